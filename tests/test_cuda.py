"""shardps with CUDA models: ``shardps worker --device cuda``, ``PSModel`` and
``PSEmbeddingBagCollection`` on the GPU, and a CPU run and a CUDA run of one seed ending with
the same parameters (to float tolerance); the copies a GPU step makes (``DeviceCopies``:
pinned staging buffers, the copy stream, the gradients' copies in flight together; their CPU
side and the staging pool's decisions: tests/test_device_copies.py). A checkpoint / restore
of a worker training on the GPU: tests/test_checkpoint.py (``test_worker_state_survives_a_restore[cuda]``).

Runs where torch sees a CUDA device and skips, saying why, everywhere else; the device
choice itself is tested on every machine in tests/test_device.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardps.tables import adagrad, normal, sgd, uniform
from shardps.worker.device import no_cuda_reason
from shardps.worker.device_copies import DeviceCopies, StagingPool
from shardps.worker.embedding_bag import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from shardps.worker.torch_ps import PSEmbedding, PSEmbeddingBagCollection, PSModel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason=f"needs a CUDA device: {no_cuda_reason() or 'torch sees none'}")

SHARDPS = [sys.executable, "-m", "shardps.tools.cli"]
GPU = torch.device("cuda", 0)
CPU = torch.device("cpu")


def ps_items() -> nn.Module:
    return PSEmbedding(1_000, 8, optimizer=adagrad(lr=0.1), init=normal(0.0, 0.01, seed=1))


def plain_items() -> nn.Module:
    """``nn.Embedding``: the plain PyTorch model ``PSModel.state_dict`` loads into."""
    return nn.Embedding(1_000, 8)


class Recommender(nn.Module):
    """The README's model, smaller, its table made by ``items`` (``ps_items`` or ``plain_items``)."""

    def __init__(self, items=ps_items):
        super().__init__()
        self.items = items()
        self.head = nn.Linear(8, 1)

    def forward(self, ids):
        return self.head(self.items(ids).mean(dim=1)).squeeze(1)


class Bags(nn.Module):
    """Multi-hot features: two features share one table, a third pools by mean."""

    def __init__(self):
        super().__init__()
        self.sparse = PSEmbeddingBagCollection([
            EmbeddingBagConfig(num_embeddings=200, embedding_dim=4, name="items", feature_names=["clicked", "viewed"],
                               optimizer=adagrad(lr=0.05), init=uniform(-0.05, 0.05, seed=2)),
            EmbeddingBagConfig(num_embeddings=200, embedding_dim=4, name="tags", feature_names=["tags"],
                               pooling=PoolingType.MEAN, init=uniform(-0.05, 0.05, seed=3))])
        self.head = nn.Linear(12, 1)

    def forward(self, features):
        return self.head(self.sparse(features).values()).squeeze(1)


def recommender_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 1_000, (256, 5), generator=g), torch.rand(256, generator=g).round()


def bags_batch():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 4, (3 * 64,), generator=g)          # keys x batch; empty bags too
    values = torch.randint(0, 200, (int(lengths.sum()),), generator=g)
    features = KeyedJaggedTensor(["clicked", "viewed", "tags"], values, lengths=lengths)
    return features, torch.rand(64, generator=g).round()


MODELS = {"recommender": (Recommender, recommender_batch), "bags": (Bags, bags_batch)}


LOOPS = {"plain": {}, "overlap": {"overlap": True}}      # lookahead 2 reads rows a push in flight races
F32 = np.dtype(np.float32)
# 1 % of the tables' learning rate (adagrad lr 0.1; sgd 0.1 for the dense parameters): on an
# H100, 38 of the recommender's 5,824 row values ended up to 2.6e-4 from the CPU run's (its
# losses agreed to 1e-4); a lost or doubled Adagrad step of these 12 moves a row's value by
# about lr / sqrt(12) = 0.029 where its gradients are of one size
TABLE_ATOL = 1e-3


def train(make_module, batch, client, device: torch.device, steps: int = 12, **options):
    """The README's loop on ``device``: the module and the batch there, the tables on the
    servers (SGD for the dense parameters: every step moves by the gradient itself).
    ``options``: PSModel's (``LOOPS``)."""
    client.create_job()
    client.join(heartbeat=False)
    torch.manual_seed(0)
    module = make_module().to(device)
    ps = PSModel(module, client, optimizer=sgd(0.1), **options)
    ps.create_tables()
    x, y = batch()
    x, y = x.to(device), y.to(device)
    losses = []
    for _ in range(steps):
        ps.pull()
        loss = F.binary_cross_entropy_with_logits(ps(x), y)
        loss.backward()
        ps.push()
        losses.append(float(loss.detach()))
    ps.settle()
    return module, ps, losses


@pytest.mark.parametrize("loop", sorted(LOOPS))
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_a_cpu_run_and_a_cuda_run_of_one_seed_end_with_the_same_parameters(make_cluster, client_factory, kind,
                                                                           loop):
    """PSModel (PSEmbedding, and PSEmbeddingBagCollection for "bags") trains a CUDA module:
    the batches, the rows it pulls and its parameters stay on the GPU, the losses fall, and
    the servers end with the values a CPU run of the same seed gives (float tolerance: the
    GPU sums in another order, and Adagrad's step g / sqrt(sum g^2 + eps) magnifies that
    rounding where a component's gradient is near zero; ``TABLE_ATOL``). The rows and dense
    values went through pinned staging buffers, the gradients came back through pinned
    buffers (``overlap``: sent while the next step computes), and none was overwritten
    before it was read."""
    make_module, batch = MODELS[kind]
    cluster = make_cluster(2)
    cpu_client, gpu_client = (client_factory(cluster.address, job=f"{kind}-{loop}-{d}") for d in ("cpu", "cuda"))
    _, _, cpu_losses = train(make_module, batch, cpu_client, CPU, **LOOPS[loop])
    module, ps, gpu_losses = train(make_module, batch, gpu_client, GPU, **LOOPS[loop])
    assert all(p.device == GPU for p in module.parameters())
    staged = ps.copies.pool.slots[F32]
    assert staged and all(s.buffer.is_pinned() for s in staged), "the rows went through the staging pool"
    assert gpu_losses[-1] < gpu_losses[0], gpu_losses
    np.testing.assert_allclose(gpu_losses, cpu_losses, rtol=1e-4, atol=1e-6)
    on_cpu, on_gpu = cpu_client.state_dict(), gpu_client.state_dict()
    assert sorted(on_cpu) == sorted(on_gpu) and len(on_gpu) >= 3
    for name in on_cpu:
        np.testing.assert_allclose(on_gpu[name], on_cpu[name], rtol=1e-4, atol=TABLE_ATOL,
                                   err_msg=f"{kind}: table {name} differs between the CPU and CUDA runs")


def test_the_state_dict_of_a_cuda_model_loads_into_plain_pytorch(make_cluster, client_factory):
    cluster = make_cluster(2)
    client = client_factory(cluster.address, job="export")
    module, ps, _ = train(Recommender, recommender_batch, client, GPU, steps=3)
    state = ps.state_dict()
    assert state["items.weight"].shape == (1_000, 8)
    plain = Recommender(plain_items).to(GPU)
    plain.load_state_dict(state)
    ids = recommender_batch()[0][:16].to(GPU)
    module.eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(ids), ps(ids), rtol=1e-5, atol=1e-6)


@pytest.mark.slow          # a process (shardps worker)
@pytest.mark.parametrize("model, device, extra", [
    ("digits-cnn", "cuda", ["--steps", "40"]),
    ("ctr", "auto", ["--ctr-rows", "10000", "--train-samples", "16384", "--batch-size", "512"]),
])
def test_shardps_worker_trains_on_the_gpu(make_cluster, tmp_path, model, device, extra):
    """The real worker loop (lookahead, prefetch, evaluation) with its model and batches on
    the GPU; ``auto`` takes cuda:{LOCAL_RANK mod the GPUs it sees}."""
    cluster = make_cluster(2)
    local_rank = torch.cuda.device_count()                  # mod count: cuda:0
    result_file = tmp_path / "result.json"
    out = subprocess.run(SHARDPS + ["worker", "--manager", cluster.address, "--name", "g0", "--job", f"gpu-{model}",
                                    "--model", model, "--device", device, "--result-file", str(result_file)] + extra,
                         capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**os.environ, "LOCAL_RANK": str(local_rank)})
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    result = json.loads(result_file.read_text())
    assert result["device"] == "cuda:0", result["device"]
    assert "(device cuda:0 (" in out.stderr, "the joined line names the GPU"
    final = [line for line in out.stdout.splitlines() if line.startswith("shardps worker rank=")]
    assert final and final[-1].endswith(" device=cuda:0"), out.stdout
    losses = result["losses"]
    quarter = max(1, len(losses) // 4)
    assert sum(losses[-quarter:]) < sum(losses[:quarter]), "the loss falls"
    assert all(0.0 <= v <= 1.0 for v in result["metrics"].values())


# ---------------------------------------------------------------- the copies of a GPU step
def test_values_go_to_the_gpu_and_gradients_come_back_unchanged():
    copies = DeviceCopies()
    rows = np.random.default_rng(0).standard_normal((37, 8)).astype(np.float32)
    ids = np.array([5, 0, 5, 2], dtype=np.int64)
    on_gpu = [copies.to_device(a, GPU) for a in (rows, ids, np.zeros((0, 8), np.float32))]
    assert [t.device for t in on_gpu] == [GPU] * 3 and on_gpu[1].dtype == torch.int64
    back = copies.to_host_all([on_gpu[0], on_gpu[0] * 2, on_gpu[2]])
    np.testing.assert_array_equal(back[0], rows)
    np.testing.assert_array_equal(back[1], rows * 2)
    assert back[2].shape == (0, 8)
    np.testing.assert_array_equal(copies.to_host_all([on_gpu[1]])[0], ids)


def test_values_of_one_dtype_travel_in_one_copy():
    """A step's dense values: arrays of one dtype share one staging buffer and one copy,
    each tensor a view of it with its own shape; another dtype has its own."""
    copies = DeviceCopies()
    arrays = [np.full((3, 4), 1.0, np.float32), np.arange(5, dtype=np.float32), np.arange(3),
              np.zeros(0, np.float32), np.full(7, 2.0, np.float32)]
    out = copies.to_device_all(arrays, GPU)
    for a, t in zip(arrays, out):
        assert t.device == GPU and tuple(t.shape) == a.shape
        np.testing.assert_array_equal(t.cpu().numpy(), a)
    assert [len(copies.pool.slots[np.dtype(d)]) for d in (np.float32, np.int64)] == [1, 1]
    assert out[0].untyped_storage().data_ptr() == out[4].untyped_storage().data_ptr(), "one copy"


def test_an_announced_lookup_does_not_wait_for_the_gpu(make_cluster, client_factory):
    """In the plain loop the lookup of an announced batch matches it without reading the
    ids back (which waits for the GPU): under torch's sync check set to raise, the forward's
    lookup runs, and reads the rows a pull gives."""
    client = client_factory(make_cluster(1).address, job="no-sync")
    module, ps, _ = train(Recommender, recommender_batch, client, GPU, steps=2)
    x = recommender_batch()[0].to(GPU)
    emb = module.items
    emb.request_prefetch(x)
    ps._pull_now()                                   # the rows, fetched before the forward
    torch.cuda.synchronize(GPU)
    torch.cuda.set_sync_debug_mode("error")
    try:
        rows, inverse = emb._lookup(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = client.pull_rows(emb.table, np.unique(x.cpu().numpy()))
    np.testing.assert_array_equal(rows.detach().cpu().numpy(), want)
    assert inverse.shape == x.shape


def test_a_gpu_batch_written_after_it_was_announced_is_read_as_written(make_cluster, client_factory):
    from tests.test_lookups import lookup_after_a_write
    lookup_after_a_write(make_cluster(1), client_factory, GPU, "bumps-gpu")


def test_staging_and_gradient_buffers_are_pinned():
    copies = DeviceCopies()
    copies.to_device(np.ones((4, 4), np.float32), GPU)
    copies.to_device(np.arange(6), GPU)
    assert all(s.buffer.is_pinned() for slots in copies.pool.slots.values() for s in slots)
    assert sorted(str(d) for d in copies.pool.slots) == ["float32", "int64"]
    grad = copies.to_host_all([torch.ones(3, 4, device=GPU)])[0]
    assert torch.from_numpy(grad).is_pinned(), "the gradient came back into pinned memory"


def _busy_copy_stream(copies: DeviceCopies) -> None:
    """Hold the copy stream for a while (~0.1 s): a copy queued now is in flight for that long."""
    with torch.cuda.stream(copies.copy_stream(GPU)):
        torch.cuda._sleep(200_000_000)


@pytest.mark.parametrize("max_buffers, buffers", [(4, 2), (1, 1)])
def test_a_staging_buffer_is_not_rewritten_while_its_copy_is_in_flight(max_buffers, buffers):
    """Two copies back to back while the copy stream is held: the second takes another
    buffer, or (a pool of one) waits for the first copy; both land right, and the compute
    stream reads them without the host waiting."""
    copies = DeviceCopies(StagingPool(max_buffers=max_buffers))
    copies.to_device(np.zeros(1_000, np.float32), GPU)       # one buffer, idle: made before the stream is held
    torch.cuda.synchronize(GPU)
    _busy_copy_stream(copies)
    first = copies.to_device(np.full(1_000, 1.0, np.float32), GPU)
    second = copies.to_device(np.full(1_000, 2.0, np.float32), GPU)
    assert len(copies.pool.slots[F32]) == buffers
    assert float(first.sum()) == 1_000.0 and float(second.sum()) == 2_000.0


def test_the_gradients_are_read_after_the_compute_stream_wrote_them():
    copies = DeviceCopies()
    grad = torch.ones(256, 256, device=GPU)
    torch.cuda._sleep(200_000_000)                   # the compute stream is busy ...
    grad.mul_(3.0)                                   # ... then writes the gradient
    (on_host,) = copies.to_host_all([grad])
    assert (on_host == 3.0).all()


def test_a_value_copied_while_the_gpu_computes_reaches_the_compute_stream_intact():
    copies = DeviceCopies()
    _busy_copy_stream(copies)
    values = np.arange(4_096, dtype=np.float32)
    on_gpu = copies.to_device(values, GPU)
    values[:] = -1.0                                 # the caller may reuse its array at once
    np.testing.assert_array_equal(on_gpu.cpu().numpy(), np.arange(4_096, dtype=np.float32))
