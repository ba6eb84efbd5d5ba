"""The one table that maps shardps errors to gRPC status codes, both ways, and the service
binder that wraps every handler with it (plus metrics and authentication).

Callers outside ``shardps.rpc`` never see a ``grpc.RpcError``: they make their calls inside
``with translated(what):`` and catch ``ShardpsError`` subclasses (``from_rpc_error``).

Servicer methods are plain functions ``fn(request, call) -> response`` that raise
``ShardpsError``; ``bind`` turns them into a grpc generic handler that aborts with the mapped
status code and the error's message, counts the call in ``grpc_server_*`` metrics and checks
credentials first. Unexpected exceptions become INTERNAL with the exception named (and logged
with its traceback).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import grpc
from google.protobuf.message import DecodeError

from shardps import errors
from shardps.errors import ShardpsError

log = logging.getLogger("shardps.rpc")

Handler = grpc.GenericRpcHandler      # what ``bind`` returns: the handlers of one service
_TO_GRPC = {cls: getattr(grpc.StatusCode, code) for code, cls in errors.ERRORS_BY_CODE.items()}
_FROM_GRPC = {getattr(grpc.StatusCode, code): cls for code, cls in errors.ERRORS_BY_CODE.items()}


def grpc_code(exc: ShardpsError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in _TO_GRPC:
            return _TO_GRPC[cls]
    return grpc.StatusCode.UNKNOWN


# What a failed call's status says about a wrong address or TLS setting, before any shardps
# code ran on the other side: (code, a piece of gRPC's details, the error it is, the advice).
# The first two are final (a retry meets the same process): no 30 s of retries.
_WRONG_PEER = (
    (grpc.StatusCode.UNIMPLEMENTED, "", errors.InvalidArgument,
     "{peer} answers gRPC but does not serve {what}: it is another kind of process (a server's address "
     "given as the manager's, or the reverse?). `shardps local` prints the manager's address; "
     "`shardps status` lists the servers'"),
    (grpc.StatusCode.UNAVAILABLE, "Failed parsing HTTP/2", errors.InvalidArgument,
     "{peer} answers HTTP/1, not gRPC: a metrics port (/metrics) or another web server? Give the "
     "process's gRPC address (--listen; `shardps local` prints the manager's)"),
    (grpc.StatusCode.UNAVAILABLE, "WRONG_VERSION_NUMBER", errors.InvalidArgument,
     "{peer} does not speak TLS and this client does: drop the client's TLS settings (--tls-ca, "
     "SHARDPS_TLS_*) or start the process with TLS"),
    (grpc.StatusCode.UNAVAILABLE, "Socket closed", errors.Unavailable,
     "{peer} closed the connection at once: a process that requires TLS (or a client certificate) "
     "closes it so for a client without one; check both sides' TLS settings (--tls-*), or whether "
     "it is restarting"),
)


def from_rpc_error(err: grpc.RpcError, what: str, peer: str = "") -> ShardpsError:
    """Translate a failed call into a shardps error whose message says what failed (and, for
    a wrong address or TLS setting, what is likely wrong: ``peer`` names the other side, such
    as "the manager at host:port")."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    cls = _FROM_GRPC.get(code, errors.Internal)
    named = errors.ERRORS_BY_NAME.get(_wire_name(err) or "")
    if named is not None and named.code == code.name:
        cls = named                  # the subclass the server raised (e.g. StaleEpoch)
    if code == grpc.StatusCode.CANCELLED:
        # not cancelled by us: the peer is stopping, or cut a stalled stream; retry elsewhere
        cls = errors.Unavailable
    advice = ""
    if code == grpc.StatusCode.UNAVAILABLE:
        advice = " (is the process at that address running and reachable?)"
    for wrong_code, sign, wrong_cls, says in _WRONG_PEER:
        if code == wrong_code and sign in str(details) and named is None:
            cls = wrong_cls
            advice = " (" + says.format(peer=peer or "the process at that address", what=what) + ")"
            break
    exc = cls(f"{what}: {code.name}: {details}{advice}")
    exc.status, exc.details = code.name, str(details)
    return exc


@contextlib.contextmanager
def translated(what: str, peer: str = "") -> Iterator[None]:
    """Run the block's gRPC calls with their failures as shardps errors: a ``grpc.RpcError``
    raised in the block (by a call, or while iterating a server-streaming reply) leaves it
    as ``from_rpc_error(err, what, peer)``, raised from None. Other exceptions pass unchanged."""
    try:
        yield
    except grpc.RpcError as err:
        raise from_rpc_error(err, what, peer) from None


def _wire_name(err: grpc.RpcError) -> str | None:
    """The error class name the server sent in trailing metadata, if any."""
    try:
        trailing = err.trailing_metadata() or ()
    except Exception:            # an RpcError raised before any response has none
        return None
    for key, value in trailing:
        if key == errors.WIRE_KEY:
            return value
    return None


def abort(context: grpc.ServicerContext, exc: ShardpsError) -> None:
    """Abort the call with ``exc``'s status code, message and class name (trailing metadata)."""
    context.set_trailing_metadata(((errors.WIRE_KEY, type(exc).__name__),))
    context.abort(grpc_code(exc), exc.message)


@dataclass
class Call:
    """What a handler knows about its call besides the request."""

    context: grpc.ServicerContext
    principal: Any
    deadline: float | None      # time.monotonic() deadline, None when the caller set none
    method: str

    def metadata(self) -> dict[str, str]:
        return {k: v for k, v in (self.context.invocation_metadata() or ())}


@dataclass(frozen=True)
class Method:
    kind: str                    # unary_unary | unary_stream | stream_unary | stream_stream
    fn: Callable
    request_deserializer: Callable
    response_serializer: Callable
    idle_ok: bool = False        # a stream that may legitimately stay quiet (watches)


class StreamWatchdog:
    """Cancels streaming calls that stall: no message for ``idle_seconds`` in either
    direction, or running longer than ``max_seconds`` (a client that sets no deadline, stops
    sending mid-stream or stops reading cannot hold a server thread forever). Thread-safe."""

    def __init__(self, idle_seconds: float = 30.0, max_seconds: float = 3600.0):
        self.idle_seconds = idle_seconds
        self.max_seconds = max_seconds
        self._lock = threading.Lock()
        self._calls: dict[int, list] = {}          # id -> [context, started, last activity, name]
        self._thread: threading.Thread | None = None
        self.cancelled = 0

    def watch(self, context, name: str) -> int:
        now = time.monotonic()
        with self._lock:
            key = id(context)
            self._calls[key] = [context, now, now, name]
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="stream-watchdog", daemon=True)
                self._thread.start()
        return key

    def touch(self, key: int) -> None:
        entry = self._calls.get(key)
        if entry is not None:
            entry[2] = time.monotonic()

    def release(self, key: int) -> None:
        with self._lock:
            self._calls.pop(key, None)

    def _loop(self) -> None:
        while True:
            time.sleep(min(1.0, self.idle_seconds / 4))
            now = time.monotonic()
            with self._lock:
                stale = [(k, e) for k, e in self._calls.items()
                         if now - e[2] > self.idle_seconds or now - e[1] > self.max_seconds]
                for k, _ in stale:
                    del self._calls[k]
            for _, (context, started, last, name) in stale:
                self.cancelled += 1
                log.warning("cancelling %s: stream idle for %.0fs (running %.0fs)", name, now - last,
                            now - started)
                context.cancel()


def _watched(iterator, watchdog: StreamWatchdog | None, key: int):
    for item in iterator:
        if watchdog is not None:
            watchdog.touch(key)
        yield item


class _Outcome:
    code = "OK"


@contextlib.contextmanager
def _outcome(context: grpc.ServicerContext, full: str, result: _Outcome):
    """Map what a handler raised to its status code (recorded in ``result.code``) and abort
    the call with it; unexpected exceptions become INTERNAL, logged with their traceback."""
    try:
        yield
    except ShardpsError as exc:
        result.code = grpc_code(exc).name
        abort(context, exc)
    except DecodeError as exc:                   # a request that is not the message it claims
        result.code = "INVALID_ARGUMENT"
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"{full}: the request does not decode as its protobuf message ({exc})")
    except Exception as exc:
        if context.code() is not None:           # aborted by grpc itself
            result.code = context.code().name
            raise
        if not context.is_active():              # cancelled (by the client or the watchdog)
            result.code = "CANCELLED"
            raise
        result.code = "INTERNAL"
        log.exception("internal error in %s", full)
        context.abort(grpc.StatusCode.INTERNAL, f"internal error in {full}: {type(exc).__name__}: {exc}")


_GRPC_TYPE = {"unary_unary": "unary", "unary_stream": "server_stream",
              "stream_unary": "client_stream", "stream_stream": "bidi_stream"}


def _deadline(context: grpc.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    if remaining is None or remaining > 1e8:
        return None
    return time.monotonic() + remaining


def bind(service: str, methods: dict[str, Method], metrics=None,
         authenticate: Callable[[str, grpc.ServicerContext], Any] | None = None,
         watchdog: StreamWatchdog | None = None) -> grpc.GenericRpcHandler:
    """A generic handler for ``service`` whose methods map errors, record metrics and
    authenticate (``authenticate(full_method, context)`` returns a principal or raises).
    Streaming calls are watched by ``watchdog`` (default: a shared 30 s idle watchdog)."""
    watchdog = watchdog if watchdog is not None else DEFAULT_WATCHDOG

    def wrap(name: str, m: Method):
        full = f"/{service}/{name}"
        gtype = _GRPC_TYPE[m.kind]
        labels = (service, name, gtype)

        def begin(context):
            if metrics is not None:
                metrics.started.labels(*labels).inc()
            principal = authenticate(full, context) if authenticate else None
            return Call(context, principal, _deadline(context), full)

        def finish(code: str, started: float) -> None:
            if metrics is not None:
                metrics.handled.labels(*labels, code).inc()
                metrics.handling.labels(*labels).observe(time.perf_counter() - started)

        if m.kind in ("unary_unary", "stream_unary"):
            def handler(request, context):
                started = time.perf_counter()
                result = _Outcome()
                key = None
                try:
                    with _outcome(context, full, result):
                        call = begin(context)         # credentials first, then decoding
                        if m.kind == "stream_unary":
                            key = watchdog.watch(context, full)
                            request = map(m.request_deserializer, _watched(request, watchdog, key))
                        else:
                            request = m.request_deserializer(request)
                        return m.fn(request, call)
                finally:
                    if key is not None:
                        watchdog.release(key)
                    finish(result.code, started)
        else:
            def handler(request, context):
                started = time.perf_counter()
                result = _Outcome()
                key = None if m.idle_ok else watchdog.watch(context, full)
                try:
                    with _outcome(context, full, result):
                        call = begin(context)
                        for item in m.fn(m.request_deserializer(request), call):
                            if metrics is not None:
                                metrics.msg_sent.labels(*labels).inc()
                            if key is not None:
                                watchdog.touch(key)
                            yield item
                finally:
                    if key is not None:
                        watchdog.release(key)
                    finish(result.code, started)

        # requests reach the handler as bytes: decoding them there maps a malformed message
        # to INVALID_ARGUMENT (grpc's own decoding would answer INTERNAL), after credentials
        factory = getattr(grpc, f"{m.kind}_rpc_method_handler")
        return factory(handler, request_deserializer=None, response_serializer=m.response_serializer)

    return grpc.method_handlers_generic_handler(
        service, {name: wrap(name, m) for name, m in methods.items()})


DEFAULT_WATCHDOG = StreamWatchdog()


def proto_method(kind: str, fn: Callable, request_cls, response_cls=None, *,
                 request_deserializer=None, response_serializer=None, idle_ok: bool = False) -> Method:
    """A Method with protobuf (de)serializers unless custom ones are given."""
    return Method(kind, fn,
                  request_deserializer or request_cls.FromString,
                  response_serializer or (lambda msg: msg.SerializeToString()), idle_ok)
