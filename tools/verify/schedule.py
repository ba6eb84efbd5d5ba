"""Seeded fault schedules: episodes of faults, each ending with the cluster whole again.

An episode is drawn from the seed (kind, victims, delays), so a seed replays the same
sequence of faults; timings follow the cluster (an episode waits for re-replication before
its next fault, so no block ever has more than R - 1 replicas down). Kinds:

* ``kill``: kill -9 a server; wait until R is restored on the others; restart it.
* ``double-kill``: kill -9 a server; wait until R is restored and every workload had a push
  acknowledged since (the cluster serves again: faults in sequence, not at once); kill -9 a
  second one (a copy destination of the first's blocks); hold both down for longer than the
  gap limit (the survivors must serve while the second stays dead, not only once it is
  back); restart both.
* ``pause``: SIGSTOP a server for longer than the lease (it is declared dead and failed
  over); SIGCONT it (fenced, it rejoins empty and blocks are copied back).
* ``restart-during-copy``: restart a server; while blocks are being copied to it, kill -9 it
  and start it again.
* ``manager``: kill -9 the manager (with ``--managers``: the leading replica); pushes go on;
  start it again (it reloads its state; a replica follows the leader elected meanwhile).
* ``etcd-partition`` (with ``--managers`` only): cut the leading replica's link to etcd for a
  while (it stays reachable to everyone else: it resigns and a follower takes over), heal.

The first server (``s0``) is never a victim: it is the RSS witness, alive for the whole run.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from shardps.tools.verify.cluster import VerifyCluster, placement

KINDS = ("kill", "double-kill", "pause", "restart-during-copy", "manager")
REPLICA_KINDS = ("etcd-partition",)           # need manager replicas on etcd


@dataclass
class Episode:
    kind: str
    victims: list[str]
    delay: float                               # kind-specific (hold, pause, downtime) in seconds
    quiet: float                               # seconds of calm after it
    started: float = 0.0                       # monotonic
    ended: float = 0.0
    restore_seconds: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return f"{self.kind}({','.join(self.victims) or 'manager'}, {self.delay:.1f}s)"


def draw(seed: int, count: int, victims: list[str], lease: float, kinds=KINDS,
         gap_limit: float = 5.0) -> list[Episode]:
    """``count`` episodes of ``seed``: every kind once in a seeded order, then at random."""
    rng = random.Random(seed)
    order: list[str] = []
    if not kinds:
        return []
    while len(order) < count:
        round_ = list(kinds)
        rng.shuffle(round_)
        order += round_
    out = []
    for kind in order[:count]:
        two = rng.sample(victims, 2) if len(victims) >= 2 else victims * 2
        if kind == "double-kill":
            ep = Episode(kind, two, gap_limit + rng.uniform(1.0, 3.0), rng.uniform(1.0, 3.0))
        elif kind == "pause":
            ep = Episode(kind, two[:1], lease + rng.uniform(1.0, 2.0), rng.uniform(1.0, 3.0))
        elif kind in ("manager", "etcd-partition"):
            ep = Episode(kind, [], rng.uniform(1.0, 3.0), rng.uniform(1.0, 3.0))
        else:
            ep = Episode(kind, two[:1], rng.uniform(0.0, 0.5), rng.uniform(1.0, 3.0))
        out.append(ep)
    return out


class Aborted(Exception):
    """The run was stopped (fail-fast) in the middle of an episode."""


class Executor:
    """Runs episodes on a cluster; ``status`` is a PSClient used for ClusterStatus."""

    def __init__(self, cluster: VerifyCluster, status, stop: threading.Event,
                 restore_timeout: float = 30.0, served: Callable[[float], bool] | None = None):
        """``served(t)``: whether every workload had a push acknowledged after monotonic
        time ``t`` (None: not asked)."""
        self.cluster, self.status, self.stop = cluster, status, stop
        self.restore_timeout = restore_timeout
        self.served = served

    def wait_served(self, since: float, timeout: float = 10.0) -> None:
        """Until every workload had a push acknowledged after ``since`` (at most ``timeout``
        seconds: a longer wait is the gap check's to judge)."""
        deadline = time.monotonic() + timeout
        while self.served is not None and not self.served(since) and time.monotonic() < deadline:
            self.sleep(0.05)

    def sleep(self, seconds: float) -> None:
        if self.stop.wait(seconds):
            raise Aborted()

    def wait_restored(self, ep: Episode, what: str, expect_serving: list[str] | None = None) -> bool:
        """Wait until no block is under-replicated and no move is pending (and, if given,
        exactly ``expect_serving`` serve); record the time or a failure."""
        started = time.monotonic()
        deadline = started + self.restore_timeout
        last: object = None
        while time.monotonic() < deadline:
            try:
                last = placement(self.status)
                serving_ok = expect_serving is None or last.serving == sorted(expect_serving)
                if serving_ok and last.under_replicated == 0 and last.pending_moves == 0:
                    ep.restore_seconds.append(time.monotonic() - started)
                    return True
            except Exception as exc:        # the manager may be starting: keep asking
                last = exc
            self.sleep(0.1)
        ep.failures.append(f"R not restored {self.restore_timeout:.0f}s after {what}: {last}")
        return False

    def run(self, ep: Episode) -> None:
        ep.started = time.monotonic()
        try:
            getattr(self, "_" + ep.kind.replace("-", "_"))(ep)
        finally:
            ep.ended = time.monotonic()

    def _kill(self, ep: Episode) -> None:
        (v,) = ep.victims
        self.cluster.kill(v)
        self.wait_restored(ep, f"kill -9 {v}", self.cluster.live())
        self.cluster.restart(v)
        self.wait_restored(ep, f"restart of {v}", self.cluster.live())

    def _double_kill(self, ep: Episode) -> None:
        a, b = ep.victims
        self.cluster.kill(a)
        self.wait_restored(ep, f"kill -9 {a}", self.cluster.live())
        self.wait_served(time.monotonic())
        self.cluster.kill(b)
        second = time.monotonic()
        if len(self.cluster.live()) >= self.cluster.replication:
            self.wait_restored(ep, f"kill -9 {b} after {a}", self.cluster.live())
        self.sleep(max(0.0, second + ep.delay - time.monotonic()))     # both down this long
        self.cluster.restart(a)
        self.cluster.restart(b)
        self.wait_restored(ep, f"restart of {a} and {b}", self.cluster.live())

    def _pause(self, ep: Episode) -> None:
        (v,) = ep.victims
        self.cluster.pause(v)
        try:
            self.sleep(ep.delay)
        finally:
            self.cluster.resume(v)
        self.wait_restored(ep, f"SIGSTOP {v} for {ep.delay:.1f}s, SIGCONT", self.cluster.live())

    def _restart_during_copy(self, ep: Episode) -> None:
        (v,) = ep.victims
        self.cluster.restart(v)             # a new incarnation: the manager copies blocks to it
        deadline = time.monotonic() + ep.delay      # kill at the first pending move seen, or then
        in_flight = False
        while not in_flight and time.monotonic() < deadline:
            try:
                in_flight = placement(self.status, timeout=1.0).pending_moves > 0
            except Exception:
                pass
        ep.notes.append("copy in flight at the kill" if in_flight else "no pending move seen at the kill")
        self.cluster.kill(v)
        self.wait_restored(ep, f"kill -9 {v} during its copies", self.cluster.live())
        self.cluster.restart(v)
        self.wait_restored(ep, f"restart of {v}", self.cluster.live())

    def _manager(self, ep: Episode) -> None:
        self.cluster.kill_manager()
        self.sleep(ep.delay)
        self.cluster.start_manager()
        self.wait_restored(ep, "manager restart", self.cluster.live())

    def _etcd_partition(self, ep: Episode) -> None:
        self.cluster.cut_leader_from_etcd()
        try:
            self.sleep(ep.delay)
        finally:
            self.cluster.heal_etcd()
        self.wait_restored(ep, "the leader cut off from etcd, healed", self.cluster.live())

    def heal(self, ep: Episode) -> None:
        """After an abort: every server and the manager up again."""
        for name in list(self.cluster.paused):
            self.cluster.resume(name)
        self.cluster.heal_etcd()
        if not self.cluster.managers_alive():
            self.cluster.start_manager()
        for name in list(self.cluster.down):
            self.cluster.restart(name)
