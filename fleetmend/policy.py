"""Remediation policy: the rules that need history, the blast-radius arithmetic, failure domains.

Pure functions over plain data, so the workflows call them deterministically (no I/O, time comes in
as an argument) and tests exercise them without Temporal. What one fault class does (severity,
drain, urgency, recovery, verification) is catalog data (fleetmend/catalog/); the rules here only add
what needs more than one event. Which rule reads a fault is the catalog row's `history` field, so no
XID number is written here.

History rules (`decide`), each citing its source:

======================  ==========================================================================
rule                    what it does
======================  ==========================================================================
app_xid_repeat          `repeats` (XID 13, 31) on the *same GPU* `app_xid_repeats` times within
                        `app_xid_window_s` → hardware suspect, drain (NVIDIA XID catalog: 13/31 are
                        application faults "unless repeated on the same GPU across jobs").
xid45_sympathetic       `sympathetic` (XID 45, preemptive cleanup) next to another XID is a consequence of it and
                        ignored; alone it is recorded only (catalog action WORKFLOW_XID_45).
xid48_with_remap        `dbe` (XID 48) with `remap_pending`/`remap_failure` (XID 63/64) on the
                        same GPU → drain and the row's recovery (reset the GPU) (the reset applies the pending remap; NVIDIA
                        "GPU Memory Error Management", row remapping).
sbe_or_remap_idle       a rising `rate` (`sbe_events_per_window` SBE events within `sbe_window_s`)
                        or a `remap_pending` alone → drain with the row's urgency (*when idle*): a Slurm DRAIN already
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

from fleetmend.catalog import History, Recovery, Urgency
from fleetmend.config import policy_default
from fleetmend.errors import ConfigError
from fleetmend.events import MAX_CLOCK_SKEW_S, Severity, Verdict

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


@dataclass
class FaultView:
    """What a rule needs to know about one recorded fault (the workflow builds these from its
    `FaultRecord`s): the event's identity and occurrence times, and its `Verdict` whole (the catalog's
    severity, drain, urgency, recovery, history rule, clearable; read through the properties)."""

    kind: str
    code: int | None
    device: str | None
    verdict: Verdict
    times: list[datetime]
    """Occurrences (observed_at), oldest first; at least one."""
    cleared: bool = False
    message: str = ""
    arrived_at: datetime | None = None
    """When the incident first saw it (debounce runs from here; `times[0]` when unknown)."""

    @property
    def severity(self) -> Severity:
        return Severity(self.verdict.severity)

    @property
    def drain(self) -> bool:
        return self.verdict.drain

    @property
    def immediate_action(self) -> str:
        return self.verdict.immediate_action

    @property
    def fault_class(self) -> str:
        return self.verdict.fault_class

    @property
    def recovery(self) -> Recovery:
        return self.verdict.recovery

    @property
    def urgency(self) -> Urgency:
        return self.verdict.urgency

    @property
    def history(self) -> History | None:
        return self.verdict.history

    @property
    def clearable(self) -> bool:
        return self.verdict.clearable


@dataclass
class RuleSettings:
    """The history rules' knobs (defaults: `PolicySettings`)."""

    app_xid_repeats: int = policy_default("app_xid_repeats")
    app_xid_window_s: float = policy_default("app_xid_window_s")
    sbe_events_per_window: int = policy_default("sbe_events_per_window")
    sbe_window_s: float = policy_default("sbe_window_s")
    max_future_s: float | None = MAX_CLOCK_SKEW_S
    """Two-sided windows: an occurrence counts only between `now - window` and `now + max_future_s`
    (the agents' allowed clock skew, `fleetmend.events.MAX_CLOCK_SKEW_S`): three XID 13 dated years
    ahead are not "recent". None: no upper bound."""
    repeats_need_a_device: bool = False
    """True: `app_xid_repeat` counts only the repeats of a named GPU. Events that name no GPU (no bus id, name,
    UUID or index: `fleetmend inject` without --bus-id, a device-plugin line without `Device=`) share the key
    device None; three of them may be three GPUs (an application bug across a job), so they are recorded, not
    read as one GPU's hardware. False (the default, until the workflow passes it behind `workflow.patched`: a
    history that drained on such repeats must replay as it ran): they count as one GPU, as before, and the
    reason says the GPU is unknown."""


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
    tags_by_dev: dict[str | None, dict[History, set[int]]] = {}
    for f in faults:
        if f.kind == "xid" and f.code is not None:
            xids_by_dev.setdefault(f.device, set()).add(f.code)
            if f.history is not None:
                tags_by_dev.setdefault(f.device, {}).setdefault(f.history, set()).add(f.code)
    all_xids = set().union(*xids_by_dev.values()) if xids_by_dev else set()
    sympathetic = {f.code for f in faults if f.kind == "xid" and f.history is History.SYMPATHETIC}
    candidates: list[tuple[FaultView, Urgency, Recovery, str]] = []
    for f in faults:
        if f.cleared:
            continue
        tags = tags_by_dev.get(f.device, {})
        if f.kind == "xid" and f.history is History.SYMPATHETIC:
            others = sorted(all_xids - sympathetic)
            d.reasons.append(f"XID {f.code} on {f.device}: sympathetic to XID {', '.join(map(str, others))}; ignored"
                             if others else f"XID {f.code} alone on {f.device}: preemptive cleanup, recorded only")
            continue
        if f.kind == "xid" and f.history is History.REPEATS and not f.drain:
            recent = _within(f.times, now, rules.app_xid_window_s, rules.max_future_s)
            if len(recent) >= rules.app_xid_repeats and f.device is None and rules.repeats_need_a_device:
                d.reasons.append(f"XID {f.code} {len(recent)}× within {rules.app_xid_window_s:.0f}s on no named GPU "
                                 "(the events carry no bus id): not one GPU's repeats (an application fault on "
                                 "several GPUs reads the same); recorded only")
            elif len(recent) >= rules.app_xid_repeats:
                where = f"GPU {f.device}" if f.device else "an unknown GPU (no bus id: every such event counted as one)"
                candidates.append((f, Urgency.NOW, Recovery.DIAGNOSE,
                                   f"XID {f.code} {len(recent)}× on {where} within "
                                   f"{rules.app_xid_window_s:.0f}s (≥ {rules.app_xid_repeats}): hardware suspect"))
            continue
        remap = tags.get(History.REMAP_PENDING, set()) | tags.get(History.REMAP_FAILURE, set())
        if f.kind == "xid" and f.history is History.DBE and remap:
            candidates.append((f, f.urgency, f.recovery,
                               f"XID {f.code} (DBE) with XID {'/'.join(map(str, sorted(remap)))} on GPU {f.device}: "
                               "drain and reset the GPU (applies the row remap)"))
            continue
        if f.history is History.RATE:
            recent = _within(f.times, now, rules.sbe_window_s, rules.max_future_s)
            if len(recent) >= rules.sbe_events_per_window:
                candidates.append((f, f.urgency, f.recovery,
                                   f"SBE rate rising on GPU {f.device}: {len(recent)} events within "
                                   f"{rules.sbe_window_s:.0f}s: drain when idle, then reset"))
            continue
        if f.history is History.REMAP_PENDING and not (f.kind == "xid" and tags.get(History.DBE)):
            candidates.append((f, f.urgency, f.recovery,
                               f"row remap pending on GPU {f.device}: drain when idle, then reset to apply it"))
            continue
        if f.kind == "fail_slow" and f.drain:
            candidates.append((f, f.urgency, f.recovery,
                               f"fail-slow on {f.device or 'the node'}: a persistent outlier among its peers; "
                               "drain when idle, diagnose, ticket"))
            continue
        if f.drain:
            candidates.append((f, f.urgency, f.recovery, f"{f.fault_class}: catalog action {f.immediate_action}"))
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
