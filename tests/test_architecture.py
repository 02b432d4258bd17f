"""The house's floors, drawn from the code itself (every `import` in every module, lazy ones too).

| floor | modules | may import (project) | third party |
|---|---|---|---|
| contract | top-level modules of `fleetmend/`, `fleetmend.messages.*`, `fleetmend.catalog.*` | the contract | pydantic (1) |
| plumbing | `fleetmend.infra.*` | contract, plumbing | anything |
| adapters | `activities.*` | contract, plumbing, activities | anything |
| workflows | `workflows.*` | contract | `temporalio` |
| processes | `agents.*`, `fleetmend.{router,analyzer,worker,cli,dev}` | anything below (2) | anything |

(1) pydantic, pydantic-settings, `temporalio.common`, `temporalio.exceptions`.
(2) Only `cli` and `dev` import another process (to start it).

Besides: no import cycle; no `importlib.import_module`/`__import__` of a project module, except the
agent's probe table (`agents.probes.PROBES`, data this test reads: its targets are edges of the graph).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fleetmend", "agents", "activities", "workflows")
PROCESSES = ("agents", "fleetmend.router", "fleetmend.analyzer", "fleetmend.worker", "fleetmend.cli", "fleetmend.dev")
STARTERS = ("fleetmend.cli", "fleetmend.dev")
"""The only processes that import another process: the CLI and dev up start them."""
CONTRACT_THIRD_PARTY = ("pydantic", "pydantic_core", "pydantic_settings", "temporalio.common", "temporalio.exceptions")
WORKFLOW_THIRD_PARTY = ("temporalio",)
DYNAMIC_IMPORT_ALLOWED = ("agents.probes",)


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


def _imported_names(mod: str, path: Path) -> list[str]:
    """Every dotted name `mod` imports (absolute; `from a import b` gives `a.b` and `a`)."""
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            names += [f"{base}.{a.name}" for a in node.names] + [base]
    return names


def _probe_targets() -> set[str]:
    """The modules of `agents.probes.PROBES`, read from its source (a dict literal of `module:Class`)."""
    tree = ast.parse((ROOT / "agents/probes.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "PROBES":
            table = ast.literal_eval(node.value)
            return {target.partition(":")[0] for target in table.values()}
    raise AssertionError("agents/probes.py has no PROBES table")


def import_graph() -> dict[str, set[str]]:
    """module → project modules it imports (anywhere in the file: top level, functions, TYPE_CHECKING),
    plus the probe table's targets for `agents.probes`."""
    known = _modules()
    graph: dict[str, set[str]] = {m: set() for m in known}
    for mod, path in known.items():
        for t in _imported_names(mod, path):
            dep = _resolve(t, known)
            if dep is not None and dep != mod and not mod.startswith(dep + "."):
                graph[mod].add(dep)
    graph["agents.probes"] |= _probe_targets()
    return graph


def third_party_imports() -> dict[str, set[str]]:
    """module → the dotted names it imports from outside the project and the standard library."""
    known = _modules()
    out: dict[str, set[str]] = {}
    for mod, path in known.items():
        names = {t for t in _imported_names(mod, path)
                 if t and t.split(".")[0] not in PACKAGES and t.split(".")[0] not in sys.stdlib_module_names
                 and t.split(".")[0] != "__future__"}
        out[mod] = names
    return out


def dynamic_imports() -> list[str]:
    """`module:line` of every `importlib.import_module(...)`, `import_module(...)` or `__import__(...)`."""
    found = []
    for mod, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                if name in ("import_module", "__import__"):
                    found.append(f"{mod}:{node.lineno}")
    return sorted(found)


def _in(mod: str, *prefixes: str) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def floor(mod: str) -> str:
    """contract, plumbing, adapters, workflows or the process `mod` belongs to."""
    for p in PROCESSES:
        if _in(mod, p):
            return p
    if _in(mod, "fleetmend.infra"):
        return "plumbing"
    if _in(mod, "activities"):
        return "adapters"
    if _in(mod, "workflows"):
        return "workflows"
    if _in(mod, "fleetmend"):
        return "contract"
    raise AssertionError(f"{mod}: on no floor")


MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "contract": ("contract",),
    "plumbing": ("contract", "plumbing"),
    "adapters": ("contract", "plumbing", "adapters"),
    "workflows": ("contract", "workflows"),
}


def floor_breaches(graph: dict[str, set[str]]) -> list[str]:
    """Every edge that runs to a floor its module may not import."""
    out = []
    for m, deps in graph.items():
        fm = floor(m)
        for d in deps:
            fd = floor(d)
            if fd == fm:
                continue
            if fm in MAY_IMPORT:
                ok = fd in MAY_IMPORT[fm]
            else:  # a process: anything below; another process only from the CLI or dev up
                ok = fd not in PROCESSES or fm in STARTERS
            if not ok:
                out.append(f"{m} ({fm}) → {d} ({fd})")
    return sorted(out)


def third_party_breaches(imports: dict[str, set[str]]) -> list[str]:
    out = []
    for m, names in imports.items():
        allowed = {"contract": CONTRACT_THIRD_PARTY, "workflows": WORKFLOW_THIRD_PARTY}.get(floor(m))
        if allowed is None:
            continue
        out += [f"{m} → {n}" for n in names if not _in(n, *allowed)]
    return sorted(out)


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
        for w in graph.get(v, ()):
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


def test_the_graph_sees_the_project() -> None:
    g = import_graph()
    assert "fleetmend.events" in g["fleetmend.router.core"]
    assert "workflows.remediation" in g["fleetmend.worker.build"]
    assert "agents.kmsg" in g["agents.probes"]  # the probe table's targets count
    assert floor("fleetmend.events") == "contract" and floor("fleetmend.messages.guard") == "contract"
    assert floor("fleetmend.infra.jetstream") == "plumbing" and floor("agents.kmsg.parser") == "agents"


def test_no_import_cycles() -> None:
    assert _cycles(import_graph()) == []


def test_every_module_keeps_to_its_floor() -> None:
    assert floor_breaches(import_graph()) == []


def test_the_contract_and_workflows_import_only_their_libraries() -> None:
    assert third_party_breaches(third_party_imports()) == []


def test_no_dynamic_import_of_a_project_module() -> None:
    found = [w for w in dynamic_imports() if w.partition(":")[0] not in DYNAMIC_IMPORT_ALLOWED]
    assert found == []


def test_the_checks_can_fail() -> None:
    """The checks above find what they look for: a cycle, each kind of floor breach, a library the
    contract may not use."""
    g = {"fleetmend.a": {"fleetmend.b"}, "fleetmend.b": {"fleetmend.a", "workflows.x"}, "workflows.x": set()}
    assert _cycles(g) == [["fleetmend.a", "fleetmend.b"]]
    assert floor_breaches(g) == ["fleetmend.b (contract) → workflows.x (workflows)"]
    g = {"fleetmend.router.core": {"fleetmend.worker.build", "activities.slurm"},
         "fleetmend.cli.app": {"fleetmend.router"}, "fleetmend.infra.lease": {"fleetmend.dev.servers"},
         "workflows.remediation": {"fleetmend.infra.permit_pool", "activities.slurm"}}
    assert floor_breaches(g) == [
        "fleetmend.infra.lease (plumbing) → fleetmend.dev.servers (fleetmend.dev)",
        "fleetmend.router.core (fleetmend.router) → fleetmend.worker.build (fleetmend.worker)",
        "workflows.remediation (workflows) → activities.slurm (adapters)",
        "workflows.remediation (workflows) → fleetmend.infra.permit_pool (plumbing)",
    ]
    assert third_party_breaches({"fleetmend.events": {"pydantic.fields", "nats.js"},
                                 "workflows.x": {"temporalio.workflow", "structlog"}}) == \
        ["fleetmend.events → nats.js", "workflows.x → structlog"]
