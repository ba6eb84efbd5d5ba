"""``FailoverChannel`` against in-process gRPC servers: a follower's refusal (``LeaderGate``)
is re-sent to the leader it names; an unreachable replica moves the next call on."""

from __future__ import annotations

import grpc
import pytest

from shardps.rpc import channels
from shardps.rpc.failover import FailoverChannel, LeaderGate, refused_by_follower
from shardps.tools.bench.common import free_port

SERVICE = "test.Echo"
METHOD = f"/{SERVICE}/Echo"


class _Echo(grpc.GenericRpcHandler):
    def __init__(self, tag: bytes):
        self.tag = tag

    def service(self, details):
        if details.method != METHOD:
            return None
        return grpc.unary_unary_rpc_method_handler(lambda request, context: self.tag + request)


@pytest.fixture
def replicas():
    started = []

    def start(handler) -> str:
        server = channels.new_server(2, handlers=[handler])
        port = channels.add_port(server, "127.0.0.1:0")
        server.start()
        started.append(server)
        return f"127.0.0.1:{port}"
    yield start
    for s in started:
        s.stop(0)


def test_a_refused_call_is_sent_to_the_leader_named(replicas):
    leader = replicas(_Echo(b"leader:"))
    follower = replicas(LeaderGate(SERVICE, lambda: leader))
    with FailoverChannel([follower, leader], channels.channel) as ch:
        echo = ch.unary_unary(METHOD)
        assert echo(b"x", timeout=5) == b"leader:x"
        assert ch.current == leader
    with channels.channel(follower) as plain:      # what a client that does not follow sees
        with pytest.raises(grpc.RpcError) as err:
            plain.unary_unary(METHOD)(b"x", timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert refused_by_follower(err.value) == leader


@pytest.mark.slow             # over a second: make test-fast stays under a minute
def test_no_leader_yet_waits_then_an_unreachable_replica_moves_on(replicas):
    gate = LeaderGate(SERVICE, lambda: "")
    follower = replicas(gate)
    with FailoverChannel([follower], channels.channel, sleep=lambda s: setattr(gate, "current", _Echo(b"new:"))) as ch:
        # refused ("no leader yet"), a pause (during which this replica becomes the leader), served
        assert ch.unary_unary(METHOD)(b"x", timeout=5) == b"new:x"
    dead = f"127.0.0.1:{free_port()}"
    live = replicas(_Echo(b"live:"))
    with FailoverChannel([dead, live], channels.channel) as ch:
        with pytest.raises(grpc.RpcError) as err:        # may have been executed: raised
            ch.unary_unary(METHOD)(b"x", timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert ch.current == live
        assert ch.unary_unary(METHOD)(b"y", timeout=5) == b"live:y"
        # wait_for_ready (a call sent once): a replica that does not connect is skipped
        ch.rotate(live)
        assert ch.current == dead
        assert ch.unary_unary(METHOD)(b"z", timeout=5, wait_for_ready=True) == b"live:z"
