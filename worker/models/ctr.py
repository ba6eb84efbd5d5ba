"""``ctr``: a synthetic click log with a known logistic ground truth, and an embedding + MLP.

The data, documented so that results can be reproduced and compared:

* 26 categorical features. Feature ``f``'s value in a sample is Zipf-distributed, as in real
  click logs: ``v = min(Zipf(a), vocab)`` with exponent ``a = 1.6`` and ``vocab = 40,000``
  (value 1 alone takes ~38% of a feature's samples; thousands of values are seen once).
* Values are hashed into the embedding table's rows: ``id = splitmix64(f * 2^32 + v) % rows``
  (the hashing trick; ``rows`` = 1,000,000 by default, or 10,000,000 for the memory benchmark).
* Ground truth: every (feature, value) has a true weight ``w ~ N(0, 0.35^2)`` (a counter-based
  function of (f, v)); a sample clicks with probability ``sigmoid(b + sum_f w[f, v_f])``,
  ``b = -1``. The oracle AUC is the AUC of these true probabilities on the test set.

The model: one ``PSEmbedding(rows, 16)`` shared by all features (ids already carry the
feature), the 26 embeddings concatenated (416) into an MLP 416-64-1, BCE-with-logits loss.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from shardps.tables import adagrad, adam, normal, splitmix64
from shardps.worker.device import module_device
from shardps.worker.models import Task
from shardps.worker.torch_ps import PSEmbedding

FEATURES = 26
VOCAB = 40_000
ZIPF_A = 1.6
TRUE_STD = 0.35
BIAS = -1.0
DIM = 16


def _true_weight(feature: np.ndarray, value: np.ndarray) -> np.ndarray:
    key = splitmix64((feature.astype(np.uint64) << np.uint64(32)) | value.astype(np.uint64) ^ np.uint64(0xC1C1))
    u1 = ((key >> np.uint64(40)).astype(np.float64) + 0.5) / (1 << 24)
    u2 = ((splitmix64(key) >> np.uint64(40)).astype(np.float64) + 0.5) / (1 << 24)
    return TRUE_STD * np.sqrt(-2 * np.log(u1)) * np.cos(2 * np.pi * u2)


def generate(n: int, rows: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids int64 [n, 26], clicks float32 [n], true probabilities float64 [n])."""
    rng = np.random.default_rng(seed)
    values = np.minimum(rng.zipf(ZIPF_A, size=(n, FEATURES)), VOCAB).astype(np.int64)
    features = np.broadcast_to(np.arange(FEATURES, dtype=np.int64), values.shape)
    logit = BIAS + _true_weight(features, values).sum(axis=1)
    prob = 1.0 / (1.0 + np.exp(-logit))
    clicks = (rng.random(n) < prob).astype(np.float32)
    keys = (features.astype(np.uint64) << np.uint64(32)) | values.astype(np.uint64)
    # row-major: a batch's 26 ids are one run in memory (the broadcast above leaves them a
    # column apart, and a batch then touches 26 x 512 scattered cache lines)
    ids = np.ascontiguousarray((splitmix64(keys) % np.uint64(rows)).astype(np.int64))
    return ids, clicks, prob


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney, ties averaged)."""
    order = np.argsort(scores, kind="mergesort")
    s = scores[order]
    ranks = np.empty(len(s), dtype=np.float64)
    n = len(s)
    starts = np.flatnonzero(np.concatenate(([True], s[1:] != s[:-1])))
    ends = np.concatenate((starts[1:], [n]))
    avg = (starts + ends - 1) / 2.0 + 1.0
    ranks[order] = np.repeat(avg, ends - starts)
    pos = labels > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return 0.5
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


class CTRModel(nn.Module):
    def __init__(self, rows: int, embedding: nn.Module | None = None):
        super().__init__()
        self.embedding = embedding if embedding is not None else PSEmbedding(
            rows, DIM, init=normal(0.0, 0.01, seed=7))
        self.fc1 = nn.Linear(FEATURES * DIM, 64)
        self.fc2 = nn.Linear(64, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.embedding(ids).reshape(ids.shape[0], -1)
        return self.fc2(F.relu(self.fc1(e))).squeeze(1)


def bce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, y)


def make_evaluate(oracle: float):
    def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
        device = module_device(model)          # chunks go to the model's device, scores come back
        model.eval()
        with torch.no_grad():
            scores = torch.cat([model(x[i:i + 8192].to(device)).cpu() for i in range(0, x.shape[0], 8192)]).numpy()
        model.train()
        return {"test_auc": auc(scores, y.numpy()), "oracle_auc": oracle}
    return evaluate


def build_ctr(seed: int = 0, rows: int = 1_000_000, train_samples: int = 400_000,
              test_samples: int = 50_000, embedding: nn.Module | None = None, **_) -> Task:
    torch.manual_seed(seed)
    ids, clicks, _prob = generate(train_samples, rows, seed=1000)
    ids_te, clicks_te, prob_te = generate(test_samples, rows, seed=2000)
    oracle = auc(prob_te, clicks_te)
    model = CTRModel(rows, embedding)
    return Task("ctr", model, (torch.from_numpy(ids), torch.from_numpy(clicks)),
                (torch.from_numpy(ids_te), torch.from_numpy(clicks_te)), bce, make_evaluate(oracle),
                optimizer=adam(lr=2e-3), batch_size=512, epochs=1, metric="test_auc",
                optimizers={"embedding": adagrad(lr=0.05)},
                info={"rows": rows, "oracle_auc": oracle})
