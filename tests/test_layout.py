"""The code stays readable in pieces: no hand-written module over 500 lines, no class over 300
(generated protobuf code excepted)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("shardps", "server", "worker", "protos", "tests")


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
