"""Cross-job fuzzing: every RPC of the authorization table (``shardps.authz.TABLE``), sent with
the attacker job's valid token and aimed at the victim job (the data job of the reference).

What is attacked comes from the table: every entry of the ParameterServer and the
ResourceManager, on every transport it names (gRPC, the data plane). Requests are the
fuzzers' structured requests with the entry's ``job_fields`` set to a job other than the
attacker's (the victim mostly), then sent as they are or mutated. Judged:

* admin and server-to-server entries: PERMISSION_DENIED, whatever the request;
* job-scoped entries: a request that names another job is refused (PERMISSION_DENIED when it
  parses as sent; a mutated one may also be INVALID_ARGUMENT);
* entries any token may call: an answer names no job but the attacker's (``revealed``);
* after every method: the victim's stored values equal the reference (``full_check``) and
  its tables, group, job record and server-side status are unchanged (``effects``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st

from shardps import authz
from shardps.errors import ShardpsError
from shardps.messages import GRADIENT, RANGE, Header, Slice, StepRequest
from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import manager_pb2 as mg
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.rpc import step
from shardps.rpc.dataplane import DataPlaneConnection
from shardps.rpc.frames import FLAG_PACKED
from tests.fuzz.admin import OTHER, VICTIM, admin_request, channel_to
from tests.fuzz.encoder import parses
from tests.fuzz.reference import SCRATCH_JOBS, UNKNOWN_JOB
from tests.fuzz.strategies import coin, mutate, one_of, seeded
from tests.fuzz.wire import DEADLINE, OK, PS, PS_METHODS, RM
from tests.fuzz.world import World

ATTACKER = OTHER
FOREIGN = [VICTIM] * 6 + [UNKNOWN_JOB, "", SCRATCH_JOBS[0]]     # jobs that are not the attacker's
DP_MESSAGES = {"Push": ps.PushHeader, "Pull": ps.PullRequest, "Exchange": ps.ExchangeHeader,
               "Replicate": ps.ReplicateHeader}
ANSWERS = {"GetShardMap": pb.ShardMap, "WatchShardMap": pb.ShardMap, "GetNodeStatus": ps.NodeStatus}


def targets() -> list[tuple[str, str, str]]:
    """(service, method, transport) of every entry attacked: all of both services' entries on
    each transport they are served on (the data plane's HELLO opens every connection)."""
    return [(service, name, transport) for service in (PS, RM)
            for name, rule in sorted(authz.TABLE[service].items()) if name != "HELLO"
            for transport in rule.transports]


@dataclass
class Tally:
    """Cross-job attempts per target, refusals by code, and what got through."""

    attempts: Counter = field(default_factory=Counter)
    codes: Counter = field(default_factory=Counter)
    revealed: list = field(default_factory=list)
    wrong: list = field(default_factory=list)
    effects: list = field(default_factory=list)
    internal: int = 0
    dp_sent: int = 0


def set_field(message, path: str, value) -> None:
    *parents, last = path.split(".")
    for name in parents:
        message = getattr(message, name)
    setattr(message, last, value)


def aim(data, w: World, rule: authz.Rule, message) -> None:
    """Point the entry's job fields at other jobs (Exchange: at least one of its two)."""
    fields = list(rule.job_fields)
    keep = data.draw(st.sampled_from([None] + fields), "attacker's own field") if len(fields) > 1 else None
    for path in fields:
        set_field(message, path, ATTACKER if path == keep else one_of(w, FOREIGN))


def grpc_request(data, w: World, service: str, method: str, rule: authz.Rule, tmp: str):
    """A structured request of ``method`` aimed at other jobs (bytes, or chunks for streams)."""
    request = admin_request(data, w, service, method, tmp)
    if rule.access != authz.JOB:
        if method == "GetShardMap":          # answered at once: the answer is what is judged
            return mg.GetShardMapRequest(min_epoch=one_of(w, [0, 1, w.epoch()]),
                                         known_epoch=one_of(w, [0, 1, w.epoch() - 1, w.epoch()]),
                                         job=one_of(w, ["", ATTACKER, *FOREIGN])).SerializeToString()
        if method == "WatchShardMap":
            return mg.WatchShardMapRequest(after_epoch=0, changes=one_of(w, [False, True]),
                                           job=one_of(w, ["", ATTACKER, *FOREIGN])).SerializeToString()
        return request
    if method == "Push":
        chunk = ps.PushChunk.FromString(request[0])
        aim(data, w, rule, chunk.header)
        return [chunk.SerializeToString()]
    msg = rule.message.FromString(request)
    aim(data, w, rule, msg)
    return msg.SerializeToString()


def named_jobs(method: str, rule: authz.Rule, request) -> list[str] | None:
    """The jobs a (possibly mutated) request names in its job fields; None if it does not
    parse (or has no first-chunk header)."""
    if method == "Push":
        chunk = parses(ps.PushChunk, request[0]) if request else None
        if chunk is None or not chunk.HasField("header"):
            return None
        return authz.requested_jobs(rule, chunk.header)
    msg = parses(rule.message, request)
    return None if msg is None else authz.requested_jobs(rule, msg)


def judge(t: Tally, key: str, rule: authz.Rule, jobs, code: str, mutated: bool) -> bool:
    """Record one outcome; returns whether it was a cross-job attempt."""
    t.codes[code] += 1
    t.internal += code == "INTERNAL"
    if rule.access in (authz.ADMIN, authz.INTERNAL):
        if code != "PERMISSION_DENIED":
            t.wrong.append(f"{key}: a job token got {code} from a {rule.access} RPC")
        return True
    if rule.access == authz.JOB:
        if jobs is not None and all(j == ATTACKER for j in jobs):
            return False              # the attacker's own job (a mutation put it back)
        allowed = {"PERMISSION_DENIED"} if jobs is not None and not mutated else \
            {"PERMISSION_DENIED", "INVALID_ARGUMENT"}
        if code not in allowed:
            t.wrong.append(f"{key} naming jobs {jobs}: {code}, expected one of {sorted(allowed)}")
        return True
    return True                       # AUTHENTICATED: judged by its answer


def foreign_jobs(message) -> set[str]:
    """Every job an answer names other than the attacker's (written independently of authz)."""
    found = set()
    for f, value in message.ListFields():
        if f.name == "job" and value != ATTACKER:
            found.add(value)
        elif f.message_type is not None:
            for item in (value if f.is_repeated else [value]):
                found |= foreign_jobs(item)
    return found


def check_answer(t: Tally, method: str, response) -> None:
    raw = response[0] if isinstance(response, list) else response
    if not raw:
        return
    answer = ANSWERS[method].FromString(raw)
    leaked = foreign_jobs(answer)
    if method == "GetNodeStatus" and answer.bytes != sum(x.bytes for x in answer.tables):
        leaked.add("node totals include other jobs")
    if leaked:
        t.revealed.append(f"{method} revealed {sorted(leaked)} to {ATTACKER!r}")


def run_grpc(data, w: World, t: Tally, service: str, method: str, token: str, tmp: str) -> None:
    seeded(data, w)
    rule = authz.TABLE[service][method]
    kind = PS_METHODS[method] if service == PS else \
        ("unary_stream" if method == "WatchShardMap" else "unary_unary")
    request = grpc_request(data, w, service, method, rule, tmp)
    mutated = coin(w) and coin(w)
    if mutated:
        request = [mutate(data, w, c) for c in request] if kind == "stream_unary" else mutate(data, w, request)
    jobs = named_jobs(method, rule, request) if rule.access == authz.JOB else None
    address = w.cluster.address if service == RM else w.servers[one_of(w, sorted(w.servers))]
    timeout = 0.5 if method in ANSWERS and service == RM else DEADLINE     # long polls
    out = w.wire.call(channel_to(w, address), service, method, request, kind=kind, timeout=timeout,
                      first_only=method == "WatchShardMap", may_wait=True,
                      metadata=(("authorization", f"Bearer {token}"),))
    key = f"{service.rsplit('.', 1)[-1]}.{method}"
    if judge(t, key, rule, jobs, out.code, mutated):
        t.attempts[key] += 1
    if out.code == OK and method in ANSWERS:
        check_answer(t, method, out.response)


def run_data_plane(data, w: World, t: Tally, method: str, conns: dict) -> None:
    seeded(data, w)
    rule = authz.TABLE[PS][method]
    seg = pb.Segment(table=one_of(w, ["w", "a"]), range=pb.Range(start=0, stop=8))
    push = ps.PushHeader(header=pb.RequestHeader(job=ATTACKER, epoch=w.epoch()), segments=[seg],
                         payload_bytes=32)
    pull = ps.PullRequest(header=pb.RequestHeader(job=ATTACKER, epoch=w.epoch()), segments=[seg])
    # Replicate: a forged primary's op on the victim's block (only the cluster may send one)
    forged = ps.ReplicateHeader(epoch=w.epoch(), source=one_of(w, sorted(w.servers)), payload_bytes=32,
                                ops=[ps.BlockOp(job=VICTIM, table=seg.table, block=0, kind=ps.APPLY,
                                                version=1, element_count=8)])
    if method == "Step":                # a push and a pull in one packed frame
        header, payload, jobs, mutated = _step_frame(data, w, rule, seg.table)
        flags = FLAG_PACKED
    else:
        msg = {"Push": push, "Pull": pull, "Exchange": ps.ExchangeHeader(push=push, pull=pull),
               "Replicate": forged}[method]
        aim(data, w, rule, msg)
        header = msg.SerializeToString()
        mutated = coin(w) and coin(w)
        if mutated:
            header = mutate(data, w, header)
        parsed = parses(DP_MESSAGES[method], header)
        jobs = None if parsed is None else authz.requested_jobs(rule, parsed)
        payload = [np.ones(8, np.float32)] if method != "Pull" else []
        flags = 0
    try:
        conns[one_of(w, sorted(conns))].call(method, header, payload, timeout=DEADLINE, flags=flags)
        code = OK
    except ShardpsError as exc:
        code = exc.code
    t.dp_sent += 1
    w.wire.sent += 1
    w.wire.codes[code] += 1
    w.wire.by_method[f"dataplane.{method}"][code] += 1
    if judge(t, f"dataplane.{method}", rule, jobs, code, mutated):
        t.attempts[f"dataplane.{method}"] += 1


def _step_frame(data, w: World, rule: authz.Rule, table: str):
    """A Step frame (header, payload, the jobs it names or None, mutated?) pushing and pulling
    ``table``'s first 8 elements, aimed at other jobs; its header mutated or not."""
    request = StepRequest(Header(ATTACKER, w.epoch(), "attacker", 1, 1), GRADIENT,
                          [Slice(table, RANGE, 0, 8, values=np.ones(8, np.float32))], [Slice(table, RANGE, 0, 8)])
    aim(data, w, rule, request)
    encoded = step.encode(request)
    header = encoded.header()
    mutated = coin(w) and coin(w)
    if mutated:
        header = mutate(data, w, header)
    try:
        jobs = authz.requested_jobs(rule, step.read_request(header)[0])
    except ShardpsError:
        jobs = None
    return header, encoded.parts(), jobs, mutated


def connections(w: World, token: str) -> dict:
    """A data-plane connection to every server, with the attacker's token."""
    return {name: DataPlaneConnection(w.cluster.servers[name].data_plane.address,
                                      metadata=(("authorization", f"Bearer {token}"),))
            for name in w.servers}


def victim_snapshot(w: World, admin_md: tuple) -> dict:
    """What of the victim the attacker must not change, apart from stored values: its tables
    (spec, config, placement), group members, job record, and each server's view of it."""
    rt = w.cluster.manager.runtime
    with rt.lock:
        published = rt.published
        job = rt.state.jobs.get(VICTIM)
        record = None if job is None else (job.consistency, job.staleness, job.quota_bytes,
                                           sorted((m.rank, m.session, m.incarnation, m.name)
                                                  for m in job.members.values()))
    tables = sorted(t.SerializeToString(deterministic=True) for t in published.tables if t.job == VICTIM)
    servers = {}
    for name, address in sorted(w.servers.items()):
        status = ps.NodeStatus.FromString(w.checks.call(
            channel_to(w, address), PS, "GetNodeStatus", b"", kind="unary_unary", metadata=admin_md).response)
        servers[name] = sorted((x.table, x.blocks, x.parameters, x.bytes) for x in status.tables
                               if x.job == VICTIM)
    return {"tables": tables, "job": record, "servers": servers}


def diff(before: dict, after: dict, what: str) -> list[str]:
    return [f"after {what}: the victim's {k} changed" for k in before if before[k] != after[k]]

