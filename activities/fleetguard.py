"""Drain permits: NodeRemediation → FleetGuard (the guard starts on first use), and FleetGuard → the
permit pool (`fleetmend.infra.permit_pool`).

A workflow cannot signal-with-start another workflow, so these activities do it with the worker's
client: `request_drain_permit` (the incident's one way to ask: signal-with-start of the guard with a
`request_permits` list of one; the answer comes back as a `permit` signal), `release_drain_permit`
(the pool slot, then the guard's `release` signal), and the guard's own `sync_permit_pool` (its one
write to the pool: settings, slots to free, slots to take for the nodes it grants), `running_incidents`
and `reconcile_pool` (no cordon outlives its incident). The worker loads the topology file once and
attaches each node's failure domains to its request; the file itself never enters workflow history
(bounded payloads for big clusters).
"""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

from nats.js import JetStreamContext
from temporalio import activity
from temporalio.client import Client, WorkflowExecution, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from activities.quarantine import PoolGate
from fleetmend import subjects
from fleetmend.catalog import Catalog, load_catalog
from fleetmend.config import Settings
from fleetmend.events import FaultEvent, Severity
from fleetmend.infra.incidents import signal_guard, start_incident
from fleetmend.infra.ledger import LedgerStore
from fleetmend.infra.permit_pool import BY_ROUTER
from fleetmend.messages import (
    KEY_CLUSTER,
    KEY_FAULT_CLASS,
    KEY_NODE,
    KEY_PHASE,
    KEY_SEVERITY,
    Activity,
    DomainReport,
    FaultBatch,
    GuardApi,
    GuardPolicy,
    IncidentInput,
    IncidentPolicy,
    PermitRelease,
    PermitRequest,
    Phase,
    PoolReconcile,
    PoolReconciled,
    PoolSync,
    PoolSynced,
    RemediationApi,
    RoutedFault,
    RunningIncident,
    RunningIncidents,
    for_workflow,
    guard_task_queue,
)
from fleetmend.policy import Topology, load_topology


def guard_policy(settings: Settings, topology: Topology | None = None) -> GuardPolicy:
    """`GuardPolicy` from `Settings.policy` and the topology's node count."""
    return GuardPolicy.from_settings(settings.policy, len(topology) if topology is not None else 0)


class FleetGuardActivities:
    """Args: client (temporalio Client), task_queue the guard runs on (`messages.guard_task_queue` of the
    cluster's queue), policy (`GuardPolicy`), gate (`activities.quarantine.PoolGate`: the permit pool),
    topology (`Topology`, node → rack/leaf/PDU); incident_task_queue, incident_policy and catalog: how
    `reconcile_pool` opens the incident of a drained node that never got one (the cluster's queue, the
    incidents' policy, the catalog that classifies its fault)."""

    def __init__(self, client: Client, task_queue: str, policy: GuardPolicy, gate: PoolGate,
                 topology: Topology | None = None, *, incident_task_queue: str | None = None,
                 incident_policy: IncidentPolicy | None = None, catalog: Catalog | None = None,
                 ledger: LedgerStore | None = None) -> None:
        self._client = client
        self.ledger = ledger
        """The incident ledger: `release_drain_permit` closes the incident's record (never fails it)."""
        self._task_queue = task_queue
        self._policy = policy
        self._topology = topology or Topology()
        self.gate = gate
        self._incident_tq = incident_task_queue or task_queue.removesuffix("-guard")
        self._incident_policy = incident_policy or IncidentPolicy()
        self._catalog = catalog

    @classmethod
    def from_settings(cls, client: Client, settings: Settings, js: JetStreamContext,
                      task_queue: str | None = None) -> FleetGuardActivities:
        """`task_queue`: the cluster's queue (default `settings.task_queue`); the guard runs on its
        `guard_task_queue`. `js`: JetStream, for the permit pool."""
        topo = load_topology(settings.policy.topology_file)
        tq = task_queue or settings.task_queue
        return cls(client, guard_task_queue(tq), guard_policy(settings, topo), PoolGate(js, topo), topo,
                   incident_task_queue=tq,
                   incident_policy=IncidentPolicy.from_settings(settings.policy, settings.notify.any),
                   catalog=load_catalog(settings.catalog_overrides))

    async def _signal_with_start(self, cluster: str, signal: str, arg: Any) -> None:
        await signal_guard(self._client, cluster, self._task_queue, self._policy, signal, arg)

    @activity.defn(name=Activity.REQUEST_DRAIN_PERMIT)
    async def request_drain_permit(self, req: PermitRequest) -> None:
        """Queue `req` at the cluster's FleetGuard (`request_permits`, a list of one), with the node's
        failure domains and whether the router already drained it under a pool slot (`preclaimed`: the
        guard adopts it). The decision comes back as a `permit` signal. Idempotent: the guard keeps a
        queued node's place and grants a holder again."""
        dom = self._topology.domain(req.node)
        preclaimed = await self.gate.drained_by_router(req.cluster, req.node)
        full = replace(req, rack=dom.rack, domains=dom.keys(), policy=self._policy, preclaimed=preclaimed)
        await self._signal_with_start(req.cluster, GuardApi.REQUEST_PERMITS, [full])

    @activity.defn(name=Activity.RUNNING_INCIDENTS)
    async def running_incidents(self, q: RunningIncidents) -> list[RunningIncident]:
        """The nodes of `q.nodes` whose incident is running (each described: authoritative), or for
        `nodes=None` every running incident of the cluster (visibility, with its phase, severity,
        fault class and failure domains). A node whose workflow is unknown counts as not running."""
        out: list[RunningIncident] = []
        if q.nodes is None:
            query = (f"WorkflowType='{RemediationApi.WORKFLOW}' AND {KEY_CLUSTER.name}='{q.cluster}' "
                     "AND ExecutionStatus='Running'")
            try:
                async for wf in self._client.list_workflows(query):
                    out.append(self._running(wf))
                    activity.heartbeat(len(out))
            except RPCError as err:
                if err.status != RPCStatusCode.UNIMPLEMENTED:
                    raise
                # a server without visibility listing (Temporal's time-skipping test server): the guard
                # starts from what later requests tell it (incidents re-request every permit_rerequest_s)
                activity.logger.warning("running_incidents: this Temporal server cannot list workflows (%s); "
                                        "FleetGuard of %s starts without rebuilding", err, q.cluster)
            return out
        for i, node in enumerate(q.nodes):
            try:
                desc = await self._client.get_workflow_handle(subjects.workflow_id(q.cluster, node)).describe()
            except RPCError as err:
                if err.status == RPCStatusCode.NOT_FOUND:
                    continue
                raise
            if desc.status == WorkflowExecutionStatus.RUNNING:
                out.append(self._running(desc))
            if i % 50 == 0:
                activity.heartbeat(i)
        return out

    def _running(self, wf: WorkflowExecution) -> RunningIncident:
        sa = wf.typed_search_attributes
        node = sa.get(KEY_NODE) or wf.id.rsplit("/", 1)[-1]
        dom = self._topology.domain(node)
        phase, sev = sa.get(KEY_PHASE), sa.get(KEY_SEVERITY)
        return RunningIncident(node=node, phase=Phase(phase) if phase in set(Phase) else None,
                               severity=Severity(sev) if sev in set(Severity) else None,
                               fault_class=sa.get(KEY_FAULT_CLASS) or "", rack=dom.rack, domains=dom.keys())

    @activity.defn(name=Activity.RELEASE_DRAIN_PERMIT)
    async def release_drain_permit(self, rel: PermitRelease) -> None:
        """Give a permit back (or withdraw a queued request): its permit pool slot, then the guard's
        `release` (lemon history, the queue served). `rel.still_drained`: the node stays cordoned, so its
        slot is kept (the guard lists it as stranded). Idempotent."""
        if not rel.still_drained:
            await self.gate.release(rel.cluster, rel.node)
        await self._signal_with_start(rel.cluster, GuardApi.RELEASE, rel)
        if self.ledger is not None:
            wid = activity.info().workflow_id or subjects.workflow_id(rel.cluster, rel.node)
            await self.ledger.closed(cluster=rel.cluster, node=rel.node, workflow_id=wid,
                                     outcome=rel.outcome.value)

    @activity.defn(name=Activity.SYNC_PERMIT_POOL)
    async def sync_permit_pool(self, sync: PoolSync) -> PoolSynced:
        """FleetGuard's write to its cluster's permit pool (`fleetmend.infra.permit_pool.PermitPool.publish`),
        one compare-and-set: budget, rack cap, open/why, closed domains; `held` added when the pool is
        new; `drop` freed; then `claims` take their slots in order while there is room.

        Returns:
            `PoolSynced`: slots held, the router's holders the guard does not hold, the claims granted
            and refused (with why).
        Raises:
            PoolBusyError: the key kept changing (retried)."""
        pool = await self.gate.pool()
        state, claims = await pool.publish(
            sync.cluster, budget=sync.budget, rack_cap=sync.rack_cap, open=sync.open, why=sync.why,
            closed_domains=sync.closed_domains, held=sync.held, drop=sync.drop,
            claims=[(c.node, c.rack) for c in sync.claims])
        return PoolSynced(holders=len(state.holders),
                          router_only=sorted(n for n, h in state.holders.items()
                                             if h.by == BY_ROUTER and n not in sync.held),
                          granted=[c.node for c, got in zip(sync.claims, claims, strict=True) if got.ok],
                          refused={c.node: got.reason for c, got in zip(sync.claims, claims, strict=True)
                                   if not got.ok})

    @activity.defn(name=Activity.RECONCILE_POOL)
    async def reconcile_pool(self, q: PoolReconcile) -> PoolReconciled:
        """Every pool holder older than `q.grace_s` must have a running incident.

        - No incident at all (the router drained the node, then Temporal stayed away past its deliveries,
          or the router died between the cordon and the signal-with-start): one is started now with the
          fault the router drained for (`Holder.fault`, classified by the catalog); it asks for its
          permit `preclaimed` and adopts the drain. A holder without a recorded fault is reported
          stranded.
        - An incident that is no longer running (terminated, reset, timed out): stranded, still counted
          (its node is still cordoned) until `fleetmend breaker release NODE` returns it to service.
        - A node the router refused a slot and noted as waiting (`PermitPool.note_waiting`) whose incident
          never started (its fault dead-lettered while Temporal was away): its incident is started with the
          noted fault, and it asks for its permit. Its wait key goes either way.

        Returns:
            `PoolReconciled`. Raises: RPCError (Temporal away: retried), PoolBusyError."""
        state = await (await self.gate.pool()).read(q.cluster)
        if state is None:
            return PoolReconciled(holders=0)
        out = PoolReconciled(holders=len(state.holders))
        cutoff = time.time() - q.grace_s
        for i, (node, holder) in enumerate(sorted(state.holders.items())):
            if holder.at > cutoff:
                continue
            if i % 50 == 0:
                activity.heartbeat(i)
            try:
                desc = await self._client.get_workflow_handle(subjects.workflow_id(q.cluster, node)).describe()
            except RPCError as err:
                if err.status != RPCStatusCode.NOT_FOUND:
                    raise
                desc = None
            if desc is not None and desc.status == WorkflowExecutionStatus.RUNNING:
                continue
            if desc is not None:
                status = desc.status.name.lower() if desc.status is not None else "closed"
                out.stranded[node] = (f"drained under a permit, but its incident is {status}: still counted; "
                                      f"`fleetmend breaker release {node}` returns it to service")
                continue
            if holder.fault is None or self._catalog is None:
                out.stranded[node] = "drained under a permit and no incident was ever opened (no fault recorded)"
                continue
            await self._open_incident(q.cluster, node, holder.fault)
            out.given.append(node)
        pool = await self.gate.pool()
        for (cluster, node), w in sorted((await pool.waiting(q.cluster)).items()):
            if float(w.get("at") or 0) > cutoff:
                continue  # the router is still starting it
            try:
                await self._client.get_workflow_handle(subjects.workflow_id(cluster, node)).describe()
            except RPCError as err:
                if err.status != RPCStatusCode.NOT_FOUND:
                    raise
                if w.get("fault") and self._catalog is not None:
                    await self._open_incident(cluster, node, w["fault"])
                    out.opened_waiting.append(node)
            await pool.clear_waiting(cluster, node)  # started (by the router or here), or gone
        return out

    async def _open_incident(self, cluster: str, node: str, fault: dict[str, Any]) -> None:
        """Start `node`'s incident with the fault the router drained it for."""
        assert self._catalog is not None
        ev = FaultEvent.model_validate({**fault, "cluster": cluster, "node": node,
                                        "attrs": {"opened_by": "fleetguard reconciliation: drained by the router, "
                                                               "its incident had never started"}})
        stamped = ev if ev.verdict is not None else self._catalog.stamp(ev)
        batch = FaultBatch(faults=[RoutedFault(event=for_workflow(stamped, None))],
                           routed_at=datetime.now(timezone.utc))
        await start_incident(self._client, self._incident_tq,
                             IncidentInput(cluster=cluster, node=node, policy=self._incident_policy), batch)
        activity.logger.warning("reconcile_pool: %s/%s was drained with no incident; opened one", cluster, node)


async def announce_policy(client: Client, settings: Settings, task_queue: str | None = None) -> None:
    """Tell the cluster's FleetGuard this worker's policy (signal-with-start of `GuardApi.POLICY`), so a
    changed budget, rack cap or observe-only reaches the guard and the permit pool at the worker's start,
    not with the next permit request. Raises what `Client.start_workflow` raises."""
    policy = guard_policy(settings, load_topology(settings.policy.topology_file))
    await signal_guard(client, settings.cluster, guard_task_queue(task_queue or settings.task_queue), policy,
                       GuardApi.POLICY, policy)


async def report_domains(client: Client, settings: Settings, report: DomainReport, policy: GuardPolicy | None = None,
                         task_queue: str | None = None) -> None:
    """Hand the fail-slow analyzer's domain findings to the cluster's FleetGuard (signal-with-start of
    `GuardApi.DOMAINS`): each one an infrastructure incident there (`fleetmend.worker.analyzer_link`
    sends it). `policy`: the guard's (default from `settings` and the topology file). Raises what
    `Client.start_workflow` raises."""
    if policy is None:
        policy = guard_policy(settings, load_topology(settings.policy.topology_file))
    await signal_guard(client, settings.cluster, guard_task_queue(task_queue or settings.task_queue), policy,
                       GuardApi.DOMAINS, report)


def fault_summary(ev: FaultEvent) -> dict[str, Any]:
    """What the router records with its pool slot (`Holder.fault`, ~150 bytes): the event's identity
    (id, kind, code, device, component, severity, time, source), enough to open the incident later
    (`FleetGuardActivities.reconcile_pool`, which classifies it again). No text, attributes or verdict:
    the pool's one document is rewritten by every claim, so each holder must stay small."""
    d = ev.model_dump(mode="json", include={"event_id", "component", "kind", "code", "severity", "observed_at",
                                            "source"}, exclude_none=True)
    dev = ev.device.model_dump(mode="json", exclude_none=True)
    if dev:
        d["device"] = dev
    return d


__all__ = ["FleetGuardActivities", "announce_policy", "fault_summary", "guard_policy", "report_domains"]
