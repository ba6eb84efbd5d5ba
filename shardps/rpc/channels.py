"""gRPC servers and channels with shardps's settings: message limits, keepalive, connection
attempts, TLS, health and reflection.

Keepalive (client and server must agree, or the server closes the client's connections):

* A client pings every ``KEEPALIVE_MS`` (10 s) on every connection, with calls or without,
  and gives up on a connection whose ping is not answered within ``KEEPALIVE_TIMEOUT_MS``
  (5 s): a peer cut off by a partition is noticed within 15 s.
* A server accepts pings without calls (``keepalive_permit_without_calls``) as often as every
  ``MIN_PING_INTERVAL_MS`` (5 s), half the clients' interval. A ping that comes sooner is a
  strike; after ``max_ping_strikes`` strikes the server sends GOAWAY "too_many_pings" and
  drops the connection with the calls on it. The margin of 2 absorbs timer jitter and delayed
  pings: a client never pings faster than ``MIN_PING_INTERVAL_MS`` without a bug.
  gRPC's name for this setting is ``grpc.http2.min_ping_interval_without_data_ms``; the
  similar-looking ``grpc.http2.min_recv_ping_interval_without_data_ms`` is not a gRPC setting
  and is silently ignored (the server then allows one ping per 5 minutes, and every idle
  client was cut off after six pings, about a minute).
* Servers also ping idle clients every 60 s (``max_pings_without_data`` 0: pings are not
  limited to connections carrying data) to drop connections of clients that died.

Connection attempts: gRPC calls its minimum connection-attempt time
``grpc.min_reconnect_backoff_ms``: a TCP + TLS + HTTP/2 handshake that has not finished after
it is abandoned, and calls that are not ``wait_for_ready`` then fail with UNAVAILABLE whatever
their deadline. It is ``CONNECT_TIMEOUT_MS`` (5 s): longer than the handshake of a peer that
is paused or busy (a stop signal, a long GC, a loaded host), short enough that an attempt to a
peer cut off by a partition is given up and started again. Reconnection after a refused
attempt still starts after 100 ms (``initial_reconnect_backoff_ms``).
"""

from __future__ import annotations

import ipaddress
import logging
import random
import re
import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shardps.errors import DeadlineExceeded, InvalidArgument, ShardpsError, Unavailable
from shardps.rpc.status import translated
from shardps.settings import MANAGER_PORT

log = logging.getLogger("shardps.rpc")

MAX_MESSAGE_BYTES = 64 << 20   # one chunk is ~1 MiB; this bounds any single message
KEEPALIVE_MS = 10_000          # clients ping this often
KEEPALIVE_TIMEOUT_MS = 5_000   # ... and drop a connection whose ping is unanswered this long
MIN_PING_INTERVAL_MS = 5_000   # servers accept pings this often: KEEPALIVE_MS / 2
CONNECT_TIMEOUT_MS = 5_000     # a connection attempt may take this long
REPLICA_CONNECT_TIMEOUT_MS = 1_500   # ... to one of several manager replicas (manager_channel)

_COMMON = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
SERVER_OPTIONS = _COMMON + [
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ("grpc.http2.max_ping_strikes", 5),
    ("grpc.max_connection_idle_ms", 3_600_000),
    ("grpc.so_reuseport", 0),
]
CLIENT_OPTIONS = _COMMON + [
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS),
]


@dataclass(frozen=True)
class TlsConfig:
    """PEM file contents. ``client_ca`` set on a server requires client certificates (mTLS)."""

    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None
    require_client_cert: bool = False
    server_name_override: str = ""

    @classmethod
    def from_files(cls, cert: str = "", key: str = "", ca: str = "", require_client_cert: bool = False,
                   server_name_override: str = "") -> "TlsConfig | None":
        if not (cert or key or ca):
            return None

        def read(path: str) -> bytes | None:
            if not path:
                return None
            with open(path, "rb") as f:
                return f.read()

        return cls(read(cert), read(key), read(ca), require_client_cert, server_name_override)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=self.require_client_cert)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        pair = (self.key, self.cert) if self.cert and self.key else (None, None)
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=pair[0],
                                            certificate_chain=pair[1])


def new_server(threads: int = 32, handlers=(), interceptors=()) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rpc"),
                         handlers=list(handlers), interceptors=list(interceptors),
                         options=SERVER_OPTIONS, maximum_concurrent_rpcs=threads * 8)
    return server


def add_port(server: grpc.Server, address: str, tls: TlsConfig | None = None) -> int:
    """Bind ``address`` (port 0 picks a free one); returns the bound port."""
    if tls is not None and tls.cert:
        port = server.add_secure_port(address, tls.server_credentials())
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind {address}: is the port in use?")
    return port


def add_health_and_reflection(server: grpc.Server, service_names: list[str]) -> health.HealthServicer:
    """Standard grpc.health.v1 (overall and per service) and server reflection."""
    servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = list(service_names) + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                   reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    for name in [""] + list(service_names):
        servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    return servicer


def add_health(server: grpc.Server, servicer: health.HealthServicer) -> None:
    """Serve ``servicer`` (of ``add_health_and_reflection``) on ``server`` too."""
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)


def set_serving(servicer: health.HealthServicer, service_names: list[str], serving: bool, *,
                overall: bool = True) -> None:
    """SERVING or NOT_SERVING for each of ``service_names`` and, with ``overall``, for the
    server as a whole ("")."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ([""] if overall else []) + list(service_names):
        servicer.set(name, status)


def channel(address: str, tls: TlsConfig | None = None, options=()) -> grpc.Channel:
    """A client channel with ``CLIENT_OPTIONS``; ``options`` add to them or replace them."""
    replaced = {key for key, _ in options}
    opts = [o for o in CLIENT_OPTIONS if o[0] not in replaced] + list(options)
    if tls is not None and tls.server_name_override:
        opts.append(("grpc.ssl_target_name_override", tls.server_name_override))
    if tls is not None and tls.ca:
        return grpc.secure_channel(address, tls.channel_credentials(), options=opts)
    return grpc.insecure_channel(address, options=opts)


# gRPC targets whose scheme has no port to default: passed on as they are
_PORTLESS_SCHEMES = ("unix:", "unix-abstract:", "vsock:", "ipv4:", "ipv6:")
_HOST_NAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?\.?")


def target(address: str, default_port: int = MANAGER_PORT, what: str = "manager address") -> str:
    """``address`` as a gRPC target that names its port: ``host`` and ``host:`` become
    ``host:default_port``, ``[v6]`` and ``v6`` (an IPv6 literal without brackets, as gRPC reads
    one) ``[v6]:default_port``, the endpoint of ``dns:[//authority/]host`` likewise (gRPC
    itself would use 443 for all of these); ``host:port``, ``[v6]:port``, ``unix:``,
    ``ipv4:``/``ipv6:`` lists and ``vsock:`` targets are kept. InvalidArgument naming
    ``address`` (and ``what`` it is) otherwise: a port out of 1..65535, an empty or malformed
    host, another URL scheme."""
    text = address.strip() if isinstance(address, str) else ""
    if not text or any(c.isspace() or c == "," for c in text):
        raise _bad_address(address, what, "expected host:port, host (port "
                           f"{default_port}), [IPv6]:port or unix:/path")
    if text.startswith(_PORTLESS_SCHEMES):
        return text
    prefix = ""
    if text.startswith("dns:"):
        authority = re.match(r"dns:(//[^/]*/)?", text)
        prefix = authority.group(0) if authority else "dns:"
        text = text[len(prefix):]
    if "://" in text:
        raise _bad_address(address, what, f"{text.split('://')[0]}:// is not a gRPC target: give "
                           "host:port (or dns:///host:port)")
    host, port = _split_host_port(address, what, text)
    if port is None:
        return f"{prefix}{host}:{default_port}"
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise _bad_address(address, what, f"port {port!r} is not a number in 1..65535")
    return f"{prefix}{host}:{int(port)}"


def _split_host_port(address: str, what: str, text: str) -> tuple[str, str | None]:
    """(host, port or None) of ``text``; an IPv6 host comes back in brackets."""
    if text.startswith("["):
        end = text.find("]")
        host, rest = text[1:end], text[end + 1:]
        if end < 0 or (rest and not rest.startswith(":")):
            raise _bad_address(address, what, "an IPv6 address goes in brackets: [::1]:port")
        return f"[{_ipv6(address, what, host)}]", rest[1:] or None
    if text.count(":") > 1:                     # an IPv6 literal without brackets has no port
        return f"[{_ipv6(address, what, text)}]", None
    host, _, port = text.partition(":")
    if not _HOST_NAME.fullmatch(host):
        raise _bad_address(address, what, f"host {host!r} is not a host name or an IP address")
    return host, port or None


def _ipv6(address: str, what: str, host: str) -> str:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        raise _bad_address(address, what, f"{host!r} is not an IPv6 address (with a port: "
                           "[::1]:port)") from None
    return host


def _bad_address(address, what: str, reason: str) -> InvalidArgument:
    return InvalidArgument(f"{what} {address!r}: {reason}")


def manager_targets(addresses: str) -> list[str]:
    """The manager addresses of ``addresses`` (comma-separated: the replicas), each a gRPC
    target with its port (``target``: the manager's port, 7070, where none is given).
    InvalidArgument naming the address that is not one."""
    if not isinstance(addresses, str):
        raise _bad_address(addresses, "manager address", "must be a string 'host:port'")
    parts = [a.strip() for a in addresses.split(",") if a.strip()]
    return [target(part) for part in parts] or [target(addresses)]


def manager_channel(addresses: str, tls: TlsConfig | None = None, options=()) -> grpc.Channel:
    """A channel to the resource manager: ``host:port`` (one manager, a plain channel), or
    ``host:port,host:port,...`` (replicas on one etcd): a ``failover.FailoverChannel`` that
    follows the leader (see there). An address without a port takes the manager's (7070):
    ``manager_targets``, which raises InvalidArgument naming an address that is not one."""
    parts = manager_targets(addresses)
    if len(parts) == 1:
        return channel(parts[0], tls, options)
    from shardps.rpc.failover import FailoverChannel
    # a replica whose handshake takes longer than this is hung or cut off: try another
    opts = [("grpc.min_reconnect_backoff_ms", REPLICA_CONNECT_TIMEOUT_MS)] + list(options)
    return FailoverChannel(parts, lambda address: channel(address, tls, opts))


@dataclass(frozen=True)
class RetryPolicy:
    """Pauses between attempts of an idempotent call that failed with UNAVAILABLE: jittered
    (0.5x to 1.5x), doubling from ``initial_seconds`` up to ``max_seconds``. The call's
    deadline bounds the whole; see ``call_with_retries``."""

    initial_seconds: float = 0.05
    max_seconds: float = 1.0
    multiplier: float = 2.0


RETRY = RetryPolicy()
_LAST_ATTEMPT_SECONDS = 0.005    # less time left than this: no attempt can succeed


def call_with_retries(attempt, timeout: float, policy: RetryPolicy = RETRY, *,
                      clock=time.monotonic, sleep=time.sleep, jitter=random.random):
    """``attempt(seconds_left)`` until it returns, retrying while it raises the ``ShardpsError``
    of a call that failed with UNAVAILABLE (``status``: the peer is down, starting, or the
    connection broke; a CANCELLED call, also ``Unavailable``, is not retried) for up to
    ``timeout`` seconds in all; attempts make their calls inside ``status.translated``.
    Raises any other error at once, and the last UNAVAILABLE once the deadline leaves no time
    for another attempt. Only for idempotent calls: an UNAVAILABLE call may have been
    executed. ``sleep(seconds)`` pauses between attempts; one that returns True
    (``threading.Event.wait`` of a set event: the caller is closing) ends the retries with the
    last error. Blocking; thread-safe."""
    deadline = clock() + timeout
    delay = policy.initial_seconds
    while True:
        try:
            return attempt(max(_LAST_ATTEMPT_SECONDS, deadline - clock()))
        except ShardpsError as err:
            if err.status != "UNAVAILABLE" or not isinstance(err, Unavailable):
                raise                   # a wrong address or TLS setting is final (status.from_rpc_error)
            if sleep(max(0.0, min(delay * (0.5 + jitter()), deadline - clock()))):
                raise
            if deadline - clock() < _LAST_ATTEMPT_SECONDS:
                raise
            delay = min(delay * policy.multiplier, policy.max_seconds)


UNREACHABLE_WARNING_SECONDS = 5.0     # while a peer cannot be reached, a warning this often


class UnreachableWarnings:
    """While the calls to ``peer`` ("the manager at host:port") keep failing with UNAVAILABLE,
    a WARNING every ``every`` seconds (the first after ``every`` seconds) naming it, how long
    it has failed, gRPC's reason and what to check; one INFO line once it answers again.
    Told of every attempt: ``attempted(err)`` of a failed one (its ``ShardpsError``),
    ``answered()`` of a reply.
    Thread-safe; ``clock`` is passed in."""

    def __init__(self, peer: str, every: float | None = None, clock=time.monotonic):
        self.peer = peer
        self.every = UNREACHABLE_WARNING_SECONDS if every is None else every
        self.clock = clock
        self.warnings = 0                       # warnings logged since the peer last answered
        self._since: float | None = None        # the first failure since the peer last answered
        self._last = 0.0                        # the last warning (or that first failure)
        self._lock = threading.Lock()

    def attempted(self, err: ShardpsError) -> None:
        """An attempt failed with ``err``: a call that ended UNAVAILABLE (no connection;
        ``status``) counts towards the warnings; DeadlineExceeded (a hung peer gives it too)
        changes nothing; any other error is an answer."""
        if err.status == "UNAVAILABLE" and isinstance(err, Unavailable):
            self.failed(f"UNAVAILABLE: {err.details}" if err.details else "UNAVAILABLE")
        elif not isinstance(err, DeadlineExceeded):
            self.answered()

    def failed(self, reason: str) -> None:
        now = self.clock()
        with self._lock:
            if self._since is None:
                self._since = self._last = now
                return
            if now - self._last < self.every:
                return
            self._last = now
            self.warnings += 1
            waited = now - self._since
        log.warning("cannot reach %s (for %.0fs; %s): check that it is running and listening there, "
                    "that the address (--manager, SHARDPS_MANAGER; port %d where none is given) is "
                    "right, and that this host can connect to it (network, firewall, TLS settings); "
                    "still trying", self.peer, waited, reason, MANAGER_PORT)

    def answered(self) -> None:
        with self._lock:
            since, warned = self._since, self.warnings
            self._since, self.warnings = None, 0
        if since is not None and warned:
            log.info("reached %s after %.0fs", self.peer, self.clock() - since)


def check_health(address: str, service: str = "", timeout: float = 3.0,
                 tls: TlsConfig | None = None) -> str:
    """The health status name of ``service`` at ``address`` (SERVING, NOT_SERVING, ...).
    An unreachable address is tried again until ``timeout``; then raises its ``ShardpsError``
    (``Unavailable``, or ``DeadlineExceeded`` when a connection stalled; ``status`` and
    ``details`` say what gRPC reported)."""
    with channel(address, tls) as ch:
        stub = health_pb2_grpc.HealthStub(ch)

        def attempt(left: float):
            with translated(f"health check of {address}"):
                return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=left)

        resp = call_with_retries(attempt, timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
