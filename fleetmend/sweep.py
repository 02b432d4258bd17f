"""`fleetmend sweep`: the same short benchmark on many nodes at once, compared across them.

Pure functions (the `Sweep` workflow calls `compare` deterministically); the sweep's messages are in
`fleetmend.messages.sweep`:

- `expand_hostlist("gpu[01-03,07],cpu1")` → `["gpu01", "gpu02", "gpu03", "gpu07", "cpu1"]`: Slurm
  hostlist syntax (comma-separated at the top level, bracket ranges with zero padding kept, several
  bracket groups per name). The CLI prefers `scontrol show hostnames` when Slurm is installed.
- `compare(reports, outlier_pct)`: per metric, the median over the nodes that reported it and each
  node's ratio to it, oriented so that < 1 is always worse; a node more than `outlier_pct` % worse
  than the median on any metric is an outlier. Metrics are higher-is-better unless
  `lower_is_better(name)`: names ending `_s`, `_ms`, `_us`, `_ns` or containing `latency` or `time`,
  unless they name a rate (`_per_s`, `per_sec`, `gbps`, `bandwidth`, ...).

A metric reported by fewer than 3 nodes is listed but not judged (a median of two says nothing).
"""

from statistics import median
import re

from fleetmend.messages.sweep import MetricCell, NodeRow, SweepFinding, SweepResult

MIN_NODES_TO_JUDGE = 3
_LOWER = re.compile(r"(_s|_ms|_us|_ns)$|latency|time", re.I)
_RATE = re.compile(r"(per_s|per_sec|_ps|_hz)$|per_second|bandwidth|throughput|gbps|mbps", re.I)


def lower_is_better(name: str) -> bool:
    """True for durations and latencies (`step_time_ms`, `allreduce_latency_us`, `load_s`); rates
    stay higher-is-better (`tokens_per_s`, `busbw_gbps`, `samples_per_sec`)."""
    return not _RATE.search(name) and bool(_LOWER.search(name))


def _split_top(text: str) -> list[str]:
    out, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in hostlist {text!r}")
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ValueError(f"unbalanced '[' in hostlist {text!r}")
    out.append("".join(cur))
    return [x.strip() for x in out if x.strip()]


def _expand_one(name: str) -> list[str]:
    m = re.search(r"\[([^\[\]]*)\]", name)
    if not m:
        if "[" in name or "]" in name:
            raise ValueError(f"bad hostlist item {name!r}")
        return [name]
    head, tail = name[:m.start()], name[m.end():]
    out = []
    for part in m.group(1).split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {part!r} in hostlist item {name!r} (expected N or N-M)")
        if not sep:
            nums = [lo]
        else:
            a, b = int(lo), int(hi)
            if b < a:
                raise ValueError(f"range {part!r} in {name!r} runs backwards")
            if b - a > 100_000:
                raise ValueError(f"range {part!r} in {name!r} is too large")
            width = len(lo) if lo.startswith("0") else 0
            nums = [str(n).zfill(width) for n in range(a, b + 1)]
        for n in nums:
            out.extend(_expand_one(head + n + tail))
    return out


def expand_hostlist(text: str) -> list[str]:
    """Expand a Slurm hostlist expression; order kept, duplicates dropped.

    Raises:
        ValueError: unbalanced brackets, a range that is not `N` or `N-M`, or runs backwards.
    """
    seen: dict[str, None] = {}
    for item in _split_top(text):
        for h in _expand_one(item):
            seen.setdefault(h, None)
    return list(seen)




def compare(cluster: str, sweep_id: str, reports: dict[str, dict[str, float]], outlier_pct: float,
            skipped: dict[str, dict[str, str]] | None = None,
            not_answering: dict[str, str] | None = None) -> SweepResult:
    """Compare the nodes' numbers (node → metric → value). See module docstring for the rule."""
    res = SweepResult(cluster=cluster, sweep_id=sweep_id, outlier_pct=outlier_pct,
                      not_answering=dict(not_answering or {}))
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
    out = []
    for r in res.rows:
        if r.outlier and r.worst_metric is not None and r.worst_ratio is not None:
            c = r.metrics[r.worst_metric]
            n = sum(1 for x in res.rows if r.worst_metric in x.metrics)
            out.append(SweepFinding(node=r.node, metric=r.worst_metric, value=c.value, median=c.median,
                                    ratio=r.worst_ratio, nodes=n))
    return out
