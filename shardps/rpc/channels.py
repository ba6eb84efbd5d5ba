"""gRPC servers and channels with shardps's settings: message limits, keepalive, TLS, health
and reflection.

Keepalive: clients ping every 10 s (a peer cut off by a partition is noticed within 15 s);
servers accept pings every 10 s or slower (a server that is stricter than its clients closes
connections with "too_many_pings").
"""

from __future__ import annotations

from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

MAX_MESSAGE_BYTES = 64 << 20   # one chunk is ~1 MiB; this bounds any single message

_COMMON = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
SERVER_OPTIONS = _COMMON + [
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 5),
    ("grpc.max_connection_idle_ms", 3_600_000),
    ("grpc.so_reuseport", 0),
]
CLIENT_OPTIONS = _COMMON + [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    ("grpc.min_reconnect_backoff_ms", 100),
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


def set_serving(servicer: health.HealthServicer, service_names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in [""] + list(service_names):
        servicer.set(name, status)


def channel(address: str, tls: TlsConfig | None = None, options=()) -> grpc.Channel:
    opts = CLIENT_OPTIONS + list(options)
    if tls is not None and tls.server_name_override:
        opts.append(("grpc.ssl_target_name_override", tls.server_name_override))
    if tls is not None and tls.ca:
        return grpc.secure_channel(address, tls.channel_credentials(), options=opts)
    return grpc.insecure_channel(address, options=opts)


def check_health(address: str, service: str = "", timeout: float = 3.0,
                 tls: TlsConfig | None = None) -> str:
    """The health status name of ``service`` at ``address`` (SERVING, NOT_SERVING, ...);
    raises grpc.RpcError when unreachable."""
    with channel(address, tls) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
