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

from shardps.metrics import STALENESS_BUCKETS
from shardps.tables import splitmix64

# bookkeeping per cached row beside its values: id, refreshed step, last use, sketch bucket
ROW_OVERHEAD_BYTES = 32
# a bounded table of at most this many rows gets a direct id -> slot map (4 bytes per row)
DIRECT_MAP_MAX_ROWS = 1 << 25
SKETCH_SIZE = 1 << 18
# staleness histogram: ages 0..MAX_AGE_BUCKET - 1 counted each, the last slot every older one
# (one past the metric's last bucket, so that older reads reach only its +Inf bucket)
MAX_AGE_BUCKET = STALENESS_BUCKETS[-1] + 1


def wanted_ids(ids: np.ndarray, plan: "CachePlan | None") -> np.ndarray:
    """The ids of a lookup that its pull fetches: all of them, or its cache plan's misses."""
    return ids if plan is None else plan.misses


@dataclass
class CachePlan:
    """How the rows of ``ids`` (distinct) are had for one lookup: ``hit`` from the cache
    (``hit_rows``, copied when planned: an eviction before the lookup cannot change them),
    the others (``misses``) from a pull."""

    ids: np.ndarray
    hit: np.ndarray                  # bool per id
    hit_rows: np.ndarray             # [hits, dim]
    use_step: int
    misses: np.ndarray               # ids[~hit]


class RowCache:
    """See the module docstring. ``budget_bytes`` bounds the cached rows' values and their
    bookkeeping (``nbytes``); besides, the id index takes 4 bytes per row of a bounded table
    (``num_rows``; 0: unbounded ids, a dict) and the frequency sketch 1 MiB.

    Cached rows fill slots ``[0, size)``: a row is only ever replaced (evicted for another),
    never removed alone, so the free slots are ``[size, capacity)``."""

    def __init__(self, dim: int, budget_bytes: int, num_rows: int = 0, admit_after: int = 2):
        self.dim = dim
        self.capacity = max(0, int(budget_bytes) // (dim * 4 + ROW_OVERHEAD_BYTES))
        self.admit_after = admit_after
        self.values = np.zeros((self.capacity, dim), np.float32)
        self.ids = np.full(self.capacity, -1, np.int64)
        self.refreshed = np.zeros(self.capacity, np.int64)
        self.used_at = np.zeros(self.capacity, np.int64)
        self.bucket = np.zeros(self.capacity, np.int64)      # each cached row's sketch bucket
        self.size = 0
        self._direct = np.full(num_rows, -1, np.int32) if 0 < num_rows <= DIRECT_MAP_MAX_ROWS else None
        self._index: dict[int, int] = {}
        self.sketch = np.zeros(SKETCH_SIZE, np.uint32)
        self._counted = 0
        # what was read: lookups, hits, and the age of every row read (a pulled row: the
        # steps it was pulled ahead of its use)
        self.lookups = 0
        self.hits = 0
        self.ages = np.zeros(MAX_AGE_BUCKET + 1, np.int64)
        self.max_age = 0

    def nbytes(self) -> int:
        """Bytes the cached rows' values and bookkeeping take (what ``budget_bytes`` bounds)."""
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
            return CachePlan(ids, np.zeros(ids.shape[0], bool), np.empty((0, self.dim), np.float32), use_step, ids)
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
        return CachePlan(ids, hit, self.values[taken], use_step, ids[~hit])

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
        room = self.capacity - self.size
        if new.shape[0] > room:                   # full: the frequent displace the rare
            buckets = self._buckets(ids[new])
            freq = self.sketch[buckets].astype(np.int64)
            wanted = freq >= self.admit_after
            order = np.argsort(-freq[wanted], kind="stable")         # most frequent first
            new, freq = new[wanted][order], freq[wanted][order]
            evicted = self._evict_for(freq[room:])
            new = new[:room + evicted.shape[0]]
        else:
            evicted = np.empty(0, np.int64)
        if not new.shape[0]:
            return
        fresh = new.shape[0] - evicted.shape[0]          # into free slots, the rest replace
        slots = np.concatenate([np.arange(self.size, self.size + fresh), evicted])
        self.size += fresh
        chosen = ids[new]
        self.ids[slots] = chosen
        self.values[slots] = rows[new]
        self.refreshed[slots] = refreshed
        self.used_at[slots] = refreshed
        self.bucket[slots] = self._buckets(chosen)
        self._set_slots(chosen, slots)

    def _evict_for(self, freq: np.ndarray) -> np.ndarray:
        """Slots of cached rows that candidates seen ``freq`` times (descending) replace:
        each the coldest cached row (fewest lookups, then least recently used) seen at most as
        often as its candidate. Their ids leave the index."""
        k = min(freq.shape[0], self.size)
        if k == 0:
            return np.empty(0, np.int64)
        held_freq = self.sketch[self.bucket[:self.size]].astype(np.int64)
        score = held_freq * (1 << 40) + self.used_at[:self.size]
        coldest = np.argpartition(score, k - 1)[:k] if k < self.size else np.arange(self.size)
        coldest = coldest[np.argsort(score[coldest], kind="stable")]
        victims = coldest[held_freq[coldest] <= freq[:k]]     # a prefix: both sides are sorted
        self._clear_slots(self.ids[victims])
        return victims

    def clear(self) -> None:
        """Forget every cached row (the tables were written: ``load_state_dict``, a restore)."""
        self._clear_slots(self.ids[:self.size])
        self.ids[:self.size] = -1
        self.size = 0

    def summary(self) -> dict:
        """Hit rate, the oldest row read, and how many rows are held."""
        return {"lookups": self.lookups, "hits": self.hits,
                "hit_rate": self.hits / self.lookups if self.lookups else 0.0,
                "max_staleness": self.max_age, "rows": self.size, "capacity": self.capacity}
