"""The client's check of a call's sparse ids, all of its tables in one compiled pass.

``check_ids``: every request's ids against its table's bounds, and whether each request's
ids are distinct (``requests.pull_pieces`` and ``push_pieces`` send distinct ids as they
are and deduplicate or sum the others); the gradient rows are checked by
``shardps.kernels.first_non_finite``. numba compiles it like the other kernels (``warm_up``);
without numba the same answers come from ``shardps.kernels``' numpy paths.
"""

from __future__ import annotations

import itertools

import numpy as np

from shardps import kernels
from shardps.kernels import _JIT, AVAILABLE, _distinct, njit

_EMPTY = np.empty(0, np.int64)


@njit(**_JIT)
def _check_ids(flat, ends, bounds, distinct):
    """(the first request with an id outside ``[0, bound)``, that id's position among the
    request's ids), or (-1, -1). ``flat``: every request's ids, one after another; request k
    ends at ``ends[k]``; a bound <= 0: unbounded. Fills ``distinct[k]`` (checked requests
    only): whether request k holds no id twice (ascending ids in the same pass, others in a
    hash set)."""
    start = 0
    for k in range(ends.shape[0]):
        end = ends[k]
        bound = bounds[k]
        ascending = True
        for i in range(start, end):
            x = flat[i]
            if bound > 0 and (x < 0 or x >= bound):
                return k, i - start
            if i > start and x <= flat[i - 1]:
                ascending = False
        if ascending:
            distinct[k] = True
        else:
            bits = 4
            while (1 << bits) < 2 * (end - start):     # a load factor <= 1/2, as kernels.distinct
                bits += 1
            distinct[k] = _distinct(flat[start:end], bits)
        start = end
    return -1, -1


def check_ids(ids: list[np.ndarray], bounds: list[int]) -> tuple[int, int, np.ndarray]:
    """(the first of ``ids`` (flat int64 arrays) holding an id outside ``[0, bounds[k])``,
    the position of that id in it), or (-1, -1); and whether each array's ids are distinct
    (valid up to the first bad array)."""
    distinct = np.empty(len(ids), np.bool_)
    if not AVAILABLE:
        for k, (x, bound) in enumerate(zip(ids, bounds)):
            bad = kernels.first_outside(x, bound)
            if bad >= 0:
                return k, bad, distinct
            distinct[k] = kernels.distinct(x)
        return -1, -1, distinct
    ends = np.fromiter(itertools.accumulate(map(len, ids)), np.int64, len(ids))
    flat = ids[0] if len(ids) == 1 else np.concatenate(ids) if ids else _EMPTY
    bad, at = _check_ids(flat, ends, np.fromiter(bounds, np.int64, len(bounds)), distinct)
    return bad, at, distinct


def warm_up() -> None:
    """Compile (or load) the kernels with the argument types the client uses."""
    if not AVAILABLE:
        return
    check_ids([np.arange(4, dtype=np.int64), np.arange(4, dtype=np.int64)[::-1].copy()], [8, 0])
