"""The code stays readable in pieces: no hand-written module over 500 lines, no class over 300
(generated protobuf code excepted); and only the transport room knows gRPC."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("shardps", "server", "worker", "protos", "tools", "tests")


def _modules():
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "_pb2" not in path.name:
                yield path


def test_no_module_over_500_lines_and_no_class_over_300():
    too_long, too_big = [], []
    for path in _modules():
        source = path.read_text()
        lines = len(source.splitlines())
        if lines > 500:
            too_long.append(f"{path.relative_to(ROOT)}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 300:
                too_big.append(f"{path.relative_to(ROOT)}: class {node.name}, "
                               f"{node.end_lineno - node.lineno + 1} lines")
    assert not too_long and not too_big, "split these: " + "; ".join(too_long + too_big)


# Only shardps/rpc/ (and the generated code in protos/) knows gRPC: everything else makes its
# calls inside ``shardps.rpc.status.translated`` and catches ShardpsError. The exceptions, each
# with its reason:
GRPC_ALLOWED = {
    "server/node_service.py": "the ParameterServer servicer: the gRPC adapter of ServerNode",
    "server/manager/service.py": "the ResourceManager servicer: the gRPC adapter of the manager",
    "tools/bench/transport.py": "measures grpcio itself: a bare handler, without the binder's layers",
}


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every import anywhere in the module: ``import a.b`` names ``a.b``,
    ``from a.b import c`` names ``a.b.c``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found += [(node.lineno, f"{node.module or ''}.{alias.name}") for alias in node.names]
    return found


def _grpc_uses(tree: ast.AST) -> list[str]:
    """``import grpc`` / ``grpc_health`` / ... anywhere in the module, and handlers of RpcError."""
    found = [f"line {node.lineno}: except {ast.unparse(node.type)}" for node in ast.walk(tree)
             if isinstance(node, ast.ExceptHandler) and node.type is not None and "RpcError" in ast.unparse(node.type)]
    return found + [f"line {line}: imports {n}" for line, n in _imports(tree) if n.split(".")[0].startswith("grpc")]


def test_only_the_transport_room_knows_grpc():
    offenders = []
    for folder in ("shardps", "server", "worker"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith("shardps/rpc/") or rel in GRPC_ALLOWED:
                continue
            offenders += [f"{rel} {use}" for use in _grpc_uses(ast.parse(path.read_text()))]
    assert not offenders, ("gRPC outside shardps/rpc (call inside shardps.rpc.status.translated and catch "
                           "ShardpsError; or move the gRPC part into shardps/rpc): " + "; ".join(offenders))
    assert all((ROOT / rel).exists() for rel in GRPC_ALLOWED), "an allowed module is gone: drop it from the list"


def test_the_grpc_check_sees_imports_and_handlers():
    source = ("import grpc\nfrom grpc_health.v1 import health_pb2\nimport grpcx.y, json\n"
              "def f():\n    try:\n        pass\n    except (grpc.RpcError, OSError):\n        pass\n")
    assert sorted(_grpc_uses(ast.parse(source))) == [
        "line 1: imports grpc", "line 2: imports grpc_health.v1.health_pb2", "line 3: imports grpcx.y",
        "line 7: except (grpc.RpcError, OSError)"]


def test_the_server_nodes_layers_read_no_environment():
    """Settings (and the verifier's test-only defects) reach a node through its constructor:
    ``shardps server`` reads the environment once, at its start."""
    readers = []
    for path in sorted((ROOT / "server" / "node").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                    isinstance(node.value, ast.Name) and node.value.id == "os":
                readers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not readers, "read the environment in the entry point and pass it in: " + ", ".join(readers)


def _protobuf_imports(tree: ast.AST) -> list[str]:
    """Imports of generated protobuf modules (``*_pb2``, ``*_pb2_grpc``), anywhere in the module."""
    return [f"line {line}: imports {n}" for line, n in _imports(tree) if "_pb2" in n]


def test_the_protobuf_check_sees_every_form_of_import():
    source = ("from shardps.protos.v1 import common_pb2 as pb\nimport shardps.protos.v1.manager_pb2\n"
              "import json\nfrom shardps.protos.v1.parameter_server_pb2 import BlockOp\n"
              "def f():\n    from shardps.protos.v1 import x_pb2_grpc\n")
    assert [u.split(":")[0] for u in _protobuf_imports(ast.parse(source))] == [
        "line 1", "line 2", "line 4", "line 6"]


# Only shardps/rpc/ should import the generated protobuf code: every other module takes plain
# values. The library's modules that still do, each with its reason; the list only shrinks
# (a module that no longer imports it must leave it).
PROTOBUF_ALLOWED = {
    "shardps/shardmap.py": "the shard map stays a message: its read-only view indexes it",
    "shardps/mapdelta.py": "the shard map stays a message: maps as changes",
    "shardps/authz.py": "the authorization table names each request message's job fields",
    "shardps/status.py": "the cluster status text, written from the ClusterStatus message",
    "server/node_service.py": "the ParameterServer servicer: the gRPC adapter of ServerNode",
    "server/processes.py": "a server's registration and heartbeats to the manager",
    "server/manager/service.py": "the ResourceManager servicer",
    "server/manager/state.py": "the manager's state is kept as messages",
    "server/manager/store.py": "the manager's state file",
    "server/manager/runtime.py": "the manager publishes the shard map and calls the servers",
    "server/manager/map_history.py": "past shard maps",
    "server/manager/checkpoints.py": "checkpoint and restore calls to the servers",
    "server/manager/checkpoint_plan.py": "the shard map's placements, planned into a checkpoint",
    "server/manager/checkpoint_files.py": "table specs and configs in a checkpoint's manifest",
    "worker/client/admin.py": "the client's control-plane calls to the manager",
}


def test_only_the_rpc_room_and_the_listed_modules_import_generated_protobuf():
    found = set()
    for folder in ("shardps", "server", "worker"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith("shardps/rpc/") and _protobuf_imports(ast.parse(path.read_text())):
                found.add(rel)
    assert not found - PROTOBUF_ALLOWED.keys(), (
        "generated protobuf outside shardps/rpc (convert in shardps/rpc and take plain values): "
        + ", ".join(sorted(found - PROTOBUF_ALLOWED.keys())))
    assert not PROTOBUF_ALLOWED.keys() - found, (
        "these no longer import protobuf: drop them from PROTOBUF_ALLOWED: "
        + ", ".join(sorted(PROTOBUF_ALLOWED.keys() - found)))


def test_no_module_of_the_server_node_imports_generated_protobuf():
    """A server node's layers take plain values (``shardps.messages``, ``shardps.blockops``;
    the shard map stays a message behind ``shardps.shardmap``): ``shardps/rpc`` turns the
    wire's messages into them, and the servicer (``server/node_service.py``) calls the node."""
    offenders = []
    for path in sorted((ROOT / "server" / "node").rglob("*.py")):
        offenders += [f"{path.relative_to(ROOT)} {use}" for use in _protobuf_imports(ast.parse(path.read_text()))]
    assert not offenders, ("generated protobuf in server/node (take the plain values of shardps.messages / "
                           "shardps.blockops, and convert in shardps/rpc): " + "; ".join(offenders))
