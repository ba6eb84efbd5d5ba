"""Server-side optimizers in numpy, with ``torch.optim``'s arithmetic (no torch import).

One function, ``apply``, updates parameters and optimizer state in place. It serves dense
blocks (1-d arrays, one step counter per block) and sparse rows (2-d ``[rows, dim]`` arrays
gathered from a block, one step counter per row).

Semantics, as ``torch.optim`` for dense tables:
  SGD      g += wd * p; buf = g on the first step, else momentum * buf + (1 - dampening) * g;
           g = g + momentum * buf (nesterov) or buf; p -= lr * g
  Adagrad  g += wd * p; clr = lr / (1 + (step - 1) * lr_decay); sum += g * g;
           p -= clr * g / (sqrt(sum) + eps)
  Adam     g += wd * p; m += (1 - b1) (g - m); v = b2 v + (1 - b2) g g;
           p -= lr / (1 - b1^step) * m / (sqrt(v) / sqrt(1 - b2^step) + eps)
Sparse tables update only the pushed rows, and ``step`` is the row's own count of pushes
(its first push is step 1): Adam's bias correction and Adagrad's lr_decay use it, as
``torch.optim.SparseAdam`` does; SGD momentum is lazy (a row's buffer decays only when the
row is pushed). With plain SGD and Adagrad this equals torch.optim with sparse gradients.
"""

from __future__ import annotations

import threading

import numpy as np

from shardps.tables import OptimizerConfig, OptimizerKind

STATE_NAMES: dict[OptimizerKind, tuple[str, ...]] = {
    OptimizerKind.SGD: ("momentum_buffer",),
    OptimizerKind.ADAGRAD: ("sum",),
    OptimizerKind.ADAM: ("exp_avg", "exp_avg_sq"),
}


def state_names(config: OptimizerConfig) -> tuple[str, ...]:
    """Names of the per-element state arrays this optimizer keeps (none for plain SGD)."""
    if config.kind is OptimizerKind.SGD and config.momentum == 0:
        return ()
    return STATE_NAMES[config.kind]


def needs_row_steps(config: OptimizerConfig) -> bool:
    """Whether sparse rows need their own step counters under this optimizer."""
    return bool(state_names(config))


def new_state(config: OptimizerConfig, shape) -> dict[str, np.ndarray]:
    """Fresh optimizer state for parameters of ``shape`` (float32 arrays)."""
    state = {}
    for name in state_names(config):
        fill = config.initial_accumulator_value if name == "sum" else 0.0
        state[name] = np.full(shape, fill, dtype=np.float32)
    return state


_local = threading.local()
SCRATCH_MAX = 1 << 18          # elements (1 MiB) a thread keeps for reuse: dense blocks; larger
                               # updates (big sparse pushes) allocate, which the heap makes cheap


def scratch(shape) -> np.ndarray:
    """A float32 scratch array of ``shape``, reused by this thread (its contents are garbage).
    Reusing it keeps each step free of large allocations and their page faults."""
    n = int(np.prod(shape))
    if n > SCRATCH_MAX:
        return np.empty(shape, dtype=np.float32)     # a rare huge update: not kept
    buf = getattr(_local, "buf", None)
    if buf is None or buf.shape[0] < n:
        buf = _local.buf = np.empty(max(n, 1 << 16), dtype=np.float32)
    return buf[:n].reshape(shape)


def apply(config: OptimizerConfig, params: np.ndarray, grad: np.ndarray,
          state: dict[str, np.ndarray], step) -> None:
    """One optimizer step, in place on ``params`` and ``state``.

    ``step`` is the step number *after* this update (1 for the first): an int for a dense
    block, or an int array of shape ``[rows, 1]`` for sparse rows. ``grad`` is float32 of
    ``params``' shape and is not modified. Uses one scratch array of ``params``' size (and no
    other temporaries), so a step's memory footprint stays flat.
    """
    with np.errstate(all="ignore"):     # tables that allow NaN/Inf propagate them silently
        _apply(config, params, grad, state, step)


def _apply(config: OptimizerConfig, params: np.ndarray, grad: np.ndarray,
           state: dict[str, np.ndarray], step) -> None:
    lr = np.float32(config.lr)
    tmp = scratch(params.shape)
    if config.weight_decay:
        np.multiply(params, np.float32(config.weight_decay), out=tmp)
        tmp += grad
        grad = tmp.copy()
    kind = config.kind
    if kind is OptimizerKind.SGD:
        if config.momentum:
            buf = state["momentum_buffer"]
            momentum = np.float32(config.momentum)
            keep = np.float32(1.0 - config.dampening)
            if np.ndim(step) == 0:
                if step == 1:
                    buf[...] = grad
                else:
                    buf *= momentum
                    np.multiply(grad, keep, out=tmp)
                    buf += tmp
            else:   # per-row: rows on their first step start their buffer at g
                np.multiply(buf, momentum, out=tmp)
                tmp += keep * grad
                np.copyto(buf, np.where(np.asarray(step) == 1, grad, tmp))
            if config.nesterov:
                np.multiply(buf, momentum, out=tmp)
                tmp += grad
                tmp *= lr
            else:
                np.multiply(buf, lr, out=tmp)
        else:
            np.multiply(grad, lr, out=tmp)
        params -= tmp
    elif kind is OptimizerKind.ADAGRAD:
        step_arr = np.asarray(step, dtype=np.float64)
        clr = (config.lr / (1.0 + (step_arr - 1.0) * config.lr_decay)).astype(np.float32)
        acc = state["sum"]
        np.multiply(grad, grad, out=tmp)
        acc += tmp
        np.sqrt(acc, out=tmp)
        tmp += np.float32(config.effective_eps)
        np.divide(grad, tmp, out=tmp)
        tmp *= clr
        params -= tmp
    elif kind is OptimizerKind.ADAM:
        beta1, beta2 = config.beta1, config.beta2
        step_arr = np.asarray(step, dtype=np.float64)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        np.subtract(grad, m, out=tmp)
        tmp *= np.float32(1.0 - beta1)
        m += tmp
        v *= np.float32(beta2)
        np.multiply(grad, grad, out=tmp)
        tmp *= np.float32(1.0 - beta2)
        v += tmp
        step_size = (config.lr / (1.0 - beta1 ** step_arr)).astype(np.float32)
        bc2_sqrt = np.sqrt(1.0 - beta2 ** step_arr).astype(np.float32)
        np.sqrt(v, out=tmp)
        tmp /= bc2_sqrt
        tmp += np.float32(config.effective_eps)
        np.divide(m, tmp, out=tmp)
        tmp *= step_size
        params -= tmp
    else:
        raise ValueError(f"unknown optimizer kind {kind!r}")
