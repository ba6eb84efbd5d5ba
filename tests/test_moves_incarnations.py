"""Block copies go to a server incarnation that has dropped its predecessor's state, and a
move is committed only onto the incarnation its copy reached (manager runtime and moves,
in-process, with a fake transport).

The defect these pin down (the verifier's short form, seed 2, on a loaded host): a server
paused past its lease is fenced, re-registers (the manager: incarnation 2, JOINING), and
only then drops its old state and installs the new map. The manager copied blocks to it in
that window: the copies landed in the old incarnation's state, the reset wiped them, and the
moves were committed all the same. The server listed those blocks as ``missing`` for good;
once their other replica died it was the blocks' only replica, refusing every read and push
("assigned to s2 but its state has not been loaded yet") and every copy out of it, with R
never restored. A server restarted while blocks were copied to it was committed the same way.
"""

import threading
import time

from shardps.server.manager import moves
from shardps.server.manager.records import ManagerSettings, ServerState
from shardps.server.manager.runtime import ManagerRuntime, RuntimeSettings
from shardps.server.manager.state import ManagerState
from shardps.tables import Consistency, TableConfig, sgd, sparse_table


class FakeStub:
    def __init__(self, pool: "FakePool", address: str):
        self.pool, self.address = pool, address

    def InstallShardMap(self, request, timeout=None, metadata=()):
        return None

    def CopyBlocks(self, request, timeout=None, metadata=()):
        source = self.address.removeprefix("addr-")
        with self.pool.lock:
            self.pool.copies.append((source, request.destination, len(request.blocks)))
        if self.pool.on_copy is not None:
            self.pool.on_copy(source, request.destination)
        return None


class FakePool:
    """Every install and copy succeeds; copies are recorded (source, destination, blocks)."""

    def __init__(self):
        self.metadata = ()
        self.lock = threading.Lock()
        self.copies: list[tuple[str, str, int]] = []
        self.on_copy = None

    def get(self, address: str) -> FakeStub:
        return FakeStub(self, address)

    def close(self) -> None:
        pass


def cluster():
    clock = [0.0]
    pool = FakePool()
    rt = ManagerRuntime(ManagerSettings(replication=2, server_lease_seconds=3.0),
                        RuntimeSettings(install_timeout=0.5, copy_timeout=1.0), pool=pool,
                        clock=lambda: clock[0])
    for i in range(3):
        rt.change(lambda s, i=i: s.register_server(f"s{i}", f"addr-s{i}", "", f"b{i}", now=0.0))
        rt.change(lambda s, i=i: s.server_heartbeat(f"s{i}", 1, s.epoch, {}, now=0.0))
    rt.change(lambda s: s.create_job("j", Consistency.ASYNC, 0))
    rt.change(lambda s: s.create_table("j", sparse_table("e", 4, num_blocks=30), TableConfig(sgd(0.1))))
    return rt, clock, pool


def tick(rt, clock, t, beating=("s0", "s1")):
    """Heartbeats of ``beating`` (their current incarnations) at ``t``, then one round."""
    clock[0] = t
    for name in beating:
        inc = rt.state.servers[name].incarnation
        rt.change(lambda s, name=name, inc=inc: s.server_heartbeat(name, inc, s.epoch, {}, now=t))
    rt.tick()


def holding(rt, name):
    with rt.lock:
        return sum(1 for t in rt.state.tables.values() for b in t.blocks if name in b.replicas)


def fence_and_rejoin_s2(rt, clock, pool):
    """s2 stops heartbeating (paused past its lease): declared dead, R restored on s0 and s1;
    then it is fenced and registers again (incarnation 2, JOINING)."""
    for t in (1.0, 2.0, 3.0, 4.0):
        tick(rt, clock, t)
    assert rt.state.servers["s2"].state is ServerState.DEAD
    assert holding(rt, "s2") == 0 and rt.state.under_replicated() == 0
    rt.change(lambda s: s.register_server("s2", "addr-s2", "", "b2-again", now=4.5))
    assert rt.state.servers["s2"].state is ServerState.JOINING
    pool.copies.clear()


def test_no_block_is_copied_to_a_server_before_it_serves_its_new_incarnation():
    rt, clock, pool = cluster()
    try:
        fence_and_rejoin_s2(rt, clock, pool)
        # s2 has registered incarnation 2 but not heartbeated under it: its process may still
        # hold incarnation 1's state, which its reset is about to wipe
        tick(rt, clock, 5.0)
        tick(rt, clock, 5.2)
        assert [c for c in pool.copies if c[1] == "s2"] == []
        assert holding(rt, "s2") == 0
        # its first heartbeat under incarnation 2 (after its reset and install): copies go on
        tick(rt, clock, 5.4, beating=("s0", "s1", "s2"))
        tick(rt, clock, 5.6, beating=("s0", "s1", "s2"))
        assert rt.state.servers["s2"].state is ServerState.SERVING
        assert [c for c in pool.copies if c[1] == "s2"] and holding(rt, "s2") > 0
        assert rt.state.under_replicated() == 0
    finally:
        rt.stop()


def test_a_move_is_not_committed_onto_a_server_that_restarted_during_its_copy():
    rt, clock, pool = cluster()
    try:
        fence_and_rejoin_s2(rt, clock, pool)
        rt.change(lambda s: s.server_heartbeat("s2", 2, s.epoch, {}, now=4.6))   # serving
        restarted = threading.Event()

        def restart_s2(source, destination):     # the copy reached incarnation 2; it restarts
            if destination == "s2" and not restarted.is_set():
                restarted.set()
                rt.change(lambda s: s.register_server("s2", "addr-s2", "", "b2-third", now=5.0))

        pool.on_copy = restart_s2
        tick(rt, clock, 5.0)
        assert restarted.is_set()
        assert rt.state.servers["s2"].incarnation == 3
        assert holding(rt, "s2") == 0             # incarnation 3 holds none of those copies
        pool.on_copy = None
        tick(rt, clock, 5.2, beating=("s0", "s1", "s2"))   # it serves incarnation 3: copied again
        tick(rt, clock, 5.4, beating=("s0", "s1", "s2"))
        assert holding(rt, "s2") > 0 and rt.state.under_replicated() == 0
    finally:
        rt.stop()


def test_a_server_that_stops_answering_is_declared_dead_while_a_copy_waits():
    """A copy held up by a server that stopped answering (paused, cut off) does not hold
    up failover: the manager judges leases while copies run. (Before, the reconcile loop
    waited for its copies, up to their timeout, and judged no lease meanwhile.)"""
    rt, clock, pool = cluster()
    copying, release = threading.Event(), threading.Event()

    def hang(source, destination):
        if destination == "s2":
            copying.set()
            release.wait(30)

    ticking = threading.Thread(target=tick, args=(rt, clock, 5.0, ("s0", "s1", "s2")), daemon=True)
    try:
        fence_and_rejoin_s2(rt, clock, pool)
        rt.change(lambda s: s.server_heartbeat("s2", 2, s.epoch, {}, now=4.6))   # serving: copied to
        pool.on_copy = hang
        ticking.start()
        assert copying.wait(10)
        for t in (6.0, 7.0, 8.0, 9.0):       # s1 stops heartbeating; its lease ends at 8.0
            clock[0] = t
            for name in ("s0", "s2"):
                inc = rt.state.servers[name].incarnation
                rt.change(lambda s, name=name, inc=inc, t=t: s.server_heartbeat(name, inc, s.epoch, {}, now=t))
        deadline = time.monotonic() + 10
        while rt.state.servers["s1"].state is not ServerState.DEAD and time.monotonic() < deadline:
            time.sleep(0.02)
        assert rt.state.servers["s1"].state is ServerState.DEAD
        assert ticking.is_alive() and not release.is_set()        # the copy still waits
        assert rt.state.servers["s2"].state is ServerState.SERVING
    finally:
        release.set()
        ticking.join(10)
        rt.stop()


def test_commit_checks_the_incarnation_each_copy_reached():
    st = ManagerState(ManagerSettings(replication=2))
    for i in range(3):
        st.register_server(f"s{i}", f"h:{i}", "", f"b{i}", now=0.0)
        st.server_heartbeat(f"s{i}", 1, st.epoch, {}, now=0.0)
    st.create_job("j", Consistency.ASYNC, 0)
    st.create_table("j", sparse_table("e", 4, num_blocks=30), TableConfig(sgd(0.1)))
    st.register_server("s3", "h:3", "", "b3", now=0.0)
    st.server_heartbeat("s3", 1, st.epoch, {}, now=0.0)
    planned = st.plan_moves()
    assert planned and all(m.add == ("s3",) for m in planned)
    copied_to = moves.copy_destinations(st)
    assert copied_to == {"s0": 1, "s1": 1, "s2": 1, "s3": 1}
    st.register_server("s3", "h:3", "", "b3-restarted", now=1.0)     # during the copies
    assert moves.copy_destinations(st) == {"s0": 1, "s1": 1, "s2": 1}   # joining: not yet
    assert st.commit_moves(planned, now=1.0, copied_to=copied_to) == 0
    st.server_heartbeat("s3", 2, st.epoch, {}, now=1.5)
    planned = st.plan_moves()
    assert st.commit_moves(planned, now=2.0, copied_to=moves.copy_destinations(st)) == len(planned)


def test_cluster_status_counts_the_moves_not_committed_yet():
    """``ClusterStatus.pending_moves``: the batch being copied plus the plan's rest; 0 once
    every move is committed (it was never set before)."""
    from shardps.server.manager.service import cluster_status
    rt, clock, pool = cluster()
    try:
        fence_and_rejoin_s2(rt, clock, pool)
        rt.change(lambda s: s.server_heartbeat("s2", 2, s.epoch, {}, now=4.6))   # serving
        seen: list[int] = []
        pool.on_copy = lambda source, destination: seen.append(rt.pending_moves)
        tick(rt, clock, 5.0)
        assert seen and min(seen) > 0, "no move counted while its copy ran"
        pool.on_copy = None
        for t in (5.2, 5.4, 5.6, 5.8):
            tick(rt, clock, t, beating=("s0", "s1", "s2"))
        assert rt.state.under_replicated() == 0
        assert cluster_status(rt).pending_moves == 0
    finally:
        rt.stop()
