"""fusedpar's import graph, read from the source with ``ast`` (function-level imports too):
no import cycle between its modules, and no module imports another module's underscore
names (a private name is private to its module: a module that needs it from elsewhere
needs a public one)."""

from __future__ import annotations

import ast
import functools
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# package-private modules of fusedpar itself, not another module's private names
PRIVATE_MODULES_ALLOWED = {"fusedpar._extension", "fusedpar._build_info", "fusedpar._C"}
# Violations allowed (each must go: the test fails when one is fixed and still listed, or a
# new one appears): none.
KNOWN_CYCLES = []
KNOWN_PRIVATE_IMPORTS = []


def _modules() -> dict[str, str]:
    """{dotted module name: path} of every module of fusedpar."""
    found = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "fusedpar")):
        for f in files:
            if f.endswith(".py"):
                parts = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                found[".".join(parts)] = os.path.join(folder, f)
    return found


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (never run)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def _imports(name: str, path: str, modules) -> list[tuple[str, str | None, int]]:
    """``(imported module, imported name or None, line)`` for every import in ``path``."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    skip = _type_checking_only(tree)
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub, None, node.lineno) if sub in modules
                           else (base, a.name, node.lineno))
    return out


@functools.cache
def _graph():
    modules = _modules()
    return modules, {m: _imports(m, p, modules) for m, p in modules.items()}


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), and self-loops."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges[v]:
                out.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_the_graph_is_read():
    modules, imports = _graph()
    assert "fusedpar.ops.registry" in modules and "fusedpar.cli.check" in modules
    # a relative import, a function-level import and a module imported by `from pkg import mod`
    assert any(m == "fusedpar.ops.registry" and n == "register"
               for m, n, _ in imports["fusedpar.ops.all_gather"])
    assert any(m == "fusedpar.testing.parallel" for m, _, _ in imports["fusedpar.cli.check"])
    assert any(m == "fusedpar.models.llama" for m, _, _ in imports["fusedpar.testing.parallel"])
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"c"}, "d": set()}) == [["a", "b"], ["c"]]


def test_no_import_cycle_between_fusedpar_modules():
    modules, imports = _graph()
    edges = {m: {target for target, _, _ in imports[m] if target in modules and target != m}
             for m in modules}
    assert _cycles(edges) == KNOWN_CYCLES


def test_no_module_imports_another_modules_underscore_names():
    modules, imports = _graph()
    violations = []
    for m, found in imports.items():
        for target, name, line in found:
            if not target.startswith("fusedpar"):
                continue
            private = [p for p in target.split(".") if p.startswith("_") and not p.startswith("__")]
            where = os.path.relpath(modules[m], ROOT)
            if private and target not in PRIVATE_MODULES_ALLOWED:
                violations.append(f"{where} imports the private module {target}")
            if name and name.startswith("_") and not name.startswith("__") and target != m:
                violations.append(f"{where} imports {name} from {target}")
    assert sorted(set(violations)) == KNOWN_PRIVATE_IMPORTS
