"""`UdevProbe`: a GPU, NIC or NVMe device removed or re-added, from device uevents (pyudev).

Source of the uevents (`source`):
    "udev"    the udevd rebroadcast (after its rules ran); needs a running udevd (/run/udev/control).
    "kernel"  the kernel's own uevents on the NETLINK_KOBJECT_UEVENT socket (needs root/CAP_NET_ADMIN
              in the host network namespace; containers and hosts without udevd).
    "auto"    (default) "udev" where /run/udev/control exists, else "kernel".

Subsystems `pci` and `net`. Judgement per uevent:
    pci remove, vendor 0x10de, class 0x03xxxx (display/3D)   → gpu_removed (fatal)
    pci remove, class 0x0108xx (NVMe)                         → nvme_removed (fatal)
    pci remove, class 0x02xxxx (network, e.g. ConnectX)       → nic_removed (degraded)
    net remove of a physical netdev (DEVPATH not under /devices/virtual/, or any netdev with
        `include_virtual_net=True`)                           → nic_removed (degraded)
    the matching add                                          → the clearing event (same kind and device,
                                                                healthy=true, clearing kind device_added)
An add of a device whose removal this probe did not see publishes nothing (boot, hotplug of new
hardware). Other actions (bind, unbind, change, move) are ignored.

`open_monitor(source, subsystems)` is also what the fingerprint reader listens on (`DEVICE_SUBSYSTEMS`: a
fresh fingerprint on every add/remove, agents/inventory/probe.py).

What a restart loses: uevents are not replayed, so a removal while the agent was down is not seen
here (the NVML probe's GPU count and the sysfs probe's links still see the result), and an add
after a restart does not clear a removal published before it (the fault clears by repair: the
diagnostics that return the node to service see the device).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog

from agents.conditions import Conditions, Reading
from agents.kmsg.matchers import normalize_bdf
from fleetmend import __version__
from fleetmend.catalog import Catalog
from fleetmend.events import Component, Device, FaultEvent, Severity, Source

Emit = Callable[[FaultEvent], Awaitable[None]]
UDEV_CONTROL = Path("/run/udev/control")
SOURCES = ("auto", "udev", "kernel")


DEVICE_SUBSYSTEMS = ("pci", "net", "infiniband", "nvme")
"""What a fresh fingerprint follows (agents.inventory.probe): the devices whose add or remove changes the node's
shape (PCI functions, netdevs, RDMA devices, NVMe controllers)."""


def default_source(control: Path = UDEV_CONTROL) -> str:
    """'udev' where udevd runs (its control socket exists), else 'kernel'."""
    return "udev" if control.exists() else "kernel"


def open_monitor(source: str, subsystems: tuple[str, ...], context: Any = None) -> Any:
    """A started `pyudev.Monitor` on `source` ("auto", "udev" or "kernel") filtered to `subsystems`.

    Raises:
        ValueError: unknown source; ImportError: no pyudev/libudev; OSError: the netlink socket cannot be
        opened (no CAP_NET_ADMIN, or not in the host's network namespace).
    """
    if source not in SOURCES:
        raise ValueError(f"unknown udev source {source!r}; expected {', '.join(SOURCES)}")
    import pyudev  # lazy: a host without libudev loses the uevents only

    ctx = context or pyudev.Context()
    mon = pyudev.Monitor.from_netlink(ctx, source=default_source() if source == "auto" else source)
    for sub in subsystems:
        mon.filter_by(sub)
    mon.start()
    return mon


def classify_uevent(action: str, subsystem: str, props: dict[str, str], include_virtual_net: bool = False
                    ) -> tuple[str, Component, Severity, Device, str] | None:
    """Which removable device a uevent is about.

    Args:
        action: 'add', 'remove', ...; subsystem: 'pci' or 'net'; props: the uevent's properties
            (PCI_CLASS '30200', PCI_ID '10DE:2330', PCI_SLOT_NAME '0000:3b:00.0', INTERFACE, DEVPATH).
    Returns:
        (kind, component, severity, device, description) for a device we track, else None.
    """
    if subsystem == "pci":
        try:
            cls = int(props.get("PCI_CLASS", ""), 16)
        except ValueError:
            return None
        vendor = props.get("PCI_ID", "").split(":")[0].upper()
        bdf = normalize_bdf(props.get("PCI_SLOT_NAME") or os.path.basename(props.get("DEVPATH", "")))
        dev = Device(pci_bus_id=bdf)
        if vendor == "10DE" and cls >> 16 == 0x03:
            return "gpu_removed", Component.GPU, Severity.FATAL, dev, f"GPU {bdf}"
        if cls >> 8 == 0x0108:
            return "nvme_removed", Component.NVME, Severity.FATAL, dev, f"NVMe controller {bdf}"
        if cls >> 16 == 0x02:
            return "nic_removed", Component.NIC, Severity.DEGRADED, dev, f"network controller {bdf}"
        return None
    if subsystem == "net":
        name = props.get("INTERFACE") or os.path.basename(props.get("DEVPATH", ""))
        devpath = props.get("DEVPATH", "")
        if not name or name == "lo":
            return None
        if "/devices/virtual/" in devpath and not include_virtual_net:
            return None
        return "nic_removed", Component.NIC, Severity.DEGRADED, Device(name=name), f"network interface {name}"
    return None


class UdevProbe:
    """udev probe (`name = "udev"`).

    Args:
        source: "auto", "udev" or "kernel" (module docstring).
        subsystems: uevent subsystems to watch (default pci and net).
        include_virtual_net: also track virtual netdevs (veth, bridges); tests use it.
        context: a `pyudev.Context` (default a new one).
        cluster, node, agent_version, catalog: stamped on events.
    Raises (from `run`):
        ValueError for an unknown source; OSError when the netlink socket cannot be opened (no
        permission): the runner reports the probe failed and retries with backoff.
    """

    name = "udev"

    def __init__(self, source: str = "auto", *, subsystems: tuple[str, ...] = ("pci", "net"),
                 include_virtual_net: bool = False, context: Any = None, cluster: str = "local",
                 node: str = "localhost", agent_version: str = __version__, catalog: Catalog | None = None) -> None:
        if source not in SOURCES:
            raise ValueError(f"unknown udev source {source!r}; expected {', '.join(SOURCES)}")
        self.source = default_source() if source == "auto" else source
        self.subsystems = subsystems
        self.include_virtual_net = include_virtual_net
        self.context = context
        self.conditions = Conditions(cluster, node, Source.UDEV, agent_version, catalog)
        self.started = asyncio.Event()
        self._log = structlog.get_logger("fleetmend.agent.udev").bind(cluster=cluster, node=node)

    def monitor(self) -> Any:
        return open_monitor(self.source, self.subsystems, self.context)

    def handle(self, action: str, subsystem: str, props: dict[str, str]) -> list[FaultEvent]:
        """One uevent → the events to publish (a removal, or the clearing of one)."""
        if action not in ("add", "remove"):
            return []
        c = classify_uevent(action, subsystem, props, self.include_virtual_net)
        if c is None:
            return []
        kind, component, severity, dev, what = c
        slot = f"{kind}@{dev.pci_bus_id or dev.name}"
        raw = "\n".join(f"{k}={v}" for k, v in sorted(props.items()))
        if action == "remove":
            return self.conditions.observe(slot, Reading(
                kind=kind, component=component, severity=severity, device=dev, raw=raw,
                attrs={"subsystem": subsystem, "uevent_source": self.source, "devpath": props.get("DEVPATH")},
                message=f"{what} removed ({subsystem} uevent from {self.source})"))
        return self.conditions.observe(slot, None, clear_message=f"{what} added again ({subsystem} uevent)")

    async def run(self, emit: Emit) -> None:
        """Watch uevents until cancelled."""
        mon = await asyncio.to_thread(self.monitor)
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        fd = mon.fileno()
        loop.add_reader(fd, ready.set)
        self._log.info("udev_watching", source=self.source, subsystems=list(self.subsystems))
        self.started.set()
        try:
            while True:
                await ready.wait()
                ready.clear()
                while (device := mon.poll(timeout=0)) is not None:
                    props = {k: str(device.properties[k]) for k in device.properties}
                    for ev in self.handle(device.action or "", device.subsystem or "", props):
                        await emit(ev)
        finally:
            loop.remove_reader(fd)
