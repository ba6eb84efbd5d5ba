"""The client's plan of a call's sparse rows: all of a push's (or a pull's) sparse pieces
routed to their servers in one compiled pass, and each server's rows gathered in another.

``RowsRoute(tables, pieces, servers)`` routes every id of every piece by its block's primary
(the rule of ``routing.route``: ``splitmix64(id) % num_blocks``, or the server a table is
placed whole on) and groups them by server, then by piece, keeping each piece's order.
``rows(server)`` gives that server's segments as one ``step.Rows`` (one ids array, one
values array for all of its tables), which ``step.Encoded`` lays out without a pass per
table; ``places(server, outputs)`` says where a pull's reply goes. The Step frames that carry
them need numba (``steps.StepCalls``); without it, calls go the general way.
"""

from __future__ import annotations

import itertools
import operator

import numpy as np

from shardps import kernels
from shardps.errors import Unavailable
from shardps.kernels import _JIT, _splitmix64, njit
from shardps.rpc.step import NO_VALUES, Rows
from shardps.shardmap import TableView
from shardps.worker.routing import Piece

_IDS, _VALUES = operator.attrgetter("ids"), operator.attrgetter("values")
_PRIMARY, _WHOLE_ON = operator.attrgetter("primary"), operator.attrgetter("whole_on")
_NUM_BLOCKS, _DIM = operator.attrgetter("spec.num_blocks"), operator.attrgetter("spec.dim")


@njit(**_JIT)
def _route(ids, id_starts, num_blocks, whole_on, primary, primary_starts, order, counts, firsts):
    """Group the ids of every piece (piece ``p``'s are ``ids[id_starts[p]:id_starts[p + 1]]``)
    by server, then piece: ``counts[s, p]`` of piece ``p``'s ids go to server ``s``, their
    positions within the piece in ``order`` (server by server, piece by piece, each piece's in
    its order); ``firsts[s, p]`` the first of them when they are consecutive, else -1.
    Returns (-1, -1), or (piece, block) of the first block without a primary."""
    pieces = id_starts.shape[0] - 1
    servers = counts.shape[0]
    server = np.empty(ids.shape[0], np.int64)
    for p in range(pieces):
        a, z = id_starts[p], id_starts[p + 1]
        if whole_on[p] >= 0:
            for i in range(a, z):
                server[i] = whole_on[p]
            counts[whole_on[p], p] += z - a
            continue
        nb = np.uint64(num_blocks[p])
        base = primary_starts[p]
        for i in range(a, z):
            b = np.int64(_splitmix64(np.uint64(ids[i])) % nb)
            s = primary[base + b]
            if s < 0:
                return p, b
            server[i] = s
            counts[s, p] += 1
    fill = np.empty((servers, pieces), np.int64)
    at = 0
    for s in range(servers):
        for p in range(pieces):
            fill[s, p] = at
            at += counts[s, p]
    for p in range(pieces):
        a = id_starts[p]
        for i in range(a, id_starts[p + 1]):
            s = server[i]
            order[fill[s, p]] = i - a
            fill[s, p] += 1
    for s in range(servers):
        for p in range(pieces):
            c = counts[s, p]
            end = fill[s, p]            # (moved to the group's end)
            first = order[end - c] if c else -1
            firsts[s, p] = first if c and order[end - 1] - first == c - 1 else -1
    return -1, -1


@njit(**_JIT)
def _gather(ids, id_starts, values, value_starts, dims, order, counts, ids_out, values_out):
    """Every server's rows in ``order``'s order (server by server, piece by piece): their ids
    into ``ids_out`` and, when ``values_out`` has room, their values (piece ``p``'s rows of
    ``dims[p]``, flat from ``value_starts[p]`` in ``values``) into ``values_out``."""
    at = v = 0
    with_values = values_out.shape[0] > 0
    for s in range(counts.shape[0]):
        for p in range(counts.shape[1]):
            d = dims[p]
            first, row0 = id_starts[p], value_starts[p]
            for _ in range(counts[s, p]):
                local = order[at]
                ids_out[at] = ids[first + local]
                at += 1
                if with_values:
                    src = row0 + local * d
                    for x in range(d):
                        values_out[v + x] = values[src + x]
                    v += d


class RowsRoute:
    """A call's sparse pieces (``pieces``, each with ids; ``tables`` their views, in order)
    routed to ``servers`` servers and gathered server by server (see the module docstring);
    with ``push``, their rows' values go along. Raises Unavailable for a block without a
    live replica."""

    __slots__ = ("pieces", "order", "counts", "firsts", "ends", "value_ends", "dims", "ids", "values")

    def __init__(self, tables: list[TableView], pieces: list[Piece], servers: int, push: bool):
        self.pieces = pieces
        n = len(pieces)
        id_starts = np.fromiter(itertools.accumulate(map(len, map(_IDS, pieces)), initial=0), np.int64, n + 1)
        ids = np.concatenate(list(map(_IDS, pieces))) if n > 1 else np.asarray(pieces[0].ids)
        primaries = list(map(_PRIMARY, tables))
        primary_starts = np.fromiter(itertools.accumulate(map(len, primaries), initial=0), np.int64, n + 1)
        self.order = np.empty(ids.shape[0], np.int64)
        self.counts = counts = np.zeros((servers, n), np.int64)
        self.firsts = np.empty((servers, n), np.int64)
        bad, block = _route(ids, id_starts, np.fromiter(map(_NUM_BLOCKS, tables), np.int64, n),
                            np.fromiter(map(_WHOLE_ON, tables), np.int64, n), np.concatenate(primaries),
                            primary_starts, self.order, counts, self.firsts)
        if bad >= 0:
            raise Unavailable(f"block {block} of table {tables[bad].name!r} has no live replica under the current "
                              f"map: wait for the manager to re-place it (or restore a checkpoint)")
        self.ends = [0, *np.cumsum(counts.sum(axis=1)).tolist()]    # server s's rows: [ends[s], ends[s + 1])
        self.dims = dims = np.fromiter(map(_DIM, tables), np.int64, n)
        self.value_ends = self.ends                 # server s's values: [value_ends[s], value_ends[s + 1])
        self.ids, self.values = np.empty(ids.shape[0], np.int64), NO_VALUES
        value_starts = id_starts
        if push:
            value_starts = np.zeros(n + 1, np.int64)
            np.cumsum(np.diff(id_starts) * dims, out=value_starts[1:])
            self.value_ends = [0, *np.cumsum(counts @ dims).tolist()]
            self.values = np.empty(self.value_ends[-1], np.float32)
        _gather(ids, id_starts, np.concatenate(list(map(_VALUES, pieces)), axis=None, dtype=np.float32) if push
                else NO_VALUES, value_starts, dims, self.order, counts, self.ids, self.values)

    def servers(self) -> list[int]:
        """The servers some row goes to (their indices, ascending)."""
        return np.flatnonzero(self.counts.any(axis=1)).tolist()

    def rows(self, server: int) -> Rows | None:
        """Server ``server``'s segments: one per piece it takes rows of, in piece order (None:
        it takes none)."""
        at, end = self.ends[server], self.ends[server + 1]
        if at == end:
            return None
        counts = self.counts[server]
        keep = counts.nonzero()[0]
        values = self.values[self.value_ends[server]:self.value_ends[server + 1]] if self.values.size else NO_VALUES
        return Rows(tuple(map(_TABLE, map(self.pieces.__getitem__, keep.tolist()))), counts[keep], self.dims[keep],
                    self.ids[at:end], values)

    def places(self, server: int, outputs: list) -> list[tuple[np.ndarray, np.ndarray | None, int, int]]:
        """Where server ``server``'s reply to a pull goes, segment by segment in ``rows``'
        order: (dest, where, elements, rows). A segment of consecutive rows of its piece's
        output is a flat view of them (``where`` None), else ``dest`` is the output and
        ``where`` its rows' positions in it."""
        counts = self.counts[server]
        keep = counts.nonzero()[0]
        pieces = list(map(self.pieces.__getitem__, keep.tolist()))
        starts = itertools.accumulate(counts[keep].tolist(), initial=self.ends[server])
        return [(out[first:first + n].reshape(-1), None, n * out.shape[1], n) if first >= 0 and p.positions is None
                else _scattered(p, out, self.order[a:a + n])
                for p, out, first, n, a in zip(pieces, map(outputs.__getitem__, map(_ITEM, pieces)),
                                               self.firsts[server, keep].tolist(), counts[keep].tolist(), starts)]


def _scattered(piece: Piece, out: np.ndarray, local: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, int, int]:
    """``RowsRoute.places``' place of rows that are not consecutive rows of the piece: its
    rows at ``local``, which go to rows ``piece.positions[local]`` of ``out`` (when those are
    consecutive: a flat view of them)."""
    n = local.shape[0]
    where = local if piece.positions is None else piece.positions[local]
    start = contiguous_start(where)
    if start is None:
        return out, where, n * out.shape[1], n
    return out[start:start + n].reshape(-1), None, n * out.shape[1], n


def contiguous_start(positions: np.ndarray | None) -> int | None:
    """The first of ``positions`` when they are consecutive (``k, k + 1, ...``; a piece
    routed whole), else None."""
    if positions is None or not positions.shape[0]:
        return None
    first = int(positions[0])
    if int(positions[-1]) - first != positions.shape[0] - 1 or not kernels.strictly_increasing(positions):
        return None
    return first


_TABLE, _ITEM = operator.attrgetter("table"), operator.attrgetter("item")


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernels, for the arrays a call passes."""
    if kernels.AVAILABLE:
        ids, starts, order = np.arange(3, dtype=np.int64), np.array([0, 3], np.int64), np.empty(3, np.int64)
        counts = np.zeros((1, 1), np.int64)
        _route(ids, starts, np.ones(1, np.int64), np.full(1, -1, np.int64), np.zeros(1, np.int32), starts, order,
               counts, np.empty((1, 1), np.int64))
        for values in (np.zeros(6, np.float32), NO_VALUES):
            _gather(ids, starts, values, starts, np.full(1, 2, np.int64), order, counts, np.empty(3, np.int64),
                    np.empty(values.shape[0], np.float32))
