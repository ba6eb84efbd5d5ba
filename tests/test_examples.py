"""Every script in examples/ runs as a user runs it, against `shardps local --port 0`, on
small synthetic data, and prints its final metric."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def manager():
    """The manager address of one `shardps local --servers 2 --port 0` for the module."""
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "grpc_proxy")}
    proc = subprocess.Popen([sys.executable, "-m", "shardps.tools.cli", "local", "--servers", "2", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        found = re.search(r"manager at (\S+);", line)
        assert found, f"shardps local printed {line!r}"
        yield found.group(1)
    finally:
        proc.send_signal(signal.SIGTERM)       # stops its manager and servers
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run(script: str, *args: str, timeout: float = 60) -> str:
    env = dict(os.environ, no_proxy="127.0.0.1,localhost")
    for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "grpc_proxy"):
        env.pop(k, None)
    out = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                         timeout=timeout, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def metric(text: str, name: str) -> float:
    found = re.findall(rf"{name}=([-0-9.e+]+)", text)
    assert found, f"no {name}= in:\n{text}"
    return float(found[-1])


@pytest.mark.parametrize("script", ["dlrm.py", "movielens_mf.py", "logreg_sync.py", "hybrid_ctr.py"])
def test_help_explains_the_example(script):
    out = run(script, "--help")
    assert "usage:" in out and "--manager" in out and "shardps local" in out


def test_dlrm_makes_one_pull_and_one_push_per_server_per_step(manager):
    """8 multi-hot features over 6 tables plus the MLPs: the servers' own counters (their
    Prometheus grpc_server_handled_total), as the example prints them, show two data calls
    per server per worker step (a pull and a push, each a Step frame); and the model learns
    the synthetic clicks."""
    out = run("dlrm.py", "--manager", manager, "--job", "dlrm-test", "--steps", "40", "--rows", "5000",
              "--batch-size", "128")
    calls = re.findall(r"server (\S+) handled per worker step: pull=([0-9.]+) push=([0-9.]+) exchange=([0-9.]+) "
                       r"step=([0-9.]+)", out)
    assert len(calls) == 2, out                     # both servers measured
    for _server, pull, push, exchange, step in calls:
        assert (float(pull), float(push), float(exchange), float(step)) == (0.0, 0.0, 0.0, 2.0), out
    assert metric(out, "test_auc") > 0.6, out
    # the run ended its job: a second run starts from fresh tables, not this run's
    from shardps.worker import PSClient
    with PSClient(manager, "dlrm-test") as client:
        assert client.tables() == []


def test_dlrm_overlap_makes_one_call_per_server_per_step_on_a_criteo_file(manager, tmp_path):
    rng = np.random.default_rng(0)
    lines = []
    for _ in range(400):      # label, I1..I13 (some empty), C1..C26 (8 hex digits, some empty)
        dense = [str(rng.integers(0, 100)) if rng.random() > 0.2 else "" for _ in range(13)]
        cats = [f"{rng.integers(0, 2**32):08x}" if rng.random() > 0.1 else "" for _ in range(26)]
        lines.append("\t".join([str(int(rng.random() < 0.3)), *dense, *cats]))
    data = tmp_path / "criteo.tsv"
    data.write_text("\n".join(lines) + "\n")
    out = run("dlrm.py", "--manager", manager, "--job", "dlrm-criteo", "--data", str(data), "--steps", "20",
              "--rows", "5000", "--batch-size", "64", "--overlap", "--mode", "sync")
    assert "400 samples (criteo" in out, out
    calls = re.findall(r"pull=([0-9.]+) push=([0-9.]+) exchange=([0-9.]+) step=([0-9.]+)", out)
    assert len(calls) == 2, out
    for pull, push, exchange, step in calls:     # the first step's pull, then one call a step: a SYNC
        # step's push reaches every server, so its push, its report and the next pull are one Step frame
        assert (float(pull), float(push), float(exchange)) == (0.0, 0.0, 0.0), out
        assert abs(float(step) - 21 / 20) < 1e-9, out
    assert np.isfinite(metric(out, "test_logloss")), out


def test_matrix_factorisation_beats_the_mean_on_a_u_data_file(manager, tmp_path):
    rng = np.random.default_rng(0)
    users, items, n = 200, 150, 6000
    p, q = rng.normal(0, 0.8, (users + 1, 3)), rng.normal(0, 0.8, (items + 1, 3))
    bu, bi = rng.normal(0, 0.5, users + 1), rng.normal(0, 0.5, items + 1)
    u, i = rng.integers(1, users + 1, n), rng.integers(1, items + 1, n)
    r = np.clip(np.rint(3.5 + bu[u] + bi[i] + (p[u] * q[i]).sum(1) + rng.normal(0, 0.3, n)), 1, 5).astype(int)
    data = tmp_path / "u.data"
    data.write_text("".join(f"{a}\t{b}\t{c}\t{881250949 + k}\n" for k, (a, b, c) in enumerate(zip(u, i, r))))
    out = run("movielens_mf.py", "--manager", manager, "--job", "mf-test", "--ratings", str(data),
              "--epochs", "8", "--batch-size", "256")
    baseline = float(re.search(r"predicting the mean: ([0-9.]+)", out).group(1))
    assert metric(out, "test_rmse") < 0.75 * baseline, out


def test_logistic_regression_in_sync_over_3_workers_equals_one_large_batch(manager):
    for _ in range(2):              # a rerun starts fresh: the same agreement, not a continuation
        out = run("logreg_sync.py", "--manager", manager, "--job", "logreg-test", "--workers", "3", "--steps", "60")
        assert "workers=3" in out, out
        assert metric(out, "sync_vs_one_large_batch_max_diff") < 1e-5, out
        assert metric(out, "test_accuracy") > 0.85, out


@pytest.mark.parametrize("script, flag", [("movielens_mf.py", "--ratings"), ("dlrm.py", "--data")])
def test_a_missing_data_file_names_where_the_data_comes_from(script, flag, tmp_path):
    env = dict(os.environ, no_proxy="127.0.0.1,localhost")
    out = subprocess.run([sys.executable, str(EXAMPLES / script), "--manager", "127.0.0.1:1", flag,
                          str(tmp_path / "missing")], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"{tmp_path / 'missing'}: no such file" in out.stderr and "https://" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_the_hybrid_click_model_learns_under_torchrun(manager):
    """examples/hybrid_ctr.py as its docstring runs it: plain torchrun, 2 ranks; the run ends its job."""
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "grpc_proxy")}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(EXAMPLES / "hybrid_ctr.py"), "--manager", manager, "--job", "hybrid-test",
                          "--steps", "60"], capture_output=True, text=True, timeout=180,
                         env={**env, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert metric(out.stdout, "test_auc") > 0.6, out.stdout
    from shardps.worker import PSClient
    with PSClient(manager, "hybrid-test") as client:
        assert client.tables() == []
