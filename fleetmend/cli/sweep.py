"""`fleetmend sweep NODE… | --nodelist 'gpu[01-64]' | --job JOBID`: the same short benchmark on many
nodes at once, compared (Temporal workflow `sweep/<cluster>/<id>`, fleetmend/sweep.py). Hostlists and
a job's nodes come from Slurm (`activities.slurm.SlurmScheduler.expand`, `.job_nodes`)."""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fleetmend import subjects
from fleetmend.cli.common import ClusterOpt, err, out, run, settings
from fleetmend.config import Settings
from fleetmend.errors import FleetmendError, SchedulerError
from fleetmend.infra.connect import connect_temporal

if TYPE_CHECKING:
    from fleetmend.messages import SweepResult

app = typer.Typer()
"""`fleetmend sweep` (top-level: added to the root app without a group name)."""


async def _named_nodes(s: Settings, nodes: list[str], nodelist: str | None, job: str | None) -> list[str]:
    """NODES, then the nodes of `nodelist` and of `job`, in that order, each once."""
    from activities.slurm import SlurmScheduler  # lazy: the adapter imports temporalio (see common)

    slurm = SlurmScheduler(s.slurm)
    names = list(nodes)
    if nodelist:
        names += await slurm.expand(nodelist)
    if job:
        names += await slurm.job_nodes(job)
    return list(dict.fromkeys(names))


@app.command()
def sweep(
    nodes: list[str] = typer.Argument(None, help="Node names."),
    nodelist: Optional[str] = typer.Option(None, "--nodelist", help="Slurm hostlist, e.g. 'gpu[01-64]'."),
    job: Optional[str] = typer.Option(None, "--job", help="The nodes of this running Slurm job."),
    outlier_pct: Optional[float] = typer.Option(None, "--outlier-pct", help="Flag nodes this many percent "
                                                "below the median (analyzer.sweep_outlier_pct, default 5)."),
    deadline: Optional[float] = typer.Option(None, "--deadline", help="Seconds each agent has to answer "
                                             "(analyzer.sweep_deadline_s, default 60)."),
    host_seconds: float = typer.Option(1.0, "--host-seconds", help="Length of each built-in host check."),
    act: bool = typer.Option(False, "--act", help="Open a fail_slow incident for each outlier."),
    site_only: bool = typer.Option(False, "--site-only", help="Only agent.bench_command, no built-in checks."),
    sweep_id: Optional[str] = typer.Option(None, "--id", help="Sweep id (default: a timestamp)."),
    as_json: bool = typer.Option(False, "--json"),
    cluster: Optional[str] = ClusterOpt,
    config: Optional[Path] = typer.Option(None, "--config", "-c", envvar="FLEETMEND_CONFIG"),
) -> None:
    """Run the same short benchmark on NODES at once (memory bandwidth, CPU, GPU clocks, agent.bench_command)
    and name the outliers. Exit 1 when an outlier is found, 0 otherwise."""
    s = settings(config, cluster=cluster)
    try:
        names = asyncio.run(_named_nodes(s, nodes or [], nodelist, job))
    except (ValueError, SchedulerError) as e:
        err.print(f"[red]error:[/red] {escape(str(e))}")
        raise typer.Exit(2) from e
    if not names:
        err.print("[red]error:[/red] name the nodes: NODE…, --nodelist 'gpu[01-64]' or --job JOBID")
        raise typer.Exit(2)
    sid = sweep_id or datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    res = run(_sweep(s, names, sid, outlier_pct if outlier_pct is not None else s.analyzer.sweep_outlier_pct,
                     deadline if deadline is not None else s.analyzer.sweep_deadline_s, host_seconds, act,
                     not site_only))
    if as_json:
        d = asdict(res)
        d["outliers"] = res.outliers
        sys.stdout.write(json.dumps(d, default=str, indent=2) + "\n")
    else:
        _table(res, out)
    raise typer.Exit(1 if res.outliers else 0)


async def _sweep(s: Settings, nodes: list[str], sid: str, outlier_pct: float, deadline_s: float,
                 host_seconds: float, act: bool, builtin: bool = True) -> SweepResult:
    from fleetmend.messages import SweepApi, SweepInput, SweepResult  # lazy: temporalio.common (see common)

    try:
        wid = subjects.sweep_workflow_id(s.cluster, sid)
    except ValueError as e:
        raise FleetmendError(str(e)) from e
    client = await connect_temporal(s)
    handle = await client.start_workflow(
        SweepApi.WORKFLOW, SweepInput(cluster=s.cluster, sweep_id=sid, nodes=nodes, deadline_s=deadline_s,
                                      outlier_pct=outlier_pct, act=act, host_seconds=host_seconds, builtin=builtin),
        id=wid, task_queue=subjects.cluster_task_queue(s.task_queue, s.cluster), result_type=SweepResult)
    return await handle.result()


def _table(res: SweepResult, out: Console) -> None:
    from fleetmend.sweep import lower_is_better  # lazy: imports fleetmend.messages (see common)

    metrics = sorted(res.medians)
    t = Table(title=f"sweep {res.sweep_id} ({res.cluster}): {len(res.rows)} node(s) answered, outliers "
                    f"{res.outlier_pct:g} % below the median")
    t.add_column("node", no_wrap=True)
    for m in metrics:
        t.add_column(f"{m}{' ↓' if lower_is_better(m) else ''}", justify="right")
    t.add_column("verdict")
    for r in res.rows:
        cells = []
        for m in metrics:
            c = r.metrics.get(m)
            if c is None:
                cells.append("-")
                continue
            ratio = "" if c.ratio is None else f" ({c.ratio:.2f})"
            txt = f"{c.value:.4g}{ratio}"
            cells.append(f"[red]{txt}[/red]" if c.outlier else txt)
        verdict = (f"[red]OUTLIER[/red] {r.worst_metric} {r.worst_ratio:.2f}" if r.outlier else "ok")
        t.add_row(escape(r.node), *cells, verdict)
    t.add_row("median", *[f"{res.medians[m]:.4g}" for m in metrics], "")
    out.print(t)
    if res.not_answering:
        out.print("did not answer: " + ", ".join(f"{n} ({escape(w)})" for n, w in sorted(res.not_answering.items())))
    if res.not_judged:
        out.print("not judged (fewer than 3 nodes reported): " + ", ".join(res.not_judged))
    if res.incidents_opened:
        out.print("fail_slow incidents opened: " + ", ".join(res.incidents_opened))
    elif res.outliers:
        out.print("outliers: " + ", ".join(res.outliers) + " (add --act to open fail_slow incidents)")
