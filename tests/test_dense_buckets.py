"""A PSModel's dense parameters travel as flat buckets: one dense table per optimizer, the
parameters views of one flat tensor, trained exactly as a table per parameter (real servers
on loopback)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardps.errors import InvalidArgument
from shardps.tables import adam, sgd
from shardps.worker.torch_ps import PSEmbedding, PSModel
from tests.dense import replicas_agree, server_value


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = PSEmbedding(50, 4)
        self.a = nn.Linear(8, 16)
        self.frozen = nn.Linear(3, 3).requires_grad_(False)      # pulled, never pushed: a bucket apart
        self.b = nn.Linear(16, 1)
        self.unused = nn.Linear(2, 2)        # no gradient in any step

    def forward(self, ids):
        return self.b(torch.relu(self.a(self.emb(ids).reshape(ids.shape[0], -1)))).squeeze(1)


class _UnusedInTheMiddle(_Net):
    """The unused layer between two used ones: a push sends the bucket in two runs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        del self.unused, self.b
        self.unused = nn.Linear(2, 2)
        self.b = nn.Linear(16, 1)


def _train(client_factory, address: str, job: str, steps: int = 5, net=_Net, **kw) -> tuple[dict, PSModel]:
    c = client_factory(address, job=job)
    c.create_job()
    module = net()
    model = PSModel(module, c, optimizer=adam(0.01), **kw)
    model.create_tables()
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 50, (32, 2), generator=g)
        y = torch.rand(32, generator=g)
        model.pull()
        F.mse_loss(model(ids), y).backward()
        model.push()
    return model.state_dict(), model


def test_a_bucket_trains_exactly_as_a_table_per_parameter(make_cluster, client_factory):
    cluster = make_cluster(2)
    bucketed, model = _train(client_factory, cluster.address, "bucket")
    per_table, reference = _train(client_factory, cluster.address, "per-parameter", dense_table=None)
    assert [b.table for b in model.buckets] == ["dense-params", "dense-params.1"]
    assert [b.table for b in reference.buckets] == list(reference.dense)
    assert bucketed.keys() == per_table.keys()
    for key in bucketed:                    # Adam on the flat table: the same arithmetic, element by element
        assert torch.equal(bucketed[key], per_table[key]), key
    # the unused layer never had a gradient: its values did not move (Adam would move them on zeros)
    assert torch.equal(bucketed["unused.weight"], _Net().unused.weight.detach())


@pytest.mark.slow          # make test-fast stays under a minute
def test_a_bucket_pushed_in_runs_takes_one_optimizer_step_per_push_on_every_replica(make_cluster, client_factory):
    """An unused layer between two used ones: each push reaches the bucket's block in two
    ranges, which share one Adam step (as one range would), on the primary and its backup."""
    cluster = make_cluster(3, replication=2)
    bucketed, model = _train(client_factory, cluster.address, "runs", net=_UnusedInTheMiddle)
    per_table, _ = _train(client_factory, cluster.address, "runs-per-parameter", net=_UnusedInTheMiddle,
                          dense_table=None)
    assert model.buckets[0].names == ["a.weight", "a.bias", "unused.weight", "unused.bias", "b.weight", "b.bias"]
    for key in bucketed:
        assert torch.equal(bucketed[key], per_table[key]), key
    assert replicas_agree(cluster, "runs") >= 2


def test_the_parameters_are_views_of_the_bucket_and_keep_their_names(make_cluster, client_factory):
    cluster = make_cluster(2)
    c = client_factory(cluster.address, job="views")
    c.create_job()
    module = _Net()
    model = PSModel(module, c, optimizer=sgd(0.1), optimizers={"b.bias": sgd(0.5)})
    model.create_tables()
    tables = {t.name: (t.spec.shape, t.config.optimizer.lr) for t in c.tables()}
    assert tables == {"emb": ((50, 4), 0.1), "dense-params": ((8 * 16 + 16 + 16 + 2 * 2 + 2,), 0.1),
                      "dense-params.1": ((3 * 3 + 3,), 0.1),     # frozen
                      "dense-params.2": ((1,), 0.5)}             # b.bias: an optimizer of its own
    bucket = model.buckets[0]
    assert bucket.names == ["a.weight", "a.bias", "b.weight", "unused.weight", "unused.bias"]
    assert module.a.bias.data_ptr() == bucket.flat[8 * 16:].data_ptr()
    state = model.state_dict()
    assert set(state) == set(module.state_dict()) | {"emb.weight"}    # the parameters' own names
    assert state["a.bias"].untyped_storage().nbytes() == 16 * 4      # its own copy, not the bucket's
    module._apply(lambda t: torch.full_like(t, 7.0))     # new tensors (as .to(device) makes): bound again
    model.pull()
    model(torch.zeros((1, 2), dtype=torch.int64))
    assert torch.equal(module.a.bias.detach(), torch.from_numpy(server_value(c, model, "a.bias")))
    assert module.a.bias.data_ptr() == model.buckets[0].flat[8 * 16:].data_ptr()


def test_a_bucket_name_taken_by_an_embedding_or_a_float64_parameter_is_refused(make_cluster, client_factory):
    cluster = make_cluster(1)
    c = client_factory(cluster.address, job="refused")
    module = _Net()
    with pytest.raises(InvalidArgument, match="'emb' is also an embedding's table: pass another dense_table="):
        PSModel(module, c, dense_table="emb")
    module.double()
    with pytest.raises(InvalidArgument, match="parameter 'a.weight' is torch.float64: PSModel's tables hold float32"):
        PSModel(module, c)


def test_a_job_with_a_table_per_parameter_goes_on_from_those_tables(make_cluster, client_factory, caplog):
    """A job trained before buckets (a table per parameter) keeps its dense values when the
    script runs again with today's default, instead of starting a bucket afresh."""
    cluster = make_cluster(2)
    trained, _ = _train(client_factory, cluster.address, "older", dense_table=None)
    c = client_factory(cluster.address, job="older")
    module = _Net()
    again = PSModel(module, c, optimizer=adam(0.01))
    with caplog.at_level("INFO", logger="shardps.worker"):
        again.create_tables()
    assert "has a table per dense parameter" in caplog.text
    assert [b.table for b in again.buckets] == list(again.dense)
    assert "dense-params" not in {t.name for t in c.tables()}
    state = again.state_dict()
    for key in trained:
        assert torch.equal(state[key], trained[key]), key
