"""`fleetmend` command line: the production processes, the local pipeline and the operator commands.

Every command reads FLEETMEND_NATS_URL, FLEETMEND_TEMPORAL_ADDRESS, FLEETMEND_TEMPORAL_UI_PORT and
FLEETMEND_STATE_DIR (and the rest of `fleetmend.config.Settings`); flags override them.
"""

from __future__ import annotations

import asyncio
import getpass
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fleetmend.config import Settings, load_settings
from fleetmend.errors import ConfigError, FleetmendError

EXIT_STATUSES = """Exit statuses:

\b
  0    done (for a listing: it was read, even when empty)
  1    could not be done: a server unreachable, no such incident, the workflow refused the command
  2    bad usage or configuration (unknown option, invalid value, config file error)
  130  interrupted (Ctrl-C)

`fleetmend explain` answers what it found instead (0/1/2/3, see its --help).
With --json, stdout holds only the JSON result; logs and errors go to stderr."""
app = typer.Typer(no_args_is_help=True, add_completion=True, rich_markup_mode=None, epilog=EXIT_STATUSES,
                  help="fleetmend: find bad GPU nodes, take them out, bring them back proven good.")
dev_app = typer.Typer(no_args_is_help=True, help="Local pipeline with embedded NATS and Temporal.")
config_app = typer.Typer(no_args_is_help=True, help="Configuration.")
app.add_typer(dev_app, name="dev")
app.add_typer(config_app, name="config")

# Piped output (| less, | grep) gets a wide console instead of rich's 80-column default.
out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)

ConfigOpt = typer.Option(None, "--config", "-c", envvar="FLEETMEND_CONFIG", help="TOML config file.")
ClusterOpt = typer.Option(None, "--cluster", help="Cluster name (FLEETMEND_CLUSTER).")
MetricsPortOpt = typer.Option(None, "--metrics-port", help="Serve Prometheus /metrics here (0: off; "
                                                         "FLEETMEND_METRICS__<PROCESS>_PORT).")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("fleetmend")
        except PackageNotFoundError:  # run from a source tree that was never installed
            v = "unknown (not installed)"
        sys.stdout.write(f"fleetmend {v}\n")
        raise typer.Exit(0)


@app.callback()
def _cli(version: bool = typer.Option(False, "--version", is_eager=True, callback=_version,
                                      help="Print the version and exit.")) -> None:
    # One-shot commands log warnings and errors only, to stderr (stdout is the result); the long-running
    # processes (worker, router, dev up) configure their own level and format at start.
    from fleetmend.infra.logs import configure_logging

    configure_logging(os.environ.get("FLEETMEND_LOG_FORMAT", "auto"), level="warning")


def _settings(config: Optional[Path] = None, **overrides: Any) -> Settings:
    try:
        return load_settings(config, **overrides)
    except ConfigError as e:
        err.print(f"[red]{e}[/red]")
        raise typer.Exit(2) from e


def _run(coro) -> Any:  # noqa: ANN001
    try:
        return asyncio.run(coro)
    except FleetmendError as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(1) from e


def _who() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no passwd entry in some containers
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


async def _serve(main, settings: Settings) -> None:  # noqa: ANN001
    """Run `main(settings, stop)`; SIGTERM/SIGINT set `stop`, a second SIGINT forces exit."""
    from fleetmend.infra.logs import configure_logging

    from fleetmend.infra.process import stop_on_signals

    configure_logging(settings.log_format)
    await main(settings, stop_on_signals())


# ------------------------------------------------------------------ processes
@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []})
def agent(ctx: typer.Context) -> None:
    """Node agent: probes → JetStream (spooling to disk while NATS is away), heartbeats, diagnostics.
    `fleetmend agent --help` lists its options (--node, --cluster, --config, --kmsg-file, --once, ...)."""
    from agents.__main__ import main as agent_main

    raise typer.Exit(agent_main(list(ctx.args), prog="fleetmend agent", lean=False))


@app.command()
def router(config: Optional[Path] = ConfigOpt, metrics_port: Optional[int] = MetricsPortOpt) -> None:
    """Router: durable JetStream consumer → fault catalog → Temporal signal-with-start."""

    from fleetmend.router import run_router

    s = _settings(config)
    if metrics_port is not None:
        s.metrics.router_port = metrics_port
    _run(_serve(run_router, s))


@app.command()
def worker(
    config: Optional[Path] = ConfigOpt,
    scheduler: Optional[str] = typer.Option(None, "--scheduler", help="slurm, standalone, kubernetes or none."),
    metrics_port: Optional[int] = MetricsPortOpt,
) -> None:
    """Temporal worker: NodeRemediation workflows and their activities."""
    from fleetmend.worker import run_worker

    s = _settings(config, scheduler=scheduler)
    if metrics_port is not None:
        s.metrics.worker_port = metrics_port
    _run(_serve(run_worker, s))


@dev_app.command("up")
def dev_up(
    state_dir: Optional[Path] = typer.Option(None, "--state-dir", help="FLEETMEND_STATE_DIR"),
    nats_url: Optional[str] = typer.Option(None, "--nats-url", help="FLEETMEND_NATS_URL"),
    temporal_address: Optional[str] = typer.Option(None, "--temporal-address", help="FLEETMEND_TEMPORAL_ADDRESS"),
    ui_port: Optional[int] = typer.Option(None, "--ui-port", help="FLEETMEND_TEMPORAL_UI_PORT"),
    scheduler: Optional[str] = typer.Option(None, "--scheduler", help="standalone (default), slurm or none"),
    no_agent: bool = typer.Option(False, "--no-agent", help="Do not start a local agent."),
    secure: bool = typer.Option(False, "--secure", help="NATS with per-role credentials (STATE/creds)."),
    config: Optional[Path] = ConfigOpt,
) -> None:
    """Start NATS (JetStream), Temporal (SQLite, Web UI), worker, router and a local agent; Ctrl-C stops all."""
    from fleetmend.dev.devup import dev_up as run_dev_up

    s = _settings(config, state_dir=state_dir, nats_url=nats_url, temporal_address=temporal_address,
                  temporal_ui_port=ui_port, scheduler=scheduler)
    raise typer.Exit(_run(run_dev_up(s, agent=not no_agent, config=config, secure=secure)))


# ------------------------------------------------------------------ incidents
def _status_dict(st: Any) -> dict[str, Any]:
    from fleetmend.cli.lookup import status_dict

    return status_dict(st)


async def _incident(s: Settings, node: str) -> dict[str, Any]:
    """`node`'s incident in `s.cluster` (callers that know the cluster, e.g. `nodes`)."""
    from fleetmend.cli.lookup import find_incidents

    return (await find_incidents(s, node, s.cluster))[0]


async def _list_incidents(s: Settings, limit: int, cluster: str | None = "") -> list[dict[str, Any]]:
    """Recent incidents of `cluster` (default `s.cluster`; None: every cluster), newest first."""
    from fleetmend.infra.connect import connect_temporal

    client = await connect_temporal(s)
    rows = []
    cluster = s.cluster if cluster == "" else cluster
    query = "WorkflowType='NodeRemediation'" + (f" AND FleetCluster='{cluster}'" if cluster else "")
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
        from fleetmend.cli.permit_waits import annotate_waits

        for cl in sorted({r["cluster"] for r in rows if r["phase"] == "awaiting_permit" and r["cluster"]}):
            await annotate_waits(client, cl, [r for r in rows if r["cluster"] == cl])  # each cluster's guard
    return rows


async def _count_beyond(s: Settings, cluster: str | None) -> str:
    """"N incidents (D drained now, Q awaiting a permit)" of `cluster` (None: every cluster), or "" when
    the server cannot count (visibility without counts)."""
    from fleetmend.infra.connect import connect_temporal

    client = await connect_temporal(s)
    base = "WorkflowType='NodeRemediation'" + (f" AND FleetCluster='{cluster}'" if cluster else "")
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
    node: Optional[str] = typer.Argument(None, help="A node: its incident in detail, found in any cluster."),
    as_json: bool = typer.Option(False, "--json", help="An object (one node: its incident; a node with "
                                 "incidents in several clusters: an array of them), or an array of incidents."),
    limit: int = typer.Option(50, "--limit", help="Most recent incidents listed."),
    cluster: Optional[str] = typer.Option(None, "--cluster", help="Only this cluster (default: every cluster)."),
    config: Optional[Path] = ConfigOpt,
) -> None:
    """Open and recent incidents of every cluster (a table), or one node's incident wherever it is."""
    s = _settings(config, cluster=cluster)
    if node:
        from fleetmend.cli.lookup import find_incidents

        found = _run(find_incidents(s, node, cluster))
        if len(found) > 1:
            if as_json:
                sys.stdout.write(json.dumps(found, default=str, indent=2) + "\n")
                return
            t = Table(title=f"{node} has incidents in {len(found)} clusters; pick one with --cluster")
            for col in ("cluster", "phase", "outcome", "fault", "ticket", "opened", "workflow"):
                t.add_column(col, no_wrap=True)
            for d in found:
                t.add_row(escape(d["cluster"] or "?"), d["phase"] or "", d["outcome"] or "", d["fault_class"] or "",
                          d["ticket"] or "", _short_time(d["opened_at"]), escape(d["workflow_id"] or ""))
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
            t.add_row(_short_time(e["at"]), e["phase"], escape(e["text"]), escape(e.get("by") or ""))
        out.print(t)
        f = Table(title=f"faults (drained: {'yes' if d['drained'] else 'no'}, ticket: {d['ticket'] or '-'})")
        for col in ("fault", "device", "severity", "action", "×"):
            f.add_column(col, no_wrap=True)
        f.add_column("message")
        for x in d["faults"]:
            what = f"XID {x['code']}" if x["kind"] == "xid" else x["kind"] + (f" {x['code']}" if x["code"] else "")
            f.add_row(what, x.get("device") or "", "cleared" if x.get("healthy") else x["severity"],
                      x.get("immediate_action") or "", str(x.get("count", 1)), escape(x.get("message") or ""))
        out.print(f)
        for ref in d.get("runbooks", {}).values():
            out.print(f"runbook: {escape(ref)}")
        return
    rows = _run(_list_incidents(s, limit, cluster))
    if as_json:
        sys.stdout.write(json.dumps(rows, default=str, indent=2) + "\n")
        return
    from fleetmend.cli.security import deadletter_line

    where = f"cluster {cluster}" if cluster else "any cluster"
    if not rows:
        out.print(f"no incidents in {where}")
        out.print(escape(_run(deadletter_line(s))))
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
        if r["status"] not in ("running", "completed", "continued_as_new", None):
            phase = f"{phase} ({r['status']})"  # terminated / failed / timed out: say so
        elif r.get("waiting"):
            phase = f"{phase}: {r['waiting']}"  # why the drain permit waits (FleetGuard)
        t.add_row(escape(r["cluster"] or "?"), escape(r["node"] or "?"), phase, "yes" if r["drained"] else "no",
                  r["fault_class"] or "", r["severity"] or "", r["ticket"] or "", _short_time(r["started"])[:11])
    out.print(t)
    if len(rows) >= limit:  # a storm: say what the newest `limit` leave out (drained nodes scroll off first)
        more = _run(_count_beyond(s, cluster))
        if more:
            out.print(escape(f"showing the {limit} newest of {more}; `--limit N` lists more"))
    out.print(escape(_run(deadletter_line(s))))


def _short_time(iso: str | None) -> str:
    """`2026-11-29T17:20:24+00:00` → `11-29 17:20:24` (UTC), for narrow tables."""
    if not iso:
        return ""
    return iso[5:19].replace("T", " ")


async def _command(s: Settings, node: str, update: str, cmd: Any, cluster: str | None = None) -> dict[str, Any]:
    """Send `update` to `node`'s open incident: in `cluster`, else the one cluster where it has one open.

    Returns {command, node, cluster, workflow_id, by, result} (what `--json` prints).
    """
    from temporalio.client import WorkflowUpdateFailedError
    from temporalio.service import RPCError

    from fleetmend import subjects
    from fleetmend.cli.lookup import open_cluster
    from fleetmend.infra.connect import connect_temporal

    client = await connect_temporal(s)
    cl = cluster or await open_cluster(client, node, s.cluster)
    wid = subjects.workflow_id(cl, node)
    handle = client.get_workflow_handle(wid)
    try:
        result = await handle.execute_update(update, cmd, result_type=str)
    except WorkflowUpdateFailedError as e:
        raise FleetmendError(f"{node}: {e.cause.message if e.cause else e}") from e
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


JsonOpt = typer.Option(False, "--json", help="Print the result as one JSON object.")


@app.command()
def repaired(
    node: str,
    ticket: Optional[str] = typer.Option(None, "--ticket", help="The repair ticket id."),
    note: str = typer.Option("", "--note", help="What was done."),
    as_json: bool = JsonOpt,
    cluster: Optional[str] = ClusterOpt,
    config: Optional[Path] = ConfigOpt,
) -> None:
    """Mark NODE repaired: diagnostics re-run, and the node returns to service if they pass."""
    from fleetmend.messages import RemediationApi, RepairedCommand

    s = _settings(config, cluster=cluster)
    _done(_run(_command(s, node, RemediationApi.MARK_REPAIRED, RepairedCommand(by=_who(), ticket=ticket, note=note),
                        cluster)), as_json)


@app.command()
def retest(node: str, as_json: bool = JsonOpt, cluster: Optional[str] = ClusterOpt,
           config: Optional[Path] = ConfigOpt) -> None:
    """Force NODE's verification diagnostics to run now."""
    from fleetmend.messages import RemediationApi, RetestCommand

    s = _settings(config, cluster=cluster)
    _done(_run(_command(s, node, RemediationApi.FORCE_RETEST, RetestCommand(by=_who()), cluster)), as_json)


@app.command()
def abort(
    node: str,
    note: str = typer.Option("", "--note", help="Why."),
    undrain: bool = typer.Option(False, "--undrain", help="Also undrain the node if fleetmend drained it."),
    as_json: bool = JsonOpt,
    cluster: Optional[str] = ClusterOpt,
    config: Optional[Path] = ConfigOpt,
) -> None:
    """Close NODE's incident now (automation stops; the drain stays unless --undrain)."""
    from fleetmend.messages import AbortCommand, RemediationApi

    s = _settings(config, cluster=cluster)
    _done(_run(_command(s, node, RemediationApi.ABORT, AbortCommand(by=_who(), note=note, undrain=undrain),
                        cluster)), as_json)


@app.command()
def tickets(as_json: bool = typer.Option(False, "--json"), config: Optional[Path] = ConfigOpt) -> None:
    """Tickets in the deployment's ticket ledger (the JetStream KV bucket every worker shares; with
    tickets.ledger = files, the JSON files under state_dir/tickets)."""
    s = _settings(config)
    items, where = _run(_read_tickets(s))
    if as_json:
        sys.stdout.write(json.dumps(items, default=str, indent=2) + "\n")
        return
    if not items:
        out.print(f"no tickets in {where}")
        return
    t = Table(title=f"tickets ({where})")
    for col in ("ticket", "node", "status", "severity", "fault", "title"):
        t.add_column(col)
    for it in items:
        t.add_row(*(escape(str(it.get(k))) for k in ("ticket_id", "node", "status", "severity", "fault_class",
                                                      "title")))
    out.print(t)


async def _read_tickets(s: Settings) -> tuple[list[dict[str, Any]], str]:
    if s.tickets.ledger == "files":
        from activities.ticket_store import LocalTicketStore

        store = LocalTicketStore(s.state_dir / "tickets")
        return await store.list_all(), str(store.directory)
    from activities.ticket_kv import KvTicketStore
    from fleetmend.infra.connect import connect_nats

    nc = await connect_nats(s, name="fleetmend-cli")
    try:
        kv = KvTicketStore(nc.jetstream())
        return await kv.list_all(), kv.directory
    finally:
        await nc.close()


@app.command()
def deadletters(
    limit: int = typer.Option(20, "--limit"),
    as_json: bool = typer.Option(False, "--json"),
    config: Optional[Path] = ConfigOpt,
) -> None:
    """Dead-lettered messages (never valid, or never accepted) with their reasons."""
    s = _settings(config)
    rows = _run(_read_deadletters(s, limit))
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return
    if not rows:
        out.print("no dead-lettered messages")
        return
    t = Table(title=f"dead letters (last {len(rows)})")
    for col in ("at", "subject", "reason", "bytes"):
        t.add_column(col)
    for r in rows:
        t.add_row(r.get("at", ""), escape(r.get("subject", "")), escape(r.get("reason", "")),
                  str(r.get("data_bytes", "")))
    out.print(t)


async def _read_deadletters(s: Settings, limit: int) -> list[dict[str, Any]]:
    from nats.js.errors import NotFoundError

    from fleetmend import subjects
    from fleetmend.infra.connect import connect_nats

    nc = await connect_nats(s, name="fleetmend-cli")
    try:
        js = nc.jetstream()
        try:
            info = await js.stream_info(subjects.DEADLETTER_STREAM)
        except NotFoundError:
            return []
        rows: list[dict[str, Any]] = []
        if not info.state.messages:  # fresh install, or every record aged out
            return rows
        last = info.state.last_seq
        first = max(info.state.first_seq, last - limit + 1, 1)
        for seq in range(first, last + 1):
            try:
                m = await js.get_msg(subjects.DEADLETTER_STREAM, seq)
                rec = json.loads(m.data)
            except (NotFoundError, ValueError):
                continue  # removed by age or limits since the stream_info; or not a record of ours
            rows.append(rec if isinstance(rec, dict) else {"reason": "unreadable record", "at": ""})
        return rows
    finally:
        await nc.close()


@config_app.command("check")
def config_check(config: Optional[Path] = ConfigOpt) -> None:
    """Validate the configuration and print every error at once."""
    import difflib

    s = _settings(config)
    from fleetmend.config import redacted

    out.print_json(json.dumps(redacted(s)))
    known = set(Settings.model_fields) | {"config"}
    for var in sorted(v for v in os.environ if v.startswith("FLEETMEND_")):
        name = var[len("FLEETMEND_"):].lower().split("__")[0]
        if name not in known:
            near = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean FLEETMEND_{near[0].upper()}?" if near else ""
            err.print(f"[yellow]warning:[/yellow] {var} is not a fleetmend setting and is ignored{hint}")
    out.print("[green]configuration valid[/green]")




# Commands of other areas live in their own modules and register here, one line each
# (`def register(app: typer.Typer) -> None` in the module).
def _register_extensions() -> None:
    import importlib

    for name in _EXTENSIONS:
        importlib.import_module(f"fleetmend.cli.{name}").register(app)


_EXTENSIONS: list[str] = ["sim", "ops", "security", "policy", "explain", "permits", "analyzer", "sweep", "incidents", "runbook"]
_register_extensions()


def main() -> None:
    """Entry point. Exits with `os._exit` after flushing: temporalio's Rust runtime threads can abort
    the interpreter during finalization ("PyGILState_Release ... finalizing", exit -6) after a command
    already finished, which would turn a successful command into a crash for scripts."""
    code: int = 0
    try:
        app()
    except SystemExit as e:
        if isinstance(e.code, int):
            code = e.code
        elif e.code is not None:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        code = 130
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":  # pragma: no cover
    main()
