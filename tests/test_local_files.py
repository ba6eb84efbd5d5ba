"""`shardps local` keeps what users asked for: files named on its command line are written
where the user is (one per worker), and its temporary work directory is removed only with a
word about it (`--keep` keeps it)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shardps.tools.local_run import worker_file

SHARDPS = [sys.executable, "-m", "shardps.tools.cli"]


def test_a_workers_file_is_absolute_and_one_per_worker(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert worker_file("r.json", 0, 1) == str(tmp_path / "r.json")
    assert worker_file("out/curve.png", 1, 2) == str(tmp_path / "out" / "curve-worker-1.png")
    assert worker_file("/abs/r", 0, 3) == "/abs/r-worker-0"


def _local(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(SHARDPS + ["local", "--servers", "1", "--port", "0", "--workers", "2", "--model",
                                     "digits-cnn", "--steps", "4", "--device", "cpu", *extra],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)


@pytest.mark.slow          # processes (shardps local with 2 workers), ~20 s
def test_files_land_where_the_user_is_and_the_work_dir_is_removed_with_a_word(tmp_path):
    out = _local(tmp_path, "--result-file", "r.json", "--plot", "curve.png")
    assert out.returncode == 0, out.stdout + out.stderr
    for name in ("r-worker-0.json", "r-worker-1.json", "curve-worker-0.png", "curve-worker-1.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    removed = re.search(r"shardps local: removed (\S+) \(state, logs, checkpoints\); --keep keeps it", out.stdout)
    assert removed, out.stdout
    assert not Path(removed.group(1)).exists()


@pytest.mark.slow          # processes (shardps local with 2 workers), ~20 s
def test_keep_keeps_the_work_dir(tmp_path):
    out = _local(tmp_path, "--keep")
    assert out.returncode == 0, out.stdout + out.stderr
    kept = re.search(r"shardps local: kept (\S+) \(state, logs, checkpoints\)", out.stdout)
    assert kept, out.stdout
    work = Path(kept.group(1))
    try:
        assert (work / "manager.log").exists() and (work / "worker-0.log").exists()
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.slow          # processes (shardps local with 2 servers), a few seconds
def test_the_console_names_the_metrics_ports_and_a_server_that_dies(tmp_path):
    import json
    import os
    import signal
    import urllib.request
    work = tmp_path / "work"
    proc = subprocess.Popen(SHARDPS + ["local", "--servers", "2", "--port", "0", "--work-dir", str(work)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline()]
        while lines[-1] and "metrics at" not in lines[-1]:
            lines.append(proc.stdout.readline())
        found = re.search(r"metrics at manager (http://\S+/metrics), s0 (http://\S+/metrics), "
                          r"s1 (http://\S+/metrics)", lines[-1])
        assert found, lines
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        for url in found.groups():                          # each one answers with its metrics
            assert b"process_cpu_seconds_total" in opener.open(url, timeout=10).read()
        pid = json.loads((work / "s1.ready").read_text())["pid"]
        os.kill(pid, signal.SIGKILL)
        said = ""
        while "exited" not in said:
            said = proc.stdout.readline()
            assert said, "shardps local ended without a word about s1"
        assert "server s1 exited with status -9 (the workers' calls to its blocks fail over" in said, said
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    assert "exited with status" not in rest, rest        # the servers it stopped itself: no word
