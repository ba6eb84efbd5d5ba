"""A data-plane frame's socket I/O in compiled code that runs without the interpreter lock.

``send_all`` sends one buffer; ``recv_frame`` reads one whole frame (its 40-byte prefix
checked, its lengths read, the rest received into a buffer, and a payload of the length the
caller expects into the caller's own buffer). Each is one call from Python however many
``send``/``recv`` calls the bytes take: the blocking waits and the bookkeeping between them
run in numba-compiled code (``nogil``), so another thread of the process (a worker's training
loop) keeps the interpreter while a call waits for its reply. ``frames.FrameReader`` and
``frames.send_parts`` use them on plain sockets (TCP and Unix; TLS sockets go through
Python's ``ssl``) where the data plane is built with ``compiled_io=True``. It is not the
default: ``python -m shardps.tools.bench --only transport`` measures a small call at about
10 us more (client and server CPU together) than with Python's socket calls, which release
the interpreter lock around their system calls too.

The calls reach libc's ``send``, ``recv``, ``clock_gettime`` and ``errno`` by name (numba
intrinsics), so numba caches the compiled code like any other kernel. Deadlines are
``time.monotonic()`` instants in nanoseconds (0: none); the socket's kernel timeout
(``frames.SocketTimer``) bounds each wait, and a wait that ends at the kernel timeout ends the
call once the deadline has passed.
"""

from __future__ import annotations

import sys

import numpy as np

from shardps import kernels
from shardps.kernels import _JIT, njit

# Linux: the intrinsics name glibc's (and musl's) ``__errno_location``
AVAILABLE = kernels.AVAILABLE and sys.platform.startswith("linux")

# recv_frame's codes (send_all answers OK, TIMEOUT, INTERRUPTED or an errno as -errno)
(OK, TIMEOUT, PEER_CLOSED, CLOSED_IN_PREFIX, CLOSED_IN_BODY, BAD_PREFIX, TOO_LARGE, TRAILING, GROW, FAILED,
 INTERRUPTED) = range(11)
PREFIX_BYTES = 40
_EAGAIN, _EINTR = 11, 4
_MSG_NOSIGNAL = 0x4000
NO_BYTES = np.empty(0, np.uint8)

if AVAILABLE:                               # pragma: no branch - numba is a dependency
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    _I32, _I64 = ir.IntType(32), ir.IntType(64)
    _PTR = ir.IntType(8).as_pointer()

    def _libc(builder, name: str, ret, args):
        return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)

    def _transfer(name: str):
        """An intrinsic calling libc's ``name`` (send or recv): (fd, address, bytes, flags)."""
        def typer(typingctx, fd, address, n, flags):
            def codegen(context, builder, signature, args):
                fd, address, n, flags = args
                fn = _libc(builder, name, _I64, [_I32, _PTR, _I64, _I32])
                return builder.call(fn, [builder.trunc(fd, _I32), builder.inttoptr(address, _PTR), n,
                                         builder.trunc(flags, _I32)])
            return types.int64(types.int64, types.int64, types.int64, types.int64), codegen
        return intrinsic(typer)

    _send = _transfer("send")
    _recv = _transfer("recv")

    @intrinsic
    def _errno(typingctx):
        def codegen(context, builder, signature, args):
            where = builder.call(_libc(builder, "__errno_location", _I32.as_pointer(), []), [])
            return builder.sext(builder.load(where), _I64)
        return types.int64(), codegen

    @intrinsic
    def _monotonic_ns(typingctx):
        """``clock_gettime(CLOCK_MONOTONIC)`` in nanoseconds: ``time.monotonic()``'s clock."""
        def codegen(context, builder, signature, args):
            spec = cgutils.alloca_once(builder, ir.ArrayType(_I64, 2))
            builder.call(_libc(builder, "clock_gettime", _I32, [_I32, _PTR]),
                         [ir.Constant(_I32, 1), builder.bitcast(spec, _PTR)])
            zero = ir.Constant(_I32, 0)
            seconds = builder.load(builder.gep(spec, [zero, zero]))
            nanos = builder.load(builder.gep(spec, [zero, ir.Constant(_I32, 1)]))
            return builder.add(builder.mul(seconds, ir.Constant(_I64, 1_000_000_000)), nanos)
        return types.int64(), codegen
else:                                       # pragma: no cover
    def _send(fd, address, n, flags):
        raise NotImplementedError

    _recv = _send


@njit(**_JIT)
def _wait_over(deadline_ns):
    """After a receive or send that the kernel timeout ended: whether the deadline passed."""
    return deadline_ns > 0 and _monotonic_ns() >= deadline_ns


@njit(**_JIT)
def send_all(fd, data, sent, deadline_ns):
    """Send the bytes of ``data`` from byte ``sent`` on. Returns (OK, TIMEOUT, INTERRUPTED or
    -errno; the bytes sent so far). INTERRUPTED: a signal came (the send failed with EINTR,
    or was cut short); call again from there once Python has run its handlers."""
    address = data.ctypes.data
    size = data.shape[0]
    while sent < size:
        n = _send(fd, address + sent, size - sent, _MSG_NOSIGNAL)
        if n < 0:
            error = _errno()
            if error == _EINTR:
                return INTERRUPTED, sent
            if error == _EAGAIN and not _wait_over(deadline_ns):
                continue
            return (TIMEOUT if error == _EAGAIN else -error), sent
        sent += n
        if sent < size:         # a blocking send cut short: by a signal (or the kernel timeout)
            return (TIMEOUT if _wait_over(deadline_ns) else INTERRUPTED), sent
    return OK, sent


@njit(**_JIT)
def _fill(fd, buf, got, need, limit, deadline_ns, window_ns=0, first_deadline_ns=0):
    """Receive into ``buf`` from byte ``got`` until it holds ``need`` bytes, reading no further
    than byte ``limit``: (OK, CLOSED_IN_BODY: the peer closed first, INTERRUPTED, TIMEOUT or
    FAILED; bytes in ``buf``; the errno of FAILED). Before the first byte (``got`` 0), a wait
    that the kernel timeout ends starts another of ``window_ns`` until ``first_deadline_ns``
    (an idle connection)."""
    address = buf.ctypes.data
    while got < need:
        n = _recv(fd, address + got, limit - got, 0)
        if n > 0:
            got += n
            continue
        if n == 0:
            return CLOSED_IN_BODY, got, 0
        error = _errno()
        if error == _EINTR:
            return INTERRUPTED, got, 0
        if error != _EAGAIN:
            return FAILED, got, error
        now = _monotonic_ns()
        if got == 0 and now < first_deadline_ns:
            deadline_ns = now + window_ns           # idle between frames: wait another window
        elif deadline_ns > 0 and now >= deadline_ns:
            return TIMEOUT, got, 0
    return OK, got, 0


@njit(**_JIT)
def _u32(buf, at):
    return np.int64(buf[at]) | np.int64(buf[at + 1]) << 8 | np.int64(buf[at + 2]) << 16 | np.int64(buf[at + 3]) << 24


@njit(**_JIT)
def recv_frame(fd, buf, got, first, into, into_got, deadline_ns, window_ns, first_deadline_ns, max_body):
    """Receive one frame into ``buf`` (its first ``got`` bytes already there; ``into_got`` of
    its payload in ``into``). Returns (code, bytes of the frame in ``buf``, the frame's
    length, or where ``buf`` must reach, or the errno of FAILED; bytes of the payload in
    ``into``).

    * Until the prefix is in, at most ``first`` bytes are read (greedy: a small frame
      arrives in one call). Before its first byte, a wait that the kernel timeout ends
      starts another of ``window_ns`` until ``first_deadline_ns`` (an idle connection).
    * A frame whose payload is exactly ``into``'s length (``into`` not empty) has its
      payload received there, the rest in ``buf``.
    * GROW: ``buf`` is too small; give a larger one holding the same first ``got`` bytes
      and call again. INTERRUPTED: a signal came; call again with the counts returned once
      Python has run its handlers. BAD_PREFIX, TOO_LARGE (over ``max_body``), TRAILING
      (bytes past the frame): the prefix is in ``buf``; PEER_CLOSED: closed before any byte.
    """
    code, got, error = _fill(fd, buf, got, PREFIX_BYTES, first, deadline_ns, window_ns, first_deadline_ns)
    if code == CLOSED_IN_BODY:
        return (PEER_CLOSED if got == 0 else CLOSED_IN_PREFIX), got, 0, 0
    if code != OK:
        return code, got, error, 0
    if buf[0] != 83 or buf[1] != 68 or buf[2] != 1:          # b"SD", version 1
        return BAD_PREFIX, got, 0, 0
    head = PREFIX_BYTES + _u32(buf, 20) + _u32(buf, 24)
    payload = _u32(buf, 32) | _u32(buf, 36) << 32
    if payload < 0 or head - PREFIX_BYTES + payload > max_body:
        return TOO_LARGE, got, 0, 0
    total = head + payload
    if got > total:
        return TRAILING, got, total, 0
    direct = into.shape[0] > 0 and into.shape[0] == payload
    end = head if direct else total
    if end > buf.shape[0]:
        return GROW, got, end, 0
    code, got, error = _fill(fd, buf, got, end, end, deadline_ns)
    if code != OK or not direct:
        return code, got, (error if code == FAILED else total), 0
    early = got - head                      # payload bytes read with the prefix
    if early > 0 and into_got < early:
        into[:early] = buf[head:got]
    code, into_got, error = _fill(fd, into, max(early, into_got), payload, payload, deadline_ns)
    return code, got, (error if code == FAILED else total), into_got


_WARM = False


def warm_up() -> None:
    """Compile (or load from numba's cache) both calls, for the buffers the data plane
    passes: a writable receive buffer, read-only bytes to send. Once per process: a
    ``frames.SocketTimer`` that uses them calls it (the data plane's default does not)."""
    global _WARM
    if AVAILABLE and not _WARM:
        _WARM = True
        done = np.frombuffer(b"", np.uint8)
        send_all(-1, done, 0, 0)
        recv_frame(-1, np.zeros(PREFIX_BYTES, np.uint8), PREFIX_BYTES, PREFIX_BYTES, NO_BYTES, 0, 0, 0, 0, 0)
