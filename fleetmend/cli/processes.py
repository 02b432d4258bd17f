"""The long-running processes: `fleetmend agent`, `router`, `worker`, `analyzer` and `dev up`.

Each command loads the settings and runs its process until SIGTERM/SIGINT (`common.serve`). The
processes' own modules are imported inside the commands: each pulls in temporalio and nats (see
`fleetmend.cli.common`), and `fleetmend agent` through the console script never comes here at all
(`fleetmend.cli.entry`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from fleetmend.cli.common import ClusterOpt, ConfigOpt, MetricsPortOpt, err, run, serve, settings
from fleetmend.config import ensure_state_dir
from fleetmend.errors import ConfigError

app = typer.Typer()
"""The top-level process commands (added to the root app without a group name)."""
dev_app = typer.Typer(no_args_is_help=True, help="Local pipeline with embedded NATS and Temporal.")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []})
def agent(ctx: typer.Context) -> None:
    """Node agent: probes → JetStream (spooling to disk while NATS is away), heartbeats, diagnostics.
    `fleetmend agent --help` lists its options (--node, --cluster, --config, --kmsg-file, --once, ...)."""
    from agents.__main__ import main as agent_main  # lazy: the agent's probes and their libraries

    raise typer.Exit(agent_main(list(ctx.args), prog="fleetmend agent", lean=False))


@app.command()
def router(config: Optional[Path] = ConfigOpt, metrics_port: Optional[int] = MetricsPortOpt,
           cluster: Optional[str] = ClusterOpt) -> None:
    """Router: durable JetStream consumer → fault catalog → Temporal signal-with-start. It routes every
    cluster's faults, each to its cluster's task queue; its own cluster (--cluster) is the one whose must-drain-now
    faults it cordons at once."""
    from fleetmend.router import run_router  # lazy: temporalio, nats

    s = settings(config, cluster=cluster)
    if metrics_port is not None:
        s.metrics.router_port = metrics_port
    run(serve(run_router, s))


@app.command()
def worker(
    config: Optional[Path] = ConfigOpt,
    scheduler: Optional[str] = typer.Option(None, "--scheduler", help="slurm, standalone, kubernetes or none."),
    metrics_port: Optional[int] = MetricsPortOpt,
    cluster: Optional[str] = ClusterOpt,
) -> None:
    """Temporal worker of one cluster (--cluster): its NodeRemediation workflows, FleetGuard and their
    activities, on that cluster's task queues. Run one (or more) per cluster."""
    from fleetmend.worker import run_worker  # lazy: temporalio, nats, the adapters

    s = settings(config, scheduler=scheduler, cluster=cluster)
    if metrics_port is not None:
        s.metrics.worker_port = metrics_port
    run(serve(run_worker, s))


@app.command()
def analyzer(
    config: Optional[Path] = ConfigOpt,
    cluster: Optional[str] = ClusterOpt,
    metrics_port: Optional[int] = typer.Option(None, "--metrics-port", help="Serve Prometheus /metrics here "
                                               "(0: off; FLEETMEND_METRICS__ANALYZER_PORT)."),
) -> None:
    """Fail-slow analyzer: compares every node's telemetry with its hardware peers and opens fail_slow
    incidents for persistent outliers. Run two per cluster: one is active (KV lease), one stands by."""
    from fleetmend.analyzer.service import run_analyzer  # lazy: temporalio, nats

    s = settings(config, cluster=cluster)
    if metrics_port is not None:
        s.metrics.analyzer_port = metrics_port
    run(serve(run_analyzer, s))


@dev_app.command("up")
def dev_up(
    state_dir: Optional[Path] = typer.Option(None, "--state-dir", help="FLEETMEND_STATE_DIR"),
    nats_url: Optional[str] = typer.Option(None, "--nats-url", help="FLEETMEND_NATS_URL"),
    temporal_address: Optional[str] = typer.Option(None, "--temporal-address", help="FLEETMEND_TEMPORAL_ADDRESS"),
    ui_port: Optional[int] = typer.Option(None, "--ui-port", help="FLEETMEND_TEMPORAL_UI_PORT"),
    scheduler: Optional[str] = typer.Option(None, "--scheduler", help="standalone (default), slurm or none"),
    no_agent: bool = typer.Option(False, "--no-agent", help="Do not start a local agent."),
    secure: bool = typer.Option(False, "--secure", help="NATS with per-role credentials (STATE/creds)."),
    join_nats: bool = typer.Option(False, "--join-nats", help="Use the NATS already at --nats-url (a cluster: "
                                   "comma-separated URLs; implied by several URLs or another host's) instead of "
                                   "starting nats-server: checks it, creates the streams and buckets there."),
    config: Optional[Path] = ConfigOpt,
) -> None:
    """Start NATS (JetStream), Temporal (SQLite, Web UI), worker, router and a local agent; Ctrl-C stops all.
    With --join-nats (or a --nats-url of several servers or another host) it joins that NATS instead."""
    from fleetmend.dev.devup import dev_up as run_dev_up  # lazy: temporalio, nats

    s = settings(config, state_dir=state_dir, nats_url=nats_url, temporal_address=temporal_address,
                 temporal_ui_port=ui_port, scheduler=scheduler)
    try:  # before anything starts: a file or a read-only place is one line, not a traceback after nats-server
        ensure_state_dir(s.state_dir)
    except ConfigError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}")
        raise typer.Exit(2) from e
    raise typer.Exit(run(run_dev_up(s, agent=not no_agent, config=config, secure=secure, join_nats=join_nats)))
