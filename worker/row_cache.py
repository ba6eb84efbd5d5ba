"""Hot rows of one sparse table kept on the worker, read without a pull while they are fresh.

Click and recommendation ids are skewed: a few rows are in nearly every batch. ``RowCache``
keeps such rows, up to a byte budget, with the worker step at which each was last read from
a server. A lookup for use at step ``u`` takes a cached row when its age ``u - refreshed``
is at most ``tau`` (the staleness bound); every other id is pulled, and the pulled rows
refresh the cache. Gradients are not the cache's business: every touched row's gradient is
still pushed, and the servers stay the source of truth.

Which rows are kept: while the budget has room, every pulled row; once it is full, a row
looked up at least ``admit_after`` times (counted in a small frequency sketch, halved now and
then so that the counts follow the data) replaces the cached row with the lowest count (the
least recently used among equals) if it was seen at least as often. Pure numpy, no I/O; not
thread-safe (the training thread drives it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardps.tables import splitmix64

# bookkeeping per cached row beside its values: id, refreshed step, last use (8 bytes each)
ROW_OVERHEAD_BYTES = 24
# a bounded table of at most this many rows gets a direct id -> slot map (4 bytes per row)
DIRECT_MAP_MAX_ROWS = 1 << 25
SKETCH_SIZE = 1 << 18
# staleness histogram: ages 0..MAX_AGE_BUCKET, the last bucket holding every older one
MAX_AGE_BUCKET = 64


@dataclass
class CachePlan:
    """How the rows of ``ids`` (distinct) are had for one lookup: ``hit`` from the cache
    (``hit_rows``, copied when planned: an eviction before the lookup cannot change them),
    the others (``misses``) from a pull."""

    ids: np.ndarray
    hit: np.ndarray                  # bool per id
    hit_rows: np.ndarray             # [hits, dim]
    use_step: int

    @property
    def misses(self) -> np.ndarray:
        return self.ids[~self.hit]


class RowCache:
    """See the module docstring. ``budget_bytes`` bounds the cached rows' values and
    bookkeeping; ``num_rows`` (0: unbounded ids) picks the id index."""

    def __init__(self, dim: int, budget_bytes: int, num_rows: int = 0, admit_after: int = 2):
        self.dim = dim
        self.capacity = max(0, int(budget_bytes) // (dim * 4 + ROW_OVERHEAD_BYTES))
        self.admit_after = admit_after
        self.values = np.zeros((self.capacity, dim), np.float32)
        self.ids = np.full(self.capacity, -1, np.int64)
        self.refreshed = np.zeros(self.capacity, np.int64)
        self.used_at = np.zeros(self.capacity, np.int64)
        self.free = np.arange(self.capacity - 1, -1, -1, dtype=np.int64)   # a stack: pop from the end
        self.n_free = self.capacity
        self._direct = np.full(num_rows, -1, np.int32) if 0 < num_rows <= DIRECT_MAP_MAX_ROWS else None
        self._index: dict[int, int] = {}
        self.sketch = np.zeros(SKETCH_SIZE, np.uint32)
        self._counted = 0
        # what was read: lookups, hits, and the age of every row read (misses are age 0
        # relative to their own pull)
        self.lookups = 0
        self.hits = 0
        self.ages = np.zeros(MAX_AGE_BUCKET + 1, np.int64)
        self.max_age = 0

    @property
    def size(self) -> int:
        return self.capacity - self.n_free

    def nbytes(self) -> int:
        return self.capacity * (self.dim * 4 + ROW_OVERHEAD_BYTES)

    # ------------------------------------------------------------------ index
    def _slots(self, ids: np.ndarray) -> np.ndarray:
        if self._direct is not None:
            inside = (ids >= 0) & (ids < self._direct.shape[0])     # others: the servers refuse them
            if inside.all():
                return self._direct[ids].astype(np.int64)
            return np.where(inside, self._direct[np.where(inside, ids, 0)], -1).astype(np.int64)
        get = self._index.get
        return np.fromiter((get(i, -1) for i in ids.tolist()), np.int64, ids.shape[0])

    def _set_slots(self, ids: np.ndarray, slots: np.ndarray) -> None:
        if self._direct is not None:
            self._direct[ids] = slots
        else:
            self._index.update(zip(ids.tolist(), slots.tolist()))

    def _clear_slots(self, ids: np.ndarray) -> None:
        if self._direct is not None:
            self._direct[ids] = -1
        else:
            for i in ids.tolist():
                self._index.pop(i, None)

    def _buckets(self, ids: np.ndarray) -> np.ndarray:
        return (splitmix64(ids.astype(np.uint64)) % np.uint64(SKETCH_SIZE)).astype(np.int64)

    def frequency(self, ids: np.ndarray) -> np.ndarray:
        """About how often ``ids`` were looked up lately (a sketch: ids sharing a bucket
        share its count)."""
        return self.sketch[self._buckets(ids)].astype(np.int64)

    # ------------------------------------------------------------------ a lookup
    def plan(self, ids: np.ndarray, use_step: int, tau: int) -> CachePlan:
        """Split the distinct ``ids`` of a lookup at step ``use_step`` into cached rows at
        most ``tau`` steps old and the ids to pull; counts the lookup."""
        self.lookups += ids.shape[0]
        if ids.shape[0]:
            # ids are distinct; two sharing a bucket count once here (np.add.at would count
            # both, at ten times the cost): a sketch's approximation either way
            self.sketch[self._buckets(ids)] += 1
            self._counted += ids.shape[0]
            if self._counted > 8 * SKETCH_SIZE:                    # follow the data
                self.sketch >>= 1
                self._counted = 0
        if self.capacity == 0 or not ids.shape[0]:
            return CachePlan(ids, np.zeros(ids.shape[0], bool), np.empty((0, self.dim), np.float32), use_step)
        slots = self._slots(ids)
        hit = slots >= 0
        ages = use_step - self.refreshed[slots[hit]]
        fresh = ages <= tau
        hit[np.flatnonzero(hit)[~fresh]] = False
        taken = slots[hit]
        self.used_at[taken] = use_step
        ages = np.maximum(ages[fresh], 0)
        self.hits += int(taken.shape[0])
        if ages.shape[0]:
            self.ages += np.bincount(np.minimum(ages, MAX_AGE_BUCKET), minlength=MAX_AGE_BUCKET + 1)
            self.max_age = max(self.max_age, int(ages.max()))
        return CachePlan(ids, hit, self.values[taken], use_step)

    def complete(self, plan: CachePlan, pulled: np.ndarray, refreshed: int) -> np.ndarray:
        """The rows of ``plan.ids``: its cached rows and the ``pulled`` rows of its misses
        (read from the servers at step ``refreshed``), which refresh the cache."""
        pulled = np.asarray(pulled, np.float32).reshape(-1, self.dim)
        if pulled.shape[0]:                       # pulled ahead of their use: that old when read
            age = max(0, plan.use_step - refreshed)
            self.ages[min(age, MAX_AGE_BUCKET)] += pulled.shape[0]
            self.max_age = max(self.max_age, age)
        if plan.hit_rows.shape[0] == 0:
            out = pulled
        else:
            out = np.empty((plan.ids.shape[0], self.dim), np.float32)
            out[plan.hit] = plan.hit_rows
            out[~plan.hit] = pulled
        self.store(plan.misses, pulled, refreshed)
        return out

    # ------------------------------------------------------------------ filling
    def store(self, ids: np.ndarray, rows: np.ndarray, refreshed: int) -> None:
        """Rows read from the servers at step ``refreshed``: cached ones are refreshed,
        others admitted as the module docstring says."""
        if self.capacity == 0 or not ids.shape[0]:
            return
        slots = self._slots(ids)
        cached = slots >= 0
        if cached.any():
            s = slots[cached]
            keep = self.refreshed[s] <= refreshed          # never replace newer values by older
            s = s[keep]
            self.values[s] = rows[cached][keep]
            self.refreshed[s] = refreshed
        new = np.flatnonzero(~cached)
        if not new.shape[0]:
            return
        if new.shape[0] <= self.n_free:            # room for all: no admission decision to make
            got = self.free[self.n_free - new.shape[0]:self.n_free][::-1].copy()
            self.n_free -= new.shape[0]
            self._admit(ids[new], rows[new], got, refreshed)
            return
        freq = self.frequency(ids[new])
        wanted = freq >= self.admit_after
        new, freq = new[wanted], freq[wanted]
        if not new.shape[0]:
            return
        order = np.argsort(-freq, kind="stable")                   # most frequent first
        new, freq = new[order], freq[order]
        take = min(self.n_free, new.shape[0])
        got = self.free[self.n_free - take:self.n_free][::-1].copy()
        self.n_free -= take
        rest = new.shape[0] - take
        if rest and self.size:
            got = np.concatenate([got, self._evict_for(freq[take:])])
        new = new[:got.shape[0]]
        self._admit(ids[new], rows[new], got, refreshed)

    def _evict_for(self, freq: np.ndarray) -> np.ndarray:
        """Free slots for candidates seen ``freq`` times (descending): each replaces the
        coldest cached row seen at most as often. Returns the freed slots, in order."""
        held = np.flatnonzero(self.ids >= 0)
        k = min(freq.shape[0], held.shape[0])
        held_freq = self.frequency(self.ids[held])
        # the coldest k: fewest lookups, then least recently used
        score = held_freq * (1 << 40) + self.used_at[held]
        coldest = held[np.argpartition(score, k - 1)[:k]] if k < held.shape[0] else held
        coldest = coldest[np.argsort(self.frequency(self.ids[coldest]) * (1 << 40) + self.used_at[coldest],
                                     kind="stable")][:k]
        beaten = self.frequency(self.ids[coldest]) <= freq[:k]
        victims = coldest[beaten[:coldest.shape[0]]]
        self._clear_slots(self.ids[victims])
        self.ids[victims] = -1
        return victims

    def _admit(self, ids: np.ndarray, rows: np.ndarray, slots: np.ndarray, refreshed: int) -> None:
        self.ids[slots] = ids
        self.values[slots] = rows
        self.refreshed[slots] = refreshed
        self.used_at[slots] = refreshed
        self._set_slots(ids, slots)

    def clear(self) -> None:
        """Forget every cached row (the tables were written: ``load_state_dict``, a restore)."""
        held = self.ids >= 0
        self._clear_slots(self.ids[held])
        self.ids[:] = -1
        self.free = np.arange(self.capacity - 1, -1, -1, dtype=np.int64)
        self.n_free = self.capacity

    def summary(self) -> dict:
        """Hit rate, the oldest row read, and how many rows are held."""
        return {"lookups": self.lookups, "hits": self.hits,
                "hit_rate": self.hits / self.lookups if self.lookups else 0.0,
                "max_staleness": self.max_age, "rows": self.size, "capacity": self.capacity}
