"""Drain permits: NodeRemediation → FleetGuard (the guard starts on first use).

A workflow cannot signal- or update-with-start another workflow, so these activities do it with the
worker's client: `decide_drain_permit` (update-with-start; the guard's decision is the result),
`request_drain_permit` (signal-with-start; incidents started before the update path),
`release_drain_permit`, and the guard's own `running_incidents` (reconciliation). The worker loads
the topology file once and attaches each node's failure domains to its request;
the file itself never enters workflow history (bounded payloads for big clusters).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from nats.js import JetStreamContext
from temporalio import activity
from temporalio.client import Client, WithStartWorkflowOperation, WorkflowExecution, WorkflowExecutionStatus
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from activities.quarantine import PoolGate
from fleetmend import subjects
from fleetmend.config import Settings
from fleetmend.events import Severity
from fleetmend.infra.permit_pool import BY_ROUTER
from fleetmend.messages import (
    KEY_CLUSTER,
    KEY_FAULT_CLASS,
    KEY_NODE,
    KEY_PHASE,
    KEY_SEVERITY,
    Activity,
    GuardApi,
    GuardInput,
    GuardPolicy,
    PermitDecision,
    PermitRelease,
    PermitRequest,
    Phase,
    PoolSync,
    PoolSynced,
    RemediationApi,
    RunningIncident,
    RunningIncidents,
    guard_task_queue,
)
from fleetmend.policy import Topology, load_topology

UPDATES_IN_FLIGHT = 4
"""`decide_permit` updates one worker has in flight at once (Temporal refuses more than 10 per workflow
by default; a few worker replicas stay under it)."""


def guard_policy(settings: Settings, topology: Topology | None = None) -> GuardPolicy:
    """`GuardPolicy` from `Settings.policy` and the topology's node count."""
    return GuardPolicy.from_settings(settings.policy, len(topology) if topology is not None else 0)


class FleetGuardActivities:
    """Args: client (temporalio Client), task_queue the guard runs on (`messages.guard_task_queue` of the
    cluster's queue in a real worker), policy (`GuardPolicy`), topology (`Topology`, node → rack/leaf/PDU).

    `decide_drain_permit` is run by NodeRemediation as a *local* activity: the decision reaches the
    incident in the workflow task that asked for it (no activity task, no second workflow task)."""

    def __init__(self, client: Client, task_queue: str, policy: GuardPolicy,
                 topology: Topology | None = None, gate: PoolGate | None = None) -> None:
        self._client = client
        self._task_queue = task_queue
        self._policy = policy
        self._topology = topology or Topology()
        self._in_flight = asyncio.Semaphore(UPDATES_IN_FLIGHT)
        self.gate = gate
        """`activities.quarantine.PoolGate` (`policy.fast_drain`); None: no permit pool."""

    @classmethod
    def from_settings(cls, client: Client, settings: Settings, task_queue: str | None = None,
                      js: JetStreamContext | None = None) -> FleetGuardActivities:
        """`task_queue`: the guard's own queue; default `guard_task_queue(settings.task_queue)`. `js`:
        JetStream, for the permit pool (`policy.fast_drain`); without it there is no pool."""
        topo = load_topology(settings.policy.topology_file)
        gate = PoolGate(js, topo, settings.policy.fast_drain) if js is not None else None
        return cls(client, task_queue or guard_task_queue(settings.task_queue), guard_policy(settings, topo), topo,
                   gate=gate)

    async def _signal_with_start(self, cluster: str, signal: str, arg: Any) -> None:
        await self._client.start_workflow(
            GuardApi.WORKFLOW, GuardInput(cluster=cluster, policy=self._policy),
            id=subjects.fleetguard_workflow_id(cluster), task_queue=self._task_queue,
            start_signal=signal, start_signal_args=[arg],
            static_summary=f"FleetGuard {cluster}: drain budget and breaker")

    @activity.defn(name=Activity.REQUEST_DRAIN_PERMIT)
    async def request_drain_permit(self, req: PermitRequest) -> None:
        """Queue `req` at the cluster's FleetGuard; the decision comes back as a `permit` signal."""
        dom = self._topology.domain(req.node)
        full = replace(req, rack=dom.rack, domains=dom.keys(), policy=self._policy)
        await self._signal_with_start(req.cluster, GuardApi.REQUEST_PERMIT, full)

    @activity.defn(name=Activity.DECIDE_DRAIN_PERMIT)
    async def decide_drain_permit(self, req: PermitRequest) -> PermitDecision:
        """Ask the cluster's FleetGuard for a permit by update-with-start and return its decision:
        granted, denied, or `queued` (the grant follows as a `permit` signal). Idempotent.

        Temporal admits only a few updates in flight per workflow (`history.maxInFlightUpdates`, 10 by
        default; more are refused with RESOURCE_EXHAUSTED). So at most `UPDATES_IN_FLIGHT` go out from
        this worker at once; past that (a storm), or when the server refuses one, the request goes by
        signal-with-start instead and returns `queued`: the guard takes all such signals in one workflow
        task and signals every answer together."""
        dom = self._topology.domain(req.node)
        full = replace(req, rack=dom.rack, domains=dom.keys(), policy=self._policy)
        if not self._in_flight.locked():
            async with self._in_flight:
                start: WithStartWorkflowOperation[Any, Any] = WithStartWorkflowOperation(
                    GuardApi.WORKFLOW, GuardInput(cluster=req.cluster, policy=self._policy),
                    id=subjects.fleetguard_workflow_id(req.cluster), task_queue=self._task_queue,
                    id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                    static_summary=f"FleetGuard {req.cluster}: drain budget and breaker")
                try:
                    return await self._client.execute_update_with_start_workflow(
                        GuardApi.DECIDE_PERMIT, full, start_workflow_operation=start, result_type=PermitDecision)
                except RPCError as err:
                    if err.status != RPCStatusCode.RESOURCE_EXHAUSTED:
                        raise
        await self._signal_with_start(req.cluster, GuardApi.REQUEST_PERMIT, full)
        return PermitDecision(granted=False, queued=True, reason="asked by signal (the guard is busy); "
                                                               "its answer follows as a signal")

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
        """Give a permit back (or withdraw a queued request), and its permit pool slot. Idempotent."""
        if self.gate is not None:
            await self.gate.release(rel.cluster, rel.node)
        await self._signal_with_start(rel.cluster, GuardApi.RELEASE, rel)

    @activity.defn(name=Activity.SYNC_PERMIT_POOL)
    async def sync_permit_pool(self, sync: PoolSync) -> PoolSynced:
        """FleetGuard's write to its cluster's permit pool (`fleetmend.infra.permit_pool.PermitPool.publish`):
        budget, rack cap, open/why, closed domains; `held` added when the pool is new; `drop` freed.

        Returns:
            `PoolSynced`: slots held, and the router's holders the guard does not hold.
        Raises:
            PoolBusyError: the key kept changing (retried)."""
        if self.gate is None:
            raise ApplicationError("this worker was built without JetStream, so it cannot reach the permit pool "
                                   "(FleetGuardActivities.from_settings(js=...))", type="NoPermitPool")
        pool = await self.gate.pool()
        state = await pool.publish(sync.cluster, budget=sync.budget, rack_cap=sync.rack_cap, open=sync.open,
                                   why=sync.why, closed_domains=sync.closed_domains, held=sync.held, drop=sync.drop)
        return PoolSynced(holders=len(state.holders),
                          router_only=sorted(n for n, h in state.holders.items()
                                             if h.by == BY_ROUTER and n not in sync.held))
