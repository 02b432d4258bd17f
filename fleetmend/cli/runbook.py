"""`fleetmend runbook CLASS`: the runbook of a fault class (generated from the catalog,
`fleetmend.catalog.runbooks`; the same text as docs/runbooks/CLASS.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from fleetmend.catalog import load_catalog
from fleetmend.catalog.runbooks import fault_classes, render
from fleetmend.cli.common import ConfigOpt, err, out, settings

app = typer.Typer()
"""`fleetmend runbook` (top-level: added to the root app without a group name)."""


@app.command("runbook")
def runbook(
    fault_class: Optional[str] = typer.Argument(None, help="A fault class: xid79, gpu_fallen_off_bus, …"),
    list_all: bool = typer.Option(False, "--list", help="List the fault classes that have a runbook."),
    as_json: bool = typer.Option(False, "--json", help="{fault_class, markdown} (with --list: an array)."),
    config: Optional[Path] = ConfigOpt,
) -> None:
    """What a fault class means, what fleetmend does about it and what a human checks."""
    s = settings(config)
    catalog = load_catalog(s.catalog_overrides)
    if list_all or not fault_class:
        classes = list(fault_classes(catalog))
        if as_json:
            sys.stdout.write(json.dumps(classes) + "\n")
        else:
            out.print("\n".join(classes), markup=False, highlight=False)
        return
    # as an operator types it: XID79, "xid 79", 79 (what `fleetmend explain` prints is "XID 79")
    fault_class = "".join(fault_class.split()).lower()
    if fault_class.isdigit():
        fault_class = f"xid{fault_class}"
    try:
        text = render(fault_class, catalog)
    except KeyError as e:
        err.print(f"[red]error:[/red] {escape(str(e.args[0]))}")
        raise typer.Exit(1) from e
    if as_json:
        sys.stdout.write(json.dumps({"fault_class": fault_class, "markdown": text}) + "\n")
    else:
        sys.stdout.write(text)
