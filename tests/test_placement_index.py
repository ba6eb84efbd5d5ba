"""The manager's holder index (which blocks each server may hold) stays a superset of the
truth through every decision that changes the placement, so a death touches its own blocks."""

from shardps.server.manager import moves
from shardps.server.manager.records import ManagerSettings
from shardps.server.manager.state import ManagerState
from shardps.tables import Consistency, TableConfig, dense_table, sgd, sparse_table


def covers_the_truth(st):
    idx = moves.index(st)
    for name in st.servers:
        truth = {id(b) for t in st.tables.values() for b in t.blocks if name in b.replicas}
        indexed = {id(b) for b in idx.by_node.get(name, []) if id(b) not in idx.dropped}
        assert truth <= indexed, f"{name}: {len(truth - indexed)} blocks missing from the index"
    return True


def beat(st, now, *names):
    for n in names:
        st.server_heartbeat(n, st.servers[n].incarnation, st.epoch, {}, now=now)


def test_the_index_follows_deaths_moves_drains_restarts_and_tables():
    st = ManagerState(ManagerSettings(replication=2, server_lease_seconds=3.0))
    for i in range(5):
        st.register_server(f"s{i}", f"h:{i}", "", f"b{i}", now=0.0)
    st.create_job("j", Consistency.ASYNC, 0)
    st.create_table("j", sparse_table("e", 4, num_blocks=200), TableConfig(sgd(0.1)))
    assert covers_the_truth(st)
    st.create_table("j", dense_table("w", (1000,), block_size=10), TableConfig(sgd(0.1)))
    beat(st, 2.5, "s0", "s1", "s2", "s3")
    assert st.expire(now=4.0) == ["server:s4"]
    assert not any("s4" in b.replicas for t in st.tables.values() for b in t.blocks)
    assert covers_the_truth(st)
    assert st.commit_moves(st.plan_moves(), now=4.0) > 0 and st.under_replicated() == 0
    assert covers_the_truth(st)
    st.drain_server("s0")
    st.commit_moves(st.plan_moves(), now=4.0)
    assert st.retire_drained() == ["s0"] and covers_the_truth(st)
    st.register_server("s1", "h:1", "", "another-boot", now=4.5)      # a restart: fenced
    assert not any("s1" in b.replicas for t in st.tables.values() for b in t.blocks)
    st.commit_moves(st.plan_moves(), now=4.5)
    assert covers_the_truth(st)
    st.delete_table("j", "e")
    st.create_table("j", sparse_table("e", 4, num_blocks=50), TableConfig(sgd(0.1)))
    st.register_server("s5", "h:5", "", "b5", now=5.0)
    st.commit_moves(st.plan_moves(), now=5.0)
    assert covers_the_truth(st)
    beat(st, 6.0, "s1", "s2", "s5")
    assert st.expire(now=8.0) == ["server:s3"]
    assert not any("s3" in b.replicas for t in st.tables.values() for b in t.blocks)
    assert covers_the_truth(st)


def test_blocks_that_lost_every_replica_are_recreated_when_a_server_comes():
    st = ManagerState(ManagerSettings(replication=1, server_lease_seconds=3.0))
    for i in range(2):
        st.register_server(f"s{i}", f"h:{i}", "", f"b{i}", now=0.0)
    st.create_job("j", Consistency.ASYNC, 0)
    t, _ = st.create_table("j", dense_table("w", (300,), block_size=10), TableConfig())
    assert sorted(st.expire(now=4.0)) == ["server:s0", "server:s1"]
    assert all(b.replicas == [] for b in t.blocks) and st.replace_lost() == 0
    st.register_server("s2", "h:2", "", "b2", now=5.0)
    assert st.replace_lost() == 30
    assert all(b.replicas == ["s2"] and b.fresh_epoch == st.epoch for b in t.blocks)
    assert st.replace_lost() == 0 and covers_the_truth(st)
