"""The push path: admission (holds, fencing, membership), then a plan (``plan.Planner``)
executed and committed (``execute``), or, for what no plan serves, the per-block engine
(``engine.BlockEngine``: exactly-once per block, quotas, lifecycle tables, every error).

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
from typing import TYPE_CHECKING

from shardps.errors import FailedPrecondition, InvalidArgument, Unavailable
from shardps.messages import (
    ASSIGN,
    GRADIENT,
    INITIALIZE,
    PUSH_KIND_UNSPECIFIED,
    Header,
    PushAck,
    PushRequest,
)
from shardps.metrics import NodeMetrics, labelled
from shardps.server.node import execute
from shardps.server.node.blocks import AnyBlock, BlockKey, Writer
from shardps.server.node.decode import (
    NodeLimits,
    Segment,
    check_assign_ids,
    check_header,
    decode_request,
    payload_bytes,
    split,
)
from shardps.server.node.engine import BlockEngine
from shardps.server.node.plan import Planner, slices_of
from shardps.server.node.table import BlockTable, EpochGate
from shardps.shardmap import ShardMapView
from shardps.tables import Consistency

if TYPE_CHECKING:
    from shardps.server.node.replication import Forwarder
    from shardps.server.node.steps import SyncSteps



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
        self.engine = BlockEngine(table, steps, forwarder, metrics, clock)

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
            # a Step's slices are planned first, as they are: a plan admits only what the
            # checks pass (``_unchecked``); the checks and their errors run where it does not
            parsed = None if self._unchecked(request, kind) else self._decode(request, kind)
            if kind == GRADIENT and not (header.session and header.sequence):
                raise InvalidArgument(
                    f"a GRADIENT push of job {header.job!r} without a session and a sequence number "
                    f"(session={header.session!r}, sequence={header.sequence}) cannot be deduplicated "
                    f"when it is retried: open a session with JoinWorkerGroup (as a member, or with "
                    f"client=true) and number the pushes from 1 (common.proto, RequestHeader)")
            group = table.view.groups.get(header.job)
            sync = group is not None and group.consistency is Consistency.SYNC and kind == GRADIENT
            member = sync and table.member(header)
            plan = self._plan(header, kind, request.slices if parsed is None else slices_of(parsed, pull=False),
                              group, member)
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
                rows, nbytes = plan.rows, plan.nbytes
            else:
                if parsed is None:
                    parsed = self._decode(request, kind)
                ack, timing = self._push_parts(header, kind, writer, parsed, sync, started, t0)
                rows = sum(s.ids.shape[0] for s in parsed if s.ids is not None)
                nbytes = payload_bytes(request, parsed)
        self.metrics.observe_part("push", rows, nbytes, *timing)
        if header.session and kind == GRADIENT:
            clock = self.steps.clocks.get(header.job)
            if clock is not None:
                clock.report(header.session, int(header.clock), int(header.sequence))
                if sync:
                    self.steps.apply_ready(header.job)
        return ack

    def _unchecked(self, request: PushRequest, kind: int) -> bool:
        """Whether a push may be planned before its checks run: a Step's gradients (its
        slices bound) within the limit a plan does not check itself (segments), in float32.
        A plan admits nothing the checks refuse (tables, ranges, ids' bounds and rows,
        values' counts, finiteness), so the checks are left to a push no plan serves."""
        slices = request.slices
        return (slices is not None and kind == GRADIENT and request.header.wire_dtype <= 1
                and len(slices) <= self.limits.max_segments)

    def _decode(self, request: PushRequest, kind: int) -> list[Segment]:
        """The push's segments, checked (every refusal is raised here)."""
        parsed = decode_request(self.table.view, self.table.name, self.limits, request, with_values=True)
        if kind == ASSIGN:
            check_assign_ids(parsed)        # before anything changes
        return parsed

    def _plan(self, header: Header, kind: int, slices: list | None, group, member: bool):
        """The plan of a push's gradients (gate held shared), or None for the per-block
        engine: another kind, a quota, an SSP job's push, a SYNC job's push that is not a
        member's (refused there), or a part no plan covers (``Planner.push``)."""
        if kind != GRADIENT or not slices:
            return None
        mode = Consistency.SYNC if member else Consistency.ASYNC
        if group is not None and (group.quota_bytes or group.consistency is not mode):
            return None
        return self.planner.push(header.job, header.epoch, slices)

    def _timing(self, started: float, optimizer: str, t0: float, t1: float) -> tuple:
        """A push's phases, optimizer and update seconds (``NodeMetrics.observe_part``)."""
        return (("decode", t1 - t0), ("optimizer", time.perf_counter() - t1)), optimizer, self._now() - started

    def updates_between(self, key: BlockKey, updates: int) -> None:
        labelled(self.metrics.updates_between, key[0]).observe(max(0, updates))

    def _push_parts(self, header: Header, kind: int, writer: Writer, parsed: list[Segment],
                    sync: bool, started: float, t0: float) -> tuple[PushAck, tuple]:
        """The general path of ``push`` (gate held shared): split into per-block parts,
        SYNC admission (``sync``: a GRADIENT push of a SYNC job), ``BlockEngine.apply_parts``; the ack
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
        ack = self.engine.apply_parts(parts, kind, writer, sync, int(header.clock), parsed)
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
