"""The scheduler plug-in interface (`SchedulerAdapter`), its factory and its Temporal activities.

Every adapter is idempotent and keeps **ownership**: fleetmend only ever returns to service (Slurm
`State=RESUME`, KV entry removal) a drain that it set itself. A drain an operator set first is
remembered (`operator_drained=True`) and left alone, before and after the incident.

Adapters, one module each: `SlurmScheduler` (activities/slurm.py), `StandaloneScheduler` and
`NoopScheduler` (activities/standalone.py), `KubernetesScheduler` (activities/kubernetes.py).
Their requests and results (`DrainResult`, `UndrainResult`, `NodeInfo`) are in `fleetmend.messages`.

`SchedulerActivities(scheduler)` exposes `drain_node` and `undrain_node` for the worker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from temporalio import activity
from temporalio.exceptions import ApplicationError

from fleetmend.config import SchedulerKind, Settings
from fleetmend.errors import ConfigError, NodeNotFoundError
from fleetmend.infra import metrics
from fleetmend.messages import Activity, DrainRequest, DrainResult, NodeInfo, UndrainRequest, UndrainResult

if TYPE_CHECKING:
    from nats.js import JetStreamContext


NodeEventRecorder = Callable[..., Awaitable[bool]]
"""`NodeEvents.record_event` as a callback: `(node, step, message, *, key, warning=False) -> recorded`."""


@runtime_checkable
class NodeEvents(Protocol):
    """A scheduler that also records each remediation step on the node itself (Kubernetes: core/v1
    Events on the Node); the diagnostics and ticket activities call it when the adapter offers it."""

    async def record_event(self, node: str, step: str, message: str, *, key: str, warning: bool = False) -> bool: ...


@runtime_checkable
class SchedulerAdapter(Protocol):
    """What every scheduler adapter offers; the activities, `fleetmend nodes` and `status` call these."""

    name: str

    async def drain(self, node: str, reason: str, incident_id: str) -> DrainResult: ...

    async def undrain(self, node: str, incident_id: str) -> UndrainResult: ...

    async def state(self, node: str) -> str: ...

    async def list_nodes(self) -> list[NodeInfo]: ...


def build_scheduler(settings: Settings, js: JetStreamContext | None = None) -> SchedulerAdapter:
    """The adapter for `settings.scheduler`.

    Args:
        settings: process settings.
        js: JetStream context, required for `standalone`.
    Returns:
        `SlurmScheduler`, `StandaloneScheduler`, `KubernetesScheduler` or `NoopScheduler`.
    Raises:
        ConfigError: standalone without `js`, kubernetes without an API server configuration, or an
            unknown kind.
    """
    # Each adapter is imported when chosen: the router and the CLI build one, and the Kubernetes client
    # alone costs ~0.4 s and ~35 MiB (measured here) in a process that runs Slurm.
    kind = settings.scheduler
    if kind == SchedulerKind.SLURM:
        from activities.slurm import SlurmScheduler

        return SlurmScheduler(settings.slurm)
    if kind == SchedulerKind.STANDALONE:
        if js is None:
            raise ConfigError("scheduler standalone keeps its drained set in JetStream; pass js= (a JetStream context)")
        from activities.standalone import StandaloneScheduler

        return StandaloneScheduler(js, cluster=settings.cluster)
    if kind == SchedulerKind.NONE:
        from activities.standalone import NoopScheduler

        return NoopScheduler()
    if kind == SchedulerKind.KUBERNETES:
        from activities.kubernetes import KubernetesScheduler

        return KubernetesScheduler(settings.kubernetes)
    raise ConfigError(f"unknown scheduler {kind!r}; expected slurm, standalone, kubernetes, none")


# --------------------------------------------------------------------------------------------------
# Activities

_POLL_S = 1.0
"""Poll interval while waiting for DRAINING → DRAINED; slurmctld updates node state at once."""


class SchedulerActivities:
    """`drain_node` / `undrain_node` for the worker, bound to one adapter.

    Args:
        scheduler: any `SchedulerAdapter`.
        cluster: the cluster the adapter's nodes belong to; requests of other clusters are refused.
            None accepts any (tests of one cluster).
    """

    def __init__(self, scheduler: SchedulerAdapter, cluster: str | None = None) -> None:
        self.scheduler = scheduler
        self.cluster = cluster

    def _check_cluster(self, req: DrainRequest | UndrainRequest) -> None:
        """An adapter acts on one cluster's nodes: a request of another cluster (workers of two clusters
        polling one task queue) is refused, retryably, so Temporal hands it to another worker."""
        if self.cluster is not None and req.cluster != self.cluster:
            raise ApplicationError(
                f"this worker drains cluster {self.cluster!r}, not {req.cluster!r} (node {req.node}); give each "
                "cluster its own task_queue", type="WrongCluster")

    @activity.defn(name=Activity.DRAIN_NODE)
    async def drain_node(self, req: DrainRequest) -> DrainResult:
        """Drain `req.node` (idempotent). With `req.wait_drained_s` > 0, heartbeat until it is drained.

        Raises:
            ApplicationError: type "NodeNotFound", non-retryable, for a node the scheduler doesn't know.
            SchedulerError: transient failure (Temporal retries).
        """
        log = activity.logger
        self._check_cluster(req)
        try:
            result = await self.scheduler.drain(req.node, req.reason, req.incident_id)
            activity.heartbeat({"phase": "drain_set", "state": result.state})
            deadline = time.monotonic() + req.wait_drained_s
            while result.owned and result.state.startswith("draining") and time.monotonic() < deadline:
                await asyncio.sleep(_POLL_S)
                result.state = await self.scheduler.state(req.node)
                activity.heartbeat({"phase": "waiting_for_jobs", "state": result.state})
        except NodeNotFoundError as err:
            raise ApplicationError(str(err), type="NodeNotFound", non_retryable=True) from err
        metrics.drain_result(req.cluster, self.scheduler.name, result, req.observed_at)
        log.info("drain_requested node=%s scheduler=%s drained=%s owned=%s operator_drained=%s state=%s: %s",
                 req.node, self.scheduler.name, result.drained, result.owned, result.operator_drained,
                 result.state, result.detail)
        return result

    @activity.defn(name=Activity.UNDRAIN_NODE)
    async def undrain_node(self, req: UndrainRequest) -> UndrainResult:
        """RESUME `req.node` if fleetmend owns its drain (idempotent; never an operator's drain).

        Raises:
            ApplicationError: type "NodeNotFound", non-retryable.
            SchedulerError: transient failure (Temporal retries).
        """
        self._check_cluster(req)
        try:
            result = await self.scheduler.undrain(req.node, req.incident_id)
        except NodeNotFoundError as err:
            raise ApplicationError(str(err), type="NodeNotFound", non_retryable=True) from err
        metrics.undrain_result(req.cluster, self.scheduler.name, result, req.drained_at)
        activity.heartbeat({"phase": "undrain_done", "state": result.state})
        activity.logger.info("undrain_requested node=%s scheduler=%s resumed=%s state=%s: %s",
                             req.node, self.scheduler.name, result.resumed, result.state, result.detail)
        return result
