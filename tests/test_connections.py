"""Connections between real processes: keepalive agreement between clients and servers, and
calls that honour their deadline when the peer is slow to accept or not there at all."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from shardps.errors import DeadlineExceeded, PermissionDenied, Unavailable
from shardps.rpc import channels
from shardps.rpc.status import from_rpc_error
from tests.waiting import wait_for

# ---------------------------------------------------------------------------- keepalive

# The child runs a server with the production SERVER_OPTIONS and a channel with the production
# CLIENT_OPTIONS, every keepalive interval scaled by the same factor (their ratio is what
# matters), makes one call, idles until the parent says "call", then calls again. gRPC traces
# every ping the server receives (http_keepalive) and logs a GOAWAY "too_many_pings" on stderr.
_KEEPALIVE_CHILD = r"""
import json, sys, time
from concurrent import futures
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from shardps.rpc import channels

scale = float(sys.argv[1])
TIMES = {"grpc.keepalive_time_ms", "grpc.keepalive_timeout_ms",
         "grpc.http2.min_ping_interval_without_data_ms",
         "grpc.http2.min_recv_ping_interval_without_data_ms",
         "grpc.http2.min_time_between_pings_ms"}

def scaled(options):
    return [(k, max(1, int(v * scale)) if k in TIMES else v) for k, v in options]

server = grpc.server(futures.ThreadPoolExecutor(2), options=scaled(channels.SERVER_OPTIONS))
servicer = channels.add_health_and_reflection(server, [])
channels.set_serving(servicer, [], True)
port = server.add_insecure_port("127.0.0.1:0")
server.start()
states = []
ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=scaled(channels.CLIENT_OPTIONS))
ch.subscribe(lambda s: states.append(s.name))
stub = health_pb2_grpc.HealthStub(ch)
try:
    stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
    print("idle", flush=True)
    sys.stdin.readline()
    idle_states = list(states)
    status = stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status
    print(json.dumps({"status": status, "idle_states": idle_states}), flush=True)
finally:
    ch.close()
    server.stop(0)
"""


@pytest.mark.slow          # a process, ~7 s
def test_idle_clients_keep_their_connections(tmp_path):
    """A client idle for many keepalive periods is not sent GOAWAY "too_many_pings" (the
    server allows pings twice as often as clients send them), and its next call works."""
    scale, periods = 0.1, 8            # production intervals / 10: a ping every second
    log_path = tmp_path / "grpc.log"
    env = dict(os.environ, GRPC_VERBOSITY="INFO", GRPC_TRACE="http_keepalive")
    with open(log_path, "wb") as log:
        child = subprocess.Popen([sys.executable, "-c", _KEEPALIVE_CHILD, str(scale)], env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                 cwd=str(Path(__file__).resolve().parents[1]))
    try:
        assert child.stdout.readline().strip() == "idle", Path(log_path).read_text()[-3000:]

        def idled_or_cut_off():
            text = log_path.read_text(errors="replace")
            pings = sum(1 for line in text.splitlines() if "SERVER[" in line and "received ping" in line)
            return pings >= periods or "too_many_pings" in text

        wait_for(f"{periods} keepalive pings", idled_or_cut_off, timeout=60, interval=0.1)
        out, _ = child.communicate("call\n", timeout=30)
        text = log_path.read_text(errors="replace")
        assert child.returncode == 0, text[-3000:]
        result = json.loads(out.strip().splitlines()[-1])
        goaways = [line for line in text.splitlines() if "GOAWAY" in line or "too_many_pings" in line]
        assert not goaways, "\n".join(goaways)
        assert result["status"] == 1                                   # SERVING
        # connected once and stayed connected while idle
        assert result["idle_states"][-1] == "READY" and "TRANSIENT_FAILURE" not in result["idle_states"]
        assert result["idle_states"].count("READY") == 1, result["idle_states"]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


# ---------------------------------------------------------------------------- deadlines

@pytest.fixture(scope="module")
def manager_process():
    """A manager as a child process (``shardps manager``), resumed and stopped at the end."""
    from shardps.tools.local import LocalCluster
    cluster = LocalCluster(servers=0)
    try:
        cluster.start()
        yield cluster.manager
    finally:
        if cluster.manager is not None and cluster.manager.alive:
            os.kill(cluster.manager.popen.pid, signal.SIGCONT)
        cluster.stop()
        cluster.cleanup()


def _client(address: str):
    from shardps.worker.client import PSClient
    return PSClient(address, "slow", timeout=10.0)


def _join(address: str):
    with _client(address) as c:
        return c.join(heartbeat=False)


def _status(address: str):
    with _client(address) as c:
        return c.cluster_status()


# Each call opens its own channel, and closes it, so that it has to connect while the manager
# is paused (channels with the same options to the same address share one connection).
SLOW_CALLS = {
    "health check": lambda address: channels.check_health(address, timeout=10.0),
    "GetClusterStatus (idempotent: retried)": _status,
    "JoinWorkerGroup (sent once)": _join,
}


@pytest.mark.slow          # a manager process (LocalCluster)
@pytest.mark.parametrize("what", sorted(SLOW_CALLS))
def test_calls_wait_for_a_manager_that_is_slow_to_accept(manager_process, what):
    """The manager is paused for 1 s (SIGSTOP) when a client connects: the call waits for it
    and succeeds within its 10 s deadline."""
    pid, address = manager_process.popen.pid, manager_process.address
    with _client(address) as c:
        c.create_job()
    os.kill(pid, signal.SIGSTOP)
    timer = threading.Timer(1.0, os.kill, (pid, signal.SIGCONT))
    timer.start()
    started = time.monotonic()
    try:
        result = SLOW_CALLS[what](address)
    finally:
        timer.cancel()
        os.kill(pid, signal.SIGCONT)
    took = time.monotonic() - started
    assert result
    assert 0.9 <= took < 9.0, f"{what} took {took:.2f}s"


def _port_nobody_listens_on() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow          # ~6 s of deadlines
def test_calls_to_an_absent_manager_fail_at_their_deadline_with_advice(client_factory):
    """Nobody listens: idempotent calls are retried until the deadline, then fail with
    UNAVAILABLE and advice; a non-idempotent call waits for a connection until the deadline."""
    address = f"127.0.0.1:{_port_nobody_listens_on()}"
    c = client_factory(address, job="absent", timeout=2.0)
    started = time.monotonic()
    with pytest.raises(Unavailable, match="reachable") as err:
        c.cluster_status()
    took = time.monotonic() - started
    assert 1.9 <= took < 4.0, f"failed after {took:.2f}s: {err.value}"
    assert "attempts in 2s" in str(err.value)

    started = time.monotonic()
    with pytest.raises(Unavailable) as health_err:
        channels.check_health(address, timeout=2.0)
    took = time.monotonic() - started
    assert health_err.value.status == "UNAVAILABLE" and 1.9 <= took < 4.0, took

    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="reachable"):
        c.join(heartbeat=False)
    took = time.monotonic() - started
    assert 1.9 <= took < 4.0, took


class _Failed(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code


def _failed(code):
    """The error an attempt raises for a call that failed with ``code`` (``status.translated``)."""
    return from_rpc_error(_Failed(code), "call")


def test_retries_back_off_and_stop_at_the_deadline():
    """call_with_retries on a fake clock: jittered doubling pauses, capped; the last
    UNAVAILABLE is raised when the deadline leaves no time; other codes (CANCELLED, which
    also reads as Unavailable, among them) are not retried."""
    now = [0.0]
    pauses = []

    def sleep(s):
        pauses.append(round(s, 3))
        now[0] += s

    def attempt(left):
        now[0] += 0.01
        raise _failed(grpc.StatusCode.UNAVAILABLE)

    with pytest.raises(Unavailable) as err:
        channels.call_with_retries(attempt, 3.0, clock=lambda: now[0], sleep=sleep, jitter=lambda: 0.5)
    assert err.value.status == "UNAVAILABLE"
    assert pauses[:6] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0]
    assert 3.0 - 0.005 <= now[0] <= 3.0 + 0.011

    for code, cls in ((grpc.StatusCode.PERMISSION_DENIED, PermissionDenied),
                      (grpc.StatusCode.CANCELLED, Unavailable)):
        calls = []

        def refused(left, calls=calls, code=code):
            calls.append(left)
            raise _failed(code)

        with pytest.raises(cls):
            channels.call_with_retries(refused, 3.0, clock=lambda: now[0], sleep=sleep)
        assert len(calls) == 1, code

    answers = iter([_failed(grpc.StatusCode.UNAVAILABLE), "ok"])

    def flaky(left):
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    assert channels.call_with_retries(flaky, 3.0, clock=lambda: now[0], sleep=sleep) == "ok"

    calls.clear()

    def unavailable(left):
        calls.append(left)
        raise _failed(grpc.StatusCode.UNAVAILABLE)

    with pytest.raises(Unavailable):               # a sleep returning True: the caller closes
        channels.call_with_retries(unavailable, 3.0, clock=lambda: now[0], sleep=lambda s: True)
    assert len(calls) == 1


def test_closing_a_client_ends_its_retries():
    from shardps.worker.client import PSClient
    c = PSClient(f"127.0.0.1:{_port_nobody_listens_on()}", "absent", timeout=30.0)
    outcome = {}

    def status():
        started = time.monotonic()
        try:
            c.cluster_status()
        except Unavailable as exc:
            outcome["error"] = exc
        outcome["took"] = time.monotonic() - started

    attempts = []
    real = c._manager.GetClusterStatus

    def counted(*args, **kw):
        attempts.append(time.monotonic())
        return real(*args, **kw)

    c._manager.GetClusterStatus = counted
    caller = threading.Thread(target=status)
    try:
        caller.start()
        wait_for("a second attempt", lambda: len(attempts) >= 2, timeout=10, interval=0.02)
    finally:
        c.close()
        caller.join(timeout=10)
    assert not caller.is_alive() and "error" in outcome and outcome["took"] < 5.0, outcome
