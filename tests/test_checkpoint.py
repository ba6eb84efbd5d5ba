"""Checkpoints of a training job: on demand while workers train, and worker state round trip."""

import io
import pickle
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from torch import nn

from shardps.errors import InvalidArgument
from shardps.server.manager.checkpoint_files import read_checkpoint
from shardps.tables import sgd
from shardps.tools.local import LocalCluster
from shardps.worker import local_state
from shardps.worker.client import PSClient
from shardps.worker.device import no_cuda_reason
from shardps.worker.model_io import load_worker_state, worker_state_bytes
from shardps.worker.torch_ps import PSModel


@pytest.mark.slow          # processes (LocalCluster)
def test_on_demand_checkpoint_while_two_workers_train(tmp_path):
    with LocalCluster(servers=2, work_dir=str(tmp_path / "cluster")) as cluster:
        # paced (about 20 s of training) so that both are still training when the on-demand
        # request comes: a worker that finished has left the group and is not in the cut
        workers = [cluster.start_worker(f"worker-{i}", ["--job", "demo", "--model", "digits-cnn", "--epochs", "12",
                                                        "--step-delay", "0.06"])
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
        out = subprocess.run([sys.executable, "-m", "shardps.tools.cli", "checkpoint", "demo", "--manager",
                              cluster.manager_address], capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stderr
        path = out.stdout.split()[0]
        ck = read_checkpoint(path)
        assert sorted(ck.workers) == [0, 1], "both workers' local state is in the checkpoint"
        assert {t["spec"]["name"] for t in ck.tables} == {"dense-params"}    # the CNN's parameters, one bucket
        state = local_state.decode(ck.workers[0])
        assert state["step"] >= 20 and state["torch_rng"].dtype == torch.uint8
        print(f"checkpoint {path}: step {ck.step}, {len(ck.tables)} tables, worker steps "
              f"{[local_state.decode(b)['step'] for b in ck.workers.values()]}")
        for p in workers:
            p.popen.communicate(timeout=300)
            assert p.popen.returncode == 0, p.log_path.read_text()[-2000:]


_NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason=f"needs a CUDA device: {no_cuda_reason() or 'torch sees none'}")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_NEEDS_CUDA)])
def test_worker_state_survives_a_restore(make_cluster, client_factory, tmp_path, device):
    """The worker's local state (batch-norm statistics on the model's device, the random
    generator dropout draws from: the CPU's, or on a GPU the GPU's) survives a restore into a
    fresh module on that device, and the restored tables reach it."""
    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")

    def rng_state() -> torch.Tensor:
        return torch.cuda.get_rng_state(dev) if dev.type == "cuda" else torch.get_rng_state()

    def make():
        return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 1)).to(dev)

    cluster = make_cluster(2)
    cluster.manager.service.checkpoints.default_dir = str(tmp_path)
    c = client_factory(cluster.address, job=f"bn-{device}")
    c.create_job()
    c.join(name="w0", heartbeat=False)
    torch.manual_seed(0)
    model = make()
    m = PSModel(model, c, optimizer=sgd(0.1))
    m.create_tables()
    for _ in range(5):
        m.pull()
        model(torch.randn(16, 4, device=dev) * 3 + 1).sum().backward()
        m.push()
    saved_bn, saved_rng = model[1].running_mean.clone(), rng_state()
    values = c.state_dict()
    path = c.checkpoint_barrier(m.step, worker_state_bytes(model, m, epoch=2, batch=7))
    for _ in range(3):                                   # training (and dropout) goes on after the checkpoint
        m.pull()
        model(torch.randn(16, 4, device=dev)).sum().backward()
        m.push()
    assert not torch.equal(rng_state(), saved_rng)
    resp = c.restore(path)
    assert resp.step == 5 and resp.tables == 1      # one bucket: the Linears' and BN's weights and biases
    for k, v in c.state_dict().items():
        np.testing.assert_array_equal(v, values[k], err_msg=f"{k} differs from the checkpoint")
    again = client_factory(cluster.address, job=f"bn-{device}")
    membership = again.join(name="w0", heartbeat=False)
    assert membership.restored and membership.rank == 0
    fresh = make()
    m2 = PSModel(fresh, again, optimizer=sgd(0.1))
    raw, step = again.worker_state()
    assert step == 5, "the step the checkpoint was cut at"
    assert load_worker_state(raw, fresh, m2) == (2, 7) and m2.step == 5
    assert fresh[1].running_mean.device == dev
    assert torch.equal(fresh[1].running_mean, saved_bn)
    assert torch.equal(rng_state(), saved_rng), f"the {device} generator is restored"
    m2.pull()
    np.testing.assert_array_equal(torch.cat([p.detach().cpu().reshape(-1) for p in fresh.parameters()]).numpy(),
                                  values["dense-params"])       # the parameters end to end


class _WritesAMarker:
    """Unpickling this runs ``exec``: what a compromised worker would upload as its state."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def test_a_pickled_worker_state_is_refused_and_never_run(make_cluster, client_factory, tmp_path):
    """Rank 0's state, uploaded through the manager by one worker, reaches whichever worker takes
    rank 0 after a restore: a pickle in it must not run there."""
    marker = tmp_path / "marker"
    cluster = make_cluster(2)
    cluster.manager.service.checkpoints.default_dir = str(tmp_path / "checkpoints")
    c = client_factory(cluster.address, job="evil")
    c.create_job()
    c.join(name="w0", heartbeat=False)
    model = nn.Sequential(nn.Linear(2, 1))
    m = PSModel(model, c, optimizer=sgd(0.1))
    m.create_tables()
    evil = io.BytesIO()
    torch.save({"step": 1, "epoch": 0, "batch": 0, "local": {}, "torch_rng": torch.get_rng_state(),
                "x": _WritesAMarker(marker)}, evil)
    path = c.checkpoint_barrier(1, evil.getvalue())
    c.restore(path)
    victim = client_factory(cluster.address, job="evil")
    assert victim.join(name="w0", heartbeat=False).restored
    raw, _ = victim.worker_state()
    for blob in (raw, pickle.dumps(_WritesAMarker(marker))):
        with pytest.raises(InvalidArgument, match="pickle"):
            load_worker_state(blob, model, m)
    assert not marker.exists(), "the pickled state ran code in the worker that loaded it"


def test_worker_state_round_trips_without_pickle():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    model(torch.randn(8, 3))                               # running statistics move
    ps_model = type("PS", (), {"dense": {"0.weight", "0.bias"}, "step": 42})()
    raw = worker_state_bytes(model, ps_model, epoch=3, batch=9)
    assert raw[:1] != b"\x80" and b"shardps.worker_state/1" in raw[:4096]
    rng = torch.get_rng_state()
    torch.rand(5)                                          # the generator moves on
    fresh = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    ps_model.step = 0
    assert load_worker_state(raw, fresh, ps_model) == (3, 9) and ps_model.step == 42
    assert torch.equal(torch.get_rng_state(), rng)
    for key in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
        assert torch.equal(fresh.state_dict()[key], model.state_dict()[key]), key
    nested = {"state": {0: {"exp_avg": torch.ones(2)}}, "groups": [{"lr": 0.1, "params": (0, 1)}],
              "none": None, "__tensor__": "not a reference"}
    back = local_state.decode(local_state.encode(nested))
    assert torch.equal(back["state"][0]["exp_avg"], torch.ones(2))
    assert back["groups"] == [{"lr": 0.1, "params": [0, 1]}] and back["none"] is None
    assert back["__tensor__"] == "not a reference"
    for bad in (b"", b"junk", raw[:20], raw.replace(b"shardps.worker_state/1", b"shardps.worker_state/9")):
        with pytest.raises(InvalidArgument, match="worker state"):
            local_state.decode(bad)


def test_checkpoints_of_jobs_sharing_a_prefix_stay_apart(tmp_path):
    """``<root>/<job>/<id>``: job "a" with id "b-c" and job "a-b" with id "c" no longer share
    ``<root>/a-b-c``; ``latest`` finds each job's own, in either layout."""
    import json
    import shutil

    from shardps.protos.v1 import common_pb2 as pb
    from shardps.server.manager.checkpoint_files import latest, write_checkpoint
    write = lambda job, cid: write_checkpoint(tmp_path, job, cid, 1, pb.Consistency(), [], {},  # noqa: E731
                                              {0: job.encode()})
    a_b = write("a-b", "c")
    a = write("a", "b-c")
    assert read_checkpoint(a_b).workers[0] == b"a-b" and read_checkpoint(a).workers[0] == b"a"
    assert latest(tmp_path, "a") == a and latest(tmp_path, "a-b") == a_b
    old = tmp_path / "a-b-old"                     # the flat layout of earlier versions
    shutil.copytree(a_b, old)
    manifest = json.loads((old / "manifest.json").read_text())
    (old / "manifest.json").write_text(json.dumps(dict(manifest, created=manifest["created"] + 1)))
    assert latest(tmp_path, "a-b") == old and latest(tmp_path, "a") == a
    with pytest.raises(InvalidArgument, match="checkpoint_id"):
        write("a", "../a-b/c")
