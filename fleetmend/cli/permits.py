"""Drain permits as an operator sees them: why a queued node waits, and `fleetmend breaker release NODE`.

`permit_waits` reads the cluster's FleetGuard (`status` query): node → the reason its drain permit
waits (budget, rack cap, breaker, pause), shown by `fleetmend status` (`annotate_waits`) and used by
the quarantine bench. Registered by `fleetmend/cli/main.py` (`_EXTENSIONS`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer


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


async def _release(settings: Any, node: str, by: str, note: str) -> str:
    from temporalio.client import WorkflowUpdateFailedError
    from temporalio.service import RPCError

    from fleetmend import subjects
    from fleetmend.connect import connect_temporal
    from fleetmend.errors import FleetmendError
    from fleetmend.messages import GuardApi, PermitReleaseCommand

    client = await connect_temporal(settings)
    handle = client.get_workflow_handle(subjects.fleetguard_workflow_id(settings.cluster))
    try:
        return await handle.execute_update(GuardApi.RELEASE_PERMIT, PermitReleaseCommand(by=by, node=node, note=note),
                                           result_type=str)
    except WorkflowUpdateFailedError as e:
        raise FleetmendError(f"FleetGuard {settings.cluster}: {e.cause.message if e.cause else e}") from e
    except RPCError as e:
        if "not found" in str(e).lower() or "already completed" in str(e).lower():
            raise FleetmendError(f"no running FleetGuard for cluster {settings.cluster}: no permit is held") from e
        raise FleetmendError(f"FleetGuard {settings.cluster}: {e}; is `fleetmend worker` running?") from e


def register(app: Any) -> None:
    """`fleetmend breaker release NODE` (added to the `breaker` group that `fleetmend.cli.policy` registers)."""
    from fleetmend.cli import main as m

    breaker = next(g.typer_instance for g in app.registered_groups if g.name == "breaker")

    @breaker.command("release")
    def breaker_release(
        node: str = typer.Argument(..., help="The node whose drain permit (or queued request) to free."),
        note: str = typer.Option("", "--note", help="Why (kept in the guard's audit log)."),
        cluster: Optional[str] = m.ClusterOpt,
        config: Optional[Path] = m.ConfigOpt,
    ) -> None:
        """Free NODE's drain permit by hand (a permit held by an incident that no longer runs): audited with
        who you are. FleetGuard also does this by itself every `policy.permit_reconcile_s`."""
        s = m._settings(config, cluster=cluster)
        m.out.print(m._run(_release(s, node, m._who(), note)))
