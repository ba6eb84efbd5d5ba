"""The resource manager's state and its decisions, as a plain class (no grpc, no I/O but files).

``ManagerState`` holds servers (leases, incarnations), jobs and their worker groups, tables
and the placement of every block, and the shard-map epoch. Every method is a decision taken
from (state, arguments, ``now``): the clock is passed in, so tests drive it with a fake one.
Methods that change the published map bump the epoch once. The caller (``ManagerService``)
serialises calls with a lock, persists after each change, installs the new map on the
servers and only then shows it to clients.

Block moves are planned here (``plan_moves``), executed elsewhere (copies between servers),
and committed here (``commit_moves``) only if nothing changed under them.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import tempfile
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from shardps.convert import (config_from_proto, config_to_proto, consistency_to_proto,
                             spec_from_proto, spec_to_proto)
from shardps.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from shardps.protos.v1 import common_pb2 as pb
from shardps.server import optimizers
from shardps.server.placement import Ring, block_name, plan_placement
from shardps.tables import Consistency, TableConfig, TableSpec, validate_job_name

log = logging.getLogger("shardps.manager")


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
    replica_blocks: int = 0
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


@dataclass
class TableRecord:
    job: str
    spec: TableSpec
    config: TableConfig
    blocks: list[BlockRecord]


@dataclass
class MemberRecord:
    rank: int
    session: str
    incarnation: int
    name: str = ""
    # not persisted
    last_heartbeat: float = 0.0
    step: int = 0
    samples_per_second: float = 0.0
    loss: float = 0.0


@dataclass
class JobRecord:
    name: str
    consistency: Consistency = Consistency.ASYNC
    staleness: int = 0
    quota_bytes: int = 0
    token_id: str = ""
    members: dict[str, MemberRecord] = field(default_factory=dict)     # by session
    departed: dict[str, list[int]] = field(default_factory=dict)       # session -> [rank, incarnation]
    membership_version: int = 0
    restored_path: str = ""
    restored_step: int = 0
    restore_pending: list[int] = field(default_factory=list)   # ranks yet to fetch their state


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


class ManagerState:
    """Servers, jobs, tables, placement and epoch. Not thread-safe: the caller holds a lock."""

    def __init__(self, settings: ManagerSettings = ManagerSettings()):
        self.settings = settings
        self.epoch = 1
        self.servers: dict[str, ServerRecord] = {}
        self.jobs: dict[str, JobRecord] = {}
        self.tables: dict[tuple[str, str], TableRecord] = {}
        self._map_cache: pb.ShardMap | None = None

    # ------------------------------------------------------------------ epochs
    def _bump(self) -> int:
        self.epoch += 1
        self._map_cache = None
        return self.epoch

    # ------------------------------------------------------------------ servers
    def candidates(self) -> list[str]:
        """Nodes that may hold blocks: live and not draining."""
        return sorted(n for n, s in self.servers.items()
                      if s.state in (ServerState.JOINING, ServerState.SERVING))

    def register_server(self, name: str, address: str, metrics_address: str, boot_id: str,
                        now: float) -> ServerRecord:
        """Register (or re-register) a server node; see ResourceManager.RegisterServer."""
        if not name or not address:
            raise InvalidArgument(f"server name {name!r} and address {address!r} are both required")
        rec = self.servers.get(name)
        if rec is not None and rec.boot_id == boot_id and rec.live:
            rec.address, rec.metrics_address, rec.last_heartbeat = address, metrics_address, now
            return rec      # a retried registration of the same process
        if rec is None:
            rec = ServerRecord(name, address, metrics_address, incarnation=1, boot_id=boot_id,
                               last_heartbeat=now)
            self.servers[name] = rec
            log.info("server %s registered at %s (incarnation 1)", name, address)
        else:
            # A restart under the same name, or a fenced node coming back: it holds nothing
            # it may serve until blocks are copied to it again.
            if rec.live:
                self._remove_from_blocks(name, now)
            rec.incarnation += 1
            rec.address, rec.metrics_address, rec.boot_id = address, metrics_address, boot_id
            rec.state, rec.last_heartbeat, rec.installed_epoch = ServerState.JOINING, now, 0
            rec.retired = False
            log.warning("server %s re-registered (incarnation %d): its old blocks are fenced",
                        name, rec.incarnation)
        self._bump()
        return rec

    def server_heartbeat(self, name: str, incarnation: int, epoch: int, stats: dict, now: float) -> None:
        rec = self.servers.get(name)
        if rec is None:
            raise NotFound(f"server {name!r} is not registered: register first")
        if rec.retired and rec.incarnation == incarnation:
            return
        if rec.incarnation != incarnation or not rec.live:
            raise FailedPrecondition(
                f"server {name!r} incarnation {incarnation} is fenced (current "
                f"{rec.incarnation}, state {rec.state.name}): drop state and register again")
        rec.last_heartbeat = now
        rec.installed_epoch = epoch
        for k in ("primary_blocks", "replica_blocks", "bytes"):
            setattr(rec, k, int(stats.get(k, getattr(rec, k))))
        if rec.state is ServerState.JOINING and epoch > 0:
            rec.state = ServerState.SERVING     # it has installed a map: it serves
            self._bump()

    def drain_server(self, name: str) -> int:
        rec = self.servers.get(name)
        if rec is None or not rec.live:
            raise NotFound(f"server {name!r} is not a live server (known: {sorted(self.servers)})")
        if rec.state is not ServerState.DRAINING:
            if len(self.candidates()) <= 1:
                raise FailedPrecondition(f"cannot drain {name!r}: it is the only server left")
            rec.state = ServerState.DRAINING
            self._bump()
        return sum(1 for t in self.tables.values() for b in t.blocks if name in b.replicas)

    def expire(self, now: float) -> list[str]:
        """Declare dead every server and worker whose lease expired. Returns what changed."""
        changed = []
        for rec in self.servers.values():
            if rec.live and now - rec.last_heartbeat > self.settings.server_lease_seconds:
                log.warning("server %s lease expired (%.1fs since heartbeat): declared dead",
                            rec.name, now - rec.last_heartbeat)
                self._remove_from_blocks(rec.name, now)
                rec.state = ServerState.DEAD
                changed.append(f"server:{rec.name}")
        for job in self.jobs.values():
            for session, m in list(job.members.items()):
                if now - m.last_heartbeat > self.settings.worker_lease_seconds:
                    log.warning("worker rank %d of job %s lease expired: removed from group",
                                m.rank, job.name)
                    self._remove_member(job, session)
                    changed.append(f"worker:{job.name}/{m.rank}")
        if changed:
            self._bump()
        return changed

    def retire_drained(self) -> list[str]:
        """Draining servers that hold no block anymore are retired (state DEAD)."""
        retired = []
        for rec in self.servers.values():
            if rec.state is ServerState.DRAINING and not any(
                    rec.name in b.replicas for t in self.tables.values() for b in t.blocks):
                rec.state, rec.retired = ServerState.DEAD, True
                retired.append(rec.name)
        if retired:
            self._bump()
        return retired

    def _remove_from_blocks(self, name: str, now: float) -> None:
        """Take ``name`` out of every replica list (promoting the next replica). Blocks left
        with no replica at all are re-created empty on a live node: their data is lost."""
        epoch = self.epoch + 1       # the epoch the caller's bump will publish
        others = [n for n in self.candidates() if n != name]
        for t in self.tables.values():
            for i, b in enumerate(t.blocks):
                if name not in b.replicas:
                    continue
                b.replicas = [n for n in b.replicas if n != name]
                b.since_epoch = epoch
                if not b.replicas and others:
                    node = Ring(others).preference(block_name(t.job, t.spec.name, i), 1)[0]
                    b.replicas, b.fresh_epoch = [node], epoch
                    log.error("block %s/%s/%d lost its last replica with %s: re-created empty "
                              "on %s (restore a checkpoint to recover its values)",
                              t.job, t.spec.name, i, name, node)

    # ------------------------------------------------------------------ jobs
    def create_job(self, name: str, consistency: Consistency, staleness: int,
                   quota_bytes: int = 0) -> tuple[JobRecord, bool]:
        validate_job_name(name)
        if consistency is Consistency.BOUNDED and staleness < 0:
            raise InvalidArgument(f"staleness {staleness}: must be >= 0")
        job = self.jobs.get(name)
        if job is not None:
            if (job.consistency, job.staleness) != (consistency, staleness):
                raise AlreadyExists(
                    f"job {name!r} exists with consistency {job.consistency.name}"
                    f"(staleness {job.staleness}), not {consistency.name}(staleness {staleness})")
            return job, False
        job = JobRecord(name, consistency, staleness, quota_bytes, token_id=secrets.token_hex(8))
        self.jobs[name] = job
        self._bump()
        return job, True

    def job(self, name: str) -> JobRecord:
        job = self.jobs.get(name)
        if job is None:
            raise NotFound(f"job {name!r} not found: create it first (shardps job create, "
                           f"or PSClient.create_job)")
        return job

    def end_job(self, name: str) -> list[str]:
        """Delete the job, its tables and its group. Returns the deleted table names."""
        if name not in self.jobs:
            return []
        dropped = [t for (j, t) in self.tables if j == name]
        for t in dropped:
            del self.tables[(name, t)]
        del self.jobs[name]
        self._bump()
        return dropped

    # ------------------------------------------------------------------ tables
    def create_table(self, job: str, spec: TableSpec, config: TableConfig) -> tuple[TableRecord, bool]:
        self.job(job)
        spec.validate()
        config.validate()
        existing = self.tables.get((job, spec.name))
        if existing is not None:
            if existing.spec != spec:
                raise AlreadyExists(
                    f"table {spec.name!r} of job {job!r} exists with another spec "
                    f"({_describe(existing.spec)}; requested {_describe(spec)}): use another "
                    f"name or delete it first")
            return existing, False
        nodes = self.candidates()
        if not nodes:
            raise FailedPrecondition("no live server to place the table on: start a server first")
        quota = self.jobs[job].quota_bytes
        if quota:
            dense = sum(dense_bytes(t.spec, t.config) for (j, _), t in self.tables.items() if j == job)
            need = dense_bytes(spec, config)
            if dense + need > quota:
                raise ResourceExhausted(
                    f"job {job!r} storage quota_bytes={quota}: its dense tables hold {dense} bytes and "
                    f"{spec.name!r} needs {need} more (values and optimizer state): raise the quota "
                    f"or delete tables")
        self._warn_if_short(f"table {spec.name!r} of job {job!r}", nodes)
        epoch = self._bump()
        names = [block_name(job, spec.name, i) for i in range(spec.block_count)]
        placement = self._place_new(names, nodes)
        blocks = [BlockRecord(placement[n], epoch, epoch) for n in names]
        rec = TableRecord(job, spec, config.replace(version=1), blocks)
        self.tables[(job, spec.name)] = rec
        return rec, True

    def _warn_if_short(self, what: str, nodes: list[str]) -> None:
        """Fewer servers than R: the blocks get one replica per server now, and the missing
        ones are added (``plan_moves``) as servers join. Placement is not refused: a cluster
        that lost servers keeps serving, and servers that start after the first client are
        normal in a deployment."""
        r = self.settings.replication
        if len(nodes) < r:
            log.warning("%s placed with %d replica(s) per block, fewer than the replication "
                        "factor %d: %d server(s) can hold blocks; start more servers to restore it",
                        what, len(nodes), r, len(nodes))

    def _place_new(self, names: list[str], nodes: list[str]) -> dict[str, list[str]]:
        """Replicas for new blocks ``names``, planned together with every block already placed
        (which stay where they are here): the new blocks fill the least-loaded servers, so
        the rebalancer has no reason to move them right after they were created."""
        current = {block_name(t.job, t.spec.name, i): b.replicas
                   for t in self.tables.values() for i, b in enumerate(t.blocks) if b.replicas}
        target = plan_placement(list(current) + names, nodes, self.settings.replication,
                                previous=current)
        return {n: target[n] for n in names}

    def table(self, job: str, name: str) -> TableRecord:
        self.job(job)
        rec = self.tables.get((job, name))
        if rec is None:
            raise NotFound(f"table {name!r} of job {job!r} not found: create it first")
        return rec

    def update_table_config(self, job: str, name: str, config: TableConfig,
                            expected_version: int = 0) -> TableConfig:
        rec = self.table(job, name)
        config.validate()
        if expected_version and expected_version != rec.config.version:
            raise FailedPrecondition(
                f"table {name!r} config is at version {rec.config.version}, not "
                f"{expected_version}: re-read it and retry")
        old, new = rec.config.optimizer, config.optimizer
        if old.kind is not new.kind or optimizers.state_names(old) != optimizers.state_names(new):
            raise InvalidArgument(
                f"table {name!r}: the optimizer cannot change from {old.kind.name}"
                f"(momentum={old.momentum}) to {new.kind.name}(momentum={new.momentum}) "
                f"while it holds state; change hyperparameters only")
        rec.config = config.replace(version=rec.config.version + 1)
        self._bump()
        return rec.config

    def delete_table(self, job: str, name: str) -> bool:
        self.job(job)
        if self.tables.pop((job, name), None) is None:
            return False
        self._bump()
        return True

    def restore_job(self, job: str, consistency: Consistency, staleness: int,
                    tables: list[tuple[TableSpec, TableConfig]], path: str, step: int,
                    ranks: list[int] = ()) -> list[TableRecord]:
        """Replace the job's tables by fresh ones with the checkpoint's specs and configs,
        placed on the current servers (their values are loaded next). Workers that join
        afterwards learn that the job was restored."""
        nodes = self.candidates()
        if not nodes:
            raise FailedPrecondition("no live server to restore onto: start servers first")
        self._warn_if_short(f"restored job {job!r}", nodes)
        job_rec = self.jobs.get(job)
        if job_rec is None:
            job_rec, _ = self.create_job(job, consistency, staleness)
        for key in [k for k in self.tables if k[0] == job]:
            del self.tables[key]
        epoch = self._bump()
        out = []
        for spec, config in tables:
            spec.validate()
            names = [block_name(job, spec.name, i) for i in range(spec.block_count)]
            placement = self._place_new(names, nodes)
            rec = TableRecord(job, spec, config, [BlockRecord(placement[n], epoch, epoch) for n in names])
            self.tables[(job, spec.name)] = rec
            out.append(rec)
        job_rec.restored_path, job_rec.restored_step = str(path), step
        job_rec.restore_pending = sorted(ranks)
        return out

    def replace_lost(self) -> int:
        """Blocks left with no replica (every copy died) are re-created empty on live servers:
        their values are lost until a checkpoint is restored. Returns how many."""
        nodes = self.candidates()
        lost = [(t, i) for t in self.tables.values() for i, b in enumerate(t.blocks) if not b.replicas]
        if not lost or not nodes:
            return 0
        epoch = self._bump()
        names = [block_name(t.job, t.spec.name, i) for t, i in lost]
        placement = plan_placement(names, nodes, self.settings.replication)
        for (t, i), name in zip(lost, names):
            b = t.blocks[i]
            b.replicas, b.since_epoch, b.fresh_epoch = placement[name], epoch, epoch
        log.error("%d blocks had lost every replica: re-created empty on %s (restore a "
                  "checkpoint to recover their values)", len(lost), nodes)
        return len(lost)

    # ------------------------------------------------------------------ moves
    def plan_moves(self, limit: int | None = None) -> list[Move]:
        """Blocks whose replica set should change (restore R, rebalance, drain), at most
        ``limit`` of them. Each move copies from the current primary to the new nodes."""
        nodes = self.candidates()
        if not nodes:
            return []
        current: dict[str, list[str]] = {}
        refs: dict[str, tuple[TableRecord, int]] = {}
        for t in self.tables.values():
            for i, b in enumerate(t.blocks):
                key = block_name(t.job, t.spec.name, i)
                current[key] = b.replicas
                refs[key] = (t, i)
        target = plan_placement(list(current), nodes, self.settings.replication, previous=current)
        moves = []
        for key in sorted(current):
            before, after = current[key], target[key]
            if before == after or not before:
                continue
            t, i = refs[key]
            add = tuple(n for n in after if n not in before)
            moves.append(Move(t.job, t.spec.name, i, before[0], add, tuple(before), tuple(after)))
            if limit and len(moves) >= limit:
                break
        return moves

    def commit_moves(self, moves: list[Move], now: float) -> int:
        """Apply the moves whose copies completed, if their block did not change meanwhile."""
        epoch = self.epoch + 1
        done = 0
        for m in moves:
            t = self.tables.get((m.job, m.table))
            if t is None or m.block >= len(t.blocks):
                continue
            b = t.blocks[m.block]
            if tuple(b.replicas) != m.before:
                continue
            if any(not self.servers.get(n) or self.servers[n].state not in
                   (ServerState.JOINING, ServerState.SERVING) for n in m.add):
                continue
            b.replicas = list(m.target)
            b.since_epoch = epoch
            done += 1
        if done:
            self._bump()
        return done

    # ------------------------------------------------------------------ worker groups
    def join(self, job_name: str, name: str, rank_hint: int, previous_session: str,
             consistency: Consistency | None, staleness: int, now: float) -> MemberRecord:
        job = self.job(job_name)
        if consistency is not None and (consistency, staleness if consistency is Consistency.BOUNDED
                                        else job.staleness) != (job.consistency, job.staleness):
            raise FailedPrecondition(
                f"job {job_name!r} runs {job.consistency.name}(staleness {job.staleness}); "
                f"this worker asked for {consistency.name}(staleness {staleness})")
        taken = {m.rank: m for m in job.members.values()}
        replaced = None
        if previous_session and previous_session in job.members:
            replaced = job.members[previous_session]
        elif name:
            replaced = next((m for m in job.members.values() if m.name == name), None)
        if replaced is not None:
            session, rank, incarnation = replaced.session, replaced.rank, replaced.incarnation + 1
            del job.members[replaced.session]
        elif previous_session and previous_session in job.departed:
            rank, last_incarnation = job.departed.pop(previous_session)
            session, incarnation = previous_session, last_incarnation + 1
            if rank in taken:
                rank = _lowest_free(taken)
        else:
            session, incarnation = secrets.token_hex(8), 1
            rank = rank_hint if rank_hint >= 0 and rank_hint not in taken else _lowest_free(taken)
        member = MemberRecord(rank, session, incarnation, name, last_heartbeat=now)
        job.members[session] = member
        job.membership_version += 1
        self._bump()
        log.info("worker %s joined job %s as rank %d (incarnation %d)", name or session, job_name,
                 rank, incarnation)
        return member

    def leave(self, job_name: str, session: str) -> int:
        job = self.job(job_name)
        if session in job.members:
            self._remove_member(job, session)
            self._bump()
        return job.membership_version

    def _remove_member(self, job: JobRecord, session: str) -> None:
        m = job.members.pop(session)
        job.departed[session] = [m.rank, m.incarnation]
        job.membership_version += 1

    def worker_heartbeat(self, job_name: str, session: str, incarnation: int, step: int,
                         samples_per_second: float, loss: float, now: float) -> tuple[JobRecord, MemberRecord]:
        job = self.job(job_name)
        m = job.members.get(session)
        if m is None or m.incarnation != incarnation:
            raise NotFound(
                f"session {session!r} (incarnation {incarnation}) is not a member of job "
                f"{job_name!r}: its lease expired or a newer incarnation joined; join again")
        m.last_heartbeat, m.step, m.samples_per_second, m.loss = now, step, samples_per_second, loss
        return job, m

    # ------------------------------------------------------------------ the published map
    def shard_map(self) -> pb.ShardMap:
        """The current map as the ShardMap message (cached until the next change)."""
        if self._map_cache is not None:
            return self._map_cache
        names = sorted(self.servers)
        index = {n: i for i, n in enumerate(names)}
        msg = pb.ShardMap(epoch=self.epoch, replication=self.settings.replication)
        for n in names:
            s = self.servers[n]
            msg.servers.add(name=s.name, address=s.address, incarnation=s.incarnation,
                            state=s.state.value, metrics_address=s.metrics_address)
        for (job, _), t in sorted(self.tables.items()):
            tp = msg.tables.add(job=job, spec=spec_to_proto(t.spec), config=config_to_proto(t.config))
            for b in t.blocks:
                tp.blocks.add(replicas=[index[r] for r in b.replicas],
                              since_epoch=b.since_epoch, fresh_epoch=b.fresh_epoch)
        for name, job in sorted(self.jobs.items()):
            g = msg.groups.add(job=name, consistency=consistency_to_proto(job.consistency, job.staleness),
                               membership_version=job.membership_version, quota_bytes=job.quota_bytes)
            for m in sorted(job.members.values(), key=lambda m: m.rank):
                g.members.add(rank=m.rank, session=m.session, incarnation=m.incarnation, name=m.name)
        self._map_cache = msg
        return msg

    def under_replicated(self) -> int:
        """Blocks with fewer than R replicas, however many servers are left (with 1 of 3
        servers and R=2, every block has one copy and counts)."""
        return self.replication_health().under_replicated

    def replication_health(self) -> ReplicationHealth:
        """Under-replicated blocks, and how many of them cannot get R replicas back until
        servers are added (fewer than R servers may hold blocks)."""
        r = self.settings.replication
        servers = len(self.candidates())
        under = sum(1 for t in self.tables.values() for b in t.blocks if len(b.replicas) < r)
        return ReplicationHealth(r, servers, under, under if servers < r else 0)

    # ------------------------------------------------------------------ persistence
    def to_dict(self) -> dict:
        return {
            "format": 1,
            "epoch": self.epoch,
            "servers": [{"name": s.name, "address": s.address, "metrics_address": s.metrics_address,
                         "incarnation": s.incarnation, "boot_id": s.boot_id, "state": s.state.name,
                         "retired": s.retired}
                        for s in self.servers.values()],
            "jobs": [{"name": j.name, "consistency": j.consistency.name, "staleness": j.staleness,
                      "quota_bytes": j.quota_bytes, "token_id": j.token_id,
                      "membership_version": j.membership_version,
                      "restored_path": j.restored_path, "restored_step": j.restored_step,
                      "restore_pending": j.restore_pending,
                      "departed": j.departed,
                      "members": [{"rank": m.rank, "session": m.session,
                                   "incarnation": m.incarnation, "name": m.name}
                                  for m in j.members.values()]}
                     for j in self.jobs.values()],
            "tables": [{"job": t.job,
                        "spec": _b64(spec_to_proto(t.spec)),
                        "config": _b64(config_to_proto(t.config)),
                        "blocks": [[b.replicas, b.since_epoch, b.fresh_epoch] for b in t.blocks]}
                       for t in self.tables.values()],
        }

    @classmethod
    def from_dict(cls, data: dict, settings: ManagerSettings, now: float) -> "ManagerState":
        """Rebuild persisted state. Leases restart at ``now``: every server and worker gets a
        full lease to reach the restarted manager before it is declared dead."""
        state = cls(settings)
        state.epoch = int(data["epoch"])
        for s in data["servers"]:
            state.servers[s["name"]] = ServerRecord(
                s["name"], s["address"], s["metrics_address"], int(s["incarnation"]), s["boot_id"],
                ServerState[s["state"]], retired=bool(s.get("retired")), last_heartbeat=now)
        for j in data["jobs"]:
            job = JobRecord(j["name"], Consistency[j["consistency"]], int(j["staleness"]),
                            int(j["quota_bytes"]), j["token_id"],
                            membership_version=int(j["membership_version"]),
                            restored_path=j.get("restored_path", ""),
                            restored_step=int(j.get("restored_step", 0)),
                            restore_pending=list(j.get("restore_pending", [])),
                            departed={k: list(v) for k, v in j.get("departed", {}).items()})
            for m in j["members"]:
                job.members[m["session"]] = MemberRecord(m["rank"], m["session"], m["incarnation"],
                                                         m["name"], last_heartbeat=now)
            state.jobs[job.name] = job
        for t in data["tables"]:
            spec = spec_from_proto(_unb64(pb.TableSpec, t["spec"]))
            config = config_from_proto(_unb64(pb.TableConfig, t["config"]))
            blocks = [BlockRecord(list(r), int(s), int(f)) for r, s, f in t["blocks"]]
            state.tables[(t["job"], spec.name)] = TableRecord(t["job"], spec, config, blocks)
        return state

    def save(self, path: Path) -> None:
        """Write the state atomically (temporary file, fsync, rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".state-")
        with os.fdopen(fd, "w") as f:
            json.dump(self.to_dict(), f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path, settings: ManagerSettings, now: float) -> "ManagerState":
        with open(path) as f:
            return cls.from_dict(json.load(f), settings, now)


def dense_bytes(spec: TableSpec, config: TableConfig) -> int:
    """Bytes a dense table occupies once materialised (values and optimizer state); 0 for sparse."""
    if spec.kind.name != "DENSE":
        return 0
    return spec.numel * 4 * (1 + len(optimizers.state_names(config.optimizer)))


def _lowest_free(taken) -> int:
    rank = 0
    while rank in taken:
        rank += 1
    return rank


def _describe(spec: TableSpec) -> str:
    return (f"{spec.kind.name} shape={list(spec.shape)} init={spec.init.kind.name} "
            f"block_size={spec.block_size} num_blocks={spec.num_blocks}")


def _b64(msg) -> str:
    import base64
    return base64.b64encode(msg.SerializeToString()).decode()


def _unb64(cls, text: str):
    import base64
    return cls.FromString(base64.b64decode(text))
