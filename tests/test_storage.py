"""``server.storage.SparseRows`` directly: what a read returns for rows not stored, and that
a push storing rows a read just initialised copies those values (``InitCache``)."""

import numpy as np

from shardps.server.node.storage import InitCache, SparseRows
from shardps.tables import TableConfig, initial_values, normal, sgd, sparse_table, uniform


def _cached(rows: SparseRows, row: int) -> int:
    """The slot of ``row`` in the rows' cache of initial values (-1: not there)."""
    ids, ok, _ = rows.cache
    slot = int(np.uint64(row) % np.uint64(ids.shape[0]))
    return slot if ok[slot] and ids[slot] == row else -1


def test_rows_read_then_pushed_start_from_the_values_the_read_returned():
    init = normal(0.0, 0.01, seed=7)
    rows = SparseRows(sparse_table("e", 16, num_rows=1000, init=init))
    config = TableConfig(sgd(1.0))
    pulled = np.array([5, 900, 17, 5, 3], dtype=np.int64)           # repeats allowed
    got = rows.read(pulled)
    assert np.array_equal(got.view(np.uint32), initial_values(init, pulled, 16).view(np.uint32))
    assert all(_cached(rows, r) >= 0 for r in (5, 900, 17, 3)) and _cached(rows, 42) < 0
    rows.cache[2][_cached(rows, 17)] = 7.0          # the push copies what the read computed
    pushed = np.array([17, 3, 42, 900, 5], dtype=np.int64)           # 42 was never read
    rows.apply(config, pushed, np.ones((5, 16), np.float32))
    want = initial_values(init, pushed, 16) - 1.0
    want[0] = 6.0
    assert np.array_equal(rows.read(pushed), want)


def test_remembered_initial_values_stay_within_their_bytes():
    rows = SparseRows(sparse_table("e", 16, init=normal(0.0, 1.0, seed=2)))
    for k in range(40):
        rows.read(np.arange(k * 5000, (k + 1) * 5000, dtype=np.int64))
    ids, ok, values = rows.cache
    assert values.nbytes <= InitCache.MAX_BYTES and ids.shape[0] == values.shape[0] == ok.shape[0]
    assert ok.all() and _cached(rows, 40 * 5000 - 1) >= 0


def test_cheap_initialisers_are_not_remembered():
    rows = SparseRows(sparse_table("e", 4, init=uniform(-1.0, 1.0, seed=1)))
    rows.read(np.arange(10, dtype=np.int64))
    assert rows.cache[0].shape[0] == 0


def test_a_new_config_gets_its_optimizer_state_after_pushes_under_the_old_one():
    """The state a config needs is ensured once per config: a later config (momentum added,
    Adagrad's starting accumulator) is still honoured."""
    rows = SparseRows(sparse_table("e", 2, num_rows=100, init=uniform(0.0, 0.0, seed=1)))
    ids = np.array([4, 9], dtype=np.int64)
    plain = TableConfig(sgd(1.0))
    rows.apply_rows(plain, ids, np.ones((2, 2), np.float32))
    rows.apply_rows(plain, ids, np.ones((2, 2), np.float32))
    assert set(rows.state) == set() and np.array_equal(rows.read(ids), -2 * np.ones((2, 2), np.float32))
    momentum = TableConfig(sgd(1.0, momentum=0.5))
    rows.apply_rows(momentum, ids, np.ones((2, 2), np.float32))
    rows.apply_rows(momentum, ids, np.ones((2, 2), np.float32))
    assert set(rows.state) == {"momentum_buffer"}
    np.testing.assert_array_equal(rows.read(ids), -2 - 1 - 1.5 * np.ones((2, 2), np.float32))


def test_pushes_land_in_the_arrays_after_they_grow_or_move_between_pushes(monkeypatch):
    """The compiled kernels' arguments are kept between pushes (``SparseRows._bound``): pushes
    that grow the arrays, and rows stored by other paths in between (``assign_values``, which
    moves them too), still update the rows where they are now. Checked against the same
    sequence through the numpy path (no compiled kernels)."""
    from shardps import kernels
    from shardps.tables import adagrad

    init = normal(0.0, 0.1, seed=3)
    config = TableConfig(adagrad(0.5))
    rng = np.random.default_rng(0)
    steps = []
    for k in range(30):
        ids = np.unique(rng.integers(0, 50_000, 300 + 40 * k)).astype(np.int64)
        steps.append((ids, rng.standard_normal((ids.shape[0], 4)).astype(np.float32),
                      np.arange(60_000 + 100 * k, 60_000 + 100 * k + 90, dtype=np.int64)))

    def run() -> SparseRows:
        rows = SparseRows(sparse_table("e", 4, num_rows=100_000, init=init))
        for ids, grad, assigned in steps:
            rows.apply_rows(config, ids, grad)
            rows.assign_values(config, assigned, np.full((assigned.shape[0], 4), 2.0, np.float32))
        return rows

    compiled = run()
    assert compiled.rows.data.shape[0] > 4096          # grown (moved) several times
    monkeypatch.setattr(kernels, "AVAILABLE", False)
    plain = run()
    every = np.arange(100_000, dtype=np.int64)
    monkeypatch.setattr(kernels, "AVAILABLE", True)
    np.testing.assert_allclose(compiled.read(every), plain.read(every), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(compiled.state["sum"].take(compiled.lookup(every[compiled.lookup(every) >= 0])),
                               plain.state["sum"].take(plain.lookup(every[compiled.lookup(every) >= 0])),
                               rtol=1e-5, atol=1e-6)
