"""Placement at scale, simulated with the manager's own code.

``shardps.server.placement.plan_placement`` is what the manager runs on every membership
change. For N servers and ``blocks_per_server * N`` blocks (named like real ones,
``job/table/block``, 1,000 blocks per table) this measures

* balance: max / mean blocks per server, for the initial placement and after each change;
* movement: the fraction of block replicas that land on a server they were not on, when one
  server joins (ideal 1/(N+1): the newcomer takes its fair share and nothing else moves) and
  when one leaves (ideal 1/N: only the leaver's share moves);
* the time each ``plan_placement`` call takes.

Targets (issue 4): max/mean <= 1.10 at every size, moved <= 1.2 x ideal.

    python -m shardps.bench.placement_sim --servers 10 100 1000 --blocks-per-server 1000
    python shardps/bench/placement_sim.py --servers 100 --profile      # where the time goes
"""

from __future__ import annotations

import argparse
import json
import sys
import time

MAX_OVER_MEAN_TARGET = 1.10
MOVED_OVER_IDEAL_TARGET = 1.2


def blocks_for(servers: int, blocks_per_server: int) -> list[str]:
    from shardps.server.placement import block_name
    return [block_name("sim", f"t{i // 1000}", i % 1000) for i in range(servers * blocks_per_server)]


def simulate(servers: int, blocks_per_server: int = 1000, replication: int = 1) -> dict[str, float]:
    """One size: the initial placement, one server joining, one leaving (see the module doc)."""
    from shardps.server.placement import placement_stats, plan_placement

    blocks = blocks_for(servers, blocks_per_server)
    nodes = [f"server-{i:04d}" for i in range(servers)]
    t0 = time.perf_counter()
    base = plan_placement(blocks, nodes, replication)
    t1 = time.perf_counter()
    joined_nodes = nodes + [f"server-{servers:04d}"]
    joined = plan_placement(blocks, joined_nodes, replication, previous=base)
    t2 = time.perf_counter()
    left_nodes = nodes[:servers // 2] + nodes[servers // 2 + 1:]
    left = plan_placement(blocks, left_nodes, replication, previous=base) if left_nodes else {}
    t3 = time.perf_counter()
    s0 = placement_stats(base, nodes)
    sj = placement_stats(joined, joined_nodes, base)
    sl = placement_stats(left, left_nodes, base) if left_nodes else None
    out = {
        "servers": servers, "blocks": len(blocks), "replication": replication,
        "max_over_mean": s0.max_over_mean,
        "join_max_over_mean": sj.max_over_mean,
        "join_moved_fraction": sj.moved_fraction,
        "join_ideal_fraction": 1.0 / (servers + 1),
        "plan_seconds": t1 - t0, "join_seconds": t2 - t1, "leave_seconds": t3 - t2,
    }
    out["join_moved_over_ideal"] = out["join_moved_fraction"] / out["join_ideal_fraction"]
    if sl is not None:
        out.update(leave_max_over_mean=sl.max_over_mean, leave_moved_fraction=sl.moved_fraction,
                   leave_ideal_fraction=1.0 / servers)
        out["leave_moved_over_ideal"] = out["leave_moved_fraction"] / out["leave_ideal_fraction"]
    out["worst_max_over_mean"] = max(v for k, v in out.items() if k.endswith("max_over_mean"))
    out["targets_met"] = float(out["worst_max_over_mean"] <= MAX_OVER_MEAN_TARGET
                               and out["join_moved_over_ideal"] <= MOVED_OVER_IDEAL_TARGET
                               and out.get("leave_moved_over_ideal", 0.0) <= MOVED_OVER_IDEAL_TARGET)
    return out


def profile(servers: int, blocks_per_server: int = 1000, top: int = 15) -> str:
    """cProfile of the initial placement and a join at one size: the hot spots, as text."""
    import cProfile
    import io
    import pstats

    from shardps.server.placement import plan_placement

    blocks = blocks_for(servers, blocks_per_server)
    nodes = [f"server-{i:04d}" for i in range(servers)]
    prof = cProfile.Profile()
    prof.enable()
    base = plan_placement(blocks, nodes, 1)
    plan_placement(blocks, nodes + ["server-new"], 1, previous=base)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


# ---------------------------------------------------------------- benchmark part
def _child(servers: int, blocks_per_server: int, queue) -> None:
    try:
        queue.put(simulate(servers, blocks_per_server))
    except BaseException as exc:
        queue.put({"error": f"{type(exc).__name__}: {exc}"})
        raise


def run(cfg, progress) -> dict[str, float]:
    """The benchmark part: each size in a child process, given up after
    ``cfg.placement_timeout_s`` (recorded as ``placement_<N>_timed_out`` = 1)."""
    from shardps.bench.common import BenchError, Children

    out: dict[str, float] = {}
    worst_balance, worst_moved, all_met = 0.0, 0.0, True
    for n in cfg.placement_sizes:
        progress(f"{n} servers, {n * cfg.placement_blocks_per_server:,} blocks ...")
        started = time.monotonic()
        with Children() as children:
            queue = children.ctx.Queue()
            children.spawn(_child, n, cfg.placement_blocks_per_server, queue)
            try:
                res = queue.get(timeout=cfg.placement_timeout_s)
            except Exception:
                res = None
        key = f"placement_{n}"
        if res is None:
            out[f"{key}_timed_out"] = 1.0
            out[f"{key}_seconds_at_least"] = cfg.placement_timeout_s
            all_met = False
            progress(f"{n} servers: not finished after {cfg.placement_timeout_s:.0f}s (recorded as timed out)")
            continue
        if "error" in res:
            raise BenchError(f"placement simulation at {n} servers: {res['error']}")
        out[f"{key}_timed_out"] = 0.0
        for k in ("max_over_mean", "worst_max_over_mean", "join_moved_fraction", "join_moved_over_ideal",
                  "leave_moved_fraction", "leave_moved_over_ideal", "plan_seconds", "join_seconds",
                  "leave_seconds"):
            if k in res:
                out[f"{key}_{k}"] = res[k]
        worst_balance = max(worst_balance, res["worst_max_over_mean"])
        worst_moved = max(worst_moved, res["join_moved_over_ideal"], res.get("leave_moved_over_ideal", 0.0))
        all_met = all_met and bool(res["targets_met"])
        progress(f"{n} servers: max/mean {res['worst_max_over_mean']:.3f}, moved on join "
                 f"{res['join_moved_over_ideal']:.2f} x ideal, on leave {res.get('leave_moved_over_ideal', 0):.2f}"
                 f" x ideal; plan {res['plan_seconds']:.1f}s, join {res['join_seconds']:.1f}s, leave "
                 f"{res['leave_seconds']:.1f}s ({time.monotonic() - started:.0f}s)")
    out["placement_worst_max_over_mean"] = worst_balance
    out["placement_worst_moved_over_ideal"] = worst_moved
    out["placement_targets_met"] = float(all_met)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardps.bench.placement_sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", type=int, nargs="+", default=[10, 100, 1000])
    p.add_argument("--blocks-per-server", type=int, default=1000)
    p.add_argument("--replication", type=int, default=1)
    p.add_argument("--profile", action="store_true", help="print cProfile hot spots at each size")
    p.add_argument("--json", default="", help="also write the results here")
    args = p.parse_args(argv)
    results = []
    ok = True
    for n in args.servers:
        if args.profile:
            print(f"--- profile, {n} servers x {args.blocks_per_server} blocks ---")
            print(profile(n, args.blocks_per_server))
        res = simulate(n, args.blocks_per_server, args.replication)
        results.append(res)
        ok = ok and bool(res["targets_met"])
        print(f"{n:5d} servers {res['blocks']:9,d} blocks  max/mean {res['worst_max_over_mean']:.3f}  "
              f"join moved {res['join_moved_fraction']:.4f} ({res['join_moved_over_ideal']:.2f} x ideal)  "
              f"leave moved {res.get('leave_moved_fraction', 0):.4f} ({res.get('leave_moved_over_ideal', 0):.2f}"
              f" x ideal)  plan {res['plan_seconds']:.1f}s join {res['join_seconds']:.1f}s "
              f"leave {res['leave_seconds']:.1f}s  {'met' if res['targets_met'] else 'MISSED'}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
