"""SYNC steps on one node's layers (server/node/steps.py) on the fakes of test_node_layers:
the mean over live workers, closed steps, reports by pulls and pushes, steps left by a
dead primary or carried by a copied block, and replicas applied per table and per block."""

from __future__ import annotations

import numpy as np
import pytest

from shardps.errors import FailedPrecondition
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.server.node import snapshot_block
from shardps.tables import Consistency, sparse_table
from tests.test_node_layers import (
    JOB,
    FakePeers,
    G,
    Layers,
    T,
    dense_seg,
    dense_w,
    header,
    push_header,
    rows_seg,
    shard_map,
)


def test_sync_step_is_the_mean_over_live_workers_and_applied_steps_are_closed():
    node = Layers()
    node.install(shard_map(1, [dense_w(replicas=[["s0"]])],
                           [G(["w0", "w1"], mode=Consistency.SYNC)]))
    blk = node.table.blocks[(JOB, "w", 0)]
    segments, payload = dense_seg(0, 8, np.full(8, 2.0))
    node.push(header(session="w0", sequence=1, clock=0), segments, payload)
    assert blk.values is None and node.steps.clocks[JOB].applied_steps == 0   # w1 not yet
    segments, payload = dense_seg(0, 8, np.full(8, 4.0))
    node.push(header(session="w1", sequence=1, clock=0), segments, payload)
    np.testing.assert_array_equal(blk.values, np.full(8, -3.0))              # -(2 + 4) / 2
    assert node.steps.clocks[JOB].applied_steps == 1 and not blk.pending
    with pytest.raises(FailedPrecondition, match="step 0 .*already applied"):
        node.push(header(session="w0", sequence=2, clock=0), segments, payload)
    np.testing.assert_array_equal(blk.values, np.full(8, -3.0))
    assert not blk.pending


def test_a_promoted_backup_applies_the_sync_step_its_old_primary_did_not_forward():
    """The backup closed step 0 when both workers reported it (the primary applies), then the
    primary's APPLY_STEP never arrived and the backup became primary: it applies step 0 from
    the gradients it holds (the verifier's seed 3: acknowledged SYNC pushes lost)."""
    peers = FakePeers(fail_kinds={ps.APPLY_STEP})
    primary, backup = Layers("s0", peers), Layers("s1")
    peers.nodes["s1"] = backup
    group = G(["w0", "w1"], mode=Consistency.SYNC)
    for n in (primary, backup):
        n.install(shard_map(1, [dense_w()], [group]))
    for rank, g in enumerate((2.0, 4.0)):
        segments, payload = dense_seg(0, 8, np.full(8, g))
        primary.push(header(session=f"w{rank}", sequence=1, clock=0), segments, payload)
        backup.steps.clocks[JOB].report(f"w{rank}", 0, 1)     # next_step reports to every server
    backup.steps.apply_ready(JOB)
    blk = backup.table.blocks[(JOB, "w", 0)]
    assert blk.values is None and 0 in blk.pending           # closed here, left to the primary
    assert backup.steps.clocks[JOB].applied_steps == 1
    backup.install(shard_map(2, [dense_w(replicas=[["s1"]], since=2)], [group], dead=("s0",)))
    np.testing.assert_array_equal(blk.values, np.full(8, -3.0))
    assert not blk.pending and backup.steps.clocks[JOB].applied_steps == 1


def test_a_block_copied_with_accumulated_gradients_applies_them_as_primary():
    primary, dest = Layers("s0"), Layers("s1")
    group = G(["w0", "w1"], mode=Consistency.SYNC)
    primary.install(shard_map(1, [dense_w(replicas=[["s0"]])], [group]))
    dest.install(shard_map(1, [dense_w(replicas=[["s0", "s1"]])], [group]))
    segments, payload = dense_seg(0, 8, np.full(8, 2.0))
    primary.push(header(session="w0", sequence=1, clock=0), segments, payload)   # w1: not yet
    dest.backup.load_blocks(1, "s0", [snapshot_block(primary.table.blocks[(JOB, "w", 0)])])
    dest.install(shard_map(2, [dense_w(replicas=[["s1"]], since=2)], [group], dead=("s0",)))
    for w in ("w0", "w1"):
        dest.steps.clocks[JOB].report(w, 0)
    dest.steps.apply_ready(JOB)
    np.testing.assert_array_equal(dest.table.blocks[(JOB, "w", 0)].values, np.full(8, -1.0))   # -2 / 2


def test_a_sync_pull_counts_as_its_workers_report_of_the_step_before():
    """w1 pushed nothing here for step 0 and its report went to the servers of its older map;
    its pull of step 1 says it completed step 0, so the step applies instead of both pulls
    waiting for each other until the deadline."""
    node = Layers()
    node.install(shard_map(1, [dense_w(replicas=[["s0"]])], [G(["w0", "w1"], mode=Consistency.SYNC)]))
    segments, payload = dense_seg(0, 8, np.full(8, 2.0))
    node.push(header(session="w0", sequence=1, clock=0), segments, payload)
    assert node.steps.clocks[JOB].applied_steps == 0
    segments, _ = dense_seg(0, 8)
    out, arrays = node.pull(header(session="w1", clock=1), segments, b"", deadline=node.clock.now)
    assert node.steps.clocks[JOB].applied_steps == 1
    np.testing.assert_array_equal(np.frombuffer(arrays[0], dtype="<f4"), np.full(8, -1.0))   # -2 / 2


def test_a_sync_push_counts_as_its_workers_report_of_the_step_before():
    """As above, for a push: w1's report of step 0 did not reach this server; its push of
    step 1 is taken (not refused as ahead of the clock) and step 0 applies."""
    node = Layers()
    node.install(shard_map(1, [dense_w(replicas=[["s0"]])], [G(["w0", "w1"], mode=Consistency.SYNC)]))
    segments, payload = dense_seg(0, 8, np.full(8, 2.0))
    node.push(header(session="w0", sequence=1, clock=0), segments, payload)
    node.push(header(session="w1", sequence=2, clock=1), segments, payload)
    assert node.steps.clocks[JOB].applied_steps == 1
    np.testing.assert_array_equal(node.table.blocks[(JOB, "w", 0)].values, np.full(8, -1.0))
    assert list(node.table.blocks[(JOB, "w", 0)].pending) == [1]


def test_a_sync_step_applied_per_table_leaves_replicas_identical_to_per_block():
    """The primary applies a sparse table's step in one call over all of its blocks; the
    backup applies each block's APPLY_STEP on its own. Three workers push overlapping rows
    whose sums depend on the order they are added in: both replicas must end bit for bit
    the same, each row the initial value less the mean of its gradients."""
    from shardps.kernels import initial_values

    peers = FakePeers()
    primary, backup = Layers("s0", peers), Layers("s1")
    peers.nodes["s1"] = backup
    spec = sparse_table("e", 4, num_rows=1000, num_blocks=4)
    msg = shard_map(1, [T(spec, [["s0", "s1"]] * 4)], [G(["w0", "w1", "w2"], mode=Consistency.SYNC)])
    for n in (primary, backup):
        n.install(msg)
    rng = np.random.default_rng(7)
    pushed = {}
    for rank in range(3):
        ids = rng.choice(40, size=30, replace=False).astype(np.int64)
        grads = (rng.standard_normal((30, 4)) * rng.choice([1e-7, 1.0, 1e7], (30, 4))).astype(np.float32)
        segments, payload = rows_seg(ids, grads)
        primary.push(header(session=f"w{rank}", sequence=1, clock=0), segments, payload)
        for i, g in zip(ids.tolist(), grads):
            pushed.setdefault(i, []).append(g)
    assert primary.steps.clocks[JOB].applied_steps == 1
    apply_steps = [op for c in peers.sent("replicate") for op in c[3] if op.kind == ps.APPLY_STEP]
    assert sorted(op.block for op in apply_steps) == [0, 1, 2, 3]       # one per block
    for b in range(4):
        a, c = (snapshot_block(n.table.blocks[(JOB, "e", b)]) for n in (primary, backup))
        assert a.header.version == c.header.version and not primary.table.blocks[(JOB, "e", b)].pending
        for x, y in zip(a.arrays, c.arrays):
            np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))
    ids = np.array(sorted(pushed), dtype=np.int64)
    expected = initial_values(spec.init, ids, 4)
    for k, i in enumerate(ids.tolist()):
        total = pushed[i][0].copy()
        for g in pushed[i][1:]:
            total += g
        expected[k] -= total / np.float32(3)
    rows = primary.table.sparse_rows[(JOB, "e")]
    np.testing.assert_allclose(rows.read(ids), expected, rtol=1e-6, atol=1e-6)


def test_sync_push_from_a_non_member_is_refused():
    node = Layers()
    node.install(shard_map(1, [dense_w(replicas=[["s0"]])], [G(["w0"], mode=Consistency.SYNC)]))
    segments, payload = dense_seg(0, 8, np.ones(8))
    with pytest.raises(FailedPrecondition, match="not a member"):
        node.push(push_header(), segments, payload)
    assert node.table.blocks[(JOB, "w", 0)].version == 0


def test_a_worker_that_pushed_its_step_and_left_still_counts_in_the_mean():
    # a worker's last push, then its leave, can both land before a slower worker's push of
    # that step: the step's mean is still over the three gradients accumulated, not over
    # the two workers left (examples/logreg_sync.py agreed with one large batch to 1e-2 only)
    node = Layers()
    node.install(shard_map(1, [dense_w(replicas=[["s0"]])], [G(["w0", "w1", "w2"], mode=Consistency.SYNC)]))
    blk = node.table.blocks[(JOB, "w", 0)]
    for session, value in (("w0", 3.0), ("w1", 6.0)):
        segments, payload = dense_seg(0, 8, np.full(8, value))
        node.push(header(session=session, sequence=1, clock=0), segments, payload)
    node.install(shard_map(2, [dense_w(replicas=[["s0"]])], [G(["w1", "w2"], mode=Consistency.SYNC)]))   # w0 left
    segments, payload = dense_seg(0, 8, np.full(8, 9.0))
    node.push(header(session="w2", sequence=1, clock=0, epoch=2), segments, payload)
    np.testing.assert_array_equal(blk.values, np.full(8, -6.0))              # -(3 + 6 + 9) / 3
