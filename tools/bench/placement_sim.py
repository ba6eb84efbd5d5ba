"""Placement at scale, simulated with the manager's own code.

A ``ManagerState`` (the manager's decisions, no I/O) holds N servers and
``blocks_per_server * N`` blocks (1,000 blocks per table) with R replicas (2 by default),
placed by the manager's planner (``shardps.server.placement``). Then, in turn:

* **join**: one server registers; the manager plans the moves toward the new balance;
* **death**: one server's lease expires: ``expire`` declares it dead and promotes the backups
  of its blocks (``declare_dead_seconds``); the manager plans the moves that restore R and
  the balance (``restore_plan_seconds``, i.e. ``leave_seconds``);
* **drain**: one server is drained; the manager plans the moves off it.

Each plan is ``ManagerState.plan_moves``: the snapshot the runtime takes under its lock
(``restore_lock_seconds``) plus the planning it does without the lock. Moves are committed
between the steps. Reported: balance (max / mean replicas per server, after every step;
``max_over_mean`` is the worst), movement (replicas that land on a server they were not on,
against the ideal: 1/(N+1) of them for a join, the departed server's share for a death or a
drain), and the seconds of each decision and plan.

Targets, checked at every size (``targets_met``): max/mean <= 1.10, moved <= 1.2 x
ideal, R restored; declaring a server dead <= 0.1 s and each plan <= 2 s (the sizes are
meant for 1,000 servers x 1,000 blocks).

    python -m shardps.tools.bench.placement_sim --servers 10 100 1000 --blocks-per-server 1000
    python tools/bench/placement_sim.py --servers 1000 --profile      # where the time goes
"""

from __future__ import annotations

import argparse
import json
import sys
import time

MAX_OVER_MEAN_TARGET = 1.10
MOVED_OVER_IDEAL_TARGET = 1.2
DECLARE_DEAD_SECONDS_TARGET = 0.1
PLAN_SECONDS_TARGET = 2.0
BLOCKS_PER_TABLE = 1000


def build_state(servers: int, blocks_per_server: int, replication: int = 2):
    """A manager state with ``servers`` serving servers and their blocks placed by the
    planner; returns (state, seconds the initial placement took)."""
    from shardps.server.manager import moves
    from shardps.server.manager.records import BlockRecord, ManagerSettings, TableRecord
    from shardps.server.manager.state import ManagerState
    from shardps.server.placement import place_blocks
    from shardps.tables import Consistency, TableConfig, sparse_table

    st = ManagerState(ManagerSettings(replication=replication, server_lease_seconds=3.0))
    for i in range(servers):
        st.register_server(f"server-{i:04d}", f"h{i}:1", "", "boot", now=0.0)
        st.server_heartbeat(f"server-{i:04d}", 1, st.epoch, {}, now=0.0)
    st.create_job("sim", Consistency.ASYNC, 0)
    total = servers * blocks_per_server
    t0 = time.perf_counter()
    placed = place_blocks(total, st.candidates(), replication)
    seconds = time.perf_counter() - t0
    for k, start in enumerate(range(0, total, BLOCKS_PER_TABLE)):
        reps = placed[start:start + BLOCKS_PER_TABLE]
        spec = sparse_table(f"t{k}", 4, num_blocks=len(reps))
        st.tables[("sim", spec.name)] = TableRecord(
            "sim", spec, TableConfig(), [BlockRecord(r, st.epoch, st.epoch) for r in reps])
    st.bump()
    moves.index(st)         # as the manager does when it starts (ManagerRuntime)
    return st, seconds


def loads(st) -> dict[str, int]:
    from collections import Counter
    from itertools import chain
    counts = Counter(chain.from_iterable(b.replicas for t in st.tables.values() for b in t.blocks))
    return {n: counts.get(n, 0) for n in st.candidates()}


def max_over_mean(st) -> float:
    load = loads(st)
    mean = sum(load.values()) / len(load)
    return max(load.values()) / mean if mean else 0.0


def primary_max_over_mean(st) -> float:
    """Max / mean blocks led per server (a server serves the blocks it leads)."""
    from collections import Counter
    counts = Counter(b.replicas[0] for t in st.tables.values() for b in t.blocks if b.replicas)
    led = [counts.get(n, 0) for n in st.candidates()]
    mean = sum(led) / len(led)
    return max(led) / mean if mean else 0.0


def _plan(st) -> tuple[list, float, float]:
    """(moves, seconds of the whole plan, seconds of its snapshot, taken under the lock)."""
    from shardps.server.manager import moves
    t0 = time.perf_counter()
    snap = moves.snapshot(st)
    t1 = time.perf_counter()
    planned = moves.plan_from(snap)
    return planned, time.perf_counter() - t0, t1 - t0


def simulate(servers: int, blocks_per_server: int = 1000, replication: int = 2) -> dict[str, float]:
    """One size: the initial placement, a join, a death, a drain (see the module doc)."""
    st, plan_seconds = build_state(servers, blocks_per_server, replication)
    total = servers * blocks_per_server * min(replication, servers)
    out: dict[str, float] = {"servers": servers, "blocks": servers * blocks_per_server,
                             "replication": replication, "plan_seconds": plan_seconds,
                             "initial_max_over_mean": max_over_mean(st)}
    primaries = [primary_max_over_mean(st)]
    now = 1.0
    # join
    newcomer = f"server-{servers:04d}"
    st.register_server(newcomer, "new:1", "", "boot", now=now)
    planned, out["join_seconds"], _ = _plan(st)
    out["join_moved_fraction"] = sum(len(m.add) for m in planned) / total
    out["join_ideal_fraction"] = 1.0 / (servers + 1)
    st.commit_moves(planned, now)
    out["join_max_over_mean"] = max_over_mean(st)
    primaries.append(primary_max_over_mean(st))
    # death: every server but one heartbeats, its lease expires
    now = 2.0
    victim = f"server-{servers // 2:04d}"
    for name, rec in st.servers.items():
        if name != victim:
            st.server_heartbeat(name, rec.incarnation, st.epoch, {}, now=now)
    lost = loads(st).get(victim, 0)
    t0 = time.perf_counter()
    dead = st.expire(now=now + 2.0)
    out["declare_dead_seconds"] = time.perf_counter() - t0
    assert dead == [f"server:{victim}"], dead
    planned, out["restore_plan_seconds"], out["restore_lock_seconds"] = _plan(st)
    out["leave_seconds"] = out["restore_plan_seconds"]
    out["leave_moved_fraction"] = sum(len(m.add) for m in planned) / total
    out["leave_ideal_fraction"] = lost / total
    st.commit_moves(planned, now)
    out["restore_under_replicated"] = st.under_replicated()
    out["leave_max_over_mean"] = max_over_mean(st)
    primaries.append(primary_max_over_mean(st))
    # drain
    if len(st.candidates()) > min(replication, servers):
        drained = st.candidates()[0]       # neither the dead one nor the newcomer
        held = loads(st)[drained]
        st.drain_server(drained)
        planned, out["drain_seconds"], _ = _plan(st)
        out["drain_moved_over_ideal"] = sum(len(m.add) for m in planned) / max(1, held)
        st.commit_moves(planned, now)
        out["drain_max_over_mean"] = max_over_mean(st)
        primaries.append(primary_max_over_mean(st))
    out["join_moved_over_ideal"] = out["join_moved_fraction"] / out["join_ideal_fraction"]
    out["leave_moved_over_ideal"] = out["leave_moved_fraction"] / max(out["leave_ideal_fraction"], 1e-12)
    out["worst_max_over_mean"] = max(v for k, v in out.items() if k.endswith("_max_over_mean"))
    out["primary_max_over_mean"] = max(primaries)
    out["max_over_mean"] = out["worst_max_over_mean"]
    out["targets_met"] = float(
        out["worst_max_over_mean"] <= MAX_OVER_MEAN_TARGET and out["restore_under_replicated"] == 0
        and all(out.get(k, 0.0) <= MOVED_OVER_IDEAL_TARGET for k in MOVED_KEYS)
        and out["declare_dead_seconds"] <= DECLARE_DEAD_SECONDS_TARGET
        and all(out.get(k, 0.0) <= PLAN_SECONDS_TARGET for k in
                ("join_seconds", "restore_plan_seconds", "drain_seconds")))
    return out


def profile(servers: int, blocks_per_server: int = 1000, top: int = 15) -> str:
    """cProfile of a join's and a death's plans at one size: the hot spots, as text."""
    import cProfile
    import io
    import pstats

    st, _ = build_state(servers, blocks_per_server)
    st.register_server("server-new", "new:1", "", "boot", now=1.0)
    prof = cProfile.Profile()
    prof.enable()
    planned, _, _ = _plan(st)
    st.commit_moves(planned, 1.0)
    for name, rec in st.servers.items():
        if name != "server-0000":
            st.server_heartbeat(name, rec.incarnation, st.epoch, {}, now=2.0)
    st.expire(now=4.0)
    _plan(st)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


# ---------------------------------------------------------------- benchmark part
KEYS = ("max_over_mean", "worst_max_over_mean", "initial_max_over_mean", "join_max_over_mean",
        "leave_max_over_mean", "drain_max_over_mean", "join_moved_fraction", "join_moved_over_ideal",
        "leave_moved_fraction", "leave_moved_over_ideal", "drain_moved_over_ideal", "plan_seconds",
        "join_seconds", "declare_dead_seconds", "restore_plan_seconds", "restore_lock_seconds",
        "leave_seconds", "drain_seconds", "restore_under_replicated", "primary_max_over_mean",
        "targets_met")
MOVED_KEYS = ("join_moved_over_ideal", "leave_moved_over_ideal", "drain_moved_over_ideal")


def summary(res: dict[str, float]) -> str:
    """One line of a size's results."""
    return (f"max/mean {res['worst_max_over_mean']:.3f} (primaries {res['primary_max_over_mean']:.3f}); "
            f"moved x ideal: join "
            f"{res['join_moved_over_ideal']:.2f}, death {res['leave_moved_over_ideal']:.2f}, drain "
            f"{res.get('drain_moved_over_ideal', 0):.2f}; seconds: initial placement "
            f"{res['plan_seconds']:.2f}, join plan {res['join_seconds']:.3f}, declare dead "
            f"{res['declare_dead_seconds']:.3f}, restore plan {res['restore_plan_seconds']:.3f} "
            f"(under the lock {res['restore_lock_seconds']:.3f}), drain plan "
            f"{res.get('drain_seconds', 0):.3f}; {'met' if res['targets_met'] else 'MISSED'}")


def _child(servers: int, blocks_per_server: int, queue) -> None:
    try:
        queue.put(simulate(servers, blocks_per_server))
    except BaseException as exc:
        queue.put({"error": f"{type(exc).__name__}: {exc}"})
        raise


def run(cfg, progress) -> dict[str, float]:
    """The benchmark part: each size in a child process, given up after
    ``cfg.placement_timeout_s`` (recorded as ``placement_<N>_timed_out`` = 1)."""
    from shardps.tools.bench.common import BenchError, Children

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
        for k in KEYS:
            if k in res:
                out[f"{key}_{k}"] = res[k]
        worst_balance = max(worst_balance, res["worst_max_over_mean"])
        worst_moved = max(worst_moved, *(res.get(k, 0.0) for k in MOVED_KEYS))
        all_met = all_met and bool(res["targets_met"])
        progress(f"{n} servers: {summary(res)} ({time.monotonic() - started:.0f}s)")
    out["placement_worst_max_over_mean"] = worst_balance
    out["placement_worst_moved_over_ideal"] = worst_moved
    out["placement_targets_met"] = float(all_met)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardps.tools.bench.placement_sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", type=int, nargs="+", default=[10, 100, 1000])
    p.add_argument("--blocks-per-server", type=int, default=1000)
    p.add_argument("--replication", type=int, default=2)
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
        print(f"{n:5d} servers {res['blocks']:9,d} blocks  {summary(res)}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
