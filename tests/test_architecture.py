"""The layering docs/reference/layout.md describes, checked from the source (no imports executed).

flows/ sits on top: nothing in gpu_jobs/, storage/ or tasks/ imports it. And no module imports
another that imports it back, directly or around a longer loop, counting imports inside
functions too (a lazy import hides a cycle from Python, not from a reader).

The parts:
- storage/ keeps bytes, layout and the commit protocol: it imports no other part (a domain
  record, like a canary or a training window, lives with the part that owns it).
- the online loop is gpu_jobs/online/ (serving, events, the consumer, windows, canaries) and
  flows/online/ (its flows: drain, retrain, decide). Its work builds on storage and on the model,
  rollout, data and reward packages only (not the training stages or the trainer); it is driven by
  its flows, the CLI (serve, feedback, simulate, models) and the nightly flow (which starts
  canaries); its flows are started by the CLI and the deployments, never imported by another flow.

And no room does two jobs: no module over 500 lines, no function over 60.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("flows", "tasks", "gpu_jobs", "storage", "deployments")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60

# A part's modules by prefix ("flows.cli*": flows.cli and flows.cli_serve, flows.cli_models ...).
ONLINE_WORK = ("gpu_jobs.online",)
ONLINE_FLOWS = ("flows.online",)
ONLINE_WORK_MAY_IMPORT = ("storage", "gpu_jobs.models", "gpu_jobs.rollout", "gpu_jobs.chat", "gpu_jobs.data",
                          "gpu_jobs.reward", "gpu_jobs.registry")  # registry: the name -> variant table every part uses
ONLINE_WORK_USERS = ("flows.cli*", "flows.nightly")
ONLINE_FLOWS_USERS = ("flows.cli*",)


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


@functools.lru_cache(maxsize=None)  # parsed once per session; callers do not change it
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


# ------------------------------------------------------------------------------------ the parts
def _matches(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module.startswith(p[:-1]) if p.endswith("*") else module == p or module.startswith(p + ".")
               for p in prefixes)


def _imports_outside(graph: dict[str, set[str]], part: tuple[str, ...], allowed: tuple[str, ...]) -> list[str]:
    """Each `module -> target` where a module of `part` imports a project module outside `part` and
    `allowed`."""
    return sorted(f"{m} -> {t}" for m, ts in graph.items() if _matches(m, part)
                  for t in ts if not _matches(t, part + allowed))


def _importers_outside(graph: dict[str, set[str]], part: tuple[str, ...], users: tuple[str, ...]) -> list[str]:
    """Each `module -> target` where a module outside `part` and `users` imports one of `part`."""
    return sorted(f"{m} -> {t}" for m, ts in graph.items() if not _matches(m, part + users)
                  for t in ts if _matches(t, part))


def test_storage_imports_no_other_part():
    wrong = _imports_outside(_graph(named_only=True), ("storage",), ())
    assert not wrong, "storage/ keeps bytes, layout and the commit protocol; these import other parts:\n" + \
        "\n".join(wrong)


def test_the_online_loop_builds_on_storage_models_rollout_data_and_reward_only():
    wrong = _imports_outside(_graph(named_only=True), ONLINE_WORK, ONLINE_WORK_MAY_IMPORT)
    assert not wrong, f"gpu_jobs/online/ may import {', '.join(ONLINE_WORK_MAY_IMPORT)}; these import more:\n" + \
        "\n".join(wrong)


def test_only_the_online_flows_the_cli_and_the_nightly_use_the_online_loop():
    graph = _graph(named_only=True)
    wrong = (_importers_outside(graph, ONLINE_WORK, ONLINE_FLOWS + ONLINE_WORK_USERS)
             + _importers_outside(graph, ONLINE_FLOWS, ONLINE_FLOWS_USERS))
    assert not wrong, "imports of the online loop from outside the modules that drive it:\n" + "\n".join(wrong)


def test_the_part_rules_see_a_wrong_import():
    graph = {"storage.fs": {"storage.errors"}, "storage.records": {"gpu_jobs.online.windows"},
             "gpu_jobs.online.app": {"storage.fs", "gpu_jobs.rollout", "gpu_jobs.stages.run"},
             "flows.cli_serve": {"gpu_jobs.online.app"}, "flows.training": {"gpu_jobs.online.app"},
             "flows.nightly": {"flows.online.retrain"}, "flows.online.retrain": {"flows.nightly"}}
    assert _imports_outside(graph, ("storage",), ()) == ["storage.records -> gpu_jobs.online.windows"]
    assert _imports_outside(graph, ONLINE_WORK, ONLINE_WORK_MAY_IMPORT) == ["gpu_jobs.online.app -> gpu_jobs.stages.run"]
    assert _importers_outside(graph, ONLINE_WORK, ONLINE_FLOWS + ONLINE_WORK_USERS) == [
        "flows.training -> gpu_jobs.online.app", "storage.records -> gpu_jobs.online.windows"]
    assert _importers_outside(graph, ONLINE_FLOWS, ONLINE_FLOWS_USERS) == ["flows.nightly -> flows.online.retrain"]
    assert _matches("flows.cli_serve", ("flows.cli*",)) and not _matches("flows.online_x", ONLINE_FLOWS)


# ------------------------------------------------------------------------------------ sizes
def _oversized(path: str, source: str) -> list[str]:
    """The module itself when it is over MAX_MODULE_LINES lines, and each function (method, nested
    function) over MAX_FUNCTION_LINES, counted from its `def` line to its last line."""
    out = []
    if (n := source.count("\n")) > MAX_MODULE_LINES:
        out.append(f"{path}: {n} lines (> {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                out.append(f"{path}:{node.lineno} {node.name}: {n} lines (> {MAX_FUNCTION_LINES})")
    return out


def test_no_module_over_500_lines_and_no_function_over_60():
    too_big = [line for path in sorted(_modules().values())
               for line in _oversized(str(path.relative_to(REPO)), path.read_text())]
    assert not too_big, "rooms that do two jobs (split them by job):\n" + "\n".join(too_big)


def test_the_size_check_sees_a_long_module_and_a_long_function():
    def function(name: str, lines: int) -> str:
        return f"def {name}():\n" + "    x = 1\n" * (lines - 1)

    assert _oversized("m.py", function("f", 60) + "\n" * 100) == []
    assert _oversized("m.py", "x = 1\n" * 501) == ["m.py: 501 lines (> 500)"]
    assert _oversized("m.py", "x = 1\n" * 500) == []
    assert _oversized("m.py", "class C:\n    " + function("long", 61).replace("\n", "\n    ")) == [
        "m.py:2 long: 61 lines (> 60)"]
