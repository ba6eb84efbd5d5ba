"""Shared fixtures: real clusters on loopback.

* ``cluster`` / ``make_cluster``: a manager and servers as real gRPC servers inside the test
  process (port 0), fast to start; for RPC-level tests.
* ``LocalCluster`` (``shardps.tools.local``): the same processes as ``shardps local``, as children;
  for multi-process and chaos tests.
Every process a test starts is stopped when the test ends, passed or failed.
"""

from __future__ import annotations

import os
import time

import pytest

from shardps.server.processes import ManagerProcess, ServerProcess
from shardps.settings import ManagerProcessSettings, ServerProcessSettings, Serving


class InProcessCluster:
    """A manager and N servers in this process. ``stop()`` is idempotent."""

    def __init__(self, servers: int = 2, replication: int = 1, lease: float = 3.0,
                 manager_kw: dict | None = None, server_kw: dict | None = None,
                 server_settings: dict | None = None, serving_kw: dict | None = None,
                 manager_settings: dict | None = None):
        self.replication = replication
        self.manager_settings = manager_settings or {}
        self.lease = lease
        self.manager_kw = manager_kw or {}
        self.server_kw = server_kw or {}
        self.server_settings = server_settings or {}
        self.serving_kw = serving_kw or {}
        self.manager: ManagerProcess | None = None
        self.servers: dict[str, ServerProcess] = {}
        self.n = servers

    def start(self) -> "InProcessCluster":
        self.manager = ManagerProcess(ManagerProcessSettings(
            serving=Serving(listen="127.0.0.1:0", metrics_port=-1, **self.serving_kw), replication=self.replication,
            server_lease_seconds=self.lease, **self.manager_settings), **self.manager_kw).start()
        for i in range(self.n):
            self.add_server(f"s{i}")
        self.wait_serving(self.n)
        return self

    def add_server(self, name: str) -> ServerProcess:
        proc = ServerProcess(ServerProcessSettings(
            serving=Serving(listen="127.0.0.1:0", metrics_port=-1, **self.serving_kw), name=name,
            manager=self.manager.address, **self.server_settings), **self.server_kw).start()
        self.servers[name] = proc
        return proc

    def wait_serving(self, count: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.manager.runtime.lock:
                serving = sum(1 for s in self.manager.runtime.state.servers.values() if s.state.name == "SERVING")
            if serving >= count:
                return
            time.sleep(0.02)
        raise TimeoutError(f"{count} servers not SERVING after {timeout}s")

    @property
    def address(self) -> str:
        return self.manager.address

    def stop(self) -> None:
        for s in self.servers.values():
            s.stop()
        self.servers.clear()
        if self.manager is not None:
            self.manager.stop()
            self.manager = None


@pytest.fixture
def make_cluster():
    made: list[InProcessCluster] = []

    def make(servers: int = 2, **kw) -> InProcessCluster:
        c = InProcessCluster(servers, **kw)
        made.append(c)
        return c.start()

    yield make
    for c in made:
        c.stop()


@pytest.fixture
def cluster(make_cluster) -> InProcessCluster:
    return make_cluster(2)


@pytest.fixture
def client_factory():
    from shardps.worker.client import PSClient
    made = []

    def make(address: str, job: str = "test", **kw) -> PSClient:
        c = PSClient(address, job, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def pytest_addoption(parser):
    parser.addoption("--soak-seconds", type=float, default=0.0,
                     help="run the load test this long (make soak: 60)")


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    # gRPC honours http_proxy; loopback tests must never go through one
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "grpc_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    yield


def pytest_configure(config):
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
