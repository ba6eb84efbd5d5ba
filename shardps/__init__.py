"""shardps: a sharded, replicated gRPC parameter server for PyTorch training.

Subpackages: ``shardps.worker`` (the client library and PyTorch integration),
``shardps.server`` (server nodes and the resource manager), ``shardps.protos`` (the wire
contract). The manager and servers never import torch.
"""

__version__ = "0.1.0"
