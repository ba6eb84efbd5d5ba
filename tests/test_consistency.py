"""Consistency models through real servers: BSP equals large-batch training, SSP bounds
staleness even with a slow worker."""

import threading
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardps.tables import sgd
from shardps.worker.torch_ps import PSModel


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))


def digits():
    from sklearn.datasets import load_digits
    d = load_digits()
    return torch.from_numpy((d.data / 16.0).astype(np.float32)), torch.from_numpy(d.target.astype(np.int64))


def run_workers(n, body):
    errors = []

    def wrap(i):
        try:
            body(i)
        except BaseException as exc:   # surfaced in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    if errors:
        raise errors[0]


@pytest.mark.slow          # ~7 s
def test_sync_with_n_workers_equals_single_process_with_batch_n_times_b(make_cluster, client_factory):
    cluster = make_cluster(2)
    x, y = digits()
    n_workers, b, steps, lr = 2, 16, 20, 0.1
    admin = client_factory(cluster.address, job="bsp")
    admin.create_job("sync")
    clients = [client_factory(cluster.address, job="bsp") for _ in range(n_workers)]
    models = []
    for i, c in enumerate(clients):
        c.join(name=f"w{i}", heartbeat=False)
    for c in clients:
        m = PSModel(mlp(0), c, optimizer=sgd(lr), report_steps=True)
        m.create_tables()
        models.append(m)

    def worker(i):
        m = models[i]
        for t in range(steps):
            m.pull()
            lo = t * n_workers * b + i * b
            loss = F.cross_entropy(m(x[lo:lo + b]), y[lo:lo + b])
            loss.backward()
            m.push()

    run_workers(n_workers, worker)
    models[0].pull()
    distributed = {k: v.detach().clone() for k, v in models[0].module.state_dict().items()}

    ref = mlp(0)
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for t in range(steps):
        lo = t * n_workers * b
        loss = F.cross_entropy(ref(x[lo:lo + n_workers * b]), y[lo:lo + n_workers * b])
        opt.zero_grad()
        loss.backward()
        opt.step()
    for k, v in ref.state_dict().items():
        np.testing.assert_allclose(distributed[k].numpy(), v.numpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=f"parameter {k} differs after {steps} steps")


@pytest.mark.slow          # ~3 s
def test_ssp_staleness_never_exceeds_t_with_a_slow_worker(make_cluster, client_factory):
    cluster = make_cluster(2)
    T = 2
    admin = client_factory(cluster.address, job="ssp")
    admin.create_job("ssp", staleness=T)
    clients = [client_factory(cluster.address, job="ssp") for _ in range(3)]
    for i, c in enumerate(clients):
        c.join(name=f"w{i}", heartbeat=False)
    models = []
    for c in clients:
        m = PSModel(mlp(0), c, optimizer=sgd(0.05), report_steps=True)
        m.create_tables()
        models.append(m)
    x, y = digits()
    seen = {i: [] for i in range(3)}
    steps = {0: 30, 1: 30, 2: 10}
    delay = {0: 0.0, 1: 0.0, 2: 0.15}     # worker 2 is slow: the others must wait for it

    def worker(i):
        m, c = models[i], clients[i]
        for _t in range(steps[i]):
            m.pull()
            seen[i].append(c.last_staleness)
            loss = F.cross_entropy(m(x[:32]), y[:32])
            loss.backward()
            time.sleep(delay[i])
            m.push()
        c.leave()                          # the fast ones continue once the slow one leaves

    run_workers(3, worker)
    worst = max(max(v) for v in seen.values())
    print(f"SSP(T={T}) staleness at pulls: max {worst}; fast worker saw {sorted(set(seen[0]))}")
    assert worst <= T, f"staleness {worst} exceeded T={T}"
    assert max(seen[0]) == T, "the slow worker never held the fast ones back: the test could not fail"
    hist = sum(s.metrics.registry.get_sample_value("shardps_pull_staleness_steps_sum", {"training_job": "ssp"}) or 0.0
               for s in cluster.servers.values())
    assert hist > 0, "staleness histogram recorded nothing"
