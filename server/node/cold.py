"""The cold tier of a sparse table: the rows its memory budget evicted, on local disk.

A table whose ``LifecyclePolicy`` has ``cold`` keeps, beside its rows in RAM (``SparseRows``,
the hot tier), a ``ColdRows`` per server: the rows that a budget eviction took out of RAM,
each with its optimizer state, step count and last-push tick, exactly as they were. A pull
of such a row reads it there, inside the request; the push that next touches it moves it
back to RAM (``SparseRows.warm``), so training goes on from the row's state as if it had
never left, and the budget decides again which rows stay hot.

Storage: per array one file, memory-mapped and grown by doubling (numpy reads and writes
rows in place: about 0.1 us a row with the data in the page cache). The id -> slot index
stays in RAM (``HashIndex``: rows move in and out in small batches). The files are unlinked once opened, so the space
goes back to the disk when the server process ends, even after kill -9, and a restarted
server never finds stale rows: a server's cold tier lives as long as its process, like its
hot tier (replicas and checkpoints carry both).

Plain numpy; no grpc, no torch.
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
import time
import weakref
from typing import TYPE_CHECKING

import numpy as np

from shardps import id_blocks
from shardps.server.node.hash_index import HashIndex

if TYPE_CHECKING:
    from shardps.server.node.storage import SparseRows

log = logging.getLogger("shardps.server.cold")
ERROR_EVERY = 60.0                 # seconds between two logs of a table's tier that cannot take rows


def cold_root(directory: str) -> str:
    """The directory cold tiers are kept in: ``directory`` (created if missing), or the
    system's temporary directory for ""; ValueError naming it when it cannot hold files."""
    path = directory or tempfile.gettempdir()
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".shardps-cold-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"cold-dir {path!r}: cannot create files there ({e.strerror}); "
                         f"give a writable directory on local disk") from None
    return path


class _FileRows:
    """A growable ``[slots, *shape]`` array in a file of its own (unlinked: it lives while
    this object does), memory-mapped; capacity doubles."""

    def __init__(self, directory: str, shape: tuple, dtype):
        self.shape, self.dtype = shape, np.dtype(dtype)
        self.row_bytes = int(np.prod(shape, dtype=np.int64)) * self.dtype.itemsize
        fd, path = tempfile.mkstemp(dir=directory, prefix="shardps-cold-")
        os.unlink(path)
        self.fd = fd
        weakref.finalize(self, os.close, fd)
        self.data = np.empty((0,) + shape, dtype=self.dtype)

    def ensure(self, slots: int) -> None:
        """Room for ``slots`` rows. The disk blocks are allocated here (OSError, ENOSPC, when
        the disk is full, with nothing changed): a write into a mapped page with no block
        behind it would kill the process (SIGBUS) instead."""
        capacity = self.data.shape[0]
        if slots <= capacity:
            return
        capacity = max(slots, 2 * capacity, 1024)
        os.posix_fallocate(self.fd, 0, capacity * self.row_bytes)
        mapped = mmap.mmap(self.fd, capacity * self.row_bytes)
        self.data = np.frombuffer(mapped, dtype=self.dtype).reshape((capacity,) + self.shape)

    def disk_bytes(self) -> int:
        return self.data.shape[0] * self.row_bytes


class ColdRows:
    """The cold tier of one sparse table on one server (see the module docstring). Not
    thread-safe: the owning ``SparseRows.lock`` is held."""

    def __init__(self, num_blocks: int, dim: int, directory: str):
        self.num_blocks, self.dim, self.directory = num_blocks, dim, directory
        self.index = HashIndex()                       # id -> slot
        self.values = _FileRows(directory, (dim,), np.float32)
        self.state: dict[str, _FileRows] = {}
        self.row_steps: _FileRows | None = None
        self.ticks = _FileRows(directory, (), np.int32)
        self.used = 0
        self.free = np.empty(0, dtype=np.int64)
        self.block_counts = np.zeros(num_blocks, dtype=np.int64)
        self.counters = dict(written=0, read=0, warmed=0, expired=0)

    @property
    def count(self) -> int:
        return self.index.count

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Slot of each id here, or -1."""
        return self.index.lookup(ids)

    def _arrays(self):
        return [self.values, self.ticks, *self.state.values(), *([self.row_steps] if self.row_steps else [])]

    def put(self, ids: np.ndarray, values: np.ndarray, state: dict[str, np.ndarray], steps: np.ndarray | None,
            ticks: np.ndarray) -> None:
        """Store rows ``ids`` (unique, not here) with their values, optimizer state, step
        counts (None: none kept) and ticks. OSError (a full disk) leaves everything as it was."""
        n = ids.shape[0]
        if n == 0:
            return
        added = {name: self._new((self.dim,), np.float32) for name in state if name not in self.state}
        steps_added = self._new((), np.int32) if steps is not None and self.row_steps is None else None
        used = self.used + max(0, n - self.free.shape[0])
        for pages in [*self._arrays(), *added.values(), *([steps_added] if steps_added else [])]:
            pages.ensure(used)                  # may raise: nothing changed yet
        self.state.update(added)
        if steps_added is not None:
            self.row_steps = steps_added
        reuse, self.free = self.free[:n], self.free[n:]
        fresh = np.arange(self.used, used, dtype=np.int64)
        self.used = used
        slots = np.concatenate([reuse, fresh]) if reuse.shape[0] else fresh
        self.values.data[slots] = values
        self.ticks.data[slots] = ticks
        for name, pages in self.state.items():
            pages.data[slots] = state[name] if name in state else 0     # as a state array added later starts
        if self.row_steps is not None:
            self.row_steps.data[slots] = 0 if steps is None else steps
        self.index.add(ids, slots)
        self.block_counts += np.bincount(id_blocks.sparse_block_of(ids, self.num_blocks), minlength=self.num_blocks)
        self.counters["written"] += n

    def _new(self, shape: tuple, dtype) -> _FileRows:
        """An array that existing slots lack (their optimizer state or step counts: zero, as
        a row stored without them would start, and as a file's new blocks read)."""
        pages = _FileRows(self.directory, shape, dtype)
        pages.ensure(self.used)
        return pages

    def rows(self, slots: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray | None, np.ndarray]:
        """(values, optimizer state by name, step counts or None, ticks) at ``slots``."""
        return (self.values.data[slots], {k: v.data[slots] for k, v in self.state.items()},
                self.row_steps.data[slots] if self.row_steps is not None else None, self.ticks.data[slots])

    def read(self, slots: np.ndarray) -> np.ndarray:
        """Values at ``slots`` (a pull: counted)."""
        self.counters["read"] += slots.shape[0]
        return self.values.data[slots]

    def remove(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Forget rows ``ids`` (here, at ``slots``); their slots are reused."""
        if ids.shape[0] == 0:
            return
        self.index.remove(ids)
        self.free = np.concatenate([self.free, slots])
        self.block_counts -= np.bincount(id_blocks.sparse_block_of(ids, self.num_blocks), minlength=self.num_blocks)

    def stored(self, blocks: np.ndarray | None = None, ordered: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """(ids, slots) of the rows here (of the blocks in mask ``blocks``): by id, or in no
        particular order (``ordered=False``: a TTL scan)."""
        ids, slots = self.index.stored(ordered=False)
        if blocks is not None:
            mine = blocks[id_blocks.sparse_block_of(ids, self.num_blocks)]
            ids, slots = ids[mine], slots[mine]
        if not ordered:
            return ids, slots
        order = np.argsort(ids)
        return ids[order], slots[order]

    def block_rows(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        if self.block_counts[block] == 0:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        mask = np.zeros(self.num_blocks, dtype=bool)
        mask[block] = True
        return self.stored(mask)

    def remove_block(self, block: int) -> None:
        ids, slots = self.block_rows(block)
        self.remove(ids, slots)

    def row_bytes(self) -> int:
        """Bytes one row takes on disk."""
        return sum(p.row_bytes for p in self._arrays())

    def disk_bytes(self) -> int:
        """Bytes of the rows stored here (the files' capacity is up to twice that)."""
        return self.count * self.row_bytes()


# ---------------------------------------------------------------------- moves between tiers
def warm(rows: "SparseRows", ids: np.ndarray) -> np.ndarray:
    """Move the rows of ``ids`` (unique, not in RAM) that ``rows``' cold tier holds back to
    RAM, with their state and ticks; returns which of ``ids`` were there."""
    cold = rows.cold
    if cold is None or cold.count == 0:
        return np.zeros(ids.shape[0], dtype=bool)
    slots = cold.lookup(ids)
    found = slots >= 0
    if found.any():
        ids, slots = ids[found], slots[found]
        values, state, steps, ticks = cold.rows(slots)
        rows.insert(ids, None, values, state, steps, ticks)
        cold.remove(ids, slots)
        cold.counters["warmed"] += ids.shape[0]
    return found


def cool(rows: "SparseRows", ids: np.ndarray) -> np.ndarray:
    """Move rows ``ids`` (unique, in RAM) to the cold tier with their state and ticks;
    returns the ids moved. When the tier cannot take them (its disk is full, its directory
    gone) they stay in RAM, above the budget, and the error is logged: nothing is lost."""
    if ids.shape[0] == 0:
        return ids
    slots = rows.lookup(ids)
    try:
        rows.ensure_cold().put(ids, rows.rows.take(slots), {k: v.take(slots) for k, v in rows.state.items()},
                               rows.row_steps.take(slots) if rows.row_steps is not None else None,
                               rows.ensure_ticks().take(slots))
    except (OSError, ValueError) as e:
        now = time.monotonic()
        if now - rows.cold_error_at >= ERROR_EVERY:     # not one line per push
            rows.cold_error_at = now
            log.error("table %r: %d rows stay in RAM above its memory budget: the cold tier in %s cannot take "
                      "them (%s); free disk space there or give the server another --cold-dir",
                      rows.spec.name, ids.shape[0], rows.cold_dir or tempfile.gettempdir(), e)
        return ids[:0]
    rows.remove(ids)
    return ids


def forget(rows: "SparseRows", ids: np.ndarray) -> None:
    """Drop rows ``ids`` (unique) from whichever tier holds them."""
    if rows.cold is None or ids.shape[0] == 0:
        rows.remove(ids)
        return
    hot = rows.lookup(ids) >= 0
    rows.remove(ids[hot])
    gone = ids[~hot]
    slots = rows.cold.lookup(gone)
    rows.cold.remove(gone[slots >= 0], slots[slots >= 0])
