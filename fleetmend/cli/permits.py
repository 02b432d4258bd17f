"""`fleetmend breaker release NODE`: free a drain permit by hand (FleetGuard's `release_permit` update,
audited with who ran it). Registered by `fleetmend/cli/main.py` (`_EXTENSIONS`); why queued nodes wait
is in `fleetmend.cli.permit_waits`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer


async def _running_incident(client: Any, cluster: str, node: str) -> str | None:
    """`node`'s incident workflow id in `cluster` when it still runs, else None."""
    from temporalio.client import WorkflowExecutionStatus
    from temporalio.service import RPCError

    from fleetmend import subjects

    wid = subjects.workflow_id(cluster, node)
    try:
        desc = await client.get_workflow_handle(wid).describe()
    except RPCError:
        return None  # never opened, or gone with the namespace's retention
    return wid if desc.status == WorkflowExecutionStatus.RUNNING else None


async def _only_queued(client: Any, cluster: str, node: str) -> bool:
    """Whether `node` waits in `cluster`'s FleetGuard queue (a queued node holds no permit). False when the
    guard cannot be read: the caller's refusal then stands as it is."""
    from fleetmend.cli.permit_waits import permit_waits

    try:
        return node in await permit_waits(client, cluster)
    except Exception:  # noqa: BLE001 - unreadable: not known to be only queued
        return False


async def _release(settings: Any, node: str, by: str, note: str, force: bool = False) -> str:
    """Free `node`'s permit. Refused while `node`'s incident still runs (its drain is in force: freeing its
    permit lets one more node drain than the budget allows) unless `force`.

    Raises:
        FleetmendError: the incident still runs (without `force`), the guard refused, or Temporal failed.
    """
    from temporalio.client import WorkflowUpdateFailedError
    from temporalio.service import RPCError

    from fleetmend import subjects
    from fleetmend.infra.connect import connect_temporal
    from fleetmend.errors import FleetmendError
    from fleetmend.messages import GuardApi, PermitReleaseCommand

    client = await connect_temporal(settings)
    running = None if force else await _running_incident(client, settings.cluster, node)
    if running and await _only_queued(client, settings.cluster, node):
        raise FleetmendError(
            f"{node} holds no permit: it is queued for one, and its incident {running} still runs. Withdrawing "
            f"the request only sends {node} to the back of the queue when the incident asks again (every "
            f"policy.permit_rerequest_s). Stop it with `fleetmend abort {node}`, or add --force")
    if running:
        raise FleetmendError(
            f"{node}'s incident {running} still runs and its permit counts its drain; releasing it would let "
            f"one more node drain than the budget allows. End the incident (`fleetmend abort {node} "
            f"[--undrain]`, which frees the permit), or add --force if the permit is wrong anyway")
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
        force: bool = typer.Option(False, "--force", help="Release even while NODE's incident still runs."),
        as_json: bool = m.JsonOpt,
        cluster: Optional[str] = m.ClusterOpt,
        config: Optional[Path] = m.ConfigOpt,
    ) -> None:
        """Free NODE's drain permit by hand (a permit held by an incident that no longer runs): audited with
        who you are. Refused while NODE's incident still runs (--force overrides). FleetGuard also does this
        by itself every `policy.permit_reconcile_s`."""
        s = m._settings(config, cluster=cluster)
        result = m._run(_release(s, node, m._who(), note, force))
        if as_json:
            import json
            import sys

            sys.stdout.write(json.dumps({"command": "release_permit", "node": node, "cluster": s.cluster,
                                         "by": m._who(), "result": result}) + "\n")
            return
        m.out.print(result)
