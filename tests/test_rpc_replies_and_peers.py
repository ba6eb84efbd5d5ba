"""Client transports and server peers against servers that misbehave, without a cluster:
a reply header that does not decode is the server's fault (Unavailable: the data path
retries it), not the caller's (InvalidArgument); a peer's hung OpenDataPlane is cancelled
by ``abandon(node)``."""

from __future__ import annotations

import threading

import grpc
import pytest

from shardps import messages as m
from shardps.errors import Unavailable
from shardps.metrics import WorkerMetrics
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.rpc import packed
from shardps.rpc.dataplane_transport import DataPlaneTransport, _Plane
from shardps.rpc.grpc_transport import GrpcTransport
from shardps.rpc.peers import NodePeers
from shardps.rpc.stubs import GrpcPeers, StubPool

HEADER = m.Header("job", 1, "", 0, 0, 0, 0, 1)
GARBAGE = b"\xff\x01\x02"


class _Planes:
    """A ``DataPlanePool`` whose every reply header is ``raw``."""

    def __init__(self, raw: bytes):
        self.raw = raw

    def call(self, address, method, head, buffers, timeout=None, consume=None, flags=0):
        return consume(self.raw, memoryview(b"")) if consume else (self.raw, memoryview(b""))

    def start(self, address, method, head, payload, timeout=None, flags=0):
        return "sent"

    def finish(self, sent, consume):
        return consume(self.raw, memoryview(b""))

    def abandon(self, address):
        return 0

    def close(self):
        pass


def _data_plane(raw: bytes, packed_form: bool) -> DataPlaneTransport:
    t = DataPlaneTransport("job", GrpcTransport("job", StubPool(), WorkerMetrics(), shared_memory=False))
    t.pool.close()
    t.pool = _Planes(raw)           # type: ignore[assignment]
    t._planes["grpc:1"] = _Plane("plane:1", packed_form)
    return t


@pytest.mark.parametrize("packed_form", [True, False], ids=["packed", "protobuf"])
def test_a_data_plane_reply_that_does_not_decode_is_unavailable(packed_form):
    push, pull = m.PushRequest(HEADER, m.GRADIENT, [], []), m.PullRequest(HEADER, [])
    calls = [lambda t: t.push("s1", "grpc:1", push, 1.0),
             lambda t: t.pull("s1", "grpc:1", pull, None, 1.0, lambda head, payload: head),
             lambda t: t.exchange_finish(t.exchange_start("s1", "grpc:1", push, pull, 1.0),
                                         lambda ack, head, payload: head)]
    for raw in (GARBAGE, b"\x00"):
        for call in calls:
            t = _data_plane(raw, packed_form)
            with pytest.raises(Unavailable, match="malformed reply from s1"):
                call(t)
            assert "grpc:1" not in t._planes        # asked again next time, as for any Unavailable
    # well-formed replies still decode
    t = _data_plane(packed.push_ack(m.PushAck([], 3)) if packed_form else
                    ps.PushAck(duplicate_blocks=3).SerializeToString(), packed_form)
    assert t.push("s1", "grpc:1", push, 1.0).duplicate_blocks == 3


class _Chunk:
    def __init__(self, header: bytes | None, data: bytes = b""):
        self.header, self.data = header, data


class _Stream:
    def __init__(self, chunks):
        self.chunks = chunks

    def __iter__(self):
        return iter(self.chunks)


class _Stub:
    def __init__(self, chunks):
        self.chunks = chunks

    def Pull(self, message, timeout=None, metadata=()):
        return _Stream(self.chunks)


class _Stubs:
    metadata = ()

    def __init__(self, stub):
        self.stub = stub

    def get(self, address):
        return self.stub

    def close(self):
        pass


@pytest.mark.parametrize("chunks", [
    [_Chunk(ps.PullHeader(in_shared_memory=True, payload_bytes=8).SerializeToString())],   # none offered
    [_Chunk(GARBAGE)],
    [_Chunk(b""), _Chunk(b"")],                                                             # two headers
    [_Chunk(None, b"1234")],                                                                # no header
], ids=["shared-memory-not-offered", "garbage", "two-headers", "no-header"])
def test_a_grpc_pull_reply_that_does_not_decode_is_unavailable(chunks):
    t = GrpcTransport("job", _Stubs(_Stub(chunks)), WorkerMetrics(), shared_memory=False)  # type: ignore[arg-type]
    with pytest.raises(Unavailable, match="malformed reply from s1"):
        t.pull("s1", "grpc:1", m.PullRequest(HEADER, []), None, 1.0, lambda head, payload: head)


class _HungCall:
    """A gRPC future that never completes unless cancelled."""

    def __init__(self):
        self.waiting = threading.Event()
        self.cancelled = threading.Event()

    def result(self, timeout=None):
        self.waiting.set()
        if not self.cancelled.wait(10):
            raise AssertionError("never cancelled")
        raise grpc.FutureCancelledError()

    def cancel(self):
        self.cancelled.set()
        return True


class _OpenDataPlane:
    def __init__(self, call):
        self.call = call

    def future(self, request, timeout=None, metadata=()):
        return self.call


class _PeerStub:
    def __init__(self, call):
        self.OpenDataPlane = _OpenDataPlane(call)


def test_abandon_cancels_a_hung_open_data_plane_by_node_name():
    hung = _HungCall()
    grpc_peers = GrpcPeers("a", {"b": "10.0.0.2:7000"}.__getitem__, _Stubs(_PeerStub(hung)),  # type: ignore[arg-type]
                           timeout=30.0)
    peers = NodePeers(grpc_peers, _Planes(b""))                                                 # type: ignore[arg-type]
    raised: list[BaseException] = []

    def replicate():
        try:
            peers.replicate("b", 1, [], [])
        except BaseException as exc:        # noqa: BLE001 - the test reads it
            raised.append(exc)

    thread = threading.Thread(target=replicate, daemon=True)
    thread.start()
    assert hung.waiting.wait(5)
    try:
        assert peers.abandon("b") == 1
        thread.join(5)
        assert not thread.is_alive()
        assert len(raised) == 1 and isinstance(raised[0], Unavailable), raised
        assert "b" in raised[0].message
    finally:
        hung.cancel()
        thread.join(5)
