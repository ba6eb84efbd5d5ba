"""Blocks: the unit of placement, replication, migration and checkpoints.

A block holds a slice of one table: its values, optimizer state, (sparse) row index, the
exactly-once record of the pushes it applied, and a version (updates applied so far).
Updates are applied one at a time under the block's lock; callers take ``block.lock``.

Memory grows only with pushed rows: a sparse row never pushed is not stored (a pull computes
its initial value), and a dense block is materialised on its first update.

Plain numpy; no grpc, no torch.
"""

from __future__ import annotations

import json
import mmap
import threading
from dataclasses import dataclass, field

import numpy as np

from shardps import kernels
from shardps.errors import FailedPrecondition, InvalidArgument
from shardps.tables import (InitKind, TableConfig, TableKind, TableSpec,
                            dense_initial_values, initial_values, sparse_block_of)
from shardps.server import optimizers

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

BlockKey = tuple[str, str, int]   # (job, table, block index)


@dataclass
class WriterRecord:
    """Exactly-once record of one writer (session, incarnation) on one block.

    Every sequence below ``acked_below`` was acknowledged and is never retried; ``applied``
    holds the sequences at or above it that this block applied.
    """

    acked_below: int = 0
    applied: set[int] = field(default_factory=set)

    def seen(self, sequence: int) -> bool:
        return sequence < self.acked_below or sequence in self.applied

    def add(self, sequence: int, acked_below: int) -> None:
        if acked_below > self.acked_below:
            self.acked_below = acked_below
            self.applied = {s for s in self.applied if s >= acked_below}
        if sequence >= self.acked_below:
            self.applied.add(sequence)


@dataclass(frozen=True)
class Writer:
    """Identity of one push: (session, incarnation, sequence). Empty session: no dedup."""

    session: str = ""
    incarnation: int = 0
    sequence: int = 0
    acked_below: int = 0

    @property
    def tracked(self) -> bool:
        return bool(self.session) and self.sequence > 0


class Block:
    """State common to dense and sparse blocks. Not thread-safe: hold ``lock``."""

    kind: TableKind

    def __init__(self, key: BlockKey, spec: TableSpec):
        self.key = key
        self.spec = spec
        self.version = 0
        self.lock = threading.Lock()
        self.writers: dict[tuple[str, int], WriterRecord] = {}
        # SYNC groups: gradients accumulated per step, applied when every worker reported it
        self.pending: dict[int, list] = {}

    # --- exactly-once ---
    def already_applied(self, writer: Writer) -> bool:
        if not writer.tracked:
            return False
        record = self.writers.get((writer.session, writer.incarnation))
        return record is not None and record.seen(writer.sequence)

    def remember(self, writer: Writer) -> None:
        if writer.tracked:
            record = self.writers.setdefault((writer.session, writer.incarnation), WriterRecord())
            record.add(writer.sequence, writer.acked_below)

    def forget_writers(self, live: set[tuple[str, int]]) -> None:
        """Drop records of writers that left the group (they can never retry)."""
        for key in [k for k in self.writers if k not in live]:
            del self.writers[key]

    # --- SYNC accumulation ---
    def accumulate(self, step: int, part) -> None:
        self.pending.setdefault(step, []).append(part)

    # --- snapshots ---
    def _metadata(self) -> dict:
        return {
            "version": self.version,
            "writers": [[s, inc, rec.acked_below, sorted(rec.applied)]
                        for (s, inc), rec in self.writers.items()],
        }

    def _load_metadata(self, meta: dict) -> None:
        self.version = int(meta["version"])
        self.writers = {(s, int(inc)): WriterRecord(int(low), set(int(x) for x in applied))
                        for s, inc, low, applied in meta["writers"]}

    def nbytes(self) -> int:
        raise NotImplementedError


class DenseBlock(Block):
    """A contiguous flat range ``[start, stop)`` of a dense table."""

    kind = TableKind.DENSE

    def __init__(self, key: BlockKey, spec: TableSpec):
        super().__init__(key, spec)
        self.start, self.stop = spec.block_range(key[2])
        self.values: np.ndarray | None = None       # materialised on the first update
        self.state: dict[str, np.ndarray] = {}
        self.step = 0
        self.initialized = spec.init.kind is not InitKind.ASSIGNED

    @property
    def size(self) -> int:
        return self.stop - self.start

    def _materialise(self, config: TableConfig) -> np.ndarray:
        if self.values is None:
            self.values = stored(dense_initial_values(self.spec, self.start, self.stop))
        if not self.state and self.step == 0:
            self.state = {k: stored(v) for k, v in optimizers.new_state(config.optimizer, self.size).items()}
        return self.values

    def read(self, lo: int, hi: int, out: np.ndarray | None = None) -> np.ndarray:
        """Values of the flat table range [lo, hi) (inside this block): a view, or written
        into ``out`` when given."""
        if not self.initialized:
            raise FailedPrecondition(
                f"table {self.spec.name!r} block {self.key[2]} has no initial values yet "
                f"(ASSIGNED initializer): push INITIALIZE first")
        if self.values is None:
            init = self.spec.init
            if out is not None and init.kind in (InitKind.ZEROS, InitKind.CONSTANT):
                out.fill(init.value if init.kind is InitKind.CONSTANT else 0.0)
                return out
            values = dense_initial_values(self.spec, lo, hi)
        else:
            values = self.values[lo - self.start:hi - self.start]
        if out is not None:
            np.copyto(out, values)
            return out
        return values

    def apply_gradient(self, config: TableConfig, lo: int, hi: int, grad: np.ndarray) -> None:
        if not self.initialized:
            raise FailedPrecondition(
                f"table {self.spec.name!r} block {self.key[2]} has no initial values yet: "
                f"push INITIALIZE before gradients")
        values = self._materialise(config)
        a, b = lo - self.start, hi - self.start
        self.step += 1
        if a == 0 and b == self.size:
            optimizers.apply(config.optimizer, values, grad, self.state, self.step)
        else:   # a partial push updates only its elements; the block's step still counts it
            part_state = {k: v[a:b] for k, v in self.state.items()}
            optimizers.apply(config.optimizer, values[a:b], grad, part_state, self.step)
        self.version += 1

    def initialize(self, lo: int, hi: int, values: np.ndarray) -> bool:
        """Write initial values of an ASSIGNED block; the first writer wins. True if written."""
        if self.initialized:
            return False
        if (lo, hi) != (self.start, self.stop):
            raise InvalidArgument(
                f"INITIALIZE of table {self.spec.name!r} must cover whole blocks: block "
                f"{self.key[2]} is [{self.start}, {self.stop}), got [{lo}, {hi})")
        self.values = stored(values)
        self.initialized = True
        self.version += 1
        return True

    def nbytes(self) -> int:
        total = 0 if self.values is None else self.values.nbytes
        return total + sum(a.nbytes for a in self.state.values())

    def snapshot(self) -> tuple[dict, dict[str, np.ndarray]]:
        meta = self._metadata()
        meta.update(step=self.step, initialized=self.initialized,
                    pending={str(s): [[lo, hi] for lo, hi, _ in parts]
                             for s, parts in self.pending.items()})
        arrays = {}
        if self.values is not None:
            arrays["values"] = self.values.copy()
        for name, arr in self.state.items():
            arrays[f"state.{name}"] = arr.copy()
        for s, parts in self.pending.items():
            for i, (_, _, g) in enumerate(parts):
                arrays[f"pending.{s}.{i}"] = np.array(g, dtype=np.float32, copy=True)
        return meta, arrays

    def load(self, meta: dict, arrays: dict[str, np.ndarray]) -> None:
        self._load_metadata(meta)
        self.step = int(meta["step"])
        self.initialized = bool(meta["initialized"])
        values = arrays.get("values")
        self.values = None if values is None else stored(values)
        self.state = {k[len("state."):]: stored(v) for k, v in arrays.items() if k.startswith("state.")}
        self.pending = {int(s): [(lo, hi, arrays[f"pending.{s}.{i}"])
                                 for i, (lo, hi) in enumerate(parts)]
                        for s, parts in meta.get("pending", {}).items()}


class _Rows:
    """A growable ``[slots, *shape]`` array. Capacity doubles (in ``storage``): the memory
    beyond the rows written is never touched, so it is not resident (RSS tracks the rows
    stored), and a gather or scatter is one vectorised numpy operation."""

    def __init__(self, shape: tuple, dtype, fill=0):
        self.shape, self.dtype, self.fill = shape, dtype, fill
        self.data = np.empty((0,) + shape, dtype=dtype)
        self.size = 0

    def ensure(self, slots: int) -> None:
        if slots <= self.data.shape[0]:
            self.size = max(self.size, slots)
            return
        capacity = max(slots, 2 * self.data.shape[0], 1024)
        grown = storage((capacity,) + self.shape, self.dtype)
        grown[:self.size] = self.data[:self.size]
        self.data = grown
        self.size = slots

    def take(self, slots: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows at ``slots`` (each in [0, size)), into ``out`` if given (unbuffered)."""
        if out is None:
            return self.data[slots]
        # mode="clip" writes straight into out; the default buffers a whole temporary copy
        np.take(self.data, slots, axis=0, out=out, mode="clip")
        return out

    def put(self, slots: np.ndarray, values) -> None:
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
        keep = ~np.isin(self.ids, ids)
        self.ids, self.slots = stored(self.ids[keep], np.int64), stored(self.slots[keep], np.int32)

    def stored(self) -> tuple[np.ndarray, np.ndarray]:
        return self.ids, self.slots.astype(np.int64)


DIRECT_INDEX_MAX_ROWS = 1 << 24     # bounded tables up to 16M rows use a direct id -> slot map


class SparseShard:
    """Every row of one sparse table that this server holds, across all of its blocks.

    Rows live in growable arrays (values, optimizer state, per-row step counts) with one
    id -> slot index (a direct map for bounded tables, sorted ids otherwise), so that a
    request touching many blocks is a handful of vectorised numpy operations, not a loop over
    blocks. Blocks remain the unit of placement: a block's rows are those whose id hashes to
    it. Slots of removed rows are reused. Not thread-safe: hold ``lock`` (after block locks).
    """

    def __init__(self, spec: TableSpec):
        self.spec = spec
        self.dim = spec.dim
        self.lock = threading.Lock()
        n = spec.num_rows
        self.index = _DirectIndex(n) if 0 < n <= DIRECT_INDEX_MAX_ROWS else _SortedIndex()
        self.rows = _Rows((self.dim,), np.float32)
        self.state: dict[str, _Rows] = {}
        self.row_steps: _Rows | None = None
        self.used = 0                                   # slots handed out so far
        self.free = np.empty(0, dtype=np.int64)         # slots of removed rows, reused first
        self.block_counts = np.zeros(spec.num_blocks, dtype=np.int64)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Slot of each id, or -1 where the row is not stored."""
        return self.index.lookup(ids)

    def read(self, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``ids`` (any order, repeats allowed): stored or initial, ``[n, dim]``
        (written into ``out`` if given)."""
        slots = self.lookup(ids)
        missing = slots < 0
        if not missing.any():
            return self.rows.take(slots, out)
        if out is None:
            out = np.empty((ids.shape[0], self.dim), dtype=np.float32)
        present = ~missing
        out[present] = self.rows.take(slots[present])
        out[missing] = initial_values(self.spec.init, ids[missing], self.dim)
        return out

    def _ensure_state(self, config: TableConfig | None, names=()) -> None:
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
        for pages in [self.rows, *self.state.values()] + ([self.row_steps] if self.row_steps else []):
            pages.ensure(self.used)
        return np.concatenate([reuse, fresh]) if reuse.shape[0] else fresh

    def insert(self, new_ids: np.ndarray, config: TableConfig | None, values: np.ndarray | None = None,
               state: dict[str, np.ndarray] | None = None, steps: np.ndarray | None = None) -> np.ndarray:
        """Store rows for ``new_ids`` (unique, absent): initial values unless given. Returns
        their slots."""
        n = new_ids.shape[0]
        if n == 0:
            return np.empty(0, dtype=np.int64)
        self._ensure_state(config, state or ())
        if steps is not None:
            self._ensure_row_steps()
        slots = self._allocate(n)
        self.rows.put(slots, initial_values(self.spec.init, new_ids, self.dim) if values is None else values)
        for name, pages in self.state.items():
            if state and name in state:
                pages.put(slots, state[name])
            else:
                pages.put(slots, pages.fill)
        if self.row_steps is not None:
            self.row_steps.put(slots, 0 if steps is None else steps)
        self.index.add(new_ids, slots)
        blocks = sparse_block_of(new_ids, self.spec.num_blocks)
        self.block_counts += np.bincount(blocks, minlength=self.block_counts.shape[0])
        return slots

    def apply(self, config: TableConfig, ids: np.ndarray, grad: np.ndarray) -> None:
        """Apply ``grad`` ``[n, dim]`` to rows ``ids`` (unique), storing new rows first."""
        self._ensure_state(config)
        slots = self.lookup(ids)
        missing = slots < 0
        if missing.any():
            slots[missing] = self.insert(ids[missing], config)
        if kernels.AVAILABLE:       # one fused pass over the rows, in place
            kernels.apply_rows(config.optimizer, self.rows.data, {k: v.data for k, v in self.state.items()},
                               self.row_steps.data if self.row_steps is not None else None,
                               slots, grad.reshape(-1, self.dim))
            return
        params = self.rows.take(slots)
        state = {k: v.take(slots) for k, v in self.state.items()}
        step = 1
        if self.row_steps is not None:
            steps = self.row_steps.take(slots) + 1
            self.row_steps.put(slots, steps)
            step = steps[:, None]
        optimizers.apply(config.optimizer, params, grad, state, step)
        self.rows.put(slots, params)
        for k, v in state.items():
            self.state[k].put(slots, v)

    def block_rows(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, slots) of ``block``'s stored rows, ordered by id (canonical for snapshots)."""
        ids, slots = self.index.stored()
        mine = sparse_block_of(ids, self.spec.num_blocks) == block
        ids, slots = ids[mine], slots[mine]
        order = np.argsort(ids, kind="stable")
        return ids[order], slots[order]

    def remove_block(self, block: int) -> None:
        """Forget every row of ``block``; its slots are reused by later inserts."""
        if self.block_counts[block] == 0:
            return
        ids, slots = self.block_rows(block)
        self.index.remove(ids)
        self.free = np.concatenate([self.free, slots])
        self.block_counts[block] = 0

    def row_bytes(self) -> int:
        """Bytes one stored row takes: values, optimizer state, step count, index entry."""
        per = self.dim * 4 * (1 + len(self.state)) + (4 if self.row_steps is not None else 0)
        return per + (4 if isinstance(self.index, _DirectIndex) else 12)


class SparseBlock(Block):
    """The rows of a sparse table whose ids hash to this block, stored in the server's
    ``SparseShard`` of that table (shared by the table's blocks on this server)."""

    kind = TableKind.SPARSE

    def __init__(self, key: BlockKey, spec: TableSpec, shard: SparseShard | None = None):
        super().__init__(key, spec)
        self.dim = spec.dim
        self.shard = shard if shard is not None else SparseShard(spec)

    @property
    def count(self) -> int:
        return int(self.shard.block_counts[self.key[2]])

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        with self.shard.lock:
            return self.shard.lookup(ids)

    def read(self, ids: np.ndarray) -> np.ndarray:
        """Rows of ``ids`` (any order, repeats allowed), float32 ``[n, dim]``: stored or initial."""
        with self.shard.lock:
            return self.shard.read(ids)

    def apply_gradient(self, config: TableConfig, ids: np.ndarray, grad: np.ndarray) -> None:
        """Apply ``grad`` ``[n, dim]`` to rows ``ids`` (unique, all of this block)."""
        with self.shard.lock:
            self.shard.apply(config, ids, grad)
        self.version += 1

    def release(self) -> None:
        """This server no longer holds the block: drop its rows."""
        with self.shard.lock:
            self.shard.remove_block(self.key[2])

    def nbytes(self) -> int:
        return self.count * self.shard.row_bytes()

    def snapshot(self) -> tuple[dict, dict[str, np.ndarray]]:
        meta = self._metadata()
        sh = self.shard
        with sh.lock:
            ids, slots = sh.block_rows(self.key[2])
            meta.update(count=int(slots.shape[0]),
                        pending={str(s): len(parts) for s, parts in self.pending.items()})
            arrays = {"ids": ids, "values": sh.rows.take(slots)}
            for name, pages in sh.state.items():
                arrays[f"state.{name}"] = pages.take(slots)
            if sh.row_steps is not None:
                arrays["row_steps"] = sh.row_steps.take(slots)
        for s, parts in self.pending.items():
            for i, (ids, g) in enumerate(parts):
                arrays[f"pending.{s}.{i}.ids"] = np.array(ids, dtype=np.int64, copy=True)
                arrays[f"pending.{s}.{i}.grad"] = np.array(g, dtype=np.float32, copy=True)
        return meta, arrays

    def load(self, meta: dict, arrays: dict[str, np.ndarray]) -> None:
        self._load_metadata(meta)
        count = int(meta["count"])
        ids = np.asarray(arrays["ids"], dtype=np.int64).reshape(count)
        values = np.asarray(arrays["values"], dtype=np.float32).reshape(count, self.dim)
        state = {k[len("state."):]: np.asarray(v, dtype=np.float32).reshape(count, self.dim)
                 for k, v in arrays.items() if k.startswith("state.")}
        steps = (np.asarray(arrays["row_steps"]).astype(np.int32) if "row_steps" in arrays else None)
        with self.shard.lock:
            self.shard.remove_block(self.key[2])
            self.shard.insert(ids, None, values, state, steps)
        self.pending = {int(s): [(arrays[f"pending.{s}.{i}.ids"],
                                  arrays[f"pending.{s}.{i}.grad"].reshape(-1, self.dim))
                                 for i in range(n)]
                        for s, n in meta.get("pending", {}).items()}


def new_block(key: BlockKey, spec: TableSpec, shard: SparseShard | None = None) -> Block:
    """A new empty block; sparse blocks store their rows in ``shard`` (a private one if None)."""
    return DenseBlock(key, spec) if spec.kind is TableKind.DENSE else SparseBlock(key, spec, shard)


def encode_metadata(meta: dict) -> bytes:
    return json.dumps(meta, separators=(",", ":")).encode()


def decode_metadata(raw: bytes) -> dict:
    return json.loads(raw.decode()) if raw else {}
