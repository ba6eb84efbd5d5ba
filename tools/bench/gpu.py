"""GPU: the ``ctr`` model on CUDA, one process holding the table against shardps GPU workers.

Runs where torch sees a CUDA device. Elsewhere it measures nothing and records why:
``gpu_skipped`` = 1, ``gpu_cuda_devices`` (the CUDA devices torch sees) and
``gpu_torch_cuda_build`` (1 when torch is built for CUDA: then the driver or
``CUDA_VISIBLE_DEVICES`` hide the GPUs), and prints the reason.

At each per-process batch size B of ``gpu_batches``, on ``gpu_train_samples`` samples of the
``ctr`` model (an ``e2e_rows`` x 16 table, one epoch, the seeds, optimizers and test AUC of
``e2e``):

* ``single``: one process with the model and the whole table on the GPU
  (``train_single_process`` with ``--device cuda``: ``nn.Embedding(sparse=True)`` with
  Adagrad, the MLP with Adam), in a child process.
* ``ps_w{W}``, W in ``gpu_workers``: W ``shardps worker --device cuda`` processes (ASYNC,
  ``shardps worker``'s defaults) against a ``LocalCluster`` of W servers at replication 1.
  On a one-GPU machine the workers share it.

Keys: ``gpu_{system}_b{B}_samples_per_s`` (aggregate, as in ``e2e``: all samples over the
slowest worker's loop time), ``gpu_{system}_b{B}_auc``, ``gpu_ps_w{W}_b{B}_over_single``,
``gpu_ps_w{W}_b{B}_auc_minus_single``, and the split of the workers' loop time,
``gpu_ps_w{W}_b{B}_share_{compute,local_optimizer,pull_wait,push_wait,barrier_wait}``:
``compute`` is the step's forward and backward including the GPU's work (the loop waits for
the GPU before it pushes), ``local_optimizer`` the step of the parameters kept on the worker
(inside ``push``, not counted in its wait), the waits are time the loop spends on the
servers while the GPU has nothing queued; ``..._share_wait`` is their sum.
``..._share_copies``: the loop's own time on copies between host and GPU (staging pulled
values into pinned buffers, waiting for the gradients' copies), a part of ``compute`` and
``push_wait``.
"""

from __future__ import annotations

import time

from shardps.tools.bench import ps_runs
from shardps.tools.bench.common import BenchError, ratio, spawn_for_result
from shardps.tools.bench.config import BenchConfig
from shardps.tools.bench.e2e import worker_args

WAITS = ("pull_wait", "push_wait", "barrier_wait")


def gpu_args(rows: int, samples: int, batch: int) -> list[str]:
    """``shardps worker`` arguments of one run: ``e2e``'s ctr run at ``batch``, on the GPU."""
    return worker_args("async", rows, samples, device="cuda") + ["--batch-size", str(batch)]


def _single(argv: list[str]) -> dict:
    from shardps.tools.cli import build_parser
    from shardps.worker.runtime import train_single_process
    res = train_single_process(build_parser().parse_args(["worker"] + argv))
    return {"samples": res.samples, "wall_seconds": res.wall_seconds, "auc": res.metrics["test_auc"],
            "device": res.device}


def run_single(argv: list[str], timeout: float) -> dict:
    """One process training on the GPU (a spawned child: CUDA does not survive a fork)."""
    res = spawn_for_result(_single, (argv,), timeout, "the one-process GPU run")
    if not res["device"].startswith("cuda"):
        raise BenchError(f"the one-process GPU run trained on {res['device']}, not a GPU")
    return {"samples_per_s": res["samples"] / res["wall_seconds"], "auc": res["auc"]}


def run_workers(cfg: BenchConfig, workers: int, argv: list[str], job: str) -> dict:
    """``workers`` GPU workers against as many servers; ``ps_runs.summarize`` of their results."""
    from shardps.tools.local import LocalCluster
    with LocalCluster(servers=workers, replication=1) as cluster:
        results = ps_runs.train(cluster, job, workers, argv, cfg.process_timeout_s)
    devices = sorted({str(r.get("device", "?")) for r in results})
    if not all(d.startswith("cuda") for d in devices):
        raise BenchError(f"{job}: the workers trained on {devices}, not only on GPUs")
    return ps_runs.summarize(results)


def run(cfg: BenchConfig, progress) -> dict[str, float]:
    import torch

    from shardps.worker.device import cuda_device_count, no_cuda_reason

    gpus = cuda_device_count()
    out: dict[str, float] = {"gpu_cuda_devices": float(gpus),
                             "gpu_torch_cuda_build": float(torch.version.cuda is not None),
                             "gpu_skipped": float(gpus == 0)}
    if gpus == 0:
        progress(f"skipped: no CUDA device ({no_cuda_reason()})")
        return out
    n, rows = cfg.gpu_train_samples, cfg.e2e_rows
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(gpus))
    progress(f"ctr on {gpus} GPU(s) ({names}): {n:,} samples, {rows:,} x 16 table, batches {cfg.gpu_batches}, "
             f"workers {cfg.gpu_workers}")
    out["gpu_train_samples"] = float(n)
    for batch in cfg.gpu_batches:
        argv = gpu_args(rows, n, batch)
        t0 = time.monotonic()
        single = run_single(argv, cfg.process_timeout_s)
        key = f"gpu_single_b{batch}"
        out[f"{key}_samples_per_s"], out[f"{key}_auc"] = single["samples_per_s"], single["auc"]
        progress(f"batch {batch}: one GPU process {single['samples_per_s']:,.0f} samples/s, AUC {single['auc']:.4f} "
                 f"({time.monotonic() - t0:.0f}s)")
        for w in cfg.gpu_workers:
            t0 = time.monotonic()
            summary = run_workers(cfg, w, argv, f"gpu-w{w}-b{batch}")
            key = f"gpu_ps_w{w}_b{batch}"
            out[f"{key}_samples_per_s"], out[f"{key}_auc"] = summary["samples_per_s"], summary["auc"]
            out[f"{key}_over_single"] = ratio(summary["samples_per_s"], single["samples_per_s"])
            out[f"{key}_auc_minus_single"] = summary["auc"] - single["auc"]
            for phase in ("compute", "copies") + WAITS:
                out[f"{key}_share_{phase}"] = summary.get(f"share_{phase}", 0.0)
            out[f"{key}_share_wait"] = sum(out[f"{key}_share_{phase}"] for phase in WAITS)
            progress(f"batch {batch}: {w} GPU workers x {w} servers {summary['samples_per_s']:,.0f} samples/s "
                     f"({out[f'{key}_over_single']:.2f} x one process), AUC {summary['auc']:.4f}; loop: compute "
                     f"{out[f'{key}_share_compute']:.0%} (copies {out[f'{key}_share_copies']:.0%}), waiting on the "
                     f"servers {out[f'{key}_share_wait']:.0%} "
                     f"({time.monotonic() - t0:.0f}s including start-up)")
    return out
