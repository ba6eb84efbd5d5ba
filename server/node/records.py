"""Exactly-once records: which pushes of each writer a block has applied.

A push carries its writer's identity (``Writer``: session, incarnation, sequence, and the
sequence below which every push of the writer was acknowledged); each block keeps a
``WriterRecord`` per writer, checked before a push is applied (``applied_any``) and updated
with it (``remember_all``), under the blocks' locks. A retry of a push some blocks applied
is applied to the others only; records travel with their blocks (snapshots, moves,
checkpoints: ``Block._metadata``). Plain Python; no grpc, no numpy.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field

from shardps.blockops import Writer

__all__ = ["Writer", "WriterRecord", "applied_any", "remember_all"]


@dataclass(eq=False)
class WriterRecord:
    """Exactly-once record of one writer (session, incarnation) on one block.

    Every sequence below ``acked_below`` was acknowledged and is never retried; ``applied``
    holds the sequences at or above it that this block applied.

    The blocks of a push whose records agree share one record object (``holders``: the keys
    of the blocks it was given to): a worker's pushes to a server touch the same blocks step
    after step, and their record is then checked and updated once per push, not once per
    block. A shared record is updated in place only by a push to exactly its holders (under
    all their locks); any other push gives the blocks it touches records of their own
    (``remember_all``).
    """

    acked_below: int = 0
    applied: set[int] = field(default_factory=set)
    holders: frozenset = frozenset()

    # ``applied`` may also hold sequences below ``acked_below`` (they are seen either way);
    # they are dropped when it grows past this, and never written (``live``). Checked and
    # updated by ``applied_any`` / ``remember_all`` (and so ``Block.already_applied`` /
    # ``Block.remember``), the one place that reads and writes these records.
    PRUNE_AT = 16

    def live(self) -> set[int]:
        """The applied sequences a retry may still carry (at or above ``acked_below``)."""
        return {s for s in self.applied if s >= self.acked_below}

    def seen(self, sequence: int) -> bool:
        return sequence < self.acked_below or sequence in self.applied

    def note(self, sequence: int, acked_below: int) -> None:
        """Record ``sequence`` as applied, everything below ``acked_below`` as acknowledged."""
        if acked_below > self.acked_below:
            self.acked_below = acked_below
        if sequence >= self.acked_below:
            self.applied.add(sequence)
            if len(self.applied) > WriterRecord.PRUNE_AT:
                self.applied = self.live()


def applied_any(blocks, writer: Writer) -> bool:
    """Whether any of ``blocks`` already applied ``writer``'s push (locks held): a sequence
    below the record's ``acked_below`` or in its ``applied``. ``Block.already_applied`` is this
    for one block; a push checks every block of it at once (dozens of blocks): one check
    when they share one record (``WriterRecord``), the records gathered without Python per
    block."""
    if not writer.tracked:
        return False
    seq = writer.sequence
    records = list(map(dict.get, map(_WRITERS, blocks), itertools.repeat((writer.session, writer.incarnation))))
    if not records:
        return False
    first = records[0]
    if first is not None and records.count(first) == len(records):      # one shared record (identity)
        return first.seen(seq)
    return any(r is not None and r.seen(seq) for r in records)


def remember_all(blocks, writer: Writer) -> None:
    """Record ``writer``'s push as applied on every one of ``blocks`` (a sequence: read more
    than once; locks held).
    ``Block.remember`` is this for one block. When the blocks share one record given to
    exactly them, it is updated once; else ``_remember_apart``."""
    if not writer.tracked:
        return
    key = (writer.session, writer.incarnation)
    records = list(map(dict.get, map(_WRITERS, blocks), itertools.repeat(key)))
    if not records:
        return
    first = records[0]
    if (first is None or records.count(first) != len(records)
            or first.holders != frozenset(map(_KEY_OF, blocks))):
        _remember_apart(blocks, records, key, writer)
        return
    first.note(writer.sequence, writer.acked_below)


def _remember_apart(blocks, records: list, key: tuple[str, int], writer: Writer) -> None:
    """``remember_all`` where the blocks' records are not one given to exactly them: each
    block's record is updated (a shared one on a copy of its own, never in place: blocks
    outside this push hold it too), and when all then agree the blocks share one."""
    updated = []
    for blk, record in zip(blocks, records):
        own = frozenset((blk.key,))
        if record is None:
            record = WriterRecord(holders=own)
        elif record.holders != own:
            record = WriterRecord(record.acked_below, set(record.applied), own)
        record.note(writer.sequence, writer.acked_below)
        updated.append(record)
    first = updated[0]
    low, live = first.acked_below, first.live()
    if len(updated) > 1 and all(r.acked_below == low and r.live() == live for r in updated[1:]):
        first.holders = frozenset(map(_KEY_OF, blocks))
        updated = [first] * len(updated)
    for blk, record in zip(blocks, updated):
        blk.writers[key] = record


_WRITERS, _KEY_OF = operator.attrgetter("writers"), operator.attrgetter("key")
