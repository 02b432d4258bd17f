"""Operator commands: `fleetmend temporal setup`, `fleetmend nodes`, `fleetmend show NODE`.

Registered by `fleetmend/cli/main.py` (`_EXTENSIONS`). Every command takes `--json`; unreachable
servers produce `ServiceUnavailableError` messages naming the address and the setting to check.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from fleetmend.config import Settings
from fleetmend.errors import FleetmendError
from fleetmend.dev.servers import SEARCH_ATTRIBUTES


async def setup_search_attributes(client: Any, namespace: str) -> dict[str, str]:
    """Register `fleetmend.dev.servers.SEARCH_ATTRIBUTES` on the namespace (operator service); idempotent.

    Args:
        client: a connected `temporalio.client.Client`.
        namespace: the namespace to register them in.
    Returns:
        name → "added" or "present".
    Raises:
        FleetmendError: an attribute exists with another type (Temporal cannot change a type; rename
            or remove it with `temporal operator search-attribute remove`).
    """
    from temporalio.api.enums.v1 import IndexedValueType
    from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesRequest

    def enum(t: str) -> int:
        return IndexedValueType.Value(f"INDEXED_VALUE_TYPE_{t.upper()}")

    existing = await client.operator_service.list_search_attributes(
        ListSearchAttributesRequest(namespace=namespace))
    custom = dict(existing.custom_attributes)
    wrong = {n: IndexedValueType.Name(custom[n]) for n, t in SEARCH_ATTRIBUTES.items()
             if n in custom and custom[n] != enum(t)}
    if wrong:
        raise FleetmendError(f"search attributes with another type in namespace {namespace}: {wrong}; expected "
                             f"{ {n: SEARCH_ATTRIBUTES[n] for n in wrong} } (remove them first)")
    missing = {n: enum(t) for n, t in SEARCH_ATTRIBUTES.items() if n not in custom}
    if missing:
        await client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(namespace=namespace, search_attributes=missing))
    return {n: "added" if n in missing else "present" for n in SEARCH_ATTRIBUTES}


async def _temporal_setup(s: Settings) -> dict[str, Any]:
    from fleetmend.infra.connect import connect_temporal

    from fleetmend.dev.servers import ensure_retention

    client = await connect_temporal(s)
    attrs = await setup_search_attributes(client, s.temporal_namespace)
    before, now = await ensure_retention(client, s.temporal_namespace, s.temporal_retention_days)
    return {"search_attributes": attrs, "retention_days": now, "retention_days_before": before}


async def _nodes(s: Settings, with_incidents: bool) -> tuple[list[dict[str, Any]], str | None]:
    """Scheduler rows joined with open incidents. Returns (rows, warning or None)."""
    from dataclasses import asdict

    from activities.scheduler import build_scheduler

    nc = None
    try:
        js = None
        if s.scheduler.value == "standalone":
            from fleetmend.infra.connect import connect_nats

            nc = await connect_nats(s, name="fleetmend-cli")
            js = nc.jetstream()
        sched = build_scheduler(s, js=js)
        rows = [asdict(r) for r in await sched.list_nodes()]  # type: ignore[attr-defined]
    finally:
        if nc is not None:
            await nc.close()
    warning = None
    if with_incidents:
        from fleetmend.cli.main import _list_incidents

        try:
            incidents = {i["node"]: i for i in await _list_incidents(s, 1000) if i["status"] == "running"}
        except FleetmendError as err:
            incidents, warning = {}, f"incidents not shown: {err}"
        seen = set()
        for r in rows:
            inc = incidents.get(r["name"])
            seen.add(r["name"])
            r["phase"] = inc["phase"] if inc else None
            r["incident_id"] = r.get("incident_id") or (inc["workflow_id"] if inc else None)
        for node, inc in sorted(incidents.items()):
            if node not in seen:  # an open incident on a node the scheduler lists as in service
                rows.append({"name": node, "state": "in_service", "reason": "", "owner": None,
                             "incident_id": inc["workflow_id"], "phase": inc["phase"]})
    return rows, warning


def register(app: typer.Typer) -> None:
    from fleetmend.cli.main import ClusterOpt, ConfigOpt, _run, _settings, err, out, status

    temporal_app = typer.Typer(no_args_is_help=True, help="Temporal cluster setup.")
    app.add_typer(temporal_app, name="temporal")

    @temporal_app.command("setup")
    def temporal_setup(
        as_json: bool = typer.Option(False, "--json"),
        namespace: Optional[str] = typer.Option(None, "--namespace", help="FLEETMEND_TEMPORAL_NAMESPACE"),
        address: Optional[str] = typer.Option(None, "--address", help="FLEETMEND_TEMPORAL_ADDRESS"),
        config: Optional[Path] = ConfigOpt,
    ) -> None:
        """Register fleetmend's search attributes (FleetNode, FleetPhase, …) on a Temporal cluster and set the
        namespace retention (temporal_retention_days, 90 by default); idempotent."""
        s = _settings(config, temporal_namespace=namespace, temporal_address=address)
        result = _run(_temporal_setup(s))
        if as_json:
            sys.stdout.write(json.dumps(result, indent=2) + "\n")
            return
        t = Table(title=f"search attributes in {s.temporal_address} namespace {s.temporal_namespace}")
        for col in ("name", "type", ""):
            t.add_column(col)
        for name, what in result["search_attributes"].items():
            t.add_row(name, SEARCH_ATTRIBUTES[name], what)
        out.print(t)
        was = result["retention_days_before"]
        out.print(f"closed incidents kept {result['retention_days']:g} days (temporal_retention_days)"
                  + (f"; was {was:g}" if was != result["retention_days"] else ""))

    @app.command("nodes")
    def nodes(
        as_json: bool = typer.Option(False, "--json"),
        incidents: bool = typer.Option(True, "--incidents/--no-incidents",
                                       help="Join open incidents from Temporal (phase)."),
        cluster: Optional[str] = ClusterOpt,
        config: Optional[Path] = ConfigOpt,
    ) -> None:
        """Nodes as the scheduler sees them: state, who drained them (fleetmend or an operator), incident."""
        s = _settings(config, cluster=cluster)
        rows, warning = _run(_nodes(s, incidents))
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

    @app.command("show")
    def show(
        node: str = typer.Argument(..., help="The node."),
        as_json: bool = typer.Option(False, "--json"),
        cluster: Optional[str] = ClusterOpt,
        config: Optional[Path] = ConfigOpt,
    ) -> None:
        """NODE's incident timeline (phases, drains, diagnostics, tickets) and its faults."""
        status(node=node, as_json=as_json, limit=1, cluster=cluster, config=config)
