#!/usr/bin/env python
"""Hybrid training of a click model: the item embeddings on the servers, the dense tower in
DistributedDataParallel among the workers (``PSModel(..., dense="allreduce")``).

A torchrun script: the workers' process group and ranks are torchrun's. The same file
runs under plain torchrun, under ``shardps run --elastic`` and as a TorchX job (whose
cluster ends with the job):

    shardps local --servers 2 &                       # a cluster at 127.0.0.1:7070
    torchrun --nproc-per-node 2 examples/hybrid_ctr.py --steps 200
    shardps run --job hybrid-ctr --elastic --nproc-per-node 2 examples/hybrid_ctr.py
    torchx run -s local_cwd tools/torchx_job.py:job --script examples/hybrid_ctr.py -- --steps 200

The clicks follow a hidden taste per item, so the embeddings must learn it: rank 0 prints
the AUC on held-out clicks at the end (test_auc=; 0.5 is chance). The run ends its job
(unless --keep-job) once every rank is done.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
import torch.nn.functional as F
from _common import add_job_arguments, finish_job  # examples/_common.py: this folder is on sys.path
from sklearn.metrics import roc_auc_score
from torch import nn

from shardps.worker import PSClient, adagrad
from shardps.worker.torch_ps import PSEmbedding, PSModel

ITEMS, DIM, PER_SAMPLE = 5_000, 8, 4


class ClickModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.items = PSEmbedding(ITEMS, DIM, optimizer=adagrad(lr=0.2))             # on the servers
        self.tower = nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, 1))   # all-reduced

    def forward(self, ids):
        return self.tower(self.items(ids).mean(dim=1)).squeeze(1)


def batch(rng: np.random.Generator, taste: np.ndarray, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` impressions of PER_SAMPLE items each; a click when the items' hidden taste wins."""
    ids = rng.integers(0, ITEMS, (n, PER_SAMPLE))
    clicks = rng.random(n) < 1 / (1 + np.exp(-4 * taste[ids].mean(axis=1)))
    return torch.from_numpy(ids), torch.from_numpy(clicks.astype(np.float32))


def held_out_auc(model: PSModel, taste: np.ndarray, n: int = 4096) -> float:
    """The AUC on ``n`` held-out impressions (the same ones on every run and rank)."""
    ids, clicks = batch(np.random.default_rng(10_000), taste, n)
    with torch.no_grad():
        model.pull(ids)
        return float(roc_auc_score(clicks.numpy(), model.module(ids).numpy()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manager", default=os.environ.get("SHARDPS_MANAGER", "127.0.0.1:7070"),
                        help="the manager's address (default: $SHARDPS_MANAGER or 127.0.0.1:7070)")
    add_job_arguments(parser, os.environ.get("SHARDPS_JOB", "hybrid-ctr"))
    parser.add_argument("--steps", type=int, default=200, help="training steps per worker (default 200)")
    parser.add_argument("--batch", type=int, default=256, help="impressions per step and worker (default 256)")
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                        help="a checkpoint every N steps (the manager's --checkpoint-dir): a restarted group's "
                        "ranks take their dense state from the latest (default 0: none)")
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    taste = np.random.default_rng(0).normal(0, 1, ITEMS)       # the same hidden truth on every rank
    rng = np.random.default_rng(1 + rank)                        # each rank its own impressions

    client = PSClient(args.manager, job=args.job)
    client.create_job()                   # a rerun of the same job continues its table
    client.join()                         # rank RANK of WORLD_SIZE
    module = ClickModel()
    model = PSModel(module, client, dense="allreduce",
                    dense_optimizer=torch.optim.Adam(module.parameters(), lr=1e-2))
    model.create_tables()
    model.resume()                        # after a restart: the step, and the latest checkpoint's tower
    while model.step < args.steps:
        ids, clicks = batch(rng, taste, args.batch)
        model.pull()
        loss = F.binary_cross_entropy_with_logits(model(ids), clicks)
        loss.backward()                   # DDP averages the tower's gradients among the ranks
        model.push()                      # the rows' gradients to the servers; Adam steps the tower
        model.maybe_checkpoint(every=args.checkpoint_every)
    model.flush()
    if rank == 0:
        auc = held_out_auc(model, taste)
        print(f"rank 0: {model.step} steps, last loss {float(loss.detach()):.4f}, test_auc={auc:.4f}", flush=True)
    if rank != 0:
        client.leave()                    # after its last push (flush)
    torch.distributed.barrier()           # every other rank has left: the job may end
    if rank == 0:
        finish_job(client, args.keep_job)
    client.close()


if __name__ == "__main__":
    main()
