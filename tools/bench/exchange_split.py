"""``python -m shardps.tools.bench.exchange_split``: where the CPU of one ctr exchange goes, on the
client and on the servers: the compiled kernels (and their argument glue), the socket calls,
and the Python and numpy around them.

One client exchanges ctr steps (each step's gradients of 4 dense tables and about 1,780
distinct rows x 16 of a 1,000,000-row Adagrad table, and the next step's values, as
``PSModel`` sends them) with two servers, all in this process: a manager and the servers as
``shardps local`` starts them, but as threads, so that each part's CPU can be measured per
thread around the functions that do it. An exchange runs on one client thread from routing
to placing the replies; each server reads, answers and replies on a connection thread of its
own. The servers' figure is those threads' CPU; the client's is the rest of this process's
(the caller, the client's threads; the manager and the servers' other threads are idle here).
Printed: CPU per step, medians of ``--rounds`` rounds of ``--steps`` steps, and the share of
it in each part.

    python -m shardps.tools.bench.exchange_split                # 5 rounds of 300 steps

The wrappers cost about a microsecond per call (a few dozen calls a step).
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import threading
import time

import numpy as np

from shardps import id_blocks, kernels
from shardps.rpc import frames, step
from shardps.server.node import optimizer_kernels, storage_kernels
from shardps.tools.bench.common import in_process_cluster, thread_cpu_seconds
from shardps.worker.client import step_plan

# Python-level entry points of the compiled kernels (each a little glue and one compiled call)
KERNELS: list[tuple[object, str]] = [
    (optimizer_kernels, "apply_rows"), (id_blocks, "route_rows"), (kernels, "unique_inverse"),
    (id_blocks, "sparse_block_of"), (kernels, "strictly_increasing"), (storage_kernels, "admit_rows"),
    (kernels, "finite"), (storage_kernels, "_gather_init"), (storage_kernels, "_assign_init"),
    (storage_kernels, "_init_rows"), (step_plan, "_plan"), (step, "_rows_fields"), (kernels, "scatter_rows"),
    (step_plan, "_scatter")]
SOCKET: list[tuple[object, str]] = [(frames, "send_parts"), (frames.FrameReader, "read_frame")]
DENSE = (("fc1.weight", 26624), ("fc1.bias", 64), ("fc2.weight", 64), ("fc2.bias", 1))


class _Spent:
    """CPU seconds per (thread, part), counted by the wrappers; the outermost wrapped call of
    a thread counts (a kernel called inside another wrapped call counts as that one's)."""

    def __init__(self):
        self.by = collections.Counter()
        self.depth = threading.local()
        self.wrapped: list[tuple[object, str, object]] = []

    def wrap(self, owner, name: str, part: str) -> None:
        fn = getattr(owner, name)
        self.wrapped.append((owner, name, fn))

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            depth = getattr(self.depth, "n", 0)
            self.depth.n = depth + 1
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth.n = depth
                if depth == 0:
                    self.by[(threading.get_ident(), part)] += time.thread_time() - t0
        setattr(owner, name, timed)

    def unwrap(self) -> None:
        """Put every wrapped function back."""
        for owner, name, fn in reversed(self.wrapped):
            setattr(owner, name, fn)
        self.wrapped.clear()

    def total(self, threads, part: str, inside: bool = True) -> float:
        """Of ``part``, on ``threads`` (``inside``) or on every other thread."""
        return sum(v for (t, p), v in self.by.items() if p == part and (t in threads) == inside)


def _cpu(threads) -> float:
    """CPU seconds of these threads (``threading.get_ident()`` values) so far."""
    return sum(thread_cpu_seconds(t) for t in threads)


def _noting(answer, threads: set[int]):
    """``answer`` (a data-plane server's), noting the threads that call it."""
    def noted(*args, **kwargs):
        threads.add(threading.get_ident())
        return answer(*args, **kwargs)
    return noted


def measure(steps: int, rounds: int, warmup: int = 200, progress=print) -> dict[str, float]:
    """{part: CPU milliseconds per step} of the client and the servers (medians of rounds)."""
    from shardps.tables import adagrad, adam, normal
    from shardps.worker.client import PSClient
    from shardps.worker.models import ctr

    kernels.warm_up()
    spent = _Spent()
    manager, servers = in_process_cluster(2)
    server_threads: set[int] = set()
    try:
        for srv in servers:              # the threads that answer data requests
            plane = srv.data_plane
            for name in ("_dispatch", "_step"):
                setattr(plane, name, _noting(getattr(plane, name), server_threads))
        ids = ctr.generate(512 * 400, 1_000_000, seed=1000)[0].reshape(400, -1)
        with PSClient(manager.address, "exchange-split") as c:
            c.create_job()
            c.join(heartbeat=False)
            c.create_sparse("emb", 16, num_rows=1_000_000, optimizer=adagrad(0.05), init=normal(0, 0.01, seed=7))
            grads = {n: np.ones(size, np.float32) for n, size in DENSE}
            for n, g in grads.items():
                c.create_dense(n, g.shape, optimizer=adam(1e-3))
            unique = [kernels.unique_inverse(b)[0] for b in ids]
            rows = [np.ones((len(u), 16), np.float32) for u in unique]

            def step(i: int) -> None:
                c.exchange_async([(n, g) for n, g in grads.items()] + [("emb", unique[i % 400], rows[i % 400])],
                                 [(n,) for n in grads] + [("emb", unique[(i + 1) % 400])], clock=0).result()
            for i in range(warmup):      # rows stored, connections open, kernels compiled
                step(i)
            for owner, name in KERNELS:
                spent.wrap(owner, name, "kernels")
            for owner, name in SOCKET:
                spent.wrap(owner, name, "socket")
            got: dict[str, list[float]] = collections.defaultdict(list)
            answering = sorted(server_threads)
            for r in range(rounds):
                spent.by.clear()
                t0, s0 = time.process_time(), _cpu(answering)
                for i in range(steps):
                    step(i)
                srv_all = _cpu(answering) - s0
                client = time.process_time() - t0 - srv_all
                for side, whole, mine in (("client", client, False), ("servers", srv_all, True)):
                    k, s = spent.total(server_threads, "kernels", mine), spent.total(server_threads, "socket", mine)
                    for part, v in (("all", whole), ("kernels", k), ("socket", s), ("python", whole - k - s)):
                        got[f"{side}_{part}"].append(v / steps * 1e3)
                progress(f"round {r + 1}/{rounds}: client {client / steps * 1e3:.3f} ms, "
                         f"servers {srv_all / steps * 1e3:.3f} ms of CPU per step")
            c.leave()
    finally:
        spent.unwrap()
        for srv in servers:
            srv.stop()
        manager.stop()
    return {k: statistics.median(v) for k, v in got.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardps.tools.bench.exchange_split", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="steps per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=200, help="steps before the first round")
    args = p.parse_args(argv)
    out = measure(args.steps, args.rounds, args.warmup)
    print(f"{'CPU per ctr step, ms':<22}{'all':>8}{'kernels':>16}{'socket calls':>16}{'Python, numpy':>16}")
    for side in ("client", "servers"):
        whole = out[f"{side}_all"]
        cells = [f"{out[f'{side}_{p}']:6.3f} ({out[f'{side}_{p}'] / whole:.0%})"
                 for p in ("kernels", "socket", "python")]
        print(f"{side:<22}{whole:8.3f}" + "".join(f"{c:>16}" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
