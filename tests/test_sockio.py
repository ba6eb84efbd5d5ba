"""Frame I/O on one socket (``frames.FrameReader``, ``frames.send_parts``), through the compiled
calls of ``shardps.rpc.sockio`` and through Python's socket calls: the same frames, the same
errors, on real socket pairs."""

from __future__ import annotations

import signal
import socket
import threading
import time

import numpy as np
import pytest

from shardps.rpc import frames, sockio

MODES = [pytest.param(True, id="compiled", marks=pytest.mark.skipif(not sockio.AVAILABLE, reason="no numba")),
         pytest.param(False, id="python")]


def frame(header: bytes, payload: bytes, flags: int = frames.FLAG_REPLY, request_id: int = 7) -> bytes:
    return frames.pack_prefix(flags, 5, 0, request_id, 0, 0, len(header), len(payload)) + header + payload


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def timer_of(sock: socket.socket, native: bool) -> frames.SocketTimer:
    timer = frames.SocketTimer(sock, tls=False)
    timer.native = native
    return timer


def send_later(sock: socket.socket, chunks: list[bytes], pause: float = 0.0, close: bool = False) -> threading.Thread:
    """Send ``chunks`` from a thread, ``pause`` seconds before each; then close when asked."""
    def run():
        for chunk in chunks:
            time.sleep(pause)
            sock.sendall(chunk)
        if close:
            sock.shutdown(socket.SHUT_WR)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("native", MODES)
@pytest.mark.parametrize("size", [0, 100, 70_000, 3 << 20], ids=["0B", "100B", "70KB", "3MiB"])
def test_frames_of_every_size_are_read_whole_in_pieces_too(pair, native, size):
    a, b = pair
    payload = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8).tobytes()
    raw = frame(b"head", payload)
    reader = frames.FrameReader(initial=4096)
    for chunks in ([raw], [raw[:10], raw[10:45], raw[45:]]):        # whole, and split inside the prefix
        thread = send_later(b, chunks, 0.01 if len(chunks) > 1 else 0.0)
        got = reader.read_frame(timer_of(a, native), 8 << 20, time.monotonic() + 10)
        thread.join()
        assert (bytes(got.header), bytes(got.payload), got.prefix.request_id) == (b"head", payload, 7)


@pytest.mark.parametrize("native", MODES)
def test_a_payload_of_the_expected_length_lands_in_the_callers_buffer(pair, native):
    a, b = pair
    payload = bytes(range(256)) * 400                     # larger than the reader's first read
    into = bytearray(len(payload))
    thread = send_later(b, [frame(b"h" * 100, payload)])
    got = frames.FrameReader(initial=4096).read_frame(timer_of(a, native), 1 << 20, time.monotonic() + 10,
                                                      into=memoryview(into))
    thread.join()
    assert bytes(got.header) == b"h" * 100 and bytes(into) == payload and got.payload.obj is into
    other = bytearray(10)                                 # another length: the reader's own buffer
    thread = send_later(b, [frame(b"", payload)])
    got = frames.FrameReader().read_frame(timer_of(a, native), 1 << 20, time.monotonic() + 10,
                                          into=memoryview(other))
    thread.join()
    assert bytes(got.payload) == payload and other == bytearray(10)


@pytest.mark.parametrize("native", MODES)
def test_a_peer_closing_between_frames_or_inside_one_is_told_apart(pair, native):
    a, b = pair
    reader = frames.FrameReader()
    raw = frame(b"head", b"x" * 1000)
    send_later(b, [raw[:20]], close=True).join()
    with pytest.raises(frames.ProtocolError, match="inside a frame prefix"):
        reader.read_frame(timer_of(a, native), 1 << 20, time.monotonic() + 10)
    c, d = socket.socketpair()
    with c, d:
        send_later(d, [raw[:500]], close=True).join()
        with pytest.raises(frames.ProtocolError, match="inside a frame"):
            reader.read_frame(timer_of(c, native), 1 << 20, time.monotonic() + 10)
    e, f = socket.socketpair()
    with e, f:
        f.shutdown(socket.SHUT_WR)
        with pytest.raises(frames.PeerClosed):
            reader.read_frame(timer_of(e, native), 1 << 20, time.monotonic() + 10)


@pytest.mark.parametrize("native", MODES)
def test_bad_prefixes_oversized_and_trailing_frames_are_refused(pair, native):
    a, b = pair
    reader = frames.FrameReader()
    b.sendall(b"XX" + frame(b"", b"")[2:])
    with pytest.raises(frames.ProtocolError, match="magic"):
        reader.read_frame(timer_of(a, native), 1 << 20, time.monotonic() + 10)
    c, d = socket.socketpair()
    with c, d:
        d.sendall(frame(b"", b"y" * 2000))
        with pytest.raises(frames.FrameTooLarge) as err:
            reader.read_frame(timer_of(c, native), 1000, time.monotonic() + 10)
        assert err.value.prefix.payload_len == 2000 and err.value.already >= frames.PREFIX_BYTES
    e, f = socket.socketpair()
    with e, f:
        f.sendall(frame(b"", b"z") + b"more")
        time.sleep(0.05)                                  # both arrive before the read
        with pytest.raises(frames.ProtocolError, match="followed a frame"):
            reader.read_frame(timer_of(e, native), 1 << 20, time.monotonic() + 10)


@pytest.mark.parametrize("native", MODES)
def test_the_deadline_ends_a_wait_and_an_idle_wait_lasts_to_its_own_deadline(pair, native):
    a, b = pair
    reader = frames.FrameReader()
    started = time.monotonic()
    with pytest.raises(socket.timeout):
        reader.read_frame(timer_of(a, native), 1 << 20, started + 0.2)
    assert 0.15 < time.monotonic() - started < 2.0
    # idle between frames: windows of 0.1 s until 5 s; the frame comes after 0.4 s
    thread = send_later(b, [frame(b"late", b"")], pause=0.4)
    now = time.monotonic()
    got = reader.read_frame(timer_of(a, native), 1 << 20, now + 0.1, first_deadline=now + 5)
    thread.join()
    assert bytes(got.header) == b"late"
    # a frame begun but not finished within its window times out
    send_later(b, [frame(b"h", b"p" * 100)[:50]]).join()
    now = time.monotonic()
    with pytest.raises(socket.timeout):
        reader.read_frame(timer_of(a, native), 1 << 20, now + 0.2, first_deadline=now + 5)
    assert time.monotonic() - now < 2.0


@pytest.mark.parametrize("native", MODES)
def test_send_parts_sends_small_and_large_frames_and_times_out_on_a_full_socket(pair, native):
    a, b = pair
    parts = [frame(b"h", b""), memoryview(np.arange(100_000, dtype=np.uint8)).cast("B"), b"tail"]
    received = bytearray()

    def drain(n: int):
        while len(received) < n:
            received.extend(b.recv(1 << 20))
    total = sum(len(p) for p in parts)
    reader = threading.Thread(target=drain, args=(total + 3,), daemon=True)
    reader.start()
    frames.send_parts(timer_of(a, native), list(parts), time.monotonic() + 10)
    frames.send_parts(timer_of(a, native), [b"abc"], time.monotonic() + 10)
    reader.join(10)
    assert bytes(received) == b"".join(bytes(p) for p in parts) + b"abc"
    with pytest.raises(socket.timeout):                   # nobody reads: the socket's buffers fill up
        frames.send_parts(timer_of(a, native), [bytes(64 << 20)], time.monotonic() + 0.3)


def test_many_parts_sent_in_pieces_arrive_whole_and_in_order(pair):
    """More parts than one ``sendmsg`` takes (IOV_MAX), two larger than the socket's buffer,
    to a reader that drains slowly: each later ``sendmsg`` goes on from where the last stopped."""
    a, b = pair
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
    rng = np.random.default_rng(5)
    parts = [rng.integers(0, 255, int(n), dtype=np.uint8).tobytes() for n in rng.integers(1, 40, 3000)]
    parts[10:10] = [bytes(range(256)) * 2048, b"x" * 300_000]
    received = bytearray()
    total = sum(map(len, parts))

    def drain():
        while len(received) < total:
            time.sleep(0.001)
            received.extend(b.recv(1 << 15))
    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    frames.send_parts(timer_of(a, False), list(parts), time.monotonic() + 30)
    reader.join(30)
    assert bytes(received) == b"".join(parts)


@pytest.mark.parametrize("native", MODES)
def test_sending_to_a_closed_peer_raises_oserror(pair, native):
    a, b = pair
    b.close()
    with pytest.raises(OSError) as err:
        frames.send_parts(timer_of(a, native), [b"x" * 100], time.monotonic() + 5)
    assert not isinstance(err.value, socket.timeout)


@pytest.mark.skipif(not sockio.AVAILABLE, reason="no numba")
def test_a_compiled_wait_leaves_the_interpreter_to_other_threads(pair):
    """While a read waits for its frame in compiled code, a pure-Python thread keeps running."""
    a, b = pair
    counted = [0]
    stop = threading.Event()

    def count():
        while not stop.is_set():
            counted[0] += 1
    counter = threading.Thread(target=count, daemon=True)
    thread = send_later(b, [frame(b"h", b"")], pause=0.3)
    counter.start()
    time.sleep(0.05)
    before = counted[0]
    frames.FrameReader().read_frame(timer_of(a, True), 1 << 20, time.monotonic() + 10)
    during = counted[0] - before
    stop.set()
    counter.join()
    thread.join()
    assert during > 10_000


class _Alarm(Exception):
    pass


@pytest.fixture
def alarm():
    """A SIGALRM in 0.2 s whose handler raises ``_Alarm`` (in the main thread, as Ctrl-C would)."""
    def handler(signum, frame):
        raise _Alarm()
    previous = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 0.2)
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("native", MODES)
def test_a_signal_interrupts_a_wait_for_a_frame(pair, native, alarm):
    a, _ = pair
    started = time.monotonic()
    with pytest.raises(_Alarm):
        frames.FrameReader().read_frame(timer_of(a, native), 1 << 20, started + 10)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("native", MODES)
def test_a_signal_interrupts_a_send_to_a_full_socket(pair, native, alarm):
    a, _ = pair
    started = time.monotonic()
    with pytest.raises(_Alarm):
        frames.send_parts(timer_of(a, native), [bytes(64 << 20)], started + 10)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("native", MODES)
def test_a_frame_interrupted_by_signals_is_read_whole(pair, native):
    """A signal whose handler returns: the read goes on where it was (into the caller's
    buffer too)."""
    a, b = pair
    payload = bytes(range(256)) * 1000
    raw = frame(b"head", payload)
    ticks = []
    previous = signal.signal(signal.SIGALRM, lambda *_: ticks.append(1))
    signal.setitimer(signal.ITIMER_REAL, 0.02, 0.02)
    try:
        thread = send_later(b, [raw[i:i + 20_000] for i in range(0, len(raw), 20_000)], pause=0.03)
        into = bytearray(len(payload))
        got = frames.FrameReader(initial=4096).read_frame(timer_of(a, native), 1 << 20, time.monotonic() + 20,
                                                          into=memoryview(into))
        thread.join()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert bytes(got.header) == b"head" and bytes(into) == payload and len(ticks) > 3


@pytest.mark.parametrize("server_compiled, client_compiled", [(True, True), (True, False), (False, True)])
def test_both_ways_of_framing_speak_the_same_wire(server_compiled, client_compiled):
    """A data-plane server and client, each reading and sending frames by ``sockio`` or by
    Python's socket calls (``compiled_io``), answer each other: small and large payloads."""
    from shardps.rpc.dataplane import DataPlaneConnection, DataPlaneServer
    server = DataPlaneServer(lambda method, header, payload, call: (header, [bytes(payload)]),
                             compiled_io=server_compiled).start()
    try:
        with DataPlaneConnection(f"127.0.0.1:{server.port}", compiled_io=client_compiled) as conn:
            for size in (0, 100, 3 << 20):
                payload = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
                head, got = conn.call(100, b"h" * 7, [payload], timeout=30)
                assert head == b"h" * 7 and bytes(got) == payload.tobytes()
    finally:
        server.stop()
