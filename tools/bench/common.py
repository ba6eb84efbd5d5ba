"""Helpers shared by the benchmark parts: ports, memory, metrics, processes, progress.

Every process a part starts is stopped when the part ends, passed or failed: child processes
are started through ``Children`` (a context manager) or ``shardps.tools.local.LocalCluster``, and
die with the benchmark process if it is killed (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Sequence

from shardps.tools.children import child_env, die_with_parent

PROXY_VARIABLES = ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "grpc_proxy", "all_proxy",
                   "ALL_PROXY")


class BenchError(RuntimeError):
    """A benchmark part could not measure what it set out to (the message says why)."""


# ---------------------------------------------------------------- numbers
def median(values) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


# ---------------------------------------------------------------- ports and memory
def in_process_cluster(servers: int = 1):
    """(manager, [servers]): a manager (replication 1) and ``servers`` servers as threads of
    this process on loopback (port 0), as ``shardps local`` starts them but without child
    processes, so that a bench can reach into them. Stop the servers, then the manager.

    The server's and the worker's kernels are compiled (or loaded from numba's cache) first:
    in one process, a compile holds the interpreter lock, on a fresh machine for long enough
    that the servers' heartbeats miss their leases."""
    import logging

    from shardps.server.node.node import warm_up_kernels
    from shardps.server.processes import ManagerProcess, ServerProcess
    from shardps.settings import ManagerProcessSettings, ServerProcessSettings, Serving
    from shardps.worker.runtime import prepare_kernels
    warm_up_kernels()
    prepare_kernels(logging.getLogger("shardps.bench"))
    manager = ManagerProcess(ManagerProcessSettings(serving=Serving(listen="127.0.0.1:0", metrics_port=-1),
                                                    replication=1)).start()
    return manager, [ServerProcess(ServerProcessSettings(serving=Serving(listen="127.0.0.1:0", metrics_port=-1),
                                                         name=f"s{i}", manager=manager.address)).start()
                     for i in range(servers)]


def free_port() -> int:
    """A loopback port free right now, for a program that needs a number before its listener
    exists: torch.distributed's tcp:// rendezvous (a clash makes the part fail, not hang), etcd
    (retried on a clash), the containers of ``first_request``. Another process may take it
    first: where the listener can bind port 0 and say which it got, it does."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_status_kb(pid: int, field: str = "VmRSS") -> int:
    """A ``/proc/PID/status`` memory field (VmRSS, VmHWM) in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise BenchError(f"/proc/{pid}/status has no {field}")


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (``/proc/PID/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(ident: int) -> float:
    """CPU seconds of this process's thread ``ident`` (``threading.get_ident()``) so far."""
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


def self_peak_rss_kb() -> int:
    """This process's peak resident memory (VmHWM), KiB."""
    return proc_status_kb(os.getpid(), "VmHWM")


def scrape(address: str, timeout: float = 5.0) -> dict[tuple[str, tuple], float]:
    """A process's Prometheus metrics: ``{(sample name, sorted label items): value}``."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
            f"http://{address}/metrics", timeout=timeout) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric_sum(samples: dict, name: str, **labels) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


# ---------------------------------------------------------------- processes
def clean_environment() -> None:
    """Loopback traffic must never go through a proxy (gRPC honours http_proxy)."""
    for var in PROXY_VARIABLES:
        os.environ.pop(var, None)
    os.environ["no_proxy"] = "127.0.0.1,localhost"
    os.environ.setdefault("PYTHONUNBUFFERED", "1")


class Children:
    """Spawned ``multiprocessing`` children and ``subprocess`` processes, all stopped on exit
    (terminate, then kill after ``grace`` seconds)."""

    def __init__(self, grace: float = 10.0):
        self.ctx = mp.get_context("spawn")
        self.grace = grace
        self.procs: list = []

    def spawn(self, target, *args) -> mp.process.BaseProcess:
        p = self.ctx.Process(target=_child_main, args=(target, args), daemon=True)
        p.start()
        self.procs.append(p)
        return p

    def popen(self, cmd: list[str], log_path: Path, env: dict | None = None) -> subprocess.Popen:
        """Start ``cmd`` (a ``shardps`` command: it asks to die with this process itself,
        ``shardps.tools.children``; no ``preexec_fn``, which runs Python in a fork of this
        process's gRPC threads and has aborted children before their exec)."""
        logf = open(log_path, "ab")
        try:
            p = subprocess.Popen(cmd, stdout=logf, stderr=logf, env=child_env(env))
        finally:
            logf.close()
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in self.procs:
            if _alive(p):
                p.terminate()
        deadline = time.monotonic() + self.grace
        for p in self.procs:
            _wait(p, max(0.1, deadline - time.monotonic()))
            if _alive(p):
                p.kill()
                _wait(p, 5.0)
        self.procs = []

    def __enter__(self) -> "Children":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _child_main(target, args) -> None:
    die_with_parent(os.getppid())
    target(*args)


def spawn_for_result(target, args: tuple, timeout: float, what: str) -> dict:
    """``target(*args)`` in a spawned child process (CUDA does not survive a fork), stopped
    on return: the dict it returned. BenchError, naming ``what``, when it raised or gave
    nothing within ``timeout`` seconds."""
    with Children() as children:
        queue = children.ctx.Queue()
        children.spawn(_result_main, target, args, queue)
        try:
            res = queue.get(timeout=timeout)
        except Exception:
            raise BenchError(f"{what} gave no result in {timeout:.0f}s") from None
    if "error" in res:
        raise BenchError(f"{what}: {res['error']}")
    return res


def _result_main(target, args: tuple, queue) -> None:
    try:
        queue.put(target(*args))
    except BaseException as exc:
        queue.put({"error": f"{type(exc).__name__}: {exc}"})
        raise


def _alive(p) -> bool:
    return p.is_alive() if isinstance(p, mp.process.BaseProcess) else p.poll() is None


def _wait(p, timeout: float) -> None:
    if isinstance(p, mp.process.BaseProcess):
        p.join(timeout)
    else:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


def wait_all(procs: list, timeout: float, what: str, logs: Sequence[Path] = ()) -> None:
    """Wait for processes to exit 0; raise BenchError (with the log's tail) at the first one
    that fails, or at the timeout. Fails fast: the others may be waiting for the one that
    failed (``--wait-workers``), and would otherwise hold the run until the timeout."""
    deadline = time.monotonic() + timeout
    pending = list(range(len(procs)))
    while pending:
        for i in list(pending):
            code = _exitcode(procs[i])
            if code is None:
                continue
            pending.remove(i)
            if code != 0:
                raise BenchError(f"{what} {i} exited with {code}{_tail(logs, i)}")
        if pending and time.monotonic() > deadline:
            raise BenchError(f"{what} {pending[0]} timed out after {timeout:.0f}s{_tail(logs, pending[0])}")
        if pending:
            time.sleep(0.05)


def _exitcode(p) -> int | None:
    return p.exitcode if isinstance(p, mp.process.BaseProcess) else p.poll()


def _tail(logs: Sequence[Path], i: int) -> str:
    if i >= len(logs):
        return ""
    return "\n" + "\n".join(Path(logs[i]).read_text(errors="replace").splitlines()[-20:])


def worker_command(manager: str, name: str, args: list[str], rss_file: Path) -> list[str]:
    """``shardps worker`` with ``args``, through ``shardps.tools.bench.probe`` (which records the
    process's peak RSS in ``rss_file`` after the worker returns)."""
    return [sys.executable, "-m", "shardps.tools.bench.probe", str(rss_file), "worker", "--manager", manager,
            "--name", name, "--log-format", "human"] + args


def start_client(client, timeout: float = 120.0):
    """``create_job`` + ``join`` for a benchmark's own ``PSClient``, retried while the manager
    is unreachable (a loaded machine can starve a fresh process for seconds)."""
    from shardps.errors import DeadlineExceeded, Unavailable
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.create_job()
            client.join()
            return client
        except (Unavailable, DeadlineExceeded):
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def read_json(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


# ---------------------------------------------------------------- progress
class Progress:
    """Clear progress lines on stderr: ``[bench  12.3s] dense: 16 MiB round 2/5``."""

    def __init__(self, stream=None, quiet: bool = False):
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.started = time.monotonic()
        self.part = ""

    def __call__(self, message: str) -> None:
        if not self.quiet:
            elapsed = time.monotonic() - self.started
            prefix = f"{self.part}: " if self.part else ""
            print(f"[bench {elapsed:6.1f}s] {prefix}{message}", file=self.stream, flush=True)
