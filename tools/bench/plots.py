"""PNG plots of a results dict (matplotlib, Agg): the comparisons and the cost curves.

    python -m shardps.tools.bench.plots bench/results/latest.json docs/img

Each figure is drawn only when its metrics are present; ``draw_all`` returns the files written.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path


def _v(results: dict, key: str) -> float:
    v = results.get(key)
    return v if isinstance(v, (int, float)) and v is not None and math.isfinite(v) else float("nan")


def _bars(ax, labels, values, colors=None, fmt="{:.2f}"):
    bars = ax.bar(range(len(values)), values, color=colors)
    ax.set_xticks(range(len(values)))
    ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
    for b, v in zip(bars, values):
        if math.isfinite(v):
            ax.annotate(fmt.format(v), (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                        va="bottom", fontsize=7)
    return bars


def _dense(results, plt, path):
    sizes = sorted({int(k.split("_")[4][:-3]) for k in results if k.startswith("ps_dense_push_gbps_")
                    and k.endswith("s") and "bf16" not in k})
    if not sizes:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    systems = [("shardps, 1 server (shared memory)", "ps_dense_{op}_gbps_{m}mib_1s", "C0"),
               ("shardps, 2 servers (shared memory)", "ps_dense_{op}_gbps_{m}mib_2s", "C1"),
               ("torch RPC (uv + default channels: cma)", "rpc_dense_{op}_gbps_{m}mib", "C2"),
               ("shardps, 1 server, TCP only", "ps_tcp_dense_{op}_gbps_{m}mib_1s", "C9"),
               ("shardps, 2 servers, TCP only", "ps_tcp_dense_{op}_gbps_{m}mib_2s", "C4"),
               ("torch RPC (uv + basic channel: TCP only)", "rpc_tcp_dense_{op}_gbps_{m}mib", "C3")]
    width = 0.8 / len(systems)
    for ax, op in zip(axes, ("push", "pull")):
        for i, (label, pattern, color) in enumerate(systems):
            vals = [_v(results, pattern.format(op=op, m=m)) for m in sizes]
            xs = [j + (i - (len(systems) - 1) / 2) * width for j in range(len(sizes))]
            ax.bar(xs, vals, width, label=label, color=color)
        tcp = _v(results, "tcp_gbps" if op == "push" else "tcp_pull_gbps")
        if math.isfinite(tcp):
            ax.axhline(tcp, color="k", ls="--", lw=1, label=f"raw TCP socket ({tcp:.2f})")
        ax.set_xticks(range(len(sizes)))
        ax.set_xticklabels([f"{m} MiB" for m in sizes])
        ax.set_title(f"dense {op}" + (" (server applies SGD)" if op == "push" else ""))
        ax.set_ylabel("GB/s (float32 payload)")
    axes[0].legend(fontsize=7)
    fig.suptitle("Dense tensors over loopback: shardps vs torch.distributed.rpc (TensorPipe)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _sparse(results, plt, path):
    if "ps_sparse_rows_per_s" not in results:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = ["shardps 1 server", "shardps 2 servers", "shardps fresh table", "torch RPC (cma)",
              "shardps TCP only", "torch RPC TCP only"]
    vals = [_v(results, k) / 1e6 for k in ("ps_sparse_rows_per_s", "ps_sparse_rows_per_s_2s",
                                           "ps_sparse_rows_per_s_cold", "rpc_sparse_rows_per_s",
                                           "ps_tcp_sparse_rows_per_s", "rpc_tcp_sparse_rows_per_s")]
    _bars(axes[0], labels, vals, ["C0", "C1", "C4", "C2", "C9", "C3"])
    axes[0].set_ylabel("million rows/s (pull + push)")
    axes[0].set_title("10,000 unique rows x 64 of a 1M-row table")
    labels = ["shardps (touched rows)", "DDP sparse grad", "DDP dense grad"]
    vals = [_v(results, k) / 1e6 for k in ("ps_sparse_step_bytes", "ddp_sparse_step_bytes", "ddp_dense_step_bytes")]
    _bars(axes[1], labels, vals, ["C0", "C3", "C2"], fmt="{:.1f}")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("MB per step per worker (log)")
    axes[1].set_title("bytes moved for the same step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


E2E = [("shardps async", "ps_async", "C0"), ("shardps sync", "ps_sync", "C1"),
       ("DDP gloo dense emb", "ddp", "C2"), ("DDP gloo sparse emb", "ddp_sparse", "C3"),
       ("single process", "single", "C7")]


def _e2e(results, plt, path):
    if "e2e_ps_async_samples_per_s" not in results:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    _bars(axes[0], [label for label, _, _ in E2E], [_v(results, f"e2e_{k}_samples_per_s") for _, k, _ in E2E],
          [c for _, _, c in E2E], fmt="{:,.0f}")
    axes[0].set_ylabel("samples/s (all workers)")
    axes[0].set_title("ctr, 1M x 16 embedding, 2 workers / 2 servers")
    _bars(axes[1], [label for label, _, _ in E2E], [_v(results, f"e2e_{k}_auc") for _, k, _ in E2E],
          [c for _, _, c in E2E], fmt="{:.4f}")
    aucs = [_v(results, f"e2e_{k}_auc") for _, k, _ in E2E]
    finite = [a for a in aucs if math.isfinite(a)]
    if finite:
        axes[1].set_ylim(min(finite) - 0.02, max(finite) + 0.01)
    axes[1].set_ylabel("test AUC after one epoch")
    axes[1].set_title(f"accuracy ({_v(results, 'e2e_train_samples'):,.0f} training samples)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _memory(results, plt, path):
    if "server_bytes_per_param_sgd" not in results:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = [("dense SGD\n(B/param)", "server_bytes_per_param_sgd", 4.5),
             ("dense Adam\n(B/param)", "server_bytes_per_param_adam", 13.0),
             ("sparse d=16 SGD\n(B/row / 10)", "server_bytes_per_sparse_row_sgd16", 80.0)]
    xs = range(len(names))
    scale = [1, 1, 10]
    rss = [_v(results, k) / s for (_, k, _), s in zip(names, scale)]
    mmap = [_v(results, k + "_mmap64k") / s for (_, k, _), s in zip(names, scale)]
    acct = [_v(results, k.replace("server_bytes", "server_table_bytes")) / s for (_, k, _), s in zip(names, scale)]
    axes[0].bar([x - 0.27 for x in xs], rss, 0.27, label="server RSS growth", color="C0")
    if any(math.isfinite(v) for v in mmap):
        axes[0].bar(list(xs), mmap, 0.27, label="RSS growth, MALLOC_MMAP_THRESHOLD_=64k", color="C9")
    axes[0].bar([x + 0.27 for x in xs], acct, 0.27, label="accounted by the server", color="C7")
    for x, (_, _, bound), s in zip(xs, names, scale):
        axes[0].plot([x - 0.45, x + 0.45], [bound / s] * 2, "r--", lw=1)
    axes[0].set_xticks(list(xs))
    axes[0].set_xticklabels([n for n, _, _ in names], fontsize=8)
    axes[0].set_title("server memory per stored parameter (red: target)")
    axes[0].legend(fontsize=7)
    labels = ["shardps worker", "DDP sparse emb", "DDP dense emb"]
    vals = [_v(results, k) for k in ("worker_rss_growth_mb_ps", "worker_rss_growth_mb_ddp",
                                     "worker_rss_growth_mb_ddp_dense")]
    _bars(axes[1], labels, vals, ["C0", "C3", "C2"], fmt="{:,.0f}")
    axes[1].set_ylabel("MB")
    axes[1].set_title("worker peak RSS growth, ctr table 1M -> 10M rows")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _curves(results, plt, path):
    pts = {}
    for k, v in results.items():
        if k.startswith("curve_s") and k.endswith("_samples_per_s"):
            s, w = k[len("curve_s"):].split("_")[:2]
            pts[(int(s), int(w[1:]))] = (v, _v(results, k.replace("_samples_per_s", "_bytes_per_step")))
    if not pts:
        return None
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex="col")
    for col, (axis_name, line_name) in enumerate((("servers", "workers"), ("workers", "servers"))):
        pos, other = (0, 1) if axis_name == "servers" else (1, 0)
        for i, fixed in enumerate(sorted({p[other] for p in pts})):
            keys = sorted((p for p in pts if p[other] == fixed), key=lambda p: p[pos])
            xs = [p[pos] for p in keys]
            label = f"{fixed} {line_name if fixed != 1 else line_name[:-1]}"
            axes[0][col].plot(xs, [pts[p][0] for p in keys], "o-", color=f"C{i}", label=label)
            axes[1][col].plot(xs, [pts[p][1] / 1e6 for p in keys], "s--", color=f"C{i}", label=label)
        axes[0][col].set_title(f"{axis_name} 1 -> 4 (2 cores shared by every process)")
        axes[0][col].set_ylabel("samples/s (all workers)")
        axes[1][col].set_ylabel("MB per step (servers' payload in + out)")
        axes[1][col].set_xlabel(axis_name)
        axes[1][col].set_xticks(sorted({p[pos] for p in pts}))
        top = max((v for _, v in pts.values() if math.isfinite(v)), default=1.0)
        axes[1][col].set_ylim(0, top * 1.25 / 1e6)
        axes[0][col].legend(fontsize=7)
    ddp = _v(results, "ddp_dense_step_bytes_ctr")
    if math.isfinite(ddp):
        fig.suptitle(f"ctr cost curves (async); a dense DDP step all-reduces {ddp / 1e6:.0f} MB per rank")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _placement(results, plt, path):
    sizes = sorted(int(k.split("_")[1]) for k in results
                   if k.startswith("placement_") and k.endswith("_worst_max_over_mean") and k.split("_")[1].isdigit())
    if not sizes:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].plot(sizes, [_v(results, f"placement_{n}_worst_max_over_mean") for n in sizes], "o-")
    axes[0].axhline(1.10, color="r", ls="--", lw=1, label="target 1.10")
    axes[0].set_xscale("log")
    axes[0].set_xlabel("servers")
    axes[0].set_ylabel("max / mean blocks per server")
    axes[0].legend()
    axes[1].plot(sizes, [_v(results, f"placement_{n}_join_moved_over_ideal") for n in sizes], "o-", label="join")
    axes[1].plot(sizes, [_v(results, f"placement_{n}_leave_moved_over_ideal") for n in sizes], "s-", label="leave")
    axes[1].axhline(1.2, color="r", ls="--", lw=1, label="target 1.2")
    axes[1].set_xscale("log")
    axes[1].set_xlabel("servers")
    axes[1].set_ylabel("blocks moved / ideal")
    axes[1].legend()
    fig.suptitle("placement simulated with the manager's plan_placement (1,000 blocks per server)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def draw_all(results: dict, out_dir: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fn in (("bench-dense", _dense), ("bench-sparse", _sparse), ("bench-e2e", _e2e),
                     ("bench-memory", _memory), ("bench-curves", _curves), ("bench-placement", _placement)):
        path = fn(results, plt, out_dir / f"{name}.png")
        plt.close("all")
        if path is not None:
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2:
        print("usage: python -m shardps.tools.bench.plots RESULTS.json OUT_DIR", file=sys.stderr)
        return 2
    results = {k: v for k, v in json.loads(Path(argv[0]).read_text()).items() if v is not None}
    for p in draw_all(results, Path(argv[1])):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
