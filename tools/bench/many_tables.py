"""Many tables through the plain loop: a wide & deep style model with one single-hot
``PSEmbedding`` per categorical field, trained with the README's loop (``model.pull()``,
``model(x)``, ``backward``, ``model.push()``), one worker (this process) and two servers,
against the same model in one process (``nn.Embedding(sparse=True)``).

Model: ``FIELDS`` (12) fields, each a Zipf(1.1) id over ``ROWS`` (100,000) rows into its own
``DIM``-wide (8) table (Adagrad 0.05: on the servers, or ``torch.optim.Adagrad`` over sparse
gradients in one process), concatenated into an MLP (``FIELDS`` x ``DIM`` - 64 - 1, Adam 2e-3),
batch ``BATCH`` (256), labels from a fixed random logistic model of the ids. One torch thread;
``many_tables_steps`` steps of the configuration after the warm-up.

Keys: ``e2e_many_tables_{ps,single}_samples_per_s`` (the loop's samples over its wall time,
after the first ``WARMUP`` steps, the final ``flush`` included),
``e2e_many_tables_calls_per_step_per_server`` (the client's data calls of the loop's steps:
pushes, pulls and exchanges, per step and server, after the warm-up; the ``flush`` after the
last step sends that step's push: one call more per server and run),
``ratio_e2e_many_tables_ps_over_single``; ``e2e_many_tables_computed_ids_*``: the same
model computing each field's ids inside the forward (``x[:, i] + 0``), which ``PSModel``
cannot fetch ahead: one pull per table per step, as every loop was before it could.

``python -m shardps.tools.bench.many_tables --num-blocks 64`` runs the case alone, its tables cut
into that many blocks (0: the default, one block per 4 MiB of values: one here), in rounds
that alternate with the default and with one process, and prints each:

    python -m shardps.tools.bench.many_tables --num-blocks 64 --rounds 3
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from shardps.metrics import DATA_METHODS
from shardps.tools.bench.common import ratio
from shardps.tools.bench.config import BenchConfig

FIELDS, ROWS, DIM, BATCH, WARMUP = 12, 100_000, 8, 256, 20


def _data(steps: int, fields: int, rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = (rng.zipf(1.1, size=(steps, BATCH, fields)) - 1) % rows
    weight = rng.standard_normal((fields, 64)).astype(np.float32)
    signal = np.sin(ids[..., None] * 0.001 * weight).sum(axis=(-2, -1))
    labels = (signal + rng.standard_normal(signal.shape) > 0).astype(np.float32)
    return ids.astype(np.int64), labels


def _model(fields: int, rows: int, make_table, computed_ids: bool = False):
    import torch
    from torch import nn

    class WideDeep(nn.Module):
        def __init__(self):
            super().__init__()
            self.fields = nn.ModuleList(make_table(i) for i in range(fields))
            self.mlp = nn.Sequential(nn.Linear(fields * DIM, 64), nn.ReLU(), nn.Linear(64, 1))

        def forward(self, x):
            # computed_ids: each field's ids computed in the forward (not a view of x), so
            # PSModel cannot fetch them before it: one pull per table per step
            cols = [x[:, i] + 0 if computed_ids else x[:, i] for i in range(fields)]
            return self.mlp(torch.cat([emb(c) for c, emb in zip(cols, self.fields)], dim=1)).squeeze(1)

    torch.manual_seed(0)
    return WideDeep()


def data_calls(client) -> float:
    """The data calls (``metrics.DATA_METHODS``) ``client`` has made so far, from its gRPC metrics."""
    return sum(s.value for m in client.metrics.registry.collect() if m.name == "grpc_client_handled"
               for s in m.samples if s.name.endswith("_total")
               and s.labels.get("grpc_method") in DATA_METHODS)


def run_ps(ids: np.ndarray, labels: np.ndarray, fields: int, rows: int,
           computed_ids: bool = False, num_blocks: int = 0) -> tuple[float, float]:
    """(samples/s, data calls per step per server) of the plain loop on two local servers;
    ``num_blocks``: each table's (0: the default)."""
    import torch
    import torch.nn.functional as F

    from shardps.tables import adagrad, adam, normal
    from shardps.tools.local import LocalCluster
    from shardps.worker.client import PSClient
    from shardps.worker.torch_ps import PSEmbedding, PSModel

    with LocalCluster(servers=2, replication=1) as cluster, \
            PSClient(cluster.manager_address, "many-tables") as client:
        client.create_job()
        client.join()
        module = _model(fields, rows, lambda i: PSEmbedding(rows, DIM, table=f"field{i}", optimizer=adagrad(0.05),
                                                            init=normal(0.0, 0.01, seed=i), num_blocks=num_blocks),
                        computed_ids)
        model = PSModel(module, client, optimizer=adam(2e-3))
        model.create_tables()
        xs, ys = torch.from_numpy(ids), torch.from_numpy(labels)
        for step in range(len(xs)):
            if step == WARMUP:
                calls0, t0 = data_calls(client), time.perf_counter()
            model.pull()
            F.binary_cross_entropy_with_logits(model(xs[step]), ys[step]).backward()
            model.push()
        calls = data_calls(client) - calls0          # the steps' calls (not the flush after them)
        model.flush()
        wall = time.perf_counter() - t0
        steps = len(xs) - WARMUP
        per_server = calls / steps / 2
        client.leave()
    return steps * BATCH / wall, per_server


def run_single(ids: np.ndarray, labels: np.ndarray, fields: int, rows: int) -> float:
    """Samples/s of the same model and optimizers in one process."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    def table(i):
        emb = nn.Embedding(rows, DIM, sparse=True)
        nn.init.normal_(emb.weight, 0.0, 0.01)
        return emb
    module = _model(fields, rows, table)
    sparse = torch.optim.Adagrad([p for e in module.fields for p in e.parameters()], lr=0.05)
    dense = torch.optim.Adam(module.mlp.parameters(), lr=2e-3)
    xs, ys = torch.from_numpy(ids), torch.from_numpy(labels)
    for step in range(len(xs)):
        if step == WARMUP:
            t0 = time.perf_counter()
        F.binary_cross_entropy_with_logits(module(xs[step]), ys[step]).backward()
        sparse.step()
        dense.step()
        sparse.zero_grad(set_to_none=True)
        dense.zero_grad(set_to_none=True)
    return (len(xs) - WARMUP) * BATCH / (time.perf_counter() - t0)


def run(cfg: BenchConfig, progress) -> dict[str, float]:
    import torch

    steps = WARMUP + max(1, cfg.many_tables_steps)
    ids, labels = _data(steps, FIELDS, ROWS)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        progress(f"many tables: {FIELDS} single-hot tables of {ROWS:,} x {DIM}, batch {BATCH}, {steps} steps")
        ps, calls = run_ps(ids, labels, FIELDS, ROWS)
        per_table, per_table_calls = run_ps(ids, labels, FIELDS, ROWS, computed_ids=True)
        single = run_single(ids, labels, FIELDS, ROWS)
    finally:
        torch.set_num_threads(threads)
    progress(f"many tables: shardps {ps:,.0f} samples/s ({calls:.2f} data calls per step per server); "
             f"ids computed in the forward {per_table:,.0f} ({per_table_calls:.2f} calls); "
             f"one process {single:,.0f} samples/s")
    return {"e2e_many_tables_ps_samples_per_s": ps, "e2e_many_tables_single_samples_per_s": single,
            "e2e_many_tables_calls_per_step_per_server": calls,
            "e2e_many_tables_computed_ids_samples_per_s": per_table,
            "e2e_many_tables_computed_ids_calls_per_step_per_server": per_table_calls,
            "ratio_e2e_many_tables_ps_over_single": ratio(ps, single)}


def main(argv=None) -> None:
    import torch

    parser = argparse.ArgumentParser(prog="python -m shardps.tools.bench.many_tables",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-blocks", type=int, default=64,
                        help="each table's blocks in the variant compared with the default (0: the default)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of (variant, default, one process)")
    parser.add_argument("--steps", type=int, default=400, help="steps after the warm-up")
    args = parser.parse_args(argv)
    ids, labels = _data(WARMUP + args.steps, FIELDS, ROWS)
    torch.set_num_threads(1)
    for r in range(args.rounds):
        variant, _ = run_ps(ids, labels, FIELDS, ROWS, num_blocks=args.num_blocks)
        default, _ = run_ps(ids, labels, FIELDS, ROWS)
        single = run_single(ids, labels, FIELDS, ROWS)
        print(f"round {r + 1}/{args.rounds}: samples/s with {args.num_blocks} blocks per table {variant:,.0f}; "
              f"default blocks {default:,.0f} ({ratio(default, variant):.2f}x); one process {single:,.0f}; "
              f"against one process {ratio(variant, single):.3f} and {ratio(default, single):.3f}", flush=True)


if __name__ == "__main__":
    main()
