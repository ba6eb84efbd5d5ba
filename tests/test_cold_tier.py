"""The cold tier (``LifecyclePolicy.cold``): rows a sparse table's memory budget evicts move
to the server's local disk with their optimizer state and come back on their next push, so
a table trains as if it were unbounded while its RAM stays within the budget. Directly on
``SparseRows`` and on real in-process gRPC clusters (tests/conftest.py): replicas,
checkpoints restored onto another server count, exports, status and metrics."""

import os

import numpy as np
import pytest

from shardps.budget import set_lifecycle
from shardps.errors import InvalidArgument
from shardps.server.node.cold import cold_root
from shardps.server.node.lifecycle import limit_rows
from shardps.server.node.storage import SparseRows
from shardps.tables import LifecyclePolicy, TableConfig, adagrad, adam, normal, sparse_table
from tests.test_replication import replicas_equal

INIT = normal(0.0, 0.1, seed=5)
BLOCKS = 4


def _rows(num_rows: int = 0) -> SparseRows:
    return SparseRows(sparse_table("e", 4, num_rows=num_rows, num_blocks=BLOCKS, init=INIT))


def _stream(steps: int, seed: int = 0, ids: int = 3000):
    """(tick, unique ids, gradient) per step: a Zipf head that recurs and a tail that returns
    after it was evicted."""
    rng = np.random.default_rng(seed)
    out = []
    for tick in range(1, steps + 1):
        batch = np.unique(rng.zipf(1.2, 300) % ids).astype(np.int64)
        out.append((tick, batch, rng.standard_normal((batch.shape[0], 4)).astype(np.float32)))
    return out


def _train(rows: SparseRows, config: TableConfig, stream) -> None:
    for tick, ids, grad in stream:
        rows.apply(config, ids, grad, tick)


def _budget(rows_per_block: int) -> int:
    per_row = 4 * 4 * 3 + 4 + 12        # values, Adam's two states, tick, sorted index entry
    return BLOCKS * rows_per_block * per_row


@pytest.mark.parametrize("num_rows", [0, 3000])      # a sorted index / a direct one
def test_a_table_with_a_cold_tier_trains_bit_for_bit_as_an_unbounded_one(num_rows):
    stream = _stream(40)
    config = TableConfig(adam(0.01))
    unbounded, cold, evicting = _rows(num_rows), _rows(num_rows), _rows(num_rows)
    _train(unbounded, config, stream)
    _train(cold, TableConfig(adam(0.01), lifecycle=LifecyclePolicy(budget_bytes=_budget(60), cold=True)), stream)
    _train(evicting, TableConfig(adam(0.01), lifecycle=LifecyclePolicy(budget_bytes=_budget(60))), stream)
    every = np.arange(3000, dtype=np.int64)
    assert cold.cold is not None and cold.cold.count > 1000        # most rows live on disk
    assert cold.life is not None and cold.life.counters["cooled"] > 0 and cold.cold.counters["warmed"] > 0
    limit = limit_rows(cold, cold.life.policy)
    assert (cold.block_counts <= limit).all(), (cold.block_counts, limit)      # RAM stays within the budget
    np.testing.assert_array_equal(cold.read(every), unbounded.read(every))
    assert not np.array_equal(evicting.read(every), unbounded.read(every))      # without it, rows start afresh
    assert cold.memory_bytes() * 3 < unbounded.memory_bytes()


def test_pulls_read_the_cold_tier_without_moving_rows_and_pushes_bring_them_back():
    rows = _rows()
    config = TableConfig(adagrad(0.1), lifecycle=LifecyclePolicy(budget_bytes=_budget(10), cold=True))
    first = np.arange(0, 200, dtype=np.int64)
    rows.apply(config, first, np.ones((200, 4), np.float32), 1)
    rows.apply(config, first + 1000, np.ones((200, 4), np.float32), 2)   # the first ones go cold
    assert rows.cold is not None
    cold_ids = rows.cold.stored()[0]
    assert np.isin(first, cold_ids).sum() > 150
    before = rows.cold.count
    expected = rows.read(first)
    assert rows.cold.count == before and rows.cold.counters["read"] > 150   # a pull moves nothing
    assert not np.allclose(expected, rows.initial(first))                   # trained values, not initial ones
    rows.apply(config, first[:5], np.zeros((5, 4), np.float32), 3)          # a zero gradient under Adagrad
    assert (rows.lookup(first[:5]) >= 0).all() and rows.cold.lookup(first[:5]).max() == -1
    np.testing.assert_array_equal(rows.read(first[:5]), expected[:5])


def test_ttl_expires_rows_in_the_cold_tier_too_counted():
    rows = _rows()
    config = TableConfig(adagrad(0.1), lifecycle=LifecyclePolicy(budget_bytes=_budget(10), ttl_steps=8, cold=True))
    rows.apply(config, np.arange(200, dtype=np.int64), np.ones((200, 4), np.float32), 1)
    assert rows.cold is not None and rows.cold.count > 100
    for tick in range(2, 30):
        rows.apply(config, np.arange(5000, 5010, dtype=np.int64), np.ones((10, 4), np.float32), tick)
    assert rows.cold.count == 0 and rows.cold.counters["expired"] > 100
    assert rows.life is not None and rows.life.counters["evicted_ttl"] >= rows.cold.counters["expired"]
    np.testing.assert_array_equal(rows.read(np.arange(3, dtype=np.int64)), rows.initial(np.arange(3)))


def test_a_cold_tier_needs_a_budget_and_a_writable_directory(tmp_path):
    with pytest.raises(InvalidArgument, match="cold=True needs budget_bytes"):
        TableConfig(lifecycle=LifecyclePolicy(cold=True)).validate()
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with pytest.raises(ValueError, match=f"cold-dir '{blocked}/x'"):
        cold_root(str(blocked / "x"))
    assert cold_root(str(tmp_path / "new")) == str(tmp_path / "new")


def test_the_cold_files_leave_nothing_on_disk(tmp_path):
    rows = SparseRows(sparse_table("e", 4, num_blocks=BLOCKS, init=INIT), str(tmp_path))
    config = TableConfig(adagrad(0.1), lifecycle=LifecyclePolicy(budget_bytes=_budget(10), cold=True))
    rows.apply(config, np.arange(500, dtype=np.int64), np.ones((500, 4), np.float32), 1)
    assert rows.cold is not None and rows.cold.count > 400 and rows.cold.disk_bytes() > 0
    assert os.listdir(tmp_path) == []          # unlinked once opened: the process holds the space


# ---------------------------------------------------------------- clusters

def _setup(cluster, client_factory, policy: LifecyclePolicy, job: str = "cold"):
    c = client_factory(cluster.address, job=job, timeout=30)
    c.create_job()
    c.create_sparse("e", 4, optimizer=adagrad(0.1), num_blocks=8, init=INIT)
    set_lifecycle(c, "e", policy)
    return c


def _server_rows(cluster, job: str = "cold"):
    return [s.node.table.sparse_rows[(job, "e")] for s in cluster.servers.values()
            if (job, "e") in s.node.table.sparse_rows]


def _push_stream(c, stream):
    for tick, ids, grad in stream:
        c.push_rows("e", ids, grad, clock=tick)


ROW_BYTES = 4 * 4 * 2 + 4 + 12        # values, Adagrad's sum, tick, sorted index entry
POLICY = LifecyclePolicy(budget_bytes=8 * 15 * ROW_BYTES, cold=True)     # 15 rows a block


def test_replicas_keep_the_same_cold_rows(make_cluster, client_factory):
    cluster = make_cluster(3, replication=2)
    c = _setup(cluster, client_factory, POLICY)
    _push_stream(c, _stream(20, seed=3))
    rows = _server_rows(cluster)
    assert sum(r.cold.count for r in rows if r.cold is not None) > 1000
    assert sum(r.life.counters["evicted_replicated"] for r in rows if r.life is not None) > 0
    assert replicas_equal(cluster, "cold", "e") == 8          # both tiers, in the digest


def test_a_table_ten_times_its_budget_checkpoints_and_restores_bit_identical(make_cluster, client_factory,
                                                                             tmp_path):
    stream = _stream(30, seed=4)
    every = np.arange(3000, dtype=np.int64)
    first = make_cluster(2)
    first.manager.service.checkpoints.default_dir = str(tmp_path)
    c = _setup(first, client_factory, POLICY)
    _push_stream(c, stream[:20])
    rows = _server_rows(first)
    hot, cold = sum(int(r.block_counts.sum()) for r in rows), sum(r.cold.count for r in rows if r.cold)
    assert hot + cold >= 10 * 8 * 15, (hot, cold)             # 10 x the budget's rows
    assert all((r.block_counts <= limit_rows(r, POLICY)).all() for r in rows)     # RAM within the budget
    path = c.checkpoint().path
    expected = c.pull_rows("e", every)
    exported = c.state_dict(["e"])                            # every stored row, of both tiers
    np.testing.assert_array_equal(exported["e.ids"], np.sort(np.concatenate(
        [r.index.stored()[0] for r in rows] + [r.cold.stored()[0] for r in rows if r.cold])))
    np.testing.assert_array_equal(exported["e.rows"], c.pull_rows("e", exported["e.ids"]))
    _push_stream(c, stream[20:])
    after = c.pull_rows("e", every)
    second = make_cluster(3)                                  # another server count
    second.manager.service.checkpoints.default_dir = str(tmp_path)
    c2 = client_factory(second.address, job="cold", timeout=30)
    c2.restore(path)
    assert sum(r.cold.count for r in _server_rows(second) if r.cold) == cold     # the cold rows came back cold
    np.testing.assert_array_equal(c2.pull_rows("e", every), expected)
    _push_stream(c2, stream[20:])                               # and trains on identically
    np.testing.assert_array_equal(c2.pull_rows("e", every), after)


def test_status_and_metrics_show_both_tiers(make_cluster, client_factory):
    from shardps.status import budget_rows, fetch_node_statuses, format_budgets
    cluster = make_cluster(2)
    c = _setup(cluster, client_factory, POLICY)
    _push_stream(c, _stream(10, seed=5))
    pulled = np.arange(0, 400, dtype=np.int64)
    c.pull_rows("e", pulled)
    nodes = fetch_node_statuses(c.cluster_status())
    (row,) = budget_rows(nodes)
    rows = _server_rows(cluster)
    assert row["rows"] == sum(int(r.block_counts.sum()) for r in rows) > 0
    assert row["cold_rows"] == sum(r.cold.count for r in rows if r.cold) > 0
    assert row["cold_bytes"] == sum(r.cold.disk_bytes() for r in rows if r.cold) > 0
    assert row["rows_cooled"] >= row["cold_rows"] and row["rows_evicted_budget"] == 0     # nothing lost
    text = format_budgets(nodes)
    assert "COLD ROWS" in text and str(row["cold_rows"]) in text
    for server in cluster.servers.values():
        server.node.publish_usage(server.node.usage())

    def total(name, **labels):
        return sum(s.node.metrics.registry.get_sample_value(name, {"training_job": "cold", "table": "e", **labels})
                   or 0 for s in cluster.servers.values())

    assert total("shardps_table_cold_rows") == row["cold_rows"]
    assert total("shardps_table_cold_bytes") == row["cold_bytes"]
    assert total("shardps_table_cold_moves_total", event="written") == row["rows_cooled"]
    assert total("shardps_table_cold_moves_total", event="read") > 0
    labels = {"training_job": "cold", "table": "e"}
    hit = [s.node.metrics.registry.get_sample_value("shardps_table_hot_hit_ratio", labels)
           for s in cluster.servers.values()]
    assert all(h is not None and 0 < h < 1 for h in hit), hit


def test_a_full_disk_keeps_the_rows_in_ram_and_loses_nothing(tmp_path, caplog):
    """The file-size limit (RLIMIT_FSIZE) makes the cold tier's next allocation fail as a
    full disk would (EFBIG; ENOSPC alike): the rows it could not take stay in RAM, above the
    budget, logged; every value stays as an unbounded table has it, and the tier takes rows
    again once there is room."""
    import resource
    import signal
    rng = np.random.default_rng(9)
    stream = []
    for tick in range(1, 13):              # 500 new ids a step, and the first 100 again
        ids = np.concatenate([np.arange(100), np.arange(tick * 500, tick * 500 + 500)]).astype(np.int64)
        stream.append((tick, ids, rng.standard_normal((ids.shape[0], 4)).astype(np.float32)))
    unbounded = _rows()
    _train(unbounded, TableConfig(adagrad(0.1)), stream)
    rows = SparseRows(sparse_table("e", 4, num_blocks=BLOCKS, init=INIT), str(tmp_path))
    config = TableConfig(adagrad(0.1), lifecycle=LifecyclePolicy(budget_bytes=_budget(10), cold=True))
    _train(rows, config, stream[:2])
    assert rows.cold is not None and 0 < rows.cold.count
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (rows.cold.values.disk_bytes(), limit[1]))   # no room to grow
    try:
        _train(rows, config, stream[2:8])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, previous)
    assert "stay in RAM above its memory budget" in caplog.text
    assert (rows.block_counts > limit_rows(rows, config.lifecycle)).any()         # over the budget, loudly
    every = np.arange(6600, dtype=np.int64)
    _train(rows, config, stream[8:])                                               # room again
    assert (rows.block_counts <= limit_rows(rows, config.lifecycle)).all()
    np.testing.assert_array_equal(rows.read(every), unbounded.read(every))
