"""Mutual TLS on every gRPC service, with certificates from `shardps dev-certs`."""

import numpy as np
import pytest

from shardps.errors import InvalidArgument, Unavailable
from shardps.rpc.channels import TlsConfig, check_health
from shardps.tables import sgd
from shardps.tools.devcerts import make_dev_certs


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_dev_certs(tmp_path_factory.mktemp("certs"))


def tls(certs, role):
    if role == "server":
        return TlsConfig.from_files(str(certs["server_cert"]), str(certs["server_key"]), str(certs["ca"]),
                                    require_client_cert=True)
    return TlsConfig.from_files(str(certs["client_cert"]), str(certs["client_key"]), str(certs["ca"]))


@pytest.mark.slow          # ~6 s
def test_mutual_tls_cluster_serves_only_clients_with_certificates(make_cluster, client_factory, certs):
    server_tls = tls(certs, "server")
    cluster = make_cluster(2, replication=2, serving_kw={"health_port": 0},
                           manager_kw={"tls": server_tls}, server_kw={"tls": server_tls})
    c = client_factory(cluster.address, tls=tls(certs, "client"))
    c.create_job()
    c.create_dense("w", (1000,), optimizer=sgd(1.0))
    c.create_sparse("e", 8, optimizer=sgd(1.0))
    c.push_dense("w", np.ones(1000, np.float32))                    # primary -> backup over mTLS too
    c.push_rows("e", [1, 2], np.ones((2, 8), np.float32))
    np.testing.assert_array_equal(c.pull_dense("w"), -np.ones(1000))
    # the data calls went over the servers' data plane, under the same certificates
    assert sum(s.data_plane.connections for s in cluster.servers.values()) > 0
    # no client certificate, or no TLS at all: refused at the handshake
    no_cert = TlsConfig.from_files(ca=str(certs["ca"]))
    with pytest.raises(Unavailable):
        client_factory(cluster.address, tls=no_cert, timeout=3).refresh_map()
    with pytest.raises(Unavailable, match="closed the connection at once: a process that requires TLS"):
        client_factory(cluster.address, timeout=3).refresh_map()
    # health stays reachable in plaintext on its own port for Kubernetes probes
    for proc in [cluster.manager, *cluster.servers.values()]:
        assert check_health(f"127.0.0.1:{proc.net.health_port}") == "SERVING"
        assert check_health(proc.address, tls=tls(certs, "client")) == "SERVING"


def test_a_tls_client_of_a_plaintext_manager_is_told_at_once(cluster, client_factory, certs):
    import time
    started = time.monotonic()
    with pytest.raises(InvalidArgument, match="does not speak TLS and this client does"):
        client_factory(cluster.address, tls=tls(certs, "client"), timeout=20).refresh_map()
    assert time.monotonic() - started < 5
