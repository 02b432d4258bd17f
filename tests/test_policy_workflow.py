"""NodeRemediation's history rules and recovery on the time-skipping test server: debounce windows,
settle periods and idle closes of minutes to hours run in seconds. Activities are the recording
stand-ins (the permit stand-in grants at once; test_fleetguard.py runs the real FleetGuard)."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from temporalio.worker import Worker

from fleetmend.diagnostics import DiagResult, RecoveryOp, RecoveryResult
from fleetmend.events import Component, Device, FaultEvent, Severity, Source, Verdict
from fleetmend.messages import FaultBatch, RepairedCommand, RoutedFault
from tests.activity_standins import Calls, stand_ins
from tests.conftest import assert_eventually
from tests.test_fleetguard import tenv  # noqa: F401 - the module-scoped time-skipping server
from tests.test_workflow import row_reading, start
from workflows.fleetguard import FleetGuard
from workflows.remediation import NodeRemediation

GPU = "0000:3b:00.0"


def ev(cluster: str, node: str, *, kind: str = "xid", code: int | None = None, drain: bool = False,
       severity: str = "degraded", action: str = "RESTART_APP", component: Component = Component.GPU,
       device: Device | None = None, healthy: bool = False, clearable: bool = False) -> RoutedFault:
    fc = f"xid{code}" if kind == "xid" else kind
    v = Verdict(severity="info" if healthy else severity, immediate_action=action, fault_class=fc,
                drain=drain and not healthy, clearable=clearable, **row_reading(kind, code))
    return RoutedFault(event=FaultEvent(cluster=cluster, node=node, component=component, kind=kind, code=code,
                                        severity=Severity(severity), source=Source.KMSG,
                                        device=device or Device(pci_bus_id=GPU),
                                        message=f"{kind} {code or ''}".strip(), healthy=healthy, verdict=v))


@pytest.fixture
async def wenv(tenv):  # noqa: F811
    calls = Calls()
    tq = f"pw-{uuid.uuid4().hex[:8]}"
    async with Worker(tenv.client, task_queue=tq, workflows=[NodeRemediation, FleetGuard],
                      activities=stand_ins(calls)):
        yield tenv, tq, calls, f"c{uuid.uuid4().hex[:8]}"


async def phase(h, want: str):
    st = await h.query(NodeRemediation.status)
    return st if st.phase == want else None


async def test_link_fault_that_clears_within_the_debounce_window_drains_nothing(wenv):
    env, tq, calls, c = wenv
    ib = dict(kind="ib_port_down", component=Component.IB, device=Device(name="mlx5_0", port=1))
    h = await start(env.client, tq, c, "d1", [ev(c, "d1", drain=True, severity="fatal", action="DRAIN_DIAGNOSE",
                                                  clearable=True, **ib)], debounce_s=30, close_after_idle_s=600)
    st = await assert_eventually(lambda: phase(h, "triage"))
    await h.signal(NodeRemediation.faults, FaultBatch(faults=[ev(c, "d1", healthy=True, clearable=True, **ib)]))
    await env.sleep(timedelta(seconds=700))  # the debounce window, then the idle close
    st = await h.result()
    assert st.outcome == "recorded" and calls.drains == [] and calls.permits == []
    assert any("waiting 30s for a clearing event" in d for d in st.decisions)


async def test_link_fault_that_stays_down_drains_after_the_debounce_window(wenv):
    env, tq, calls, c = wenv
    h = await start(env.client, tq, c, "d2", [ev(c, "d2", kind="ib_port_down", component=Component.IB,
                                                  device=Device(name="mlx5_0", port=1), drain=True, severity="fatal",
                                                  action="DRAIN_DIAGNOSE", clearable=True)], debounce_s=30)
    await assert_eventually(lambda: phase(h, "triage"))
    assert calls.drains == []
    await env.sleep(timedelta(seconds=31))
    await assert_eventually(lambda: phase(h, "awaiting_repair"), what="drained after the window")
    assert [d.node for d in calls.drains] == ["d2"] and len(calls.permits) == 1
    assert calls.diags[0].checks is None, "initial diagnostics run every QUICK check"


def _flap(c: str, node: str, states: str) -> list[RoutedFault]:
    """A link's states in arrival order: 'D' = Link DOWN, 'U' = ACTIVE again (the clearing event)."""
    ib = dict(kind="ib_port_down", component=Component.IB, device=Device(name="mlx5_0", port=1), clearable=True)
    return [ev(c, node, healthy=True, **ib) if x == "U" else
            ev(c, node, drain=True, severity="fatal", action="DRAIN_DIAGNOSE", **ib) for x in states]


@pytest.mark.parametrize("one_batch", [True, False], ids=["one-batch", "signal-each"])
async def test_flapping_link_that_ends_down_drains_after_the_debounce_window(wenv, one_batch):
    """DOWN, UP, DOWN: the last word is DOWN. Before patch `arrival-order` the second DOWN merged into
    the first record, which the UP (later in the list) then 'cleared', and the node was never drained."""
    env, tq, calls, c = wenv
    flaps = _flap(c, "f1", "DUD")
    h = await start(env.client, tq, c, "f1", flaps if one_batch else flaps[:1], debounce_s=30,
                    close_after_idle_s=600)
    if not one_batch:
        for rf in flaps[1:]:
            await assert_eventually(lambda: phase(h, "triage"))
            await h.signal(NodeRemediation.faults, FaultBatch(faults=[rf]))
    await env.sleep(timedelta(seconds=31))
    st = await assert_eventually(lambda: phase(h, "awaiting_repair"), what="drained after the window")
    assert [d.node for d in calls.drains] == ["f1"]
    down = next(f for f in st.faults if not f["healthy"])
    assert down["count"] == 2 and [f["count"] for f in st.faults if f["healthy"]] == [1]


async def test_flapping_link_that_ends_up_drains_nothing(wenv):
    env, tq, calls, c = wenv
    h = await start(env.client, tq, c, "f2", _flap(c, "f2", "DUDU"), debounce_s=30, close_after_idle_s=600)
    await env.sleep(timedelta(seconds=700))
    st = await h.result()
    assert st.outcome == "recorded" and calls.drains == []


async def test_collapsed_repeats_count_every_new_id_once(wenv):
    """The router's collapsed form (one RoutedFault with `repeats`) counts and de-duplicates each
    occurrence as if it had come alone, including ids seen before and ids repeated in the batch."""
    from fleetmend.messages import Occurrence

    env, tq, calls, c = wenv
    first = ev(c, "k1", code=13)
    h = await start(env.client, tq, c, "k1", [first], close_after_idle_s=3600, app_xid_repeats=100)
    await assert_eventually(lambda: phase(h, "triage"))
    more = ev(c, "k1", code=13)
    more.repeats = [Occurrence(event_id=first.event.event_id, observed_at=first.event.observed_at),  # seen
                    Occurrence(event_id="r-1", observed_at=more.event.observed_at),
                    Occurrence(event_id="r-1", observed_at=more.event.observed_at),  # twice in the batch
                    Occurrence(event_id="r-2", observed_at=more.event.observed_at)]
    await h.signal(NodeRemediation.faults, FaultBatch(faults=[more]))

    async def counted():
        st = await h.query(NodeRemediation.status)
        return st if st.faults and st.faults[0]["count"] == 4 else None

    st = await assert_eventually(counted, what="4 distinct occurrences")
    assert len(st.faults) == 1 and len(st.faults[0]["times"]) == 4 and st.duplicates == 2
    assert calls.drains == []


async def test_repeating_xid13_on_one_gpu_becomes_a_hardware_suspect(wenv):
    env, tq, calls, c = wenv
    h = await start(env.client, tq, c, "a1", [ev(c, "a1", code=13)], app_xid_repeats=3, close_after_idle_s=3600)
    for _ in range(2):
        await assert_eventually(lambda: phase(h, "triage"))
        assert calls.drains == []
        await h.signal(NodeRemediation.faults, FaultBatch(faults=[ev(c, "a1", code=13)]))
    st = await assert_eventually(lambda: phase(h, "awaiting_repair"), what="drained on the third XID 13")
    assert any("XID 13 3× on GPU" in d and "hardware suspect" in d for d in st.decisions)
    assert [d.node for d in calls.drains] == ["a1"] and len(calls.tickets) == 1
    assert calls.recoveries == [], "an application-XID suspect is diagnosed and ticketed, not reset"


async def test_xid48_with_63_resets_the_gpu_settles_verifies_and_returns_without_a_ticket(wenv):
    env, tq, calls, c = wenv
    calls.recovery_results = [RecoveryResult.APPLIED]
    calls.diag_results = [DiagResult.FAIL, DiagResult.PASS]  # initial diagnostics fail; after the reset pass
    h = await start(env.client, tq, c, "r1", [ev(c, "r1", code=48, drain=True, severity="fatal",
                                                  action="WORKFLOW_XID_48"), ev(c, "r1", code=63, action="IGNORE")],
                    recovery_settle_s=120)
    await assert_eventually(lambda: _recovered_once(calls), what="reset applied")
    await env.sleep(timedelta(seconds=130))  # the settle period
    st = await h.result()
    assert st.outcome == "returned_to_service" and not st.drained
    assert [r.op for r in calls.recoveries] == [RecoveryOp.RESET_GPU] and calls.recoveries[0].pci_bus_id == GPU
    assert calls.tickets == [] and len(calls.undrains) == 1 and len(calls.releases) == 1
    assert calls.releases[0].returned and calls.releases[0].outcome == "returned_to_service"
    assert "remapped_rows_pending" in (calls.diags[-1].checks or []), "ECC fault → memory/remap verification"
    assert any("recovered by reset_gpu" in line for line in st.recovery_log)


async def test_a_repeat_part_goes_to_rma_without_a_recovery_loop(wenv):
    """Patch repeat-part: the drain's result names a part that came back unchanged and failed again (the
    incident ledger's `repeat_part`): no GPU reset or reboot, an RMA ticket, a lemon notification."""
    env, tq, calls, c = wenv
    calls.repeat_part = "repeat part: the same device failed with gsp_error 1 time(s) within 30 days (last on r9)"
    h = await start(env.client, tq, c, "r9", [ev(c, "r9", kind="gsp_error", drain=True, severity="fatal",
                                                  action="RESET_GPU")])
    st = await assert_eventually(lambda: phase(h, "awaiting_repair"), what="RMA ticket filed")
    assert calls.recoveries == [] and st.lemon == calls.repeat_part
    assert calls.tickets[0].title.startswith("[fleetmend] RMA r9") and calls.tickets[0].evidence["lemon"]
    assert [n.event.value for n in calls.notifications if n.event.value == "lemon"] == ["lemon"]


async def test_refused_reset_then_dry_run_reboot_escalates_to_a_ticket(wenv):
    env, tq, calls, c = wenv
    calls.recovery_results = [RecoveryResult.REFUSED, RecoveryResult.DRY_RUN]
    h = await start(env.client, tq, c, "r2", [ev(c, "r2", kind="gsp_error", drain=True, severity="fatal",
                                                  action="RESET_GPU")])
    st = await assert_eventually(lambda: phase(h, "awaiting_repair"), what="ticket filed")
    assert [r.op for r in calls.recoveries] == [RecoveryOp.RESET_GPU, RecoveryOp.REBOOT]
    assert len(calls.tickets) == 1 and calls.tickets[0].evidence["recovery"]
    # nothing was applied (refused, then a dry run): said as it is, not "did not hold"
    assert any("no recovery was applied (reset_gpu refused, reboot dry_run); escalating to a ticket" in line
               for line in st.recovery_log), st.recovery_log
    assert not any("did not hold" in line for line in st.recovery_log)


async def test_reset_that_does_not_hold_during_settle_escalates(wenv):
    env, tq, calls, c = wenv
    calls.recovery_results = [RecoveryResult.APPLIED, RecoveryResult.DRY_RUN]
    h = await start(env.client, tq, c, "r3", [ev(c, "r3", code=74, drain=True, severity="fatal",
                                                  action="WORKFLOW_NVLINK_ERR", component=Component.NVLINK)],
                    recovery_settle_s=600)
    await assert_eventually(lambda: _recovered_once(calls), what="reset applied")
    await h.signal(NodeRemediation.faults, FaultBatch(faults=[ev(c, "r3", code=74, drain=True, severity="fatal",
                                                                 action="WORKFLOW_NVLINK_ERR",
                                                                 device=Device(pci_bus_id="0000:5e:00.0"))]))
    st = await assert_eventually(lambda: phase(h, "awaiting_repair"), what="escalated")
    assert any("did not hold: a new drain-worthy fault while settling" in line for line in st.recovery_log)
    assert len(calls.tickets) == 1
    await h.execute_update(NodeRemediation.mark_repaired, RepairedCommand(by="alice@ops"))
    st = await h.result()
    assert st.outcome == "returned_to_service"
    assert "dcgm_diag" in (calls.diags[-1].checks or []), "NVLink fault → DCGM (NVLink) verification"


async def _recovered_once(calls: Calls) -> bool:
    return len(calls.recoveries) == 1


async def test_pending_row_remap_drains_when_idle(wenv):
    env, tq, calls, c = wenv
    h = await start(env.client, tq, c, "s1", [ev(c, "s1", code=63, action="IGNORE")])
    st = await assert_eventually(lambda: phase(h, "awaiting_repair"))
    assert "drain when idle" in calls.drains[0].reason
    assert any("row remap pending" in d for d in st.decisions)


async def test_ticket_status_is_a_source_of_repaired(wenv):
    """While awaiting repair the workflow polls the ticket; when the ticket system says Done, the node
    is verified and returned as if `fleetmend repaired` had been sent (by "ticket:<id>")."""
    env, tq, calls, c = wenv
    h = await start(env.client, tq, c, "tp1", [ev(c, "tp1", code=79, drain=True, severity="fatal",
                                                   action="RESTART_BM")],
                    ticket_poll_s=900, repair_escalation_s=86400, recovery_settle_s=0)
    await assert_eventually(lambda: phase(h, "awaiting_repair"))
    await env.sleep(timedelta(seconds=1000))  # one poll: still open
    await assert_eventually(lambda: len(calls.polls) >= 1, what="first poll")
    st = await h.query(NodeRemediation.status)
    assert st.phase == "awaiting_repair"
    calls.ticket_status = "Done"
    await env.sleep(timedelta(seconds=1000))
    st = await h.result()
    assert st.outcome == "returned_to_service" and len(calls.undrains) == 1
    assert any(e.get("by") == f"ticket:{st.ticket}" for e in st.timeline)


async def test_info_only_incident_closes_after_the_short_quiet_time(wenv):
    """An incident holding only info readings (an agent's nvml_unavailable, a cleared link) closes
    after close_info_after_s, not the hour that application faults wait."""
    env, tq, calls, c = wenv
    h = await start(env.client, tq, c, "i1", [ev(c, "i1", kind="nvml_unavailable", severity="info",
                                                 action="IGNORE", component=Component.AGENT)],
                    close_after_idle_s=3600, close_info_after_s=300)
    await assert_eventually(lambda: phase(h, "triage"))
    await env.sleep(timedelta(seconds=400))
    st = await h.result()
    assert st.outcome == "recorded" and calls.drains == []
    from datetime import datetime

    open_s = (datetime.fromisoformat(st.closed_at) - datetime.fromisoformat(st.opened_at)).total_seconds()
    assert open_s < 1000, f"closed after {open_s:.0f}s, not after the 300s quiet time"
