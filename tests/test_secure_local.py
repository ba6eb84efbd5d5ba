"""`shardps local --secure`: one command gives a mutual-TLS cluster with tokens and prints how
to connect; the README's secured client (its ```py block) connects with what it printed."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from shardps.errors import PermissionDenied, ShardpsError, Unauthenticated

README = Path(__file__).resolve().parents[1] / "README.md"
pytestmark = pytest.mark.slow


def secured_block() -> str:
    blocks = [b for b in re.findall(r"```py\n(.*?)```", README.read_text(), flags=re.S)
              if "SHARDPS_TLS_CERT" in b]
    assert len(blocks) == 1, "README: expected one ```py block with the secured client"
    return blocks[0]


@pytest.fixture
def secure_local(tmp_path):
    """``shardps local --secure --port 0`` as a child; yields (the variables it printed to
    export, its work dir, its output so far); stopped with SIGTERM, like Ctrl-C."""
    work = tmp_path / "local"
    proc = subprocess.Popen([sys.executable, "-m", "shardps.tools.cli", "local", "--secure", "--port", "0",
                             "--servers", "2", "--work-dir", str(work)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    found = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if line.strip().startswith("export "):
                found.set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        found.wait(180)
        assert found.is_set(), f"no export line from shardps local --secure:\n{''.join(lines)}"
        export = next(line for line in lines if line.strip().startswith("export "))
        env = dict(kv.split("=", 1) for kv in export.split()[1:])
        yield env, work, lines
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(5)
    assert proc.returncode == 0, "".join(lines)
    for ready in work.glob("*.ready"):          # every process it started is gone
        pid = json.loads(ready.read_text())["pid"]
        assert not Path(f"/proc/{pid}").exists() or _zombie(pid), f"{ready.name}: pid {pid} still runs"


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def test_shardps_local_secure_serves_mutual_tls_with_tokens_and_the_readme_client_connects(
        secure_local, monkeypatch, capsys):
    env, work, lines = secure_local
    assert set(env) == {"SHARDPS_MANAGER", "SHARDPS_TLS_CA", "SHARDPS_TLS_CERT", "SHARDPS_TLS_KEY",
                        "SHARDPS_TOKEN_FILE"}
    manager = env["SHARDPS_MANAGER"]
    secrets = work / "secrets"
    text = "".join(lines)
    assert "mutual TLS" in text and f"--token-file {secrets / 'admin-token'}" in text
    for name in ("ca-key.pem", "server-key.pem", "client-key.pem", "admin-token", "token-key", "demo.token"):
        assert (secrets / name).stat().st_mode & 0o077 == 0, f"{name} is readable by others"

    # the README's secured client, with what the command printed
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    exec(compile(secured_block(), "README.md secured client", "exec"), {"__name__": "readme_secure"})
    assert "[-0.5 -0.5 -0.5 -0.5]" in capsys.readouterr().out

    from shardps.rpc.channels import TlsConfig, check_health
    from shardps.worker import PSClient
    tls = TlsConfig.from_files(env["SHARDPS_TLS_CERT"], env["SHARDPS_TLS_KEY"], env["SHARDPS_TLS_CA"])
    assert check_health(manager, timeout=5, tls=tls) == "SERVING"
    # no TLS, or TLS without a client certificate: nothing is served
    with pytest.raises(ShardpsError):
        check_health(manager, timeout=2)
    with pytest.raises(ShardpsError):
        check_health(manager, timeout=2, tls=TlsConfig.from_files(ca=env["SHARDPS_TLS_CA"]))
    # the certificate without a token, and the job's token for admin work or another job
    token = Path(env["SHARDPS_TOKEN_FILE"]).read_text().strip()
    with PSClient(manager, "demo", tls=tls, timeout=5) as c, pytest.raises(Unauthenticated):
        c.refresh_map()
    with PSClient(manager, "other", token=token, tls=tls, timeout=5) as c, pytest.raises(PermissionDenied):
        c.create_dense("x", shape=(2,))
    # the CLI with the exported variables and the admin token
    from shardps.tools.cli import main
    admin = str(secrets / "admin-token")
    assert main(["status", "--token-file", admin, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert len(status["servers"]) == 2 and "demo" in json.dumps(status)

