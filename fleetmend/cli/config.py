"""`fleetmend config check`: validate the configuration and print every error at once."""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from fleetmend.catalog import load_catalog
from fleetmend.cli.common import ConfigOpt, err, out, settings
from fleetmend.config import Settings, redacted
from fleetmend.errors import CatalogError

app = typer.Typer(no_args_is_help=True, help="Configuration.")
"""`fleetmend config ...`."""


@app.command("check")
def config_check(config: Optional[Path] = ConfigOpt) -> None:
    """Validate the configuration (and the operator's catalog overrides) and print every error at once."""
    s = settings(config)
    try:  # the overrides are read by every process at start: a bad row must fail here, not there
        load_catalog(s.catalog_overrides)
    except (CatalogError, OSError) as e:
        err.print(f"[red]invalid catalog_overrides ({s.catalog_overrides}): {escape(str(e))}[/red]")
        raise typer.Exit(2) from e
    out.print_json(json.dumps(redacted(s)))
    known = set(Settings.model_fields) | {"config"}
    for var in sorted(v for v in os.environ if v.startswith("FLEETMEND_")):
        name = var[len("FLEETMEND_"):].lower().split("__")[0]
        if name not in known:
            near = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean FLEETMEND_{near[0].upper()}?" if near else ""
            err.print(f"[yellow]warning:[/yellow] {var} is not a fleetmend setting and is ignored{hint}")
    out.print("[green]configuration valid[/green]")
