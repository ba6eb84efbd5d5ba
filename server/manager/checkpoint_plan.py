"""What a checkpoint or a restore does, decided from the shard map: pure, no grpc, no I/O.

``PendingCheckpoint`` is one checkpoint's barrier (who arrived with what); ``plan_cut`` says
which servers hold the job's pushes and which blocks each primary snapshots; ``plan_load``
says which snapshots each replica loads on a restore; ``restore_tables`` reads a
checkpoint's job settings and tables. ``CheckpointCoordinator`` (``checkpoints.py``) carries
them out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from google.protobuf.json_format import ParseDict

from shardps.errors import InvalidArgument, ShardpsError
from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.rpc.convert import config_from_proto, consistency_from_proto, spec_from_proto
from shardps.tables import Consistency, TableConfig, TableSpec


@dataclass
class PendingCheckpoint:
    """A checkpoint of one job from its first arrival (or request) until it is written."""

    id: str
    directory: str
    arrived: dict = field(default_factory=dict)     # session -> (rank, step, state bytes)
    taking: bool = False
    done: bool = False
    path: str = ""
    error: ShardpsError | None = None
    step: int = 0

    def ready(self, live: dict[str, int]) -> bool:
        """Every live worker (session -> rank) arrived, and nobody is cutting it yet."""
        return set(live) <= set(self.arrived) and not self.taking

    def worker_states(self) -> dict[int, bytes]:
        return {rank: state for rank, step, state in self.arrived.values()}

    def last_step(self) -> int:
        """The checkpoint's step: the highest step a worker arrived with (0 without workers)."""
        return max((step for _, step, _ in self.arrived.values()), default=0)


def barrier_checkpoint_id(checkpoint_id: str, step: int) -> str:
    """The id of a checkpoint the workers start: theirs, or ``step-<step>``."""
    return checkpoint_id or f"step-{step}"


def on_demand_checkpoint_id(wall_seconds: float) -> str:
    """The id of a checkpoint an admin requests: ``manual-<milliseconds>``."""
    return f"manual-{int(wall_seconds * 1000)}"


def live_servers(msg: pb.ShardMap) -> list[pb.ServerInfo]:
    return [s for s in msg.servers if s.state != pb.DEAD]


@dataclass(frozen=True)
class CutPlan:
    """How to cut a checkpoint of ``job`` under the map ``epoch``."""

    job: str
    epoch: int
    tables: list                       # the job's TablePlacements
    consistency: pb.Consistency        # the job's group's (default without a group)
    hold: list                         # live servers: each holds the job's pushes meanwhile
    snapshots: dict                    # server index -> BlockRefs it is the primary of
    unplaced: str = ""                 # why the cut cannot be taken (a block has no replica)


def plan_cut(msg: pb.ShardMap, job: str) -> CutPlan:
    tables = [t for t in msg.tables if t.job == job]
    group = next((g for g in msg.groups if g.job == job), None)
    by_primary: dict[int, list] = {}
    unplaced = ""
    for t in tables:
        for b, bp in enumerate(t.blocks):
            if not bp.replicas:
                unplaced = f"block {b} of {t.spec.name!r} has no live replica: cannot checkpoint"
                break
            by_primary.setdefault(bp.replicas[0], []).append(ps.BlockRef(job=job, table=t.spec.name, block=b))
        if unplaced:
            break
    consistency = group.consistency if group is not None else pb.Consistency()
    return CutPlan(job, msg.epoch, tables, consistency, live_servers(msg), by_primary, unplaced)


def plan_load(msg: pb.ShardMap, job: str, blocks: dict[str, list]) -> dict[int, list]:
    """Server index -> the snapshots (``blocks``: table -> snapshots in block order; None
    for a block not to load) it loads: every replica ``msg`` lists for each block of ``job``
    (of the tables ``blocks`` has)."""
    per_server: dict[int, list] = {}
    for t in msg.tables:
        if t.job != job or t.spec.name not in blocks:
            continue
        snaps = blocks[t.spec.name]
        for b, bp in enumerate(t.blocks):
            if snaps[b] is None:
                continue
            for index in bp.replicas:
                per_server.setdefault(index, []).append(snaps[b])
    return per_server


def restore_tables(ck, job: str, path: str) -> tuple[Consistency, int, list[tuple[TableSpec, TableConfig]]]:
    """(consistency, staleness, tables) of checkpoint ``ck`` (read from ``path``), which must
    be of ``job`` (InvalidArgument otherwise)."""
    if ck.job != job:
        raise InvalidArgument(f"checkpoint {path} is of job {ck.job!r}, not {job!r}")
    mode, staleness = consistency_from_proto(ParseDict(ck.consistency, pb.Consistency()))
    tables = [(spec_from_proto(s), config_from_proto(c)) for s, c in ck.table_specs()]
    return mode, staleness, tables
