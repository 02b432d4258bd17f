"""`FleetGuard`: one per cluster (id `fleetguard/<cluster>`), on its own task queue
(`messages.guard_task_queue`): who may drain next, the breaker, failure domains and lemons. The budget
itself is the cluster's permit pool (`fleetmend.infra.permit_pool`, JetStream KV compare-and-set): every
drain under a permit holds a slot there, and the guard sizes, opens and closes it.

The permit path, top to bottom:

1. A fault the catalog says must drain *now* is cordoned by the router under a pool slot before any
   workflow exists (`fleetmend.router`). Refused a slot (budget, rack cap, closed pool or domain), the
   node's incident starts in `awaiting_permit` and the router forwards its request here
   (`request_permits`, a burst's nodes in a few signals), so the guard queues it at once.
2. Every incident that decides to drain asks here one way: the `request_drain_permit` activity,
   signal-with-start of `request_permits` with a list of one (again every `permit_rerequest_s` while it
   waits; a re-ask keeps its place). A node the router already drained asks `preclaimed` and is adopted.
3. The guard decides, in order (each decision in its log and `status`):
   observe-only → denied (the incident records and closes; the pool stays closed, so nothing drains);
   failure domain: `domain_incident_nodes` distinct nodes under one rack/leaf/PDU within
   `domain_window_s` → one infrastructure incident (ticket, a human paged), its nodes denied while it is
   open and the domain closed in the pool (it closes `domain_window_s` after its last fault, or on
   `reset_breaker`); breaker: drain-worthy faults from MORE than `breaker_distinct_nodes` distinct nodes
   within `breaker_window_s` trip it, and while tripped (or paused) nothing is granted, the pool is
   closed and requests queue; only a human resets it (`reset_breaker`, `by` in the history).
   Otherwise the request queues, served highest severity first, then oldest.
   Before all of these, a `fail_slow` request of a node that an open *analyzer* infrastructure incident
   lists is denied (below), and counts toward neither the breaker nor the failure domains.
4. Granting is one write to the pool (`sync_permit_pool`): the guard's settings (budget
   `drain_budget(known, N, P%)`, `max_drained_per_rack`, open or why not, closed domains), the slots to
   free, and a slot for each queue head in order while the budget and its rack cap leave room. The
   nodes that got one are granted (`permit` signals, all of one pass together); the others wait with
   the pool's reason. So the guard never counts the budget itself, and router drains it has not heard of
   are counted by the same compare-and-set. The incident's `drain_node` finds its slot held and cordons.
5. A permit comes back with its slot (`release_drain_permit`: return to service, close, abort): the
   `release` signal then serves the queue and records returns for the lemon rule (`returns`, per node,
   pruned to `lemon_window_s`; a grant carries `lemon` when the node's fault came back after
   `lemon_repairs` repairs).

The fail-slow analyzer's domain findings (issue 28): outliers sharing a rack, leaf, PDU or an inferred
domain are one finding there, and a worker sends the analyzer's current list (`analyzer_domains`,
`DomainReport`: each finding reported after `windows` windows in a row and still seen). Each becomes one
infrastructure incident (`source` analyzer: a ticket, a human paged), which denies the `fail_slow`
incidents of the nodes it explains in the analyzer's last window (queued ones at once; a node that
stands out even against its domain's own median is not among them: its fault is its own) and nothing
else: it does not count toward the
breaker, does not close its domain in the permit pool (a fatal fault there still drains under the
budget and rack cap), and `reset_breaker` leaves it to the analyzer. It closes as soon as a report no
longer lists it (the domain cleared: its nodes are judged again at once, and the analyzer, which
forgot their earlier reports when it explained them, reports a node that stays an outlier after the
usual `windows` windows), or `ANALYZER_DOMAIN_STALE` after the last report that listed it (no word
from the analyzer). Nothing of this runs in a history without an `analyzer_domains` signal, so it
needs no patch: tests/histories/fleetguard_fail_slow_rack.json, recorded before it, replays.

No cordon outlives its incident: while anyone holds or waits, every `permit_reconcile_s` the guard
withdraws queued requests whose incident is gone (`running_incidents`) and checks the pool's holders
(`reconcile_pool`): a drained node whose incident never started gets one (it adopts the drain); a node
whose incident was terminated or reset stays counted (it is still cordoned), listed as stranded, until
a human returns it (`fleetmend breaker release NODE`: undrain, then `release_permit` frees the slot).
A guard that starts without carried state (first use, or after it was terminated) rebuilds its holders
and queue from the running incidents first, answering no request before that.

Search attributes: `FleetCluster`, `FleetPhase` (`guarding`, `breaker_tripped`, `paused`). The current
details say why. History stays bounded: continue-as-new past `GuardInput.max_history_events`, carrying
the state. All messages and the carried state are defined in `fleetmend.messages`.

Versioning: the histories in tests/histories/fleetguard_*.json are the 0.2 baseline, recorded once with
this code (every earlier patch folded in; nothing was deployed). Every later change to the command order
goes behind `workflow.patched(<id>)`, listed here with a history recorded before it:
(none yet)
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
        DOMAIN_MAX_FINDINGS,
        DOMAIN_MAX_NODES,
        FAIL_SLOW_CLASS,
        INFRA_ANALYZER,
        INFRA_TOPOLOGY,
        KEY_CLUSTER,
        KEY_PHASE,
        Activity,
        CarriedMessage,
        DomainReport,
        GuardApi,
        GuardCommand,
        GuardInput,
        GuardPhase,
        GuardPolicy,
        GuardState,
        GuardStatus,
        Held,
        InfraIncident,
        PermitDecision,
        PermitRelease,
        PermitReleaseCommand,
        PermitRequest,
        Phase,
        PoolClaim,
        PoolReconcile,
        PoolReconciled,
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

HOLDING_PHASES = frozenset({Phase.DRAINING, Phase.DIAGNOSING, Phase.RECOVERING, Phase.AWAITING_REPAIR,
                            Phase.VERIFYING, Phase.RETURNING})
"""Incident phases that hold a drain permit (a rebuilt guard counts them)."""
RECONCILE_TIMEOUT = timedelta(minutes=2)
RECONCILE_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=30),
                              maximum_attempts=0)
POOL_TIMEOUT = timedelta(seconds=30)
POOL_RETRY = RetryPolicy(initial_interval=timedelta(milliseconds=200), maximum_interval=timedelta(seconds=10),
                         maximum_attempts=0)
"""The pool write is the grant: retried quickly and forever (NATS away: nothing is granted meanwhile)."""
CLAIM_SLACK = 20
"""Queue heads offered to the pool beyond its free slots (as of the last write), for heads a full rack
passes over. Only heads that may find room are offered: a queue of thousands behind a full budget costs
no pool write and no history per request."""

MAX_RETURNS_PER_NODE = 10
MAX_INFRA_KEPT = 20
ANALYZER_DOMAIN_STALE = timedelta(hours=1)
"""An analyzer infrastructure incident that no `DomainReport` has listed for this long closes (the
analyzer or the worker that relays it is gone; a live one resends its list every 15 min)."""
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
        self._inbox: list[PermitRequest | PermitRelease | DomainReport] = []
        """Requests and releases in arrival order (a release must not overtake its own request)."""
        self._tickets: list[InfraIncident] = []
        self._answers: list[tuple[str, PermitDecision]] = []
        self._dirty = False
        self._published_phase: GuardPhase | None = None
        self._reconcile_due = False
        self._reconcile_task: asyncio.Task[None] | None = None
        """The reconciliation in flight (`run`): like the pool write, it never holds up the main loop."""
        self._pool_task: asyncio.Task[None] | None = None
        """The pool write in flight (`_start_pool_sync`): the main loop never waits for it."""
        self._pool_synced = False
        """This run has written the pool once (a new run writes its settings again)."""
        self._claims_due = True
        """A request queued since the last write: offer the queue heads if that write left room."""
        self._room_changed = True
        """Room may have changed since the last write (a release, a reset, a resume, a new run): offer the
        queue heads whatever the last write's count said."""
        self._refused: dict[str, str] = {}
        """node → why the pool refused its slot in the last write (derived, never carried)."""
        self._recent_ix = RecentIndex()
        self._seen_set: set[str] = set()
        """`GuardState.seen_nodes` as a set (derived; rebuilt when the list grew elsewhere)."""

    # ---------------------------------------------------------------- messages
    @workflow.signal(name=GuardApi.REQUEST_PERMITS)
    def request_permits(self, reqs: list[PermitRequest]) -> None:
        """Permit requests in arrival order: an incident's own (a list of one), or the router's for the
        nodes of a burst it found no pool slot for (`PermitRequest.forwarded`). An empty list only
        starts the guard (it publishes the pool)."""
        self._inbox.extend(reqs)
        self._dirty = True

    @workflow.signal(name=GuardApi.RELEASE)
    def release(self, rel: PermitRelease) -> None:
        self._inbox.append(rel)

    @workflow.signal(name=GuardApi.DOMAINS)
    def analyzer_domains(self, report: DomainReport) -> None:
        """The fail-slow analyzer's domain findings now (module docstring): decided in the main loop, in
        arrival order with the requests."""
        self._inbox.append(report)

    @workflow.signal(name=GuardApi.POLICY)
    def policy(self, policy: GuardPolicy) -> None:
        """A worker's policy at its start: the newest wins (as with requests), and a change is written to
        the permit pool at once (a lowered budget, observe-only), not when the next request comes."""
        s = self._state
        if policy != s.policy:
            old, s.policy = s.policy, policy
            changed = [f"{k} {getattr(old, k)} → {getattr(policy, k)}" for k in vars(policy)
                       if getattr(old, k) != getattr(policy, k)]
            self._log(f"policy from a worker: {'; '.join(changed)}")
            self._room_changed = self._dirty = True

    @workflow.update(name=GuardApi.RELEASE_PERMIT)
    async def release_permit(self, cmd: PermitReleaseCommand) -> str:
        """Free `cmd.node`'s permit and pool slot (or withdraw its queued request) by hand; audited with
        `by`. The CLI returns the node to service first (`fleetmend breaker release`)."""
        s = self._state
        held = any(h.node == cmd.node for h in s.held)
        queued = any(q.node == cmd.node for q in s.queue)
        s.pool_drop.append(cmd.node)  # its pool slot, known to the guard or not (a router drain never adopted)
        s.stranded.pop(cmd.node, None)
        s.held = [h for h in s.held if h.node != cmd.node]
        s.queue = [q for q in s.queue if q.node != cmd.node]
        self._room_changed = self._dirty = True
        what = "permit released" if held else "queued request withdrawn" if queued else "permit pool slot freed"
        self._log(f"{cmd.node}: {what} by {cmd.by}{': ' + cmd.note if cmd.note else ''}")
        return (f"{cmd.node}: {what}; {len(s.queue)} queued" if held or queued else
                f"{cmd.node} holds no permit here and is not queued; its permit pool slot (if any) is freed")

    @release_permit.validator
    def _v_release_permit(self, cmd: PermitReleaseCommand) -> None:
        _require_by(cmd)
        if not cmd.node or not cmd.node.strip():
            raise ValueError("name the node whose permit to release")

    @workflow.query(name=GuardApi.STATUS)
    def status(self) -> GuardStatus:
        s = self._state
        return GuardStatus(
            cluster=s.cluster, budget=self._budget(), known_nodes=self._known(),
            held=[h.to_dict() for h in s.held],
            queue=[{**q.to_dict(), "waiting": self._waiting(q)} for q in self._ordered_queue()],
            breaker_tripped=s.breaker_tripped, breaker_reason=s.breaker_reason,
            breaker_tripped_at=iso(s.breaker_tripped_at), paused=s.paused, paused_by=s.paused_by,
            paused_at=iso(s.paused_at), paused_note=s.paused_note,
            observe_only=s.policy.observe_only, infra_incidents=[i.to_dict() for i in s.infra],
            recent_nodes=len({n for n, _ in s.recent}), log=s.log[-30:],
            router_only=list(s.router_only), pool_holders=s.pool_holders, stranded=dict(s.stranded))

    @workflow.update(name=GuardApi.RESET_BREAKER)
    async def reset_breaker(self, cmd: GuardCommand) -> str:
        s = self._state
        open_inc = [i.domain for i in s.infra if i.closed_at is None and i.source == INFRA_TOPOLOGY]
        if not s.breaker_tripped and not open_inc:
            return "the breaker is not tripped and no infrastructure incident is open: nothing to reset"
        was = s.breaker_reason
        s.breaker_tripped, s.breaker_reason, s.breaker_tripped_at = False, None, None
        s.recent = []  # the storm that tripped it is acknowledged; count afresh
        for inc in s.infra:
            if inc.closed_at is None and inc.source == INFRA_TOPOLOGY:  # the analyzer's follow the analyzer
                inc.closed_at = self._now()
        self._log(f"breaker reset by {cmd.by}{': ' + cmd.note if cmd.note else ''} (was: {was or 'not tripped'}"
                  + (f"; closed infrastructure incidents {', '.join(open_inc)}" if open_inc else "") + ")")
        self._room_changed = self._dirty = True
        return ("breaker reset" if was else "breaker was not tripped") \
            + (f"; infrastructure incident(s) {', '.join(open_inc)} closed" if open_inc else "") \
            + f"; {len(s.queue)} queued request(s) will be served in severity order"

    @reset_breaker.validator
    def _v_reset(self, cmd: GuardCommand) -> None:
        _require_by(cmd)

    @workflow.update(name=GuardApi.PAUSE)
    async def pause(self, cmd: GuardCommand) -> str:
        s = self._state
        if s.paused:
            return f"already paused by {s.paused_by} at {iso(s.paused_at)}" + (f": {s.paused_note}" if s.paused_note
                                                                               else "")
        s.paused, s.paused_by, s.paused_at, s.paused_note = True, cmd.by, self._now(), cmd.note
        self._log(f"paused by {cmd.by}{': ' + cmd.note if cmd.note else ''}: no new drains")
        self._dirty = True
        return "paused: faults are still classified and recorded; no node will be drained"

    @pause.validator
    def _v_pause(self, cmd: GuardCommand) -> None:
        _require_by(cmd)

    @workflow.update(name=GuardApi.RESUME)
    async def resume(self, cmd: GuardCommand) -> str:
        s = self._state
        if not s.paused:
            return "not paused: nothing to resume"
        s.paused, s.paused_by, s.paused_at, s.paused_note = False, None, None, ""
        self._log(f"resumed by {cmd.by}{': ' + cmd.note if cmd.note else ''}")
        self._room_changed = self._dirty = True
        return f"resumed; {len(s.queue)} queued request(s)"

    @resume.validator
    def _v_resume(self, cmd: GuardCommand) -> None:
        _require_by(cmd)

    # ---------------------------------------------------------------- main
    @workflow.run
    async def run(self, inp: GuardInput) -> None:
        carried: list[PermitRequest | PermitRelease | DomainReport] = [
            *(m.message for m in inp.pending), *inp.pending_releases, *inp.pending_requests]
        self._inbox = carried + self._inbox
        self._dirty = True
        if inp.carried is None:
            await self._rebuild()  # before answering anyone
        self._clock = asyncio.create_task(self._reconcile_clock())  # kept: a dropped task may be collected
        while True:
            await workflow.wait_condition(lambda: bool(self._inbox) or self._dirty or bool(self._tickets)
                                          or bool(self._answers) or self._reconcile_due)
            self._dirty = False
            if self._reconcile_due and (self._reconcile_task is None or self._reconcile_task.done()):
                self._reconcile_due = False
                self._reconcile_task = asyncio.create_task(self._reconcile())
            self._process()
            await self._send()
            await self._file_tickets()
            self._publish()
            self._start_pool_sync()
            info = workflow.info()
            if (info.get_current_history_length() > inp.max_history_events or info.is_continue_as_new_suggested()) \
                    and not self._inbox:
                await workflow.wait_condition(workflow.all_handlers_finished)
                for task in (self._pool_task, self._reconcile_task):
                    if task is not None and not task.done():
                        await task  # its grants, slots to free and findings must not be lost with this run
                if self._answers:
                    continue  # answers of the last write go out first; continue-as-new on a later pass
                s = self._state
                workflow.continue_as_new(GuardInput(
                    cluster=s.cluster, policy=s.policy, carried=s,
                    pending=[CarriedMessage.of(m) for m in self._inbox],  # in order: see GuardInput.pending
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
            elif isinstance(msg, DomainReport):
                self._analyzer_domains(msg, now)
            else:
                self._request(msg, now, queued)

    def _release(self, rel: PermitRelease) -> None:
        s = self._state
        if rel.still_drained and any(h.node == rel.node for h in s.held):
            # aborted with fleetmend's drain left in place: still cordoned, so still counted (its pool slot
            # kept by the activity) until a person returns it to service; no cordon outlives its count
            s.queue = [q for q in s.queue if q.node != rel.node]
            s.stranded[rel.node] = (f"its incident closed ({rel.outcome.value}) with fleetmend's drain left in "
                                    f"place: still counted; `fleetmend breaker release {rel.node}` returns it "
                                    "to service")
            self._log(f"{rel.node}: STRANDED: {s.stranded[rel.node]}")
            self._dirty = True
            return
        before = len(s.held) + len(s.queue)
        s.held = [h for h in s.held if h.node != rel.node]
        s.queue = [q for q in s.queue if q.node != rel.node]
        s.stranded.pop(rel.node, None)
        s.router_only = [n for n in s.router_only if n != rel.node]
        self._room_changed = True  # its slot is free (the activity gave it back before signalling)
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
        explained = self._explaining(req, now)
        if explained is not None:  # the analyzer's domain finding explains this node's slowness
            self._deny(req.node, self._explained_reason(explained), infra=explained.domain)
            return
        at = self._queued_at(req.node, queued)
        if at is not None and s.queue[at].counted and not req.preclaimed and not s.policy.observe_only:
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
            s.router_only = [n for n in s.router_only if n != req.node]
            self._log(f"{req.node}: drained by the router under a permit pool slot; adopted "
                      f"({req.severity} {req.fault_class})")
            self._answers.append((req.node, PermitDecision(
                granted=True, reason="adopted: drained by the router under a permit pool slot",
                lemon=self._lemon(req, now))))
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
        else:
            self._requeue(at, req)
        if s.pool_holders < self._budget():  # room as of the last write: offer the heads
            self._claims_due = True
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
            if inc.closed_at is None and inc.source == INFRA_TOPOLOGY and now - inc.last_fault_at > window:
                inc.closed_at = self._now()
                self._log(f"infrastructure incident {inc.domain} closed: no fault for {window}")
        for dom in req.domains:
            open_inc = next((i for i in s.infra if i.domain == dom and i.closed_at is None
                             and i.source == INFRA_TOPOLOGY), None)
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

    # ---------------------------------------------------------------- the analyzer's domain findings
    def _analyzer_domains(self, rep: DomainReport, now: datetime) -> None:
        """Open an infrastructure incident for each domain finding the report lists that none is open for
        (its queued fail_slow requests denied), widen and confirm the open ones, and close the ones it
        no longer lists (the domain cleared)."""
        s = self._state
        if rep.window_end is not None and s.analyzer_window_end is not None and rep.window_end < s.analyzer_window_end:
            return  # an older report overtaken by a newer one (two workers relayed it)
        if rep.window_end is not None:
            s.analyzer_window_end = rep.window_end
        self._expire_analyzer_incidents(now)
        findings = {f.key: f for f in rep.findings[:DOMAIN_MAX_FINDINGS]}
        for inc in s.infra:
            if inc.source == INFRA_ANALYZER and inc.closed_at is None and inc.domain not in findings:
                inc.closed_at, inc.closed_why = self._now(), "cleared: the analyzer no longer reports it"
                self._log(f"infrastructure incident {inc.domain} (fail-slow domain) cleared by the analyzer; "
                          f"its {len(inc.nodes)} nodes are judged again")
        for key, f in findings.items():
            nodes = sorted(set(f.nodes))[:DOMAIN_MAX_NODES]
            found = next((i for i in s.infra if i.domain == key and i.source == INFRA_ANALYZER
                          and i.closed_at is None), None)
            if found is None:
                inc = InfraIncident(domain=key, opened_at=self._now(), last_fault_at=self._now(), nodes=nodes,
                                    source=INFRA_ANALYZER, metrics=sorted(set(f.metrics)), confirmed_at=self._now())
                s.infra.append(inc)
                self._keep_infra()
                self._log(f"INFRASTRUCTURE INCIDENT {key} (fail-slow domain from the analyzer): {len(nodes)} nodes "
                          f"slower on {', '.join(inc.metrics) or 'shared metrics'} ({', '.join(nodes[:10])}"
                          f"{' …' if len(nodes) > 10 else ''}); paging, draining none of them for it")
                self._tickets.append(inc)
            else:
                inc = found
                inc.nodes = nodes  # the outliers it explains now: a node standing out in it is its own
                inc.metrics = sorted(set(inc.metrics) | set(f.metrics))
                inc.confirmed_at = self._now()
            members = set(inc.nodes)
            for q in [q for q in s.queue if q.node in members and q.fault_class == FAIL_SLOW_CLASS]:
                s.queue.remove(q)
                reason = self._explained_reason(inc)
                self._log(f"{q.node}: denied: {reason}")
                self._answers.append((q.node, PermitDecision(granted=False, reason=reason, infra_incident=key)))
        self._dirty = True

    def _explaining(self, req: PermitRequest, now: datetime) -> InfraIncident | None:
        """The open analyzer incident whose domain explains `req` (a fail_slow of one of its nodes)."""
        s = self._state
        if req.fault_class != FAIL_SLOW_CLASS or req.preclaimed or not s.infra:
            return None
        self._expire_analyzer_incidents(now)
        return next((i for i in s.infra if i.source == INFRA_ANALYZER and i.closed_at is None
                     and req.node in i.nodes), None)

    def _expire_analyzer_incidents(self, now: datetime) -> None:
        for inc in self._state.infra:
            if (inc.source == INFRA_ANALYZER and inc.closed_at is None
                    and now - (inc.confirmed_at or inc.opened_at) > ANALYZER_DOMAIN_STALE):
                inc.closed_at, inc.closed_why = self._now(), f"no report from the analyzer for {ANALYZER_DOMAIN_STALE}"
                self._log(f"infrastructure incident {inc.domain} (fail-slow domain) closed: "
                          f"no report from the analyzer for {ANALYZER_DOMAIN_STALE}")

    @staticmethod
    def _explained_reason(inc: InfraIncident) -> str:
        return (f"fail-slow explained by infrastructure incident {inc.domain} (the analyzer's domain finding: "
                f"{len(inc.nodes)} nodes slower on {', '.join(inc.metrics) or 'shared metrics'}); not drained, a "
                "human is paged; the analyzer judges the node again once the domain clears")

    def _keep_infra(self) -> None:
        """At most `MAX_INFRA_KEPT` infrastructure incidents: the oldest closed ones go first."""
        s = self._state
        extra = len(s.infra) - MAX_INFRA_KEPT
        if extra > 0:
            closed = [i for i in s.infra if i.closed_at is not None][:extra]
            s.infra = [i for i in s.infra if all(i is not c for c in closed)]

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
        """Every `permit_reconcile_s`: reconcile. Always, even with nothing held here: the router takes
        slots without telling the guard, and one whose incident never started is found only by reading
        the pool (one timer and one KV read per period)."""
        s = self._state
        while True:
            await workflow.sleep(s.policy.permit_reconcile_s)
            self._reconcile_due = True

    async def _running(self, nodes: list[str] | None) -> list[RunningIncident]:
        return await workflow.execute_activity(
            Activity.RUNNING_INCIDENTS, RunningIncidents(cluster=self._state.cluster, nodes=nodes),
            result_type=list[RunningIncident], start_to_close_timeout=RECONCILE_TIMEOUT,
            retry_policy=RECONCILE_RETRY, summary="which permit holders still have a running incident")

    async def _reconcile(self) -> None:
        """Queued requests whose incident is gone are withdrawn; the pool's holders are checked
        (`reconcile_pool`): a drained node whose incident never started gets one, a drained node whose
        incident no longer runs stays counted and is listed as stranded."""
        s = self._state
        queued = sorted({q.node for q in s.queue})
        if queued:
            alive = {r.node for r in await self._running(queued)}
            for node in queued:
                if node not in alive and any(q.node == node for q in s.queue):
                    s.queue = [q for q in s.queue if q.node != node]
                    self._log(f"{node}: queued request withdrawn by reconciliation: its incident is not running")
                    self._dirty = True
        r: PoolReconciled = await workflow.execute_activity(
            Activity.RECONCILE_POOL, PoolReconcile(cluster=s.cluster, grace_s=s.policy.permit_reconcile_s),
            result_type=PoolReconciled, start_to_close_timeout=RECONCILE_TIMEOUT, retry_policy=RECONCILE_RETRY,
            summary="every drained node has a running incident")
        s.pool_holders = r.holders
        for node in r.given:
            self._log(f"{node}: drained by the router but its incident never started; opened it (it adopts the drain)")
        for node in r.opened_waiting:
            self._log(f"{node}: refused a slot by the router and its incident never started; opened it")
        for node, why in r.stranded.items():
            if s.stranded.get(node) != why:
                self._log(f"{node}: STRANDED: {why}")
        s.stranded = dict(r.stranded)
        self._dirty = True

    async def _rebuild(self) -> None:
        """A guard without carried state: take the running incidents that hold a drain (their phase) as
        holders and queue those awaiting a permit, before answering anyone."""
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

    # ---------------------------------------------------------------- the pool: settings and grants
    def _pool_view(self) -> PoolSync:
        """What the pool must say now (budget, rack cap, open or why not, closed domains) and the queue
        heads to offer it (none while the breaker is tripped, the guard paused or observe-only)."""
        s = self._state
        why = ""
        if s.policy.observe_only:
            why = "observe-only: nothing is drained"
        elif s.breaker_tripped:
            why = f"breaker tripped at {iso(s.breaker_tripped_at)}"
        elif s.paused:
            why = f"paused by {s.paused_by}"
        closed = sorted({i.domain for i in s.infra if i.closed_at is None and i.source == INFRA_TOPOLOGY})
        free = max(self._budget() - s.pool_holders, 0)
        offer = self._room_changed or (self._claims_due and free > 0)
        claims = [PoolClaim(node=q.node, rack=q.rack) for q in self._ordered_queue()[:free + CLAIM_SLACK]] \
            if not why and s.queue and offer else []
        return PoolSync(cluster=s.cluster, budget=self._budget(), rack_cap=s.policy.max_drained_per_rack,
                        open=not why, why=why, closed_domains=closed, claims=claims)

    def _start_pool_sync(self) -> None:
        """Write the pool in the background when it must change (`_sync_pool`). The main loop goes on
        taking requests meanwhile: under a storm an activity round trip takes seconds, and a loop
        waiting for it would leave signalled requests unqueued that long."""
        if (self._pool_task is None or self._pool_task.done()) and self._pool_due() is not None:
            self._pool_task = asyncio.create_task(self._pool_syncer())

    async def _pool_syncer(self) -> None:
        while (due := self._pool_due()) is not None:  # what changed while a write was in flight goes next
            await self._sync_pool(*due)

    def _pool_due(self) -> tuple[PoolSync, str] | None:
        """(the write to make, its settings' signature), or None when the last write already said it, no
        slot is to be freed and no queue head is to be offered."""
        s = self._state
        view = self._pool_view()
        sig = f"{view.budget}|{view.rack_cap}|{view.open}|{view.why}|{','.join(view.closed_domains)}"
        if sig == s.pool_published and not s.pool_drop and not view.claims and self._pool_synced:
            return None
        return view, sig

    async def _sync_pool(self, view: PoolSync, sig: str) -> None:
        """Write `view` with the slots to free, and grant the claims that got a slot. The guard's holders
        go with it: the pool adds them only when it is new."""
        s = self._state
        view.held = {h.node: h.rack for h in s.held}
        view.drop, s.pool_drop = sorted(set(s.pool_drop)), []
        self._claims_due = self._room_changed = False  # until a request, a release, a reset (set meanwhile: again)
        r: PoolSynced = await workflow.execute_activity(
            Activity.SYNC_PERMIT_POOL, view, result_type=PoolSynced, start_to_close_timeout=POOL_TIMEOUT,
            retry_policy=POOL_RETRY, summary=f"permit pool: {view.budget} slots, "
                                             f"{'open' if view.open else 'closed: ' + view.why}"
                                             + (f"; {len(view.claims)} queue head(s) offered" if view.claims else ""))
        if sig != s.pool_published:
            self._log(f"permit pool: budget {view.budget}, {view.rack_cap} per rack, "
                      f"{'open' if view.open else 'closed (' + view.why + ')'}"
                      + (f", closed domains {', '.join(view.closed_domains)}" if view.closed_domains else "")
                      + f"; {r.holders} slot(s) held")
        s.pool_published, self._pool_synced = sig, True
        s.pool_holders = r.holders
        held = {h.node for h in s.held}
        s.router_only = [n for n in r.router_only if n not in held]
        self._refused = dict(r.refused)
        if not view.claims and view.open and s.queue and r.holders < view.budget:
            self._room_changed = True  # this write freed slots (or the guard's count was stale): offer heads next
        granted = set(r.granted)
        now = workflow.now()
        for q in [q for q in self._ordered_queue() if q.node in granted]:
            s.queue.remove(q)
            s.held.append(Held(node=q.node, severity=q.severity, fault_class=q.fault_class, rack=q.rack,
                               granted_at=self._now()))
            s.grants += 1
            lemon = self._lemon(PermitRequest(cluster=s.cluster, node=q.node, severity=q.severity,
                                              fault_class=q.fault_class), now)
            self._log(f"{q.node}: permit granted ({q.severity.value} {q.fault_class}; "
                      f"{r.holders}/{view.budget} slots held)")
            self._answers.append((q.node, PermitDecision(granted=True, reason=f"pool slot {r.holders}/{view.budget}",
                                                         lemon=lemon)))
        # a slot taken for a node that left the queue while the write was in flight goes back
        gone = granted - {h.node for h in s.held}
        if gone:
            s.pool_drop.extend(sorted(gone))
        self._dirty = True

    async def _send(self) -> None:
        """Signal the collected answers to their incidents, all at once."""
        s = self._state
        answers, self._answers = self._answers, []

        async def deliver(node: str, decision: PermitDecision) -> None:
            handle = workflow.get_external_workflow_handle(subjects.workflow_id(s.cluster, node))
            try:
                await handle.signal(RemediationApi.PERMIT, decision)
            except Exception as err:  # noqa: BLE001 - the incident closed meanwhile: take the permit back
                if decision.granted and not decision.reason.startswith("adopted"):
                    s.held = [h for h in s.held if h.node != node]
                    s.pool_drop.append(node)  # granted, never drained: its slot goes back
                self._log(f"{node}: could not deliver permit decision ({err}); "
                          + ("permit withdrawn" if decision.granted else "dropped"))
                self._dirty = True

        if answers:
            await asyncio.gather(*(deliver(n, d) for n, d in answers))

    async def _file_tickets(self) -> None:
        incs, self._tickets = self._tickets, []
        s = self._state
        for inc in incs:
            if inc.source == INFRA_ANALYZER:
                severity, title = "degraded", (f"[fleetmend] infrastructure incident {inc.domain} in {s.cluster}: "
                                               f"{len(inc.nodes)} nodes slower ({', '.join(inc.metrics)})")
                note = ("the fail-slow analyzer found these nodes slower together under one failure domain (a rack's "
                        "cooling or power, a leaf switch, or inferred from outliers that started together): not "
                        "their own fault; none of them is drained for it, and they are judged again once it clears")
            else:
                severity, title = "fatal", (f"[fleetmend] infrastructure incident {inc.domain} in {s.cluster}: "
                                            f"{len(inc.nodes)} nodes")
                note = "correlated faults under one failure domain; nothing was drained"
            evidence = {"domain": inc.domain, "nodes": inc.nodes, "opened_at": iso(inc.opened_at), "note": note}
            if inc.source == INFRA_ANALYZER:
                evidence |= {"source": inc.source, "metrics": inc.metrics}
            ref: TicketRef = await workflow.execute_activity(
                Activity.FILE_TICKET, TicketRequest(
                    incident_id=f"{workflow.info().workflow_id}/{inc.domain}/{iso(inc.opened_at)}", cluster=s.cluster,
                    node=inc.domain.replace(":", "-"), severity=severity, fault_class="infrastructure",
                    title=title, evidence=evidence),
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
        refused = self._refused.get(q.node)
        if refused is None and s.pool_holders >= self._budget():  # not offered yet, and no room
            refused = f"budget: {s.pool_holders}/{self._budget()} permits held"
        if refused is None:
            return "next in the queue"
        extra = f", {len(s.router_only)} of them drained by the router, not adopted yet" if s.router_only else ""
        return f"{refused} (blast radius{extra}); {len(s.queue)} queued"

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
                 f"permit pool: {s.pool_holders}/{self._budget()} slots held (known nodes {self._known()}); "
                 f"queued: {len(s.queue)}"]
        if s.router_only:
            ro = s.router_only
            lines.append(f"router drains not adopted yet: {len(ro)} ({', '.join(ro[:10])}{' …' if len(ro) > 10 else ''})")
        if s.stranded:
            lines.append(f"stranded (drained, incident gone; still counted): {', '.join(sorted(s.stranded)[:10])}; "
                         "`fleetmend breaker release NODE`")
        if s.breaker_tripped:
            lines.append(f"breaker tripped at {iso(s.breaker_tripped_at)}: {s.breaker_reason}")
            lines.append("reset: `fleetmend breaker reset`")
        if s.paused:
            lines.append(f"paused by {s.paused_by}")
        open_inc = [i for i in s.infra if i.closed_at is None]
        if open_inc:
            lines.append("infrastructure incidents: " + ", ".join(
                f"{i.domain} ({i.ticket}{', fail-slow domain' if i.source == INFRA_ANALYZER else ''})"
                for i in open_inc))
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
