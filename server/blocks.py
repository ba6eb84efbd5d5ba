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
import threading
from dataclasses import dataclass, field

import numpy as np

from shardps.errors import FailedPrecondition, InvalidArgument
from shardps.tables import (InitKind, TableConfig, TableKind, TableSpec,
                            dense_initial_values, initial_values)
from shardps.server import optimizers

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
            self.values = dense_initial_values(self.spec, self.start, self.stop)
        if not self.state and self.step == 0:
            self.state = optimizers.new_state(config.optimizer, self.size)
        return self.values

    def read(self, lo: int, hi: int) -> np.ndarray:
        """Values of the flat table range [lo, hi) (inside this block). May be a view."""
        if not self.initialized:
            raise FailedPrecondition(
                f"table {self.spec.name!r} block {self.key[2]} has no initial values yet "
                f"(ASSIGNED initializer): push INITIALIZE first")
        if self.values is None:
            return dense_initial_values(self.spec, lo, hi)
        return self.values[lo - self.start:hi - self.start]

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
        self.values = np.array(values, dtype=np.float32, copy=True)
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
        self.values = arrays.get("values")
        self.state = {k[len("state."):]: v for k, v in arrays.items() if k.startswith("state.")}
        self.pending = {int(s): [(lo, hi, arrays[f"pending.{s}.{i}"])
                                 for i, (lo, hi) in enumerate(parts)]
                        for s, parts in meta.get("pending", {}).items()}


class SparseBlock(Block):
    """The rows of a sparse table whose ids hash to this block.

    Rows are stored in insertion order (``rows[slot]``); ``ids`` is kept sorted with the
    matching ``slots`` so that lookups are one ``searchsorted``.
    """

    kind = TableKind.SPARSE
    _GROWTH = 1.5

    def __init__(self, key: BlockKey, spec: TableSpec):
        super().__init__(key, spec)
        self.dim = spec.dim
        self.count = 0
        self.ids = np.empty(0, dtype=np.int64)        # sorted
        self.slots = np.empty(0, dtype=np.int32)      # slot of ids[i]
        self.rows = np.empty((0, self.dim), dtype=np.float32)
        self.state: dict[str, np.ndarray] = {}
        self.row_steps: np.ndarray | None = None

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Slot of each id, or -1 where the row was never pushed."""
        if self.count == 0:
            return np.full(ids.shape[0], -1, dtype=np.int64)
        pos = np.searchsorted(self.ids, ids)
        pos_clipped = np.minimum(pos, self.count - 1)
        found = self.ids[pos_clipped] == ids
        return np.where(found, self.slots[pos_clipped].astype(np.int64), -1)

    def read(self, ids: np.ndarray) -> np.ndarray:
        """Rows of ``ids`` (any order, repeats allowed), float32 ``[n, dim]``: stored or initial."""
        slots = self.lookup(ids)
        missing = slots < 0
        if not missing.any():
            return self.rows[slots]
        out = np.empty((ids.shape[0], self.dim), dtype=np.float32)
        present = ~missing
        out[present] = self.rows[slots[present]]
        out[missing] = initial_values(self.spec.init, ids[missing], self.dim)
        return out

    def _reserve(self, extra: int, config: TableConfig) -> None:
        need = self.count + extra
        capacity = self.rows.shape[0]
        if need <= capacity:
            return
        new_capacity = max(need, int(capacity * self._GROWTH), 16)

        def grow(arr: np.ndarray, fill: float = 0.0) -> np.ndarray:
            out = np.full((new_capacity,) + arr.shape[1:], fill, dtype=arr.dtype)
            out[:self.count] = arr[:self.count]
            return out

        self.rows = grow(self.rows)
        if not self.state:
            self.state = optimizers.new_state(config.optimizer, (0, self.dim))
        self.state = {k: grow(v, config.optimizer.initial_accumulator_value if k == "sum" else 0.0)
                      for k, v in self.state.items()}
        if optimizers.needs_row_steps(config.optimizer):
            self.row_steps = grow(self.row_steps if self.row_steps is not None
                                  else np.zeros(0, dtype=np.int32))

    def _insert(self, new_ids: np.ndarray, config: TableConfig) -> None:
        """Store rows for ``new_ids`` (unique, absent) at their initial values."""
        n = new_ids.shape[0]
        self._reserve(n, config)
        first = self.count
        self.rows[first:first + n] = initial_values(self.spec.init, new_ids, self.dim)
        new_slots = np.arange(first, first + n, dtype=np.int32)
        self.count += n
        ids = np.concatenate([self.ids, new_ids])
        slots = np.concatenate([self.slots, new_slots])
        order = np.argsort(ids, kind="stable")
        self.ids, self.slots = ids[order], slots[order]

    def apply_gradient(self, config: TableConfig, ids: np.ndarray, grad: np.ndarray) -> None:
        """Apply ``grad`` ``[n, dim]`` to rows ``ids`` (unique)."""
        slots = self.lookup(ids)
        missing = slots < 0
        if missing.any():
            self._insert(ids[missing], config)
            slots = self.lookup(ids)
        params = self.rows[slots]
        state = {k: v[slots] for k, v in self.state.items()}
        step = None
        if self.row_steps is not None:
            self.row_steps[slots] += 1
            step = self.row_steps[slots][:, None]
        optimizers.apply(config.optimizer, params, grad, state, step if step is not None else 1)
        self.rows[slots] = params
        for k, v in state.items():
            self.state[k][slots] = v
        self.version += 1

    def nbytes(self) -> int:
        total = self.rows.nbytes + self.ids.nbytes + self.slots.nbytes
        total += sum(a.nbytes for a in self.state.values())
        return total + (self.row_steps.nbytes if self.row_steps is not None else 0)

    def snapshot(self) -> tuple[dict, dict[str, np.ndarray]]:
        meta = self._metadata()
        meta.update(count=self.count, pending={str(s): len(parts) for s, parts in self.pending.items()})
        order = np.argsort(self.slots, kind="stable")       # ids in slot order
        arrays = {"ids": self.ids[order].copy(), "values": self.rows[:self.count].copy()}
        for name, arr in self.state.items():
            arrays[f"state.{name}"] = arr[:self.count].copy()
        if self.row_steps is not None:
            arrays["row_steps"] = self.row_steps[:self.count].copy()
        for s, parts in self.pending.items():
            for i, (ids, g) in enumerate(parts):
                arrays[f"pending.{s}.{i}.ids"] = np.array(ids, dtype=np.int64, copy=True)
                arrays[f"pending.{s}.{i}.grad"] = np.array(g, dtype=np.float32, copy=True)
        return meta, arrays

    def load(self, meta: dict, arrays: dict[str, np.ndarray]) -> None:
        self._load_metadata(meta)
        self.count = int(meta["count"])
        ids_in_slot_order = arrays["ids"].astype(np.int64)
        order = np.argsort(ids_in_slot_order, kind="stable")
        self.ids = ids_in_slot_order[order]
        self.slots = order.astype(np.int32)
        self.rows = np.array(arrays["values"], dtype=np.float32).reshape(self.count, self.dim)
        self.state = {k[len("state."):]: np.array(v, dtype=np.float32).reshape(self.count, self.dim)
                      for k, v in arrays.items() if k.startswith("state.")}
        self.row_steps = (np.array(arrays["row_steps"], dtype=np.int32)
                          if "row_steps" in arrays else None)
        self.pending = {int(s): [(arrays[f"pending.{s}.{i}.ids"],
                                  arrays[f"pending.{s}.{i}.grad"].reshape(-1, self.dim))
                                 for i in range(n)]
                        for s, n in meta.get("pending", {}).items()}


def new_block(key: BlockKey, spec: TableSpec) -> Block:
    return DenseBlock(key, spec) if spec.kind is TableKind.DENSE else SparseBlock(key, spec)


def encode_metadata(meta: dict) -> bytes:
    return json.dumps(meta, separators=(",", ":")).encode()


def decode_metadata(raw: bytes) -> dict:
    return json.loads(raw.decode()) if raw else {}
