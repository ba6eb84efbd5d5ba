"""The lookups' backward over the rows a step pulled, in one compiled pass (and the
deduplication of a step's batches, every table's in one: ``unique_each``).

* ``lookup(rows, inverse)`` is ``F.embedding(inverse, rows)``: each id's row, out of the
  ``[U, dim]`` rows of the step's distinct ids. Its backward adds each output gradient row
  into its id's row, in the order of the ids, as torch's does: the same bits.
* ``bag_lookup(rows, inverse, offsets, ...)`` is ``F.embedding_bag`` (torch's forward and
  checks) whose backward, for bags pooled by sum or mean, adds each bag's gradient (times
  the id's weight, or over the bag's size) into the rows of its ids, in the order of the
  ids. Torch adds them in the order its sort of the ids leaves (an unstable sort): the two
  agree to float32 rounding (a few units in the last place), not bit for bit.

Why: torch's CPU backward passes sort or scan what one pass does. On one thread
(``python -m shardps.tools.bench --only kernels``, keys ``kernel_lookup_*`` and
``kernel_bag_*``), the ctr batch (13,312 ids, 1,778 distinct, dim 16): torch's 0.56-0.59
ms, this 0.054 ms, where the ctr step's whole forward and backward is about 0.85 ms; 512
bags of 20 ids (dim 16, sum): torch's backward 0.84-0.87 ms, this 0.090-0.093 ms.

Torch's own backward runs on other devices and dtypes, without numba, for ``max`` bags,
weights that take a gradient, and for fewer than ``MIN_IDS`` ids: there the autograd
function's own overhead costs more than it saves (forward and backward, the same command:
256 ids 63-66 us against torch's 46-47 us, 1,024 ids 68-71 us against 91-95 us).
A backward that builds a graph (``create_graph=True``, for a second derivative) is taken by
differentiable torch operations instead: ``embedding_dense_backward``, and for bags an
``index_add`` of the same sums (torch's own bag backward has no derivative).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from shardps.kernels import _JIT, AVAILABLE, _hash_unique, njit

MIN_IDS = 512


def sum_rows(grad: torch.Tensor, inverse: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The gradient of ``num_rows`` looked-up rows (float32, on the CPU): ``grad``
    (``inverse.shape + (dim,)``) summed per row ``inverse`` names (each in
    ``[0, num_rows)``), each id a bag of its own for ``_sum_bags``."""
    dim = grad.shape[-1]
    out = np.empty((num_rows, dim), np.float32)
    _sum_bags(grad.detach().reshape(-1, dim).contiguous().numpy(), inverse.reshape(-1).long().contiguous().numpy(),
              _EACH_ID, _EACH_ID, _NO_WEIGHTS, -1, False, out)
    return torch.from_numpy(out)


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.num_rows = rows.shape[0]
        return F.embedding(inverse, rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        if torch.is_grad_enabled() or grad.dtype != torch.float32:      # create_graph: differentiable
            return torch.ops.aten.embedding_dense_backward(grad, inverse, ctx.num_rows, -1, False), None
        return sum_rows(grad, inverse, ctx.num_rows), None


def _compiled(rows: torch.Tensor, inverse: torch.Tensor) -> bool:
    """Whether a lookup of ``inverse`` in ``rows`` takes the compiled backward: ``rows``
    collect gradients, in float32 on the CPU, and there are ``MIN_IDS`` ids or more."""
    return (AVAILABLE and rows.requires_grad and torch.is_grad_enabled() and rows.device.type == "cpu"
            and rows.dtype == torch.float32 and inverse.numel() >= MIN_IDS)


def lookup(rows: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``F.embedding(inverse, rows)``: the row of each index of ``inverse`` (any shape; int64
    or int32), with the compiled backward of the module docstring where ``_compiled``."""
    return _Lookup.apply(rows, inverse) if _compiled(rows, inverse) else F.embedding(inverse, rows)


@njit(**_JIT)
def _sum_bags(grad, inverse, starts, ends, weights, padding, mean, out):
    """The rows' gradient of bags pooled by sum (``mean``: by mean) from ``out``'s rows: bag
    ``b`` is ``inverse[starts[b]:ends[b]]``; each row gets ``grad[b]``, times the id's weight
    (``weights``; size 0: none) or the bag's ``1 / ids`` (mean), for each of its ids in the
    bag, in the order of the ids; ids equal to ``padding`` are left out (and not counted).
    ``starts`` of size 0: each id is a bag of its own (a lookup's), summed as it is."""
    out[:] = 0.0
    d = grad.shape[1]
    n = inverse.shape[0]
    if starts.shape[0] == 0:            # a lookup: a plain loop, which the compiler vectorises
        for i in range(n):
            r = inverse[i]
            for j in range(d):
                out[r, j] += grad[i, j]
        return
    weighted = weights.shape[0] > 0
    for b in range(starts.shape[0]):
        lo = min(max(starts[b], 0), n)
        hi = min(max(ends[b], lo), n)
        scale = np.float32(1.0)
        if mean:
            count = 0
            for i in range(lo, hi):
                if inverse[i] != padding:
                    count += 1
            if count == 0:
                continue
            scale = np.float32(1.0) / np.float32(count)
        for i in range(lo, hi):
            r = inverse[i]
            if r == padding:
                continue
            s = weights[i] if weighted else scale
            for j in range(d):
                out[r, j] += grad[b, j] * s


def _bags(inverse: torch.Tensor, offsets: torch.Tensor | None, include_last_offset: bool
          ) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) of each bag in the flat ids, as ``F.embedding_bag`` reads ``offsets``."""
    if inverse.dim() == 2:
        b, n = inverse.shape
        starts = np.arange(b, dtype=np.int64) * n
        return starts, starts + n
    assert offsets is not None
    at = offsets.detach().cpu().numpy().astype(np.int64, copy=False)
    if include_last_offset:
        return at[:-1], at[1:]
    return at, np.append(at[1:], inverse.shape[0])


class _BagLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, inverse, offsets, weights, mode, include_last_offset, padding):
        ctx.save_for_backward(inverse, offsets, weights)
        ctx.num_rows, ctx.mode, ctx.last, ctx.padding = rows.shape[0], mode, include_last_offset, padding
        return F.embedding_bag(inverse, rows, offsets, mode=mode, per_sample_weights=weights,
                               include_last_offset=include_last_offset, padding_idx=padding)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        inverse, offsets, weights = ctx.saved_tensors
        starts, ends = _bags(inverse, offsets, ctx.last)
        if torch.is_grad_enabled():         # create_graph: the same sums by differentiable torch ops
            return (_bag_grad_torch(grad, inverse, starts, ends, weights, ctx.padding, ctx.mode == "mean",
                                    ctx.num_rows), None, None, None, None, None, None)
        if grad.dtype != torch.float32:
            return (_bag_grad_torch(grad, inverse, starts, ends, weights, ctx.padding, ctx.mode == "mean",
                                    ctx.num_rows), None, None, None, None, None, None)
        out = np.empty((ctx.num_rows, grad.shape[1]), np.float32)
        _sum_bags(grad.detach().contiguous().numpy(), inverse.reshape(-1).long().contiguous().numpy(), starts, ends,
                  _NO_WEIGHTS if weights is None else weights.detach().reshape(-1).contiguous().numpy(),
                  -1 if ctx.padding is None else ctx.padding, ctx.mode == "mean", out)
        return torch.from_numpy(out), None, None, None, None, None, None


_NO_WEIGHTS = np.empty(0, np.float32)
_EACH_ID = np.empty(0, np.int64)         # no bags' bounds: each id its own bag


def _bag_grad_torch(grad: torch.Tensor, inverse: torch.Tensor, starts: np.ndarray, ends: np.ndarray,
                    weights: torch.Tensor | None, padding: int | None, mean: bool, num_rows: int) -> torch.Tensor:
    """``_sum_bags``' gradient as torch operations (an ``index_add``), so that a second
    derivative can be taken through it."""
    n = inverse.numel()
    lo = np.clip(starts, 0, n)
    sizes = np.maximum(np.clip(ends, 0, n), lo) - lo
    bags = np.repeat(np.arange(lo.shape[0]), sizes)
    # each bag's ids: its start, plus the place of each id in its bag
    at = torch.from_numpy(lo[bags] + np.arange(bags.shape[0]) - np.repeat(np.cumsum(sizes) - sizes, sizes))
    bag_of = torch.from_numpy(bags)
    ids = inverse.reshape(-1).long()[at]
    keep = ids != (-1 if padding is None else padding)
    scale = torch.ones(at.shape[0], dtype=grad.dtype)
    if weights is not None:
        scale = weights.reshape(-1)[at].to(grad.dtype)
    elif mean:
        counts = torch.zeros(lo.shape[0], dtype=grad.dtype).index_add(0, bag_of, keep.to(grad.dtype))
        scale = 1.0 / counts.clamp(min=1)[bag_of]
    rows = (grad[bag_of] * scale[:, None])[keep]
    return torch.zeros(num_rows, grad.shape[1], dtype=grad.dtype).index_add(0, ids[keep], rows)


def bag_lookup(rows: torch.Tensor, inverse: torch.Tensor, offsets: torch.Tensor | None, mode: str,
               per_sample_weights: torch.Tensor | None, include_last_offset: bool,
               padding: int | None) -> torch.Tensor:
    """``F.embedding_bag(inverse, rows, offsets, mode=mode, per_sample_weights=...,
    include_last_offset=..., padding_idx=padding)`` with the compiled backward of the module
    docstring where ``rows`` collects gradients (float32, on the CPU), the bags pool by sum
    or mean, ``per_sample_weights`` takes none and there are ``MIN_IDS`` ids or more."""
    if (not _compiled(rows, inverse) or mode not in ("sum", "mean")
            or (per_sample_weights is not None and (per_sample_weights.requires_grad
                                                    or per_sample_weights.dtype != torch.float32))):
        return F.embedding_bag(inverse, rows, offsets, mode=mode, per_sample_weights=per_sample_weights,
                               include_last_offset=include_last_offset, padding_idx=padding)
    return _BagLookup.apply(rows, inverse, offsets, per_sample_weights, mode, include_last_offset, padding)


def unique_each(flat: np.ndarray, ends: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``kernels.unique_inverse`` of each batch of a step's lookups at once: ``flat`` holds
    every batch's int64 ids one after another, batch k ending at ``ends[k]``. Returns each
    batch's sorted distinct ids and each of its ids' index in them (views of two arrays):
    every batch's ids hashed in one compiled pass, all their distinct ids sorted by one numpy
    sort (by batch, then id), the indices written by one more pass (``np.unique`` per batch
    without numba)."""
    if not AVAILABLE:
        pairs = [np.unique(batch, return_inverse=True) for batch in np.split(flat, ends[:-1])]
        return [u for u, _ in pairs], [i.reshape(-1) for _, i in pairs]
    first, at, first_ends, batch_of = _hash_each(flat, ends)
    order = np.argsort(first)                                        # numpy's sort: faster than numba's
    order = order[np.argsort(batch_of[order], kind="stable")]       # by batch (a radix sort), then by id
    unique, inverse = _rank_each(first, at, first_ends, batch_of, order, ends)
    return np.split(unique, first_ends[:-1]), np.split(inverse, ends[:-1])


@njit(**_JIT)
def _hash_each(flat, ends):
    """Each batch's distinct ids in order of first appearance (one batch's after another's),
    each id's index among its batch's, where each batch's distinct ids end, and the batch of
    each distinct id."""
    first = np.empty(flat.shape[0], np.int64)
    at = np.empty(flat.shape[0], np.int64)
    first_ends = np.empty(ends.shape[0], np.int64)
    batch_of = np.empty(flat.shape[0], np.int16)
    start = u = 0
    for k in range(ends.shape[0]):
        batch = flat[start:ends[k]]
        bits = 4
        while (1 << bits) < 2 * batch.shape[0]:         # a load factor <= 1/2, as kernels._table_bits
            bits += 1
        distinct, index = _hash_unique(batch, bits)
        first[u:u + distinct.shape[0]] = distinct
        batch_of[u:u + distinct.shape[0]] = k
        at[start:ends[k]] = index
        u += distinct.shape[0]
        first_ends[k] = u
        start = ends[k]
    return first[:u], at, first_ends, batch_of[:u]


@njit(**_JIT)
def _rank_each(first, at, first_ends, batch_of, order, ends):
    """The distinct ids in ``order`` (by batch, then id), and each id's index among its
    batch's sorted distinct ids."""
    unique = np.empty(first.shape[0], np.int64)
    rank = np.empty(first.shape[0], np.int64)
    for j in range(order.shape[0]):
        d = order[j]
        unique[j] = first[d]
        k = batch_of[d]
        rank[d] = j - (first_ends[k - 1] if k else 0)
    inverse = np.empty(at.shape[0], np.int64)
    start = 0
    for k in range(ends.shape[0]):
        base = first_ends[k - 1] if k else 0
        for i in range(start, ends[k]):
            inverse[i] = rank[base + at[i]]
        start = ends[k]
    return unique, inverse


def warm_up() -> None:
    """Compile (or load from numba's cache) the backward passes for the arrays torch gives
    them (writable: a gradient, the ids' indices, the bags' bounds and weights), and the
    lookups' deduplication."""
    if not AVAILABLE:
        return
    unique_each(np.array([3, 1, 3, 2], np.int64), np.array([2, 4], np.int64))
    inverse, bounds, grad = np.zeros(2, np.int64), np.zeros(1, np.int64), np.zeros((2, 2), np.float32)
    for weights in (_NO_WEIGHTS, np.zeros(2, np.float32)):
        _sum_bags(grad, inverse, bounds, bounds, weights, -1, False, np.empty((1, 2), np.float32))
