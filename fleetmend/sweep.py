"""`fleetmend sweep`: the same short benchmark on many nodes at once, compared across them.

Pure functions (the `Sweep` workflow calls `compare` deterministically); the sweep's messages are in
`fleetmend.messages.sweep`:

- `compare(reports, outlier_pct)`: per metric, the median over the nodes that reported it and each
  node's ratio to it, oriented so that < 1 is always worse; a node more than `outlier_pct` % worse
  than the median on any metric is an outlier. Metrics are higher-is-better unless
  `lower_is_better(name)`: names ending `_s`, `_ms`, `_us`, `_ns` or containing `latency` or `time`,
  unless they name a rate (`_per_s`, `per_sec`, `gbps`, `bandwidth`, ...).

A metric reported by fewer than 3 nodes is listed but not judged (a median of two says nothing).
Which nodes a sweep asks (`gpu[01-64]`, a Slurm job's nodes) is the scheduler's: `activities.slurm`.
"""

from __future__ import annotations

import re
from statistics import median
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: the agent's parsers import `lower_is_better`, and
    # `fleetmend.messages` needs temporalio, which an agent-only install does not have (pyproject.toml)
    from fleetmend.messages.sweep import SweepFinding, SweepResult

MIN_NODES_TO_JUDGE = 3
MAX_METRICS_PER_NODE = 128
"""Metrics one node's report may carry into the workflow (the first by name); the rest are noted."""
MAX_SKIPPED_PER_NODE = 48
MAX_TEXT = 300
MAX_RESULT_CELLS = 10_000
"""Metric cells the `SweepResult` carries (~100 bytes each: far inside Temporal's 2 MiB payload
limit); beyond, a row keeps its outlying and worst cells only, and `SweepResult.clipped` says so."""
_LOWER = re.compile(r"(_s|_ms|_us|_ns)$|latency|time", re.I)
_RATE = re.compile(r"(per_s|per_sec|_ps|_hz)$|per_second|bandwidth|throughput|gbps|mbps", re.I)


def lower_is_better(name: str) -> bool:
    """True for durations and latencies (`step_time_ms`, `allreduce_latency_us`, `load_s`); rates
    stay higher-is-better (`tokens_per_s`, `busbw_gbps`, `samples_per_sec`)."""
    return not _RATE.search(name) and bool(_LOWER.search(name))


def clip_report(metrics: dict[str, float], skipped: dict[str, str],
                noise_pct: dict[str, float] | None = None) -> tuple[dict[str, float], dict[str, str], dict[str, float]]:
    """Bound one node's report before it enters the workflow: at most `MAX_METRICS_PER_NODE`
    metrics (the first by name; names up to 80 characters), `MAX_SKIPPED_PER_NODE` skipped entries of
    `MAX_TEXT` characters; what was left out is noted in skipped as `clipped`."""
    names = sorted(m for m in metrics if len(m) <= 80)
    kept = {m: metrics[m] for m in names[:MAX_METRICS_PER_NODE]}
    sk = {k[:80]: str(v)[:MAX_TEXT] for k, v in sorted(skipped.items())[:MAX_SKIPPED_PER_NODE]}
    if len(kept) < len(metrics):
        sk["clipped"] = (f"{len(metrics)} metrics reported; the first {len(kept)} by name kept "
                         f"(fleetmend.sweep.MAX_METRICS_PER_NODE)")
    if len(skipped) > MAX_SKIPPED_PER_NODE:
        sk["clipped_skipped"] = f"{len(skipped)} skipped entries; {MAX_SKIPPED_PER_NODE} kept"
    noise = {m: float(v) for m, v in (noise_pct or {}).items() if m in kept}
    return kept, sk, noise


def clip_result(res: SweepResult) -> SweepResult:
    """Keep `res` within `MAX_RESULT_CELLS` metric cells: each row keeps its outlying cells and its
    worst one, the medians stay, and `res.clipped` says how many cells were left out."""
    cells = sum(len(r.metrics) for r in res.rows)
    if cells <= MAX_RESULT_CELLS:
        return res
    for r in res.rows:
        r.metrics = {m: c for m, c in r.metrics.items() if c.outlier or m == r.worst_metric}
    left = sum(len(r.metrics) for r in res.rows)
    res.clipped = (f"{cells} metric cells; each node's outlying and worst ones kept ({left}), medians for all "
                   f"(fleetmend.sweep.MAX_RESULT_CELLS = {MAX_RESULT_CELLS})")
    return res


def compare(cluster: str, sweep_id: str, reports: dict[str, dict[str, float]], outlier_pct: float,
            skipped: dict[str, dict[str, str]] | None = None,
            not_answering: dict[str, str] | None = None,
            noise_pct: dict[str, dict[str, float]] | None = None) -> SweepResult:
    """Compare the nodes' numbers (node → metric → value). See module docstring for the rule.
    `noise_pct`: node → metric → spread of its repeated runs (%); the result gives each metric's
    median and largest spread (`SweepResult.noise_pct`, `noise_max_pct`)."""
    from fleetmend.messages.sweep import MetricCell, NodeRow, SweepResult

    res = SweepResult(cluster=cluster, sweep_id=sweep_id, outlier_pct=outlier_pct,
                      not_answering=dict(not_answering or {}))
    spreads: dict[str, list[float]] = {}
    for ns in (noise_pct or {}).values():
        for m, v in ns.items():
            spreads.setdefault(m, []).append(v)
    res.noise_pct = {m: round(median(v), 2) for m, v in sorted(spreads.items())}
    res.noise_max_pct = {m: round(max(v), 2) for m, v in sorted(spreads.items())}
    names = sorted({m for ms in reports.values() for m in ms})
    limit = 1 - outlier_pct / 100
    for m in names:
        vals = [ms[m] for ms in reports.values() if m in ms]
        res.medians[m] = median(vals)
        if len(vals) < MIN_NODES_TO_JUDGE:
            res.not_judged.append(m)
    for node in sorted(reports):
        row = NodeRow(node=node, skipped=dict((skipped or {}).get(node, {})))
        for m, v in sorted(reports[node].items()):
            med = res.medians[m]
            if lower_is_better(m):
                ratio = (med / v) if v > 0 else (1.0 if med == 0 else None)
            else:
                ratio = (v / med) if med > 0 else (1.0 if v == med else None)
            judged = m not in res.not_judged and ratio is not None
            out = bool(judged and ratio is not None and ratio < limit)
            row.metrics[m] = MetricCell(value=v, median=med, ratio=ratio, outlier=out)
            if judged and ratio is not None and (row.worst_ratio is None or ratio < row.worst_ratio):
                row.worst_metric, row.worst_ratio = m, ratio
        row.outlier = any(c.outlier for c in row.metrics.values())
        res.rows.append(row)
    return res




def findings(res: SweepResult) -> list[SweepFinding]:
    """One finding per outlier node: its worst judged metric."""
    from fleetmend.messages.sweep import SweepFinding

    out = []
    for r in res.rows:
        if r.outlier and r.worst_metric is not None and r.worst_ratio is not None:
            c = r.metrics[r.worst_metric]
            n = sum(1 for x in res.rows if r.worst_metric in x.metrics)
            out.append(SweepFinding(node=r.node, metric=r.worst_metric, value=c.value, median=c.median,
                                    ratio=r.worst_ratio, nodes=n))
    return out
