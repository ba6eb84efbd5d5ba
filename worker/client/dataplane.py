"""``Transport`` over the socket data plane (``shardps.rpc.dataplane``), gRPC where a server has
none.

Each server is asked once for its data-plane address (``OpenDataPlane``, job-scoped, over
gRPC); then Push, Pull and Exchange go through a ``DataPlanePool`` (payloads of
``SHM_PREFERRED_BYTES`` or more to a server on this host go through shared memory instead) (the same token in the
connection's HELLO, the same TLS certificates). A server that answers UNIMPLEMENTED or an
empty address is served by the ``GrpcTransport`` given as ``fallback`` from then on; a
data-plane call that fails with ``Unavailable`` forgets the address (a restarted server
listens on another port) and the data path's retry asks again.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import grpc

from shardps.errors import Unavailable
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.rpc.dataplane import DataPlanePool, client_ssl_context
from shardps.rpc.status import from_rpc_error
from shardps.worker.client.transport import GrpcTransport, Payload

log = logging.getLogger("shardps.client")
_NONE = ""                      # cached: this server has no data plane
# Payloads this large go through shared memory (the gRPC transport's same-host path) where the
# server maps this process's memory: one copy instead of two through the loopback socket.
SHM_PREFERRED_BYTES = 4 << 20


class DataPlaneTransport:
    """``Transport`` (see ``transport.py``) over the data plane. Thread-safe."""

    def __init__(self, job: str, fallback: GrpcTransport, *, tls=None, metadata=(),
                 connections_per_address: int = 4):
        self.job = job
        self.fallback = fallback
        self.metadata = tuple(metadata)
        self.pool = DataPlanePool(client_ssl_context(tls) if tls is not None else None,
                                  server_hostname=getattr(tls, "server_name_override", "") or None,
                                  connections_per_address=connections_per_address,
                                  metadata=self.metadata)
        self._lock = threading.Lock()
        self._addresses: dict[str, str] = {}        # gRPC address -> data-plane address

    # --- Transport ---
    def push(self, server, address, header, payload, timeout):
        dp = self._address(address, timeout)
        if not dp or (header.payload_bytes >= SHM_PREFERRED_BYTES and self.fallback.shares_memory_with(address)):
            return self.fallback.push(server, address, header, payload, timeout)
        raw = self._call(dp, address, "Push", header.SerializeToString(), list(payload), timeout,
                         None, server)
        return ps.PushAck.FromString(raw)

    def pull(self, server, address, request, reply_bytes, timeout, consume):
        dp = self._address(address, timeout)
        if not dp or ((reply_bytes or 0) >= SHM_PREFERRED_BYTES and self.fallback.shares_memory_with(address)):
            return self.fallback.pull(server, address, request, reply_bytes, timeout, consume)
        ids, request.data = request.data, b""        # the ids travel raw, beside the header

        def use(head: bytes, view: memoryview):
            return consume(ps.PullHeader.FromString(head), Payload([view]))
        return self._call(dp, address, "Pull", request.SerializeToString(), [ids] if ids else [],
                          timeout, use, server)

    def exchange_start(self, server, address, push: ps.PushHeader, payload, pull: ps.PullRequest,
                       timeout) -> tuple | None:
        """Send an Exchange (push then pull in one round trip) and return at once, with what
        ``exchange_finish`` (which must follow, on any thread) needs to read the reply; None
        where the server has no data plane (nothing was sent: the caller then sends a Push
        and a Pull). Raises as ``push``."""
        dp = self._address(address, timeout)
        if not dp:
            return None
        ids, pull.data = pull.data, b""
        head = ps.ExchangeHeader(push=push, pull=pull).SerializeToString()
        buffers = list(payload) + ([ids] if ids else [])
        started = time.perf_counter()
        with self._observed(address, "Exchange", started, only_failures=True):
            return address, started, self.pool.start(dp, "Exchange", head, buffers, timeout=timeout)

    def exchange_finish(self, started: tuple, consume):
        """Read the reply of ``exchange_start``'s request, ``consume(ack, pull header,
        payload)`` it and return its result."""
        address, began, sent = started

        def use(raw: bytes, view: memoryview):
            reply = ps.ExchangeReply.FromString(raw)
            return consume(reply.ack, reply.pull, Payload([view]))
        with self._observed(address, "Exchange", began):
            return self.pool.finish(sent, use)

    def abandon(self, address: str) -> None:
        """Close the data-plane connections to the server at gRPC ``address`` (calls in
        flight on them fail with Unavailable at once) and forget its data-plane address."""
        with self._lock:
            dp = self._addresses.pop(address, None)
        if dp:
            self.pool.abandon(dp)
        self.fallback.abandon(address)

    def close(self) -> None:
        self.pool.close()
        self.fallback.close()

    # --- internals ---
    def _call(self, dp: str, address: str, method: str, head: bytes, buffers: list, timeout,
              consume, server: str):
        with self._observed(address, method, time.perf_counter()):
            if consume is None:
                raw, _ = self.pool.call(dp, method, head, buffers, timeout=timeout)
                return raw
            return self.pool.call(dp, method, head, buffers, timeout=timeout, consume=consume)

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
                self._addresses.pop(address, None)      # ask again: it may have restarted
            raise
        except Exception as exc:
            code = getattr(exc, "code", "UNKNOWN")
            raise
        finally:
            if code != "OK" or not only_failures:
                self.fallback.observe(method, "dataplane", code, started)

    def _address(self, address: str, timeout: float) -> str:
        """The data-plane address of the server at gRPC ``address`` ("" where it has none)."""
        with self._lock:
            known = self._addresses.get(address)
        if known is not None:
            return known
        try:
            call = self.fallback.pool.get(address).OpenDataPlane.future(
                ps.OpenDataPlaneRequest(job=self.job), timeout=min(timeout, 5.0), metadata=self.metadata)
            found = self.fallback.in_flight.wait(address, call, f"OpenDataPlane on {address}").address
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.CANCELLED:     # abandoned: declared dead
                raise from_rpc_error(err, f"OpenDataPlane on {address}") from None
            if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                return _NONE                # not now (starting, unreachable): gRPC this time
            found = _NONE
        with self._lock:
            self._addresses[address] = found
        if not found:
            log.info("server at %s has no data plane: gRPC it is", address)
        return found
