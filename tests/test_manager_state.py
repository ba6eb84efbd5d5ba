"""The manager's decisions with a fake clock: leases, promotion, ranks, persistence, checkpoint
plans (pure); and that the runtime persists what the decisions change."""

import pytest

from shardps.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from shardps.protos.v1 import common_pb2 as pb
from shardps.server.manager.checkpoint_plan import plan_cut, plan_load
from shardps.server.manager.records import ManagerSettings, ServerState
from shardps.server.manager.state import ManagerState
from shardps.server.manager.store import StateFile
from shardps.tables import Consistency, TableConfig, adam, dense_table, sgd, sparse_table


def make(n=3, r=2):
    st = ManagerState(ManagerSettings(replication=r, server_lease_seconds=3.0, worker_lease_seconds=5.0))
    for i in range(n):
        st.register_server(f"s{i}", f"h:{i}", "", f"boot{i}", now=0.0)
    st.create_job("j", Consistency.ASYNC, 0)
    return st


def test_table_creation_is_idempotent_and_conflicts_are_named():
    st = make()
    t, created = st.create_table("j", dense_table("w", (100,), block_size=10), TableConfig(sgd(0.1)))
    assert created and len(t.blocks) == 10 and all(len(b.replicas) == 2 for b in t.blocks)
    epoch = st.epoch
    _, created = st.create_table("j", dense_table("w", (100,), block_size=10), TableConfig(sgd(0.1)))
    assert not created and st.epoch == epoch
    with pytest.raises(AlreadyExists, match="another spec"):
        st.create_table("j", dense_table("w", (101,), block_size=10), TableConfig(sgd(0.1)))
    with pytest.raises(NotFound, match="job 'nope'"):
        st.create_table("nope", dense_table("w", (1,)), TableConfig())


def test_a_sparse_table_keeps_its_block_count_when_a_run_leaves_it_at_the_default():
    """A job made when every sparse table got 64 blocks is reused by a run that leaves the
    count to the default (one block per 4 MiB now); a count chosen otherwise conflicts."""
    st = make()
    old, _ = st.create_table("j", sparse_table("e", 8, num_rows=100_000, num_blocks=64), TableConfig(sgd(0.1)))
    epoch = st.epoch
    again, created = st.create_table("j", sparse_table("e", 8, num_rows=100_000), TableConfig(sgd(0.1)))
    assert not created and again is old and again.spec.num_blocks == 64 and st.epoch == epoch
    with pytest.raises(AlreadyExists, match="another spec"):
        st.create_table("j", sparse_table("e", 8, num_rows=100_000, num_blocks=7), TableConfig(sgd(0.1)))
    with pytest.raises(AlreadyExists, match="another spec"):         # not only the count differs
        st.create_table("j", sparse_table("e", 8, num_rows=100_001), TableConfig(sgd(0.1)))


def test_tables_created_together_take_one_epoch_and_are_placed_in_balance():
    """A model's every parameter at once: one map change, not one per table (the manager,
    servers and clients each handle a whole map per change), balanced as one placement."""
    st = make(3, 2)
    epoch = st.epoch
    tables = [(dense_table(f"w{i}", (4, 4)), TableConfig(sgd(0.1))) for i in range(300)]
    tables.append((sparse_table("e", 8, num_blocks=64), TableConfig(sgd(0.2))))
    got = st.create_tables("j", tables)
    assert st.epoch == epoch + 1 and [created for _, created in got] == [True] * 301
    assert [rec.spec.name for rec, _ in got] == [spec.name for spec, _ in tables]
    assert st.tables[("j", "e")].config.optimizer.lr == 0.2
    load = {f"s{n}": 0 for n in range(3)}
    for rec, _ in got:
        for b in rec.blocks:
            assert len(set(b.replicas)) == 2 and b.since_epoch == epoch + 1
            for node in b.replicas:
                load[node] += 1
    assert max(load.values()) - min(load.values()) <= 0.1 * sum(load.values()) / 3, load
    again = st.create_tables("j", tables[:2] + [(dense_table("new", (3,)), TableConfig())])
    assert [created for _, created in again] == [False, False, True] and st.epoch == epoch + 2
    assert again[0][0] is got[0][0]


@pytest.mark.parametrize("bad, error, match", [
    ((dense_table("w1", (5, 4)), TableConfig(sgd(0.1))), AlreadyExists, "'w1' of job 'j' exists with another spec"),
    ((dense_table("w0", (4, 4)), TableConfig(sgd(0.1))), InvalidArgument, "'w0' of job 'j' is named twice"),
    ((dense_table("w9", (0,)), TableConfig()), InvalidArgument, "w9"),
])
def test_tables_created_together_are_all_or_none(bad, error, match):
    st = make(3, 2)
    st.create_table("j", dense_table("w1", (4, 4)), TableConfig(sgd(0.1)))
    epoch, before = st.epoch, set(st.tables)
    with pytest.raises(error, match=match):
        st.create_tables("j", [(dense_table("w0", (4, 4)), TableConfig(sgd(0.1))), bad,
                               (dense_table("w2", (4, 4)), TableConfig(sgd(0.1)))])
    assert st.epoch == epoch and set(st.tables) == before


def test_configs_changed_together_take_one_epoch_all_or_none():
    st = make(3, 2)
    st.create_tables("j", [(dense_table(f"w{i}", (4,)), TableConfig(sgd(0.1))) for i in range(50)])
    epoch = st.epoch
    got = st.update_table_configs("j", [(f"w{i}", TableConfig(sgd(0.01 * i)), 0) for i in range(50)])
    assert st.epoch == epoch + 1 and [c.optimizer.lr for c in got] == [0.01 * i for i in range(50)]
    assert all(c.version == 2 for c in got) and st.tables[("j", "w7")].config.optimizer.lr == 0.07
    for bad, error, match in [
        (("nope", TableConfig(sgd(0.5)), 0), NotFound, "'nope'"),
        (("w3", TableConfig(adam(0.5)), 0), InvalidArgument, "'w3': the optimizer cannot change"),
        (("w3", TableConfig(sgd(0.5)), 1), FailedPrecondition, "'w3' config is at version 2, not 1"),
        (("w0", TableConfig(sgd(0.5)), 0), InvalidArgument, "'w0' of job 'j' is named twice"),
    ]:
        with pytest.raises(error, match=match):
            st.update_table_configs("j", [("w0", TableConfig(sgd(0.9)), 0), bad])
        assert st.epoch == epoch + 1 and st.tables[("j", "w0")].config.optimizer.lr == 0.0


def test_a_job_quota_counts_every_table_created_together():
    st = make(3, 2)
    st.create_job("q", Consistency.ASYNC, 0, quota_bytes=1000)
    config = TableConfig(sgd(0.1))                               # 200 bytes per table: values only
    st.create_tables("q", [(dense_table(f"a{i}", (50,)), config) for i in range(4)])
    with pytest.raises(ResourceExhausted, match="hold 1000 bytes and 'b1' needs 200 more"):
        st.create_tables("q", [(dense_table("b0", (50,)), config), (dense_table("b1", (50,)), config)])
    assert ("q", "b0") not in st.tables


@pytest.mark.parametrize("r", [1, 2])
def test_new_tables_fill_the_least_loaded_servers_and_are_not_moved_after(r):
    st = make(3, r)
    for i, blocks in enumerate([64, 7, 64, 10, 64, 1, 33]):
        st.create_table("j", sparse_table(f"e{i}", 4, num_blocks=blocks), TableConfig(sgd(0.1)))
        moved = [m for m in st.plan_moves() if m.table == f"e{i}"]
        assert moved == [], f"table e{i} ({blocks} blocks) was placed off balance"
    load = {f"s{n}": 0 for n in range(3)}
    for t in st.tables.values():
        for b in t.blocks:
            for node in b.replicas:
                load[node] += 1
    assert max(load.values()) - min(load.values()) <= 0.1 * sum(load.values()) / 3, load


def test_lease_expiry_promotes_the_backup_and_bumps_since_epoch():
    st = make()
    t, _ = st.create_table("j", sparse_table("e", 4, num_blocks=30), TableConfig(sgd(0.1)))
    before = {i: list(b.replicas) for i, b in enumerate(t.blocks)}
    for name in ("s1", "s2"):
        st.server_heartbeat(name, 1, st.epoch, {}, now=2.5)
    changed = st.expire(now=4.0)
    assert changed == ["server:s0"]
    for i, b in enumerate(t.blocks):
        assert "s0" not in b.replicas and b.replicas
        if "s0" in before[i]:
            assert b.since_epoch == st.epoch
            assert b.replicas == [n for n in before[i] if n != "s0"]
    with pytest.raises(FailedPrecondition, match="fenced"):
        st.server_heartbeat("s0", 1, st.epoch, {}, now=4.1)
    moves = st.plan_moves()
    assert moves and all("s0" not in m.target and len(m.target) == 2 for m in moves)


def test_restart_under_the_same_name_is_fenced():
    st = make(3, 1)
    t, _ = st.create_table("j", dense_table("w", (300,), block_size=10), TableConfig())
    owned = [i for i, b in enumerate(t.blocks) if b.replicas == ["s1"]]
    rec = st.register_server("s1", "h:1", "", "another-boot", now=1.0)
    assert rec.incarnation == 2 and rec.state is ServerState.JOINING
    for i in owned:   # R=1: its blocks were lost; re-created empty elsewhere, marked fresh
        b = t.blocks[i]
        assert b.replicas and b.replicas != ["s1"] and b.fresh_epoch == b.since_epoch


def test_ranks_rejoin_and_leases():
    st = make()
    a = st.join("j", "a", -1, "", None, 0, now=0.0)
    b = st.join("j", "b", -1, "", None, 0, now=0.0)
    assert (a.rank, b.rank) == (0, 1)
    again = st.join("j", "a", -1, a.session, None, 0, now=1.0)
    assert again.rank == 0 and again.incarnation == 2 and again.session == a.session
    st.worker_heartbeat("j", a.session, 2, 5, 0.0, 0.0, now=4.0)
    for name in ("s0", "s1", "s2"):
        st.server_heartbeat(name, 1, st.epoch, {}, now=6.0)
    assert st.expire(now=7.0) == ["worker:j/1"]
    c = st.join("j", "c", -1, "", None, 0, now=7.0)
    assert c.rank == 1
    with pytest.raises(FailedPrecondition, match="runs async .staleness 0.; this worker asked for sync"):
        st.join("j", "d", -1, "", Consistency.SYNC, 0, now=7.0)


def test_persistence_round_trip(tmp_path):
    st = make()
    st.create_table("j", dense_table("w", (50,), block_size=10), TableConfig(sgd(0.3)))
    st.join("j", "a", -1, "", None, 0, now=0.0)
    StateFile(tmp_path / "state.json").save(st)
    back = StateFile(tmp_path / "state.json").load(st.settings, now=100.0)
    assert back.shard_map() == st.shard_map()
    assert back.servers["s0"].last_heartbeat == 100.0


def test_drain_plans_moves_off_the_node_and_retires_it():
    st = make(3, 1)
    t, _ = st.create_table("j", dense_table("w", (300,), block_size=10), TableConfig())
    st.drain_server("s0")
    moves = st.plan_moves()
    assert moves and all("s0" not in m.target for m in moves)
    assert st.commit_moves(moves, now=1.0) == len(moves)
    assert all("s0" not in b.replicas for b in t.blocks)
    assert st.retire_drained() == ["s0"] and st.servers["s0"].retired


def _replica_counts(t):
    return sorted({len(b.replicas) for b in t.blocks})


def test_under_replicated_counts_against_r_when_too_few_servers_are_left():
    """1 of 3 servers left with R=2: every block has one copy and counts as under-replicated,
    and none of them can get R back until a server joins."""
    st = make(3, 2)
    t, _ = st.create_table("j", sparse_table("e", 4, num_blocks=30), TableConfig(sgd(0.1)))
    assert st.under_replicated() == 0
    st.server_heartbeat("s0", 1, st.epoch, {}, now=2.5)
    assert st.expire(now=4.0) == ["server:s1", "server:s2"]
    assert _replica_counts(t) == [1]
    assert st.under_replicated() == 30
    health = st.replication_health()
    assert (health.target, health.servers, health.under_replicated, health.unrestorable) == (2, 1, 30, 30)
    assert not health.target_reachable
    assert st.plan_moves() == []                     # nowhere to copy to


def test_under_replicated_blocks_are_restorable_while_r_servers_are_left():
    st = make(3, 2)
    t, _ = st.create_table("j", sparse_table("e", 4, num_blocks=30), TableConfig(sgd(0.1)))
    for name in ("s0", "s1"):
        st.server_heartbeat(name, 1, st.epoch, {}, now=2.5)
    st.expire(now=4.0)
    lost = sum(1 for b in t.blocks if len(b.replicas) < 2)
    health = st.replication_health()
    assert lost > 0 and health.under_replicated == lost and health.unrestorable == 0
    assert health.target_reachable
    assert st.commit_moves(st.plan_moves(), now=4.0) == lost
    assert st.under_replicated() == 0 and _replica_counts(t) == [2]


def test_tables_created_with_fewer_servers_than_r_get_r_when_servers_join():
    """What CreateTable promises (manager.proto): with fewer live servers than R the table is
    created under-replicated, not refused, and the missing replicas follow the servers."""
    st = make(1, 2)
    t, created = st.create_table("j", dense_table("w", (100,), block_size=10), TableConfig(sgd(0.1)))
    assert created and _replica_counts(t) == [1]
    health = st.replication_health()
    assert (health.under_replicated, health.unrestorable) == (10, 10)
    st.register_server("s1", "h:1", "", "boot1", now=1.0)
    assert st.replication_health().unrestorable == 0
    assert st.commit_moves(st.plan_moves(), now=1.0) == 10
    assert _replica_counts(t) == [2] and st.under_replicated() == 0


def test_a_table_needs_at_least_one_server():
    st = ManagerState(ManagerSettings(replication=2))
    st.create_job("j", Consistency.ASYNC, 0)
    with pytest.raises(FailedPrecondition, match="no live server"):
        st.create_table("j", dense_table("w", (10,)), TableConfig())


def test_a_cut_snapshots_every_block_once_from_its_primary_and_a_restore_loads_every_replica():
    st = make(3, 2)
    st.create_table("j", sparse_table("e", 4, num_blocks=12), TableConfig(sgd(0.1)))
    st.create_table("j", dense_table("w", (50,), block_size=10), TableConfig(sgd(0.1)))
    msg = st.shard_map()
    plan = plan_cut(msg, "j")
    assert not plan.unplaced and plan.epoch == st.epoch
    assert [s.name for s in plan.hold] == ["s0", "s1", "s2"]
    refs = [(r.table, r.block, index) for index, rs in plan.snapshots.items() for r in rs]
    assert len(refs) == 12 + 5
    for t in msg.tables:
        for b, bp in enumerate(t.blocks):
            assert (t.spec.name, b, bp.replicas[0]) in refs
    snaps = {"e": [f"e{b}" for b in range(12)], "w": [f"w{b}" for b in range(5)]}
    loads = plan_load(msg, "j", snaps)
    assert sum(len(v) for v in loads.values()) == 2 * (12 + 5)
    names = [s.name for s in msg.servers]
    for t in st.tables.values():
        for b, rec in enumerate(t.blocks):
            assert all(f"{t.spec.name}{b}" in loads[names.index(n)] for n in rec.replicas)


def test_a_cut_of_a_block_without_replica_says_which():
    st = make(1, 1)
    st.create_table("j", dense_table("w", (20,), block_size=10), TableConfig())
    msg = pb.ShardMap()
    msg.CopyFrom(st.shard_map())
    del msg.tables[0].blocks[1].replicas[:]
    assert plan_cut(msg, "j").unplaced == "block 1 of 'w' has no live replica: cannot checkpoint"


def test_a_worker_that_fetched_its_restored_state_stays_fetched_after_a_manager_restart(tmp_path):
    """GetWorkerState takes the rank off restore_pending; the runtime persists that although
    the epoch does not move (a restarted manager must not tell the worker to restore again)."""
    from shardps.server.manager.runtime import ManagerRuntime, RuntimeSettings
    from shardps.tables import Consistency as C
    path = tmp_path / "state.json"
    rt = ManagerRuntime(ManagerSettings(), RuntimeSettings(state_path=str(path)))
    try:
        rt.change(lambda s: s.create_job("j", C.ASYNC, 0))
        with rt.lock:       # as restore_job leaves it (which needs live servers)
            job = rt.state.jobs["j"]
            job.restored_path, job.restored_step, job.restore_pending = "/ck", 7, [0, 1]
        epoch = rt.state.epoch
        got = rt.change(lambda s: s.claim_restored_state("j", 0), wait_published=False)
        assert got == ("/ck", 7) and rt.state.epoch == epoch and not rt.state.unsaved
        back = StateFile(path).load(rt.settings, now=0.0)
        assert back.jobs["j"].restore_pending == [1]
    finally:
        rt.stop()


def test_nothing_is_acknowledged_while_the_state_cannot_be_saved(tmp_path):
    """A save that fails leaves the state in memory ahead of the store. Found by the HA test
    that cuts the leader off etcd: an idempotent CreateJob retried on the same manager
    changed nothing, skipped the save and was acknowledged, and the next leader had no such
    job. Every later call now saves first and raises while that fails."""
    from shardps.errors import Unavailable
    from shardps.server.manager.runtime import ManagerRuntime, RuntimeSettings
    from shardps.tables import Consistency as C

    class Flaky(StateFile):
        down = False

        def save(self, state):
            if self.down:
                raise Unavailable("etcd /kv/txn: no endpoint answered")
            super().save(state)

    store = Flaky(tmp_path / "state.json")
    rt = ManagerRuntime(ManagerSettings(), RuntimeSettings(), store=store)
    try:
        store.down = True
        for _ in range(2):               # the first try, then an idempotent retry
            with pytest.raises(Unavailable, match="no endpoint answered"):
                rt.change(lambda s: s.create_job("j", C.ASYNC, 0))
        assert not store.exists() or "j" not in store.load(rt.settings, now=0.0).jobs
        assert rt.published.epoch < rt.state.epoch            # not shown to anyone either
        store.down = False
        rt.change(lambda s: s.create_job("j", C.ASYNC, 0))
        assert "j" in store.load(rt.settings, now=0.0).jobs
        assert rt.published.epoch == rt.state.epoch
    finally:
        rt.stop()
