"""Bad input: one status code per case, a message naming the bad value, nothing stored changes.

Requests go to the server with a raw stub (bypassing the client's own checks), so the
server's validation at the boundary is what is tested.
"""

import grpc
import numpy as np
import pytest

from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.rpc import channels
from shardps.rpc.codec import encode_chunk
from shardps.rpc.stubs import ParameterServerStub
from shardps.tables import sgd


@pytest.fixture
def setup(make_cluster, client_factory):
    cluster = make_cluster(1, server_settings={"max_request_bytes": 1 << 20})
    c = client_factory(cluster.address)
    c.create_job()
    c.create_dense("w", (100,), optimizer=sgd(1.0))
    c.create_sparse("e", 4, num_rows=1000, optimizer=sgd(1.0))
    c.push_dense("w", np.ones(100, np.float32))
    c.push_rows("e", [1, 2], np.ones((2, 4), np.float32))
    server = next(iter(cluster.servers.values()))
    ch = channels.channel(server.address)
    yield c, ParameterServerStub(ch)
    ch.close()


def push(stub, header, segments, payload, dtype=pb.FLOAT32, kind=ps.GRADIENT):
    h = ps.PushHeader(header=header, kind=kind, segments=segments, payload_bytes=len(payload))
    h.header.wire_dtype = dtype
    return stub.Push(iter([encode_chunk(h.SerializeToString(), payload)]), timeout=10)


def dense(start, stop):
    return [pb.Segment(table="w", range=pb.Range(start=start, stop=stop))]


def rows(n, table="e"):
    return [pb.Segment(table=table, rows=pb.RowSelection(count=n))]


def f32(*shape, value=1.0):
    return np.full(shape, value, np.float32).tobytes()


CASES = [
    ("unknown job", dict(job="nope"), dense(0, 100), f32(100), pb.FLOAT32, "NOT_FOUND", "nope"),
    ("unknown table", {}, [pb.Segment(table="zz", range=pb.Range(start=0, stop=1))], f32(1), pb.FLOAT32,
     "NOT_FOUND", "zz"),
    ("short payload", {}, dense(0, 100), f32(99), pb.FLOAT32, "INVALID_ARGUMENT", "400 bytes"),
    ("long payload", {}, dense(0, 10), f32(11), pb.FLOAT32, "INVALID_ARGUMENT", "44 bytes"),
    ("wrong dtype", {}, dense(0, 10), np.ones(10, np.int64).tobytes(), pb.INT64, "INVALID_ARGUMENT", "INT64"),
    ("unknown dtype", {}, dense(0, 10), f32(10), 77, "INVALID_ARGUMENT", "77"),
    ("range out of bounds", {}, dense(90, 101), f32(11), pb.FLOAT32, "INVALID_ARGUMENT", "101"),
    ("negative range", {}, dense(-1, 5), f32(6), pb.FLOAT32, "INVALID_ARGUMENT", "-1"),
    ("id out of bounds", {}, rows(2), np.array([5, 1000], np.int64).tobytes() + f32(2, 4), pb.FLOAT32,
     "INVALID_ARGUMENT", "1000"),
    ("negative id", {}, rows(1), np.array([-2], np.int64).tobytes() + f32(1, 4), pb.FLOAT32,
     "INVALID_ARGUMENT", "-2"),
    ("NaN gradient", {}, dense(0, 3), np.array([1, np.nan, 1], np.float32).tobytes(), pb.FLOAT32,
     "INVALID_ARGUMENT", "nan"),
    ("Inf gradient", {}, rows(1), np.array([1], np.int64).tobytes() + np.array([0, np.inf, 0, 0], np.float32).tobytes(),
     pb.FLOAT32, "INVALID_ARGUMENT", "inf"),
    ("huge row count", {}, rows(10**12), b"", pb.FLOAT32, "RESOURCE_EXHAUSTED", "max_rows"),
    ("over the size limit", {}, dense(0, 100), b"\0" * (2 << 20), pb.FLOAT32, "RESOURCE_EXHAUSTED",
     "max_request_bytes"),
    ("stale epoch (server behind)", dict(epoch=10**9), dense(0, 100), f32(100), pb.FLOAT32, "UNAVAILABLE",
     "behind"),
    ("no job", dict(job=""), dense(0, 100), f32(100), pb.FLOAT32, "INVALID_ARGUMENT", "job"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_push_is_refused_and_changes_nothing(setup, case):
    c, stub = setup
    _, header_changes, segments, payload, dtype, code, word = case
    before_w, before_e = c.pull_dense("w"), c.pull_rows("e", [1, 2, 5])
    header = pb.RequestHeader(job="test", epoch=c.shard_map.epoch)
    for k, v in header_changes.items():
        setattr(header, k, v)
    with pytest.raises(grpc.RpcError) as err:
        push(stub, header, segments, payload, dtype)
    assert err.value.code().name == code, err.value.details()
    assert word.lower() in err.value.details().lower(), err.value.details()
    np.testing.assert_array_equal(c.pull_dense("w"), before_w)
    np.testing.assert_array_equal(c.pull_rows("e", [1, 2, 5]), before_e)


def test_a_request_half_bad_applies_nothing(setup):
    """A push whose second segment is bad does not apply its first."""
    c, stub = setup
    before = c.pull_dense("w")
    header = pb.RequestHeader(job="test", epoch=c.shard_map.epoch)
    segments = dense(0, 10) + rows(1)
    payload = f32(10) + np.array([5000], np.int64).tobytes() + f32(1, 4)
    with pytest.raises(grpc.RpcError) as err:
        push(stub, header, segments, payload)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "5000" in err.value.details()
    np.testing.assert_array_equal(c.pull_dense("w"), before)


def test_truncated_stream_is_refused(setup):
    c, stub = setup
    h = ps.PushHeader(header=pb.RequestHeader(job="test", epoch=c.shard_map.epoch), segments=dense(0, 100),
                      payload_bytes=400)
    with pytest.raises(grpc.RpcError) as err:
        stub.Push(iter([encode_chunk(h.SerializeToString(), f32(50))]), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "truncated" in err.value.details()


def test_bad_pull_codes(setup):
    c, stub = setup
    header = pb.RequestHeader(job="test", epoch=c.shard_map.epoch)
    req = ps.PullRequest(header=header, segments=dense(50, 200))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Pull(req, timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "200" in err.value.details()
    req = ps.PullRequest(header=header, segments=rows(3), data=np.array([1, 2], np.int64).tobytes())
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Pull(req, timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "3 ids" in err.value.details()


def test_client_side_errors_name_the_value(setup):
    from shardps.errors import InvalidArgument
    c, _ = setup
    with pytest.raises(InvalidArgument, match="12345"):
        c.pull_dense("w", 0, 12345)
    with pytest.raises(InvalidArgument, match="float64"):
        c.pull_rows("e", np.array([1.5]))


def test_a_call_of_several_tables_is_checked_whole_and_applies_nothing_when_refused(setup):
    """A call's plain requests are checked together (one compiled pass): a bad id or value of
    any table, dense or sparse, refuses the whole call, naming that table, the value and its
    place."""
    from shardps.errors import InvalidArgument
    c, _ = setup
    c.create_sparse("f", 2, num_rows=10, optimizer=sgd(1.0))
    ids = np.array([1, 2], np.int64)
    before = c.pull_rows("e", ids)
    good = ("e", ids, np.ones((2, 4), np.float32))
    with pytest.raises(InvalidArgument, match=r"row id 12 \(position 1 of the ids\) of table 'f'"):
        c.push_many([good, ("f", np.array([3, 12], np.int64), np.ones((2, 2), np.float32))])
    with pytest.raises(InvalidArgument, match=r"row 1 \(id 4\), column 0 of the gradient rows for table 'f' is nan"):
        c.push_many([good, ("f", np.array([3, 4], np.int64), np.array([[0, 0], [np.nan, 0]], np.float32))])
    with pytest.raises(InvalidArgument, match=r"row id -1 \(position 0 of the ids\) of table 'f'"):
        c.exchange([good], [("e", ids), ("f", np.array([-1], np.int64))], clock=0)
    c.create_dense("m", (3, 2), optimizer=sgd(1.0))
    m0 = c.pull_dense("m")
    nan_at_4 = np.array([[0, 0], [0, 0], [np.nan, 0]], np.float32)
    for grad in (nan_at_4, nan_at_4.reshape(-1)):       # in the table's shape, or flat
        with pytest.raises(InvalidArgument, match=r"element 4 of the gradient.* for table 'm' is nan"):
            c.push_many([good, ("m", grad), ("w", np.ones(100, np.float32))])
    with pytest.raises(InvalidArgument, match=r"element 1 of the gradient for table 'w' is inf"):
        c.exchange([("m", np.ones((3, 2), np.float32)), ("w", np.array([0, np.inf] + [0] * 98, np.float32))],
                   [("m",)], clock=0)
    np.testing.assert_array_equal(c.pull_rows("e", ids), before)
    w, m = c.pull_many([("w",), ("m",)]).values
    assert m.shape == (3, 2) and w.shape == (100,)
    np.testing.assert_array_equal(m, m0)
    # repeated ids: summed in a push, spread back in a pull, beside distinct ones in any order
    f0 = c.pull_rows("f", np.array([5, 6], np.int64))
    c.push_many([("f", np.array([5, 5, 6], np.int64), np.ones((3, 2), np.float32)),
                 ("e", np.array([2, 1], np.int64), np.ones((2, 4), np.float32))])
    f, e = c.pull_many([("f", np.array([6, 5, 6], np.int64)), ("e", np.array([2, 1], np.int64))]).values
    np.testing.assert_allclose(f, [f0[1] - 1.0, f0[0] - 2.0, f0[1] - 1.0])
    np.testing.assert_allclose(e, before[::-1] - 1.0)
