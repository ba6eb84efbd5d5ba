"""The node's door: protobuf data messages into the plain values of ``shardps.messages``, and
the node's plain replies back into messages. The one place that maps them, for the gRPC
servicer and the data plane alike."""

from __future__ import annotations

from shardps import messages as m
from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import parameter_server_pb2 as ps


def header(h: pb.RequestHeader) -> m.Header:
    return m.Header(h.job, h.epoch, h.session, h.incarnation, h.sequence, h.acked_below, h.clock,
                    h.wire_dtype)


def header_message(h: m.Header) -> pb.RequestHeader:
    return pb.RequestHeader(job=h.job, epoch=h.epoch, session=h.session, incarnation=h.incarnation,
                            sequence=h.sequence, acked_below=h.acked_below, clock=h.clock,
                            wire_dtype=h.wire_dtype)  # type: ignore[arg-type]  # an enum number


def selection(seg: pb.Segment) -> m.Selection:
    which = seg.WhichOneof("selector")
    s = m.Selection(seg.table, which)
    if which == m.RANGE:
        s.start, s.stop = seg.range.start, seg.range.stop
    elif which == m.ROWS:
        s.count, s.all_stored = seg.rows.count, seg.rows.all_stored
    if seg.base_versions:
        s.base_versions = {bv.block: bv.version for bv in seg.base_versions}
    return s


def push_request(h: ps.PushHeader, payload) -> m.PushRequest:
    """A ``PushHeader`` and its payload bytes."""
    return m.PushRequest(header(h.header), h.kind, [selection(s) for s in h.segments], payload)


def pull_request(r: ps.PullRequest, ids=None) -> m.PullRequest:
    """A ``PullRequest``; its ids are ``ids`` where they travelled beside it, else ``r.data``."""
    return m.PullRequest(header(r.header), [selection(s) for s in r.segments],
                         r.data if ids is None else ids)


def _add_versions(field, versions: list[m.Versions]) -> None:
    for v in versions:
        for block, version in zip(v.blocks, v.versions):
            field.add(table=v.table, block=int(block), version=int(version))


def push_ack(ack: m.PushAck) -> ps.PushAck:
    out = ps.PushAck(duplicate_blocks=ack.duplicate_blocks)
    _add_versions(out.versions, ack.versions)
    return out


def pull_header(reply: m.PullReply) -> ps.PullHeader:
    out = ps.PullHeader(payload_bytes=reply.payload_bytes, min_clock=reply.min_clock,
                        in_shared_memory=reply.in_shared_memory, waited_seconds=reply.waited_seconds)
    for seg in reply.segments:
        out.segments.add(dtype=seg.dtype, elements=seg.elements, ids=seg.ids)
    _add_versions(out.versions, reply.versions)
    return out


# ---------------------------------------------------------------------- the client's side
def selection_message(seg, s: m.Selection) -> None:
    """Fill the protobuf ``Segment`` ``seg`` from ``s``."""
    seg.table = s.table
    if s.selector == m.RANGE:
        seg.range.start, seg.range.stop = s.start, s.stop
    elif s.selector == m.ROWS:
        if s.all_stored:
            seg.rows.all_stored = True
        else:
            seg.rows.count = s.count
    for block, version in s.base_versions.items():
        seg.base_versions.add(table=s.table, block=block, version=version)


def push_header(request: m.PushRequest, payload_bytes: int) -> ps.PushHeader:
    out = ps.PushHeader(header=header_message(request.header), kind=request.kind,  # type: ignore[arg-type]
                        payload_bytes=payload_bytes)
    for s in request.segments:
        selection_message(out.segments.add(), s)
    return out


def pull_message(request: m.PullRequest, chunk_bytes: int = 0, data: bytes = b"") -> ps.PullRequest:
    """A ``PullRequest`` message; its ids in ``data`` (gRPC) or beside it (the data plane)."""
    out = ps.PullRequest(header=header_message(request.header), chunk_bytes=chunk_bytes, data=data)
    for s in request.segments:
        selection_message(out.segments.add(), s)
    return out


def _versions(field) -> list[m.Versions]:
    return m.versions_by_table((v.table, v.block, v.version) for v in field)


def push_ack_plain(ack: ps.PushAck) -> m.PushAck:
    return m.PushAck(_versions(ack.versions), ack.duplicate_blocks)


def pull_reply_plain(head: ps.PullHeader) -> m.PullReply:
    return m.PullReply([m.Layout(s.dtype, s.elements, s.ids) for s in head.segments], _versions(head.versions),
                       head.payload_bytes, head.min_clock, head.in_shared_memory, head.waited_seconds)
