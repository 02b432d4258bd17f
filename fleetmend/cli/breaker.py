"""The cluster's FleetGuard (`fleetguard/<cluster>`): `fleetmend breaker status | reset | release NODE` and
the global `fleetmend pause | resume`; why a queued node waits for its drain permit (`permit_waits`, which
`fleetmend status` shows).

Every command is a `GuardApi` query or update; the updates carry who sent them for the guard's audit log.
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import asdict
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from fleetmend import subjects
from fleetmend.cli.common import (
    ClusterOpt,
    ConfigOpt,
    JsonOpt,
    free_text,
    node_name,
    out,
    refusal,
    run,
    scheduler_adapter,
    settings,
    who,
)
from fleetmend.config import Settings
from fleetmend.errors import FleetmendError
from fleetmend.infra.connect import close_nats, connect_nats, connect_temporal
from fleetmend.policy import load_topology

app = typer.Typer(no_args_is_help=True, help="The cluster's drain breaker (FleetGuard).")
"""`fleetmend breaker ...`."""
commands = typer.Typer()
"""`fleetmend pause` and `fleetmend resume` (top-level: added to the root app without a group name)."""


# temporalio and fleetmend.messages (GuardApi) are imported inside the functions and commands that talk to
# Temporal: `fleetmend --help` need not load them (see fleetmend.cli.common).

# ------------------------------------------------------------------ talking to FleetGuard

GUARD_QUERY_TIMEOUT_S = 3.0
"""How long `status` waits for a cluster's FleetGuard to answer its query (a guard's worker answers in
milliseconds; a query to a guard no worker polls waits for one until the RPC deadline)."""


async def permit_waits(client: Any, cluster: str) -> dict[str, str]:
    """node → why its permit request is queued, for every queued node of `cluster`'s FleetGuard.

    Args:
        client: a connected `temporalio.client.Client` (the project's data converter).
        cluster: the cluster name.
    Returns:
        {} when the guard does not exist yet (no permit was ever requested).
    Raises:
        temporalio.service.RPCError: Temporal unreachable or the query failed for another reason.
        FleetmendError: the guard did not answer within `GUARD_QUERY_TIMEOUT_S` (no worker of `cluster` polls
            its queue: a query waits for one, and `status` must not wait on every dead cluster in turn).
    """
    from temporalio.service import RPCError, RPCStatusCode

    from fleetmend.messages import GuardApi

    handle = client.get_workflow_handle(subjects.fleetguard_workflow_id(cluster))
    try:
        st = await handle.query(GuardApi.STATUS, rpc_timeout=timedelta(seconds=GUARD_QUERY_TIMEOUT_S))
    except RPCError as e:
        if "not found" in str(e).lower():
            return {}
        if e.status in (RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.CANCELLED):
            raise FleetmendError(f"FleetGuard of cluster {cluster} did not answer within {GUARD_QUERY_TIMEOUT_S:g} s "
                                 f"(is a worker of cluster {cluster} running?)") from None
        raise
    queue = st["queue"] if isinstance(st, dict) else st.queue
    return {q["node"]: q.get("waiting") or "" for q in queue}


async def annotate_waits(client: Any, cluster: str, rows: list[dict[str, Any]], settings: Settings | None = None) -> None:
    """Add `waiting` (why its permit waits) to each running `awaiting_permit` row of `fleetmend status`:
    FleetGuard's reason for the nodes it has queued; for the others (in a burst the router starts
    incidents faster than the guard takes them up), the permit pool's own state when `settings` let it
    be read (full, closed, or the node holding a slot already). A node neither knows says so (its
    incident asks again)."""
    try:
        waits = await permit_waits(client, cluster)
    except Exception as e:  # noqa: BLE001 - the table still shows without the reasons
        waits, missing = {}, f"FleetGuard unreadable: {e}"
    else:
        missing = "not queued at FleetGuard yet (the incident asks again)"
    waiting = [r for r in rows if r["phase"] == "awaiting_permit" and r["status"] == "running"]
    pool = None
    if settings is not None and any(waits.get(r["node"], NEXT) == NEXT for r in waiting):
        try:
            pool = await _pool_status(settings.model_copy(update={"cluster": cluster}))
        except Exception:  # noqa: BLE001 - NATS away: the guard's reasons only
            pool = None
    for r in waiting:
        guard = waits.get(r["node"])
        # "next in the queue" is the guard's view as of its last pool write; the pool says whether it is full now
        r["waiting"] = (guard if guard and guard != NEXT else None) or _pool_reason(pool, r["node"]) or guard or missing


NEXT = "next in the queue"
"""FleetGuard's reason for a queued node when its last pool write left room (`FleetGuard._waiting`)."""


def _pool_reason(pool: dict[str, Any] | None, node: str) -> str | None:
    """Why `node` waits, from the permit pool alone (the budget's owner), or None when it does not say."""
    if pool is None:
        return None
    held = len(pool["holders"])
    if node in pool["holders"]:
        return "holds a permit pool slot: its drain follows"
    if not pool["open"]:
        return f"permit pool closed: {pool['why']}"
    if held >= pool["budget"]:
        return (f"budget: {held}/{pool['budget']} permits held (permit pool; the router queued it, FleetGuard "
                "takes it up next)")
    return None


async def _guard_handle(settings: Settings, *, start: bool) -> Any:
    """The cluster's FleetGuard handle; `start`: start the guard first when it does not exist yet."""
    from fleetmend.infra.incidents import signal_guard
    from fleetmend.messages import GuardApi, GuardPolicy, guard_task_queue

    client = await connect_temporal(settings)
    wid = subjects.fleetguard_workflow_id(settings.cluster)
    if start:  # the guard may not exist yet (no permit requested so far): start it, on its cluster's queue
        policy = GuardPolicy.from_settings(settings.policy, len(load_topology(settings.policy.topology_file)))
        await signal_guard(client, settings.cluster, guard_task_queue(settings.task_queue), policy,
                           GuardApi.REQUEST_PERMITS, [])
    return client.get_workflow_handle(wid)


GUARD_UPDATE_TIMEOUT_S = 15.0
"""How long `pause`, `resume` and `breaker reset` wait for the cluster's FleetGuard to take their update (its
worker answers in milliseconds; an update nobody processes would otherwise wait without end)."""


async def require_worker(settings: Settings) -> None:
    """Refuse at once when no live worker serves `settings.cluster` (the presence keys of
    `fleetmend.infra.lease.presence`): a FleetGuard update or query for it would wait for nobody (a mistyped
    cluster name). Unknown (NATS away, no permission, no answer): the command goes on, bounded by its timeout.

    Raises:
        FleetmendError: no worker serves the cluster, naming the clusters that are served.
    """
    from fleetmend.infra.lease import presence, served_clusters

    try:
        nc = await connect_nats(settings, name="fleetmend-cli")
    except Exception:  # noqa: BLE001 - NATS away: not known, the bounded wait decides
        return
    try:
        rows = await presence(nc.jetstream(), "worker", timeout_s=3.0)
    except Exception:  # noqa: BLE001 - no permission or no answer: not known
        return
    finally:
        await close_nats(nc)
    served = served_clusters(rows)
    if settings.cluster in served:
        return
    others = ", ".join(sorted(served)) or "none"
    raise FleetmendError(f"no worker serves cluster {settings.cluster} (workers are running for: {others}); start "
                         f"`fleetmend worker --cluster {settings.cluster}`, or check the name")


async def _guard_status(settings: Settings) -> dict[str, Any]:
    from temporalio.service import RPCError, RPCStatusCode

    from fleetmend.messages import GuardApi, GuardStatus

    await require_worker(settings)
    handle = await _guard_handle(settings, start=False)
    try:
        st = await handle.query(GuardApi.STATUS, result_type=GuardStatus,
                                rpc_timeout=timedelta(seconds=GUARD_QUERY_TIMEOUT_S))
    except RPCError as e:
        if "not found" in str(e).lower():
            raise FleetmendError(f"no FleetGuard for cluster {settings.cluster} yet: no drain permit has been "
                                 "requested (it starts with the first drain-worthy fault, or `fleetmend pause`)") from e
        if e.status in (RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.CANCELLED):
            raise FleetmendError(f"FleetGuard of cluster {settings.cluster} did not answer within "
                                 f"{GUARD_QUERY_TIMEOUT_S:g} s; is a worker of cluster {settings.cluster} "
                                 "running?") from None
        raise FleetmendError(f"could not read FleetGuard of {settings.cluster}: {e}; is `fleetmend worker` running?") \
            from e
    return dict(st.__dict__)


async def _guard_update(settings: Settings, update: str, by: str, note: str) -> str:
    """Send the `GuardApi` update `update` (RESET_BREAKER, PAUSE, RESUME). Returns the guard's answer."""
    from temporalio.client import WorkflowUpdateFailedError, WorkflowUpdateRPCTimeoutOrCancelledError
    from temporalio.service import RPCError

    from fleetmend.messages import GuardCommand

    await require_worker(settings)  # before the guard is started: a typo'd cluster gets no guard nobody serves
    handle = await _guard_handle(settings, start=True)
    try:
        return await asyncio.wait_for(
            handle.execute_update(update, GuardCommand(by=by, note=note), result_type=str,
                                  rpc_timeout=timedelta(seconds=GUARD_UPDATE_TIMEOUT_S)),
            timeout=GUARD_UPDATE_TIMEOUT_S + 1)
    except (TimeoutError, asyncio.TimeoutError, WorkflowUpdateRPCTimeoutOrCancelledError):
        raise FleetmendError(f"FleetGuard of cluster {settings.cluster} did not take the update within "
                             f"{GUARD_UPDATE_TIMEOUT_S:g} s; is a worker of cluster {settings.cluster} running? "
                             "(it applies the update when one starts)") from None
    except WorkflowUpdateFailedError as e:
        raise FleetmendError(f"FleetGuard {settings.cluster}: {refusal(e)}") from e
    except RPCError as e:
        raise FleetmendError(f"FleetGuard {settings.cluster}: {e}; is `fleetmend worker` running?") from e


async def _pool_status(s: Settings) -> dict[str, Any] | None:
    """The cluster's permit pool as stored (`fleetmend.infra.permit_pool`), or None before FleetGuard wrote it."""
    from fleetmend.infra.permit_pool import PermitPool  # lazy: nats

    nc = await connect_nats(s, name="fleetmend-cli")
    try:
        st = await (await PermitPool.open(nc.jetstream())).read(s.cluster)
    finally:
        await close_nats(nc)
    return asdict(st) if st is not None else None


async def _running_incident(client: Any, cluster: str, node: str) -> str | None:
    """`node`'s incident workflow id in `cluster` when it still runs, else None."""
    from temporalio.client import WorkflowExecutionStatus
    from temporalio.service import RPCError

    wid = subjects.workflow_id(cluster, node)
    try:
        desc = await client.get_workflow_handle(wid).describe()
    except RPCError:
        return None  # never opened, or gone with the namespace's retention
    return wid if desc.status == WorkflowExecutionStatus.RUNNING else None


async def _only_queued(client: Any, cluster: str, node: str) -> bool:
    """Whether `node` waits in `cluster`'s FleetGuard queue (a queued node holds no permit). False when the
    guard cannot be read: the caller's refusal then stands as it is."""
    try:
        return node in await permit_waits(client, cluster)
    except Exception:  # noqa: BLE001 - unreadable: not known to be only queued
        return False


async def _undrain_for_release(settings: Settings, node: str) -> str:
    """Return `node` to service if fleetmend drained it (the scheduler's record names the incident the
    drain belongs to); an operator's drain, or none, is left as it is. Returns what was done.

    Raises:
        FleetmendError: the scheduler adapter failed (nothing is released then)."""
    from fleetmend.messages import OWNER_FLEETMEND

    try:
        async with scheduler_adapter(settings) as sched:
            info = next((n for n in await sched.list_nodes() if n.name == node), None)
            if info is None or info.owner != OWNER_FLEETMEND or not info.incident_id:
                return "not drained by fleetmend" if info is None or info.owner is None else \
                    f"drained by the {info.owner}: left as is"
            res = await sched.undrain(node, info.incident_id)
    except Exception as e:
        raise FleetmendError(f"{node}: could not return it to service first ({e}); its permit is kept") from e
    if not res.resumed and not res.operator_drained:
        raise FleetmendError(f"{node}: not returned to service ({res.detail}); its permit is kept")
    return f"returned to service ({res.detail})" if res.resumed else f"left as is ({res.detail})"


async def release_permit(settings: Settings, node: str, by: str, note: str, force: bool = False) -> str:
    """Return `node` to service if fleetmend drained it, then free its permit and pool slot
    (`GuardApi.RELEASE_PERMIT`), so no cordon outlives its count. Refused while `node`'s incident still
    runs (its drain is in force: the incident returns it) unless `force`.

    Raises:
        FleetmendError: the incident still runs (without `force`), the undrain failed, the guard refused,
            or Temporal failed.
    """
    from temporalio.client import WorkflowUpdateFailedError
    from temporalio.service import RPCError

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
    undrained = await _undrain_for_release(settings, node)
    handle = client.get_workflow_handle(subjects.fleetguard_workflow_id(settings.cluster))
    try:
        answer = await handle.execute_update(GuardApi.RELEASE_PERMIT,
                                             PermitReleaseCommand(by=by, node=node, note=f"{note} ({undrained})"
                                                                  if note else undrained), result_type=str)
    except WorkflowUpdateFailedError as e:
        raise FleetmendError(f"FleetGuard {settings.cluster}: {refusal(e)}") from e
    except RPCError as e:
        if "not found" in str(e).lower() or "already completed" in str(e).lower():
            raise FleetmendError(f"no running FleetGuard for cluster {settings.cluster}: no permit is held") from e
        raise FleetmendError(f"FleetGuard {settings.cluster}: {e}; is `fleetmend worker` running?") from e
    return f"{node}: {undrained}. {answer}{await _slot_freed(settings, node)}"


async def _slot_freed(settings: Settings, node: str, timeout_s: float = 10.0) -> str:
    """What the permit pool says of `node` once FleetGuard's next pool write lands (the guard answers the
    release before that write), waiting at most `timeout_s`: "; the permit pool no longer lists NODE", or
    why it was not said."""
    from fleetmend.infra.permit_pool import PermitPool  # lazy: nats

    deadline = asyncio.get_running_loop().time() + timeout_s
    try:
        nc = await connect_nats(settings, name="fleetmend-cli")
    except Exception as e:  # noqa: BLE001 - the release itself is done; only the pool's word is missing
        return f"; the permit pool was not read ({type(e).__name__}: {e})"
    try:
        pool = await PermitPool.open(nc.jetstream())
        while True:
            st = await pool.read(settings.cluster)
            if st is None or node not in st.holders:
                return f"; the permit pool no longer lists {node}" if st is not None else ""
            if asyncio.get_running_loop().time() >= deadline:
                return (f"; the permit pool still lists {node} after {timeout_s:.0f} s: FleetGuard frees it at "
                        f"its next pool write (`fleetmend breaker status`)")
            await asyncio.sleep(0.2)
    finally:
        await close_nats(nc)


# ------------------------------------------------------------------ commands
def _guard_done(s: Settings, update: str, result: str, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps({"command": update, "cluster": s.cluster, "by": who(), "result": result}) + "\n")
    else:
        out.print(result)


def _send(config: Optional[Path], cluster: Optional[str], name: str, note: str, as_json: bool) -> None:
    """Send FleetGuard update `name` (a `GuardApi` name) and print its answer."""
    s = settings(config, cluster=cluster)
    _guard_done(s, name, run(_guard_update(s, name, who(), note)), as_json)


@app.command("status")
def breaker_status(
    as_json: bool = typer.Option(False, "--json"),
    cluster: Optional[str] = ClusterOpt,
    config: Optional[Path] = ConfigOpt,
) -> None:
    """Permits held, the queue, the breaker and infrastructure incidents of the cluster."""
    s = settings(config, cluster=cluster)
    d = run(_guard_status(s))
    d["pool"] = run(_pool_status(s))
    if as_json:
        sys.stdout.write(json.dumps(d, default=str, indent=2) + "\n")
        return
    state = "TRIPPED" if d["breaker_tripped"] else "closed" + ("" if d["paused"] or d["observe_only"]
                                                               else " (drains allowed)")
    out.print(f"FleetGuard {d['cluster']}: breaker {state}"
              + (f"; PAUSED by {d['paused_by']}" + (f" at {d['paused_at']}" if d.get("paused_at") else "")
                 + (f" ({escape(d['paused_note'])})" if d.get("paused_note") else "") + ": no drains"
                 if d["paused"] else "")
              + ("; observe-only" if d["observe_only"] else ""))
    if d["breaker_tripped"]:
        out.print(f"  tripped at {d['breaker_tripped_at']}: {escape(d['breaker_reason'] or '')}")
        out.print("  reset with: fleetmend breaker reset --note '…'")
    pool = d.get("pool")
    holders: dict[str, Any] = pool["holders"] if pool is not None else {}
    if pool is not None:  # the budget is the pool: every drain under a permit holds a slot there
        out.print(f"permits held {len(holders)}/{pool['budget']} (known nodes {d['known_nodes']}, "
                  f"{pool['rack_cap']} per rack), queued {len(d['queue'])}; permit pool "
                  + ("open" if pool["open"] else f"closed ({escape(pool['why'])})"))
    else:
        out.print(f"permits held 0/{d['budget']} (known nodes {d['known_nodes']}), queued {len(d['queue'])}; "
                  "permit pool not published yet (FleetGuard writes it when it starts)")
    held = {h["node"]: h for h in d["held"]}
    stranded = d.get("stranded") or {}
    t = Table(title="permits and queue")
    for col in ("node", "state", "severity", "fault", "rack", "since"):
        t.add_column(col, no_wrap=True)
    for node in sorted(holders):
        slot, h = holders[node], held.get(node)
        state = "stranded" if node in stranded else "held" if h else "drained by router, not adopted yet"
        since = h["granted_at"] if h else datetime.fromtimestamp(slot.get("at") or 0, timezone.utc).isoformat(
            timespec="seconds")
        fault = (slot.get("fault") or {}).get("verdict") or {}
        t.add_row(node, state, h["severity"] if h else str((slot.get("fault") or {}).get("severity") or ""),
                  h["fault_class"] if h else str(fault.get("fault_class") or ""), slot.get("rack") or "", since)
    for q in d["queue"]:
        t.add_row(q["node"], "queued", q["severity"], q["fault_class"], q.get("rack") or "", q["requested_at"])
    if holders or d["queue"]:
        out.print(t)
    for node, why in sorted(stranded.items()):
        out.print(f"stranded: {node}: {escape(why)}")
    for inc in d["infra_incidents"]:
        out.print(f"infrastructure incident {inc['domain']} ({'closed' if inc.get('closed_at') else 'open'}): "
                  f"{len(inc['nodes'])} nodes, ticket {inc.get('ticket') or '-'}")


@app.command("reset")
def breaker_reset(
    note: str = typer.Option("", "--note", help="Why it is safe to resume.", callback=free_text()),
    as_json: bool = JsonOpt,
    cluster: Optional[str] = ClusterOpt,
    config: Optional[Path] = ConfigOpt,
) -> None:
    """Reset a tripped breaker: queued drains resume, highest severity first."""
    from fleetmend.messages import GuardApi

    _send(config, cluster, GuardApi.RESET_BREAKER, note, as_json)


@app.command("release")
def breaker_release(
    node: str = typer.Argument(..., help="The node whose drain permit (or queued request) to free.",
                               callback=node_name),
    note: str = typer.Option("", "--note", help="Why (kept in the guard's audit log).", callback=free_text()),
    force: bool = typer.Option(False, "--force", help="Release even while NODE's incident still runs."),
    as_json: bool = JsonOpt,
    cluster: Optional[str] = ClusterOpt,
    config: Optional[Path] = ConfigOpt,
) -> None:
    """Return NODE to service (a drain fleetmend made) and free its drain permit and pool slot by hand: for
    a node whose incident no longer runs (terminated, reset: `breaker status` lists it as stranded).
    Audited with who you are. Refused while NODE's incident still runs (--force overrides)."""
    from fleetmend.messages import GuardApi

    s = settings(config, cluster=cluster)
    result = run(release_permit(s, node, who(), note, force))
    if as_json:
        sys.stdout.write(json.dumps({"command": GuardApi.RELEASE_PERMIT, "node": node, "cluster": s.cluster,
                                     "by": who(), "result": result}) + "\n")
        return
    out.print(result)


@commands.command()
def pause(
    note: str = typer.Option("", "--note", help="Why.", callback=free_text()),
    as_json: bool = JsonOpt,
    cluster: Optional[str] = ClusterOpt,
    config: Optional[Path] = ConfigOpt,
) -> None:
    """Global pause: faults are still classified and recorded; no node is drained until `resume`."""
    from fleetmend.messages import GuardApi

    _send(config, cluster, GuardApi.PAUSE, note, as_json)


@commands.command()
def resume(
    note: str = typer.Option("", "--note", callback=free_text()),
    as_json: bool = JsonOpt,
    cluster: Optional[str] = ClusterOpt,
    config: Optional[Path] = ConfigOpt,
) -> None:
    """End a global pause; queued drains proceed within the budget."""
    from fleetmend.messages import GuardApi

    _send(config, cluster, GuardApi.RESUME, note, as_json)
