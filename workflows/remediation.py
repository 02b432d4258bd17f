"""`NodeRemediation`: one durable incident per node, id `remediate/<cluster>/<node>`.

    triage ─(drain-worthy fault)→ awaiting_permit → draining → diagnosing → recovering
        → awaiting_repair ⇄ verifying → returning → closed
    triage ─(only application-side faults; quiet for policy.close_after_idle_s)→ closed ("recorded")

Started by the router with signal-with-start (`faults` signal); later faults of the same node join
the open incident. Human commands are updates with validators, so bad input never reaches history:
`mark_repaired`, `force_retest`, `abort` (FleetGuard takes `reset_breaker`, `pause`, `resume`). The `status` query answers `IncidentStatus`.

Deterministic code only: every side effect is an activity (activities/), time is `workflow.now()`,
logs go through `workflow.logger`. History stays bounded: after `MAX_HISTORY_EVENTS` (or when the
server suggests it) the workflow continues-as-new at a waiting point, carrying its state.

Policy (issue 4; fleetmend/policy.py holds the pure rules, workflows/fleetguard.py the fleet budget):
triage applies the history rules (`policy.decide`: XID 13/31 repeats, sympathetic XID 45, XID 48 with
63/64, SBE rate / pending remap → drain when idle, debounce of clearable faults) and notes every rule
that fired; `awaiting_permit` asks the cluster's FleetGuard for a drain permit and waits for its
`permit` signal (denied: observe-only or an infrastructure incident → closes without draining);
`recovering` tries the catalog's recovery (GPU reset, then reboot) with a settle period and a
verification chosen from the original fault before filing a ticket; a lemon node (FleetGuard's
per-node history) goes to RMA at once. Every close gives the permit back.

Versioning: running incidents keep their command sequence; new code paths sit behind
`workflow.patched(<id>)` and the recorded histories in tests/histories/ replay in CI.

==========================  =====================================================================
patch id                    what changed
==========================  =====================================================================
`history-rules`             triage decides with `policy.decide` (notes, debounce timer)
`fleetguard-permit`         awaiting_permit requests a permit (activity) and waits for the signal;
                            closing releases it (activity)
`recovery-before-rma`       GPU reset / reboot + settle + verification before a ticket; RMA for
                            lemons and RMA-class faults
`fault-verification`        verification runs the checks chosen from the original fault
`settle-clean`              the settle period ends early (back to awaiting repair) on a new fault
`ticket-poll`               awaiting repair polls the ticket system on a timer (`ticket_poll_s`)
`arrival-order`             a fault counts as cleared only by a clearing event that arrived after its
                            *latest* occurrence (`FaultRecord.last_seq`), so a flapping link that
                            ends DOWN is not taken for cleared
`upsert-on-change`          search attributes are upserted only when one of them changed (before:
                            on every batch of faults: a history event and a visibility write each)
==========================  =====================================================================
Also fixed without a patch (no command changes; the old code never completed that path): an abort
while awaiting repair left `_await_repair` spinning without yielding.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeKey
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.diagnostics import DiagActivityRequest
    from activities.recovery import RecoveryActivityRequest
    from fleetmend.policy import (
        Decision, FaultView, Recovery, RecoveryOp, RecoveryReport, RecoveryResult, RuleSettings, Urgency, decide,
        verification_checks,
    )
    from workflows.fleetguard import PermitDecision, PermitRelease, PermitRequest
    from activities.scheduler import DrainRequest, DrainResult, UndrainRequest, UndrainResult
    from activities.tickets import TicketRef, TicketRequest, TicketStatus, TicketUpdate
    from fleetmend.diagnostics import DiagLevel, DiagReport, DiagResult
    from fleetmend.events import FaultEvent, Severity

MAX_HISTORY_EVENTS = 5_000
"""Continue-as-new past this many history events (Temporal warns at 10k, limits at 50k)."""
MAX_FAULTS_KEPT = 100
"""Fault records kept in state; older ones are summarised in `faults_dropped` (bounded history)."""
MAX_SEEN_IDS = 2_000
"""Event ids remembered for de-duplication of redelivered events (router retries, agent re-sends)."""
MAX_TIMES_KEPT = 32
"""Occurrence times kept per fault record (enough for the repeat/rate rules' thresholds)."""

P_RULES = "history-rules"
P_PERMIT = "fleetguard-permit"
P_RECOVERY = "recovery-before-rma"
P_VERIFY = "fault-verification"
P_SETTLE = "settle-clean"
P_TICKET_POLL = "ticket-poll"
P_ORDER = "arrival-order"
P_SA_CHANGED = "upsert-on-change"

KEY_NODE = SearchAttributeKey.for_keyword("FleetNode")
KEY_CLUSTER = SearchAttributeKey.for_keyword("FleetCluster")
KEY_PHASE = SearchAttributeKey.for_keyword("FleetPhase")
KEY_FAULT_CLASS = SearchAttributeKey.for_keyword("FleetFaultClass")
KEY_TICKET = SearchAttributeKey.for_keyword("FleetTicket")
KEY_SEVERITY = SearchAttributeKey.for_keyword("FleetSeverity")
KEY_DRAINED = SearchAttributeKey.for_bool("FleetDrained")

ACTIVITY_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), backoff_coefficient=2.0,
                             maximum_interval=timedelta(minutes=1), maximum_attempts=0,
                             non_retryable_error_types=["NodeNotFound", "InvalidRequest"])
"""Side effects retry until they succeed (drains and undrains must not be given up), bounded per
attempt by start_to_close and overall by schedule_to_close where set."""
DRAIN_TIMEOUT = timedelta(minutes=15)
"""A drain may evict pods through PodDisruptionBudgets (Kubernetes adapter: 90 s deadline by default)."""
DRAIN_HEARTBEAT = timedelta(seconds=60)
"""A worker killed mid-drain is noticed within a minute and the idempotent drain retried elsewhere."""
DIAG_RETRY = RetryPolicy(initial_interval=timedelta(seconds=2), maximum_interval=timedelta(seconds=30),
                         maximum_attempts=5)
"""Diagnostics give up after 5 attempts: a silent agent is itself evidence (result UNKNOWN)."""


class Phase(StrEnum):
    TRIAGE = "triage"
    AWAITING_PERMIT = "awaiting_permit"
    DRAINING = "draining"
    DIAGNOSING = "diagnosing"
    RECOVERING = "recovering"
    AWAITING_REPAIR = "awaiting_repair"
    VERIFYING = "verifying"
    RETURNING = "returning"
    CLOSED = "closed"


class Outcome(StrEnum):
    RETURNED = "returned_to_service"
    RECORDED = "recorded"
    """Only faults that need no drain (application-side); nothing was touched."""
    OBSERVED = "observed"
    """Observe-only mode: a drain would have happened; nothing was touched."""
    ABORTED = "aborted"
    OPERATOR_OWNED = "operator_owned"
    """The node was already drained by an operator; fleetmend recorded and left it."""
    INFRASTRUCTURE = "infrastructure_incident"
    """Part of a correlated failure-domain incident (FleetGuard): not drained, a human was paged."""
    DENIED = "permit_denied"


@dataclass
class Verdict:
    """The router's classification of one event (from the fault catalog), carried with it."""

    severity: str
    immediate_action: str
    investigatory_action: str = ""
    fault_class: str = ""
    drain: bool = False
    source: str = ""
    description: str = ""
    clearable: bool = False
    """The kind has a clearing event (catalog `cleared_by`): debounced before it drains."""


@dataclass
class Occurrence:
    """One more occurrence of a condition the router collapsed into a `RoutedFault`."""

    event_id: str
    observed_at: datetime


@dataclass
class RoutedFault:
    event: FaultEvent
    """The first occurrence in the batch (its text, device and verdict stand for all of them)."""
    verdict: Verdict
    repeats: list[Occurrence] = field(default_factory=list)
    """Later occurrences of the same condition (`merge_key`: kind, code, device, healthy) in the same
    batch, oldest first. The router collapses a storm of one node's repeats into one entry so the
    signal carries ids and times, not thousands of copies of the same text; the workflow counts and
    de-duplicates every id exactly as if each had come alone."""


def merge_key(ev: FaultEvent) -> tuple[str, int | None, str | None, bool]:
    """The identity under which repeats of one condition merge into one `FaultRecord` (and the router
    collapses them): kind, code, device (PCI bus id, else name, else UUID), healthy."""
    return ev.kind, ev.code, ev.device.pci_bus_id or ev.device.name or ev.device.uuid, ev.healthy


@dataclass
class FaultBatch:
    """Signal payload: one node's events coalesced by the router, oldest first."""

    faults: list[RoutedFault]
    routed_at: datetime | None = None


@dataclass
class PolicySnapshot:
    """Policy values in force when the incident started (kept in history for replay)."""

    observe_only: bool = False
    repair_escalation_s: float = 3 * 24 * 3600.0
    settle_s: float = 0.0
    diag_timeout_s: float = 120.0
    close_after_idle_s: float = 3600.0
    debounce_s: float = 0.0
    app_xid_repeats: int = 3
    app_xid_window_s: float = 3600.0
    sbe_events_per_window: int = 10
    sbe_window_s: float = 3600.0
    recovery_settle_s: float = 0.0
    ticket_poll_s: float = 0.0
    """While awaiting repair, ask the ticket system this often whether the ticket says repaired
    (0 = only `fleetmend repaired`)."""
    close_info_after_s: float = 0.0
    """An incident holding only info readings / clearings closes after this quiet time (0 = as any).

    Defaults here are those of an input that predates the field (replay); the router sends
    `PolicySettings`' values."""


@dataclass
class FaultRecord:
    event_id: str
    kind: str
    code: int | None
    severity: str
    component: str
    device: str | None
    healthy: bool
    raw: str
    message: str
    observed_at: str
    fault_class: str
    immediate_action: str
    drain: bool
    source: str
    count: int = 1
    times: list[str] = field(default_factory=list)
    """observed_at of the most recent occurrences (MAX_TIMES_KEPT), for the repeat/rate rules."""
    arrived_at: str | None = None
    """Workflow time the first occurrence arrived (debounce runs from here)."""
    clearable: bool = False
    last_seq: int = 0
    """Arrival order of the latest occurrence (`IncidentState.arrivals`; 0: recorded before the
    `arrival-order` patch, when list position stood for order)."""


@dataclass
class TimelineEntry:
    at: str
    phase: str
    text: str
    by: str | None = None


@dataclass
class IncidentState:
    cluster: str
    node: str
    phase: str = Phase.TRIAGE.value
    outcome: str | None = None
    drained: bool = False
    drain_owned: bool = False
    operator_drained: bool = False
    ticket: str | None = None
    ticket_url: str | None = None
    fault_class: str | None = None
    severity: str = Severity.INFO.value
    opened_at: str | None = None
    closed_at: str | None = None
    faults: list[FaultRecord] = field(default_factory=list)
    faults_dropped: int = 0
    duplicates: int = 0
    seen_ids: list[str] = field(default_factory=list)
    timeline: list[TimelineEntry] = field(default_factory=list)
    last_diag: dict[str, Any] | None = None
    repair_attempts: int = 0
    arrivals: int = 0
    """Counter behind `FaultRecord.last_seq` (one step per absorbed condition)."""
    run: int = 1
    decisions: list[str] = field(default_factory=list)
    """Rules that fired (policy.decide reasons), each noted once."""
    drained_at: str | None = None
    """Workflow time the drain took effect (MTTR runs from here)."""
    urgency: str | None = None
    recovery: str | None = None
    device: str | None = None
    permit_requested: bool = False
    permit_requested_at: str | None = None
    permit_held: bool = False
    permit: PermitDecision | None = None
    lemon: str | None = None
    recovery_tried: list[str] = field(default_factory=list)
    recovery_log: list[str] = field(default_factory=list)


@dataclass
class IncidentInput:
    cluster: str
    node: str
    policy: PolicySnapshot = field(default_factory=PolicySnapshot)
    carried: IncidentState | None = None
    """State carried across continue-as-new."""
    pending: list[RoutedFault] = field(default_factory=list)


@dataclass
class HumanCommand:
    by: str
    """Who sent it (CLI user@host); recorded in history for audit."""
    note: str = ""
    ticket: str | None = None
    undrain: bool = False


@dataclass
class IncidentStatus:
    workflow_id: str
    node: str
    cluster: str
    phase: str
    outcome: str | None
    drained: bool
    ticket: str | None
    fault_class: str | None
    severity: str
    opened_at: str | None
    closed_at: str | None
    faults: list[dict[str, Any]]
    faults_dropped: int
    duplicates: int
    timeline: list[dict[str, Any]]
    last_diag: dict[str, Any] | None
    operator_drained: bool
    permit_held: bool = False
    decisions: list[str] = field(default_factory=list)
    recovery_log: list[str] = field(default_factory=list)
    lemon: str | None = None


@workflow.defn(name="NodeRemediation")
class NodeRemediation:
    def __init__(self) -> None:
        self._s: IncidentState | None = None
        self._pending: list[RoutedFault] = []
        self._repaired: HumanCommand | None = None
        self._retest: HumanCommand | None = None
        self._abort: HumanCommand | None = None
        self._policy = PolicySnapshot()
        self._sa_last: tuple[Any, ...] | None = None

    # ---------------------------------------------------------------- messages
    @workflow.signal(name="faults")
    def faults(self, batch: FaultBatch) -> None:
        self._pending.extend(batch.faults)

    @workflow.signal(name="permit")
    def permit(self, decision: PermitDecision) -> None:
        """FleetGuard's answer to this node's drain-permit request."""
        self._state.permit = decision

    @workflow.query(name="status")
    def status(self) -> IncidentStatus:
        s = self._state
        return IncidentStatus(
            workflow_id=workflow.info().workflow_id, node=s.node, cluster=s.cluster, phase=s.phase,
            outcome=s.outcome, drained=s.drained, ticket=s.ticket, fault_class=s.fault_class,
            severity=s.severity, opened_at=s.opened_at, closed_at=s.closed_at,
            faults=[_record_dict(f) for f in s.faults], faults_dropped=s.faults_dropped,
            duplicates=s.duplicates, timeline=[t.__dict__ for t in s.timeline[-50:]],
            last_diag=s.last_diag, operator_drained=s.operator_drained, permit_held=s.permit_held,
            decisions=list(s.decisions), recovery_log=list(s.recovery_log), lemon=s.lemon)

    @workflow.update(name="mark_repaired")
    async def mark_repaired(self, cmd: HumanCommand) -> str:
        self._repaired = cmd
        self._note(f"marked repaired{' (ticket ' + cmd.ticket + ')' if cmd.ticket else ''}"
                   f"{': ' + cmd.note if cmd.note else ''}", by=cmd.by)
        return "repair recorded; verification will run"

    @mark_repaired.validator
    def _validate_repaired(self, cmd: HumanCommand) -> None:
        self._require_by(cmd)
        if self._state.phase != Phase.AWAITING_REPAIR.value:
            raise ValueError(f"node {self._state.node} is in phase {self._state.phase}, not awaiting_repair; "
                             "nothing to mark repaired")

    @workflow.update(name="force_retest")
    async def force_retest(self, cmd: HumanCommand) -> str:
        self._retest = cmd
        self._note("re-test requested", by=cmd.by)
        return "re-test scheduled"

    @force_retest.validator
    def _validate_retest(self, cmd: HumanCommand) -> None:
        self._require_by(cmd)
        if self._state.phase not in (Phase.AWAITING_REPAIR.value, Phase.TRIAGE.value):
            raise ValueError(f"node {self._state.node} is in phase {self._state.phase}; a re-test can be forced "
                             "while awaiting_repair (or triage)")

    @workflow.update(name="abort")
    async def abort(self, cmd: HumanCommand) -> str:
        self._abort = cmd
        self._note(f"abort requested{': ' + cmd.note if cmd.note else ''}", by=cmd.by)
        return "incident will close; " + ("node will be undrained" if cmd.undrain else "scheduler state left as is")

    @abort.validator
    def _validate_abort(self, cmd: HumanCommand) -> None:
        self._require_by(cmd)
        if self._state.phase == Phase.CLOSED.value:
            raise ValueError(f"incident for {self._state.node} is already closed")

    # ---------------------------------------------------------------- main
    @workflow.run
    async def run(self, inp: IncidentInput) -> IncidentStatus:
        self._policy = inp.policy
        # An update handled in the first activation runs before this method and notes on a placeholder
        # state (see `_state`): keep those notes, they are the audit trail of who did what.
        early = self._s.timeline if self._s is not None else []
        early_permit = self._s.permit if self._s is not None else None  # FleetGuard's answer raced a CAN
        if inp.carried is not None:
            self._s = inp.carried
            self._s.run += 1
        else:
            self._s = IncidentState(cluster=inp.cluster, node=inp.node, opened_at=self._now())
            self._note("incident opened")
        self._s.timeline.extend(early)
        if early_permit is not None:
            self._s.permit = early_permit
        self._pending = list(inp.pending) + self._pending
        s = self._s

        if s.phase == Phase.TRIAGE.value:
            await self._triage()
        if s.phase in (Phase.AWAITING_PERMIT.value, Phase.DRAINING.value):
            await self._drain()
        if s.phase in (Phase.DIAGNOSING.value, Phase.RECOVERING.value):
            await self._diagnose_and_ticket()
        while s.phase in (Phase.AWAITING_REPAIR.value, Phase.VERIFYING.value) and self._abort is None:
            if s.phase == Phase.AWAITING_REPAIR.value:
                await self._await_repair()
            if s.phase == Phase.VERIFYING.value:
                await self._verify()
        if s.phase == Phase.RETURNING.value:
            await self._return()
        if self._abort is not None and s.phase != Phase.CLOSED.value:
            await self._do_abort()
        await workflow.wait_condition(workflow.all_handlers_finished)
        if self._pending:
            # Faults that arrived as this incident closed open the node's next incident.
            workflow.continue_as_new(IncidentInput(cluster=s.cluster, node=s.node, policy=self._policy,
                                                   pending=self._pending))
        return self.status()

    # ---------------------------------------------------------------- phases
    async def _triage(self) -> None:
        if workflow.patched(P_RULES):
            await self._triage_rules()
        else:
            await self._triage_v1()

    async def _triage_rules(self) -> None:
        """Decide with the history rules; wait out debounce windows; close quiet record-only incidents."""
        s = self._state
        debouncing: list[str] = []
        while True:
            self._absorb()
            if self._abort is not None:
                return
            d = self._decide()
            self._note_decisions(d)
            if debouncing and not d.debounce and not d.drain:
                self._note("debounced fault(s) cleared within the window: " + ", ".join(debouncing) + "; not drained")
            debouncing = sorted({f.fault_class for f in d.debounce})
            if d.drain:
                s.fault_class, s.device = d.fault_class, d.device
                s.urgency, s.recovery = d.urgency.value, d.recovery.value
                if Severity(d.severity).rank > Severity(s.severity).rank:
                    s.severity = d.severity
                self._note(f"decision: drain {d.urgency.value.replace('_', ' ')}, then {d.recovery.value} "
                           f"({s.fault_class} on {s.device or 'node'})")
                if self._policy.observe_only:
                    self._note("observe-only: would drain; nothing touched")
                    self._close(Outcome.OBSERVED)
                    return
                self._set_phase(Phase.AWAITING_PERMIT)
                return
            if self._retest is not None:
                self._retest = None
            wait_s = self._policy.close_after_idle_s
            if self._policy.close_info_after_s and not any(
                    not f.healthy and Severity(f.severity).rank > Severity.INFO.rank for f in s.faults):
                wait_s = min(wait_s, self._policy.close_info_after_s)  # only info readings / clearings
            if d.debounce:
                now = workflow.now()
                ends = [(f.arrived_at or now) + timedelta(seconds=self._policy.debounce_s) for f in d.debounce]
                wait_s = max(1.0, min((e - now).total_seconds() for e in ends))
                self._details(f"debouncing {', '.join(sorted({f.fault_class for f in d.debounce}))}: drains in "
                              f"{wait_s:.0f}s unless it clears")
            else:
                self._details(f"triage: {len(s.faults)} fault(s) recorded, none needs a drain; closes after "
                              f"{wait_s:.0f}s quiet")
            try:
                await workflow.wait_condition(lambda: bool(self._pending) or self._abort is not None,
                                              timeout=timedelta(seconds=wait_s))
            except asyncio.TimeoutError:
                self._absorb()
                if not d.debounce:
                    again = self._decide()
                    if not again.drain and not again.debounce:
                        self._close(Outcome.RECORDED)
                        return
            self._maybe_continue_as_new()

    def _decide(self) -> Decision:
        s, p = self._state, self._policy
        views = [FaultView(kind=f.kind, code=f.code, device=f.device, severity=f.severity, drain=f.drain,
                           immediate_action=f.immediate_action, fault_class=f.fault_class,
                           times=[_parse(t) for t in (f.times or [f.observed_at])],
                           cleared=self._cleared(f), clearable=f.clearable, message=f.message,
                           arrived_at=_parse(f.arrived_at) if f.arrived_at else None)
                 for f in s.faults if not f.healthy]
        rules = RuleSettings(app_xid_repeats=p.app_xid_repeats, app_xid_window_s=p.app_xid_window_s,
                             sbe_events_per_window=p.sbe_events_per_window, sbe_window_s=p.sbe_window_s)
        return decide(views, workflow.now(), rules, debounce_s=p.debounce_s)

    def _note_decisions(self, d: Decision) -> None:
        s = self._state
        for reason in d.reasons:
            if reason not in s.decisions:
                s.decisions.append(reason)
                del s.decisions[:-50]
                self._note(f"rule: {reason}")

    async def _triage_v1(self) -> None:
        s = self._state
        while True:
            self._absorb()
            if self._abort is not None:
                return
            drainers = [f for f in s.faults if f.drain and not f.healthy and not self._cleared(f)]
            if drainers:
                worst = max(drainers, key=lambda f: Severity(f.severity).rank)
                s.fault_class = worst.fault_class
                self._note(f"drain-worthy fault {worst.fault_class} ({worst.immediate_action}): {worst.message}")
                if self._policy.observe_only:
                    self._note("observe-only: would drain; nothing touched")
                    self._close(Outcome.OBSERVED)
                    return
                self._set_phase(Phase.AWAITING_PERMIT)
                return
            if self._retest is not None:
                self._retest = None
            self._details(f"triage: {len(s.faults)} fault(s) recorded, none needs a drain; closes after "
                          f"{self._policy.close_after_idle_s:.0f}s quiet")
            try:
                await workflow.wait_condition(lambda: bool(self._pending) or self._abort is not None,
                                              timeout=timedelta(seconds=self._policy.close_after_idle_s))
            except asyncio.TimeoutError:
                self._absorb()
                if not any(f.drain and not f.healthy for f in s.faults):
                    self._close(Outcome.RECORDED)
                    return
            self._maybe_continue_as_new()

    async def _await_permit(self) -> bool:
        """Ask FleetGuard for a drain permit and wait for its answer. Returns True when granted; on a
        denial the incident is closed (observe-only, infrastructure incident), on abort it returns False."""
        s = self._state
        if s.permit_held:
            return True
        if not s.permit_requested:
            s.permit_requested, s.permit_requested_at = True, self._now()
        await workflow.execute_activity(
            "request_drain_permit", PermitRequest(cluster=s.cluster, node=s.node, severity=s.severity,
                                                  fault_class=s.fault_class or "", reason="; ".join(s.decisions[-3:]),
                                                  requested_at=s.permit_requested_at),
            start_to_close_timeout=timedelta(seconds=30), retry_policy=ACTIVITY_RETRY,
            summary=f"drain permit for {s.node}")
        self._note(f"waiting for a drain permit from FleetGuard ({s.severity} {s.fault_class}): the fleet's "
                   "blast-radius budget decides; `fleetmend breaker status` shows permits held and the queue")
        while True:
            await workflow.wait_condition(lambda: s.permit is not None or self._abort is not None
                                          or bool(self._pending))
            self._absorb()
            if self._abort is not None:
                return False
            if s.permit is not None:
                break
            self._maybe_continue_as_new()
        decision, s.permit = s.permit, None
        if decision.granted:
            s.permit_held = True
            self._note(f"drain permit granted ({decision.reason})")
            if decision.lemon:
                s.lemon, s.recovery = decision.lemon, Recovery.RMA.value
                self._note(decision.lemon)
            return True
        s.permit_requested = False
        self._note(f"drain permit denied: {decision.reason}")
        if decision.infra_incident:
            self._close(Outcome.INFRASTRUCTURE)
        elif decision.reason.startswith("observe-only"):
            self._close(Outcome.OBSERVED)
        else:
            self._close(Outcome.DENIED)
        return False

    async def _drain(self) -> None:
        s = self._state
        if workflow.patched(P_PERMIT):
            if not await self._await_permit():
                return
        # else (histories before P_PERMIT): the permit was granted at once.
        self._set_phase(Phase.DRAINING)
        reason = f"{s.fault_class} incident {self._incident_id}"
        if s.urgency == Urgency.WHEN_IDLE.value:
            reason += " (drain when idle: running jobs finish)"
        first = next((f for f in s.faults if f.drain and not f.healthy), None)
        res: DrainResult = await workflow.execute_activity(
            "drain_node", DrainRequest(cluster=s.cluster, node=s.node, reason=reason,
                                       incident_id=self._incident_id,
                                       observed_at=datetime.fromisoformat(first.observed_at) if first else None),
            result_type=DrainResult, start_to_close_timeout=DRAIN_TIMEOUT, heartbeat_timeout=DRAIN_HEARTBEAT,
            retry_policy=ACTIVITY_RETRY, summary=f"drain {s.node}: {s.fault_class}")
        if res.drained:
            s.drained_at = self._now()
        s.drained = res.drained
        s.drain_owned = res.owned
        s.operator_drained = res.operator_drained
        if res.operator_drained:
            self._note(f"node already drained by an operator ({res.detail}); left as is, never undrained")
        else:
            self._note(f"drained ({res.state}): {res.detail}")
        self._upsert()
        self._set_phase(Phase.DIAGNOSING)

    async def _diagnose_and_ticket(self) -> None:
        s = self._state
        if s.phase == Phase.DIAGNOSING.value:
            report = await self._diagnostics("initial diagnostics")
            self._set_phase(Phase.RECOVERING)
        else:
            report = s.last_diag
        if workflow.patched(P_RECOVERY):
            if await self._recover():
                self._set_phase(Phase.RETURNING)
                return
            if self._abort is not None:
                return
        evidence = {
            "faults": [_record_dict(f) for f in s.faults],
            "raw": "\n".join(f.raw for f in s.faults if f.raw)[:32_000],
            "classification": {"fault_class": s.fault_class, "severity": s.severity},
            "diagnostics": report,
            "workflow_id": workflow.info().workflow_id,
        }
        if s.decisions or s.recovery_log or s.lemon:
            evidence.update({"decisions": s.decisions, "recovery": s.recovery_log, "lemon": s.lemon})
        rma = s.lemon is not None or s.recovery == Recovery.RMA.value
        title = f"[fleetmend] {'RMA ' if rma else ''}{s.node}: {s.fault_class} ({s.severity})"
        ref: TicketRef = await workflow.execute_activity(
            "file_ticket", TicketRequest(incident_id=self._incident_id, cluster=s.cluster, node=s.node,
                                         title=title, severity=s.severity, fault_class=s.fault_class or "",
                                         evidence=evidence),
            result_type=TicketRef, start_to_close_timeout=timedelta(minutes=1), retry_policy=ACTIVITY_RETRY,
            summary=f"file ticket for {s.node}")
        s.ticket, s.ticket_url = ref.ticket_id, ref.url
        self._note(f"ticket {ref.ticket_id} {'filed' if ref.created else 'already filed'}")
        self._upsert()
        self._set_phase(Phase.AWAITING_REPAIR)

    async def _recover(self) -> bool:
        """Recovery before RMA: the catalog's GPU reset (then a reboot) or reboot, each followed by a
        settle period and the verification chosen for the original fault. True when one held."""
        s, p = self._state, self._policy
        if s.lemon is not None or s.recovery == Recovery.RMA.value:
            self._recovery_note("no recovery attempt: " + (s.lemon or f"{s.fault_class}: catalog says RMA"))
            return False
        plan = {Recovery.RESET_GPU.value: [RecoveryOp.RESET_GPU, RecoveryOp.REBOOT],
                Recovery.RESTART_BM.value: [RecoveryOp.REBOOT]}.get(s.recovery or "", [])
        for op in plan:
            if op.value in s.recovery_tried:
                continue
            s.recovery_tried.append(op.value)
            if op is RecoveryOp.RESET_GPU and not (s.device and ":" in s.device):
                self._recovery_note(f"reset_gpu skipped: no PCI bus id known for the faulty GPU ({s.device})")
                continue
            report = await self._recovery_activity(op)
            self._recovery_note(f"{op.value}: {report.result.value} ({report.detail[:300]})")
            if report.result is not RecoveryResult.APPLIED:
                continue
            if p.recovery_settle_s > 0:
                self._details(f"{op.value} applied; settling {p.recovery_settle_s:.0f}s before verification")
                faults_before = len(s.faults)
                settle_end = workflow.now() + timedelta(seconds=p.recovery_settle_s)
                while workflow.now() < settle_end and self._abort is None \
                        and not self._fresh_drainers(faults_before):
                    try:
                        await workflow.wait_condition(lambda: self._abort is not None or bool(self._pending),
                                                      timeout=settle_end - workflow.now())
                    except asyncio.TimeoutError:
                        pass
                    self._absorb()
                if self._abort is not None:
                    return False
                if self._fresh_drainers(faults_before):
                    self._recovery_note(f"{op.value} did not hold: a new drain-worthy fault while settling")
                    continue
            verified = await self._diagnostics(f"verification after {op.value}", checks=self._verify_checks())
            result = DiagResult(verified["result"]) if verified else DiagResult.UNKNOWN
            if result in (DiagResult.PASS, DiagResult.NOT_APPLICABLE):
                self._recovery_note(f"recovered by {op.value}: verification {result.value}; returning to service")
                return True
            self._recovery_note(f"{op.value} did not hold: verification {result.value}")
        if plan:
            self._recovery_note("recovery did not hold; escalating to a ticket")
        return False

    async def _recovery_activity(self, op: RecoveryOp) -> RecoveryReport:
        s = self._state
        req = RecoveryActivityRequest(cluster=s.cluster, node=s.node, op=op,
                                      pci_bus_id=s.device if op is RecoveryOp.RESET_GPU else None,
                                      incident_id=self._incident_id)
        try:
            return await workflow.execute_activity(
                "reset_gpu" if op is RecoveryOp.RESET_GPU else "reboot_node", req, result_type=RecoveryReport,
                start_to_close_timeout=timedelta(seconds=req.timeout_s + 10), retry_policy=DIAG_RETRY,
                summary=f"{op.value} on {s.node}" + (f" GPU {s.device}" if op is RecoveryOp.RESET_GPU else ""))
        except ActivityError as err:
            return RecoveryReport(node=s.node, cluster=s.cluster, op=op, result=RecoveryResult.FAILED,
                                  detail=f"agent did not carry it out: {err.cause or err}")

    def _recovery_note(self, text: str) -> None:
        s = self._state
        s.recovery_log.append(f"{self._now()} {text}")
        del s.recovery_log[:-50]
        self._note(text)

    def _fresh_drainers(self, faults_before: int) -> list[FaultRecord]:
        return [f for f in self._state.faults[faults_before:] if f.drain and not f.healthy]

    def _verify_checks(self) -> list[str] | None:
        """Checks that prove the original fault gone (policy.verification_checks); None: every QUICK check."""
        s = self._state
        root = next((f for f in s.faults if f.fault_class == s.fault_class and not f.healthy), None)
        if root is None:
            return None
        return verification_checks(root.component, root.kind, root.code) or None

    async def _await_repair(self) -> None:
        s = self._state
        self._details(f"awaiting repair: ticket {s.ticket}; signal with `fleetmend repaired {s.node}`")
        escalate_after = timedelta(seconds=self._policy.repair_escalation_s)
        poll = (timedelta(seconds=self._policy.ticket_poll_s)
                if self._policy.ticket_poll_s > 0 and s.ticket and workflow.patched(P_TICKET_POLL) else None)
        waited = timedelta(0)
        while True:
            try:
                step = min(poll, escalate_after - waited) if poll else escalate_after
                await workflow.wait_condition(
                    lambda: self._repaired is not None or self._retest is not None or self._abort is not None
                    or bool(self._pending), timeout=step)
            except asyncio.TimeoutError:
                waited += step
                if poll and waited < escalate_after:
                    await self._poll_ticket()  # sets self._repaired when the ticket says so
                    if self._repaired is None:
                        continue
                else:
                    waited = timedelta(0)
                    self._note(f"no repair after {escalate_after}; escalating ticket {s.ticket}")
                    await self._update_ticket("escalated", f"No repair after {escalate_after}; escalated.")
                    escalate_after = escalate_after * 2
                    continue
            self._absorb()
            if self._abort is not None:
                return
            if self._repaired is not None or self._retest is not None:
                s.repair_attempts += 1 if self._repaired is not None else 0
                self._repaired = self._retest = None
                self._set_phase(Phase.VERIFYING)
                return
            self._maybe_continue_as_new()

    async def _verify(self) -> None:
        s = self._state
        faults_before = len(s.faults)
        checks = self._verify_checks() if workflow.patched(P_VERIFY) else None
        report = await self._diagnostics("verification", checks=checks)
        result = DiagResult(report["result"]) if report else DiagResult.UNKNOWN
        self._absorb()
        fresh = [f for f in s.faults[faults_before:] if f.drain and not f.healthy]
        if fresh:
            self._note(f"new drain-worthy fault during verification ({fresh[0].fault_class}); back to awaiting repair")
            await self._update_ticket("verification_failed", f"New fault during verification: {fresh[0].message}")
            self._set_phase(Phase.AWAITING_REPAIR)
            return
        if result in (DiagResult.PASS, DiagResult.NOT_APPLICABLE):
            if self._policy.settle_s > 0:
                self._details(f"verified; settling {self._policy.settle_s:.0f}s before return")
                if workflow.patched(P_SETTLE):
                    # The node must stay clean for the settle period; a new fault sends it back.
                    before = len(s.faults)
                    try:
                        await workflow.wait_condition(lambda: bool(self._pending) or self._abort is not None,
                                                      timeout=timedelta(seconds=self._policy.settle_s))
                    except asyncio.TimeoutError:
                        pass
                    self._absorb()
                    if self._fresh_drainers(before):
                        f = self._fresh_drainers(before)[0]
                        self._note(f"new drain-worthy fault while settling ({f.fault_class}); back to awaiting repair")
                        await self._update_ticket("verification_failed", f"New fault while settling: {f.message}")
                        self._set_phase(Phase.AWAITING_REPAIR)
                        return
                    if self._abort is not None:
                        return
                else:
                    await workflow.sleep(timedelta(seconds=self._policy.settle_s))
            self._set_phase(Phase.RETURNING)
        else:
            self._note(f"verification {result.value}; back to awaiting repair")
            await self._update_ticket("verification_failed", f"Verification {result.value}: {report}")
            self._set_phase(Phase.AWAITING_REPAIR)

    async def _return(self) -> None:
        s = self._state
        if s.drain_owned and s.drained:
            res: UndrainResult = await workflow.execute_activity(
                "undrain_node", UndrainRequest(cluster=s.cluster, node=s.node, incident_id=self._incident_id,
                                               drained_at=self._drained_at()),
                result_type=UndrainResult, start_to_close_timeout=DRAIN_TIMEOUT, heartbeat_timeout=DRAIN_HEARTBEAT,
                retry_policy=ACTIVITY_RETRY, summary=f"return {s.node} to service")
            s.drained = not res.resumed and s.drained
            self._note(f"undrain: {'resumed' if res.resumed else 'not resumed'} ({res.detail})")
        await self._update_ticket("resolved", "Verification passed; node returned to service.")
        await self._finish(Outcome.OPERATOR_OWNED if s.operator_drained else Outcome.RETURNED)

    async def _do_abort(self) -> None:
        s = self._state
        cmd = self._abort
        assert cmd is not None
        if cmd.undrain and s.drain_owned and s.drained:
            res: UndrainResult = await workflow.execute_activity(
                "undrain_node", UndrainRequest(cluster=s.cluster, node=s.node, incident_id=self._incident_id,
                                               drained_at=self._drained_at()),
                result_type=UndrainResult, start_to_close_timeout=DRAIN_TIMEOUT, heartbeat_timeout=DRAIN_HEARTBEAT,
                retry_policy=ACTIVITY_RETRY, summary=f"undrain {s.node} (abort)")
            s.drained = not res.resumed and s.drained
        if s.ticket:
            await self._update_ticket("aborted", f"Incident aborted by {cmd.by}: {cmd.note}")
        await self._finish(Outcome.ABORTED)

    # ---------------------------------------------------------------- helpers
    async def _finish(self, outcome: Outcome) -> None:
        """Close the incident, giving FleetGuard its permit back (or withdrawing a queued request)."""
        s = self._state
        if s.permit_requested or s.permit_held:
            returned = outcome in (Outcome.RETURNED, Outcome.OPERATOR_OWNED)
            await workflow.execute_activity(
                "release_drain_permit", PermitRelease(cluster=s.cluster, node=s.node, outcome=outcome.value,
                                                      fault_class=s.fault_class or "", returned=returned),
                start_to_close_timeout=timedelta(seconds=30), retry_policy=ACTIVITY_RETRY,
                summary=f"release drain permit of {s.node}")
            s.permit_requested = s.permit_held = False
        self._close(outcome)

    async def _diagnostics(self, why: str, checks: list[str] | None = None) -> dict[str, Any] | None:
        s = self._state
        try:
            rep: DiagReport = await workflow.execute_activity(
                "run_diagnostics", DiagActivityRequest(cluster=s.cluster, node=s.node, level=DiagLevel.QUICK,
                                                       checks=checks,
                                                       timeout_s=self._policy.diag_timeout_s,
                                                       incident_id=self._incident_id),
                result_type=DiagReport, start_to_close_timeout=timedelta(seconds=self._policy.diag_timeout_s + 10),
                retry_policy=DIAG_RETRY, summary=f"{why} on {s.node}")
            d = rep.model_dump(mode="json")
            d["result"] = rep.result.value
        except ActivityError as err:
            d = {"result": DiagResult.UNKNOWN.value, "error": str(err.cause or err), "checks": []}
        s.last_diag = d
        failed = [c["name"] for c in d.get("checks", []) if c.get("result") == DiagResult.FAIL.value]
        self._note(f"{why}: {d['result']}" + (f" (failed: {', '.join(failed)})" if failed else "")
                   + (f" ({d['error']})" if d.get("error") else ""))
        return d

    async def _poll_ticket(self) -> None:
        """Ask the ticket system whether the ticket says repaired; if so, act as `mark_repaired`."""
        s = self._state
        try:
            st: TicketStatus = await workflow.execute_activity(
                "poll_ticket", s.ticket, result_type=TicketStatus, start_to_close_timeout=timedelta(minutes=1),
                retry_policy=DIAG_RETRY, summary=f"poll ticket {s.ticket}")
        except ActivityError as err:
            self._details(f"awaiting repair: ticket {s.ticket} could not be polled ({err.cause or err})")
            return
        if st.repaired and self._repaired is None:
            self._repaired = HumanCommand(by=f"ticket:{s.ticket}", note=f"ticket status {st.status}",
                                          ticket=s.ticket)
            self._note(f"ticket {s.ticket} says {st.status}: treated as repaired", by=f"ticket:{s.ticket}")

    def _drained_at(self) -> datetime | None:
        s = self._state
        return datetime.fromisoformat(s.drained_at) if s.drained_at else None

    async def _update_ticket(self, status: str, comment: str) -> None:
        s = self._state
        if not s.ticket:
            return
        await workflow.execute_activity(
            "update_ticket", TicketUpdate(ticket_id=s.ticket, incident_id=self._incident_id, status=status,
                                          comment=comment),
            start_to_close_timeout=timedelta(minutes=1), retry_policy=ACTIVITY_RETRY,
            summary=f"ticket {s.ticket}: {status}")

    def _absorb(self) -> None:
        """Move pending faults into state: de-duplicate by event id, coalesce repeats, bound the list."""
        s = self._state
        batch, self._pending = self._pending, []
        seen = set(s.seen_ids)
        ordered = bool(batch) and workflow.patched(P_ORDER)
        for rf in batch:
            ev, v = rf.event, rf.verdict
            new_times: list[str] = []
            for event_id, observed_at in [(ev.event_id, ev.observed_at),
                                          *((r.event_id, r.observed_at) for r in rf.repeats)]:
                if event_id in seen:
                    s.duplicates += 1
                    continue
                seen.add(event_id)
                s.seen_ids.append(event_id)
                new_times.append(observed_at.isoformat())
            if not new_times:
                continue
            _kind, _code, dev, _healthy = merge_key(ev)
            same = next((f for f in reversed(s.faults)
                         if f.kind == ev.kind and f.code == ev.code and f.device == dev and f.healthy == ev.healthy),
                        None)
            if ordered:
                s.arrivals += 1
            if same is not None:
                same.count += len(new_times)
                same.times.extend(new_times)
                del same.times[:-MAX_TIMES_KEPT]
                if ordered:
                    same.last_seq = s.arrivals
                continue
            s.faults.append(FaultRecord(
                event_id=ev.event_id, kind=ev.kind, code=ev.code, severity=v.severity, component=ev.component.value,
                device=dev, healthy=ev.healthy, raw=ev.raw[:4000], message=ev.message,
                observed_at=ev.observed_at.isoformat(), fault_class=v.fault_class, immediate_action=v.immediate_action,
                drain=v.drain, source=v.source, count=len(new_times), times=new_times[-MAX_TIMES_KEPT:],
                arrived_at=self._now(), clearable=v.clearable, last_seq=s.arrivals if ordered else 0))
            if Severity(v.severity).rank > Severity(s.severity).rank and not ev.healthy:
                s.severity = v.severity
            if s.fault_class is None and not ev.healthy:
                s.fault_class = v.fault_class
        if len(s.seen_ids) > MAX_SEEN_IDS:
            del s.seen_ids[: len(s.seen_ids) - MAX_SEEN_IDS]
        if len(s.faults) > MAX_FAULTS_KEPT:
            # keep the first (root cause) and the most recent ones
            drop = len(s.faults) - MAX_FAULTS_KEPT
            s.faults_dropped += drop
            s.faults = s.faults[:1] + s.faults[1 + drop:]
        if batch:
            self._upsert()

    def _cleared(self, f: FaultRecord) -> bool:
        """A healthy event of the same kind/device that arrived after the fault's latest occurrence
        clears it (`last_seq`, patch `arrival-order`); records from before the patch: a healthy record
        later in the list."""
        if f.last_seq:
            return any(g.healthy and g.kind == f.kind and g.device == f.device and g.last_seq > f.last_seq
                       for g in self._state.faults)
        later = False
        for g in self._state.faults:
            if g is f:
                later = True
                continue
            if later and g.healthy and g.kind == f.kind and g.device == f.device:
                return True
        return False

    def _maybe_continue_as_new(self) -> None:
        info = workflow.info()
        if info.get_current_history_length() > MAX_HISTORY_EVENTS or info.is_continue_as_new_suggested():
            s = self._state
            self._note(f"continuing as new (history {info.get_current_history_length()} events)")
            workflow.continue_as_new(IncidentInput(cluster=s.cluster, node=s.node, policy=self._policy,
                                                   carried=s, pending=self._pending))

    @property
    def _state(self) -> IncidentState:
        if self._s is None:  # a query before run() started
            info = workflow.info()
            parts = info.workflow_id.split("/")
            self._s = IncidentState(cluster=parts[1] if len(parts) == 3 else "?",
                                    node=parts[2] if len(parts) == 3 else info.workflow_id)
        return self._s

    @property
    def _incident_id(self) -> str:
        """Stable per incident (workflow id + first run id): the idempotency key of every side effect."""
        info = workflow.info()
        return f"{info.workflow_id}/{info.first_execution_run_id}"

    def _now(self) -> str:
        return workflow.now().isoformat(timespec="seconds")

    def _note(self, text: str, by: str | None = None) -> None:
        s = self._state
        s.timeline.append(TimelineEntry(at=self._now(), phase=s.phase, text=text, by=by))
        if len(s.timeline) > 200:
            del s.timeline[:50]
        workflow.logger.info("%s: %s%s", s.node, text, f" (by {by})" if by else "")
        self._details(text)

    def _details(self, text: str) -> None:
        s = self._state
        lines = [f"**{s.node}** ({s.cluster}) — phase `{s.phase}`", "", text]
        if s.fault_class:
            lines.append(f"fault: {s.fault_class} ({s.severity})")
        if s.ticket:
            lines.append(f"ticket: {s.ticket}")
        lines.append(f"drained: {'yes' if s.drained else 'no'}")
        workflow.set_current_details("\n".join(lines))

    def _set_phase(self, phase: Phase) -> None:
        self._state.phase = phase.value
        self._upsert()
        self._details(f"entered {phase.value}")

    def _close(self, outcome: Outcome) -> None:
        s = self._state
        s.outcome = outcome.value
        s.closed_at = self._now()
        s.phase = Phase.CLOSED.value
        self._note(f"closed: {outcome.value}")
        self._upsert()

    def _upsert(self) -> None:
        s = self._state
        updates = [KEY_NODE.value_set(s.node), KEY_CLUSTER.value_set(s.cluster), KEY_PHASE.value_set(s.phase),
                   KEY_SEVERITY.value_set(s.severity), KEY_DRAINED.value_set(s.drained)]
        if s.fault_class:
            updates.append(KEY_FAULT_CLASS.value_set(s.fault_class))
        if s.ticket:
            updates.append(KEY_TICKET.value_set(s.ticket))
        values = (s.node, s.cluster, s.phase, s.severity, s.drained, s.fault_class, s.ticket)
        if values == self._sa_last and workflow.patched(P_SA_CHANGED):
            return
        self._sa_last = values
        workflow.upsert_search_attributes(updates)

    @staticmethod
    def _require_by(cmd: HumanCommand) -> None:
        if not cmd.by or not cmd.by.strip():
            raise ValueError("a command must say who sent it (`by`), for the audit trail")


def _record_dict(f: FaultRecord) -> dict[str, Any]:
    return dict(f.__dict__)


def _parse(iso: str) -> datetime:
    return datetime.fromisoformat(iso)


__all__ = [
    "NodeRemediation", "IncidentInput", "IncidentStatus", "IncidentState", "FaultBatch", "RoutedFault",
    "Verdict", "PolicySnapshot", "HumanCommand", "Phase", "Outcome", "ApplicationError",
]
