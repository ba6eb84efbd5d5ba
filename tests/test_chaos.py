"""Chaos on real processes: kill servers, workers and the manager, add and drain servers.

Each test checks a counter table (``tests/chaos_worker.py``: every worker adds +1 per step to
its own rows and records the pushes acknowledged to it) rather than training to a target,
except the first, which also trains digits-cnn through the failure.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from shardps.protos.v1 import common_pb2 as pb
from shardps.tools.children import child_env
from shardps.tools.local import LocalCluster
from shardps.worker.client import PSClient
from tests.waiting import wait_for

pytestmark = pytest.mark.chaos
HERE = Path(__file__).resolve().parent


class Counters:
    """Counter-worker processes and the check of their table."""

    def __init__(self, cluster: LocalCluster, tmp: Path, job: str = "chaos"):
        self.cluster, self.tmp, self.job = cluster, tmp, job
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, steps: int, delay: float = 0.02, timeout: float = 120.0,
              extra: list[str] = ()) -> subprocess.Popen:
        cmd = list(self.cluster.wrap(name)) + [
               sys.executable, str(HERE / "chaos_worker.py"), "--manager", self.cluster.manager_address,
               "--job", self.job, "--name", name, "--steps", str(steps), "--delay", str(delay),
               "--state-file", str(self.tmp / f"{name}.json"), "--log-file", str(self.tmp / f"{name}.log"),
               "--timeout", str(timeout), "--stop-file", str(self.tmp / "stop")] + list(extra)
        log = open(self.tmp / f"{name}.out", "ab")
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=child_env())
        log.close()
        self.procs[name] = proc
        return proc

    def state(self, name: str) -> dict:
        path = self.tmp / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def wait_acked(self, name: str, count: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while self.state(name).get("acked", 0) < count:
            if self.procs[name].poll() not in (None, 0):
                raise AssertionError(f"{name} failed:\n{(self.tmp / f'{name}.out').read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} acked {self.state(name).get('acked')} < {count}")
            time.sleep(0.05)

    def finish(self, timeout: float = 300.0) -> None:
        for name, proc in self.procs.items():
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise AssertionError(f"{name} did not finish") from None
            assert code == 0, f"{name} exited {code}:\n{(self.tmp / f'{name}.out').read_text()[-3000:]}"

    def stop(self) -> None:
        (self.tmp / "stop").touch()
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def check(self) -> dict:
        """Every worker's rows equal its acknowledged pushes. Returns {name: acked}."""
        table = {}
        with PSClient(self.cluster.manager_address, self.job, timeout=60) as c:
            for name in self.procs:
                st = self.state(name)
                rows = c.pull_rows("counters", np.array(st["ids"]))[:, 0]
                assert np.all(rows == st["acked"]), (
                    f"{name}: rows {sorted(set(rows.tolist()))} != acknowledged pushes {st['acked']}")
                table[name] = st["acked"]
        print("counter table (worker: acknowledged pushes == every row):", table)
        return table

    def first_ack_after(self, name: str, t: float) -> float:
        for line in (self.tmp / f"{name}.log").read_text().splitlines():
            start, end = map(float, line.split())
            if start >= t:
                return end
        raise AssertionError(f"{name} acknowledged nothing after t={t}")


@pytest.fixture
def chaos(tmp_path):
    made = []

    def make(servers=3, replication=2, **kw):
        cluster = LocalCluster(servers=servers, replication=replication, work_dir=str(tmp_path / "cluster"), **kw)
        counters = Counters(cluster, tmp_path)
        made.append((cluster, counters))
        cluster.start()
        return cluster, counters

    yield make
    for cluster, counters in made:
        counters.stop()
        cluster.stop()


def test_kill_one_of_three_servers_mid_training(chaos, tmp_path):
    cluster, counters = chaos(servers=3, replication=2)
    trainers = [cluster.start_worker(f"trainer-{i}", ["--job", "demo", "--model", "digits-cnn", "--epochs", "15",
                                                       "--result-file", str(tmp_path / f"train-{i}.json")])
                for i in range(2)]
    counters.start("w0", steps=300)
    counters.wait_acked("w0", 60)
    victim = cluster.servers["s1"]
    killed = time.time()
    cluster.kill(victim, signal.SIGKILL)
    counters.wait_acked("w0", 300, timeout=240)
    recovery = counters.first_ack_after("w0", killed) - killed
    for p in trainers:
        out, _ = p.popen.communicate(timeout=300)
        assert p.popen.returncode == 0, f"{out}\n{p.log_path.read_text()[-3000:]}"
    counters.finish()
    counters.check()
    accuracy = [json.loads((tmp_path / f"train-{i}.json").read_text())["metrics"]["test_accuracy"]
                for i in range(2)]
    print(f"recovery time (kill -9 to the first acknowledged push touching the dead server's "
          f"blocks): {recovery:.2f}s; trainers' test_accuracy {accuracy}")
    assert min(accuracy) >= 0.97
    with PSClient(cluster.manager_address, "demo") as c:
        st = c.cluster_status()
    states = {s.server.name: s.server.state for s in st.servers}
    assert states["s1"] == pb.DEAD and st.under_replicated_blocks == 0, states   # R restored


def epoch_stable(client):
    """A ``wait_for`` condition: true once two polls in a row see the same shard-map epoch,
    i.e. the manager committed no move (nor any other change) in between."""
    seen: list[int] = []

    def check() -> bool:
        seen.append(client.refresh_map().epoch)
        return len(seen) >= 2 and seen[-1] == seen[-2]
    return check


def test_add_a_fourth_server_then_drain_one(chaos, tmp_path):
    cluster, counters = chaos(servers=3, replication=2)
    counters.start("w0", steps=300)
    counters.start("w1", steps=300)
    counters.wait_acked("w0", 40)
    with PSClient(cluster.manager_address, "chaos") as c:
        before = {b: list(r) for b, r in enumerate(c.refresh_map().table("chaos", "counters").replicas)}
        cluster.start_server("s3")
        deadline = time.monotonic() + 60
        while True:
            st = c.cluster_status()
            s3 = next((s for s in st.servers if s.server.name == "s3"), None)
            if s3 and s3.primary_blocks + s3.replica_blocks > 0 and st.under_replicated_blocks == 0:
                break
            assert time.monotonic() < deadline, "s3 never received blocks"
            time.sleep(0.1)
        wait_for("the rebalance to settle (the same shard-map epoch twice in a row)",
                 epoch_stable(c), timeout=60, interval=1.0)
        after = {b: list(r) for b, r in enumerate(c.refresh_map().table("chaos", "counters").replicas)}
        moved = sum(len(set(after[b]) - set(before[b])) for b in before) / sum(len(r) for r in before.values())
        print(f"join: {moved:.3f} of replicas moved (ideal 1/N = {1 / 4:.3f})")
        assert moved <= 1.2 * 2 / 4 + 0.05
        out = subprocess.run([sys.executable, "-m", "shardps.tools.cli", "drain", "s0", "--manager",
                              cluster.manager_address], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        deadline = time.monotonic() + 90
        while True:
            st = c.cluster_status()
            s0 = next(s for s in st.servers if s.server.name == "s0")
            if s0.server.state == pb.DEAD and s0.primary_blocks + s0.replica_blocks == 0:
                break
            assert time.monotonic() < deadline, "s0 was not drained"
            time.sleep(0.1)
        drained = {b: list(r) for b, r in enumerate(c.refresh_map().table("chaos", "counters").replicas)}
        moved = sum(len(set(drained[b]) - set(after[b])) for b in after) / sum(len(r) for r in after.values())
        print(f"drain: {moved:.3f} of replicas moved (ideal: s0's share, 1/4 = 0.25)")
    counters.finish()
    counters.check()


def test_kill_a_worker_and_start_it_again(chaos):
    cluster, counters = chaos(servers=3, replication=2)
    counters.start("w0", steps=150)
    w1 = counters.start("w1", steps=150)
    counters.wait_acked("w1", 30)
    before = counters.state("w1")
    w1.kill()
    w1.wait()
    counters.start("w1", steps=150)
    counters.finish()
    after = counters.state("w1")
    assert after["rank"] == before["rank"] and after["session"] == before["session"]
    assert after["incarnation"] > before["incarnation"], after
    print(f"w1 rejoined as rank {after['rank']}, incarnations {after['incarnations']}")
    counters.check()


def test_kill_the_manager_keep_pushing_restart_it(chaos):
    cluster, counters = chaos(servers=3, replication=2)
    counters.start("w0", steps=250)
    counters.wait_acked("w0", 30)
    cluster.kill(cluster.manager, signal.SIGKILL)
    at_kill = counters.state("w0")["acked"]
    counters.wait_acked("w0", at_kill + 40, timeout=60)     # training continues without the manager
    cluster.start_manager()
    counters.start("w1", steps=100)                         # a membership change, after the restart
    counters.finish()
    table = counters.check()
    assert table["w0"] == 250 and table["w1"] == 100



def test_kill_every_server_restore_onto_another_count(chaos, tmp_path):
    """Checkpoint periodically, lose every server, restore onto 2 servers instead of 3:
    the tables are bit-identical to the checkpoint, and the job finishes exactly."""
    from shardps.protos.v1 import parameter_server_pb2 as ps
    from shardps.rpc import channels
    from shardps.rpc.chunks import decode_snapshots
    from shardps.rpc.stubs import ParameterServerStub
    from shardps.server.manager.checkpoint_files import latest, read_checkpoint
    cluster, counters = chaos(servers=3, replication=2)
    for name in ("w0", "w1"):
        counters.start(name, steps=120, extra=["--checkpoint-every", "20"])
    counters.wait_acked("w0", 50)
    counters.wait_acked("w1", 50)
    for name in list(cluster.servers):
        cluster.kill(cluster.servers[name], signal.SIGKILL)
    for proc in counters.procs.values():
        proc.kill()
        proc.wait()
    path = latest(cluster.work_dir / "checkpoints", "chaos")
    assert path is not None, "no checkpoint was written"
    ck = read_checkpoint(path)
    print(f"restoring {path.name} (step {ck.step}) onto 2 new servers")
    for name in ("n0", "n1"):
        cluster.start_server(name)
    with PSClient(cluster.manager_address, "chaos", timeout=60) as c:
        deadline = time.monotonic() + 60
        while sum(1 for s in c.cluster_status().servers if s.server.state == pb.SERVING) != 2:
            assert time.monotonic() < deadline, "old servers not declared dead / new ones not serving"
            time.sleep(0.2)
        out = subprocess.run([sys.executable, "-m", "shardps.tools.cli", "restore", "chaos", "--manager",
                              cluster.manager_address], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        view = c.refresh_map()
        t = view.table("chaos", "counters")
        assert {r for reps in t.replicas for r in reps} == {"n0", "n1"}
        # bit-identical: every block, as its primary now holds it, equals the checkpoint's
        identical = 0
        for b, reps in enumerate(t.replicas):
            with channels.channel(view.address(reps[0])) as ch:
                stream = ParameterServerStub(ch).SnapshotBlocks(ps.SnapshotBlocksRequest(
                    blocks=[ps.BlockRef(job="chaos", table="counters", block=b)]), timeout=30)
                _, (snap,) = decode_snapshots(stream)
            want = ck.blocks["counters"][b]
            assert snap.header.version == want.header.version
            assert snap.header.metadata == want.header.metadata
            for got, exp in zip(snap.arrays, want.arrays):
                assert got.tobytes() == exp.tobytes(), f"block {b} differs from the checkpoint"
            identical += 1
        print(f"{identical} blocks bit-identical to the checkpoint after restore")
    counters.procs.clear()
    for name in ("w0", "w1"):
        counters.start(name, steps=120, extra=["--checkpoint-every", "20"])
    counters.finish()
    table = counters.check()
    assert table == {"w0": 120, "w1": 120}


def test_partitioned_server_is_failed_over_and_rejoins_without_split_brain(tmp_path):
    """s1 and the worker w1 are cut off from the rest (each process in its own network
    namespace). The majority fails s1 over and keeps counting; w1 keeps talking to s1, whose
    pushes can never be acknowledged (its backups are gone); after the heal s1's stale epoch
    and incarnation are refused, it rejoins empty, and every counter equals its acks."""
    from tests.netns import NetnsLab
    reason = NetnsLab.available()
    if reason:
        pytest.skip(f"network namespaces unavailable: {reason}")
    lab = NetnsLab(["manager", "s0", "s1", "s2", "w0", "w1"]).up()
    cluster = LocalCluster(servers=3, replication=2, work_dir=str(tmp_path / "cluster"),
                           host_of=lambda n: lab.ip.get(n, "127.0.0.1"), wrap=lab.wrap)
    counters = Counters(cluster, tmp_path)
    try:
        cluster.start()
        counters.start("w0", steps=220)
        counters.start("w1", steps=220)
        counters.wait_acked("w0", 30)
        counters.wait_acked("w1", 30)
        lab.partition(["s1", "w1"])
        cut = time.time()
        w1_at_cut = counters.state("w1")["acked"]
        with PSClient(cluster.manager_address, "chaos", timeout=30) as c:
            deadline = time.monotonic() + 60
            while next(s for s in c.cluster_status().servers if s.server.name == "s1").server.state != pb.DEAD:
                assert time.monotonic() < deadline, "the partitioned server was never declared dead"
                time.sleep(0.2)
            detected = time.time() - cut
            w0_before = counters.state("w0")["acked"]
            counters.wait_acked("w0", w0_before + 30, timeout=60)     # the majority goes on
            w1_during = counters.state("w1")["acked"]
            assert w1_during <= w1_at_cut + 1, "the minority acknowledged pushes: split brain"
            lab.heal()
            healed = time.time()
            deadline = time.monotonic() + 90
            while True:
                s1 = next(s for s in c.cluster_status().servers if s.server.name == "s1")
                if s1.server.incarnation >= 2 and s1.server.state == pb.SERVING:
                    break
                assert time.monotonic() < deadline, f"s1 did not rejoin: {s1}"
                time.sleep(0.2)
            print(f"partition detected after {detected:.1f}s; s1 rejoined as incarnation "
                  f"{s1.server.incarnation} {time.time() - healed:.1f}s after the heal")
        counters.finish(timeout=300)
        log = (cluster.work_dir / "s1.log").read_text()
        assert "fenced by the manager" in log, "s1's stale incarnation was never refused"
        table = counters.check()
        assert table == {"w0": 220, "w1": 220}
    finally:
        counters.stop()
        cluster.stop()
        lab.down()


def test_a_paused_server_is_routed_around_while_it_stays_paused(chaos, monkeypatch):
    """SIGSTOP a server (a VM freeze, a long GC pause) for 8 s, longer than the lease (3 s)
    plus its failover, while two joined workers push to every block. Pushes must be
    acknowledged again while it is still paused:

    * a server whose new map declares the paused one dead cancels its forwards and resyncs
      to it (``GrpcPeers.abandon``; a resync is bounded by the forward timeout, not the 30 s
      of a copy), so its map install and its pushes do not wait for the paused backup;
    * a client's calls waiting on the paused primary are abandoned once its heartbeat
      brings the new map (``fanout.abandon_dead``), not at the attempt's timeout (made 60 s
      here).

    Before, the pushes were acknowledged only after SIGCONT (4.82 s with a 4.8 s pause)."""
    from shardps.tables import sgd
    from shardps.worker.client import fanout
    monkeypatch.setattr(fanout, "ATTEMPT_SECONDS", 60.0)
    cluster, _ = chaos(servers=4, replication=2, server_lease_seconds=3.0)
    ids = np.arange(240)
    with PSClient(cluster.manager_address, "paused", timeout=30) as c:
        c.create_job()
        c.create_sparse("counters", 1, optimizer=sgd(1.0), num_blocks=12)
    acks: list[float] = []
    stop = __import__("threading").Event()
    workers = [PSClient(cluster.manager_address, "paused", timeout=30) for _ in range(2)]

    def push_loop(client):
        while not stop.is_set():
            client.push_rows("counters", ids, -np.ones((240, 1), np.float32), timeout=20)
            acks.append(time.monotonic())

    threads = [__import__("threading").Thread(target=push_loop, args=(w,), daemon=True) for w in workers]
    try:
        for i, w in enumerate(workers):
            w.join(name=f"w{i}")
        for t in threads:
            t.start()
        wait_for("pushes flowing", lambda: len(acks) >= 10, 30, interval=0.05)
        victim = cluster.servers["s2"].popen
        victim.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            time.sleep(8.0)
        finally:
            victim.send_signal(signal.SIGCONT)
        resumed = time.monotonic()
        wait_for("pushes after the resume", lambda: acks[-1] > resumed, 30, interval=0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    around = sorted(a for a in acks if a > stopped - 1.0)
    gap = max(b - a for a, b in zip(around, around[1:]) if a < resumed)
    late = [a for a in acks if stopped + gap - 0.5 < a < resumed]
    assert late and gap < resumed - stopped - 1.0, (gap, resumed - stopped)
    print(f"longest time without an acknowledged push around the 8 s pause: {gap:.2f}s (lease 3 s); "
          f"{len(late)} pushes acknowledged after it, before the SIGCONT")
    with PSClient(cluster.manager_address, "paused", timeout=30) as c:
        np.testing.assert_array_equal(c.pull_rows("counters", ids)[:, 0], np.full(240, float(len(acks))))
    for w in workers:
        w.close()


def test_a_resumed_primary_does_not_answer_a_reader_as_stale_as_itself(chaos):
    """The primary of a dense block is paused (SIGSTOP) longer than its lease; the manager
    gives the block to its backup, and a writer's pushes are acknowledged there. A reader
    whose map is as old as the paused server's then pulls: its request waits in the paused
    server's socket. When that server runs again it must not answer from its old copy (it
    did, and the verifier caught it: "read missed an acknowledged push"): it noticed it did
    not run, refuses until the manager answers it, and the reader's retry reads every
    acknowledged push."""
    import threading

    from shardps.tables import sgd
    cluster, _ = chaos(servers=2, replication=2, server_lease_seconds=3.0)
    writer = PSClient(cluster.manager_address, "stale-read", timeout=30)
    reader = PSClient(cluster.manager_address, "stale-read", timeout=30)
    try:
        writer.create_job()
        writer.create_dense("w", (16,), optimizer=sgd(1.0))
        writer.join(name="w0")
        for _ in range(5):
            writer.push_dense("w", -np.ones(16, np.float32))
        assert reader.pull_dense("w")[0] == 5.0              # the reader's map: the primary below
        view = reader.refresh_map()
        t = view.table("stale-read", "w")
        primary = view.server_names[int(t.primary[0])]
        acked = [5]
        stop = threading.Event()

        def push_loop():
            while not stop.is_set():
                writer.push_dense("w", -np.ones(16, np.float32), timeout=30)
                acked.append(acked[-1] + 1)

        victim = cluster.servers[primary].popen
        victim.send_signal(signal.SIGSTOP)
        pushing = threading.Thread(target=push_loop, daemon=True)
        try:
            pushing.start()
            wait_for("pushes acknowledged by the new primary", lambda: acked[-1] >= 8, 30, interval=0.05)
            before = acked[-1]
            read = reader.pull_dense_async("w")             # to the paused server: its map is old
            time.sleep(0.3)
        finally:
            victim.send_signal(signal.SIGCONT)
        value = float(read.result(timeout=60)[0])
        stop.set()
        pushing.join(timeout=30)
        assert value >= before, f"read {value:.0f} < {before} acknowledged before the pull started"
        assert "did not run for" in (cluster.work_dir / f"{primary}.log").read_text()
    finally:
        for c in (writer, reader):
            c.close()
