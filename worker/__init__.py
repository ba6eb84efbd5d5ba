"""Workers: the ``PSClient`` library and (``shardps.worker.torch_ps``) the PyTorch integration.

Importing this package does not import torch: a client that only pushes and pulls numpy
arrays needs no torch.
"""

from shardps.tables import adagrad, adam, constant, dense_table, normal, sgd, sparse_table, uniform, zeros
from shardps.worker.client import Membership, PSClient, PullResult, PushResult

__all__ = ["PSClient", "Membership", "PullResult", "PushResult", "sgd", "adagrad", "adam",
           "zeros", "constant", "uniform", "normal", "dense_table", "sparse_table"]
