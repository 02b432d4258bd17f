"""Outliers that share a cause: a failure domain or a version, before any node is blamed (issue 28).

Pure computation, called by `core.Comparator.close_window` once a window's judgements are made and
before streaks are counted (`Explainer.explain`):

1. **Versions before nodes.** In one comparison group and metric, when at least `VERSION_MIN_NODES`
   outliers share a fingerprint value (`driver`, `vbios`: the agent's NVML versions, `PerfSample.hw`)
   that covers at least `VERSION_COVER` of the outliers, at least `VERSION_HOLDERS_OUT` of the
   value's holders are outliers, and some nodes of the group do not hold it, the outliers are one
   version finding ("vbios 96.00.89.00.01: SM clock / max 0.955 vs 0.985 in the group"), not N node
   incidents. A work-dependent metric is judged job by job, so the rule is also applied to a class's
   jobs pooled (`_versions_across_jobs`): a version on a quarter of a class has one or two nodes in
   most jobs, too few in any one. A version that splits the hardware class (the driver is part of `HardwareClass.key`,
   so nodes of two drivers are two groups and neither has outliers) is found by comparing the
   groups that differ only in the driver: a group whose median is beyond the metric's floor and
   `mad_k` MADs worse than every other driver's is a version finding.
2. **Domains before nodes.** A metric a failure domain can move (`MetricSpec.shared`: clocks,
   temperatures, thermal and power shares, IB errors, wait and rate, CPU throttling; not a PCIe
   width, links down or ECC, which are a node's own) outlying on at least `DOMAIN_MIN_NODES` nodes
   that share a domain (rack, leaf, PDU from the topology file, `fleetmend.policy.Topology`), and on
   at least `DOMAIN_MIN_SHARE` of that domain's judged nodes, is one domain finding. Without a
   topology (or for nodes it does not list) the domain is inferred from co-occurrence: at least
   `INFER_MIN_NODES` nodes (and at least twice as many as started on their own in any window of the
   last hour: independent faults start together as often as the fleet's fault rate makes them)
   whose outlier streaks on shared metrics start in the same window (on nodes judged normal before: the
   comparator's `new_streak`) are one inferred domain (nodes
   starting while it lasts join it), remembered while at least half of its nodes are still outliers. Outliers are counted
   per domain across every group and shared metric (a rack's nodes run different jobs).
3. Within an explained domain each node is judged again against the domain's own median (with the
   metric's floors and `mad_k` MADs): a node that is still an outlier there is still counted (a real
   fault in a hot rack is still found); the others' outlier windows are not counted (neither an
   outlier nor a normal window for their streaks).
4. A domain or version finding is reported once it has been seen in `windows` windows in a row, and
   once per episode: a reported one not seen for fewer than `windows` windows in a row (a job
   turnover left too few of its nodes busy) is the same episode when seen again, not a second
   report; one not yet reported is forgotten at once. Its nodes are judged as usual from the first
   window it is not seen in (no 24 h mute): only the report is remembered, not the explanation.
   Findings drain nothing: they are no node's fault.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from fleetmend.analyzer.metrics import judged_floors

VERSION_MIN_NODES = 3
VERSION_COVER = 0.8
"""Share of a group's outliers that must hold the version value."""
VERSION_HOLDERS_OUT = 0.5
"""Share of the value's holders in the group that must be outliers."""
DOMAIN_MIN_NODES = 3
DOMAIN_MIN_SHARE = 0.2
"""Share of a domain's judged nodes that must be outliers (3 of a 32-node rack are not enough)."""
INFER_MIN_NODES = 4
INFER_BACKGROUND_WINDOWS = 12
"""Windows (an hour at the defaults) over which the background of outliers starting on their own is
kept (`Explainer._infer_min`)."""
MAX_INFERRED = 1000
"""Inferred domains remembered at once (bounded whatever arrives)."""
FINGERPRINT_KEYS = ("driver", "vbios")



@dataclass
class GroupFinding:
    """One cause shared by several outliers: `kind` "domain" or "version"; `key` is the domain
    (`rack:r07`, `inferred:<window end>`) or the version (`vbios=96.00.89.00.01`,
    `driver=570.124.06`). A version: `metric` and `group` as judged, `value` the median of its nodes,
    `peer_median` the rest of the group's (or the other drivers' best). A domain: `metric` the
    metrics its nodes outlie on (comma-separated), `group` "*", `value` the share of the domain's
    judged nodes outlying, `peer_median` 0."""

    kind: str
    key: str
    metric: str
    group: str
    nodes: list[str]
    value: float
    peer_median: float
    windows: int
    window_end: float
    window_s: float
    reported: bool = False
    """Seen `windows` windows in a row, so reported (in this window or an earlier one of its episode)."""
    metrics: list[str] = field(default_factory=list)
    """Every metric its nodes outlied on in this episode (a domain's `metric`: those of this window; a version's:
    the one `value` and `peer_median` are of)."""

    def evidence(self) -> dict[str, Any]:
        return {"kind": self.kind, "key": self.key, "metric": self.metric, "group": self.group,
                "nodes": len(self.nodes), "node_list": ",".join(sorted(self.nodes)[:50]),
                "value": round(self.value, 6), "peer_median": round(self.peer_median, 6), "windows": self.windows,
                "window_end": self.window_end, "window_s": self.window_s,
                **({"metrics": ",".join(self.metrics)} if self.kind == "version" and len(self.metrics) > 1 else {})}


@dataclass
class _Episode:
    windows: int = 0
    reported: bool = False
    seen: bool = False
    missed: int = 0
    """Windows in a row a reported episode has not been seen (it ends at `windows`)."""
    metrics: set[str] = field(default_factory=set)
    """The metrics its nodes outlied on over the episode."""


@dataclass
class Explainer:
    """Domain and version findings of one comparator (see module docstring).

    Args:
        domains_of: node → its failure-domain keys (`FailureDomain.keys()`); None: no topology.
    """

    domains_of: Callable[[str], list[str]] | None = None
    enabled: bool = True
    """False: explain nothing (the rule before issue 28, for contrast in tests and benches)."""
    episodes: dict[str, _Episode] = field(default_factory=dict)
    inferred: dict[str, frozenset[str]] = field(default_factory=dict)
    """inferred domain key → its nodes."""
    starts: deque[int] = field(default_factory=lambda: deque(maxlen=INFER_BACKGROUND_WINDOWS))
    """How many outliers started on their own (no domain formed or joined) in each recent window."""
    explained_nodes: set[str] = field(default_factory=set)
    """Nodes of the domains and versions active in the last window (their job step times are not
    blamed on them either: `Comparator.explained_units`)."""

    def explain(self, judged: list[Any], fingerprints: dict[str, dict[str, str]], specs: dict[str, Any],
                cfg: Any, new_streak: Callable[[str, str], bool], end: float,
                domain_judged: list[Any] | None = None,
                ) -> tuple[list[Any], list[GroupFinding], list[GroupFinding]]:
        """(the judgements whose streaks count, findings reported now, all findings seen in this
        window). `judged`: `core._Judged` of one window; `fingerprints`: node → version values;
        `new_streak(node, metric)`: the node has no outlier streak on the metric yet. `domain_judged`:
        the judgements the domain rules read, when not `judged` (the comparator's by each node's role in
        its job: a role is no domain's cause, while a version shows against the job's median)."""
        self.explained_nodes = set()
        if not self.enabled:
            return judged, [], []
        seen: list[GroupFinding] = []
        explained: set[tuple[str, str]] = set()
        by_gm: dict[tuple[str, str], list[Any]] = {}
        for j in judged:
            by_gm.setdefault((j.group, j.metric), []).append(j)
        for (group, m), js in by_gm.items():
            seen += self._versions(group, m, js, fingerprints, explained, end, cfg)
        seen += self._versions_across_jobs(by_gm, fingerprints, explained, end, cfg)
        seen += self._driver_split(by_gm, specs, cfg, end)
        by_gm_dom = by_gm
        if domain_judged is not None:
            by_gm_dom = {}
            for j in domain_judged:
                by_gm_dom.setdefault((j.group, j.metric), []).append(j)
        seen += self._domains(by_gm_dom, specs, cfg, new_streak, explained, end)
        self.explained_nodes |= {n for n, _ in explained}
        keep = [j for j in judged if (j.node, j.metric) not in explained]
        return keep, self._persist(seen, cfg), seen

    # ------------------------------------------------------------------ versions

    def _versions(self, group: str, m: str, js: list[Any], fps: dict[str, dict[str, str]],
                  explained: set[tuple[str, str]], end: float, cfg: Any) -> list[GroupFinding]:
        out_nodes = [j for j in js if j.outlier]
        if len(out_nodes) < VERSION_MIN_NODES:
            return []
        found = []
        for key in FINGERPRINT_KEYS:
            vals = Counter(fps.get(j.node, {}).get(key) for j in out_nodes)
            vals.pop(None, None)
            if not vals:
                continue
            v, c = vals.most_common(1)[0]
            holders = [j for j in js if fps.get(j.node, {}).get(key) == v]
            if (c < VERSION_MIN_NODES or c < VERSION_COVER * len(out_nodes) or len(holders) == len(js)
                    or c < VERSION_HOLDERS_OUT * len(holders)):
                continue
            rest = [j.value for j in js if fps.get(j.node, {}).get(key) != v]
            explained.update((j.node, m) for j in holders)
            found.append(GroupFinding("version", f"{key}={v}", m, group, [j.node for j in holders],
                                      median(j.value for j in holders), median(rest), 0, end, cfg.window_s))
            break
        return found

    def _versions_across_jobs(self, by_gm: dict[tuple[str, str], list[Any]], fps: dict[str, dict[str, str]],
                              explained: set[tuple[str, str]], end: float, cfg: Any) -> list[GroupFinding]:
        """Rule 1 over a class's jobs pooled. A work-dependent metric is judged job by job (group
        `<class> job:<job>`), and a version on a quarter of a class puts one or two of its nodes in
        most jobs: too few in any one job for `VERSION_MIN_NODES`, so each would be a node finding
        (a drain). Pooled across the class's jobs (group `<class> job:*`), the outliers no job's
        own rule explained are judged again by rule 1: sharing a version, they are one version finding."""
        pooled: dict[tuple[str, str], list[Any]] = {}
        for (group, m), js in by_gm.items():
            cls, sep, _job = group.partition(" job:")
            if sep:
                pooled.setdefault((cls, m), []).extend(j for j in js if (j.node, m) not in explained)
        found: list[GroupFinding] = []
        for (cls, m), js in pooled.items():
            found += self._versions(f"{cls} job:*", m, js, fps, explained, end, cfg)
        return found

    def _driver_split(self, by_gm: dict[tuple[str, str], list[Any]], specs: dict[str, Any], cfg: Any,
                      end: float) -> list[GroupFinding]:
        """Groups `<model>x<n>|<driver>|<hca>` that differ only in the driver, per metric: one whose
        median is worse than every other driver's by the metric's floor and `mad_k` MADs."""
        base: dict[tuple[str, str], list[tuple[str, str, list[Any]]]] = {}
        for (group, m), js in by_gm.items():
            parts = group.split("|")
            if len(parts) != 3 or "(" in group or len(js) < cfg.min_group_size:
                continue  # not a hardware (or job-in-hardware) group of comparable size
            base.setdefault((f"{parts[0]}|{parts[2]}", m), []).append((parts[1], group, js))
        found = []
        for (_b, m), drivers in base.items():
            if len(drivers) < 2:
                continue
            spec = specs[m]
            low = spec.bad == "low"
            stats = []
            for drv, group, js in drivers:
                vals = [j.value for j in js]
                med = median(vals)
                stats.append((drv, group, js, med, median(abs(v - med) for v in vals) * 1.4826))
            for drv, group, js, med, _mad in stats:
                others = [s for s in stats if s[0] != drv]
                best = max(others, key=lambda s: s[3]) if low else min(others, key=lambda s: s[3])
                gap = (best[3] - med) if low else (med - best[3])
                # medians of whole groups: half the per-node floor, and mad_k standard errors of a median
                min_rel, min_abs = judged_floors(spec)
                thr = max(0.5 * min_rel * abs(best[3]), 0.5 * min_abs,
                          cfg.mad_k * 1.25 * max(_mad, best[4]) / len(js) ** 0.5)
                if gap > thr:
                    found.append(GroupFinding("version", f"driver={drv}", m, group, [j.node for j in js], med,
                                              best[3], 0, end, cfg.window_s))
        return found

    # ------------------------------------------------------------------ domains

    def _domains(self, by_gm: dict[tuple[str, str], list[Any]], specs: dict[str, Any], cfg: Any,
                 new_streak: Callable[[str, str], bool], explained: set[tuple[str, str]],
                 end: float) -> list[GroupFinding]:
        """Domains across every group and shared metric of the window (a rack's nodes run different
        jobs and classes: their outliers are counted together)."""
        js = [j for (_g, m), group_js in by_gm.items() if getattr(specs.get(m), "shared", False)
              for j in group_js if (j.node, m) not in explained]  # a version explained them already
        doms: dict[str, list[Any]] = {}
        known: set[str] = set()
        if self.domains_of is not None:
            for j in js:
                keys = self.domains_of(j.node)
                if keys:
                    known.add(j.node)
                for k in keys:
                    doms.setdefault(k, []).append(j)
        for key, nodes in list(self.inferred.items()):  # remembered while half its nodes still outlie
            members = [j for j in js if j.node in nodes]
            if len({j.node for j in members if j.outlier}) * 2 < len(nodes):
                del self.inferred[key]
                continue
            doms[key] = members
        in_inferred = set().union(*self.inferred.values()) if self.inferred else set()
        starting = {j.node for j in js if j.outlier and j.node not in known and j.node not in in_inferred
                    and new_streak(j.node, j.metric)}
        if starting and self.inferred:  # outliers starting while an inferred event is on join it
            key = max(self.inferred)
            self.inferred[key] = self.inferred[key] | starting
            doms[key] = [j for j in js if j.node in self.inferred[key]]
        elif len(starting) >= self._infer_min() and len(self.inferred) < MAX_INFERRED:
            key = f"inferred:{int(end)}"
            self.inferred[key] = frozenset(starting)
            doms[key] = [j for j in js if j.node in starting]
        else:
            self.starts.append(len(starting))  # the background: outliers that start in a window on their own
        found = []
        self.explained_nodes = set()
        for key, members in doms.items():
            out_nodes = {j.node for j in members if j.outlier}
            judged_nodes = {j.node for j in members}
            if key.startswith("inferred:"):
                active = bool(out_nodes)
            else:
                active = len(out_nodes) >= DOMAIN_MIN_NODES and len(out_nodes) >= DOMAIN_MIN_SHARE * len(judged_nodes)
            if not active:
                continue
            by_metric: dict[tuple[str, str], list[Any]] = {}
            for j in members:
                by_metric.setdefault((j.group, j.metric), []).append(j)
            still = {(n, m) for (_g, m), ms in by_metric.items() for n in self._rejudge(ms, specs[m], cfg)}
            expl = {(j.node, j.metric) for j in members if j.outlier and (j.node, j.metric) not in still}
            explained.update(expl)
            self.explained_nodes |= judged_nodes - {n for n, _ in still}
            metrics = sorted({m for _, m in expl})
            found.append(GroupFinding("domain", key, ",".join(metrics), "*", sorted({n for n, _ in expl}),
                                      len(out_nodes) / len(judged_nodes), 0.0, 0, end, cfg.window_s))
        return found

    def _infer_min(self) -> int:
        """Outliers that must start in one window to be taken for one inferred domain: `INFER_MIN_NODES`,
        or twice the most that started on their own in one of the last `INFER_BACKGROUND_WINDOWS`
        windows. Independent faults that start in the same window by chance are as many as a
        fleet's fault rate makes them; one shared cause starts far more at once."""
        return max(INFER_MIN_NODES, 2 * max(self.starts, default=0))

    @staticmethod
    def _rejudge(members: list[Any], spec: Any, cfg: Any) -> set[str]:
        """The members still outlying against the domain's own median (rule 3)."""
        if len(members) < 3:
            return set()
        vals = [j.value for j in members]
        med = median(vals)
        mad = 1.4826 * median(abs(v - med) for v in vals)
        min_rel, min_abs = judged_floors(spec)
        thr = max(cfg.mad_k * mad, min_rel * abs(med), min_abs)
        low = spec.bad == "low"
        return {j.node for j in members if j.outlier and ((med - j.value) if low else (j.value - med)) > thr}

    # ------------------------------------------------------------------ persistence

    def _persist(self, seen: list[GroupFinding], cfg: Any) -> list[GroupFinding]:
        """Count each finding's windows in a row; report at `windows`, once per episode; forget
        the ones not seen in this window."""
        now: dict[str, GroupFinding] = {}
        for f in seen:  # a domain or a version is one finding whatever metrics its nodes show (a VBIOS that
            k = f"{f.kind}/{f.key}"  # lowers clocks outlies on two clock metrics: one regression, one finding)
            if k in now:  # the same version in several groups (jobs) or metrics: one finding of all their nodes
                first = now[k]
                merged = GroupFinding(first.kind, first.key, first.metric,
                                      "*" if first.group != f.group else f.group, sorted({*first.nodes, *f.nodes}),
                                      first.value, first.peer_median, 0, first.window_end, first.window_s)
                if f.kind == "version":
                    merged.metrics = sorted({*(first.metrics or [first.metric]), f.metric})
                now[k] = merged
            else:
                now[k] = f
        for k in [k for k in self.episodes if k not in now]:
            ep = self.episodes[k]
            ep.missed += 1
            if not ep.reported or ep.missed >= cfg.windows:  # a reported one outlives a short gap
                del self.episodes[k]
        report = []
        for k, f in now.items():
            ep = self.episodes.setdefault(k, _Episode())
            ep.windows += 1
            ep.missed = 0
            f.windows = ep.windows
            # the nodes it explains now; the metrics of its whole episode (a version: `metric` is the one whose
            # value and peer median it gives)
            ep.metrics.update(m for m in (f.metric.split(",") if f.kind == "domain" else f.metrics or [f.metric]) if m)
            f.metrics = sorted(ep.metrics)
            if ep.windows >= cfg.windows and not ep.reported:
                ep.reported = True
                report.append(f)
            f.reported = ep.reported
        return report
