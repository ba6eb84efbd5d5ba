"""Routing: cut pull/push requests into per-server pieces with the published shard map.

Pure (numpy + the map view). A *piece* is the part of one request item that one server
serves: a dense sub-range, or a subset of sparse ids. Pieces are re-routable: when a server
refuses a piece (stale epoch, unavailable), the client refreshes the map and routes the same
pieces again, so a retry re-sends exactly what was not acknowledged.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass

import numpy as np

from shardps import id_blocks, kernels
from shardps.errors import Unavailable
from shardps.shardmap import ShardMapView, TableView


@dataclass
class Piece:
    """Part of request item ``item`` for table ``table``.

    Dense: the flat range [start, stop) whose output begins at ``offset`` in the item's output.
    Sparse: ``ids`` (unique), whose rows go to ``positions`` of the item's output (None: to
    its rows ``0, 1, ..., n - 1`` in order, which a reply then fills as one span).
    ``values`` (push): float32, dense 1-d or sparse [n, dim]. ``all_stored``: export pulls.
    """

    item: int
    table: str
    dense: bool
    start: int = 0
    stop: int = 0
    offset: int = 0
    ids: np.ndarray | None = None
    positions: np.ndarray | None = None
    values: np.ndarray | None = None
    all_stored: bool = False

    @property
    def rows(self) -> int:
        return 0 if self.ids is None else int(self.ids.shape[0])


class Outputs(list):
    """A pull's outputs, one per request item (a list). Items whose ``starts[item]`` is not
    negative are views of the one float32 array ``flat``, beginning at that element: their
    rows can be written by one compiled scatter (``step_plan.RowsRoute.places``)."""

    def __init__(self, outputs, flat: np.ndarray | None = None, starts: list[int] | None = None):
        super().__init__(outputs)
        self.flat = flat
        self.starts = starts


def route(view: ShardMapView, job: str, pieces: list[Piece]) -> dict[str, list[Piece]]:
    """Split pieces by the primary server of their blocks: {server name: pieces}."""
    out: dict[str, list[Piece]] = {}
    names = view.server_names
    for p in pieces:
        t = view.table(job, p.table)
        if p.all_stored:
            for idx in sorted(set(int(x) for x in t.primary if x >= 0)):
                out.setdefault(names[idx], []).append(p)
            continue
        if p.dense:
            for server, sub in _route_dense(t, p):
                out.setdefault(names[server], []).append(sub)
        else:
            for server, sub in _route_sparse(t, p):
                out.setdefault(names[server], []).append(sub)
    return out


def _no_replica(t: TableView, block: int) -> Unavailable:
    return Unavailable(f"block {block} of table {t.name!r} has no live replica under the current "
                       f"map: wait for the manager to re-place it (or restore a checkpoint)")


def _route_dense(t: TableView, p: Piece):
    bs = t.spec.block_size
    b0, b1 = p.start // bs, (p.stop - 1) // bs
    if b0 == b1:                        # one block (a small table): no arrays to cut
        server = int(t.primary[b0])
        if server < 0:
            raise _no_replica(t, b0)
        yield server, p
        return
    prim = t.primary[b0:b1 + 1]
    if (prim < 0).any():
        raise _no_replica(t, b0 + int(np.flatnonzero(prim < 0)[0]))
    cuts = np.flatnonzero(prim[1:] != prim[:-1]) + 1
    starts = np.concatenate(([0], cuts))
    ends = np.concatenate((cuts, [prim.shape[0]]))
    for s, e in zip(starts, ends):
        lo = max(p.start, (b0 + int(s)) * bs)
        hi = min(p.stop, (b0 + int(e)) * bs)
        sub = Piece(p.item, p.table, True, lo, hi, p.offset + (lo - p.start))
        if p.values is not None:
            sub.values = p.values[lo - p.start:hi - p.start]
        yield int(prim[s]), sub


def _route_sparse(t: TableView, p: Piece):
    assert p.ids is not None                # a sparse piece carries its ids
    if p.ids.shape[0] == 0:
        return
    if t.whole_on >= 0:
        yield t.whole_on, p            # the table on one server (a small one's default): whole
        return
    if kernels.AVAILABLE:
        for server, pos in _rows_by_server(t, p.ids):
            yield server, _rows_of(p, pos)
        return
    blocks = id_blocks.sparse_block_of(p.ids, t.spec.num_blocks)
    servers = t.primary[blocks]
    if (servers < 0).any():
        raise _no_replica(t, int(blocks[np.flatnonzero(servers < 0)[0]]))
    for server, pos in kernels.group_by_key(servers, len(t.server_index)):
        yield server, _rows_of(p, pos)


def _rows_of(p: Piece, pos: np.ndarray) -> Piece:
    """The sparse piece of ``p``'s rows at ``pos``."""
    assert p.ids is not None
    sub = Piece(p.item, p.table, False, ids=p.ids[pos], positions=pos if p.positions is None else p.positions[pos])
    if p.values is not None:
        sub.values = p.values[pos]
    return sub


# One dense piece's part for one server: (piece, start, stop), the flat range [start, stop)
# of the piece's (its values not copied: the transport sends them from there).
Part = tuple[Piece, int, int]


_TABLE = operator.attrgetter("table")


def route_ranges(view: ShardMapView, job: str, pieces: list[Piece]) -> dict[str, list[Part]]:
    """``route`` of dense pieces for the compiled request path: the same split by primary
    server, as parts that point into the pieces' arrays (a call's sparse pieces are routed
    together: ``client.step_plan.RowsRoute``)."""
    out: dict[str, list[Part]] = {}
    names = view.server_names
    found = list(map(view.tables.get, zip(itertools.repeat(job), map(_TABLE, pieces))))
    tables: list[TableView] = [view.table(job, p.table) for p in pieces] if None in found else found  # type: ignore
    for p, t in zip(pieces, tables):
        for server, sub in _route_dense(t, p):
            out.setdefault(names[server], []).append((p, sub.start, sub.stop))
    return out


def _rows_by_server(t: TableView, ids: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(server index, positions of its ids, ascending) of every server some of ``ids`` go
    to, by their blocks' primaries (one compiled pass; numba only)."""
    got = id_blocks.route_rows(ids, t.spec.num_blocks, t.primary, len(t.server_index))
    if isinstance(got, int):
        raise _no_replica(t, got)
    order, starts = got
    bounds = starts.tolist()
    return [(server, order[a:z]) for server, (a, z) in enumerate(zip(bounds, bounds[1:])) if a < z]


def live_servers(view: ShardMapView) -> list[str]:
    """Servers a step report must reach (SYNC / SSP): every server not declared dead, so
    that each keeps the group's clocks even before it holds any of the job's blocks."""
    return [name for name in view.server_names if name not in view.dead]
