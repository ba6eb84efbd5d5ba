"""The data plane's shared pieces (``shardps.rpc.dataplane`` describes the whole): the frame
limit, the status numbers of the wire, addresses, TLS contexts and socket helpers used by both
``dataplane_server`` and ``dataplane_client``."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import tempfile
from typing import Any

import grpc

from shardps.errors import InvalidArgument

MAX_FRAME_BYTES = (1 << 30) + (16 << 20)   # a whole push up to max_request_bytes (1 GiB) + header
_STATUS_BY_NUMBER = {c.value[0]: c for c in grpc.StatusCode}
_OK = grpc.StatusCode.OK.value[0]
_INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
_RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
_INTERNAL = grpc.StatusCode.INTERNAL.value[0]
_FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]


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
