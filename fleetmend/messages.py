"""Every message that crosses a process or stage boundary after the router, defined once.

No `from __future__ import annotations` here (nor in `fleetmend.catalog`): the workflow sandbox
resolves dataclass annotations that are strings in its own module table, where they may be missing.

Next to `fleetmend.events.FaultEvent` (agent → router), this module holds what the router, the
workflows, the activities and the CLI say to each other:

- router → `NodeRemediation`: `IncidentInput` (start), `FaultBatch` of `RoutedFault`s (signal `faults`);
- CLI → `NodeRemediation`: one dataclass per update (`RepairedCommand`, `RetestCommand`,
  `AbortCommand`), answered by the `status` query's `IncidentStatus`;
- `NodeRemediation` → activities: drain/undrain, ticket, diagnostics, recovery and permit requests
  and their results, called by the names in `Activity`;
- `FleetGuard` ↔ everyone: `PermitRequest`, `PermitDecision`, `PermitRelease`, `GuardCommand`,
  `GuardInput`, `GuardStatus`;
- the incident's own typed state (`IncidentState`, `FaultRecord`), carried across continue-as-new.

Workflow, signal, query and update names (`RemediationApi`, `GuardApi`) and the search-attribute
keys live here too, so the router and the CLI address workflows without importing them.

Payloads travel through Temporal's pydantic data converter (`fleetmend.converter`): dataclasses
with enums and `datetime` fields round-trip as themselves. Imports only the contract, pydantic
and `temporalio.common` (search-attribute keys).
"""


from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from temporalio.common import SearchAttributeKey

from fleetmend.config import PolicySettings, policy_default
from fleetmend.diagnostics import DiagLevel, DiagReport, DiagResult, RecoveryOp
from fleetmend.events import Component, ConditionKey, FaultEvent, History, Recovery, Severity, Urgency

# ------------------------------------------------------------------ names


class Activity:
    """Activity names: the worker registers them (`@activity.defn(name=...)`), workflows call them."""

    DRAIN_NODE = "drain_node"
    UNDRAIN_NODE = "undrain_node"
    FILE_TICKET = "file_ticket"
    UPDATE_TICKET = "update_ticket"
    POLL_TICKET = "poll_ticket"
    RUN_DIAGNOSTICS = "run_diagnostics"
    RESET_GPU = "reset_gpu"
    REBOOT_NODE = "reboot_node"
    REQUEST_DRAIN_PERMIT = "request_drain_permit"
    DECIDE_DRAIN_PERMIT = "decide_drain_permit"
    """Update-with-start of the guard: the decision is the activity's result (queued: a later signal)."""
    DRAIN_WITH_PERMIT = "drain_with_permit"
    """`decide_drain_permit`, and on a grant `drain_node` at once, in one activity (`PermitDrainRequest`
    → `PermitDrainResult`): a granted drain costs the incident one activity and no second workflow task."""
    RUNNING_INCIDENTS = "running_incidents"
    SYNC_PERMIT_POOL = "sync_permit_pool"
    """FleetGuard's reconciliation: which of these nodes (or, for none, which nodes of the cluster) have
    a running incident."""
    RELEASE_DRAIN_PERMIT = "release_drain_permit"
    BENCH_NODE = "bench_node"
    """`Sweep`: one node's benchmark numbers (`fleetmend.sweep.BenchActivityRequest` → `BenchReport`)."""
    OPEN_FAIL_SLOW = "open_fail_slow"
    """`Sweep --act`: publish fail_slow for the outliers (`fleetmend.sweep.FailSlowRequest` → node names)."""
    NOTIFY = "notify"


class RemediationApi:
    """The `NodeRemediation` workflow's type, signal, query and update names."""

    WORKFLOW = "NodeRemediation"
    FAULTS = "faults"
    PERMIT = "permit"
    STATUS = "status"
    MARK_REPAIRED = "mark_repaired"
    FORCE_RETEST = "force_retest"
    ABORT = "abort"


class GuardApi:
    """The `FleetGuard` workflow's type, signal, query and update names."""

    WORKFLOW = "FleetGuard"
    REQUEST_PERMIT = "request_permit"
    REQUEST_PERMITS = "request_permits"
    """Requests the router forwards for incidents that have not asked yet (`policy.fast_drain`), a list
    per signal."""
    RELEASE = "release"
    ENSURE = "ensure"
    STATUS = "status"
    RESET_BREAKER = "reset_breaker"
    PAUSE = "pause"
    RESUME = "resume"
    DECIDE_PERMIT = "decide_permit"
    RELEASE_PERMIT = "release_permit"


def guard_task_queue(task_queue: str) -> str:
    """The task queue FleetGuard runs on, beside the cluster's `task_queue` (`fleet` → `fleet-guard`).

    The guard has workflow-task slots of its own (`fleetmend.worker`): an incident asks for its permit
    from a local activity that holds the incident's workflow-task slot while the guard decides, so on a
    shared queue a storm of waiting incidents could take every slot the guard needs to answer them."""
    return f"{task_queue}-guard"


KEY_NODE = SearchAttributeKey.for_keyword("FleetNode")
KEY_CLUSTER = SearchAttributeKey.for_keyword("FleetCluster")
KEY_PHASE = SearchAttributeKey.for_keyword("FleetPhase")
KEY_FAULT_CLASS = SearchAttributeKey.for_keyword("FleetFaultClass")
KEY_TICKET = SearchAttributeKey.for_keyword("FleetTicket")
KEY_SEVERITY = SearchAttributeKey.for_keyword("FleetSeverity")
KEY_DRAINED = SearchAttributeKey.for_bool("FleetDrained")


def iso(at: datetime | None) -> str | None:
    """`2026-11-29T17:20:24+00:00`: how times are shown (status, timeline, evidence)."""
    return at.isoformat(timespec="seconds") if at is not None else None


# ------------------------------------------------------------------ incident phases and outcomes


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


# ------------------------------------------------------------------ router → NodeRemediation

# Byte budget of everything that reaches Temporal. Temporal refuses a payload over 2 MiB (and warns
# from 512 KiB); an incident must never get there, however many distinct faults a node sends.
WORKFLOW_RAW_BYTES = 1024
"""`raw` text an event carries into a workflow (UTF-8 bytes); the full text stays in the fault
stream, at `RoutedFault.stream_seq` / `FaultRecord.stream_seq`."""
WORKFLOW_MESSAGE_CHARS = 256
WORKFLOW_ATTRS = 16
"""At most this many `attrs` keys per event in a workflow, each string value at most `WORKFLOW_ATTR_CHARS`."""
WORKFLOW_ATTR_CHARS = 128
MAX_SIGNAL_BYTES = 256 * 1024
"""A `FaultBatch` signal stays below this (JSON bytes); the router splits larger batches."""
MAX_PENDING_FAULTS = 200
"""Faults waiting in a workflow to be absorbed beyond which the signal handler merges repeats of one
condition and keeps the text only of drain-worthy faults."""
MAX_PENDING_HARD = 2_000
"""Hard bound of waiting faults (≈ 1 MiB of bare entries): beyond it the oldest non-drain-worthy
entries are dropped and counted in `IncidentState.faults_dropped` (their text is in the stream)."""


def for_workflow(ev: FaultEvent, stream_seq: int | None = None) -> FaultEvent:
    """`ev` within the workflow byte budget: `raw` cut to `WORKFLOW_RAW_BYTES` (with a note naming
    the stream sequence that holds the full text), `message` to `WORKFLOW_MESSAGE_CHARS`, `attrs`
    to `WORKFLOW_ATTRS` keys with string values of at most `WORKFLOW_ATTR_CHARS`."""
    update: dict[str, Any] = {}
    raw = ev.raw.encode("utf-8")
    if len(raw) > WORKFLOW_RAW_BYTES:
        where = f" in FLEET_FAULTS seq {stream_seq}" if stream_seq is not None else ""
        kept = WORKFLOW_RAW_BYTES - 200  # room for the note
        update["raw"] = (raw[:kept].decode("utf-8", "ignore")
                         + f"\n…[{len(raw) - kept} more bytes{where}]")
    if len(ev.message) > WORKFLOW_MESSAGE_CHARS:
        update["message"] = ev.message[: WORKFLOW_MESSAGE_CHARS - 1] + "…"
    if len(ev.attrs) > WORKFLOW_ATTRS or any(isinstance(v, str) and len(v) > WORKFLOW_ATTR_CHARS
                                             for v in ev.attrs.values()):
        update["attrs"] = {k: (v[:WORKFLOW_ATTR_CHARS] if isinstance(v, str) else v)
                           for k, v in list(ev.attrs.items())[:WORKFLOW_ATTRS]}
    return ev.model_copy(update=update) if update else ev


@dataclass
class Occurrence:
    """One more occurrence of a condition the router collapsed into a `RoutedFault`."""

    event_id: str
    observed_at: datetime


@dataclass
class RoutedFault:
    event: FaultEvent
    """The first occurrence in the batch, with its `Verdict` (its text, device and verdict stand for all
    of them)."""
    repeats: list[Occurrence] = field(default_factory=list)
    """Later occurrences of the same condition (`ConditionKey` and `healthy`) in the same batch,
    oldest first. The router collapses a storm of one node's repeats into one entry so the signal
    carries ids and times, not thousands of copies of the same text; the workflow counts and
    de-duplicates every id exactly as if each had come alone."""
    stream_seq: int | None = None
    """Fault-stream sequence of `event` (its full text, when `raw` was cut for the workflow)."""


@dataclass
class FaultBatch:
    """Signal payload: one node's events coalesced by the router, oldest first."""

    faults: list[RoutedFault]
    routed_at: datetime | None = None


@dataclass
class IncidentPolicy:
    """The `PolicySettings` knobs one incident runs with, fixed at its start (kept in history).

    Built by `from_settings` from the operator's `[policy]` section; every default is
    `PolicySettings`' own (one place). Units: seconds for every `_s` field.
    """

    observe_only: bool = policy_default("observe_only")
    repair_escalation_s: float = policy_default("repair_escalation_s")
    settle_s: float = policy_default("settle_s")
    diag_timeout_s: float = policy_default("diag_timeout_s")
    close_after_idle_s: float = policy_default("close_after_idle_s")
    debounce_s: float = policy_default("debounce_s")
    app_xid_repeats: int = policy_default("app_xid_repeats")
    app_xid_window_s: float = policy_default("app_xid_window_s")
    sbe_events_per_window: int = policy_default("sbe_events_per_window")
    sbe_window_s: float = policy_default("sbe_window_s")
    recovery_settle_s: float = policy_default("recovery_settle_s")
    ticket_poll_s: float = policy_default("ticket_poll_s")
    close_info_after_s: float = policy_default("close_info_after_s")
    permit_rerequest_s: float = policy_default("permit_rerequest_s")
    notify: bool = True
    """Notification channels are configured (`[notify]`): the incident starts `notify` activities.
    False: it starts none (no activity per event in a deployment that notifies nobody)."""

    @classmethod
    def from_settings(cls, p: PolicySettings, notify: bool = True) -> "IncidentPolicy":
        from dataclasses import fields

        return cls(**{f.name: getattr(p, f.name) for f in fields(cls) if f.name != "notify"}, notify=notify)


# ------------------------------------------------------------------ NodeRemediation's state


@dataclass
class FaultRecord:
    """One condition recorded by an incident (repeats counted, not copied)."""

    event_id: str
    kind: str
    code: int | None
    severity: Severity
    component: Component
    device: str | None
    healthy: bool
    raw: str
    message: str
    observed_at: datetime
    fault_class: str
    immediate_action: str
    drain: bool
    source: str
    count: int = 1
    times: list[datetime] = field(default_factory=list)
    """observed_at of the most recent occurrences (bounded), for the repeat/rate rules."""
    arrived_at: datetime | None = None
    """Workflow time the first occurrence arrived (debounce runs from here)."""
    clearable: bool = False
    last_seq: int = 0
    """Arrival order of the latest occurrence (`IncidentState.arrivals`)."""
    stream_seq: int | None = None
    """Fault-stream sequence of the first occurrence (the full `raw` text: `fleetmend show`, the NATS tools)."""
    urgency: Urgency = Urgency.NOW
    recovery: Recovery = Recovery.DIAGNOSE
    verify: list[str] = field(default_factory=list)
    history: History | None = None
    """From the catalog row (`Verdict`): how urgently, what recovery, which checks, which history rule."""

    @property
    def key(self) -> ConditionKey:
        return ConditionKey(self.kind, self.code, self.device)

    def view(self) -> dict[str, Any]:
        """JSON-safe dict (enums as strings, times ISO-8601): status and evidence."""
        d = {k: v for k, v in self.__dict__.items() if k not in ("urgency", "recovery", "verify", "history")}
        d["severity"], d["component"] = self.severity.value, self.component.value
        d["observed_at"] = iso(self.observed_at)
        d["times"] = [iso(t) for t in self.times]
        d["arrived_at"] = iso(self.arrived_at)
        return d


@dataclass
class TimelineEntry:
    at: datetime
    phase: Phase
    text: str
    by: str | None = None

    def view(self) -> dict[str, Any]:
        return {"at": iso(self.at), "phase": self.phase.value, "text": self.text, "by": self.by}


@dataclass
class DiagOutcome:
    """The last diagnostics an incident ran: the agent's report, or why there is none."""

    result: DiagResult
    report: DiagReport | None = None
    error: str | None = None

    def view(self) -> dict[str, Any]:
        d: dict[str, Any] = self.report.model_dump(mode="json") if self.report is not None else {"checks": []}
        d["result"] = self.result.value
        if self.error is not None:
            d["error"] = self.error
        return d

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.report.checks if c.result is DiagResult.FAIL] if self.report else []


@dataclass
class PermitDecision:
    granted: bool
    reason: str
    lemon: str | None = None
    """Set when the node is a lemon (the reason): the incident goes to RMA instead of recovery."""
    infra_incident: str | None = None
    queued: bool = False
    """Neither granted nor denied yet (`reason` says why it waits): the decision follows as a `permit`
    signal."""


@dataclass
class IncidentState:
    cluster: str
    node: str
    phase: Phase = Phase.TRIAGE
    outcome: Outcome | None = None
    drained: bool = False
    drain_owned: bool = False
    operator_drained: bool = False
    ticket: str | None = None
    ticket_url: str | None = None
    fault_class: str | None = None
    severity: Severity = Severity.INFO
    opened_at: datetime | None = None
    closed_at: datetime | None = None
    faults: list[FaultRecord] = field(default_factory=list)
    faults_dropped: int = 0
    duplicates: int = 0
    seen_ids: list[str] = field(default_factory=list)
    timeline: list[TimelineEntry] = field(default_factory=list)
    last_diag: DiagOutcome | None = None
    repair_attempts: int = 0
    arrivals: int = 0
    """Counter behind `FaultRecord.last_seq` (one step per absorbed condition)."""
    run: int = 1
    decisions: list[str] = field(default_factory=list)
    """Rules that fired (policy.decide reasons), each noted once."""
    drained_at: datetime | None = None
    """Workflow time the drain took effect (MTTR runs from here)."""
    urgency: Urgency | None = None
    recovery: Recovery | None = None
    device: str | None = None
    permit_requested: bool = False
    permit_requested_at: datetime | None = None
    permit_held: bool = False
    permit: PermitDecision | None = None
    lemon: str | None = None
    recovery_tried: list[RecoveryOp] = field(default_factory=list)
    recovery_log: list[str] = field(default_factory=list)


@dataclass
class IncidentInput:
    cluster: str
    node: str
    policy: IncidentPolicy = field(default_factory=IncidentPolicy)
    carried: IncidentState | None = None
    """State carried across continue-as-new."""
    pending: list[RoutedFault] = field(default_factory=list)


# ------------------------------------------------------------------ CLI → NodeRemediation


@dataclass
class RepairedCommand:
    """`mark_repaired`: the hardware was repaired; verification runs next."""

    by: str
    """Who sent it (CLI user@host, or `ticket:<id>`); recorded in history for audit."""
    note: str = ""
    ticket: str | None = None


@dataclass
class RetestCommand:
    """`force_retest`: run the verification diagnostics now."""

    by: str
    note: str = ""


@dataclass
class AbortCommand:
    """`abort`: close the incident now; `undrain` returns a node fleetmend drained."""

    by: str
    note: str = ""
    undrain: bool = False


@dataclass
class IncidentStatus:
    """The `status` query's answer: JSON-safe views (times ISO-8601 to the second)."""

    workflow_id: str
    node: str
    cluster: str
    phase: Phase
    outcome: Outcome | None
    drained: bool
    ticket: str | None
    fault_class: str | None
    severity: Severity
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
    drained_at: str | None = None
    """When fleetmend drained the node (None: never drained by this incident)."""


# ------------------------------------------------------------------ activities: scheduler

OWNER_FLEETMEND = "fleetmend"
OWNER_OPERATOR = "operator"


@dataclass
class DrainRequest:
    cluster: str
    node: str
    reason: str
    incident_id: str
    wait_drained_s: float = 0.0
    """Seconds `drain_node` waits (heartbeating) for DRAINING → DRAINED, i.e. running jobs to end.
    0 returns as soon as the drain is set (the node may still be `draining`)."""
    observed_at: datetime | None = None
    """When the fault that caused the drain was observed (the event's `observed_at`); given, the
    activity observes `fleetmend_time_to_quarantine_seconds`."""


@dataclass
class PermitDrainRequest:
    """`Activity.DRAIN_WITH_PERMIT`: ask `permit`'s guard; when it grants, issue `drain`."""

    permit: "PermitRequest"
    drain: DrainRequest


@dataclass
class PermitDrainResult:
    decision: PermitDecision
    drain: "DrainResult | None" = None
    """The drain issued on the grant; None when the decision is not a grant (queued or denied)."""


@dataclass
class DrainResult:
    node: str
    drained: bool
    """The node is (now) drained or draining (or down): no new work lands on it."""
    owned: bool
    """fleetmend set this drain (reason carries the prefix / KV entry owner is fleetmend)."""
    operator_drained: bool
    """Someone else drained (or downed) it first; fleetmend leaves it and never undrains it."""
    state: str
    """Normalized state: idle, allocated, mixed, draining, drained, down, … (`*` = not responding)."""
    detail: str
    reason: str = ""
    """The scheduler's current drain reason (without Slurm's `[user@time]` suffix)."""
    raw_state: str = ""
    """The scheduler's own state text, e.g. Slurm `ALLOCATED+DRAIN`."""


@dataclass
class UndrainRequest:
    cluster: str
    node: str
    incident_id: str
    drained_at: datetime | None = None
    """When the node was drained; given, a successful undrain observes `fleetmend_mttr_seconds`."""


@dataclass
class UndrainResult:
    node: str
    resumed: bool
    """True only when this call returned a fleetmend-owned drain to service."""
    state: str
    detail: str
    operator_drained: bool = False
    """The drain belongs to someone else and was left in place (resumed is False)."""


@dataclass
class NodeInfo:
    """One row of `list_nodes()` (for `fleetmend nodes` / `fleetmend status`)."""

    name: str
    state: str
    reason: str
    owner: str | None
    """"fleetmend", "operator", or None when the node is not drained."""
    incident_id: str | None = None


# ------------------------------------------------------------------ activities: tickets


@dataclass
class TicketRequest:
    incident_id: str
    cluster: str
    node: str
    title: str
    severity: str
    fault_class: str
    evidence: dict
    """Raw lines, classification, diagnostics report: stored (and sent) in full."""


@dataclass
class TicketRef:
    ticket_id: str
    url: str | None
    created: bool
    """False when the incident already had a ticket (idempotent re-file)."""


@dataclass
class TicketUpdate:
    ticket_id: str
    incident_id: str
    status: str
    comment: str


@dataclass
class TicketStatus:
    """What `poll_ticket` reports: the ticket system's own status and whether it means repaired."""

    ticket_id: str
    status: str
    """The remote status name as the ticket system says it (Jira "Done", a webhook's "repaired", …)."""
    repaired: bool
    """`status` is one of `tickets.repaired_statuses` (case-insensitive)."""
    url: str | None = None
    detail: str = ""


# ------------------------------------------------------------------ activities: diagnostics, recovery


@dataclass
class DiagActivityRequest:
    cluster: str
    node: str
    level: DiagLevel = DiagLevel.QUICK
    checks: list[str] | None = None
    timeout_s: float = 120.0
    incident_id: str | None = None


@dataclass
class RecoveryActivityRequest:
    cluster: str
    node: str
    op: RecoveryOp
    pci_bus_id: str | None = None
    incident_id: str | None = None
    timeout_s: float = 120.0
    """Reply wait; `nvidia-smi -r` takes seconds, a reboot request is answered before the reboot."""


# ------------------------------------------------------------------ FleetGuard


@dataclass
class GuardPolicy:
    """Blast-radius policy (`from_settings`), carried by every request: the newest wins. Defaults are
    `PolicySettings`' own."""

    max_drained_nodes: int = policy_default("max_drained_nodes")
    max_drained_percent: float = policy_default("max_drained_percent")
    max_drained_per_rack: int = policy_default("max_drained_per_rack")
    cluster_nodes: int | None = policy_default("cluster_nodes")
    breaker_distinct_nodes: int = policy_default("breaker_distinct_nodes")
    breaker_window_s: float = policy_default("breaker_window_s")
    domain_incident_nodes: int = policy_default("domain_incident_nodes")
    domain_window_s: float = policy_default("domain_window_s")
    lemon_repairs: int = policy_default("lemon_repairs")
    lemon_window_s: float = policy_default("lemon_window_s")
    observe_only: bool = policy_default("observe_only")
    permit_reconcile_s: float = policy_default("permit_reconcile_s")
    fast_drain: bool = policy_default("fast_drain")
    topology_nodes: int = 0
    """Nodes the topology file lists (the worker counts them; the file itself stays out of history)."""

    @classmethod
    def from_settings(cls, p: PolicySettings, topology_nodes: int = 0) -> "GuardPolicy":
        from dataclasses import fields

        return cls(**{f.name: getattr(p, f.name) for f in fields(cls) if f.name != "topology_nodes"},
                   topology_nodes=topology_nodes)


@dataclass
class PermitRequest:
    cluster: str
    node: str
    severity: Severity
    fault_class: str
    reason: str = ""
    rack: str | None = None
    domains: list[str] = field(default_factory=list)
    """`rack:…`, `leaf:…`, `pdu:…` from the topology (attached by the activity)."""
    policy: GuardPolicy = field(default_factory=GuardPolicy)
    requested_at: datetime | None = None
    """When the incident first asked (UTC); the queue keeps its oldest."""
    preclaimed: bool = False
    """The router already drained the node under a slot of the permit pool (`policy.fast_drain`): the
    guard adopts it as held (it is drained; the pool kept the budget) instead of deciding."""
    pool_router: dict[str, str | None] | None = None
    """`policy.fast_drain`: the router's holders in the permit pool (node → rack) when the request was
    sent; the guard counts those it has not adopted yet against the budget and the rack caps, so it does
    not grant a slot the router already took. None: no view (no pool, or an older worker)."""
    forwarded: bool = False
    """Sent by the router (`GuardApi.REQUEST_PERMITS`) for a node that must drain now and got no slot in
    the permit pool, before its incident asks: the guard queues it at once (a burst is visible in
    `fleetmend status` within seconds, not after every incident's first workflow task) and keeps its
    own policy (the router's settings do not replace the worker's). The incident's own request, which
    follows, keeps the queue place."""


@dataclass
class PermitRelease:
    cluster: str
    node: str
    outcome: Outcome
    fault_class: str = ""
    returned: bool = False
    """True when the node went back to service after a repair (counts toward the lemon rule)."""


@dataclass
class GuardCommand:
    """`reset_breaker`, `pause`, `resume`: who (`by`, for the audit trail) and why."""

    by: str
    note: str = ""


@dataclass
class PermitReleaseCommand:
    """`release_permit` (`fleetmend breaker release NODE`): free NODE's permit or queued request by hand."""

    by: str
    node: str
    note: str = ""


@dataclass
class RunningIncidents:
    """`running_incidents` activity: `nodes` to check (None: every running incident of the cluster)."""

    cluster: str
    nodes: list[str] | None = None


@dataclass
class RunningIncident:
    node: str
    phase: Phase | None = None
    """The incident's `FleetPhase` (None: not published yet, or not a phase this version knows)."""
    severity: Severity | None = None
    fault_class: str = ""
    rack: str | None = None
    domains: list[str] = field(default_factory=list)


@dataclass
class GuardPhase(StrEnum):
    """FleetGuard's `FleetPhase` search attribute."""

    GUARDING = "guarding"
    BREAKER_TRIPPED = "breaker_tripped"
    PAUSED = "paused"


@dataclass
class Held:
    node: str
    severity: Severity
    fault_class: str
    rack: str | None
    granted_at: datetime

    def to_dict(self) -> dict[str, Any]:
        """The shape `GuardStatus.held` shows: enums as values, times as `iso`."""
        return {"node": self.node, "severity": self.severity.value, "fault_class": self.fault_class,
                "rack": self.rack, "granted_at": iso(self.granted_at)}


@dataclass
class Queued:
    node: str
    severity: Severity
    fault_class: str
    rack: str | None
    domains: list[str]
    requested_at: datetime
    reason: str = ""
    counted: bool = True
    """False for an entry rebuilt from a running incident (`FleetGuard._rebuild`): its fault was not
    counted toward the breaker and the failure domains yet, so its incident's next request counts it.
    A counted entry's later requests are re-asks (patch reask-not-a-fault)."""

    def to_dict(self) -> dict[str, Any]:
        """The shape `GuardStatus.queue` shows: enums as values, times as `iso`."""
        return {"node": self.node, "severity": self.severity.value, "fault_class": self.fault_class,
                "rack": self.rack, "domains": list(self.domains), "requested_at": iso(self.requested_at),
                "reason": self.reason}


@dataclass
class InfraIncident:
    domain: str
    opened_at: datetime
    last_fault_at: datetime
    nodes: list[str]
    ticket: str | None = None
    closed_at: datetime | None = None

    def to_dict(self) -> dict[str, Any]:
        """The shape `GuardStatus.infra_incidents` shows: times as `iso`."""
        return {"domain": self.domain, "opened_at": iso(self.opened_at), "last_fault_at": iso(self.last_fault_at),
                "nodes": list(self.nodes), "ticket": self.ticket, "closed_at": iso(self.closed_at)}


@dataclass
class GuardState:
    cluster: str
    policy: GuardPolicy = field(default_factory=GuardPolicy)
    held: list[Held] = field(default_factory=list)
    queue: list[Queued] = field(default_factory=list)
    seen_nodes: list[str] = field(default_factory=list)
    recent: list[tuple[str, datetime]] = field(default_factory=list)
    """(node, time) of drain-worthy requests within the breaker/domain windows, oldest first (appended at
    workflow time, expired from the front: `FleetGuard._prune`)."""
    breaker_tripped: bool = False
    breaker_reason: str | None = None
    breaker_tripped_at: datetime | None = None
    breaker_trips: int = 0
    paused: bool = False
    paused_by: str | None = None
    infra: list[InfraIncident] = field(default_factory=list)
    node_domains: dict[str, list[str]] = field(default_factory=dict)
    """node → its failure domains, as the requests said (topology stays out of history)."""
    returns: dict[str, list[tuple[str, datetime]]] = field(default_factory=dict)
    """node → [(fault_class, time), …] of returns to service (lemon rule)."""
    log: list[str] = field(default_factory=list)
    grants: int = 0
    run: int = 1
    pool_published: str | None = None
    """What FleetGuard last wrote to the permit pool (budget, rack cap, open, why, closed domains), so it
    writes again only on a change (`policy.fast_drain`)."""
    pool_drop: list[str] = field(default_factory=list)
    """Nodes whose pool slot the guard still has to free (reconciliation, `breaker release`)."""
    pool_router: dict[str, str | None] = field(default_factory=dict)
    """The router's pool holders (node → rack) as the newest request saw them (`PermitRequest.pool_router`)."""


@dataclass
class PoolSync:
    """`Activity.SYNC_PERMIT_POOL`: FleetGuard's write to its cluster's permit pool (`fleetmend.permits`)."""

    cluster: str
    budget: int
    rack_cap: int
    open: bool
    why: str = ""
    closed_domains: list[str] = field(default_factory=list)
    held: dict[str, str | None] = field(default_factory=dict)
    """The guard's permit holders (node → rack), written as holders only when the pool is new."""
    drop: list[str] = field(default_factory=list)


@dataclass
class PoolSynced:
    holders: int
    router_only: list[str] = field(default_factory=list)
    """Nodes the router drained under a pool slot that the guard does not hold yet (their incidents
    have not asked; shown in the guard's status)."""


GUARD_MAX_HISTORY_EVENTS = 2_000
"""FleetGuard continues-as-new past this many events: a storm of 1k nodes is ~6 events per node."""


@dataclass
class GuardInput:
    cluster: str
    policy: GuardPolicy = field(default_factory=GuardPolicy)
    carried: GuardState | None = None
    pending_requests: list[PermitRequest] = field(default_factory=list)
    pending_releases: list[PermitRelease] = field(default_factory=list)
    max_history_events: int = GUARD_MAX_HISTORY_EVENTS
    """Continue-as-new threshold (tests lower it)."""


@dataclass
class GuardStatus:
    cluster: str
    budget: int
    known_nodes: int
    held: list[dict]
    queue: list[dict]
    breaker_tripped: bool
    breaker_reason: str | None
    breaker_tripped_at: str | None
    paused: bool
    paused_by: str | None
    observe_only: bool
    infra_incidents: list[dict]
    recent_nodes: int
    log: list[str]
    router_only: list[str] = field(default_factory=list)
    """`policy.fast_drain`: nodes the router drained under a permit pool slot whose incident has not asked
    the guard yet (as of the guard's last pool write)."""


# ------------------------------------------------------------------ activities: notifications


class NotifyEvent(StrEnum):
    """What a human is told about (webhook, Slack, PagerDuty); `notify.events` picks which."""

    DRAINED = "drained"
    TICKET_FILED = "ticket_filed"
    BREAKER_OPEN = "breaker_open"
    LEMON = "lemon"
    RETURNED = "returned"


@dataclass
class Notification:
    """One notification, sent to every configured channel at most once per `dedup_key`.

    `dedup_key` is `fleetmend/<incident id>/<event>` (an incident's events) or
    `fleetmend/<cluster>/breaker/<tripped at>`; PagerDuty gets `alert_key` (the incident's one
    alert: drain and ticket trigger it, return to service resolves it).
    """

    event: NotifyEvent
    cluster: str
    summary: str
    dedup_key: str
    alert_key: str
    node: str | None = None
    severity: str = "info"
    """fleetmend severity (info, degraded, fatal); PagerDuty's is derived from it."""
    incident_id: str | None = None
    ticket: str | None = None
    ticket_url: str | None = None
    runbook: str | None = None
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class NotifyResult:
    sent: list[str] = field(default_factory=list)
    """Channels that accepted it now."""
    already: list[str] = field(default_factory=list)
    """Channels that had it already (a retried activity): not sent again."""

