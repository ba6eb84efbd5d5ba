"""``python -m shardps.tools.verify``: run seeded fault schedules and print the checker's verdict.

    python -m shardps.tools.verify --minutes 30 --seed 7      # one 30-minute schedule (make torture)
    python -m shardps.tools.verify --seeds 1,2,3 --seconds 20 # three 20-second schedules
    python -m shardps.tools.verify --short                    # the short form of tests/test_torture.py

Prints a progress line every 10 s, then a table per schedule (one row each, and its fault
episodes) and a total. Exit status 0 when every schedule passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import replace
from typing import Any

from shardps.tools.verify.checker import HEADER, Verdict
from shardps.tools.verify.defects import DEFECTS
from shardps.tools.verify.run import LIFECYCLE_JOBS, RunConfig, run_schedule, short_form, summary
from shardps.tools.verify.schedule import KINDS, REPLICA_KINDS
from shardps.tools.verify.workload import JOBS


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m shardps.tools.verify", description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=0.0, help="run schedules for this long in all")
    p.add_argument("--seconds", type=float, default=0.0, help="... or this many seconds (default 60)")
    p.add_argument("--seed", type=int, default=0, help="the first seed (default: from the clock, printed)")
    p.add_argument("--seeds", default="", help="comma-separated seeds, one schedule each "
                   "(--seconds / --minutes: the length of each)")
    p.add_argument("--schedule-minutes", type=float, default=0.0,
                   help="the length of one schedule (default: 10 minutes, or all of a shorter run)")
    p.add_argument("--short", action="store_true", help="the short form of tests/test_torture.py (fixed seeds)")
    p.add_argument("--faults", default="", help=f"fault kinds to draw from (default: {','.join(KINDS)}; with "
                                                 f"--managers also {','.join(REPLICA_KINDS)})")
    p.add_argument("--managers", type=int, default=1,
                   help="manager replicas; more than 1 runs them on a real etcd (Debian's etcd-server) "
                        "and draws the leader's kill and its partition from etcd too")
    p.add_argument("--etcd-binary", default="", help="with --managers: the etcd binary (default: on PATH)")
    p.add_argument("--sync-faults-all", action="store_true",
                   help="timed runs: put the SYNC job under every fault kind (default: manager restarts)")
    p.add_argument("--jobs", default=",".join(JOBS), help=f"workloads ({','.join(JOBS)})")
    p.add_argument("--servers", type=int, default=4)
    p.add_argument("--lease", type=float, default=3.0, help="the servers' lease in seconds")
    p.add_argument("--forward-timeout", type=float, default=1.5, help="the servers' forward timeout")
    p.add_argument("--gap-limit", type=float, default=5.0)
    p.add_argument("--keep-going", action="store_true", help="do not stop a schedule at its first gap")
    p.add_argument("--test-reintroduce-defect", default="", choices=["", *DEFECTS],
                   help="TEST-ONLY: the servers re-introduce a fixed defect (tools/verify/defects.py) "
                        "to show the checker catches it")
    p.add_argument("--verbose", action="store_true")
    return p.parse_args(argv)


def print_table(verdicts: list[Verdict], out=sys.stdout) -> None:
    for v in verdicts:
        print(f"\nschedule seed {v.seed}: {len(v.episodes)} fault episodes", file=out)
        for line in v.episodes:
            print(f"  {line}", file=out)
        for job, t in v.per_table.items():
            print(f"  table {job:<13} acked {t['acked']:>6}  unknown {t['unknown']:>4}  lost {t['lost']}  "
                  f"doubled {t['doubled']}  longest gap {v.gaps.get(job, 0.0):.2f}s", file=out)
        if v.rss_growth:
            print("  server RSS growth after warm-up: " + ", ".join(
                f"{k} {g * 100:+.1f}%" for k, g in sorted(v.rss_growth.items())), file=out)
        print(f"  SYNC pushes for an applied step: {v.stale_refused} refused, {v.stale_acked} acknowledged; "
              f"reads checked {v.reads}; servers' leases expired {v.lease_expiries} times; the verifier "
              f"stalled up to {v.host_stall:.1f}s (host load)", file=out)
        print(f"  replicas compared: {v.replica_blocks} blocks ({v.replica_copies} replicas)"
              + ("" if not v.lifecycle else "; lifecycle tables (summed over servers): "
                 + ", ".join(f"{k} {n}" for k, n in v.lifecycle.items())), file=out)
        if not v.passed:
            for x in v.worker_errors:
                print(f"  worker error: {x}", file=out)
        for x in v.violations:
            print(f"  VIOLATION: {x}", file=out)
    print("\n" + HEADER, file=out)
    for v in verdicts:
        print(v.row(), file=out)
    total = summary(verdicts)
    print(total.row().replace(f"{total.seed:>6}", f"{'total':>6}", 1), file=out)
    print(f"verdict: {'PASS' if total.passed else 'FAIL'} ({len(verdicts)} schedules, "
          f"{len(total.violations)} violations; {total.replica_blocks} blocks' replicas compared)",
          file=out, flush=True)


def _warm_kernels(say) -> None:
    """The data path's kernels compiled (or loaded) once here, into numba's cache, before any
    server starts: on a fresh checkout the cluster's processes would otherwise all compile
    them at once, for seconds of CPU each while their leases run (on 2 cores, long enough
    for a lease to expire before the first fault)."""
    from shardps.server.node.node import warm_up_kernels
    took, _, compiled = warm_up_kernels()
    if compiled:
        say(f"compiled {compiled} data-path kernels into numba's cache in {took:.0f} s")


def main(argv=None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    known = KINDS + (REPLICA_KINDS if args.managers > 1 else ())
    faults = tuple(k.strip() for k in args.faults.split(",") if k.strip()) or known
    unknown = [k for k in faults if k not in known]
    if unknown:
        print(f"unknown fault kinds {unknown}; known: {', '.join(known)}"
              + ("" if args.managers > 1 else f" ({', '.join(REPLICA_KINDS)} need --managers 3)"), file=sys.stderr)
        return 2
    _warm_kernels(lambda line: print(line, flush=True))
    if args.short:
        short = short_form(args.test_reintroduce_defect, progress=lambda line: print(line, flush=True),
                           stop_at_failure=False)
        print_table(short)
        return 0 if all(v.passed for v in short) else 1
    total = args.minutes * 60 or args.seconds or 60.0
    first = args.seed or int(time.time()) % 100_000
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    per = args.schedule_minutes * 60 if args.schedule_minutes else min(total, 600.0)
    jobs = tuple(j.strip() for j in args.jobs.split(",") if j.strip())
    if any(j not in JOBS for j in jobs):
        print(f"unknown jobs in {jobs}; known: {', '.join(JOBS)}", file=sys.stderr)
        return 2
    base: dict[str, Any] = dict(lease=args.lease, forward_timeout=args.forward_timeout, jobs=jobs,
                                servers=args.servers, gap_limit=args.gap_limit, faults=faults,
                                fail_fast=not args.keep_going, defect=args.test_reintroduce_defect,
                                managers=args.managers, etcd_binary=args.etcd_binary)
    if per < 300:             # short schedules: judge RSS over what there is
        base.update(rss_warmup=10.0, rss_min_span=max(5.0, per / 3))
    say = lambda line: print(line, flush=True)  # noqa: E731
    verdicts: list[Verdict] = []
    if seeds:
        for seed in seeds:
            verdicts.append(run_schedule(RunConfig(seed=seed, seconds=args.schedule_minutes * 60 or total, **base),
                                         say))
        print_table(verdicts)
        return 0 if all(v.passed for v in verdicts) else 1
    # Timed: schedules of `per` seconds, seeds first, first + 1, ... Unless --jobs or
    # --sync-faults all says otherwise, they alternate: the ASYNC jobs (lifecycle included)
    # under every fault kind, then the SYNC job under manager restarts only (a server that
    # rejoins stalls a SYNC job: the known defect in docs/reliability.md).
    split = not args.sync_faults_all and args.jobs == ",".join(JOBS)
    started, seed, i = time.monotonic(), first, 0
    say(f"shardps verify: {total / 60:.1f} minutes from seed {first}, schedules of {per / 60:.1f} min "
        f"(replay one: --seeds N --schedule-minutes {per / 60:g})"
        + ("; SYNC schedules: manager restarts only (--sync-faults-all to include the rest)" if split else ""))
    while time.monotonic() - started < total - 30 or not verdicts:
        left = total - (time.monotonic() - started)
        cfg = RunConfig(seed=seed, seconds=max(20.0, min(per, left) - 20), **base)
        if split:
            cfg = replace(cfg, jobs=LIFECYCLE_JOBS) if i % 2 == 0 else replace(
                cfg, jobs=("sync",), faults=tuple(k for k in faults if k in ("manager", *REPLICA_KINDS)))
        verdicts.append(run_schedule(cfg, say))
        seed, i = seed + 1, i + 1
    print_table(verdicts)
    return 0 if all(v.passed for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
