"""Hybrid training: a model's dense parameters all-reduced among the workers by torch's own
``DistributedDataParallel``, its embedding tables on the servers.

``PSModel(module, client, dense="allreduce", dense_optimizer=torch.optim.Adam(...))`` keeps
every parameter of ``module`` on the worker, wraps ``module`` in
``torch.nn.parallel.DistributedDataParallel`` (whose buckets average the gradients during the
backward pass) and steps ``dense_optimizer`` (any ``torch.optim`` optimizer) in ``push``;
the ``PSEmbedding`` / ``PSEmbeddingBag`` tables keep their rows, their server-side
optimizers and the job's ASYNC / SSP / SYNC semantics. PSModel's tables hold no
``nn.Parameter`` (their rows arrive per step), so DDP sees the dense parameters only; any
parameter under a table's module is still handed to
``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``, as TorchRec keeps
its sharded tables out of DDP.

The process group is torch's: the default group when the script initialised one, else one
initialised here from torchrun's environment (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
``WORLD_SIZE``, as ``torchrun`` and ``shardps run`` set them): gloo for CPU workers, NCCL for
CUDA workers with a GPU each. Where torchrun starts more ranks on a host than it has GPUs
(``LOCAL_WORLD_SIZE`` > the GPUs torch sees) ranks share GPUs, and NCCL refuses two ranks on
one device ("Duplicate GPU detected"): gloo then, on the CUDA tensors through host memory,
with a warning (``backend_for``).
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import TYPE_CHECKING

import torch
from torch import nn

from shardps.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger("shardps.worker")

if TYPE_CHECKING:
    import torch.distributed as dist

    from shardps.tables import OptimizerConfig

DENSE_MODES = ("servers", "allreduce")
STORE_TIMEOUT = datetime.timedelta(minutes=10)     # torch's default for a process group's store
_TORCHRUN_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def dense_mode(dense: str) -> str:
    """``dense`` checked: "servers" (dense tables on the servers, the default) or "allreduce"."""
    if dense not in DENSE_MODES:
        raise InvalidArgument(f"dense={dense!r}: use 'servers' (dense parameters as tables on the servers) "
                              f"or 'allreduce' (kept on the workers, averaged by DistributedDataParallel)")
    return dense


def check_optimizer(dense_optimizer, local_optimizer):
    """The optimizer of dense="allreduce": ``dense_optimizer``, a ``torch.optim`` optimizer
    (InvalidArgument without one, or with ``local_optimizer`` beside it)."""
    if local_optimizer is not None:
        raise InvalidArgument("dense='allreduce' keeps every parameter on the worker: pass its optimizer as "
                              "dense_optimizer, not local_optimizer")
    if not isinstance(dense_optimizer, torch.optim.Optimizer):
        raise InvalidArgument(f"dense='allreduce' steps the dense parameters with a torch optimizer on each worker: "
                              f"pass dense_optimizer=torch.optim.Adam(module.parameters(), ...) (got "
                              f"{type(dense_optimizer).__name__})")
    return dense_optimizer


def worker_kwargs(dense: str, module: nn.Module, optimizer: "OptimizerConfig",
                  per_table: dict[str, "OptimizerConfig"]) -> dict:
    """``PSModel``'s dense arguments for ``shardps worker --dense``: none for "servers"; for
    "allreduce", the torch optimizer equivalent to each dense parameter's table optimizer
    (``per_table`` by name, else ``optimizer``)."""
    from shardps.worker.runtime import torch_optimizer
    if dense_mode(dense) == "servers":
        return {}
    by_config: dict = {}
    for name, p in module.named_parameters():
        by_config.setdefault(per_table.get(name, optimizer), []).append(p)
    if len(by_config) != 1:
        raise InvalidArgument(f"--dense allreduce: the model's dense parameters have {len(by_config)} optimizer "
                              f"configs; one torch optimizer steps them all (use PSModel's dense_optimizer)")
    (config, params), = by_config.items()
    return {"dense": dense, "dense_optimizer": torch_optimizer(config, params)}


def backend_for(device: torch.device, local_world_size: int = 1, cuda_count: int = 1) -> str:
    """The process group's backend for workers on ``device``: gloo on the CPU; on CUDA, NCCL
    where each of the host's ``local_world_size`` ranks has a GPU of its own among the
    ``cuda_count`` it sees, else gloo (NCCL refuses two ranks on one GPU, "Duplicate GPU
    detected"; gloo all-reduces CUDA tensors through host memory, slower, and works). Pure."""
    if device.type != "cuda":
        return "gloo"
    return "nccl" if local_world_size <= cuda_count else "gloo"


def _backend(device: torch.device, environ) -> str:
    """``backend_for`` this process: torchrun's LOCAL_WORLD_SIZE, the GPUs torch sees; a
    warning when ranks share a GPU."""
    from shardps.worker.device import cuda_device_count
    local, count = int(environ.get("LOCAL_WORLD_SIZE") or 1), cuda_device_count()
    backend = backend_for(device, local, count)
    if device.type == "cuda" and backend == "gloo":
        log.warning("dense='allreduce': %d ranks on this host share %d GPU(s); NCCL needs a GPU per rank, so "
                    "the dense gradients are all-reduced by gloo through host memory (slower). Start at "
                    "most one rank per GPU (torchrun --nproc-per-node %d) for NCCL", local, count, count)
    return backend


def process_group(device: torch.device, environ=os.environ) -> "dist.ProcessGroup":
    """The default process group: the one the script initialised, else one initialised now
    from torchrun's environment (``backend_for(device)``). FailedPrecondition, saying how to
    start the workers, where there is neither."""
    import torch.distributed as dist
    if not dist.is_available():
        raise FailedPrecondition("dense='allreduce' needs torch.distributed, which this torch build lacks")
    if not dist.is_initialized():
        missing = [k for k in _TORCHRUN_ENV if not environ.get(k)]
        if missing:
            raise FailedPrecondition(
                f"dense='allreduce' all-reduces the dense parameters among the workers, and no process group "
                f"is initialised ({', '.join(missing)} not set): start the workers with torchrun or "
                f"`shardps run --elastic`, or call torch.distributed.init_process_group first")
        _init_from_env(_backend(device, environ), environ)
    group = dist.group.WORLD
    assert group is not None           # initialised above
    return group


def _init_from_env(backend: str, environ) -> None:
    """``init_process_group`` from torchrun's environment. Under torch's elastic agent every
    restart round's workers meet in the agent's store at the same address, and torch's env://
    rendezvous adds no prefix per round: a new round's rank could read the address a rank of
    the last round (dead) left there, and fail to connect. The store is prefixed by the round
    (``TORCHELASTIC_RESTART_COUNT``) here."""
    import torch.distributed as dist
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend=backend)
        return
    rank, world = int(environ["RANK"]), int(environ["WORLD_SIZE"])
    agent = dist.TCPStore(environ["MASTER_ADDR"], int(environ["MASTER_PORT"]), world, is_master=False,
                          timeout=STORE_TIMEOUT)
    store = dist.PrefixStore(f"shardps/round-{restart_round(environ)}", agent)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world)


def check_through_ddp(through: bool | None) -> None:
    """A training forward (gradients on) of the module itself, not through the ``PSModel``
    (its DDP wrapper): its gradients would not be averaged and the workers would drift apart:
    InvalidArgument. Evaluation under ``torch.no_grad()`` may call the module directly."""
    if not through and torch.is_grad_enabled():
        raise InvalidArgument("dense='allreduce': call the PSModel (model(x)), not the module it wraps: "
                              "DistributedDataParallel averages the gradients through its own forward")


def ignored_parameters(module: nn.Module, table_modules: list[str]) -> list[str]:
    """The names of ``module``'s parameters and buffers under the modules of its tables
    (``table_modules``: their paths): DDP leaves them alone."""
    def under(name: str) -> bool:
        return any(name == p or name.startswith(p + ".") for p in table_modules if p)
    return ([n for n, _ in module.named_parameters() if under(n)]
            + [n for n, _ in module.named_buffers() if under(n)])


def wrap(module: nn.Module, table_modules: list[str], **ddp_kwargs) -> nn.parallel.DistributedDataParallel:
    """``module`` in ``DistributedDataParallel`` over the default process group (see
    ``process_group``), its tables' parameters ignored; on a CUDA module, ``device_ids`` its
    device. A collective: every worker of the group constructs its own at the same point (it
    broadcasts rank 0's parameters and buffers, so every worker starts from the same)."""
    from torch.nn.parallel import DistributedDataParallel

    try:
        device = next(module.parameters()).device
    except StopIteration:
        raise InvalidArgument("dense='allreduce': the module has no dense parameters to all-reduce; "
                              "use the default dense='servers'") from None
    process_group(device)
    ignored = ignored_parameters(module, table_modules)
    if ignored:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, ignored)
    if device.type == "cuda":
        ddp_kwargs.setdefault("device_ids", [device.index if device.index is not None else torch.cuda.current_device()])
    return DistributedDataParallel(module, **ddp_kwargs)


def agreed_step(step: int, device: torch.device) -> int:
    """The step every rank of the default process group resumes from: the highest any rank
    brings (a restarted group's ranks join while the last round's leave and report their
    steps, so they may be told different ones). A collective: each rank calls it once, at
    the same point; all then run the same number of steps, as DDP needs."""
    import torch.distributed as dist
    mine = torch.tensor([step], dtype=torch.int64, device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return int(mine.item())


def restart_round(environ=os.environ) -> int:
    """The elastic agent's restart round of this process (torchrun's
    ``TORCHELASTIC_RESTART_COUNT``; 0: the first round, or no agent). Every rank of a round
    sees the same."""
    count = environ.get("TORCHELASTIC_RESTART_COUNT", "")
    return int(count) if count.isdigit() else 0


class BackwardPush:
    """With ``dense="allreduce"`` and ``overlap``, a step's push leaves from its backward pass:
    each lookup's rows (the leaves that collect a table's gradient rows) are ``watch``ed, and
    when the last of them has its gradient, ``send`` (the step's push with the next step's
    announced pull, one exchange per server) is called from the gradient hook, while DDP's
    buckets still all-reduce the dense gradients. ``push`` then ``take``s what was sent (None
    when nothing was: a row without a gradient, or ``send`` declined), raising its error there,
    on the training thread. ``send`` runs on the thread that computes the backward pass (on a
    GPU, torch's autograd thread of that device) while the training thread waits in
    ``backward``, so it sees the step as the training thread left it."""

    __slots__ = ("send", "waiting", "sent", "error")

    def __init__(self, send):
        self.send = send               # () -> what push takes, or None to leave the push to push()
        self.waiting = 0               # watched rows without their gradient yet
        self.sent: tuple | None = None
        self.error: Exception | None = None

    def watch(self, rows: torch.Tensor) -> None:
        self.waiting += 1
        rows.register_post_accumulate_grad_hook(self._arrived)

    def _arrived(self, _rows: torch.Tensor) -> None:
        self.waiting -= 1
        if self.waiting == 0 and self.sent is None and self.error is None:
            try:
                self.sent = self.send()
            except Exception as exc:   # raised by take, on the training thread
                self.error = exc

    def take(self) -> tuple | None:
        """What the backward pass sent, once (raising its error); forgets the rows still watched."""
        sent, error = self.sent, self.error
        self.sent, self.error, self.waiting = None, None, 0
        if error is not None:
            raise error
        return sent
