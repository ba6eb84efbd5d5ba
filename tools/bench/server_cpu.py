"""``python -m shardps.tools.bench.server_cpu``: a server's CPU per push + pull of a ctr-like
request, on one ``ServerNode`` in this process (no transport, no other process): what the
node's Python and kernels cost, apart from the network and the machine's other tenants.

Each round pushes the gradients of a batch of rows of a 1,000,000-row sparse table (dim 16,
Adam, a normal initializer, as the ctr model's) pulled in the round before, and pulls the
next batch, as a worker's step does; most rows are new (random ids), so their initial values
are computed. Printed: CPU milliseconds per round (``time.thread_time``), median of
``--repeats`` runs, for

* ``compiled``: the server as it is: each round one Step (push, then pull), admitted
  (``server/node/plan.py``) and executed (``server/node/execute.py``) as one plan per part;
* ``no-cache``: the same without the cache of initial values a read computed, for the push
  that stores those rows (``storage.InitCache``);
* ``general``: the round as a Push and a Pull request, each decoded into segments with
  every check raising its error before it is planned (what a Push or Pull frame costs).

    python -m shardps.tools.bench.server_cpu                     # 3,300 rows per round, 32 blocks
    python -m shardps.tools.bench.server_cpu --rows 6500 --blocks 64
    python -m shardps.tools.bench.server_cpu --tables 12 --table-rows 100000 --dim 8 --rows 128
                                 # a wide & deep step: 12 tables, 128 rows of each per round

With ``--tables N`` each round pulls and pushes ``--rows`` ids of each of N tables in one
request (the blocks of every table on this server), as a model with one table per field does.

With ``--replication 2`` a second node in this process backs up every block: the primary's
forwarded operations are handed to it in memory (no transport), and the figure is both
nodes' CPU, the forwarding and the backup's apply included.

    python -m shardps.tools.bench.server_cpu --rows 900 --blocks 8 --replication 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from shardps import kernels
from shardps import tables as tables_
from shardps.messages import GRADIENT, ROWS, Header, PullRequest, PushRequest, Selection, Slice, StepRequest
from shardps.protos.v1 import common_pb2 as pb
from shardps.rpc.convert import config_to_proto, spec_to_proto
from shardps.server.node import ServerNode, storage

JOB, TABLE = "bench", "e"


def _names(tables: int) -> list[str]:
    return [TABLE] if tables == 1 else [f"{TABLE}{i}" for i in range(tables)]


class _InMemoryPeers:
    """A primary's calls to its backup, made in this process: the backup applies the
    forwarded operations from one buffer of their arrays, as it would a received frame's."""

    def __init__(self, backup: ServerNode, source: str):
        self.backup, self.source = backup, source

    def replicate(self, node, epoch, ops, arrays):
        payload = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
        stale = self.backup.apply_replicated(epoch, self.source, ops, payload)[1]
        return lambda: stale

    def load_blocks(self, node, epoch, snapshots, resync=False):
        self.backup.load_blocks(epoch, self.source, snapshots)

    def abandon(self, node):
        return 0


def _node(rows: int, dim: int, blocks: int, tables: int = 1, replication: int = 1) -> ServerNode:
    """One node serving every block of ``tables`` sparse tables; with ``replication`` 2, a
    second node backing up every block, reached in memory."""
    msg = pb.ShardMap(epoch=1, replication=replication)
    for n in range(replication):
        msg.servers.add(name=f"s{n}", address=f"s{n}:0", incarnation=1, state=pb.SERVING)
    for i, name in enumerate(_names(tables)):
        spec = tables_.sparse_table(name, dim, num_rows=rows, init=tables_.normal(0.0, 0.01, seed=7 + i),
                                    num_blocks=blocks)
        t = msg.tables.add(job=JOB, spec=spec_to_proto(spec),
                           config=config_to_proto(tables_.TableConfig(optimizer=tables_.adam(2e-3))))
        for _ in range(blocks):
            t.blocks.add(replicas=list(range(replication)), since_epoch=1, fresh_epoch=1)
    node = ServerNode("s0")
    node.install_map(msg)
    if replication > 1:
        backup = ServerNode("s1")
        backup.install_map(msg)
        node.peers = _InMemoryPeers(backup, "s0")
    return node


def _segments(names: list[str], ids: list[np.ndarray]) -> list[Selection]:
    return [Selection(name, ROWS, count=i.shape[0]) for name, i in zip(names, ids)]


def _without_cache(node: ServerNode) -> None:
    """Leave out the cache of initial values on every table of ``node``."""
    for entry in node.table.sparse_rows.values():
        entry.cache = storage.InitCache.none(entry.dim)


def _slices(names: list[str], ids: list[np.ndarray], grads: list[np.ndarray] | None) -> list[Slice]:
    """A Step's slices as the node receives them (a push's values flat)."""
    return [Slice(name, "rows", ids=i, values=None if grads is None else g.reshape(-1))
            for name, i, g in zip(names, ids, grads or ids)]


def measure(variant: str, rows: int, blocks: int, batch: int, rounds: int, seed: int = 0, tables: int = 1,
            dim: int = 16, replication: int = 1) -> float:
    """CPU milliseconds per push + pull round of ``batch`` random ids of each of ``tables``
    tables under ``variant``."""
    rng = np.random.default_rng(seed)
    names = _names(tables)
    node = _node(rows, dim, blocks, tables, replication)
    if variant == "no-cache":
        _without_cache(node)
    header = Header(JOB, epoch=1, session="w0", incarnation=1)
    work = []
    for _ in range(rounds + 6):
        ids = [np.unique(rng.integers(0, rows, batch)).astype("<i8") for _ in names]
        work.append((ids, [rng.standard_normal((i.shape[0], dim)).astype("<f4") for i in ids]))
    spent = 0.0
    for i in range(1, len(work)):                 # push the last round's rows, pull this round's
        (pushed, grads), (pulled, _) = work[i - 1], work[i]
        header.sequence = i
        header.acked_below = i - 1                # the earlier pushes were acknowledged
        t0 = time.thread_time()
        if variant == "general":
            segments = _segments(names, pushed)
            node.push(PushRequest(header, GRADIENT, segments,
                                  b"".join(x.tobytes() + g.tobytes() for x, g in zip(pushed, grads))))
            node.pull(PullRequest(Header(JOB, epoch=1), _segments(names, pulled),
                                  b"".join(x.tobytes() for x in pulled)))
        else:
            node.step(StepRequest(header, GRADIENT, push=_slices(names, pushed, grads),
                                  pull=_slices(names, pulled, None)))
        if i > 5:                                 # the first rounds warm up
            spent += time.thread_time() - t0
    return spent / rounds * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardps.tools.bench.server_cpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=3300, help="ids per round (the ctr batch's on one of 2 servers)")
    p.add_argument("--blocks", type=int, default=32, help="blocks of each table on this server")
    p.add_argument("--tables", type=int, default=1, help="sparse tables in each request")
    p.add_argument("--table-rows", type=int, default=1_000_000, help="rows of each table")
    p.add_argument("--dim", type=int, default=16, help="each row's width")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--repeats", type=int, default=3, help="runs per variant, interleaved; medians printed")
    p.add_argument("--replication", type=int, default=1, choices=(1, 2),
                   help="2: a second node in this process backs up every block (its CPU counted)")
    args = p.parse_args(argv)
    kernels.warm_up()
    variants = ("compiled", "no-cache", "general")
    got: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(args.repeats):
        for v in variants:
            got[v].append(measure(v, args.table_rows, args.blocks, args.rows, args.rounds, seed=r,
                                  tables=args.tables, dim=args.dim, replication=args.replication))
    base = statistics.median(got["compiled"])
    for v in variants:
        ms = statistics.median(got[v])
        what = (f"~{args.rows:,} rows" + (f" of each of {args.tables} tables" if args.tables > 1 else "")
                + (", primary and backup" if args.replication > 1 else ""))
        print(f"{v:<11} {ms:6.2f} ms CPU per push + pull of {what} ({ms / base:.2f} x compiled)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
