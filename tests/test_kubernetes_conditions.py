"""Node condition `FleetmendFault` and core/v1 Events on the Node (node-problem-detector conventions),
written by the Kubernetes adapter through the official client against kmock's emulator.

What a real API server adds that kmock lacks: generated resourceVersions (the condition patch carries
one as a precondition; kmock has none) and strategic merge (unused: the adapter sends the whole
conditions list in a JSON merge patch, which kmock applies as the API server does)."""

from __future__ import annotations

import asyncio

import kmock
import pytest

from activities.kubernetes import CONDITION_TYPE, condition_reason
from tests.test_kubernetes_adapter import NODES, Cluster, _status, cluster, sched  # noqa: F401 - fixture

EVENTS = kmock.resource("", "v1", "events")
NODE = "ip-10-0-1-23.ec2.internal"


@pytest.fixture
async def kc(cluster: Cluster) -> Cluster:  # noqa: F811 - the imported fixture
    cluster.k8s.resources["v1/events"] = {}
    return cluster


def conditions(c: Cluster, node: str) -> dict[str, dict]:
    return {x["type"]: x for x in c.read(NODES, node)["status"]["conditions"]}


def events(c: Cluster) -> list[dict]:
    return [v for k, v in c.k8s.objects.items() if k[0] == EVENTS]


def test_condition_reason_is_camel_case() -> None:
    assert condition_reason("xid_79_fallen_off_bus incident remediate/p/n/r") == "Xid79FallenOffBus"
    assert condition_reason("row-remap.failure") == "RowRemapFailure"
    assert condition_reason("") == CONDITION_TYPE


async def test_drain_sets_the_condition_and_records_an_event_return_clears_it(kc: Cluster) -> None:
    kc.node(NODE)
    s = sched(kc)
    r = await s.drain(NODE, "xid_79_fallen_off_bus incident remediate/prod/n/1", "remediate/prod/n/1")
    assert r.owned and r.drained
    conds = conditions(kc, NODE)
    assert conds["Ready"]["status"] == "True", "the kubelet's conditions are kept"
    fault = conds[CONDITION_TYPE]
    assert fault["status"] == "True" and fault["reason"] == "Xid79FallenOffBus"
    assert "xid_79_fallen_off_bus" in fault["message"]
    assert fault["lastHeartbeatTime"] and fault["lastTransitionTime"]
    (ev,) = events(kc)
    assert ev["reason"] == "FleetmendDrained" and ev["type"] == "Warning"
    assert ev["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": NODE}
    assert ev["metadata"]["namespace"] == "default" and ev["source"]["component"] == "fleetmend"

    # an activity retry of the same drain: the transition time stays, no second event
    first_transition = fault["lastTransitionTime"]
    await asyncio.sleep(1.1)
    await s.drain(NODE, "xid_79_fallen_off_bus incident remediate/prod/n/1", "remediate/prod/n/1")
    again = conditions(kc, NODE)[CONDITION_TYPE]
    assert again["lastTransitionTime"] == first_transition and again["lastHeartbeatTime"] > first_transition
    assert len(events(kc)) == 1

    u = await s.undrain(NODE, "remediate/prod/n/1")
    assert u.resumed
    cleared = conditions(kc, NODE)[CONDITION_TYPE]
    assert cleared["status"] == "False" and cleared["reason"] == "FleetmendReturned"
    assert cleared["lastTransitionTime"] > first_transition
    assert conditions(kc, NODE)["Ready"]["status"] == "True"
    assert [e["reason"] for e in events(kc)] == ["FleetmendDrained", "FleetmendReturned"]


async def test_an_undrain_by_another_incident_changes_nothing(kc: Cluster) -> None:
    kc.node(NODE)
    s = sched(kc)
    await s.drain(NODE, "xid_79 incident A", "remediate/prod/n/A")
    u = await s.undrain(NODE, "remediate/prod/n/B")
    assert not u.resumed and "belongs to incident remediate/prod/n/A" in u.detail
    node = kc.read(NODES, NODE)
    assert node["spec"]["unschedulable"] is True
    assert conditions(kc, NODE)[CONDITION_TYPE]["status"] == "True"
    # a later incident of the node adopts the drain; then its undrain returns the node
    r = await s.drain(NODE, "xid_79 incident B", "remediate/prod/n/B")
    assert r.owned
    assert (await s.undrain(NODE, "remediate/prod/n/B")).resumed
    assert not kc.read(NODES, NODE)["spec"]["unschedulable"]


async def test_events_refused_never_fail_a_drain(kc: Cluster) -> None:
    kc.node(NODE)
    kc.k8s["post", EVENTS] << kmock.Response(status=403, payload=_status(403, "Forbidden", "events is forbidden"))
    r = await sched(kc).drain(NODE, "xid_79 incident A", "remediate/prod/n/A")
    assert r.drained and r.owned  # (kmock stores the object before the scripted 403; a real server would not)
    assert conditions(kc, NODE)[CONDITION_TYPE]["status"] == "True"


async def test_ticket_and_diagnostics_activities_record_events_on_the_node(kc: Cluster, nc, tmp_path) -> None:
    """The worker wires the adapter's `record_event` into the ticket and diagnostics activities."""
    from temporalio.testing import ActivityEnvironment

    from activities.diagnostics import DiagnosticsActivities
    from activities.ticket_store import LocalTicketStore
    from activities.tickets import TicketActivities
    from fleetmend import subjects
    from fleetmend.diagnostics import CheckResult, DiagLevel, DiagReport, DiagResult
    from fleetmend.messages import DiagActivityRequest, TicketRequest

    kc.node(NODE)
    s = sched(kc)
    env = ActivityEnvironment()
    tickets = TicketActivities(LocalTicketStore(tmp_path / "tickets"), node_events=s.record_event)
    req = TicketRequest(incident_id="remediate/prod/n/1", cluster="prod", node=NODE, title="XID 79", severity="fatal",
                        fault_class="xid_79_fallen_off_bus", evidence={})
    ref = await env.run(tickets.file_ticket, req)
    await env.run(tickets.file_ticket, req)  # a retry finds the same ticket: still one event

    async def answer(msg) -> None:
        rep = DiagReport(node=NODE, cluster="prod", level=DiagLevel.QUICK,
                         checks=[CheckResult(name="gpu_count", result=DiagResult.FAIL, measured="7", expected="8")])
        await msg.respond(rep.model_dump_json().encode())

    sub = await nc.subscribe(subjects.diag_subject("prod", NODE), cb=answer)
    try:
        diag = DiagnosticsActivities(nc, node_events=s.record_event)
        rep = await env.run(diag.run_diagnostics, DiagActivityRequest("prod", NODE, timeout_s=5,
                                                                      incident_id="remediate/prod/n/1"))
        assert rep.result == DiagResult.FAIL
    finally:
        await sub.unsubscribe()
    evs = {e["reason"]: e for e in events(kc)}
    assert set(evs) == {"FleetmendTicketFiled", "FleetmendDiagnostics"} and len(events(kc)) == 2
    assert ref.ticket_id in evs["FleetmendTicketFiled"]["message"]
    assert "fail" in evs["FleetmendDiagnostics"]["message"] and "gpu_count" in evs["FleetmendDiagnostics"]["message"]
    assert all(e["involvedObject"]["name"] == NODE for e in evs.values())
