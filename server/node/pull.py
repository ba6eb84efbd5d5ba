"""The read path: ``PullReader.pull`` reads values of this node's primary blocks.

Contract: only a block's primary serves it (fencing as in decode.check_owned); a pull sees
every acknowledged push (linearizable per block, since backups are never read). SYNC and
SSP jobs first wait for their consistency condition (``JobClock.wait_for_pull``),
outside the gate, then read under it; a pull whose map changed while it waited is decoded
again. The response is bounded by ``NodeLimits.max_response_bytes`` (ResourceExhausted).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, cast

import numpy as np

from shardps import dtypes
from shardps.dtypes import WireDType
from shardps.errors import ResourceExhausted
from shardps.messages import Header, Layout, PullReply, PullRequest, Versions, versions_by_table
from shardps.metrics import NodeMetrics
from shardps.server.node import execute
from shardps.server.node.blocks import BlockKey, BlockLocks, DenseBlock, SparseBlock
from shardps.server.node.decode import NodeLimits, Segment, check_header, decode_request, sparse_blocks, split
from shardps.server.node.plan import Planner, slices_of
from shardps.server.node.table import BlockTable
from shardps.tables import Consistency

if TYPE_CHECKING:
    from shardps.server.node.steps import SyncSteps


class PullReader:
    """Serves pulls. Thread-safe: a pull holds the gate shared and its blocks' locks (a
    sparse segment's blocks at once, sorted by key); nothing held on entry."""

    def __init__(self, table: BlockTable, planner: Planner, steps: "SyncSteps", limits: NodeLimits,
                 metrics: NodeMetrics, clock=time.monotonic):
        self.table = table
        self.planner = planner
        self.steps = steps
        self.limits = limits
        self.metrics = metrics
        self._now = clock

    def pull(self, request: PullRequest, deadline: float | None = None,
             out_buffer=None) -> tuple[PullReply, list[np.ndarray]]:
        """Read values; returns the reply and the wire-encoded arrays, in segment order.

        ``out_buffer`` (a writable buffer, e.g. a shared-memory region): float32 values are
        written straight into it (``header.in_shared_memory`` is then set and the returned
        list is empty); other cases return the arrays as usual.

        SYNC / SSP groups: first waits (up to ``deadline``) for the consistency condition.
        Raises InvalidArgument / NotFound / StaleEpoch / Unavailable / ResourceExhausted, and
        DeadlineExceeded if the wait outlasts ``deadline``. Nothing held on entry.
        """
        started = time.perf_counter()       # phases: shardps_server_phase_seconds
        header = request.header
        header_out = PullReply()
        table = self.table
        check_header(header)
        with table.gate.shared():          # a malformed pull is refused before it waits
            table.check_epoch(header)
            parsed = decode_request(table.view, table.name, self.limits, request, with_values=False)
            parsed_under = table.view
        decoding = time.perf_counter() - started
        clock = self.steps.clocks.get(header.job)
        if clock is not None and table.member(header):
            waited = self._now()
            if clock.mode is Consistency.SYNC:
                self.steps.reached(header.job, header.session, int(header.clock), pulling=True)
            staleness = clock.wait_for_pull(int(header.clock), deadline)
            header_out.waited_seconds = self._now() - waited
            if clock.mode is not Consistency.ASYNC:
                self.metrics.staleness.labels(header.job).observe(staleness)
            header_out.min_clock = clock.min_completed() if clock.mode is not Consistency.SYNC \
                else clock.applied_steps
        elif clock is not None:
            header_out.min_clock = clock.applied_steps if clock.mode is Consistency.SYNC \
                else clock.min_completed()
        outputs: list[np.ndarray] = []
        with table.gate.shared():
            t0 = time.perf_counter()
            table.check_epoch(header)
            if table.view is not parsed_under:      # a new map came in while the pull waited
                parsed = decode_request(table.view, table.name, self.limits, request, with_values=False)
            # (cast: a sparse segment carries its ids)
            out_bytes = sum(((s.hi - s.lo) if s.dense else cast(np.ndarray, s.ids).shape[0] * s.table.spec.dim)
                            * s.dtype.itemsize for s in parsed if not s.all_stored)
            if out_bytes > self.limits.max_response_bytes:
                raise ResourceExhausted(
                    f"pull would return {out_bytes} bytes; the limit max_response_bytes is "
                    f"{self.limits.max_response_bytes}: pull smaller ranges")
            t1 = time.perf_counter()
            in_place = out_buffer is not None and out_bytes <= len(out_buffer)
            planned = self._read_planned(header, parsed, request.slices, header_out, out_buffer if in_place else None)
            t2 = time.perf_counter()
            if planned is not None and in_place:       # written straight into the buffer
                header_out.in_shared_memory = True
                header_out.payload_bytes = out_bytes
            elif planned is not None:
                outputs = planned
            else:
                t1, t2 = self._read_parts(header, parsed, header_out, outputs, out_buffer, out_bytes)
            t3 = time.perf_counter()
        nbytes = sum(a.nbytes for a in outputs) if outputs else int(header_out.payload_bytes)
        header_out.payload_bytes = nbytes
        self.metrics.observe_part("pull", sum(s.ids.shape[0] for s in parsed if s.ids is not None), nbytes,
                                  (("decode", decoding + t1 - t0), ("lookup", t2 - t1), ("encode", t3 - t2)))
        return header_out, outputs

    def _read_planned(self, header: Header, parsed: list[Segment], request_slices, reply: PullReply,
                      out) -> list | None:
        """The values of a pull a plan covers (gate held shared, consistency wait done), or
        None (nothing read; ``reply`` unchanged): ``execute.read``. ``request_slices``: a
        Step's (checked as ``parsed``), planned as they are."""
        slices = request_slices if request_slices is not None else slices_of(parsed, pull=True)
        plan = None if slices is None else self.planner.pull(header.job, header.epoch, slices)
        return None if plan is None else execute.read(self.table, plan, reply, out)

    def _read_parts(self, header: Header, parsed: list[Segment], header_out: PullReply, outputs: list,
                    out_buffer, out_bytes: int) -> tuple[float, float]:
        """The general read (gate held shared): block by block, exports, other wire dtypes,
        replies written into ``out_buffer``. Fills ``outputs`` and ``header_out``; returns
        when its lookup phase started and ended (the phase metrics)."""
        table = self.table
        parts = split(table.name, table.view.epoch, header, parsed, False, table.loaded, sparse=False)
        sparse_blocks_of = {i: sparse_blocks(table.name, table.view.epoch, header, s, table.loaded)
                            for i, s in enumerate(parsed) if not s.dense and not s.all_stored}
        t1 = time.perf_counter()
        in_place = (out_buffer is not None and out_bytes <= len(out_buffer)
                    and all(not s.all_stored and s.dtype is WireDType.FLOAT32 for s in parsed))
        values: list = []      # per segment: its rows, or None for an all_stored one
        pos = 0
        for s in parsed:
            if s.all_stored:
                values.append(None)
                continue
            shape = (s.hi - s.lo,) if s.dense else (cast(np.ndarray, s.ids).shape[0], s.table.spec.dim)
            if in_place:
                n = int(np.prod(shape))
                values.append(np.frombuffer(out_buffer, dtype="<f4", count=n, offset=pos).reshape(shape))
                pos += 4 * n
            else:
                values.append(np.empty(shape, dtype=np.float32))
        stored: dict[int, list] = {i: [] for i, s in enumerate(parsed) if s.all_stored}
        versions: dict[BlockKey, int] = {}          # of dense and exported blocks
        sparse_versions: list[Versions] = []
        for part in parts:
            s, out = parsed[part.segment], values[part.segment]
            blk = table.blocks[part.key]
            with blk.lock:
                if s.dense:
                    cast(DenseBlock, blk).read(part.lo, part.hi, out=out[part.lo - s.lo:part.hi - s.lo])
                else:
                    meta, arrays = blk.snapshot()
                    stored[part.segment].append((arrays["ids"], arrays["values"]))
                    if "cold.ids" in arrays:        # and the rows of its cold tier
                        stored[part.segment].append((arrays["cold.ids"], arrays["cold.values"]))
                versions[part.key] = blk.version
        for seg_index, block_indexes in sparse_blocks_of.items():
            # one vectorised read of every block of the segment, consistent across them
            t = parsed[seg_index].table
            held, job, name = table.blocks, t.job, t.name
            blks = [held[(job, name, b)] for b in block_indexes.tolist()]
            if not blks:
                continue
            with BlockLocks(blks):
                s = parsed[seg_index]
                table_rows = cast(SparseBlock, blks[0]).table_rows
                assert s.ids is not None            # a sparse segment carries its ids
                with table_rows.lock:
                    table_rows.read(s.ids, out=values[seg_index])
                sparse_versions.append(Versions(name, block_indexes, [blk.version for blk in blks]))
        t2 = time.perf_counter()
        for i, (s, out) in enumerate(zip(parsed, values)):
            if s.all_stored:
                got = stored[i]
                ids = np.concatenate([g[0] for g in got]) if got else np.empty(0, np.int64)
                rows = (np.concatenate([g[1] for g in got]) if got
                        else np.empty((0, s.table.spec.dim), np.float32))
                outputs.append(ids.astype("<i8"))
                outputs.append(dtypes.encode(rows, s.dtype))
                header_out.segments.append(Layout(s.dtype.value, rows.size, ids.shape[0]))
                continue
            if not in_place:
                outputs.append(dtypes.encode(out, s.dtype))
            header_out.segments.append(Layout(s.dtype.value, out.size))
        if in_place:
            header_out.in_shared_memory = True
            header_out.payload_bytes = out_bytes
        header_out.versions = versions_by_table((key[1], key[2], v) for key, v in sorted(versions.items())) \
            + sparse_versions
        return t1, t2
