"""``shardps local``: the whole cluster as local processes on loopback.

``LocalCluster`` starts a manager and N servers as real processes (port 0: each writes its
bound address to a ready file), waits until every one answers SERVING on the gRPC health
service, and stops them all on ``stop()``. Children die with their parent even if it is
killed (PR_SET_PDEATHSIG, ``shardps.tools.children``), so no process is ever orphaned. Tests use
the same class.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from shardps.settings import CLIENT_VARIABLES
from shardps.tools.children import child_env, stop_processes

log = logging.getLogger("shardps.tools.local")


@dataclass
class Proc:
    role: str
    name: str
    popen: subprocess.Popen
    ready_file: Path
    log_path: Path
    info: dict = field(default_factory=dict)

    @property
    def address(self) -> str:
        return self.info.get("address", "")

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None


def default_replication(servers: int) -> int:
    """R where the caller chose none: 2 wherever two or more servers run (a server's death
    then loses nothing), else 1."""
    return 2 if servers >= 2 else 1


class LocalCluster:
    """A manager and N servers as child processes. Use as a context manager."""

    def __init__(self, servers: int = 2, replication: int | None = None, work_dir: str | None = None,
                 log_format: str = "human", server_lease_seconds: float | None = None,
                 manager_args: tuple = (), server_args: tuple = (), env: dict | None = None,
                 python: str = sys.executable, stream_logs: bool = False, host_of=None, wrap=None,
                 manager_port: int = 0, tls=None, token: str = "",
                 manager_replicas: Sequence[tuple[str, ...]] = ()):
        self.n_servers = servers
        self.replication = replication or default_replication(servers)
        self._own_dir = work_dir is None
        # absolute: the processes run in it, so a relative path would be read from inside it
        self.work_dir = Path(work_dir).resolve() if work_dir else Path(tempfile.mkdtemp(prefix="shardps-local-"))
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.log_format = log_format
        self.lease = server_lease_seconds
        self.manager_args = tuple(manager_args)
        self.server_args = tuple(server_args)
        self.env = dict(os.environ if env is None else env)
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        self.python = python
        self.stream_logs = stream_logs
        # per process name: the address to listen on, and a command prefix (e.g. to run it
        # in its own network namespace with `ip netns exec NS`)
        self.host_of = host_of or (lambda name: "127.0.0.1")
        self.wrap: Callable[[str], list[str]] = wrap or (lambda name: [])
        self.manager_port = manager_port         # 0: any free port
        # how this process reaches the cluster (health checks, status): a client TlsConfig
        # and the admin token when the cluster is secured (``Secured``)
        self.tls = tls
        self.token = token
        # several manager replicas (their state in etcd): each one's extra arguments (its
        # --etcd ...); each binds a free port at its first start (a port chosen here could be
        # taken by another process before the replica binds it) and keeps it on restarts;
        # servers and clients get the list once every replica started
        self.manager_replicas = [tuple(a) for a in manager_replicas]
        host = self.host_of("manager")
        self.replica_addresses = [f"{host}:0" for _ in self.manager_replicas]
        self.replicas: list[Proc | None] = [None] * len(self.manager_replicas)
        self.manager: Proc | None = None
        self.servers: dict[str, Proc] = {}
        self.workers: list[Proc] = []
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ processes
    def _spawn(self, role: str, name: str, args: list[str], ready: bool = True,
               stdout=None, env: dict | None = None) -> Proc:
        ready_file = self.work_dir / f"{name}.ready"
        log_path = self.work_dir / f"{name}.log"
        if ready_file.exists():
            ready_file.unlink()
        cmd = list(self.wrap(name)) + [self.python, "-m", "shardps.tools.cli", role] + args
        if ready:
            cmd += ["--ready-file", str(ready_file)]
        logf = open(log_path, "ab")
        popen = subprocess.Popen(cmd, stdout=stdout if stdout is not None else logf, stderr=logf,
                                 env={**self._env_of(role), **(env or {})}, cwd=str(self.work_dir))
        logf.close()
        proc = Proc(role, name, popen, ready_file, log_path)
        log.debug("started %s %s (pid %d)", role, name, popen.pid)
        return proc

    def _env_of(self, role: str) -> dict:
        """A child's environment. This cluster's manager and servers get their TLS and token
        settings as flags (``Secured``), and so do its workers where it is not secured: a
        client's variables left in the shell (``settings.CLIENT_VARIABLES``, what `shardps
        local --secure` prints to export, and SHARDPS_TOKEN) are another cluster's, and are
        not passed on. Every other variable is (a manager's SHARDPS_TOKEN_TTL_SECONDS, ...)."""
        env = child_env(self.env)
        if role != "worker" or self.tls is None:
            for key in (*CLIENT_VARIABLES, "SHARDPS_TOKEN"):
                env.pop(key, None)
        return env

    def _wait_ready(self, proc: Proc, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not proc.alive:
                raise RuntimeError(f"{proc.role} {proc.name} exited with {proc.popen.returncode} "
                                   f"before it was ready; its log:\n{tail(proc.log_path)}")
            if proc.ready_file.exists():
                try:
                    proc.info = json.loads(proc.ready_file.read_text())
                    break
                except json.JSONDecodeError:
                    pass
            time.sleep(0.05)
        else:
            raise TimeoutError(f"{proc.role} {proc.name} not ready after {timeout}s; log:\n{tail(proc.log_path)}")
        from shardps.rpc.channels import check_health
        while time.monotonic() < deadline:
            try:
                if check_health(proc.address, timeout=2.0, tls=self.tls) == "SERVING":
                    return
            except Exception:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"{proc.role} {proc.name} at {proc.address} never reported SERVING")

    def start_replica(self, index: int, timeout: float = 60.0) -> Proc:
        """Start manager replica ``index``: on a free port the first time, then again on the
        address it bound."""
        args = ["--listen", self.replica_addresses[index], "--metrics-port", "-1",
                "--replication", str(self.replication), "--log-format", self.log_format,
                "--checkpoint-dir", str(self.work_dir / "checkpoints")]
        if self.lease is not None:
            args += ["--server-lease-seconds", str(self.lease)]
        proc = self._spawn("manager", f"m{index}", args + list(self.manager_args) + list(self.manager_replicas[index]))
        self._wait_ready(proc, timeout)
        self.replica_addresses[index] = proc.address
        self.replicas[index] = proc
        return proc

    def start_manager(self, timeout: float = 60.0) -> Proc:
        if self.manager_replicas:
            procs = [self.start_replica(i, timeout) for i in range(len(self.manager_replicas))]
            self.manager = procs[0]
            return procs[0]
        host = self.host_of("manager")
        if self.manager_port and not (self.manager and self.manager.info.get("address")):
            _check_free(host, self.manager_port)
        args = ["--listen", f"{host}:{self.manager_port}", "--metrics-port", "0", "--metrics-host", host,
                "--state-dir", str(self.work_dir / "manager-state"), "--replication", str(self.replication),
                "--checkpoint-dir", str(self.work_dir / "checkpoints"), "--log-format", self.log_format]
        if self.lease is not None:
            args += ["--server-lease-seconds", str(self.lease)]
        if self.manager and self.manager.info.get("address"):
            args[1] = self.manager.info["address"]          # a restart keeps its address
        proc = self._spawn("manager", "manager", args + list(self.manager_args))
        self._wait_ready(proc, timeout)
        self.manager = proc
        return proc

    def start_server(self, name: str, timeout: float = 60.0, wait: bool = True, extra: tuple = ()) -> Proc:
        host = self.host_of(name)
        args = ["--name", name, "--listen", f"{host}:0", "--manager", self.manager_address,
                "--metrics-port", "0", "--metrics-host", host, "--log-format", self.log_format]
        proc = self._spawn("server", name, args + list(self.server_args) + list(extra))
        with self._lock:
            self.servers[name] = proc
        if wait:
            self._wait_ready(proc, timeout)
        return proc

    def start(self, timeout: float = 90.0) -> "LocalCluster":
        try:
            self.start_manager(timeout)
            procs = [self.start_server(f"s{i}", wait=False) for i in range(self.n_servers)]
            for p in procs:
                self._wait_ready(p, timeout)
            self.wait_servers(self.n_servers, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_servers(self, count: int, timeout: float = 60.0) -> None:
        """Wait until the manager reports ``count`` servers SERVING."""
        from shardps.worker.client import PSClient
        deadline = time.monotonic() + timeout
        with PSClient(self.manager_address, "_local", timeout=5.0, token=self.token, tls=self.tls) as c:
            while True:
                st = c.cluster_status()
                if sum(1 for s in st.servers if s.server.state == 2) >= count:
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"only {sum(1 for s in st.servers if s.server.state == 2)} of "
                                       f"{count} servers SERVING after {timeout}s")
                time.sleep(0.1)

    def start_worker(self, name: str, args: list[str], stdout=subprocess.PIPE, env: dict | None = None) -> Proc:
        """Start ``shardps worker`` ``name`` with ``args`` (and ``env`` added to its environment)."""
        full = ["--manager", self.manager_address, "--name", name, "--log-format", self.log_format] + args
        proc = self._spawn("worker", name, full, ready=False, stdout=stdout, env=env)
        self.workers.append(proc)
        return proc

    @property
    def manager_address(self) -> str:
        if self.replica_addresses:
            return ",".join(self.replica_addresses)
        return self.manager.address if self.manager else ""

    def kill(self, proc: Proc, sig: int = signal.SIGKILL) -> None:
        if proc.alive:
            proc.popen.send_signal(sig)
            try:
                proc.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()

    def stop(self) -> None:
        """Stop every process (SIGTERM, then SIGKILL after 10 s); remove a temporary work dir."""
        managers = [p for p in self.replicas if p is not None] or ([self.manager] if self.manager else [])
        procs = list(self.workers) + list(self.servers.values()) + managers
        stop_processes([p.popen for p in procs], 10.0)
        for p in procs:
            for stream in (p.popen.stdout, p.popen.stderr):
                if stream is not None:
                    stream.close()

    def cleanup(self) -> None:
        if self._own_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        self.cleanup()


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _check_free(host: str, port: int) -> None:
    """Raise FailedPrecondition naming the port when something already listens on it."""
    import socket

    from shardps.errors import FailedPrecondition
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise FailedPrecondition(
                f"the manager's port {host}:{port} is taken ({exc.strerror}): is another "
                f"`shardps local` running? Stop it, or pass --port N (--port 0: any free port; "
                f"clients then need --manager / SHARDPS_MANAGER)") from None


class Secured:
    """Mutual TLS and tokens for a local cluster (``shardps local --secure``): development
    certificates, an admin token and a token key in ``directory`` (``make_dev_secrets``),
    the flags that give them to the processes, and one job's token for clients."""

    def __init__(self, directory: str | Path):
        from shardps.tools.devcerts import make_dev_secrets
        self.dir = Path(directory)
        self.paths = {k: str(v) for k, v in make_dev_secrets(self.dir).items()}

    def process_args(self) -> tuple[str, ...]:
        """Flags of the manager and the servers: their certificate, client certificates
        required, the admin token and the token key (files)."""
        p = self.paths
        return ("--tls-cert", p["server_cert"], "--tls-key", p["server_key"], "--tls-ca", p["ca"],
                "--tls-require-client-cert", "true", "--admin-token-file", p["admin_token"],
                "--token-key-file", p["token_key"])

    def client_env(self, manager: str, token_file: str) -> dict[str, str]:
        """The variables that point ``shardps`` commands (and the README's client) at the
        cluster: each is a flag's environment variable (``--tls-ca``: SHARDPS_TLS_CA, ...)."""
        p = self.paths
        return {"SHARDPS_MANAGER": manager, "SHARDPS_TLS_CA": p["ca"], "SHARDPS_TLS_CERT": p["client_cert"],
                "SHARDPS_TLS_KEY": p["client_key"], "SHARDPS_TOKEN_FILE": token_file}

    def client_tls(self):
        from shardps.rpc.channels import TlsConfig
        p = self.paths
        return TlsConfig.from_files(p["client_cert"], p["client_key"], p["ca"])

    @property
    def admin_token(self) -> str:
        return Path(self.paths["admin_token"]).read_text().strip()

    def create_job(self, manager: str, job: str, mode: str = "async", staleness: int = 0) -> str:
        """Create ``job`` with the admin token; write its token to ``<dir>/<job>.token``
        (mode 0600) and return that path."""
        from shardps.tools.devcerts import write_private
        from shardps.worker.client import PSClient
        with PSClient(manager, job, token=self.admin_token, tls=self.client_tls(), timeout=10.0) as c:
            token = c.create_job(mode, staleness)
        path = self.dir / f"{job}.token"
        write_private(path, token.encode())
        return str(path)

    def instructions(self, manager: str, job: str, token_file: str) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.client_env(manager, token_file).items())
        return (f"shardps local: secured: mutual TLS (development certificates) and tokens, in {self.dir}\n"
                f"  connect as job {job!r} (the shardps commands and the README's Python client "
                f"read these):\n    export {env}\n"
                f"  admin commands take the admin token: shardps status --token-file {self.paths['admin_token']}\n"
                f"  another job: shardps job create NAME --token-file {self.paths['admin_token']} "
                f"--token-out NAME.token")
