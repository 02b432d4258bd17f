"""Every NATS subject, JetStream name and Temporal id comes from a function here.

Call sites never build them with f-strings, so a rename is one edit and the node-scoped
permissions in `deploy/nats/` stay in step with the code.
"""

from __future__ import annotations

import re

FAULT_STREAM = "FLEET_FAULTS"
"""JetStream stream holding fault events (file storage, dedupe window by Nats-Msg-Id)."""
DEADLETTER_STREAM = "FLEET_DEADLETTER"
DEADLETTER_SUBJECT = "fleet.deadletter"
ROUTER_DURABLE = "fleetmend-router"
DRAIN_KV_BUCKET = "fleetmend_drains"
"""JetStream key-value bucket of the standalone scheduler adapter (drained set, durable)."""
TICKET_KV_BUCKET = "fleetmend_tickets"
LEASE_KV_BUCKET = "fleetmend_leases"
"""Leases electing the one replica that publishes a cluster's fleet-level gauges (`fleetmend.lease`)."""
NOTIFY_KV_BUCKET = "fleetmend_notified"
"""Notifications already delivered, by deduplication key and channel (a retried activity skips them)."""

_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


def _check(kind: str, value: str) -> str:
    if not _NAME.match(value or ""):
        raise ValueError(f"invalid {kind} name {value!r}: use letters, digits, '-' and '_' only")
    return value


def fault_subject(cluster: str, node: str) -> str:
    """`fleet.<cluster>.fault.<node>`: where a node's agent publishes its `FaultEvent`s."""
    return f"fleet.{_check('cluster', cluster)}.fault.{_check('node', node)}"


def heartbeat_subject(cluster: str, node: str) -> str:
    """`fleet.<cluster>.hb.<node>`: core-NATS heartbeats (never stored in the fault stream)."""
    return f"fleet.{_check('cluster', cluster)}.hb.{_check('node', node)}"


def diag_subject(cluster: str, node: str) -> str:
    """`fleet.<cluster>.diag.<node>`: request/reply diagnostics answered by the node's agent."""
    return f"fleet.{_check('cluster', cluster)}.diag.{_check('node', node)}"


def all_faults_subject() -> str:
    return "fleet.*.fault.*"


def all_heartbeats_subject() -> str:
    return "fleet.*.hb.*"


def max_deliveries_advisory(stream: str, consumer: str) -> str:
    """JetStream's advisory when a message of `stream` reached `consumer`'s max deliveries."""
    return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{consumer}"


def parse_fault_subject(subject: str) -> tuple[str, str]:
    """Inverse of `fault_subject`. Returns (cluster, node). Raises ValueError for other subjects."""
    parts = subject.split(".")
    if len(parts) != 4 or parts[0] != "fleet" or parts[2] != "fault":
        raise ValueError(f"not a fault subject: {subject!r} (expected fleet.<cluster>.fault.<node>)")
    return _check("cluster", parts[1]), _check("node", parts[3])


def workflow_id(cluster: str, node: str) -> str:
    """`remediate/<cluster>/<node>`: the one `NodeRemediation` workflow id of a node."""
    return f"remediate/{_check('cluster', cluster)}/{_check('node', node)}"


def fleetguard_workflow_id(cluster: str) -> str:
    """`fleetguard/<cluster>`: the one `FleetGuard` workflow (drain budget, breaker) of a cluster."""
    return f"fleetguard/{_check('cluster', cluster)}"


def parse_workflow_id(wid: str) -> tuple[str, str]:
    parts = wid.split("/")
    if len(parts) != 3 or parts[0] != "remediate":
        raise ValueError(f"not a remediation workflow id: {wid!r}")
    return parts[1], parts[2]


def msg_id(event_id: str) -> str:
    """JetStream `Nats-Msg-Id` for an event: the event id itself (dedupe across re-sends)."""
    return event_id
