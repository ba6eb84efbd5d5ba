"""Leader election of manager replicas through an etcd lease.

Every replica campaigns for the leader key ``{prefix}/leader``: it grants itself a lease of
``ttl`` seconds and creates the key, attached to the lease, in a transaction that applies only
when the key is absent. The one that created it leads while it renews the lease (every
``ttl / 4``); the key then holds its identity and the address clients should call. When the
leader dies (kill -9, a lost machine, a partition from etcd), its lease expires after ``ttl``
seconds, etcd deletes the key, and the next follower to poll (every ``poll`` seconds)
creates it. A new leader is thus elected within about ``ttl + poll`` seconds (etcd rounds
``ttl`` up to its minimum, about 2 s with its default election timeout).

A leader that cannot renew its lease for ``0.75 * ttl`` seconds (etcd unreachable) steps down
before the lease can have expired: two replicas never both believe they lead. Writes of the
state are fenced independently (``EtcdStore.save`` compares the leader key's value), so even a
leader that has not noticed yet cannot write.

``LeaderElection`` runs the protocol on one thread and reports transitions through two
callbacks, called on that thread, in order: ``on_elected(identity)`` (return only when this
replica serves as the leader) and ``on_deposed()``.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from typing import Callable

from shardps.errors import Unavailable
from shardps.server.manager.etcd_store import EtcdClient, absent, put, value_is

log = logging.getLogger("shardps.manager")


class LeaderElection:
    """Campaign for, hold and give up ``{prefix}/leader``. Thread-safe reads of
    ``is_leader`` and ``leader_address``."""

    def __init__(self, client: EtcdClient, prefix: str, address: str, *, ttl: int = 2,
                 poll: float = 0.1, on_elected: Callable[[str], None] = lambda identity: None,
                 on_deposed: Callable[[], None] = lambda: None, clock=time.monotonic):
        self.client = client
        self.key = f"{prefix.rstrip('/')}/leader"
        self.address = address
        # unique per process start: a restarted replica is a new candidate
        self.identity = json.dumps({"address": address, "id": secrets.token_hex(8)}, sort_keys=True)
        self.ttl = ttl
        self.poll = poll
        self.on_elected = on_elected
        self.on_deposed = on_deposed
        self.now = clock
        self._lease = 0
        self._renewed_at = 0.0         # when the last successful renewal was sent
        self._leader = ""              # the leader's address as last read ("" unknown)
        self._is_leader = False
        self._stop = threading.Event()
        self._resign = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def is_leader(self) -> bool:
        return self._is_leader

    @property
    def leader_address(self) -> str:
        """The current leader's address, "" while none is known."""
        return self.address if self._is_leader else self._leader

    def start(self) -> "LeaderElection":
        self._thread = threading.Thread(target=self._run, name="leader-election", daemon=True)
        self._thread.start()
        return self

    def stop(self, resign: bool = True) -> None:
        """Stop campaigning; a leader resigns (revokes its lease: a follower takes over at
        once) unless ``resign`` is False."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._is_leader:
            self._step_down("stopping")
        if resign:
            self._give_up("stopping")

    def resign(self) -> None:
        """Give the leadership up (a follower, or this replica again, takes over with the
        state as etcd holds it): done on the election thread within ``ttl / 4`` seconds."""
        self._resign.set()

    # ------------------------------------------------------------------ the protocol
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self._resign.is_set():
                    self._resign.clear()
                    self._give_up("resigned")
                elif self._is_leader:
                    self._renew()
                else:
                    self._campaign()
            except Unavailable as exc:
                log.warning("leader election: %s", exc.message)
            except Exception:
                log.exception("leader election round failed; retrying")
            if self._is_leader and self.now() - self._renewed_at > 0.75 * self.ttl:
                self._step_down(f"lease not renewed for {self.now() - self._renewed_at:.1f}s")
            self._stop.wait(self.ttl / 4 if self._is_leader else self.poll)

    def _campaign(self) -> None:
        """One try: read the key; when absent, create it under a new lease."""
        current = self.client.get(self.key)
        if current is not None:
            self._leader = _address(current)
            return
        self._leader = ""
        lease = self.client.grant(self.ttl)
        sent = self.now()
        resp = self.client.txn([absent(self.key)], [put(self.key, self.identity, lease)])
        if not resp.get("succeeded"):
            self.client.revoke(lease)         # another replica was faster
            return
        self._lease, self._renewed_at = lease, sent
        log.info("elected leader (lease %x, ttl %ds)", lease, self.ttl)
        self._is_leader = True
        try:
            self.on_elected(self.identity)
        except Exception:
            log.exception("taking over as leader failed; resigning")
            self._give_up("could not take over")

    def _renew(self) -> None:
        sent = self.now()
        if self.client.keep_alive(self._lease) <= 0:
            self._step_down("lease expired")
            self._lease = 0
            return
        # the key may have been deleted (an operator, a compaction of a stale lease)
        resp = self.client.txn([value_is(self.key, self.identity)], [])
        if not resp.get("succeeded"):
            self._give_up("the leader key no longer holds this replica")
            return
        self._renewed_at = sent

    def _give_up(self, why: str) -> None:
        if self._is_leader:
            self._step_down(why)
        if self._lease:
            self.client.revoke(self._lease)
            self._lease = 0

    def _step_down(self, why: str) -> None:
        log.warning("no longer the leader: %s", why)
        self._is_leader = False
        try:
            self.on_deposed()
        except Exception:
            log.exception("stepping down failed")


def _address(identity: str) -> str:
    try:
        return str(json.loads(identity).get("address", ""))
    except (ValueError, AttributeError):
        return ""
