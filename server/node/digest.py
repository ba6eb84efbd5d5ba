"""Digests of block state: one hash per block replica, so that replicas can be compared.

A digest covers a block's full state in a canonical order, exactly what a copy of the block
carries (``Block.snapshot``): values, optimizer state, per-row step counts; for a sparse
block its stored rows by ascending id (each with its row, optimizer state, step count and
lifecycle tick), its lifecycle state (clock, sketch counts, the count-min sketch) and its
pending SYNC gradients; for a dense block its step and whether it is initialized.

Left out, by design: the version (reported beside the digest: replicas are compared at
the same version) and the exactly-once writer records (each server prunes the records of
departed writers when it installs a map, at its own pace; they decide nothing about values).
Nor the per-server lifecycle counters (admitted, evicted...): those count what this server
did with the table (a primary counts its evictions by reason, a backup "evicted_replicated")
and are not block state.

Plain numpy and hashlib; no grpc.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np

from shardps.server.node.blocks import AnyBlock, BlockKey, SparseBlock

DIGEST_BYTES = 16
EXCLUDED_METADATA = ("version", "writers")


def state_digest(meta: dict, arrays: dict[str, np.ndarray]) -> bytes:
    """blake2b (``DIGEST_BYTES``) of a block snapshot (``Block.snapshot``'s metadata and
    arrays) without ``EXCLUDED_METADATA``. Arrays are hashed by name order, each with its
    dtype and shape, so equal states hash equal whatever order they were built in."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    kept = {k: v for k, v in meta.items() if k not in EXCLUDED_METADATA}
    h.update(json.dumps(kept, sort_keys=True, separators=(",", ":")).encode())
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"\0{name}\0{a.dtype.str}\0{list(a.shape)}\0".encode())
        h.update(a.tobytes())
    return h.digest()


def block_digest(blk: AnyBlock) -> bytes:
    """The digest of ``blk``'s state (see the module docstring). Hold ``blk.lock``."""
    meta, arrays = blk.snapshot()
    return state_digest(meta, arrays)


def block_size(blk: AnyBlock) -> int:
    """Rows stored (sparse) or elements materialised (dense). Hold ``blk.lock``."""
    if isinstance(blk, SparseBlock):
        return blk.count
    return 0 if blk.values is None else int(blk.values.size)


@dataclass(frozen=True)
class ReplicaDigest:
    """One block replica held by one server."""

    key: BlockKey
    version: int
    primary: bool
    digest: bytes
    size: int
    loaded: bool


def held_digests(table, job: str = "") -> list[ReplicaDigest]:
    """Digests of the blocks ``table`` (a ``server.node.table.BlockTable``) holds, of ``job``
    (empty: every job), ordered by key. Takes each block's lock in turn, nothing held on
    entry; may wait for a push in progress on a block (up to a forward timeout)."""
    with table.lock:
        items = sorted(((k, b) for k, b in table.blocks.items() if not job or k[0] == job),
                       key=lambda item: item[0])
        missing = set(table.missing)
    out = []
    for key, blk in items:
        with blk.lock:
            out.append(ReplicaDigest(key, blk.version, table.is_primary(key), block_digest(blk),
                                     block_size(blk), key not in missing))
    return out
