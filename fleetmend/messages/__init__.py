"""Every message that crosses a process or stage boundary after the router, defined once, one module
per conversation; this package re-exports them all (`from fleetmend.messages import FaultRecord`).

| module | conversation |
|---|---|
| `fleetmend.messages.names` | activity, workflow, signal, query, update names; task queues; search keys; phases |
| `fleetmend.messages.incident` | router → `NodeRemediation` (`IncidentInput`, `FaultBatch`, byte budget); carried state |
| `fleetmend.messages.commands` | CLI → `NodeRemediation` updates and the `status` query's answer |
| `fleetmend.messages.guard` | `FleetGuard` ↔ incidents, router and CLI: permits, the guard's policy and state |
| `fleetmend.messages.drain` | `NodeRemediation` → the scheduler adapter (drain, undrain, `NodeInfo`) |
| `fleetmend.messages.tickets` | → the ticket filer; → the agent for diagnostics and recovery |
| `fleetmend.messages.notify` | → the notifier |
| `fleetmend.messages.sweep` | the CLI → `Sweep` → agents benchmark sweep |
| `fleetmend.messages.fingerprint` | agent → KV bucket and stream: the node fingerprint; → the agent: live fixes |

Next to `fleetmend.events.FaultEvent` (agent → router), these are what the router, the workflows,
the activities and the CLI say to each other. Payloads travel through Temporal's pydantic data
converter (`fleetmend.infra.converter`): dataclasses with enums and `datetime` fields round-trip as
themselves. Imports only the contract, pydantic and `temporalio.common` (search-attribute keys).
No `from __future__ import annotations` in this package (nor in `fleetmend.catalog`): the workflow
sandbox resolves dataclass annotations that are strings in its own module table, where they may be
missing.
"""

from fleetmend.messages.commands import AbortCommand, IncidentStatus, RepairedCommand, RetestCommand
from fleetmend.messages.drain import (
    OWNER_FLEETMEND,
    OWNER_OPERATOR,
    DrainRequest,
    DrainResult,
    NodeInfo,
    UndrainRequest,
    UndrainResult,
)
from fleetmend.messages.fingerprint import (
    DeviceRole,
    Fingerprint,
    FingerprintChange,
    FixResult,
    ReconfigureReport,
    ReconfigureRequest,
    TopoLevel,
)
from fleetmend.messages.guard import (
    GUARD_MAX_HISTORY_EVENTS,
    GuardCommand,
    GuardInput,
    GuardPhase,
    GuardPolicy,
    GuardState,
    GuardStatus,
    Held,
    InfraIncident,
    PermitDecision,
    PermitRelease,
    PermitReleaseCommand,
    PermitRequest,
    PoolClaim,
    PoolReconcile,
    PoolReconciled,
    PoolSync,
    PoolSynced,
    Queued,
    RunningIncident,
    RunningIncidents,
)
from fleetmend.messages.incident import (
    MAX_PENDING_FAULTS,
    MAX_PENDING_HARD,
    MAX_SIGNAL_BYTES,
    WORKFLOW_ATTR_CHARS,
    WORKFLOW_ATTRS,
    WORKFLOW_MESSAGE_CHARS,
    WORKFLOW_RAW_BYTES,
    DiagOutcome,
    FaultBatch,
    FaultRecord,
    IncidentInput,
    IncidentPolicy,
    IncidentState,
    Occurrence,
    RoutedFault,
    TimelineEntry,
    for_workflow,
)
from fleetmend.messages.names import (
    KEY_CLUSTER,
    KEY_DRAINED,
    KEY_FAULT_CLASS,
    KEY_NODE,
    KEY_PHASE,
    KEY_SEVERITY,
    KEY_TICKET,
    Activity,
    GuardApi,
    Outcome,
    Phase,
    RemediationApi,
    SweepApi,
    guard_task_queue,
    iso,
)
from fleetmend.messages.notify import Notification, NotifyEvent, NotifyResult
from fleetmend.messages.sweep import (
    BenchActivityRequest,
    FailSlowRequest,
    MetricCell,
    NodeRow,
    SweepFinding,
    SweepInput,
    SweepResult,
)
from fleetmend.messages.tickets import (
    DiagActivityRequest,
    RecoveryActivityRequest,
    TicketRef,
    TicketRequest,
    TicketStatus,
    TicketUpdate,
)

__all__ = [
    "AbortCommand",
    "Activity",
    "BenchActivityRequest",
    "DiagActivityRequest",
    "DiagOutcome",
    "DrainRequest",
    "DrainResult",
    "FailSlowRequest",
    "FaultBatch",
    "FaultRecord",
    "GUARD_MAX_HISTORY_EVENTS",
    "GuardApi",
    "GuardCommand",
    "GuardInput",
    "GuardPhase",
    "GuardPolicy",
    "GuardState",
    "GuardStatus",
    "Held",
    "IncidentInput",
    "IncidentPolicy",
    "IncidentState",
    "IncidentStatus",
    "InfraIncident",
    "KEY_CLUSTER",
    "KEY_DRAINED",
    "KEY_FAULT_CLASS",
    "KEY_NODE",
    "KEY_PHASE",
    "KEY_SEVERITY",
    "KEY_TICKET",
    "MAX_PENDING_FAULTS",
    "MAX_PENDING_HARD",
    "MAX_SIGNAL_BYTES",
    "MetricCell",
    "NodeInfo",
    "NodeRow",
    "Notification",
    "NotifyEvent",
    "NotifyResult",
    "OWNER_FLEETMEND",
    "OWNER_OPERATOR",
    "Occurrence",
    "Outcome",
    "PermitDecision",
    "PermitRelease",
    "PermitReleaseCommand",
    "PermitRequest",
    "DeviceRole",
    "Fingerprint",
    "FingerprintChange",
    "FixResult",
    "ReconfigureReport",
    "ReconfigureRequest",
    "TopoLevel",
    "Phase",
    "PoolClaim",
    "PoolReconcile",
    "PoolReconciled",
    "PoolSync",
    "PoolSynced",
    "Queued",
    "RecoveryActivityRequest",
    "RemediationApi",
    "RepairedCommand",
    "RetestCommand",
    "RoutedFault",
    "RunningIncident",
    "RunningIncidents",
    "SweepApi",
    "SweepFinding",
    "SweepInput",
    "SweepResult",
    "TicketRef",
    "TicketRequest",
    "TicketStatus",
    "TicketUpdate",
    "TimelineEntry",
    "UndrainRequest",
    "UndrainResult",
    "WORKFLOW_ATTRS",
    "WORKFLOW_ATTR_CHARS",
    "WORKFLOW_MESSAGE_CHARS",
    "WORKFLOW_RAW_BYTES",
    "for_workflow",
    "guard_task_queue",
    "iso",
]
