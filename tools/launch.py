"""``shardps run``: your own training script on N processes, started as torchrun starts them.

    shardps run --job ctr --nproc-per-node 4 train.py --epochs 3

Each process gets the cluster and its place in the environment: ``SHARDPS_MANAGER``,
``SHARDPS_JOB`` (``PSClient()`` reads both when not given), and torchrun's ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` (``PSClient.join()`` asks for rank
``RANK`` under a name of its own, so a restarted process takes its rank back). A process that
exits with an error is started again, up to ``--max-restarts`` times per rank; a rank that
exits cleanly is done. A rank that ends with a shardps error no restart can change (its
stderr's last line names ``InvalidArgument``, ``AlreadyExists``, ``PermissionDenied``,
``Unauthenticated`` or ``DataLost``: a setting or a state to fix first) is not started
again. When a rank has used its restarts, or on SIGINT / SIGTERM, the others
are stopped (SIGTERM, then SIGKILL after 10 s) and ``shardps run`` exits with that rank's
status (128 + N for a rank killed by signal N; 130 / 143 when ``shardps run`` itself gets
SIGINT / SIGTERM). Each process's SHARDPS_PARENT_PID names ``shardps run``
(``shardps.tools.children``): a rank that is a ``shardps`` command dies with it.

``--elastic`` is for scripts whose workers all-reduce (``PSModel(dense="allreduce")``): one
rank cannot rejoin a process group the others still hold, so the group restarts whole. There
``shardps run`` hands the processes to torch's own elastic agent, ``python -m
torch.distributed.run`` (torchrun): its c10d rendezvous (``--standalone`` on one machine,
``--rdzv-endpoint`` across several, ``--nnodes MIN:MAX``), its whole-group restarts into a
new rendezvous round (``--max-restarts``) and its environment (``MASTER_ADDR``, ...), with
``SHARDPS_MANAGER`` and ``SHARDPS_JOB`` added. Jobs without all-reduce keep the per-rank
restarts above: a rank's death need not stop the others, whose pushes the servers keep.

``plan`` (pure: what each rank's environment holds), ``elastic_command`` (pure: torchrun's
command line) and ``Supervisor`` (the processes: start, restart, stop) are separate; the
CLI glue is ``run``.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field

from shardps.errors import InvalidArgument
from shardps.tools.children import child_env, stop_processes

log = logging.getLogger("shardps.run")


def elastic_command(command: list[str], nproc: int, nnodes: str = "1", max_restarts: int = 3,
                    rdzv_endpoint: str = "", python: str = sys.executable) -> list[str]:
    """torchrun's command line for ``command`` (through ``shardps.tools.elastic_agent``: torchrun
    that dies with this process; a ``.py`` script runs with ``python``; another
    command with ``--no-python``): ``nproc`` processes here, ``nnodes`` machines ("N" or
    "MIN:MAX"), whole-group restarts, c10d rendezvous (standalone on one machine)."""
    if nproc < 1:
        raise InvalidArgument(f"--nproc-per-node {nproc}: at least 1")
    if not all(part.isdigit() and int(part) >= 1 for part in nnodes.split(":", 1)):
        raise InvalidArgument(f"--nnodes {nnodes!r}: a number of machines, or MIN:MAX with --elastic")
    out = [python, "-m", "shardps.tools.elastic_agent", "--nnodes", nnodes, "--nproc-per-node", str(nproc),
           "--max-restarts", str(max_restarts)]
    if rdzv_endpoint:
        out += ["--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint]
    elif nnodes == "1":
        out += ["--standalone"]
    else:
        raise InvalidArgument(f"--nnodes {nnodes} with --elastic: name the rendezvous, --rdzv-endpoint HOST:PORT "
                              f"(a port on one of the machines, the same for all)")
    script, *rest = command
    return out + ([script, *rest] if script.endswith(".py") else ["--no-python", script, *rest])


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


# shardps errors that starting the same process again cannot change: the arguments, a table
# that exists with other settings, the credentials, or lost data wait for a person
FINAL_ERRORS = ("InvalidArgument", "AlreadyExists", "PermissionDenied", "Unauthenticated", "DataLost")
_ERROR_LINE = re.compile(rb"^shardps\.errors\.(\w+): ?(.*)$")
TAIL_BYTES = 4096          # the end of a rank's stderr kept to read its error from


def final_error(stderr_tail: bytes) -> str | None:
    """The error that ended a process, when it is one of ``FINAL_ERRORS`` (Python's last
    traceback line, ``shardps.errors.AlreadyExists: ...``): ``"AlreadyExists: ..."``; else
    None (restart it)."""
    lines = [line for line in stderr_tail.splitlines() if line.strip()]
    found = _ERROR_LINE.match(lines[-1]) if lines else None
    if found is None or found.group(1).decode() not in FINAL_ERRORS:
        return None
    return f"{found.group(1).decode()}: {found.group(2).decode(errors='replace')}"


@dataclass
class _Rank:
    env: dict[str, str]
    proc: subprocess.Popen = field(init=False)             # set by Supervisor._start
    restarts: int = 0
    done: bool = False
    tail: bytearray = field(default_factory=bytearray)     # the end of its stderr
    reader: threading.Thread | None = None


def exit_status(code: int) -> int:
    """A process's exit status as a shell reports it: ``Popen.returncode`` -N (killed by
    signal N) is 128 + N."""
    return 128 - code if code < 0 else code


class Supervisor:
    """Runs ``command`` once per entry of ``envs`` (added to this process's environment) and
    keeps each going until it exits cleanly or has used ``max_restarts``. ``wait`` returns
    the exit status (see the module docstring)."""

    def __init__(self, command: list[str], envs: list[dict[str, str]], max_restarts: int = 3,
                 stop_seconds: float = 10.0, poll: float = 0.1):
        self.command = command
        self.envs = envs
        self.ranks: list[_Rank] = []
        self.max_restarts = max_restarts
        self.stop_seconds = stop_seconds
        self.poll = poll
        self.stopping = threading.Event()
        self.signal_status = 0

    def _start(self, r: _Rank) -> None:
        """(Re)start rank ``r``: its stderr goes on to this process's, its end kept in
        ``r.tail``. child_env: SHARDPS_PARENT_PID names this process, not its parent."""
        r.tail.clear()
        r.proc = subprocess.Popen(self.command, env=child_env({**os.environ, **r.env}), stderr=subprocess.PIPE)
        r.reader = threading.Thread(target=_forward, args=(r.proc.stderr, r.tail), daemon=True,
                                    name=f"stderr-rank-{r.env['RANK']}")
        r.reader.start()

    def stop(self, status: int = 0) -> None:
        """Ask ``wait`` to stop every process and return ``status`` (a signal's)."""
        self.signal_status = status
        self.stopping.set()

    def wait(self) -> int:
        """Start every rank, keep them going, stop them all however this returns (an
        ``OSError`` of a start, too)."""
        try:
            for env in self.envs:
                r = _Rank(env)
                self._start(r)
                self.ranks.append(r)
            return self._supervise()
        finally:
            self._stop_all()

    def _supervise(self) -> int:
        status = 0
        while not self.stopping.wait(self.poll):
            for r in self.ranks:
                if r.done:
                    continue
                code = r.proc.poll()
                if code is None:
                    continue
                rank = r.env["RANK"]
                if code == 0:
                    r.done = True
                    continue
                if r.reader is not None:
                    r.reader.join(timeout=2.0)          # the rest of its stderr
                final = final_error(bytes(r.tail))
                if final is not None:
                    log.error("rank %s exited with status %d on %s; starting it again cannot change that: "
                              "stopping the others", rank, exit_status(code), final)
                    status = exit_status(code)
                    self.stopping.set()
                    break
                if r.restarts < self.max_restarts:
                    r.restarts += 1
                    log.warning("rank %s exited with status %d; starting it again (restart %d of %d)",
                                rank, exit_status(code), r.restarts, self.max_restarts)
                    self._start(r)
                else:
                    log.error("rank %s exited with status %d after %d restart(s): stopping the others",
                              rank, exit_status(code), r.restarts)
                    status = exit_status(code)
                    self.stopping.set()
                    break
            if all(r.done for r in self.ranks):
                break
        return self.signal_status or status

    def _stop_all(self) -> None:
        stop_processes([r.proc for r in self.ranks], self.stop_seconds)


def _forward(stream, tail: bytearray) -> None:
    """Copy ``stream`` (a rank's stderr) to this process's stderr as it comes (a progress
    bar's carriage returns too), keeping its last ``TAIL_BYTES`` in ``tail``."""
    out = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None
    while True:
        chunk = os.read(stream.fileno(), 65536)
        if not chunk:
            break
        if out is not None:
            out.write(chunk)
            out.flush()
        tail.extend(chunk)
        del tail[:-TAIL_BYTES]
    stream.close()


def run(args) -> int:
    """``shardps run``: the CLI's entry (``args``: its parsed flags and the script's argv)."""
    from shardps import logs
    logs.setup("run", "run", args.log_format)
    if not args.script:
        print("shardps run: name the script to run: shardps run --job J [--nproc-per-node N] script.py [args]",
              file=sys.stderr)
        return 2
    if args.elastic:
        return _run_elastic(args)
    try:
        if not str(args.nnodes).isdigit():
            raise InvalidArgument(f"--nnodes {args.nnodes!r}: a number (MIN:MAX is for --elastic)")
        envs = plan(args.manager, args.job, args.nproc_per_node, int(args.nnodes), args.node_rank)
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
    try:
        return supervisor.wait()
    except OSError as exc:          # the command cannot be started (not found, not executable)
        print(f"shardps run: cannot start {command[0]}: {exc.strerror or exc}", file=sys.stderr)
        return 2


def _run_elastic(args) -> int:
    """``shardps run --elastic``: torchrun's elastic agent runs the processes (see the module
    docstring); its exit status is the run's. SIGINT / SIGTERM are passed on to it."""
    if not args.job:
        print("shardps run: shardps run needs --job (or SHARDPS_JOB): the job every process joins", file=sys.stderr)
        return 2
    try:
        command = elastic_command(args.script, args.nproc_per_node, str(args.nnodes), args.max_restarts,
                                  args.rdzv_endpoint)
    except InvalidArgument as exc:
        print(f"shardps run: {exc.message}", file=sys.stderr)
        return 2
    env = child_env({**os.environ, "SHARDPS_MANAGER": args.manager, "SHARDPS_JOB": args.job})
    log.info("running %s (torch's elastic agent: whole-group restarts) for job %s, manager %s",
             " ".join(command), args.job, args.manager)
    agent = subprocess.Popen(command, env=env)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: agent.send_signal(signum))
    return exit_status(agent.wait())
