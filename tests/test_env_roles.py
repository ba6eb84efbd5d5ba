"""Each role and the environment: the variables `shardps local --secure` tells clients to export
are a client's; a manager or server that finds them says so, naming the variable and the file,
instead of crashing on a FileNotFoundError or serving with a client's certificate."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from shardps.settings import Common, build
from shardps.tools.cli import build_parser
from shardps.tools.local import LocalCluster, Secured


@pytest.fixture
def client_env(tmp_path) -> dict[str, str]:
    """What `shardps local --secure` prints for clients to export (its certificates exist)."""
    secured = Secured(tmp_path / "secrets")
    token_file = tmp_path / "secrets" / "demo.token"
    token_file.write_text("a-job-token")
    env = secured.client_env("127.0.0.1:7070", str(token_file))
    env.pop("SHARDPS_MANAGER")
    return env


def _common(argv: list[str], env: dict[str, str]) -> Common:
    return build(Common, build_parser(env).parse_args(argv))


def test_a_server_role_names_a_missing_file_from_the_environment(tmp_path):
    gone = str(tmp_path / "gone" / "client.pem")          # the work directory of a stopped cluster
    for role in ("manager", "server"):
        with pytest.raises(SystemExit) as exit_:
            _common([role], {"SHARDPS_TLS_CERT": gone})
        text = str(exit_.value.code)
        assert f"shardps {role}: SHARDPS_TLS_CERT={gone} (from the environment): no such file" in text
        assert "unset SHARDPS_TLS_CERT SHARDPS_TLS_KEY SHARDPS_TLS_CA SHARDPS_TOKEN_FILE" in text
        assert "--tls-cert" in text


def test_a_server_role_refuses_a_client_certificate_from_the_environment(client_env):
    for role in ("manager", "server"):
        with pytest.raises(SystemExit) as exit_:
            _common([role], client_env)
        text = str(exit_.value.code)
        assert f"SHARDPS_TLS_CERT={client_env['SHARDPS_TLS_CERT']} (from the environment): a client " \
               f"certificate" in text and f"unset the client's variables where the {role} starts" in text


def test_client_roles_take_the_client_settings(client_env):
    for role in ("worker", "status", "job", "checkpoint"):
        argv = [role] + {"job": ["create", "demo"], "checkpoint": ["demo"]}.get(role, [])
        common = _common(argv, client_env)
        assert common.tls_cert == client_env["SHARDPS_TLS_CERT"]
        assert common.resolved_token() == "a-job-token"


def test_the_manager_ignores_the_clients_token_file(tmp_path):
    env = {"SHARDPS_TOKEN_FILE": str(tmp_path / "gone.token")}
    assert _common(["manager"], env).token_file           # read, never opened: the manager sends none
    with pytest.raises(SystemExit, match="SHARDPS_TOKEN_FILE=.*gone.token .from the environment.: no such file"):
        _common(["server"], env)                          # a server sends its token to the manager


def test_a_flag_wins_over_the_clients_variables(client_env, tmp_path):
    certs = Path(client_env["SHARDPS_TLS_CA"]).parent
    common = _common(["manager", "--tls-cert", str(certs / "server.pem"), "--tls-key",
                      str(certs / "server-key.pem")], client_env)
    assert common.tls_cert.endswith("server.pem")
    with pytest.raises(SystemExit) as exit_:
        _common(["manager", "--tls-cert", str(tmp_path / "nope.pem")], client_env)
    assert str(exit_.value.code) == (f"shardps manager: --tls-cert {tmp_path / 'nope.pem'}: no such file: "
                                     f"give --tls-cert a readable file")


def test_a_server_certificate_from_the_environment_is_the_servers(client_env):
    certs = Path(client_env["SHARDPS_TLS_CA"]).parent
    env = {"SHARDPS_TLS_CERT": str(certs / "server.pem"), "SHARDPS_TLS_KEY": str(certs / "server-key.pem"),
           "SHARDPS_TLS_CA": client_env["SHARDPS_TLS_CA"]}      # as docker-compose.tls.yml sets them
    for role in ("manager", "server"):
        assert _common([role], env).tls_cert == env["SHARDPS_TLS_CERT"]


def test_a_local_cluster_passes_on_every_variable_but_the_clients(client_env, tmp_path):
    """Its manager and servers lose only the client's variables (those `shardps local --secure`
    prints, and SHARDPS_TOKEN), not their own settings that share a prefix with them."""
    own = {"SHARDPS_TOKEN_TTL_SECONDS": "60", "SHARDPS_TOKEN_KEY_FILE": str(tmp_path / "keys"),
           "SHARDPS_TLS_REQUIRE_CLIENT_CERT": "false"}
    cluster = LocalCluster(servers=1, work_dir=str(tmp_path / "plain"),
                           env={**client_env, **own, "SHARDPS_TOKEN": "a-clients-token"})
    for role in ("manager", "server", "worker"):
        env = cluster._env_of(role)
        assert {k: env.get(k) for k in own} == own, role
        assert not {"SHARDPS_TOKEN", *client_env} & set(env), role


@pytest.mark.slow          # processes (shardps local's manager and server)
def test_a_plain_local_cluster_ignores_a_secure_ones_lingering_variables(client_env, tmp_path):
    """The issue's row: export what `shardps local --secure` printed, stop that cluster (its
    files go), start a plain one: its manager and servers do not take the client's settings
    and the cluster serves."""
    shutil.rmtree(Path(client_env["SHARDPS_TLS_CA"]).parent)
    with LocalCluster(servers=1, work_dir=str(tmp_path / "plain"), env={**os.environ, **client_env}) as cluster:
        from shardps.worker.client import PSClient
        with PSClient(cluster.manager_address, "plain") as c:
            c.create_job()
            c.create_dense("w", (4,))
            assert c.pull_dense("w").shape == (4,)
