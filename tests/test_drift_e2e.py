"""Configuration drift end to end with every real part: six real agents (the `Agent` runner with its inventory
probe) over synthesised host roots → fingerprints in the KV bucket → drift judge → `config_drift_*` faults on the
node's fault subject → router → Temporal `NodeRemediation` (real worker, standalone scheduler). Exactly the
misconfigured node gets an incident, on exactly its keys; `fleetmend drift --json` names only it; a 3-vs-3 cohort
is a split and opens nothing; the live fix (activity `reconfigure_node`) is applied, verified and the faults clear.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from temporalio.testing import ActivityEnvironment

from activities.reconfigure import ReconfigureActivities
from agents.inventory.probe import InventoryProbe
from agents.runner import Agent
from fleetmend import subjects
from fleetmend.analyzer.drift import DriftJudge
from fleetmend.catalog import load_catalog
from fleetmend.config import load_settings
from fleetmend.fingerprint import ReconfigureRequest
from fleetmend.infra.connect import connect_nats, connect_temporal
from fleetmend.infra.jetstream import ensure_deadletter_stream, ensure_fault_stream
from fleetmend.router.core import Router
from fleetmend.worker import build_worker
from tests.conftest import assert_eventually
from tests.fixtures.hosts.synth import HostSpec, build_host
from workflows.remediation import NodeRemediation

BAD = HostSpec(governor="powersave", peermem=False, numa_balancing="1")


async def _agents(s: Any, tmp_path: Path, specs: dict[str, HostSpec], stop: asyncio.Event,
                  reconfigure: set[str] | None = None) -> tuple[list[asyncio.Task[int]], dict[str, InventoryProbe]]:
    tasks, probes = [], {}
    for node, spec in specs.items():
        root = build_host(tmp_path / node, spec)
        modprobe = [sys.executable, "-c", f"import os; os.makedirs({str(root / 'sys/module/nvidia_peermem')!r})"]
        probe = InventoryProbe(root, s.cluster, node, interval_s=3600, change_poll_s=0.5,
                               reconfigure=node in (reconfigure or set()), peermem_command=modprobe)
        probes[node] = probe
        ns = s.model_copy(update={"node": node, "state_dir": tmp_path / "state" / node})
        agent = Agent(ns, stop=stop, probes=[probe], kmsg=False, hardware=False)
        tasks.append(asyncio.create_task(agent.run()))
    await assert_eventually(lambda: all(p.published >= 1 for p in probes.values()), timeout_s=30,
                            what="every agent published its fingerprint")
    return tasks, probes


def _cli(s: Any, *args: str, rc: int = 0) -> dict[str, Any]:
    env = dict(os.environ, FLEETMEND_NATS_URL=s.nats_url, FLEETMEND_CLUSTER=s.cluster)
    res = subprocess.run([sys.executable, "-m", "fleetmend.cli.main", *args], env=env,
                         capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == rc, res.stderr
    return json.loads(res.stdout)


def _drift_json(s: Any) -> dict[str, Any]:
    return _cli(s, "drift", "--json")


async def test_only_the_misconfigured_node_gets_config_drift_and_a_split_opens_none(
        nats_server, temporal_server, tmp_path: Path, unique: str) -> None:
    cluster = f"dr{unique}"
    s = load_settings(None, cluster=cluster, node="judge", nats_url=nats_server.url,
                      temporal_address=temporal_server.address, state_dir=tmp_path / "state",
                      scheduler="standalone", task_queue=f"tq-{unique}", log_format="json")
    nc = await connect_nats(s, name="drift-e2e")
    js = nc.jetstream()
    await ensure_fault_stream(js)
    client = await connect_temporal(s)
    stop = asyncio.Event()
    router = Router(s, nc, js, client, load_catalog(), filter_subject=f"fleet.{cluster}.fault.*",
                    durable=f"router-{unique}")
    worker = await build_worker(s, client, nc)
    tasks: list[asyncio.Task[Any]] = [asyncio.create_task(router.run(stop)), asyncio.create_task(worker.run())]
    specs = {f"gpu-{i}": (BAD if i == 3 else HostSpec()) for i in range(6)}
    agent_tasks, probes = await _agents(s, tmp_path, specs, stop, reconfigure={"gpu-3"})
    try:
        judge = DriftJudge(cluster, js)
        report = await judge.tick()
        assert {(d.node, d.key) for d in report.deviations} == {
            ("gpu-3", "cpu.governor"), ("gpu-3", "gpudirect.peermem"), ("gpu-3", "kernel.numa_balancing")}
        assert {e.kind for e in judge.published} == {"config_drift_governor", "config_drift_peermem",
                                                     "config_drift_numa_balancing"}
        out = _drift_json(s)
        assert out["nodes"] == 6 and out["splits"] == [] and out["topology_changes"] == []
        assert sorted((d["node"], d["key"]) for d in out["deviations"]) == [
            ("gpu-3", "cpu.governor"), ("gpu-3", "gpudirect.peermem"), ("gpu-3", "kernel.numa_balancing")]

        async def incident() -> Any:
            h = client.get_workflow_handle_for(NodeRemediation.run, subjects.workflow_id(cluster, "gpu-3"))
            try:
                return await h.query(NodeRemediation.status)
            except Exception:
                return None

        want = {"config_drift_governor", "config_drift_peermem", "config_drift_numa_balancing"}

        async def incident_with_all() -> Any:
            st = await incident()
            return st if st is not None and want <= {f["kind"] for f in st.faults} else None

        st = await assert_eventually(incident_with_all, timeout_s=60, what="config_drift incident with the 3 faults")
        assert all(f["severity"] == "degraded" for f in st.faults if f["kind"].startswith("config_drift"))

        async def listed() -> list[str]:
            q = f"WorkflowType='NodeRemediation' AND FleetCluster='{cluster}'"
            return [w.id async for w in client.list_workflows(q)]

        ids = await assert_eventually(listed, what="incidents listed")
        assert ids == [subjects.workflow_id(cluster, "gpu-3")], "only the misconfigured node has an incident"

        # the live fix through the activity: policy.reconfigure is on for gpu-3's agent
        req = ReconfigureRequest(cluster=cluster, node="gpu-3", incident_id="inc-e2e", dry_run=False,
                                 fixes={d.key: d.wanted for d in report.deviations})
        fixed = await ActivityEnvironment().run(ReconfigureActivities(nc).reconfigure_node, req)
        assert fixed.verified and not fixed.dry_run, fixed
        # the fingerprint read after the fix reaches the judge: not "published twice", since a uevent of another
        # test on this host (the probes listen to the kernel's) may trigger a read before the fix
        async def clean():
            r = await judge.tick()
            return r if r.deviations == [] else None

        report = await assert_eventually(clean, what="no deviation once the fixed fingerprint is read")
        assert report.deviations == []
        resolved = [e for e in judge.published if e.healthy]
        assert sorted((e.kind, e.attrs["key"]) for e in resolved) == [
            ("config_drift_governor", "cpu.governor"), ("config_drift_numa_balancing", "kernel.numa_balancing"),
            ("config_drift_peermem", "gpudirect.peermem")]
        assert all(e.attrs["clearing_kind"] == "config_drift_resolved" and e.severity == "info" for e in resolved)

        async def cleared() -> bool:  # the incident records each clearing event beside its fault
            st = await incident()
            return st is not None and sum(1 for f in st.faults if f["healthy"]) >= 3

        await assert_eventually(cleared, timeout_s=60, what="clearing events reached the incident")
    finally:
        stop.set()
        await asyncio.gather(*agent_tasks, return_exceptions=True)
        await worker.shutdown()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await nc.close()


async def test_three_against_three_is_a_split_and_opens_nothing(nats_server, tmp_path: Path, unique: str) -> None:
    cluster = f"sp{unique}"
    s = load_settings(None, cluster=cluster, node="judge", nats_url=nats_server.url, state_dir=tmp_path / "state")
    nc = await connect_nats(s, name="drift-split")
    js = nc.jetstream()
    await ensure_fault_stream(js)
    stop = asyncio.Event()
    specs = {f"gpu-{i}": HostSpec(numa_balancing="1" if i < 3 else "0", thp="always" if i % 2 else "never")
             for i in range(6)}
    agent_tasks, _ = await _agents(s, tmp_path, specs, stop)
    try:
        judge = DriftJudge(cluster, js)
        report = await judge.tick()
        assert report.deviations == [] and judge.published == []
        assert sorted(c.key for c in report.splits) == ["kernel.numa_balancing", "mm.thp_enabled"]
        out = _drift_json(s)
        assert out["deviations"] == [] and sorted(c["key"] for c in out["splits"]) == ["kernel.numa_balancing",
                                                                                       "mm.thp_enabled"]
        assert all(c["share"] == 0.5 and c["majority"] is None for c in out["splits"])
        # the operator views: one node's fingerprint, the version distribution per class
        inv = _cli(s, "inventory", "gpu-0", "--json")
        assert inv["node"] == "gpu-0" and inv["gpus"][0]["nic_level"] == "PIX"
        hca = _cli(s, "inventory", "gpu-0", "--nccl-ib-hca", "=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7",
                   "--json")
        assert hca["ok"] and hca["compute"] == [f"mlx5_{i}" for i in range(8)]
        # a job's NCCL_IB_HCA against its nodes' fingerprints (no benchmark): which GPU, which NIC, what is given
        nccl = _cli(s, "sweep", "gpu-0", "gpu-1", "gpu-9", "--nccl-only", "--nccl-env", "NCCL_IB_HCA=^=mlx5_3",
                    "--nccl-env", "NCCL_DEBUG=INFO", "--json", rc=1)["nccl"]
        assert [(f["node"], f["gpu"], f["expected"]) for f in nccl["findings"]] == [
            ("gpu-0", "0000:61:00.0", "mlx5_3 (PIX, NUMA 0)"), ("gpu-1", "0000:61:00.0", "mlx5_3 (PIX, NUMA 0)")]
        assert nccl["without_fingerprint"] == ["gpu-9"] and nccl["not_checked"] == ["NCCL_DEBUG"]
        ok = _cli(s, "sweep", "gpu-0", "gpu-1", "--nccl-only", "--nccl-env", "NCCL_IB_HCA=mlx5", "--json")["nccl"]
        assert ok["findings"] == [] and ok["nodes"] == 2
        versions = _cli(s, "versions", "--json")
        (hw,) = versions["classes"]
        assert versions["classes"][hw]["nvidia_driver"] == {"550.90.07": 6}
        # a fingerprint that does not parse is skipped with one line and dead-lettered, the rest still judged
        kv = await js.key_value(subjects.FINGERPRINT_KV_BUCKET)
        await kv.put(subjects.fingerprint_kv_key(cluster, "broken"), b'{"cluster": 1}')
        await ensure_deadletter_stream(js)
        dl = await nc.subscribe(subjects.DEADLETTER_SUBJECT)
        again = await DriftJudge(cluster, js).tick()
        assert len(again.splits) == 2
        record = json.loads((await dl.next_msg(timeout=5)).data)
        assert record["key"] == subjects.fingerprint_kv_key(cluster, "broken") and "fingerprint" in record["reason"]
        # leave the shared dead-letter stream as it was (other tests read it from its start)
        last = await js.get_last_msg(subjects.DEADLETTER_STREAM, subjects.DEADLETTER_SUBJECT)
        assert json.loads(last.data)["key"] == record["key"]
        await js.delete_msg(subjects.DEADLETTER_STREAM, last.seq)
    finally:
        stop.set()
        await asyncio.gather(*agent_tasks, return_exceptions=True)
        await nc.close()
