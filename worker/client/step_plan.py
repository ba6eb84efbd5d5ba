"""The client's plan of a call's sparse rows: all of a push's (or a pull's) sparse pieces
routed to their servers and gathered server by server in one compiled call.

``RowsRoute(tables, pieces, push)`` routes every id of every piece by its block's primary
(the rule of ``routing.route``: ``splitmix64(id) % num_blocks``, or the server a table is
placed whole on), groups them by server, then by piece, keeping each piece's order, and
gathers each server's ids (and, in a push, rows) into one array. ``rows(server)`` gives that
server's segments as one ``step.Rows``, which ``step.Encoded`` lays out without a pass per
table; ``places(server, outputs)`` says where a pull's reply goes. ``Tables`` holds what the
route needs of the tables, derived once per shard map. The Step frames that carry them need
numba (``steps.StepCalls``); without it, calls go the general way.
"""

from __future__ import annotations

import itertools
import operator

import numpy as np

from shardps import kernels
from shardps.errors import Unavailable
from shardps.id_blocks import block_of_id
from shardps.kernels import _JIT, njit
from shardps.rpc.step import NO_VALUES, Rows
from shardps.shardmap import TableView
from shardps.worker.routing import Outputs, Piece

_IDS, _VALUES = operator.attrgetter("ids"), operator.attrgetter("values")
_PRIMARY, _WHOLE_ON = operator.attrgetter("primary"), operator.attrgetter("whole_on")
_NUM_BLOCKS, _DIM = operator.attrgetter("spec.num_blocks"), operator.attrgetter("spec.dim")
_ITEM = operator.attrgetter("item")
_NO_STARTS = np.empty(0, np.int64)                  # ``RowsRoute._piece_starts``: outputs not in one array
HEAD = 3                                # ``_plan``'s info: bad piece, bad block, segments; then its lists


@njit(**_JIT)
def _plan(ids, id_starts, values, num_blocks, whole_on, primary, primary_starts, dims, servers):
    """Route and gather the ids of every piece (piece ``p``'s are ``ids[id_starts[p]:id_starts[p
    + 1]]``, its rows of ``dims[p]`` values flat in ``values`` when that is not empty) to
    ``servers`` servers. Returns (info, order, counts, dims, ids, values): the rows by server,
    then piece, each piece's in its order; ``order`` their positions within their piece;
    ``ids`` and ``values`` theirs; one segment per (server, piece) with rows, its rows
    (``counts``) and dim (``dims``). ``info``: the piece and block of the first block without
    a primary (-1, -1: none), the segments, then per server ``servers + 1`` bounds of its rows,
    of its values and of its segments, then per segment its piece and its first row in the
    piece when its rows are consecutive there (else -1)."""
    pieces = id_starts.shape[0] - 1
    n = ids.shape[0]
    server = np.empty(n, np.int64)
    counts = np.zeros((servers, pieces), np.int64)
    for p in range(pieces):
        a, z = id_starts[p], id_starts[p + 1]
        if whole_on[p] >= 0:
            for i in range(a, z):
                server[i] = whole_on[p]
            counts[whole_on[p], p] += z - a
            continue
        nb, base = np.uint64(num_blocks[p]), np.uint64(primary_starts[p])
        for i in range(np.uint64(a), np.uint64(z)):
            b = block_of_id(ids[i], nb)
            s = primary[base + b]
            if s < 0:
                info = np.full(HEAD, -1, np.int64)
                info[0], info[1] = p, b
                none = np.empty(0, np.int64)
                return info, none, none, none, none, np.empty(0, np.float32)
            server[i] = s
            counts[s, p] += 1
    segments = 0
    for s in range(servers):
        for p in range(pieces):
            if counts[s, p]:
                segments += 1
    info = np.empty(HEAD + 3 * (servers + 1) + 2 * segments, np.int64)
    info[0], info[1], info[2] = -1, -1, segments
    ends, value_ends, seg_ends = HEAD, HEAD + servers + 1, HEAD + 2 * (servers + 1)
    seg_pieces, seg_firsts = HEAD + 3 * (servers + 1), HEAD + 3 * (servers + 1) + segments
    seg_counts, seg_dims = np.empty(segments, np.int64), np.empty(segments, np.int64)
    fill = np.empty((servers, pieces), np.int64)
    at = v = k = 0
    info[ends] = info[value_ends] = info[seg_ends] = 0
    for s in range(servers):
        for p in range(pieces):
            c = counts[s, p]
            fill[s, p] = at
            if c:
                seg_counts[k], seg_dims[k] = c, dims[p]
                info[seg_pieces + k] = p
                k += 1
            at += c
            v += c * dims[p]
        info[ends + s + 1], info[value_ends + s + 1], info[seg_ends + s + 1] = at, v, k
    order = np.empty(n, np.int64)
    for p in range(pieces):
        a = id_starts[p]
        for i in range(np.uint64(a), np.uint64(id_starts[p + 1])):
            s = server[i]
            order[fill[s, p]] = i - a
            fill[s, p] += 1
    ids_out = np.empty(n, np.int64)
    values_out = np.empty(v if values.shape[0] else 0, np.float32)
    value_starts = np.zeros(pieces, np.int64)         # where each piece's rows begin in ``values``
    for p in range(1, pieces):
        value_starts[p] = value_starts[p - 1] + (id_starts[p] - id_starts[p - 1]) * dims[p - 1]
    at = v = k = 0
    for s in range(servers):
        for p in range(pieces):
            c = counts[s, p]
            if not c:
                continue
            first = order[at]
            info[seg_firsts + k] = first if order[at + c - 1] - first == c - 1 else -1
            k += 1
            # unsigned indices: numba then checks no negative ones and copies a row as a block
            d, row0, value0 = np.uint64(dims[p]), np.uint64(id_starts[p]), np.uint64(value_starts[p])
            for j in range(np.uint64(at), np.uint64(at + c)):
                local = np.uint64(order[j])
                ids_out[j] = ids[row0 + local]
                if values_out.shape[0]:
                    src = value0 + local * d
                    for x in range(d):
                        values_out[np.uint64(v) + x] = values[src + x]
                    v += dims[p]
            at += c
    return info, order, seg_counts, seg_dims, ids_out, values_out


@njit(**_JIT)
def _scatter(values, flat, order, counts, dims, starts):
    """A server's pulled rows (``values``: its segments' one after another, segment ``s``
    ``counts[s]`` rows of ``dims[s]`` values) into ``flat``: row ``r`` of the server (its
    position ``order[r]`` in its piece's output) at ``starts[s] + order[r] * dims[s]``."""
    at = np.uint64(0)
    r = 0
    for s in range(counts.shape[0]):
        d, base = np.uint64(dims[s]), np.uint64(starts[s])
        for _ in range(counts[s]):
            dst = base + np.uint64(order[r]) * d
            for x in range(d):
                flat[dst + x] = values[at + x]
            at += d
            r += 1


class Tables:
    """What ``RowsRoute`` needs of the tables of a call's sparse pieces (``tables``, their
    views, in order) under one shard map of ``servers`` servers."""

    __slots__ = ("names", "servers", "num_blocks", "whole_on", "primary", "primary_starts", "dims")

    def __init__(self, tables: list[TableView], servers: int):
        n = len(tables)
        self.names = [t.name for t in tables]
        self.servers = servers
        self.num_blocks = np.fromiter(map(_NUM_BLOCKS, tables), np.int64, n)
        self.whole_on = np.fromiter(map(_WHOLE_ON, tables), np.int64, n)
        self.primary = np.concatenate(list(map(_PRIMARY, tables)), dtype=np.int32)
        self.primary_starts = np.fromiter(itertools.accumulate(map(len, map(_PRIMARY, tables)), initial=0),
                                          np.int64, n + 1)
        self.dims = np.fromiter(map(_DIM, tables), np.int64, n)


class RowsRoute:
    """A call's sparse pieces (``pieces``, each with ids, of ``tables``) routed and gathered
    (see the module docstring); with ``push``, their rows' values go along. Raises
    Unavailable for a block without a live replica."""

    __slots__ = ("pieces", "names", "order", "counts", "dims", "ids", "values", "ends", "value_ends", "seg_ends",
                 "seg_pieces", "seg_firsts", "_piece_starts")

    def __init__(self, tables: Tables, pieces: list[Piece], push: bool):
        self.pieces, self.names = pieces, tables.names
        n = len(pieces)
        id_starts = np.fromiter(itertools.accumulate(map(len, map(_IDS, pieces)), initial=0), np.int64, n + 1)
        ids = np.concatenate(list(map(_IDS, pieces))) if n > 1 else pieces[0].ids
        values = NO_VALUES
        if push:
            values = (np.concatenate(list(map(_VALUES, pieces)), axis=None, dtype=np.float32) if n > 1 else
                      np.ascontiguousarray(pieces[0].values, np.float32).reshape(-1))
        info, self.order, self.counts, self.dims, self.ids, self.values = _plan(
            ids, id_starts, values, tables.num_blocks, tables.whole_on, tables.primary, tables.primary_starts,
            tables.dims, tables.servers)
        info = info.tolist()
        if info[0] >= 0:
            raise Unavailable(f"block {info[1]} of table {self.names[info[0]]!r} has no live replica under the "
                              f"current map: wait for the manager to re-place it (or restore a checkpoint)")
        # server s's rows are [ends[s], ends[s + 1]) of ids and order, its values [value_ends[s],
        # value_ends[s + 1]), its segments [seg_ends[s], seg_ends[s + 1]) of seg_pieces and seg_firsts
        bounds = tables.servers + 1
        self.ends = info[HEAD:HEAD + bounds]
        self.value_ends = info[HEAD + bounds:HEAD + 2 * bounds]
        self.seg_ends = info[HEAD + 2 * bounds:HEAD + 3 * bounds]
        self.seg_pieces = info[HEAD + 3 * bounds:HEAD + 3 * bounds + info[2]]
        self.seg_firsts = info[HEAD + 3 * bounds + info[2]:]
        self._piece_starts: np.ndarray | None = None

    def taking(self) -> list[int]:
        """The servers some row goes to (their indices, ascending)."""
        ends = self.ends
        return list(itertools.compress(range(len(ends) - 1), map(operator.lt, ends, ends[1:])))

    def rows(self, server: int) -> Rows | None:
        """Server ``server``'s segments: one per piece it takes rows of, in piece order (None:
        it takes none)."""
        at, end = self.ends[server], self.ends[server + 1]
        if at == end:
            return None
        a, z = self.seg_ends[server], self.seg_ends[server + 1]
        return Rows(tuple(map(self.names.__getitem__, self.seg_pieces[a:z])), self.counts[a:z], self.dims[a:z],
                    self.ids[at:end], self.values[self.value_ends[server]:self.value_ends[server + 1]])

    def _one_array(self, outputs: list) -> bool:
        """Whether every piece's output is a view of ``outputs.flat`` (``_one_array_starts``;
        found at the first server's places, kept for the others)."""
        if self._piece_starts is None:
            starts = _one_array_starts(self.pieces, outputs)
            self._piece_starts = _NO_STARTS if starts is None else starts
        return self._piece_starts is not _NO_STARTS

    def elements(self, server: int) -> tuple[int, ...]:
        """The values of each of server ``server``'s segments, in ``rows``' order."""
        a, z = self.seg_ends[server], self.seg_ends[server + 1]
        return tuple((self.counts[a:z] * self.dims[a:z]).tolist())

    def places(self, server: int, outputs: list) -> list[tuple]:
        """Where server ``server``'s reply to a pull goes: (dest, where, elements, rows), as
        ``steps.scatter`` takes them. Rows of several segments (or one not consecutive in its
        output), all of whose outputs are views of one array (``routing.Outputs``), are one
        place whose ``where`` writes them there in one compiled call (``Scatter``). Else one
        place per segment: a segment of consecutive rows of its piece's output is a flat view
        of them (``where`` None), else ``dest`` is the output and ``where`` its rows'
        positions in it."""
        a, z = self.seg_ends[server], self.seg_ends[server + 1]
        if (z - a > 1 or self.seg_firsts[a] < 0) and self._one_array(outputs):
            at, end = self.ends[server], self.ends[server + 1]
            elements = self.value_ends[server + 1] - self.value_ends[server]
            starts = self._piece_starts[self.seg_pieces[a:z]]       # type: ignore[index]
            return [(outputs.flat, Scatter(self.order[at:end], self.counts[a:z], self.dims[a:z], starts),  # type: ignore[attr-defined]
                     elements, end - at)]
        pieces = list(map(self.pieces.__getitem__, self.seg_pieces[a:z]))
        counts = self.counts[a:z].tolist()
        starts = itertools.accumulate(counts, initial=self.ends[server])
        return [(out[first:first + n].reshape(-1), None, n * out.shape[1], n) if first >= 0 and p.positions is None
                else _scattered(p, out, self.order[at:at + n])
                for p, out, first, n, at in zip(pieces, map(outputs.__getitem__, map(_ITEM, pieces)),
                                                self.seg_firsts[a:z], counts, starts)]


class Scatter:
    """``RowsRoute.places``' writer of a server's pulled rows into the one array of their
    outputs (``_scatter``, one compiled call)."""

    __slots__ = ("order", "counts", "dims", "starts")

    def __init__(self, order: np.ndarray, counts: np.ndarray, dims: np.ndarray, starts: np.ndarray):
        self.order, self.counts, self.dims, self.starts = order, counts, dims, starts

    def __call__(self, flat: np.ndarray, values: np.ndarray) -> None:
        _scatter(values, flat, self.order, self.counts, self.dims, self.starts)


def _scattered(piece: Piece, out: np.ndarray, local: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, int, int]:
    """``RowsRoute.places``' place of rows that are not consecutive rows of the piece: its
    rows at ``local``, which go to those rows of ``out``, or to rows ``piece.positions[local]``
    (when those are consecutive: a flat view of them)."""
    n = local.shape[0]
    if piece.positions is None:
        return out, local, n * out.shape[1], n
    where = piece.positions[local]
    start = contiguous_start(where)
    if start is None:
        return out, where, n * out.shape[1], n
    return out[start:start + n].reshape(-1), None, n * out.shape[1], n


def _one_array_starts(pieces: list[Piece], outputs: list) -> np.ndarray | None:
    """Where each of ``pieces``' outputs begins in ``outputs.flat``, when every one is a
    view of it (``routing.Outputs``) and each piece's rows are its output's rows ``0, 1,
    ...`` (no ``positions``); else None."""
    if not isinstance(outputs, Outputs) or outputs.starts is None or any(p.positions is not None for p in pieces):
        return None
    mine = [outputs.starts[p.item] for p in pieces]
    return np.array(mine, np.int64) if min(mine) >= 0 else None


def contiguous_start(positions: np.ndarray | None) -> int | None:
    """The first of ``positions`` when they are consecutive (``k, k + 1, ...``; a piece
    routed whole), else None."""
    if positions is None or not positions.shape[0]:
        return None
    first = int(positions[0])
    if int(positions[-1]) - first != positions.shape[0] - 1 or not kernels.strictly_increasing(positions):
        return None
    return first


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernels: the route, for a push's arrays and a
    pull's, and the reply's scatter."""
    if kernels.AVAILABLE:
        ids, starts, one = np.arange(3, dtype=np.int64), np.array([0, 3], np.int64), np.ones(1, np.int64)
        for values in (np.zeros(6, np.float32), NO_VALUES):
            _plan(ids, starts, values, one, np.full(1, -1, np.int64), np.zeros(1, np.int32), np.array([0, 1]),
                  one * 2, 1)
        _scatter(np.zeros(2, np.float32), np.zeros(2, np.float32), one * 0, one, one * 2, one * 0)
