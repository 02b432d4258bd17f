"""`fleetmend nodes` / `fleetmend worker --scheduler kubernetes` wiring against kmock (a real CLI process)."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import kmock

from activities.kubernetes import KubernetesScheduler
from fleetmend.config import KubernetesSettings
from tests.test_kubernetes_adapter import NODES, Cluster


async def test_nodes_json_shows_who_drained_what() -> None:
    async with kmock.KubernetesEmulator() as k8s, kmock.Server(k8s) as srv:
        k8s.resources["v1/pods"] = {}
        k8s.resources["v1/nodes"] = {}
        c = Cluster(k8s, str(srv.url).rstrip("/"))
        c.node("gpu-001")
        c.node("gpu-002", unschedulable=True)
        c.node("gpu-003")
        await KubernetesScheduler(KubernetesSettings(api_url=c.url)).drain("gpu-001", "xid79 incident inc-1", "inc-1")
        env = {**os.environ, "FLEETMEND_SCHEDULER": "kubernetes", "FLEETMEND_KUBERNETES__API_URL": c.url}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fleetmend.cli.main", "nodes", "--json", "--no-incidents", env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        rows = {r["name"]: r for r in json.loads(out)}
        assert rows["gpu-001"]["owner"] == "fleetmend" and rows["gpu-001"]["incident_id"] == "inc-1"
        assert rows["gpu-002"]["owner"] == "operator"
        assert rows["gpu-003"]["owner"] is None and rows["gpu-003"]["state"] == "ready"
        assert c.read(NODES, "gpu-001")["spec"]["unschedulable"] is True
