"""The Step frame's reply (its layout: ``shardps.rpc.step``): ``reply`` writes a reply header
on the server, ``read_reply`` reads it on the client, walking its versions entries in one
compiled pass (``_walk_entries``)."""

from __future__ import annotations

import operator
import struct

import numpy as np

from shardps import kernels
from shardps.errors import InvalidArgument
from shardps.kernels import _JIT, njit
from shardps.messages import PullReply, PushAck, StepReply, StepRequest, Versions
from shardps.rpc.step import SHARED, VERSION, pad8

REPLY = struct.Struct("<BBHIqdQ")
_ENTRY = struct.Struct("<II")
_TABLE, _ELEMENTS = operator.attrgetter("table"), operator.attrgetter("elements")


def reply(step: StepReply, request: StepRequest, shared: bool) -> bytes:
    """The reply header of ``step`` to ``request`` (``shared``: its values are in the
    request's region)."""
    ack, pull = step.ack, step.pull
    n_push = len(request.push) if request.push is not None else 0
    out: list = []
    entries = 0
    if ack is not None:
        entries += _versions(out, ack.versions, request.push or (), 0)
    if pull is not None:
        entries += _versions(out, pull.versions, request.pull or (), n_push)
    elements = struct.pack(f"<{len(pull.segments)}Q", *map(_ELEMENTS, pull.segments)) if pull else b""
    head = REPLY.pack(VERSION, SHARED if shared else 0, entries, ack.duplicate_blocks if ack else 0,
                      pull.min_clock if pull else 0, pull.waited_seconds if pull else 0.0,
                      pull.payload_bytes if pull else 0)
    return b"".join((head, elements, *out))


def _versions(out: list, versions: list[Versions], slices, first: int) -> int:
    """Append each table's versions as an entry naming the first slice of that table."""
    last = first + len(slices) - 1           # each table's first slice: the last written, walked backwards
    index = dict(zip(map(_TABLE, reversed(slices)), range(last, first - 1, -1)))
    for v in versions:
        n = len(v.blocks)
        blocks, numbers = np.asarray(v.blocks, "<u4").tobytes(), np.asarray(v.versions, "<u8").tobytes()
        out += (_ENTRY.pack(index[v.table], n), blocks, _PAD[n % 2], numbers)
    return len(versions)


_PAD = (b"", b"\0\0\0\0")            # after an odd count of 4-byte blocks: the versions 8-byte aligned


def read_reply(buf: bytes, names: list[str], n_push: int, n_pull: int
               ) -> tuple[PushAck, PullReply, tuple[int, ...], bool]:
    """A Step reply header to a request of ``n_push`` then ``n_pull`` segments whose tables
    are ``names`` (one per segment): (the push's ack, the pull's reply without its segments'
    layouts, the values each pull segment returned, whether they are in the region).
    InvalidArgument for anything that does not fit."""
    size = len(buf)
    end = REPLY.size + 8 * n_pull
    if size < end:
        raise InvalidArgument(f"step reply: {size} bytes, at least {end} needed")
    version, flags, entries, duplicates, min_clock, waited, payload_bytes = REPLY.unpack_from(buf)
    if version != VERSION:
        raise InvalidArgument(f"step reply: version {version}; this side reads {VERSION}")
    elements = struct.unpack_from(f"<{n_pull}Q", buf, REPLY.size) if n_pull else ()
    ack = PushAck(duplicate_blocks=duplicates)
    pulled = PullReply(payload_bytes=payload_bytes, min_clock=min_clock, waited_seconds=waited,
                       in_shared_memory=bool(flags & SHARED))
    if entries:
        ack.versions, pulled.versions = _read_versions(buf, end, entries, names, n_push)
    elif end != size:
        raise InvalidArgument(f"step reply: {size - end} bytes follow its end at byte {end}")
    return ack, pulled, elements, bool(flags & SHARED)


def _read_versions(buf: bytes, at: int, entries: int, names: list[str], n_push: int
                   ) -> tuple[list[Versions], list[Versions]]:
    """The ``entries`` versions entries from byte ``at`` to the end of ``buf``: (the push
    segments', the pull segments'), each a view of ``buf``."""
    size = len(buf)
    if kernels.AVAILABLE:
        table = np.empty((entries, 4), np.int64)
        done, pushes = _walk_entries(np.frombuffer(buf, np.uint8), at, entries, len(names), n_push, table)
    else:
        done, pushes, table = _walk_entries_py(buf, at, entries, len(names), n_push)
    if done < 0:
        raise InvalidArgument(f"step reply: versions entry {-1 - done} of {entries} does not fit its {size} bytes "
                              f"(or names a segment the request has not)")
    if done != size:
        raise InvalidArgument(f"step reply: {size - done} bytes follow its end at byte {done}")
    u4, u8 = np.frombuffer(buf, "<u4", size // 4), np.frombuffer(buf, "<u8", size // 8)
    rows = table.tolist()
    return ([Versions(names[s], u4[b:b + n], u8[v:v + n]) for s, n, b, v in rows[:pushes]],
            [Versions(names[s], u4[b:b + n], u8[v:v + n]) for s, n, b, v in rows[pushes:]])


@njit(**_JIT)
def _walk_entries(raw, at, count, segments, n_push, table):
    """Walk ``count`` versions entries of a reply (``raw``: its bytes) from byte ``at``:
    each one's (segment, blocks, where its blocks start in 4-byte words, where its versions
    start in 8-byte words) into ``table``, the push segments' entries first (each part's in
    order). Returns (the byte after the last entry, or -1 - k where entry k does not fit or
    names no segment; the push segments' entries)."""
    size = raw.shape[0]
    start = at
    pushes = 0
    seen = np.empty((count, 2), np.int64)
    for k in range(count):              # first: every entry fits, and how many are the push's
        if at + 8 > size:
            return -1 - k, 0
        segment = np.int64(0)
        n = np.int64(0)
        for j in range(4):
            segment |= np.int64(raw[at + j]) << (8 * j)
            n |= np.int64(raw[at + 4 + j]) << (8 * j)
        seen[k, 0] = segment
        seen[k, 1] = n
        at += 8 + ((4 * n + 7) & ~7) + 8 * n
        if segment >= segments or at > size:
            return -1 - k, 0
        if segment < n_push:
            pushes += 1
    push, pull, at = 0, pushes, start
    for k in range(count):              # then: the rows, the push's first
        segment, n = seen[k, 0], seen[k, 1]
        row = push if segment < n_push else pull
        if segment < n_push:
            push += 1
        else:
            pull += 1
        table[row, 0] = segment
        table[row, 1] = n
        table[row, 2] = (at + 8) // 4
        table[row, 3] = (at + 8 + ((4 * n + 7) & ~7)) // 8
        at += 8 + ((4 * n + 7) & ~7) + 8 * n
    return at, pushes


def _walk_entries_py(buf: bytes, at: int, count: int, segments: int, n_push: int) -> tuple[int, int, np.ndarray]:
    """``_walk_entries`` without numba (the table as a list of rows)."""
    size = len(buf)
    push: list = []
    pull: list = []
    for k in range(count):
        if at + 8 > size:
            return -1 - k, 0, _NO_ENTRIES
        segment, n = _ENTRY.unpack_from(buf, at)
        blocks_at = at + 8
        versions_at = blocks_at + pad8(4 * n)
        at = versions_at + 8 * n
        if segment >= segments or at > size:
            return -1 - k, 0, _NO_ENTRIES
        (push if segment < n_push else pull).append((segment, n, blocks_at // 4, versions_at // 8))
    return at, len(push), np.array(push + pull, dtype=np.int64).reshape(-1, 4)


_NO_ENTRIES = np.empty((0, 4), np.int64)


def warm_up() -> None:
    """Compile (or load from numba's cache) the reply's walk, for the read-only bytes a reply
    is."""
    if kernels.AVAILABLE:
        raw = np.zeros(16, np.uint8)
        raw.flags.writeable = False
        _walk_entries(raw, 0, 1, 1, 1, np.empty((1, 4), np.int64))
