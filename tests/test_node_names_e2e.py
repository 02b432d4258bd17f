"""Dotted node names through the real pipeline.

- An EKS-style name (`ip-10-0-1-23.ec2.internal`): its agent replays a fatal XID log → JetStream
  (the subject carries the encoded token) → router → Temporal (workflow id with the real name) →
  worker with the standalone scheduler (drain key `<cluster>.<token>` in JetStream KV) → the CLI shows
  and takes the real name → `fleetmend repaired` returns the node.
- A dotted Slurm `NodeName` (`gpu.rack1-07`) on a real Slurm cluster: drained with `scontrol`, returned.
- `fleetmend creds generate` for a dotted name: its agent publishes with those credentials only on
  its own subject.
- The router's check that the body's node is the subject's node holds for encoded tokens.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import nats
import pytest
from typer.testing import CliRunner

from fleetmend import subjects
from fleetmend.catalog import load_catalog
from fleetmend.config import SlurmSettings, load_settings
from fleetmend.dev import servers
from fleetmend.events import Component, Device, FaultEvent, Severity, Source
from fleetmend.infra import security
from fleetmend.infra.connect import connect_nats, connect_temporal
from fleetmend.infra.jetstream import ensure_fault_stream
from fleetmend.router.core import Router
from fleetmend.worker import build_worker
from tests.conftest import assert_eventually
from tests.corpus_paths import corpus_case
from tests.test_e2e import cli
from workflows.remediation import NodeRemediation

EKS = "ip-10-0-1-23.ec2.internal"
SLURM = ["gpu.rack1-07", "gpu.rack1-08"]


async def incident(client, cluster: str, node: str, phase: str, timeout_s: float = 90):
    async def check():
        try:
            st = await client.get_workflow_handle_for(NodeRemediation.run, subjects.workflow_id(cluster, node)) \
                .query(NodeRemediation.status)
        except Exception:
            return None
        return st if st.phase == phase else None

    return await assert_eventually(check, timeout_s=timeout_s, what=f"{node} {phase}")


class Stack:
    """Router + worker (+ the node's agent replaying `log`) in this process, on the session servers."""

    def __init__(self, s, unique: str, log: Path) -> None:
        self.s, self.unique, self.log = s, unique, log
        self.stop, self.agent_stop = asyncio.Event(), asyncio.Event()
        self.tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> Stack:
        from agents.runner import run_agent

        s = self.s
        self.nc = await connect_nats(s, name="names-e2e")
        self.client = await connect_temporal(s)
        router = Router(s, self.nc, self.nc.jetstream(), self.client, load_catalog(),
                        filter_subject=f"fleet.{s.cluster}.fault.*", durable=f"router-{self.unique}")
        self.worker = await build_worker(s, self.client, self.nc)
        self.tasks = [asyncio.create_task(router.run(self.stop)), asyncio.create_task(self.worker.run()),
                      asyncio.create_task(run_agent(s, kmsg_file=self.log, once=False, stop=self.agent_stop))]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        self.agent_stop.set()
        await self.worker.shutdown()
        for t in self.tasks:
            try:
                await asyncio.wait_for(t, 30)
            except (asyncio.CancelledError, Exception):
                pass
        await self.nc.close()


def env_of(s) -> dict[str, str]:
    return {**os.environ, "FLEETMEND_NATS_URL": s.nats_url, "FLEETMEND_TEMPORAL_ADDRESS": s.temporal_address,
            "FLEETMEND_STATE_DIR": str(s.state_dir), "FLEETMEND_CLUSTER": s.cluster, "FLEETMEND_LOG_FORMAT": "json",
            "FLEETMEND_TASK_QUEUE": s.task_queue, "FLEETMEND_SCHEDULER": s.scheduler.value}


async def test_eks_node_name_end_to_end_standalone(nats_server, temporal_server, tmp_path: Path, unique: str):
    cluster = f"eks{unique}"
    s = load_settings(None, cluster=cluster, node=EKS, nats_url=nats_server.url,
                      temporal_address=temporal_server.address, state_dir=tmp_path / "state",
                      scheduler="standalone", task_queue=f"tq-{unique}", log_format="json")
    log = tmp_path / "dmesg.txt"
    log.write_text(corpus_case("c005")["raw"] + "\n")
    env = env_of(s)
    async with Stack(s, unique, log) as st:
        inc = await incident(st.client, cluster, EKS, "awaiting_repair")
        assert inc.drained and inc.ticket
        subject = subjects.fault_subject(cluster, EKS)
        assert subject == f"fleet.{cluster}.fault.ip-10-0-1-23=2Eec2=2Einternal"
        stored = await st.nc.jetstream().stream_info(subjects.FAULT_STREAM, subjects_filter=subject)
        assert stored.state.subjects and stored.state.subjects.get(subject, 0) >= 1
        kv = await st.nc.jetstream().key_value(subjects.DRAIN_KV_BUCKET)
        entry = json.loads((await kv.get(subjects.drain_kv_key(cluster, EKS))).value)
        assert entry["owner"] == "fleetmend" and EKS in entry["incident_id"]

        # the operator types and reads the real name
        js = json.loads((await cli(env, "status", EKS, "--json")).stdout)
        assert js["node"] == EKS and js["phase"] == "awaiting_repair" and js["drained"] is True
        assert EKS in (await cli(env, "status")).stdout
        rows = json.loads((await cli(env, "nodes", "--json")).stdout)
        assert [r["name"] for r in rows] == [EKS]
        injected = await cli(env, "inject", "--node", EKS, "--xid", "13", "--json")  # typed as the operator sees it
        assert EKS in injected.stdout
        assert "repair recorded" in (await cli(env, "repaired", EKS, "--note", "reseated")).stdout
        closed = await incident(st.client, cluster, EKS, "closed")
        assert closed.outcome == "returned_to_service" and not closed.drained
        assert json.loads((await cli(env, "nodes", "--json")).stdout) == []


@pytest.mark.slurm
async def test_dotted_slurm_node_name_end_to_end(nats_server, temporal_server, tmp_path: Path, unique: str):
    from tests.fixtures_slurm import require_slurm, start_cluster

    require_slurm()
    sl = await asyncio.to_thread(start_cluster, tmp_path / "slurm", SLURM)
    try:
        cluster = f"sl{unique}"
        s = load_settings(None, cluster=cluster, node=SLURM[0], nats_url=nats_server.url,
                          temporal_address=temporal_server.address, state_dir=tmp_path / "state",
                          scheduler="slurm", task_queue=f"tq-{unique}", log_format="json",
                          slurm=SlurmSettings(slurm_conf=str(sl.conf)))
        log = tmp_path / "dmesg.txt"
        log.write_text(corpus_case("c005")["raw"] + "\n")
        env = {**env_of(s), "FLEETMEND_SLURM__SLURM_CONF": str(sl.conf)}
        async with Stack(s, unique, log) as st:
            inc = await incident(st.client, cluster, SLURM[0], "awaiting_repair")
            assert inc.drained
            assert "DRAIN" in sl.state(SLURM[0]) and sl.reason(SLURM[0]).startswith("fleetmend:")
            assert "DRAIN" not in sl.state(SLURM[1])
            table = (await cli(env, "nodes")).stdout
            assert SLURM[0] in table
            await cli(env, "repaired", SLURM[0])
            await incident(st.client, cluster, SLURM[0], "closed")
            await asyncio.to_thread(sl.wait_idle, [SLURM[0]])
    finally:
        await asyncio.to_thread(sl.stop)


def _event(cluster: str, node: str) -> FaultEvent:
    return FaultEvent(cluster=cluster, node=node, component=Component.GPU, kind="xid", code=79,
                      severity=Severity.FATAL, source=Source.INJECT, device=Device(pci_bus_id="0000:3b:00.0"))


async def test_credentials_for_a_dotted_node(tmp_path: Path):
    out = tmp_path / "creds"
    from fleetmend.cli.app import app

    r = CliRunner().invoke(app, ["creds", "generate", "--out", str(out), "--cluster", "c1", "--nodes",
                            f"{EKS},ip-10-0-1-24.ec2.internal"])
    assert r.exit_code == 0, r.output
    assert (out / "nodes" / f"{EKS}.nk").exists()
    cs = security.generate(out, "c1", [EKS, "ip-10-0-1-24.ec2.internal"])  # reuses the seeds
    conf = tmp_path / "nats.conf"
    conf.write_text(security.server_conf(cs.accounts_conf))
    port = servers.free_port()
    proc = servers.start_nats(tmp_path / "js", port, config_file=conf)
    url = f"nats://127.0.0.1:{port}"
    try:
        admin = await nats.connect(url, nkeys_seed=str(cs.seed_file("admin")))
        await ensure_fault_stream(admin.jetstream())
        s = load_settings(out / "nodes" / f"{EKS}.toml", nats_url=url)
        assert s.node == EKS
        node = await connect_nats(s, name="eks-node")  # seed and inbox prefix from the generated settings
        try:
            ack = await node.jetstream().publish(subjects.fault_subject("c1", EKS), _event("c1", EKS).to_json_bytes(),
                                                 timeout=5)
            assert ack.seq >= 1
            with pytest.raises(Exception):  # noqa: B017 - a forbidden JetStream publish only times out
                await node.jetstream().publish(subjects.fault_subject("c1", "ip-10-0-1-24.ec2.internal"),
                                               _event("c1", "ip-10-0-1-24.ec2.internal").to_json_bytes(), timeout=2)
        finally:
            await node.close()
            await admin.close()
    finally:
        proc.stop()


def test_router_still_checks_body_node_against_subject() -> None:
    from fleetmend.router.core import decode_event

    ev = _event("c", "ip-10-0-1-24.ec2.internal")
    with pytest.raises(Exception, match="arrived on the subject"):
        decode_event(subjects.fault_subject("c", EKS), ev.to_json_bytes())
    ok = _event("c", EKS)
    assert decode_event(subjects.fault_subject("c", EKS), ok.to_json_bytes()).node == EKS
    with pytest.raises(Exception, match="not canonical"):
        decode_event("fleet.c.fault.ip=2D10-0-1-23=2Eec2=2Einternal", ok.to_json_bytes())


async def test_two_clusters_one_node_name_abort_undrain_in_b_keeps_a_drained(nats_server, temporal_server,
                                                                              tmp_path: Path, unique: str):
    """Clusters A and B share NATS and Temporal and both have a node `ip-10-0-1-23.ec2.internal`; both
    are drained by the standalone scheduler. `fleetmend abort --undrain` in B returns B's node only:
    A's drain record stays and A's incident still says drained."""
    log = tmp_path / "dmesg.txt"
    log.write_text(corpus_case("c005")["raw"] + "\n")
    settings = {c: load_settings(None, cluster=f"{c}{unique}", node=EKS, nats_url=nats_server.url,
                                 temporal_address=temporal_server.address, state_dir=tmp_path / c,
                                 scheduler="standalone", task_queue=f"tq-{c}-{unique}", log_format="json")
                for c in ("a", "b")}
    async with Stack(settings["a"], f"a{unique}", log) as a, Stack(settings["b"], f"b{unique}", log) as b:
        for st in (a, b):
            assert (await incident(st.client, st.s.cluster, EKS, "awaiting_repair")).drained
        kv = await a.nc.jetstream().key_value(subjects.DRAIN_KV_BUCKET)
        out = await cli(env_of(settings["b"]), "abort", EKS, "--undrain", "--note", "test",
                        "--cluster", settings["b"].cluster)
        assert out.returncode == 0
        closed = await incident(b.client, settings["b"].cluster, EKS, "closed")
        assert not closed.drained
        st_a = await a.client.get_workflow_handle_for(
            NodeRemediation.run, subjects.workflow_id(settings["a"].cluster, EKS)).query(NodeRemediation.status)
        assert st_a.drained and st_a.phase == "awaiting_repair"
        rows = json.loads((await cli(env_of(settings["a"]), "nodes", "--json")).stdout)
        assert [(r["name"], r["state"]) for r in rows] == [(EKS, "drained")], "A's node went back to service"
        entry = json.loads((await kv.get(subjects.drain_kv_key(settings["a"].cluster, EKS))).value)
        assert entry["owner"] == "fleetmend" and settings["a"].cluster in entry["incident_id"]
