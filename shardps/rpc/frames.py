"""The data plane's wire format (one fixed 40-byte prefix, then three byte strings) and the
frame I/O on one socket: ``send_parts`` (scatter-gather), ``FrameReader`` (one reusable
receive buffer), ``SocketTimer`` (deadlines). ``shardps.rpc.dataplane`` builds the server and
the client on them.

Every frame, request or reply, is::

    prefix (40 bytes, little-endian, PREFIX below)
    message  (message_len bytes: UTF-8 error text; replies only, empty on OK)
    header   (header_len bytes: a serialized protobuf message, e.g. a PushHeader; in a
              reply with an error status, the error's class name, e.g. ``StaleEpoch``: what
              gRPC calls carry in the ``x-shardps-error`` trailing metadata)
    payload  (payload_len bytes: raw little-endian tensor bytes, the concatenation of the
              sender's buffers)

========  ====  ==========================================================================
offset    size  field
========  ====  ==========================================================================
0         2     magic ``b"SD"`` (shardps data plane)
2         1     version (``VERSION``; a frame of another version is refused)
3         1     flags: ``FLAG_REPLY`` (1) on replies, ``FLAG_CLOSE`` (2) when the sender
                closes the connection after this frame, ``FLAG_PACKED`` (4) when the
                header is in the packed form (``shardps.rpc.packed``) instead of protobuf,
                ``FLAG_SHARED`` (8) on a Push or Pull whose bulk bytes are in shared memory
                (the header begins with the region: ``packed.shared_region``)
4         2     method id (``METHOD_IDS``; ``HELLO`` = 0 opens every connection)
6         2     status: a gRPC status code number (0 = OK); 0 in requests
8         8     request id, chosen by the client, echoed by the reply
16        4     timeout in milliseconds (requests; 0 = none): the server's deadline
20        4     message_len
24        4     header_len
28        4     reserved (0)
32        8     payload_len
========  ====  ==========================================================================

A connection carries one call at a time: the client sends its next request after the reply
to the last (a server refuses bytes that follow a request). The protobuf messages are those
of ``protos/``; the data plane adds no message types. The
``HELLO`` exchange that opens a connection carries JSON: the client's metadata (what gRPC
sends as call metadata, e.g. ``authorization``) and, back, the server's frame limit.
"""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import time
from typing import NamedTuple

import numpy as np

from shardps.errors import InvalidArgument
from shardps.rpc import sockio
from shardps.rpc.codec import byte_view

MAGIC = b"SD"
VERSION = 1
PREFIX = struct.Struct("<2sBBHHQIIIIQ")
PREFIX_BYTES = PREFIX.size          # 40
FLAG_REPLY = 1
FLAG_CLOSE = 2
FLAG_PACKED = 4
FLAG_SHARED = 8

HELLO = 0
# The ParameterServer methods the data plane carries (ids are part of the wire format:
# add, never renumber).
METHOD_IDS = {"Push": 1, "Pull": 2, "Exchange": 3, "Replicate": 4, "Step": 5}
METHOD_NAMES = {v: k for k, v in METHOD_IDS.items()}
MAX_METHOD_ID = 0xFFFF


class ProtocolError(InvalidArgument):
    """Bytes that are not a data-plane frame (wrong magic or version, inconsistent lengths)."""


class Prefix(NamedTuple):
    """The fields of a prefix, in wire order (a tuple: built once per frame, cheaply)."""

    magic: bytes
    version: int
    flags: int
    method: int
    status: int
    request_id: int
    timeout_ms: int
    message_len: int
    header_len: int
    reserved: int
    payload_len: int

    @property
    def body_len(self) -> int:
        return self.message_len + self.header_len + self.payload_len


def pack_prefix(flags: int, method: int, status: int, request_id: int, timeout_ms: int,
                message_len: int, header_len: int, payload_len: int) -> bytes:
    return PREFIX.pack(MAGIC, VERSION, flags, method, status, request_id, timeout_ms, message_len,
                       header_len, 0, payload_len)


def unpack_prefix(buf) -> Prefix:
    """Parse the first ``PREFIX_BYTES`` of ``buf``; ProtocolError if they are not a prefix."""
    p = Prefix._make(PREFIX.unpack_from(buf))
    if p.magic != MAGIC:
        raise ProtocolError(f"not a shardps data-plane frame (magic {bytes(p.magic)!r}, expected {MAGIC!r}): "
                            f"is this port the data plane, and do both sides agree on TLS?")
    if p.version != VERSION:
        raise ProtocolError(f"data-plane frame version {p.version}; this side speaks {VERSION}")
    return p


def method_id(method: int | str) -> int:
    """The wire id of ``method`` (a name of ``METHOD_IDS`` or an id in 1..65535)."""
    if isinstance(method, str):
        try:
            return METHOD_IDS[method]
        except KeyError:
            raise InvalidArgument(f"data-plane method {method!r}: known names are "
                                  f"{sorted(METHOD_IDS)}, or pass an id in 1..{MAX_METHOD_ID}") from None
    if not 0 < int(method) <= MAX_METHOD_ID:
        raise InvalidArgument(f"data-plane method id {method}: use 1..{MAX_METHOD_ID} (0 is HELLO)")
    return int(method)


def encode_hello(metadata) -> bytes:
    return json.dumps({"metadata": [[str(k), str(v)] for k, v in metadata]}).encode()


def decode_hello(raw: bytes) -> tuple[tuple[str, str], ...]:
    try:
        doc = json.loads(raw.decode() or "{}")
        return tuple((str(k), str(v)) for k, v in doc.get("metadata", ()))
    except (ValueError, TypeError, AttributeError) as exc:
        raise ProtocolError(f"malformed HELLO: {exc}") from None


def encode_hello_reply(max_frame_bytes: int) -> bytes:
    return json.dumps({"max_frame_bytes": int(max_frame_bytes)}).encode()


def decode_hello_reply(raw: bytes) -> dict:
    try:
        doc = json.loads(raw.decode() or "{}")
        return {"max_frame_bytes": int(doc.get("max_frame_bytes", 0))}
    except (ValueError, TypeError, AttributeError) as exc:
        raise ProtocolError(f"malformed HELLO reply: {exc}") from None


# ====================================================================== frame I/O on one socket
KEEP_BUFFER_BYTES = 64 << 20               # receive buffers larger than this are not kept
INITIAL_BUFFER_BYTES = 64 << 10
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024)
_TLS_COALESCE_BYTES = 64 << 10             # TLS: small pieces are joined into one record
NATIVE_JOIN_BYTES = 64 << 10               # plain sockets: parts this small together are joined


class FrameTooLarge(Exception):
    """A frame declares more bytes than the reader accepts (only its prefix was read)."""

    def __init__(self, prefix: Prefix, limit: int, already: int):
        super().__init__(f"frame of {prefix.body_len} bytes exceeds the limit of {limit}")
        self.prefix = prefix
        self.limit = limit
        self.already = already        # bytes of the frame already read


class PeerClosed(Exception):
    """The peer closed the connection between frames (not an error for a server)."""


class Frame(NamedTuple):
    """One frame read by ``FrameReader``: views into its buffer."""

    prefix: Prefix
    message: memoryview
    header: memoryview
    payload: memoryview


_TIMEVAL = struct.Struct("@ll")


class SocketTimer:
    """Applies deadlines to one socket's operations; ``arm(deadline)`` before each.

    TLS sockets use Python's socket timeouts. Plain sockets stay in blocking mode with kernel
    timeouts (SO_RCVTIMEO / SO_SNDTIMEO), changed only when the one set is shorter than the
    time left or more than 25 % (+10 ms) longer: Python's own timeouts cost a poll() before
    every send and receive and an ioctl per change, a tenth of a small call's CPU. A kernel
    timeout surfaces as BlockingIOError, which the I/O functions below turn into
    socket.timeout."""

    __slots__ = ("sock", "kernel", "native", "current")

    def __init__(self, sock: socket.socket, tls: bool, compiled_io: bool = False):
        self.sock = sock
        self.kernel = not tls
        # frames through ``sockio`` (plain sockets, ``compiled_io``), else Python's socket calls
        self.native = compiled_io and self.kernel and sockio.AVAILABLE
        if self.native:
            sockio.warm_up()                # compiled (or loaded) where it is used, once per process
        self.current = -1.0                 # the kernel timeout now set; 0: none; -1: unknown
        if self.kernel:
            sock.settimeout(None)

    def arm(self, deadline: float | None) -> None:
        if deadline is None:
            if not self.kernel:
                self.sock.settimeout(None)
            elif self.current != 0.0:
                self._set(0.0)
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise socket.timeout("deadline passed")
        if not self.kernel:
            self.sock.settimeout(remaining)
        elif not remaining <= self.current <= remaining * 1.25 + 0.01:
            self._set(remaining)

    def _set(self, seconds: float) -> None:
        whole = int(seconds)
        tv = _TIMEVAL.pack(whole, min(999_999, math.ceil((seconds - whole) * 1e6)))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        self.current = seconds


class FrameReader:
    """One reusable receive buffer; ``read_frame`` fills it with one whole frame. Views it
    returns stay valid until the next ``read_frame``. Not thread-safe (one per connection)."""

    def __init__(self, initial: int = INITIAL_BUFFER_BYTES, keep: int = KEEP_BUFFER_BYTES):
        self.initial = initial
        self.keep = keep
        self._new(initial)

    def _new(self, size: int) -> None:
        self.buf = bytearray(size)
        self.view = memoryview(self.buf)
        self.array = np.frombuffer(self.buf, np.uint8)

    def read_frame(self, timer: SocketTimer, max_body: int, deadline: float | None,
                   first_deadline: float | None = None, into: memoryview | None = None) -> Frame:
        """Read one frame by ``deadline`` (socket.timeout after); with ``first_deadline``
        (later), the wait for its first bytes lasts until then. With ``into`` (writable
        bytes), a frame whose payload has exactly its length is received there, not into this
        reader's buffer (the frame's ``payload`` is then ``into``): a large reply goes to
        its destination without a copy. Raises PeerClosed on EOF before any byte,
        ProtocolError, FrameTooLarge (when the declared body exceeds ``max_body``; the prefix
        alone was read), OSError."""
        if timer.native:
            return self._read_native(timer, max_body, deadline, first_deadline, into)
        try:
            return self._read_frame(timer, max_body, deadline, first_deadline, into)
        except BlockingIOError:                 # a kernel timeout (see SocketTimer)
            raise socket.timeout("timed out") from None

    def _read_frame(self, timer: SocketTimer, max_body: int, deadline: float | None,
                    first_deadline: float | None, into: memoryview | None = None) -> Frame:
        if len(self.buf) > self.keep:           # a one-off huge frame: do not keep its buffer
            self._new(self.initial)
        view = self.view
        sock = timer.sock
        window = None if deadline is None or first_deadline is None else deadline - time.monotonic()
        # greedy: a small frame arrives in one call (where the payload may go to ``into``, at
        # most the initial buffer's worth of it is read here and copied there)
        first = view if into is None else view[:self.initial]
        while True:
            timer.arm(deadline)
            try:
                got = sock.recv_into(first)
                break
            except (socket.timeout, BlockingIOError):
                if window is None or time.monotonic() >= first_deadline:      # type: ignore[operator]
                    raise
                deadline = time.monotonic() + window    # idle: wait another window (same timeout)
        if not got:
            raise PeerClosed()
        while got < PREFIX_BYTES:
            timer.arm(deadline)
            n = sock.recv_into(first[got:])
            if not n:
                raise ProtocolError(f"connection closed inside a frame prefix ({got} bytes)")
            got += n
        prefix = unpack_prefix(view)
        body = prefix.message_len + prefix.header_len + prefix.payload_len
        if body > max_body:
            raise FrameTooLarge(prefix, max_body, got)
        total = PREFIX_BYTES + body
        if got > total:
            raise ProtocolError(f"{got - total} bytes followed a frame before its reply "
                                       f"(one call at a time per connection)")
        b = PREFIX_BYTES + prefix.message_len
        c = b + prefix.header_len
        if into is not None and prefix.payload_len and len(into) == prefix.payload_len:
            view = self._fill(timer, deadline, got, c, total)
            early = max(0, got - c)             # payload bytes read with the header
            if early:
                into[:early] = view[c:got]
            _receive(timer, deadline, into, early, c, total)
            return Frame(prefix, view[PREFIX_BYTES:b], view[b:c], into)
        if got < total:                         # else the first call read it whole: the common case
            view = self._fill(timer, deadline, got, total, total)
        return Frame(prefix, view[PREFIX_BYTES:b], view[b:c], view[c:total])

    def _read_native(self, timer: SocketTimer, max_body: int, deadline: float | None,
                     first_deadline: float | None, into: memoryview | None) -> Frame:
        """``read_frame`` in one compiled call (``sockio.recv_frame``), plain sockets only."""
        if len(self.buf) > self.keep:
            self._new(self.initial)
        window = 0 if deadline is None or first_deadline is None else _ns(deadline - time.monotonic())
        timer.arm(deadline)
        target, first = (sockio.NO_BYTES, len(self.buf)) if into is None else (np.frombuffer(into, np.uint8),
                                                                                self.initial)
        code, got, total, into_got = sockio.recv_frame(timer.sock.fileno(), self.array, 0, first, target, 0,
                                                       _ns(deadline), window, _ns(first_deadline), max_body)
        while code == sockio.GROW or code == sockio.INTERRUPTED:    # (a signal: its handler runs here)
            if code == sockio.GROW:             # a larger buffer, with the bytes read so far
                old = self.view
                self._new(min(max(total, 2 * len(self.buf)), self.keep) if total <= self.keep else total)
                self.view[:got] = old[:got]
            code, got, total, into_got = sockio.recv_frame(timer.sock.fileno(), self.array, got, first, target,
                                                           into_got, _ns(deadline), window, _ns(first_deadline),
                                                           max_body)
        if code != sockio.OK:
            _native_failure(code, got, total, self.view, max_body)
        prefix = Prefix._make(PREFIX.unpack_from(self.view))
        view, b = self.view, PREFIX_BYTES + prefix.message_len
        c = b + prefix.header_len
        payload = into if into is not None and target.shape[0] == prefix.payload_len > 0 else view[c:total]
        return Frame(prefix, view[PREFIX_BYTES:b], view[b:c], payload)

    def _fill(self, timer: SocketTimer, deadline: float | None, got: int, end: int, total: int) -> memoryview:
        """The buffer's view once it holds the first ``end`` bytes of a frame of ``total``
        (``got`` read)."""
        if end > len(self.buf):
            old = self.view
            self._new(min(max(end, 2 * len(self.buf)), self.keep) if end <= self.keep else end)
            self.view[:got] = old[:got]
        _receive(timer, deadline, self.view[:end], got, 0, total)
        return self.view


def _ns(instant: float | None) -> int:
    """A ``time.monotonic()`` instant (or span) in nanoseconds for ``sockio``; 0 for None."""
    return 0 if instant is None else max(1, int(instant * 1e9))


def _native_failure(code: int, got: int, total: int, view: memoryview, max_body: int):
    """Raise what ``read_frame`` raises for ``sockio.recv_frame``'s failure ``code``."""
    if code == sockio.TIMEOUT:
        raise socket.timeout("timed out")
    if code == sockio.PEER_CLOSED:
        raise PeerClosed()
    if code == sockio.CLOSED_IN_PREFIX:
        raise ProtocolError(f"connection closed inside a frame prefix ({got} bytes)")
    if code == sockio.CLOSED_IN_BODY:
        raise ProtocolError(f"connection closed inside a frame ({got} of {total} bytes)")
    if code == sockio.FAILED:                   # the errno in place of the length
        raise OSError(total, os.strerror(total))
    prefix = unpack_prefix(view)                # BAD_PREFIX raises here
    if code == sockio.TOO_LARGE:
        raise FrameTooLarge(prefix, max_body, got)
    raise ProtocolError(f"{got - total} bytes followed a frame before its reply (one call at a time per connection)")


def _receive(timer: SocketTimer, deadline: float | None, dest: memoryview, got: int, at: int, total: int) -> None:
    """Fill ``dest`` from its byte ``got`` on: bytes ``at + got`` onwards of a frame of
    ``total``. ProtocolError where the peer closes first."""
    sock = timer.sock
    while got < len(dest):
        timer.arm(deadline)
        n = sock.recv_into(dest[got:])
        if not n:
            raise ProtocolError(f"connection closed inside a frame ({at + got} of {total} bytes)")
        got += n


def add_views(parts: list, buffers) -> int:
    """Append the non-empty byte views of ``buffers`` (bytes as they are, C-contiguous numpy
    arrays as a cast of their memory, other buffers through ``codec.byte_view``) to
    ``parts``; returns their total length."""
    total = 0
    if buffers:
        for buf in buffers:
            kind = type(buf)
            if kind is bytes:
                v = buf
            elif kind is np.ndarray and buf.flags.c_contiguous and buf.dtype.isbuiltin == 1:
                v = memoryview(buf).cast("B") if buf.size else b""
            else:
                v = byte_view(buf)
            n = len(v)
            if n:
                parts.append(v)
                total += n
    return total


def send_parts(timer: SocketTimer, parts: list, deadline: float | None) -> None:
    """Send ``parts`` (byte views) in order by ``deadline`` (socket.timeout after). On plain
    sockets: one compiled call (``sockio.send_all``) for one part, or for parts of at most
    ``NATIVE_JOIN_BYTES`` together (joined: copying them costs less than the Python around
    ``sendmsg``), else scatter-gather ``sendmsg``; on TLS sockets (no sendmsg) small parts
    are joined and large ones sent as they are."""
    if timer.native and (len(parts) == 1 or sum(map(len, parts)) <= NATIVE_JOIN_BYTES):
        data = np.frombuffer(parts[0] if len(parts) == 1 else b"".join(parts), np.uint8)
        timer.arm(deadline)
        code, sent = sockio.send_all(timer.sock.fileno(), data, 0, _ns(deadline))
        while code == sockio.INTERRUPTED:      # a signal: its handler runs here
            code, sent = sockio.send_all(timer.sock.fileno(), data, sent, _ns(deadline))
        if code == sockio.TIMEOUT:
            raise socket.timeout("timed out")
        if code != sockio.OK:
            raise OSError(-code, os.strerror(-code))
        return
    try:
        _send(timer, parts, deadline)
    except BlockingIOError:                     # a kernel timeout (see SocketTimer)
        raise socket.timeout("timed out") from None


def _send(timer: SocketTimer, parts: list, deadline: float | None) -> None:
    sock = timer.sock
    if not timer.kernel:                        # TLS
        pending = bytearray()
        for p in parts:
            if len(p) < _TLS_COALESCE_BYTES:
                pending += p
                continue
            if pending:
                timer.arm(deadline)
                sock.sendall(pending)
                pending = bytearray()
            timer.arm(deadline)
            sock.sendall(p)
        if pending:
            timer.arm(deadline)
            sock.sendall(pending)
        return
    n = len(parts)
    timer.arm(deadline)
    sent = sock.sendmsg(parts if n <= _IOV_MAX else parts[:_IOV_MAX])
    if sent == sum(map(len, parts)):
        return                                  # all at once: the common case
    i = 0
    while True:
        while sent:                             # past the parts sent whole, into the one sent in part
            size = len(parts[i])
            if sent >= size:
                sent -= size
                i += 1
            else:
                parts[i] = parts[i][sent:]
                sent = 0
        if i >= n:
            return
        timer.arm(deadline)
        sent = sock.sendmsg(parts[i:i + _IOV_MAX])
