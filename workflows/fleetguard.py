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

Fast path (the permit path under a storm): an incident asks with the `decide_drain_permit` activity,
an update-with-start of this workflow (`decide_permit`) that decides in the guard's next workflow task
and returns the decision as the activity's result: granted, denied, or `queued` with the reason it
waits (budget, rack cap, breaker, pause). Only a queued request is answered later by a `permit`
signal, and every answer of one workflow task goes out at once. The older `request_permit` signal
still works (histories and incidents started before).

Reconciliation: while it holds or queues anyone, the guard checks every `permit_reconcile_s` that each
such node still has a running incident (`running_incidents` activity, which describes each one) and
releases the others with an audit note (an incident terminated or reset never gives its permit back).
A guard that starts without carried state (first use, or after it was terminated) rebuilds its
permits and queue from the running incidents first, answering no request before that. An operator
frees a permit by hand with the `release_permit` update (`fleetmend breaker release NODE`, `by`
recorded).

Versioning: the histories in tests/histories/ are the baseline recorded before any patch; every change
to the command order goes behind `workflow.patched(<id>)`, listed here:
`answers-at-once`: the answers of one workflow task are signalled together (before: one at a time,
  one workflow task each).
`reconcile`: the rebuild at start and the reconciliation timer.
Both are guarded by the baseline histories fleetguard_breaker.json and fleetguard_pause.json (recorded
before them; without the patch guards they fail to replay with TMPRL1100).
`answers-before-can`: answers that update handlers left for other nodes while the guard waited to
  continue-as-new are signalled first (before: the run continued-as-new and those incidents waited for
  their next re-request, `permit_rerequest_s`). Reached only when such answers are pending, so the
  baseline histories replay unchanged.
`permit-pool`: with `policy.fast_drain`, the guard writes its budget, rack cap, open/closed and the
  domains of open infrastructure incidents to the cluster's permit pool (`sync_permit_pool` activity,
  `fleetmend.infra.permit_pool`) once per run and on every change, and frees the pool slots of permits it
  releases (reconciliation, `breaker release`). Reached only with `fast_drain`, so the recorded
  histories (all without it) replay unchanged.
`reask-not-a-fault`: a queued node asking again (its incident's re-request every
  `permit_rerequest_s`, or its own request after the router forwarded it) keeps its place and is not
  counted again toward the breaker or the failure domains (an entry rebuilt from a running incident
  is counted at its incident's first request: `Queued.counted`) (before: each re-ask was a fresh fault, so
  with more queued nodes than `breaker_distinct_nodes` a `breaker reset` tripped again within one
  re-request period, with no new fault). History: fleetguard_reask_after_reset.json.

Permit pool (`policy.fast_drain`): the router drains a node whose fault must drain now as soon as it
holds a slot in the pool; its incident then asks with `preclaimed` and the guard *adopts* it as held,
whatever the breaker, pause or budget say (the node is drained already, and the pool held the budget
and the rack cap when it was taken). Adopted requests still count toward the breaker and the failure
domains, which close the pool for the next ones.
A node that must drain now and finds no slot (budget, rack cap, breaker, pause, a closed domain) is
*forwarded*: the router sends its request here (`request_permits`, one signal for a burst's nodes)
as soon as its incident has started, so the guard queues it, with the reason it waits, before the
incident's first workflow task runs. The incident's own request later keeps that queue place. A new
signal handler only: no command changes, the recorded histories replay unchanged.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import datetime, timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from fleetmend import subjects
    from fleetmend.events import Severity
    from fleetmend.messages import (
        KEY_CLUSTER,
        KEY_PHASE,
        Activity,
        GuardApi,
        GuardCommand,
        GuardInput,
        GuardPhase,
        GuardState,
        GuardStatus,
        Held,
        InfraIncident,
        PermitDecision,
        PermitRelease,
        PermitReleaseCommand,
        PermitRequest,
        Phase,
        PoolSync,
        PoolSynced,
        Queued,
        RemediationApi,
        RunningIncident,
        RunningIncidents,
        TicketRef,
        TicketRequest,
        iso,
    )
    from fleetmend.policy import drain_budget

PATCH_ANSWERS_AT_ONCE = "answers-at-once"
PATCH_RECONCILE = "reconcile"
PATCH_ANSWERS_BEFORE_CAN = "answers-before-can"
PATCH_PERMIT_POOL = "permit-pool"
PATCH_REASK_NOT_A_FAULT = "reask-not-a-fault"
HOLDING_PHASES = frozenset({Phase.DRAINING, Phase.DIAGNOSING, Phase.RECOVERING, Phase.AWAITING_REPAIR,
                            Phase.VERIFYING, Phase.RETURNING})
"""Incident phases that hold a drain permit (a rebuilt guard counts them against the budget)."""
RECONCILE_TIMEOUT = timedelta(minutes=2)
RECONCILE_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=30),
                              maximum_attempts=0)

MAX_RETURNS_PER_NODE = 10
MAX_INFRA_KEPT = 20
MAX_LOG = 100

TICKET_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(minutes=1),
                           maximum_attempts=0)


class RecentIndex:
    """Counts derived from `GuardState.recent` (time-ordered `(node, at)`) and `node_domains`: the
    distinct nodes of the window and each failure domain's nodes in it. Never carried (a new run or
    replay rebuilds it from the state), so it changes no history. `sync` extends it by what was
    appended since; a replaced list (reset, a new run) or a node whose domains changed rebuilds it.

    Without it every request scanned the whole window three ways (breaker, each of its domains), and
    a burst's requests cost O(n²) in one workflow task: 3,000 took 3.3 s, past the SDK's 2 s deadlock
    limit (measured outside Temporal for the storm-path pass of 2026-12-01)."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._of: list | None = None
        self._seen = 0
        self.nodes: Counter[str] = Counter()
        self.domains: dict[str, Counter[str]] = {}

    def sync(self, recent: list, node_domains: dict[str, list[str]]) -> "RecentIndex":
        if self._of is not recent or self._seen > len(recent):
            self._reset()
            self._of = recent
        for node, _at in recent[self._seen:]:
            self._count(node, node_domains, 1)
        self._seen = len(recent)
        return self

    def drop_oldest(self, recent: list, k: int, node_domains: dict[str, list[str]]) -> None:
        """Remove the first `k` entries of `recent` (in place) and their counts."""
        self.sync(recent, node_domains)
        for node, _at in recent[:k]:
            self._count(node, node_domains, -1)
        del recent[:k]
        self._seen -= k

    def invalidate(self) -> None:
        self._of = None

    def _count(self, node: str, node_domains: dict[str, list[str]], by: int) -> None:
        for c in [self.nodes] + [self.domains.setdefault(d, Counter()) for d in node_domains.get(node, [])]:
            c[node] += by
            if c[node] <= 0:
                del c[node]


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
            self._s.log.append(f"{iso(workflow.now())} guard started")
        self._inbox: list[PermitRequest | PermitRelease] = []
        """Requests and releases in arrival order (a release must not overtake its own request)."""
        self._tickets: list[InfraIncident] = []
        self._answers: list[tuple[str, PermitDecision]] = []
        self._dirty = False
        self._published_phase: GuardPhase | None = None
        self._ready = inp.carried is not None
        """False until a new guard has rebuilt its permits from the running incidents (`run`): requests
        that start the guard (update-with-start) run before `run` and must wait for it."""
        self._reconcile_due = False
        self._pool_synced = False
        self._pool_task: asyncio.Task[None] | None = None
        """The pool write in flight (`_start_pool_sync`): the main loop never waits for it."""
        """This run has written the permit pool once (`permit-pool`)."""
        self._router_only: list[str] = []
        self._recent_ix = RecentIndex()
        self._seen_set: set[str] = set()
        """`GuardState.seen_nodes` as a set (derived; rebuilt when the list grew elsewhere)."""

    # ---------------------------------------------------------------- messages
    @workflow.signal(name=GuardApi.REQUEST_PERMIT)
    def request_permit(self, req: PermitRequest) -> None:
        self._inbox.append(req)

    @workflow.signal(name=GuardApi.REQUEST_PERMITS)
    def request_permits(self, reqs: list[PermitRequest]) -> None:
        """Requests the router forwarded in one signal (`PermitRequest.forwarded`, `policy.fast_drain`):
        nodes that must drain now and found no slot in the permit pool, queued here before their
        incidents ask. Handled like `request_permit`, in arrival order."""
        self._inbox.extend(reqs)

    @workflow.update(name=GuardApi.DECIDE_PERMIT)
    async def decide_permit(self, req: PermitRequest) -> PermitDecision:
        """Decide `req` now: granted, denied (observe-only, infrastructure incident) or `queued` with the
        reason it waits; a queued request is answered later by a `permit` signal. Idempotent: a node
        that holds its permit is granted again, a queued one keeps its place."""
        if not self._ready:
            await workflow.wait_condition(lambda: self._ready)
        self._process()  # earlier requests and releases first, in arrival order
        self._request(req, workflow.now())
        self._grant_queue()
        self._dirty = True
        mine = [d for n, d in self._answers if n == req.node]
        if mine:
            self._answers = [(n, d) for n, d in self._answers if n != req.node]
            return mine[-1]
        q = next((q for q in self._state.queue if q.node == req.node), None)
        return PermitDecision(granted=False, queued=True, reason=self._waiting(q) if q else "queued")

    @workflow.update(name=GuardApi.RELEASE_PERMIT)
    async def release_permit(self, cmd: PermitReleaseCommand) -> str:
        """Free `cmd.node`'s permit (or withdraw its queued request) by hand; audited with `by`."""
        s = self._state
        held = any(h.node == cmd.node for h in s.held)
        queued = any(q.node == cmd.node for q in s.queue)
        if s.policy.fast_drain:  # its pool slot too, known to the guard or not (a router drain never adopted)
            s.pool_drop.append(cmd.node)
            self._dirty = True
        if not (held or queued):
            if s.policy.fast_drain:
                self._log(f"{cmd.node}: permit pool slot freed by {cmd.by}{': ' + cmd.note if cmd.note else ''}")
                return f"{cmd.node} holds no permit here and is not queued; its permit pool slot (if any) is freed"
            return f"{cmd.node} holds no permit and is not queued in {s.cluster}: nothing released"
        s.held = [h for h in s.held if h.node != cmd.node]
        s.queue = [q for q in s.queue if q.node != cmd.node]
        what = "permit released" if held else "queued request withdrawn"
        self._log(f"{cmd.node}: {what} by {cmd.by}{': ' + cmd.note if cmd.note else ''}")
        self._dirty = True
        return f"{cmd.node}: {what}; {len(s.held)}/{self._budget()} permits held, {len(s.queue)} queued"

    @release_permit.validator
    def _v_release_permit(self, cmd: PermitReleaseCommand) -> None:
        _require_by(cmd)
        if not cmd.node or not cmd.node.strip():
            raise ValueError("name the node whose permit to release")

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
            held=[h.to_dict() for h in s.held],
            queue=[{**q.to_dict(), "waiting": self._waiting(q)} for q in self._ordered_queue()],
            breaker_tripped=s.breaker_tripped, breaker_reason=s.breaker_reason,
            breaker_tripped_at=iso(s.breaker_tripped_at), paused=s.paused, paused_by=s.paused_by,
            observe_only=s.policy.observe_only, infra_incidents=[i.to_dict() for i in s.infra],
            recent_nodes=len({n for n, _ in s.recent}), log=s.log[-30:],
            router_only=list(self._router_only) if s.policy.fast_drain else [])

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
        if workflow.patched(PATCH_RECONCILE):
            if inp.carried is None:
                await self._rebuild()
            self._ready = True
            self._clock = asyncio.create_task(self._reconcile_clock())  # kept: a dropped task may be collected
        self._ready = True
        while True:
            await workflow.wait_condition(lambda: bool(self._inbox) or self._dirty or bool(self._tickets)
                                          or bool(self._answers) or self._reconcile_due)
            self._dirty = False
            if self._reconcile_due:
                self._reconcile_due = False
                await self._reconcile()
            self._process()
            await self._grant()
            await self._file_tickets()
            self._publish()
            if self._state.policy.fast_drain and workflow.patched(PATCH_PERMIT_POOL):
                self._start_pool_sync()
            info = workflow.info()
            if (info.get_current_history_length() > inp.max_history_events or info.is_continue_as_new_suggested()) \
                    and not self._inbox:
                await workflow.wait_condition(workflow.all_handlers_finished)
                if self._pool_task is not None and not self._pool_task.done():
                    await self._pool_task  # its slots to free must not be lost with this run
                if self._answers and workflow.patched(PATCH_ANSWERS_BEFORE_CAN):
                    # the last update handlers granted other nodes too (requests that came by signal):
                    # send those answers first, continue-as-new on a later pass
                    continue
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
        # the queued nodes, or more: within this loop the queue only grows by `_request`, which adds to
        # it, and whatever removes from the queue leaves a superset, so a node absent from it is not queued
        queued = {q.node for q in self._state.queue} if len(inbox) > 1 else None
        for msg in inbox:
            if isinstance(msg, PermitRelease):
                self._release(msg)
            else:
                self._request(msg, now, queued)

    def _release(self, rel: PermitRelease) -> None:
        s = self._state
        s.pool_router.pop(rel.node, None)
        before = len(s.held) + len(s.queue)
        s.held = [h for h in s.held if h.node != rel.node]
        s.queue = [q for q in s.queue if q.node != rel.node]
        if rel.returned and rel.fault_class:
            hist = s.returns.setdefault(rel.node, [])
            hist.append((rel.fault_class, self._now()))
            del hist[:-MAX_RETURNS_PER_NODE]
        if len(s.held) + len(s.queue) < before:
            self._log(f"{rel.node}: permit returned ({rel.outcome.value})")

    def _request(self, req: PermitRequest, now: datetime, queued: set[str] | None = None) -> None:
        """Decide or queue `req`. `queued`: a superset of the queued nodes (`_process`), so a burst's
        new requests skip the scan of the queue (updated here)."""
        s = self._state
        if not req.forwarded:  # the worker's policy; a router's forward keeps the guard's
            s.policy = req.policy
        if req.pool_router is not None:  # the newest view of the router's pool slots
            s.pool_router = dict(req.pool_router)
        if len(self._seen_set) != len(s.seen_nodes):
            self._seen_set = set(s.seen_nodes)
        if req.node not in self._seen_set:
            s.seen_nodes.append(req.node)
            self._seen_set.add(req.node)
        if req.domains:
            old = s.node_domains.get(req.node)
            s.node_domains[req.node] = list(req.domains)
            if old != s.node_domains[req.node] and req.node in self._recent_ix.nodes:
                self._recent_ix.invalidate()  # its window entries count under the new domains
        if any(h.node == req.node for h in s.held):
            self._answers.append((req.node, PermitDecision(granted=True, reason="permit already held",
                                                           lemon=self._lemon(req, now))))
            return
        at = self._queued_at(req.node, queued)
        if at is not None and s.queue[at].counted and not req.preclaimed and not s.policy.observe_only \
                and workflow.patched(PATCH_REASK_NOT_A_FAULT):
            self._requeue(at, req)  # asked again: the same place, not a new fault
            return
        s.recent.append((req.node, self._now()))
        self._prune(now)
        # 0. drained by the router under a pool slot: adopted (the pool kept the budget and rack cap)
        if req.preclaimed:
            s.queue = [q for q in s.queue if q.node != req.node]
            s.held.append(Held(node=req.node, severity=Severity(req.severity), fault_class=req.fault_class,
                               rack=req.rack, granted_at=self._now()))
            s.grants += 1
            s.pool_router.pop(req.node, None)
            self._router_only = [n for n in self._router_only if n != req.node]
            self._log(f"{req.node}: drained by the router under a permit pool slot; adopted "
                      f"({req.severity} {req.fault_class}; {len(s.held)}/{self._budget()} held)")
            self._answers.append((req.node, PermitDecision(
                granted=True, reason=f"adopted: drained by the router under a permit pool slot "
                                     f"({len(s.held)}/{self._budget()} held)", lemon=self._lemon(req, now))))
            self._domain_incident(req, now)  # counts toward its domains (an incident opened closes them in the pool)
            self._check_breaker()
            return
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
        # `at` still holds: since it was found, only a domain incident that opened could have changed the
        # queue, and that denied this request above
        if at is None:
            s.queue.append(self._entry(req))
            if queued is not None:
                queued.add(req.node)
        else:  # asked again while queued (a run before patch reask-not-a-fault)
            self._requeue(at, req)
        # 3. breaker
        self._check_breaker()

    def _entry(self, req: PermitRequest) -> Queued:
        return Queued(node=req.node, severity=Severity(req.severity), fault_class=req.fault_class, rack=req.rack,
                      domains=list(req.domains), requested_at=req.requested_at or self._now(), reason=req.reason)

    def _queued_at(self, node: str, queued: set[str] | None) -> int | None:
        """`node`'s index in the queue, or None. `queued`: a superset of the queued nodes (`_process`)."""
        if queued is not None and node not in queued:
            return None
        return next((i for i, q in enumerate(self._state.queue) if q.node == node), None)

    def _requeue(self, at: int, req: PermitRequest) -> None:
        """The queue entry at `at` takes `req`'s details and keeps the oldest request time (its place)."""
        s = self._state
        entry = self._entry(req)
        entry.requested_at = min(entry.requested_at, s.queue[at].requested_at)
        s.queue[at] = entry

    def _recent(self) -> RecentIndex:
        s = self._state
        return self._recent_ix.sync(s.recent, s.node_domains)

    def _check_breaker(self) -> None:
        s = self._state
        nodes = self._recent().nodes
        if s.breaker_tripped or len(nodes) <= s.policy.breaker_distinct_nodes:
            return
        distinct = sorted(nodes)
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
            if inc.closed_at is None and now - inc.last_fault_at > window:
                inc.closed_at = self._now()
                self._log(f"infrastructure incident {inc.domain} closed: no fault for {window}")
        for dom in req.domains:
            open_inc = next((i for i in s.infra if i.domain == dom and i.closed_at is None), None)
            if open_inc is not None:
                if req.node not in open_inc.nodes:
                    open_inc.nodes.append(req.node)
                open_inc.last_fault_at = self._now()
                return open_inc
            in_dom = self._recent().domains.get(dom) or Counter()
            if len(in_dom) + (req.node not in in_dom) >= s.policy.domain_incident_nodes:
                members = sorted(set(in_dom) | {req.node})
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
        # `recent` is in time order (appended at workflow time), so what expired is a prefix
        k = 0
        while k < len(s.recent) and s.recent[k][1] < start:
            k += 1
        if k:
            self._recent_ix.drop_oldest(s.recent, k, s.node_domains)

    def _lemon(self, req: PermitRequest, now: datetime) -> str | None:
        s = self._state
        start = now - timedelta(seconds=s.policy.lemon_window_s)
        same = [at for fc, at in s.returns.get(req.node, []) if fc == req.fault_class
                and at >= start]
        if len(same) >= s.policy.lemon_repairs:
            return (f"lemon node: {req.fault_class} returned after {len(same)} repairs within "
                    f"{s.policy.lemon_window_s / 86400:.0f} days (last {iso(same[-1])}); RMA instead of another loop")
        return None

    async def _reconcile_clock(self) -> None:
        """Every `permit_reconcile_s` while anyone holds or waits for a permit: reconcile (one timer per
        period; an idle guard sleeps without one)."""
        s = self._state
        while True:
            await workflow.wait_condition(lambda: bool(s.held or s.queue))
            await workflow.sleep(s.policy.permit_reconcile_s)
            self._reconcile_due = True

    async def _running(self, nodes: list[str] | None) -> list[RunningIncident]:
        return await workflow.execute_activity(
            Activity.RUNNING_INCIDENTS, RunningIncidents(cluster=self._state.cluster, nodes=nodes),
            result_type=list[RunningIncident], start_to_close_timeout=RECONCILE_TIMEOUT,
            retry_policy=RECONCILE_RETRY, summary="which permit holders still have a running incident")

    async def _reconcile(self) -> None:
        """Release the permits and queued requests of nodes whose incident is no longer running."""
        s = self._state
        nodes = sorted({h.node for h in s.held} | {q.node for q in s.queue})
        if not nodes:
            return
        alive = {r.node for r in await self._running(nodes)}
        for node in nodes:
            held = any(h.node == node for h in s.held)
            queued = any(q.node == node for q in s.queue)
            if node in alive or not (held or queued):
                continue
            s.held = [h for h in s.held if h.node != node]
            s.queue = [q for q in s.queue if q.node != node]
            if s.policy.fast_drain:
                s.pool_drop.append(node)
            self._log(f"{node}: {'permit released' if held else 'queued request withdrawn'} by reconciliation: "
                      "its incident is not running (terminated, reset or lost)")
            self._dirty = True

    async def _rebuild(self) -> None:
        """A guard without carried state: count the running incidents that hold a drain (their phase)
        against the budget and queue those awaiting a permit, before answering anyone."""
        s = self._state
        running = await self._running(None)
        held = queued = 0
        for r in running:
            if any(h.node == r.node for h in s.held) or any(q.node == r.node for q in s.queue):
                continue
            if r.phase in HOLDING_PHASES:
                s.held.append(Held(node=r.node, severity=r.severity or Severity.FATAL, fault_class=r.fault_class,
                                   rack=r.rack, granted_at=self._now()))
                held += 1
            elif r.phase == Phase.AWAITING_PERMIT:
                s.queue.append(Queued(node=r.node, severity=r.severity or Severity.FATAL,
                                      fault_class=r.fault_class, rack=r.rack, domains=list(r.domains),
                                      requested_at=self._now(), reason="rebuilt from its running incident",
                                      counted=False))
                queued += 1
        if held or queued:
            self._log(f"rebuilt from the running incidents: {held} holding a drain, {queued} awaiting a permit")

    async def _grant(self) -> None:
        self._grant_queue()
        await self._send()

    def _grant_queue(self) -> None:
        """Grant queued requests within the budget and rack caps (answers collected in `_answers`)."""
        s = self._state
        now = workflow.now()
        if not (s.breaker_tripped or s.paused):
            budget = self._budget()
            router = self._unadopted()
            for q in self._ordered_queue():
                if len(s.held) + len(router) >= budget:
                    break
                if q.rack and self._in_rack(q.rack, router) >= s.policy.max_drained_per_rack:
                    continue
                s.queue.remove(q)
                s.held.append(Held(node=q.node, severity=q.severity, fault_class=q.fault_class, rack=q.rack,
                                   granted_at=self._now()))
                s.grants += 1
                lemon = self._lemon(PermitRequest(cluster=s.cluster, node=q.node, severity=q.severity,
                                                  fault_class=q.fault_class), now)
                self._log(f"{q.node}: permit granted ({q.severity.value} {q.fault_class}; {len(s.held)}/{budget} held)")
                self._answers.append((q.node, PermitDecision(
                    granted=True, reason=f"permit {len(s.held)}/{budget}", lemon=lemon)))

    async def _send(self) -> None:
        """Signal the collected answers to their incidents: all in one workflow task (patched)."""
        s = self._state
        answers, self._answers = self._answers, []

        async def deliver(node: str, decision: PermitDecision) -> None:
            handle = workflow.get_external_workflow_handle(subjects.workflow_id(s.cluster, node))
            try:
                await handle.signal(RemediationApi.PERMIT, decision)
            except Exception as err:  # noqa: BLE001 - the incident closed meanwhile: take the permit back
                s.held = [h for h in s.held if h.node != node]
                if s.policy.fast_drain and decision.granted:
                    s.pool_drop.append(node)
                self._log(f"{node}: could not deliver permit decision ({err}); permit withdrawn")
                self._dirty = True

        if answers and workflow.patched(PATCH_ANSWERS_AT_ONCE):
            await asyncio.gather(*(deliver(n, d) for n, d in answers))
            return
        for node, decision in answers:
            await deliver(node, decision)

    def _pool_view(self) -> PoolSync:
        """What the permit pool must say now: budget, rack cap, open (or why not), closed domains."""
        s = self._state
        why = ""
        if s.policy.observe_only:
            why = "observe-only: nothing is drained"
        elif s.breaker_tripped:
            why = f"breaker tripped at {iso(s.breaker_tripped_at)}"
        elif s.paused:
            why = f"paused by {s.paused_by}"
        closed = sorted({i.domain for i in s.infra if i.closed_at is None})
        return PoolSync(cluster=s.cluster, budget=self._budget(), rack_cap=s.policy.max_drained_per_rack,
                        open=not why, why=why, closed_domains=closed)

    def _start_pool_sync(self) -> None:
        """Write the pool in the background when it must change (`_sync_pool`). The main loop goes on
        answering requests meanwhile: under a storm an activity round trip takes seconds, and a loop
        waiting for it would leave signalled requests unqueued that long."""
        if (self._pool_task is None or self._pool_task.done()) and self._pool_due() is not None:
            self._pool_task = asyncio.create_task(self._pool_syncer())

    async def _pool_syncer(self) -> None:
        while (due := self._pool_due()) is not None:  # what changed while a write was in flight goes next
            await self._sync_pool(*due)

    def _pool_due(self) -> tuple[PoolSync, str] | None:
        """(what the pool must say now, its signature), or None when the last write already said it
        and no slot is to be freed."""
        s = self._state
        view = self._pool_view()
        sig = f"{view.budget}|{view.rack_cap}|{view.open}|{view.why}|{','.join(view.closed_domains)}"
        return None if sig == s.pool_published and not s.pool_drop and self._pool_synced else (view, sig)

    async def _sync_pool(self, view: PoolSync, sig: str) -> None:
        """Write `view` to the pool with the slots to free (`permit-pool`). The guard's own holders go
        with it: the pool adds them only when it is new."""
        s = self._state
        view.held = {h.node: h.rack for h in s.held}
        view.drop, s.pool_drop = sorted(set(s.pool_drop)), []
        r: PoolSynced = await workflow.execute_activity(
            Activity.SYNC_PERMIT_POOL, view, result_type=PoolSynced, start_to_close_timeout=RECONCILE_TIMEOUT,
            retry_policy=RECONCILE_RETRY, summary=f"permit pool: {view.budget} slots, "
                                                  f"{'open' if view.open else 'closed: ' + view.why}")
        if sig != s.pool_published:
            self._log(f"permit pool: budget {view.budget}, {view.rack_cap} per rack, "
                      f"{'open' if view.open else 'closed (' + view.why + ')'}"
                      + (f", closed domains {', '.join(view.closed_domains)}" if view.closed_domains else "")
                      + f"; {r.holders} slot(s) held")
        s.pool_published, self._pool_synced = sig, True
        held = {h.node for h in s.held}
        self._router_only = [n for n in r.router_only if n not in held]

    async def _file_tickets(self) -> None:
        incs, self._tickets = self._tickets, []
        s = self._state
        for inc in incs:
            ref: TicketRef = await workflow.execute_activity(
                Activity.FILE_TICKET, TicketRequest(
                    incident_id=f"{workflow.info().workflow_id}/{inc.domain}/{iso(inc.opened_at)}", cluster=s.cluster,
                    node=inc.domain.replace(":", "-"), severity="fatal", fault_class="infrastructure",
                    title=f"[fleetmend] infrastructure incident {inc.domain} in {s.cluster}: {len(inc.nodes)} nodes",
                    evidence={"domain": inc.domain, "nodes": inc.nodes, "opened_at": iso(inc.opened_at),
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

    def _waiting(self, q: Queued) -> str:
        """Why queued request `q` is not granted yet, for the incident, `fleetmend status` and the guard."""
        s = self._state
        if s.breaker_tripped:
            return f"breaker tripped at {iso(s.breaker_tripped_at)}; `fleetmend breaker reset` resumes drains"
        if s.paused:
            return f"paused by {s.paused_by}; `fleetmend resume` resumes drains"
        budget = self._budget()
        router = self._unadopted()
        if len(s.held) + len(router) >= budget:
            extra = f"; {len(router)} of them drained by the router, not adopted yet" if router else ""
            return (f"budget: {len(s.held) + len(router)}/{budget} permits held (blast radius{extra}), "
                    f"{len(s.queue)} queued")
        if q.rack:
            in_rack = self._in_rack(q.rack, router)
            if in_rack >= s.policy.max_drained_per_rack:
                return f"rack {q.rack}: {in_rack}/{s.policy.max_drained_per_rack} drained"
        return "next in the queue"

    def _unadopted(self) -> dict[str, str | None]:
        """The router's pool holders (newest view) that the guard does not hold yet: drained nodes that
        count against the budget and rack caps until their incidents ask to be adopted."""
        s = self._state
        held = {h.node for h in s.held}
        return {n: r for n, r in s.pool_router.items() if n not in held}

    def _in_rack(self, rack: str, router: dict[str, str | None]) -> int:
        return sum(1 for h in self._state.held if h.rack == rack) + sum(1 for r in router.values() if r == rack)

    def _ordered_queue(self) -> list[Queued]:
        return sorted(self._state.queue, key=lambda q: (-q.severity.rank, q.requested_at))

    def _known(self) -> int:
        s = self._state
        return max(s.policy.topology_nodes, s.policy.cluster_nodes or 0, len(s.seen_nodes))

    def _budget(self) -> int:
        p = self._state.policy
        return drain_budget(self._known(), p.max_drained_nodes, p.max_drained_percent)

    def _publish(self) -> None:
        s = self._state
        phase = GuardPhase.BREAKER_TRIPPED if s.breaker_tripped else GuardPhase.PAUSED if s.paused \
            else GuardPhase.GUARDING
        if phase != self._published_phase:  # one history event per change, not per loop
            workflow.upsert_search_attributes([KEY_CLUSTER.value_set(s.cluster), KEY_PHASE.value_set(phase.value)])
            self._published_phase = phase
        lines = [f"**FleetGuard {s.cluster}** — `{phase.value}`", "",
                 f"permits held: {len(s.held)}/{self._budget()} (known nodes {self._known()}); queued: {len(s.queue)}"]
        if s.breaker_tripped:
            lines.append(f"breaker tripped at {iso(s.breaker_tripped_at)}: {s.breaker_reason}")
            lines.append("reset: `fleetmend breaker reset`")
        if s.paused:
            lines.append(f"paused by {s.paused_by}")
        open_inc = [i for i in s.infra if i.closed_at is None]
        if open_inc:
            lines.append("infrastructure incidents: " + ", ".join(f"{i.domain} ({i.ticket})" for i in open_inc))
        if s.policy.fast_drain:  # details are metadata, not commands: no patch
            ro = self._router_only
            lines.append(f"permit pool (policy.fast_drain): {len(ro)} router drain(s) not adopted yet"
                         + (f" ({', '.join(ro[:10])}{' …' if len(ro) > 10 else ''})" if ro else "")
                         + "; `fleetmend breaker status` shows the pool")
        workflow.set_current_details("\n".join(lines))

    def _log(self, text: str) -> None:
        s = self._state
        s.log.append(f"{iso(self._now())} {text}")
        del s.log[:-MAX_LOG]
        workflow.logger.info("fleetguard %s: %s", s.cluster, text)

    def _now(self) -> datetime:
        """Workflow time to the second (UTC): what the state keeps and the windows compare."""
        return workflow.now().replace(microsecond=0)

    @property
    def _state(self) -> GuardState:
        if self._s is None:
            self._s = GuardState(cluster=workflow.info().workflow_id.split("/")[-1])
        return self._s



def _require_by(cmd: GuardCommand | PermitReleaseCommand) -> None:
    if not cmd.by or not cmd.by.strip():
        raise ValueError("a command must say who sent it (`by`), for the audit trail")


__all__ = ["FleetGuard"]
