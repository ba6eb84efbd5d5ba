"""Hybrid training: ``PSModel(..., dense="allreduce")`` keeps a model's dense parameters on the
workers, averaged by torch's DistributedDataParallel, and its embedding tables on the servers.
The script runs unchanged under plain torchrun (``python -m torch.distributed.run``: its c10d
rendezvous and environment) against real servers on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from torch import nn

from shardps.errors import FailedPrecondition, InvalidArgument
from shardps.tables import adagrad
from shardps.worker.torch_ps import PSEmbedding, PSModel
from tests.waiting import alive, wait_for

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.nn.functional as F
    from torch import nn
    from shardps.worker import PSClient, adagrad
    from shardps.worker.torch_ps import PSEmbedding, PSModel

    class CTR(nn.Module):
        def __init__(self):
            super().__init__()
            self.items = PSEmbedding(1000, 8, optimizer=adagrad(lr=0.1))     # rows on the servers
            self.head = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))   # all-reduced

        def forward(self, ids):
            return self.head(self.items(ids).mean(dim=1)).squeeze(1)

    rank = int(os.environ["RANK"])
    torch.manual_seed(rank)                    # different initial values: DDP starts every rank from rank 0's
    client = PSClient()                        # SHARDPS_MANAGER, SHARDPS_JOB
    client.create_job()
    client.join()
    module = CTR()
    model = PSModel(module, client, dense="allreduce",
                    dense_optimizer=torch.optim.SGD(module.parameters(), lr=0.5))
    model.create_tables()
    first = [p.detach().clone() for p in module.parameters()]
    g = torch.Generator().manual_seed(100 + rank)          # each rank its own batches
    losses = []
    for step in range(30):
        if step == 10 and "--die-once" in sys.argv and rank == 1 and not os.path.exists(sys.argv[1] + ".died"):
            open(sys.argv[1] + ".died", "w").close()
            os.kill(os.getpid(), 9)                        # SIGKILL: torchrun restarts the whole group
        ids = torch.randint(0, 1000, (64, 3), generator=g)
        clicks = (ids[:, 0] % 2).float()
        model.pull()
        loss = F.binary_cross_entropy_with_logits(model(ids), clicks)
        loss.backward()
        model.push()
        losses.append(float(loss))
    model.flush()
    tables = sorted(t.name for t in client.tables())
    json.dump({"first": [p.tolist() for p in first], "last": [p.detach().tolist() for p in module.parameters()],
               "losses": losses, "tables": tables, "world_size": client.membership.world_size,
               "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))},
              open(sys.argv[1] + f".{rank}.json", "w"))
    client.leave()
    client.close()
""")


@pytest.mark.slow          # processes (torchrun and its 2 workers)
def test_a_hybrid_script_runs_under_plain_torchrun(cluster, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "SHARDPS_MANAGER": cluster.address, "SHARDPS_JOB": "hybrid", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script), str(tmp_path / "out")], capture_output=True, text=True, timeout=300,
                         env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    got = [json.loads((tmp_path / f"out.{r}.json").read_text()) for r in (0, 1)]
    # DDP broadcast rank 0's initial values, then averaged every step's gradients: the dense
    # parameters agree on both ranks, bit for bit, though each trained on its own batches
    assert got[0]["first"] == got[1]["first"] and got[0]["last"] == got[1]["last"]
    assert got[0]["last"] != got[0]["first"]
    # only the embedding is a table on the servers: the dense parameters never went there
    assert got[0]["tables"] == ["items"] and got[0]["world_size"] == 2
    for g in got:
        assert np.mean(g["losses"][-5:]) < np.mean(g["losses"][:5]), g["losses"]


class _Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.items = PSEmbedding(100, 4, optimizer=adagrad(lr=0.1))
        self.head = nn.Linear(4, 1)

    def forward(self, ids):
        return self.head(self.items(ids).mean(dim=1)).squeeze(1)


def test_allreduce_needs_a_torch_optimizer_and_a_process_group(cluster, client_factory, monkeypatch):
    import torch.distributed as dist
    assert not dist.is_initialized()
    client = client_factory(cluster.address, job="hybrid-args")
    client.create_job()
    module = _Small()
    with pytest.raises(InvalidArgument, match="pass dense_optimizer=torch.optim"):
        PSModel(module, client, dense="allreduce")
    with pytest.raises(InvalidArgument, match="dense='ring'"):
        PSModel(module, client, dense="ring")
    with pytest.raises(InvalidArgument, match="dense_optimizer is for dense='allreduce'"):
        PSModel(module, client, dense_optimizer=torch.optim.SGD(module.parameters(), lr=0.1))
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(FailedPrecondition, match="start the workers with torchrun or `shardps run --elastic`"):
        PSModel(module, client, dense="allreduce", dense_optimizer=torch.optim.SGD(module.parameters(), lr=0.1))


def test_one_worker_trains_in_hybrid_mode_and_exports_plain_weights(cluster, client_factory, tmp_path):
    import torch.distributed as dist
    import torch.nn.functional as F
    client = client_factory(cluster.address, job="hybrid-one")
    client.create_job()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        module = _Small()
        model = PSModel(module, client, dense="allreduce", dense_optimizer=torch.optim.Adam(module.parameters(), 1e-2))
        model.create_tables()
        before = module.head.weight.detach().clone()
        for _ in range(5):
            model.pull()
            F.mse_loss(model(torch.tensor([[1, 2], [3, 4]])), torch.ones(2)).backward()
            model.push()
        model.flush()
        assert not torch.equal(before, module.head.weight)              # stepped on the worker
        assert [t.name for t in client.tables()] == ["items"]
        state = model.state_dict()                                      # the servers' rows, the worker's head
        assert set(state) == {"items.weight", "head.weight", "head.bias"}
        assert torch.equal(state["head.weight"], module.head.weight.detach())
        with pytest.raises(InvalidArgument, match=r"call the PSModel \(model\(x\)\), not the module it wraps"):
            module(torch.tensor([[1, 2]]))               # a training forward past DDP: not averaged
        model.eval()
        assert not model._ddp.training and not module.training
        with torch.no_grad():
            module(torch.tensor([[1, 2]]))               # evaluation may call the module itself
    finally:
        dist.destroy_process_group()


def _train_hybrid(client, steps: int, announce_before_backward: bool, watch_step: int = -1):
    """``steps`` hybrid steps with ``overlap`` (lookahead 2) on one rank, the batch two steps
    ahead announced before or after each backward pass. At ``watch_step``: whether the
    servers held the step's push before ``push()`` was called. Returns (model, that)."""
    torch.manual_seed(0)
    module = _Small()
    model = PSModel(module, client, dense="allreduce", overlap=True, lookahead=2,
                    dense_optimizer=torch.optim.SGD(module.parameters(), lr=0.1))
    model.create_tables()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 100, (8, 2), generator=g) for _ in range(steps)]
    pushed_in_backward = None
    for i, ids in enumerate(batches):
        model.pull()
        if i == watch_step:
            model.flush()                              # every earlier push has reached the servers
            before = client.pull_rows("items", ids.unique().numpy())
        loss = torch.nn.functional.mse_loss(model(ids), torch.ones(8))
        ahead = batches[i + 2] if i + 2 < steps else None
        if ahead is not None and announce_before_backward:
            model.module.items.request_prefetch(ahead)
        loss.backward()
        if i == watch_step:
            def changed(ids=ids, before=before) -> bool:
                return not np.array_equal(client.pull_rows("items", ids.unique().numpy()), before)
            if announce_before_backward:         # in flight from the backward pass: arrives
                wait_for("the push sent from the backward pass", changed, timeout=10, interval=0.01)
            pushed_in_backward = changed()       # without it, nothing was sent yet
        if ahead is not None and not announce_before_backward:
            model.module.items.request_prefetch(ahead)
        model.push()
    model.flush()
    return model, pushed_in_backward


@pytest.mark.slow          # two hybrid models against the cluster
def test_a_hybrid_push_leaves_from_the_backward_pass_with_the_same_results(cluster, client_factory, tmp_path):
    """With the next lookups announced before ``loss.backward()``, the step's push (with their
    pull) reaches the servers from the backward pass, before ``push()``; announced after it,
    ``push()`` sends the same exchange. Both give the same values, bit for bit."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        runs = {}
        for early in (True, False):
            client = client_factory(cluster.address, job=f"backward-{early}")
            client.create_job()
            model, in_backward = _train_hybrid(client, 8, announce_before_backward=early, watch_step=5)
            assert in_backward is early
            head = [p.detach() for p in model.module.head.parameters()]
            runs[early] = (client.pull_rows("items", np.arange(100)), head)
        assert np.array_equal(runs[True][0], runs[False][0])
        assert all(torch.equal(a, b) for a, b in zip(runs[True][1], runs[False][1]))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow          # a hybrid model against the cluster
def test_a_second_backward_after_the_push_left_is_pushed_too(cluster, client_factory, tmp_path):
    """Gradient accumulation (two forward and backward passes per push): the first backward
    sends the push; the second's rows are pushed by ``push()``, and later steps push there."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        client = client_factory(cluster.address, job="accumulate")
        client.create_job()
        model, _ = _train_hybrid(client, 3, announce_before_backward=True)
        first, second = torch.tensor([[1, 2]]), torch.tensor([[90, 91]])
        before = client.pull_rows("items", np.array([90, 91]))
        model.module.items.request_prefetch(torch.tensor([[5, 6]]))
        for ids in (first, second):
            torch.nn.functional.mse_loss(model(ids), torch.ones(1)).backward()
        model.push()
        model.flush()
        assert model._backward_push is None
        assert not np.array_equal(client.pull_rows("items", np.array([90, 91])), before)
        # the next step, announced before its backward pass, still pushes at push() only
        ids = torch.tensor([[40, 41]])
        before = client.pull_rows("items", np.array([40, 41]))
        loss = torch.nn.functional.mse_loss(model(ids), torch.ones(1))
        model.module.items.request_prefetch(torch.tensor([[7, 8]]))
        loss.backward()
        deadline = time.monotonic() + 1.0            # a push from the hook would arrive in milliseconds
        while time.monotonic() < deadline:
            assert np.array_equal(client.pull_rows("items", np.array([40, 41])), before)
            time.sleep(0.02)
        model.push()
        model.flush()
        assert not np.array_equal(client.pull_rows("items", np.array([40, 41])), before)
    finally:
        dist.destroy_process_group()


def test_ranks_sharing_a_gpu_all_reduce_by_gloo_and_one_gpu_each_by_nccl():
    from shardps.worker.hybrid import backend_for
    cuda = torch.device("cuda", 0)
    assert backend_for(torch.device("cpu"), 4, 0) == "gloo"
    assert backend_for(cuda, 1, 1) == "nccl" and backend_for(cuda, 8, 8) == "nccl"
    # NCCL refuses two ranks on one device: torchrun --nproc-per-node 2 on a 1-GPU host
    assert backend_for(cuda, 2, 1) == "gloo" and backend_for(cuda, 9, 8) == "gloo"


def test_elastic_runs_torchrun_with_the_cluster_added():
    from shardps.tools.launch import elastic_command
    assert elastic_command(["train.py", "--epochs", "3"], 2, python="py") == [
        "py", "-m", "shardps.tools.elastic_agent", "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "3",
        "--standalone", "train.py", "--epochs", "3"]
    assert elastic_command(["./train"], 4, "2:4", 1, "m0:29400", python="py")[5:] == [
        "--nproc-per-node", "4", "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "m0:29400",
        "--no-python", "./train"]
    with pytest.raises(InvalidArgument, match="--rdzv-endpoint HOST:PORT"):
        elastic_command(["train.py"], 2, "2")
    with pytest.raises(InvalidArgument, match="--nnodes 'two'"):
        elastic_command(["train.py"], 2, "two")


@pytest.mark.slow          # processes (shardps run, torchrun and 2 workers, twice)
def test_under_shardps_run_elastic_a_killed_worker_restarts_the_whole_group(cluster, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "shardps.tools.cli", "run", "--manager", cluster.address, "--job",
                          "hybrid-elastic", "--elastic", "--nproc-per-node", "2", "--max-restarts", "1",
                          str(script), str(tmp_path / "out"), "--die-once"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "out.died").exists()                 # rank 1 was killed once
    got = [json.loads((tmp_path / f"out.{r}.json").read_text()) for r in (0, 1)]
    assert [g["restart"] for g in got] == [1, 1]            # both ranks: the group's second round
    assert got[0]["last"] == got[1]["last"] and got[0]["tables"] == ["items"]


@pytest.mark.slow          # processes (shardps run, torchrun and 2 shardps workers)
def test_shardps_worker_ranks_of_one_host_under_shardps_run_elastic_are_distinct_members(cluster):
    """``shardps worker`` without --name under torchrun: each rank joins as HOST-rankN (once
    both took the host's name, and each join fenced the other's)."""
    import re
    import socket
    out = subprocess.run([sys.executable, "-m", "shardps.tools.cli", "run", "--manager", cluster.address, "--job",
                          "hybrid-worker", "--elastic", "--nproc-per-node", "2", "--max-restarts", "0",
                          sys.executable, "-m", "shardps.tools.cli", "worker", "--model", "ctr", "--dense", "allreduce",
                          "--train-samples", "20000", "--torch-threads", "1"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    finals = re.findall(r"shardps worker rank=(\d) steps=(\d+) test_auc=([0-9.]+)", out.stdout)
    assert sorted(f[0] for f in finals) == ["0", "1"], out.stdout[-3000:]
    assert finals[0][1] == finals[1][1]                       # the same steps (DDP)
    assert "fenced" not in out.stderr and "membership lost" not in out.stderr, out.stderr[-3000:]
    host = socket.gethostname()
    assert f"node={host}-rank0" in out.stderr and f"node={host}-rank1" in out.stderr


@pytest.mark.slow          # processes (shardps local: a manager, 2 servers, 2 workers)
def test_shardps_local_trains_the_digits_with_dense_allreduce(tmp_path):
    import re
    out = subprocess.run([sys.executable, "-m", "shardps.tools.cli", "local", "--servers", "2", "--port", "0",
                          "--workers", "2", "--model", "digits-cnn", "--dense", "allreduce", "--epochs", "8",
                          "--work-dir", str(tmp_path), "--result-file", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    accuracy = float(re.search(r"mean test_accuracy=([0-9.]+)", out.stdout).group(1))
    assert accuracy > 0.95, out.stdout
    results = [json.loads((tmp_path / f"r-worker-{i}.json").read_text()) for i in (0, 1)]
    assert results[0]["steps"] == results[1]["steps"] > 0          # DDP: every worker the same steps
    # the same parameters; batch-norm statistics differ by each worker's last batch (DDP broadcasts
    # rank 0's buffers at each forward, as in any DDP job)
    assert abs(results[0]["metrics"]["test_accuracy"] - results[1]["metrics"]["test_accuracy"]) < 0.03


def test_a_learning_rate_schedule_reaches_the_workers_own_optimizer(cluster, client_factory, tmp_path):
    import torch.distributed as dist
    client = client_factory(cluster.address, job="hybrid-lr")
    client.create_job()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        module = _Small()
        model = PSModel(module, client, optimizer=adagrad(0.2), dense="allreduce",
                        dense_optimizer=torch.optim.SGD(module.parameters(), lr=0.5))
        model.create_tables()
        model.set_lr(lambda base: base * 0.1, tables=False)          # another rank's: its own optimizer only
        assert model.local_optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
        assert client.refresh_map().table("hybrid-lr", "items").config.optimizer.lr == pytest.approx(0.1)
        model.set_lr(lambda base: base * 0.01)                       # rank 0's: the tables too, from their bases
        assert model.local_optimizer.param_groups[0]["lr"] == pytest.approx(0.005)
        assert client.refresh_map().table("hybrid-lr", "items").config.optimizer.lr == pytest.approx(0.001)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow          # processes (shardps run, torchrun and 2 workers)
def test_the_elastic_agent_and_its_workers_die_with_shardps_run(tmp_path):
    import signal
    script = tmp_path / "sleeper.py"
    script.write_text("import os, sys, time\n"
                      "open(sys.argv[1] + '.' + os.environ['RANK'], 'w').write(str(os.getpid()))\n"
                      "time.sleep(600)\n")
    run = subprocess.Popen([sys.executable, "-m", "shardps.tools.cli", "run", "--manager", "127.0.0.1:1", "--job",
                            "sleepers", "--elastic", "--nproc-per-node", "2", str(script), str(tmp_path / "pid")],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    try:
        files = [tmp_path / f"pid.{r}" for r in (0, 1)]
        wait_for("both workers to start", lambda: all(f.exists() and f.read_text() for f in files)
                 or run.poll() is not None, 120, 0.2)
        assert run.poll() is None, "shardps run ended before its workers started"
        pids = [int((tmp_path / f"pid.{r}").read_text()) for r in (0, 1)]
        run.send_signal(signal.SIGKILL)                  # no chance to stop anything itself
        run.wait()
        wait_for("the workers to die with shardps run", lambda: not any(alive(p) for p in pids), 60, 0.2)
    finally:
        if run.poll() is None:
            run.kill()
