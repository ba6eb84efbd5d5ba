"""Replication's messages: ``shardps.blockops``'s plain values into protobuf and back (the
forwarded ops of ``Replicate``, the block states of ``LoadBlocks`` / ``SnapshotBlocks``), for
the gRPC stubs and the data plane alike."""

from __future__ import annotations

from typing import Sequence

from shardps.blockops import ArrayInfo, BlockOp, BlockRef, BlockState, Writer
from shardps.errors import InvalidArgument
from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import parameter_server_pb2 as ps

_DTYPE_CODES = {"<f4": pb.FLOAT32, "<i8": pb.INT64, "<f8": pb.FLOAT64}
_DTYPES = {code: name for name, code in _DTYPE_CODES.items()}


def op_message(op: BlockOp) -> ps.BlockOp:
    w = op.writer
    out = ps.BlockOp(job=op.job, table=op.table, block=op.block, kind=op.kind,  # type: ignore[arg-type]
                     writer=ps.WriterId(session=w.session, incarnation=w.incarnation, sequence=w.sequence,
                                        acked_below=w.acked_below),
                     version=op.version, config_version=op.config_version, step=op.step, divisor=op.divisor,
                     id_count=op.id_count, element_count=op.element_count, dropped_count=op.dropped_count,
                     evicted_count=op.evicted_count, cooled_count=op.cooled_count, blocks=op.blocks,
                     versions=op.versions, same_step=op.same_step)
    if op.start or op.stop:
        out.range.start, out.range.stop = op.start, op.stop
    return out


def op_plain(msg: ps.BlockOp) -> BlockOp:
    w = msg.writer
    return BlockOp(msg.job, msg.table, msg.block, msg.kind, Writer(w.session, w.incarnation, w.sequence, w.acked_below),
                   msg.version, msg.config_version, msg.step, msg.divisor, msg.id_count, msg.element_count,
                   msg.range.start, msg.range.stop, msg.dropped_count, msg.evicted_count, msg.cooled_count,
                   list(msg.blocks), list(msg.versions), msg.same_step)


def replicate_header(epoch: int, source: str, ops: Sequence[BlockOp], payload_bytes: int) -> bytes:
    """A ``Replicate`` call's header, encoded: ``ops``'s arrays follow as its payload."""
    return ps.ReplicateHeader(epoch=epoch, source=source, ops=[op_message(op) for op in ops],
                              payload_bytes=payload_bytes).SerializeToString()


def replicate_request(header: ps.ReplicateHeader) -> tuple[int, str, list[BlockOp]]:
    """(sender's epoch, sender, ops) of a ``Replicate`` call's header."""
    return header.epoch, header.source, [op_plain(op) for op in header.ops]


def replicate_ack(applied: int, out_of_sync: Sequence[tuple[str, str, int]]) -> ps.ReplicateAck:
    ack = ps.ReplicateAck(applied=applied)
    for job, table, block in out_of_sync:
        ack.out_of_sync.add(job=job, table=table, block=block)
    return ack


def out_of_sync(ack: ps.ReplicateAck) -> list[tuple[str, str, int]]:
    """The blocks a backup's ``ReplicateAck`` reports out of sync."""
    return [(r.job, r.table, r.block) for r in ack.out_of_sync]


def state_message(state: BlockState) -> ps.BlockStateHeader:
    ref = state.ref
    out = ps.BlockStateHeader(ref=ps.BlockRef(job=ref.job, table=ref.table, block=ref.block),
                              version=state.version, initialized=state.initialized, metadata=state.metadata)
    for info in state.arrays:
        out.arrays.add(name=info.name, dtype=_DTYPE_CODES[info.dtype], shape=list(info.shape))
    return out


def state_plain(msg: ps.BlockStateHeader) -> BlockState:
    """A ``BlockStateHeader`` as plain values; InvalidArgument for an array dtype other than
    FLOAT32, FLOAT64 or INT64."""
    ref = BlockRef(msg.ref.job, msg.ref.table, msg.ref.block)
    arrays = []
    for info in msg.arrays:
        if info.dtype not in _DTYPES:
            raise InvalidArgument(f"block {tuple(ref)}: array {info.name!r} dtype {info.dtype}: block state "
                                  f"travels as FLOAT32, FLOAT64 or INT64")
        arrays.append(ArrayInfo(info.name, _DTYPES[info.dtype], tuple(info.shape)))
    return BlockState(ref, msg.version, msg.initialized, arrays, msg.metadata)
