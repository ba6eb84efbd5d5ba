"""The compiled kernels equal the numpy code they replace (``shardps.kernels``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shardps import id_blocks, kernels
from shardps.rpc import sockio, step, step_reply
from shardps.server import optimizers
from shardps.server.node import optimizer_kernels
from shardps.tables import adagrad, adam, constant, initial_values, normal, sgd, uniform, zeros
from shardps.worker import lookup_kernels
from shardps.worker.client import request_kernels

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not kernels.AVAILABLE, reason="numba is not installed")

CONFIGS = {
    "sgd": sgd(0.1),
    "sgd-momentum": sgd(0.1, momentum=0.9, dampening=0.1),
    "sgd-nesterov-wd": sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adagrad": adagrad(0.05),
    "adagrad-decay-wd": adagrad(0.05, lr_decay=0.01, weight_decay=0.001),
    "adam": adam(1e-2),
    "adam-wd": adam(1e-2, weight_decay=0.01),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_sparse_rows_update_equals_the_numpy_optimizer(name):
    config = CONFIGS[name]
    rng = np.random.default_rng(1)
    capacity, dim = 500, 8
    rows = rng.standard_normal((capacity, dim)).astype(np.float32)
    state = {k: np.abs(rng.standard_normal((capacity, dim))).astype(np.float32)
             for k in optimizers.state_names(config)}
    steps = np.zeros(capacity, np.int32) if optimizers.needs_row_steps(config) else None
    ref_rows, ref_state = rows.copy(), {k: v.copy() for k, v in state.items()}
    ref_steps = None if steps is None else steps.copy()
    for _ in range(4):                     # rows at different step counts, some on their first
        slots = np.sort(rng.choice(capacity, 120, replace=False))
        grad = rng.standard_normal((120, dim)).astype(np.float32)
        optimizer_kernels.apply_rows(config, rows, state, steps, slots, grad)
        params = ref_rows[slots]
        st = {k: v[slots] for k, v in ref_state.items()}
        step = 1
        if ref_steps is not None:
            ref_steps[slots] += 1
            step = ref_steps[slots][:, None]
        optimizers.apply(config, params, grad, st, step)
        ref_rows[slots] = params
        for k, v in st.items():
            ref_state[k][slots] = v
    np.testing.assert_allclose(rows, ref_rows, rtol=2e-6, atol=2e-7)
    for k in state:
        np.testing.assert_allclose(state[k], ref_state[k], rtol=2e-6, atol=2e-7)
    if steps is not None:
        np.testing.assert_array_equal(steps, ref_steps)


@pytest.mark.parametrize("n, high", [(0, 10), (1, 10), (100, 5), (13_312, 1 << 40), (50_000, 3_000)])
def test_deduplication_equals_numpy(n, high):
    """``unique_inverse`` sorts as ``np.unique``; ``first_unique`` keeps the order of first
    appearance; ``distinct`` says whether an id repeats, in any order."""
    rng = np.random.default_rng(n)
    ids = rng.integers(-high, high, n, dtype=np.int64)
    unique, inverse = kernels.unique_inverse(ids)
    ref_unique, index, ref_inverse = np.unique(ids, return_index=True, return_inverse=True)
    np.testing.assert_array_equal(unique, ref_unique)
    np.testing.assert_array_equal(inverse, ref_inverse.reshape(-1))
    first, inverse = kernels.first_unique(ids)
    np.testing.assert_array_equal(first, ids[np.sort(index)])
    np.testing.assert_array_equal(first[inverse], ids)
    assert kernels.distinct(ids) == (unique.shape[0] == n)
    shuffled = rng.permutation(unique)
    assert kernels.distinct(shuffled) and kernels.distinct(unique)
    if unique.shape[0] > 1:
        assert not kernels.distinct(np.concatenate([shuffled, shuffled[-1:]]))


def test_coalesce_keeps_unique_ids_in_their_order_and_sums_repeated_ones():
    ids = np.array([9, 3, 7, 1], dtype=np.int64)
    values = np.arange(8, dtype=np.float32).reshape(4, 2)
    same_ids, same_values = kernels.coalesce(ids, values, keep_order=True)
    assert same_ids is ids and same_values is values              # as given: no sort, no copy
    sorted_ids, sorted_values = kernels.coalesce(ids, values)
    np.testing.assert_array_equal(sorted_ids, [1, 3, 7, 9])
    np.testing.assert_array_equal(sorted_values, values[[3, 1, 2, 0]])
    summed_ids, summed = kernels.coalesce(np.array([9, 3, 9], dtype=np.int64), values[:3], keep_order=True)
    np.testing.assert_array_equal(summed_ids, [3, 9])
    np.testing.assert_array_equal(summed, [values[1], values[0] + values[2]])


@pytest.mark.parametrize("n, high", [(0, 1), (1, 1), (7, 3), (2000, 300), (3000, 3000)])
def test_sum_rows_adds_each_ids_rows_in_the_order_given_compiled_or_not(n, high):
    """SYNC steps sum every worker's rows of an id: one after another in the order pushed,
    so that a table applied at once and block by block give the same bits (numpy's
    ``reduceat`` adds four rows in another order)."""
    from shardps.server.node import storage_kernels

    rng = np.random.default_rng(n)
    ids = rng.integers(0, high, n).astype(np.int64)
    rows = (rng.standard_normal((n, 8)) * rng.choice([1e-8, 1.0, 1e8], (n, 8))).astype(np.float32)
    if n:
        rows[0, 0] = -0.0                      # a first row is copied: -0.0 stays -0.0
    expected: dict[int, np.ndarray] = {}
    for i, x in enumerate(ids.tolist()):
        expected[x] = expected[x] + rows[i] if x in expected else rows[i].copy()
    for sum_rows in (storage_kernels.sum_rows, storage_kernels._sum_rows_numpy):
        got_ids, got = sum_rows(ids, rows)
        assert got_ids.tolist() == list(expected)                    # order of first appearance
        assert got.shape == (len(expected), 8) and got.dtype == np.float32
        for k, x in enumerate(got_ids.tolist()):
            np.testing.assert_array_equal(got[k].view(np.uint32), expected[x].view(np.uint32))


@pytest.mark.parametrize("unique", [False, True])
def test_scan_finds_unique_ids_in_any_order_when_asked(unique):
    from shardps.server.node import storage_kernels
    ids = np.array([40, 3, 17, 8], dtype=np.int64)
    status, blocks, counts = storage_kernels.scan(ids, 100, 4, unique=unique)
    assert status == (1 if unique else 0) and counts.sum() == 4
    np.testing.assert_array_equal(blocks, id_blocks.sparse_block_of(ids, 4))
    assert storage_kernels.scan(np.sort(ids), 100, 4)[0] == 1
    assert storage_kernels.scan(np.array([40, 3, 40], dtype=np.int64), 100, 4, unique=True)[0] == 0
    assert storage_kernels.scan(np.array([40, 3, 100], dtype=np.int64), 100, 4, unique=True)[0] == -3


@pytest.mark.parametrize("n", [0, 1, 63, 64, 13_312])
@pytest.mark.parametrize("num_blocks", [1, 7, 64])
def test_block_of_and_grouping_equal_the_numpy_reference(n, num_blocks):
    from shardps.tables import group_by_block
    rng = np.random.default_rng(n + num_blocks)
    ids = rng.integers(-(1 << 62), 1 << 62, n, dtype=np.int64)
    blocks = id_blocks.sparse_block_of(ids, num_blocks)
    assert blocks.dtype == np.int64
    assert np.array_equal(blocks, id_blocks.reference_block_of(ids, num_blocks))
    # the rule of one id, as every compiled kernel inlines it
    assert [int(id_blocks.block_of_id(x, np.uint64(num_blocks))) for x in ids[:64]] == blocks[:64].tolist()
    got, want = kernels.group_by_key(blocks, num_blocks), group_by_block(blocks)
    assert [k for k, _ in got] == [k for k, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert np.array_equal(a, b)       # positions ascending within a block (stable)


@pytest.mark.parametrize("init", [uniform(-0.05, 0.05, seed=3), uniform(0.0, 1.0, seed=(1 << 40) + 5),
                                  normal(0.0, 0.01, seed=7), normal(0.5, 2.0, seed=123456789),
                                  zeros(), constant(0.25)], ids=str)
def test_initial_values_equal_the_numpy_reference_bit_for_bit(init):
    rng = np.random.default_rng(1)
    ids = np.concatenate([rng.integers(-(1 << 62), 1 << 62, 200_000, dtype=np.int64),
                          np.arange(1000, dtype=np.int64), np.empty(0, np.int64)])
    for dim in (1, 3, 16):
        got, want = kernels.initial_values(init, ids, dim), initial_values(init, ids, dim)
        assert got.dtype == np.float32 and got.shape == (ids.shape[0], dim)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.skipif(not kernels.AVAILABLE, reason="numba is not installed")
@pytest.mark.parametrize("n", [0, 1, 4095, 4096, 4097, 20000])
def test_the_first_non_finite_value_and_the_first_id_outside_are_numpys(n):
    rng = np.random.default_rng(n)
    values = rng.standard_normal(n).astype(np.float32)
    ids = rng.integers(0, 1000, n)
    assert kernels.first_non_finite(values) == -1 and kernels.finite(values)
    assert kernels.first_outside(ids, 1000) == -1 and kernels.first_outside(ids, 0) == -1
    for bad in sorted({0, n // 2, n - 1}) if n else []:
        spoiled = values.copy()
        spoiled[bad:] = rng.choice([np.nan, np.inf, -np.inf], n - bad)
        assert kernels.first_non_finite(spoiled) == bad and not kernels.finite(spoiled)
        assert kernels.first_non_finite(spoiled.reshape(1, -1)) == bad
        outside = ids.copy()
        outside[bad:] = rng.choice([-1, 1000, 1 << 62], n - bad)
        assert kernels.first_outside(outside, 1000) == bad


def test_warm_up_compiles_every_kernel_for_the_data_paths_types():
    kernels.warm_up()
    id_blocks.warm_up()
    optimizer_kernels.warm_up()
    lookup_kernels.warm_up()
    step.warm_up()
    step_reply.warm_up()
    sockio.warm_up()
    request_kernels.warm_up()
    for fn in (lookup_kernels._sum_bags, lookup_kernels._hash_each, lookup_kernels._rank_each, step_reply._walk_entries,
               request_kernels._check_ids, step._check_segments, step._check_layout,
               sockio.send_all, sockio.recv_frame,
               optimizer_kernels._sgd, optimizer_kernels._adagrad, optimizer_kernels._adam,
               kernels._hash_unique, id_blocks._block_of, id_blocks._route_rows,
               kernels._group, kernels._init_uniform, kernels._init_units, kernels._distinct,
               kernels._finite, kernels._first_non_finite, kernels._first_outside):
        assert fn.signatures, f"{fn.__name__} was not compiled by warm_up"
    kernels.warm_up()                   # idempotent


# what the server's and the worker's image builds run
_BUILD = ("import logging; from shardps.server.node.node import warm_up_kernels; warm_up_kernels(); "
          "from shardps.worker.runtime import prepare_kernels; prepare_kernels(logging)")
# a server's and a worker's first requests in one process: every optimizer, sparse and dense,
# over the data plane, and a PSModel step; then the signatures compiled so far, by kernel
_SERVE = """
import json, numpy as np, torch
from shardps import id_blocks, kernels
from shardps.server.node import optimizer_kernels, storage_kernels
from shardps.server.node.node import warm_up_kernels
from shardps.rpc import sockio, step, step_reply
from shardps.worker import PSClient, adagrad, adam, sgd, lookup_kernels
from shardps.worker.client import step_plan
from shardps.worker.torch_ps import PSEmbedding, PSModel
from tests.conftest import InProcessCluster
warm_up_kernels()
cluster = InProcessCluster(servers=1).start()
try:
    with PSClient(cluster.address, job="first-requests") as client:
        client.create_job()
        for name, opt in (("a", adagrad(lr=0.05)), ("b", adam(lr=0.01)), ("c", sgd(lr=0.1)),
                          ("d", sgd(lr=0.1, momentum=0.9))):
            client.create_sparse(name, dim=16, optimizer=opt)
            ids = np.array([7, 9, 7], dtype=np.int64)
            client.push_rows(name, ids, np.ones((3, 16), np.float32))
            client.pull_rows(name, ids)
        client.create_dense("w", shape=(10, 4), optimizer=adam(lr=0.1))
        client.push_dense("w", np.ones((10, 4), np.float32))
        client.pull_dense("w")
        model = PSModel(torch.nn.Sequential(PSEmbedding(100, 4), torch.nn.Flatten(), torch.nn.Linear(8, 1)),
                        client, optimizer=adagrad(lr=0.1))
        model.create_tables()
        model.pull()
        model(torch.tensor([[1, 2], [2, 3]])).sum().backward()
        model.push()
        model.settle()
finally:
    cluster.stop()
print(json.dumps({name: len(fn.stats.cache_misses)
                  for module in (kernels, id_blocks, storage_kernels, optimizer_kernels, lookup_kernels, step,
                                 step_reply, sockio, step_plan)
                  for name, fn in vars(module).items() if getattr(fn, "stats", None) is not None
                  and fn.stats.cache_misses}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not kernels.AVAILABLE, reason="numba is not installed")
def test_a_process_given_a_built_cache_serves_without_compiling(tmp_path):
    """What the images do: one process fills NUMBA_CACHE_DIR (the image build runs
    ``warm_up_kernels``); a server and a worker started later with that cache serve their
    first pushes and pulls (every optimizer, read-only frames, a PSModel step) without
    compiling any kernel."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", _BUILD], env=env, timeout=300, check=True)
    out = subprocess.run([sys.executable, "-c", _SERVE], env=env, capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    compiled = json.loads(out.stdout.strip().splitlines()[-1])
    assert compiled == {}, f"compiled in the request path, not by warm_up: {compiled}"


@pytest.mark.parametrize("compiled", [True, False], ids=["numba", "numpy"])
def test_a_calls_ids_are_checked_together(monkeypatch, compiled):
    monkeypatch.setattr(request_kernels, "AVAILABLE", compiled)
    ids = [np.array([1, 2, 9], np.int64), np.array([7, 3, 5], np.int64), np.array([4, 2, 4], np.int64),
           np.array([10**12, -3], np.int64), np.empty(0, np.int64)]
    bad, at, distinct = request_kernels.check_ids(ids, [10, 8, 5, 0, 3])
    assert (bad, at) == (-1, -1)
    assert distinct.tolist() == [True, True, False, True, True]     # ascending, any order, a repeat
    bad, at, _ = request_kernels.check_ids(ids, [10, 8, 5, 1, 3])
    assert (bad, at) == (3, 0), "the first id outside its own table's bounds, by its place"
    bad, at, _ = request_kernels.check_ids(ids[:2], [10, 6])
    assert (bad, at) == (1, 0)
    bad, at, _ = request_kernels.check_ids([np.array([0, -1], np.int64)], [4])
    assert (bad, at) == (0, 1)
    rows = [np.zeros((2, 3), np.float32), np.array([[0, 1], [np.inf, 0]], np.float32)]
    assert [kernels.first_non_finite(r) for r in rows] == [-1, 2], "what push_pieces checks each table's rows with"


def test_every_batch_of_a_step_deduplicated_in_one_pass_equals_np_unique():
    rng = np.random.default_rng(0)
    for _ in range(200):
        lengths = rng.integers(0, 80, rng.integers(1, 6))
        flat = rng.integers(-5, 40, lengths.sum()).astype(np.int64)
        ends = np.cumsum(lengths)
        unique, inverse = lookup_kernels.unique_each(flat, ends)
        for k, batch in enumerate(np.split(flat, ends[:-1])):
            expected, at = np.unique(batch, return_inverse=True)
            np.testing.assert_array_equal(unique[k], expected)
            np.testing.assert_array_equal(inverse[k], at.reshape(-1))
