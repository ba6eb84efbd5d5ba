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
  ``cache_auc_gap_on_minus_off``.
"""

from __future__ import annotations

import time

from shardps.bench import ps_runs
from shardps.bench.common import ratio
from shardps.bench.config import BenchConfig
from shardps.bench.e2e import worker_args


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


def run(cfg: BenchConfig, progress) -> dict[str, float]:
    from shardps.local import LocalCluster

    n, rows, w = cfg.e2e_train_samples, cfg.e2e_rows, cfg.e2e_workers
    out: dict[str, float] = {"cache_on_staleness_bound": float(cfg.cache_staleness),
                             "cache_bytes_per_table": float(cfg.cache_bytes)}
    progress(f"cache: ctr, {n:,} samples, {w} workers, {cfg.e2e_servers} servers; cache {cfg.cache_bytes:,} "
             f"bytes per table, staleness bound {cfg.cache_staleness} steps")
    for name, extra in (("off", []), ("on", ["--cache-bytes", str(cfg.cache_bytes),
                                             "--cache-staleness", str(cfg.cache_staleness)])):
        t0 = time.monotonic()
        with LocalCluster(servers=cfg.e2e_servers, replication=1) as cluster:
            results = ps_runs.train(cluster, f"cache-{name}", w, worker_args("async", rows, n) + extra,
                                    cfg.process_timeout_s)
        summary = ps_runs.summarize(results)
        figures = _per_step(results)
        out[f"cache_{name}_samples_per_s"] = summary["samples_per_s"]
        out[f"cache_{name}_auc"] = summary["auc"]
        out[f"cache_{name}_pull_bytes_per_step"] = figures["pull_bytes_per_step"]
        out[f"cache_{name}_row_pull_bytes_per_step"] = figures["row_pull_bytes_per_step"]
        if name == "on":
            out["cache_on_hit_rate"] = figures["hit_rate"]
            out["cache_on_max_staleness"] = figures["max_staleness"]
        progress(f"cache {name}: {summary['samples_per_s']:,.0f} samples/s, AUC {summary['auc']:.4f}, "
                 f"{figures['pull_bytes_per_step'] / 1e3:,.0f} KB pulled per step "
                 f"({figures['row_pull_bytes_per_step'] / 1e3:,.0f} KB of rows)"
                 + (f", hit rate {figures['hit_rate']:.0%}, oldest row read {figures['max_staleness']:.0f} steps"
                    if name == "on" else "") + f" ({time.monotonic() - t0:.0f}s including start-up)")
    out["ratio_cache_on_over_off_samples_per_s"] = ratio(out["cache_on_samples_per_s"], out["cache_off_samples_per_s"])
    out["ratio_cache_row_pull_bytes_on_over_off"] = ratio(out["cache_on_row_pull_bytes_per_step"],
                                                          out["cache_off_row_pull_bytes_per_step"])
    out["ratio_cache_pull_bytes_on_over_off"] = ratio(out["cache_on_pull_bytes_per_step"],
                                                      out["cache_off_pull_bytes_per_step"])
    out["cache_auc_gap_on_minus_off"] = out["cache_on_auc"] - out["cache_off_auc"]
    return out
