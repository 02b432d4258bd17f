"""The `fleetmend` command line: the one Typer app, every command group added here.

| module | commands |
|---|---|
| `fleetmend.cli.processes` | `agent`, `router`, `worker`, `analyzer`, `dev up` |
| `fleetmend.cli.incidents` | `status`, `show`, `history`, `nodes`, `repaired`, `retest`, `abort` |
| `fleetmend.cli.breaker` | `breaker status / reset / release`, `pause`, `resume` |
| `fleetmend.cli.inject` | `inject` |
| `fleetmend.cli.ledger` | `tickets`, `deadletters` |
| `fleetmend.cli.explain` | `explain` |
| `fleetmend.cli.runbook` | `runbook` |
| `fleetmend.cli.sweep` | `sweep` |
| `fleetmend.cli.sim` | `sim` |
| `fleetmend.cli.config` | `config check` |
| `fleetmend.cli.temporal` | `temporal setup` |
| `fleetmend.cli.creds` | `creds generate` |
| `fleetmend.cli.inventory` | `inventory`, `versions` |
| `fleetmend.cli.drift` | `drift`, `drift allow` |
| `fleetmend.cli.report` | `report` |

Each module holds a module-level `app = typer.Typer()` of plain decorated functions; a group's is added
under its name, the top-level commands' without one. Shared options and helpers: `fleetmend.cli.common`.
The console script is `fleetmend.cli.entry:main` (the lean agent path first, then `main` here).
"""

from __future__ import annotations

import os
import sys
from importlib.metadata import PackageNotFoundError, version

import typer

from fleetmend.cli import (
    breaker,
    config,
    creds,
    drift,
    explain,
    incidents,
    inject,
    inventory,
    ledger,
    processes,
    report,
    runbook,
    sim,
    sweep,
    temporal,
)
from fleetmend.cli.common import run_and_exit
from fleetmend.infra.logs import configure_logging

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

# top-level commands, in the order `fleetmend --help` lists them
app.add_typer(processes.app)
app.add_typer(incidents.app)
app.add_typer(inject.app)
app.add_typer(breaker.commands)
app.add_typer(ledger.app)
app.add_typer(explain.app)
app.add_typer(runbook.app)
app.add_typer(sweep.app)
app.add_typer(sim.app)
app.add_typer(inventory.app)
app.add_typer(report.app)
# command groups
app.add_typer(processes.dev_app, name="dev")
app.add_typer(config.app, name="config")
app.add_typer(temporal.app, name="temporal")
app.add_typer(creds.app, name="creds")
app.add_typer(breaker.app, name="breaker")
app.add_typer(drift.app, name="drift")


def _version(value: bool) -> None:
    if value:
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
    fmt = os.environ.get("FLEETMEND_LOG_FORMAT", "auto")
    try:
        configure_logging(fmt, level="warning")
    except ValueError as e:  # a bad FLEETMEND_LOG_FORMAT: a configuration error, for every command alike
        sys.stderr.write(f"invalid configuration: FLEETMEND_LOG_FORMAT: {e}\n")
        raise typer.Exit(2) from None


def main() -> None:
    """Run the app (`fleetmend.cli.common.run_and_exit`: exits with `os._exit` after flushing)."""
    run_and_exit(app)
