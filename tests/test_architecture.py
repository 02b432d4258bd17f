"""The import layering, drawn from the code itself (every `import` in every module, lazy ones too).

- no import cycle among the project's modules;
- the contract (`fleetmend/` except the composition roots) imports nothing from `agents/`,
  `activities/` or `workflows/`;
- the router and the CLI import nothing from `workflows/` (they address workflows by the names in
  `fleetmend.messages`);
- `workflows/` imports no module of `activities/` (activities are called by name).

Composition roots, which wire the layers together: `fleetmend/cli/`, `fleetmend/worker.py`,
`fleetmend/devup.py`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fleetmend", "agents", "activities", "workflows")
ROOTS = ("fleetmend.cli", "fleetmend.worker", "fleetmend.devup")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The project module `name` refers to (`fleetmend.events.Severity` → `fleetmend.events`)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    """module → project modules it imports (anywhere in the file: top level, functions, TYPE_CHECKING)."""
    known = _modules()
    graph: dict[str, set[str]] = {m: set() for m in known}
    for mod, path in known.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for t in targets:
                dep = _resolve(t, known)
                if dep is not None and dep != mod and not mod.startswith(dep + "."):
                    graph[mod].add(dep)
    return graph


def _in(mod: str, *prefixes: str) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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


def _violations(graph: dict[str, set[str]], sources: tuple[str, ...], forbidden: tuple[str, ...],
                exempt: tuple[str, ...] = ()) -> list[str]:
    return sorted(f"{m} → {d}" for m, deps in graph.items() if _in(m, *sources) and not _in(m, *exempt)
                  for d in deps if _in(d, *forbidden))


def test_the_graph_sees_the_project() -> None:
    g = import_graph()
    assert "fleetmend.events" in g["fleetmend.router.core"]
    assert "workflows.remediation" in g["fleetmend.worker"]  # a lazy import inside a function counts


def test_no_import_cycles() -> None:
    assert _cycles(import_graph()) == []


def test_contract_imports_no_agent_activity_or_workflow() -> None:
    assert _violations(import_graph(), ("fleetmend",), ("agents", "activities", "workflows"), exempt=ROOTS) == []


def test_router_and_cli_import_no_workflow() -> None:
    assert _violations(import_graph(), ("fleetmend.router", "fleetmend.cli"), ("workflows",)) == []


def test_workflows_import_no_activity() -> None:
    assert _violations(import_graph(), ("workflows",), ("activities",)) == []


def test_the_checks_can_fail() -> None:
    """The checks above find what they look for (a graph with a cycle and a forbidden edge)."""
    g = {"fleetmend.a": {"fleetmend.b"}, "fleetmend.b": {"fleetmend.a", "workflows.x"}, "workflows.x": set()}
    assert _cycles(g) == [["fleetmend.a", "fleetmend.b"]]
    assert _violations(g, ("fleetmend",), ("workflows",)) == ["fleetmend.b → workflows.x"]
