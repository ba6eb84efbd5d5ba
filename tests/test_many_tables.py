"""Models of many tensors and tables of many blocks: created in one map change, all or none;
a request carries thousands of segments to one server; a model of 1,200 parameter tensors
trains on one server as in one process."""

import numpy as np
import pytest
import torch
from torch import nn

from shardps.errors import AlreadyExists, InvalidArgument, NotFound
from shardps.tables import dense_table, sgd, sparse_table
from shardps.worker.torch_ps import PSModel


def test_tables_created_together_take_one_map_change_all_or_none(make_cluster, client_factory):
    cluster = make_cluster(2)
    c = client_factory(cluster.address, job="many")
    c.create_job()
    epoch = c.refresh_map().epoch
    views = c.create_tables([(dense_table(f"w{i}", (3, 5)), sgd(0.1)) for i in range(200)]
                            + [(sparse_table("e", 4, num_rows=100), sgd(0.5))])
    assert c.shard_map.epoch == epoch + 1
    assert [v.name for v in views] == [f"w{i}" for i in range(200)] + ["e"]
    assert c.table("e").config.optimizer.lr == 0.5 and c.pull_dense("w199").shape == (3, 5)
    with pytest.raises(AlreadyExists, match="'w7' of job 'many' exists with another spec"):
        c.create_tables([(dense_table("fresh", (2,)), sgd(0.1)), (dense_table("w7", (4, 5)), sgd(0.1))])
    with pytest.raises(InvalidArgument, match="'twice' of job 'many' is named twice"):
        c.create_tables([(dense_table("twice", (2,)), sgd(0.1))] * 2)
    names = {t.name for t in c.refresh_map().tables.values() if t.job == "many"}
    assert "fresh" not in names and "twice" not in names and len(names) == 201
    again = c.create_tables([(dense_table("w0", (3, 5)), sgd(0.1))])    # identical: idempotent
    assert again[0].name == "w0" and c.refresh_map().epoch == epoch + 1


def test_a_schedule_sets_every_tables_learning_rate_in_one_map_change(make_cluster, client_factory):
    cluster = make_cluster(2)
    c = client_factory(cluster.address, job="lr")
    c.create_job()
    model = PSModel(_Wide(20), c, optimizer=sgd(0.2), dense_table=None)     # a table per parameter
    model.create_tables()
    epoch = c.refresh_map().epoch
    model.set_lr(lambda base: base / 4)
    assert c.shard_map.epoch == epoch + 1
    assert {c.table(name).config.optimizer.lr for name in model.dense} == {0.05}
    with pytest.raises(InvalidArgument, match="table 'branches.3.bias': unknown setting"):
        c.update_configs({"branches.0.bias": {"lr": 1.0}, "branches.3.bias": {"rate": 1.0}})
    with pytest.raises(NotFound, match="'nope'"):
        c.update_configs({"branches.0.bias": {"lr": 1.0}, "nope": {"lr": 1.0}})
    assert c.refresh_map().epoch == epoch + 1 and c.table("branches.0.bias").config.optimizer.lr == 0.05


@pytest.mark.slow             # over a second: make test-fast stays under a minute
def test_a_dense_table_of_thousands_of_blocks_pulls_and_pushes_whole(make_cluster, client_factory):
    """6,250 blocks over two servers: each server gets its blocks as a thousand or more
    ranges of one request (once refused over a limit of 1,024 segments a request)."""
    cluster = make_cluster(2)
    c = client_factory(cluster.address, job="blocks")
    c.create_job()
    n = 100_000
    c.create_dense("w", (n,), optimizer=sgd(1.0), block_size=16)
    primaries = c.table("w").primary
    runs = 1 + int(np.count_nonzero(primaries[1:] != primaries[:-1]))
    assert runs > 2 * 1024, f"{runs} ranges: too few to cross the old limit"
    assert not c.pull_dense("w").any()
    grad = np.arange(n, dtype=np.float32)
    c.push_dense("w", grad)
    np.testing.assert_array_equal(c.pull_dense("w"), -grad)


class _Wide(nn.Module):
    """``width`` small linear branches summed: 2 x ``width`` parameter tensors, every one of
    which gets a gradient each step."""

    def __init__(self, width: int):
        super().__init__()
        torch.manual_seed(0)
        self.branches = nn.ModuleList(nn.Linear(4, 1) for _ in range(width))

    def forward(self, x):
        return sum(b(x) for b in self.branches)


@pytest.mark.slow               # ~5 s: 1,200 tables
def test_a_model_of_1200_tensors_trains_on_one_server_as_in_one_process(make_cluster, client_factory):
    cluster = make_cluster(1)
    c = client_factory(cluster.address, job="deep")
    c.create_job()
    c.join(heartbeat=False)
    epoch = c.refresh_map().epoch
    model = PSModel(_Wide(600), c, optimizer=sgd(0.05))
    model.create_tables()
    assert len(model.dense) == 1200 and c.shard_map.epoch == epoch + 1    # one map for the lot
    local = _Wide(600)
    opt = torch.optim.SGD(local.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen)
        model.pull()
        ((model(x) - y) ** 2).mean().backward()
        model.push()
        opt.zero_grad()
        ((local(x) - y) ** 2).mean().backward()
        opt.step()
    model.flush()
    model.pull()
    for (name, got), (_, want) in zip(model.module.named_parameters(), local.named_parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
