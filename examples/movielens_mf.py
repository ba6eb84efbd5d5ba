#!/usr/bin/env python
"""Matrix factorisation of a MovieLens ratings file, trained on shardps.

A rating is predicted as ``mean + b_user + b_item + <p_user, q_item>``: four embeddings
(user and item factors, user and item biases) whose rows live on the servers, trained with
adagrad on the servers by mean squared error. Each step announces its users and items, so
every table's rows come in one pull per server, and the gradients of the rows it touched go
back in one push.

The file is MovieLens ``u.data``: ``user \\t item \\t rating \\t timestamp`` per line (ids
from 1), from GroupLens's MovieLens 100K data set (https://grouplens.org/datasets/movielens/100k/:
``ml-100k.zip`` holds ``ml-100k/u.data``). A seeded 90/10 split of the lines is the training
and test set; the script prints the test RMSE beside the RMSE of always predicting the
training mean.

    shardps local --servers 2 &             # a cluster at 127.0.0.1:7070
    python examples/movielens_mf.py --ratings ml-100k/u.data --epochs 10
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
from _common import add_job_arguments, finish_job  # examples/_common.py: this folder is on sys.path
from torch import nn
from tqdm import tqdm

from shardps.worker import PSClient, adagrad, normal, zeros
from shardps.worker.torch_ps import PSEmbedding, PSModel

MOVIELENS_URL = "https://grouplens.org/datasets/movielens/100k/"


def read_ratings(path: str) -> np.ndarray:
    """``[n, 3]`` (user, item, rating) of a u.data file (tab-separated; timestamps ignored)."""
    if not os.path.isfile(path):
        raise SystemExit(f"{path}: no such file. Download MovieLens 100K from "
                         f"{MOVIELENS_URL} and give its u.data: --ratings ml-100k/u.data")
    try:
        data = np.loadtxt(path, delimiter="\t", usecols=(0, 1, 2), dtype=np.int64, ndmin=2)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{path}: not a MovieLens u.data file (user\\titem\\trating\\ttimestamp): {exc}") from None
    if data.shape[0] == 0:
        raise SystemExit(f"{path}: no ratings")
    return data


class MF(nn.Module):
    def __init__(self, users: int, items: int, dim: int, mean: float, lr: float):
        super().__init__()
        self.user = PSEmbedding(users, dim, optimizer=adagrad(lr), init=normal(0, 0.1, seed=1))
        self.item = PSEmbedding(items, dim, optimizer=adagrad(lr), init=normal(0, 0.1, seed=2))
        self.user_bias = PSEmbedding(users, 1, optimizer=adagrad(lr), init=zeros())
        self.item_bias = PSEmbedding(items, 1, optimizer=adagrad(lr), init=zeros())
        self.mean = mean

    def announce(self, users: torch.Tensor, items: torch.Tensor) -> None:
        """The next forward's ids: PSModel.pull fetches all four tables' rows at once."""
        self.user.request_prefetch(users)
        self.user_bias.request_prefetch(users)
        self.item.request_prefetch(items)
        self.item_bias.request_prefetch(items)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        dot = (self.user(users) * self.item(items)).sum(dim=1)
        return self.mean + self.user_bias(users).squeeze(1) + self.item_bias(items).squeeze(1) + dot


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ratings", default="u.data", help=f"a MovieLens u.data file (default: ./u.data; MovieLens "
                   f"100K from {MOVIELENS_URL})")
    p.add_argument("--manager", default=os.environ.get("SHARDPS_MANAGER", "127.0.0.1:7070"),
                   help="the manager's address (default: $SHARDPS_MANAGER or 127.0.0.1:7070)")
    add_job_arguments(p, "movielens")
    p.add_argument("--dim", type=int, default=16, help="latent factors (default: 16)")
    p.add_argument("--epochs", type=int, default=10, help="passes over the training ratings (default: 10)")
    p.add_argument("--batch-size", type=int, default=512, help="ratings per step (default: 512)")
    p.add_argument("--lr", type=float, default=0.1, help="adagrad learning rate (default: 0.1)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    data = read_ratings(args.ratings)
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(data.shape[0])
    n_test = max(1, data.shape[0] // 10)
    train, test = data[order[n_test:]], data[order[:n_test]]
    users, items = int(data[:, 0].max()) + 1, int(data[:, 1].max()) + 1
    mean = float(train[:, 2].mean())
    print(f"movielens: {data.shape[0]} ratings of {len(np.unique(data[:, 0]))} users on "
          f"{len(np.unique(data[:, 1]))} items; {train.shape[0]} to train, {test.shape[0]} to test", flush=True)

    torch.manual_seed(args.seed)
    client = PSClient(args.manager, job=args.job)
    try:
        client.create_job()
        client.join()
        model = MF(users, items, args.dim, mean, args.lr)
        ps_model = PSModel(model, client)
        ps_model.create_tables()
        steps_per_epoch = max(1, train.shape[0] // args.batch_size)
        bar = tqdm(total=args.epochs * steps_per_epoch, desc="movielens", unit="step", file=sys.stderr,
                   mininterval=1.0)
        for epoch in range(args.epochs):
            shuffled = train[rng.permutation(train.shape[0])]
            for i in range(steps_per_epoch):
                batch = torch.from_numpy(shuffled[i * args.batch_size:(i + 1) * args.batch_size])
                u, it, r = batch[:, 0], batch[:, 1], batch[:, 2].float()
                model.announce(u, it)
                ps_model.pull()                # the four tables' rows: one call per server
                loss = (model(u, it) - r).pow(2).mean()
                loss.backward()
                ps_model.push()                # the touched rows' gradients: one call per server
                bar.update(1)
                bar.set_postfix(epoch=epoch, mse=f"{float(loss.detach()):.3f}", refresh=False)
        bar.close()
        ps_model.settle()
        model.eval()
        with torch.no_grad():
            t = torch.from_numpy(test)
            predicted = model(t[:, 0], t[:, 1]).clamp(1, 5).numpy()
        finish_job(client, args.keep_job)
    finally:
        client.close()
    rmse = float(np.sqrt(np.mean((predicted - test[:, 2]) ** 2)))
    baseline = float(np.sqrt(np.mean((mean - test[:, 2]) ** 2)))
    print(f"movielens: epochs={args.epochs} test_rmse={rmse:.4f} (predicting the mean: {baseline:.4f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
