"""The common request, admitted whole, computed table by table, committed block by block.

Most pushes are ASYNC gradients of sparse rows and dense ranges, on blocks this node serves
and holds, of tables without lifecycle policies, from a writer whose push is new. For those:

* ``admit_push`` checks the request with a few vectorised operations per table (the ids'
  bounds, blocks and uniqueness in one compiled pass, ownership of every touched block at once)
  and no per-block objects; it returns None for any other request, which the general path
  (``apply.PushApplier.apply_parts``) serves, and which raises the errors;
* ``apply_push`` holds the blocks' locks, sends the push's operations to the backups (a
  sparse table's rows as one APPLY_ROWS operation per set of backups, which a backup applies
  in one compiled call too), computes each sparse table's update in one compiled call
  (``storage.SparseRows.apply_rows``: slots, new rows, optimizer) and each dense range as
  before while the backups apply theirs, then commits: every block's version, the writer's
  exactly-once record, the backups' answers, the acknowledgement. Which
  blocks have backups is decided there, under the locks: a block of the push that is
  missing, owed a resync or being copied (a copy destination added after admission) sends
  the push, whole, to the general path, which forwards to the copy too.

``accumulate_push`` takes a SYNC member's push the same way: admitted as above, the step
decided (``SyncSteps.check_step_open``: a push for an applied step is refused before
anything changes), each block's part kept for the step (one grouping pass per sparse table),
the same records, versions and forwarding (ACCUMULATE operations) as the general path's.

``read_pull`` does the same for the common pull (float32 values of dense ranges and sparse
rows, not an export): ownership checked per table at once, every block locked at once, each
sparse table's rows gathered in one compiled pass.

Same results, same replicas, same records as the general path (the tests run both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import numpy as np

from shardps.blockops import ACCUMULATE, APPLY, APPLY_ROWS, BlockOp
from shardps.dtypes import WireDType
from shardps.messages import GRADIENT, Layout, PullReply, PushAck, Versions
from shardps.server.node import storage_kernels
from shardps.server.node.blocks import AnyBlock, BlockLocks, DenseBlock, SparseRows, Writer, applied_any, remember_all
from shardps.server.node.decode import Segment, serves
from shardps.server.node.table import BlockTable
from shardps.shardmap import TableView
from shardps.tables import Consistency, TableKind, dense_blocks_of_range

if TYPE_CHECKING:
    from shardps.server.node.replication import Forwarder
    from shardps.server.node.steps import SyncSteps


@dataclass
class Unit:
    """One segment of an admitted push: its table, blocks (ascending) and data. Sparse:
    ``ids`` unique (in any order), ``values`` ``[n, dim]``, ``blocks_of`` each id's block;
    dense: the flat range ``[lo, hi)`` and its values."""

    table: TableView
    blocks: np.ndarray
    values: np.ndarray
    objects: list[AnyBlock] = field(default_factory=list)     # the blocks held here, in order
    ids: np.ndarray | None = None
    blocks_of: np.ndarray | None = None
    rows: SparseRows | None = None
    lo: int = 0
    hi: int = 0
    base_versions: dict[int, int] = field(default_factory=dict)


@dataclass
class FastPush:
    table: BlockTable
    units: list[Unit]
    blocks: list[AnyBlock]              # every block, sorted by key
    generation: int | None = None       # the block table's when admitted (None: not checked)


def admit_push(table: BlockTable, job: str, epoch: int, kind: int, parsed: list[Segment],
               sync: bool = False) -> FastPush | None:
    """The plan of a push in the common case (see the module docstring), or None. ``sync``:
    a SYNC member's push, to be accumulated (``accumulate_push``), not applied. Reads the
    table's view and dicts (gate held shared); changes nothing."""
    view = table.view
    group = view.groups.get(job)
    mode = Consistency.SYNC if sync else Consistency.ASYNC
    if kind != GRADIENT or (group is not None and (group.consistency is not mode or group.quota_bytes)):
        return None
    units: list[Unit] = []
    for s in parsed:
        t = s.table
        if t.lost or s.values is None:
            return None
        if t.spec.kind is TableKind.DENSE:
            blocks = np.fromiter(dense_blocks_of_range(t.spec, s.lo, s.hi), np.int64)
            if not serves(t, table.name, blocks, epoch):
                return None
            units.append(Unit(t, blocks, s.values, lo=s.lo, hi=s.hi, base_versions=s.base_versions))
            continue
        rows = table.sparse_rows.get((t.job, t.name))
        if rows is None or rows.life is not None or t.config.lifecycle.enabled or s.ids is None:
            return None
        status, blocks_of, counts = storage_kernels.scan(s.ids, t.spec.num_rows, t.spec.num_blocks, unique=True)
        if status != 1:                 # repeated ids, or out of bounds
            return None
        blocks = counts.nonzero()[0]
        if not serves(t, table.name, blocks, epoch):
            return None
        units.append(Unit(t, blocks, s.values, ids=s.ids, blocks_of=blocks_of, rows=rows))
    if len({(u.table.job, u.table.name) for u in units}) != len(units):
        return None                     # a table named twice: the general path sums them
    held = table.blocks
    every: list[AnyBlock] = []
    for u in sorted(units, key=lambda u: u.table.name):     # the blocks in key order: a
        name = u.table.name                                 # table's are in block order
        objects = [held.get((job, name, b)) for b in u.blocks.tolist()]
        if None in objects:
            return None
        u.objects = cast(list[AnyBlock], objects)
        every.extend(u.objects)
    return FastPush(table, units, every)


def _unsettled(table: BlockTable, blocks: list[AnyBlock]) -> bool:
    """Whether one of ``blocks`` (locked) is missing here, owed a whole copy by a backup
    (``needs_resync``) or being copied (``extra``): the general path handles those (it
    resyncs first; it refuses a missing block). Other blocks' states do not matter."""
    missing, resync, extra = table.missing, table.needs_resync, table.extra
    if not (missing or resync or extra):
        return False
    return any(blk.key in missing or resync.get(blk.key) or extra.get(blk.key) for blk in blocks)


def _backed(u: Unit) -> list[bool]:
    """Whether each block of ``u`` has backups (locks held; ``_unsettled`` sent blocks being
    copied to the general path): the map's replica counts, one vectorised test, which is
    ``BlockTable.has_backups`` for every other block."""
    return (u.table.replica_counts[u.blocks] > 1).tolist()


def apply_push(plan: FastPush, writer: Writer, forwarder: "Forwarder", updates_between) -> PushAck | None:
    """Apply an admitted push; None (nothing changed) when a block already applied it (a
    retry: the general path counts its duplicates), a dense block has no initial values
    yet (the general path refuses the push whole), or a block is missing, owed a resync or
    being copied (``_unsettled``: the general path serves it). The blocks' operations, decided
    per block under the locks (``BlockTable.has_backups``), are sent to their backups first
    (``forwarder.start_locked``), so that the backups apply them while this node does; the
    acknowledgement waits for them (``finish_locked``). ``updates_between`` (block key,
    updates) observes the versions pushed against (dense ``base_versions``)."""
    with BlockLocks(plan.blocks):
        if _for_the_general_path(plan, writer):
            return None
        ops: list = []
        for u in plan.units:
            backed = _backed(u)
            if u.ids is None:
                for (blk, lo, hi, values), has in zip(_dense_parts(u), backed):
                    if has:
                        ops.append(_op(blk, u.table, writer, [np.ascontiguousarray(values, dtype=np.float32)],
                                       start=lo, stop=hi, element_count=hi - lo))
            elif any(backed):
                ops.extend(_rows_ops(u, u.values.reshape(-1, u.table.spec.dim), writer, backed))
        _set_versions(ops, 1)               # each block's version once this push is applied
        in_flight = forwarder.start_locked([blk_op[:3] for blk_op in ops])
        try:
            _apply_here(plan, updates_between)
            remember_all(plan.blocks, writer)
        finally:
            forwarder.finish_locked(in_flight, plan.blocks)
        return _ack(plan)


def _dense_parts(u: Unit):
    """(block, lo, hi, gradient values) of each block of a dense unit."""
    for blk in u.objects:
        assert isinstance(blk, DenseBlock)
        lo, hi = max(u.lo, blk.start), min(u.hi, blk.stop)
        yield blk, lo, hi, u.values[lo - u.lo:hi - u.lo]


def _apply_here(plan: FastPush, updates_between) -> None:
    """The push's update of this node's blocks (locks held): each sparse table's rows in one
    compiled call, each dense block's range; every block's version one up."""
    for u in plan.units:
        t = u.table
        if u.ids is None:
            for b, (blk, lo, hi, values) in zip(u.blocks.tolist(), _dense_parts(u)):
                if b in u.base_versions:
                    updates_between(blk.key, blk.version - u.base_versions[b])
                blk.apply_gradient(t.config, lo, hi, values)     # counts its version itself
            continue
        assert u.rows is not None                # a sparse unit
        with u.rows.lock:
            u.rows.apply_rows(t.config, u.ids, u.values.reshape(-1, t.spec.dim))
        for blk in u.objects:
            blk.version += 1


def accumulate_push(plan: FastPush, job: str, writer: Writer, step: int, steps: "SyncSteps",
                    forward) -> PushAck | None:
    """Accumulate an admitted SYNC push (``admit_push(sync=True)``) into its step: as
    ``apply_push``, but each block keeps its part for ``steps`` to apply once the step is
    complete (``SyncSteps.accumulate``'s copies, one grouping pass per sparse table instead
    of a request part per block). ``SyncSteps.check_step_open`` decides the step, or refuses
    the push, before anything changes. The caller checked membership and the clock."""
    with BlockLocks(plan.blocks):
        if _for_the_general_path(plan, writer):
            return None
        step = steps.check_step_open(job, step, plan.blocks, writer)
        ops: list = []
        for u in plan.units:
            t = u.table
            backed = _backed(u)
            if u.ids is None:
                for blk, has in zip(u.objects, backed):
                    assert isinstance(blk, DenseBlock)
                    lo, hi = max(u.lo, blk.start), min(u.hi, blk.stop)
                    values = np.array(u.values[lo - u.lo:hi - u.lo], dtype=np.float32)
                    blk.accumulate(step, (lo, hi, values))
                    if has:
                        ops.append(_op(blk, t, writer, [values], step, start=lo, stop=hi, element_count=hi - lo))
                continue
            assert u.blocks_of is not None     # a sparse unit
            values = u.values.reshape(-1, t.spec.dim)
            for blk, pos, has in zip(u.objects, _by_block(u), backed):
                ids, rows = u.ids[pos], np.ascontiguousarray(values[pos], dtype=np.float32)
                blk.accumulate(step, (ids, rows))
                if has:
                    ops.append(_op(blk, t, writer, [ids, rows], step, id_count=ids.shape[0], element_count=rows.size))
        for blk in plan.blocks:         # tracked as pending by check_step_open
            blk.version += 1
        return _commit(plan, writer, ops, forward)


def _for_the_general_path(plan: FastPush, writer: Writer) -> bool:
    """Whether an admitted push goes to the general path after all (locks held): the blocks
    held here changed since admission (``generation``), a retry (a block already applied it:
    the general path counts the duplicates), a block the general path must handle
    (``_unsettled``), or a dense block without its initial values (refused whole there)."""
    if plan.generation is not None and plan.generation != plan.table.generation:
        return True                     # a block dropped or loaded since admission
    return (applied_any(plan.blocks, writer) or _unsettled(plan.table, plan.blocks)
            or any(not blk.initialized for u in plan.units if u.ids is None for blk in u.objects))  # type: ignore[union-attr]


def _commit(plan: FastPush, writer: Writer, ops: list, forward) -> PushAck:
    """The end of a fast SYNC push (locks held, every block changed): the writer's
    exactly-once record, the operations' versions and their forwarding, the acknowledgement."""
    remember_all(plan.blocks, writer)
    if ops:
        _set_versions(ops, 0)
        forward([blk_op[:3] for blk_op in ops], plan.blocks)
    return _ack(plan)


def _set_versions(ops: list, ahead: int) -> None:
    """Each op's version(s): its blocks' versions now, plus ``ahead``."""
    for _, op, _, changed in ops:
        if op.kind == APPLY_ROWS:
            op.versions.extend(blk.version + ahead for blk in changed)
        else:
            op.version = changed[0].version + ahead


def _ack(plan: FastPush) -> PushAck:
    ack = PushAck()
    for u in plan.units:
        ack.versions.append(Versions(u.table.name, u.blocks, [blk.version for blk in u.objects]))
    return ack


def _by_block(u: Unit) -> list[np.ndarray]:
    """The positions of a sparse unit's rows in each of its blocks (``u.blocks`` order)."""
    assert u.blocks_of is not None
    order = np.argsort(u.blocks_of, kind="stable")
    sorted_blocks = u.blocks_of[order]
    starts = np.searchsorted(sorted_blocks, u.blocks, side="left").tolist()
    ends = np.searchsorted(sorted_blocks, u.blocks, side="right").tolist()
    return [order[a:z] for a, z in zip(starts, ends)]


def _op(blk: AnyBlock, t: TableView, writer: Writer, arrays: list, step: int | None = None, kind: int = 0,
        **fields) -> tuple:
    """(key, op, arrays, [block]) of an APPLY of ``blk`` (its version is set once
    committed), or, with ``step``, an ACCUMULATE into that SYNC step; an op of another
    ``kind`` (APPLY_ROWS, of ``blk`` and more blocks) keeps it. ``fields``: the op's others."""
    op = BlockOp(blk.key[0], blk.key[1], blk.key[2], kind or (APPLY if step is None else ACCUMULATE), writer,
                 config_version=t.config.version, step=step or 0, **fields)
    return blk.key, op, arrays, [blk]


def _rows_ops(u: Unit, values: np.ndarray, writer: Writer, backed: list[bool]) -> list:
    """The APPLY_ROWS ops of a sparse unit's blocks that have backups (``backed``, per
    block): one per set of backups (one in all where every block has the same: two servers),
    with its blocks' rows; the request's own arrays when those are every block's."""
    assert u.ids is not None and u.blocks_of is not None
    t = u.table
    by_backups: dict[tuple[str, ...], list[int]] = {}
    for i, (b, has) in enumerate(zip(u.blocks.tolist(), backed)):
        if has:
            by_backups.setdefault(tuple(t.replicas[b][1:]), []).append(i)
    out = []
    for positions in by_backups.values():
        ids, rows = u.ids, values
        if len(positions) < len(u.objects):
            keep = np.isin(u.blocks_of, u.blocks[positions])
            ids, rows = ids[keep], rows[keep]
        ids, rows = np.ascontiguousarray(ids, dtype="<i8"), np.ascontiguousarray(rows, dtype="<f4")
        changed = [u.objects[i] for i in positions]
        key, op, arrays, _ = _op(changed[0], t, writer, [ids, rows], kind=APPLY_ROWS, id_count=ids.shape[0],
                                 element_count=rows.size, blocks=[blk.key[2] for blk in changed])
        out.append((key, op, arrays, changed))
    return out


def read_pull(table: BlockTable, epoch: int, parsed: list[Segment], reply: PullReply,
              out_buffer=None) -> list[np.ndarray] | None:
    """The values of a pull routed with map ``epoch``, in the common case (gate held shared,
    consistency wait done): one float32 array per segment, the segments' layouts and blocks' versions in ``reply``;
    None for any other pull (an export, another wire dtype, a block not served here: the
    general path, ``PullReader._read_parts``, reads it or raises). ``out_buffer`` (large
    enough: the caller checked): the arrays are views of it, one after the other."""
    if table.missing:
        return None
    held, name = table.blocks, table.name
    plan = []
    every: list[AnyBlock] = []
    for s in parsed:
        t = s.table
        if s.all_stored or s.dtype is not WireDType.FLOAT32 or t.lost:
            return None
        if t.spec.kind is TableKind.DENSE:
            blocks = np.fromiter(dense_blocks_of_range(t.spec, s.lo, s.hi), np.int64)
        else:
            assert s.ids is not None
            status, _, counts = storage_kernels.scan(s.ids, t.spec.num_rows, t.spec.num_blocks)
            if status < 0:
                return None
            blocks = counts.nonzero()[0]
        if not serves(t, name, blocks, epoch):
            return None
        job, table_name = t.job, t.name
        objects: list = [held.get((job, table_name, b)) for b in blocks.tolist()]
        if None in objects:
            return None
        plan.append((s, t, blocks, objects))
    for _, _, _, objects in sorted(plan, key=lambda p: p[1].name):     # the blocks in key order:
        every.extend(objects)                                          # a table's are in block order
    if len({p[1].name for p in plan}) < len(plan):     # a table named twice: each block locked once
        every = sorted({id(blk): blk for blk in every}.values(), key=lambda blk: blk.key)
    outputs = []
    offset = 0
    with BlockLocks(every):
        for s, t, blocks, objects in plan:
            shape = (s.hi - s.lo,) if s.ids is None else (s.ids.shape[0], t.spec.dim)
            if out_buffer is None:
                out = np.empty(shape, dtype=np.float32)
            else:
                out = np.frombuffer(out_buffer, "<f4", count=math.prod(shape), offset=offset).reshape(shape)
                offset += out.nbytes
            if s.ids is None:
                for blk in objects:
                    lo, hi = max(s.lo, blk.start), min(s.hi, blk.stop)
                    blk.read(lo, hi, out=out[lo - s.lo:hi - s.lo])
            else:
                if objects:                     # no block: a segment of no rows
                    rows = objects[0].table_rows
                    with rows.lock:
                        rows.read(s.ids, out=out)
            outputs.append(out)
            reply.segments.append(Layout(WireDType.FLOAT32.value, out.size))
            reply.versions.append(Versions(t.name, blocks, [blk.version for blk in objects]))
    return outputs
