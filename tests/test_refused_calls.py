"""A refused call changes nothing anywhere: a push spread over several servers with one bad
value (a NaN, an infinity, an id out of bounds) is refused whole by the client before anything
is sent, over the data plane and over gRPC, and the error names the value by its place in the
caller's arrays. (Each server's own refusal of its part is tested in test_bad_input.py and
test_lane.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from shardps.errors import InvalidArgument
from shardps.tables import sgd

N_DENSE, N_SPARSE, N_BOUNDED = 4096, 143, 155


@pytest.fixture(params=[True, False], ids=["data-plane", "grpc"])
def client(request, make_cluster, client_factory):
    cluster = make_cluster(2)
    c = client_factory(cluster.address, data_plane=request.param)
    c.create_job()
    c.create_dense("w", (N_DENSE,), block_size=256, optimizer=sgd(1.0))
    c.create_sparse("e", 8, optimizer=sgd(1.0))
    c.create_sparse("b", 8, num_rows=1000, num_blocks=39, optimizer=sgd(1.0))
    for name in ("w", "e", "b"):       # else one server's refusal alone would change nothing
        assert len({r[0] for r in c.table(name).replicas}) == 2, f"{name} is not spread over both servers"
    return c


def _sparse_ids() -> np.ndarray:
    return np.arange(N_SPARSE, dtype=np.int64) * 7919


def _bounded_ids() -> np.ndarray:
    ids = np.arange(N_BOUNDED, dtype=np.int64) * 6
    ids[77] = 5000                      # out of [0, 1000)
    return ids


def _state(c) -> tuple:
    return (c.pull_dense("w"), c.pull_rows("e", _sparse_ids()), c.pull_rows("b", np.delete(_bounded_ids(), 77)))


def _unchanged(before: tuple, after: tuple) -> None:
    for b, a in zip(before, after):
        assert np.array_equal(b, a)


def test_a_nan_in_a_dense_push_over_two_servers_changes_nothing(client):
    before = _state(client)
    grad = np.ones(N_DENSE, np.float32)
    grad[4095] = np.nan
    with pytest.raises(InvalidArgument, match=r"element 4095 of the gradient for table 'w' is nan"):
        client.push_dense("w", grad)
    _unchanged(before, _state(client))


def test_the_place_of_a_nan_in_a_partial_or_shaped_gradient(client):
    grad = np.ones(1024, np.float32)
    grad[517] = -np.inf
    with pytest.raises(InvalidArgument, match=r"element 517 of the gradient \(element 1541 of the table\) "
                                              r"for table 'w' is -inf"):
        client.push_dense("w", grad, start=1024)
    client.create_dense("m", (64, 64), block_size=256, optimizer=sgd(1.0))
    grad = np.ones((64, 64), np.float32)
    grad[63, 63] = np.nan
    with pytest.raises(InvalidArgument, match=r"element 4095 of the gradient \(index \(63, 63\)\) for table 'm'"):
        client.push_dense("m", grad)


def test_an_inf_in_one_sparse_row_changes_no_row(client):
    before = _state(client)
    grads = np.ones((N_SPARSE, 8), np.float32)
    grads[100, 3] = np.inf
    with pytest.raises(InvalidArgument, match=rf"row 100 \(id {100 * 7919}\), column 3 of the gradient rows "
                                              r"for table 'e' is inf"):
        client.push_rows("e", _sparse_ids(), grads)
    _unchanged(before, _state(client))


def test_an_id_out_of_bounds_changes_no_valid_row(client):
    before = _state(client)
    with pytest.raises(InvalidArgument, match=r"row id 5000 \(position 77 of the ids\) of table 'b' is out "
                                              r"of bounds: ids must lie in \[0, 1000\)"):
        client.push_rows("b", _bounded_ids(), np.ones((N_BOUNDED, 8), np.float32))
    with pytest.raises(InvalidArgument, match="row id 5000"):
        client.pull_rows("b", _bounded_ids())
    _unchanged(before, _state(client))


def test_one_bad_item_of_a_push_many_or_an_exchange_sends_none(client):
    before = _state(client)
    grads = np.ones((N_SPARSE, 8), np.float32)
    grads[0, 0] = np.nan
    good = ("w", np.ones(N_DENSE, np.float32))
    with pytest.raises(InvalidArgument, match="table 'e' is nan"):
        client.push_many([good, ("e", _sparse_ids(), grads)])
    with pytest.raises(InvalidArgument, match="table 'e' is nan"):
        client.exchange([good, ("e", _sparse_ids(), grads)], [("w",)], clock=0)
    _unchanged(before, _state(client))


def test_a_table_that_allows_non_finite_values_takes_them(client):
    client.create_dense("loose", (N_DENSE,), block_size=256, optimizer=sgd(1.0), allow_non_finite=True)
    grad = np.zeros(N_DENSE, np.float32)
    grad[4095] = np.nan
    client.push_dense("loose", grad)
    got = client.pull_dense("loose")
    assert np.isnan(got[4095]) and np.isfinite(got[:4095]).all()
