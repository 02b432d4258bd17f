"""Debounced conditions for the polling probes (nvml, sysfs): publish a state once, clear it once.

A polling probe reads the same hardware every period. What reaches NATS is the *change*:

- a slot (one condition of one device, e.g. "remapped rows of GPU 0000:3b:00.0") that turns
  unhealthy emits its fault event once; the same reading on later polls emits nothing;
- a different unhealthy reading in the same slot (a counter stepped, pending → failure) emits again;
  when the kind changes, the old kind is cleared first (so every published kind is closed);
- a slot that returns to healthy emits one clearing event: the same component, kind and device
  (same `fault_key`) with `healthy=True`, severity info and `attrs["clearing_kind"]` naming the
  clearing kind from the catalog (`cleared_by`), as the kmsg parser does;
- `UNKNOWN` (the value could not be read this time, or must not be judged now, e.g. an idle GPU's
  PCIe generation) keeps the slot's state and emits nothing;
- a slot that is healthy on first sight emits nothing (there is nothing to clear).

State lives in memory: after an agent restart the first unhealthy reading is published again
(at-least-once; the router coalesces by `fault_key`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

from fleetmend import __version__
from fleetmend.catalog import Catalog, default_catalog
from fleetmend.events import Component, Device, FaultEvent, Severity, Source


class _Unknown:
    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN: Final = _Unknown()
"""Reading of a slot that could not (or must not) be judged this poll: keep the previous state."""


@dataclass(frozen=True)
class Reading:
    """One unhealthy reading of a slot.

    `signature` decides "same reading": by default (kind, severity, message). Put only discrete
    values in it (a counter value, a state word), never a drifting one (a temperature), or every
    poll republishes.
    """

    kind: str
    component: Component
    severity: Severity
    message: str
    device: Device = field(default_factory=Device)
    code: int | None = None
    attrs: dict[str, Any] = field(default_factory=dict)
    raw: str = ""
    signature: tuple[Any, ...] | None = None

    def key(self) -> tuple[Any, ...]:
        return (self.kind, self.severity, self.code) + (self.signature if self.signature is not None
                                                        else (self.message,))


class Conditions:
    """Per-slot debouncing. One instance per probe.

    Args:
        cluster, node, agent_version: stamped on the events.
        source: the probe's `Source`.
        catalog: looks up the clearing kind (`cleared_by`) of a kind; default the packaged catalog.
    """

    def __init__(self, cluster: str, node: str, source: Source, agent_version: str = __version__,
                 catalog: Catalog | None = None) -> None:
        self.cluster, self.node, self.source, self.agent_version = cluster, node, source, agent_version
        self.catalog = catalog or default_catalog()
        self._last: dict[str, Reading] = {}

    def event(self, r: Reading, healthy: bool = False, message: str | None = None) -> FaultEvent:
        """A `FaultEvent` for reading `r` (or, with `healthy`, its clearing event)."""
        attrs = {k: v for k, v in r.attrs.items() if isinstance(v, (str, int, float, bool)) or v is None}
        if healthy:
            entry = self.catalog.kinds.get(r.kind)
            cleared_by = entry.cleared_by if entry is not None else ""
            attrs["clearing_kind"] = None if cleared_by.startswith("none:") or not cleared_by else cleared_by
        return self.catalog.stamp(FaultEvent(
            cluster=self.cluster, node=self.node, component=r.component, device=r.device, kind=r.kind, code=r.code,
            severity=Severity.INFO if healthy else r.severity, healthy=healthy, message=message or r.message,
            source=self.source, raw=r.raw or message or r.message, agent_version=self.agent_version, attrs=attrs))

    def observe(self, slot: str, reading: Reading | None | _Unknown, clear_message: str = "") -> list[FaultEvent]:
        """Record this poll's reading of `slot`; return the events to publish (0, 1 or 2).

        Args:
            slot: stable identity of the condition, e.g. "remap@0000:3b:00.0".
            reading: a `Reading` (unhealthy), None (healthy) or `UNKNOWN` (keep state).
            clear_message: message of the clearing event (default "cleared: <old message>").
        """
        if reading is UNKNOWN:
            return []
        last = self._last.get(slot)
        out: list[FaultEvent] = []
        if reading is None:
            if last is not None:
                del self._last[slot]
                out.append(self.event(last, healthy=True, message=clear_message or f"cleared: {last.message}"))
            return out
        assert isinstance(reading, Reading)
        if last is not None and last.key() == reading.key():
            return out
        if last is not None and last.kind != reading.kind:
            out.append(self.event(last, healthy=True, message=f"cleared: {last.message} (now {reading.kind})"))
        self._last[slot] = reading
        out.append(self.event(reading))
        return out

    def active(self) -> dict[str, Reading]:
        """Slots currently unhealthy (a copy)."""
        return dict(self._last)
