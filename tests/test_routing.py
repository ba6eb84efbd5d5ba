"""``route``: which server gets which rows of a sparse piece. Plain objects: shard maps built
here."""

from __future__ import annotations

import numpy as np
import pytest

from shardps.errors import Unavailable
from shardps.id_blocks import sparse_block_of
from shardps.protos.v1 import common_pb2 as pb
from shardps.rpc.convert import config_to_proto, spec_to_proto
from shardps.shardmap import ShardMapView
from shardps.tables import TableConfig, sparse_table
from shardps.worker.routing import Piece, route

JOB = "routing"


def _view(primaries: list[int]) -> ShardMapView:
    """Servers s0 and s1; sparse table "e" with one block per entry of ``primaries``."""
    msg = pb.ShardMap(epoch=1, replication=1)
    for name in ("s0", "s1"):
        msg.servers.add(name=name, address=f"{name}:1", incarnation=1, state=pb.SERVING)
    spec = sparse_table("e", 4, num_rows=1000, num_blocks=len(primaries))
    t = msg.tables.add(job=JOB, spec=spec_to_proto(spec), config=config_to_proto(TableConfig()))
    for p in primaries:
        t.blocks.add(replicas=[p] if p >= 0 else [], since_epoch=1, fresh_epoch=1)
    return ShardMapView(msg)


def _piece(in_order: bool = False) -> Piece:
    """A sparse piece; ``in_order``: its rows are the item's, in order (``positions`` None)."""
    ids = np.arange(0, 1000, 7, dtype=np.int64)
    values = np.arange(ids.shape[0] * 4, dtype=np.float32).reshape(-1, 4)
    return Piece(0, "e", False, ids=ids, positions=None if in_order else np.arange(ids.shape[0]) * 2, values=values)


@pytest.mark.parametrize("primaries", [[1], [0, 0, 0, 0]])
def test_a_table_on_one_server_goes_whole(primaries):
    piece = _piece()
    out = route(_view(primaries), JOB, [piece])
    server = f"s{primaries[0]}"
    assert list(out) == [server] and len(out[server]) == 1 and out[server][0] is piece     # not copied


@pytest.mark.parametrize("in_order", [False, True])
def test_a_table_over_two_servers_is_split_by_block(in_order):
    primaries = [0, 1, 1, 0]
    piece = _piece(in_order)
    out = route(_view(primaries), JOB, [piece])
    owner = np.array(primaries)[sparse_block_of(piece.ids, 4)]
    assert sorted(out) == ["s0", "s1"]
    for server, (sub,) in out.items():
        mine = owner == int(server[1])
        assert np.array_equal(np.sort(sub.ids), piece.ids[mine])
        rows = sub.positions if in_order else sub.positions // 2      # the item's rows they go to
        assert np.array_equal(piece.ids[rows], sub.ids)
        assert np.array_equal(sub.values, piece.values[rows])


@pytest.mark.parametrize("primaries", [[-1], [-1, -1], [0, -1]])
def test_rows_of_a_block_without_a_replica_are_refused_naming_it(primaries):
    with pytest.raises(Unavailable, match=r"block \d+ of table 'e' has no live replica"):
        route(_view(primaries), JOB, [_piece()])


def test_a_pulls_destination_is_one_contiguous_piece_of_its_output_or_none():
    """``steps.destination``: where one server's pulled values may be received in place (rows:
    ``tests/test_step_plan_rows.py``)."""
    from shardps.worker.client import steps

    def destination(parts, outputs, reply_bytes):
        return steps.destination([steps._place(part, outputs[part[0].item]) for part in parts], reply_bytes)

    flat = np.zeros(1000, np.float32)
    dense = Piece(0, "w", True, start=100, stop=900, offset=0)
    got = destination([(dense, 200, 700)], [flat], 4 * 500)
    assert got is not None and got.dtype == np.uint8 and got.nbytes == 2000
    assert got.__array_interface__["data"][0] == flat[100:].__array_interface__["data"][0]
    assert destination([(dense, 200, 700)], [flat], 4 * 499) is None           # another size
    assert destination([(dense, 200, 300), (dense, 400, 500)], [flat], 800) is None
