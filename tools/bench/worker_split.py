"""``python -m shardps.tools.bench.worker_split``: where a ctr worker's step goes, against the
step's own forward and backward.

One worker, in this process, trains ctr as ``shardps worker --model ctr`` does
(``run_worker``: ASYNC, the prefetch and the lookahead of 2 by default, one torch thread) against two
server processes (``LocalCluster``, replication 1), one epoch of ``--train-samples``. Per
step, over its training loop:

* wall time (the test set's evaluation after the loop left out, here and below);
* CPU of the training thread (the batch's ids, ``PSModel.pull`` and ``push``, the model's
  forward and backward, the loop's own work);
* CPU of the process's other threads (each push and the next step's pull, sent and read
  in the background, and the heartbeats);
* CPU of the two servers;

and, beside them, the model's forward and backward alone on one thread (``ctr_compute``,
``transport_ctr_step_compute_cpu_ms`` of the bench). Medians of ``--rounds`` runs. The
training thread and the exchanges share one interpreter lock, so a step's wall time is at
least their sum less what runs without the lock (torch's kernels, the socket calls).

    python -m shardps.tools.bench.worker_split                   # 3 rounds of 200,000 samples
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import threading
import time

from shardps.tools.bench.common import proc_cpu_seconds, thread_cpu_seconds
from shardps.tools.bench.transport import ctr_compute

PARTS = ("wall", "training_thread_cpu", "other_threads_cpu", "servers_cpu")


def _threads_cpu() -> dict[int, float]:
    """CPU seconds of each Python thread of this process so far (by ``threading`` ident)."""
    out = {}
    for t in threading.enumerate():
        if t.ident is None:
            continue
        try:
            out[t.ident] = thread_cpu_seconds(t.ident)
        except (OSError, ProcessLookupError):     # it ended meanwhile
            continue
    return out


def one_round(train_samples: int, job: str) -> dict[str, float]:
    """{part: milliseconds per step} of one worker's epoch (``PARTS``)."""
    from shardps.tools.cli import build_parser
    from shardps.tools.local import LocalCluster
    from shardps.worker import runtime

    got: dict[str, float] = {}
    train = runtime.train_with_ps

    def measured(task, ps_model, *args, **kwargs):
        me = threading.get_ident()
        evaluating = [0.0, 0.0]                  # the test set's evaluation after the loop: wall, CPU
        evaluate = task.evaluate

        def timed_evaluate(*a, **kw):
            wall0, cpu0 = time.perf_counter(), time.thread_time()
            try:
                return evaluate(*a, **kw)
            finally:
                evaluating[0] += time.perf_counter() - wall0
                evaluating[1] += time.thread_time() - cpu0

        task = dataclasses.replace(task, evaluate=timed_evaluate)
        threads0, wall0 = _threads_cpu(), time.perf_counter()
        servers0 = sum(proc_cpu_seconds(p) for p in pids)
        try:
            return train(task, ps_model, *args, **kwargs)
        finally:
            wall = time.perf_counter() - wall0 - evaluating[0]
            servers = sum(proc_cpu_seconds(p) for p in pids) - servers0
            spent = {t: c - threads0.get(t, 0.0) for t, c in _threads_cpu().items()}
            steps = max(1, ps_model.step)
            mine = spent.pop(me, 0.0) - evaluating[1]
            for part, seconds in zip(PARTS, (wall, mine, sum(spent.values()), servers)):
                got[part] = seconds / steps * 1e3
            got["steps"] = float(ps_model.step)

    with LocalCluster(servers=2, replication=1) as cluster:
        pids = [s.popen.pid for s in cluster.servers.values()]
        args = build_parser().parse_args([
            "worker", "--manager", cluster.manager_address, "--name", "w0", "--job", job, "--model", "ctr",
            "--mode", "async", "--train-samples", str(train_samples), "--torch-threads", "1", "--device", "cpu"])
        runtime.train_with_ps = measured
        try:
            runtime.run_worker(args)
        finally:
            runtime.train_with_ps = train
    return got


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardps.tools.bench.worker_split", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train-samples", type=int, default=200_000, help="samples of each round's epoch")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    rounds = []
    for r in range(args.rounds):
        got = one_round(args.train_samples, f"worker-split-{r}")
        rounds.append(got)
        print(f"round {r + 1}/{args.rounds}: {got['steps']:.0f} steps, " +
              ", ".join(f"{part} {got[part]:.2f} ms" for part in PARTS), flush=True)
    compute = ctr_compute(lambda _line: None)["transport_ctr_step_compute_cpu_ms"]
    print(f"\nper ctr step, ms (median of {args.rounds} rounds)")
    for part in PARTS:
        print(f"  {part.replace('_', ' '):<28}{statistics.median(r[part] for r in rounds):8.2f}")
    print(f"  {'forward and backward alone':<28}{compute:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
