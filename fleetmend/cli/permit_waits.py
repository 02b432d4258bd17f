"""Why a queued node waits for its drain permit, as `fleetmend status` shows it.

`permit_waits` reads the cluster's FleetGuard (`status` query): node → the reason its drain permit
waits (budget, rack cap, breaker, pause); `annotate_waits` adds it to `fleetmend status` rows. Imports
nothing else of the CLI (`fleetmend.cli.main` uses it).
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


async def annotate_waits(client: Any, cluster: str, rows: list[dict[str, Any]]) -> None:
    """Add `waiting` (why its permit waits) to each running `awaiting_permit` row of `fleetmend status`.
    A node the guard does not know says so (its incident asks again every `policy.permit_rerequest_s`)."""
    try:
        waits = await permit_waits(client, cluster)
    except Exception as err:  # noqa: BLE001 - the table still shows without the reasons
        waits, missing = {}, f"FleetGuard unreadable: {err}"
    else:
        missing = "not queued at FleetGuard yet (the incident asks again)"
    for r in rows:
        if r["phase"] == "awaiting_permit" and r["status"] == "running":
            r["waiting"] = waits.get(r["node"]) or missing
