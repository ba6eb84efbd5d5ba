"""Planning without the manager's lock: heartbeats and joins are answered while a plan runs,
and a plan made for a placement that changed meanwhile is not used (runtime, moves)."""

import threading

from shardps.server.manager import moves
from shardps.server.manager.records import ManagerSettings
from shardps.server.manager.runtime import ManagerRuntime, RuntimeSettings
from shardps.server.manager.state import ManagerState
from shardps.tables import Consistency, TableConfig, sgd, sparse_table

NOWHERE = "127.0.0.1:1"     # installs and copies fail at once (connection refused)


class GatedRuntime(ManagerRuntime):
    """A runtime whose planning waits until the test lets it go on."""

    def __init__(self, *args, **kwargs):
        self.planning = threading.Event()
        self.go_on = threading.Event()
        self.snapshots: list[moves.PlanInput] = []
        self.plans: list[list] = []
        super().__init__(*args, **kwargs)

    def plan(self, snap):
        self.snapshots.append(snap)
        self.planning.set()
        assert self.go_on.wait(timeout=60), "the test never let the plan go on"
        planned = super().plan(snap)
        self.plans.append(planned)
        return planned


def answered(fn, timeout=30.0):
    """Run ``fn`` in a thread; whether it returned (a call stuck on the lock would not)."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(timeout)
    return bool(out)


def gated_cluster():
    clock = [0.0]
    rt = GatedRuntime(ManagerSettings(replication=2, server_lease_seconds=3.0),
                      RuntimeSettings(install_timeout=0.5, copy_timeout=1.0), clock=lambda: clock[0])
    for i in range(3):
        rt.change(lambda s, i=i: s.register_server(f"s{i}", NOWHERE, "", f"b{i}", now=0.0))
        rt.change(lambda s, i=i: s.server_heartbeat(f"s{i}", 1, s.epoch, {}, now=0.0))
    rt.change(lambda s: s.create_job("j", Consistency.ASYNC, 0))
    rt.change(lambda s: s.create_table("j", sparse_table("e", 4, num_blocks=30), TableConfig(sgd(0.1))))
    return rt, clock


def test_heartbeats_and_joins_are_answered_while_a_plan_runs():
    rt, clock = gated_cluster()
    try:
        ticking = threading.Thread(target=rt.tick, daemon=True)
        ticking.start()
        assert rt.planning.wait(timeout=30)
        assert answered(lambda: rt.change(lambda s: s.server_heartbeat("s1", 1, s.epoch, {}, now=0.5)))
        assert answered(lambda: rt.change(lambda s: s.join("j", "w", -1, "", None, 0, now=0.5)))
        assert answered(lambda: rt.published.epoch)
        assert rt.state.servers["s1"].last_heartbeat == 0.5 and len(rt.state.jobs["j"].members) == 1
        rt.go_on.set()
        ticking.join(timeout=30)
        assert not ticking.is_alive()
        # a worker joining does not change the placement: the plan (nothing to move) stands
        assert rt.plans == [[]] and moves.still_valid(rt.state, rt.snapshots[0])
    finally:
        rt.go_on.set()
        rt.stop()


def test_a_plan_made_before_a_server_died_is_not_used():
    rt, clock = gated_cluster()
    try:
        ticking = threading.Thread(target=rt.tick, daemon=True)
        ticking.start()
        assert rt.planning.wait(timeout=30)
        clock[0] = 2.5
        for name in ("s0", "s1"):
            rt.change(lambda s, name=name: s.server_heartbeat(name, 1, s.epoch, {}, now=2.5))
        clock[0] = 4.0
        assert rt.change(lambda s: s.expire(4.0)) == ["server:s2"]
        rt.go_on.set()
        ticking.join(timeout=30)
        assert not moves.still_valid(rt.state, rt.snapshots[0])
        rt.tick()           # plans again, for the servers left (the copies then fail: nowhere)
        assert len(rt.snapshots) == 2 and rt.snapshots[1].nodes == ("s0", "s1")
        restore = rt.plans[1]
        assert restore and all(len(m.target) == 2 and "s2" not in m.target for m in restore)
    finally:
        rt.go_on.set()
        rt.stop()


def test_a_snapshot_plans_what_the_state_plans_and_notices_what_invalidates_it():
    st = ManagerState(ManagerSettings(replication=2))
    for i in range(4):
        st.register_server(f"s{i}", f"h:{i}", "", f"b{i}", now=0.0)
    st.create_job("j", Consistency.ASYNC, 0)
    st.create_table("j", sparse_table("e", 4, num_blocks=40), TableConfig(sgd(0.1)))
    st.drain_server("s3")
    snap = moves.snapshot(st)
    before = [list(r) for r in snap.replicas]
    planned = moves.plan_from(snap)
    assert planned == st.plan_moves() and planned
    assert [list(r) for r in snap.replicas] == before          # planning reads, never writes
    st.join("j", "w", -1, "", None, 0, now=0.0)                # epoch moves, placement does not
    assert st.epoch != snap.epoch and moves.still_valid(st, snap)
    st.register_server("s4", "h:4", "", "b4", now=0.0)         # a new server: plan again
    assert not moves.still_valid(st, snap)
    snap = moves.snapshot(st)
    st.server_heartbeat("s4", 1, st.epoch, {}, now=0.5)        # joining -> serving: same plan
    assert st.epoch != snap.epoch and moves.still_valid(st, snap)
    st.delete_table("j", "e")
    assert not moves.still_valid(st, snap)


def test_restoring_r_comes_before_rebalancing_in_a_limited_batch():
    st = ManagerState(ManagerSettings(replication=2, server_lease_seconds=3.0))
    for i in range(4):
        st.register_server(f"s{i}", f"h:{i}", "", f"b{i}", now=0.0)
    st.create_job("j", Consistency.ASYNC, 0)
    t, _ = st.create_table("j", sparse_table("e", 4, num_blocks=200), TableConfig(sgd(0.1)))
    for i in range(3):
        st.server_heartbeat(f"s{i}", 1, st.epoch, {}, now=2.5)
    st.expire(now=4.0)
    st.register_server("s5", "h:5", "", "b5", now=4.0)         # also something to rebalance
    short = sum(1 for b in t.blocks if len(b.replicas) < 2)
    batch = st.plan_moves(limit=short)
    assert len(batch) == short and all(len(m.before) == 1 for m in batch)
