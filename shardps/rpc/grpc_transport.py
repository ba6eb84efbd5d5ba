"""``GrpcTransport``: the data path's ``Transport`` (``shardps.worker.client.transport``) over
gRPC streams of ``codec`` chunks, with the same-host shared-memory fast path
(``shardps.rpc.shm``). Requests and replies are the plain values of ``shardps.messages``,
turned into their protobuf messages (``shardps.rpc.messages``) here."""

from __future__ import annotations

import logging
import os
import time

import grpc
from google.protobuf.message import DecodeError

from shardps.errors import InvalidArgument, ShardpsError, Unavailable, UnknownRegion
from shardps.messages import PullRequest, PushAck, PushRequest
from shardps.metrics import WorkerMetrics, labelled
from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.rpc import messages, shm
from shardps.rpc.codec import CHUNK_BYTES, byte_view, encode_chunk, split_payload, write_into
from shardps.rpc.payload import Payload
from shardps.rpc.status import from_rpc_error
from shardps.rpc.stubs import SERVICE, InFlight, StubPool

log = logging.getLogger("shardps.client")
SHM_MIN_BYTES = 32 << 10       # payloads this large go through shared memory when possible


class _Unproved(Exception):
    """A call through a shared-memory region the server does not know (``GrpcTransport.push``)."""


# the codes of a call the server may still be serving (a deadline, a broken connection, a
# cancel): its shared-memory region is not used again (``release_region``)
UNANSWERED = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


class GrpcTransport:
    """``Transport`` over gRPC (``StubPool``) with the shared-memory fast path: a payload of
    ``SHM_MIN_BYTES`` or more to a server that proved it maps this process's memory goes
    through a ``/dev/shm`` region; gRPC then carries only the control messages. Thread-safe."""

    def __init__(self, job: str, pool: StubPool, metrics: WorkerMetrics, *, metadata=(),
                 chunk_bytes: int = CHUNK_BYTES, shared_memory: bool = True):
        self.job = job
        self.pool = pool
        self.metrics = metrics
        self.metadata = tuple(metadata)
        self.chunk_bytes = chunk_bytes
        self._shm = shm.ClientRegions() if shared_memory and shm.available() else None
        self._shm_ok: dict[str, bool] = {}
        self._shm_proved: set[tuple[str, str]] = set()
        self.in_flight = InFlight()                    # by address: abandon() cancels them

    def push(self, server, address, request: PushRequest, timeout: float) -> PushAck:
        """Send a push. One through a shared-memory region that the server does not know
        (``UnknownRegion``: restarted at the same address) is sent again in chunks, and the
        server's regions are proved again before their next use."""
        try:
            return self._push(server, address, request, timeout, shared=True)
        except _Unproved:
            return self._push(server, address, request, timeout, shared=False)

    def _push(self, server, address, request: PushRequest, timeout: float, shared: bool) -> PushAck:
        arrays = list(request.payload)
        header = messages.push_header(request, sum(byte_view(a).nbytes for a in arrays))
        region = self._shared_memory_for(address, header.payload_bytes) if shared else None
        if region is not None:          # same host: write the bytes once, send a reference
            view = region.view(0, header.payload_bytes)
            write_into(view, arrays)
            del view
            header.shared_memory.name = region.name
            header.shared_memory.length = header.payload_bytes
            arrays = []
        head = header.SerializeToString()

        def chunks():
            first = head
            for piece in split_payload(arrays, self.chunk_bytes):
                yield encode_chunk(first, piece)
                first = None
            if first is not None:
                yield encode_chunk(first, None)

        started = time.perf_counter()
        code = "OK"
        answered = False
        try:
            call = self.pool.get(address).Push.future(chunks(), timeout=timeout, metadata=self.metadata)
            ack = messages.push_ack_plain(self.in_flight.wait(address, call, f"push to {server}"))
            answered = True
            return ack
        except grpc.RpcError as err:
            code = err.code().name
            answered = err.code() not in UNANSWERED
            raise self._failure(region, address, from_rpc_error(err, f"push to {server}")) from None
        finally:
            if region is not None:
                self.release_region(region, answered)
            self.observe("Push", "client_stream", code, started)

    def pull(self, server, address, request: PullRequest, reply_bytes, timeout, consume):
        """Send a pull and ``consume`` its reply; a region refused as ``push`` says."""
        try:
            return self._pull(server, address, request, reply_bytes, timeout, consume, shared=True)
        except _Unproved:
            return self._pull(server, address, request, reply_bytes, timeout, consume, shared=False)

    def _pull(self, server, address, request: PullRequest, reply_bytes, timeout, consume, shared: bool):
        region = self._shared_memory_for(address, reply_bytes) if reply_bytes and shared else None
        message = messages.pull_message(request, self.chunk_bytes,
                                        b"".join(byte_view(a) for a in request.ids) if request.ids else b"")
        if region is not None:
            message.reply_shared_memory.name = region.name
            message.reply_shared_memory.length = region.size
        started = time.perf_counter()
        code = "OK"
        payload = None
        answered = False
        try:
            stream = self.pool.get(address).Pull(message, timeout=timeout, metadata=self.metadata)
            with self.in_flight.tracking(address, stream):
                head, payload = collect(stream, server)
            answered = True
            if head.in_shared_memory:
                if region is None:              # the server writes only where we asked
                    raise Unavailable(f"malformed reply from {server}: its payload is in shared memory, "
                                      f"but this pull offered none")
                try:
                    payload = Payload([region.view(0, head.payload_bytes)])
                except InvalidArgument as exc:
                    raise Unavailable(f"malformed reply from {server}: {exc.message}") from None
            return consume(messages.pull_reply_plain(head), payload)
        except grpc.RpcError as err:
            code = err.code().name
            answered = err.code() not in UNANSWERED
            raise self._failure(region, address, from_rpc_error(err, f"pull from {server}")) from None
        finally:
            payload = None                  # drop views of the region before releasing it
            if region is not None:
                self.release_region(region, answered)
            self.observe("Pull", "server_stream", code, started)

    def _failure(self, region, address: str, exc: ShardpsError) -> Exception:
        """What a failed call raises: ``_Unproved`` where it went through ``region`` and the
        server does not know the region (see ``push``), else ``exc``."""
        if region is not None and isinstance(exc, UnknownRegion):
            self.forget_regions(address)
            return _Unproved()
        return exc

    def exchange_start(self, server, address, push, pull, timeout):
        """gRPC has no exchange: None (the data path sends a push, then a pull)."""
        return None

    def exchange_finish(self, started, consume):
        raise AssertionError("GrpcTransport.exchange_start never starts an exchange")

    def step_start(self, server, address, request, reply_bytes, timeout, into=None):
        """gRPC has no Step: None (the data path sends a push, then a pull)."""
        return None

    def step_finish(self, started, consume):
        raise AssertionError("GrpcTransport.step_start never starts a step")

    def observe(self, method: str, kind: str, code: str, started: float) -> None:
        g = self.metrics.grpc
        labelled(g.started, SERVICE, method, kind).inc()
        labelled(g.handled, SERVICE, method, kind, code).inc()
        labelled(g.handling, SERVICE, method, kind).observe(time.perf_counter() - started)

    def abandon(self, address: str) -> None:
        """Cancel the gRPC calls in flight to ``address`` (they raise Unavailable)."""
        self.in_flight.abandon(address)

    def close(self) -> None:
        self.pool.close()
        if self._shm is not None:
            self._shm.close()

    # --- the same-host fast path ---
    def shares_memory_with(self, address: str) -> bool:
        """Whether the server at ``address`` maps this process's shared memory (probed once;
        False where shared memory is off or unavailable)."""
        if self._shm is None:
            return False
        if address not in self._shm_ok:
            region = self._shared_memory_for(address, SHM_MIN_BYTES)
            if region is not None:
                self._shm.release(region)
        return bool(self._shm_ok.get(address))

    def shared_region(self, address: str, nbytes: int):
        """A region of at least ``nbytes`` that the server at ``address`` maps (proved once per
        region), for one call; give it back with ``release_region``. None where the payload
        is under ``SHM_MIN_BYTES`` or the server cannot map this process's memory."""
        return self._shared_memory_for(address, nbytes)

    def release_region(self, region, answered: bool = True) -> None:
        """Give back a region of ``shared_region`` once its call ended: for the next call where
        the server answered it, else dropped (``ClientRegions.retire``: the server may still
        read or write it)."""
        assert self._shm is not None        # regions come from it
        if answered:
            self._shm.release(region)
        else:
            self._shm.retire(region)

    def forget_regions(self, address: str) -> None:
        """Prove regions to the server at ``address`` again before their next use (it no
        longer knows them: it restarted at the same address)."""
        self._shm_proved = {key for key in self._shm_proved if key[0] != address}

    def _shared_memory_for(self, address: str, nbytes: int):
        """A shared-memory region of ``nbytes`` for a call to ``address``, or None when the
        payload is small or the server cannot map our memory (another host or container).
        Each region is proved to each server once (the server binds it to this job)."""
        if self._shm is None or nbytes < SHM_MIN_BYTES or self._shm_ok.get(address) is False:
            return None
        region = self._shm.acquire(nbytes)
        if (address, region.name) in self._shm_proved:
            return region
        if self._probe_shared_memory(address, region):
            self._shm_proved.add((address, region.name))
            self._shm_ok[address] = True
            return region
        self._shm_ok[address] = False
        self._shm.release(region)
        return None

    def _probe_shared_memory(self, address: str, region) -> bool:
        nonce = os.urandom(16)
        region.view(0, 16)[:] = nonce
        try:
            resp = self.pool.get(address).ProbeSharedMemory(
                ps.ProbeSharedMemoryRequest(ref=pb.SharedMemoryRef(name=region.name, offset=0, length=16),
                                            nonce=nonce, job=self.job), timeout=5.0, metadata=self.metadata)
        except grpc.RpcError:
            return False
        if not resp.usable:
            log.debug("shared memory with %s unusable: %s", address, resp.reason)
        return resp.usable


def collect(stream, server: str = "the server") -> tuple[ps.PullHeader, Payload]:
    """The header and payload of a Pull response stream (chunks decoded by
    ``codec.decode_chunk``). Raises Unavailable for a stream without exactly one header, or
    with one that does not decode."""
    header = None
    pieces = []
    for chunk in stream:
        if chunk.header is not None:
            if header is not None:
                raise Unavailable(f"malformed reply from {server}: the pull stream carried two headers")
            try:
                header = ps.PullHeader.FromString(chunk.header)
            except DecodeError as exc:
                raise Unavailable(f"malformed reply from {server}: pull header: {exc}") from None
        if len(chunk.data):
            pieces.append(chunk.data)
    if header is None:
        raise Unavailable(f"malformed reply from {server}: the pull stream ended without a header")
    return header, Payload(pieces)
