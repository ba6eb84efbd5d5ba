"""The data plane (shardps.rpc.dataplane): real servers on loopback, port 0."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from shardps.errors import (
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    StaleEpoch,
    Unauthenticated,
    Unavailable,
)
from shardps.rpc import frames
from shardps.rpc.channels import TlsConfig
from shardps.rpc.dataplane import (
    DataPlaneConnection,
    DataPlaneLimits,
    DataPlanePool,
    DataPlaneServer,
    client_ssl_context,
    server_ssl_context,
)
from shardps.tools.devcerts import make_dev_certs

ECHO = 100


def echo(method, header, payload, call):
    """Echo; other methods raise what the header names."""
    if method == ECHO:
        return header, [payload]
    raise {b"not_found": NotFound("table 'emb' of job 'j' does not exist"),
           b"stale": StaleEpoch("epoch 3 is stale: this server is at epoch 5"),
           b"quota": ResourceExhausted("job 'j' exceeds its quota of 10 bytes"),
           b"bug": ZeroDivisionError("division by zero")}[header]


@pytest.fixture
def server():
    srv = DataPlaneServer(echo).start()
    yield srv
    srv.stop()


@pytest.mark.parametrize("sizes", [[], [64], [1, 63], [3 << 20, 5 << 20]], ids=["0B", "64B", "64B-2", "8MiB"])
def test_echo_round_trip_in_several_buffers(server, sizes):
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 255, n, dtype=np.uint8) for n in sizes]
    with DataPlaneConnection(server.address) as conn:
        for _ in range(2):                    # the receive buffers are reused
            header, payload = conn.call(ECHO, b"head", parts, timeout=10)
            assert header == b"head"
            assert payload.readonly
            assert bytes(payload) == b"".join(p.tobytes() for p in parts)


def test_numpy_arrays_and_method_names(server):
    def named(method, header, payload, call):
        assert method == "Push" and call.full_method == "/shardps.v1.ParameterServer/Push"
        assert call.deadline is not None and call.deadline > time.monotonic()
        values = np.frombuffer(payload, dtype="<f4")
        return b"", [values * 2]

    srv = DataPlaneServer(named).start()
    try:
        with DataPlaneConnection(srv.address) as conn:
            _, payload = conn.call("Push", b"", [np.arange(3, dtype="<f4"), np.ones(2, dtype="<f4")], timeout=5)
            np.testing.assert_array_equal(np.frombuffer(payload, dtype="<f4"), [0, 2, 4, 2, 2])
    finally:
        srv.stop()


def test_many_threads_share_a_pool(server):
    pool = DataPlanePool(connections_per_address=3)
    failures = []

    def worker(i):
        try:
            for k in range(30):
                data = np.full(100 + i, i * 1000 + k, dtype=np.int64)
                got = pool.call(server.address, ECHO, str(i).encode(), [data], timeout=10,
                                consume=lambda h, p: (h, np.frombuffer(p, dtype=np.int64).copy()))
                assert got[0] == str(i).encode()
                np.testing.assert_array_equal(got[1], data)
                assert server.connections <= 3
        except Exception as exc:           # noqa: BLE001 - reported below
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    pool.close()
    assert not failures, failures
    with pytest.raises(Unavailable):
        pool.call(server.address, ECHO, b"", [], timeout=1)


@pytest.mark.parametrize("what,cls,text", [
    (b"not_found", NotFound, "table 'emb' of job 'j' does not exist"),
    (b"stale", StaleEpoch, "epoch 3 is stale"),
    (b"quota", ResourceExhausted, "exceeds its quota of 10 bytes"),
    (b"bug", Internal, "ZeroDivisionError: division by zero"),
])
def test_handler_errors_arrive_as_shardps_errors(server, what, cls, text):
    with DataPlaneConnection(server.address) as conn:
        with pytest.raises(cls) as err:
            conn.call(7, what, [], timeout=5)
        assert type(err.value) is cls and text in err.value.message
        assert conn.call(ECHO, b"still", [], timeout=5)[0] == b"still"   # the connection survives


def test_oversized_frames_are_refused():
    srv = DataPlaneServer(echo, limits=DataPlaneLimits(max_frame_bytes=1 << 20)).start()
    try:
        with DataPlaneConnection(srv.address) as conn:
            conn.call(ECHO, b"", [b"x"], timeout=5)            # learns the server's limit
            with pytest.raises(ResourceExhausted, match="max_frame_bytes"):
                conn.call(ECHO, b"", [np.zeros(2 << 20, np.uint8)], timeout=5)
            assert conn.call(ECHO, b"", [b"ok"], timeout=5)[1] == b"ok"   # not sent: still usable
        # a peer that ignores the limit: answered RESOURCE_EXHAUSTED, then the server closes
        host, port = srv.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            hello = frames.encode_hello(())
            raw.sendall(frames.pack_prefix(0, frames.HELLO, 0, 1, 0, 0, len(hello), 0) + hello)
            _read_frame(raw)
            raw.sendall(frames.pack_prefix(0, ECHO, 0, 2, 0, 0, 0, 2 << 20) + b"\0" * (64 << 10))
            raw.shutdown(socket.SHUT_WR)
            prefix, body = _read_frame(raw)
            assert prefix.status == 8 and prefix.flags & frames.FLAG_CLOSE       # RESOURCE_EXHAUSTED
            assert b"exceeds this server's limit" in body
            raw.settimeout(5)
            while raw.recv(1 << 16):                           # then the server closes
                pass
    finally:
        srv.stop()


def _read_frame(sock):
    head = b""
    while len(head) < frames.PREFIX_BYTES:
        head += sock.recv(frames.PREFIX_BYTES - len(head))
    prefix = frames.unpack_prefix(head)
    body = b""
    while len(body) < prefix.body_len:
        body += sock.recv(prefix.body_len - len(body))
    return prefix, body


def test_stopped_server_gives_unavailable_then_reconnects():
    srv = DataPlaneServer(echo).start()
    host, port = srv.address.rsplit(":", 1)
    conn = DataPlaneConnection(srv.address)
    assert conn.call(ECHO, b"", [b"a"], timeout=5)[1] == b"a"
    srv.stop()
    with pytest.raises(Unavailable):
        conn.call(ECHO, b"", [b"b"], timeout=5)
    srv = DataPlaneServer(echo, host=host, port=int(port)).start()
    try:
        assert conn.call(ECHO, b"", [b"c"], timeout=5)[1] == b"c"
    finally:
        conn.close()
        srv.stop()


def test_timeout_is_deadline_exceeded_and_the_next_call_reconnects():
    def slow(method, header, payload, call):
        if header == b"slow":
            time.sleep(0.3)
        return header, []

    srv = DataPlaneServer(slow).start()
    try:
        with DataPlaneConnection(srv.address) as conn:
            with pytest.raises(DeadlineExceeded):
                conn.call(ECHO, b"slow", [], timeout=0.1)
            assert conn.call(ECHO, b"fast", [], timeout=5)[0] == b"fast"
    finally:
        srv.stop()


def test_unix_socket(tmp_path):
    srv = DataPlaneServer(echo, host=f"unix:{tmp_path / 'dp.sock'}").start()
    try:
        with DataPlaneConnection(srv.address) as conn:
            assert conn.call(ECHO, b"h", [b"unix"], timeout=5) == (b"h", b"unix")
    finally:
        srv.stop()


def test_metadata_reaches_the_authenticator():
    from shardps.server.auth import SERVER_ADMIN, Authenticator, check_job, issue_job_token

    key = b"k" * 32
    authn = Authenticator("admin-secret", key, SERVER_ADMIN)

    def handler(method, header, payload, call):
        check_job(call.principal, header.decode())
        return b"", []

    srv = DataPlaneServer(handler, authenticate=authn,
                          method_names={**frames.METHOD_NAMES, 3: "Replicate"}).start()
    try:
        token = issue_job_token(key, "jobA")
        with DataPlaneConnection(srv.address, metadata=(("authorization", f"Bearer {token}"),)) as conn:
            conn.call("Push", b"jobA", [], timeout=5)
            with pytest.raises(PermissionDenied, match="jobA"):
                conn.call("Pull", b"jobB", [], timeout=5)        # another job's data
            with pytest.raises(PermissionDenied, match="admin operation"):
                conn.call(3, b"jobA", [], timeout=5)              # a server-admin method
        with DataPlaneConnection(srv.address, metadata=(("authorization", "Bearer admin-secret"),)) as conn:
            conn.call(3, b"jobB", [], timeout=5)
        with DataPlaneConnection(srv.address) as conn:            # no token: refused at HELLO
            with pytest.raises(Unauthenticated, match="no token"):
                conn.connect(timeout=5)
            assert not conn.connected
    finally:
        srv.stop()


def test_mutual_tls(tmp_path):
    certs = make_dev_certs(tmp_path / "certs")
    server_tls = TlsConfig.from_files(str(certs["server_cert"]), str(certs["server_key"]), str(certs["ca"]),
                                      require_client_cert=True)
    client_tls = TlsConfig.from_files(str(certs["client_cert"]), str(certs["client_key"]), str(certs["ca"]))
    srv = DataPlaneServer(echo, ssl_context=server_ssl_context(server_tls)).start()
    try:
        with DataPlaneConnection(srv.address, client_ssl_context(client_tls)) as conn:
            big = np.arange(3 << 18, dtype=np.uint32)          # 3 MiB through TLS records
            header, payload = conn.call(ECHO, b"tls", [b"small", big], timeout=10)
            assert header == b"tls" and bytes(payload) == b"small" + big.tobytes()
            assert conn.call(ECHO, b"again", [], timeout=5)[0] == b"again"
        no_cert = client_ssl_context(TlsConfig.from_files(ca=str(certs["ca"])))
        with DataPlaneConnection(srv.address, no_cert) as conn:
            with pytest.raises(Unavailable):
                conn.call(ECHO, b"", [b"x"], timeout=5)
        with DataPlaneConnection(srv.address) as conn:           # plaintext to a TLS port
            with pytest.raises(Unavailable):
                conn.call(ECHO, b"", [b"x"], timeout=5)
    finally:
        srv.stop()


def test_bad_method_and_address_are_invalid_arguments(server):
    with pytest.raises(InvalidArgument):
        DataPlaneConnection("no-port")
    with DataPlaneConnection(server.address) as conn:
        with pytest.raises(InvalidArgument):
            conn.call("NoSuchMethod", b"", [])
        with pytest.raises(InvalidArgument):
            conn.call(0, b"", [])


def test_idle_connections_wait_then_close_and_the_client_reconnects_quietly():
    srv = DataPlaneServer(echo, limits=DataPlaneLimits(io_seconds=0.1, idle_seconds=0.5)).start()
    try:
        with DataPlaneConnection(srv.address) as conn:
            conn.call(ECHO, b"", [b"a"], timeout=5)
            time.sleep(0.3)                  # longer than io_seconds: the server keeps waiting
            assert conn.call(ECHO, b"", [b"b"], timeout=5)[1] == b"b"
            assert srv.connections == 1
            time.sleep(0.8)                  # longer than idle_seconds: the server closes it
            assert srv.connections == 0
            assert conn.call(ECHO, b"", [b"c"], timeout=5)[1] == b"c"     # reconnected, no error
    finally:
        srv.stop()


@pytest.mark.slow
def test_transport_bench_part_writes_its_keys(tmp_path):
    import json

    from shardps.tools.bench.cli import main
    out = tmp_path / "results.json"
    assert main(["--tiny", "--only", "transport", "--out", str(out), "--quiet"]) == 0
    results = json.loads(out.read_text())
    for system in ("raw", "grpc", "dataplane"):
        for size in ("small", "1mib"):
            for what in ("rtt", "cpu", "client_cpu", "server_cpu"):
                key = f"transport_{system}_{size}_{what}_us"
                assert results.get(key) is not None and results[key] > 0, key
    assert results["tcp_gbps"] > 0
    for key in ("transport_ps_small_rtt_us", "transport_ps_small_cpu_us", "transport_ps_grpc_small_rtt_us"):
        assert results[key] > 0, key                         # a 1-row PSClient pull, both transports


def test_frame_prefix_round_trip_and_refusals():
    raw = frames.pack_prefix(frames.FLAG_REPLY, 2, 9, 1 << 40, 1500, 3, 4, 5 << 30)
    assert len(raw) == frames.PREFIX_BYTES == 40
    p = frames.unpack_prefix(raw)
    assert (p.flags, p.method, p.status, p.request_id, p.timeout_ms) == (frames.FLAG_REPLY, 2, 9, 1 << 40, 1500)
    assert p.body_len == 3 + 4 + (5 << 30)
    with pytest.raises(frames.ProtocolError, match="magic"):
        frames.unpack_prefix(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(16))     # a gRPC client
    with pytest.raises(frames.ProtocolError, match="version"):
        frames.unpack_prefix(b"SD\x07" + raw[3:])
    assert frames.decode_hello(frames.encode_hello((("authorization", "Bearer t"),))) == \
        (("authorization", "Bearer t"),)


def test_a_connection_refused_for_load_is_not_read_again_before_its_retry_hint():
    """Admission control's refusals carry ``retry_after``: the server reads nothing more from
    that connection until it has passed (a client ignoring the hint is slowed by TCP flow
    control), while other connections are served at once; refusals without a hint (a quota)
    do not pause."""
    def flooded(method, header, payload, call):
        if header == b"over-rate":
            exc = ResourceExhausted("job 'f' is over its request rate: retry in 0.300 s")
            exc.retry_after = 0.3
            raise exc
        if header == b"quota":
            raise ResourceExhausted("job 'f' exceeds its quota of 10 bytes")
        return header, []

    srv = DataPlaneServer(flooded).start()
    try:
        with DataPlaneConnection(srv.address) as conn, DataPlaneConnection(srv.address) as other:
            with pytest.raises(ResourceExhausted, match="quota"):
                conn.call(ECHO, b"quota", [], timeout=5)
            t0 = time.monotonic()
            assert conn.call(ECHO, b"next", [], timeout=5)[0] == b"next"
            assert time.monotonic() - t0 < 0.2                  # no hint: no pause
            with pytest.raises(ResourceExhausted, match="over its request rate"):
                conn.call(ECHO, b"over-rate", [], timeout=5)
            t0 = time.monotonic()
            assert other.call(ECHO, b"other", [], timeout=5)[0] == b"other"
            assert time.monotonic() - t0 < 0.2                  # another connection: at once
            assert conn.call(ECHO, b"next", [], timeout=5)[0] == b"next"
            assert time.monotonic() - t0 >= 0.25                # read only after the hint
    finally:
        srv.stop()


def test_abandon_fails_the_calls_in_flight_to_an_address_at_once():
    """A peer that will never answer (paused, cut off): ``DataPlanePool.abandon`` closes its
    connections and the call waiting on one raises Unavailable at once, not at its timeout;
    the next call connects again."""
    answer = threading.Event()

    def hung(method, header, payload, call):
        if header == b"hang":
            answer.wait(10)
        return header, []

    srv = DataPlaneServer(hung).start()
    pool = DataPlanePool()
    outcome: list = []
    try:
        def call():
            t0 = time.monotonic()
            try:
                pool.call(srv.address, ECHO, b"hang", [], timeout=10)
                outcome.append(("answered", time.monotonic() - t0))
            except Unavailable as exc:
                outcome.append((exc, time.monotonic() - t0))

        t = threading.Thread(target=call)
        t.start()
        wait_until = time.monotonic() + 5
        while not pool._all and time.monotonic() < wait_until:    # the call is in flight
            time.sleep(0.01)
        time.sleep(0.1)
        assert pool.abandon(srv.address) == 1
        t.join(5)
        (what, seconds), = outcome
        assert isinstance(what, Unavailable) and seconds < 2.0, outcome
        answer.set()
        assert pool.call(srv.address, ECHO, b"again", [], timeout=5)[0] == b"again"
        assert pool.abandon("127.0.0.1:1") == 0                  # nothing to that address
    finally:
        answer.set()
        pool.close()
        srv.stop()


def test_requests_started_on_several_servers_are_served_at_once_before_any_reply_is_read():
    """``start`` sends and returns; each server works on its request while the caller has
    not read a reply yet, and ``finish`` (in any order) reads each reply. Both handlers wait
    until both requests arrived: with a call that waited for its reply before the next was
    sent, neither would answer."""
    arrived = threading.Barrier(2, timeout=10)

    def meet(method, header, payload, call):
        if header.startswith(b"to "):
            arrived.wait()                    # both requests are in before either answers
        return header, [payload]

    servers = [DataPlaneServer(meet).start() for _ in range(2)]
    pool = DataPlanePool()
    try:
        sent = [pool.start(s.address, ECHO, f"to {i}".encode(), [bytes([i]) * 3], timeout=10)
                for i, s in enumerate(servers)]
        replies = [pool.finish(s) for s in reversed(sent)]
        assert [(h, bytes(p)) for h, p in replies] == [(b"to 1", b"\x01" * 3), (b"to 0", b"\x00" * 3)]
        # the connections went back to the pool: the next calls reuse them
        assert [bytes(pool.call(s.address, ECHO, b"again", [], timeout=5)[0]) for s in servers] == [b"again"] * 2
    finally:
        pool.close()
        for s in servers:
            s.stop()


def test_a_started_request_holds_its_connection_until_finished(server):
    """Between ``start`` and ``finish`` no other call uses the connection (its reply would
    be read as the other's); a failing ``finish`` gives the connection back too."""
    conn = DataPlaneConnection(server.address)
    try:
        sent = conn.start(ECHO, b"first", [b"1"], timeout=10)
        other: list = []
        t = threading.Thread(target=lambda: other.append(conn.call(ECHO, b"second", [b"2"], timeout=10)))
        t.start()
        t.join(0.3)
        assert t.is_alive() and not other     # waits for the connection
        assert conn.finish(sent)[0] == b"first"
        t.join(10)
        assert other and other[0][0] == b"second"
        failing = conn.start(ECHO + 1, b"not_found", [], timeout=10)
        with pytest.raises(NotFound, match="table 'emb'"):
            conn.finish(failing)
        assert conn.call(ECHO, b"after", [], timeout=10)[0] == b"after"
    finally:
        conn.close()


@pytest.mark.parametrize("size", [3, 200 << 10, 3 << 20], ids=["3B", "200KiB", "3MiB"])
def test_a_reply_payload_is_received_where_the_caller_asks(server, size):
    """``reply_into`` of the payload's length receives it there (the bytes read with the
    header copied first); of another length, the reply arrives as usual."""
    data = np.random.default_rng(1).integers(0, 255, size, dtype=np.uint8)
    with DataPlaneConnection(server.address) as conn:
        for _ in range(2):
            dest = np.zeros(size, np.uint8)
            header, payload = conn.finish(conn.start(ECHO, b"head" * 100, [data], timeout=10,
                                                     reply_into=memoryview(dest)))
            assert header == b"head" * 100
            np.testing.assert_array_equal(dest, data)
            assert np.frombuffer(payload, np.uint8).__array_interface__["data"][0] == dest.ctypes.data
        assert len(conn._receiver.buf) == frames.INITIAL_BUFFER_BYTES      # not grown to the payload
        other = np.zeros(size + 1, np.uint8)
        _, payload = conn.finish(conn.start(ECHO, b"h", [data], timeout=10, reply_into=memoryview(other)))
        assert bytes(payload) == data.tobytes() and not other.any()
