"""`fleetmend temporal setup`: register fleetmend's search attributes on a Temporal cluster and set the
namespace's retention of closed incidents."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from fleetmend.cli.common import ConfigOpt, out, run, settings
from fleetmend.config import Settings
from fleetmend.dev.servers import SEARCH_ATTRIBUTES, ensure_retention
from fleetmend.errors import FleetmendError
from fleetmend.infra.connect import connect_temporal

app = typer.Typer(no_args_is_help=True, help="Temporal cluster setup.")
"""`fleetmend temporal ...`."""


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
    # lazy: temporalio (see fleetmend.cli.common)
    from temporalio.api.enums.v1 import IndexedValueType
    from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesRequest

    def enum(t: str) -> IndexedValueType.ValueType:
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
    client = await connect_temporal(s)
    attrs = await setup_search_attributes(client, s.temporal_namespace)
    before, now = await ensure_retention(client, s.temporal_namespace, s.temporal_retention_days)
    return {"search_attributes": attrs, "retention_days": now, "retention_days_before": before}


@app.command("setup")
def temporal_setup(
    as_json: bool = typer.Option(False, "--json"),
    namespace: Optional[str] = typer.Option(None, "--namespace", help="FLEETMEND_TEMPORAL_NAMESPACE"),
    address: Optional[str] = typer.Option(None, "--address", help="FLEETMEND_TEMPORAL_ADDRESS"),
    config: Optional[Path] = ConfigOpt,
) -> None:
    """Register fleetmend's search attributes (FleetNode, FleetPhase, …) on a Temporal cluster and set the
    namespace retention (temporal_retention_days, 90 by default); idempotent."""
    s = settings(config, temporal_namespace=namespace, temporal_address=address)
    result = run(_temporal_setup(s))
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
