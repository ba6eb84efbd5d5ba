"""The compiled request path: the common step admitted once, computed table by table in
compiled calls, committed once.

Most data requests are one worker's step: ASYNC gradients of sparse rows and dense ranges,
then a pull of the next step's rows and ranges, of tables without lifecycle policies, on
blocks this node serves. ``Lane`` serves those parts of a ``StepRequest`` with as little
Python per request as the checks allow:

* **admit** (gate held shared, no block locks): what a table needs to be checked is derived
  once per state of the block table (``LaneTable``: each block's epoch of ownership here, or
  "not served"; the held blocks; the rows' storage) and reused until the map, the blocks
  held or the blocks missing change (``BlockTable.generation``). A sparse slice's ids are
  checked in one compiled pass (bounds, the block of each id and that this node serves it
  under the request's epoch, uniqueness), its values in another (finite);
* **compute and commit** (the touched blocks' locks): a push's exactly-once check, its
  update (one compiled call per sparse table: slots, new rows, the optimizer; a dense
  range per block), the versions and the writer's record; a pull's compiled gather per
  table. A push to blocks with backups is handed to ``fast.apply_push``, which forwards it.

A part the lane does not serve (SYNC and SSP groups, quotas, holds, lifecycle policies, other
wire dtypes, exports, repeated ids, a block not served here, a retry) is left to the general
path (``apply.PushApplier``, ``pull.PullReader``), which serves it or raises the precise
error; both leave the same blocks, versions and records (``tests/test_lane.py``).
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from shardps import kernels
from shardps.messages import (
    GRADIENT,
    RANGE,
    ROWS,
    Header,
    Layout,
    PullReply,
    PullRequest,
    PushAck,
    PushRequest,
    Selection,
    StepRequest,
    Versions,
)
from shardps.server.node import fast, storage_kernels
from shardps.server.node.blocks import VERSION_OF, BlockLocks, Writer, applied_any, remember_all
from shardps.server.node.table import BlockTable
from shardps.shardmap import TableView
from shardps.tables import Consistency, TableKind

if TYPE_CHECKING:
    from shardps.server.node.apply import JobHolds
    from shardps.server.node.replication import Forwarder
    from shardps.server.node.steps import SyncSteps

NOT_SERVED = np.uint64(np.iinfo(np.uint64).max)
_ASYNC = Consistency.ASYNC


class LaneTable:
    """What the lane needs of one table, derived from the block table at one ``generation``:
    ``owned[b]`` the epoch since which this node serves block ``b`` as its primary with its
    state loaded (``NOT_SERVED`` otherwise: lost, missing, another node's), ``objects[b]``
    the block held here (or None), ``rows`` a sparse table's storage when the lane may
    update it (no lifecycle state), else None: such a table is left to the general path;
    ``backed[b]`` whether block ``b`` has backups under the map."""

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


class Lane:
    """Serves the common parts of step requests (see the module docstring). Thread-safe:
    it holds the gate shared (the caller) and the blocks' locks as the general path does."""

    def __init__(self, table: BlockTable, steps: "SyncSteps", forwarder: "Forwarder", holds: "JobHolds",
                 max_rows: int, max_response_bytes: int, observe, updates_between):
        self.table = table
        self.steps = steps
        self.forwarder = forwarder
        self.holds = holds
        self.max_rows = max_rows
        self.max_response_bytes = max_response_bytes
        self.observe = observe                      # NodeMetrics.observe_lane
        self.updates_between = updates_between      # (block key, updates): dense base versions
        self._lock = threading.Lock()
        self._generation = -1
        self._tables: dict[tuple[str, str], LaneTable] = {}

    # ------------------------------------------------------------------ tables
    def _tables_now(self) -> tuple[int, dict]:
        """The block table's generation now and the entries derived at it (gate held shared)."""
        generation = self.table.generation
        if generation != self._generation:
            with self._lock:
                if generation != self._generation:
                    self._tables, self._generation = {}, generation
        return generation, self._tables

    def _entry(self, generation: int, tables: dict, job: str, name: str) -> LaneTable | None:
        """The table's ``LaneTable`` at ``generation`` (from ``_tables_now``); None when the map
        has no such table or the block table has changed since."""
        t = self.table.view.tables.get((job, name))
        if t is None:
            return None
        with self.table.lock:
            if self.table.generation != generation:
                return None
            entry = tables[(job, name)] = LaneTable(self.table, t)
        return entry

    def _async(self, header: Header) -> bool:
        """Whether the request's map is not newer than this node's and its job has no group,
        or an ASYNC one without a quota."""
        view = self.table.view
        if header.epoch > view.epoch or header.wire_dtype > 1:
            return False
        group = view.groups.get(header.job)
        return group is None or (group.consistency is _ASYNC and not group.quota_bytes)

    # ------------------------------------------------------------------ push
    def push(self, header: Header, kind: int, slices: list) -> PushAck | None:
        """Apply an ASYNC push's gradients (gate held shared); None: nothing changed, the
        general path serves it."""
        started = time.perf_counter()
        job = header.job
        if kind != GRADIENT or not header.sequence or not header.session or not slices or not self._async(header):
            return None
        group = self.table.view.groups.get(job)
        if (group is not None and not _writer_current(group, header)) or self.holds.holding(job):
            return None
        generation, tables = self._tables_now()
        epoch = header.epoch
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
                units.append((e, blocks, list(map(e.objects.__getitem__, blocks)), None, values, s))
            else:
                ids = s.ids
                rows = e.rows
                if rows is None or ids is None or values.shape[0] != ids.shape[0] * e.dim:
                    return None
                rows_total += ids.shape[0]
                counts = np.zeros(e.owned.shape[0], np.int64)
                if storage_kernels.admit_rows(ids, e.num_rows, e.owned, epoch, None, counts, True) != 1:
                    return None
                if e.finite and not kernels.finite(values):
                    return None
                blocks = counts.nonzero()[0].tolist()
                units.append((e, blocks, list(map(e.objects.__getitem__, blocks)), ids, values.reshape(-1, e.dim), s))
            nbytes += s.values.nbytes
            if e.any_backed and not backed:
                backed = any(e.backed[b] for b in blocks)
        if rows_total > self.max_rows:
            return None
        if len(units) > 1:
            units.sort(key=_unit_order)             # the blocks in key order
            if len({u[0].name for u in units}) < len(units) and (   # a table twice (runs of a dense one)
                    len({(u[0].name, b) for u in units for b in u[1]}) < sum(len(u[1]) for u in units) or
                    len({u[0].name for u in units if u[3] is not None}) < sum(u[3] is not None for u in units)):
                return None             # a block or a sparse table twice: the general path sums them
        writer = Writer(header.session, header.incarnation, header.sequence, header.acked_below)
        if backed:
            ack = self._forwarded(units, generation, writer)
        else:
            ack = self._applied(units, generation, writer)
        if ack is not None:
            self.observe("push", time.perf_counter() - started, rows_total, nbytes + 8 * rows_total,
                         units[0][0].optimizer)
        return ack

    def _applied(self, units: list, generation: int, writer: Writer) -> PushAck | None:
        """A push to blocks without backups: locks, exactly-once, the update, versions."""
        table = self.table
        every = units[0][2] if len(units) == 1 else list(itertools.chain.from_iterable(u[2] for u in units))
        with BlockLocks(every):
            if (table.generation != generation or applied_any(every, writer)
                    or ((table.missing or table.needs_resync or table.extra) and fast._unsettled(table, every))):
                return None
            for unit in units:
                if unit[3] is None and not all(blk.initialized for blk in unit[2]):
                    return None
            ack = PushAck()
            updates = self.updates_between
            config = None
            for e, blocks, objects, ids, values, s in units:
                config = e.t.config
                if ids is None:
                    lo = s.start
                    base = s.base_versions
                    for b, blk in zip(blocks, objects):
                        a, z = max(lo, blk.start), min(s.stop, blk.stop)
                        if base and b in base:
                            updates(blk.key, blk.version - base[b])
                        blk.apply_gradient(config, a, z, values[a - lo:z - lo])
                else:
                    rows = e.rows
                    with rows.lock:
                        rows.apply_rows(config, ids, values)
                    for blk in objects:
                        blk.version += 1
                ack.versions.append(Versions(e.name, blocks, list(map(VERSION_OF, objects))))
            remember_all(every, writer)
            return ack

    def _forwarded(self, units: list, generation: int, writer: Writer) -> PushAck | None:
        """A push to blocks with backups: ``fast.apply_push`` forwards it as it applies it."""
        plan_units = []
        for e, blocks, objects, ids, values, s in units:
            u = fast.Unit(e.t, np.asarray(blocks, np.int64), values, objects, lo=s.start, hi=s.stop,
                          base_versions=s.base_versions or {})
            if ids is not None:
                u.ids, u.rows = ids, e.rows
                u.blocks_of = kernels.sparse_block_of(ids, e.owned.shape[0])
            plan_units.append(u)
        every = [blk for u in units for blk in u[2]]
        plan = fast.FastPush(self.table, plan_units, every, generation)
        return fast.apply_push(plan, writer, self.forwarder, self.updates_between)

    # ------------------------------------------------------------------ pull
    def pull(self, header: Header, slices: list, out: np.ndarray | None) -> tuple[PullReply, list] | None:
        """Read an ASYNC pull's float32 values (gate held shared): into ``out`` (a writable
        byte buffer: ``PullReply.in_shared_memory`` is then set and no arrays are returned)
        when they fit, else into new arrays; None: the general path serves it."""
        started = time.perf_counter()
        if not self._async(header):
            return None
        job = header.job
        generation, tables = self._tables_now()
        epoch = header.epoch
        plan = []
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
                n = s.stop - s.start
                plan.append((e, blocks, list(map(e.objects.__getitem__, blocks)), s, n))
                out_bytes += 4 * n
                continue
            ids = s.ids
            if e.rows is None or ids is None:
                return None
            rows_total += ids.shape[0]
            counts = np.zeros(e.owned.shape[0], np.int64)
            if storage_kernels.admit_rows(ids, e.num_rows, e.owned, epoch, None, counts, False) < 0:
                return None
            blocks = counts.nonzero()[0].tolist()
            n = ids.shape[0] * e.dim
            plan.append((e, blocks, list(map(e.objects.__getitem__, blocks)), s, n))
            out_bytes += 4 * n
        if out_bytes > self.max_response_bytes or rows_total > self.max_rows:
            return None
        if len(plan) > 1:                   # the locks in key order: by table, a table's by block
            every = list(itertools.chain.from_iterable(p[2] for p in sorted(plan, key=_plan_name)))
            if len({p[0].name for p in plan}) < len(plan):     # a table twice: each block locked once
                every = sorted({id(blk): blk for blk in every}.values(), key=_block_key)
        else:
            every = plan[0][2] if plan else []
        in_place = out is not None and out_bytes <= out.shape[0]
        reply = PullReply()
        arrays = []
        at = 0
        with BlockLocks(every):
            if self.table.generation != generation:
                return None                 # a block dropped or loaded since admission
            for p in plan:
                if p[0].dense and not all(blk.initialized for blk in p[2]):
                    return None
            for e, blocks, objects, s, n in plan:
                if in_place:
                    values = out[at:at + 4 * n].view(np.float32)        # type: ignore[index]
                    at += 4 * n
                else:
                    values = np.empty(n, np.float32)
                    arrays.append(values)
                if e.dense:
                    lo = s.start
                    for blk in objects:
                        a, z = max(lo, blk.start), min(s.stop, blk.stop)
                        blk.read(a, z, out=values[a - lo:z - lo])
                elif objects:
                    rows = e.rows
                    with rows.lock:
                        rows.read(s.ids, out=values.reshape(-1, e.dim))
                reply.segments.append(Layout(1, n))
                reply.versions.append(Versions(e.name, blocks, list(map(VERSION_OF, objects))))
        clock = self.steps.clocks.get(job)
        if clock is not None:
            reply.min_clock = clock.min_completed()
        reply.payload_bytes = out_bytes
        reply.in_shared_memory = in_place
        self.observe("pull", time.perf_counter() - started, rows_total, out_bytes)
        return reply, arrays


def push_request(step: StepRequest) -> PushRequest:
    """A step's push as the general path takes it (its payload: each segment's ids, then its
    values, one segment after another), in bytes of its own, copied once: the general path
    may wait (a hold, a SYNC step) while the frame's or the client's shared-memory region's
    bytes are reused (read in place, ``python -m shardps.tools.verify --jobs sync
    --sync-faults-all --seed 7`` saw pushes refused for steps already applied, and a stall
    past its 5 s limit)."""
    segments, payload = [], []
    for s in step.push or ():
        if s.selector is ROWS:
            segments.append(Selection(s.table, ROWS, count=s.ids.shape[0]))
            payload.append(s.ids)
        else:
            segments.append(Selection(s.table, RANGE, s.start, s.stop, base_versions=s.base_versions or {}))
        payload.append(s.values)
    return PushRequest(step.header, step.kind, segments, b"".join(payload))     # arrays are bytes-like


def pull_request(step: StepRequest) -> PullRequest:
    """A step's pull as the general path takes it (the header with the pull's clock; the ids
    in bytes of its own, as ``push_request``'s)."""
    h = step.header
    header = Header(h.job, h.epoch, h.session, h.incarnation, h.sequence, h.acked_below, step.pull_clock,
                    h.wire_dtype)
    segments = [Selection(s.table, ROWS, count=s.ids.shape[0]) if s.selector is ROWS
                else Selection(s.table, RANGE, s.start, s.stop) for s in step.pull or ()]
    return PullRequest(header, segments, b"".join(s.ids for s in step.pull or () if s.selector is ROWS))


def _unit_order(unit) -> tuple[str, int]:
    """A push unit's place in key order: its table, then its first block (a dense table's
    ranges to one server are runs of blocks)."""
    return unit[0].name, unit[1][0] if len(unit[1]) else 0


def _plan_name(part) -> str:
    return part[0].name


def _block_key(blk: Any):
    return blk.key


def _writer_current(group, header: Header) -> bool:
    """Whether the request's session is not fenced: absent from the group, or at its
    current incarnation (``PushApplier.check_writer``'s rule; a fenced one goes to the
    general path for its error)."""
    session = header.session
    for m in group.members:
        if m.session == session:
            return m.incarnation == header.incarnation
    for m in group.clients:
        if m.session == session:
            return m.incarnation == header.incarnation
    return True
