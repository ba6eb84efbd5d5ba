"""Pushes of kind ASSIGN on the node's layers (fakes, as tests/test_node_layers.py): a sparse
segment naming an id twice is refused, as the fuzzers' reference model says; a dense block
written whole starts afresh, on its backups too. And the data plane's protobuf form refuses
a pull whose reply would go to shared memory, as its push refuses a payload there."""

from __future__ import annotations

import numpy as np
import pytest

from shardps.errors import InvalidArgument
from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.server import optimizers
from shardps.server.node.digest import block_digest
from shardps.tables import TableConfig, adagrad, assigned, dense_table, sparse_table
from tests.test_node_layers import JOB, FakePeers, G, Layers, T, dense_seg, header, rows_seg, shard_map

DIM = 2


def _node(replicas=("s0",)):
    peers = FakePeers()
    primary, backup = Layers("s0", peers), Layers("s1")
    peers.nodes["s1"] = backup
    config = TableConfig(optimizer=adagrad(0.1))
    sparse = T(sparse_table("e", DIM, num_rows=100, num_blocks=2), [list(replicas)] * 2, config)
    waiting = T(dense_table("a", (16,), init=assigned(), block_size=8), [list(replicas)] * 2, config)
    msg = shard_map(1, [sparse, waiting], [G(["w0"])])
    primary.install(msg)
    backup.install(msg)
    return primary, backup


def test_an_assign_repeating_an_id_is_refused_naming_the_table_and_the_id():
    node, _ = _node()
    good_seg, good_payload = rows_seg([1, 2], np.ones((2, DIM), np.float32))
    bad_seg, bad_payload = rows_seg([5, 9, 5], np.ones((3, DIM), np.float32))
    with pytest.raises(InvalidArgument, match=r"'e'.* repeats id 5"):
        node.push(header(session="w0", sequence=1), good_seg + bad_seg, good_payload + bad_payload,
                  kind=ps.ASSIGN)
    for key, blk in node.table.blocks.items():                 # nothing changed
        assert blk.version == 0 and not blk.writers, key
    assert all(blk.count == 0 for key, blk in node.table.blocks.items() if key[1] == "e")
    # the same ids, each once, are written (not summed)
    seg, payload = rows_seg([9, 5], np.array([[1, 2], [3, 4]], np.float32))
    node.push(header(session="w0", sequence=2), seg, payload, kind=ps.ASSIGN)
    _, (values,) = node.pull(header(), *rows_seg([5, 9]))
    np.testing.assert_array_equal(values, [[3, 4], [1, 2]])


def test_the_reference_model_judges_a_repeated_id_of_an_assign_invalid():
    from tests.fuzz.reference import DATA_JOB, Reference, RefTable
    from tests.fuzz.wire import INVALID
    table = RefTable("e", dense=False, dim=DIM, num_rows=100, num_blocks=1, blocks=1)
    ref = Reference({"e": table}, ("w0", 1), {"max_segments": 8, "max_rows": 100})
    ref.placement = {"e": (["s0"], [1])}
    ref.map_epoch = 1

    def judge(ids, kind):
        ids = np.asarray(ids, "<i8")
        h = ps.PushHeader(header=pb.RequestHeader(job=DATA_JOB, epoch=1, session="w0", incarnation=1,
                                                  sequence=1, wire_dtype=pb.FLOAT32), kind=kind)
        h.segments.add(table="e", rows=pb.RowSelection(count=ids.shape[0]))
        return ref.judge_push("s0", h, ids.tobytes() + np.ones((ids.shape[0], DIM), "<f4").tobytes())
    assert INVALID in judge([3, 4, 3], ps.ASSIGN).codes
    assert judge([3, 4], ps.ASSIGN).ok
    assert judge([3, 4, 3], ps.GRADIENT).ok                   # gradients of a repeated id are summed


def test_a_partial_assign_of_a_block_without_initial_values_is_refused_before_anything_changes():
    node, _ = _node()
    e_seg, e_payload = rows_seg([1, 2], np.ones((2, DIM), np.float32))
    a_seg, a_payload = dense_seg(0, 4, np.ones(4), table="a")
    with pytest.raises(InvalidArgument, match="must cover the whole block"):
        node.push(header(session="w0", sequence=1), e_seg + a_seg, e_payload + a_payload, kind=ps.ASSIGN)
    assert all(blk.version == 0 for blk in node.table.blocks.values())
    blk = node.table.blocks[(JOB, "a", 0)]
    assert blk.values is None and not blk.initialized


def test_a_whole_block_assign_starts_afresh_on_the_primary_and_its_backup():
    primary, backup = _node(("s0", "s1"))
    config = primary.table.view.tables[(JOB, "a")].config
    seg, payload = dense_seg(0, 16, np.arange(16), table="a")
    primary.push(header(session="w0", sequence=1), seg, payload, kind=ps.ASSIGN)      # initializes
    primary.push(header(session="w0", sequence=2), seg, np.ones(16, "<f4").tobytes())  # a gradient
    primary.push(header(session="w0", sequence=3), *dense_seg(8, 16, np.full(8, 7.0), table="a"),
                 kind=ps.ASSIGN)                                                         # block 1, whole
    fresh = optimizers.new_state(config.optimizer, 8)
    for node in (primary, backup):
        b0, b1 = node.table.blocks[(JOB, "a", 0)], node.table.blocks[(JOB, "a", 1)]
        assert b1.step == 0 and b1.version == 3 and b1.initialized
        np.testing.assert_array_equal(b1.values, np.full(8, 7.0))
        assert b1.state.keys() == fresh.keys()
        for name, arr in b1.state.items():
            np.testing.assert_array_equal(arr, fresh[name])
        assert b0.step == 1 and not np.array_equal(b0.values, np.arange(8))   # untouched by the third
    for key, blk in primary.table.blocks.items():
        assert block_digest(blk) == block_digest(backup.table.blocks[key]), key


def test_the_data_planes_protobuf_pull_refuses_a_reply_in_shared_memory(make_cluster, client_factory):
    from shardps import messages as m
    from shardps.rpc import messages
    from shardps.rpc.dataplane import DataPlaneConnection
    cluster = make_cluster(1)
    client = client_factory(cluster.address, job="shm")
    client.create_job()
    client.create_sparse("e", 4)
    epoch = client.refresh_map().epoch
    server = next(iter(cluster.servers.values()))
    ids = np.array([3, 7], np.int64)
    pull = messages.pull_message(m.PullRequest(m.Header("shm", epoch), [m.Selection("e", m.ROWS, count=2)]))
    with DataPlaneConnection(server.data_plane.address) as conn:
        raw, view = conn.call("Pull", pull.SerializeToString(), [ids], timeout=10)
        assert ps.PullHeader.FromString(raw).payload_bytes == 2 * 4 * 4
        pull.reply_shared_memory.name, pull.reply_shared_memory.length = "shardps-x", 64
        with pytest.raises(InvalidArgument, match="not in shared memory"):
            conn.call("Pull", pull.SerializeToString(), [ids], timeout=10)
        exchange = ps.ExchangeHeader(push=ps.PushHeader(header=pull.header, kind=ps.GRADIENT), pull=pull)
        with pytest.raises(InvalidArgument, match="not in shared memory"):
            conn.call("Exchange", exchange.SerializeToString(), [ids], timeout=10)
