"""``NodePeers``: a server node's calls to other nodes, replication over the data plane.

A primary forwards every push's operations to its backups and waits for them before it
acknowledges: the forward is on the push's critical path, holding the push's block locks.
Over gRPC (a client-streaming call: a thread per call in grpc Python) it cost more CPU than
the push itself; over the data plane it is one frame each way on a kept connection.

``replicate`` asks each peer once for its data-plane address (``OpenDataPlane``, over gRPC,
with the cluster's credential) and sends ``Replicate`` frames there (a ``ReplicateHeader``
and the ops' arrays raw); a peer without a data plane is served by ``GrpcPeers``. A call
that finds the peer unavailable forgets its address (a restarted server listens on another
port). Block loads (copies, resyncs: rare, large) stay on gRPC. ``abandon`` fails the calls
in flight on both at once.
"""

from __future__ import annotations

import logging
import threading

import grpc

from shardps.errors import Unavailable
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.rpc.dataplane import DataPlanePool
from shardps.rpc.replication import out_of_sync, replicate_header
from shardps.rpc.status import from_rpc_error
from shardps.rpc.stubs import GrpcPeers

log = logging.getLogger("shardps.server")


class NodePeers:
    """``Peers`` (``server.node.replication``): replication over the data plane where the
    peer serves one, everything else through ``grpc`` (a ``GrpcPeers``). Thread-safe."""

    def __init__(self, grpc_peers: GrpcPeers, pool: DataPlanePool):
        self.grpc = grpc_peers
        self.pool = pool
        self._lock = threading.Lock()
        self._planes: dict[str, str] = {}       # peer's gRPC address -> data-plane address ("": none)
        self._used: dict[str, str] = {}         # node name -> data-plane address last called

    def replicate(self, node, epoch, ops, arrays):
        """Send the frame now; the answer reads the backup's acknowledgement (the connection
        stays taken until then)."""
        address = self.grpc.address(node)
        plane = self._plane(node, address, ops[0].job if ops else "")
        if not plane:
            return self.grpc.replicate(node, epoch, ops, arrays)
        nbytes = sum(a.nbytes for a in arrays)
        header = replicate_header(epoch, self.grpc.node_name, ops, nbytes)
        with self._lock:
            self._used[node] = plane
        try:
            sent = self.pool.start(plane, "Replicate", header, arrays, timeout=self.grpc.timeout + nbytes / 20e6)
        except Unavailable as exc:
            raise self._lost(node, address, exc) from None

        def answer() -> list:
            try:
                raw, _ = self.pool.finish(sent)
            except Unavailable as exc:
                raise self._lost(node, address, exc) from None
            return out_of_sync(ps.ReplicateAck.FromString(raw))
        return answer

    def _lost(self, node: str, address: str, exc: Unavailable) -> Unavailable:
        """A replicate to ``node`` found it unavailable: its data-plane address is asked
        again next time (a restarted server listens on another port)."""
        with self._lock:
            self._planes.pop(address, None)
        return Unavailable(f"replicate to {node}: {exc.message}")

    def load_blocks(self, node, epoch, snapshots, resync=False):
        return self.grpc.load_blocks(node, epoch, snapshots, resync)

    def abandon(self, node: str) -> int:
        with self._lock:
            plane = self._used.pop(node, "")
        return self.grpc.abandon(node) + (self.pool.abandon(plane) if plane else 0)

    def close(self) -> None:
        self.pool.close()

    def _plane(self, node: str, address: str, job: str) -> str:
        """The data-plane address of ``node``, the peer at gRPC ``address`` ("" where it has
        none or cannot say now: gRPC this time). ``abandon(node)`` cancels the asking."""
        with self._lock:
            known = self._planes.get(address)
        if known is not None:
            return known
        try:
            resp = self.grpc.open_data_plane(node, address, job)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.CANCELLED:          # abandoned: declared dead
                raise from_rpc_error(err, f"OpenDataPlane on {address}") from None
            if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                return ""                                        # not now: gRPC this time
            resp = ps.OpenDataPlaneResponse()
        with self._lock:
            self._planes[address] = resp.address
        if not resp.address:
            log.info("peer at %s has no data plane: replicating over gRPC", address)
        return resp.address
