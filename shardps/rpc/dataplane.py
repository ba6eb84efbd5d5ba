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

The code: ``dataplane_sockets`` (addresses, TLS contexts, socket helpers), ``dataplane_server``
(``DataPlaneServer``), ``dataplane_client`` (``DataPlaneConnection``, ``DataPlanePool``). This
module is the public API: import from here.
"""

from __future__ import annotations

from shardps.rpc.dataplane_client import DataPlaneConnection, DataPlanePool
from shardps.rpc.dataplane_server import DataPlaneCall, DataPlaneLimits, DataPlaneServer, Handler
from shardps.rpc.dataplane_sockets import MAX_FRAME_BYTES, client_ssl_context, parse_address, server_ssl_context

__all__ = ["MAX_FRAME_BYTES", "DataPlaneCall", "DataPlaneConnection", "DataPlaneLimits", "DataPlanePool",
           "DataPlaneServer", "Handler", "client_ssl_context", "parse_address", "server_ssl_context"]
