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


def apply(config: OptimizerConfig, params: np.ndarray, grad: np.ndarray,
          state: dict[str, np.ndarray], step) -> None:
    """One optimizer step, in place on ``params`` and ``state``.

    ``step`` is the step number *after* this update (1 for the first): an int for a dense
    block, or an int array of shape ``[rows, 1]`` for sparse rows. ``grad`` is float32 of
    ``params``' shape and is not modified.
    """
    lr = np.float32(config.lr)
    if config.weight_decay:
        grad = grad + np.float32(config.weight_decay) * params
    kind = config.kind
    if kind is OptimizerKind.SGD:
        if config.momentum:
            buf = state["momentum_buffer"]
            momentum = np.float32(config.momentum)
            first = (np.asarray(step) == 1)
            if np.ndim(step) == 0:
                if first:
                    buf[...] = grad
                else:
                    buf *= momentum
                    buf += np.float32(1.0 - config.dampening) * grad
            else:   # per-row: rows on their first step start their buffer at g
                decayed = momentum * buf + np.float32(1.0 - config.dampening) * grad
                np.copyto(buf, np.where(first, grad, decayed))
            update = grad + momentum * buf if config.nesterov else buf
        else:
            update = grad
        params -= lr * update
    elif kind is OptimizerKind.ADAGRAD:
        step_arr = np.asarray(step, dtype=np.float64)
        clr = (config.lr / (1.0 + (step_arr - 1.0) * config.lr_decay)).astype(np.float32)
        acc = state["sum"]
        acc += grad * grad
        std = np.sqrt(acc)
        std += np.float32(config.effective_eps)
        params -= clr * (grad / std)
    elif kind is OptimizerKind.ADAM:
        beta1, beta2 = config.beta1, config.beta2
        step_arr = np.asarray(step, dtype=np.float64)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m += np.float32(1.0 - beta1) * (grad - m)
        v *= np.float32(beta2)
        v += np.float32(1.0 - beta2) * grad * grad
        step_size = (config.lr / (1.0 - beta1 ** step_arr)).astype(np.float32)
        bc2_sqrt = np.sqrt(1.0 - beta2 ** step_arr).astype(np.float32)
        denom = np.sqrt(v) / bc2_sqrt
        denom += np.float32(config.effective_eps)
        params -= step_size * (m / denom)
    else:
        raise ValueError(f"unknown optimizer kind {kind!r}")
