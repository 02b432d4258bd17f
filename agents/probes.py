"""The probe protocol and the explicit registry of probes.

A probe watches one source of hardware truth and calls `emit(event)` for every `FaultEvent` it
builds. Probes never see NATS: `emit` is `Publisher.emit`, which queues (with backpressure) and
publishes or spools. Hardware enters through constructor arguments (`KmsgProbe(source=Path)`),
so tests feed recorded corpus files through the same code as production.

`run` returns when a finite source is exhausted (`--kmsg-file` replay, `--once`); a following
probe runs until cancelled. An exception out of `run` is the probe failing: the runner reports it
in the heartbeat and restarts the probe with a backoff (see `agents.runner`).
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import orjson

from fleetmend import __version__
from fleetmend.config import Settings
from fleetmend.events import FaultEvent, Source

Emit = Callable[[FaultEvent], Awaitable[Any]]
"""`await emit(event)`; the agent's returns a future settled once the event is published or spooled."""


@runtime_checkable
class Probe(Protocol):
    """One source of faults. `name` is stable (heartbeat key, log field)."""

    name: str

    async def run(self, emit: Emit) -> None:
        """Observe and call `await emit(event)` per event; return when the source is exhausted."""
        ...


class InjectProbe:
    """Replays a JSON-lines file of `FaultEvent` objects (drills, tests, `fleetmend inject`).

    Each line is one event's JSON; `cluster`/`node`/`agent_version` are forced to this agent's
    (an agent publishes only on its own subject), `source` defaults to `inject`, and an
    `event_id` in the file is kept (so a drill replayed twice is deduplicated by JetStream).
    Raises `pydantic.ValidationError` naming the line for an invalid event.
    """

    name = "inject"

    def __init__(self, source: Path, cluster: str, node: str, agent_version: str = __version__) -> None:
        self.source = Path(source)
        self.cluster, self.node, self.agent_version = cluster, node, agent_version

    async def run(self, emit: Emit) -> None:
        text = await asyncio.to_thread(self.source.read_bytes)
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                data = orjson.loads(line)
            except orjson.JSONDecodeError as err:
                raise ValueError(f"{self.source} line {lineno}: not JSON ({err})") from err
            data.setdefault("source", Source.INJECT.value)
            data.update(cluster=self.cluster, node=self.node, agent_version=self.agent_version)
            await emit(FaultEvent.model_validate(data))


class UnavailableProbe:
    """Stands in for a probe whose module could not be imported; fails with the reason."""

    def __init__(self, name: str, reason: str) -> None:
        self.name, self.reason = name, reason

    async def run(self, emit: Emit) -> None:
        raise RuntimeError(self.reason)


PROBES: dict[str, str] = {
    "kmsg": "agents.kmsg:KmsgProbe",
    "nvml": "agents.nvml:NvmlProbe",
    "sysfs": "agents.sysfs:SysfsProbe",
    "udev": "agents.udev:UdevProbe",
    "inject": "agents.probes:InjectProbe",
    "lastboot": "agents.lastboot:LastBootProbe",
}
"""Probe name → `module:Class`, imported lazily so one missing optional module (or a probe whose
hardware library is absent) cannot stop the others."""


def probe_class(name: str) -> type:
    """Import the class registered as `name`. Raises KeyError listing the known probes, ImportError."""
    try:
        target = PROBES[name]
    except KeyError as err:
        raise KeyError(f"unknown probe {name!r}; expected {', '.join(sorted(PROBES))}") from err
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


HARDWARE_PROBES = ("nvml", "sysfs", "udev", "lastboot")
"""Probes of live hardware state; left out when the agent replays a file or runs `--once`."""


def _hardware_probe(name: str, settings: Settings, catalog: Any, agent_state_dir: Path | None) -> Any:
    a = settings.agent
    common = dict(cluster=settings.cluster, node=settings.node, agent_version=__version__, catalog=catalog)
    cls = probe_class(name)
    if name == "lastboot":
        state = agent_state_dir or settings.state_dir / "agent" / settings.node
        return cls(a.host_root, state, journal="default" if a.lastboot_journal else None, **common)
    if name == "nvml":
        return cls("default", poll_interval_s=a.nvml_poll_interval_s, retry_interval_s=a.nvml_retry_interval_s,
                   xid_events=a.nvml_xid_events, xid_wait_ms=a.nvml_xid_wait_ms,
                   pcie_gen_min_util_pct=a.pcie_gen_min_util_pct, temperature_max_c=a.gpu_temperature_max_c,
                   nvlink_error_step=a.nvlink_error_step, **common)
    if name == "sysfs":
        return cls(a.sysfs_root, poll_interval_s=a.sysfs_poll_interval_s,
                   ib_expected_rate_gbps=a.ib_expected_rate_gbps, **common)
    return cls(a.udev_source, include_virtual_net=a.udev_include_virtual_net, **common)


def build_probes(settings: Settings, kmsg_file: Path | None = None, state_dir: Path | None = None,
                 inject_file: Path | None = None, kmsg: bool = True, hardware: bool = True,
                 agent_state_dir: Path | None = None) -> list[Any]:
    """The probes this agent runs.

    Args:
        settings: cluster, node and `agent.kmsg_path`.
        kmsg_file: replay this captured kernel log once (follow=False, no cursor) instead of
            following `settings.agent.kmsg_path`.
        state_dir: where the kmsg probe keeps its cursor (live mode only).
        inject_file: also replay this JSON-lines file of events (`InjectProbe`).
        kmsg: False leaves the kmsg probe out (e.g. a drill that only injects).
        hardware: add the nvml, sysfs, udev and lastboot probes that `settings.agent.*_enabled` turn on.
        agent_state_dir: the agent's state directory (lastboot keeps what it published there);
            default `<state_dir>/agent/<node>`.
    Raises:
        fleetmend.errors.CatalogError: `settings.catalog_overrides` is invalid (fail at startup).
    Returns:
        Probes, each satisfying `Probe`. A probe whose module cannot be imported becomes an
        `UnavailableProbe`, which fails on start and shows as failed in the heartbeat.
    """
    probes: list[Any] = []
    catalog = None
    if settings.catalog_overrides is not None:
        from fleetmend.catalog import load_catalog

        catalog = load_catalog(settings.catalog_overrides)
    if kmsg:
        try:
            kmsg_cls = probe_class("kmsg")
            from agents.kmsg import KmsgParser

            parser = KmsgParser(settings.cluster, settings.node, __version__, catalog=catalog)
            if kmsg_file is not None:
                probes.append(kmsg_cls(source=kmsg_file, parser=parser, follow=False, state_dir=None))
            else:
                probes.append(kmsg_cls(source=settings.agent.kmsg_path, parser=parser, follow=True,
                                       state_dir=state_dir))
        except ImportError as err:
            probes.append(UnavailableProbe("kmsg", f"kmsg probe unavailable: {err}"))
    if hardware:
        for name in HARDWARE_PROBES:
            if not getattr(settings.agent, f"{name}_enabled"):
                continue
            try:
                probes.append(_hardware_probe(name, settings, catalog, agent_state_dir))
            except ImportError as err:
                probes.append(UnavailableProbe(name, f"{name} probe unavailable: {err}"))
    if inject_file is not None:
        probes.append(InjectProbe(inject_file, settings.cluster, settings.node))
    return probes
