"""Scale: the ctr model end to end at the (workers, servers) points this machine's cores fit.

A point (W, S) runs W ``shardps worker`` processes against S servers (replication 1), W + S
at most the machine's cores (one process per core, one torch thread each): on 2 cores that
is (1, 1); on 16 cores (1, 1), (2, 2), (4, 4) and (8, 4). At each point: shardps ASYNC and SYNC,
DDP over gloo with W ranks and a sparse embedding; once, one process
(``shardps.tools.bench.e2e.run_single``). Samples/s as in ``e2e`` (all samples over the slowest
worker's loop time).

Keys: ``scale_w{W}_s{S}_{ps_async,ps_sync,ddp_sparse}_samples_per_s``,
``scale_w{W}_s{S}_server_busy_share`` (the servers' CPU seconds over wall seconds x S, both
over the whole ASYNC run of the workers: their start-up, table creation, training and
evaluation; 1.0 means the servers used their cores fully), ``scale_single_samples_per_s``,
and per point ``scale_w{W}_s{S}_ps_async_over_w_single`` (ASYNC against W x one process),
``..._ps_async_over_ddp_sparse``, ``..._ps_sync_over_ddp_sparse`` and
``..._ps_async_per_core_over_ddp_sparse_per_core`` (samples/s per core used: W + S for
shardps, W for DDP).
"""

from __future__ import annotations

import os
import time

from shardps.tools.bench import ddp, ps_runs
from shardps.tools.bench.common import proc_cpu_seconds, ratio
from shardps.tools.bench.config import BenchConfig
from shardps.tools.bench.e2e import run_single, worker_args

POINTS = ((1, 1), (2, 2), (4, 4), (8, 4))


def points(cores: int, chosen: tuple[tuple[int, int], ...] = ()) -> list[tuple[int, int]]:
    """The (workers, servers) points with workers + servers <= ``cores``: of ``POINTS``, or of
    ``chosen`` where given (``--scale-points``)."""
    return [(w, s) for w, s in (chosen or POINTS) if w + s <= cores]


def run(cfg: BenchConfig, progress) -> dict[str, float]:
    from shardps.tools.local import LocalCluster

    cores = os.cpu_count() or 1
    n, rows = cfg.scale_train_samples, cfg.e2e_rows
    out: dict[str, float] = {"scale_cores": float(cores)}
    single = run_single(rows, n, cfg.process_timeout_s)["samples_per_s"]
    out["scale_single_samples_per_s"] = single
    progress(f"scale: {cores} cores, points {points(cores, cfg.scale_points)}; one process {single:,.0f} samples/s")
    for w, s in points(cores, cfg.scale_points):
        key = f"scale_w{w}_s{s}"
        for mode in ("async", "sync"):
            t0 = time.monotonic()
            with LocalCluster(servers=s, replication=1) as cluster:
                pids = [p.popen.pid for p in cluster.servers.values()]
                cpu0, wall0 = sum(proc_cpu_seconds(p) for p in pids), time.monotonic()
                results = ps_runs.train(cluster, f"scale-{mode}", w, worker_args(mode, rows, n),
                                        cfg.process_timeout_s)
                wall = time.monotonic() - wall0
                cpu = sum(proc_cpu_seconds(p) for p in pids) - cpu0
            summary = ps_runs.summarize(results)
            out[f"{key}_ps_{mode}_samples_per_s"] = summary["samples_per_s"]
            if mode == "async":
                # CPU and wall time over the same span: the workers' whole run (their start-up,
                # table creation and evaluation included), not their training loop alone
                out[f"{key}_server_busy_share"] = cpu / max(1e-9, wall * s)
            progress(f"{key} ps {mode}: {summary['samples_per_s']:,.0f} samples/s "
                     f"({time.monotonic() - t0:.0f}s including start-up)")
        res = ddp.summarize(ddp.run_ddp(rows, True, n, world=w, seed=0, evaluate=False,
                                        timeout=cfg.process_timeout_s))
        out[f"{key}_ddp_sparse_samples_per_s"] = res["samples_per_s"]
        a, y, d = (out[f"{key}_ps_async_samples_per_s"], out[f"{key}_ps_sync_samples_per_s"],
                   out[f"{key}_ddp_sparse_samples_per_s"])
        out[f"{key}_ps_async_over_w_single"] = ratio(a, w * single)
        out[f"{key}_ps_async_over_ddp_sparse"] = ratio(a, d)
        out[f"{key}_ps_sync_over_ddp_sparse"] = ratio(y, d)
        out[f"{key}_ps_async_per_core_over_ddp_sparse_per_core"] = ratio(a / (w + s), d / w)
        progress(f"{key}: ddp sparse {d:,.0f} samples/s; async {a / (w * single):.2f} x {w} x one process, "
                 f"{a / d:.2f} x ddp sparse; sync {y / d:.2f} x ddp sparse; servers busy "
                 f"{out[f'{key}_server_busy_share']:.0%}")
    return out
