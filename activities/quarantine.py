"""`drain_with_permit`: the drain permit and, on a grant, the drain itself, in one activity.

A drain used to cost the incident two round trips through Temporal before the node was cordoned:
the `decide_drain_permit` activity, a workflow task to read its result, then the `drain_node`
activity. Under a storm those extra tasks queue behind every other incident's. Here the grant is
followed at once by the idempotent drain, in the same activity; the guard stays the one place that
decides (budget, rack cap, breaker, pause, observe-only, lemons, queue order). A queued or denied
request drains nothing and comes back as before (the grant of a queued one follows as a `permit`
signal; the incident then runs `drain_node`).

Retries are safe: the guard grants a node that already holds its permit again, and the drain is
idempotent. A failed drain after the grant fails the activity as `drain_node` would (the permit
stays held, as it did when `drain_node` failed after a separate grant).
"""

from __future__ import annotations

from typing import Awaitable, Callable

from temporalio import activity

from fleetmend.messages import (
    Activity, DrainRequest, DrainResult, PermitDecision, PermitDrainRequest, PermitDrainResult, PermitRequest,
)

Decide = Callable[[PermitRequest], Awaitable[PermitDecision]]
Drain = Callable[[DrainRequest], Awaitable[DrainResult]]


class DrainWithPermitActivities:
    """Args: decide (`FleetGuardActivities.decide_drain_permit`), drain (`SchedulerActivities.drain_node`):
    the two activities it chains, called in this activity's context (their heartbeats are its own)."""

    def __init__(self, decide: Decide, drain: Drain) -> None:
        self._decide = decide
        self._drain = drain

    @activity.defn(name=Activity.DRAIN_WITH_PERMIT)
    async def drain_with_permit(self, req: PermitDrainRequest) -> PermitDrainResult:
        """The guard's decision on `req.permit`; when granted, also the `DrainResult` of `req.drain`.

        Raises what `drain_node` raises (ApplicationError "NodeNotFound", non-retryable; a scheduler
        error, retried) and what `decide_drain_permit` raises."""
        decision = await self._decide(req.permit)
        if not decision.granted:
            return PermitDrainResult(decision=decision)
        activity.heartbeat({"phase": "permit_granted"})
        return PermitDrainResult(decision=decision, drain=await self._drain(req.drain))
