"""Table specs, block layout and counter-based initial values (pure)."""

import numpy as np
import pytest

from shardps.errors import InvalidArgument
from shardps.id_blocks import sparse_block_of
from shardps.tables import (
    TableKind,
    coalesce,
    dense_table,
    group_by_block,
    initial_values,
    normal,
    sparse_table,
    uniform,
)


def test_dense_layout_covers_the_tensor_in_blocks():
    spec = dense_table("w", (10, 7), block_size=16)
    assert spec.numel == 70 and spec.block_count == 5
    covered = [spec.block_range(b) for b in range(spec.block_count)]
    assert covered[0] == (0, 16) and covered[-1] == (64, 70)


@pytest.mark.parametrize("rows, dim, blocks", [
    (100_000, 8, 1),            # 3.2 MB: placed whole
    (1 << 17, 8, 1),            # exactly 4 MiB of values
    ((1 << 17) + 1, 8, 2),
    (1_000_000, 16, 16),        # 64 MB
    (10_000_000, 64, 64),       # capped
    (0, 16, 64),                # unbounded ids
])
def test_sparse_tables_get_a_block_per_4_mib_of_values(rows, dim, blocks):
    assert sparse_table("e", dim, num_rows=rows).num_blocks == blocks
    assert sparse_table("e", dim, num_rows=rows, num_blocks=7).num_blocks == 7     # as asked


@pytest.mark.parametrize("spec, word", [
    (dense_table("w", (0, 3)), "dimension"),
    (dense_table("bad name!", (3,)), "name"),
    (sparse_table("e", 0), "dim"),
    (dense_table("w", (3,), init=uniform(1.0, -1.0)), "low <= high"),
])
def test_invalid_specs_name_the_bad_value(spec, word):
    with pytest.raises(InvalidArgument, match=word):
        spec.validate()


def test_initial_values_are_a_pure_function_of_seed_and_id():
    init = normal(0.0, 1.0, seed=42)
    ids = np.array([5, -3, 10**15, 5], dtype=np.int64)
    a = initial_values(init, ids, 16)
    b = initial_values(init, ids[::-1].copy(), 16)[::-1]
    assert np.array_equal(a, b) and np.array_equal(a[0], a[3])
    assert not np.array_equal(a, initial_values(normal(0.0, 1.0, seed=43), ids, 16))
    big = initial_values(init, np.arange(100_000), 4)
    assert abs(big.mean()) < 0.02 and abs(big.std() - 1.0) < 0.02


def test_uniform_initial_values_stay_in_range():
    v = initial_values(uniform(-0.5, 0.25, seed=1), np.arange(50_000), 2)
    assert v.min() >= -0.5 and v.max() < 0.25


def test_sparse_blocks_are_stable_and_spread():
    ids = np.arange(200_000, dtype=np.int64)
    blocks = sparse_block_of(ids, 64)
    assert np.array_equal(blocks, sparse_block_of(ids.copy(), 64))
    counts = np.bincount(blocks, minlength=64)
    assert counts.max() / counts.mean() < 1.1


def test_coalesce_sums_duplicates():
    ids = np.array([4, 1, 4, 9, 1], dtype=np.int64)
    vals = np.arange(10, dtype=np.float32).reshape(5, 2)
    u, s = coalesce(ids, vals)
    assert u.tolist() == [1, 4, 9]
    assert s.tolist() == [[2 + 8, 3 + 9], [0 + 4, 1 + 5], [6, 7]]


def test_group_by_block_partitions_positions():
    groups = group_by_block(np.array([2, 0, 2, 1]))
    assert [(b, p.tolist()) for b, p in groups] == [(0, [1]), (1, [3]), (2, [0, 2])]
    assert dense_table("x", 3).kind is TableKind.DENSE
