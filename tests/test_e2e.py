"""The main job end to end, with every real part: a captured kernel log → agent → JetStream →
router → Temporal → worker → real Slurm (scontrol) and the local ticket store, and back.

- A fatal XID (corpus case c005, XID 79 "fallen off the bus") for Slurm node `node2` drains exactly
  that node with a `fleetmend:` reason, files one ticket, and after `fleetmend repaired` the node is
  idle again in Slurm.
- An XID 13-only log (corpus case c002) for `node3` drains nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from activities.ticket_kv import KvTicketStore
from fleetmend import subjects
from fleetmend.catalog import load_catalog
from fleetmend.config import SlurmSettings, load_settings
from fleetmend.infra.connect import connect_nats, connect_temporal
from fleetmend.router.core import Router
from fleetmend.worker import build_worker
from tests.conftest import assert_eventually
from tests.corpus_paths import corpus_case
from workflows.remediation import NodeRemediation

pytestmark = pytest.mark.slurm


async def cli(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run the real `fleetmend` CLI in a subprocess (in a thread: the worker shares this event loop)."""
    p = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "fleetmend.cli.main", *args], env=env, capture_output=True,
                       text=True, timeout=120)
    if check and p.returncode != 0:
        raise AssertionError(f"fleetmend {' '.join(args)} failed rc={p.returncode}\n{p.stdout}\n{p.stderr}")
    return p


async def status(client, cluster: str, node: str):
    h = client.get_workflow_handle_for(NodeRemediation.run, subjects.workflow_id(cluster, node))
    return await h.query(NodeRemediation.status)


async def test_fatal_xid_drains_tickets_and_returns_after_repair(nats_server, temporal_server, slurm_cluster,
                                                                 tmp_path: Path, unique: str):
    from agents.runner import run_agent

    cluster = f"e2e{unique}"
    slurm_cluster.resume_all()
    slurm_cluster.wait_idle()
    s = load_settings(None, cluster=cluster, node="node2", nats_url=nats_server.url,
                      temporal_address=temporal_server.address, state_dir=tmp_path / "state", scheduler="slurm",
                      task_queue=f"tq-{unique}", slurm=SlurmSettings(slurm_conf=str(slurm_cluster.conf)),
                      log_format="json")
    env = {**os.environ, "FLEETMEND_NATS_URL": nats_server.url, "FLEETMEND_TEMPORAL_ADDRESS": temporal_server.address,
           "FLEETMEND_STATE_DIR": str(s.state_dir), "FLEETMEND_CLUSTER": cluster, "FLEETMEND_LOG_FORMAT": "json",
           "FLEETMEND_TASK_QUEUE": s.task_queue}
    fatal_log = tmp_path / "node2-dmesg.txt"
    fatal_log.write_text(corpus_case("c005")["raw"] + "\n")
    app_log = tmp_path / "node3-dmesg.txt"
    app_log.write_text(corpus_case("c002")["raw"] + "\n")

    nc = await connect_nats(s, name="e2e")
    client = await connect_temporal(s)
    stop = asyncio.Event()
    router = Router(s, nc, nc.jetstream(), client, load_catalog(),
                    filter_subject=f"fleet.{cluster}.fault.*", durable=f"router-{unique}")
    worker = await build_worker(s, client, nc)
    tasks = [asyncio.create_task(router.run(stop)), asyncio.create_task(worker.run())]
    # node2's agent: replays the fatal log, then keeps running to answer diagnostics requests.
    agent_stop = asyncio.Event()
    tasks.append(asyncio.create_task(run_agent(s, kmsg_file=fatal_log, once=False, stop=agent_stop)))
    try:
        # node3: an operator replays an application-error log with the CLI, exactly as the README says.
        out = await cli(env, "agent", "--node", "node3", "--kmsg-file", str(app_log), "--once")
        assert out.returncode == 0

        async def node2_awaiting_repair():
            try:
                st = await status(client, cluster, "node2")
            except Exception:
                return None
            return st if st.phase == "awaiting_repair" else None

        st = await assert_eventually(node2_awaiting_repair, timeout_s=60, what="node2 awaiting repair")
        assert st.drained and st.ticket
        assert any(f["kind"] == "xid" and f["code"] == 79 and f["severity"] == "fatal" for f in st.faults)
        assert slurm_cluster.state("node2").find("DRAIN") >= 0
        assert slurm_cluster.reason("node2").startswith("fleetmend:")
        for other in ("node1", "node3", "node4"):
            assert "DRAIN" not in slurm_cluster.state(other), f"{other} must not be drained"

        # What the Temporal UI filters on: the incident is findable by node, cluster, phase and ticket.
        async def listed():
            q = (f"FleetNode='node2' AND FleetCluster='{cluster}' AND FleetPhase='awaiting_repair' "
                 f"AND FleetTicket='{st.ticket}' AND FleetDrained=true")
            return [w async for w in client.list_workflows(q)]

        assert len(await assert_eventually(listed, what="incident listed by search attributes")) == 1
        desc = await client.get_workflow_handle(subjects.workflow_id(cluster, "node2")).describe()
        assert "node2" in (await desc.static_summary() or ""), "the UI shows a one-line summary"

        js = nc.jetstream()
        tickets = [t for t in await KvTicketStore(js).list_all() if t["cluster"] == cluster]  # the shared ledger
        assert [t["node"] for t in tickets] == ["node2"]
        assert "Xid" in json.dumps(tickets[0]["evidence"]), "the raw kernel lines are in the ticket's evidence"

        # The XID 13-only node: recorded, nothing drained.
        st3 = await assert_eventually(lambda: status(client, cluster, "node3"), what="node3 incident")
        assert st3.phase == "triage" and not st3.drained and st3.ticket is None
        codes = {f["code"] for f in st3.faults}
        assert 13 in codes and codes <= {13, 43}, "c002 holds XID 13s and one XID 43 (application-side only)"
        assert not any(f["drain"] for f in st3.faults)
        assert "DRAIN" not in slurm_cluster.state("node3")

        # CLI views an operator uses.
        js_status = json.loads((await cli(env, "status", "node2", "--json")).stdout)
        assert js_status["phase"] == "awaiting_repair" and js_status["drained"] is True
        assert js_status["ticket"] == st.ticket and js_status["outcome"] is None
        assert js_status["faults"][0]["raw"]
        table = (await cli(env, "status")).stdout
        assert "node2" in table and "node3" in table
        assert "node2" in (await cli(env, "tickets")).stdout

        # Repair → verify → return to service.
        done = await cli(env, "repaired", "node2", "--ticket", "RMA-42", "--note", "GPU replaced")
        assert "repair recorded" in done.stdout

        async def node2_closed():
            st = await status(client, cluster, "node2")
            return st if st.phase == "closed" else None

        st = await assert_eventually(node2_closed, timeout_s=60, what="node2 closed")
        assert st.outcome == "returned_to_service" and not st.drained
        slurm_cluster.wait_idle(["node2"])
        assert "DRAIN" not in slurm_cluster.state("node2")
        assert [t["status"] for t in await KvTicketStore(js).list_all() if t["cluster"] == cluster] == ["resolved"]

        # The incident ledger (issue 26): the report counts it, written by the router and the activities.
        page = tmp_path / "report.html"
        rep = json.loads((await cli(env, "report", "--json", "--cluster", cluster, "--html", str(page))).stdout)
        assert rep["incidents"] == 1 and rep["gpu_hours"] > 0, rep
        assert list(rep["gpu_hours_by_fault_class"]) == ["xid79"] and rep["outcomes"] == {"returned_after_repair": 1}
        assert rep["mttr_h"]["n"] == 1 and rep["time_to_detect_s"]["n"] == 1 and rep["time_to_drain_s"]["n"] == 1
        assert rep["ticket_turnaround_h"]["n"] == 1 and 'data-figure="gpu_hours_by_fault_class" data-group="xid79"' \
            in page.read_text()
    finally:
        stop.set()
        agent_stop.set()
        await worker.shutdown()
        for t in tasks:
            try:
                await asyncio.wait_for(t, 30)
            except (asyncio.CancelledError, Exception):
                pass
        await nc.close()
        slurm_cluster.resume_all()
