"""The push path: admission (holds, fencing, membership), exactly-once, quotas, optimizers.

Contract of ``PushApplier.push`` (the .proto states the same):

* Every request is validated whole before anything is applied: a rejected request changes
  nothing.
* Exactly-once per block: (session, incarnation, sequence) is remembered by every replica
  (``Block.remember``); a push a block already applied is counted as a duplicate, not
  applied again.
* A push is acknowledged once it is applied on every listed backup and on every node the
  block is being copied to (``replication.Forwarder``); a raised error means nothing was
  acknowledged, and a retry is safe.
* A job's quota (``quota_bytes``, shared by servers in proportion to the block replicas
  they hold) refuses, with ResourceExhausted, a push that would store more; nothing of it
  is stored.
* SYNC jobs: gradients are accumulated per step (``steps.SyncSteps``), from members only,
  for steps not yet applied.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, cast

import numpy as np

from shardps.blockops import ACCUMULATE, APPLY, ASSIGN_VALUES, INITIAL, BlockOp
from shardps.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from shardps.messages import (
    ASSIGN,
    GRADIENT,
    INITIALIZE,
    PUSH_KIND_UNSPECIFIED,
    Header,
    PushAck,
    PushRequest,
    versions_by_table,
)
from shardps.metrics import NodeMetrics, labelled
from shardps.server import optimizers
from shardps.server.node import execute, lifecycle_ops
from shardps.server.node.blocks import AnyBlock, BlockKey, BlockLocks, DenseBlock, SparseBlock, Writer, remember_all
from shardps.server.node.decode import (
    NodeLimits,
    Part,
    Segment,
    check_assign_ids,
    check_header,
    decode_request,
    payload_bytes,
    split,
)
from shardps.server.node.plan import Planner, slices_of
from shardps.server.node.table import BlockTable, EpochGate
from shardps.shardmap import ShardMapView, TableView
from shardps.tables import Consistency

if TYPE_CHECKING:
    from shardps.server.node.replication import Forwarder
    from shardps.server.node.steps import SyncSteps



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


def forget_departed_writers(view: ShardMapView, held: list[tuple[BlockKey, AnyBlock]]) -> None:
    """Drop exactly-once records of writers no longer in their job's group under ``view``
    (they can never retry). Takes each block's lock; nothing held on entry."""
    for job, g in view.groups.items():
        writers = g.writers
        for key, blk in held:
            if key[0] == job:
                with blk.lock:
                    blk.forget_writers(writers)


class JobHolds:
    """Jobs whose new pushes are held (for a checkpoint). Thread-safe."""

    def __init__(self, gate: EpochGate, clock=time.monotonic):
        self._gate = gate
        self._now = clock
        self._holds: dict[str, float] = {}                     # job -> hold deadline
        self._cond = threading.Condition()

    def hold(self, job: str, hold: bool, seconds: float = 30.0) -> None:
        """Hold (or release) new pushes of ``job``; a hold expires after ``seconds``. A hold
        returns once pushes already inside finished (it takes the gate exclusive)."""
        with self._cond:
            if hold:
                self._holds[job] = self._now() + seconds
            else:
                self._holds.pop(job, None)
            self._cond.notify_all()
        if hold:   # wait for pushes already inside to finish
            with self._gate.exclusive():
                pass

    def holding(self, job: str) -> bool:
        """Whether ``job`` has a hold (perhaps an expired one ``wait_unheld`` has not dropped
        yet): a cheap test for the compiled path, which leaves held jobs to the general one."""
        return job in self._holds

    def wait_unheld(self, job: str, deadline: float | None) -> None:
        """Block while ``job`` is held; Unavailable once ``deadline`` passes first."""
        with self._cond:
            while True:
                until = self._holds.get(job)
                now = self._now()
                if until is None or until <= now:
                    self._holds.pop(job, None)
                    return
                wait = until - now
                if deadline is not None:
                    if deadline <= now:
                        raise Unavailable(f"job {job!r} is held for a checkpoint: retry")
                    wait = min(wait, deadline - now)
                self._cond.wait(timeout=wait)


class PushApplier:
    """Applies pushes to this node's blocks and, through the forwarder, to their backups.
    Thread-safe: a push holds the gate shared and its blocks' locks (sorted by key)."""

    def __init__(self, table: BlockTable, planner: Planner, steps: "SyncSteps", forwarder: "Forwarder",
                 holds: JobHolds, limits: NodeLimits, metrics: NodeMetrics, clock=time.monotonic):
        self.table = table
        self.planner = planner
        self.steps = steps
        self.forwarder = forwarder
        self.holds = holds
        self.limits = limits
        self.metrics = metrics
        self._now = clock

    def push(self, request: PushRequest, deadline: float | None = None) -> PushAck:
        """Apply a push (gradients, or initial values) to this node's blocks and their backups.

        Blocks while the job is held for a checkpoint and while backups apply the forwarded
        operations. Raises InvalidArgument / NotFound / StaleEpoch / Unavailable /
        ResourceExhausted / FailedPrecondition; a raised error means nothing was
        acknowledged (a retry is safe). Nothing held on entry.
        """
        header, kind = request.header, request.kind
        if kind not in (GRADIENT, INITIALIZE, ASSIGN, PUSH_KIND_UNSPECIFIED):
            raise InvalidArgument(f"push kind {kind}: unknown (use GRADIENT, INITIALIZE or ASSIGN)")
        kind = kind or GRADIENT
        self.holds.wait_unheld(header.job, deadline)
        writer = Writer(header.session, int(header.incarnation), int(header.sequence),
                        int(header.acked_below))
        started = self._now()
        check_header(header)
        if header.session and kind == GRADIENT and header.clock:
            self.steps.reached(header.job, header.session, int(header.clock))   # SYNC only
        table = self.table
        with table.gate.shared():
            t0 = time.perf_counter()        # phases: shardps_server_phase_seconds
            table.check_epoch(header)
            self.check_writer(header)
            parsed = decode_request(table.view, table.name, self.limits, request, with_values=True)
            if kind == ASSIGN:
                check_assign_ids(parsed)        # before anything changes
            if kind == GRADIENT and not (header.session and header.sequence):
                raise InvalidArgument(
                    f"a GRADIENT push of job {header.job!r} without a session and a sequence number "
                    f"(session={header.session!r}, sequence={header.sequence}) cannot be deduplicated "
                    f"when it is retried: open a session with JoinWorkerGroup (as a member, or with "
                    f"client=true) and number the pushes from 1 (common.proto, RequestHeader)")
            group = table.view.groups.get(header.job)
            sync = group is not None and group.consistency is Consistency.SYNC and kind == GRADIENT
            member = sync and table.member(header)
            plan = self._plan(header, kind, parsed, group, member)
            t1 = time.perf_counter()
            if plan is None:
                ack = None
            elif member:
                self._adopt(header)
                ack = execute.accumulate(table, plan, header.job, writer, int(header.clock), self.steps,
                                         self.forwarder.forward_locked)
            else:
                ack = execute.apply(table, plan, writer, self.forwarder, self.updates_between)
            if plan is not None and ack is not None:
                timing = self._timing(started, plan.units[0].entry.optimizer, t0, t1)
            else:
                ack, timing = self._push_parts(header, kind, writer, parsed, sync, started, t0)
        self.metrics.observe_part("push", sum(s.ids.shape[0] for s in parsed if s.ids is not None),
                                  payload_bytes(request, parsed), *timing)
        if header.session and kind == GRADIENT:
            clock = self.steps.clocks.get(header.job)
            if clock is not None:
                clock.report(header.session, int(header.clock), int(header.sequence))
                if sync:
                    self.steps.apply_ready(header.job)
        return ack

    def _plan(self, header: Header, kind: int, parsed: list[Segment], group, member: bool):
        """The plan of a push's gradients (gate held shared; the request checked), or None for
        the per-block engine: another kind, a quota, an SSP job's push, a SYNC job's push
        that is not a member's (refused there), or a part no plan covers."""
        if kind != GRADIENT or not parsed:
            return None
        mode = Consistency.SYNC if member else Consistency.ASYNC
        if group is not None and (group.quota_bytes or group.consistency is not mode):
            return None
        slices = slices_of(parsed, pull=False)
        return None if slices is None else self.planner.push(header.job, header.epoch, slices)

    def _timing(self, started: float, optimizer: str, t0: float, t1: float) -> tuple:
        """A push's phases, optimizer and update seconds (``NodeMetrics.observe_part``)."""
        return (("decode", t1 - t0), ("optimizer", time.perf_counter() - t1)), optimizer, self._now() - started

    def updates_between(self, key: BlockKey, updates: int) -> None:
        labelled(self.metrics.updates_between, key[0]).observe(max(0, updates))

    def _push_parts(self, header: Header, kind: int, writer: Writer, parsed: list[Segment],
                    sync: bool, started: float, t0: float) -> tuple[PushAck, tuple]:
        """The general path of ``push`` (gate held shared): split into per-block parts,
        SYNC admission (``sync``: a GRADIENT push of a SYNC job), ``apply_parts``; the ack
        and its timing (``_timing``; none for a push of no parts)."""
        table = self.table
        parts = split(table.name, table.view.epoch, header, parsed, True, table.loaded)
        t1 = time.perf_counter()
        if sync and parts and not table.member(header):
            raise FailedPrecondition(
                f"job {header.job!r} is SYNC: its pushes are applied as steps of its worker "
                f"group, and session {header.session!r} is not a member under epoch "
                f"{table.view.epoch}: join the group (PSClient.join) before pushing")
        if sync and table.member(header):
            self._adopt(header)
        ack = self.apply_parts(parts, kind, writer, sync, int(header.clock), parsed)
        if parts:
            return ack, self._timing(started, parts[0].table.config.optimizer.kind.name, t0, t1)
        return ack, ()

    def _adopt(self, header: Header) -> None:
        """A SYNC member's push of step ``header.clock``: the clock learns the group's step
        (``JobClock.adopt``), or FailedPrecondition for a step further ahead than any real
        worker's: a SYNC worker pushes step t only after pulling step t, which waited for
        step t - 1."""
        clock = self.steps.clocks.get(header.job)
        if clock is not None and not clock.adopt(int(header.clock), pushing=True):
            raise FailedPrecondition(
                f"SYNC push for step {header.clock} while this server has applied "
                f"{clock.applied_steps} steps: a worker pushes step t after pulling it")

    def check_writer(self, header: Header) -> None:
        """A session's pushes are accepted only from its current incarnation: an older one
        gets FailedPrecondition (it is fenced). Gate held shared."""
        if not header.session:
            return
        group = self.table.view.groups.get(header.job)
        if group is None:
            return
        for m in group.members + group.clients:
            if m.session == header.session:
                if m.incarnation != header.incarnation:
                    raise FailedPrecondition(
                        f"session {header.session} incarnation {header.incarnation} is fenced: "
                        f"the group's current incarnation is {m.incarnation}")
                return
        # not (or no longer) a member under this map: accept; the block record still dedups

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
