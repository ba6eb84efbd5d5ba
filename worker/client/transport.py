"""The per-server transport of the data path: one Push or one Pull to one server.

``Transport`` is the interface ``DataPath`` (``data.py``) sends through; it knows nothing of
routing, retries or shard maps. ``GrpcTransport`` is the implementation today: gRPC streams
of ``codec`` chunks, with the same-host shared-memory fast path (``shardps.rpc.shm``).

Adding the socket data plane (``shardps.rpc.dataplane``): write a second ``Transport`` here
that asks each server once for its data-plane address (``OpenDataPlane``, over the gRPC
stubs), sends through a ``DataPlanePool`` where a server has one and delegates to a
``GrpcTransport`` where it has not; then build it in ``PSClient.__init__`` (or pass it as
``PSClient(transport=...)``). Routing, retries and decoding do not change.

The messages are the wire contract both transports share: ``ps.PushHeader`` / ``ps.PushAck``
and ``ps.PullRequest`` / ``ps.PullHeader`` (parameter_server.proto); the bulk bytes travel
beside them, as buffers going out and as a ``Payload`` coming back.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Protocol, Sequence, TypeVar

import grpc

from shardps.errors import Unavailable
from shardps.metrics import WorkerMetrics, labelled
from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.rpc import shm
from shardps.rpc.codec import CHUNK_BYTES, encode_chunk, split_payload, write_into
from shardps.rpc.status import from_rpc_error
from shardps.rpc.stubs import SERVICE, InFlight, StubPool

log = logging.getLogger("shardps.client")
T = TypeVar("T")
SHM_MIN_BYTES = 32 << 10       # payloads this large go through shared memory when possible


class Payload:
    """The data of a pull response as the buffers that carried it, read in order without
    assembling them first: a read inside one buffer is zero-copy, ``read_into`` copies
    pieces straight into the caller's array. Not thread-safe (one reader)."""

    def __init__(self, pieces: list):
        self.pieces = pieces
        self.total = sum(len(p) for p in pieces)
        self._i = 0
        self._pos = 0
        self.consumed = 0

    def __len__(self) -> int:
        return self.total

    def read(self, n: int):
        """The next ``n`` bytes (a memoryview; a copy only when they span two buffers)."""
        if n == 0:
            return memoryview(b"")
        piece = self.pieces[self._i] if self._i < len(self.pieces) else memoryview(b"")
        if self._pos + n <= len(piece):
            out = piece[self._pos:self._pos + n]
            self._advance(n)
            return out
        out = bytearray(n)
        self.read_into(memoryview(out))
        return memoryview(out)

    def read_into(self, dest: memoryview) -> None:
        """Fill ``dest`` with the next bytes; raises Unavailable if the payload is short."""
        filled, n = 0, len(dest)
        while filled < n:
            if self._i >= len(self.pieces):
                raise Unavailable(f"pull payload ended {n - filled} bytes short")
            piece = self.pieces[self._i]
            take = min(n - filled, len(piece) - self._pos)
            dest[filled:filled + take] = piece[self._pos:self._pos + take]
            filled += take
            self._advance(take)

    def _advance(self, n: int) -> None:
        self._pos += n
        self.consumed += n
        while self._i < len(self.pieces) and self._pos >= len(self.pieces[self._i]):
            self._pos -= len(self.pieces[self._i])
            self._i += 1


class Transport(Protocol):
    """One call to one server. Implementations are thread-safe (calls run in parallel, one
    per server), block until the reply or ``timeout`` seconds, and raise ``ShardpsError``
    (``StaleEpoch`` and ``Unavailable`` make the data path re-route; never ``grpc.RpcError``).
    ``server`` is the server's name (for messages), ``address`` where to reach it."""

    def push(self, server: str, address: str, header: ps.PushHeader, payload: Sequence,
             timeout: float) -> ps.PushAck:
        """Send ``header`` (segments and ``payload_bytes`` filled in) and ``payload`` (numpy
        arrays or buffers, concatenated in order on the wire); return the server's ack. The
        transport may set its own fields of ``header`` (``shared_memory``)."""

    def pull(self, server: str, address: str, request: ps.PullRequest, reply_bytes: int | None,
             timeout: float, consume: Callable[[ps.PullHeader, Payload], T]) -> T:
        """Send ``request``; call ``consume(reply header, reply payload)`` while the reply's
        buffers are valid (they may be reused after it returns) and return its result.
        ``reply_bytes``: the payload size the caller expects, None when unknown."""

    def abandon(self, address: str) -> None:
        """Make the calls in flight to the server at ``address`` fail now with
        ``Unavailable`` (the data path re-routes them): the shard map declared that server
        dead, so a reply it might still send no longer matters. A transport may do nothing
        (its calls then end at their attempt timeout)."""

    def close(self) -> None:
        """Release connections and buffers; calls in flight may fail."""


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

    def push(self, server, address, header, payload, timeout):
        arrays = list(payload)
        region = self._shared_memory_for(address, header.payload_bytes)
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
        try:
            call = self.pool.get(address).Push.future(chunks(), timeout=timeout, metadata=self.metadata)
            return self.in_flight.wait(address, call, f"push to {server}")
        except grpc.RpcError as err:
            code = err.code().name
            raise from_rpc_error(err, f"push to {server}") from None
        finally:
            if region is not None:
                self._shm.release(region)
            self.observe("Push", "client_stream", code, started)

    def pull(self, server, address, request, reply_bytes, timeout, consume):
        region = self._shared_memory_for(address, reply_bytes) if reply_bytes else None
        if region is not None:
            request.reply_shared_memory.name = region.name
            request.reply_shared_memory.length = region.size
        started = time.perf_counter()
        code = "OK"
        payload = None
        try:
            stream = self.pool.get(address).Pull(request, timeout=timeout, metadata=self.metadata)
            with self.in_flight.tracking(address, stream):
                head, payload = collect(stream)
            if head.in_shared_memory:
                payload = Payload([region.view(0, head.payload_bytes)])
            return consume(head, payload)
        except grpc.RpcError as err:
            code = err.code().name
            raise from_rpc_error(err, f"pull from {server}") from None
        finally:
            payload = None                  # drop views of the region before releasing it
            if region is not None:
                self._shm.release(region)
            self.observe("Pull", "server_stream", code, started)

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


def collect(stream) -> tuple[ps.PullHeader, Payload]:
    """The header and payload of a Pull response stream (chunks decoded by
    ``codec.decode_chunk``). Raises Unavailable for a stream without exactly one header."""
    header = None
    pieces = []
    for chunk in stream:
        if chunk.header is not None:
            if header is not None:
                raise Unavailable("pull stream carried two headers")
            header = ps.PullHeader.FromString(chunk.header)
        if len(chunk.data):
            pieces.append(chunk.data)
    if header is None:
        raise Unavailable("pull stream ended without a header")
    return header, Payload(pieces)
