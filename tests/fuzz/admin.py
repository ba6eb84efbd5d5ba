"""Admin RPCs with credentials: no token, a forged one, another job's, the job's own or the
admin's; which requests are safe to send; what each credential must be refused."""

from __future__ import annotations

from collections import Counter

import grpc
import numpy as np
from hypothesis import strategies as st

from shardps import authz
from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import manager_pb2 as mg
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.rpc import channels
from shardps.server.auth import Authenticator
from tests.fuzz.encoder import parses
from tests.fuzz.internal_rpcs import internal_request
from tests.fuzz.manager_rpcs import manager_request, waits
from tests.fuzz.reference import DATA_JOB
from tests.fuzz.strategies import blob, coin, mutate, one_of, randint, seeded
from tests.fuzz.wire import OK, PS, PS_METHODS, RM, RM_REQUESTS
from tests.fuzz.world import World

ADMIN = "fuzz-admin-token-0123456789"
TOKEN_KEY = "fuzz-token-key"
VICTIM, OTHER = DATA_JOB, "other"      # the victim job holds the data tables
SAFE_ADDRESSES = ["", "127.0.0.1:1", "localhost:1", "[::1]:1"]      # nothing to resolve, nothing listening


def credential(data, tokens: dict) -> tuple[str, tuple]:
    """Which credentials a message carries: none, garbage, a job token, or the admin token."""
    who = data.draw(st.sampled_from(["admin", "admin", "none", "garbage", VICTIM, OTHER]), "credential")
    token = {"admin": ADMIN, "none": "", "garbage": "fuzz.not.signed", VICTIM: tokens[VICTIM],
             OTHER: tokens[OTHER]}[who]
    return who, ((("authorization", f"Bearer {token}"),) if token else ())


def admin_request(data, w: World, service: str, method: str, tmp: str):
    """A structured request of any RPC, aimed at the victim job's real blocks."""
    if service == RM:
        msg = manager_request(data, w, method, tmp)
        if method == "RegisterServer":
            msg.name = one_of(w, ["s0", "s1", "s2", "s9", ""])
            msg.address = one_of(w, SAFE_ADDRESSES)
        if method in ("DrainServer", "ServerHeartbeat"):
            msg.name = one_of(w, ["s0", "s1", "s2", "s9"])
        if hasattr(msg, "job") and coin(w):
            msg.job = one_of(w, [VICTIM, OTHER])
        return msg.SerializeToString()
    if method in ("Push", "Pull"):
        header = pb.RequestHeader(job=one_of(w, [VICTIM, OTHER, ""]), epoch=w.epoch())
        seg = pb.Segment(table="w", range=pb.Range(start=0, stop=8))
        if method == "Pull":
            return ps.PullRequest(header=header, segments=[seg]).SerializeToString()
        head = ps.PushHeader(header=header, segments=[seg], payload_bytes=32)
        return [ps.PushChunk(header=head, data=np.ones(8, np.float32).tobytes()).SerializeToString()]
    return internal_request(data, w, method, w.ref.tables, real_refs=True)


def admin_safe(service: str, method: str, request) -> bool:
    """Only requests that cannot make the manager resolve or dial arbitrary names."""
    if service == RM and method == "RevokeJobTokens":    # the fuzz keeps using these tokens
        msg = parses(mg.RevokeJobTokensRequest, request)
        return msg is None or msg.job not in (VICTIM, OTHER)
    if service == RM and method == "RegisterServer":
        msg = parses(mg.RegisterServerRequest, request)
        return msg is None or msg.address in SAFE_ADDRESSES
    if service == PS and method == "CopyBlocks":
        msg = parses(ps.CopyBlocksRequest, request)
        return msg is None or msg.destination in ("", "s0", "s1", "s2", "s9")
    return True


def run_admin(data, w: World, tokens: dict, tmp: str, checks: Counter) -> None:
    seeded(data, w)
    service = data.draw(st.sampled_from([PS, RM]), "service")
    method = data.draw(st.sampled_from(sorted(PS_METHODS) if service == PS else sorted(RM_REQUESTS)), "method")
    kind = PS_METHODS[method] if service == PS else \
        ("unary_stream" if method == "WatchShardMap" else "unary_unary")
    form = data.draw(st.sampled_from(["structured"] * 5 + ["mutated", "random"]), "form")
    if form == "random":
        chunks = [blob(w, 0, 64) for _ in range(randint(w, 1, 3))]
        request = chunks if kind == "stream_unary" else chunks[0]
    else:
        request = admin_request(data, w, service, method, tmp)
        if form == "mutated":
            request = [mutate(data, w, c) for c in request] if kind == "stream_unary" else mutate(data, w, request)
    if not admin_safe(service, method, request):
        w.skipped[method] += 1
        return
    who, metadata = credential(data, tokens)
    address = w.cluster.address if service == RM else w.servers[data.draw(st.sampled_from(sorted(w.servers)), "server")]
    admin_only = authz.TABLE[service][method].access in (authz.ADMIN, authz.INTERNAL)
    parsed = parses(RM_REQUESTS[method], request) if service == RM else None
    out = w.wire.call(channel_to(w, address), service, method, request, kind=kind,
                      timeout=0.15 if waits(w, method, parsed) else 2.0,
                      first_only=method == "WatchShardMap", may_wait=True, metadata=metadata)
    if w.wire.known_bug(method, out) is not None and out.code == "INTERNAL" \
            and "deserializing" in out.details:
        return          # refused before the credentials were looked at (known bug)
    what = f"{method} with credential {who} -> {out.code} {out.details[:200]}"
    if who in ("none", "garbage"):
        assert out.code == "UNAUTHENTICATED", f"unauthenticated call answered: {what}"
        checks["refused without a valid token"] += 1
    elif who != "admin" and admin_only:
        # UNAUTHENTICATED "revoked": the admin's own fuzzing ended and re-created the job
        # (or revoked its tokens): the job token is refused before its role is looked at
        revoked = out.code == "UNAUTHENTICATED" and "revoked" in out.details
        assert out.code == "PERMISSION_DENIED" or revoked, f"job token used for an admin RPC: {what}"
        checks["admin RPC refused to a job token"] += 1
    elif who != "admin":
        jobs = requested_jobs(service, method, request)
        if jobs and any(j != who for j in jobs):
            assert out.code != OK, f"a token of job {who!r} acted on job(s) {jobs}: {what}"
            checks["other job's request refused"] += 1


def requested_jobs(service: str, method: str, request) -> list[str]:
    """The job(s) a request names in its authorization-table entry's job fields (what a job
    token is checked against)."""
    rule = authz.TABLE[service][method]
    if rule.access != authz.JOB:
        return []
    if method == "Push":
        chunk = parses(ps.PushChunk, request[0]) if request else None
        return authz.requested_jobs(rule, chunk.header) if chunk is not None and chunk.HasField("header") else []
    msg = parses(rule.message, request)
    return authz.requested_jobs(rule, msg) if msg is not None else []


def secure_cluster(make_cluster, servers: int, **kw):
    """An in-process cluster with the admin token and job tokens on (processes present the
    admin token to each other)."""
    admin_md = (("authorization", f"Bearer {ADMIN}"),)
    return make_cluster(
        servers, serving_kw={"admin_token": ADMIN, "token_key": TOKEN_KEY},
        manager_kw={"authenticate": Authenticator(ADMIN, TOKEN_KEY.encode()), "metadata": admin_md},
        server_kw={"authenticate": Authenticator(ADMIN, TOKEN_KEY.encode()), "metadata": admin_md},
        **kw)


def channel_to(w: World, address: str) -> grpc.Channel:
    ch = w.channels.get(address)
    if ch is None:
        ch = w.channels[address] = channels.channel(address)
    return ch
