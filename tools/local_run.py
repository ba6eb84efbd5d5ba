"""``shardps local``'s command: a ``LocalCluster`` (``shardps.tools.local``), optionally secured,
and M workers training ``--model`` on it; the files the user named written where the user
is, and the temporary work directory removed with a word about it (``--keep``)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from shardps.errors import ShardpsError
from shardps.tools.local import LocalCluster, Secured, tail

_RESULT = re.compile(r"^shardps worker .*")


def run_local(args, worker_flags: list[str]) -> int:
    """``shardps local``: see the module docstring. ``worker_flags`` are the flags of
    ``shardps worker`` (``shardps.tools.cli.FLAGS["worker"]``): the workers get those of ``args``."""
    from shardps import logs
    logs.setup("local", "local", args.log_format)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    started = time.perf_counter()
    cluster = LocalCluster(args.servers, args.replication, args.work_dir or None, args.log_format,
                           manager_port=args.port)
    secured = None
    code = 0
    try:
        try:
            if getattr(args, "secure", False):
                secured = Secured(cluster.work_dir / "secrets")
                cluster.manager_args = cluster.server_args = secured.process_args()
                cluster.tls, cluster.token = secured.client_tls(), secured.admin_token
            cluster.start()
            client_args: list[str] = []
            if secured is not None:
                token_file = secured.create_job(cluster.manager_address, args.job, args.mode, args.staleness)
                client_args = [f"--{k[8:].lower().replace('_', '-')}={v}"
                               for k, v in secured.client_env(cluster.manager_address, token_file).items()
                               if k != "SHARDPS_MANAGER"]
        except ShardpsError as exc:
            print(f"shardps local: {exc.message}", file=sys.stderr, flush=True)
            return 2
        print(f"shardps local: manager at {cluster.manager_address}; {args.servers} servers "
              f"SERVING, replication {cluster.replication}; logs in {cluster.work_dir}", flush=True)
        print(f"shardps local: {metrics_line(cluster)}", flush=True)
        watch = threading.Thread(target=_watch, args=(cluster, stop), daemon=True, name="watch-processes")
        watch.start()
        if cluster.replication < 2 and args.servers >= 2:
            print(f"shardps local: warning: replication {cluster.replication}: a server's death loses "
                  f"the values of its blocks (restored from the latest checkpoint where there is one, "
                  f"else DATA_LOSS); --replication 2 survives it", flush=True)
        if secured is not None:
            print(secured.instructions(cluster.manager_address, args.job, token_file), flush=True)
        if args.workers <= 0:
            while not stop.wait(0.5):
                pass
            return 0
        code = _train_locally(cluster, args, worker_flags, stop, started, client_args)
    except KeyboardInterrupt:
        code = 130
    finally:
        stop.set()                       # the watcher says nothing of the processes stopped now
        cluster.stop()
        _leave_work_dir(cluster, getattr(args, "keep", False))
    return code


def metrics_line(cluster: LocalCluster) -> str:
    """Where each process serves its Prometheus metrics (from its ready file)."""
    procs = [("manager", cluster.manager)] + sorted(cluster.servers.items())
    where = [f"{name} http://{p.info['metrics']}/metrics" for name, p in procs
             if p is not None and p.info.get("metrics")]
    return "metrics at " + (", ".join(where) or "none")


def _watch(cluster: LocalCluster, stop: threading.Event, every: float = 0.5) -> None:
    """Say once when the manager or a server exits while the cluster runs (until ``stop``),
    with the end of its log: training may go on (replication) or stall, and the console
    would otherwise say nothing."""
    told: set[str] = set()
    while not stop.wait(every):
        procs = [cluster.manager] + list(cluster.servers.values())
        for p in procs:
            if p is None or p.alive or p.name in told or stop.is_set():
                continue
            told.add(p.name)
            what = ("the workers' calls to its blocks fail over to their other replicas"
                    if cluster.replication > 1 else "its blocks are lost unless a checkpoint restores them")
            if p.role == "manager":
                what = "training goes on; membership and map changes wait for a manager"
            print(f"shardps local: {p.role} {p.name} exited with status {p.popen.returncode} ({what}); "
                  f"its log ends:\n{tail(p.log_path, 10)}", file=sys.stderr, flush=True)


def _leave_work_dir(cluster: LocalCluster, keep: bool) -> None:
    """Remove a temporary work directory unless ``keep``, and say which it was."""
    if not cluster._own_dir:
        return                              # --work-dir: the user's directory stays
    if keep:
        print(f"shardps local: kept {cluster.work_dir} (state, logs, checkpoints)", flush=True)
        return
    cluster.cleanup()
    print(f"shardps local: removed {cluster.work_dir} (state, logs, checkpoints); --keep keeps it, "
          f"--work-dir DIR puts it where you choose", flush=True)


# worker flags naming files the worker writes: resolved against the caller's directory (the
# workers run in the work directory), one file per worker where there are several
OUTPUT_FLAGS = ("--plot", "--result-file")


def worker_file(path: str, index: int, count: int) -> str:
    """``path`` as worker ``index`` of ``count`` writes it: absolute, against this process's
    directory; with several workers, ``curve.png`` becomes ``curve-worker-<index>.png``."""
    p = Path(path).expanduser().resolve()
    return str(p if count <= 1 else p.with_name(f"{p.stem}-worker-{index}{p.suffix}"))


def _worker_args(args, worker_flags: list[str], index: int = 0, count: int = 1) -> list[str]:
    """The flags of ``args`` that ``shardps worker`` accepts, as arguments for worker
    ``index`` of ``count``."""
    skip = {"--manager", "--name", "--log-format", "--metrics-port", "--metrics-host", "--rank-hint"}
    out = []
    for flag in worker_flags:
        if flag in skip or not flag.startswith("--"):
            continue
        attr = flag[2:].replace("-", "_")
        if hasattr(args, attr):
            value = getattr(args, attr)
            if value in ("", None):
                continue
            if flag in OUTPUT_FLAGS:
                value = worker_file(str(value), index, count)
            if flag == "--wait-workers" and not value and args.mode == "sync":
                value = count           # a SYNC job's workers start together (rendezvous)
            out += [flag, str(value).lower() if isinstance(value, bool) else str(value)]
    return out


def _train_locally(cluster: LocalCluster, args, worker_flags: list[str], stop: threading.Event,
                   started: float, client_args: tuple[str, ...] | list[str] = ()) -> int:
    group = torch_group_env(args.workers) if getattr(args, "dense", "servers") == "allreduce" else None
    procs = [cluster.start_worker(f"worker-{i}", _worker_args(args, worker_flags, i, args.workers) + list(client_args),
                                  stdout=subprocess.PIPE, env=group[i] if group else None)
             for i in range(args.workers)]
    for flag in OUTPUT_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"), "")
        if value:
            print(f"shardps local: {flag} writes " + ", ".join(worker_file(value, i, args.workers)
                                                                for i in range(args.workers)), flush=True)
    # show rank 0's progress: its stderr goes to the log file; relay its lines here
    relay = threading.Thread(target=_relay, args=(cluster.workers[0].log_path, stop), daemon=True)
    relay.start()
    results = []
    for p in procs:
        out, _ = p.popen.communicate()
        for line in out.decode(errors="replace").splitlines():
            if _RESULT.match(line):
                results.append(line)
                print(line, flush=True)
        if p.popen.returncode != 0:
            print(f"shardps local: {p.name} exited with {p.popen.returncode}; log:\n{tail(p.log_path)}",
                  file=sys.stderr)
            stop.set()
            return 1
    train_seconds = time.perf_counter() - started
    summary = " ".join(f"{k}={v:.4f}" for k, v in _metrics_of(results).items())
    print(f"shardps local: {args.workers} workers, {args.servers} servers, mode={args.mode}, "
          f"model={args.model}: mean {summary} (wall {train_seconds:.1f}s including start-up)", flush=True)
    if args.baseline:
        from shardps.worker.runtime import train_single_process
        stop.set()
        cluster.stop()
        print("shardps local: training the single-process baseline (same model, data and optimizer)...",
              flush=True)
        base = train_single_process(args)
        print(base.line("baseline"), flush=True)
        dist = _metrics_of(results)
        key = next(iter(base.metrics))
        print(f"shardps local: {key}: distributed {dist.get(key, float('nan')):.4f} vs single process "
              f"{base.metrics[key]:.4f}", flush=True)
        print(f"test_accuracy={dist.get('test_accuracy', dist.get(key, float('nan'))):.4f}"
              if key == "test_accuracy" else f"{key}={dist.get(key, float('nan')):.4f}", flush=True)
    stop.set()
    return 0


def torch_group_env(workers: int, host: str = "127.0.0.1") -> list[dict[str, str]]:
    """Each local worker's torch process group, as torchrun would give it (``--dense
    allreduce``: DDP among the workers): its rank, the world, and rank 0's store on a free
    port of ``host``."""
    import socket
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    return [{"RANK": str(i), "WORLD_SIZE": str(workers), "LOCAL_RANK": str(i), "LOCAL_WORLD_SIZE": str(workers),
             "MASTER_ADDR": host, "MASTER_PORT": str(port)} for i in range(workers)]


def _metrics_of(lines: list[str]) -> dict:
    """Mean of each metric over the workers' final lines."""
    values: dict[str, list[float]] = {}
    for line in lines:
        for k, v in re.findall(r"(\w+)=([-0-9.eE+naif]+)", line):
            if k in ("rank", "steps", "wall_seconds", "samples_per_second"):
                continue
            try:
                values.setdefault(k, []).append(float(v))
            except ValueError:
                pass
    return {k: sum(v) / len(v) for k, v in values.items()}


def _relay(path: Path, stop: threading.Event) -> None:
    pos = 0
    while not stop.wait(1.0):
        try:
            with open(path, "rb") as f:
                f.seek(pos)
                data = f.read()
                pos += len(data)
        except OSError:
            continue
        for line in data.decode(errors="replace").splitlines():
            if "step=" in line or "joined" in line:
                print(f"  worker-0 | {line}", file=sys.stderr, flush=True)
