"""Primary-backup replication's values: a block operation (``BlockOp``), the identity of the
push it belongs to (``Writer``) and a block's whole state (``BlockState``, ``BlockSnapshot``).

The wire contract is ``protos/v1/parameter_server.proto`` (``BlockOp``, ``WriterId``,
``BlockStateHeader``); ``shardps.rpc.replication`` turns those messages into these values and
back, so that a server node never sees protobuf (as ``shardps.messages`` does for the data
requests). Plain dataclasses; no logic beyond naming the fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

# Block operation kinds (``BlockOpKind``; the numbers are the proto's)
APPLY, INITIAL, ACCUMULATE, APPLY_STEP, ASSIGN_VALUES, APPLY_ROWS = 1, 2, 3, 4, 5, 6
# Kinds whose op carries arrays (ids when ``id_count``, then ``element_count`` values)
WITH_ARRAYS = frozenset({APPLY, APPLY_ROWS, ACCUMULATE, INITIAL, ASSIGN_VALUES})


@dataclass(frozen=True)
class Writer:
    """Identity of one push: (session, incarnation, sequence). Empty session: no dedup."""

    session: str = ""
    incarnation: int = 0
    sequence: int = 0
    acked_below: int = 0

    @property
    def tracked(self) -> bool:
        return bool(self.session) and self.sequence > 0


NO_WRITER = Writer()


@dataclass(slots=True)
class BlockOp:
    """One operation on one block (APPLY_ROWS: on several), as the primary applied it; the
    proto's ``BlockOp`` states each field. ``start`` / ``stop``: a dense op's flat range."""

    job: str
    table: str
    block: int
    kind: int = 0
    writer: Writer = NO_WRITER
    version: int = 0               # the block's version after this op
    config_version: int = 0
    step: int = 0
    divisor: int = 0
    id_count: int = 0
    element_count: int = 0
    start: int = 0
    stop: int = 0
    dropped_count: int = 0
    evicted_count: int = 0
    cooled_count: int = 0
    blocks: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    same_step: bool = False


class BlockRef(NamedTuple):
    """A block's key, by name: (job, table, block)."""

    job: str
    table: str
    block: int


@dataclass(slots=True)
class ArrayInfo:
    """One array of a block's state: its name, numpy dtype string (``"<f4"``, ``"<i8"``) and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(slots=True)
class BlockState:
    """``BlockStateHeader``: a block's version, whether it has values, its arrays' layout and
    its JSON metadata (writer records, step counters, pending SYNC sums)."""

    ref: BlockRef
    version: int = 0
    initialized: bool = False
    arrays: list[ArrayInfo] = field(default_factory=list)
    metadata: bytes = b""


@dataclass
class BlockSnapshot:
    """A block's full state: header and arrays (in the header's order)."""

    header: BlockState
    arrays: list[np.ndarray]
