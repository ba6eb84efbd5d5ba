"""Primary-backup replication: a primary forwards its ops and whole blocks (``Forwarder``), a
backup applies them (``BackupApplier``).

Contract (the .proto states the same):

* The primary applies an operation, then forwards it, in its order and holding the block's
  lock, to every backup the map lists and every node the block is being copied to; it
  acknowledges a push only once every one of them applied it. Backups' copies are therefore
  identical to the primary's.
* A backup applies an operation only if its version follows on from its own; otherwise it
  reports the block out of sync and the primary sends the whole block before acknowledging.
* A backup that cannot be reached is marked in ``BlockTable.needs_resync``; the primary keeps
  the op and raises ``Unavailable`` (a retry is deduplicated), and sends the block whole
  before it acknowledges anything else of that block.

``Peers`` (passed in) carries the calls to other nodes; the gRPC one is in server/node/service.py.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence, cast

import numpy as np

from shardps.errors import InvalidArgument, ShardpsError, StaleEpoch, Unavailable
from shardps.metrics import NodeMetrics
from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.rpc.codec import byte_view
from shardps.server.node.apply import apply_gradient, assign_values
from shardps.server.node.blocks import (
    AnyBlock,
    BlockKey,
    BlockLocks,
    DenseBlock,
    Writer,
    decode_metadata,
    encode_metadata,
    remember_all,
)
from shardps.server.node.table import BlockTable
from shardps.shardmap import ShardMapView

if TYPE_CHECKING:
    from shardps.server.node.steps import SyncSteps

log = logging.getLogger("shardps.server")

# TEST-ONLY (shardps/verify/defects.py): "3" makes backups skip the lifecycle decisions a
# primary forwards with its APPLY ops (ids not admitted, ids evicted) so the verifier's
# replica check can show it catches replicas that diverge.
_TEST_DEFECT = os.environ.get("SHARDPS_TEST_REINTRODUCE_DEFECT", "")

Op = tuple[BlockKey, ps.BlockOp, list[np.ndarray]]   # a block's op and its arrays, to forward


@dataclass
class BlockSnapshot:
    """A block's full state: header (ref, version, array layout, JSON metadata) and arrays."""

    header: ps.BlockStateHeader
    arrays: list[np.ndarray]


def snapshot_block(blk: AnyBlock) -> BlockSnapshot:
    """``blk``'s whole state, every array as float32 or int64. Hold ``blk.lock``."""
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


class Peers(Protocol):
    """How a node reaches other nodes (the gRPC implementation is in server/node/service.py)."""

    def replicate(self, node: str, epoch: int, ops: list[ps.BlockOp],
                  arrays: list[np.ndarray]) -> list[BlockKey]:
        """Forward ops; returns the blocks the backup reports out of sync. Raises on failure."""

    def load_blocks(self, node: str, epoch: int, snapshots: list[BlockSnapshot],
                    resync: bool = False) -> None:
        """Install whole blocks on ``node``. Raises on failure. ``resync``: a block sent
        whole on the push path (a backup out of sync), within the forward timeout like
        ``replicate``: a paused backup must not hold its primary's pushes and map installs
        for longer (a copy of a move may take much longer)."""

    def abandon(self, node: str) -> int:
        """Make the calls in flight to ``node`` fail now (Unavailable); returns how many."""


class NoPeers:
    """Peers of a node that has none: every call raises Unavailable."""

    def replicate(self, node, epoch, ops, arrays):
        raise Unavailable(f"no transport to reach backup {node!r}")

    def load_blocks(self, node, epoch, snapshots, resync=False):
        raise Unavailable(f"no transport to reach {node!r}")

    def abandon(self, node):
        return 0


class Forwarder:
    """The primary's side: forward ops, send whole blocks (resync, copy), snapshot blocks.

    Thread-safe; methods named ``*_locked`` expect the locks of the blocks they are given
    held. Every method may block on ``peers`` (up to its timeout) holding block locks.
    ``peers`` may be replaced after construction (the node's ``peers`` attribute).
    """

    def __init__(self, table: BlockTable, metrics: NodeMetrics, peers: Peers,
                 clock=time.monotonic):
        self.table = table
        self.metrics = metrics
        self.peers = peers
        self._now = clock
        # nodes the newest map this node received declares dead: calls to them fail at once
        self.dead: frozenset[str] = frozenset()
        self._dead_epoch = 0
        self._dead_lock = threading.Lock()

    def declare_dead(self, epoch: int, nodes: set[str]) -> None:
        """The map of ``epoch``, being installed, declares ``nodes`` dead: the calls in flight
        to them fail now, and so does every later call until a newer map lists them alive.
        Requests admitted under the old map still forward to its backups, and a paused backup
        (its socket still accepts connections) would hold each of them, and so the install
        that waits for them, until the forward timeout. An older map's call is ignored."""
        with self._dead_lock:
            if epoch < self._dead_epoch:
                return
            newly = nodes - self.dead
            self.dead, self._dead_epoch = frozenset(nodes), epoch
        for node in sorted(newly):
            self.peers.abandon(node)

    def _reachable(self, node: str) -> None:
        if node in self.dead:
            raise Unavailable(f"{node} was declared dead by the shard map")

    def forward_locked(self, ops: list[Op], blocks: list[AnyBlock]) -> None:
        """Send ops to every backup (block locks held). Out-of-sync blocks are sent whole.
        Raises Unavailable if a backup cannot be reached (the ops stay applied here; the
        backup is marked for a full resync before this block acknowledges anything)."""
        if not ops:
            return
        by_node: dict[str, list[Op]] = {}
        for key, op, arrays in ops:
            for node in self.table.backups(key):
                by_node.setdefault(node, []).append((key, op, arrays))
        if not by_node:
            return
        by_key = {b.key: b for b in blocks}
        failures = []
        for node, items in by_node.items():
            started = self._now()
            try:
                self._reachable(node)
                stale = self.peers.replicate(node, self.table.view.epoch, [op for _, op, _ in items],
                                             [a for _, _, arrays in items for a in arrays])
                for key in stale:
                    if key in by_key:
                        self.send_whole(by_key[key], node)
                self.metrics.replication_seconds.observe(self._now() - started)
            except ShardpsError as exc:
                for key, _, _ in items:
                    self.table.needs_resync.setdefault(key, set()).add(node)
                failures.append(f"{node}: {exc.message}")
        if failures:
            raise Unavailable(f"backup(s) did not apply the push: {'; '.join(failures)}; "
                              f"retry (the push will not be applied twice)")

    def resync_locked(self, blk: AnyBlock) -> None:
        """Send the whole block to backups marked out of sync (lock held). Raises
        Unavailable, leaving the rest marked, if one cannot be reached."""
        nodes = self.table.needs_resync.get(blk.key, set())
        targets = set(self.table.backups(blk.key)) if self.table.is_primary(blk.key) else set()
        for node in sorted(nodes):
            if node not in targets:
                nodes.discard(node)
                continue
            try:
                self.send_whole(blk, node)
                nodes.discard(node)
            except ShardpsError as exc:
                raise Unavailable(f"backup {node} of block {blk.key} needs a full copy and "
                                  f"cannot be reached ({exc.message}): retry") from exc
        if not nodes:
            self.table.needs_resync.pop(blk.key, None)

    def resync_marked(self) -> None:
        """Resync every marked block this node is primary of (after a map install). A backup
        that cannot be reached now stays marked and is resynced before its block
        acknowledges the next push; nothing is raised."""
        for key in list(self.table.needs_resync):
            block = self.table.blocks.get(key)
            if block is not None and self.table.is_primary(key):
                with block.lock:
                    try:
                        self.resync_locked(block)
                    except Unavailable as exc:
                        log.warning("resync after epoch %d deferred: %s", self.table.view.epoch,
                                    exc.message)

    def send_whole(self, blk: AnyBlock, node: str) -> None:
        """Load ``blk`` whole on ``node`` (lock held). Raises what ``peers`` raises."""
        self._reachable(node)
        self.peers.load_blocks(node, self.table.view.epoch, [snapshot_block(blk)], resync=True)
        self.metrics.resyncs.inc()

    def copy_blocks(self, epoch: int, refs: Sequence[tuple[str, str, int]], destination: str) -> tuple[int, int]:
        """Primary: send ``refs`` whole to ``destination`` and forward later ops to it too,
        until a map lists it (or drops the move). Returns (blocks copied, bytes). Raises
        StaleEpoch for a block this node is not primary of."""
        copied = nbytes = 0
        for ref in refs:
            key, blk = self._primary_block(ref)
            with blk.lock:
                snap = snapshot_block(blk)
                self._reachable(destination)
                self.peers.load_blocks(destination, self.table.view.epoch, [snap])
                self.table.add_destination(key, destination)
            copied += 1
            nbytes += sum(a.nbytes for a in snap.arrays)
        return copied, nbytes

    def snapshot_blocks(self, refs: Sequence[tuple[str, str, int]] | None = None,
                        job: str | None = None) -> list[BlockSnapshot]:
        """Whole blocks this node is primary of: ``refs``, or all blocks of ``job``. Raises
        StaleEpoch for a block this node is not primary of."""
        if refs is None:
            refs = sorted(k for k in self.table.blocks if k[0] == job and self.table.is_primary(k))
        out = []
        for ref in refs:
            _, blk = self._primary_block(ref)
            with blk.lock:
                out.append(snapshot_block(blk))
        return out

    def _primary_block(self, ref) -> tuple[BlockKey, AnyBlock]:
        """The block ``ref`` (a tuple or list) names; StaleEpoch unless this node is its
        primary (the manager's plan or request is behind the map)."""
        key = cast(BlockKey, tuple(ref))
        blk = self.table.blocks.get(key)
        if blk is None or not self.table.is_primary(key):
            raise StaleEpoch(f"{self.table.name} is not the primary of block {key} under epoch "
                             f"{self.table.view.epoch}: the request is behind the map")
        return key, blk


def _decode_ops(ops: Sequence[ps.BlockOp], payload) -> list[Op]:
    """Each op with its key and arrays (views of ``payload``: ids int64, values float32).
    InvalidArgument if the payload does not match the ops."""
    buf = byte_view(payload) if payload is not None else memoryview(b"")
    offset = 0
    out: list[Op] = []
    for op in ops:
        arrays = []
        if op.kind in (ps.APPLY, ps.ACCUMULATE, ps.INITIAL, ps.ASSIGN_VALUES):
            for count, dtype, size in ((op.id_count, "<i8", 8), (op.element_count, "<f4", 4)):
                if dtype == "<i8" and not count:
                    continue
                n = int(count) * size
                if offset + n > len(buf):
                    raise InvalidArgument(f"replicate payload has {len(buf)} bytes; op "
                                          f"{(op.job, op.table, op.block)} needs {n} more after byte {offset}")
                arrays.append(np.frombuffer(buf[offset:offset + n], dtype=dtype))
                offset += n
        out.append(((op.job, op.table, int(op.block)), op, arrays))
    if offset != len(buf):
        raise InvalidArgument(f"replicate payload has {len(buf)} bytes; ops describe {offset}")
    return out


class BackupApplier:
    """The backup's side: apply a primary's forwarded ops, load whole blocks.

    Thread-safe; takes block locks in key order (``BlockLocks``), with nothing held on
    entry. No I/O.
    """

    def __init__(self, table: BlockTable, steps: "SyncSteps"):
        self.table = table
        self.steps = steps

    def apply_replicated(self, epoch: int, source: str, ops: Sequence[ps.BlockOp],
                         payload) -> tuple[int, list[BlockKey]]:
        """Apply a primary's forwarded ops (in order). Returns (applied, out-of-sync keys).

        Accepted only from the block's primary under this node's map (or from the node that
        copied a staged block here), for blocks that did not move after ``epoch``: else
        StaleEpoch. InvalidArgument if the payload does not match the ops.
        """
        items = _decode_ops(ops, payload)
        applied = 0
        stale: list[BlockKey] = []
        view = self.table.view
        i = 0
        while i < len(items):
            run = self._sparse_run(view, items, i)
            if run > 1:
                applied += self._apply_sparse_run(view, source, epoch, items[i:i + run], stale)
                i += run
                continue
            key, op, arrays = items[i]
            i += 1
            blk = self.backup_block(view, key, source, epoch)
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
                    if _TEST_DEFECT == "3" and (op.dropped_count or op.evicted_count):
                        arrays[0] = arrays[0][:int(op.id_count - op.dropped_count - op.evicted_count)]
                        op = ps.BlockOp(job=op.job, table=op.table, block=op.block, kind=op.kind,
                                        step=op.step, version=op.version)
                    apply_gradient(blk, t, arrays, op)
                elif op.kind == ps.INITIAL:                 # dense blocks only
                    cast(DenseBlock, blk).initialize(op.range.start, op.range.stop, arrays[0])
                elif op.kind == ps.ASSIGN_VALUES:
                    if t is None or t.config.version != op.config_version:
                        stale.append(key)
                        continue
                    assign_values(blk, t, arrays, op)
                elif op.kind == ps.ACCUMULATE:
                    self.steps.accumulate(blk, int(op.step), arrays, op.range.start, op.range.stop)
                elif op.kind == ps.APPLY_STEP:
                    if t is None:
                        stale.append(key)
                        continue
                    self.steps.apply_step_locked([blk], t, int(op.step), int(op.divisor))
                else:
                    raise InvalidArgument(f"unknown block op kind {op.kind}")
                blk.remember(writer)
                applied += 1
        return applied, stale

    def _sparse_run(self, view: ShardMapView, items: list[Op], i: int) -> int:
        """How many ops from ``items[i]`` on are plain APPLYs of one sparse table's blocks
        by one writer under the config this node has (no lifecycle decisions): they are
        applied as one (``_apply_sparse_run``). 0 or 1: apply ``items[i]`` alone."""
        key, op, _ = items[i]
        if op.kind != ps.APPLY or op.dropped_count or op.evicted_count:
            return 0
        t = view.tables.get((key[0], key[1]))
        rows = self.table.sparse_rows.get((key[0], key[1]))
        if (t is None or rows is None or rows.life is not None or t.config.lifecycle.enabled
                or t.config.version != op.config_version):
            return 0
        w = op.writer
        n = 1
        seen = {key}
        for k2, op2, _ in items[i + 1:]:
            w2 = op2.writer
            if (k2 in seen or k2[:2] != key[:2] or op2.kind != ps.APPLY or op2.dropped_count or op2.evicted_count
                    or op2.config_version != op.config_version or w2.session != w.session
                    or w2.incarnation != w.incarnation or w2.sequence != w.sequence
                    or w2.acked_below != w.acked_below):
                break
            seen.add(k2)
            n += 1
        return n

    def _apply_sparse_run(self, view: ShardMapView, source: str, epoch: int, run: list[Op],
                          stale: list[BlockKey]) -> int:
        """Apply the APPLY ops of ``_sparse_run`` with one compiled update of their rows;
        blocks whose version does not follow on are reported in ``stale``. Returns how many
        were applied."""
        key0, op0, _ = run[0]
        t = view.tables[(key0[0], key0[1])]
        rows = self.table.sparse_rows[(key0[0], key0[1])]
        blocks = [self.backup_block(view, key, source, epoch) for key, _, _ in run]
        w = op0.writer
        writer = Writer(w.session, w.incarnation, w.sequence, w.acked_below)
        with BlockLocks(sorted(blocks, key=lambda blk: blk.key)):
            fresh = []
            for (key, op, arrays), blk in zip(run, blocks):
                if op.version != blk.version + 1:
                    stale.append(key)
                else:
                    fresh.append((blk, arrays))
            if not fresh:
                return 0
            ids = np.concatenate([arrays[0] for _, arrays in fresh])
            grad = np.concatenate([arrays[1] for _, arrays in fresh]).reshape(-1, t.spec.dim)
            with rows.lock:
                rows.apply_rows(t.config, ids, grad)
            done = [blk for blk, _ in fresh]
            for blk in done:
                blk.version += 1
            remember_all(done, writer)
        return len(done)

    def backup_block(self, view: ShardMapView, key: BlockKey, source: str, epoch: int) -> AnyBlock:
        """The block ``source`` may forward ``key``'s ops to here, else StaleEpoch."""
        t = view.tables.get((key[0], key[1]))
        blk, staged = self.table.lookup(key)
        if blk is not None and t is not None:
            reps = t.replicas[key[2]]
            if reps and reps[0] == source and int(t.since_epoch[key[2]]) <= epoch:
                return blk
            if reps and reps[0] == self.table.name:
                raise StaleEpoch(f"{self.table.name} is the primary of block {key} under epoch "
                                 f"{view.epoch}; {source} (epoch {epoch}) is not")
        if staged is not None and staged[1] == source:
            return staged[0]
        raise StaleEpoch(
            f"{self.table.name} does not hold block {key} as a backup of {source} under epoch "
            f"{view.epoch} (sender's epoch {epoch})")

    def load_blocks(self, epoch: int, source: str, snapshots: Sequence[BlockSnapshot]) -> int:
        """Install whole blocks sent by their primary (copy, resync) or by the manager
        (restore, source ``"manager"``). Returns how many. Refused (StaleEpoch) for blocks
        this node is primary of; Unavailable for a table its map does not have yet."""
        loaded = 0
        name = self.table.name
        for snap in snapshots:
            ref = snap.header.ref
            key = (ref.job, ref.table, int(ref.block))
            t = self.table.view.tables.get((key[0], key[1]))
            if t is None or key[2] >= len(t.replicas):
                raise Unavailable(f"{name} does not know table {key[1]!r} of job {key[0]!r} "
                                  f"at epoch {self.table.view.epoch}: retry after the map is installed")
            reps = t.replicas[key[2]]
            if reps and reps[0] == name and source != "manager":
                raise StaleEpoch(f"{name} is the primary of {key} under epoch {self.table.view.epoch}; "
                                 f"it does not take copies from {source}")
            meta = decode_metadata(snap.header.metadata)
            arrays = {info.name: arr for info, arr in zip(snap.header.arrays, snap.arrays)}
            blk = self.table.receive(key, t, source)
            with blk.lock:
                blk.load(meta, arrays)
                if blk.pending:
                    self.steps.track_locked(blk)
            loaded += 1
        return loaded
