"""The data path: pushes and pulls cut into per-server pieces, sent in parallel through a
``Transport``, re-routed until they succeed or the deadline passes, and decoded into the
caller's arrays.

* ``Fanout`` routes pieces with the shard map, calls ``send`` once per server (in parallel)
  and re-routes what a server refused: StaleEpoch -> wait briefly for a newer map and route
  again; Unavailable / DeadlineExceeded of one attempt -> jittered backoff and route again;
  a block without a live replica -> poll the manager until one appears; all until the
  call's deadline (then DeadlineExceeded).
* ``DataPath`` builds the requests (one ``PushRequest`` / ``PullRequest`` of
  ``shardps.messages`` per server and attempt, with the exactly-once numbers of
  ``membership.Session``), hands them to the transport, and places the replies. Per-call
  results (versions, clock, waited seconds, staleness) are returned in ``PushResult`` /
  ``PullResult``, never kept in shared fields.

The transport is the plug-in point: ``DataPath(transport=...)`` takes any ``Transport``
(``transport.py``): ``DataPlaneTransport`` and ``GrpcTransport`` (``shardps.rpc``) today.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

import numpy as np

from shardps import dtypes
from shardps.dtypes import WireDType
from shardps.errors import DeadlineExceeded, Unavailable
from shardps.messages import (
    GRADIENT,
    RANGE,
    ROWS,
    PullReply,
    PullRequest,
    PushAck,
    PushRequest,
    Selection,
)
from shardps.metrics import WorkerMetrics, labelled
from shardps.rpc.codec import CHUNK_BYTES, byte_view
from shardps.shardmap import ShardMapView
from shardps.worker.client.fanout import RETRYABLE, Fanout, MapSource, Send, attempt_timeout, split_phase
from shardps.worker.client.membership import Session
from shardps.worker.client.results import BlockVersions, PullResult, PushResult, take_pull_reply
from shardps.worker.client.step_plan import contiguous_start
from shardps.worker.client.steps import StepCalls, base_versions
from shardps.worker.client.transport import Payload, Transport
from shardps.worker.routing import Piece, live_servers, route


class DataPath:
    """Pushes and pulls of one job. Blocking; thread-safe (each call keeps its own state;
    concurrent calls share only the transport, the map and the versions seen at pulls).
    Raises ``ShardpsError``."""

    def __init__(self, job: str, transport: Transport, maps: MapSource, session: Session, *,
                 executor: futures.Executor, metrics: WorkerMetrics | None = None,
                 wire_dtype: WireDType = WireDType.FLOAT32, chunk_bytes: int = CHUNK_BYTES,
                 default_timeout: float = 30.0):
        self.job = job
        self.transport = transport
        self.maps = maps
        self.session = session
        self.metrics = metrics or WorkerMetrics()
        self.wire_dtype = wire_dtype
        self.chunk_bytes = chunk_bytes
        self.default_timeout = default_timeout
        self.fanout = Fanout(job, maps, executor, self.metrics)
        # block versions seen at pulls (pushes send them: the servers measure the updates
        # in between); single-key writes and reads, atomic under the GIL
        self._versions: dict[tuple[str, int], int] = {}
        self._last_lock = threading.Lock()
        self._last_pull = PullResult([], BlockVersions())
        self._last_clock = 0
        self.step = 0       # the clock of calls that name none (PSClient.next_step advances it)
        self.completed = 0  # steps completed: one more than the clock of the latest push
        self.steps = StepCalls(job, transport, maps, self.metrics, self._versions, self._header,
                               wire_dtype is WireDType.FLOAT32)

    def deadline(self, timeout: float | None) -> float:
        return time.monotonic() + (self.default_timeout if timeout is None else timeout)

    @property
    def last_pull(self) -> PullResult:
        """The result of the pull that completed last (any thread; an empty one before)."""
        with self._last_lock:
            return self._last_pull

    @property
    def last_clock(self) -> int:
        """The clock of the pull or push that completed last (any thread)."""
        with self._last_lock:
            return self._last_clock

    def _completed(self, clock: int) -> None:
        """A push of step ``clock`` was acknowledged: ``completed`` counts it."""
        with self._last_lock:
            self.completed = max(self.completed, clock + 1)

    def _header(self, view: ShardMapView, sequence: int, clock: int):
        return self.session.header(self.job, view.epoch, sequence, clock, self.wire_dtype.value)

    # ================================================================== pull
    def pull(self, pieces: list[Piece], outputs: list, timeout: float | None,
             clock: int | None = None) -> PullResult:
        """Fill ``outputs`` (one array per request item; ``None`` for an export item, which
        becomes ``(ids, rows)``) with the values of ``pieces``. ``clock``: this worker's
        completed steps (SYNC / SSP pulls wait as the consistency model requires)."""
        deadline = self.deadline(timeout)
        clock = self.step if clock is None else int(clock)
        if self.steps.take(pieces):
            got = self.steps.run(None, 0, pieces, outputs, deadline, pull_clock=clock)
            if got is not None and got[1] is not None:
                return self._finish_pull(got[1], {})
        result = PullResult(outputs, BlockVersions(), clock=clock)
        stored: dict[int, list] = {}
        self.fanout.run(pieces, deadline, self._pull_sender(result, stored, deadline))
        return self._finish_pull(result, stored)

    def _pull_sender(self, result: PullResult, stored: dict, deadline: float) -> Send:
        lock = threading.Lock()

        def send(server: str, address: str, ps_: list[Piece], view: ShardMapView) -> None:
            header = self._header(view, 0, result.clock)
            request, expected = pull_request(header, ps_, view, self.job, self.wire_dtype.itemsize)

            def consume(head: PullReply, payload: Payload) -> None:
                self._place(server, ps_, head, payload, header, result, stored, lock)

            self.transport.pull(server, address, request, expected,
                                attempt_timeout(deadline, expected or 0), consume)
        send.place = lambda server, ps_, head, payload, header: self._place(  # type: ignore[attr-defined]
            server, ps_, head, payload, header, result, stored, lock)
        return send

    def _finish_pull(self, result: PullResult, stored: dict) -> PullResult:
        outputs = result.values
        for item, got in stored.items():
            ids = np.concatenate([g[0] for g in got]) if got else np.empty(0, np.int64)
            rows = np.concatenate([g[1] for g in got]) if got else np.empty(0, np.float32)
            outputs[item] = (ids, rows)
        with self._last_lock:
            self._last_pull, self._last_clock = result, result.clock
        return result

    def _place(self, server, ps_, head, payload: Payload, header, result: PullResult, stored, lock) -> None:
        """Copy a pull's payload into the caller's outputs (and record versions, clocks)."""
        outputs = result.values
        labelled(self.metrics.bytes, "pulled").inc(len(payload))
        labelled(self.metrics.rows, "pulled").inc(sum(p.rows for p in ps_))
        if len(head.segments) != len(ps_):
            raise Unavailable(f"pull from {server}: {len(head.segments)} segments in the reply for "
                              f"{len(ps_)} asked")
        sparse_bytes = 0
        for p, layout in zip(ps_, head.segments):
            wire = WireDType.parse(int(layout.dtype))
            if layout.ids and not p.all_stored:
                payload.read(int(layout.ids) * 8)        # the ids of rows asked by id: known
            count = int(layout.elements)
            if not p.dense:             # the reply's ids (an export's) and rows of a sparse table
                sparse_bytes += int(layout.ids) * 8 + count * wire.itemsize
            if p.all_stored:
                got_ids = (np.frombuffer(payload.read(int(layout.ids) * 8), dtype="<i8").copy() if layout.ids
                           else np.empty(0, np.int64))           # a server holding none of the rows
                values = dtypes.decode(payload.read(count * wire.itemsize), wire, count)
                with lock:
                    stored.setdefault(p.item, []).append((got_ids, values.copy()))
            else:
                _place_values(server, p, outputs[p.item], payload, count, wire)
        if payload.consumed != len(payload):
            raise Unavailable(f"pull from {server}: payload has {len(payload)} bytes; "
                              f"the header describes {payload.consumed}")
        if sparse_bytes:
            labelled(self.metrics.sparse_bytes, "pulled").inc(sparse_bytes)     # part of bytes "pulled"
        with lock:
            take_pull_reply(result, head.min_clock, head.waited_seconds, head.versions, bool(header.session),
                            {p.table for p in ps_ if p.dense}, self._versions)

    def server_clock(self, timeout: float | None = None) -> int:
        """The group's step as the servers see it: the largest ``min_clock`` of an empty pull
        to every live server (sent once each, not retried)."""
        view = self.maps.view()
        best = 0
        for name in live_servers(view):
            request = PullRequest(self._header(view, 0, 0), [])
            best = max(best, self.transport.pull(name, view.address(name), request, None,
                                                 timeout or self.default_timeout,
                                                 lambda head, _payload: int(head.min_clock)))
        return best

    # ================================================================== push
    def push(self, pieces: list[Piece], kind: int, timeout: float | None, clock: int | None,
             report_step: bool) -> PushResult:
        """Send ``pieces`` (with values) as one push of ``kind`` (``GRADIENT`` /
        ``INITIALIZE``): one sequence number, kept across retries. ``report_step``: also
        send an empty push to every live server, reporting step ``clock``."""
        deadline = self.deadline(timeout)
        clock = self.step if clock is None else int(clock)
        seq = self.session.begin_push()
        try:
            got = (self.steps.run(pieces, kind, None, None, deadline, seq, clock, report=report_step)
                   if pieces and self.steps.take(pieces) else None)
            result = got[0] if got is not None and got[0] is not None else PushResult(clock=clock)
            view = self.maps.view()
            send = self._push_sender(seq, kind, result, deadline)
            if got is None:
                self.fanout.run(pieces, deadline, send)
            if report_step and got is None:     # (Step frames reached every live server)
                # only after every piece landed: a server that got none reports the step now;
                # reporting it earlier would close the step there before a retried piece
                # re-routed to that server arrives (the servers refuse pushes of closed steps)
                with_data = set(route(view, self.job, pieces)) if pieces else set()
                self.fanout.run([], deadline, send,
                                extra_servers=[s for s in live_servers(view) if s not in with_data])
        finally:
            self.session.end_push(seq)
        with self._last_lock:
            self._last_clock = result.clock
        self._completed(result.clock)
        return result

    def _push_request(self, ps_: list[Piece], view: ShardMapView, seq: int, kind: int, clock: int) -> PushRequest:
        """The push of ``ps_`` to one server (its payload: the arrays, in segment order)."""
        segments = []
        arrays = []
        rows = sparse_bytes = 0
        for p in ps_:
            assert p.values is not None           # a push piece carries its values
            if p.dense:
                segments.append(Selection(p.table, RANGE, p.start, p.stop,
                                          base_versions=base_versions(p, view, self.job, self._versions)))
                arrays.append(dtypes.encode(p.values, self.wire_dtype))
            else:
                segments.append(Selection(p.table, ROWS, count=p.rows))
                rows += p.rows
                arrays.append(np.ascontiguousarray(p.ids, dtype="<i8"))
                arrays.append(dtypes.encode(p.values, self.wire_dtype))
                sparse_bytes += arrays[-1].nbytes + arrays[-2].nbytes
        labelled(self.metrics.bytes, "pushed").inc(sum(a.nbytes for a in arrays))
        labelled(self.metrics.rows, "pushed").inc(rows)
        labelled(self.metrics.sparse_bytes, "pushed").inc(sparse_bytes)
        return PushRequest(self._header(view, seq, clock), kind, segments, arrays)

    def _push_sender(self, seq: int, kind: int, result: PushResult, deadline: float) -> Send:
        lock = threading.Lock()

        def acknowledged(ack: PushAck) -> None:
            with lock:
                result.versions.extend(ack.versions)
                result.duplicate_blocks += ack.duplicate_blocks

        def send(server: str, address: str, ps_: list[Piece], view: ShardMapView) -> None:
            request = self._push_request(ps_, view, seq, kind, result.clock)
            acknowledged(self.transport.push(server, address, request,
                                             attempt_timeout(deadline, payload_bytes(request))))
        send.acknowledged = acknowledged        # type: ignore[attr-defined]
        return send

    # ================================================================== push + pull
    def exchange(self, push_pieces: list[Piece], pull_pieces: list[Piece], outputs: list,
                 timeout: float | None, clock: int, report_step: bool = False
                 ) -> tuple[PushResult, PullResult]:
        """Push this step's gradients (``clock``) and pull the next step's values (``clock +
        1``) with one round trip per server where the transport offers ``exchange``: each
        server applies the push, then serves the pull. A server whose exchange fails gets
        its pieces again as a push (the same sequence number: applied once) followed by a
        pull, re-routed until the deadline, as ``push`` and ``pull`` do."""
        deadline = self.deadline(timeout)
        presult = PushResult(clock=int(clock))
        lresult = PullResult(outputs, BlockVersions(), clock=int(clock) + 1)
        stored: dict[int, list] = {}
        seq = self.session.begin_push()
        try:
            if self.steps.take(push_pieces) and self.steps.take(pull_pieces):
                got = self.steps.run(push_pieces, GRADIENT, pull_pieces, outputs, deadline, seq, int(clock),
                                     int(clock) + 1, report=report_step)
                if got is not None and got[0] is not None and got[1] is not None:
                    self._completed(presult.clock)
                    return got[0], self._finish_pull(got[1], stored)
            push_send = self._push_sender(seq, GRADIENT, presult, deadline)
            pull_send = self._pull_sender(lresult, stored, deadline)
            view = self.maps.view()
            pushes, pulls = route(view, self.job, push_pieces), route(view, self.job, pull_pieces)
            # servers without data report the step after every piece landed (see ``push``);
            # their pulls wait for that report
            report_only = [s for s in live_servers(view) if s not in pushes] if report_step else []
            deferred_pulls = [p for s in report_only for p in pulls.pop(s, [])]

            def begin(server: str):
                """Send ``server`` its exchange; what ``end`` needs, or None (not sent)."""
                pp, lp = pushes.get(server), pulls.get(server)
                if pp is None or not lp:
                    return None
                push_request = self._push_request(pp, view, seq, GRADIENT, presult.clock)
                pheader = self._header(view, 0, lresult.clock)
                request, expected = pull_request(pheader, lp, view, self.job, self.wire_dtype.itemsize)
                sent = self.transport.exchange_start(
                    server, view.address(server), push_request, request,
                    attempt_timeout(deadline, payload_bytes(push_request) + (expected or 0)))
                return None if sent is None else (server, sent, lp, pheader)

            def end(begun) -> None:
                server, sent, lp, pheader = begun

                def consume(ack, head, payload):
                    push_send.acknowledged(ack)
                    pull_send.place(server, lp, head, payload, pheader)
                self.transport.exchange_finish(sent, consume)

            def separately(server: str) -> None:
                """A push then a pull (a server without the data plane's exchange)."""
                pp, lp = pushes.get(server), pulls.get(server)
                if pp is not None:
                    push_send(server, view.address(server), pp, view)
                if lp:
                    pull_send(server, view.address(server), lp, view)

            servers = sorted(set(pushes) | set(pulls))
            outcomes = split_phase(self.fanout.executor, servers, begin, end, separately)
            retry_push, retry_pull = [], list(deferred_pulls)
            for server, (ok, err) in zip(servers, outcomes):
                if ok:
                    continue
                if not isinstance(err, RETRYABLE + (DeadlineExceeded,)):
                    raise err
                retry_push.extend(pushes.get(server) or [])
                retry_pull.extend(pulls.get(server) or [])
            if retry_push:
                self.fanout.run(retry_push, deadline, push_send)
            if report_only:
                self.fanout.run([], deadline, push_send, extra_servers=report_only)
            if retry_pull:
                self.fanout.run(retry_pull, deadline, pull_send)
        finally:
            self.session.end_push(seq)
        self._completed(presult.clock)
        return presult, self._finish_pull(lresult, stored)


def pull_request(header, ps_: list[Piece], view: ShardMapView, job: str, itemsize: int
                 ) -> tuple[PullRequest, int | None]:
    """(the pull of ``ps_`` to one server, the bytes its reply carries: None when unknown,
    an export's)."""
    segments = []
    ids = []
    for p in ps_:
        if p.all_stored:
            segments.append(Selection(p.table, ROWS, all_stored=True))
        elif p.dense:
            segments.append(Selection(p.table, RANGE, p.start, p.stop))
        else:
            assert p.ids is not None          # a sparse piece carries its ids
            segments.append(Selection(p.table, ROWS, count=p.rows))
            ids.append(p.ids.astype("<i8", copy=False))
    expected = None if any(p.all_stored for p in ps_) else sum(
        (p.stop - p.start) * itemsize if p.dense else p.rows * view.table(job, p.table).spec.dim * itemsize
        for p in ps_)
    return PullRequest(header, segments, ids), expected


def _place_values(server: str, p: Piece, output: np.ndarray, payload: Payload, count: int,
                  wire: WireDType) -> None:
    """The ``count`` values (``wire``) of pulled piece ``p`` from ``payload`` into their place
    in ``output``: read straight into it where the place is one run of float32 (a dense
    range; sparse rows bound for consecutive rows of ``output``), else decoded and scattered."""
    if p.dense:
        out = output[p.offset:p.offset + (p.stop - p.start)]
        if wire is WireDType.FLOAT32:
            if out.size != count or not out.flags.c_contiguous:
                raise Unavailable(f"pull from {server}: {count} values for a range of {out.size}")
            payload.read_into(byte_view(out))
            return
        out[:] = dtypes.decode(payload.read(count * wire.itemsize), wire, count)
        return
    run = None if wire is not WireDType.FLOAT32 else 0 if p.positions is None else contiguous_start(p.positions)
    rows = None if run is None else output[run:run + p.rows]
    if rows is not None and rows.flags.c_contiguous:
        if rows.size != count:
            raise Unavailable(f"pull from {server}: {count} values for {p.rows} rows of {rows.size // max(1, p.rows)}")
        payload.read_into(byte_view(rows))
        return
    where = slice(0, p.rows) if p.positions is None else p.positions
    output[where] = dtypes.decode(payload.read(count * wire.itemsize), wire, count).reshape(p.rows, -1)


def payload_bytes(request: PushRequest) -> int:
    return sum(a.nbytes for a in request.payload)
