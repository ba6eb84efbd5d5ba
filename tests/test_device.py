"""Which device a worker trains on (``--device``, ``SHARDPS_DEVICE``), on any machine.

The choice is a pure function of the flag, the CUDA devices torch sees and the worker's slot
(``shardps.worker.device.resolve_device``): given a CUDA count, these tests decide as a GPU
machine would. The process tests run the real ``shardps worker``; those that need a machine
without CUDA skip where torch sees a GPU (tests/test_cuda.py runs there).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from shardps.errors import FailedPrecondition, InvalidArgument
from shardps.tools.cli import FLAGS, build_parser
from shardps.worker.device import module_device, resolve_device

SHARDPS = [sys.executable, "-m", "shardps.tools.cli"]
CPU = torch.device("cpu")
NO_CUDA_HERE = pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a GPU on this machine: "
                                  "these tests are about one without (tests/test_cuda.py runs here)")


def cuda(index: int) -> torch.device:
    return torch.device("cuda", index)


# ---------------------------------------------------------------- the choice, decided purely
@pytest.mark.parametrize("gpus", [0, 1, 4])
def test_cpu_is_the_cpu_whatever_gpus_there_are(gpus):
    assert resolve_device("cpu", gpus) == CPU
    assert resolve_device(" CPU ", gpus, {"LOCAL_RANK": "3"}, rank=2) == CPU


def test_auto_falls_back_to_the_cpu_without_cuda():
    assert resolve_device("auto", 0) == CPU
    assert resolve_device("auto", 0, {"LOCAL_RANK": "5"}, rank=7) == CPU


@pytest.mark.parametrize("gpus, env, rank, expected", [
    (1, {}, None, 0),                              # one GPU: cuda:0 for everyone
    (1, {"LOCAL_RANK": "3"}, 3, 0),
    (4, {"LOCAL_RANK": "2"}, None, 2),             # torchrun: LOCAL_RANK mod count
    (4, {"LOCAL_RANK": "6"}, None, 2),
    (2, {"LOCAL_RANK": "3"}, 0, 1),                # LOCAL_RANK wins over the rank
    (4, {}, 5, 1),                                 # no LOCAL_RANK: the worker's rank stands in
    (4, {"LOCAL_RANK": ""}, 3, 3),                 # empty is unset
    (4, {}, None, 0),                              # before the join: slot 0
])
def test_auto_and_cuda_take_the_local_rank_mod_the_gpu_count(gpus, env, rank, expected):
    for spec in ("auto", "cuda", "CUDA"):
        assert resolve_device(spec, gpus, env, rank=rank) == cuda(expected), spec


def test_cuda_n_is_that_gpu():
    assert resolve_device("cuda:1", 2, {"LOCAL_RANK": "0"}, rank=0) == cuda(1)
    assert resolve_device("cuda:0", 8) == cuda(0)


@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:3"])
def test_a_gpu_without_cuda_fails_naming_the_device_and_what_to_do(spec):
    with pytest.raises(FailedPrecondition) as err:
        resolve_device(spec, 0, no_cuda="torch 2.x+cpu is a CPU-only build")
    message = err.value.message
    assert f"--device {spec}:" in message and "no CUDA device" in message
    assert "torch 2.x+cpu is a CPU-only build" in message, "the reason torch sees no GPU"
    assert "--device cpu" in message and "--device auto" in message


def test_a_gpu_index_beyond_those_seen_fails_listing_those_there_are():
    with pytest.raises(FailedPrecondition, match=r"--device cuda:3: this process sees 2 CUDA device\(s\), "
                                                 r"cuda:0 to cuda:1"):
        resolve_device("cuda:3", 2)


@pytest.mark.parametrize("spec", ["tpu", "gpu", "", "cuda:", "cuda:-1", "cuda:x", "cuda:²", "cuda:1:2", "cpu:0", "mps"])
def test_garbage_is_refused_naming_the_value_and_the_choices(spec):
    for gpus in (0, 2):
        with pytest.raises(InvalidArgument) as err:
            resolve_device(spec, gpus)
        assert f"--device {spec!r}" in err.value.message
        assert "auto, cpu, cuda or cuda:N" in err.value.message and "SHARDPS_DEVICE" in err.value.message


@pytest.mark.parametrize("bad", ["x", "-1", "1.5", "²"])
def test_a_malformed_local_rank_is_refused_even_where_no_gpu_would_use_it(bad):
    for gpus in (0, 2):
        with pytest.raises(InvalidArgument, match=f"LOCAL_RANK='{bad}' is not an integer >= 0"):
            resolve_device("auto", gpus, {"LOCAL_RANK": bad})
    assert resolve_device("cuda:1", 2, {"LOCAL_RANK": bad}) == cuda(1), "cuda:N does not read it"


def test_module_device_is_where_the_parameters_are():
    assert module_device(nn.Linear(2, 2)) == CPU
    assert module_device(nn.Module()) == CPU, "no parameters: the CPU"
    bn = nn.BatchNorm1d(2, affine=False)                   # buffers only
    assert module_device(bn) == CPU


# ---------------------------------------------------------------- the flag
def test_the_flag_defaults_to_auto_and_reads_shardps_device():
    assert build_parser({}).parse_args(["worker"]).device == "auto"
    assert "--device" in FLAGS["worker"]
    assert "--device" in FLAGS["local"], "shardps local passes it to its workers"
    assert build_parser({"SHARDPS_DEVICE": "cuda:1"}).parse_args(["worker"]).device == "cuda:1"
    assert build_parser({"SHARDPS_DEVICE": "cuda:1"}).parse_args(["worker", "--device", "cpu"]).device == "cpu"


@pytest.mark.slow          # ~2.5 s: loads the digits, trains, evaluates
def test_the_baseline_trains_on_the_device_it_is_given():
    """``train_single_process`` (``shardps local --baseline``, the bench's one-process runs)."""
    from shardps.worker.runtime import train_single_process
    args = build_parser({}).parse_args(["worker", "--model", "digits-cnn", "--steps", "3", "--device", "cpu"])
    result = train_single_process(args)
    assert result.device == "cpu" and result.steps == 3
    assert result.line("baseline").endswith(" device=cpu")


@NO_CUDA_HERE
def test_the_baseline_refuses_a_gpu_it_does_not_see():
    from shardps.worker.runtime import train_single_process
    args = build_parser({}).parse_args(["worker", "--model", "digits-cnn", "--steps", "3", "--device", "cuda"])
    with pytest.raises(FailedPrecondition, match="--device cuda: no CUDA device"):
        train_single_process(args)


# ---------------------------------------------------------------- the real `shardps worker`
@pytest.mark.slow          # processes (shardps worker)
@pytest.mark.parametrize("argv, env, named", [
    (["--device", "tpu"], {}, "--device 'tpu': not a device"),
    ([], {"SHARDPS_DEVICE": "gpu"}, "--device 'gpu': not a device"),
    pytest.param(["--device", "cuda:3"], {}, "--device cuda:3: no CUDA device", marks=NO_CUDA_HERE),
])
def test_a_worker_given_a_device_it_cannot_use_fails_at_start_up(argv, env, named, tmp_path):
    """Before it contacts the manager: nothing listens at 127.0.0.1:1, and a worker that got
    past the check would wait for one (and time out here)."""
    import os
    out = subprocess.run(SHARDPS + ["worker", "--manager", "127.0.0.1:1"] + argv, capture_output=True,
                         text=True, timeout=60, env={**os.environ, **env}, cwd=tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "worker failed: " + named in out.stderr, out.stderr


@pytest.mark.slow          # a process (shardps worker), ~10 s
def test_a_worker_on_the_cpu_trains_and_says_where(make_cluster, tmp_path):
    cluster = make_cluster(1)
    result_file, ready_file = tmp_path / "result.json", tmp_path / "worker.ready"
    out = subprocess.run(SHARDPS + ["worker", "--manager", cluster.address, "--name", "w0", "--job", "dev",
                                    "--device", "cpu", "--model", "digits-cnn", "--steps", "4",
                                    "--result-file", str(result_file), "--ready-file", str(ready_file)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(result_file.read_text())
    assert result["device"] == "cpu" and result["steps"] == 4
    assert 0.0 <= result["metrics"]["test_accuracy"] <= 1.0
    assert json.loads(ready_file.read_text())["device"] == "cpu"
    assert "(device cpu)" in out.stderr, "the joined line names the device"
    final = [line for line in out.stdout.splitlines() if line.startswith("shardps worker rank=")]
    assert final and final[-1].endswith(" device=cpu"), out.stdout


def test_a_gpu_workers_state_restores_on_the_cpu_and_a_malformed_generator_is_refused():
    """A GPU worker's checkpointed state carries its GPU generator (``cuda_rng``): a CPU
    worker taking its rank ignores it; anything but a uint8 tensor there is refused."""
    from shardps.worker import local_state
    from shardps.worker.model_io import load_worker_state
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    ps_model = type("PS", (), {"dense": {"0.weight", "0.bias", "1.weight", "1.bias"}, "step": 0})()
    state = {"step": 7, "epoch": 1, "batch": 2, "local": {"1.running_mean": torch.ones(2)},
             "torch_rng": torch.get_rng_state(), "cuda_rng": torch.zeros(16, dtype=torch.uint8)}
    assert load_worker_state(local_state.encode(state), model, ps_model) == (1, 2) and ps_model.step == 7
    assert torch.equal(model[1].running_mean, torch.ones(2))
    with pytest.raises(InvalidArgument, match="cuda_rng"):
        load_worker_state(local_state.encode({**state, "cuda_rng": torch.zeros(4)}), model, ps_model)
