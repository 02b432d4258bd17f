"""`fleetmend report --html FILE`: the report as one self-contained page (inline CSS and SVG charts, no script,
no network at view time; opens from a file without a server). Pure: the report dict in, the page out.

Every figure is an element with `data-figure="<name>"` and `data-value="<the --json value>"`, so a browser test
reads the page's figures back and compares them with `--json` (tests/test_report.py).
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from html import escape
from typing import Any

BAR_COLOUR = "#3b6ea8"
MAX_BARS = 15


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:,.3f}".rstrip("0").rstrip(".") if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _figure(name: str, label: str, value: Any, how: str, unit: str = "") -> str:
    data = escape(json.dumps(value, sort_keys=True), quote=True)
    return (f'<div class="fig"><div class="label">{escape(label)}</div>'
            f'<div class="value" data-figure="{escape(name)}" data-value="{data}">{escape(_fmt(value))}'
            f'{" " + escape(unit) if unit and value is not None else ""}</div>'
            f'<div class="how">{escape(how)}</div></div>')


def bar_chart(name: str, title: str, values: dict[str, float], how: str, unit: str = "GPU-h") -> str:
    """A horizontal SVG bar chart of `values` (largest first, at most `MAX_BARS`), its numbers in the bars'
    `data-value`."""
    items = sorted(values.items(), key=lambda kv: -kv[1])[:MAX_BARS]
    top = max((v for _k, v in items), default=0.0) or 1.0
    row, label_w, bar_w = 22, 330, 420
    h = row * max(1, len(items)) + 10
    bars = []
    for i, (k, v) in enumerate(items):
        y = 5 + i * row
        w = max(1.0, bar_w * v / top) if v > 0 else 0.0
        bars.append(f'<text x="{label_w - 6}" y="{y + 15}" text-anchor="end">{escape(k[:48])}</text>'
                    f'<rect x="{label_w}" y="{y + 3}" width="{w:.1f}" height="{row - 6}" fill="{BAR_COLOUR}" '
                    f'data-figure="{escape(name)}" data-group="{escape(k, quote=True)}" data-value="{v!r}"/>'
                    f'<text x="{label_w + w + 6:.1f}" y="{y + 15}">{escape(_fmt(v))} {escape(unit)}</text>')
    if not items:
        bars.append(f'<text x="10" y="20">no {escape(unit)} in this window</text>')
    return (f'<section><h2>{escape(title)}</h2><p class="how">{escape(how)}</p>'
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{label_w + bar_w + 120}" height="{h}" '
            f'font-family="sans-serif" font-size="12">{"".join(bars)}</svg></section>')


def _table(title: str, how: str, cols: list[str], rows: list[list[Any]], name: str) -> str:
    head = "".join(f"<th>{escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{escape(_fmt(c))}</td>" for c in r) + "</tr>" for r in rows)
    return (f'<section><h2>{escape(title)}</h2><p class="how">{escape(how)}</p>'
            f'<table data-figure="{escape(name)}" data-value="{len(rows)}"><tr>{head}</tr>{body or ""}</table>'
            f'{"" if rows else "<p>none</p>"}</section>')


def render_html(rep: dict[str, Any]) -> str:
    """The page of `fleetmend.report.build_report`'s dict."""
    how = rep.get("how") or {}
    w = rep["window"]
    figs = [
        _figure("gpu_hours", "GPU-hours out of service", rep["gpu_hours"], how.get("gpu_hours", ""), "GPU-h"),
        _figure("incidents", "incidents (drained) in the window", rep["incidents"], "records whose time out of "
                "service overlaps the window"),
        _figure("mttr_h", "MTTR (mean)", rep["mttr_h"]["mean"], how.get("mttr_h", ""), "h"),
        _figure("time_to_detect_s", "time to detect (mean)", rep["time_to_detect_s"]["mean"],
                how.get("time_to_detect_s", ""), "s"),
        _figure("time_to_drain_s", "time to drain (mean)", rep["time_to_drain_s"]["mean"],
                how.get("time_to_drain_s", ""), "s"),
        _figure("ticket_turnaround_h", "ticket turnaround (mean)", rep["ticket_turnaround_h"]["mean"],
                how.get("ticket_turnaround_h", ""), "h"),
        _figure("false_drain_rate", "false-drain rate", rep["false_drain_rate"], how.get("false_drain_rate", "")),
        _figure("slowness_gpu_hours", "GPU-hours lost to slow nodes", rep["slowness_gpu_hours"],
                how.get("slowness_gpu_hours", ""), "GPU-h"),
    ]
    charts = [
        bar_chart("gpu_hours_by_fault_class", "GPU-hours by fault class", rep["gpu_hours_by_fault_class"],
                  how.get("gpu_hours_by_fault_class", "")),
        bar_chart("gpu_hours_by_rack", "GPU-hours by rack", rep["gpu_hours_by_rack"], how.get("gpu_hours_by_rack", "")),
        bar_chart("gpu_hours_by_hw_class", "GPU-hours by hardware class", rep["gpu_hours_by_hw_class"],
                  how.get("gpu_hours_by_hw_class", "")),
    ]
    for key, values in (rep.get("gpu_hours_by_version") or {}).items():
        charts.append(bar_chart(f"gpu_hours_by_version.{key}", f"GPU-hours by {key}", values,
                                how.get("gpu_hours_by_version", "")))
    charts.append(bar_chart("outcomes", "Outcomes", {k: float(v) for k, v in rep["outcomes"].items()},
                            how.get("outcomes", ""), unit="incidents"))
    tables = [
        _table("Version findings", how.get("findings", ""),
               ["fault class", "key", "value", "faulty nodes with it", "faulty nodes", "fleet with it", "fleet",
                "expected", "test"],
               [[f["fault_class"], f["key"], f["value"], f["nodes_with_fault_and_value"], f["nodes_with_fault"],
                 f["fleet_nodes_with_value"], f["fleet_nodes"], f["expected"], f["test"]] for f in rep["findings"]],
               "findings"),
        _table("Lemon nodes", how.get("lemons", ""), ["node", "why"],
               [[x["node"], "; ".join(x["why"])] for x in rep["lemons"]], "lemons"),
        _table("Parts not replaced", how.get("parts_not_replaced", ""), ["node", "fault class", "part", "serial",
                                                                          "ticket"],
               [[x["node"], x["fault_class"], x["part"], x["serial"], x["ticket"]] for x in rep["parts_not_replaced"]],
               "parts_not_replaced"),
        _table("Cost of slowness (fail_slow)", how.get("slowness_gpu_hours", ""),
               ["node", "metric", "ratio", "lost pace", "slow h", "GPUs", "job", "GPU-h"],
               [[x["node"], x["metric"], x["ratio"], x["lost_pace"], x["slow_h"], x["gpus"], x["job"], x["gpu_hours"]]
                for x in rep["slowness"]], "slowness"),
    ]
    title = f"fleetmend report — {rep.get('cluster') or 'all clusters'}"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 24px; color: #222; max-width: 1100px; }}
h1 {{ font-size: 22px; }} h2 {{ font-size: 16px; margin-top: 28px; }}
.figs {{ display: grid; grid-template-columns: repeat(4, 1fr); gap: 12px; }}
.fig {{ border: 1px solid #ccd; border-radius: 6px; padding: 10px; }}
.label {{ font-size: 12px; color: #555; }} .value {{ font-size: 22px; font-weight: bold; margin: 4px 0; }}
.how {{ font-size: 11px; color: #666; }}
table {{ border-collapse: collapse; font-size: 12px; }} td, th {{ border: 1px solid #ccd; padding: 3px 6px; }}
</style></head><body>
<h1>{escape(title)}</h1>
<p>window: {escape(_when(w["since"]))} → {escape(_when(w["until"]))} ({_fmt(w["hours"])} h). Figures from the
incident ledger; each says how it was computed. The same figures: <code>fleetmend report --json</code>.</p>
<div class="figs">{"".join(figs)}</div>
{"".join(charts)}
{"".join(tables)}
</body></html>
"""


__all__ = ["bar_chart", "render_html"]
