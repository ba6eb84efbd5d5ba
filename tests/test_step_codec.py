"""A Step reply's versions as the client reads them (``shardps.rpc.step_reply.read_reply``): what
the server wrote (``step_reply.reply``), each entry given to the push or the pull by its segment
in whatever order the entries come, and every reply that does not fit refused by name;
with numba and without it alike."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from shardps import kernels
from shardps.errors import InvalidArgument
from shardps.messages import RANGE, ROWS, Header, Layout, PullReply, PushAck, Slice, StepReply, StepRequest, Versions
from shardps.rpc import step, step_reply


@pytest.fixture(params=["compiled", "python"])
def walker(request, monkeypatch):
    if request.param == "compiled" and not kernels.AVAILABLE:
        pytest.skip("numba is not installed")
    if request.param == "python":
        monkeypatch.setattr(kernels, "AVAILABLE", False)
    return request.param


def _request() -> StepRequest:
    push = [Slice("w", RANGE, 0, 8), Slice("e", ROWS, ids=np.arange(3, dtype=np.int64))]
    pull = [Slice("w", RANGE, 0, 8), Slice("e", ROWS, ids=np.arange(2, dtype=np.int64)),
            Slice("f", ROWS, ids=np.arange(1, dtype=np.int64))]
    return StepRequest(Header("job"), push=push, pull=pull)


def _reply() -> StepReply:
    ack = PushAck([Versions("w", [0, 1], [7, 9]), Versions("e", [3, 1, 2], [1, 2, 3])], duplicate_blocks=2)
    pull = PullReply([Layout(1, 8), Layout(1, 32), Layout(1, 16)],
                     [Versions("w", [0, 1], [8, 10]), Versions("e", [5], [2**40]), Versions("f", [0], [0])],
                     payload_bytes=224, min_clock=4, waited_seconds=0.25)
    return StepReply(ack, pull)


def _names(request: StepRequest) -> list[str]:
    return [s.table for s in (*request.push, *request.pull)]


def _plain(versions: list[Versions]) -> list[tuple]:
    return [(v.table, [int(b) for b in v.blocks], [int(x) for x in v.versions]) for v in versions]


def test_a_reply_reads_back_as_the_server_wrote_it(walker):
    request, sent = _request(), _reply()
    ack, pulled, elements, shared = step_reply.read_reply(step_reply.reply(sent, request, True), _names(request), 2, 3)
    assert _plain(ack.versions) == _plain(sent.ack.versions) and ack.duplicate_blocks == 2
    assert _plain(pulled.versions) == _plain(sent.pull.versions)
    assert (pulled.payload_bytes, pulled.min_clock, pulled.waited_seconds) == (224, 4, 0.25)
    assert elements == (8, 32, 16) and shared and pulled.in_shared_memory


def _entries(raw: bytes, n_pull: int) -> tuple[bytes, list[bytes]]:
    """(the reply's fixed part, its versions entries as written)."""
    at = step_reply.REPLY.size + 8 * n_pull
    head, entries = raw[:at], []
    while at < len(raw):
        n = struct.unpack_from("<I", raw, at + 4)[0]
        size = 8 + step.pad8(4 * n) + 8 * n
        entries.append(raw[at:at + size])
        at += size
    return head, entries


def test_entries_in_any_order_go_to_the_push_or_the_pull_by_their_segment(walker):
    request, sent = _request(), _reply()
    head, entries = _entries(step_reply.reply(sent, request, False), 3)
    shuffled = head + b"".join(entries[i] for i in (2, 0, 4, 1, 3))     # pull, push, pull, push, pull
    ack, pulled, _, _ = step_reply.read_reply(shuffled, _names(request), 2, 3)
    assert _plain(ack.versions) == _plain(sent.ack.versions)
    assert _plain(pulled.versions) == [_plain(sent.pull.versions)[i] for i in (0, 2, 1)]


@pytest.mark.parametrize("damage, named", [
    (lambda head, entries: head + b"".join(entries)[:-8], "does not fit"),                # cut short
    (lambda head, entries: head + b"".join(entries) + bytes(8), "follow its end"),         # trailing bytes
    (lambda head, entries: head + b"".join(entries[:-1]) + struct.pack("<II", 9, 0), "does not fit"),   # segment 9
    (lambda head, entries: head + b"".join(entries[:-1]) + struct.pack("<II", 4, 2**31), "does not fit"),
    (lambda head, entries: head[:2] + struct.pack("<H", 9) + head[4:] + b"".join(entries), "does not fit"),
])
def test_a_reply_that_does_not_fit_is_refused_by_name(walker, damage, named):
    request, sent = _request(), _reply()
    head, entries = _entries(step_reply.reply(sent, request, False), 3)
    with pytest.raises(InvalidArgument, match=named):
        step_reply.read_reply(damage(head, entries), _names(request), 2, 3)


def test_a_reply_without_versions_reads_without_walking(walker):
    request = StepRequest(Header("job"), push=[Slice("w", RANGE, 0, 8)])
    raw = step_reply.reply(StepReply(PushAck()), request, False)
    ack, pulled, elements, _ = step_reply.read_reply(raw, ["w"], 1, 0)
    assert ack.versions == [] and pulled.versions == [] and elements == ()
    with pytest.raises(InvalidArgument, match="follow its end"):
        step_reply.read_reply(step_reply.reply(StepReply(PushAck()), request, False) + bytes(8), ["w"], 1, 0)
