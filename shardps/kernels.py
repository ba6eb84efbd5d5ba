"""Compiled kernels for the hot loops of the data path, with numpy fallbacks.

Three loops dominate a sparse step outside the network:

* the servers' optimizer update of pushed rows (``server/node/optimizer_kernels.py``, on
  the kernels here);
* the workers' deduplication of a batch's ids with the inverse map (``np.unique`` sorts all
  of them: 0.5 ms for the ctr batch's 13,312 ids); hashing, then sorting only the distinct
  ids, is several times cheaper;
* the servers' initial values of rows pulled or pushed for the first time (a pure function
  of seed, row and column: ``shardps.tables.initial_values``), computed here without its
  temporaries, bit for bit the same.

The kernels are compiled with numba (``cache=True``: once per machine, into ``__pycache__``
or ``NUMBA_CACHE_DIR``) and release the GIL. When numba is not installed, ``AVAILABLE`` is
False and callers use the numpy code they had; the tests compare both.
"""

from __future__ import annotations

import functools
import math
import os
import re
import time
from typing import Any

import numpy as np

from shardps.tables import Initializer, InitKind
from shardps.tables import coalesce as _tables_coalesce
from shardps.tables import group_by_block as _tables_group_by_block
from shardps.tables import initial_values as _tables_initial_values
from shardps.tables import splitmix64 as _tables_splitmix64

try:                                    # pragma: no cover - exercised where numba exists
    from numba import njit
    AVAILABLE = True
except ImportError:                     # pragma: no cover
    AVAILABLE = False

    def njit(*args, **kwargs):  # type: ignore[no-redef]  # numba's stand-in; the functions are then never called
        return (lambda f: f) if not args or not callable(args[0]) else args[0]


SGD, ADAGRAD, ADAM = 0, 1, 2
# error_model="numpy": a division by zero gives inf/nan as numpy does; numba's default
# ("python") checks every division, which keeps LLVM from vectorising the loops (3x slower)
_JIT: dict[str, Any] = dict(cache=True, nogil=True, fastmath=False, boundscheck=False, error_model="numpy")


# ====================================================================== deduplication
@njit(**_JIT)
def _hash_unique(ids, table_bits):
    size = 1 << table_bits
    mask = size - 1
    keys = np.empty(size, dtype=np.int64)
    index = np.full(size, -1, dtype=np.int64)
    n = ids.shape[0]
    first = np.empty(n, dtype=np.int64)           # distinct ids in order of first appearance
    inverse = np.empty(n, dtype=np.int64)         # position of each id in ``first``
    count = 0
    for i in range(n):
        x = ids[i]
        h = (np.uint64(x) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(64 - table_bits)
        p = np.int64(h)
        while True:
            k = index[p]
            if k < 0:
                index[p] = count
                keys[p] = x
                first[count] = x
                inverse[i] = count
                count += 1
                break
            if keys[p] == x:
                inverse[i] = k
                break
            p = (p + 1) & mask
    return first[:count], inverse


@njit(**_JIT)
def _increasing(ids):
    for i in range(1, ids.shape[0]):
        if ids[i] <= ids[i - 1]:
            return False
    return True


def strictly_increasing(ids: np.ndarray) -> bool:
    """Whether int64 ``ids`` are unique and ascending (``np.all(ids[1:] > ids[:-1])`` in one
    pass without temporaries)."""
    if not AVAILABLE or ids.dtype != np.int64:
        return bool(ids.shape[0] <= 1 or np.all(ids[1:] > ids[:-1]))
    return bool(_increasing(ids))


@njit(**_JIT)
def _distinct(ids, table_bits):
    """Whether no id of ``ids`` repeats: one pass over a hash set of ``2 ** table_bits`` slots."""
    size = 1 << table_bits
    mask = size - 1
    keys = np.empty(size, dtype=np.int64)
    used = np.zeros(size, dtype=np.bool_)
    for i in range(ids.shape[0]):
        x = ids[i]
        p = np.int64((np.uint64(x) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(64 - table_bits))
        while used[p]:
            if keys[p] == x:
                return False
            p = (p + 1) & mask
        used[p] = True
        keys[p] = x
    return True


def _table_bits(n: int) -> int:
    return max(4, int(n * 2 - 1).bit_length())     # a hash set's load factor <= 1/2


def distinct(ids: np.ndarray) -> bool:
    """Whether int64 ``ids`` hold no id twice, in any order: one compiled pass when they are
    ascending, else one over a hash set (no sort)."""
    if not AVAILABLE or ids.dtype != np.int64:
        return bool(np.unique(ids).shape[0] == ids.shape[0])
    return bool(ids.shape[0] <= 1 or _increasing(ids) or _distinct(ids, _table_bits(ids.shape[0])))


def coalesce(ids: np.ndarray, values: np.ndarray, keep_order: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``tables.coalesce`` (rows of repeated ids summed, ids ascending), returning at once,
    after one compiled pass, when the ids are already unique and ascending (the common push).
    ``keep_order``: also when they are unique in any order (``distinct``), unsorted: what a
    client sends (servers take unique ids in any order); repeated ids are still summed and
    sorted."""
    if (distinct(ids) if keep_order else strictly_increasing(ids)):
        return ids, values
    return _tables_coalesce(ids, values)


def first_unique(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct int64 ``ids`` in order of first appearance, index of each id in them):
    ``unique_inverse`` without its sort, for requests (servers take ids in any order)."""
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    if not AVAILABLE:
        unique, index, inverse = np.unique(ids, return_index=True, return_inverse=True)
        order = np.argsort(index, kind="stable")
        rank = np.empty(order.shape[0], dtype=np.int64)
        rank[order] = np.arange(order.shape[0], dtype=np.int64)
        return unique[order], rank[inverse.reshape(-1)]
    return _hash_unique(ids, _table_bits(ids.shape[0]))


def unique_inverse(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(ids, return_inverse=True)`` for int64 ids: (sorted distinct ids, index of
    each id in them). Hashes the ids, then sorts only the distinct ones."""
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    if not AVAILABLE or ids.shape[0] < 64:
        unique, inverse = np.unique(ids, return_inverse=True)
        return unique, inverse.reshape(-1)
    first, inverse = _hash_unique(ids, _table_bits(ids.shape[0]))
    order = np.argsort(first)      # distinct keys: any sort orders them alike (stable: 4 x slower)
    rank = np.empty(order.shape[0], dtype=np.int64)
    rank[order] = np.arange(order.shape[0], dtype=np.int64)
    return first[order], rank[inverse]


# ====================================================================== checks
@njit(**_JIT)
def _finite(bits):
    """Whether no float32 (as its uint32 bits) is NaN or infinite: an all-ones exponent,
    found with integer operations that vectorise."""
    bad = np.uint32(0)
    mask = np.uint32(0x7F800000)
    for i in range(bits.shape[0]):
        bad |= np.uint32((bits[i] & mask) == mask)
    return bad == 0


_CHECK_RUN = 4096                       # values checked per vectorised run before an exit


@njit(**_JIT)
def _first_non_finite(bits):
    """The index of the first NaN or infinity of float32 ``bits`` (uint32), else -1: runs of
    ``_CHECK_RUN`` checked as ``_finite`` does, a run holding one searched value by value."""
    n = bits.shape[0]
    mask = np.uint32(0x7F800000)
    for lo in range(0, n, _CHECK_RUN):
        hi = min(n, lo + _CHECK_RUN)
        if not _finite(bits[lo:hi]):
            for i in range(lo, hi):
                if (bits[i] & mask) == mask:
                    return i
    return -1


@njit(**_JIT)
def _first_outside(ids, num_rows):
    for i in range(ids.shape[0]):
        if ids[i] < 0 or ids[i] >= num_rows:
            return i
    return -1


def finite(values: np.ndarray) -> bool:
    """Whether no value of a float32 array is NaN or infinite (one compiled pass)."""
    flat = values.reshape(-1)
    if not AVAILABLE or flat.dtype != np.float32 or not flat.flags.c_contiguous:
        return bool(np.isfinite(flat).all())
    return bool(_finite(flat.view(np.uint32)))


def first_non_finite(values: np.ndarray) -> int:
    """The flat index of the first NaN or infinity of float32 ``values``, else -1 (one
    compiled pass, no temporaries)."""
    flat = values.reshape(-1)
    if not AVAILABLE or flat.dtype != np.float32 or not flat.flags.c_contiguous:
        bad = np.flatnonzero(~np.isfinite(flat))
        return int(bad[0]) if bad.shape[0] else -1
    return int(_first_non_finite(flat.view(np.uint32)))


def first_outside(ids: np.ndarray, num_rows: int) -> int:
    """The index of the first of int64 ``ids`` outside ``[0, num_rows)``, else -1 (every id
    is inside when ``num_rows`` is 0: unbounded ids)."""
    if num_rows <= 0 or not ids.shape[0]:
        return -1
    if not AVAILABLE or ids.dtype != np.int64:
        bad = np.flatnonzero((ids < 0) | (ids >= num_rows))
        return int(bad[0]) if bad.shape[0] else -1
    return int(_first_outside(ids, num_rows))


# ====================================================================== blocks
@njit(**_JIT)
def _splitmix64(z):
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@njit(**_JIT)
def _group(keys, num_keys, order, starts):
    for k in keys:
        starts[k + 1] += 1
    for k in range(num_keys):
        starts[k + 1] += starts[k]
    fill = starts[:num_keys].copy()
    for i in range(keys.shape[0]):
        k = keys[i]
        order[fill[k]] = i
        fill[k] += 1


# ====================================================================== initial values
@njit(**_JIT)
def _unit(key, col):
    """``shardps.tables._uniform01`` of one element: the top 24 bits of the mixed counter."""
    mixed = _splitmix64(key * np.uint64(0x9E3779B97F4A7C15) + np.uint64(col))
    return np.float32(mixed >> np.uint64(40)) * np.float32(1.0 / 16777216.0)


@njit(**_JIT)
def _init_uniform(rows, stream, low, span, out):
    n, d = out.shape
    for i in range(n):
        key = _splitmix64(rows[i] ^ stream)
        for j in range(d):
            out[i, j] = low + _unit(key, j) * span


@njit(**_JIT)
def _init_units(rows, stream, out):
    n, d = out.shape
    for i in range(n):
        key = _splitmix64(rows[i] ^ stream)
        for j in range(d):
            out[i, j] = _unit(key, j)


# normal initial values of up to this many elements are computed in one compiled loop; more
# are vectorised by numpy (1 row x 16: 3 us against 12; 1,000 rows x 16: 700 us against 580)
_NORMAL_COMPILED_MAX = 4096


@njit(**_JIT)
def _normal_value(k1, k2, j, mean, std):
    """``shardps.tables.initial_values``' normal draw of one element: Box-Muller on two
    float32 uniforms, in float64 as numpy computes it (log1p, sqrt and cos of the C
    library: the same bits as numpy's, which the tests check), rounded to float32."""
    u1 = np.float64(_unit(k1, j))
    u2 = np.float64(_unit(k2, j))
    z = math.sqrt(-2.0 * math.log1p(-u1)) * math.cos(2.0 * math.pi * u2)
    return np.float32(mean + std * z)


@njit(**_JIT)
def _init_normal(rows, stream1, stream2, mean, std, out):
    n, d = out.shape
    for i in range(n):
        k1 = _splitmix64(rows[i] ^ stream1)
        k2 = _splitmix64(rows[i] ^ stream2)
        for j in range(d):
            out[i, j] = _normal_value(k1, k2, j, mean, std)


def init_params(init: Initializer) -> tuple:
    """``init`` as compiled kernels take it: (kind: 0 zeros, 1 constant, 2 uniform, 3 normal;
    then constant / low / mean, span / std, and the stream keys), ``initial_values``'
    arithmetic (ASSIGNED rows start at zero)."""
    if init.kind is InitKind.CONSTANT:
        return 1, float(init.value), 0.0, np.uint64(0), np.uint64(0)
    if init.kind is InitKind.UNIFORM:
        return 2, float(np.float32(init.low)), float(np.float32(init.high - init.low)), _stream_key(init.seed, 0), \
            np.uint64(0)
    if init.kind is InitKind.NORMAL:
        return 3, float(init.mean), float(init.std), _stream_key(init.seed, 1), _stream_key(init.seed, 2)
    return 0, 0.0, 0.0, np.uint64(0), np.uint64(0)


@functools.lru_cache(maxsize=256)
def _stream_key(seed: int, stream: int) -> np.uint64:
    """A table's initialiser stream, per (seed, stream): every read of new rows needs it
    (numpy's splitmix64 on one value costs more than the rows' own kernel)."""
    return _tables_splitmix64(np.array([seed ^ stream], dtype=np.uint64))[0]


def initial_values(init: Initializer, rows: np.ndarray, dim: int) -> np.ndarray:
    """``shardps.tables.initial_values`` in one compiled pass per row (numpy makes about
    fifteen passes over temporaries); bit-identical to it (the tests compare them)."""
    if not AVAILABLE or init.kind not in (InitKind.UNIFORM, InitKind.NORMAL):
        return _tables_initial_values(init, rows, dim)
    ids = np.ascontiguousarray(rows, dtype=np.int64).view(np.uint64)
    out = np.empty((ids.shape[0], dim), dtype=np.float32)
    if init.kind is InitKind.UNIFORM:
        _init_uniform(ids, _stream_key(init.seed, 0), np.float32(init.low),
                      np.float32(init.high - init.low), out)
        return out
    if out.size <= _NORMAL_COMPILED_MAX:
        _init_normal(ids, _stream_key(init.seed, 1), _stream_key(init.seed, 2), float(init.mean), float(init.std),
                     out)
        return out
    # many rows: the counters compiled, log1p, sqrt and cos vectorised by numpy (faster than
    # the C library's one value at a time beyond a few thousand; the same bits either way)
    u2 = np.empty_like(out)
    _init_units(ids, _stream_key(init.seed, 1), out)
    _init_units(ids, _stream_key(init.seed, 2), u2)
    z = np.sqrt(-2.0 * np.log1p(-out.astype(np.float64)))
    z *= np.cos(2.0 * np.pi * u2.astype(np.float64))
    return (init.mean + init.std * z).astype(np.float32)


@njit(**_JIT)
def _scatter_rows(out, where, rows):
    d = rows.shape[1]
    for i in range(where.shape[0]):
        k = where[i]
        for j in range(d):
            out[k, j] = rows[i, j]


def scatter_rows(out: np.ndarray, where: np.ndarray, rows: np.ndarray) -> None:
    """``out[where] = rows`` for float32 rows ``[n, dim]`` (a pull's reply into the caller's
    rows) in one compiled pass; ``where`` int64, in bounds."""
    if AVAILABLE and out.flags.c_contiguous and out.dtype == np.float32 and where.dtype == np.int64:
        _scatter_rows(out, where, rows)
    else:
        out[where] = rows


def group_by_key(keys: np.ndarray, num_keys: int) -> list[tuple[int, np.ndarray]]:
    """``shardps.tables.group_by_block`` for keys in [0, num_keys): [(key, positions of
    its rows, ascending)], keys ascending; a counting sort (one pass to count, one to place)
    instead of an argsort."""
    if not AVAILABLE:
        return _tables_group_by_block(keys)
    order = np.empty(keys.shape[0], dtype=np.int64)
    starts = np.zeros(num_keys + 1, dtype=np.int64)
    _group(np.ascontiguousarray(keys, dtype=np.int64), num_keys, order, starts)
    touched = np.flatnonzero(starts[1:] != starts[:-1])
    return [(int(k), order[starts[k]:starts[k + 1]]) for k in touched]


_WARM = False


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def warm_up() -> None:
    """Compile every kernel now (or load it from numba's cache), with the argument types the
    data path uses, so that a process's first request or training step does not pay for it
    (a few hundred milliseconds per process). Idempotent; a no-op without numba."""
    global _WARM
    if _WARM or not AVAILABLE:
        return
    unique_inverse(np.arange(128, dtype=np.int64))
    strictly_increasing(np.arange(4, dtype=np.int64))
    for ids in (np.arange(4, dtype=np.int64)[::-1].copy(), _read_only(np.arange(4, dtype=np.int64)[::-1].copy())):
        distinct(ids)                   # not ascending: the hash set too
        first_unique(ids)
    for kind in (InitKind.UNIFORM, InitKind.NORMAL):
        initial_values(Initializer(kind), np.arange(2, dtype=np.int64), 2)
    _init_units(np.zeros(1, np.uint64), _stream_key(0, 1), np.empty((1, 1), np.float32))   # many normal rows
    group_by_key(np.arange(4, dtype=np.int64) % 4, 4)          # servers group by block (int64)
    group_by_key(np.zeros(4, np.int32), 4)          # clients group by server index (int32)
    for ids in (np.arange(4, dtype=np.int64), _read_only(np.arange(4, dtype=np.int64))):
        first_outside(ids, 8)
    for values in (np.zeros(2, np.float32), _read_only(np.zeros(2, np.float32))):
        finite(values)
        first_non_finite(values)
    for rows in (np.zeros((2, 2), np.float32), _read_only(np.zeros((2, 2), np.float32))):   # a reply's rows
        scatter_rows(np.zeros((4, 2), np.float32), np.arange(2, dtype=np.int64), rows)
    _WARM = True


def prepare(log, *others) -> tuple[float, int, int]:
    """``warm_up()`` this module's kernels and those of ``others`` (modules with their own
    ``warm_up``), and log how long it took and how: ``(seconds, signatures loaded from numba's
    cache, signatures compiled)``. A process that compiled nothing did not pay for numba's
    compiler; the container images ship the cache (``NUMBA_CACHE_DIR``) for that."""
    if not AVAILABLE:
        return 0.0, 0, 0
    started = time.perf_counter()
    warm_up()
    for module in others:
        module.warm_up()
    took = time.perf_counter() - started
    loaded = compiled = 0
    for namespace in (globals(), *(vars(m) for m in others)):
        for obj in namespace.values():
            stats = getattr(obj, "stats", None)
            if stats is not None and hasattr(stats, "cache_hits"):
                loaded += sum(stats.cache_hits.values())
                compiled += sum(stats.cache_misses.values())
    log.info(READY_LOG, took, loaded, compiled, os.environ.get("NUMBA_CACHE_DIR") or "next to the sources")
    return took, loaded, compiled


READY_LOG = "data-path kernels ready in %.2f s: %d loaded from numba's cache, %d compiled (cache: %s)"
# ``prepare``'s log line, read back from a process's log: (seconds, loaded, compiled)
READY_LINE = re.compile(r"kernels ready in ([0-9.]+) s: (\d+) loaded from numba's cache, (\d+) compiled")
