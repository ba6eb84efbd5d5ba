"""The per-server transport of the data path: one Push, Pull or Exchange to one server.

``Transport`` is the interface ``DataPath`` (``data.py``) sends through; it knows nothing of
routing, retries or shard maps, and the data path knows nothing of the wire: requests and
replies are the plain values of ``shardps.messages`` (``PushRequest`` / ``PushAck``,
``PullRequest`` / ``PullReply``), the bulk bytes travel beside them, as buffers going out and
as a ``Payload`` coming back. The implementations live with the rest of the wire in
``shardps.rpc``: ``GrpcTransport`` (gRPC streams, with the same-host shared-memory path) and
``DataPlaneTransport`` (the socket data plane, gRPC where a server has none); ``PSClient``
builds them, or takes another as ``PSClient(transport=...)``.
"""

from __future__ import annotations

from typing import Callable, Protocol, TypeVar

import numpy as np

from shardps.messages import PullReply, PullRequest, PushAck, PushRequest
from shardps.rpc.grpc_transport import GrpcTransport
from shardps.rpc.payload import Payload
from shardps.rpc.step import Encoded

T = TypeVar("T")

__all__ = ["GrpcTransport", "Payload", "Transport"]


class Transport(Protocol):
    """One call to one server. Implementations are thread-safe (calls run in parallel, one
    per server), block until the reply or ``timeout`` seconds, and raise ``ShardpsError``
    (``StaleEpoch`` and ``Unavailable`` make the data path re-route; never ``grpc.RpcError``).
    ``server`` is the server's name (for messages), ``address`` where to reach it.

    Requests carry their bulk bytes as lists of buffers (numpy arrays): a push's
    ``payload`` (concatenated in order on the wire) and a pull's ``ids`` (its sparse
    segments' int64 ids, in segment order)."""

    def push(self, server: str, address: str, request: PushRequest, timeout: float) -> PushAck:
        """Send ``request``; return the server's acknowledgement."""

    def pull(self, server: str, address: str, request: PullRequest, reply_bytes: int | None,
             timeout: float, consume: Callable[[PullReply, Payload], T]) -> T:
        """Send ``request``; call ``consume(reply, reply payload)`` while the reply's buffers
        are valid (they may be reused after it returns) and return its result.
        ``reply_bytes``: the payload size the caller expects, None when unknown."""

    def exchange_start(self, server: str, address: str, push: PushRequest, pull: PullRequest,
                       timeout: float) -> object | None:
        """Send ``push`` then ``pull`` as one round trip (the server applies the push, then
        serves the pull) and return at once with what ``exchange_finish`` needs; None where
        this transport or server has no exchange (nothing was sent: the caller sends a push
        and a pull). Raises as ``push``."""

    def exchange_finish(self, started: object, consume: Callable[[PushAck, PullReply, Payload], T]) -> T:
        """Read the reply of ``exchange_start``'s request (which must be followed by this,
        on any thread), ``consume(ack, pull reply, payload)`` it and return its result."""

    def step_start(self, server: str, address: str, encoded: Encoded, reply_bytes: int,
                   timeout: float, into: np.ndarray | None = None) -> object | None:
        """Send a step's push and pull parts for this server (``encoded``: laid out by the
        caller, ``step.Encoded``, its arrays the caller's or the rows they pick;
        ``reply_bytes``: the pulled values' size) as one round
        trip, and return at once with what ``step_finish`` needs; None where this transport
        or server has no Step (nothing was sent: the caller sends a push and a pull).
        ``into``: where the pulled values belong, ``reply_bytes`` of contiguous memory, which
        a transport may receive them into directly (the values ``step_finish`` passes on are
        then views of it); it may also ignore it. Raises as ``push``."""

    def step_finish(self, started: object, consume: Callable[[PushAck, PullReply, tuple, np.ndarray], T]) -> T:
        """Read the reply of ``step_start``'s request (which must be followed by this, on any
        thread), ``consume(ack, pull reply, elements, values)`` it (``elements``: the values
        each pull segment returned; ``values``: all of them, flat float32 one segment after
        another, valid while ``consume`` runs) and return its result."""

    def abandon(self, address: str) -> None:
        """Make the calls in flight to the server at ``address`` fail now with
        ``Unavailable`` (the data path re-routes them): the shard map declared that server
        dead, so a reply it might still send no longer matters. A transport may do nothing
        (its calls then end at their attempt timeout)."""

    def close(self) -> None:
        """Release connections and buffers; calls in flight may fail."""
