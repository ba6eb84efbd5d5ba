"""End to end: the ``ctr`` model trained five ways, samples/s and test AUC.

``ctr`` (``shardps.worker.models.ctr``): 26 Zipf-distributed hashed features into one
``e2e_rows x 16`` embedding, MLP 416-64-1, batch 512 per worker, one epoch over
``e2e_train_samples`` samples (fixed seeds), Adagrad(0.05) on the embedding and Adam(2e-3) on
the MLP, AUC on 50,000 held-out samples. One torch thread per process.

* ``ps_async`` / ``ps_sync``: a ``LocalCluster`` of ``e2e_servers`` servers at replication 1
  and ``e2e_workers`` real ``shardps worker`` processes (``--mode async`` / ``sync``); the
  optimizers run on the servers. AUC: the mean of the workers' (they evaluate the final
  parameters after their own last step). ``ps_async_r2``: ``ps_async`` at replication 2
  (every push applied on two servers: the default wherever two or more servers run).
  ``e2e_<name>_replication`` records each run's replication.
* ``ddp`` / ``ddp_sparse``: ``shardps.tools.bench.ddp``, DDP over gloo with ``e2e_workers`` ranks,
  ``nn.Embedding(sparse=False)`` / ``(sparse=True)``. The dense one trains on a data set of
  ``e2e_ddp_dense_train_samples`` samples (same generator and seeds) when that is set (``--quick``: it runs at a few
  thousand samples/s at best here); ``e2e_ddp_train_samples`` records how many, and its AUC
  is after those.
* ``single``: ``shardps.worker.runtime.train_single_process`` (``nn.Embedding(sparse=True)``,
  the same optimizers), in a child process.

samples/s is aggregate: all workers' samples over the slowest one's training-loop time.
``e2e_many_tables_*``: the plain ``PSModel`` loop on a model of 12 tables
(``shardps.tools.bench.many_tables``).
"""

from __future__ import annotations

import time

from shardps.tools.bench import ddp, many_tables, ps_runs
from shardps.tools.bench.common import ratio, self_peak_rss_kb, spawn_for_result
from shardps.tools.bench.config import BenchConfig


def worker_args(mode: str, rows: int, train_samples: int, steps: int = 0, device: str = "cpu") -> list[str]:
    """``shardps worker`` arguments of the ctr run; on the CPU unless ``device`` says otherwise
    (CPU against CPU baselines; the gpu part passes ``cuda``)."""
    args = ["--model", "ctr", "--mode", mode, "--ctr-rows", str(rows), "--train-samples", str(train_samples),
            "--torch-threads", "1", "--device", device]
    return args + (["--steps", str(steps)] if steps else [])


def _single(rows: int, train_samples: int) -> dict:
    from shardps.tools.cli import build_parser
    from shardps.worker.runtime import train_single_process
    res = train_single_process(build_parser().parse_args(["worker"] + worker_args("async", rows, train_samples)))
    return {"samples": res.samples, "wall_seconds": res.wall_seconds, "auc": res.metrics["test_auc"],
            "peak_rss_kb": self_peak_rss_kb()}


def run_single(rows: int, train_samples: int, timeout: float) -> dict:
    """The one-process baseline on the CPU, in a spawned child."""
    res = spawn_for_result(_single, (rows, train_samples), timeout, "the single-process baseline")
    return {"samples_per_s": res["samples"] / res["wall_seconds"], "auc": res["auc"],
            "rank0_peak_rss_mb": res["peak_rss_kb"] / 1024.0}


def run(cfg: BenchConfig, progress) -> dict[str, float]:
    from shardps.tools.local import LocalCluster

    out: dict[str, float] = {}
    n, rows, w = cfg.e2e_train_samples, cfg.e2e_rows, cfg.e2e_workers
    progress(f"ctr: {n:,} samples, {rows:,} x 16 embedding, {w} workers, {cfg.e2e_servers} servers")

    def record(name: str, summary: dict, took: float) -> None:
        out[f"e2e_{name}_samples_per_s"] = summary["samples_per_s"]
        out[f"e2e_{name}_auc"] = summary["auc"]
        out[f"e2e_{name}_worker_peak_rss_mb"] = summary["rank0_peak_rss_mb"]
        for k, v in summary.items():
            if k.startswith(("share_", "server_share_")):
                out[f"e2e_{name}_{k}"] = v
        progress(f"{name}: {summary['samples_per_s']:,.0f} samples/s, AUC {summary['auc']:.4f} "
                 f"({took:.0f}s including start-up)")
        split = ", ".join(f"{k[6:].replace('_', ' ')} {v:.0%}" for k, v in summary.items() if k.startswith("share_"))
        server = ", ".join(f"{k[13:]} {v:.0%}" for k, v in summary.items() if k.startswith("server_share_"))
        if split:
            progress(f"  {name} worker loop: {split}" + (f"; server time: {server}" if server else ""))

    runs = [("async", 1, "ps_async"), ("sync", 1, "ps_sync")]
    if cfg.e2e_servers >= 2:
        runs.append(("async", 2, "ps_async_r2"))          # every block on two servers
    for mode, replication, name in runs:
        t0 = time.monotonic()
        with LocalCluster(servers=cfg.e2e_servers, replication=replication) as cluster:
            before = ps_runs.server_phase_seconds(cluster)
            results = ps_runs.train(cluster, f"e2e-{mode}", w, worker_args(mode, rows, n), cfg.process_timeout_s)
            after = ps_runs.server_phase_seconds(cluster)
        summary = ps_runs.summarize(results)
        summary.update(ps_runs.server_shares(before, after, cfg.e2e_servers, summary["wall_seconds"]))
        record(name, summary, time.monotonic() - t0)
        out[f"e2e_{name}_replication"] = float(replication)
    n_dense = cfg.e2e_ddp_dense_train_samples or n
    for name, sparse, samples in (("ddp_sparse", True, n), ("ddp", False, n_dense)):
        t0 = time.monotonic()
        res = ddp.run_ddp(rows, sparse, samples, world=w, seed=0, timeout=cfg.process_timeout_s)
        record(name, ddp.summarize(res), time.monotonic() - t0)
    t0 = time.monotonic()
    record("single", run_single(rows, n, cfg.process_timeout_s), time.monotonic() - t0)

    t0 = time.monotonic()
    out.update(many_tables.run(cfg, progress))           # the plain loop on many tables
    progress(f"many tables took {time.monotonic() - t0:.0f}s")

    out["e2e_train_samples"] = float(n)
    out["e2e_ddp_train_samples"] = float(n_dense)
    out["ratio_e2e_ps_async_over_ddp"] = ratio(out["e2e_ps_async_samples_per_s"], out["e2e_ddp_samples_per_s"])
    out["ratio_e2e_ps_async_over_ddp_sparse"] = ratio(out["e2e_ps_async_samples_per_s"],
                                                      out["e2e_ddp_sparse_samples_per_s"])
    out["ratio_e2e_ps_async_over_single"] = ratio(out["e2e_ps_async_samples_per_s"], out["e2e_single_samples_per_s"])
    out["ratio_e2e_ps_sync_over_ddp_sparse"] = ratio(out["e2e_ps_sync_samples_per_s"],
                                                     out["e2e_ddp_sparse_samples_per_s"])
    out["e2e_auc_gap_ps_async_minus_ddp_sparse"] = out["e2e_ps_async_auc"] - out["e2e_ddp_sparse_auc"]
    return out
