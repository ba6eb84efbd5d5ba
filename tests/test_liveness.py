"""A server that did not run for a while refuses data requests until the manager answered a
heartbeat sent after it (``server/node/liveness.py``); its reason names the stall. The real
pause, with a reader whose map is as old as the paused server's: tests/test_chaos.py."""

from __future__ import annotations

import numpy as np
import pytest

from shardps.errors import Unavailable
from shardps.server.node import ServerNode
from shardps.server.node.liveness import Liveness, stall_seconds


def _watched(now: float = 100.0) -> Liveness:
    live = Liveness()
    live.configure(lease_seconds=3.0, heartbeat_seconds=0.5, now=now)
    return live


def test_the_stall_bound_is_the_lease_less_two_heartbeat_intervals():
    assert stall_seconds(3.0, 0.5) == 2.0
    assert stall_seconds(1.0, 0.5) == 0.5          # at least one interval


def test_a_node_without_a_manager_never_refuses():
    live = Liveness()
    live.tick(0.0)
    assert live.refusal(1e6, 0) is None


def test_regular_ticks_serve_and_a_gap_longer_than_the_bound_refuses():
    live = _watched()
    for t in np.arange(1, 50) * 0.2 + 100.0:      # the last at 109.8
        live.tick(float(t))
        assert live.refusal(float(t) + 0.1, 5) is None
    reason = live.refusal(112.3, 5)                 # 2.5 s after the last tick, without a tick
    assert reason is not None and "did not run for 2.5 s" in reason and "longer than 2.0 s" in reason
    assert live.stalls == 1


def test_it_serves_again_once_a_heartbeat_sent_after_the_stall_is_answered_and_its_map_installed():
    live = _watched()
    sent_before = live.heartbeat_sent(100.1)
    live.tick(104.0)                                # the process ran again: a stall of 3.9 s
    live.heartbeat_answered(sent_before, 9)          # in flight across the stall: proves nothing
    assert live.refusal(104.1, 8) is not None
    sent = live.heartbeat_sent(104.2)
    assert live.refusal(104.3, 8) is not None        # not answered yet
    live.heartbeat_answered(sent, 9)
    assert live.refusal(104.4, 8) is not None, "the manager's map (epoch 9) is not installed yet"
    assert live.refusal(104.5, 9) is None
    assert live.refusal(104.6, 9) is None and live.stalls == 1


def test_a_stalled_node_refuses_pushes_and_pulls_with_unavailable():
    node = ServerNode("s0")
    node.liveness.configure(3.0, 0.5, now=0.0)       # ticks stopped at 0: any request now is late
    from shardps.messages import GRADIENT, Header, PullRequest, PushRequest
    with pytest.raises(Unavailable, match="server s0: this server did not run"):
        node.pull(PullRequest(Header("j", epoch=0), [], b""))
    with pytest.raises(Unavailable, match="may have been replaced"):
        node.push(PushRequest(Header("j", epoch=0, session="w", incarnation=1), GRADIENT, [], b""))
