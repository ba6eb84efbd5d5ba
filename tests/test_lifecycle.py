"""Sparse tables within a memory budget (issue 18): admission by frequency, TTL and budget
eviction (LRU on the job's clock), consistent across replicas and checkpoints. Real
in-process gRPC clusters (tests/conftest.py); the storage rules also directly on
``SparseRows``."""

import numpy as np
import pytest

from shardps.budget import set_lifecycle
from shardps.errors import InvalidArgument
from shardps.id_blocks import sparse_block_of
from shardps.server.node.lifecycle import LOW_WATERMARK, SKETCH_BYTES, limit_rows
from shardps.server.node.storage import SparseRows
from shardps.tables import (
    LifecyclePolicy,
    TableConfig,
    adagrad,
    initial_values,
    normal,
    sgd,
    sparse_table,
)
from tests.test_replication import replicas_equal

INIT = normal(0.0, 0.1, seed=3)


def _rows(policy: LifecyclePolicy, num_blocks: int = 4) -> tuple[SparseRows, TableConfig]:
    return SparseRows(sparse_table("e", 4, num_blocks=num_blocks, init=INIT)), TableConfig(sgd(0.5), lifecycle=policy)


def _push(rows: SparseRows, config: TableConfig, ids, tick: int):
    ids = np.asarray(ids, dtype=np.int64)
    return rows.apply(config, ids, np.ones((ids.shape[0], 4), np.float32), tick)


def _stored(rows: SparseRows) -> set[int]:
    return set(rows.index.stored()[0].tolist())


@pytest.mark.parametrize("field, value, named", [
    ("budget_bytes", -1, "budget_bytes=-1"), ("admit_after", 256, "admit_after=256"),
    ("ttl_steps", -5, "ttl_steps=-5"), ("ttl_seconds", float("nan"), "ttl_seconds=nan"),
])
def test_bad_policy_values_are_refused_naming_the_value(field, value, named):
    with pytest.raises(InvalidArgument, match=named):
        TableConfig(lifecycle=LifecyclePolicy(**{field: value})).validate()


def test_admission_stores_a_row_from_its_kth_push_and_drops_earlier_gradients():
    rows, config = _rows(LifecyclePolicy(admit_after=3))
    ids = np.arange(10, 20)
    for tick in (1, 2):
        out = _push(rows, config, ids, tick)
        assert sorted(out.dropped.tolist()) == ids.tolist() and not _stored(rows)
    np.testing.assert_array_equal(rows.read(ids), initial_values(INIT, ids, 4))   # nothing applied yet
    out = _push(rows, config, ids, 3)
    assert out.dropped.size == 0 and _stored(rows) == set(ids.tolist())
    # the admitting push's gradient is the first one applied: init - lr * 1
    np.testing.assert_allclose(rows.read(ids), initial_values(INIT, ids, 4) - 0.5, rtol=1e-6)
    c = rows.life.counters
    assert (c["not_admitted"], c["admitted"]) == (20, 10)


def test_budget_evicts_least_recently_pushed_rows_per_block_ties_by_id():
    rows, config = _rows(LifecyclePolicy(ttl_steps=1000), num_blocks=1)
    _push(rows, config, [0], 0)                                 # creates the per-row ticks
    per_row = rows.row_bytes()
    config = config.replace(lifecycle=LifecyclePolicy(budget_bytes=10 * per_row))
    assert limit_rows(rows, config.lifecycle) == 10
    for tick, ids in enumerate([range(1, 5), range(5, 9), range(9, 12)], start=1):
        _push(rows, config, list(ids), tick)
    # 12 rows pushed at ticks 0,1x4,2x4,3x3 with room for 10: down to 95% (9): the three
    # oldest go: id 0 (tick 0), then ids 1 and 2 (tick 1, smaller ids first)
    assert _stored(rows) == set(range(3, 12))
    assert rows.life.counters["evicted_budget"] == 3
    _push(rows, config, [3], 4)                                  # touching a row makes it recent
    _push(rows, config, [20, 21], 5)
    assert 3 in _stored(rows) and 4 not in _stored(rows)
    assert int(rows.block_counts.sum()) <= 10


def test_ttl_in_steps_evicts_rows_unseen_for_longer_than_the_ttl():
    rows, config = _rows(LifecyclePolicy(ttl_steps=8))
    _push(rows, config, np.arange(0, 50), 1)
    _push(rows, config, np.arange(50, 60), 5)
    _push(rows, config, np.arange(0, 50), 9)           # block clocks move into a new interval
    _push(rows, config, np.arange(60, 70), 14)         # 50..59 were last pushed 9 steps ago
    assert _stored(rows) == set(range(0, 50)) | set(range(60, 70))
    assert rows.life.counters["evicted_ttl"] == 10
    np.testing.assert_array_equal(rows.read(np.arange(50, 60)), initial_values(INIT, np.arange(50, 60), 4))
    assert rows.life.counters["pulled_evicted"] == 10


def test_ttl_in_seconds_evicts_rows_whose_tick_ended_longer_ago_than_the_ttl():
    """A tick's rows expire once a later tick began more than ``ttl_seconds`` before the push
    that scans (the primary maps ticks to the wall time it first saw them)."""
    rows, config = _rows(LifecyclePolicy(ttl_seconds=10.0))

    def push(ids, tick, wall):
        ids = np.asarray(ids, dtype=np.int64)
        rows.apply(config, ids, np.ones((ids.shape[0], 4), np.float32), tick, wall)

    push(range(0, 50), 1, 100.0)
    push(range(50, 60), 2, 105.0)
    push(range(60, 70), 3, 112.0)         # tick 2 began 7 s ago: tick 1's rows are kept
    assert _stored(rows) == set(range(70))
    push(range(70, 80), 4, 116.0)         # tick 2 began 11 s ago: tick 1's rows expire
    assert _stored(rows) == set(range(50, 80))
    assert rows.life.counters["evicted_ttl"] == 50
    push(range(80, 81), 5, 116.5)         # within ttl_seconds / 8 of the last scan: no scan
    assert _stored(rows) == set(range(50, 81))
    # ticks 2-4 ended over 10 s ago; tick 5 ended only when tick 6 began, now: its row stays.
    # The scan covers the blocks this push reaches (all of them here)
    push(range(100, 140), 6, 140.0)
    assert set(sparse_block_of(np.arange(100, 140), 4).tolist()) == set(range(4))
    assert _stored(rows) == {80} | set(range(100, 140))


def test_removed_slots_are_reused_and_memory_follows_the_budget():
    rows, config = _rows(LifecyclePolicy(admit_after=2), num_blocks=2)
    budget = 2 * (SKETCH_BYTES + 100 * 40)
    config = config.replace(lifecycle=LifecyclePolicy(admit_after=2, budget_bytes=budget))
    peak = 0
    for tick in range(1, 40):
        ids = np.arange(tick * 30, tick * 30 + 60)          # each id pushed on two ticks
        _push(rows, config, ids, tick)
        peak = max(peak, rows.memory_bytes())
    limit = limit_rows(rows, config.lifecycle)
    assert limit > 0 and int(rows.block_counts.max()) <= limit
    assert peak <= budget * 1.05, (peak, budget)
    assert rows.used <= 2 * limit + 60                   # slots freed by evictions were reused
    assert int(rows.block_counts.min()) >= int(limit * LOW_WATERMARK) - 1


# ---------------------------------------------------------------- clusters

def _setup(cluster, client_factory, policy: LifecyclePolicy, num_blocks: int = 8, job: str = "lc",
           join: bool = True):
    c = client_factory(cluster.address, job=job, timeout=30)
    c.create_job()
    if join:
        c.join(heartbeat=False)
    c.create_sparse("e", 4, optimizer=adagrad(0.1), num_blocks=num_blocks, init=INIT)
    config = set_lifecycle(c, "e", policy)
    assert config.lifecycle == policy and config.version >= 1
    return c


def _server_rows(cluster, job: str = "lc"):
    return [s.node.table.sparse_rows[(job, "e")] for s in cluster.servers.values()
            if (job, "e") in s.node.table.sparse_rows]


def test_policy_is_refused_by_the_manager_and_changed_while_training(make_cluster, client_factory):
    cluster = make_cluster(2)
    c = _setup(cluster, client_factory, LifecyclePolicy(admit_after=2))
    from shardps.protos.v1 import manager_pb2 as mg
    from shardps.rpc.convert import config_to_proto
    bad = config_to_proto(TableConfig(adagrad(0.1)))
    bad.lifecycle.admit_after = 999
    with pytest.raises(InvalidArgument, match="admit_after=999"):
        c._admin.call("UpdateTableConfig", c._admin.stub.UpdateTableConfig,
                      mg.UpdateTableConfigRequest(job="lc", table="e", config=bad), 10)
    ids = np.arange(2000)
    for step in range(1, 4):
        c.push_rows("e", ids, np.ones((2000, 4), np.float32), clock=step)
    assert sum(int(r.block_counts.sum()) for r in _server_rows(cluster)) == 2000
    row_bytes = _server_rows(cluster)[0].row_bytes()
    budget = 8 * (SKETCH_BYTES + 100 * row_bytes)               # 100 rows a block
    set_lifecycle(c, "e", LifecyclePolicy(admit_after=2, budget_bytes=budget))
    few = ids[:64]
    assert set(sparse_block_of(few, 8).tolist()) == set(range(8))     # one push reaches every block
    c.push_rows("e", few, np.ones((64, 4), np.float32), clock=4)           # one eviction pass per block
    counts = sum(r.block_counts for r in _server_rows(cluster))
    assert (counts <= 100).all() and (counts >= 90).all(), counts


def test_backups_stay_identical_after_admission_and_eviction(make_cluster, client_factory):
    cluster = make_cluster(3, replication=2)
    c = _setup(cluster, client_factory, LifecyclePolicy(admit_after=2, ttl_steps=6), num_blocks=6)
    rng = np.random.default_rng(1)
    row_bytes = None
    for step in range(1, 25):
        ids = np.unique(rng.zipf(1.3, 600) % 5000)
        c.push_rows("e", ids, rng.standard_normal((ids.shape[0], 4)).astype(np.float32), clock=step)
        if step == 8:
            row_bytes = _server_rows(cluster)[0].row_bytes()
            set_lifecycle(c, "e", LifecyclePolicy(admit_after=2, ttl_steps=6,
                                                  budget_bytes=6 * (SKETCH_BYTES + 40 * row_bytes)))
    counters = [r.life.counters for r in _server_rows(cluster)]
    assert sum(x["evicted_budget"] for x in counters) > 0 and sum(x["evicted_ttl"] for x in counters) > 0
    assert sum(x["evicted_replicated"] for x in counters) > 0
    assert replicas_equal(cluster, "lc", "e") == 6          # rows, optimizer state, sketches, ticks


def test_checkpoint_restore_onto_more_servers_keeps_counters_and_decisions(make_cluster, client_factory, tmp_path):
    """The sketches, row ticks and block clocks travel in the checkpoint: after a restore
    onto 3 servers instead of 2, the same pushes admit and evict exactly the same rows."""
    rng = np.random.default_rng(2)
    stream = [np.unique(rng.zipf(1.2, 2000) % 20000) for _ in range(12)]
    every = np.arange(20000)

    def run(c, steps):
        for step in steps:
            c.push_rows("e", stream[step], np.full((stream[step].shape[0], 4), 0.1, np.float32), clock=step + 1)

    def stored(cluster):
        return sorted(i for r in _server_rows(cluster) for i in r.index.stored()[0].tolist())

    def evicted(cluster):
        return sum(r.life.counters["evicted_budget"] for r in _server_rows(cluster))

    first = make_cluster(2)
    first.manager.service.checkpoints.default_dir = str(tmp_path)
    policy = LifecyclePolicy(admit_after=2, budget_bytes=8 * (SKETCH_BYTES + 30 * 48))  # 30 rows a block
    c = _setup(first, client_factory, policy, join=False)     # no barrier to wait for
    run(c, range(6))
    path = c.checkpoint().path
    before = evicted(first)
    run(c, range(6, 12))
    assert evicted(first) > before > 0
    expected_rows, expected_values = stored(first), c.pull_rows("e", every)
    second = make_cluster(3)                                 # another server count
    second.manager.service.checkpoints.default_dir = str(tmp_path)
    c2 = client_factory(second.address, job="lc", timeout=30)
    c2.restore(path)
    assert c2.table("e").config.lifecycle == policy
    run(c2, range(6, 12))
    assert evicted(second) > 0
    assert stored(second) == expected_rows, "the same rows were admitted and evicted after the restore"
    np.testing.assert_array_equal(c2.pull_rows("e", every), expected_values)


def test_status_and_metrics_show_budget_use_and_row_counters(make_cluster, client_factory):
    from shardps.status import budget_rows, fetch_node_statuses, format_budgets
    cluster = make_cluster(2)
    c = _setup(cluster, client_factory, LifecyclePolicy(admit_after=2, budget_bytes=8 * (SKETCH_BYTES + 20 * 48)))
    ids = np.arange(3000)
    for step in (1, 2):
        c.push_rows("e", ids, np.ones((3000, 4), np.float32), clock=step)
    c.pull_rows("e", np.arange(2900, 3100))                  # 100 stored or evicted, 100 never pushed
    nodes = fetch_node_statuses(c.cluster_status())
    (row,) = budget_rows(nodes)
    assert row["budget_bytes"] == 8 * (SKETCH_BYTES + 20 * 48) and 0 < row["bytes"] <= row["budget_bytes"]
    # every id is admitted on its second push; a count-min sketch may overestimate (a few
    # ids colliding in every row are admitted on their first)
    assert row["rows_admitted"] == 3000 and 2990 <= row["rows_not_admitted"] <= 3000
    assert row["rows_evicted_budget"] == 3000 - row["rows"]
    text = format_budgets(nodes)
    assert "lc/e" in text and "%" in text and "EVICTED BUDGET" in text
    for server in cluster.servers.values():
        server.node.publish_usage(server.node.usage())
    m = cluster.servers["s0"].node.metrics.registry
    budget = sum(s.node.metrics.registry.get_sample_value("shardps_table_budget_bytes",
                                                          {"training_job": "lc", "table": "e"}) or 0
                 for s in cluster.servers.values())
    assert budget == row["budget_bytes"]
    assert m.get_sample_value("shardps_table_lifecycle_rows", {"training_job": "lc", "table": "e",
                                                                "event": "not_admitted"}) > 0
    miss = sum(s.node.metrics.registry.get_sample_value(
        "shardps_table_pull_miss_ratio", {"training_job": "lc", "table": "e", "reason": "not_admitted"}) or 0
        for s in cluster.servers.values())
    assert miss > 0                               # the 100 never-pushed ids (sketch count 0)


def test_a_policy_set_at_creation_survives_an_optimizer_change(make_cluster, client_factory):
    """``create_sparse(..., lifecycle=)`` installs the policy; ``update_config(lr=...)``
    changes the optimizer and keeps the policy (and ``lifecycle=`` replaces it)."""
    from shardps.tables import LifecyclePolicy, sgd
    cluster = make_cluster(1)
    c = client_factory(cluster.address, job="keep-policy")
    c.create_job()
    policy = LifecyclePolicy(budget_bytes=1 << 20, admit_after=2)
    c.create_sparse("e", 4, optimizer=sgd(0.1), lifecycle=policy)
    assert c.table("e").config.lifecycle == policy
    c.update_config("e", lr=0.5)
    config = c.refresh_map().table("keep-policy", "e").config
    assert config.optimizer.lr == 0.5 and config.lifecycle == policy
    c.update_config("e", lifecycle=LifecyclePolicy())
    assert c.refresh_map().table("keep-policy", "e").config.lifecycle == LifecyclePolicy()


def test_oldest_rows_compiled_and_numpy_choose_alike(monkeypatch):
    """The eviction choice (oldest per block, ties by the order given) is the same compiled
    and in the numpy fallback."""
    from shardps.server.node import storage_kernels
    rng = np.random.default_rng(7)
    blocks, seen = rng.integers(0, 6, 5000), rng.integers(0, 30, 5000)
    excess = rng.integers(0, 900, 6)
    compiled = storage_kernels.oldest_rows(blocks, seen, excess)
    monkeypatch.setattr(storage_kernels, "AVAILABLE", False)
    np.testing.assert_array_equal(storage_kernels.oldest_rows(blocks, seen, excess), compiled)
    assert compiled.sum() == sum(min(e, (blocks == k).sum()) for k, e in enumerate(excess))
