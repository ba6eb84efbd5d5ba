"""A read-only, indexed view of a published shard map (the ``shardps.v1.ShardMap`` message).

Clients route with it and servers check ownership with it; neither ever rebuilds the ring.
Immutable after construction, so it can be shared between threads and swapped atomically.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from shardps.errors import InvalidArgument, NotFound
from shardps.protos.v1 import common_pb2 as pb
from shardps.rpc.convert import config_from_proto, consistency_from_proto, spec_from_proto
from shardps.tables import Consistency, TableConfig, TableSpec

ShardMap = pb.ShardMap      # the map itself stays a message: servers and clients install it as sent
# how a job's lost blocks stand (``DataLoss.recovery`` of the map's groups)
LOSS_PENDING, LOSS_RESTORED, LOSS_RESET = pb.DataLoss.PENDING, pb.DataLoss.RESTORED, pb.DataLoss.RESET


@dataclass(frozen=True)
class TableView:
    """One table's spec, config and placement. ``replicas[b]`` are server names, primary first."""

    job: str
    spec: TableSpec
    config: TableConfig
    replicas: tuple[tuple[str, ...], ...]
    primary: np.ndarray        # int32 server index per block (-1: no replica)
    since_epoch: np.ndarray    # uint64 per block
    fresh_epoch: np.ndarray    # uint64 per block: epoch at which it was (re)created empty
    server_index: dict = field(default_factory=dict, compare=False)   # name -> index in the map's servers
    # blocks that lost every replica (BlockPlacement.lost_epoch), by block: their loss
    # (None when the job's group no longer lists it); empty for almost every table
    lost: dict[int, "LostBlock"] = field(default_factory=dict, compare=False)
    # int32 per block: how many replicas it has (more than 1: the primary forwards to backups)
    replica_counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32), compare=False)
    # the server index holding every block as primary (a table placed whole), else -1
    whole_on: int = field(default=-1, compare=False)
    name: str = field(init=False, compare=False)    # the spec's: read for every table of every request

    def __post_init__(self):
        object.__setattr__(self, "name", self.spec.name)


@dataclass(frozen=True)
class LostBlock:
    """How a block lost every replica, from the job's ``DataLoss`` record: ``pending`` while
    the manager restores it from a checkpoint (requests: Unavailable), else lost for good
    until restored or reset (requests: DataLost, naming ``server`` and ``detail``)."""

    epoch: int
    server: str = ""
    pending: bool = False
    detail: str = ""


@dataclass(frozen=True)
class Member:
    """A worker-group member as the shard map publishes it: a read-only view. On the wire it
    is the proto's ``WorkerMember``; the manager keeps it (with its lease and progress) as
    ``shardps.server.manager.records.MemberRecord``; a client's own view is
    ``shardps.worker.Membership``."""

    rank: int
    session: str
    incarnation: int
    name: str


@dataclass(frozen=True)
class GroupView:
    job: str
    consistency: Consistency
    staleness: int
    members: tuple[Member, ...]
    membership_version: int
    quota_bytes: int = 0
    clients: tuple[Member, ...] = ()          # sessions of clients outside the group
    data_loss: tuple[pb.DataLoss, ...] = ()
    peak_members: int = 0                     # the most live members at once

    @property
    def writers(self) -> set[tuple[str, int]]:
        """Every session whose pushes servers deduplicate: members' and clients'."""
        return {(m.session, m.incarnation) for m in self.members + self.clients}


class ShardMapView:
    """Index over a ShardMap message: tables by (job, name), servers by name, groups by job."""

    def __init__(self, msg: pb.ShardMap | None = None):
        self.msg = msg or pb.ShardMap()
        self.epoch = int(self.msg.epoch)
        self.replication = int(self.msg.replication) or 1
        self.servers = list(self.msg.servers)
        self.server_names = [s.name for s in self.servers]
        self.server_by_name = {s.name: s for s in self.servers}
        self.dead = {s.name for s in self.servers if s.state == pb.DEAD}   # servers declared dead
        self.server_index = index = {s.name: i for i, s in enumerate(self.servers)}   # name -> index
        self.tables: dict[tuple[str, str], TableView] = {}
        losses: dict[tuple[str, str, int], pb.DataLoss] = {}
        for g in self.msg.groups:
            for d in g.data_loss:
                for b in d.blocks:
                    losses[(g.job, d.table, b)] = d
        for t in self.msg.tables:
            n = len(t.blocks)
            primary = np.full(n, -1, dtype=np.int32)
            since = np.zeros(n, dtype=np.uint64)
            fresh = np.zeros(n, dtype=np.uint64)
            replicas = []
            lost: dict[int, LostBlock] = {}
            for b, bp in enumerate(t.blocks):
                if bp.lost_epoch:
                    d = losses.get((t.job, t.spec.name, b))
                    lost[b] = LostBlock(int(bp.lost_epoch)) if d is None else LostBlock(
                        int(bp.lost_epoch), d.server, d.recovery == pb.DataLoss.PENDING, d.detail)
                if any(i >= len(self.servers) for i in bp.replicas):
                    raise InvalidArgument(
                        f"shard map epoch {self.epoch}: block {b} of {t.spec.name!r} lists replica "
                        f"index {max(bp.replicas)} but the map has {len(self.servers)} servers")
                names = tuple(self.servers[i].name for i in bp.replicas)
                replicas.append(names)
                if names:
                    primary[b] = index[names[0]]
                since[b] = bp.since_epoch
                fresh[b] = bp.fresh_epoch
            self.tables[(t.job, t.spec.name)] = TableView(
                job=t.job, spec=spec_from_proto(t.spec), config=config_from_proto(t.config),
                replicas=tuple(replicas), primary=primary, since_epoch=since, fresh_epoch=fresh,
                server_index=index, lost=lost,
                replica_counts=np.fromiter((len(r) for r in replicas), np.int32, n),
                whole_on=int(primary[0]) if n and primary[0] >= 0 and (primary == primary[0]).all() else -1)
        self.groups: dict[str, GroupView] = {}
        for g in self.msg.groups:
            mode, staleness = consistency_from_proto(g.consistency)
            members = tuple(Member(m.rank, m.session, m.incarnation, m.name) for m in g.members)
            clients = tuple(Member(-1, m.session, m.incarnation, m.name) for m in g.clients)
            self.groups[g.job] = GroupView(g.job, mode, staleness, members, g.membership_version,
                                           int(g.quota_bytes), clients, tuple(g.data_loss),
                                           int(g.peak_members))

    def table(self, job: str, name: str) -> TableView:
        try:
            return self.tables[(job, name)]
        except KeyError:
            known = sorted(n for j, n in self.tables if j == job)
            raise NotFound(
                f"table {name!r} of job {job!r} not found (epoch {self.epoch}; the job has "
                f"{known or 'no tables'}): create it first") from None

    def jobs(self) -> set[str]:
        return {j for j, _ in self.tables} | set(self.groups)

    def address(self, server: str) -> str:
        return self.server_by_name[server].address
