"""`fleetmend sim`: a simulated fleet (rehearsals, benchmarks)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def sim(
        nodes: int = typer.Option(100, "--nodes", min=1, help="Virtual nodes."),
        cluster: str = typer.Option("sim", "--cluster"),
        duration: float = typer.Option(60.0, "--duration", help="Seconds to run."),
        seed: int = typer.Option(1, "--seed"),
        accelerate: float = typer.Option(1.0, "--accelerate",
                                         help="Multiply the Llama 3 failure rate (0.0038/node-day) by this."),
        fault_rate: Optional[float] = typer.Option(None, "--fault-rate", help="Fleet-wide fault lines per second "
                                                   "(overrides the published rate)."),
        heartbeat_interval: float = typer.Option(10.0, "--heartbeat-interval", help="Seconds, per node."),
        config: Optional[Path] = typer.Option(None, "--config", "-c", envvar="FLEETMEND_CONFIG"),
    ) -> None:
        """Simulate NODES nodes: heartbeats plus faults from the Llama 3 failure mix, through the agent's path."""
        from rich.console import Console
        from rich.table import Table

        from fleetmend.cli.main import _run, _settings
        from fleetmend.logs import configure_logging
        from fleetmend.cli.simulate import SimConfig, fleet_rate_per_s, run_sim

        s = _settings(config)
        configure_logging(s.log_format, level="warning")
        cfg = SimConfig(nodes=nodes, cluster=cluster, duration_s=duration, seed=seed, accelerate=accelerate,
                        fault_rate_per_s=fault_rate, heartbeat_interval_s=heartbeat_interval)
        out = Console()
        out.print(f"simulating {nodes} nodes in cluster {cluster} for {duration:.0f}s: "
                  f"{fleet_rate_per_s(cfg):.4f} fault lines/s, heartbeat every {heartbeat_interval:.0f}s per node")
        rep = _run(run_sim(s, cfg))
        t = Table(title=f"simulated {rep.nodes} nodes for {rep.duration_s:.0f}s (seed {seed})")
        t.add_column("category")
        t.add_column("fault lines", justify="right")
        for cat, n in rep.by_category.most_common():
            t.add_row(cat, str(n))
        for cat, n in rep.silent_by_category.most_common():
            t.add_row(f"{cat} (no agent signal)", str(n))
        out.print(t)
        out.print(f"events published {rep.events_published}, spooled {rep.events_spooled}, "
                  f"heartbeats {rep.heartbeats_sent}")
