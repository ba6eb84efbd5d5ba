"""Server-side optimizers (numpy) against torch.optim on the same gradients (pure)."""

import numpy as np
import pytest
import torch

from shardps.server import optimizers
from shardps.tables import adagrad, adam, sgd
from shardps.worker.runtime import torch_optimizer

DENSE = [sgd(0.1), sgd(0.1, momentum=0.9), sgd(0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
         sgd(0.1, momentum=0.5, dampening=0.3), adagrad(0.1), adagrad(0.1, lr_decay=0.01, weight_decay=0.1,
                                                               initial_accumulator_value=0.1),
         adam(1e-2), adam(1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01)]


@pytest.mark.parametrize("cfg", DENSE, ids=lambda c: f"{c.kind.name}-{c.momentum}-{c.weight_decay}")
def test_dense_matches_torch(cfg):
    rng = np.random.default_rng(0)
    p0 = rng.standard_normal(1000).astype(np.float32)
    ours, state = p0.copy(), optimizers.new_state(cfg, p0.shape)
    ref = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt = torch_optimizer(cfg, [ref])
    for step in range(1, 11):
        g = rng.standard_normal(1000).astype(np.float32)
        optimizers.apply(cfg, ours, g, state, step)
        ref.grad = torch.from_numpy(g)
        opt.step()
    np.testing.assert_allclose(ours, ref.detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cfg", [sgd(0.1), adagrad(0.1)], ids=["sgd", "adagrad"])
def test_sparse_rows_match_torch_sparse_gradients(cfg):
    rng = np.random.default_rng(1)
    table = rng.standard_normal((50, 4)).astype(np.float32)
    ref = torch.nn.Parameter(torch.from_numpy(table.copy()))
    opt = torch_optimizer(cfg, [ref])
    ours = table.copy()
    state = optimizers.new_state(cfg, table.shape)
    steps = np.zeros((50, 1), dtype=np.int64)
    for _ in range(10):
        ids = np.unique(rng.integers(0, 50, 12))
        g = rng.standard_normal((ids.shape[0], 4)).astype(np.float32)
        steps[ids] += 1
        rows = ours[ids]
        st = {k: v[ids] for k, v in state.items()}
        optimizers.apply(cfg, rows, g, st, steps[ids] if state else 1)
        ours[ids] = rows
        for k, v in st.items():
            state[k][ids] = v
        ref.grad = torch.sparse_coo_tensor(torch.from_numpy(ids)[None], torch.from_numpy(g), (50, 4))
        opt.step()
    np.testing.assert_allclose(ours, ref.detach().numpy(), rtol=1e-5, atol=1e-6)
