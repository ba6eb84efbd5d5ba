"""The bench's ``hybrid`` part: dense parameters all-reduced among the workers (``--dense
allreduce``) against dense parameters through the servers, against DDP and one process.

Two models, 2 workers each, one torch thread per process:

* ``digits``: the digits CNN of ``make run`` (``--model digits-cnn``: 55 k dense parameters,
  no embedding; Adam, its epochs and learning-rate schedule): ``hybrid`` (2 servers, the CNN
  all-reduced by DDP among the workers), ``ps`` (2 servers, the CNN as dense tables stepped by
  the servers), ``ddp`` (plain DDP over gloo, ``tools/bench/ddp.py``), ``single`` (one process).
  samples/s and test accuracy.
* ``ctr``: the e2e part's ctr model (its data size, ``e2e_rows`` rows): ``hybrid`` (the MLP
  all-reduced, the embedding on 2 servers), ``ps`` (both on the servers), ``ddp_sparse`` (DDP
  with a sparse embedding), ``single``. samples/s, test AUC, and the servers' CPU per worker
  step (``server_cpu_ms_per_step``).

Keys ``hybrid_{digits,ctr}_{hybrid,ps,single}_samples_per_s``, ``hybrid_digits_ddp_*``,
``hybrid_ctr_ddp_sparse_*``, ``hybrid_digits_*_accuracy``, ``hybrid_ctr_*_auc``,
``hybrid_ctr_{hybrid,ps}_server_cpu_ms_per_step`` and their ratios.

    python -m shardps.tools.bench --only hybrid
"""

from __future__ import annotations

import time

from shardps.tools.bench import ddp, ps_runs
from shardps.tools.bench.common import proc_cpu_seconds, ratio, spawn_for_result
from shardps.tools.bench.config import BenchConfig
from shardps.tools.bench.e2e import run_single, worker_args

WORKERS = 2


def _digits_single(epochs: int) -> dict:
    from shardps.tools.cli import build_parser
    from shardps.worker.runtime import train_single_process
    res = train_single_process(build_parser().parse_args(
        ["worker", "--model", "digits-cnn", "--torch-threads", "1", "--device", "cpu", "--epochs", str(epochs)]))
    return {"samples_per_s": res.samples / res.wall_seconds, "accuracy": res.metrics["test_accuracy"]}


def _ps_run(job: str, args: list[str], allreduce: bool, timeout: float) -> dict:
    """``WORKERS`` shardps workers on 2 local servers (replication 1): samples/s, the mean of
    the workers' metrics, and the servers' CPU ms per worker step."""
    from shardps.tools.local import LocalCluster
    from shardps.tools.local_run import torch_group_env
    with LocalCluster(servers=2, replication=1) as cluster:
        pids = [p.popen.pid for p in cluster.servers.values()]
        cpu0 = sum(proc_cpu_seconds(p) for p in pids)
        envs = torch_group_env(WORKERS) if allreduce else None
        results = ps_runs.train(cluster, job, WORKERS, args + (["--dense", "allreduce"] if allreduce else []),
                                timeout, envs=envs)
        cpu = sum(proc_cpu_seconds(p) for p in pids) - cpu0
    summary = ps_runs.summarize(results)
    metrics = [r["metrics"] for r in results]
    out = {"samples_per_s": summary["samples_per_s"],
           "server_cpu_ms_per_step": cpu * 1e3 / max(1, sum(r["steps"] for r in results))}
    for name in metrics[0]:
        out[name] = sum(m[name] for m in metrics) / len(metrics)
    return out


def run(cfg: BenchConfig, progress) -> dict[str, float]:
    out: dict[str, float] = {}
    timeout = cfg.process_timeout_s
    digits = ["--model", "digits-cnn", "--mode", "async", "--torch-threads", "1", "--device", "cpu"]
    if cfg.hybrid_digits_epochs:
        digits += ["--epochs", str(cfg.hybrid_digits_epochs)]
    for name, allreduce in (("hybrid", True), ("ps", False)):
        t0 = time.monotonic()
        got = _ps_run(f"hybrid-digits-{name}", digits, allreduce, timeout)
        out[f"hybrid_digits_{name}_samples_per_s"] = got["samples_per_s"]
        out[f"hybrid_digits_{name}_accuracy"] = got["test_accuracy"]
        progress(f"digits {name}: {got['samples_per_s']:,.0f} samples/s, accuracy {got['test_accuracy']:.4f} "
                 f"({time.monotonic() - t0:.0f}s)")
    res = ddp.run_ddp(0, False, 0, world=WORKERS, timeout=timeout, model="digits-cnn",
                      epochs=cfg.hybrid_digits_epochs)
    wall = max(r["wall_seconds"] for r in res)
    out["hybrid_digits_ddp_samples_per_s"] = sum(r["samples"] for r in res) / wall
    out["hybrid_digits_ddp_accuracy"] = res[0]["metrics"]["test_accuracy"]
    single = spawn_for_result(_digits_single, (cfg.hybrid_digits_epochs,), timeout,
                              "the digits single-process baseline")
    out["hybrid_digits_single_samples_per_s"], out["hybrid_digits_single_accuracy"] = (
        single["samples_per_s"], single["accuracy"])
    progress(f"digits ddp {out['hybrid_digits_ddp_samples_per_s']:,.0f} samples/s, accuracy "
             f"{out['hybrid_digits_ddp_accuracy']:.4f}; single {single['samples_per_s']:,.0f}, "
             f"{single['accuracy']:.4f}")

    n, rows = cfg.e2e_train_samples, cfg.e2e_rows
    for name, allreduce in (("hybrid", True), ("ps", False)):
        t0 = time.monotonic()
        got = _ps_run(f"hybrid-ctr-{name}", worker_args("async", rows, n), allreduce, timeout)
        out[f"hybrid_ctr_{name}_samples_per_s"] = got["samples_per_s"]
        out[f"hybrid_ctr_{name}_auc"] = got["test_auc"]
        out[f"hybrid_ctr_{name}_server_cpu_ms_per_step"] = got["server_cpu_ms_per_step"]
        progress(f"ctr {name}: {got['samples_per_s']:,.0f} samples/s, AUC {got['test_auc']:.4f}, servers "
                 f"{got['server_cpu_ms_per_step']:.2f} ms CPU per worker step ({time.monotonic() - t0:.0f}s)")
    summary = ddp.summarize(ddp.run_ddp(rows, True, n, world=WORKERS, timeout=timeout))
    out["hybrid_ctr_ddp_sparse_samples_per_s"], out["hybrid_ctr_ddp_sparse_auc"] = (
        summary["samples_per_s"], summary["auc"])
    single_ctr = run_single(rows, n, timeout)
    out["hybrid_ctr_single_samples_per_s"], out["hybrid_ctr_single_auc"] = (
        single_ctr["samples_per_s"], single_ctr["auc"])
    progress(f"ctr ddp_sparse {summary['samples_per_s']:,.0f} samples/s, AUC {summary['auc']:.4f}; single "
             f"{single_ctr['samples_per_s']:,.0f}, {single_ctr['auc']:.4f}")

    out["ratio_hybrid_digits_hybrid_over_ps"] = ratio(out["hybrid_digits_hybrid_samples_per_s"],
                                                      out["hybrid_digits_ps_samples_per_s"])
    out["ratio_hybrid_digits_hybrid_over_ddp"] = ratio(out["hybrid_digits_hybrid_samples_per_s"],
                                                       out["hybrid_digits_ddp_samples_per_s"])
    out["hybrid_digits_accuracy_gap_single"] = abs(out["hybrid_digits_hybrid_accuracy"]
                                                   - out["hybrid_digits_single_accuracy"])
    out["ratio_hybrid_ctr_hybrid_over_ps"] = ratio(out["hybrid_ctr_hybrid_samples_per_s"],
                                                   out["hybrid_ctr_ps_samples_per_s"])
    out["hybrid_ctr_auc_gap_ddp_sparse"] = abs(out["hybrid_ctr_hybrid_auc"] - out["hybrid_ctr_ddp_sparse_auc"])
    out["ratio_hybrid_ctr_server_cpu_hybrid_over_ps"] = ratio(out["hybrid_ctr_hybrid_server_cpu_ms_per_step"],
                                                              out["hybrid_ctr_ps_server_cpu_ms_per_step"])
    return out
