"""The wire encoding, written independently of the library: raw protobuf chunks, the sparse
block hash, and float values in every wire dtype (what the contract says, in numpy)."""

from __future__ import annotations

import numpy as np

from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import parameter_server_pb2 as ps


def push_chunks(header: bytes, payload: bytes, cuts: list[int] = ()) -> list[bytes]:
    """PushChunk messages (plain protobuf, not the library's codec): header + data pieces."""
    bounds = [0] + sorted(c for c in cuts if 0 < c < len(payload)) + [len(payload)]
    pieces = [payload[a:b] for a, b in zip(bounds, bounds[1:])] or [b""]
    chunks = [ps.PushChunk(header=ps.PushHeader.FromString(header), data=pieces[0]).SerializeToString()
              if parses(ps.PushHeader, header) else raw_chunk(header, pieces[0])]
    chunks += [ps.PushChunk(data=p).SerializeToString() for p in pieces[1:]]
    return chunks


def raw_chunk(header: bytes, data: bytes) -> bytes:
    """A chunk whose header field holds arbitrary bytes (what a broken client could send)."""
    return _field(1, header) + (_field(2, data) if data else b"")


def _field(number: int, value: bytes) -> bytes:
    return _varint((number << 3) | 2) + _varint(len(value)) + value


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def parses(cls, raw: bytes):
    try:
        return cls.FromString(raw)
    except Exception:
        return None


def splitmix64(x: int) -> int:
    """The contract's sparse block hash (common.proto): splitmix64 of the id as uint64."""
    mask = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def widen(raw: bytes, wire: int, count: int) -> np.ndarray:
    """Wire values to float32, as the contract says the server does."""
    with np.errstate(over="ignore", invalid="ignore"):
        if wire in (0, pb.FLOAT32):
            return np.frombuffer(raw, "<f4", count).astype(np.float32)
        if wire == pb.FLOAT16:
            return np.frombuffer(raw, "<f2", count).astype(np.float32)
        if wire == pb.BFLOAT16:
            return (np.frombuffer(raw, "<u2", count).astype(np.uint32) << 16).view(np.float32)
        return np.frombuffer(raw, "<f8", count).astype(np.float32)


def narrow_expected(values: np.ndarray, wire: int) -> np.ndarray:
    """What float32 ``values`` read back as after travelling in ``wire`` (round to nearest even)."""
    values = np.asarray(values, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        if wire in (0, pb.FLOAT32, pb.FLOAT64):
            return values.copy()
        if wire == pb.FLOAT16:
            return values.astype(np.float16).astype(np.float32)
        bits = values.view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
        out = (rounded.astype(np.uint32) << 16).view(np.float32)
        out[np.isnan(values)] = np.nan
        return out


ITEMSIZE = {0: 4, pb.FLOAT32: 4, pb.FLOAT16: 2, pb.BFLOAT16: 2, pb.FLOAT64: 8}


def encode_values(values: np.ndarray, wire: int) -> bytes:
    with np.errstate(over="ignore", invalid="ignore"):
        if wire in (0, pb.FLOAT32):
            return np.asarray(values, "<f4").tobytes()
        if wire == pb.FLOAT16:
            return np.asarray(values, "<f2").tobytes()
        if wire == pb.BFLOAT16:
            return (np.asarray(values, "<f4").view(np.uint32) >> 16).astype("<u2").tobytes()
        return np.asarray(values, "<f8").tobytes()
