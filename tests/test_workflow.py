"""NodeRemediation on the real Temporal dev server, with stand-in activities under their real names.

The stand-ins record every call, so the tests assert outcomes: phase, drains issued, tickets filed.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
from temporalio.client import WorkflowUpdateFailedError
from temporalio.worker import Worker

from fleetmend import subjects
from fleetmend.diagnostics import DiagResult
from fleetmend.events import Component, Device, FaultEvent, Severity, Source, Verdict
from fleetmend.messages import (
    AbortCommand,
    FaultBatch,
    IncidentInput,
    IncidentPolicy,
    RepairedCommand,
    RetestCommand,
    RoutedFault,
)
from tests.activity_standins import Calls, stand_ins
from tests.conftest import assert_eventually
from workflows.remediation import NodeRemediation


def fault(cluster: str, node: str, xid: int, drain: bool, severity: str = "fatal", event_id: str | None = None,
          healthy: bool = False) -> RoutedFault:
    ev = FaultEvent(cluster=cluster, node=node, component=Component.GPU, kind="xid", code=xid,
                    severity=Severity(severity), source=Source.KMSG, device=Device(pci_bus_id="0000:3b:00.0"),
                    raw=f"NVRM: Xid (PCI:0000:3b:00): {xid}, pid=1, name=python, test", message=f"XID {xid}",
                    healthy=healthy, **({"event_id": event_id} if event_id else {}),
                    verdict=Verdict(severity=severity, immediate_action="RESTART_BM" if drain else "RESTART_APP",
                                    fault_class=f"xid{xid}", drain=drain, **row_reading("xid", xid)))
    return RoutedFault(event=ev)


def row_reading(kind: str, code: int | None = None) -> dict:
    """The catalog row's urgency, recovery, verification and history rule, as the router's verdict
    carries them (tests set severity/drain/action themselves); unknown kinds: the defaults."""
    from fleetmend.catalog import default_catalog

    cat = default_catalog()
    r = cat.xids.get(code) if kind == "xid" and code is not None else cat.kinds.get(kind)
    return {} if r is None else dict(urgency=r.urgency, recovery=r.recovery, verify=list(r.verify), history=r.history)


FAST_POLICY = {"debounce_s": 0.0, "recovery_settle_s": 0.0, "ticket_poll_s": 0.0, "close_info_after_s": 0.0}
"""Tests run incidents without the production waits (debounce, settle, ticket polling) unless they set them."""


async def start(client, tq: str, cluster: str, node: str, faults: list[RoutedFault], **policy):
    wid = subjects.workflow_id(cluster, node)
    await client.start_workflow(NodeRemediation.run, IncidentInput(cluster=cluster, node=node,
                                                                   policy=IncidentPolicy(**{**FAST_POLICY, **policy})),
                                id=wid, task_queue=tq, start_signal="faults",
                                start_signal_args=[FaultBatch(faults=faults)])
    return client.get_workflow_handle_for(NodeRemediation.run, wid)


async def phase_is(handle, phase: str):
    st = await handle.query(NodeRemediation.status)
    return st if st.phase == phase else None


BY = RepairedCommand(by="tester@ci")


@pytest.fixture
async def env(temporal_client):
    calls = Calls()
    tq = f"tq-{uuid.uuid4().hex[:8]}"
    async with Worker(temporal_client, task_queue=tq, workflows=[NodeRemediation], activities=stand_ins(calls)):
        yield temporal_client, tq, calls


async def test_fatal_fault_drains_tickets_and_returns_after_repair(env, unique):
    client, tq, calls = env
    h = await start(client, tq, unique, "n1", [fault(unique, "n1", 79, drain=True)])
    st = await assert_eventually(lambda: phase_is(h, "awaiting_repair"), what="awaiting_repair")
    assert st.drained and st.ticket == "FM-000001" and st.outcome is None
    assert [d.node for d in calls.drains] == ["n1"] and len(calls.tickets) == 1
    assert "xid79" in calls.tickets[0].title and calls.tickets[0].evidence["faults"][0]["code"] == 79

    # A repeat of the same fault joins the incident; a re-delivered event id is counted, not recorded twice.
    dup = fault(unique, "n1", 79, drain=True)
    await h.signal(NodeRemediation.faults, FaultBatch(faults=[dup, dup]))
    await assert_eventually(lambda: _dups(h), what="duplicate counted")

    await h.execute_update(NodeRemediation.mark_repaired, RepairedCommand(by="alice@ops", ticket="RMA-1", note="swapped"))
    st = await assert_eventually(lambda: phase_is(h, "closed"), what="closed")
    assert st.outcome == "returned_to_service" and not st.drained
    assert len(calls.drains) == 1 and len(calls.undrains) == 1 and len(calls.tickets) == 1
    assert [u.status for u in calls.updates][-1] == "resolved"
    assert any(e["by"] == "alice@ops" for e in st.timeline), "the command's sender is in the audit trail"
    assert len(calls.diags) == 2


async def _dups(h):
    st = await h.query(NodeRemediation.status)
    return st.duplicates >= 1 and st.faults[0]["count"] == 2


async def test_application_fault_records_without_draining(env, unique):
    client, tq, calls = env
    h = await start(client, tq, unique, "n2", [fault(unique, "n2", 13, drain=False, severity="degraded")],
                    close_after_idle_s=2)
    st = await assert_eventually(lambda: phase_is(h, "closed"), what="closed")
    assert st.outcome == "recorded" and not st.drained and st.ticket is None
    assert calls.drains == [] and calls.tickets == []
    assert st.faults[0]["code"] == 13
    # the timeline says what happened while it waited, not only "incident opened"
    texts = [e["text"] for e in st.timeline]
    assert texts[0] == "incident opened" and texts[1].startswith("recorded, no drain: xid13 (1 condition(s)); "
                                                                 "closes after 2s without a new fault"), texts


async def test_failed_verification_goes_back_to_awaiting_repair(env, unique):
    client, tq, calls = env
    calls.diag_results = [DiagResult.FAIL, DiagResult.FAIL, DiagResult.PASS]
    h = await start(client, tq, unique, "n3", [fault(unique, "n3", 48, drain=True)])
    await assert_eventually(lambda: phase_is(h, "awaiting_repair"))
    with pytest.raises(WorkflowUpdateFailedError):
        await h.execute_update(NodeRemediation.mark_repaired, RepairedCommand(by=""))  # no sender: rejected
    await h.execute_update(NodeRemediation.mark_repaired, BY)
    await assert_eventually(lambda: _verification_failed(h, calls), what="verification failed once")
    await h.execute_update(NodeRemediation.force_retest, RetestCommand(by="tester@ci"))
    st = await assert_eventually(lambda: phase_is(h, "closed"))
    assert st.outcome == "returned_to_service"
    assert "verification_failed" in [u.status for u in calls.updates]
    assert len(calls.undrains) == 1


async def _verification_failed(h, calls):
    st = await h.query(NodeRemediation.status)
    return st.phase == "awaiting_repair" and len(calls.diags) == 2


async def test_commands_rejected_in_wrong_phase(env, unique):
    client, tq, calls = env
    h = await start(client, tq, unique, "n4", [fault(unique, "n4", 31, drain=False, severity="degraded")])
    await assert_eventually(lambda: phase_is(h, "triage"))
    with pytest.raises(WorkflowUpdateFailedError) as ei:
        await h.execute_update(NodeRemediation.mark_repaired, BY)
    assert "not awaiting_repair" in str(ei.value.cause)
    await h.execute_update(NodeRemediation.abort, AbortCommand(by="bob@ops", note="false alarm"))
    st = await assert_eventually(lambda: phase_is(h, "closed"))
    assert st.outcome == "aborted" and calls.drains == []


async def test_operator_drain_is_never_undrained(env, unique):
    client, tq, calls = env
    calls.operator_drained = True
    h = await start(client, tq, unique, "n5", [fault(unique, "n5", 79, drain=True)])
    await assert_eventually(lambda: phase_is(h, "awaiting_repair"))
    await h.execute_update(NodeRemediation.mark_repaired, BY)
    st = await assert_eventually(lambda: phase_is(h, "closed"))
    assert st.outcome == "operator_owned" and calls.undrains == []


async def test_observe_only_touches_nothing(env, unique):
    client, tq, calls = env
    h = await start(client, tq, unique, "n6", [fault(unique, "n6", 79, drain=True)], observe_only=True)
    st = await assert_eventually(lambda: phase_is(h, "closed"))
    assert st.outcome == "observed" and calls.drains == [] and calls.tickets == []


async def test_app_xids_dated_years_ahead_drain_nothing(env):
    """The workflow's history rules are two-sided: three XID 13 on one GPU dated three years ahead
    (sent straight to the workflow, as a router without the clamp would) are recorded, not drained."""
    import dataclasses
    from datetime import timedelta

    from fleetmend.events import utcnow

    client, tq, calls = env
    node = f"fut-{uuid.uuid4().hex[:6]}"
    ahead = utcnow() + timedelta(days=3 * 365)
    faults = [fault("c1", node, 13, drain=False, severity="degraded") for _ in range(3)]
    faults = [dataclasses.replace(f, event=f.event.model_copy(update={"observed_at": ahead})) for f in faults]
    h = await start(client, tq, "c1", node, faults, close_after_idle_s=2)
    st = await assert_eventually(lambda: phase_is(h, "closed"), timeout_s=30)
    assert not st.drained and len(st.faults) == 1 and st.faults[0]["count"] == 3
    assert not [d for d in calls.drains if d.node == node]


async def test_a_flood_of_distinct_faults_stays_within_the_byte_budget(env):
    """More distinct faults waiting than MAX_PENDING_FAULTS (one signal of 1,100 conditions): the
    signal handler keeps text only for the newest and the drain-worthy, the incident absorbs every
    one (records bounded, the rest counted) and a drain-worthy fault among them still drains."""
    import dataclasses

    from fleetmend.messages import MAX_PENDING_FAULTS

    client, tq, calls = env
    node = f"flood-{uuid.uuid4().hex[:6]}"
    faults = [fault("c1", node, 13, drain=False, severity="degraded") for _ in range(1100)]
    faults = [dataclasses.replace(f, event=f.event.model_copy(update={"device": f.event.device.model_copy(
        update={"pci_bus_id": f"0000:{i // 250:02x}:{i % 250:02x}.0"})})) for i, f in enumerate(faults)]
    faults[0] = fault("c1", node, 79, drain=True)  # the oldest entry is the drain-worthy one
    assert len(faults) > MAX_PENDING_FAULTS
    h = await start(client, tq, "c1", node, faults)
    st = await assert_eventually(lambda: phase_is(h, "awaiting_repair"), timeout_s=60)
    assert st.drained and len(st.faults) + st.faults_dropped == 1100
    assert any(f["code"] == 79 and f["raw"] for f in st.faults), "the drain-worthy fault kept its text"


async def abort_while_diagnosing(client, calls: Calls):
    """XID 79 (recovery: reboot) drained; abort with undrain while its diagnostics run; the incident's
    handle and its closed status. `test_abort_while_diagnosing_stops_recovery` asserts what it did;
    tests/test_policy_replay.py records it."""
    calls.diag_gate = asyncio.Event()
    tq, cluster = f"recd-{uuid.uuid4().hex[:8]}", "rec"
    node = f"abd-{uuid.uuid4().hex[:6]}"
    async with Worker(client, task_queue=tq, workflows=[NodeRemediation], activities=stand_ins(calls)):
        h = await start(client, tq, cluster, node, [fault(cluster, node, 79, drain=True)])
        await assert_eventually(lambda: phase_is(h, "diagnosing"))
        await assert_eventually(lambda: bool(calls.diags), what="diagnostics running")
        await h.execute_update(NodeRemediation.abort, AbortCommand(by="rec@ci", note="hands on the node",
                                                                   undrain=True))
        calls.diag_gate.set()
        st = await assert_eventually(lambda: phase_is(h, "closed"))
        await h.result()
    return h, st


def drift_fault(cluster: str, node: str) -> RoutedFault:
    """A `config_drift_governor` fault as the drift judge publishes it (a live fix: `performance`)."""
    from fleetmend.catalog import default_catalog

    ev = FaultEvent(cluster=cluster, node=node, component=Component.CPU, kind="config_drift_governor",
                    severity=Severity.DEGRADED, source=Source.ANALYZER, device=Device(name="cpu.governor"),
                    message="config drift: cpu.governor = 'powersave', expected 'performance'",
                    attrs={"key": "cpu.governor", "found": "powersave", "expected": "performance", "layer": "policy",
                           "fix": "live", "wanted": "performance"})
    return RoutedFault(event=default_catalog().stamp(ev))


async def config_drift_incident(client, calls: Calls):
    """A config_drift incident (a live-fixable governor) on a record-only close; the handle and its
    status. `test_a_live_config_drift_is_fixed_in_place_without_a_drain` asserts what it did;
    tests/test_policy_replay.py records it."""
    tq, cluster = f"recf-{uuid.uuid4().hex[:8]}", "rec"
    node = f"cfg-{uuid.uuid4().hex[:6]}"
    async with Worker(client, task_queue=tq, workflows=[NodeRemediation], activities=stand_ins(calls)):
        h = await start(client, tq, cluster, node, [drift_fault(cluster, node)], close_after_idle_s=2,
                        close_info_after_s=2)
        st = await assert_eventually(lambda: phase_is(h, "closed"))
        await h.result()
    return h, st


async def test_a_live_config_drift_is_fixed_in_place_without_a_drain(temporal_client) -> None:
    """Issue 25: the agent sets the governor and re-reads it; the incident notes it verified, drains
    nothing and closes; each key is asked once."""
    calls = Calls()
    _h, st = await config_drift_incident(temporal_client, calls)
    assert [r.fixes for r in calls.reconfigures] == [{"cpu.governor": "performance"}]
    assert calls.drains == [] and calls.tickets == [] and st.outcome == "recorded"
    texts = [e["text"] for e in st.timeline]
    assert any(t.startswith("live fix cpu.governor: 'powersave' → 'performance': verified") for t in texts), texts
    assert "live fix verified: the next fingerprint clears the drift; no drain" in texts


async def redelivered_after_close(client, calls: Calls):
    """XID 79 drained; while its diagnostics run, an abort (undrain) and then the same event again (a
    router's redelivery after a crash: same event id). Returns the first run's handle and the calls.
    `test_a_redelivered_event_does_not_reopen_a_closed_incident` asserts what happens;
    tests/test_policy_replay.py records it."""
    calls.diag_gate = asyncio.Event()
    tq, cluster = f"recr-{uuid.uuid4().hex[:8]}", "rec"
    node = f"red-{uuid.uuid4().hex[:6]}"
    f79 = fault(cluster, node, 79, drain=True)
    async with Worker(client, task_queue=tq, workflows=[NodeRemediation], activities=stand_ins(calls)):
        h = await start(client, tq, cluster, node, [f79])
        await assert_eventually(lambda: bool(calls.diags), what="diagnostics running")
        first_run = (await h.describe()).run_id
        await h.execute_update(NodeRemediation.abort, AbortCommand(by="rec@ci", note="done", undrain=True))
        await h.signal(NodeRemediation.faults, FaultBatch(faults=[f79]))  # the redelivery
        calls.diag_gate.set()
        first = client.get_workflow_handle(h.id, run_id=first_run)
        await assert_eventually(lambda: _closed_run(first), what="the first run ended")
        await asyncio.sleep(3)  # a second run, if any, drains by now
    return first, calls


async def _closed_run(handle):
    from temporalio.client import WorkflowExecutionStatus

    d = await handle.describe()
    return d if d.status != WorkflowExecutionStatus.RUNNING else None


async def test_a_redelivered_event_does_not_reopen_a_closed_incident(temporal_client) -> None:
    """Found by a fresh-eyes trial: a router killed after a cordon redelivers the event into the incident
    the guard's reconciliation opened; the operator aborts, and the redelivery (already seen) was carried
    into a new incident that drained the node again. Faults that arrive as an incident closes open the
    next incident only when this one has not seen them."""
    calls = Calls()
    first, calls = await redelivered_after_close(temporal_client, calls)
    d = await first.describe()
    assert d.status.name == "COMPLETED", d.status  # not continued-as-new into a second incident
    assert [op for op, _n in calls.log] == ["drain", "undrain"], calls.log


async def test_abort_while_diagnosing_stops_recovery(temporal_client) -> None:
    """An abort that arrives while the initial diagnostics run: no reboot starts after it (the
    operator's hands are on the node), the node is undrained and the permit given back."""
    calls = Calls()
    _h, st = await abort_while_diagnosing(temporal_client, calls)
    assert st.outcome == "aborted" and not st.drained
    assert calls.recoveries == [], calls.recoveries
    assert [n for op, n in calls.log] and calls.log[-1][0] == "undrain" and calls.releases
    assert any("reboot not started: the incident was aborted" in t["text"] for t in st.timeline)


async def test_the_next_incident_of_a_chain_has_its_own_ticket(temporal_client) -> None:
    """Found on review: faults that arrive as an incident closes open the node's next incident by continuing
    as new, and every run of one chain shares its first run id. The next incident's idempotency key
    (`NodeRemediation._incident_id`) must differ, or its ticket comes back as its predecessor's ("already
    filed") and its notifications are deduplicated away."""
    calls = Calls()
    calls.diag_gate = asyncio.Event()
    tq, cluster = f"next-{uuid.uuid4().hex[:8]}", "nxt"
    node = f"nx-{uuid.uuid4().hex[:6]}"
    async with Worker(temporal_client, task_queue=tq, workflows=[NodeRemediation], activities=stand_ins(calls)):
        h = await start(temporal_client, tq, cluster, node, [fault(cluster, node, 79, drain=True)])
        await assert_eventually(lambda: bool(calls.diags), what="diagnostics running")
        await h.execute_update(NodeRemediation.abort, AbortCommand(by="rec@ci", note="done", undrain=True))
        await h.signal(NodeRemediation.faults, FaultBatch(faults=[fault(cluster, node, 48, drain=True)]))  # new
        calls.diag_gate.set()
        await assert_eventually(lambda: len(calls.drains) >= 2 and calls.tickets, timeout_s=60,
                                what="the next incident drained and ticketed")
    first, second = (d.incident_id for d in calls.drains[:2])
    assert second != first and second == f"{first}#2", (first, second)
    assert calls.tickets[-1].incident_id == second, [t.incident_id for t in calls.tickets]


async def test_a_retest_in_triage_is_refused_and_an_abort_undrain_is_in_the_timeline(env, unique):
    """A re-test in triage was answered "re-test scheduled" and then dropped (nothing is drained there, so
    there is nothing to verify): it is refused with that reason. An abort's undrain is in the timeline like
    the return's (a new user's trial, F20 and F17)."""
    client, tq, calls = env
    h = await start(client, tq, unique, "n7", [fault(unique, "n7", 13, drain=False, severity="degraded")],
                    close_after_idle_s=600)
    await assert_eventually(lambda: phase_is(h, "triage"))
    with pytest.raises(WorkflowUpdateFailedError) as err:
        await h.execute_update(NodeRemediation.force_retest, RetestCommand(by="tester@ci"))
    assert "nothing to verify" in str(err.value.cause)
    h2 = await start(client, tq, unique, "n8", [fault(unique, "n8", 79, drain=True)])
    await assert_eventually(lambda: phase_is(h2, "awaiting_repair"))
    await h2.execute_update(NodeRemediation.abort, AbortCommand(by="bob@ops", note="false alarm", undrain=True))
    st = await assert_eventually(lambda: phase_is(h2, "closed"))
    assert any(e["text"].startswith("undrain: resumed") and e["by"] == "bob@ops" for e in st.timeline), st.timeline
