"""Version findings from running agents (issue 26, "How to check"): twelve real agents, two driver versions.

Each agent is the agent's own entry (`agents.runner.run_agent`, twelve in this process like `bench/chaos.py
agents`), with a synthesised host root (`tests/fixtures/hosts/synth.py`) as `agent.host_root` and `agent.sysfs.root`:
nine hosts carry driver 550.90.07, three 535.104.05 (`/proc/driver/nvidia/version` and `sys/module/nvidia/version`,
where the fingerprint reads it). Their inventory probes publish the fingerprints through NATS; the faulty nodes'
agents replay a kernel log with XID 79 (the real kmsg parser); the real router and worker (standalone scheduler,
the real FleetGuard) drain them, and the activities write the ledger. Then the operator's command:

- fatal faults only on the three nodes of the rarer driver: `fleetmend report --json` lists exactly one finding,
  naming that driver (and `--vendor-bundle` writes its files, with the nodes' raw kernel lines);
- the faults spread evenly over the fleet (one of four faulty nodes on the rarer driver, its share of the fleet):
  no finding.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from agents.runner import run_agent
from fleetmend.catalog import load_catalog
from fleetmend.config import load_settings
from fleetmend.infra.ledger import LedgerStore
from fleetmend.router.core import Router
from fleetmend.worker import build_worker
from tests.conftest import assert_eventually
from tests.fixtures.hosts.synth import HostSpec, build_host
from tests.test_ledger import cli

COMMON, RARE = "550.90.07", "535.104.05"
NODES = [f"n{i:02d}" for i in range(12)]
DRIVER = {n: RARE if i >= 9 else COMMON for i, n in enumerate(NODES)}
XID79 = ("[Fri Apr  5 21:29:39 2024] NVRM: Xid (PCI:0000:1b:00): 79, pid='<unknown>', name=<unknown>, "
         "GPU has fallen off the bus.\n[Fri Apr  5 21:29:39 2024] NVRM: GPU 0000:1b:00.0: GPU has fallen off the bus.\n")


async def _fleet_with_faults(tmp_path: Path, nats_server, temporal_server, client, nc, cluster: str,
                             faulty: list[str]) -> dict:
    """Run the twelve agents, the router and the worker until every faulty node's drain is in the ledger and
    every fingerprint is in NATS; then stop them and return `fleetmend report --json` of the cluster."""
    base = dict(cluster=cluster, nats_url=nats_server.url, temporal_address=temporal_server.address,
                state_dir=tmp_path / "state", scheduler="standalone", task_queue=f"tq-{cluster}",
                policy={"max_drained_percent": 100.0, "max_drained_nodes": 12, "max_drained_per_rack": 12,
                        "cluster_nodes": 12})
    s = load_settings(None, **base)
    stop = asyncio.Event()
    router = Router(s, nc, nc.jetstream(), client, load_catalog(),
                    filter_subject=f"fleet.{cluster}.fault.*", durable=f"vf-{cluster}")
    worker = await build_worker(s, client, nc)
    tasks = [asyncio.create_task(router.run(stop)), asyncio.create_task(worker.run())]
    for node in NODES:
        info = {f"proc/driver/nvidia/gpus/0000:{bus}:00.0/information":  # the driver's file, with each GPU's UUID
                f"Model: \t\t NVIDIA H100 80GB HBM3\nGPU UUID: \t GPU-{node}-{bus}\nVideo BIOS: \t 96.00.74.00.0B\n"
                for bus in ("1b", "43")}
        root = build_host(tmp_path / "hosts" / node, HostSpec(driver=DRIVER[node], gpus=2, cpus=2, extra=info))
        log = tmp_path / "kmsg" / f"{node}.txt"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(XID79 if node in faulty else "[Fri Apr  5 21:29:39 2024] eth0: link up\n")
        ns = load_settings(None, **base, node=node, agent={
            "host_root": str(root), "sysfs": {"enabled": True, "root": str(root)}, "nvml": {"enabled": False},
            "udev": {"enabled": False}, "lastboot": {"enabled": False}, "perf": {"enabled": False},
            "inventory_interval_s": 3600.0})
        tasks.append(asyncio.create_task(run_agent(ns, kmsg_file=log, once=False, stop=stop, hardware=True,
                                                   shutdown_timeout_s=3.0)))
    store = LedgerStore(nc.jetstream())
    try:
        async def drained_and_known():
            heads = await store.read_heads(cluster)
            fleet = await store.fleet(cluster)
            drained = {h["node"] for h in heads if h.get("drained_at")}
            return drained == set(faulty) and len(fleet) == 12 and (heads, fleet)

        heads, fleet = await assert_eventually(drained_and_known, timeout_s=120, interval_s=0.5,
                                               what="every faulty node drained, every fingerprint published")
        assert {f["node"]: f["versions"]["nvidia_driver"] for f in fleet} == DRIVER, "read from the host roots"
        assert {h["fault_class"] for h in heads} == {"xid79"} and len(heads) == len(faulty)
        assert all(h["versions_drain"]["nvidia_driver"] == DRIVER[h["node"]] for h in heads)
    finally:
        stop.set()
        await worker.shutdown()
        await asyncio.gather(*(asyncio.wait_for(t, 30) for t in tasks), return_exceptions=True)
    r = await cli(nats_server.url, "report", "--json", "--cluster", cluster, "--since", "1h")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


async def test_the_rarer_driver_takes_every_fault_one_finding(tmp_path, nats_server, temporal_server, temporal_client, nc,
                                                        unique):
    cluster = f"vr{unique}"
    rare = [n for n in NODES if DRIVER[n] == RARE]
    rep = await _fleet_with_faults(tmp_path, nats_server, temporal_server, temporal_client, nc, cluster, rare)
    assert rep["incidents"] == 3 and list(rep["gpu_hours_by_fault_class"]) == ["xid79"]
    assert [(f["fault_class"], f["key"], f["value"]) for f in rep["findings"]] == [("xid79", "nvidia_driver", RARE)]
    f = rep["findings"][0]
    assert (f["nodes_with_fault_and_value"], f["nodes_with_fault"], f["fleet_nodes_with_value"], f["fleet_nodes"]) == (
        3, 3, 3, 12)
    assert f["nodes"] == sorted(rare) and "hypergeometric" in f["test"]
    assert set(rep["gpu_hours_by_version"]["nvidia_driver"]) == {RARE}
    text = (await cli(nats_server.url, "report", "--cluster", cluster, "--since", "1h")).stdout  # the operator's table
    print(text)
    assert text.count("version finding ") == 1 and f"nvidia_driver={RARE}" in text and f["id"] in text

    out = tmp_path / "bundle"
    b = await cli(nats_server.url, "report", "--cluster", cluster, "--since", "1h", "--vendor-bundle", f["id"][:8],
                  str(out))
    assert b.returncode == 0, b.stderr
    assert sorted(p.name for p in out.iterdir()) == ["diagnostics.json", "finding.json", "incidents.jsonl",
                                                     "raw_fault_lines.txt", "serials.json", "versions.json"]
    assert (out / "raw_fault_lines.txt").read_text().count("Xid (PCI:0000:1b:00): 79") == 3, "the agents' lines"
    assert set(json.loads((out / "versions.json").read_text())) == set(rare)
    serials = json.loads((out / "serials.json").read_text())
    assert {n: v["part_serial_drain"] for n, v in serials.items()} == {n: f"GPU-{n}-1b" for n in rare}, \
        "the faulty GPU's UUID from the agents' fingerprints"
    bad = await cli(nats_server.url, "report", "--cluster", cluster, "--vendor-bundle", "nosuch", str(out))
    assert bad.returncode == 1 and "no single version finding" in bad.stderr


async def test_faults_spread_evenly_no_finding(tmp_path, nats_server, temporal_server, temporal_client, nc,
                                                        unique):
    cluster = f"ve{unique}"
    spread = ["n00", "n03", "n06", "n09"]  # one of four on the rarer driver: a quarter, its share of the fleet
    rep = await _fleet_with_faults(tmp_path, nats_server, temporal_server, temporal_client, nc, cluster, spread)
    assert rep["incidents"] == 4 and set(rep["gpu_hours_by_version"]["nvidia_driver"]) == {COMMON, RARE}
    assert rep["findings"] == []
