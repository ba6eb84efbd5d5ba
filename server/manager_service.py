"""The resource manager process: ``ManagerRuntime`` executes what ``ManagerState`` decides
(persist, install maps on servers, copy blocks, watch leases) and ``ResourceManagerService``
is the thin gRPC layer in front of it.

Publication order: every change is persisted, then installed on every live server
(InstallShardMap, in parallel, in epoch order), and only then visible to clients
(GetShardMap / WatchShardMap). A server that misses an install catches up from its next
heartbeat.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from shardps.convert import config_from_proto, config_to_proto, consistency_from_proto, spec_from_proto
from google.protobuf.json_format import ParseDict

from shardps import names
from shardps.errors import (DeadlineExceeded, InvalidArgument, NotFound,
                            ShardpsError, Unavailable)
from shardps.metrics import ManagerMetrics
from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import manager_pb2 as mg
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.rpc.status import Method, bind, from_rpc_error, proto_method
from shardps.server.manager_state import ManagerSettings, ManagerState, Move, ServerState
from shardps.server.node_service import StubPool

log = logging.getLogger("shardps.manager")
SERVICE = "shardps.v1.ResourceManager"


@dataclass(frozen=True)
class RuntimeSettings:
    state_path: str = ""                 # empty: state lives in memory only
    install_timeout: float = 3.0
    reconcile_interval: float = 0.2
    copy_timeout: float = 60.0


class ManagerRuntime:
    """Owns the state, its lock and every side effect. Thread-safe."""

    def __init__(self, settings: ManagerSettings = ManagerSettings(),
                 runtime: RuntimeSettings = RuntimeSettings(), metrics: ManagerMetrics | None = None,
                 pool: StubPool | None = None, clock=time.monotonic):
        self.settings = settings
        self.runtime = runtime
        self.metrics = metrics or ManagerMetrics()
        self.pool = pool or StubPool()
        self.now = clock
        self.lock = threading.RLock()
        # Held while blocks move (plan, copy, commit) and while a restore loads its blocks: a
        # restored block must not be copied before its values are loaded. Order: moves_lock
        # before lock.
        self.moves_lock = threading.Lock()
        path = Path(runtime.state_path) if runtime.state_path else None
        if path is not None and path.exists():
            self.state = ManagerState.load(path, settings, self.now())
            log.info("manager state loaded from %s: epoch %d, %d servers, %d tables, %d jobs",
                     path, self.state.epoch, len(self.state.servers), len(self.state.tables),
                     len(self.state.jobs))
        else:
            self.state = ManagerState(settings)
        self._path = path
        self._publish_lock = threading.Lock()
        self._published = self.state.shard_map()
        self._published_cond = threading.Condition()
        self._executor = futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="install")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._planned_epoch = -1
        self._last_tick = self.now()
        self.last_recovery: dict = {}
        self._update_metrics()

    # ------------------------------------------------------------------ change + publish
    def change(self, fn, *args, **kwargs):
        """Run ``fn(state, *args)`` under the lock; if the epoch moved, persist and publish."""
        with self.lock:
            before = self.state.epoch
            result = fn(self.state, *args, **kwargs)
            after = self.state.epoch
            changed = after != before
            msg = self.state.shard_map() if changed else None
            if changed and self._path is not None:
                self.state.save(self._path)
        if changed:
            self.publish(msg)
        elif self._published.epoch < after:
            # read-your-writes: another caller's change is being installed; wait for it
            self.wait_published(after, timeout=self.runtime.install_timeout * 2)
        return result

    def publish(self, msg: pb.ShardMap) -> None:
        """Install ``msg`` on every live server, then show it to clients."""
        with self._publish_lock:
            if msg.epoch <= self._published.epoch:
                return
            started = self.now()
            targets = [s for s in msg.servers if s.state != pb.DEAD]
            request = ps.InstallShardMapRequest(map=msg)
            jobs = {self._executor.submit(self._install, s.address, request): s.name for s in targets}
            for fut in futures.as_completed(jobs):
                err = fut.exception()
                if err is not None:
                    log.warning("epoch %d not installed on %s yet (%s); it catches up from its "
                                "next heartbeat", msg.epoch, jobs[fut], err)
            self.metrics.install_seconds.observe(self.now() - started)
            with self._published_cond:
                self._published = msg
                self._published_cond.notify_all()
        self._update_metrics()

    def _install(self, address: str, request) -> None:
        try:
            self.pool.get(address).InstallShardMap(request, timeout=self.runtime.install_timeout,
                                                   metadata=self.pool.metadata)
        except grpc.RpcError as err:
            raise from_rpc_error(err, f"install on {address}") from None

    @property
    def published(self) -> pb.ShardMap:
        return self._published

    def wait_published(self, min_epoch: int, timeout: float | None) -> pb.ShardMap:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._published_cond:
            while self._published.epoch < min_epoch:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._published_cond.wait(timeout=remaining if remaining is not None else 1.0)
            return self._published

    # ------------------------------------------------------------------ background work
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="reconcile", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._published_cond:
            self._published_cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.pool.close()

    def _loop(self) -> None:
        while not self._stop.wait(self.runtime.reconcile_interval):
            try:
                self.tick()
            except Exception:
                log.exception("reconcile tick failed; retrying")

    def tick(self) -> None:
        """One round: expire leases, move blocks toward the planned placement, retire drained."""
        now = self.now()
        stalled = now - self._last_tick > max(1.0, 5 * self.runtime.reconcile_interval)
        self._last_tick = now
        if stalled:
            # the manager itself was busy (a long placement, a slow disk): heartbeats queued
            # meanwhile have not been counted yet; skip this round, judge leases on the next
            log.warning("reconcile loop stalled; this round is skipped (leases are judged on the next)")
            return
        changed = self.change(lambda s: s.expire(now))
        if not changed:
            self._update_metrics()
        if any(c.startswith("server:") for c in changed):
            self.metrics.failovers.inc(sum(1 for c in changed if c.startswith("server:")))
            self.last_recovery = {"declared_dead_at": now, "what": changed}
        if not self.moves_lock.acquire(blocking=False):
            return                  # a restore is loading blocks: move them on a later round
        try:
            with self.lock:
                if self.state.epoch == self._planned_epoch:
                    return
                moves = self.state.plan_moves(self.settings.move_batch_blocks)
                if not moves:
                    self._planned_epoch = self.state.epoch
            if moves:
                done = self._execute(moves)
                if done:
                    n = self.change(lambda s: s.commit_moves(done, self.now()))
                    self.metrics.moves.inc(n)
            self.change(lambda s: s.retire_drained())
            self.change(lambda s: s.replace_lost())
        finally:
            self.moves_lock.release()

    def _execute(self, moves: list[Move]) -> list[Move]:
        """Copy blocks (grouped by source and destination); returns the moves whose copies
        all succeeded."""
        with self.lock:
            epoch = self.state.epoch
            address = {n: s.address for n, s in self.state.servers.items()}
        groups: dict[tuple[str, str], list[Move]] = {}
        for m in moves:
            for dst in m.add:
                groups.setdefault((m.source, dst), []).append(m)
        failed: set[Move] = set()

        def copy(source: str, dst: str, items: list[Move]) -> None:
            request = ps.CopyBlocksRequest(epoch=epoch, destination=dst)
            for m in items:
                request.blocks.add(job=m.job, table=m.table, block=m.block)
            try:
                self.pool.get(address[source]).CopyBlocks(request, timeout=self.runtime.copy_timeout,
                                                          metadata=self.pool.metadata)
            except grpc.RpcError as err:
                log.warning("copying %d blocks %s -> %s failed: %s", len(items), source, dst,
                            from_rpc_error(err, "CopyBlocks").message)
                failed.update(items)

        jobs = [self._executor.submit(copy, src, dst, items) for (src, dst), items in groups.items()]
        futures.wait(jobs)
        done = [m for m in moves if m not in failed]
        if done:
            log.info("copied %d blocks to their new replicas", len(done))
        return done

    # ------------------------------------------------------------------ metrics
    def _update_metrics(self) -> None:
        with self.lock:
            st = self.state
            now = self.now()
            m = self.metrics
            m.epoch.set(st.epoch)
            counts = {s: 0 for s in ServerState}
            for rec in st.servers.values():
                counts[rec.state] += 1
            for state, n in counts.items():
                m.servers.labels(state.name).set(n)
            primaries: dict[str, int] = {}
            replicas: dict[str, int] = {}
            nblocks = 0
            for t in st.tables.values():
                for b in t.blocks:
                    nblocks += 1
                    for i, n in enumerate(b.replicas):
                        (primaries if i == 0 else replicas)[n] = (primaries if i == 0 else replicas).get(n, 0) + 1
            for rec in st.servers.values():
                m.server_up.labels(rec.name).set(1 if rec.live else 0)
                m.heartbeat_age.labels(rec.name).set(max(0.0, now - rec.last_heartbeat))
                m.server_blocks.labels(rec.name, "primary").set(primaries.get(rec.name, 0))
                m.server_blocks.labels(rec.name, "backup").set(replicas.get(rec.name, 0))
                m.server_bytes.labels(rec.name).set(rec.bytes)
            m.blocks.set(nblocks)
            m.set_replication(st.replication_health())
            for job in st.jobs.values():
                m.workers.labels(job.name).set(len(job.members))

    def refresh_metrics(self) -> None:
        self._update_metrics()


@dataclass
class _PendingCheckpoint:
    id: str
    directory: str
    arrived: dict = field(default_factory=dict)     # session -> (rank, step, state bytes)
    taking: bool = False
    done: bool = False
    path: str = ""
    error: ShardpsError | None = None
    step: int = 0


class CheckpointCoordinator:
    """Cuts consistent checkpoints of a job and restores them.

    With live workers, every one of them stops at a step boundary and arrives at a barrier
    (``barrier``) with its local state; once all live workers arrived, the job's pushes are
    held on every server, each table's blocks are copied from their primaries and written
    with the workers' states (``shardps.server.checkpoints``), then everything resumes.
    Without live workers the servers' hold alone makes the cut consistent.
    """

    def __init__(self, rt: ManagerRuntime, default_dir: str = "", barrier_timeout: float = 120.0):
        self.rt = rt
        self.default_dir = default_dir
        self.barrier_timeout = barrier_timeout
        self._cond = threading.Condition()
        self._pending: dict[str, _PendingCheckpoint] = {}
        self._requests: dict[str, str] = {}             # job -> on-demand checkpoint id

    def requested(self, job: str) -> str:
        with self._cond:
            return self._requests.get(job, "")

    def _directory(self, directory: str, field: str = "directory") -> str:
        """``directory`` of a request resolved inside the checkpoint root (``names.inside_root``):
        the root itself when empty; FailedPrecondition without a root, InvalidArgument outside."""
        return str(names.inside_root(directory, self.default_dir, field))

    def _live(self, job: str) -> dict[str, int]:
        with self.rt.lock:
            rec = self.rt.state.job(job)
            return {m.session: m.rank for m in rec.members.values()}

    def barrier(self, job: str, session: str, step: int, state: bytes, checkpoint_id: str,
                directory: str = "", deadline: float | None = None) -> str:
        """A worker's arrival; returns the checkpoint's path once it is written."""
        live = self._live(job)
        if session not in live:
            raise NotFound(f"session {session!r} is not a live member of job {job!r}: join first")
        with self._cond:
            p = self._pending.get(job)
            if p is None or p.done:
                p = self._pending[job] = _PendingCheckpoint(checkpoint_id or f"step-{step}",
                                                            self._directory(directory))
            p.arrived[session] = (live[session], step, state)
            self._cond.notify_all()
        return self._wait(job, p, deadline)

    def request(self, job: str, directory: str = "", deadline: float | None = None) -> str:
        """An on-demand checkpoint (admin): asks the live workers to arrive, or cuts directly."""
        directory = self._directory(directory)
        live = self._live(job)
        with self._cond:
            p = self._pending.get(job)
            if p is None or p.done:
                p = self._pending[job] = _PendingCheckpoint(f"manual-{int(time.time() * 1000)}", directory)
            if live:
                self._requests[job] = p.id
        return self._wait(job, p, deadline)

    def _wait(self, job: str, p: _PendingCheckpoint, deadline: float | None) -> str:
        limit = time.monotonic() + self.barrier_timeout
        if deadline is not None:
            limit = min(limit, deadline)
        while True:
            with self._cond:
                if p.done:
                    if p.error is not None:
                        raise p.error
                    return p.path
                live = self._live(job)
                ready = set(live) <= set(p.arrived) and not p.taking
                if ready:
                    p.taking = True
                elif time.monotonic() > limit:
                    missing = sorted(live[s] for s in set(live) - set(p.arrived))
                    raise DeadlineExceeded(f"checkpoint {p.id} of job {job!r}: ranks {missing} did not "
                                           f"reach the barrier in time")
                else:
                    self._cond.wait(timeout=0.2)
                    continue
            try:
                p.path = str(self.cut(job, p))
            except ShardpsError as exc:
                p.error = exc
            finally:
                with self._cond:
                    p.done = True
                    if self._requests.get(job) == p.id:
                        del self._requests[job]
                    self._cond.notify_all()

    def cut(self, job: str, p: _PendingCheckpoint):
        """Hold the job's pushes, copy every block from its primary, write the files."""
        from shardps.server.checkpoints import write_checkpoint
        from shardps.server.node_service import decode_snapshots
        msg = self.rt.published
        tables = [t for t in msg.tables if t.job == job]
        group = next((g for g in msg.groups if g.job == job), None)
        servers = [s for s in msg.servers if s.state != pb.DEAD]
        self._hold(servers, job, True)
        try:
            snapshots: dict[str, list] = {t.spec.name: [] for t in tables}
            by_primary: dict[int, list] = {}
            for t in tables:
                for b, bp in enumerate(t.blocks):
                    if not bp.replicas:
                        raise Unavailable(f"block {b} of {t.spec.name!r} has no live replica: cannot checkpoint")
                    by_primary.setdefault(bp.replicas[0], []).append(ps.BlockRef(job=job, table=t.spec.name, block=b))
            for index, refs in by_primary.items():
                server = msg.servers[index]
                try:
                    stream = self.rt.pool.get(server.address).SnapshotBlocks(
                        ps.SnapshotBlocksRequest(epoch=msg.epoch, blocks=refs), timeout=120,
                        metadata=self.rt.pool.metadata)
                    _, snaps = decode_snapshots(stream)
                except grpc.RpcError as err:
                    raise from_rpc_error(err, f"snapshot from {server.name}") from None
                for snap in snaps:
                    snapshots[snap.header.ref.table].append(snap)
            workers = {rank: state for rank, step, state in p.arrived.values()}
            p.step = max((step for _, step, _ in p.arrived.values()), default=0)
            consistency = group.consistency if group is not None else pb.Consistency()
            path = write_checkpoint(p.directory, job, p.id, p.step, consistency, tables, snapshots, workers)
            log.info("checkpoint of job %s written to %s (%d tables, %d workers)", job, path, len(tables),
                     len(workers))
            return path
        finally:
            self._hold(servers, job, False)

    def _hold(self, servers, job: str, hold: bool) -> None:
        for s in servers:
            try:
                self.rt.pool.get(s.address).HoldJob(ps.HoldJobRequest(job=job, hold=hold, hold_seconds=60),
                                                    timeout=30, metadata=self.rt.pool.metadata)
            except grpc.RpcError as err:
                if hold:
                    raise from_rpc_error(err, f"hold job {job} on {s.name}") from None
                log.warning("releasing the hold of job %s on %s failed (it expires by itself): %s",
                            job, s.name, err.details())

    def restore(self, job: str, path: str) -> tuple[int, int, int]:
        """Recreate the job's tables from a checkpoint onto the current servers.
        Returns (epoch, step, tables). Run it with the job's workers stopped."""
        from shardps.convert import spec_from_proto, config_from_proto, consistency_from_proto
        from shardps.server.checkpoints import latest, read_checkpoint
        if not path:
            found = latest(self._directory(""), job)
            if found is None:
                raise NotFound(f"no checkpoint of job {job!r} under {self.default_dir}")
            path = str(found)
        else:
            path = self._directory(path, "path")
        ck = read_checkpoint(path)
        if ck.job != job:
            raise InvalidArgument(f"checkpoint {path} is of job {ck.job!r}, not {job!r}")
        mode, staleness = consistency_from_proto(ParseDict(ck.consistency, pb.Consistency()))
        tables = [(spec_from_proto(s), config_from_proto(c)) for s, c in ck.table_specs()]
        # No block moves while the restored blocks are empty (a copy would carry the empty
        # state to a replica the next map lists), and the job's pushes are held from before
        # the tables are recreated until their values are loaded: when this returns, every
        # block is readable with the checkpoint's values on the replicas the map names.
        with self.rt.moves_lock:
            servers = [s for s in self.rt.published.servers if s.state != pb.DEAD]
            self._hold(servers, job, True)
            try:
                self.rt.change(lambda s: s.restore_job(job, mode, staleness, tables, path,
                                                       ck.step, list(ck.workers)))
                msg = self.rt.published
                self._load(msg, job, ck)
            finally:
                self._hold(servers, job, False)
        log.info("job %s restored from %s (step %d) onto %d servers", job, path, ck.step, len(servers))
        return msg.epoch, ck.step, len(tables)

    def _load(self, msg: pb.ShardMap, job: str, ck) -> None:
        """Send checkpoint ``ck``'s blocks of ``job`` to every replica ``msg`` lists."""
        from shardps.server.node_service import encode_snapshots
        per_server: dict[int, list] = {}
        for t in msg.tables:
            if t.job != job:
                continue
            snaps = ck.blocks[t.spec.name]
            for b, bp in enumerate(t.blocks):
                for index in bp.replicas:
                    per_server.setdefault(index, []).append(snaps[b])
        for index, snaps in per_server.items():
            server = msg.servers[index]
            try:
                self.rt.pool.get(server.address).LoadBlocks(
                    encode_snapshots(snaps, msg.epoch), timeout=300,
                    metadata=self.rt.pool.metadata + (("x-shardps-source", "manager"),))
            except grpc.RpcError as err:
                raise from_rpc_error(err, f"load blocks on {server.name}") from None

    def worker_state(self, job: str, rank: int) -> tuple[bytes, int]:
        from shardps.server.checkpoints import read_checkpoint
        with self.rt.lock:
            rec = self.rt.state.job(job)
            path, step = rec.restored_path, rec.restored_step
            if rank in rec.restore_pending:
                rec.restore_pending.remove(rank)
        if not path:
            raise NotFound(f"job {job!r} was not restored from a checkpoint")
        ck = read_checkpoint(path, verify=False)
        if rank not in ck.workers:
            raise NotFound(f"checkpoint {path} holds no state for rank {rank} "
                           f"(ranks: {sorted(ck.workers)})")
        return ck.workers[rank], step


class ResourceManagerService:
    """gRPC methods of the resource manager over a ManagerRuntime."""

    def __init__(self, runtime: ManagerRuntime, checkpoints: CheckpointCoordinator | None = None,
                 token_key: bytes = b""):
        self.rt = runtime
        self.checkpoints = checkpoints or CheckpointCoordinator(runtime)
        self.token_key = token_key

    def methods(self) -> dict[str, Method]:
        u = "unary_unary"
        scoped = _job_scoped
        return {
            "RegisterServer": proto_method(u, self.register_server, mg.RegisterServerRequest),
            "ServerHeartbeat": proto_method(u, self.server_heartbeat, mg.ServerHeartbeatRequest),
            "DrainServer": proto_method(u, self.drain_server, mg.DrainServerRequest),
            "CreateJob": proto_method(u, self.create_job, mg.CreateJobRequest),
            "EndJob": proto_method(u, self.end_job, mg.EndJobRequest),
            "CreateTable": proto_method(u, scoped(self.create_table), mg.CreateTableRequest),
            "DescribeTable": proto_method(u, scoped(self.describe_table), mg.DescribeTableRequest),
            "ListTables": proto_method(u, scoped(self.list_tables), mg.ListTablesRequest),
            "UpdateTableConfig": proto_method(u, scoped(self.update_table_config), mg.UpdateTableConfigRequest),
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
        }

    def handler(self, metrics=None, authenticate=None) -> grpc.GenericRpcHandler:
        return bind(SERVICE, self.methods(), metrics, authenticate)

    # --- servers ---
    def register_server(self, req, call) -> mg.RegisterServerResponse:
        names.check(names.SERVER, req.name, "name")
        now = self.rt.now()
        rec = self.rt.change(lambda s: s.register_server(req.name, req.address, req.metrics_address,
                                                         req.boot_id, now))
        s = self.rt.settings
        return mg.RegisterServerResponse(incarnation=rec.incarnation, lease_seconds=s.server_lease_seconds,
                                         heartbeat_seconds=s.server_heartbeat_seconds,
                                         map=self.rt.published)

    def server_heartbeat(self, req, call) -> mg.ServerHeartbeatResponse:
        names.check(names.SERVER, req.name, "name")
        stats = {"primary_blocks": req.primary_blocks, "replica_blocks": req.replica_blocks,
                 "bytes": req.bytes}
        now = self.rt.now()
        self.rt.change(lambda s: s.server_heartbeat(req.name, req.incarnation, req.epoch, stats, now))
        with self.rt.lock:
            retired = self.rt.state.servers[req.name].retired
        return mg.ServerHeartbeatResponse(epoch=self.rt.published.epoch, retired=retired)

    def drain_server(self, req, call) -> mg.DrainServerResponse:
        names.check(names.SERVER, req.name, "name")
        n = self.rt.change(lambda s: s.drain_server(req.name))
        return mg.DrainServerResponse(epoch=self.rt.published.epoch, blocks_to_move=n)

    # --- jobs and tables ---
    def create_job(self, req, call) -> mg.CreateJobResponse:
        names.check(names.JOB, req.job, "job")
        mode, staleness = consistency_from_proto(req.consistency)
        job, created = self.rt.change(lambda s: s.create_job(req.job, mode, staleness,
                                                             req.quota.max_bytes))
        return mg.CreateJobResponse(created=created, token=self.issue_token(job))

    def issue_token(self, job) -> str:
        """The job's token (signed with the token key), or "" when tokens are off."""
        from shardps.server.auth import issue_job_token
        return issue_job_token(self.token_key, job.name) if self.token_key else ""

    def end_job(self, req, call) -> mg.EndJobResponse:
        names.check(names.JOB, req.job, "job")
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

    def delete_table(self, req, call) -> mg.DeleteTableResponse:
        self.rt.change(lambda s: s.delete_table(req.job, req.table))
        return mg.DeleteTableResponse(epoch=self.rt.published.epoch)

    # --- shard map ---
    def get_shard_map(self, req, call) -> pb.ShardMap:
        if req.min_epoch:
            # answer (with the current map) a little before the caller's deadline
            timeout = None if call.deadline is None else max(0.0, call.deadline - time.monotonic() - 0.05)
            return _visible(self.rt.wait_published(req.min_epoch, timeout), call.principal)
        return _visible(self.rt.published, call.principal)

    def watch_shard_map(self, req, call):
        last = req.after_epoch
        while call.context.is_active() and not self.rt._stop.is_set():
            msg = self.rt.wait_published(last + 1, timeout=1.0)
            if msg.epoch > last:
                last = msg.epoch
                yield _visible(msg, call.principal)

    # --- worker groups ---
    def join_worker_group(self, req, call) -> mg.JoinWorkerGroupResponse:
        names.check_optional(names.WORKER, req.name, "name")
        consistency, staleness = (consistency_from_proto(req.consistency)
                                  if req.consistency.mode else (None, 0))
        now = self.rt.now()
        member = self.rt.change(lambda s: s.join(req.job, req.name, req.rank_hint,
                                                 req.previous_session, consistency, staleness, now))
        msg = self.rt.published
        group = next((g for g in msg.groups if g.job == req.job), pb.WorkerGroup(job=req.job))
        with self.rt.lock:
            job = self.rt.state.job(req.job)
            restored = member.rank in job.restore_pending
        s = self.rt.settings
        return mg.JoinWorkerGroupResponse(
            rank=member.rank, session=member.session, incarnation=member.incarnation, group=group,
            epoch=msg.epoch, lease_seconds=s.worker_lease_seconds,
            heartbeat_seconds=s.worker_heartbeat_seconds, restored=restored)

    def leave_worker_group(self, req, call) -> mg.LeaveWorkerGroupResponse:
        version = self.rt.change(lambda s: s.leave(req.job, req.session))
        return mg.LeaveWorkerGroupResponse(membership_version=version)

    def worker_heartbeat(self, req, call) -> mg.WorkerHeartbeatResponse:
        now = self.rt.now()
        with self.rt.lock:
            job, member = self.rt.state.worker_heartbeat(req.job, req.session, req.incarnation,
                                                         req.step, req.samples_per_second,
                                                         req.loss, now)
            resp = mg.WorkerHeartbeatResponse(membership_version=job.membership_version,
                                              world_size=len(job.members), rank=member.rank,
                                              epoch=self.rt.published.epoch)
        resp.checkpoint_id = self.checkpoints.requested(req.job)
        return resp

    # --- checkpoints ---
    def checkpoint(self, req, call) -> mg.CheckpointResponse:
        names.check(names.JOB, req.job, "job")
        path = self.checkpoints.request(req.job, req.directory, call.deadline)
        from shardps.server.checkpoints import read_checkpoint
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

    def get_worker_state(self, req, call) -> mg.GetWorkerStateResponse:
        state, step = self.checkpoints.worker_state(req.job, req.rank)
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


def _visible(msg: pb.ShardMap, principal) -> pb.ShardMap:
    """A job token sees the servers and its own job's tables and group only."""
    from shardps.server.auth import JOB
    if principal is None or principal.role != JOB:
        return msg
    out = pb.ShardMap(epoch=msg.epoch, replication=msg.replication, servers=msg.servers)
    out.tables.extend(t for t in msg.tables if t.job == principal.job)
    out.groups.extend(g for g in msg.groups if g.job == principal.job)
    return out


def cluster_status(rt: ManagerRuntime) -> mg.ClusterStatus:
    with rt.lock:
        st = rt.state
        now = rt.now()
        msg = mg.ClusterStatus(epoch=rt.published.epoch, replication=st.settings.replication,
                               under_replicated_blocks=st.under_replicated())
        primaries: dict[str, int] = {}
        replicas: dict[str, int] = {}
        for t in st.tables.values():
            for b in t.blocks:
                msg.blocks += 1
                for i, n in enumerate(b.replicas):
                    d = primaries if i == 0 else replicas
                    d[n] = d.get(n, 0) + 1
        for name in sorted(st.servers):
            rec = st.servers[name]
            msg.servers.add(
                server=pb.ServerInfo(name=rec.name, address=rec.address, incarnation=rec.incarnation,
                                     state=rec.state.value, metrics_address=rec.metrics_address),
                primary_blocks=primaries.get(name, 0), replica_blocks=replicas.get(name, 0),
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
        return msg

