"""``PSClient``: the client library of a shardps cluster, for one job.

    client = PSClient("127.0.0.1:7070", job="demo")
    client.create_job()                                  # idempotent
    client.create_dense("w", shape=(1000, 16), optimizer=sgd(lr=0.1))
    w = client.pull_dense("w")                           # float32 array of shape (1000, 16)
    client.push_dense("w", np.ones_like(w))              # applied by the servers' SGD

Contract:
* Blocking calls take ``timeout=`` (seconds; default ``PSClient.timeout``) and raise
  ``shardps.errors.ShardpsError`` subclasses, never ``grpc.RpcError``. ``*_async`` variants
  return ``concurrent.futures.Future``; the blocking call does the same work in the caller's
  thread.
* Data calls fan out in parallel to the servers that own the touched blocks; a server that
  answers FAILED_PRECONDITION (stale epoch) or UNAVAILABLE makes the client refresh its shard
  map and re-send just that server's share, until the deadline. Pushes keep their sequence
  number across retries, so a retried push is applied once: this needs a session (``join``).
  A client that has not joined is not deduplicated, and a retry after an UNAVAILABLE push
  (whose outcome is unknown) may apply it twice on some blocks.
* Sparse ids are int64 (any order, repeats allowed): pulls send each distinct id once, pushes
  sum the rows of repeated ids before sending. Dense ranges are flat and half-open.
* Thread-safe: one client may be shared by threads (each call is independent).
"""

from __future__ import annotations

import functools
import logging
import os
import random
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import grpc
import numpy as np

from shardps import dtypes
from shardps.convert import config_to_proto, consistency_to_proto, spec_to_proto
from shardps.dtypes import WireDType
from shardps.errors import (DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound,
                            ShardpsError, StaleEpoch, Unavailable)
from shardps.metrics import WorkerMetrics
from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import manager_pb2 as mg
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.rpc import channels, shm
from shardps.rpc.codec import CHUNK_BYTES, byte_view, encode_chunk, split_payload, write_into
from shardps.rpc.status import from_rpc_error
from shardps.server.node_service import StubPool
from shardps.shardmap import ShardMapView, TableView
from shardps.tables import (Consistency, Initializer, OptimizerConfig, TableConfig, TableKind,
                            TableSpec, coalesce, dense_table, sparse_table)
from shardps.worker.routing import Piece, live_servers, route

log = logging.getLogger("shardps.client")
MANAGER = "shardps.v1.ResourceManager"


@dataclass(frozen=True)
class Membership:
    """This client's place in its job's worker group."""

    rank: int
    session: str
    incarnation: int
    world_size: int
    restored: bool = False


@dataclass
class PushResult:
    versions: dict[tuple[str, int], int] = field(default_factory=dict)   # (table, block) -> version
    duplicate_blocks: int = 0


@dataclass
class PullResult:
    values: list[np.ndarray]
    versions: dict[tuple[str, int], int]
    min_clock: int = 0


class ManagerStub:
    def __init__(self, ch: grpc.Channel):
        def unary(name, req, resp):
            return ch.unary_unary(f"/{MANAGER}/{name}", request_serializer=req.SerializeToString,
                                  response_deserializer=resp.FromString)
        self.CreateJob = unary("CreateJob", mg.CreateJobRequest, mg.CreateJobResponse)
        self.EndJob = unary("EndJob", mg.EndJobRequest, mg.EndJobResponse)
        self.CreateTable = unary("CreateTable", mg.CreateTableRequest, mg.CreateTableResponse)
        self.DescribeTable = unary("DescribeTable", mg.DescribeTableRequest, pb.TablePlacement)
        self.ListTables = unary("ListTables", mg.ListTablesRequest, mg.ListTablesResponse)
        self.UpdateTableConfig = unary("UpdateTableConfig", mg.UpdateTableConfigRequest, pb.TableConfig)
        self.DeleteTable = unary("DeleteTable", mg.DeleteTableRequest, mg.DeleteTableResponse)
        self.GetShardMap = unary("GetShardMap", mg.GetShardMapRequest, pb.ShardMap)
        self.JoinWorkerGroup = unary("JoinWorkerGroup", mg.JoinWorkerGroupRequest, mg.JoinWorkerGroupResponse)
        self.LeaveWorkerGroup = unary("LeaveWorkerGroup", mg.LeaveWorkerGroupRequest,
                                      mg.LeaveWorkerGroupResponse)
        self.WorkerHeartbeat = unary("WorkerHeartbeat", mg.WorkerHeartbeatRequest, mg.WorkerHeartbeatResponse)
        self.GetClusterStatus = unary("GetClusterStatus", mg.GetClusterStatusRequest, mg.ClusterStatus)
        self.DrainServer = unary("DrainServer", mg.DrainServerRequest, mg.DrainServerResponse)
        self.Checkpoint = unary("Checkpoint", mg.CheckpointRequest, mg.CheckpointResponse)
        self.CheckpointBarrier = unary("CheckpointBarrier", mg.CheckpointBarrierRequest,
                                       mg.CheckpointBarrierResponse)
        self.Restore = unary("Restore", mg.RestoreRequest, mg.RestoreResponse)
        self.GetWorkerState = unary("GetWorkerState", mg.GetWorkerStateRequest, mg.GetWorkerStateResponse)


_RETRYABLE = (StaleEpoch, Unavailable)
SHM_MIN_BYTES = 32 << 10       # payloads this large go through shared memory when possible
# A single attempt of a data call may take this long plus size / ATTEMPT_BANDWIDTH before it
# is abandoned and retried (a peer cut off by a partition never answers; the call's overall
# deadline bounds the retries).
ATTEMPT_SECONDS = 5.0
ATTEMPT_BANDWIDTH = 20e6


def _attempt_timeout(deadline: float, nbytes: int) -> float:
    return max(0.001, min(deadline - time.monotonic(), ATTEMPT_SECONDS + nbytes / ATTEMPT_BANDWIDTH))


class PSClient:
    """Client of one job on a shardps cluster. See the module docstring for the contract."""

    def __init__(self, manager: str, job: str, *, token: str = "", tls: channels.TlsConfig | None = None,
                 timeout: float = 30.0, wire_dtype: str | WireDType = "float32",
                 chunk_bytes: int = CHUNK_BYTES, threads: int = 16,
                 metrics: WorkerMetrics | None = None, shared_memory: bool = True):
        self.manager_address = manager
        self.job = job
        self.timeout = timeout
        self.wire_dtype = WireDType.parse(wire_dtype)
        self.chunk_bytes = chunk_bytes
        self.metrics = metrics or WorkerMetrics()
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._token = token
        self._channel = channels.channel(manager, tls)
        self._manager = ManagerStub(self._channel)
        self._pool = StubPool(tls=tls, metadata=self._metadata)
        self._calls = futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ps-call")
        self._rpcs = futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ps-rpc")
        self._map = ShardMapView()
        self._map_lock = threading.Lock()
        self._seq_lock = threading.Lock()
        self._next_seq = 1
        self._in_flight: set[int] = set()
        self.membership: Membership | None = None
        self.clock = 0                     # completed steps (SYNC / BOUNDED)
        self.last_staleness = 0
        self.last_wait = 0.0               # seconds the last pull waited for stragglers
        self._versions: dict[tuple[str, int], int] = {}   # block versions seen at pulls
        self._heartbeat: threading.Thread | None = None
        self._stop = threading.Event()      # stops the heartbeat loop
        self._closed = threading.Event()    # ends the retries of calls in flight
        self.progress = {"step": 0, "samples_per_second": 0.0, "loss": 0.0}
        # same-host fast path: bulk bytes through /dev/shm, gRPC for control only
        self._shm = shm.ClientRegions() if shared_memory and shm.available() else None
        self._shm_ok: dict[str, bool] = {}
        self._shm_proved: set[tuple[str, str]] = set()
        self.checkpoint_request = ""       # set by heartbeats when an on-demand checkpoint is cut

    # ================================================================== plumbing
    def _call(self, what: str, fn, request, timeout: float | None = None, *, idempotent: bool = False):
        """A unary manager call that honours its deadline, errors translated.

        ``idempotent`` calls (reads, heartbeats, creations of an identical job or table,
        deletions; see manager.proto) are retried after UNAVAILABLE with jittered backoff
        until the deadline: the manager may be restarting or briefly unreachable. The others
        are sent once, but only when a connection exists (``wait_for_ready``: a call that was
        never sent cannot have been executed), so they too wait for a manager that is slow
        to accept instead of failing at once. ``close()`` ends the retries."""
        timeout = timeout or self.timeout
        started = time.perf_counter()
        code = "OK"
        attempts = 0

        def attempt(left: float):
            nonlocal attempts
            attempts += 1
            return fn(request, timeout=left, metadata=self._metadata)

        try:
            if idempotent:
                return channels.call_with_retries(attempt, timeout, sleep=self._closed.wait)
            return fn(request, timeout=timeout, metadata=self._metadata, wait_for_ready=True)
        except grpc.RpcError as err:
            code = err.code().name if hasattr(err, "code") else "UNKNOWN"
            exc = from_rpc_error(err, what)
            if attempts > 1:
                exc = type(exc)(f"{exc.message} (gave up after {attempts} attempts in {timeout:g}s)")
            elif not idempotent and code == "DEADLINE_EXCEEDED":
                exc = type(exc)(f"{exc.message} (waited {timeout:g}s for the manager at "
                                f"{self.manager_address}: is it running and reachable, or is the "
                                f"timeout too short for this call?)")
            raise exc from None
        finally:
            self._observe(MANAGER, what, "unary", code, started)

    def _observe(self, service: str, method: str, kind: str, code: str, started: float) -> None:
        g = self.metrics.grpc
        g.started.labels(service, method, kind).inc()
        g.handled.labels(service, method, kind, code).inc()
        g.handling.labels(service, method, kind).observe(time.perf_counter() - started)

    def close(self) -> None:
        """Stop heartbeats, leave nothing running. Does not leave the group (see ``leave``)."""
        self._closed.set()
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
        self._calls.shutdown(wait=False, cancel_futures=True)
        self._rpcs.shutdown(wait=False, cancel_futures=True)
        self._pool.close()
        self._channel.close()
        if self._shm is not None:
            self._shm.close()

    def __enter__(self) -> "PSClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ================================================================== shard map
    @property
    def shard_map(self) -> ShardMapView:
        return self._map

    def refresh_map(self, min_epoch: int = 0, timeout: float | None = None) -> ShardMapView:
        """Fetch the published shard map (waiting for ``min_epoch`` if given)."""
        msg = self._call("GetShardMap", self._manager.GetShardMap,
                         mg.GetShardMapRequest(min_epoch=min_epoch), timeout, idempotent=True)
        with self._map_lock:
            if msg.epoch > self._map.epoch:
                self._map = ShardMapView(msg)
            return self._map

    def _view(self) -> ShardMapView:
        if self._map.epoch == 0:
            self.refresh_map()
        return self._map

    # ================================================================== jobs and groups
    def create_job(self, consistency: str | Consistency = "async", staleness: int = 0,
                   quota_bytes: int = 0, timeout: float | None = None) -> str:
        """Create this client's job (idempotent with the same consistency). Returns its token
        (empty when the cluster runs without authentication)."""
        mode = consistency if isinstance(consistency, Consistency) else _MODES.get(str(consistency).lower())
        if mode is None:
            raise InvalidArgument(f"consistency {consistency!r}: use async, sync or ssp")
        resp = self._call("CreateJob", self._manager.CreateJob, mg.CreateJobRequest(
            job=self.job, consistency=consistency_to_proto(mode, staleness),
            quota=mg.JobQuota(max_bytes=quota_bytes)), timeout, idempotent=True)
        return resp.token

    def end_job(self, timeout: float | None = None) -> None:
        self._call("EndJob", self._manager.EndJob, mg.EndJobRequest(job=self.job), timeout, idempotent=True)

    def join(self, name: str = "", rank_hint: int = -1, previous_session: str = "",
             heartbeat: bool = True, timeout: float | None = None) -> Membership:
        """Join the job's worker group; starts a background heartbeat (about once a second)
        that keeps the membership lease and reports ``self.progress``."""
        resp = self._call("JoinWorkerGroup", self._manager.JoinWorkerGroup, mg.JoinWorkerGroupRequest(
            job=self.job, name=name, rank_hint=rank_hint, previous_session=previous_session), timeout)
        self.membership = Membership(resp.rank, resp.session, resp.incarnation,
                                     len(resp.group.members), resp.restored)
        with self._seq_lock:
            self._next_seq, self._in_flight = 1, set()
        self.refresh_map(min_epoch=resp.epoch)
        if heartbeat and self._heartbeat is None:
            self._heartbeat_every = resp.heartbeat_seconds or 1.0
            self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="ps-heartbeat",
                                               daemon=True)
            self._heartbeat.start()
        return self.membership

    def leave(self, timeout: float | None = None) -> None:
        """Leave the worker group (SYNC/BOUNDED groups stop waiting for this worker)."""
        m = self.membership
        self._stop.set()
        if m is not None:
            self._call("LeaveWorkerGroup", self._manager.LeaveWorkerGroup,
                       mg.LeaveWorkerGroupRequest(job=self.job, session=m.session), timeout,
                       idempotent=True)
            self.membership = None

    def heartbeat(self, timeout: float | None = None) -> mg.WorkerHeartbeatResponse:
        m = self.membership
        if m is None:
            raise FailedPrecondition("not a member of a worker group: call join() first")
        resp = self._call("WorkerHeartbeat", self._manager.WorkerHeartbeat, mg.WorkerHeartbeatRequest(
            job=self.job, session=m.session, incarnation=m.incarnation,
            step=int(self.progress["step"]), samples_per_second=float(self.progress["samples_per_second"]),
            loss=float(self.progress["loss"])), timeout or 5.0, idempotent=True)
        self.checkpoint_request = resp.checkpoint_id
        if resp.world_size != m.world_size or resp.rank != m.rank:
            self.membership = Membership(resp.rank, m.session, m.incarnation, resp.world_size, m.restored)
        if resp.epoch > self._map.epoch:
            self.refresh_map()
        return resp

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self._heartbeat_every):
            try:
                self.heartbeat()
            except NotFound as exc:
                log.error("worker membership lost (%s): rejoining", exc.message)
                try:
                    m = self.membership
                    self.join(previous_session=m.session if m else "", heartbeat=False)
                except ShardpsError as exc2:
                    log.error("rejoin failed: %s", exc2.message)
            except ShardpsError as exc:
                log.debug("heartbeat failed: %s", exc.message)

    # ================================================================== checkpoints
    def checkpoint_barrier(self, step: int, worker_state: bytes, checkpoint_id: str = "",
                           timeout: float | None = 300.0) -> str:
        """This worker's part of a checkpoint: blocks until every live worker arrived and the
        checkpoint is written; returns its path. ``checkpoint_id``: ``step-<S>`` (periodic,
        the default) or the id from ``checkpoint_request`` (on demand)."""
        m = self.membership
        if m is None:
            raise FailedPrecondition("checkpoint_barrier needs a group member: call join() first")
        resp = self._call("CheckpointBarrier", self._manager.CheckpointBarrier, mg.CheckpointBarrierRequest(
            job=self.job, session=m.session, step=step, worker_state=worker_state,
            checkpoint_id=checkpoint_id or f"step-{step}"), timeout)
        if checkpoint_id and checkpoint_id == self.checkpoint_request:
            self.checkpoint_request = ""
        return resp.path

    def worker_state(self, timeout: float | None = None) -> tuple[bytes, int]:
        """This rank's local state from the checkpoint the job was restored from, and its step."""
        m = self.membership
        if m is None:
            raise FailedPrecondition("worker_state needs a group member: call join() first")
        resp = self._call("GetWorkerState", self._manager.GetWorkerState,
                          mg.GetWorkerStateRequest(job=self.job, rank=m.rank), timeout, idempotent=True)
        return resp.worker_state, resp.step

    def checkpoint(self, directory: str = "", timeout: float | None = 600.0) -> mg.CheckpointResponse:
        """Admin: cut a consistent checkpoint of this job now (live workers join in)."""
        return self._call("Checkpoint", self._manager.Checkpoint,
                          mg.CheckpointRequest(job=self.job, directory=directory), timeout)

    def restore(self, path: str = "", timeout: float | None = 600.0) -> mg.RestoreResponse:
        """Admin: recreate this job's tables from a checkpoint onto the current servers."""
        resp = self._call("Restore", self._manager.Restore, mg.RestoreRequest(job=self.job, path=path), timeout)
        self.refresh_map(min_epoch=resp.epoch)
        return resp

    def drain_server(self, name: str, timeout: float | None = None) -> mg.DrainServerResponse:
        """Admin: move every block off server ``name`` (in the background), then retire it."""
        return self._call("DrainServer", self._manager.DrainServer, mg.DrainServerRequest(name=name), timeout,
                          idempotent=True)

    def cluster_status(self, timeout: float | None = None) -> mg.ClusterStatus:
        return self._call("GetClusterStatus", self._manager.GetClusterStatus,
                          mg.GetClusterStatusRequest(), timeout, idempotent=True)

    # ================================================================== tables
    def create_table(self, spec: TableSpec, optimizer: OptimizerConfig | None = None,
                     allow_non_finite: bool = False, timeout: float | None = None) -> TableView:
        """Create a table (idempotent for an identical spec; AlreadyExists otherwise)."""
        config = TableConfig(optimizer or OptimizerConfig(), allow_non_finite)
        spec.validate()
        config.validate()
        resp = self._call("CreateTable", self._manager.CreateTable, mg.CreateTableRequest(
            job=self.job, spec=spec_to_proto(spec), config=config_to_proto(config)), timeout, idempotent=True)
        view = self.refresh_map(min_epoch=resp.epoch)
        return view.table(self.job, spec.name)

    def create_dense(self, name: str, shape, optimizer: OptimizerConfig | None = None,
                     init: Initializer | None = None, block_size: int = 0, **kw) -> TableView:
        return self.create_table(dense_table(name, shape, init, block_size), optimizer, **kw)

    def create_sparse(self, name: str, dim: int, num_rows: int = 0, optimizer: OptimizerConfig | None = None,
                      init: Initializer | None = None, num_blocks: int = 0, **kw) -> TableView:
        return self.create_table(sparse_table(name, dim, num_rows, init, num_blocks), optimizer, **kw)

    def table(self, name: str) -> TableView:
        """The table's spec, config and placement from the client's map (refreshed if unknown)."""
        try:
            return self._view().table(self.job, name)
        except NotFound:
            return self.refresh_map().table(self.job, name)

    def tables(self) -> list[TableView]:
        view = self.refresh_map()
        return [t for (j, _), t in sorted(view.tables.items()) if j == self.job]

    def update_config(self, name: str, timeout: float | None = None, **changes) -> TableConfig:
        """Change optimizer hyperparameters (``lr=0.01``, ``momentum=...``) while training runs;
        returns after every server installed the new config: the next push uses it."""
        import dataclasses
        t = self.refresh_map().table(self.job, name)
        allow = changes.pop("allow_non_finite", t.config.allow_non_finite)
        optimizer = dataclasses.replace(t.config.optimizer, **changes)
        config = TableConfig(optimizer, allow)
        resp = self._call("UpdateTableConfig", self._manager.UpdateTableConfig, mg.UpdateTableConfigRequest(
            job=self.job, table=name, config=config_to_proto(config)), timeout)
        self.refresh_map()
        from shardps.convert import config_from_proto
        return config_from_proto(resp)

    def delete_table(self, name: str, timeout: float | None = None) -> None:
        self._call("DeleteTable", self._manager.DeleteTable,
                   mg.DeleteTableRequest(job=self.job, table=name), timeout, idempotent=True)

    # ================================================================== data: dense
    def pull_dense(self, table: str, start: int = 0, stop: int | None = None,
                   timeout: float | None = None) -> np.ndarray:
        """Values of the flat range [start, stop) (default: the whole table, returned in the
        table's shape; a sub-range is returned flat). float32."""
        return self._pull_dense_call(table, start, stop, timeout)()

    def _pull_dense_call(self, table: str, start: int = 0, stop: int | None = None,
                         timeout: float | None = None):
        t = self.table(table)
        whole = start == 0 and stop is None
        stop = t.spec.numel if stop is None else stop
        _check_dense(t, start, stop)
        piece = Piece(0, table, True, start, stop)

        def run():
            res = self._pull([piece], [np.empty(stop - start, np.float32)], timeout)
            out = res.values[0]
            return out.reshape(t.spec.shape) if whole else out
        return run

    def pull_dense_async(self, table: str, start: int = 0, stop: int | None = None,
                         timeout: float | None = None) -> futures.Future:
        return self._calls.submit(self._pull_dense_call(table, start, stop, timeout))

    def push_dense(self, table: str, grad, start: int = 0, timeout: float | None = None,
                   clock: int | None = None) -> PushResult:
        """Push a gradient for the flat range starting at ``start`` (``grad`` of any shape)."""
        return self._push_dense_call(table, grad, start, timeout, clock)()

    def _push_dense_call(self, table: str, grad, start: int = 0, timeout: float | None = None,
                         clock: int | None = None):
        t = self.table(table)
        values = _as_float32(grad).reshape(-1)
        _check_dense(t, start, start + values.shape[0])
        piece = Piece(0, table, True, start, start + values.shape[0], values=values)
        return functools.partial(self._push, [piece], ps.GRADIENT, timeout, clock, False)

    def push_dense_async(self, table: str, grad, start: int = 0, timeout: float | None = None,
                         clock: int | None = None) -> futures.Future:
        return self._calls.submit(self._push_dense_call(table, grad, start, timeout, clock))

    def initialize_dense(self, table: str, values, timeout: float | None = None) -> PushResult:
        """Write the initial values of an ASSIGNED table (the first writer wins; later calls
        are acknowledged and ignored). ``values`` covers the whole table."""
        t = self.table(table)
        flat = _as_float32(values).reshape(-1)
        if flat.shape[0] != t.spec.numel:
            raise InvalidArgument(f"initial values of {table!r} have {flat.shape[0]} elements; "
                                  f"the table has {t.spec.numel}")
        return self._push([Piece(0, table, True, 0, flat.shape[0], values=flat)], ps.INITIALIZE,
                          timeout, None, False)

    # ================================================================== data: sparse
    def pull_rows(self, table: str, ids, timeout: float | None = None) -> np.ndarray:
        """Rows of ``ids`` (int64, any order, repeats allowed): float32 ``[len(ids), dim]``.
        Each distinct id travels once; never-pushed rows come back at their initial value."""
        return self._pull_rows_call(table, ids, timeout)()

    def _pull_rows_call(self, table: str, ids, timeout: float | None = None):
        t = self.table(table)
        unique, spread = _distinct(_as_ids(ids, t))
        piece = Piece(0, table, False, ids=unique, positions=np.arange(unique.shape[0]))

        def run():
            out = np.empty((unique.shape[0], t.spec.dim), np.float32)
            return spread(self._pull([piece], [out], timeout).values[0])
        return run

    def pull_rows_async(self, table: str, ids, timeout: float | None = None) -> futures.Future:
        return self._calls.submit(self._pull_rows_call(table, ids, timeout))

    def push_rows(self, table: str, ids, grads, timeout: float | None = None,
                  clock: int | None = None) -> PushResult:
        """Push gradient rows for ``ids`` (repeated ids are summed before sending)."""
        return self._push_rows_call(table, ids, grads, timeout, clock)()

    def _push_rows_call(self, table: str, ids, grads, timeout: float | None = None,
                        clock: int | None = None):
        t = self.table(table)
        ids = _as_ids(ids, t)
        grads = _as_float32(grads).reshape(ids.shape[0], t.spec.dim) if ids.shape[0] else \
            np.empty((0, t.spec.dim), np.float32)
        ids, grads = coalesce(ids, grads)
        piece = Piece(0, table, False, ids=ids, positions=np.arange(ids.shape[0]), values=grads)
        return functools.partial(self._push, [piece], ps.GRADIENT, timeout, clock, False)

    # ================================================================== data: several tables

    def push_rows_async(self, table: str, ids, grads, timeout: float | None = None,
                        clock: int | None = None) -> futures.Future:
        return self._calls.submit(self._push_rows_call(table, ids, grads, timeout, clock))

    def pull_many(self, requests: Sequence[tuple], timeout: float | None = None) -> PullResult:
        """Pull several tables in one round: ``requests`` are ``(table,)`` (whole dense table),
        ``(table, start, stop)`` or ``(table, ids)``. Returns values in request order (dense
        whole tables in their shape; sparse rows ``[len(ids), dim]``)."""
        return self._pull_many_call(requests, timeout)()

    def _pull_many_call(self, requests: Sequence[tuple], timeout: float | None = None):
        pieces, outputs, finish = [], [], []
        for i, req in enumerate(requests):
            t = self.table(req[0])
            if t.spec.kind is TableKind.DENSE:
                start, stop = (req[1], req[2]) if len(req) == 3 else (0, t.spec.numel)
                _check_dense(t, start, stop)
                pieces.append(Piece(i, t.name, True, start, stop))
                outputs.append(np.empty(stop - start, np.float32))
                shape = t.spec.shape if len(req) == 1 else None
                finish.append(lambda v, shape=shape: v.reshape(shape) if shape else v)
            else:
                unique, spread = _distinct(_as_ids(req[1], t))
                pieces.append(Piece(i, t.name, False, ids=unique, positions=np.arange(unique.shape[0])))
                outputs.append(np.empty((unique.shape[0], t.spec.dim), np.float32))
                finish.append(spread)

        def run():
            res = self._pull(pieces, outputs, timeout)
            res.values = [f(v) for f, v in zip(finish, res.values)]
            return res
        return run

    def pull_many_async(self, requests: Sequence[tuple], timeout: float | None = None) -> futures.Future:
        return self._calls.submit(self._pull_many_call(requests, timeout))

    def push_many(self, requests: Sequence[tuple], timeout: float | None = None,
                  clock: int | None = None, report_step: bool = False) -> PushResult:
        """Push several tables as one push (one sequence number): ``(table, grad)`` (dense,
        whole table), ``(table, grad, start)`` or ``(table, ids, grads)`` (sparse).
        ``report_step``: also report step ``clock`` to every server (SYNC / BOUNDED groups)."""
        return self._push_many_call(requests, timeout, clock, report_step)()

    def _push_many_call(self, requests: Sequence[tuple], timeout: float | None = None,
                        clock: int | None = None, report_step: bool = False):
        pieces = []
        for i, req in enumerate(requests):
            t = self.table(req[0])
            if t.spec.kind is TableKind.DENSE:
                values = _as_float32(req[1]).reshape(-1)
                start = req[2] if len(req) > 2 else 0
                _check_dense(t, start, start + values.shape[0])
                pieces.append(Piece(i, t.name, True, start, start + values.shape[0], values=values))
            else:
                ids = _as_ids(req[1], t)
                grads = _as_float32(req[2]).reshape(ids.shape[0], t.spec.dim)
                ids, grads = coalesce(ids, grads)
                pieces.append(Piece(i, t.name, False, ids=ids, positions=np.arange(ids.shape[0]),
                                    values=grads))
        return functools.partial(self._push, pieces, ps.GRADIENT, timeout, clock, report_step)

    def push_many_async(self, requests: Sequence[tuple], timeout: float | None = None,
                        clock: int | None = None, report_step: bool = False) -> futures.Future:
        return self._calls.submit(self._push_many_call(requests, timeout, clock, report_step))

    def report_step(self, clock: int, timeout: float | None = None) -> None:
        """Tell every server this worker finished step ``clock`` without sending data."""
        self._push([], ps.GRADIENT, timeout, clock, True)

    def server_clock(self, timeout: float | None = None) -> int:
        """The group's step as the servers see it (the largest applied / slowest clock)."""
        view = self._view()
        best = 0
        for name in live_servers(view):
            header = self._header(view, 0)
            stream = self._pool.get(view.address(name)).Pull(
                ps.PullRequest(header=header), timeout=timeout or self.timeout, metadata=self._metadata)
            for chunk in stream:
                h = chunk.parse_header(ps.PullHeader)
                if h is not None:
                    best = max(best, int(h.min_clock))
        return best

    # ================================================================== export
    def state_dict(self, tables: Iterable[str] | None = None, timeout: float | None = None) -> dict:
        """The job's tables as plain arrays: dense tables in their shape; sparse tables as
        ``{name}.ids`` (int64, sorted) and ``{name}.rows`` (``[n, dim]``): every stored row."""
        out = {}
        names = list(tables) if tables is not None else [t.name for t in self.tables()]
        for name in names:
            t = self.table(name)
            if t.spec.kind is TableKind.DENSE:
                out[name] = self.pull_dense(name, timeout=timeout)
            else:
                ids, rows = self._pull_stored(name, timeout)
                out[f"{name}.ids"], out[f"{name}.rows"] = ids, rows
        return out

    def _pull_stored(self, table: str, timeout: float | None) -> tuple[np.ndarray, np.ndarray]:
        """Every stored row of a sparse table; the whole export restarts if the map changes."""
        t = self.table(table)
        deadline = self._deadline(timeout)
        while True:
            try:
                res = self._pull([Piece(0, table, False, all_stored=True)], [None],
                                 max(0.001, deadline - time.monotonic()))
                break
            except _RETRYABLE:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)
                self.refresh_map()
        ids, rows = res.values[0]
        order = np.argsort(ids)
        return ids[order], rows.reshape(-1, t.spec.dim)[order]

    # ================================================================== the data path
    def _header(self, view: ShardMapView, sequence: int, clock: int | None = None) -> pb.RequestHeader:
        m = self.membership
        with self._seq_lock:
            acked_below = min(self._in_flight) if self._in_flight else self._next_seq
        return pb.RequestHeader(job=self.job, epoch=view.epoch, session=m.session if m else "",
                                incarnation=m.incarnation if m else 0, sequence=sequence,
                                acked_below=acked_below if m else 0,
                                clock=self.clock if clock is None else clock,
                                wire_dtype=self.wire_dtype.value)

    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + (self.timeout if timeout is None else timeout)

    def _run_pieces(self, pieces: list[Piece], deadline: float, send, extra_servers=()):
        """Route pieces, call ``send(server, address, pieces, view)`` per server in parallel,
        and re-route what a server refused until it succeeds or the deadline passes."""
        view = self._view()
        pending = route(view, self.job, pieces)
        for s in extra_servers:
            pending.setdefault(s, [])
        delay = 0.02
        attempt = 0
        while True:
            errors: dict[str, ShardpsError] = {}
            items = list(pending.items())

            def one(item):
                server, ps_ = item
                return send(server, view.address(server), ps_, view)

            if len(items) == 1:
                outcomes = [_capture(one, items[0])]
            else:
                outcomes = [f.result() for f in [self._rpcs.submit(_capture, one, it) for it in items]]
            retry: list[Piece] = []
            retry_servers: list[str] = []
            for (server, ps_), (ok, value) in zip(items, outcomes):
                if ok:
                    continue
                retryable = (isinstance(value, _RETRYABLE + (DeadlineExceeded,))
                             and not any(p.all_stored for p in ps_))
                if retryable and time.monotonic() < deadline:
                    errors[server] = value
                    retry.extend(ps_)
                    if not ps_:
                        retry_servers.append(server)
                    continue
                if isinstance(value, _RETRYABLE + (DeadlineExceeded,)) and time.monotonic() >= deadline:
                    raise DeadlineExceeded(f"gave up at the deadline after {attempt + 1} attempts: "
                                           f"{value.message}") from value
                raise value
            if not errors:
                return
            attempt += 1
            for e in errors.values():
                self.metrics.retries.labels(type(e).__name__).inc()
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())) * (0.5 + random.random()))
            delay = min(delay * 2, 0.5)
            # wait (briefly) for a newer map: after a failover it arrives as soon as the
            # manager publishes it; otherwise retry with the map we have
            try:
                view = self.refresh_map(min_epoch=view.epoch + 1,
                                        timeout=max(0.05, min(1.0, deadline - time.monotonic())))
            except (DeadlineExceeded, Unavailable):
                view = self._view()
            try:
                pending = route(view, self.job, retry)
            except Unavailable:
                # a block has no live replica in this map yet: wait for the manager
                if time.monotonic() >= deadline:
                    raise
                pending = {}
                retry_servers = []
                errors_pending = retry
                while not pending and time.monotonic() < deadline:
                    time.sleep(0.2)
                    try:
                        view = self.refresh_map(timeout=max(0.05, min(1.0, deadline - time.monotonic())))
                        pending = route(view, self.job, errors_pending)
                    except (DeadlineExceeded, Unavailable):
                        continue
                if not pending:
                    raise
            alive = set(live_servers(view))
            for s in retry_servers:
                if s in alive:
                    pending.setdefault(s, [])

    # --- the same-host fast path ---
    def _shared_memory_for(self, address: str, nbytes: int):
        """A shared-memory region of ``nbytes`` for a call to ``address``, or None when the
        payload is small or the server cannot map our memory (another host or container).
        Each region is proved to each server once (the server binds it to this job)."""
        if self._shm is None or nbytes < SHM_MIN_BYTES or self._shm_ok.get(address) is False:
            return None
        region = self._shm.acquire(nbytes)
        if (address, region.name) in self._shm_proved:
            return region
        if self._probe_shared_memory(address, region):
            self._shm_proved.add((address, region.name))
            self._shm_ok[address] = True
            return region
        self._shm_ok[address] = False
        self._shm.release(region)
        return None

    def _probe_shared_memory(self, address: str, region) -> bool:
        nonce = os.urandom(16)
        region.view(0, 16)[:] = nonce
        try:
            resp = self._pool.get(address).ProbeSharedMemory(
                ps.ProbeSharedMemoryRequest(ref=pb.SharedMemoryRef(name=region.name, offset=0, length=16),
                                            nonce=nonce, job=self.job), timeout=5.0, metadata=self._metadata)
        except grpc.RpcError:
            return False
        if not resp.usable:
            log.debug("shared memory with %s unusable: %s", address, resp.reason)
        return resp.usable

    # --- pull ---
    def _pull(self, pieces: list[Piece], outputs: list, timeout: float | None) -> PullResult:
        deadline = self._deadline(timeout)
        self.last_wait = 0.0
        versions: dict[tuple[str, int], int] = {}
        lock = threading.Lock()
        stored: dict[int, list] = {}
        result = PullResult(outputs, versions)

        def send(server: str, address: str, ps_: list[Piece], view: ShardMapView) -> None:
            header = self._header(view, 0)
            request = ps.PullRequest(header=header, chunk_bytes=self.chunk_bytes)
            ids = []
            for p in ps_:
                seg = request.segments.add(table=p.table)
                if p.all_stored:
                    seg.rows.all_stored = True
                elif p.dense:
                    seg.range.start, seg.range.stop = p.start, p.stop
                else:
                    seg.rows.count = p.rows
                    ids.append(p.ids.astype("<i8", copy=False))
            if ids:
                request.data = b"".join(byte_view(a) for a in ids)
            started = time.perf_counter()
            code = "OK"
            item = self.wire_dtype.itemsize
            expected = None if any(p.all_stored for p in ps_) else sum(
                (p.stop - p.start) * item if p.dense else p.rows * view.table(self.job, p.table).spec.dim * item
                for p in ps_)
            region = self._shared_memory_for(address, expected) if expected else None
            if region is not None:
                request.reply_shared_memory.name = region.name
                request.reply_shared_memory.length = region.size
            try:
                stream = self._pool.get(address).Pull(request, timeout=_attempt_timeout(deadline, expected or 0),
                                                      metadata=self._metadata)
                head, payload = _collect(stream)
                if head.in_shared_memory:
                    payload = _Payload([region.view(0, head.payload_bytes)])
                return self._place(server, ps_, head, payload, header, outputs, versions, stored, lock, result)
            except grpc.RpcError as err:
                code = err.code().name
                raise from_rpc_error(err, f"pull from {server}") from None
            finally:
                payload = None
                if region is not None:
                    self._shm.release(region)
                self._observe("shardps.v1.ParameterServer", "Pull", "server_stream", code, started)

        self._run_pieces(pieces, deadline, send)
        for item, got in stored.items():
            ids = np.concatenate([g[0] for g in got]) if got else np.empty(0, np.int64)
            rows = np.concatenate([g[1] for g in got]) if got else np.empty(0, np.float32)
            outputs[item] = (ids, rows)
        return result

    def _place(self, server, ps_, head, payload, header, outputs, versions, stored, lock, result) -> None:
        """Copy a pull's payload into the caller's outputs (and record versions and clocks)."""
        self.metrics.bytes.labels("pulled").inc(len(payload))
        self.metrics.rows.labels("pulled").inc(sum(p.rows for p in ps_))
        if head.min_clock or header.session:
            self.last_staleness = max(0, self.clock - int(head.min_clock))
        self.last_wait = max(self.last_wait, head.waited_seconds)
        for p, layout in zip(ps_, head.segments):
            wire = WireDType.parse(int(layout.dtype))
            got_ids = None
            if layout.ids:
                got_ids = np.frombuffer(payload.read(int(layout.ids) * 8), dtype="<i8").copy()
            count = int(layout.elements)
            if p.dense and not p.all_stored and wire is WireDType.FLOAT32:
                out = outputs[p.item][p.offset:p.offset + (p.stop - p.start)]
                if out.size != count or not out.flags.c_contiguous:
                    raise Unavailable(f"pull from {server}: {count} values for a range of {out.size}")
                payload.read_into(byte_view(out))          # straight into the result
                continue
            values = dtypes.decode(payload.read(count * wire.itemsize), wire, count)
            if p.all_stored:
                with lock:
                    stored.setdefault(p.item, []).append((got_ids, values.copy()))
            elif p.dense:
                outputs[p.item][p.offset:p.offset + (p.stop - p.start)] = values
            else:
                outputs[p.item][p.positions] = values.reshape(p.rows, -1)
        if payload.consumed != len(payload):
            raise Unavailable(f"pull from {server}: payload has {len(payload)} bytes; "
                              f"the header describes {payload.consumed}")
        with lock:
            for v in head.versions:
                versions[(v.table, v.block)] = v.version
                self._versions[(v.table, v.block)] = v.version
            result.min_clock = max(result.min_clock, int(head.min_clock))

    def _add_base_versions(self, seg, p: Piece, view: ShardMapView) -> None:
        """The versions at which this worker last pulled the blocks it now pushes: the servers
        measure how many updates arrived in between (shardps_push_intervening_updates)."""
        if not self._versions or not p.dense:
            return        # sparse pushes skip it: finding their blocks costs a hash per row
        spec = view.table(self.job, p.table).spec
        blocks = range(p.start // spec.block_size, (p.stop - 1) // spec.block_size + 1)
        for b in blocks:
            v = self._versions.get((p.table, b))
            if v is not None:
                seg.base_versions.add(table=p.table, block=b, version=v)

    # --- push ---
    def _push(self, pieces: list[Piece], kind: int, timeout: float | None, clock: int | None,
              report_step: bool) -> PushResult:
        deadline = self._deadline(timeout)
        with self._seq_lock:
            seq = self._next_seq if self.membership is not None else 0
            if seq:
                self._next_seq += 1
                self._in_flight.add(seq)
        result = PushResult()
        lock = threading.Lock()

        def send(server: str, address: str, ps_: list[Piece], view: ShardMapView) -> None:
            header = ps.PushHeader(header=self._header(view, seq, clock), kind=kind)
            arrays = []
            rows = sparse_bytes = 0
            for p in ps_:
                seg = header.segments.add(table=p.table)
                self._add_base_versions(seg, p, view)
                if p.dense:
                    seg.range.start, seg.range.stop = p.start, p.stop
                    arrays.append(dtypes.encode(p.values, self.wire_dtype))
                else:
                    seg.rows.count = p.rows
                    rows += p.rows
                    arrays.append(np.ascontiguousarray(p.ids, dtype="<i8"))
                    arrays.append(dtypes.encode(p.values, self.wire_dtype))
                    sparse_bytes += arrays[-1].nbytes + arrays[-2].nbytes
            header.payload_bytes = sum(a.nbytes for a in arrays)
            region = self._shared_memory_for(address, header.payload_bytes)
            if region is not None:          # same host: write the bytes once, send a reference
                view = region.view(0, header.payload_bytes)
                write_into(view, arrays)
                del view
                header.shared_memory.name = region.name
                header.shared_memory.length = header.payload_bytes
                arrays = []
            head = header.SerializeToString()

            def chunks():
                first = head
                for piece in split_payload(arrays, self.chunk_bytes):
                    yield encode_chunk(first, piece)
                    first = None
                if first is not None:
                    yield encode_chunk(first, None)

            started = time.perf_counter()
            code = "OK"
            try:
                ack = self._pool.get(address).Push(chunks(), timeout=_attempt_timeout(deadline, header.payload_bytes),
                                                   metadata=self._metadata)
            except grpc.RpcError as err:
                code = err.code().name
                raise from_rpc_error(err, f"push to {server}") from None
            finally:
                if region is not None:
                    self._shm.release(region)
                self._observe("shardps.v1.ParameterServer", "Push", "client_stream", code, started)
            self.metrics.bytes.labels("pushed").inc(header.payload_bytes)
            self.metrics.rows.labels("pushed").inc(rows)
            self.metrics.sparse_bytes.labels("pushed").inc(sparse_bytes)
            with lock:
                for v in ack.versions:
                    result.versions[(v.table, v.block)] = v.version
                result.duplicate_blocks += ack.duplicate_blocks

        extra = live_servers(self._view()) if report_step else ()
        try:
            self._run_pieces(pieces, deadline, send, extra_servers=extra)
        finally:
            if seq:
                with self._seq_lock:
                    self._in_flight.discard(seq)
        return result


# ====================================================================== helpers
_MODES = {"async": Consistency.ASYNC, "asp": Consistency.ASYNC, "sync": Consistency.SYNC,
          "bsp": Consistency.SYNC, "ssp": Consistency.BOUNDED, "bounded": Consistency.BOUNDED}


def parse_consistency(text: str) -> Consistency:
    mode = _MODES.get(str(text).lower())
    if mode is None:
        raise InvalidArgument(f"consistency {text!r}: use async, sync or ssp")
    return mode


def _capture(fn, arg):
    try:
        return True, fn(arg)
    except ShardpsError as exc:
        return False, exc
    except Exception as exc:          # a bug: surface it with its type
        return False, exc


class _Payload:
    """The data of a pull response as the chunks that carried it, read in order without
    assembling them first: a read inside one chunk is zero-copy, ``read_into`` copies chunk
    pieces straight into the caller's array."""

    def __init__(self, pieces: list):
        self.pieces = pieces
        self.total = sum(len(p) for p in pieces)
        self._i = 0
        self._pos = 0
        self.consumed = 0

    def __len__(self) -> int:
        return self.total

    def read(self, n: int):
        if n == 0:
            return memoryview(b"")
        piece = self.pieces[self._i] if self._i < len(self.pieces) else memoryview(b"")
        if self._pos + n <= len(piece):
            out = piece[self._pos:self._pos + n]
            self._advance(n)
            return out
        out = bytearray(n)
        self.read_into(memoryview(out))
        return memoryview(out)

    def read_into(self, dest: memoryview) -> None:
        filled, n = 0, len(dest)
        while filled < n:
            if self._i >= len(self.pieces):
                raise Unavailable(f"pull payload ended {n - filled} bytes short")
            piece = self.pieces[self._i]
            take = min(n - filled, len(piece) - self._pos)
            dest[filled:filled + take] = piece[self._pos:self._pos + take]
            filled += take
            self._advance(take)

    def _advance(self, n: int) -> None:
        self._pos += n
        self.consumed += n
        while self._i < len(self.pieces) and self._pos >= len(self.pieces[self._i]):
            self._pos -= len(self.pieces[self._i])
            self._i += 1


def _collect(stream) -> tuple[ps.PullHeader, _Payload]:
    header = None
    pieces = []
    for chunk in stream:
        if chunk.header is not None:
            if header is not None:
                raise Unavailable("pull stream carried two headers")
            header = ps.PullHeader.FromString(chunk.header)
        if len(chunk.data):
            pieces.append(chunk.data)
    if header is None:
        raise Unavailable("pull stream ended without a header")
    return header, _Payload(pieces)


def _as_float32(values) -> np.ndarray:
    if hasattr(values, "detach"):            # a torch tensor: no torch import needed here
        values = values.detach().cpu().numpy()
    return np.ascontiguousarray(values, dtype=np.float32)


def _distinct(ids: np.ndarray):
    """(each distinct id once, ascending; a function taking their rows to the rows of
    ``ids``). Ids already distinct and ascending (e.g. from ``torch.unique``) are neither
    sorted again nor gathered afterwards."""
    if ids.shape[0] <= 1 or bool(np.all(ids[1:] > ids[:-1])):
        return ids, lambda rows: rows
    unique, inverse = np.unique(ids, return_inverse=True)
    return unique, lambda rows: rows[inverse]


def _as_ids(ids, t: TableView) -> np.ndarray:
    if hasattr(ids, "detach"):
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu":
        raise InvalidArgument(f"ids for table {t.name!r} must be integers, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr.reshape(-1), dtype=np.int64)


def _check_dense(t: TableView, start: int, stop: int) -> None:
    if t.spec.kind is not TableKind.DENSE:
        raise InvalidArgument(f"table {t.name!r} is sparse: use pull_rows / push_rows")
    if not (0 <= start < stop <= t.spec.numel):
        raise InvalidArgument(f"range [{start}, {stop}) of table {t.name!r}: must satisfy "
                              f"0 <= start < stop <= {t.spec.numel}")
