"""The TorchX component (``tools/torchx_job.py:job``): a manager, servers and torchrun workers
for one job, the cluster ending with the job. It runs for real under TorchX's ``local_cwd``
scheduler (processes on this machine, the examples' hybrid script as the workers'), and its
Kubernetes (Volcano) and Slurm requests come from TorchX's dry run, the pods validated
against Kubernetes' schemas. Plus the pieces it stands on: ``shardps manager
--exit-when-job-ends`` (``JobEnding``) and ``--advertise HOST``."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shardps.server.manager.ending import JobEnding
from shardps.server.processes import advertised
from shardps.settings import Serving
from tests.test_k8s import KUBERNETES_VERSIONS, kubernetes_validate

ROOT = Path(__file__).resolve().parent.parent
COMPONENT = str(ROOT / "tools" / "torchx_job.py") + ":job"
BIN = Path(sys.executable).parent           # torchx, torchrun and shardps of this environment

torchx = pytest.importorskip("torchx", reason="torchx belongs to the dev extra (pip install -e '.[dev]')")


# ---------------------------------------------------------------- the pieces
def test_a_cluster_for_one_job_ends_when_the_job_ended_or_was_asked_to():
    e = JobEnding("j")
    assert not e.job_ended(set()) and not e.job_ended({"other"})        # not started yet
    assert not e.job_ended({"j"}) and e.job_ended(set())                # existed, then ended
    assert not e.tell("s0") and not e.may_exit([])                       # not closed: serve on
    e.close()
    assert e.tell("s0") and not e.may_exit(["s0", "s1"]) and e.tell("s1") and e.may_exit(["s0", "s1"])
    never = JobEnding("j")
    never.end_asked("other")
    assert not never.job_ended(set())
    never.end_asked("j")                    # the workers failed before creating it
    assert never.job_ended(set()) and not never.job_ended({"j"})


def test_advertise_a_bare_host_gets_the_bound_port():
    assert advertised(Serving(listen="0.0.0.0:0", advertise="10.1.2.3"), 4321) == "10.1.2.3:4321"
    assert advertised(Serving(listen="0.0.0.0:0", advertise="[fd00::7]"), 4321) == "[fd00::7]:4321"
    assert advertised(Serving(listen="0.0.0.0:0", advertise="ps-0.ps:7071"), 4321) == "ps-0.ps:7071"


# ---------------------------------------------------------------- the component
def _dryrun(scheduler: str, *args: str, cfg: dict | None = None):
    from torchx.runner import get_runner
    with get_runner() as runner:
        return runner.dryrun_component(COMPONENT, list(args), scheduler, cfg=cfg or {}, workspace=None)


def test_the_component_refuses_unclear_arguments():
    from shardps.tools.torchx_job import job  # the file TorchX loads, as a module
    with pytest.raises(ValueError, match="exactly one of --script and -m"):
        job(script="a.py", m="pkg.train")
    with pytest.raises(ValueError, match="workers='2x'"):
        job(script="a.py", workers="2x")
    with pytest.raises(ValueError, match="workers='3:2x1'"):
        job(script="a.py", workers="3:2x1")


@pytest.mark.slow          # TorchX's Kubernetes scheduler and the schemas load: about 2 s
def test_kubernetes_gets_a_volcano_job_whose_pods_validate():
    kv = kubernetes_validate()
    info = _dryrun("kubernetes", "--script", "train.py", "--servers", "2", "--workers", "1:2x4", "--gpu", "4",
                   "--checkpoint_dir", "/checkpoints",
                   "--mounts", "type=volume,src=shardps-checkpoints,dst=/checkpoints",
                   "--", "--epochs", "3", cfg={"queue": "default"})
    job = yaml.safe_load(str(info.request))         # the resource TorchX submits, as YAML
    assert (job["apiVersion"], job["kind"]) == ("batch.volcano.sh/v1alpha1", "Job")
    tasks = {t["name"]: t for t in job["spec"]["tasks"]}
    assert sorted(tasks) == ["manager-0", "server-0", "server-1", "worker-0", "worker-1"]
    for name, task in tasks.items():
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": task["template"]["spec"]}
        for version in KUBERNETES_VERSIONS:
            kv.validate(pod, version, strict=True)
    command = {name: t["template"]["spec"]["containers"][0]["command"][2] for name, t in tasks.items()}
    app = job["metadata"]["name"]
    assert f"--exit-when-job-ends '{app}' --checkpoint-dir /checkpoints" in command["manager-0"]
    manager = tasks["manager-0"]["template"]["spec"]       # the checkpoints on the claimed volume
    claim = next(v for v in manager["volumes"] if "persistentVolumeClaim" in v)
    assert claim["persistentVolumeClaim"]["claimName"] == "shardps-checkpoints"
    assert {"name": claim["name"], "mountPath": "/checkpoints"}.items() <= next(
        m for m in manager["containers"][0]["volumeMounts"] if m["name"] == claim["name"]).items()
    # every role finds the manager through the first role's host, as TorchX names it on Volcano
    assert '--manager "${VC_MANAGER_0_HOSTS:-localhost}:7070"' in command["server-1"]
    assert "--name server-1" in command["server-1"] and "--name server-0" in command["server-0"]
    worker = command["worker-0"]
    assert "torchrun --nnodes 1:2 --nproc_per_node 4" in worker and "train.py --epochs 3" in worker
    assert '--rdzv_endpoint "${VC_WORKER_0_HOSTS:-' in worker
    assert re.search(rf"shardps job end '{app}' .*--wait-workers 60\nexit \$trained$", worker)
    limits = tasks["worker-0"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert str(limits["nvidia.com/gpu"]) == "4"


@pytest.mark.slow
def test_slurm_gets_a_heterogeneous_batch_job():
    script = str(_dryrun("slurm", "--script", "train.py", "--servers", "3", "--workers", "2x2"))
    assert script.count("#SBATCH hetjob") == 1 + 3 + 2 - 1
    assert '--manager "${SLURM_JOB_NODELIST_HET_GROUP_0:-localhost}:7070"' in script
    # the workers' first node is component 1 + 3 servers
    assert "${SLURM_JOB_NODELIST_HET_GROUP_4:-localhost}}:29500" in script


# ---------------------------------------------------------------- for real
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchx_run(tmp_path: Path, port: int, *args: str) -> tuple[int, str]:
    """``torchx run -s local_cwd`` of the component: its exit status and its output. On a
    timeout it is stopped by SIGTERM, which TorchX turns into stopping the app's processes."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([str(BIN / "torchx"), "run", "-s", "local_cwd", "-cfg", f"log_dir={tmp_path}",
                             COMPONENT, "--manager_port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
        pytest.fail(f"torchx run did not finish in 240 s:\n{out[-4000:]}")
    return proc.returncode, out


def _left_running(port: int, log: str) -> str:
    """Processes of the app still running: the manager and servers name its port, torchrun the app."""
    app = re.search(r"local_cwd://torchx/(\S+)", log).group(1)
    return subprocess.run(["pgrep", "-af", f"shardps .*:{port}( |$)|{app}"], capture_output=True, text=True).stdout


@pytest.mark.slow        # processes: TorchX, a manager, 2 servers, torchrun and 2 workers
def test_torchx_local_cwd_runs_a_hybrid_job_to_completion_and_the_cluster_exits(tmp_path):
    port = _free_port()
    rc, log = _torchx_run(tmp_path, port, "--script", "examples/hybrid_ctr.py", "--servers", "2", "--workers", "1x2",
                          "--checkpoint_dir", str(tmp_path / "checkpoints"), "--", "--steps", "60",
                          "--checkpoint-every", "20")
    assert rc == 0 and "Job finished: SUCCEEDED" in log, log[-4000:]
    auc = float(re.search(r"rank 0: 60 steps, .*test_auc=([0-9.]+)", log).group(1))
    assert auc > 0.6, log[-4000:]           # it trained: 0.5 is chance
    assert re.search(r"manager/0 .* job \S+ ended: every server is told to exit", log)
    assert len(re.findall(r"server/\d .* was retired", log)) == 2
    assert _left_running(port, log) == ""
    # the checkpoints the script cut every 20 steps outlive the cluster (--checkpoint_dir)
    assert len([p for p in (tmp_path / "checkpoints").rglob("manifest.json")]) == 3, log[-3000:]


@pytest.mark.slow
def test_a_failing_script_fails_the_app_and_still_ends_the_cluster(tmp_path):
    port = _free_port()
    rc, log = _torchx_run(tmp_path, port, "--script", "examples/hybrid_ctr.py", "--servers", "1", "--workers",
                          "1x1", "--max_restarts", "0", "--", "--no-such-flag")
    assert rc != 0 and "Job finished: FAILED" in log, log[-4000:]
    assert "unrecognized arguments: --no-such-flag" in log
    assert re.search(r"server/0 .* was retired", log), log[-4000:]      # the job never existed: ended all the same
    assert _left_running(port, log) == ""
