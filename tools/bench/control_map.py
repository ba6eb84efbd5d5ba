"""Shard-map bytes the manager sends, whole maps against changes, simulated with its own code.

A ``ManagerState`` (as in ``placement_sim``) holds N servers and ``blocks_per_server * N``
blocks (1,000 per table) with R = 2, its tables spread over J jobs, each job with W / J
members in its worker group. The manager's maps (``ManagerState.shard_map``) are taken
around two events, each of two epochs:

* **death**: a server's lease expires (promotion: epoch 1), then the moves that restore R are
  committed (epoch 2);
* **join**: a server registers (epoch 1), then the moves toward the new balance (epoch 2).

For each epoch, what the manager sends to every live server and every watching worker:

* ``full``: the whole map to each (what shardps sent before maps travelled as changes);
* ``delta``: the changes since the previous epoch (``shardps.mapdelta.diff``) to each server,
  and each worker its own job's part of them (``changes_only_job``).

Target: ``delta`` <= 1 % of ``full``, for the death at 1,000 servers x 1,000
blocks each with 10,000 workers in 100 jobs. Also reported: a worker's whole map of its own
job (what it is sent when it starts), and the seconds a diff of two whole maps takes.

    python -m shardps.tools.bench.control_map                      # the target's sizes (the defaults)
    python -m shardps.tools.bench.control_map --servers 100 --workers 1000
"""

from __future__ import annotations

import argparse
import sys
import time

DELTA_TARGET = 0.01


def build(servers: int, blocks_per_server: int, jobs: int, workers: int):
    """The simulated manager state: tables over ``jobs`` jobs, ``workers`` members."""
    from shardps.server.manager import moves
    from shardps.tables import Consistency
    from shardps.tools.bench.placement_sim import build_state

    st, _ = build_state(servers, blocks_per_server)
    tables = sorted(st.tables.items())
    st.tables.clear()
    st.jobs.pop("sim", None)
    for j in range(jobs):
        st.create_job(f"job{j:03d}", Consistency.ASYNC, 0)
    for k, ((_, name), rec) in enumerate(tables):
        rec.job = f"job{k % jobs:03d}"
        st.tables[(rec.job, name)] = rec
    for w in range(workers):
        st.join(f"job{w % jobs:03d}", f"w{w:05d}", -1, "", None, 0, now=0.0)
    st.bump()
    moves.index(st)
    return st


def _bytes(old, new, jobs: list[str], workers_per_job: int) -> tuple[int, int, float]:
    """(whole maps to every receiver, changes to every receiver, seconds of the diff)."""
    from shardps import mapdelta
    from shardps.protos.v1 import common_pb2 as pb
    live = sum(1 for s in new.servers if s.state != pb.DEAD)
    t0 = time.perf_counter()
    changes = mapdelta.diff(old, new)
    seconds = time.perf_counter() - t0
    full = new.ByteSize() * (live + workers_per_job * len(jobs))
    delta = changes.ByteSize() * live + workers_per_job * sum(
        mapdelta.changes_only_job(changes, j).ByteSize() for j in jobs)
    return full, delta, seconds


def simulate(servers: int = 1000, blocks_per_server: int = 1000, jobs: int = 100,
             workers: int = 10_000) -> dict[str, float]:
    from shardps import mapdelta
    st = build(servers, blocks_per_server, jobs, workers)
    names = sorted(st.jobs)
    per_job = workers // jobs
    maps = [st.shard_map()]
    out: dict[str, float] = {"servers": servers, "blocks": servers * blocks_per_server, "jobs": jobs,
                             "workers": workers, "map_bytes": maps[0].ByteSize(),
                             "worker_map_bytes": max(mapdelta.only_job(maps[0], j).ByteSize() for j in names)}
    now = 2.0
    victim = f"server-{servers // 2:04d}"
    for name, rec in st.servers.items():
        if name != victim:
            st.server_heartbeat(name, rec.incarnation, st.epoch, {}, now=now)
    st.expire(now=now + 2.0)
    maps.append(st.shard_map())
    st.commit_moves(st.plan_moves(), now)
    maps.append(st.shard_map())
    st.register_server(f"server-{servers:04d}", "new:1", "", "boot", now=now)
    maps.append(st.shard_map())
    st.commit_moves(st.plan_moves(), now)
    maps.append(st.shard_map())
    diff_seconds = 0.0
    for event, pair in (("death", (0, 1, 2)), ("join", (2, 3, 4))):
        full = delta = 0
        for a, b in zip(pair, pair[1:]):
            f, d, s = _bytes(maps[a], maps[b], names, per_job)
            full, delta, diff_seconds = full + f, delta + d, max(diff_seconds, s)
        out[f"{event}_bytes_full"] = full
        out[f"{event}_bytes_delta"] = delta
        out[f"{event}_delta_over_full"] = delta / full
    out["diff_seconds"] = diff_seconds
    out["targets_met"] = float(out["death_delta_over_full"] <= DELTA_TARGET)
    return out


def summary(res: dict[str, float]) -> str:
    return (f"{res['servers']:.0f} servers, {res['blocks']:,.0f} blocks, {res['workers']:,.0f} workers in "
            f"{res['jobs']:.0f} jobs: a map is {res['map_bytes'] / 1e6:.1f} MB (a worker's own job: "
            f"{res['worker_map_bytes'] / 1e3:.1f} kB); one death sends {res['death_bytes_full'] / 1e9:.2f} GB "
            f"as whole maps, {res['death_bytes_delta'] / 1e6:.2f} MB as changes "
            f"({100 * res['death_delta_over_full']:.3f} %); one join {res['join_bytes_full'] / 1e9:.2f} GB / "
            f"{res['join_bytes_delta'] / 1e6:.2f} MB ({100 * res['join_delta_over_full']:.3f} %); a diff "
            f"takes {res['diff_seconds']:.2f} s; target <= {100 * DELTA_TARGET:g} %: "
            f"{'met' if res['targets_met'] else 'MISSED'}")


def run(cfg, progress) -> dict[str, float]:
    """The benchmark part (keys ``control_map_*``)."""
    progress(f"{cfg.control_servers} servers x {cfg.control_blocks_per_server} blocks, "
             f"{cfg.control_workers} workers in {cfg.control_jobs} jobs ...")
    res = simulate(cfg.control_servers, cfg.control_blocks_per_server, cfg.control_jobs, cfg.control_workers)
    progress(summary(res))
    return {f"control_map_{k}": v for k, v in res.items()} | {
        "control_map_bytes_full": res["death_bytes_full"], "control_map_bytes_delta": res["death_bytes_delta"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardps.tools.bench.control_map", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", type=int, default=1000)
    p.add_argument("--blocks-per-server", type=int, default=1000)
    p.add_argument("--jobs", type=int, default=100)
    p.add_argument("--workers", type=int, default=10_000)
    args = p.parse_args(argv)
    res = simulate(args.servers, args.blocks_per_server, args.jobs, args.workers)
    print(summary(res), flush=True)
    return 0 if res["targets_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
