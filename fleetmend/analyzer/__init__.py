"""The fail-slow analyzer: compares each node's telemetry with its peers of the same hardware class
and turns a persistent outlier into a `fail_slow` FaultEvent (see `core` for the rule, `metrics` for
what is judged, `service` for the process: lease, state, NATS)."""

from fleetmend.analyzer.core import Comparator, Finding, WindowResult, finding_event

__all__ = ["Comparator", "Finding", "WindowResult", "finding_event"]
