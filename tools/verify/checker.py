"""The checker: the figures of one run and its verdict. No person decides.

Per worker and block, with A acknowledged pushes and U pushes of unknown outcome (refused,
deadline, unavailable): lost = A - value where value < A; doubled = value - (A + U) where
value > A + U. Summed over blocks, these are counts of block updates. A run fails on any lost
or doubled update, any read that missed an acknowledged push or went backwards, any
availability gap over the limit, R not restored after a failure that left enough servers,
the final read failing, a server's RSS growing more than the limit after warm-up, or block
replicas that differ once the workloads stopped (``compare_replicas``: same version,
different state; or versions that still differ after a short wait).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from shardps.tools.verify.cluster import RssSeries
from shardps.tools.verify.schedule import Episode
from shardps.tools.verify.workload import History, Job


@dataclass
class Verdict:
    seed: int
    seconds: float = 0.0
    ops: int = 0                    # push attempts
    acked: int = 0
    unknown: int = 0
    refused: int = 0
    stale_acked: int = 0            # SYNC pushes for an applied step: acknowledged (then applied)
    stale_refused: int = 0
    lost: int = 0
    doubled: int = 0
    reads: int = 0
    stale_reads: int = 0
    backwards: int = 0
    max_gap: float = 0.0
    gaps: dict[str, float] = field(default_factory=dict)        # per job
    episodes: list[str] = field(default_factory=list)           # "kind(victims): gap, restore"
    restore_max: float = 0.0
    rss_growth: dict[str, float] = field(default_factory=dict)  # "s0[pid]": fraction
    per_table: dict[str, dict] = field(default_factory=dict)
    host_stall: float = 0.0         # the longest time the verifier itself was not scheduled
    lease_expiries: int = 0         # "lease expired" lines of the manager's log
    worker_errors: list[str] = field(default_factory=list)     # "worker: kind xN: last message"
    replica_blocks: int = 0         # blocks whose replicas were compared at the end (>= 2 replicas)
    replica_copies: int = 0         # replicas (digests) compared
    lifecycle: dict[str, int] = field(default_factory=dict)     # tables with a policy: summed figures
    violations: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.violations

    def row(self) -> str:
        rss = f"{max(self.rss_growth.values()) * 100:>6.1f}%" if self.rss_growth else f"{'n/a':>7}"
        return (f"{self.seed:>6} {self.seconds:>7.0f} {len(self.episodes):>5} {self.ops:>7} {self.acked:>7} "
                f"{self.unknown + self.refused:>6} {self.lost:>5} {self.doubled:>7} "
                f"{self.stale_reads + self.backwards:>6} {self.max_gap:>6.2f} {self.restore_max:>8.1f} "
                f"{rss} {'PASS' if self.passed else 'FAIL':>7}")


HEADER = (f"{'seed':>6} {'secs':>7} {'fault':>5} {'ops':>7} {'acked':>7} {'unkn':>6} {'lost':>5} "
          f"{'doubled':>7} {'badrd':>6} {'gap_s':>6} {'restore':>8} {'rss':>7} {'verdict':>7}")


def longest_gap(times: list[float], start: float, end: float) -> float:
    """The longest interval in [start, end] without an element of ``times``."""
    inside = [t for t in times if start <= t <= end]
    edges = [start] + inside + [end]
    return max((b - a for a, b in zip(edges, edges[1:])), default=0.0)


def check_values(v: Verdict, jobs: list[Job], history: History, final: dict[str, dict[str, np.ndarray]]) -> None:
    for job in jobs:
        got = final.get(job.name)
        table = {"acked": 0, "unknown": 0, "lost": 0, "doubled": 0, "applied": 0}
        for rec in job.records:
            maybe = rec.unknown + rec.refused
            table["acked"] += rec.acked
            table["unknown"] += maybe
            if got is None or rec.name not in got:      # no final read, or no counters (lifecycle)
                continue
            values = got[rec.name]
            if not np.all(np.abs(values - np.round(values)) < 1e-3):
                v.violations.append(f"{rec.name}: non-integer counters {values.tolist()}")
            values = np.round(values).astype(np.int64)
            lost = int(np.maximum(0, rec.acked - values).sum())
            doubled = int(np.maximum(0, values - rec.acked - maybe).sum())
            table["lost"] += lost
            table["doubled"] += doubled
            table["applied"] += int(values.min())
            if lost or doubled:
                v.violations.append(f"{rec.name}: blocks hold {sorted(set(values.tolist()))} for "
                                    f"{rec.acked} acknowledged + {maybe} unknown pushes "
                                    f"({lost} block updates lost, {doubled} doubled)")
        v.per_table[job.name] = table
        v.lost += table["lost"]
        v.doubled += table["doubled"]
    with history.lock:
        for rec in history.workers.values():
            v.ops += rec.acked + rec.unknown + rec.refused
            v.acked += rec.acked
            v.unknown += rec.unknown
            v.refused += rec.refused
            v.stale_acked += rec.stale_acked
            v.stale_refused += rec.stale_refused
        v.worker_errors = [f"{rec.name}: {kind} x{n}: {rec.last_error.get(kind, '')}"
                           for rec in history.workers.values() for kind, n in rec.errors.most_common(3)]
        v.reads = history.reads
        v.stale_reads = len(history.stale_reads)
        v.backwards = len(history.backwards)
        for what, items in (("read missed an acknowledged push", history.stale_reads),
                            ("value went backwards", history.backwards),
                            ("read above every push sent", history.over_reads)):
            if items:
                v.violations.append(f"{len(items)} x {what}; first: {items[0]}")


def check_gaps(v: Verdict, history: History, episodes: list[Episode], start: float, end: float,
               limit: float) -> None:
    for job in history.jobs():
        times = history.ack_times(job)
        gap = longest_gap(times, start, end)
        v.gaps[job] = gap
        v.max_gap = max(v.max_gap, gap)
        if gap > limit:
            worst = max(((b - a, a) for a, b in zip([start] + times, times + [end])), default=(0, start))
            with history.lock:
                errors = [(n, k, r.last_error.get(k, "")) for r in history.workers.values() if r.job == job
                          for k, n in r.errors.items()]
            top = max(errors, default=None)
            v.violations.append(f"job {job}: no acknowledged push for {gap:.2f}s (> {limit:.0f}s), "
                                f"from t={worst[1] - start:.1f}s"
                                + (f"; most frequent error {top[1]} x{top[0]}: {top[2]}" if top else ""))
    all_times = {job: history.ack_times(job) for job in history.jobs()}
    for ep in episodes:
        if not ep.ended:
            continue
        gap = max((longest_gap(t, ep.started, ep.ended) for t in all_times.values()), default=0.0)
        restore = max(ep.restore_seconds, default=0.0)
        v.restore_max = max(v.restore_max, restore)
        v.episodes.append(f"t={ep.started - start:6.1f}s {ep.describe():<40} gap {gap:5.2f}s  "
                          f"R restored in {', '.join(f'{r:.1f}' for r in ep.restore_seconds) or '-'} s"
                          + (f"  ({'; '.join(ep.notes)})" if ep.notes else ""))
        v.violations.extend(f"{ep.describe()}: {f}" for f in ep.failures)


def check_rss(v: Verdict, series: list[RssSeries], warm_until: float, warmup: float, min_span: float,
              limit: float) -> None:
    """Growth of each server process from its baseline (the mean of its samples in the 5 s
    after ``max(warm_until, its start + warmup)``) to the mean of its last 5 s of samples,
    for processes sampled at least ``min_span`` seconds after the baseline."""
    for s in series:
        if not s.samples:
            continue
        base_at = max(warm_until, s.started + warmup)
        base = [r for t, r in s.samples if base_at <= t <= base_at + 5]
        last_t = s.samples[-1][0]
        if not base or last_t - base_at < min_span:
            continue
        tail = [r for t, r in s.samples if t >= last_t - 5]
        growth = float(np.mean(tail)) / float(np.mean(base)) - 1.0
        v.rss_growth[f"{s.name}[{s.pid}]"] = growth
        if growth > limit:
            v.violations.append(f"server {s.name} (pid {s.pid}) RSS grew {growth * 100:.1f}% after warm-up "
                                f"({np.mean(base) / 2**20:.0f} -> {np.mean(tail) / 2**20:.0f} MiB; limit "
                                f"{limit * 100:.0f}%)")


@dataclass(frozen=True)
class Replica:
    """One server's digest of one block (``GetBlockDigests``)."""

    server: str
    version: int
    primary: bool
    digest: bytes
    loaded: bool = True


def compare_replicas(held: dict[tuple[str, str, int], list[Replica]],
                     replication: int = 0) -> tuple[int, list[str]]:
    """Compare every block's replicas: (blocks with two or more replicas compared, problems).

    A problem names the block and the servers: replicas at the same version whose digests
    differ; versions that differ; a replica whose state is not loaded; a block with more
    than one primary, or fewer than ``replication`` replicas (0: not checked). Transient
    ones (a copy or resync in flight) clear on a later read; the caller decides how long
    to wait."""
    compared, problems = 0, []
    for key in sorted(held):
        reps = sorted(held[key], key=lambda r: r.server)
        name = f"block {key[0]}/{key[1]}/{key[2]}"
        where = ", ".join(f"{r.server}{'*' if r.primary else ''} v{r.version}" for r in reps)
        unloaded = [r.server for r in reps if not r.loaded]
        if unloaded:
            problems.append(f"{name}: state not loaded on {', '.join(unloaded)} ({where})")
            continue
        if sum(r.primary for r in reps) > 1:
            problems.append(f"{name}: more than one primary ({where}; * primary)")
        if replication and len(reps) < replication:
            problems.append(f"{name}: {len(reps)} of {replication} replicas ({where})")
        if len(reps) < 2:
            continue
        compared += 1
        versions = {r.version for r in reps}
        if len(versions) > 1:
            problems.append(f"{name}: replicas at different versions ({where})")
            continue
        digests: dict[bytes, list[str]] = {}
        for r in reps:
            digests.setdefault(r.digest, []).append(f"{r.server}{'*' if r.primary else ''}")
        if len(digests) > 1:
            groups = "; ".join(f"{', '.join(servers)}: {d.hex()[:12]}" for d, servers in digests.items())
            problems.append(f"{name}: replicas differ at version {reps[0].version} ({groups}; * primary)")
    return compared, problems
