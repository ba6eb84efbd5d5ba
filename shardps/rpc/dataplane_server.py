"""The data plane's server side: ``DataPlaneServer`` with its limits and the per-call
``DataPlaneCall`` (the wire format, errors, credentials and threads are described in
``shardps.rpc.dataplane``)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from google.protobuf.message import DecodeError

from shardps import authz
from shardps.errors import InvalidArgument, ShardpsError, Unavailable
from shardps.rpc import frames
from shardps.rpc.dataplane_sockets import (
    _FAILED_PRECONDITION,
    _INTERNAL,
    _INVALID_ARGUMENT,
    _OK,
    _RESOURCE_EXHAUSTED,
    MAX_FRAME_BYTES,
    _nodelay,
    _shutdown,
    parse_address,
)
from shardps.rpc.status import grpc_code

log = logging.getLogger("shardps.rpc.dataplane")

MAX_PAUSE = 1.0          # seconds: the longest a refused connection waits before its next read

Handler = Callable[[Any, bytes, memoryview, "DataPlaneCall"], "tuple[bytes | None, Iterable | None]"]


@dataclass(frozen=True)
class DataPlaneLimits:
    """Server limits. ``max_frame_bytes`` bounds one request's message + header + payload
    (a larger one is refused with RESOURCE_EXHAUSTED and the connection closed); a
    connection waits ``idle_seconds`` for its next request and ``io_seconds`` for the rest of
    a started frame, a reply's send or a TLS handshake; connections beyond
    ``max_connections`` are closed at once."""

    max_frame_bytes: int = MAX_FRAME_BYTES
    max_connections: int = 1024
    idle_seconds: float = 3600.0
    io_seconds: float = 60.0
    keep_buffer_bytes: int = frames.KEEP_BUFFER_BYTES


@dataclass(slots=True)
class DataPlaneCall:
    """What a handler knows about its call besides the request (cf. ``status.Call``).

    ``method`` is the name (``frames.METHOD_NAMES``) or, for other ids, the number;
    ``deadline`` is a ``time.monotonic()`` deadline (None: the client set no timeout);
    ``principal`` is what ``authenticate`` returned; ``peer_certificate`` the verified
    client certificate (``SSLSocket.getpeercert()``) under TLS, else None."""

    method: Any
    full_method: str
    request_id: int
    peer: str
    metadata: tuple = ()
    peer_certificate: dict | None = None
    principal: Any = None
    deadline: float | None = None
    flags: int = 0                   # the request frame's ``frames.FLAG_PACKED`` and ``FLAG_SHARED``

    def invocation_metadata(self) -> tuple:
        """The client's metadata pairs (what a grpc.ServicerContext returns)."""
        return self.metadata


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    peer: str
    thread: threading.Thread | None = None
    timer: frames.SocketTimer | None = None
    principals: dict = field(default_factory=dict)    # full method -> principal
    state: dict = field(default_factory=dict)         # the step handler's, per connection


# A step handler (``DataPlaneServer(step_handler=...)``): (header, payload, principal,
# connection state, deadline, flags) -> (reply header, payload buffers)
StepHandler = Callable[[memoryview, memoryview, Any, dict, "float | None", int], "tuple[bytes, list]"]
_STEP = frames.METHOD_IDS["Step"]


class DataPlaneServer:
    """Serves data-plane calls on ``host:port`` (port 0 picks a free one; ``host`` may be
    ``unix:/path``), over TLS when ``ssl_context`` is given.

    ``handler(method, header, payload, call) -> (header_bytes, buffers)`` runs on the
    connection's thread, one call at a time per connection and concurrently across
    connections (it must be thread-safe). ``header`` is bytes; ``payload`` a read-only view
    into the connection's receive buffer, valid only until the handler returns (copy what
    you keep). It returns the reply's header (bytes or None) and payload buffers (numpy
    arrays or any buffer, sent without joining them; None for none). It raises
    ``ShardpsError`` to answer with that error's status code and message (a protobuf
    ``DecodeError`` answers INVALID_ARGUMENT, as ``status.bind`` does); any other exception
    answers INTERNAL and is logged with its traceback.

    ``authenticate(full_method, call)``: as for ``status.bind``. Called at HELLO (method
    ``HELLO``: a refusal closes the connection before the peer can send a large frame) and
    before the handler once per method per connection (the metadata of a connection does
    not change); its result is ``call.principal``; a ``ShardpsError`` it raises is the
    call's answer.

    ``compiled_io``: frames read and sent by ``shardps.rpc.sockio``'s compiled calls on plain
    sockets, not by Python's socket calls (the default: ``python -m shardps.tools.bench
    --only transport`` measures both, and the compiled calls cost more per call today).
    ``start()`` returns at once; ``stop()`` closes the listener and every
    connection and joins the threads. Thread-safe.
    """

    def __init__(self, handler: Handler, host: str = "127.0.0.1", port: int = 0,
                 ssl_context: ssl.SSLContext | None = None, *, limits: DataPlaneLimits | None = None,
                 authenticate: Callable[[str, DataPlaneCall], Any] | None = None,
                 service: str = "shardps.v1.ParameterServer",
                 method_names: dict[int, str] | None = None, step_handler: StepHandler | None = None,
                 compiled_io: bool = False):
        self.handler = handler
        self.compiled_io = compiled_io
        self.step_handler = step_handler
        self._step_full = f"/{service}/Step"
        self.ssl_context = ssl_context
        self.limits = limits or DataPlaneLimits()
        self.authenticate = authenticate
        self.service = service
        self.method_names = frames.METHOD_NAMES if method_names is None else dict(method_names)
        self._names: dict[int, tuple] = {}          # method id -> (name, full method name)
        self._lock = threading.Lock()
        self._conns: set = set()
        self._closing = False
        self._accept_thread: threading.Thread | None = None
        self._unix_path = ""
        if host.startswith("unix:"):
            self._unix_path = host[len("unix:"):]
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._unix_path)
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._listener.bind(self._unix_path)
        else:
            family, addr = parse_address(f"{host}:{port}")
            self._listener = socket.socket(family, socket.SOCK_STREAM)
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                self._listener.bind(addr)
            except OSError as exc:
                self._listener.close()
                raise Unavailable(f"data plane: cannot listen on {host}:{port}: {exc}") from None
        self._listener.listen(128)

    @property
    def address(self) -> str:
        """Where clients connect: ``host:port`` (the bound port) or ``unix:/path``."""
        if self._unix_path:
            return f"unix:{self._unix_path}"
        host, port = self._listener.getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    @property
    def port(self) -> int:
        return 0 if self._unix_path else self._listener.getsockname()[1]

    def start(self) -> "DataPlaneServer":
        self._accept_thread = threading.Thread(target=self._accept_loop, name="dataplane-accept",
                                               daemon=True)
        self._accept_thread.start()
        return self

    def stop(self, grace: float = 5.0) -> None:
        """Close the listener and every connection (calls in progress get no reply), then
        join the threads (each for at most ``grace`` seconds). Idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            conns = list(self._conns)
        _shutdown(self._listener)               # wakes accept() (Linux, TCP)
        if self._accept_thread is not None:
            self._accept_thread.join(0.2)
            if self._accept_thread.is_alive():  # elsewhere: wake it with a connection
                with contextlib.suppress(OSError), socket.socket(self._listener.family) as s:
                    s.settimeout(1.0)
                    s.connect(self._unix_path or ("127.0.0.1" if self._listener.family == socket.AF_INET
                                                  else "::1", self.port))
            self._accept_thread.join(grace)
        self._listener.close()
        for c in conns:
            _shutdown(c.sock)
        deadline = time.monotonic() + grace
        for c in conns:
            if c.thread is not None:
                c.thread.join(max(0.0, deadline - time.monotonic()))
        if self._unix_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._unix_path)

    def __enter__(self) -> "DataPlaneServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    # --- threads ---
    def _accept_loop(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except OSError:
                if self._closing:
                    return
                log.warning("data plane: accept failed", exc_info=True)
                time.sleep(0.05)
                continue
            peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else f"unix:{addr or '?'}"
            conn = _Connection(sock, peer)
            with self._lock:
                refuse = self._closing or len(self._conns) >= self.limits.max_connections
                if not refuse:
                    self._conns.add(conn)
            if refuse:
                sock.close()
                if self._closing:
                    return
                log.warning("data plane: refusing %s: %d connections open (max_connections)",
                            peer, self.limits.max_connections)
                continue
            conn.thread = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                           name=f"dataplane-{peer}")
            conn.thread.start()

    def _serve(self, conn: _Connection) -> None:
        lim = self.limits
        tls = self.ssl_context is not None
        try:
            _nodelay(conn.sock)
            if self.ssl_context is not None:
                conn.sock.settimeout(lim.io_seconds)
                try:
                    conn.sock = self.ssl_context.wrap_socket(conn.sock, server_side=True)
                except (OSError, ValueError) as exc:
                    log.info("data plane: TLS handshake with %s failed: %s", conn.peer, exc)
                    return
            cert = conn.sock.getpeercert() if isinstance(conn.sock, ssl.SSLSocket) else None
            conn.timer = frames.SocketTimer(conn.sock, tls, self.compiled_io)
            receiver = frames.FrameReader(keep=lim.keep_buffer_bytes)
            metadata = None
            while not self._closing:
                now = time.monotonic()
                idle = now + (lim.io_seconds if metadata is None else lim.idle_seconds)
                try:
                    frame = receiver.read_frame(conn.timer, lim.max_frame_bytes, now + lim.io_seconds, idle)
                except frames.PeerClosed:
                    return
                except frames.FrameTooLarge as exc:
                    self._refuse_oversized(conn, exc, receiver, tls)
                    return
                except frames.ProtocolError as exc:
                    log.info("data plane: %s sent a malformed frame: %s", conn.peer, exc)
                    _reply(conn, lim.io_seconds, 0, 0, _INVALID_ARGUMENT, exc.message, b"", [], 0, close=True)
                    return
                p = frame.prefix
                if metadata is None:                    # the first frame must be HELLO
                    if p.method != frames.HELLO:
                        _reply(conn, lim.io_seconds, p.method, p.request_id, _FAILED_PRECONDITION,
                               "a data-plane connection starts with HELLO", b"", [], 0, close=True)
                        return
                    metadata = frames.decode_hello(bytes(frame.header))
                    if not _hello_authenticated(self, conn, p, metadata, cert):
                        return
                    _reply(conn, lim.io_seconds, p.method, p.request_id, _OK, "",
                           frames.encode_hello_reply(lim.max_frame_bytes), [], 0)
                    continue
                if p.method == _STEP and self.step_handler is not None:
                    pause = self._step(conn, frame, metadata, cert, tls)
                else:
                    pause = self._dispatch(conn, frame, metadata, cert, tls)
                del frame
                if pause:                               # refused for load: see _dispatch
                    time.sleep(pause)
        except (OSError, ValueError) as exc:           # reset, timeout, shut down by stop()
            if not self._closing:
                log.debug("data plane: connection from %s ended: %s", conn.peer, exc)
        finally:
            with contextlib.suppress(OSError):
                conn.sock.close()
            with self._lock:
                self._conns.discard(conn)

    def _dispatch(self, conn: _Connection, frame: frames.Frame, metadata, cert, tls: bool) -> float:
        """Answer one call. Returns how long the connection must wait before its next
        request is read: the ``retry_after`` of a ``ResourceExhausted`` refusal (admission
        control; at most ``MAX_PAUSE``), else 0. A client that ignores the hint is then held
        back by TCP flow control instead of being read and refused as fast as it sends."""
        p = frame.prefix
        names = self._names.get(p.method)
        if names is None:
            name = self.method_names.get(p.method, p.method)
            names = self._names[p.method] = (name, f"/{self.service}/{name}")
        name, full = names
        call = DataPlaneCall(name, full, p.request_id, conn.peer, metadata, cert, None,
                             time.monotonic() + p.timeout_ms / 1000.0 if p.timeout_ms else None,
                             p.flags & (frames.FLAG_PACKED | frames.FLAG_SHARED))
        status, message, header, plen = _OK, "", b"", 0
        parts: list = []
        pause = 0.0
        try:
            if p.method == frames.HELLO:
                raise InvalidArgument("HELLO sent twice on one connection")
            if self.authenticate is not None:
                call.principal = self._principal(conn, call)
            out_header, out_buffers = self.handler(name, bytes(frame.header), frame.payload.toreadonly(), call)
            header = out_header or b""
            plen = frames.add_views(parts, out_buffers)
        except ShardpsError as exc:
            # the header of an error reply: the error's class name
            status, message, header = grpc_code(exc).value[0], exc.message, type(exc).__name__.encode()
            pause = min(MAX_PAUSE, getattr(exc, "retry_after", None) or 0.0)
        except DecodeError as exc:
            status, header = _INVALID_ARGUMENT, b""
            message = f"{full}: the request header does not decode as its protobuf message ({exc})"
        except Exception as exc:
            log.exception("internal error in %s (data plane)", full)
            status, header = _INTERNAL, b""
            message = f"internal error in {full}: {type(exc).__name__}: {exc}"
        if status != _OK:
            parts, plen = [], 0
        _reply(conn, self.limits.io_seconds, p.method, p.request_id, status, message, header, parts, plen,
               packed=bool(call.flags & frames.FLAG_PACKED) and status == _OK)
        return pause

    def _principal(self, conn: _Connection, call: DataPlaneCall):
        """The principal of ``call``'s method on this connection: ``authenticate``d (and
        authorized by the table's entry) at the method's first call, then kept."""
        principal = conn.principals.get(call.full_method)
        if principal is None:
            principal = self.authenticate(call.full_method, call)       # type: ignore[misc]
            if self.service in authz.TABLE:      # the authorization table's entry
                authz.authorize(call.full_method, principal)
            conn.principals[call.full_method] = principal
        return principal

    def _step(self, conn: _Connection, frame: frames.Frame, metadata, cert, tls: bool) -> float:
        """Answer a Step frame through ``step_handler``: ``_dispatch`` with nothing a Step
        does not need (the principal of the connection's first Step is kept for the others,
        as ``_dispatch`` keeps one per method). Returns the pause as ``_dispatch`` does."""
        p = frame.prefix
        parts: list = []
        status, message, header, plen, pause = _OK, "", b"", 0, 0.0
        try:
            principal = None
            if self.authenticate is not None:
                full = self._step_full
                principal = conn.principals.get(full) or self._principal(
                    conn, DataPlaneCall("Step", full, p.request_id, conn.peer, metadata, cert, None, None, p.flags))
            deadline = time.monotonic() + p.timeout_ms / 1000.0 if p.timeout_ms else None
            header, buffers = self.step_handler(frame.header, frame.payload.toreadonly(), principal,   # type: ignore[misc]
                                                conn.state, deadline, p.flags)
            plen = frames.add_views(parts, buffers) if buffers else 0
        except ShardpsError as exc:
            status, message, header = grpc_code(exc).value[0], exc.message, type(exc).__name__.encode()
            pause = min(MAX_PAUSE, getattr(exc, "retry_after", None) or 0.0)
        except Exception as exc:
            log.exception("internal error in Step (data plane)")
            status, header = _INTERNAL, b""
            message = f"internal error in Step: {type(exc).__name__}: {exc}"
        if status != _OK:
            parts, plen = [], 0
        _reply(conn, self.limits.io_seconds, _STEP, p.request_id, status, message, header, parts, plen,
               packed=status == _OK)
        return pause

    def _refuse_oversized(self, conn: _Connection, exc: frames.FrameTooLarge, receiver: frames.FrameReader,
                          tls: bool) -> None:
        p = exc.prefix
        log.warning("data plane: refusing a %d-byte frame from %s (max_frame_bytes %d)", p.body_len,
                    conn.peer, exc.limit)
        _reply(conn, self.limits.io_seconds, p.method, p.request_id, _RESOURCE_EXHAUSTED,
                    f"data-plane frame of {p.body_len} bytes exceeds this server's limit of {exc.limit} "
                    f"bytes (max_frame_bytes): split the request", b"", [], 0, close=True)
        _drain(conn, frames.PREFIX_BYTES + p.body_len - exc.already, receiver)


def _hello_authenticated(server: DataPlaneServer, conn: _Connection, p: frames.Prefix, metadata, cert) -> bool:
    """Check the credentials once at HELLO, before the peer may send any large frame;
    a refusal is answered and the connection closed."""
    if server.authenticate is None:
        return True
    full = f"/{server.service}/HELLO"
    try:
        server.authenticate(full, DataPlaneCall("HELLO", full, p.request_id, conn.peer, metadata, cert))
        return True
    except ShardpsError as exc:
        log.info("data plane: refusing %s: %s", conn.peer, exc.message)
        _reply(conn, server.limits.io_seconds, p.method, p.request_id, grpc_code(exc).value[0], exc.message,
               type(exc).__name__.encode(), [], 0, close=True)
        return False


def _reply(conn: _Connection, io_seconds: float, method: int, request_id: int, status: int, message: str,
           header, parts: list, plen: int, close: bool = False, packed: bool = False) -> None:
    """Send a reply: ``parts`` are the payload's byte views (``plen`` bytes in all);
    ``packed``: its header is in the packed form (the request's was)."""
    out = [b""]
    msg = message.encode("utf-8", "replace") if message else b""
    if msg:
        out.append(msg)
    hlen = frames.add_views(out, (header,)) if header else 0
    out += parts
    flags = frames.FLAG_REPLY | frames.FLAG_CLOSE if close else frames.FLAG_REPLY
    if packed:
        flags |= frames.FLAG_PACKED
    out[0] = frames.pack_prefix(flags, method, status, request_id, 0, len(msg), hlen, plen)
    assert conn.timer is not None          # set before the connection's first frame
    # without payload bytes (a Step's values in shared memory, an error): one buffer
    frames.send_parts(conn.timer, out if plen else [b"".join(out)], time.monotonic() + io_seconds)


def _drain(conn: _Connection, left: int, receiver: frames.FrameReader) -> None:
    """Read (and drop) the ``left`` bytes the client is still sending, briefly: closing with
    unread bytes would reset the connection and could destroy the reply before the client
    reads it."""
    deadline = time.monotonic() + 1.0
    assert conn.timer is not None
    with contextlib.suppress(OSError, ValueError):
        while left > 0:
            conn.timer.arm(deadline)
            n = conn.sock.recv_into(receiver.view, min(left, len(receiver.view)))
            if not n:
                break
            left -= n
