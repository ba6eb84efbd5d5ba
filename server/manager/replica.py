"""One manager replica of several sharing their state in etcd (``shardps manager --etcd``).

Every replica listens and campaigns (``leader.LeaderElection``). The leader loads the state
from etcd (``EtcdStore``; leases restart then, plus ``TAKEOVER_GRACE_SECONDS``: every server
and worker gets a full lease to reach it, even from a heartbeat stuck on a hung leader),
builds a term (``ManagerRuntime``, its reconcile loop and the gRPC
service over it, through ``build_term``) and serves. Every change it acknowledges was first
written to etcd in a transaction fenced by its leadership, so a new leader starts from every
acknowledged change (tables, jobs, joins, epochs).

Followers serve nothing of ``shardps.v1.ResourceManager``: their ``LeaderGate``
(``shardps.rpc.failover``) refuses every call with UNAVAILABLE, "not the leader", and the
trailing metadata ``x-shardps-leader`` naming the leader's address ("" while an election is
under way). A refused call was not executed, so any client may send it again to the leader;
clients built on ``shardps.rpc.failover`` (given the managers' addresses, comma-separated) do
so at once. Health: the overall service ("") is SERVING on every replica that runs
(liveness), ``shardps.v1.ResourceManager`` only on the leader (readiness: a Kubernetes
Service routes to the leader alone).

A leader that loses its lease, or cannot write to etcd, drops its term (the state in memory
is discarded, the reconcile loop stopped) and campaigns again.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Protocol

from shardps.rpc.failover import LeaderGate
from shardps.rpc.status import Handler
from shardps.server.manager.etcd_store import EtcdClient, EtcdStore
from shardps.server.manager.leader import LeaderElection

log = logging.getLogger("shardps.manager")

# A new leader judges no lease before a full lease plus this: the longest a server's or a
# worker's heartbeat may stay stuck on a leader that hangs rather than dies (their 5 s call
# timeout; then their channel moves on, shardps/rpc/failover.py) and one more heartbeat.
TAKEOVER_GRACE_SECONDS = 6.0


class Term(Protocol):
    """What a leader runs while it leads: the gRPC handler of the manager's service."""

    handler: Handler

    def stop(self) -> None: ...


class ManagerReplica:
    """Campaigns, and runs a term while it leads. ``build_term(store)`` makes the term from
    the state in ``store`` (blocking until it serves); ``on_role(leading)`` is told every
    change of role (health). ``gate``: the handler to route through (default: a new one,
    ``self.gate``). Thread-safe."""

    def __init__(self, client: EtcdClient, prefix: str, address: str, service: str,
                 build_term: Callable[[EtcdStore], Term], *, ttl: int = 2, poll: float = 0.1,
                 gate: LeaderGate | None = None, on_role: Callable[[bool], None] = lambda leading: None):
        self.client = client
        self.prefix = prefix.rstrip("/")
        self.build_term = build_term
        self.on_role = on_role
        self.election = LeaderElection(client, self.prefix, address, ttl=ttl, poll=poll,
                                       on_elected=self._elected, on_deposed=self._deposed)
        self.gate = gate if gate is not None else LeaderGate(service, lambda: "")
        self.gate.leader_address = lambda: self.election.leader_address
        self._term: Term | None = None
        self._lock = threading.Lock()
        self.elected_at = 0.0            # time.monotonic() of the last take-over (0: never)

    @property
    def leading(self) -> bool:
        return self.gate.current is not None

    def start(self) -> "ManagerReplica":
        self.election.start()
        return self

    def stop(self) -> None:
        """Stop campaigning; a leader drops its term and resigns (a follower takes over)."""
        self.election.stop(resign=True)
        self._deposed()
        self.client.close()

    def _elected(self, identity: str) -> None:
        started = time.monotonic()
        store = EtcdStore(self.client, self.prefix, guard=(self.election.key, identity),
                          on_failure=self._store_failed, grace=TAKEOVER_GRACE_SECONDS)
        term = self.build_term(store)
        with self._lock:
            self._term = term
            self.gate.current = term.handler
            self.elected_at = time.monotonic()
        log.info("leading: state loaded from etcd and serving in %.2fs", time.monotonic() - started)
        self.on_role(True)

    def _deposed(self) -> None:
        with self._lock:
            term, self._term = self._term, None
            self.gate.current = None
        if term is None:
            return
        self.on_role(False)
        term.stop()
        log.info("following: the term's state and loops are dropped")

    def _store_failed(self, exc: Exception) -> None:
        log.warning("the state could not be written to etcd (%s): resigning, a leader reloads it", exc)
        self.election.resign()
