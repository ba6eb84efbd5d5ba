"""The resource manager's state and its decisions, as a plain class: no grpc, no I/O.

``ManagerState`` holds servers (leases, incarnations), jobs and their worker groups, tables
and the placement of every block, and the shard-map epoch. Every method is a decision taken
from (state, arguments, ``now``): the clock is passed in, so tests drive it with a fake one.
Methods that change the published map bump the epoch once. The caller (``ManagerRuntime``,
``runtime.py``) serialises calls with a lock, persists after each change (``store.py``),
installs the new map on the servers and only then shows it to clients.

The decisions live beside this class, as functions of the state: ``servers.py`` (server
membership and leases), ``groups.py`` (worker groups), ``moves.py`` (placement of blocks and
block moves), ``losses.py`` (blocks that lost every replica), ``table_ops.py`` (creating
tables). The methods below delegate to them, so callers use one object.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Sequence

from shardps.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from shardps.protos.v1 import common_pb2 as pb
from shardps.rpc.convert import config_to_proto, consistency_to_proto, spec_to_proto
from shardps.server.manager import groups, losses, moves, servers, table_ops
from shardps.server.manager.records import (
    BlockRecord,
    JobRecord,
    ManagerSettings,
    MemberRecord,
    Move,
    ReplicationHealth,
    ServerRecord,
    ServerState,
    TableRecord,
)
from shardps.server.placement import block_name
from shardps.tables import Consistency, TableConfig, TableSpec, validate_job_name

log = logging.getLogger("shardps.manager")
RECOVERY = {"lost": pb.DataLoss.LOST, "restored": pb.DataLoss.RESTORED, "reset": pb.DataLoss.RESET,
            "pending": pb.DataLoss.PENDING}


class ManagerState:
    """Servers, jobs, tables, placement and epoch. Not thread-safe: the caller holds a lock."""

    def __init__(self, settings: ManagerSettings = ManagerSettings()):
        self.settings = settings
        self.epoch = 1
        self.servers: dict[str, ServerRecord] = {}
        self.jobs: dict[str, JobRecord] = {}
        self.tables: dict[tuple[str, str], TableRecord] = {}
        # A persisted field changed without a new epoch (nothing to publish, something to
        # save); the runtime saves and clears it.
        self.unsaved = False
        self._map_cache: pb.ShardMap | None = None
        # Which blocks each server holds, for a server's death (moves.HolderIndex; not
        # persisted, built on first use)
        self.holders: moves.HolderIndex | None = None
        # blocks lost and recovered since start, by (what, job): what is "lost", "restored"
        # or "reset" (the metrics' counters; not persisted)
        self.loss_counts: Counter[tuple[str, str]] = Counter()

    # ------------------------------------------------------------------ epochs
    def bump(self) -> int:
        """Start the next epoch (the map changed); returns it."""
        self.epoch += 1
        self._map_cache = None
        return self.epoch

    # ------------------------------------------------------------------ servers (servers.py)
    def candidates(self) -> list[str]:
        """Nodes that may hold blocks: live and not draining."""
        return sorted(n for n, s in self.servers.items()
                      if s.state in (ServerState.JOINING, ServerState.SERVING))

    def register_server(self, name: str, address: str, metrics_address: str, boot_id: str,
                        now: float) -> ServerRecord:
        return servers.register_server(self, name, address, metrics_address, boot_id, now)

    def server_heartbeat(self, name: str, incarnation: int, epoch: int, stats: dict, now: float) -> None:
        servers.server_heartbeat(self, name, incarnation, epoch, stats, now)

    def drain_server(self, name: str) -> int:
        return servers.drain_server(self, name)

    def retire_drained(self) -> list[str]:
        return servers.retire_drained(self)

    def expire(self, now: float) -> list[str]:
        """Declare dead every server and worker whose lease expired. Returns what changed."""
        changed = servers.expire_servers(self, now) + groups.expire_workers(self, now)
        if changed:
            self.bump()
        return changed

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
                    f"job {name!r} exists with consistency {job.consistency}"
                    f" (staleness {job.staleness}), not {consistency} (staleness {staleness})")
            return job, False
        # the token generation: above every generation issued before, also to an ended job
        # of the same name (generations are epochs, and epochs only rise)
        job = JobRecord(name, consistency, staleness, quota_bytes, token_id=str(self.bump()))
        self.jobs[name] = job
        return job, True

    def revoke_job_tokens(self, name: str) -> int:
        """Refuse every token issued so far for job ``name``: its token generation becomes
        the next epoch. Returns the new generation."""
        job = self.job(name)
        job.token_id = str(self.bump())
        return job.token_generation

    def token_floors(self) -> dict[str, int]:
        """Per job, the lowest token generation accepted (sent to servers with heartbeats)."""
        return {name: job.token_generation for name, job in self.jobs.items()}

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
        self.bump()
        return dropped

    def claim_restored_state(self, job: str, rank: int) -> tuple[str, int]:
        """The checkpoint ``job`` was restored from and its step (("", 0) if none); ``rank``
        has now fetched its worker state and is no longer pending (saved, not published)."""
        rec = self.job(job)
        if rank in rec.restore_pending:
            rec.restore_pending.remove(rank)
            self.unsaved = True
        return rec.restored_path, rec.restored_step

    # ------------------------------------------------------------------ tables
    def create_table(self, job: str, spec: TableSpec, config: TableConfig) -> tuple[TableRecord, bool]:
        return self.create_tables(job, [(spec, config)])[0]

    def create_tables(self, job: str, tables: Sequence[tuple[TableSpec, TableConfig]]
                      ) -> list[tuple[TableRecord, bool]]:
        return table_ops.create_tables(self, job, tables)

    def table(self, job: str, name: str) -> TableRecord:
        self.job(job)
        rec = self.tables.get((job, name))
        if rec is None:
            raise NotFound(f"table {name!r} of job {job!r} not found: create it first")
        return rec

    def update_table_config(self, job: str, name: str, config: TableConfig,
                            expected_version: int = 0) -> TableConfig:
        return self.update_table_configs(job, [(name, config, expected_version)])[0]

    def update_table_configs(self, job: str, changes: Sequence[tuple[str, TableConfig, int]]) -> list[TableConfig]:
        return table_ops.update_table_configs(self, job, changes)

    def delete_table(self, job: str, name: str) -> bool:
        rec = self.job(job)
        if self.tables.pop((job, name), None) is None:
            return False
        rec.data_loss = [d for d in rec.data_loss if d.table != name]
        self.bump()
        return True

    # ------------------------------------------------------------------ lost blocks
    def lost_blocks(self, job: str | None = None) -> dict[tuple[str, str], list[int]]:
        return losses.lost_blocks(self, job)

    def recover_lost(self, job: str, table: str, blocks: Sequence[int], how: str,
                     checkpoint: str = "", checkpoint_step: int = 0) -> int:
        return losses.recover_lost(self, job, table, blocks, how, checkpoint, checkpoint_step)

    def give_up_recovery(self, job: str, detail: str) -> None:
        losses.give_up_recovery(self, job, detail)

    def restore_job(self, job: str, consistency: Consistency, staleness: int,
                    tables: list[tuple[TableSpec, TableConfig]], path: str, step: int,
                    ranks: Sequence[int] = ()) -> list[TableRecord]:
        """Replace the job's tables by fresh ones with the checkpoint's specs and configs,
        placed on the current servers (their values are loaded next). Workers that join
        afterwards learn that the job was restored."""
        nodes = self.candidates()
        if not nodes:
            raise FailedPrecondition("no live server to restore onto: start servers first")
        moves.warn_if_short(self, f"restored job {job!r}", nodes)
        job_rec = self.jobs.get(job)
        if job_rec is None:
            job_rec, _ = self.create_job(job, consistency, staleness)
        for key in [k for k in self.tables if k[0] == job]:
            del self.tables[key]
        epoch = self.bump()
        out = []
        for spec, config in tables:
            spec.validate()
            names = [block_name(job, spec.name, i) for i in range(spec.block_count)]
            placement = moves.place_new(self, names, nodes)
            rec = TableRecord(job, spec, config, [BlockRecord(placement[n], epoch, epoch) for n in names])
            self.tables[(job, spec.name)] = rec
            out.append(rec)
        job_rec.restored_path, job_rec.restored_step = str(path), step
        job_rec.restore_pending = sorted(ranks)
        for d in job_rec.data_loss:
            if d.recovery in ("lost", "pending"):
                d.recovery, d.checkpoint, d.checkpoint_step, d.detail = "restored", str(path), step, ""
        return out

    # ------------------------------------------------------------------ blocks (moves.py)
    def replace_lost(self) -> int:
        return moves.replace_lost(self)

    def plan_moves(self, limit: int | None = None) -> list[Move]:
        return moves.plan_moves(self, limit)

    def commit_moves(self, planned: list[Move], now: float,
                     copied_to: dict[str, int] | None = None) -> int:
        return moves.commit_moves(self, planned, now, copied_to)

    # ------------------------------------------------------------------ worker groups (groups.py)
    def join(self, job_name: str, name: str, rank_hint: int, previous_session: str,
             consistency: Consistency | None, staleness: int, now: float) -> MemberRecord:
        return groups.join(self, job_name, name, rank_hint, previous_session, consistency,
                           staleness, now)

    def open_client(self, job_name: str, name: str, now: float) -> MemberRecord:
        return groups.open_client(self, job_name, name, now)

    def leave(self, job_name: str, session: str, step: int = 0) -> int:
        return groups.leave(self, job_name, session, step)

    def worker_heartbeat(self, job_name: str, session: str, incarnation: int, step: int,
                         samples_per_second: float, loss: float, now: float) -> tuple[JobRecord, MemberRecord]:
        return groups.worker_heartbeat(self, job_name, session, incarnation, step,
                                       samples_per_second, loss, now)

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
                              since_epoch=b.since_epoch, fresh_epoch=b.fresh_epoch, lost_epoch=b.lost_epoch)
        for name, rec in sorted(self.jobs.items()):
            g = msg.groups.add(job=name, consistency=consistency_to_proto(rec.consistency, rec.staleness),
                               membership_version=rec.membership_version, quota_bytes=rec.quota_bytes,
                               peak_members=rec.peak_members)
            for m in sorted(rec.members.values(), key=lambda m: m.rank):
                g.members.add(rank=m.rank, session=m.session, incarnation=m.incarnation, name=m.name)
            for m in sorted(rec.clients.values(), key=lambda m: m.session):
                g.clients.add(session=m.session, incarnation=m.incarnation, name=m.name)
            for d in rec.data_loss:
                g.data_loss.add(epoch=d.epoch, server=d.server, table=d.table, blocks=d.blocks,
                                lost_at_step=d.lost_at_step, recovery=RECOVERY[d.recovery],
                                checkpoint=d.checkpoint, checkpoint_step=d.checkpoint_step,
                                detail=d.detail)
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
        nodes = len(self.candidates())
        under = sum(1 for t in self.tables.values() for b in t.blocks if len(b.replicas) < r)
        lost = sum(1 for t in self.tables.values() for b in t.blocks if b.lost_epoch)
        return ReplicationHealth(r, nodes, under, under if nodes < r else 0, lost)
