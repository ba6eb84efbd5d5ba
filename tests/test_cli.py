"""The `shardps` command: help texts, `shardps local` end to end, clean shutdown."""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardps.tools.cli import FLAGS, build_parser
from tests.waiting import alive, wait_for

SHARDPS = [sys.executable, "-m", "shardps.tools.cli"]


@pytest.mark.slow          # a process (shardps --help)
def test_help_explains_every_subcommand(capsys):
    out = subprocess.run(SHARDPS + ["--help"], capture_output=True, text=True, check=True).stdout
    assert "parameter server" in out
    build_parser()
    for sub in FLAGS:
        if sub == "bench":            # dispatched to shardps.tools.bench before parsing
            from shardps.tools.cli import main
            with pytest.raises(SystemExit) as exit_:
                main(["bench", "--help"])
            assert exit_.value.code == 0 and "--quick" in capsys.readouterr().out
            continue
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args([sub, "--help"])
        assert exit_.value.code == 0
        text = capsys.readouterr().out
        assert f"usage: shardps {sub}" in text
        for flag in FLAGS[sub]:
            assert flag in text, f"`shardps {sub} --help` does not explain {flag}"


def test_environment_variables_set_defaults():
    parser = build_parser({"SHARDPS_REPLICATION": "3", "SHARDPS_LISTEN": "127.0.0.1:9"})
    args = parser.parse_args(["manager"])
    assert args.replication == 3 and args.listen == "127.0.0.1:9"
    args = parser.parse_args(["manager", "--replication", "2"])
    assert args.replication == 2


@pytest.mark.slow          # processes (shardps local)
def test_local_starts_a_sync_jobs_workers_together():
    """``shardps local --mode sync``: its workers wait for one another before the first
    step (``--wait-workers`` = ``--workers``) unless told otherwise; other modes start at once."""
    from shardps.tools.local_run import _worker_args

    def wait_flag(*argv: str) -> str:
        args = build_parser().parse_args(["local", "--workers", "3", *argv])
        flags = _worker_args(args, FLAGS["worker"], 0, args.workers)
        return flags[flags.index("--wait-workers") + 1]

    assert wait_flag("--mode", "sync") == "3"
    assert wait_flag("--mode", "sync", "--wait-workers", "2") == "2"
    assert wait_flag("--mode", "async") == "0"


@pytest.mark.slow          # processes: shardps local, its manager and servers (about 4 s)
def test_local_cluster_stops_cleanly_on_sigterm(tmp_path):
    proc = subprocess.Popen(SHARDPS + ["local", "--servers", "2", "--port", "0", "--work-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        deadline = time.monotonic() + 60
        while "manager at" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
        assert "manager at" in line, line
        address = re.search(r"manager at (\S+);", line).group(1)
        from shardps.rpc.channels import check_health
        assert check_health(address) == "SERVING"
        pids = [json.loads(p.read_text())["pid"] for p in tmp_path.glob("*.ready")]
        assert len(pids) == 3 and all(alive(p) for p in pids)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        wait_for("its manager and servers to exit, not orphaned", lambda: not any(alive(p) for p in pids), 10, 0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow          # processes (shardps local), ~25 s
def test_make_run_command_trains_digits_to_the_baseline(tmp_path):
    """`make run`'s command: 2 servers, 2 async workers, digits-cnn, baseline beside it."""
    started = time.monotonic()
    out = subprocess.run(SHARDPS + ["local", "--servers", "2", "--port", "0", "--workers", "2", "--model", "digits-cnn",
                                    "--mode", "async", "--baseline", "--work-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.strip().splitlines()
    print("\n".join(lines[-4:]), f"\n(wall {time.monotonic() - started:.0f}s)")
    assert lines[-1].startswith("test_accuracy=")
    dist = float(lines[-1].split("=")[1])
    base = float(re.search(r"shardps baseline .*test_accuracy=([0-9.]+)", out.stdout).group(1))
    assert dist >= 0.97 and abs(dist - base) <= 0.01, (dist, base)


@pytest.mark.slow          # a process (shardps status)
def test_status_command_shows_servers(cluster):
    out = subprocess.run(SHARDPS + ["status", "--manager", cluster.address], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "s0" in out.stdout and "SERVING" in out.stdout
    js = subprocess.run(SHARDPS + ["status", "--manager", cluster.address, "--json"], capture_output=True,
                        text=True, timeout=60)
    data = json.loads(js.stdout)
    assert {s["server"]["name"] for s in data["servers"]} == {"s0", "s1"}


@pytest.mark.slow          # processes (shardps health)
def test_health_command_exit_codes(cluster):
    ok = subprocess.run(SHARDPS + ["health", cluster.address], capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0 and "SERVING" in ok.stdout
    bad = subprocess.run(SHARDPS + ["health", "127.0.0.1:1", "--timeout", "1"], capture_output=True,
                         text=True, timeout=30)
    assert bad.returncode == 2 and "unreachable" in bad.stderr


@pytest.mark.slow          # processes (shardps local)
def test_local_listens_where_the_readme_connects_and_says_when_that_port_is_taken(tmp_path):
    """`shardps local --port N` puts the manager on 127.0.0.1:N (default 7070, the
    README's address); a taken port is a clear error naming it, not a random other port."""
    import socket
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(SHARDPS + ["local", "--servers", "1", "--port", str(port), "--work-dir",
                                       str(tmp_path / "a")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        line = proc.stdout.readline()
        deadline = time.monotonic() + 60
        while "manager at" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
        assert f"manager at 127.0.0.1:{port};" in line, line
        taken = subprocess.run(SHARDPS + ["local", "--servers", "1", "--port", str(port), "--work-dir",
                                          str(tmp_path / "b")], capture_output=True, text=True, timeout=60)
        assert taken.returncode == 2
        assert f"127.0.0.1:{port} is taken" in taken.stderr and "--port" in taken.stderr, taken.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_make_run_takes_another_port():
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(["make", "-n", "run", "PORT=7171"], capture_output=True, text=True, cwd=root, timeout=60)
    assert out.returncode == 0, out.stderr
    assert re.search(r"shardps local --servers 2 .*--port 7171$", out.stdout, flags=re.M), out.stdout
