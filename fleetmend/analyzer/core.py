"""The fail-slow comparator: windows of per-node metrics → peer statistics → persistent outliers.

Pure computation (no NATS, no clock): `add(node, group, t, metrics)` files a sample's metrics into
the window `floor(t / window_s)`; `close_window(w)` judges that window and returns `Finding`s. The
service (`fleetmend.analyzer.service`) feeds it samples from the perf stream and closes windows by
the wall clock; the benchmark feeds it simulated days in seconds.

Rule, per window, hardware group (`HardwareClass.key`) and metric (`metrics.MetricSpec`):

1. A node's value is the median of its samples of that metric in the window (at least
   `min_samples_per_window` of them): one spike cannot move it. Load-dependent metrics exist only on
   busy samples, so busy nodes are compared with busy nodes and an idle node is not judged on them.
2. Fewer than `min_group_size` nodes with a value: the group is too small to compare; it is
   reported (`WindowResult.small_groups`) and nobody in it is judged.
3. Peer median m and scaled MAD s = 1.4826·median(|x − m|) (a robust σ: up to half the group may be
   outliers without moving either). The node is an outlier when its gap in the bad direction exceeds
   max(`mad_k`·s, min_rel·|m|, min_abs).
4. Outlier windows count up per node and metric; a judged window that is not an outlier resets the
   count; a window without a judgement (idle, no data) leaves it. `windows` in a row → a `Finding`,
   unless the same node and metric was reported less than `reopen_after_s` ago.

State (`to_state`/`from_state`, JSON-ready) is the counts, their evidence and the report times; the
open windows are rebuilt from the perf stream after a restart.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from fleetmend import __version__
from fleetmend.analyzer.metrics import SPECS, Derived, MetricSpec, device_of, specs_for
from fleetmend.config import AnalyzerSettings
from fleetmend.events import FaultEvent, Severity, Source

MAD_SCALE = 1.4826
"""MAD × 1.4826 estimates σ of normally distributed data (consistency constant)."""


@dataclass
class Finding:
    """A node that stayed an outlier: the evidence a `fail_slow` event carries."""

    node: str
    metric: str
    value: float
    peer_median: float
    ratio: float | None
    windows: int
    group: str
    group_size: int
    where: str
    threshold: float
    mad: float
    window_end: float
    """Epoch seconds at the end of the window that completed the streak."""
    window_s: float
    values: list[float] = field(default_factory=list)
    """The node's value in each window of the streak, oldest first."""

    def evidence(self) -> dict[str, Any]:
        return {"metric": self.metric, "value": round(self.value, 6), "peer_median": round(self.peer_median, 6),
                "ratio": None if self.ratio is None else round(self.ratio, 4), "windows": self.windows,
                "window_s": self.window_s, "group": self.group, "group_size": self.group_size,
                "device": self.where, "threshold": round(self.threshold, 6), "mad": round(self.mad, 6),
                "window_values": ",".join(f"{v:.4g}" for v in self.values)}


@dataclass
class SmallGroup:
    group: str
    metric: str
    size: int


@dataclass
class WindowResult:
    window: int
    nodes: int = 0
    judged: int = 0
    """(node, metric) pairs judged."""
    outliers: int = 0
    """(node, metric) pairs outlying in this window (before persistence)."""
    findings: list[Finding] = field(default_factory=list)
    small_groups: list[SmallGroup] = field(default_factory=list)


class _NodeWindow:
    __slots__ = ("group", "values", "where")

    def __init__(self, group: str) -> None:
        self.group = group
        self.values: dict[str, list[float]] = {}
        self.where: dict[str, str] = {}


class Comparator:
    """Windows and streaks of one cluster. See module docstring for the rule.

    Args:
        cfg: `AnalyzerSettings` (window_s, windows, min_samples_per_window, min_group_size, mad_k,
            reopen_after_s, min_ratio_sm_clock).
    """

    def __init__(self, cfg: AnalyzerSettings) -> None:
        self.cfg = cfg
        self.specs: dict[str, MetricSpec] = specs_for(cfg.min_ratio_sm_clock)
        self.open: dict[int, dict[str, _NodeWindow]] = {}
        self.last_closed: int = -1
        self.streaks: dict[str, dict[str, list[Any]]] = {}
        """node → metric → [count, [values], where]."""
        self.reported: dict[str, dict[str, float]] = {}
        """node → metric → epoch seconds of the last report."""
        self.late = 0

    def window_of(self, t: float) -> int:
        return int(t // self.cfg.window_s)

    def add(self, node: str, group: str, t: float, metrics: Derived) -> bool:
        """File one sample's metrics (taken at epoch `t`). Returns False when its window is already
        judged (a late sample; counted in `late`)."""
        w = int(t // self.cfg.window_s)
        if w <= self.last_closed:
            self.late += 1
            return False
        win = self.open.get(w)
        if win is None:
            win = self.open[w] = {}
        nw = win.get(node)
        if nw is None:
            nw = win[node] = _NodeWindow(group)
        else:
            nw.group = group
        values, where = nw.values, nw.where
        for m, (v, wh) in metrics.items():
            lst = values.get(m)
            if lst is None:
                values[m] = [v]
            else:
                lst.append(v)
            where[m] = wh
        return True

    def due(self, now: float) -> list[int]:
        """Open windows whose end + `grace_s` is at or before `now` (epoch seconds), oldest first."""
        limit = now - self.cfg.grace_s
        return sorted(w for w in self.open if (w + 1) * self.cfg.window_s <= limit)

    def close_window(self, w: int) -> WindowResult:
        """Judge window `w` (and drop it, and any older open window, from memory)."""
        cfg = self.cfg
        for old in [x for x in self.open if x < w]:
            del self.open[old]
        nodes = self.open.pop(w, {})
        self.last_closed = max(self.last_closed, w)
        res = WindowResult(window=w, nodes=len(nodes))
        groups: dict[tuple[str, str], list[tuple[str, float, str]]] = {}
        min_n = cfg.min_samples_per_window
        for node, nw in nodes.items():
            for m, vals in nw.values.items():
                if len(vals) < min_n:
                    continue
                groups.setdefault((nw.group, m), []).append((node, median(vals), nw.where[m]))
        end = (w + 1) * cfg.window_s
        for (group, m), items in groups.items():
            n = len(items)
            if n < cfg.min_group_size:
                res.small_groups.append(SmallGroup(group, m, n))
                continue
            spec = self.specs.get(m)
            if spec is None:
                continue
            vals = sorted(v for _, v, _ in items)
            med = median(vals)
            mad = MAD_SCALE * median(abs(v - med) for v in vals)
            thr = max(cfg.mad_k * mad, spec.min_rel * abs(med), spec.min_abs)
            low = spec.bad == "low"
            for node, v, wh in items:
                res.judged += 1
                gap = (med - v) if low else (v - med)
                per_node = self.streaks.get(node)
                if gap <= thr:
                    if per_node and m in per_node:
                        del per_node[m]
                        if not per_node:
                            del self.streaks[node]
                    continue
                res.outliers += 1
                if per_node is None:
                    per_node = self.streaks[node] = {}
                st = per_node.get(m)
                if st is None:
                    st = per_node[m] = [0, [], wh]
                st[0] += 1
                st[1] = (st[1] + [v])[-cfg.windows:]
                st[2] = wh
                if st[0] < cfg.windows:
                    continue
                last = self.reported.get(node, {}).get(m)
                if last is not None and end - last < cfg.reopen_after_s:
                    continue
                self.reported.setdefault(node, {})[m] = end
                res.findings.append(Finding(
                    node=node, metric=m, value=v, peer_median=med, ratio=(v / med) if med else None,
                    windows=st[0], group=group, group_size=n, where=wh, threshold=thr, mad=mad,
                    window_end=end, window_s=cfg.window_s, values=list(st[1])))
        return res

    # ------------------------------------------------------------------ state

    def to_state(self) -> dict[str, Any]:
        """JSON-ready state: last judged window, streaks with evidence, report times."""
        return {"version": 1, "last_closed": self.last_closed, "window_s": self.cfg.window_s,
                "streaks": self.streaks, "reported": self.reported}

    def load_state(self, state: dict[str, Any]) -> None:
        """Adopt a state written by `to_state` (a restart, or a standby taking over). A state written
        with a different `window_s` keeps the report times only (its window numbers mean other times)."""
        self.reported = {n: {m: float(t) for m, t in ms.items()} for n, ms in state.get("reported", {}).items()}
        if float(state.get("window_s", self.cfg.window_s)) != self.cfg.window_s:
            return
        self.last_closed = max(self.last_closed, int(state.get("last_closed", -1)))
        self.streaks = {n: {m: [int(s[0]), [float(x) for x in s[1]], str(s[2])] for m, s in ms.items()}
                        for n, ms in state.get("streaks", {}).items()}
        for w in [x for x in self.open if x <= self.last_closed]:
            del self.open[w]

    def forget_reports_before(self, t: float) -> None:
        """Drop report times older than `reopen_after_s` before `t` (bounds the state's size)."""
        keep = t - self.cfg.reopen_after_s
        for node in list(self.reported):
            ms = {m: x for m, x in self.reported[node].items() if x >= keep}
            if ms:
                self.reported[node] = ms
            else:
                del self.reported[node]


def finding_event(f: Finding, cluster: str, spec: MetricSpec | None = None) -> FaultEvent:
    """The `fail_slow` FaultEvent (severity degraded, source analyzer) of a finding.

    The event id is derived from the window end, node and metric, so two replicas reporting the same
    finding (a failover inside the window) are deduplicated by JetStream's Nats-Msg-Id.
    """
    spec = spec or SPECS.get(f.metric)
    ns = int(f.window_end * 1e9)
    suffix = hashlib.sha1(f"{cluster}/{f.node}/{f.metric}".encode()).hexdigest()[:8]
    label = spec.label if spec else f.metric
    ratio = f" (ratio {f.ratio:.3f})" if f.ratio is not None else ""
    msg = (f"fail-slow: {label} {f.value:.4g} vs peer median {f.peer_median:.4g}{ratio} on {f.where}, "
           f"outlier in {f.windows} consecutive {f.window_s:g} s windows among {f.group_size} peers of {f.group}")
    return FaultEvent(
        event_id=f"{ns:016x}{suffix}", cluster=cluster, node=f.node,
        component=spec.component if spec else "gpu", device=device_of(f.where), kind="fail_slow",
        severity=Severity.DEGRADED, message=msg, source=Source.ANALYZER, agent_version=__version__,
        attrs=f.evidence(), raw=msg)
