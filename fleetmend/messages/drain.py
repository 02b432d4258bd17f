"""`NodeRemediation` → the scheduler adapter: drain/undrain requests and their results, and the
node as the scheduler sees it (`NodeInfo`). `OWNER_*` say who drained a node.

No `from __future__ import annotations` here: the workflow sandbox resolves dataclass annotations
that are strings in its own module table, where they may be missing.
"""

from dataclasses import dataclass
from datetime import datetime

OWNER_FLEETMEND = "fleetmend"
OWNER_OPERATOR = "operator"


@dataclass
class DrainRequest:
    cluster: str
    node: str
    reason: str
    incident_id: str
    wait_drained_s: float = 0.0
    """Seconds `drain_node` waits (heartbeating) for DRAINING → DRAINED, i.e. running jobs to end.
    0 returns as soon as the drain is set (the node may still be `draining`)."""
    observed_at: datetime | None = None
    """When the fault that caused the drain was observed (the event's `observed_at`); given, the
    activity observes `fleetmend_time_to_quarantine_seconds`."""


@dataclass
class DrainResult:
    node: str
    drained: bool
    """The node is (now) drained or draining (or down): no new work lands on it."""
    owned: bool
    """fleetmend set this drain (reason carries the prefix / KV entry owner is fleetmend)."""
    operator_drained: bool
    """Someone else drained (or downed) it first; fleetmend leaves it and never undrains it."""
    state: str
    """Normalized state: idle, allocated, mixed, draining, drained, down, … (`*` = not responding)."""
    detail: str
    reason: str = ""
    """The scheduler's current drain reason (without Slurm's `[user@time]` suffix)."""
    raw_state: str = ""
    """The scheduler's own state text, e.g. Slurm `ALLOCATED+DRAIN`."""
    repeat_part: str | None = None
    """Set by the drain when the incident ledger shows the faulty part (by serial) failed with the same fault
    class within `policy.repeat_part_window_days`: the reason, and the incident goes to RMA like a lemon."""


@dataclass
class UndrainRequest:
    cluster: str
    node: str
    incident_id: str
    drained_at: datetime | None = None
    """When the node was drained; given, a successful undrain observes `fleetmend_mttr_seconds`."""


@dataclass
class UndrainResult:
    node: str
    resumed: bool
    """True only when this call returned a fleetmend-owned drain to service."""
    state: str
    detail: str
    operator_drained: bool = False
    """The drain belongs to someone else and was left in place (resumed is False)."""


@dataclass
class NodeInfo:
    """One row of `list_nodes()` (for `fleetmend nodes` / `fleetmend status`)."""

    name: str
    state: str
    reason: str
    owner: str | None
    """"fleetmend", "operator", or None when the node is not drained."""
    incident_id: str | None = None
