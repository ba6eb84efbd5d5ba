"""The data plane's client side: ``DataPlaneConnection`` (one persistent connection) and
``DataPlanePool`` (connections per address for concurrent calls); the wire format, errors and
credentials are described in ``shardps.rpc.dataplane``."""

from __future__ import annotations

import contextlib
import math
import select
import socket
import ssl
import threading
import time
from typing import Any, Callable, Iterable, NamedTuple

import grpc

from shardps import errors
from shardps.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted, ShardpsError, Unavailable
from shardps.rpc import frames
from shardps.rpc.dataplane_sockets import (
    _OK,
    _STATUS_BY_NUMBER,
    MAX_FRAME_BYTES,
    _nodelay,
    _shutdown,
    client_ssl_context,
    parse_address,
)
from shardps.rpc.status import from_rpc_error


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
    """The error a server answered with. Its ``answered`` attribute is set: the server is
    done with the request (``answered``), unlike a timeout or a broken connection."""
    code = _STATUS_BY_NUMBER.get(frame.prefix.status, grpc.StatusCode.UNKNOWN)
    error = from_rpc_error(_Failure(code, bytes(frame.message).decode("utf-8", "replace"),
                                    bytes(frame.header).decode("ascii", "replace")), what)
    error.answered = True           # type: ignore[attr-defined]
    return error


def answered(exc: BaseException) -> bool:
    """Whether a failed call's error is the server's answer (``_error``): the server is done
    with the request and whatever it named (a shared-memory region) may be used again."""
    return getattr(exc, "answered", False)


class Sent(NamedTuple):
    """A request ``DataPlaneConnection.start`` sent; ``frame``: the answer already read where
    sending broke; ``into``: where the reply's payload may be received (``start``)."""

    method: int
    deadline: float | None
    request_id: int
    frame: "frames.Frame | None"
    into: memoryview | None = None


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
                 connect_timeout: float = 10.0, keep_buffer_bytes: int = frames.KEEP_BUFFER_BYTES,
                 compiled_io: bool = False):
        self.address = address
        self.compiled_io = compiled_io      # frames through sockio on plain sockets (see DataPlaneServer)
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
        self._poll: select.poll | None = None
        self._timer: frames.SocketTimer | None = None
        self._receiver = frames.FrameReader(keep=keep_buffer_bytes)
        self._next_id = 1

    # --- public ---
    @property
    def connected(self) -> bool:
        return self._sock is not None

    def call(self, method: int | str, header=b"", payload: Iterable = (), timeout: float | None = None,
             flags: int = 0) -> tuple[bytes, memoryview]:
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
        return self.finish(self.start(method, header, payload, timeout, flags))

    def start(self, method: int | str, header=b"", payload: Iterable = (), timeout: float | None = None,
              flags: int = 0, reply_into: memoryview | None = None) -> "Sent":
        """The first half of ``call``: send the request and return without waiting for the
        reply, which ``finish`` reads. The connection is held (other calls on it wait) until
        ``finish`` returns, which must follow, on any thread. Sending to several servers
        first and reading their replies after lets them work at once from one thread.
        ``reply_into`` (writable bytes): a reply whose payload has exactly its length is
        received there, and ``finish`` returns a view of it as the payload.
        Raises as ``call`` (then nothing is held)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        mid = method if type(method) is int and 0 < method <= frames.MAX_METHOD_ID else frames.method_id(method)
        if type(header) is bytes:               # the prefix goes first
            parts: list = [b"", header] if header else [b""]
            hlen = len(header)
        else:
            parts = [b""]
            hlen = frames.add_views(parts, (header,)) if header else 0
        plen = frames.add_views(parts, payload) if payload else 0
        self._lock.acquire()
        try:
            if hlen + plen > self._limit:
                raise self._too_large(mid, hlen + plen)
            if self._sock is None or self._peer_closed():
                self._connect(deadline, mid)
                if hlen + plen > self._limit:   # the server's limit, known after HELLO
                    raise self._too_large(mid, hlen + plen)
            rid, frame = self._send_request(mid, parts, hlen, plen, deadline, flags)
            return Sent(mid, deadline, rid, frame, reply_into)
        except BaseException:
            self._lock.release()
            raise

    def finish(self, sent: "Sent") -> tuple[bytes, memoryview]:
        """The second half of ``call``: wait for the reply of ``sent`` (from ``start`` on
        this connection) and release the connection. Returns and raises as ``call``."""
        try:
            frame = sent.frame if sent.frame is not None else self._read_reply(sent)
            if frame.prefix.status != _OK:
                raise _error(frame, self._what(sent.method))
            return bytes(frame.header), frame.payload.toreadonly()
        finally:
            self._lock.release()

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
        assert self._poll is not None and self._sock is not None     # connected
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
        self._timer = frames.SocketTimer(sock, self.ssl_context is not None, self.compiled_io)
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
        rid, frame = self._send_request(mid, parts, hlen, plen, deadline)
        return frame if frame is not None else self._read_reply(Sent(mid, deadline, rid, None))

    def _send_request(self, mid: int, parts: list, hlen: int, plen: int, deadline: float | None,
                      flags: int = 0) -> tuple[int, frames.Frame | None]:
        """Send ``parts`` (as ``_exchange``): ``(request id, None)``, or ``(request id, the
        server's answer)`` where sending broke and the server had answered (it may refuse a
        request and close)."""
        rid = self._next_id
        self._next_id = rid + 1
        timeout_ms = 0
        if deadline is not None:
            timeout_ms = max(1, min(0xFFFFFFFF, math.ceil((deadline - time.monotonic()) * 1000)))
        parts[0] = frames.pack_prefix(flags, mid, 0, rid, timeout_ms, 0, hlen, plen)
        assert self._timer is not None          # connected
        try:
            frames.send_parts(self._timer, parts, deadline)
        except socket.timeout:
            self._disconnect()
            raise DeadlineExceeded(f"{self._what(mid)}: sending took longer than the timeout") from None
        except (OSError, ValueError) as exc:
            # the server may have refused the request and closed: read its answer if it is there
            frame = self._read(time.monotonic() + 0.5, mid, after_send_error=exc)
            self._disconnect()
            return rid, frame
        return rid, None

    def _read_reply(self, sent: "Sent") -> frames.Frame:
        """Read the reply to the request ``sent``."""
        mid, rid = sent.method, sent.request_id
        if self._sock is None:
            raise Unavailable(f"{self._what(mid)}: the connection was closed before the reply")
        frame = self._read(sent.deadline, mid, into=sent.into)
        p = frame.prefix
        if not p.flags & frames.FLAG_REPLY or (p.request_id != rid and p.request_id != 0):
            self._disconnect()
            raise Unavailable(f"{self._what(mid)}: the server answered request {p.request_id}, not {rid}; "
                              f"connection closed")
        if p.flags & frames.FLAG_CLOSE:
            self._disconnect()           # the views stay valid: the buffer is ours
        return frame

    def _read(self, deadline: float | None, mid: int, after_send_error: Exception | None = None,
              into: memoryview | None = None) -> frames.Frame:
        limit = max(self.max_frame_bytes, 1 << 20)
        assert self._timer is not None          # connected
        try:
            return self._receiver.read_frame(self._timer, limit, deadline, into=into)
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

    @classmethod
    def for_tls(cls, tls, **kw) -> "DataPlanePool":
        """A pool speaking TLS as ``tls`` (a client ``TlsConfig``; None: plain TCP) says:
        its certificates, and the name it expects the servers' certificates to carry."""
        return cls(client_ssl_context(tls) if tls is not None else None,
                   server_hostname=getattr(tls, "server_name_override", "") or None, **kw)

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
             timeout: float | None = None, consume: Callable[[bytes, memoryview], Any] | None = None,
             flags: int = 0):
        """``DataPlaneConnection.call`` on a free connection to ``address``; blocking, within
        ``timeout`` including the wait for a connection. Returns ``(header, payload copy)``,
        or ``consume(header, payload_view)``'s result. Raises as ``DataPlaneConnection.call``."""
        return self.finish(self.start(address, method, header, payload, timeout, flags), consume)

    def start(self, address: str, method: int | str, header=b"", payload: Iterable = (),
              timeout: float | None = None, flags: int = 0,
              reply_into: memoryview | None = None) -> tuple[DataPlaneConnection, Sent]:
        """The first half of ``call``: send the request on a free connection to ``address``
        and return ``(connection, sent)`` for ``finish``, which must follow (it gives the
        connection back); ``reply_into`` as in ``DataPlaneConnection.start``. Raises as
        ``call`` (then nothing is held)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        conn = self._acquire(address, deadline)
        try:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            return conn, conn.start(method, header, payload, remaining, flags, reply_into)
        except BaseException as exc:
            self._release(address, conn, isinstance(exc, Unavailable))
            raise

    def finish(self, started: tuple[DataPlaneConnection, Sent],
               consume: Callable[[bytes, memoryview], Any] | None = None):
        """The second half of ``call``: read the reply of ``started`` (from ``start``); returns
        and raises as ``call``."""
        conn, sent = started
        broken = False
        try:
            head, view = conn.finish(sent)
            if consume is not None:
                return consume(head, view)
            return head, memoryview(bytes(view))
        except Unavailable:
            broken = True
            raise
        finally:
            self._release(conn.address, conn, broken)

    def abandon(self, address: str) -> int:
        """Close every connection to ``address``, idle or in use: a call in flight on one
        fails with Unavailable at once (for a peer that will never answer: declared dead
        while paused or cut off). Later calls connect again. Returns how many were closed."""
        with self._cond:
            conns = [c for c in self._all if c.address == address]
        for c in conns:
            c.close()
        return len(conns)

    def close(self) -> None:
        """Close every connection; later calls raise Unavailable."""
        with self._cond:
            self._closed = True
            conns, self._all = self._all, []
            self._free.clear()
            self._cond.notify_all()
        for c in conns:
            c.close()
