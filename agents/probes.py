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
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Protocol, TypeVar, runtime_checkable

from agents.perf import PerfSampler
from fleetmend import __version__
from fleetmend.catalog import Catalog, load_catalog
from fleetmend.config import (
    AgentSettings,
    LastbootProbeSettings,
    NvmlProbeSettings,
    Settings,
    SysfsProbeSettings,
    UdevProbeSettings,
)
from fleetmend.events import FaultEvent, Source

Emit = Callable[[FaultEvent], Awaitable[object]]
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
                data = json.loads(line)
            except ValueError as err:  # json.JSONDecodeError, or bytes that are not UTF-8
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
    "inventory": "agents.inventory.probe:InventoryProbe",
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


@dataclass(frozen=True)
class ProbeContext:
    """What every probe builder gets besides its own settings section."""

    cluster: str
    node: str
    catalog: Catalog | None
    agent_state_dir: Path
    """`<state_dir>/agent/<node>`: lastboot keeps what it published here."""
    host_root: Path
    """The host's `/` as the agent sees it (`agent.host_root`)."""


def _nvml(cfg: NvmlProbeSettings, ctx: ProbeContext) -> Probe:
    cls = probe_class("nvml")
    return cls("default", cluster=ctx.cluster, node=ctx.node, agent_version=__version__, catalog=ctx.catalog,
               poll_interval_s=cfg.poll_interval_s, retry_interval_s=cfg.retry_interval_s,
               xid_events=cfg.xid_events, xid_wait_ms=cfg.xid_wait_ms,
               pcie_gen_min_util_pct=cfg.pcie_gen_min_util_pct, temperature_max_c=cfg.temperature_max_c,
               nvlink_error_step=cfg.nvlink_error_step, host_root=ctx.host_root)


def nvml_applies(settings: Settings) -> bool:
    """NVML is worth loading here: `agent.nvml.enabled`, and NVIDIA GPUs on the PCI bus under `agent.host_root`
    (or the bus unreadable). False on a CPU node or a dev box: the inventory and the perf sampler then run
    without NVML, and the NVML probe says it does not apply."""
    from agents.nvml import nvidia_gpus_on_bus  # lazy, like the probe modules

    return settings.agent.nvml.enabled and nvidia_gpus_on_bus(settings.agent.host_root) != 0


def _sysfs(cfg: SysfsProbeSettings, ctx: ProbeContext) -> Probe:
    cls = probe_class("sysfs")
    return cls(cfg.root, cluster=ctx.cluster, node=ctx.node, agent_version=__version__, catalog=ctx.catalog,
               poll_interval_s=cfg.poll_interval_s, ib_expected_rate_gbps=cfg.ib_expected_rate_gbps)


def _udev(cfg: UdevProbeSettings, ctx: ProbeContext) -> Probe:
    cls = probe_class("udev")
    return cls(cfg.source, include_virtual_net=cfg.include_virtual_net, cluster=ctx.cluster, node=ctx.node,
               agent_version=__version__, catalog=ctx.catalog)


def _inventory(settings: Settings, ctx: ProbeContext) -> Probe:
    """The fingerprint reader/publisher (agents/inventory): `agent.host_root`, `agent.inventory_interval_s`,
    `policy.reconfigure` (live fixes, dry run by default); NVML only when `agent.nvml.enabled`; uevents from
    `agent.udev.source` when `agent.udev.enabled` (else the device poll alone)."""
    cls = probe_class("inventory")
    nvml: object = None
    if nvml_applies(settings):
        try:
            import pynvml  # lazy: the agent runs without it on GPU-less nodes

            nvml = pynvml
        except ImportError:
            nvml = None
    return cls(ctx.host_root, ctx.cluster, ctx.node, interval_s=settings.agent.inventory_interval_s,
               reconfigure=settings.policy.reconfigure, nvml=nvml, agent_version=__version__,
               udev_source=settings.agent.udev.source if settings.agent.udev.enabled else None,
               create_stores=not (settings.nats_user or settings.nats_nkey_seed or settings.nats_creds))


def _lastboot(cfg: LastbootProbeSettings, ctx: ProbeContext) -> Probe:
    cls = probe_class("lastboot")
    return cls(ctx.host_root, ctx.agent_state_dir, cluster=ctx.cluster, node=ctx.node, agent_version=__version__,
               catalog=ctx.catalog, journal="default" if cfg.journal else None)


class _Toggle(Protocol):
    enabled: bool


S = TypeVar("S", bound=_Toggle)


class ProbeFactory(Protocol):
    """Builds one probe kind from `AgentSettings`, or None when its section turns it off."""

    def __call__(self, agent: AgentSettings, ctx: ProbeContext) -> Probe | None: ...


@dataclass(frozen=True)
class HardwareProbeSpec(Generic[S]):
    """One hardware probe kind: its own section of `AgentSettings` (with an `enabled` flag) and the
    builder that reads only that section."""

    section: Callable[[AgentSettings], S]
    build: Callable[[S, ProbeContext], Probe]

    def __call__(self, agent: AgentSettings, ctx: ProbeContext) -> Probe | None:
        cfg = self.section(agent)
        return self.build(cfg, ctx) if cfg.enabled else None


HARDWARE_REGISTRY: dict[str, ProbeFactory] = {
    "nvml": HardwareProbeSpec(lambda a: a.nvml, _nvml),
    "sysfs": HardwareProbeSpec(lambda a: a.sysfs, _sysfs),
    "udev": HardwareProbeSpec(lambda a: a.udev, _udev),
    "lastboot": HardwareProbeSpec(lambda a: a.lastboot, _lastboot),
}
"""Hardware probe name (`agent.<name>` is its settings section) → its factory, in start order."""

HARDWARE_PROBES = tuple(HARDWARE_REGISTRY)
"""Probes of live hardware state; left out when the agent replays a file or runs `--once`."""


def build_probes(settings: Settings, kmsg_file: Path | None = None, state_dir: Path | None = None,
                 inject_file: Path | None = None, kmsg: bool = True, hardware: bool = True,
                 agent_state_dir: Path | None = None) -> list[Probe]:
    """The probes this agent runs, each built from its own section of `settings.agent`.

    Args:
        settings: cluster, node, `catalog_overrides` and the probe sections `agent.kmsg`,
            `agent.nvml`, `agent.sysfs`, `agent.udev`, `agent.lastboot`.
        kmsg_file: replay this captured kernel log once (follow=False, no cursor) instead of
            following `settings.agent.kmsg.path`.
        state_dir: where the kmsg probe keeps its cursor (live mode only).
        inject_file: also replay this JSON-lines file of events (`InjectProbe`).
        kmsg: False leaves the kmsg probe out (e.g. a drill that only injects).
        hardware: add the hardware probes (`HARDWARE_PROBES`) whose `agent.<name>.enabled` is true.
        agent_state_dir: the agent's state directory (lastboot keeps what it published there);
            default `<state_dir>/agent/<node>`.
    Raises:
        fleetmend.errors.CatalogError: `settings.catalog_overrides` is invalid (fail at startup).
    Returns:
        Probes, each satisfying `Probe`. A probe whose module cannot be imported becomes an
        `UnavailableProbe`, which fails on start and shows as failed in the heartbeat.
    """
    probes: list[Probe] = []
    catalog: Catalog | None = None
    if settings.catalog_overrides is not None:
        catalog = load_catalog(settings.catalog_overrides)
    if kmsg:
        try:
            kmsg_cls = probe_class("kmsg")
            from agents.kmsg import KmsgParser  # lazy, like the probe: a missing matcher library stops kmsg only

            parser = KmsgParser(settings.cluster, settings.node, __version__, catalog=catalog)
            if kmsg_file is not None:
                probes.append(kmsg_cls(source=kmsg_file, parser=parser, follow=False, state_dir=None))
            else:
                probes.append(kmsg_cls(source=settings.agent.kmsg.path, parser=parser, follow=True,
                                       state_dir=state_dir))
        except ImportError as err:
            probes.append(UnavailableProbe("kmsg", f"kmsg probe unavailable: {err}"))
    if hardware:
        ctx = ProbeContext(settings.cluster, settings.node, catalog,
                           agent_state_dir or settings.state_dir / "agent" / settings.node, settings.agent.host_root)
        for name, factory in HARDWARE_REGISTRY.items():
            try:
                probe = factory(settings.agent, ctx)
            except ImportError as err:
                probe = UnavailableProbe(name, f"{name} probe unavailable: {err}")
            if probe is not None:
                probes.append(probe)
        if settings.agent.inventory_enabled:
            try:
                probes.append(_inventory(settings, ctx))
            except ImportError as err:
                probes.append(UnavailableProbe("inventory", f"inventory probe unavailable: {err}"))
    if inject_file is not None:
        probes.append(InjectProbe(inject_file, settings.cluster, settings.node))
    return probes


def build_perf_sampler(settings: Settings, nvml: object = "default") -> PerfSampler | None:
    """The perf sampler from `agent.perf` (interval) and `agent.sysfs.root`; None when `agent.perf.enabled`
    is false. `nvml` is the `pynvml` module or a stand-in ("default": import it); it is not used when
    `agent.nvml.enabled` is false or no NVIDIA GPU is on the bus (`nvml_applies`). Raises ValueError for a
    non-positive interval."""
    a = settings.agent
    if not a.perf.enabled:
        return None
    return PerfSampler(nvml if nvml_applies(settings) else None, a.sysfs.root, cluster=settings.cluster,
                       node=settings.node, interval_s=a.perf.interval_s)
