"""Checkpoints of a training job: on demand while workers train, and worker state round trip."""

import io
import subprocess
import sys
import time

import numpy as np
import torch
from torch import nn

from shardps.local import LocalCluster
from shardps.server.checkpoints import read_checkpoint
from shardps.tables import sgd
from shardps.worker.client import PSClient
from shardps.worker.runtime import load_worker_state, worker_state_bytes
from shardps.worker.torch_ps import PSModel


def test_on_demand_checkpoint_while_two_workers_train(tmp_path):
    with LocalCluster(servers=2, work_dir=str(tmp_path / "cluster")) as cluster:
        workers = [cluster.start_worker(f"worker-{i}", ["--job", "demo", "--model", "digits-cnn", "--epochs", "12"])
                   for i in range(2)]
        with PSClient(cluster.manager_address, "demo") as c:
            deadline = time.monotonic() + 120
            while True:
                st = c.cluster_status()
                steps = [w.step for g in st.groups for w in g.workers]
                if len(steps) == 2 and min(steps) >= 20:
                    break
                assert time.monotonic() < deadline, f"workers did not start: {steps}"
                time.sleep(0.2)
        out = subprocess.run([sys.executable, "-m", "shardps.cli", "checkpoint", "demo", "--manager",
                              cluster.manager_address], capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stderr
        path = out.stdout.split()[0]
        ck = read_checkpoint(path)
        assert sorted(ck.workers) == [0, 1], "both workers' local state is in the checkpoint"
        assert {t["spec"]["name"] for t in ck.tables} >= {"conv1.weight", "fc3.bias"}
        state = torch.load(io.BytesIO(ck.workers[0]), weights_only=False)
        assert state["step"] >= 20 and "torch_rng" in state
        print(f"checkpoint {path}: step {ck.step}, {len(ck.tables)} tables, worker steps "
              f"{[torch.load(io.BytesIO(b), weights_only=False)['step'] for b in ck.workers.values()]}")
        for p in workers:
            p.popen.communicate(timeout=300)
            assert p.popen.returncode == 0, p.log_path.read_text()[-2000:]


def test_worker_state_survives_a_restore(make_cluster, client_factory, tmp_path):
    cluster = make_cluster(2)
    cluster.manager.service.checkpoints.default_dir = str(tmp_path)
    c = client_factory(cluster.address, job="bn")
    c.create_job()
    c.join(name="w0", heartbeat=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    m = PSModel(model, c, optimizer=sgd(0.1))
    m.create_tables()
    for _ in range(5):
        m.pull()
        model(torch.randn(16, 4) * 3 + 1).sum().backward()
        m.push()
    saved_bn = model[1].running_mean.clone()
    values = c.state_dict()
    path = c.checkpoint_barrier(m.step, worker_state_bytes(model, m, epoch=2, batch=7))
    for _ in range(3):                                   # training goes on after the checkpoint
        m.pull()
        model(torch.randn(16, 4)).sum().backward()
        m.push()
    resp = c.restore(path)
    assert resp.step == 5 and resp.tables == 6      # BN weight and bias are parameters too
    for k, v in c.state_dict().items():
        np.testing.assert_array_equal(v, values[k], err_msg=f"{k} differs from the checkpoint")
    again = client_factory(cluster.address, job="bn")
    membership = again.join(name="w0", heartbeat=False)
    assert membership.restored and membership.rank == 0
    fresh = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    m2 = PSModel(fresh, again, optimizer=sgd(0.1))
    raw, step = again.worker_state()
    assert step == 5, "the step the checkpoint was cut at"
    assert load_worker_state(raw, fresh, m2) == (2, 7) and m2.step == 5
    assert torch.equal(fresh[1].running_mean, saved_bn)
