"""Replication inside one process: backups equal primaries, failover keeps every
acknowledged push, re-replication restores R (real gRPC servers on loopback)."""

import time

import numpy as np
import pytest

from shardps.server.node import snapshot_block
from shardps.tables import adam, sgd
from tests.waiting import wait_for


def replicas_equal(cluster, job, table):
    """Every block's replicas hold identical state (values, optimizer state, version)."""
    rt = cluster.manager.runtime
    with rt.lock:
        placement = [list(b.replicas) for b in rt.state.tables[(job, table)].blocks]
    checked = 0
    for b, reps in enumerate(placement):
        snaps = []
        for name in reps:
            blk = cluster.servers[name].node.blocks[(job, table, b)]
            with blk.lock:
                snaps.append(snapshot_block(blk))
        for other in snaps[1:]:
            assert other.header.version == snaps[0].header.version, f"block {b} versions differ"
            for x, y in zip(snaps[0].arrays, other.arrays):
                assert np.array_equal(x, y), f"block {b} of {table} differs between {reps}"
        checked += len(snaps) > 1
    return checked


def settled(cluster):
    """No move is planned and every server installed the manager's current shard map."""
    rt = cluster.manager.runtime
    with rt.lock:
        epoch, moves = rt.state.epoch, rt.state.plan_moves()
        retired = {n for n, rec in rt.state.servers.items() if rec.retired}
    return not moves and all(s.node.view.epoch >= epoch for n, s in cluster.servers.items()
                             if n not in retired)


def wait(cond, what: str, timeout: float = 30.0):
    wait_for(what, cond, timeout, interval=0.05)


@pytest.mark.parametrize("transport", ["dataplane", "client_stream"])
def test_backups_apply_exactly_what_primaries_apply(make_cluster, client_factory, transport):
    # servers forward over their peers' data planes; without one, over gRPC
    cluster = make_cluster(3, replication=2,
                           server_settings={} if transport == "dataplane" else {"data_plane_port": -1})
    c = client_factory(cluster.address)
    c.create_job()
    c.join(heartbeat=False)
    c.create_dense("d", (5000,), optimizer=adam(1e-2), block_size=500)
    c.create_sparse("e", 8, optimizer=sgd(0.1), num_blocks=16)
    rng = np.random.default_rng(0)
    for _ in range(5):
        c.push_dense("d", rng.standard_normal(5000).astype(np.float32))
        c.push_rows("e", rng.integers(0, 10_000, 300), rng.standard_normal((300, 8)).astype(np.float32))
    assert replicas_equal(cluster, "test", "d") == 10
    assert replicas_equal(cluster, "test", "e") == 16
    other = "client_stream" if transport == "dataplane" else "dataplane"
    assert replicate_calls(cluster, transport) >= 10 and replicate_calls(cluster, other) == 0


def replicate_calls(cluster, grpc_type: str) -> float:
    """Replicate calls the cluster's servers answered OK over ``grpc_type``."""
    return sum(s.metrics.registry.get_sample_value("grpc_server_handled_total", {
        "grpc_service": "shardps.v1.ParameterServer", "grpc_method": "Replicate", "grpc_type": grpc_type,
        "grpc_code": "OK"}) or 0.0 for s in cluster.servers.values())


@pytest.mark.slow          # waits out leases or retry intervals: over a second
def test_failover_keeps_acknowledged_pushes_and_restores_r(make_cluster, client_factory):
    cluster = make_cluster(3, replication=2, lease=1.0)
    c = client_factory(cluster.address, timeout=30)
    c.create_job()
    c.join(heartbeat=False)
    c.create_sparse("counters", 1, optimizer=sgd(1.0), num_blocks=12)
    ids = np.arange(200)
    for _ in range(5):
        c.push_rows("counters", ids, -np.ones((200, 1), np.float32))
    victim = "s1"
    cluster.servers[victim].stop()          # gone without a goodbye
    killed = time.monotonic()
    for _ in range(5):
        c.push_rows("counters", ids, -np.ones((200, 1), np.float32))
    recovered = time.monotonic() - killed
    np.testing.assert_array_equal(c.pull_rows("counters", ids)[:, 0], np.full(200, 10.0))
    print(f"recovery (in-process, lease 1 s): {recovered:.2f}s")
    rt = cluster.manager.runtime
    del cluster.servers[victim]
    wait(lambda: rt.state.under_replicated() == 0 and settled(cluster), what="R restored")
    with rt.lock:
        assert all(len(b.replicas) == 2 and victim not in b.replicas
                   for b in rt.state.tables[("test", "counters")].blocks)
    assert replicas_equal(cluster, "test", "counters") == 12
    np.testing.assert_array_equal(c.pull_rows("counters", ids)[:, 0], np.full(200, 10.0))


def test_new_server_takes_blocks_and_drain_empties_one(make_cluster, client_factory):
    cluster = make_cluster(2, replication=2)
    c = client_factory(cluster.address)
    c.create_job()
    c.join(heartbeat=False)
    c.create_dense("w", (64 * 60,), optimizer=sgd(1.0), block_size=64)
    c.push_dense("w", np.ones(64 * 60, np.float32))
    rt = cluster.manager.runtime
    cluster.add_server("s2")
    wait(lambda: settled(cluster) and any("s2" in b.replicas for b in rt.state.tables[("test", "w")].blocks),
         what="rebalance onto s2")
    c.push_dense("w", np.ones(64 * 60, np.float32))
    np.testing.assert_array_equal(c.pull_dense("w"), -2 * np.ones(64 * 60))
    assert replicas_equal(cluster, "test", "w") == 60
    rt.change(lambda s: s.drain_server("s0"))
    wait(lambda: rt.state.servers["s0"].retired and settled(cluster), what="s0 drained")
    assert all("s0" not in b.replicas for b in rt.state.tables[("test", "w")].blocks)
    c.push_dense("w", np.ones(64 * 60, np.float32))
    np.testing.assert_array_equal(c.pull_dense("w"), -3 * np.ones(64 * 60))
    assert replicas_equal(cluster, "test", "w") == 60


def test_empty_sparse_blocks_copy_to_a_new_server(make_cluster, client_factory):
    """Blocks without a stored row are copied too (their snapshot holds zero-row arrays)."""
    cluster = make_cluster(2, replication=2)
    c = client_factory(cluster.address)
    c.create_job()
    c.create_sparse("e", 4, optimizer=sgd(1.0), num_blocks=32)
    c.push_rows("e", [1, 2, 3], np.ones((3, 4), np.float32))            # most blocks stay empty
    rt = cluster.manager.runtime
    cluster.add_server("s2")
    wait(lambda: settled(cluster) and any("s2" in b.replicas for b in rt.state.tables[("test", "e")].blocks),
         what="rebalance onto s2")
    assert replicas_equal(cluster, "test", "e") == 32
    np.testing.assert_array_equal(c.pull_rows("e", [1, 2, 3]), -np.ones((3, 4)))
