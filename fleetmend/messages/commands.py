"""CLI → `NodeRemediation`: one dataclass per update (`RepairedCommand`, `RetestCommand`,
`AbortCommand`), answered by the `status` query's `IncidentStatus`.

No `from __future__ import annotations` here: the workflow sandbox resolves dataclass annotations
that are strings in its own module table, where they may be missing.
"""

from dataclasses import dataclass, field
from typing import Any

from fleetmend.events import Severity
from fleetmend.messages.names import Outcome, Phase


@dataclass
class RepairedCommand:
    """`mark_repaired`: the hardware was repaired; verification runs next."""

    by: str
    """Who sent it (CLI user@host, or `ticket:<id>`); recorded in history for audit."""
    note: str = ""
    ticket: str | None = None


@dataclass
class RetestCommand:
    """`force_retest`: run the verification diagnostics now."""

    by: str
    note: str = ""


@dataclass
class AbortCommand:
    """`abort`: close the incident now; `undrain` returns a node fleetmend drained."""

    by: str
    note: str = ""
    undrain: bool = False


@dataclass
class IncidentStatus:
    """The `status` query's answer: JSON-safe views (times ISO-8601 to the second)."""

    workflow_id: str
    node: str
    cluster: str
    phase: Phase
    outcome: Outcome | None
    drained: bool
    ticket: str | None
    fault_class: str | None
    severity: Severity
    opened_at: str | None
    closed_at: str | None
    faults: list[dict[str, Any]]
    faults_dropped: int
    duplicates: int
    timeline: list[dict[str, Any]]
    last_diag: dict[str, Any] | None
    operator_drained: bool
    permit_held: bool = False
    decisions: list[str] = field(default_factory=list)
    recovery_log: list[str] = field(default_factory=list)
    lemon: str | None = None
    drained_at: str | None = None
    """When fleetmend drained the node (None: never drained by this incident)."""
