"""Cache: the ctr model end to end with and without the worker-side embedding cache.

Both runs: ``e2e_workers`` ``shardps worker`` processes against ``e2e_servers`` servers
(replication 1), ASYNC, as in ``e2e``; the cached run adds ``--cache-bytes cache_bytes``
(per table) and ``--cache-staleness cache_staleness``. Keys:

* ``cache_{on,off}_samples_per_s``, ``cache_{on,off}_auc``;
* ``cache_{on,off}_pull_bytes_per_step``: every payload byte a worker pulled per step (the
  dense parameters, about 107 KB a ctr step, included) and
  ``cache_{on,off}_row_pull_bytes_per_step``: the embedding rows and their ids alone (the
  client's count of sparse ids and rows pulled, ``TrainResult.sparse_bytes_pulled``);
* ``cache_on_hit_rate`` (rows read from the cache over rows looked up),
  ``cache_on_max_staleness`` (the oldest row read, in steps) and ``cache_on_staleness_bound``;
* ``ratio_cache_on_over_off_samples_per_s``, ``ratio_cache_row_pull_bytes_on_over_off``,
  ``cache_auc_gap_on_minus_off``;
* ``cache_hit_rate_ceiling``: what no cache of this design can exceed on this data, however
  large (``hit_rate_ceiling``: every row kept, re-read once older than the staleness bound),
  and so ``cache_row_pull_bytes_floor`` (1 - the ceiling: the lowest
  ``ratio_cache_row_pull_bytes_on_over_off`` reachable); ``cache_staleness_for_quarter_bytes``:
  the least staleness bound (a power of two, up to 1,024; 0: none) whose ceiling lets the row
  bytes fall to a quarter;
* where CUDA is present, the same with ``cache_gpu_`` in place of ``cache_``, through
  ``shardps worker --device cuda`` (2 GPU workers, 2 servers, the largest of ``gpu_batches``),
  with one GPU process holding the table beside them (``cache_gpu_single_*``,
  ``ratio_cache_gpu_on_over_single``), the staleness bound ``shardps worker``'s default at
  that batch with lookahead 2 (``cache_gpu_on_staleness_bound``: 2 steps of 4,096, the least
  bound that reads a cached row; at 8 steps of 4,096 the workers' AUC fell by 0.06); elsewhere
  ``cache_gpu_skipped`` = 1.
"""

from __future__ import annotations

import time

import numpy as np

from shardps.tools.bench import ps_runs
from shardps.tools.bench.common import ratio
from shardps.tools.bench.config import BenchConfig
from shardps.tools.bench.e2e import worker_args


def _per_step(results: list[dict]) -> dict[str, float]:
    """Bytes pulled per step (all, and the sparse ids and rows alone, as the client counted
    them) and the caches' figures."""
    steps = max(1, sum(r["steps"] for r in results))
    looked = sum(c["lookups"] for r in results for c in r.get("cache", {}).values())
    hits = sum(c["hits"] for r in results for c in r.get("cache", {}).values())
    return {"pull_bytes_per_step": sum(r["bytes_pulled"] for r in results) / steps,
            "row_pull_bytes_per_step": sum(r["sparse_bytes_pulled"] for r in results) / steps,
            "hit_rate": hits / looked if looked else 0.0,
            "max_staleness": float(max((c["max_staleness"] for r in results for c in r.get("cache", {}).values()),
                                       default=0))}


def _off_and_on(cfg: BenchConfig, progress, prefix: str, argv: list[str], workers: int,
                servers: int, staleness: int) -> dict[str, float]:
    """The run without the cache, then with it (bound ``staleness`` steps), each against a
    fresh cluster: ``{prefix}_{off,on}_*`` and the ratios of on over off."""
    from shardps.tools.local import LocalCluster

    out: dict[str, float] = {}
    for name, extra in (("off", []), ("on", ["--cache-bytes", str(cfg.cache_bytes),
                                             "--cache-staleness", str(staleness)])):
        t0 = time.monotonic()
        with LocalCluster(servers=servers, replication=1) as cluster:
            results = ps_runs.train(cluster, f"{prefix}-{name}".replace("_", "-"), workers, argv + extra,
                                    cfg.process_timeout_s)
        summary = ps_runs.summarize(results)
        figures = _per_step(results)
        key = f"{prefix}_{name}"
        out[f"{key}_samples_per_s"] = summary["samples_per_s"]
        out[f"{key}_auc"] = summary["auc"]
        out[f"{key}_pull_bytes_per_step"] = figures["pull_bytes_per_step"]
        out[f"{key}_row_pull_bytes_per_step"] = figures["row_pull_bytes_per_step"]
        if name == "on":
            out[f"{key}_hit_rate"] = figures["hit_rate"]
            out[f"{key}_max_staleness"] = figures["max_staleness"]
        progress(f"{prefix.replace('_', ' ')} {name}: {summary['samples_per_s']:,.0f} samples/s, AUC "
                 f"{summary['auc']:.4f}, {figures['pull_bytes_per_step'] / 1e3:,.0f} KB pulled per step "
                 f"({figures['row_pull_bytes_per_step'] / 1e3:,.0f} KB of rows)"
                 + (f", hit rate {figures['hit_rate']:.0%}, oldest row read {figures['max_staleness']:.0f} steps"
                    if name == "on" else "") + f" ({time.monotonic() - t0:.0f}s including start-up)")
    head = f"ratio_{prefix}"
    out[f"{head}_on_over_off_samples_per_s"] = ratio(out[f"{prefix}_on_samples_per_s"],
                                                     out[f"{prefix}_off_samples_per_s"])
    out[f"{head}_row_pull_bytes_on_over_off"] = ratio(out[f"{prefix}_on_row_pull_bytes_per_step"],
                                                      out[f"{prefix}_off_row_pull_bytes_per_step"])
    out[f"{head}_pull_bytes_on_over_off"] = ratio(out[f"{prefix}_on_pull_bytes_per_step"],
                                                  out[f"{prefix}_off_pull_bytes_per_step"])
    out[f"{prefix}_auc_gap_on_minus_off"] = out[f"{prefix}_on_auc"] - out[f"{prefix}_off_auc"]
    return out


def _on_the_gpu(cfg: BenchConfig, progress) -> dict[str, float]:
    """The same through ``shardps worker --device cuda``: 2 GPU workers (as many servers) at
    the largest ``gpu_batches`` batch, against one GPU process holding the table
    (``cache_gpu_*``, ``ratio_cache_gpu_on_over_single``); ``cache_gpu_skipped`` = 1 without CUDA."""
    from shardps.tools.bench import gpu
    from shardps.worker.device import cuda_device_count, no_cuda_reason

    if cuda_device_count() == 0:
        progress(f"cache on the GPU: skipped, no CUDA device ({no_cuda_reason()})")
        return {"cache_gpu_skipped": 1.0}
    batch, workers = max(cfg.gpu_batches), 2
    argv = gpu.gpu_args(cfg.e2e_rows, cfg.gpu_train_samples, batch)
    single = gpu.run_single(argv, cfg.process_timeout_s)
    progress(f"cache on the GPU: batch {batch}, one GPU process {single['samples_per_s']:,.0f} samples/s, "
             f"AUC {single['auc']:.4f}")
    from shardps.worker.runtime import cache_staleness_for
    staleness = cache_staleness_for(batch, 2)   # shardps worker's default: 2 steps of 4,096 (lookahead 2)
    out = {"cache_gpu_skipped": 0.0, "cache_gpu_batch": float(batch), "cache_gpu_on_staleness_bound": float(staleness),
           "cache_gpu_single_samples_per_s": single["samples_per_s"], "cache_gpu_single_auc": single["auc"]}
    out.update(_off_and_on(cfg, progress, "cache_gpu", argv + ["--device", "cuda"], workers, workers, staleness))
    out["ratio_cache_gpu_on_over_single"] = ratio(out["cache_gpu_on_samples_per_s"], single["samples_per_s"])
    out["cache_gpu_on_auc_minus_single"] = out["cache_gpu_on_auc"] - single["auc"]
    return out


def worker_lookups(rows: int, train_samples: int, workers: int, batch: int = 512, seed: int = 0) -> list[np.ndarray]:
    """The distinct ids of each ctr batch the first of ``workers`` workers trains on
    (``shardps worker --model ctr``'s data and sharding), in order."""
    from shardps.worker.data import batches, shard_indices
    from shardps.worker.models.ctr import generate

    ids = generate(train_samples, rows, seed=1000)[0]      # as build_ctr
    return [np.unique(ids[part]) for part in batches(shard_indices(train_samples, 0, seed, 0, workers), batch)]


def hit_rate_ceiling(lookups: list[np.ndarray], rows: int, tau: int) -> float:
    """The hit rate of an unbounded cache with staleness bound ``tau`` over ``lookups`` (the
    distinct ids of each step, ``worker_lookups``): every row looked up is kept, and a row
    read from the servers at step ``s`` serves the lookups of steps ``s + 1`` to ``s + tau``,
    then is read again. ``RowCache`` never hits more (a bounded budget and the admission of
    frequent rows only lose hits; its rows are read a step ahead of their use, one step
    older): this bounds what any budget saves on this data."""
    refreshed = np.full(rows, -(1 << 40), np.int64)
    hits = looked = 0
    for step, distinct in enumerate(lookups):
        fresh = step - refreshed[distinct] <= tau
        hits += int(fresh.sum())
        looked += distinct.shape[0]
        refreshed[distinct[~fresh]] = step
    return hits / looked if looked else 0.0


def _ceilings(cfg: BenchConfig, progress) -> dict[str, float]:
    rows = cfg.e2e_rows
    lookups = worker_lookups(rows, cfg.e2e_train_samples, cfg.e2e_workers)
    ceiling = hit_rate_ceiling(lookups, rows, cfg.cache_staleness)
    quarter = next((tau for tau in (1 << k for k in range(11)) if hit_rate_ceiling(lookups, rows, tau) >= 0.75), 0)
    progress(f"cache ceiling on this data: at most {ceiling:.0%} of the rows a step looks up can be read from a "
             f"cache at staleness {cfg.cache_staleness} (row bytes >= {1 - ceiling:.2f} x without); a quarter "
             + (f"of the bytes needs staleness {quarter}" if quarter else "is out of reach up to staleness 1,024"))
    return {"cache_hit_rate_ceiling": ceiling, "cache_row_pull_bytes_floor": 1.0 - ceiling,
            "cache_staleness_for_quarter_bytes": float(quarter)}


def run(cfg: BenchConfig, progress) -> dict[str, float]:
    n, rows, w = cfg.e2e_train_samples, cfg.e2e_rows, cfg.e2e_workers
    out: dict[str, float] = {"cache_on_staleness_bound": float(cfg.cache_staleness),
                             "cache_bytes_per_table": float(cfg.cache_bytes)}
    progress(f"cache: ctr, {n:,} samples, {w} workers, {cfg.e2e_servers} servers; cache {cfg.cache_bytes:,} "
             f"bytes per table, staleness bound {cfg.cache_staleness} steps")
    out.update(_ceilings(cfg, progress))
    out.update(_off_and_on(cfg, progress, "cache", worker_args("async", rows, n), w, cfg.e2e_servers,
                           cfg.cache_staleness))
    out.update(_on_the_gpu(cfg, progress))
    return out
