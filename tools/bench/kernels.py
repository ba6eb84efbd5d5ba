"""Part ``kernels``: the hot loops of the data path on one core, compiled against numpy.

For 10,000 random rows of a 1,000,000 x 64 table stored by a server (``SparseRows``):
``kernel_gather_ms`` (index lookup + gather into a reply buffer) and
``kernel_adagrad_ms`` / ``kernel_adagrad_numpy_ms`` (lookup + Adagrad + scatter, through
``SparseRows.apply`` with and without ``shardps.kernels``); for the ctr batch (13,312
Zipf-distributed ids): ``kernel_dedup_ms`` / ``kernel_dedup_numpy_ms`` (distinct ids and the
inverse map). Medians of ``kernel_repeats`` runs, the two variants interleaved.

The worker's lookups (``worker/lookup_kernels.py``), one torch thread, each figure the
median per call of rounds of 20 calls, against torch's own:

* ``kernel_lookup_backward_ms`` / ``_torch_ms``: the ctr batch's embedding backward
  (13,312 ids into its distinct rows, dim 16): the compiled pass against
  ``embedding_dense_backward``;
* ``kernel_bag_backward_ms`` / ``_torch_ms``: 512 bags of 20 ids (3,000 rows, dim 16,
  ``sum``), the backward alone;
* ``kernel_lookup_{256,1024}_ms`` / ``_torch_ms``: forward and backward of that many ids
  (dim 8) through the autograd function and through ``F.embedding``: where the function's
  own cost is paid back (``lookup_kernels.MIN_IDS``);
* ``kernel_batch_gather_ms`` / ``_indexing_ms``: a ctr batch of 512 x 26 ids gathered from
  400,000 samples (a different batch each call), ``worker.data.take_batch`` against
  ``samples[tensor]``.
"""

from __future__ import annotations

import itertools
import time

import numpy as np

from shardps.tools.bench.common import median
from shardps.tools.bench.config import BenchConfig


def _time(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def run(cfg: BenchConfig, progress) -> dict[str, float]:
    from shardps import kernels
    from shardps.server.node.blocks import SparseRows
    from shardps.tables import TableConfig, adagrad, sparse_table

    rows, dim, n = (1_000_000, 64, 10_000) if cfg.name != "tiny" else (20_000, 64, 2_000)
    repeats = max(3, cfg.transport_rounds * 3)
    config = TableConfig(optimizer=adagrad(0.05))
    table_rows = SparseRows(sparse_table("bench", dim, rows))
    every = np.arange(rows, dtype=np.int64)
    for start in range(0, rows, 200_000):
        table_rows.insert(every[start:start + 200_000], config)
    rng = np.random.default_rng(0)
    ids = np.sort(rng.choice(rows, n, replace=False)).astype(np.int64)
    grad = rng.standard_normal((n, dim)).astype(np.float32)
    out = np.empty((n, dim), np.float32)
    batch = (rng.zipf(1.2, 13_312) % rows).astype(np.int64)
    samples: dict[str, list[float]] = {}
    compiled = kernels.AVAILABLE
    for _ in range(3):                                   # compile and warm caches
        table_rows.read(ids, out=out)
        table_rows.apply(config, ids, grad)
        kernels.unique_inverse(batch)
    for _ in range(repeats):
        samples.setdefault("kernel_gather_ms", []).extend(_time(lambda: table_rows.read(ids, out=out), 1))
        samples.setdefault("kernel_adagrad_ms", []).extend(_time(lambda: table_rows.apply(config, ids, grad), 1))
        kernels.AVAILABLE = False                        # the numpy code the kernels replace
        try:
            samples.setdefault("kernel_adagrad_numpy_ms", []).extend(
                _time(lambda: table_rows.apply(config, ids, grad), 1))
        finally:
            kernels.AVAILABLE = compiled
        samples.setdefault("kernel_dedup_ms", []).extend(_time(lambda: kernels.unique_inverse(batch), 1))
        samples.setdefault("kernel_dedup_numpy_ms", []).extend(
            _time(lambda: np.unique(batch, return_inverse=True), 1))
    res = {k: median(v) for k, v in samples.items()}
    res.update(_lookups(repeats, cfg.name == "tiny"))
    res["kernel_compiled"] = float(compiled)
    progress(f"kernels ({'numba' if compiled else 'numpy only'}): gather {res['kernel_gather_ms']:.2f} ms, "
             f"Adagrad {res['kernel_adagrad_ms']:.2f} ms (numpy {res['kernel_adagrad_numpy_ms']:.2f}), "
             f"dedup {res['kernel_dedup_ms']:.2f} ms (numpy {res['kernel_dedup_numpy_ms']:.2f})")
    progress("lookups: " + ", ".join(
        f"{what} {res[f'kernel_{key}_ms']:.3f} ms (torch {res[f'kernel_{key}_{base}_ms']:.3f})"
        for what, key, base in (("ctr backward", "lookup_backward", "torch"),
                                ("bags backward", "bag_backward", "torch"), ("256 ids", "lookup_256", "torch"),
                                ("1,024 ids", "lookup_1024", "torch"), ("batch gather", "batch_gather", "indexing"))))
    return res


def _per_call(fn, calls: int = 20) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e3


def _lookups(repeats: int, tiny: bool) -> dict[str, float]:
    """The ``kernel_lookup_*``, ``kernel_bag_*`` and ``kernel_batch_gather_*`` keys (see the
    module docstring)."""
    import torch
    import torch.nn.functional as F

    from shardps import kernels
    from shardps.worker import lookup_kernels
    from shardps.worker.data import take_batch
    from shardps.worker.models import ctr

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        ids, _, _ = ctr.generate(512, 1_000 if tiny else 1_000_000, seed=1000)
        unique, inverse = kernels.unique_inverse(ids.reshape(-1))
        inv = torch.from_numpy(inverse)
        grad = torch.randn(inv.shape[0], ctr.DIM, generator=g)
        bags = torch.randint(0, 3_000, (512, 20), generator=g)
        bag_grad = torch.randn(512, 16, generator=g)
        small = {n: torch.randint(0, n // 2, (n,), generator=g) for n in (256, 1024)}
        samples = torch.randint(0, 1_000_000, (4_000 if tiny else 400_000, 26), generator=g)
        order = np.random.default_rng(0).permutation(samples.shape[0])
        batches = itertools.cycle([order[k:k + 512] for k in range(0, order.shape[0] - 511, 512)])

        def bag_backward(pool):
            def once():
                rows = torch.randn(3_000, 16, generator=g).requires_grad_(True)
                out = pool(rows)
                t0 = time.perf_counter()
                out.backward(bag_grad)
                return time.perf_counter() - t0
            return lambda: sum(once() for _ in range(20)) / 20 * 1e3

        def forward_backward(n, fn):
            def once():
                rows = torch.randn(n // 2, 8, generator=g).requires_grad_(True)
                fn(rows, small[n]).sum().backward()
            return lambda: _per_call(once)

        cases = {
            "lookup_backward": lambda: _per_call(lambda: lookup_kernels.sum_rows(grad, inv, unique.shape[0])),
            "lookup_backward_torch": lambda: _per_call(
                lambda: torch.ops.aten.embedding_dense_backward(grad, inv, unique.shape[0], -1, False)),
            "bag_backward": bag_backward(lambda r: lookup_kernels.bag_lookup(r, bags, None, "sum", None, False, None)),
            "bag_backward_torch": bag_backward(lambda r: F.embedding_bag(bags, r, mode="sum")),
            "batch_gather": lambda: _per_call(lambda: take_batch(samples, next(batches))),
            "batch_gather_indexing": lambda: _per_call(lambda: samples[torch.as_tensor(next(batches))]),
        }
        for n in small:
            cases[f"lookup_{n}"] = forward_backward(n, lookup_kernels._Lookup.apply)
            cases[f"lookup_{n}_torch"] = forward_backward(n, lambda r, i: F.embedding(i, r))
        got: dict[str, list[float]] = {}
        for _ in range(2):                               # compile and warm caches
            for fn in cases.values():
                fn()
        for _ in range(repeats):
            for name, fn in cases.items():
                got.setdefault(f"kernel_{name}_ms", []).append(fn())
        return {k: median(v) for k, v in got.items()}
    finally:
        torch.set_num_threads(threads)
