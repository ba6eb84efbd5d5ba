"""The ParameterServer gRPC service: a thin layer that decodes chunks, calls ``ServerNode`` and
encodes the answer; and ``GrpcPeers``, the node's calls to other nodes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from shardps import authz, names
from shardps.errors import InvalidArgument, ResourceExhausted, ShardpsError
from shardps.messages import PullReply, PullRequest, PushAck, PushRequest
from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.rpc import messages, packed, replication
from shardps.rpc.chunks import collect_chunks, decode_snapshots
from shardps.rpc.codec import CHUNK_BYTES, decode_chunk, encode_chunk, split_payload, write_into
from shardps.rpc.frames import FLAG_PACKED, FLAG_SHARED
from shardps.rpc.status import Method, bind, grpc_code, proto_method
from shardps.rpc.stubs import encode_snapshots
from shardps.server.auth import JOB, check_job
from shardps.server.node import ServerNode, digest, lifecycle
from shardps.server.node.step_service import StepService

SERVICE = "shardps.v1.ParameterServer"
MAX_HOLD_SECONDS = 600.0
MIN_CHUNK_BYTES = 64 << 10          # a client cannot ask for one message per byte
MAX_CHUNK_BYTES = 16 << 20
_IDENTITY = bytes


def _shared_region(method: str, header: bytes, payload) -> tuple[pb.SharedMemoryRef, bytes]:
    """The shared-memory region a data-plane frame with ``FLAG_SHARED`` names before its
    header (where a push's payload lies or a pull's reply goes), and the header after it."""
    if method not in ("Push", "Pull") or (method == "Push" and len(payload)):
        raise InvalidArgument(f"{method}: flag SHARED is for a Pull, or a Push whose frame carries "
                              f"no payload bytes ({len(payload)} here)")
    name, offset, length, rest = packed.read_shared_region(header)
    return pb.SharedMemoryRef(name=name, offset=offset, length=length), bytes(rest)


_REFUSAL_REASONS = {"StaleEpoch": "stale_epoch", "InvalidArgument": "invalid", "NotFound": "invalid",
                    "Unavailable": "unavailable", "ResourceExhausted": "quota",
                    "PermissionDenied": "unauthorized", "Unauthenticated": "unauthorized",
                    "FailedPrecondition": "invalid"}


_DP_PUSH, _DP_PULL, _DP_EXCHANGE = (authz.TABLE[SERVICE][m] for m in ("Push", "Pull", "Exchange"))


@dataclass
class _Exchange:
    """An exchange's two requests, as the authorization table names their jobs
    (``push.header.job``, ``pull.header.job``)."""

    push: PushRequest
    pull: PullRequest


def _push_from_proto(header: ps.PushHeader, payload) -> tuple[PushRequest, int]:
    """A data-plane push whose header is protobuf: the plain request and the payload bytes
    it declares (its payload travels in the frame: never in shared memory)."""
    if header.shared_memory.name:
        raise InvalidArgument("data plane: the payload travels in the frame, not in shared memory")
    return messages.push_request(header, payload), int(header.payload_bytes)


def _pull_from_proto(request: ps.PullRequest, ids) -> PullRequest:
    """A data-plane pull whose header is protobuf, as the plain request (its reply travels in
    the frame: never in shared memory, so a ``reply_shared_memory`` is refused)."""
    if request.reply_shared_memory.name:
        raise InvalidArgument("data plane: the reply travels in the frame, not in shared memory")
    return messages.pull_request(request, ids or None)


def _scoped(rule: authz.Rule, call, request):
    """``request`` once the jobs it names are the caller's (the table's job fields)."""
    authz.check_scope(rule, call.principal, request)
    return request


class ParameterServerService:
    """gRPC methods of one node. ``authenticate`` is the credentials check (security issue)."""

    def __init__(self, node: ServerNode):
        from shardps.rpc.shm import ServerRegions
        from shardps.server.node.admission import Admission
        self.node = node
        self.regions = ServerRegions()
        self.steps = StepService(node, self.regions, Admission(), self._refused)

    admission = property(lambda self: self.steps.admission, lambda self, a: setattr(self.steps, "admission", a),
                         doc="Per-job limits (server/node/admission.py), for every data request: off "
                             "unless the process sets them (``ServerProcess``).")

    def methods(self) -> dict[str, Method]:
        return {
            "Push": Method("stream_unary", self._counted(self.push), decode_chunk,
                           ps.PushAck.SerializeToString),
            "Pull": Method("unary_stream", self._counted_stream(self.pull), ps.PullRequest.FromString,
                           _IDENTITY),
            "ProbeSharedMemory": proto_method("unary_unary", self.probe_shared_memory,
                                              ps.ProbeSharedMemoryRequest),
            "Replicate": Method("stream_unary", self.replicate, decode_chunk,
                                ps.ReplicateAck.SerializeToString),
            "InstallShardMap": proto_method("unary_unary", self.install_shard_map,
                                            ps.InstallShardMapRequest),
            "CopyBlocks": proto_method("unary_unary", self.copy_blocks, ps.CopyBlocksRequest),
            "LoadBlocks": Method("stream_unary", self.load_blocks, decode_chunk,
                                 ps.LoadBlocksResponse.SerializeToString),
            "SnapshotBlocks": Method("unary_stream", self.snapshot_blocks,
                                     ps.SnapshotBlocksRequest.FromString, _IDENTITY),
            "HoldJob": proto_method("unary_unary", self.hold_job, ps.HoldJobRequest),
            "DropTables": proto_method("unary_unary", self.drop_tables, ps.DropTablesRequest),
            "GetNodeStatus": proto_method("unary_unary", self.get_node_status, ps.GetNodeStatusRequest),
            "GetBlockDigests": proto_method("unary_unary", self.get_block_digests, ps.GetBlockDigestsRequest),
            "OpenDataPlane": proto_method("unary_unary", self.open_data_plane, ps.OpenDataPlaneRequest),
        }

    def handler(self, metrics=None, authenticate=None) -> grpc.GenericRpcHandler:
        return bind(SERVICE, authz.enforce(SERVICE, self.methods()), metrics, authenticate)

    # --- data path ---
    def _refused(self, exc: ShardpsError) -> None:
        reason = _REFUSAL_REASONS.get(type(exc).__name__)
        if reason:
            self.node.metrics.refusals.labels(reason).inc()

    def _counted(self, fn):
        def handler(request, call):
            try:
                return fn(request, call)
            except ShardpsError as exc:
                self._refused(exc)
                raise
        return handler

    def _counted_stream(self, fn):
        def handler(request, call):
            try:
                yield from fn(request, call)
            except ShardpsError as exc:
                self._refused(exc)
                raise
        return handler

    def push(self, chunks, call) -> ps.PushAck:
        header, payload = collect_chunks(chunks, ps.PushHeader, self.node.limits.max_request_bytes, "Push",
                                         "; send a PushChunk with a header")
        check_job(call.principal, header.header.job)
        if header.shared_memory.name:
            if header.shared_memory.length != header.payload_bytes:
                raise InvalidArgument(f"Push: shared-memory length {header.shared_memory.length} != "
                                      f"payload_bytes {header.payload_bytes}")
            payload = self._open_shared(header.shared_memory, header.header.job)
        with self.admission.admit(header.header.job, len(payload)):
            return messages.push_ack(self.node.push(messages.push_request(header, payload), call.deadline))

    def pull(self, request: ps.PullRequest, call):
        check_job(call.principal, request.header.job)
        ref = request.reply_shared_memory
        reply, arrays = self._pulled(messages.pull_request(request), call.deadline, ref if ref.name else None)
        header = messages.pull_header(reply)
        if header.in_shared_memory:            # in the client's memory
            yield encode_chunk(header.SerializeToString(), None)
            return
        chunk = max(MIN_CHUNK_BYTES, min(request.chunk_bytes or CHUNK_BYTES, MAX_CHUNK_BYTES))
        head = header.SerializeToString()
        for piece in split_payload(arrays, chunk):
            yield encode_chunk(head, piece)
            head = None
        if head is not None:
            yield encode_chunk(head, None)

    # --- data plane (shardps.rpc.dataplane): Push and Pull as above, and Exchange ---
    def open_data_plane(self, request, call) -> ps.OpenDataPlaneResponse:
        names.check(names.JOB, request.job, "job")
        check_job(call.principal, request.job)
        return ps.OpenDataPlaneResponse(address=self.data_plane_address,
                                        max_frame_bytes=self.data_plane_max_frame_bytes,
                                        packed=bool(self.data_plane_address),
                                        shared_memory=bool(self.data_plane_address),
                                        step=bool(self.data_plane_address))

    data_plane_address = ""               # set by the process that serves a data plane
    data_plane_max_frame_bytes = 0

    def data_plane(self, method, header: bytes, payload: memoryview, call):
        """``DataPlaneServer`` handler: the same messages and checks as the gRPC methods
        (names, the principal's job, the node's validation), the bulk bytes raw beside the
        header. Returns (reply header, payload buffers). Counted in the ``grpc_server_*``
        metrics with ``grpc_type="dataplane"``, so dashboards see every data call."""
        started = time.perf_counter()
        code = "OK"
        if method == "Step":                # counted by StepService.frame
            return self._step(header, payload, call)
        try:
            return self._data_plane(method, header, payload, call)
        except ShardpsError as exc:
            code = grpc_code(exc).name
            self._refused(exc)
            raise
        except DecodeError:
            code = "INVALID_ARGUMENT"
            raise
        except Exception:
            code = "INTERNAL"
            raise
        finally:
            self.node.metrics.observe_call(SERVICE, str(method), code, time.perf_counter() - started)

    def _step(self, header: bytes, payload: memoryview, call):
        """A Step frame through the generic handler (``data_plane``): ``StepService.frame``."""
        return self.steps.frame(memoryview(header), payload, call.principal, {}, call.deadline, call.flags)

    def _data_plane(self, method, header: bytes, payload: memoryview, call):
        packed_form = bool(call.flags & FLAG_PACKED)
        region, header = _shared_region(method, header, payload) if call.flags & FLAG_SHARED else (None, header)
        if method == "Push":
            push, declared = (packed.read_push(header, payload) if packed_form
                              else _push_from_proto(ps.PushHeader.FromString(header), payload))
            ack = self._dp_push(_scoped(_DP_PUSH, call, push), declared, call, region)
            return (packed.push_ack(ack) if packed_form
                    else messages.push_ack(ack).SerializeToString()), None
        if method == "Pull":
            pull = (packed.read_pull(header, payload) if packed_form
                    else _pull_from_proto(ps.PullRequest.FromString(header), payload))
            reply, arrays = self._dp_pull(_scoped(_DP_PULL, call, pull), call, region)
            return (packed.pull_reply(reply) if packed_form
                    else messages.pull_header(reply).SerializeToString()), arrays
        if method == "Exchange":
            if packed_form:
                push, pull = packed.read_exchange(header, payload)
                declared = len(push.payload)
            else:
                request = ps.ExchangeHeader.FromString(header)
                declared = int(request.push.payload_bytes)
                if declared > len(payload):
                    raise InvalidArgument(f"Exchange: push.payload_bytes={declared} but the frame "
                                          f"carries {len(payload)} payload bytes")
                push, _ = _push_from_proto(request.push, payload[:declared])
                pull = _pull_from_proto(request.pull, payload[declared:])
            _scoped(_DP_EXCHANGE, call, _Exchange(push, pull))
            ack = self._dp_push(push, declared, call)
            reply, arrays = self._dp_pull(pull, call)
            return (packed.exchange_reply(ack, reply) if packed_form else ps.ExchangeReply(
                ack=messages.push_ack(ack), pull=messages.pull_header(reply)).SerializeToString()), arrays
        if method == "Replicate":           # primary -> backup (INTERNAL: the cluster's credential)
            if len(payload) > self.node.limits.max_request_bytes:
                raise ResourceExhausted(f"Replicate: {len(payload)} bytes; the limit "
                                        f"max_request_bytes is {self.node.limits.max_request_bytes}")
            return self._replicate(ps.ReplicateHeader.FromString(header), payload).SerializeToString(), None
        raise InvalidArgument(f"data plane: unknown method {method!r}: Push, Pull, Exchange or Replicate")

    def _dp_push(self, push: PushRequest, declared: int, call, region: pb.SharedMemoryRef | None = None) -> PushAck:
        job = push.header.job
        names.check(names.JOB, job, "header.job")
        check_job(call.principal, job)
        if region is not None:              # the job's own region (ServerRegions checks the binding)
            push.payload = self._open_shared(region, job)
        payload = push.payload
        if declared and declared != len(payload):
            raise InvalidArgument(f"Push: the header declares {declared} payload bytes; "
                                  f"the frame carries {len(payload)}")
        if len(payload) > self.node.limits.max_request_bytes:
            raise ResourceExhausted(f"Push: {len(payload)} bytes; the limit max_request_bytes is "
                                    f"{self.node.limits.max_request_bytes}: split the request")
        with self.admission.admit(job, len(payload)):
            return self.node.push(push, call.deadline)

    def _dp_pull(self, pull: PullRequest, call, region: pb.SharedMemoryRef | None = None) -> tuple[PullReply, list]:
        job = pull.header.job
        names.check(names.JOB, job, "header.job")
        check_job(call.principal, job)
        return self._pulled(pull, call.deadline, region)

    def _pulled(self, pull: PullRequest, deadline, region: pb.SharedMemoryRef | None) -> tuple[PullReply, list]:
        """``node.pull`` under the job's admission (gRPC and the data plane); with ``region``
        (the job's shared memory, checked first) the values land there: read straight into
        it where the pull allows, else copied after, and no arrays are returned."""
        job = pull.header.job
        out = None if region is None else self._open_shared(region, job)
        with self.admission.admit(job):
            reply, arrays = self.node.pull(pull, deadline, out_buffer=out)
        if region is not None and not reply.in_shared_memory:
            self.write_shared_memory(region, arrays, job)
            reply.in_shared_memory, arrays = True, []
        return reply, arrays

    # --- shared-memory fast path (same host) ---
    def probe_shared_memory(self, request, call) -> ps.ProbeSharedMemoryResponse:
        names.check(names.JOB, request.job, "job")
        check_job(call.principal, request.job)
        if len(request.nonce) < 16:
            return ps.ProbeSharedMemoryResponse(usable=False, reason="nonce shorter than 16 bytes")
        try:
            view = self.regions.view(request.ref.name, int(request.ref.offset), int(request.ref.length))
            ok = bytes(view[:len(request.nonce)]) == request.nonce
            del view
        except ShardpsError as exc:
            return ps.ProbeSharedMemoryResponse(usable=False, reason=exc.message)
        if not ok:
            return ps.ProbeSharedMemoryResponse(usable=False, reason="nonce differs")
        if not self.regions.bind(request.ref.name, request.job):
            return ps.ProbeSharedMemoryResponse(usable=False, reason="region belongs to another job")
        return ps.ProbeSharedMemoryResponse(usable=True)

    def _open_shared(self, ref: pb.SharedMemoryRef, job: str) -> memoryview:
        return self.regions.view_for(ref.name, int(ref.offset), int(ref.length), job)

    def write_shared_memory(self, ref: pb.SharedMemoryRef, arrays, job: str) -> None:
        view = self._open_shared(ref, job)
        total = sum(a.nbytes for a in arrays)
        if total > len(view):
            raise ResourceExhausted(f"pull result is {total} bytes; the shared-memory region "
                                    f"{ref.name} offers {len(view)}")
        write_into(view, arrays)

    # --- internal ---
    def replicate(self, chunks, call) -> ps.ReplicateAck:
        header, payload = collect_chunks(chunks, ps.ReplicateHeader, self.node.limits.max_request_bytes,
                                         "Replicate")
        return self._replicate(header, payload)

    def _replicate(self, header: ps.ReplicateHeader, payload) -> ps.ReplicateAck:
        if header.payload_bytes and header.payload_bytes != len(payload):
            raise InvalidArgument(f"Replicate: the header declares {header.payload_bytes} payload "
                                  f"bytes; the request carries {len(payload)}")
        epoch, source, ops = replication.replicate_request(header)
        return replication.replicate_ack(*self.node.apply_replicated(epoch, source, ops, payload))

    def install_shard_map(self, request, call) -> ps.InstallShardMapResponse:
        return ps.InstallShardMapResponse(epoch=self.node.install_map(request.map))

    def copy_blocks(self, request, call) -> ps.CopyBlocksResponse:
        refs = [(r.job, r.table, r.block) for r in request.blocks]
        copied, nbytes = self.node.copy_blocks(request.epoch, refs, request.destination)
        return ps.CopyBlocksResponse(copied=copied, bytes=nbytes)

    def load_blocks(self, chunks, call) -> ps.LoadBlocksResponse:
        epoch, snapshots = decode_snapshots(chunks)
        source = dict(call.metadata()).get("x-shardps-source", "")
        return ps.LoadBlocksResponse(loaded=self.node.load_blocks(epoch, source, snapshots))

    def snapshot_blocks(self, request, call):
        refs = [(r.job, r.table, r.block) for r in request.blocks]
        yield from encode_snapshots(self.node.snapshot_blocks(refs), self.node.epoch)

    def hold_job(self, request, call) -> ps.HoldJobResponse:
        names.check(names.JOB, request.job, "job")
        seconds = request.hold_seconds or 30.0
        if not 0 < seconds <= MAX_HOLD_SECONDS:
            raise InvalidArgument(f"hold_seconds={request.hold_seconds}: a hold lasts (0, "
                                  f"{MAX_HOLD_SECONDS}] seconds")
        self.node.hold_job(request.job, request.hold, seconds)
        return ps.HoldJobResponse()

    def drop_tables(self, request, call) -> ps.DropTablesResponse:
        names.check(names.JOB, request.job, "job")
        return ps.DropTablesResponse(dropped_blocks=self.node.drop_tables(request.job, list(request.tables)))

    def get_block_digests(self, request, call) -> ps.GetBlockDigestsResponse:
        if request.job:
            names.check(names.JOB, request.job, "job")
        node = self.node
        msg = ps.GetBlockDigestsResponse(name=node.name, incarnation=node.incarnation, epoch=node.epoch)
        for d in digest.held_digests(node.table, request.job):
            msg.blocks.add(job=d.key[0], table=d.key[1], block=d.key[2], version=d.version,
                           role=ps.BLOCK_PRIMARY if d.primary else ps.BLOCK_BACKUP, digest=d.digest,
                           rows=d.size, loaded=d.loaded)
        return msg

    def get_node_status(self, request, call) -> ps.NodeStatus:
        principal = call.principal
        only = principal.job if principal is not None and principal.role == JOB else None
        return node_status(self.node, only)


def node_status(node: ServerNode, job: str | None = None) -> ps.NodeStatus:
    """The node's usage and clocks; with ``job``, only that job's tables and clocks, and the
    block and byte totals of that job alone (what a job token may see)."""
    u = node.usage()
    msg = ps.NodeStatus(name=node.name, incarnation=node.incarnation, epoch=node.epoch,
                        primary_blocks=u["primary_blocks"], replica_blocks=u["backup_blocks"],
                        bytes=u["bytes"])
    if job is not None:
        keys = [k for k in list(node.blocks) if k[0] == job]
        msg.primary_blocks = sum(1 for k in keys if node._is_primary(k))   # usage()'s rule
        msg.replica_blocks = len(keys) - msg.primary_blocks
        msg.bytes = sum(nbytes for (j, _), (_, _, nbytes) in u["tables"].items() if j == job)
    for (j, table), (blocks, params, nbytes) in sorted(u["tables"].items()):
        if job is None or j == job:
            entry = msg.tables.add(job=j, table=table, blocks=blocks, parameters=params, bytes=nbytes)
            rows = node.table.sparse_rows.get((j, table))
            if rows is not None:              # a lifecycle policy's figures (issue 18)
                with rows.lock:
                    r = lifecycle.report(rows, blocks)
                if r is not None:
                    for field in ("budget_bytes", "rows", "rows_admitted", "rows_evicted_ttl",
                                  "rows_evicted_budget", "rows_not_admitted", "rows_cooled"):
                        setattr(entry, field, r[field])
                    entry.cold_rows, entry.cold_bytes = r.get("cold_rows", 0), r.get("cold_bytes", 0)
    for j, clock in sorted(node.clocks.items()):
        if job is not None and j != job:
            continue
        view = node.view.groups.get(j)
        ranks = {m.session: m.rank for m in view.members} if view else {}
        for session, done in sorted(clock.completed.items()):
            msg.clocks.add(job=j, rank=ranks.get(session, 0), clock=done)
    return msg
