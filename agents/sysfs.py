"""`SysfsProbe`: InfiniBand ports, NIC links and PCIe links read from sysfs, polled and debounced.

Files read under `root` (every `poll_interval_s`; plain reads of a few bytes each):

    sys/class/infiniband/<hca>/ports/<n>/state       "4: ACTIVE"   (1 DOWN, 2 INIT, 3 ARMED, 4 ACTIVE, 5 ACTIVE_DEFER)
    sys/class/infiniband/<hca>/ports/<n>/phys_state  "5: LinkUp"   (2 Polling, 3 Disabled, ...)
    sys/class/infiniband/<hca>/ports/<n>/rate        "400 Gb/sec (4X NDR)"
    sys/class/net/<if>/{carrier,operstate,speed,flags,type}   physical interfaces only (`device` link)
    sys/bus/pci/devices/<bdf>/{vendor,class,current_link_width,max_link_width,
                               current_link_speed,max_link_speed}     "16", "32.0 GT/s PCIe"

Judgements (kinds.toml has severity, action and clearing of each):

- IB port DOWN → ib_port_down; INIT/ARMED → ib_port_init; ACTIVE clears (clearing kind
  ib_port_active); ACTIVE below `ib_expected_rate_gbps` (when configured) → ib_port_rate_degraded.
- NIC administratively up without carrier → nic_link_down, carrier back clears (nic_link_up);
  administratively down interfaces are the operator's choice and keep their state. InfiniBand
  netdevs (type 32) are left to the IB port check.
- PCIe (NVIDIA 0x10de display/3D controllers and NVSwitches, Mellanox 0x15b3 network controllers;
  SR-IOV VFs skipped): the expected width/speed is the lower of the device's maximum and its
  upstream port's maximum (a Gen5 GPU in a Gen4 slot is by design). Width below → pcie_link_degraded,
  always. Speed below → pcie_link_speed_degraded for NICs; for GPUs the speed is *not* judged here by
  default, because an idle NVIDIA GPU lowers its link speed on purpose (the NVML probe judges it
  while the GPU is busy); `gpu_link_speed_info=True` reports it as pcie_link_speed_low (info).

Unreadable files (EINVAL from `carrier` of a down interface, a device that vanished mid-read) give
UNKNOWN: the slot keeps its state. A restart loses only the debounce state (first unhealthy
readings are republished). Tests point `root` at recorded trees.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from agents.conditions import UNKNOWN, Conditions, Reading
from fleetmend import __version__
from fleetmend.catalog import Catalog
from fleetmend.events import Component, Device, FaultEvent, Severity, Source

Emit = Callable[[FaultEvent], Awaitable[None]]

VENDOR_NVIDIA, VENDOR_MELLANOX = 0x10DE, 0x15B3
IFF_UP = 0x1
ARPHRD_INFINIBAND = 32
_STATE = re.compile(r"^\s*(\d+)\s*:\s*(\S+)")
_RATE = re.compile(r"^\s*([\d.]+)\s*Gb/sec(?:\s*\((\d+)X\s*([A-Z0-9]*)\))?", re.I)
_SPEED = re.compile(r"^\s*([\d.]+)\s*GT/s", re.I)


def _read(p: Path) -> str | None:
    try:
        return p.read_text(errors="replace").strip()
    except OSError:
        return None


def parse_port_state(text: str | None) -> tuple[int, str] | None:
    """'4: ACTIVE' → (4, 'ACTIVE'); None for anything else."""
    m = _STATE.match(text or "")
    return (int(m.group(1)), m.group(2).upper()) if m else None


def parse_rate(text: str | None) -> tuple[float, int | None, str | None] | None:
    """'400 Gb/sec (4X NDR)' → (400.0, 4, 'NDR'); '10 Gb/sec (4X)' → (10.0, 4, None); None if unparsable."""
    m = _RATE.match(text or "")
    if not m:
        return None
    return float(m.group(1)), int(m.group(2)) if m.group(2) else None, (m.group(3) or None)


def parse_link_speed(text: str | None) -> float | None:
    """'16.0 GT/s PCIe' / '8 GT/s' → 16.0 / 8.0; 'Unknown' → None."""
    m = _SPEED.match(text or "")
    return float(m.group(1)) if m else None


def _int(text: str | None, base: int = 10) -> int | None:
    try:
        return int(text, base) if text is not None else None
    except ValueError:
        return None


GEN_BY_GTS = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}


class SysfsProbe:
    """sysfs probe (`name = "sysfs"`).

    Args:
        root: filesystem root the `sys/...` paths are read under (tests: a recorded tree).
        cluster, node, agent_version, catalog: stamped on events / clearing kinds.
        poll_interval_s: period (default 30 s; a node with 8 GPUs and 8 HCAs is ~150 small reads).
        ib_expected_rate_gbps: an ACTIVE IB port below this rate is degraded; None: not judged.
        nic_expected_speed_mbps: accepted for config symmetry; reported as an attribute only.
        gpu_link_speed_info: also report a GPU's lower PCIe speed as pcie_link_speed_low (info).
    """

    name = "sysfs"

    def __init__(self, root: Path = Path("/"), *, cluster: str = "local", node: str = "localhost",
                 agent_version: str = __version__, catalog: Catalog | None = None, poll_interval_s: float = 30.0,
                 ib_expected_rate_gbps: float | None = None, nic_expected_speed_mbps: int | None = None,
                 gpu_link_speed_info: bool = False) -> None:
        self.root = Path(root)
        self.poll_interval_s = poll_interval_s
        self.ib_expected_rate_gbps = ib_expected_rate_gbps
        self.nic_expected_speed_mbps = nic_expected_speed_mbps
        self.gpu_link_speed_info = gpu_link_speed_info
        self.conditions = Conditions(cluster, node, Source.SYSFS, agent_version, catalog)

    async def run(self, emit: Emit) -> None:
        """Poll until cancelled."""
        while True:
            for ev in await asyncio.to_thread(self.poll_once):
                await emit(ev)
            await asyncio.sleep(self.poll_interval_s)

    def poll_once(self) -> list[FaultEvent]:
        """Read everything once. Returns the events to publish (changes only)."""
        out: list[FaultEvent] = []
        for slot, reading in self.readings():
            out += self.conditions.observe(slot, reading)
        return out

    def readings(self) -> list[tuple[str, Any]]:
        return self._ib() + self._net() + self._pci()

    # ------------------------------------------------------------------ InfiniBand

    def _ib(self) -> list[tuple[str, Any]]:
        r: list[tuple[str, Any]] = []
        base = self.root / "sys" / "class" / "infiniband"
        for port_dir in sorted(base.glob("*/ports/*")):
            hca, port = port_dir.parts[-3], _int(port_dir.name)
            if port is None:
                continue
            bdf = None
            dev_link = base / hca / "device"
            if dev_link.exists():
                bdf = os.path.basename(os.path.realpath(dev_link)) or None
            dev = Device(name=hca, port=port, pci_bus_id=bdf if bdf and re.match(r"^[0-9a-f]{4}:", bdf) else None)
            state = parse_port_state(_read(port_dir / "state"))
            phys = parse_port_state(_read(port_dir / "phys_state"))
            rate_text = _read(port_dir / "rate")
            rate = parse_rate(rate_text)
            layer = _read(port_dir / "link_layer") or "InfiniBand"
            attrs = {"port_state": state[1] if state else None, "phys_state": phys[1] if phys else None,
                     "rate": rate_text, "link_layer": layer}
            where = f"{hca} port {port}"
            slot = f"ib@{hca}/{port}"
            if state is None:
                r.append((slot, UNKNOWN))
                continue
            name = state[1]
            if name == "DOWN":
                r.append((slot, Reading(kind="ib_port_down", component=Component.IB, severity=Severity.DEGRADED,
                                        device=dev, attrs=attrs, signature=(name, attrs["phys_state"]),
                                        message=f"{where} is DOWN (physical state {attrs['phys_state']}, "
                                                f"{layer})")))
            elif name in ("INIT", "ARMED"):
                r.append((slot, Reading(kind="ib_port_init", component=Component.IB, severity=Severity.INFO,
                                        device=dev, attrs=attrs, signature=(name,),
                                        message=f"{where} is {name} (link up, waiting for the subnet manager)")))
            elif name.startswith("ACTIVE"):
                exp = self.ib_expected_rate_gbps
                if exp is not None and rate is not None and rate[0] < exp:
                    r.append((slot, Reading(kind="ib_port_rate_degraded", component=Component.IB,
                                            severity=Severity.DEGRADED, device=dev, attrs=attrs,
                                            signature=(rate[0],),
                                            message=f"{where} active at {rate_text}, expected {exp:g} Gb/sec")))
                else:
                    r.append((slot, None))
            else:
                r.append((slot, UNKNOWN))
        return r

    # ------------------------------------------------------------------ Ethernet

    def _net(self) -> list[tuple[str, Any]]:
        r: list[tuple[str, Any]] = []
        base = self.root / "sys" / "class" / "net"
        for d in sorted(base.iterdir()) if base.is_dir() else []:
            if not (d / "device").exists():
                continue  # virtual: lo, veth, bridges, bonds (bond slaves are physical and checked)
            if _int(_read(d / "type")) == ARPHRD_INFINIBAND:
                continue
            slot = f"net@{d.name}"
            flags = _int(_read(d / "flags"), 16)
            if flags is None or not flags & IFF_UP:
                r.append((slot, UNKNOWN))  # administratively down: the operator's choice
                continue
            carrier = _read(d / "carrier")
            oper = _read(d / "operstate")
            speed = _int(_read(d / "speed"))
            bdf = os.path.basename(os.path.realpath(d / "device"))
            dev = Device(name=d.name, pci_bus_id=bdf if re.match(r"^[0-9a-f]{4}:", bdf) else None)
            attrs = {"operstate": oper, "speed_mbps": speed if speed and speed > 0 else None,
                     "expected_speed_mbps": self.nic_expected_speed_mbps}
            if carrier == "0" or (carrier is None and oper in ("down", "lowerlayerdown")):
                r.append((slot, Reading(kind="nic_link_down", component=Component.NIC, severity=Severity.DEGRADED,
                                        device=dev, attrs=attrs, signature=("down",),
                                        message=f"{d.name}: link down (no carrier, operstate {oper})")))
            elif carrier == "1":
                r.append((slot, None))
            else:
                r.append((slot, UNKNOWN))
        return r

    # ------------------------------------------------------------------ PCIe

    def _pci(self) -> list[tuple[str, Any]]:
        r: list[tuple[str, Any]] = []
        base = self.root / "sys" / "bus" / "pci" / "devices"
        for d in sorted(base.iterdir()) if base.is_dir() else []:
            vendor = _int(_read(d / "vendor"), 16)
            cls = _int(_read(d / "class"), 16)
            if vendor is None or cls is None:
                continue
            gpu = vendor == VENDOR_NVIDIA and (cls >> 16 == 0x03 or cls >> 8 == 0x0680)
            nic = vendor == VENDOR_MELLANOX and cls >> 16 == 0x02
            if not (gpu or nic) or (d / "physfn").exists():
                continue
            real = Path(os.path.realpath(d))
            up = real.parent
            cur_w, max_w = _int(_read(d / "current_link_width")), _int(_read(d / "max_link_width"))
            cur_s, max_s = parse_link_speed(_read(d / "current_link_speed")), parse_link_speed(_read(d / "max_link_speed"))
            up_w, up_s = _int(_read(up / "max_link_width")), parse_link_speed(_read(up / "max_link_speed"))
            exp_w = min(x for x in (max_w, up_w) if x) if (max_w or up_w) else None
            exp_s = min(x for x in (max_s, up_s) if x) if (max_s or up_s) else None
            bdf = d.name
            component = Component.PCIE
            what = "GPU" if gpu and cls >> 16 == 0x03 else ("NVSwitch" if gpu else "NIC")
            dev = Device(pci_bus_id=bdf)
            attrs = {"pcie_link_width": cur_w, "pcie_link_width_max": exp_w, "pcie_link_speed_gts": cur_s,
                     "pcie_link_speed_max_gts": exp_s, "pci_function": what}
            if not cur_w or not exp_w:
                r.append((f"pcie_width@{bdf}", UNKNOWN))  # width 0: link down, the device is reported elsewhere
            else:
                r.append((f"pcie_width@{bdf}", None if cur_w >= exp_w else Reading(
                    kind="pcie_link_degraded", component=component, severity=Severity.DEGRADED, device=dev,
                    attrs=attrs, signature=(cur_w, exp_w),
                    message=f"{what} {bdf}: PCIe link trained at x{cur_w} of x{exp_w}")))
            slot = f"pcie_speed@{bdf}"
            if cur_s is None or exp_s is None:
                r.append((slot, UNKNOWN))
            elif cur_s >= exp_s:
                r.append((slot, None))
            elif what == "NIC":
                r.append((slot, Reading(kind="pcie_link_speed_degraded", component=component, severity=Severity.DEGRADED,
                                        device=dev, attrs=attrs, signature=(cur_s, exp_s),
                                        message=f"NIC {bdf}: PCIe link at {cur_s:g} GT/s (Gen{GEN_BY_GTS.get(cur_s, '?')}) "
                                                f"of {exp_s:g} GT/s (Gen{GEN_BY_GTS.get(exp_s, '?')})")))
            elif self.gpu_link_speed_info:
                r.append((slot, Reading(kind="pcie_link_speed_low", component=component, severity=Severity.INFO,
                                        device=dev, attrs=attrs, signature=(cur_s, exp_s),
                                        message=f"{what} {bdf}: PCIe link at {cur_s:g} of {exp_s:g} GT/s "
                                                "(normal while idle)")))
            else:
                r.append((slot, UNKNOWN))
        return r
