"""The per-block engine: a push that no plan serves (``plan``, ``execute``), cut into one
part per block and applied block by block under the blocks' locks: INITIALIZE and ASSIGN,
quotas, lifecycle tables, repeated ids, retries (counted as duplicates), owed resyncs, and
the precise error of whatever a plan declined. Also the block operations a backup applies
(``apply_gradient``, ``assign_values``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, cast

import numpy as np

from shardps.blockops import ACCUMULATE, APPLY, ASSIGN_VALUES, INITIAL, BlockOp
from shardps.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from shardps.messages import ASSIGN, GRADIENT, INITIALIZE, PushAck, versions_by_table
from shardps.metrics import NodeMetrics, labelled
from shardps.server import optimizers
from shardps.server.node import lifecycle_ops
from shardps.server.node.blocks import AnyBlock, BlockKey, BlockLocks, DenseBlock, SparseBlock, Writer, remember_all
from shardps.server.node.decode import Part, Segment
from shardps.server.node.table import BlockTable
from shardps.shardmap import TableView

if TYPE_CHECKING:
    from shardps.server.node.replication import Forwarder
    from shardps.server.node.steps import SyncSteps


class BlockEngine:
    """Applies a push's per-block parts (see the module docstring). Thread-safe: the caller
    holds the gate shared; a push holds its blocks' locks (sorted by key)."""

    def __init__(self, table: BlockTable, steps: "SyncSteps", forwarder: "Forwarder", metrics: NodeMetrics,
                 clock=time.monotonic):
        self.table = table
        self.steps = steps
        self.forwarder = forwarder
        self.metrics = metrics
        self._now = clock

    def apply_parts(self, parts: list[Part], kind: int, writer: Writer, sync: bool,
                    step: int, parsed: list[Segment]) -> PushAck:
        """Check, apply and forward ``parts`` under their blocks' locks (gate shared). Every
        precondition (INITIALIZE shape, initial values, SYNC step open, quota, owed resyncs)
        is checked before the first block changes; a backup that misses the ops raises
        Unavailable after they were applied here (see replication.Forwarder)."""
        ack = PushAck()
        if not parts:
            return ack
        parts.sort(key=lambda p: p.key)
        blocks = [self.table.blocks[p.key] for p in parts]
        unique = sorted({id(b): b for b in blocks}.values(), key=lambda b: b.key)
        base = {}
        for s in parsed:
            for b, v in s.base_versions.items():
                base[(s.table.job, s.table.name, b)] = v
        with BlockLocks(unique):
            # exactly-once: decided once per block, under its lock
            applied = {id(blk) for blk in unique if blk.already_applied(writer)}
            # pass 1: preconditions, before anything changes
            for part, blk in zip(parts, blocks):
                if id(blk) in applied:
                    continue
                if kind == INITIALIZE:
                    if not isinstance(blk, DenseBlock):
                        raise InvalidArgument(f"INITIALIZE is for dense tables; "
                                              f"{part.table.name!r} is sparse")
                    if (part.lo, part.hi) != (blk.start, blk.stop):
                        raise InvalidArgument(
                            f"INITIALIZE of table {part.table.name!r} must cover whole blocks: "
                            f"block {part.key[2]} is [{blk.start}, {blk.stop}), got "
                            f"[{part.lo}, {part.hi})")
                elif kind == ASSIGN:
                    check_assign(part, blk)
                elif isinstance(blk, DenseBlock) and not blk.initialized:
                    raise FailedPrecondition(
                        f"table {part.table.name!r} block {part.key[2]} has no initial values "
                        f"yet: push INITIALIZE first")
            fresh = [blk for blk in unique if id(blk) not in applied]
            if sync and fresh:          # a retry of an applied push is a duplicate, not late
                step = self.steps.check_step_open(parts[0].key[0], step, fresh, writer)
            check_quota(self.table, parts, blocks, applied)
            for blk in unique:
                if self.table.needs_resync.get(blk.key):
                    self.forwarder.resync_locked(blk)
            # pass 2: apply, in block order
            ops: list[tuple[BlockKey, BlockOp, list[np.ndarray]]] = []
            duplicates = 0
            todo: list[tuple[Part, AnyBlock]] = []
            for part, blk in zip(parts, blocks):
                if id(blk) in applied:
                    duplicates += 1
                    continue
                if part.key in base:
                    labelled(self.metrics.updates_between, part.key[0]).observe(
                        max(0, blk.version - base[part.key]))
                todo.append((part, blk))
            i = 0
            stepped: set[int] = set()         # dense blocks a range of this push reached: one step each
            while i < len(todo):
                part, blk = todo[i]
                j = i + 1
                if isinstance(blk, SparseBlock) and kind == GRADIENT and not sync:
                    # every sparse block of one table in one vectorised update
                    while j < len(todo) and todo[j][1].key[:2] == blk.key[:2] \
                            and todo[j][1] is not todo[j - 1][1]:
                        j += 1
                    ops.extend(self.apply_sparse(todo[i:j], writer, step))
                else:
                    op, arrays = self.apply_one(blk, part, kind, writer, sync, step, id(blk) in stepped)
                    stepped.add(id(blk))
                    ops.append((blk.key, op, arrays))
                i = j
            remember_all(unique, writer)
            if duplicates:
                self.metrics.duplicates.labels(parts[0].key[0]).inc(duplicates)
            self.forwarder.forward_locked(ops, unique)
            ack.versions = versions_by_table((blk.key[1], blk.key[2], blk.version) for blk in unique)
            ack.duplicate_blocks = duplicates
        return ack

    def apply_sparse(self, group: list[tuple[Part, AnyBlock]], writer: Writer, clock: int = 0):
        """Apply the parts of one sparse table (distinct blocks, unique ids) at once; returns
        one op per block for the backups, carrying the lifecycle decisions (admission,
        eviction: server.lifecycle) made here for ``clock``. Block locks are held."""
        t = group[0][0].table
        whole = group[0][0].whole
        if whole is not None and whole[2] == len(group) and all(p.whole is whole for p, _ in group):
            ids, grads = whole[0], whole[1]           # the whole segment: no re-assembly
        else:
            ids = np.concatenate([p.ids for p, _ in group])
            grads = np.concatenate([p.values for p, _ in group])
        rows = cast(SparseBlock, group[0][1]).table_rows   # a group holds sparse blocks only
        wall = self._now() if t.config.lifecycle.ttl_seconds else None
        with rows.lock:
            outcome = rows.apply(t.config, ids, np.ascontiguousarray(grads, dtype=np.float32).reshape(-1, t.spec.dim),
                                 clock, wall)
        decided = None if outcome is None else lifecycle_ops.by_block(outcome, t.spec.num_blocks)
        out = []
        for part, blk in group:
            blk.version += 1
            if not self.table.has_backups(blk.key):
                continue                              # nothing to forward
            assert part.ids is not None and part.values is not None   # a sparse push part
            if decided is not None:
                op, arrays = lifecycle_ops.block_op(blk.key, part.ids, part.values, decided, clock)
                op.writer = writer
                op.config_version, op.version = t.config.version, blk.version
                out.append((blk.key, op, arrays))
                continue
            op = BlockOp(blk.key[0], blk.key[1], blk.key[2], APPLY, writer, blk.version, t.config.version,
                         id_count=part.ids.shape[0], element_count=part.values.size)
            out.append((blk.key, op, [np.ascontiguousarray(part.ids, dtype=np.int64),
                                      np.ascontiguousarray(part.values, dtype=np.float32)]))
        return out

    def apply_one(self, blk: AnyBlock, part: Part, kind: int, writer: Writer, sync: bool,
                  step: int, same_step: bool = False) -> tuple[BlockOp, list[np.ndarray]]:
        """Apply one part to its block (lock held); returns the op to forward to backups.
        ``same_step``: the push reached this dense block in an earlier part too."""
        t = part.table
        op = BlockOp(blk.key[0], blk.key[1], blk.key[2], writer=writer, config_version=t.config.version)
        if isinstance(blk, DenseBlock):
            op.start, op.stop = part.lo, part.hi
            op.element_count = part.hi - part.lo
            arrays = [np.ascontiguousarray(part.values, dtype=np.float32)]
        else:
            assert part.ids is not None and part.values is not None   # a sparse push part
            op.id_count = part.ids.shape[0]
            op.element_count = part.values.size
            arrays = [np.ascontiguousarray(part.ids, dtype=np.int64),
                      np.ascontiguousarray(part.values, dtype=np.float32)]
        if kind == INITIALIZE:
            op.kind = INITIAL
            cast(DenseBlock, blk).initialize(part.lo, part.hi, arrays[0])   # INITIALIZE: dense only
        elif kind == ASSIGN:                      # applied at once, in SYNC groups too
            op.kind = ASSIGN_VALUES
            assign_values(blk, t, arrays, op)
        elif sync:
            op.kind = ACCUMULATE
            op.step = step
            self.steps.accumulate(blk, step, arrays, part.lo, part.hi)
        else:
            op.kind = APPLY
            op.same_step = same_step and isinstance(blk, DenseBlock)
            apply_gradient(blk, t, arrays, op)
        op.version = blk.version
        return op, arrays


def logical_bytes(blk: AnyBlock, t: TableView) -> int:
    """Bytes a block's stored parameters and optimizer state need (without growth slack)."""
    per = 4 * (1 + len(optimizers.state_names(t.config.optimizer)))
    if isinstance(blk, DenseBlock):
        return blk.size * per if blk.values is not None else 0
    return blk.count * (blk.dim * per + 12)


def apply_gradient(blk: AnyBlock, t: TableView, arrays, op: BlockOp) -> None:
    """Apply a gradient op's arrays to ``blk`` with the table's optimizer (lock held). A
    sparse table's lifecycle decisions ride on the op (see BlockOp.dropped_count)."""
    if isinstance(blk, DenseBlock):
        blk.apply_gradient(t.config, op.start, op.stop, arrays[0], same_step=op.same_step)
    elif op.dropped_count or op.evicted_count or t.config.lifecycle.enabled or blk.table_rows.life is not None:
        ids = arrays[0]
        n = ids.shape[0] - int(op.dropped_count) - int(op.evicted_count)
        cooled = n + int(op.dropped_count)
        blk.apply_decided(t.config, ids[:n], arrays[1], ids[n:cooled], ids[cooled:cooled + int(op.cooled_count)],
                          ids[cooled + int(op.cooled_count):], int(op.step))
    else:
        blk.apply_gradient(t.config, arrays[0], arrays[1].reshape(-1, blk.dim))


def check_assign(part: Part, blk: AnyBlock) -> None:
    """An ASSIGN part's precondition, checked before anything changes (``DenseBlock.assign``
    relies on it): a dense block without initial values is written whole; a sparse table has
    no lifecycle policy (its admission and eviction decide which rows are stored). A segment's
    repeated ids were refused before (``decode.check_assign_ids``)."""
    t = part.table
    if isinstance(blk, DenseBlock):
        if not blk.initialized and (part.lo, part.hi) != (blk.start, blk.stop):
            raise InvalidArgument(
                f"ASSIGN of table {t.name!r} block {part.key[2]} (no initial values yet) must cover "
                f"the whole block [{blk.start}, {blk.stop}), got [{part.lo}, {part.hi})")
    elif t.config.lifecycle.enabled or blk.table_rows.life is not None:
        raise InvalidArgument(
            f"ASSIGN of sparse table {t.name!r}: the table has a lifecycle policy (admission, "
            f"eviction), which decides the rows it stores; warm-start it with shardps restore "
            f"from a checkpoint instead")


def assign_values(blk: AnyBlock, t: TableView, arrays: list[np.ndarray], op: BlockOp) -> None:
    """Apply an ASSIGN op's arrays to ``blk`` (lock held): a primary's push or a backup's
    forwarded op, the same bytes."""
    if isinstance(blk, DenseBlock):
        blk.assign(t.config, int(op.start), int(op.stop), arrays[0])
    else:
        blk.assign(t.config, arrays[0], arrays[1])


def check_quota(table: BlockTable, parts: list[Part], blocks: list[AnyBlock], applied: set[int]) -> None:
    """RESOURCE_EXHAUSTED when this push would store more of its job than the job's
    quota allows on this server (the quota is shared by servers in proportion to the
    block replicas they hold); ``applied``: ids of the blocks that already applied it.
    Block locks are held."""
    job = parts[0].key[0]
    view = table.view
    group = view.groups.get(job)
    if group is None or not group.quota_bytes:
        return
    new = 0
    for part, blk in zip(parts, blocks):
        if id(blk) in applied:
            continue
        row_bytes = 4 * (1 + len(optimizers.state_names(part.table.config.optimizer)))
        if isinstance(blk, DenseBlock):
            if blk.values is None:
                new += blk.size * row_bytes
        else:
            assert part.ids is not None           # a sparse part carries its ids
            new += int((blk.lookup(part.ids) < 0).sum()) * (blk.dim * row_bytes + 12)
    if not new:
        return
    held = table.held(job)
    total = sum(len(reps) for (j, _), t in view.tables.items() if j == job for reps in t.replicas)
    share = group.quota_bytes * len(held) // max(1, total)
    usage = sum(logical_bytes(b, view.tables[(k[0], k[1])]) for k, b in held
                if (k[0], k[1]) in view.tables)
    if usage + new > share:
        raise ResourceExhausted(
            f"job {job!r} is over its storage quota (quota_bytes={group.quota_bytes}; this server "
            f"holds {len(held)} of its {total} block replicas, a share of {share} bytes): it stores "
            f"{usage} bytes and this push would add {new}: raise the quota or delete tables")
