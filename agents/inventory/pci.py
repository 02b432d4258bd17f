"""PCI facts from sysfs: device class, ancestry, the `nvidia-smi topo -m` level between two devices, and the
config-space registers that matter (ACS control, PCIe Device Control).

Formats (Linux Documentation/ABI/testing/sysfs-bus-pci and the PCI Express Base Specification r5.0):
    /sys/bus/pci/devices/<bdf>        symlink to ../../../devices/pci<dom>:<bus>/<root port>/.../<bdf>
    <dev>/class, vendor, device       "0x030200", "0x10de", "0x2330"
    <dev>/numa_node                   "-1" (unknown) or the node number
    <dev>/current_link_speed          "32.0 GT/s PCIe"; current_link_width "16"; max_link_* the same
    <dev>/config                      the configuration space (256 B legacy, 4096 B extended; a non-root
                                      reader sees only the first 64 B, so the agent runs as root)
    capability list                   pointer at 0x34; each entry: id (byte), next (byte); PCIe cap id 0x10,
                                      its Device Control at +8: MaxPayload bits 7:5, MaxReadReq bits 14:12,
                                      each 128 << value bytes
    extended capabilities             from 0x100: dword id 15:0, version 19:16, next 31:20; ACS id 0x000D,
                                      ACS Control at +6: bit 0 Source Validation (lspci "ACSCtl: SrcValid+")
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from fleetmend.fingerprint import TopoLevel

_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
PCI_CAP_EXP = 0x10
PCI_EXT_CAP_ACS = 0x000D
ACS_CTRL_SRC_VALID = 0x0001


@dataclass
class PciDevice:
    """One PCI function as sysfs shows it. `chain` is the list of bridge BDFs from the root port down to (not
    including) the device; `host_bridge` is `pci0000:15`."""

    bdf: str
    path: Path
    pci_class: int
    vendor: int
    device: int
    host_bridge: str
    chain: list[str] = field(default_factory=list)
    numa_node: int | None = None

    @property
    def is_gpu(self) -> bool:
        return self.vendor == 0x10DE and (self.pci_class >> 16) == 0x03

    @property
    def is_nic(self) -> bool:
        return (self.pci_class >> 16) == 0x02

    @property
    def is_nvme(self) -> bool:
        return (self.pci_class >> 8) == 0x0108

    @property
    def is_nvswitch(self) -> bool:
        """An NVSwitch: vendor 0x10de, class 0x068000 ("Bridge: other"), as NVIDIA's go-nvlib tells them apart
        (pkg/nvpci/nvpci.go `PCINvSwitchClass`; NCCL's src/transport/nvlink reads the same class file)."""
        return self.vendor == 0x10DE and self.pci_class == 0x068000

    @property
    def is_bridge(self) -> bool:
        return (self.pci_class >> 8) == 0x0604


def read_text(path: Path) -> str | None:
    """The stripped text of `path`, or None when it does not exist or cannot be read (not applicable)."""
    try:
        with open(path, "rb") as f:
            return f.read(65536).decode(errors="replace").strip()
    except OSError:
        return None


def _int(text: str | None, base: int = 0) -> int | None:
    if text is None:
        return None
    try:
        return int(text, base)
    except ValueError:
        return None


def scan(root: Path) -> dict[str, PciDevice]:
    """Every PCI function under `root/sys/bus/pci/devices`, keyed by BDF; {} where there is no PCI bus."""
    base = root / "sys/bus/pci/devices"
    try:
        names = os.listdir(base)
    except OSError:
        return {}
    out: dict[str, PciDevice] = {}
    for bdf in names:
        if not _BDF.match(bdf):
            continue
        link = base / bdf
        try:
            real = Path(os.path.realpath(link))
        except OSError:
            continue
        parts = real.parts
        host = next((p for p in parts if p.startswith("pci") and ":" in p), "")
        chain = [p for p in parts[parts.index(host) + 1:-1] if _BDF.match(p)] if host else []
        cls = _int(read_text(link / "class"), 16) or 0
        numa = _int(read_text(link / "numa_node"))
        out[bdf] = PciDevice(bdf, link, cls, _int(read_text(link / "vendor"), 16) or 0,
                             _int(read_text(link / "device"), 16) or 0, host, chain,
                             None if numa is None or numa < 0 else numa)
    return out


def topo_level(a: PciDevice, b: PciDevice) -> TopoLevel:
    """The `nvidia-smi topo -m` level between `a` and `b` from their sysfs ancestry.

    PIX: their nearest common bridge sits below the root port and each hangs at most one bridge below it (both
    under one PCIe switch); PXB: a common bridge, more bridges between; PHB: only the host bridge in common;
    NODE: different host bridges, same NUMA node; SYS: different (or unknown) NUMA nodes.
    """
    if a.host_bridge and a.host_bridge == b.host_bridge:
        common = 0
        for x, y in zip(a.chain, b.chain, strict=False):
            if x != y:
                break
            common += 1
        if common == 0:
            return TopoLevel.PHB
        if common >= 2 and len(a.chain) - common <= 1 and len(b.chain) - common <= 1:
            return TopoLevel.PIX
        return TopoLevel.PXB
    if a.numa_node is not None and a.numa_node == b.numa_node:
        return TopoLevel.NODE
    return TopoLevel.SYS


def read_config(dev_path: Path) -> bytes:
    """The device's configuration space (b"" when unreadable)."""
    try:
        with open(dev_path / "config", "rb") as f:
            return f.read(4096)
    except OSError:
        return b""


def _capability(cfg: bytes, cap_id: int) -> int | None:
    if len(cfg) < 0x40 or not (struct.unpack_from("<H", cfg, 0x06)[0] & 0x10):
        return None
    ptr, seen = cfg[0x34] & 0xFC, 0
    while ptr and ptr + 1 < len(cfg) and seen < 48:
        if cfg[ptr] == cap_id:
            return ptr
        ptr, seen = cfg[ptr + 1] & 0xFC, seen + 1
    return None


def _ext_capability(cfg: bytes, cap_id: int) -> int | None:
    off, seen = 0x100, 0
    while off and off + 4 <= len(cfg) and seen < 96:
        (hdr,) = struct.unpack_from("<I", cfg, off)
        if hdr in (0, 0xFFFFFFFF):
            return None
        if hdr & 0xFFFF == cap_id:
            return off
        off, seen = (hdr >> 20) & 0xFFC, seen + 1
    return None


def acs_source_validation(cfg: bytes) -> bool | None:
    """True when ACS Source Validation is enabled ("ACSCtl: SrcValid+"), False when off, None without an ACS
    capability or without the extended space (not applicable)."""
    off = _ext_capability(cfg, PCI_EXT_CAP_ACS)
    if off is None or off + 8 > len(cfg):
        return None
    (ctrl,) = struct.unpack_from("<H", cfg, off + 6)
    return bool(ctrl & ACS_CTRL_SRC_VALID)


def payload_sizes(cfg: bytes) -> tuple[int, int] | None:
    """(MaxPayload, MaxReadReq) in bytes from the PCIe Device Control register, or None without a PCIe cap."""
    off = _capability(cfg, PCI_CAP_EXP)
    if off is None or off + 10 > len(cfg):
        return None
    (ctl,) = struct.unpack_from("<H", cfg, off + 8)
    return 128 << ((ctl >> 5) & 7), 128 << ((ctl >> 12) & 7)


def link(dev_path: Path) -> str | None:
    """`32.0 GT/s x16 (max 32.0 GT/s x16)` from current/max link speed and width; None where absent."""
    cs, cw = read_text(dev_path / "current_link_speed"), read_text(dev_path / "current_link_width")
    ms, mw = read_text(dev_path / "max_link_speed"), read_text(dev_path / "max_link_width")
    if cs is None or cw is None:
        return None
    def speed(s: str | None) -> str:
        return (s or "?").replace(" PCIe", "")
    return f"{speed(cs)} x{cw} (max {speed(ms)} x{mw or '?'})"
