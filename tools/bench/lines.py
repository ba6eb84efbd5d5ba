"""``python -m shardps.tools.bench.lines`` (the bench's ``lines`` part): the lines of the project's
own Python that a training step executes, counted with ``sys.settrace``.

Counted, not timed: the same code and the same step give the same count whatever else the
machine does, so these figures need no side-by-side run. What counts is every ``line``
event in a frame of the library's modules (the ground floor ``shardps``, ``shardps.server``,
``shardps.worker``, the generated ``shardps.protos``), the tools excluded (``shardps.tools``:
the bench, the verifier, the cli, local, launch, devcerts and netproxy modules); a compiled
kernel's loops count nothing, the Python around it does.

* ``ctr``: the worker of ``shardps worker --model ctr`` (ASYNC, its defaults: overlap,
  lookahead 2, batch 512, one torch thread) in this process, against a manager and two
  servers also in this process (replication 1). After ``WARMUP`` steps, over ``STEPS``
  steps: the lines on the training thread (``lines_worker_train_per_step``), on the
  worker's other threads (the exchanges, heartbeats: ``lines_worker_other_per_step``), and
  on the servers' data-plane connection threads per data request they answered
  (``lines_server_per_request``: a request is one Step, Push, Pull or Exchange frame to one
  server). The cluster's own threads (gRPC handlers, heartbeats, map installs) are left out.
* ``many tables``: the 12-table model of ``e2e_many_tables`` (``bench/many_tables.py``) in
  its plain loop (``pull``, forward, backward, ``push``): the worker's lines on every
  thread per step (``lines_many_tables_worker_per_step``).

Also written: the calls (frames of the library entered) per step and per request, the same
way (``calls_*``). The counting slows the step about tenfold; the counts do not change with
it.

    python -m shardps.tools.bench.lines                 # both, printed
    python -m shardps.tools.bench --only lines          # into bench/results/latest.json
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
from pathlib import Path
from typing import Callable

from shardps.tools.bench.config import BenchConfig

WARMUP, STEPS = 30, 40
ROOT = Path(__file__).resolve().parents[2]
LIBRARY = tuple(str(ROOT / d) + "/" for d in ("shardps", "server", "worker", "protos"))

# threads of the cluster's machinery, not of a data request or of the worker (name prefixes)
CLUSTER_THREADS = ("rpc", "install", "heartbeat", "map-sync", "stall-watch", "stream-watchdog",
                   "kernels-warm-up", "dataplane-accept")
SERVER_THREADS = ("dataplane-",)         # a server's data-plane connection: one per client connection


def in_library(filename: str) -> bool:
    """Whether a code object's file is one of the library's modules (``tools/``, the tools'
    own, is not among them)."""
    return filename.startswith(LIBRARY)


class LineCounter:
    """Counts the ``line`` events (and calls) of frames whose file ``wanted(filename)``
    accepts, per thread, while ``active``. ``install`` traces this thread and every thread
    started afterwards; ``remove`` stops this thread's tracing (threads started meanwhile
    keep their tracer until they end, counting nothing once inactive)."""

    def __init__(self, wanted: Callable[[str], bool] = in_library, detail: bool = False):
        self.wanted = wanted
        self.active = False
        # with ``detail``: lines per (thread, file, function), for ``--top``
        self.where: collections.Counter[tuple[int, str, str]] | None = collections.Counter() if detail else None
        self.lines: collections.Counter[int] = collections.Counter()
        self.calls: collections.Counter[int] = collections.Counter()
        self.names: dict[int, str] = {}
        self._files: dict[str, bool] = {}

    def _call(self, frame, event, arg):
        name = frame.f_code.co_filename
        keep = self._files.get(name)
        if keep is None:
            keep = self._files[name] = self.wanted(name)
        if not keep:
            return None
        if self.active:
            ident = threading.get_ident()
            if ident not in self.names:
                self.names[ident] = threading.current_thread().name
            self.calls[ident] += 1
        return self._line

    def _line(self, frame, event, arg):
        if event == "line" and self.active:
            ident = threading.get_ident()
            self.lines[ident] += 1
            if self.where is not None:
                code = frame.f_code
                self.where[(ident, code.co_filename, code.co_name)] += 1
        return self._line

    def install(self) -> None:
        threading.settrace(self._call)
        sys.settrace(self._call)

    def remove(self) -> None:
        self.active = False
        sys.settrace(None)
        threading.settrace(None)          # None: no tracer for the threads started from now on

    def role(self, ident: int, training: int) -> str:
        """A counted thread's role (see ``by_role``)."""
        name = self.names.get(ident, "")
        return ("train" if ident == training else "server" if name.startswith(SERVER_THREADS)
                else "cluster" if name.startswith(CLUSTER_THREADS) else "other")

    def top(self, training: int, roles: tuple[str, ...], n: int) -> list[tuple[str, int]]:
        """The ``n`` functions of the threads of ``roles`` that ran the most lines ("file:function", lines)."""
        assert self.where is not None, "a LineCounter(detail=True)"
        by_function: collections.Counter[str] = collections.Counter()
        for (ident, filename, function), lines in self.where.items():
            if self.role(ident, training) in roles:
                by_function[f"{Path(filename).relative_to(ROOT)}:{function}"] += lines
        return by_function.most_common(n)

    def by_role(self, training: int) -> dict[str, tuple[int, int]]:
        """(lines, calls) per role of the counted threads: ``train`` (the thread ``training``),
        ``server`` (data-plane connections), ``cluster`` (its machinery), ``other`` (the
        rest: the worker's threads)."""
        out = {role: [0, 0] for role in ("train", "server", "cluster", "other")}
        for ident in set(self.lines) | set(self.calls):
            role = self.role(ident, training)
            out[role][0] += self.lines[ident]
            out[role][1] += self.calls[ident]
        return {role: (lines, calls) for role, (lines, calls) in out.items()}


class StepWindow:
    """Counting over steps ``[warmup, warmup + steps)`` of a ``PSModel``: ``PSModel.push``
    wrapped (for the duration of a ``with``) so that the counter turns on at the start of
    step ``warmup``'s push and off at the start of step ``warmup + steps``'s: whole steps
    (a push, then the next step's pull, forward and backward). ``at_start`` / ``at_end``
    are called at those two moments (the servers' request counts)."""

    def __init__(self, counter: LineCounter, warmup: int, steps: int,
                 at_start: Callable[[], None] = lambda: None, at_end: Callable[[], None] = lambda: None):
        self.counter, self.warmup, self.steps = counter, warmup, steps
        self.at_start, self.at_end = at_start, at_end
        self.pushes = 0
        self.training = 0           # the thread that pushes
        self.done = threading.Event()

    def __enter__(self) -> "StepWindow":
        from shardps.worker.torch_ps import PSModel
        self._push = PSModel.push
        window = self

        def push(model):
            if window.pushes == window.warmup:
                window.training = threading.get_ident()
                window.at_start()
                window.counter.active = True
            elif window.pushes == window.warmup + window.steps:
                window.counter.active = False
                window.at_end()
                window.done.set()
            window.pushes += 1
            return window._push(model)
        PSModel.push = push                  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc) -> None:
        from shardps.worker.torch_ps import PSModel
        PSModel.push = self._push            # type: ignore[method-assign]
        self.counter.active = False


def _data_requests(servers) -> float:
    """The data requests (``metrics.DATA_METHODS``) the in-process ``servers`` answered so far."""
    from shardps.metrics import DATA_METHODS
    total = 0.0
    for s in servers:
        for m in s.metrics.registry.collect():
            if m.name == "grpc_server_handled":
                total += sum(x.value for x in m.samples if x.name.endswith("_total")
                             and x.labels.get("grpc_method") in DATA_METHODS)
    return total


def count_ctr(warmup: int = WARMUP, steps: int = STEPS, top: int = 0, mode: str = "async") -> dict[str, float]:
    """The ``ctr`` counts (see the module docstring); ``top``: also print the functions that
    ran the most lines, per role; ``mode``: the job's consistency (``shardps worker --mode``)."""
    from shardps.tools.bench.common import in_process_cluster
    from shardps.tools.cli import build_parser
    from shardps.worker import runtime

    counter = LineCounter(detail=top > 0)
    requests: list[float] = []
    manager, servers = in_process_cluster(2)
    try:
        window = StepWindow(counter, warmup, steps, at_start=lambda: requests.append(_data_requests(servers)),
                            at_end=lambda: requests.append(_data_requests(servers)))
        args = build_parser().parse_args([
            "worker", "--manager", manager.address, "--name", "w0", "--job", "lines-ctr", "--model", "ctr",
            "--mode", mode, "--train-samples", str(512 * (warmup + steps + 4)), "--torch-threads", "1",
            "--device", "cpu", "--log-level", "warning"])
        counter.install()
        try:
            with window:
                runtime.run_worker(args)
        finally:
            counter.remove()
    finally:
        for s in servers:
            s.stop()
        manager.stop()
    if not window.done.is_set() or len(requests) != 2:
        raise RuntimeError(f"the ctr worker took {window.pushes} steps: fewer than {warmup + steps + 1}")
    roles = counter.by_role(window.training)
    served = requests[1] - requests[0]
    for role, per in (("train", steps), ("other", steps), ("server", max(1.0, served))) if top else ():
        _print_top(f"ctr, {role} (per {'request' if role == 'server' else 'step'})",
                   counter.top(window.training, (role,), top), per)
    return {"lines_worker_train_per_step": roles["train"][0] / steps,
            "lines_worker_other_per_step": roles["other"][0] / steps,
            "lines_server_per_request": roles["server"][0] / max(1.0, served),
            "calls_worker_train_per_step": roles["train"][1] / steps,
            "calls_worker_other_per_step": roles["other"][1] / steps,
            "calls_server_per_request": roles["server"][1] / max(1.0, served),
            "lines_server_requests_per_step": served / steps}


def _print_top(what: str, functions: list[tuple[str, int]], per: float) -> None:
    print(f"{what}, the functions that ran the most lines:")
    for function, lines in functions:
        print(f"  {lines / per:8.1f}  {function}")


def count_many_tables(warmup: int = WARMUP, steps: int = STEPS, top: int = 0) -> dict[str, float]:
    """The ``many tables`` counts: the worker's lines per step on every thread of its own;
    ``top``: also print the functions that ran the most of them."""
    import torch
    import torch.nn.functional as F

    from shardps.tables import adagrad, adam, normal
    from shardps.tools.bench.common import in_process_cluster
    from shardps.tools.bench.many_tables import BATCH, DIM, FIELDS, ROWS, _data, _model
    from shardps.worker.client import PSClient
    from shardps.worker.torch_ps import PSEmbedding, PSModel

    total = warmup + steps + 1
    ids, labels = _data(total, FIELDS, ROWS)
    counter = LineCounter(detail=top > 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    manager, servers = in_process_cluster(2)
    try:
        counter.install()
        try:
            with PSClient(manager.address, "lines-many-tables") as client, \
                    StepWindow(counter, warmup, steps) as window:
                client.create_job()
                client.join()
                module = _model(FIELDS, ROWS, lambda i: PSEmbedding(ROWS, DIM, table=f"field{i}",
                                                                    optimizer=adagrad(0.05),
                                                                    init=normal(0.0, 0.01, seed=i)))
                model = PSModel(module, client, optimizer=adam(2e-3))
                model.create_tables()
                xs, ys = torch.from_numpy(ids), torch.from_numpy(labels)
                for step in range(total):
                    model.pull()
                    F.binary_cross_entropy_with_logits(model(xs[step]), ys[step]).backward()
                    model.push()
                model.flush()
                client.leave()
        finally:
            counter.remove()
    finally:
        torch.set_num_threads(threads)
        for s in servers:
            s.stop()
        manager.stop()
    if not window.done.is_set():
        raise RuntimeError(f"the many-tables loop took {window.pushes} steps: fewer than {total}")
    roles = counter.by_role(window.training)
    assert BATCH and FIELDS         # the model's shape: bench/many_tables.py
    if top:
        _print_top("12 tables, the worker (per step)", counter.top(window.training, ("train", "other"), top), steps)
    return {"lines_many_tables_worker_per_step": (roles["train"][0] + roles["other"][0]) / steps,
            "calls_many_tables_worker_per_step": (roles["train"][1] + roles["other"][1]) / steps}


def run(cfg: BenchConfig, progress) -> dict[str, float]:
    steps = max(2, min(STEPS, cfg.lines_steps))
    progress(f"lines: a ctr step and a 12-table step, {steps} steps after {WARMUP}, counted with sys.settrace")
    out = count_ctr(WARMUP, steps)
    progress(f"lines: ctr worker {out['lines_worker_train_per_step']:.0f} on the training thread, "
             f"{out['lines_worker_other_per_step']:.0f} on its other threads per step; servers "
             f"{out['lines_server_per_request']:.0f} per request ({out['lines_server_requests_per_step']:.1f} "
             f"requests per step)")
    out.update(count_many_tables(WARMUP, steps))
    progress(f"lines: 12 tables, the worker's {out['lines_many_tables_worker_per_step']:.0f} per step")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardps.tools.bench.lines", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--warmup", type=int, default=WARMUP, help=f"steps before counting (default {WARMUP})")
    p.add_argument("--steps", type=int, default=STEPS, help=f"steps counted (default {STEPS})")
    p.add_argument("--top", type=int, default=0, metavar="N",
                   help="also print the N functions that ran the most lines on each side of a ctr step, "
                   "and on the worker of a 12-table step")
    p.add_argument("--mode", choices=("async", "sync", "ssp"), default="async",
                   help="the ctr job's consistency (default async, as the bench part counts it; sync: every "
                   "step a SYNC step, which the servers' general path serves)")
    args = p.parse_args(argv)
    out = count_ctr(args.warmup, args.steps, args.top, args.mode)
    out.update(count_many_tables(args.warmup, args.steps, args.top))
    for key in sorted(out):
        print(f"{key:<40}{out[key]:10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
