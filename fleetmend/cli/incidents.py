"""`fleetmend history NODE`: every incident of a node, open and closed, in every cluster
(lookups in `fleetmend.cli.lookup`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from fleetmend.cli.lookup import node_history


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    m, sec = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    d, h = divmod(h, 24)
    return f"{d}d{h:02d}h" if d else f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s"


def register(app: typer.Typer) -> None:
    from fleetmend.cli.main import ClusterOpt, ConfigOpt, _run, _settings, _short_time, out

    @app.command("history")
    def history(
        node: str = typer.Argument(..., help="The node."),
        as_json: bool = typer.Option(False, "--json", help="A JSON array, newest incident first."),
        limit: int = typer.Option(100, "--limit", help="Most recent incidents listed."),
        cluster: Optional[str] = ClusterOpt,
        config: Optional[Path] = ConfigOpt,
    ) -> None:
        """Every incident of NODE, open and closed, in every cluster (unless --cluster): opened, closed,
        fault classes, outcome, ticket, time drained. Kept as long as the namespace retention."""
        s = _settings(config)
        rows = _run(node_history(s, node, cluster, limit))
        if as_json:
            sys.stdout.write(json.dumps(rows, indent=2, default=str) + "\n")
            return
        if not rows:
            out.print(f"no incidents of {escape(node)} in {'cluster ' + cluster if cluster else 'any cluster'} "
                      f"(closed ones are kept {s.temporal_retention_days} days: temporal_retention_days)")
            return
        t = Table(title=f"incidents of {node} ({len(rows)})")
        for col in ("cluster", "opened", "closed", "outcome", "fault classes", "ticket", "drained"):
            t.add_column(col, no_wrap=col != "fault classes")
        for r in rows:
            outcome = r["outcome"] or (r["phase"] if r["run_status"] == "running" else "?")
            t.add_row(escape(r["cluster"] or "?"), _short_time(r["opened_at"]), _short_time(r["closed_at"]) or "open",
                      escape(outcome or ""), escape(", ".join(r["fault_classes"])), escape(r["ticket"] or ""),
                      _duration(r["drained_s"]))
        out.print(t)
