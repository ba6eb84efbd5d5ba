"""Authentication, authorisation, quotas and stalled streams, on real gRPC servers."""

import logging
import threading
import time

import grpc
import numpy as np
import pytest

from shardps.errors import PermissionDenied, ResourceExhausted, Unauthenticated
from shardps.server.auth import MANAGER_ADMIN, SERVER_ADMIN, Authenticator
from shardps.tables import sgd

ADMIN = "admin-secret-0123456789"
KEY = b"token-key-for-tests"


@pytest.fixture
def secure(make_cluster):
    admin_md = (("authorization", f"Bearer {ADMIN}"),)
    return make_cluster(
        2, serving_kw={"admin_token": ADMIN, "token_key": KEY.decode()},
        manager_kw={"authenticate": Authenticator(ADMIN, KEY, MANAGER_ADMIN), "metadata": admin_md},
        server_kw={"authenticate": Authenticator(ADMIN, KEY, SERVER_ADMIN), "metadata": admin_md})


def test_jobs_are_isolated_by_their_tokens(secure, client_factory, caplog):
    caplog.set_level(logging.DEBUG)
    admin_a = client_factory(secure.address, job="team-a", token=ADMIN)
    admin_b = client_factory(secure.address, job="team-b", token=ADMIN)
    token_a, token_b = admin_a.create_job(), admin_b.create_job()
    assert token_a and token_b and token_a != token_b
    a = client_factory(secure.address, job="team-a", token=token_a)
    a.join(heartbeat=False)
    a.create_dense("w", (8,), optimizer=sgd(1.0))
    a.push_dense("w", np.ones(8))
    b = client_factory(secure.address, job="team-b", token=token_b)
    b.create_dense("w", (8,), optimizer=sgd(1.0))
    # B's token on A's job: every operation is refused
    spy = client_factory(secure.address, job="team-a", token=token_b)
    for op in (lambda: spy.create_dense("x", (2,)), lambda: spy.join(heartbeat=False),
               lambda: spy.delete_table("w")):
        with pytest.raises(PermissionDenied, match="team-b"):
            op()
    # B's map shows nothing of A: it cannot even route to A's blocks
    assert ("team-a", "w") not in spy.refresh_map().tables
    # a raw push to A's table with B's token reaches the server and is refused there
    from shardps.protos.v1 import common_pb2 as pb
    from shardps.protos.v1 import parameter_server_pb2 as ps
    from shardps.rpc import channels
    from shardps.rpc.codec import encode_chunk
    from shardps.server.node_service import ParameterServerStub
    view = a.shard_map
    primary = view.table("team-a", "w").replicas[0][0]
    header = ps.PushHeader(header=pb.RequestHeader(job="team-a", epoch=view.epoch),
                           segments=[pb.Segment(table="w", range=pb.Range(start=0, stop=8))], payload_bytes=32)
    with channels.channel(view.address(primary)) as ch:
        with pytest.raises(grpc.RpcError) as err:
            ParameterServerStub(ch).Push(iter([encode_chunk(header.SerializeToString(), np.ones(8, np.float32).tobytes())]),
                                         timeout=5, metadata=(("authorization", f"Bearer {token_b}"),))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as err:
            ParameterServerStub(ch).Push(iter([encode_chunk(header.SerializeToString(), np.ones(8, np.float32).tobytes())]),
                                         timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    np.testing.assert_array_equal(a.pull_dense("w"), -np.ones(8))
    # no token at all, a forged token, and a job token for admin work
    with pytest.raises(Unauthenticated):
        client_factory(secure.address, job="team-a").refresh_map()
    with pytest.raises(Unauthenticated, match="not signed"):
        client_factory(secure.address, job="team-a", token=f"team-a.x.{'A' * 43}").refresh_map()
    with pytest.raises(PermissionDenied, match="admin"):
        a.create_job()
    with pytest.raises(PermissionDenied, match="admin"):
        a.checkpoint()
    # tokens never reach the logs
    assert ADMIN not in caplog.text and token_a not in caplog.text and token_b not in caplog.text


def test_job_quota_refuses_growth_beyond_it(make_cluster, client_factory):
    cluster = make_cluster(2)
    c = client_factory(cluster.address, job="small")
    c.create_job(quota_bytes=64 * 1024)
    with pytest.raises(ResourceExhausted, match="quota_bytes=65536"):
        c.create_dense("big", (100_000,), optimizer=sgd(0.1))
    c.create_sparse("e", 16, optimizer=sgd(0.1))
    c.push_rows("e", np.arange(200), np.ones((200, 16)))          # ~15 KiB: fits
    before = c.pull_rows("e", np.arange(200))
    with pytest.raises(ResourceExhausted, match="quota"):
        c.push_rows("e", np.arange(1000, 3000), np.ones((2000, 16)))
    np.testing.assert_array_equal(c.pull_rows("e", np.arange(200)), before)
    c.push_rows("e", np.arange(200), np.ones((200, 16)))          # existing rows still update


def test_a_stalled_push_stream_is_cancelled(cluster):
    """A client that opens a push stream and never finishes it does not hold a server thread."""
    from shardps.rpc import channels
    from shardps.rpc.status import DEFAULT_WATCHDOG
    from shardps.server.node_service import ParameterServerStub
    old = DEFAULT_WATCHDOG.idle_seconds
    DEFAULT_WATCHDOG.idle_seconds = 1.0
    release = threading.Event()
    try:
        from shardps.protos.v1 import common_pb2 as pb
        from shardps.protos.v1 import parameter_server_pb2 as ps
        from shardps.rpc.codec import encode_chunk
        header = ps.PushHeader(header=pb.RequestHeader(job="test", epoch=1), payload_bytes=1 << 20)

        def stalled():
            yield encode_chunk(header.SerializeToString(), b"\0" * 1024)   # then nothing more
            release.wait(30)

        server = next(iter(cluster.servers.values()))
        with channels.channel(server.address) as ch:
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                ParameterServerStub(ch).Push(stalled())      # no deadline at all
            assert err.value.code() == grpc.StatusCode.CANCELLED
            assert time.monotonic() - started < 10
    finally:
        release.set()
        DEFAULT_WATCHDOG.idle_seconds = old
