"""The backup's side of primary-backup replication (``server/node/replication.py`` states
the contract): apply a primary's forwarded ops, load whole blocks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence, cast

import numpy as np

from shardps.blockops import (
    ACCUMULATE,
    APPLY,
    APPLY_ROWS,
    APPLY_STEP,
    ASSIGN_VALUES,
    INITIAL,
    WITH_ARRAYS,
    BlockOp,
    BlockSnapshot,
    Writer,
)
from shardps.errors import InvalidArgument, StaleEpoch, Unavailable
from shardps.rpc.codec import byte_view
from shardps.server.node import storage_kernels
from shardps.server.node.blocks import (
    AnyBlock,
    BlockKey,
    BlockLocks,
    DenseBlock,
    SparseRows,
    bump_versions,
    decode_metadata,
    remember_all,
)
from shardps.server.node.engine import apply_gradient, assign_values
from shardps.server.node.replication import Op, op_keys
from shardps.server.node.table import BlockTable
from shardps.shardmap import ShardMapView, TableView

if TYPE_CHECKING:
    from shardps.server.node.steps import SyncSteps


def _decode_ops(ops: Sequence[BlockOp], payload) -> list[Op]:
    """Each op with its key and arrays (views of ``payload``: ids int64, values float32).
    InvalidArgument if the payload does not match the ops."""
    buf = byte_view(payload) if payload is not None else memoryview(b"")
    offset = 0
    out: list[Op] = []
    for op in ops:
        arrays = []
        if op.kind in WITH_ARRAYS:
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
    """The backup's side: apply a primary's forwarded ops, load whole blocks. An APPLY_ROWS
    op (a sparse table's rows on several blocks) is applied in one compiled update, the
    rows of blocks out of sync left out; a run of APPLY ops of one table's blocks by one
    writer (the general path forwards one per block) likewise.

    Thread-safe; takes block locks in key order (``BlockLocks``), with nothing held on
    entry. No I/O.
    """

    def __init__(self, table: BlockTable, steps: "SyncSteps", defect: str = ""):
        self.table = table
        self.steps = steps
        # TEST-ONLY (tools/verify/defects.py): "3" makes backups skip the lifecycle decisions a
        # primary forwards with its APPLY ops (ids not admitted, ids evicted) so the verifier's
        # replica check can show it catches replicas that diverge
        self.defect = defect

    def apply_replicated(self, epoch: int, source: str, ops: Sequence[BlockOp],
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
            if items[i][1].kind == APPLY_ROWS:
                applied += self._apply_rows(view, source, epoch, items[i], stale)
                i += 1
                continue
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
                t = view.tables.get((op.job, op.table))
                if op.kind == APPLY:
                    if t is None or t.config.version != op.config_version:
                        # our config is behind the primary's: take the whole block instead
                        stale.append(key)
                        continue
                    if self.defect == "3" and (op.dropped_count or op.evicted_count):
                        arrays[0] = arrays[0][:int(op.id_count - op.dropped_count - op.evicted_count)]
                        op = BlockOp(op.job, op.table, op.block, op.kind, op.writer, op.version, step=op.step)
                    apply_gradient(blk, t, arrays, op)
                elif op.kind == INITIAL:                 # dense blocks only
                    cast(DenseBlock, blk).initialize(op.start, op.stop, arrays[0])
                elif op.kind == ASSIGN_VALUES:
                    if t is None or t.config.version != op.config_version:
                        stale.append(key)
                        continue
                    assign_values(blk, t, arrays, op)
                elif op.kind == ACCUMULATE:
                    self.steps.accumulate(blk, int(op.step), arrays, op.start, op.stop)
                elif op.kind == APPLY_STEP:
                    if t is None:
                        stale.append(key)
                        continue
                    self.steps.apply_step_locked([blk], t, int(op.step), int(op.divisor))
                else:
                    raise InvalidArgument(f"unknown block op kind {op.kind}")
                blk.remember(op.writer)
                applied += 1
        return applied, stale

    def _plain_rows(self, view: ShardMapView, job: str, table: str,
                    config_version: int) -> tuple[TableView, SparseRows] | None:
        """(table view, rows) of a sparse table whose forwarded rows this node applies in one
        compiled update: held here, under the primary's config, without lifecycle state or
        policy (no decisions to follow); else None."""
        t = view.tables.get((job, table))
        rows = self.table.sparse_rows.get((job, table))
        if (t is None or rows is None or rows.life is not None or t.config.lifecycle.enabled
                or t.config.version != config_version):
            return None
        return t, rows

    def _sparse_run(self, view: ShardMapView, items: list[Op], i: int) -> int:
        """How many ops from ``items[i]`` on are plain APPLYs of one sparse table's blocks
        by one writer (``_plain_rows``): they are applied as one (``_apply_sparse_run``).
        0 or 1: apply ``items[i]`` alone."""
        key, op, _ = items[i]
        if (op.kind != APPLY or op.dropped_count or op.evicted_count
                or self._plain_rows(view, key[0], key[1], op.config_version) is None):
            return 0
        n = 1
        seen = {key}
        for k2, op2, _ in items[i + 1:]:
            if (k2 in seen or k2[:2] != key[:2] or op2.kind != APPLY or op2.dropped_count or op2.evicted_count
                    or op2.config_version != op.config_version or op2.writer != op.writer):
                break
            seen.add(k2)
            n += 1
        return n

    def _apply_sparse_run(self, view: ShardMapView, source: str, epoch: int, run: list[Op],
                          stale: list[BlockKey]) -> int:
        """Apply the APPLY ops of ``_sparse_run`` as one update of their rows
        (``_apply_to_blocks``). Returns how many blocks were applied."""
        key0, op0, _ = run[0]
        plain = self._plain_rows(view, key0[0], key0[1], op0.config_version)
        assert plain is not None                # as _sparse_run found it
        t, rows = plain
        keys = [key for key, _, _ in run]
        blocks = [self.backup_block(view, key, source, epoch) for key in keys]
        ids = np.concatenate([arrays[0] for _, _, arrays in run])
        grad = np.concatenate([arrays[1] for _, _, arrays in run]).reshape(-1, t.spec.dim)
        blocks_of = np.repeat([key[2] for key in keys], [arrays[0].shape[0] for _, _, arrays in run])
        return self._apply_to_blocks(t, rows, keys, blocks, [op.version for _, op, _ in run], ids, grad,
                                     blocks_of, op0.writer, stale)

    def _apply_rows(self, view: ShardMapView, source: str, epoch: int, item: Op, stale: list[BlockKey]) -> int:
        """Apply an APPLY_ROWS op as one update of its rows (``_apply_to_blocks``); all its
        blocks are reported in ``stale`` where the table is not plain here (``_plain_rows``).
        Its rows are checked first: InvalidArgument, nothing changed, unless they are unique,
        inside the table and in its blocks. Returns how many blocks were applied."""
        key, op, arrays = item
        keys = op_keys(key, op)
        blocks = [self.backup_block(view, k, source, epoch) for k in keys]
        plain = self._plain_rows(view, op.job, op.table, op.config_version)
        if plain is None or len(op.versions) != len(keys):
            stale.extend(keys)
            return 0
        t, rows = plain
        ids, grad = arrays[0], arrays[1]
        status, blocks_of, counts = storage_kernels.scan(ids, t.spec.num_rows, t.spec.num_blocks, unique=True)
        if (status != 1 or grad.shape[0] != ids.shape[0] * t.spec.dim
                or not set(counts.nonzero()[0].tolist()) <= {k[2] for k in keys}):
            raise InvalidArgument(f"APPLY_ROWS op on {op.table!r} blocks {list(op.blocks)}: its "
                                  f"{ids.shape[0]} ids must be unique, inside the table and in those blocks, "
                                  f"with {t.spec.dim} values each ({grad.shape[0]} values)")
        return self._apply_to_blocks(t, rows, keys, blocks, op.versions, ids, grad.reshape(-1, t.spec.dim),
                                     blocks_of, op.writer, stale)

    @staticmethod
    def _apply_to_blocks(t: TableView, rows: SparseRows, keys: list[BlockKey], blocks: list[AnyBlock],
                         versions, ids: np.ndarray, grad: np.ndarray, blocks_of: np.ndarray, w: Writer,
                         stale: list[BlockKey]) -> int:
        """One compiled update of the rows (``ids``, each in block ``blocks_of``) of the blocks
        whose version (``versions``: each block's after the op) follows on from theirs; the
        others' rows are left out and their keys added to ``stale``. Then those blocks'
        versions and the writer's exactly-once record. Returns how many blocks were applied."""
        with BlockLocks(sorted(blocks, key=lambda blk: blk.key)):
            follows = [int(v) == blk.version + 1 for v, blk in zip(versions, blocks)]
            if not all(follows):
                stale.extend(k for k, ok in zip(keys, follows) if not ok)
                keep = np.isin(blocks_of, [k[2] for k, ok in zip(keys, follows) if ok])
                ids, grad = ids[keep], grad[keep]
            done = [blk for blk, ok in zip(blocks, follows) if ok]
            if not done:
                return 0
            with rows.lock:
                rows.apply_rows(t.config, ids, grad)
            bump_versions(done)
            remember_all(done, w)
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
