"""A client's place in its job's worker group: join, leave, the heartbeat thread, and the
numbers that make pushes exactly-once.

* ``Session`` holds the membership (session, incarnation, rank) and the push sequence
  numbers: every push of a member carries ``(session, incarnation, sequence)`` and
  ``acked_below`` (every sequence below it finished: the servers may forget them), so a
  retried push is applied once. Pure state, no I/O.
* ``GroupMember`` makes the manager calls of a member: join / leave / heartbeat (a daemon
  thread, about once a second, that keeps the lease, reports ``progress`` and rejoins when
  the lease was lost), and its part of checkpoints.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Callable

from shardps.errors import FailedPrecondition, NotFound, ShardpsError
from shardps.group import Heartbeat
from shardps.messages import Header
from shardps.rpc import group
from shardps.worker.client.admin import Admin

log = logging.getLogger("shardps.client")


@dataclass(frozen=True)
class Membership:
    """This client's place in its job's worker group. ``world_size``: the group's live
    members, and at least ``launched``, the processes its launcher started (torchrun's and
    ``shardps run``'s ``WORLD_SIZE``), so the first rank to join does not see 1.
    ``previous_step``: the steps this rank had completed before it was started again (its last
    heartbeat's report, about once a second; 0 for a new rank): a restarted loop goes on from
    there instead of pushing its earlier batches again."""

    rank: int
    session: str
    incarnation: int
    world_size: int
    restored: bool = False
    client: bool = False        # a client's session outside the group (no rank): see open_client
    previous_step: int = 0
    launched: int = 0


class Session:
    """The membership and the exactly-once sequence numbers of one client. Thread-safe.

    Sequence numbers start at 1 for each membership. A push takes its number once
    (``begin_push``) and keeps it across retries; ``end_push`` marks it finished, successful
    or not. A client that is not a member gets a session of its own at its first push
    (``opener``: ``GroupMember.open_client``), so every push is deduplicated."""

    def __init__(self, opener: Callable[[], object] | None = None):
        self._lock = threading.Lock()
        self._open_lock = threading.Lock()
        self._membership: Membership | None = None
        self._next_seq = 1
        self._in_flight: set[int] = set()
        self.opener = opener

    @property
    def membership(self) -> Membership | None:
        return self._membership

    def start(self, membership: Membership) -> None:
        """A new membership (join or rejoin): sequence numbers start again at 1."""
        with self._lock:
            self._membership = membership
            self._next_seq, self._in_flight = 1, set()

    def update(self, membership: Membership | None) -> None:
        """The same session with a new rank or world size (or None: left the group)."""
        with self._lock:
            self._membership = membership

    def begin_push(self) -> int:
        """The sequence number of a new push; opens a client session first when this client
        has none (0 only without an ``opener``: not deduplicated)."""
        if self._membership is None and self.opener is not None:
            with self._open_lock:               # one opener at a time; the others find it open
                if self._membership is None:
                    self.opener()
        with self._lock:
            seq = self._next_seq if self._membership is not None else 0
            if seq:
                self._next_seq += 1
                self._in_flight.add(seq)
            return seq

    def end_push(self, seq: int) -> None:
        if seq:
            with self._lock:
                self._in_flight.discard(seq)

    def header(self, job: str, epoch: int, sequence: int, clock: int, wire_dtype: int) -> Header:
        """The request header of one attempt of a data call."""
        m = self._membership
        if m is None:
            return Header(job, epoch, "", 0, sequence, 0, clock, wire_dtype)
        with self._lock:
            acked_below = min(self._in_flight) if self._in_flight else self._next_seq
        return Header(job, epoch, m.session, m.incarnation, sequence, acked_below, clock, wire_dtype)


def after_heartbeat(m: Membership, resp: Heartbeat) -> Membership:
    """The membership a heartbeat reply leaves (rank and world size may change)."""
    if m.client:
        return m
    world_size = max(int(resp.world_size), m.launched)
    if world_size != m.world_size or resp.rank != m.rank:
        return dataclasses.replace(m, rank=resp.rank, world_size=world_size)
    return m


class GroupMember:
    """The worker-group calls of one client. Blocking calls take ``timeout=`` and raise
    ``ShardpsError``; thread-safe, except that ``join`` and ``leave`` should not race each
    other. ``progress`` (step, samples_per_second, loss) is reported by each heartbeat;
    ``checkpoint_request`` is the id of an on-demand checkpoint the last heartbeat announced
    (empty when none)."""

    def __init__(self, admin: Admin, session: Session):
        self.admin = admin
        self.job = admin.job
        self.session = session
        self.progress = {"step": 0, "samples_per_second": 0.0, "loss": 0.0}
        self.completed: Callable[[], int] = lambda: 0      # steps the data path saw completed
        self.checkpoint_request = ""
        self._heartbeat: threading.Thread | None = None
        self._heartbeat_every = 1.0
        self._stop = threading.Event()       # stops the heartbeat loop

    @property
    def membership(self) -> Membership | None:
        return self.session.membership

    def join(self, name: str = "", rank_hint: int = -1, previous_session: str = "",
             heartbeat: bool = True, timeout: float | None = None, launched: int = 0) -> Membership:
        """Join the job's worker group (waits for the shard map that lists this member);
        starts the heartbeat thread unless ``heartbeat`` is False or it runs already.
        ``launched``: the processes the launcher started (``Membership.launched``)."""
        self.close_client()                  # a client's own session gives way to the member's
        a = self.admin
        resp = group.join(a, self.job, name, rank_hint, previous_session, timeout=timeout)
        m = Membership(resp.rank, resp.session, resp.incarnation, max(resp.members, launched),
                       resp.restored, previous_step=resp.step, launched=launched)
        self.session.start(m)
        a.refresh_map(min_epoch=resp.epoch)
        if heartbeat:
            self._start_heartbeats(resp.heartbeat_seconds)
        return m

    def open_client(self, timeout: float | None = None) -> Membership:
        """A session for this client outside the worker group (its pushes are deduplicated
        like a member's), kept by the heartbeat thread; ``Session.begin_push`` calls this at
        the first push of a client that did not join."""
        resp = group.join(self.admin, self.job, client=True, timeout=timeout)
        m = Membership(resp.rank, resp.session, resp.incarnation, resp.members, client=True)
        self.session.start(m)
        # no map refresh: the servers installed the map naming the session before this
        # returned, and a push routed with an older map is refused and re-routed as always
        self._start_heartbeats(resp.heartbeat_seconds)
        return m

    def _start_heartbeats(self, every: float) -> None:
        if self._heartbeat is None or self._stop.is_set():
            self._stop = threading.Event()          # a stopped loop keeps its own, set
            self._heartbeat_every = every or 1.0
            self._heartbeat = threading.Thread(target=self._heartbeat_loop, args=(self._stop,),
                                               name="ps-heartbeat", daemon=True)
            self._heartbeat.start()

    def close_client(self, timeout: float = 0.5) -> None:
        """End this client's own session, if it has one (best effort: it expires anyway)."""
        m = self.membership
        if m is None or not m.client:
            return
        self.session.update(None)
        try:
            group.leave(self.admin, self.job, m.session, timeout=timeout)
        except ShardpsError as exc:
            log.debug("ending client session %s failed (it expires by itself): %s", m.session, exc.message)

    def leave(self, timeout: float | None = None) -> None:
        """Stop heartbeats and leave the group (SYNC/SSP groups stop waiting for this
        worker). A client that is not a member only stops its heartbeats (and ends its own
        session)."""
        m = self.membership
        self._stop.set()
        if m is not None:
            group.leave(self.admin, self.job, m.session, self.steps(), timeout, idempotent=True)
            self.session.update(None)

    def steps(self) -> int:
        """The steps this worker completed: its reported progress, or the clock of its pushes."""
        return max(int(self.progress["step"]), self.completed())

    def heartbeat(self, timeout: float | None = None) -> Heartbeat:
        """One heartbeat now (the thread sends them by itself). FailedPrecondition when not a
        member; NotFound when the manager no longer knows this session (lease expired)."""
        m = self.membership
        if m is None:
            raise FailedPrecondition("not a member of a worker group: call join() first")
        a = self.admin
        resp = group.heartbeat(a, self.job, m.session, m.incarnation, self.steps(),
                               float(self.progress["samples_per_second"]), float(self.progress["loss"]),
                               timeout or 5.0)
        self.checkpoint_request = resp.checkpoint_id
        updated = after_heartbeat(m, resp)
        if updated is not m:
            self.session.update(updated)
        if resp.epoch > a.shard_map.epoch:
            a.refresh_map()
        return resp

    def _heartbeat_loop(self, stop: threading.Event) -> None:
        while not stop.wait(self._heartbeat_every):
            try:
                self.heartbeat()
            except NotFound as exc:
                m = self.membership
                if m is not None and m.client:
                    log.warning("client session lost (%s): the next push opens another", exc.message)
                    self.session.update(None)
                    continue
                log.error("worker membership lost (%s): rejoining", exc.message)
                try:
                    m = self.membership
                    self.join(previous_session=m.session if m else "", heartbeat=False)
                except ShardpsError as exc2:
                    log.error("rejoin failed: %s", exc2.message)
            except ShardpsError as exc:
                log.debug("heartbeat failed: %s", exc.message)

    def checkpoint_barrier(self, step: int, worker_state: bytes, checkpoint_id: str = "",
                           timeout: float | None = 300.0) -> str:
        """This worker's part of a checkpoint: blocks until every live worker arrived and the
        checkpoint is written; returns its path. ``checkpoint_id``: ``step-<S>`` (periodic,
        the default) or the id from ``checkpoint_request`` (on demand)."""
        m = self.membership
        if m is None:
            raise FailedPrecondition("checkpoint_barrier needs a group member: call join() first")
        path = group.checkpoint_barrier(self.admin, self.job, m.session, step, worker_state,
                                        checkpoint_id or f"step-{step}", timeout)
        if checkpoint_id and checkpoint_id == self.checkpoint_request:
            self.checkpoint_request = ""
        return path

    def worker_state(self, timeout: float | None = None, latest: bool = False,
                     rank: int | None = None) -> tuple[bytes, int]:
        """This rank's (or ``rank``'s) local state from the checkpoint the job was restored
        from (``latest``: from the job's latest checkpoint), and its step."""
        m = self.membership
        if m is None:
            raise FailedPrecondition("worker_state needs a group member: call join() first")
        return group.worker_state(self.admin, self.job, m.rank if rank is None else rank, latest, timeout)

    def close(self) -> None:
        """Stop the heartbeat thread (waits up to 5 s for it) and end a client's own session.
        Does not leave the group."""
        self.close_client()
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
