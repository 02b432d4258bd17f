"""Remediation policy: the rules that need history, the blast-radius arithmetic, failure domains,
and the recovery request/reply contract between the worker and a node's agent.

Pure functions over plain data, so the workflows call them deterministically (no I/O, time comes in
as an argument) and tests exercise them without Temporal. Imports only stdlib and pydantic.

History rules (`decide`), each citing its source:

======================  ==========================================================================
rule                    what it does
======================  ==========================================================================
app_xid_repeat          XID 13 or 31 on the *same GPU* `app_xid_repeats` times within
                        `app_xid_window_s` → hardware suspect, drain (NVIDIA XID catalog: 13/31 are
                        application faults "unless repeated on the same GPU across jobs").
xid45_sympathetic       XID 45 (preemptive cleanup) next to another XID is a consequence of it and
                        ignored; alone it is recorded only (catalog action WORKFLOW_XID_45).
xid48_with_remap        XID 48 (DBE) with 63 (row remap pending) or 64 (remap failure) on the same
                        GPU → drain and reset the GPU (the reset applies the pending remap; NVIDIA
                        "GPU Memory Error Management", row remapping).
sbe_or_remap_idle       a rising SBE rate (`sbe_events_per_window` SBE events within `sbe_window_s`)
                        or a pending row remap alone → drain *when idle*: a Slurm DRAIN already
                        lets running jobs finish (DRAINING → DRAINED), so "when idle" is the same
                        scheduler request; what differs is that nothing is reset or diagnosed until
                        the node is idle, and no job is cut short (NVIDIA: pending remaps are applied
                        at the next reset, which needs the GPU idle).
fail_slow_idle          `fail_slow` (the analyzer: a persistent outlier among its hardware peers)
                        → drain *when idle*, diagnose, ticket: a slow node costs a few percent, a
                        cut-short job costs it all (own reasoning; Greyhound/FALCON measured
                        fail-slows lasting minutes to hours).
debounce                a fault whose kind has a clearing event (`clearable`) waits `debounce_s`;
                        if its clearing event arrives first, nothing drains (flapping is
                        damped).
lemon                   (FleetGuard) the same fault class returning after `lemon_repairs` repairs
                        within `lemon_window_s` → RMA instead of another recovery loop.
======================  ==========================================================================
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from fleetmend.errors import ConfigError
from fleetmend.events import Severity
from fleetmend.messages import Recovery, Urgency

# ------------------------------------------------------------------ failure domains


@dataclass(frozen=True)
class FailureDomain:
    """Where a node sits: rack, leaf switch, PDU (any may be unknown)."""

    rack: str | None = None
    leaf: str | None = None
    pdu: str | None = None

    def keys(self) -> list[str]:
        """`rack:r07`, `leaf:ls3`, `pdu:p12`: the domains correlated faults are grouped by."""
        return [f"{k}:{v}" for k, v in (("rack", self.rack), ("leaf", self.leaf), ("pdu", self.pdu)) if v]


class Topology:
    """node → `FailureDomain`, from an operator's TOML file:

        [node.gpu-001]
        rack = "r01"
        leaf = "leaf-a"
        pdu = "pdu-1a"
    """

    def __init__(self, nodes: dict[str, FailureDomain] | None = None) -> None:
        self.nodes = dict(nodes or {})

    def domain(self, node: str) -> FailureDomain:
        return self.nodes.get(node, FailureDomain())

    def __len__(self) -> int:
        return len(self.nodes)


def load_topology(path: Path | str | None) -> Topology:
    """Read a topology file (format in `Topology`). None → an empty topology (no domains known).

    Raises:
        ConfigError: missing file, bad TOML, or an entry with keys other than rack/leaf/pdu.
    """
    if path is None:
        return Topology()
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise ConfigError(f"topology file {p} not found (policy.topology_file)") from err
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"topology file {p}: {err}") from err
    nodes: dict[str, FailureDomain] = {}
    for name, entry in (data.get("node") or {}).items():
        if not isinstance(entry, dict) or set(entry) - {"rack", "leaf", "pdu"}:
            raise ConfigError(f"topology file {p}: [node.{name}]: expected keys rack, leaf, pdu; got "
                              f"{sorted(entry) if isinstance(entry, dict) else type(entry).__name__}")
        nodes[name] = FailureDomain(**{k: str(v) for k, v in entry.items()})
    extra = set(data) - {"node"}
    if extra:
        raise ConfigError(f"topology file {p}: unknown section(s) {sorted(extra)}; expected [node.NAME] tables")
    return Topology(nodes)


# ------------------------------------------------------------------ blast radius


def drain_budget(known_nodes: int, max_drained_nodes: int, max_drained_percent: float) -> int:
    """Permits FleetGuard may hold at once: min(N, floor(P % of known nodes)), never below 1.

    Examples: 100 nodes, N=20, P=10 → 10; 1000 nodes → 20; a 1-node dev box → 1 (one drain at a
    time is the least automation that still does its job).
    """
    by_percent = math.floor(known_nodes * max_drained_percent / 100.0) if known_nodes > 0 else max_drained_nodes
    return max(1, min(max_drained_nodes, by_percent))


# ------------------------------------------------------------------ history rules


_RECOVERY_BY_ACTION = {
    "RESET_GPU": Recovery.RESET_GPU,
    "RESTART_BM": Recovery.RESTART_BM,
    "RESTART_VM": Recovery.RESTART_BM,
    "RMA": Recovery.RMA,
    "WORKFLOW_XID_48": Recovery.RESET_GPU,
    "WORKFLOW_NVLINK_ERR": Recovery.RESET_GPU,
}
"""Catalog immediate action → recovery step (NVIDIA XID catalog 'Immediate Action' column)."""

APP_XIDS = frozenset({13, 31})
SYMPATHETIC_XIDS = frozenset({45})
REMAP_XIDS = frozenset({63, 64})
SBE_KINDS = frozenset({"ecc_sbe_volatile"})
REMAP_PENDING_KINDS = frozenset({"remapped_rows_pending", "row_remap_pending"})


@dataclass
class FaultView:
    """What a rule needs to know about one recorded fault (the workflow builds these)."""

    kind: str
    code: int | None
    device: str | None
    severity: Severity
    drain: bool
    immediate_action: str
    fault_class: str
    times: list[datetime]
    """Occurrences (observed_at), oldest first; at least one."""
    cleared: bool = False
    clearable: bool = False
    message: str = ""
    arrived_at: datetime | None = None
    """When the incident first saw it (debounce runs from here; `times[0]` when unknown)."""


@dataclass
class RuleSettings:
    app_xid_repeats: int = 3
    app_xid_window_s: float = 3600.0
    sbe_events_per_window: int = 10
    sbe_window_s: float = 3600.0
    max_future_s: float | None = None
    """Two-sided windows: an occurrence counts only between `now - window` and `now + max_future_s`
    (the agents' allowed clock skew, `fleetmend.events.MAX_CLOCK_SKEW_S`). None: no upper bound
    (incidents started before two-sided windows keep deciding as they did)."""


@dataclass
class Decision:
    drain: bool
    urgency: Urgency = Urgency.NOW
    recovery: Recovery = Recovery.DIAGNOSE
    fault_class: str | None = None
    severity: Severity = Severity.INFO
    device: str | None = None
    reasons: list[str] = field(default_factory=list)
    """Every rule that fired, in words (they go into the incident's history)."""
    debounce: list[FaultView] = field(default_factory=list)
    """Clearable faults younger than the debounce window: wait before acting on them."""


def _within(times: list[datetime], now: datetime, window_s: float,
            max_future_s: float | None = None) -> list[datetime]:
    """Occurrences in `[now - window_s, now + max_future_s]` (no upper bound when None): an
    occurrence dated in the future is not "recent", however far ahead a clock put it."""
    start = now - timedelta(seconds=window_s)
    if max_future_s is None:
        return [t for t in times if t >= start]
    end = now + timedelta(seconds=max_future_s)
    return [t for t in times if start <= t <= end]


def decide(faults: list[FaultView], now: datetime, rules: RuleSettings, debounce_s: float = 0.0) -> Decision:
    """Apply the catalog verdicts plus the history rules (module docstring) to a node's faults.

    Args:
        faults: the incident's unhealthy, not-yet-cleared faults (healthy events excluded).
        now: the workflow's clock (`workflow.now()`).
    Returns:
        `Decision`: whether to drain, how urgently, which recovery to try first and why.
    """
    d = Decision(drain=False)
    xids_by_dev: dict[str | None, set[int]] = {}
    for f in faults:
        if f.kind == "xid" and f.code is not None:
            xids_by_dev.setdefault(f.device, set()).add(f.code)
    all_xids = set().union(*xids_by_dev.values()) if xids_by_dev else set()
    candidates: list[tuple[FaultView, Urgency, Recovery, str]] = []
    for f in faults:
        if f.cleared:
            continue
        if f.kind == "xid" and f.code in SYMPATHETIC_XIDS:
            others = sorted(all_xids - SYMPATHETIC_XIDS)
            d.reasons.append(f"XID 45 on {f.device}: sympathetic to XID {', '.join(map(str, others))}; ignored"
                             if others else f"XID 45 alone on {f.device}: preemptive cleanup, recorded only")
            continue
        if f.kind == "xid" and f.code in APP_XIDS and not f.drain:
            recent = _within(f.times, now, rules.app_xid_window_s, rules.max_future_s)
            if len(recent) >= rules.app_xid_repeats:
                candidates.append((f, Urgency.NOW, Recovery.DIAGNOSE,
                                   f"XID {f.code} {len(recent)}× on GPU {f.device} within "
                                   f"{rules.app_xid_window_s:.0f}s (≥ {rules.app_xid_repeats}): hardware suspect"))
            continue
        if f.kind == "xid" and f.code == 48 and xids_by_dev.get(f.device, set()) & REMAP_XIDS:
            with_ = sorted(xids_by_dev[f.device] & REMAP_XIDS)
            candidates.append((f, Urgency.NOW, Recovery.RESET_GPU,
                               f"XID 48 (DBE) with XID {'/'.join(map(str, with_))} on GPU {f.device}: "
                               "drain and reset the GPU (applies the row remap)"))
            continue
        if f.kind in SBE_KINDS:
            recent = _within(f.times, now, rules.sbe_window_s, rules.max_future_s)
            if len(recent) >= rules.sbe_events_per_window:
                candidates.append((f, Urgency.WHEN_IDLE, Recovery.RESET_GPU,
                                   f"SBE rate rising on GPU {f.device}: {len(recent)} events within "
                                   f"{rules.sbe_window_s:.0f}s: drain when idle, then reset"))
            continue
        if (f.kind in REMAP_PENDING_KINDS or (f.kind == "xid" and f.code == 63)) and not (
                f.kind == "xid" and 48 in xids_by_dev.get(f.device, set())):
            candidates.append((f, Urgency.WHEN_IDLE, Recovery.RESET_GPU,
                               f"row remap pending on GPU {f.device}: drain when idle, then reset to apply it"))
            continue
        if f.kind == "fail_slow" and f.drain:
            candidates.append((f, Urgency.WHEN_IDLE, Recovery.DIAGNOSE,
                               f"fail-slow on {f.device or 'the node'}: a persistent outlier among its peers; "
                               "drain when idle, diagnose, ticket"))
            continue
        if f.drain:
            rec = _RECOVERY_BY_ACTION.get(f.immediate_action, Recovery.DIAGNOSE)
            candidates.append((f, Urgency.NOW, rec, f"{f.fault_class}: catalog action {f.immediate_action}"))
    if not candidates:
        return d
    # Debounce: clearable faults younger than the window wait (unless something else drains now).
    firm = [c for c in candidates if not (c[0].clearable and debounce_s > 0
                                          and (now - (c[0].arrived_at or c[0].times[0])).total_seconds()
                                          < debounce_s)]
    if not firm:
        d.debounce = [c[0] for c in candidates]
        d.reasons.append("waiting " + f"{debounce_s:.0f}s for a clearing event of "
                         + ", ".join(sorted({c[0].fault_class for c in candidates})))
        return d
    worst = max(firm, key=lambda c: (c[1] is Urgency.NOW, Severity(c[0].severity).rank,
                                     c[2] is not Recovery.DIAGNOSE))
    f, urgency, recovery, _why = worst
    d.drain = True
    d.urgency = Urgency.NOW if any(c[1] is Urgency.NOW for c in firm) else Urgency.WHEN_IDLE
    d.recovery = Recovery.RMA if any(c[2] is Recovery.RMA for c in firm) else recovery
    d.fault_class, d.device = f.fault_class, f.device
    d.severity = Severity.worst(Severity.DEGRADED, *(c[0].severity for c in firm))
    d.reasons.extend(c[3] for c in firm)
    return d


# ------------------------------------------------------------------ verification by fault

_NVLINK_XIDS = frozenset({74, *range(144, 151)})
_MEMORY_XIDS = frozenset({48, 63, 64, 92, 94, 95})
_PCIE_KINDS = frozenset({"gpu_fallen_off_bus", "aer_fatal", "aer_uncorrected", "aer_recovery_failed",
                         "pcie_link_degraded"})


def verification_checks(component: str, kind: str, code: int | None) -> list[str]:
    """Diagnostics (agent check names, agents/diag.py) that prove *this* fault is gone.

    NVLink faults → DCGM diag (its level 2 runs the NVLink/P2P bandwidth tests); ECC/row-remap →
    remapped_rows_pending plus DCGM's memory test; PCIe/bus → link width and GPU count; IB → port
    state. Every list starts with nvml_reachable/gpu_count for GPU faults. Empty: every QUICK check.
    A check that does not apply on the host answers NOT_APPLICABLE (never a false FAIL).
    """
    gpu = ["nvml_reachable", "gpu_count"]
    if component == "nvlink" or (kind == "xid" and code in _NVLINK_XIDS):
        return gpu + ["dcgm_diag"]
    if component == "memory" or kind.startswith(("ecc_", "row_remap", "remapped_rows", "retired_pages")) or (
            kind == "xid" and code in _MEMORY_XIDS):
        return gpu + ["remapped_rows_pending", "dcgm_diag"]
    if component == "pcie" or kind in _PCIE_KINDS or (kind == "xid" and code == 79):
        return gpu + ["pcie_link_width"]
    if component == "ib":
        return ["ib_ports_active"]
    return []
