"""``lifecycle``: the ctr model on an id stream whose tail never repeats, with and without a
memory budget on its embedding table (docs/memory-budget.md).

Data: 26 features, each value ``v = min(Zipf(1.1), 100,000,000)`` hashed with its feature
into a ``100,000,000 x 16`` table (``id = splitmix64(f * 2^32 + v) % 10^8``): most values
are seen once. Labels from the ctr model's logistic ground truth (``worker.models.ctr``).
One in-process manager and server, one worker (``PSModel``, Adagrad(0.05) on the embedding,
Adam(2e-3) on the MLP), ``lifecycle_train_samples`` samples in batches of
``lifecycle_batch``, then test AUC on ``lifecycle_test_samples`` held-out samples.

Run twice on the same data: unbounded (no policy), then with ``LifecyclePolicy(budget_bytes,
admit_after)``. The table's server memory (``SparseRows.memory_bytes``: every slot handed
out, index, sketches) is sampled after every step; its maximum is the peak.

Keys: lifecycle_budget_bytes, lifecycle_peak_table_bytes (budget run),
lifecycle_unbounded_table_bytes (peak of the unbounded run), lifecycle_auc_budget,
lifecycle_auc_unbounded, lifecycle_rows_evicted, lifecycle_rows_not_admitted (pushed rows
whose gradients were dropped before admission), lifecycle_peak_over_budget (peak / budget),
lifecycle_auc_gap (unbounded - budget), lifecycle_unbounded_over_budget.
"""

from __future__ import annotations

import time

import numpy as np

from shardps.tools.bench.common import in_process_cluster
from shardps.tools.bench.config import BenchConfig

IDS = 100_000_000
ZIPF_A = 1.1
FEATURES = 26


def generate(n: int, seed: int, salt: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(ids int64 [n, 26], clicks float32 [n]) of the stream described above (``salt``: the
    same values hashed to other ids, as if the popular items changed)."""
    from shardps.tables import splitmix64
    from shardps.worker.models.ctr import BIAS, _true_weight
    rng = np.random.default_rng(seed)
    values = np.minimum(rng.zipf(ZIPF_A, size=(n, FEATURES)), IDS).astype(np.int64)
    features = np.broadcast_to(np.arange(FEATURES, dtype=np.int64), values.shape)
    prob = 1.0 / (1.0 + np.exp(-(BIAS + _true_weight(features, values).sum(axis=1))))
    clicks = (rng.random(n) < prob).astype(np.float32)
    keys = (features.astype(np.uint64) << np.uint64(32)) | values.astype(np.uint64)
    return (splitmix64(keys ^ np.uint64(salt)) % np.uint64(IDS)).astype(np.int64), clicks


def train(cfg: BenchConfig, data, test, policy, progress) -> dict:
    """One run on a fresh in-process cluster; returns peak bytes, AUC and counters."""
    import torch

    from shardps.budget import set_lifecycle
    from shardps.tables import adagrad, adam
    from shardps.worker.client import PSClient
    from shardps.worker.models.ctr import CTRModel, auc, bce
    from shardps.worker.torch_ps import PSModel

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(1)
    manager, (server,) = in_process_cluster(1)
    client = PSClient(manager.address, "lifecycle", timeout=60)
    try:
        client.create_job()
        client.join(heartbeat=True)
        model = CTRModel(IDS)
        ps = PSModel(model, client, optimizer=adam(lr=2e-3), optimizers={"embedding": adagrad(lr=0.05)})
        ps.create_tables()
        if policy is not None:
            set_lifecycle(client, "embedding", policy)
        rows = server.node.table.sparse_rows[("lifecycle", "embedding")]
        x, y = torch.from_numpy(data[0]), torch.from_numpy(data[1])
        peak, started, b = 0, time.monotonic(), cfg.lifecycle_batch
        for i in range(0, x.shape[0] - b + 1, b):
            ps.pull()
            bce(model(x[i:i + b]), y[i:i + b]).backward()
            ps.push()
            with rows.lock:
                peak = max(peak, rows.memory_bytes())
        ps.flush()
        took = time.monotonic() - started
        model.eval()
        with torch.no_grad():
            xt = torch.from_numpy(test[0])
            scores = torch.cat([model(xt[j:j + 8192]) for j in range(0, xt.shape[0], 8192)]).numpy()
        with rows.lock:
            peak = max(peak, rows.memory_bytes())
            counters = dict(rows.life.counters) if rows.life is not None else {}
            stored = int(rows.block_counts.sum())
            if rows.cold is not None:
                counters.update({f"cold_{k}": v for k, v in rows.cold.counters.items()},
                                cold_rows=rows.cold.count, cold_disk_bytes=rows.cold.disk_bytes())
        out = {"peak": peak, "auc": auc(scores, test[1]), "stored": stored, "seconds": took, **counters}
        label = "unbounded" if policy is None else "cold tier" if policy.cold else "budget"
        on_disk = f", {counters['cold_rows']:,} on disk" if "cold_rows" in counters else ""
        progress(f"{label}: {x.shape[0] / took:,.0f} samples/s, peak {peak / 2**20:.1f} MiB, {stored:,} rows "
                 f"in RAM{on_disk}, AUC {out['auc']:.4f}")
        return out
    finally:
        client.close()
        server.stop()
        manager.stop()


def run(cfg: BenchConfig, progress) -> dict[str, float]:
    from shardps.tables import LifecyclePolicy

    n = cfg.lifecycle_train_samples
    data, test = generate(n, 1000 + cfg.seed), generate(cfg.lifecycle_test_samples, 2000 + cfg.seed)
    progress(f"{n:,} samples over {IDS:,} ids, Zipf({ZIPF_A}); {len(np.unique(data[0])):,} distinct ids")
    unbounded = train(cfg, data, test, None, progress)
    budget = cfg.lifecycle_budget_mib << 20
    policy = LifecyclePolicy(budget_bytes=budget, admit_after=cfg.lifecycle_admit_after)
    bounded = train(cfg, data, test, policy, progress)
    return {
        "lifecycle_budget_bytes": float(budget),
        "lifecycle_peak_table_bytes": float(bounded["peak"]),
        "lifecycle_unbounded_table_bytes": float(unbounded["peak"]),
        "lifecycle_auc_budget": bounded["auc"],
        "lifecycle_auc_unbounded": unbounded["auc"],
        "lifecycle_auc_gap": unbounded["auc"] - bounded["auc"],
        "lifecycle_rows_evicted": float(bounded.get("evicted_budget", 0) + bounded.get("evicted_ttl", 0)),
        "lifecycle_rows_not_admitted": float(bounded.get("not_admitted", 0)),
        "lifecycle_rows_stored_budget": float(bounded["stored"]),
        "lifecycle_rows_stored_unbounded": float(unbounded["stored"]),
        "lifecycle_peak_over_budget": bounded["peak"] / budget,
        "lifecycle_unbounded_over_budget": unbounded["peak"] / budget,
        "lifecycle_train_samples": float(n),
    }
