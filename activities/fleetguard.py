"""Drain permits: NodeRemediation → FleetGuard by signal-with-start (the guard starts on first use).

A workflow cannot signal-with-start another workflow, so this activity does it with the worker's
client. The worker loads the topology file once and attaches each node's failure domains to its
request; the file itself never enters workflow history (bounded payloads for big clusters).
"""

from __future__ import annotations

from dataclasses import replace

from temporalio import activity

from fleetmend import subjects
from fleetmend.policy import Topology, load_topology
from fleetmend.messages import Activity, GuardApi, GuardInput, GuardPolicy, PermitRelease, PermitRequest


def guard_policy(settings, topology: Topology | None = None) -> GuardPolicy:  # noqa: ANN001 - Settings
    """`GuardPolicy` from `Settings.policy` and the topology's node count."""
    return GuardPolicy.from_settings(settings.policy, len(topology) if topology is not None else 0)


class FleetGuardActivities:
    """Args: client (temporalio Client), task_queue the guard runs on, policy (`GuardPolicy`),
    topology (`Topology`, node → rack/leaf/PDU)."""

    def __init__(self, client, task_queue: str, policy: GuardPolicy,  # noqa: ANN001 - temporal Client
                 topology: Topology | None = None) -> None:
        self._client = client
        self._task_queue = task_queue
        self._policy = policy
        self._topology = topology or Topology()

    @classmethod
    def from_settings(cls, client, settings, task_queue: str | None = None) -> "FleetGuardActivities":  # noqa: ANN001
        topo = load_topology(settings.policy.topology_file)
        return cls(client, task_queue or settings.task_queue, guard_policy(settings, topo), topo)

    async def _signal_with_start(self, cluster: str, signal: str, arg) -> None:  # noqa: ANN001
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

    @activity.defn(name=Activity.RELEASE_DRAIN_PERMIT)
    async def release_drain_permit(self, rel: PermitRelease) -> None:
        """Give a permit back (or withdraw a queued request). Idempotent."""
        await self._signal_with_start(rel.cluster, GuardApi.RELEASE, rel)
