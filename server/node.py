"""A server node's logic: the blocks it holds, the shard map it obeys, its replication duties.

``ServerNode`` is a plain, thread-safe class; ``shardps.server.node_service`` is the thin gRPC
layer in front of it, and ``Peers`` (passed in) carries its calls to other servers.

Data path rules (the .proto states the same contract):

* Only a block's primary serves it. A request is refused with ``StaleEpoch``
  (FAILED_PRECONDITION) when, under this node's map, the block's primary is another node or
  the block moved after the request's epoch; with ``Unavailable`` when the node's map is
  older than the request's or the block's state has not been loaded here yet.
* Every request is validated whole before anything is applied: a rejected request changes
  nothing.
* Push is exactly-once per block: (session, incarnation, sequence) is remembered by every
  replica. A push is acknowledged once it is applied on every listed backup (and on every
  node a block is being copied to). Primary-backup replication: the primary applies an
  operation, then forwards it (in its order, holding the block's lock) to the backups, whose
  copies are therefore identical; readers read the primary only, so a pull sees every
  acknowledged push (linearizable per block).
* A backup applies an operation only if its version follows on from its own; otherwise it
  reports the block out of sync and the primary sends the whole block before acknowledging.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from shardps import dtypes
from shardps.dtypes import WireDType
from shardps.errors import (FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted,
                            ShardpsError, StaleEpoch, Unavailable)
from shardps.metrics import NodeMetrics
from shardps.rpc.codec import byte_view
from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.server import optimizers
from shardps.server.blocks import (Block, BlockKey, DenseBlock, SparseBlock, SparseShard, Writer,
                                   decode_metadata, encode_metadata, new_block)
from shardps.server.clocks import JobClock
from shardps.shardmap import ShardMapView, TableView
from shardps.tables import (Consistency, TableKind, check_ids, check_range, coalesce,
                            dense_blocks_of_range, group_by_block, sparse_block_of)

log = logging.getLogger("shardps.server")

GRADIENT, INITIALIZE = ps.GRADIENT, ps.INITIALIZE
MAX_CLOCK = 1 << 40          # steps: far beyond any real run, far below int64 overflow


@dataclass(frozen=True)
class NodeLimits:
    """Per-request limits; larger requests get RESOURCE_EXHAUSTED naming the limit."""

    max_request_bytes: int = 1 << 30
    max_response_bytes: int = 1 << 30
    max_rows: int = 4_000_000
    max_segments: int = 1024
    forward_timeout: float = 1.5


@dataclass
class BlockSnapshot:
    """A block's full state: header (ref, version, array layout, JSON metadata) and arrays."""

    header: ps.BlockStateHeader
    arrays: list[np.ndarray]


class Peers(Protocol):
    """How a node reaches other nodes (the gRPC implementation is in node_service)."""

    def replicate(self, node: str, epoch: int, ops: list[ps.BlockOp],
                  arrays: list[np.ndarray]) -> list[BlockKey]:
        """Forward ops; returns the blocks the backup reports out of sync. Raises on failure."""

    def load_blocks(self, node: str, epoch: int, snapshots: list[BlockSnapshot]) -> None:
        """Install whole blocks on ``node``. Raises on failure."""


class NoPeers:
    def replicate(self, node, epoch, ops, arrays):
        raise Unavailable(f"no transport to reach backup {node!r}")

    def load_blocks(self, node, epoch, snapshots):
        raise Unavailable(f"no transport to reach {node!r}")


class EpochGate:
    """Data requests enter shared; a map install enters exclusive and waits for them."""

    def __init__(self):
        self._cond = threading.Condition()
        self._active = 0
        self._closed = False

    @contextlib.contextmanager
    def shared(self):
        with self._cond:
            while self._closed:
                self._cond.wait()
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                if not self._active:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self):
        with self._cond:
            while self._closed:
                self._cond.wait()
            self._closed = True
            while self._active:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._closed = False
                self._cond.notify_all()


@dataclass
class _Part:
    """One table segment's share of one block in a request."""

    key: BlockKey
    table: TableView
    segment: int = 0
    lo: int = 0                       # dense: flat range
    hi: int = 0
    ids: np.ndarray | None = None     # sparse: unique ids (push) or ids in request order (pull)
    positions: np.ndarray | None = None   # where these rows are in the segment (its output, on pulls)
    whole: tuple | None = None        # sparse push: (ids, values, parts) of the whole segment
    _values: np.ndarray | None = None

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
class _Segment:
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


class ServerNode:
    """One server node's blocks and duties. Thread-safe; methods may block (see each)."""

    def __init__(self, name: str, peers: Peers | None = None, limits: NodeLimits = NodeLimits(),
                 metrics: NodeMetrics | None = None, clock=time.monotonic):
        self.name = name
        self.peers = peers or NoPeers()
        self.limits = limits
        self.metrics = metrics or NodeMetrics()
        self._now = clock
        self.incarnation = 0
        self.view = ShardMapView()
        self.my_index = -1
        self._gate = EpochGate()
        self._lock = threading.Lock()          # guards the dicts below
        self.blocks: dict[BlockKey, Block] = {}
        self.shards: dict[tuple[str, str], SparseShard] = {}  # a sparse table's rows on this node
        self.staged: dict[BlockKey, tuple[Block, str]] = {}   # copies received, not yet listed
        self.missing: set[BlockKey] = set()                    # listed here, state not loaded
        self.extra: dict[BlockKey, set[str]] = {}              # copy destinations to forward to
        self.needs_resync: dict[BlockKey, set[str]] = {}
        self.clocks: dict[str, JobClock] = {}
        self._apply_locks: dict[str, threading.Lock] = {}
        self._pending: dict[str, set[BlockKey]] = {}           # SYNC: blocks with pending steps
        self._holds: dict[str, float] = {}                     # job -> hold deadline
        self._hold_cond = threading.Condition()
        self.on_epoch = None          # optional callback(epoch) after each install (logging)

    # ================================================================== shard map
    @property
    def epoch(self) -> int:
        return self.view.epoch

    def reset(self, incarnation: int) -> None:
        """Start incarnation ``incarnation``: a new one forgets every block and the map (it is
        fenced until blocks are copied to it again); the same one keeps everything."""
        if incarnation == self.incarnation:
            return
        with self._gate.exclusive():
            with self._lock:
                for d in (self.blocks, self.shards, self.staged, self.extra, self.needs_resync,
                          self.clocks, self._pending, self._apply_locks):
                    d.clear()
                self.missing.clear()
                self.view = ShardMapView()
                self.my_index = -1
            self.incarnation = incarnation
        self._update_usage_metrics()

    def view_address(self, name: str) -> str:
        """Address of server ``name`` under the installed map (KeyError if unknown)."""
        return self.view.address(name)

    def install_map(self, msg: pb.ShardMap) -> int:
        """Install a newer shard map; older or equal epochs are ignored. Waits for in-flight
        data requests under the old map to finish. Returns the installed epoch."""
        if msg.epoch <= self.view.epoch:
            return self.view.epoch
        view = ShardMapView(msg)
        with self._gate.exclusive():
            if view.epoch <= self.view.epoch:
                return self.view.epoch
            self._install_locked(view)
        self._after_install()
        return view.epoch

    def _install_locked(self, view: ShardMapView) -> None:
        me = self.name
        listed: set[BlockKey] = set()
        dropped: list[Block] = []
        forget: list[tuple[str, set]] = []
        with self._lock:
            for (job, tname), t in view.tables.items():
                for b, reps in enumerate(t.replicas):
                    if me not in reps:
                        continue
                    key = (job, tname, b)
                    listed.add(key)
                    block = self.blocks.get(key)
                    if block is not None and block.spec != t.spec:
                        dropped.append(self.blocks.pop(key))   # a table re-created under the name
                        block = None
                    if block is None:
                        if key in self.staged:
                            block = self.staged.pop(key)[0]
                        elif t.since_epoch[b] == t.fresh_epoch[b]:
                            block = self._new_block(key, t.spec)
                        else:
                            self.missing.add(key)
                            continue
                        self.blocks[key] = block
                    self.missing.discard(key)
            for key in [k for k in self.blocks if k not in listed]:
                dropped.append(self.blocks.pop(key))
            for key in [k for k in self.shards if k not in view.tables]:
                del self.shards[key]
            self.missing &= listed
            for d in (self.extra, self.needs_resync):
                for key in [k for k in d if k not in listed]:
                    del d[key]
            self._prune_destinations(view)
            for key in [k for k, (blk, _) in self.staged.items()
                        if (k[0], k[1]) not in view.tables]:
                del self.staged[key]
            for job, g in view.groups.items():
                clock = self.clocks.get(job)
                if clock is None:
                    clock = self.clocks[job] = JobClock(g.consistency, g.staleness, self._now)
                    self._apply_locks[job] = threading.Lock()
                clock.set_members({m.session for m in g.members}, g.consistency, g.staleness)
                forget.append((job, g.writers))
            for job in [j for j in self.clocks if j not in view.groups]:
                del self.clocks[job]
            self.view = view
            self.my_index = view.server_names.index(me) if me in view.server_names else -1
            held = list(self.blocks.items())
        self._release(dropped)
        for job, writers in forget:         # writers that left the group can never retry
            for key, blk in held:
                if key[0] == job:
                    with blk.lock:
                        blk.forget_writers(writers)
        self.metrics.epoch.set(view.epoch)
        self._update_usage_metrics()
        if self.on_epoch is not None:
            self.on_epoch(view.epoch)

    def _prune_destinations(self, view: ShardMapView) -> None:
        """Forget copy destinations the map now lists as replicas (the copy is done: they are
        backups like any other) and any node the map declares dead, so that neither is sent
        ops or resyncs any more. Call with ``self._lock`` held."""
        dead = {s.name for s in view.servers if s.state == pb.DEAD}
        live = set(view.server_names) - dead
        for key in list(self.extra):
            t = view.tables[(key[0], key[1])]
            dests = (self.extra[key] - set(t.replicas[key[2]])) & live
            if dests:
                self.extra[key] = dests
            else:
                del self.extra[key]
        for key in list(self.needs_resync):
            nodes = self.needs_resync[key] & live
            if nodes:
                self.needs_resync[key] = nodes
            else:
                del self.needs_resync[key]

    def _after_install(self) -> None:
        """Work a new map may unlock: resync listed backups, apply completed SYNC steps.
        A backup that cannot be reached now does not fail the install: it stays marked and is
        resynced before its block acknowledges the next push."""
        for key in list(self.needs_resync):
            block = self.blocks.get(key)
            if block is not None and self._is_primary(key):
                with block.lock:
                    try:
                        self._resync_locked(block)
                    except Unavailable as exc:
                        log.warning("resync after epoch %d deferred: %s", self.view.epoch, exc.message)
        for job in list(self.clocks):
            self._apply_ready_steps(job)

    def _new_block(self, key: BlockKey, spec) -> Block:
        """A new empty block; a sparse one stores its rows in the table's shard here. Call
        with ``self._lock`` held."""
        if spec.kind is TableKind.SPARSE:
            shard = self.shards.get((key[0], key[1]))
            if shard is None or shard.spec != spec:
                shard = self.shards[(key[0], key[1])] = SparseShard(spec)
            return new_block(key, spec, shard)
        return new_block(key, spec)

    @staticmethod
    def _release(blocks: list[Block]) -> None:
        """Free the rows of sparse blocks this node no longer holds. Lock order: a block's
        lock is never taken while ``self._lock`` is held (copy_blocks takes them the other
        way round), so callers pop blocks under ``self._lock`` and release them after."""
        for blk in blocks:
            if isinstance(blk, SparseBlock):
                with blk.lock:
                    blk.release()

    def _is_primary(self, key: BlockKey) -> bool:
        t = self.view.tables.get((key[0], key[1]))
        return t is not None and key[2] < len(t.replicas) and bool(t.replicas[key[2]]) \
            and t.replicas[key[2]][0] == self.name

    def _backups(self, key: BlockKey) -> list[str]:
        t = self.view.tables[(key[0], key[1])]
        listed = list(t.replicas[key[2]][1:])
        return listed + sorted(self.extra.get(key, set()) - set(listed))

    # ================================================================== validation
    def _table(self, job: str, name: str) -> TableView:
        view = self.view
        t = view.tables.get((job, name))
        if t is None:
            if job not in view.jobs():
                raise NotFound(f"job {job!r} not found on server {self.name} (epoch {view.epoch}): "
                               f"create the job first, or refresh the shard map")
            raise NotFound(f"table {name!r} of job {job!r} not found (epoch {view.epoch}): "
                           f"create it first, or refresh the shard map")
        return t

    def _check_header(self, header: pb.RequestHeader) -> None:
        """Bounds every header field can be checked against without the map."""
        if not 0 <= header.clock < MAX_CLOCK:
            raise InvalidArgument(f"header.clock={header.clock}: a worker's completed steps must "
                                  f"lie in [0, {MAX_CLOCK})")

    def _member(self, header: pb.RequestHeader) -> bool:
        """Whether the request's session is a live member of its job's group."""
        group = self.view.groups.get(header.job)
        return bool(header.session) and group is not None and any(
            m.session == header.session for m in group.members)

    def _check_epoch(self, header: pb.RequestHeader) -> None:
        if header.epoch > self.view.epoch:
            raise Unavailable(
                f"server {self.name} is at epoch {self.view.epoch}, behind the request's epoch "
                f"{header.epoch}: retry shortly")

    def _parse_segments(self, header: pb.RequestHeader, segments: Sequence[pb.Segment],
                        payload, with_values: bool) -> list[_Segment]:
        """Decode and validate every segment against the payload. Nothing is stored."""
        if not header.job:
            raise InvalidArgument("request header has no job: set header.job")
        if len(segments) > self.limits.max_segments:
            raise ResourceExhausted(
                f"request has {len(segments)} segments; the limit max_segments is "
                f"{self.limits.max_segments}: split the request")
        wire = dtypes.WireDType.parse(int(header.wire_dtype))
        if wire not in dtypes.VALUE_DTYPES:
            raise InvalidArgument(f"header.wire_dtype {wire.name} cannot carry values: use "
                                  f"FLOAT32, FLOAT16 or BFLOAT16")
        view_payload = byte_view(payload) if payload is not None else memoryview(b"")
        total = len(view_payload)
        offset = 0
        rows = 0
        parsed = []
        for i, seg in enumerate(segments):
            t = self._table(header.job, seg.table)
            spec = t.spec
            which = seg.WhichOneof("selector")
            s = _Segment(t, wire, base_versions={bv.block: bv.version for bv in seg.base_versions})
            if spec.kind is TableKind.DENSE:
                if which != "range":
                    raise InvalidArgument(
                        f"segment {i} for dense table {spec.name!r} must select a range, got {which}")
                s.lo, s.hi = int(seg.range.start), int(seg.range.stop)
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
                if which != "rows":
                    raise InvalidArgument(
                        f"segment {i} for sparse table {spec.name!r} must select rows, got {which}")
                if seg.rows.all_stored:
                    if with_values or seg.rows.count:
                        raise InvalidArgument(
                            f"segment {i} ({spec.name!r}): all_stored is for pulls, with count 0")
                    s.all_stored = True
                    parsed.append(s)
                    continue
                count = int(seg.rows.count)
                rows += count
                if rows > self.limits.max_rows:
                    raise ResourceExhausted(
                        f"request has more than {self.limits.max_rows} rows (limit max_rows): "
                        f"split the request")
                nbytes = count * 8
                if offset + nbytes > total:
                    raise InvalidArgument(
                        f"segment {i} ({spec.name!r}) declares {count} ids ({nbytes} bytes) but the "
                        f"payload has {total - offset} bytes left")
                s.ids = np.frombuffer(view_payload[offset:offset + nbytes], dtype="<i8")
                offset += nbytes
                check_ids(spec, s.ids)
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
            if with_values and not t.config.allow_non_finite and s.values is not None \
                    and s.values.size and not _all_finite(s.values):
                bad = int(np.flatnonzero(~np.isfinite(s.values.reshape(-1)))[0])
                raise InvalidArgument(
                    f"segment {i} ({spec.name!r}) holds a non-finite value "
                    f"({s.values.reshape(-1)[bad]} at element {bad}): NaN/Inf gradients are "
                    f"rejected unless the table's config sets allow_non_finite")
            parsed.append(s)
        if offset != total:
            raise InvalidArgument(
                f"payload has {total} bytes but the segments describe {offset}: check the "
                f"segment counts and header.wire_dtype")
        return parsed

    def _split(self, header: pb.RequestHeader, segments: list[_Segment], for_push: bool) -> list[_Part]:
        """Cut segments into per-block parts and check that this node serves every block."""
        parts: list[_Part] = []
        for i, s in enumerate(segments):
            t, spec = s.table, s.table.spec
            if s.all_stored:     # every block of the table this node is primary of
                for b in range(spec.block_count):
                    reps = t.replicas[b]
                    if reps and reps[0] == self.name:
                        parts.append(_Part((t.job, spec.name, b), t, i))
                continue
            if s.dense:
                for b in dense_blocks_of_range(spec, s.lo, s.hi):
                    start, stop = spec.block_range(b)
                    lo, hi = max(start, s.lo), min(stop, s.hi)
                    part = _Part((t.job, spec.name, b), t, i, lo, hi)
                    if s.values is not None:
                        part.values = s.values[lo - s.lo:hi - s.lo]
                    parts.append(part)
            else:
                ids, values = s.ids, s.values
                if for_push:
                    ids, values = coalesce(ids, values)
                blocks_of = sparse_block_of(ids, spec.num_blocks)
                groups = group_by_block(blocks_of)
                whole = (ids, values, len(groups)) if for_push else None
                parts.extend(_Part((t.job, spec.name, b), t, i, ids=ids[pos], positions=pos, whole=whole)
                             for b, pos in groups)
        self._check_owned(header, parts)
        return parts

    def _check_owned(self, header: pb.RequestHeader, parts: list[_Part]) -> None:
        for part in parts:
            t, b = part.table, part.key[2]
            reps = t.replicas[b]
            if not reps or reps[0] != self.name:
                raise StaleEpoch(
                    f"block {b} of table {t.name!r} is served by {reps[0] if reps else 'nobody'}, "
                    f"not {self.name}, under epoch {self.view.epoch}: refresh the shard map and retry")
            if int(t.since_epoch[b]) > header.epoch:
                raise StaleEpoch(
                    f"block {b} of table {t.name!r} moved at epoch {int(t.since_epoch[b])}, after "
                    f"the request's epoch {header.epoch}: refresh the shard map and retry")
            if part.key in self.missing or part.key not in self.blocks:
                raise Unavailable(
                    f"block {b} of table {t.name!r} is assigned to {self.name} but its state has "
                    f"not been loaded yet: retry shortly")

    # ================================================================== push
    def push(self, header: pb.RequestHeader, kind: int, segments: Sequence[pb.Segment],
             payload, deadline: float | None = None) -> ps.PushAck:
        """Apply a push (gradients, or initial values) to this node's blocks and their backups.

        Blocks while the job is held for a checkpoint and while backups apply the forwarded
        operations. Raises InvalidArgument / NotFound / StaleEpoch / Unavailable /
        ResourceExhausted; a raised error means nothing was acknowledged (a retry is safe).
        """
        if kind not in (GRADIENT, INITIALIZE, ps.PUSH_KIND_UNSPECIFIED):
            raise InvalidArgument(f"push kind {kind}: unknown (use GRADIENT or INITIALIZE)")
        kind = kind or GRADIENT
        self._wait_unheld(header.job, deadline)
        writer = Writer(header.session, int(header.incarnation), int(header.sequence),
                        int(header.acked_below))
        started = self._now()
        self._check_header(header)
        with self._gate.shared():
            self._check_epoch(header)
            self._check_writer(header)
            parsed = self._parse_segments(header, segments, payload, with_values=True)
            parts = self._split(header, parsed, for_push=True)
            group = self.view.groups.get(header.job)
            sync = group is not None and group.consistency is Consistency.SYNC and kind == GRADIENT
            if sync and parts and not self._member(header):
                raise FailedPrecondition(
                    f"job {header.job!r} is SYNC: its pushes are applied as steps of its worker "
                    f"group, and session {header.session!r} is not a member under epoch "
                    f"{self.view.epoch}: join the group (PSClient.join) before pushing")
            if sync and self._member(header):
                clock = self.clocks.get(header.job)
                if clock is not None and header.clock > clock.applied_steps:
                    # a SYNC worker pushes step t only after pulling step t, which waited for
                    # step t - 1: a clock further ahead is not a real worker's
                    raise FailedPrecondition(
                        f"SYNC push for step {header.clock} while this server has applied "
                        f"{clock.applied_steps} steps: a worker pushes step t after pulling it")
            ack = self._apply_parts(parts, kind, writer, sync, int(header.clock), parsed)
            if parts:
                optimizer = parts[0].table.config.optimizer.kind.name
                self.metrics.update_seconds.labels(optimizer).observe(self._now() - started)
        nbytes = len(byte_view(payload)) if payload is not None else 0
        self.metrics.request_bytes.labels("Push").observe(nbytes)
        self.metrics.bytes.labels("in").inc(nbytes)
        self.metrics.request_rows.labels("Push").observe(
            sum(s.ids.shape[0] for s in parsed if s.ids is not None))
        if header.session and kind == GRADIENT:
            clock = self.clocks.get(header.job)
            if clock is not None:
                clock.report(header.session, int(header.clock))
                if sync:
                    self._apply_ready_steps(header.job)
        return ack

    def _check_writer(self, header: pb.RequestHeader) -> None:
        """A session's pushes are accepted only from its current incarnation."""
        if not header.session:
            return
        group = self.view.groups.get(header.job)
        if group is None:
            return
        for m in group.members:
            if m.session == header.session:
                if m.incarnation != header.incarnation:
                    raise FailedPrecondition(
                        f"session {header.session} incarnation {header.incarnation} is fenced: "
                        f"the group's current incarnation is {m.incarnation}")
                return
        # not (or no longer) a member under this map: accept; the block record still dedups

    def _apply_parts(self, parts: list[_Part], kind: int, writer: Writer, sync: bool,
                     step: int, parsed: list[_Segment]) -> ps.PushAck:
        ack = ps.PushAck()
        if not parts:
            return ack
        parts.sort(key=lambda p: p.key)
        blocks = [self.blocks[p.key] for p in parts]
        unique = sorted({id(b): b for b in blocks}.values(), key=lambda b: b.key)
        base = {}
        for s in parsed:
            for b, v in s.base_versions.items():
                base[(s.table.job, s.table.name, b)] = v
        with contextlib.ExitStack() as stack:
            for blk in unique:
                stack.enter_context(blk.lock)
            # pass 1: preconditions, before anything changes
            for part, blk in zip(parts, blocks):
                if blk.already_applied(writer):
                    continue
                if kind == INITIALIZE:
                    if not isinstance(blk, DenseBlock):
                        raise InvalidArgument(f"INITIALIZE is for dense tables; "
                                              f"{part.table.name!r} is sparse")
                    if (part.lo, part.hi) != (blk.start, blk.stop):
                        raise InvalidArgument(
                            f"INITIALIZE of table {part.table.name!r} must cover whole blocks: "
                            f"block {part.key[2]} is [{blk.start}, {blk.stop}), got "
                            f"[{part.lo}, {part.hi})")
                elif isinstance(blk, DenseBlock) and not blk.initialized:
                    raise FailedPrecondition(
                        f"table {part.table.name!r} block {part.key[2]} has no initial values "
                        f"yet: push INITIALIZE first")
            if sync:
                self._check_step_open(parts[0].key[0], step, unique)
            self._check_quota(parts, blocks, writer)
            for blk in unique:
                if self.needs_resync.get(blk.key):
                    self._resync_locked(blk)
            # pass 2: apply, in block order
            ops: list[tuple[BlockKey, ps.BlockOp, list[np.ndarray]]] = []
            duplicates = 0
            todo: list[tuple[_Part, Block]] = []
            for part, blk in zip(parts, blocks):
                if blk.already_applied(writer):
                    duplicates += 1
                    continue
                if part.key in base:
                    self.metrics.updates_between.labels(part.key[0]).observe(
                        max(0, blk.version - base[part.key]))
                todo.append((part, blk))
            i = 0
            while i < len(todo):
                part, blk = todo[i]
                j = i + 1
                if isinstance(blk, SparseBlock) and kind == GRADIENT and not sync:
                    # every sparse block of one table in one vectorised update
                    while j < len(todo) and todo[j][1].key[:2] == blk.key[:2] \
                            and todo[j][1] is not todo[j - 1][1]:
                        j += 1
                    ops.extend(self._apply_sparse(todo[i:j], writer))
                else:
                    op, arrays = self._apply_one(blk, part, kind, writer, sync, step)
                    ops.append((blk.key, op, arrays))
                i = j
            for blk in unique:
                blk.remember(writer)
            if duplicates:
                self.metrics.duplicates.labels(parts[0].key[0]).inc(duplicates)
            self._forward_locked(ops, unique)
            for blk in unique:
                ack.versions.add(table=blk.key[1], block=blk.key[2], version=blk.version)
            ack.duplicate_blocks = duplicates
        return ack

    def _apply_sparse(self, group: list[tuple[_Part, Block]], writer: Writer):
        """Apply the parts of one sparse table (distinct blocks, unique ids) at once; returns
        one op per block for the backups. Block locks are held."""
        t = group[0][0].table
        whole = group[0][0].whole
        if whole is not None and whole[2] == len(group) and all(p.whole is whole for p, _ in group):
            ids, grads = whole[0], whole[1]           # the whole segment: no re-assembly
        else:
            ids = np.concatenate([p.ids for p, _ in group])
            grads = np.concatenate([p.values for p, _ in group])
        shard = group[0][1].shard
        with shard.lock:
            shard.apply(t.config, ids, np.ascontiguousarray(grads, dtype=np.float32).reshape(-1, t.spec.dim))
        out = []
        wid = ps.WriterId(session=writer.session, incarnation=writer.incarnation,
                          sequence=writer.sequence, acked_below=writer.acked_below)
        for part, blk in group:
            blk.version += 1
            if not self._backups(blk.key):
                continue                              # nothing to forward
            op = ps.BlockOp(job=blk.key[0], table=blk.key[1], block=blk.key[2], kind=ps.APPLY, writer=wid,
                            config_version=t.config.version, id_count=part.ids.shape[0],
                            element_count=part.values.size, version=blk.version)
            out.append((blk.key, op, [np.ascontiguousarray(part.ids, dtype=np.int64),
                                      np.ascontiguousarray(part.values, dtype=np.float32)]))
        return out

    def _check_step_open(self, job: str, step: int, blocks: list[Block]) -> None:
        """SYNC: refuse a push for a step that was already applied here (block locks held).

        The blocks are registered as pending *before* the check, so a step that closes after
        the check still finds them (``_apply_ready_steps`` closes a step, then collects the
        pending blocks, then takes their locks): a push is either part of its step or refused.
        A refused push leaves at most a registration without data, which the next step drops.
        """
        with self._lock:
            self._pending.setdefault(job, set()).update(b.key for b in blocks)
        clock = self.clocks.get(job)
        if clock is not None and step < clock.closed_below:
            raise FailedPrecondition(
                f"SYNC step {step} of job {job!r} was already applied on server {self.name} "
                f"({clock.closed_below} steps applied) without this push; nothing was applied: "
                f"push each step once, for the step after the last one pulled (PSClient keeps "
                f"the step when a loop uses client.step() / next_step())")

    def _check_quota(self, parts: list[_Part], blocks: list[Block], writer: Writer) -> None:
        """RESOURCE_EXHAUSTED when this push would store more of its job than the job's
        quota allows on this server (the quota is shared by servers in proportion to the
        block replicas they hold). Block locks are held."""
        job = parts[0].key[0]
        group = self.view.groups.get(job)
        if group is None or not group.quota_bytes:
            return
        new = 0
        for part, blk in zip(parts, blocks):
            if blk.already_applied(writer):
                continue
            row_bytes = 4 * (1 + len(optimizers.state_names(part.table.config.optimizer)))
            if isinstance(blk, DenseBlock):
                if blk.values is None:
                    new += blk.size * row_bytes
            else:
                new += int((blk.lookup(part.ids) < 0).sum()) * (blk.dim * row_bytes + 12)
        if not new:
            return
        with self._lock:
            held = [(k, b) for k, b in self.blocks.items() if k[0] == job]
        total = sum(len(reps) for (j, _), t in self.view.tables.items() if j == job for reps in t.replicas)
        share = group.quota_bytes * len(held) // max(1, total)
        usage = sum(logical_bytes(b, self.view.tables[(k[0], k[1])]) for k, b in held
                    if (k[0], k[1]) in self.view.tables)
        if usage + new > share:
            raise ResourceExhausted(
                f"job {job!r} is over its storage quota (quota_bytes={group.quota_bytes}; this server "
                f"holds {len(held)} of its {total} block replicas, a share of {share} bytes): it stores "
                f"{usage} bytes and this push would add {new}: raise the quota or delete tables")

    def _apply_one(self, blk: Block, part: _Part, kind: int, writer: Writer, sync: bool,
                   step: int) -> tuple[ps.BlockOp, list[np.ndarray]]:
        """Apply one part to its block (lock held); returns the op to forward to backups."""
        t = part.table
        op = ps.BlockOp(job=blk.key[0], table=blk.key[1], block=blk.key[2],
                        writer=ps.WriterId(session=writer.session, incarnation=writer.incarnation,
                                           sequence=writer.sequence, acked_below=writer.acked_below),
                        config_version=t.config.version)
        if isinstance(blk, DenseBlock):
            op.range.start, op.range.stop = part.lo, part.hi
            op.element_count = part.hi - part.lo
            arrays = [np.ascontiguousarray(part.values, dtype=np.float32)]
        else:
            op.id_count = part.ids.shape[0]
            op.element_count = part.values.size
            arrays = [np.ascontiguousarray(part.ids, dtype=np.int64),
                      np.ascontiguousarray(part.values, dtype=np.float32)]
        if kind == INITIALIZE:
            op.kind = ps.INITIAL
            blk.initialize(part.lo, part.hi, arrays[0])
        elif sync:
            op.kind = ps.ACCUMULATE
            op.step = step
            self._accumulate(blk, step, arrays, part.lo, part.hi)
        else:
            op.kind = ps.APPLY
            self._apply_gradient(blk, t, arrays, op)
        op.version = blk.version
        return op, arrays

    def _apply_gradient(self, blk: Block, t: TableView, arrays, op: ps.BlockOp) -> None:
        if isinstance(blk, DenseBlock):
            blk.apply_gradient(t.config, op.range.start, op.range.stop, arrays[0])
        else:
            blk.apply_gradient(t.config, arrays[0], arrays[1].reshape(-1, blk.dim))

    def _accumulate(self, blk: Block, step: int, arrays, lo: int, hi: int) -> None:
        """SYNC: add a gradient to the block's pending sum of ``step`` (a copy is kept)."""
        if isinstance(blk, DenseBlock):
            blk.accumulate(step, (lo, hi, np.array(arrays[0], dtype=np.float32)))
        else:
            blk.accumulate(step, (np.array(arrays[0], dtype=np.int64),
                                  np.array(arrays[1], dtype=np.float32).reshape(-1, blk.dim)))
        blk.version += 1
        with self._lock:
            self._pending.setdefault(blk.key[0], set()).add(blk.key)

    # ================================================================== replication
    def _forward_locked(self, ops: list[tuple[BlockKey, ps.BlockOp, list[np.ndarray]]],
                        blocks: list[Block]) -> None:
        """Send ops to every backup (block locks held). Out-of-sync blocks are sent whole.
        Raises Unavailable if a backup cannot be reached (the ops stay applied here; the
        backup is marked for a full resync before this block acknowledges anything)."""
        if not ops:
            return
        by_node: dict[str, list[tuple[BlockKey, ps.BlockOp, list[np.ndarray]]]] = {}
        for key, op, arrays in ops:
            for node in self._backups(key):
                by_node.setdefault(node, []).append((key, op, arrays))
        if not by_node:
            return
        by_key = {b.key: b for b in blocks}
        failures = []
        for node, items in by_node.items():
            started = self._now()
            try:
                stale = self.peers.replicate(node, self.view.epoch, [op for _, op, _ in items],
                                             [a for _, _, arrays in items for a in arrays])
                for key in stale:
                    if key in by_key:
                        self._send_whole(by_key[key], node)
                self.metrics.replication_seconds.observe(self._now() - started)
            except ShardpsError as exc:
                for key, _, _ in items:
                    self.needs_resync.setdefault(key, set()).add(node)
                failures.append(f"{node}: {exc.message}")
        if failures:
            raise Unavailable(f"backup(s) did not apply the push: {'; '.join(failures)}; "
                              f"retry (the push will not be applied twice)")

    def _resync_locked(self, blk: Block) -> None:
        """Send the whole block to backups marked out of sync (lock held)."""
        nodes = self.needs_resync.get(blk.key, set())
        targets = set(self._backups(blk.key)) if self._is_primary(blk.key) else set()
        for node in sorted(nodes):
            if node not in targets:
                nodes.discard(node)
                continue
            try:
                self._send_whole(blk, node)
                nodes.discard(node)
            except ShardpsError as exc:
                raise Unavailable(f"backup {node} of block {blk.key} needs a full copy and "
                                  f"cannot be reached ({exc.message}): retry") from exc
        if not nodes:
            self.needs_resync.pop(blk.key, None)

    def _send_whole(self, blk: Block, node: str) -> None:
        self.peers.load_blocks(node, self.view.epoch, [snapshot_block(blk)])
        self.metrics.resyncs.inc()

    def apply_replicated(self, epoch: int, source: str, ops: Sequence[ps.BlockOp],
                         payload) -> tuple[int, list[BlockKey]]:
        """Apply a primary's forwarded ops (in order). Returns (applied, out-of-sync keys).

        Accepted only from the block's primary under this node's map (or from the node that
        copied a staged block here), for blocks that did not move after ``epoch``.
        """
        buf = byte_view(payload) if payload is not None else memoryview(b"")
        offset = 0
        applied = 0
        stale: list[BlockKey] = []
        view = self.view
        for op in ops:
            key = (op.job, op.table, int(op.block))
            arrays = []
            if op.kind in (ps.APPLY, ps.ACCUMULATE, ps.INITIAL):
                for count, dtype, size in ((op.id_count, "<i8", 8), (op.element_count, "<f4", 4)):
                    if dtype == "<i8" and not count:
                        continue
                    n = int(count) * size
                    if offset + n > len(buf):
                        raise InvalidArgument(f"replicate payload has {len(buf)} bytes; op {key} needs "
                                              f"{n} more after byte {offset}")
                    arrays.append(np.frombuffer(buf[offset:offset + n], dtype=dtype))
                    offset += n
            blk = self._replica_block(view, key, source, epoch)
            with blk.lock:
                if op.version != blk.version + 1:
                    stale.append(key)
                    continue
                writer = Writer(op.writer.session, op.writer.incarnation, op.writer.sequence,
                                op.writer.acked_below)
                t = view.tables.get((op.job, op.table))
                if op.kind == ps.APPLY:
                    if t is None or t.config.version != op.config_version:
                        # our config is behind the primary's: take the whole block instead
                        stale.append(key)
                        continue
                    self._apply_gradient(blk, t, arrays, op)
                elif op.kind == ps.INITIAL:
                    blk.initialize(op.range.start, op.range.stop, arrays[0])
                elif op.kind == ps.ACCUMULATE:
                    self._accumulate(blk, int(op.step), arrays, op.range.start, op.range.stop)
                elif op.kind == ps.APPLY_STEP:
                    if t is None:
                        stale.append(key)
                        continue
                    self._apply_step_locked(blk, t, int(op.step), int(op.divisor))
                else:
                    raise InvalidArgument(f"unknown block op kind {op.kind}")
                blk.remember(writer)
                applied += 1
        if offset != len(buf):
            raise InvalidArgument(f"replicate payload has {len(buf)} bytes; ops describe {offset}")
        return applied, stale

    def _replica_block(self, view: ShardMapView, key: BlockKey, source: str, epoch: int) -> Block:
        t = view.tables.get((key[0], key[1]))
        with self._lock:
            blk = self.blocks.get(key)
            staged = self.staged.get(key)
        if blk is not None and t is not None:
            reps = t.replicas[key[2]]
            if reps and reps[0] == source and int(t.since_epoch[key[2]]) <= epoch:
                return blk
            if reps and reps[0] == self.name:
                raise StaleEpoch(f"{self.name} is the primary of block {key} under epoch "
                                 f"{view.epoch}; {source} (epoch {epoch}) is not")
        if staged is not None and staged[1] == source:
            return staged[0]
        raise StaleEpoch(
            f"{self.name} does not hold block {key} as a backup of {source} under epoch "
            f"{view.epoch} (sender's epoch {epoch})")

    # ================================================================== SYNC steps
    def _apply_ready_steps(self, job: str) -> None:
        """Apply every SYNC step all live workers completed (mean over live workers)."""
        clock = self.clocks.get(job)
        lock = self._apply_locks.get(job)
        if clock is None or lock is None or clock.mode is not Consistency.SYNC:
            return
        with lock:
            ready = clock.steps_to_apply()
            clock.close(ready.stop)      # before collecting: see _check_step_open
            with self._lock:
                keys = list(self._pending.get(job, set()))
            with_data = set()
            for k in keys:
                blk = self.blocks.get(k)
                if blk is not None:
                    with blk.lock:
                        with_data.update(st for st in blk.pending if st in ready)
                        if not blk.pending:
                            with self._lock:
                                self._pending.get(job, set()).discard(k)
            with_data = sorted(with_data)
            for step in with_data:      # steps nobody pushed data for need no work here
                divisor = max(1, len(clock.live))
                with self._gate.shared(), contextlib.ExitStack() as stack:
                    with self._lock:
                        keys = sorted(self._pending.get(job, set()))
                    ops = []
                    touched = []
                    for key in keys:
                        blk = self.blocks.get(key)
                        if blk is None or not self._is_primary(key):
                            continue
                        stack.enter_context(blk.lock)
                        touched.append(blk)
                        if step not in blk.pending:
                            continue
                        t = self.view.tables[(key[0], key[1])]
                        self._apply_step_locked(blk, t, step, divisor)
                        ops.append((key, ps.BlockOp(job=key[0], table=key[1], block=key[2],
                                                    kind=ps.APPLY_STEP, step=step, divisor=divisor,
                                                    version=blk.version,
                                                    config_version=t.config.version), []))
                    try:
                        self._forward_locked(ops, touched)
                    except Unavailable as exc:
                        log.warning("step %d of job %s applied; a backup missed it (%s): it "
                                    "will be resynced", step, job, exc.message)
                clock.mark_applied(step)
            if len(ready):
                clock.skip_to(ready.stop)

    def _apply_step_locked(self, blk: Block, t: TableView, step: int, divisor: int) -> None:
        parts = blk.pending.pop(step, [])
        if isinstance(blk, DenseBlock):
            total = np.zeros(blk.size, dtype=np.float32)
            for lo, hi, g in parts:
                total[lo - blk.start:hi - blk.start] += g
            total /= np.float32(divisor)
            blk.apply_gradient(t.config, blk.start, blk.stop, total)
        else:
            if parts:
                ids = np.concatenate([p[0] for p in parts])
                grads = np.concatenate([p[1] for p in parts])
                ids, grads = coalesce(ids, grads)
                blk.apply_gradient(t.config, ids, grads / np.float32(divisor))
            else:
                blk.version += 1
        if not blk.pending:
            with self._lock:
                self._pending.get(blk.key[0], set()).discard(blk.key)

    # ================================================================== pull
    def pull(self, header: pb.RequestHeader, segments: Sequence[pb.Segment], ids_payload,
             deadline: float | None = None, out_buffer=None) -> tuple[ps.PullHeader, list[np.ndarray]]:
        """Read values; returns the header and the wire-encoded arrays, in segment order.

        ``out_buffer`` (a writable buffer, e.g. a shared-memory region): float32 values are
        written straight into it (``header.in_shared_memory`` is then set and the returned
        list is empty); other cases return the arrays as usual.

        SYNC / BOUNDED groups: first waits (up to ``deadline``) for the consistency condition.
        """
        header_out = ps.PullHeader()
        self._check_header(header)
        with self._gate.shared():          # a malformed pull is refused before it waits
            self._check_epoch(header)
            parsed = self._parse_segments(header, segments, ids_payload, with_values=False)
            parsed_under = self.view
        clock = self.clocks.get(header.job)
        if clock is not None and self._member(header):
            waited = self._now()
            staleness = clock.wait_for_pull(int(header.clock), deadline)
            header_out.waited_seconds = self._now() - waited
            if clock.mode is not Consistency.ASYNC:
                self.metrics.staleness.labels(header.job).observe(staleness)
            header_out.min_clock = clock.min_completed() if clock.mode is not Consistency.SYNC \
                else clock.applied_steps
        elif clock is not None:
            header_out.min_clock = clock.applied_steps if clock.mode is Consistency.SYNC \
                else clock.min_completed()
        outputs: list[np.ndarray] = []
        with self._gate.shared():
            self._check_epoch(header)
            if self.view is not parsed_under:      # a new map came in while the pull waited
                parsed = self._parse_segments(header, segments, ids_payload, with_values=False)
            out_bytes = sum(((s.hi - s.lo) if s.dense else s.ids.shape[0] * s.table.spec.dim)
                            * s.dtype.itemsize for s in parsed if not s.all_stored)
            if out_bytes > self.limits.max_response_bytes:
                raise ResourceExhausted(
                    f"pull would return {out_bytes} bytes; the limit max_response_bytes is "
                    f"{self.limits.max_response_bytes}: pull smaller ranges")
            parts = self._split(header, parsed, for_push=False)
            in_place = (out_buffer is not None and out_bytes <= len(out_buffer)
                        and all(not s.all_stored and s.dtype is WireDType.FLOAT32 for s in parsed))
            values = []
            pos = 0
            for s in parsed:
                if s.all_stored:
                    values.append(None)
                    continue
                shape = (s.hi - s.lo,) if s.dense else (s.ids.shape[0], s.table.spec.dim)
                if in_place:
                    n = int(np.prod(shape))
                    values.append(np.frombuffer(out_buffer, dtype="<f4", count=n, offset=pos).reshape(shape))
                    pos += 4 * n
                else:
                    values.append(np.empty(shape, dtype=np.float32))
            stored: dict[int, list] = {i: [] for i, s in enumerate(parsed) if s.all_stored}
            versions: dict[BlockKey, int] = {}
            sparse_parts: dict[int, list[_Part]] = {}
            for part in parts:
                s, out = parsed[part.segment], values[part.segment]
                if not s.dense and not s.all_stored:
                    sparse_parts.setdefault(part.segment, []).append(part)
                    continue
                blk = self.blocks[part.key]
                with blk.lock:
                    if s.dense:
                        blk.read(part.lo, part.hi, out=out[part.lo - s.lo:part.hi - s.lo])
                    else:
                        meta, arrays = blk.snapshot()
                        stored[part.segment].append((arrays["ids"], arrays["values"]))
                    versions[part.key] = blk.version
            for seg_index, seg_parts in sparse_parts.items():
                # one vectorised read of every block of the segment, consistent across them
                blks = sorted({self.blocks[p.key].key: self.blocks[p.key] for p in seg_parts}.values(),
                              key=lambda b: b.key)
                with contextlib.ExitStack() as stack:
                    for blk in blks:
                        stack.enter_context(blk.lock)
                    s = parsed[seg_index]
                    shard = blks[0].shard
                    with shard.lock:
                        shard.read(s.ids, out=values[seg_index])
                    for blk in blks:
                        versions[blk.key] = blk.version
            for i, (s, out) in enumerate(zip(parsed, values)):
                if s.all_stored:
                    got = stored[i]
                    ids = np.concatenate([g[0] for g in got]) if got else np.empty(0, np.int64)
                    rows = (np.concatenate([g[1] for g in got]) if got
                            else np.empty((0, s.table.spec.dim), np.float32))
                    outputs.append(ids.astype("<i8"))
                    outputs.append(dtypes.encode(rows, s.dtype))
                    header_out.segments.add(dtype=s.dtype.value, elements=rows.size, ids=ids.shape[0])
                    continue
                if not in_place:
                    outputs.append(dtypes.encode(out, s.dtype))
                header_out.segments.add(dtype=s.dtype.value, elements=out.size)
            if in_place:
                header_out.in_shared_memory = True
                header_out.payload_bytes = out_bytes
            for key, v in sorted(versions.items()):
                header_out.versions.add(table=key[1], block=key[2], version=v)
        nbytes = sum(a.nbytes for a in outputs) if outputs else int(header_out.payload_bytes)
        header_out.payload_bytes = nbytes
        self.metrics.request_bytes.labels("Pull").observe(nbytes)
        self.metrics.bytes.labels("out").inc(nbytes)
        self.metrics.request_rows.labels("Pull").observe(
            sum(s.ids.shape[0] for s in parsed if s.ids is not None))
        return header_out, outputs

    # ================================================================== block transfer
    def copy_blocks(self, epoch: int, refs: Sequence[tuple[str, str, int]], destination: str) -> tuple[int, int]:
        """Primary: send ``refs`` whole to ``destination`` and forward later ops to it too,
        until a map lists it (or drops the move). Returns (blocks copied, bytes)."""
        copied = nbytes = 0
        for key in refs:
            key = tuple(key)
            blk = self.blocks.get(key)
            if blk is None or not self._is_primary(key):
                raise StaleEpoch(f"{self.name} is not the primary of block {key} under epoch "
                                 f"{self.view.epoch}: the manager's plan is stale")
            with blk.lock:
                snap = snapshot_block(blk)
                self.peers.load_blocks(destination, self.view.epoch, [snap])
                with self._lock:
                    self.extra.setdefault(key, set()).add(destination)
                    self.needs_resync.get(key, set()).discard(destination)
            copied += 1
            nbytes += sum(a.nbytes for a in snap.arrays)
        return copied, nbytes

    def load_blocks(self, epoch: int, source: str, snapshots: Sequence[BlockSnapshot]) -> int:
        """Install whole blocks sent by their primary (copy, resync) or by the manager
        (restore, source ``"manager"``). Refused for blocks this node is primary of."""
        loaded = 0
        for snap in snapshots:
            ref = snap.header.ref
            key = (ref.job, ref.table, int(ref.block))
            t = self.view.tables.get((key[0], key[1]))
            if t is None or key[2] >= len(t.replicas):
                raise Unavailable(f"{self.name} does not know table {key[1]!r} of job {key[0]!r} "
                                  f"at epoch {self.view.epoch}: retry after the map is installed")
            reps = t.replicas[key[2]]
            if reps and reps[0] == self.name and source != "manager":
                raise StaleEpoch(f"{self.name} is the primary of {key} under epoch {self.view.epoch}; "
                                 f"it does not take copies from {source}")
            meta = decode_metadata(snap.header.metadata)
            arrays = {info.name: arr for info, arr in zip(snap.header.arrays, snap.arrays)}
            with self._lock:
                if self.name in reps:
                    blk = self.blocks.get(key)
                    if blk is None:
                        blk = self.blocks[key] = self._new_block(key, t.spec)
                    self.missing.discard(key)
                else:
                    staged = self.staged.get(key)
                    blk = staged[0] if staged is not None else self._new_block(key, t.spec)
                    self.staged[key] = (blk, source)
            with blk.lock:
                blk.load(meta, arrays)
            loaded += 1
        self._update_usage_metrics()
        return loaded

    def snapshot_blocks(self, refs: Sequence[tuple[str, str, int]] | None = None,
                        job: str | None = None) -> list[BlockSnapshot]:
        """Whole blocks this node is primary of: ``refs``, or all blocks of ``job``."""
        if refs is None:
            refs = sorted(k for k in self.blocks if k[0] == job and self._is_primary(k))
        out = []
        for key in refs:
            key = tuple(key)
            blk = self.blocks.get(key)
            if blk is None or not self._is_primary(key):
                raise StaleEpoch(f"{self.name} is not the primary of block {key} under epoch "
                                 f"{self.view.epoch}")
            with blk.lock:
                out.append(snapshot_block(blk))
        return out

    # ================================================================== jobs
    def hold_job(self, job: str, hold: bool, seconds: float = 30.0) -> None:
        """Hold (or release) new pushes of ``job``; a hold expires after ``seconds``."""
        with self._hold_cond:
            if hold:
                self._holds[job] = self._now() + seconds
            else:
                self._holds.pop(job, None)
            self._hold_cond.notify_all()
        if hold:   # wait for pushes already inside to finish
            with self._gate.exclusive():
                pass

    def _wait_unheld(self, job: str, deadline: float | None) -> None:
        with self._hold_cond:
            while True:
                until = self._holds.get(job)
                now = self._now()
                if until is None or until <= now:
                    self._holds.pop(job, None)
                    return
                wait = until - now
                if deadline is not None:
                    if deadline <= now:
                        raise Unavailable(f"job {job!r} is held for a checkpoint: retry")
                    wait = min(wait, deadline - now)
                self._hold_cond.wait(timeout=wait)

    def drop_tables(self, job: str, tables: Sequence[str] = ()) -> int:
        with self._lock:
            keys = [k for k in self.blocks if k[0] == job and (not tables or k[1] in tables)]
            dropped = [self.blocks.pop(k) for k in keys]
        self._release(dropped)
        self._update_usage_metrics()
        return len(keys)

    # ================================================================== status
    def usage(self) -> dict:
        primary = replica = 0
        nbytes = 0
        tables: dict[tuple[str, str], list[int]] = {}
        with self._lock:
            items = list(self.blocks.items())
        for key, blk in items:
            if self._is_primary(key):
                primary += 1
            else:
                replica += 1
            b = blk.nbytes()
            nbytes += b
            params = (blk.values.size if isinstance(blk, DenseBlock) and blk.values is not None
                      else blk.count * blk.dim if isinstance(blk, SparseBlock) else 0)
            entry = tables.setdefault((key[0], key[1]), [0, 0, 0])
            entry[0] += 1
            entry[1] += params
            entry[2] += b
        return {"primary_blocks": primary, "replica_blocks": replica, "bytes": nbytes,
                "tables": tables}

    def _update_usage_metrics(self) -> None:
        self.publish_usage(self.usage())

    def publish_usage(self, u: dict) -> None:
        """Set the per-table and per-role gauges from ``usage()``."""
        self.metrics.blocks.labels("primary").set(u["primary_blocks"])
        self.metrics.blocks.labels("backup").set(u["replica_blocks"])
        self.metrics.table_parameters.clear()
        self.metrics.table_bytes.clear()
        for (job, table), (_, params, b) in u["tables"].items():
            self.metrics.table_parameters.labels(job, table).set(params)
            self.metrics.table_bytes.labels(job, table).set(b)


def _all_finite(values: np.ndarray) -> bool:
    """True if no NaN or Inf: one cheap reduction, the exact check only if the sum is not
    finite (a NaN or Inf always makes the sum non-finite; a huge finite sum may too)."""
    if np.isfinite(values.sum()):
        return True
    return bool(np.isfinite(values).all())


def logical_bytes(blk: Block, t: TableView) -> int:
    """Bytes a block's stored parameters and optimizer state need (without growth slack)."""
    per = 4 * (1 + len(optimizers.state_names(t.config.optimizer)))
    if isinstance(blk, DenseBlock):
        return blk.size * per if blk.values is not None else 0
    return blk.count * (blk.dim * per + 12)


# ====================================================================== snapshots
def snapshot_block(blk: Block) -> BlockSnapshot:
    meta, arrays = blk.snapshot()
    header = ps.BlockStateHeader(
        ref=ps.BlockRef(job=blk.key[0], table=blk.key[1], block=blk.key[2]),
        version=blk.version, metadata=encode_metadata(meta),
        initialized=bool(meta.get("initialized", True)))
    out = []
    for name, arr in arrays.items():
        # every array travels as float32 or int64, whatever its storage type
        arr = np.ascontiguousarray(arr, dtype="<i8" if arr.dtype.kind in "iu" else "<f4")
        header.arrays.add(name=name, dtype=pb.INT64 if arr.dtype.kind == "i" else pb.FLOAT32,
                          shape=list(arr.shape))
        out.append(arr)
    return BlockSnapshot(header, out)


