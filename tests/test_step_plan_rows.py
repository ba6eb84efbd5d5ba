"""A call's sparse rows routed and gathered together (``worker/client/step_plan.py``) send the
very bytes that routing each piece on its own sends (``routing.route``, the general path's,
its sub-pieces one segment each), and a pull's reply lands in the same rows, for tables of
several dims spread over several servers, one placed whole, and a piece whose rows go to
positions of its output. Plain objects: shard maps built here."""

from __future__ import annotations

import numpy as np
import pytest

from shardps import kernels
from shardps.errors import Unavailable
from shardps.messages import Header
from shardps.protos.v1 import common_pb2 as pb
from shardps.rpc import step
from shardps.rpc.convert import config_to_proto, spec_to_proto
from shardps.shardmap import ShardMapView
from shardps.tables import TableConfig, sparse_table
from shardps.worker.client import steps
from shardps.worker.client.step_plan import RowsRoute, Scatter, Tables
from shardps.worker.routing import Outputs, Piece, route

pytestmark = pytest.mark.skipif(not kernels.AVAILABLE, reason="the rows are routed together with numba only")

JOB = "rows"
# table -> (dim, each block's primary server index; -1: none)
TABLES = {"a": (4, [0, 1, 2, 1]), "b": (3, [1, 1]), "c": (8, [2, 0, 0]), "d": (2, [0])}


def _view(tables: dict = TABLES) -> ShardMapView:
    msg = pb.ShardMap(epoch=1, replication=1)
    for name in ("s0", "s1", "s2"):
        msg.servers.add(name=name, address=f"{name}:1", incarnation=1, state=pb.SERVING)
    for name, (dim, primaries) in tables.items():
        spec = sparse_table(name, dim, num_rows=10_000, num_blocks=len(primaries))
        t = msg.tables.add(job=JOB, spec=spec_to_proto(spec), config=config_to_proto(TableConfig()))
        for p in primaries:
            t.blocks.add(replicas=[p] if p >= 0 else [], since_epoch=1, fresh_epoch=1)
    return ShardMapView(msg)


def _pieces(seed: int, push: bool) -> list[Piece]:
    """A piece of each table (item = its place), distinct ids in no order; "d" of none; in a
    pull, "c"'s rows go to every other row of its output (``positions``)."""
    rng = np.random.default_rng(seed)
    out = []
    for item, (name, (dim, _)) in enumerate(TABLES.items()):
        n = 0 if name == "d" else int(rng.integers(20, 60))
        ids = rng.choice(10_000, n, replace=False).astype(np.int64)
        values = rng.standard_normal((n, dim)).astype(np.float32) if push else None
        positions = 2 * np.arange(n) if name == "c" and not push else None
        out.append(Piece(item, name, False, ids=ids, values=values, positions=positions))
    return out


def _segments(pieces: list[Piece], push: bool) -> list:
    """``Encoded``'s segments of routed sub-pieces, one each."""
    return [(p.table, step.ROWS_CODE, p.ids.shape[0], 0, p.ids, p.values if push else step.NO_VALUES, ())
            for p in pieces]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_servers_rows_are_the_bytes_its_parts_send(seed):
    view = _view()
    push, pull = _pieces(seed, push=True), _pieces(seed + 10, push=False)
    tables = Tables([view.table(JOB, p.table) for p in push], 3)
    pushes, pulls = RowsRoute(tables, push, True), RowsRoute(tables, pull, False)
    by_part_push, by_part_pull = route(view, JOB, push), route(view, JOB, pull)
    assert pushes.taking() == [0, 1, 2] and pulls.taking() == [0, 1, 2]
    header = Header(JOB, epoch=1, session="w", incarnation=1, sequence=4, acked_below=4)
    for k, server in enumerate(("s0", "s1", "s2")):
        together = step.Encoded(header, 1, 3, None, None, pushes.rows(k), pulls.rows(k))
        alone = step.Encoded(header, 1, 3, _segments(by_part_push[server], True),
                             _segments(by_part_pull[server], False))
        assert together.tables == alone.tables
        assert together.header("region", 0, 64, 128) == alone.header("region", 0, 64, 128)
        assert together.push_counts() == alone.push_counts()
        region = np.zeros((2, together.payload_bytes), np.uint8)
        together.write(region[0])
        alone.write(region[1])
        assert region[0].tobytes() == region[1].tobytes()
        assert b"".join(map(bytes, together.parts())) == b"".join(map(bytes, alone.parts()))


@pytest.mark.parametrize("seed", [4, 5])
def test_a_pulls_reply_lands_in_the_rows_its_sub_pieces_name(seed):
    view = _view()
    pull = _pieces(seed, push=False)
    rows = RowsRoute(Tables([view.table(JOB, p.table) for p in pull], 3), pull, False)
    by_piece = route(view, JOB, pull)

    def outputs():
        return [np.zeros((2 * p.ids.shape[0], TABLES[p.table][0]), np.float32) for p in pull]

    together, alone = outputs(), outputs()
    for k, server in enumerate(("s0", "s1", "s2")):
        places = rows.places(k, together)
        assert [p[3] for p in places] == [sub.ids.shape[0] for sub in by_piece[server]]     # rows
        values = np.arange(sum(p[2] for p in places), dtype=np.float32) + 1000 * k
        steps.scatter(places, values)
        at = 0
        for sub in by_piece[server]:
            out = alone[sub.item]
            n = sub.ids.shape[0] * out.shape[1]
            out[np.arange(sub.ids.shape[0]) if sub.positions is None else sub.positions] = \
                values[at:at + n].reshape(-1, out.shape[1])
            at += n
    for a, b in zip(together, alone):
        assert np.array_equal(a, b)
    assert all(o.any() for o, p in zip(together, pull) if p.ids.shape[0])      # every row written


@pytest.mark.parametrize("seed", [6, 7])
def test_a_pulls_rows_into_views_of_one_array_are_placed_by_one_call_per_server(seed):
    """Outputs that are views of one array (``routing.Outputs``, as ``requests.pull_pieces``
    makes them): each server's rows of every table are one place, written by one compiled
    call, to the rows the per-segment places write."""
    view = _view()
    pull = [Piece(p.item, p.table, False, ids=p.ids) for p in _pieces(seed, push=False)]     # no positions
    tables = Tables([view.table(JOB, p.table) for p in pull], 3)
    sizes = [p.ids.shape[0] * TABLES[p.table][0] for p in pull]
    flat = np.zeros(sum(sizes), np.float32)
    starts = np.cumsum([0, *sizes[:-1]])
    one = Outputs([flat[a:a + n].reshape(-1, TABLES[p.table][0]) for p, a, n in zip(pull, starts, sizes)],
                  flat, starts.tolist())
    apart = [np.zeros_like(o) for o in one]
    together, alone = RowsRoute(tables, pull, False), RowsRoute(tables, pull, False)
    for k in range(3):
        places, per_segment = together.places(k, one), alone.places(k, apart)
        assert len(places) == 1 and isinstance(places[0][1], Scatter)
        assert places[0][2:] == (sum(p[2] for p in per_segment), sum(p[3] for p in per_segment))
        assert together.elements(k) == tuple(p[2] for p in per_segment)
        values = np.arange(places[0][2], dtype=np.float32) + 1 + 1000 * k
        steps.scatter(places, values)
        steps.scatter(per_segment, values)
    for a, b in zip(one, apart):
        assert np.array_equal(a, b)
    assert all(o.all() for o in one)                                       # every row written (values > 0)


def test_a_piece_routed_whole_is_one_span_of_its_output():
    view = _view({"b": (3, [1, 1])})
    piece = Piece(0, "b", False, ids=np.array([9, 3, 7], np.int64))
    rows = RowsRoute(Tables([view.table(JOB, "b")], 3), [piece], False)
    out = np.zeros((3, 3), np.float32)
    assert rows.taking() == [1] and rows.rows(0) is None and rows.rows(2) is None
    (dest, where, elements, n), = rows.places(1, [out])
    assert where is None and (elements, n) == (9, 3) and np.shares_memory(dest, out)
    assert steps.destination([(dest, where, elements, n)], 36) is not None      # received in place


def test_rows_that_go_to_consecutive_rows_of_the_output_are_one_span_of_it():
    view = _view({"b": (4, [1, 1])})
    out = np.zeros((10, 4), np.float32)
    for positions, start in ((np.array([3, 4, 5]), 3), (np.array([0, 2, 4]), None)):
        piece = Piece(0, "b", False, ids=np.array([7, 1, 5], np.int64), positions=positions)
        place = RowsRoute(Tables([view.table(JOB, "b")], 3), [piece], False).places(1, [out])
        got = steps.destination(place, 3 * 16)
        if start is None:
            assert got is None and place[0][1].tolist() == positions.tolist()
        else:
            assert got is not None and got.__array_interface__["data"][0] == out[start:].__array_interface__["data"][0]


def test_rows_of_a_block_without_a_replica_are_refused_naming_it():
    view = _view({"a": (4, [0, -1]), "b": (3, [1])})
    pieces = [Piece(0, "b", False, ids=np.arange(5, dtype=np.int64)),
              Piece(1, "a", False, ids=np.arange(100, dtype=np.int64))]
    with pytest.raises(Unavailable, match=r"block 1 of table 'a' has no live replica"):
        RowsRoute(Tables([view.table(JOB, p.table) for p in pieces], 3), pieces, False)
