"""Blocks: the unit of placement, replication, migration and checkpoints.

A block holds a slice of one table: its values, optimizer state, (sparse) row index, the
exactly-once record of the pushes it applied, and a version (updates applied so far).
Updates are applied one at a time under the block's lock; callers take ``block.lock``.

Memory grows only with pushed rows: a sparse row never pushed is not stored (a pull computes
its initial value), and a dense block is materialised on its first update.

Plain numpy; no grpc, no torch.
"""

from __future__ import annotations

import collections
import itertools
import json
import operator
import threading
from typing import cast

import numpy as np

from shardps import kernels
from shardps.errors import FailedPrecondition, InvalidArgument
from shardps.server import optimizers
from shardps.server.node import optimizer_kernels
from shardps.server.node.records import Writer, WriterRecord, applied_any, remember_all
from shardps.server.node.storage import DIRECT_INDEX_MAX_ROWS, MAPPED_MIN_BYTES, SparseRows, storage, stored
from shardps.tables import InitKind, TableConfig, TableKind, TableSpec, dense_initial_values

__all__ = ["DIRECT_INDEX_MAX_ROWS", "MAPPED_MIN_BYTES", "VERSION_OF", "AnyBlock", "Block", "BlockKey", "BlockLocks",
           "DenseBlock", "SparseBlock", "SparseRows", "Writer", "WriterRecord", "applied_any", "bump_versions",
           "decode_metadata", "encode_metadata", "new_block", "remember_all", "storage", "stored"]

BlockKey = tuple[str, str, int]   # (job, table, block index)
_ROW0 = np.zeros(1, dtype=np.int64)


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
        return applied_any((self,), writer)

    def remember(self, writer: Writer) -> None:
        remember_all((self,), writer)

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
            "writers": [[s, inc, rec.acked_below, sorted(rec.live())]
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

    def apply_gradient(self, config: TableConfig, lo: int, hi: int, grad: np.ndarray,
                       same_step: bool = False) -> None:
        """Apply ``grad`` to the flat range [lo, hi), the block's optimizer step counting it;
        ``same_step``: a further range of the same push, which takes that push's step (one
        step per block per push, whatever the ranges it arrives in)."""
        if not self.initialized:
            raise FailedPrecondition(
                f"table {self.spec.name!r} block {self.key[2]} has no initial values yet: "
                f"push INITIALIZE before gradients")
        values = self._materialise(config)
        a, b = lo - self.start, hi - self.start
        if not same_step:
            self.step += 1
        if kernels.AVAILABLE:
            # the range as one row of the compiled update (one pass, in place); the block's
            # step is the row's step count
            steps = np.array([self.step - 1], dtype=np.int32)
            optimizer_kernels.apply_rows(config.optimizer, values[a:b].reshape(1, -1),
                               {k: v[a:b].reshape(1, -1) for k, v in self.state.items()}, steps,
                               _ROW0, np.asarray(grad, dtype=np.float32).reshape(1, -1))
        elif a == 0 and b == self.size:
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

    def assign(self, config: TableConfig, lo: int, hi: int, values: np.ndarray) -> None:
        """Overwrite the flat range [lo, hi) (a push of kind ASSIGN); its optimizer state
        starts afresh, and a block written whole also restarts its step count and counts as
        initialized. The caller checked the precondition (``engine.check_assign``: a block
        without initial values is written whole); a backup applies what its primary did."""
        if (lo, hi) == (self.start, self.stop):   # whole: nothing of the old state is kept
            if self.values is None:
                self.values = stored(values)
            else:
                np.copyto(self.values, values, casting="unsafe")
            self.state = {k: stored(v) for k, v in optimizers.new_state(config.optimizer, self.size).items()}
            self.step = 0
        else:
            current = self._materialise(config)
            a, b = lo - self.start, hi - self.start
            current[a:b] = values
            fresh = optimizers.new_state(config.optimizer, b - a)
            for name, arr in self.state.items():
                arr[a:b] = fresh[name] if name in fresh else 0.0
        self.initialized = True
        self.version += 1

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


class SparseBlock(Block):
    """The rows of a sparse table whose ids hash to this block, stored in the server's
    ``SparseRows`` of that table (shared by the table's blocks on this server)."""

    kind = TableKind.SPARSE

    def __init__(self, key: BlockKey, spec: TableSpec, table_rows: SparseRows | None = None):
        super().__init__(key, spec)
        self.dim = spec.dim
        self.table_rows = table_rows if table_rows is not None else SparseRows(spec)

    @property
    def count(self) -> int:
        return int(self.table_rows.block_counts[self.key[2]])

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        with self.table_rows.lock:
            return self.table_rows.lookup(ids)

    def read(self, ids: np.ndarray) -> np.ndarray:
        """Rows of ``ids`` (any order, repeats allowed), float32 ``[n, dim]``: stored or initial."""
        with self.table_rows.lock:
            return self.table_rows.read(ids)

    def apply_gradient(self, config: TableConfig, ids: np.ndarray, grad: np.ndarray,
                       tick: int | None = None) -> None:
        """Apply ``grad`` ``[n, dim]`` to rows ``ids`` (unique, all of this block). With a
        lifecycle policy the decisions are made here (deterministic: a SYNC step applied on
        every replica); ``tick`` None: the block's clock plus one."""
        with self.table_rows.lock:
            self.table_rows.apply(config, ids, grad, tick)
        self.version += 1

    def apply_decided(self, config: TableConfig, ids: np.ndarray, grad: np.ndarray,
                      dropped: np.ndarray, cooled: np.ndarray, gone: np.ndarray, tick: int) -> None:
        """Backup: apply a primary's APPLY op with its lifecycle decisions (rows ``ids``
        applied, ``dropped`` not admitted, ``cooled`` moved to the cold tier and ``gone``
        removed after; see server.lifecycle)."""
        from shardps.server.node import lifecycle
        with self.table_rows.lock:
            lifecycle.apply_decided(self.table_rows, config, ids, grad.reshape(-1, self.dim),
                                    dropped, cooled, gone, tick)
        self.version += 1

    def assign(self, config: TableConfig, ids: np.ndarray, values: np.ndarray) -> None:
        """Overwrite rows ``ids`` (unique, all of this block; stored if absent) with
        ``values`` ``[n, dim]``, their optimizer state afresh (a push of kind ASSIGN)."""
        with self.table_rows.lock:
            self.table_rows.assign_values(config, ids, values.reshape(-1, self.dim))
        self.version += 1

    def release(self) -> None:
        """This server no longer holds the block: drop its rows."""
        with self.table_rows.lock:
            self.table_rows.remove_block(self.key[2])

    def nbytes(self) -> int:
        life = self.table_rows.life
        sketch = 0
        if life is not None and life.sketched[self.key[2]]:
            from shardps.server.node.lifecycle import SKETCH_BYTES
            sketch = SKETCH_BYTES
        return self.count * self.table_rows.row_bytes() + sketch

    def snapshot(self) -> tuple[dict, dict[str, np.ndarray]]:
        meta = self._metadata()
        sh = self.table_rows
        with sh.lock:
            ids, slots = sh.block_rows(self.key[2])
            meta.update(count=int(slots.shape[0]),
                        pending={str(s): len(parts) for s, parts in self.pending.items()})
            arrays = {"ids": ids, "values": sh.rows.take(slots)}
            for name, pages in sh.state.items():
                arrays[f"state.{name}"] = pages.take(slots)
            if sh.row_steps is not None:
                arrays["row_steps"] = sh.row_steps.take(slots)
            if sh.life is not None:       # lifecycle state (server/node/lifecycle.py) travels along
                life_meta, life_arrays = sh.life.block_state(self.key[2])
                meta["lifecycle"] = life_meta
                arrays.update(life_arrays)
                arrays["lifecycle.ticks"] = sh.ensure_ticks().take(slots)
            if sh.cold is not None and sh.cold.block_counts[self.key[2]]:   # and the cold tier's rows
                cold_ids, cold_slots = sh.cold.block_rows(self.key[2])
                values, state, steps, ticks = sh.cold.rows(cold_slots)
                arrays.update({"cold.ids": cold_ids, "cold.values": values, "cold.ticks": ticks})
                arrays.update({f"cold.state.{k}": v for k, v in state.items()})
                if steps is not None:
                    arrays["cold.row_steps"] = steps
        for s, parts in self.pending.items():
            for i, (ids, g) in enumerate(parts):
                arrays[f"pending.{s}.{i}.ids"] = np.array(ids, dtype=np.int64, copy=True)
                arrays[f"pending.{s}.{i}.grad"] = np.array(g, dtype=np.float32, copy=True)
        return meta, arrays

    def load(self, meta: dict, arrays: dict[str, np.ndarray]) -> None:
        self._load_metadata(meta)
        ids = np.asarray(arrays["ids"], dtype=np.int64).reshape(int(meta["count"]))
        with self.table_rows.lock:
            self.table_rows.remove_block(self.key[2])
            self.table_rows.insert(ids, None, *self._snapshot_rows(arrays, "", "lifecycle.ticks", ids.shape[0]))
            if "lifecycle" in meta:
                self.table_rows.lifecycle().load_block(self.key[2], meta["lifecycle"], arrays)
            if "cold.ids" in arrays:          # the cold tier's rows (``snapshot``)
                cold_ids = np.asarray(arrays["cold.ids"], dtype=np.int64)
                values, state, steps, ticks = self._snapshot_rows(arrays, "cold.", "cold.ticks", cold_ids.shape[0])
                self.table_rows.ensure_cold().put(cold_ids, values, state, steps, cast(np.ndarray, ticks))
        self.pending = {int(s): [(arrays[f"pending.{s}.{i}.ids"],
                                  arrays[f"pending.{s}.{i}.grad"].reshape(-1, self.dim))
                                 for i in range(n)]
                        for s, n in meta.get("pending", {}).items()}


    def _snapshot_rows(self, arrays: dict[str, np.ndarray], prefix: str, ticks: str, n: int) -> tuple:
        """(values, optimizer state by name, step counts or None, ticks or None) of ``n`` rows
        in a snapshot's arrays named ``prefix`` + values, state.NAME, row_steps, and ``ticks``."""
        state = {k[len(prefix) + len("state."):]: np.asarray(v, dtype=np.float32).reshape(n, self.dim)
                 for k, v in arrays.items() if k.startswith(prefix + "state.")}
        steps = arrays.get(prefix + "row_steps")
        return (np.asarray(arrays[prefix + "values"], dtype=np.float32).reshape(n, self.dim), state,
                None if steps is None else np.asarray(steps).astype(np.int32),
                np.asarray(arrays[ticks]).astype(np.int32).reshape(n) if ticks in arrays else None)


# What a block table holds: a block of either kind (``isinstance`` tells which).
AnyBlock = DenseBlock | SparseBlock


class BlockLocks:
    """``with BlockLocks(blocks):`` holds every block's lock (the caller orders ``blocks`` by
    key), released in reverse order on exit: one context manager for the lot, where an
    ``ExitStack`` costs a callback per block (a push or pull touches dozens). The locks are
    taken and released by ``map`` in C, no Python per block; when taking one raises, those
    already taken (counted by what is left of the iterator) are released before it goes on."""

    __slots__ = ("locks",)

    def __init__(self, blocks):
        self.locks = list(map(_LOCK_OF, blocks))

    def __enter__(self) -> "BlockLocks":
        remaining = iter(self.locks)
        try:
            _each(_ACQUIRE, remaining)
        except BaseException:
            taken = len(self.locks) - operator.length_hint(remaining) - 1     # the last one raised
            _each(_RELEASE, reversed(self.locks[:taken]))
            raise
        return self

    def __exit__(self, *exc) -> None:
        _each(_RELEASE, reversed(self.locks))


_LOCK_OF = operator.attrgetter("lock")
VERSION_OF = operator.attrgetter("version")
_ACQUIRE, _RELEASE = operator.methodcaller("acquire"), operator.methodcaller("release")


def bump_versions(blocks) -> None:
    """Each of ``blocks``' version one up (locks held), walked in C: a push's dozens of blocks
    without Python per block."""
    collections.deque(map(setattr, blocks, itertools.repeat("version"),
                          map(operator.add, map(VERSION_OF, blocks), itertools.repeat(1))), maxlen=0)


def _each(method, items) -> None:
    """``method(item)`` for each of ``items``, looped in C (``deque`` of length 0 consumes)."""
    collections.deque(map(method, items), maxlen=0)


def new_block(key: BlockKey, spec: TableSpec, table_rows: SparseRows | None = None) -> AnyBlock:
    """A new empty block; sparse blocks store their rows in ``table_rows`` (a private one if None)."""
    return DenseBlock(key, spec) if spec.kind is TableKind.DENSE else SparseBlock(key, spec, table_rows)


def encode_metadata(meta: dict) -> bytes:
    return json.dumps(meta, separators=(",", ":")).encode()


def decode_metadata(raw: bytes) -> dict:
    return json.loads(raw.decode()) if raw else {}
