"""Cost curves: samples/s and bytes per step as servers and workers go 1 -> 4.

One ``LocalCluster`` grows from the smallest to the largest server count of
``curve_points``; at each point ``(servers, workers)`` a fresh job trains ``ctr`` (async,
``curve_rows`` rows) with ``workers`` real ``shardps worker`` processes for ``curve_steps``
steps each, and is ended afterwards. Bytes per step: the growth of every server's
``shardps_server_bytes_total`` (payload received and sent) over the run, divided by the
steps all workers took; the dense DDP step all-reduces the whole ``rows x 16`` float32
embedding gradient plus the MLP's, for comparison (``ddp_dense_step_bytes_ctr``).

This machine has 2 cores: with a manager, S servers and W workers all busy, every point past
2 processes shares the same two cores, so the curves show contention, not scaling; on real
hosts each server and worker brings its own cores.
"""

from __future__ import annotations

import time

from shardps.tools.bench import ps_runs
from shardps.tools.bench.common import metric_sum, scrape
from shardps.tools.bench.config import BenchConfig
from shardps.tools.bench.e2e import worker_args


def _server_bytes(cluster) -> float:
    return sum(metric_sum(scrape(p.info["metrics"]), "shardps_server_bytes_total")
               for p in cluster.servers.values())


def run(cfg: BenchConfig, progress) -> dict[str, float]:
    from shardps.tools.local import LocalCluster
    from shardps.worker.client import PSClient
    from shardps.worker.models.ctr import DIM, FEATURES

    out: dict[str, float] = {}
    points = sorted(set(cfg.curve_points))
    with LocalCluster(servers=points[0][0], replication=1) as cluster:
        for servers, workers in points:
            while len(cluster.servers) < servers:
                cluster.start_server(f"s{len(cluster.servers)}")
                cluster.wait_servers(len(cluster.servers))
            job = f"curve-s{servers}-w{workers}"
            t0 = time.monotonic()
            before = _server_bytes(cluster)
            results = ps_runs.train(cluster, job, workers,
                                    worker_args("async", cfg.curve_rows, cfg.curve_train_samples, cfg.curve_steps),
                                    cfg.process_timeout_s)
            moved = _server_bytes(cluster) - before
            summary = ps_runs.summarize(results)
            key = f"curve_s{servers}_w{workers}"
            out[f"{key}_samples_per_s"] = summary["samples_per_s"]
            out[f"{key}_bytes_per_step"] = moved / max(1, summary["steps"])
            progress(f"{servers} server(s), {workers} worker(s): {summary['samples_per_s']:,.0f} samples/s, "
                     f"{out[f'{key}_bytes_per_step'] / 1e6:.2f} MB/step ({time.monotonic() - t0:.0f}s)")
            with PSClient(cluster.manager_address, job) as client:
                client.end_job()
    mlp = FEATURES * DIM * 64 + 64 + 64 + 1
    out["ddp_dense_step_bytes_ctr"] = float((cfg.curve_rows * DIM + mlp) * 4)
    out["curve_cores"] = 2.0
    return out
