"""Request decoding: a data request's header, segments and payload into plain values.

Everything here is a pure function of (the request, the shard map view, the limits): no node
state, no locks, no I/O. A request is validated whole before anything is stored, and every
refusal names the bad value:

* ``InvalidArgument``: malformed (no job, a selector of the wrong kind, a payload shorter or
  longer than the segments describe, a non-finite value where the table refuses them);
* ``ResourceExhausted``: over a ``NodeLimits`` bound (segments, rows);
* ``NotFound``: a job or table the map does not have;
* ``StaleEpoch`` / ``Unavailable`` (``check_owned``): a block this node does not serve, or
  serves but has not loaded yet.

Callers hold the node's gate shared (``table.EpochGate``) so the view cannot change under
them; nothing here blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from shardps import dtypes, id_blocks, kernels
from shardps.dtypes import WireDType
from shardps.errors import (
    DataLost,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    StaleEpoch,
    Unavailable,
    non_finite,
)
from shardps.messages import RANGE, ROWS, Header, PullRequest, PushRequest, Selection, Slice
from shardps.rpc.codec import byte_view
from shardps.server.node import storage_kernels
from shardps.server.node.blocks import BlockKey
from shardps.shardmap import ShardMapView, TableView
from shardps.tables import (
    MAX_CLOCK,
    TableKind,
    TableSpec,
    check_range,
    dense_blocks_of_range,
)


@dataclass(frozen=True)
class NodeLimits:
    """Per-request limits; larger requests get RESOURCE_EXHAUSTED naming the limit."""

    max_request_bytes: int = 1 << 30
    max_response_bytes: int = 1 << 30
    max_rows: int = 4_000_000
    max_segments: int = 65_535          # what a packed header's 2-byte count carries
    forward_timeout: float = 1.5


@dataclass
class Part:
    """One table segment's share of one block in a request."""

    key: BlockKey
    table: TableView
    segment: int = 0
    lo: int = 0                       # dense: flat range
    hi: int = 0
    _ids: np.ndarray | None = None    # sparse: unique ids (push) or ids in request order (pull)
    positions: np.ndarray | None = None   # where these rows are in the segment (its output, on pulls)
    whole: tuple | None = None        # sparse push: (ids, values, parts) of the whole segment
    _values: np.ndarray | None = None

    @property
    def ids(self) -> np.ndarray | None:
        """Sparse: this block's ids, gathered from the segment's (``whole``) on first use."""
        if self._ids is None and self.whole is not None:
            self._ids = self.whole[0][self.positions]
        return self._ids

    @ids.setter
    def ids(self, ids: np.ndarray | None) -> None:
        self._ids = ids

    @property
    def values(self) -> np.ndarray | None:
        """Push: float32, dense 1-d or sparse ``[n, dim]``. A sparse part's rows are gathered
        from the segment's (``whole``) on first use: a push applied to the whole segment at
        once never copies them unless a backup needs them."""
        if self._values is None and self.whole is not None and self.whole[1] is not None:
            self._values = self.whole[1][self.positions]
        return self._values

    @values.setter
    def values(self, values: np.ndarray | None) -> None:
        self._values = values


@dataclass
class Segment:
    """One decoded request segment: a dense range or sparse ids (and values, on pushes)."""

    table: TableView
    dtype: WireDType
    lo: int = 0
    hi: int = 0
    ids: np.ndarray | None = None
    values: np.ndarray | None = None
    base_versions: dict[int, int] = field(default_factory=dict)
    all_stored: bool = False

    @property
    def dense(self) -> bool:
        return self.table.spec.kind is TableKind.DENSE


def check_header(header: Header) -> None:
    """Bounds every header field can be checked against without the map."""
    if not 0 <= header.clock < MAX_CLOCK:
        raise InvalidArgument(f"header.clock={header.clock}: a worker's completed steps must "
                              f"lie in [0, {MAX_CLOCK})")


def table_of(view: ShardMapView, server: str, job: str, name: str) -> TableView:
    """Table ``name`` of ``job`` under ``view``; NotFound (naming both) if the map lacks it."""
    t = view.tables.get((job, name))
    if t is None:
        if job not in view.jobs():
            raise NotFound(f"job {job!r} not found on server {server} (epoch {view.epoch}): "
                           f"create the job first, or refresh the shard map")
        raise NotFound(f"table {name!r} of job {job!r} not found (epoch {view.epoch}): "
                       f"create it first, or refresh the shard map")
    return t


def parse_segments(view: ShardMapView, server: str, limits: NodeLimits, header: Header,
                   segments: Sequence[Selection], payload, with_values: bool) -> list[Segment]:
    """Decode and validate every segment against the payload. Nothing is stored."""
    wire = _check_request(limits, header, len(segments))
    if wire not in dtypes.VALUE_DTYPES:
        raise InvalidArgument(f"header.wire_dtype {wire.name} cannot carry values: use "
                              f"FLOAT32, FLOAT16 or BFLOAT16")
    view_payload = byte_view(payload) if payload is not None else memoryview(b"")
    total = len(view_payload)
    offset = 0
    rows = 0
    parsed = []
    for i, seg in enumerate(segments):
        t = table_of(view, server, header.job, seg.table)
        spec = t.spec
        s = Segment(t, wire, base_versions=seg.base_versions)
        _check_selector(i, spec, seg.selector)
        if spec.kind is TableKind.DENSE:
            s.lo, s.hi = int(seg.start), int(seg.stop)
            check_range(spec, s.lo, s.hi)
            count = s.hi - s.lo
            if with_values:
                nbytes = count * wire.itemsize
                if offset + nbytes > total:
                    raise InvalidArgument(
                        f"segment {i} ({spec.name!r} [{s.lo}, {s.hi})) needs {nbytes} bytes of "
                        f"{wire.name} values, but the payload has {total - offset} left")
                s.values = dtypes.decode(view_payload[offset:offset + nbytes], wire, count)
                offset += nbytes
        else:
            if seg.all_stored:
                if with_values or seg.count:
                    raise InvalidArgument(
                        f"segment {i} ({spec.name!r}): all_stored is for pulls, with count 0")
                s.all_stored = True
                parsed.append(s)
                continue
            count = int(seg.count)
            rows = _count_rows(rows + count, limits)
            nbytes = count * 8
            if offset + nbytes > total:
                raise InvalidArgument(
                    f"segment {i} ({spec.name!r}) declares {count} ids ({nbytes} bytes) but the "
                    f"payload has {total - offset} bytes left")
            s.ids = np.frombuffer(view_payload[offset:offset + nbytes], dtype="<i8")
            offset += nbytes
            storage_kernels.check_ids(spec, s.ids)
            if with_values:
                n_values = count * spec.dim
                vbytes = n_values * wire.itemsize
                if offset + vbytes > total:
                    raise InvalidArgument(
                        f"segment {i} ({spec.name!r}) needs {vbytes} bytes for {count} rows x "
                        f"{spec.dim} {wire.name} values, but the payload has {total - offset} left")
                s.values = dtypes.decode(view_payload[offset:offset + vbytes], wire,
                                         n_values).reshape(count, spec.dim)
                offset += vbytes
        if with_values and not t.config.allow_non_finite and s.values is not None:
            _check_finite(i, s)
        parsed.append(s)
    if offset != total:
        raise InvalidArgument(
            f"payload has {total} bytes but the segments describe {offset}: check the "
            f"segment counts and header.wire_dtype")
    return parsed


def check_slices(view: ShardMapView, server: str, limits: NodeLimits, header: Header,
                 slices: Sequence[Slice], with_values: bool) -> list[Segment]:
    """Validate a Step's slices, their arrays already bound to the frame's payload (float32
    values, int64 ids: ``shardps.rpc.step.bind``), with ``parse_segments``' rules and
    errors; the segments are views of the same arrays. Nothing is stored."""
    wire = _check_request(limits, header, len(slices))
    if wire is not WireDType.FLOAT32:
        raise InvalidArgument(f"header.wire_dtype {wire.name}: Step frames carry FLOAT32 values; send other "
                              f"dtypes as Push frames")
    rows = 0
    parsed = []
    for i, sl in enumerate(slices):
        t = table_of(view, server, header.job, sl.table)
        spec = t.spec
        s = Segment(t, wire, base_versions=sl.base_versions or {})
        _check_selector(i, spec, sl.selector)
        values = sl.values
        if spec.kind is TableKind.DENSE:
            s.lo, s.hi = int(sl.start), int(sl.stop)
            check_range(spec, s.lo, s.hi)
            expected = s.hi - s.lo
        else:
            s.ids = sl.ids
            count = s.ids.shape[0]
            rows = _count_rows(rows + count, limits)
            storage_kernels.check_ids(spec, s.ids)
            expected = count * spec.dim
            if values is not None and values.shape[0] == expected:
                values = values.reshape(count, spec.dim)
        if with_values:
            if values is None or values.size != expected:
                raise InvalidArgument(f"segment {i} ({spec.name!r}) carries "
                                      f"{0 if values is None else values.size} values; it needs {expected}")
            s.values = values
            if not t.config.allow_non_finite:
                _check_finite(i, s)
        parsed.append(s)
    return parsed


def _check_request(limits: NodeLimits, header: Header, segments: int) -> WireDType:
    """The checks of a request as a whole; its wire dtype."""
    if not header.job:
        raise InvalidArgument("request header has no job: set header.job")
    if segments > limits.max_segments:
        raise ResourceExhausted(
            f"request has {segments} segments; the limit max_segments is "
            f"{limits.max_segments}: split the request")
    return dtypes.WireDType.parse(int(header.wire_dtype))


def _check_selector(i: int, spec: TableSpec, which) -> None:
    """A dense table's segment selects a range, a sparse one's rows."""
    dense = spec.kind is TableKind.DENSE
    if which != (RANGE if dense else ROWS):
        raise InvalidArgument(f"segment {i} for {'dense' if dense else 'sparse'} table {spec.name!r} must "
                              f"select {'a range' if dense else 'rows'}, got {which}")


def _count_rows(rows: int, limits: NodeLimits) -> int:
    """``rows`` (a request's rows so far); ResourceExhausted past ``max_rows``."""
    if rows > limits.max_rows:
        raise ResourceExhausted(f"request has more than {limits.max_rows} rows (limit max_rows): "
                                f"split the request")
    return rows


def decode_request(view: ShardMapView, server: str, limits: NodeLimits, request: "PushRequest | PullRequest",
                   with_values: bool) -> list[Segment]:
    """A push's or a pull's segments: its bound slices checked (``check_slices``: a Step's),
    or its segments read from its payload (``parse_segments``)."""
    if request.slices is not None:
        return check_slices(view, server, limits, request.header, request.slices, with_values)
    payload = request.payload if isinstance(request, PushRequest) else request.ids
    return parse_segments(view, server, limits, request.header, request.segments, payload, with_values)


def _check_finite(i: int, s: Segment) -> None:
    """InvalidArgument naming the first NaN or infinity of segment ``i``'s values by the
    table's own coordinates: a dense table's element, a sparse row's id and column."""
    assert s.values is not None
    bad = kernels.first_non_finite(s.values)
    if bad < 0:
        return
    value = s.values.reshape(-1)[bad]
    if s.dense:
        where = f"element {s.lo + bad} (segment {i}: [{s.lo}, {s.hi}))"
    else:
        assert s.ids is not None
        dim = s.table.spec.dim
        where = f"row id {int(s.ids[bad // dim])}, column {bad % dim} (segment {i})"
    raise non_finite(s.table.spec.name, value, where)


def split(server: str, epoch: int, header: Header, segments: list[Segment],
          for_push: bool, loaded: Callable[[BlockKey], bool], sparse: bool = True) -> list[Part]:
    """Cut segments into per-block parts and check that ``server`` serves every block
    (``check_owned``; ``epoch`` is the server's, for the messages). ``sparse=False``: leave
    out the sparse segments that carry ids (see ``sparse_blocks``)."""
    parts: list[Part] = []
    for i, s in enumerate(segments):
        t, spec = s.table, s.table.spec
        if not sparse and not s.dense and not s.all_stored:
            continue
        if s.all_stored:     # every block of the table this node is primary of
            for b in range(spec.block_count):
                reps = t.replicas[b]
                if reps and reps[0] == server:
                    parts.append(Part((t.job, spec.name, b), t, i))
            continue
        if s.dense:
            for b in dense_blocks_of_range(spec, s.lo, s.hi):
                start, stop = spec.block_range(b)
                lo, hi = max(start, s.lo), min(stop, s.hi)
                part = Part((t.job, spec.name, b), t, i, lo, hi)
                if s.values is not None:
                    part.values = s.values[lo - s.lo:hi - s.lo]
                parts.append(part)
        else:
            ids, values = s.ids, s.values
            assert ids is not None                  # a sparse segment carries its ids
            if for_push:
                assert values is not None           # and, on a push, their values
                ids, values = kernels.coalesce(ids, values)
            groups = kernels.group_by_key(id_blocks.sparse_block_of(ids, spec.num_blocks), spec.num_blocks)
            whole = (ids, values, len(groups))
            parts.extend(Part((t.job, spec.name, b), t, i, positions=pos, whole=whole) for b, pos in groups)
    if not owned(server, header, parts, loaded):
        check_owned(server, epoch, header, parts, loaded)
    return parts


def sparse_blocks(server: str, epoch: int, header: Header, segment: Segment,
                  loaded: Callable[[BlockKey], bool]) -> np.ndarray:
    """The blocks (ascending) a sparse segment's ids fall in, checked as ``split`` checks
    them: what a pull needs, without cutting the ids per block."""
    t, spec = segment.table, segment.table.spec
    assert segment.ids is not None                   # a sparse segment carries its ids
    if kernels.AVAILABLE:
        blocks = storage_kernels.scan(segment.ids, 0, spec.num_blocks)[2].nonzero()[0]
    else:
        touched = np.zeros(spec.num_blocks, dtype=bool)
        touched[id_blocks.sparse_block_of(segment.ids, spec.num_blocks)] = True
        blocks = np.flatnonzero(touched)
    if not (serves(t, server, blocks, header.epoch)
            and not (t.lost and any(int(b) in t.lost for b in blocks))
            and all(loaded((t.job, spec.name, int(b))) for b in blocks)):
        check_owned(server, epoch, header, [Part((t.job, spec.name, int(b)), t) for b in blocks], loaded)
    return blocks


def serves(t: TableView, server: str, blocks: np.ndarray, epoch: int) -> bool:
    """Whether ``server`` is the primary of every one of ``blocks`` (an int array) of ``t``
    and none of them moved after ``epoch`` (the request's): one vectorised check, the common
    case of ``check_owned``'s first rule."""
    mine = t.server_index.get(server)
    if mine is None:
        return False
    if blocks.shape[0] == 1:            # a small table's one block: no arrays to build
        b = blocks[0]
        return bool(t.primary[b] == mine and t.since_epoch[b] <= epoch)
    return bool((t.primary[blocks] == mine).all() and (t.since_epoch[blocks] <= np.uint64(epoch)).all())


def owned(server: str, header: Header, parts: list[Part],
          loaded: Callable[[BlockKey], bool]) -> bool:
    """Whether ``check_owned`` would pass: one vectorised check per table (the common
    case); False sends the caller to ``check_owned`` for the error naming the block."""
    by_table: dict[int, tuple[TableView, list[int]]] = {}
    for part in parts:
        entry = by_table.get(id(part.table))
        if entry is None:
            entry = by_table[id(part.table)] = (part.table, [])
        entry[1].append(part.key[2])
        if not loaded(part.key):
            return False
    for t, blocks in by_table.values():
        if t.lost and any(b in t.lost for b in blocks):
            return False
        if not serves(t, server, np.asarray(blocks, dtype=np.int64), header.epoch):
            return False
    return True


def check_assign_ids(segments: list[Segment]) -> None:
    """InvalidArgument, naming the table and an id, if a sparse segment of an ASSIGN push
    repeats an id: an ASSIGN writes each row once (gradients of a repeated id are summed;
    values written are not). Nothing is stored."""
    for i, s in enumerate(segments):
        ids = s.ids
        if ids is None or ids.shape[0] < 2 or bool((ids[1:] > ids[:-1]).all()):
            continue                        # none, one, or ascending: unique
        ordered = np.sort(ids)
        repeated = ordered[1:][ordered[1:] == ordered[:-1]]
        if repeated.shape[0]:
            raise InvalidArgument(
                f"segment {i}: ASSIGN of sparse table {s.table.name!r} repeats id {int(repeated[0])}: "
                f"an ASSIGN writes each row once; send every id once per segment")


def check_owned(server: str, epoch: int, header: Header, parts: list[Part],
                loaded: Callable[[BlockKey], bool]) -> None:
    """StaleEpoch unless ``server`` is each part's primary and the block did not move after
    the request's epoch; DataLost (Unavailable while the manager restores them) if blocks
    lost every replica; Unavailable if ``loaded(key)`` says its state is not here yet."""
    lost = sorted({(part.table.job, part.table.name, part.key[2]) for part in parts
                   if part.key[2] in part.table.lost})
    for part in parts:
        t, b = part.table, part.key[2]
        reps = t.replicas[b]
        if not reps or reps[0] != server:
            raise StaleEpoch(
                f"block {b} of table {t.name!r} is served by {reps[0] if reps else 'nobody'}, "
                f"not {server}, under epoch {epoch}: refresh the shard map and retry")
        if int(t.since_epoch[b]) > header.epoch:
            raise StaleEpoch(
                f"block {b} of table {t.name!r} moved at epoch {int(t.since_epoch[b])}, after "
                f"the request's epoch {header.epoch}: refresh the shard map and retry")
    if lost:
        table = next(p.table for p in parts if (p.table.job, p.table.name) == lost[0][:2])
        raise lost_blocks_error(table, [k[2] for k in lost if k[:2] == lost[0][:2]])
    for part in parts:
        t, b = part.table, part.key[2]
        if not loaded(part.key):
            raise Unavailable(
                f"block {b} of table {t.name!r} is assigned to {server} but its state has "
                f"not been loaded yet: retry shortly")


def lost_blocks_error(t: TableView, blocks: list[int]) -> DataLost | Unavailable:
    """The refusal of a request touching ``blocks`` of ``t`` that lost every replica."""
    first = t.lost[blocks[0]]
    shown = f"{blocks[:10]}{' ...' if len(blocks) > 10 else ''}"
    what = (f"block(s) {shown} of table {t.name!r} of job {t.job!r} lost every replica"
            f"{f' with server {first.server}' if first.server else ''} at epoch {first.epoch}")
    if first.pending:
        return Unavailable(f"{what}; the manager is restoring them from the job's latest checkpoint: "
                           f"retry shortly")
    why = f" ({first.detail})" if first.detail else ""
    return DataLost(f"{what}: their values are gone{why}. Restore the job from a checkpoint "
                    f"(shardps restore {t.job}), or accept the loss (shardps reset-lost {t.job} {t.name}, "
                    f"or PSClient.reset_lost({t.name!r})): the blocks then start from their initial values")


def payload_bytes(request: "PushRequest | PullRequest", parsed: list[Segment]) -> int:
    """The bytes a push's payload (a pull's ids) took on the wire: the metrics' figure."""
    if request.slices is not None:
        return sum((0 if s.ids is None else s.ids.nbytes) + (0 if s.values is None else s.values.nbytes)
                   for s in parsed)
    payload = request.payload if isinstance(request, PushRequest) else request.ids
    return len(byte_view(payload)) if payload is not None else 0
