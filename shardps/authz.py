"""The authorization table: one entry per RPC of every shardps service, saying who may call
it, where a job-scoped call names its job, and how its answer is filtered. Nothing else
decides access: the gRPC binders (``enforce``), the authenticator (``server.auth``) and the
data plane (``shardps.rpc.dataplane_server``) all read ``TABLE``; the fuzzers pick what to
attack from it, and ``tests/test_authz.py`` fails when a .proto declares an RPC it lacks.

Who may call (``Rule.access``), when authentication is on:

* ``PUBLIC``          anyone, without credentials (health checks and reflection: no job data)
* ``AUTHENTICATED``   any valid token; a job token's answer is filtered to its own job
* ``JOB``             a job token for the job the request names (``Rule.job_fields``, dotted
                      paths into ``Rule.message``; every one must name the caller's job), or
                      the admin token
* ``ADMIN``           the operator's admin token only
* ``INTERNAL``        server-to-server and manager-to-server calls: the cluster credential
                      (today the admin token, which every process presents); never a job token

With authentication off (no admin token, no token key) every principal is anonymous and may
call every RPC that has an entry. An RPC without an entry is refused with PERMISSION_DENIED
whether authentication is on or off (deny by default).

How the answer is filtered (``Rule.answer``): ``SCOPED`` answers concern only the request's
own job (acks, the requested job's rows); ``OWN_JOB`` answers are filtered by the handler to
the caller's job and verified by ``enforce``: a reply to a job token that names any other job
in a ``job`` field is not sent (INTERNAL: a filtering bug); ``FULL`` answers are whole (only
admins and the cluster get them).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

from google.protobuf.message import Message

from shardps.errors import Internal, PermissionDenied
from shardps.protos.v1 import manager_pb2 as mg
from shardps.protos.v1 import parameter_server_pb2 as ps

PUBLIC, AUTHENTICATED, JOB, ADMIN, INTERNAL = "public", "authenticated", "job", "admin", "internal"
SCOPED, OWN_JOB, FULL = "scoped", "own-job", "full"

# principal roles (``server.auth.Principal.role``)
ROLE_ADMIN, ROLE_JOB, ROLE_ANONYMOUS, ROLE_PUBLIC = "admin", "job", "anonymous", "public"

PS_SERVICE, RM_SERVICE = "shardps.v1.ParameterServer", "shardps.v1.ResourceManager"
HEALTH_SERVICE, REFLECTION_SERVICE = "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"


@dataclass(frozen=True)
class Rule:
    """Who may call one RPC and what its answer shows (see the module docstring).

    ``message`` is the protobuf message ``job_fields`` are read from: the request, or for a
    streamed request the header of its first chunk (Push: ``PushHeader``). ``transports``
    says where the RPC is served: "grpc", "dataplane" (``shardps.rpc.dataplane``) or
    "standard" (grpc's own health and reflection servicers)."""

    access: str
    job_fields: tuple[str, ...] = ()
    message: type | None = None
    answer: str = SCOPED
    transports: tuple[str, ...] = ("grpc",)
    note: str = ""


def _job(message, *fields, note="", answer=SCOPED, transports=("grpc",)) -> Rule:
    return Rule(JOB, tuple(fields) or ("job",), message, answer, transports, note)


_BOTH = ("grpc", "dataplane")

TABLE: dict[str, dict[str, Rule]] = {
    PS_SERVICE: {
        "Push": _job(ps.PushHeader, "header.job", transports=_BOTH,
                     note="the job is in the first chunk's PushHeader (the data plane: the frame's header)"),
        "Pull": _job(ps.PullRequest, "header.job", transports=_BOTH),
        "Exchange": _job(ps.ExchangeHeader, "push.header.job", "pull.header.job", transports=("dataplane",),
                         note="a push and a pull in one frame: both must name the caller's job"),
        "Step": _job(ps.StepHeader, "header.job", transports=("dataplane",),
                     note="a push and a pull in one packed frame (shardps/rpc/step.py)"),
        "ProbeSharedMemory": _job(ps.ProbeSharedMemoryRequest,
                                  note="binds the region to the job; another job's region is refused"),
        "OpenDataPlane": _job(ps.OpenDataPlaneRequest),
        "HELLO": Rule(AUTHENTICATED, transports=("dataplane",),
                      note="opens a data-plane connection; each method is then checked by its entry"),
        "GetNodeStatus": Rule(AUTHENTICATED, answer=OWN_JOB,
                              note="a job token sees its own tables, clocks and totals only"),
        "Replicate": Rule(INTERNAL, transports=_BOTH, note="primary -> backup updates"),
        "InstallShardMap": Rule(INTERNAL, note="manager -> server"),
        "CopyBlocks": Rule(INTERNAL, note="manager -> server: block moves"),
        "LoadBlocks": Rule(INTERNAL, note="server -> server: block moves, restores"),
        "SnapshotBlocks": Rule(INTERNAL, answer=FULL, note="manager -> server: checkpoints"),
        "HoldJob": Rule(INTERNAL, note="manager -> server: checkpoints"),
        "DropTables": Rule(INTERNAL, note="manager -> server: deleted tables and ended jobs"),
        "GetBlockDigests": Rule(ADMIN, answer=FULL,
                                note="operators and the verifier: a digest of every block replica held"),
    },
    RM_SERVICE: {
        "RegisterServer": Rule(INTERNAL, answer=FULL, note="server -> manager"),
        "ServerHeartbeat": Rule(INTERNAL, note="server -> manager"),
        "DrainServer": Rule(ADMIN),
        "CreateJob": Rule(ADMIN, note="answers the job's token"),
        "EndJob": Rule(ADMIN),
        "RevokeJobTokens": Rule(ADMIN, note="raises the job's token generation; answers a fresh token"),
        "CreateTable": _job(mg.CreateTableRequest, answer=OWN_JOB),
        "CreateTables": _job(mg.CreateTablesRequest, answer=OWN_JOB),
        "DescribeTable": _job(mg.DescribeTableRequest, answer=OWN_JOB),
        "ListTables": _job(mg.ListTablesRequest, answer=OWN_JOB),
        "UpdateTableConfig": _job(mg.UpdateTableConfigRequest),
        "UpdateTableConfigs": _job(mg.UpdateTableConfigsRequest),
        "DeleteTable": _job(mg.DeleteTableRequest),
        "GetShardMap": Rule(AUTHENTICATED, answer=OWN_JOB,
                            note="a job token sees every server and its own job's tables and group; "
                                 "naming another job in `job` is PERMISSION_DENIED"),
        "WatchShardMap": Rule(AUTHENTICATED, answer=OWN_JOB, note="as GetShardMap, per published map"),
        "JoinWorkerGroup": _job(mg.JoinWorkerGroupRequest, answer=OWN_JOB),
        "LeaveWorkerGroup": _job(mg.LeaveWorkerGroupRequest),
        "WorkerHeartbeat": _job(mg.WorkerHeartbeatRequest),
        "Checkpoint": Rule(ADMIN, note="directories lie under the manager's checkpoint root"),
        "CheckpointBarrier": _job(mg.CheckpointBarrierRequest,
                                  note="checkpoint_id follows shardps.names.CHECKPOINT_ID"),
        "Restore": Rule(ADMIN),
        "GetWorkerState": _job(mg.GetWorkerStateRequest),
        "ResetLostBlocks": _job(mg.ResetLostBlocksRequest,
                                note="a job accepts the loss of its own table's lost blocks"),
        "GetClusterStatus": Rule(ADMIN, answer=FULL, note="every job's groups and servers"),
    },
    HEALTH_SERVICE: {
        "Check": Rule(PUBLIC, transports=("standard",), note="serving status only"),
        "Watch": Rule(PUBLIC, transports=("standard",), note="serving status only"),
    },
    REFLECTION_SERVICE: {
        "ServerReflectionInfo": Rule(PUBLIC, transports=("standard",), note="the .proto schemas"),
    },
}


def split(full_method: str) -> tuple[str, str]:
    """``"/svc/Method"`` -> ``("svc", "Method")``."""
    service, _, method = full_method.lstrip("/").rpartition("/")
    return service, method


def rule_for(full_method: str) -> Rule | None:
    """The entry of ``"/service/Method"``, or None (refused by default)."""
    service, method = split(full_method)
    return TABLE.get(service, {}).get(method)


def methods_with(*accesses: str, service: str | None = None) -> set[str]:
    """Names of the RPCs whose access is one of ``accesses`` (in ``service``, or any)."""
    return {m for s, rules in TABLE.items() if service in (None, s)
            for m, r in rules.items() if r.access in accesses}


def authorize(full_method: str, principal) -> Rule:
    """The method's rule if ``principal`` may call it at all (before its request is read);
    PermissionDenied when the method has no entry or is beyond the principal's role.
    ``principal`` None means authentication is off (anonymous)."""
    rule = rule_for(full_method)
    method = split(full_method)[1]
    if rule is None:
        raise PermissionDenied(f"{method}: no entry in the authorization table (shardps.authz): "
                               f"refused by default")
    role = getattr(principal, "role", ROLE_ANONYMOUS)
    if rule.access == PUBLIC or role in (ROLE_ADMIN, ROLE_ANONYMOUS):
        return rule
    if role == ROLE_JOB and rule.access in (AUTHENTICATED, JOB):
        return rule
    kind = "a server-to-server (admin) operation" if rule.access == INTERNAL else "an admin operation"
    who = f"a job token for {principal.job!r}" if role == ROLE_JOB else "this caller"
    raise PermissionDenied(f"{method} is {kind}; {who} cannot call it")


def field_value(message, path: str):
    for name in path.split("."):
        message = getattr(message, name)
    return message


def requested_jobs(rule: Rule, message) -> list[str]:
    """The jobs ``message`` names in the rule's job fields."""
    return [str(field_value(message, path)) for path in rule.job_fields]


def check_scope(rule: Rule, principal, message) -> None:
    """PermissionDenied unless every job the request names is the job token's own job
    (admins, the cluster and anonymous callers may name any job)."""
    if getattr(principal, "role", None) != ROLE_JOB or rule.access != JOB:
        return
    for path in rule.job_fields:
        job = field_value(message, path)
        if job != principal.job:
            raise PermissionDenied(f"{path}={job!r}: this token grants job {principal.job!r}, "
                                   f"not {job!r}")


def check_answer(full_method: str, principal, answer) -> None:
    """Internal error if an OWN_JOB answer to a job token names another job anywhere."""
    if getattr(principal, "role", None) != ROLE_JOB or not isinstance(answer, Message):
        return
    foreign = _foreign_job(answer, principal.job)
    if foreign is not None:
        raise Internal(f"{full_method}: the answer to a job token of {principal.job!r} names job "
                       f"{foreign!r}; not sent (answer filtering bug)")


@functools.lru_cache(maxsize=None)
def _job_carrying(descriptor) -> bool:
    """Whether messages of ``descriptor`` can hold a ``job`` field at any depth."""
    return any(f.name == "job" or (f.message_type is not None and f.message_type is not descriptor
                                   and _job_carrying(f.message_type))
               for f in descriptor.fields)


def _foreign_job(message, job: str):
    for field, value in message.ListFields():
        if field.name == "job" and isinstance(value, str) and value != job:
            return value
        if field.message_type is None or not _job_carrying(field.message_type):
            continue
        if field.message_type.GetOptions().map_entry:
            continue
        items = value if field.is_repeated else (value,)
        for item in items:
            found = _foreign_job(item, job)
            if found is not None:
                return found
    return None


def enforce(service: str, methods: dict) -> dict:
    """``methods`` (name -> ``shardps.rpc.status.Method``) with the table applied: a method
    without an entry refuses every call (PERMISSION_DENIED); the others check the caller's
    role, the jobs the request names and, for OWN_JOB answers, what the answer names."""
    from dataclasses import replace
    out = {}
    for name, m in methods.items():
        full = f"/{service}/{name}"
        rule = rule_for(full)
        if rule is None or "grpc" not in rule.transports:
            out[name] = replace(m, fn=_refuse(full))
        else:
            out[name] = replace(m, fn=_enforced(full, rule, m.kind, m.fn))
    return out


def _refuse(full: str):
    def refuse(request, call):
        authorize(full, None)           # raises: the method has no gRPC entry
        raise PermissionDenied(f"{split(full)[1]}: not served over gRPC")
    return refuse


def _enforced(full: str, rule: Rule, kind: str, fn):
    streamed_request = kind in ("stream_unary", "stream_stream")
    filtered = rule.answer == OWN_JOB

    def check(request, call):
        principal = call.principal
        authorize(full, principal)
        if getattr(principal, "role", None) != ROLE_JOB or rule.access != JOB:
            return request
        if streamed_request:                        # the job is in the first chunk's header
            it = iter(request)
            first = next(it, None)
            header = first.parse_header(rule.message) if first is not None else None
            if header is not None:
                check_scope(rule, principal, header)
                return itertools.chain([first], it)
            raise PermissionDenied(f"{split(full)[1]}: the first chunk names no job (no header)")
        check_scope(rule, principal, request)
        return request

    if kind in ("unary_stream", "stream_stream"):
        if not filtered:
            def streaming(request, call):
                return fn(check(request, call), call)
            return streaming

        def filtered_stream(request, call):
            for item in fn(check(request, call), call):
                check_answer(full, call.principal, item)
                yield item
        return filtered_stream

    def unary(request, call):
        answer = fn(check(request, call), call)
        if filtered:
            check_answer(full, call.principal, answer)
        return answer
    return unary
