"""A plan executed and committed under its blocks' locks (``plan.Plan``; gate held shared).

* ``apply``: an ASYNC push. Under the locks it is decided once more whether the plan still
  holds (``_declined``: the blocks changed since admission, a retry, a block missing, owed a
  resync or being copied, a dense block without its initial values); then the operations of
  the blocks with backups are sent first (a sparse table's rows as one APPLY_ROWS operation
  per set of backups, which a backup applies in one compiled call too), so that the backups
  apply them while this node does: each sparse table's update in one compiled call
  (``storage.SparseRows.apply_rows``: slots, new rows, the optimizer), each dense block's
  range. The commit: every block's version, the writer's exactly-once record, the backups'
  answers, the acknowledgement.
* ``accumulate``: a SYNC member's push. The step is decided (``SyncSteps.check_step_open``:
  a push for an applied step is refused before anything changes), each block keeps its part
  for the step, and the same records, versions and forwarding (ACCUMULATE operations).
* ``read``: a pull's float32 values, each sparse table's rows in one compiled gather, into
  the caller's buffer when one is given.
* ``step``: a Step's push and then its pull, as ``apply`` and ``read``, under one holding
  of all their blocks' locks.

Each answers None, having changed nothing, when the per-block engine must serve the request
after all (which leaves the same blocks, versions and records).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from shardps.blockops import ACCUMULATE, APPLY, APPLY_ROWS, BlockOp
from shardps.messages import Layout, PullReply, PushAck, Versions
from shardps.server.node.blocks import (
    VERSION_OF,
    AnyBlock,
    BlockLocks,
    DenseBlock,
    Writer,
    applied_any,
    bump_versions,
    remember_all,
)
from shardps.server.node.plan import Plan, StepPlan, Unit
from shardps.server.node.table import BlockTable

if TYPE_CHECKING:
    from shardps.server.node.replication import Forwarder
    from shardps.server.node.steps import SyncSteps


def apply(table: BlockTable, plan: Plan, writer: Writer, forwarder: "Forwarder", updates_between) -> PushAck | None:
    """Apply an admitted ASYNC push (see the module docstring); None: nothing changed.
    ``updates_between`` (block key, updates) observes the versions a dense part was
    computed against (``base_versions``)."""
    with BlockLocks(plan.blocks):
        if _declined(table, plan, writer):
            return None
        return _apply_locked(plan, writer, forwarder, updates_between)


def step(table: BlockTable, plan: StepPlan, writer: Writer, forwarder: "Forwarder", updates_between,
         reply: PullReply | None, out=None) -> tuple[PushAck | None, list[np.ndarray], float] | None:
    """A Step's admitted push applied (as ``apply``) and then its pull read (as ``read``)
    under one holding of every block's lock, ``reply`` the pull's (None: the step has no
    pull): (the push's ack or None, the pull's arrays, when the push was applied:
    ``time.perf_counter``). None: the per-block engine serves the step after all (nothing
    changed, nothing read)."""
    push, pull = plan.push, plan.pull
    with BlockLocks(plan.locks):
        if push is not None and _declined(table, push, writer):
            return None
        if pull is not None and not _readable(table, pull):
            return None
        ack = None if push is None else _apply_locked(push, writer, forwarder, updates_between)
        applied = time.perf_counter()
        return ack, [] if pull is None or reply is None else _read_locked(pull, reply, out), applied


def _apply_locked(plan: Plan, writer: Writer, forwarder: "Forwarder", updates_between) -> PushAck:
    """``apply`` once the plan is decided to hold (locks held)."""
    if not plan.backed:
        _apply_here(plan, updates_between)
        remember_all(plan.blocks, writer)
        return _ack(plan)
    ops: list = []
    for u in plan.units:
        backed = list(map(u.entry.backed.__getitem__, u.blocks))     # the map's, under the gate
        if u.ids is None:
            for (blk, lo, hi, values), has in zip(_dense_parts(u), backed):
                if has:
                    ops.append(_op(blk, u, writer, [np.ascontiguousarray(values, dtype=np.float32)],
                                   start=lo, stop=hi, element_count=hi - lo))
        elif any(backed):
            ops.extend(_rows_ops(u, writer, backed))
    _set_versions(ops, 1)               # each block's version once this push is applied
    in_flight = forwarder.start_locked([blk_op[:3] for blk_op in ops])
    try:
        _apply_here(plan, updates_between)
        remember_all(plan.blocks, writer)
    finally:
        forwarder.finish_locked(in_flight, plan.blocks)
    return _ack(plan)


def accumulate(table: BlockTable, plan: Plan, job: str, writer: Writer, step: int, steps: "SyncSteps",
               forward) -> PushAck | None:
    """Accumulate an admitted SYNC member's push into its step (see the module docstring):
    each block keeps its part for ``steps`` to apply once the step is complete. The caller
    checked membership and the clock; ``forward`` sends the ACCUMULATE operations (locks
    held)."""
    with BlockLocks(plan.blocks):
        if _declined(table, plan, writer):
            return None
        step = steps.check_step_open(job, step, plan.blocks, writer)
        ops: list = []
        for u in plan.units:
            backed = list(map(u.entry.backed.__getitem__, u.blocks))
            if u.ids is None:
                for (blk, lo, hi, values), has in zip(_dense_parts(u), backed):
                    values = np.array(values, dtype=np.float32)
                    blk.accumulate(step, (lo, hi, values))
                    if has:
                        ops.append(_op(blk, u, writer, [values], step, start=lo, stop=hi, element_count=hi - lo))
                continue
            for blk, pos, has in zip(u.objects, _by_block(u), backed):
                ids, rows = u.ids[pos], np.ascontiguousarray(u.values[pos], dtype=np.float32)
                blk.accumulate(step, (ids, rows))
                if has:
                    ops.append(_op(blk, u, writer, [ids, rows], step, id_count=ids.shape[0], element_count=rows.size))
        bump_versions(plan.blocks)      # tracked as pending by check_step_open
        remember_all(plan.blocks, writer)
        if ops:
            _set_versions(ops, 0)
            forward([blk_op[:3] for blk_op in ops], plan.blocks)
        return _ack(plan)


def read(table: BlockTable, plan: Plan, reply: PullReply, out=None) -> list[np.ndarray] | None:
    """A pull's values (see the module docstring): the segments' layouts and the blocks'
    versions appended to ``reply``; returns one array per unit (a sparse one ``[n, dim]``),
    views of ``out`` (a writable buffer of at least ``plan.nbytes``) when given. None: a
    block changed since admission or a dense one has no initial values (nothing read)."""
    with BlockLocks(plan.blocks):
        return _read_locked(plan, reply, out) if _readable(table, plan) else None


def _readable(table: BlockTable, plan: Plan) -> bool:
    """Whether an admitted pull still holds (locks held): no block dropped or loaded since
    admission, every dense block with its initial values."""
    if table.generation != plan.generation:
        return False
    return all(blk.initialized for u in plan.units if u.ids is None for blk in u.objects)


def _read_locked(plan: Plan, reply: PullReply, out) -> list[np.ndarray]:
    """``read`` once the plan is decided to hold (locks held)."""
    arrays = []
    at = 0
    for u in plan.units:
        e = u.entry
        n = u.stop - u.start if u.ids is None else u.ids.shape[0] * e.dim
        if out is not None:
            values = np.frombuffer(out, np.float32, n, at)
            at += 4 * n
        else:
            values = np.empty(n, np.float32)
        if u.ids is None:
            lo = u.start
            for blk in u.objects:
                a, z = max(lo, blk.start), min(u.stop, blk.stop)
                blk.read(a, z, out=values[a - lo:z - lo])
        else:
            values = values.reshape(-1, e.dim)
            if u.objects:           # no block: a part of no rows
                rows = e.rows
                with rows.lock:
                    rows.read(u.ids, out=values)
        arrays.append(values)
        reply.segments.append(Layout(1, n))
        reply.versions.append(Versions(e.name, u.blocks, list(map(VERSION_OF, u.objects))))
    return arrays


# ---------------------------------------------------------------------- commit and its parts
def _declined(table: BlockTable, plan: Plan, writer: Writer) -> bool:
    """Whether an admitted push goes to the per-block engine after all (locks held): the
    blocks held here changed since admission (``generation``), a retry (a block already
    applied it: the engine counts the duplicates), a block missing here, owed a whole copy by
    a backup or being copied (the engine resyncs first, or refuses), or a dense block without
    its initial values (refused whole there)."""
    if table.generation != plan.generation or applied_any(plan.blocks, writer):
        return True
    missing, resync, extra = table.missing, table.needs_resync, table.extra
    if (missing or resync or extra) and any(blk.key in missing or resync.get(blk.key) or extra.get(blk.key)
                                            for blk in plan.blocks):
        return True
    return any(not blk.initialized for u in plan.units if u.ids is None for blk in u.objects)


def _apply_here(plan: Plan, updates_between) -> None:
    """The push's update of this node's blocks (locks held): each sparse table's rows in one
    compiled call, each dense block's range; every block's version one up."""
    for u in plan.units:
        config = u.entry.t.config
        if u.ids is None:
            base = u.base_versions
            for b, (blk, lo, hi, values) in zip(u.blocks, _dense_parts(u)):
                if base and b in base:
                    updates_between(blk.key, blk.version - base[b])
                blk.apply_gradient(config, lo, hi, values)     # counts its version itself
            continue
        rows = u.entry.rows
        with rows.lock:
            rows.apply_rows(config, u.ids, u.values)
        bump_versions(u.objects)


def _ack(plan: Plan) -> PushAck:
    ack = PushAck()
    for u in plan.units:
        ack.versions.append(Versions(u.entry.name, u.blocks, list(map(VERSION_OF, u.objects))))
    return ack


def _dense_parts(u: Unit):
    """(block, lo, hi, values) of each block of a dense unit."""
    for blk in u.objects:
        assert isinstance(blk, DenseBlock)
        lo, hi = max(u.start, blk.start), min(u.stop, blk.stop)
        yield blk, lo, hi, u.values[lo - u.start:hi - u.start]


def _by_block(u: Unit) -> list[np.ndarray]:
    """The positions of a sparse unit's rows in each of its blocks (``u.blocks`` order)."""
    blocks_of = u.blocks_of()
    order = np.argsort(blocks_of, kind="stable")
    sorted_blocks = blocks_of[order]
    starts = np.searchsorted(sorted_blocks, u.blocks, side="left").tolist()
    ends = np.searchsorted(sorted_blocks, u.blocks, side="right").tolist()
    return [order[a:z] for a, z in zip(starts, ends)]


def _op(blk: AnyBlock, u: Unit, writer: Writer, arrays: list, step: int | None = None, kind: int = 0,
        **fields) -> tuple:
    """(key, op, arrays, [block]) of an APPLY of ``blk`` (its version is set once
    committed), or, with ``step``, an ACCUMULATE into that SYNC step; an op of another
    ``kind`` (APPLY_ROWS, of ``blk`` and more blocks) keeps it. ``fields``: the op's others."""
    op = BlockOp(blk.key[0], blk.key[1], blk.key[2], kind or (APPLY if step is None else ACCUMULATE), writer,
                 config_version=u.entry.t.config.version, step=step or 0, **fields)
    return blk.key, op, arrays, [blk]


def _rows_ops(u: Unit, writer: Writer, backed: list[bool]) -> list:
    """The APPLY_ROWS ops of a sparse unit's blocks that have backups (``backed``, per
    block): one per set of backups (one in all where every block has the same: two servers),
    with its blocks' rows; the request's own arrays when those are every block's."""
    replicas = u.entry.t.replicas
    by_backups: dict[tuple[str, ...], list[int]] = {}
    for i, (b, has) in enumerate(zip(u.blocks, backed)):
        if has:
            by_backups.setdefault(tuple(replicas[b][1:]), []).append(i)
    out = []
    for positions in by_backups.values():
        ids, rows = u.ids, u.values
        if len(positions) < len(u.objects):
            keep = np.isin(u.blocks_of(), np.asarray(u.blocks)[positions])
            ids, rows = ids[keep], rows[keep]
        ids, rows = np.ascontiguousarray(ids, dtype="<i8"), np.ascontiguousarray(rows, dtype="<f4")
        changed = [u.objects[i] for i in positions]
        key, op, arrays, _ = _op(changed[0], u, writer, [ids, rows], kind=APPLY_ROWS, id_count=ids.shape[0],
                                 element_count=rows.size, blocks=[blk.key[2] for blk in changed])
        out.append((key, op, arrays, changed))
    return out


def _set_versions(ops: list, ahead: int) -> None:
    """Each op's version(s): its blocks' versions now, plus ``ahead``."""
    for _, op, _, changed in ops:
        if op.kind == APPLY_ROWS:
            op.versions.extend(blk.version + ahead for blk in changed)
        else:
            op.version = changed[0].version + ahead
