"""`fleetmend creds generate`: per-node NATS nkeys and the server's accounts block (fleetmend.infra.security)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from fleetmend.cli.common import err, out
from fleetmend.errors import ConfigError
from fleetmend.infra.security import generate as generate_credentials

app = typer.Typer(no_args_is_help=True, help="NATS credentials: one nkey per node and service.")
"""`fleetmend creds ...`."""


@app.command("generate")
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
    names = [n.strip() for n in (nodes or "").split(",") if n.strip()]
    if nodes_file:
        names += [ln.strip() for ln in nodes_file.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    if not names:
        err.print("[red]error:[/red] no nodes: pass --nodes n1,n2 or --nodes-file FILE")
        raise typer.Exit(2)
    try:
        cs = generate_credentials(out_dir, cluster, sorted(set(names)))
    except ConfigError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}")
        raise typer.Exit(2) from e
    if as_json:
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
