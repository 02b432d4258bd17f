"""`fleetmend analyzer`: the fail-slow analyzer process (fleetmend/analyzer/)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def analyzer(
        config: Optional[Path] = typer.Option(None, "--config", "-c", envvar="FLEETMEND_CONFIG",
                                              help="TOML config file."),
        cluster: Optional[str] = typer.Option(None, "--cluster", help="Cluster name (FLEETMEND_CLUSTER)."),
        metrics_port: Optional[int] = typer.Option(None, "--metrics-port", help="Serve Prometheus /metrics here "
                                                   "(0: off; FLEETMEND_METRICS__ANALYZER_PORT)."),
    ) -> None:
        """Fail-slow analyzer: compares every node's telemetry with its hardware peers and opens fail_slow
        incidents for persistent outliers. Run two per cluster: one is active (KV lease), one stands by."""
        from fleetmend.analyzer.service import run_analyzer
        from fleetmend.cli.main import _run, _serve, _settings

        s = _settings(config, cluster=cluster)
        if metrics_port is not None:
            s.metrics.analyzer_port = metrics_port
        _run(_serve(run_analyzer, s))
