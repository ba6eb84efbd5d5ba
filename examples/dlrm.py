#!/usr/bin/env python
"""A DLRM-style click-through-rate model with 8 multi-hot features, trained on shardps.

The model is written as a TorchRec user writes it: an embedding-bag collection over a
``KeyedJaggedTensor`` (6 tables, two of them shared by two features each), a dense MLP, the
DLRM pairwise dot-product interaction and an over MLP. Every table lives on the servers:
a step moves only the rows its batch touches, and the whole model costs one pull and one
push per server per step (one exchange with --overlap). The script measures that from the
servers' own counters (their Prometheus ``grpc_server_handled_total``) and prints it.

Data: the Criteo TSV format when given --data (label, 13 integer features, 26 categorical
hex features per line; the 26 categorical columns are grouped into 8 multi-hot bags,
column c going to feature c % 8), synthetic clicks otherwise. Criteo's 1 TB click logs
(day_0 ... day_23) are at https://ailab.criteo.com/download-criteo-1tb-click-logs-dataset/ ;
the Kaggle display-advertising set's train.txt has the same format.

    shardps local --servers 2 &             # a cluster at 127.0.0.1:7070
    python examples/dlrm.py --steps 300
    python examples/dlrm.py --data day_0_sample.tsv --rows 1000000
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import urllib.request

import numpy as np
import torch
import torch.nn.functional as F
from _common import add_job_arguments, finish_job  # examples/_common.py: this folder is on sys.path
from sklearn.metrics import roc_auc_score
from torch import nn
from tqdm import tqdm

from shardps.worker import PSClient, adagrad, adam, uniform
from shardps.worker.embedding_bag import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from shardps.worker.torch_ps import PSEmbeddingBagCollection, PSModel

FEATURES = [f"f{i}" for i in range(8)]
BAG = 4                          # ids per bag at most (26 Criteo columns over 8 features)


# ---------------------------------------------------------------- data
def read_criteo(path: str, rows: int, limit: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dense [n, 13] log(1 + x), ids [n, 8, 4] hashed into [0, rows) with -1 for none,
    labels [n]) from a Criteo TSV file. Empty fields: dense 0, categorical left out."""
    if not os.path.isfile(path):
        raise SystemExit(f"{path}: no such file. Criteo TSV data: the 1 TB click logs at "
                         f"https://ailab.criteo.com/download-criteo-1tb-click-logs-dataset/ (or the Kaggle "
                         f"display-advertising train.txt); without --data the script makes synthetic clicks")
    dense, ids, labels = [], [], []
    with open(path) as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) != 40:
                raise SystemExit(f"{path}: expected 40 tab-separated fields (label, I1-I13, C1-C26), "
                                 f"got {len(parts)}")
            labels.append(float(parts[0]))
            dense.append([math.log1p(max(0.0, float(v))) if v else 0.0 for v in parts[1:14]])
            bags = np.full((8, BAG), -1, np.int64)
            for c, v in enumerate(parts[14:]):
                if v:     # the column's index salts the hash: equal strings of two columns differ
                    bags[c % 8, c // 8] = (int(v, 16) * 0x9E3779B1 + c * 0x85EBCA6B) % rows
            ids.append(bags)
            if limit and len(labels) >= limit:
                break
    return np.asarray(dense, np.float32), np.stack(ids), np.asarray(labels, np.float32)


def synthetic(n: int, rows: int, seed: int, model_seed: int = 1234) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``n`` clicks of a hidden model (fixed by ``model_seed``; ``seed`` draws the samples):
    every id has a score; a sample's logit is the sum over its features of the mean score
    of its bag, plus a linear function of the dense features. Bags hold 1 to 4 ids drawn
    from a skewed (Zipf-like) popularity."""
    hidden = np.random.default_rng(model_seed)
    score = hidden.normal(0, 1.0, rows).astype(np.float32)
    w = hidden.normal(0, 0.3, 13).astype(np.float32)
    rng = np.random.default_rng(seed)
    dense = rng.exponential(1.0, (n, 13)).astype(np.float32)
    popular = np.minimum(rng.zipf(1.3, (n, 8, BAG)) - 1, rows - 1)
    ids = (popular * 7919 + np.arange(8)[None, :, None] * 104729) % rows
    lengths = rng.integers(1, BAG + 1, (n, 8))
    ids[np.arange(BAG)[None, None, :] >= lengths[..., None]] = -1
    bag_score = np.where(ids >= 0, score[np.maximum(ids, 0)], 0).sum(-1) / lengths
    logit = bag_score.sum(-1) * 0.5 + (np.log1p(dense) - 0.7) @ w
    labels = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return np.log1p(dense), ids, labels


def features_of(ids: np.ndarray) -> KeyedJaggedTensor:
    """The batch's bags ``[B, 8, 4]`` (-1: none) as a KeyedJaggedTensor (key-major)."""
    per_key = np.ascontiguousarray(ids.transpose(1, 0, 2))           # [8, B, 4]
    present = per_key >= 0
    return KeyedJaggedTensor.from_lengths_sync(FEATURES, torch.from_numpy(per_key[present]),
                                               torch.from_numpy(present.sum(-1).reshape(-1)))


# ---------------------------------------------------------------- the model
def mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class DLRM(nn.Module):
    """dense_arch (MLP of the 13 dense features) + sparse_arch (8 pooled features) ->
    pairwise dot products of the 9 vectors -> over_arch -> one logit."""

    def __init__(self, rows: int, dim: int, lr: float):
        super().__init__()
        init = uniform(-0.05, 0.05, seed=1)
        groups = [["f0", "f1"], ["f2", "f3"], ["f4"], ["f5"], ["f6"], ["f7"]]     # 6 tables, 8 features
        self.sparse_arch = PSEmbeddingBagCollection([
            EmbeddingBagConfig(rows, dim, f"t{i}", names, init=init, optimizer=adagrad(lr),
                               pooling=PoolingType.MEAN if i % 2 else PoolingType.SUM)
            for i, names in enumerate(groups)])
        self.dense_arch = mlp([13, 64, dim])
        pairs = 9 * 8 // 2
        self.over_arch = mlp([dim + pairs, 64, 1])

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        d = self.dense_arch(dense)                                           # [B, dim]
        pooled = self.sparse_arch(sparse).values().reshape(dense.shape[0], len(FEATURES), -1)
        vectors = torch.cat([d.unsqueeze(1), pooled], dim=1)                 # [B, 9, dim]
        dots = vectors @ vectors.transpose(1, 2)
        i, j = torch.triu_indices(9, 9, offset=1)
        return self.over_arch(torch.cat([d, dots[:, i, j]], dim=1)).squeeze(1)


# ---------------------------------------------------------------- the servers' counters
def server_calls(client: PSClient) -> dict[str, dict[str, float]]:
    """Per server: the data calls (Pull, Push, Exchange, and Step: a push, a pull or both in
    one frame) it has handled, read from its Prometheus endpoint. Empty when the servers
    serve no metrics."""
    from prometheus_client.parser import text_string_to_metric_families
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    out = {}
    for s in client.cluster_status().servers:
        if not s.server.metrics_address:
            continue
        text = opener.open(f"http://{s.server.metrics_address}/metrics", timeout=10).read().decode()
        counts = {"Pull": 0.0, "Push": 0.0, "Exchange": 0.0, "Step": 0.0}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "grpc_server_handled_total" and sample.labels.get("grpc_method") in counts:
                    counts[sample.labels["grpc_method"]] += sample.value
        out[s.server.name] = counts
    return out


# ---------------------------------------------------------------- training
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--manager", default=os.environ.get("SHARDPS_MANAGER", "127.0.0.1:7070"),
                   help="the manager's address (default: $SHARDPS_MANAGER or 127.0.0.1:7070)")
    add_job_arguments(p, "dlrm")
    p.add_argument("--data", default="", help="a Criteo TSV file (default: synthetic clicks; Criteo's 1 TB click "
                   "logs or the Kaggle display-advertising train.txt)")
    p.add_argument("--samples", type=int, default=0,
                   help="with --data: samples to read, the last 10%% being the test set (default: all); "
                   "synthetic: test samples (default: 4096; training draws fresh ones each step)")
    p.add_argument("--rows", type=int, default=100_000, help="rows per embedding table (default: 100000)")
    p.add_argument("--dim", type=int, default=16, help="embedding dimension (default: 16)")
    p.add_argument("--steps", type=int, default=500, help="training steps (default: 500)")
    p.add_argument("--batch-size", type=int, default=256, help="samples per step (default: 256)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate: adagrad for the tables, adam/10 "
                   "for the MLPs (default: 0.05)")
    p.add_argument("--mode", default="async", choices=["async", "sync", "ssp"],
                   help="the job's consistency mode (default: async)")
    p.add_argument("--overlap", action="store_true",
                   help="send each step's gradients and the next step's rows as one exchange in the background")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    if args.data:
        dense, ids, labels = read_criteo(args.data, args.rows, args.samples)
        n_test = max(1, len(labels) // 10)
        n_train = len(labels) - n_test
    else:
        n_train = args.steps * args.batch_size
        dense, ids, labels = synthetic(n_train + (args.samples or 4096), args.rows, args.seed)
    if n_train < args.batch_size:
        raise SystemExit(f"{len(labels)} samples: too few for a batch of {args.batch_size} plus a test set")
    print(f"dlrm: {len(labels)} samples ({'criteo ' + args.data if args.data else 'synthetic'}), "
          f"8 multi-hot features over 6 tables of {args.rows} rows, click rate {labels.mean():.3f}", flush=True)

    client = PSClient(args.manager, job=args.job)
    try:
        client.create_job(args.mode, staleness=2 if args.mode == "ssp" else 0)
        client.join()
        model = DLRM(args.rows, args.dim, args.lr)
        ps_model = PSModel(model, client, optimizer=adam(lr=args.lr / 10), overlap=args.overlap)
        ps_model.create_tables()
        rng = np.random.default_rng(args.seed)
        batches = ([rng.choice(n_train, args.batch_size, replace=False) for _ in range(args.steps)] if args.data
                   else [np.arange(i * args.batch_size, (i + 1) * args.batch_size) for i in range(args.steps)])
        before = server_calls(client)
        losses = []
        bar = tqdm(range(args.steps), desc="dlrm", unit="step", file=sys.stderr, mininterval=1.0)
        for step in bar:
            b = batches[step]
            sparse = features_of(ids[b])
            ps_model.pull(sparse)            # dense values and every table's rows: one call per server
            loss = F.binary_cross_entropy_with_logits(model(torch.from_numpy(dense[b]), sparse),
                                                      torch.from_numpy(labels[b]))
            loss.backward()
            if args.overlap and step + 1 < args.steps:
                ps_model.prefetch(features_of(ids[batches[step + 1]]))   # rides on this push
            ps_model.push()                  # every gradient (touched rows only): one call per server
            losses.append(float(loss.detach()))
            bar.set_postfix(loss=f"{np.mean(losses[-50:]):.4f}", refresh=False)
        ps_model.flush()
        bar.close()
        after = server_calls(client)

        ps_model.settle()
        model.eval()
        scores = []
        with torch.no_grad():
            for start in range(n_train, len(labels), 1024):
                sl = slice(start, min(start + 1024, len(labels)))
                scores.append(torch.sigmoid(model(torch.from_numpy(dense[sl]), features_of(ids[sl]))).numpy())
        p_test = np.clip(np.concatenate(scores), 1e-7, 1 - 1e-7)
        y_test = labels[n_train:]
        logloss = float(-np.mean(y_test * np.log(p_test) + (1 - y_test) * np.log(1 - p_test)))
        finish_job(client, args.keep_job)
    finally:
        client.close()

    for server in sorted(after):
        calls = {m: (after[server][m] - before.get(server, {}).get(m, 0.0)) / args.steps for m in after[server]}
        print(f"dlrm: server {server} handled per worker step: pull={calls['Pull']:.2f} "
              f"push={calls['Push']:.2f} exchange={calls['Exchange']:.2f} step={calls['Step']:.2f}", flush=True)
    if not after:
        print("dlrm: the servers serve no Prometheus metrics: call counts not measured", flush=True)
    print(f"dlrm: steps={args.steps} train_loss={np.mean(losses[-50:]):.4f} "
          f"test_auc={roc_auc_score(y_test, p_test):.4f} test_logloss={logloss:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
