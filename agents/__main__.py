"""`python -m agents`: the node agent without the CLI's extra imports (also used by tests that
run the agent as a subprocess to kill -9 it). `fleetmend agent` is the documented entry point and
comes here directly (fleetmend/cli/entry.py), without typer, rich or temporalio.

Memory (bench/agent_memory.py): nats-py imports aiohttp for its websocket transport whenever aiohttp
is installed, and structlog imports rich for pretty tracebacks whenever rich is installed; together
~15 MiB of RSS on every node for code the agent never runs. `lean_imports()` keeps both out of the
agent's process (aiohttp only when no `ws://`/`wss://` NATS URL is configured).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from fleetmend.config import load_settings
from fleetmend.errors import CatalogError, ConfigError


def lean_imports(nats_url: str) -> None:
    """Make `import aiohttp` (unless a websocket URL is configured) and `import rich` fail in this
    process, before nats and structlog are imported: both libraries treat them as optional."""
    if not any(u.strip().startswith(("ws://", "wss://")) for u in nats_url.split(",")):
        sys.modules.setdefault("aiohttp", None)  # type: ignore[arg-type]
    sys.modules.setdefault("rich", None)  # type: ignore[arg-type]


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (0-65535)")
    return port


def main(argv: list[str] | None = None, prog: str = "python -m agents", lean: bool = True) -> int:
    """Run the agent; `lean=False` when called inside another program (no import blocking)."""
    ap = argparse.ArgumentParser(prog=prog, description="Node agent: probes → JetStream (spooling to disk "
                                 "while NATS is away), heartbeats, diagnostics and recovery requests.")
    ap.add_argument("--config", "-c", type=Path, help="TOML config file (FLEETMEND_CONFIG)")
    ap.add_argument("--node", help="this node's name (default: host name; FLEETMEND_NODE)")
    ap.add_argument("--cluster", help="cluster name (FLEETMEND_CLUSTER)")
    ap.add_argument("--kmsg-file", type=Path, help="replay a captured kernel log instead of /dev/kmsg")
    ap.add_argument("--inject-file", type=Path, help="also replay a JSON-lines file of FaultEvents")
    ap.add_argument("--no-kmsg", action="store_true", help="leave the kmsg probe out")
    ap.add_argument("--once", action="store_true", help="exit when the probes are done")
    ap.add_argument("--hardware", action=argparse.BooleanOptionalAction, default=None,
                    help="run the nvml/sysfs/udev probes (default: only when live, i.e. no --once and no file)")
    ap.add_argument("--metrics-port", type=_port, help="serve /metrics on this port (0: off)")
    args = ap.parse_args(argv)
    for flag, path in (("--kmsg-file", args.kmsg_file), ("--inject-file", args.inject_file)):
        if path is not None and not path.is_file():
            print(f"{flag} {path}: {'a directory, not a file' if path.is_dir() else 'no such file'}",
                  file=sys.stderr)
            return 2
    try:
        settings = load_settings(args.config, node=args.node, cluster=args.cluster)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    if args.metrics_port is not None:
        settings.metrics.agent_port = args.metrics_port
    if lean:
        lean_imports(settings.nats_url)
    # imported after lean_imports(): these pull in nats and structlog, which must not find aiohttp or rich
    from agents.runner import run_agent
    from fleetmend.infra.connect import nats_auth_options
    from fleetmend.infra.logs import configure_logging

    try:  # the seed, creds and TLS files, read now: a missing one is one line, not a TaskGroup traceback
        nats_auth_options(settings)
    except ConfigError as err:
        print(f"fleetmend agent: {err}", file=sys.stderr)
        return 2

    configure_logging(settings.log_format)
    try:
        return asyncio.run(run_agent(settings, kmsg_file=args.kmsg_file, once=args.once,
                                     inject_file=args.inject_file, kmsg=not args.no_kmsg,
                                     hardware=args.hardware))
    except CatalogError as err:  # the operator's catalog_overrides: a configuration error, one line
        print(f"fleetmend agent: invalid catalog_overrides: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # metrics port taken, state dir not writable: say so, no traceback
        print(f"fleetmend agent: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
