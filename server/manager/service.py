"""``ResourceManagerService``: the resource manager's gRPC methods, a thin layer over
``ManagerRuntime``. Each method checks the request's names, runs one decision of
``ManagerState`` through ``ManagerRuntime.change`` (or reads the published map) and encodes
the answer; errors map to status codes in ``shardps.rpc.status``."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import grpc

from shardps import authz, mapdelta, names
from shardps.errors import NotFound, PermissionDenied
from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import manager_pb2 as mg
from shardps.rpc.convert import config_from_proto, config_to_proto, consistency_from_proto, spec_from_proto
from shardps.rpc.status import Method, bind, proto_method
from shardps.server import tokens
from shardps.server.manager.checkpoint_files import read_checkpoint
from shardps.server.manager.checkpoints import CheckpointCoordinator
from shardps.server.manager.ending import JobEnding
from shardps.server.manager.runtime import ManagerRuntime

log = logging.getLogger("shardps.manager")
SERVICE = "shardps.v1.ResourceManager"


class ResourceManagerService:
    """gRPC methods of the resource manager over a ManagerRuntime."""

    def __init__(self, runtime: ManagerRuntime, checkpoints: CheckpointCoordinator | None = None,
                 token_key=b"", token_ttl_seconds: float = tokens.DEFAULT_TTL_SECONDS,
                 revocations: tokens.Revocations | None = None):
        """``token_key``: one key (bytes), a ``tokens.KeyRing`` or a ``tokens.KeyFile``; none:
        no job tokens. ``revocations``: the floors the manager's own authenticator checks;
        raised here whenever a job's token generation changes, so the manager refuses
        revoked tokens at once."""
        self.rt = runtime
        self.checkpoints = checkpoints or CheckpointCoordinator(runtime)
        self.keys = tokens.keys_from(token_key)
        self.token_ttl_seconds = tokens.check_ttl(token_ttl_seconds)
        self.revocations = revocations
        self.ending: JobEnding | None = None      # --exit-when-job-ends: the cluster's one job
        self._sync_floors()

    def methods(self) -> dict[str, Method]:
        u = "unary_unary"
        scoped = _job_scoped
        return {
            "RegisterServer": proto_method(u, self.register_server, mg.RegisterServerRequest),
            "ServerHeartbeat": proto_method(u, self.server_heartbeat, mg.ServerHeartbeatRequest),
            "DrainServer": proto_method(u, self.drain_server, mg.DrainServerRequest),
            "CreateJob": proto_method(u, self.create_job, mg.CreateJobRequest),
            "EndJob": proto_method(u, self.end_job, mg.EndJobRequest),
            "RevokeJobTokens": proto_method(u, self.revoke_job_tokens, mg.RevokeJobTokensRequest),
            "CreateTable": proto_method(u, scoped(self.create_table), mg.CreateTableRequest),
            "CreateTables": proto_method(u, scoped(self.create_tables), mg.CreateTablesRequest),
            "DescribeTable": proto_method(u, scoped(self.describe_table), mg.DescribeTableRequest),
            "ListTables": proto_method(u, scoped(self.list_tables), mg.ListTablesRequest),
            "UpdateTableConfig": proto_method(u, scoped(self.update_table_config), mg.UpdateTableConfigRequest),
            "UpdateTableConfigs": proto_method(u, scoped(self.update_table_configs), mg.UpdateTableConfigsRequest),
            "DeleteTable": proto_method(u, scoped(self.delete_table), mg.DeleteTableRequest),
            "GetShardMap": proto_method(u, self.get_shard_map, mg.GetShardMapRequest),
            "WatchShardMap": proto_method("unary_stream", self.watch_shard_map, mg.WatchShardMapRequest,
                                          idle_ok=True),
            "JoinWorkerGroup": proto_method(u, scoped(self.join_worker_group), mg.JoinWorkerGroupRequest),
            "LeaveWorkerGroup": proto_method(u, scoped(self.leave_worker_group), mg.LeaveWorkerGroupRequest),
            "WorkerHeartbeat": proto_method(u, scoped(self.worker_heartbeat), mg.WorkerHeartbeatRequest),
            "GetClusterStatus": proto_method(u, self.get_cluster_status, mg.GetClusterStatusRequest),
            "Checkpoint": proto_method(u, self.checkpoint, mg.CheckpointRequest),
            "CheckpointBarrier": proto_method(u, scoped(self.checkpoint_barrier), mg.CheckpointBarrierRequest),
            "Restore": proto_method(u, self.restore, mg.RestoreRequest),
            "GetWorkerState": proto_method(u, scoped(self.get_worker_state), mg.GetWorkerStateRequest),
            "ResetLostBlocks": proto_method(u, scoped(self.reset_lost_blocks), mg.ResetLostBlocksRequest),
        }

    def handler(self, metrics=None, authenticate=None) -> grpc.GenericRpcHandler:
        return bind(SERVICE, authz.enforce(SERVICE, self.methods()), metrics, authenticate)

    # --- servers ---
    def register_server(self, req, call) -> mg.RegisterServerResponse:
        names.check(names.SERVER, req.name, "name")
        now = self.rt.now()
        rec = self.rt.change(lambda s: s.register_server(req.name, req.address, req.metrics_address,
                                                         req.boot_id, now))
        if req.accepts_map_changes:
            self.rt.maps.accepts.add(req.name)
        else:
            self.rt.maps.accepts.discard(req.name)
        s = self.rt.settings
        return mg.RegisterServerResponse(incarnation=rec.incarnation, lease_seconds=s.server_lease_seconds,
                                         heartbeat_seconds=s.server_heartbeat_seconds,
                                         map=self.rt.published)

    def server_heartbeat(self, req, call) -> mg.ServerHeartbeatResponse:
        names.check(names.SERVER, req.name, "name")
        stats = {"primary_blocks": req.primary_blocks, "backup_blocks": req.replica_blocks,
                 "bytes": req.bytes}
        now = self.rt.now()
        # no read-your-writes wait: a heartbeat held while another change's map is installed
        # (3 s on a server that died unnoticed) would delay the next one past the lease
        self.rt.change(lambda s: s.server_heartbeat(req.name, req.incarnation, req.epoch, stats, now),
                       wait_published=False)
        with self.rt.lock:
            retired = self.rt.state.servers[req.name].retired
            floors = self.rt.state.token_floors()
        if self.ending is not None and self.ending.tell(req.name):   # the cluster's job ended
            retired = True
        return mg.ServerHeartbeatResponse(epoch=self.rt.published.epoch, retired=retired,
                                          token_floors=floors)

    def drain_server(self, req, call) -> mg.DrainServerResponse:
        names.check(names.SERVER, req.name, "name")
        n = self.rt.change(lambda s: s.drain_server(req.name))
        return mg.DrainServerResponse(epoch=self.rt.published.epoch, blocks_to_move=n)

    # --- jobs and tables ---
    def create_job(self, req, call) -> mg.CreateJobResponse:
        names.check(names.JOB, req.job, "job")
        mode, staleness = consistency_from_proto(req.consistency)
        ttl = tokens.check_ttl(req.token_ttl_seconds, self.token_ttl_seconds)
        job, created = self.rt.change(lambda s: s.create_job(req.job, mode, staleness,
                                                             req.quota.max_bytes))
        self._sync_floors()
        token, expires = self.issue_token(job.name, ttl)
        return mg.CreateJobResponse(created=created, token=token, token_expires_at=expires, step=job.step)

    def revoke_job_tokens(self, req, call) -> mg.RevokeJobTokensResponse:
        names.check(names.JOB, req.job, "job")
        ttl = tokens.check_ttl(req.token_ttl_seconds, self.token_ttl_seconds)
        generation = self.rt.change(lambda s: s.revoke_job_tokens(req.job))
        self._sync_floors()
        log.info("job %s: tokens below generation %d revoked", req.job, generation)
        token, expires = self.issue_token(req.job, ttl)
        return mg.RevokeJobTokensResponse(generation=generation, token=token, token_expires_at=expires)

    def issue_token(self, job: str, ttl_seconds: float | None = None) -> tuple[str, float]:
        """A token of ``job``'s current generation and its expiry (Unix seconds), or ("", 0)
        when tokens are off."""
        if self.keys is None:
            return "", 0.0
        with self.rt.lock:
            generation = self.rt.state.job(job).token_generation
        return tokens.issue(self.keys, job, generation, ttl_seconds or self.token_ttl_seconds)

    def _sync_floors(self) -> None:
        """Raise the manager's own revocation floors to the state's."""
        if self.revocations is not None:
            with self.rt.lock:
                floors = self.rt.state.token_floors()
            self.revocations.raise_floors(floors)

    def end_job(self, req, call) -> mg.EndJobResponse:
        names.check(names.JOB, req.job, "job")
        if self.ending is not None:
            self.ending.end_asked(req.job)
        dropped = self.rt.change(lambda s: s.end_job(req.job))
        if dropped:
            log.info("job %s ended: %d tables deleted", req.job, len(dropped))
        return mg.EndJobResponse(epoch=self.rt.published.epoch)

    def create_table(self, req, call) -> mg.CreateTableResponse:
        names.check(names.TABLE, req.spec.name, "spec.name")
        spec = spec_from_proto(req.spec)
        config = config_from_proto(req.config)
        rec, created = self.rt.change(lambda s: s.create_table(req.job, spec, config))
        return mg.CreateTableResponse(table=self._placement(req.job, spec.name), created=created,
                                      epoch=self.rt.published.epoch)

    def create_tables(self, req, call) -> mg.CreateTablesResponse:
        items = []
        for i, t in enumerate(req.tables):
            names.check(names.TABLE, t.spec.name, f"tables[{i}].spec.name")
            items.append((spec_from_proto(t.spec), config_from_proto(t.config)))
        got = self.rt.change(lambda s: s.create_tables(req.job, items))
        placed = {t.spec.name: t for t in self.rt.published.tables if t.job == req.job}
        missing = [spec.name for spec, _ in items if spec.name not in placed]
        if missing:
            raise NotFound(f"table {missing[0]!r} of job {req.job!r} is not published yet: retry")
        return mg.CreateTablesResponse(tables=[placed[spec.name] for spec, _ in items],
                                       created=[created for _, created in got], epoch=self.rt.published.epoch)

    def _placement(self, job: str, name: str) -> pb.TablePlacement:
        with self.rt.lock:
            self.rt.state.table(job, name)
        for t in self.rt.published.tables:
            if t.job == job and t.spec.name == name:
                return t
        raise NotFound(f"table {name!r} of job {job!r} is not published yet: retry")

    def describe_table(self, req, call) -> pb.TablePlacement:
        return self._placement(req.job, req.table)

    def list_tables(self, req, call) -> mg.ListTablesResponse:
        with self.rt.lock:
            self.rt.state.job(req.job)
        return mg.ListTablesResponse(tables=[t for t in self.rt.published.tables if t.job == req.job])

    def update_table_config(self, req, call) -> pb.TableConfig:
        config = config_from_proto(req.config)
        new = self.rt.change(lambda s: s.update_table_config(req.job, req.table, config,
                                                             req.expected_version))
        return config_to_proto(new)

    def update_table_configs(self, req, call) -> mg.UpdateTableConfigsResponse:
        changes = [(c.table, config_from_proto(c.config), c.expected_version) for c in req.changes]
        new = self.rt.change(lambda s: s.update_table_configs(req.job, changes))
        return mg.UpdateTableConfigsResponse(configs=[config_to_proto(c) for c in new])

    def delete_table(self, req, call) -> mg.DeleteTableResponse:
        self.rt.change(lambda s: s.delete_table(req.job, req.table))
        return mg.DeleteTableResponse(epoch=self.rt.published.epoch)

    # --- shard map ---
    def get_shard_map(self, req, call) -> pb.ShardMap:
        names.check_optional(names.JOB, req.job, "job")
        msg = self.rt.published
        if req.min_epoch:
            # answer (with the current map) a little before the caller's deadline
            timeout = None if call.deadline is None else max(0.0, call.deadline - time.monotonic() - 0.05)
            msg = self.rt.wait_published(req.min_epoch, timeout)
        return self._answer(msg, req.known_epoch, _job_of(req, call.principal))

    def watch_shard_map(self, req, call):
        names.check_optional(names.JOB, req.job, "job")
        job = _job_of(req, call.principal)
        last = req.after_epoch
        sent = 0                                    # the epoch of the last map sent
        while call.context.is_active() and not self.rt.stopping:
            msg = self.rt.wait_published(last + 1, timeout=1.0)
            if msg.epoch > last:
                last = msg.epoch
                yield self._answer(msg, sent if req.changes else 0, job)
                sent = msg.epoch

    def _answer(self, msg: pb.ShardMap, known_epoch: int, job: str) -> pb.ShardMap:
        """``msg`` for a holder of ``known_epoch``'s map (0: none): its changes since then
        when they are known, else whole; only ``job``'s tables and group when ``job``."""
        changes = self.rt.maps.changes_since(known_epoch, msg) if known_epoch else None
        if changes is not None:
            out = mapdelta.changes_only_job(changes, job) if job else changes
        else:
            out = mapdelta.only_job(msg, job) if job else msg
        self.rt.maps.count_sent(out)
        return out

    # --- worker groups ---
    def join_worker_group(self, req, call) -> mg.JoinWorkerGroupResponse:
        names.check_optional(names.WORKER, req.name, "name")
        consistency, staleness = (consistency_from_proto(req.consistency)
                                  if req.consistency.mode else (None, 0))
        now = self.rt.now()
        if req.client:
            member = self.rt.change(lambda s: s.open_client(req.job, req.name, now))
        else:
            member = self.rt.change(lambda s: s.join(req.job, req.name, req.rank_hint,
                                                     req.previous_session, consistency, staleness, now))
        msg = self.rt.published
        group = next((g for g in msg.groups if g.job == req.job), pb.WorkerGroup(job=req.job))
        with self.rt.lock:
            job = self.rt.state.job(req.job)
            restored = member.rank in job.restore_pending
        s = self.rt.settings
        return mg.JoinWorkerGroupResponse(
            rank=max(0, member.rank), session=member.session, incarnation=member.incarnation, group=group,
            epoch=msg.epoch, lease_seconds=s.worker_lease_seconds,
            heartbeat_seconds=s.worker_heartbeat_seconds, restored=restored, step=max(0, member.step))

    def leave_worker_group(self, req, call) -> mg.LeaveWorkerGroupResponse:
        version = self.rt.change(lambda s: s.leave(req.job, req.session, max(0, req.step)))
        return mg.LeaveWorkerGroupResponse(membership_version=version)

    def worker_heartbeat(self, req, call) -> mg.WorkerHeartbeatResponse:
        now = self.rt.now()

        def beat(s):
            job, member = s.worker_heartbeat(req.job, req.session, req.incarnation, req.step,
                                             req.samples_per_second, req.loss, now)
            return mg.WorkerHeartbeatResponse(membership_version=job.membership_version,
                                              world_size=len(job.members), rank=max(0, member.rank),
                                              epoch=self.rt.published.epoch)
        resp = self.rt.change(beat, wait_published=False)
        resp.checkpoint_id = self.checkpoints.requested(req.job)
        return resp

    # --- checkpoints ---
    def checkpoint(self, req, call) -> mg.CheckpointResponse:
        names.check(names.JOB, req.job, "job")
        path = self.checkpoints.request(req.job, req.directory, call.deadline)
        ck = read_checkpoint(path, verify=False)
        nbytes = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
        return mg.CheckpointResponse(path=path, step=ck.step, tables=len(ck.tables), bytes=nbytes)

    def checkpoint_barrier(self, req, call) -> mg.CheckpointBarrierResponse:
        names.check_optional(names.CHECKPOINT_ID, req.checkpoint_id, "checkpoint_id")
        path = self.checkpoints.barrier(req.job, req.session, req.step, req.worker_state,
                                        req.checkpoint_id, deadline=call.deadline)
        return mg.CheckpointBarrierResponse(path=path)

    def restore(self, req, call) -> mg.RestoreResponse:
        names.check(names.JOB, req.job, "job")
        epoch, step, tables = self.checkpoints.restore(req.job, req.path)
        return mg.RestoreResponse(epoch=epoch, step=step, tables=tables)

    def reset_lost_blocks(self, req, call) -> mg.ResetLostBlocksResponse:
        names.check(names.TABLE, req.table, "table")
        with self.rt.lock:
            blocks = self.rt.state.lost_blocks(req.job).get((req.job, req.table), [])
            self.rt.state.table(req.job, req.table)             # NotFound for an unknown one
        n = self.rt.change(lambda s: s.recover_lost(req.job, req.table, blocks, "reset"))
        if n:
            log.warning("job %s: %d lost block(s) of table %s reset to their initial values on request",
                        req.job, n, req.table)
        return mg.ResetLostBlocksResponse(epoch=self.rt.published.epoch, blocks=n)

    def get_worker_state(self, req, call) -> mg.GetWorkerStateResponse:
        state, step = self.checkpoints.worker_state(req.job, req.rank, req.latest)
        return mg.GetWorkerStateResponse(worker_state=state, step=step)

    # --- status ---
    def get_cluster_status(self, req, call) -> mg.ClusterStatus:
        return cluster_status(self.rt)


def _job_scoped(fn):
    """A handler for requests naming a job: the name follows its rule (``shardps.names``) and
    a job token may only act on its own job."""
    from shardps.server.auth import check_job

    def handler(req, call):
        names.check(names.JOB, req.job, "job")
        check_job(call.principal, req.job)
        return fn(req, call)
    handler.__name__ = fn.__name__
    return handler


def _job_of(req, principal) -> str:
    """The job whose tables a map answer shows: a job token's own, else the request's
    ``job`` (empty: every job's)."""
    from shardps.server.auth import JOB
    if principal is not None and principal.role == JOB:
        if req.job and req.job != principal.job:
            raise PermissionDenied(f"a token of job {principal.job!r} cannot read the map of job "
                                   f"{req.job!r}")
        return principal.job
    return req.job


def data_loss_proto(records) -> list[pb.DataLoss]:
    """The proto's ``DataLoss`` of a job's ``DataLossRecord`` list."""
    from shardps.server.manager.state import RECOVERY
    return [pb.DataLoss(epoch=d.epoch, server=d.server, table=d.table, blocks=d.blocks,
                        lost_at_step=d.lost_at_step, recovery=RECOVERY[d.recovery], checkpoint=d.checkpoint,
                        checkpoint_step=d.checkpoint_step, detail=d.detail) for d in records]


def cluster_status(rt: ManagerRuntime) -> mg.ClusterStatus:
    with rt.lock:
        st = rt.state
        now = rt.now()
        msg = mg.ClusterStatus(epoch=rt.published.epoch, replication=st.settings.replication,
                               under_replicated_blocks=st.under_replicated(),
                               pending_moves=rt.pending_moves)
        primaries: dict[str, int] = {}
        backups: dict[str, int] = {}
        for t in st.tables.values():
            for b in t.blocks:
                msg.blocks += 1
                msg.lost_blocks += 1 if b.lost_epoch else 0
                for i, n in enumerate(b.replicas):
                    d = primaries if i == 0 else backups
                    d[n] = d.get(n, 0) + 1
        for name in sorted(st.servers):
            rec = st.servers[name]
            msg.servers.add(
                server=pb.ServerInfo(name=rec.name, address=rec.address, incarnation=rec.incarnation,
                                     # (protobuf's stubs want ServerState.ValueType: the same number)
                                     state=rec.state.value,  # type: ignore[arg-type]
                                     metrics_address=rec.metrics_address),
                primary_blocks=primaries.get(name, 0), replica_blocks=backups.get(name, 0),
                bytes=rec.bytes, heartbeat_age_seconds=max(0.0, now - rec.last_heartbeat))
        for name in sorted(st.jobs):
            job = st.jobs[name]
            g = msg.groups.add(job=name, tables=sum(1 for (j, _) in st.tables if j == name))
            g.consistency.mode = job.consistency.value
            g.consistency.staleness = job.staleness
            for m in sorted(job.members.values(), key=lambda m: m.rank):
                g.workers.add(member=pb.WorkerMember(rank=m.rank, session=m.session,
                                                     incarnation=m.incarnation, name=m.name),
                              step=m.step, samples_per_second=m.samples_per_second, loss=m.loss,
                              heartbeat_age_seconds=max(0.0, now - m.last_heartbeat))
            g.data_loss.extend(data_loss_proto(job.data_loss))
        return msg

