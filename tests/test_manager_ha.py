"""Manager replicas on a real etcd: kill -9 the leader during activity, and again while a
server is dead; pause the leader (cut off from etcd) and resume it; partition the leader
from etcd alone (it stays reachable to everyone else) while workers push.

Debian's ``etcd`` binary (package ``etcd-server``, installed when missing; the tests skip with
the reason when it cannot be) runs on probed loopback ports in a temporary directory. Three
``shardps manager --etcd`` processes share it; three ``shardps server`` processes and the
test's clients are given the three managers' addresses, comma-separated, and follow the
leader. Every process a test starts is killed in ``finally``.

What is measured and printed: the time from the leader's kill -9 to the first change (a
CreateJob) acknowledged by its successor (target: <= 5 s), and the time from a server's
kill -9, after a failover, until every block has R = 2 live replicas again.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from shardps.errors import ShardpsError
from shardps.protos.v1 import common_pb2 as pb
from shardps.tables import dense_table, sgd
from shardps.tools.children import child_env
from shardps.tools.netproxy import TcpProxy
from shardps.tools.verify.etcd import EtcdProcess
from shardps.worker.client import PSClient
from tests.debian import debian_binary
from tests.waiting import wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.slow]
PREFIX = "/ha-test"
FAILOVER_TARGET_SECONDS = 5.0


# ====================================================================== a real etcd
def etcd_binary() -> str:
    """The etcd binary (Debian's etcd-server, installed when missing), else skips."""
    return debian_binary("etcd", "etcd-server")


class Etcd(EtcdProcess):
    """The shared etcd helper, its leader key under this file's prefix."""

    def leader(self) -> str:            # type: ignore[override]
        return super().leader(PREFIX)


def _kill(popen: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    if popen.poll() is None:
        try:
            popen.send_signal(sig)
        except ProcessLookupError:
            pass
    try:
        popen.wait(timeout=10)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait(timeout=10)


# ====================================================================== the cluster
class HaCluster:
    """etcd, three manager replicas and three servers (R = 2), all real processes."""

    def __init__(self, work: Path, servers: int = 3):
        self.work = work
        self.etcd = Etcd(etcd_binary(), work)
        self.procs: dict[str, subprocess.Popen] = {}
        # each replica binds a free port and names it in its ready file (a port chosen here
        # could be taken before the replica binds it): known once they started
        self.addresses: list[str] = []
        self.manager_list = ""
        self.server_names = [f"s{i}" for i in range(servers)]
        # each replica reaches etcd through its own proxy: a test can cut one off from etcd
        self.etcd_proxies = [TcpProxy(("127.0.0.1", self.etcd.client_port)) for _ in range(3)]

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.work / f"{name}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "shardps.tools.cli", *args], stdout=log,
                                stderr=subprocess.STDOUT, env=child_env())
        log.close()
        self.procs[name] = proc
        return proc

    def start_manager(self, i: int) -> Path:
        """Start replica ``i`` on a free port; returns its ready file."""
        ready = self.work / f"m{i}.ready"
        self._spawn(f"m{i}", ["manager", "--listen", "127.0.0.1:0", "--ready-file", str(ready), "--metrics-port", "-1",
                              "--etcd", f"http://{self.etcd_proxies[i].address}", "--etcd-prefix", PREFIX,
                              "--replication", "2", "--server-lease-seconds", "3",
                              "--worker-lease-seconds", "30", "--leader-lease-seconds", "2"])
        return ready

    def start_server(self, name: str) -> None:
        self._spawn(name, ["server", "--name", name, "--listen", "127.0.0.1:0", "--metrics-port", "-1",
                           "--manager", self.manager_list])

    def start(self) -> "HaCluster":
        ready = [self.start_manager(i) for i in range(3)]
        for i, f in enumerate(ready):
            wait_for(f"manager replica {i}'s ready file", f.exists, 60, interval=0.05)
        self.addresses = [json.loads(f.read_text())["address"] for f in ready]
        self.manager_list = ",".join(self.addresses)
        wait_for("a manager leader", self.etcd.leader, 60, interval=0.1)
        for name in self.server_names:
            self.start_server(name)
        with self.client("ha-setup") as c:
            wait_for("3 serving servers", lambda: serving(c) == len(self.server_names), 90)
        return self

    def client(self, job: str, last: str = "") -> PSClient:
        """A client of ``job`` given the three managers (``last`` at the end of the list)."""
        managers = [a for a in self.addresses if a != last] + ([last] if last else [])
        return PSClient(",".join(managers), job, timeout=20.0, data_plane=False, shared_memory=False)

    def manager_index(self, address: str) -> int:
        return self.addresses.index(address)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.procs[name].send_signal(sig)
        if sig == signal.SIGKILL:
            self.procs[name].wait(timeout=10)

    def stop(self) -> None:
        for proc in self.procs.values():
            _kill(proc, signal.SIGKILL)
        for proxy in self.etcd_proxies:
            proxy.close()
        self.etcd.stop()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.work.glob("*.log")))


def serving(client: PSClient) -> int:
    try:
        msg = client.cluster_map(timeout=5).msg
    except ShardpsError:
        return 0
    return sum(1 for s in msg.servers if s.state == pb.SERVING)


def restored(client: PSClient, dead: str, r: int = 2):
    """Whether every block has ``r`` replicas, none on ``dead`` (which is DEAD)."""
    try:
        msg = client.cluster_map(timeout=5).msg
    except ShardpsError:
        return False
    names = [s.name for s in msg.servers]
    if not any(s.name == dead and s.state == pb.DEAD for s in msg.servers):
        return False
    for t in msg.tables:
        for b in t.blocks:
            if len(b.replicas) != r or dead in (names[i] for i in b.replicas):
                return False
    return True


@pytest.fixture
def ha(tmp_path):
    cluster = HaCluster(tmp_path)
    try:
        yield cluster.start()
    except BaseException:
        print(cluster.logs())
        raise
    finally:
        cluster.stop()


# ====================================================================== activity
class Activity:
    """Creates jobs, tables and worker joins in a loop, through the failover channel;
    records what was acknowledged (and the epochs the acknowledgements named)."""

    def __init__(self, cluster: HaCluster):
        self.cluster = cluster
        self.jobs: list[str] = []
        self.tables: list[tuple[str, str]] = []
        self.joins: list[tuple[str, str]] = []          # (job, session)
        self.max_epoch = 0
        self.failures: list[str] = []
        self.acks: list[float] = []                     # time.monotonic() of every CreateJob ack
        self._stop = threading.Event()
        self._clients: list[PSClient] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Activity":
        self._thread.start()
        return self

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            job = f"job{i}"
            c = self.cluster.client(job)
            self._clients.append(c)
            try:
                c.create_job("async")
                self.jobs.append(job)
                self.acks.append(time.monotonic())
                view = c.create_table(dense_table("w", [64], block_size=16))
                self.tables.append((job, "w"))
                self.max_epoch = max(self.max_epoch, view.epoch if hasattr(view, "epoch") else 0,
                                     c.shard_map.epoch)
                m = c.join(name=f"w{i}", heartbeat=True)
                self.joins.append((job, m.session))
                self.max_epoch = max(self.max_epoch, c.shard_map.epoch)
            except ShardpsError as exc:
                self.failures.append(f"{job}: {type(exc).__name__}: {exc.message}")
            i += 1
            self._stop.wait(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def close(self) -> None:
        for c in self._clients:
            c.close()


def check_acknowledged(cluster: HaCluster, act: Activity) -> None:
    """Every acknowledged job, table and join is in the current leader's map, whose epoch
    is at least every acknowledged one."""
    with cluster.client("ha-check") as c:
        msg = c.cluster_map(timeout=20).msg
    assert msg.epoch >= act.max_epoch, (msg.epoch, act.max_epoch)
    groups = {g.job: {m.session for m in g.members} for g in msg.groups}
    tables = {(t.job, t.spec.name) for t in msg.tables}
    missing_jobs = [j for j in act.jobs if j not in groups]
    missing_tables = [t for t in act.tables if t not in tables]
    missing_joins = [(j, s) for j, s in act.joins if s not in groups.get(j, set())]
    assert not (missing_jobs or missing_tables or missing_joins), (missing_jobs, missing_tables, missing_joins)


def kill_leader_and_measure(cluster: HaCluster, act: Activity) -> tuple[str, float]:
    """kill -9 the leader once the activity has acknowledged a few changes; the seconds from
    its exit until its successor acknowledged a CreateJob."""
    wait_for("changes acknowledged before the kill", lambda: len(act.joins) >= 3, 60, interval=0.1)
    old = cluster.etcd.leader()
    cluster.kill(f"m{cluster.manager_index(old)}")
    killed_at = time.monotonic()        # once it has exited: an ack received before then may be the old leader's
    wait_for("a CreateJob acknowledged by the new leader",
             lambda: any(t > killed_at for t in act.acks), 30, interval=0.05)
    took = min(t for t in act.acks if t > killed_at) - killed_at
    new = cluster.etcd.leader()
    assert new and new != old, (old, new)
    return new, took


# ====================================================================== the tests
def test_kill_the_leader_during_activity_then_a_server(ha):
    act = Activity(ha).start()
    try:
        new, took = kill_leader_and_measure(ha, act)
        print(f"\nmanager failover: leader killed -9, first change acknowledged by the new leader "
              f"({new}) after {took:.2f}s (target <= {FAILOVER_TARGET_SECONDS:.0f}s)")
        time.sleep(1.0)            # a little activity on the new leader too
    finally:
        act.stop()
    try:
        assert took <= FAILOVER_TARGET_SECONDS, took
        check_acknowledged(ha, act)
        # failover of servers goes on under the new leader
        killed_at = time.monotonic()
        ha.kill("s1")
        with ha.client("ha-check") as c:
            wait_for("s1 declared dead and every block back to 2 replicas", lambda: restored(c, "s1"), 60, 0.2)
        print(f"server s1 killed -9 after the failover: R = 2 restored in {time.monotonic() - killed_at:.2f}s")
        print(f"activity: {len(act.jobs)} jobs, {len(act.tables)} tables, {len(act.joins)} joins "
              f"acknowledged; {len(act.failures)} calls failed (unacknowledged): {act.failures[:3]}")
    finally:
        act.close()


def test_kill_the_leader_while_a_server_is_dead(ha):
    """The leader dies while it re-replicates a dead server's blocks: its successor finishes."""
    with ha.client("big") as c:
        c.create_job("async")
        c.create_table(dense_table("w", [64 * 256], block_size=64))       # 256 blocks
    ha.kill("s2")
    with ha.client("big") as c:
        wait_for("s2 declared dead", lambda: any(
            s.name == "s2" and s.state == pb.DEAD for s in c.cluster_map(timeout=5).msg.servers), 30, 0.1)
    old = ha.etcd.leader()
    killed_at = time.monotonic()
    ha.kill(f"m{ha.manager_index(old)}")
    with ha.client("big") as c:
        c.create_job("async")                         # acknowledged by the successor
        took = time.monotonic() - killed_at
        wait_for("every block back to 2 replicas under the new leader", lambda: restored(c, "s2"), 60, 0.2)
    print(f"\nleader killed -9 during re-replication: new leader served after {took:.2f}s; "
          f"R = 2 restored {time.monotonic() - killed_at:.2f}s after the kill")
    assert took <= FAILOVER_TARGET_SECONDS, took


def test_a_paused_leader_is_replaced_and_cannot_write_when_it_resumes(ha):
    """SIGSTOP: the leader is cut off from etcd (and everyone). A successor is elected; when
    the old one resumes it finds its lease gone and follows: one leader, and its writes
    are fenced meanwhile. The servers' heartbeats stuck on the paused leader time out and
    move on within the successor's take-over grace: no server is declared dead.

    The client lists the paused leader last: a call already sent to a hung manager waits for
    its deadline (the channel cannot tell a hung manager from a slow one), and only the next
    call moves on."""
    old = ha.etcd.leader()
    name = f"m{ha.manager_index(old)}"
    ha.kill(name, signal.SIGSTOP)
    try:
        stopped_at = time.monotonic()
        with ha.client("paused", last=old) as c:
            c.create_job("async")
            took = time.monotonic() - stopped_at
        new = ha.etcd.leader()
        assert new and new != old
    finally:
        ha.kill(name, signal.SIGCONT)
    with ha.client("paused", last=old) as c:
        c.create_table(dense_table("w", [64], block_size=16))
        time.sleep(3.0)            # the resumed replica notices its lost lease
        msg = c.cluster_map(timeout=10).msg
    assert ha.etcd.leader() == new
    assert all(s.state == pb.SERVING for s in msg.servers), msg.servers
    assert ("paused", "w") in {(t.job, t.spec.name) for t in msg.tables}
    log = (ha.work / f"{name}.log").read_text()
    assert "no longer the leader" in log, log[-3000:]
    print(f"\nleader paused (SIGSTOP): a new leader served after {took:.2f}s; the old one "
          f"stepped down when resumed")
    assert took <= FAILOVER_TARGET_SECONDS, took


class Counter:
    """A worker pushing +1 to a dense counter in a loop (the data path needs no manager);
    counts its acknowledged pushes and the longest time without one."""

    def __init__(self, cluster: HaCluster):
        self.client = cluster.client("counter")
        self.client.create_job("async")
        self.client.create_dense("c", (16,), optimizer=sgd(1.0))
        self.acked = 0
        self.acks: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Counter":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.client.push_dense("c", -np.ones(16, np.float32), timeout=10)
                self.acked += 1
                self.acks.append(time.monotonic())
            except ShardpsError:
                pass
            self._stop.wait(0.02)

    def stop(self) -> float:
        """Stop; the longest gap between acknowledged pushes (seconds)."""
        self._stop.set()
        self._thread.join(timeout=30)
        return max((b - a for a, b in zip(self.acks, self.acks[1:])), default=0.0)

    def check(self) -> None:
        values = self.client.pull_dense("c")
        assert np.all(values == self.acked), (values[:4], self.acked)
        self.client.close()


def test_a_leader_partitioned_from_etcd_steps_down_and_a_successor_serves(ha):
    """Only the leader's link to etcd is cut; clients and servers still reach it. It cannot
    renew its lease, steps down before the lease can have expired, and refuses calls; a
    follower takes the key and serves. Pushes go on throughout (counter exact), every
    acknowledged change is kept, and after the heal the old leader follows."""
    counter = Counter(ha).start()
    act = Activity(ha).start()
    try:
        wait_for("changes acknowledged before the cut", lambda: len(act.joins) >= 3, 60, interval=0.1)
        old = ha.etcd.leader()
        proxy = ha.etcd_proxies[ha.manager_index(old)]
        cut_at = time.monotonic()
        proxy.cut()
        elected: list[float] = []

        def served() -> bool:
            if not elected and ha.etcd.leader() not in ("", old):
                elected.append(time.monotonic() - cut_at)
            return bool(elected) and any(t > cut_at for t in act.acks)
        wait_for("a CreateJob acknowledged by a new leader", served, 30, 0.05)
        wait_for("a CreateJob acknowledged after the election",
                 lambda: any(t > cut_at + elected[0] for t in act.acks), 30, 0.05)
        took = min(t for t in act.acks if t > cut_at + elected[0]) - cut_at
        new = ha.etcd.leader()
        time.sleep(1.0)
        proxy.heal()
        time.sleep(2.0)                                  # the old leader reads the key again
    finally:
        act.stop()
        gap = counter.stop()
    try:
        assert new != old and ha.etcd.leader() == new, (old, new)
        assert took <= FAILOVER_TARGET_SECONDS, (took, elected)
        check_acknowledged(ha, act)
        counter.check()
        log = (ha.work / f"m{ha.manager_index(old)}.log").read_text()
        assert "no longer the leader" in log or "stepping down" in log, log[-3000:]
        print(f"\nleader partitioned from etcd: a new leader ({new}) elected {elected[0]:.2f}s and "
              f"acknowledged a change {took:.2f}s after the cut (target <= {FAILOVER_TARGET_SECONDS:.0f}s); pushes: "
              f"{counter.acked} acknowledged, counter exact, longest gap {gap:.2f}s")
        assert gap <= FAILOVER_TARGET_SECONDS, gap
    finally:
        act.close()
