"""``shardps.rpc.status.translated`` against a real in-process gRPC server on port 0: what a
server raised (or the status it aborted with) reaches the caller as the ShardpsError subclass
of its status code, with the call's ``status`` and ``details`` kept, also mid-stream."""

from __future__ import annotations

import grpc
import pytest

from shardps.errors import InvalidArgument, StaleEpoch, Unavailable
from shardps.rpc import channels
from shardps.rpc.status import Method, bind, translated

SERVICE = "test.Translated"
_IDENTITY = bytes


def _stale(request, call):
    raise StaleEpoch(f"routed with map {request.decode()}: refresh the map")


def _stream(request, call):
    yield b"first"
    raise Unavailable("the server is stopping")


def _flaky(failures: int):
    calls = []

    def answer(request, call):
        calls.append(request)
        if len(calls) <= failures:
            raise Unavailable("starting")
        return b"ok"
    return answer, calls


class _Cancelling(grpc.GenericRpcHandler):
    """A raw handler that ends its call CANCELLED (as a peer that stops or cuts a stalled stream)."""

    def service(self, details):
        if details.method != f"/{SERVICE}/Cancelled":
            return None

        def cancel(request, context):
            context.abort(grpc.StatusCode.CANCELLED, "cut by the peer")
        return grpc.unary_unary_rpc_method_handler(cancel)


@pytest.fixture
def server():
    flaky, flaky_calls = _flaky(2)
    handler = bind(SERVICE, {"Stale": Method("unary_unary", _stale, _IDENTITY, _IDENTITY),
                             "Stream": Method("unary_stream", _stream, _IDENTITY, _IDENTITY),
                             "Flaky": Method("unary_unary", flaky, _IDENTITY, _IDENTITY)})
    srv = channels.new_server(2, handlers=[handler, _Cancelling()])
    port = channels.add_port(srv, "127.0.0.1:0")
    srv.start()
    with channels.channel(f"127.0.0.1:{port}") as ch:
        yield ch, flaky_calls
    srv.stop(0)


def test_a_unary_failure_becomes_the_servers_error_class(server):
    ch, _ = server
    with pytest.raises(StaleEpoch) as err, translated("push to s1"):
        ch.unary_unary(f"/{SERVICE}/Stale")(b"3", timeout=5)
    assert err.value.message == "push to s1: FAILED_PRECONDITION: routed with map 3: refresh the map"
    assert (err.value.status, err.value.details) == ("FAILED_PRECONDITION", "routed with map 3: refresh the map")
    assert err.value.__cause__ is None and err.value.__suppress_context__     # raised from None


def test_a_failure_while_iterating_a_stream_is_translated(server):
    ch, _ = server
    got = []
    with pytest.raises(Unavailable) as err, translated("snapshot from s2"):
        for item in ch.unary_stream(f"/{SERVICE}/Stream")(b"", timeout=5):
            got.append(item)
    assert got == [b"first"]
    assert err.value.status == "UNAVAILABLE"
    assert err.value.message == ("snapshot from s2: UNAVAILABLE: the server is stopping "
                                 "(is the process at that address running and reachable?)")


def test_codes_without_a_class_of_their_own_keep_their_status(server):
    ch, _ = server
    with pytest.raises(Unavailable) as cancelled, translated("call"):
        ch.unary_unary(f"/{SERVICE}/Cancelled")(b"", timeout=5)
    assert (cancelled.value.status, cancelled.value.details) == ("CANCELLED", "cut by the peer")
    with pytest.raises(InvalidArgument) as unknown, translated("NoSuchMethod", "the manager at x:1"):
        ch.unary_unary(f"/{SERVICE}/NoSuchMethod")(b"", timeout=5)     # a wrong address: final, named
    assert unknown.value.status == "UNIMPLEMENTED"
    assert "the manager at x:1 answers gRPC but does not serve NoSuchMethod" in unknown.value.message


def test_other_exceptions_pass_unchanged():
    with pytest.raises(InvalidArgument, match="^local$"), translated("call"):
        raise InvalidArgument("local")
    with pytest.raises(KeyError), translated("call"):
        raise KeyError("x")


def test_retries_see_translated_errors(server):
    """``channels.call_with_retries`` retries the translated UNAVAILABLE until an answer."""
    ch, calls = server
    rpc = ch.unary_unary(f"/{SERVICE}/Flaky")

    def attempt(left: float):
        with translated("flaky"):
            return rpc(b"x", timeout=left)

    assert channels.call_with_retries(attempt, 10.0) == b"ok"
    assert len(calls) == 3
