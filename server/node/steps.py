"""SYNC (BSP) steps on one node, on top of ``server.clocks.JobClock``.

A SYNC job's pushes are not applied when they arrive: each block accumulates them per step
(``accumulate``), and once every live worker of the job's group completed step ``t``,
``apply_ready`` applies the step on every block this node is primary of as the mean over
the workers that completed it (the sum divided by their number: the live ones, and any that
completed it and then left) and forwards it to the backups.

A push for a step that was already applied is refused (``check_step_open``), never kept:
a push is either part of its step or refused.

``SyncSteps`` owns the job clocks (``clocks``, one ``JobClock`` per group, for every
consistency mode), one apply lock per job, and ``pending`` (the blocks with accumulated
gradients, per job, guarded by ``BlockTable.lock``). Thread-safe; see table.py for the
lock order.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import numpy as np

from shardps.blockops import APPLY_STEP, BlockOp
from shardps.errors import FailedPrecondition, Unavailable
from shardps.server.node import storage_kernels
from shardps.server.node.blocks import AnyBlock, BlockKey, DenseBlock, SparseBlock
from shardps.server.node.clocks import JobClock
from shardps.server.node.replication import Forwarder, Op
from shardps.server.node.table import BlockTable
from shardps.shardmap import ShardMapView, TableView
from shardps.tables import Consistency

log = logging.getLogger("shardps.server")


class SyncSteps:
    """Job clocks and SYNC step application of one node."""

    def __init__(self, table: BlockTable, forwarder: Forwarder, clock=time.monotonic, defect: str = ""):
        self.table = table
        # TEST-ONLY (tools/verify/defects.py): "2" re-introduces defect 2 of issue 13 (a SYNC push
        # for an applied step acknowledged into that step, which is never applied again) so the
        # verifier's tests can show they catch it
        self.defect = defect
        self.forwarder = forwarder
        self._now = clock
        self.clocks: dict[str, JobClock] = {}
        self.apply_locks: dict[str, threading.Lock] = {}
        self.pending: dict[str, set[BlockKey]] = {}           # blocks with pending steps
        # job -> (closed steps, block table generation) when apply_ready last looked at every
        # pending block: until either changes, no primary block can hold a closed step
        self._looked: dict[str, tuple[int, int]] = {}

    def clear_locked(self) -> None:
        """Forget every clock (a new incarnation). ``table.lock`` held."""
        for d in (self.clocks, self.pending, self.apply_locks, self._looked):
            d.clear()

    def set_groups_locked(self, view: ShardMapView) -> None:
        """Follow ``view``'s worker groups: a clock per group, members as listed. Called by
        ``BlockTable.install`` under ``table.lock``."""
        for job, g in view.groups.items():
            clock = self.clocks.get(job)
            if clock is None:
                clock = self.clocks[job] = JobClock(g.consistency, g.staleness, self._now)
                self.apply_locks[job] = threading.Lock()
            clock.set_members({m.session for m in g.members}, g.consistency, g.staleness,
                              {m.session: m.rank for m in g.members})
        for job in [j for j in self.clocks if j not in view.groups]:
            del self.clocks[job]

    # ------------------------------------------------------------------ pushes
    def check_step_open(self, job: str, step: int, blocks: list[AnyBlock], writer) -> int:
        """SYNC: the step a push is accumulated in (block locks held); FailedPrecondition for
        a push of a step already applied here.

        One exception: a piece of a push whose other pieces already reported that step here
        (the same session and sequence number: a piece refused elsewhere by a block move and
        re-routed here) goes into the step now open: applied one step late, never lost.

        The blocks are registered as pending *before* the check, so a step that closes after
        the check still finds them (``apply_ready`` closes a step, then collects the pending
        blocks, then takes their locks): a push is either part of a step or refused. A refused
        push leaves at most a registration without data, which the next step drops.
        """
        with self.table.lock:
            self.pending.setdefault(job, set()).update(b.key for b in blocks)
        clock = self.clocks.get(job)
        if clock is None or step >= clock.closed_below:
            return step
        if clock.reported_by(writer.session, step, writer.sequence):
            return clock.closed_below
        if self.defect == "2":
            return step
        raise FailedPrecondition(
            f"SYNC step {step} of job {job!r} was already applied on server {self.table.name} "
            f"({clock.closed_below} steps applied) without this push; nothing was applied: "
            f"push each step once, for the step after the last one pulled (PSClient keeps "
            f"the step when a loop uses client.step() / next_step())")

    def accumulate(self, blk: AnyBlock, step: int, arrays, lo: int, hi: int) -> None:
        """SYNC: add a gradient to the block's pending sum of ``step`` (a copy is kept).
        Block lock held."""
        if isinstance(blk, DenseBlock):
            blk.accumulate(step, (lo, hi, np.array(arrays[0], dtype=np.float32)))
        else:
            blk.accumulate(step, (np.array(arrays[0], dtype=np.int64),
                                  np.array(arrays[1], dtype=np.float32).reshape(-1, blk.dim)))
        blk.version += 1
        self.track_locked(blk)

    def track_locked(self, blk: AnyBlock) -> None:
        """``blk`` holds accumulated gradients (an accumulate, or a whole copy loaded with
        them): ``apply_ready`` looks at it. Block lock held."""
        with self.table.lock:
            self.pending.setdefault(blk.key[0], set()).add(blk.key)

    # ------------------------------------------------------------------ steps
    def reached(self, job: str, session: str, step: int, pulling: bool = False) -> None:
        """SYNC: member ``session`` pulls (``pulling``) or pushes ``step``, so it completed
        ``step`` steps: a worker pulls and pushes step t only after its pushes and report of
        step t - 1 were acknowledged, and that report may have gone to the servers of an
        older map, without this one (or been lost with a paused connection). Counts that
        report; a pull also lets a clock that knew nothing learn the group's step
        (``JobClock.adopt``; a push adopts under the gate, in ``PushApplier.push``). What
        either completes is applied now (held steps included: see ``apply_ready``), before
        the pull waits or the push is checked against the clock. Nothing held on entry."""
        clock = self.clocks.get(job)
        if clock is None or clock.mode is not Consistency.SYNC:
            return
        before = clock.applied_steps
        if pulling:
            clock.adopt(step, pushing=False)
        rose = step > 0 and clock.report(session, step - 1)
        if rose or clock.applied_steps > before:
            self.apply_ready(job)

    def apply_all_ready(self) -> None:
        """``apply_ready`` for every job (after a map install). Nothing held on entry."""
        for job in list(self.clocks):
            self.apply_ready(job)

    def apply_ready(self, job: str) -> None:
        """Apply every SYNC step all live workers completed (the mean over the workers that
        completed it: ``JobClock.workers_of``), and
        forward each to the backups. A backup that misses a step is marked for a resync
        (logged, not raised). Nothing held on entry; takes the job's apply lock, then the
        gate shared, then the blocks' locks."""
        clock = self.clocks.get(job)
        lock = self.apply_locks.get(job)
        if clock is None or lock is None or clock.mode is not Consistency.SYNC:
            return
        with lock:
            ready = clock.steps_to_apply()
            clock.close(ready.stop)      # before collecting: see check_step_open
            closed = clock.closed_below
            looked = (closed, self.table.generation)
            if not len(ready) and self._looked.get(job) == looked:
                return                   # no step closed, no block loaded or moved since
            with self.table.lock:
                keys = list(self.pending.get(job, set()))
            with_data: set[int] = set()
            held, is_primary, applying = self.table.blocks, self.table.is_primary, self.defect != "2"
            for k in keys:
                blk = held.get(k)
                if blk is None:
                    continue
                with blk.lock:
                    pending = blk.pending
                    if not pending:
                        with self.table.lock:
                            self.pending.get(job, set()).discard(k)
                    elif is_primary(k):
                        # every closed step a primary block holds: the ready ones, and any
                        # it holds from when this node was its backup or a move's destination
                        # (it closed the step when every worker reported it and left the
                        # applying to the primary, whose APPLY_STEP never arrived: it died, or
                        # the block changed hands as it applied), or from before a fresh clock
                        # learnt a later step (JobClock.adopt)
                        for st in pending:
                            if st < closed and (applying or st in ready):
                                with_data.add(st)
            for step in sorted(with_data):      # steps nobody pushed data for need no work here
                divisor = max(1, clock.workers_of(step))
                with self.table.gate.shared(), contextlib.ExitStack() as stack:
                    with self.table.lock:
                        keys = sorted(self.pending.get(job, set()))
                    touched: list[AnyBlock] = []
                    due: list[AnyBlock] = []
                    for key in keys:
                        blk = self.table.blocks.get(key)
                        if blk is None or not self.table.is_primary(key):
                            continue
                        stack.enter_context(blk.lock)
                        touched.append(blk)
                        if step in blk.pending:
                            due.append(blk)
                    ops: list[Op] = []
                    has_backups = self.table.has_backups
                    for t, blocks in self._by_table(due):
                        self.apply_step_locked(blocks, t, step, divisor)
                        for blk in blocks:          # an APPLY_STEP for each block with backups
                            if has_backups(blk.key):
                                ops.append((blk.key, BlockOp(blk.key[0], blk.key[1], blk.key[2], APPLY_STEP,
                                                             version=blk.version, config_version=t.config.version,
                                                             step=step, divisor=divisor), []))
                    try:
                        self.forwarder.forward_locked(ops, touched)
                    except Unavailable as exc:
                        log.warning("step %d of job %s applied; a backup missed it (%s): it "
                                    "will be resynced", step, job, exc.message)
                clock.mark_applied(step)
            if len(ready):
                clock.skip_to(ready.stop)
            self._looked[job] = looked

    def _by_table(self, blocks: list[AnyBlock]) -> list[tuple[TableView, list[AnyBlock]]]:
        """``blocks`` (in key order) by table, each table's in one list where one call applies
        them (``apply_step_locked``: sparse blocks without lifecycle policies), else one list
        per block."""
        groups: list[tuple[TableView, list[AnyBlock]]] = []
        for blk in blocks:
            t = self.table.view.tables[(blk.key[0], blk.key[1])]
            if groups and groups[-1][0] is t and _table_at_once(blk, t):
                groups[-1][1].append(blk)
            else:
                groups.append((t, [blk]))
        return groups

    def apply_step_locked(self, blocks: list[AnyBlock], t: TableView, step: int, divisor: int) -> None:
        """Apply the accumulated gradients of ``step`` of ``blocks`` (one dense block, or sparse
        blocks of table ``t``) divided by ``divisor`` (the workers of the step). Block locks held; a
        primary applies a table's blocks in one call, a backup each block as its APPLY_STEP
        arrives, with the same results: each row's gradients are summed in the order they
        were accumulated (``storage_kernels.sum_rows``) and rows update independently."""
        parts = [p for blk in blocks for p in blk.pending.pop(step, [])]
        blk = blocks[0]
        if isinstance(blk, DenseBlock):
            total = np.zeros(blk.size, dtype=np.float32)
            for lo, hi, g in parts:
                total[lo - blk.start:hi - blk.start] += g
            total /= np.float32(divisor)
            blk.apply_gradient(t.config, blk.start, blk.stop, total)
        elif len(blocks) > 1:
            assert isinstance(blk, SparseBlock)
            if parts:
                ids, grads = self._summed(parts, divisor)
                with blk.table_rows.lock:
                    blk.table_rows.apply_rows(t.config, ids, grads)
            for b in blocks:
                b.version += 1
        elif parts:
            blk.apply_gradient(t.config, *self._summed(parts, divisor))
        else:
            blk.version += 1
        for b in blocks:
            if not b.pending:
                with self.table.lock:
                    self.pending.get(b.key[0], set()).discard(b.key)

    @staticmethod
    def _summed(parts: list, divisor: int) -> tuple[np.ndarray, np.ndarray]:
        """(distinct ids, mean gradient rows) of sparse parts ``(ids, rows)``."""
        ids, grads = storage_kernels.sum_rows(np.concatenate([p[0] for p in parts]),
                                              np.concatenate([p[1] for p in parts]))
        grads /= np.float32(divisor)
        return ids, grads


def _table_at_once(blk: AnyBlock, t: TableView) -> bool:
    """Whether ``blk``'s step may be applied with its table's other blocks in one call: a
    sparse block whose rows keep no lifecycle state (lifecycle decisions are made per
    block, on its clock)."""
    return (isinstance(blk, SparseBlock) and blk.table_rows.life is None
            and not t.config.lifecycle.enabled)
