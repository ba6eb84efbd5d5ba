"""The plain loop moves a step's rows in one pull per server: ``LookupPlanner`` learns where
each embedding's ids come from, ``PSModel`` fetches them with the dense values before the
forward, and a wrong prediction only costs a call (real servers on loopback)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from shardps.tables import normal, sgd
from shardps.tools.bench.many_tables import data_calls
from shardps.worker.lookups import LookupPlanner, Recipe
from shardps.worker.torch_ps import PSEmbedding, PSModel
from tests.dense import server_value

TABLES, ROWS, DIM, BATCH = 4, 1000, 4, 32


@pytest.mark.parametrize("view", [lambda x: x, lambda x: x[:, 2], lambda x: x.t()[1],
                                  lambda x: x[..., 1:3], lambda x: x[3:9, 0]])
def test_a_view_of_an_input_is_cut_from_the_next_inputs(view):
    old, new = torch.arange(40).reshape(10, 4), torch.arange(100, 140).reshape(10, 4)
    recipe = Recipe.of(view(old), [torch.zeros(3), old])
    assert recipe is not None and recipe.input == 1
    assert torch.equal(recipe.cut([torch.zeros(3), new]), view(new))


def test_computed_ids_and_other_layouts_are_not_predicted():
    x = torch.arange(40).reshape(10, 4)
    assert Recipe.of(x[:, 1] + 0, [x]) is None                       # not a view
    assert Recipe.of(x[:, 1].long().clone(), [x]) is None
    recipe = Recipe.of(x[:, 1], [x])
    assert recipe is not None
    assert recipe.cut([torch.arange(50).reshape(10, 5)]) is None       # another shape
    assert recipe.cut([torch.arange(40).reshape(4, 10).t()]) is None   # another layout
    assert recipe.cut([torch.arange(40, dtype=torch.int32).reshape(10, 4)]) is None
    assert recipe.cut([]) is None


def test_the_planner_predicts_tables_looked_up_once_from_the_last_forward():
    p = LookupPlanner()
    x = torch.arange(40).reshape(10, 4)
    p.begin((x,), {})
    assert p.predict() == []                                          # nothing learned yet
    p.observe("a", x[:, 0])
    p.observe("b", x[:, 1])
    p.observe("b", x[:, 2])                                           # twice: pulled per lookup
    p.observe("c", x[:, 3] * 2)                                       # computed
    p.end()
    y = torch.arange(100, 140).reshape(10, 4)
    p.begin((), {"ids": y})
    assert [(t, ids.tolist()) for t, ids in p.predict()] == [("a", y[:, 0].tolist())]
    p.observe("x", y[:, 0])                                           # outside a forward: ignored after end
    p.end()
    assert set(p.recipes) == {"x"}


def _learned(columns: dict) -> LookupPlanner:
    """A planner that watched one forward look tables up in columns of its input
    (``columns``: table -> column)."""
    p = LookupPlanner()
    x = torch.arange(40).reshape(10, 4)
    p.begin((x,), {})
    for table, column in columns.items():
        p.observe(table, x[:, column])
    p.end()
    return p


def test_a_lookup_of_the_predicted_ids_keeps_its_recipe_and_another_view_is_learned_again():
    p = _learned({"a": 1, "b": 2})
    learned = dict(p.recipes)
    y = torch.arange(100, 140).reshape(10, 4)
    p.begin((y,), {})
    assert [t for t, _ in p.predict()] == ["a", "b"]
    p.observe("a", y[:, 1])                        # the predicted view: the same recipe
    p.observe("b", y[:, 3])                        # another column than predicted: learned from the ids
    p.end()
    assert p.recipes["a"] is learned["a"]
    z = torch.arange(200, 240).reshape(10, 4)
    p.begin((z,), {})
    assert [(t, ids.tolist()) for t, ids in p.predict()] == [("a", z[:, 1].tolist()), ("b", z[:, 3].tolist())]
    p.observe("a", z[:, 1].clone())                # equal ids, other memory: not a view of the input
    p.end()
    assert set(p.recipes) == set()


def test_lookups_taken_from_a_batch_keep_their_recipes_unless_looked_up_twice():
    """``end(kept)``: a lookup that took its announced ids from a batch (``lookup_batch``,
    without ``observe``) keeps the recipe that predicted it; one looked up on its own too is
    no longer predicted; one without a recipe is learned from its ids."""
    p = _learned({"a": 0, "b": 1})
    learned = dict(p.recipes)
    y = torch.arange(100, 140).reshape(10, 4)
    p.begin((y,), {})
    p.predict()
    p.observe("b", y[:, 1])                        # b also looked up on its own
    p.end([("a", y[:, 0]), ("b", y[:, 1]), ("c", y[:, 3])])
    assert p.recipes["a"] is learned["a"] and "b" not in p.recipes
    z = torch.arange(200, 240).reshape(10, 4)
    p.begin((z,), {})
    assert [(t, ids.tolist()) for t, ids in p.predict()] == [("a", z[:, 0].tolist()), ("c", z[:, 3].tolist())]
    p.end()


def test_a_forward_whose_lookups_all_took_their_predicted_ids_keeps_every_recipe():
    """The common step: every table predicted, each taken once from the batch; then a
    second input laid out otherwise cuts only the recipes of the input still laid out alike."""
    p = _learned({"a": 0, "b": 1, "c": 2})
    learned = dict(p.recipes)
    y = torch.arange(100, 140).reshape(10, 4)
    p.begin((y,), {})
    predicted = p.predict()
    assert [(t, ids.tolist()) for t, ids in predicted] == [(t, y[:, c].tolist())
                                                           for t, c in (("a", 0), ("b", 1), ("c", 2))]
    p.end(predicted)
    assert list(p.recipes) == ["a", "b", "c"] and all(p.recipes[t] is learned[t] for t in learned)
    p.begin((torch.arange(100, 140).reshape(4, 10).t(),), {})    # the same shape, strides of a transpose
    assert p.predict() == []
    p.end()


class _Wide(nn.Module):
    """One single-hot table per column of the input, and a dense head."""

    def __init__(self, computed: bool = False):
        super().__init__()
        self.tables = nn.ModuleList(PSEmbedding(ROWS, DIM, table=f"t{i}") for i in range(TABLES))
        self.head = nn.Linear(TABLES * DIM, 1)
        self.computed = computed

    def forward(self, x):
        cols = [x[:, i] + 0 if self.computed else x[:, i] for i in range(TABLES)]
        return self.head(torch.cat([t(c) for t, c in zip(self.tables, cols)], dim=1)).squeeze(1)


def _joined(cluster, client_factory, job: str, computed: bool = False, mode: str = "async", of=None):
    """A joined client of a new job, and a PSModel of ``of(computed)`` (``_Wide``) over it,
    tables created."""
    c = client_factory(cluster.address, job=job)
    c.create_job(mode)
    c.join(heartbeat=False)
    module = (of or _Wide)(computed)
    model = PSModel(module, c, optimizer=sgd(0.1))
    model.create_tables()
    return c, module, model


def _train(cluster, client_factory, job: str, computed: bool, steps: int = 5, mode: str = "async"):
    torch.manual_seed(0)
    c, _, model = _joined(cluster, client_factory, job, computed, mode)
    rng = np.random.default_rng(1)
    calls = []
    for _ in range(steps):
        x = torch.from_numpy(rng.integers(0, ROWS, (BATCH, TABLES)))
        before = data_calls(c)
        model.pull()
        loss = model(x).square().mean()
        loss.backward()
        model.push()
        calls.append(data_calls(c) - before)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return calls, state


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_the_plain_loop_is_one_call_per_server_and_reads_what_per_table_pulls_read(make_cluster, client_factory,
                                                                                    mode):
    cluster = make_cluster(2)
    calls, state = _train(cluster, client_factory, "planned", computed=False, mode=mode)
    per_table, reference = _train(cluster, client_factory, "per-table", computed=True, mode=mode)
    # the first step learns; then a step is one exchange per server: the last step's push
    # (held by push()) and the dense values and every table's rows
    assert calls[0] >= TABLES and calls[1:] == [2] * (len(calls) - 1), calls
    assert min(per_table) >= TABLES + 2, per_table           # a pull per table, pull and push per server
    assert state.keys() == reference.keys()
    for k in state:
        assert torch.equal(state[k], reference[k]), k


def test_leave_sends_the_push_the_model_holds(make_cluster, client_factory):
    c, module, model = _joined(make_cluster(2), client_factory, "held")
    x = torch.arange(BATCH * TABLES).reshape(BATCH, TABLES) % ROWS
    for _ in range(3):
        model.pull()
        model(x).sum().backward()
        bias, grad = module.head.bias.detach().clone(), module.head.bias.grad.clone()
        model.push()
    assert model._flow.held is not None                            # waiting for the next pull
    c.leave()
    assert model._flow.held is None
    np.testing.assert_allclose(server_value(c, model, "head.bias"), (bias - 0.1 * grad).numpy(), rtol=1e-6)


def test_a_pull_no_forward_took_is_completed_by_push(make_cluster, client_factory):
    c, module, model = _joined(make_cluster(1), client_factory, "no-forward")
    x = torch.zeros((BATCH, TABLES), dtype=torch.int64)
    for _ in range(2):
        model.pull()
        model(x).sum().backward()
        model.push()
    with torch.no_grad():
        module.head.bias.fill_(123.0)                 # the local copy drifts
    model.pull()                                      # deferred: the lookups are learned
    model.push()                                      # no forward: the pull is completed here
    assert float(module.head.bias.detach()) != 123.0
    np.testing.assert_array_equal(module.head.bias.detach().numpy(), server_value(c, model, "head.bias"))


class _Bumps(nn.Module):
    """One table looked up with the forward's input, which ``bump`` first adds one to in
    place: after ``PSModel`` announced (and fetched) the rows of the ids it held."""

    def __init__(self):
        super().__init__()
        self.t0 = PSEmbedding(ROWS, DIM, table="t0", init=normal(0.0, 1.0, seed=3))

    def forward(self, x, bump: bool = False):
        if bump:
            x.add_(1)
        return self.t0(x)


def lookup_after_a_write(cluster, client_factory, device: torch.device, job: str) -> None:
    """A batch written in place after it was announced is read as written: its rows are
    those of the new ids, not the announced ones (on a GPU, where a lookup matches the
    announced tensor without reading it back, the write is what tells them apart)."""
    c = client_factory(cluster.address, job=job)
    c.create_job()
    c.join(heartbeat=False)
    module = _Bumps().to(device)
    model = PSModel(module, c, optimizer=sgd(0.1))
    model.create_tables()
    x = (torch.arange(BATCH) * 7 % ROWS).to(device)
    with torch.no_grad():
        for bump in (False, False, True):           # the first forward learns the lookup
            model.pull()
            out = model(x, bump=bump).cpu().numpy()
            np.testing.assert_array_equal(out, c.pull_rows("t0", x.cpu().numpy()), err_msg=f"bump={bump}")
    assert int(x[0]) == 1


def test_a_batch_written_after_it_was_announced_is_read_as_written(make_cluster, client_factory):
    lookup_after_a_write(make_cluster(1), client_factory, torch.device("cpu"), "bumps")


def test_same_ids_is_array_equal_for_ids():
    from shardps.worker.embeddings import same_ids
    a = np.arange(256, dtype=np.int64)
    strided = np.arange(512, dtype=np.int64).reshape(256, 2)[:, 0]     # a column: not contiguous
    for b in (a, a.copy(), a.astype(np.int32), a[:-1], strided, strided // 2, a[::-1].copy()):
        assert same_ids(a, b) == np.array_equal(a, b)


class _Mixed(nn.Module):
    """Tables of two dims (``c`` is wider), ``d`` looked up twice per forward: ``a`` and ``b``
    are looked up in one call (``lookup_batch``), ``c`` and ``d`` on their own."""

    def __init__(self, computed: bool = False):
        super().__init__()
        self.a, self.b, self.d = (PSEmbedding(ROWS, DIM, table=n, init=normal(0.0, 1.0, seed=k))
                                  for k, n in enumerate("abd"))
        self.c = PSEmbedding(ROWS, DIM + 2, table="c", init=normal(0.0, 1.0, seed=7))
        self.head = nn.Linear(4 * DIM + DIM + 2, 1)
        self.computed = computed

    def forward(self, x):
        cols = [x[:, i] + 0 if self.computed else x[:, i] for i in range(4)]
        looked = [self.a(cols[0]), self.b(cols[1]), self.c(cols[2]), self.d(cols[3]), self.d(cols[0])]
        return self.head(torch.cat(looked, dim=1)).squeeze(1)


def _accumulated(cluster, client_factory, job: str, computed: bool) -> dict:
    """Four steps of two forwards and backwards each (gradients accumulated) per push."""
    torch.manual_seed(0)
    _, _, model = _joined(cluster, client_factory, job, computed, of=_Mixed)
    rng = np.random.default_rng(2)
    for _ in range(4):
        model.pull()
        for _ in range(2):
            model(torch.from_numpy(rng.integers(0, 50, (BATCH, 4)))).square().mean().backward()
        model.push()
    model.flush()
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_batched_lookups_train_as_lookups_of_their_own(make_cluster, client_factory, monkeypatch):
    """The tables of one dim looked up in one call train exactly as each table's lookup of
    its own would (the same bits), with gradients accumulated over two forwards (the second
    looks up on its own), a table of another dim and a table looked up twice beside them."""
    from shardps.worker import lookup_batch

    taken: list = []
    take = lookup_batch.LookupBatch.take

    def watched(self, emb, ids):
        out = take(self, emb, ids)
        if out is not None:
            taken.append(emb.table)
        return out
    monkeypatch.setattr(lookup_batch.LookupBatch, "take", watched)
    cluster = make_cluster(2)
    batched = _accumulated(cluster, client_factory, "batched", computed=False)
    assert taken and set(taken) == {"a", "b"}, taken          # learned in the first step, then batched
    reference = _accumulated(cluster, client_factory, "own", computed=True)
    assert set(taken) == {"a", "b"} and batched.keys() == reference.keys()
    for k in batched:
        assert torch.equal(batched[k], reference[k]), k


class _HalfFrozen(nn.Module):
    """Two tables, the first looked up without gradients: the batch's first lookup is in
    no-grad mode, and the second table's must not take its rows from it."""

    def __init__(self, computed: bool = False):
        super().__init__()
        self.a, self.b = (PSEmbedding(ROWS, DIM, table=n, init=normal(0.0, 1.0, seed=k)) for k, n in enumerate("ab"))
        self.head = nn.Linear(2 * DIM, 1)
        self.computed = computed

    def forward(self, x):
        with torch.no_grad():
            frozen = self.a(x[:, 0] + 0 if self.computed else x[:, 0])
        return self.head(torch.cat([frozen, self.b(x[:, 1] + 0 if self.computed else x[:, 1])], dim=1)).squeeze(1)


def test_a_batch_looked_up_without_gradients_leaves_the_others_their_own(make_cluster, client_factory):
    cluster = make_cluster(1)
    states = []
    for job, computed in (("half-batched", False), ("half-own", True)):
        torch.manual_seed(0)
        _, _, model = _joined(cluster, client_factory, job, computed, of=_HalfFrozen)
        rng = np.random.default_rng(3)
        for _ in range(4):
            model.pull()
            model(torch.from_numpy(rng.integers(0, 50, (BATCH, 2)))).square().mean().backward()
            model.push()
        model.flush()
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]), k
