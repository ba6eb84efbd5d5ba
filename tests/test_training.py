"""Training through the parameter server: data split, local batch-norm, real worker processes."""

import json
import signal
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardps.local import LocalCluster
from shardps.tables import sgd
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
    for step in range(10):
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


def test_parameters_listed_local_stay_on_the_worker(make_cluster, client_factory):
    cluster = make_cluster(1)
    c = client_factory(cluster.address, job="loc")
    c.create_job()
    c.join(heartbeat=False)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    local_opt = torch.optim.SGD(model[1].parameters(), lr=0.1)
    m = PSModel(model, c, optimizer=sgd(0.1), local=["1"], local_optimizer=local_opt)
    m.create_tables()
    assert set(m.dense) == {"0.weight", "0.bias"}
    assert {t.name for t in c.tables()} == {"0.weight", "0.bias"}
    before = model[1].weight.detach().clone()
    m.pull()
    model(torch.ones(2, 4)).sum().backward()
    m.push()
    assert not torch.equal(before, model[1].weight), "the local optimizer did not step"


def _start_cluster_with_workers(tmp_path, n_workers, extra):
    cluster = LocalCluster(servers=2, work_dir=str(tmp_path))
    cluster.start()
    procs = [cluster.start_worker(f"worker-{i}", ["--job", "demo", "--model", "digits-cnn",
                                                  "--result-file", str(tmp_path / f"result-{i}.json")] + extra)
             for i in range(n_workers)]
    return cluster, procs


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
