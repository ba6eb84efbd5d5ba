"""Memory: what a stored parameter costs a server, and what a bigger table costs a worker.

Server (one ``LocalCluster`` server process per table kind, fresh each time): read the
server's VmRSS, create the table, fill it, read VmRSS again; growth / parameters (or rows).

* dense plain SGD (no momentum) and dense Adam tables of ``mem_dense_params`` float32
  parameters, filled by pushing a gradient over every element in pushes of
  ``mem_push_elements`` (a dense block is materialised on its first update);
* a sparse table (dim ``mem_sparse_dim``, SGD) filled by pushing ``mem_sparse_rows`` distinct
  rows, ``mem_push_rows`` per push (a sparse row is stored on its first push).

Before the measured table, a warm-up table (a tenth of the size) is filled the same way, so
that gRPC's buffers, the allocator's arenas and imported code are already resident and the
growth is the table's own. ``server_table_bytes_*`` is what the server itself accounts for
the table (values, optimizer state, row index: the ``bytes`` of its heartbeat), for comparison.
With ``mem_mmap_variant`` the three are measured again with ``MALLOC_MMAP_THRESHOLD_=65536``
in the server's environment (keys ending ``_mmap64k``): glibc then never raises its mmap
threshold, which shows how much of the growth is heap fragmentation rather than the table.

Worker: the peak RSS (VmHWM) of rank 0 of a ``ctr`` run of ``mem_workers`` workers x
``mem_worker_steps`` steps (DDP: ``mem_ddp_steps``; its gradients and optimizer state exist
from the first step on) with a ``rows[0]`` and with a ``rows[1]``-row table, shardps (real
``shardps worker`` processes) against DDP over gloo with ``nn.Embedding(sparse=True)`` (the
strong baseline) and with a dense embedding. Growth = peak(rows[1]) - peak(rows[0]), MB (2^20 bytes). The data set
is the same size in both runs, so the growth is what the table costs the worker.
"""

from __future__ import annotations

import os
import time

import numpy as np

from shardps.tools.bench import ddp, ps_runs
from shardps.tools.bench.common import proc_status_kb, ratio, start_client
from shardps.tools.bench.config import BenchConfig
from shardps.tools.bench.e2e import worker_args

MMAP_THRESHOLD = 64 * 1024


def _settle(pid: int) -> int:
    """VmRSS (bytes) once it stops changing (pushes are acknowledged before buffers are freed)."""
    last = proc_status_kb(pid)
    for _ in range(20):
        time.sleep(0.1)
        now = proc_status_kb(pid)
        if now == last:
            break
        last = now
    return last * 1024


def _stored_bytes(client) -> int:
    return sum(int(s.bytes) for s in client.cluster_status().servers)


def _stable_stored(client, changed_from: int | None, timeout: float = 10.0, quiet: float = 2.5) -> int:
    """The bytes the servers report in their heartbeats (about once a second), read once the
    figure differs from ``changed_from`` and has then stayed put for ``quiet`` seconds."""
    deadline = time.monotonic() + timeout
    last, since = _stored_bytes(client), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = _stored_bytes(client)
        if now != last:
            last, since = now, time.monotonic()
        elif last != changed_from and time.monotonic() - since >= quiet:
            break
    return last


def _fill_dense(client, name: str, params: int, chunk: int, optimizer) -> None:
    from shardps.tables import zeros
    client.create_dense(name, (params,), optimizer=optimizer, init=zeros())
    grad = np.full(chunk, 1e-3, np.float32)
    for start in range(0, params, chunk):
        stop = min(params, start + chunk)
        client.push_dense(name, grad[:stop - start], start=start)


def _fill_sparse(client, name: str, rows: int, dim: int, chunk: int, optimizer, offset: int = 0) -> None:
    client.create_sparse(name, dim, num_rows=0, optimizer=optimizer)
    for start in range(0, rows, chunk):
        ids = np.arange(offset + start, offset + min(rows, start + chunk), dtype=np.int64)
        client.push_rows(name, ids, np.full((ids.shape[0], dim), 1e-3, np.float32))


def _server_growth(cfg: BenchConfig, kind: str, progress, env: dict | None = None,
                   suffix: str = "") -> dict[str, float]:
    from shardps.tables import adam, sgd
    from shardps.tools.local import LocalCluster
    from shardps.worker.client import PSClient

    optimizer = adam(1e-3) if kind == "adam" else sgd(0.01)
    with LocalCluster(servers=1, replication=1, env=env) as cluster, \
            PSClient(cluster.manager_address, f"bench-mem-{kind}", timeout=300.0) as client:
        start_client(client)
        server = cluster.servers["s0"]
        pid = server.info["pid"]
        if kind == "sparse":
            n = cfg.mem_sparse_rows
            _fill_sparse(client, "warm", max(1, n // 10), cfg.mem_sparse_dim, cfg.mem_push_rows, optimizer,
                         offset=1 << 40)
            before = _settle(pid)
            stored = _stable_stored(client, 0)
            _fill_sparse(client, "t", n, cfg.mem_sparse_dim, cfg.mem_push_rows, optimizer)
        else:
            n = cfg.mem_dense_params
            _fill_dense(client, "warm", max(cfg.mem_push_elements, n // 10), cfg.mem_push_elements, optimizer)
            before = _settle(pid)
            stored = _stable_stored(client, 0)
            _fill_dense(client, "t", n, cfg.mem_push_elements, optimizer)
        after = _settle(pid)
        accounted = _stable_stored(client, stored) - stored
        client.leave()
    unit = "row" if kind == "sparse" else "param"
    key = {"sgd": "sgd", "adam": "adam", "sparse": f"sgd{cfg.mem_sparse_dim}"}[kind]
    what = "sparse_row" if kind == "sparse" else "param"
    out = {f"server_bytes_per_{what}_{key}{suffix}": (after - before) / n,
           f"server_table_bytes_per_{what}_{key}{suffix}": accounted / n}
    progress(f"{kind}{suffix}: RSS +{(after - before) / 2**20:.1f} MiB for {n:,} {unit}s = "
             f"{(after - before) / n:.2f} B/{unit} (the server accounts {accounted / n:.2f})")
    return out


def _worker_peaks(cfg: BenchConfig, progress) -> dict[str, float]:
    from shardps.tools.local import LocalCluster

    out: dict[str, float] = {}
    steps, n = cfg.mem_worker_steps, cfg.mem_worker_train_samples
    peaks: dict[str, list[float]] = {}
    for rows in cfg.mem_worker_rows:
        with LocalCluster(servers=2, replication=1) as cluster:
            results = ps_runs.train(cluster, f"mem-{rows}", cfg.mem_workers,
                                    worker_args("async", rows, n, steps), cfg.process_timeout_s)
        peaks.setdefault("ps", []).append(results[0]["peak_rss_kb"] / 1024.0)
        variants = [("ddp", True)] + ([("ddp_dense", False)] if cfg.mem_ddp_dense else [])
        for name, sparse in variants:
            res = ddp.run_ddp(rows, sparse, n, world=cfg.mem_workers, steps=cfg.mem_ddp_steps,
                              evaluate=False, timeout=cfg.process_timeout_s)
            peaks.setdefault(name, []).append(res[0]["peak_rss_kb"] / 1024.0)
        progress(f"{rows:,} rows: worker peak RSS " + ", ".join(f"{k} {v[-1]:.0f} MB" for k, v in peaks.items()))
    for name, (small, big) in peaks.items():
        out[f"worker_peak_rss_mb_{name}_small"] = small
        out[f"worker_peak_rss_mb_{name}_big"] = big
        out[f"worker_rss_growth_mb_{name}"] = big - small
    out["ratio_worker_rss_growth_ps_over_ddp"] = ratio(out["worker_rss_growth_mb_ps"], out["worker_rss_growth_mb_ddp"])
    return out


def run(cfg: BenchConfig, progress) -> dict[str, float]:
    out: dict[str, float] = {}
    for kind in ("sgd", "adam", "sparse"):
        out.update(_server_growth(cfg, kind, progress))
    if cfg.mem_mmap_variant:
        # the same with glibc's dynamic mmap threshold pinned: large arrays always get their
        # own mapping, so freed request buffers cannot fragment the heap around table blocks
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD))
        for kind in ("sgd", "adam", "sparse"):
            out.update(_server_growth(cfg, kind, progress, env, "_mmap64k"))
    out.update(_worker_peaks(cfg, progress))
    return out
