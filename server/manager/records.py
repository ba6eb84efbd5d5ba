"""The records the resource manager keeps, and its settings: plain dataclasses, no logic.

``ManagerState`` (``state.py``) holds them; ``store.py`` persists the fields not marked "not
persisted"; the shard map (``ManagerState.shard_map``) publishes most of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum

from shardps.server import optimizers
from shardps.tables import Consistency, TableConfig, TableSpec


class ServerState(Enum):
    JOINING = 1
    SERVING = 2
    DRAINING = 3
    DEAD = 4


@dataclass
class ServerRecord:
    name: str
    address: str
    metrics_address: str = ""
    incarnation: int = 1
    boot_id: str = ""
    state: ServerState = ServerState.JOINING
    retired: bool = False       # drained: told to exit rather than to register again
    # not persisted
    last_heartbeat: float = 0.0
    primary_blocks: int = 0
    backup_blocks: int = 0      # blocks held, not as primary (ServerHeartbeat.replica_blocks)
    bytes: int = 0
    installed_epoch: int = 0

    @property
    def live(self) -> bool:
        return self.state is not ServerState.DEAD


@dataclass
class BlockRecord:
    replicas: list[str]
    since_epoch: int
    fresh_epoch: int
    lost_epoch: int = 0         # every replica died at this epoch: no values (BlockPlacement)


@dataclass
class DataLossRecord:
    """Blocks of one table that lost every replica at one epoch, and their recovery (the
    proto's ``DataLoss``). ``recovery``: "pending" (the manager is looking for a checkpoint
    to restore them from), "lost" (none: requests touching them get DATA_LOSS), "restored"
    (from ``checkpoint`` at ``checkpoint_step``) or "reset" (back to their initial values)."""

    epoch: int
    server: str
    table: str
    blocks: list[int]
    lost_at_step: int = 0
    recovery: str = "pending"
    checkpoint: str = ""
    checkpoint_step: int = 0
    detail: str = ""


@dataclass
class TableRecord:
    job: str
    spec: TableSpec
    config: TableConfig
    blocks: list[BlockRecord]
    # the configuration the table was created with (update_config changes ``config`` only),
    # which a later create must repeat; None where unknown (restored from a checkpoint, or
    # persisted before it was kept): any create of the same spec is accepted
    created: TableConfig | None = None


@dataclass
class MemberRecord:
    """The manager's record of a worker-group member: persisted (rank, session, incarnation,
    name) plus its lease and progress. Published in the shard map as the proto's
    ``WorkerMember``, which servers and clients read as ``shardps.shardmap.Member``."""

    rank: int
    session: str
    incarnation: int
    name: str = ""
    # not persisted
    last_heartbeat: float = 0.0
    step: int = 0
    samples_per_second: float = 0.0
    loss: float = 0.0


MAX_DATA_LOSS = 16        # data-loss records kept per job (the oldest recovered ones go first)


@dataclass
class JobRecord:
    name: str
    consistency: Consistency = Consistency.ASYNC
    staleness: int = 0
    quota_bytes: int = 0
    token_id: str = ""       # str(token generation): see token_generation
    members: dict[str, MemberRecord] = field(default_factory=dict)     # by session
    departed: dict[str, list[int]] = field(default_factory=dict)       # session -> [rank, incarnation, step]
    membership_version: int = 0
    peak_members: int = 0    # the most live members at once since the group was last empty
    step: int = 0            # the most steps a worker reported completing, over every run
    restored_path: str = ""
    restored_step: int = 0
    restore_pending: list[int] = field(default_factory=list)   # ranks yet to fetch their state
    clients: dict[str, MemberRecord] = field(default_factory=dict)     # sessions outside the group
    data_loss: list[DataLossRecord] = field(default_factory=list)      # the last MAX_DATA_LOSS

    @property
    def token_generation(self) -> int:
        """The lowest token generation this job accepts (``token_id``: the epoch at which the
        job was created or its tokens last revoked; 0 for a record saved before tokens had
        generations)."""
        return int(self.token_id) if self.token_id.isdigit() else 0


@dataclass(frozen=True)
class Move:
    """Copy ``table``'s ``block`` from ``source`` to each node of ``add``, then list ``target``."""

    job: str
    table: str
    block: int
    source: str
    add: tuple[str, ...]
    before: tuple[str, ...]
    target: tuple[str, ...]


@dataclass(frozen=True)
class ReplicationHealth:
    """How far the placement is from R replicas of every block (``ManagerState.replication_health``)."""

    target: int              # R, the replication factor
    servers: int             # servers that may hold blocks (live, not draining)
    under_replicated: int    # blocks with fewer than R replicas
    unrestorable: int        # of those, blocks that cannot get R back: fewer than R servers
    lost: int = 0            # blocks that lost every replica and are not recovered

    @property
    def target_reachable(self) -> bool:
        """Whether there are enough servers to hold R replicas of every block."""
        return self.servers >= self.target


@dataclass(frozen=True)
class ManagerSettings:
    replication: int = 1
    server_lease_seconds: float = 3.0
    server_heartbeat_seconds: float = 0.5
    worker_lease_seconds: float = 10.0
    worker_heartbeat_seconds: float = 1.0
    move_batch_blocks: int = 256


def dense_bytes(spec: TableSpec, config: TableConfig) -> int:
    """Bytes a dense table occupies once materialised (values and optimizer state); 0 for sparse."""
    if spec.kind.name != "DENSE":
        return 0
    return spec.numel * 4 * (1 + len(optimizers.state_names(config.optimizer)))


def describe_config(config: TableConfig, against: TableConfig | None = None) -> str:
    """The settings a user chose (not the manager's version), as ``key=value``s: those that
    differ from their defaults, and, compared ``against`` another config, every optimizer
    setting of the same name that differs from the other's (``lr=0.01`` against ``lr=0.5``,
    the default 0.01 included)."""
    o = config.optimizer
    other = against.optimizer if against is not None else None
    parts = [f"optimizer={o.kind.name.lower()}"] + [
        f"{f.name}={getattr(o, f.name)}" for f in dataclasses.fields(o)
        if f.name != "kind" and (getattr(o, f.name) != f.default
                                 or (other is not None and getattr(o, f.name) != getattr(other, f.name)))]
    if config.allow_non_finite:
        parts.append("allow_non_finite=True")
    if config.lifecycle.enabled:
        parts.append(f"lifecycle={config.lifecycle}")
    return " ".join(parts)


def describe_spec(spec: TableSpec) -> str:
    return (f"{spec.kind.name} shape={list(spec.shape)} init={spec.init.kind.name} "
            f"block_size={spec.block_size} num_blocks={spec.num_blocks}")
