"""`fleetmend inject`, `breaker status|reset`, `pause|resume` against the session's real NATS and
Temporal dev server, with a worker running NodeRemediation + FleetGuard (stand-in side effects)."""

from __future__ import annotations

import asyncio
import json

import pytest
import structlog
from temporalio.worker import Worker
from typer.testing import CliRunner

from fleetmend import subjects
from fleetmend.cli.app import app
from fleetmend.infra.lease import Presence
from fleetmend.messages import GuardPolicy, guard_task_queue
from tests.activity_standins import GUARD_ACTIVITIES, Calls, guard_activities, real_guard, stand_ins
from tests.conftest import assert_eventually
from tests.test_workflow import fault, phase_is, start
from workflows.fleetguard import FleetGuard
from workflows.remediation import NodeRemediation


def cli(env: dict[str, str], *args: str):
    """The app in this process; JSON is read from `.stdout` alone (`.output` interleaves stderr, where a task
    another test left in this worker may log)."""
    return CliRunner().invoke(app, list(args), env=env, catch_exceptions=False)


@pytest.fixture
def cli_env(nats_server, temporal_server, unique, tmp_path):
    return {"FLEETMEND_NATS_URL": nats_server.url, "FLEETMEND_TEMPORAL_ADDRESS": temporal_server.address,
            "FLEETMEND_CLUSTER": f"cli{unique}", "FLEETMEND_TASK_QUEUE": f"tq-{unique}",
            "FLEETMEND_STATE_DIR": str(tmp_path), "FLEETMEND_LOG_FORMAT": "json"}


async def test_inject_publishes_a_synthetic_event_with_msg_id(cli_env, nc):
    cluster = cli_env["FLEETMEND_CLUSTER"]
    r = await asyncio.to_thread(cli, cli_env, "inject", "--node", "gpu-7", "--xid", "79", "--bus-id",
                                "0000:3b:00.0", "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["subject"] == subjects.fault_subject(cluster, "gpu-7") and not res["duplicate"]
    js = nc.jetstream()
    msg = await js.get_msg(subjects.FAULT_STREAM, res["seq"])
    body = json.loads(msg.data)
    assert msg.headers["Nats-Msg-Id"] == res["event_id"] == body["event_id"]
    assert body["source"] == "inject" and body["code"] == 79 and body["severity"] == "fatal"
    assert body["device"]["pci_bus_id"] == "0000:3b:00.0" and "injected" in body["message"]

    r = await asyncio.to_thread(cli, cli_env, "inject", "--node", "gpu-7", "--kind", "ib_port_down", "--json")
    assert r.exit_code == 0, r.output
    body = json.loads((await js.get_msg(subjects.FAULT_STREAM, json.loads(r.stdout)["seq"])).data)
    assert body["kind"] == "ib_port_down" and body["component"] == "ib"

    bad = await asyncio.to_thread(cli, cli_env, "inject", "--node", "gpu-7", "--kind", "ib_prot_down")
    assert bad.exit_code == 2 and "unknown kind 'ib_prot_down'" in bad.output
    both = await asyncio.to_thread(cli, cli_env, "inject", "--node", "gpu-7")
    assert both.exit_code == 2 and "exactly one of --xid" in both.output
    # the router classifies by the catalog: a severity it would override is refused, not published
    sev = await asyncio.to_thread(cli, cli_env, "inject", "--node", "gpu-7", "--kind", "ib_port_down",
                                  "--severity", "fatal")
    assert sev.exit_code == 2 and "by the catalog as degraded" in sev.output, sev.output
    same = await asyncio.to_thread(cli, cli_env, "inject", "--node", "gpu-7", "--xid", "79", "--severity", "fatal")
    assert same.exit_code == 0, same.output
    name = await asyncio.to_thread(cli, cli_env, "inject", "--node", "gpu 7", "--xid", "79")
    assert name.exit_code == 2 and "--node: invalid node name 'gpu 7'" in name.output, name.output
    assert "pydantic" not in name.output and "validation error" not in name.output


async def test_breaker_status_reset_and_pause_resume(cli_env, temporal_client, nc):
    cluster, tq = cli_env["FLEETMEND_CLUSTER"], cli_env["FLEETMEND_TASK_QUEUE"]
    calls = Calls()
    # as in a real worker, the guard runs on its own queue (the CLI starts it there)
    gtq = guard_task_queue(tq)
    guard = real_guard(temporal_client, gtq, GuardPolicy(breaker_distinct_nodes=1, cluster_nodes=100), nc.jetstream(),
                       incident_task_queue=tq)
    acts = [a for a in stand_ins(calls) if a.__name__ not in GUARD_ACTIVITIES]
    tq, gtq = subjects.cluster_task_queue(tq, cluster), subjects.cluster_task_queue(gtq, cluster)
    async with Worker(temporal_client, task_queue=tq, workflows=[NodeRemediation],
                      activities=acts + guard_activities(guard, calls)), \
            Worker(temporal_client, task_queue=gtq, workflows=[FleetGuard], activities=guard_activities(guard, calls)):
        # as a real worker does: the guard commands refuse a cluster no worker announces (try2 F26)
        present = Presence(nc.jetstream(), "worker", [cluster], renew_s=5)
        await present.announce()
        stop = asyncio.Event()
        renewing = asyncio.create_task(present.run(stop, structlog.get_logger()))
        none = await asyncio.to_thread(cli, cli_env, "breaker", "status")
        assert none.exit_code == 1 and "no FleetGuard" in none.output

        r = await asyncio.to_thread(cli, cli_env, "pause", "--note", "maintenance window")
        assert r.exit_code == 0 and "no node will be drained" in r.output, r.output
        h1 = await start(temporal_client, tq, cluster, "x1", [fault(cluster, "x1", 79, drain=True)])
        await assert_eventually(lambda: phase_is(h1, "awaiting_permit"))
        st = await assert_eventually(lambda: _status(cli_env, lambda s: s["queue"]), what="x1 queued")
        assert st["paused"] and [q["node"] for q in st["queue"]] == ["x1"] and calls.drains == []
        r = await asyncio.to_thread(cli, cli_env, "breaker", "status")
        out = " ".join(r.output.split())
        assert "PAUSED by" in out and " at 20" in out and "(maintenance window)" in out, out  # who, when, why
        r = await asyncio.to_thread(cli, cli_env, "pause", "--note", "again")
        assert r.exit_code == 0 and "already paused by" in r.output and "maintenance window" in r.output, r.output
        r = await asyncio.to_thread(cli, cli_env, "resume", "--json")
        assert r.exit_code == 0, r.output
        res = json.loads(r.stdout)  # --json: the result as one object
        assert res["command"] == "resume" and res["cluster"] == cluster and res["by"] and res["result"]
        await assert_eventually(lambda: phase_is(h1, "awaiting_repair"), what="drained after resume")
        r = await asyncio.to_thread(cli, cli_env, "resume")
        assert r.exit_code == 0 and "not paused: nothing to resume" in r.output, r.output
        r = await asyncio.to_thread(cli, cli_env, "breaker", "reset")
        assert r.exit_code == 0 and "nothing to reset" in r.output, r.output

        h2 = await start(temporal_client, tq, cluster, "x2", [fault(cluster, "x2", 79, drain=True)])
        await assert_eventually(lambda: _status(cli_env, lambda s: s["breaker_tripped"]), what="tripped (2 > 1)")
        r = await asyncio.to_thread(cli, cli_env, "breaker", "status")
        assert r.exit_code == 0 and "TRIPPED" in r.output and "reset with: fleetmend breaker reset" in r.output, r.output
        st = await _status(cli_env, lambda s: True)
        assert "from 2 distinct nodes" in st["breaker_reason"] and "x1, x2" in st["breaker_reason"]
        r = await asyncio.to_thread(cli, cli_env, "breaker", "reset", "--note", "one-off", "--json")
        assert r.exit_code == 0 and "breaker reset" in json.loads(r.stdout)["result"], r.output
        await assert_eventually(lambda: phase_is(h2, "awaiting_repair"), what="queued drain after reset")
        st = json.loads((await asyncio.to_thread(cli, cli_env, "breaker", "status", "--json")).stdout)
        assert any("breaker reset by" in line and "one-off" in line for line in st["log"])
        assert [d.node for d in calls.drains] == ["x1", "x2"]
        stop.set()
        await renewing


async def _status(env: dict[str, str], pred):
    r = await asyncio.to_thread(cli, env, "breaker", "status", "--json")
    st = json.loads(r.stdout) if r.exit_code == 0 else None
    return st if st and pred(st) else None


def test_breaker_release_refuses_a_bad_node_name_before_asking_anyone() -> None:
    for bad in ("", "a b"):
        r = CliRunner().invoke(app, ["breaker", "release", bad], env={"FLEETMEND_TEMPORAL_ADDRESS": "127.0.0.1:1"})
        assert r.exit_code == 2 and "invalid node name" in r.output and "Traceback" not in r.output, r.output
