"""Which device a worker trains on (``shardps worker --device``, ``SHARDPS_DEVICE``).

The choice is a pure function of the flag, the number of CUDA devices torch sees and the
worker's slot on its host (``resolve_device``), so that it is tested without a GPU; the
entry point reads torch and the environment and passes them in.

* ``cpu``: the CPU.
* ``cuda:N``: GPU N of those this process sees (``CUDA_VISIBLE_DEVICES`` renumbers them).
  FailedPrecondition when torch sees no GPU or fewer than N + 1.
* ``cuda``: a GPU, picked as ``auto`` picks one; FailedPrecondition when torch sees none.
* ``auto`` (the default): ``cuda:{slot mod count}`` when torch sees ``count`` >= 1 GPUs, else
  the CPU. The slot is ``LOCAL_RANK`` where it is set (torchrun's convention: the worker's
  index on its host), else the worker's rank in its group, else 0. One worker per GPU
  therefore gets a GPU of its own whether torchrun, a Kubernetes pod with one GPU
  (``count`` = 1: ``cuda:0``) or several ``shardps worker`` processes on one host start it;
  more workers than GPUs share them round robin.
"""

from __future__ import annotations

from typing import Mapping

import torch

from shardps.errors import FailedPrecondition, InvalidArgument

AUTO, CPU, CUDA = "auto", "cpu", "cuda"
CHOICES = "auto, cpu, cuda or cuda:N"
LOCAL_RANK = "LOCAL_RANK"


def parse_device(spec: str) -> tuple[str, int | None]:
    """``(kind, index)`` of a ``--device`` value: ``("auto", None)``, ``("cpu", None)``,
    ``("cuda", None)`` or ``("cuda", N)``. InvalidArgument naming the value otherwise."""
    text = str(spec).strip().lower()
    if text in (AUTO, CPU, CUDA):
        return text, None
    kind, _, index = text.partition(":")
    if kind == CUDA and index.isascii() and index.isdigit():
        return CUDA, int(index)
    raise InvalidArgument(f"--device {spec!r}: not a device shardps trains on; set --device (or "
                          f"SHARDPS_DEVICE) to {CHOICES} (N: the GPU's index, e.g. cuda:0)")


def local_rank_of(env: Mapping[str, str]) -> int | None:
    """``LOCAL_RANK`` of ``env`` (None when unset or empty); InvalidArgument when it is not an
    integer >= 0."""
    raw = env.get(LOCAL_RANK, "")
    if raw is None or not str(raw).strip():
        return None
    text = str(raw).strip()
    if not (text.isascii() and text.isdigit()):
        raise InvalidArgument(f"{LOCAL_RANK}={raw!r} is not an integer >= 0: it is the worker's index on its "
                              f"host (torchrun sets it); unset it or set a number")
    return int(text)


def resolve_device(spec: str, cuda_count: int, env: Mapping[str, str] | None = None,
                   rank: int | None = None, no_cuda: str = "") -> torch.device:
    """The device ``--device spec`` names, given the CUDA devices torch sees (``cuda_count``),
    the environment (``LOCAL_RANK``) and the worker's rank in its group (None before it
    joined); see the module docstring. ``no_cuda`` says why torch sees no GPU (for the
    error). Pure: reads nothing but its arguments.

    Raises InvalidArgument for a malformed ``spec`` or ``LOCAL_RANK``, FailedPrecondition for
    a GPU this process does not see."""
    kind, index = parse_device(spec)
    if kind == CPU:
        return torch.device(CPU)
    local = local_rank_of(env or {}) if index is None else None     # checked even where unused
    if cuda_count <= 0:
        if kind == AUTO:
            return torch.device(CPU)
        reason = f" ({no_cuda})" if no_cuda else ""
        raise FailedPrecondition(f"--device {spec}: no CUDA device is visible to this process{reason}; run it "
                                 f"where torch sees a GPU (a CUDA build of torch, the NVIDIA driver, the "
                                 f"container's GPU reservation), or use --device cpu, or --device auto to "
                                 f"fall back to the CPU")
    if index is not None:
        if index >= cuda_count:
            raise FailedPrecondition(f"--device {spec}: this process sees {cuda_count} CUDA device(s), "
                                     f"cuda:0 to cuda:{cuda_count - 1} (CUDA_VISIBLE_DEVICES renumbers "
                                     f"them); name one of those, or --device cuda / auto to pick one")
        return torch.device(CUDA, index)
    slot = local if local is not None else (rank if rank is not None and rank >= 0 else 0)
    return torch.device(CUDA, slot % cuda_count)


def cuda_device_count() -> int:
    """CUDA devices this process sees (0 without a usable CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def no_cuda_reason() -> str:
    """Why this process sees no CUDA device ("" when it sees one)."""
    if cuda_device_count() > 0:
        return ""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build: install a CUDA build of torch"
    return (f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but finds no GPU: check the "
            f"driver (nvidia-smi) and CUDA_VISIBLE_DEVICES")


def describe(device: torch.device) -> str:
    """``cpu``, or ``cuda:0 (NVIDIA H100 80GB HBM3)``: for log lines."""
    if device.type == CUDA:
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def module_device(module: torch.nn.Module) -> torch.device:
    """The device of a module's first parameter or buffer (the CPU when it has none)."""
    for parameter in module.parameters():
        return parameter.device
    for buffer in module.buffers():
        return buffer.device
    return torch.device(CPU)


def use_device(device: torch.device) -> None:
    """Make ``device`` the process's current CUDA device, so that nothing lands on GPU 0 by
    default (a CUDA context there costs every worker hundreds of MiB); a no-op for the CPU."""
    if device.type == CUDA:
        torch.cuda.set_device(device)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a no-op on the CPU): step timings then
    measure the GPU's work, not only its launch."""
    if device.type == CUDA:
        torch.cuda.synchronize(device)
