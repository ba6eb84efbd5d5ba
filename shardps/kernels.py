"""Compiled kernels for the hot loops of the data path, with numpy fallbacks.

Three loops dominate a sparse step outside the network:

* the servers' optimizer update of pushed rows: look up each row's slot, gather its values
  and optimizer state, update, scatter back. numpy needs about fifteen passes over
  ``rows x dim`` elements plus three fancy-indexed copies (10.5 ms for 10,000 x 64 Adagrad
  rows on this machine); one fused pass over the rows in place costs well under 1 ms;
* the workers' deduplication of a batch's ids with the inverse map (``np.unique`` sorts all
  of them: 0.5 ms for the ctr batch's 13,312 ids); hashing, then sorting only the distinct
  ids, is several times cheaper;
* the servers' initial values of rows pulled or pushed for the first time (a pure function
  of seed, row and column: ``shardps.tables.initial_values``), computed here without its
  temporaries, bit for bit the same.

The kernels are compiled with numba (``cache=True``: once per machine, into ``__pycache__``
or ``NUMBA_CACHE_DIR``) and release the GIL. When numba is not installed, ``AVAILABLE`` is
False and callers use the numpy code they had; the tests compare both.

Arithmetic is float32, in the order of ``shardps.server.optimizers`` (the numpy reference),
with per-row learning-rate factors computed in float64 and rounded to float32 as it does.
"""

from __future__ import annotations

import functools
import os
import re
import time
from typing import Any

import numpy as np

from shardps.tables import Initializer, InitKind, OptimizerKind
from shardps.tables import coalesce as _tables_coalesce
from shardps.tables import group_by_block as _tables_group_by_block
from shardps.tables import initial_values as _tables_initial_values
from shardps.tables import sparse_block_of as _tables_block_of
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


# ====================================================================== optimizer updates
@njit(**_JIT)
def _sgd(rows, buf, steps, slots, grad, lr, wd, momentum, keep, nesterov):
    n, d = grad.shape
    lr32 = np.float32(lr)
    wd32 = np.float32(wd)
    mom = np.float32(momentum)
    keep32 = np.float32(keep)
    for i in range(n):
        s = slots[i]
        first = False
        if steps.shape[0]:
            st = steps[s] + 1
            steps[s] = st
            first = st == 1
        for j in range(d):
            g = grad[i, j]
            if wd != 0.0:
                g = rows[s, j] * wd32 + g
            if buf.shape[0]:
                if first:
                    b = g
                else:
                    b = buf[s, j] * mom + keep32 * g
                buf[s, j] = b
                if nesterov:
                    upd = (b * mom + g) * lr32
                else:
                    upd = b * lr32
            else:
                upd = g * lr32
            rows[s, j] -= upd


@njit(**_JIT)
def _adagrad(rows, acc, steps, slots, grad, lr, lr_decay, eps, wd):
    n, d = grad.shape
    eps32 = np.float32(eps)
    wd32 = np.float32(wd)
    for i in range(n):
        s = slots[i]
        st = steps[s] + 1
        steps[s] = st
        clr = np.float32(lr / (1.0 + (st - 1.0) * lr_decay))
        if wd != 0.0:
            for j in range(d):
                g = rows[s, j] * wd32 + grad[i, j]
                a = acc[s, j] + g * g
                acc[s, j] = a
                rows[s, j] -= (g / (np.sqrt(a) + eps32)) * clr
        else:
            for j in range(d):
                g = grad[i, j]
                a = acc[s, j] + g * g
                acc[s, j] = a
                rows[s, j] -= (g / (np.sqrt(a) + eps32)) * clr


@njit(**_JIT)
def _adam(rows, m, v, steps, slots, grad, lr, beta1, beta2, eps, wd):
    n, d = grad.shape
    eps32 = np.float32(eps)
    wd32 = np.float32(wd)
    one_b1 = np.float32(1.0 - beta1)
    b2 = np.float32(beta2)
    one_b2 = np.float32(1.0 - beta2)
    for i in range(n):
        s = slots[i]
        st = steps[s] + 1
        steps[s] = st
        step_size = np.float32(lr / (1.0 - beta1 ** st))
        bc2 = np.float32(np.sqrt(1.0 - beta2 ** st))
        for j in range(d):
            g = grad[i, j]
            if wd != 0.0:
                g = rows[s, j] * wd32 + g
            mj = m[s, j] + (g - m[s, j]) * one_b1
            m[s, j] = mj
            vj = v[s, j] * b2 + (g * g) * one_b2
            v[s, j] = vj
            rows[s, j] -= (mj / (np.sqrt(vj) / bc2 + eps32)) * step_size


_EMPTY_2D = np.empty((0, 0), dtype=np.float32)
_EMPTY_STEPS = np.empty(0, dtype=np.int32)


def apply_rows(config, rows: np.ndarray, state: dict[str, np.ndarray], steps: np.ndarray | None,
               slots: np.ndarray, grad: np.ndarray) -> None:
    """One optimizer step for the rows at ``slots`` of ``rows`` (``[capacity, dim]`` float32,
    updated in place with ``state``'s arrays of the same shape and the int32 per-row step
    counts ``steps``, which it increments). ``slots`` are distinct; ``grad`` is ``[n, dim]``.
    Same results as ``shardps.server.optimizers.apply`` on the gathered rows (to float32
    rounding). Requires ``AVAILABLE``; releases the GIL."""
    kind = config.kind
    slots = np.ascontiguousarray(slots, dtype=np.int64)
    grad = np.ascontiguousarray(grad, dtype=np.float32)
    st = _EMPTY_STEPS if steps is None else steps
    wd = float(config.weight_decay)
    if kind is OptimizerKind.SGD:
        buf = state.get("momentum_buffer", _EMPTY_2D) if config.momentum else _EMPTY_2D
        _sgd(rows, buf, st, slots, grad, float(config.lr), wd, float(config.momentum),
             float(1.0 - config.dampening), bool(config.nesterov))
    elif kind is OptimizerKind.ADAGRAD:
        _adagrad(rows, state["sum"], st, slots, grad, float(config.lr), float(config.lr_decay),
                 float(config.effective_eps), wd)
    elif kind is OptimizerKind.ADAM:
        _adam(rows, state["exp_avg"], state["exp_avg_sq"], st, slots, grad, float(config.lr),
              float(config.beta1), float(config.beta2), float(config.effective_eps), wd)
    else:
        raise ValueError(f"unknown optimizer kind {kind!r}")


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


# ====================================================================== blocks
@njit(**_JIT)
def _splitmix64(z):
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@njit(**_JIT)
def _block_of(ids, num_blocks, out):
    nb = np.uint64(num_blocks)
    for i in range(ids.shape[0]):
        out[i] = np.int64(_splitmix64(ids[i]) % nb)


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
    # the counters compiled; log1p, sqrt and cos as numpy does them (vectorised, and the
    # same bits as shardps.tables.initial_values)
    u2 = np.empty_like(out)
    _init_units(ids, _stream_key(init.seed, 1), out)
    _init_units(ids, _stream_key(init.seed, 2), u2)
    z = np.sqrt(-2.0 * np.log1p(-out.astype(np.float64)))
    z *= np.cos(2.0 * np.pi * u2.astype(np.float64))
    return (init.mean + init.std * z).astype(np.float32)


def sparse_block_of(ids: np.ndarray, num_blocks: int) -> np.ndarray:
    """``shardps.tables.sparse_block_of`` (``splitmix64(id) % num_blocks``, int64) in one
    compiled pass instead of numpy's eight over temporaries."""
    if not AVAILABLE:
        return _tables_block_of(ids, num_blocks)
    out = np.empty(ids.shape[0], dtype=np.int64)
    _block_of(np.ascontiguousarray(ids, dtype=np.int64).view(np.uint64), num_blocks, out)
    return out


@njit(**_JIT)
def _route_rows(ids, num_blocks, primary, num_servers, order, starts):
    nb = np.uint64(num_blocks)
    n = ids.shape[0]
    server = np.empty(n, dtype=np.int32)
    for i in range(n):
        b = np.int64(_splitmix64(np.uint64(ids[i])) % nb)
        s = primary[b]
        if s < 0:
            return b                     # a block without a live replica
        server[i] = s
        starts[s + 1] += 1
    for k in range(num_servers):
        starts[k + 1] += starts[k]
    fill = starts[:num_servers].copy()
    for i in range(n):
        s = server[i]
        order[fill[s]] = i
        fill[s] += 1
    return -1


def route_rows(ids: np.ndarray, num_blocks: int, primary: np.ndarray, num_servers: int
               ) -> tuple[np.ndarray, np.ndarray] | int:
    """Rows ``ids`` grouped by the server of their block (``primary``: the server index of
    each block's primary), in one compiled pass: (order, starts), the positions of server
    ``k``'s rows being ``order[starts[k]:starts[k + 1]]`` (ascending); or the index of the
    first block without a live replica (primary -1)."""
    order = np.empty(ids.shape[0], dtype=np.int64)
    starts = np.zeros(num_servers + 1, dtype=np.int64)
    missing = _route_rows(np.ascontiguousarray(ids, dtype=np.int64), num_blocks,
                          np.ascontiguousarray(primary, dtype=np.int32), num_servers, order, starts)
    return int(missing) if missing >= 0 else (order, starts)


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
    rows = np.zeros((2, 2), np.float32)
    slots = np.zeros(1, np.int64)
    # gradients decoded from a received frame are read-only views (numba types them apart)
    for grad in (np.zeros((1, 2), np.float32), _read_only(np.zeros((1, 2), np.float32))):
        for steps in (_EMPTY_STEPS, np.zeros(2, np.int32)):      # SGD and Adagrad: with or without
            _sgd(rows, _EMPTY_2D, steps, slots, grad, 0.1, 0.0, 0.0, 1.0, False)
            _sgd(rows, np.zeros_like(rows), steps, slots, grad, 0.1, 0.0, 0.9, 1.0, False)
            _adagrad(rows, np.zeros_like(rows), steps, slots, grad, 0.1, 0.0, 1e-10, 0.0)
        # Adam always keeps per-row steps (it indexes them: never an empty array)
        _adam(rows, np.zeros_like(rows), np.zeros_like(rows), np.zeros(2, np.int32), slots, grad,
              0.1, 0.9, 0.999, 1e-8, 0.0)
    unique_inverse(np.arange(128, dtype=np.int64))
    strictly_increasing(np.arange(4, dtype=np.int64))
    for ids in (np.arange(4, dtype=np.int64)[::-1].copy(), _read_only(np.arange(4, dtype=np.int64)[::-1].copy())):
        distinct(ids)                   # not ascending: the hash set too
        first_unique(ids)
    for kind in (InitKind.UNIFORM, InitKind.NORMAL):
        initial_values(Initializer(kind), np.arange(2, dtype=np.int64), 2)
    group_by_key(sparse_block_of(np.arange(4, dtype=np.int64), 4), 4)
    group_by_key(np.zeros(4, np.int32), 4)          # clients group by server index (int32)
    route_rows(np.arange(4, dtype=np.int64), 4, np.zeros(4, np.int32), 1)
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
