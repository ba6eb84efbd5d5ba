"""Training through the parameter server: data split, local batch-norm, real worker processes."""

import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardps.errors import InvalidArgument
from shardps.tables import sgd
from shardps.tools.local import LocalCluster
from shardps.worker.data import position, shard_indices
from shardps.worker.torch_ps import PSModel


@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_each_epoch_is_partitioned_among_live_workers(count):
    n = 1797
    parts = [shard_indices(n, 3, 7, i, count) for i in range(count)]
    together = np.concatenate(parts)
    assert len(together) == n and len(np.unique(together)) == n
    assert np.array_equal(parts[0], shard_indices(n, 3, 7, 0, count)), "not deterministic"
    assert not np.array_equal(shard_indices(n, 4, 7, 0, count), parts[0]) or count == n


def test_membership_change_moves_positions_not_ranks():
    # ranks 0, 1, 2 live; rank 1 leaves: rank 2 takes position 1 of 2 from the next epoch on
    assert position(2, [0, 1, 2]) == (2, 3)
    assert position(2, [0, 2]) == (1, 2)
    # a joiner (rank 3) is counted from the next epoch's membership read
    assert position(3, [0, 2, 3]) == (2, 3)
    n = 100
    after = [shard_indices(n, 5, 0, i, 2) for i in range(2)]
    assert sorted(np.concatenate(after).tolist()) == list(range(n))


@pytest.mark.slow          # ~2.5 s
def test_batchnorm_statistics_stay_local(make_cluster, client_factory):
    """Two workers see differently scaled data: their BN running means differ, while every
    parameter on the servers is the same for both after a pull."""
    cluster = make_cluster(1)
    admin = client_factory(cluster.address, job="bn")
    admin.create_job()

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))

    models = []
    for i in range(2):
        c = client_factory(cluster.address, job="bn")
        c.join(name=f"w{i}", heartbeat=False)
        m = PSModel(net(), c, optimizer=sgd(0.05))
        m.create_tables()
        models.append(m)
    gen = torch.Generator().manual_seed(1)
    for _step in range(10):
        for i, m in enumerate(models):
            x = torch.randn(32, 8, generator=gen) * (1 + 4 * i) + 3 * i
            y = torch.randint(0, 2, (32,), generator=gen)
            m.pull()
            F.cross_entropy(m(x), y).backward()
            m.push()
    for m in models:
        m.pull()
    bn = [m.module[1] for m in models]
    assert not torch.allclose(bn[0].running_mean, bn[1].running_mean, atol=0.1), "BN buffers were shared"
    for (k, a), (_, b) in zip(models[0].module.named_parameters(), models[1].module.named_parameters()):
        assert torch.equal(a, b), f"parameter {k} differs between workers after a pull"
    assert "1.running_mean" not in models[0].dense


def _with_a_local_layer(make_cluster, client_factory, job: str, local_optimizer):
    """A two-layer model whose second layer stays on the worker (``local_optimizer(params)``
    steps it), its first on one server: (client, model, PSModel)."""
    cluster = make_cluster(1)
    c = client_factory(cluster.address, job=job)
    c.create_job()
    c.join(heartbeat=False)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    m = PSModel(model, c, optimizer=sgd(0.1), local=["1"], local_optimizer=local_optimizer(model[1].parameters()))
    m.create_tables()
    return c, model, m


def test_parameters_listed_local_stay_on_the_worker(make_cluster, client_factory):
    c, model, m = _with_a_local_layer(make_cluster, client_factory, "loc", lambda p: torch.optim.SGD(p, lr=0.1))
    assert set(m.dense) == {"0.weight", "0.bias"}
    assert {t.name: t.spec.shape for t in c.tables()} == {"dense-params": (20,)}     # 0.weight, 0.bias end to end
    before = model[1].weight.detach().clone()
    m.pull()
    model(torch.ones(2, 4)).sum().backward()
    m.push()
    assert not torch.equal(before, model[1].weight), "the local optimizer did not step"


class _SlowSGD(torch.optim.SGD):
    """SGD whose step takes ``delay`` seconds: compute of the worker's own."""

    def __init__(self, params, delay: float):
        super().__init__(params, lr=0.1)
        self.delay = delay

    def step(self, closure=None):
        time.sleep(self.delay)
        return super().step(closure)


def test_the_local_optimizers_step_is_compute_not_push_wait(make_cluster, client_factory):
    _, model, m = _with_a_local_layer(make_cluster, client_factory, "locwait", lambda p: _SlowSGD(p, delay=0.2))
    for _ in range(2):
        m.pull()
        model(torch.ones(2, 4)).sum().backward()
        m.push()
    assert m.timings["local_optimizer"] >= 0.4
    assert m.timings["push_wait"] < 0.2, m.timings      # two pushes to one in-process server


def _start_cluster_with_workers(tmp_path, n_workers, extra):
    cluster = LocalCluster(servers=2, work_dir=str(tmp_path))
    cluster.start()
    procs = [cluster.start_worker(f"worker-{i}", ["--job", "demo", "--model", "digits-cnn",
                                                  "--result-file", str(tmp_path / f"result-{i}.json")] + extra)
             for i in range(n_workers)]
    return cluster, procs


@pytest.mark.slow          # processes (LocalCluster)
def test_async_worker_killed_mid_run_the_other_reaches_the_target(tmp_path):
    cluster, procs = _start_cluster_with_workers(tmp_path, 2, ["--epochs", "30"])
    try:
        from shardps.worker.client import PSClient
        with PSClient(cluster.manager_address, "demo") as c:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                st = c.cluster_status()
                steps = {w.member.name: w.step for g in st.groups for w in g.workers}
                if steps.get("worker-1", 0) >= 40:
                    break
                time.sleep(0.2)
            else:
                raise AssertionError(f"worker-1 never reached step 40: {steps}")
        cluster.kill(procs[1], signal.SIGKILL)
        out, _ = procs[0].popen.communicate(timeout=300)
        assert procs[0].popen.returncode == 0, out
        result = json.loads((tmp_path / "result-0.json").read_text())
        print(f"survivor: {result['metrics']} after {result['steps']} steps")
        assert result["metrics"]["test_accuracy"] >= 0.97
    finally:
        cluster.stop()


@pytest.mark.slow          # processes (LocalCluster)
def test_ctr_async_two_workers_reaches_oracle_auc_and_pushes_only_touched_rows(tmp_path):
    cluster, procs = _start_cluster_with_workers(tmp_path, 0, [])
    try:
        procs = [cluster.start_worker(f"worker-{i}", ["--job", "ctr", "--model", "ctr", "--mode", "async",
                                                      "--result-file", str(tmp_path / f"ctr-{i}.json")])
                 for i in range(2)]
        for p in procs:
            out, _ = p.popen.communicate(timeout=600)
            assert p.popen.returncode == 0, f"{out}\n{p.log_path.read_text()[-3000:]}"
        results = [json.loads((tmp_path / f"ctr-{i}.json").read_text()) for i in range(2)]
        for r in results:
            auc, oracle = r["metrics"]["test_auc"], r["metrics"]["oracle_auc"]
            row_bytes = 8 + 16 * 4
            ratio = r["sparse_bytes_pushed"] / (r["unique_rows"] * row_bytes)
            print(f"rank {r['rank']}: auc {auc:.4f} (oracle {oracle:.4f}), "
                  f"{r['samples'] / r['wall_seconds']:.0f} samples/s, sparse bytes pushed / "
                  f"(unique rows x {row_bytes} B) = {ratio:.4f}")
            assert auc >= oracle - 0.02
            assert ratio <= 1.05
    finally:
        cluster.stop()


def test_learning_rate_schedule_updates_every_table(make_cluster, client_factory):
    from shardps.tables import adagrad
    from shardps.worker.torch_ps import PSEmbedding, PSLambdaLR
    cluster = make_cluster(1)
    c = client_factory(cluster.address, job="sched")
    c.create_job()
    c.join(heartbeat=False)
    model = nn.Module()
    model.emb = PSEmbedding(100, 4, optimizer=adagrad(0.1))
    model.fc = nn.Linear(4, 1)
    m = PSModel(model, c, optimizer=sgd(0.2))
    m.create_tables()
    schedule = PSLambdaLR(m, lambda epoch: 0.5 ** epoch)
    schedule.step()
    lrs = {t.name: t.config.optimizer.lr for t in c.tables()}
    assert lrs == {"emb": 0.05, "dense-params": 0.1}
    a, z = m.buckets[0].piece("fc.bias")
    before = c.pull_dense("dense-params")[a:z].copy()
    m.pull()
    model.fc(torch.ones(1, 4)).sum().backward()
    m.push()
    np.testing.assert_allclose(c.pull_dense("dense-params")[a:z], before - 0.1, rtol=1e-6)   # the new lr, at once


@pytest.mark.slow          # processes (LocalCluster)
def test_mnist_cnn_trains_when_the_data_is_present(tmp_path):
    """mnist-cnn needs torchvision and MNIST on disk, which these machines cannot download."""
    from shardps.errors import FailedPrecondition
    from shardps.worker.models import build
    try:
        task = build("mnist-cnn")
    except FailedPrecondition as exc:
        pytest.skip(f"mnist-cnn unavailable here: {exc.message}")
    assert task.train[0].shape[1:] == (1, 28, 28)


@pytest.mark.slow          # processes (shardps local)
def test_json_logs_carry_the_context_and_the_worker_plots_its_curve(tmp_path):
    """`--log-format json`: one JSON object per line with role, node, job, rank and epoch;
    `--plot PATH` writes the loss/accuracy curve as a PNG."""
    plot = tmp_path / "curve.png"
    out = subprocess.run([sys.executable, "-m", "shardps.tools.cli", "local", "--port", "0", "--servers", "1",
                          "--workers", "1",
                          "--model", "digits-cnn", "--epochs", "2", "--log-format", "json",
                          "--plot", str(plot), "--work-dir", str(tmp_path / "w")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = (tmp_path / "w" / "worker-0.log").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.startswith("{")]
    joined = next(r for r in records if "joined job" in r["msg"])
    assert {"ts", "level", "msg", "role", "node", "job", "rank", "epoch"} <= set(joined), joined
    assert joined["role"] == "worker" and joined["job"] == "demo"
    server = [json.loads(line) for line in (tmp_path / "w" / "s0.log").read_text().splitlines()]
    assert server and all(r["role"] == "server" and r["node"] == "s0" for r in server)


class _Scalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))


@pytest.mark.parametrize("lookahead, seen", [(1, [0, -1, -2, -3, -4, -5]),
                                             (2, [0, -1, -1, -2, -3, -4])])
def test_lookahead_decides_which_pushes_a_step_reads(make_cluster, client_factory, lookahead, seen):
    """SGD(lr=1) on a gradient of 1 per step. With lookahead 1, step t reads every earlier
    push of this worker; with 2 (the pull rode on step t - 2's push), step t >= 2 lacks
    step t - 1's push: one step staler, never more."""
    cluster = make_cluster(1)
    c = client_factory(cluster.address, job="ahead")
    c.create_job()
    c.join(heartbeat=False)
    module = _Scalar()
    m = PSModel(module, c, optimizer=sgd(1.0), overlap=True, lookahead=lookahead)
    m.create_tables()
    got = []
    for _ in range(6):
        m.pull()
        got.append(float(module.w.detach()))
        module.w.sum().backward()
        m.push()
    m.settle()
    assert got == seen
    assert float(module.w) == -6.0, "every push was applied once"


def test_lookahead_is_one_in_sync_jobs_and_bounded(make_cluster, client_factory):
    cluster = make_cluster(1)
    c = client_factory(cluster.address, job="ahead-sync")
    c.create_job("sync")
    c.join(heartbeat=False)
    m = PSModel(_Scalar(), c, optimizer=sgd(1.0), overlap=True, lookahead=2)
    assert m.lookahead == 1
    with pytest.raises(InvalidArgument, match="lookahead=9"):
        PSModel(_Scalar(), c, lookahead=9)


def test_a_pull_no_exchange_carried_reads_this_workers_push_in_flight(make_cluster, client_factory):
    """Lookahead 2: step 1's values were not carried by any exchange, so it pulls them
    itself; that pull reads step 0's push although the push is still in flight (the push is
    large, so without waiting for it the small pull overtakes it at the server)."""
    cluster = make_cluster(1)
    c = client_factory(cluster.address, job="ryw")
    c.create_job()
    c.join(heartbeat=False)

    class _Wide(nn.Module):
        def __init__(self):
            super().__init__()
            self.big = nn.Parameter(torch.zeros(4_000_000))
            self.w = nn.Parameter(torch.zeros(1))

    module = _Wide()
    m = PSModel(module, c, optimizer=sgd(1.0), overlap=True, lookahead=2)
    m.create_tables()
    got = []
    for _ in range(3):
        m.pull()
        got.append((float(module.w.detach()), float(module.big.detach()[-1])))
        (module.w.sum() + module.big.sum()).backward()
        m.push()
    m.settle()
    assert got == [(0.0, 0.0), (-1.0, -1.0), (-1.0, -1.0)]
