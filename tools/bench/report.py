"""The targets, the keys every run must write, the printed table and its Markdown form."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

# Keys every run writes to bench/results/latest.json (a full run writes many more).
REQUIRED_KEYS = (
    "tcp_gbps", "ps_dense_push_gbps", "ps_dense_pull_gbps", "rpc_dense_push_gbps", "rpc_dense_pull_gbps",
    "ps_sparse_rows_per_s", "rpc_sparse_rows_per_s", "e2e_ps_async_samples_per_s", "e2e_ps_sync_samples_per_s",
    "e2e_ddp_samples_per_s", "e2e_ddp_sparse_samples_per_s", "e2e_single_samples_per_s", "e2e_ps_async_auc",
    "e2e_ddp_auc", "e2e_ddp_sparse_auc", "server_bytes_per_param_sgd", "server_bytes_per_param_adam",
    "server_bytes_per_sparse_row_sgd16", "worker_rss_growth_mb_ps", "worker_rss_growth_mb_ddp",
    "e2e_ps_async_share_compute", "e2e_ps_async_share_local_optimizer", "e2e_ps_async_share_pull_wait",
    "e2e_ps_async_share_push_wait",
    "e2e_ps_async_server_share_decode", "e2e_ps_async_server_share_lookup",
    "e2e_ps_async_server_share_optimizer", "e2e_ps_async_server_share_encode", "e2e_ps_async_server_share_idle",
    "control_map_bytes_full", "control_map_bytes_delta",
    "cache_on_samples_per_s", "cache_off_samples_per_s", "cache_on_auc", "cache_off_auc",
    "cache_on_pull_bytes_per_step", "cache_off_pull_bytes_per_step", "cache_on_row_pull_bytes_per_step",
    "cache_off_row_pull_bytes_per_step", "cache_on_hit_rate", "cache_on_max_staleness",
    "cache_hit_rate_ceiling", "cache_row_pull_bytes_floor", "cache_staleness_for_quarter_bytes",
    "lines_worker_train_per_step", "lines_worker_other_per_step", "lines_server_per_request",
    "lines_many_tables_worker_per_step",
    "cold_on_samples_per_s", "cold_off_samples_per_s", "cold_unbounded_samples_per_s", "cold_on_auc",
    "cold_off_auc", "cold_unbounded_auc", "cold_on_peak_table_bytes", "cold_off_peak_table_bytes",
    "cold_unbounded_peak_table_bytes", "cold_budget_bytes", "cold_on_hit_rate", "cold_on_disk_bytes",
    "cold_recur_on_auc", "cold_recur_off_auc",
)


@dataclass(frozen=True)
class Target:
    name: str
    metric: str           # the key compared with ``bound``
    op: str               # ">=" or "<="
    bound: float
    text: str
    cuda: bool = False    # measured only where torch sees a CUDA device (else "not measured")
    cores: int = 0        # measured only on a machine with at least this many cores

    def met(self, results: dict) -> bool | None:
        value = results.get(self.metric)
        if value is None or not math.isfinite(value):
            return None
        return {">=": operator.ge, "<=": operator.le}[self.op](value, self.bound)


def _tcp_only(t: Target) -> Target:
    """``t`` with every byte over TCP on both sides (as between two hosts): ``ps_tcp_*`` against
    ``rpc_tcp_*`` instead of each side's same-host fast path."""
    return Target(f"{t.name}_tcp", t.metric.replace("_ps_over_rpc", "_ps_tcp_over_rpc_tcp"), t.op, t.bound,
                  "[TCP only] " + t.text.replace("ps_", "ps_tcp_").replace("rpc_", "rpc_tcp_"))


_SAME_HOST = (
    Target("dense_push", "ratio_dense_push_ps_over_rpc", ">=", 1.0, "ps_dense_push_gbps >= 1.0 x rpc_dense_push_gbps"),
    Target("dense_pull", "ratio_dense_pull_ps_over_rpc", ">=", 1.0, "ps_dense_pull_gbps >= 1.0 x rpc_dense_pull_gbps"),
    Target("sparse", "ratio_sparse_ps_over_rpc", ">=", 2.0, "ps_sparse_rows_per_s >= 2 x rpc_sparse_rows_per_s"),
)

SCALE_CORES = 12          # the scale part's largest point: 8 workers + 4 servers

TARGETS = (
    *_SAME_HOST,
    *map(_tcp_only, _SAME_HOST),
    Target("e2e_vs_ddp", "ratio_e2e_ps_async_over_ddp", ">=", 3.0,
           "e2e_ps_async_samples_per_s >= 3 x e2e_ddp_samples_per_s"),
    Target("e2e_vs_ddp_sparse", "ratio_e2e_ps_async_over_ddp_sparse", ">=", 1.0,
           "e2e_ps_async_samples_per_s >= 1.0 x e2e_ddp_sparse_samples_per_s"),
    Target("e2e_auc", "e2e_auc_abs_gap_ps_async_ddp_sparse", "<=", 0.01,
           "|e2e_ps_async_auc - e2e_ddp_sparse_auc| <= 0.01"),
    Target("mem_sgd", "server_bytes_per_param_sgd", "<=", 4.5, "server_bytes_per_param_sgd <= 4.5"),
    Target("mem_adam", "server_bytes_per_param_adam", "<=", 13.0, "server_bytes_per_param_adam <= 13"),
    Target("mem_sparse", "server_bytes_per_sparse_row_sgd16", "<=", 80.0, "server_bytes_per_sparse_row_sgd16 <= 80"),
    Target("worker_rss", "ratio_worker_rss_growth_ps_over_ddp", "<=", 0.1,
           "worker_rss_growth_mb_ps <= 0.1 x worker_rss_growth_mb_ddp"),
    Target("placement_balance", "placement_worst_max_over_mean", "<=", 1.10,
           "placement max/mean <= 1.10 at every size"),
    Target("placement_moves", "placement_worst_moved_over_ideal", "<=", 1.2,
           "placement moved <= 1.2 x ideal (join and leave, every size)"),
    Target("control_map", "control_map_death_delta_over_full", "<=", 0.01,
           "control_map_bytes_delta <= 0.01 x control_map_bytes_full (one server's death)"),
    # the data path against the work it serves (2 cores, ratios within one run)
    Target("step_cpu", "ratio_transport_step_cpu_over_compute", "<=", 0.35,
           "data path CPU per ctr step (client + servers) <= 0.35 x the step's compute"),
    Target("small_rtt", "ratio_transport_ps_small_rtt_over_raw", "<=", 3.0,
           "transport_ps_small_rtt_us <= 3 x transport_raw_small_rtt_us"),
    Target("e2e_vs_ddp_sparse_15", "ratio_e2e_ps_async_over_ddp_sparse", ">=", 1.5,
           "e2e_ps_async_samples_per_s >= 1.5 x e2e_ddp_sparse_samples_per_s"),
    Target("e2e_vs_single", "ratio_e2e_ps_async_over_single", ">=", 1.2,
           "e2e_ps_async_samples_per_s >= 1.2 x e2e_single_samples_per_s"),
    Target("e2e_sync_vs_ddp_sparse", "ratio_e2e_ps_sync_over_ddp_sparse", ">=", 1.0,
           "e2e_ps_sync_samples_per_s >= 1.0 x e2e_ddp_sparse_samples_per_s"),
    Target("e2e_auc_005", "e2e_auc_abs_gap_ps_async_ddp_sparse", "<=", 0.005,
           "|e2e_ps_async_auc - e2e_ddp_sparse_auc| <= 0.005"),
    Target("e2e_waits", "e2e_ps_async_share_waits", "<=", 0.25,
           "e2e_ps_async pull wait + push wait <= 0.25 of the loop"),
    # lines of the project's Python per step and per request, counted (python -m shardps.tools.bench.lines)
    Target("lines_train", "lines_worker_train_per_step", "<=", 100.0,
           "a ctr step's lines on the worker's training thread <= 100"),
    Target("lines_other", "lines_worker_other_per_step", "<=", 100.0,
           "a ctr step's lines on the worker's other threads <= 100"),
    Target("lines_server", "lines_server_per_request", "<=", 60.0,
           "a server's lines per data request <= 60"),
    Target("lines_many_tables", "lines_many_tables_worker_per_step", "<=", 250.0,
           "a 12-table step's lines on the worker (every thread) <= 250"),
    # hybrid: dense parameters all-reduced among 2 workers, embeddings on the servers
    Target("hybrid_digits_vs_ps", "ratio_hybrid_digits_hybrid_over_ps", ">=", 2.0,
           "digits CNN, 2 workers: hybrid >= 2 x dense through the servers"),
    Target("hybrid_digits_vs_ddp", "ratio_hybrid_digits_hybrid_over_ddp", ">=", 0.9,
           "digits CNN, 2 workers: hybrid >= 0.9 x plain DDP"),
    Target("hybrid_digits_accuracy", "hybrid_digits_accuracy_gap_single", "<=", 0.005,
           "digits CNN: |hybrid accuracy - one process's| <= 0.005"),
    Target("hybrid_ctr_vs_ps", "ratio_hybrid_ctr_hybrid_over_ps", ">=", 0.9,
           "ctr, 2 workers x 2 servers: hybrid >= 0.9 x dense through the servers"),
    Target("hybrid_ctr_auc", "hybrid_ctr_auc_gap_ddp_sparse", "<=", 0.003,
           "ctr: |hybrid AUC - sparse DDP's| <= 0.003"),
    Target("hybrid_ctr_server_cpu", "ratio_hybrid_ctr_server_cpu_hybrid_over_ps", "<=", 0.7,
           "ctr: the servers' CPU per step, hybrid <= 0.7 x dense through the servers"),
    Target("many_tables_calls", "e2e_many_tables_calls_per_step_per_server", "<=", 1.0,
           "e2e_many_tables: data calls per step per server <= 1"),
    Target("many_tables_speed", "ratio_e2e_many_tables_ps_over_single", ">=", 0.5,
           "e2e_many_tables_ps_samples_per_s >= 0.5 x e2e_many_tables_single_samples_per_s"),
    Target("cache_pull_bytes", "ratio_cache_row_pull_bytes_on_over_off", "<=", 0.25,
           "embedding row bytes pulled per ctr step with the cache <= 0.25 x without"),
    Target("cache_speed", "ratio_cache_on_over_off_samples_per_s", ">=", 1.25,
           "cache_on_samples_per_s >= 1.25 x cache_off_samples_per_s"),
    Target("cache_auc", "cache_auc_abs_gap_on_off", "<=", 0.003,
           "|cache_on_auc - cache_off_auc| <= 0.003"),
    # cold: a tenth of the rows in RAM, the rest in the cold tier on disk
    Target("cold_auc", "cold_on_auc_abs_gap", "<=", 0.002, "cold tier: |AUC - unbounded's| <= 0.002"),
    Target("cold_speed", "cold_on_over_unbounded_samples_per_s", ">=", 0.7,
           "cold tier: samples/s >= 0.7 x unbounded"),
    Target("cold_peak", "cold_on_peak_over_budget", "<=", 1.10,
           "cold tier: peak table bytes in RAM <= 1.10 x the budget"),
    Target("cold_recur", "cold_recur_gain", ">=", 0.0001,
           "ids evicted then revisited: cold tier's AUC > evicting's (gain >= 0.0001)"),
    # on a CUDA machine only (the gpu and cache parts; elsewhere not measured)
    Target("gpu_w2_speed", "gpu_ps_w2_b4096_over_single", ">=", 0.7,
           "GPU: 2 workers x 2 servers, batch 4096 >= 0.7 x one GPU process", cuda=True),
    Target("gpu_w2_auc", "gpu_ps_w2_b4096_auc_abs_gap", "<=", 0.005,
           "GPU: |2 workers' AUC - one GPU process's| <= 0.005", cuda=True),
    Target("gpu_w2_waits", "gpu_ps_w2_b4096_share_wait", "<=", 0.3,
           "GPU: a worker's step waiting on the servers <= 0.3", cuda=True),
    Target("cache_gpu_speed", "ratio_cache_gpu_on_over_single", ">=", 1.0,
           "GPU: 2 workers with the cache, batch 4096 >= 1.0 x one GPU process", cuda=True),
    Target("cache_gpu_auc", "cache_gpu_on_auc_abs_gap", "<=", 0.005,
           "GPU: |2 workers with the cache's AUC - one GPU process's| <= 0.005", cuda=True),
    # the scale part's point of 8 workers and 4 servers, on a machine of 12 or more cores
    Target("scale_w8_vs_single", "scale_w8_s4_ps_async_over_w_single", ">=", 0.7,
           "scale: 8 workers x 4 servers async >= 0.7 x 8 x one process", cores=SCALE_CORES),
    Target("scale_w8_vs_ddp_sparse", "scale_w8_s4_ps_async_over_ddp_sparse", ">=", 2.0,
           "scale: 8 workers x 4 servers async >= 2 x sparse DDP", cores=SCALE_CORES),
    Target("scale_w8_per_core", "scale_w8_s4_ps_async_per_core_over_ddp_sparse_per_core", ">=", 1.5,
           "scale: async per core used (W + S) >= 1.5 x sparse DDP's (W)", cores=SCALE_CORES),
    Target("scale_sync", "scale_worst_ps_sync_over_ddp_sparse", ">=", 1.0,
           "scale: sync >= 1.0 x sparse DDP at every point", cores=SCALE_CORES),
)


def add_derived(results: dict) -> None:
    """Derived keys: the AUC gap's absolute value and one ``target_<name>_met`` (1/0) per
    target whose metric was measured."""
    gap = results.get("e2e_auc_gap_ps_async_minus_ddp_sparse")
    if gap is not None and math.isfinite(gap):
        results["e2e_auc_abs_gap_ps_async_ddp_sparse"] = abs(gap)
    cache_gap = results.get("cache_auc_gap_on_minus_off")
    if cache_gap is not None and math.isfinite(cache_gap):
        results["cache_auc_abs_gap_on_off"] = abs(cache_gap)
    for gap_key, abs_key in (("gpu_ps_w2_b4096_auc_minus_single", "gpu_ps_w2_b4096_auc_abs_gap"),
                             ("cache_gpu_on_auc_minus_single", "cache_gpu_on_auc_abs_gap")):
        value = results.get(gap_key)
        if value is not None and math.isfinite(value):
            results[abs_key] = abs(value)
    waits = [results.get(f"e2e_ps_async_share_{k}") for k in ("pull_wait", "push_wait")]
    if all(w is not None and math.isfinite(w) for w in waits):
        results["e2e_ps_async_share_waits"] = sum(waits)
    if results.get("scale_w8_s4_ps_sync_over_ddp_sparse") is not None:
        syncs = [v for k, v in results.items() if k.startswith("scale_w") and k.endswith("_ps_sync_over_ddp_sparse")]
        if all(v is not None and math.isfinite(v) for v in syncs):
            results["scale_worst_ps_sync_over_ddp_sparse"] = min(syncs)
    for t in TARGETS:
        met = t.met(results)
        if met is not None:
            results[f"target_{t.name}_met"] = float(met)


def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    a = abs(v)
    if a >= 1e5:
        return f"{v:,.0f}"
    if a >= 100:
        return f"{v:,.1f}"
    return f"{v:.3f}" if a >= 0.01 or a == 0 else f"{v:.2e}"


def table(results: dict) -> str:
    """The targets (met or not), then every metric, as aligned text."""
    lines = ["Targets, from this run:", ""]
    w = max(len(t.text) for t in TARGETS)
    for t in TARGETS:
        met = t.met(results)
        mark = {True: "met", False: "MISSED", None: "not measured"}[met]
        lines.append(f"  {t.text:<{w}}   {t.metric} = {_fmt(results.get(t.metric)):>9}  (bound {t.op} {t.bound:g})"
                     f"  {mark}")
    lines += ["", "All metrics:", ""]
    kw = max(len(k) for k in results) if results else 10
    for k in sorted(results):
        lines.append(f"  {k:<{kw}}  {_fmt(results[k])}")
    return "\n".join(lines)


def markdown_targets(results: dict) -> str:
    """The targets as a Markdown table (docs/performance.md quotes it)."""
    rows = ["| target | metric | value | bound | verdict |", "|---|---|---|---|---|"]
    for t in TARGETS:
        met = t.met(results)
        verdict = {True: "met", False: "**missed**", None: "not measured"}[met]
        text = t.text.replace("|", "\\|")
        rows.append(f"| {text} | `{t.metric}` | {_fmt(results.get(t.metric))} | {t.op} {t.bound:g} | {verdict} |")
    return "\n".join(rows)


def md_cell(results: dict, key: str, digits: int = 3) -> str:
    """A metric as a Markdown table cell: thousands separated, else `digits` decimals; "-" if absent."""
    v = results.get(key)
    if v is None:
        return "-"
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.{digits}f}"


def markdown_results(results: dict, meta: dict) -> str:
    """The "Results of one run" section of docs/performance.md, from a run's JSON and meta."""
    def f(key: str, digits: int = 3) -> str:
        return md_cell(results, key, digits)

    out = [f"One quick run: preset `{meta.get('preset')}`, commit `{meta.get('commit')}`"
           f"{' plus uncommitted changes' if meta.get('uncommitted_changes') else ''}, started "
           f"{meta.get('started')}, {meta.get('seconds', 0):.0f} s wall, load average "
           f"{meta.get('loadavg_before', [0])[0]:.1f} before / {meta.get('loadavg_after', [0])[0]:.1f} "
           f"after on {meta.get('cpus')} cores.", "", "### Targets", "", markdown_targets(results), "",
           "### Transport and dense (GB/s)", "",
           f"Raw TCP socket, two processes: send {f('tcp_gbps')}, receive {f('tcp_pull_gbps')}.", "",
           "| tensor | op | shardps 1 server | shardps 2 servers | torch RPC (uv, default channels = cma) "
           "| shardps 1 server, TCP only | shardps 2 servers, TCP only | torch RPC (uv, basic = TCP only) |",
           "|---|---|---|---|---|---|---|---|"]
    for mib in meta.get("config", {}).get("dense_sizes_mib", (16, 64)):
        for op in ("push", "pull"):
            keys = (f"ps_dense_{op}_gbps_{mib}mib_1s", f"ps_dense_{op}_gbps_{mib}mib_2s",
                    f"rpc_dense_{op}_gbps_{mib}mib",
                    f"ps_tcp_dense_{op}_gbps_{mib}mib_1s", f"ps_tcp_dense_{op}_gbps_{mib}mib_2s",
                    f"rpc_tcp_dense_{op}_gbps_{mib}mib")
            out.append(f"| {mib} MiB | {op} | " + " | ".join(f(k) for k in keys) + " |")
    out += ["", f"bfloat16 on the wire (TCP only, 16 MiB, 1 server, GB/s of the float32 tensor): push "
            f"{f('ps_tcp_dense_push_gbps_16mib_1s_bf16')}, pull {f('ps_tcp_dense_pull_gbps_16mib_1s_bf16')}.", "",
            "### Sparse (10,000 rows x 64 of 1,000,000, pull + push)", "", "| system | rows/s |", "|---|---|"]
    for label, key in (("shardps, 1 server (shared memory)", "ps_sparse_rows_per_s"),
                       ("shardps, 2 servers", "ps_sparse_rows_per_s_2s"),
                       ("shardps, 1 server, fresh table (rows created on first push)", "ps_sparse_rows_per_s_cold"),
                       ("torch RPC (uv, default channels)", "rpc_sparse_rows_per_s"),
                       ("shardps, 1 server, TCP only", "ps_tcp_sparse_rows_per_s"),
                       ("torch RPC (uv, basic channel)", "rpc_tcp_sparse_rows_per_s")):
        out.append(f"| {label} | {f(key)} |")
    out += ["", f"Bytes per step: shardps {f('ps_sparse_step_bytes')} (ids and rows, both ways); DDP with a "
            f"sparse gradient {f('ddp_sparse_step_bytes')} sent per rank; dense DDP all-reduces "
            f"{f('ddp_dense_step_bytes')} ({f('ratio_sparse_step_bytes_ddp_dense_over_ps')} x shardps). "
            f"Filling the table: {f('ps_sparse_populate_s_1s')} s on 1 server, "
            f"{f('ps_sparse_populate_s_2s')} s on 2.",
            "", "### End to end: ctr", "", "| system | samples/s | test AUC | worker peak RSS (MB) |",
            "|---|---|---|---|"]
    for label, p in (("shardps async (2 workers, 2 servers, replication 1)", "ps_async"),
                     ("shardps async, replication 2 (the default)", "ps_async_r2"),
                     ("shardps sync (replication 1)", "ps_sync"),
                     ("DDP gloo, dense embedding", "ddp"), ("DDP gloo, sparse embedding", "ddp_sparse"),
                     ("single process, sparse embedding", "single")):
        out.append(f"| {label} | {f(f'e2e_{p}_samples_per_s', 1)} | {f(f'e2e_{p}_auc')} | "
                   f"{f(f'e2e_{p}_worker_peak_rss_mb', 1)} |")
    out += ["", "Many tables (12 single-hot tables, the README's loop, 1 worker, 2 servers): shardps "
            f"{f('e2e_many_tables_ps_samples_per_s', 1)} samples/s at "
            f"{f('e2e_many_tables_calls_per_step_per_server')} data calls per step per server; with ids "
            f"computed in the forward {f('e2e_many_tables_computed_ids_samples_per_s', 1)} at "
            f"{f('e2e_many_tables_computed_ids_calls_per_step_per_server')}; one process "
            f"{f('e2e_many_tables_single_samples_per_s', 1)}."]
    out += ["", f"Training samples: {f('e2e_train_samples')} (dense DDP: {f('e2e_ddp_train_samples')}). shardps "
            f"async workers' loop time: pull wait {f('e2e_ps_async_share_pull_wait')}, compute "
            f"{f('e2e_ps_async_share_compute')}, local optimizer {f('e2e_ps_async_share_local_optimizer')}, push wait "
            f"{f('e2e_ps_async_share_push_wait')}; the servers' "
            f"time: decode {f('e2e_ps_async_server_share_decode')}, lookup {f('e2e_ps_async_server_share_lookup')}, "
            f"optimizer {f('e2e_ps_async_server_share_optimizer')}, encode {f('e2e_ps_async_server_share_encode')}, "
            f"idle {f('e2e_ps_async_server_share_idle')}.", "",
            "### Memory", "", "| | measured (RSS growth) | accounted by the server | target |", "|---|---|---|---|",
            f"| dense, plain SGD (B/param) | {f('server_bytes_per_param_sgd')} | "
            f"{f('server_table_bytes_per_param_sgd')} | <= 4.5 |",
            f"| dense, Adam (B/param) | {f('server_bytes_per_param_adam')} | "
            f"{f('server_table_bytes_per_param_adam')} | <= 13 |",
            f"| sparse d=16, SGD (B/row) | {f('server_bytes_per_sparse_row_sgd16')} | "
            f"{f('server_table_bytes_per_sparse_row_sgd16')} | <= 80 |", "",
            "| worker, ctr table 1M -> 10M rows | peak RSS at 1M (MB) | at 10M (MB) | growth (MB) |",
            "|---|---|---|---|",
            f"| shardps worker | {f('worker_peak_rss_mb_ps_small', 1)} | {f('worker_peak_rss_mb_ps_big', 1)} | "
            f"{f('worker_rss_growth_mb_ps')} |",
            f"| DDP, sparse embedding | {f('worker_peak_rss_mb_ddp_small', 1)} | "
            f"{f('worker_peak_rss_mb_ddp_big', 1)} | {f('worker_rss_growth_mb_ddp', 1)} |", "",
            "### Cost curves", "", "| servers | workers | samples/s | payload bytes per step |", "|---|---|---|---|"]
    for s, w in ((1, 2), (2, 1), (2, 2), (2, 4), (4, 2)):
        out.append(f"| {s} | {w} | {f(f'curve_s{s}_w{w}_samples_per_s', 1)} | {f(f'curve_s{s}_w{w}_bytes_per_step')} |")
    out += ["", "### Placement", "",
            "| servers | blocks | max/mean (worst of initial, join, leave) | moved on join / ideal "
            "| moved on leave / ideal | plan s | join s | leave s |", "|---|---|---|---|---|---|---|---|"]
    for n in (10, 100, 1000):
        if f"placement_{n}_plan_seconds" in results:
            keys = (f"placement_{n}_worst_max_over_mean", f"placement_{n}_join_moved_over_ideal",
                    f"placement_{n}_leave_moved_over_ideal", f"placement_{n}_plan_seconds",
                    f"placement_{n}_join_seconds", f"placement_{n}_leave_seconds")
            out.append(f"| {n} | {n * 1000:,} | " + " | ".join(f(k) for k in keys) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    from pathlib import Path

    p = argparse.ArgumentParser(
        prog="python -m shardps.tools.bench.report",
        description="Print the \"Results of one run\" section of docs/performance.md (the targets' "
                    "verdicts first) from a bench run's JSON, deriving the verdicts of targets added "
                    "since that run. Several files are merged, later ones winning (parts run apart, "
                    "e.g. on a GPU machine).")
    p.add_argument("results", nargs="*", default=["bench/results/latest.json"],
                   help="results JSON of `python -m shardps.tools.bench --out` (default bench/results/latest.json); "
                        "its .meta.json beside it is read where present")
    args = p.parse_args(argv)
    results: dict = {}
    meta: dict = {}
    for name in args.results:
        path = Path(name)
        if not path.is_file():
            p.error(f"{name}: no such results file (python -m shardps.tools.bench --out writes one)")
        results.update({k: v for k, v in json.loads(path.read_text()).items() if v is not None})
        meta_path = path.with_name(path.stem + ".meta.json")
        if meta_path.is_file():
            meta = json.loads(meta_path.read_text())
    add_derived(results)        # also the verdicts of targets added since the run
    print(markdown_results(results, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
