"""``shardps dev-certs``: the certificates it writes work for mutual TLS with a real gRPC server.

A gRPC server (health service only) requires client certificates from the development CA:
a client with the generated client certificate gets SERVING; a client without a certificate,
or with one from another CA, is refused during the handshake (UNAVAILABLE).
"""

from __future__ import annotations

import ipaddress
import stat

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shardps.rpc import channels
from shardps.rpc.channels import TlsConfig
from shardps.tools import devcerts

SERVICE = "shardps.test.Devcerts"


def _read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return devcerts.make_dev_certs(tmp_path_factory.mktemp("certs"), hosts=devcerts.DEFAULT_HOSTS)


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory):
    return devcerts.make_dev_certs(tmp_path_factory.mktemp("other"), hosts=devcerts.DEFAULT_HOSTS)


@pytest.fixture(scope="module")
def mtls_server(certs):
    """A real gRPC server that requires client certificates from ``certs``' CA."""
    tls = TlsConfig(cert=_read(certs["server_cert"]), key=_read(certs["server_key"]),
                    ca=_read(certs["ca"]), require_client_cert=True)
    server = channels.new_server(threads=4)
    try:
        health = channels.add_health_and_reflection(server, [SERVICE])
        port = channels.add_port(server, "127.0.0.1:0", tls)
        server.start()
        channels.set_serving(health, [SERVICE], True)
        yield port
    finally:
        server.stop(0).wait(5)


def _check(address: str, tls: TlsConfig | None) -> str:
    with channels.channel(address, tls) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=SERVICE),
                                                    timeout=10)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def _client(certs, ca_of=None, override: str = "") -> TlsConfig:
    return TlsConfig(cert=_read(certs["client_cert"]), key=_read(certs["client_key"]),
                     ca=_read((ca_of or certs)["ca"]), server_name_override=override)


def test_files_and_permissions(certs):
    assert set(certs) == set(devcerts.FILES)
    for role, path in certs.items():
        mode = stat.S_IMODE(path.stat().st_mode)
        if role.endswith("key"):
            assert mode == 0o600, f"{path} has mode {oct(mode)}"
        else:
            assert mode & 0o077 == 0o044, f"{path} has mode {oct(mode)}"


def test_certificate_contents(certs):
    ca = x509.load_pem_x509_certificate(_read(certs["ca"]))
    server = x509.load_pem_x509_certificate(_read(certs["server_cert"]))
    client = x509.load_pem_x509_certificate(_read(certs["client_cert"]))
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for leaf in (server, client):
        assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        assert leaf.issuer == ca.subject
        leaf.verify_directly_issued_by(ca)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(san.get_values_for_type(x509.DNSName)) == {
        "localhost", "manager", "s0", "s1", "s2", "shardps-manager", "shardps-server-0.shardps-server",
        "shardps-server-1.shardps-server", "shardps-server-2.shardps-server"}
    assert set(san.get_values_for_type(x509.IPAddress)) == {ipaddress.ip_address("127.0.0.1"),
                                                            ipaddress.ip_address("::1")}
    assert not any("*" in n for n in san.get_values_for_type(x509.DNSName))
    usages = server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    usages = client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usages) == [ExtendedKeyUsageOID.CLIENT_AUTH]


def test_mutual_tls_accepts_the_client_certificate(certs, mtls_server):
    assert _check(f"127.0.0.1:{mtls_server}", _client(certs)) == "SERVING"
    assert _check(f"localhost:{mtls_server}", _client(certs)) == "SERVING"


@pytest.mark.parametrize("name", ["manager", "s0", "s1", "s2", "shardps-manager", "shardps-server-2.shardps-server"])
def test_service_names_verify(certs, mtls_server, name):
    """The compose/Kubernetes service names are in the certificate (checked by the client)."""
    assert _check(f"127.0.0.1:{mtls_server}", _client(certs, override=name)) == "SERVING"


def test_a_name_outside_the_certificate_is_refused(certs, mtls_server):
    with pytest.raises(grpc.RpcError) as err:
        _check(f"127.0.0.1:{mtls_server}", _client(certs, override="elsewhere.example"))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_no_client_certificate_is_refused(certs, mtls_server):
    with pytest.raises(grpc.RpcError) as err:
        _check(f"127.0.0.1:{mtls_server}", TlsConfig(ca=_read(certs["ca"])))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_client_certificate_of_another_ca_is_refused(certs, other_ca, mtls_server):
    # the client trusts the right CA (so the server is verified) but presents a foreign cert
    with pytest.raises(grpc.RpcError) as err:
        _check(f"127.0.0.1:{mtls_server}", _client(other_ca, ca_of=certs))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_server_of_another_ca_is_not_trusted(other_ca, mtls_server):
    with pytest.raises(grpc.RpcError) as err:
        _check(f"127.0.0.1:{mtls_server}", _client(other_ca))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_plaintext_client_is_refused(mtls_server):
    with pytest.raises(grpc.RpcError) as err:
        _check(f"127.0.0.1:{mtls_server}", None)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_cli_writes_the_files_and_refuses_to_overwrite(tmp_path, capsys):
    target = tmp_path / "dev"
    assert devcerts.main([str(target), "--host", "ps.example.internal", "--host", "10.0.0.7"]) == 0
    out = capsys.readouterr().out
    assert "--tls-require-client-cert" in out and str(target / "server.pem") in out
    server = x509.load_pem_x509_certificate(_read(target / "server.pem"))
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "ps.example.internal" in san.get_values_for_type(x509.DNSName)
    assert ipaddress.ip_address("10.0.0.7") in san.get_values_for_type(x509.IPAddress)
    assert stat.S_IMODE(target.stat().st_mode) & 0o077 == 0
    before = _read(target / "ca.pem")
    assert devcerts.main([str(target)]) == 2
    assert "already exist" in capsys.readouterr().err
    assert _read(target / "ca.pem") == before
    assert devcerts.main([str(target), "--force"]) == 0
    assert _read(target / "ca.pem") != before


@pytest.mark.parametrize("host", ["*.svc.cluster.local", "host:7070", "two words", "dns/name"])
def test_bad_host_names_are_refused(tmp_path, host):
    with pytest.raises(devcerts.DevCertsError, match="host"):
        devcerts.make_dev_certs(tmp_path / "x", hosts=["localhost", host])
