"""A request routed with an old shard map is refused (FAILED_PRECONDITION) and the client's
refresh-and-retry succeeds; blocks move while the table stays consistent."""

import time

import grpc
import numpy as np

from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.rpc import channels
from shardps.rpc.codec import encode_chunk
from shardps.rpc.stubs import ParameterServerStub
from shardps.tables import sgd
from tests.sessions import ClientSession


def wait_rebalanced(cluster, name, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rt = cluster.manager.runtime
        with rt.lock:
            held = sum(1 for t in rt.state.tables.values() for b in t.blocks if name in b.replicas)
            pending = rt.state.plan_moves()
        if held and not pending:
            return held
        time.sleep(0.05)
    raise TimeoutError("no rebalance")


def test_stale_epoch_refused_then_retry_succeeds(make_cluster, client_factory):
    cluster = make_cluster(2)
    c = client_factory(cluster.address)
    c.create_job()
    c.create_dense("w", (64 * 100,), optimizer=sgd(1.0), block_size=64)
    old_epoch = c.shard_map.epoch
    old_map = c.shard_map
    cluster.add_server("s2")
    moved = wait_rebalanced(cluster, "s2")
    assert moved >= 20, f"only {moved} of 100 blocks moved to the new server"
    # the client still routes with its old map: some servers refuse, it refreshes and retries
    assert c.shard_map.epoch == old_epoch
    c.push_dense("w", np.ones(6400, np.float32))
    assert c.shard_map.epoch > old_epoch
    retries = c.metrics.registry.get_sample_value("shardps_client_retries_total", {"reason": "StaleEpoch"})
    assert retries >= 1, "the client never saw a stale-epoch refusal"
    np.testing.assert_allclose(c.pull_dense("w"), -np.ones(6400))

    # the raw refusal: the block's new owner refuses a request made under the old epoch
    t_new = c.shard_map.table("test", "w")
    b = next(i for i, r in enumerate(t_new.replicas) if r[0] == "s2")
    header = ps.PushHeader(header=ClientSession(cluster.address, "test").header(old_epoch),
                           segments=[pb.Segment(table="w", range=pb.Range(start=b * 64, stop=b * 64 + 64))],
                           payload_bytes=256)
    with channels.channel(cluster.servers["s2"].address) as ch:
        try:
            ParameterServerStub(ch).Push(iter([encode_chunk(header.SerializeToString(),
                                                            np.ones(64, np.float32).tobytes())]), timeout=5)
            raise AssertionError("stale request accepted")
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "moved at epoch" in err.details() and "refresh" in err.details()
    # and the old owner of that block refuses it too
    old_owner = old_map.table("test", "w").replicas[b][0]
    with channels.channel(cluster.servers[old_owner].address) as ch:
        try:
            ParameterServerStub(ch).Push(iter([encode_chunk(header.SerializeToString(),
                                                            np.ones(64, np.float32).tobytes())]), timeout=5)
            raise AssertionError("stale request accepted by the old owner")
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    np.testing.assert_allclose(c.pull_dense("w"), -np.ones(6400))
