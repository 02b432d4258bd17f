"""Incidents: `fleetmend status [NODE]`, `show NODE`, `history NODE`, `nodes`, and the commands a human
sends to an incident (`repaired`, `retest`, `abort`: `RemediationApi` updates, audited with who sent them).

Finding a node's incidents across clusters is `fleetmend.cli.lookup`; why a queued node waits for its
drain permit is `fleetmend.cli.breaker.annotate_waits`.
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from fleetmend import subjects
from fleetmend.cli.breaker import annotate_waits
from fleetmend.cli.common import (
    MAX_TICKET_CHARS,
    ClusterOpt,
    ConfigOpt,
    JsonOpt,
    err,
    free_text,
    node_name,
    out,
    refusal,
    run,
    scheduler_adapter,
    settings,
    short_time,
    who,
)
from fleetmend.cli.ledger import deadletter_line
from fleetmend.cli.lookup import NoIncidentError, find_incidents, node_history, open_cluster
from fleetmend.config import Settings
from fleetmend.errors import FleetmendError
from fleetmend.infra.connect import close_nats, connect_nats, connect_temporal
from fleetmend.infra.lease import presence, served_clusters, unserved_reason

app = typer.Typer()
"""Top-level commands (added to the root app without a group name)."""


async def list_incidents(s: Settings, limit: int, cluster: str | None = "") -> list[dict[str, Any]]:
    """Recent incidents of `cluster` (default `s.cluster`; None: every cluster), newest first.

    Returns one dict per run: node, cluster, phase, drained, ticket, fault_class, severity, status (the
    run's, lower case), started (ISO), workflow_id, run_id; a running `awaiting_permit` row also has
    `waiting` (why its permit waits). The nodes the router is still starting an incident for come first
    (`_starting`), then the incidents; `limit` rows at most in all.
    """
    from fleetmend.messages import RemediationApi  # lazy: temporalio.common (see common)

    client = await connect_temporal(s)
    rows = []
    cluster = s.cluster if cluster == "" else cluster
    query = f"WorkflowType='{RemediationApi.WORKFLOW}'" + (f" AND FleetCluster='{cluster}'" if cluster else "")
    async for wf in client.list_workflows(query, limit=limit):
        sa = wf.typed_search_attributes
        get = {p.key.name: p.value for p in sa}
        rows.append({"node": get.get("FleetNode"), "cluster": get.get("FleetCluster"),
                     "phase": get.get("FleetPhase"), "drained": bool(get.get("FleetDrained", False)),
                     "ticket": get.get("FleetTicket"), "fault_class": get.get("FleetFaultClass"),
                     "severity": get.get("FleetSeverity"), "status": wf.status.name.lower() if wf.status else None,
                     "started": wf.start_time.isoformat(timespec="seconds") if wf.start_time else None,
                     "workflow_id": wf.id, "run_id": wf.run_id})
    if any(r["phase"] == "awaiting_permit" and r["status"] == "running" for r in rows):
        # each cluster's guard, asked at once: a guard no worker answers costs its query timeout once, not per cluster
        await asyncio.gather(*(annotate_waits(client, str(cl), [r for r in rows if r["cluster"] == cl], s)
                               for cl in sorted({r["cluster"] for r in rows
                                                 if r["phase"] == "awaiting_permit" and r["cluster"]})))
    # The nodes still starting are the newest rows, and live state: listed first whatever the history holds
    # (behind `limit` recent incidents they were never read, and a burst's refused nodes went unseen).
    running = {(str(r["cluster"]), str(r["node"])) for r in rows if r["status"] == "running"}
    starting = await _starting(s, cluster, running, limit)
    rows = (starting + rows)[:limit]
    served = await processes_alive(s)
    if served is not None:  # an open incident of a cluster no live worker serves: nothing of it runs
        workers = served_clusters(served)
        for r in rows:
            if r["status"] in ("running", "starting") and r["cluster"] and r["cluster"] not in workers:
                r["unserved"] = unserved_reason(str(r["cluster"]))
    return rows


async def processes_alive(s: Settings) -> list[dict[str, Any]] | None:
    """Every worker's and router's presence (`fleetmend.infra.lease.presence`: cluster, holder, age_s, alive,
    ...), or None when NATS cannot be read (status then says nothing of which clusters are served)."""
    try:
        nc = await connect_nats(s, name="fleetmend-cli")
    except Exception:  # noqa: BLE001 - NATS away: the incidents alone
        return None
    try:
        return await presence(nc.jetstream())
    except Exception:  # noqa: BLE001 - no permission or no answer: unknown
        return None
    finally:
        await close_nats(nc)


def cluster_rows(rows: list[dict[str, Any]], alive: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per cluster (those with an incident listed or a process announced): its live workers and the live routers
    whose subjects take its faults, open incidents listed, and what an operator must do when no worker serves
    it. A router routes every cluster its filter matches (the default `fleet.*.fault.*`: all)."""
    names = sorted({str(r["cluster"]) for r in rows if r["cluster"]} | {p["cluster"] for p in alive})
    routers = [p for p in alive if p["role"] == "router" and p["alive"]]
    out = []
    for c in names:
        workers = [p for p in alive if p["role"] == "worker" and p["cluster"] == c]
        live = [p for p in workers if p["alive"]]
        routing = [p for p in routers if _matches(str(p.get("filter") or subjects.all_faults_subject()),
                                                   subjects.fault_subject(c, "x"))]
        last = min((p["age_s"] for p in workers), default=None)
        note = "" if live else unserved_reason(c) + (f" (last worker seen {last:.0f} s ago)" if last is not None else "")
        if not routing:
            note = (note + "; " if note else "") + "no router alive: start `fleetmend router`"
        out.append({"cluster": c, "workers": len(live), "routers": len(routing),
                    "open": sum(1 for r in rows if r["cluster"] == c and r["status"] in ("running", "starting")),
                    "note": note})
    return out


def _matches(pattern: str, subject: str) -> bool:
    """NATS subject matching (`*` one token, `>` the rest)."""
    ps, ss = pattern.split("."), subject.split(".")
    for i, p in enumerate(ps):
        if p == ">":
            return len(ss) > i
        if i >= len(ss) or (p != "*" and p != ss[i]):
            return False
    return len(ps) == len(ss)


async def _starting(s: Settings, cluster: str | None, running: set[tuple[str, str]], limit: int) -> list[dict[str, Any]]:
    """Rows for the nodes the router refused a permit pool slot and is still starting an incident for
    (`PermitPool.waiting`): in a burst the router starts incidents at the Temporal server's rate, and these
    wait for the budget before their incident exists. Status `starting`, phase `awaiting_permit`, with the
    pool's reason. [] when NATS cannot be read (the Temporal rows stand alone)."""
    from fleetmend.infra.permit_pool import PermitPool  # lazy: nats

    try:
        nc = await connect_nats(s, name="fleetmend-cli")
    except Exception:  # noqa: BLE001 - NATS away: the incidents alone
        return []
    try:
        waiting = await (await PermitPool.open(nc.jetstream())).waiting(cluster)
    except Exception:  # noqa: BLE001 - no bucket yet, or no permission: nothing is starting
        waiting = {}
    finally:
        await close_nats(nc)
    out: list[dict[str, Any]] = []
    for (cl, node), w in sorted(waiting.items()):
        if (cl, node) in running or len(out) >= limit:
            continue
        since = datetime.fromtimestamp(float(w.get("at") or 0), timezone.utc).isoformat(timespec="seconds")
        out.append({"node": node, "cluster": cl, "phase": "awaiting_permit", "drained": False, "ticket": None,
                    "fault_class": w.get("fault_class"), "severity": w.get("severity"), "status": "starting",
                    "started": since, "workflow_id": None, "run_id": None,
                    "waiting": f"{w.get('reason')} (permit pool; the router is starting its incident)"})
    return out


async def _count_beyond(s: Settings, cluster: str | None) -> str:
    """"N incidents (D drained now, Q awaiting a permit)" of `cluster` (None: every cluster), or "" when
    the server cannot count (visibility without counts)."""
    from fleetmend.messages import RemediationApi  # lazy: temporalio.common (see common)

    client = await connect_temporal(s)
    base = f"WorkflowType='{RemediationApi.WORKFLOW}'" + (f" AND FleetCluster='{cluster}'" if cluster else "")
    running = f"{base} AND ExecutionStatus='Running'"
    try:
        total = (await client.count_workflows(base)).count
        drained = (await client.count_workflows(f"{running} AND FleetDrained=true")).count
        waiting = (await client.count_workflows(f"{running} AND FleetPhase='awaiting_permit'")).count
    except Exception:  # noqa: BLE001 - the listing stands without the counts
        return ""
    return f"{total} incidents ({drained} drained now, {waiting} awaiting a drain permit)"


@app.command()
def status(
    node: Optional[str] = typer.Argument(None, help="A node: its incident in detail, found in any cluster.",
                                         callback=node_name),
    as_json: bool = typer.Option(False, "--json", help="An object (one node: its incident; a node with "
                                 "incidents in several clusters: an array of them), or an array of incidents."),
    limit: int = typer.Option(50, "--limit", help="Most recent incidents listed."),
    cluster: Optional[str] = typer.Option(None, "--cluster", help="Only this cluster (default: every cluster)."),
    config: Optional[Path] = ConfigOpt,
) -> None:
    """Open and recent incidents of every cluster (a table), or one node's incident wherever it is."""
    s = settings(config, cluster=cluster)
    if node:
        _show_node(s, node, cluster, as_json)
        return
    rows = run(list_incidents(s, limit, cluster))
    if as_json:
        sys.stdout.write(json.dumps(rows, default=str, indent=2) + "\n")
        return
    where = f"cluster {cluster}" if cluster else "any cluster"
    alive = run(processes_alive(s))
    if not rows:
        out.print(f"no incidents in {where}")
        _print_clusters(rows, alive, cluster)
        out.print(escape(run(deadletter_line(s))))
        return
    t = Table(title=f"incidents in {where}")
    # node and cluster are what an operator acts on (`--cluster`): never cut. A permit-wait reason in the
    # phase column is cut at 60 columns instead (`status NODE` shows it whole): unbounded, it squeezed
    # the cluster column to "a5…"
    widths = {"node": max(len(r["node"] or "?") for r in rows), "phase": len("awaiting_repair"),
              "cluster": max(len(r["cluster"] or "?") for r in rows),
              "ticket": max([len(r["ticket"] or "") for r in rows] + [6])}
    for col in ("cluster", "node", "phase", "drained", "fault", "severity", "ticket", "opened"):
        t.add_column(col, no_wrap=True, min_width=widths.get(col), max_width=60 if col == "phase" else None)
    for r in rows:
        phase = r["phase"] or "?"
        if r["status"] not in ("running", "completed", "continued_as_new", "starting", None):
            phase = f"{phase} ({r['status']})"  # terminated / failed / timed out: say so
        elif r.get("unserved"):
            phase = f"{phase}: {r['unserved']}"  # nothing of it runs until a worker of its cluster does
        elif r.get("waiting"):
            phase = f"{phase}: {r['waiting']}"  # why the drain permit waits (FleetGuard)
        t.add_row(escape(r["cluster"] or "?"), escape(r["node"] or "?"), phase, "yes" if r["drained"] else "no",
                  r["fault_class"] or "", r["severity"] or "", r["ticket"] or "", short_time(r["started"])[:11])
    out.print(t)
    if len(rows) >= limit:  # a storm: say what the newest `limit` leave out (drained nodes scroll off first)
        more = run(_count_beyond(s, cluster))
        if more:
            out.print(escape(f"showing the {limit} newest of {more}; `--limit N` lists more"))
    _print_clusters(rows, alive, cluster)
    out.print(escape(run(deadletter_line(s))))


def _print_clusters(rows: list[dict[str, Any]], alive: list[dict[str, Any]] | None, cluster: str | None) -> None:
    """The clusters table of `status` (`cluster_rows`), or one line saying it cannot be known."""
    if alive is None:
        out.print("clusters: unknown (NATS could not be read: which workers and routers are alive is not shown)")
        return
    table = [c for c in cluster_rows(rows, alive) if cluster is None or c["cluster"] == cluster]
    if not table:
        out.print("clusters: no worker or router has announced itself (`fleetmend worker --cluster C`, "
                  "`fleetmend router`)")
        return
    t = Table(title="clusters (workers and routers alive, from their presence keys)")
    for col in ("cluster", "workers", "routers", "open incidents", "note"):
        t.add_column(col, no_wrap=col != "note")
    for c in table:
        t.add_row(escape(c["cluster"]), str(c["workers"]), str(c["routers"]), str(c["open"]), escape(c["note"]))
    out.print(t)


def _show_node(s: Settings, node: str, cluster: str | None, as_json: bool) -> None:
    """`status NODE`: the node's incident (timeline and faults), or the clusters it has incidents in.
    With `as_json` a node without any incident is still one JSON object on stdout
    (`{"node", "cluster", "incident": null, "error"}`), and the exit status is 1."""
    try:
        found = run(find_incidents(s, node, cluster), reraise=(NoIncidentError,)) if as_json else \
            run(find_incidents(s, node, cluster))
    except NoIncidentError as missing:
        sys.stdout.write(json.dumps({"node": node, "cluster": cluster, "incident": None, "error": str(missing)})
                         + "\n")
        err.print(f"[red]error:[/red] {escape(str(missing))}")
        raise typer.Exit(1) from missing
    if len(found) > 1:
        if as_json:
            sys.stdout.write(json.dumps(found, default=str, indent=2) + "\n")
            return
        t = Table(title=f"{node} has incidents in {len(found)} clusters; pick one with --cluster")
        for col in ("cluster", "phase", "outcome", "fault", "ticket", "opened", "workflow"):
            t.add_column(col, no_wrap=True)
        for d in found:
            t.add_row(escape(d["cluster"] or "?"), d["phase"] or "", d["outcome"] or "", d["fault_class"] or "",
                      d["ticket"] or "", short_time(d["opened_at"]), escape(d["workflow_id"] or ""))
        out.print(t)
        return
    d = found[0]
    if as_json:
        sys.stdout.write(json.dumps(d, default=str, indent=2) + "\n")
        return
    t = Table(title=f"{d['node']} (cluster {d['cluster']}) — {d['phase']}"
              + (f", outcome {d['outcome']}" if d["outcome"] else ""))
    for col in ("when", "phase", "what", "by"):
        t.add_column(col)
    for e in d["timeline"]:
        t.add_row(short_time(e["at"]), e["phase"], escape(e["text"]), escape(e.get("by") or ""))
    out.print(t)
    out.print(faults_table(d))
    for ref in d.get("runbooks", {}).values():
        out.print(f"runbook: {escape(ref)}")


def seen(count: int) -> str:
    """How often an incident saw a fault, in words ("once", "3 times"): a bare "×1" beside a kernel message
    naming a PCIe width ("x16") read as one more width."""
    return "once" if count == 1 else f"{count} times"


def faults_table(d: dict) -> Table:
    """The faults of one incident view (`find_incidents`): fault, device, severity, action, seen, message."""
    f = Table(title=f"faults (drained: {'yes' if d['drained'] else 'no'}, ticket: {d['ticket'] or '-'})")
    for col in ("fault", "device", "severity", "action", "seen"):
        f.add_column(col, no_wrap=True)
    f.add_column("message")
    for x in d["faults"]:
        what = f"XID {x['code']}" if x["kind"] == "xid" else x["kind"] + (f" {x['code']}" if x["code"] else "")
        f.add_row(what, x.get("device") or "", "cleared" if x.get("healthy") else x["severity"],
                  x.get("immediate_action") or "", seen(int(x.get("count") or 1)), escape(x.get("message") or ""))
    return f


@app.command("show")
def show(
    node: str = typer.Argument(..., help="The node.", callback=node_name),
    as_json: bool = typer.Option(False, "--json"),
    cluster: Optional[str] = ClusterOpt,
    config: Optional[Path] = ConfigOpt,
) -> None:
    """NODE's incident timeline (phases, drains, diagnostics, tickets) and its faults."""
    _show_node(settings(config, cluster=cluster), node, cluster, as_json)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    m, sec = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    d, h = divmod(h, 24)
    return f"{d}d{h:02d}h" if d else f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s"


@app.command("history")
def history(
    node: str = typer.Argument(..., help="The node.", callback=node_name),
    as_json: bool = typer.Option(False, "--json", help="A JSON array, newest incident first."),
    limit: int = typer.Option(100, "--limit", help="Most recent incidents listed."),
    cluster: Optional[str] = ClusterOpt,
    config: Optional[Path] = ConfigOpt,
) -> None:
    """Every incident of NODE, open and closed, in every cluster (unless --cluster): opened, closed,
    fault classes, outcome, ticket, time drained. Kept as long as the namespace retention."""
    s = settings(config)
    rows = run(node_history(s, node, cluster, limit))
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=2, default=str) + "\n")
        return
    if not rows:
        out.print(f"no incidents of {escape(node)} in {'cluster ' + cluster if cluster else 'any cluster'} "
                  f"(closed ones are kept {s.temporal_retention_days} days: temporal_retention_days)")
        return
    t = Table(title=f"incidents of {node} ({len(rows)})")
    for col in ("cluster", "opened", "closed", "outcome", "fault classes", "ticket", "drained"):
        t.add_column(col, no_wrap=col != "fault classes")
    for r in rows:
        outcome = r["outcome"] or (r["phase"] if r["run_status"] == "running" else "?")
        t.add_row(escape(r["cluster"] or "?"), short_time(r["opened_at"]), short_time(r["closed_at"]) or "open",
                  escape(outcome or ""), escape(", ".join(r["fault_classes"])), escape(r["ticket"] or ""),
                  _duration(r["drained_s"]))
    out.print(t)


async def _nodes(s: Settings, with_incidents: bool) -> tuple[list[dict[str, Any]], str | None]:
    """Scheduler rows joined with open incidents. Returns (rows, warning or None)."""
    async with scheduler_adapter(s) as sched:
        rows = [asdict(r) for r in await sched.list_nodes()]
    warning = None
    if with_incidents:
        try:
            incidents = {i["node"]: i for i in await list_incidents(s, 1000) if i["status"] == "running"}
        except FleetmendError as e:
            incidents, warning = {}, f"incidents not shown: {e}"
        seen = set()
        for r in rows:
            inc = incidents.get(r["name"])
            seen.add(r["name"])
            r["phase"] = inc["phase"] if inc else None
            r["incident_id"] = inc["workflow_id"] if inc else r.get("incident_id")
        for node, inc in sorted(incidents.items()):
            if node not in seen:  # an open incident on a node the scheduler lists as in service
                rows.append({"name": node, "state": "in_service", "reason": "", "owner": None,
                             "incident_id": inc["workflow_id"], "phase": inc["phase"]})
    for r in rows:
        r["incident_id"] = incident_ref(r.get("incident_id"))
    return rows, warning


def incident_ref(recorded: str | None) -> str | None:
    """The one form `nodes` shows an incident in: its workflow id `remediate/<cluster>/<node>` (what
    `status`, `show` and the Temporal UI use). A scheduler records the incident's idempotency key
    `<workflow id>/<first run id>` (`NodeRemediation._incident_id`); the run id is dropped. Anything
    else (an operator's or a fast drain's key) is shown as recorded."""
    if recorded and recorded.startswith("remediate/") and recorded.count("/") == 3:
        return recorded.rsplit("/", 1)[0]
    return recorded


@app.command("nodes")
def nodes(
    as_json: bool = typer.Option(False, "--json"),
    incidents: bool = typer.Option(True, "--incidents/--no-incidents",
                                   help="Join open incidents from Temporal (phase)."),
    cluster: Optional[str] = ClusterOpt,
    config: Optional[Path] = ConfigOpt,
) -> None:
    """Nodes as the scheduler sees them: state, who drained them (fleetmend or an operator), incident."""
    s = settings(config, cluster=cluster)
    rows, warning = run(_nodes(s, incidents))
    if warning:
        err.print(f"[yellow]warning:[/yellow] {escape(warning)}")
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=2, default=str) + "\n")
        return
    if not rows:
        out.print(f"no nodes drained or in incidents (scheduler {s.scheduler.value}, cluster {s.cluster})")
        return
    t = Table(title=f"nodes ({s.scheduler.value}, cluster {s.cluster})")
    for col in ("node", "state", "drained by", "phase", "incident", "reason"):
        t.add_column(col, no_wrap=col != "reason")
    for r in rows:
        t.add_row(escape(r["name"]), r["state"], r.get("owner") or "", r.get("phase") or "",
                  escape(r.get("incident_id") or ""), escape(r.get("reason") or ""))
    out.print(t)


async def send_command(s: Settings, node: str, update: str, cmd: Any, cluster: str | None = None) -> dict[str, Any]:
    """Send the `RemediationApi` update `update` to `node`'s open incident: in `cluster`, else the one
    cluster where it has one open.

    Returns:
        {command, node, cluster, workflow_id, by, result} (what `--json` prints).
    Raises:
        FleetmendError: no open incident, the workflow refused the update, or Temporal failed.
    """
    from temporalio.client import WorkflowUpdateFailedError  # lazy: temporalio (see common)
    from temporalio.service import RPCError

    client = await connect_temporal(s)
    cl = cluster or await open_cluster(client, node, s.cluster)
    wid = subjects.workflow_id(cl, node)
    handle = client.get_workflow_handle(wid)
    try:
        result = await handle.execute_update(update, cmd, result_type=str)
    except WorkflowUpdateFailedError as e:
        raise FleetmendError(f"{node}: {refusal(e)}") from e
    except RPCError as e:
        if "not found" in str(e).lower() or "already completed" in str(e).lower():
            raise FleetmendError(f"no open incident for node {node} in cluster {cl}") from e
        raise FleetmendError(f"{wid}: {e}") from e
    return {"command": update, "node": node, "cluster": cl, "workflow_id": wid, "by": cmd.by, "result": result}


def _done(res: dict[str, Any], as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(res, default=str) + "\n")
    else:
        out.print(f"{res['node']} ({res['cluster']}): {res['result']}")


@app.command()
def repaired(
    node: str = typer.Argument(..., help="The node.", callback=node_name),
    ticket: Optional[str] = typer.Option(None, "--ticket", help="The repair ticket id.",
                                          callback=free_text(MAX_TICKET_CHARS)),
    note: str = typer.Option("", "--note", help="What was done.", callback=free_text()),
    as_json: bool = JsonOpt,
    cluster: Optional[str] = ClusterOpt,
    config: Optional[Path] = ConfigOpt,
) -> None:
    """Mark NODE repaired: diagnostics re-run, and the node returns to service if they pass."""
    from fleetmend.messages import RemediationApi, RepairedCommand  # lazy: temporalio.common (see common)

    s = settings(config, cluster=cluster)
    _done(run(send_command(s, node, RemediationApi.MARK_REPAIRED, RepairedCommand(by=who(), ticket=ticket, note=note),
                           cluster)), as_json)


@app.command()
def retest(node: str = typer.Argument(..., help="The node.", callback=node_name), as_json: bool = JsonOpt,
           cluster: Optional[str] = ClusterOpt,
           config: Optional[Path] = ConfigOpt) -> None:
    """Force NODE's verification diagnostics to run now."""
    from fleetmend.messages import RemediationApi, RetestCommand  # lazy: temporalio.common (see common)

    s = settings(config, cluster=cluster)
    _done(run(send_command(s, node, RemediationApi.FORCE_RETEST, RetestCommand(by=who()), cluster)), as_json)


@app.command()
def abort(
    node: str = typer.Argument(..., help="The node.", callback=node_name),
    note: str = typer.Option("", "--note", help="Why.", callback=free_text()),
    undrain: bool = typer.Option(False, "--undrain", help="Also undrain the node if fleetmend drained it."),
    as_json: bool = JsonOpt,
    cluster: Optional[str] = ClusterOpt,
    config: Optional[Path] = ConfigOpt,
) -> None:
    """Close NODE's incident now (automation stops; the drain stays unless --undrain)."""
    from fleetmend.messages import AbortCommand, RemediationApi  # lazy: temporalio.common (see common)

    s = settings(config, cluster=cluster)
    _done(run(send_command(s, node, RemediationApi.ABORT, AbortCommand(by=who(), note=note, undrain=undrain),
                           cluster)), as_json)
