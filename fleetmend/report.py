"""`fleetmend report`: compute lost, counted from the incident ledger (`fleetmend.ledger`). Pure: records in,
figures out; the reading is `fleetmend.infra.ledger`, the command `fleetmend.cli.report`.

Every figure carries how it was computed (`HOW`), and the same words are printed by the CLI, shown in the HTML
page and exported as Prometheus help. Definitions (docs/compute-lost.md, and the operators' practice in
shared notes §6: Meta's ETTR and goodput, NVSentinel's MTBI/MTTR, Google's badput split by cause):

- GPU-hours out of service: per incident, the node's GPUs × the hours from the drain to the return (else the
  close, else now), clipped to the report's window, so that the figures of consecutive windows add up.
- Version findings: a fault class whose nodes hold one value of a fingerprint version key far more often than
  that value's share of the fleet: a one-sided hypergeometric test (Fisher's exact test of the 2×2 table
  nodes-with-the-fault × nodes-with-the-value), p ≤ `p_level` / the number of tests made (Bonferroni), and at
  least `min_nodes` nodes.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Iterable

from fleetmend.config import Settings
from fleetmend.ledger import FINDING_KEYS, Outcome, out_of_service

HOW: dict[str, str] = {
    "gpu_hours": "Σ over incidents of GPUs × hours out of service (drain → return, else close, else now), "
                 "clipped to the window; GPUs from the node's fingerprint at the drain, else ledger.default_gpus_per_node",
    "gpu_hours_by_fault_class": "the same sum, grouped by the fault class that drained the node",
    "gpu_hours_by_rack": "the same sum, grouped by the node's rack in policy.topology_file ('-': not listed)",
    "gpu_hours_by_hw_class": "the same sum, grouped by the fingerprint's hardware class at the drain",
    "gpu_hours_by_version": "the same sum, grouped by each version key's value at the drain (driver, VBIOS, ...)",
    "mttr_h": "mean hours from the drain to the return to service, over incidents returned in the window",
    "time_to_detect_s": "seconds from the fault line (the event's observed_at) to its incident (the router's "
                        "signal-with-start), over incidents drained in the window that the router noted",
    "time_to_drain_s": "seconds from the fault line to the cordon (the router's for faults that must drain now, "
                       "else the incident's drain), over incidents drained in the window",
    "ticket_turnaround_h": "hours from the ticket filed to the ticket resolved, over tickets resolved in the window",
    "false_drain_rate": "no_fault_found ÷ incidents closed in the window after a drain: back in service with no "
                        "ticket and no failing check in the first diagnostics after the drain",
    "outcomes": "incidents closed in the window, by how they ended (fleetmend.ledger.Outcome); still_out: open",
    "lemons": "nodes with ≥ policy.lemon_repairs incidents of one fault class in the window, or an incident that "
              "went to RMA as a lemon or a repeat part (over several clusters a node is `<cluster>/<node>`)",
    "parts_not_replaced": "incidents repaired through a ticket whose faulty device has the serial it had at the drain",
    "slowness_gpu_hours": "Σ over fail_slow incidents of the lost pace (1 − min(ratio, 1/ratio) against the peer "
                          "median) × the hours the node was slow before the finding (windows × window length) × "
                          "the job's GPUs where job step times name the job (the job ran at that node's pace), "
                          "else the node's GPUs",
    "findings": "per fault class and version key: one-sided hypergeometric (Fisher exact) P(≥ k of the n faulty "
                "nodes hold the value | K of the fleet's N do; each node once, a faulty one with its value at the "
                "drain), a finding when p × tests ≤ p_level and k ≥ min_nodes",
}


FIELDS = ("cluster", "node", "fault_class", "rack", "hw_class", "gpu_count", "observed_at", "routed_at",
          "drained_at", "returned_at", "closed_at", "outcome", "ticket", "ticket_filed_at", "ticket_closed_at", "lemon",
          "repeat_part", "part", "part_serial_drain", "part_not_replaced", "slow", "versions_drain")
"""The record keys the report reads (`fleetmend.ledger`): a reader may keep only these."""


@dataclass(frozen=True)
class ReportParams:
    """The knobs of one report (from `LedgerSettings` and `PolicySettings`)."""

    since: float
    """Start of the window (Unix seconds)."""
    now: float
    default_gpus_per_node: int = 8
    lemon_repairs: int = 2
    p_level: float = 0.01
    min_nodes: int = 3

    @classmethod
    def from_settings(cls, s: Settings, since: float, now: float) -> ReportParams:
        """The window `since`..`now` with the deployment's `[ledger]` and `policy.lemon_repairs`."""
        return cls(since=since, now=now, default_gpus_per_node=s.ledger.default_gpus_per_node,
                   lemon_repairs=s.policy.lemon_repairs, p_level=s.ledger.finding_p,
                   min_nodes=s.ledger.finding_min_nodes)


def hypergeom_sf(k: int, population: int, successes: int, draws: int) -> float:
    """P(X ≥ k) for X ~ Hypergeometric(N=`population`, K=`successes`, n=`draws`): the first term exact
    (`math.comb`, integer arithmetic), the rest by the pmf's ratio recurrence
    pmf(x+1)/pmf(x) = (K−x)(n−x) / ((x+1)(N−K−n+x+1)), in floats (relative error ~1e-15 per term)."""
    if k <= 0:
        return 1.0
    hi = min(draws, successes)
    if k > hi:
        return 0.0
    term = math.comb(successes, k) * math.comb(population - successes, draws - k) / math.comb(population, draws)
    total = 0.0
    for x in range(k, hi + 1):
        total += term
        if term < total * 1e-17:
            break  # the rest cannot change the sum
        term *= (successes - x) * (draws - x) / ((x + 1) * (population - successes - draws + x + 1))
    return min(1.0, total)


def _stats(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0, "mean": None, "p50": None, "p90": None}
    v = sorted(values)

    def q(p: float) -> float:
        return v[min(len(v) - 1, int(p * (len(v) - 1) + 0.5))]

    return {"n": len(v), "mean": round(sum(v) / len(v), 3), "p50": round(q(0.5), 3), "p90": round(q(0.9), 3)}


def _in(t: float | None, p: ReportParams) -> bool:
    return t is not None and p.since <= t <= p.now


def gpu_hours_of(rec: dict[str, Any], p: ReportParams) -> float:
    """GPUs × hours out of service of one record within the window (≥ 0)."""
    span = out_of_service(rec, p.now)
    if span is None:
        return 0.0
    start, end = max(span[0], p.since), min(span[1], p.now)
    if end <= start:
        return 0.0
    return gpus_of(rec, p) * (end - start) / 3600.0


def gpus_of(rec: dict[str, Any], p: ReportParams) -> int:
    g = rec.get("gpu_count")
    return int(g) if isinstance(g, int) and g > 0 else p.default_gpus_per_node


def finding_id(cluster: str, fault_class: str, key: str, value: str) -> str:
    return hashlib.sha1(f"{cluster}|{fault_class}|{key}|{value}".encode()).hexdigest()[:16]


def version_findings(records: list[dict[str, Any]], fleet: list[dict[str, Any]], p: ReportParams,
                     cluster: str = "") -> list[dict[str, Any]]:
    """Version findings (see module docstring). `fleet`: one `{node, versions}` per node of the fleet now (the
    fingerprints); a faulty node's value is the one at its drain, else its fingerprint's now, and it counts in the
    fleet with that value (each node once)."""
    now_versions = {f["node"]: f.get("versions") or {} for f in fleet}
    by_class: dict[str, dict[str, dict[str, str]]] = defaultdict(dict)  # fault class → node → versions
    first_at: dict[tuple[str, str], float] = {}
    since, now = p.since, p.now
    for r in records:
        at, fc = r.get("drained_at"), r.get("fault_class")
        if at is None or not fc or not since <= at <= now:
            continue
        # a node counts once per class, with its versions at its first drain of the class in the window (not
        # whichever record the store gave first: the same figures however the ledger is laid out)
        which = (fc, r["node"])
        first = first_at.get(which)
        if first is not None and first <= at:
            continue
        first_at[which] = at
        by_class[fc][r["node"]] = r.get("versions_drain") or now_versions.get(r["node"], {})
    candidates = []
    for key in FINDING_KEYS:
        now_vals = {nd: v[key] for nd, v in now_versions.items() if v.get(key)}
        now_counts = Counter(now_vals.values())
        for fc, nodes in sorted(by_class.items()):
            faulty = {nd: v[key] for nd, v in nodes.items() if v.get(key)}
            # the fleet as the test sees it: each node once, a faulty node with its value at the drain (which
            # may not be its value now: a node upgraded since, or not reporting now), every other node with its
            # value now. So k ≤ K and n ≤ N always, and no node is counted under two values.
            counts = now_counts.copy()
            big_n = len(now_vals)
            for nd, value in faulty.items():
                was = now_vals.get(nd)
                if was is None:
                    big_n += 1
                else:
                    counts[was] -= 1
                counts[value] += 1
            if sum(1 for c in counts.values() if c > 0) < 2:
                continue  # one value fleet-wide: nothing can concentrate on it
            vals = Counter(faulty.values())
            n = len(faulty)
            for value, k in sorted(vals.items()):
                if k < p.min_nodes:
                    continue
                big_k = counts[value]
                candidates.append((fc, key, value, k, n, big_k, big_n, hypergeom_sf(k, big_n, big_k, n)))
    tests = len(candidates)
    out = []
    for fc, key, value, k, n, big_k, big_n, pv in candidates:
        if pv * tests > p.p_level:
            continue
        out.append({
            "id": finding_id(cluster, fc, key, value), "fault_class": fc, "key": key, "value": value,
            "nodes_with_fault_and_value": k, "nodes_with_fault": n, "fleet_nodes_with_value": big_k,
            "fleet_nodes": big_n, "expected": round(n * big_k / big_n, 2), "p_value": pv, "tests": tests,
            "test": f"one-sided hypergeometric (Fisher exact): P(X ≥ {k} | N={big_n}, K={big_k}, n={n}) = {pv:.3g}; "
                    f"× {tests} test(s) ≤ {p.p_level}",
            "nodes": sorted(nd for nd, v in by_class[fc].items() if v.get(key) == value),
        })
    return sorted(out, key=lambda f: f["p_value"])


def build_report(records: Iterable[dict[str, Any]], p: ReportParams, *, fleet: list[dict[str, Any]] | None = None,
                 cluster: str = "") -> dict[str, Any]:
    """The report's figures as one JSON-safe dict (what `--json` prints, the HTML shows and /metrics exports).

    Args:
        records: ledger heads (`fleetmend.ledger`), any cluster filter applied already.
        p: window and knobs.
        fleet: `{node, versions}` of every node now, for version findings (None: no findings).
    Returns:
        `{"window": …, "gpu_hours": float, "gpu_hours_by_*": {group: float}, "mttr_h": stats, …, "how": HOW}`;
        `stats` = `{n, mean, p50, p90}`.
    """
    recs = [r for r in records if r.get("drained_at") is not None]
    # a node is its cluster's: over several clusters a node name is `<cluster>/<node>`, so two clusters' nodes of
    # one name are neither summed nor a lemon together (two false alarms in two clusters made one "lemon")
    several = len({r.get("cluster") for r in recs}) > 1
    by: dict[str, dict[str, float]] = {k: defaultdict(float) for k in ("fault_class", "rack", "hw_class", "node")}
    by_fc, by_rack, by_hw, by_node = by["fault_class"], by["rack"], by["hw_class"], by["node"]
    by_version: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    by_vmap: dict[int, list[Any]] = {}  # id of a versions map → [the map, its hours]
    total = 0.0
    mttr, ttd, ttdrain, turnaround = [], [], [], []
    outcomes: Counter[str] = Counter()
    closed_after_drain = 0
    per_node_class: Counter[tuple[str, str]] = Counter()
    lemons: dict[str, list[str]] = defaultdict(list)
    not_replaced, slowness = [], []
    slow_total = 0.0
    window = []
    since, now, default_gpus = p.since, p.now, p.default_gpus_per_node
    for r in recs:  # 100,000 records in about a second: plain locals and comparisons (bench/ledger_report.py)
        get = r.get
        drained = r["drained_at"]
        returned = get("returned_at")
        end = returned or get("closed_at") or now
        if end < drained:
            end = drained  # a clock step: never negative
        if drained > now or end < since:
            continue  # out of service wholly outside the window
        window.append(r)
        g = get("gpu_count")
        gpus = g if isinstance(g, int) and g > 0 else default_gpus
        lo = drained if drained > since else since
        hi = end if end < now else now
        h = gpus * (hi - lo) / 3600.0 if hi > lo else 0.0
        total += h
        fc = get("fault_class") or "unknown"
        node = f"{get('cluster') or '?'}/{r['node']}" if several else r["node"]
        by_fc[fc] += h
        by_rack[get("rack") or "-"] += h
        by_hw[get("hw_class") or "unknown"] += h
        by_node[node] += h
        v = get("versions_drain")
        if v:  # summed per versions map first: readers share equal maps, so a handful of maps for 100,000 records
            e = by_vmap.get(id(v))
            if e is None:
                by_vmap[id(v)] = [v, h]
            else:
                e[1] += h
        if returned is not None and since <= returned <= now:
            mttr.append((returned - drained) / 3600.0)
        drained_in = since <= drained <= now
        if drained_in:
            obs = get("observed_at")
            if obs is not None:
                ttdrain.append(drained - obs if drained > obs else 0.0)
                routed = get("routed_at")
                if routed is not None:
                    ttd.append(routed - obs if routed > obs else 0.0)
            per_node_class[(node, fc)] += 1
            for why in (get("lemon"), get("repeat_part")):
                if why:
                    lemons[node].append(why)
        tc = get("ticket_closed_at")
        if tc is not None and since <= tc <= now:
            tf = get("ticket_filed_at")
            if tf is not None:
                turnaround.append((tc - tf if tc > tf else 0.0) / 3600.0)
        outcome = get("outcome")
        if outcome is None:
            outcomes["still_out"] += 1
        else:
            closed = get("closed_at")
            if closed is not None and since <= closed <= now:
                outcomes[outcome] += 1
                closed_after_drain += 1
        if get("part_not_replaced"):
            not_replaced.append({"node": node, "fault_class": get("fault_class"), "part": get("part"),
                                 "serial": get("part_serial_drain"), "ticket": get("ticket"),
                                 "returned_at": returned})
        slow = get("slow")
        if slow and slow.get("ratio") and drained_in:
            ratio = float(slow["ratio"])
            lost = 1.0 - min(ratio, 1.0 / ratio) if ratio > 0 else 0.0
            sgpus = (int(slow.get("job_gpus") or 0) if slow.get("job") else 0) or gpus
            gh = lost * float(slow.get("slow_s") or 0) / 3600.0 * sgpus
            slow_total += gh
            slowness.append({"node": node, "metric": slow.get("metric"), "ratio": ratio, "lost_pace": round(lost, 4),
                             "slow_h": round(float(slow.get("slow_s") or 0) / 3600.0, 3), "gpus": sgpus,
                             "job": slow.get("job") or None, "gpu_hours": round(gh, 3)})
    for v, vh in by_vmap.values():
        for key, value in v.items():
            by_version[key][value] += vh
    for (node, fc), n in per_node_class.items():
        if n >= p.lemon_repairs:
            lemons[node].append(f"{n} incidents of {fc} in the window")
    nff = outcomes.get(Outcome.NO_FAULT_FOUND.value, 0)

    def rounded(d: dict[str, float]) -> dict[str, float]:
        return {k: round(v, 3) for k, v in sorted(d.items(), key=lambda kv: -kv[1])}

    return {
        "cluster": cluster or None,
        "window": {"since": p.since, "until": p.now, "hours": round((p.now - p.since) / 3600.0, 3)},
        "incidents": len(window),
        "gpu_hours": round(total, 3),
        "gpu_hours_by_fault_class": rounded(by["fault_class"]),
        "gpu_hours_by_rack": rounded(by["rack"]),
        "gpu_hours_by_hw_class": rounded(by["hw_class"]),
        "gpu_hours_by_node": rounded(by["node"]),
        "gpu_hours_by_version": {k: rounded(v) for k, v in sorted(by_version.items())},
        "mttr_h": _stats(mttr),
        "time_to_detect_s": _stats(ttd),
        "time_to_drain_s": _stats(ttdrain),
        "ticket_turnaround_h": _stats(turnaround),
        "false_drain_rate": round(nff / closed_after_drain, 4) if closed_after_drain else None,
        "outcomes": dict(sorted(outcomes.items())),
        "lemons": [{"node": n, "why": sorted(set(w))} for n, w in sorted(lemons.items())],
        "parts_not_replaced": sorted(not_replaced, key=lambda x: (x["returned_at"] or 0.0, x["node"])),
        "slowness_gpu_hours": round(slow_total, 3),
        "slowness": sorted(slowness, key=lambda s: (-s["gpu_hours"], s["node"])),
        "findings": version_findings(window, fleet, p, cluster) if fleet is not None else [],
        "how": HOW,
    }


__all__ = ["FIELDS", "HOW", "ReportParams", "build_report", "finding_id", "gpu_hours_of", "hypergeom_sf", "version_findings"]
