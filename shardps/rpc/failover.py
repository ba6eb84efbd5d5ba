"""A gRPC channel to several manager replicas that follows the leader (``FailoverChannel``).

Given ``host:port,host:port,...`` (``channels.manager_channel``), the channel sends each call
to the replica it believes leads (the first address at first) and moves on when:

* a replica refuses the call as a follower: UNAVAILABLE with trailing metadata
  ``x-shardps-leader`` (``LeaderGate``, below, which ``server/manager/replica.py`` opens while
  it leads). A refused call was not executed, so it is sent again at once to the leader named
  (added to the addresses when it is new), or, while no leader is elected, after a short pause
  to the same replica (which learns the new leader as soon as it is elected); until the call's
  deadline.
* a replica cannot be reached (UNAVAILABLE without that metadata) or does not answer in time
  (DEADLINE_EXCEEDED: it hangs, or is cut off): the next call goes to the next address. The
  error is raised: the call may have been executed, and only the caller knows whether it may
  be sent again (``channels.call_with_retries`` does for idempotent calls, and the retry then
  reaches the next replica). Connection attempts to a replica are given up after
  ``channels.REPLICA_CONNECT_TIMEOUT_MS``.
* a call with ``wait_for_ready`` (the callers' way to say "send it once, when connected")
  finds its replica not connected within ``CONNECT_SECONDS``: it is tried on the next one
  (it was never sent), until its deadline.

Streaming calls go to the current replica, without retries. Thread-safe.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import grpc

LEADER_METADATA = "x-shardps-leader"     # LeaderGate sets it on refusals
CONNECT_SECONDS = 1.0                    # wait_for_ready: how long one replica may take to connect
REFUSED_PAUSE = 0.1                      # between tries while no leader is elected


def refused_by_follower(err: grpc.RpcError) -> str | None:
    """The leader named by a follower's refusal ("" while none is elected), or None when
    ``err`` is not such a refusal."""
    if not hasattr(err, "code") or err.code() != grpc.StatusCode.UNAVAILABLE:
        return None
    for key, value in (err.trailing_metadata() or ()) if hasattr(err, "trailing_metadata") else ():
        if key == LEADER_METADATA:
            return value if isinstance(value, str) else value.decode()
    return None


class LeaderGate(grpc.GenericRpcHandler):
    """The replicas' side (``server/manager/replica.py``): routes ``service``'s calls to the
    current term's handler; refuses them, naming the leader (``LEADER_METADATA``), when this
    replica does not lead. Calls of other services are not its business."""

    def __init__(self, service: str, leader_address: Callable[[], str]):
        self.prefix = f"/{service}/"
        self.leader_address = leader_address
        self.current: grpc.GenericRpcHandler | None = None

    def service(self, handler_call_details):
        method = handler_call_details.method
        if not method.startswith(self.prefix):
            return None
        current = self.current
        if current is not None:
            return current.service(handler_call_details)
        leader = self.leader_address()

        def refuse(request, context):
            context.set_trailing_metadata(((LEADER_METADATA, leader),))
            where = f"the leader is {leader}" if leader else "no leader is elected yet: retry shortly"
            context.abort(grpc.StatusCode.UNAVAILABLE, f"this manager is not the leader: {where}")

        if method.endswith("/WatchShardMap"):
            return grpc.unary_stream_rpc_method_handler(refuse)
        return grpc.unary_unary_rpc_method_handler(refuse)


class FailoverChannel(grpc.Channel):
    """One channel per replica, created on first use; calls go to ``current``."""

    def __init__(self, addresses: list[str], make_channel: Callable[[str], grpc.Channel], *,
                 clock=time.monotonic, sleep=time.sleep):
        if not addresses:
            raise ValueError("no manager address given")
        self.addresses = list(addresses)
        self._make = make_channel
        self._channels: dict[str, grpc.Channel] = {}
        self._current = self.addresses[0]
        self._lock = threading.Lock()
        self.clock = clock
        self.sleep = sleep

    @property
    def current(self) -> str:
        return self._current

    def channel(self, address: str) -> grpc.Channel:
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = self._make(address)
            return ch

    def follow(self, leader: str) -> None:
        """Send the next calls to ``leader`` (learned from a refusal)."""
        with self._lock:
            if leader not in self.addresses:
                self.addresses.append(leader)
            self._current = leader

    def rotate(self, failed: str) -> None:
        """``failed`` did not answer: the next calls go to the address after it."""
        with self._lock:
            if self._current == failed:
                i = self.addresses.index(failed) if failed in self.addresses else -1
                self._current = self.addresses[(i + 1) % len(self.addresses)]

    def connected(self, address: str, timeout: float) -> bool:
        try:
            grpc.channel_ready_future(self.channel(address)).result(timeout=timeout)
            return True
        except grpc.FutureTimeoutError:
            return False

    # ------------------------------------------------------------------ grpc.Channel
    def unary_unary(self, method, request_serializer=None, response_deserializer=None,
                    _registered_method=False):
        return _Unary(self, method, request_serializer, response_deserializer)

    def unary_stream(self, method, request_serializer=None, response_deserializer=None,
                     _registered_method=False):
        return _Stream(self, method, request_serializer, response_deserializer)

    def stream_unary(self, method, request_serializer=None, response_deserializer=None,
                     _registered_method=False):
        return self.channel(self._current).stream_unary(method, request_serializer, response_deserializer)

    def stream_stream(self, method, request_serializer=None, response_deserializer=None,
                      _registered_method=False):
        return self.channel(self._current).stream_stream(method, request_serializer, response_deserializer)

    def subscribe(self, callback, try_to_connect=False):
        self.channel(self._current).subscribe(callback, try_to_connect)

    def unsubscribe(self, callback):
        for ch in list(self._channels.values()):
            ch.unsubscribe(callback)

    def close(self):
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            ch.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        self.close()
        return False


class _Method:
    """One method of a ``FailoverChannel``: what a call needs to reach the current manager."""

    def __init__(self, owner: FailoverChannel, method, serializer, deserializer):
        self.owner = owner
        self.method = method
        self.serializer = serializer
        self.deserializer = deserializer


class _Unary(_Method, grpc.UnaryUnaryMultiCallable):
    def __call__(self, request, timeout=None, metadata=None, credentials=None, wait_for_ready=None,
                 compression=None):
        ch = self.owner
        deadline = None if timeout is None else ch.clock() + timeout
        refusals = 0
        while True:
            address = ch.current
            left = None if deadline is None else max(0.005, deadline - ch.clock())
            if wait_for_ready and len(ch.addresses) > 1 and not ch.connected(
                    address, CONNECT_SECONDS if left is None else min(left, CONNECT_SECONDS)):
                ch.rotate(address)              # never sent: try the next replica
                if deadline is not None and ch.clock() >= deadline:
                    raise _Timeout(f"no manager replica connected within {timeout:g}s "
                                   f"({', '.join(ch.addresses)})")
                continue
            call = ch.channel(address).unary_unary(self.method, self.serializer, self.deserializer)
            try:
                return call(request, timeout=left, metadata=metadata, credentials=credentials,
                            wait_for_ready=wait_for_ready, compression=compression)
            except grpc.RpcError as err:
                leader = refused_by_follower(err)
                if leader is None:
                    if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        ch.rotate(address)
                    raise
                refusals += 1
                if leader and leader != address:
                    ch.follow(leader)
                elif leader or refusals % 5 == 0:
                    # a follower that names itself, or that has known no leader for a while:
                    # ask another replica (a follower learns a new leader within 0.1 s)
                    ch.rotate(address)
                if deadline is not None and deadline - ch.clock() < REFUSED_PAUSE:
                    raise
                if deadline is None and refusals > 4 * len(ch.addresses):
                    raise
                if not leader or refusals > len(ch.addresses):
                    ch.sleep(REFUSED_PAUSE)     # an election is under way

    def with_call(self, request, timeout=None, metadata=None, credentials=None, wait_for_ready=None,
                  compression=None):
        call = self.owner.channel(self.owner.current).unary_unary(self.method, self.serializer,
                                                                   self.deserializer)
        return call.with_call(request, timeout, metadata, credentials, wait_for_ready, compression)

    def future(self, request, timeout=None, metadata=None, credentials=None, wait_for_ready=None,
               compression=None):
        call = self.owner.channel(self.owner.current).unary_unary(self.method, self.serializer,
                                                                   self.deserializer)
        return call.future(request, timeout, metadata, credentials, wait_for_ready, compression)


class _Stream(_Method, grpc.UnaryStreamMultiCallable):
    def __call__(self, request, timeout=None, metadata=None, credentials=None, wait_for_ready=None,
                 compression=None):
        call = self.owner.channel(self.owner.current).unary_stream(self.method, self.serializer,
                                                                    self.deserializer)
        return call(request, timeout=timeout, metadata=metadata, credentials=credentials,
                    wait_for_ready=wait_for_ready, compression=compression)


class _Timeout(grpc.RpcError, grpc.Call):
    """DEADLINE_EXCEEDED raised by the channel itself (no replica connected in time)."""

    def __init__(self, details: str):
        super().__init__(details)
        self._details = details

    def code(self):
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self):
        return self._details

    def trailing_metadata(self):
        return ()

    def initial_metadata(self):
        return ()

    def is_active(self):
        return False

    def time_remaining(self):
        return 0.0

    def cancel(self):
        return False

    def add_callback(self, callback):
        return False
