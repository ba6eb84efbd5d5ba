"""A server node's logic: the blocks it holds, the shard map it obeys, its replication duties.

``ServerNode`` (node.py) is the facade other code uses; the modules beside it are its layers
(see node.py's docstring for the map, table.py for the lock order). The names below are the
package's public API; import them from ``shardps.server.node``.
"""

from shardps.blockops import BlockSnapshot
from shardps.server.node.apply import GRADIENT, INITIALIZE
from shardps.server.node.decode import MAX_CLOCK, NodeLimits
from shardps.server.node.engine import logical_bytes
from shardps.server.node.node import ServerNode
from shardps.server.node.replication import NoPeers, Peers, snapshot_block
from shardps.server.node.table import EpochGate

__all__ = ["BlockSnapshot", "EpochGate", "GRADIENT", "INITIALIZE", "MAX_CLOCK", "NoPeers",
           "NodeLimits", "Peers", "ServerNode", "logical_bytes", "snapshot_block"]
