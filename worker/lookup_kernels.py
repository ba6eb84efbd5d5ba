"""A lookup's forward and backward over the rows a step pulled: ``lookup(rows, inverse)`` is
``F.embedding(inverse, rows)`` (each id's row, out of the ``[U, dim]`` rows of the step's
distinct ids) whose backward sums the output gradients into one row per distinct id in
one compiled pass.

Why: torch's CPU backward of ``F.embedding`` (``embedding_dense_backward``) takes 0.54 ms
for the ctr batch (13,312 ids, 1,778 distinct, dim 16) where one pass that adds each
gradient row into its id's row takes 0.045 ms; the ctr step's forward and backward is about
0.85 ms in all. The sum is taken in the order of the ids, as torch's is, so the gradients
are the same bits. On other devices and dtypes (and without numba) the backward is
torch's own, and for fewer than ``MIN_IDS`` ids too: there the autograd function's own
overhead costs more than it saves (fwd + bwd, one thread: 256 ids 41 us against torch's
36 us, 1,024 ids 51 us against 75 us, the ctr batch 252 us against 859 us).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from shardps.kernels import _JIT, AVAILABLE, _read_only, njit

MIN_IDS = 512


@njit(**_JIT)
def _sum_rows(grad, inverse, out):
    """``out[r] = sum of grad[i] where inverse[i] == r``, each row's in the order of ``i``."""
    out[:] = 0.0
    d = grad.shape[1]
    for i in range(inverse.shape[0]):
        r = inverse[i]
        for j in range(d):
            out[r, j] += grad[i, j]


def sum_rows(grad: torch.Tensor, inverse: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The gradient of ``num_rows`` looked-up rows: ``grad`` (``inverse.shape + (dim,)``)
    summed per row ``inverse`` names (each in ``[0, num_rows)``)."""
    dim = grad.shape[-1]
    if AVAILABLE and grad.device.type == "cpu" and grad.dtype == torch.float32 and inverse.dtype == torch.int64:
        out = np.empty((num_rows, dim), np.float32)
        _sum_rows(grad.detach().reshape(-1, dim).contiguous().numpy(), inverse.reshape(-1).contiguous().numpy(),
                  out)
        return torch.from_numpy(out)
    return torch.ops.aten.embedding_dense_backward(grad, inverse, num_rows, -1, False)


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.num_rows = rows.shape[0]
        return F.embedding(inverse, rows)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return sum_rows(grad, inverse, ctx.num_rows), None


def lookup(rows: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``F.embedding(inverse, rows)``: the row of each index of ``inverse`` (any shape; int64
    or int32), with the compiled backward of the module docstring when ``rows`` collects
    gradients (and ``MIN_IDS`` ids or more)."""
    if not rows.requires_grad or not torch.is_grad_enabled() or inverse.numel() < MIN_IDS:
        return F.embedding(inverse, rows)
    return _Lookup.apply(rows, inverse)


def warm_up() -> None:
    """Compile (or load from numba's cache) the backward for the arrays it is given: a
    gradient torch made (writable) and one that is a read-only view."""
    if not AVAILABLE:
        return
    inverse = np.zeros(2, np.int64)
    for grad in (np.zeros((2, 2), np.float32), _read_only(np.zeros((2, 2), np.float32))):
        _sum_rows(grad, inverse, np.empty((1, 2), np.float32))
