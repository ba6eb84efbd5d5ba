"""``cold``: the ctr model over 100,000,000 ids with a RAM budget of a tenth of the rows it
touches: with the cold tier (``LifecyclePolicy.cold``: evicted rows move to local disk and
come back), without it (evicted rows start again from their initial value), and unbounded.

Data and model: ``tools/bench/lifecycle.py`` (Zipf(1.1) values of 26 features hashed into a
``100,000,000 x 16`` table, Adagrad(0.05) on it, one in-process manager and server, one
``PSModel`` worker); ``cold_train_samples`` samples, then test AUC on held-out ones. The
policy has no admission (every pushed row is stored), so the runs differ only in what
happens to an evicted row. Peak table bytes: the table's RAM (``SparseRows.memory_bytes``:
every slot handed out, the index), sampled after every step.

A second stream revisits ids after they were evicted: a third of the samples from one
mapping of values to ids (A), a third from another (B: the popular items changed), then A
again, and the test set from A; evicting against the cold tier.

Keys: cold_{on,off,unbounded}_{samples_per_s,auc,peak_table_bytes}, cold_budget_bytes,
cold_rows_touched, cold_on_hit_rate (share of pulled rows the cold tier served),
cold_on_hot_hit_rate (share of pulled rows found in RAM; the rest were never pushed before),
cold_on_disk_bytes (the
cold tier's rows on disk at the end), cold_on_rows_written / _warmed (rows moved to disk /
back to RAM), cold_on_peak_over_budget, cold_on_over_unbounded_samples_per_s, cold_on_auc_abs_gap,
cold_recur_{on,off}_auc, cold_recur_gain (on - off).
"""

from __future__ import annotations

import numpy as np

from shardps.tools.bench.config import BenchConfig
from shardps.tools.bench.lifecycle import generate, train

ROW_BYTES = 16 * 4 * 2 + 4 + 12     # values, Adagrad's sum, last-push tick, sorted index entry


def _budget(ids: np.ndarray) -> tuple[int, int]:
    touched = int(np.unique(ids).shape[0])
    return touched, touched * ROW_BYTES // 10


def run(cfg: BenchConfig, progress) -> dict[str, float]:
    from shardps.tables import LifecyclePolicy

    n = cfg.cold_train_samples
    data, test = generate(n, 3000 + cfg.seed), generate(cfg.lifecycle_test_samples, 4000 + cfg.seed)
    touched, budget = _budget(data[0])
    progress(f"{n:,} samples touching {touched:,} rows; budget {budget / 2**20:.1f} MiB (a tenth)")
    runs = {"unbounded": train(cfg, data, test, None, progress),
            "off": train(cfg, data, test, LifecyclePolicy(budget_bytes=budget), progress),
            "on": train(cfg, data, test, LifecyclePolicy(budget_bytes=budget, cold=True), progress)}
    out = {"cold_budget_bytes": float(budget), "cold_rows_touched": float(touched), "cold_train_samples": float(n)}
    for name, r in runs.items():
        out[f"cold_{name}_samples_per_s"] = n / r["seconds"]
        out[f"cold_{name}_auc"] = r["auc"]
        out[f"cold_{name}_peak_table_bytes"] = float(r["peak"])
    on = runs["on"]
    pulled = max(1, on["pulled"])
    out.update(cold_on_hit_rate=on["cold_read"] / pulled,
               cold_on_hot_hit_rate=1.0 - (on["cold_read"] + on["pulled_evicted"]) / pulled,
               cold_on_disk_bytes=float(on["cold_disk_bytes"]),
               cold_on_rows_written=float(on["cold_written"]), cold_on_rows_warmed=float(on["cold_warmed"]),
               cold_on_peak_over_budget=on["peak"] / budget,
               cold_on_over_unbounded_samples_per_s=runs["unbounded"]["seconds"] / on["seconds"],
               cold_on_auc_abs_gap=abs(runs["unbounded"]["auc"] - on["auc"]))
    out.update(_recurring(cfg, progress))
    return out


def _recurring(cfg: BenchConfig, progress) -> dict[str, float]:
    """Ids that come back after they were evicted: A, B (other ids), A; tested on A."""
    from shardps.tables import LifecyclePolicy

    third = cfg.cold_train_samples // 3
    phases = [generate(third, 5000 + cfg.seed), generate(third, 5001 + cfg.seed, salt=0x5A17),
              generate(third, 5002 + cfg.seed)]
    data = (np.concatenate([p[0] for p in phases]), np.concatenate([p[1] for p in phases]))
    test = generate(cfg.lifecycle_test_samples, 6000 + cfg.seed)
    touched, budget = _budget(data[0])
    progress(f"recurring: A, B, A ({third:,} samples each) touching {touched:,} rows; budget "
             f"{budget / 2**20:.1f} MiB")
    off = train(cfg, data, test, LifecyclePolicy(budget_bytes=budget), progress)
    on = train(cfg, data, test, LifecyclePolicy(budget_bytes=budget, cold=True), progress)
    return {"cold_recur_off_auc": off["auc"], "cold_recur_on_auc": on["auc"],
            "cold_recur_gain": on["auc"] - off["auc"]}
