"""shardps training runs: real ``shardps worker`` processes against a ``LocalCluster``.

Workers are started as ``shardps.tools.bench.probe`` wrapping the ``shardps worker`` command (the
same arguments ``LocalCluster.start_worker`` passes), each writing its ``TrainResult`` JSON
(``--result-file``) and its peak RSS. The workers wait for one another before their first
step (``--wait-workers``), as DDP's ranks meet at a barrier before theirs. Aggregate samples/s
= all workers' samples over the slowest worker's training-loop wall time (set-up, data
generation and evaluation excluded): without the wait, a worker that started first trained
part of its loop alone, and that reading counted its solo start as time the workers shared
(on 2 cores it overstated async by about a third, docs/performance.md).
"""

from __future__ import annotations

import os
from pathlib import Path

from shardps.tools.bench.common import Children, metric_sum, read_json, scrape, wait_all, worker_command

SERVER_PHASES = ("decode", "lookup", "optimizer", "encode")


def train(cluster, job: str, workers: int, args: list[str], timeout: float,
          envs: list[dict] | None = None) -> list[dict]:
    """Run ``workers`` shardps workers of ``job`` to completion; one dict per worker:
    the TrainResult fields plus ``peak_rss_kb``. ``envs``: each worker's additions to the
    environment (a torch process group's, for ``--dense allreduce``)."""
    work = Path(cluster.work_dir)
    with Children() as children:
        procs, logs, files = [], [], []
        for i in range(workers):
            name = f"{job}-w{i}"
            result_file, rss_file, log = (work / f"{name}.json", work / f"{name}.rss.json",
                                          work / f"{name}.log")
            for f in (result_file, rss_file):
                f.unlink(missing_ok=True)
            cmd = worker_command(cluster.manager_address, name,
                                 ["--job", job, "--result-file", str(result_file),
                                  "--wait-workers", str(workers)] + args, rss_file)
            procs.append(children.popen(cmd, log, {**os.environ, **(envs[i] if envs else {})}))
            logs.append(log)
            files.append((result_file, rss_file))
        wait_all(procs, timeout, f"shardps worker of job {job}", logs)
    results = []
    for result_file, rss_file in files:
        res = read_json(result_file)
        res["peak_rss_kb"] = read_json(rss_file)["peak_rss_kb"]
        results.append(res)
    return results


def server_phase_seconds(cluster) -> dict[str, float]:
    """Seconds each phase of data requests took so far, summed over the cluster's servers
    (``shardps_server_phase_seconds_total``, from each server's /metrics)."""
    out = dict.fromkeys(SERVER_PHASES, 0.0)
    for p in cluster.servers.values():
        samples = scrape(p.info["metrics"])
        for phase in SERVER_PHASES:
            out[phase] += metric_sum(samples, "shardps_server_phase_seconds_total", phase=phase)
    return out


def server_shares(before: dict[str, float], after: dict[str, float], servers: int, wall: float) -> dict:
    """Each phase's share of the servers' time over ``wall`` seconds (the mean server),
    and ``idle``: the rest (waiting for requests, SYNC / SSP waits, transport, protobuf)."""
    span = max(1e-9, wall * servers)
    shares = {f"server_share_{k}": (after[k] - before[k]) / span for k in SERVER_PHASES}
    shares["server_share_idle"] = max(0.0, 1.0 - sum(shares.values()))
    return shares


def summarize(results: list[dict]) -> dict:
    samples = sum(r["samples"] for r in results)
    wall = max(r["wall_seconds"] for r in results)
    aucs = [r["metrics"]["test_auc"] for r in results if "test_auc" in r.get("metrics", {})]
    steps = sum(r["steps"] for r in results)
    timings: dict[str, float] = {}
    for r in results:
        for k, v in r.get("timings", {}).items():
            timings[k] = timings.get(k, 0.0) + v
    return {"samples_per_s": samples / wall if wall > 0 else float("nan"),
            "auc": sum(aucs) / len(aucs) if aucs else float("nan"),
            "rank0_peak_rss_mb": results[0]["peak_rss_kb"] / 1024.0,
            "steps": steps,
            "samples": samples,
            "wall_seconds": wall,
            # share of the workers' loop time in each phase (pull_wait, push_wait, compute, local_optimizer)
            **{f"share_{k}": v / max(1e-9, sum(r["wall_seconds"] for r in results)) for k, v in timings.items()}}
