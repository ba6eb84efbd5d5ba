"""The authorization table (``shardps.authz``): complete for every .proto, enforced on gRPC and
on the data plane, deny by default, answers filtered. Real gRPC servers and data planes on
loopback; the cross-job fuzz that reads the same table is ``tests/test_authz_fuzz.py``."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from concurrent import futures

import grpc
import numpy as np
import pytest

from shardps import authz
from shardps.errors import PermissionDenied
from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.rpc.status import bind, proto_method
from shardps.server.auth import Authenticator, issue_job_token
from shardps.tables import sgd
from tests.fuzz.admin import ADMIN, TOKEN_KEY, secure_cluster
from tests.sessions import ClientSession


def declared_rpcs() -> dict[str, set[str]]:
    """Service full name -> RPC names, from every generated *_pb2 module's descriptors."""
    import shardps.protos.v1 as v1
    out: dict[str, set[str]] = {}
    for mod in pkgutil.iter_modules(v1.__path__):
        if mod.name.endswith("_pb2"):
            module = importlib.import_module(f"{v1.__name__}.{mod.name}")
            for service in module.DESCRIPTOR.services_by_name.values():
                out.setdefault(service.full_name, set()).update(m.name for m in service.methods)
    return out


def test_every_rpc_of_every_proto_has_exactly_one_entry():
    """A new RPC in a .proto fails here until the table says who may call it; an entry for
    an RPC no .proto declares must be a data-plane-only method or a standard service's."""
    declared = declared_rpcs()
    assert {authz.PS_SERVICE, authz.RM_SERVICE} <= set(declared)
    missing = sorted(f"{s}/{m}" for s, names in declared.items() for m in names
                     if m not in authz.TABLE.get(s, {}))
    assert not missing, f"RPCs without an entry in shardps.authz.TABLE: {missing}"
    stale = sorted(f"{s}/{m}" for s, rules in authz.TABLE.items() for m, r in rules.items()
                   if m not in declared.get(s, set()) and "grpc" in r.transports)
    assert not stale, f"entries served over gRPC that no .proto declares: {stale}"
    # exactly one: a key written twice in the table's dict literals would silently override
    tree = ast.parse(inspect.getsource(authz))
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            keys = [k.value for k in node.keys if isinstance(k, ast.Constant)]
            assert len(keys) == len(set(keys)), f"duplicate entries: {sorted(keys)}"


def test_job_fields_name_string_fields_of_the_request():
    """Every job-scoped entry says where the job is read from, and that field exists: the
    request of a unary RPC (its .proto input type), the header of a streamed one."""
    inputs = {}
    for s in declared_rpcs():
        module = {authz.PS_SERVICE: ps, authz.RM_SERVICE: importlib.import_module(
            "shardps.protos.v1.manager_pb2")}.get(s)
        for m in module.DESCRIPTOR.services_by_name[s.rsplit(".", 1)[-1]].methods if module else ():
            inputs[(s, m.name)] = m
    for service, rules in authz.TABLE.items():
        for name, rule in rules.items():
            if rule.access != authz.JOB:
                assert not rule.job_fields, f"{name}: only job-scoped entries read a job"
                continue
            assert rule.job_fields and rule.message is not None, name
            for path in rule.job_fields:
                assert isinstance(authz.field_value(rule.message(), path), str), f"{name}: {path}"
            method = inputs.get((service, name))
            if method is not None and not method.client_streaming:
                assert method.input_type.full_name == rule.message.DESCRIPTOR.full_name, name


def test_the_services_bind_only_what_the_table_serves_over_grpc(make_cluster):
    cluster = make_cluster(1)
    bound = {authz.RM_SERVICE: cluster.manager.service.methods(),
             authz.PS_SERVICE: next(iter(cluster.servers.values())).service.methods()}
    for service, methods in bound.items():
        for name in methods:
            rule = authz.TABLE[service].get(name)
            assert rule is not None and "grpc" in rule.transports, f"{service}/{name}"


def _serve(service: str, methods: dict, authenticate):
    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((bind(service, authz.enforce(service, methods), None, authenticate),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, grpc.insecure_channel(f"127.0.0.1:{port}")


def _md(token: str) -> tuple:
    return (("authorization", f"Bearer {token}"),)


@pytest.mark.parametrize("auth", ["on", "off"])
def test_an_rpc_without_an_entry_is_refused(auth):
    """Deny by default: a method bound by a service but absent from the table is refused with
    PERMISSION_DENIED, to the admin too and with authentication off; the method is never run."""
    ran = []

    def status(request, call):
        ran.append(call.method)
        return ps.NodeStatus(name="n")
    m = proto_method("unary_unary", status, ps.GetNodeStatusRequest)
    authn = Authenticator(ADMIN, TOKEN_KEY.encode()) if auth == "on" else None
    server, ch = _serve(authz.PS_SERVICE, {"GetNodeStatus": m, "DumpEverything": m}, authn)
    try:
        md = _md(ADMIN) if auth == "on" else ()
        for name in ("DumpEverything", "NoSuchMethodAnywhere"):
            with pytest.raises(grpc.RpcError) as err:
                ch.unary_unary(f"/{authz.PS_SERVICE}/{name}")(b"", timeout=5, metadata=md)
            assert err.value.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED)
            if name == "DumpEverything":
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "authorization table" in err.value.details()
        assert ch.unary_unary(f"/{authz.PS_SERVICE}/GetNodeStatus")(b"", timeout=5, metadata=md)
        assert ran == [f"/{authz.PS_SERVICE}/GetNodeStatus"]
    finally:
        ch.close()
        server.stop(None)


def test_an_answer_naming_another_job_is_not_sent_to_a_job_token():
    """OWN_JOB answers are checked on the way out: a handler that forgets to filter reveals
    nothing to a job token (INTERNAL, the reply withheld) while the admin gets it whole."""
    leaky = pb.ShardMap(epoch=3)
    leaky.tables.add(job="team-a", spec=pb.TableSpec(name="secret"))
    leaky.tables.add(job="team-b", spec=pb.TableSpec(name="w"))
    from shardps.protos.v1 import manager_pb2 as mg
    methods = {"GetShardMap": proto_method("unary_unary", lambda r, c: leaky, mg.GetShardMapRequest),
               "WatchShardMap": proto_method("unary_stream", lambda r, c: iter([leaky]),
                                             mg.WatchShardMapRequest)}
    server, ch = _serve(authz.RM_SERVICE, methods, Authenticator(ADMIN, TOKEN_KEY.encode()))
    token_b = issue_job_token(TOKEN_KEY.encode(), "team-b")
    try:
        get = ch.unary_unary(f"/{authz.RM_SERVICE}/GetShardMap")
        watch = ch.unary_stream(f"/{authz.RM_SERVICE}/WatchShardMap")
        for call in (lambda md: get(b"", timeout=5, metadata=md),
                     lambda md: list(watch(b"", timeout=5, metadata=md))):
            with pytest.raises(grpc.RpcError) as err:
                call(_md(token_b))
            assert err.value.code() == grpc.StatusCode.INTERNAL
            assert "team-b" in err.value.details() and "secret" not in err.value.details()
            assert call(_md(ADMIN))
    finally:
        ch.close()
        server.stop(None)


def test_the_data_plane_checks_the_tables_entries(make_cluster, client_factory):
    """Push, Pull and Exchange over the data plane with B's token naming A's job are refused
    with PERMISSION_DENIED before anything is applied (Exchange: B's own push included);
    a data-plane method without an entry is refused; A's values do not move."""
    from shardps.rpc.dataplane import DataPlaneConnection
    cluster = secure_cluster(make_cluster, 1)
    tokens = {j: client_factory(cluster.address, job=j, token=ADMIN).create_job() for j in ("team-a", "team-b")}
    a = client_factory(cluster.address, job="team-a", token=tokens["team-a"])
    b = client_factory(cluster.address, job="team-b", token=tokens["team-b"])
    a.create_dense("w", (8,), optimizer=sgd(1.0))
    b.create_dense("w", (8,), optimizer=sgd(1.0))
    a.push_dense("w", np.ones(8, np.float32))
    b_before = b.pull_dense("w").copy()
    epoch = a.refresh_map().epoch
    server = next(iter(cluster.servers.values()))
    seg = [pb.Segment(table="w", range=pb.Range(start=0, stop=8))]

    session = ClientSession(cluster.address, "team-b", metadata=_md(tokens["team-b"]))

    def push(job):
        return ps.PushHeader(header=session.header(epoch, job=job), segments=seg, payload_bytes=32)

    def pull(job):
        return ps.PullRequest(header=pb.RequestHeader(job=job, epoch=epoch), segments=seg)
    grads = np.ones(8, np.float32)
    with DataPlaneConnection(server.data_plane.address, metadata=_md(tokens["team-b"])) as conn:
        attempts = [("Push", push("team-a"), [grads]), ("Pull", pull("team-a"), []),
                    ("Exchange", ps.ExchangeHeader(push=push("team-b"), pull=pull("team-a")), [grads]),
                    ("Exchange", ps.ExchangeHeader(push=push("team-a"), pull=pull("team-b")), [grads])]
        for method, header, payload in attempts:
            with pytest.raises(PermissionDenied, match="team-b"):
                conn.call(method, header.SerializeToString(), payload, timeout=5)
        with pytest.raises(PermissionDenied, match="authorization table"):
            conn.call(9, push("team-b").SerializeToString(), [grads], timeout=5)
        conn.call("Push", push("team-b").SerializeToString(), [grads], timeout=5)      # its own: served
    np.testing.assert_array_equal(a.pull_dense("w"), -np.ones(8))
    np.testing.assert_array_equal(b.pull_dense("w"), b_before - 1)       # only its own push landed
