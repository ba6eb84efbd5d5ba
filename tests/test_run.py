"""`shardps run`: your own script on N processes with the cluster and torchrun's variables
in their environment, a failed process started again, a run that cannot go on stopped with
the failing rank's status (real processes against a real cluster)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from shardps.errors import InvalidArgument
from shardps.tools.launch import final_error, plan

SHARDPS = [sys.executable, "-m", "shardps.tools.cli"]

SCRIPT = textwrap.dedent("""
    import json, os, sys
    from shardps.worker import PSClient
    out = sys.argv[1]
    marker = f"{out}.failed-once-{os.environ['RANK']}"
    if "--fail-once" in sys.argv and not os.path.exists(marker):
        open(marker, "w").close()
        sys.exit(3)                                     # the first try of each rank fails
    if "--always-fail" in sys.argv and os.environ["RANK"] == "1":
        sys.exit(7)
    with PSClient() as client:                          # SHARDPS_MANAGER and SHARDPS_JOB
        client.create_job()
        membership = client.join(heartbeat=False)
        if "--crash-after-steps" in sys.argv and not os.path.exists(marker):
            open(marker, "w").close()
            import numpy as np
            from shardps.worker import sgd
            client.create_dense("w", (4,), optimizer=sgd(0.1))
            for step in range(5):
                client.push_dense("w", np.ones(4, np.float32), clock=step)
            client.heartbeat()                          # as the heartbeat thread would
            os._exit(3)                                 # dies without leaving
        env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SHARDPS_JOB")}
        with open(f"{out}.{os.environ['RANK']}.json", "w") as f:
            json.dump({"env": env, "rank": membership.rank, "job": client.job, "world_size": membership.world_size,
                       "previous_step": membership.previous_step}, f)
        client.leave()
""")


def test_the_plan_gives_each_process_its_place():
    envs = plan("m:7070", "j", 2, nnodes=2, node_rank=1)
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) for e in envs] == \
        [("2", "0", "4", "2"), ("3", "1", "4", "2")]
    assert all(e["SHARDPS_MANAGER"] == "m:7070" and e["SHARDPS_JOB"] == "j" for e in envs)
    for bad in ({"nproc": 0}, {"nnodes": 2, "node_rank": 2}, {"job": ""}):
        with pytest.raises(InvalidArgument):
            plan("m", bad.get("job", "j"), bad.get("nproc", 1), bad.get("nnodes", 1), bad.get("node_rank", 0))


def test_a_shardps_error_no_restart_can_change_is_final():
    tail = b"Traceback (most recent call last):\n  ...\nshardps.errors.AlreadyExists: table 'w' exists\n\n"
    assert final_error(tail) == "AlreadyExists: table 'w' exists"
    assert final_error(b"shardps.errors.InvalidArgument: lr=-1\n") == "InvalidArgument: lr=-1"
    for retried in (b"shardps.errors.Unavailable: server s1 did not answer\n", b"RuntimeError: boom\n",
                    b"shardps.errors.AlreadyExists: x\nthen the process printed something else\n", b""):
        assert final_error(retried) is None


def _run(cluster, tmp_path, *script_args: str, restarts: int = 3) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    return subprocess.run(SHARDPS + ["run", "--manager", cluster.address, "--job", "mine", "--nproc-per-node", "2",
                                     "--max-restarts", str(restarts), str(script), str(tmp_path / "out"),
                                     *script_args],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)


@pytest.mark.slow          # processes (shardps run and its 2 scripts)
def test_each_process_joins_with_its_rank_and_a_failed_one_is_started_again(cluster, tmp_path):
    out = _run(cluster, tmp_path, "--fail-once")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stderr.count("starting it again (restart 1 of 3)") == 2, out.stderr
    for rank in (0, 1):
        got = json.loads((tmp_path / f"out.{rank}.json").read_text())
        assert got["env"] == {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                              "LOCAL_WORLD_SIZE": "2", "SHARDPS_JOB": "mine"}
        assert got["rank"] == rank and got["job"] == "mine"
        assert got["world_size"] == 2 and got["previous_step"] == 0     # WORLD_SIZE, also for the first to join


@pytest.mark.slow          # processes (shardps run and its 2 scripts)
def test_a_restarted_rank_learns_the_steps_it_had_completed(cluster, tmp_path):
    out = _run(cluster, tmp_path, "--crash-after-steps")
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in (0, 1):
        got = json.loads((tmp_path / f"out.{rank}.json").read_text())
        assert got["rank"] == rank and got["previous_step"] == 5, got


@pytest.mark.slow          # processes (shardps run and its 2 scripts)
def test_a_rank_that_keeps_failing_ends_the_run_with_its_status(cluster, tmp_path):
    out = _run(cluster, tmp_path, "--always-fail", restarts=1)
    assert out.returncode == 7, out.stdout + out.stderr
    assert "rank 1 exited with status 7 after 1 restart(s): stopping the others" in out.stderr


@pytest.mark.slow          # processes (shardps run and its script)
def test_a_rank_failing_on_an_error_no_restart_can_change_is_not_started_again(tmp_path):
    out = _run_alone(tmp_path, """
        import sys
        from shardps.errors import AlreadyExists
        print("started", file=sys.stderr)
        raise AlreadyExists("table 'w' of job 'alone' exists, created with optimizer=sgd lr=0.01")
    """, restarts=3)
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stderr.count("Traceback") == 1 and out.stderr.count("started") == 1, out.stderr
    assert "rank 0 exited with status 1 on AlreadyExists: table 'w' of job 'alone' exists" in out.stderr
    assert "starting it again cannot change that" in out.stderr


def _run_alone(tmp_path, script: str, *args: str, env: dict | None = None, restarts: int = 0
               ) -> subprocess.CompletedProcess:
    """``shardps run`` of ``script`` (rank 0 only, ``restarts``), no cluster needed."""
    path = tmp_path / "alone.py"
    path.write_text(textwrap.dedent(script))
    return subprocess.run(SHARDPS + ["run", "--manager", "127.0.0.1:1", "--job", "alone", "--max-restarts",
                                     str(restarts), str(path), *args],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)


@pytest.mark.slow          # processes (shardps run and its script)
def test_each_process_is_tied_to_shardps_run_not_to_its_parent(tmp_path):
    """`shardps run` started as a child (SHARDPS_PARENT_PID naming its parent, this test):
    its processes name `shardps run`, so a shardps command among them does not exit at once."""
    out = _run_alone(tmp_path, """
        import json, os, sys
        json.dump({"parent_env": os.environ.get("SHARDPS_PARENT_PID"), "ppid": os.getppid()}, open(sys.argv[1], "w"))
    """, str(tmp_path / "seen.json"), env={**os.environ, "SHARDPS_PARENT_PID": str(os.getpid())})
    assert out.returncode == 0, out.stdout + out.stderr
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["parent_env"] == str(seen["ppid"]) != str(os.getpid())


@pytest.mark.slow          # processes (shardps run and its script)
def test_a_rank_killed_by_a_signal_ends_the_run_with_128_plus_the_signal(tmp_path):
    out = _run_alone(tmp_path, """
        import os, signal
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert out.returncode == 128 + 9, out.stdout + out.stderr
    assert "rank 0 exited with status 137 after 0 restart(s)" in out.stderr


@pytest.mark.slow          # a process (shardps run)
def test_a_command_that_cannot_start_is_one_line_and_status_2(tmp_path):
    out = subprocess.run(SHARDPS + ["run", "--job", "alone", "no-such-command-shardps-test"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "shardps run: cannot start no-such-command-shardps-test: No such file or directory" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_client_without_a_job_says_how_to_name_one(monkeypatch):
    from shardps.worker.client import PSClient
    monkeypatch.delenv("SHARDPS_JOB", raising=False)
    monkeypatch.delenv("SHARDPS_MANAGER", raising=False)
    with pytest.raises(InvalidArgument, match="SHARDPS_MANAGER and SHARDPS_JOB"):
        PSClient()
