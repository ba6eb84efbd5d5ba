"""The data path: pushes and pulls cut into per-server pieces, sent in parallel through a
``Transport``, re-routed until they succeed or the deadline passes, and decoded into the
caller's arrays.

* ``Fanout`` routes pieces with the shard map, calls ``send`` once per server (in parallel)
  and re-routes what a server refused: StaleEpoch -> wait briefly for a newer map and route
  again; Unavailable / DeadlineExceeded of one attempt -> jittered backoff and route again;
  a block without a live replica -> poll the manager until one appears; all until the
  call's deadline (then DeadlineExceeded).
* ``DataPath`` builds the requests (one ``ps.PushHeader`` / ``ps.PullRequest`` per server
  and attempt, with the exactly-once numbers of ``membership.Session``), hands them to the
  transport, and places the replies. Per-call results (versions, clock, waited seconds,
  staleness) are returned in ``PushResult`` / ``PullResult``, never kept in shared fields.

The transport is the plug-in point: ``DataPath(transport=...)`` takes any ``Transport``
(``transport.py``); ``GrpcTransport`` is the one implementation today.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from shardps import dtypes
from shardps.dtypes import WireDType
from shardps.errors import DeadlineExceeded, ShardpsError, StaleEpoch, Unavailable
from shardps.metrics import WorkerMetrics
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.rpc.codec import CHUNK_BYTES, byte_view
from shardps.shardmap import ShardMapView, TableView
from shardps.tables import TableKind
from shardps.worker.client.membership import Session
from shardps.worker.client.transport import Payload, Transport
from shardps.worker.routing import Piece, live_servers, route

RETRYABLE = (StaleEpoch, Unavailable)
# A single attempt of a data call may take this long plus size / ATTEMPT_BANDWIDTH before it
# is abandoned and retried (a peer cut off by a partition never answers; the call's overall
# deadline bounds the retries).
ATTEMPT_SECONDS = 5.0
ATTEMPT_BANDWIDTH = 20e6


def attempt_timeout(deadline: float, nbytes: int) -> float:
    return max(0.001, min(deadline - time.monotonic(), ATTEMPT_SECONDS + nbytes / ATTEMPT_BANDWIDTH))


@dataclass
class PushResult:
    """What the servers acknowledged for one push."""

    versions: dict[tuple[str, int], int] = field(default_factory=dict)   # (table, block) -> version
    duplicate_blocks: int = 0          # blocks that had already applied this push (a retry)
    clock: int = 0                     # the clock the push carried


@dataclass
class PullResult:
    """The values of one pull (in request order) and what the servers said about them."""

    values: list[np.ndarray]
    versions: dict[tuple[str, int], int]                                # (table, block) -> version
    min_clock: int = 0                 # the group's slowest completed step, largest over servers
    clock: int = 0                     # the clock the pull carried (this worker's completed steps)
    waited_seconds: float = 0.0        # longest a server held the pull for stragglers (SYNC/SSP)
    staleness: int = 0                 # clock - a server's min_clock, worst server (SYNC/SSP)


class MapSource(Protocol):
    """Where the data path gets its shard map (``admin.Admin``)."""

    def view(self) -> ShardMapView: ...

    def refresh_map(self, min_epoch: int = 0, timeout: float | None = None) -> ShardMapView: ...

    def table(self, name: str) -> TableView: ...


Send = Callable[[str, str, list, ShardMapView], None]     # (server, address, pieces, view)


def _capture(fn, arg):
    try:
        return True, fn(arg)
    except ShardpsError as exc:
        return False, exc
    except Exception as exc:          # a bug: surface it with its type
        return False, exc


class Fanout:
    """Routing, parallel sends and re-routing of one call's pieces. Thread-safe (no state
    of its own between calls); ``run`` blocks until every piece succeeded."""

    def __init__(self, job: str, maps: MapSource, executor: futures.Executor, metrics: WorkerMetrics):
        self.job = job
        self.maps = maps
        self.executor = executor
        self.metrics = metrics

    def run(self, pieces: list[Piece], deadline: float, send: Send, extra_servers=()) -> None:
        """Route pieces, call ``send(server, address, pieces, view)`` per server in parallel,
        and re-route what a server refused until it succeeds or the deadline passes.
        ``extra_servers`` get a call with no pieces (step reports). Raises the first error
        that is not retryable (or any error of an export pull: ``all_stored`` pieces), and
        DeadlineExceeded when the deadline passed with pieces still refused."""
        view = self.maps.view()
        pending = route(view, self.job, pieces)
        for s in extra_servers:
            pending.setdefault(s, [])
        delay = 0.02
        attempt = 0
        while True:
            items = list(pending.items())
            outcomes = self._send_all(items, view, send)
            errors, retry, retry_servers = self._triage(items, outcomes, deadline, attempt)
            if not errors:
                return
            attempt += 1
            for e in errors.values():
                self.metrics.retries.labels(type(e).__name__).inc()
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())) * (0.5 + random.random()))
            delay = min(delay * 2, 0.5)
            view, pending, waited = self._reroute(view, retry, deadline)
            if waited:
                retry_servers = []
            alive = set(live_servers(view))
            for s in retry_servers:
                if s in alive:
                    pending.setdefault(s, [])

    def _send_all(self, items, view: ShardMapView, send: Send) -> list:
        def one(item):
            server, ps_ = item
            return send(server, view.address(server), ps_, view)

        if len(items) == 1:
            return [_capture(one, items[0])]
        return [f.result() for f in [self.executor.submit(_capture, one, it) for it in items]]

    @staticmethod
    def _triage(items, outcomes, deadline: float, attempt: int):
        """(errors by server, pieces to re-send, servers to re-send an empty call to); raises
        what cannot be retried."""
        errors: dict[str, ShardpsError] = {}
        retry: list[Piece] = []
        retry_servers: list[str] = []
        for (server, ps_), (ok, value) in zip(items, outcomes):
            if ok:
                continue
            transient = isinstance(value, RETRYABLE + (DeadlineExceeded,))
            if transient and not any(p.all_stored for p in ps_) and time.monotonic() < deadline:
                errors[server] = value
                retry.extend(ps_)
                if not ps_:
                    retry_servers.append(server)
                continue
            if transient and time.monotonic() >= deadline:
                raise DeadlineExceeded(f"gave up at the deadline after {attempt + 1} attempts: "
                                       f"{value.message}") from value
            raise value
        return errors, retry, retry_servers

    def _reroute(self, view: ShardMapView, retry: list[Piece], deadline: float):
        """(the map to retry with, its routing of ``retry``, whether it had to wait for a
        block without a live replica)."""
        # wait (briefly) for a newer map: after a failover it arrives as soon as the
        # manager publishes it; otherwise retry with the map we have
        try:
            view = self.maps.refresh_map(min_epoch=view.epoch + 1,
                                         timeout=max(0.05, min(1.0, deadline - time.monotonic())))
        except (DeadlineExceeded, Unavailable):
            view = self.maps.view()
        try:
            return view, route(view, self.job, retry), False
        except Unavailable:
            # a block has no live replica in this map yet: wait for the manager
            if time.monotonic() >= deadline:
                raise
            pending: dict = {}
            while not pending and time.monotonic() < deadline:
                time.sleep(0.2)
                try:
                    view = self.maps.refresh_map(timeout=max(0.05, min(1.0, deadline - time.monotonic())))
                    pending = route(view, self.job, retry)
                except (DeadlineExceeded, Unavailable):
                    continue
            if not pending:
                raise
            return view, pending, True


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
        self._last_pull = PullResult([], {})
        self._last_clock = 0

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

    def _header(self, view: ShardMapView, sequence: int, clock: int):
        return self.session.header(self.job, view.epoch, sequence, clock, self.wire_dtype.value)

    # ================================================================== pull
    def pull(self, pieces: list[Piece], outputs: list, timeout: float | None,
             clock: int | None = None) -> PullResult:
        """Fill ``outputs`` (one array per request item; ``None`` for an export item, which
        becomes ``(ids, rows)``) with the values of ``pieces``. ``clock``: this worker's
        completed steps (SYNC / BOUNDED pulls wait as the consistency model requires)."""
        deadline = self.deadline(timeout)
        result = PullResult(outputs, {}, clock=0 if clock is None else int(clock))
        lock = threading.Lock()
        stored: dict[int, list] = {}

        def send(server: str, address: str, ps_: list[Piece], view: ShardMapView) -> None:
            header = self._header(view, 0, result.clock)
            request = ps.PullRequest(header=header, chunk_bytes=self.chunk_bytes)
            ids = []
            for p in ps_:
                seg = request.segments.add(table=p.table)
                if p.all_stored:
                    seg.rows.all_stored = True
                elif p.dense:
                    seg.range.start, seg.range.stop = p.start, p.stop
                else:
                    seg.rows.count = p.rows
                    ids.append(p.ids.astype("<i8", copy=False))
            if ids:
                request.data = b"".join(byte_view(a) for a in ids)
            item = self.wire_dtype.itemsize
            expected = None if any(p.all_stored for p in ps_) else sum(
                (p.stop - p.start) * item if p.dense else p.rows * view.table(self.job, p.table).spec.dim * item
                for p in ps_)

            def consume(head: ps.PullHeader, payload: Payload) -> None:
                self._place(server, ps_, head, payload, header, result, stored, lock)

            self.transport.pull(server, address, request, expected,
                                attempt_timeout(deadline, expected or 0), consume)

        self.fanout.run(pieces, deadline, send)
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
        self.metrics.bytes.labels("pulled").inc(len(payload))
        self.metrics.rows.labels("pulled").inc(sum(p.rows for p in ps_))
        for p, layout in zip(ps_, head.segments):
            wire = WireDType.parse(int(layout.dtype))
            got_ids = None
            if layout.ids:
                got_ids = np.frombuffer(payload.read(int(layout.ids) * 8), dtype="<i8").copy()
            count = int(layout.elements)
            if p.dense and not p.all_stored and wire is WireDType.FLOAT32:
                out = outputs[p.item][p.offset:p.offset + (p.stop - p.start)]
                if out.size != count or not out.flags.c_contiguous:
                    raise Unavailable(f"pull from {server}: {count} values for a range of {out.size}")
                payload.read_into(byte_view(out))          # straight into the result
                continue
            values = dtypes.decode(payload.read(count * wire.itemsize), wire, count)
            if p.all_stored:
                with lock:
                    stored.setdefault(p.item, []).append((got_ids, values.copy()))
            elif p.dense:
                outputs[p.item][p.offset:p.offset + (p.stop - p.start)] = values
            else:
                outputs[p.item][p.positions] = values.reshape(p.rows, -1)
        if payload.consumed != len(payload):
            raise Unavailable(f"pull from {server}: payload has {len(payload)} bytes; "
                              f"the header describes {payload.consumed}")
        with lock:
            if head.min_clock or header.session:
                result.staleness = max(result.staleness, max(0, result.clock - int(head.min_clock)))
            result.waited_seconds = max(result.waited_seconds, head.waited_seconds)
            for v in head.versions:
                result.versions[(v.table, v.block)] = v.version
                self._versions[(v.table, v.block)] = v.version
            result.min_clock = max(result.min_clock, int(head.min_clock))

    def export(self, tables: list[str], timeout: float | None) -> dict[str, np.ndarray]:
        """``tables`` as plain arrays: a dense table in its shape under its name; a sparse
        one as ``{name}.ids`` and ``{name}.rows`` (see ``pull_stored``)."""
        out = {}
        for name in tables:
            t = self.maps.table(name)
            if t.spec.kind is TableKind.DENSE:
                values = np.empty(t.spec.numel, np.float32)
                self.pull([Piece(0, name, True, 0, t.spec.numel)], [values], timeout)
                out[name] = values.reshape(t.spec.shape)
            else:
                out[f"{name}.ids"], out[f"{name}.rows"] = self.pull_stored(name, timeout)
        return out

    def pull_stored(self, table: str, timeout: float | None) -> tuple[np.ndarray, np.ndarray]:
        """Every stored row of a sparse table as (ids ascending, rows ``[n, dim]``); the
        whole export restarts if the map changes under it."""
        t = self.maps.table(table)
        deadline = self.deadline(timeout)
        while True:
            try:
                res = self.pull([Piece(0, table, False, all_stored=True)], [None],
                                max(0.001, deadline - time.monotonic()))
                break
            except RETRYABLE:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)
                self.maps.refresh_map()
        ids, rows = res.values[0]
        order = np.argsort(ids)
        return ids[order], rows.reshape(-1, t.spec.dim)[order]

    def server_clock(self, timeout: float | None = None) -> int:
        """The group's step as the servers see it: the largest ``min_clock`` of an empty pull
        to every live server (sent once each, not retried)."""
        view = self.maps.view()
        best = 0
        for name in live_servers(view):
            request = ps.PullRequest(header=self._header(view, 0, 0))
            best = max(best, self.transport.pull(name, view.address(name), request, None,
                                                 timeout or self.default_timeout,
                                                 lambda head, _payload: int(head.min_clock)))
        return best

    # ================================================================== push
    def push(self, pieces: list[Piece], kind: int, timeout: float | None, clock: int | None,
             report_step: bool) -> PushResult:
        """Send ``pieces`` (with values) as one push of ``kind`` (``ps.GRADIENT`` /
        ``ps.INITIALIZE``): one sequence number, kept across retries. ``report_step``: also
        send an empty push to every live server, reporting step ``clock``."""
        deadline = self.deadline(timeout)
        result = PushResult(clock=0 if clock is None else int(clock))
        lock = threading.Lock()
        seq = self.session.begin_push()

        def send(server: str, address: str, ps_: list[Piece], view: ShardMapView) -> None:
            header = ps.PushHeader(header=self._header(view, seq, result.clock), kind=kind)
            arrays = []
            rows = sparse_bytes = 0
            for p in ps_:
                seg = header.segments.add(table=p.table)
                self._add_base_versions(seg, p, view)
                if p.dense:
                    seg.range.start, seg.range.stop = p.start, p.stop
                    arrays.append(dtypes.encode(p.values, self.wire_dtype))
                else:
                    seg.rows.count = p.rows
                    rows += p.rows
                    arrays.append(np.ascontiguousarray(p.ids, dtype="<i8"))
                    arrays.append(dtypes.encode(p.values, self.wire_dtype))
                    sparse_bytes += arrays[-1].nbytes + arrays[-2].nbytes
            nbytes = header.payload_bytes = sum(a.nbytes for a in arrays)
            ack = self.transport.push(server, address, header, arrays, attempt_timeout(deadline, nbytes))
            self.metrics.bytes.labels("pushed").inc(nbytes)
            self.metrics.rows.labels("pushed").inc(rows)
            self.metrics.sparse_bytes.labels("pushed").inc(sparse_bytes)
            with lock:
                for v in ack.versions:
                    result.versions[(v.table, v.block)] = v.version
                result.duplicate_blocks += ack.duplicate_blocks

        try:
            extra = live_servers(self.maps.view()) if report_step else ()
            self.fanout.run(pieces, deadline, send, extra_servers=extra)
        finally:
            self.session.end_push(seq)
        with self._last_lock:
            self._last_clock = result.clock
        return result

    def _add_base_versions(self, seg, p: Piece, view: ShardMapView) -> None:
        """The versions at which this worker last pulled the blocks it now pushes: the servers
        measure how many updates arrived in between (shardps_push_intervening_updates)."""
        if not self._versions or not p.dense:
            return        # sparse pushes skip it: finding their blocks costs a hash per row
        spec = view.table(self.job, p.table).spec
        blocks = range(p.start // spec.block_size, (p.stop - 1) // spec.block_size + 1)
        for b in blocks:
            v = self._versions.get((p.table, b))
            if v is not None:
                seg.base_versions.add(table=p.table, block=b, version=v)
