"""The verifier's cluster: ``LocalCluster`` processes and the faults done to them.

Every fault is a signal to a real process (SIGKILL, SIGSTOP / SIGCONT) or a restart under
the same name (a new incarnation). ``RssSampler`` records each server process's resident
memory from /proc, per pid, so a restarted server is a new series.
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.rpc.channels import channel
from shardps.rpc.status import translated
from shardps.tools.local import LocalCluster
from shardps.tools.netproxy import TcpProxy
from shardps.tools.verify.defects import ENV
from shardps.tools.verify.etcd import EtcdProcess, find_etcd

log = logging.getLogger("shardps.tools.verify")


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass
class RssSeries:
    name: str
    pid: int
    started: float                                 # monotonic
    samples: list[tuple[float, int]] = field(default_factory=list)


ETCD_PREFIX = "/verify"


class VerifyCluster:
    """A manager and ``servers`` servers (R = ``replication``) as child processes; with
    ``managers`` > 1, that many manager replicas on a real etcd (``etcd_binary``), each
    reaching it through its own ``TcpProxy`` so that one can be cut off from etcd."""

    def __init__(self, servers: int, replication: int, lease: float, forward_timeout: float,
                 defect: str = "", work_dir: str | None = None, managers: int = 1,
                 etcd_binary: str = ""):
        env = dict(os.environ)
        env.pop(ENV, None)
        if defect:
            env[ENV] = defect
        self.names = [f"s{i}" for i in range(servers)]
        self.replication = replication
        self.lease = lease
        self.etcd: EtcdProcess | None = None
        self.proxies: list[TcpProxy] = []
        replicas: list[tuple[str, ...]] = []
        if managers > 1:
            work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="shardps-verify-etcd-"))
            work.mkdir(parents=True, exist_ok=True)
            self.etcd = EtcdProcess(etcd_binary or find_etcd(), work)
            self.proxies = [TcpProxy(("127.0.0.1", self.etcd.client_port)) for _ in range(managers)]
            replicas = [("--etcd", f"http://{p.address}", "--etcd-prefix", ETCD_PREFIX,
                         "--leader-lease-seconds", "2") for p in self.proxies]
        self.local = LocalCluster(servers=servers, replication=replication, work_dir=work_dir,
                                  server_lease_seconds=lease, env=env,
                                  server_args=("--forward-timeout", str(forward_timeout)),
                                  manager_replicas=replicas)
        self.killed_manager = -1             # the replica a `manager` fault killed (HA)
        self.cut_manager = -1                # the replica cut off from etcd
        self.down: set[str] = set()          # killed and not restarted
        self.paused: set[str] = set()
        self.lock = threading.Lock()
        self.rss: dict[int, RssSeries] = {}

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        self.local.start()                   # etcd (with --managers) answered when constructed

    def stop(self, keep_logs: bool = False) -> None:
        """Stop every process; remove the work dir unless ``keep_logs`` (a failed run)."""
        for name in list(self.paused):
            self.resume(name)
        self.local.stop()
        for proxy in self.proxies:
            proxy.close()
        if self.etcd is not None:
            self.etcd.stop()
        if not keep_logs:
            self.local.cleanup()

    @property
    def manager_address(self) -> str:
        return self.local.manager_address

    @property
    def work_dir(self) -> str:
        return str(self.local.work_dir)

    def live(self) -> list[str]:
        """Servers neither killed nor paused."""
        return [n for n in self.names if n not in self.down and n not in self.paused]

    # ------------------------------------------------------------------ faults
    def kill(self, name: str) -> None:
        """kill -9 a server."""
        proc = self.local.servers[name]
        if name in self.paused:
            self.resume(name)
        self.local.kill(proc, signal.SIGKILL)
        self.down.add(name)

    def restart(self, name: str, timeout: float = 60.0) -> None:
        """Start a (killed) server again under its name: it registers as a new incarnation."""
        proc = self.local.servers.get(name)
        if proc is not None and proc.alive:
            self.local.kill(proc, signal.SIGKILL)
        self.local.start_server(name, timeout=timeout)
        self.down.discard(name)

    def pause(self, name: str) -> None:
        self.local.servers[name].popen.send_signal(signal.SIGSTOP)
        self.paused.add(name)

    def resume(self, name: str) -> None:
        proc = self.local.servers[name]
        if proc.alive:
            proc.popen.send_signal(signal.SIGCONT)
        self.paused.discard(name)

    def leader_index(self, timeout: float = 30.0) -> int:
        """The replica that leads now (waits for an election)."""
        assert self.etcd is not None
        deadline = time.monotonic() + timeout
        while True:
            address = self.etcd.leader(ETCD_PREFIX)
            if address in self.local.replica_addresses:
                return self.local.replica_addresses.index(address)
            if time.monotonic() > deadline:
                raise TimeoutError(f"no manager replica leads after {timeout:g}s")
            time.sleep(0.05)

    def kill_manager(self) -> None:
        """kill -9 the manager (the leading replica, with replicas)."""
        if self.etcd is None:
            assert self.local.manager is not None
            self.local.kill(self.local.manager, signal.SIGKILL)
            return
        self.killed_manager = self.leader_index()
        proc = self.local.replicas[self.killed_manager]
        assert proc is not None
        self.local.kill(proc, signal.SIGKILL)

    def start_manager(self) -> None:
        """Start the killed manager (replica) again."""
        if self.etcd is None:
            self.local.start_manager()
        elif self.killed_manager >= 0:
            self.local.start_replica(self.killed_manager)
            self.killed_manager = -1

    def cut_leader_from_etcd(self) -> None:
        """Cut the leading replica's link to etcd (it stays reachable to everyone else)."""
        self.cut_manager = self.leader_index()
        self.proxies[self.cut_manager].cut()

    def heal_etcd(self) -> None:
        if self.cut_manager >= 0:
            self.proxies[self.cut_manager].heal()
            self.cut_manager = -1

    def managers_alive(self) -> bool:
        """Whether every manager process runs (a killed one not restarted yet: False)."""
        procs = [p for p in self.local.replicas] if self.etcd is not None else [self.local.manager]
        return all(p is not None and p.alive for p in procs)

    def server_pid(self, name: str) -> int:
        return self.local.servers[name].popen.pid

    # ------------------------------------------------------------------ observation
    def sample_rss(self) -> None:
        now = time.monotonic()
        for name in self.names:
            proc = self.local.servers.get(name)
            if proc is None or not proc.alive or name in self.paused or not proc.info:
                continue
            pid = proc.popen.pid
            series = self.rss.get(pid)
            if series is None:
                series = self.rss[pid] = RssSeries(name, pid, now)     # warm-up counts from here
            value = rss_bytes(pid)
            if value:
                series.samples.append((now, value))


    def server_call(self, name: str, method: str, request, response_cls, timeout: float = 10.0):
        """One unary ``ParameterServer`` call to server ``name``; ``ShardpsError`` on failure
        (its ``status`` and ``details`` say what gRPC reported)."""
        with channel(self.local.servers[name].address) as ch, translated(f"{method} on server {name}"):
            call = ch.unary_unary(f"/shardps.v1.ParameterServer/{method}",
                                  request_serializer=type(request).SerializeToString,
                                  response_deserializer=response_cls.FromString)
            return call(request, timeout=timeout)

    def block_digests(self, name: str, timeout: float = 10.0) -> ps.GetBlockDigestsResponse:
        """Every block replica server ``name`` holds, with its digest (``GetBlockDigests``)."""
        return self.server_call(name, "GetBlockDigests", ps.GetBlockDigestsRequest(),
                                ps.GetBlockDigestsResponse, timeout)

    def node_status(self, name: str, timeout: float = 10.0) -> ps.NodeStatus:
        return self.server_call(name, "GetNodeStatus", ps.GetNodeStatusRequest(), ps.NodeStatus, timeout)


@dataclass
class Placement:
    """What the manager says about replication (``ClusterStatus``)."""

    under_replicated: int
    pending_moves: int
    serving: list[str]
    dead: list[str]
    epoch: int


def placement(client, timeout: float = 5.0) -> Placement:
    st = client.cluster_status(timeout=timeout)
    return Placement(int(st.under_replicated_blocks), int(st.pending_moves),
                     sorted(s.server.name for s in st.servers if s.server.state == pb.SERVING),
                     sorted(s.server.name for s in st.servers if s.server.state == pb.DEAD),
                     int(st.epoch))
