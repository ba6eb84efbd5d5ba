"""A block whose every replica died is never silently re-created empty: requests touching it
fail with DataLost naming the table, the blocks, the server and the ways out (or wait while
the manager restores it from the job's latest checkpoint); lost blocks are counted in the
status and the metrics; other jobs' blocks are refused as loudly; a reset or a restore ends
it. Real gRPC servers in this process, a server stopped without warning (its lease expires)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from shardps.errors import DataLost
from shardps.protos.v1 import common_pb2 as pb
from shardps.tables import sgd
from tests.waiting import wait_for

IDS = np.arange(400)


def _fill(client, job: str, value: float = 1.0) -> None:
    client.create_job()
    client.create_sparse("emb", dim=4, optimizer=sgd(lr=1.0), num_blocks=16)
    client.push_rows("emb", IDS, np.full((IDS.shape[0], 4), value, np.float32))


def _ids_on(client, server: str, on: bool) -> np.ndarray:
    """The ids of IDS whose block's primary is (``on``) / is not ``server`` in the client's map."""
    from shardps.id_blocks import sparse_block_of
    t = client.refresh_map().table(client.job, "emb")
    blocks = sparse_block_of(IDS, t.spec.num_blocks)
    return IDS[np.array([(t.replicas[b][0] == server) == on for b in blocks])]


def _lost(cluster, recovery: int):
    status = cluster.manager.service.get_cluster_status(None, None)
    losses = [d for g in status.groups for d in g.data_loss if d.recovery == recovery]
    return (status, losses) if status.lost_blocks and losses else None


@pytest.mark.slow          # waits out leases or retry intervals: over a second
def test_lost_blocks_fail_loudly_in_every_job_until_reset(make_cluster, client_factory):
    cluster = make_cluster(2, replication=1, lease=1.0)
    a, b = client_factory(cluster.address, "a"), client_factory(cluster.address, "b")
    _fill(a, "a")
    _fill(b, "b")
    lost_ids, kept_ids = _ids_on(a, "s1", True), _ids_on(a, "s1", False)
    assert lost_ids.size and kept_ids.size
    cluster.servers.pop("s1").stop()                       # no goodbye: its lease expires

    status, losses = wait_for("the manager to declare the blocks lost", lambda: _lost(cluster, pb.DataLoss.LOST), 20,
                              interval=0.1)
    assert {d.server for d in losses} == {"s1"} and {d.table for d in losses} == {"emb"}
    assert "no checkpoint directory" in losses[0].detail
    gauge = cluster.manager.metrics.registry.get_sample_value("shardps_lost_blocks")
    assert gauge == status.lost_blocks > 0
    for client in (a, b):                                  # the other job too: loudly, not silently
        with pytest.raises(DataLost) as err:
            client.pull_rows("emb", IDS, timeout=10)
        msg = err.value.message
        assert "'emb'" in msg and "s1" in msg and f"shardps restore {client.job}" in msg \
            and f"reset-lost {client.job} emb" in msg, msg
        with pytest.raises(DataLost):
            client.push_rows("emb", lost_ids[:3], np.ones((3, 4), np.float32), timeout=10)
    np.testing.assert_array_equal(a.pull_rows("emb", kept_ids), -np.ones((kept_ids.size, 4)))

    assert a.reset_lost("emb") > 0 and a.reset_lost("emb") == 0      # idempotent
    np.testing.assert_array_equal(a.pull_rows("emb", lost_ids), np.zeros((lost_ids.size, 4)))
    np.testing.assert_array_equal(a.pull_rows("emb", kept_ids), -np.ones((kept_ids.size, 4)))
    a.push_rows("emb", lost_ids, np.ones((lost_ids.size, 4), np.float32))
    assert (a.pull_rows("emb", lost_ids) == -1).all()
    assert [d.recovery for d in a.data_loss] == [pb.DataLoss.RESET]
    with pytest.raises(DataLost):                          # job b did not reset its own
        b.pull_rows("emb", lost_ids, timeout=10)
    assert cluster.manager.service.get_cluster_status(None, None).lost_blocks > 0


@pytest.mark.slow          # waits out leases or retry intervals: over a second
def test_lost_blocks_are_restored_from_the_jobs_latest_checkpoint(make_cluster, client_factory, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="shardps.client")
    cluster = make_cluster(2, replication=1, lease=1.0, manager_settings={"checkpoint_dir": str(tmp_path)})
    a = client_factory(cluster.address, "a")
    _fill(a, "a")                                          # rows at -1
    path = a.checkpoint().path
    a.push_rows("emb", IDS, np.ones((IDS.shape[0], 4), np.float32))     # -2, after the checkpoint
    lost_ids, kept_ids = _ids_on(a, "s1", True), _ids_on(a, "s1", False)
    cluster.servers.pop("s1").stop()

    # a call made while the manager finds and loads the checkpoint waits for it (UNAVAILABLE
    # is retried), then reads the checkpoint's values of the lost rows
    rows = a.pull_rows("emb", IDS, timeout=30)
    lost = np.isin(IDS, lost_ids)
    np.testing.assert_array_equal(rows[lost], -np.ones((lost.sum(), 4)))        # the checkpoint's
    np.testing.assert_array_equal(rows[~lost], -2 * np.ones(((~lost).sum(), 4)))  # kept: current
    status, losses = wait_for("the loss recorded as restored", lambda: _lost_restored(cluster), 10, 0.1)
    assert status.lost_blocks == 0
    assert losses[0].checkpoint == path and losses[0].server == "s1"
    a.refresh_map()
    assert [d.recovery for d in a.data_loss] == [pb.DataLoss.RESTORED]
    assert cluster.manager.metrics.registry.get_sample_value(
        "shardps_blocks_recovered_total", {"training_job": "a", "how": "restored"}) == len(losses[0].blocks)
    a.push_rows("emb", kept_ids, np.ones((kept_ids.size, 4), np.float32))     # training goes on
    said = [r.getMessage() for r in caplog.records if r.name == "shardps.client" and "restored from" in r.getMessage()]
    assert len(said) == 1, said                         # the client says what the table now holds
    n = len(losses[0].blocks)
    assert f"{n} of 16 block(s) restored from checkpoint {path} at step" in said[0]
    assert f"the table's other {16 - n} block(s) keep their current values, so the table mixes the two" in said[0]
    assert "shardps restore a" in said[0]


def _lost_restored(cluster):
    status = cluster.manager.service.get_cluster_status(None, None)
    losses = [d for g in status.groups for d in g.data_loss if d.recovery == pb.DataLoss.RESTORED]
    return (status, losses) if losses else None
