"""Acceptance: server-side optimizers equal PyTorch's, through 3 real server processes.

A 10,000,000-element dense table and a sparse table of 100,000 random ids x 16 are pushed
and pulled through PSClient for 10 steps and compared with torch.optim on the same gradients.
"""

import numpy as np
import pytest
import torch

from shardps.tables import adagrad, adam, sgd
from shardps.tools.local import LocalCluster
from shardps.worker.client import PSClient
from shardps.worker.runtime import torch_optimizer

pytestmark = pytest.mark.slow     # every test trains on a LocalCluster (processes)

STEPS = 10
DENSE_N = 10_000_000
SPARSE_IDS = 100_000
DIM = 16


@pytest.fixture(scope="module")
def client():
    with LocalCluster(servers=3) as cluster:
        c = PSClient(cluster.manager_address, "acceptance", timeout=120)
        c.create_job()
        c.join()                 # a session: pushes retried across live moves apply once
        yield c
        c.close()


def dense_run(client, name, cfg):
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    client.create_dense(name, (DENSE_N,), optimizer=cfg)
    p0 = client.pull_dense(name)
    ref = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt = torch_optimizer(cfg, [ref])
    for _ in range(STEPS):
        g = rng.standard_normal(DENSE_N, dtype=np.float32)
        client.push_dense(name, g)
        ref.grad = torch.from_numpy(g)
        opt.step()
        ours = client.pull_dense(name)
    return ours, ref.detach().numpy()


@pytest.mark.parametrize("cfg", [sgd(0.1), sgd(0.1, momentum=0.9), adagrad(0.1), adam(1e-3)],
                         ids=["sgd", "sgd-momentum", "adagrad", "adam"])
def test_dense_optimizer_equals_torch(client, cfg):
    ours, ref = dense_run(client, f"dense-{cfg.kind.name}-{cfg.momentum}", cfg)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-6)


def sparse_batches(seed):
    rng = np.random.default_rng(seed)
    ids = np.unique(rng.integers(-2**62, 2**62, SPARSE_IDS * 2))[:SPARSE_IDS]
    rng.shuffle(ids)
    for _ in range(STEPS):
        pos = rng.integers(0, SPARSE_IDS, 30_000)           # repeats: summed
        yield ids, pos, rng.standard_normal((pos.shape[0], DIM), dtype=np.float32)


@pytest.mark.parametrize("cfg", [sgd(0.1), adagrad(0.1)], ids=["sgd", "adagrad"])
def test_sparse_optimizer_equals_torch_sparse_gradients(client, cfg):
    name = f"sparse-{cfg.kind.name}"
    client.create_sparse(name, DIM, optimizer=cfg)
    ref = opt = ids = None
    for ids, pos, g in sparse_batches(7):
        if ref is None:
            ref = torch.nn.Parameter(torch.from_numpy(client.pull_rows(name, ids)))
            opt = torch_optimizer(cfg, [ref])
        client.push_rows(name, ids[pos], g)
        ref.grad = torch.sparse_coo_tensor(torch.from_numpy(pos)[None], torch.from_numpy(g), (SPARSE_IDS, DIM))
        opt.step()
    np.testing.assert_allclose(client.pull_rows(name, ids), ref.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_sparse_adam_per_row_steps_equal_a_torch_reference(client):
    cfg = adam(1e-2)
    name = "sparse-adam"
    client.create_sparse(name, DIM, optimizer=cfg)
    p = m = v = steps = ids = None
    for ids, pos, g in sparse_batches(11):
        if p is None:
            p = torch.from_numpy(client.pull_rows(name, ids))
            m, v = torch.zeros_like(p), torch.zeros_like(p)
            steps = torch.zeros(SPARSE_IDS, 1, dtype=torch.float64)
        client.push_rows(name, ids[pos], g)
        grad = torch.zeros_like(p).index_add_(0, torch.from_numpy(pos), torch.from_numpy(g))
        rows = torch.unique(torch.from_numpy(pos))
        steps[rows] += 1
        gr, st = grad[rows], steps[rows]
        m[rows] = m[rows] + (1 - cfg.beta1) * (gr - m[rows])
        v[rows] = v[rows] * cfg.beta2 + (1 - cfg.beta2) * gr * gr
        step_size = (cfg.lr / (1 - cfg.beta1 ** st)).float()
        denom = v[rows].sqrt() / (1 - cfg.beta2 ** st).sqrt().float() + cfg.eps
        p[rows] = p[rows] - step_size * m[rows] / denom
    np.testing.assert_allclose(client.pull_rows(name, ids), p.numpy(), rtol=1e-5, atol=1e-6)
