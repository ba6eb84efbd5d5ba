"""Checkpoints of your own training loop: one call per step (``PSModel.maybe_checkpoint``)
joins an on-demand or periodic checkpoint, ``PSModel.resume`` goes on from it after a
restore, and ``shardps checkpoint`` names the ranks that never reached the barrier and what
their loop must call. In-process clusters on loopback."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from torch import nn

from shardps.server.manager.checkpoint_files import read_checkpoint
from shardps.tables import sgd
from shardps.tools import cli
from shardps.worker.torch_ps import PSModel


def _step(ps_model, model, g) -> None:
    ps_model.pull()
    model(torch.randn(8, 4, generator=g)).square().mean().backward()
    ps_model.push()


def test_a_custom_loop_joins_an_on_demand_checkpoint_and_resumes_from_it(make_cluster, client_factory, tmp_path):
    cluster = make_cluster(2)
    cluster.manager.service.checkpoints.default_dir = str(tmp_path)
    c = client_factory(cluster.address, job="loop")
    c.create_job()
    c.join(name="my-loop")                   # the heartbeat brings checkpoint requests
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    ps_model = PSModel(model, c, optimizer=sgd(0.05))
    ps_model.create_tables()
    assert ps_model.maybe_checkpoint() is None          # nothing asked: returns at once
    paths: list[str] = []
    stop = threading.Event()

    def loop():
        g = torch.Generator().manual_seed(1)
        while not stop.is_set():
            _step(ps_model, model, g)
            path = ps_model.maybe_checkpoint(epoch=3, batch=ps_model.step)
            if path is not None:
                paths.append(path)
                stop.set()

    t = threading.Thread(target=loop)
    t.start()
    admin = client_factory(cluster.address, job="loop")
    resp = admin.checkpoint(timeout=60)                 # what `shardps checkpoint loop` calls
    t.join(timeout=60)
    assert not t.is_alive()
    assert paths == [resp.path]
    ck = read_checkpoint(resp.path)
    assert list(ck.workers) == [0] and ck.step == ps_model.step
    saved = c.state_dict()
    saved_bn = model[1].running_mean.clone()
    g = torch.Generator().manual_seed(2)
    for _ in range(3):                                   # training goes on, then a restore
        _step(ps_model, model, g)
    c.leave()
    admin.restore(resp.path)

    again = client_factory(cluster.address, job="loop")
    again.join(name="my-loop", heartbeat=False)
    fresh = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    resumed = PSModel(fresh, again, optimizer=sgd(0.05))
    resumed.create_tables()
    assert resumed.resume() == (3, ck.step) and resumed.step == ck.step
    assert torch.equal(fresh[1].running_mean, saved_bn)
    for k, v in again.state_dict().items():
        np.testing.assert_array_equal(v, saved[k], err_msg=k)


def test_periodic_checkpoints_every_n_steps(make_cluster, client_factory, tmp_path):
    cluster = make_cluster(2)
    cluster.manager.service.checkpoints.default_dir = str(tmp_path)
    c = client_factory(cluster.address, job="every")
    c.create_job()
    c.join(name="w0", heartbeat=False)
    model = nn.Sequential(nn.Linear(4, 1))
    ps_model = PSModel(model, c, optimizer=sgd(0.05))
    ps_model.create_tables()
    g = torch.Generator().manual_seed(0)
    made = []
    for _ in range(7):
        _step(ps_model, model, g)
        path = ps_model.maybe_checkpoint(every=3)
        if path is not None:
            made.append((ps_model.step, read_checkpoint(path).step))
        assert ps_model.maybe_checkpoint(every=3) is None, "once per step"
    assert made == [(3, 3), (6, 6)]


def _dies(client) -> None:
    """The worker dies without leaving: its last heartbeat reported its steps."""
    client.heartbeat()


def _seven_steps(client_factory, address: str, job: str, every: int):
    """A worker "w0" of a new ``job`` trains 7 steps, checkpointing every ``every`` (0: never):
    (its client, its PSModel, its batch-norm mean at the last checkpoint)."""
    c = client_factory(address, job=job)
    c.create_job()
    c.join(name="w0", heartbeat=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    ps_model = PSModel(model, c, optimizer=sgd(0.05))
    ps_model.create_tables()
    g = torch.Generator().manual_seed(0)
    at_checkpoint = None
    for _ in range(7):
        _step(ps_model, model, g)
        if every and ps_model.maybe_checkpoint(every=every, epoch=1, batch=ps_model.step) is not None:
            at_checkpoint = model[1].running_mean.clone()           # steps 3, then 6
    return c, ps_model, at_checkpoint


def test_a_rank_started_again_without_a_restore_takes_its_state_from_the_latest_checkpoint(
        make_cluster, client_factory, tmp_path):
    """A worker dies and starts again (no ``shardps restore``): the tables go on as the
    servers hold them, its step is the one it had reached, its local state the latest
    checkpoint's; without a checkpoint, only the step comes back."""
    cluster = make_cluster(2)
    cluster.manager.service.checkpoints.default_dir = str(tmp_path)
    for job, every in (("again", 3), ("no-checkpoint", 0)):
        c, ps_model, at_checkpoint = _seven_steps(client_factory, cluster.address, job, every)
        ps_model.flush()
        tables = c.state_dict()
        _dies(c)

        again = client_factory(cluster.address, job=job)
        assert again.join(name="w0", heartbeat=False).previous_step == 7
        fresh = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
        resumed = PSModel(fresh, again, optimizer=sgd(0.05))
        resumed.create_tables()
        position = resumed.resume()
        assert resumed.step == 7
        for k, v in again.state_dict().items():                      # the tables: as the servers hold them
            np.testing.assert_array_equal(v, tables[k], err_msg=k)
        if every:
            assert position == (1, 6)                                # the checkpoint's data position
            assert torch.equal(fresh[1].running_mean, at_checkpoint)     # the local state: step 6's
        else:
            assert position is None and torch.equal(fresh[1].running_mean, torch.zeros(4))


@pytest.mark.slow          # make test-fast stays under a minute
def test_a_later_elastic_round_goes_on_from_the_latest_checkpoint_when_the_manager_lost_the_step(
        make_cluster, client_factory, tmp_path, monkeypatch):
    """The last round's rank left (torchrun stopped it) before the new round joined: the
    manager tells step 0, and a first start would begin afresh; a later round of torch's
    elastic agent goes on from the latest checkpoint."""
    cluster = make_cluster(2)
    cluster.manager.service.checkpoints.default_dir = str(tmp_path)
    c, _, at_checkpoint = _seven_steps(client_factory, cluster.address, "round", 3)
    c.leave()
    for restart_count, position, step in (("0", None, 0), ("1", (1, 6), 6)):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart_count)
        again = client_factory(cluster.address, job="round")
        assert again.join(name="w0", heartbeat=False).previous_step == 0
        fresh = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
        resumed = PSModel(fresh, again, optimizer=sgd(0.05))
        resumed.create_tables()
        assert resumed.resume() == position and resumed.step == step
        if position:
            assert torch.equal(fresh[1].running_mean, at_checkpoint)
        again.leave()


@pytest.mark.slow          # waits out leases or retry intervals: over a second
def test_shardps_checkpoint_names_the_ranks_that_never_arrive_and_what_they_must_call(
        make_cluster, client_factory, tmp_path, capsys):
    cluster = make_cluster(2)
    coordinator = cluster.manager.service.checkpoints
    coordinator.default_dir = str(tmp_path)
    coordinator.barrier_timeout = 1.5
    c = client_factory(cluster.address, job="silent")
    c.create_job()
    c.join(name="never-polls", heartbeat=False)
    code = cli.main(["checkpoint", "silent", "--manager", cluster.address])
    err = capsys.readouterr().err
    assert code == 2
    assert "rank 0 ('never-polls') of 1 live worker(s) did not reach the checkpoint barrier within 1.5 s" in err
    assert "ps_model.maybe_checkpoint()" in err and "nothing was written" in err
    assert "waited" not in err, "the manager answered: no hint about reaching it"
    assert not list(tmp_path.iterdir())


@pytest.mark.slow             # over a second: make test-fast stays under a minute
def test_a_hybrid_models_dense_values_and_optimizer_state_come_back_with_a_restore(make_cluster, client_factory,
                                                                                     tmp_path):
    import torch.distributed as dist

    from shardps.worker.torch_ps import PSEmbedding

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.items = PSEmbedding(50, 4)
            self.head = nn.Linear(4, 1)

        def forward(self, ids):
            return self.head(self.items(ids).mean(dim=1)).squeeze(1)

    cluster = make_cluster(2)
    cluster.manager.service.checkpoints.default_dir = str(tmp_path)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        c = client_factory(cluster.address, job="hybrid-ck")
        c.create_job()
        c.join(name="w0", heartbeat=False)
        net = Net()
        model = PSModel(net, c, dense="allreduce", dense_optimizer=torch.optim.Adam(net.parameters(), lr=0.01))
        model.create_tables()
        for step in range(3):
            model.pull()
            model(torch.tensor([[step, step + 1]])).sum().backward()
            model.push()
            path = model.maybe_checkpoint(every=3)
        assert path is not None
        saved_head = net.head.weight.detach().clone()
        saved_adam = model.local_optimizer.state_dict()["state"][0]["exp_avg"].clone()
        c.leave()
        admin = client_factory(cluster.address, job="hybrid-ck")
        admin.restore(path)

        again = client_factory(cluster.address, job="hybrid-ck")
        again.join(name="w0", heartbeat=False)
        fresh = Net()
        resumed = PSModel(fresh, again, dense="allreduce",
                          dense_optimizer=torch.optim.Adam(fresh.parameters(), lr=0.01))
        resumed.create_tables()
        assert resumed.resume() == (0, 0) and resumed.step == 3
        assert torch.equal(fresh.head.weight, saved_head)          # the dense values, from the worker state
        assert torch.equal(resumed.local_optimizer.state_dict()["state"][0]["exp_avg"], saved_adam)
    finally:
        dist.destroy_process_group()
