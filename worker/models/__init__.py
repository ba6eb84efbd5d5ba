"""Models and data sets registered by name (``shardps worker --model NAME``).

Each entry builds a ``Task``: the module, the train and test tensors, the loss, an evaluation
function and default hyperparameters. Data sets are real or synthetic and ship without a
download: ``digits-cnn`` uses scikit-learn's ``load_digits`` (1,797 real handwritten digits),
``ctr`` a synthetic click log with a known logistic ground truth, ``mnist-cnn`` torchvision's
MNIST when it is present on disk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from shardps.errors import InvalidArgument
from shardps.tables import OptimizerConfig


@dataclass
class Task:
    name: str
    model: torch.nn.Module
    train: tuple[torch.Tensor, torch.Tensor]
    test: tuple[torch.Tensor, torch.Tensor]
    loss: Callable
    evaluate: Callable            # (model, x, y) -> {"test_accuracy": ...} etc.
    optimizer: OptimizerConfig
    batch_size: int
    epochs: int
    metric: str
    optimizers: dict[str, OptimizerConfig] = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    # learning-rate factor of epoch e of n (1.0 when None): applied to the server-side
    # optimizers through the tables' configs (PSModel.set_lr), and to the baseline's torch optimizers
    lr_schedule: Callable[[int, int], float] | None = None


def names() -> list[str]:
    return ["digits-cnn", "mnist-cnn", "ctr"]


def build(name: str, seed: int = 0, **options) -> Task:
    if name == "digits-cnn":
        from shardps.worker.models.digits import build_digits
        return build_digits(seed, **options)
    if name == "mnist-cnn":
        from shardps.worker.models.digits import build_mnist
        return build_mnist(seed, **options)
    if name == "ctr":
        from shardps.worker.models.ctr import build_ctr
        return build_ctr(seed, **options)
    raise InvalidArgument(f"unknown model {name!r}: choose one of {names()}")
