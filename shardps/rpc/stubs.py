"""Client-side gRPC stubs of the shardps services, with shardps's codecs and channel settings.

* ``ParameterServerStub``: the callables of ``shardps.v1.ParameterServer`` (bulk messages are
  encoded and decoded with ``shardps.rpc.codec``: pushes send pre-encoded chunk bytes, pulls
  and snapshots come back as ``codec.Chunk``).
* ``ManagerStub``: the callables of ``shardps.v1.ResourceManager`` (a server's registration
  and heartbeats among them).
* ``StubPool``: one channel and ``ParameterServerStub`` per server address.
* ``GrpcPeers``: a server node's calls to other nodes (replication, block loads).

Workers, the manager and server nodes all call servers through these; none of this imports
``shardps.server``. Stubs raise ``grpc.RpcError``: callers make their calls inside
``shardps.rpc.status.translated(what)`` and see ``ShardpsError`` instead.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterable

import grpc

from shardps.blockops import BlockSnapshot
from shardps.errors import Unavailable
from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import manager_pb2 as mg
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.rpc import channels
from shardps.rpc.codec import CHUNK_BYTES, decode_chunk, encode_chunk, split_payload
from shardps.rpc.replication import out_of_sync, replicate_header, state_message
from shardps.rpc.status import from_rpc_error

SERVICE = "shardps.v1.ParameterServer"
MANAGER = "shardps.v1.ResourceManager"
_IDENTITY = bytes


class ParameterServerStub:
    """Client-side callables of the ParameterServer service with shardps's codecs."""

    def __init__(self, ch: grpc.Channel):
        p = f"/{SERVICE}/"
        self.Push = ch.stream_unary(p + "Push", request_serializer=_IDENTITY,
                                    response_deserializer=ps.PushAck.FromString)
        self.Pull = ch.unary_stream(p + "Pull", request_serializer=ps.PullRequest.SerializeToString,
                                    response_deserializer=decode_chunk)
        self.ProbeSharedMemory = ch.unary_unary(
            p + "ProbeSharedMemory", request_serializer=ps.ProbeSharedMemoryRequest.SerializeToString,
            response_deserializer=ps.ProbeSharedMemoryResponse.FromString)
        self.Replicate = ch.stream_unary(p + "Replicate", request_serializer=_IDENTITY,
                                         response_deserializer=ps.ReplicateAck.FromString)
        self.InstallShardMap = ch.unary_unary(
            p + "InstallShardMap", request_serializer=ps.InstallShardMapRequest.SerializeToString,
            response_deserializer=ps.InstallShardMapResponse.FromString)
        self.CopyBlocks = ch.unary_unary(p + "CopyBlocks",
                                         request_serializer=ps.CopyBlocksRequest.SerializeToString,
                                         response_deserializer=ps.CopyBlocksResponse.FromString)
        self.LoadBlocks = ch.stream_unary(p + "LoadBlocks", request_serializer=_IDENTITY,
                                          response_deserializer=ps.LoadBlocksResponse.FromString)
        self.SnapshotBlocks = ch.unary_stream(
            p + "SnapshotBlocks", request_serializer=ps.SnapshotBlocksRequest.SerializeToString,
            response_deserializer=decode_chunk)
        self.HoldJob = ch.unary_unary(p + "HoldJob", request_serializer=ps.HoldJobRequest.SerializeToString,
                                      response_deserializer=ps.HoldJobResponse.FromString)
        self.DropTables = ch.unary_unary(p + "DropTables",
                                         request_serializer=ps.DropTablesRequest.SerializeToString,
                                         response_deserializer=ps.DropTablesResponse.FromString)
        self.OpenDataPlane = ch.unary_unary(
            p + "OpenDataPlane", request_serializer=ps.OpenDataPlaneRequest.SerializeToString,
            response_deserializer=ps.OpenDataPlaneResponse.FromString)
        self.GetNodeStatus = ch.unary_unary(p + "GetNodeStatus",
                                            request_serializer=ps.GetNodeStatusRequest.SerializeToString,
                                            response_deserializer=ps.NodeStatus.FromString)


class ManagerStub:
    """Client-side callables of the ResourceManager service (plain protobuf messages)."""

    def __init__(self, ch: grpc.Channel):
        def unary(name, req, resp):
            return ch.unary_unary(f"/{MANAGER}/{name}", request_serializer=req.SerializeToString,
                                  response_deserializer=resp.FromString)
        self.RegisterServer = unary("RegisterServer", mg.RegisterServerRequest, mg.RegisterServerResponse)
        self.ServerHeartbeat = unary("ServerHeartbeat", mg.ServerHeartbeatRequest, mg.ServerHeartbeatResponse)
        self.CreateJob = unary("CreateJob", mg.CreateJobRequest, mg.CreateJobResponse)
        self.EndJob = unary("EndJob", mg.EndJobRequest, mg.EndJobResponse)
        self.CreateTable = unary("CreateTable", mg.CreateTableRequest, mg.CreateTableResponse)
        self.CreateTables = unary("CreateTables", mg.CreateTablesRequest, mg.CreateTablesResponse)
        self.DescribeTable = unary("DescribeTable", mg.DescribeTableRequest, pb.TablePlacement)
        self.ListTables = unary("ListTables", mg.ListTablesRequest, mg.ListTablesResponse)
        self.UpdateTableConfig = unary("UpdateTableConfig", mg.UpdateTableConfigRequest, pb.TableConfig)
        self.UpdateTableConfigs = unary("UpdateTableConfigs", mg.UpdateTableConfigsRequest,
                                        mg.UpdateTableConfigsResponse)
        self.DeleteTable = unary("DeleteTable", mg.DeleteTableRequest, mg.DeleteTableResponse)
        self.GetShardMap = unary("GetShardMap", mg.GetShardMapRequest, pb.ShardMap)
        self.JoinWorkerGroup = unary("JoinWorkerGroup", mg.JoinWorkerGroupRequest, mg.JoinWorkerGroupResponse)
        self.LeaveWorkerGroup = unary("LeaveWorkerGroup", mg.LeaveWorkerGroupRequest,
                                      mg.LeaveWorkerGroupResponse)
        self.WorkerHeartbeat = unary("WorkerHeartbeat", mg.WorkerHeartbeatRequest, mg.WorkerHeartbeatResponse)
        self.GetClusterStatus = unary("GetClusterStatus", mg.GetClusterStatusRequest, mg.ClusterStatus)
        self.DrainServer = unary("DrainServer", mg.DrainServerRequest, mg.DrainServerResponse)
        self.Checkpoint = unary("Checkpoint", mg.CheckpointRequest, mg.CheckpointResponse)
        self.CheckpointBarrier = unary("CheckpointBarrier", mg.CheckpointBarrierRequest,
                                       mg.CheckpointBarrierResponse)
        self.Restore = unary("Restore", mg.RestoreRequest, mg.RestoreResponse)
        self.GetWorkerState = unary("GetWorkerState", mg.GetWorkerStateRequest, mg.GetWorkerStateResponse)
        self.ResetLostBlocks = unary("ResetLostBlocks", mg.ResetLostBlocksRequest, mg.ResetLostBlocksResponse)


class StubPool:
    """One channel and stub per address, created on first use. Thread-safe."""

    def __init__(self, tls=None, metadata=()):
        self._tls = tls
        self._lock = threading.Lock()
        self._stubs: dict[str, tuple[grpc.Channel, ParameterServerStub]] = {}
        self.metadata = tuple(metadata)

    def get(self, address: str) -> ParameterServerStub:
        with self._lock:
            entry = self._stubs.get(address)
            if entry is None:
                ch = channels.channel(address, self._tls)
                entry = self._stubs[address] = (ch, ParameterServerStub(ch))
            return entry[1]

    def close(self) -> None:
        with self._lock:
            for ch, _ in self._stubs.values():
                ch.close()
            self._stubs.clear()


def encode_snapshots(snapshots: Iterable[BlockSnapshot], epoch: int, chunk_bytes: int = CHUNK_BYTES):
    """BlockChunk messages for ``snapshots``: each block starts with a header chunk."""
    for snap in snapshots:
        first = True
        header = state_message(snap.header)
        for piece in split_payload(snap.arrays, chunk_bytes):
            if first:
                msg = ps.BlockChunk(header=header, epoch=epoch).SerializeToString()
                yield msg + encode_chunk(None, piece)
                first = False
            else:
                yield encode_chunk(None, piece)
        if first:
            yield ps.BlockChunk(header=header, epoch=epoch).SerializeToString()


class InFlight:
    """gRPC calls in flight, by peer (an address or a node name), so that the calls to a
    peer declared dead can be cancelled: a paused or cut-off peer would otherwise hold them
    until their timeout. Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._calls: dict[str, set] = {}

    @contextlib.contextmanager
    def tracking(self, peer: str, call):
        """Track ``call`` (a gRPC future or response iterator) for the block."""
        with self._lock:
            self._calls.setdefault(peer, set()).add(call)
        try:
            yield call
        finally:
            with self._lock:
                self._calls[peer].discard(call)

    def wait(self, peer: str, call, what: str):
        """``call.result()`` of a gRPC future to ``peer``; Unavailable if ``abandon`` cancelled
        it (a cancelled call's RpcError, CANCELLED, reads as Unavailable too)."""
        with self.tracking(peer, call):
            try:
                return call.result()
            except grpc.FutureCancelledError:
                raise Unavailable(f"{what}: abandoned, {peer} was declared dead") from None

    def abandon(self, peer: str) -> int:
        """Cancel the calls in flight to ``peer``; returns how many."""
        with self._lock:
            calls = list(self._calls.get(peer, ()))
        for call in calls:
            call.cancel()
        return len(calls)


class GrpcPeers:
    """``Peers`` over gRPC: replicate and load blocks on other nodes, by name. Blocking;
    raises ``ShardpsError`` (``Unavailable`` for a node not in the shard map, or whose calls
    were abandoned). Thread-safe."""

    def __init__(self, node_name: str, address_of, pool: StubPool, timeout: float = 5.0):
        self.node_name = node_name
        self.address_of = address_of
        self.pool = pool
        self.timeout = timeout
        self.in_flight = InFlight()                        # by node name

    def abandon(self, node: str) -> int:
        """Cancel the calls in flight to ``node`` (the map declared it dead: a paused or cut
        off node would hold them, and the caller's block locks, until their timeout); they
        raise Unavailable. Returns how many were cancelled."""
        return self.in_flight.abandon(node)

    def _call(self, node: str, method, request, timeout: float, metadata, what: str):
        try:
            return self.in_flight.wait(node, method.future(request, timeout=timeout, metadata=metadata), what)
        except grpc.RpcError as err:
            raise from_rpc_error(err, what) from None

    def address(self, node: str) -> str:
        """The gRPC address of ``node`` under the node's map; Unavailable if it has none."""
        try:
            return self.address_of(node)
        except KeyError:
            raise Unavailable(f"server {node!r} is not in the shard map") from None

    def _stub(self, node: str) -> ParameterServerStub:
        return self.pool.get(self.address(node))

    def open_data_plane(self, node: str, address: str, job: str) -> ps.OpenDataPlaneResponse:
        """Ask ``node`` (at gRPC ``address``) for its data plane (raises ``grpc.RpcError``;
        Unavailable if ``abandon(node)`` cancels it: the call is tracked by node name)."""
        call = self.pool.get(address).OpenDataPlane.future(
            ps.OpenDataPlaneRequest(job=job), timeout=min(self.timeout, 5.0), metadata=self.pool.metadata)
        return self.in_flight.wait(node, call, f"OpenDataPlane on {node} ({address})")

    def replicate(self, node, epoch, ops, arrays):
        header = replicate_header(epoch, self.node_name, ops, sum(a.nbytes for a in arrays))

        def chunks():
            head = header
            for piece in split_payload(arrays):
                yield encode_chunk(head, piece)
                head = None
            if head is not None:
                yield encode_chunk(head, None)

        nbytes = sum(a.nbytes for a in arrays)
        ack = self._call(node, self._stub(node).Replicate, chunks(), self.timeout + nbytes / 20e6,
                         self.pool.metadata, f"replicate to {node}")
        stale = out_of_sync(ack)
        return lambda: stale            # ``Peers.replicate``'s answer: here, already had

    def load_blocks(self, node, epoch, snapshots, resync=False):
        """A resync (push path) gets the forward timeout plus its size at 20 MB/s, as
        ``replicate``; a copy (moves) up to 30 s."""
        nbytes = sum(a.nbytes for snap in snapshots for a in snap.arrays)
        timeout = self.timeout + nbytes / 20e6 if resync else max(self.timeout, 30.0)
        self._call(node, self._stub(node).LoadBlocks, encode_snapshots(snapshots, epoch), timeout,
                   self.pool.metadata + (("x-shardps-source", self.node_name),), f"load blocks on {node}")
