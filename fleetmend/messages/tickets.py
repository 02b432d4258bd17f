"""`NodeRemediation` → the ticket filer (Jira, webhook, local ledger), and → the agent for
diagnostics and recovery.

No `from __future__ import annotations` here: the workflow sandbox resolves dataclass annotations
that are strings in its own module table, where they may be missing.
"""

from dataclasses import dataclass

from fleetmend.diagnostics import DiagLevel, RecoveryOp


@dataclass
class TicketRequest:
    incident_id: str
    cluster: str
    node: str
    title: str
    severity: str
    fault_class: str
    evidence: dict
    """Raw lines, classification, diagnostics report: stored (and sent) in full."""


@dataclass
class TicketRef:
    ticket_id: str
    url: str | None
    created: bool
    """False when the incident already had a ticket (idempotent re-file)."""


@dataclass
class TicketUpdate:
    ticket_id: str
    incident_id: str
    status: str
    comment: str


@dataclass
class TicketStatus:
    """What `poll_ticket` reports: the ticket system's own status and whether it means repaired."""

    ticket_id: str
    status: str
    """The remote status name as the ticket system says it (Jira "Done", a webhook's "repaired", …)."""
    repaired: bool
    """`status` is one of `tickets.repaired_statuses` (case-insensitive)."""
    url: str | None = None
    detail: str = ""




@dataclass
class DiagActivityRequest:
    cluster: str
    node: str
    level: DiagLevel = DiagLevel.QUICK
    checks: list[str] | None = None
    timeout_s: float = 120.0
    incident_id: str | None = None


@dataclass
class RecoveryActivityRequest:
    cluster: str
    node: str
    op: RecoveryOp
    pci_bus_id: str | None = None
    incident_id: str | None = None
    timeout_s: float = 120.0
    """Reply wait; `nvidia-smi -r` takes seconds, a reboot request is answered before the reboot."""
