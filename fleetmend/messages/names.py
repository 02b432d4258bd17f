"""Names shared by every process: activity, workflow, signal, query and update names, task queues,
and the search-attribute keys, so the router and the CLI address workflows without importing them.

No `from __future__ import annotations` here: the workflow sandbox resolves dataclass annotations
that are strings in its own module table, where they may be missing.
"""

from datetime import datetime
from enum import StrEnum

from temporalio.common import SearchAttributeKey


class Activity:
    """Activity names: the worker registers them (`@activity.defn(name=...)`), workflows call them."""

    DRAIN_NODE = "drain_node"
    UNDRAIN_NODE = "undrain_node"
    FILE_TICKET = "file_ticket"
    UPDATE_TICKET = "update_ticket"
    POLL_TICKET = "poll_ticket"
    RUN_DIAGNOSTICS = "run_diagnostics"
    RESET_GPU = "reset_gpu"
    REBOOT_NODE = "reboot_node"
    REQUEST_DRAIN_PERMIT = "request_drain_permit"
    """The incident's one way to ask for a drain permit: signal-with-start of its cluster's FleetGuard
    (`GuardApi.REQUEST_PERMITS`); the answer comes back as a `RemediationApi.PERMIT` signal."""
    RELEASE_DRAIN_PERMIT = "release_drain_permit"
    """The permit back: the node's permit pool slot, then a `GuardApi.RELEASE` signal."""
    RUNNING_INCIDENTS = "running_incidents"
    """FleetGuard's reconciliation: which of these nodes (or, for none, which nodes of the cluster) have
    a running incident."""
    SYNC_PERMIT_POOL = "sync_permit_pool"
    """FleetGuard's one write to the permit pool: budget, rack cap, open/closed, closed domains, the slots
    to free, and the slots to take for the queue heads it grants (`PoolSync` → `PoolSynced`)."""
    RECONCILE_POOL = "reconcile_pool"
    """FleetGuard's check of the pool's holders against the incidents (`PoolReconcile` →
    `PoolReconciled`): a drained node whose incident never started gets one."""
    BENCH_NODE = "bench_node"
    """`Sweep`: one node's benchmark numbers (`fleetmend.messages.sweep.BenchActivityRequest` → `BenchReport`)."""
    OPEN_FAIL_SLOW = "open_fail_slow"
    """`Sweep --act`: publish fail_slow for the outliers (`fleetmend.messages.sweep.FailSlowRequest` → node names)."""
    NOTIFY = "notify"
    RECONFIGURE_NODE = "reconfigure_node"
    """A `config_drift` incident's live fix: the agent sets the settings and re-reads them
    (`fleetmend.fingerprint.ReconfigureRequest` → `ReconfigureReport`; `activities.reconfigure`)."""


class RemediationApi:
    """The `NodeRemediation` workflow's type, signal, query and update names."""

    WORKFLOW = "NodeRemediation"
    FAULTS = "faults"
    PERMIT = "permit"
    STATUS = "status"
    MARK_REPAIRED = "mark_repaired"
    FORCE_RETEST = "force_retest"
    ABORT = "abort"


class GuardApi:
    """The `FleetGuard` workflow's type, signal, query and update names."""

    WORKFLOW = "FleetGuard"
    REQUEST_PERMITS = "request_permits"
    """Permit requests, a list per signal: an incident's own (one), or the router's for the nodes of a
    burst it found no pool slot for (many); an empty list only starts the guard."""
    RELEASE = "release"
    POLICY = "policy"
    """A worker's `GuardPolicy` at its start (budget, rack cap, breaker, observe-only): a changed setting
    reaches the guard, and the permit pool, before any request carries it."""
    DOMAINS = "analyzer_domains"
    """The fail-slow analyzer's domain findings (`DomainReport`, sent by a worker): each one an
    infrastructure incident; their nodes' fail_slow incidents are denied while it is open."""
    STATUS = "status"
    RESET_BREAKER = "reset_breaker"
    PAUSE = "pause"
    RESUME = "resume"
    RELEASE_PERMIT = "release_permit"


class SweepApi:
    """The `Sweep` workflow's type name (the CLI starts it by name; it imports no workflow module)."""

    WORKFLOW = "Sweep"


def guard_task_queue(task_queue: str) -> str:
    """The one task queue FleetGuard runs on, beside the cluster's `task_queue` (`fleet` → `fleet-guard`).

    The guard has workflow-task slots of its own (`fleetmend.worker`): in a storm a thousand incidents'
    first workflow tasks wait on the cluster's queue, and the guard that answers them must not wait
    behind them."""
    return f"{task_queue}-guard"


KEY_NODE = SearchAttributeKey.for_keyword("FleetNode")
KEY_CLUSTER = SearchAttributeKey.for_keyword("FleetCluster")
KEY_PHASE = SearchAttributeKey.for_keyword("FleetPhase")
KEY_FAULT_CLASS = SearchAttributeKey.for_keyword("FleetFaultClass")
KEY_TICKET = SearchAttributeKey.for_keyword("FleetTicket")
KEY_SEVERITY = SearchAttributeKey.for_keyword("FleetSeverity")
KEY_DRAINED = SearchAttributeKey.for_bool("FleetDrained")


def iso(at: datetime | None) -> str | None:
    """`2026-11-29T17:20:24+00:00`: how times are shown (status, timeline, evidence)."""
    return at.isoformat(timespec="seconds") if at is not None else None


class Phase(StrEnum):
    TRIAGE = "triage"
    AWAITING_PERMIT = "awaiting_permit"
    DRAINING = "draining"
    DIAGNOSING = "diagnosing"
    RECOVERING = "recovering"
    AWAITING_REPAIR = "awaiting_repair"
    VERIFYING = "verifying"
    RETURNING = "returning"
    CLOSED = "closed"


class Outcome(StrEnum):
    RETURNED = "returned_to_service"
    RECORDED = "recorded"
    """Only faults that need no drain (application-side); nothing was touched."""
    OBSERVED = "observed"
    """Observe-only mode: a drain would have happened; nothing was touched."""
    ABORTED = "aborted"
    OPERATOR_OWNED = "operator_owned"
    """The node was already drained by an operator; fleetmend recorded and left it."""
    INFRASTRUCTURE = "infrastructure_incident"
    """Part of a correlated failure-domain incident (FleetGuard): not drained, a human was paged."""
    DENIED = "permit_denied"
