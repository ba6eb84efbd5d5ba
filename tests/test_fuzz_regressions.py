"""What the fuzzers found, each failure reduced to a few requests: all fixed, so these are
regression tests, named after what must hold. (An open bug's reproduction carries
``xfail(strict=True)`` and an entry in ``tests.fuzz.wire.KNOWN_BUGS`` until it is fixed.)
"""

from __future__ import annotations

import contextlib
import time

import grpc
import numpy as np
import pytest

from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.rpc import channels
from shardps.tables import sgd
from tests.fuzz.admin import ADMIN, secure_cluster
from tests.fuzz.encoder import raw_chunk
from tests.fuzz.wire import FAILED, INVALID, NOT_FOUND, OK, PS, RM, UNAVAILABLE


@pytest.fixture
def one_server(make_cluster, client_factory):
    """A manager and one server; job "r" with a dense table w (8 x f32, SGD lr 1) and a sparse
    table e (dim 2, 4 blocks, SGD lr 1); a raw channel to the server."""
    cluster = make_cluster(1)
    client = client_factory(cluster.address, "r")
    client.create_job()
    client.create_dense("w", (8,), optimizer=sgd(1.0), block_size=8)
    client.create_sparse("e", 2, num_rows=100, optimizer=sgd(1.0), num_blocks=4)
    server = next(iter(cluster.servers.values()))
    with channels.channel(server.address) as ch:
        yield cluster, client, ch


@contextlib.contextmanager
def process_cluster(tmp_path, job: str, consistency: str = "async", timeout: float = 10.0):
    """A manager and one server as processes (so that a stuck one is killed at the end) and a
    client of ``job``, created with ``consistency``."""
    from shardps.tools.local import LocalCluster
    from shardps.worker.client import PSClient
    with LocalCluster(servers=1, work_dir=str(tmp_path)) as cluster:
        with PSClient(cluster.manager_address, job, timeout=timeout) as client:
            client.create_job(consistency)
            yield client


def _push_chunk(client, segments, payload: bytes, **header) -> bytes:
    h = ps.PushHeader(header=pb.RequestHeader(job="r", epoch=client.refresh_map().epoch, **header),
                      segments=segments, payload_bytes=len(payload))
    return ps.PushChunk(header=h, data=payload).SerializeToString()


def _code(fn) -> str:
    try:
        fn()
        return OK
    except grpc.RpcError as err:
        return err.code().name


def test_an_undecodable_request_is_invalid_argument(one_server):
    cluster, _, ch = one_server
    assert _code(lambda: list(ch.unary_stream(f"/{PS}/Pull")(b"\xff\xff\xff", timeout=5))) == INVALID
    with channels.channel(cluster.address) as mch:
        assert _code(lambda: mch.unary_unary(f"/{RM}/CreateJob")(b"\xff", timeout=5)) == INVALID


def test_a_push_with_a_trailing_undecodable_chunk_is_refused_and_not_applied(one_server):
    _, client, ch = one_server
    before = client.pull_dense("w")
    good = _push_chunk(client, [pb.Segment(table="w", range=pb.Range(start=0, stop=8))],
                       np.ones(8, np.float32).tobytes())
    code = _code(lambda: ch.stream_unary(f"/{PS}/Push")(iter([good, b"\x0a\xff"]), timeout=5))
    assert code != OK
    np.testing.assert_array_equal(client.pull_dense("w"), before, err_msg=f"refused with {code}, yet applied")


def test_an_undecodable_push_header_is_invalid_argument(one_server):
    _, _, ch = one_server
    assert _code(lambda: ch.stream_unary(f"/{PS}/Push")(iter([raw_chunk(b"\xff\xff", b"")]),
                                                         timeout=5)) == INVALID


def test_a_replicate_with_a_short_payload_is_invalid_argument(one_server):
    _, _, ch = one_server
    head = ps.ReplicateHeader(epoch=1, source="s0", ops=[ps.BlockOp(job="r", table="w", block=0,
                                                                    kind=ps.APPLY, element_count=5)])
    chunk = ps.ReplicateChunk(header=head, data=b"abc").SerializeToString()
    assert _code(lambda: ch.stream_unary(f"/{PS}/Replicate")(iter([chunk]), timeout=5)) == INVALID


def test_load_blocks_with_an_unknown_array_dtype_is_invalid_argument(one_server):
    _, _, ch = one_server
    head = ps.BlockStateHeader(ref=ps.BlockRef(job="r", table="w", block=0),
                               arrays=[ps.ArrayInfo(name="values", dtype=pb.FLOAT16, shape=[8])])
    chunk = ps.BlockChunk(header=head, data=b"\0" * 16).SerializeToString()
    assert _code(lambda: ch.stream_unary(f"/{PS}/LoadBlocks")(iter([chunk]), timeout=5)) == INVALID


def test_a_push_with_clock_int64_max_leaves_the_jobs_pulls_working(one_server):
    _, client, ch = one_server
    m = client.join(heartbeat=False)
    report = _push_chunk(client, [], b"", session=m.session, incarnation=m.incarnation, clock=2 ** 63 - 1)
    assert _code(lambda: ch.stream_unary(f"/{PS}/Push")(iter([report]), timeout=5)) in (OK, INVALID)
    req = ps.PullRequest(header=pb.RequestHeader(job="r", epoch=client.refresh_map().epoch),
                         segments=[pb.Segment(table="w", range=pb.Range(start=0, stop=8))])
    assert _code(lambda: list(ch.unary_stream(f"/{PS}/Pull")(req.SerializeToString(), timeout=5))) == OK


def test_installing_a_malformed_shard_map_is_invalid_argument(one_server):
    _, client, ch = one_server
    m = pb.ShardMap()
    m.CopyFrom(client.refresh_map().msg)
    m.epoch += 100
    m.tables[0].blocks[0].replicas[:] = [7]
    req = ps.InstallShardMapRequest(map=m).SerializeToString()
    assert _code(lambda: ch.unary_unary(f"/{PS}/InstallShardMap")(req, timeout=5)) == INVALID


def test_a_pull_is_validated_before_it_waits_for_the_clock(make_cluster, client_factory):
    cluster = make_cluster(1)
    client = client_factory(cluster.address, "b")
    client.create_job("ssp", staleness=1)
    client.create_dense("w", (8,), optimizer=sgd(1.0))
    client.join(heartbeat=False)
    server = next(iter(cluster.servers.values()))
    req = ps.PullRequest(header=pb.RequestHeader(job="b", epoch=client.refresh_map().epoch,
                                                 session="not-a-member", clock=10 ** 6),
                         segments=[pb.Segment(table="nope", range=pb.Range(start=0, stop=1))])
    with channels.channel(server.address) as ch:
        assert _code(lambda: list(ch.unary_stream(f"/{PS}/Pull")(req.SerializeToString(), timeout=2))) == NOT_FOUND


@pytest.mark.slow          # processes
@pytest.mark.timeout(180, method="thread")
def test_a_sync_push_with_a_huge_clock_is_answered_without_spinning(tmp_path):
    with process_cluster(tmp_path, "s", "sync") as client:
        client.create_dense("w", (8,), optimizer=sgd(1.0))
        m = client.join(heartbeat=False)
        view = client.refresh_map()
        header = ps.PushHeader(header=pb.RequestHeader(job="s", epoch=view.epoch, session=m.session,
                                                       incarnation=m.incarnation, clock=10 ** 12))
        with channels.channel(view.address(view.table("s", "w").replicas[0][0])) as ch:
            code = _code(lambda: ch.stream_unary(f"/{PS}/Push")(
                iter([ps.PushChunk(header=header).SerializeToString()]), timeout=3))
        assert code in (OK, INVALID, FAILED), code


@pytest.mark.slow          # processes
@pytest.mark.timeout(180, method="thread")
def test_a_table_with_very_many_blocks_is_refused_as_resource_exhausted(tmp_path):
    from shardps.errors import ResourceExhausted, ShardpsError
    with process_cluster(tmp_path, "big", timeout=3) as client:
        try:
            client.create_sparse("huge", 1, num_blocks=1 << 18)
            outcome = "created"
        except ResourceExhausted:
            return
        except ShardpsError as exc:
            outcome = type(exc).__name__
        raise AssertionError(f"CreateTable of 2**18 blocks: {outcome}, not RESOURCE_EXHAUSTED")


def test_a_push_answered_unavailable_is_applied_once_when_retried(make_cluster, client_factory):
    """UNAVAILABLE from Push means an unknown outcome (parameter_server.proto): the primary
    may have applied it before a backup failed to. Retried with the same (session,
    incarnation, sequence) once the map drops the dead backup, it is applied exactly once."""
    cluster = make_cluster(2, replication=2, lease=1.0)
    client = client_factory(cluster.address, "r", timeout=10)
    client.create_job()
    m = client.join(heartbeat=False)
    view = client.create_dense("w", (8,), optimizer=sgd(1.0), block_size=8)
    primary, backup = view.replicas[0]
    cluster.servers[backup].stop()
    payload = np.ones(8, np.float32).tobytes()
    ident = dict(session=m.session, incarnation=m.incarnation, sequence=1)
    push = _push_chunk(client, [pb.Segment(table="w", range=pb.Range(start=0, stop=8))], payload, **ident)
    with channels.channel(cluster.servers[primary].address) as ch:
        assert _code(lambda: ch.stream_unary(f"/{PS}/Push")(iter([push]), timeout=5)) == UNAVAILABLE
        deadline = time.monotonic() + 30
        while backup in client.refresh_map().table("r", "w").replicas[0]:
            assert time.monotonic() < deadline, "the dead backup was never dropped"
            time.sleep(0.1)
        retry = _push_chunk(client, [pb.Segment(table="w", range=pb.Range(start=0, stop=8))], payload, **ident)
        assert _code(lambda: ch.stream_unary(f"/{PS}/Push")(iter([retry]), timeout=5)) == OK
    np.testing.assert_array_equal(client.pull_dense("w"), -np.ones(8, np.float32))


def test_a_job_cannot_push_from_another_clients_shared_memory_region(make_cluster, client_factory):
    import os
    import secrets
    cluster = secure_cluster(make_cluster, 1)
    token_b = client_factory(cluster.address, "team-b", token=ADMIN).create_job()
    b = client_factory(cluster.address, "team-b", token=token_b)
    b.create_dense("w", (4,), optimizer=sgd(1.0), block_size=4)
    name = "shardps-" + secrets.token_hex(8)          # job A's worker's region, holding its gradient
    path = os.path.join("/dev/shm", name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, np.array([1.5, 2.5, 3.5, 4.5], np.float32).tobytes())
        os.close(fd)
        head = ps.PushHeader(header=pb.RequestHeader(job="team-b", epoch=b.refresh_map().epoch),
                             segments=[pb.Segment(table="w", range=pb.Range(start=0, stop=4))],
                             payload_bytes=16, shared_memory=pb.SharedMemoryRef(name=name, length=16))
        with channels.channel(next(iter(cluster.servers.values())).address) as ch:
            code = _code(lambda: ch.stream_unary(f"/{PS}/Push")(
                iter([ps.PushChunk(header=head).SerializeToString()]), timeout=5,
                metadata=(("authorization", f"Bearer {token_b}"),)))
        assert code != OK, "job B's push read another client's shared-memory region"
    finally:
        os.unlink(path)
