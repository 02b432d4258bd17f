"""`fleetmend sim`: a simulated fleet (rehearsals, benchmarks); the engines are `fleetmend.dev.simulate`
(heartbeats and faults) and `fleetmend.dev.perfsim` (telemetry, `--perf`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from fleetmend.cli.common import err, out, run, settings
from fleetmend.infra.logs import configure_logging

app = typer.Typer()
"""`fleetmend sim` (top-level: added to the root app without a group name)."""


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
    perf: bool = typer.Option(False, "--perf", help="Emit performance telemetry instead (fleet.<cluster>.perf.*), "
                              "for the fail-slow analyzer."),
    slow_nodes: int = typer.Option(0, "--slow-nodes", min=0, help="With --perf: degrade this many nodes."),
    slowdown: float = typer.Option(0.05, "--slowdown", help="With --perf: the fraction they lose (0.05 = 5 %)."),
    perf_interval: float = typer.Option(60.0, "--perf-interval", help="With --perf: seconds between a node's "
                                        "samples (the agent's agent.perf.interval_s)."),
    as_json: bool = typer.Option(False, "--json", help="With --perf: one JSON object with `slow_nodes`."),
) -> None:
    """Simulate NODES nodes: heartbeats plus faults from the Llama 3 failure mix, through the agent's path.
    With --perf: telemetry of noisy healthy nodes and --slow-nodes degraded ones (printed)."""
    if perf:
        _perf(nodes, cluster, duration, seed, slow_nodes, slowdown, perf_interval, as_json, config)
        return
    from fleetmend.dev.simulate import SimConfig, fleet_rate_per_s, run_sim  # lazy: dev-only engine, 0.1 s

    s = settings(config)
    configure_logging(s.log_format, level="warning")
    cfg = SimConfig(nodes=nodes, cluster=cluster, duration_s=duration, seed=seed, accelerate=accelerate,
                    fault_rate_per_s=fault_rate, heartbeat_interval_s=heartbeat_interval)
    out.print(f"simulating {nodes} nodes in cluster {cluster} for {duration:.0f}s: "
              f"{fleet_rate_per_s(cfg):.4f} fault lines/s, heartbeat every {heartbeat_interval:.0f}s per node")
    rep = run(run_sim(s, cfg))
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


def _perf(nodes: int, cluster: str, duration: float, seed: int, slow_nodes: int, slowdown: float,
          interval: float, as_json: bool, config: Optional[Path]) -> None:
    from fleetmend.dev.perfsim import PerfFleet, run_perf_sim  # lazy: dev-only engine, 0.1 s

    s = settings(config)
    configure_logging(s.log_format, level="warning")
    try:
        fleet = PerfFleet(nodes, slow_nodes=slow_nodes, slowdown=slowdown, seed=seed, cluster=cluster)
    except ValueError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}")
        raise typer.Exit(2) from e
    slow = sorted(fleet.slow)
    if not as_json:
        print(f"simulating telemetry of {nodes} nodes in cluster {cluster} for {duration:.0f}s, one sample per node "
              f"every {interval:g}s; slowed by {slowdown:.1%}: "
              + (", ".join(f"{n} ({fleet.slow[n]})" for n in slow) or "none"), flush=True)
    rep = run(run_perf_sim(s, fleet, duration, interval))
    if as_json:
        sys.stdout.write(json.dumps({"slow_nodes": slow, "patterns": fleet.slow, "nodes": nodes, "cluster": cluster,
                                     "slowdown": slowdown, **rep}) + "\n")
    else:
        print(f"published {rep['samples']} samples in {rep['intervals']} interval(s); slowed nodes: "
              + (" ".join(slow) or "none"))
