"""Where a server stores rows: ``storage`` (long-lived arrays, memory-mapped from 64 KiB) and
``SparseRows`` (every row of one sparse table this server holds, across its blocks, with
its id -> slot index). ``server.blocks`` builds the blocks on top; see it for the model.

Plain numpy; no grpc, no torch.
"""

from __future__ import annotations

import mmap
import threading
from typing import TYPE_CHECKING, NamedTuple, cast

import numpy as np

from shardps import id_blocks, kernels
from shardps.server import optimizers
from shardps.server.node import optimizer_kernels, storage_kernels
from shardps.tables import InitKind, TableConfig, TableSpec

if TYPE_CHECKING:
    from shardps.server.node.cold import ColdRows
    from shardps.server.node.lifecycle import Outcome, TableLifecycle

MAPPED_MIN_BYTES = 64 << 10


def storage(shape, dtype=np.float32) -> np.ndarray:
    """An uninitialised array for long-lived state: stored values, optimizer state, indexes.

    From 64 KiB up it gets its own anonymous memory mapping (pages become resident when
    first written, and return to the system when the array is freed). Stored tables so never
    share the allocator's heap with request temporaries: the heap, which glibc keeps for
    reuse (keeping transient buffers cheap), does not grow with the tables, and deleting or
    moving a table gives its memory back."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    if n * dtype.itemsize < MAPPED_MIN_BYTES:
        return np.empty(shape, dtype=dtype)
    return np.frombuffer(mmap.mmap(-1, n * dtype.itemsize), dtype=dtype, count=n).reshape(shape)


def stored(values: np.ndarray, dtype=np.float32) -> np.ndarray:
    """A copy of ``values`` in ``storage``."""
    values = np.asarray(values)
    out = storage(values.shape, dtype)
    np.copyto(out, values, casting="unsafe")
    return out


class _Rows:
    """A growable ``[slots, *shape]`` array. Capacity doubles (in ``storage``): the memory
    beyond the rows written is not touched until the array grows past it (then the old
    array is copied whole: its rows and fewer unused ones than the growing request adds), so
    it is not resident (RSS tracks the rows stored), and a gather or scatter is one
    vectorised numpy operation."""

    def __init__(self, shape: tuple, dtype, fill=0):
        self.shape, self.dtype, self.fill = shape, dtype, fill
        self.data = np.empty((0,) + shape, dtype=dtype)

    def ensure(self, slots: int) -> None:
        """Room for ``slots`` rows (the array moves when it grows)."""
        if slots <= self.data.shape[0]:
            return
        capacity = max(slots, 2 * self.data.shape[0], 1024)
        grown = storage((capacity,) + self.shape, self.dtype)
        grown[:self.data.shape[0]] = self.data
        self.data = grown

    def take(self, slots: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows at ``slots`` (each a slot handed out), into ``out`` if given (unbuffered)."""
        if out is None:
            return self.data[slots]
        # mode="clip" writes straight into out; the default buffers a whole temporary copy
        np.take(self.data, slots, axis=0, out=out, mode="clip")
        return out

    def put(self, slots: np.ndarray | slice, values) -> None:
        self.data[slots] = values


class _DirectIndex:
    """id -> slot for ids in [0, num_rows): one int32 per possible id (4 bytes a row)."""

    def __init__(self, num_rows: int):
        self.slot_of = storage(num_rows, np.int32)
        self.slot_of.fill(-1)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        return self.slot_of[ids].astype(np.int64)

    def add(self, ids: np.ndarray, slots: np.ndarray) -> None:
        self.slot_of[ids] = slots

    def remove(self, ids: np.ndarray) -> None:
        self.slot_of[ids] = -1

    def stored(self) -> tuple[np.ndarray, np.ndarray]:
        ids = np.flatnonzero(self.slot_of >= 0).astype(np.int64)
        return ids, self.slot_of[ids].astype(np.int64)


class _SortedIndex:
    """id -> slot for any int64 ids: sorted ids and their slots (12 bytes a row)."""

    def __init__(self):
        self.ids = np.empty(0, dtype=np.int64)
        self.slots = np.empty(0, dtype=np.int32)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        n = self.ids.shape[0]
        if n == 0:
            return np.full(ids.shape[0], -1, dtype=np.int64)
        pos = np.searchsorted(self.ids, ids)
        np.minimum(pos, n - 1, out=pos)
        return np.where(self.ids[pos] == ids, self.slots[pos], -1).astype(np.int64)

    def add(self, ids: np.ndarray, slots: np.ndarray) -> None:
        order = np.argsort(ids, kind="stable")
        sorted_ids = ids[order]
        # merge into fresh arrays in storage (as np.insert would, outside the heap)
        dest = np.searchsorted(self.ids, sorted_ids) + np.arange(sorted_ids.shape[0])
        n = self.ids.shape[0] + sorted_ids.shape[0]
        old = storage(n, bool)        # a mapping of its own: this mask grows with every insert
        old.fill(True)
        old[dest] = False
        merged_ids, merged_slots = storage(n, np.int64), storage(n, np.int32)
        merged_ids[dest], merged_ids[old] = sorted_ids, self.ids
        merged_slots[dest], merged_slots[old] = slots[order], self.slots
        self.ids, self.slots = merged_ids, merged_slots

    def remove(self, ids: np.ndarray) -> None:
        """Forget ``ids`` (those not here are ignored)."""
        n = self.ids.shape[0]
        if n == 0:
            return
        pos = np.minimum(np.searchsorted(self.ids, ids), n - 1)
        keep = np.ones(n, dtype=bool)
        keep[pos[self.ids[pos] == ids]] = False
        self.ids, self.slots = stored(self.ids[keep], np.int64), stored(self.slots[keep], np.int32)

    def stored(self) -> tuple[np.ndarray, np.ndarray]:
        return self.ids, self.slots.astype(np.int64)


DIRECT_INDEX_MAX_ROWS = 1 << 24     # bounded tables up to 16M rows use a direct id -> slot map


class InitCache:
    """Initial values that reads of missing rows computed lately, for the push that stores
    those rows soon after (a worker pulls a row, then pushes its gradient): the push copies
    them instead of computing them again. Only for initialisers that cost more than the copy
    (normal: a float64 log1p, sqrt and cos per element). A direct-mapped table of ``slots``
    rows (``MAX_BYTES`` at most, outside a table's memory budget), read and written by the
    compiled kernels under the rows' lock; values are a pure function of the table's seed
    and the row id, so an entry is never stale."""

    MAX_BYTES = 1 << 22
    MAX_SLOTS = 1 << 14

    def __init__(self, spec: TableSpec):
        slots = 1 << max(0, min(self.MAX_SLOTS, self.MAX_BYTES // (4 * max(1, spec.dim))).bit_length() - 1)
        self.ids = np.zeros(slots, np.int64)
        self.ok = np.zeros(slots, np.uint8)
        self.rows = np.zeros((slots, spec.dim), np.float32)

    @classmethod
    def none(cls, dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The kernels' arguments for no cache."""
        return np.zeros(0, np.int64), np.zeros(0, np.uint8), np.zeros((0, dim), np.float32)


_NO_STEPS = np.empty(0, np.int32)
_NO_STATE = (np.empty((0, 0), np.float32), 0.0)


class _Bound(NamedTuple):
    """A table's arrays as its compiled kernels take them, kept while none moves: ``room``
    rows in every per-row array; ``new_rows``, ``_assign_init``'s arguments after the slots
    (where new rows go, their initial values and their optimizer state's); ``update``, the
    optimizer's (``optimizer_kernels.bound``) under the config ``_ensure_state`` ensured."""

    room: int
    new_rows: tuple
    update: tuple


class SparseRows:
    """Every row of one sparse table that this server holds, across all of its blocks.

    Rows live in growable arrays (values, optimizer state, per-row step counts) with one
    id -> slot index (a direct map for bounded tables, sorted ids otherwise), so that a
    request touching many blocks is a handful of vectorised numpy operations, not a loop over
    blocks. Blocks remain the unit of placement: a block's rows are those whose id hashes to
    it. Slots of removed rows are reused. Not thread-safe: hold ``lock`` (after block locks).
    """

    def __init__(self, spec: TableSpec, cold_dir: str = ""):
        self.spec = spec
        self.dim = spec.dim
        self.lock = threading.Lock()
        n = spec.num_rows
        self.index = _DirectIndex(n) if 0 < n <= DIRECT_INDEX_MAX_ROWS else _SortedIndex()
        self.rows = _Rows((self.dim,), np.float32)
        self.state: dict[str, _Rows] = {}
        self.row_steps: _Rows | None = None
        self.ticks: _Rows | None = None                 # lifecycle: tick of each row's last push
        self.life: TableLifecycle | None = None         # lifecycle state (server/node/lifecycle.py)
        self.cold: ColdRows | None = None               # the cold tier (server/node/cold.py)
        self.cold_dir = cold_dir                        # where it goes ("": the system's temp directory)
        self.cold_error_at = float("-inf")              # when it last could not take rows (logged)
        self.used = 0                                   # slots handed out so far
        self.free = np.empty(0, dtype=np.int64)         # slots of removed rows, reused first
        self.block_counts = np.zeros(spec.num_blocks, dtype=np.int64)
        self.init = kernels.init_params(spec.init)      # the kernels' arguments for new rows
        cache = InitCache(spec) if spec.init.kind is InitKind.NORMAL else None
        self.cache = (cache.ids, cache.ok, cache.rows) if cache is not None else InitCache.none(spec.dim)
        self._state_for: TableConfig | None = None      # the config whose state is ensured
        self._kernel_args: _Bound | None = None         # see _bound; None after _ensure_state changed anything

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Slot of each id, or -1 where the row is not stored."""
        return self.index.lookup(ids)

    def read(self, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``ids`` (any order, repeats allowed): stored or initial, ``[n, dim]``
        (written into ``out`` if given)."""
        if self.life is None and kernels.AVAILABLE and isinstance(self.index, _DirectIndex):
            if out is None:
                out = np.empty((ids.shape[0], self.dim), dtype=np.float32)
            storage_kernels._gather_init(self.index.slot_of, self.rows.data, ids, out, *self.init, *self.cache)
            return out
        slots = self.lookup(ids)
        missing = slots < 0
        if not missing.any():
            if self.life is not None:
                self.life.count_pull(ids, None)
            return self.rows.take(slots, out)
        if out is None:
            out = np.empty((ids.shape[0], self.dim), dtype=np.float32)
        present = ~missing
        out[present] = self.rows.take(slots[present])
        if self.cold is not None and self.cold.count:      # rows the budget moved to disk
            where = np.flatnonzero(missing)
            cold_slots = self.cold.lookup(ids[where])
            found = cold_slots >= 0
            if found.any():
                out[where[found]] = self.cold.read(cold_slots[found])
                missing[where[found]] = False
        if self.life is not None:
            self.life.count_pull(ids, missing if missing.any() else None)
        if missing.any():
            out[missing] = self.initial(ids[missing], remember=True)
        return out

    def initial(self, ids: np.ndarray, remember: bool = False) -> np.ndarray:
        """Initial values of rows ``ids`` (the cache's where it holds them; ``remember``: kept
        there, for a read's missing rows)."""
        if not kernels.AVAILABLE:
            return kernels.initial_values(self.spec.init, ids, self.dim)
        out = np.empty((ids.shape[0], self.dim), dtype=np.float32)
        storage_kernels._init_rows(np.ascontiguousarray(ids, dtype=np.int64), out, *self.init, *self.cache, remember)
        return out

    def _ensure_state(self, config: TableConfig | None, names=()) -> None:
        if config is not None and config is self._state_for and not names:
            return                  # ensured for this config (frozen) already: every push's case
        self._kernel_args = None
        wanted = set(names)
        if config is not None:
            wanted |= set(optimizers.state_names(config.optimizer))
        for name in wanted - set(self.state):
            fill = config.optimizer.initial_accumulator_value if (config and name == "sum") else 0.0
            self.state[name] = self._pages((self.dim,), np.float32, fill)
        if config is not None and "sum" in self.state:     # rows inserted later start here
            self.state["sum"].fill = config.optimizer.initial_accumulator_value
        if config is not None and optimizers.needs_row_steps(config.optimizer):
            self._ensure_row_steps()
        if config is not None and not names:
            self._state_for = config

    def _pages(self, shape: tuple, dtype, fill) -> _Rows:
        """New per-row arrays covering the slots handed out so far, at ``fill``."""
        pages = _Rows(shape, dtype, fill)
        pages.ensure(self.used)
        if self.used:
            pages.put(slice(0, self.used), fill)
        return pages

    def _ensure_row_steps(self) -> None:
        if self.row_steps is None:
            self.row_steps = self._pages((), np.int32, 0)

    def _allocate(self, n: int) -> np.ndarray:
        reuse = self.free[:n]
        self.free = self.free[n:]
        fresh = np.arange(self.used, self.used + (n - reuse.shape[0]), dtype=np.int64)
        self.used += fresh.shape[0]
        for pages in [self.rows, *self.state.values(), self.row_steps, self.ticks]:
            if pages is not None:
                pages.ensure(self.used)
        return np.concatenate([reuse, fresh]) if reuse.shape[0] else fresh

    def insert(self, new_ids: np.ndarray, config: TableConfig | None, values: np.ndarray | None = None,
               state: dict[str, np.ndarray] | None = None, steps: np.ndarray | None = None,
               ticks: np.ndarray | None = None) -> np.ndarray:
        """Store rows for ``new_ids`` (unique, absent): initial values unless given (last-push
        ticks: 0 unless given). Returns their slots."""
        n = new_ids.shape[0]
        if n == 0:
            return np.empty(0, dtype=np.int64)
        self._ensure_state(config, state or ())
        if steps is not None:
            self._ensure_row_steps()
        slots = self._allocate(n)
        if values is None:
            values = self.initial(new_ids)
        self.rows.put(slots, values)
        for name, pages in self.state.items():
            if state and name in state:
                pages.put(slots, state[name])
            else:
                pages.put(slots, pages.fill)
        if self.row_steps is not None:
            self.row_steps.put(slots, 0 if steps is None else steps)
        if ticks is not None:
            self.ensure_ticks()
        if self.ticks is not None:
            self.ticks.put(slots, 0 if ticks is None else ticks)
        self.index.add(new_ids, slots)
        blocks = id_blocks.sparse_block_of(new_ids, self.spec.num_blocks)
        self.block_counts += np.bincount(blocks, minlength=self.block_counts.shape[0])
        return slots

    def apply(self, config: TableConfig, ids: np.ndarray, grad: np.ndarray, tick: int | None = None,
              wall: float | None = None) -> Outcome | None:
        """Apply ``grad`` ``[n, dim]`` to rows ``ids`` (unique), storing new rows first. With
        a lifecycle policy (or state from one), the primary's decisions are made and
        returned (``server.lifecycle.apply_push``; ``tick``: the push's clock, None: the
        block's clock plus one, for ids of one block; ``wall``: seconds for ttl_seconds);
        without, None."""
        if self.life is None and not config.lifecycle.enabled:
            self.apply_rows(config, ids, grad)
            return None
        from shardps.server.node import lifecycle
        if tick is None:
            first = id_blocks.sparse_block_of(ids[:1], self.spec.num_blocks)
            tick = int(self.lifecycle().now[first].max(initial=0)) + 1
        return lifecycle.apply_push(self, config, ids, grad.reshape(-1, self.dim), tick, wall)

    def _bound(self, config: TableConfig, slots: int) -> _Bound:
        """The compiled kernels' arguments under ``config`` (just ensured by ``_ensure_state``)
        with room for ``slots`` rows. Kept until more room is needed: an array moves only when
        it grows past its capacity (``_Rows.ensure``, whoever calls it), which is at least
        ``room``, for slots this table then uses; arrays are added, and the config changes,
        only in ``_ensure_state``, which drops them."""
        bound = self._kernel_args
        if bound is None or slots > bound.room:
            bound = self._kernel_args = _bind(self, config, slots)
        return bound

    def _assign(self, config: TableConfig, ids: np.ndarray) -> np.ndarray:
        """Slots of ``ids`` (unique), new rows stored at their initial values with their
        optimizer state (compiled: bounded tables, no lifecycle state)."""
        bound = self._bound(config, self.used + max(0, ids.shape[0] - self.free.shape[0]))
        slots = np.empty(ids.shape[0], dtype=np.int64)
        _, taken, self.used = storage_kernels._assign_init(
            cast(_DirectIndex, self.index).slot_of, ids, self.free, self.used, self.block_counts.shape[0],
            self.block_counts, slots, *bound.new_rows)
        if taken:
            self.free = self.free[taken:]
        return slots

    def apply_rows(self, config: TableConfig, ids: np.ndarray, grad: np.ndarray) -> np.ndarray:
        """Apply ``grad`` ``[n, dim]`` to rows ``ids`` (unique), storing new rows first (no
        lifecycle decisions). Returns their slots."""
        self._ensure_state(config)
        if kernels.AVAILABLE and isinstance(self.index, _DirectIndex) and self.ticks is None:
            slots = self._assign(config, ids)
        else:
            slots = self.lookup(ids)
            missing = slots < 0
            if missing.any():
                slots[missing] = self.insert(ids[missing], config)
        if kernels.AVAILABLE:       # one fused pass over the rows, in place
            optimizer_kernels.run(self._bound(config, self.used).update, slots, grad.reshape(-1, self.dim))
            return slots
        params = self.rows.take(slots)
        state = {k: v.take(slots) for k, v in self.state.items()}
        step: int | np.ndarray = 1
        if self.row_steps is not None:
            steps = self.row_steps.take(slots) + 1
            self.row_steps.put(slots, steps)
            step = steps[:, None]
        optimizers.apply(config.optimizer, params, grad, state, step)
        self.rows.put(slots, params)
        for k, v in state.items():
            self.state[k].put(slots, v)
        return slots

    def assign_values(self, config: TableConfig, ids: np.ndarray, values: np.ndarray) -> None:
        """Overwrite rows ``ids`` (unique) with ``values``, storing absent ones; their
        optimizer state and step counts start afresh. Not for tables with lifecycle state."""
        self._ensure_state(config)
        slots = self.lookup(ids)
        missing = slots < 0
        if missing.any():
            self.insert(ids[missing], config, values[missing])
        present = ~missing
        if present.any():
            old = slots[present]
            self.rows.put(old, values[present])
            for pages in self.state.values():
                pages.put(old, pages.fill)
            if self.row_steps is not None:
                self.row_steps.put(old, 0)

    def lifecycle(self) -> TableLifecycle:
        """The table's lifecycle state here, created on first use."""
        if self.life is None:
            from shardps.server.node.lifecycle import TableLifecycle
            self.life = TableLifecycle(self.spec.num_blocks)
        return self.life

    def ensure_ticks(self) -> _Rows:
        """The per-row last-push ticks, created (at 0) on first use."""
        if self.ticks is None:
            self.ticks = self._pages((), np.int32, 0)
        return self.ticks

    def remove(self, ids: np.ndarray) -> None:
        """Forget rows ``ids`` (unique, stored); their slots are reused by later inserts."""
        if ids.shape[0] == 0:
            return
        slots = self.lookup(ids)
        self.index.remove(ids)
        self.free = np.concatenate([self.free, slots])
        blocks = id_blocks.sparse_block_of(ids, self.spec.num_blocks)
        self.block_counts -= np.bincount(blocks, minlength=self.block_counts.shape[0])

    def ensure_cold(self) -> ColdRows:
        """The table's cold tier here, created on first use (ValueError naming the
        directory when it cannot hold files)."""
        if self.cold is None:
            from shardps.server.node.cold import ColdRows, cold_root
            self.cold = ColdRows(self.spec.num_blocks, self.dim, cold_root(self.cold_dir))
        return self.cold

    def block_rows(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, slots) of ``block``'s stored rows, ordered by id (canonical for snapshots)."""
        ids, slots = self.index.stored()
        mine = id_blocks.sparse_block_of(ids, self.spec.num_blocks) == block
        ids, slots = ids[mine], slots[mine]
        order = np.argsort(ids, kind="stable")
        return ids[order], slots[order]

    def remove_block(self, block: int) -> None:
        """Forget every row of ``block`` (both tiers); its slots are reused by later inserts."""
        if self.cold is not None:
            self.cold.remove_block(block)
        if self.block_counts[block] == 0:
            return
        ids, slots = self.block_rows(block)
        self.index.remove(ids)
        self.free = np.concatenate([self.free, slots])
        self.block_counts[block] = 0
        if self.life is not None:
            self.life.forget_block(block)

    def row_bytes(self) -> int:
        """Bytes one stored row takes: values, optimizer state, step count, index entry."""
        per = self.dim * 4 * (1 + len(self.state)) + (4 if self.row_steps is not None else 0)
        per += 4 if self.ticks is not None else 0
        return per + (4 if isinstance(self.index, _DirectIndex) else 12)

    def memory_bytes(self) -> int:
        """Bytes this table's storage here takes: every slot handed out (stored rows and
        the free slots kept for reuse), the index entries, the admission sketches in use."""
        index = 4 if isinstance(self.index, _DirectIndex) else 12
        stored = int(self.block_counts.sum())
        sketch = self.life.sketch_bytes() if self.life is not None else 0
        return self.used * (self.row_bytes() - index) + stored * index + sketch


def _bind(rows: SparseRows, config: TableConfig, slots: int) -> _Bound:
    """``SparseRows._bound``'s arguments, its per-row arrays grown to ``slots`` rows first."""
    pages = [p for p in (rows.rows, *rows.state.values(), rows.row_steps) if p is not None]
    for p in pages:
        p.ensure(slots)
    # up to two optimizer state arrays (array, fill): what the compiled insert writes
    states = [(p.data, float(p.fill)) for p in rows.state.values()]
    assert len(states) <= 2, f"optimizer state {sorted(rows.state)}: the compiled insert writes two at most"
    first, second = (states + [_NO_STATE, _NO_STATE])[:2]
    steps = rows.row_steps.data if rows.row_steps is not None else None
    new_rows = (rows.rows.data, *rows.init, *rows.cache, *first, *second, _NO_STEPS if steps is None else steps)
    update = optimizer_kernels.bound(config.optimizer, rows.rows.data, {k: v.data for k, v in rows.state.items()},
                                     steps)
    return _Bound(min(p.data.shape[0] for p in pages), new_rows, update)
