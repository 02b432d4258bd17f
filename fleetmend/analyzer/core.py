"""The fail-slow comparator: windows of per-node metrics → peer statistics → persistent outliers.

Pure computation (no NATS, no clock): `add(node, group, t, metrics, now=...)` files a sample's metrics
into the window `floor(t / window_s)`; `note_job(node, job, t)` says the node ran `job` then;
`close_window(w)` judges that window and returns `Finding`s. The service
(`fleetmend.analyzer.service`) feeds it samples from the perf stream and closes windows by the wall
clock; the benchmark feeds it simulated days in seconds.

Rule, per window, comparison group and metric (`metrics.MetricSpec`):

1. A node's value is the median of its samples of that metric in the window (at least
   `min_samples_per_window` of them): one spike cannot move it; of a quantized metric, the
   interpolated median (`window_value`), which resolves finer than one step; of a bursty error
   counter, the share of its samples of the last 2·`windows` windows that exceed the group's level
   by the metric's floor (how often it bursts, not a median of 0; `_judge_bursts`, rule 4b).
   Load-dependent metrics exist only on
   busy samples, so busy nodes are compared with busy nodes and an idle node is not judged on them.
2. Like with like. A hardware-own metric is compared across the hardware group (`HardwareClass.key`).
   A work-dependent metric (`MetricSpec.work_dependent`: power cap share, clocks and temperature
   under load, IB wait, CPU frequency) is compared only among the nodes of one job within the
   hardware group, group `<hardware key> job:<job>`. The scheduler's word comes first (`note_sched`:
   the nodes Slurm or Kubernetes runs the job on, group `job:sched:<job>`), then the job the node's own
   step times name (`note_job`). A node whose job is unknown in the window (neither, or more than one
   job) is **not judged** on work-dependent metrics: the analyzer rather
   misses a finding than drains a healthy node because its work differs from its neighbours'.
   Those skipped judgements are counted (`WindowResult.no_job`).
3. Fewer than `min_group_size` nodes with a value: the group is too small to compare; it is
   reported (`WindowResult.small_groups`, with how it was judged instead; job groups only counted,
   `small_job_groups`, and not judged). A hardware group's nodes are judged alone
   (`_judge_alone`): against the class's fixed expectation (`MetricSpec.expected`) where the metric
   has one, else each against its own history, with the metric's floors.
4. Peer median m and scaled MAD s = 1.4826·median(|x − m|) (a robust σ: up to half the group may be
   outliers without moving either); for a quantized metric (`MetricSpec.quantum`) the median of the
   deviations is interpolated within one-quantum bins (`quantized_mad`). The node is an outlier
   when its gap in the bad direction exceeds max(`mad_k`·s, min_rel·|m|, min_abs).
4b. A bursty counter (`MetricSpec.bursty`) is judged on shares of samples: the group's level L is
   the median of its nodes' window medians (0 on healthy links), a sample exceeds when it is above
   L + max(min_abs, min_rel·L), a node's share is its exceeding samples over its pool's (a young
   pool counts as full: as many bursts as a full pool would need), and it is an outlier when its
   share is at least `metrics.BURST_SHARE` and above the peers' median share p by more than
   `mad_k`·max(s, √(p(1−p)/n)) (s: the shares' scaled MAD interpolated within one sample's step, n:
   the node's pooled samples): how often it bursts against how often its peers do, so healthy nodes
   that all burst often (heavy noise) are not flagged for bursting a little more by chance. The same
   is judged at a second height, `BURST_BIG` times the largest burst a typical peer had in its pool:
   bursts far bigger than any healthy node's are an outlier even where every node bursts as often.
5. Own baseline (`MetricSpec.baseline_windows` = b > 0; the step times of a job's ranks). A member's
   ratio to the group median over its first b judged windows in that group is its own offset (rank
   0 of a job may be 10 % slower by design); it is not judged until the offset is known, and from
   then on its value divided by its offset is judged against the others' (rule 4). A member
   consistently slower through the group's whole life is therefore never slow; one that becomes
   slower later is. Offsets are forgotten `baseline_ttl_s` after their member was last seen.
5b. Roles within a job. A work-dependent metric judged in a job group (rule 2) is judged the same way,
   with an additive offset: a member's difference from the group median over its first
   `job_baseline_windows` (3) judged windows in that job is its role's (a prefill or first pipeline stage at
   the power cap half the time where its peers are at 12 %, a parameter server waiting 4x more on IB, a
   data-loader rank at a lower CPU turbo, a GPU at the top of the rack running 9 °C warmer: all healthy,
   and each was flagged against its job's median before), and from then on its value less that offset is
   judged against the others'. A member that becomes worse in its job is found; one that was worse from
   the job's start is left to the hardware-own metrics (rule 2: free clocks, link width and rate, error
   counters, brakes), which compare it across the class, and to its next job.
6. Outlier windows count up per node and metric; a judged window that is not an outlier resets the
   count; a window without a judgement (idle, no data, no job) leaves it. `windows` in a row → a
   `Finding`, unless the same node and metric was reported less than `reopen_after_s` ago. An
   outlier window that a failure domain or a version explains (`shared.Explainer`) is the shared
   cause's: the node's count on that metric starts again, and an earlier report of it is forgotten
   (FleetGuard denied its incident as the domain's), so once the cause clears the node is judged as
   any other, from its next window (no `reopen_after_s` mute).

Nothing one node sends can poison a median or the memory: a value that is not finite or outside
its metric's physical range (`MetricSpec.lo`..`hi`) is dropped; with `now` given, a sample dated more
than `max_skew_s` after `now` (`fleetmend.events.MAX_CLOCK_SKEW_S`) or older than the windows still
open can be (`window_s + grace_s + max_skew_s` before `now`) is dropped, so at most
`(window_s + grace_s + 2·max_skew_s) / window_s + 2` windows are open whatever timestamps arrive; a
node files at most `max_samples_per_window` samples into one window. Every drop is counted by reason
in `dropped`. One node gives one value per group, so it weighs as one member of any median; where
one node speaks for several members (the ranks it runs of a job), `unit_of` makes the group's
median and MAD one value per node, so it still weighs as one member.

State (`to_state`/`from_state`, JSON-ready) is the counts, their evidence, the report times and the
baselines; the open windows are rebuilt from the perf stream after a restart.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from fleetmend import __version__
from fleetmend.analyzer.metrics import BURST_SHARE, SPECS, Derived, MetricSpec, device_of, judged_floors, specs_for
from fleetmend.analyzer.shared import Explainer, GroupFinding
from fleetmend.config import AnalyzerSettings
from fleetmend.events import MAX_CLOCK_SKEW_S, FaultEvent, Severity, Source

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
    baseline: float | None = None
    """Rule 5: the member's own offset against its group (value and peer_median are in its units)."""
    burst_over: float | None = None
    """Rule 4b, a bursty counter: the rate a sample had to exceed; value, peer_median, threshold and
    mad are then shares of samples."""
    offset: float | None = None
    """Rule 5b: the member's own (role's) offset from its job group's median, in the metric's units
    (value and peer_median include it)."""

    def evidence(self) -> dict[str, Any]:
        return {"metric": self.metric, "value": round(self.value, 6), "peer_median": round(self.peer_median, 6),
                "ratio": None if self.ratio is None else round(self.ratio, 4), "windows": self.windows,
                "window_s": self.window_s, "group": self.group, "group_size": self.group_size,
                "device": self.where, "threshold": round(self.threshold, 6), "mad": round(self.mad, 6),
                "window_values": ",".join(f"{v:.4g}" for v in self.values),
                **({} if self.baseline is None else {"baseline_ratio": round(self.baseline, 4)}),
                **({} if self.offset is None else {"role_offset": round(self.offset, 6)}),
                **({} if self.burst_over is None else {"burst_over": round(self.burst_over, 6)})}


@dataclass
class SmallGroup:
    """A (group, metric) with fewer than `min_group_size` nodes; `judged`: how its nodes were judged
    instead (`expected`: the class's fixed expectation, `own_history`: each against its own past;
    "": not at all)."""

    group: str
    metric: str
    size: int
    judged: str = ""


@dataclass
class _Judged:
    """One node's judgement of one metric in one window, before streaks are counted."""

    node: str
    metric: str
    value: float
    where: str
    group: str
    size: int
    median: float
    mad: float
    threshold: float
    outlier: bool
    baseline: float | None
    burst_over: float | None = None
    """A bursty counter (rule 4b): the rate a sample had to exceed; the numbers above are shares."""
    offset: float | None = None
    """Rule 5b: the member's own offset, subtracted from `value` and `median` here."""


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
    small_job_groups: int = 0
    """(job, metric) groups of a work-dependent metric with fewer than `min_group_size` nodes."""
    no_job: int = 0
    """(node, metric) values of work-dependent metrics not judged: the node's job is unknown."""
    shared_findings: list[GroupFinding] = field(default_factory=list)
    """Domain and version findings reported in this window (they drain nothing)."""
    shared_seen: list[GroupFinding] = field(default_factory=list)
    """Every domain and version finding seen in this window (reported or still counting)."""
    explained: int = 0
    """(node, metric) outlier windows explained by a domain or version, not counted for the node."""


MAX_SAMPLES_PER_WINDOW = 600
"""Samples one node may file into one window (an agent at 1 s samples over a 10 min window); more are
dropped (`dropped["flood"]`): one chatty node cannot grow the analyzer's memory."""
MAX_JOBS_PER_WINDOW = 4
"""Distinct jobs remembered per node and window; a node with more than one is not judged on
work-dependent metrics anyway."""
MAX_VALUES_PER_METRIC = 64
"""Values kept per node, metric and window: beyond, every other one is let go and from then on one
sample in 2, 4, … is kept (`_NodeWindow.stride`), so the window's median still spans the whole
window while memory stays fixed however fast a node samples."""
MAX_NODES_PER_WINDOW = 100_000
"""Distinct nodes filed into one window; a new node beyond is dropped (`dropped["too_many_nodes"]`):
a flood of made-up names (a NATS without per-node credentials) cannot grow the memory."""
MAX_BASELINE_MEMBERS = 200_000
"""Members whose own offset (rule 5) is learnt at once, over all groups; a new member beyond is not
judged until room is made (`dropped["baselines_full"]`)."""
MAX_BASELINE_PER_UNIT = 1024
"""Members one unit (`Comparator.unit_of`: the node that speaks for them) holds offsets for at once; a
new member beyond is not learnt (`dropped["baselines_unit_full"]`). An honest node holds its GPUs'
ranks of its recent jobs (8 GPUs: a few dozen); a node that claims 1,024 GPUs and new ranks of 4
jobs every window would otherwise hold ~49,000 within the hour, a quarter of `MAX_BASELINE_MEMBERS`,
and a handful of such nodes (or one in a fleet of ~20,000 8-GPU nodes) would leave every honest rank
unjudged."""
OWN_HISTORY_WINDOWS = 3
"""Windows a node of a group too small to compare is measured before its own history judges it."""
STREAK_TTL_S = 3600.0
"""A streak whose node has not been judged on that metric for this long is forgotten (the node left):
streaks are bounded by the nodes seen in the last hour."""
BASELINE_TTL_S = 3600.0
"""A member's own offset (rule 5) is forgotten this long after it was last judged (the job ended or
moved): a job id reused later starts a new baseline."""


class _NodeWindow:
    __slots__ = ("group", "values", "where", "jobs", "sched", "n", "stride", "fp")

    def __init__(self, group: str) -> None:
        self.group = group
        self.fp: dict[str, str] = {}
        """Version values of the node (`driver`, `vbios`), for version findings."""
        self.values: dict[str, list[float]] = {}
        self.where: dict[str, str] = {}
        self.jobs: set[str] = set()
        """Jobs the node reported step times of in the window (`note_job`)."""
        self.sched: set[str] = set()
        """Jobs the scheduler says the node ran in the window (`note_sched`): they take precedence."""
        self.n = 0
        self.stride = 1
        """Every `stride`-th sample is kept (doubles each time a metric fills `MAX_VALUES_PER_METRIC`)."""

    def thin(self) -> None:
        """Keep every other value of every metric and halve the rate at which new ones are kept."""
        for m, lst in self.values.items():
            self.values[m] = lst[::2]
        self.stride *= 2


class Comparator:
    """Windows and streaks of one cluster. See module docstring for the rule.

    Args:
        cfg: `AnalyzerSettings` (window_s, windows, min_samples_per_window, min_group_size, mad_k,
            reopen_after_s, min_ratio_sm_clock, grace_s).
        max_skew_s: how far a sample's time may be ahead of `now` (`events.MAX_CLOCK_SKEW_S`).
    """

    def __init__(self, cfg: AnalyzerSettings, max_skew_s: float = MAX_CLOCK_SKEW_S,
                 unit_of: Callable[[str], str] | None = None,
                 domains_of: Callable[[str], list[str]] | None = None) -> None:
        self.cfg = cfg
        self.explainer = Explainer(domains_of)
        self.explained_units: set[str] = set()
        """Units (`unit_of`) whose outlier windows are not counted in the next judged window: the
        nodes another comparator's domain or version findings explain (the analyzer sets it for
        the job comparator from the node comparator's `explainer.explained_nodes`)."""
        """Domain and version findings (`fleetmend.analyzer.shared`): outliers sharing a cause."""
        self.max_skew_s = max_skew_s
        self.unit_of = unit_of
        """Member key → the sender it weighs as (the job comparator: `<node>/<rank>` → `<node>`): a
        group's median and MAD are taken over one value per unit (the median of its members), so a
        node that speaks for many ranks moves them as one member (None: every member is its own)."""
        self.specs: dict[str, MetricSpec] = specs_for(cfg.min_ratio_sm_clock)
        self.open: dict[int, dict[str, _NodeWindow]] = {}
        self.last_closed: int = -1
        self.streaks: dict[str, dict[str, list[Any]]] = {}
        """node → metric → [count, [values], where, epoch seconds of its last outlier window]."""
        self._baseline_members = 0
        self._unit_members: Counter[str] = Counter()
        """Unit → members it holds offsets for (`MAX_BASELINE_PER_UNIT`)."""
        self.own: dict[str, dict[str, list[Any]]] = {}
        """node → metric → [its own reference or None, [values so far], epoch seconds last judged]
        (rule 3: a group too small to compare)."""
        self._bursts: dict[str, dict[str, deque[tuple[int, list[float]]]]] = {}
        """node → bursty metric → (samples, highest values) of its last `windows` windows."""
        self.reported: dict[str, dict[str, float]] = {}
        """node → metric → epoch seconds of the last report."""
        self.normal_at: dict[str, float] = {}
        """node → epoch seconds of its last window judged normal on some metric. An outlier streak is a start
        (for `shared.Explainer`'s inferred domains) only on a node seen normal before: outliers that were
                already there when the analyzer first ran did not start together, and taken for one inferred domain
        they hid every independent fault that started later (an adversarial run: a GPU 20 % slow, never
        drained). Kept in the state, so a restart does not forget who was normal."""
        self.baselines: dict[str, dict[str, list[Any]]] = {}
        """group → member → [offset or None, [ratios so far], epoch seconds last judged] (rule 5)."""
        self.skewed: dict[str, Counter[str]] = {}
        """Node → reason → samples of that node dropped for their time (`take_skewed`)."""
        self.dropped: Counter[str] = Counter()
        """Reason → samples or values dropped at the door: `late` (window judged), `future`, `stale`,
        `flood`, `non_finite:<metric>`, `out_of_range:<metric>`."""

    @property
    def late(self) -> int:
        return self.dropped["late"]

    def window_of(self, t: float) -> int:
        return int(t // self.cfg.window_s)

    def _admit(self, t: float, now: float | None, node: str) -> int | None:
        """The window of time `t`, or None (counted in `dropped`, and per node in `skewed`) when it
        cannot be filed."""
        if not math.isfinite(t):
            self.dropped["non_finite:time"] += 1
            return None
        reason = None
        if now is not None and t > now + self.max_skew_s:
            reason = "future"
        elif now is not None and t < now - self.cfg.window_s - self.cfg.grace_s - self.max_skew_s:
            reason = "stale"
        elif t // self.cfg.window_s <= self.last_closed:
            reason = "late"
        if reason is None:
            return int(t // self.cfg.window_s)
        self.dropped[reason] += 1
        per = self.skewed.get(node)
        if per is None and len(self.skewed) < MAX_NODES_PER_WINDOW:
            per = self.skewed[node] = Counter()
        if per is not None:
            per[reason] += 1
        return None

    def take_skewed(self) -> dict[str, dict[str, int]]:
        """Node → reason (`late`, `future`: early, `stale`) → samples dropped since the last call
        (and forget them): a node whose clock is behind or ahead is named, not silently dropped."""
        out = {n: dict(c) for n, c in self.skewed.items()}
        self.skewed.clear()
        return out

    def _node_window(self, w: int, node: str, group: str) -> tuple[_NodeWindow | None, bool]:
        """`node`'s entry in open window `w` (made with `group` when missing), and whether it was made
        now; None when the window holds `MAX_NODES_PER_WINDOW` other nodes already."""
        win = self.open.get(w)
        if win is None:
            win = self.open[w] = {}
        nw = win.get(node)
        if nw is None:
            if len(win) >= MAX_NODES_PER_WINDOW:
                return None, False
            nw = win[node] = _NodeWindow(group)
            return nw, True
        return nw, False

    def add(self, node: str, group: str, t: float, metrics: Derived, now: float | None = None,
            fingerprint: dict[str, str] | None = None) -> bool:
        """File one sample's metrics (taken at epoch `t`; `now`: the receiver's clock, which bounds
        the windows that can open). Returns False when the sample is dropped: its window is already
        judged (late), it is dated beyond the clock skew ahead of `now` (future) or before any window
        still open (stale), or its node filled the window (flood); each counted in `dropped`. Values
        that are not finite or outside their metric's range are dropped one by one (counted)."""
        w = self._admit(t, now, node)
        if w is None:
            return False
        nw, new = self._node_window(w, node, group)
        if nw is None:
            self.dropped["too_many_nodes"] += 1
            return False
        if not new:
            if nw.n >= MAX_SAMPLES_PER_WINDOW:
                self.dropped["flood"] += 1
                return False
            nw.group = group
        if fingerprint:
            nw.fp = fingerprint
        nw.n += 1
        if nw.n % nw.stride:
            return True  # thinned: this window already holds its share of this node's samples
        values, where, specs = nw.values, nw.where, self.specs
        for m, (v, wh) in metrics.items():
            spec = specs.get(m)
            if not math.isfinite(v):
                self.dropped[f"non_finite:{m}"] += 1
                continue
            if spec is not None and not spec.lo <= v <= spec.hi:
                self.dropped[f"out_of_range:{m}"] += 1
                continue
            lst = values.get(m)
            if lst is None:
                values[m] = [v]
            else:
                lst.append(v)
                if len(lst) >= MAX_VALUES_PER_METRIC:
                    nw.thin()
                    values = nw.values
            where[m] = wh
        return True

    def note_job(self, node: str, job: str, t: float, now: float | None = None) -> bool:
        """Record that `node` ran `job` at epoch `t` (it reported a step time then): in that window its
        work-dependent metrics are compared with the other nodes of `job`. Same time rules as `add`."""
        nw = self._job_window(node, t, now)
        if nw is None:
            return False
        if len(nw.jobs) < MAX_JOBS_PER_WINDOW:
            nw.jobs.add(job)
        return True

    def note_sched(self, node: str, job: str, t: float, now: float | None = None) -> bool:
        """Record that the scheduler says `node` ran `job` at epoch `t` (Slurm job → nodes, a Kubernetes
        job's pods → nodes). In that window the scheduler's word decides the node's job (group
        `job:sched:<job>`), whether or not the node reports step times; a node the scheduler puts in
        two jobs at once (a shared node) has no single job and is not judged on work-dependent metrics.
        Same time rules as `add`."""
        nw = self._job_window(node, t, now)
        if nw is None:
            return False
        if len(nw.sched) < MAX_JOBS_PER_WINDOW:
            nw.sched.add(job)
        return True

    def _job_window(self, node: str, t: float, now: float | None) -> _NodeWindow | None:
        """`node`'s window at epoch `t` for a job note (`note_job`, `note_sched`), or None when the time rules
        of `add` refuse `t` or the window holds too many nodes already (counted)."""
        w = self._admit(t, now, node)
        if w is None:
            return None
        nw, _ = self._node_window(w, node, "")
        if nw is None:
            self.dropped["too_many_nodes"] += 1
        return nw

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
        res = WindowResult(window=w, nodes=sum(1 for nw in nodes.values() if nw.values))
        groups: dict[tuple[str, str], list[tuple[str, float, str]]] = {}
        min_n = cfg.min_samples_per_window
        specs = self.specs
        seen_bursty: set[tuple[str, str]] = set()
        pools: dict[tuple[str, str], deque[tuple[int, list[float]]]] = {}
        for node, nw in nodes.items():
            if nw.sched:  # the scheduler's word first: every node of the job, reporting or not
                job = f"sched:{next(iter(nw.sched))}" if len(nw.sched) == 1 else None
            else:
                job = next(iter(nw.jobs)) if len(nw.jobs) == 1 else None
            for m, vals in nw.values.items():
                if len(vals) < min_n:
                    continue
                spec = specs.get(m)
                if spec is None:
                    continue
                if spec.work_dependent:
                    if job is None:
                        res.no_job += 1
                        continue
                    key = f"{nw.group} job:{job}"
                else:
                    key = nw.group
                if spec.bursty:  # rule 4b: pooled now, judged once the group's level is known
                    pools[(node, m)] = self._pool_bursts(node, m, vals, seen_bursty)
                    value = median(vals)
                else:
                    value = window_value(vals, spec.quantum)
                groups.setdefault((key, m), []).append((node, value, nw.where[m]))
        for node in list(self._bursts):  # bounded by the nodes of the last window
            kept = {m: h for m, h in self._bursts[node].items() if (node, m) in seen_bursty}
            if kept:
                self._bursts[node] = kept
            else:
                del self._bursts[node]
        end = (w + 1) * cfg.window_s
        judged: list[_Judged] = []
        by_role: dict[tuple[str, str, str], _Judged | None] = {}
        """Rule 5b: (node, metric, job group) → its judgement with its role's offset removed (None: offset not
        known yet). The explainer sees the judgements against the job's median (a version or a domain shows
        there); a node's streak counts the one by its role."""
        for (group, m), items in groups.items():
            spec = specs[m]
            scale: dict[str, float] = {}
            if spec.baseline_windows > 0:
                items, scale = self._with_baselines(group, items, spec.baseline_windows, end)
            elif spec.work_dependent and " job:" in group and not spec.bursty:
                by_role.update(self._judge_by_role(group, m, spec, items, end))
            n = len(items)
            if spec.bursty:
                judged += self._judge_bursts(group, m, spec, items, pools, res)
                continue
            if n < cfg.min_group_size:
                if spec.work_dependent and " job:" in group:
                    res.small_job_groups += 1
                    continue
                if spec.baseline_windows > 0:
                    if n:
                        res.small_groups.append(SmallGroup(group, m, n))
                    continue
                res.small_groups.append(SmallGroup(group, m, n, "expected" if spec.expected is not None
                                                   else "own_history"))
                judged += self._judge_alone(group, m, spec, items, end)
                continue
            vals = self._unit_values(items)
            med = median(vals)
            mad = MAD_SCALE * quantized_mad(vals, med, spec.quantum)
            thr = max(cfg.mad_k * mad, spec.min_rel * abs(med), spec.min_abs)
            low = spec.bad == "low"
            for node, v, wh in items:
                gap = (med - v) if low else (v - med)
                judged.append(_Judged(node, m, v, wh, group, n, med, mad, thr, gap > thr, scale.get(node)))
        fps = {node: nw.fp for node, nw in nodes.items() if nw.fp}
        for j in self._explain(res, judged, end, fps, by_role):
            if (j.node, j.metric, j.group) in by_role:  # rule 5b: the node is judged by its role
                mine = by_role[(j.node, j.metric, j.group)]
                if mine is not None:
                    self._count(res, mine, end)
                continue
            self._count(res, j, end)
        self._forget_baselines(end)
        return res

    def _judge_by_role(self, group: str, m: str, spec: MetricSpec, items: list[tuple[str, float, str]],
                       end: float) -> dict[tuple[str, str, str], _Judged | None]:
        """Rule 5b: each member of job group `group` judged on work-dependent metric `m` with its own offset
        (learnt over its first `job_baseline_windows` windows) removed, against the others whose offset is known;
        None for a member still being measured, or when fewer than `min_group_size` are known."""
        adjusted, offsets = self._with_baselines(f"{group}|{m}", items, self.cfg.job_baseline_windows, end,
                                                 additive=True)
        out: dict[tuple[str, str, str], _Judged | None] = {(node, m, group): None for node, _, _ in items}
        n = len(adjusted)
        if n < self.cfg.min_group_size:
            return out
        vals = self._unit_values(adjusted)
        med = median(vals)
        mad = MAD_SCALE * quantized_mad(vals, med, spec.quantum)
        thr = max(self.cfg.mad_k * mad, spec.min_rel * abs(med), spec.min_abs)
        low = spec.bad == "low"
        for node, v, wh in adjusted:
            gap = (med - v) if low else (v - med)
            out[(node, m, group)] = _Judged(node, m, v, wh, group, n, med, mad, thr, gap > thr, None,
                                            offset=offsets[node])
        return out

    def _judge_alone(self, group: str, m: str, spec: MetricSpec, items: list[tuple[str, float, str]],
                     end: float) -> list[_Judged]:
        """Rule 3: a group too small to compare is judged against the class's fixed expectation
        (`MetricSpec.expected`: a link at its maximum width and generation, no NVLink down, error
        counters and brake shares at 0) with the metric's floors; without one, each node against its
        own history (the median of its first `OWN_HISTORY_WINDOWS` judged windows), with the floors."""
        out = []
        low = spec.bad == "low"
        for node, v, wh in items:
            if spec.expected is not None:
                ref, basis = spec.expected, "expected"
            else:
                h = self.own.setdefault(node, {}).get(m)
                if h is None:
                    h = self.own[node][m] = [None, [], end]
                h[2] = end
                if h[0] is None:
                    h[1].append(v)
                    if len(h[1]) >= OWN_HISTORY_WINDOWS:
                        h[0], h[1] = median(h[1]), []
                    continue
                ref, basis = float(h[0]), "own_history"
            min_rel, min_abs = judged_floors(spec)
            thr = max(min_rel * abs(ref), min_abs)
            gap = (ref - v) if low else (v - ref)
            out.append(_Judged(node, m, v, wh, f"{group} ({basis})", len(items), ref, 0.0, thr, gap > thr, None))
        return out

    def _explain(self, res: WindowResult, judged: list[_Judged], end: float,
                 fingerprints: dict[str, dict[str, str]],
                 by_role: dict[tuple[str, str, str], _Judged | None] | None = None) -> list[_Judged]:
        """The judgements whose streaks count: outliers explained by a failure domain or a version
        (`shared.Explainer`) are left out (neither an outlier nor a normal window); the domain and
        version findings go to `res.shared_findings` (reported now) and `res.shared_seen`."""
        def new_streak(node: str, m: str) -> bool:  # a start: a node seen normal before, no streak on m yet
            return node in self.normal_at and m not in self.streaks.get(node, {})

        explained: list[_Judged] = []
        if self.explained_units and self.unit_of is not None:  # the nodes a domain or version explains
            unit_of = self.unit_of
            explained = [j for j in judged if j.outlier and unit_of(j.node) in self.explained_units]
            judged = [j for j in judged if not (j.outlier and unit_of(j.node) in self.explained_units)]
        domain_judged = None
        if by_role:  # rule 5b: the domain rules read each node by its role (None: not judged yet)
            domain_judged = []
            for j in judged:
                k = (j.node, j.metric, j.group)
                if k not in by_role:
                    domain_judged.append(j)
                elif (mine := by_role[k]) is not None:
                    domain_judged.append(mine)
        keep, report, seen = self.explainer.explain(judged, fingerprints, self.specs, self.cfg, new_streak, end,
                                                    domain_judged)
        res.shared_findings, res.shared_seen = report, seen
        kept = {id(j) for j in keep}
        explained += [j for j in judged if id(j) not in kept]
        res.explained += len(explained)
        for j in explained:  # its outlier windows so far were the shared cause's, and so was any report
            self._forget(self.streaks, j.node, j.metric)
            self._forget(self.reported, j.node, j.metric)
        return keep

    @staticmethod
    def _forget(table: dict[str, dict[str, Any]], node: str, m: str) -> None:
        per = table.get(node)
        if per is not None and per.pop(m, None) is not None and not per:
            del table[node]

    def _count(self, res: WindowResult, j: _Judged, end: float) -> None:
        """Rule 6: count an outlier window, reset on a judged normal one, report at `windows`."""
        cfg = self.cfg
        node, m = j.node, j.metric
        res.judged += 1
        per_node = self.streaks.get(node)
        if not j.outlier:
            self.normal_at[node] = end
            if per_node and m in per_node:
                del per_node[m]
                if not per_node:
                    del self.streaks[node]
            return
        res.outliers += 1
        b = 1.0 if j.baseline is None else j.baseline
        o = 0.0 if j.offset is None else j.offset
        if per_node is None:
            per_node = self.streaks[node] = {}
        st = per_node.get(m)
        if st is None:
            st = per_node[m] = [0, [], j.where, end]
        st[0] += 1
        st[1] = (st[1] + [j.value * b + o])[-cfg.windows:]
        st[2], st[3] = j.where, end
        if st[0] < cfg.windows:
            return
        last = self.reported.get(node, {}).get(m)
        if last is not None and end - last < cfg.reopen_after_s:
            return
        self.reported.setdefault(node, {})[m] = end
        res.findings.append(Finding(
            node=node, metric=m, value=j.value * b + o, peer_median=j.median * b + o,
            ratio=((j.value * b + o) / (j.median * b + o)) if (j.median * b + o) and j.burst_over is None else None,
            windows=st[0],
            group=j.group, group_size=j.size, where=j.where, threshold=j.threshold * b, mad=j.mad * b,
            window_end=end, window_s=cfg.window_s, values=list(st[1]), baseline=j.baseline,
            burst_over=j.burst_over, offset=j.offset))

    def _pool_bursts(self, node: str, m: str, vals: list[float],
                     seen: set[tuple[str, str]]) -> deque[tuple[int, list[float]]]:
        """File a bursty counter's window into the node's pool of its last
        `BURST_POOL_WINDOWS`·`windows` windows (bursts in a third of the samples come 1 or 2 to a window
        of 5; pooled over 6 windows they are 10 of 30, past the quarter, while one burst a window is
        6 of 30). Each window keeps its sample count and its highest `BURST_KEEP` values above 0 (the
        others count as 0)."""
        seen.add((node, m))
        hist = self._bursts.setdefault(node, {}).setdefault(m, deque(maxlen=BURST_POOL_WINDOWS * self.cfg.windows))
        hist.append((len(vals), sorted((v for v in vals if v > 0), reverse=True)[:BURST_KEEP]))
        return hist

    def _judge_bursts(self, group: str, m: str, spec: MetricSpec, items: list[tuple[str, float, str]],
                      pools: dict[tuple[str, str], deque[tuple[int, list[float]]]],
                      res: WindowResult) -> list[_Judged]:
        """Rule 4b: a bursty counter judged by how often each node's samples exceed, against how often
        its peers' do, at two heights: above the group's level by the metric's floor (any burst), and
        above `BURST_BIG` times the largest burst a typical peer had in its pool (the median of the
        nodes' maxima), so bursts of a healthy size that come no more often than the peers' are not
        an outlier however noisy the group, and bursts far bigger than any healthy node's are, even
        where every node bursts as often. `items`: (node, its window median, where). A group too
        small to compare is judged against the class's expectation (no burst: a share of 0) with the
        `BURST_SHARE` floor, at the first height only."""
        cfg = self.cfg
        alone = len(items) < cfg.min_group_size
        level = max(0.0, spec.expected or 0.0) if alone else max(0.0, median(self._unit_values(items)))
        over = level + max(spec.min_abs, spec.min_rel * level)
        n = len(items)
        pooled = []
        for node, _v, wh in items:
            hist = pools[(node, m)]
            full = sum(c for c, _ in hist) * (hist.maxlen or 1) / len(hist)  # a young pool counts as full
            vals = [v for _, tops in hist for v in tops]
            pooled.append((node, wh, full, vals))
        if alone:
            res.small_groups.append(SmallGroup(group, m, n, "expected"))
            out = []
            for node, wh, full, vals in pooled:
                c = sum(1 for v in vals if v > over)
                sh = c / full if full else 0.0
                out.append(_Judged(node, m, sh, wh, f"{group} (expected)", n, 0.0, 0.0, BURST_SHARE,
                                   sh >= BURST_SHARE and c >= 2, None, over))
            return out
        biggest = median(self._unit_values([(node, max(vals, default=0.0), wh) for node, wh, _f, vals in pooled]))
        out = self._burst_height(group, m, pooled, over, n)
        if BURST_BIG * biggest > over:
            for i, j in enumerate(self._burst_height(group, m, pooled, BURST_BIG * biggest, n)):
                if j.outlier and not out[i].outlier:
                    out[i] = j
        return out

    def _burst_height(self, group: str, m: str, pooled: list[tuple[str, str, float, list[float]]], over: float,
                      n: int) -> list[_Judged]:
        """Rule 4b at one height `over`: each node's share of samples above it against the peers'."""
        cfg = self.cfg
        shares = []
        for node, wh, full, vals in pooled:
            c = sum(1 for v in vals if v > over)
            shares.append((node, c / full if full else 0.0, wh, full, c))
        vals_ = self._unit_values([(node, sh, wh) for node, sh, wh, _f, _c in shares])
        p = median(vals_)
        step = 1.0 / max(1.0, median(f for *_, f, _c in shares))  # one sample's share: the shares' quantum
        mad = MAD_SCALE * quantized_mad(vals_, p, step)
        out = []
        for node, sh, wh, full, c in shares:
            thr = cfg.mad_k * max(mad, math.sqrt(max(0.0, p * (1 - p)) / full) if full else 0.0)
            out.append(_Judged(node, m, sh, wh, group, n, p, mad, max(thr, BURST_SHARE - p),
                               sh >= BURST_SHARE and sh - p > thr and c >= 2, None, over))
        return out

    def _with_baselines(self, group: str, items: list[tuple[str, float, str]], need: int,
                        end: float, additive: bool = False) -> tuple[list[tuple[str, float, str]], dict[str, float]]:
        """Rule 5: learn each member's offset against the group median over its first `need` windows;
        return the members whose offset is known, their values divided by it, and the offsets. `additive`
        (rule 5b, kept under `group` = `<job group>|<metric>`): the offset is the member's difference from
        the median, and it is subtracted."""
        med = median(self._unit_values(items))
        base = self.baselines.setdefault(group, {})
        out: list[tuple[str, float, str]] = []
        scale: dict[str, float] = {}
        for member, v, wh in items:
            b = base.get(member)
            if b is None:
                unit = self.unit_of(member) if self.unit_of is not None else member
                if self._baseline_members >= MAX_BASELINE_MEMBERS:
                    self.dropped["baselines_full"] += 1
                    continue
                if self._unit_members[unit] >= MAX_BASELINE_PER_UNIT:
                    self.dropped["baselines_unit_full"] += 1  # one node's share, whatever it claims
                    continue
                self._baseline_members += 1
                self._unit_members[unit] += 1
                b = base[member] = [None, [], end]
            b[2] = end
            if b[0] is None:
                if additive:
                    b[1].append(v - med)
                elif med > 0:
                    b[1].append(v / med)
                if len(b[1]) >= need:
                    b[0], b[1] = median(b[1]), []
                continue
            off = float(b[0])
            if additive:
                out.append((member, v - off, wh))
                scale[member] = off
            elif off > 0:
                out.append((member, v / off, wh))
                scale[member] = off
        return out, scale

    def _count_units(self) -> None:
        """Recount the members each unit holds offsets for (after forgetting or loading)."""
        unit_of = self.unit_of or (lambda member: member)
        self._unit_members = Counter(unit_of(k) for ms in self.baselines.values() for k in ms)

    def _unit_values(self, items: list[tuple[str, float, str]]) -> list[float]:
        """One value per unit (`unit_of`): the median of the unit's members' values, so whatever
        one sender reports weighs as one member of the group's median and MAD."""
        if self.unit_of is None:
            return [v for _, v, _ in items]
        by: dict[str, list[float]] = {}
        for member, v, _ in items:
            by.setdefault(self.unit_of(member), []).append(v)
        return [median(vs) for vs in by.values()]

    def _forget_baselines(self, t: float) -> None:
        """Forget offsets `BASELINE_TTL_S` and streaks `STREAK_TTL_S` after they were last used."""
        keep = t - BASELINE_TTL_S
        n = 0
        for group in list(self.baselines):
            members = {k: b for k, b in self.baselines[group].items() if b[2] >= keep}
            n += len(members)
            if members:
                self.baselines[group] = members
            else:
                del self.baselines[group]
        self._baseline_members = n
        self._count_units()
        for node in list(self.own):
            ms = {m: h for m, h in self.own[node].items() if h[2] >= keep}
            if ms:
                self.own[node] = ms
            else:
                del self.own[node]
        keep = t - STREAK_TTL_S
        self.normal_at = {n: at for n, at in self.normal_at.items() if at >= keep}
        for node in list(self.streaks):
            ms = {m: st for m, st in self.streaks[node].items() if st[3] >= keep}
            if ms:
                self.streaks[node] = ms
            else:
                del self.streaks[node]

    # ------------------------------------------------------------------ state

    def to_state(self) -> dict[str, Any]:
        """JSON-ready state: last judged window, streaks with evidence, report times, baselines."""
        return {"version": 1, "last_closed": self.last_closed, "window_s": self.cfg.window_s,
                "streaks": self.streaks, "reported": self.reported, "baselines": self.baselines, "own": self.own,
                "normal_at": self.normal_at}

    def load_state(self, state: dict[str, Any]) -> None:
        """Adopt a state written by `to_state` (a restart, or a standby taking over). A state written
        with a different `window_s` keeps the report times and baselines only (its window numbers mean
        other times)."""
        self.reported = {n: {m: float(t) for m, t in ms.items()} for n, ms in state.get("reported", {}).items()}
        self.baselines = {g: {k: [None if b[0] is None else float(b[0]), [float(x) for x in b[1]], float(b[2])]
                              for k, b in ms.items()} for g, ms in state.get("baselines", {}).items()}
        self._baseline_members = sum(len(ms) for ms in self.baselines.values())
        self._count_units()
        self.own = {n: {m: [None if h[0] is None else float(h[0]), [float(x) for x in h[1]], float(h[2])]
                        for m, h in ms.items()} for n, ms in state.get("own", {}).items()}
        self.normal_at = {str(n): float(t) for n, t in state.get("normal_at", {}).items()}
        if float(state.get("window_s", self.cfg.window_s)) != self.cfg.window_s:
            return
        self.last_closed = max(self.last_closed, int(state.get("last_closed", -1)))
        last_end = (self.last_closed + 1) * self.cfg.window_s
        self.streaks = {n: {m: [int(s[0]), [float(x) for x in s[1]], str(s[2]),
                                float(s[3]) if len(s) > 3 else last_end] for m, s in ms.items()}
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


BURST_POOL_WINDOWS = 2
"""A bursty counter is pooled over this many times `windows` windows (30 samples at the defaults):
bursts in a third of the samples are 10 of 30, past the quarter (`metrics.BURST_SHARE`), while a
healthy node whose 8 GPUs burst in 4 % of the samples reaches 8 of 30 about once in 60,000 windows
(over 15 samples, 4 of 15, about once in 500: a false finding a day per 1,000 nodes,
bench/failslow_scenarios.py). Where healthy peers burst often (a share p), a node must also exceed
p by `mad_k` binomial σ over its samples (rule 4b)."""
BURST_KEEP = 48
"""Highest values of a bursty counter kept per node and window (a quarter of 3 windows of 64)."""
BURST_BIG = 2.0
"""Rule 4b's second height: bursts this many times the largest a typical peer had in its pool (the
median of the nodes' maxima over their last 6 windows). A healthy node's samples pass the typical
maximum in ~2 % of the samples (its own maximum is as likely above as below it); twice it, far
fewer, so 8 of 30 do not happen by chance."""


def window_value(values: list[float], quantum: float = 0.0) -> float:
    """A node's value of one metric in one window (rule 1): the median of its samples; for a quantized
    metric (`quantum` > 0) the grouped-data (interpolated) median, which resolves finer than one step
    (five samples of a clock, three at one 15 MHz step and two one step below, give a third of a
    step below the upper one, not one of the steps) and, like the median, ignores up to half the
    samples however far off (two clock dips among five move it by less than one step)."""
    med = median(values)
    if quantum <= 0 or len(values) < 2:
        return med
    bins = Counter(round((v - med) / quantum) for v in values)  # steps from the median
    half, cum = len(values) / 2, 0
    for k in sorted(bins):
        c = bins[k]
        if cum + c >= half:
            return med + (k - 0.5) * quantum + (half - cum) / c * quantum
        cum += c
    return med  # not reached: the bins hold every value


def quantized_mad(values: list[float], med: float, quantum: float) -> float:
    """Median absolute deviation of `values` from `med` (unscaled), for a metric of resolution `quantum`.

    `quantum` 0: the plain MAD. Otherwise the deviations are grouped into bins of one quantum
    (bin 0 is [0, q/2), bin k ≥ 1 is [k·q − q/2, k·q + q/2)) and the median is interpolated within its
    bin (the grouped-data median): a group where 45 % of the nodes sit at the median clock and 55 %
    one 15 MHz step off gets ~0.6 step, not 1 step (plain MAD) or 0; all at the median gets q/4, a
    floor from the metric's resolution. For a spread of several quanta it equals the plain MAD to
    within a fraction of a quantum."""
    devs = [abs(v - med) for v in values]
    if quantum <= 0 or not devs:
        return median(devs) if devs else 0.0
    bins = Counter(int(d / quantum + 0.5) for d in devs)
    half, cum = len(devs) / 2, 0
    for k in sorted(bins):
        c = bins[k]
        if cum + c >= half:
            lo, width = (0.0, quantum / 2) if k == 0 else (k * quantum - quantum / 2, quantum)
            return lo + (half - cum) / c * width
        cum += c
    return median(devs)  # not reached: the bins hold every deviation


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
    if f.burst_over is not None:  # rule 4b: shares of samples above a rate
        what = (f"{label} above {f.burst_over:.4g} in {f.value:.0%} of recent samples vs peer median "
                f"{f.peer_median:.0%}")
    else:
        what = f"{label} {f.value:.4g} vs peer median {f.peer_median:.4g}{ratio}"
    msg = (f"fail-slow: {what} on {f.where}, "
           f"outlier in {f.windows} consecutive {f.window_s:g} s windows among {f.group_size} peers of {f.group}")
    return FaultEvent(
        event_id=f"{ns:016x}{suffix}", cluster=cluster, node=f.node,
        component=spec.component if spec else "gpu", device=device_of(f.where), kind="fail_slow",
        severity=Severity.DEGRADED, message=msg, source=Source.ANALYZER, agent_version=__version__,
        attrs=f.evidence(), raw=msg)
