"""The `fleetmend` console script.

`fleetmend agent ...` runs on every node of the fleet, so it goes straight to the lean agent entry
(`agents.__main__`: no typer, rich or temporalio in the process; bench/agent_memory.py shows what
that saves). `fleetmend explain ...` (a health check, run on logs of any size) goes to an app of that one
command (`fleetmend.cli.explain.explain_main`). Every other command goes to the typer application in
`fleetmend.cli.app`.
"""

from __future__ import annotations

import sys


def main() -> None:
    argv = sys.argv[1:]
    # Both imports are lazy on purpose: importing the app would load typer and rich into every
    # node's agent, and the agent entry is not needed by any other command.
    if argv[:1] == ["agent"]:
        from agents.__main__ import main as agent_main

        sys.exit(agent_main(argv[1:], prog="fleetmend agent"))
    if argv[:1] == ["explain"]:
        # `explain` needs no server: its own small app skips the imports of every other command (nats-py,
        # aiohttp, temporalio, the Kubernetes client), half of its start-up (bench/explain_stream.py).
        from fleetmend.cli.explain import explain_main

        explain_main(argv[1:])
    from fleetmend.cli.app import main as cli_main

    cli_main()


if __name__ == "__main__":  # pragma: no cover
    main()
