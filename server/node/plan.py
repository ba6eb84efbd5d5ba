"""A data request's plan: each table's part admitted once, before a block is locked.

Every data request that changes or reads rows and ranges (a Step frame's push and pull, a
Push, a Pull, an Exchange) is admitted here first. What a table needs for that is derived
once per state of the block table (``PlanTable``: the epoch since which this node serves
each block, or ``NOT_SERVED``; the blocks held; the rows' storage) and reused until the map,
the blocks held or the blocks missing change (``BlockTable.generation``). A sparse part's
ids are checked in one compiled pass (bounds, each id's block, that this node serves the
block under the request's epoch, uniqueness), its values in another (finite).

The ``Plan`` is executed by ``execute`` (one compiled update or gather per sparse table, a
range per dense block) and committed there. A part that no plan covers (other wire dtypes,
exports, repeated ids, lifecycle tables, a block not served here) makes ``Planner.push`` or
``Planner.pull`` answer None; the per-block engine (``apply.PushApplier``,
``pull.PullReader``) then serves the request or raises its precise error, and both leave
the same blocks, versions and records (``tests/test_plan.py``, ``tests/test_fast_path.py``).
"""

from __future__ import annotations

import itertools
import operator
import threading
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from shardps import id_blocks, kernels
from shardps.dtypes import WireDType
from shardps.messages import GRADIENT, RANGE, ROWS, Header, Slice
from shardps.server.node import storage_kernels
from shardps.server.node.table import BlockTable
from shardps.shardmap import TableView
from shardps.tables import Consistency, TableKind

if TYPE_CHECKING:
    from shardps.server.node.apply import JobHolds
    from shardps.server.node.decode import Segment

_KEY_OF = operator.attrgetter("key")
NOT_SERVED = np.uint64(np.iinfo(np.uint64).max)
_ASYNC = Consistency.ASYNC


class PlanTable:
    """What a plan needs of one table, derived from the block table at one ``generation``:
    ``owned[b]`` the epoch since which this node serves block ``b`` as its primary with its
    state loaded (``NOT_SERVED`` otherwise: lost, missing, another node's), ``objects[b]``
    the block held here (or None), ``rows`` a sparse table's storage when a plan may update
    it (no lifecycle state), else None: such a table is the per-block engine's; ``backed[b]``
    whether block ``b`` has backups under the map."""

    __slots__ = ("t", "name", "dense", "dim", "owned", "objects", "rows", "finite", "block_size", "num_rows",
                 "numel", "backed", "any_backed", "optimizer")

    def __init__(self, table: BlockTable, t: TableView):
        self.t = t
        self.name = t.name
        spec = t.spec
        self.dense = spec.kind is TableKind.DENSE
        self.dim = spec.dim
        self.block_size = spec.block_size if self.dense else 0
        self.num_rows = spec.num_rows
        self.numel = spec.numel if self.dense else 0
        self.finite = not t.config.allow_non_finite
        self.optimizer = t.config.optimizer.kind.name
        held, missing = table.blocks, table.missing
        # the blocks held here by index (None: not held); a dense table's are DenseBlocks
        objects: list[Any] = [held.get((t.job, t.name, b)) for b in range(spec.block_count)]
        mine = t.server_index.get(table.name, -1)
        owned = np.where(np.asarray(t.primary) == mine, np.asarray(t.since_epoch, dtype=np.uint64), NOT_SERVED)
        for b, blk in enumerate(objects):
            if blk is None or blk.key in missing or b in t.lost:
                owned[b] = NOT_SERVED
        self.owned = owned
        self.objects = objects
        self.backed = [len(r) > 1 for r in t.replicas]
        self.any_backed = any(self.backed)
        rows = None
        if not self.dense and kernels.AVAILABLE and not t.config.lifecycle.enabled:
            rows = table.sparse_rows.get((t.job, t.name))
            if rows is not None and (rows.life is not None or rows.ticks is not None):
                rows = None
        self.rows: Any = rows           # SparseRows, or None

    def dense_blocks(self, lo: int, hi: int, epoch: int) -> list[int] | None:
        """The blocks of the flat range [lo, hi) when the range is valid and this node serves
        them all under ``epoch``; else None."""
        if not 0 <= lo < hi <= self.numel:
            return None
        bs = self.block_size
        first, last = lo // bs, (hi - 1) // bs
        owned = self.owned
        if first == last:
            return [first] if owned[first] <= epoch else None
        blocks = list(range(first, last + 1))
        for b in blocks:
            if owned[b] > epoch:
                return None
        return blocks


class Unit(NamedTuple):
    """One table's part of a plan: its ``blocks`` (ascending) and the blocks held here
    (``objects``, in that order); a sparse part's ``ids`` and, in a push, ``values``
    ``[n, dim]``; a dense part's flat range ``[start, stop)`` and, in a push, its values and
    the versions they were computed against (``base_versions``)."""

    entry: PlanTable
    blocks: list[int]
    objects: list[Any]
    ids: Any
    values: Any
    start: int
    stop: int
    base_versions: dict[int, int] | None

    def blocks_of(self) -> np.ndarray:
        """A sparse part's block of each id (int64)."""
        return id_blocks.sparse_block_of(self.ids, self.entry.owned.shape[0])

    def order(self) -> tuple[str, int]:
        """The unit's place in key order: its table, then its first block (a dense table's
        ranges to one server are runs of blocks)."""
        return self.entry.name, self.blocks[0] if self.blocks else 0


class Plan(NamedTuple):
    """An admitted request part: its ``units`` and every block they lock (``blocks``, in key
    order, each once), the block table's ``generation`` it was admitted at, its sparse
    ``rows``, its values' bytes (``nbytes``: a push's in, a pull's out) and whether a block
    of it has backups under the map (``backed``)."""

    units: list[Unit]
    blocks: list
    generation: int
    rows: int
    nbytes: int
    backed: bool


class StepPlan(NamedTuple):
    """A Step's admitted parts: its ``push`` and ``pull`` plans (either may be None) and
    every block they lock (``locks``: in key order, each once), held across both."""

    push: Plan | None
    pull: Plan | None
    locks: list


class Planner:
    """Admits requests against the block table (see the module docstring). Thread-safe: the
    caller holds the gate shared; the derived tables are replaced as a whole."""

    def __init__(self, table: BlockTable, holds: "JobHolds", max_rows: int, max_response_bytes: int):
        self.table = table
        self.holds = holds
        self.max_rows = max_rows
        self.max_response_bytes = max_response_bytes
        self._lock = threading.Lock()
        self._generation = -1
        self._tables: dict[tuple[str, str], PlanTable] = {}

    # ------------------------------------------------------------------ tables
    def _tables_now(self) -> tuple[int, dict]:
        """The block table's generation now and the entries derived at it (gate held shared)."""
        generation = self.table.generation
        if generation != self._generation:
            with self._lock:
                if generation != self._generation:
                    self._tables, self._generation = {}, generation
        return generation, self._tables

    def _entry(self, generation: int, tables: dict, job: str, name: str) -> PlanTable | None:
        """The table's ``PlanTable`` at ``generation`` (from ``_tables_now``); None when the map
        has no such table or the block table has changed since."""
        t = self.table.view.tables.get((job, name))
        if t is None:
            return None
        with self.table.lock:
            if self.table.generation != generation:
                return None
            entry = tables[(job, name)] = PlanTable(self.table, t)
        return entry

    # ------------------------------------------------------------------ a Step frame
    def step(self, header: Header, kind: int, push: list[Slice] | None, pull: list[Slice] | None
             ) -> "StepPlan | None":
        """A Step's push and pull admitted together (gate held shared), or None when a plan
        does not serve the whole of it: a map newer than this node's, another wire dtype
        than float32, a job with a quota or not ASYNC, a push that is not an ASYNC gradient
        with a current writer and a sequence, a job held for a checkpoint, or a part no plan
        covers (``push``, ``pull``). The per-block engine serves those."""
        view = self.table.view
        if header.epoch > view.epoch or header.wire_dtype > 1:
            return None
        job = header.job
        group = view.groups.get(job)
        if group is not None and (group.consistency is not _ASYNC or group.quota_bytes):
            return None
        pushed = pulled = None
        if push is not None:
            if (kind != GRADIENT or not header.sequence or not header.session or not push or self.holds.holding(job)
                    or (group is not None and not _writer_current(group, header))):
                return None
            pushed = self.push(job, header.epoch, push)
            if pushed is None:
                return None
        if pull is not None:
            pulled = self.pull(job, header.epoch, pull)
            if pulled is None:
                return None
            if pushed is not None and pulled.blocks != pushed.blocks:     # (a step's usually touch the same)
                every = dict.fromkeys(itertools.chain(pushed.blocks, pulled.blocks))    # each once
                return StepPlan(pushed, pulled, sorted(every, key=_KEY_OF))
        return StepPlan(pushed, pulled, (pushed or pulled).blocks)    # type: ignore[union-attr]

    # ------------------------------------------------------------------ admission
    def push(self, job: str, epoch: int, slices: list[Slice]) -> Plan | None:
        """The plan of a push's gradients routed with map ``epoch`` (gate held shared), or None:
        a part no plan covers, or more rows than ``max_rows`` (nothing was changed).
        ``slices``' values are float32 (a sparse slice's flat, ``len(ids) * dim``)."""
        generation, tables = self._tables_now()
        units = []
        rows_total = nbytes = 0
        backed = False
        for s in slices:
            e = tables.get((job, s.table)) or self._entry(generation, tables, job, s.table)
            if e is None:
                return None
            values = s.values
            if e.dense:
                if s.ids is not None:
                    return None
                blocks = e.dense_blocks(s.start, s.stop, epoch)
                if blocks is None or values.shape[0] != s.stop - s.start:
                    return None
                if e.finite and not kernels.finite(values):
                    return None
                units.append(Unit(e, blocks, list(map(e.objects.__getitem__, blocks)), None, values, s.start, s.stop,
                                  s.base_versions))
            else:
                ids = s.ids
                if e.rows is None or ids is None or values.shape[0] != ids.shape[0] * e.dim:
                    return None
                rows_total += ids.shape[0]
                counts = np.zeros(e.owned.shape[0], np.int64)
                if storage_kernels.admit_rows(ids, e.num_rows, e.owned, epoch, None, counts, True) != 1:
                    return None
                if e.finite and not kernels.finite(values):
                    return None
                blocks = counts.nonzero()[0].tolist()
                units.append(Unit(e, blocks, list(map(e.objects.__getitem__, blocks)), ids, values.reshape(-1, e.dim),
                                  0, 0, None))
            nbytes += values.nbytes
            if e.any_backed and not backed:
                backed = any(e.backed[b] for b in units[-1].blocks)
        if len(units) > 1:
            units.sort(key=Unit.order)             # the blocks in key order
            if len({u.entry.name for u in units}) < len(units) and (   # a table twice (runs of a dense one)
                    len({(u.entry.name, b) for u in units for b in u.blocks}) < sum(len(u.blocks) for u in units) or
                    len({u.entry.name for u in units if u.ids is not None}) < sum(u.ids is not None for u in units)):
                return None             # a block or a sparse table twice: the per-block engine sums them
            every = list(itertools.chain.from_iterable(u.objects for u in units))
        else:
            every = units[0].objects if units else []
        if rows_total > self.max_rows:
            return None
        return Plan(units, every, generation, rows_total, nbytes + 8 * rows_total, backed)

    def pull(self, job: str, epoch: int, slices: list[Slice]) -> Plan | None:
        """The plan of a pull of float32 values routed with map ``epoch`` (gate held shared),
        or None: a part no plan covers, or one over ``max_rows`` or ``max_response_bytes``."""
        generation, tables = self._tables_now()
        units = []
        out_bytes = rows_total = 0
        for s in slices:
            e = tables.get((job, s.table)) or self._entry(generation, tables, job, s.table)
            if e is None:
                return None
            if e.dense:
                if s.ids is not None:
                    return None
                blocks = e.dense_blocks(s.start, s.stop, epoch)
                if blocks is None:
                    return None
                units.append(Unit(e, blocks, list(map(e.objects.__getitem__, blocks)), None, None, s.start, s.stop,
                                  None))
                out_bytes += 4 * (s.stop - s.start)
                continue
            ids = s.ids
            if e.rows is None or ids is None:
                return None
            rows_total += ids.shape[0]
            counts = np.zeros(e.owned.shape[0], np.int64)
            if storage_kernels.admit_rows(ids, e.num_rows, e.owned, epoch, None, counts, False) < 0:
                return None
            blocks = counts.nonzero()[0].tolist()
            units.append(Unit(e, blocks, list(map(e.objects.__getitem__, blocks)), ids, None, 0, 0, None))
            out_bytes += 4 * ids.shape[0] * e.dim
        if len(units) > 1:                   # the locks in key order: by table, a table's by block
            every = list(itertools.chain.from_iterable(u.objects for u in sorted(units, key=_name)))
            if len({u.entry.name for u in units}) < len(units):     # a table twice: each block locked once
                every = sorted(dict.fromkeys(every), key=_KEY_OF)
        else:
            every = units[0].objects if units else []
        if out_bytes > self.max_response_bytes or rows_total > self.max_rows:
            return None
        return Plan(units, every, generation, rows_total, out_bytes, False)


def slices_of(parsed: list["Segment"], pull: bool) -> list[Slice] | None:
    """Decoded request segments (the per-block engine's) as a step's slices, for a plan;
    None for a pull whose reply is an export or another wire dtype than float32."""
    out = []
    for s in parsed:
        if pull and (s.all_stored or s.dtype is not WireDType.FLOAT32):
            return None
        values = s.values
        if s.ids is None:
            out.append(Slice(s.table.name, RANGE, s.lo, s.hi, None, values, None, s.base_versions))
        else:
            out.append(Slice(s.table.name, ROWS, 0, 0, s.ids, None if values is None else values.reshape(-1)))
    return out


def _name(unit: Unit) -> str:
    return unit.entry.name


def _writer_current(group, header: Header) -> bool:
    """Whether the request's session is not fenced: absent from the group, or at its
    current incarnation (``PushApplier.check_writer``'s rule; a fenced one goes to the
    per-block engine for its error)."""
    session = header.session
    for m in group.members:
        if m.session == session:
            return m.incarnation == header.incarnation
    for m in group.clients:
        if m.session == session:
            return m.incarnation == header.incarnation
    return True
