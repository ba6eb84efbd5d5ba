"""Warm starts: values written into a job's tables (``PSClient.load_state_dict``, a push of
kind ASSIGN) and ``PSModel`` as an ``nn.Module`` whose ``load_state_dict`` writes the servers'
tables. In-process clusters on loopback."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from shardps.errors import InvalidArgument
from shardps.tables import LifecyclePolicy, adagrad, normal, sgd
from shardps.worker.torch_ps import PSEmbedding, PSModel
from tests.dense import replicas_agree, server_value


def test_load_state_dict_overwrites_values_and_restarts_their_optimizer_state(make_cluster, client_factory):
    cluster = make_cluster(3, replication=2)
    c = client_factory(cluster.address, job="warm")
    c.create_job()
    c.create_dense("w", (6, 4), optimizer=adagrad(0.5))
    c.create_sparse("e", 4, 1000, optimizer=adagrad(0.5), init=normal(0.0, 0.1, seed=1), num_blocks=4)
    for _ in range(3):                     # optimizer state builds up
        c.push_many([("w", np.ones((6, 4), np.float32)),
                     ("e", np.arange(0, 40), np.ones((40, 4), np.float32))])
    untouched = c.pull_rows("e", [2, 900])
    w = np.arange(24, dtype=np.float32).reshape(6, 4)
    ids = np.array([7, 1, 500, 999])       # not sorted; 1 and 7 have state, 500 and 999 are new
    rows = np.linspace(-1, 1, 16, dtype=np.float32).reshape(4, 4)
    assert c.load_state_dict({"w": w, "e.ids": ids, "e.rows": rows}) == ["w", "e"]
    np.testing.assert_array_equal(c.pull_dense("w"), w)
    np.testing.assert_array_equal(c.pull_rows("e", ids), rows)
    np.testing.assert_array_equal(c.pull_rows("e", [2, 900]), untouched)
    # Adagrad's accumulator starts afresh: the first step after the write is a full step of lr
    c.push_many([("w", np.ones((6, 4), np.float32)), ("e", ids, np.ones((4, 4), np.float32))])
    np.testing.assert_allclose(c.pull_dense("w"), w - 0.5, rtol=0, atol=1e-6)
    np.testing.assert_allclose(c.pull_rows("e", ids), rows - 0.5, rtol=0, atol=1e-6)
    assert replicas_agree(cluster, "warm") == 5        # backups applied the same bytes
    exported = c.state_dict()
    np.testing.assert_array_equal(exported["w"], w - np.float32(0.5))


def test_a_bad_state_is_refused_naming_it_and_writes_nothing(make_cluster, client_factory):
    cluster = make_cluster(2)
    c = client_factory(cluster.address, job="warm-bad")
    c.create_job()
    c.create_dense("w", (3, 2), optimizer=sgd(0.1))
    c.create_sparse("e", 2, 100, optimizer=sgd(0.1))
    before = c.state_dict()
    good = {"w": np.ones((3, 2), np.float32)}
    cases = [
        ({**good, "nope": np.zeros(2, np.float32)}, "nope name no table"),
        ({**good, "e": np.zeros((100, 2), np.float32)}, "sparse: give e.ids and e.rows"),
        ({**good, "e.ids": np.array([1, 2])}, "without e.rows"),
        ({"w": np.ones((2, 3), np.float32)}, r"shape \(2, 3\); the table's shape is \(3, 2\)"),
        ({"w": np.ones((3, 2), np.float64)}, "float64"),
        ({**good, "e.ids": np.array([1, 1]), "e.rows": np.ones((2, 2), np.float32)}, "repeated ids"),
        ({**good, "e.ids": np.array([1, 2]), "e.rows": np.ones((2, 3), np.float32)}, r"\(2, 3\).*need \(2, 2\)"),
        ({**good, "e.ids": np.array([1, 200]), "e.rows": np.ones((2, 2), np.float32)}, "200"),
        # a dense table's .ids / .rows are no keys of it (they were once written as its values)
        ({"w.ids": np.zeros((3, 2), np.float32), "w.rows": np.zeros((3, 2), np.float32)},
         r"w\.ids, w\.rows name no table"),
    ]
    for state, message in cases:
        with pytest.raises(InvalidArgument, match=message):
            c.load_state_dict(state)
    after = c.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        np.testing.assert_array_equal(before[k], after[k], err_msg=k)


def test_load_state_dict_sorts_once_and_sends_the_dense_tables_in_one_push(make_cluster, client_factory,
                                                                           monkeypatch):
    from shardps.worker.client import export
    cluster = make_cluster(2)
    c = client_factory(cluster.address, job="warm-pushes")
    c.create_job()
    c.create_dense("a", (4, 2), optimizer=sgd(0.1))
    c.create_dense("b", (5,), optimizer=sgd(0.1))
    c.create_sparse("e", 2, 1000, optimizer=sgd(0.1))
    monkeypatch.setattr(export, "ASSIGN_ROWS", 4)
    pushes: list[list] = []
    push = c._data.push
    monkeypatch.setattr(c._data, "push", lambda pieces, *rest: pushes.append(pieces) or push(pieces, *rest))
    ids = np.array([900, 3, 77, 5, 41, 600, 2, 12, 999, 8])
    rows = np.arange(20, dtype=np.float32).reshape(10, 2)
    a, b = np.full((4, 2), 2.0, np.float32), np.arange(5, dtype=np.float32)
    assert c.load_state_dict({"a": a, "e.ids": ids, "e.rows": rows, "b": b}) == ["a", "e", "b"]
    assert [[p.table for p in push] for push in pushes] == [["a", "b"], ["e"], ["e"], ["e"]]
    sent = np.concatenate([push[0].ids for push in pushes[1:]])
    np.testing.assert_array_equal(sent, np.sort(ids))          # sorted once: each chunk ascending
    np.testing.assert_array_equal(c.pull_rows("e", ids), rows)
    np.testing.assert_array_equal(c.pull_dense("a"), a)
    np.testing.assert_array_equal(c.pull_dense("b"), b)


def test_a_table_with_a_lifecycle_policy_refuses_the_write(make_cluster, client_factory):
    cluster = make_cluster(2)
    c = client_factory(cluster.address, job="warm-life")
    c.create_job()
    c.create_sparse("e", 2, optimizer=sgd(0.1), lifecycle=LifecyclePolicy(admit_after=2))
    with pytest.raises(InvalidArgument, match="lifecycle policy.*shardps restore"):
        c.load_state_dict({"e.ids": np.array([3]), "e.rows": np.ones((1, 2), np.float32)})
    assert c.state_dict()["e.ids"].shape == (0,)


class Recommender(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = PSEmbedding(50, 4)
        self.head = nn.Linear(4, 1)
        self.norm = nn.BatchNorm1d(1)

    def forward(self, ids):
        return self.norm(self.head(self.emb(ids)))


def _train(ps_model, model, steps: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 50, (16,), generator=g)
        ps_model.pull()
        ps_model(ids).square().mean().backward()
        ps_model.push()


def test_psmodel_is_a_module_and_warm_starts_a_fresh_job_from_an_exported_state(make_cluster, client_factory):
    cluster = make_cluster(2)
    first = client_factory(cluster.address, job="warm-a")
    first.create_job()
    torch.manual_seed(0)
    model = Recommender()
    ps_model = PSModel(model, first, optimizer=adagrad(0.1))
    assert isinstance(ps_model, nn.Module) and dict(ps_model.named_children()) == {"module": model}
    ps_model.create_tables()
    _train(ps_model, model, 5)
    ps_model.eval()
    assert not model.training and not model.norm.training
    ps_model.train()
    assert model.norm.training
    exported = ps_model.state_dict()
    assert exported["emb.weight"].shape == (50, 4) and "norm.running_mean" in exported
    plain = nn.Sequential()                # what plain PyTorch loads it into
    plain.emb, plain.head, plain.norm = nn.Embedding(50, 4), nn.Linear(4, 1), nn.BatchNorm1d(1)
    plain.load_state_dict(exported)

    second = client_factory(cluster.address, job="warm-b")
    second.create_job()
    torch.manual_seed(1)                   # other initial values
    fresh = Recommender()
    warm = PSModel(fresh, second, optimizer=adagrad(0.1))
    warm.create_tables()
    result = warm.load_state_dict(exported)
    assert result.missing_keys == [] and result.unexpected_keys == []
    back = warm.state_dict()
    for key, value in exported.items():
        assert torch.equal(back[key], value), key
    _train(warm, fresh, 2)                 # trains on from there
    assert not torch.equal(warm.state_dict()["emb.weight"], exported["emb.weight"])


def test_psmodel_load_state_dict_strict_names_the_keys_and_writes_nothing(make_cluster, client_factory):
    cluster = make_cluster(2)
    c = client_factory(cluster.address, job="warm-strict")
    c.create_job()
    model = Recommender()
    ps_model = PSModel(model, c, optimizer=sgd(0.1))
    ps_model.create_tables()
    state = ps_model.state_dict()
    before = c.state_dict()
    changed = {k: v + 1 if v.is_floating_point() else v for k, v in state.items()}
    with pytest.raises(InvalidArgument, match=r"missing keys \['head.bias'\], unexpected keys \['extra'\]"):
        ps_model.load_state_dict({**{k: v for k, v in changed.items() if k != "head.bias"},
                                  "extra": torch.zeros(1)})
    with pytest.raises(InvalidArgument, match=r"'emb.weight' has shape \(49, 4\)"):
        ps_model.load_state_dict({**changed, "emb.weight": torch.zeros(49, 4)})
    after = c.state_dict()
    for k in before:
        np.testing.assert_array_equal(before[k], after[k], err_msg=k)
    result = ps_model.load_state_dict({k: v for k, v in changed.items() if k != "head.bias"}, strict=False)
    assert result.missing_keys == ["head.bias"]
    np.testing.assert_array_equal(server_value(c, ps_model, "head.weight"), changed["head.weight"].numpy().reshape(-1))
    np.testing.assert_array_equal(server_value(c, ps_model, "head.bias"), state["head.bias"].numpy())
