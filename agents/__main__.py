"""`python -m agents`: the node agent without the CLI's extra imports (also used by tests that
run the agent as a subprocess to kill -9 it). `fleetmend agent` is the documented entry point."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from agents.runner import run_agent
from fleetmend.config import load_settings
from fleetmend.errors import ConfigError
from fleetmend.logs import configure_logging


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agents", description=__doc__)
    ap.add_argument("--config", "-c", type=Path, help="TOML config file (FLEETMEND_CONFIG)")
    ap.add_argument("--node")
    ap.add_argument("--cluster")
    ap.add_argument("--kmsg-file", type=Path, help="replay a captured kernel log instead of /dev/kmsg")
    ap.add_argument("--inject-file", type=Path, help="also replay a JSON-lines file of FaultEvents")
    ap.add_argument("--no-kmsg", action="store_true", help="leave the kmsg probe out")
    ap.add_argument("--once", action="store_true", help="exit when the probes are done")
    ap.add_argument("--hardware", action=argparse.BooleanOptionalAction, default=None,
                    help="run the nvml/sysfs/udev probes (default: only when live, i.e. no --once and no file)")
    args = ap.parse_args(argv)
    try:
        settings = load_settings(args.config, node=args.node, cluster=args.cluster)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    configure_logging(settings.log_format)
    return asyncio.run(run_agent(settings, kmsg_file=args.kmsg_file, once=args.once,
                                 inject_file=args.inject_file, kmsg=not args.no_kmsg,
                                 hardware=args.hardware))


if __name__ == "__main__":
    sys.exit(main())
