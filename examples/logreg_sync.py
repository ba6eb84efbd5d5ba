#!/usr/bin/env python
"""Logistic regression with the raw PSClient (numpy only, no torch) in a SYNC job of 3 workers.

Each worker joins the job's group, waits for the others, and runs the README's step loop:
``with client.step(): w = pull; push(gradient of its own shard)``. In SYNC the servers apply
each step once every worker reported it, with the mean of the workers' gradients: the
result is the same as one worker taking batches 3 times as large. Rank 0 checks exactly
that (it replays the training on all shards at once) and prints the test accuracy.

Started without --rank, the script runs the --workers workers as local processes and ends
the job once they are done (unless --keep-job), so a second run starts from fresh tables and
prints the same agreement; with --rank R it is one worker (start one per machine, each with
its own rank; the job and its table then stay until ``shardps job end logreg``):

    shardps local --servers 2 &             # a cluster at 127.0.0.1:7070
    python examples/logreg_sync.py --workers 3 --steps 200
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys

import numpy as np
from _common import add_job_arguments  # examples/_common.py: this folder is on sys.path

from shardps.errors import PermissionDenied
from shardps.worker import PSClient, sgd

DIM = 20


def dataset(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Every worker makes the same data: ``x [n, DIM + 1]`` (a 1 for the bias last), labels
    in {0, 1} from a hidden linear model with noise."""
    rng = np.random.default_rng(seed)
    w_true = rng.normal(0, 1, DIM + 1).astype(np.float32)
    x = np.hstack([rng.normal(0, 1, (n, DIM)), np.ones((n, 1))]).astype(np.float32)
    y = (rng.random(n) < 1 / (1 + np.exp(-(x @ w_true) * 2))).astype(np.float32)
    return x, y


def gradient(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Mean gradient of the logistic loss over the rows of ``x``."""
    p = 1 / (1 + np.exp(-(x @ w)))
    return (x.T @ (p - y) / np.float32(x.shape[0])).astype(np.float32)


def batch_of(rank: int, step: int, workers: int, batch: int, n_train: int) -> np.ndarray:
    """Rank ``rank``'s rows of step ``step``: the workers' batches tile one large batch."""
    start = (step * workers + rank) * batch
    return np.arange(start, start + batch) % n_train


def worker(rank: int, args: argparse.Namespace) -> int:
    x, y = dataset(args.samples, args.seed)
    n_train = args.samples - args.samples // 5
    lr = np.float32(args.lr)
    with PSClient(args.manager, job=args.job) as client:
        client.create_job("sync")                                  # idempotent: every worker may
        client.create_dense("w", shape=(DIM + 1,), optimizer=sgd(lr=float(lr)), block_size=8)
        client.join(rank_hint=rank)
        client.wait_for_workers(args.workers, timeout=120)       # all of them, before step 0
        steps = range(args.steps)
        if rank == 0:
            from tqdm import tqdm
            steps = tqdm(steps, desc="logreg", unit="step", file=sys.stderr, mininterval=1.0)
        for step in steps:
            with client.step():                                    # SYNC: this step's pull waits for the last
                w = client.pull_dense("w")
                b = batch_of(rank, step, args.workers, args.batch_size, n_train)
                client.push_dense("w", gradient(w, x[b], y[b]))
        if rank == 0:
            w = client.pull_dense("w")                             # after every worker's last step
            # the same training in one process, each step on the workers' batches together
            replay = np.zeros(DIM + 1, np.float32)
            for step in range(args.steps):
                rows = np.concatenate([batch_of(r, step, args.workers, args.batch_size, n_train)
                                       for r in range(args.workers)])
                replay -= lr * gradient(replay, x[rows], y[rows])
            p = 1 / (1 + np.exp(-(x[n_train:] @ w)))
            accuracy = float(((p > 0.5) == (y[n_train:] > 0.5)).mean())
            logloss = float(-np.mean(y[n_train:] * np.log(p + 1e-7) + (1 - y[n_train:]) * np.log(1 - p + 1e-7)))
            print(f"logreg: workers={args.workers} steps={args.steps} test_accuracy={accuracy:.4f} "
                  f"test_logloss={logloss:.4f} sync_vs_one_large_batch_max_diff={np.abs(w - replay).max():.2e}",
                  flush=True)
        client.leave()
    return 0


def end_job(args: argparse.Namespace) -> None:
    """End the job once every worker is done: the next run starts from fresh tables."""
    with PSClient(args.manager, job=args.job) as client:
        try:
            client.end_job()
        except PermissionDenied:
            print("the job's table stays: ending a job needs the admin token; name a fresh --job "
                  "next time", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--manager", default=os.environ.get("SHARDPS_MANAGER", "127.0.0.1:7070"),
                   help="the manager's address (default: $SHARDPS_MANAGER or 127.0.0.1:7070)")
    add_job_arguments(p, "logreg")
    p.add_argument("--workers", type=int, default=3, help="workers in the SYNC group (default: 3)")
    p.add_argument("--rank", type=int, default=-1,
                   help="run only this worker (default: run all --workers as local processes)")
    p.add_argument("--steps", type=int, default=200, help="SYNC steps (default: 200)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per worker per step (default: 32)")
    p.add_argument("--samples", type=int, default=10_000, help="synthetic samples, 20%% for the test (default: 10000)")
    p.add_argument("--lr", type=float, default=0.5, help="SGD learning rate (default: 0.5)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.rank >= 0:
        return worker(args.rank, args)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, args), name=f"logreg-{r}") for r in range(args.workers)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    failed = [proc.name for proc in procs if proc.exitcode != 0]
    if not args.keep_job:
        end_job(args)
    if failed:
        print(f"logreg: {', '.join(failed)} failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
