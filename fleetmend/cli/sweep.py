"""`fleetmend sweep NODE… | --nodelist 'gpu[01-64]' | --job JOBID`: the same short benchmark on many
nodes at once, compared (Temporal workflow `sweep/<cluster>/<id>`, fleetmend/sweep.py)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Optional

import typer


def slurm_hostnames(expr: str, scontrol: str = "scontrol", env: dict[str, str] | None = None) -> list[str]:
    """Expand a Slurm hostlist: `scontrol show hostnames` when Slurm is installed, else
    `fleetmend.sweep.expand_hostlist`. `env`: the subprocess environment (None: this process's).
    Raises ValueError for an expression neither accepts."""
    from fleetmend.sweep import expand_hostlist

    if shutil.which(scontrol):
        p = subprocess.run([scontrol, "show", "hostnames", expr], capture_output=True, text=True, timeout=30, env=env)
        if p.returncode == 0 and p.stdout.strip():
            return p.stdout.split()
    return expand_hostlist(expr)


def job_nodes(job: str, scontrol: str = "scontrol", env: dict[str, str] | None = None) -> list[str]:
    """The nodes of a running Slurm job (`scontrol show job JOBID`, field `NodeList=`, expanded by
    `slurm_hostnames`). `env`: the subprocesses' environment (SLURM_CONF from `slurm.slurm_conf`).

    Raises:
        ValueError: scontrol missing, unknown job, or a job without nodes (pending).
    """
    if not shutil.which(scontrol):
        raise ValueError(f"--job needs Slurm's {scontrol} on PATH (slurm.scontrol)")
    p = subprocess.run([scontrol, "show", "job", job], capture_output=True, text=True, timeout=30, env=env)
    if p.returncode != 0:
        raise ValueError(f"scontrol show job {job}: {(p.stderr or p.stdout).strip()}")
    m = re.search(r"(?:^|\s)NodeList=(\S+)", p.stdout)
    if not m or m.group(1) in ("(null)", ""):
        raise ValueError(f"job {job} has no nodes allocated (pending?)")
    return slurm_hostnames(m.group(1), scontrol, env)


def register(app: typer.Typer) -> None:
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
        cluster: Optional[str] = typer.Option(None, "--cluster", help="Cluster name (FLEETMEND_CLUSTER)."),
        config: Optional[Path] = typer.Option(None, "--config", "-c", envvar="FLEETMEND_CONFIG"),
    ) -> None:
        """Run the same short benchmark on NODES at once (memory bandwidth, CPU, GPU clocks, agent.bench_command)
        and name the outliers. Exit 1 when an outlier is found, 0 otherwise."""
        import json
        import sys
        from datetime import datetime, timezone

        from fleetmend.cli.main import _run, _settings, err, out

        s = _settings(config, cluster=cluster)
        import os

        env = {**os.environ, "SLURM_CONF": s.slurm.slurm_conf} if s.slurm.slurm_conf else None
        try:
            names = list(nodes or [])
            if nodelist:
                names += slurm_hostnames(nodelist, s.slurm.scontrol, env)
            if job:
                names += job_nodes(job, s.slurm.scontrol, env)
        except (ValueError, subprocess.SubprocessError) as e:
            err.print(f"[red]error:[/red] {e}")
            raise typer.Exit(2) from e
        names = list(dict.fromkeys(names))
        if not names:
            err.print("[red]error:[/red] name the nodes: NODE…, --nodelist 'gpu[01-64]' or --job JOBID")
            raise typer.Exit(2)
        sid = sweep_id or datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        res = _run(_sweep(s, names, sid, outlier_pct if outlier_pct is not None else s.analyzer.sweep_outlier_pct,
                          deadline if deadline is not None else s.analyzer.sweep_deadline_s, host_seconds, act,
                          not site_only))
        if as_json:
            from dataclasses import asdict

            d = asdict(res)
            d["outliers"] = res.outliers
            sys.stdout.write(json.dumps(d, default=str, indent=2) + "\n")
        else:
            _table(res, out)
        raise typer.Exit(1 if res.outliers else 0)


async def _sweep(s, nodes: list[str], sid: str, outlier_pct: float, deadline_s: float, host_seconds: float,  # noqa: ANN001
                 act: bool, builtin: bool = True):  # noqa: ANN202
    from fleetmend import subjects
    from fleetmend.infra.connect import connect_temporal
    from fleetmend.errors import FleetmendError
    from fleetmend.messages import SweepApi, SweepInput, SweepResult

    try:
        wid = subjects.sweep_workflow_id(s.cluster, sid)
    except ValueError as e:
        raise FleetmendError(str(e)) from e
    client = await connect_temporal(s)
    handle = await client.start_workflow(
        SweepApi.WORKFLOW, SweepInput(cluster=s.cluster, sweep_id=sid, nodes=nodes, deadline_s=deadline_s,
                              outlier_pct=outlier_pct, act=act, host_seconds=host_seconds, builtin=builtin),
        id=wid, task_queue=s.task_queue, result_type=SweepResult)
    return await handle.result()


def _table(res, out) -> None:  # noqa: ANN001
    from rich.markup import escape
    from rich.table import Table

    from fleetmend.sweep import lower_is_better

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
