"""Import hygiene: the layers import downwards only.

* A worker never loads the server: ``import shardps.worker`` (and the client package and the
  client-side stubs) must not import any ``shardps.server`` module, nor torch.
* No import cycles between shardps modules at module level (imports that run when a module
  is first imported; imports inside functions and under ``if TYPE_CHECKING:`` are lazy and
  do not count). Modules are found through pyproject.toml's ``package-dir`` and read with
  ``ast``: nothing is imported.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Cycles that exist today and are someone else's to break: (sorted module names). Empty:
# a new cycle fails the test.
KNOWN_CYCLES: set[tuple[str, ...]] = set()


def test_importing_the_worker_loads_no_server_module_and_no_torch():
    code = ("import json, sys\n"
            "import shardps.worker\n"
            "import shardps.worker.client\n"
            "import shardps.rpc.stubs\n"
            "print(json.dumps(sorted(m for m in sys.modules\n"
            "                        if m.startswith('shardps.server') or m.split('.')[0] == 'torch')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == [], f"importing shardps.worker loaded {loaded}: the worker must not depend on them"


def _modules() -> dict[str, Path]:
    """Module name -> file, for every package in pyproject.toml's package-dir (recursively)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        package_dir = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    modules: dict[str, Path] = {}
    for package, folder in package_dir.items():
        base = ROOT / folder
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if (Path(dirpath) / d / "__init__.py").exists()]
            rel = Path(dirpath).relative_to(base)
            prefix = ".".join((package, *rel.parts))
            for name in filenames:
                if name.endswith(".py"):
                    module = prefix if name == "__init__.py" else f"{prefix}.{name[:-3]}"
                    modules.setdefault(module, Path(dirpath) / name)
    return modules


def _module_level_imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The shardps modules ``module`` imports when it is first imported."""
    is_package = path.name == "__init__.py"
    names: list[str] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue                                   # runs later, if at all
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for other in child.orelse:
                    visit_statement(other)
                continue
            visit_statement(child)

    def visit_statement(child: ast.AST) -> None:
        if isinstance(child, ast.Import):
            names.extend(alias.name for alias in child.names)
        elif isinstance(child, ast.ImportFrom):
            base = child.module or ""
            if child.level:
                package = module if is_package else module.rpartition(".")[0]
                for _ in range(child.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            for alias in child.names:
                sub = f"{base}.{alias.name}"
                names.append(sub if sub in modules else base)
        visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    found = set()
    for name in names:
        while name and name not in modules:        # an attribute of a module: the module
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[tuple[str, ...]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        out.append(tuple(sorted(component)))
    return out


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [("a", "b", "c")]


def test_no_import_cycles_between_shardps_modules():
    modules = _modules()
    assert "shardps.worker.client.client" in modules and "shardps.server" in modules, sorted(modules)
    graph = {m: _module_level_imports(m, p, modules) for m, p in modules.items()}
    assert "shardps.worker.client.admin" in graph["shardps.worker.client.membership"]
    cycles = [c for c in _cycles(graph) if c not in KNOWN_CYCLES]
    assert not cycles, ("module-level import cycles (move an import into the function that needs "
                        "it, or move the shared code down a layer): " + "; ".join(" <-> ".join(c) for c in cycles))


def test_nothing_in_the_library_imports_the_tools():
    """shardps.tools (the commands, bench, verifier, local cluster) sits above the library:
    no module of shardps, shardps.server or shardps.worker imports it, lazily or not."""
    modules = _modules()
    assert "shardps.tools.cli" in modules and "shardps.tools.bench.lines" in modules
    offenders = []
    for module, path in modules.items():
        if module == "shardps.tools" or module.startswith("shardps.tools."):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if isinstance(node, ast.ImportFrom) and node.module == "shardps":
                names = [f"shardps.{a.name}" for a in node.names]
            offenders += [f"{module} (line {node.lineno}): {n}" for n in names
                          if n == "shardps.tools" or n.startswith("shardps.tools.")]
    assert not offenders, "the library imports the tools: " + "; ".join(offenders)
