"""The client's side of the compiled request path: a push and/or a pull as one Step frame per
server, every frame sent before any reply is read: a server's request laid out in one pass
over its parts (``step.Encoded``: the caller's arrays themselves where a part takes them
whole, the rows it picks otherwise), its reply's values copied or scattered into the
caller's outputs (or received there directly, one part's values of 256 KiB or more).

``StepCalls.run`` makes one attempt; it answers False when the call must go the general
way (``data.DataPath``'s ``Fanout``): a server that takes no Step frames, or a refusal the
general path knows how to retry (StaleEpoch, Unavailable, a deadline of one attempt). A
push keeps its sequence number there, so what some servers applied here is not applied
twice.
"""

from __future__ import annotations

import itertools
import operator
from typing import TYPE_CHECKING

import numpy as np

from shardps import kernels
from shardps.errors import DeadlineExceeded, Unavailable
from shardps.messages import PullReply, PushAck
from shardps.metrics import WorkerMetrics
from shardps.rpc.step import NO_IDS, NO_VALUES, RANGE_CODE, Encoded
from shardps.shardmap import ShardMapView
from shardps.worker.client.fanout import RETRYABLE, MapSource, attempt_timeout
from shardps.worker.client.results import BlockVersions, PullResult, PushResult, take_pull_reply
from shardps.worker.client.step_plan import RowsRoute, Scatter, Tables
from shardps.worker.routing import Piece, live_servers, route_ranges

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
        self._tables: dict[tuple[str, ...], tuple[ShardMapView, Tables]] = {}     # by table names, per map

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
        push_rows, pushes = self._route(view, push, True) if push is not None else (None, {})
        pushed = pushes.keys() | (_servers(view, push_rows) if push_rows is not None else set())
        if report and any(server not in pushed for server in live_servers(view)):
            return None
        pull_rows, pulls = self._route(view, pull, False) if pull is not None else (None, {})
        pulled = pulls.keys() | (_servers(view, pull_rows) if pull_rows is not None else set())
        header = self.header(view, seq, clock)
        presult = PushResult(clock=clock) if push is not None else None
        outputs = outputs if outputs is not None else []
        lresult = PullResult(outputs, BlockVersions(), clock=pull_clock) if pull is not None else None
        begun: list = []
        declined = False
        moved = [0] * 6                 # pushed bytes, rows, sparse bytes; pulled bytes, rows, sparse bytes
        try:
            for server in sorted(pushed | pulled):
                pp, lp = pushes.get(server), pulls.get(server)
                k = view.server_index[server]
                pr = push_rows.rows(k) if push_rows is not None else None
                lr = pull_rows.rows(k) if pull_rows is not None else None
                encoded = Encoded(header, kind, pull_clock, self._push(pp, view) if pp else None,
                                  self._pull(lp) if lp else None, pr, lr)
                places: list = [_place(part, outputs[part[0].item]) for part in lp] if lp else []
                expected = tuple(map(_ELEMENTS, places))       # each segment's values in the reply
                if lr is not None:
                    places += pull_rows.places(k, outputs)         # type: ignore[union-attr]
                    expected += pull_rows.elements(k)              # type: ignore[union-attr]
                reply_bytes = 4 * sum(map(_ELEMENTS, places))
                _count(moved, encoded, places, reply_bytes)
                into = destination(places, reply_bytes) if reply_bytes >= DIRECT_REPLY_BYTES else None
                sent = self.transport.step_start(server, view.address(server), encoded, reply_bytes,
                                                 attempt_timeout(deadline, reply_bytes), into)
                if sent is None:
                    declined = True
                    break
                dense = set(map(_TABLE, map(_PIECE, lp))) if lp else set()       # (its parts are ranges)
                begun.append((server, sent, (places, expected), dense))
        except RETRYABLE:
            declined = True
        failed: BaseException | None = None
        for server, sent, planned, dense in begun:
            try:
                self.transport.step_finish(sent, _Reply(self, server, planned, dense, presult, lresult,
                                                        bool(header.session)))
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

    def _route(self, view: ShardMapView, pieces: list[Piece], push: bool) -> tuple[RowsRoute | None, dict]:
        """A call's pieces routed: its sparse ones together (``step_plan.RowsRoute``; None:
        it has none), its dense ranges part by part (``routing.route_ranges``, by server
        name)."""
        sparse = list(itertools.filterfalse(_DENSE, pieces))
        if not sparse:
            return None, route_ranges(view, self.job, pieces)
        names = tuple(map(_TABLE, sparse))
        known = self._tables.get(names)
        if known is None or known[0] is not view:
            if len(self._tables) >= MAX_TABLE_SETS:
                self._tables.clear()
            known = self._tables[names] = (view, Tables([view.table(self.job, name) for name in names],
                                                        len(view.server_names)))
        rows = RowsRoute(known[1], sparse, push)
        return rows, route_ranges(view, self.job, list(filter(_DENSE, pieces))) if len(sparse) < len(pieces) else {}

    def _push(self, parts: list, view: ShardMapView) -> list:
        """A server's dense push parts (``routing.route_ranges``) as ``Encoded``'s segments,
        each range with its base versions."""
        return [(p.table, RANGE_CODE, a, z, NO_IDS, p.values[a - p.start:z - p.start],
                 tuple(itertools.chain.from_iterable(base_versions(p, view, self.job, self.versions, a, z).items())))
                for p, a, z in parts]

    @staticmethod
    def _pull(parts: list) -> list:
        """A server's dense pull parts as ``Encoded``'s segments."""
        return [(p.table, RANGE_CODE, a, z, NO_IDS, NO_VALUES, ()) for p, a, z in parts]

    def place(self, server: str, ack: PushAck, reply: PullReply, elements: tuple, values: np.ndarray,
              planned: tuple[list, tuple], dense: set[str], presult, lresult, in_group: bool) -> None:
        """Take one server's Step reply: the ack's versions, the pull's values into place
        (``planned``: (the places of its pull parts, each segment's values expected);
        ``dense``: the tables of its dense ranges; ``in_group``: the request's header had a
        session, see ``take_pull_reply``)."""
        if presult is not None:
            presult.versions.extend(ack.versions)
            presult.duplicate_blocks += ack.duplicate_blocks
        places, expected = planned
        if lresult is None or not places:
            return
        if elements != expected:
            raise _unexpected(server, elements, expected)
        if len(places) > 1 or places[0][1] is not None or not _same_memory(places[0][0], values):
            scatter(places, values)     # (else received in place: ``destination``)
        take_pull_reply(lresult, reply.min_clock, reply.waited_seconds, reply.versions, in_group, dense,
                        self.versions)


class _Reply:
    """``step_finish``'s consumer of one server's reply (``StepCalls.place``)."""

    __slots__ = ("calls", "server", "places", "dense", "presult", "lresult", "in_group")

    def __init__(self, calls: StepCalls, server: str, places: tuple[list, tuple], dense: set[str], presult, lresult,
                 in_group: bool):
        self.calls, self.server, self.places, self.dense = calls, server, places, dense
        self.presult, self.lresult, self.in_group = presult, lresult, in_group

    def __call__(self, ack: PushAck, reply: PullReply, elements: tuple, values: np.ndarray) -> None:
        self.calls.place(self.server, ack, reply, elements, values, self.places, self.dense, self.presult,
                         self.lresult, self.in_group)


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
MAX_TABLE_SETS = 64                   # sets of tables whose ``step_plan.Tables`` a ``StepCalls`` keeps


_ALL_STORED = operator.attrgetter("all_stored")
_DENSE, _TABLE = operator.attrgetter("dense"), operator.attrgetter("table")
_ELEMENTS, _ROWS = operator.itemgetter(2), operator.itemgetter(3)      # of a place
_PIECE = operator.itemgetter(0)                                         # of a part


def _servers(view: ShardMapView, rows: RowsRoute) -> set[str]:
    """The names of the servers ``rows`` go to."""
    return set(map(view.server_names.__getitem__, rows.taking()))


def _place(part, out: np.ndarray) -> tuple[np.ndarray, None, int, int]:
    """Where a dense pull part's values go in its output ``out``: ``(dest, None, elements,
    0)``, ``dest`` a flat view of ``out`` they fill (``step_plan.RowsRoute.places`` says the
    same of rows: ``where``, their rows in ``dest`` when not None; ``rows``, how many)."""
    p, a, z = part
    lo = p.offset + (a - p.start)
    return out[lo:lo + z - a], None, z - a, 0


def _count(moved: list, encoded: Encoded, places: list, reply_bytes: int) -> None:
    """Add a server's request to ``moved`` (see ``StepCalls.run``)."""
    pushed, rows, sparse = encoded.push_counts()
    moved[0] += pushed
    moved[1] += rows
    moved[2] += sparse
    moved[3] += reply_bytes
    rows = sum(map(_ROWS, places))
    if rows:                            # a dense range's place has no rows
        moved[4] += rows
        moved[5] += 4 * sum(itertools.compress(map(_ELEMENTS, places), map(_ROWS, places)))


def scatter(places: list, values: np.ndarray) -> None:
    """A server's pulled ``values`` (its segments' one after another) into their ``places``."""
    at = 0
    for dest, where, n, _ in places:
        if where is None:
            dest[...] = values[at:at + n]
        elif type(where) is Scatter:
            where(dest, values[at:at + n])
        else:
            kernels.scatter_rows(dest, where, values[at:at + n].reshape(where.shape[0], -1))
        at += n


def destination(places: list, reply_bytes: int) -> np.ndarray | None:
    """Where one server's pulled values belong, as bytes, when they are one piece of
    contiguous memory (one pull part whose ``_place`` is one flat view): the transport may
    receive them there directly. None otherwise."""
    if len(places) != 1 or places[0][1] is not None:
        return None
    dest = places[0][0]
    if dest.dtype != np.float32 or not dest.flags.c_contiguous or dest.nbytes != reply_bytes:
        return None
    return dest.view(np.uint8)


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays begin at the same address (values received in place)."""
    return a.__array_interface__["data"][0] == b.__array_interface__["data"][0]


def _unexpected(server: str, elements: tuple, expected: tuple) -> Unavailable:
    """The refusal of a Step reply whose pull segments carry other counts than asked."""
    for k, (got, n) in enumerate(zip(elements, expected)):
        if got != n:
            return Unavailable(f"step reply from {server}: {got} values in pulled segment {k}, which asked for {n}")
    return Unavailable(f"step reply from {server}: {len(elements)} pulled segments for {len(expected)} asked")
