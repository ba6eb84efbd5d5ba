"""``ManagerRuntime``: executes what ``ManagerState`` decides. Persists the state, installs maps
on the servers, copies blocks, watches leases.

Every change of the state goes through ``change()``: it runs a decision under the lock,
persists the state when the epoch moved (or a persisted field changed, ``state.unsaved``),
installs the new map on every live server (InstallShardMap, in parallel, in epoch order) and
only then makes it visible to clients (GetShardMap / WatchShardMap). A server that misses an
install catches up from its next heartbeat.

Maps travel as changes where the receiver can take them (``shardps.mapdelta``): servers that
registered with ``accepts_map_changes`` are sent the changes since the previous epoch (the
whole map if they answer that they hold another one), and ``maps`` (``MapHistory``) answers
clients that name the epoch they hold.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent import futures
from dataclasses import dataclass
from itertools import chain
from typing import Callable

from shardps.errors import ShardpsError
from shardps.metrics import ManagerMetrics
from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.rpc.status import translated
from shardps.rpc.stubs import StubPool
from shardps.server.manager import moves
from shardps.server.manager.map_history import MapHistory
from shardps.server.manager.records import ManagerSettings, Move, ReplicationHealth, ServerState
from shardps.server.manager.state import ManagerState
from shardps.server.manager.store import StateFile, StateStore

log = logging.getLogger("shardps.manager")
SLOW_INSTALL_SECONDS = 0.5    # a map install slower than this is logged


def _installed(metrics: ManagerMetrics, epoch: int, took: float, servers: int, last: str) -> None:
    """Count a map's install on the servers; log one slower than ``SLOW_INSTALL_SECONDS``
    (clients are shown the map only after every server has it)."""
    metrics.install_seconds.observe(took)
    if took > SLOW_INSTALL_SECONDS:
        log.warning("epoch %d took %.2f s to install on %d servers (the last: %s); clients "
                    "were shown it after that", epoch, took, servers, last)


@dataclass(frozen=True)
class RuntimeSettings:
    state_path: str = ""                 # empty: state lives in memory only
    install_timeout: float = 3.0
    reconcile_interval: float = 0.2
    copy_timeout: float = 60.0


class ManagerRuntime:
    """Owns the state, its lock and every side effect. Thread-safe."""

    def __init__(self, settings: ManagerSettings = ManagerSettings(),
                 runtime: RuntimeSettings = RuntimeSettings(), metrics: ManagerMetrics | None = None,
                 pool: StubPool | None = None, clock=time.monotonic, store: StateStore | None = None):
        """``store``: where the state persists (``exists`` / ``load`` / ``save``: an
        ``EtcdStore``); default: the file ``runtime.state_path``, or none."""
        self.settings = settings
        self.runtime = runtime
        self.metrics = metrics or ManagerMetrics()
        self.pool = pool or StubPool()
        self.now = clock
        self.lock = threading.RLock()
        # Held while blocks move (plan, copy, commit) and while a restore loads its blocks: a
        # restored block must not be copied before its values are loaded. Order: moves_lock
        # before lock.
        self._in_flight = 0                 # moves of the batch being copied (pending_moves)
        self.moves_lock = threading.Lock()
        self._store: StateStore | None = store if store is not None else (
            StateFile(runtime.state_path) if runtime.state_path else None)
        if self._store is not None and self._store.exists():
            self.state = self._store.load(settings, self.now())
            log.info("manager state loaded from %s: epoch %d, %d servers, %d tables, %d jobs",
                     self._store.path, self.state.epoch, len(self.state.servers),
                     len(self.state.tables), len(self.state.jobs))
        else:
            self.state = ManagerState(settings)
        moves.index(self.state)         # which server holds which block: a death touches its own
        self._publish_lock = threading.Lock()
        self._published = self.state.shard_map()
        self._published_cond = threading.Condition()
        self.maps = MapHistory(self._published, self.metrics)     # changes instead of whole maps
        self._save_failed = False           # the last save raised: memory is ahead of the store
        self._publish_pending = False       # ... and its map was not published
        self._executor = futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="install")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._planned_epoch = -1
        self._pending: tuple[moves.PlanInput, list[Move]] | None = None   # the plan's rest
        # (epoch, primaries, replicas held per server, blocks, health) for the gauges
        self._counted: tuple[int, Counter[str], Counter[str], int, ReplicationHealth] = (
            -1, Counter(), Counter(), 0, ReplicationHealth(settings.replication, 0, 0, 0))
        self._last_tick = self.now()
        self.last_recovery: dict = {}
        self._loss_counted: dict[tuple[str, str], int] = {}     # loss_counts already counted
        # run at the end of every reconcile round, without the locks (the checkpoint
        # coordinator's restore of lost blocks)
        self.after_tick: list[Callable[[], None]] = []
        self._update_metrics()

    # ------------------------------------------------------------------ change + publish
    def change(self, fn, *args, wait_published: bool = True, **kwargs):
        """Run ``fn(state, *args)`` under the lock; if the epoch moved, persist and publish;
        if only a persisted field changed (``state.unsaved``), persist.

        With ``wait_published`` (read-your-writes), a call that changed nothing while another
        caller's change is being installed waits for that change to be published.

        Nothing is acknowledged that is not persisted: after a failed save the state in
        memory is ahead of the store, so every later call saves again before it returns
        (an idempotent retry that changes nothing included) and raises while that fails."""
        with self.lock:
            before = self.state.epoch
            result = fn(self.state, *args, **kwargs)
            after = self.state.epoch
            changed = after != before or self._publish_pending
            persist = changed or self.state.unsaved or self._save_failed
            self.state.unsaved = False
            msg = self.state.shard_map() if changed else None
            if persist and self._store is not None:
                self._save_failed = self._publish_pending = True
                self._store.save(self.state)
                self._save_failed = False
            self._publish_pending = False
        if msg is not None:                 # the map changed
            self.publish(msg)
        elif wait_published and self._published.epoch < after:
            # read-your-writes: another caller's change is being installed; wait for it
            self.wait_published(after, timeout=self.runtime.install_timeout * 2)
        return result

    def publish(self, msg: pb.ShardMap) -> None:
        """Install ``msg`` on every live server (as its changes since the previous epoch
        where the server takes them), then show it to clients."""
        with self._publish_lock:
            prev = self._published
            if msg.epoch <= prev.epoch:
                return
            started = self.now()
            targets = [s for s in msg.servers if s.state != pb.DEAD]
            changes, whole = self.maps.install_requests(prev, msg, targets)
            jobs = {self._executor.submit(self.maps.install, self.pool.get(s.address), s.address,
                                          changes if s.name in self.maps.accepts else whole, whole,
                                          self.runtime.install_timeout, self.pool.metadata): s.name
                    for s in targets}
            slowest = ""
            for fut in futures.as_completed(jobs):
                slowest = jobs[fut]
                err = fut.exception()
                if err is not None:
                    log.warning("epoch %d not installed on %s yet (%s); it catches up from its "
                                "next heartbeat", msg.epoch, jobs[fut], err)
            _installed(self.metrics, msg.epoch, self.now() - started, len(jobs), slowest)
            with self._published_cond:
                self._published = msg
                self.maps.remember(msg)
                self._published_cond.notify_all()
        self._update_metrics()

    @property
    def published(self) -> pb.ShardMap:
        return self._published

    @property
    def stopping(self) -> bool:
        """Whether ``stop()`` was called (long polls end)."""
        return self._stop.is_set()

    def wait_published(self, min_epoch: int, timeout: float | None) -> pb.ShardMap:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._published_cond:
            while self._published.epoch < min_epoch:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._published_cond.wait(timeout=remaining if remaining is not None else 1.0)
            return self._published

    # ------------------------------------------------------------------ background work
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="reconcile", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._published_cond:
            self._published_cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.pool.close()

    def _loop(self) -> None:
        while not self._stop.wait(self.runtime.reconcile_interval):
            try:
                self.tick()
            except Exception:
                log.exception("reconcile tick failed; retrying")

    def tick(self) -> None:
        """One round: expire leases, move blocks toward the planned placement, retire drained.

        The plan is made from a snapshot without the lock (``plan``) and used only if the
        placement it was made for still holds (``moves.still_valid``); else the next round
        plans again."""
        if not self._judge_leases():
            return
        if not self.moves_lock.acquire(blocking=False):
            return                  # a restore is loading blocks: move them on a later round
        try:
            batch = self._next_batch()
            if batch is None:
                return
            if batch:
                self._in_flight = len(batch)
                try:
                    done, copied_to = self._execute(batch)
                    if done:
                        n = self.change(lambda s: s.commit_moves(done, self.now(), copied_to))
                        self.metrics.moves.inc(n)
                finally:
                    self._in_flight = 0
            self.change(lambda s: s.retire_drained())
            self.change(lambda s: s.replace_lost())
        finally:
            self.moves_lock.release()
        for fn in self.after_tick:
            fn()

    def _judge_leases(self) -> bool:
        """Declare dead every server and worker whose lease expired. False, judging nothing, when
        the loop stalled since it last judged (a slow disk, a starved process: heartbeats queued
        meanwhile are not counted yet); planning and copies do not count as stalls."""
        now = self.now()
        stalled = now - self._last_tick > max(1.0, 5 * self.runtime.reconcile_interval)
        self._last_tick = now
        if stalled:
            log.warning("reconcile loop stalled; this round is skipped (leases are judged on the next)")
            return False
        changed = self.change(lambda s: s.expire(now))
        if not changed:
            self._update_metrics()
        if any(c.startswith("server:") for c in changed):
            self.metrics.failovers.inc(sum(1 for c in changed if c.startswith("server:")))
            self.last_recovery = {"declared_dead_at": now, "what": changed}
        return True

    @property
    def pending_moves(self) -> int:
        """Block moves planned and not committed yet (being copied, or waiting for a
        later batch of the current plan)."""
        pending = self._pending
        return self._in_flight + (len(pending[1]) if pending is not None else 0)

    def _next_batch(self) -> list[Move] | None:
        """The next ``move_batch_blocks`` moves: from the last plan while the placement it
        was made for still holds (``moves.still_valid``; our own commits keep it), else from
        a new plan, made without the lock. None: nothing to do this round (the placement
        was planned and needs nothing, or it changed while planning: plan again next round)."""
        limit = self.settings.move_batch_blocks
        with self.lock:
            if self._pending is not None and moves.still_valid(self.state, self._pending[0]):
                snap, planned = self._pending
                self._pending = (snap, planned[limit:]) if planned[limit:] else None
                return planned[:limit]
            self._pending = None
            if self.state.epoch == self._planned_epoch:
                return None
            snap = moves.snapshot(self.state)
        started = self.now()
        planned = self.plan(snap)           # without the lock: heartbeats and joins go on
        took = self.now() - started
        self._last_tick += took             # nor is it a stall of the loop (see tick)
        with self.lock:
            if not moves.still_valid(self.state, snap):
                log.info("placement changed while planning (epoch %d -> %d); planning again",
                         snap.epoch, self.state.epoch)
                return None
            if not planned:
                self._planned_epoch = snap.epoch
                return []
            self._pending = (snap, planned[limit:]) if planned[limit:] else None
        log.info("planned %d block moves in %.2fs (epoch %d)", len(planned), took, snap.epoch)
        return planned[:limit]

    def plan(self, snap: moves.PlanInput) -> list[Move]:
        """Every move toward the placement planned for ``snap`` (restoring R first); runs
        without the lock, and is used in batches while the placement holds."""
        return moves.plan_from(snap)

    def _execute(self, planned: list[Move]) -> tuple[list[Move], dict[str, int]]:
        """Copy blocks (grouped by source and destination); returns the moves whose copies
        all succeeded, and the incarnations copied to. Moves to a server that is not yet
        serving its incarnation wait for a later round (``moves.copy_destinations``)."""
        with self.lock:
            epoch = self.state.epoch
            address = {n: s.address for n, s in self.state.servers.items()}
            copied_to = moves.copy_destinations(self.state)
        planned = [m for m in planned if all(n in copied_to for n in m.add)]
        failed: set[Move] = set()
        metadata = self.pool.metadata

        def copy(source: str, dst: str, items: list[Move]) -> None:
            try:
                with translated("CopyBlocks"):
                    self.pool.get(address[source]).CopyBlocks(
                        _copy_request(epoch, dst, items), timeout=self.runtime.copy_timeout, metadata=metadata)
            except ShardpsError as err:
                log.warning("copying %d blocks %s -> %s failed: %s", len(items), source, dst, err.message)
                failed.update(items)

        running = {self._executor.submit(copy, src, dst, items) for (src, dst), items in _by_route(planned).items()}
        # a copy held up by a server that stopped answering must not hold up its failover
        while running := futures.wait(running, timeout=self.runtime.reconcile_interval).not_done:
            self._judge_leases()
        done = [m for m in planned if m not in failed]
        if done:
            log.info("copied %d blocks to their new replicas", len(done))
        return done, copied_to

    # ------------------------------------------------------------------ metrics
    def _update_metrics(self) -> None:
        """Set the gauges. Per-block counts are recounted only when the epoch moved (every
        placement change bumps it), from references taken under the lock and counted
        without it: at a million blocks a count is a fraction of a second."""
        with self.lock:
            st = self.state
            now = self.now()
            epoch = st.epoch
            servers = [(r.name, r.state, r.live, r.last_heartbeat, r.bytes) for r in st.servers.values()]
            workers = [(job.name, len(job.members)) for job in st.jobs.values()]
            snap = moves.snapshot(st) if epoch != self._counted[0] else None
            candidates = len(st.candidates())
        if snap is not None:
            replicas = snap.replicas
            primaries = Counter(reps[0] for reps in replicas if reps)
            held = Counter(chain.from_iterable(replicas))
            r = self.settings.replication
            under = sum(1 for reps in replicas if len(reps) < r)
            lost = sum(1 for t in snap.tables for b in t.blocks if b.lost_epoch)
            health = ReplicationHealth(r, candidates, under, under if candidates < r else 0, lost)
            self._counted = (epoch, primaries, held, len(replicas), health)
        _set_gauges(self.metrics, epoch, servers, workers, self._counted, now)
        with self.lock:
            counts = dict(self.state.loss_counts)
        _count_losses(self.metrics, counts, self._loss_counted)

    def refresh_metrics(self) -> None:
        self._update_metrics()


def _by_route(planned: list[Move]) -> dict[tuple[str, str], list[Move]]:
    """Moves by (source, destination): one CopyBlocks call each."""
    groups: dict[tuple[str, str], list[Move]] = {}
    for m in planned:
        for dst in m.add:
            groups.setdefault((m.source, dst), []).append(m)
    return groups


def _copy_request(epoch: int, dst: str, items: list[Move]) -> ps.CopyBlocksRequest:
    request = ps.CopyBlocksRequest(epoch=epoch, destination=dst)
    for m in items:
        request.blocks.add(job=m.job, table=m.table, block=m.block)
    return request


def _count_losses(m: ManagerMetrics, counts: dict[tuple[str, str], int], counted: dict) -> None:
    """Advance the lost / recovered block counters to ``ManagerState.loss_counts``."""
    for (what, job), n in counts.items():
        seen = counted.get((what, job), 0)
        if n > seen:
            counter = m.blocks_lost.labels(job) if what == "lost" else m.blocks_recovered.labels(job, what)
            counter.inc(n - seen)
            counted[(what, job)] = n


def _set_gauges(m: ManagerMetrics, epoch: int, servers: list, workers: list, counted: tuple,
                now: float) -> None:
    """The manager's gauges from what ``ManagerRuntime._update_metrics`` took and counted."""
    _, primaries, held, nblocks, health = counted
    m.epoch.set(epoch)
    counts = {s: 0 for s in ServerState}
    for _, state, _, _, _ in servers:
        counts[state] += 1
    for state, n in counts.items():
        m.servers.labels(state.name).set(n)
    for name, _, live, last_heartbeat, nbytes in servers:
        m.server_up.labels(name).set(1 if live else 0)
        m.heartbeat_age.labels(name).set(max(0.0, now - last_heartbeat))
        m.server_blocks.labels(name, "primary").set(primaries.get(name, 0))
        m.server_blocks.labels(name, "backup").set(held.get(name, 0) - primaries.get(name, 0))
        m.server_bytes.labels(name).set(nbytes)
    m.blocks.set(nblocks)
    m.set_replication(health)
    for job, n in workers:
        m.workers.labels(job).set(n)
