"""Routing, parallel sends and re-routing of one data call's pieces (see ``data.py``).

``Fanout`` routes pieces with the shard map, calls ``send`` once per server (in parallel) and
re-routes what a server refused: StaleEpoch -> wait briefly for a newer map and route again;
Unavailable / DeadlineExceeded of one attempt -> jittered backoff and route again; a block
without a live replica -> poll the manager until one appears; all until the call's deadline
(then DeadlineExceeded).
"""

from __future__ import annotations

import random
import time
from concurrent import futures
from typing import Callable, Protocol

from shardps.errors import DeadlineExceeded, ShardpsError, StaleEpoch, Unavailable
from shardps.metrics import WorkerMetrics
from shardps.shardmap import ShardMapView, TableView
from shardps.worker.routing import Piece, live_servers, route

RETRYABLE = (StaleEpoch, Unavailable)
# A single attempt of a data call may take this long plus size / ATTEMPT_BANDWIDTH before it
# is abandoned and retried (a peer cut off by a partition never answers; the call's overall
# deadline bounds the retries).
ATTEMPT_SECONDS = 5.0
ATTEMPT_BANDWIDTH = 20e6


def attempt_timeout(deadline: float, nbytes: int) -> float:
    return max(0.001, min(deadline - time.monotonic(), ATTEMPT_SECONDS + nbytes / ATTEMPT_BANDWIDTH))


class MapSource(Protocol):
    """Where the data path gets its shard map (``admin.Admin``)."""

    def view(self) -> ShardMapView: ...

    def refresh_map(self, min_epoch: int = 0, timeout: float | None = None) -> ShardMapView: ...

    def table(self, name: str) -> TableView: ...


Send = Callable[[str, str, list, ShardMapView], None]     # (server, address, pieces, view)


def abandon_dead(transport, old: ShardMapView, new: ShardMapView) -> list[str]:
    """A ``map_listeners`` hook (``admin.Admin``): calls in flight to the servers that ``old``
    listed alive and ``new`` declares dead (or no longer lists) fail at once
    (``transport.abandon``), so ``Fanout`` re-routes them with ``new`` instead of waiting for
    a paused or cut-off server until the attempt's timeout. Safe: such a call's outcome was
    already unknown, and its retry carries the same exactly-once header. Returns the names."""
    gone = sorted(set(live_servers(old)) - set(live_servers(new)))
    for name in gone:
        transport.abandon(old.address(name))
    return gone


def capture(fn, arg):
    try:
        return True, fn(arg)
    except ShardpsError as exc:
        return False, exc
    except Exception as exc:          # a bug: surface it with its type
        return False, exc


def in_parallel(executor: futures.Executor, fn, items: list) -> list:
    """``[capture(fn, item) for item in items]``, run in parallel: the calling thread runs
    the first item itself (one thread hand-off fewer per call), the executor the others."""
    if not items:
        return []
    others = [executor.submit(capture, fn, it) for it in items[1:]]
    return [capture(fn, items[0])] + [f.result() for f in others]


def split_phase(executor: futures.Executor, items: list, begin, end, otherwise) -> list:
    """``capture`` outcomes, in ``items``' order, of a call to each item in two halves:
    ``begin(item)`` sends (returning what ``end`` needs, or None where the item has no
    split-phase call), then ``end(begun)`` reads the reply. Every request is sent before any
    reply is read, all on the calling thread: the servers work at once, and no thread
    hand-off or GIL contention is paid per call. Items ``begin`` declined run
    ``otherwise(item)`` as ``in_parallel`` does."""
    begun = [capture(begin, item) for item in items]
    outcomes = [capture(end, got) if ok and got is not None else (ok, got) for ok, got in begun]
    rest = [i for i, (ok, got) in enumerate(begun) if ok and got is None]
    for i, outcome in zip(rest, in_parallel(executor, otherwise, [items[i] for i in rest])):
        outcomes[i] = outcome
    return outcomes


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
            if self.maps.view().epoch <= view.epoch:
                # nothing new to route by: back off. A newer map (one that declared a paused
                # server dead, whose calls were then abandoned) is retried with at once
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

        return in_parallel(self.executor, one, items)

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


