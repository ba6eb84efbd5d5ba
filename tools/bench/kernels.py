"""Part ``kernels``: the hot loops of the data path on one core, compiled against numpy.

For 10,000 random rows of a 1,000,000 x 64 table stored by a server (``SparseRows``):
``kernel_gather_ms`` (index lookup + gather into a reply buffer) and
``kernel_adagrad_ms`` / ``kernel_adagrad_numpy_ms`` (lookup + Adagrad + scatter, through
``SparseRows.apply`` with and without ``shardps.kernels``); for the ctr batch (13,312
Zipf-distributed ids): ``kernel_dedup_ms`` / ``kernel_dedup_numpy_ms`` (distinct ids and the
inverse map). Medians of ``kernel_repeats`` runs, the two variants interleaved.
"""

from __future__ import annotations

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
    res["kernel_compiled"] = float(compiled)
    progress(f"kernels ({'numba' if compiled else 'numpy only'}): gather {res['kernel_gather_ms']:.2f} ms, "
             f"Adagrad {res['kernel_adagrad_ms']:.2f} ms (numpy {res['kernel_adagrad_numpy_ms']:.2f}), "
             f"dedup {res['kernel_dedup_ms']:.2f} ms (numpy {res['kernel_dedup_numpy_ms']:.2f})")
    return res
