"""Manager addresses: one without a port takes the manager's (7070, not gRPC's 443), a bad one
is refused naming it, and a client that cannot reach the manager says so every few seconds."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys

import pytest

from shardps.errors import InvalidArgument, Unavailable
from shardps.rpc import channels
from shardps.rpc.channels import UnreachableWarnings, manager_targets, target
from shardps.server.processes import ManagerProcess
from shardps.settings import MANAGER_PORT, ManagerProcessSettings, Serving
from tests.waiting import wait_for


@pytest.mark.parametrize("given, expected", [
    ("127.0.0.1", ["127.0.0.1:7070"]),
    ("127.0.0.1:7071", ["127.0.0.1:7071"]),
    ("manager.example.com", ["manager.example.com:7070"]),
    ("host:", ["host:7070"]),
    ("[::1]", ["[::1]:7070"]),
    ("[::1]:9", ["[::1]:9"]),
    ("::1", ["[::1]:7070"]),                       # gRPC reads an unbracketed v6 literal as portless
    ("dns:///manager", ["dns:///manager:7070"]),
    ("dns://8.8.8.8/manager:9", ["dns://8.8.8.8/manager:9"]),
    ("unix:/run/shardps.sock", ["unix:/run/shardps.sock"]),
    (" a , b:1 ", ["a:7070", "b:1"]),              # replicas
])
def test_an_address_without_a_port_takes_the_managers(given, expected):
    assert MANAGER_PORT == 7070
    assert manager_targets(given) == expected


@pytest.mark.parametrize("given, says", [
    ("", "expected host:port"),
    ("h:abc", "port 'abc' is not a number in 1..65535"),
    ("h:70000", "port '70000'"),
    ("h:0", "port '0'"),
    ("[::1", "in brackets"),
    ("[::1]7070", "in brackets"),
    ("[nope]:1", "'nope' is not an IPv6 address"),
    ("1:2:3", "'1:2:3' is not an IPv6 address"),
    ("http://h:7070", "http:// is not a gRPC target"),
    ("h h", "expected host:port"),
    (":7070", "host '' is not a host name"),
    ("h/x:1", "host 'h/x' is not a host name"),
])
def test_a_bad_address_is_refused_naming_it(given, says):
    with pytest.raises(InvalidArgument) as err:
        manager_targets(given)
    assert f"manager address {given!r}" in err.value.message and says in err.value.message


def test_a_client_given_a_bad_address_says_which():
    from shardps.worker.client import PSClient
    with pytest.raises(InvalidArgument, match="manager address '127.0.0.1:x': port 'x'"):
        PSClient("127.0.0.1:x", "j")
    with pytest.raises(InvalidArgument, match="manager address None"):
        PSClient(None, "j")


def test_cli_commands_say_which_address_is_bad(capsys):
    from shardps.tools.cli import main
    assert main(["status", "--manager", "127.0.0.1:x"]) == 2
    assert "shardps status: manager address '127.0.0.1:x': port 'x'" in capsys.readouterr().err


def test_the_default_port_reaches_a_real_manager():
    """``target`` fills in the port it is given: a health check through it reaches a manager
    listening on a port chosen by the system."""
    mgr = ManagerProcess(ManagerProcessSettings(serving=Serving(listen="127.0.0.1:0", metrics_port=-1))).start()
    try:
        port = int(mgr.address.rsplit(":", 1)[1])
        assert channels.check_health(target("127.0.0.1", default_port=port), timeout=10) == "SERVING"
    finally:
        mgr.stop()


def _manager_on_default_port(host: str) -> ManagerProcess:
    listen = f"[{host}]:{MANAGER_PORT}" if ":" in host else f"{host}:{MANAGER_PORT}"
    try:
        return ManagerProcess(ManagerProcessSettings(serving=Serving(listen=listen, metrics_port=-1))).start()
    except (OSError, RuntimeError) as exc:  # taken (a `shardps local` running here?), or no IPv6
        pytest.skip(f"cannot listen on {listen} here: {exc}")


@pytest.mark.parametrize("host, given", [("127.0.0.1", "127.0.0.1"), ("::1", "[::1]")])
def test_a_client_given_no_port_reaches_the_manager_on_its_default_port(host, given, client_factory):
    mgr = _manager_on_default_port(host)
    try:
        client = client_factory(given, "portless", timeout=10.0)
        client.create_job()
        assert client.refresh_map().epoch >= 1
    finally:
        mgr.stop()


# ---------------------------------------------------------------- unreachable managers
class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_unreachable_warnings_come_every_few_seconds_until_the_manager_answers(caplog):
    caplog.set_level(logging.INFO, logger="shardps.rpc")
    clock = _Clock()
    w = UnreachableWarnings("the manager at h:1", every=5.0, clock=clock)
    warnings = lambda: [r for r in caplog.records if r.levelno == logging.WARNING]  # noqa: E731
    for t in (0.0, 1.0, 4.9):                       # the first failure starts the count
        clock.now = 100.0 + t
        w.failed("UNAVAILABLE: connection refused")
    assert warnings() == []
    clock.now = 105.0
    w.failed("UNAVAILABLE: connection refused")
    clock.now = 109.0
    w.failed("UNAVAILABLE: connection refused")
    clock.now = 110.0
    w.failed("UNAVAILABLE: connection refused")
    assert len(warnings()) == 2
    text = warnings()[0].getMessage()
    assert "cannot reach the manager at h:1 (for 5s; UNAVAILABLE: connection refused)" in text
    assert "--manager, SHARDPS_MANAGER; port 7070" in text and "still trying" in text
    w.answered()
    assert "reached the manager at h:1 after 10s" in caplog.records[-1].getMessage()
    clock.now = 111.0
    w.failed("UNAVAILABLE")                          # a new outage counts from its own start
    clock.now = 115.0
    w.failed("UNAVAILABLE")
    assert len(warnings()) == 2


@pytest.fixture
def refused_address():
    """An address that refuses connections: a port bound here but not listening."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.slow          # waits out leases or retry intervals: over a second
def test_a_client_that_cannot_reach_the_manager_says_so_every_few_seconds(
        refused_address, client_factory, caplog, monkeypatch):
    monkeypatch.setattr(channels, "UNREACHABLE_WARNING_SECONDS", 0.1)
    caplog.set_level(logging.WARNING)
    client = client_factory(refused_address, "unreachable", timeout=1.5)
    with pytest.raises(Unavailable):
        client.create_job()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
              and f"cannot reach the manager at {refused_address}" in r.getMessage()]
    assert len(warned) >= 2, caplog.text
    assert "UNAVAILABLE" in warned[0] and "--manager" in warned[0]


@pytest.mark.slow          # a process (shardps worker)
def test_a_worker_that_cannot_reach_the_manager_says_so(refused_address, tmp_path):
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "shardps.tools.cli", "worker", "--manager", refused_address,
                                 "--job", "j"], stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        wait_for("the worker's warning", lambda: f"cannot reach the manager at {refused_address}"
                 in log_path.read_text(), timeout=90, interval=0.2)
        assert proc.poll() is None, log_path.read_text()         # still trying
    finally:
        proc.kill()
        proc.wait()


def test_a_servers_address_or_an_http_port_given_as_the_managers_is_named_at_once(cluster, client_factory):
    import http.server
    import threading
    import time
    httpd = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)   # a metrics port
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        server = next(iter(cluster.servers.values())).address
        for address, says in ((server, "answers gRPC but does not serve CreateJob: it is another kind of process "
                                       "(a server's address given as the manager's"),
                              (f"127.0.0.1:{httpd.server_port}", "answers HTTP/1, not gRPC: a metrics port")):
            started = time.monotonic()
            with pytest.raises(InvalidArgument, match=r"the manager at 127\.0\.0\.1:\d+ " + says.replace("(", r"\(")):
                client_factory(address, "wrong", timeout=20).create_job()
            assert time.monotonic() - started < 5           # not 20 s of retries
    finally:
        httpd.shutdown()
        httpd.server_close()
