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
import itertools
import operator
import struct
from typing import NamedTuple

import numpy as np

from shardps import kernels
from shardps.errors import InvalidArgument
from shardps.kernels import _JIT, njit
from shardps.messages import RANGE, ROWS, Header, Slice, StepRequest

VERSION = 1
SHARED, PUSH, PULL = 1, 2, 4
_FLAGS = SHARED | PUSH | PULL
HEAD = struct.Struct("<BBHHHIIQQQQqqQQQQ")
SEGMENT_FIELDS = 8
SEGMENT_BYTES = 8 * SEGMENT_FIELDS
_SELECTORS = {1: RANGE, 2: ROWS}
NONE = -1
RANGE_CODE, ROWS_CODE = 1, 2          # a segment's selector
NO_IDS = np.empty(0, np.int64)          # the ids of a range segment


def pad8(n: int) -> int:
    return (n + 7) & ~7


# ====================================================================== requests
@functools.lru_cache(maxsize=1024)
def _names(fixed: tuple[str, ...]) -> bytes:
    return "\0".join(fixed).encode()


def request(header: Header, kind: int, flags: int, push_segments: int, segments: np.ndarray,
            names: tuple[str, ...], pull_clock: int = 0, payload_offset: int = 0, payload_bytes: int = 0,
            reply_offset: int = 0, reply_bytes: int = 0, bases: list | tuple = ()) -> bytes:
    """A Step request header. ``segments``: the segments' ``SEGMENT_FIELDS`` int64 fields, one
    array ``[segments, SEGMENT_FIELDS]``;
    ``names``: job, session, region and the tables' names (the segments' first
    field indexes them); ``bases``: the segments' base versions, flat (block, version) pairs
    in segment order (each segment's last field counts its own)."""
    raw = _names(names)
    if len(raw) > 0xFFFF:
        raise InvalidArgument(f"a step's names take {len(raw)} bytes; at most 65,535 fit: send fewer tables per call")
    n = len(segments)
    if n > 0xFFFF:
        raise InvalidArgument(f"{n} segments in one request to one server; at most 65,535 fit: "
                              f"send fewer tables or ranges per call")
    head = HEAD.pack(VERSION, flags, n, push_segments, len(raw), kind, header.wire_dtype, header.epoch,
                     header.incarnation, header.sequence, header.acked_below, header.clock, pull_clock,
                     payload_offset, payload_bytes, reply_offset, reply_bytes)
    return b"".join((head, segments.tobytes(), raw, bytes(pad8(len(raw)) - len(raw)),
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


def read_request(buf) -> tuple[StepRequest, Region | None, np.ndarray]:
    """A Step request header: (the request, its slices without their arrays; the region it
    names or None; its segments' fields, ``[segments, SEGMENT_FIELDS]``, checked in one
    compiled pass). ``bind`` then gives the slices their arrays."""
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
    fields = np.frombuffer(buf, "<i8", n * SEGMENT_FIELDS, HEAD.size).reshape(n, SEGMENT_FIELDS)
    bad, why = _check_segments(fields, n_push, len(names), (len(buf) - end) // 16)
    if bad >= 0:
        raise InvalidArgument(f"step segment {bad}: " + _SEGMENT_ERRORS[why].format(fields[bad, 7], len(names) - 3,
                                                                                      *fields[bad, :2]))
    extra = len(buf) - end - 16 * int(fields[:, 7].sum())       # past the base versions
    if extra:
        raise InvalidArgument(f"step header: {extra} bytes follow its end")
    rows = fields.tolist()
    push = [Slice(names[f[0]], _SELECTORS[f[1]], f[2], f[3]) for f in rows[:n_push]] if flags & PUSH else None
    pull = [Slice(names[f[0]], _SELECTORS[f[1]], f[2], f[3]) for f in rows[n_push:]] if flags & PULL else None
    if push and (fields[:n_push, 7] > 0).any():        # a dense range's base versions
        pairs = np.frombuffer(buf, "<i8", offset=end).tolist()
        at = 0
        for s, f in zip(push, rows):
            if f[7]:
                s.base_versions = dict(zip(pairs[at:at + 2 * f[7]:2], pairs[at + 1:at + 2 * f[7]:2]))
                at += 2 * f[7]
    region = None
    if flags & SHARED:
        region = Region(names[2], payload_offset, payload_bytes, reply_offset, reply_bytes)
    return StepRequest(header, kind, push, pull, pull_clock), region, fields


_SEGMENT_ERRORS = ("selector {3}; known: 1 (range), 2 (rows)",
                   "name {2} is not a table's ({1} named)",
                   "a push segment carries values, a pull segment none; rows carry ids, a range none",
                   "{0} base versions (push segments only, inside the header)")


@njit(**_JIT)
def _check_segments(fields, n_push, names, room):
    """(the first segment that breaks a rule, or -1; which rule: an index of
    ``_SEGMENT_ERRORS``). ``room``: the (block, version) pairs the header has room for."""
    for i in range(fields.shape[0]):
        name, selector, ids_at, values_at, bases = fields[i, 0], fields[i, 1], fields[i, 4], fields[i, 5], fields[i, 7]
        if selector != 1 and selector != 2:
            return i, 0
        if name < 3 or name >= names:
            return i, 1
        pushing = i < n_push
        if pushing == (values_at == NONE) or (selector == 2) == (ids_at == NONE):
            return i, 2
        if bases and (not pushing or bases < 0 or bases > room):
            return i, 3
        room -= bases
    return -1, 0


def bind(request: StepRequest, fields: np.ndarray, payload) -> None:
    """Give ``request``'s slices their arrays (``fields``: ``read_request``'s segments):
    views of ``payload`` (the frame's payload, or the region's bytes). InvalidArgument for a
    range outside ``payload``, a misaligned one, or a negative count."""
    size = len(payload)
    bad = _check_layout(fields, size)
    if bad >= 0:
        f = fields[bad].tolist()
        if f[1] == 2 and not _fits(f[2], f[4], 8, size):
            raise InvalidArgument(f"step segment {bad}: {f[2]} ids at byte {f[4]} do not fit a payload of {size} "
                                  f"bytes at an 8-byte boundary")
        raise InvalidArgument(f"step segment {bad}: {f[6]} values at byte {f[5]} do not fit a payload of {size} "
                              f"bytes at a 4-byte boundary")
    i8 = np.frombuffer(payload, np.int64, size // 8)
    f4 = np.frombuffer(payload, np.float32, size // 4)
    for s, (_, selector, count, _, ids_at, values_at, values_count, _) in zip(
            [*(request.push or ()), *(request.pull or ())], fields.tolist()):
        if selector == 2:
            s.ids = i8[ids_at // 8:ids_at // 8 + count]
        if values_at != NONE:
            s.values = f4[values_at // 4:values_at // 4 + values_count]


@njit(**_JIT)
def _fits(count, at, width, size):
    """Whether ``count`` items of ``width`` bytes at byte ``at`` (a multiple of ``width``) lie
    inside ``size`` bytes; compared without multiplying (no overflow for hostile counts)."""
    return count >= 0 and at >= 0 and at % width == 0 and at <= size and count <= (size - at) // width


@njit(**_JIT)
def _check_layout(fields, size):
    """The first segment whose arrays do not fit ``size`` payload bytes, or -1."""
    for i in range(fields.shape[0]):
        if fields[i, 1] == 2 and not _fits(fields[i, 2], fields[i, 4], 8, size):
            return i
        if fields[i, 5] != NONE and not _fits(fields[i, 6], fields[i, 5], 4, size):
            return i
    return -1


class Rows(NamedTuple):
    """Sparse segments laid out together (a client's rows of all of its tables for one
    server): one per entry of ``tables``, ``counts[k]`` rows of ``dims[k]`` values each
    (int64 arrays); ``ids`` every segment's ids one after another (int64), ``values`` every
    segment's rows flat (float32; ``NO_VALUES`` in a pull)."""

    tables: tuple
    counts: np.ndarray
    dims: np.ndarray
    ids: np.ndarray
    values: np.ndarray


@njit(**_JIT)
def _rows_fields(fields, name, counts, dims, ids_at, values_at, bytes_first):
    """The fields of ``Rows``' segments, the first naming entry ``name`` of the names, its ids
    at ids element ``ids_at`` and (``values_at`` >= 0: a push) its values at values element
    ``values_at`` after the ids' ``bytes_first`` bytes. Returns (ids, values) it adds."""
    ids = values = 0
    for k in range(counts.shape[0]):
        n = counts[k]
        fields[k, 0] = name + k
        fields[k, 1] = ROWS_CODE
        fields[k, 2] = n
        fields[k, 3] = 0
        fields[k, 4] = 8 * (ids_at + ids)
        if values_at >= 0:
            fields[k, 5] = bytes_first + 4 * (values_at + values)
            fields[k, 6] = n * dims[k]
        else:
            fields[k, 5] = NONE
            fields[k, 6] = NONE
        fields[k, 7] = 0
        ids += n
        values += n * dims[k]
    return ids, values


class Encoded:
    """A Step request laid out for sending: ``Encoded(header, kind, pull_clock, push, pull,
    push_rows, pull_rows)``, built in one pass over a server's segments. ``push`` / ``pull``:
    None (no such part) or its segments (a push part of none: a clock report), each a tuple

    * push: ``(table, selector, start, stop, ids, values, bases)``: a range (``RANGE_CODE``,
      flat ``[start, stop)``, ``ids`` ``NO_IDS``, ``values`` its float32 values flat) or rows
      (``ROWS_CODE``, ``start`` their count, ``stop`` 0, ``ids`` int64, ``values`` float32
      ``[n, dim]``); ``bases``: a range's base versions as flat (block, version) pairs;
    * pull: the same with ``values`` ``NO_VALUES`` and no ``bases``;

    and ``push_rows`` / ``pull_rows``: more rows segments of the part as one ``Rows`` (after
    its segments), their fields written in one compiled call.

    The payload holds every segment's ids first, one array after another (int64: each at
    an 8-byte boundary), then every push segment's values (float32), so it needs no padding
    and is written with two ``np.concatenate`` calls (``write``) or sent as the arrays
    themselves (``parts``). The header names each segment's table by its own entry among
    the names (job, session, region, then one per segment)."""

    __slots__ = ("head", "kind", "pull_clock", "push", "pull", "tables", "n_push", "fields", "ids", "values",
                 "bases", "ids_bytes", "payload_bytes", "push_rows", "push_row_values")
    tables: tuple
    ids: tuple
    values: tuple

    def __init__(self, header: Header, kind: int, pull_clock: int = 0, push: list | None = None,
                 pull: list | None = None, push_rows: Rows | None = None, pull_rows: Rows | None = None):
        self.head, self.kind, self.pull_clock = header, kind, pull_clock
        self.push, self.pull = push is not None or push_rows is not None, pull is not None or pull_rows is not None
        push, pull = push or [], pull or []
        pr, lr = push_rows or _NO_ROWS, pull_rows or _NO_ROWS
        self.tables = (*map(_FIRST, push), *pr.tables, *map(_FIRST, pull), *lr.tables)
        self.n_push = n_push = len(push) + len(pr.tables)
        self.ids = (*map(_IDS_OF, push), pr.ids, *map(_IDS_OF, pull), lr.ids)
        self.values = (*map(_VALUES_OF, push), pr.values)
        self.bases = list(itertools.chain.from_iterable(map(_BASES_OF, push)))
        self.ids_bytes = first = 8 * sum(map(_SIZE, self.ids))
        self.payload_bytes = first + 4 * sum(map(_SIZE, self.values))
        self.push_rows = sum(map(_SIZE, self.ids[:len(push) + 1]))
        self.fields = fields = np.empty((len(self.tables), SEGMENT_FIELDS), np.int64)
        ids_at = values_at = row_values = 0
        for k, (_, sel, a, z, ids, values, bases) in enumerate(push):     # a push's ranges (and rows one by one)
            fields[k] = (k + 3, sel, a, z, 8 * ids_at if sel == ROWS_CODE else NONE, first + 4 * values_at,
                         values.size, len(bases) // 2)
            ids_at, values_at = ids_at + ids.size, values_at + values.size
            row_values += values.size if sel == ROWS_CODE else 0
        k = len(push)
        if pr.tables:
            added, values = _rows_fields(fields[k:n_push], k + 3, pr.counts, pr.dims, ids_at, values_at, first)
            ids_at, row_values = ids_at + added, row_values + values
        self.push_row_values = row_values
        for k, (_, sel, a, z, ids, _, _) in enumerate(pull, n_push):
            fields[k] = (k + 3, sel, a, z, 8 * ids_at if sel == ROWS_CODE else NONE, NONE, NONE, 0)
            ids_at += ids.size
        if lr.tables:
            k = n_push + len(pull)
            _rows_fields(fields[k:], k + 3, lr.counts, lr.dims, ids_at, -1, first)

    def header(self, region: str = "", payload_offset: int = 0, reply_offset: int = 0, reply_bytes: int = 0) -> bytes:
        h = self.head
        flags = (PUSH if self.push else 0) | (PULL if self.pull else 0) | (SHARED if region else 0)
        return request(h, self.kind if self.push else 0, flags, self.n_push, self.fields,
                       (h.job, h.session, region, *self.tables), self.pull_clock, payload_offset,
                       self.payload_bytes if region else 0, reply_offset, reply_bytes, self.bases)

    def push_counts(self) -> tuple[int, int, int]:
        """(the push's bytes, its rows, its rows' bytes: their ids and values)."""
        rows = self.push_rows
        return 8 * rows + self.payload_bytes - self.ids_bytes, rows, 8 * rows + 4 * self.push_row_values

    def parts(self) -> list:
        """The payload as buffers to send one after the other: the arrays themselves."""
        return [a for a in (*self.ids, *self.values) if a.size]

    def write(self, buf: np.ndarray) -> None:
        """Write the payload into ``buf`` (a uint8 array of ``payload_bytes`` or more: a
        shared-memory region's view)."""
        np.concatenate(self.ids, out=buf[:self.ids_bytes].view(np.int64))
        np.concatenate(self.values, axis=None, out=buf[self.ids_bytes:self.payload_bytes].view(np.float32))


_SIZE = operator.attrgetter("size")
_FIRST, _IDS_OF, _VALUES_OF, _BASES_OF = (operator.itemgetter(k) for k in (0, 4, 5, 6))
NO_VALUES = np.empty(0, np.float32)     # a pull segment's values
_NO_ROWS = Rows((), np.empty(0, np.int64), np.empty(0, np.int64), NO_IDS, NO_VALUES)


def encode(request: StepRequest) -> Encoded:
    """Lay out a client's ``request`` (its slices as ``Encoded``'s segments; a slice's
    ``positions`` pick the rows it carries)."""
    def picked(s: Slice, array: np.ndarray) -> np.ndarray:
        return array if s.positions is None else array[s.positions]

    push = None if request.push is None else [
        (s.table, ROWS_CODE, picked(s, s.ids).shape[0], 0, picked(s, s.ids), picked(s, s.values), ())
        if s.selector is ROWS else
        (s.table, RANGE_CODE, s.start, s.stop, NO_IDS, s.values,
         tuple(itertools.chain.from_iterable((s.base_versions or {}).items())))
        for s in request.push]
    pull = None if request.pull is None else [
        (s.table, ROWS_CODE, picked(s, s.ids).shape[0], 0, picked(s, s.ids), NO_VALUES, ()) if s.selector is ROWS else
        (s.table, RANGE_CODE, s.start, s.stop, NO_IDS, NO_VALUES, ()) for s in request.pull]
    return Encoded(request.header, request.kind, request.pull_clock, push, pull)


def warm_up() -> None:
    """Compile (or load from numba's cache) the request's checks, for a server's writable
    frame buffer and for bytes."""
    if kernels.AVAILABLE:
        for writable in (True, False):
            fields = np.zeros((1, SEGMENT_FIELDS), np.int64)
            fields.flags.writeable = writable
            _check_segments(fields, 0, 3, 0)
            _check_layout(fields, 0)
        counts = np.ones(1, np.int64)
        _rows_fields(np.empty((1, SEGMENT_FIELDS), np.int64)[0:], 3, counts, counts, 0, 0, 0)
