"""The data plane: request/response calls over plain TCP (or TLS, or a Unix socket), carrying
the same protobuf messages as gRPC with the bulk bytes beside them, raw.

gRPC Python costs about 430 µs of CPU per small call where a raw socket costs about 54 µs
(docs: "The transport floor"); a training step computes for about 3 ms. The data plane is a
bulk channel negotiated over gRPC (as the shared-memory path is) for Push and Pull; gRPC stays
the control plane and the fallback.

* Wire format: ``shardps.rpc.frames`` (a 40-byte prefix, an error message, a protobuf header,
  a raw payload). Senders pass the payload as several buffers, written with one
  ``socket.sendmsg`` (scatter-gather: numpy arrays are never concatenated); receivers
  ``recv_into`` one buffer per connection, reused from call to call.
* Errors: a handler raises ``ShardpsError``; the reply carries the gRPC status code of
  ``shardps.rpc.status`` (the one table) and the message; the client raises the same class
  as the gRPC path would (``status.from_rpc_error``). A broken connection is ``Unavailable``,
  a call past its timeout ``DeadlineExceeded``; both close the connection, and the next call
  connects again.
* Credentials: TLS (mutual with the gRPC certificates: ``server_ssl_context`` /
  ``client_ssl_context`` build ``ssl.SSLContext`` objects from a ``TlsConfig``) and call
  metadata: the client sends its metadata (``authorization: Bearer ...``) once, in the HELLO
  that opens the connection; the server passes it to ``authenticate(full_method, call)``,
  the same callable ``status.bind`` takes (``DataPlaneCall.invocation_metadata()`` is what
  ``server.auth.Authenticator`` reads), once per method per connection.

Threads: the server runs one accept thread and one thread per connection (blocking I/O, one
call at a time per connection). A client connection carries one call at a time; a
``DataPlanePool`` holds up to N connections per address for concurrent calls.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import shutil
import socket
import ssl
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import grpc
from google.protobuf.message import DecodeError

from shardps import errors
from shardps.errors import (DeadlineExceeded, InvalidArgument, ResourceExhausted, ShardpsError,
                            Unavailable)
from shardps.rpc import frames
from shardps.rpc.status import from_rpc_error, grpc_code

log = logging.getLogger("shardps.rpc.dataplane")

MAX_FRAME_BYTES = (1 << 30) + (16 << 20)   # a whole push up to max_request_bytes (1 GiB) + header
_STATUS_BY_NUMBER = {c.value[0]: c for c in grpc.StatusCode}
_OK = grpc.StatusCode.OK.value[0]
_INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
_RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
_INTERNAL = grpc.StatusCode.INTERNAL.value[0]
_FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]

Handler = Callable[[Any, bytes, memoryview, "DataPlaneCall"], "tuple[bytes | None, Iterable | None]"]


# ====================================================================== addresses and TLS
def parse_address(address: str) -> tuple[int, Any]:
    """``(family, sockaddr)`` of ``host:port``, ``[v6]:port`` or ``unix:/path``."""
    if address.startswith("unix:"):
        return socket.AF_UNIX, address[len("unix:"):]
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise InvalidArgument(f"data-plane address {address!r}: expected host:port or unix:/path")
    host = host.strip("[]")
    return (socket.AF_INET6 if ":" in host else socket.AF_INET), (host, int(port))


def _with_pem_files(cert: bytes, key: bytes, fn) -> None:
    # ssl loads a certificate chain only from files: write them into a private directory
    # for the call and remove it at once
    tmp = tempfile.mkdtemp(prefix="shardps-tls-")
    try:
        cert_path, key_path = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
        for path, data in ((cert_path, cert), (key_path, key)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        fn(cert_path, key_path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def server_ssl_context(tls) -> ssl.SSLContext:
    """An ``ssl.SSLContext`` for ``DataPlaneServer`` from a ``channels.TlsConfig``: the same
    certificate and key as the gRPC server; with ``tls.ca``, client certificates signed by it
    are requested, and required when ``tls.require_client_cert`` (as gRPC does)."""
    if not (tls.cert and tls.key):
        raise InvalidArgument("data-plane TLS server: TlsConfig needs cert and key")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _with_pem_files(tls.cert, tls.key, ctx.load_cert_chain)
    if tls.ca:
        ctx.load_verify_locations(cadata=tls.ca.decode())
        ctx.verify_mode = ssl.CERT_REQUIRED if tls.require_client_cert else ssl.CERT_OPTIONAL
    elif tls.require_client_cert:
        raise InvalidArgument("data-plane TLS server: require_client_cert needs the CA (tls.ca)")
    return ctx


def client_ssl_context(tls) -> ssl.SSLContext:
    """An ``ssl.SSLContext`` for ``DataPlaneConnection`` / ``DataPlanePool`` from a
    ``channels.TlsConfig``: verifies the server against ``tls.ca`` (host name checked; pass
    ``server_hostname=tls.server_name_override`` where one is set) and presents the client
    certificate when ``tls.cert`` and ``tls.key`` are given."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if tls.ca:
        ctx.load_verify_locations(cadata=tls.ca.decode())
    else:
        ctx.load_default_certs()
    if tls.cert and tls.key:
        _with_pem_files(tls.cert, tls.key, ctx.load_cert_chain)
    return ctx


# ====================================================================== sockets
def _shutdown(sock: socket.socket | None) -> None:
    """Wake every thread blocked on ``sock`` (SSLSocket.shutdown would drop its SSL object
    under a reader in another thread; the plain socket's shutdown does not)."""
    if sock is None:
        return
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


def _nodelay(sock: socket.socket) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# ====================================================================== server
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

    ``start()`` returns at once; ``stop()`` closes the listener and every connection and
    joins the threads. Thread-safe.
    """

    def __init__(self, handler: Handler, host: str = "127.0.0.1", port: int = 0,
                 ssl_context: ssl.SSLContext | None = None, *, limits: DataPlaneLimits | None = None,
                 authenticate: Callable[[str, DataPlaneCall], Any] | None = None,
                 service: str = "shardps.v1.ParameterServer",
                 method_names: dict[int, str] | None = None):
        self.handler = handler
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
            if tls:
                conn.sock.settimeout(lim.io_seconds)
                try:
                    conn.sock = self.ssl_context.wrap_socket(conn.sock, server_side=True)
                except (OSError, ValueError) as exc:
                    log.info("data plane: TLS handshake with %s failed: %s", conn.peer, exc)
                    return
            cert = conn.sock.getpeercert() if tls else None
            conn.timer = frames.SocketTimer(conn.sock, tls)
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
                    self._reply(conn, 0, 0, _INVALID_ARGUMENT, exc.message, b"", [], 0, tls, close=True)
                    return
                p = frame.prefix
                if metadata is None:                    # the first frame must be HELLO
                    if p.method != frames.HELLO:
                        self._reply(conn, p.method, p.request_id, _FAILED_PRECONDITION,
                                    "a data-plane connection starts with HELLO", b"", [], 0, tls, close=True)
                        return
                    metadata = frames.decode_hello(bytes(frame.header))
                    if not self._hello_authenticated(conn, p, metadata, cert, tls):
                        return
                    self._reply(conn, p.method, p.request_id, _OK, "",
                                frames.encode_hello_reply(lim.max_frame_bytes), [], 0, tls)
                    continue
                self._dispatch(conn, frame, metadata, cert, tls)
                del frame
        except (OSError, ValueError) as exc:           # reset, timeout, shut down by stop()
            if not self._closing:
                log.debug("data plane: connection from %s ended: %s", conn.peer, exc)
        finally:
            with contextlib.suppress(OSError):
                conn.sock.close()
            with self._lock:
                self._conns.discard(conn)

    def _hello_authenticated(self, conn: _Connection, p: frames.Prefix, metadata, cert, tls: bool) -> bool:
        """Check the credentials once at HELLO, before the peer may send any large frame;
        a refusal is answered and the connection closed."""
        if self.authenticate is None:
            return True
        full = f"/{self.service}/HELLO"
        try:
            self.authenticate(full, DataPlaneCall("HELLO", full, p.request_id, conn.peer, metadata, cert))
            return True
        except ShardpsError as exc:
            log.info("data plane: refusing %s: %s", conn.peer, exc.message)
            self._reply(conn, p.method, p.request_id, grpc_code(exc).value[0], exc.message,
                        type(exc).__name__.encode(), [], 0, tls, close=True)
            return False

    def _dispatch(self, conn: _Connection, frame: frames.Frame, metadata, cert, tls: bool) -> None:
        p = frame.prefix
        names = self._names.get(p.method)
        if names is None:
            name = self.method_names.get(p.method, p.method)
            names = self._names[p.method] = (name, f"/{self.service}/{name}")
        name, full = names
        call = DataPlaneCall(name, full, p.request_id, conn.peer, metadata, cert, None,
                             time.monotonic() + p.timeout_ms / 1000.0 if p.timeout_ms else None)
        status, message, header, parts, plen = _OK, "", b"", [], 0
        try:
            if p.method == frames.HELLO:
                raise InvalidArgument("HELLO sent twice on one connection")
            if self.authenticate is not None:
                principal = conn.principals.get(full)
                if principal is None:
                    principal = conn.principals[full] = self.authenticate(full, call)
                call.principal = principal
            out_header, out_buffers = self.handler(name, bytes(frame.header), frame.payload.toreadonly(), call)
            header = out_header or b""
            plen = frames.add_views(parts, out_buffers)
        except ShardpsError as exc:
            # the header of an error reply: the error's class name
            status, message, header = grpc_code(exc).value[0], exc.message, type(exc).__name__.encode()
        except DecodeError as exc:
            status, header = _INVALID_ARGUMENT, b""
            message = f"{full}: the request header does not decode as its protobuf message ({exc})"
        except Exception as exc:
            log.exception("internal error in %s (data plane)", full)
            status, header = _INTERNAL, b""
            message = f"internal error in {full}: {type(exc).__name__}: {exc}"
        if status != _OK:
            parts, plen = [], 0
        self._reply(conn, p.method, p.request_id, status, message, header, parts, plen, tls)

    def _reply(self, conn: _Connection, method: int, request_id: int, status: int, message: str,
               header, parts: list, plen: int, tls: bool, close: bool = False) -> None:
        """Send a reply: ``parts`` are the payload's byte views (``plen`` bytes in all)."""
        out = [b""]
        msg = message.encode("utf-8", "replace") if message else b""
        if msg:
            out.append(msg)
        hlen = frames.add_views(out, (header,)) if header else 0
        out += parts
        flags = frames.FLAG_REPLY | frames.FLAG_CLOSE if close else frames.FLAG_REPLY
        out[0] = frames.pack_prefix(flags, method, status, request_id, 0, len(msg), hlen, plen)
        frames.send_parts(conn.timer, out, time.monotonic() + self.limits.io_seconds)

    def _refuse_oversized(self, conn: _Connection, exc: frames.FrameTooLarge, receiver: frames.FrameReader,
                          tls: bool) -> None:
        p = exc.prefix
        log.warning("data plane: refusing a %d-byte frame from %s (max_frame_bytes %d)", p.body_len,
                    conn.peer, exc.limit)
        self._reply(conn, p.method, p.request_id, _RESOURCE_EXHAUSTED,
                    f"data-plane frame of {p.body_len} bytes exceeds this server's limit of {exc.limit} "
                    f"bytes (max_frame_bytes): split the request", b"", [], 0, tls, close=True)
        # read (and drop) what the client is still sending, briefly: closing with unread bytes
        # would reset the connection and could destroy the reply before the client reads it
        left = frames.PREFIX_BYTES + p.body_len - exc.already
        deadline = time.monotonic() + 1.0
        with contextlib.suppress(OSError, ValueError):
            while left > 0:
                conn.timer.arm(deadline)
                n = conn.sock.recv_into(receiver.view, min(left, len(receiver.view)))
                if not n:
                    break
                left -= n


# ====================================================================== client
class _Failure:
    """A failed call as ``status.from_rpc_error`` reads one: code(), details() and the
    error's class name as gRPC's trailing metadata carries it."""

    def __init__(self, code: grpc.StatusCode, details: str, error_name: str):
        self._code, self._details, self._name = code, details, error_name

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return ((errors.WIRE_KEY, self._name),) if self._name else ()


def _error(frame: "frames.Frame", what: str) -> ShardpsError:
    code = _STATUS_BY_NUMBER.get(frame.prefix.status, grpc.StatusCode.UNKNOWN)
    return from_rpc_error(_Failure(code, bytes(frame.message).decode("utf-8", "replace"),
                                   bytes(frame.header).decode("ascii", "replace")), what)


class DataPlaneConnection:
    """One persistent connection to a ``DataPlaneServer`` at ``address`` (``host:port`` or
    ``unix:/path``), over TLS when ``ssl_context`` is given (``server_hostname`` defaults to
    the address's host). It connects on the first call and after a broken one; ``metadata``
    (e.g. ``(("authorization", "Bearer <token>"),)``) goes to the server once per connection.

    Thread-safe: calls from several threads take turns (one call in flight per connection);
    use a ``DataPlanePool`` for concurrent calls.
    """

    def __init__(self, address: str, ssl_context: ssl.SSLContext | None = None,
                 server_hostname: str | None = None, *, metadata=(), max_frame_bytes: int = MAX_FRAME_BYTES,
                 connect_timeout: float = 10.0, keep_buffer_bytes: int = frames.KEEP_BUFFER_BYTES):
        self.address = address
        self.family, self.sockaddr = parse_address(address)
        self.ssl_context = ssl_context
        if server_hostname is None and self.family != socket.AF_UNIX:
            server_hostname = self.sockaddr[0]
        self.server_hostname = server_hostname
        self.metadata = tuple(metadata)
        self.max_frame_bytes = max_frame_bytes
        self.connect_timeout = connect_timeout
        self.server_max_frame_bytes = 0
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._poll = None
        self._timer: frames.SocketTimer | None = None
        self._receiver = frames.FrameReader(keep=keep_buffer_bytes)
        self._next_id = 1

    # --- public ---
    @property
    def connected(self) -> bool:
        return self._sock is not None

    def call(self, method: int | str, header=b"", payload: Iterable = (), timeout: float | None = None
             ) -> tuple[bytes, memoryview]:
        """Send one request and wait for its reply: ``(reply header bytes, reply payload)``.

        Blocking, for at most ``timeout`` seconds (None: no limit; the server sees the same
        deadline). ``method`` is a name of ``frames.METHOD_IDS`` or an id; ``header`` a
        serialized protobuf message; ``payload`` buffers or numpy arrays, sent one after the
        other without being joined.

        The returned payload is a read-only view into this connection's receive buffer: it
        is valid until the next call on this connection (zero-copy; copy it to keep it).

        Raises the ``ShardpsError`` of the reply's status code (as the gRPC path does);
        ``Unavailable`` when the connection cannot be made or breaks, ``DeadlineExceeded``
        when the timeout passes (both close the connection; the next call reconnects);
        ``ResourceExhausted`` for a frame over either side's ``max_frame_bytes`` (not sent).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        mid = method if type(method) is int and 0 < method <= frames.MAX_METHOD_ID else frames.method_id(method)
        parts = [b""]                           # the prefix goes first
        hlen = frames.add_views(parts, (header,)) if header else 0
        plen = frames.add_views(parts, payload)
        with self._lock:
            if hlen + plen > self._limit:
                raise self._too_large(mid, hlen + plen)
            if self._sock is None or self._peer_closed():
                self._connect(deadline, mid)
                if hlen + plen > self._limit:   # the server's limit, known after HELLO
                    raise self._too_large(mid, hlen + plen)
            frame = self._exchange(mid, parts, hlen, plen, deadline)
            if frame.prefix.status != _OK:
                raise _error(frame, self._what(mid))
            return bytes(frame.header), frame.payload.toreadonly()

    def connect(self, timeout: float | None = None) -> None:
        """Connect now (and say HELLO) instead of on the first call. Raises as ``call``."""
        with self._lock:
            self._connect(None if timeout is None else time.monotonic() + timeout, frames.HELLO)

    def close(self) -> None:
        """Close the socket (a later call connects again). A call in flight on another
        thread fails with Unavailable. Idempotent."""
        _shutdown(self._sock)          # wakes a call in flight; its thread then disconnects
        with self._lock:
            self._disconnect()

    def __enter__(self) -> "DataPlaneConnection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- internals (under self._lock) ---
    def _what(self, mid: int) -> str:
        name = "HELLO" if mid == frames.HELLO else frames.METHOD_NAMES.get(mid, mid)
        return f"{name} on {self.address} (data plane)"

    @property
    def _limit(self) -> int:
        if self.server_max_frame_bytes:
            return min(self.max_frame_bytes, self.server_max_frame_bytes)
        return self.max_frame_bytes

    def _too_large(self, mid: int, body: int) -> ResourceExhausted:
        return ResourceExhausted(f"{self._what(mid)}: a request of {body} bytes exceeds the data-plane "
                                 f"frame limit of {self._limit} bytes (max_frame_bytes): split the request")

    def _disconnect(self) -> None:
        sock, self._sock, self._poll, self._timer = self._sock, None, None, None
        if sock is not None:
            _shutdown(sock)
            with contextlib.suppress(OSError):
                sock.close()

    def _peer_closed(self) -> bool:
        """Whether the idle connection was closed by the server (restart, idle timeout): then
        nothing was sent yet, and reconnecting is safe."""
        if not self._poll.poll(0):
            return False
        try:
            data = socket.socket.recv(self._sock, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            return True
        # TLS: the bytes may be records OpenSSL has not read yet (session tickets)
        return not data or self.ssl_context is None

    def _connect(self, deadline: float | None, mid: int) -> None:
        """(Re)connect and say HELLO."""
        what = self._what(mid)
        self._disconnect()
        budget = self.connect_timeout if deadline is None else min(self.connect_timeout,
                                                                    deadline - time.monotonic())
        if budget <= 0:
            raise DeadlineExceeded(f"{what}: the deadline passed before connecting")
        sock = socket.socket(self.family, socket.SOCK_STREAM)
        try:
            sock.settimeout(budget)
            sock.connect(self.sockaddr)
            _nodelay(sock)
            if self.ssl_context is not None:
                sock = self.ssl_context.wrap_socket(sock, server_hostname=self.server_hostname)
        except socket.timeout:
            sock.close()
            raise DeadlineExceeded(f"{what}: connecting took longer than {budget:.3g}s") from None
        except (OSError, ValueError) as exc:
            sock.close()
            raise Unavailable(f"{what}: cannot connect: {exc} (is the server at that address "
                              f"running, and do both sides agree on TLS?)") from None
        self._sock = sock
        self._timer = frames.SocketTimer(sock, self.ssl_context is not None)
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
        hello_deadline = time.monotonic() + budget
        hello = frames.encode_hello(self.metadata)
        frame = self._exchange(frames.HELLO, [b"", hello], len(hello), 0, hello_deadline)
        if frame.prefix.status != _OK:
            self._disconnect()
            raise _error(frame, what)
        self.server_max_frame_bytes = frames.decode_hello_reply(bytes(frame.header))["max_frame_bytes"]

    def _exchange(self, mid: int, parts: list, hlen: int, plen: int, deadline: float | None) -> frames.Frame:
        """Send ``parts`` (``parts[0]`` is replaced by the prefix; then the header's view, if
        any, then the payload's) and read the reply."""
        rid = self._next_id
        self._next_id += 1
        timeout_ms = 0
        if deadline is not None:
            timeout_ms = max(1, min(0xFFFFFFFF, math.ceil((deadline - time.monotonic()) * 1000)))
        parts[0] = frames.pack_prefix(0, mid, 0, rid, timeout_ms, 0, hlen, plen)
        try:
            frames.send_parts(self._timer, parts, deadline)
        except socket.timeout:
            self._disconnect()
            raise DeadlineExceeded(f"{self._what(mid)}: sending took longer than the timeout") from None
        except (OSError, ValueError) as exc:
            # the server may have refused the request and closed: read its answer if it is there
            frame = self._read(time.monotonic() + 0.5, mid, after_send_error=exc)
            self._disconnect()
            return frame
        frame = self._read(deadline, mid)
        p = frame.prefix
        if not p.flags & frames.FLAG_REPLY or (p.request_id != rid and p.request_id != 0):
            self._disconnect()
            raise Unavailable(f"{self._what(mid)}: the server answered request {p.request_id}, not {rid}; "
                              f"connection closed")
        if p.flags & frames.FLAG_CLOSE:
            self._disconnect()           # the views stay valid: the buffer is ours
        return frame

    def _read(self, deadline: float | None, mid: int, after_send_error: Exception | None = None) -> frames.Frame:
        limit = max(self.max_frame_bytes, 1 << 20)
        try:
            return self._receiver.read_frame(self._timer, limit, deadline)
        except socket.timeout:
            self._disconnect()
            what = self._what(mid)
            if after_send_error is not None:
                raise Unavailable(f"{what}: connection broke while sending: {after_send_error}") from None
            raise DeadlineExceeded(f"{what}: no reply within the timeout; connection closed") from None
        except frames.FrameTooLarge as exc:
            self._disconnect()
            raise ResourceExhausted(f"{self._what(mid)}: the reply of {exc.prefix.body_len} bytes exceeds this "
                                    f"client's max_frame_bytes ({exc.limit}); connection closed") from None
        except (frames.PeerClosed, frames.ProtocolError, OSError, ValueError) as exc:
            self._disconnect()
            cause = after_send_error or exc
            detail = "the connection was closed" if isinstance(cause, frames.PeerClosed) else str(cause)
            raise Unavailable(f"{self._what(mid)}: connection broke: {detail} (is the server at that address "
                              f"running?)") from None


class DataPlanePool:
    """Up to ``connections_per_address`` ``DataPlaneConnection`` objects per address, taken
    from a free list for one call at a time. Thread-safe.

    ``call`` copies the reply's payload (the connection goes back to the free list when it
    returns) unless ``consume`` is given: then ``consume(header, payload_view)`` runs while
    the connection is held, and its result is returned (zero-copy). ``connection(address)``
    holds one connection for a block of calls.

    When a call finds its connection broken (``Unavailable``), the idle connections to the
    same address are closed too: they most likely point at the same dead process.
    """

    def __init__(self, ssl_context: ssl.SSLContext | None = None, *, server_hostname: str | None = None,
                 connections_per_address: int = 4, metadata=(), max_frame_bytes: int = MAX_FRAME_BYTES,
                 connect_timeout: float = 10.0):
        if connections_per_address < 1:
            raise InvalidArgument(f"connections_per_address={connections_per_address}: at least 1")
        self.ssl_context = ssl_context
        self.server_hostname = server_hostname
        self.per_address = connections_per_address
        self.metadata = tuple(metadata)
        self.max_frame_bytes = max_frame_bytes
        self.connect_timeout = connect_timeout
        self._cond = threading.Condition()
        self._free: dict[str, list[DataPlaneConnection]] = {}
        self._count: dict[str, int] = {}
        self._all: list[DataPlaneConnection] = []
        self._closed = False

    def _acquire(self, address: str, deadline: float | None) -> DataPlaneConnection:
        with self._cond:
            while True:
                if self._closed:
                    raise Unavailable(f"data-plane pool is closed (call to {address})")
                free = self._free.setdefault(address, [])
                if free:
                    return free.pop()
                if self._count.get(address, 0) < self.per_address:
                    self._count[address] = self._count.get(address, 0) + 1
                    conn = DataPlaneConnection(address, self.ssl_context, self.server_hostname,
                                               metadata=self.metadata, max_frame_bytes=self.max_frame_bytes,
                                               connect_timeout=self.connect_timeout)
                    self._all.append(conn)
                    return conn
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise DeadlineExceeded(f"all {self.per_address} data-plane connections to {address} "
                                           f"stayed busy until the deadline")
                self._cond.wait(remaining)

    def _release(self, address: str, conn: DataPlaneConnection, broken: bool) -> None:
        with self._cond:
            idle = self._free.setdefault(address, [])
            stale = list(idle) if broken else []
            idle.append(conn)
            self._cond.notify()
        for c in stale:
            c.close()
        if self._closed:
            conn.close()

    @contextlib.contextmanager
    def connection(self, address: str, timeout: float | None = None):
        """Hold one connection to ``address`` for the block (waits at most ``timeout`` for a
        free one: DeadlineExceeded)."""
        conn = self._acquire(address, None if timeout is None else time.monotonic() + timeout)
        broken = False
        try:
            yield conn
        except Unavailable:
            broken = True
            raise
        finally:
            self._release(address, conn, broken)

    def call(self, address: str, method: int | str, header=b"", payload: Iterable = (),
             timeout: float | None = None, consume: Callable[[bytes, memoryview], Any] | None = None):
        """``DataPlaneConnection.call`` on a free connection to ``address``; blocking, within
        ``timeout`` including the wait for a connection. Returns ``(header, payload copy)``,
        or ``consume(header, payload_view)``'s result. Raises as ``DataPlaneConnection.call``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        conn = self._acquire(address, deadline)
        broken = False
        try:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            head, view = conn.call(method, header, payload, remaining)
            if consume is not None:
                return consume(head, view)
            return head, memoryview(bytes(view))
        except Unavailable:
            broken = True
            raise
        finally:
            self._release(address, conn, broken)

    def close(self) -> None:
        """Close every connection; later calls raise Unavailable."""
        with self._cond:
            self._closed = True
            conns, self._all = self._all, []
            self._free.clear()
            self._cond.notify_all()
        for c in conns:
            c.close()
