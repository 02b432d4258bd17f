"""`fleetmend creds generate`: per-node NATS nkeys and the server's accounts block (fleetmend.infra.security)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

out = Console()
err = Console(stderr=True)

creds_app = typer.Typer(no_args_is_help=True, help="NATS credentials: one nkey per node and service.")


@creds_app.command("generate")
def generate(
    out_dir: Path = typer.Option(..., "--out", help="Directory for seeds and accounts.conf (created)."),
    cluster: str = typer.Option(..., "--cluster", help="Cluster name."),
    nodes: Optional[str] = typer.Option(None, "--nodes", help="Comma-separated node names."),
    nodes_file: Optional[Path] = typer.Option(None, "--nodes-file", exists=True, dir_okay=False,
                                              help="File with one node name a line."),
    as_json: bool = typer.Option(False, "--json", help="Print what was written as one JSON object."),
) -> None:
    """Write an nkey seed per node (publish only its own fault/heartbeat subjects, answer only its own
    diagnostics) plus router, worker and admin seeds, and `accounts.conf` for nats-server. Existing
    seeds are kept, so adding nodes never rotates the others."""
    from fleetmend.errors import ConfigError
    from fleetmend.infra.security import generate as gen

    names = [n.strip() for n in (nodes or "").split(",") if n.strip()]
    if nodes_file:
        names += [ln.strip() for ln in nodes_file.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    if not names:
        err.print("[red]error:[/red] no nodes: pass --nodes n1,n2 or --nodes-file FILE")
        raise typer.Exit(2)
    try:
        cs = gen(out_dir, cluster, sorted(set(names)))
    except ConfigError as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from e
    if as_json:
        import json
        import sys

        sys.stdout.write(json.dumps({"cluster": cluster, "out": str(out_dir), "accounts_conf": str(cs.accounts_conf),
                                     "credentials": [{"name": c.name, "public_key": c.public_key,
                                                      "seed_file": str(c.seed_file)} for c in cs.credentials]})
                         + "\n")
        return
    t = Table(title=f"NATS credentials for cluster {cluster} in {out_dir}")
    for col in ("who", "public key", "seed file"):
        t.add_column(col, no_wrap=True)
    for c in cs.credentials:
        t.add_row(c.name, c.public_key[:12] + "…", str(c.seed_file))
    out.print(t)
    out.print(f"server: include {cs.accounts_conf} in nats-server.conf (accounts block, JetStream enabled)")
    out.print("agents: nodes/<node>.toml sets nats_nkey_seed and nats_inbox_prefix; "
              "router/worker: --config <dir>/router.toml (worker.toml) sets nats_nkey_seed and nats_inbox_prefix")


def register(app: typer.Typer) -> None:
    app.add_typer(creds_app, name="creds")


REASONS_SCANNED = 500
"""Dead letters whose reasons `fleetmend status` tallies (the newest); the total is always exact."""


async def deadletter_line(settings, timeout_s: float = 3.0) -> str:  # noqa: ANN001
    """One line for `fleetmend status`: how many messages were dead-lettered, by reason.

    `dead letters: 3 (not UTF-8: 1, invalid FaultEvent: 2); details: fleetmend deadletters`, or
    `dead letters: 0`, or `dead letters: unknown (NATS …)` when NATS cannot be asked (status still prints).
    """
    import asyncio
    import json
    from collections import Counter

    from fleetmend import subjects
    from fleetmend.infra.connect import connect_nats
    from fleetmend.infra.metrics import deadletter_reason

    try:
        async with asyncio.timeout(timeout_s * 2):
            nc = await connect_nats(settings, name="fleetmend-status", allow_reconnect=False,
                                    max_reconnect_attempts=0)
            try:
                js = nc.jetstream(timeout=timeout_s)
                try:
                    info = await js.stream_info(subjects.DEADLETTER_STREAM)
                except Exception:  # noqa: BLE001 - no stream yet: nothing was ever dead-lettered
                    return "dead letters: 0"
                total = info.state.messages
                reasons: Counter = Counter()
                first = max(info.state.first_seq, info.state.last_seq - REASONS_SCANNED + 1)
                for seq in range(first, info.state.last_seq + 1) if total else ():
                    try:
                        rec = json.loads((await js.get_msg(subjects.DEADLETTER_STREAM, seq)).data)
                    except Exception:  # noqa: BLE001 - removed by age, or not ours
                        continue
                    reasons[deadletter_reason(str(rec.get("reason", "?")))] += 1
            finally:
                await nc.close()
    except Exception as err:  # noqa: BLE001 - status must print even when NATS is away
        return f"dead letters: unknown (NATS at {settings.nats_url}: {type(err).__name__})"
    if not total:
        return "dead letters: 0"
    by = ", ".join(f"{r}: {n}" for r, n in reasons.most_common())  # a closed set of ≤ 11 categories
    return f"dead letters: {total} ({by}); details: fleetmend deadletters"
