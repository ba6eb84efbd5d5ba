"""Compiled loops of ``storage.SparseRows`` over a direct id -> slot index (bounded tables):
one pass per request instead of a handful of numpy passes and fancy-indexed temporaries.

* ``_gather_init``: the stored rows of ``ids`` into ``out`` (one copy per row, straight into
  the reply), the others at their initial values (kept in the cache of initial values);
* ``scan`` and ``admit_rows``: a request's ids checked against the table's bounds, their
  blocks (and, ``admit_rows``, that this node serves them under the request's epoch), and
  whether they are unique (ascending in one pass; in any other order also checked in a hash
  set) (a push's values are checked by ``shardps.kernels.finite``);
* ``_assign_init``: the slot of every id, storing the missing ones (a free slot first, else
  the next unused one) at their initial values (from the cache where a read computed them)
  with their optimizer state, counted per block;
* ``sum_rows``: the rows of repeated ids summed (a SYNC step's gradients from every worker),
  each id's rows added in the order given, so any split of the same rows into blocks sums
  them alike (a primary applies a table's blocks at once, a backup block by block).

They release the GIL. Compiled with numba as ``shardps.kernels`` is (``_JIT``: cached,
``nogil``, numpy's error model); callers check ``kernels.AVAILABLE`` and keep their numpy
code for machines without numba.
"""

from __future__ import annotations

import numpy as np

from shardps.id_blocks import block_of_id
from shardps.kernels import (
    _JIT,
    AVAILABLE,
    _distinct,
    _normal_value,
    _splitmix64,
    _table_bits,
    _unit,
    first_outside,
    first_unique,
    njit,
)
from shardps.tables import TableSpec
from shardps.tables import check_ids as _tables_check_ids


@njit(**_JIT)
def _scan(ids, num_rows, num_blocks, blocks, counts, table_bits):
    """Block of each id into ``blocks`` and rows per block into ``counts``. Returns -1 - i
    for the first id out of [0, num_rows) (num_rows 0: any id), else 1 when the ids are
    unique: strictly increasing, or (``table_bits`` > 0) found so in a hash set of
    ``2 ** table_bits`` slots; else 0."""
    nb = np.uint64(num_blocks)
    increasing = 1
    prev = np.int64(0)
    for i in range(ids.shape[0]):
        x = ids[i]
        if num_rows > 0 and (x < 0 or x >= num_rows):
            return -1 - i
        if i > 0 and x <= prev:
            increasing = 0
        prev = x
        b = np.int64(block_of_id(x, nb))
        blocks[i] = b
        counts[b] += 1
    if increasing == 0 and table_bits > 0 and _distinct(ids, table_bits):
        return 1
    return increasing


@njit(**_JIT)
def _init_one(kind, a, b, key1, key2, x, out, i, cache_ids, cache_ok, cache_rows, store):
    """Row ``i`` of ``out`` at id ``x``'s initial value (``kernels.init_params`` gives the kinds),
    copied from the cache of initial values where it holds ``x``; with ``store``, a computed
    value is kept there (a read's missing rows, which a push often stores soon after)."""
    d = out.shape[1]
    k = cache_ids.shape[0]
    c = 0
    if k:
        c = np.int64(np.uint64(x) % np.uint64(k))
        if cache_ok[c] and cache_ids[c] == x:
            for j in range(d):
                out[i, j] = cache_rows[c, j]
            return
    u = np.uint64(x)
    if kind == 0 or kind == 1:
        v = np.float32(a) if kind == 1 else np.float32(0.0)
        for j in range(d):
            out[i, j] = v
    elif kind == 2:
        low, span = np.float32(a), np.float32(b)
        key = _splitmix64(u ^ key1)
        for j in range(d):
            out[i, j] = low + _unit(key, j) * span
    else:
        k1 = _splitmix64(u ^ key1)
        k2 = _splitmix64(u ^ key2)
        for j in range(d):
            out[i, j] = _normal_value(k1, k2, j, a, b)
    if k and store:
        cache_ids[c] = x
        cache_ok[c] = 1
        for j in range(d):
            cache_rows[c, j] = out[i, j]


@njit(**_JIT)
def _gather_init(slot_of, rows, ids, out, kind, a, b, key1, key2, cache_ids, cache_ok, cache_rows):
    """Rows of ``ids`` into ``out``: stored ones copied, the others at their initial values
    (remembered in the cache). Returns how many were not stored."""
    n, d = out.shape
    m = 0
    for i in range(n):
        s = slot_of[ids[i]]
        if s < 0:
            _init_one(kind, a, b, key1, key2, ids[i], out, i, cache_ids, cache_ok, cache_rows, True)
            m += 1
            continue
        for j in range(d):
            out[i, j] = rows[s, j]
    return m


@njit(**_JIT)
def _init_rows(ids, out, kind, a, b, key1, key2, cache_ids, cache_ok, cache_rows, store):
    for i in range(ids.shape[0]):
        _init_one(kind, a, b, key1, key2, ids[i], out, i, cache_ids, cache_ok, cache_rows, store)


@njit(**_JIT)
def _assign_init(slot_of, ids, free, used, num_blocks, block_counts, slots, rows, kind, a, b, key1, key2,
                 cache_ids, cache_ok, cache_rows, state1, fill1, state2, fill2, steps):
    """``_assign`` with the new rows written at once: their initial values (from the cache of
    initial values where it holds them), up to two optimizer state arrays at their fill
    values (size 0: none), their step counts (size 0: none) at 0. Returns (new rows, free
    slots taken, used)."""
    n = ids.shape[0]
    d = rows.shape[1]
    n_free = free.shape[0]
    m = 0
    taken = 0
    nb = np.uint64(num_blocks)
    f1, f2 = np.float32(fill1), np.float32(fill2)
    for i in range(n):
        x = ids[i]
        s = slot_of[x]
        if s < 0:
            if taken < n_free:
                s = free[taken]
                taken += 1
            else:
                s = used
                used += 1
            slot_of[x] = s
            block_counts[np.int64(block_of_id(x, nb))] += 1
            _init_one(kind, a, b, key1, key2, x, rows, s, cache_ids, cache_ok, cache_rows, False)
            if state1.shape[0]:
                for j in range(d):
                    state1[s, j] = f1
            if state2.shape[0]:
                for j in range(d):
                    state2[s, j] = f2
            if steps.shape[0]:
                steps[s] = 0
            m += 1
        slots[i] = s
    return m, taken, used


@njit(**_JIT)
def _admit_rows(ids, num_rows, owned, epoch, blocks, counts, keep_blocks, table_bits):
    """``admit_rows`` (``keep_blocks``: write each id's block into ``blocks``)."""
    nb = np.uint64(owned.shape[0])
    increasing = 1
    prev = np.int64(0)
    for i in range(ids.shape[0]):
        x = ids[i]
        if num_rows > 0 and (x < 0 or x >= num_rows):
            return -1
        if i > 0 and x <= prev:
            increasing = 0
        prev = x
        b = np.int64(block_of_id(x, nb))
        if owned[b] > epoch:
            return -2
        if keep_blocks:
            blocks[i] = b
        counts[b] += 1
    if increasing == 0 and table_bits > 0:
        return 1 if _distinct(ids, table_bits) else 0
    return 1 if increasing == 1 or table_bits > 0 else 0


@njit(**_JIT)
def _add_in_order(inverse, rows, out):
    """Row ``i`` of ``rows`` into row ``inverse[i]`` of ``out``, one after another: copied where
    it is that row's first (``first_unique`` numbers the ids in order of first appearance, so
    row ``k`` first appears when ``k`` rows have been seen; copied, not added to a zero: -0.0
    stays), added otherwise."""
    d = rows.shape[1]
    seen = 0
    for i in range(inverse.shape[0]):
        k = inverse[i]
        if k == seen:
            for j in range(d):
                out[k, j] = rows[i, j]
            seen += 1
        else:
            for j in range(d):
                out[k, j] += rows[i, j]


def sum_rows(ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct int64 ``ids`` in order of first appearance, float32 ``rows`` ``[n, dim]`` of
    repeated ids summed): each id's rows added one after another in the order they come,
    compiled or not (``np.add.reduceat``, as ``tables.coalesce`` sums, may add three or more
    rows in another order)."""
    if not AVAILABLE:
        return _sum_rows_numpy(ids, rows)
    first, inverse = first_unique(ids)
    out = np.empty((first.shape[0], rows.shape[1]), dtype=np.float32)
    _add_in_order(inverse, rows, out)
    return first, out


def _sum_rows_numpy(ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``sum_rows`` without numba: the first row of each id copied, the others added in
    order by ``np.add.at`` (unbuffered, one index after another)."""
    first, inverse = first_unique(ids)
    n = ids.shape[0]
    at = np.empty(first.shape[0], dtype=np.int64)
    at[inverse[::-1]] = np.arange(n - 1, -1, -1)         # the last write wins: each id's first row
    out = np.array(rows[at], dtype=np.float32)
    rest = np.ones(n, dtype=bool)
    rest[at] = False
    np.add.at(out, inverse[rest], rows[rest])
    return first, out


def check_ids(spec: TableSpec, ids: np.ndarray) -> None:
    """``tables.check_ids`` (InvalidArgument for an id outside ``[0, num_rows)``, naming it)
    in one compiled pass over int64 ids where numpy makes two reductions."""
    if AVAILABLE and ids.dtype == np.int64 and first_outside(ids, spec.num_rows) < 0:
        return
    _tables_check_ids(spec, ids)        # numpy's check: raises, naming the id, where one is outside


def scan(ids: np.ndarray, num_rows: int, num_blocks: int,
         unique: bool = False) -> tuple[int, np.ndarray, np.ndarray]:
    """(status, block of each id, rows per block) of a sparse segment's ids in one pass:
    status 1: the ids are unique and ascending, or, with ``unique``, unique in any order (a
    second pass over a hash set where they are not ascending); 0: not so; -1 - i: id ``i``
    is out of [0, num_rows)."""
    blocks = np.empty(ids.shape[0], dtype=np.int64)
    counts = np.zeros(num_blocks, dtype=np.int64)
    bits = _table_bits(ids.shape[0]) if unique else 0
    return _scan(ids, num_rows, num_blocks, blocks, counts, bits), blocks, counts


def admit_rows(ids: np.ndarray, num_rows: int, owned: np.ndarray, epoch: int, blocks: np.ndarray | None,
               counts: np.ndarray, unique: bool) -> int:
    """A sparse slice's ids checked in one pass: each id inside ``[0, num_rows)`` (num_rows
    0: any id), in a block ``b`` with ``owned[b] <= epoch`` (``owned``: uint64, one per
    block, the epoch since which this node serves it; a block moved later or served
    elsewhere is larger), counted per block into ``counts`` (and each id's block written into
    ``blocks`` unless None). Returns -1 for an id out of bounds, -2 for a block not served,
    else 1 when the ids are unique (with ``unique``: ascending or found so in a hash set;
    without: always 1) and 0 when they repeat."""
    bits = _table_bits(ids.shape[0]) if unique else 0
    keep = blocks is not None
    return int(_admit_rows(ids, num_rows, owned, np.uint64(epoch), blocks if keep else counts, counts, keep, bits))


@njit(**_JIT)
def _oldest_rows(blocks, seen, excess, chosen):
    n, nb = blocks.shape[0], excess.shape[0]
    counts = np.zeros(nb, np.int64)
    for i in range(n):
        counts[blocks[i]] += 1
    starts = np.zeros(nb + 1, np.int64)
    for k in range(nb):
        starts[k + 1] = starts[k] + counts[k]
    fill = starts[:nb].copy()
    grouped = np.empty(n, np.int64)
    for i in range(n):                      # each block's rows, in the order given
        k = blocks[i]
        grouped[fill[k]] = i
        fill[k] += 1
    for k in range(nb):
        m = min(excess[k], counts[k])
        if m <= 0:
            continue
        rows = grouped[starts[k]:starts[k + 1]]
        values = seen[rows]
        cut = np.partition(values, m - 1)[m - 1]     # the m-th smallest: below it all go, at it the first
        below = 0
        for j in range(values.shape[0]):
            if values[j] < cut:
                below += 1
        at_cut = m - below
        for j in range(values.shape[0]):
            if values[j] < cut:
                chosen[rows[j]] = True
            elif values[j] == cut and at_cut > 0:
                chosen[rows[j]] = True
                at_cut -= 1


def oldest_rows(blocks: np.ndarray, seen: np.ndarray, excess: np.ndarray) -> np.ndarray:
    """Which rows to evict: in each block ``b`` (``blocks``: int64 per row), the ``excess[b]``
    with the smallest ``seen`` (int64), ties in the order given (callers list rows by
    ascending id). Compiled: a selection per block (linear), where a sort of all the rows
    by (block, seen) took most of an eviction pass."""
    chosen = np.zeros(blocks.shape[0], dtype=np.bool_)
    if not AVAILABLE:
        order = np.lexsort((np.arange(blocks.shape[0]), seen, blocks))
        ob = blocks[order]
        counts = np.bincount(ob, minlength=excess.shape[0])
        rank = np.arange(order.shape[0]) - (np.cumsum(counts) - counts)[ob]
        chosen[order[rank < excess[ob]]] = True
        return chosen
    _oldest_rows(np.ascontiguousarray(blocks, dtype=np.int64), np.ascontiguousarray(seen, dtype=np.int64),
                 np.ascontiguousarray(excess, dtype=np.int64), chosen)
    return chosen


def warm_up() -> None:
    """Compile (or load from the cache) with the argument types SparseRows uses: ids as
    arrays of their own and as read-only views of a received frame (numba types them apart)."""
    read_only = np.arange(2, dtype=np.int64)
    read_only.flags.writeable = False
    for ids in (np.arange(2, dtype=np.int64), read_only):
        slot_of = np.full(4, -1, dtype=np.int32)
        rows = np.zeros((4, 2), np.float32)
        scan(ids, 4, 2)
        sum_rows(ids, np.zeros((2, 2), np.float32))
        owned = np.zeros(2, np.uint64)
        admit_rows(ids, 4, owned, 1, np.empty(2, np.int64), np.zeros(2, np.int64), True)
        admit_rows(ids, 4, owned, 1, None, np.zeros(2, np.int64), False)
        cache = (np.zeros(4, np.int64), np.zeros(4, np.uint8), np.zeros((4, 2), np.float32))
        init = (3, 0.0, 1.0, np.uint64(1), np.uint64(2))
        _gather_init(slot_of, rows, ids, np.empty((2, 2), np.float32), *init, *cache)
        _init_rows(ids, np.empty((2, 2), np.float32), *init, *cache, True)
        oldest_rows(ids, ids, np.ones(2, np.int64))
        state = np.zeros((4, 2), np.float32)
        _assign_init(np.full(4, -1, dtype=np.int32), ids, np.empty(0, np.int64), 0, 2, np.zeros(2, np.int64),
                     np.empty(2, np.int64), rows, *init, *cache, state, 0.0, state, 0.0, np.zeros(4, np.int32))
