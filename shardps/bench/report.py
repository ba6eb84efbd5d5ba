"""The issue's targets, the keys every run must write, the printed table and its Markdown form."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

# Keys the issue requires in bench/results/latest.json (a full run writes many more).
REQUIRED_KEYS = (
    "tcp_gbps", "ps_dense_push_gbps", "ps_dense_pull_gbps", "rpc_dense_push_gbps", "rpc_dense_pull_gbps",
    "ps_sparse_rows_per_s", "rpc_sparse_rows_per_s", "e2e_ps_async_samples_per_s", "e2e_ps_sync_samples_per_s",
    "e2e_ddp_samples_per_s", "e2e_ddp_sparse_samples_per_s", "e2e_single_samples_per_s", "e2e_ps_async_auc",
    "e2e_ddp_auc", "e2e_ddp_sparse_auc", "server_bytes_per_param_sgd", "server_bytes_per_param_adam",
    "server_bytes_per_sparse_row_sgd16", "worker_rss_growth_mb_ps", "worker_rss_growth_mb_ddp",
)


@dataclass(frozen=True)
class Target:
    name: str
    metric: str           # the key compared with ``bound``
    op: str               # ">=" or "<="
    bound: float
    text: str

    def met(self, results: dict) -> bool | None:
        value = results.get(self.metric)
        if value is None or not math.isfinite(value):
            return None
        return {">=": operator.ge, "<=": operator.le}[self.op](value, self.bound)


TARGETS = (
    Target("dense_push", "ratio_dense_push_ps_over_rpc", ">=", 1.0, "ps_dense_push_gbps >= 1.0 x rpc_dense_push_gbps"),
    Target("dense_pull", "ratio_dense_pull_ps_over_rpc", ">=", 1.0, "ps_dense_pull_gbps >= 1.0 x rpc_dense_pull_gbps"),
    Target("sparse", "ratio_sparse_ps_over_rpc", ">=", 2.0, "ps_sparse_rows_per_s >= 2 x rpc_sparse_rows_per_s"),
    # the same three with every byte over TCP on both sides (as between two hosts)
    Target("dense_push_tcp", "ratio_dense_push_ps_tcp_over_rpc_tcp", ">=", 1.0,
           "[TCP only] ps_tcp_dense_push_gbps >= 1.0 x rpc_tcp_dense_push_gbps"),
    Target("dense_pull_tcp", "ratio_dense_pull_ps_tcp_over_rpc_tcp", ">=", 1.0,
           "[TCP only] ps_tcp_dense_pull_gbps >= 1.0 x rpc_tcp_dense_pull_gbps"),
    Target("sparse_tcp", "ratio_sparse_ps_tcp_over_rpc_tcp", ">=", 2.0,
           "[TCP only] ps_tcp_sparse_rows_per_s >= 2 x rpc_tcp_sparse_rows_per_s"),
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
)


def add_derived(results: dict) -> None:
    """Derived keys: the AUC gap's absolute value and one ``target_<name>_met`` (1/0) per
    target whose metric was measured."""
    gap = results.get("e2e_auc_gap_ps_async_minus_ddp_sparse")
    if gap is not None and math.isfinite(gap):
        results["e2e_auc_abs_gap_ps_async_ddp_sparse"] = abs(gap)
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
    lines = ["Targets (issue 4), from this run:", ""]
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
