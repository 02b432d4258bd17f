"""Stand-ins for the worker's activities under their real names; they record every call so
workflow tests assert outcomes (drains issued, tickets filed) rather than implementation."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from temporalio import activity

from activities.quarantine import PooledDrainActivities
from fleetmend import subjects
from fleetmend.diagnostics import CheckResult, DiagLevel, DiagReport, DiagResult, RecoveryReport, RecoveryResult
from fleetmend.fingerprint import FixResult, ReconfigureReport, ReconfigureRequest
from fleetmend.messages import (
    DiagActivityRequest,
    DrainRequest,
    DrainResult,
    Notification,
    NotifyResult,
    PermitDecision,
    PermitRelease,
    PermitRequest,
    RecoveryActivityRequest,
    TicketRef,
    TicketRequest,
    TicketStatus,
    TicketUpdate,
    UndrainRequest,
    UndrainResult,
)


@dataclass
class Calls:
    drains: list[DrainRequest] = field(default_factory=list)
    undrains: list[UndrainRequest] = field(default_factory=list)
    tickets: list[TicketRequest] = field(default_factory=list)
    updates: list[TicketUpdate] = field(default_factory=list)
    diags: list[DiagActivityRequest] = field(default_factory=list)
    diag_results: list[DiagResult] = field(default_factory=list)
    operator_drained: bool = False
    log: list[tuple[str, str]] = field(default_factory=list)
    """("drain" | "undrain", node) in call order: drained-at-once counts come from here."""
    permits: list = field(default_factory=list)
    releases: list = field(default_factory=list)
    recoveries: list = field(default_factory=list)
    recovery_results: list[RecoveryResult] = field(default_factory=list)
    """Answers of reset_gpu/reboot_node in turn; when empty: DRY_RUN (an agent's default)."""
    polls: list[str] = field(default_factory=list)
    ticket_status: str = "open"
    """What poll_ticket reports; "Done" counts as repaired."""
    lemon: str | None = None
    """The stand-in guard's `PermitDecision.lemon` (a lemon node goes straight to RMA)."""
    notifications: list = field(default_factory=list)
    """`Notification`s the workflow asked to send, in order."""
    reconfigures: list = field(default_factory=list)
    """`ReconfigureRequest`s (live fixes of config_drift incidents), in order."""
    repeat_part: str | None = None
    """What `drain_node` says of the faulty part (`DrainResult.repeat_part`: the incident ledger's repeat part)."""
    diag_gate: asyncio.Event | None = None
    """When set, `run_diagnostics` waits for it (an incident held in a phase while the test acts)."""


def _drain_stand_in(calls: Calls):
    @activity.defn(name="drain_node")
    async def drain_node(req: DrainRequest) -> DrainResult:
        calls.drains.append(req)
        calls.log.append(("drain", req.node))
        if calls.operator_drained:
            return DrainResult(node=req.node, drained=True, owned=False, operator_drained=True, state="DRAINED",
                               detail="operator reason")
        return DrainResult(node=req.node, drained=True, owned=True, operator_drained=False, state="DRAINED",
                           detail="ok", repeat_part=calls.repeat_part)

    return drain_node


def stand_ins(calls: Calls) -> list:
    drain_node = _drain_stand_in(calls)

    @activity.defn(name="undrain_node")
    async def undrain_node(req: UndrainRequest) -> UndrainResult:
        calls.undrains.append(req)
        calls.log.append(("undrain", req.node))
        return UndrainResult(node=req.node, resumed=True, state="IDLE", detail="resumed")

    @activity.defn(name="file_ticket")
    async def file_ticket(req: TicketRequest) -> TicketRef:
        calls.tickets.append(req)
        return TicketRef(ticket_id=f"FM-{len(calls.tickets):06d}", url=None, created=True)

    @activity.defn(name="update_ticket")
    async def update_ticket(upd: TicketUpdate) -> None:
        calls.updates.append(upd)

    @activity.defn(name="run_diagnostics")
    async def run_diagnostics(req: DiagActivityRequest) -> DiagReport:
        calls.diags.append(req)
        if calls.diag_gate is not None:
            await calls.diag_gate.wait()
        result = calls.diag_results.pop(0) if calls.diag_results else DiagResult.NOT_APPLICABLE
        return DiagReport(node=req.node, cluster=req.cluster, level=DiagLevel.QUICK,
                          checks=[CheckResult(name="nvml_reachable", result=result)])

    @activity.defn(name="request_drain_permit")
    async def request_drain_permit(req: PermitRequest) -> None:
        """A FleetGuard that always grants at once (tests/test_fleetguard.py runs the real one)."""
        calls.permits.append(req)
        await activity.client().get_workflow_handle(subjects.workflow_id(req.cluster, req.node)).signal(
            "permit", PermitDecision(granted=True, reason="stand-in guard", lemon=calls.lemon))

    @activity.defn(name="release_drain_permit")
    async def release_drain_permit(rel: PermitRelease) -> None:
        calls.releases.append(rel)

    @activity.defn(name="reset_gpu")
    async def reset_gpu(req: RecoveryActivityRequest) -> RecoveryReport:
        calls.recoveries.append(req)
        result = calls.recovery_results.pop(0) if calls.recovery_results else RecoveryResult.DRY_RUN
        return RecoveryReport(node=req.node, cluster=req.cluster, op=req.op, result=result, detail="stand-in")

    @activity.defn(name="reboot_node")
    async def reboot_node(req: RecoveryActivityRequest) -> RecoveryReport:
        calls.recoveries.append(req)
        result = calls.recovery_results.pop(0) if calls.recovery_results else RecoveryResult.DRY_RUN
        return RecoveryReport(node=req.node, cluster=req.cluster, op=req.op, result=result, detail="stand-in")

    @activity.defn(name="poll_ticket")
    async def poll_ticket(ticket_id: str) -> TicketStatus:
        calls.polls.append(ticket_id)
        return TicketStatus(ticket_id, calls.ticket_status, calls.ticket_status == "Done")

    @activity.defn(name="notify")
    async def notify(n: Notification) -> NotifyResult:
        calls.notifications.append(n)
        return NotifyResult(sent=["stand-in"])

    @activity.defn(name="reconfigure_node")
    async def reconfigure_node(req: ReconfigureRequest) -> ReconfigureReport:
        """An agent whose policy.reconfigure is on: every key is written and reads back as wanted."""
        calls.reconfigures.append(req)
        return ReconfigureReport(node=req.node, dry_run=False, results=[
            FixResult(key=k, before="powersave", wanted=v, after=v, applied=True, verified=True)
            for k, v in req.fixes.items()])

    return [drain_node, undrain_node, file_ticket, update_ticket, run_diagnostics, request_drain_permit,
            release_drain_permit, reset_gpu, reboot_node, poll_ticket, notify, reconfigure_node]


GUARD_ACTIVITIES = ("request_drain_permit", "release_drain_permit", "running_incidents", "drain_node")
"""The activities a test replaces with the real ones (`guard_activities`) to run the real FleetGuard."""


def guard_activities(guard, calls: Calls | None = None) -> list:
    """The real guard's activities (`activities.fleetguard.FleetGuardActivities` over the real permit pool),
    and `drain_node` as the worker builds it: the node's pool slot, then the stand-in drain (recording
    into `calls`; a fresh `Calls` when none is given)."""
    drain = PooledDrainActivities(_drain_stand_in(calls or Calls()), guard.gate)
    return [guard.request_drain_permit, guard.release_drain_permit, guard.running_incidents,
            guard.sync_permit_pool, guard.reconcile_pool, drain.drain_node]


def real_guard(client, task_queue: str, policy, js, topology=None, incident_task_queue: str | None = None):
    """The real `FleetGuardActivities` over the real permit pool (JetStream `js`), its guard and the
    incidents on one deployment `task_queue` (the tests' single worker polls its cluster's,
    `subjects.cluster_task_queue(task_queue, cluster)`), or the incidents on `incident_task_queue`."""
    from activities.fleetguard import FleetGuardActivities
    from activities.quarantine import PoolGate
    from fleetmend.catalog import default_catalog

    return FleetGuardActivities(client, task_queue, policy, PoolGate(js, topology), topology,
                                incident_task_queue=incident_task_queue or task_queue, catalog=default_catalog())
