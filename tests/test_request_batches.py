"""A call's requests checked together (``requests.pull_pieces`` / ``push_pieces``): when every
sparse request's ids are a flat int64 array (and, for a push, its rows a float32
``[len(ids), dim]`` array) the sparse requests are checked and laid out in one batch; else
each request goes its own way. Both give the same pieces in request order, and the same
refusals: pure, on table views built here."""

from __future__ import annotations

import numpy as np
import pytest

from shardps.errors import InvalidArgument
from shardps.shardmap import TableView
from shardps.tables import TableConfig, dense_table, sparse_table
from shardps.worker.client import requests as rq


def _view(spec, allow_non_finite: bool = False) -> TableView:
    empty = np.zeros(0, np.uint64)
    return TableView("job", spec, TableConfig(allow_non_finite=allow_non_finite), (), np.zeros(0, np.int32),
                     empty, empty)


DENSE = _view(dense_table("dense", (3, 2)))
A = _view(sparse_table("a", 4, num_rows=100))
B = _view(sparse_table("b", 2, num_rows=10))
LOOSE = _view(sparse_table("loose", 2, num_rows=10), allow_non_finite=True)


def _ids(*xs) -> np.ndarray:
    return np.array(xs, np.int64)


def _pulled(tables, requests):
    """Each part as (item, table, dense, ids, output shape, finish given), and the parts."""
    call = rq.pull_pieces(tables, requests)
    return [(p.item, p.table, p.dense, None if p.ids is None else p.ids.tolist(), out.shape, finish is not None)
            for p, out, finish in zip(*call)], call


def test_a_mixed_pull_is_laid_out_in_request_order_whichever_way_its_sparse_requests_go():
    tables = [A, DENSE, B, A]
    plain = [("a", _ids(5, 1, 9)), ("dense",), ("b", _ids(3, 3, 7)), ("a", _ids())]
    batched, call = _pulled(tables, plain)
    assert batched == [(0, "a", False, [5, 1, 9], (3, 4), False),
                       (1, "dense", True, None, (6,), True),            # whole: reshaped to (3, 2)
                       (2, "b", False, [3, 7], (2, 2), True),          # a repeated id: sent once, spread back
                       (3, "a", False, [], (0, 4), False)]
    # the outputs of the batch's distinct ids are views of one array (its rows' scatter is one call)
    assert call.outputs.starts == [0, -1, -1, 12]
    first = call.outputs[0]
    assert first.base is call.outputs.flat and np.shares_memory(first, call.outputs.flat[:12])
    # one request's ids as int32: the call goes request by request, to the same pieces
    apart, split = _pulled(tables, [*plain[:2], ("b", np.array([3, 3, 7], np.int32)), plain[3]])
    assert apart == batched and split.outputs.flat is None


def test_a_pulls_finish_spreads_the_rows_of_repeated_ids_and_leaves_the_others_as_they_are():
    _, call = _pulled([B, A], [("b", _ids(3, 3, 7)), ("a", _ids(2))])
    values = [np.array([[1, 2], [3, 4]], np.float32), np.ones((1, 4), np.float32)]
    same = values[1]
    out = rq.finished(call.finishes, values)
    assert out[0].tolist() == [[1, 2], [1, 2], [3, 4]] and out[1] is same


def test_a_sparse_id_out_of_bounds_is_refused_naming_its_table_and_place_in_a_mixed_call():
    with pytest.raises(InvalidArgument, match=r"row id 10 \(position 1 of the ids\) of table 'b'.*\[0, 10\)"):
        rq.pull_pieces([DENSE, A, B], [("dense",), ("a", _ids(99)), ("b", _ids(0, 10))])
    with pytest.raises(InvalidArgument, match=r"row id -1 \(position 0 of the ids\) of table 'a'"):
        rq.push_pieces([A, DENSE], [("a", _ids(-1), np.zeros((1, 4), np.float32)),
                                    ("dense", np.zeros(6, np.float32))])


def test_a_push_sums_repeated_ids_and_keeps_distinct_rows_as_given():
    rows_a = np.arange(8, dtype=np.float32).reshape(2, 4)
    pieces = rq.push_pieces([A, DENSE, B], [("a", _ids(4, 2), rows_a), ("dense", np.ones((3, 2), np.float32)),
                                            ("b", _ids(1, 1), np.array([[1, 2], [10, 20]], np.float32))])
    assert [(p.item, p.table, p.dense) for p in pieces] == [(0, "a", False), (1, "dense", True), (2, "b", False)]
    assert pieces[0].values is rows_a and pieces[0].ids.tolist() == [4, 2]
    assert pieces[1].values.tolist() == [1.0] * 6
    assert pieces[2].ids.tolist() == [1] and pieces[2].values.tolist() == [[11, 22]]


def test_a_non_finite_row_is_refused_by_the_first_table_that_does_not_allow_it():
    ok = np.zeros((1, 2), np.float32)
    nan = np.array([[0, np.nan]], np.float32)
    inf = np.array([[np.inf, 0]], np.float32)
    # allowed in 'loose', refused in 'b', whose NaN comes after it
    with pytest.raises(InvalidArgument, match=r"row 0 \(id 4\), column 1 of the gradient rows for table 'b' is nan"):
        rq.push_pieces([LOOSE, B, A], [("loose", _ids(1), inf), ("b", _ids(4), nan),
                                       ("a", _ids(1), np.zeros((1, 4), np.float32))])
    pieces = rq.push_pieces([B, LOOSE], [("b", _ids(2), ok), ("loose", _ids(3), inf)])
    assert np.isinf(pieces[1].values).any()


def test_push_rows_of_another_shape_or_dtype_take_the_per_request_checks():
    with pytest.raises(InvalidArgument, match=r"have shape \(2, 2\); 2 ids of a table with dim 4 need \(2, 4\)"):
        rq.push_pieces([B, A], [("b", _ids(1), np.zeros((1, 2), np.float32)),
                                ("a", _ids(1, 2), np.zeros((2, 2), np.float32))])
    with pytest.raises(InvalidArgument, match="has dtype float64"):
        rq.push_pieces([A], [("a", _ids(1), np.zeros((1, 4)))])
