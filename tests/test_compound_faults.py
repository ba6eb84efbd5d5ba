"""Faults in sequence, and SYNC pushes that arrive after their step (real gRPC servers on
loopback, in this process). Each test reproduces a defect of the reliability issue."""

import threading
import time

import numpy as np
import pytest

from shardps.errors import FailedPrecondition
from shardps.tables import sgd
from shardps.worker.routing import route
from tests.test_replication import replicas_equal, settled
from tests.waiting import wait_for


def _restored(cluster) -> bool:
    rt = cluster.manager.runtime
    with rt.lock:
        r = rt.state.settings.replication
        full = all(len(b.replicas) >= r for t in rt.state.tables.values() for b in t.blocks)
    return full and settled(cluster)


@pytest.mark.slow          # two lease expiries, ~2.5 s
def test_a_second_failure_after_rereplication_leaves_pushes_flowing(make_cluster, client_factory):
    """R=2, 3 servers: kill one, wait until R is restored (its blocks were copied to the
    others), kill a second. The survivor must drop the dead copy destination and keep
    acknowledging pushes; before the fix it forwarded to it forever (DEADLINE_EXCEEDED)."""
    cluster = make_cluster(3, replication=2, lease=1.0)
    c = client_factory(cluster.address, timeout=20)
    c.create_job()
    c.join(heartbeat=False)
    c.create_sparse("counters", 1, optimizer=sgd(1.0), num_blocks=12)
    ids = np.arange(240)
    pushes = 0

    def push():
        nonlocal pushes
        c.push_rows("counters", ids, -np.ones((240, 1), np.float32))
        pushes += 1

    push()
    cluster.servers.pop("s1").stop()
    push()                                  # acknowledged across the failover
    wait_for("R restored after the first failure", lambda: _restored(cluster), 30, interval=0.05)
    push()
    cluster.servers.pop("s2").stop()        # a copy destination of s0's blocks dies too
    started = time.monotonic()
    for _ in range(3):
        push()
    gap = time.monotonic() - started
    np.testing.assert_array_equal(c.pull_rows("counters", ids)[:, 0], np.full(240, float(pushes)))
    node = cluster.servers["s0"].node
    assert not node.extra and not node.needs_resync, (node.extra, node.needs_resync)
    print(f"pushes resumed {gap:.2f}s after the second failure (lease 1 s)")


def test_install_drops_copy_destinations_once_listed(make_cluster, client_factory):
    """After a join's copies complete, the primary forwards to the new replicas because the
    map lists them, not because they are remembered as copy destinations."""
    cluster = make_cluster(2, replication=2)
    c = client_factory(cluster.address)
    c.create_job()
    c.join(heartbeat=False)
    c.create_dense("w", (64 * 30,), optimizer=sgd(1.0), block_size=64)
    c.push_dense("w", np.ones(64 * 30, np.float32))
    cluster.add_server("s2")
    rt = cluster.manager.runtime
    wait_for("rebalance onto s2", lambda: settled(cluster) and any(
        "s2" in b.replicas for b in rt.state.tables[("test", "w")].blocks), 30, interval=0.05)
    for name, s in cluster.servers.items():
        assert not s.node.extra, f"{name} still forwards to copy destinations {s.node.extra}"
    c.push_dense("w", np.ones(64 * 30, np.float32))
    assert replicas_equal(cluster, "test", "w") == 30


def _sync_client(cluster, client_factory):
    c = client_factory(cluster.address, job="bsp")
    c.create_job("sync")
    c.join(heartbeat=False)
    c.create_dense("w", (1000,), optimizer=sgd(1.0), block_size=250)
    return c


def test_sync_push_for_an_applied_step_is_refused_not_dropped(make_cluster, client_factory):
    """A second push for a step already applied was acknowledged, never applied, and its
    gradient kept in server memory forever. Now it is refused, says what to do, and no
    server keeps a pending gradient for a step it applied."""
    cluster = make_cluster(2)
    c = _sync_client(cluster, client_factory)
    c.push_dense("w", np.ones(1000, np.float32), clock=0)            # step 0: applied (1 live worker)
    np.testing.assert_array_equal(c.pull_dense("w"), -np.ones(1000))
    with pytest.raises(FailedPrecondition, match="step 0 .*already applied"):
        c.push_dense("w", np.ones(1000, np.float32), clock=0)        # as the README loop did: same step
    c.push_dense("w", np.ones(1000, np.float32), clock=1)            # the next step is applied
    np.testing.assert_array_equal(c.pull_dense("w"), -2 * np.ones(1000))
    for name, s in cluster.servers.items():
        pending = {k: dict(b.pending) for k, b in s.node.blocks.items() if b.pending}
        assert not pending, f"{name} holds gradients of applied steps: {list(pending)}"


def test_sync_push_without_a_session_is_refused(make_cluster, client_factory):
    """A push that is not a member's cannot be part of any step: refused, not kept forever."""
    cluster = make_cluster(2)
    _sync_client(cluster, client_factory)
    outsider = client_factory(cluster.address, job="bsp")
    with pytest.raises(FailedPrecondition, match="join"):
        outsider.push_dense("w", np.ones(1000, np.float32))
    for s in cluster.servers.values():
        assert not any(b.pending for b in s.node.blocks.values())


@pytest.mark.slow          # ~15 s
def test_restore_returns_only_when_every_block_is_readable(make_cluster, client_factory, tmp_path):
    """A restore publishes the recreated tables, then loads their blocks. A rebalance that
    ran in between copied empty blocks to a new server and listed them there, so reads
    right after Restore returned failed ("no initial values yet") or saw zeros. The servers'
    loads are held here until a new server had every chance to take blocks."""
    cluster = make_cluster(2)
    cluster.manager.service.checkpoints.default_dir = str(tmp_path)
    c = client_factory(cluster.address, job="r", timeout=60)
    c.create_job()
    c.join(heartbeat=False)
    c.create_dense("w", (64 * 24,), optimizer=sgd(1.0), block_size=64)
    c.create_sparse("e", 4, optimizer=sgd(1.0), num_blocks=24)
    ids = np.arange(0, 2400, 7)
    c.push_dense("w", np.arange(64 * 24, dtype=np.float32))
    c.push_rows("e", ids, np.ones((ids.shape[0], 4), np.float32))
    saved = c.state_dict()
    path = c.checkpoint().path
    c.push_dense("w", np.ones(64 * 24, np.float32))                 # training goes on after the checkpoint

    loading, gate = threading.Event(), threading.Event()
    for s in cluster.servers.values():
        original = s.node.load_blocks

        def gated(epoch, source, snapshots, _original=original):
            if source == "manager":
                loading.set()
                gate.wait(20)
            return _original(epoch, source, snapshots)
        s.node.load_blocks = gated
    result = {}
    restore = threading.Thread(target=lambda: result.update(resp=c.restore(path)))
    restore.start()
    try:
        wait_for("the restore's first load", loading.is_set, 20, interval=0.01)
        cluster.add_server("s2")
        rt = cluster.manager.runtime
        try:
            wait_for("a restored block moved to s2", lambda: any(
                "s2" in b.replicas for (job, _), t in list(rt.state.tables.items()) if job == "r"
                for b in t.blocks), 4, interval=0.02)
        except AssertionError:
            pass                       # no move while the restore runs: the fixed behaviour
    finally:
        gate.set()
        restore.join(60)
    assert "resp" in result, "the restore did not return"
    got = c.state_dict()
    for k, v in saved.items():
        np.testing.assert_array_equal(got[k], v, err_msg=f"{k} differs from the checkpoint")


def test_a_retried_sync_push_of_an_applied_step_is_a_duplicate_not_refused(make_cluster, client_factory):
    """An exchange whose push was applied but whose pull was refused (a map change) is sent
    again with the same sequence number; by then its step is applied. The retry must be
    acknowledged as a duplicate: refusing it failed the job (found by the e2e bench)."""
    from shardps.messages import GRADIENT
    from shardps.worker.client import requests as rq
    cluster = make_cluster(2)
    c = _sync_client(cluster, client_factory)
    view = c.refresh_map()
    piece = rq.dense_push(0, c.table("w"), np.ones(1000, np.float32), 0)
    seq = c._session.begin_push()
    sent = []
    for server, pieces in route(view, c.job, [piece]).items():
        request = c._data._push_request(pieces, view, seq, GRADIENT, 0)
        sent.append((server, view.address(server), request))
    for server, address, request in sent:                        # step 0 applied here
        assert c._transport.push(server, address, request, 10).duplicate_blocks == 0
    np.testing.assert_array_equal(c.pull_dense("w"), -np.ones(1000))
    for server, address, request in sent:                        # the same push again
        assert c._transport.push(server, address, request, 10).duplicate_blocks > 0
    c._session.end_push(seq)
    np.testing.assert_array_equal(c.pull_dense("w"), -np.ones(1000))


def test_a_late_piece_of_a_push_that_reported_its_step_is_applied_in_the_next_step(make_cluster, client_factory):
    """A push's pieces for one server can arrive in two parts when a block moved (refused by
    its old primary, re-routed here) after the first part reported the step and closed it.
    The late part, same sequence number, goes into the next step: applied, never lost. A new
    push for the closed step is still refused (found by the e2e bench's SYNC job)."""
    from shardps.messages import GRADIENT
    from shardps.worker.client import requests as rq
    cluster = make_cluster(1)
    c = _sync_client(cluster, client_factory)               # w: 1000 values in 4 blocks
    view = c.refresh_map()
    server = next(iter(cluster.servers))
    address = view.address(server)
    seq = c._session.begin_push()
    first = rq.dense_push(0, c.table("w"), np.ones(500, np.float32), 0)       # blocks 0-1
    late = rq.dense_push(0, c.table("w"), np.ones(500, np.float32), 500)      # blocks 2-3, arriving later
    for piece in (first, late):
        c._transport.push(server, address, c._data._push_request([piece], view, seq, GRADIENT, 0), 10)
    c._session.end_push(seq)
    got = c.pull_dense("w")
    np.testing.assert_array_equal(got[:500], -np.ones(500))      # step 0: the first part
    np.testing.assert_array_equal(got[500:], np.zeros(500))     # the late part waits for step 1
    with pytest.raises(FailedPrecondition, match="step 0 .*already applied"):
        c.push_dense("w", np.ones(1000, np.float32), clock=0)                # a new push for step 0
    c.push_dense("w", np.zeros(1000, np.float32), clock=1)                   # step 1 applies the late part
    np.testing.assert_array_equal(c.pull_dense("w"), -np.ones(1000))
