"""The packed headers of the data plane (``shardps.rpc.packed``): every field round-trips,
anything malformed is refused with InvalidArgument (never another exception), and a packed
request gets the same answer as its protobuf form from a real server."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardps import messages as m
from shardps.errors import InvalidArgument, PermissionDenied
from shardps.rpc import messages, packed
from shardps.tables import sgd

HEADER = m.Header("job-a", 12, "0123456789abcdef", 3, 77, 75, 1 << 39, 2)
SEGMENTS = [m.Selection("w", m.RANGE, 16, 4096, base_versions={0: 5, 3: 1 << 40}),
            m.Selection("emb", m.ROWS, count=890), m.Selection("all", m.ROWS, all_stored=True),
            m.Selection("\u00fc-table")]


def test_requests_round_trip():
    push = m.PushRequest(HEADER, m.GRADIENT, SEGMENTS)
    got, declared = packed.read_push(packed.push(push, 1234), b"")
    assert (got.header, got.kind, got.segments, declared) == (HEADER, m.GRADIENT, SEGMENTS, 1234)
    assert packed.read_pull(packed.pull(m.PullRequest(HEADER, SEGMENTS)), b"ids").segments == SEGMENTS
    payload = memoryview(bytes(range(40)))
    a, b = packed.read_exchange(packed.exchange(push, 30, m.PullRequest(HEADER, SEGMENTS[:2])), payload)
    assert bytes(a.payload) == bytes(range(30)) and bytes(b.ids) == bytes(range(30, 40))
    assert a.segments == SEGMENTS and b.segments == SEGMENTS[:2] and b.header == HEADER


def test_a_shared_region_before_a_header_round_trips_and_refuses_negative_numbers():
    head = packed.pull(m.PullRequest(HEADER, SEGMENTS))
    name, offset, length, rest = packed.read_shared_region(packed.shared_region("shardps-ab12", 64, 1 << 33) + head)
    assert (name, offset, length, bytes(rest)) == ("shardps-ab12", 64, 1 << 33, head)
    with pytest.raises(InvalidArgument, match="must not be negative"):
        packed.read_shared_region(packed.shared_region("shardps-ab12", -1, 8))


def test_replies_round_trip():
    ack = m.PushAck([m.Versions("emb", [0, 5, 63], [1, 2, 1 << 50]), m.Versions("w", [0], [9])], 2)
    reply = m.PullReply([m.Layout(1, 100), m.Layout(2, 16, 4)], ack.versions, 8400, -3, True, 0.25)
    got_ack, got_reply = packed.read_exchange_reply(packed.exchange_reply(ack, reply))
    assert got_ack.duplicate_blocks == 2 and got_reply.segments == reply.segments
    assert (got_reply.payload_bytes, got_reply.min_clock, got_reply.in_shared_memory,
            got_reply.waited_seconds) == (8400, -3, True, 0.25)
    for got, want in ((got_ack.versions, ack.versions), (got_reply.versions, reply.versions)):
        assert [(v.table, list(v.blocks), list(v.versions)) for v in got] == \
            [(v.table, list(v.blocks), list(v.versions)) for v in want]


def test_more_base_versions_than_a_two_byte_count_round_trip():
    """A dense table with a small block_size has more than 65535 blocks: its base versions
    once overflowed a 2-byte count (a raw struct.error at the next push)."""
    base = {b: (b * 7) + (1 << 40) for b in range(70_000)}
    segments = [m.Selection("w", m.RANGE, 0, 70_000 * 4, base_versions=base), m.Selection("e", m.ROWS, count=3)]
    got, declared = packed.read_push(packed.push(m.PushRequest(HEADER, m.GRADIENT, segments), 9), b"")
    assert got.segments == segments and declared == 9
    assert all(type(b) is int and type(v) is int for b, v in got.segments[0].base_versions.items())
    a, b = packed.read_exchange(packed.exchange(m.PushRequest(HEADER, m.GRADIENT, segments), 0,
                                                m.PullRequest(HEADER, segments)), memoryview(b""))
    assert a.segments == segments and b.segments == segments
    with pytest.raises(InvalidArgument, match="base versions"):
        packed.push(m.PushRequest(HEADER, m.GRADIENT, [m.Selection("w", m.RANGE, 0, 4, base_versions={-1: 2})]), 0)


READERS = [lambda b: packed.read_push(b, b""), lambda b: packed.read_pull(b, b""),
           lambda b: packed.read_exchange(b, memoryview(b"")), packed.read_push_ack, packed.read_pull_reply,
           packed.read_exchange_reply, packed.read_shared_region]


def test_more_segments_than_a_packed_header_carries_are_refused_by_name():
    """A request of over 65,535 segments to one server does not fit the 2-byte count: a
    clear InvalidArgument before anything is sent (once a raw struct.error)."""
    many = [m.Selection("w", m.RANGE, i, i + 1) for i in range(65_536)]
    with pytest.raises(InvalidArgument, match="65536 segments in one request to one server: at most 65,535"):
        packed.push(m.PushRequest(HEADER, m.GRADIENT, many), 0)
    with pytest.raises(InvalidArgument, match="65536 segments"):
        packed.pull(m.PullRequest(HEADER, many))
    assert packed.read_pull(packed.pull(m.PullRequest(HEADER, many[:65_535])), b"").segments == many[:65_535]


@settings(max_examples=400, deadline=None)
@given(reader=st.sampled_from(READERS), data=st.binary(max_size=120), cut=st.integers(0, 200),
       flip=st.integers(0, 400))
def test_malformed_headers_are_refused_with_invalid_argument(reader, data, cut, flip):
    valid = packed.exchange(m.PushRequest(HEADER, 1, SEGMENTS), 0, m.PullRequest(HEADER, SEGMENTS))
    for raw in (data, valid[:cut], valid[:flip % len(valid)] + bytes([valid[flip % len(valid)] ^ 0xA5])
                + valid[flip % len(valid) + 1:]):
        try:
            reader(raw)
        except InvalidArgument:
            pass


@pytest.mark.parametrize("packed_form", [False, True], ids=["protobuf", "packed"])
def test_a_real_server_answers_both_forms_alike_and_checks_the_job(make_cluster, client_factory, packed_form):
    from shardps.protos.v1 import parameter_server_pb2 as ps
    from shardps.rpc.dataplane import DataPlaneConnection
    from shardps.rpc.frames import FLAG_PACKED
    from tests.fuzz.admin import ADMIN, secure_cluster
    from tests.sessions import ClientSession
    from tests.test_authz import _md
    cluster = secure_cluster(make_cluster, 1)
    tokens = {j: client_factory(cluster.address, job=j, token=ADMIN).create_job() for j in ("team-a", "team-b")}
    a = client_factory(cluster.address, job="team-a", token=tokens["team-a"])
    a.create_sparse("e", 4, optimizer=sgd(1.0))
    epoch = a.refresh_map().epoch
    session = ClientSession(cluster.address, "team-a", metadata=_md(tokens["team-a"]))
    ids = np.array([3, 7], np.int64)
    grads = np.ones((2, 4), np.float32)
    server = next(iter(cluster.servers.values()))

    def header(job="team-a"):
        h = session.header(epoch, job=job)
        return m.Header(h.job, h.epoch, h.session, h.incarnation, h.sequence, h.acked_below)
    segs = [m.Selection("e", m.ROWS, count=2)]

    def call(conn, method, push=None, pull=None):
        if packed_form:
            head = (packed.push(push, 48) if method == "Push" else packed.pull(pull) if method == "Pull"
                    else packed.exchange(push, 48, pull))
        else:
            head = (messages.push_header(push, 48) if method == "Push" else messages.pull_message(pull)
                    if method == "Pull" else ps.ExchangeHeader(push=messages.push_header(push, 48),
                                                               pull=messages.pull_message(pull)))
            head = head.SerializeToString()
        payload = [ids, grads] if method == "Push" else [ids] if method == "Pull" else [ids, grads, ids]
        raw, view = conn.call(method, head, payload, timeout=10, flags=FLAG_PACKED if packed_form else 0)
        if method == "Push":
            return packed.read_push_ack(raw) if packed_form else messages.push_ack_plain(ps.PushAck.FromString(raw))
        reply = (packed.read_exchange_reply(raw)[1] if method == "Exchange" and packed_form else
                 packed.read_pull_reply(raw) if packed_form else
                 messages.pull_reply_plain(ps.ExchangeReply.FromString(raw).pull if method == "Exchange"
                                           else ps.PullHeader.FromString(raw)))
        return reply, np.frombuffer(bytes(view), np.float32).reshape(-1, 4)

    with DataPlaneConnection(server.data_plane.address, metadata=_md(tokens["team-a"])) as conn:
        ack = call(conn, "Push", push=m.PushRequest(header(), m.GRADIENT, segs))
        assert ack.duplicate_blocks == 0 and sum(len(v.blocks) for v in ack.versions) >= 1
        reply, rows = call(conn, "Pull", pull=m.PullRequest(header(), segs))
        np.testing.assert_array_equal(rows, -np.ones((2, 4)))
        assert [(s.dtype, s.elements) for s in reply.segments] == [(1, 8)]
        reply, rows = call(conn, "Exchange", push=m.PushRequest(header(), m.GRADIENT, segs),
                           pull=m.PullRequest(header(), segs))
        np.testing.assert_array_equal(rows, -2 * np.ones((2, 4)))
    with DataPlaneConnection(server.data_plane.address, metadata=_md(tokens["team-b"])) as conn:
        with pytest.raises(PermissionDenied, match="team-b"):
            call(conn, "Pull", pull=m.PullRequest(header(), segs))
        with pytest.raises(PermissionDenied, match="team-b"):
            call(conn, "Exchange", push=m.PushRequest(header("team-b"), m.GRADIENT, segs),
                 pull=m.PullRequest(header(), segs))
