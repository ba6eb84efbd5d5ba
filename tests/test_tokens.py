"""Job-token lifecycle: expiry, revocation (`shardps job revoke`), key rotation without a
restart. The plain classes (``shardps.server.tokens``) first, then real gRPC servers on
loopback, each server with its own authenticator (so each must learn revocations itself)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from shardps.errors import InvalidArgument, Unauthenticated
from shardps.protos.v1 import manager_pb2 as mg
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.rpc import channels
from shardps.server import tokens
from shardps.server.auth import MANAGER_ADMIN, SERVER_ADMIN, Authenticator, issue_job_token
from shardps.tables import sgd

ADMIN = "admin-secret-0123456789"
KEY = b"token-key-for-tests"
ADMIN_MD = (("authorization", f"Bearer {ADMIN}"),)


# ---------------------------------------------------------------------- the plain classes

def test_a_token_names_its_job_key_generation_and_expiry():
    ring = tokens.KeyRing([KEY])
    token, expires = tokens.issue(ring, "team.a", generation=7, ttl_seconds=60, now=1_000_000)
    claims = tokens.parse(ring, token)
    assert (claims.job, claims.key_id, claims.generation, claims.issued, claims.expires) == \
        ("team.a", tokens.key_id(KEY), 7, 1_000_000, 1_000_060)
    assert expires == 1_000_060
    clock = [1_000_059.0]
    verifier = tokens.TokenVerifier(ring, clock=lambda: clock[0])
    assert verifier.verify(token).job == "team.a"
    clock[0] = 1_000_060.0
    with pytest.raises(Unauthenticated, match=r"expired at 1970-01-12T13:47:40\+00:00"):
        verifier.verify(token)


def test_forged_tampered_and_foreign_tokens_are_not_signed():
    ring = tokens.KeyRing([KEY])
    token, _ = tokens.issue(ring, "a", 1, 60)
    job, claims, mac = token.rsplit(".", 2)
    kid, gen, issued, expires, nonce = claims.split("-")
    longer = f"{job}.{kid}-{gen}-{issued}-{int(expires) + 10**6}-{nonce}.{mac}"
    other_job = f"b.{claims}.{mac}"
    foreign, _ = tokens.issue(tokens.KeyRing([b"another-clusters-key"]), "a", 1, 60)
    for bad in (longer, other_job, "a.x.AAAA", "garbage", ""):
        with pytest.raises(Unauthenticated, match="not signed"):
            tokens.TokenVerifier(ring).verify(bad)
    with pytest.raises(Unauthenticated, match="not among the keys"):
        tokens.TokenVerifier(ring).verify(foreign)


def test_floors_only_rise_and_refuse_lower_generations():
    floors = tokens.Revocations()
    verifier = tokens.TokenVerifier(tokens.KeyRing([KEY]), floors)
    old, _ = tokens.issue(verifier.keys, "a", 3, 60)
    new, _ = tokens.issue(verifier.keys, "a", 5, 60)
    claims = verifier.verify(old)
    floors.raise_floors({"a": 5})
    floors.raise_floors({"a": 4})               # lower: ignored
    assert floors.floor("a") == 5 and floors.floor("b") == 0
    with pytest.raises(Unauthenticated, match=r"revoked \(generation 3, the job accepts 5"):
        verifier.check_current(claims)
    assert verifier.verify(new).generation == 5


def test_ttls_outside_their_range_are_refused():
    assert tokens.check_ttl(0, 100.0) == 100.0
    for bad in (-1.0, float("nan"), float("inf"), 1e12):
        with pytest.raises(InvalidArgument, match="token_ttl_seconds"):
            tokens.check_ttl(bad)


def test_a_key_file_is_read_again_when_it_changes(tmp_path):
    path = tmp_path / "keys"
    path.write_bytes(b"first-key-0123456789\n")
    now = [0.0]
    keys = tokens.KeyFile(path, interval=1.0, clock=lambda: now[0])
    first = keys.ring().signing_id
    _replace(path, b"# the new key signs; the old one still verifies\nsecond-key-0123456789\nfirst-key-0123456789\n")
    assert keys.ring().signing_id == first          # not checked again within the interval
    now[0] = 2.0
    ring = keys.ring()
    assert ring.signing_id == tokens.key_id(b"second-key-0123456789") and first in ring.by_id
    _replace(path, b"\n")                           # a file without a key: keep the ring in use
    now[0] = 4.0
    assert keys.ring().signing_id == ring.signing_id
    with pytest.raises(ValueError, match="holds no key"):
        tokens.KeyFile(path)


def _replace(path: Path, data: bytes) -> None:
    """Write ``path`` as an operator (or a Kubernetes Secret update) would: atomically."""
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# ---------------------------------------------------------------------- real servers

def _secure_cluster(make_cluster, servers: int = 2, key=KEY, serving_kw=None):
    """A manager and ``servers`` servers with the admin token and job tokens on; every
    process has its own Authenticator (its own keys and revocation floors)."""
    serving = {"admin_token": ADMIN, **(serving_kw or {"token_key": key.decode()})}

    def authn(admin_methods):
        source = tokens.KeyFile(serving["token_key_file"], interval=0.1) if "token_key_file" in serving \
            else key
        return Authenticator(ADMIN, source, admin_methods)
    cluster = make_cluster(0, serving_kw=serving,
                           manager_kw={"authenticate": authn(MANAGER_ADMIN), "metadata": ADMIN_MD})
    for i in range(servers):
        cluster.server_kw = {"authenticate": authn(SERVER_ADMIN), "metadata": ADMIN_MD}
        cluster.add_server(f"s{i}")
    cluster.wait_serving(servers)
    return cluster


def _code(fn) -> tuple[str, str]:
    try:
        fn()
        return "OK", ""
    except grpc.RpcError as err:
        return err.code().name, err.details() or ""


def _on_manager(cluster, token: str) -> tuple[str, str]:
    with channels.channel(cluster.address) as ch:
        rpc = ch.unary_unary("/shardps.v1.ResourceManager/ListTables",
                             request_serializer=mg.ListTablesRequest.SerializeToString,
                             response_deserializer=mg.ListTablesResponse.FromString)
        return _code(lambda: rpc(mg.ListTablesRequest(job=_job_of(token)), timeout=5,
                                 metadata=(("authorization", f"Bearer {token}"),)))


def _on_server(server, token: str) -> tuple[str, str]:
    with channels.channel(server.address) as ch:
        rpc = ch.unary_unary("/shardps.v1.ParameterServer/GetNodeStatus",
                             request_serializer=ps.GetNodeStatusRequest.SerializeToString,
                             response_deserializer=ps.NodeStatus.FromString)
        return _code(lambda: rpc(ps.GetNodeStatusRequest(), timeout=5,
                                 metadata=(("authorization", f"Bearer {token}"),)))


def _job_of(token: str) -> str:
    return token.rsplit(".", 2)[0]


def _wait(condition, timeout: float, what: str) -> float:
    """Seconds until ``condition()`` holds (polled); AssertionError naming ``what`` after
    ``timeout``."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.02)
    return time.monotonic() - started


@pytest.mark.slow          # waits out leases or retry intervals: over a second
def test_an_expired_token_is_refused_with_unauthenticated_naming_the_expiry(make_cluster, client_factory):
    cluster = _secure_cluster(make_cluster)
    admin = client_factory(cluster.address, job="team-a", token=ADMIN)
    live = admin.create_job()
    generation = tokens.parse(tokens.KeyRing([KEY]), live).generation
    expired = issue_job_token(KEY, "team-a", generation, ttl_seconds=60, now=time.time() - 120)
    expiry = tokens.when(tokens.parse(tokens.KeyRing([KEY]), expired).expires)
    assert _on_manager(cluster, live)[0] == "OK"
    code, details = _on_manager(cluster, expired)
    assert code == "UNAUTHENTICATED" and f"expired at {expiry}" in details, details
    for server in cluster.servers.values():
        code, details = _on_server(server, expired)
        assert code == "UNAUTHENTICATED" and f"expired at {expiry}" in details, details
        assert _on_server(server, live)[0] == "OK"
    # a token that expires while its data-plane connection stays open: refused there too
    short = admin.create_job(token_ttl_seconds=2)          # PSClient asks for a lifetime
    expires = tokens.parse(tokens.KeyRing([KEY]), short).expires
    assert 0 < expires - time.time() <= 2.5
    a = client_factory(cluster.address, job="team-a", token=short)
    a.create_dense("w", (8,), optimizer=sgd(1.0))
    a.push_dense("w", np.ones(8, np.float32))
    _wait(lambda: time.time() >= expires, 5, "the short token's expiry")
    with pytest.raises(Unauthenticated, match="expired at"):
        a.pull_dense("w")
    np.testing.assert_array_equal(client_factory(cluster.address, job="team-a", token=live).pull_dense("w"),
                                  -np.ones(8))


def test_revoke_refuses_old_tokens_on_the_manager_at_once_and_on_every_server_within_seconds(
        make_cluster, client_factory, capsys, tmp_path):
    from shardps.tools.cli import main
    cluster = _secure_cluster(make_cluster, servers=3)
    old = client_factory(cluster.address, job="team-a", token=ADMIN).create_job()
    other = client_factory(cluster.address, job="team-b", token=ADMIN).create_job()
    a = client_factory(cluster.address, job="team-a", token=old)
    a.create_dense("w", (64,), optimizer=sgd(1.0))     # blocks on every server
    a.push_dense("w", np.ones(64, np.float32))                       # data-plane connections now open
    assert all(_on_server(s, old)[0] == "OK" for s in cluster.servers.values())

    assert main(["job", "revoke", "team-a", "--manager", cluster.address, "--token", ADMIN,
                 "--token-out", str(tmp_path / "token")]) == 0
    revoked_at = time.monotonic()
    assert "tokens revoked" in capsys.readouterr().out
    new = (tmp_path / "token").read_text()
    code, details = _on_manager(cluster, old)            # the manager: at once
    assert code == "UNAUTHENTICATED" and "revoked" in details, details
    waits = {name: _wait(lambda s=s: _on_server(s, old)[0] == "UNAUTHENTICATED", 5.0,
                         f"server {name} refusing the revoked token")
             for name, s in cluster.servers.items()}
    with capsys.disabled():
        print(f"\nrevocation seen by every server {time.monotonic() - revoked_at:.2f} s after the "
              f"revoke; per server (polled one after the other): "
              f"{ {n: round(w, 2) for n, w in waits.items()} }")
    with pytest.raises(Unauthenticated, match="revoked"):
        a.pull_dense("w")                                  # its open data-plane connection too
    fresh = client_factory(cluster.address, job="team-a", token=new)
    np.testing.assert_array_equal(fresh.pull_dense("w"), -np.ones(64))
    fresh.push_dense("w", np.ones(64, np.float32))
    assert _on_manager(cluster, other)[0] == "OK"          # another job's tokens: untouched
    assert all(_on_server(s, other)[0] == "OK" for s in cluster.servers.values())
    # a job ended and created again under its name does not accept the old job's tokens
    client_factory(cluster.address, job="team-a", token=ADMIN).end_job()
    client_factory(cluster.address, job="team-a", token=ADMIN).create_job()
    assert _on_manager(cluster, new)[0] == "UNAUTHENTICATED"
    # a job token cannot revoke (its own or another job's tokens)
    assert main(["job", "revoke", "team-b", "--manager", cluster.address, "--token", other]) == 2
    assert "admin operation" in capsys.readouterr().err


def test_the_signing_key_rotates_without_a_restart(make_cluster, client_factory, tmp_path):
    keys = tmp_path / "token-keys"
    k1, k2 = b"first-signing-key-0123", b"second-signing-key-0123"
    keys.write_bytes(k1 + b"\n")
    cluster = _secure_cluster(make_cluster, serving_kw={"token_key_file": str(keys)})
    admin = client_factory(cluster.address, job="team-a", token=ADMIN)
    t1 = admin.create_job()
    assert tokens.parse(tokens.KeyRing([k1]), t1)           # signed with k1
    a = client_factory(cluster.address, job="team-a", token=t1)
    a.create_dense("w", (16,), optimizer=sgd(1.0))

    _replace(keys, k2 + b"\n" + k1 + b"\n")                 # k2 signs, k1 still verifies
    kid2 = tokens.key_id(k2)
    _wait(lambda: admin.create_job().split(".")[-2].startswith(kid2 + "-"), 5, "the manager signing with k2")
    t2 = admin.create_job()
    for server in cluster.servers.values():
        _wait(lambda s=server: _on_server(s, t2)[0] == "OK", 5, f"{server.name} accepting k2")
        assert _on_server(server, t1)[0] == "OK"
    assert _on_manager(cluster, t1)[0] == "OK"
    a.push_dense("w", np.ones(16, np.float32))                          # k1's token, still on the data plane

    _replace(keys, k2 + b"\n")                              # k1 retired
    _wait(lambda: _on_manager(cluster, t1)[0] == "UNAUTHENTICATED", 5, "the manager retiring k1")
    for server in cluster.servers.values():
        _wait(lambda s=server: _on_server(s, t1)[0] == "UNAUTHENTICATED", 5, f"{server.name} retiring k1")
        assert _on_server(server, t2)[0] == "OK"
    code, details = _on_manager(cluster, t1)
    assert "not among the keys this cluster accepts" in details, details
    with pytest.raises(Unauthenticated, match="retired"):
        a.push_dense("w", np.ones(16, np.float32))                      # cached on its connection: refused
    b = client_factory(cluster.address, job="team-a", token=t2)
    np.testing.assert_array_equal(b.pull_dense("w"), -np.ones(16))
