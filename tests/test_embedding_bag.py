"""PSEmbeddingBag and PSEmbeddingBagCollection against torch's own nn.EmbeddingBag on the
same weights (real servers on loopback), and the calls a DLRM-style model makes per step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from shardps.errors import InvalidArgument
from shardps.tables import sgd, uniform
from shardps.worker.embedding_bag import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from shardps.worker.torch_ps import PSEmbeddingBag, PSEmbeddingBagCollection, PSModel

N, DIM = 50, 4
DATA_METHODS = ("Push", "Pull", "Exchange", "Step")


def data_calls(cluster) -> dict[str, dict[str, float]]:
    """Per server: data calls it handled, by method (every transport, every status code)."""
    out = {}
    for name, proc in cluster.servers.items():
        counts = dict.fromkeys(DATA_METHODS, 0.0)
        for family in proc.metrics.registry.collect():
            for sample in family.samples:
                if sample.name == "grpc_server_handled_total" and sample.labels["grpc_method"] in counts:
                    counts[sample.labels["grpc_method"]] += sample.value
        out[name] = counts
    return out


def _rows_pushed(client) -> float:
    return client.metrics.registry.get_sample_value("shardps_client_rows_total", {"direction": "pushed"})


def bound(client, module: nn.Module, **kw) -> PSModel:
    client.create_job()
    model = PSModel(module, client, optimizer=sgd(1.0), **kw)     # lr 1: the update is minus the gradient
    model.create_tables()
    return model


class Holder(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner


CASES = {   # mode, input, offsets, per_sample_weights, include_last_offset, padding_idx
    "sum": ("sum", [3, 7, 3, 9, 11, 7, 0], [0, 2, 2, 5], False, False, None),
    "mean-with-empty-bag": ("mean", [3, 7, 3, 9, 11, 7, 0], [0, 2, 2, 5], False, False, None),
    "weighted-sum": ("sum", [3, 7, 3, 9, 11, 7, 0], [0, 2, 2, 5], True, False, None),
    "max": ("max", [3, 7, 3, 9, 11, 7, 0], [0, 3, 5], False, False, None),
    "mean-2d": ("mean", [[1, 2, 2], [5, 1, 40]], None, False, False, None),
    "last-offset-padding": ("mean", [3, 7, 3, 9, 11, 7, 0], [0, 2, 5, 7], False, True, 7),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bag_forward_and_gradient_equal_nn_embedding_bag(cluster, client_factory, case):
    mode, ids, offsets, weighted, last, padding = CASES[case]
    client = client_factory(cluster.address, job=f"bag-{case}")
    bag = PSEmbeddingBag(N, DIM, mode=mode, include_last_offset=last, padding_idx=padding,
                         init=uniform(-1, 1, seed=3))
    model = bound(client, Holder(bag))
    before = client.pull_rows("inner", np.arange(N))
    ref = nn.EmbeddingBag(N, DIM, mode=mode, include_last_offset=last, padding_idx=padding)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(before))
    x = torch.tensor(ids)
    off = None if offsets is None else torch.tensor(offsets)
    g = torch.Generator().manual_seed(1)
    psw = torch.rand(x.shape, generator=g) if weighted else None
    pushed = _rows_pushed(client)
    out = bag(x, off, psw)
    expected = ref(x, off, psw)
    np.testing.assert_allclose(out.detach().numpy(), expected.detach().numpy(), rtol=0, atol=1e-6)
    upstream = torch.randn(expected.shape, generator=g)
    (out * upstream).sum().backward()
    (expected * upstream).sum().backward()
    model.push()
    after = client.pull_rows("inner", np.arange(N))
    np.testing.assert_allclose(after, before - ref.weight.grad.numpy(), rtol=0, atol=1e-6)
    # the gradient travelled as one row per distinct id, not the table
    assert _rows_pushed(client) - pushed == len(np.unique(ids))


def test_bag_rejects_what_nn_embedding_bag_rejects(cluster, client_factory):
    client = client_factory(cluster.address, job="bag-bad")
    bag = PSEmbeddingBag(N, DIM, mode="mean")
    bound(client, Holder(bag))
    with pytest.raises((ValueError, RuntimeError)):     # per_sample_weights need mode="sum", as in torch
        bag(torch.tensor([1, 2]), torch.tensor([0]), torch.ones(2))
    with pytest.raises(InvalidArgument, match="mode"):
        PSEmbeddingBag(N, DIM, mode="median")
    with pytest.raises(InvalidArgument, match="nn.Module attribute"):
        PSEmbeddingBagCollection([EmbeddingBagConfig(N, DIM, "train", ["a"])])
    with pytest.raises(InvalidArgument, match="in tables"):
        PSEmbeddingBagCollection([EmbeddingBagConfig(N, DIM, "x", ["a"]), EmbeddingBagConfig(N, DIM, "y", ["a"])])


def kjt_of(batch: int, keys: list[str], rng: np.random.Generator, weighted: bool = False) -> KeyedJaggedTensor:
    lengths = rng.integers(0, 4, size=len(keys) * batch)       # empty bags included
    values = rng.integers(0, N, size=int(lengths.sum()))
    weights = torch.from_numpy(rng.random(values.shape[0]).astype(np.float32)) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys, torch.from_numpy(values), torch.from_numpy(lengths), weights)


def test_keyed_jagged_tensor_has_torchrec_layout():
    kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.tensor([1, 2, 3, 4, 5]),
                                              torch.tensor([2, 0, 1, 2]))
    assert kjt.stride() == 2 and kjt.length_per_key() == [2, 3]
    assert kjt["b"].values().tolist() == [3, 4, 5] and kjt["b"].offsets().tolist() == [0, 1, 3]
    same = KeyedJaggedTensor.from_offsets_sync(["a", "b"], kjt.values(), kjt.offsets())
    assert same.lengths().tolist() == [2, 0, 1, 2]
    with pytest.raises(InvalidArgument, match="cover 5 values"):
        KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.arange(4), torch.tensor([2, 0, 1, 2]))
    with pytest.raises(InvalidArgument, match="lengths for 2 keys"):
        KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.arange(3), torch.tensor([2, 0, 1]))


@pytest.mark.parametrize("weighted", [False, True])
def test_collection_equals_torch_embedding_bags_on_the_same_weights(cluster, client_factory, weighted):
    """Two features share a table, one owns one; pooled values, gradients (as server updates)
    and the exported state dict match plain torch."""
    client = client_factory(cluster.address, job=f"ebc-{int(weighted)}")
    pooling = PoolingType.SUM if weighted else PoolingType.MEAN
    tables = [EmbeddingBagConfig(N, DIM, "shared", ["a", "b"], init=uniform(-1, 1, seed=1)),
              EmbeddingBagConfig(N, 2 * DIM, "own", ["c"], pooling=pooling, init=uniform(-1, 1, seed=2))]
    ebc = PSEmbeddingBagCollection(tables, is_weighted=weighted)
    model = bound(client, Holder(ebc))
    kjt = kjt_of(5, ["c", "a", "b"], np.random.default_rng(0), weighted)
    ref = {t.name: nn.EmbeddingBag(N, t.embedding_dim, mode=PoolingType(t.pooling).value) for t in tables}
    before = {}
    for t in tables:
        before[t.name] = client.pull_rows(f"inner.embedding_bags.{t.name}", np.arange(N))
        with torch.no_grad():
            ref[t.name].weight.copy_(torch.from_numpy(before[t.name]))
    model.pull(kjt)
    out = ebc(kjt)
    assert out.keys() == ["a", "b", "c"] and out.values().shape == (5, 4 * DIM)
    expected = []
    for t in tables:
        for f in t.feature_names:
            jt = kjt[f]
            expected.append(ref[t.name](jt.values(), jt.offsets()[:-1], jt.weights_or_none()))
    expected_t = torch.cat(expected, dim=1)
    np.testing.assert_allclose(out.values().detach().numpy(), expected_t.detach().numpy(), rtol=0, atol=1e-6)
    upstream = torch.randn(expected_t.shape, generator=torch.Generator().manual_seed(2))
    (out.values() * upstream).sum().backward()
    (expected_t * upstream).sum().backward()
    model.push()
    for t in tables:
        after = client.pull_rows(f"inner.embedding_bags.{t.name}", np.arange(N))
        np.testing.assert_allclose(after, before[t.name] - ref[t.name].weight.grad.numpy(), rtol=0, atol=1e-6)
    plain = Holder(nn.Module())
    plain.inner.embedding_bags = nn.ModuleDict({t.name: nn.EmbeddingBag(N, t.embedding_dim) for t in tables})
    plain.load_state_dict(model.state_dict())         # TorchRec's key layout, plain torch modules


class TinyDLRM(nn.Module):
    """Dense MLP + 8 multi-hot features over 6 tables (two shared by two features each)."""

    FEATURES = [f"f{i}" for i in range(8)]

    def __init__(self):
        super().__init__()
        names = [["f0", "f1"], ["f2", "f3"], ["f4"], ["f5"], ["f6"], ["f7"]]
        self.sparse = PSEmbeddingBagCollection(
            [EmbeddingBagConfig(N, DIM, f"t{i}", fs, num_blocks=4) for i, fs in enumerate(names)])
        self.bottom = nn.Linear(3, DIM)
        self.top = nn.Linear(9 * DIM, 1)

    def forward(self, dense, sparse):
        return self.top(torch.cat([self.bottom(dense), self.sparse(sparse).values()], dim=1)).squeeze(1)


@pytest.mark.parametrize("mode, overlap", [("async", False), ("sync", True)])
def test_a_dlrm_style_model_makes_one_pull_and_one_push_per_server_per_step(cluster, client_factory,
                                                                           mode, overlap):
    client = client_factory(cluster.address, job=f"dlrm-{mode}")
    client.create_job(mode)
    client.join(heartbeat=False)
    torch.manual_seed(0)
    model = PSModel(TinyDLRM(), client, optimizer=sgd(0.05), overlap=overlap)
    model.create_tables()
    rng = np.random.default_rng(0)
    batches = [(torch.randn(16, 3), kjt_of(16, TinyDLRM.FEATURES, rng), torch.rand(16).round())
               for _ in range(6)]
    before = data_calls(cluster)
    for i, (dense, sparse, y) in enumerate(batches):
        model.pull(sparse)
        loss = nn.functional.binary_cross_entropy_with_logits(model(dense, sparse), y)
        loss.backward()
        if i + 1 < len(batches):
            model.prefetch(batches[i + 1][1])      # with overlap: rides on this push's exchange
        model.push()
    model.flush()
    after = data_calls(cluster)
    steps = len(batches)
    for server in after:
        calls = {m: after[server][m] - before[server][m] for m in DATA_METHODS}
        # measured: every server holds part of the model, and gets exactly this many calls,
        # all Step frames (a SYNC step's push reaches every server, so it reports the step too)
        if overlap:      # the first pull, then one call per step: push + next step's pull
            assert calls == {"Pull": 0, "Push": 0, "Exchange": 0, "Step": steps + 1}, (server, calls)
        else:            # 8 features, 6 tables, 2 dense layers: one pull_many, one push_many
            assert calls == {"Pull": 0, "Push": 0, "Exchange": 0, "Step": 2 * steps}, (server, calls)


def test_a_batch_of_empty_bags_pools_to_zeros_and_pushes_no_rows(cluster, client_factory):
    client = client_factory(cluster.address, job="ebc-empty")
    ebc = PSEmbeddingBagCollection([EmbeddingBagConfig(N, DIM, "t", ["a"]), EmbeddingBagConfig(N, DIM, "u", ["b"])])
    model = bound(client, Holder(ebc))
    kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.tensor([4, 4]), torch.tensor([0, 0, 2, 0]))
    model.pull(kjt)
    out = ebc(kjt)
    assert out["a"].abs().sum() == 0 and out["b"][1].abs().sum() == 0
    out.values().sum().backward()
    pushed = _rows_pushed(client)
    model.push()
    assert _rows_pushed(client) - pushed == 1       # id 4 of table u only
