"""The permit pool's gate on every drain under a permit: `drain_node` takes (or finds) the node's slot
in the cluster's permit pool (`fleetmend.infra.permit_pool`) right before the scheduler adapter's call.

FleetGuard takes the slot when it grants (`sync_permit_pool`), and the router takes it before its own
cordon of a fault that must drain now; so here the slot is normally held already and the claim is one
KV read. When it is not (a human freed it with `fleetmend breaker release` while the grant was on its
way), the claim takes one if the budget and the rack cap leave room; otherwise the activity fails
retryably (`DrainSlotWait`, with the reason) and Temporal retries it until a slot frees: the node is not
cordoned meanwhile, so the budget holds at the last moment before every cordon.

Retries are safe: a slot is held once per node, and the drain is idempotent.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from temporalio import activity
from temporalio.exceptions import ApplicationError

from fleetmend import subjects
from fleetmend.infra.ledger import LedgerStore
from fleetmend.infra.permit_pool import BY_GUARD, BY_ROUTER, PermitPool
from fleetmend.messages import Activity, DrainRequest, DrainResult, UndrainRequest, UndrainResult
from fleetmend.policy import Topology

Drain = Callable[[DrainRequest], Awaitable[DrainResult]]
Undrain = Callable[[UndrainRequest], Awaitable[UndrainResult]]


class PoolGate:
    """The permit pool as the worker's activities see it.

    Args:
        js: JetStream context (the pool's bucket is opened on first use).
        topology: node → rack (the rack cap).
    """

    def __init__(self, js: Any, topology: Topology | None) -> None:
        self._js = js
        self._topology = topology or Topology()
        self._pool: PermitPool | None = None

    async def pool(self) -> PermitPool:
        if self._pool is None:
            self._pool = await PermitPool.open(self._js)
        return self._pool

    async def drained_by_router(self, cluster: str, node: str) -> bool:
        """Whether the router holds `node`'s slot (it cordoned the node before its incident asked)."""
        state = await (await self.pool()).read(cluster)
        holder = state.holders.get(node) if state is not None else None
        return holder is not None and holder.by == BY_ROUTER

    async def claim(self, cluster: str, node: str) -> None:
        """Find or take `node`'s pool slot, right before its drain.

        Raises:
            ApplicationError: type "DrainSlotWait" (retryable) when the pool has no room; Temporal's
                retry tries again until a slot frees.
            PoolBusyError: the key kept changing (retryable)."""
        rack = self._topology.domain(node).rack
        got = await (await self.pool()).claim(cluster, node, rack, by=BY_GUARD)
        if not got.ok:
            raise ApplicationError(
                f"{node}: granted by FleetGuard, but the permit pool of {cluster} has no slot for it ({got.reason}); "
                "not drained, retried until a slot frees", type="DrainSlotWait")
        activity.heartbeat({"phase": "pool_slot", "reason": got.reason})

    async def release(self, cluster: str, node: str) -> bool:
        """Give `node`'s slot back. Returns whether it held one."""
        return await (await self.pool()).release(cluster, node)


    async def router_claim_at(self, cluster: str, node: str) -> float | None:
        """When the router took `node`'s slot (Unix seconds: right before its must-drain-now cordon), or None
        when the router does not hold it."""
        state = await (await self.pool()).read(cluster)
        holder = state.holders.get(node) if state is not None else None
        return holder.at if holder is not None and holder.by == BY_ROUTER and holder.at else None


class PooledDrainActivities:
    """`drain_node` under the permit pool: the node's slot first (`PoolGate.claim`), then the scheduler's
    drain. NodeRemediation runs `drain_node` only under a granted permit.

    With a `ledger` (`fleetmend.infra.ledger.LedgerStore`), the drain opens the incident's ledger record and
    `undrain_node` (the scheduler's, wrapped) records the return; a ledger write never fails either."""

    def __init__(self, drain: Drain, gate: PoolGate, *, undrain: Undrain | None = None,
                 ledger: LedgerStore | None = None) -> None:
        self._drain = drain
        self._undrain = undrain
        self._gate = gate
        self._ledger = ledger

    @activity.defn(name=Activity.DRAIN_NODE)
    async def drain_node(self, req: DrainRequest) -> DrainResult:
        """Raises: what `SchedulerActivities.drain_node` raises, and "DrainSlotWait"."""
        await self._gate.claim(req.cluster, req.node)
        res = await self._drain(req)
        if self._ledger is not None and res.drained and not res.operator_drained:
            try:
                claimed = await self._gate.router_claim_at(req.cluster, req.node)
            except Exception:  # noqa: BLE001 - the pool read only dates a router's cordon: the drain counts from now
                claimed = None
            res.repeat_part = await self._ledger.drained(
                cluster=req.cluster, node=req.node, incident_id=req.incident_id,
                workflow_id=activity.info().workflow_id or subjects.workflow_id(req.cluster, req.node),
                observed_at=req.observed_at, reason=req.reason,
                drained=res.drained, state=res.state, router_claim_at=claimed)
        return res

    @activity.defn(name=Activity.UNDRAIN_NODE)
    async def undrain_node(self, req: UndrainRequest) -> UndrainResult:
        """The scheduler's `undrain_node`, then the ledger's return (versions and serials at the return).

        Raises: what `SchedulerActivities.undrain_node` raises."""
        assert self._undrain is not None, "PooledDrainActivities(undrain=...) to register undrain_node"
        res = await self._undrain(req)
        if self._ledger is not None:
            await self._ledger.returned(cluster=req.cluster, node=req.node, incident_id=req.incident_id,
                                        resumed=res.resumed)
        return res
