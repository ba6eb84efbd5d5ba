"""The public API as the README teaches it, in every consistency mode (real servers on
loopback)."""

import numpy as np
import pytest
import torch
from torch import nn

from shardps.tables import adagrad, sgd, sparse_block_of
from shardps.worker.torch_ps import PSEmbedding, PSModel


class Recommender(nn.Module):
    def __init__(self):
        super().__init__()
        self.items = PSEmbedding(1_000, 4, optimizer=adagrad(lr=0.1), num_blocks=8)
        self.head = nn.Linear(4, 1, bias=False)    # one dense table: on one server only

    def forward(self, ids):
        return self.head(self.items(ids).mean(dim=1)).squeeze(1)


@pytest.mark.parametrize("mode", ["sync", "ssp", "async"])
def test_psmodel_with_its_defaults_trains_in_every_mode(make_cluster, client_factory, mode):
    """SYNC with PSModel's defaults used to hang at step 2: a server that got no rows of a
    step never learned the step was done. Steps are now reported to every server by default
    in SYNC and SSP jobs, whatever rows a batch touches."""
    cluster = make_cluster(2)
    client = client_factory(cluster.address, job=f"readme-{mode}", timeout=15)
    client.create_job(mode, staleness=1 if mode == "ssp" else 0)
    client.join(heartbeat=False)
    torch.manual_seed(0)
    model = PSModel(Recommender(), client, optimizer=sgd(0.1))
    model.create_tables()
    view = client.refresh_map()
    table = view.table(client.job, "items")
    candidates = np.arange(1_000)
    owner = np.array([table.replicas[b][0] for b in sparse_block_of(candidates, table.spec.num_blocks)])
    servers = sorted(set(owner))
    assert len(servers) == 2, "the embedding's blocks are on both servers"
    for step in range(6):
        # each step's rows all on one server, the other one's next: a server gets nothing
        # from a step, then must serve the next step's rows
        on = candidates[owner == servers[step % 2]]
        ids = torch.tensor([[int(on[step]), int(on[step + 7])]])
        model.pull()
        loss = (model(ids) - 1.0).pow(2).mean()
        loss.backward()
        model.push()
    assert model.step == 6
    assert np.isfinite(client.pull_dense("head.weight")).all()
