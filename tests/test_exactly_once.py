"""Exactly-once for every client (common.proto, RequestHeader): a push resent with the same
header is applied once, inside the worker group and outside it; a GRADIENT push without a
session is refused; a PSClient that never joined retries a push whose acknowledgement was
lost without applying it twice."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from shardps.errors import Unavailable
from shardps.metrics import WorkerMetrics
from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import manager_pb2 as mg
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.rpc import channels
from shardps.rpc.codec import encode_chunk
from shardps.rpc.stubs import ManagerStub, ParameterServerStub, StubPool
from shardps.tables import sgd
from shardps.worker.client.transport import GrpcTransport


@pytest.fixture
def setup(make_cluster, client_factory):
    cluster = make_cluster(1)
    c = client_factory(cluster.address, "once")
    c.create_job()
    c.create_dense("w", (8,), optimizer=sgd(1.0))
    server = next(iter(cluster.servers.values()))
    with channels.channel(cluster.address) as mch, channels.channel(server.address) as sch:
        yield c, ManagerStub(mch), ParameterServerStub(sch)


def _push(stub, header: pb.RequestHeader) -> ps.PushAck:
    h = ps.PushHeader(header=header, segments=[pb.Segment(table="w", range=pb.Range(start=0, stop=8))],
                      payload_bytes=32)
    return stub.Push(iter([encode_chunk(h.SerializeToString(), np.ones(8, np.float32).tobytes())]), timeout=10)


@pytest.mark.parametrize("client_session", [False, True], ids=["member", "client outside the group"])
def test_a_push_resent_with_the_same_header_is_applied_once(setup, client_session):
    c, manager, server = setup
    joined = manager.JoinWorkerGroup(mg.JoinWorkerGroupRequest(job="once", client=client_session), timeout=10)
    epoch = c.refresh_map(min_epoch=joined.epoch).epoch
    group = c.shard_map.groups["once"]
    listed = group.clients if client_session else group.members
    assert joined.session in {m.session for m in listed}
    header = pb.RequestHeader(job="once", epoch=epoch, session=joined.session,
                              incarnation=joined.incarnation, sequence=1, acked_below=1)
    first, again = _push(server, header), _push(server, header)         # the retry of a lost ack
    assert first.duplicate_blocks == 0 and again.duplicate_blocks == 1
    np.testing.assert_array_equal(c.pull_dense("w"), -np.ones(8))
    header.sequence = 2
    _push(server, header)                                               # the next push applies
    np.testing.assert_array_equal(c.pull_dense("w"), -2 * np.ones(8))
    manager.LeaveWorkerGroup(mg.LeaveWorkerGroupRequest(job="once", session=joined.session), timeout=10)
    assert joined.session not in {m.session for g in [c.refresh_map().groups["once"]]
                                  for m in g.members + g.clients}


def test_a_gradient_push_without_a_session_is_refused_and_changes_nothing(setup):
    c, _, server = setup
    with pytest.raises(grpc.RpcError) as err:
        _push(server, pb.RequestHeader(job="once", epoch=c.refresh_map().epoch))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "session" in err.value.details() and "JoinWorkerGroup" in err.value.details()
    np.testing.assert_array_equal(c.pull_dense("w"), np.zeros(8))


class LosesFirstAck:
    """A transport whose first push is applied by the server but whose acknowledgement is
    lost on the way back (the client sees UNAVAILABLE, as after a dropped connection)."""

    def __init__(self, inner):
        self.inner = inner
        self.headers: list = []

    def push(self, server, address, request, timeout):
        ack = self.inner.push(server, address, request, timeout)
        self.headers.append(request.header)
        if len(self.headers) == 1:
            raise Unavailable("the acknowledgement was lost")
        return ack

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_client_that_never_joined_retries_a_push_without_applying_it_twice(cluster, client_factory):
    owner = client_factory(cluster.address, "solo")
    owner.create_job()
    owner.create_dense("w", (8,), optimizer=sgd(1.0))
    lossy = LosesFirstAck(GrpcTransport("solo", StubPool(), WorkerMetrics()))
    c = client_factory(cluster.address, "solo", transport=lossy)
    assert c.membership is None                     # not in the worker group
    result = c.push_dense("w", np.ones(8, np.float32))
    first, retry = lossy.headers
    assert first.session and (first.session, first.sequence) == (retry.session, retry.sequence)
    assert result.duplicate_blocks == 1
    np.testing.assert_array_equal(owner.pull_dense("w"), -np.ones(8))
    assert first.session in {m.session for m in owner.refresh_map().groups["solo"].clients}
    c.close()                                       # ends its session
    assert first.session not in {m.session for m in owner.refresh_map().groups["solo"].clients}
