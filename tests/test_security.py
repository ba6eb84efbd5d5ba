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
    a.push_dense("w", np.ones(8, np.float32))
    b = client_factory(secure.address, job="team-b", token=token_b)
    b.create_dense("w", (8,), optimizer=sgd(1.0))
    # B's token on A's job: every operation is refused
    spy = client_factory(secure.address, job="team-a", token=token_b)
    for op in (lambda: spy.create_dense("x", (2,)), lambda: spy.join(heartbeat=False),
               lambda: spy.delete_table("w")):
        with pytest.raises(PermissionDenied, match="team-b"):
            op()
    # B's token cannot read A's map (PERMISSION_DENIED), and the whole map it may read shows
    # nothing of A: it cannot even route to A's blocks
    with pytest.raises(PermissionDenied, match="cannot read the map of job 'team-a'"):
        spy.refresh_map()
    assert ("team-a", "w") not in spy.cluster_map().tables
    assert ("team-b", "w") in spy.cluster_map().tables
    # a raw push to A's table with B's token reaches the server and is refused there
    from shardps.protos.v1 import common_pb2 as pb
    from shardps.protos.v1 import parameter_server_pb2 as ps
    from shardps.rpc import channels
    from shardps.rpc.codec import encode_chunk
    from shardps.rpc.stubs import ParameterServerStub
    view = a.shard_map
    primary = view.table("team-a", "w").replicas[0][0]
    header = ps.PushHeader(header=pb.RequestHeader(job="team-a", epoch=view.epoch),
                           segments=[pb.Segment(table="w", range=pb.Range(start=0, stop=8))], payload_bytes=32)
    with channels.channel(view.address(primary)) as ch:
        with pytest.raises(grpc.RpcError) as err:
            ParameterServerStub(ch).Push(iter([encode_chunk(header.SerializeToString(),
                                                            np.ones(8, np.float32).tobytes())]),
                                         timeout=5, metadata=(("authorization", f"Bearer {token_b}"),))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as err:
            ParameterServerStub(ch).Push(iter([encode_chunk(header.SerializeToString(),
                                                            np.ones(8, np.float32).tobytes())]),
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
    c.push_rows("e", np.arange(200), np.ones((200, 16), np.float32))          # ~15 KiB: fits
    before = c.pull_rows("e", np.arange(200))
    with pytest.raises(ResourceExhausted, match="quota"):
        c.push_rows("e", np.arange(1000, 3000), np.ones((2000, 16), np.float32))
    np.testing.assert_array_equal(c.pull_rows("e", np.arange(200)), before)
    c.push_rows("e", np.arange(200), np.ones((200, 16), np.float32))          # existing rows still update


def test_a_stalled_push_stream_is_cancelled(cluster):
    """A client that opens a push stream and never finishes it does not hold a server thread."""
    from shardps.rpc import channels
    from shardps.rpc.status import DEFAULT_WATCHDOG
    from shardps.rpc.stubs import ParameterServerStub
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


# ---------------------------------------------------------------------- tenancy: names, files,
# status and shared memory of one job are out of another job's reach
def _jobs(secure, client_factory, *jobs):
    """Per job: a joined client with the job's token, and the token."""
    out = []
    for job in jobs:
        token = client_factory(secure.address, job=job, token=ADMIN).create_job()
        c = client_factory(secure.address, job=job, token=token)
        c.join(name=f"{job}-w0", heartbeat=False)
        out.append((c, token))
    return out


def _tree(root) -> dict:
    """Every file under ``root``: relative path -> bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_job_cannot_replace_another_jobs_checkpoint_nor_write_outside_the_root(
        secure, client_factory, tmp_path):
    import os

    from shardps.errors import InvalidArgument
    root = tmp_path / "checkpoints"
    secure.manager.service.checkpoints.default_dir = str(root)
    (a, _), (b, _) = _jobs(secure, client_factory, "team-a", "team-b")
    a.create_dense("w", (8,), optimizer=sgd(1.0))
    a.push_dense("w", np.ones(8, np.float32))
    path_a = a.checkpoint_barrier(1, b"state of team-a")
    path_bx = b.checkpoint_barrier(1, b"", checkpoint_id="x")       # B's own, legitimately
    before, outside = _tree(root / os.path.relpath(path_a, root)), _tree(tmp_path)
    for checkpoint_id in ("x/" + os.path.relpath(path_a, path_bx), "x/../../anywhere", "..", "a\0b"):
        with pytest.raises(InvalidArgument, match="checkpoint_id"):
            b.checkpoint_barrier(2, b"", checkpoint_id=checkpoint_id)
    assert _tree(root / os.path.relpath(path_a, root)) == before, "team-a's checkpoint changed"
    assert _tree(tmp_path) == outside, "files changed"
    assert not (tmp_path / "anywhere").exists()


@pytest.mark.slow          # ~10 s
def test_admin_directories_must_lie_inside_the_checkpoint_root(secure, client_factory, tmp_path):
    from shardps.errors import FailedPrecondition, InvalidArgument
    root = tmp_path / "checkpoints"
    _jobs(secure, client_factory, "team-a")
    admin = client_factory(secure.address, job="team-a", token=ADMIN)
    with pytest.raises(FailedPrecondition, match="checkpoint-dir"):       # no root configured
        admin.checkpoint(str(root))
    secure.manager.service.checkpoints.default_dir = str(root)
    for directory in (str(tmp_path / "elsewhere"), "../elsewhere", "sub/../../elsewhere"):
        with pytest.raises(InvalidArgument, match="outside the checkpoint root"):
            admin.checkpoint(directory)
    assert not (tmp_path / "elsewhere").exists()
    path = admin.checkpoint("sub").path                 # relative: under the root
    assert path.startswith(str(root / "sub" / "team-a") + "/")
    with pytest.raises(InvalidArgument, match="outside the checkpoint root"):
        admin.restore(str(tmp_path))
    assert admin.restore(path).tables == 0


BAD_NAMES = ["", "a/b", "../etc", "..", ".", ".hidden", "-rf", "a\0b", "sp ace", "a\n", "tab\t",
             "\u00fc", "a..b", "x" * 129]


def test_names_that_break_their_rule_are_refused_before_anything_changes(secure):
    """Job, table, worker and server names: INVALID_ARGUMENT naming the field, nothing stored."""
    from shardps.protos.v1 import common_pb2 as pb
    from shardps.protos.v1 import manager_pb2 as mg
    from shardps.rpc import channels
    from shardps.worker.client import ManagerStub
    admin = (("authorization", f"Bearer {ADMIN}"),)
    rt = secure.manager.runtime
    with channels.channel(secure.address) as ch:
        stub = ManagerStub(ch)
        stub.CreateJob(mg.CreateJobRequest(job="team-a"), timeout=5, metadata=admin)
        with rt.lock:
            before = rt.state.epoch, sorted(rt.state.jobs), sorted(rt.state.tables)
        table = lambda name: pb.TableSpec(name=name, kind=pb.DENSE, shape=[4])    # noqa: E731
        config = pb.TableConfig(optimizer=pb.OptimizerConfig(kind=pb.SGD, lr=0.1))
        calls = [(f"CreateJob {n!r}", "job", lambda n=n: stub.CreateJob(mg.CreateJobRequest(job=n), timeout=5,
                                                                        metadata=admin))
                 for n in BAD_NAMES + ["x" * 65]]
        calls += [(f"CreateTable {n!r}", "spec.name", lambda n=n: stub.CreateTable(
            mg.CreateTableRequest(job="team-a", spec=table(n), config=config), timeout=5, metadata=admin))
            for n in BAD_NAMES]
        calls += [(f"JoinWorkerGroup {n!r}", "name", lambda n=n: stub.JoinWorkerGroup(
            mg.JoinWorkerGroupRequest(job="team-a", name=n), timeout=5, metadata=admin)) for n in BAD_NAMES[1:]]
        calls += [(f"ListTables of job {n!r}", "job", lambda n=n: stub.ListTables(
            mg.ListTablesRequest(job=n), timeout=5, metadata=admin)) for n in BAD_NAMES]
        register = ch.unary_unary("/shardps.v1.ResourceManager/RegisterServer",
                                  request_serializer=mg.RegisterServerRequest.SerializeToString,
                                  response_deserializer=mg.RegisterServerResponse.FromString)
        calls += [(f"RegisterServer {n!r}", "name", lambda n=n: register(
            mg.RegisterServerRequest(name=n, address="127.0.0.1:1"), timeout=5, metadata=admin))
            for n in BAD_NAMES]
        wrong = []
        for what, field, call in calls:
            try:
                call()
                wrong.append(f"{what}: accepted")
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.INVALID_ARGUMENT or f"{field}=" not in err.details():
                    wrong.append(f"{what}: {err.code().name} {err.details()}")
        assert not wrong, "\n".join(wrong)
    with rt.lock:
        assert (rt.state.epoch, sorted(rt.state.jobs), sorted(rt.state.tables)) == before
        assert not rt.state.job("team-a").members


def test_node_status_shows_a_job_token_only_its_own_job(secure, client_factory):
    from shardps.protos.v1 import parameter_server_pb2 as ps
    from shardps.rpc import channels
    from shardps.rpc.stubs import ParameterServerStub
    (a, _), (b, token_b) = _jobs(secure, client_factory, "team-a", "team-b")
    a.create_dense("secret-a", (4096,), optimizer=sgd(1.0), block_size=64)
    b.create_dense("w", (8,), optimizer=sgd(1.0))
    for name, server in secure.servers.items():
        with channels.channel(server.address) as ch:
            def status(token):
                return ParameterServerStub(ch).GetNodeStatus(
                    ps.GetNodeStatusRequest(), timeout=5, metadata=(("authorization", f"Bearer {token}"),))
            everything = status(ADMIN)
            assert {t.job for t in everything.tables} >= {"team-a"}, name     # A has blocks everywhere
            assert {c.job for c in everything.clocks} == {"team-a", "team-b"}, name
            seen = status(token_b)
            assert {t.job for t in seen.tables} <= {"team-b"}, f"{name} shows B {list(seen.tables)}"
            assert {c.job for c in seen.clocks} == {"team-b"}, f"{name} shows B {list(seen.clocks)}"
            mine = [t for t in everything.tables if t.job == "team-b"]
            assert seen.bytes == sum(t.bytes for t in mine), f"{name}: totals include other jobs"
            assert seen.primary_blocks + seen.replica_blocks == sum(t.blocks for t in mine)


def test_another_jobs_shared_memory_region_is_permission_denied(secure, client_factory):
    import secrets

    from shardps import messages as m
    from shardps.errors import PermissionDenied
    from shardps.protos.v1 import common_pb2 as pb
    from shardps.protos.v1 import parameter_server_pb2 as ps
    from shardps.rpc import channels, packed
    from shardps.rpc.codec import encode_chunk
    from shardps.rpc.dataplane import DataPlaneConnection
    from shardps.rpc.frames import FLAG_PACKED, FLAG_SHARED
    from shardps.rpc.shm import ClientRegions, available
    from shardps.rpc.stubs import ParameterServerStub
    if not available():
        pytest.skip("no writable /dev/shm")
    (a, token_a), (b, token_b) = _jobs(secure, client_factory, "team-a", "team-b")
    b.create_dense("w", (8,), optimizer=sgd(1.0))
    view = b.refresh_map()
    server = view.address(view.table("team-b", "w").replicas[0][0])
    regions = ClientRegions()
    try:
        region = regions.acquire(64)
        nonce = secrets.token_bytes(16)
        region.view(0, 16)[:] = nonce
        ref = pb.SharedMemoryRef(name=region.name, offset=0, length=32)
        with channels.channel(server) as ch:
            stub = ParameterServerStub(ch)
            md_a, md_b = ((("authorization", f"Bearer {t}"),) for t in (token_a, token_b))
            probe = stub.ProbeSharedMemory(ps.ProbeSharedMemoryRequest(ref=ref, nonce=nonce, job="team-a"),
                                           timeout=5, metadata=md_a)
            assert probe.usable, probe.reason                        # the region is A's now
            header = pb.RequestHeader(job="team-b", epoch=view.epoch)
            segments = [pb.Segment(table="w", range=pb.Range(start=0, stop=8))]
            push = ps.PushHeader(header=header, segments=segments, payload_bytes=32, shared_memory=ref)
            with pytest.raises(grpc.RpcError) as err:
                stub.Push(iter([encode_chunk(push.SerializeToString(), None)]), timeout=5, metadata=md_b)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
            pull = ps.PullRequest(header=header, segments=segments, reply_shared_memory=ref)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Pull(pull, timeout=5, metadata=md_b))
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
        # the same region named in data-plane frames (flag SHARED): refused as well
        plane = next(s for s in secure.servers.values() if s.address == server).data_plane.address
        head, selection = m.Header("team-b", view.epoch), [m.Selection("w", m.RANGE, 0, 8)]
        shared = packed.shared_region(region.name, 0, 32)
        with DataPlaneConnection(plane, metadata=md_b) as conn:
            with pytest.raises(PermissionDenied):
                conn.call("Push", shared + packed.push(m.PushRequest(head, m.GRADIENT, selection), 32),
                          timeout=5, flags=FLAG_PACKED | FLAG_SHARED)
            with pytest.raises(PermissionDenied):
                conn.call("Pull", shared + packed.pull(m.PullRequest(head, selection)), timeout=5,
                          flags=FLAG_PACKED | FLAG_SHARED)
        assert bytes(region.view(0, 16)) == nonce
    finally:
        regions.close()
