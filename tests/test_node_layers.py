"""Unit tests of the server node's layers (server/node/) on fakes: no gRPC, no threads, no
sleeps. Peers are a fake that records calls, fails on demand and may deliver to another
node's layers in memory; time is a fake clock."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import pytest

from shardps.errors import InvalidArgument, NotFound, ResourceExhausted, StaleEpoch, Unavailable
from shardps.messages import PullRequest, PushRequest
from shardps.metrics import NodeMetrics
from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.rpc import messages, replication
from shardps.rpc.chunks import decode_snapshots
from shardps.rpc.codec import decode_chunk
from shardps.rpc.convert import config_to_proto, consistency_to_proto, spec_to_proto
from shardps.rpc.stubs import encode_snapshots
from shardps.server.node import NodeLimits, ServerNode, snapshot_block
from shardps.server.node.apply import JobHolds, PushApplier
from shardps.server.node.backup import BackupApplier
from shardps.server.node.decode import check_header, parse_segments, split
from shardps.server.node.plan import Planner
from shardps.server.node.pull import PullReader
from shardps.server.node.replication import Forwarder
from shardps.server.node.steps import SyncSteps
from shardps.server.node.table import BlockTable
from shardps.shardmap import ShardMapView
from shardps.tables import Consistency, TableConfig, TableSpec, dense_table, sgd, sparse_table

JOB = "j"


# ---------------------------------------------------------------------- fakes
class FakeClock:
    """Time stands still until a test moves it."""

    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass
class FakePeers:
    """Records every call (``abandon`` too). ``fail``: nodes whose calls raise Unavailable.
    ``out_of_sync``: node -> keys its replicate reports stale. ``nodes``: name -> Layers."""

    fail: set = field(default_factory=set)
    fail_kinds: set = field(default_factory=set)      # op kinds whose replicate raises Unavailable
    out_of_sync: dict = field(default_factory=dict)
    nodes: dict = field(default_factory=dict)
    calls: list = field(default_factory=list)
    source: str = "s0"

    def replicate(self, node, epoch, ops, arrays):
        """Delivered when sent (as a backup applies while its primary does); the answer
        returns what the backup said."""
        self.calls.append(("replicate", node, epoch, list(ops)))
        if node in self.fail or any(op.kind in self.fail_kinds for op in ops):
            raise Unavailable(f"{node} is down")
        if node in self.nodes:
            payload = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
            # the ops as a backup reads them: encoded and decoded as the wire carries them
            epoch, source, ops = replication.replicate_request(
                ps.ReplicateHeader.FromString(replication.replicate_header(epoch, self.source, ops, len(payload))))
            stale = self.nodes[node].backup.apply_replicated(epoch, source, ops, payload)[1]
        else:
            stale = list(self.out_of_sync.get(node, []))
        return lambda: stale

    def load_blocks(self, node, epoch, snapshots, resync=False):
        self.calls.append(("load_blocks", node, epoch, list(snapshots)))
        if node in self.fail:
            raise Unavailable(f"{node} is down")
        if node in self.nodes:      # the blocks as a node reads them: through the chunk stream
            epoch, snapshots = decode_snapshots(map(decode_chunk, encode_snapshots(snapshots, epoch)))
            self.nodes[node].backup.load_blocks(epoch, self.source, snapshots)

    def abandon(self, node):
        return self.calls.append(("abandon", node)) or 0

    def sent(self, what: str) -> list:
        return [c for c in self.calls if c[0] == what]


class Layers:
    """One node's layers, wired as ServerNode wires them, on a fake clock and fake peers."""

    def __init__(self, name: str = "s0", peers: FakePeers | None = None,
                 limits: NodeLimits = NodeLimits()):
        self.clock = FakeClock()
        self.peers = peers or FakePeers(source=name)
        self.metrics = NodeMetrics()
        self.limits = limits
        self.table = BlockTable(name)
        self.forwarder = Forwarder(self.table, self.metrics, self.peers, self.clock)
        self.steps = SyncSteps(self.table, self.forwarder, self.clock)
        self.backup = BackupApplier(self.table, self.steps)
        self.holds = JobHolds(self.table.gate, self.clock)
        self.planner = Planner(self.table, self.holds, limits.max_rows, limits.max_response_bytes)
        self.pusher = PushApplier(self.table, self.planner, self.steps, self.forwarder, self.holds, limits,
                                  self.metrics, self.clock)
        self.reader = PullReader(self.table, self.planner, self.steps, limits, self.metrics, self.clock)

    def install(self, msg: pb.ShardMap) -> None:
        """As ``ServerNode.install`` does it."""
        with self.table.gate.exclusive():
            self.table.install(ShardMapView(msg), self.steps.set_groups_locked)
        self.steps.apply_all_ready()

    def push(self, hdr, segments, payload, kind=ps.GRADIENT, deadline=None):
        return self.pusher.push(push_request(hdr, kind, segments, payload), deadline)

    def pull(self, hdr, segments, ids=b"", deadline=None):
        return self.reader.pull(pull_request(hdr, segments, ids), deadline)


def push_request(hdr: pb.RequestHeader, kind, segments, payload) -> PushRequest:
    """The plain request the node's door makes of these messages (shardps.rpc.messages)."""
    return messages.push_request(ps.PushHeader(header=hdr, kind=kind, segments=segments), payload)


def pull_request(hdr: pb.RequestHeader, segments, ids=b"") -> PullRequest:
    return messages.pull_request(ps.PullRequest(header=hdr, segments=segments), ids)


def plain(hdr: pb.RequestHeader):
    return messages.header(hdr)


def sels(segments) -> list:
    return [messages.selection(s) for s in segments]


# ---------------------------------------------------------------------- shard maps
@dataclass
class T:
    spec: TableSpec
    replicas: list                    # per block: server names, primary first
    config: TableConfig = TableConfig(optimizer=sgd(1.0))
    since: int = 1
    fresh: int = 1


@dataclass
class G:
    sessions: list
    mode: Consistency = Consistency.ASYNC
    quota: int = 0


def shard_map(epoch: int, tables: list[T], groups: list[G] = (), servers=("s0", "s1", "s2"),
              dead=()) -> pb.ShardMap:
    """A ShardMap message as the manager publishes one (cf. manager_state.shard_map())."""
    msg = pb.ShardMap(epoch=epoch, replication=2)
    index = {n: i for i, n in enumerate(servers)}
    for n in servers:
        msg.servers.add(name=n, address=f"{n}:7071", incarnation=1,
                        state=pb.DEAD if n in dead else pb.SERVING)
    for t in tables:
        tp = msg.tables.add(job=JOB, spec=spec_to_proto(t.spec), config=config_to_proto(t.config))
        for reps in t.replicas:
            tp.blocks.add(replicas=[index[r] for r in reps], since_epoch=t.since, fresh_epoch=t.fresh)
    for g in groups:
        gp = msg.groups.add(job=JOB, consistency=consistency_to_proto(g.mode), quota_bytes=g.quota)
        for rank, s in enumerate(g.sessions):
            gp.members.add(rank=rank, session=s, incarnation=1, name=f"w{rank}")
    return msg


def dense_w(replicas=(("s0", "s1"),), **kw) -> T:
    """Dense table "w": 8 elements per block, one block per entry of ``replicas``."""
    return T(dense_table("w", (8 * len(replicas),), block_size=8), [list(r) for r in replicas], **kw)


# ---------------------------------------------------------------------- requests
def header(epoch=1, session="", sequence=0, clock=0) -> pb.RequestHeader:
    return pb.RequestHeader(job=JOB, epoch=epoch, session=session,
                            incarnation=1 if session else 0, sequence=sequence, clock=clock)


_sequence = itertools.count(1)


def push_header(epoch=1, clock=0) -> pb.RequestHeader:
    """A push's header from a client outside the group (every GRADIENT push has a session)."""
    return header(epoch, session="client", sequence=next(_sequence), clock=clock)


def dense_seg(lo, hi, values=None, table="w"):
    seg = pb.Segment(table=table, range=pb.Range(start=lo, stop=hi))
    payload = b"" if values is None else np.asarray(values, dtype="<f4").tobytes()
    return [seg], payload


def rows_seg(ids, values=None, table="e"):
    ids = np.asarray(ids, dtype="<i8")
    seg = pb.Segment(table=table, rows=pb.RowSelection(count=ids.shape[0]))
    payload = ids.tobytes() + (b"" if values is None else np.asarray(values, dtype="<f4").tobytes())
    return [seg], payload


# ====================================================================== decode
@pytest.fixture
def view():
    msg = shard_map(1, [dense_w(), T(sparse_table("e", 2, num_rows=100, num_blocks=2),
                                     [["s0"], ["s0"]])])
    return ShardMapView(msg)


@pytest.mark.parametrize("segments, payload, error, names", [
    ([pb.Segment(table="w", rows=pb.RowSelection(count=1))], b"", InvalidArgument,
     "must select a range, got rows"),
    (*dense_seg(0, 8, np.ones(4)), InvalidArgument, "needs 32 bytes"),
    (*dense_seg(0, 8, np.ones(12)), InvalidArgument, "payload has 48 bytes"),
    (*dense_seg(0, 8, [0, 0, 0, np.nan, 0, 0, 0, 0]), InvalidArgument, "element 3 "),
    (*dense_seg(4, 99, np.ones(95)), InvalidArgument, "99"),
    (*rows_seg([1, 100], np.ones((2, 2))), InvalidArgument, "100"),
    (*dense_seg(0, 8, np.ones(8), table="nope"), NotFound, "'nope'"),
])
def test_decode_rejects_bad_segments_naming_the_value(view, segments, payload, error, names):
    with pytest.raises(error, match=names.replace("[", r"\[")):
        parse_segments(view, "s0", NodeLimits(), plain(header()), sels(segments), payload, with_values=True)


def test_decode_checks_header_and_limits(view):
    with pytest.raises(InvalidArgument, match="header.clock=-1"):
        check_header(plain(header(clock=-1)))
    segments, payload = dense_seg(0, 8, np.ones(8))
    with pytest.raises(ResourceExhausted, match="max_segments is 0"):
        parse_segments(view, "s0", NodeLimits(max_segments=0), plain(header()), sels(segments), payload, True)
    segments, payload = rows_seg([1, 2, 3], np.ones((3, 2)))
    with pytest.raises(ResourceExhausted, match="max_rows"):
        parse_segments(view, "s0", NodeLimits(max_rows=2), plain(header()), sels(segments), payload, True)


def test_split_refuses_blocks_this_node_does_not_serve(view):
    segments, payload = dense_seg(0, 8, np.ones(8))
    parsed = parse_segments(view, "s1", NodeLimits(), plain(header()), sels(segments), payload, True)
    with pytest.raises(StaleEpoch, match="served by s0, not s1"):
        split("s1", 1, plain(header()), parsed, True, lambda key: True)
    parsed = parse_segments(view, "s0", NodeLimits(), plain(header()), sels(segments), payload, True)
    with pytest.raises(Unavailable, match="not been loaded"):
        split("s0", 1, plain(header()), parsed, True, lambda key: False)
    parts = split("s0", 1, plain(header()), parsed, True, lambda key: True)
    assert [(p.key, p.lo, p.hi) for p in parts] == [((JOB, "w", 0), 0, 8)]


# ====================================================================== table
def test_install_drops_copy_destinations_once_listed_or_dead():
    table = BlockTable("s0")
    three = dense_w(replicas=[["s0"], ["s0"], ["s0"]])
    with table.gate.exclusive():
        table.install(ShardMapView(shard_map(1, [three])))
    table.add_destination((JOB, "w", 0), "s1")       # being copied to s1
    table.add_destination((JOB, "w", 1), "s2")       # being copied to s2
    table.add_destination((JOB, "w", 2), "s1")       # being copied to s1, not listed yet
    table.needs_resync[(JOB, "w", 1)] = {"s2"}
    assert table.backups((JOB, "w", 0)) == ["s1"]
    # epoch 2: s1 is listed for block 0 (its copy is done), s2 is dead
    moved = dense_w(replicas=[["s0", "s1"], ["s0"], ["s0"]])
    with table.gate.exclusive():
        table.install(ShardMapView(shard_map(2, [moved], dead=("s2",))))
    assert table.extra == {(JOB, "w", 2): {"s1"}}
    assert table.needs_resync == {}
    assert table.backups((JOB, "w", 0)) == ["s1"]     # as a listed backup now
    assert table.backups((JOB, "w", 1)) == []


def test_install_marks_moved_blocks_missing_until_loaded():
    table = BlockTable("s1")
    moved = dense_w(replicas=[["s0", "s1"]], since=2, fresh=1)   # s1 must receive the state
    with table.gate.exclusive():
        table.install(ShardMapView(shard_map(2, [moved])))
    key = (JOB, "w", 0)
    assert key in table.missing and not table.loaded(key)
    table.receive(key, table.view.tables[(JOB, "w")], "s0")
    assert table.loaded(key)


# ====================================================================== apply
def test_exactly_once_the_same_writer_twice_applies_once():
    node = Layers()
    node.install(shard_map(1, [dense_w(replicas=[["s0"]])], [G(["w0"])]))
    segments, payload = dense_seg(0, 8, np.ones(8))
    first = node.push(header(session="w0", sequence=1), segments, payload)
    again = node.push(header(session="w0", sequence=1), segments, payload)
    blk = node.table.blocks[(JOB, "w", 0)]
    np.testing.assert_array_equal(blk.values, -np.ones(8))
    assert (first.duplicate_blocks, again.duplicate_blocks) == (0, 1)
    assert blk.version == 1 and list(again.versions[0].versions) == [1]
    node.push(header(session="w0", sequence=2), segments, payload)
    np.testing.assert_array_equal(blk.values, -2 * np.ones(8))


def test_quota_exceeded_is_resource_exhausted_and_nothing_is_stored():
    node = Layers()
    sparse = T(sparse_table("e", 2, num_rows=100, num_blocks=1), [["s0"]])
    node.install(shard_map(1, [dense_w(replicas=[["s0"]]), sparse], [G(["w0"], quota=16)]))
    segments, payload = dense_seg(0, 8, np.ones(8))           # would materialise 32 bytes
    with pytest.raises(ResourceExhausted, match="quota_bytes=16"):
        node.push(header(session="w0", sequence=1), segments, payload)
    blk = node.table.blocks[(JOB, "w", 0)]
    assert blk.values is None and blk.version == 0 and not blk.writers
    segments, payload = rows_seg([1, 2, 3], np.ones((3, 2)))  # 3 new rows of 20 bytes
    with pytest.raises(ResourceExhausted, match="this push would add 60"):
        node.push(header(session="w0", sequence=2), segments, payload)
    sblk = node.table.blocks[(JOB, "e", 0)]
    assert sblk.count == 0 and sblk.version == 0
    assert node.peers.calls == []


def test_a_held_job_refuses_pushes_past_their_deadline():
    node = Layers()
    node.install(shard_map(1, [dense_w(replicas=[["s0"]])]))
    node.holds.hold(JOB, True, seconds=5)
    segments, payload = dense_seg(0, 8, np.ones(8))
    with pytest.raises(Unavailable, match="held for a checkpoint"):
        node.push(push_header(), segments, payload, deadline=node.clock.now)
    node.clock.now += 6                                           # the hold expired
    node.push(push_header(), segments, payload, deadline=node.clock.now)
    assert node.table.blocks[(JOB, "w", 0)].version == 1


# ====================================================================== replication
def test_a_backup_that_reports_out_of_sync_gets_the_whole_block():
    key = (JOB, "w", 0)
    node = Layers(peers=FakePeers(out_of_sync={"s1": [key]}))
    node.install(shard_map(1, [dense_w()]))
    segments, payload = dense_seg(0, 8, np.arange(8))
    node.push(push_header(), segments, payload)
    assert [c[1] for c in node.peers.sent("replicate")] == ["s1"]
    (_, dest, epoch, snaps), = node.peers.sent("load_blocks")
    assert (dest, epoch) == ("s1", 1)
    assert snaps[0].header.version == 1 and snaps[0].header.ref.block == 0
    np.testing.assert_array_equal(snaps[0].arrays[0], -np.arange(8, dtype=np.float32))
    assert not node.table.needs_resync


def test_a_diverged_backup_ends_identical_to_its_primary():
    peers = FakePeers()
    primary, backup = Layers("s0", peers), Layers("s1")
    peers.nodes["s1"] = backup
    msg = shard_map(1, [dense_w()], [G(["w0"])])
    primary.install(msg)
    backup.install(msg)
    backup.table.blocks[(JOB, "w", 0)].version = 7          # diverged: versions do not follow on
    segments, payload = dense_seg(0, 8, np.arange(8))
    primary.push(header(session="w0", sequence=1), segments, payload)
    assert len(peers.sent("load_blocks")) == 1              # the op was stale: sent whole
    primary.push(header(session="w0", sequence=2), segments, payload)
    assert len(peers.sent("load_blocks")) == 1              # in sync again: ops suffice
    a, b = (snapshot_block(n.table.blocks[(JOB, "w", 0)]) for n in (primary, backup))
    assert a.header == b.header
    for x, y in zip(a.arrays, b.arrays):
        np.testing.assert_array_equal(x, y)


def test_a_failing_backup_is_marked_and_the_primary_keeps_the_op():
    key = (JOB, "w", 0)
    node = Layers(peers=FakePeers(fail={"s1"}))
    node.install(shard_map(1, [dense_w()], [G(["w0"])]))
    segments, payload = dense_seg(0, 8, np.ones(8))
    with pytest.raises(Unavailable, match="s1 is down"):
        node.push(header(session="w0", sequence=1), segments, payload)
    blk = node.table.blocks[key]
    assert node.table.needs_resync == {key: {"s1"}}
    assert blk.version == 1
    np.testing.assert_array_equal(blk.values, -np.ones(8))
    # the backup is back: the retry resyncs it whole and is not applied twice
    node.peers.fail.clear()
    ack = node.push(header(session="w0", sequence=1), segments, payload)
    assert ack.duplicate_blocks == 1 and blk.version == 1
    assert not node.table.needs_resync
    (_, dest, _, snaps), = node.peers.sent("load_blocks")
    assert dest == "s1" and snaps[0].header.version == 1


# ====================================================================== facade
def test_the_facade_exposes_its_layers_state():
    peers = FakePeers()
    node = ServerNode("s0", peers=peers, clock=FakeClock())
    assert node.install_map(shard_map(1, [dense_w()], [G(["w0"])])) == 1
    assert node.epoch == 1 and node.view is node.table.view
    assert node.blocks is node.table.blocks and node.extra is node.table.extra
    assert node.clocks is node.steps.clocks and node._is_primary((JOB, "w", 0))
    other = FakePeers()
    node.peers = other                    # the server process sets its transport later
    assert node.forwarder.peers is other
    segments, payload = dense_seg(0, 8, np.ones(8))
    node.push(push_request(header(session="w0", sequence=1), ps.GRADIENT, segments, payload))
    assert other.sent("replicate") and not peers.calls
    assert node.usage()["primary_blocks"] == 1
    assert node.drop_tables(JOB) == 1 and not node.blocks


def test_block_locks_hold_every_lock_and_release_the_taken_ones_when_one_fails():
    import threading
    from types import SimpleNamespace

    from shardps.server.node.blocks import BlockLocks

    class Refusing:
        def acquire(self):
            raise KeyboardInterrupt

    ok = [SimpleNamespace(lock=threading.Lock()) for _ in range(3)]
    with BlockLocks(ok):
        assert all(b.lock.locked() for b in ok)
    assert not any(b.lock.locked() for b in ok)
    with pytest.raises(KeyboardInterrupt):
        with BlockLocks(ok[:2] + [SimpleNamespace(lock=Refusing())]):
            pass
    assert not any(b.lock.locked() for b in ok)
