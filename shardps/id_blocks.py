"""Which block of a sparse table a row id lives in: ``splitmix64(id) % num_blocks``.

The one statement of the rule, for every side that needs it (the client's routing, a
server's admission, storage and lifecycle, the cold tier, the verifier):

* ``block_of_id(id, num_blocks)``: one id, inside compiled kernels (numba inlines it), as a
  uint64 (``num_blocks`` a uint64; cast where an int64 is wanted);
* ``sparse_block_of(ids, num_blocks)``: an array of ids, in one compiled pass;
  ``reference_block_of`` is the same in numpy (used without numba, and by the tests);
* ``route_rows(ids, num_blocks, primary, servers)``: ids grouped by their block's primary.

``num_blocks`` is fixed when the table is created (``shardps.tables``); splitmix64 is the
finaliser of ``shardps.tables.splitmix64``, stable across versions: stored tables and
checkpoints depend on it.
"""

from __future__ import annotations

import numpy as np

from shardps.kernels import _JIT, AVAILABLE, _splitmix64, njit
from shardps.tables import splitmix64

_U64 = np.uint64


@njit(**_JIT)
def block_of_id(x, num_blocks):
    """The block of id ``x`` (an integer of any width) among ``num_blocks`` (a uint64), as a uint64."""
    return _splitmix64(np.uint64(x)) % num_blocks


def reference_block_of(ids: np.ndarray, num_blocks: int) -> np.ndarray:
    """The block of each id (int64 array) in numpy: ``splitmix64(id) % num_blocks``."""
    return (splitmix64(ids.view(_U64) if ids.dtype == np.int64 else ids) % _U64(num_blocks)).astype(np.int64)


@njit(**_JIT)
def _block_of(ids, num_blocks, out):
    nb = np.uint64(num_blocks)
    for i in range(ids.shape[0]):
        out[i] = np.int64(block_of_id(ids[i], nb))


def sparse_block_of(ids: np.ndarray, num_blocks: int) -> np.ndarray:
    """The block of each id (int64 array) in one compiled pass instead of numpy's eight over
    temporaries (``reference_block_of`` without numba)."""
    if not AVAILABLE:
        return reference_block_of(ids, num_blocks)
    out = np.empty(ids.shape[0], dtype=np.int64)
    _block_of(np.ascontiguousarray(ids, dtype=np.int64).view(np.uint64), num_blocks, out)
    return out


@njit(**_JIT)
def _route_rows(ids, num_blocks, primary, num_servers, order, starts):
    nb = np.uint64(num_blocks)
    n = ids.shape[0]
    server = np.empty(n, dtype=np.int32)
    for i in range(n):
        b = np.int64(block_of_id(ids[i], nb))
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


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernels with the argument types the data path uses."""
    if AVAILABLE:
        sparse_block_of(np.arange(4, dtype=np.int64), 4)
        route_rows(np.arange(4, dtype=np.int64), 4, np.zeros(4, np.int32), 1)
