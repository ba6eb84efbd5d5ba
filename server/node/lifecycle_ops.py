"""The primary's lifecycle decisions (``server.lifecycle.Outcome``) as per-block APPLY ops.

An APPLY op of a sparse table with a lifecycle policy carries, after the rows it applies,
the ids of its block that were pushed and not admitted (``dropped_count``) and the ids the
primary evicted after the push (``evicted_count``: first the ``cooled_count`` moved to the
cold tier, then those gone); ``step`` is the push's clock. A backup replays them
(``SparseBlock.apply_decided``) and decides nothing itself.
"""

from __future__ import annotations

import numpy as np

from shardps import id_blocks, kernels
from shardps.blockops import APPLY, BlockOp
from shardps.server.node.lifecycle import Outcome

_EMPTY = np.empty(0, dtype=np.int64)


class ByBlock:
    """An outcome's ids split by block, computed on first use (only a push whose blocks
    have backups needs it)."""

    def __init__(self, outcome: Outcome, num_blocks: int):
        self.outcome = outcome
        self.num_blocks = num_blocks
        self._split: list[dict[int, np.ndarray]] | None = None

    def of(self, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(dropped ids, cooled ids, gone ids) of ``block``."""
        if self._split is None:
            o = self.outcome
            self._split = [self._group(o.dropped), self._group(o.cooled), self._group(o.gone)]
        dropped, cooled, gone = (part.get(block, _EMPTY) for part in self._split)
        return dropped, cooled, gone

    def _group(self, ids: np.ndarray) -> dict[int, np.ndarray]:
        if ids.shape[0] == 0:
            return {}
        blocks = id_blocks.sparse_block_of(ids, self.num_blocks)
        return {int(b): ids[pos] for b, pos in kernels.group_by_key(blocks, self.num_blocks)}


def by_block(outcome: Outcome, num_blocks: int) -> ByBlock:
    return ByBlock(outcome, num_blocks)


def block_op(key: tuple[str, str, int], ids: np.ndarray, values: np.ndarray, decided: ByBlock,
             clock: int) -> tuple[BlockOp, list[np.ndarray]]:
    """The APPLY op of block ``key`` for its pushed ``ids`` / ``values`` and the primary's
    decisions; the caller sets writer, config_version and version."""
    dropped, cooled, gone = decided.of(key[2])
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    values = np.asarray(values, dtype=np.float32).reshape(ids.shape[0], -1)
    if dropped.shape[0]:
        keep = ~np.isin(ids, dropped)
        ids, values = ids[keep], values[keep]
    evicted = cooled.shape[0] + gone.shape[0]
    op = BlockOp(key[0], key[1], key[2], APPLY, step=clock, id_count=ids.shape[0] + dropped.shape[0] + evicted,
                 element_count=values.size, dropped_count=dropped.shape[0], evicted_count=evicted,
                 cooled_count=cooled.shape[0])
    return op, [np.concatenate([ids, dropped, cooled, gone]), np.ascontiguousarray(values, dtype=np.float32)]
