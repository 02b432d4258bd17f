"""Finding incidents by node across clusters (for `fleetmend status NODE` and `fleetmend history NODE`).

Both ask Temporal visibility for `NodeRemediation` runs whose `FleetNode` is the node, in every
cluster unless `--cluster` is given, then read each incident's `IncidentStatus`: the `status` query
for an open incident, the run's result for a completed one (no worker needed), the `status` query
on the closed run for one that closed by continuing into the node's next incident (the worker
replays it). What cannot be read (a terminated run, no worker) is shown from its search attributes.

Closed incidents stay listed as long as the Temporal namespace keeps closed workflows (its
retention; `fleetmend temporal setup` and `dev up` set `temporal_retention_days`, 90 by default).
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Any

from fleetmend import subjects
from fleetmend.catalog.runbooks import runbook_ref
from fleetmend.config import Settings
from fleetmend.errors import FleetmendError
from fleetmend.infra.connect import connect_temporal

# temporalio and fleetmend.messages are imported inside the functions that ask Temporal: `fleetmend --help`
# need not load them (see fleetmend.cli.common).

_SAFE = re.compile(r"^[^'\"\\\s]+$")


class NoIncidentError(FleetmendError, LookupError):
    """The node has no incident (open or closed) where it was searched; carries `node` and `cluster`."""

    def __init__(self, message: str, node: str, cluster: str | None) -> None:
        super().__init__(message)
        self.node, self.cluster = node, cluster


def _quoted(what: str, value: str) -> str:
    """`'value'` for a visibility query. Raises FleetmendError for a value that cannot be a name."""
    if not _SAFE.match(value or ""):
        raise FleetmendError(f"invalid {what} name {value!r}")
    return f"'{value}'"


def node_query(node: str, cluster: str | None = None, running: bool = False) -> str:
    """The visibility query for `node`'s incidents (in `cluster`, or every cluster when None)."""
    from fleetmend.messages import RemediationApi

    q = f"WorkflowType='{RemediationApi.WORKFLOW}' AND FleetNode={_quoted('node', node)}"
    if cluster:
        q += f" AND FleetCluster={_quoted('cluster', cluster)}"
    if running:
        q += " AND ExecutionStatus='Running'"
    return q


def _attrs(wf: Any) -> dict[str, Any]:
    return {p.key.name: p.value for p in wf.typed_search_attributes}


def _iso(at: datetime | None) -> str | None:
    return at.astimezone(timezone.utc).isoformat(timespec="seconds") if at else None


def status_dict(st: Any) -> dict[str, Any]:
    """`IncidentStatus` (or its dict) → the JSON-safe dict `status --json` prints."""
    d = dict(st.__dict__) if not isinstance(st, dict) else dict(st)
    for k in ("phase", "outcome", "severity"):
        d[k] = getattr(d.get(k), "value", d.get(k))
    d["faults"] = [{k: f.get(k) for k in ("kind", "code", "severity", "raw", "message", "component", "device",
                                          "count", "fault_class", "immediate_action", "drain", "healthy",
                                          "observed_at")}
                   for f in d.get("faults", [])]
    classes = [d.get("fault_class")] + [f["fault_class"] for f in d["faults"] if f.get("drain")]
    d["runbooks"] = {fc: runbook_ref(fc) for fc in dict.fromkeys(c for c in classes if c)}
    return d


def _from_attrs(wf: Any) -> dict[str, Any]:
    """What visibility alone says about a run (no worker needed)."""
    sa = _attrs(wf)
    status = wf.status.name.lower() if wf.status else None
    return {"workflow_id": wf.id, "run_id": wf.run_id, "node": sa.get("FleetNode"), "cluster": sa.get("FleetCluster"),
            "phase": sa.get("FleetPhase"), "outcome": None if status in ("running", "completed", "continued_as_new")
            else status, "drained": bool(sa.get("FleetDrained", False)), "ticket": sa.get("FleetTicket"),
            "fault_class": sa.get("FleetFaultClass"), "severity": sa.get("FleetSeverity"),
            "opened_at": _iso(wf.start_time), "closed_at": _iso(wf.close_time), "faults": [], "timeline": [],
            "drained_at": None, "run_status": status, "partial": True}


async def read_incident(client: Any, wf: Any) -> dict[str, Any]:
    """One run's `IncidentStatus` as a dict (see module docstring for where it comes from).

    Returns the dict with `run_id` and `run_status` added; `partial: True` when only the search
    attributes could be read (and `read_error` says why).
    """
    from temporalio.client import WorkflowFailureError
    from temporalio.service import RPCError

    from fleetmend.messages import IncidentStatus, RemediationApi

    status = wf.status.name.lower() if wf.status else None
    handle = client.get_workflow_handle(wf.id, run_id=wf.run_id, result_type=IncidentStatus)
    try:
        if status == "completed":
            st = await handle.result(follow_runs=False)
        else:
            st = await handle.query(RemediationApi.STATUS, result_type=IncidentStatus)
    except (RPCError, WorkflowFailureError) as err:
        d = _from_attrs(wf)
        d["read_error"] = str(err).splitlines()[0][:200]
        return d
    d = status_dict(st)
    d.update(run_id=wf.run_id, run_status=status, partial=False)
    return d


async def find_incidents(s: Settings, node: str, cluster: str | None) -> list[dict[str, Any]]:
    """`node`'s current incident in each cluster it has one in (`cluster` narrows to one).

    Per cluster: the open incident, else the most recent closed one. Falls back to the workflow id
    in `s.cluster` when visibility has nothing yet (it lags a start by up to a second).
    Raises:
        NoIncidentError: no incident anywhere (a `FleetmendError`).
        FleetmendError: Temporal unreachable.
    """
    from temporalio.service import RPCError

    from fleetmend.messages import IncidentStatus, RemediationApi

    client = await connect_temporal(s)
    latest: dict[str, Any] = {}
    try:
        async for wf in client.list_workflows(node_query(node, cluster), limit=200):
            cl = _attrs(wf).get("FleetCluster") or "?"
            cur = latest.get(cl)
            running = wf.status is not None and wf.status.name == "RUNNING"
            cur_running = cur is not None and cur.status is not None and cur.status.name == "RUNNING"
            if cur is None or (running and not cur_running) or (
                    running == cur_running and wf.start_time and cur.start_time and wf.start_time > cur.start_time):
                latest[cl] = wf
    except RPCError as err:
        raise FleetmendError(f"could not list incidents of {node}: {err}") from err
    if latest:
        return [await read_incident(client, wf) for _, wf in sorted(latest.items())]
    # Visibility lags a start: ask the workflow id of the configured cluster directly.
    cl = cluster or s.cluster
    wid = subjects.workflow_id(cl, node)
    try:
        st = await client.get_workflow_handle(wid).query(RemediationApi.STATUS, result_type=IncidentStatus)
    except RPCError as err:
        where = f"cluster {cluster}" if cluster else "any cluster"
        raise NoIncidentError(f"no incident for node {node} in {where} (searched FleetNode={node!r}"
                              f"{'' if 'not found' in str(err).lower() else f'; {wid}: {err}'})", node,
                              cluster) from err
    d = status_dict(st)
    d.update(run_status="running", partial=False)
    return [d]


async def open_cluster(client: Any, node: str, default: str) -> str:
    """The cluster a command given no `--cluster` acts in (`repaired`, `retest`, `abort`): the configured
    cluster (`default`), always. A node with no open incident there but open incidents elsewhere is
    refused, naming them: falling back to another cluster made a retried command act on a second incident
    (`abort gpu-7` twice closed gpu-7 in `local`, then undrained a gpu-7 of another cluster).

    Returns `default` when the node has an open incident there or none anywhere (the command then says so).
    Raises:
        FleetmendError: no open incident in `default`, open ones elsewhere (names them: add --cluster).
    """
    clusters: set[str] = set()
    async for wf in client.list_workflows(node_query(node, running=True), limit=20):
        cl = _attrs(wf).get("FleetCluster")
        if cl is not None:
            clusters.add(cl)
    if default in clusters or not clusters:
        return default
    others = sorted(clusters)
    raise FleetmendError(f"{node} has no open incident in cluster {default}; it has one in "
                         f"{', '.join(others)}: add --cluster {others[0]}" + (" (or another)" if len(others) > 1
                                                                              else ""))


async def node_history(s: Settings, node: str, cluster: str | None, limit: int) -> list[dict[str, Any]]:
    """Every incident of `node` (open and closed, every cluster unless `cluster`), newest first.

    A run that continued-as-new in the middle of an incident is not an incident of its own (its
    successor carries the whole state); one that closed its incident and continued into the next
    is. Each row: cluster, workflow_id, run_id, opened_at, closed_at, phase, outcome, fault_classes,
    ticket, drained_at, drained_s (seconds drained: to closed_at, or to now while open), severity.
    Raises:
        FleetmendError: Temporal unreachable or the query refused.
    """
    from temporalio.service import RPCError

    client = await connect_temporal(s)
    runs = []
    try:
        async for wf in client.list_workflows(node_query(node, cluster), limit=limit * 4):
            runs.append(wf)
    except RPCError as err:
        raise FleetmendError(f"could not list incidents of {node}: {err}") from err
    rows = []
    now = datetime.now(timezone.utc)
    for wf in sorted(runs, key=lambda w: w.start_time or now, reverse=True):
        status = wf.status.name.lower() if wf.status else None
        if status == "continued_as_new" and _attrs(wf).get("FleetPhase") != "closed":
            continue  # mid-incident continue-as-new: the next run carries it
        d = await read_incident(client, wf)
        classes = sorted({f["fault_class"] for f in d.get("faults", []) if f.get("fault_class")}
                         | ({d["fault_class"]} if d.get("fault_class") else set()))
        drained_s = None
        if d.get("drained_at"):
            end = datetime.fromisoformat(d["closed_at"]) if d.get("closed_at") else now
            drained_s = max(0.0, (end - datetime.fromisoformat(d["drained_at"])).total_seconds())
        rows.append({"cluster": d.get("cluster"), "node": d.get("node") or node, "workflow_id": d.get("workflow_id"),
                     "run_id": wf.run_id, "opened_at": d.get("opened_at"), "closed_at": d.get("closed_at"),
                     "phase": d.get("phase"), "outcome": d.get("outcome"), "fault_classes": classes,
                     "severity": d.get("severity"), "ticket": d.get("ticket"), "drained": d.get("drained"),
                     "drained_at": d.get("drained_at"), "drained_s": drained_s, "run_status": status,
                     "partial": d.get("partial", False)})
        if len(rows) >= limit:
            break
    return rows
