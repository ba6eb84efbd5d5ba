"""Sparse: pull then push of 10,000 unique ids x 64 float32 of a 1,000,000-row table.

One round = pull the rows of ``sparse_ids`` unique random ids, then push a gradient for each
(SGD on the server). shardps: a sparse table on a ``LocalCluster`` (1 server; also 2 servers),
``pull_rows`` + ``push_rows`` from a ``PSClient`` in this process. torch RPC
(``shardps.tools.bench.rpc_baseline``): ``table[ids]`` and ``table.index_add_(0, ids, -lr * grads)``
on a preallocated ``[rows, dim]`` table in another process. Both see the same ids and
gradients (fixed seed); rounds interleave; one warm-up. As in ``shardps.tools.bench.dense``, each
side is measured with its same-host fast path (``ps_``: shared memory; ``rpc_``: TensorPipe's
default channels, i.e. ``cma``) and TCP only (``ps_tcp_``, ``rpc_tcp_``: the ``basic`` channel).

Rows/s = ids / (pull seconds + push seconds), median over rounds (each row travels both ways).
Before timing, every row of the shardps table is stored (``sparse_populate``: pushes of zero
gradients), as on a table in steady state; ``ps_sparse_rows_per_s_cold`` times rounds on a
fresh table instead, where every row is created on its first push.

Bytes per step: ``ps_sparse_step_bytes`` (ids both ways plus values both ways, as counted by
the client), ``ddp_dense_step_bytes`` (the full ``rows x dim`` float32 gradient a dense DDP
all-reduce moves every step; with 2 ranks a ring all-reduce sends and receives that much per
rank) and ``ddp_sparse_step_bytes`` (a sparse-gradient DDP step: each rank sends its ids and
rows to the other).
"""

from __future__ import annotations

import time

import numpy as np

from shardps.tools.bench.common import BenchError, median, ratio, start_client
from shardps.tools.bench.config import BenchConfig
from shardps.tools.bench.dense import RPC_CONFIGS
from shardps.tools.bench.rpc_baseline import RpcBaseline

LR = 0.01


def _rounds(cfg: BenchConfig, count: int, salt: int):
    rng = np.random.default_rng([cfg.seed, salt])
    for _ in range(count):
        ids = rng.choice(cfg.sparse_rows, cfg.sparse_ids, replace=False).astype(np.int64)
        grads = (rng.standard_normal((cfg.sparse_ids, cfg.sparse_dim), dtype=np.float32) * 0.01)
        yield ids, grads


def _ps_round(client, table: str, ids: np.ndarray, grads: np.ndarray) -> float:
    t0 = time.perf_counter()
    rows = client.pull_rows(table, ids)
    client.push_rows(table, ids, grads)
    took = time.perf_counter() - t0
    if rows.shape != grads.shape:
        raise BenchError(f"shardps pull_rows returned {rows.shape}, expected {grads.shape}")
    return took


def _populate(client, table: str, cfg: BenchConfig) -> float:
    t0 = time.perf_counter()
    chunk = 100_000
    for start in range(0, cfg.sparse_rows, chunk):
        ids = np.arange(start, min(start + chunk, cfg.sparse_rows), dtype=np.int64)
        client.push_rows(table, ids, np.zeros((ids.shape[0], cfg.sparse_dim), np.float32))
    return time.perf_counter() - t0


def _bytes(client) -> float:
    reg = client.metrics.registry
    return sum(reg.get_sample_value("shardps_client_bytes_total", {"direction": d}) or 0.0
               for d in ("pushed", "pulled"))


def _one_cluster(cfg: BenchConfig, servers: int, rpcs: dict, times: dict, out: dict, progress) -> None:
    """Create and fill the table on a fresh cluster, then time interleaved rounds: shardps
    (with shared memory, and on 1 server also TCP only), then each torch RPC configuration."""
    from shardps.tables import normal, sgd
    from shardps.tools.local import LocalCluster
    from shardps.worker.client import PSClient

    n = cfg.sparse_ids
    progress(f"starting a shardps cluster of {servers} server(s)")
    modes = [("ps", True)] + ([("ps_tcp", False)] if servers == 1 else [])
    with LocalCluster(servers=servers, replication=1) as cluster:
        clients = {prefix: start_client(PSClient(cluster.manager_address, "bench-sparse", timeout=300.0,
                                                 shared_memory=shm)) for prefix, shm in modes}
        try:
            client = clients["ps"]
            client.create_sparse("emb", cfg.sparse_dim, num_rows=cfg.sparse_rows, optimizer=sgd(LR),
                                 init=normal(0.0, 0.01, seed=cfg.seed))
            if cfg.sparse_populate:
                took = _populate(client, "emb", cfg)
                out[f"ps_sparse_populate_s_{servers}s"] = took
                progress(f"stored all {cfg.sparse_rows:,} rows in {took:.1f}s")
            paired = rpcs if servers == 1 else {}
            for i, (ids, grads) in enumerate(_rounds(cfg, cfg.sparse_rounds + 1, 1)):
                for prefix, c in clients.items():
                    before = _bytes(c)
                    took = _ps_round(c, "emb", ids, grads)
                    if i:
                        times.setdefault((prefix, servers), []).append(took)
                    out[f"{prefix}_sparse_step_bytes"] = _bytes(c) - before + ids.nbytes  # + the pull's ids
                for prefix, r in paired.items():
                    tp, tu = r.call("sparse_round", "emb", ids, grads, LR)
                    if i:
                        times.setdefault((prefix, 1), []).append(tp + tu)
            progress(f"{servers} server(s): " + "; ".join(
                f"{p} {n / median(v):,.0f} rows/s" for (p, s), v in times.items() if s == servers))
            if servers == 1:
                client.create_sparse("cold", cfg.sparse_dim, num_rows=cfg.sparse_rows, optimizer=sgd(LR),
                                     init=normal(0.0, 0.01, seed=cfg.seed))
                cold = [_ps_round(client, "cold", ids, grads)
                        for ids, grads in _rounds(cfg, max(3, cfg.sparse_rounds // 3), 2)]
                out["ps_sparse_rows_per_s_cold"] = n / median(cold)
                progress(f"fresh table (rows created on first push): {out['ps_sparse_rows_per_s_cold']:,.0f} rows/s")
            for c in clients.values():
                c.leave()
        finally:
            for c in clients.values():
                c.close()


def run(cfg: BenchConfig, progress) -> dict[str, float]:
    out: dict[str, float] = {}
    n = cfg.sparse_ids
    times: dict[tuple[str, int], list[float]] = {}      # (key prefix, servers) -> seconds per round
    rpcs = {prefix: RpcBaseline(channels) for prefix, channels in RPC_CONFIGS.items()}
    try:
        for prefix, r in rpcs.items():
            progress(f"torch RPC ({prefix}): creating the remote {cfg.sparse_rows:,} x {cfg.sparse_dim} table")
            r.start()
            r.call("create_sparse", "emb", cfg.sparse_rows, cfg.sparse_dim, cfg.seed)
        for servers in cfg.sparse_servers:
            _one_cluster(cfg, servers, rpcs, times, out, progress)
    finally:
        for r in rpcs.values():
            r.stop()
    for (prefix, servers), secs in times.items():
        out[f"{prefix}_sparse_rows_per_s" + ("" if servers == 1 else f"_{servers}s")] = n / median(secs)
    out["ratio_sparse_ps_over_rpc"] = ratio(out["ps_sparse_rows_per_s"], out["rpc_sparse_rows_per_s"])
    out["ratio_sparse_ps_tcp_over_rpc_tcp"] = ratio(out["ps_tcp_sparse_rows_per_s"], out["rpc_tcp_sparse_rows_per_s"])
    out["ddp_dense_step_bytes"] = float(cfg.sparse_rows * cfg.sparse_dim * 4)
    out["ddp_sparse_step_bytes"] = float(n * (8 + cfg.sparse_dim * 4))
    out["ratio_sparse_step_bytes_ddp_dense_over_ps"] = ratio(out["ddp_dense_step_bytes"], out["ps_sparse_step_bytes"])
    return out
