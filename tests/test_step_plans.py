"""A Step's parts admitted as plans and executed (``server/node/plan.py``, ``execute.py``)
leave exactly what the per-block engine leaves: the same values, optimizer state, versions
and exactly-once records on the primary and on its backup, and the same replies, for the same
Step requests written by the client's encoder and read by the server's decoder
(``shardps/rpc/step.py``). What no plan covers (a retry, a NaN, a block moved away, a SYNC
job's wait) goes to the engine, which answers as it always did."""

from __future__ import annotations

import numpy as np
import pytest

from shardps.errors import InvalidArgument, StaleEpoch
from shardps.id_blocks import sparse_block_of
from shardps.messages import GRADIENT, RANGE, ROWS, Header, Slice, StepRequest
from shardps.rpc import step
from shardps.server.node import ServerNode, execute
from shardps.server.node.digest import block_digest
from shardps.tables import (
    Consistency,
    TableConfig,
    adagrad,
    adam,
    dense_table,
    normal,
    sgd,
    sparse_table,
    uniform,
)
from tests.test_node_layers import JOB, FakePeers, G, T, shard_map

E_ROWS, DIM = 400, 4


def _tables(moved: bool = False) -> list[T]:
    """"e": bounded, normal initial values, Adagrad, 8 blocks (block 0 on s1 alone when
    ``moved``); "u": unbounded ids, SGD with momentum, 4 blocks; "w": dense, Adam, 3 blocks.
    Every block's primary s0 and backup s1."""
    both = ["s0", "s1"]
    e = T(sparse_table("e", DIM, num_rows=E_ROWS, num_blocks=8, init=normal(0.0, 0.1, seed=3)),
          [["s1"] if moved and b == 0 else both for b in range(8)], TableConfig(optimizer=adagrad(0.1)))
    u = T(sparse_table("u", 3, num_blocks=4, init=uniform(-1.0, 1.0, seed=9)), [both] * 4,
          TableConfig(optimizer=sgd(0.5, momentum=0.9)))
    w = T(dense_table("w", (24,), block_size=8), [both] * 3, TableConfig(optimizer=adam(0.01)))
    return [e, u, w]


def _nodes(general: bool, mode: Consistency = Consistency.ASYNC) -> tuple[ServerNode, ServerNode]:
    """A primary s0 and its backup s1 (forwarded operations delivered in memory); with
    ``general``, the primary admits no plan: the per-block engine serves every request."""
    peers = FakePeers()
    primary, backup = ServerNode("s0", peers), ServerNode("s1")
    peers.nodes["s1"] = backup
    msg = shard_map(1, _tables(), [G(["w0"], mode)])
    primary.install_map(msg)
    backup.install_map(msg)
    if general:
        _without_plans(primary)
    return primary, backup


def _frame(request: StepRequest):
    """``request`` (a client's) through the wire: encoded as the client sends it, read and
    bound as a server does."""
    encoded = step.encode(request)
    payload = b"".join(bytes(memoryview(p).cast("B")) for p in encoded.parts())
    got, region, layout = step.read_request(encoded.header())
    assert region is None
    step.bind(got, layout, memoryview(payload))
    return got


def _steps(seed: int, n: int = 10):
    """Step requests of worker w0: pushes of "e", "u" and "w", then pulls of the next ids."""
    rng = np.random.default_rng(seed)
    for seq in range(1, n + 1):
        e_ids = rng.choice(E_ROWS, size=30, replace=False).astype(np.int64)
        u_ids = rng.choice(1 << 40, size=6, replace=False).astype(np.int64) - (1 << 39)
        lo = int(rng.integers(0, 12))
        hi = int(rng.integers(lo + 1, 24))
        push = [Slice("e", ROWS, ids=e_ids, values=rng.standard_normal((30, DIM)).astype(np.float32)),
                Slice("u", ROWS, ids=u_ids, values=rng.standard_normal((6, 3)).astype(np.float32)),
                Slice("w", RANGE, lo, hi, values=rng.standard_normal(hi - lo).astype(np.float32))]
        pull = [Slice("w", RANGE, 0, 24), Slice("e", ROWS, ids=rng.choice(E_ROWS, 25, replace=False)),
                Slice("u", ROWS, ids=np.concatenate([u_ids[:3], np.array([5, -7], np.int64)]))]
        header = Header(JOB, epoch=1, session="w0", incarnation=1, sequence=seq, acked_below=seq)
        yield StepRequest(header, GRADIENT, push, pull, pull_clock=seq)


def _state(node: ServerNode) -> dict:
    """Every block of the job held: (version, digest of values, state and records)."""
    with node.table.lock:
        blocks = dict(node.table.blocks)
    return {key: (blk.version, block_digest(blk)) for key, blk in sorted(blocks.items())}


def _run(node: ServerNode, seed: int) -> list:
    replies = []
    for request in _steps(seed):
        reply = node.step(_frame(request))
        values = [v.reshape(-1).copy() for v in reply.values]
        replies.append(([(v.table, list(v.blocks), list(v.versions)) for v in reply.ack.versions],
                        [(v.table, list(v.blocks), list(v.versions)) for v in reply.pull.versions],
                        [v.view(np.uint32).tolist() for v in values]))
    return replies


def _without_plans(node: ServerNode) -> None:
    node.planner.step = lambda *a: None                     # type: ignore[method-assign]
    node.planner.push = lambda *a: None                     # type: ignore[method-assign]
    node.planner.pull = lambda *a: None                     # type: ignore[method-assign]


def _served(monkeypatch, node: ServerNode) -> list[str]:
    """Record which of a Step's parts one plan of the whole step served (``"push"``,
    ``"pull"``)."""
    served: list[str] = []
    original = execute.step

    def watch(table, plan, *a):
        out = original(table, plan, *a)
        if out is not None and table is node.table:
            served.extend(name for name in ("push", "pull") if getattr(plan, name) is not None)
        return out
    monkeypatch.setattr(execute, "step", watch)
    return served


def test_plans_and_the_per_block_engine_leave_the_same_blocks_and_replies(monkeypatch):
    planned, planned_backup = _nodes(general=False)
    served = _served(monkeypatch, planned)
    general, general_backup = _nodes(general=True)
    replies = _run(planned, seed=1)
    assert served == ["push", "pull"] * 10, served              # a plan took every part
    assert replies == _run(general, seed=1)
    assert _state(planned) == _state(general)
    assert _state(planned_backup) == _state(general_backup)
    assert _state(planned_backup) == _state(planned)            # the backup equals its primary


def test_a_retried_push_is_counted_once_by_the_per_block_engine():
    node, _ = _nodes(general=False)
    first = next(_steps(seed=2))
    node.step(_frame(first))
    before = _state(node)
    again = node.step(_frame(StepRequest(first.header, GRADIENT, first.push, None)))
    assert again.ack.duplicate_blocks > 0 and _state(node) == before


def test_a_nan_is_refused_before_anything_changes():
    node, backup = _nodes(general=False)
    request = next(_steps(seed=3))
    request.push[0].values[3, 1] = np.nan
    before, backup_before = _state(node), _state(backup)
    with pytest.raises(InvalidArgument, match="is nan: NaN/Inf gradients are refused"):
        node.step(_frame(request))
    assert _state(node) == before and _state(backup) == backup_before


def test_a_declined_step_is_checked_as_it_was_bound_and_refused_by_name():
    """What no plan covers goes to the per-block engine as the Step's own slices (no bytes
    re-encoded): its checks are the Push's, with errors naming the segment and table."""
    node, backup = _nodes(general=False, mode=Consistency.SYNC)     # SYNC: the engine's
    before, backup_before = _state(node), _state(backup)
    header = Header(JOB, epoch=1, session="w0", incarnation=1, sequence=1, acked_below=1)
    short = StepRequest(header, GRADIENT, [Slice("w", RANGE, 0, 8, values=np.ones(4, np.float32))], None)
    with pytest.raises(InvalidArgument, match=r"segment 0 \('w'\) carries 4 values; it needs 8"):
        node.step(_frame(short))
    header.wire_dtype = 2                                              # FLOAT16 values
    halves = StepRequest(header, GRADIENT, [Slice("w", RANGE, 0, 8, values=np.ones(8, np.float32))], None)
    with pytest.raises(InvalidArgument, match="Step frames carry FLOAT32 values"):
        node.step(_frame(halves))
    assert _state(node) == before and _state(backup) == backup_before


def test_a_block_moved_away_is_refused_and_the_others_are_served(monkeypatch):
    node, _ = _nodes(general=False)
    node.install_map(shard_map(2, _tables(moved=True), [G(["w0"])]))
    served = _served(monkeypatch, node)
    ids = np.arange(E_ROWS, dtype=np.int64)
    blocks = sparse_block_of(ids, 8)
    header = Header(JOB, epoch=2, session="w0", incarnation=1, sequence=1, acked_below=1)
    with pytest.raises(StaleEpoch, match="block 0 of table 'e' is served by s1"):
        node.step(_frame(StepRequest(header, 0, None, [Slice("e", ROWS, ids=ids[blocks == 0][:3])])))
    got = node.step(_frame(StepRequest(header, 0, None, [Slice("e", ROWS, ids=ids[blocks == 5][:3])])))
    assert served == ["pull"] and got.pull.versions[0].blocks == [5]


def test_sync_jobs_wait_for_their_group_outside_the_steps_plans(monkeypatch):
    node, _ = _nodes(general=False, mode=Consistency.SYNC)
    served = _served(monkeypatch, node)
    request = next(_steps(seed=4))
    got = node.step(_frame(StepRequest(request.header, GRADIENT, request.push, None)))
    assert served == [] and got.ack.versions            # applied as the step of its one member


# ---------------------------------------------------------------------- the frame
def test_a_step_frame_reads_back_what_the_client_wrote():
    request = next(_steps(seed=5))
    request.push[2].base_versions = {0: 3, 1: 7}
    got = _frame(request)
    assert (got.header, got.kind, got.pull_clock) == (request.header, request.kind, request.pull_clock)
    for mine, theirs in zip(request.push + request.pull, got.push + got.pull):
        assert (mine.table, mine.selector, mine.base_versions) == (theirs.table, theirs.selector,
                                                                    theirs.base_versions)
        if mine.ids is not None:
            assert np.array_equal(mine.ids, theirs.ids)
        else:
            assert (mine.start, mine.stop) == (theirs.start, theirs.stop)
        if mine.values is not None:
            assert np.array_equal(mine.values.reshape(-1), theirs.values)


def test_the_shared_memory_payload_is_the_frames_payload():
    """``Encoded.write`` (into a shared-memory region) lays out the very bytes ``parts``
    sends in a frame, and nothing past them."""
    for request in _steps(seed=9, n=3):
        request.push[0].positions = np.array([3, 1])         # rows picked, as a routed part's
        request.pull[1].positions = np.array([4, 0, 2])
        encoded = step.encode(request)
        sent = b"".join(bytes(memoryview(p).cast("B")) for p in encoded.parts())
        region = np.full(encoded.payload_bytes + 16, 0xAB, np.uint8)
        encoded.write(region)
        assert len(sent) == encoded.payload_bytes
        assert region[:encoded.payload_bytes].tobytes() == sent
        assert (region[encoded.payload_bytes:] == 0xAB).all()


def test_rows_picked_by_positions_travel_without_the_others():
    ids = np.arange(10, 20, dtype=np.int64)
    rows = np.arange(30, dtype=np.float32).reshape(10, 3)
    positions = np.array([7, 2, 5])
    header = Header(JOB, epoch=1, session="w0", incarnation=1, sequence=1)
    got = _frame(StepRequest(header, GRADIENT, [Slice("u", ROWS, ids=ids, values=rows, positions=positions)], None))
    assert got.push[0].ids.tolist() == [17, 12, 15]
    assert np.array_equal(got.push[0].values.reshape(3, 3), rows[positions])


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[:40], "at least"),
    (lambda b: bytes([2]) + b[1:], "version 2"),
    (lambda b: b[:1] + bytes([b[1] | 0x40]) + b[2:], "unknown flags"),
    (lambda b: b + b"\0" * 8, "follow its end"),
    (lambda b: b[:96] + (99).to_bytes(8, "little") + b[104:], "is not a table's"),
    (lambda b: b[:104] + (7).to_bytes(8, "little") + b[112:], "selector 7"),
])
def test_a_malformed_step_header_is_refused_naming_what(damage, message):
    header = Header(JOB, epoch=1, session="w0", incarnation=1, sequence=1)
    encoded = step.encode(StepRequest(header, GRADIENT, [Slice("w", RANGE, 0, 4, values=np.ones(4, np.float32))],
                                      None))
    with pytest.raises(InvalidArgument, match=message):
        step.read_request(damage(encoded.header()))


@pytest.mark.parametrize("field, value, message", [
    (2, 1 << 61, "ids at byte 0 do not fit"),          # rows whose bytes would overflow int64
    (4, (1 << 63) - 8, "do not fit"),                   # ids far past the payload
    (7, 1 << 60, "base versions"),                      # base versions past the header
])
def test_hostile_counts_and_offsets_are_refused_not_wrapped(field, value, message):
    """A segment's counts and offsets are compared with the buffer without multiplying
    them: a count whose bytes overflow int64 is refused, not wrapped into a small one."""
    header = Header(JOB, epoch=1, session="w0", incarnation=1, sequence=1)
    encoded = step.encode(StepRequest(header, GRADIENT, [Slice("e", ROWS, ids=np.arange(2, dtype=np.int64),
                                                               values=np.ones((2, 4), np.float32))], None))
    raw = bytearray(encoded.header())
    raw[96 + 8 * field:104 + 8 * field] = value.to_bytes(8, "little")
    with pytest.raises(InvalidArgument, match=message):
        got, _, fields = step.read_request(bytes(raw))
        step.bind(got, fields, memoryview(bytes(encoded.payload_bytes)))


def test_a_payload_too_short_for_its_segments_is_refused():
    header = Header(JOB, epoch=1, session="w0", incarnation=1, sequence=1)
    request = StepRequest(header, 0, None, [Slice("e", ROWS, ids=np.arange(8, dtype=np.int64))])
    encoded = step.encode(request)
    got, _, layout = step.read_request(encoded.header())
    with pytest.raises(InvalidArgument, match="do not fit"):
        step.bind(got, layout, memoryview(bytes(40)))


def test_a_dense_table_in_several_runs_of_blocks_is_served_in_one_step(monkeypatch):
    """A dense table whose blocks alternate between servers reaches a server as several
    ranges of one table (``routing.route_ranges``): one plan serves them together, in key
    order; two ranges that share a block go to the per-block engine, which adds them."""
    v = T(dense_table("v", (24,), block_size=8), [["s0"], ["s1"], ["s0"]], TableConfig(optimizer=sgd(1.0)))
    node, general = ServerNode("s0"), ServerNode("s0")
    for n in (node, general):
        n.install_map(shard_map(1, [v], [G(["w0"])]))
    _without_plans(general)
    served = _served(monkeypatch, node)
    header = Header(JOB, epoch=1, session="w0", incarnation=1, sequence=1, acked_below=1)
    ranges = [Slice("v", RANGE, 16, 24, values=np.full(8, 2.0, np.float32)),
              Slice("v", RANGE, 0, 8, values=np.full(8, 1.0, np.float32))]
    for n in (node, general):
        n.step(_frame(StepRequest(header, GRADIENT, ranges, None)))
    assert served == ["push"] and _state(node) == _state(general)
    overlapping = [Slice("v", RANGE, 0, 4, values=np.ones(4, np.float32)),
                   Slice("v", RANGE, 2, 8, values=np.ones(6, np.float32))]
    header = Header(JOB, epoch=1, session="w0", incarnation=1, sequence=2, acked_below=2)
    for n in (node, general):
        n.step(_frame(StepRequest(header, GRADIENT, overlapping, None)))
    assert served == ["push"] and _state(node) == _state(general)
