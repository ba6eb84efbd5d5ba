"""``python -m shardps.bench.server_cpu``: a server's CPU per pull + push of a ctr-like
request, on one ``ServerNode`` in this process (no transport, no other process): what the
node's Python and kernels cost, apart from the network and the machine's other tenants.

Each round pulls a batch of rows of a 1,000,000-row sparse table (dim 16, Adam, a normal
initializer, as the ctr model's), then pushes their gradients, as a worker's step does; most
rows are new (random ids), so their initial values are computed. Printed: CPU milliseconds
per round (``time.thread_time``), median of ``--repeats`` runs, for

* ``compiled``: the server as it is (compiled initial values, the recent-inits cache);
* ``no-cache``: without the cache of initial values a read computed (``storage._RecentInits``);
* ``numpy-init``: also with numpy's initial values (``shardps.tables.initial_values``).

    python -m shardps.bench.server_cpu                     # 3,300 rows per round, 32 blocks
    python -m shardps.bench.server_cpu --rows 6500 --blocks 64
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

import numpy as np

from shardps import kernels, tables
from shardps.convert import config_to_proto, spec_to_proto
from shardps.messages import GRADIENT, ROWS, Header, PullRequest, PushRequest, Selection
from shardps.protos.v1 import common_pb2 as pb
from shardps.server.node import ServerNode, storage

JOB, TABLE = "bench", "e"


def _node(rows: int, dim: int, blocks: int) -> ServerNode:
    """One node serving every block of one sparse table (no replicas)."""
    spec = tables.sparse_table(TABLE, dim, num_rows=rows, init=tables.normal(0.0, 0.01, seed=7),
                               num_blocks=blocks)
    msg = pb.ShardMap(epoch=1, replication=1)
    msg.servers.add(name="s0", address="s0:0", incarnation=1, state=pb.SERVING)
    t = msg.tables.add(job=JOB, spec=spec_to_proto(spec),
                       config=config_to_proto(tables.TableConfig(optimizer=tables.adam(2e-3))))
    for _ in range(blocks):
        t.blocks.add(replicas=[0], since_epoch=1, fresh_epoch=1)
    node = ServerNode("s0")
    node.install_map(msg)
    return node


def _segment(ids: np.ndarray) -> list[Selection]:
    return [Selection(TABLE, ROWS, count=ids.shape[0])]


@contextmanager
def _variant(name: str):
    """Switch the parts a variant leaves out, and back."""
    init, recent = kernels.initial_values, storage.SparseRows.__init__

    def without_cache(self, spec):
        recent(self, spec)
        self.recent = None

    if name in ("no-cache", "numpy-init"):
        storage.SparseRows.__init__ = without_cache          # type: ignore[method-assign]
    if name == "numpy-init":
        kernels.initial_values = tables.initial_values
    try:
        yield
    finally:
        kernels.initial_values, storage.SparseRows.__init__ = init, recent   # type: ignore[method-assign]


def measure(variant: str, rows: int, blocks: int, batch: int, rounds: int, seed: int = 0) -> float:
    """CPU milliseconds per pull + push round of ``batch`` random ids under ``variant``."""
    rng = np.random.default_rng(seed)
    with _variant(variant):
        node = _node(rows, 16, blocks)
        header = Header(JOB, epoch=1, session="w0", incarnation=1)
        work = []
        for _ in range(rounds + 5):
            ids = np.unique(rng.integers(0, rows, batch)).astype("<i8")
            work.append((ids, rng.standard_normal((ids.shape[0], 16)).astype("<f4")))
        spent = 0.0
        for i, (ids, grads) in enumerate(work):
            t0 = time.thread_time()
            node.pull(PullRequest(Header(JOB, epoch=1), _segment(ids), ids.tobytes()))
            header.sequence = header.acked_below = i + 1     # the earlier pushes were acknowledged
            node.push(PushRequest(header, GRADIENT, _segment(ids), ids.tobytes() + grads.tobytes()))
            if i >= 5:                                         # the first rounds warm up
                spent += time.thread_time() - t0
    return spent / rounds * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardps.bench.server_cpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=3300, help="ids per round (the ctr batch's on one of 2 servers)")
    p.add_argument("--blocks", type=int, default=32, help="blocks of the table on this server")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--repeats", type=int, default=3, help="runs per variant, interleaved; medians printed")
    args = p.parse_args(argv)
    kernels.warm_up()
    variants = ("compiled", "no-cache", "numpy-init")
    got: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(args.repeats):
        for v in variants:
            got[v].append(measure(v, 1_000_000, args.blocks, args.rows, args.rounds, seed=r))
    base = statistics.median(got["compiled"])
    for v in variants:
        ms = statistics.median(got[v])
        print(f"{v:<11} {ms:6.2f} ms CPU per pull + push of ~{args.rows:,} rows ({ms / base:.2f} x compiled)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
