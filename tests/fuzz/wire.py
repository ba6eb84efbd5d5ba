"""Calls and status codes: the RPCs the fuzzers know, the codes the .proto files document,
and ``Wire``, which sends raw bytes and records every outcome (code, latency, violations)."""

from __future__ import annotations

import re
import time
from collections import Counter, defaultdict
from dataclasses import dataclass

import grpc

from shardps.protos.v1 import manager_pb2 as mg
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.rpc import channels

PS, RM = "shardps.v1.ParameterServer", "shardps.v1.ResourceManager"
DEADLINE = 5.0          # every call carries one
SLACK = 1.5             # a call may return this much after its deadline (scheduling), no more
OK = "OK"
INVALID, NOT_FOUND, FAILED, UNAVAILABLE = ("INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION",
                                           "UNAVAILABLE")
EXHAUSTED, EXISTS = "RESOURCE_EXHAUSTED", "ALREADY_EXISTS"

# Status codes the .proto files document (parameter_server.proto, manager.proto). INTERNAL is
# documented for the ParameterServer as "a bug", so it counts as one here.
DOCUMENTED = {
    PS: {OK, INVALID, NOT_FOUND, FAILED, UNAVAILABLE, EXHAUSTED, "DEADLINE_EXCEEDED",
         "UNAUTHENTICATED", "PERMISSION_DENIED"},
    RM: {OK, INVALID, NOT_FOUND, EXISTS, FAILED, EXHAUSTED, UNAVAILABLE, "UNAUTHENTICATED",
         "PERMISSION_DENIED"},
}
# Codes a shared-memory reference that does not exist (or is not the caller's) may get.
SHM_REFUSED = {INVALID, NOT_FOUND, FAILED, UNAVAILABLE, "PERMISSION_DENIED"}


@dataclass(frozen=True)
class KnownBug:
    """A failure the fuzzer finds today, tolerated here and reproduced by ``repro``."""

    key: str
    code: str
    methods: frozenset | None
    details: str          # regex searched in the status details
    repro: str


# None open: each bug found has a regression test in tests/test_fuzz_regressions.py.
KNOWN_BUGS: list = []

PS_METHODS = {   # name -> gRPC kind
    "Push": "stream_unary", "Pull": "unary_stream", "ProbeSharedMemory": "unary_unary",
    "Replicate": "stream_unary", "InstallShardMap": "unary_unary", "CopyBlocks": "unary_unary",
    "LoadBlocks": "stream_unary", "SnapshotBlocks": "unary_stream", "HoldJob": "unary_unary",
    "DropTables": "unary_unary", "GetNodeStatus": "unary_unary", "OpenDataPlane": "unary_unary",
    "GetBlockDigests": "unary_unary",
}
RM_REQUESTS = {   # name -> request class (every ResourceManager RPC is unary except Watch)
    "RegisterServer": mg.RegisterServerRequest, "ServerHeartbeat": mg.ServerHeartbeatRequest,
    "DrainServer": mg.DrainServerRequest, "CreateJob": mg.CreateJobRequest,
    "EndJob": mg.EndJobRequest, "RevokeJobTokens": mg.RevokeJobTokensRequest,
    "CreateTable": mg.CreateTableRequest, "CreateTables": mg.CreateTablesRequest,
    "DescribeTable": mg.DescribeTableRequest, "ListTables": mg.ListTablesRequest,
    "UpdateTableConfig": mg.UpdateTableConfigRequest, "UpdateTableConfigs": mg.UpdateTableConfigsRequest,
    "DeleteTable": mg.DeleteTableRequest,
    "GetShardMap": mg.GetShardMapRequest, "WatchShardMap": mg.WatchShardMapRequest,
    "JoinWorkerGroup": mg.JoinWorkerGroupRequest, "LeaveWorkerGroup": mg.LeaveWorkerGroupRequest,
    "WorkerHeartbeat": mg.WorkerHeartbeatRequest, "Checkpoint": mg.CheckpointRequest,
    "CheckpointBarrier": mg.CheckpointBarrierRequest, "Restore": mg.RestoreRequest,
    "GetWorkerState": mg.GetWorkerStateRequest, "GetClusterStatus": mg.GetClusterStatusRequest,
    "ResetLostBlocks": mg.ResetLostBlocksRequest,
}
PS_REQUESTS = {"ProbeSharedMemory": ps.ProbeSharedMemoryRequest,
               "InstallShardMap": ps.InstallShardMapRequest, "CopyBlocks": ps.CopyBlocksRequest,
               "SnapshotBlocks": ps.SnapshotBlocksRequest, "HoldJob": ps.HoldJobRequest,
               "DropTables": ps.DropTablesRequest, "GetNodeStatus": ps.GetNodeStatusRequest,
               "OpenDataPlane": ps.OpenDataPlaneRequest, "GetBlockDigests": ps.GetBlockDigestsRequest}


@dataclass
class Outcome:
    code: str
    details: str
    response: object     # bytes (unary), list of bytes (stream), None on error
    elapsed: float


class Wire:
    """Sends raw bytes with identity serializers; records codes, latency and violations."""

    def __init__(self):
        self.sent = 0
        self.codes: Counter = Counter()
        self.by_method: dict[str, Counter] = defaultdict(Counter)
        self.known: Counter = Counter()
        self.violations: list[str] = []
        self.slowest = (0.0, "")
        self.seconds: Counter = Counter()      # time spent in calls, per method
        self._callables: dict = {}

    def call(self, ch: grpc.Channel, service: str, method: str, request, *, kind: str,
             timeout: float = DEADLINE, first_only: bool = False, may_wait: bool = False,
             metadata: tuple = ()) -> Outcome:
        key = (id(ch), method, kind)
        fn = self._callables.get(key)
        if fn is None:
            fn = self._callables[key] = getattr(ch, kind)(f"/{service}/{method}")
        started = time.monotonic()
        response = None
        try:
            if kind == "unary_unary":
                response = fn(request, timeout=timeout, metadata=metadata)
            elif kind == "stream_unary":
                response = fn(iter(request), timeout=timeout, metadata=metadata)
            else:
                stream = fn(request, timeout=timeout, metadata=metadata)
                if first_only:
                    response = [next(stream, b"")]
                    stream.cancel()
                else:
                    response = list(stream)
            code, details = OK, ""
        except grpc.RpcError as err:
            code, details = err.code().name, err.details() or ""
            response = None
        elapsed = time.monotonic() - started
        self.sent += 1
        self.codes[code] += 1
        self.by_method[f"{service.rsplit('.', 1)[-1]}.{method}"][code] += 1
        self.seconds[method] += elapsed
        if elapsed > self.slowest[0]:
            self.slowest = (elapsed, f"{method} -> {code}")
        out = Outcome(code, details, response, elapsed)
        if elapsed > timeout + SLACK:
            self.violations.append(f"{method}: took {elapsed:.2f}s with a {timeout}s deadline ({code})")
        if code == "DEADLINE_EXCEEDED" and not may_wait:
            self.violations.append(f"{method}: DEADLINE_EXCEEDED where nothing may wait: {details}")
        self._check_documented(service, method, out, may_wait)
        return out

    def known_bug(self, method: str, out: Outcome) -> KnownBug | None:
        for bug in KNOWN_BUGS:
            if out.code == bug.code and (bug.methods is None or method in bug.methods) \
                    and re.search(bug.details, out.details):
                return bug
        return None

    def _check_documented(self, service: str, method: str, out: Outcome, may_wait: bool) -> None:
        if out.code in DOCUMENTED[service] or out.code == "CANCELLED":
            return
        if out.code == "DEADLINE_EXCEEDED" and may_wait:      # long polls and barriers
            return
        bug = self.known_bug(method, out)
        if bug is not None:
            self.known[bug.key] += 1
            return
        self.violations.append(f"{method}: undocumented status {out.code}: {out.details[:300]}")

    def report(self, title: str) -> str:
        lines = [f"{title}: {self.sent} messages; status codes: "
                 + ", ".join(f"{c}={n}" for c, n in self.codes.most_common()),
                 f"  slowest call {self.slowest[0] * 1000:.0f} ms ({self.slowest[1]})"]
        for method in sorted(self.by_method):
            calls = sum(self.by_method[method].values())
            seconds = self.seconds[method.rsplit(".", 1)[-1]]
            lines.append(f"  {method:34s} {1000 * seconds / calls:6.1f} ms/call  " + " ".join(
                f"{c}={n}" for c, n in self.by_method[method].most_common()))
        if self.known:
            lines.append("  known bugs hit (see KNOWN_BUGS): "
                         + ", ".join(f"{k}={n}" for k, n in self.known.most_common()))
        return "\n".join(lines)


def check_health(addresses: dict[str, str], require_serving: bool = True) -> None:
    for name, address in addresses.items():
        status = channels.check_health(address, timeout=DEADLINE)
        if require_serving:
            assert status == "SERVING", f"{name} at {address} reports {status}"
