"""``HashIndex``: id -> slot for any int64 ids, an open-addressing hash table (linear
probing, deletion by backward shift, load at most 0.7), for indexes that change by
many small batches: a lookup, insert or removal costs O(ids given), where a sorted index
re-merges all of its entries. The cold tier's index (``server/node/cold.py``): rows move in
and out of it on most pushes, millions of them.

The loops are compiled (``shardps.kernels``: cached, ``nogil``); without numba they run as
plain Python (slow, correct). Arrays in ``storage``. Not thread-safe: the owner's lock.
"""

from __future__ import annotations

import numpy as np

from shardps.kernels import _JIT, njit
from shardps.server.node.storage import MAPPED_MIN_BYTES, storage

MIN_BITS = 10


@njit(**_JIT)
def _home(x, bits):
    return np.int64((np.uint64(x) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(64 - bits))


@njit(**_JIT)
def _probe(keys, used, bits, x):
    """Where ``x`` is, or the empty place where it would go."""
    mask = (1 << bits) - 1
    p = _home(x, bits)
    while used[p] and keys[p] != x:
        p = (p + 1) & mask
    return p


@njit(**_JIT)
def _lookup(keys, slots, used, bits, ids, out):
    for i in range(ids.shape[0]):
        p = _probe(keys, used, bits, ids[i])
        out[i] = slots[p] if used[p] else -1


@njit(**_JIT)
def _insert(keys, slots, used, bits, ids, values):
    """Insert (or overwrite) each id; returns how many were new."""
    added = 0
    for i in range(ids.shape[0]):
        p = _probe(keys, used, bits, ids[i])
        if not used[p]:
            used[p] = True
            keys[p] = ids[i]
            added += 1
        slots[p] = values[i]
    return added


@njit(**_JIT)
def _remove(keys, slots, used, bits, ids):
    """Remove each id present (backward-shift deletion: no tombstones); returns how many."""
    mask = (1 << bits) - 1
    removed = 0
    for i in range(ids.shape[0]):
        p = _probe(keys, used, bits, ids[i])
        if not used[p]:
            continue
        removed += 1
        hole = p
        q = (p + 1) & mask
        while used[q]:
            home = _home(keys[q], bits)
            # move q back into the hole unless its home lies cyclically in (hole, q]
            if (q - home) & mask >= (q - hole) & mask:
                keys[hole] = keys[q]
                slots[hole] = slots[q]
                hole = q
            q = (q + 1) & mask
        used[hole] = False
    return removed


MAX_LOAD = 0.7              # grow past this, to a load of 1/2 at most


class HashIndex:
    """id -> slot (int64 ids, slots below 2**31); see the module docstring. 13 bytes a
    place, 0.25 to 0.7 of them taken: 19 to 52 bytes an entry."""

    def __init__(self, bits: int = MIN_BITS):
        self.bits = bits
        self.keys, self.slots = _zeros(1 << bits, np.int64), _zeros(1 << bits, np.int32)
        self.used = _zeros(1 << bits, np.bool_)
        self.count = 0

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Slot of each id, or -1."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        out = np.empty(ids.shape[0], np.int64)
        if self.count == 0:
            out.fill(-1)
            return out
        _lookup(self.keys, self.slots, self.used, self.bits, ids, out)
        return out

    def add(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Map ``ids`` (unique) to ``slots``."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if self.count + ids.shape[0] > MAX_LOAD * self.keys.shape[0]:
            self._grow(self.count + ids.shape[0])
        self.count += _insert(
            self.keys, self.slots, self.used, self.bits, ids, np.ascontiguousarray(slots, dtype=np.int32))

    def remove(self, ids: np.ndarray) -> None:
        """Forget ``ids`` (those not here are ignored)."""
        if self.count:
            self.count -= _remove(
                self.keys, self.slots, self.used, self.bits, np.ascontiguousarray(ids, dtype=np.int64))

    def stored(self, ordered: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """(ids, their slots): ids ascending, or in the table's order (``ordered=False``)."""
        ids, slots = self.keys[self.used], self.slots[self.used].astype(np.int64)
        if not ordered:
            return ids, slots
        order = np.argsort(ids)              # unique ids: any sort gives the one order
        return ids[order], slots[order]

    def _grow(self, entries: int) -> None:
        ids, slots = self.keys[self.used], self.slots[self.used]
        bigger = HashIndex(max(MIN_BITS, (2 * entries - 1).bit_length()))      # load <= 1/2 right after
        bigger.add(ids, slots)
        self.bits, self.keys, self.slots, self.used, self.count = (
            bigger.bits, bigger.keys, bigger.slots, bigger.used, bigger.count)


def _zeros(n: int, dtype) -> np.ndarray:
    """Zeros in ``storage`` (a mapping of its own is zero-filled already)."""
    out = storage(n, dtype)
    if out.nbytes < MAPPED_MIN_BYTES:
        out.fill(0)
    return out


def warm_up() -> None:
    """Compile (or load from the cache) the kernels with the types ``HashIndex`` passes."""
    index = HashIndex()
    index.add(np.arange(3, dtype=np.int64), np.arange(3, dtype=np.int32))
    index.lookup(np.arange(4, dtype=np.int64))
    index.remove(np.arange(1, dtype=np.int64))
