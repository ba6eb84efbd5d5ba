"""The manager calls of one job: jobs, tables, the shard map, checkpoints, status, drains.

``Admin.call`` is the one way to the manager: it honours the call's deadline, retries the
idempotent calls after UNAVAILABLE, counts the call in ``grpc_client_*`` metrics and raises
``ShardpsError`` (``shardps.rpc.status.translated``). ``Admin`` also keeps the client's shard map, the
only state the data path reads from the manager.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import operator
import threading
import time
from typing import TYPE_CHECKING, Callable, Sequence

from shardps import mapdelta
from shardps.errors import DeadlineExceeded, InvalidArgument, NotFound, ShardpsError
from shardps.metrics import WorkerMetrics
from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import manager_pb2 as mg
from shardps.rpc import channels
from shardps.rpc.convert import config_from_proto, config_to_proto, consistency_to_proto, spec_to_proto
from shardps.rpc.status import translated
from shardps.rpc.stubs import MANAGER, ManagerStub
from shardps.shardmap import GroupView, ShardMapView, TableView
from shardps.tables import (
    Consistency,
    Initializer,
    LifecyclePolicy,
    OptimizerConfig,
    TableConfig,
    TableSpec,
)
from shardps.worker.client import notices, requests

if TYPE_CHECKING:
    from shardps.worker.client.membership import GroupMember  # it imports this module

log = logging.getLogger("shardps.client")


def check_name(name) -> str:
    """A table name argument: InvalidArgument unless it is a string (the manager checks the
    rest of the name's rule, ``shardps.names``)."""
    if not isinstance(name, str):
        raise InvalidArgument(f"table name {name!r}: must be a string")
    return name


def parse_consistency(text: str) -> Consistency:
    """``async``/``asp``, ``sync``/``bsp`` or ``ssp``/``bounded`` (any case); InvalidArgument
    otherwise (``Consistency.parse``)."""
    return Consistency.parse(text)


def _restated(exc: ShardpsError, message: str) -> ShardpsError:
    """``exc`` with another message: its class, ``status`` and ``details`` kept."""
    out = type(exc)(message)
    out.status, out.details = exc.status, exc.details
    return out


def table_config(spec: TableSpec, optimizer: OptimizerConfig | None = None, allow_non_finite: bool = False,
                 lifecycle: LifecyclePolicy | None = None) -> TableConfig:
    """The config ``create_table`` asks for, its arguments checked with ``spec``:
    InvalidArgument naming the table for any that is not what it should be."""
    for what, value, cls in (("optimizer", optimizer, OptimizerConfig), ("lifecycle", lifecycle, LifecyclePolicy)):
        if value is not None and not isinstance(value, cls):
            raise InvalidArgument(f"table {spec.name!r}: {what}={value!r} must be a {cls.__name__} "
                                  f"(or None)")
    if not isinstance(allow_non_finite, bool):
        raise InvalidArgument(f"table {spec.name!r}: allow_non_finite={allow_non_finite!r} must be "
                              f"True or False")
    config = TableConfig(optimizer or OptimizerConfig(), allow_non_finite, lifecycle=lifecycle or LifecyclePolicy())
    spec.validate()
    config.validate()
    return config


def changed_config(t: TableView, changes: dict) -> TableConfig:
    """Table ``t``'s config with ``changes`` (optimizer hyperparameters, ``allow_non_finite``,
    ``lifecycle``) applied, checked: InvalidArgument naming the table and the setting."""
    name, changes = t.name, dict(changes)
    settable = sorted({f.name for f in dataclasses.fields(OptimizerConfig)} - {"kind"})
    unknown = sorted(set(changes) - set(settable) - {"allow_non_finite", "lifecycle"})
    if unknown:
        raise InvalidArgument(f"update_config of table {name!r}: unknown setting(s) {unknown}; "
                              f"the settable ones are {settable + ['allow_non_finite', 'lifecycle']}")
    allow = changes.pop("allow_non_finite", t.config.allow_non_finite)
    lifecycle = changes.pop("lifecycle", t.config.lifecycle)
    if not isinstance(allow, bool):
        raise InvalidArgument(f"update_config of table {name!r}: allow_non_finite={allow!r} must be "
                              f"True or False")
    if not isinstance(lifecycle, LifecyclePolicy):
        raise InvalidArgument(f"update_config of table {name!r}: lifecycle={lifecycle!r} must be a "
                              f"LifecyclePolicy")
    optimizer = dataclasses.replace(t.config.optimizer, **changes)
    config = dataclasses.replace(t.config, optimizer=optimizer, allow_non_finite=allow,
                                 lifecycle=lifecycle, version=0)
    config.validate()
    return config


class Admin:
    """Manager calls of job ``job``. Every call blocks for at most ``timeout`` seconds
    (default ``default_timeout``) and raises ``ShardpsError``, never ``grpc.RpcError``.
    Thread-safe. ``closed``: once set (the client closes), retries stop."""

    def __init__(self, address: str, job: str, stub: ManagerStub, metrics: WorkerMetrics, *,
                 metadata=(), default_timeout: float = 30.0, closed: threading.Event | None = None,
                 unreachable: channels.UnreachableWarnings | None = None):
        self.address = ",".join(channels.manager_targets(address))     # each with its port
        self.job = job
        self.stub = stub
        self.metrics = metrics
        self.metadata = tuple(metadata)
        self.default_timeout = default_timeout
        self.closed = closed or threading.Event()
        # says every few seconds that the manager cannot be reached, while it cannot
        self.unreachable = unreachable or channels.UnreachableWarnings(f"the manager at {self.address}")
        self._map = ShardMapView()
        self._map_lock = threading.Lock()
        # called with (old, new) each time the client's map moves forward, outside the lock
        self.map_listeners: list[Callable[[ShardMapView, ShardMapView], object]] = [self._report_losses]

    # ================================================================== the one call
    def call(self, what: str, fn, request, timeout: float | None = None, *, idempotent: bool = False):
        """A unary manager call that honours its deadline, errors translated.

        ``idempotent`` calls (reads, heartbeats, creations of an identical job or table,
        deletions; see manager.proto) are retried after UNAVAILABLE with jittered backoff
        until the deadline: the manager may be restarting or briefly unreachable. The others
        are sent once, but only when a connection exists (``wait_for_ready``: a call that was
        never sent cannot have been executed), so they too wait for a manager that is slow
        to accept instead of failing at once. ``closed`` ends the retries. While attempts keep
        failing with UNAVAILABLE, across calls, a WARNING every few seconds names the manager's
        address and what to check (``channels.UnreachableWarnings``)."""
        timeout = timeout or self.default_timeout
        started = time.perf_counter()
        code = "OK"
        attempts = 0

        def attempt(left: float, **kw):
            nonlocal attempts
            attempts += 1
            try:
                with translated(what, f"the manager at {self.address}"):
                    reply = fn(request, timeout=left, metadata=self.metadata, **kw)
            except ShardpsError as err:
                self.unreachable.attempted(err)     # a warning every few seconds while unreachable
                raise
            self.unreachable.answered()
            return reply

        try:
            if idempotent:
                return channels.call_with_retries(attempt, timeout, sleep=self.closed.wait)
            return attempt(timeout, wait_for_ready=True)
        except ShardpsError as exc:
            code = exc.status or "UNKNOWN"          # the metrics' label: the status the call ended with
            waited = time.perf_counter() - started
            if attempts > 1:
                exc = _restated(exc, f"{exc.message} (gave up after {attempts} attempts in {timeout:g}s)")
            elif not idempotent and isinstance(exc, DeadlineExceeded) and waited >= 0.95 * timeout:
                # this call's own deadline passed (not a deadline the manager reports)
                exc = _restated(exc, f"{exc.message} (waited {timeout:g}s for the manager at "
                                     f"{self.address}: is it running and reachable, or is the "
                                     f"timeout too short for this call?)")
            raise exc from None
        finally:
            g = self.metrics.grpc
            g.started.labels(MANAGER, what, "unary").inc()
            g.handled.labels(MANAGER, what, "unary", code).inc()
            g.handling.labels(MANAGER, what, "unary").observe(time.perf_counter() - started)

    # ================================================================== shard map
    @property
    def shard_map(self) -> ShardMapView:
        """The newest shard map this client has (epoch 0 before the first fetch)."""
        return self._map

    def refresh_map(self, min_epoch: int = 0, timeout: float | None = None) -> ShardMapView:
        """Fetch the published shard map (waiting for ``min_epoch`` if given): its changes
        since the map this client holds, and only this job's tables and group. The client's
        map only moves forward: an older answer leaves the newer map in place. When it moves,
        ``map_listeners`` are called with the old and the new map (errors are logged)."""
        known = self._map
        msg = self.call("GetShardMap", self.stub.GetShardMap, mg.GetShardMapRequest(
            min_epoch=min_epoch, known_epoch=known.epoch, job=self.job), timeout, idempotent=True)
        if msg.HasField("changes") and msg.epoch > known.epoch:
            try:
                msg = mapdelta.apply(known.msg, msg)
            except mapdelta.StaleBase:          # another thread moved the map meanwhile
                msg = self.call("GetShardMap", self.stub.GetShardMap, mg.GetShardMapRequest(
                    min_epoch=min_epoch, job=self.job), timeout, idempotent=True)
        with self._map_lock:
            old = self._map
            if msg.epoch > old.epoch and not msg.HasField("changes"):
                self._map = ShardMapView(msg)
            new = self._map
        if new is not old:
            for listener in list(self.map_listeners):
                try:
                    listener(old, new)
                except Exception:
                    log.exception("a shard-map listener failed (epoch %d -> %d)", old.epoch, new.epoch)
        return new

    def data_loss(self) -> list[pb.DataLoss]:
        """This job's blocks lost with their servers and what became of them, from the
        client's map (``DataLoss`` in common.proto)."""
        group = self._map.groups.get(self.job)
        return list(group.data_loss) if group is not None else []

    def _report_losses(self, old: ShardMapView, new: ShardMapView) -> None:
        """Log each loss of this job's blocks, and its recovery, once, when a map shows it."""
        for level, message in notices.losses(self.job, old, new):
            log.log(level, "%s", message)

    def cluster_map(self, timeout: float | None = None) -> ShardMapView:
        """The whole published map, every job's tables and groups (a job token still gets
        its own job's only). For tools and operators: not the map this client routes with,
        and not kept."""
        msg = self.call("GetShardMap", self.stub.GetShardMap, mg.GetShardMapRequest(), timeout,
                        idempotent=True)
        return ShardMapView(msg)

    def view(self) -> ShardMapView:
        """The client's map, fetched first if it has none yet."""
        if self._map.epoch == 0:
            self.refresh_map()
        return self._map

    # ================================================================== jobs
    def create_job(self, consistency: str | Consistency = "async", staleness: int = 0,
                   quota_bytes: int = 0, timeout: float | None = None,
                   token_ttl_seconds: float = 0.0) -> str:
        """Create this job (idempotent with the same consistency). Returns its token (empty
        when the cluster runs without authentication), valid for ``token_ttl_seconds``
        (0: the manager's default, ``--token-ttl-seconds``)."""
        mode = Consistency.parse(consistency)
        resp = self.call("CreateJob", self.stub.CreateJob, mg.CreateJobRequest(
            job=self.job, consistency=consistency_to_proto(mode, staleness),
            quota=mg.JobQuota(max_bytes=quota_bytes), token_ttl_seconds=token_ttl_seconds),
            timeout, idempotent=True)
        said = None if resp.created else notices.existing_job(self.job, self.refresh_map(), int(resp.step))
        if said is not None:
            log.log(said[0], "%s", said[1])
        return resp.token

    def end_job(self, timeout: float | None = None) -> None:
        self.call("EndJob", self.stub.EndJob, mg.EndJobRequest(job=self.job), timeout, idempotent=True)

    # ================================================================== tables
    def create_table(self, spec: TableSpec, optimizer: OptimizerConfig | None = None,
                     allow_non_finite: bool = False, timeout: float | None = None,
                     lifecycle: LifecyclePolicy | None = None) -> TableView:
        """Create a table (idempotent for an identical spec; AlreadyExists otherwise) and
        wait for the shard map that places it. ``lifecycle``: a sparse table's memory budget,
        admission and TTL (docs/memory-budget.md)."""
        return self.create_tables([(spec, table_config(spec, optimizer, allow_non_finite, lifecycle))], timeout)[0]

    def create_tables(self, tables: list[tuple[TableSpec, TableConfig]], timeout: float | None = None
                      ) -> list[TableView]:
        """Create ``tables`` ((spec, config) each, from ``table_config``) in one map change,
        all or none, each as ``create_table`` would; wait for the map that places them."""
        if not tables:
            return []
        resp = self.call("CreateTables", self.stub.CreateTables, mg.CreateTablesRequest(
            job=self.job, tables=[mg.TableDefinition(spec=spec_to_proto(spec), config=config_to_proto(config))
                                  for spec, config in tables]), timeout, idempotent=True)
        view = self.refresh_map(min_epoch=resp.epoch)
        return [view.table(self.job, spec.name) for spec, _ in tables]

    def table(self, name: str) -> TableView:
        """The table's spec, config and placement from the client's map (refreshed if
        unknown; NotFound if the manager does not know it either)."""
        if type(name) is str:                # a table of the client's map: one lookup
            t = self._map.tables.get((self.job, name))
            if t is not None:
                return t
        try:
            return self.view().table(self.job, check_name(name))
        except NotFound:
            return self.refresh_map().table(self.job, name)

    def tables_named(self, requests: list) -> list[TableView]:
        """``table`` of each request's table name (its first item), one lookup each in the map."""
        views = list(map(self._map.tables.get, zip(itertools.repeat(self.job), map(operator.itemgetter(0), requests))))
        return [v or self.table(r[0]) for v, r in zip(views, requests)] if None in views else views  # type: ignore

    def tables(self) -> list[TableView]:
        """Every table of this job, by name, from a freshly fetched map."""
        view = self.refresh_map()
        return [t for (j, _), t in sorted(view.tables.items()) if j == self.job]

    def update_config(self, name: str, timeout: float | None = None, **changes) -> TableConfig:
        """Change optimizer hyperparameters (``lr=0.01``, ``momentum=...``), and
        ``allow_non_finite`` or ``lifecycle`` (a LifecyclePolicy), while training runs; what
        is not named keeps its value. Returns after every server installed the new config:
        the next push uses it."""
        name = check_name(name)
        return self.update_configs({name: changes}, timeout)[name]

    def update_configs(self, changes: dict[str, dict], timeout: float | None = None) -> dict[str, TableConfig]:
        """``update_config`` of several tables ({name: {setting: value}}) in one map change,
        all or none; returns their new configs."""
        if not changes:
            return {}
        view = self.refresh_map()
        items = [mg.TableConfigChange(table=name, config=config_to_proto(
            changed_config(view.table(self.job, check_name(name)), settings)))
            for name, settings in changes.items()]
        resp = self.call("UpdateTableConfigs", self.stub.UpdateTableConfigs,
                         mg.UpdateTableConfigsRequest(job=self.job, changes=items), timeout)
        self.refresh_map()
        return {c.table: config_from_proto(new) for c, new in zip(items, resp.configs)}

    def set_config(self, name: str, config: TableConfig, timeout: float | None = None) -> TableConfig:
        """Install ``config`` (checked by the caller) on table ``name``; returns it as the
        manager stored it (its version set)."""
        resp = self.call("UpdateTableConfig", self.stub.UpdateTableConfig, mg.UpdateTableConfigRequest(
            job=self.job, table=name, config=config_to_proto(config)), timeout)
        self.refresh_map()
        return config_from_proto(resp)

    def delete_table(self, name: str, timeout: float | None = None) -> None:
        self.call("DeleteTable", self.stub.DeleteTable,
                  mg.DeleteTableRequest(job=self.job, table=name), timeout, idempotent=True)

    # ================================================================== operations
    def checkpoint(self, directory: str = "", timeout: float | None = 600.0) -> mg.CheckpointResponse:
        """Cut a consistent checkpoint of this job now (live workers join in)."""
        return self.call("Checkpoint", self.stub.Checkpoint,
                         mg.CheckpointRequest(job=self.job, directory=directory), timeout)

    def restore(self, path: str = "", timeout: float | None = 600.0) -> mg.RestoreResponse:
        """Recreate this job's tables from a checkpoint onto the current servers; returns
        once the map that places them is the client's."""
        resp = self.call("Restore", self.stub.Restore, mg.RestoreRequest(job=self.job, path=path), timeout)
        self.refresh_map(min_epoch=resp.epoch)
        return resp

    def reset_lost(self, table: str, timeout: float | None = None) -> int:
        """Accept the loss of ``table``'s lost blocks: they start again from their initial
        values. Returns how many were reset (0: none was lost)."""
        resp = self.call("ResetLostBlocks", self.stub.ResetLostBlocks, mg.ResetLostBlocksRequest(
            job=self.job, table=check_name(table)), timeout, idempotent=True)
        self.refresh_map(min_epoch=resp.epoch)
        return resp.blocks

    def drain_server(self, name: str, timeout: float | None = None) -> mg.DrainServerResponse:
        """Move every block off server ``name`` (in the background), then retire it."""
        return self.call("DrainServer", self.stub.DrainServer, mg.DrainServerRequest(name=name), timeout,
                         idempotent=True)

    def cluster_status(self, timeout: float | None = None) -> mg.ClusterStatus:
        return self.call("GetClusterStatus", self.stub.GetClusterStatus,
                         mg.GetClusterStatusRequest(), timeout, idempotent=True)

    def wait_for_workers(self, count: int, timeout: float | None = None) -> int:
        """Wait until the job's group has had ``count`` members at once (see PSClient): a long
        poll of the shard map, whose epoch moves with every join. Reads the group's peak, not
        its live members: the first workers may have finished and left by the time a slow one
        sees the map."""
        deadline = time.monotonic() + (self.default_timeout if timeout is None else timeout)
        view = self.refresh_map()
        while True:
            group = view.groups.get(self.job)
            joined = max(len(group.members), group.peak_members) if group is not None else 0
            if joined >= count:
                return joined
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceeded(f"{joined} of {count} workers of job {self.job!r} joined before "
                                       f"the deadline: start the others, or wait longer (timeout=)")
            try:
                view = self.refresh_map(min_epoch=view.epoch + 1, timeout=min(remaining, 30.0))
            except DeadlineExceeded:
                view = self.shard_map            # the long poll's own deadline: look again


class ManagerCalls:
    """The manager calls of ``PSClient``: jobs, tables, the shard map, operations (a mixin:
    they delegate to its ``_admin``)."""

    _admin: Admin
    _member: GroupMember

    @property
    def shard_map(self) -> ShardMapView:
        return self._admin.shard_map

    def refresh_map(self, min_epoch: int = 0, timeout: float | None = None) -> ShardMapView:
        """Fetch the published shard map (waiting for ``min_epoch`` if given)."""
        return self._admin.refresh_map(min_epoch, timeout)

    def group(self) -> GroupView | None:
        """This job's worker group (consistency, staleness, members) from the client's map,
        fetched again when that map lacks it; None before the job exists."""
        a = self._admin
        return a.shard_map.groups.get(a.job) or a.refresh_map().groups.get(a.job)

    def create_job(self, consistency: str | Consistency = "async", staleness: int = 0,
                   quota_bytes: int = 0, timeout: float | None = None, token_ttl_seconds: float = 0.0) -> str:
        """Create this client's job (idempotent with the same consistency); its token ("" without
        authentication) lasts ``token_ttl_seconds`` (0: the manager's default)."""
        return self._admin.create_job(consistency, staleness, quota_bytes, timeout, token_ttl_seconds)

    def end_job(self, timeout: float | None = None) -> None:
        self._admin.end_job(timeout)

    def checkpoint(self, directory: str = "", timeout: float | None = 600.0) -> mg.CheckpointResponse:
        """Admin: cut a consistent checkpoint of this job now (live workers join in)."""
        return self._admin.checkpoint(directory, timeout)

    def restore(self, path: str = "", timeout: float | None = 600.0) -> mg.RestoreResponse:
        """Admin: recreate this job's tables from a checkpoint onto the current servers."""
        return self._admin.restore(path, timeout)

    def drain_server(self, name: str, timeout: float | None = None) -> mg.DrainServerResponse:
        """Admin: move every block off server ``name`` (in the background), then retire it."""
        return self._admin.drain_server(name, timeout)

    def cluster_status(self, timeout: float | None = None) -> mg.ClusterStatus:
        return self._admin.cluster_status(timeout)

    def reset_lost(self, table: str, timeout: float | None = None) -> int:
        """Accept the loss of ``table``'s blocks that lost every replica (calls touching them
        raise ``DataLost`` until then): they start again from their initial values. The way
        out when the job has no checkpoint (``restore`` is the other). Returns how many."""
        return self._admin.reset_lost(table, timeout)

    @property
    def data_loss(self) -> list:
        """This job's blocks lost with their servers and their recovery (``DataLoss`` of
        common.proto: table, blocks, server, step, and the checkpoint step they were restored
        to); each is also logged once when the client's map first shows it."""
        return self._admin.data_loss()

    def wait_for_workers(self, count: int, timeout: float | None = None) -> int:
        """Block until the job's worker group has had at least ``count`` members at once (they
        may have left since: a fast worker can finish its steps before a slow one looks);
        returns how many joined. Raises DeadlineExceeded naming how many had joined. (In SYNC,
        a worker that joins late starts at the group's current step; earlier steps averaged
        over the workers present then.)"""
        return self._admin.wait_for_workers(count, timeout)

    def create_table(self, spec: TableSpec, optimizer: OptimizerConfig | None = None,
                     allow_non_finite: bool = False, timeout: float | None = None,
                     lifecycle: LifecyclePolicy | None = None) -> TableView:
        """Create a table (idempotent for an identical spec; AlreadyExists otherwise);
        ``lifecycle``: a sparse table's memory budget (docs/memory-budget.md)."""
        return self._admin.create_table(spec, optimizer, allow_non_finite, timeout, lifecycle)

    def create_tables(self, tables: Sequence[tuple[TableSpec, OptimizerConfig | None]],
                      allow_non_finite: bool = False, timeout: float | None = None) -> list[TableView]:
        """Create several tables ((spec, optimizer) each) in one map change: as
        ``create_table`` each (idempotent for identical specs), all or none. A model's
        tables together: the manager, the servers and this client handle one new map
        instead of one per table (which grows with the tables already there)."""
        return self._admin.create_tables([(spec, table_config(spec, optimizer, allow_non_finite))
                                          for spec, optimizer in tables], timeout)

    def create_dense(self, name: str, shape, optimizer: OptimizerConfig | None = None,
                     init: Initializer | None = None, block_size: int = 0, **kw) -> TableView:
        return self.create_table(requests.dense_spec(name, shape, init, block_size), optimizer, **kw)

    def create_sparse(self, name: str, dim: int, num_rows: int = 0, optimizer: OptimizerConfig | None = None,
                      init: Initializer | None = None, num_blocks: int = 0, **kw) -> TableView:
        return self.create_table(requests.sparse_spec(name, dim, num_rows, init, num_blocks), optimizer, **kw)

    def table(self, name: str) -> TableView:
        """The table's spec, config and placement from the client's map (refreshed if unknown)."""
        return self._admin.table(name)

    def tables(self) -> list[TableView]:
        return self._admin.tables()

    def cluster_map(self, timeout: float | None = None) -> ShardMapView:
        """The whole published map with every job's tables (``refresh_map`` and
        ``shard_map`` hold this client's own job's only); see ``Admin.cluster_map``."""
        return self._admin.cluster_map(timeout)

    def update_config(self, name: str, timeout: float | None = None, **changes) -> TableConfig:
        """Change optimizer hyperparameters (``lr=0.01``, ``momentum=...``) while training runs;
        returns after every server installed the new config: the next push uses it."""
        return self._admin.update_config(name, timeout, **changes)

    def update_configs(self, changes: dict[str, dict], timeout: float | None = None) -> dict[str, TableConfig]:
        """``update_config`` of several tables at once, ``{name: {"lr": 0.01, ...}}``: one
        map change for all of them, all or none (a schedule over every table of a model)."""
        return self._admin.update_configs(changes, timeout)

    def delete_table(self, name: str, timeout: float | None = None) -> None:
        self._admin.delete_table(name, timeout)

