"""`fleetmend report [--since 7d] [--cluster C] [--json] [--html FILE] [--vendor-bundle FINDING DIR]`: compute lost,
counted from the incident ledger (`fleetmend.report`, read by `fleetmend.infra.ledger`)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from fleetmend.cli.common import ConfigOpt, JsonOpt, err, out, run, settings
from fleetmend.config import Settings
from fleetmend.report import FIELDS, ReportParams, build_report

app = typer.Typer()
"""`fleetmend report` (top-level)."""

_SPAN = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


MAX_SINCE_DAYS = 3650
"""The longest window `report --since` takes (ten years; the ledger keeps `ledger.max_age_days`, 400 by default)."""


def parse_since(value: str, now: float) -> float:
    """`7d`, `12h`, `30m`, `2w`, `90s` before `now`, or an ISO-8601 time (UTC when no offset), at most
    `MAX_SINCE_DAYS` back and not after `now`. Raises ValueError."""
    m = _SPAN.match(value.strip())
    if m:
        start = now - float(m[1]) * _UNIT_S[m[2]]
    else:
        try:
            t = datetime.fromisoformat(value.strip())
        except ValueError as e:
            raise ValueError(f"--since {value!r}: give a span (7d, 12h, 30m, 2w) or an ISO-8601 time") from e
        start = t.timestamp() if t.tzinfo else t.replace(tzinfo=timezone.utc).timestamp()
    if now - start > MAX_SINCE_DAYS * 86400:
        raise ValueError(f"--since {value!r}: at most {MAX_SINCE_DAYS} days back (10 years)")
    if start > now:
        raise ValueError(f"--since {value!r}: in the future; give a time before now")
    return start


def gpu_hours_text(v: float) -> str:
    """GPU-hours as the report prints them: two decimals (as the tables), and a small nonzero value to two
    significant digits instead of rounding it to 0.00 (0.0038 → 0.0038)."""
    if v == 0 or abs(v) >= 0.01:
        return f"{v:,.2f}"
    return f"{v:.{min(12, 1 - math.floor(math.log10(abs(v))))}f}"


def check_writable_file(path: Path, what: str) -> None:
    """Refuse (ValueError, a usage error) a file `what` cannot be written to: its directory missing or not a
    directory, the path a directory, or no permission; checked before anything is read."""
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ValueError(f"{what} {path}: is a directory; give a file name")
    if not parent.is_dir():
        raise ValueError(f"{what} {path}: no such directory {parent}")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"{what} {path}: not writable (permission denied)")


async def _read(s: Settings, cluster: Optional[str], with_detail: bool = False,
                since: float | None = None) -> tuple[list[dict], list[dict]]:
    from fleetmend.infra.connect import connect_nats  # lazy: nats (see fleetmend.cli.common)
    from fleetmend.infra.ledger import LedgerStore

    nc = await connect_nats(s, name="fleetmend-cli")
    try:
        store = LedgerStore(nc.jetstream(), s.ledger)
        async with asyncio.timeout(120):
            fields = None if with_detail else FIELDS
            heads = await store.read_heads(cluster, with_detail=with_detail, fields=fields, since=since)
            return heads, await store.fleet(cluster)
    finally:
        await nc.close()


@app.command()
def report(
    since: str = typer.Option("7d", "--since", help="Window start: a span (7d, 12h, 30m, 2w) or an ISO-8601 time."),
    cluster: Optional[str] = typer.Option(None, "--cluster", help="One cluster (default: every cluster in the ledger)."),
    as_json: bool = JsonOpt,
    html: Optional[Path] = typer.Option(None, "--html", help="Also write the report as a self-contained HTML page."),
    vendor_bundle: Optional[tuple[str, Path]] = typer.Option(
        None, "--vendor-bundle", metavar="FINDING DIR",
        help="Write what a vendor asks for about one version finding (its id, from the report) into DIR."),
    config: Optional[Path] = ConfigOpt,
) -> None:
    """GPU-hours out of service by fault class, rack, hardware class and version; MTTR, time to detect, time to
    drain, ticket turnaround; the false-drain rate; lemon nodes; parts not replaced; the cost of slow nodes; and
    version findings. Every figure says how it was computed (docs/compute-lost.md)."""
    s = settings(config)
    now = time.time()
    try:
        start = parse_since(since, now)
        if html is not None:
            check_writable_file(html, "--html")
        if cluster is not None:
            from fleetmend.subjects import ledger_cluster_prefixes

            ledger_cluster_prefixes(cluster)
    except ValueError as e:
        err.print(f"[red]{escape(str(e))}[/red]")
        raise typer.Exit(2) from e
    heads, fleet = run(_read(s, cluster, with_detail=vendor_bundle is not None, since=start))
    rep = build_report(heads, ReportParams.from_settings(s, start, now), fleet=fleet, cluster=cluster or "")
    if vendor_bundle is not None:
        finding, directory = vendor_bundle
        found = [f for f in rep["findings"] if f["id"] == finding or f["id"].startswith(finding)]
        if len(found) != 1:
            ids = ", ".join(f["id"] for f in rep["findings"]) or "none in this window"
            err.print(f"[red]no single version finding {escape(finding)!r}[/red]; findings: {escape(ids)}")
            raise typer.Exit(1)
        try:
            written = write_vendor_bundle(found[0], heads, directory)
        except OSError as e:
            err.print(f"[red]error:[/red] cannot write the vendor bundle into {escape(str(directory))}: "
                      f"{escape(e.strerror or str(e))}")
            raise typer.Exit(1) from e
        out.print(f"vendor bundle for finding {found[0]['id']} ({escape(found[0]['fault_class'])} on "
                  f"{escape(found[0]['key'])}={escape(found[0]['value'])}): {len(written)} files in {escape(str(directory))}")
        return
    if html is not None:
        from fleetmend.report_html import render_html

        page = render_html(rep)
    if as_json:
        sys.stdout.write(json.dumps(rep, indent=2) + "\n")
    else:
        _print(rep)
    if html is not None:  # after the report itself: a failed write loses nothing printed
        try:
            html.write_text(page, encoding="utf-8")
        except OSError as e:
            err.print(f"[red]error:[/red] cannot write {escape(str(html))}: {escape(e.strerror or str(e))}")
            raise typer.Exit(1) from e
        if not as_json:
            out.print(f"HTML: {escape(str(html))}")


def _print(rep: dict[str, Any]) -> None:
    how = rep["how"]
    n = rep["incidents"]
    out.print(f"[bold]compute lost[/bold] {escape(rep.get('cluster') or 'all clusters')}, last {rep['window']['hours']:g} h: "
              f"{gpu_hours_text(rep['gpu_hours'])} GPU-hours out of service in {n} incident{'' if n == 1 else 's'}")
    out.print(f"  [dim]{escape(how['gpu_hours'])}[/dim]")
    for name, label, unit in (("mttr_h", "MTTR", "h"), ("time_to_detect_s", "time to detect", "s"),
                              ("time_to_drain_s", "time to drain", "s"), ("ticket_turnaround_h", "ticket turnaround", "h")):
        st = rep[name]
        value = "–" if st["mean"] is None else f"mean {st['mean']:g} {unit}, p50 {st['p50']:g}, p90 {st['p90']:g} (n={st['n']})"
        out.print(f"{label}: {value}\n  [dim]{escape(how[name])}[/dim]")
    fdr = rep["false_drain_rate"]
    out.print(f"false-drain rate: {'–' if fdr is None else f'{fdr:.1%}'}\n  [dim]{escape(how['false_drain_rate'])}[/dim]")
    out.print(f"lost to slow nodes: {gpu_hours_text(rep['slowness_gpu_hours'])} GPU-hours\n"
              f"  [dim]{escape(how['slowness_gpu_hours'])}[/dim]")
    for by in ("fault_class", "rack", "hw_class"):
        values = rep[f"gpu_hours_by_{by}"]
        if values:
            t = Table(title=f"GPU-hours by {by.replace('_', ' ')}")
            t.add_column(by)
            t.add_column("GPU-h", justify="right")
            for k, v in values.items():
                t.add_row(escape(k), gpu_hours_text(v))
            out.print(t)
    if rep["outcomes"]:
        out.print("outcomes: " + ", ".join(f"{k} {v}" for k, v in rep["outcomes"].items()))
    for x in rep["lemons"]:
        out.print(f"lemon: {escape(x['node'])}: {escape('; '.join(x['why']))}")
    for x in rep["parts_not_replaced"]:
        out.print(f"part not replaced: {escape(x['node'])} {escape(str(x['part']))} serial {escape(str(x['serial']))} "
                  f"(ticket {escape(str(x['ticket']))}, {escape(str(x['fault_class']))})")
    for f in rep["findings"]:
        out.print(f"[yellow]version finding {f['id']}[/yellow]: {escape(f['fault_class'])} on "
                  f"{f['nodes_with_fault_and_value']} of "
                  f"{f['nodes_with_fault']} faulty nodes with {escape(f['key'])}={escape(f['value'])} (fleet: "
                  f"{f['fleet_nodes_with_value']} of {f['fleet_nodes']}); {escape(f['test'])}; "
                  f"`fleetmend report --vendor-bundle {f['id']} DIR`")


def write_vendor_bundle(finding: dict[str, Any], heads: list[dict[str, Any]], directory: Path) -> list[Path]:
    """What a vendor asks for about `finding`: `finding.json` (the counts and the test), `incidents.jsonl` (every
    record of the finding's fault class on its nodes), `raw_fault_lines.txt`, `serials.json`, `versions.json` and
    `diagnostics.json`. Returns the files written."""
    directory.mkdir(parents=True, exist_ok=True)
    nodes = set(finding["nodes"])
    recs = [h for h in heads if h.get("node") in nodes and h.get("fault_class") == finding["fault_class"]]
    files: dict[str, str] = {
        "finding.json": json.dumps(finding, indent=2),
        "incidents.jsonl": "".join(json.dumps({k: v for k, v in h.items() if k != "_detail"}) + "\n" for h in recs),
        "raw_fault_lines.txt": "".join(f"# {h['node']} {h.get('incident_id')} observed_at={h.get('observed_at')}\n"
                                       f"{(h.get('_detail') or {}).get('raw', '')}\n\n" for h in recs),
        "serials.json": json.dumps({h["node"]: {"part": h.get("part"), "part_serial_drain": h.get("part_serial_drain"),
                                                "part_serial_return": h.get("part_serial_return"),
                                                "at_drain": (h.get("_detail") or {}).get("serials_drain"),
                                                "at_return": (h.get("_detail") or {}).get("serials_return")}
                                    for h in recs}, indent=2),
        "versions.json": json.dumps({h["node"]: {"at_drain": h.get("versions_drain"),
                                                 "at_return": h.get("versions_return")} for h in recs}, indent=2),
        "diagnostics.json": json.dumps({h["node"]: (h.get("_detail") or {}).get("diagnostics") or [] for h in recs},
                                       indent=2),
    }
    written = []
    for name, text in files.items():
        (directory / name).write_text(text, encoding="utf-8")
        written.append(directory / name)
    return written
