"""One schedule end to end: start the cluster and the workloads, run the seed's fault
episodes for the time asked, heal, stop the workloads, read every counter, judge."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Callable

from shardps.errors import ShardpsError
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.tools.verify import checker
from shardps.tools.verify.checker import Replica, Verdict
from shardps.tools.verify.cluster import VerifyCluster
from shardps.tools.verify.schedule import KINDS, REPLICA_KINDS, Aborted, Episode, Executor, draw
from shardps.tools.verify.workload import JOBS, History, Job, make_jobs
from shardps.worker.client import PSClient

log = logging.getLogger("shardps.tools.verify")


@dataclass
class RunConfig:
    seed: int = 1
    seconds: float = 60.0             # fault schedule length (episodes start while time is left)
    servers: int = 4                  # s0 is never a victim (the RSS witness)
    replication: int = 2
    lease: float = 3.0                # the servers' lease (the default of `shardps manager`)
    forward_timeout: float = 1.5      # the default of `shardps server` (below the lease)
    gap_limit: float = 5.0
    rss_limit: float = 0.10
    rss_warmup: float = 30.0          # seconds after a server starts (and after the workload's warm-up)
    rss_min_span: float = 60.0        # judge a server's RSS only when sampled this long after warm-up
    restore_timeout: float = 30.0
    faults: tuple[str, ...] = KINDS
    jobs: tuple[str, ...] = JOBS      # workloads (shardps.tools.verify.workload.JOBS)
    stale_p: float = 0.2              # SYNC: chance of a push for the step pulled before
    defect: str = ""                  # TEST-ONLY: shardps.tools.verify.defects
    managers: int = 1                 # > 1: manager replicas on a real etcd (etcd-partition faults)
    etcd_binary: str = ""             # with managers > 1 (default: `etcd` on PATH)
    fail_fast: bool = True            # stop the schedule at the first gap over the limit
    work_dir: str | None = None


class Monitor(threading.Thread):
    """Samples RSS every second, watches the gap live (fail-fast) and prints progress."""

    def __init__(self, cfg: RunConfig, cluster: VerifyCluster, history: History, stop: threading.Event,
                 progress: Callable[[str], None] | None):
        super().__init__(daemon=True, name="verify-monitor")
        self.cfg, self.cluster, self.history, self.stop = cfg, cluster, history, stop
        self.progress = progress
        self.done = threading.Event()
        self.watch_from = 0.0                 # monotonic; 0: not watching gaps yet
        self.episode = "-"
        self.started = time.monotonic()
        self.live_violation = ""
        self.max_stall = 0.0                  # seconds this process was not scheduled (host load)

    def run(self) -> None:
        last_print = 0.0
        prev = time.monotonic()
        while not self.done.wait(0.2):
            now = time.monotonic()
            self.max_stall = max(self.max_stall, now - prev - 0.2)
            prev = now
            if int(now * 5) % 5 == 0:
                self.cluster.sample_rss()
            if self.watch_from and not self.live_violation:
                for job in self.history.jobs():
                    last = max(self.history.last_ack(job), self.watch_from)
                    if now - last > self.cfg.gap_limit:
                        self.live_violation = f"job {job}: no acknowledged push for over {self.cfg.gap_limit:.0f}s"
                        if self.cfg.fail_fast:
                            self.stop.set()
            if self.progress and now - last_print >= 10:
                last_print = now
                with self.history.lock:
                    recs = list(self.history.workers.values())
                    acked = sum(r.acked for r in recs)
                    other = sum(r.unknown + r.refused for r in recs)
                self.progress(f"  [seed {self.cfg.seed}] t={now - self.started:5.0f}s {self.episode:<40} "
                              f"acked={acked} unknown/refused={other} reads={self.history.reads}"
                              + (f"  !! {self.live_violation}" if self.live_violation else ""))


def _final_read(jobs: list[Job], manager: str, timeout: float = 60.0) -> tuple[dict, list[str]]:
    final, problems = {}, []
    for job in jobs:
        deadline = time.monotonic() + timeout
        with PSClient(manager, job.name, timeout=10) as c:
            while True:
                try:
                    final[job.name] = job.read_values(c, 10)
                    break
                except ShardpsError as exc:
                    if time.monotonic() > deadline:
                        problems.append(f"job {job.name}: final read failed for {timeout:.0f}s: {exc}")
                        break
                    time.sleep(0.5)
    return final, problems


def run_schedule(cfg: RunConfig, progress: Callable[[str], None] | None = None) -> Verdict:
    """Run one seeded schedule; returns its verdict (never raises for a failed check)."""
    verdict = Verdict(cfg.seed)
    say = progress or (lambda line: None)
    cluster = VerifyCluster(cfg.servers, cfg.replication, cfg.lease, cfg.forward_timeout, cfg.defect,
                            cfg.work_dir, managers=cfg.managers, etcd_binary=cfg.etcd_binary)
    history = History()
    stop = threading.Event()
    jobs: list[Job] = []
    episodes: list[Episode] = []
    monitor = Monitor(cfg, cluster, history, stop, progress)
    started = time.monotonic()
    try:
        cluster.start()
        monitor.start()
        rng = random.Random(cfg.seed)
        jobs = make_jobs(cluster.manager_address, history, rng, cfg.stale_p, cfg.jobs)
        for job in jobs:
            job.create()
        for job in jobs:
            job.start()
        deadline = time.monotonic() + 60
        while not all(r.acked for r in history.workers.values()):
            if time.monotonic() > deadline:
                verdict.violations.append("warm-up: not every worker had a push acknowledged in 60 s")
                raise Aborted()
            time.sleep(0.05)
        begin = monitor.watch_from = history.began = time.monotonic()
        victims = cluster.names[1:]
        plan = draw(cfg.seed, 10_000, victims, cfg.lease, cfg.faults, cfg.gap_limit)
        say(f"  [seed {cfg.seed}] cluster {cluster.manager_address} ({cfg.servers} servers, R={cfg.replication}, "
            f"lease {cfg.lease}s), work dir {cluster.work_dir}; schedule: "
            + ", ".join(e.describe() for e in plan[:6]) + ", ...")
        executor = Executor(cluster, PSClient(cluster.manager_address, "_verify", timeout=5),
                            stop, cfg.restore_timeout,
                            served=lambda t: all(history.last_ack(j) > t for j in history.jobs()))
        try:
            if not plan:                               # no faults: the workloads alone
                executor.sleep(cfg.seconds)
            for ep in plan:
                if time.monotonic() - begin >= cfg.seconds or stop.is_set():
                    break
                monitor.episode = ep.describe()
                episodes.append(ep)
                executor.run(ep)
                monitor.episode = "quiet"
                executor.sleep(ep.quiet)
        except Aborted:
            pass
        finally:
            end = time.monotonic()
            monitor.watch_from = 0.0
            monitor.episode = "healing"
            executor.stop = threading.Event()          # healing must not abort
            healed = Episode("heal", [], 0.0, 0.0)
            executor.heal(healed)
            executor.wait_restored(healed, "the end of the schedule (every server up)", cluster.live())
            verdict.violations.extend(f"final: {f}" for f in healed.failures)
            executor.status.close()
        monitor.episode = "stopping workloads"
        for job in jobs:
            job.finish(timeout=10.0 if monitor.live_violation else 30.0)
        final, problems = _final_read(jobs, cluster.manager_address, 20.0 if monitor.live_violation else 60.0)
        verdict.violations.extend(problems)
        checker.check_values(verdict, jobs, history, final)
        _check_replicas(verdict, cluster, cfg.replication)
        checker.check_gaps(verdict, history, episodes, begin, end, cfg.gap_limit)
        if monitor.live_violation and not any("no acknowledged push" in x for x in verdict.violations):
            verdict.violations.append(monitor.live_violation)
        monitor.done.set()
        checker.check_rss(verdict, list(cluster.rss.values()), begin, cfg.rss_warmup, cfg.rss_min_span,
                          cfg.rss_limit)
        verdict.seconds = end - begin
        verdict.host_stall = monitor.max_stall
        _manager_log_findings(verdict, cluster)
    except Aborted:
        pass
    except Exception as exc:             # the harness itself failed: a failed run, with the reason
        log.exception("verifier run failed")
        verdict.violations.append(f"harness error: {type(exc).__name__}: {exc}")
    finally:
        monitor.done.set()
        stop.set()
        for job in jobs:
            job.stop.set()
            for c in job.clients:
                c.close()
        cluster.stop(keep_logs=not verdict.passed)
    say(f"  [seed {cfg.seed}] {'PASS' if verdict.passed else 'FAIL'} in {time.monotonic() - started:.0f}s"
        + ("" if verdict.passed else f"; the processes' logs are in {cluster.work_dir}"))
    return verdict


LIFECYCLE_FIGURES = ("rows", "rows_admitted", "rows_not_admitted", "rows_evicted_ttl", "rows_evicted_budget",
                     "rows_cooled", "cold_rows")


def _read_replicas(cluster: VerifyCluster) -> tuple[dict, list[str]]:
    """Every live server's block digests, grouped by block; and the servers that did not answer."""
    held: dict[tuple[str, str, int], list[Replica]] = defaultdict(list)
    errors = []
    for name in cluster.live():
        try:
            answer = cluster.block_digests(name)
        except ShardpsError as exc:
            errors.append(f"server {name} did not answer GetBlockDigests: {exc.status} {exc.details}")
            continue
        for b in answer.blocks:
            held[(b.job, b.table, int(b.block))].append(
                Replica(name, int(b.version), b.role == ps.BLOCK_PRIMARY, bytes(b.digest), b.loaded))
    return dict(held), errors


def _check_replicas(verdict: Verdict, cluster: VerifyCluster, replication: int, wait: float = 10.0) -> None:
    """After the final read, with the workloads stopped: every block's replicas must be
    identical (``checker.compare_replicas``). Differences that can be in flight (versions,
    copies not loaded) get up to ``wait`` seconds; replicas that differ at the same version
    and stay so over three reads are judged at once."""
    deadline = time.monotonic() + wait
    last: list[str] = []
    stable = 0
    while True:
        held, errors = _read_replicas(cluster)
        compared, problems = checker.compare_replicas(
            held, replication if len(cluster.live()) >= replication else 0)
        problems = errors + problems
        stable = stable + 1 if problems and problems == last else 0
        last = problems
        diverged = all(" differ at version " in p for p in problems)
        if not problems or time.monotonic() > deadline or (diverged and stable >= 2):
            break
        time.sleep(0.5)
    verdict.replica_blocks = compared
    verdict.replica_copies = sum(len(r) for r in held.values())
    for p in problems[:10]:
        verdict.violations.append(f"replicas: {p}")
    if len(problems) > 10:
        verdict.violations.append(f"replicas: {len(problems) - 10} more block(s) with the problems above")
    figures = dict.fromkeys(LIFECYCLE_FIGURES, 0)
    for name in cluster.live():
        try:
            status = cluster.node_status(name)
        except ShardpsError:
            continue
        for t in status.tables:
            if t.budget_bytes:
                for f in LIFECYCLE_FIGURES:
                    figures[f] += int(getattr(t, f))
    if any(figures.values()):
        verdict.lifecycle = figures


def _manager_log_findings(verdict: Verdict, cluster: VerifyCluster) -> None:
    """Blocks the manager re-created empty (every replica declared dead): a loss the schedule
    never causes by itself (it keeps R - 1 replicas down at most), so say what the host did."""
    text = ""
    for log in sorted(cluster.local.work_dir.glob("m*.log")):        # manager.log, or m0.log ...
        try:
            text += log.read_text(errors="replace")
        except OSError:
            pass
    lines = [x for x in text.splitlines() if "lost their last replica" in x]
    verdict.lease_expiries = sum("lease expired" in x for x in text.splitlines())
    if lines:
        verdict.violations.append(
            f"the manager re-created blocks empty {len(lines)} time(s) (every replica declared dead; "
            f"{verdict.lease_expiries} lease expiries for the schedule's faults and the host's stalls, "
            f"longest stall of this process {verdict.host_stall:.1f}s): {lines[0][:200]}")


ASYNC_JOBS = ("async-sparse", "async-dense")
LIFECYCLE_JOBS = ASYNC_JOBS + ("lifecycle",)      # the ASYNC schedules of timed runs (make torture)
# The short form (tests/test_torture.py, `python -m shardps.tools.verify --short`): fixed seeds whose
# first episodes cover every fault kind. SYNC runs with manager restarts only: a server that
# rejoins stalls a SYNC job (docs/reliability.md, "what does not hold"; see test_torture.py).
# Every schedule ends with the replica check; seed 1 adds the lifecycle job (issue 18).
SHORT_FORM = (
    RunConfig(seed=3, seconds=8, jobs=("sync",), faults=("manager",), rss_warmup=10.0, rss_min_span=8.0),
    # pause, double-kill, restart-during-copy
    RunConfig(seed=2, seconds=20, jobs=ASYNC_JOBS, rss_warmup=10.0, rss_min_span=8.0),
    # pause, restart-during-copy, manager
    RunConfig(seed=1, seconds=20, jobs=LIFECYCLE_JOBS, rss_warmup=10.0, rss_min_span=8.0),
)


def short_form(defect: str = "", progress: Callable[[str], None] | None = None,
               stop_at_failure: bool = True, work_dir: str | None = None) -> list[Verdict]:
    """Run ``SHORT_FORM`` (with the test-only ``defect`` switch); stop at the first failed
    schedule unless told otherwise. ``work_dir``: where the processes' logs go (default: a
    temporary folder, kept only when a schedule fails)."""
    verdicts = []
    for cfg in SHORT_FORM:
        where = f"{work_dir}/seed-{cfg.seed}" if work_dir else None
        verdicts.append(run_schedule(replace(cfg, defect=defect, work_dir=where), progress))
        if stop_at_failure and not verdicts[-1].passed:
            break
    return verdicts


def summary(verdicts: list[Verdict]) -> Verdict:
    total = Verdict(seed=-1)
    for v in verdicts:
        for name in ("seconds", "ops", "acked", "unknown", "refused", "stale_acked", "stale_refused", "lost",
                     "doubled", "reads", "stale_reads", "backwards"):
            setattr(total, name, getattr(total, name) + getattr(v, name))
        total.max_gap = max(total.max_gap, v.max_gap)
        total.restore_max = max(total.restore_max, v.restore_max)
        total.rss_growth.update({f"{v.seed}:{k}": g for k, g in v.rss_growth.items()})
        total.episodes += v.episodes
        total.replica_blocks += v.replica_blocks
        total.replica_copies += v.replica_copies
        for k, n in v.lifecycle.items():
            total.lifecycle[k] = total.lifecycle.get(k, 0) + n
        total.violations += [f"seed {v.seed}: {x}" for x in v.violations]
    return total


__all__ = ["LIFECYCLE_JOBS", "REPLICA_KINDS", "RunConfig", "SHORT_FORM", "run_schedule", "short_form", "summary"]
