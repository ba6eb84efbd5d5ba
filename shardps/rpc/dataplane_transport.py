"""``DataPlaneTransport``: the data path's ``Transport`` over the socket data plane
(``shardps.rpc.dataplane``), gRPC where a server has none.

Each server is asked once for its data-plane address (``OpenDataPlane``, job-scoped, over
gRPC); then Push, Pull and Exchange go through a ``DataPlanePool``, with the same token in
the connection's HELLO and the same TLS certificates. A push's payload or a pull's reply of
``SHARED_BYTES`` or more to a server on this host that maps this process's memory (proved
over gRPC, ``ProbeSharedMemory``) travels through a shared-memory region named in the frame
(``frames.FLAG_SHARED``): written once, read in place, no bytes through the socket; a server
that does not offer that (``OpenDataPlaneResponse.shared_memory``) gets payloads of
``SHM_PREFERRED_BYTES`` or more over gRPC with shared memory. Their headers
travel in the packed form (``shardps.rpc.packed``) to servers that speak it
(``OpenDataPlaneResponse.packed``), as protobuf to the others. A server that answers
UNIMPLEMENTED or an empty address is served by the ``GrpcTransport`` given as ``fallback``
from then on; a data-plane call that fails with ``Unavailable`` forgets the address (a
restarted server listens on another port) and the data path's retry asks again.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from shardps.errors import InvalidArgument, Unavailable, UnknownRegion
from shardps.messages import PullRequest, PushAck, PushRequest
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.rpc import messages, packed, step, step_reply
from shardps.rpc.codec import byte_view, write_into
from shardps.rpc.dataplane import DataPlanePool
from shardps.rpc.dataplane_client import answered as server_answered
from shardps.rpc.frames import FLAG_PACKED, FLAG_SHARED, METHOD_IDS
from shardps.rpc.grpc_transport import SERVICE, GrpcTransport
from shardps.rpc.payload import Payload
from shardps.rpc.status import from_rpc_error

log = logging.getLogger("shardps.client")
# Payloads this large go through shared memory (the gRPC transport's same-host path) where the
# server maps this process's memory: one copy instead of two through the loopback socket.
SHM_PREFERRED_BYTES = 4 << 20
# Push payloads and pull replies this large go through shared memory within the data plane's
# own frames where the server offers it: one copy into the region instead of two through the
# loopback socket. Measured (rows x 64 float32, pull + push): 128 KB 1.12 ms through the region
# against 0.99 through the socket, 256 KB 1.04 against 1.26, 512 KB 1.29 against 1.44
SHARED_BYTES = 256 << 10
# A Step frame's payload and reply values this large together go through a region: the frame
# is written in place either way, and the server reads and writes the region in place
STEP_SHARED_BYTES = 32 << 10
_STEP = METHOD_IDS["Step"]
T = TypeVar("T")


@dataclass(frozen=True)
class _Plane:
    """A server's data plane: its address ("" where it has none) and whether it reads
    packed headers."""

    address: str
    packed: bool = False
    shared: bool = False            # takes bulk bytes in shared memory (frames.FLAG_SHARED)
    step: bool = False              # takes Step frames (shardps.rpc.step)


_NONE = _Plane("")              # cached: this server has no data plane


def _nbytes(buffers) -> int:
    return sum(b.nbytes if isinstance(b, np.ndarray) else byte_view(b).nbytes for b in buffers)


def _decoded(server: str, decode: Callable[[bytes], T], raw: bytes) -> T:
    """``decode(raw)`` of a server's reply header; one that does not decode is the server's
    fault, not the caller's: Unavailable (retried), not InvalidArgument."""
    try:
        return decode(raw)
    except InvalidArgument as exc:
        raise Unavailable(f"malformed reply from {server}: {exc.message}") from None
    except DecodeError as exc:
        raise Unavailable(f"malformed reply from {server}: {exc}") from None


class DataPlaneTransport:
    """``Transport`` (``shardps.worker.client.transport``) over the data plane. Thread-safe."""

    def __init__(self, job: str, fallback: GrpcTransport, *, tls=None, metadata=(),
                 connections_per_address: int = 4):
        self.job = job
        self.fallback = fallback
        self.metadata = tuple(metadata)
        self.pool = DataPlanePool.for_tls(tls, connections_per_address=connections_per_address,
                                          metadata=self.metadata)
        self._lock = threading.Lock()
        self._planes: dict[str, _Plane] = {}        # gRPC address -> its data plane

    # --- Transport ---
    def push(self, server, address, request: PushRequest, timeout) -> PushAck:
        plane = self._plane(address, timeout)
        payload = list(request.payload)
        nbytes = _nbytes(payload)
        region = self._region(plane, address, nbytes)
        if region is not None:
            answered = False
            try:
                write_into(region.view(0, nbytes), payload)
                ack = self._call(plane, address, "Push", packed.shared_region(region.name, 0, nbytes)
                                 + packed.push(request, nbytes), [], timeout,
                                 lambda raw, _: _decoded(server, packed.read_push_ack, raw), FLAG_SHARED)
                answered = True
                return ack
            except UnknownRegion:
                answered = True
                self.fallback.forget_regions(address)     # see _region; then through the socket
            except BaseException as exc:
                answered = server_answered(exc)
                raise
            finally:
                self.fallback.release_region(region, answered)
        if not plane.address or (nbytes >= SHM_PREFERRED_BYTES and self.fallback.shares_memory_with(address)):
            return self.fallback.push(server, address, request, timeout)
        if plane.packed:
            return self._call(plane, address, "Push", packed.push(request, nbytes), payload, timeout,
                              lambda raw, _: _decoded(server, packed.read_push_ack, raw))
        head = messages.push_header(request, nbytes).SerializeToString()
        return self._call(plane, address, "Push", head, payload, timeout,
                          lambda raw, _: messages.push_ack_plain(_decoded(server, ps.PushAck.FromString, raw)))

    def pull(self, server, address, request: PullRequest, reply_bytes, timeout, consume):
        plane = self._plane(address, timeout)
        ids = list(request.ids) if request.ids else []      # the ids travel raw, beside the header
        region = self._region(plane, address, reply_bytes or 0)
        if region is not None:
            def placed(head: bytes, view: memoryview):
                reply = _decoded(server, packed.read_pull_reply, head)
                if not reply.in_shared_memory:
                    return consume(reply, Payload([view]))
                if reply.payload_bytes > region.size:
                    raise Unavailable(f"malformed reply from {server}: {reply.payload_bytes} bytes in a "
                                      f"shared-memory region of {region.size}")
                return consume(reply, Payload([region.view(0, reply.payload_bytes)]))
            answered = False
            try:
                got = self._call(plane, address, "Pull", packed.shared_region(region.name, 0, region.size)
                                 + packed.pull(request), ids, timeout, placed, FLAG_SHARED)
                answered = True
                return got
            except UnknownRegion:
                answered = True
                self.fallback.forget_regions(address)     # see _region; then through the socket
            except BaseException as exc:
                answered = server_answered(exc)
                raise
            finally:
                self.fallback.release_region(region, answered)
        big = (reply_bytes or 0) >= SHM_PREFERRED_BYTES
        if not plane.address or (big and self.fallback.shares_memory_with(address)):
            return self.fallback.pull(server, address, request, reply_bytes, timeout, consume)
        if plane.packed:
            def use(head: bytes, view: memoryview):
                return consume(_decoded(server, packed.read_pull_reply, head), Payload([view]))
            return self._call(plane, address, "Pull", packed.pull(request), ids, timeout, use)

        def use_proto(head: bytes, view: memoryview):
            return consume(messages.pull_reply_plain(_decoded(server, ps.PullHeader.FromString, head)),
                           Payload([view]))
        return self._call(plane, address, "Pull", messages.pull_message(request).SerializeToString(), ids,
                          timeout, use_proto)

    def exchange_start(self, server, address, push: PushRequest, pull: PullRequest, timeout) -> object | None:
        """Send an Exchange (push then pull in one round trip) and return at once, with what
        ``exchange_finish`` (which must follow, on any thread) needs to read the reply; None
        where the server has no data plane (nothing was sent: the caller then sends a Push
        and a Pull). Raises as ``push``."""
        plane = self._plane(address, timeout)
        if not plane.address:
            return None
        payload = list(push.payload)
        nbytes = _nbytes(payload)
        ids = list(pull.ids) if pull.ids else []
        if plane.packed:
            head = packed.exchange(push, nbytes, pull)
        else:
            head = ps.ExchangeHeader(push=messages.push_header(push, nbytes),
                                     pull=messages.pull_message(pull)).SerializeToString()
        started = time.perf_counter()
        with self._observed(address, "Exchange", started, only_failures=True):
            return (server, address, started, plane.packed,
                    self.pool.start(plane.address, "Exchange", head, payload + ids, timeout=timeout,
                                    flags=FLAG_PACKED if plane.packed else 0))

    def exchange_finish(self, started, consume):
        """Read the reply of ``exchange_start``'s request, ``consume(ack, pull reply,
        payload)`` it and return its result."""
        server, address, began, packed_form, sent = started

        def use(raw: bytes, view: memoryview):
            if packed_form:
                ack, reply = _decoded(server, packed.read_exchange_reply, raw)
            else:
                both = _decoded(server, ps.ExchangeReply.FromString, raw)
                ack, reply = messages.push_ack_plain(both.ack), messages.pull_reply_plain(both.pull)
            return consume(ack, reply, Payload([view]))
        with self._observed(address, "Exchange", began):
            return self.pool.finish(sent, use)

    def step_start(self, server, address, encoded: step.Encoded, reply_bytes: int, timeout,
                   into: np.ndarray | None = None) -> object | None:
        """Send ``encoded`` (a client's request, laid out) as a Step frame and return at
        once with what ``step_finish`` (which must follow, on any thread) needs; None where
        the server takes no Step frames (nothing was sent). The payload and the reply's
        values (``reply_bytes``) travel in a shared-memory region where the server maps this
        process's memory and they are ``STEP_SHARED_BYTES`` or more together, else in the
        frames; there, the reply's values are received straight into ``into`` (writable,
        ``reply_bytes`` long) when it is given, and ``step_finish``'s values are its views.
        Raises as ``push``."""
        plane = self._plane(address, timeout)
        if not plane.step:
            return None
        nbytes = encoded.payload_bytes
        reply_at = step.pad8(nbytes)
        region = self._region(plane, address, reply_at + reply_bytes, STEP_SHARED_BYTES)
        reply_into = None
        if region is not None:
            encoded.write(np.frombuffer(region.mm, np.uint8, nbytes))
            head, parts = encoded.header(region.name, 0, reply_at, region.size - reply_at), []
        else:
            head, parts = encoded.header(), encoded.parts()
            if into is not None:
                reply_into = byte_view(into)          # the same memory: into is contiguous
        started = time.perf_counter()
        try:
            sent = self.pool.start(plane.address, _STEP, head, parts, timeout=timeout, flags=FLAG_PACKED,
                                   reply_into=reply_into)
        except BaseException as exc:
            self._step_failed(address, exc, started)
            if region is not None:          # the frame may have gone out: the server may use it
                self.fallback.release_region(region, False)
            raise
        return server, address, started, sent, encoded, region

    def step_finish(self, started, consume):
        """Read the reply of ``step_start``'s request and return ``consume(ack, pull reply,
        elements, values)``: ``elements`` the values each pull segment returned, ``values``
        all of them, flat float32 one segment after another, valid while ``consume`` runs."""
        server, address, began, sent, encoded, region = started
        tables, n_push = encoded.tables, encoded.n_push

        def use(raw: bytes, view: memoryview):
            ack, reply, elements, shared = _decoded(
                server, lambda b: step_reply.read_reply(b, tables, n_push, len(tables) - n_push), raw)
            total = 4 * sum(elements)
            if shared:
                if region is None or total > region.size:
                    raise Unavailable(f"malformed reply from {server}: {total} bytes of values in a shared-memory "
                                      f"region it was not given")
                source = np.frombuffer(region.mm, np.float32, total // 4, step.pad8(encoded.payload_bytes))
            else:
                if total != len(view):
                    raise Unavailable(f"malformed reply from {server}: {len(view)} payload bytes for {total} bytes "
                                      f"of values")
                source = np.frombuffer(view, np.float32, total // 4)
            return consume(ack, reply, elements, source)
        answered = False
        try:
            got = self.pool.finish(sent, use)
            answered = True
        except UnknownRegion:
            answered = True
            self.fallback.forget_regions(address)
            exc = Unavailable(f"Step to {server}: the server no longer knows this client's shared memory "
                              f"(restarted): retry")
            self._step_failed(address, exc, began)
            raise exc from None
        except BaseException as exc:
            answered = server_answered(exc)
            self._step_failed(address, exc, began)
            raise
        finally:
            if region is not None:          # retired unless answered: see ClientRegions.retire
                self.fallback.release_region(region, answered)
        self.fallback.metrics.observe_call(SERVICE, "Step", "OK", time.perf_counter() - began)
        return got

    def _step_failed(self, address: str, exc: BaseException, started: float) -> None:
        """A Step that failed: counted (batched), and the server's data-plane address
        forgotten when it was unavailable (it may have restarted elsewhere)."""
        if isinstance(exc, Unavailable):
            with self._lock:
                self._planes.pop(address, None)
        self.fallback.metrics.observe_call(SERVICE, "Step", getattr(exc, "code", "UNKNOWN"),
                                           time.perf_counter() - started)

    def abandon(self, address: str) -> None:
        """Close the data-plane connections to the server at gRPC ``address`` (calls in
        flight on them fail with Unavailable at once) and forget its data-plane address."""
        with self._lock:
            plane = self._planes.pop(address, None)
        if plane is not None and plane.address:
            self.pool.abandon(plane.address)
        self.fallback.abandon(address)

    def close(self) -> None:
        self.pool.close()
        self.fallback.close()

    # --- internals ---
    def _region(self, plane: _Plane, address: str, nbytes: int, threshold: int = SHARED_BYTES):
        """A shared-memory region for ``nbytes`` of bulk bytes to this server, or None (below
        ``SHARED_BYTES``, no such data plane, or another host). A call through it that the
        server answers with ``UnknownRegion`` (restarted at the same address, it knows none of
        this client's regions) is sent again through the socket, and this server's regions are
        proved again before their next use."""
        if not plane.shared or nbytes < threshold:
            return None
        return self.fallback.shared_region(address, nbytes)

    def _call(self, plane: _Plane, address: str, method: str, head: bytes, buffers: list, timeout, consume,
              flags: int = 0):
        with self._observed(address, method, time.perf_counter()):
            flags |= FLAG_PACKED if plane.packed else 0
            return self.pool.call(plane.address, method, head, buffers, timeout=timeout, consume=consume,
                                  flags=flags)

    @contextlib.contextmanager
    def _observed(self, address: str, method: str, started: float, only_failures: bool = False):
        """Count the call in the client's metrics (``only_failures``: unless it succeeds) and
        forget the server's data-plane address when the call finds it unavailable."""
        code = "OK"
        try:
            yield
        except Unavailable:
            code = "UNAVAILABLE"
            with self._lock:
                self._planes.pop(address, None)      # ask again: it may have restarted
            raise
        except Exception as exc:
            code = getattr(exc, "code", "UNKNOWN")
            raise
        finally:
            if code != "OK" or not only_failures:
                self.fallback.observe(method, "dataplane", code, started)

    def _plane(self, address: str, timeout: float) -> _Plane:
        """The data plane of the server at gRPC ``address`` (address "" where it has none)."""
        known = self._planes.get(address)        # a dict read: atomic
        if known is not None:
            return known
        try:
            call = self.fallback.pool.get(address).OpenDataPlane.future(
                ps.OpenDataPlaneRequest(job=self.job), timeout=min(timeout, 5.0), metadata=self.metadata)
            resp = self.fallback.in_flight.wait(address, call, f"OpenDataPlane on {address}")
            found = (_Plane(resp.address, resp.packed, resp.packed and resp.shared_memory, resp.packed and resp.step)
                     if resp.address else _NONE)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.CANCELLED:     # abandoned: declared dead
                raise from_rpc_error(err, f"OpenDataPlane on {address}") from None
            if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                return _NONE                # not now (starting, unreachable): gRPC this time
            found = _NONE
        with self._lock:
            self._planes[address] = found
        if not found.address:
            log.info("server at %s has no data plane: gRPC it is", address)
        return found
