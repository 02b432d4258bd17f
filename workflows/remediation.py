"""`NodeRemediation`: one durable incident per node, id `remediate/<cluster>/<node>`.

    triage ─(drain-worthy fault)→ awaiting_permit → draining → diagnosing → recovering
        → awaiting_repair ⇄ verifying → returning → closed
    triage ─(only application-side faults; quiet for policy.close_after_idle_s)→ closed ("recorded")

Started by the router with signal-with-start (`faults` signal); later faults of the same node join
the open incident. Human commands are updates with validators, so bad input never reaches history:
`mark_repaired` (`RepairedCommand`), `force_retest` (`RetestCommand`), `abort` (`AbortCommand`);
FleetGuard takes `reset_breaker`, `pause`, `resume`. The `status` query answers `IncidentStatus`.
Every message and the state are defined in `fleetmend.messages`; activities are called by the names
in `fleetmend.messages.Activity` (this package imports no activity module).

Deterministic code only: every side effect is an activity (activities/), time is `workflow.now()`,
logs go through `workflow.logger`. History stays bounded: after `MAX_HISTORY_EVENTS` (or when the
server suggests it) the workflow continues-as-new at a waiting point, carrying its state.

Policy (fleetmend/policy.py holds the pure history rules, workflows/fleetguard.py the fleet budget):
triage applies the history rules (`policy.decide`: XID 13/31 repeats, sympathetic XID 45, XID 48 with
63/64, SBE rate / pending remap → drain when idle, debounce of clearable faults) and notes every rule
that fired; `awaiting_permit` asks the cluster's FleetGuard for a drain permit and waits for its
`permit` signal (denied: observe-only or an infrastructure incident → closes without draining);
`recovering` tries the catalog's recovery (GPU reset, then reboot) with a settle period and a
verification chosen from the original fault before filing a ticket; a lemon node (FleetGuard's
per-node history) goes to RMA at once. Every close gives the permit back.

Versioning: running incidents keep their command sequence. The histories in
tests/histories/remediation_*.json are the 0.2 baseline, recorded once with this code (every earlier
patch folded in; nothing was deployed). Every later change to the command order goes behind
`workflow.patched(<id>)` with a history recorded before the change, listed here:

==========================  =====================================================================
patch id                    what changed
==========================  =====================================================================
live-fix                    a `config_drift` fault that can be set live (governor, nvidia_peermem,
                            NUMA balancing, THP, IRQ affinity, persistence, clocks, power limit) is
                            fixed in place by the agent (`reconfigure_node`, dry run unless the
                            agent's policy.reconfigure), once per key, and the incident closes
                            without a drain when the next fingerprint agrees (before: recorded
                            only). History: remediation_config_drift_recorded.json
close-drops-seen            faults still waiting when the incident closes open the node's next
                            incident only if this one has not seen them (before: a router's
                            redelivery of an event already recorded was carried into a new incident,
                            which drained the node again after the operator's abort; found by a
                            fresh-eyes trial). History: remediation_redelivered_after_close.json
repeat-part                 a drain whose result names a repeat part (`DrainResult.repeat_part`: the
                            incident ledger saw the same part, by serial, fail with the same fault
                            class within policy.repeat_part_window_days) goes to RMA like a lemon:
                            no recovery loop, an RMA ticket, a `lemon` notification (before: the
                            field did not exist). Taken only when the field is set, which no earlier
                            history holds: the baseline histories replay unchanged.
attention                   a recorded fault that drains nothing but that only a person can act on
                            (`ATTENTION_ACTIONS`: CHECK_MECHANICALS, CONTACT_SUPPORT, UPDATE_SWFW...;
                            degraded or worse, not cleared) starts one `attention` notification per
                            incident (before: nobody was told, e.g. of cabling changed across a
                            repair). History: remediation_attention_recorded.json
==========================  =====================================================================
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeUpdate
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from fleetmend.catalog.runbooks import runbook_ref
    from fleetmend.diagnostics import (
        DiagLevel,
        DiagReport,
        DiagResult,
        RecoveryOp,
        RecoveryReport,
        RecoveryResult,
        recovery_steps,
    )
    from fleetmend.events import MAX_CLOCK_SKEW_S, Recovery, Severity, Urgency, Verdict, condition_key
    from fleetmend.fingerprint import ReconfigureReport, ReconfigureRequest
    from fleetmend.messages import (
        KEY_CLUSTER,
        KEY_DRAINED,
        KEY_FAULT_CLASS,
        KEY_NODE,
        KEY_PHASE,
        KEY_SEVERITY,
        KEY_TICKET,
        MAX_PENDING_FAULTS,
        MAX_PENDING_HARD,
        AbortCommand,
        Activity,
        DiagActivityRequest,
        DiagOutcome,
        DrainRequest,
        DrainResult,
        FaultBatch,
        FaultRecord,
        IncidentInput,
        IncidentPolicy,
        IncidentState,
        IncidentStatus,
        Notification,
        NotifyEvent,
        NotifyResult,
        Occurrence,
        Outcome,
        PermitDecision,
        PermitRelease,
        PermitRequest,
        Phase,
        RecoveryActivityRequest,
        RemediationApi,
        RepairedCommand,
        RetestCommand,
        RoutedFault,
        TicketRef,
        TicketRequest,
        TicketStatus,
        TicketUpdate,
        TimelineEntry,
        UndrainRequest,
        UndrainResult,
        iso,
    )
    from fleetmend.policy import Decision, FaultView, RuleSettings, decide

NOTIFY_RETRY = RetryPolicy(initial_interval=timedelta(seconds=2), backoff_coefficient=2.0,
                           maximum_interval=timedelta(minutes=2), maximum_attempts=10)
"""A channel down is retried for ~10 minutes, then noted in the timeline; the incident never waits on it
(the activity runs alongside; the run waits for it only before it ends)."""

PATCH_CLOSE_DROPS_SEEN = "close-drops-seen"
PATCH_LIVE_FIX = "live-fix"
PATCH_REPEAT_PART = "repeat-part"
PATCH_ATTENTION = "attention"
"""A recorded fault that drains nothing but asks a human to act notifies (`NotifyEvent.ATTENTION`)."""

ATTENTION_ACTIONS = frozenset({"CHECK_MECHANICALS", "CONTACT_SUPPORT", "UPDATE_SWFW", "CHECK_UVM",
                               "WORKFLOW_NVLINK_ERR"})
"""Immediate actions that only a person can take (cabling, a vendor case, a firmware update, NVIDIA's NVLink
triage). A degraded or worse fault with one of them that drains nothing is otherwise seen only by whoever reads
`fleetmend status`; `RESTART_APP` (the job's owner), `IGNORE`, `NONE` and what automation does in service
(`DIAGNOSE_IN_SERVICE`, `RESET_GPU_WHEN_IDLE`, live fixes) notify nobody."""

FORWARDED_FIRST_WAIT_S = 30.0
"""An incident whose permit request the router forwarded asks FleetGuard itself after this long without
an answer (the forward may have failed), then every `permit_rerequest_s`."""
MAX_HISTORY_EVENTS = 5_000
"""Continue-as-new past this many history events (Temporal warns at 10k, limits at 50k)."""
MAX_RUN_BYTES = 64 * 1024
"""Continue-as-new once the run's history grew by this many bytes since it started (the start event, with
the carried state, is not counted). A run evicted from the worker's cache (`worker.max_cached_workflows`)
replays its whole history on its next task, and a storm's faults arrive as a few large signals: by the
event count alone one run took in ~190 KiB of faults in a few hundred events (bench/RESULTS.md, "Worker
memory"). This bounds what an evicted run replays."""
MAX_FAULTS_KEPT = 100
"""Fault records kept in state; older ones are summarised in `faults_dropped` (bounded history)."""
MAX_SEEN_IDS = 2_000
"""Event ids remembered for de-duplication of redelivered events (router retries, agent re-sends)."""
MAX_TIMES_KEPT = 32
"""Occurrence times kept per fault record (enough for the repeat/rate rules' thresholds)."""

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


@workflow.defn(name="NodeRemediation")
class NodeRemediation:
    def __init__(self) -> None:
        self._s: IncidentState | None = None
        self._pending: list[RoutedFault] = []
        self._pending_dropped = 0  # occurrences dropped by _bound_pending, added to faults_dropped
        self._repaired: RepairedCommand | None = None
        self._retest: RetestCommand | None = None
        self._abort: AbortCommand | None = None
        self._policy = IncidentPolicy()
        self._sa_last: tuple[object, ...] | None = None
        self._sa_flush_due = False  # an upsert is queued for the end of this workflow task
        self._notifications: list = []
        self._run_bytes0 = 0  # history size in bytes when this run started (start event + carried state)
        self._forwarded = False  # IncidentInput.permit_forwarded of a new incident
        self._incident_no = 0  # IncidentInput.incident: which incident of this workflow chain (`_incident_id`)
        self._noted_arrivals = -1  # `IncidentState.arrivals` when triage last noted "recorded, no drain"

    # ---------------------------------------------------------------- messages
    @workflow.signal(name=RemediationApi.FAULTS)
    def faults(self, batch: FaultBatch) -> None:
        self._pending.extend(batch.faults)
        if len(self._pending) > MAX_PENDING_FAULTS:
            self._bound_pending()

    def _bound_pending(self) -> None:
        """Keep the faults waiting to be absorbed (signal payloads, the continue-as-new input) within
        the byte budget: merge repeats of one condition, keep the text only of drain-worthy faults
        beyond `MAX_PENDING_FAULTS`, and past `MAX_PENDING_HARD` drop the oldest others (counted)."""
        merged: dict[tuple[object, bool], RoutedFault] = {}
        order: list[tuple[object, bool]] = []
        for rf in self._pending:
            k = (condition_key(rf.event), rf.event.healthy)
            if k in merged:
                head = merged[k]
                head.repeats.append(Occurrence(event_id=rf.event.event_id, observed_at=rf.event.observed_at))
                head.repeats.extend(rf.repeats)
                order.remove(k)
            else:
                merged[k] = RoutedFault(event=rf.event, repeats=list(rf.repeats),
                                        stream_seq=rf.stream_seq)
            order.append(k)  # ordered by the latest occurrence, as the router orders a batch
        pending = [merged[k] for k in order]
        if len(pending) > MAX_PENDING_FAULTS:
            cut = len(pending) - MAX_PENDING_FAULTS
            pending = [rf if i >= cut or _drains(rf) else
                       RoutedFault(event=rf.event.model_copy(update={"raw": "", "attrs": {},
                                                                     "message": rf.event.message[:80]}),
                                   repeats=rf.repeats, stream_seq=rf.stream_seq)
                       for i, rf in enumerate(pending)]
        while len(pending) > MAX_PENDING_HARD:
            i = next((i for i, rf in enumerate(pending) if not _drains(rf)), 0)
            self._pending_dropped += 1 + len(pending[i].repeats)
            del pending[i]
        self._pending = pending

    @workflow.signal(name=RemediationApi.PERMIT)
    def permit(self, decision: PermitDecision) -> None:
        """FleetGuard's answer to this node's drain-permit request."""
        self._state.permit = decision

    @workflow.query(name=RemediationApi.STATUS)
    def status(self) -> IncidentStatus:
        s = self._state
        return IncidentStatus(
            workflow_id=workflow.info().workflow_id, node=s.node, cluster=s.cluster, phase=s.phase,
            outcome=s.outcome, drained=s.drained, ticket=s.ticket, fault_class=s.fault_class,
            severity=s.severity, opened_at=iso(s.opened_at), closed_at=iso(s.closed_at),
            faults=[f.view() for f in s.faults], faults_dropped=s.faults_dropped,
            duplicates=s.duplicates, timeline=[t.view() for t in s.timeline[-50:]],
            last_diag=s.last_diag.view() if s.last_diag else None, operator_drained=s.operator_drained, permit_held=s.permit_held,
            decisions=list(s.decisions), recovery_log=list(s.recovery_log), lemon=s.lemon,
            drained_at=iso(s.drained_at))

    @workflow.update(name=RemediationApi.MARK_REPAIRED)
    async def mark_repaired(self, cmd: RepairedCommand) -> str:
        self._repaired = cmd
        self._note(f"marked repaired{' (ticket ' + cmd.ticket + ')' if cmd.ticket else ''}"
                   f"{': ' + cmd.note if cmd.note else ''}", by=cmd.by)
        return "repair recorded; verification will run"

    @mark_repaired.validator
    def _validate_repaired(self, cmd: RepairedCommand) -> None:
        self._require_by(cmd)
        if self._state.phase is not Phase.AWAITING_REPAIR:
            raise ValueError(f"node {self._state.node} is in phase {self._state.phase}, not awaiting_repair; "
                             "nothing to mark repaired")

    @workflow.update(name=RemediationApi.FORCE_RETEST)
    async def force_retest(self, cmd: RetestCommand) -> str:
        self._retest = cmd
        self._note("re-test requested", by=cmd.by)
        return "re-test scheduled"

    @force_retest.validator
    def _validate_retest(self, cmd: RetestCommand) -> None:
        self._require_by(cmd)
        if self._state.phase is not Phase.AWAITING_REPAIR:
            raise ValueError(f"node {self._state.node} is in phase {self._state.phase}; a re-test (the verification "
                             "diagnostics) can be forced only while awaiting_repair"
                             + (": in triage nothing is drained, so there is nothing to verify"
                                if self._state.phase is Phase.TRIAGE else ""))

    @workflow.update(name=RemediationApi.ABORT)
    async def abort(self, cmd: AbortCommand) -> str:
        self._abort = cmd
        self._note(f"abort requested{': ' + cmd.note if cmd.note else ''}", by=cmd.by)
        return "incident will close; " + ("node will be undrained" if cmd.undrain else
                                          "scheduler state left as is (a drain fleetmend made stays, and keeps "
                                          "its permit: `fleetmend breaker release NODE` returns it to service)")

    @abort.validator
    def _validate_abort(self, cmd: AbortCommand) -> None:
        self._require_by(cmd)
        if self._state.phase is Phase.CLOSED:
            raise ValueError(f"incident for {self._state.node} is already closed")

    # ---------------------------------------------------------------- main
    @workflow.run
    async def run(self, inp: IncidentInput) -> IncidentStatus:
        self._policy = inp.policy
        self._incident_no = inp.incident
        self._forwarded = inp.permit_forwarded and inp.carried is None
        self._run_bytes0 = workflow.info().get_current_history_size()
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

        if s.phase == Phase.TRIAGE:
            await self._triage()
        if s.phase in (Phase.AWAITING_PERMIT, Phase.DRAINING):
            await self._drain()
        if s.phase in (Phase.DIAGNOSING, Phase.RECOVERING):
            await self._diagnose_and_ticket()
        while s.phase in (Phase.AWAITING_REPAIR, Phase.VERIFYING) and self._abort is None:
            if s.phase == Phase.AWAITING_REPAIR:
                await self._await_repair()
            if s.phase == Phase.VERIFYING:
                await self._verify()
        if s.phase == Phase.RETURNING:
            await self._return()
        if self._abort is not None and s.phase != Phase.CLOSED:
            await self._do_abort()
        await workflow.wait_condition(workflow.all_handlers_finished)
        await self._notifications_done()
        if self._sa_flush_due:  # a queued upsert goes before the run's last command
            self._flush_search_attributes()
        if self._pending and workflow.patched(PATCH_CLOSE_DROPS_SEEN):
            self._pending = self._unseen(self._pending)
        if self._pending:
            # Faults that arrived as this incident closed open the node's next incident.
            workflow.continue_as_new(IncidentInput(cluster=s.cluster, node=s.node, policy=self._policy,
                                                   pending=self._pending, incident=self._incident_no + 1))
        return self.status()

    # ---------------------------------------------------------------- phases
    async def _triage(self) -> None:
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
                s.urgency, s.recovery = d.urgency, d.recovery
                s.severity = Severity.worst(s.severity, d.severity)
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
            await self._live_fixes()
            wait_s = self._policy.close_after_idle_s
            if self._policy.close_info_after_s and not any(
                    not f.healthy and f.severity is not Severity.INFO for f in s.faults):
                wait_s = min(wait_s, self._policy.close_info_after_s)  # only info readings / clearings
            if d.debounce:
                now = workflow.now()
                ends = [(f.arrived_at or now) + timedelta(seconds=self._policy.debounce_s) for f in d.debounce]
                wait_s = max(1.0, min((e - now).total_seconds() for e in ends))
                self._details(f"debouncing {', '.join(sorted({f.fault_class for f in d.debounce}))}: drains in "
                              f"{wait_s:.0f}s unless it clears")
            else:
                if self._noted_arrivals != s.arrivals:  # once per new fault, not per wait
                    self._noted_arrivals = s.arrivals
                    classes = sorted({f.fault_class for f in s.faults if not f.healthy})
                    self._note(f"recorded, no drain: {', '.join(classes) or 'clearing events only'} "
                               f"({len(s.faults)} condition(s)); closes after {wait_s:.0f}s without a new fault")
                    self._notify_attention()
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
        views = [FaultView(kind=f.kind, code=f.code, device=f.device, verdict=f.verdict,
                           times=list(f.times or [f.observed_at]), cleared=self._cleared(f), message=f.message,
                           arrived_at=f.arrived_at)
                 for f in s.faults if not f.healthy]
        rules = RuleSettings(app_xid_repeats=p.app_xid_repeats, app_xid_window_s=p.app_xid_window_s,
                             sbe_events_per_window=p.sbe_events_per_window, sbe_window_s=p.sbe_window_s,
                             max_future_s=MAX_CLOCK_SKEW_S)
        return decide(views, workflow.now(), rules, debounce_s=p.debounce_s)

    def _note_decisions(self, d: Decision) -> None:
        s = self._state
        for reason in d.reasons:
            if reason not in s.decisions:
                s.decisions.append(reason)
                del s.decisions[:-50]
                self._note(f"rule: {reason}")

    async def _await_permit(self) -> bool:
        """Ask FleetGuard for a drain permit (`request_drain_permit`) and wait for its `permit` signal,
        asking again every `permit_rerequest_s` (idempotent: a queued node keeps its place; a guard that
        was terminated or reset learns of it again). Returns True when granted; on a denial the incident
        is closed (observe-only, infrastructure incident); on abort it returns False."""
        s = self._state
        if s.permit_held:
            return True
        if not s.permit_requested:
            s.permit_requested, s.permit_requested_at = True, self._now()
        req = PermitRequest(cluster=s.cluster, node=s.node, severity=s.severity, fault_class=s.fault_class or "",
                            reason="; ".join(s.decisions[-3:]), requested_at=s.permit_requested_at)
        wait_s = self._policy.permit_rerequest_s
        if self._forwarded:  # the router sent our request already; ask ourselves only if no answer comes
            self._forwarded = False
            wait_s = min(wait_s, FORWARDED_FIRST_WAIT_S)
            self._note(f"waiting for a drain permit from FleetGuard ({s.severity} {s.fault_class}): the router "
                       "queued the request (no permit pool slot was free); `fleetmend breaker status` shows the "
                       "pool and the queue")
        else:
            await self._ask_permit(req)
            self._note(f"waiting for a drain permit from FleetGuard ({s.severity} {s.fault_class}): the fleet's "
                       "blast-radius budget decides; `fleetmend breaker status` shows the pool and the queue")
        while True:
            if s.permit is None and self._abort is None and not self._pending:
                try:
                    await workflow.wait_condition(
                        lambda: s.permit is not None or self._abort is not None or bool(self._pending),
                        timeout=timedelta(seconds=wait_s))
                except asyncio.TimeoutError:  # a guard terminated or reset lost us: ask again (idempotent)
                    await self._ask_permit(req)
                    wait_s = self._policy.permit_rerequest_s
                    continue
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
                s.lemon, s.recovery = decision.lemon, Recovery.RMA
                self._note(decision.lemon)
                self._notify(NotifyEvent.LEMON, f"{s.node}: lemon node, straight to RMA ({decision.lemon})")
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

    async def _ask_permit(self, req: PermitRequest) -> None:
        await workflow.execute_activity(
            Activity.REQUEST_DRAIN_PERMIT, req, start_to_close_timeout=timedelta(seconds=30),
            retry_policy=ACTIVITY_RETRY, summary=f"drain permit for {self._state.node}")

    async def _drain(self) -> None:
        s = self._state
        if not await self._await_permit():
            return
        self._set_phase(Phase.DRAINING)
        res: DrainResult = await workflow.execute_activity(
            Activity.DRAIN_NODE, self._drain_request(), result_type=DrainResult,
            start_to_close_timeout=DRAIN_TIMEOUT, heartbeat_timeout=DRAIN_HEARTBEAT,
            retry_policy=ACTIVITY_RETRY, summary=f"drain {s.node}: {s.fault_class}")
        self._drain_state(res)
        if res.repeat_part and s.lemon is None and workflow.patched(PATCH_REPEAT_PART):
            s.lemon, s.recovery = res.repeat_part, Recovery.RMA  # the part came back unchanged and failed again
            self._note(res.repeat_part)
            self._notify(NotifyEvent.LEMON, f"{s.node}: repeat part, straight to RMA ({res.repeat_part})")
        if res.operator_drained:
            self._note(f"node already drained by an operator ({res.detail}); left as is, never undrained")
        else:
            self._note(f"drained ({res.state}): {res.detail}")
            if res.drained:
                self._notify(NotifyEvent.DRAINED, f"{s.node} drained: {s.fault_class} ({s.severity.value})")
        self._upsert()
        self._set_phase(Phase.DIAGNOSING)

    def _drain_request(self) -> DrainRequest:
        s = self._state
        reason = f"{s.fault_class} incident {self._incident_id}"
        if s.urgency is Urgency.WHEN_IDLE:
            reason += " (drain when idle: running jobs finish)"
        first = next((f for f in s.faults if f.drain and not f.healthy), None)
        return DrainRequest(cluster=s.cluster, node=s.node, reason=reason, incident_id=self._incident_id,
                            observed_at=first.observed_at if first else None)

    def _drain_state(self, res: DrainResult) -> None:
        s = self._state
        if res.drained:
            s.drained_at = self._now()
        s.drained = res.drained
        s.drain_owned = res.owned
        s.operator_drained = res.operator_drained

    async def _diagnose_and_ticket(self) -> None:
        s = self._state
        if s.phase == Phase.DIAGNOSING:
            report: DiagOutcome | None = await self._diagnostics("initial diagnostics")
            self._set_phase(Phase.RECOVERING)
        else:
            report = s.last_diag
        if await self._recover():
            self._set_phase(Phase.RETURNING)
            return
        if self._abort is not None:
            return
        evidence: dict[str, Any] = {
            "faults": [f.view() for f in s.faults],
            "raw": "\n".join(f.raw for f in s.faults if f.raw)[:32_000],
            "classification": {"fault_class": s.fault_class, "severity": s.severity.value},
            "diagnostics": report.view() if report else None,
            "workflow_id": workflow.info().workflow_id,
        }
        if s.decisions or s.recovery_log or s.lemon:
            evidence.update({"decisions": s.decisions, "recovery": s.recovery_log, "lemon": s.lemon})
        rma = s.lemon is not None or s.recovery is Recovery.RMA
        title = f"[fleetmend] {'RMA ' if rma else ''}{s.node}: {s.fault_class} ({s.severity})"
        ref: TicketRef = await workflow.execute_activity(
            Activity.FILE_TICKET, TicketRequest(incident_id=self._incident_id, cluster=s.cluster, node=s.node,
                                         title=title, severity=s.severity, fault_class=s.fault_class or "",
                                         evidence=evidence),
            result_type=TicketRef, start_to_close_timeout=timedelta(minutes=1), retry_policy=ACTIVITY_RETRY,
            summary=f"file ticket for {s.node}")
        s.ticket, s.ticket_url = ref.ticket_id, ref.url
        self._note(f"ticket {ref.ticket_id} {'filed' if ref.created else 'already filed'}")
        self._upsert()
        self._notify(NotifyEvent.TICKET_FILED, f"{title.removeprefix('[fleetmend] ')}: ticket {ref.ticket_id}, "
                                               "awaiting repair")
        self._set_phase(Phase.AWAITING_REPAIR)

    async def _recover(self) -> bool:
        """Recovery before RMA: the catalog's GPU reset (then a reboot) or reboot, each followed by a
        settle period and the verification chosen for the original fault. True when one held."""
        s, p = self._state, self._policy
        if s.lemon is not None or s.recovery is Recovery.RMA:
            self._recovery_note("no recovery attempt: " + (s.lemon or f"{s.fault_class}: catalog says RMA"))
            return False
        plan = recovery_steps(s.recovery)
        results: list[str] = []
        for op in plan:
            if op in s.recovery_tried:
                continue
            if self._aborted_recovery(op):
                return False
            s.recovery_tried.append(op)
            if op is RecoveryOp.RESET_GPU and not (s.device and ":" in s.device):
                self._recovery_note(f"reset_gpu skipped: no PCI bus id known for the faulty GPU ({s.device})")
                continue
            report = await self._recovery_activity(op)
            self._recovery_note(f"{op.value}: {report.result.value} ({report.detail[:300]})")
            results.append(f"{op.value} {report.result.value}")
            if self._aborted_recovery(None):
                return False
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
            result = verified.result
            if result in (DiagResult.PASS, DiagResult.NOT_APPLICABLE):
                self._recovery_note(f"recovered by {op.value}: verification {result.value}; returning to service")
                return True
            self._recovery_note(f"{op.value} did not hold: verification {result.value}")
        if plan and not any(r.endswith(RecoveryResult.APPLIED.value) for r in results):
            self._recovery_note(f"no recovery was applied ({', '.join(results) or 'no step could run'}); "
                                "escalating to a ticket")
        elif plan:
            self._recovery_note("recovery did not hold; escalating to a ticket")
        return False

    async def _live_fixes(self) -> None:
        """`config_drift` faults that can be set live and were not tried yet: ask the agent to set them and
        re-read them (`reconfigure_node`; dry run unless the agent's policy.reconfigure). Verified fixes clear
        with the next fingerprint (`config_drift_resolved`) and the incident closes without a drain; a dry run,
        a refusal or a fix that did not hold is noted and the fault stays recorded."""
        s = self._state
        fixes = {f.device: f.wanted for f in s.faults
                 if f.wanted is not None and f.device and not f.healthy and not self._cleared(f)
                 and f.device not in s.live_fixes_tried}
        if not fixes or not workflow.patched(PATCH_LIVE_FIX):
            return
        s.live_fixes_tried.extend(sorted(fixes))
        req = ReconfigureRequest(cluster=s.cluster, node=s.node, incident_id=self._incident_id,
                                 fixes=dict(sorted(fixes.items())), dry_run=False)
        try:
            rep: ReconfigureReport = await workflow.execute_activity(
                Activity.RECONFIGURE_NODE, req, result_type=ReconfigureReport,
                start_to_close_timeout=timedelta(seconds=req.timeout_s + 10), retry_policy=DIAG_RETRY,
                summary=f"live fix on {s.node}: {', '.join(sorted(fixes))}")
        except ActivityError as err:
            self._note(f"live fix not carried out: {err.cause or err}; the drift stays recorded")
            return
        for r in rep.results:
            what = ("verified" if r.verified else "did not hold") if r.applied else \
                ("dry run (the agent's policy.reconfigure is off)" if rep.dry_run else
                 ("already set" if r.verified else "not applied"))
            self._note(f"live fix {r.key}: {r.before!r} → {r.wanted!r}: {what}"
                       + (f" ({r.detail[:200]})" if r.detail else ""))
        if rep.verified and not rep.dry_run:
            self._note("live fix verified: the next fingerprint clears the drift; no drain")

    def _aborted_recovery(self, op: RecoveryOp | None) -> bool:
        """True when an abort arrived: the recovery plan stops before `op` (None: before verifying the
        step just run), so no GPU reset or reboot starts after the operator said stop."""
        if self._abort is None:
            return False
        self._recovery_note(f"{op.value} not started: the incident was aborted" if op is not None
                            else "not verified: the incident was aborted")
        return True

    async def _recovery_activity(self, op: RecoveryOp) -> RecoveryReport:
        s = self._state
        req = RecoveryActivityRequest(cluster=s.cluster, node=s.node, op=op,
                                      pci_bus_id=s.device if op is RecoveryOp.RESET_GPU else None,
                                      incident_id=self._incident_id)
        try:
            return await workflow.execute_activity(
                Activity.RESET_GPU if op is RecoveryOp.RESET_GPU else Activity.REBOOT_NODE, req,
                result_type=RecoveryReport,
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
        """Checks that prove the original fault gone (its catalog row's `verify`); None: every QUICK check."""
        s = self._state
        root = next((f for f in s.faults if f.fault_class == s.fault_class and not f.healthy), None)
        return (root.verify or None) if root is not None else None

    async def _await_repair(self) -> None:
        s = self._state
        self._details(f"awaiting repair: ticket {s.ticket}; signal with `fleetmend repaired {s.node}`")
        escalate_after = timedelta(seconds=self._policy.repair_escalation_s)
        poll = (timedelta(seconds=self._policy.ticket_poll_s)
                if self._policy.ticket_poll_s > 0 and s.ticket else None)
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
        report = await self._diagnostics("verification", checks=self._verify_checks())
        result = report.result
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
            self._set_phase(Phase.RETURNING)
        else:
            self._note(f"verification {result.value}; back to awaiting repair")
            await self._update_ticket("verification_failed", f"Verification {result.value}: {report.view()}")
            self._set_phase(Phase.AWAITING_REPAIR)

    async def _return(self) -> None:
        s = self._state
        if s.drain_owned and s.drained:
            res: UndrainResult = await workflow.execute_activity(
                Activity.UNDRAIN_NODE, UndrainRequest(cluster=s.cluster, node=s.node, incident_id=self._incident_id,
                                                      drained_at=s.drained_at),
                result_type=UndrainResult, start_to_close_timeout=DRAIN_TIMEOUT, heartbeat_timeout=DRAIN_HEARTBEAT,
                retry_policy=ACTIVITY_RETRY, summary=f"return {s.node} to service")
            s.drained = not res.resumed and s.drained
            self._note(f"undrain: {'resumed' if res.resumed else 'not resumed'} ({res.detail})")
        await self._update_ticket("resolved", "Verification passed; node returned to service.")
        if not s.operator_drained:
            self._notify(NotifyEvent.RETURNED, f"{s.node} returned to service: verification passed")
        await self._finish(Outcome.OPERATOR_OWNED if s.operator_drained else Outcome.RETURNED)

    async def _do_abort(self) -> None:
        s = self._state
        cmd = self._abort
        assert cmd is not None
        if cmd.undrain and s.drain_owned and s.drained:
            res: UndrainResult = await workflow.execute_activity(
                Activity.UNDRAIN_NODE, UndrainRequest(cluster=s.cluster, node=s.node, incident_id=self._incident_id,
                                                      drained_at=s.drained_at),
                result_type=UndrainResult, start_to_close_timeout=DRAIN_TIMEOUT, heartbeat_timeout=DRAIN_HEARTBEAT,
                retry_policy=ACTIVITY_RETRY, summary=f"undrain {s.node} (abort)")
            s.drained = not res.resumed and s.drained
            self._note(f"undrain: {'resumed' if res.resumed else 'not resumed'} ({res.detail})", by=cmd.by)
        if s.ticket:
            await self._update_ticket("aborted", f"Incident aborted by {cmd.by}: {cmd.note}")
        await self._finish(Outcome.ABORTED)

    # ---------------------------------------------------------------- helpers
    def _notify_attention(self) -> None:
        """Notify once per incident (`ATTENTION`) when it records, without a drain, a fault that is not info,
        not cleared, and whose immediate action only a person can take (`ATTENTION_ACTIONS`), e.g. a node back
        from a repair with its GPU-to-NIC placement moved (`config_drift_topology_repair`: check the cabling)."""
        s = self._state
        if s.attention_notified or not self._policy.notify:
            return
        need = [f for f in s.faults if not f.healthy and f.severity is not Severity.INFO and not self._cleared(f)
                and f.verdict.immediate_action in ATTENTION_ACTIONS]
        if not need or not workflow.patched(PATCH_ATTENTION):
            return
        s.attention_notified = True
        first = need[0]
        more = f" (+{len(need) - 1} more)" if len(need) > 1 else ""
        what = first.verdict.investigatory_action or first.verdict.description or first.message
        self._notify(NotifyEvent.ATTENTION,
                     f"{s.node}: {first.fault_class} on {first.device or 'node'}{more} needs a person "
                     f"({first.verdict.immediate_action}); not drained: {what}", fault_class=first.fault_class)

    def _notify(self, event: NotifyEvent, summary: str, fault_class: str | None = None) -> None:
        """Start the `notify` activity (never awaited here: a slow channel does not hold the incident).
        `fault_class`: the class the notification is about when the incident has none yet (not drained)."""
        if not self._policy.notify:
            return
        s = self._state
        fault_class = fault_class or s.fault_class
        n = Notification(event=event, cluster=s.cluster, node=s.node, summary=summary,
                         dedup_key=f"fleetmend/{self._incident_id}/{event.value}",
                         alert_key=f"fleetmend/{self._incident_id}", severity=s.severity.value,
                         incident_id=self._incident_id, ticket=s.ticket, ticket_url=s.ticket_url,
                         runbook=runbook_ref(fault_class) if fault_class else None,
                         details={"fault_class": fault_class, "phase": s.phase.value, "lemon": s.lemon})
        self._notifications.append(workflow.start_activity(
            Activity.NOTIFY, n, result_type=NotifyResult, start_to_close_timeout=timedelta(seconds=60),
            retry_policy=NOTIFY_RETRY, summary=f"notify {event.value}: {s.node}"))

    async def _notifications_done(self) -> None:
        """Wait for the notifications this run started; one that failed every retry is noted, not fatal."""
        pending, self._notifications = self._notifications, []
        for handle in pending:
            try:
                await handle
            except ActivityError as err:
                self._note(f"notification not delivered: {err.cause or err}")

    async def _finish(self, outcome: Outcome) -> None:
        """Close the incident, giving FleetGuard its permit back (or withdrawing a queued request)."""
        s = self._state
        if s.permit_requested or s.permit_held:
            returned = outcome in (Outcome.RETURNED, Outcome.OPERATOR_OWNED)
            # aborted without --undrain: fleetmend's cordon stays, and so does its count (F18: each such abort
            # let one more queued node drain beyond the budget)
            still = outcome is Outcome.ABORTED and s.permit_held and s.drained and s.drain_owned
            await workflow.execute_activity(
                Activity.RELEASE_DRAIN_PERMIT, PermitRelease(cluster=s.cluster, node=s.node, outcome=outcome,
                                                      fault_class=s.fault_class or "", returned=returned,
                                                      still_drained=still),
                start_to_close_timeout=timedelta(seconds=30), retry_policy=ACTIVITY_RETRY,
                summary=f"release drain permit of {s.node}")
            s.permit_requested = s.permit_held = False
        self._close(outcome)

    async def _diagnostics(self, why: str, checks: list[str] | None = None) -> DiagOutcome:
        s = self._state
        try:
            rep: DiagReport = await workflow.execute_activity(
                Activity.RUN_DIAGNOSTICS, DiagActivityRequest(cluster=s.cluster, node=s.node, level=DiagLevel.QUICK,
                                                              checks=checks, timeout_s=self._policy.diag_timeout_s,
                                                              incident_id=self._incident_id),
                result_type=DiagReport, start_to_close_timeout=timedelta(seconds=self._policy.diag_timeout_s + 10),
                retry_policy=DIAG_RETRY, summary=f"{why} on {s.node}")
            out = DiagOutcome(result=rep.result, report=rep)
        except ActivityError as err:
            out = DiagOutcome(result=DiagResult.UNKNOWN, error=str(err.cause or err))
        s.last_diag = out
        failed = out.failed
        self._note(f"{why}: {out.result.value}" + (f" (failed: {', '.join(failed)})" if failed else "")
                   + (f" ({out.error})" if out.error else ""))
        return out

    async def _poll_ticket(self) -> None:
        """Ask the ticket system whether the ticket says repaired; if so, act as `mark_repaired`."""
        s = self._state
        try:
            st: TicketStatus = await workflow.execute_activity(
                Activity.POLL_TICKET, s.ticket, result_type=TicketStatus, start_to_close_timeout=timedelta(minutes=1),
                retry_policy=DIAG_RETRY, summary=f"poll ticket {s.ticket}")
        except ActivityError as err:
            self._details(f"awaiting repair: ticket {s.ticket} could not be polled ({err.cause or err})")
            return
        if st.repaired and self._repaired is None:
            self._repaired = RepairedCommand(by=f"ticket:{s.ticket}", note=f"ticket status {st.status}",
                                             ticket=s.ticket)
            self._note(f"ticket {s.ticket} says {st.status}: treated as repaired", by=f"ticket:{s.ticket}")

    async def _update_ticket(self, status: str, comment: str) -> None:
        s = self._state
        if not s.ticket:
            return
        await workflow.execute_activity(
            Activity.UPDATE_TICKET, TicketUpdate(ticket_id=s.ticket, incident_id=self._incident_id, status=status,
                                          comment=comment),
            start_to_close_timeout=timedelta(minutes=1), retry_policy=ACTIVITY_RETRY,
            summary=f"ticket {s.ticket}: {status}")

    def _absorb(self) -> None:
        """Move pending faults into state: de-duplicate by event id, coalesce repeats, bound the list."""
        s = self._state
        batch, self._pending = self._pending, []
        s.faults_dropped += self._pending_dropped
        self._pending_dropped = 0
        seen = set(s.seen_ids)
        for rf in batch:
            ev = rf.event
            v = ev.verdict or Verdict(severity=ev.severity, immediate_action="NONE", fault_class=ev.kind,
                                      source="not classified")  # the router stamps every event it routes
            new_times: list[datetime] = []
            for event_id, observed_at in [(ev.event_id, ev.observed_at),
                                          *((r.event_id, r.observed_at) for r in rf.repeats)]:
                if event_id in seen:
                    s.duplicates += 1
                    continue
                seen.add(event_id)
                s.seen_ids.append(event_id)
                new_times.append(observed_at)
            if not new_times:
                continue
            key = condition_key(ev)
            same = next((f for f in reversed(s.faults) if f.key == key and f.healthy == ev.healthy), None)
            s.arrivals += 1
            if same is not None:
                same.count += len(new_times)
                same.times.extend(new_times)
                del same.times[:-MAX_TIMES_KEPT]
                same.last_seq = s.arrivals
                continue
            s.faults.append(FaultRecord(
                event_id=ev.event_id, kind=ev.kind, code=ev.code, component=ev.component, device=key.device,
                healthy=ev.healthy, raw=ev.raw[:4000], message=ev.message, observed_at=ev.observed_at, verdict=v,
                count=len(new_times), times=new_times[-MAX_TIMES_KEPT:], arrived_at=self._now(),
                last_seq=s.arrivals, stream_seq=rf.stream_seq,
                wanted=str(ev.attrs["wanted"]) if ev.kind.startswith("config_drift") and ev.attrs.get("fix") == "live"
                and ev.attrs.get("wanted") not in (None, "") else None))
            if not ev.healthy:
                s.severity = Severity.worst(s.severity, v.severity)
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

    def _unseen(self, pending: list[RoutedFault]) -> list[RoutedFault]:
        """`pending` without the occurrences this incident has recorded already (by event id): a
        redelivery must not open a new incident. A fault whose first occurrence was seen keeps its unseen
        repeats, the first of them as its event."""
        seen = set(self._state.seen_ids)
        out: list[RoutedFault] = []
        for rf in pending:
            repeats = [r for r in rf.repeats if r.event_id not in seen]
            if rf.event.event_id not in seen:
                out.append(RoutedFault(event=rf.event, repeats=repeats, stream_seq=rf.stream_seq))
            elif repeats:
                head = rf.event.model_copy(update={"event_id": repeats[0].event_id,
                                                   "observed_at": repeats[0].observed_at})
                out.append(RoutedFault(event=head, repeats=repeats[1:], stream_seq=rf.stream_seq))
        return out

    def _cleared(self, f: FaultRecord) -> bool:
        """A clearing event of the same condition that arrived after the fault's latest occurrence
        (`last_seq`) clears it, so a flapping link that ends DOWN is not taken for cleared."""
        return any(g.healthy and g.key == f.key and g.last_seq > f.last_seq for g in self._state.faults)

    def _maybe_continue_as_new(self) -> None:
        info = workflow.info()
        if (info.get_current_history_length() > MAX_HISTORY_EVENTS or info.is_continue_as_new_suggested()
                or info.get_current_history_size() - self._run_bytes0 > MAX_RUN_BYTES):
            s = self._state
            self._note(f"continuing as new (history {info.get_current_history_length()} events, "
                       f"{info.get_current_history_size() // 1024} KiB)")
            if self._sa_flush_due:
                self._flush_search_attributes()
            workflow.continue_as_new(IncidentInput(cluster=s.cluster, node=s.node, policy=self._policy,
                                                   carried=s, pending=self._pending, incident=self._incident_no))

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
        """Stable per incident: the idempotency key of every side effect. `<workflow id>/<first run id>` for the
        chain's first incident, `…#N` for its Nth (`IncidentInput.incident`): the runs of one chain share the first
        run id, and a next incident under the old key got its predecessor's ticket back and its notifications
        deduplicated away."""
        info = workflow.info()
        base = f"{info.workflow_id}/{info.first_execution_run_id}"
        return f"{base}#{self._incident_no + 1}" if self._incident_no else base

    def _now(self) -> datetime:
        return workflow.now()

    def _note(self, text: str, by: str | None = None) -> None:
        s = self._state
        s.timeline.append(TimelineEntry(at=self._now(), phase=s.phase, text=text, by=by))
        if len(s.timeline) > 200:
            del s.timeline[:50]
        workflow.logger.info("%s: %s%s", s.node, text, f" (by {by})" if by else "")
        self._details(text)

    def _details(self, text: str) -> None:
        s = self._state
        lines = [f"**{s.node}** ({s.cluster}) — phase `{s.phase.value}`", "", text]
        if s.fault_class:
            lines.append(f"fault: {s.fault_class} ({s.severity.value})")
        if s.ticket:
            lines.append(f"ticket: {s.ticket}")
        lines.append(f"drained: {'yes' if s.drained else 'no'}")
        workflow.set_current_details("\n".join(lines))

    def _set_phase(self, phase: Phase) -> None:
        self._state.phase = phase
        self._upsert()
        self._details(f"entered {phase.value}")

    def _close(self, outcome: Outcome) -> None:
        s = self._state
        s.outcome = outcome
        s.closed_at = self._now()
        s.phase = Phase.CLOSED
        self._note(f"closed: {outcome.value}")
        self._upsert()

    def _upsert(self) -> None:
        """Keep the search attributes (what the Temporal UI and `fleetmend status` list by) in step with
        the state; only a change is written."""
        if self._sa_values() == self._sa_last:
            return
        # One upsert for all the changes of this workflow task, sent when the run next yields: each
        # upsert is a history event and a visibility write on the server (a new incident changes four
        # in its first task: faults, awaiting_permit, draining, drained).
        if not self._sa_flush_due:
            self._sa_flush_due = True
            asyncio.get_running_loop().call_soon(self._flush_search_attributes)

    def _flush_search_attributes(self) -> None:
        """Send the search attributes if they changed since the last upsert (also the queued upsert's
        callback; called directly before the run's last command, which must stay last)."""
        self._sa_flush_due = False
        s, values = self._state, self._sa_values()
        if values == self._sa_last:
            return
        self._sa_last = values
        updates: list[SearchAttributeUpdate[Any]] = [
            KEY_NODE.value_set(s.node), KEY_CLUSTER.value_set(s.cluster), KEY_PHASE.value_set(s.phase.value),
            KEY_SEVERITY.value_set(s.severity.value), KEY_DRAINED.value_set(s.drained)]
        if s.fault_class:
            updates.append(KEY_FAULT_CLASS.value_set(s.fault_class))
        if s.ticket:
            updates.append(KEY_TICKET.value_set(s.ticket))
        workflow.upsert_search_attributes(updates)

    def _sa_values(self) -> tuple[object, ...]:
        s = self._state
        return (s.node, s.cluster, s.phase, s.severity, s.drained, s.fault_class, s.ticket)

    @staticmethod
    def _require_by(cmd: RepairedCommand | RetestCommand | AbortCommand) -> None:
        if not cmd.by or not cmd.by.strip():
            raise ValueError("a command must say who sent it (`by`), for the audit trail")


def _drains(rf: RoutedFault) -> bool:
    """Whether the fault's verdict says drain (an unclassified event does not)."""
    return rf.event.verdict is not None and rf.event.verdict.drain


__all__ = ["NodeRemediation", "ApplicationError"]
