"""``digits-cnn`` and ``mnist-cnn``: the classic PyTorch MNIST example net, on real digits.

Two convolutions, dropout, fully connected 128 -> 20 -> 10, log-softmax, NLL loss.
``load_digits`` holds 1,797 real 8x8 handwritten digits (scikit-learn ships them); 20% are
held out for testing (stratified, fixed seed).
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from shardps.errors import FailedPrecondition
from shardps.tables import adam
from shardps.worker.device import module_device
from shardps.worker.models import Task


class DigitsNet(nn.Module):
    def __init__(self, side: int = 8, dropout: bool = True):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25 if dropout else 0.0)
        self.dropout2 = nn.Dropout(0.5 if dropout else 0.0)
        pooled = (side - 4) // 2
        self.fc1 = nn.Linear(64 * pooled * pooled, 128)
        self.fc2 = nn.Linear(128, 20)
        self.fc3 = nn.Linear(20, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        x = F.relu(self.fc2(x))
        return F.log_softmax(self.fc3(x), dim=1)


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    device = module_device(model)                 # the test set goes to the model's device
    model.eval()
    with torch.no_grad():
        pred = model(x.to(device)).argmax(dim=1)
    model.train()
    return {"test_accuracy": float((pred == y.to(device)).float().mean())}


def load_digits_split(seed: int = 0):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    data = load_digits()
    x = (data.images / 16.0).astype(np.float32)[:, None, :, :]
    y = data.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=1234, stratify=y)
    return (torch.from_numpy(x_tr), torch.from_numpy(y_tr)), (torch.from_numpy(x_te), torch.from_numpy(y_te))


def build_digits(seed: int = 0, dropout: bool = True, **_) -> Task:
    torch.manual_seed(seed)
    train, test = load_digits_split(seed)
    return Task("digits-cnn", DigitsNet(8, dropout), train, test, F.nll_loss, accuracy,
                optimizer=adam(lr=2e-3), batch_size=32, epochs=20, metric="test_accuracy",
                lr_schedule=step_decay)


def step_decay(epoch: int, epochs: int) -> float:
    """The learning rate drops tenfold for the last quarter of the epochs."""
    return 0.1 if epoch >= 0.75 * epochs else 1.0


def build_mnist(seed: int = 0, data_dir: str = "", **_) -> Task:
    try:
        from torchvision import datasets
    except ImportError:
        raise FailedPrecondition("mnist-cnn needs torchvision: pip install torchvision") from None
    root = data_dir or os.path.expanduser("~/.cache/shardps/mnist")
    try:
        tr = datasets.MNIST(root, train=True, download=False)
        te = datasets.MNIST(root, train=False, download=False)
    except RuntimeError as exc:
        raise FailedPrecondition(f"MNIST is not present under {root} ({exc}): download it there "
                                 f"first (this machine cannot)") from None

    def tensors(ds):
        x = ds.data.float().div(255.0).sub(0.1307).div(0.3081)[:, None]
        return x, ds.targets.long()

    torch.manual_seed(seed)
    return Task("mnist-cnn", DigitsNet(28), tensors(tr), tensors(te), F.nll_loss, accuracy,
                optimizer=adam(lr=1e-3), batch_size=64, epochs=2, metric="test_accuracy")
