"""`FleetGuard`: one per cluster (id `fleetguard/<cluster>`), the blast-radius budget and the breaker.

NodeRemediation asks for a drain permit through the `request_drain_permit` activity (signal-with-start
of this workflow, so the guard exists the first time anyone needs it); the guard answers later with a
`permit` signal to the node's workflow (`PermitDecision`: granted, or denied with the reason). A node
gives its permit back (`release_drain_permit` → `release` signal) when it returns to service, its
incident closes, or it is aborted — also while still queued.

Decisions, in order, for each request (all recorded in the guard's history and `status`):

1. observe-only (policy) → denied "observe-only": the incident records and closes, nothing drains.
2. failure domain: `domain_incident_nodes` distinct nodes under one rack/leaf/PDU within
   `domain_window_s` → one infrastructure incident (ticket `file_ticket`, pages a human); its nodes'
   requests are denied "infrastructure incident …" while it is open (it closes `domain_window_s` after
   its last fault, or on `reset_breaker`). Nodes granted before the threshold keep their drain; the
   per-rack cap bounds them.
3. breaker: drain-worthy faults from MORE than `breaker_distinct_nodes` distinct nodes within
   `breaker_window_s` trip it; while tripped (or paused) nothing is granted and requests queue. Only a
   human resets it (`reset_breaker` update, `fleetmend breaker reset`), with `by` in the history.
4. budget: at most `drain_budget(known, N, P%)` permits held, at most `max_drained_per_rack` per rack.
   The queue is served highest severity first, then oldest.

Node history for the lemon rule lives here (`returns`: fault class and time of each return to
service, per node, pruned to `lemon_window_s`), because the guard outlives every incident; a grant
carries `lemon` (the reason) when the node's fault came back after `lemon_repairs` repairs.

Search attributes: `FleetCluster`, `FleetPhase` (`guarding`, `breaker_tripped`, `paused`). The current
details say why. History stays bounded: continue-as-new past `GuardInput.max_history_events`, carrying the state.

All messages and the carried state are defined in `fleetmend.messages`.

Versioning: the histories in tests/histories/ are the baseline recorded with this code (no patches
yet); every later change to the command order goes behind `workflow.patched(<id>)`, listed here.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from fleetmend import subjects
    from fleetmend.events import Severity
    from fleetmend.messages import (
        KEY_CLUSTER, KEY_PHASE, Activity, GuardApi, GuardCommand, GuardInput, GuardState, GuardStatus, Held,
        InfraIncident, PermitDecision, PermitRelease, PermitRequest, Queued, RemediationApi, TicketRef, TicketRequest,
    )
    from fleetmend.policy import drain_budget

MAX_RETURNS_PER_NODE = 10
MAX_INFRA_KEPT = 20
MAX_LOG = 100

TICKET_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(minutes=1),
                           maximum_attempts=0)


@workflow.defn(name=GuardApi.WORKFLOW)
class FleetGuard:
    @workflow.init
    def __init__(self, inp: GuardInput) -> None:
        # State exists before any handler runs: a `pause` that starts the guard (CLI) must not be lost.
        if inp.carried is not None:
            self._s: GuardState | None = inp.carried
            self._s.run += 1
        else:
            self._s = GuardState(cluster=inp.cluster, policy=inp.policy)
            self._s.log.append(f"{workflow.now().isoformat(timespec='seconds')} guard started")
        self._inbox: list[PermitRequest | PermitRelease] = []
        """Requests and releases in arrival order (a release must not overtake its own request)."""
        self._tickets: list[InfraIncident] = []
        self._answers: list[tuple[str, PermitDecision]] = []
        self._dirty = False
        self._published_phase: str | None = None

    # ---------------------------------------------------------------- messages
    @workflow.signal(name=GuardApi.REQUEST_PERMIT)
    def request_permit(self, req: PermitRequest) -> None:
        self._inbox.append(req)

    @workflow.signal(name=GuardApi.RELEASE)
    def release(self, rel: PermitRelease) -> None:
        self._inbox.append(rel)

    @workflow.signal(name=GuardApi.ENSURE)
    def ensure(self) -> None:
        """No-op: lets a CLI signal-with-start the guard before its first update."""

    @workflow.query(name=GuardApi.STATUS)
    def status(self) -> GuardStatus:
        s = self._state
        return GuardStatus(
            cluster=s.cluster, budget=self._budget(), known_nodes=self._known(),
            held=[h.__dict__ for h in s.held], queue=[q.__dict__ for q in self._ordered_queue()],
            breaker_tripped=s.breaker_tripped, breaker_reason=s.breaker_reason,
            breaker_tripped_at=s.breaker_tripped_at, paused=s.paused, paused_by=s.paused_by,
            observe_only=s.policy.observe_only, infra_incidents=[i.__dict__ for i in s.infra],
            recent_nodes=len({n for n, _ in s.recent}), log=s.log[-30:])

    @workflow.update(name=GuardApi.RESET_BREAKER)
    async def reset_breaker(self, cmd: GuardCommand) -> str:
        s = self._state
        was = s.breaker_reason
        s.breaker_tripped, s.breaker_reason, s.breaker_tripped_at = False, None, None
        s.recent = []  # the storm that tripped it is acknowledged; count afresh
        for inc in s.infra:
            if inc.closed_at is None:
                inc.closed_at = self._now()
        self._log(f"breaker reset by {cmd.by}{': ' + cmd.note if cmd.note else ''} (was: {was})")
        self._dirty = True
        return f"breaker reset; {len(s.queue)} queued request(s) will be served in severity order"

    @reset_breaker.validator
    def _v_reset(self, cmd: GuardCommand) -> None:
        _require_by(cmd)

    @workflow.update(name=GuardApi.PAUSE)
    async def pause(self, cmd: GuardCommand) -> str:
        s = self._state
        s.paused, s.paused_by = True, cmd.by
        self._log(f"paused by {cmd.by}{': ' + cmd.note if cmd.note else ''}: no new drains")
        self._dirty = True
        return "paused: faults are still classified and recorded; no node will be drained"

    @pause.validator
    def _v_pause(self, cmd: GuardCommand) -> None:
        _require_by(cmd)

    @workflow.update(name=GuardApi.RESUME)
    async def resume(self, cmd: GuardCommand) -> str:
        s = self._state
        s.paused, s.paused_by = False, None
        self._log(f"resumed by {cmd.by}{': ' + cmd.note if cmd.note else ''}")
        self._dirty = True
        return f"resumed; {len(s.queue)} queued request(s)"

    @resume.validator
    def _v_resume(self, cmd: GuardCommand) -> None:
        _require_by(cmd)

    # ---------------------------------------------------------------- main
    @workflow.run
    async def run(self, inp: GuardInput) -> None:
        self._inbox = list(inp.pending_releases) + list(inp.pending_requests) + self._inbox
        self._dirty = True
        while True:
            await workflow.wait_condition(lambda: bool(self._inbox) or self._dirty or bool(self._tickets))
            self._dirty = False
            self._process()
            await self._grant()
            await self._file_tickets()
            self._publish()
            info = workflow.info()
            if (info.get_current_history_length() > inp.max_history_events or info.is_continue_as_new_suggested()) \
                    and not self._inbox:
                await workflow.wait_condition(workflow.all_handlers_finished)
                s = self._state
                workflow.continue_as_new(GuardInput(
                    cluster=s.cluster, policy=s.policy, carried=s,
                    pending_requests=[m for m in self._inbox if isinstance(m, PermitRequest)],
                    pending_releases=[m for m in self._inbox if isinstance(m, PermitRelease)],
                                                    max_history_events=inp.max_history_events))

    # ---------------------------------------------------------------- decisions
    def _process(self) -> None:
        now = workflow.now()
        inbox, self._inbox = self._inbox, []
        for msg in inbox:
            if isinstance(msg, PermitRelease):
                self._release(msg)
            else:
                self._request(msg, now)

    def _release(self, rel: PermitRelease) -> None:
        s = self._state
        before = len(s.held) + len(s.queue)
        s.held = [h for h in s.held if h.node != rel.node]
        s.queue = [q for q in s.queue if q.node != rel.node]
        if rel.returned and rel.fault_class:
            hist = s.returns.setdefault(rel.node, [])
            hist.append([rel.fault_class, self._now()])
            del hist[:-MAX_RETURNS_PER_NODE]
        if len(s.held) + len(s.queue) < before:
            self._log(f"{rel.node}: permit returned ({rel.outcome})")

    def _request(self, req: PermitRequest, now: datetime) -> None:
        s = self._state
        s.policy = req.policy
        if req.node not in s.seen_nodes:
            s.seen_nodes.append(req.node)
        if req.domains:
            s.node_domains[req.node] = list(req.domains)
        if any(h.node == req.node for h in s.held):
            self._answers.append((req.node, PermitDecision(granted=True, reason="permit already held",
                                                           lemon=self._lemon(req, now))))
            return
        s.recent.append([req.node, self._now()])
        self._prune(now)
        # 1. observe-only
        if s.policy.observe_only:
            self._deny(req.node, f"observe-only: {req.fault_class} would be drained; nothing touched")
            return
        # 2. failure domain
        inc = self._domain_incident(req, now)
        if inc is not None:
            self._deny(req.node, f"infrastructure incident {inc.domain} ({len(inc.nodes)} nodes: "
                                 f"{', '.join(inc.nodes[:10])}); not drained, a human is paged",
                       infra=inc.domain)
            return
        s.queue = [q for q in s.queue if q.node != req.node]
        s.queue.append(Queued(node=req.node, severity=Severity(req.severity).value, fault_class=req.fault_class,
                              rack=req.rack, domains=list(req.domains),
                              requested_at=req.requested_at or self._now(), reason=req.reason))
        # 3. breaker
        distinct = sorted({n for n, _ in s.recent})
        if not s.breaker_tripped and len(distinct) > s.policy.breaker_distinct_nodes:
            s.breaker_tripped, s.breaker_tripped_at = True, self._now()
            s.breaker_trips += 1
            s.breaker_reason = (f"drain-worthy faults from {len(distinct)} distinct nodes within "
                                f"{s.policy.breaker_window_s:.0f}s (threshold: more than "
                                f"{s.policy.breaker_distinct_nodes}): {', '.join(distinct[:20])}"
                                + (" …" if len(distinct) > 20 else ""))
            self._log(f"BREAKER TRIPPED: {s.breaker_reason}; no new drains until `fleetmend breaker reset`")

    def _domain_incident(self, req: PermitRequest, now: datetime) -> InfraIncident | None:
        s = self._state
        window = timedelta(seconds=s.policy.domain_window_s)
        for inc in s.infra:
            if inc.closed_at is None and now - datetime.fromisoformat(inc.last_fault_at) > window:
                inc.closed_at = self._now()
                self._log(f"infrastructure incident {inc.domain} closed: no fault for {window}")
        for dom in req.domains:
            open_inc = next((i for i in s.infra if i.domain == dom and i.closed_at is None), None)
            if open_inc is not None:
                if req.node not in open_inc.nodes:
                    open_inc.nodes.append(req.node)
                open_inc.last_fault_at = self._now()
                return open_inc
            members = sorted({n for n, _ in s.recent if dom in s.node_domains.get(n, [])} | {req.node})
            if len(members) >= s.policy.domain_incident_nodes:
                inc = InfraIncident(domain=dom, opened_at=self._now(), last_fault_at=self._now(), nodes=members)
                s.infra.append(inc)
                del s.infra[:-MAX_INFRA_KEPT]
                # queued nodes of this domain are part of it: they do not drain either
                for q in [q for q in s.queue if dom in q.domains]:
                    s.queue.remove(q)
                    self._answers.append((q.node, PermitDecision(
                        granted=False, reason=f"infrastructure incident {dom}: not drained", infra_incident=dom)))
                self._log(f"INFRASTRUCTURE INCIDENT {dom}: {len(members)} nodes within "
                          f"{s.policy.domain_window_s:.0f}s ({', '.join(members)}); paging, draining none")
                self._tickets.append(inc)
                return inc
        return None

    def _prune(self, now: datetime) -> None:
        s = self._state
        keep_s = max(s.policy.breaker_window_s, s.policy.domain_window_s)
        start = now - timedelta(seconds=keep_s)
        s.recent = [r for r in s.recent if datetime.fromisoformat(r[1]) >= start]

    def _lemon(self, req: PermitRequest, now: datetime) -> str | None:
        s = self._state
        start = now - timedelta(seconds=s.policy.lemon_window_s)
        same = [at for fc, at in s.returns.get(req.node, []) if fc == req.fault_class
                and datetime.fromisoformat(at) >= start]
        if len(same) >= s.policy.lemon_repairs:
            return (f"lemon node: {req.fault_class} returned after {len(same)} repairs within "
                    f"{s.policy.lemon_window_s / 86400:.0f} days (last {same[-1]}); RMA instead of another loop")
        return None

    async def _grant(self) -> None:
        s = self._state
        now = workflow.now()
        if not (s.breaker_tripped or s.paused):
            budget = self._budget()
            for q in self._ordered_queue():
                if len(s.held) >= budget:
                    break
                if q.rack and sum(1 for h in s.held if h.rack == q.rack) >= s.policy.max_drained_per_rack:
                    continue
                s.queue.remove(q)
                s.held.append(Held(node=q.node, severity=q.severity, fault_class=q.fault_class, rack=q.rack,
                                   granted_at=self._now()))
                s.grants += 1
                lemon = self._lemon(PermitRequest(cluster=s.cluster, node=q.node, severity=Severity(q.severity),
                                                  fault_class=q.fault_class), now)
                self._log(f"{q.node}: permit granted ({q.severity} {q.fault_class}; {len(s.held)}/{budget} held)")
                self._answers.append((q.node, PermitDecision(
                    granted=True, reason=f"permit {len(s.held)}/{budget}", lemon=lemon)))
        answers, self._answers = self._answers, []
        for node, decision in answers:
            handle = workflow.get_external_workflow_handle(subjects.workflow_id(s.cluster, node))
            try:
                await handle.signal(RemediationApi.PERMIT, decision)
            except Exception as err:  # noqa: BLE001 - the incident closed meanwhile: take the permit back
                s.held = [h for h in s.held if h.node != node]
                self._log(f"{node}: could not deliver permit decision ({err}); permit withdrawn")
                self._dirty = True

    async def _file_tickets(self) -> None:
        incs, self._tickets = self._tickets, []
        s = self._state
        for inc in incs:
            ref: TicketRef = await workflow.execute_activity(
                Activity.FILE_TICKET, TicketRequest(
                    incident_id=f"{workflow.info().workflow_id}/{inc.domain}/{inc.opened_at}", cluster=s.cluster,
                    node=inc.domain.replace(":", "-"), severity="fatal", fault_class="infrastructure",
                    title=f"[fleetmend] infrastructure incident {inc.domain} in {s.cluster}: {len(inc.nodes)} nodes",
                    evidence={"domain": inc.domain, "nodes": inc.nodes, "opened_at": inc.opened_at,
                              "note": "correlated faults under one failure domain; nothing was drained"}),
                result_type=TicketRef, start_to_close_timeout=timedelta(minutes=1), retry_policy=TICKET_RETRY,
                summary=f"page: infrastructure incident {inc.domain}")
            inc.ticket = ref.ticket_id
            self._log(f"infrastructure incident {inc.domain}: ticket {ref.ticket_id}")

    # ---------------------------------------------------------------- helpers
    def _deny(self, node: str, reason: str, infra: str | None = None) -> None:
        s = self._state
        s.queue = [q for q in s.queue if q.node != node]
        self._log(f"{node}: denied: {reason}")
        self._answers.append((node, PermitDecision(granted=False, reason=reason, infra_incident=infra)))

    def _ordered_queue(self) -> list[Queued]:
        return sorted(self._state.queue, key=lambda q: (-Severity(q.severity).rank, q.requested_at))

    def _known(self) -> int:
        s = self._state
        return max(s.policy.topology_nodes, s.policy.cluster_nodes or 0, len(s.seen_nodes))

    def _budget(self) -> int:
        p = self._state.policy
        return drain_budget(self._known(), p.max_drained_nodes, p.max_drained_percent)

    def _publish(self) -> None:
        s = self._state
        phase = "breaker_tripped" if s.breaker_tripped else "paused" if s.paused else "guarding"
        if phase != self._published_phase:  # one history event per change, not per loop
            workflow.upsert_search_attributes([KEY_CLUSTER.value_set(s.cluster), KEY_PHASE.value_set(phase)])
            self._published_phase = phase
        lines = [f"**FleetGuard {s.cluster}** — `{phase}`", "",
                 f"permits held: {len(s.held)}/{self._budget()} (known nodes {self._known()}); queued: {len(s.queue)}"]
        if s.breaker_tripped:
            lines.append(f"breaker tripped at {s.breaker_tripped_at}: {s.breaker_reason}")
            lines.append("reset: `fleetmend breaker reset`")
        if s.paused:
            lines.append(f"paused by {s.paused_by}")
        open_inc = [i for i in s.infra if i.closed_at is None]
        if open_inc:
            lines.append("infrastructure incidents: " + ", ".join(f"{i.domain} ({i.ticket})" for i in open_inc))
        workflow.set_current_details("\n".join(lines))

    def _log(self, text: str) -> None:
        s = self._state
        s.log.append(f"{self._now()} {text}")
        del s.log[:-MAX_LOG]
        workflow.logger.info("fleetguard %s: %s", s.cluster, text)

    def _now(self) -> str:
        return workflow.now().isoformat(timespec="seconds")

    @property
    def _state(self) -> GuardState:
        if self._s is None:
            self._s = GuardState(cluster=workflow.info().workflow_id.split("/")[-1])
        return self._s



def _require_by(cmd: GuardCommand) -> None:
    if not cmd.by or not cmd.by.strip():
        raise ValueError("a command must say who sent it (`by`), for the audit trail")


__all__ = ["FleetGuard"]
