"""A push's plan executed (``server/node/plan.py``, ``execute.py``) leaves exactly what the
per-block engine leaves: the same values, optimizer state, versions and exactly-once records,
on the primary and on its backups. The same pushes go through both: the engine takes them
with one id repeated (a second row of zeros: a plan admits only unique ids, the engine sums
repeated ones), a plan the same ids unique, ascending or not."""

from __future__ import annotations

import numpy as np
import pytest

from shardps.blockops import APPLY_ROWS, BlockOp
from shardps.errors import InvalidArgument
from shardps.id_blocks import sparse_block_of
from shardps.server.node import execute, snapshot_block
from shardps.server.node.digest import block_digest
from shardps.server.node.plan import Planner
from shardps.tables import Consistency, TableConfig, adagrad, adam, normal, sparse_table
from tests.test_node_layers import FakePeers, G, Layers, T, dense_seg, dense_w, header, rows_seg, shard_map

ROWS, DIM = 500, 4


def _cluster(replicas, optimizer):
    """A primary s0 (and its backup s1, delivering in memory) with a sparse table "e" of 8
    blocks and a dense table "w" of 2 blocks."""
    peers = FakePeers()
    primary, backup = Layers("s0", peers), Layers("s1")
    peers.nodes["s1"] = backup
    sparse = T(sparse_table("e", DIM, num_rows=ROWS, num_blocks=8, init=normal(0.0, 0.1, seed=3)),
               [list(replicas)] * 8, TableConfig(optimizer=optimizer))
    msg = shard_map(1, [sparse, dense_w(replicas=[replicas] * 2, config=TableConfig(optimizer=optimizer))],
                    [G(["w0"])])
    primary.install(msg)
    backup.install(msg)
    return primary, backup


def _pushes(seed: int, n: int = 12):
    rng = np.random.default_rng(seed)
    for seq in range(1, n + 1):
        ids = rng.choice(ROWS, size=40, replace=False)
        grads = rng.standard_normal((40, DIM)).astype(np.float32)
        yield seq, ids, grads, rng.standard_normal(16).astype(np.float32)


# what ``_watch`` wraps: admission (``Planner.push``), execution (``execute.*``)
_WATCHED = {"admit": (Planner, "push"), "apply": (execute, "apply"), "accumulate": (execute, "accumulate"),
            "read": (execute, "read")}


def _watch(monkeypatch, name: str) -> list[bool]:
    """Wrap ``_WATCHED[name]``; the list records, per call, whether it answered (a plan
    served the request) rather than returned None (the per-block engine)."""
    took: list[bool] = []
    owner, attribute = _WATCHED[name]
    original = getattr(owner, attribute)

    def watch(*a, **kw):
        out = original(*a, **kw)
        took.append(out is not None)
        return out
    monkeypatch.setattr(owner, attribute, watch)
    return took


def _run(node: Layers, order: str, seed: int, monkeypatch) -> int:
    """Apply the pushes of ``seed`` to ``node``, their ids in ``order`` ("ascending",
    "descending", or "repeated": descending with the first id again, its gradient row zeros);
    returns how many a plan served."""
    admit = Planner.push
    admitted = _watch(monkeypatch, "admit")
    for seq, ids, grads, dense in _pushes(seed):
        request_header = header(session="w0", sequence=seq)
        request_header.acked_below = seq
        node.push(request_header, *_segments(ids, grads, dense, order))
    monkeypatch.setattr(Planner, "push", admit)
    return sum(admitted)


def _segments(ids, grads, dense, order: str):
    """(segments, payload) of a push of table "e"'s rows and table "w"'s 16 elements, the
    ids in ``order`` ("ascending", "descending", or "repeated": descending with the first id
    again, its gradient row zeros)."""
    perm = np.argsort(ids) if order == "ascending" else np.argsort(-ids)
    ids, grads = ids[perm], grads[perm]
    if order == "repeated":
        ids = np.concatenate([ids, ids[:1]])
        grads = np.concatenate([grads, np.zeros((1, DIM), np.float32)])
    e_seg, e_payload = rows_seg(ids, grads)
    w_seg, w_payload = dense_seg(0, 16, dense)
    return w_seg + e_seg, w_payload + e_payload


def _state(node: Layers) -> dict:
    out = {}
    for key, blk in sorted(node.table.blocks.items()):
        snap = snapshot_block(blk)
        out[key] = (block_digest(blk), snap.header.version, snap.header.metadata)
    return out


@pytest.mark.parametrize("optimizer", [adagrad(0.1), adam(0.01)], ids=["adagrad", "adam"])
@pytest.mark.parametrize("replicas", [("s0",), ("s0", "s1")], ids=["R=1", "R=2"])
def test_a_plan_leaves_what_the_per_block_engine_leaves(replicas, optimizer, monkeypatch):
    planned_primary, planned_backup = _cluster(replicas, optimizer)
    slow_primary, slow_backup = _cluster(replicas, optimizer)
    assert _run(planned_primary, "ascending", 5, monkeypatch) == 12
    assert _run(slow_primary, "repeated", 5, monkeypatch) == 0
    assert _state(planned_primary) == _state(slow_primary)
    if len(replicas) > 1:
        assert _state(planned_backup) == _state(slow_backup) == _state(planned_primary)
        assert planned_primary.peers.sent("replicate") and not planned_primary.peers.sent("load_blocks")


@pytest.mark.parametrize("replicas", [("s0",), ("s0", "s1")], ids=["R=1", "R=2"])
def test_unique_ids_in_any_order_take_a_plan_and_leave_the_same_state(replicas, monkeypatch):
    """A client sends a push's ids as they come when none repeats (no sort): a plan
    takes them, and the rows, state and replicas are those of the same ids sorted."""
    sorted_primary, sorted_backup = _cluster(replicas, adagrad(0.1))
    unsorted_primary, unsorted_backup = _cluster(replicas, adagrad(0.1))
    assert _run(sorted_primary, "ascending", 6, monkeypatch) == 12
    assert _run(unsorted_primary, "descending", 6, monkeypatch) == 12
    assert _state(unsorted_primary) == _state(sorted_primary)
    if len(replicas) > 1:
        assert _state(unsorted_backup) == _state(sorted_backup) == _state(sorted_primary)


def test_a_retried_push_takes_the_per_block_engine_and_is_counted_a_duplicate():
    primary, _ = _cluster(("s0",), adagrad(0.1))
    segments, payload = rows_seg([1, 2, 3], np.ones((3, DIM), np.float32))
    first = primary.push(header(session="w0", sequence=1), segments, payload)
    again = primary.push(header(session="w0", sequence=1), segments, payload)
    assert first.duplicate_blocks == 0 and again.duplicate_blocks == len(again.versions[0].blocks) > 0
    assert [list(v.versions) for v in first.versions] == [list(v.versions) for v in again.versions]


def test_dense_and_sparse_versions_in_the_ack_follow_the_blocks():
    primary, _ = _cluster(("s0",), adagrad(0.1))
    segments, payload = dense_seg(0, 16, np.ones(16))
    for seq in (1, 2):
        ack = primary.push(header(session="w0", sequence=seq), segments, payload)
    assert [(v.table, list(v.blocks), list(v.versions)) for v in ack.versions] == [("w", [0, 1], [2, 2])]
    assert [blk.version for key, blk in sorted(primary.table.blocks.items()) if key[1] == "w"] == [2, 2]


def test_a_push_with_a_block_not_initialized_is_refused_whole():
    """An ASSIGNED dense table before its INITIALIZE: the push is refused and its other
    segments are not applied (found by the data-path fuzzer)."""
    from shardps.errors import FailedPrecondition
    from shardps.tables import assigned, dense_table
    primary = Layers("s0")
    sparse = T(sparse_table("e", DIM, num_rows=ROWS, num_blocks=2), [["s0"]] * 2)
    waiting = T(dense_table("a", (8,), init=assigned(), block_size=8), [["s0"]])
    primary.install(shard_map(1, [sparse, waiting], [G(["w0"])]))
    e_seg, e_payload = rows_seg([1, 2], np.ones((2, DIM), np.float32))
    a_seg, a_payload = dense_seg(0, 8, np.ones(8), table="a")
    with pytest.raises(FailedPrecondition, match="INITIALIZE"):
        primary.push(header(session="w0", sequence=1), e_seg + a_seg, e_payload + a_payload)
    assert all(blk.version == 0 for blk in primary.table.blocks.values())
    assert all(blk.count == 0 for key, blk in primary.table.blocks.items() if key[1] == "e")


def test_a_pull_of_several_tables_takes_a_plan(monkeypatch):
    primary, _ = _cluster(("s0",), adagrad(0.1))
    took = _watch(monkeypatch, "read")
    e, ids = rows_seg([1, 2, 3, 40, 41])
    w, _ = dense_seg(0, 16)
    _, values = primary.pull(header(), w + e, ids)
    assert took == [True], "every segment after the first is read by a plan too"
    assert [v.shape for v in values] == [(16,), (5, DIM)]


def test_a_pull_naming_a_table_twice_locks_each_block_once(monkeypatch):
    primary, _ = _cluster(("s0",), adagrad(0.1))
    took = _watch(monkeypatch, "read")
    e1, i1 = rows_seg([1, 2, 3])
    e2, i2 = rows_seg([3, 4])
    w1, _ = dense_seg(0, 8)
    w2, _ = dense_seg(4, 16)
    reply, values = primary.pull(header(), e1 + w1 + e2 + w2, i1 + i2)
    assert [v.shape for v in values] == [(3, DIM), (8,), (2, DIM), (12,)]
    assert took == [True]


def test_a_pull_with_a_segment_of_no_rows_answers_an_empty_array():
    # the data-path fuzzer found the planned read indexing the blocks of a segment that has none
    primary, _ = _cluster(("s0",), adagrad(0.1))
    e1, i1 = rows_seg([5, 23, 48])
    e2, i2 = rows_seg([])
    _, values = primary.pull(header(), e1 + e2, i1 + i2)
    assert [v.shape for v in values] == [(3, DIM), (0, DIM)]


def _racing_admission(monkeypatch, during):
    """``Planner.push`` that runs ``during()`` between admitting a push and applying it
    (what another thread may do then: ``copy_blocks`` takes only the blocks' locks)."""
    admit = Planner.push

    def racing(*a, **kw):
        plan = admit(*a, **kw)
        assert plan is not None
        during()
        return plan
    monkeypatch.setattr(Planner, "push", racing)


def test_a_copy_started_between_admission_and_apply_gets_the_push(monkeypatch):
    """The lost update found in review: admission decided "no backups" before the block
    locks were taken, ``copy_blocks`` added a copy destination in between, and the push was
    acknowledged without reaching it."""
    primary, dest = _cluster(("s0",), adagrad(0.1))
    primary.peers.nodes["s1"] = dest            # dest is not listed: the copy is staged there
    ids = np.array([3, 17, 42, 99, 250], np.int64)
    e_seg, e_payload = rows_seg(ids, np.ones((5, DIM), np.float32))
    w_seg, w_payload = dense_seg(0, 16, np.ones(16))
    keys = sorted(k for k in primary.table.blocks)           # every block of both tables
    _racing_admission(monkeypatch, lambda: primary.forwarder.copy_blocks(1, keys, "s1"))
    ack = primary.push(header(session="w0", sequence=1), w_seg + e_seg, w_payload + e_payload)
    assert sum(len(v.blocks) for v in ack.versions) > 0
    assert primary.peers.sent("replicate"), "acknowledged without forwarding to the copy destination"
    for key, blk in primary.table.blocks.items():
        copy = dest.table.staged[key][0]
        assert copy.version == blk.version and block_digest(copy) == block_digest(blk), key


def test_only_the_pushs_own_unsettled_blocks_send_it_to_the_per_block_engine(monkeypatch):
    primary, _ = _cluster(("s0",), adagrad(0.1))
    served = _watch(monkeypatch, "apply")
    segments, payload = dense_seg(0, 8, np.ones(8))              # block 0 of "w" only
    primary.table.extra[("j", "w", 1)] = {"s2"}                  # another block being copied
    primary.table.needs_resync[("j", "e", 0)] = {"s2"}           # another block owed a resync
    primary.push(header(session="w0", sequence=1), segments, payload)
    assert served == [True]
    primary.table.extra[("j", "w", 0)] = {"s2"}                  # this push's block
    primary.push(header(session="w0", sequence=2), segments, payload)
    assert served == [True, False]                               # the per-block engine forwarded it
    assert [c[1] for c in primary.peers.sent("replicate")] == ["s2"]


def test_only_blocks_with_backups_are_forwarded_and_their_backups_follow():
    peers = FakePeers()
    primary, backup = Layers("s0", peers), Layers("s1")
    peers.nodes["s1"] = backup
    mixed = [["s0", "s1"] if b % 2 == 0 else ["s0"] for b in range(8)]
    sparse = T(sparse_table("e", DIM, num_rows=ROWS, num_blocks=8), mixed, TableConfig(optimizer=adagrad(0.1)))
    msg = shard_map(1, [sparse, dense_w(replicas=[("s0", "s1"), ("s0",)])], [G(["w0"])])
    primary.install(msg)
    backup.install(msg)
    ids = np.arange(0, ROWS, 7, dtype=np.int64)
    e_seg, e_payload = rows_seg(ids, np.ones((ids.shape[0], DIM), np.float32))
    w_seg, w_payload = dense_seg(0, 16, np.ones(16))
    primary.push(header(session="w0", sequence=1), w_seg + e_seg, w_payload + e_payload)
    (_, _, _, ops), = peers.sent("replicate")
    assert sorted((op.table, b) for op in ops for b in _op_blocks(op)) == [
        ("e", 0), ("e", 2), ("e", 4), ("e", 6), ("w", 0)]
    assert [op.kind for op in ops if op.table == "e"] == [APPLY_ROWS]     # one op for the table's rows
    assert sorted(backup.table.blocks) == [("j", "e", b) for b in (0, 2, 4, 6)] + [("j", "w", 0)]
    for key, blk in backup.table.blocks.items():
        assert block_digest(blk) == block_digest(primary.table.blocks[key]), key


def _op_blocks(op) -> list[int]:
    return list(op.blocks) if op.kind == APPLY_ROWS else [op.block]


def _sparse_cluster(replicas: list, backups=("s1",)):
    """A primary s0 of table "e" (8 blocks, ``replicas`` per block) and its backups,
    delivering in memory; every node holds the same map."""
    peers = FakePeers()
    primary = Layers("s0", peers)
    nodes = {name: Layers(name) for name in backups}
    peers.nodes.update(nodes)
    sparse = T(sparse_table("e", DIM, num_rows=ROWS, num_blocks=8, init=normal(0.0, 0.1, seed=3)), replicas,
               TableConfig(optimizer=adagrad(0.1)))
    msg = shard_map(1, [sparse], [G(["w0"])])
    for node in (primary, *nodes.values()):
        node.install(msg)
    return primary, nodes, peers


def _same_blocks(primary: Layers, backup: Layers) -> None:
    assert backup.table.blocks
    for key, blk in backup.table.blocks.items():
        assert block_digest(blk) == block_digest(primary.table.blocks[key]), key
        assert blk.version == primary.table.blocks[key].version, key


def test_a_tables_rows_go_to_each_set_of_backups_in_one_op():
    """Blocks of one table with different backups: each backup is sent one APPLY_ROWS op
    with the rows of its blocks only, and ends with the primary's blocks."""
    replicas = [["s0", "s1"] if b % 2 == 0 else ["s0", "s2"] for b in range(8)]
    primary, nodes, peers = _sparse_cluster(replicas, ("s1", "s2"))
    ids = np.arange(0, ROWS, 3, dtype=np.int64)
    for seq in (1, 2):
        primary.push(header(session="w0", sequence=seq), *rows_seg(ids, np.full((ids.shape[0], DIM), seq, np.float32)))
    calls = peers.sent("replicate")
    assert sorted(c[1] for c in calls) == ["s1", "s1", "s2", "s2"]
    blocks_of = sparse_block_of(ids, 8)
    for _, node, _, ops in calls:
        (op,) = ops
        mine = [b for b in range(8) if node in replicas[b]]
        assert op.kind == APPLY_ROWS and sorted(op.blocks) == mine
        assert op.id_count == np.isin(blocks_of, mine).sum()
    for node in nodes.values():
        _same_blocks(primary, node)
    assert not peers.sent("load_blocks")


def test_the_backups_are_sent_a_push_before_the_primary_applies_it_and_answer_after():
    """A plan sends the operations first, so that the backups apply them while the
    primary does, and waits for their answers once it has: at the send the primary's blocks
    are still at their old versions; at the answer at their new ones."""
    primary, nodes, peers = _sparse_cluster([["s0", "s1"]] * 8)
    ids = np.arange(0, ROWS, 5, dtype=np.int64)
    blocks = [primary.table.blocks[("j", "e", b)] for b in sorted(set(sparse_block_of(ids, 8).tolist()))]
    seen = {}
    deliver = peers.replicate

    def replicate(node, epoch, ops, arrays):
        seen["sent"] = [blk.version for blk in blocks]
        answer = deliver(node, epoch, ops, arrays)

        def answered():
            seen["answered"] = [blk.version for blk in blocks]
            return answer()
        return answered
    peers.replicate = replicate
    primary.push(header(session="w0", sequence=1), *rows_seg(ids, np.ones((ids.shape[0], DIM), np.float32)))
    assert seen == {"sent": [0] * len(blocks), "answered": [1] * len(blocks)}
    _same_blocks(primary, nodes["s1"])


def test_a_backup_behind_on_one_block_applies_the_others_and_is_sent_that_one_whole():
    primary, nodes, peers = _sparse_cluster([["s0", "s1"]] * 8)
    ids = np.arange(0, ROWS, 5, dtype=np.int64)
    primary.push(header(session="w0", sequence=1), *rows_seg(ids, np.ones((ids.shape[0], DIM), np.float32)))
    behind = ("j", "e", 3)
    nodes["s1"].table.blocks[behind].version -= 1            # diverged on block 3 only
    primary.push(header(session="w0", sequence=2), *rows_seg(ids, np.ones((ids.shape[0], DIM), np.float32)))
    (_, _, _, snaps), = peers.sent("load_blocks")
    assert [s.header.ref.block for s in snaps] == [3]
    _same_blocks(primary, nodes["s1"])


@pytest.mark.parametrize("ids, blocks, error", [
    ([1, 2, 700], None, "inside the table"),           # an id outside [0, ROWS)
    ([1, 2, 2], None, "unique"),
    (None, [0], "in those blocks"),                    # rows of blocks the op does not list
])
def test_a_malformed_apply_rows_op_is_refused_and_changes_nothing(ids, blocks, error):
    """A backup checks an APPLY_ROWS op's rows (unique, inside the table, in its blocks)
    before it changes anything."""
    _, nodes, _ = _sparse_cluster([["s0", "s1"]] * 8)
    backup = nodes["s1"]
    ids = np.asarray(ids if ids is not None else np.arange(0, 40), np.int64)
    listed = blocks if blocks is not None else list(range(8))
    op = BlockOp("j", "e", listed[0], APPLY_ROWS, blocks=listed, versions=[1] * len(listed),
                 id_count=ids.shape[0], element_count=ids.shape[0] * DIM,
                 config_version=backup.table.view.tables[("j", "e")].config.version)
    before = _state(backup)
    payload = ids.tobytes() + np.ones((ids.shape[0], DIM), np.float32).tobytes()
    with pytest.raises(InvalidArgument, match=error):
        backup.backup.apply_replicated(1, "s0", [op], payload)
    assert _state(backup) == before


def _sync_run(node: Layers, order: str, seed: int, monkeypatch) -> int:
    """Steps of a SYNC group of two workers: each pushes its rows (``order`` as in ``_run``)
    and a dense gradient, then the step applies; returns how many pushes were accumulated
    by a plan."""
    accumulated = _watch(monkeypatch, "accumulate")
    pushes = list(_pushes(seed))
    for step in range(len(pushes) // 2):
        for rank in range(2):
            _, ids, grads, dense = pushes[2 * step + rank]
            request_header = header(session=f"w{rank}", sequence=step + 1, clock=step)
            request_header.acked_below = step + 1
            node.push(request_header, *_segments(ids, grads, dense, order))
        assert node.steps.clocks["j"].applied_steps == step + 1
    return sum(accumulated)


@pytest.mark.parametrize("replicas", [("s0",), ("s0", "s1")], ids=["R=1", "R=2"])
def test_a_sync_push_accumulated_by_a_plan_leaves_what_the_per_block_engine_leaves(replicas, monkeypatch):
    """SYNC members' pushes with unique ids are accumulated by ``execute.accumulate``;
    with a repeated id (a zero row) by the per-block engine. Once every step is applied the
    rows, optimizer state, versions and exactly-once records are the same, on the primary
    and its backup (which accumulates the forwarded parts and applies each block's step)."""
    def cluster():
        peers = FakePeers()
        primary, backup = Layers("s0", peers), Layers("s1")
        peers.nodes["s1"] = backup
        sparse = T(sparse_table("e", DIM, num_rows=ROWS, num_blocks=8, init=normal(0.0, 0.1, seed=3)),
                   [list(replicas)] * 8, TableConfig(optimizer=adagrad(0.1)))
        msg = shard_map(1, [sparse, dense_w(replicas=[replicas] * 2, config=TableConfig(optimizer=adagrad(0.1)))],
                        [G(["w0", "w1"], mode=Consistency.SYNC)])
        primary.install(msg)
        backup.install(msg)
        return primary, backup

    planned_primary, planned_backup = cluster()
    slow_primary, slow_backup = cluster()
    assert _sync_run(planned_primary, "descending", 8, monkeypatch) == 12
    assert _sync_run(slow_primary, "repeated", 8, monkeypatch) == 0
    assert _state(planned_primary) == _state(slow_primary)
    if len(replicas) > 1:
        assert _state(planned_backup) == _state(slow_backup) == _state(planned_primary)
        assert not planned_primary.peers.sent("load_blocks")


def test_a_sync_push_for_an_applied_step_is_refused_by_a_plan_and_changes_nothing(monkeypatch):
    """A plan decides the step (``SyncSteps.check_step_open``) before anything
    changes: a member's push for a step already applied is refused, and no block keeps a
    part of it."""
    from shardps.errors import FailedPrecondition

    node, _ = _cluster(("s0",), adagrad(0.1))
    node.install(shard_map(2, [T(sparse_table("e", DIM, num_rows=ROWS, num_blocks=8, init=normal(0.0, 0.1, seed=3)),
                                 [["s0"]] * 8, TableConfig(optimizer=adagrad(0.1)))],
                           [G(["w0", "w1"], mode=Consistency.SYNC)]))
    accumulated = _watch(monkeypatch, "accumulate")
    ids = np.arange(0, 40, dtype=np.int64)
    for rank in range(2):
        seg, payload = rows_seg(ids, np.ones((40, DIM), np.float32))
        node.push(header(epoch=2, session=f"w{rank}", sequence=1, clock=0), seg, payload)
    assert node.steps.clocks["j"].applied_steps == 1 and accumulated == [True, True]
    before = _state(node)
    seg, payload = rows_seg(ids, np.ones((40, DIM), np.float32))
    with pytest.raises(FailedPrecondition, match="step 0 .*already applied"):
        node.push(header(epoch=2, session="w0", sequence=2, clock=0), seg, payload)
    assert _state(node) == before
    assert not any(blk.pending for blk in node.table.blocks.values())
