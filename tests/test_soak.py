"""Bounded load on loopback: 16 concurrent workers against 2 real server processes.

Each worker (a thread with its own ``PSClient``, a member of the job's worker group) loops
over a training-like mix: pull 64 sparse rows, push their gradients, pull a slice of a dense
table, push a gradient for it. The sparse rows and dense slices all lie in a fixed working
set that the warm-up touches, so after it the servers hold nothing new: resident memory may
only grow by leaks (per-request state that is never freed, exactly-once records, metrics).

Asserted: no request fails; after warm-up, at least 10,000 requests (RPCs the servers
handled, from their ``grpc_server_handled_total``: a sparse pull or push of rows spread over
both servers is two); the resident memory of each server (``VmRSS`` in ``/proc/PID/status``)
grows by at most 5 % from the start of the measured window to its end. Printed: throughput,
p50/p99 latency per client operation, memory.
``--soak-seconds N`` sets the measured window (``make soak``: 60 s); the default is a short
run for ``make test``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest

from shardps.tables import sgd
from shardps.tools.bench.common import metric_sum, proc_status_kb, scrape
from shardps.tools.local import LocalCluster
from shardps.worker.client import PSClient

WORKERS = 16
SERVERS = 2
SHORT_SECONDS = 10.0            # measured window of the short run (make test), at least
WARMUP_REQUESTS = 1500          # client operations before the window
MIN_REQUESTS = 10_000           # server RPCs in the window, at least
MAX_RSS_GROWTH = 0.05
ROWS, DIM, IDS_PER_STEP = 20_000, 16, 64
DENSE, SLICE = 1 << 16, 4096
JOB = "soak"


def handled_rpcs(metrics_address: str) -> int:
    """ParameterServer RPCs a server completed (any status), from its /metrics endpoint."""
    return int(metric_sum(scrape(metrics_address, timeout=10), "grpc_server_handled_total",
                          grpc_service="shardps.v1.ParameterServer"))


def rss_bytes(pid: int) -> int:
    return proc_status_kb(pid, "VmRSS") * 1024


@dataclass
class Load:
    """What the workers record; ``measuring`` switches recording from warm-up to the window."""

    stop: threading.Event = field(default_factory=threading.Event)
    measuring: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    warmup: int = 0
    latencies: dict[str, list[float]] = field(default_factory=lambda: {
        "pull_rows": [], "push_rows": [], "pull_dense": [], "push_dense": []})
    errors: list[str] = field(default_factory=list)

    @property
    def measured(self) -> int:
        return sum(len(v) for v in self.latencies.values())

    def record(self, op: str, seconds: float) -> None:
        with self.lock:
            if self.measuring.is_set():
                self.latencies[op].append(seconds)
            else:
                self.warmup += 1


def worker(rank: int, address: str, load: Load) -> None:
    rng = np.random.default_rng(rank)
    try:
        with PSClient(address, JOB, timeout=30.0, threads=2) as client:
            client.join(name=f"soak-{rank}")
            grads = rng.standard_normal((IDS_PER_STEP, DIM)).astype(np.float32) * 1e-3
            dense_grad = rng.standard_normal(SLICE).astype(np.float32) * 1e-3
            while not load.stop.is_set():
                ids = rng.integers(0, ROWS, IDS_PER_STEP)
                start = int(rng.integers(0, DENSE // SLICE)) * SLICE
                for op, call in (("pull_rows", lambda ids=ids: client.pull_rows("e", ids)),
                                 ("push_rows", lambda ids=ids: client.push_rows("e", ids, grads)),
                                 ("pull_dense", lambda start=start: client.pull_dense("w", start, start + SLICE)),
                                 ("push_dense", lambda start=start: client.push_dense("w", dense_grad, start))):
                    began = time.perf_counter()
                    call()
                    load.record(op, time.perf_counter() - began)
            client.leave()
    except Exception as exc:        # every failure counts; the test asserts there are none
        with load.lock:
            load.errors.append(f"worker {rank}: {type(exc).__name__}: {exc}")
        load.stop.set()


def wait_for(condition, load: Load, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert not load.errors, load.errors[:5]
        assert time.monotonic() < deadline, f"{what} not reached after {timeout:.0f} s"
        time.sleep(0.1)


@pytest.mark.slow          # processes (LocalCluster), ~50 s
@pytest.mark.timeout(900, method="thread")      # a stack dump instead of a silent hang
def test_soak(request, tmp_path):
    seconds = request.config.getoption("--soak-seconds") or SHORT_SECONDS
    load = Load()
    threads: list[threading.Thread] = []
    with LocalCluster(servers=SERVERS, work_dir=str(tmp_path / "cluster")) as cluster:
        try:
            with PSClient(cluster.manager_address, JOB, timeout=30.0) as setup:
                setup.create_job()
                setup.create_dense("w", (DENSE,), optimizer=sgd(0.01), block_size=DENSE // 8)
                setup.create_sparse("e", DIM, num_rows=ROWS, optimizer=sgd(0.01), num_blocks=16)
                # the whole working set exists before the measured window
                setup.push_rows("e", np.arange(ROWS), np.zeros((ROWS, DIM), np.float32))
                setup.push_dense("w", np.zeros(DENSE, np.float32))
            pids = {name: proc.info["pid"] for name, proc in cluster.servers.items()}
            metrics = [proc.info["metrics"] for proc in cluster.servers.values()]

            def served() -> int:
                return sum(handled_rpcs(m) for m in metrics)

            threads = [threading.Thread(target=worker, args=(r, cluster.manager_address, load),
                                        name=f"soak-{r}", daemon=True) for r in range(WORKERS)]
            for t in threads:
                t.start()
            wait_for(lambda: load.warmup >= WARMUP_REQUESTS, load, 120, "warm-up")
            rss_before = {name: rss_bytes(pid) for name, pid in pids.items()}
            rpcs_before = served()
            load.measuring.set()
            began = time.perf_counter()
            wait_for(lambda: time.perf_counter() - began >= seconds and served() - rpcs_before >= MIN_REQUESTS,
                     load, seconds + 300, f"{MIN_REQUESTS} requests")
            elapsed = time.perf_counter() - began
            with load.lock:
                load.measuring.clear()
            rpcs = served() - rpcs_before
            rss_after = {name: rss_bytes(pid) for name, pid in pids.items()}
        finally:
            load.stop.set()
            for t in threads:
                t.join(timeout=60)
        alive = [t.name for t in threads if t.is_alive()]
        assert not alive, f"workers still running: {alive}"

    total = load.measured
    all_latencies = np.concatenate([np.array(v) for v in load.latencies.values()])
    print(f"\nsoak: {WORKERS} workers, {SERVERS} servers, {elapsed:.1f} s measured after "
          f"{load.warmup} warm-up operations: {rpcs} server RPCs ({rpcs / elapsed:.0f}/s), "
          f"{total} client operations ({total / elapsed:.0f}/s), errors {len(load.errors)}")
    print(f"  all operations: p50 {1000 * np.percentile(all_latencies, 50):.1f} ms, "
          f"p99 {1000 * np.percentile(all_latencies, 99):.1f} ms")
    for op, values in load.latencies.items():
        v = np.array(values)
        print(f"  {op:10s} {len(v):6d} requests  p50 {1000 * np.percentile(v, 50):6.1f} ms  "
              f"p99 {1000 * np.percentile(v, 99):6.1f} ms")
    growth = {name: (rss_after[name] - rss_before[name]) / rss_before[name] for name in rss_before}
    for name in sorted(rss_before):
        print(f"  server {name}: VmRSS {rss_before[name] / 2**20:.1f} MiB -> "
              f"{rss_after[name] / 2**20:.1f} MiB ({100 * growth[name]:+.2f} %)")

    assert not load.errors, load.errors[:10]
    assert rpcs >= MIN_REQUESTS
    for name, g in growth.items():
        assert g <= MAX_RSS_GROWTH, (f"server {name} resident memory grew {100 * g:.1f} % over "
                                     f"{rpcs} requests after warm-up")
