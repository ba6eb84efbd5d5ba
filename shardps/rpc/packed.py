"""The packed form of the data plane's Push, Pull and Exchange headers and their replies: the
fields of ``shardps.messages`` in a fixed little-endian layout, read and written with
``struct`` in a few calls, where protobuf objects cost tens of microseconds a request to
build and to parse. A frame carries it when its prefix has ``frames.FLAG_PACKED``; servers
that speak it say so in ``OpenDataPlaneResponse.packed``, and answer a packed request with a
packed reply (``parameter_server.proto`` documents the layout beside the messages it packs).

Layout (``<`` little-endian; ``str`` is ``<H`` length then UTF-8 bytes)::

    header    B version (2), str job, Q epoch, str session, Q incarnation, Q sequence,
              Q acked_below, q clock, B wire_dtype
    segments  H count, then per segment: str table, B selector (0 none, 1 range, 2 rows,
              3 rows with all_stored), then range: q start, q stop / rows: Q count, then
              base versions: I n, n x I block, n x Q version
    push      header, B kind, Q payload_bytes, segments
    pull      header, segments
    exchange  I length of the push, push, pull (the payload: the push's, then the pull's ids)
    versions  H tables, then per table: str table, I n, n x I block, n x Q version
    push ack  I duplicate_blocks, versions
    pull      Q payload_bytes, q min_clock, B in_shared_memory, d waited_seconds,
    reply     H segments, then per segment B dtype, Q elements, Q ids; versions
    exchange  I length of the push ack, push ack, pull reply
    reply
    shared    str name, Q offset, Q length: with ``frames.FLAG_SHARED``, before a Push's or
    region    Pull's header (packed or protobuf): where the push's payload lies, or where the
              pull's reply values go

Decoding refuses anything that does not fit (short, trailing bytes, bad UTF-8, an unknown
selector) with InvalidArgument naming what; it never reads past the buffer.
"""

from __future__ import annotations

import functools
import struct

import numpy as np

from shardps.errors import InvalidArgument
from shardps.messages import (
    RANGE,
    ROWS,
    Header,
    Layout,
    PullReply,
    PullRequest,
    PushAck,
    PushRequest,
    Selection,
    Versions,
)

VERSION = 2                                   # 2: base versions as I n + arrays (1: H n + pairs)
_HEADER_TAIL = struct.Struct("<QQQqB")        # incarnation, sequence, acked_below, clock, wire_dtype
_Q = struct.Struct("<Q")
_H = struct.Struct("<H")
_I = struct.Struct("<I")
_B = struct.Struct("<B")
_RANGE = struct.Struct("<qq")
_PUSH = struct.Struct("<BQ")
_PULL_REPLY = struct.Struct("<QqBdH")
_LAYOUT = struct.Struct("<BQQ")
_SELECT_RANGE = struct.Struct("<Bqq")         # a segment's selector and its range
_SELECT_ROWS = struct.Struct("<BQ")           # ... and its rows' count
_NO_SELECTOR = _B.pack(0)
_NO_VERSIONS = _I.pack(0)                     # base versions: none


# ====================================================================== writing
@functools.lru_cache(maxsize=4096)
def _packed_str(text: str) -> bytes:
    """``text`` as a packed ``str``: a job's, a session's and its tables' names recur in every
    request, so each is encoded once."""
    raw = text.encode()
    if len(raw) > 0xFFFF:
        raise InvalidArgument(f"{text[:40]!r}...: a name of {len(raw)} bytes does not fit a packed header")
    return _H.pack(len(raw)) + raw


def _str(out: list, text: str) -> None:
    out.append(_packed_str(text))


@functools.lru_cache(maxsize=1024)
def _header_head(job: str, epoch: int, session: str) -> bytes:
    """A header's fields up to its session: the same in each request of a session's epoch."""
    return b"".join((_B.pack(VERSION), _packed_str(job), _Q.pack(epoch), _packed_str(session)))


def _header(out: list, h: Header) -> None:
    out.append(_header_head(h.job, h.epoch, h.session))
    out.append(_HEADER_TAIL.pack(h.incarnation, h.sequence, h.acked_below, h.clock, h.wire_dtype))


def _count(out: list, n: int, what: str) -> None:
    if n > 0xFFFF:
        raise InvalidArgument(f"{n} {what}: at most 65,535 fit one packed header; send fewer "
                              f"tables or ranges per call")
    out.append(_H.pack(n))


def _segments(out: list, segments) -> None:
    _count(out, len(segments), "segments in one request to one server")
    for s in segments:
        out.append(_packed_str(s.table))
        if s.selector == RANGE:
            out.append(_SELECT_RANGE.pack(1, s.start, s.stop))
        elif s.selector == ROWS:
            out.append(_SELECT_ROWS.pack(3 if s.all_stored else 2, s.count))
        else:
            out.append(_NO_SELECTOR)
        if s.base_versions:
            _base_versions(out, s.base_versions)
        else:
            out.append(_NO_VERSIONS)


def _base_versions(out: list, base: dict[int, int]) -> None:
    # As _versions writes a table's block versions: a 4-byte count, then two arrays.
    try:
        blocks = np.fromiter(base.keys(), dtype="<u4", count=len(base))
        versions = np.fromiter(base.values(), dtype="<u8", count=len(base))
    except (OverflowError, ValueError, TypeError) as e:
        raise InvalidArgument(f"base versions do not fit a packed header (block <u4, version <u8): {e}") from None
    out.append(_I.pack(blocks.shape[0]))
    out.append(blocks.tobytes())
    out.append(versions.tobytes())


def push(request: PushRequest, payload_bytes: int) -> bytes:
    out: list = []
    _header(out, request.header)
    out.append(_PUSH.pack(request.kind, payload_bytes))
    _segments(out, request.segments)
    return b"".join(out)


def pull(request: PullRequest) -> bytes:
    out: list = []
    _header(out, request.header)
    _segments(out, request.segments)
    return b"".join(out)


def exchange(push_request: PushRequest, payload_bytes: int, pull_request: PullRequest) -> bytes:
    head = push(push_request, payload_bytes)
    return _I.pack(len(head)) + head + pull(pull_request)


def _versions(out: list, versions: list[Versions]) -> None:
    _count(out, len(versions), "tables' versions in one reply")
    for v in versions:
        _str(out, v.table)
        blocks = np.asarray(v.blocks, dtype="<u4")
        out.append(_I.pack(blocks.shape[0]))
        out.append(blocks.tobytes())
        out.append(np.asarray(v.versions, dtype="<u8").tobytes())


def push_ack(ack: PushAck) -> bytes:
    out: list = [_I.pack(ack.duplicate_blocks)]
    _versions(out, ack.versions)
    return b"".join(out)


def pull_reply(reply: PullReply) -> bytes:
    out: list = [_PULL_REPLY.pack(reply.payload_bytes, reply.min_clock, reply.in_shared_memory,
                                  reply.waited_seconds, len(reply.segments))]
    for seg in reply.segments:
        out.append(_LAYOUT.pack(seg.dtype, seg.elements, seg.ids))
    _versions(out, reply.versions)
    return b"".join(out)


def exchange_reply(ack: PushAck, reply: PullReply) -> bytes:
    head = push_ack(ack)
    return _I.pack(len(head)) + head + pull_reply(reply)


def shared_region(name: str, offset: int, length: int) -> bytes:
    out: list = []
    _str(out, name)
    out.append(_RANGE.pack(offset, length))
    return b"".join(out)


# ====================================================================== reading
class _Reader:
    """Fields read in order from a buffer, never past its end."""

    __slots__ = ("buf", "pos", "what")

    def __init__(self, buf, what: str):
        self.buf, self.pos, self.what = memoryview(buf), 0, what

    def take(self, st: struct.Struct) -> tuple:
        try:
            got = st.unpack_from(self.buf, self.pos)
        except struct.error:
            raise InvalidArgument(f"packed {self.what}: {len(self.buf)} bytes end inside a field at byte "
                                  f"{self.pos}") from None
        self.pos += st.size
        return got

    def one(self, st: struct.Struct):
        return self.take(st)[0]

    def str(self) -> str:
        n = self.one(_H)
        raw = self.bytes(n)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            raise InvalidArgument(f"packed {self.what}: a name at byte {self.pos - n} is not UTF-8") from None

    def bytes(self, n: int):
        if self.pos + n > len(self.buf):
            raise InvalidArgument(f"packed {self.what}: {len(self.buf)} bytes end inside a field of {n} "
                                  f"bytes at byte {self.pos}")
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        return raw

    def end(self) -> None:
        if self.pos != len(self.buf):
            raise InvalidArgument(f"packed {self.what}: {len(self.buf) - self.pos} bytes follow its end "
                                  f"at byte {self.pos}")


def _read_header(r: _Reader) -> Header:
    version = r.one(_B)
    if version != VERSION:
        raise InvalidArgument(f"packed {r.what}: version {version}; this side reads {VERSION}")
    job = r.str()
    epoch = r.one(_Q)
    session = r.str()
    incarnation, sequence, acked_below, clock, wire_dtype = r.take(_HEADER_TAIL)
    return Header(job, epoch, session, incarnation, sequence, acked_below, clock, wire_dtype)


def _read_segments(r: _Reader) -> list[Selection]:
    out: list[Selection] = []
    for _ in range(r.one(_H)):
        table = r.str()
        selector = r.one(_B)
        if selector == 1:
            start, stop = r.take(_RANGE)
            s = Selection(table, RANGE, start, stop)
        elif selector in (2, 3):
            s = Selection(table, ROWS, count=r.one(_Q), all_stored=selector == 3)
        elif selector == 0:
            s = Selection(table)
        else:
            raise InvalidArgument(f"packed {r.what}: segment {len(out)} ({table!r}) has selector {selector}; "
                                  f"known: 0 (none), 1 (range), 2 (rows), 3 (all rows)")
        n = r.one(_I)
        if n:
            blocks = np.frombuffer(r.bytes(4 * n), dtype="<u4")
            versions = np.frombuffer(r.bytes(8 * n), dtype="<u8")
            s.base_versions = dict(zip(blocks.tolist(), versions.tolist()))
        out.append(s)
    return out


def read_shared_region(buf) -> tuple[str, int, int, memoryview]:
    """(name, offset, length, the rest of ``buf``) of a header that begins with a shared
    region (``shared_region``)."""
    r = _Reader(buf, "shared-memory region")
    name = r.str()
    offset, length = r.take(_RANGE)
    if offset < 0 or length < 0:
        raise InvalidArgument(f"packed shared-memory region {name!r}: offset {offset} and length {length} "
                              f"must not be negative")
    return name, offset, length, r.buf[r.pos:]


def read_push(buf, payload) -> tuple[PushRequest, int]:
    """A packed push header and its payload: (request, the payload_bytes it declares)."""
    r = _Reader(buf, "push header")
    request, declared = _read_push(r, payload)
    r.end()
    return request, declared


def _read_push(r: _Reader, payload) -> tuple[PushRequest, int]:
    header = _read_header(r)
    kind, declared = r.take(_PUSH)
    return PushRequest(header, kind, _read_segments(r), payload), declared


def read_pull(buf, ids) -> PullRequest:
    r = _Reader(buf, "pull header")
    request = PullRequest(_read_header(r), _read_segments(r), ids)
    r.end()
    return request


def read_exchange(buf, payload) -> tuple[PushRequest, PullRequest]:
    """A packed exchange header: the push (its payload the first ``payload_bytes`` of
    ``payload``) and the pull (the rest: its ids)."""
    r = _Reader(buf, "exchange header")
    n = r.one(_I)
    push_reader = _Reader(r.bytes(n), "exchange header's push")
    request, declared = _read_push(push_reader, None)
    push_reader.end()
    if declared > len(payload):
        raise InvalidArgument(f"Exchange: the push declares {declared} payload bytes but the frame "
                              f"carries {len(payload)}")
    request.payload = payload[:declared]
    pull_request = PullRequest(_read_header(r), _read_segments(r), payload[declared:])
    r.end()
    return request, pull_request


def _read_versions(r: _Reader) -> list[Versions]:
    out: list[Versions] = []
    for _ in range(r.one(_H)):
        table = r.str()
        n = r.one(_I)
        blocks = np.frombuffer(r.bytes(4 * n), dtype="<u4")
        versions = np.frombuffer(r.bytes(8 * n), dtype="<u8")
        out.append(Versions(table, blocks, versions))
    return out


def read_push_ack(buf) -> PushAck:
    r = _Reader(buf, "push ack")
    duplicates = r.one(_I)
    ack = PushAck(_read_versions(r), duplicates)
    r.end()
    return ack


def _read_pull_reply(r: _Reader) -> PullReply:
    payload_bytes, min_clock, in_shm, waited, n = r.take(_PULL_REPLY)
    segments = [Layout(*r.take(_LAYOUT)) for _ in range(n)]
    return PullReply(segments, _read_versions(r), payload_bytes, min_clock, bool(in_shm), waited)


def read_pull_reply(buf) -> PullReply:
    r = _Reader(buf, "pull reply")
    reply = _read_pull_reply(r)
    r.end()
    return reply


def read_exchange_reply(buf) -> tuple[PushAck, PullReply]:
    r = _Reader(buf, "exchange reply")
    n = r.one(_I)
    ack = read_push_ack(r.bytes(n))
    reply = _read_pull_reply(r)
    r.end()
    return ack, reply
