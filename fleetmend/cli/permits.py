"""Drain permits as an operator sees them: why a queued node waits.

`permit_waits` reads the cluster's FleetGuard (`status` query): node → the reason its drain permit
waits (budget, rack cap, breaker, pause), for `fleetmend status` and the quarantine bench.
"""

from __future__ import annotations

from typing import Any


async def permit_waits(client: Any, cluster: str) -> dict[str, str]:
    """node → why its permit request is queued, for every queued node of `cluster`'s FleetGuard.

    Args:
        client: a connected `temporalio.client.Client` (the project's data converter).
        cluster: the cluster name.
    Returns:
        {} when the guard does not exist yet (no permit was ever requested).
    Raises:
        temporalio.service.RPCError: Temporal unreachable or the query failed for another reason.
    """
    from temporalio.service import RPCError

    from fleetmend import subjects

    handle = client.get_workflow_handle(subjects.fleetguard_workflow_id(cluster))
    try:
        st = await handle.query("status")
    except RPCError as e:
        if "not found" in str(e).lower():
            return {}
        raise
    queue = st["queue"] if isinstance(st, dict) else st.queue
    return {q["node"]: q.get("waiting") or "" for q in queue}
