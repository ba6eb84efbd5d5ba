"""A shardps job as a TorchX component: a manager, servers and torchrun workers, for one job.

TorchX (``pip install 'shardps[torchx]'``) launches the same component locally, on
Kubernetes (Volcano) or on Slurm. The cluster lives as long as the job: the workers run
your script under ``torchrun`` (its c10d rendezvous, so a hybrid script's process group
forms as under plain torchrun), then end the job once its worker group is empty, and the
manager (``--exit-when-job-ends``) tells the servers to exit and exits: the app ends
SUCCEEDED when the workers succeeded, FAILED when they did not. Save what you keep (export
the embeddings, ``maybe_checkpoint`` into a checkpoint directory on a volume) before the
script returns: the tables go with the cluster.

    torchx run -s local_cwd tools/torchx_job.py:job --script examples/hybrid_ctr.py \\
        --servers 2 --workers 1x2 -- --steps 200
    torchx run -s kubernetes --dryrun tools/torchx_job.py:job --script train.py ...

How the roles find each other: the manager is the first role, so TorchX's ``rank0_env``
names its host in every replica (``localhost`` under local schedulers, the manager pod's
name under Kubernetes, the first node of the allocation under Slurm). Servers listen on a
free port and advertise their own address (``hostname -i``); workers of several nodes meet
at the first worker's host (Kubernetes' ``VC_WORKER_0_HOSTS``, Slurm's first node of the
workers' component, else ``localhost``).
"""


import shlex
from typing import List, Optional

import torchx.specs as specs
from torchx.components.dist import get_role_name, parse_nnodes
from torchx.specs import macros

WORKER_IMAGE = "shardps/worker:latest"      # `make images`' worker image: shardps with torch
SERVER_IMAGE = "shardps/server:latest"      # ... and its server image: no torch


def _nodes(workers: str) -> tuple[int, int, int]:
    """``[[MIN:]NODESx]PROCS``, as TorchX's ``dist.ddp -j`` reads it -> (min nodes, nodes,
    processes per node); ValueError naming ``workers`` for anything else."""
    try:
        low, nodes, procs, _ = parse_nnodes(workers)
    except ValueError:
        raise ValueError(f"workers={workers!r}: expected NODESxPROCS, MIN:MAXxPROCS or PROCS, "
                         f"e.g. 1x2, 1:4x8 or 2") from None
    if not 0 < low <= nodes or procs < 1:
        raise ValueError(f"workers={workers!r}: nodes and processes must be >= 1, MIN <= MAX")
    return low, nodes, procs


def _bash(*lines: str) -> list[str]:
    return ["-c", "\n".join(lines)]


def job(
    *script_args: str,
    script: str = "",
    m: str = "",
    job_name: str = macros.app_id,
    servers: int = 2,
    replication: int = 1,
    workers: str = "1x2",
    image: str = WORKER_IMAGE,
    server_image: str = SERVER_IMAGE,
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 4096,
    server_memMB: int = 4096,
    manager_port: int = 7070,
    rdzv_port: int = 29500,
    max_restarts: int = 3,
    wait_workers_s: int = 60,
    checkpoint_dir: str = "",
    mounts: Optional[List[str]] = None,
) -> specs.AppDef:
    """A shardps job: one manager, ``servers`` servers, and workers running ``script`` (or
    module ``m``) under torchrun with SHARDPS_MANAGER and SHARDPS_JOB set. The workers end the
    job when they are done, and the cluster exits with it.

    Args:
        script_args: arguments to the script or module
        script: the training script (exactly one of script and m)
        m: the training script as a Python module (python -m)
        job_name: the shardps job (default: the TorchX app id, a fresh job per run)
        servers: server replicas
        replication: copies of every block (2 survives a server's death)
        workers: [[MIN:]NODESx]PROCS, worker nodes (elastic from MIN) and torchrun processes on each
        image: the workers' image (shardps with torch)
        server_image: the manager's and the servers' image
        cpu: CPUs per worker node
        gpu: GPUs per worker node (one per process: NCCL; none: gloo)
        memMB: memory per worker node, MB
        server_memMB: memory per server, MB
        manager_port: the manager's gRPC port
        rdzv_port: the c10d rendezvous port on the first worker node (several nodes)
        max_restarts: torchrun's whole-group restarts before the job fails
        wait_workers_s: after torchrun exits, how long a node waits for the group to empty before it ends the job
        checkpoint_dir: the manager's --checkpoint-dir, where checkpoints go and a restarted group's
            ranks find their state (on a cluster: a volume mounted there)
        mounts: the manager's mounts, as TorchX writes them (type=volume,src=CLAIM,dst=/checkpoints)
    """
    if bool(script) == bool(m):
        raise ValueError("give exactly one of --script and -m")
    low, nodes, procs = _nodes(workers)
    # "$$" is a literal "$" to TorchX's macros (string.Template); bash expands it in the replica
    manager = f"$${{{macros.rank0_env}:-localhost}}:{manager_port}"
    advertise = '--advertise "$$(hostname -i | cut -d " " -f 1)"'
    # several worker nodes meet at the first one: Volcano names it, Slurm's heterogeneous job
    # has it as component 1 + servers (one node each), elsewhere all run on one host
    first_worker = f"$${{VC_WORKER_0_HOSTS:-$${{SLURM_JOB_NODELIST_HET_GROUP_{servers + 1}:-localhost}}}}"
    rdzv = "localhost:0" if nodes == 1 else f"{first_worker}:{rdzv_port}"
    torchrun = (f"torchrun --nnodes {low}:{nodes} --nproc_per_node {procs} --rdzv_backend c10d "
                f'--rdzv_endpoint "{rdzv}" --rdzv_id {macros.app_id} --max_restarts {max_restarts} '
                + shlex.join([*(["--module", m] if m else [script]), *script_args]))
    job_q = shlex.quote(job_name)
    roles = [
        specs.Role(
            name="manager", image=server_image, entrypoint="bash", resource=specs.resource(cpu=1, memMB=1024),
            args=_bash(f"exec shardps manager --listen 0.0.0.0:{manager_port} --metrics-port 0 "
                       f"--replication {replication} --exit-when-job-ends {job_q}"
                       + (f" --checkpoint-dir {shlex.quote(checkpoint_dir)}" if checkpoint_dir else "")),
            port_map={"grpc": manager_port}, mounts=specs.parse_mounts(mounts) if mounts else []),
        specs.Role(
            name="server", image=server_image, entrypoint="bash", num_replicas=servers,
            resource=specs.resource(cpu=1, memMB=server_memMB),
            args=_bash(f'exec shardps server --manager "{manager}" --name server-{macros.replica_id} '
                       f"--listen 0.0.0.0:0 {advertise} --metrics-port 0")),
        specs.Role(
            name="worker", image=image, entrypoint="bash", min_replicas=low, num_replicas=nodes,
            resource=specs.resource(cpu=cpu, gpu=gpu, memMB=memMB), env={"SHARDPS_JOB": job_name},
            args=_bash(f'export SHARDPS_MANAGER="{manager}"', torchrun, "trained=$$?",
                       f'shardps job end {job_q} --manager "$$SHARDPS_MANAGER" --wait-workers {wait_workers_s}',
                       "exit $$trained"),
            port_map={"c10d": rdzv_port}),
    ]
    return specs.AppDef(name=f"shardps-{get_role_name(script or None, m or None)}", roles=roles)
