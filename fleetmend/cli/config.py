"""`fleetmend config check`: validate the configuration and print every error at once."""

from __future__ import annotations

import difflib
import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from fleetmend.catalog import load_catalog
from fleetmend.cli.common import ConfigOpt, JsonOpt, err, out, settings
from fleetmend.config import Settings, redacted, state_dir_problem
from fleetmend.errors import CatalogError, ConfigError

app = typer.Typer(no_args_is_help=True, help="Configuration.")
"""`fleetmend config ...`."""


@app.command("check")
def config_check(config: Optional[Path] = ConfigOpt, as_json: bool = JsonOpt) -> None:
    """Validate the configuration (and the operator's catalog overrides) and print every error at once.

    stdout holds the effective settings as JSON (secrets redacted) and nothing else, so
    `fleetmend config check | jq` works; warnings and the verdict go to stderr (none with --json)."""
    s = settings(config)
    try:  # the overrides are read by every process at start: a bad row must fail here, not there
        load_catalog(s.catalog_overrides)
    except (CatalogError, OSError) as e:
        err.print(f"[red]invalid catalog_overrides ({s.catalog_overrides}): {escape(str(e))}[/red]")
        raise typer.Exit(2) from e
    from fleetmend.infra.connect import nats_auth_options, temporal_tls_config

    try:  # the files every process opens at connect: a missing seed must fail here, not kill the agent later
        nats_auth_options(s)
        temporal_tls_config(s.temporal_tls)
        for what, f in (("nats_nkey_seed", s.nats_nkey_seed), ("nats_creds", s.nats_creds)):
            try:
                if f is not None:
                    Path(f).read_bytes()
            except OSError as e:
                raise ConfigError(f"{what} {f}: {e.strerror or e}; check the file path and permissions") from e
    except ConfigError as e:
        err.print(f"[red]{escape(str(e))}[/red]")
        raise typer.Exit(2) from e
    problem = state_dir_problem(s.state_dir)
    if problem is not None:
        err.print(f"[red]invalid configuration: {escape(problem)}[/red]")
        raise typer.Exit(2)
    if as_json:
        sys.stdout.write(json.dumps(redacted(s), indent=2) + "\n")
    else:
        out.print_json(json.dumps(redacted(s)))
    known = set(Settings.model_fields) | {"config"}
    for var in sorted(v for v in os.environ if v.startswith("FLEETMEND_")):
        name = var[len("FLEETMEND_"):].lower().split("__")[0]
        if name not in known:
            near = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean FLEETMEND_{near[0].upper()}?" if near else ""
            err.print(f"[yellow]warning:[/yellow] {var} is not a fleetmend setting and is ignored{hint}")
    if not as_json:
        err.print("[green]configuration valid[/green]")
