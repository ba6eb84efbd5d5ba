"""``Fanout``'s retry policy: a refused attempt backs off before it is routed again, unless the
client already holds a newer shard map (the one that declared the server dead and abandoned
the call): then it is routed with that map at once. Plain objects: shard maps built here, the
sends and the map source are the test's."""

from __future__ import annotations

from concurrent import futures

import pytest
from prometheus_client import CollectorRegistry

from shardps.errors import Unavailable
from shardps.metrics import WorkerMetrics
from shardps.protos.v1 import common_pb2 as pb
from shardps.rpc.convert import config_to_proto, spec_to_proto
from shardps.shardmap import ShardMapView
from shardps.tables import TableConfig, dense_table
from shardps.worker.client import fanout
from shardps.worker.routing import Piece

JOB = "retry"


def _view(epoch: int, primary: int, dead: str = "") -> ShardMapView:
    """Servers s0 and s1; one dense table of one block whose primary is server ``primary``."""
    msg = pb.ShardMap(epoch=epoch, replication=1)
    for name in ("s0", "s1"):
        msg.servers.add(name=name, address=f"{name}:1", incarnation=1,
                        state=pb.DEAD if name == dead else pb.SERVING)
    t = msg.tables.add(job=JOB, spec=spec_to_proto(dense_table("w", 8)), config=config_to_proto(TableConfig()))
    t.blocks.add(replicas=[primary], since_epoch=1, fresh_epoch=1)
    return ShardMapView(msg)


class Maps:
    """The client's map: ``view()`` what it holds now, ``refresh_map`` the newest it knows."""

    def __init__(self, view: ShardMapView):
        self.current = view

    def view(self) -> ShardMapView:
        return self.current

    def refresh_map(self, min_epoch: int = 0, timeout: float | None = None) -> ShardMapView:
        return self.current

    def table(self, name: str):
        return self.current.table(JOB, name)


@pytest.mark.parametrize("map_moved, sleeps", [(True, 0), (False, 1)])
def test_a_refused_call_is_retried_at_once_only_with_a_newer_map(monkeypatch, map_moved, sleeps):
    slept: list[float] = []
    monkeypatch.setattr(fanout.time, "sleep", slept.append)
    maps = Maps(_view(1, primary=0))
    sent: list[str] = []

    def send(server, address, pieces, view):
        sent.append(server)
        if len(sent) == 1:
            if map_moved:        # what the heartbeat's map listener does before abandoning the call
                maps.current = _view(2, primary=1, dead="s0")
            raise Unavailable(f"{server}: abandoned")

    with futures.ThreadPoolExecutor(2) as pool:
        fan = fanout.Fanout(JOB, maps, pool, WorkerMetrics(CollectorRegistry()))
        fan.run([Piece(0, "w", True, 0, 8)], deadline=fanout.time.monotonic() + 10, send=send)
    assert sent == (["s0", "s1"] if map_moved else ["s0", "s0"])
    assert len(slept) == sleeps, slept
