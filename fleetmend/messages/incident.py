"""The router → `NodeRemediation` conversation and the incident's own typed state.

- router → `NodeRemediation`: `IncidentInput` (start), `FaultBatch` of `RoutedFault`s (signal `faults`),
  cut to the byte budget by `for_workflow`;
- `IncidentState`, `FaultRecord`, `TimelineEntry`: carried across continue-as-new;
- `Phase` and `Outcome`: what `fleetmend status` shows and how an incident ended.

No `from __future__ import annotations` here: the workflow sandbox resolves dataclass annotations
that are strings in its own module table, where they may be missing.
"""

from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any

from fleetmend.config import PolicySettings, policy_default
from fleetmend.diagnostics import DiagReport, DiagResult, RecoveryOp
from fleetmend.events import (
    Component,
    ConditionKey,
    FaultEvent,
    Recovery,
    Severity,
    Urgency,
    Verdict,
)
from fleetmend.messages.guard import PermitDecision
from fleetmend.messages.names import Outcome, Phase, iso

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
        return cls(**{f.name: getattr(p, f.name) for f in fields(cls) if f.name != "notify"}, notify=notify)




@dataclass
class FaultRecord:
    """One condition recorded by an incident (repeats counted, not copied), with the `Verdict` its
    event carried: the catalog's decision, made once by the producer or the router and read here whole
    (severity, fault class, drain, urgency, recovery, verification checks, history rule, source)."""

    event_id: str
    kind: str
    code: int | None
    component: Component
    device: str | None
    healthy: bool
    raw: str
    message: str
    observed_at: datetime
    verdict: Verdict
    count: int = 1
    times: list[datetime] = field(default_factory=list)
    """observed_at of the most recent occurrences (bounded), for the repeat/rate rules."""
    arrived_at: datetime | None = None
    """Workflow time the first occurrence arrived (debounce runs from here)."""
    last_seq: int = 0
    """Arrival order of the latest occurrence (`IncidentState.arrivals`)."""
    stream_seq: int | None = None
    """Fault-stream sequence of the first occurrence (the full `raw` text: `fleetmend show`, the NATS tools)."""
    wanted: str | None = None
    """A `config_drift_*` fault that can be set live (its attrs `fix` = live): the value the fix writes to
    its settings key (the record's `device`)."""

    @property
    def key(self) -> ConditionKey:
        return ConditionKey(self.kind, self.code, self.device)

    @property
    def severity(self) -> Severity:
        return Severity(self.verdict.severity)

    @property
    def fault_class(self) -> str:
        return self.verdict.fault_class

    @property
    def drain(self) -> bool:
        return self.verdict.drain

    @property
    def verify(self) -> list[str]:
        return list(self.verdict.verify)

    def view(self) -> dict[str, Any]:
        """JSON-safe dict (enums as strings, times ISO-8601): status and evidence. The verdict's
        severity, fault class, NVIDIA action, drain, source and clearable are shown flat beside the
        event's own fields."""
        v = self.verdict
        return {"event_id": self.event_id, "kind": self.kind, "code": self.code,
                "severity": Severity(v.severity).value, "component": self.component.value, "device": self.device,
                "healthy": self.healthy, "raw": self.raw, "message": self.message,
                "observed_at": iso(self.observed_at), "fault_class": v.fault_class,
                "immediate_action": v.immediate_action, "drain": v.drain, "source": v.source,
                "count": self.count, "times": [iso(t) for t in self.times], "arrived_at": iso(self.arrived_at),
                "clearable": v.clearable, "last_seq": self.last_seq, "stream_seq": self.stream_seq}


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
    attention_notified: bool = False
    """A fault that needs a person but drains nothing was notified (`NotifyEvent.ATTENTION`, once per incident)."""
    recovery_tried: list[RecoveryOp] = field(default_factory=list)
    live_fixes_tried: list[str] = field(default_factory=list)
    """Settings keys of `config_drift` faults this incident asked the agent to set live (once each)."""
    recovery_log: list[str] = field(default_factory=list)


@dataclass
class IncidentInput:
    cluster: str
    node: str
    policy: IncidentPolicy = field(default_factory=IncidentPolicy)
    carried: IncidentState | None = None
    """State carried across continue-as-new."""
    pending: list[RoutedFault] = field(default_factory=list)
    incident: int = 0
    """Which incident of this workflow chain: 0 for the first; a closing run that continues as new for the
    node's next incident (faults that arrived as it closed) counts it up, so the next incident's side
    effects (drain reason, ticket, notifications) get their own idempotency key (`NodeRemediation._incident_id`)."""
    permit_forwarded: bool = False
    """The router found no pool slot for this node's must-drain-now fault and forwards its permit request
    to FleetGuard right after this start: the incident does not ask again at once (in a burst of
    thousands, one signal and one activity less each), only after `FORWARDED_FIRST_WAIT_S` without an
    answer."""
