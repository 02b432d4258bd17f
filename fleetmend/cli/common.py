"""What every command module of the CLI shares: options, settings loading, `run`, `who`, output.

Every command reads FLEETMEND_NATS_URL, FLEETMEND_TEMPORAL_ADDRESS, FLEETMEND_TEMPORAL_UI_PORT and
FLEETMEND_STATE_DIR (and the rest of `fleetmend.config.Settings`); flags override them.

Lazy imports: the command modules import temporalio, nats, `fleetmend.messages` (temporalio.common) and
the adapters (`activities.*`) inside the commands that talk to a server. Together they take about 0.7 s
to import, which `fleetmend --help`, `explain`, `runbook` and `config check` would otherwise pay on every
start. Everything else is imported at the top of each module.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import os
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, Optional, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from fleetmend.config import Settings, load_settings
from fleetmend.errors import ConfigError, FleetmendError
from fleetmend.infra.logs import configure_logging
from fleetmend.infra.process import stop_on_signals

T = TypeVar("T")

# Piped output (| less, | grep) gets a wide console instead of rich's 80-column default.
out = Console(width=None if sys.stdout.isatty() else 160)
# Errors are never wrapped: one error is one line, whatever its length (grep, log collectors).
err = Console(stderr=True, width=None if sys.stderr.isatty() else 160, soft_wrap=True)

ConfigOpt = typer.Option(None, "--config", "-c", envvar="FLEETMEND_CONFIG", help="TOML config file.")
ClusterOpt = typer.Option(None, "--cluster", help="Cluster name (FLEETMEND_CLUSTER).")
MetricsPortOpt = typer.Option(None, "--metrics-port", help="Serve Prometheus /metrics here (0: off; "
                                                         "FLEETMEND_METRICS__<PROCESS>_PORT).")
JsonOpt = typer.Option(False, "--json", help="Print the result as one JSON object.")


def node_name(value: Optional[str]) -> Optional[str]:
    """Typer callback for a NODE argument or `--node`: the name `fleetmend.subjects.check_node_name`
    accepts, else a usage error (exit 2) that says why, before any server is asked."""
    from fleetmend.subjects import check_node_name

    if value is None:
        return None
    try:
        return check_node_name(value)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e


MAX_NOTE_CHARS = 2000
"""The longest `--note` (and `--why`) an operator command takes: it lands in the incident's history."""
MAX_TICKET_CHARS = 128
"""The longest `--ticket` id (and `--who`)."""
_BIDI = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def check_free_text(value: str, max_chars: int) -> str:
    """`value` when it is one line of at most `max_chars` characters without control characters (newlines, tabs,
    ESC and so terminal escape sequences, C1 controls, bidirectional overrides): what an operator types into a
    note or a ticket id is shown raw in every other operator's `status`. Raises ValueError saying why."""
    import unicodedata

    for i, c in enumerate(value):
        if unicodedata.category(c) == "Cc" or c in _BIDI:
            raise ValueError(f"holds a control character ({c!r} at position {i + 1}); write it on one line, "
                             "without tabs or escape sequences")
    if len(value) > max_chars:
        raise ValueError(f"{len(value)} characters; at most {max_chars}")
    return value


def free_text(max_chars: int = MAX_NOTE_CHARS) -> Callable[[Optional[str]], Optional[str]]:
    """Typer callback for a free-text option (`--note`, `--ticket`): `check_free_text`, else a usage error
    (exit 2) that says why, before any server is asked."""

    def callback(value: Optional[str]) -> Optional[str]:
        if value is None:
            return None
        try:
            return check_free_text(value, max_chars)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from e

    return callback


def settings(config: Optional[Path] = None, **overrides: Any) -> Settings:
    """`load_settings(config, **overrides)`; a configuration error is printed and exits 2."""
    try:
        return load_settings(config, **overrides)
    except ConfigError as e:
        err.print(f"[red]{escape(str(e))}[/red]")
        raise typer.Exit(2) from e


def run(coro: Coroutine[Any, Any, T], reraise: tuple[type[BaseException], ...] = ()) -> T:
    """`asyncio.run(coro)`; a `FleetmendError` is printed and exits 1 (one of `reraise` is raised for the
    caller to answer instead)."""
    try:
        return asyncio.run(coro)
    except reraise:
        raise
    except FleetmendError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}")
        raise typer.Exit(1) from e


def who() -> str:
    """`user@host`: who sent a command, for the workflows' audit trail."""
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no passwd entry in some containers
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


async def serve(main: Callable[[Settings, asyncio.Event], Awaitable[None]], settings: Settings) -> None:
    """Run a long-running process `main(settings, stop)`; SIGTERM/SIGINT set `stop`, a second SIGINT
    forces exit. Logs at the process's own level and format (`settings.log_format`)."""
    configure_logging(settings.log_format)
    await main(settings, stop_on_signals())


def refusal(e: Any) -> str:
    """What a workflow said when it refused an update: the message of a `WorkflowUpdateFailedError`'s
    cause (the validator's or handler's `ApplicationError`), else the error itself."""
    cause = e.cause
    return str(getattr(cause, "message", cause)) if cause else str(e)


@contextlib.asynccontextmanager
async def scheduler_adapter(s: Settings) -> AsyncIterator[Any]:
    """The cluster's scheduler adapter (`activities.scheduler.build_scheduler`) for a command, with the NATS
    connection the standalone scheduler keeps its drains in (closed on exit)."""
    from activities.scheduler import build_scheduler  # lazy: the adapters' libraries
    from fleetmend.infra.connect import close_nats, connect_nats

    nc = await connect_nats(s, name="fleetmend-cli") if s.scheduler.value == "standalone" else None
    try:
        yield build_scheduler(s, js=nc.jetstream() if nc is not None else None)
    finally:
        if nc is not None:
            await close_nats(nc)


def short_time(iso: str | None) -> str:
    """`2026-11-29T17:20:24+00:00` → `11-29 17:20:24` (UTC), for narrow tables."""
    if not iso:
        return ""
    return iso[5:19].replace("T", " ")


def run_and_exit(run: Callable[[], Any]) -> None:
    """Run a command line (`run`: a Typer app or a click command's `main`) and exit with its status by
    `os._exit` after flushing: temporalio's Rust runtime threads can abort the interpreter during
    finalization ("PyGILState_Release ... finalizing", exit -6) after a command already finished, which would
    turn a successful command into a crash for scripts. Ctrl-C exits 130."""
    code: int = 0
    try:
        run()
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
