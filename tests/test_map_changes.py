"""Shard maps travel as changes on the wire (real manager and servers on loopback, in this
process): servers install the changes since their epoch, clients hold and route with only
their own job's tables and are sent the changes since the epoch they hold, and a receiver
that asks the old way still gets whole maps."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from shardps import mapdelta
from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import manager_pb2 as mg
from shardps.rpc.stubs import ManagerStub
from shardps.tables import sgd
from tests.waiting import wait_for


def _stub(cluster) -> tuple[grpc.Channel, ManagerStub]:
    channel = grpc.insecure_channel(cluster.address)
    return channel, ManagerStub(channel)


def test_servers_install_changes_and_hold_the_managers_map(make_cluster, client_factory):
    cluster = make_cluster(3, replication=2)
    rt = cluster.manager.runtime
    assert rt.maps.accepts == {"s0", "s1", "s2"}
    c = client_factory(cluster.address, "a")
    c.create_job()
    c.create_sparse("e", 4, optimizer=sgd(0.1), num_blocks=12)
    c.push_rows("e", np.arange(100), np.ones((100, 4), np.float32))
    cluster.add_server("s3")                               # a join: the list and the blocks move
    cluster.wait_serving(4)
    wait_for("the join's moves", lambda: rt.pending_moves == 0 and all(
        s.node.epoch == rt.published.epoch for s in cluster.servers.values()), 30)
    for s in cluster.servers.values():
        assert s.node.table.view.msg == rt.published, s.name
    sent = {form: rt.metrics.registry.get_sample_value("shardps_map_sent_bytes_total", {"form": form})
            for form in ("whole", "changes")}
    assert sent["changes"] > 0, sent                       # the installs after registration
    np.testing.assert_allclose(c.pull_rows("e", np.arange(100)), np.full((100, 4), -0.1), rtol=1e-6)


def test_a_server_holding_another_epoch_refuses_the_changes_and_gets_the_whole_map(make_cluster):
    cluster = make_cluster(2)
    node = cluster.servers["s0"].node
    base = node.table.view.msg
    later = pb.ShardMap()
    later.CopyFrom(base)
    later.epoch = base.epoch + 5
    changes = mapdelta.diff(later, later)
    changes.epoch = base.epoch + 6
    with pytest.raises(mapdelta.StaleBase, match=f"from epoch {base.epoch + 5} cannot be applied to "
                                                 f"epoch {base.epoch}"):
        node.install_map(changes)
    assert node.epoch == base.epoch


def test_clients_hold_their_own_job_and_are_sent_changes(make_cluster, client_factory):
    cluster = make_cluster(2)
    a, b = client_factory(cluster.address, "a"), client_factory(cluster.address, "b")
    for c in (a, b):
        c.create_job()
        c.create_dense("w", (64,), optimizer=sgd(0.1))
    a.join()
    assert {job for job, _ in a.shard_map.tables} == {"a"}
    assert set(a.shard_map.groups) <= {"a"} and "a" in a.refresh_map().groups
    channel, stub = _stub(cluster)
    try:
        now = cluster.manager.runtime.published
        same = stub.GetShardMap(mg.GetShardMapRequest(known_epoch=now.epoch, job="a"), timeout=5)
        assert same.HasField("changes") and same.ByteSize() < 16
        b.create_dense("v", (4096,), optimizer=sgd(0.1))  # another job's change
        later = cluster.manager.runtime.published
        mine = stub.GetShardMap(mg.GetShardMapRequest(known_epoch=now.epoch, job="a"), timeout=5)
        assert mine.HasField("changes") and not mine.changes.tables
        assert mapdelta.apply(mapdelta.only_job(now, "a"), mine) == mapdelta.only_job(later, "a")
        old_way = stub.GetShardMap(mg.GetShardMapRequest(), timeout=5)       # a client of before
        assert old_way == later and {t.job for t in old_way.tables} == {"a", "b"}
        gone = stub.GetShardMap(mg.GetShardMapRequest(known_epoch=1, job="a"), timeout=5)
        assert not gone.HasField("changes") or gone.changes.from_epoch == 1     # whole, or from 1
        watch = channel.unary_stream("/shardps.v1.ResourceManager/WatchShardMap",
                                     request_serializer=mg.WatchShardMapRequest.SerializeToString,
                                     response_deserializer=pb.ShardMap.FromString)(
            mg.WatchShardMapRequest(changes=True, job="b"), timeout=5)
        first = next(watch)
        assert not first.HasField("changes") and {t.job for t in first.tables} == {"b"}
        b.create_dense("u", (8,), optimizer=sgd(0.1))
        second = next(watch)
        assert second.HasField("changes") and [t.table for t in second.changes.tables] == ["u"]
        assert mapdelta.apply(first, second) == mapdelta.only_job(cluster.manager.runtime.published, "b")
        watch.cancel()
    finally:
        channel.close()
    epoch = a.refresh_map().epoch                             # a's map follows, by changes
    assert epoch == cluster.manager.runtime.published.epoch
    assert a.shard_map.msg == mapdelta.only_job(cluster.manager.runtime.published, "a")


def test_server_heartbeats_are_answered_while_a_map_install_waits(make_cluster):
    """A map install waiting on a server that died unnoticed (up to the install timeout) must
    not hold the other servers' heartbeats: in the docker test's CI run it did, for 3 s, and
    the manager declared every server dead at once (a block lost its last replica)."""
    import threading
    import time

    from shardps.tables import Consistency
    cluster = make_cluster(2)
    rt, svc = cluster.manager.runtime, cluster.manager.service
    release = threading.Event()
    install = rt.maps.install

    def hung(*args, **kwargs):                 # a server that does not answer
        release.wait(10)
        return install(*args, **kwargs)

    rt.maps.install = hung
    publishing = threading.Thread(target=lambda: rt.change(lambda s: s.create_job("j", Consistency.ASYNC, 0)))
    publishing.start()
    try:
        wait_for("a change being installed", lambda: rt.state.epoch > rt.published.epoch, 10)
        with rt.lock:
            incarnation = rt.state.servers["s0"].incarnation
        started = time.monotonic()
        resp = svc.server_heartbeat(mg.ServerHeartbeatRequest(name="s0", incarnation=incarnation), None)
        took = time.monotonic() - started
    finally:
        release.set()
        publishing.join(timeout=30)
        rt.maps.install = install
    assert took < 1.0, took
    assert resp.epoch < rt.state.epoch or resp.epoch == rt.published.epoch
