"""Replay recorded `NodeRemediation` and `FleetGuard` histories against today's workflow code.

`tests/histories/*.json` are the 0.2 baseline, recorded once from real runs on the Temporal dev server
and NATS with the code that folded every earlier patch and made the permit pool the one drain path
(nothing was deployed before it). A change to a workflow's command sequence must keep them replaying:
guard it with `workflow.patched(<id>)` (ids listed in the workflow's module docstring) and add a
history recorded *before* the change (add a scenario below, run `FLEETMEND_RECORD_HISTORIES=1 pytest
tests/test_policy_replay.py tests/test_permit_pool.py -k "record or adopts"` on the old code; existing
files are never overwritten).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer, Worker

from fleetmend.infra.converter import data_converter
from fleetmend.messages import AbortCommand, FaultBatch, GuardCommand, GuardPolicy, RepairedCommand
from tests.activity_standins import GUARD_ACTIVITIES, Calls, guard_activities, real_guard, stand_ins
from tests.conftest import assert_eventually
from workflows.fleetguard import FleetGuard
from workflows.remediation import NodeRemediation

HISTORIES = Path(__file__).parent / "histories"
RECORD = os.environ.get("FLEETMEND_RECORD_HISTORIES") == "1"
BASELINE = {
    "remediation_fatal_returned", "remediation_app_fault_recorded", "remediation_abort_in_triage",
    "remediation_reset_returned", "remediation_abort_awaiting_repair", "remediation_flap_ends_down",
    "remediation_second_batch_in_triage", "remediation_future_app_xid_recorded", "remediation_many_pending_faults",
    "remediation_lemon_returned", "remediation_storm_bytes", "remediation_abort_while_diagnosing",
    "fleetguard_breaker", "fleetguard_pause", "fleetguard_reask_after_reset",
    "fleetguard_pool",  # adoptions, pause, breaker, a forwarded request (tests/test_permit_pool.py records it)
    "remediation_redelivered_after_close",  # before patch close-drops-seen
    "remediation_config_drift_recorded",  # before patch live-fix
    "fleetguard_fail_slow_rack",  # before the analyzer's domain findings reached the guard (issue 28)
    "remediation_attention_recorded",  # before patch attention: a cabling fault recorded, nobody notified
}


def recorded() -> list[Path]:
    return sorted(HISTORIES.glob("*.json"))


@pytest.mark.parametrize("path", recorded(), ids=lambda p: p.stem)
async def test_recorded_history_replays(path: Path) -> None:
    history = WorkflowHistory.from_json(f"replay/{path.stem}", path.read_text())
    replayer = Replayer(workflows=[NodeRemediation, FleetGuard], data_converter=data_converter)
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert result.replay_failure is None, f"{path.name} no longer replays: {result.replay_failure!r}"


def test_histories_are_present() -> None:
    assert BASELINE <= {p.stem for p in recorded()}


def _write(name: str, history) -> None:
    """Histories are never overwritten: an old one is the contract that running incidents hold us to."""
    path = HISTORIES / f"{name}.json"
    if not path.exists():
        path.write_text(history.to_json())


@pytest.mark.skipif(not RECORD, reason="set FLEETMEND_RECORD_HISTORIES=1 to re-record histories")
async def test_record_histories(temporal_client, nc) -> None:
    from fleetmend.diagnostics import RecoveryResult
    from tests.test_policy_workflow import _flap, ev
    from tests.test_workflow import fault, phase_is, start

    client, calls = temporal_client, Calls()
    tq = f"rec-{uuid.uuid4().hex[:8]}"
    cluster = "rec"
    async with Worker(client, task_queue=tq, workflows=[NodeRemediation], activities=stand_ins(calls)):
        sfx = uuid.uuid4().hex[:6]
        h1 = await start(client, tq, cluster, f"fatal-{sfx}", [fault(cluster, f"fatal-{sfx}", 79, drain=True)])
        await assert_eventually(lambda: phase_is(h1, "awaiting_repair"))
        await h1.execute_update(NodeRemediation.mark_repaired, RepairedCommand(by="rec@ci", ticket="RMA-1"))
        await assert_eventually(lambda: phase_is(h1, "closed"))

        h2 = await start(client, tq, cluster, f"app-{sfx}", [fault(cluster, f"app-{sfx}", 13, drain=False,
                                                                   severity="degraded")], close_after_idle_s=2)
        await assert_eventually(lambda: phase_is(h2, "closed"))

        h3 = await start(client, tq, cluster, f"abort-{sfx}", [fault(cluster, f"abort-{sfx}", 31, drain=False,
                                                                     severity="degraded")])
        await assert_eventually(lambda: phase_is(h3, "triage"))
        await h3.execute_update(NodeRemediation.abort, AbortCommand(by="rec@ci", note="test", undrain=True))
        await assert_eventually(lambda: phase_is(h3, "closed"))

        calls.recovery_results = [RecoveryResult.APPLIED]
        h4 = await start(client, tq, cluster, f"rst-{sfx}", [ev(cluster, f"rst-{sfx}", code=48, drain=True,
                                                                severity="fatal", action="WORKFLOW_XID_48"),
                                                             ev(cluster, f"rst-{sfx}", code=63, action="IGNORE")],
                         recovery_settle_s=1)
        await assert_eventually(lambda: phase_is(h4, "closed"))

        h5 = await start(client, tq, cluster, f"abr-{sfx}", [fault(cluster, f"abr-{sfx}", 79, drain=True)])
        await assert_eventually(lambda: phase_is(h5, "awaiting_repair"))
        await h5.execute_update(NodeRemediation.abort, AbortCommand(by="rec@ci", note="test", undrain=True))
        await assert_eventually(lambda: phase_is(h5, "closed"))

        # A flapping link DOWN, UP, DOWN in one batch: the last word is DOWN, it drains after the debounce.
        h6 = await start(client, tq, cluster, f"flp-{sfx}", _flap(cluster, f"flp-{sfx}", "DUD"), debounce_s=1,
                         close_after_idle_s=2)
        await assert_eventually(lambda: phase_is(h6, "awaiting_repair"))
        await h6.execute_update(NodeRemediation.abort, AbortCommand(by="rec@ci", note="test"))
        await assert_eventually(lambda: phase_is(h6, "closed"))

        # A second batch of faults while in triage (search attributes upserted only on a change).
        h7 = await start(client, tq, cluster, f"two-{sfx}", [fault(cluster, f"two-{sfx}", 13, drain=False,
                                                                   severity="degraded")],
                         close_after_idle_s=3, app_xid_repeats=100)
        await assert_eventually(lambda: phase_is(h7, "triage"))
        await h7.signal(NodeRemediation.faults, FaultBatch(faults=[fault(cluster, f"two-{sfx}", 13, drain=False,
                                                                         severity="degraded")]))
        await assert_eventually(lambda: phase_is(h7, "closed"))

        # Three XID 13 on one GPU dated three years ahead: not "recent", recorded only.
        from datetime import timedelta

        from fleetmend.events import utcnow

        ahead = utcnow() + timedelta(days=3 * 365)
        future = [fault(cluster, f"fut-{sfx}", 13, drain=False, severity="degraded") for _ in range(3)]
        import dataclasses

        future = [dataclasses.replace(f, event=f.event.model_copy(update={"observed_at": ahead})) for f in future]
        h8 = await start(client, tq, cluster, f"fut-{sfx}", future, close_after_idle_s=2)
        await assert_eventually(lambda: _phase_in(h8, ("awaiting_repair", "closed")))
        if (await h8.query(NodeRemediation.status)).phase != "closed":
            await h8.execute_update(NodeRemediation.abort, AbortCommand(by="rec@ci", note="test"))
        await assert_eventually(lambda: phase_is(h8, "closed"))

        # 250 distinct conditions in one signal (the workflow bounds its waiting faults).
        many = [dataclasses.replace(fault(cluster, f"many-{sfx}", 13, drain=False, severity="degraded"))
                for _ in range(250)]
        many = [dataclasses.replace(f, event=f.event.model_copy(update={"device": f.event.device.model_copy(
            update={"pci_bus_id": f"0000:{i // 200:02x}:{i % 200:02x}.0"})})) for i, f in enumerate(many)]
        h9 = await start(client, tq, cluster, f"many-{sfx}", many, close_after_idle_s=2, app_xid_repeats=100)
        await assert_eventually(lambda: phase_is(h9, "closed"), timeout_s=60)


        # A lemon node (the guard says so): straight to an RMA ticket, repaired, returned.
        calls.lemon = f"lemon: lem-{sfx} back with xid79 after 2 repairs"
        h10 = await start(client, tq, cluster, f"lem-{sfx}", [fault(cluster, f"lem-{sfx}", 79, drain=True)])
        await assert_eventually(lambda: phase_is(h10, "awaiting_repair"))
        calls.lemon = None
        await h10.execute_update(NodeRemediation.mark_repaired, RepairedCommand(by="rec@ci", ticket="RMA-9"))
        await assert_eventually(lambda: phase_is(h10, "closed"))

        for name, h in (("remediation_lemon_returned", h10), ("remediation_fatal_returned", h1),
                        ("remediation_app_fault_recorded", h2),
                        ("remediation_abort_in_triage", h3), ("remediation_reset_returned", h4),
                        ("remediation_abort_awaiting_repair", h5), ("remediation_flap_ends_down", h6),
                        ("remediation_second_batch_in_triage", h7), ("remediation_future_app_xid_recorded", h8),
                        ("remediation_many_pending_faults", h9)):
            await h.result()
            _write(name, await h.fetch_history())
    await _record_guard(client, nc.jetstream())
    await _record_guard_pause(client, nc.jetstream())


@pytest.mark.skipif(not RECORD, reason="set FLEETMEND_RECORD_HISTORIES=1 to re-record histories")
async def test_record_reask_after_reset(temporal_client, nc) -> None:
    """Queued nodes asking again after a breaker reset (a re-ask is not a new fault)."""
    from tests.test_breaker_reask import reask_after_reset

    history, _reset, _st = await reask_after_reset(temporal_client, nc.jetstream())
    _write("fleetguard_reask_after_reset", history)


@pytest.mark.skipif(not RECORD, reason="set FLEETMEND_RECORD_HISTORIES=1 to re-record histories")
async def test_record_abort_while_diagnosing(temporal_client) -> None:
    """An abort that arrives while the initial diagnostics run (no reboot after it)."""
    from tests.test_workflow import abort_while_diagnosing

    h, _st = await abort_while_diagnosing(temporal_client, Calls())
    _write("remediation_abort_while_diagnosing", await h.fetch_history())



@pytest.mark.skipif(not RECORD, reason="set FLEETMEND_RECORD_HISTORIES=1 to re-record histories")
async def test_record_redelivered_after_close(temporal_client) -> None:
    """A redelivered event (already seen) arriving as the incident closes (recorded before patch
    close-drops-seen: the run continued as new into a second incident that drained the node again)."""
    from tests.test_workflow import redelivered_after_close

    first, _calls = await redelivered_after_close(temporal_client, Calls())
    _write("remediation_redelivered_after_close", await first.fetch_history())


@pytest.mark.skipif(not RECORD, reason="set FLEETMEND_RECORD_HISTORIES=1 to re-record histories")
async def test_record_config_drift(temporal_client) -> None:
    """A config_drift incident with a live-fixable key (recorded before patch live-fix: recorded only)."""
    from tests.test_workflow import config_drift_incident

    h, _st = await config_drift_incident(temporal_client, Calls())
    _write("remediation_config_drift_recorded", await h.fetch_history())


@pytest.mark.skipif(not RECORD, reason="set FLEETMEND_RECORD_HISTORIES=1 to re-record histories")
async def test_record_attention(temporal_client) -> None:
    """A degraded fault that only a person can act on (CHECK_MECHANICALS), recorded with notifications on and
    closed after 1 s quiet (recorded before patch attention: nobody was notified)."""
    from fleetmend.events import Component, Device, FaultEvent, Severity, Source, Verdict
    from fleetmend.messages import RoutedFault
    from tests.test_workflow import row_reading, start

    cluster = f"att-{uuid.uuid4().hex[:6]}"
    ev = FaultEvent(cluster=cluster, node="t1", component=Component.PCIE, kind="config_drift_topology_repair",
                    severity=Severity.DEGRADED, source=Source.ANALYZER, device=Device(name="topology.hash"),
                    raw="topology.hash before=ab12 after=cd34", message="GPU to NIC placement moved across a repair",
                    verdict=Verdict(severity="degraded", immediate_action="CHECK_MECHANICALS",
                                    fault_class="config_drift_topology_repair", drain=False,
                                    **row_reading("config_drift_topology_repair")))
    calls, tq = Calls(), f"reca-{uuid.uuid4().hex[:8]}"
    async with Worker(temporal_client, task_queue=tq, workflows=[NodeRemediation], activities=stand_ins(calls)):
        h = await start(temporal_client, tq, cluster, "t1", [RoutedFault(event=ev)], close_after_idle_s=1.0,
                        notify=True)
        await h.result()
        _write("remediation_attention_recorded", await h.fetch_history())


@pytest.mark.skipif(not RECORD, reason="set FLEETMEND_RECORD_HISTORIES=1 to re-record histories")
async def test_record_storm_bytes(temporal_client) -> None:
    """A record-only incident absorbing ~2.7 × `MAX_RUN_BYTES` of faults (it continues as new by bytes)."""
    from tests.test_workflow_run_bytes import send_storm

    calls, tq = Calls(), f"recs-{uuid.uuid4().hex[:8]}"
    async with Worker(temporal_client, task_queue=tq, workflows=[NodeRemediation], activities=stand_ins(calls)):
        h, _ = await send_storm(temporal_client, tq, "rec", f"sb-{uuid.uuid4().hex[:6]}")
        await h.result()
        _write("remediation_storm_bytes", await h.fetch_history())


async def _phase_in(h, phases: tuple[str, ...]):
    st = await h.query(NodeRemediation.status)
    return st if st.phase in phases else None


async def _record_guard(client, js) -> None:
    from fleetmend import subjects
    from tests.test_workflow import fault, phase_is, start

    calls, tq, cluster = Calls(), f"recg-{uuid.uuid4().hex[:8]}", f"recg{uuid.uuid4().hex[:6]}"
    guard = real_guard(client, tq, GuardPolicy(max_drained_nodes=1, breaker_distinct_nodes=2), js)
    tq = subjects.cluster_task_queue(tq, cluster)  # the cluster's queue: its incidents and its guard
    acts = [a for a in stand_ins(calls) if a.__name__ not in GUARD_ACTIVITIES]
    async with Worker(client, task_queue=tq, workflows=[NodeRemediation, FleetGuard],
                      activities=acts + guard_activities(guard, calls)):
        g1 = await start(client, tq, cluster, "g1", [fault(cluster, "g1", 79, drain=True)])
        await assert_eventually(lambda: phase_is(g1, "awaiting_repair"))
        g2 = await start(client, tq, cluster, "g2", [fault(cluster, "g2", 79, drain=True)])
        await assert_eventually(lambda: phase_is(g2, "awaiting_permit"))
        g3 = await start(client, tq, cluster, "g3", [fault(cluster, "g3", 79, drain=True)])
        await assert_eventually(lambda: phase_is(g3, "awaiting_permit"))  # 3 nodes > 2: breaker trips
        gh = client.get_workflow_handle_for(FleetGuard.run, subjects.fleetguard_workflow_id(cluster))

        async def tripped():
            st = await gh.query(FleetGuard.status)
            return st if st.breaker_tripped else None

        await assert_eventually(tripped, what="the breaker tripped")
        await gh.execute_update(FleetGuard.reset_breaker, GuardCommand(by="rec@ci"))
        await g1.execute_update(NodeRemediation.mark_repaired, RepairedCommand(by="rec@ci"))
        await assert_eventually(lambda: phase_is(g2, "awaiting_repair"))
        await g3.execute_update(NodeRemediation.abort, AbortCommand(by="rec@ci", note="test"))
        await assert_eventually(lambda: phase_is(g3, "closed"))
        await g2.execute_update(NodeRemediation.mark_repaired, RepairedCommand(by="rec@ci"))
        await assert_eventually(lambda: phase_is(g2, "closed"))
        _write("fleetguard_breaker", await gh.fetch_history())


async def _record_guard_pause(client, js) -> None:
    """A pause and a resume by hand while a node holds a permit."""
    from fleetmend import subjects
    from tests.test_workflow import fault, phase_is, start

    calls, tq, cluster = Calls(), f"recp-{uuid.uuid4().hex[:8]}", f"recp{uuid.uuid4().hex[:6]}"
    guard = real_guard(client, tq, GuardPolicy(cluster_nodes=100), js)
    tq = subjects.cluster_task_queue(tq, cluster)  # the cluster's queue: its incidents and its guard
    acts = [a for a in stand_ins(calls) if a.__name__ not in GUARD_ACTIVITIES]
    async with Worker(client, task_queue=tq, workflows=[NodeRemediation, FleetGuard],
                      activities=acts + guard_activities(guard, calls)):
        p1 = await start(client, tq, cluster, "p1", [fault(cluster, "p1", 79, drain=True)])
        await assert_eventually(lambda: phase_is(p1, "awaiting_repair"))
        gh = client.get_workflow_handle(subjects.fleetguard_workflow_id(cluster))
        await gh.execute_update(FleetGuard.pause, GuardCommand(by="rec@ci", note="maintenance"))
        await asyncio.sleep(1.0)
        await gh.execute_update(FleetGuard.resume, GuardCommand(by="rec@ci"))
        await p1.execute_update(NodeRemediation.mark_repaired, RepairedCommand(by="rec@ci"))
        await assert_eventually(lambda: phase_is(p1, "closed"))
        await asyncio.sleep(1.0)
        _write("fleetguard_pause", await gh.fetch_history())


@pytest.mark.skipif(not RECORD, reason="set FLEETMEND_RECORD_HISTORIES=1 to re-record histories")
async def test_record_guard_fail_slow_rack(temporal_client, nc) -> None:
    """Before patch analyzer-domains (issue 28): fail_slow incidents of three nodes of one rack open the
    topology's infrastructure incident (the third and fourth denied), one elsewhere is granted."""
    await _record_guard_fail_slow_rack(temporal_client, nc.jetstream())


def fail_slow_fault(cluster: str, node: str):
    """A `fail_slow` fault as the router hands it to the incident (the catalog's row)."""
    from fleetmend.events import Component, FaultEvent, Severity, Source, Verdict
    from fleetmend.messages import RoutedFault
    from tests.test_workflow import row_reading

    ev = FaultEvent(cluster=cluster, node=node, component=Component.GPU, kind="fail_slow", severity=Severity.DEGRADED,
                    source=Source.ANALYZER, message="fail-slow: SM clock / max 0.93 vs peer median 0.98",
                    raw="fail-slow", attrs={"metric": "sm_clock_ratio"},
                    verdict=Verdict(severity="degraded", immediate_action="DRAIN_DIAGNOSE", fault_class="fail_slow",
                                    drain=True, **row_reading("fail_slow")))
    return RoutedFault(event=ev)


async def _record_guard_fail_slow_rack(client, js) -> None:
    from fleetmend import subjects
    from fleetmend.policy import FailureDomain, Topology
    from tests.test_workflow import phase_is, start

    calls, tq, cluster = Calls(), f"recd-{uuid.uuid4().hex[:8]}", f"recd{uuid.uuid4().hex[:6]}"
    topo = Topology({**{n: FailureDomain(rack="r1") for n in ("a", "b", "c", "d")}, "e": FailureDomain(rack="r2")})
    policy = GuardPolicy(max_drained_nodes=10, max_drained_percent=100.0, max_drained_per_rack=4,
                         domain_incident_nodes=3, domain_window_s=300, breaker_distinct_nodes=50)
    guard = real_guard(client, tq, policy, js, topo)
    acts = [a for a in stand_ins(calls) if a.__name__ not in GUARD_ACTIVITIES]
    async with Worker(client, task_queue=tq, workflows=[NodeRemediation, FleetGuard],
                      activities=acts + guard_activities(guard, calls)):
        hs = {}
        for n in ("a", "b", "c", "d", "e"):
            hs[n] = await start(client, tq, cluster, n, [fail_slow_fault(cluster, n)])
            await assert_eventually(lambda n=n: _phase_in(hs[n], ("awaiting_repair", "closed")), what=f"{n} decided")
        for n in ("a", "b", "e"):
            await hs[n].execute_update(NodeRemediation.abort, AbortCommand(by="rec@ci", note="test", undrain=True))
            await assert_eventually(lambda n=n: phase_is(hs[n], "closed"))
        await asyncio.sleep(1.0)
        gh = client.get_workflow_handle(subjects.fleetguard_workflow_id(cluster))
        _write("fleetguard_fail_slow_rack", await gh.fetch_history())


def test_guard_state_of_string_era_decodes_typed() -> None:
    """A guard state carried (continue-as-new) and requests sent before the state was typed held times as
    ISO strings and severities/outcomes as strings: they decode into today's `datetime`s and enums, and
    encode back to the same strings."""
    from datetime import UTC, datetime

    from fleetmend.events import Severity
    from fleetmend.messages import GuardState, Outcome, PermitRelease, PermitRequest

    old = {"cluster": "c", "held": [{"node": "n1", "severity": "fatal", "fault_class": "gpu_lost", "rack": "r1",
                                      "granted_at": "2026-11-30T18:33:31+00:00"}],
           "queue": [{"node": "n2", "severity": "degraded", "fault_class": "ecc", "rack": None, "domains": ["rack:r2"],
                      "requested_at": "2026-11-30T18:33:32+00:00", "reason": ""}],
           "recent": [["n1", "2026-11-30T18:33:31+00:00"]], "breaker_tripped_at": "2026-11-30T18:34:00+00:00",
           "infra": [{"domain": "rack:r2", "opened_at": "2026-11-30T18:33:40+00:00",
                      "last_fault_at": "2026-11-30T18:33:41+00:00", "nodes": ["n2"], "ticket": None, "closed_at": None}],
           "returns": {"n1": [["gpu_lost", "2026-11-29T10:00:00+00:00"]]}}
    conv = data_converter.payload_converter
    [payload] = conv.to_payloads([old])
    s = conv.from_payloads([payload], [GuardState])[0]
    at = datetime(2026, 11, 30, 18, 33, 31, tzinfo=UTC)
    assert s.held[0].severity is Severity.FATAL and s.held[0].granted_at == at
    assert s.queue[0].severity is Severity.DEGRADED
    assert s.recent == [("n1", at)] and s.returns["n1"][0][1] == datetime(2026, 11, 29, 10, tzinfo=UTC)
    assert s.infra[0].opened_at < s.infra[0].last_fault_at and s.breaker_tripped_at > at
    assert s.held[0].to_dict()["granted_at"] == "2026-11-30T18:33:31+00:00"
    assert s.queue[0].to_dict()["severity"] == "degraded"
    [payload] = conv.to_payloads([{"cluster": "c", "node": "n", "severity": "fatal", "fault_class": "x",
                                   "requested_at": "2026-11-30T18:33:31+00:00"}])
    req = conv.from_payloads([payload], [PermitRequest])[0]
    assert req.severity is Severity.FATAL and req.requested_at == at
    [payload] = conv.to_payloads([{"cluster": "c", "node": "n", "outcome": "returned_to_service"}])
    assert conv.from_payloads([payload], [PermitRelease])[0].outcome is Outcome.RETURNED
    again = conv.from_payloads(conv.to_payloads([s]), [GuardState])[0]
    assert again == s
