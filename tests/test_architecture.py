"""The layering README's "Layout" describes, checked from the source (no imports executed).

flows/ sits on top: nothing in gpu_jobs/, storage/ or tasks/ imports it. And no module imports
another that imports it back, directly or around a longer loop, counting imports inside
functions too (a lazy import hides a cycle from Python, not from a reader).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("flows", "tasks", "gpu_jobs", "storage", "deployments")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module an import of `name` loads last (a submodule if it is one)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _in_type_checking(node: ast.AST) -> bool:
    return getattr(node, "_rlmill_type_checking", False)


def _graph(named_only: bool = False) -> dict[str, set[str]]:
    """module -> the project modules importing it runs; named_only: only those its import
    statements name (not the package __init__s above them that run first)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        for block in ast.walk(tree):  # imports under `if TYPE_CHECKING:` never run
            if isinstance(block, ast.If) and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                for inner in ast.walk(block):
                    inner._rlmill_type_checking = True
        graph[name] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and not _in_type_checking(node):
                graph[name] |= _imports_of_node(name, path, node, modules, named_only)
    return graph


def _imports_of_node(name: str, path: Path, node: ast.AST, modules: dict[str, Path],
                     named_only: bool = False) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    found = {m for t in targets if (m := _resolve(t, modules)) and m != name}
    if named_only:
        return found
    # Importing a.b.c runs a/__init__ and a/b/__init__ first: those are imports too (a package
    # whose __init__ imports its engines makes every importer of a small helper in it depend on them).
    return found | {a for m in found for a in _ancestors(m) if a in modules and a != name}


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _is_package_init(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def test_nothing_below_flows_imports_flows():
    up = sorted(f"{m} -> {t}" for m, targets in _graph().items() if m.split(".")[0] in ("gpu_jobs", "storage", "tasks")
                for t in targets if t.split(".")[0] == "flows")
    assert not up, "imports that run back up into flows/:\n" + "\n".join(up)


def test_no_import_cycles_between_modules():
    """Importing a.b.c runs a/__init__ first, but from inside package a that __init__ has
    already run: leave those implied edges out. An import that names its own package (`from
    gpu_jobs.rollout import X` inside gpu_jobs/rollout/) stays: it depends on everything the
    __init__ re-exports, so a loop through it is a real one. The __init__'s own imports of its
    submodules stay too: they run whenever anything in the package is imported."""
    modules = _modules()
    named = _graph(named_only=True)
    graph = {m: {t for t in ts if not (_is_package_init(t, modules) and m.startswith(t + ".") and t not in named[m])}
             for m, ts in _graph().items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_checker_sees_a_cycle_and_an_upward_import():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
