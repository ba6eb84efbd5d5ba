"""``shardps status`` and the replication gauges say when R cannot be restored."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from shardps.metrics import ManagerMetrics
from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import manager_pb2 as mg
from shardps.status import format_status, restored_text, status_to_dict
from shardps.tables import sgd
from tests.waiting import wait_for


def _status(replication: int, states: list[int], under: int) -> mg.ClusterStatus:
    st = mg.ClusterStatus(epoch=7, replication=replication, blocks=30, under_replicated_blocks=under)
    for i, state in enumerate(states):
        st.servers.add(server=pb.ServerInfo(name=f"s{i}", address=f"h:{i}", incarnation=1, state=state))
    return st


def test_status_says_when_r_cannot_be_restored():
    st = _status(2, [pb.SERVING, pb.DEAD, pb.DEAD], under=30)
    text = format_status(st)
    assert "under-replicated 30" in text
    assert ("replication 2 cannot be restored: 1 server(s) can hold blocks; 30 blocks stay "
            "under-replicated until 1 more server(s) join") in text
    data = status_to_dict(st)
    assert data["replication_target_reachable"] is False and data["unrestorable_blocks"] == 30


def test_status_is_quiet_while_r_can_be_restored():
    st = _status(2, [pb.SERVING, pb.JOINING, pb.DEAD], under=12)      # copies to s1 will follow
    assert "cannot be restored" not in format_status(st)
    data = status_to_dict(st)
    assert data["replication_target_reachable"] is True and data["unrestorable_blocks"] == 0


def test_draining_servers_do_not_count_towards_r():
    st = _status(2, [pb.SERVING, pb.DRAINING], under=0)
    assert "replication 2 cannot be restored: 1 server(s)" in format_status(st)


def test_replication_gauges():
    from shardps.server.manager.records import ReplicationHealth
    m = ManagerMetrics(CollectorRegistry())
    m.set_replication(ReplicationHealth(target=2, servers=1, under_replicated=30, unrestorable=30))
    assert m.registry.get_sample_value("shardps_under_replicated_blocks") == 30
    assert m.registry.get_sample_value("shardps_replication_unrestorable_blocks") == 30


@pytest.mark.slow          # waits out leases or retry intervals: over a second
def test_cluster_status_after_losing_servers_below_r(make_cluster, client_factory):
    """Two servers, R=2, one dies: the manager reports every block under-replicated (not 0,
    as when it counted against the servers left) and status says R cannot be restored."""
    cluster = make_cluster(2, replication=2, lease=1.0)
    c = client_factory(cluster.address)
    c.create_job()
    c.create_sparse("e", 4, optimizer=sgd(0.1), num_blocks=8)
    assert c.cluster_status().under_replicated_blocks == 0
    cluster.servers.pop("s1").stop()

    def s1_dead():
        st = c.cluster_status()
        return st if {s.server.name: s.server.state for s in st.servers}["s1"] == pb.DEAD else None

    st = wait_for("s1 declared dead", s1_dead, timeout=30, interval=0.1)
    assert st.under_replicated_blocks == 8
    assert "replication 2 cannot be restored: 1 server(s) can hold blocks; 8 blocks" in format_status(st)


def test_status_warns_at_replication_1_and_lists_each_jobs_lost_blocks():
    st = _status(1, [pb.SERVING, pb.DEAD], under=0)
    st.lost_blocks = 3
    g = st.groups.add(job="a", tables=1)
    g.data_loss.add(epoch=9, server="s1", table="emb", blocks=[1, 4, 6], lost_at_step=120,
                    recovery=pb.DataLoss.LOST, detail="job 'a' has no checkpoint under /ck")
    g.data_loss.add(epoch=5, server="s2", table="w", blocks=[0], lost_at_step=80,
                    recovery=pb.DataLoss.RESTORED, checkpoint="/ck/a/step-60", checkpoint_step=60)
    text = format_status(st)
    assert "lost 3" in text and "warning: replication 1" in text
    assert "LOST      table emb: 3 block(s) [1, 4, 6] lost with server s1 at epoch 9 (step 120)" in text
    assert "no checkpoint under /ck" in text and "shardps reset-lost a emb" in text
    assert "restored from checkpoint /ck/a/step-60 at step 60" in text
    assert "warning" not in format_status(_status(2, [pb.SERVING, pb.SERVING], under=0))


def test_a_restore_of_lost_blocks_says_what_the_table_holds_and_which_steps_are_lost():
    d = pb.DataLoss(table="emb", blocks=[1, 5], lost_at_step=57, recovery=pb.DataLoss.RESTORED,
                    checkpoint="/ck/step-20", checkpoint_step=20)
    assert restored_text(d, 16) == (
        "2 of 16 block(s) restored from checkpoint /ck/step-20 at step 20; the table's other 14 block(s) keep "
        "their current values, so the table mixes the two; the restored blocks' updates of steps 21-57 are "
        "lost. `shardps restore JOB` rolls the whole job back to one checkpoint instead")
    d.lost_at_step = 0                  # the job's step unknown then: no range like "1-0"
    assert "updates of the steps after 20 are lost" in restored_text(d)
