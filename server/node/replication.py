"""Primary-backup replication: a primary forwards its ops and whole blocks (``Forwarder``), a
backup applies them (``BackupApplier``, in ``server/node/backup.py``).

Contract (the .proto states the same):

* The primary forwards an operation, in its order and holding the block's lock, to every
  backup the map lists and every node the block is being copied to, and applies it itself
  (the common push sends first and applies while the backups do: ``start_locked``, then
  ``finish_locked``; other paths apply first); it acknowledges a push only once every one of
  them applied it. Backups' copies are therefore identical to the primary's.
* A backup applies an operation only if its version follows on from its own; otherwise it
  reports the block out of sync and the primary sends the whole block before acknowledging.
* A backup that cannot be reached is marked in ``BlockTable.needs_resync``; the primary keeps
  the op and raises ``Unavailable`` (a retry is deduplicated), and sends the block whole
  before it acknowledges anything else of that block.

``Peers`` (passed in) carries the calls to other nodes (``shardps.rpc.peers.NodePeers``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, cast

import numpy as np

from shardps.blockops import APPLY_ROWS, ArrayInfo, BlockOp, BlockRef, BlockSnapshot, BlockState
from shardps.errors import ShardpsError, StaleEpoch, Unavailable
from shardps.metrics import NodeMetrics
from shardps.server.node.blocks import AnyBlock, BlockKey, encode_metadata
from shardps.server.node.table import BlockTable

log = logging.getLogger("shardps.server")

Op = tuple[BlockKey, BlockOp, list[np.ndarray]]   # a block's op and its arrays, to forward


def snapshot_block(blk: AnyBlock) -> BlockSnapshot:
    """``blk``'s whole state, every array as float32 or int64. Hold ``blk.lock``."""
    meta, arrays = blk.snapshot()
    header = BlockState(BlockRef(*blk.key), blk.version, bool(meta.get("initialized", True)),
                        metadata=encode_metadata(meta))
    out = []
    for name, arr in arrays.items():
        # every array travels as float32 or int64, whatever its storage type
        dtype = "<i8" if arr.dtype.kind in "iu" else "<f4"
        arr = np.ascontiguousarray(arr, dtype=dtype)
        header.arrays.append(ArrayInfo(name, dtype, tuple(arr.shape)))
        out.append(arr)
    return BlockSnapshot(header, out)


@dataclass
class Forwarding:
    """One backup's ops in flight (``Forwarder.start_locked``): its answer to wait for, or
    why they could not be sent."""

    node: str
    items: list[Op]
    started: float
    answer: Callable[[], list[BlockKey]] | None = None
    error: str | None = None


class Peers(Protocol):
    """How a node reaches other nodes (``shardps.rpc.peers.NodePeers``: the data plane, else gRPC)."""

    def replicate(self, node: str, epoch: int, ops: list[BlockOp],
                  arrays: list[np.ndarray]) -> Callable[[], list[BlockKey]]:
        """Send ops to ``node``; returns the call's answer: a function that waits for the
        backup to apply them and returns the blocks it reports out of sync. Either raises on
        failure (the answer must be called once the send succeeded)."""

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
        """Send ops (applied here) to every backup and wait for them (block locks held):
        ``start_locked`` then ``finish_locked``."""
        self.finish_locked(self.start_locked(ops), blocks)

    def start_locked(self, ops: list[Op]) -> list[Forwarding]:
        """Send ops to every backup (block locks held) without waiting for the answers:
        ``finish_locked`` waits, with the same locks held. The ops may be applied here
        meanwhile. A backup that cannot be reached is left for ``finish_locked`` to report."""
        by_node: dict[str, list[Op]] = {}
        for key, op, arrays in ops:
            for node in self.table.backups(key):
                by_node.setdefault(node, []).append((key, op, arrays))
        out = []
        for node, items in by_node.items():
            call = Forwarding(node, items, self._now())
            try:
                self._reachable(node)
                call.answer = self.peers.replicate(node, self.table.view.epoch, [op for _, op, _ in items],
                                                   [a for _, _, arrays in items for a in arrays])
            except ShardpsError as exc:
                call.error = exc.message
            out.append(call)
        return out

    def finish_locked(self, calls: list[Forwarding], blocks: list[AnyBlock]) -> None:
        """Wait for the backups of ``start_locked`` (block locks held, the ops applied here).
        Out-of-sync blocks are sent whole. Raises Unavailable if a backup cannot be reached
        (the ops stay applied here; the backup is marked for a full resync before this block
        acknowledges anything)."""
        if not calls:
            return
        by_key = {b.key: b for b in blocks}
        failures = []
        for call in calls:
            if call.answer is not None:
                try:
                    for key in call.answer():
                        if key in by_key:
                            self.send_whole(by_key[key], call.node)
                    self.metrics.replication_seconds.observe(self._now() - call.started)
                except ShardpsError as exc:
                    call.error = exc.message
            if call.error is not None:
                for key, op, _ in call.items:
                    for changed in op_keys(key, op):
                        self.table.needs_resync.setdefault(changed, set()).add(call.node)
                failures.append(f"{call.node}: {call.error}")
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


def op_keys(key: BlockKey, op: BlockOp) -> list[BlockKey]:
    """The blocks ``op`` changes: its own (``key``), or an APPLY_ROWS's ``blocks``."""
    if op.kind == APPLY_ROWS:
        return [(key[0], key[1], int(b)) for b in op.blocks]
    return [key]
