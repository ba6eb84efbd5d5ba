"""The ``shardps`` command: one console script, one subcommand per role or task.

Every flag ``--x-y`` can also be set with the environment variable ``SHARDPS_X_Y`` (flags
win); ``shardps SUBCOMMAND --help`` lists them with their defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time

from shardps import __version__, logs
from shardps.settings import (
    MANAGER_PORT,
    Common,
    FlagSet,
    ManagerProcessSettings,
    ServerProcessSettings,
    Serving,
    add_common,
    add_serving,
    build,
)
from shardps.tools.children import PARENT_ENV, die_with_parent

log = logging.getLogger("shardps.tools.cli")

DESCRIPTION = """\
shardps: a sharded, replicated gRPC parameter server for PyTorch training.

A resource manager places the blocks of every table on server nodes with a consistent-hash
ring and publishes an epoch-numbered shard map; workers pull the parameter rows and ranges a
step needs from the servers that own them and push their gradients back; the servers apply
the optimizer. Quick start: `shardps local --servers 2 --workers 2 --model digits-cnn`.
"""

# Subcommand name -> the flags it accepts (filled while building the parser); the contract
# test checks manifests against it.
FLAGS: dict[str, list[str]] = {}
DEFAULT_MANAGER = f"127.0.0.1:{MANAGER_PORT}"
MANAGER_HELP = "resource manager address (several replicas: comma-separated; the leader is followed)"


def _sub(subparsers, name: str, help: str, description: str, environ) -> tuple[argparse.ArgumentParser, FlagSet]:
    p = subparsers.add_parser(name, help=help, description=description,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    fs = FlagSet(p, environ)
    FLAGS[name] = fs.names
    return p, fs


def build_parser(environ=None) -> argparse.ArgumentParser:
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(prog="shardps", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"shardps {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p, fs = _sub(sub, "manager", "run the resource manager",
                 "Run the resource manager: registers servers, places blocks, publishes the shard map,\n"
                 "keeps worker groups and table metadata. Its state is persisted in --state-dir.", environ)
    add_common(fs)
    add_serving(fs, f"0.0.0.0:{MANAGER_PORT}", 9100)
    fs.add("--state-dir", "", "directory for the manager's persisted state (empty: memory only)")
    fs.add("--checkpoint-dir", "", "default directory for checkpoints")
    fs.add("--replication", 2, "copies of every block (R), on distinct servers; 1 means a server's "
           "death loses its blocks' values (restored from the latest checkpoint, else DATA_LOSS)")
    fs.add("--server-lease-seconds", 3.0, "a server is declared dead after this long without a heartbeat")
    fs.add("--worker-lease-seconds", 10.0, "a worker leaves its group after this long without a heartbeat")
    fs.add("--token-ttl-seconds", 7 * 24 * 3600.0, "lifetime of the job tokens it issues (CreateJob, "
           "RevokeJobTokens) unless the request asks for another")
    fs.add("--etcd", "", "etcd endpoints (comma-separated http://host:port): run as one of several "
           "manager replicas whose state lives in etcd, serving while elected leader; --state-dir "
           "is then unused")
    fs.add("--etcd-prefix", "/shardps", "with --etcd: the prefix of this cluster's keys")
    fs.add("--exit-when-job-ends", "", "a cluster for one job (TorchX: shardps.tools.torchx_job): once "
           "this job has existed and ended (shardps job end JOB), tell every server to exit, then exit 0")
    fs.add("--leader-lease-seconds", 2, "with --etcd: the leader's etcd lease; a dead leader is "
           "replaced after about this long")
    p.set_defaults(func=cmd_manager)

    p, fs = _sub(sub, "server", "run a server node",
                 "Run a server node: registers with the manager under --name (its ring node name),\n"
                 "holds the blocks the shard map gives it, applies the optimizers.", environ)
    add_common(fs)
    add_serving(fs, "0.0.0.0:7071", 9101)
    fs.add("--name", "", "stable node name (default: the host name)")
    fs.add("--manager", DEFAULT_MANAGER, MANAGER_HELP)
    fs.add("--max-request-bytes", 1 << 30, "largest accepted request payload")
    fs.add("--max-rows", 4_000_000, "most sparse rows in one request")
    fs.add("--data-plane-port", 0, "port of the socket data plane that carries pushes and pulls "
           "beside gRPC (0: any free port, advertised to clients; -1: none, gRPC only)")
    fs.add("--job-max-requests-per-second", 0.0, "per job: data requests (push, pull) per second "
           "this server admits; more get RESOURCE_EXHAUSTED with a retry hint (0: no limit)")
    fs.add("--job-max-bytes-in-flight", 0, "per job: push bytes this server applies at once; more "
           "get RESOURCE_EXHAUSTED with a retry hint (0: no limit)")
    fs.add("--forward-timeout", 1.5, "seconds a primary waits for a backup to apply a push "
           "(plus 1 s per 20 MB); keep it below the manager's server lease")
    fs.add("--cold-dir", "", "local-disk directory for the cold tiers of sparse tables whose lifecycle "
           "policy has cold (the rows their budget evicts); default: the system's temp directory")
    p.set_defaults(func=cmd_server)

    p, fs = _sub(sub, "local", "run a whole cluster as local processes",
                 "Start a manager and N servers on loopback (and M workers training --model),\n"
                 "wait until all report SERVING, print the manager address; Ctrl-C or SIGTERM stops\n"
                 "everything.", environ)
    fs.add("--servers", 2, "server nodes")
    fs.add("--port", MANAGER_PORT, "the manager's port on 127.0.0.1, where the README's examples connect "
           "(0: any free port)")
    fs.add("--workers", 0, "workers training --model (0: cluster only, runs until stopped)")
    fs.add("--replication", 0, "copies of every block (0: 2 with two or more servers, else 1)")
    fs.add("--log-format", "human", "log lines: human or json", choices=["human", "json"])
    fs.add("--work-dir", "", "directory for state, logs, checkpoints and ready files, kept (default: a "
           "temporary one, removed at exit: see --keep)")
    fs.add("--keep", False, "keep the temporary work directory (state, logs, checkpoints) at exit")
    fs.add("--secure", False, "mutual TLS and tokens: development certificates, an admin token, a "
           "token key and --job's token in WORK_DIR/secrets; prints how to connect")
    from shardps.worker.runtime import add_training_flags
    add_training_flags(fs)
    fs.add("--baseline", False, "also train the same model in a single process and print both")
    p.set_defaults(func=cmd_local)

    p, fs = _sub(sub, "worker", "run a training worker",
                 "Join a job's worker group, train --model on this worker's share of the data,\n"
                 "pulling parameters from and pushing gradients to the servers.", environ)
    add_common(fs)
    fs.add("--manager", DEFAULT_MANAGER, MANAGER_HELP)
    fs.add("--name", "", "worker name (default: the host name; under torchrun or shardps run HOST-rankRANK); "
           "a restart with the same name keeps its rank")
    fs.add("--rank-hint", -1, "preferred rank (e.g. a Kubernetes completion index)")
    fs.add("--metrics-port", -1, "Prometheus /metrics port (-1 disables, 0 picks one)")
    fs.add("--metrics-host", "0.0.0.0", "Prometheus /metrics bind address")
    from shardps.worker.runtime import add_training_flags as add_train
    add_train(fs)
    p.set_defaults(func=cmd_worker)

    p, fs = _sub(sub, "run", "run your own training script on N processes (torchrun's shape)",
                 "Start --nproc-per-node processes of SCRIPT with the cluster and their place in\n"
                 "the environment (SHARDPS_MANAGER, SHARDPS_JOB, RANK, WORLD_SIZE, LOCAL_RANK,\n"
                 "LOCAL_WORLD_SIZE); PSClient() and join() read them. A process that fails is\n"
                 "started again (--max-restarts per rank); then the others are stopped.\n"
                 "--elastic, for scripts that all-reduce (PSModel dense='allreduce'): torch's elastic\n"
                 "agent (torchrun) runs them and restarts the whole group into a new rendezvous round.\n\n"
                 "  shardps run --job ctr --nproc-per-node 4 train.py --epochs 3\n"
                 "  shardps run --job ctr --elastic --nproc-per-node 2 hybrid.py", environ)
    fs.add("--manager", DEFAULT_MANAGER, MANAGER_HELP)
    fs.add("--job", "", "the job every process joins (SHARDPS_JOB)")
    fs.add("--nproc-per-node", 1, "processes on this machine")
    fs.add("--nnodes", "1", "machines running this job (ranks: node_rank x nproc-per-node + local rank); "
           "with --elastic, MIN:MAX")
    fs.add("--node-rank", 0, "this machine's index among --nnodes")
    fs.add("--max-restarts", 3, "times a failed process is started again before the run gives up (with "
           "--elastic: times the whole group is)")
    fs.add("--elastic", False, "run the processes under torch's elastic agent (torchrun): whole-group restarts, "
           "c10d rendezvous; for scripts that all-reduce (PSModel dense='allreduce')")
    fs.add("--rdzv-endpoint", "", "with --elastic over several machines: the rendezvous HOST:PORT (the same "
           "on all)")
    fs.add("--log-format", "human", "log lines: human or json", choices=["human", "json"])
    p.add_argument("script", nargs=argparse.REMAINDER, help="the script (a .py file runs with this Python) "
                   "and its arguments")
    p.set_defaults(func=cmd_run)

    p, fs = _sub(sub, "health", "check a process's gRPC health (exit 0 if SERVING)",
                 "Query the standard grpc.health.v1 service; exit status 0 when SERVING.", environ)
    p.add_argument("address", help="host:port")
    fs.add("--service", "", "service name ('' for the whole process)")
    fs.add("--timeout", 3.0, "seconds")
    add_common(fs)
    p.set_defaults(func=cmd_health)

    p, fs = _sub(sub, "status", "show servers, worker groups and the epoch",
                 "A table of servers (state, blocks, bytes, heartbeat age), worker groups (ranks,\n"
                 "steps) and the shard-map epoch.", environ)
    add_common(fs)
    fs.add("--manager", DEFAULT_MANAGER, MANAGER_HELP)
    fs.add("--json", False, "print JSON for scripts")
    p.set_defaults(func=cmd_status)

    p, fs = _sub(sub, "drain", "move every block off a server, then retire it",
                 "Ask the manager to copy every block away from NODE while training continues.", environ)
    p.add_argument("node", help="server name")
    add_common(fs)
    fs.add("--manager", DEFAULT_MANAGER, MANAGER_HELP)
    p.set_defaults(func=cmd_drain)

    p, fs = _sub(sub, "job", "create, end a job, or revoke its tokens",
                 "Create a job (prints its token when authentication is on) or end it.\n"
                 "revoke: every token issued so far for the job is refused (by the manager at once,\n"
                 "by the servers within a heartbeat); prints the job's new token.", environ)
    p.add_argument("action", choices=["create", "end", "revoke"])
    p.add_argument("job")
    add_common(fs)
    fs.add("--manager", DEFAULT_MANAGER, MANAGER_HELP)
    fs.add("--mode", "async", "consistency: async, sync or ssp", choices=["async", "sync", "ssp"])
    fs.add("--staleness", 2, "SSP staleness bound T")
    fs.add("--quota-bytes", 0, "storage quota of the job across servers (0: none)")
    fs.add("--wait-workers", 0.0, "end: first wait up to this many seconds for the job's worker group "
           "to empty (each worker leaves, or its lease lapses); then end it all the same")
    fs.add("--token-out", "", "create, revoke: write the job's token to this file (mode 0600) "
           "instead of printing it")
    fs.add("--token-ttl-seconds", 0.0, "revoke: lifetime of the new token (0: the manager's default)")
    p.set_defaults(func=cmd_job)

    p, fs = _sub(sub, "checkpoint", "write a consistent checkpoint of a job now",
                 "Cut a consistent checkpoint of JOB: its live workers stop at a step boundary and add\n"
                 "their local state, the servers' blocks are copied, all is written under the manager's\n"
                 "checkpoint directory (or --dir, on the manager's file system). Prints the path.", environ)
    p.add_argument("job")
    add_common(fs)
    fs.add("--manager", DEFAULT_MANAGER, MANAGER_HELP)
    fs.add("--dir", "", "checkpoint directory on the manager (default: its --checkpoint-dir)")
    p.set_defaults(func=cmd_checkpoint)

    p, fs = _sub(sub, "restore", "recreate a job's tables from a checkpoint",
                 "Recreate JOB's tables from a checkpoint onto the current servers (any number of\n"
                 "them). Stop the job's workers first; restarted workers resume from the checkpoint.",
                 environ)
    p.add_argument("job")
    add_common(fs)
    fs.add("--manager", DEFAULT_MANAGER, MANAGER_HELP)
    fs.add("--path", "", "checkpoint directory (default: the job's newest one on the manager)")
    p.set_defaults(func=cmd_restore)

    p, fs = _sub(sub, "reset-lost", "accept the loss of a table's lost blocks",
                 "Blocks that lost every replica (their servers died before another copy existed)\n"
                 "refuse every call with DATA_LOSS until they are restored (`shardps restore JOB`)\n"
                 "or reset: this makes TABLE's lost blocks start again from their initial values.\n"
                 "`shardps status` lists what each job lost.", environ)
    p.add_argument("job")
    p.add_argument("table")
    add_common(fs)
    fs.add("--manager", DEFAULT_MANAGER, MANAGER_HELP)
    p.set_defaults(func=cmd_reset_lost)

    p = sub.add_parser("dev-certs", help="make a development CA and TLS certificates",
                       description="Write a development CA, a server certificate (for the manager and\n"
                                   "servers) and a client certificate (for workers and the CLI) for\n"
                                   "mutual TLS. Development only: see SECURITY.md.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    from shardps.tools import devcerts
    devcerts.add_arguments(p)
    p.set_defaults(func=devcerts.run)
    FLAGS["dev-certs"] = ["--host", "--days", "--force"]

    # `shardps bench ...` is dispatched to shardps.tools.bench before parsing (see main); this entry
    # only lists it in --help
    sub.add_parser("bench", help="benchmarks against TensorPipe, gloo and DDP "
                                 "(`shardps bench --help` for its options)", add_help=False)
    FLAGS["bench"] = []

    return parser


# ---------------------------------------------------------------------- commands

def _common(args) -> Common:
    return build(Common, args)


def _tls(common: Common):
    from shardps.rpc.channels import TlsConfig
    return TlsConfig.from_files(common.tls_cert, common.tls_key, common.tls_ca,
                                common.tls_require_client_cert)


def _wait_for_signal(until: threading.Event | None = None) -> None:
    """Until SIGINT or SIGTERM, or ``until`` is set (a retired server, a manager whose job ended)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5) and not (until is not None and until.is_set()):
        pass


def cmd_manager(args) -> int:
    common = _common(args)
    logs.setup("manager", "manager", common.log_format, common.log_level)
    settings = build(ManagerProcessSettings, args, common=common, serving=build(Serving, args))
    from shardps.server import auth
    from shardps.server.processes import ManagerProcess
    authn = auth.authenticator_for(settings.serving, role="manager")
    admin = settings.serving.resolved_admin_token()
    metadata = (("authorization", f"Bearer {admin}"),) if admin else ()
    proc = ManagerProcess(settings, authenticate=authn, tls=_tls(common), metadata=metadata).start()
    _wait_for_signal(proc.finished)
    log.info("stopping")
    proc.stop()
    return 0


def cmd_server(args) -> int:
    common = _common(args)
    name = args.name or __import__("socket").gethostname()
    ctx = logs.setup("server", name, common.log_format, common.log_level)
    settings = build(ServerProcessSettings, args, common=common, serving=build(Serving, args))
    from shardps.tools.verify.defects import ENV as DEFECT  # TEST-ONLY, for the verifier's servers
    settings = dataclasses.replace(settings, name=name, test_defect=os.environ.get(DEFECT, ""))
    from shardps.server import auth
    from shardps.server.processes import ServerProcess
    authn = auth.authenticator_for(settings.serving, role="server")
    token = common.resolved_token() or settings.serving.resolved_admin_token()
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    proc = ServerProcess(settings, authenticate=authn, tls=_tls(common), metadata=metadata)
    proc.node.on_epoch = lambda e: ctx.set(epoch=e)
    proc.start(wait_registered=None)
    _wait_for_signal(proc.retired)
    log.info("stopping")
    proc.stop()
    return 0


def cmd_worker(args) -> int:
    from shardps.worker.runtime import run_worker
    return run_worker(args)


def cmd_run(args) -> int:
    from shardps.tools.launch import run
    return run(args)


def cmd_local(args) -> int:
    from shardps.tools.local_run import run_local
    return run_local(args, FLAGS["worker"])


def cmd_health(args) -> int:
    from shardps.errors import ShardpsError
    from shardps.rpc.channels import check_health
    # several addresses (manager replicas, comma-separated): healthy when one of them is
    code = 2
    for address in [a.strip() for a in args.address.split(",") if a.strip()] or [args.address]:
        try:
            status = check_health(address, args.service, args.timeout, _tls(_common(args)))
        except ShardpsError as err:         # what gRPC said: the call's status and details
            print(f"{address}: unreachable ({err.status}: {err.details})", file=sys.stderr)
            continue
        print(f"{address}: {status}")
        if status == "SERVING":
            return 0
        code = 1
    return code


def _admin_client(args, job: str = "_admin"):
    from shardps.worker.client import PSClient
    common = _common(args)
    return PSClient(args.manager, job, token=common.resolved_token(), tls=_tls(common), timeout=10.0)


def _admin_command(args, what: str, action, job: str = "_admin") -> int:
    """Run ``action(client)`` against the manager; errors become one line and exit status 2."""
    from shardps.errors import ShardpsError
    try:
        with _admin_client(args, job) as client:
            action(client)
    except ShardpsError as exc:
        print(f"shardps {what}: {exc.message}", file=sys.stderr)
        return 2
    return 0


def cmd_status(args) -> int:
    from shardps.status import budget_rows, fetch_node_statuses, format_budgets, format_status, status_to_dict

    def show(client):
        status = client.cluster_status()
        common = _common(args)
        nodes = fetch_node_statuses(status, _tls(common), common.resolved_token())   # table budgets
        if args.json:
            print(json.dumps({**status_to_dict(status), "table_budgets": budget_rows(nodes)}, indent=2))
            return
        budgets = format_budgets(nodes)
        print(format_status(status) + (f"\n\n{budgets}" if budgets else ""))
    return _admin_command(args, "status", show)


def cmd_drain(args) -> int:
    def drain(client):
        resp = client.drain_server(args.node)
        print(f"draining {args.node}: {resp.blocks_to_move} blocks to move (epoch {resp.epoch}); "
              f"watch `shardps status`")
    return _admin_command(args, "drain", drain)


def _manager_call(args, method: str, request, response_cls):
    """One unary call of ``method`` on the manager with this command's TLS and token;
    ``ShardpsError`` on failure."""
    from shardps.rpc import channels
    from shardps.rpc.status import translated
    common = _common(args)
    token = common.resolved_token()
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    with channels.manager_channel(args.manager, _tls(common)) as ch:
        rpc = ch.unary_unary(f"/shardps.v1.ResourceManager/{method}",
                             request_serializer=type(request).SerializeToString,
                             response_deserializer=response_cls.FromString)
        with translated(method):
            return rpc(request, timeout=10.0, metadata=metadata, wait_for_ready=True)


def _show_token(args, token: str, what: str) -> None:
    if args.token_out and token:
        from shardps.tools.devcerts import write_private
        write_private(args.token_out, token.encode())
        print(f"{what}; its token is in {args.token_out}")
    else:
        print(token if token else f"{what} (authentication is off: no token)")


def cmd_job_revoke(args) -> int:
    """``shardps job revoke JOB``: see ``build_parser``."""
    import datetime

    from shardps.errors import ShardpsError
    from shardps.protos.v1 import manager_pb2 as mg
    try:
        resp = _manager_call(args, "RevokeJobTokens", mg.RevokeJobTokensRequest(
            job=args.job, token_ttl_seconds=args.token_ttl_seconds), mg.RevokeJobTokensResponse)
    except ShardpsError as exc:
        print(f"shardps job revoke: {exc.message}", file=sys.stderr)
        return 2
    expires = (datetime.datetime.fromtimestamp(resp.token_expires_at, datetime.timezone.utc)
               .isoformat(timespec="seconds") if resp.token_expires_at else "never")
    print(f"job {args.job}: every earlier token revoked (generation {resp.generation}); the manager "
          f"refuses them now, servers within a heartbeat. New token expires {expires}.", file=sys.stderr)
    _show_token(args, resp.token, f"job {args.job} tokens revoked")
    return 0


def cmd_job(args) -> int:
    if args.action == "revoke":
        return cmd_job_revoke(args)

    def job(client):
        if args.action == "create":
            return _show_token(args, client.create_job(args.mode, args.staleness, args.quota_bytes),
                               f"job {args.job} ready")
        busy = _wait_for_workers(client, args.job, args.wait_workers)
        client.end_job()
        print(f"job {args.job} ended" + (f" with {busy} worker(s) in its group" if busy else ""))
    return _admin_command(args, "job", job, args.job)


def _wait_for_workers(client, job: str, seconds: float) -> int:
    """Wait up to ``seconds`` until ``job``'s worker group is empty; the workers left in it."""
    deadline = time.monotonic() + seconds
    while (busy := sum(len(g.workers) for g in client.cluster_status().groups if g.job == job)) and \
            time.monotonic() < deadline:
        time.sleep(0.5)
    return busy


def cmd_checkpoint(args) -> int:
    def checkpoint(client):
        resp = client.checkpoint(args.dir)
        print(f"{resp.path} (step {resp.step}, {resp.tables} tables, {resp.bytes} bytes)")
    return _admin_command(args, "checkpoint", checkpoint, args.job)


def cmd_reset_lost(args) -> int:
    def reset(client):
        n = client.reset_lost(args.table)
        print(f"job {args.job}, table {args.table}: {n} lost block(s) reset to their initial values"
              if n else f"job {args.job}, table {args.table}: no lost block")
    return _admin_command(args, "reset-lost", reset, args.job)


def cmd_restore(args) -> int:
    def restore(client):
        resp = client.restore(args.path)
        print(f"job {args.job} restored: {resp.tables} tables at step {resp.step} (epoch {resp.epoch})")
    return _admin_command(args, "restore", restore, args.job)


def main(argv: list[str] | None = None) -> int:
    die_with_parent(int(os.environ.get(PARENT_ENV, "0") or 0))
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        from shardps.tools.bench.cli import main as bench_main
        return bench_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
