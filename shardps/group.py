"""A worker group's manager answers as plain values: what joining gave (``Joined``) and what a
heartbeat said (``Heartbeat``).

The wire contract is ``protos/v1/manager.proto`` (``JoinWorkerGroupResponse``,
``WorkerHeartbeatResponse``); ``shardps.rpc.group`` makes the calls and turns the answers into
these values, so that a worker's membership never sees protobuf. Plain frozen dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Joined:
    """A session in a job's worker group (or, ``client``, beside it): its rank (-1 for a
    client), the group's live members then, the map epoch that lists the session, how often
    to send heartbeats, whether the job was restored from a checkpoint, and the steps this
    rank had completed before it was started again (0 for a new member)."""

    rank: int
    session: str
    incarnation: int
    members: int
    epoch: int
    heartbeat_seconds: float
    restored: bool = False
    step: int = 0


@dataclass(frozen=True)
class Heartbeat:
    """What the manager answered a heartbeat: the member's rank and the group's size now,
    the map epoch, and an on-demand checkpoint to take part in (``checkpoint_id``; empty:
    none)."""

    rank: int
    world_size: int
    epoch: int
    checkpoint_id: str = ""
    membership_version: int = 0
