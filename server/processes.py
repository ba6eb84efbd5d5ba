"""Wiring of the two server-side processes: ``shardps manager`` and ``shardps server``.

Each starts a gRPC server (the service, standard health and reflection), a Prometheus
/metrics endpoint, and its background loops; ``stop`` undoes all of it. Both can also run
inside a test process (several at once: nothing is global).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import start_http_server

from shardps.errors import FailedPrecondition, InvalidArgument, ShardpsError
from shardps.metrics import ManagerMetrics, NodeMetrics
from shardps.protos.v1 import manager_pb2 as mg
from shardps.rpc import channels
from shardps.rpc.failover import LeaderGate
from shardps.rpc.peers import NodePeers
from shardps.rpc.status import translated
from shardps.rpc.stubs import GrpcPeers, ManagerStub, StubPool
from shardps.server.manager.checkpoints import CheckpointCoordinator
from shardps.server.manager.ending import JobEnding
from shardps.server.manager.etcd_store import EtcdClient
from shardps.server.manager.records import ManagerSettings
from shardps.server.manager.replica import ManagerReplica
from shardps.server.manager.runtime import ManagerRuntime, RuntimeSettings
from shardps.server.manager.service import SERVICE as MANAGER_SERVICE
from shardps.server.manager.service import ResourceManagerService
from shardps.server.node import NodeLimits, ServerNode
from shardps.server.node.cold import cold_root
from shardps.server.node_service import SERVICE as NODE_SERVICE
from shardps.server.node_service import ParameterServerService
from shardps.settings import ManagerProcessSettings, ServerProcessSettings, Serving

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

log = logging.getLogger("shardps.process")


def advertised(serving: Serving, port: int) -> str:
    """The address others reach this process at: ``--advertise`` (HOST:PORT as given; a bare
    HOST gets the port bound, for ``--listen HOST:0``), else the listen address."""
    if serving.advertise:
        bare = ":" not in serving.advertise or serving.advertise.endswith("]")
        return f"{serving.advertise}:{port}" if bare else serving.advertise
    host = serving.listen.rsplit(":", 1)[0]
    if host in ("0.0.0.0", "[::]", ""):
        host = socket.gethostname()
    return f"{host}:{port}"


def _start_metrics(serving: Serving, registry) -> tuple[WSGIServer | None, str]:
    if serving.metrics_port < 0:
        return None, ""
    server, _thread = start_http_server(serving.metrics_port, addr=serving.metrics_host, registry=registry)
    port = server.server_address[1]
    host = serving.metrics_host if serving.metrics_host not in ("0.0.0.0", "::") else "127.0.0.1"
    return server, f"{host}:{port}"


def _write_ready(path: str, info: dict) -> None:
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)


class _Serving:
    """Common gRPC + health + metrics scaffolding."""

    def __init__(self, serving: Serving, tls, service_name: str, handler, registry, grpc_metrics):
        self.serving = serving
        self.service_name = service_name
        self.server = channels.new_server(serving.threads, handlers=[handler])
        self.health = channels.add_health_and_reflection(self.server, [service_name])
        self.port = channels.add_port(self.server, serving.listen, tls)
        self.health_server = None
        if tls is not None and serving.health_port >= 0:
            # Kubernetes gRPC probes cannot speak TLS: health also on a plaintext port
            self.health_server = channels.new_server(2)
            channels.add_health(self.health_server, self.health)
            self.health_port = channels.add_port(self.health_server, f"0.0.0.0:{serving.health_port}")
        self.metrics_server, self.metrics_address = _start_metrics(serving, registry)
        self.address = advertised(serving, self.port)

    def start(self) -> None:
        self.server.start()
        if self.health_server is not None:
            self.health_server.start()

    def set_serving(self, serving: bool) -> None:
        channels.set_serving(self.health, [self.service_name], serving)

    def stop(self, grace: float = 1.0) -> None:
        self.set_serving(False)
        self.server.stop(grace).wait(grace + 1)
        if self.health_server is not None:
            self.health_server.stop(0)
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()


class ManagerProcess:
    """The resource manager: state, reconcile loop, gRPC service, metrics.

    Embedded (the default): the state in ``--state-dir`` (or memory), one process. With
    ``--etcd``: one replica of several sharing their state in etcd (``manager/replica.py``):
    it serves only while it leads, and refuses calls naming the leader meanwhile."""

    def __init__(self, settings: ManagerProcessSettings, authenticate=None, tls=None, metadata=()):
        self.settings = settings
        self.metrics = ManagerMetrics()
        self._authenticate = authenticate
        self._tls = tls
        self._metadata = tuple(metadata)
        self.replica: ManagerReplica | None = None
        self._term: _ManagerTerm | None = None
        self.finished = threading.Event()       # --exit-when-job-ends: the job ended, servers told
        self._stopped = threading.Event()
        if settings.exit_when_job_ends and settings.etcd:
            raise InvalidArgument("--exit-when-job-ends is for a one-job cluster's single manager, not "
                                  "with --etcd")
        if settings.etcd:
            gate = LeaderGate(MANAGER_SERVICE, lambda: "")
            self.net = _Serving(settings.serving, tls, MANAGER_SERVICE, gate,
                                self.metrics.registry, self.metrics.grpc)
            self.replica = ManagerReplica(
                EtcdClient(settings.etcd), settings.etcd_prefix, self.net.address, MANAGER_SERVICE,
                self._build_term, ttl=settings.leader_lease_seconds, gate=gate, on_role=self._on_role)
        else:
            state_path = str(Path(settings.state_dir) / "manager-state.json") if settings.state_dir else ""
            self._term = _ManagerTerm(self, RuntimeSettings(state_path=state_path), None)
            self.net = _Serving(settings.serving, tls, MANAGER_SERVICE, self._term.handler,
                                self.metrics.registry, self.metrics.grpc)

    def _build_term(self, store) -> "_ManagerTerm":
        term = _ManagerTerm(self, RuntimeSettings(), store)
        term.runtime.start()
        self._term = term
        return term

    def _on_role(self, leading: bool) -> None:
        channels.set_serving(self.net.health, [MANAGER_SERVICE], leading, overall=False)

    @property
    def runtime(self) -> ManagerRuntime:
        """The runtime of the current term (embedded: the only one). With --etcd, the last
        term's, until this replica first leads: AttributeError."""
        if self._term is None:
            raise AttributeError("this manager replica has not led yet: it has no runtime")
        return self._term.runtime

    @property
    def service(self) -> ResourceManagerService:
        if self._term is None:
            raise AttributeError("this manager replica has not led yet: it has no service")
        return self._term.service

    @property
    def address(self) -> str:
        return self.net.address

    def start(self) -> "ManagerProcess":
        if self.settings.replication < 2:
            log.warning("replication %d: every block has one copy, so a server's death loses the "
                        "values of the blocks it held (they are restored from the job's latest "
                        "checkpoint where there is one; else requests touching them fail with "
                        "DATA_LOSS). Run with --replication 2 (and two or more servers) to survive it",
                        self.settings.replication)
        self.net.start()
        if self.replica is not None:
            channels.set_serving(self.net.health, [], True)   # alive; the service only while leading
            self.replica.start()
        else:
            self.runtime.start()
            self.net.set_serving(True)
        if self.settings.exit_when_job_ends:
            self.service.ending = ending = JobEnding(self.settings.exit_when_job_ends)
            threading.Thread(target=self._end_with_job, args=(ending,), name="job-ending", daemon=True).start()
        log.info("manager serving on %s (metrics %s)%s", self.address, self.net.metrics_address or "off",
                 f"; state in etcd {self.settings.etcd}, campaigning" if self.replica else "")
        _write_ready(self.settings.serving.ready_file,
                     {"role": "manager", "address": self.address, "metrics": self.net.metrics_address,
                      "pid": os.getpid()})
        return self

    def _end_with_job(self, ending: JobEnding) -> None:
        """--exit-when-job-ends: once the job ended, retire every server (its next heartbeat
        says so) and set ``finished`` when each live one has heard, or their leases ran out."""
        rt = self.runtime
        while not self._stopped.wait(0.2):
            with rt.lock:
                jobs = set(rt.state.jobs)
            if ending.job_ended(jobs):
                break
        else:
            return
        log.info("job %s ended: every server is told to exit, then this manager exits", ending.job)
        ending.close()
        deadline = time.monotonic() + 2 * self.settings.server_lease_seconds + 1.0
        while time.monotonic() < deadline and not self._stopped.wait(0.2):
            with rt.lock:
                live = [name for name, rec in rt.state.servers.items() if rec.live]
            if ending.may_exit(live):
                break
        self.finished.set()

    def stop(self) -> None:
        self._stopped.set()
        self.net.stop()
        if self.replica is not None:
            self.replica.stop()
        elif self._term is not None:
            self._term.stop()


class _ManagerTerm:
    """What a manager runs while it serves: the runtime over the state of ``store`` (None:
    ``runtime``'s state file or memory) and the gRPC service over it."""

    def __init__(self, proc: ManagerProcess, runtime: RuntimeSettings, store):
        s = proc.settings
        self.runtime = ManagerRuntime(
            ManagerSettings(replication=s.replication, server_lease_seconds=s.server_lease_seconds,
                            worker_lease_seconds=s.worker_lease_seconds),
            runtime, metrics=proc.metrics, pool=StubPool(tls=proc._tls, metadata=proc._metadata),
            store=store)
        checkpoints = CheckpointCoordinator(self.runtime, s.checkpoint_dir)
        self.runtime.after_tick.append(checkpoints.recover_lost)      # lost blocks, from checkpoints
        self.service = ResourceManagerService(
            self.runtime, checkpoints,
            token_key=s.serving.token_keys(), token_ttl_seconds=s.token_ttl_seconds,
            revocations=getattr(proc._authenticate, "revocations", None))
        self.handler = self.service.handler(proc.metrics.grpc, proc._authenticate)

    def stop(self) -> None:
        self.runtime.stop()


def _data_plane(settings: ServerProcessSettings, service: ParameterServerService, address: str,
                tls, authenticate):
    """The server's data plane (``shardps.rpc.dataplane``) on the gRPC listener's host, with
    the same TLS certificates and credential check; None when ``data_plane_port`` is -1.
    Clients learn its address from OpenDataPlane (advertised host, the data plane's port)."""
    if settings.data_plane_port < 0:
        return None
    from shardps.rpc.dataplane import DataPlaneServer, server_ssl_context
    host = settings.serving.listen.rsplit(":", 1)[0] or "0.0.0.0"
    server = DataPlaneServer(service.data_plane, host.strip("[]"), settings.data_plane_port,
                             server_ssl_context(tls) if tls is not None else None,
                             authenticate=authenticate, step_handler=service.steps.frame)
    service.data_plane_address = f"{address.rsplit(':', 1)[0]}:{server.port}"
    service.data_plane_max_frame_bytes = server.limits.max_frame_bytes
    return server


def _peers(name: str, address_of, pool: StubPool, timeout: float, tls, metadata) -> NodePeers:
    """How a node reaches its peers: replication over their data planes, the rest (and
    peers without one) over gRPC, with the node's TLS and credential."""
    from shardps.rpc.dataplane import DataPlanePool
    planes = DataPlanePool.for_tls(tls, connections_per_address=8, metadata=metadata, connect_timeout=timeout)
    return NodePeers(GrpcPeers(name, address_of, pool, timeout), planes)


class _ManagerCallFailed(Exception):
    """A call of the server to the manager failed with ``error`` (a ShardpsError): kept apart
    from the errors the node raises itself, since only the manager's FailedPrecondition
    fences the server."""

    def __init__(self, error: ShardpsError):
        super().__init__(error.message)
        self.error = error


class ServerProcess:
    """A server node: registers with the manager, heartbeats, serves its blocks."""

    def __init__(self, settings: ServerProcessSettings, authenticate=None, tls=None, metadata=()):
        self.settings = settings
        self.metrics = NodeMetrics()
        self.pool = StubPool(tls=tls, metadata=metadata)
        name = settings.name or socket.gethostname()
        try:
            cold_dir = cold_root(settings.cold_dir)
        except ValueError as e:
            raise SystemExit(f"shardps server: {e}") from None
        self.node = ServerNode(
            name, limits=NodeLimits(max_request_bytes=settings.max_request_bytes,
                                    max_rows=settings.max_rows,
                                    forward_timeout=settings.forward_timeout),
            metrics=self.metrics, defect=settings.test_defect, cold_dir=cold_dir)
        self.peers = _peers(name, self.node.view_address, self.pool, settings.forward_timeout, tls, metadata)
        self.node.peers = self.peers
        self.service = ParameterServerService(self.node)
        from shardps.server.node.admission import Admission
        self.service.admission = Admission(settings.job_max_requests_per_second,
                                           settings.job_max_bytes_in_flight, where=f"server {name}")
        self.net = _Serving(settings.serving, tls, NODE_SERVICE,
                            self.service.handler(self.metrics.grpc, authenticate),
                            self.metrics.registry, self.metrics.grpc)
        self.data_plane = _data_plane(settings, self.service, self.net.address, tls, authenticate)
        self._update_revocations = getattr(authenticate, "update_revocations", None)
        self._tls = tls
        self._metadata = tuple(metadata)
        self._manager = channels.manager_channel(settings.manager, tls)
        self._manager_stub = ManagerStub(self._manager)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sync_thread: threading.Thread | None = None
        self._stall_thread: threading.Thread | None = None
        self._wanted_epoch = 0
        self._wanted = threading.Condition()
        self.boot_id = secrets.token_hex(8)
        self.heartbeat_seconds = 0.5
        self.retired = threading.Event()

    @property
    def address(self) -> str:
        return self.net.address

    @property
    def name(self) -> str:
        return self.node.name

    def start(self, wait_registered: float | None = 60.0) -> "ServerProcess":
        if self.data_plane is not None:
            self.data_plane.start()
        self.net.start()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()
        self._sync_thread = threading.Thread(target=self._sync_maps, name="map-sync", daemon=True)
        self._sync_thread.start()
        self._stall_thread = threading.Thread(target=self._watch_stalls, name="stall-watch", daemon=True)
        self._stall_thread.start()
        if wait_registered:
            deadline = time.monotonic() + wait_registered
            while self.node.incarnation == 0 and time.monotonic() < deadline and not self._stop.is_set():
                time.sleep(0.02)
        return self

    def _call_manager(self, method, request):
        """``method`` (a ``ManagerStub`` callable) with a 5 s timeout; its failure raises
        ``_ManagerCallFailed``."""
        try:
            with translated("manager"):
                return method(request, timeout=5.0, metadata=self._metadata)
        except ShardpsError as error:
            raise _ManagerCallFailed(error) from None

    def _register_once(self) -> None:
        sent = self.node.liveness.heartbeat_sent(time.monotonic())
        resp = self._call_manager(self._manager_stub.RegisterServer, mg.RegisterServerRequest(
            name=self.node.name, address=self.address, metrics_address=self.net.metrics_address,
            boot_id=self.boot_id, accepts_map_changes=True))
        self.node.reset(resp.incarnation)
        self.node.install_map(resp.map)
        self.heartbeat_seconds = resp.heartbeat_seconds or 0.5
        if resp.lease_seconds:
            self.node.liveness.configure(resp.lease_seconds, self.heartbeat_seconds, time.monotonic())
        self.node.liveness.heartbeat_answered(sent, resp.map.epoch)
        self.net.set_serving(True)
        log.info("server %s registered (incarnation %d) at %s, epoch %d", self.node.name,
                 resp.incarnation, self.address, self.node.epoch)
        _write_ready(self.settings.serving.ready_file,
                     {"role": "server", "name": self.node.name, "address": self.address,
                      "metrics": self.net.metrics_address, "pid": os.getpid()})

    def _run(self) -> None:
        registered = False
        warned = 0.0
        while not self._stop.is_set():
            try:
                if not registered:
                    self._register_once()
                    registered = True
                self._beat()
            except _ManagerCallFailed as failed:
                error = failed.error
                if isinstance(error, FailedPrecondition):
                    log.warning("fenced by the manager (%s): dropping state and registering again",
                                error.message)
                    self.boot_id = secrets.token_hex(8)
                    self.net.set_serving(False)
                    registered = False
                    continue
                if time.monotonic() - warned > 10:
                    log.warning("manager unreachable (%s); serving the current map meanwhile",
                                error.message)
                    warned = time.monotonic()
            except ShardpsError as exc:
                log.warning("heartbeat: %s", exc.message)
            except Exception:
                log.exception("heartbeat loop error")
            self._stop.wait(self.heartbeat_seconds if registered else 0.5)

    def _beat(self) -> None:
        u = self.node.usage()
        now = time.monotonic()
        if now - getattr(self, "_usage_published", 0.0) > 5.0:
            self._usage_published = now
            self.node.publish_usage(u)
        sent = self.node.liveness.heartbeat_sent(time.monotonic())
        resp = self._call_manager(self._manager_stub.ServerHeartbeat, mg.ServerHeartbeatRequest(
            name=self.node.name, incarnation=self.node.incarnation, epoch=self.node.epoch,
            primary_blocks=u["primary_blocks"], replica_blocks=u["backup_blocks"], bytes=u["bytes"]))
        self.node.liveness.heartbeat_answered(sent, resp.epoch)
        if self._update_revocations is not None:     # revoked job tokens: refused from now on
            self._update_revocations(resp.token_floors)
        if resp.retired:
            if not self.retired.is_set():
                log.info("server %s was retired (drained, or its cluster's one job ended): exiting", self.node.name)
                self.retired.set()
                self.net.set_serving(False)
            return
        if resp.epoch > self.node.epoch:
            # installing waits for in-flight requests: never on the heartbeat thread, whose
            # lease must not lapse meanwhile
            with self._wanted:
                self._wanted_epoch = max(self._wanted_epoch, resp.epoch)
                self._wanted.notify_all()

    def _watch_stalls(self) -> None:
        """Tick the node's ``liveness`` five times a second (a tick long after the last one
        is a stall of this process: ``server.node.liveness``), and log each stall noticed."""
        live = self.node.liveness
        logged = 0
        while not self._stop.wait(0.2):
            live.tick(time.monotonic())
            stall = live.last_stall
            if live.stalls > logged and stall is not None:
                logged = live.stalls
                log.warning("server %s did not run for %.1f s: refusing data requests until the manager "
                            "answers a heartbeat", self.node.name, stall.lasted)

    def _sync_maps(self) -> None:
        """Fetch and install maps the heartbeats found newer than ours."""
        while not self._stop.is_set():
            with self._wanted:
                while self._wanted_epoch <= self.node.epoch and not self._stop.is_set():
                    self._wanted.wait(timeout=0.5)
                want = self._wanted_epoch
            if self._stop.is_set():
                return
            try:
                known = self.node.epoch
                get_map = self._manager_stub.GetShardMap
                msg = self._call_manager(get_map, mg.GetShardMapRequest(min_epoch=want, known_epoch=known))
                try:
                    self.node.install_map(msg)
                except FailedPrecondition:     # installed another epoch meanwhile: the whole map
                    self.node.install_map(self._call_manager(get_map, mg.GetShardMapRequest(min_epoch=want)))
            except _ManagerCallFailed as failed:
                log.debug("map fetch failed: %s", failed.error.details)
                self._stop.wait(0.2)

    def stop(self) -> None:
        self._stop.set()
        with self._wanted:
            self._wanted.notify_all()
        self.net.stop()
        if self.data_plane is not None:
            self.data_plane.stop(grace=1.0)
        for t in (self._thread, self._sync_thread, self._stall_thread):
            if t is not None:
                t.join(timeout=1)     # a heartbeat in flight must not delay the stop
        self._manager.close()
        self.peers.close()
        self.pool.close()
