"""The public API as the README teaches it, in every consistency mode (real servers on
loopback)."""

import threading

import numpy as np
import pytest
import torch
from torch import nn

from shardps.id_blocks import sparse_block_of
from shardps.tables import adagrad, sgd
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
    assert np.isfinite(client.pull_dense("dense-params")).all()


def test_a_sync_job_driven_by_the_raw_client_equals_one_large_batch(make_cluster, client_factory):
    """Three workers, the README's SYNC loop (join, wait_for_workers, `with client.step():`
    pull then push): every step applies the mean of the three gradients, as one large batch."""
    import threading
    cluster = make_cluster(2)
    workers, steps, batch, dim, lr = 3, 5, 8, 20, np.float32(0.1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((steps, workers, batch, dim)).astype(np.float32)
    y = rng.standard_normal((steps, workers, batch)).astype(np.float32)

    def grad(w, xb, yb):
        return (xb.T @ (xb @ w - yb) / np.float32(batch)).astype(np.float32)

    first = client_factory(cluster.address, job="linreg")
    first.create_job("sync")
    first.create_dense("w", (dim,), optimizer=sgd(float(lr)), block_size=8)   # blocks on both servers
    clients = [first] + [client_factory(cluster.address, job="linreg") for _ in range(workers - 1)]
    errors = []

    def train(rank: int, client) -> None:
        try:
            client.join(rank_hint=rank)
            client.wait_for_workers(workers, timeout=30)
            for t in range(steps):
                with client.step():
                    w = client.pull_dense("w")
                    client.push_dense("w", grad(w, x[t, rank], y[t, rank]))
        except Exception as exc:          # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=train, args=(r, c)) for r, c in enumerate(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not errors, errors
    expected = np.zeros(dim, np.float32)
    for t in range(steps):
        expected -= lr * np.mean([grad(expected, x[t, r], y[t, r]) for r in range(workers)], axis=0)
    np.testing.assert_allclose(first.pull_dense("w"), expected, rtol=1e-5, atol=1e-6)
    assert all(c.current_step == steps for c in clients)


def test_wait_for_workers_names_how_many_joined(make_cluster, client_factory):
    from shardps.errors import DeadlineExceeded
    cluster = make_cluster(1)
    c = client_factory(cluster.address, job="group")
    c.create_job()
    c.join(heartbeat=False)
    assert c.wait_for_workers(1, timeout=5) == 1
    with pytest.raises(DeadlineExceeded, match="1 of 2 workers"):
        c.wait_for_workers(2, timeout=0.3)
    # a wait returns when the map shows the next join (it long-polls the map's epoch)
    seen: list[int] = []
    waiting = threading.Thread(target=lambda: seen.append(c.wait_for_workers(2, timeout=60)))
    waiting.start()
    waiting.join(timeout=0.5)
    assert waiting.is_alive() and not seen, "returned before the second worker joined"
    client_factory(cluster.address, job="group").join(heartbeat=False)
    waiting.join(timeout=30)
    assert seen == [2]


def test_a_worker_whose_join_completes_the_group_does_not_wait_for_one_that_already_left(
        make_cluster, client_factory):
    """``wait_for_workers(2)`` (``shardps worker --wait-workers 2``): the first worker saw the
    second join, trained its few steps and left before the second looked at the group; the
    second goes on (its join made two), instead of waiting for a second member that will not
    come."""
    cluster = make_cluster(1)
    fast, slow = (client_factory(cluster.address, job="rendezvous") for _ in range(2))
    fast.create_job("sync")
    assert fast.join(heartbeat=False).world_size == 1
    joined = slow.join(heartbeat=False)
    assert joined.world_size == 2
    assert fast.wait_for_workers(2, timeout=5) == 2
    fast.leave()
    slow.refresh_map()
    assert len(slow.group().members) == 1
    assert slow.wait_for_workers(2, timeout=5) == 2


def test_a_worker_that_looks_after_the_others_left_still_sees_the_group_was_whole(
        make_cluster, client_factory):
    """``--wait-workers 3``: the second worker joined when the group had two, the third made
    it whole, and the first and third trained their few steps and left before the second
    looked again (8 workers on 16 cores, each training 50 steps, did this). The second goes
    on: the group has had three members, though one is left."""
    cluster = make_cluster(1)
    first, middle, last = (client_factory(cluster.address, job="rendezvous3") for _ in range(3))
    first.create_job()
    first.join(heartbeat=False)
    assert middle.join(heartbeat=False).world_size == 2
    last.join(heartbeat=False)
    first.leave()
    last.leave()
    middle.refresh_map()
    assert len(middle.group().members) == 1
    assert middle.group().peak_members == 3
    assert middle.wait_for_workers(3, timeout=5) == 3


def test_the_next_run_of_a_job_waits_for_its_own_workers(make_cluster, client_factory):
    """The group's peak starts again once every member left: a job's second run with
    ``--wait-workers 2`` waits for two of its own workers, not the two of the first run."""
    from shardps.errors import DeadlineExceeded
    cluster = make_cluster(1)
    first_run = [client_factory(cluster.address, job="rerun") for _ in range(2)]
    first_run[0].create_job()
    for c in first_run:
        c.join(heartbeat=False)
    for c in first_run:
        c.leave()
    second = client_factory(cluster.address, job="rerun")
    second.join(heartbeat=False)
    assert second.group().peak_members == 1
    with pytest.raises(DeadlineExceeded, match="1 of 2 workers"):
        second.wait_for_workers(2, timeout=0.3)


def test_a_psmodel_refuses_another_dtype_at_once_and_keeps_training(cluster, client_factory):
    from shardps.errors import InvalidArgument
    client = client_factory(cluster.address, job="dtype")
    client.create_job()
    model = PSModel(Recommender(), client, optimizer=sgd(0.1))
    model.create_tables()
    for change in (lambda m: m.to(torch.float64), lambda m: m.double(), lambda m: m.half()):
        with pytest.raises(InvalidArgument, match="cannot become torch.float"):
            change(model)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    model.to("cpu")                                     # a device is fine
    model.pull()
    model(torch.tensor([[1, 2]])).sum().backward()
    model.push()
    model.flush()
