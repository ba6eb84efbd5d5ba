"""The verifier's workloads: counter workers, readers, and the history they record.

Every worker owns one row (sparse) or one element (dense) in every block of its job's table,
so each push touches every block, and pushes a gradient that SGD with lr 1 turns into +1 on
each of them. The history counts, per worker, the pushes acknowledged (each must be applied
exactly once on every block), refused and unknown (deadline or unavailable: each applied at
most once per block). Jobs:

* ``async-sparse`` and ``async-dense`` (ASYNC): pushes applied as they arrive.
* ``lifecycle`` (ASYNC, ``LifecycleJob``): two sparse tables with a small memory budget,
  admission and a TTL, one of them with a cold tier (the rows its budget evicts go to the
  servers' disk); their values are not counters, their replicas are compared bit for bit.
* ``sync`` (SYNC, ``SYNC_WORKERS`` members): each step a worker pulls with the step's clock
  (waiting for the previous step), pushes ``-SYNC_WORKERS`` (the step applies the mean over
  the members: +1), then reports the step. Sometimes (seeded) it pushes again for the step
  it pulled before, as a loop without clock handling does: that push must be refused, or, if
  acknowledged, applied.

Readers (one per job, not joined) pull every worker's rows and check that a pull started
after an acknowledgement reflects it (ASYNC), that no value exceeds what could have been
applied, and that values never go backwards.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from shardps.errors import FailedPrecondition, ShardpsError
from shardps.id_blocks import sparse_block_of
from shardps.tables import LifecyclePolicy, adagrad, sgd
from shardps.worker.client import PSClient

log = logging.getLogger("shardps.tools.verify")
BLOCKS = 12
BLOCK_SIZE = 16              # dense: elements per block (one per worker at most)
SYNC_WORKERS = 2
TABLE = "counters"
PUSH_TIMEOUT = 10.0


def sparse_ids(index: int, blocks: int = BLOCKS) -> np.ndarray:
    """One id per block from worker ``index``'s own id range."""
    candidates = np.arange(index * 1_000_000, index * 1_000_000 + 100_000, dtype=np.int64)
    present, first = np.unique(sparse_block_of(candidates, blocks), return_index=True)
    if present.shape[0] != blocks:
        raise ValueError(f"ids of worker {index} reach {present.shape[0]} of {blocks} blocks")
    return candidates[first]


@dataclass
class WorkerRecord:
    """One worker's history: outcome counts and the times of its acknowledgements."""

    job: str
    name: str
    index: int
    acked: int = 0
    unknown: int = 0
    refused: int = 0
    stale_acked: int = 0                      # SYNC pushes for a pulled step, acknowledged
    stale_refused: int = 0
    ack_times: list[float] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)
    last_error: dict[str, str] = field(default_factory=dict)     # kind -> message
    in_flight: int = 0

    def error(self, kind: str, exc: BaseException) -> None:
        """Count an error of a call other than a push (history lock held)."""
        self.errors[f"{kind}:{type(exc).__name__}"] += 1
        self.last_error[f"{kind}:{type(exc).__name__}"] = str(exc)[:300]


class History:
    """Every worker's record, and what the readers saw. Thread-safe."""

    def __init__(self):
        self.lock = threading.Lock()
        self.workers: dict[str, WorkerRecord] = {}
        self.stale_reads: list[str] = []        # a pull missed an acknowledged push
        self.backwards: list[str] = []          # a value went down
        self.over_reads: list[str] = []         # a value above acked + unknown + in flight
        self.reads = 0
        self.began = time.monotonic()           # for the times in messages (the run sets it)
        self.read_errors: Counter = Counter()

    def add(self, rec: WorkerRecord) -> WorkerRecord:
        with self.lock:
            self.workers[rec.name] = rec
        return rec

    def begin(self, rec: WorkerRecord) -> None:
        with self.lock:
            rec.in_flight += 1

    def outcome(self, rec: WorkerRecord, outcome: str, exc: BaseException | None = None,
                stale: bool = False) -> None:
        now = time.monotonic()
        with self.lock:
            rec.in_flight -= 1
            if outcome == "acked":
                rec.acked += 1
                rec.ack_times.append(now)
                rec.stale_acked += stale
            elif outcome == "refused":
                rec.refused += 1
                rec.stale_refused += stale
            else:
                rec.unknown += 1
            if exc is not None:
                rec.error("push", exc)

    def snapshot(self, job: str) -> dict[str, tuple[int, int]]:
        """{worker: (acked, acked + unknown + refused + in flight)} of ``job``."""
        with self.lock:
            return {n: (r.acked, r.acked + r.unknown + r.refused + r.in_flight)
                    for n, r in self.workers.items() if r.job == job}

    def last_ack(self, job: str) -> float:
        with self.lock:
            return max((r.ack_times[-1] for r in self.workers.values() if r.job == job and r.ack_times),
                       default=0.0)

    def ack_times(self, job: str) -> list[float]:
        with self.lock:
            return sorted(t for r in self.workers.values() if r.job == job for t in r.ack_times)

    def jobs(self) -> list[str]:
        with self.lock:
            return sorted({r.job for r in self.workers.values()})


def _classify(exc: BaseException) -> str:
    return "refused" if isinstance(exc, FailedPrecondition) else "unknown"


class Job:
    """One job's table, workers and reader."""

    def __init__(self, name: str, consistency: str, dense: bool, workers: int, manager: str,
                 history: History, rng: random.Random, first_index: int, stale_p: float = 0.0):
        self.name, self.consistency, self.dense = name, consistency, dense
        self.manager, self.history = manager, history
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.clients: list[PSClient] = []
        self.records = [history.add(WorkerRecord(name, f"{name}/w{i}", first_index + i))
                        for i in range(workers)]
        self.seeds = [rng.randrange(1 << 30) for _ in range(workers)]
        self.stale_p = stale_p
        self.last_values: dict[str, np.ndarray] = {}

    # ------------------------------------------------------------------ set-up
    def create(self) -> None:
        with PSClient(self.manager, self.name, timeout=30) as c:
            c.create_job(self.consistency)
            if self.dense:
                c.create_dense(TABLE, (BLOCKS * BLOCK_SIZE,), optimizer=sgd(1.0), block_size=BLOCK_SIZE)
            else:
                c.create_sparse(TABLE, 1, optimizer=sgd(1.0), num_blocks=BLOCKS)

    def start(self) -> None:
        for rec, seed in zip(self.records, self.seeds):
            c = PSClient(self.manager, self.name, timeout=PUSH_TIMEOUT)
            c.join(name=rec.name.replace("/", "-"))
            self.clients.append(c)
            target = self._sync_loop if self.consistency == "sync" else self._async_loop
            t = threading.Thread(target=target, args=(c, rec, random.Random(seed)), daemon=True,
                                 name=f"verify-{rec.name}")
            self.threads.append(t)
        for t in self.threads:
            t.start()
        reader = threading.Thread(target=self._read_loop, daemon=True, name=f"verify-read-{self.name}")
        self.threads.append(reader)
        reader.start()

    # ------------------------------------------------------------------ rows
    def rows(self, rec: WorkerRecord):
        if self.dense:
            return np.arange(BLOCKS) * BLOCK_SIZE + rec.index % BLOCK_SIZE
        return sparse_ids(rec.index)

    def _grad(self, rec: WorkerRecord, amount: float) -> np.ndarray:
        if self.dense:
            g = np.zeros(BLOCKS * BLOCK_SIZE, dtype=np.float32)
            g[self.rows(rec)] = -amount
            return g
        return np.full((BLOCKS, 1), -amount, dtype=np.float32)

    def _push(self, c: PSClient, rec: WorkerRecord, amount: float, clock: int | None = None,
              stale: bool = False) -> str:
        self.history.begin(rec)
        try:
            if self.dense:
                c.push_dense(TABLE, self._grad(rec, amount), clock=clock)
            else:
                c.push_rows(TABLE, self.rows(rec), self._grad(rec, amount), clock=clock)
        except ShardpsError as exc:
            outcome = _classify(exc)
            self.history.outcome(rec, outcome, exc, stale)
            return outcome
        except Exception as exc:          # anything else: the outcome is unknown
            log.warning("push of %s raised %r", rec.name, exc)
            self.history.outcome(rec, "unknown", exc, stale)
            return "unknown"
        self.history.outcome(rec, "acked", None, stale)
        return "acked"

    # ------------------------------------------------------------------ loops
    def _async_loop(self, c: PSClient, rec: WorkerRecord, rng: random.Random) -> None:
        while not self.stop.is_set():
            if self._push(c, rec, 1.0) != "acked":
                self.stop.wait(0.05)
            self.stop.wait(rng.uniform(0.005, 0.03))

    def _sync_loop(self, c: PSClient, rec: WorkerRecord, rng: random.Random) -> None:
        try:
            c.wait_for_workers(SYNC_WORKERS, timeout=60)
        except ShardpsError as exc:
            with self.history.lock:
                rec.error("wait_for_workers", exc)
            return
        while not self.stop.is_set():
            self.sync_step(c, rec, rng)

    def sync_step(self, c: PSClient, rec: WorkerRecord, rng: random.Random | None, until: float = 0.0) -> bool:
        """One SYNC step: pull it, push it (and maybe a stale push), report it. False when the
        pull or the report did not succeed by ``until`` (default: 60 s; in the worker thread
        the report also gives up when the job stops)."""
        step = c.current_step
        until = until or time.monotonic() + 60
        try:              # every block: every primary has applied the previous step
            self._pull(c, rec, step, max(1.0, min(PUSH_TIMEOUT, until - time.monotonic())))
        except Exception as exc:
            with self.history.lock:
                rec.error("pull", exc)
            self.stop.wait(0.05)
            return False
        self._push(c, rec, float(SYNC_WORKERS), clock=step)
        if rng is not None and step >= 1 and rng.random() < self.stale_p:
            self._push(c, rec, float(SYNC_WORKERS), clock=step - 1, stale=True)
        while True:
            try:
                c.next_step(timeout=max(1.0, min(PUSH_TIMEOUT, until - time.monotonic())))
                return True
            except Exception as exc:
                with self.history.lock:
                    rec.error("report", exc)
                if time.monotonic() > until or (rng is not None and self.stop.is_set()):
                    return False
                time.sleep(0.1)

    def _pull(self, c: PSClient, rec: WorkerRecord, clock: int, timeout: float) -> None:
        if self.dense:
            c.pull_dense(TABLE, clock=clock, timeout=timeout)
        else:
            c.pull_rows(TABLE, self.rows(rec), clock=clock, timeout=timeout)

    def finish(self, timeout: float = 30.0) -> None:
        """Stop the workers; SYNC: bring every worker to the same step, then wait until the
        servers applied it (a final pull with that clock). At most ``timeout`` seconds."""
        self.stop.set()
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.1, deadline - time.monotonic()))
        if self.consistency == "sync" and self.clients:
            target = max(c.current_step for c in self.clients)
            for c, rec in zip(self.clients, self.records):
                while c.current_step < target and time.monotonic() < deadline:
                    self.sync_step(c, rec, None, deadline)
            for c, rec in zip(self.clients, self.records):
                try:
                    self._pull(c, rec, target, max(1.0, deadline - time.monotonic()))
                except Exception as exc:
                    with self.history.lock:
                        rec.error("final-pull", exc)
        for c in self.clients:
            try:
                c.leave(timeout=5)
            except Exception:
                pass
            c.close()

    # ------------------------------------------------------------------ reads
    def read_values(self, c: PSClient, timeout: float) -> dict[str, np.ndarray]:
        """Every worker's values, one per block."""
        if self.dense:
            values = c.pull_dense(TABLE, timeout=timeout)
            return {r.name: values[self.rows(r)] for r in self.records}
        ids = np.concatenate([self.rows(r) for r in self.records])
        got = c.pull_rows(TABLE, ids, timeout=timeout)[:, 0]
        return {r.name: got[i * BLOCKS:(i + 1) * BLOCKS] for i, r in enumerate(self.records)}

    def _read_loop(self) -> None:
        with PSClient(self.manager, self.name, timeout=PUSH_TIMEOUT) as c:
            while not self.stop.wait(0.25):
                before = self.history.snapshot(self.name)
                try:
                    values = self.read_values(c, PUSH_TIMEOUT)
                except ShardpsError as exc:
                    with self.history.lock:
                        self.history.read_errors[type(exc).__name__] += 1
                    continue
                after = self.history.snapshot(self.name)
                self.check_read(values, before, after)

    def check_read(self, values: dict[str, np.ndarray], before: dict, after: dict) -> None:
        with self.history.lock:
            self.history.reads += 1
            at = f"t={time.monotonic() - self.history.began:.1f}s"
            for name, v in values.items():
                acked, _ = before[name]
                _, most = after[name]
                if self.consistency != "sync" and np.any(v < acked):
                    self.history.stale_reads.append(
                        f"{at} {name}: read {v.min():.0f} < {acked} acknowledged before the pull started")
                if np.any(v > most):
                    self.history.over_reads.append(f"{at} {name}: read {v.max():.0f} > {most} pushes sent")
                last = self.last_values.get(name)
                if last is not None and np.any(v < last):
                    b = int(np.argmax(last - v))
                    self.history.backwards.append(f"{at} {name}: block {b} went from {last[b]:.0f} to {v[b]:.0f}")
                self.last_values[name] = np.maximum(v, last) if last is not None else v.copy()


class LifecycleJob(Job):
    """``lifecycle`` (ASYNC): a sparse table with a ``LifecyclePolicy`` small enough that, in a
    few seconds, rows are not admitted (seen once), evicted by TTL and by the budget, and
    ``COLD_TABLE`` with the same policy and a cold tier (budget evictions move rows to disk
    and back), pushed the same ids in the same push.

    Each push sends ``LIFECYCLE_HOT`` ids of a skewed hot set (recurring: admitted on their
    second push, then kept or evicted by recency) and ``LIFECYCLE_COLD`` ids seen about once
    (dropped by admission); its clock is the worker's push count (the TTL's ticks). Values
    are not counters (evicted rows restart from their initial value): the history counts
    the pushes' outcomes and the gaps, the reader only checks that pulls answer finite
    values, and the run's replica check compares the blocks' replicas bit for bit."""

    def __init__(self, name: str, manager: str, history: History, rng: random.Random, first_index: int,
                 workers: int = 2):
        super().__init__(name, "async", False, workers, manager, history, rng, first_index)

    def create(self) -> None:
        with PSClient(self.manager, self.name, timeout=30) as c:
            c.create_job(self.consistency)
            c.create_sparse(TABLE, LIFECYCLE_DIM, num_rows=LIFECYCLE_ROWS, optimizer=adagrad(0.05),
                            num_blocks=LIFECYCLE_BLOCKS, lifecycle=LIFECYCLE_POLICY)
            c.create_sparse(COLD_TABLE, LIFECYCLE_DIM, num_rows=LIFECYCLE_ROWS, optimizer=adagrad(0.05),
                            num_blocks=LIFECYCLE_BLOCKS, lifecycle=COLD_POLICY)

    def _ids(self, rec: WorkerRecord, gen: np.random.Generator, step: int) -> np.ndarray:
        hot = (LIFECYCLE_HOT_SET * gen.random(LIFECYCLE_HOT) ** 2).astype(np.int64)
        base = LIFECYCLE_HOT_SET + (rec.index * 1_000_003 + step * LIFECYCLE_COLD) % (LIFECYCLE_ROWS // 2)
        cold = base + gen.integers(0, LIFECYCLE_COLD * 4, LIFECYCLE_COLD)
        return np.unique(np.concatenate([hot, cold]))

    def _async_loop(self, c: PSClient, rec: WorkerRecord, rng: random.Random) -> None:
        gen = np.random.default_rng(rng.randrange(1 << 30))
        step = 0
        while not self.stop.is_set():
            step += 1
            ids = self._ids(rec, gen, step)
            grad = gen.standard_normal((ids.shape[0], LIFECYCLE_DIM)).astype(np.float32)
            self.history.begin(rec)
            try:
                c.push_many([(TABLE, ids, grad), (COLD_TABLE, ids, grad)], clock=step)
            except Exception as exc:
                self.history.outcome(rec, _classify(exc) if isinstance(exc, ShardpsError) else "unknown", exc)
                self.stop.wait(0.05)
            else:
                self.history.outcome(rec, "acked")
            self.stop.wait(rng.uniform(0.005, 0.03))

    def read_values(self, c: PSClient, timeout: float) -> dict[str, np.ndarray]:
        """Pull a sample of hot ids (stored, evicted or never admitted alike); their values
        must be finite. Returns no counters."""
        ids = np.unique(np.random.default_rng().integers(0, LIFECYCLE_HOT_SET, 64))
        got = c.pull_many([(TABLE, ids), (COLD_TABLE, ids)], timeout=timeout)
        if not all(np.all(np.isfinite(g)) for g in got.values):
            with self.history.lock:
                self.history.over_reads.append(f"{self.name}: a pull answered non-finite values")
        return {}


LIFECYCLE_DIM = 4
LIFECYCLE_BLOCKS = 8
LIFECYCLE_ROWS = 1 << 20                  # a direct index: 40 bytes a row (adagrad, tick, index)
LIFECYCLE_HOT_SET = 2_000                 # ids 0..1999, skewed: low ids recur most
LIFECYCLE_HOT, LIFECYCLE_COLD = 24, 24    # ids per push of each kind
# per block: the 16 KiB sketch and about 150 rows of 40 bytes; 8 blocks
LIFECYCLE_POLICY = LifecyclePolicy(budget_bytes=LIFECYCLE_BLOCKS * (16_384 + 150 * 40), admit_after=2,
                                   ttl_steps=40)
COLD_TABLE = "cold"
COLD_POLICY = dataclasses.replace(LIFECYCLE_POLICY, cold=True)

JOBS = ("async-sparse", "async-dense", "sync", "lifecycle")


def make_jobs(manager: str, history: History, rng: random.Random, stale_p: float = 0.2,
              names=JOBS) -> list[Job]:
    made = {"async-sparse": lambda: Job("async-sparse", "async", False, 2, manager, history, rng, 0),
            "async-dense": lambda: Job("async-dense", "async", True, 2, manager, history, rng, 2),
            "sync": lambda: Job("sync", "sync", False, SYNC_WORKERS, manager, history, rng, 4,
                                stale_p=stale_p),
            "lifecycle": lambda: LifecycleJob("lifecycle", manager, history, rng, 6)}
    return [made[n]() for n in JOBS if n in names]
