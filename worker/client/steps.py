"""The client's side of the compiled request path: a push and/or a pull as one Step frame per
server, every frame sent before any reply is read, the rows going straight from the caller's
arrays into the frames (or the shared-memory region) and from the replies into the caller's
outputs.

``StepCalls.run`` makes one attempt; it answers False when the call must go the general
way (``data.DataPath``'s ``Fanout``): a server that takes no Step frames, or a refusal the
general path knows how to retry (StaleEpoch, Unavailable, a deadline of one attempt). A
push keeps its sequence number there, so what some servers applied here is not applied
twice.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import numpy as np

from shardps import kernels
from shardps.errors import DeadlineExceeded, Unavailable
from shardps.messages import PullReply, PushAck
from shardps.metrics import WorkerMetrics
from shardps.rpc.step import Encoded
from shardps.shardmap import ShardMapView
from shardps.worker.client.fanout import RETRYABLE, MapSource, attempt_timeout
from shardps.worker.client.results import BlockVersions, PullResult, PushResult, take_pull_reply
from shardps.worker.routing import Piece, live_servers, route_parts

if TYPE_CHECKING:
    from shardps.worker.client.transport import Transport


class StepCalls:
    """Step frames for one job's data calls. Thread-safe (no state between calls but the
    versions seen at pulls, single-key dict writes). ``versions`` is the data path's (block
    versions seen at pulls: dense pushes send them as base versions); ``header(view, seq,
    clock)`` makes a request header; ``float32``: the data path's wire dtype is float32
    (Step frames carry nothing else)."""

    def __init__(self, job: str, transport: "Transport", maps: MapSource, metrics: WorkerMetrics,
                 versions: dict[tuple[str, int], int], header, float32: bool = True):
        self.enabled = float32 and kernels.AVAILABLE          # the frames carry float32
        self.job = job
        self.transport = transport
        self.maps = maps
        self.metrics = metrics
        self.versions = versions
        self.header = header

    def take(self, pieces: list[Piece]) -> bool:
        """Whether Step frames may carry ``pieces``: float32 on the wire and no export pull
        (the servers' support is asked per call, in ``run``)."""
        return self.enabled and not any(map(_ALL_STORED, pieces))

    def run(self, push: list[Piece] | None, kind: int, pull: list[Piece] | None, outputs: list | None,
            deadline: float, seq: int = 0, clock: int = 0, pull_clock: int = 0, report: bool = False
            ) -> tuple[PushResult | None, PullResult | None] | None:
        """One attempt of a push (``push``: its pieces, of ``kind``, sequence ``seq``, step
        ``clock``) and/or a pull (``pull``, into ``outputs``, step ``pull_clock``): their
        results, or None when the caller must send it the general way (see the module
        docstring). ``report``: the push also reports step ``clock`` to every live server
        (SYNC / SSP), which it does when it reaches every one of them; else None before
        anything is sent (the general way reports to the others once the pieces landed).
        Other errors are raised, once every reply was read."""
        view = self.maps.view()
        job = self.job
        pushes = route_parts(view, job, push) if push is not None else {}
        if report and any(server not in pushes for server in live_servers(view)):
            return None
        pulls = route_parts(view, job, pull) if pull is not None else {}
        header = self.header(view, seq, clock)
        presult = PushResult(clock=clock) if push is not None else None
        lresult = PullResult(outputs or [], BlockVersions(), clock=pull_clock) if pull is not None else None
        begun: list = []
        declined = False
        moved = [0] * 6                 # pushed bytes, rows, sparse bytes; pulled bytes, rows, sparse bytes
        try:
            for server in sorted(pushes.keys() | pulls.keys()):
                pp, lp = pushes.get(server), pulls.get(server)
                encoded = Encoded(header, kind, pull_clock)
                if pp:
                    self._push(encoded, pp, view, moved)
                reply_bytes = self._pull(encoded, lp, view, moved) if lp else 0
                into = destination(lp, outputs, reply_bytes) if reply_bytes >= DIRECT_REPLY_BYTES else None
                sent = self.transport.step_start(server, view.address(server), encoded, reply_bytes,
                                                 attempt_timeout(deadline, reply_bytes), into)
                if sent is None:
                    declined = True
                    break
                begun.append((server, sent, lp))
        except RETRYABLE:
            declined = True
        failed: BaseException | None = None
        for server, sent, lp in begun:
            try:
                self.transport.step_finish(sent, _Reply(self, server, lp, presult, lresult, bool(header.session)))
            except RETRYABLE + (DeadlineExceeded,):
                declined = True
            except BaseException as exc:             # read the other replies first
                failed = failed or exc
        if failed is not None:
            raise failed
        if declined:
            return None
        self.metrics.moved(*moved)
        return presult, lresult

    def _push(self, encoded: Encoded, parts: list, view: ShardMapView, moved: list) -> None:
        """Lay out a server's routed push parts (``routing.route_parts``), their bytes and
        rows added to ``moved``; a dense range's base versions set."""
        for p, positions, a, z in parts:
            if p.dense:
                moved[0] += 4 * (z - a)
                encoded.push_range(p.table, a, z, p.values[a - p.start:z - p.start],
                                   base_versions(p, view, self.job, self.versions, a, z) or None)
                continue
            n = z - a
            sparse = (4 * p.values.shape[1] + 8) * n
            moved[0] += sparse
            moved[1] += n
            moved[2] += sparse
            encoded.push_rows(p.table, p.ids, positions, p.values)

    def _pull(self, encoded: Encoded, parts: list, view: ShardMapView, moved: list) -> int:
        """Lay out a server's routed pull parts; returns their values' bytes (also added to
        ``moved`` with the rows)."""
        nbytes = 0
        for p, positions, a, z in parts:
            if p.dense:
                nbytes += 4 * (z - a)
                encoded.pull_range(p.table, a, z)
                continue
            rows = 4 * (z - a) * view.table(self.job, p.table).spec.dim
            nbytes += rows
            moved[4] += z - a
            moved[5] += rows
            encoded.pull_rows(p.table, p.ids, positions)
        moved[3] += nbytes
        return nbytes

    def place(self, server: str, ack: PushAck, reply: PullReply, values: list, lp, presult, lresult,
              in_group: bool) -> None:
        """Take one server's Step reply: the ack's versions, the pull's values into place
        (``in_group``: the request's header had a session, see ``take_pull_reply``)."""
        if presult is not None:
            presult.versions.extend(ack.versions)
            presult.duplicate_blocks += ack.duplicate_blocks
        if lresult is None or lp is None:
            return
        if len(values) != len(lp):
            raise Unavailable(f"step reply from {server}: {len(values)} pulled segments for {len(lp)} asked")
        outputs = lresult.values
        for part, got in zip(lp, values):
            p, _, a, z = part
            out = outputs[p.item]
            n = z - a
            if p.dense and got.shape[0] != n:
                raise Unavailable(f"step reply from {server}: {got.shape[0]} values for a range of {n}")
            if not p.dense and got.shape[0] != n * out.shape[1]:
                raise Unavailable(f"step reply from {server}: {got.shape[0]} values for {n} rows of {out.shape[1]}")
            span, where = _span(part, out)
            if span is None:
                kernels.scatter_rows(out, where, got.reshape(n, out.shape[1]))
            elif len(lp) > 1 or got.__array_interface__["data"][0] != span.__array_interface__["data"][0]:
                span[...] = got.reshape(span.shape)     # unless received in place (``destination``)
        take_pull_reply(lresult, reply.min_clock, reply.waited_seconds, reply.versions, in_group,
                        {p.table for p, _, _, _ in lp if p.dense}, self.versions)


class _Reply:
    """``step_finish``'s consumer of one server's reply (``StepCalls.place``)."""

    __slots__ = ("calls", "server", "lp", "presult", "lresult", "in_group")

    def __init__(self, calls: StepCalls, server: str, lp, presult, lresult, in_group: bool):
        self.calls, self.server, self.lp, self.presult, self.lresult = calls, server, lp, presult, lresult
        self.in_group = in_group

    def __call__(self, ack: PushAck, reply: PullReply, values: list) -> None:
        self.calls.place(self.server, ack, reply, values, self.lp, self.presult, self.lresult, self.in_group)


def base_versions(p: Piece, view: ShardMapView, job: str, versions: dict[tuple[str, int], int],
                  start: int | None = None, stop: int | None = None) -> dict[int, int]:
    """The versions (of ``versions``: (table, block) -> version) at which this worker last
    pulled the blocks dense piece ``p`` of ``job`` pushes (of its range [start, stop) when
    given): the servers measure how many updates arrived in between
    (shardps_push_intervening_updates). Sparse pushes skip it: finding their blocks costs a
    hash per row."""
    if not versions:
        return {}
    spec = view.table(job, p.table).spec
    start = p.start if start is None else start
    stop = p.stop if stop is None else stop
    out = {}
    for b in range(start // spec.block_size, (stop - 1) // spec.block_size + 1):
        v = versions.get((p.table, b))
        if v is not None:
            out[b] = v
    return out


DIRECT_REPLY_BYTES = 256 << 10        # a server's pulled values from this size received in place


_NO_ROWS = np.empty(0, np.int64)
_ALL_STORED = operator.attrgetter("all_stored")


def _span(part, out: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
    """Where a routed pull part's values go in its output ``out``: ``(span, rows)``, the
    piece of ``out`` they fill when they fill one (a dense range; rows routed whole or
    otherwise consecutive), else None, and the rows of ``out`` they go to (none for dense)."""
    p, positions, a, z = part
    if p.dense:
        lo = p.offset + (a - p.start)
        return out[lo:lo + (z - a)], _NO_ROWS
    if positions is None and p.positions is None:     # the piece whole, its rows in order
        return out[:z - a], _NO_ROWS
    where = positions if p.positions is None else p.positions if positions is None else p.positions[positions]
    start = contiguous_start(where)
    return (None if start is None else out[start:start + (z - a)]), where


def destination(lp: list | None, outputs: list | None, reply_bytes: int) -> np.ndarray | None:
    """Where one server's pulled values belong, as bytes, when they are one piece of
    contiguous memory in ``outputs`` (a pull of one routed part whose ``_span`` is one
    piece): the transport may receive them there directly. None otherwise."""
    if not lp or len(lp) != 1 or outputs is None:
        return None
    dest, _ = _span(lp[0], outputs[lp[0][0].item])
    if dest is None or dest.dtype != np.float32 or not dest.flags.c_contiguous or dest.nbytes != reply_bytes:
        return None
    return dest.reshape(-1).view(np.uint8)


def contiguous_start(positions: np.ndarray | None) -> int | None:
    """The first of ``positions`` when they are consecutive (``k, k + 1, ...``; a piece
    routed whole), else None."""
    if positions is None or not positions.shape[0]:
        return None
    first = int(positions[0])
    if int(positions[-1]) - first != positions.shape[0] - 1 or not kernels.strictly_increasing(positions):
        return None
    return first
