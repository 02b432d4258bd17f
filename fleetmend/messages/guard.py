"""`FleetGuard` ↔ everyone: permit requests, decisions and releases, the guard's policy, its
carried state (`GuardState`, `Held`, `Queued`) and what its `status` query answers.

No `from __future__ import annotations` here: the workflow sandbox resolves dataclass annotations
that are strings in its own module table, where they may be missing.
"""

from dataclasses import dataclass, field, fields
from datetime import datetime
from enum import StrEnum
from typing import Any

from fleetmend.config import PolicySettings, policy_default
from fleetmend.events import Severity
from fleetmend.messages.names import Outcome, Phase, iso


@dataclass
class PermitDecision:
    granted: bool
    reason: str
    lemon: str | None = None
    """Set when the node is a lemon (the reason): the incident goes to RMA instead of recovery."""
    infra_incident: str | None = None
    queued: bool = False
    """Neither granted nor denied yet (`reason` says why it waits): the decision follows as a `permit`
    signal."""


@dataclass
class GuardPolicy:
    """Blast-radius policy (`from_settings`), carried by every request: the newest wins. Defaults are
    `PolicySettings`' own."""

    max_drained_nodes: int = policy_default("max_drained_nodes")
    max_drained_percent: float = policy_default("max_drained_percent")
    max_drained_per_rack: int = policy_default("max_drained_per_rack")
    cluster_nodes: int | None = policy_default("cluster_nodes")
    breaker_distinct_nodes: int = policy_default("breaker_distinct_nodes")
    breaker_window_s: float = policy_default("breaker_window_s")
    domain_incident_nodes: int = policy_default("domain_incident_nodes")
    domain_window_s: float = policy_default("domain_window_s")
    lemon_repairs: int = policy_default("lemon_repairs")
    lemon_window_s: float = policy_default("lemon_window_s")
    observe_only: bool = policy_default("observe_only")
    permit_reconcile_s: float = policy_default("permit_reconcile_s")
    topology_nodes: int = 0
    """Nodes the topology file lists (the worker counts them; the file itself stays out of history)."""

    @classmethod
    def from_settings(cls, p: PolicySettings, topology_nodes: int = 0) -> "GuardPolicy":
        return cls(**{f.name: getattr(p, f.name) for f in fields(cls) if f.name != "topology_nodes"},
                   topology_nodes=topology_nodes)


@dataclass
class PermitRequest:
    cluster: str
    node: str
    severity: Severity
    fault_class: str
    reason: str = ""
    rack: str | None = None
    domains: list[str] = field(default_factory=list)
    """`rack:…`, `leaf:…`, `pdu:…` from the topology (attached by the activity)."""
    policy: GuardPolicy = field(default_factory=GuardPolicy)
    requested_at: datetime | None = None
    """When the incident first asked (UTC); the queue keeps its oldest."""
    preclaimed: bool = False
    """The router already drained the node under a slot of the permit pool (its fault must drain now):
    the guard adopts it as held (it is drained; the pool kept the budget and the rack cap) instead of
    deciding. Set by the `request_drain_permit` activity from the pool."""
    forwarded: bool = False
    """Sent by the router for a node that must drain now and got no slot in the permit pool, right after
    its incident started: the guard queues it at once (a burst is visible in `fleetmend status` within
    seconds, not after every incident's first workflow task) and keeps its own policy (the router's
    settings do not replace the worker's). The incident's own request, which follows, keeps the queue
    place."""


@dataclass
class PermitRelease:
    cluster: str
    node: str
    outcome: Outcome
    fault_class: str = ""
    returned: bool = False
    """True when the node went back to service after a repair (counts toward the lemon rule)."""
    still_drained: bool = False
    """The incident closed (aborted without `--undrain`) leaving fleetmend's drain in place: the permit and
    its pool slot stay taken (the node is still cordoned and counts against the budget), listed as stranded
    until `fleetmend breaker release NODE` returns it to service; only a queued request is withdrawn."""


@dataclass
class GuardCommand:
    """`reset_breaker`, `pause`, `resume`: who (`by`, for the audit trail) and why."""

    by: str
    note: str = ""


@dataclass
class PermitReleaseCommand:
    """`release_permit` (`fleetmend breaker release NODE`): free NODE's permit or queued request by hand."""

    by: str
    node: str
    note: str = ""


@dataclass
class RunningIncidents:
    """`running_incidents` activity: `nodes` to check (None: every running incident of the cluster)."""

    cluster: str
    nodes: list[str] | None = None


@dataclass
class RunningIncident:
    node: str
    phase: Phase | None = None
    """The incident's `FleetPhase` (None: not published yet, or not a phase this version knows)."""
    severity: Severity | None = None
    fault_class: str = ""
    rack: str | None = None
    domains: list[str] = field(default_factory=list)


@dataclass
class GuardPhase(StrEnum):
    """FleetGuard's `FleetPhase` search attribute."""

    GUARDING = "guarding"
    BREAKER_TRIPPED = "breaker_tripped"
    PAUSED = "paused"


@dataclass
class Held:
    node: str
    severity: Severity
    fault_class: str
    rack: str | None
    granted_at: datetime

    def to_dict(self) -> dict[str, Any]:
        """The shape `GuardStatus.held` shows: enums as values, times as `iso`."""
        return {"node": self.node, "severity": self.severity.value, "fault_class": self.fault_class,
                "rack": self.rack, "granted_at": iso(self.granted_at)}


@dataclass
class Queued:
    node: str
    severity: Severity
    fault_class: str
    rack: str | None
    domains: list[str]
    requested_at: datetime
    reason: str = ""
    counted: bool = True
    """False for an entry rebuilt from a running incident (`FleetGuard._rebuild`): its fault was not
    counted toward the breaker and the failure domains yet, so its incident's next request counts it.
    A counted entry's later requests are re-asks (patch reask-not-a-fault)."""

    def to_dict(self) -> dict[str, Any]:
        """The shape `GuardStatus.queue` shows: enums as values, times as `iso`."""
        return {"node": self.node, "severity": self.severity.value, "fault_class": self.fault_class,
                "rack": self.rack, "domains": list(self.domains), "requested_at": iso(self.requested_at),
                "reason": self.reason}


FAIL_SLOW_CLASS = "fail_slow"
"""The fault class of the analyzer's node findings (the catalog's `fail_slow` kind)."""
INFRA_TOPOLOGY = "topology"
"""`InfraIncident.source`: drain-worthy faults of `domain_incident_nodes` nodes under one domain of the
topology file, counted by the guard."""
INFRA_ANALYZER = "analyzer"
"""`InfraIncident.source`: a domain finding of the fail-slow analyzer (`DomainReport`)."""


@dataclass
class InfraIncident:
    domain: str
    opened_at: datetime
    last_fault_at: datetime
    nodes: list[str]
    ticket: str | None = None
    closed_at: datetime | None = None
    source: str = INFRA_TOPOLOGY
    """`INFRA_TOPOLOGY` or `INFRA_ANALYZER`. An analyzer incident denies the fail_slow incidents of its
    `nodes` only (the outliers its domain explains in the analyzer's last report), closes when the
    analyzer no longer reports it, and does not close the domain in the permit pool (a fatal fault
    there still drains)."""
    metrics: list[str] = field(default_factory=list)
    """An analyzer incident: the metrics its nodes outlie on."""
    confirmed_at: datetime | None = None
    """An analyzer incident: the last report that still listed it (`last_fault_at` stays its opening)."""
    closed_why: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The shape `GuardStatus.infra_incidents` shows: times as `iso`."""
        return {"domain": self.domain, "opened_at": iso(self.opened_at), "last_fault_at": iso(self.last_fault_at),
                "nodes": list(self.nodes), "ticket": self.ticket, "closed_at": iso(self.closed_at),
                "source": self.source, "metrics": list(self.metrics), "confirmed_at": iso(self.confirmed_at),
                "closed_why": self.closed_why}


DOMAIN_MAX_NODES = 1000
"""Nodes a `DomainFinding` lists at most (a leaf switch's; a signal and the carried state stay small)."""
DOMAIN_MAX_FINDINGS = 50
"""Domain findings one `DomainReport` carries at most."""


@dataclass
class DomainFinding:
    """One failure domain whose fail-slow outliers the analyzer explains (`fleetmend.analyzer.shared`):
    `key` `rack:r07` / `leaf:…` / `pdu:…` (topology) or `inferred:<epoch>` (co-occurrence); `nodes` the
    outliers it explains in the analyzer's last window (not one that stands out even against the
    domain's own median: that fault is its own); `metrics` what they outlie on; `windows` how many
    windows in a row it has been seen; `share` of the domain's judged nodes outlying."""

    key: str
    nodes: list[str]
    metrics: list[str] = field(default_factory=list)
    windows: int = 0
    share: float = 0.0


@dataclass
class DomainReport:
    """`GuardApi.DOMAINS`: every domain finding the analyzer has reported (seen `windows` windows in a
    row) and still sees, as of its window ending `window_end`; a domain missing from it has cleared. Sent
    by a worker (`fleetmend.worker.analyzer_link`) when the list changes, and again every
    `fleetmend.worker.analyzer_link.DOMAIN_REFRESH_S` while it is not empty."""

    cluster: str
    window_end: datetime | None = None
    findings: list[DomainFinding] = field(default_factory=list)


@dataclass
class GuardState:
    cluster: str
    policy: GuardPolicy = field(default_factory=GuardPolicy)
    held: list[Held] = field(default_factory=list)
    queue: list[Queued] = field(default_factory=list)
    seen_nodes: list[str] = field(default_factory=list)
    recent: list[tuple[str, datetime]] = field(default_factory=list)
    """(node, time) of drain-worthy requests within the breaker/domain windows, oldest first (appended at
    workflow time, expired from the front: `FleetGuard._prune`)."""
    breaker_tripped: bool = False
    breaker_reason: str | None = None
    breaker_tripped_at: datetime | None = None
    breaker_trips: int = 0
    paused: bool = False
    paused_by: str | None = None
    paused_at: datetime | None = None
    paused_note: str = ""
    infra: list[InfraIncident] = field(default_factory=list)
    node_domains: dict[str, list[str]] = field(default_factory=dict)
    """node → its failure domains, as the requests said (topology stays out of history)."""
    returns: dict[str, list[tuple[str, datetime]]] = field(default_factory=dict)
    """node → [(fault_class, time), …] of returns to service (lemon rule)."""
    log: list[str] = field(default_factory=list)
    grants: int = 0
    run: int = 1
    pool_published: str | None = None
    """What FleetGuard last wrote to the permit pool (budget, rack cap, open, why, closed domains), so it
    writes again only on a change."""
    pool_drop: list[str] = field(default_factory=list)
    """Nodes whose pool slot the guard still has to free (a queued request withdrawn after a grant
    could not be delivered, `breaker release`)."""
    pool_holders: int = 0
    """Slots held in the pool as of the guard's last write (every path's: the guard's grants and the
    router's drains)."""
    router_only: list[str] = field(default_factory=list)
    """The router's drains (pool holders) whose incidents have not asked the guard yet, as of the last
    pool write."""
    stranded: dict[str, str] = field(default_factory=dict)
    """node → why: pool holders whose incident is no longer running (terminated, reset). Still drained,
    so still counted, until `fleetmend breaker release NODE` returns the node to service."""
    analyzer_window_end: datetime | None = None
    """The analyzer window of the last `DomainReport` applied (an older one arriving late is ignored)."""


@dataclass
class PoolClaim:
    """One slot FleetGuard takes for a queued node it is about to grant (`PoolSync.claims`)."""

    node: str
    rack: str | None = None


@dataclass
class PoolSync:
    """`Activity.SYNC_PERMIT_POOL`: FleetGuard's write to its cluster's permit pool (`fleetmend.infra.permit_pool`),
    one compare-and-set: the pool's settings, the slots to free (`drop`), then the slots to take
    (`claims`, in the guard's queue order: severity, then age), each while the budget and its rack cap
    leave room."""

    cluster: str
    budget: int
    rack_cap: int
    open: bool
    why: str = ""
    closed_domains: list[str] = field(default_factory=list)
    held: dict[str, str | None] = field(default_factory=dict)
    """The guard's permit holders (node → rack), written as holders only when the pool is new."""
    drop: list[str] = field(default_factory=list)
    claims: list[PoolClaim] = field(default_factory=list)


@dataclass
class PoolSynced:
    holders: int
    router_only: list[str] = field(default_factory=list)
    """Nodes the router drained under a pool slot that the guard does not hold yet (their incidents
    have not asked; shown in the guard's status)."""
    granted: list[str] = field(default_factory=list)
    """Claims that hold their slot now (taken by this write, or held already)."""
    refused: dict[str, str] = field(default_factory=dict)
    """Claims without a slot → why (budget, rack cap): they stay queued."""


@dataclass
class PoolReconcile:
    """`Activity.RECONCILE_POOL`: check the pool's holders older than `grace_s` against the incidents."""

    cluster: str
    grace_s: float


@dataclass
class PoolReconciled:
    holders: int
    given: list[str] = field(default_factory=list)
    """Drained nodes whose incident had never started: one was started for each (it adopts the drain)."""
    stranded: dict[str, str] = field(default_factory=dict)
    """Drained nodes whose incident is closed (terminated, reset, ...) → why: still counted."""
    opened_waiting: list[str] = field(default_factory=list)
    """Nodes the router refused a slot whose incident never started (their fault dead-lettered while
    Temporal was away): one was started for each (it asks for its permit)."""


GUARD_MAX_HISTORY_EVENTS = 2_000
"""FleetGuard continues-as-new past this many events: a storm of 1k nodes is ~6 events per node."""


@dataclass
class CarriedMessage:
    """One message of FleetGuard's inbox carried across continue-as-new (`GuardInput.pending`): exactly one
    field is set."""
    request: PermitRequest | None = None
    release: PermitRelease | None = None
    report: DomainReport | None = None

    @classmethod
    def of(cls, msg: PermitRequest | PermitRelease | DomainReport) -> "CarriedMessage":
        if isinstance(msg, PermitRequest):
            return cls(request=msg)
        if isinstance(msg, PermitRelease):
            return cls(release=msg)
        return cls(report=msg)

    @property
    def message(self) -> PermitRequest | PermitRelease | DomainReport:
        msg = self.request or self.release or self.report
        if msg is None:
            raise ValueError("a carried guard message with no field set")
        return msg


@dataclass
class GuardInput:
    cluster: str
    policy: GuardPolicy = field(default_factory=GuardPolicy)
    carried: GuardState | None = None
    pending: list[CarriedMessage] = field(default_factory=list)
    """The inbox not yet decided when the previous run continued as new, in arrival order: a release after
    its node's request stays after it (were releases carried first, the request would queue again)."""
    pending_requests: list[PermitRequest] = field(default_factory=list)
    pending_releases: list[PermitRelease] = field(default_factory=list)
    """Before 0.2.0 the inbox was carried as these two lists (releases first), which lost the order and
    every `DomainReport`; still read, after `pending`, for a run an older worker continued."""
    max_history_events: int = GUARD_MAX_HISTORY_EVENTS
    """Continue-as-new threshold (tests lower it)."""


@dataclass
class GuardStatus:
    cluster: str
    budget: int
    known_nodes: int
    held: list[dict]
    queue: list[dict]
    breaker_tripped: bool
    breaker_reason: str | None
    breaker_tripped_at: str | None
    paused: bool
    paused_by: str | None
    observe_only: bool
    infra_incidents: list[dict]
    recent_nodes: int
    log: list[str]
    router_only: list[str] = field(default_factory=list)
    """Nodes the router drained under a permit pool slot whose incident has not asked the guard yet (as of
    the guard's last pool write)."""
    pool_holders: int = 0
    """Slots held in the permit pool (every drain under a permit, whichever stage took it), as of the
    guard's last pool write; `fleetmend breaker status` reads the pool itself."""
    stranded: dict[str, str] = field(default_factory=dict)
    """Drained nodes whose incident no longer runs (node → why): still counted against the budget."""
    paused_at: str | None = None
    paused_note: str = ""
