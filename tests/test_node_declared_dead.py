"""A server node's forwarding to a backup its newest map declares dead (``Forwarder.declare_dead``),
on the layers and fake peers of tests/test_node_layers.py."""

import numpy as np
import pytest

from shardps.errors import Unavailable
from tests.test_node_layers import JOB, G, Layers, dense_seg, dense_w, header, shard_map


def test_a_backup_declared_dead_is_not_called_until_a_newer_map_lists_it():
    """A map declaring s1 dead: its calls in flight are abandoned and a push still forwarding
    under the old map fails at once (not at the forward timeout, holding the install); an
    older map's word is ignored; a newer map listing s1 alive lets it be called again."""
    key = (JOB, "w", 0)
    node = Layers()
    node.install(shard_map(1, [dense_w()], [G(["w0"])]))
    node.forwarder.declare_dead(2, {"s1"})
    assert node.peers.sent("abandon") == [("abandon", "s1")]
    segments, payload = dense_seg(0, 8, np.ones(8))
    with pytest.raises(Unavailable, match="s1 was declared dead"):
        node.push(header(session="w0", sequence=1), segments, payload)
    assert not node.peers.sent("replicate") and node.table.needs_resync == {key: {"s1"}}
    node.forwarder.declare_dead(1, set())                 # an older map: still dead
    assert node.forwarder.dead == {"s1"}
    node.forwarder.declare_dead(3, set())                 # listed alive again
    ack = node.push(header(session="w0", sequence=1), segments, payload)
    assert ack.duplicate_blocks == 1 and [c[1] for c in node.peers.sent("load_blocks")] == ["s1"]
    assert node.peers.sent("abandon") == [("abandon", "s1")]
