"""The fail-slow analyzer: compares each node's telemetry with its peers (the hardware's own metrics
across its hardware class, work-dependent metrics among the nodes of its own job, a rank's step
time against its job's other ranks at its own offset) and turns a persistent outlier into a
`fail_slow` FaultEvent (see `core` for the rule, `metrics` for what is judged and which kind each
metric is, `service` for the process: lease, state, NATS)."""

from fleetmend.analyzer.core import Comparator, Finding, WindowResult, finding_event

__all__ = ["Comparator", "Finding", "WindowResult", "finding_event"]
