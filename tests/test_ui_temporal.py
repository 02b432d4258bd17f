"""`fleetmend temporal setup` on a fresh Temporal started without fleetmend's search attributes, and
what an operator sees in the Temporal Web UI, checked in a real headless Chromium.

The Chromium test needs Debian's `chromium` (`apt-get install -y chromium`; .ci/run installs it when
root). Without it the test is skipped locally and fails in CI. The screenshot path is printed
(`pytest -s` shows it; it lies under the test's tmp dir).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import pytest
from temporalio.client import Client
from temporalio.common import SearchAttributeKey, SearchAttributePair, TypedSearchAttributes

from fleetmend.dev import servers
from tests.conftest import IN_CI

CLI = [sys.executable, "-m", "fleetmend.cli.main"]


def _fresh_temporal(tmp: Path, ui: bool) -> tuple[servers.ManagedProcess, str, int]:
    port, ui_port = servers.free_port(), servers.free_port()
    p = servers.temporal_dev_server(tmp / "t.db", port, ui_port, ui=ui, log_path=tmp / "temporal.log")
    if not ui:  # a "real cluster": none of fleetmend's search attributes
        argv, out = p.argv, []
        i = 0
        while i < len(argv):
            if argv[i] == "--search-attribute":
                i += 2
                continue
            out.append(argv[i])
            i += 1
        p.argv = out
    p.start()
    p.wait_tcp("127.0.0.1", port, 60)
    address = f"127.0.0.1:{port}"
    asyncio.run(servers.wait_temporal_ready(address))
    return p, address, ui_port


def _sa(node: str, phase: str) -> TypedSearchAttributes:
    return TypedSearchAttributes([
        SearchAttributePair(SearchAttributeKey.for_keyword("FleetNode"), node),
        SearchAttributePair(SearchAttributeKey.for_keyword("FleetCluster"), "c1"),
        SearchAttributePair(SearchAttributeKey.for_keyword("FleetPhase"), phase)])


async def _start_incidents(address: str, incidents: dict[str, str]) -> None:
    """Open NodeRemediation executions (no worker needed: visibility shows them at once)."""
    client = await Client.connect(address)
    for node, phase in incidents.items():
        await client.start_workflow("NodeRemediation", id=f"remediate/c1/{node}", task_queue="ui-test-no-worker",
                                    search_attributes=_sa(node, phase))


async def _count(address: str, query: str) -> int:
    client = await Client.connect(address)
    for _ in range(100):  # visibility is eventually consistent
        n = (await client.count_workflows(query)).count
        if n:
            return n
        await asyncio.sleep(0.1)
    return 0


def test_temporal_setup_registers_search_attributes_idempotently(tmp_path: Path) -> None:
    proc, address, _ = _fresh_temporal(tmp_path, ui=False)
    try:
        env = {**os.environ, "FLEETMEND_TEMPORAL_ADDRESS": address}
        before = subprocess.run(CLI + ["temporal", "setup", "--json"], env=env, capture_output=True, text=True,
                                timeout=60)
        assert before.returncode == 0, before.stderr
        first = json.loads(before.stdout)
        assert set(first["search_attributes"].values()) == {"added"}
        # the dev server keeps closed workflows 1 day; setup sets the configured retention (90 days)
        assert first["retention_days_before"] == 1 and first["retention_days"] == 90
        again = subprocess.run(CLI + ["temporal", "setup", "--json"], env={**env, "FLEETMEND_TEMPORAL_RETENTION_DAYS":
                                                                          "30"}, capture_output=True, text=True,
                               timeout=60)
        assert again.returncode == 0, again.stderr
        second = json.loads(again.stdout)
        assert second["search_attributes"] == {k: "present" for k in first["search_attributes"]}
        assert (second["retention_days_before"], second["retention_days"]) == (90, 30)
        asyncio.run(_start_incidents(address, {"gpu-9": "draining"}))
        assert asyncio.run(_count(address, "FleetNode='gpu-9' AND FleetPhase='draining'")) == 1
        table = subprocess.run(CLI + ["temporal", "setup"], env=env, capture_output=True, text=True, timeout=60)
        assert "FleetDrained" in table.stdout and "present" in table.stdout
    finally:
        proc.stop()


def test_temporal_setup_says_where_when_unreachable() -> None:
    port = servers.free_port()
    r = subprocess.run(CLI + ["temporal", "setup", "--address", f"127.0.0.1:{port}"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1
    assert f"cannot reach Temporal at 127.0.0.1:{port}" in r.stderr and "FLEETMEND_TEMPORAL_ADDRESS" in r.stderr


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def _headless(binary: str, url: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           "--virtual-time-budget=20000", "--window-size=1400,900", *extra, url],
                          capture_output=True, text=True, timeout=120)


def test_ui_lists_incident_filterable_by_node_and_phase(tmp_path: Path) -> None:
    binary = _chromium()
    if binary is None:
        if IN_CI:
            pytest.fail("chromium not installed; .ci/run installs it (apt-get install -y chromium)")
        pytest.skip("chromium not installed (apt-get install -y chromium)")
    proc, address, ui_port = _fresh_temporal(tmp_path, ui=True)
    try:
        asyncio.run(_start_incidents(address, {"gpu-ui-1": "awaiting_repair", "gpu-ui-2": "triage",
                                               "gpu-ui-3": "awaiting_repair"}))
        assert asyncio.run(_count(address, "FleetPhase='triage'")) == 1
        base = f"http://127.0.0.1:{ui_port}/namespaces/default/workflows?query="

        by_node_phase = base + quote("FleetNode=\"gpu-ui-1\" AND FleetPhase=\"awaiting_repair\"")
        dom = _headless(binary, by_node_phase, "--dump-dom").stdout
        assert "remediate/c1/gpu-ui-1" in dom, dom[-2000:]
        assert "remediate/c1/gpu-ui-2" not in dom and "remediate/c1/gpu-ui-3" not in dom

        by_phase = _headless(binary, base + quote("FleetPhase=\"awaiting_repair\""), "--dump-dom").stdout
        assert "remediate/c1/gpu-ui-1" in by_phase and "remediate/c1/gpu-ui-3" in by_phase
        assert "remediate/c1/gpu-ui-2" not in by_phase

        shot = tmp_path / "temporal-ui-incident.png"
        _headless(binary, by_node_phase, f"--screenshot={shot}")
        assert shot.exists() and shot.stat().st_size > 10_000
        print(f"\nTemporal UI screenshot: {shot}")
    finally:
        proc.stop()
