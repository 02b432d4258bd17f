"""`fleetmend sweep NODE… | --nodelist 'gpu[01-64]' | --job JOBID`: the same short benchmark on many
nodes at once, compared (Temporal workflow `sweep/<cluster>/<id>`, fleetmend/sweep.py). Hostlists and
a job's nodes come from Slurm (`activities.slurm.SlurmScheduler.expand`, `.job_nodes`).

`--nccl-env 'NCCL_IB_HCA=...'` (repeatable; `@FILE` reads `KEY=VALUE` lines, e.g. `/etc/nccl.conf` or a job's
`env` dump) also checks the job's NCCL environment against each node's fingerprint from the KV bucket
(`fleetmend.drift.nccl_env_findings`: the GPU-local NICs, their roles and NUMA nodes). That check needs no
workflow and no agent round trip; `--nccl-only` skips the benchmark. `scontrol show job` does not show a job's
variables, so they are given here (`sacct -j JOB --env-vars`, where accounting keeps them, saved as `@FILE`).
"""

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
from fleetmend.infra.connect import connect_nats, connect_temporal

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
    nccl_env: list[str] = typer.Option([], "--nccl-env", help="Check a job's NCCL variable against the nodes' "
                                       "GPU-local NICs: 'NCCL_IB_HCA=^=mlx5_8' (NCCL_SOCKET_IFNAME, "
                                       "NCCL_NET_GDR_LEVEL too); repeatable; @FILE reads KEY=VALUE lines."),
    nccl_only: bool = typer.Option(False, "--nccl-only", help="Only the NCCL environment check (no benchmark)."),
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
    try:
        env = parse_nccl_env(nccl_env)
    except ValueError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}")
        raise typer.Exit(2) from e
    if nccl_only and not env:
        err.print("[red]error:[/red] --nccl-only needs --nccl-env NCCL_IB_HCA=... (or NCCL_SOCKET_IFNAME, "
                  "NCCL_NET_GDR_LEVEL)")
        raise typer.Exit(2)
    nccl = run(_nccl_check(s, names, env)) if env else None
    if nccl_only:
        assert nccl is not None
        if as_json:
            sys.stdout.write(json.dumps({"nccl": nccl}, indent=2) + "\n")
        else:
            _nccl_table(nccl, out)
        raise typer.Exit(1 if nccl["findings"] else 0)
    sid = sweep_id or datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    res = run(_sweep(s, names, sid, outlier_pct if outlier_pct is not None else s.analyzer.sweep_outlier_pct,
                     deadline if deadline is not None else s.analyzer.sweep_deadline_s, host_seconds, act,
                     not site_only))
    if as_json:
        d = asdict(res)
        d["outliers"] = res.outliers
        if nccl is not None:
            d["nccl"] = nccl
        sys.stdout.write(json.dumps(d, default=str, indent=2) + "\n")
    else:
        if nccl is not None:
            _nccl_table(nccl, out)
        _table(res, out)
    raise typer.Exit(1 if res.outliers or (nccl and nccl["findings"]) else 0)


NCCL_CHECKED = ("NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "NCCL_NET_GDR_LEVEL", "NCCL_IB_GDR_LEVEL")
"""The variables `fleetmend.drift.nccl_env_findings` judges; other NCCL_* given are listed as not checked."""
NCCL_GETS_AT_ONCE = 64
"""Fingerprint reads in flight at once (one KV get each)."""
MAX_NCCL_NODES_LISTED = 200
"""Nodes whose findings the answer lists (each at most `fleetmend.drift.MAX_NCCL_FINDINGS_PER_NODE`); beyond,
only their count: a 4,000-node job with one wrong variable stays a readable answer."""


def parse_nccl_env(items: list[str]) -> dict[str, str]:
    """`KEY=VALUE` items (or `@FILE` of such lines; `#` comments, `export ` prefixes and quotes allowed) → the
    NCCL_* variables among them; a later one wins.

    Raises:
        ValueError: an item without `=`, a key that is not NCCL_*, or a file that cannot be read.
    """
    env: dict[str, str] = {}
    for item in items:
        if item.startswith("@"):
            try:
                lines = Path(item[1:]).read_text().splitlines()
            except OSError as e:
                raise ValueError(f"--nccl-env {item}: {e.strerror or e}") from e
            for ln in lines:
                ln = ln.strip().removeprefix("export ").strip()
                key, sep, value = ln.partition("=")
                if sep and key.strip().startswith("NCCL_"):
                    env[key.strip()] = value.strip().strip("'\"")
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip().startswith("NCCL_"):
            raise ValueError(f"--nccl-env {item!r}: expected NCCL_NAME=VALUE (e.g. NCCL_IB_HCA='=mlx5_0,mlx5_1')")
        env[key.strip()] = value.strip()
    return env


async def _nccl_check(s: Settings, nodes: list[str], env: dict[str, str]) -> dict:
    """Each node's fingerprint from the KV bucket, checked with `nccl_env_findings`. Returns the `--json` shape
    `{env, checked, not_checked, nodes, without_fingerprint, findings: [{node, variable, gpu, expected, given,
    why}], nodes_with_findings, clipped}` (bounded: `MAX_NCCL_NODES_LISTED` nodes listed)."""
    from nats.js.errors import KeyNotFoundError

    from fleetmend.drift import nccl_env_findings  # lazy (see fleetmend.cli.common)
    from fleetmend.fingerprint import Fingerprint
    from fleetmend.infra.jetstream import open_kv_bucket

    missing: list[str] = []
    findings: list[dict] = []
    with_findings = 0
    nc = await connect_nats(s, name="fleetmend-cli")
    try:
        kv = await open_kv_bucket(nc.jetstream(), subjects.FINGERPRINT_KV_BUCKET, "latest node fingerprint")

        async def one(node: str) -> Fingerprint | None:
            try:
                entry = await kv.get(subjects.fingerprint_kv_key(s.cluster, node))
                return Fingerprint.model_validate_json(entry.value)
            except (KeyNotFoundError, ValueError):
                return None

        fps: list[Fingerprint | None] = []
        for i in range(0, len(nodes), NCCL_GETS_AT_ONCE):
            fps += await asyncio.gather(*(one(n) for n in nodes[i:i + NCCL_GETS_AT_ONCE]))
        for node, fp in zip(nodes, fps, strict=True):
            if fp is None:
                missing.append(node)
                continue
            got = nccl_env_findings(env, fp)
            if got:
                with_findings += 1
                if with_findings <= MAX_NCCL_NODES_LISTED:
                    findings += [{"node": f.node, "variable": f.variable, "gpu": f.gpu, "expected": f.expected,
                                  "given": f.given, "why": f.why} for f in got]
    finally:
        await nc.close()
    return {"env": env, "checked": [k for k in env if k in NCCL_CHECKED],
            "not_checked": [k for k in env if k not in NCCL_CHECKED], "nodes": len(nodes),
            "without_fingerprint": missing[:MAX_NCCL_NODES_LISTED], "findings": findings,
            "nodes_with_findings": with_findings,
            "clipped": (f"{with_findings} nodes have findings; the first {MAX_NCCL_NODES_LISTED} are listed"
                        if with_findings > MAX_NCCL_NODES_LISTED else None)}


def _nccl_table(res: dict, out: Console) -> None:
    env = " ".join(f"{k}={v}" for k, v in res["env"].items())
    if not res["findings"]:
        out.print(f"NCCL environment ({escape(env)}): fits the GPU-local NICs of "
                  f"{res['nodes'] - len(res['without_fingerprint'])} node(s)")
    else:
        t = Table(title=f"NCCL environment ({escape(env)}): {res['nodes_with_findings']} of {res['nodes']} "
                        "node(s) with findings")
        for col in ("node", "variable", "GPU", "expected", "given", "why"):
            t.add_column(col)
        for f in res["findings"]:
            t.add_row(escape(f["node"]), f["variable"], f["gpu"] or "-", escape(f["expected"]), escape(f["given"]),
                      escape(f["why"]))
        out.print(t)
    if res["clipped"]:
        out.print(escape(res["clipped"]))
    if res["without_fingerprint"]:
        out.print("no fingerprint (agent not running, or agent.inventory_enabled off): "
                  + escape(", ".join(res["without_fingerprint"])))
    if res["not_checked"]:
        out.print("not checked: " + escape(", ".join(res["not_checked"])))


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
