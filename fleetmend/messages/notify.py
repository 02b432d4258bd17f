"""`NodeRemediation`/`FleetGuard` → the notifier: what happened (`NotifyEvent`) and to whom
(`Notification`, `NotifyResult`).

No `from __future__ import annotations` here: the workflow sandbox resolves dataclass annotations
that are strings in its own module table, where they may be missing.
"""

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class NotifyEvent(StrEnum):
    """What a human is told about (webhook, Slack, PagerDuty); `notify.events` picks which."""

    DRAINED = "drained"
    TICKET_FILED = "ticket_filed"
    BREAKER_OPEN = "breaker_open"
    LEMON = "lemon"
    RETURNED = "returned"
    VERSION_FINDING = "version_finding"
    """A fault class concentrated on one driver/firmware/kernel/BIOS value beyond chance (`fleetmend report`)."""
    ATTENTION = "attention"
    """A recorded fault that drains nothing but that only a person can act on (check the cabling, contact
    support, update firmware): once per incident (`workflows.remediation.ATTENTION_ACTIONS`)."""


@dataclass
class Notification:
    """One notification, sent to every configured channel at most once per `dedup_key`.

    `dedup_key` is `fleetmend/<incident id>/<event>` (an incident's events) or
    `fleetmend/<cluster>/breaker/<tripped at>`; PagerDuty gets `alert_key` (the incident's one
    alert: drain and ticket trigger it, return to service resolves it).
    """

    event: NotifyEvent
    cluster: str
    summary: str
    dedup_key: str
    alert_key: str
    node: str | None = None
    severity: str = "info"
    """fleetmend severity (info, degraded, fatal); PagerDuty's is derived from it."""
    incident_id: str | None = None
    ticket: str | None = None
    ticket_url: str | None = None
    runbook: str | None = None
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class NotifyResult:
    sent: list[str] = field(default_factory=list)
    """Channels that accepted it now."""
    already: list[str] = field(default_factory=list)
    """Channels that had it already (a retried activity): not sent again."""
