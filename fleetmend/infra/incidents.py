"""Signal-with-start of the two workflows, made from several places: a node's incident (`NodeRemediation`)
with its faults (the router; FleetGuard's reconciliation for a drain whose incident never started), and a
cluster's FleetGuard (incidents' permit requests and releases, the router's forwards, a worker's policy).

Both run on their cluster's own task queue, `subjects.cluster_task_queue(<queue>, cluster)`, derived here from
the deployment's queue the caller passes: only a worker of that cluster polls it (`fleetmend.worker`), so an
incident is drained by its own cluster's scheduler adapter, and a cluster no worker serves holds no permit
(its FleetGuard does not run either)."""

from __future__ import annotations

from typing import Any

from temporalio.common import SearchAttributePair, TypedSearchAttributes

from fleetmend import subjects
from fleetmend.infra.lease import unserved_reason
from fleetmend.messages import (
    KEY_CLUSTER,
    KEY_NODE,
    KEY_PHASE,
    FaultBatch,
    GuardApi,
    GuardInput,
    GuardPolicy,
    IncidentInput,
    Phase,
    RemediationApi,
)


async def start_incident(client: Any, task_queue: str, inp: IncidentInput, batch: FaultBatch,
                         phase: Phase = Phase.TRIAGE, unserved: bool = False) -> None:
    """Signal-with-start `inp`'s node's incident (`subjects.workflow_id`) with `batch` on its cluster's queue,
    `subjects.cluster_task_queue(task_queue, inp.cluster)` (`task_queue`: `Settings.task_queue`).

    `phase`: the incident's `FleetPhase` search attribute if this call starts it (`awaiting_permit` for a
    node queued for its permit, so `fleetmend status` shows it before the incident's first workflow task);
    an incident already running keeps its own and takes `batch` as a `faults` signal. `unserved`: no worker
    of `inp.cluster` was alive when it was started (`fleetmend.infra.lease.presence`); its summary in the
    Temporal UI says so and how to serve it (`lease.unserved_reason`).

    Raises:
        what `temporalio.client.Client.start_workflow` raises (RPCError: Temporal away or refusing)."""
    await client.start_workflow(
        RemediationApi.WORKFLOW, inp, id=subjects.workflow_id(inp.cluster, inp.node),
        task_queue=subjects.cluster_task_queue(task_queue, inp.cluster),
        start_signal=RemediationApi.FAULTS, start_signal_args=[batch],
        search_attributes=TypedSearchAttributes([
            SearchAttributePair(KEY_NODE, inp.node), SearchAttributePair(KEY_CLUSTER, inp.cluster),
            SearchAttributePair(KEY_PHASE, phase.value)]),
        static_summary=f"{inp.node} ({inp.cluster}): remediation incident"
        + (f"; when it opened, {unserved_reason(inp.cluster)}" if unserved else ""))


async def signal_guard(client: Any, cluster: str, task_queue: str, policy: GuardPolicy, signal: str,
                       arg: Any) -> None:
    """Signal-with-start `cluster`'s FleetGuard (`subjects.fleetguard_workflow_id`) on its cluster's guard queue,
    `subjects.cluster_task_queue(task_queue, cluster)` (`task_queue`: the deployment's guard queue,
    `messages.guard_task_queue(Settings.task_queue)`), with `signal` and its one argument; a guard that does
    not run yet is started with `policy`. Raises what `temporalio.client.Client.start_workflow` raises."""
    await client.start_workflow(
        GuardApi.WORKFLOW, GuardInput(cluster=cluster, policy=policy), id=subjects.fleetguard_workflow_id(cluster),
        task_queue=subjects.cluster_task_queue(task_queue, cluster), start_signal=signal, start_signal_args=[arg],
        static_summary=f"FleetGuard {cluster}: drain budget and breaker")


__all__ = ["signal_guard", "start_incident"]
