"""``shardps run``: your own training script on N processes, started as torchrun starts them.

    shardps run --job ctr --nproc-per-node 4 train.py --epochs 3

Each process gets the cluster and its place in the environment: ``SHARDPS_MANAGER``,
``SHARDPS_JOB`` (``PSClient()`` reads both when not given), and torchrun's ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` (``PSClient.join()`` asks for rank
``RANK`` under a name of its own, so a restarted process takes its rank back). A process that
exits with an error is started again, up to ``--max-restarts`` times per rank; a rank that
exits cleanly is done. When a rank has used its restarts, or on SIGINT / SIGTERM, the others
are stopped (SIGTERM, then SIGKILL after ``--stop-seconds``) and ``shardps run`` exits with
that rank's status (130 / 143 for the signals).

``plan`` (pure: what each rank's environment holds) and ``Supervisor`` (the processes:
start, restart, stop) are separate; the CLI glue is ``run``.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from shardps.errors import InvalidArgument

log = logging.getLogger("shardps.run")


def plan(manager: str, job: str, nproc: int, nnodes: int = 1, node_rank: int = 0) -> list[dict[str, str]]:
    """The environment each local process adds: the cluster, the job, torchrun's variables."""
    if nproc < 1:
        raise InvalidArgument(f"--nproc-per-node {nproc}: at least 1")
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise InvalidArgument(f"--node-rank {node_rank} of --nnodes {nnodes}: use 0 .. nnodes - 1")
    if not job:
        raise InvalidArgument("shardps run needs --job (or SHARDPS_JOB): the job every process joins")
    return [{"SHARDPS_MANAGER": manager, "SHARDPS_JOB": job, "RANK": str(node_rank * nproc + local),
             "WORLD_SIZE": str(nnodes * nproc), "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(nproc)}
            for local in range(nproc)]


@dataclass
class _Rank:
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    restarts: int = 0
    done: bool = False


class Supervisor:
    """Runs ``command`` once per entry of ``envs`` (added to this process's environment) and
    keeps each going until it exits cleanly or has used ``max_restarts``. ``wait`` returns
    the exit status (see the module docstring)."""

    def __init__(self, command: list[str], envs: list[dict[str, str]], max_restarts: int = 3,
                 stop_seconds: float = 10.0, poll: float = 0.1):
        self.command = command
        self.ranks = [_Rank(env) for env in envs]
        self.max_restarts = max_restarts
        self.stop_seconds = stop_seconds
        self.poll = poll
        self.stopping = threading.Event()
        self.signal_status = 0

    def _start(self, r: _Rank) -> None:
        r.proc = subprocess.Popen(self.command, env={**os.environ, **r.env})

    def stop(self, status: int = 0) -> None:
        """Ask ``wait`` to stop every process and return ``status`` (a signal's)."""
        self.signal_status = status
        self.stopping.set()

    def wait(self) -> int:
        for r in self.ranks:
            self._start(r)
        status = 0
        while not self.stopping.wait(self.poll):
            for r in self.ranks:
                if r.done or r.proc is None:
                    continue
                code = r.proc.poll()
                if code is None:
                    continue
                rank = r.env["RANK"]
                if code == 0:
                    r.done = True
                elif r.restarts < self.max_restarts:
                    r.restarts += 1
                    log.warning("rank %s exited with status %d; starting it again (restart %d of %d)",
                                rank, code, r.restarts, self.max_restarts)
                    self._start(r)
                else:
                    log.error("rank %s exited with status %d after %d restart(s): stopping the others",
                              rank, code, r.restarts)
                    status = code
                    self.stopping.set()
                    break
            if all(r.done for r in self.ranks):
                break
        self._stop_all()
        return self.signal_status or status

    def _stop_all(self) -> None:
        running = [r.proc for r in self.ranks if r.proc is not None and r.proc.poll() is None]
        for p in running:
            p.terminate()
        deadline = time.monotonic() + self.stop_seconds
        for p in running:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def run(args) -> int:
    """``shardps run``: the CLI's entry (``args``: its parsed flags and the script's argv)."""
    from shardps import logs
    logs.setup("run", "run", args.log_format)
    if not args.script:
        print("shardps run: name the script to run: shardps run --job J [--nproc-per-node N] script.py [args]",
              file=sys.stderr)
        return 2
    try:
        envs = plan(args.manager, args.job, args.nproc_per_node, args.nnodes, args.node_rank)
    except InvalidArgument as exc:
        print(f"shardps run: {exc.message}", file=sys.stderr)
        return 2
    script, *rest = args.script
    command = [sys.executable, script, *rest] if script.endswith(".py") else [script, *rest]
    supervisor = Supervisor(command, envs, args.max_restarts)
    for sig, status in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        signal.signal(sig, lambda *_, status=status: supervisor.stop(status))
    log.info("running %s as %d process(es) of job %s (ranks %s..%s of %s), manager %s",
             " ".join(command), len(envs), args.job, envs[0]["RANK"], envs[-1]["RANK"], envs[0]["WORLD_SIZE"],
             args.manager)
    return supervisor.wait()
