"""`drain_with_permit`: the drain permit and, on a grant, the drain itself, in one activity; and the
permit pool's gate on every drain under a permit (`policy.fast_drain`).

A drain used to cost the incident two round trips through Temporal before the node was cordoned:
the `decide_drain_permit` activity, a workflow task to read its result, then the `drain_node`
activity. Under a storm those extra tasks queue behind every other incident's. Here the grant is
followed at once by the idempotent drain, in the same activity; the guard stays the one place that
decides (budget, rack cap, breaker, pause, observe-only, lemons, queue order). A queued or denied
request drains nothing and comes back as before (the grant of a queued one follows as a `permit`
signal; the incident then runs `drain_node`).

With `policy.fast_drain` (`fleetmend.infra.permit_pool`) the budget itself lives in the cluster's permit pool,
shared with the router's fast path, and `PoolGate` enforces it at the last moment before a cordon:
- a node the router already drained under a pool slot asks the guard with `preclaimed` (adopted), and
  every request carries the router's holders as the pool has them (`pool_router`), so the guard counts
  the router's drains it has not adopted yet;
- a grant takes the node's pool slot right before the drain. When the pool has no room (router drains
  the guard had not counted yet), the activity fails retryably (`DrainSlotWait`, with the reason) and
  Temporal retries it until a slot frees: the node is not cordoned meanwhile, so the budget holds.

Retries are safe: the guard grants a node that already holds its permit again, a pool slot is held
once per node, and the drain is idempotent. A failed drain after the grant fails the activity as
`drain_node` would (the permit stays held, as it did when `drain_node` failed after a separate grant).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Awaitable, Callable

from temporalio import activity
from temporalio.exceptions import ApplicationError

from fleetmend.infra.permit_pool import BY_GUARD, BY_ROUTER, PermitPool
from fleetmend.messages import (
    Activity,
    DrainRequest,
    DrainResult,
    PermitDecision,
    PermitDrainRequest,
    PermitDrainResult,
    PermitRequest,
)
from fleetmend.policy import Topology

Decide = Callable[[PermitRequest], Awaitable[PermitDecision]]
Drain = Callable[[DrainRequest], Awaitable[DrainResult]]


class PoolGate:
    """The permit pool as the worker's drain activities see it.

    Args:
        js: JetStream context (the pool's bucket is opened on first use).
        topology: node → rack (the rack cap).
        enabled: `policy.fast_drain`; False makes every method a no-op (no pool is read or written).
    """

    def __init__(self, js: Any, topology: Topology | None, enabled: bool) -> None:
        self._js = js
        self._topology = topology or Topology()
        self.enabled = enabled
        self._pool: PermitPool | None = None

    async def pool(self) -> PermitPool:
        if self._pool is None:
            self._pool = await PermitPool.open(self._js)
        return self._pool

    async def router_view(self, cluster: str, node: str) -> tuple[bool, dict[str, str | None] | None]:
        """(whether the router drained `node` under a pool slot: its incident then asks `preclaimed`;
        the router's holders, node → rack, at most `MAX_ROUTER_VIEW`), or (False, None) without a pool."""
        if not self.enabled:
            return False, None
        state = await (await self.pool()).read(cluster)
        if state is None:
            return False, None
        holder = state.holders.get(node)
        return holder is not None and holder.by == BY_ROUTER, state.router_holders(but=node)

    async def claim(self, cluster: str, node: str) -> None:
        """Take `node`'s pool slot for a FleetGuard grant, right before its drain.

        Raises:
            ApplicationError: type "DrainSlotWait" (retryable) when the pool has no room; Temporal's
                retry tries again until a slot frees.
            PoolBusyError: the key kept changing (retryable)."""
        if not self.enabled:
            return
        rack = self._topology.domain(node).rack
        got = await (await self.pool()).claim(cluster, node, rack, by=BY_GUARD)
        if not got.ok:
            raise ApplicationError(
                f"{node}: granted by FleetGuard, but the permit pool of {cluster} has no slot ({got.reason}; router "
                "drains the guard has not counted yet); not drained, retried until a slot frees", type="DrainSlotWait")
        activity.heartbeat({"phase": "pool_slot", "reason": got.reason})

    async def release(self, cluster: str, node: str) -> None:
        if self.enabled:
            await (await self.pool()).release(cluster, node)


class DrainWithPermitActivities:
    """Args: decide (`FleetGuardActivities.decide_drain_permit`), drain (`SchedulerActivities.drain_node`):
    the two activities it chains, called in this activity's context (their heartbeats are its own);
    gate: the permit pool (`PoolGate`; None or disabled: no pool)."""

    def __init__(self, decide: Decide, drain: Drain, gate: PoolGate | None = None) -> None:
        self._decide = decide
        self._drain = drain
        self._gate = gate

    @activity.defn(name=Activity.DRAIN_WITH_PERMIT)
    async def drain_with_permit(self, req: PermitDrainRequest) -> PermitDrainResult:
        """The guard's decision on `req.permit`; when granted, also the `DrainResult` of `req.drain`.

        Raises what `drain_node` raises (ApplicationError "NodeNotFound", non-retryable; a scheduler
        error, retried), what `decide_drain_permit` raises, and "DrainSlotWait" (`PoolGate.claim`)."""
        permit = req.permit
        gate = self._gate
        if gate is not None:
            preclaimed, router = await gate.router_view(permit.cluster, permit.node)
            permit = replace(permit, preclaimed=preclaimed, pool_router=router)
        decision = await self._decide(permit)
        if not decision.granted:
            return PermitDrainResult(decision=decision)
        activity.heartbeat({"phase": "permit_granted"})
        if gate is not None:
            await gate.claim(permit.cluster, permit.node)
        return PermitDrainResult(decision=decision, drain=await self._drain(req.drain))


class PooledDrainActivities:
    """`drain_node` for a worker with the permit pool: the node's pool slot first (`PoolGate.claim`),
    then the scheduler's drain. NodeRemediation runs `drain_node` only under a granted permit."""

    def __init__(self, drain: Drain, gate: PoolGate) -> None:
        self._drain = drain
        self._gate = gate

    @activity.defn(name=Activity.DRAIN_NODE)
    async def drain_node(self, req: DrainRequest) -> DrainResult:
        """Raises: what `SchedulerActivities.drain_node` raises, and "DrainSlotWait"."""
        await self._gate.claim(req.cluster, req.node)
        return await self._drain(req)
