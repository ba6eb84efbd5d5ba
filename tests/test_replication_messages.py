"""Replication's plain values (``shardps.blockops``) travel through their protobuf messages
(``shardps.rpc.replication``) unchanged: every field of a block op and of a block state, and a
message another client sends with a field the plain values cannot hold is refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from shardps.blockops import APPLY_ROWS, ArrayInfo, BlockOp, BlockRef, BlockSnapshot, BlockState, Writer
from shardps.errors import InvalidArgument
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.rpc import replication
from shardps.rpc.chunks import decode_snapshots
from shardps.rpc.codec import decode_chunk
from shardps.rpc.stubs import encode_snapshots


def _every_field_set() -> BlockOp:
    """A block op whose every field differs from its default (and from each other's value)."""
    return BlockOp("job", "table", 3, APPLY_ROWS, Writer("session", 4, 5, 6), version=7, config_version=8,
                   step=9, divisor=10, id_count=11, element_count=12, start=13, stop=14, dropped_count=15,
                   evicted_count=16, cooled_count=17, blocks=[3, 18], versions=[19, 20], same_step=True)


def test_every_field_of_a_block_op_survives_the_wire():
    op = _every_field_set()
    defaults = BlockOp("", "", 0)
    unset = [f.name for f in dataclasses.fields(BlockOp) if getattr(op, f.name) == getattr(defaults, f.name)]
    assert unset == [], f"the test leaves {unset} at their defaults: it would not see them lost"
    raw = replication.replicate_header(21, "s0", [op, BlockOp("job", "table", 0)], 22)
    epoch, source, ops = replication.replicate_request(ps.ReplicateHeader.FromString(raw))
    assert (epoch, source) == (21, "s0")
    assert ops == [op, BlockOp("job", "table", 0)]
    assert ps.ReplicateHeader.FromString(raw).payload_bytes == 22


def test_the_out_of_sync_blocks_survive_the_wire():
    ack = replication.replicate_ack(2, [("j", "t", 1), ("j", "u", 0)])
    read = ps.ReplicateAck.FromString(ack.SerializeToString())
    assert replication.out_of_sync(read) == [("j", "t", 1), ("j", "u", 0)]
    assert ack.applied == 2


def test_a_block_state_survives_the_chunk_stream():
    values = np.arange(12, dtype="<f4").reshape(3, 4)
    ids = np.array([5, 9, 2], dtype="<i8")
    state = BlockState(BlockRef("j", "t", 2), version=7, initialized=True,
                       arrays=[ArrayInfo("values", "<f4", (3, 4)), ArrayInfo("ids", "<i8", (3,))],
                       metadata=b'{"writers": {}}')
    stream = encode_snapshots([BlockSnapshot(state, [values, ids])], epoch=9, chunk_bytes=16)
    epoch, (snap,) = decode_snapshots(map(decode_chunk, stream))
    assert epoch == 9 and snap.header == state
    np.testing.assert_array_equal(snap.arrays[0], values)
    np.testing.assert_array_equal(snap.arrays[1], ids)


def test_a_block_state_of_another_dtype_is_refused_naming_it():
    msg = ps.BlockStateHeader(ref=ps.BlockRef(job="j", table="t", block=0))
    msg.arrays.add(name="values", dtype=99, shape=[1])
    with pytest.raises(InvalidArgument, match="array 'values' dtype 99"):
        replication.state_plain(msg)
