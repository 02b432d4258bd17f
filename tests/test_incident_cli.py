"""`fleetmend status NODE` finds a node in any cluster, `fleetmend history NODE` lists its closed
incidents too, and every command's `--json` stdout parses as JSON: real Temporal dev server, a
worker running NodeRemediation with stand-in side effects, the CLI as a subprocess."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from temporalio.worker import Worker

from tests.activity_standins import Calls, stand_ins
from tests.conftest import assert_eventually
from tests.test_workflow import fault, phase_is, start
from workflows.remediation import NodeRemediation

REPO = Path(__file__).resolve().parents[1]


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleetmend.cli.main", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=90, env={**os.environ, **env})


async def cli_json(env: dict[str, str], *args: str, rc: int = 0):
    p = await asyncio.to_thread(cli, env, *args)
    assert p.returncode == rc, (args, p.stdout, p.stderr)
    return json.loads(p.stdout)  # the whole stdout: nothing but JSON


@pytest.fixture
async def worker(temporal_client, unique):
    calls = Calls()
    tq = f"tq-{unique}"
    async with Worker(temporal_client, task_queue=tq, workflows=[NodeRemediation], activities=stand_ins(calls)):
        yield temporal_client, tq, calls


async def _listed(client, query: str, n: int) -> bool:
    return (await client.count_workflows(query)).count >= n


async def test_status_and_history_find_a_node_in_every_cluster(worker, temporal_server, unique, tmp_path):
    client, tq, calls = worker
    ca, cb, node = f"a{unique}", f"b{unique}", f"n{unique}"
    env = {"FLEETMEND_TEMPORAL_ADDRESS": temporal_server.address, "FLEETMEND_CLUSTER": "elsewhere",
           "FLEETMEND_TASK_QUEUE": tq, "FLEETMEND_STATE_DIR": str(tmp_path), "FLEETMEND_NATS_URL": "nats://127.0.0.1:1"}

    # incident 1 in cluster A: drained, ticket, repaired, returned to service
    h = await start(client, tq, ca, node, [fault(ca, node, 79, drain=True)])
    await assert_eventually(lambda: phase_is(h, "awaiting_repair"), what="awaiting_repair")
    await assert_eventually(lambda: _listed(client, f"FleetNode='{node}'", 1), what="visible")
    st = await cli_json(env, "status", node, "--json")  # configured cluster is "elsewhere": found anyway
    assert st["cluster"] == ca and st["phase"] == "awaiting_repair" and st["drained"] and st["drained_at"]
    assert st["runbooks"] == {"xid79": "fleetmend runbook xid79 (docs/runbooks/xid79.md)"}
    shown = await asyncio.to_thread(cli, env, "show", node)
    assert shown.returncode == 0 and "runbook: fleetmend runbook xid79" in shown.stdout, shown.stdout
    # a command that acts is not guessed into another cluster (a retried abort closed a second incident)
    refused = await asyncio.to_thread(cli, env, "repaired", node, "--ticket", "RMA-1")
    assert refused.returncode == 1 and f"no open incident in cluster elsewhere; it has one in {ca}: add --cluster " \
        f"{ca}" in refused.stderr.replace("\n", " "), refused.stderr
    res = await cli_json(env, "repaired", node, "--ticket", "RMA-1", "--cluster", ca, "--json")
    assert res["cluster"] == ca and res["command"] == "mark_repaired" and "repair recorded" in res["result"]
    await assert_eventually(lambda: phase_is(h, "closed"), what="closed")
    await asyncio.sleep(1.0)  # the incident stays drained at least this long (drained_s below)

    # incident 2: the same node in cluster B, open; incident 3: cluster A again, an application fault
    hb = await start(client, tq, cb, node, [fault(cb, node, 48, drain=True)])
    await assert_eventually(lambda: phase_is(hb, "awaiting_repair"), what="B awaiting_repair")
    h3 = await start(client, tq, ca, node, [fault(ca, node, 13, drain=False, severity="degraded")],
                     close_after_idle_s=1)
    await assert_eventually(lambda: phase_is(h3, "closed"), what="A's second incident closed")
    await assert_eventually(lambda: _listed(client, f"FleetNode='{node}' AND ExecutionStatus='Completed'", 2),
                            what="both closed runs visible")

    both = await cli_json(env, "status", node, "--json")
    assert isinstance(both, list) and sorted(d["cluster"] for d in both) == [ca, cb]
    table = await asyncio.to_thread(cli, env, "status", node)
    assert table.returncode == 0 and "2 clusters" in table.stdout and "--cluster" in table.stdout
    only_b = await cli_json(env, "status", node, "--cluster", cb, "--json")
    assert only_b["cluster"] == cb and only_b["phase"] == "awaiting_repair"

    hist = await cli_json(env, "history", node, "--json")
    assert len(hist) == 3, hist
    by = {(r["cluster"], tuple(r["fault_classes"])): r for r in hist}
    returned = by[(ca, ("xid79",))]
    assert returned["outcome"] == "returned_to_service" and returned["ticket"] == "FM-000001"
    assert returned["opened_at"] and returned["closed_at"] and returned["drained_at"]
    assert returned["drained_s"] >= 1.0
    assert by[(ca, ("xid13",))]["outcome"] == "recorded" and by[(ca, ("xid13",))]["drained_at"] is None
    open_b = by[(cb, ("xid48",))]
    assert open_b["closed_at"] is None and open_b["phase"] == "awaiting_repair" and open_b["outcome"] is None
    assert [r["cluster"] for r in await cli_json(env, "history", node, "--cluster", cb, "--json")] == [cb]
    text = await asyncio.to_thread(cli, env, "history", node)
    assert "returned_to_service" in text.stdout and "open" in text.stdout

    # every cluster in the listing, with a cluster column; --cluster narrows it
    listing = await cli_json(env, "status", "--json")
    assert {ca, cb} <= {r["cluster"] for r in listing}
    assert {r["cluster"] for r in await cli_json(env, "status", "--cluster", cb, "--json")} == {cb}
    table = await asyncio.to_thread(cli, env, "status")
    assert "cluster" in table.stdout and ca in table.stdout and cb in table.stdout
    # a listing cut at --limit says how many it leaves out, and how many are drained now
    cut = " ".join((await asyncio.to_thread(cli, env, "status", "--limit", "1")).stdout.split())
    assert "showing the 1 newest of " in cut and " drained now, " in cut and "`--limit N` lists more" in cut, cut

    # state-changing commands print their result as JSON; a refused one exits 1 with stdout empty
    from fleetmend.diagnostics import DiagResult

    calls.diag_results.append(DiagResult.FAIL)  # the re-test fails: B stays open for the abort below
    res = await cli_json(env, "retest", node, "--cluster", cb, "--json")
    assert res["cluster"] == cb and res["result"] == "re-test scheduled"
    await assert_eventually(lambda: _failed_retest(hb), what="re-test ran and failed")
    res = await cli_json(env, "abort", node, "--note", "test over", "--cluster", cb, "--json")
    assert res["cluster"] == cb and res["by"] and "incident will close" in res["result"]
    await assert_eventually(lambda: phase_is(hb, "closed"), what="B aborted")
    refused = await asyncio.to_thread(cli, env, "repaired", node, "--cluster", cb, "--json")
    assert refused.returncode == 1 and refused.stdout == "" and "no open incident" in refused.stderr

    missing = await asyncio.to_thread(cli, env, "status", f"none{unique}", "--json")
    assert missing.returncode == 1 and "in any cluster" in missing.stderr
    assert json.loads(missing.stdout)["incident"] is None  # --json: still JSON on stdout


async def _failed_retest(h) -> bool:
    st = await h.query(NodeRemediation.status)
    return st.phase == "awaiting_repair" and any("back to awaiting repair" in e["text"] for e in st.timeline)
