"""``shardps.worker.device_copies``, on any machine: the CPU pass-through, the staging pool's
choices (decided purely, acted on with fake events), and a CPU training through PSModel
that ends bit for bit where a plain-torch reference of the same steps ends. The copies on a
GPU (pinned buffers, the copy stream, a CPU run against a CUDA run): tests/test_cuda.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardps.tables import normal, sgd
from shardps.worker.device_copies import (
    MIN_STAGING_BYTES,
    DeviceCopies,
    SlotView,
    Staging,
    StagingPool,
    choose_staging,
    staging_capacity,
)
from shardps.worker.torch_ps import PSEmbedding, PSModel
from tests.dense import server_value

CPU = torch.device("cpu")
F32 = np.dtype(np.float32)
LEAST = MIN_STAGING_BYTES // 4          # float32 elements in the least buffer


# ---------------------------------------------------------------- the CPU: nothing moves
def test_to_device_on_the_cpu_wraps_the_array_without_a_copy():
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = DeviceCopies().to_device(rows, CPU)
    assert out.dtype == torch.float32 and out.shape == (3, 4)
    assert np.shares_memory(out.numpy(), rows), "torch.from_numpy, as before"
    ids = np.array([4, 1, 1], dtype=np.int64)
    assert DeviceCopies().to_device(ids, CPU).tolist() == [4, 1, 1]
    together = DeviceCopies().to_device_all([rows, ids, np.zeros((0, 2), np.float32)], CPU)
    assert [tuple(t.shape) for t in together] == [(3, 4), (3,), (0, 2)]
    assert np.shares_memory(together[0].numpy(), rows) and np.shares_memory(together[1].numpy(), ids)


def test_to_host_all_on_the_cpu_returns_views_of_the_gradients():
    grads = [torch.randn(3, 4), torch.randn(5, requires_grad=True) * 2, torch.zeros(0, 4)]
    copies = DeviceCopies()
    out = copies.to_host_all(grads)
    copies.to_device(np.ones(3, np.float32), torch.device("cpu"))
    assert copies.seconds == 0.0, "nothing is copied on the CPU: no copy time in the step's split"
    for grad, array in zip(grads, out):
        np.testing.assert_array_equal(array, grad.detach().numpy())
    assert np.shares_memory(out[0], grads[0].numpy()), "tensor.detach().cpu().numpy(), as before"
    assert DeviceCopies().to_host_all([grads[0]])[0].shape == (3, 4)


# ---------------------------------------------------------------- the pool's decisions
def test_staging_capacity_is_a_power_of_two_at_least_the_least_buffer():
    assert staging_capacity(1, 4) == LEAST
    assert staging_capacity(LEAST, 4) == LEAST
    assert staging_capacity(LEAST + 1, 4) == 2 * LEAST, "regrown: it doubles at least"
    assert staging_capacity(3 * LEAST, 4) == 4 * LEAST
    assert staging_capacity(1, 8) == MIN_STAGING_BYTES // 8


def slot(capacity: int, busy: bool = False, issued: int = 0) -> SlotView:
    return SlotView(capacity, busy, issued)


@pytest.mark.parametrize("slots, need, expected", [
    ([], 10, Staging(0, LEAST)),                                          # none yet: a new one
    ([slot(4 * LEAST), slot(LEAST), slot(2 * LEAST)], 10, Staging(1, LEAST)),       # smallest idle that fits
    ([slot(LEAST, busy=True), slot(2 * LEAST)], 10, Staging(1, 2 * LEAST)),         # a busy one is not written
    ([slot(LEAST), slot(2 * LEAST), slot(LEAST, busy=True)], 3 * LEAST, Staging(1, 4 * LEAST)),  # largest idle, regrown
    ([slot(8 * LEAST, busy=True)], 10, Staging(1, LEAST)),                # all busy: another buffer
    ([slot(LEAST, True, 7), slot(LEAST, True, 3)], 10, Staging(1, LEAST, wait=True)),           # full: the oldest
    ([slot(LEAST, True, 7), slot(LEAST, True, 3)], 3 * LEAST, Staging(1, 4 * LEAST, wait=True)),
])
def test_choose_staging_never_writes_a_buffer_a_copy_reads(slots, need, expected):
    choice = choose_staging(slots, need, 4, max_buffers=2)
    assert choice == expected
    if choice.index < len(slots):
        assert not slots[choice.index].busy or choice.wait
        assert choice.capacity >= slots[choice.index].capacity, "never shrinks"
    assert choice.capacity >= need


class FakeEvent:
    """``torch.cuda.Event``'s ``query`` / ``synchronize``: done once ``synchronize``d (or set)."""

    def __init__(self, done: bool = False):
        self.done, self.waited = done, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = self.done = True


def host_buffer(dtype: torch.dtype, capacity: int) -> torch.Tensor:
    return torch.empty(capacity, dtype=dtype)


def test_the_pool_reuses_a_buffer_only_once_its_copy_completed():
    pool = StagingPool(host_buffer, max_buffers=2)
    first = pool.take(F32, 100)
    assert first.buffer.dtype == torch.float32 and first.buffer.numel() == LEAST
    copy = FakeEvent()
    pool.issued(first, copy)
    second = pool.take(F32, 100)
    assert second is not first, "the first buffer's copy is in flight"
    pool.issued(second, FakeEvent())
    copy.done = True
    assert pool.take(F32, 100) is first, "its copy completed: reused"
    ids = pool.take(np.dtype(np.int64), 10)
    assert ids.buffer.dtype == torch.int64 and all(s is not ids for s in pool.slots[F32]), "one pool per dtype"


def test_a_full_pool_waits_for_the_oldest_copy_then_grows_that_buffer():
    pool = StagingPool(host_buffer, max_buffers=2)
    events = [FakeEvent(), FakeEvent()]
    taken = []
    for event in events:
        taken.append(pool.take(F32, 10))
        pool.issued(taken[-1], event)
    again = pool.take(F32, 3 * LEAST)
    assert again is taken[0] and events[0].waited and not events[1].waited
    assert again.buffer.numel() == 4 * LEAST and len(pool.slots[F32]) == 2


# ---------------------------------------------------------------- PSModel: the results stand
class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.items = PSEmbedding(20, 4, optimizer=sgd(0.5), init=normal(0.0, 0.1, seed=4))
        self.head = nn.Linear(4, 1)

    def forward(self, ids):
        return self.head(self.items(ids).mean(dim=1)).squeeze(1)


def test_a_cpu_training_ends_where_a_plain_torch_reference_ends_bit_for_bit(make_cluster, client_factory):
    """PSModel's rows in, gradients out (``DeviceCopies`` on the CPU, the held push riding
    with the next pull) against the same steps in plain torch and numpy: SGD on the servers
    is ``w -= float32(lr) * g``."""
    client = client_factory(make_cluster(1).address, job="copies")
    client.create_job()
    client.join(heartbeat=False)
    torch.manual_seed(0)
    module = Tiny()
    ps = PSModel(module, client, optimizer=sgd(0.25))
    ps.create_tables()
    table = client.pull_rows("items", np.arange(20)).copy()
    dense = {name: p.detach().numpy().copy() for name, p in module.head.named_parameters()}
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 20, (6, 3), generator=g), torch.randn(6, generator=g)) for _ in range(3)]
    for x, y in batches:
        ps.pull()
        F.mse_loss(ps(x), y).backward()
        ps.push()
    ps.settle()

    head = nn.Linear(4, 1)
    for x, y in batches:
        with torch.no_grad():
            for name, p in head.named_parameters():
                p.copy_(torch.from_numpy(dense[name]))
        unique, inverse = torch.unique(x.reshape(-1), return_inverse=True)
        rows = torch.from_numpy(table[unique.numpy()]).requires_grad_(True)
        F.mse_loss(head(F.embedding(inverse.reshape(x.shape), rows).mean(dim=1)).squeeze(1), y).backward()
        assert rows.grad is not None
        table[unique.numpy()] -= np.float32(0.5) * rows.grad.numpy()
        for name, p in head.named_parameters():
            assert p.grad is not None
            dense[name] -= np.float32(0.25) * p.grad.numpy()
            p.grad = None
    np.testing.assert_array_equal(client.pull_rows("items", np.arange(20)), table)
    for name in dense:
        np.testing.assert_array_equal(server_value(client, ps, f"head.{name}"), dense[name].reshape(-1))
