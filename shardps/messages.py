"""The data requests a server node takes and the replies it returns, as plain values.

The wire contract is ``protos/v1`` (``RequestHeader``, ``Segment``, ``PushHeader``,
``PullRequest``, ``PushAck``, ``PullHeader``); ``shardps.rpc.messages`` turns those messages
into these values at the node's door and these replies back into messages, so the node never
sees protobuf (as in ps-lite, where only the van knows the wire). Bulk bytes stay where they
arrived: ``payload`` / ``ids`` are views into the receive buffer, valid while the request is
served.

Plain dataclasses with slots; no logic beyond naming the fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Segment selectors (``Segment.selector`` in common.proto)
RANGE, ROWS = "range", "rows"
# Push kinds (``PushKind``; the numbers are the proto's)
PUSH_KIND_UNSPECIFIED, GRADIENT, INITIALIZE, ASSIGN = 0, 1, 2, 3


@dataclass(slots=True)
class Header:
    """``RequestHeader``: who sends the request, under which map, at which step."""

    job: str
    epoch: int = 0
    session: str = ""
    incarnation: int = 0
    sequence: int = 0
    acked_below: int = 0
    clock: int = 0
    wire_dtype: int = 0              # a ``WireDType`` value (0: unspecified, FLOAT32)


@dataclass(slots=True)
class Selection:
    """One table's part of a request (``Segment``): a flat dense range ``[start, stop)`` or
    ``count`` sparse ids (``all_stored``: every row the server stores, pulls only).
    ``selector`` is RANGE, ROWS or None (none set: refused by the node).
    ``base_versions``: push only, block -> version the worker pulled it at."""

    table: str
    selector: str | None = None
    start: int = 0
    stop: int = 0
    count: int = 0
    all_stored: bool = False
    base_versions: dict[int, int] = field(default_factory=dict)


@dataclass(slots=True)
class PushRequest:
    """A push: ``segments`` describe ``payload`` (concatenated in segment order); or, on a
    server, ``slices``: its tables' parts with their arrays bound (a Step frame's push)."""

    header: Header
    kind: int
    segments: list[Selection]
    payload: Any = b""               # a bytes-like object (or, on a client, a list of arrays)
    slices: list[Slice] | None = None


@dataclass(slots=True)
class PullRequest:
    """A pull: the sparse segments' ids, concatenated in segment order, are ``ids``; or, on
    a server, ``slices``: its tables' parts with their ids bound (a Step frame's pull)."""

    header: Header
    segments: list[Selection]
    ids: Any = b""                   # a bytes-like object (or, on a client, a list of arrays)
    slices: list[Slice] | None = None


@dataclass(slots=True)
class Versions:
    """Versions of blocks of one table: ``blocks[i]`` is at ``versions[i]`` (sequences of
    ints: lists or integer arrays)."""

    table: str
    blocks: Any
    versions: Any


def versions_by_table(entries) -> list[Versions]:
    """``Versions`` per table, in order of first appearance, from ``(table, block, version)``
    triples."""
    by_table: dict[str, Versions] = {}
    for table, block, version in entries:
        entry = by_table.get(table)
        if entry is None:
            entry = by_table[table] = Versions(table, [], [])
        entry.blocks.append(block)
        entry.versions.append(version)
    return list(by_table.values())


@dataclass(slots=True)
class PushAck:
    """What a push's server acknowledged (``PushAck``)."""

    versions: list[Versions] = field(default_factory=list)
    duplicate_blocks: int = 0


@dataclass(slots=True)
class Layout:
    """One segment's part of a pull's reply payload (``SegmentLayout``)."""

    dtype: int
    elements: int
    ids: int = 0


@dataclass(slots=True)
class PullReply:
    """A pull's reply (``PullHeader``); its payload travels beside it as arrays."""

    segments: list[Layout] = field(default_factory=list)
    versions: list[Versions] = field(default_factory=list)
    payload_bytes: int = 0
    min_clock: int = 0
    in_shared_memory: bool = False
    waited_seconds: float = 0.0


@dataclass(slots=True)
class Slice:
    """One table's part of a ``StepRequest``: a flat dense range ``[start, stop)`` (``ids``
    None) or ``ids`` of sparse rows; ``values`` the push's float32 values (None in a pull).
    On a server, ``ids`` and ``values`` are views of the received bytes and ``values`` is
    flat (a sparse table's rows ``[len(ids) * dim]``: the node checks its length against the
    table). On a client they are the caller's arrays (sparse values ``[n, dim]``, a dense
    range's values flat) and ``positions`` (None: all) picks the rows this request carries."""

    table: str
    selector: str
    start: int = 0
    stop: int = 0
    ids: Any = None
    values: Any = None
    positions: Any = None
    base_versions: dict[int, int] | None = None   # a dense push's (see ``Selection``)


@dataclass(slots=True)
class StepRequest:
    """One worker step against one server (the data plane's Step frame): a push (``push``:
    its slices, None for no push; an empty list is a clock report) applied first, then a
    pull (``pull``: its slices, None for no pull) with clock ``pull_clock``. ``header`` is
    the push's (its ``clock``) and the pull's (every other field)."""

    header: Header
    kind: int = GRADIENT
    push: list[Slice] | None = None
    pull: list[Slice] | None = None
    pull_clock: int = 0


@dataclass(slots=True)
class StepReply:
    """What a server answered to a ``StepRequest``: the push's acknowledgement (None: no
    push) and the pull's reply (None: no pull) with its values: ``values`` one float32 array
    per pull slice, or empty where they were written into the buffer the caller gave."""

    ack: PushAck | None = None
    pull: PullReply | None = None
    values: list = field(default_factory=list)
