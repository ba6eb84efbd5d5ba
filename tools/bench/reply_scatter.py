"""``python -m shardps.tools.bench.reply_scatter``: the client's CPU to route a pull of many
sparse tables and place its servers' replies, with the outputs in one array and apart.

A pull of ``--tables`` tables (``--rows`` distinct ids each, dim ``--dim``) over two servers,
as a 12-table model's step pulls them: routed together (``step_plan.RowsRoute``), then each
server's reply placed into the outputs (``RowsRoute.places`` and ``steps.scatter``). When
the outputs are views of one array (``routing.Outputs``, as ``requests.pull_pieces`` makes
them for a batch of sparse pulls) each server's rows are written by one compiled call;
otherwise a segment (a table's rows from one server) at a time. No sockets: the route and the
placement only, timed with ``timeit`` (the best of ``--repeat`` rounds), side by side.

    python -m shardps.tools.bench.reply_scatter               # 12 tables, 110 rows of 8
"""

from __future__ import annotations

import argparse
import functools
import timeit

import numpy as np

from shardps.protos.v1 import common_pb2 as pb
from shardps.rpc.convert import config_to_proto, spec_to_proto
from shardps.shardmap import ShardMapView
from shardps.tables import TableConfig, sparse_table
from shardps.worker.client import steps
from shardps.worker.client.step_plan import RowsRoute, Tables
from shardps.worker.routing import Outputs, Piece

JOB = "scatter"


def _view(tables: int, dim: int) -> ShardMapView:
    """Two servers; each table of four blocks, two on each."""
    msg = pb.ShardMap(epoch=1, replication=1)
    for name in ("s0", "s1"):
        msg.servers.add(name=name, address=f"{name}:1", incarnation=1, state=pb.SERVING)
    for k in range(tables):
        spec = sparse_table(f"t{k}", dim, num_rows=1_000_000, num_blocks=4)
        t = msg.tables.add(job=JOB, spec=spec_to_proto(spec), config=config_to_proto(TableConfig()))
        for primary in (0, 1, 0, 1):
            t.blocks.add(replicas=[primary], since_epoch=1, fresh_epoch=1)
    return ShardMapView(msg)


def measure(tables: int = 12, rows: int = 110, dim: int = 8, number: int = 2000, repeat: int = 5) -> dict[str, float]:
    """Microseconds per pull to route it and place both servers' replies: outputs in one
    array, and apart."""
    view = _view(tables, dim)
    rng = np.random.default_rng(0)
    pieces = [Piece(k, f"t{k}", False, ids=rng.choice(1_000_000, rows, replace=False).astype(np.int64))
              for k in range(tables)]
    route_tables = Tables([view.table(JOB, p.table) for p in pieces], 2)
    flat = np.zeros(tables * rows * dim, np.float32)
    starts = [k * rows * dim for k in range(tables)]
    one = Outputs([flat[a:a + rows * dim].reshape(rows, dim) for a in starts], flat, starts)
    apart = [np.zeros((rows, dim), np.float32) for _ in range(tables)]
    reply = [np.ones(n, np.float32) for n in (tables * rows * dim,) * 2]

    def pull(outputs) -> None:
        route = RowsRoute(route_tables, pieces, False)
        for server in (0, 1):
            places = route.places(server, outputs)
            steps.scatter(places, reply[server][:sum(p[2] for p in places)])

    out = {}
    for name, outputs in (("one_array", one), ("apart", apart)):
        pull(outputs)                                   # compiled, warm
        out[name] = min(timeit.repeat(functools.partial(pull, outputs), number=number, repeat=repeat)) / number * 1e6
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shardps.tools.bench.reply_scatter", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", type=int, default=12, help="sparse tables in the pull (default 12)")
    ap.add_argument("--rows", type=int, default=110, help="distinct ids per table (default 110)")
    ap.add_argument("--dim", type=int, default=8, help="each table's dim (default 8)")
    ap.add_argument("--repeat", type=int, default=5, help="rounds of 2,000 pulls; the best is printed (default 5)")
    args = ap.parse_args(argv)
    got = measure(args.tables, args.rows, args.dim, repeat=args.repeat)
    print(f"a pull of {args.tables} tables x {args.rows} rows x {args.dim} over 2 servers, routed and placed: "
          f"outputs in one array {got['one_array']:.1f} us, apart {got['apart']:.1f} us "
          f"({got['apart'] / got['one_array']:.2f} x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
