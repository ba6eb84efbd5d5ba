"""The data plane's Step frame: one worker step against one server (a push, a pull, or both)
in a fixed binary layout that costs a few ``struct`` calls to write and to read, with every
bulk array 8-byte aligned so that it is used in place (a numpy view of the received buffer, or
of a shared-memory region). ``parameter_server.proto`` (``StepHeader``, ``StepReply``) gives
the meaning of the fields; this module is the only one that knows their bytes.

Request header (the frame's prefix sets ``frames.FLAG_PACKED``), little-endian::

    0   B  version (1)
    1   B  flags: PUSH (2) a push part, PULL (4) a pull part, SHARED (1) the payload lies in
           the shared-memory region named below and the reply's values go there too
    2   H  segments (push segments first, then the pull's)
    4   H  push_segments
    6   H  names_bytes
    8   I  kind (PushKind of the push)
    12  I  wire_dtype (WireDType; 0 is FLOAT32)
    16  Q  epoch          24  Q  incarnation     32  Q  sequence      40  Q  acked_below
    48  q  clock (the push's step)               56  q  pull_clock (the pull's)
    64  Q  payload_offset, 72 Q payload_bytes: where the payload lies in the region (SHARED)
    80  Q  reply_offset, 88 Q reply_bytes: where the reply's values may go in the region
    96  segments x 8 q: name (an index into the names), selector (1 range, 2 rows), start
        (rows: their count), stop, ids_offset, values_offset, values_count (offsets into the
        payload; -1 where the segment has none), bases (base versions it carries)
    then names_bytes of UTF-8 names separated by NUL: job, session, region, then the tables'
    names (segments point at them); zero bytes up to a multiple of 8
    then each segment's base versions, in segment order: bases x (q block, q version): the
    versions of a dense range's blocks when this worker last pulled them (push segments)

Payload (the frame's, or the region's): int64 ids at 8-byte aligned offsets and float32
values, where the segments say. A push segment carries values (a sparse one ``count * dim``
of them, the rows one after another), a pull segment none.

Reply header, little-endian::

    0   B  version (1)      1  B  flags: SHARED (1) the values are in the request's region
    2   H  version entries  4  I  duplicate_blocks
    8   q  min_clock        16 d  waited_seconds    24 Q  payload_bytes
    32  per pull segment Q elements (the values it returned)
    then per entry: I segment (the request's index), I n, n x I block (zero-padded to a
    multiple of 8 bytes), n x Q version

The reply's payload: each pull segment's float32 values, one after another (in the frame,
or at the request's ``reply_offset`` in the region).

Reading refuses anything that does not fit with InvalidArgument naming what; nothing is read
past a buffer.
"""

from __future__ import annotations

import functools
import math
import struct

import numpy as np

from shardps import kernels
from shardps.errors import InvalidArgument
from shardps.kernels import _JIT, njit
from shardps.messages import RANGE, ROWS, Header, PullReply, PushAck, Slice, StepReply, StepRequest, Versions

VERSION = 1
SHARED, PUSH, PULL = 1, 2, 4
_FLAGS = SHARED | PUSH | PULL
HEAD = struct.Struct("<BBHHHIIQQQQqqQQQQ")
SEGMENT_FIELDS = 8
SEGMENT_BYTES = 8 * SEGMENT_FIELDS
REPLY = struct.Struct("<BBHIqdQ")
_ENTRY = struct.Struct("<II")
_SELECTORS = {1: RANGE, 2: ROWS}
_SELECTOR_CODES = {RANGE: 1, ROWS: 2}
NONE = -1
_EMPTY_I8 = np.empty(0, np.int64)
_EMPTY_F4 = np.empty(0, np.float32)


def pad8(n: int) -> int:
    return (n + 7) & ~7


# ====================================================================== requests
@functools.lru_cache(maxsize=1024)
def _names(fixed: tuple[str, ...]) -> bytes:
    return "\0".join(fixed).encode()


def request(header: Header, kind: int, flags: int, push_segments: int, segments: list, names: tuple[str, ...],
            pull_clock: int = 0, payload_offset: int = 0, payload_bytes: int = 0, reply_offset: int = 0,
            reply_bytes: int = 0, bases: list | tuple = ()) -> bytes:
    """A Step request header. ``segments``: flat int64 fields, ``SEGMENT_FIELDS`` per
    segment; ``names``: job, session, region and the tables' names (the segments' first
    field indexes them); ``bases``: the segments' base versions, flat (block, version) pairs
    in segment order (each segment's last field counts its own)."""
    raw = _names(names)
    if len(raw) > 0xFFFF:
        raise InvalidArgument(f"a step's names take {len(raw)} bytes; at most 65,535 fit: send fewer tables per call")
    n = len(segments) // SEGMENT_FIELDS
    if n > 0xFFFF:
        raise InvalidArgument(f"{n} segments in one request to one server; at most 65,535 fit: "
                              f"send fewer tables or ranges per call")
    head = HEAD.pack(VERSION, flags, n, push_segments, len(raw), kind, header.wire_dtype, header.epoch,
                     header.incarnation, header.sequence, header.acked_below, header.clock, pull_clock,
                     payload_offset, payload_bytes, reply_offset, reply_bytes)
    return b"".join((head, struct.pack(f"<{len(segments)}q", *segments), raw, bytes(pad8(len(raw)) - len(raw)),
                     struct.pack(f"<{len(bases)}q", *bases) if bases else b""))


class Region:
    """The shared-memory region a Step request names (flag SHARED): where its payload lies
    and where the reply's values may go."""

    __slots__ = ("name", "payload_offset", "payload_bytes", "reply_offset", "reply_bytes")

    def __init__(self, name: str, payload_offset: int, payload_bytes: int, reply_offset: int, reply_bytes: int):
        self.name, self.payload_offset, self.payload_bytes = name, payload_offset, payload_bytes
        self.reply_offset, self.reply_bytes = reply_offset, reply_bytes

    @property
    def end(self) -> int:
        """The bytes of the region the request uses."""
        return max(self.payload_offset + self.payload_bytes, self.reply_offset + self.reply_bytes)


def read_request(buf) -> tuple[StepRequest, Region | None, list[tuple[int, int, int]]]:
    """A Step request header: (the request, its slices without their arrays; the region it
    names or None; where each slice's arrays lie in the payload: (ids offset, values offset,
    values count), -1 for none). ``bind`` then gives the slices their arrays."""
    if len(buf) < HEAD.size:
        raise InvalidArgument(f"step header: {len(buf)} bytes, at least {HEAD.size} needed")
    (version, flags, n, n_push, names_bytes, kind, wire, epoch, incarnation, sequence, acked_below, clock,
     pull_clock, payload_offset, payload_bytes, reply_offset, reply_bytes) = HEAD.unpack_from(buf)
    if version != VERSION:
        raise InvalidArgument(f"step header: version {version}; this side reads {VERSION}")
    if flags & ~_FLAGS:
        raise InvalidArgument(f"step header: unknown flags {flags:#x}")
    if n_push > n or (n_push and not flags & PUSH) or (n > n_push and not flags & PULL):
        raise InvalidArgument(f"step header: {n_push} push segments of {n}, flags {flags:#x}: push segments "
                              f"need flag PUSH (2), pull segments flag PULL (4)")
    seg_end = HEAD.size + n * SEGMENT_BYTES
    end = seg_end + pad8(names_bytes)
    if len(buf) < end:
        raise InvalidArgument(f"step header: {len(buf)} bytes; its {n} segments and {names_bytes} bytes of "
                              f"names take {end}")
    try:
        names = str(buf[seg_end:seg_end + names_bytes], "utf-8").split("\0")
    except UnicodeDecodeError:
        raise InvalidArgument("step header: the names are not UTF-8") from None
    if len(names) < 3:
        raise InvalidArgument(f"step header: {len(names)} names; job, session and region come first")
    header = Header(names[0], epoch, names[1], incarnation, sequence, acked_below, clock, wire)
    fields = struct.unpack_from(f"<{n * SEGMENT_FIELDS}q", buf, HEAD.size) if n else ()
    push: list[Slice] | None = [] if flags & PUSH else None
    pull: list[Slice] | None = [] if flags & PULL else None
    layout = []
    bases_at = end
    for i in range(n):
        name, selector, start, stop, ids_at, values_at, values_count, bases = \
            fields[i * SEGMENT_FIELDS:(i + 1) * SEGMENT_FIELDS]
        which = _SELECTORS.get(selector)
        if which is None:
            raise InvalidArgument(f"step segment {i}: selector {selector}; known: 1 (range), 2 (rows)")
        if not 3 <= name < len(names):
            raise InvalidArgument(f"step segment {i}: name {name} is not a table's ({len(names) - 3} named)")
        pushing = i < n_push
        if pushing == (values_at == NONE) or (which is ROWS) == (ids_at == NONE):
            raise InvalidArgument(f"step segment {i}: a push segment carries values, a pull segment none; "
                                  f"rows carry ids, a range none")
        s = Slice(names[name], which, start, stop)
        if bases:
            if not pushing or bases < 0 or bases_at + 16 * bases > len(buf):
                raise InvalidArgument(f"step segment {i}: {bases} base versions (push segments only, inside "
                                      f"the header)")
            pairs = struct.unpack_from(f"<{2 * bases}q", buf, bases_at)
            s.base_versions = dict(zip(pairs[::2], pairs[1::2]))
            bases_at += 16 * bases
        (push if pushing else pull).append(s)   # type: ignore[union-attr]
        layout.append((ids_at, values_at, values_count))
    if bases_at != len(buf):
        raise InvalidArgument(f"step header: {len(buf) - bases_at} bytes follow its end at byte {bases_at}")
    region = None
    if flags & SHARED:
        region = Region(names[2], payload_offset, payload_bytes, reply_offset, reply_bytes)
    return StepRequest(header, kind, push, pull, pull_clock), region, layout


def bind(request: StepRequest, layout: list[tuple[int, int, int]], payload) -> None:
    """Give ``request``'s slices their arrays (``layout``: ``read_request``'s): views of
    ``payload`` (the frame's payload, or the region's bytes). InvalidArgument for a range
    outside ``payload``, a misaligned one, or a negative count."""
    size = len(payload)
    i8 = f4 = None
    slices = [*(request.push or ()), *(request.pull or ())]
    for k, (s, (ids_at, values_at, values_count)) in enumerate(zip(slices, layout)):
        if s.selector is ROWS:
            count = s.start
            if count < 0 or ids_at < 0 or ids_at % 8 or ids_at + 8 * count > size:
                raise InvalidArgument(f"step segment {k} ({s.table!r}): {count} ids at byte {ids_at} do not fit a "
                                      f"payload of {size} bytes at an 8-byte boundary")
            if i8 is None:
                i8 = np.frombuffer(payload, np.int64, size // 8)
            s.ids = i8[ids_at // 8:ids_at // 8 + count]
        if values_at != NONE:
            if values_count < 0 or values_at < 0 or values_at % 4 or values_at + 4 * values_count > size:
                raise InvalidArgument(f"step segment {k} ({s.table!r}): {values_count} values at byte {values_at} "
                                      f"do not fit a payload of {size} bytes at a 4-byte boundary")
            if f4 is None:
                f4 = np.frombuffer(payload, np.float32, size // 4)
            s.values = f4[values_at // 4:values_at // 4 + values_count]


class Encoded:
    """A Step request laid out for sending, built a segment at a time by a client
    (``push_rows``, ``push_range``, ``pull_rows``, ``pull_range``: the push's segments go
    first in the header whatever the order they come in): the header's flat fields per
    segment, the tables' names, the payload's size (``payload_bytes``) and where each array
    goes in it (``writes``: (offset, array, positions or None): ``array[positions]`` there).
    A segment's arrays are the caller's whole
    arrays (sparse values ``[n, dim]``, a dense range's values flat); ``positions`` (None:
    all) picks the rows it carries. ``push``: a push part even without segments (a clock
    report)."""

    __slots__ = ("head", "kind", "pull_clock", "push", "pull", "push_fields", "pull_fields", "push_tables",
                 "pull_tables", "tables", "payload_bytes", "writes", "bases")

    def __init__(self, header: Header, kind: int, pull_clock: int = 0, push: bool = False, pull: bool = False):
        self.head, self.kind, self.pull_clock, self.push, self.pull = header, kind, pull_clock, push, pull
        self.push_fields: list[int] = []
        self.pull_fields: list[int] = []
        self.push_tables: list[str] = []
        self.pull_tables: list[str] = []
        self.tables: dict[str, int] = {}
        self.payload_bytes = 0
        self.writes: list = []
        self.bases: list[int] = []

    def push_rows(self, table: str, ids: np.ndarray, positions: np.ndarray | None, values: np.ndarray) -> None:
        n = ids.shape[0] if positions is None else positions.shape[0]
        ids_at = (self.payload_bytes + 7) & ~7
        values_at, count = ids_at + 8 * n, n * values.shape[1]
        self.writes += ((ids_at, ids, positions), (values_at, values, positions))
        self.payload_bytes = values_at + 4 * count
        self._segment(True, table, 2, n, 0, ids_at, values_at, count, 0)

    def push_range(self, table: str, start: int, stop: int, values: np.ndarray, bases: dict | None = None) -> None:
        values_at = self.payload_bytes
        self.writes.append((values_at, values, None))
        self.payload_bytes = values_at + 4 * values.shape[0]
        self._segment(True, table, 1, start, stop, NONE, values_at, values.shape[0], len(bases) if bases else 0)
        if bases:
            for pair in bases.items():
                self.bases += pair

    def pull_rows(self, table: str, ids: np.ndarray, positions: np.ndarray | None) -> None:
        n = ids.shape[0] if positions is None else positions.shape[0]
        ids_at = (self.payload_bytes + 7) & ~7
        self.writes.append((ids_at, ids, positions))
        self.payload_bytes = ids_at + 8 * n
        self._segment(False, table, 2, n, 0, ids_at, NONE, NONE, 0)

    def pull_range(self, table: str, start: int, stop: int) -> None:
        self._segment(False, table, 1, start, stop, NONE, NONE, NONE, 0)

    def _segment(self, pushing: bool, table: str, *fields: int) -> None:
        """A segment's header fields, its table's name index first (the push's and the pull's
        kept apart: the push's go first)."""
        name = self.tables.setdefault(table, 3 + len(self.tables))
        if pushing:
            self.push = True
            self.push_tables.append(table)
            self.push_fields += (name, *fields)
        else:
            self.pull = True
            self.pull_tables.append(table)
            self.pull_fields += (name, *fields)

    @property
    def segment_tables(self) -> list[str]:
        """Each segment's table, in the header's order."""
        return self.push_tables + self.pull_tables

    def header(self, region: str = "", payload_offset: int = 0, reply_offset: int = 0, reply_bytes: int = 0) -> bytes:
        h = self.head
        flags = (PUSH if self.push else 0) | (PULL if self.pull else 0) | (SHARED if region else 0)
        return request(h, self.kind if self.push else 0, flags, len(self.push_tables),
                       self.push_fields + self.pull_fields if self.pull_fields else self.push_fields,
                       (h.job, h.session, region, *self.tables), self.pull_clock, payload_offset,
                       self.payload_bytes if region else 0, reply_offset, reply_bytes, self.bases)

    def parts(self) -> list:
        """The payload as buffers to send one after the other (zero bytes where an array is
        aligned; the rows a segment selects gathered, the others as they are)."""
        out: list = []
        at = 0
        for offset, array, positions in self.writes:
            if offset > at:
                out.append(bytes(offset - at))
            data = array if positions is None else np.take(array, positions, axis=0)
            out.append(data)
            at = offset + data.nbytes
        return out

    def write(self, buf: np.ndarray) -> None:
        """Write the payload into ``buf`` (a uint8 array of ``payload_bytes`` or more: a
        shared-memory region's view)."""
        for offset, array, positions in self.writes:
            n = array.shape[0] if positions is None else positions.shape[0]
            shape = (n,) + array.shape[1:]
            dest = buf[offset:offset + array.dtype.itemsize * math.prod(shape)].view(array.dtype).reshape(shape)
            if positions is None:
                np.copyto(dest, array)
            else:
                np.take(array, positions, axis=0, out=dest, mode="clip")


def encode(request: StepRequest) -> Encoded:
    """Lay out a client's ``request`` (its slices as ``Encoded``'s segments)."""
    out = Encoded(request.header, request.kind, request.pull_clock, request.push is not None,
                  request.pull is not None)
    for s in request.push or ():
        if s.selector is ROWS:
            out.push_rows(s.table, s.ids, s.positions, s.values)
        else:
            out.push_range(s.table, s.start, s.stop, s.values, s.base_versions)
    for s in request.pull or ():
        if s.selector is ROWS:
            out.pull_rows(s.table, s.ids, s.positions)
        else:
            out.pull_range(s.table, s.start, s.stop)
    return out


# ====================================================================== replies
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
    elements = struct.pack(f"<{len(pull.segments)}Q", *(s.elements for s in pull.segments)) if pull else b""
    head = REPLY.pack(VERSION, SHARED if shared else 0, entries, ack.duplicate_blocks if ack else 0,
                      pull.min_clock if pull else 0, pull.waited_seconds if pull else 0.0,
                      pull.payload_bytes if pull else 0)
    return b"".join((head, elements, *out))


def _versions(out: list, versions: list[Versions], slices, first: int) -> int:
    """Append each table's versions as an entry naming the first slice of that table."""
    index: dict[str, int] = {}
    for k, s in enumerate(slices):
        index.setdefault(s.table, first + k)
    for v in versions:
        blocks = np.asarray(v.blocks, dtype="<u4")
        n = blocks.shape[0]
        out.append(_ENTRY.pack(index[v.table], n))
        out.append(blocks.tobytes())
        if n % 2:
            out.append(b"\0\0\0\0")
        out.append(np.asarray(v.versions, dtype="<u8").tobytes())
    return len(versions)


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
    """Compile (or load from numba's cache) the reply's walk, for the read-only bytes a
    reply is."""
    if kernels.AVAILABLE:
        raw = np.zeros(16, np.uint8)
        raw.flags.writeable = False
        _walk_entries(raw, 0, 1, 1, 1, np.empty((1, 4), np.int64))
