"""Chunked gRPC streams read back whole: a Push's or a Replicate's chunks (``collect_chunks``)
and block snapshots (``decode_snapshots``, the inverse of ``shardps.rpc.stubs.encode_snapshots``)."""

from __future__ import annotations

import numpy as np

from shardps.blockops import BlockSnapshot, BlockState
from shardps.errors import InvalidArgument, ResourceExhausted
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.rpc.codec import assemble
from shardps.rpc.replication import state_plain


def collect_chunks(chunks, header_cls, limit: int, what: str, empty: str = ""):
    """Header of the first chunk and the concatenated data of all chunks (size-checked).
    An empty stream is refused (``empty``: what the message adds)."""
    rest = iter(chunks)
    first = next(rest, None)
    if first is None:
        raise InvalidArgument(f"{what}: empty stream{empty}")
    header = first.parse_header(header_cls)
    if header is None:
        raise InvalidArgument(f"{what}: the first chunk must carry the header")
    declared = int(getattr(header, "payload_bytes", 0))
    in_shared_memory = bool(getattr(header, "shared_memory", None) and header.shared_memory.name)
    if declared > limit:
        raise ResourceExhausted(f"{what} declares {declared} bytes; the limit max_request_bytes "
                                f"is {limit}: split the request")
    pieces = [first.data] if len(first.data) else []
    total = len(first.data)
    for chunk in rest:
        if chunk.header is not None:
            raise InvalidArgument(f"{what}: only the first chunk may carry a header")
        total += len(chunk.data)
        if total > limit:
            raise ResourceExhausted(f"{what} exceeds {limit} bytes (limit max_request_bytes): "
                                    f"split the request")
        pieces.append(chunk.data)
    if in_shared_memory:
        if total:
            raise InvalidArgument(f"{what}: the payload is in shared memory; chunks must not carry data")
    elif declared and total != declared:
        raise InvalidArgument(f"{what}: chunks carry {total} bytes but the header declares "
                              f"{declared} (truncated stream?)")
    payload = assemble(pieces, total) if pieces else memoryview(b"")
    return header, payload


def decode_snapshots(chunks) -> tuple[int, list[BlockSnapshot]]:
    """Inverse of ``encode_snapshots``: (sender's epoch, snapshots)."""
    snapshots: list[BlockSnapshot] = []
    epoch = 0
    current: BlockState | None = None
    pieces: list = []

    def close():
        if current is None:
            return
        data = assemble(pieces) if pieces else memoryview(b"")
        arrays, pos = [], 0
        for info in current.arrays:
            dt = np.dtype(info.dtype)
            if any(d < 0 for d in info.shape):
                raise InvalidArgument(f"block {tuple(current.ref)}: array {info.name!r} shape {list(info.shape)}")
            count = int(np.prod(info.shape, dtype=object)) if len(info.shape) else 1
            n = count * dt.itemsize
            if pos + n > len(data):
                raise InvalidArgument(f"block {tuple(current.ref)}: array {info.name!r} is truncated")
            arrays.append(np.frombuffer(data[pos:pos + n], dtype=dt).reshape(tuple(info.shape)).copy())
            pos += n
        if pos != len(data):
            raise InvalidArgument(f"block {tuple(current.ref)}: {len(data) - pos} unexpected bytes")
        snapshots.append(BlockSnapshot(current, arrays))

    for chunk in chunks:
        if chunk.header is not None:
            close()
            current = state_plain(ps.BlockStateHeader.FromString(chunk.header))
            pieces = []
            epoch = max(epoch, int(chunk.extra.get(3, 0)))
        elif current is None:
            raise InvalidArgument("LoadBlocks: the first chunk must carry a block header")
        if len(chunk.data):
            pieces.append(chunk.data)
    close()
    return epoch, snapshots
