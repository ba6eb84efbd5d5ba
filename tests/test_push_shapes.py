"""A push whose shape or dtype does not match its table is refused, naming the table, the
expected and the given shape, and changes nothing; no bare ValueError / TypeError escapes the
public client, whatever its arguments (a hypothesis run over the public API)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardps.errors import InvalidArgument, ShardpsError
from shardps.worker import sgd

SHAPE = (1000, 16)


@pytest.fixture
def client(cluster, client_factory):
    c = client_factory(cluster.address, "shapes")
    c.create_job()
    c.create_dense("w", shape=SHAPE, optimizer=sgd(lr=1.0))
    c.create_sparse("emb", dim=4, optimizer=sgd(lr=1.0))
    return c


BAD_DENSE = [
    ("half the rows", np.ones((500, 16), np.float32), "(500, 16)"),
    ("transposed", np.ones((16, 1000), np.float32), "(16, 1000)"),
    ("float64", np.ones(SHAPE, np.float64), "float64"),
    ("int64", np.ones(SHAPE, np.int64), "int64"),
    ("torch float64", torch.ones(SHAPE, dtype=torch.float64), "float64"),
    ("flat but short", np.ones(1000 * 16 - 1, np.float32), "(15999,)"),
]


@pytest.mark.parametrize("what,grad,named", BAD_DENSE, ids=[b[0] for b in BAD_DENSE])
def test_a_dense_gradient_of_another_shape_or_dtype_is_refused_and_changes_nothing(client, what, grad, named):
    before = client.pull_dense("w")
    with pytest.raises(InvalidArgument) as err:
        client.push_dense("w", grad)
    assert "'w'" in err.value.message and named in err.value.message, err.value.message
    if "float" not in named and "int" not in named:
        assert "(1000, 16)" in err.value.message, err.value.message
    with pytest.raises(InvalidArgument):
        client.push_many([("w", grad)])
    assert np.array_equal(client.pull_dense("w"), before)


def test_a_sub_range_gradient_is_flat_or_whole_rows_at_a_row_boundary(client):
    client.push_dense("w", np.ones(32, np.float32), start=16)            # flat range
    client.push_dense("w", np.ones((2, 16), np.float32), start=64)       # two whole rows
    w = client.pull_dense("w")
    assert (w[1:3] == -1).all() and (w[4:6] == -1).all() and (w[0] == 0).all() and (w[3] == 0).all()
    with pytest.raises(InvalidArgument, match="row boundary"):
        client.push_dense("w", np.ones((2, 16), np.float32), start=8)
    with pytest.raises(InvalidArgument, match=r"\(2, 8\)"):
        client.push_dense("w", np.ones((2, 8), np.float32), start=0)
    client.push_dense("w", np.ones(SHAPE, np.float32).reshape(-1))        # the whole table, flat
    assert (client.pull_dense("w")[0] == -1).all()


def test_gradient_rows_must_match_the_ids_and_the_tables_dim(client):
    ids = np.arange(10)
    with pytest.raises(InvalidArgument) as err:
        client.push_rows("emb", ids, np.ones((9, 4), np.float32))
    assert "'emb'" in err.value.message and "(9, 4)" in err.value.message and "(10, 4)" in err.value.message
    with pytest.raises(InvalidArgument, match="float64"):
        client.push_rows("emb", ids, np.ones((10, 4)))
    with pytest.raises(InvalidArgument, match="integers|int64"):
        client.pull_rows("emb", np.array([1.5, 2.0]))
    assert np.array_equal(client.pull_rows("emb", ids), np.zeros((10, 4), np.float32))
    batch = np.arange(6).reshape(2, 3)                                   # ids of a (B, F) batch
    client.push_rows("emb", batch, np.ones((2, 3, 4), np.float32))
    assert (client.pull_rows("emb", np.arange(6)) == -1).all()


def test_update_config_names_an_unknown_setting(client):
    with pytest.raises(InvalidArgument) as err:
        client.update_config("w", learning_rate=0.1)
    assert "learning_rate" in err.value.message and "'lr'" in err.value.message
    with pytest.raises(InvalidArgument, match="lr='fast'"):
        client.update_config("w", lr="fast")
    assert client.table("w").config.optimizer.lr == 1.0


# ---------------------------------------------------------------------------- fuzzing the API
ODD_ARRAYS = st.sampled_from([
    np.ones((3, 16), np.float32), np.ones(SHAPE, np.float64), np.ones((0,), np.float32),
    np.ones((1000, 16, 1), np.float32), np.array(["a", "b"]), np.array([1 + 2j]),
    np.array([None, 1.0], dtype=object), np.ones((4, 4), np.int8), np.array(True),
    torch.ones(5, dtype=torch.int64), torch.ones((10, 4)), np.full((10, 4), np.nan, np.float32),
])
ODD = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
    st.text(max_size=5), st.lists(st.integers(-5, 2000), max_size=5),
    st.lists(st.lists(st.floats(-1, 1), max_size=3), max_size=3), ODD_ARRAYS,
    st.tuples(st.just("w")), st.tuples(st.just("emb"), st.integers(0, 5)),
)
TABLE = st.one_of(st.sampled_from(["w", "emb", "nope", ""]), ODD)
CALLS = st.sampled_from(["push_dense", "push_rows", "pull_dense", "pull_rows", "pull_many",
                         "push_many", "update_config", "initialize_dense", "create_dense",
                         "create_sparse", "exchange_async"])


def _call(c, name: str, table, a, b, timeout, clock):
    kw = {"timeout": timeout, "clock": clock}
    if name == "push_dense":
        return c.push_dense(table, a, start=b, **kw)
    if name == "push_rows":
        return c.push_rows(table, a, b, **kw)
    if name == "pull_dense":
        return c.pull_dense(table, a, b, **kw)
    if name == "pull_rows":
        return c.pull_rows(table, a, **kw)
    if name == "pull_many":
        return c.pull_many(a, **kw)
    if name == "push_many":
        return c.push_many(a, **kw)
    if name == "update_config":
        return c.update_config(table, **{str(b): a})
    if name == "initialize_dense":
        return c.initialize_dense(table, a, timeout=timeout)
    if name == "create_dense":
        return c.create_dense(f"f{abs(hash(str(table))) % 3}", shape=a, optimizer=b)
    if name == "create_sparse":
        return c.create_sparse(f"g{abs(hash(str(table))) % 3}", dim=a, num_rows=b)
    return c.exchange_async(a, b, clock=clock if clock is not None else 0, timeout=timeout).result()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(name=CALLS, table=TABLE, a=ODD, b=ODD,
       timeout=st.one_of(st.none(), st.sampled_from([5.0, -1.0, 0, float("nan"), "x", True])),
       clock=st.one_of(st.none(), st.sampled_from([0, 3, -1, 2.5, "1", 2**64])))
def test_the_public_client_raises_only_shardps_errors_whatever_its_arguments(client, name, table, a, b,
                                                                               timeout, clock):
    try:
        _call(client, name, table, a, b, timeout, clock)
    except ShardpsError:
        pass
