"""SysfsProbe over recorded sysfs trees (file contents as the kernel writes them), and once over this
host's real /sys (must not crash, must be quiet on a second poll)."""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from agents.sysfs import SysfsProbe, parse_link_speed, parse_port_state, parse_rate
from fleetmend.events import Component, Severity, Source


def w(p: Path, text: str) -> None:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text + "\n")


def ib_port(root: Path, hca: str, port: int, state: str, phys: str, rate: str, bdf: str = "0000:1a:00.0") -> Path:
    dev = root / "sys/devices/pci0000:00/0000:00:02.0" / bdf
    dev.mkdir(parents=True, exist_ok=True)
    hca_dir = root / "sys/class/infiniband" / hca
    hca_dir.mkdir(parents=True, exist_ok=True)
    if not (hca_dir / "device").exists():
        os.symlink(dev, hca_dir / "device")
    d = hca_dir / "ports" / str(port)
    w(d / "state", state)
    w(d / "phys_state", phys)
    w(d / "rate", rate)
    w(d / "link_layer", "InfiniBand")
    return d


def netdev(root: Path, name: str, carrier: str | None, oper: str, flags: str = "0x1003", physical: bool = True,
           speed: str = "100000", type_: str = "1") -> Path:
    d = root / "sys/class/net" / name
    d.mkdir(parents=True, exist_ok=True)
    if physical and not (d / "device").exists():
        dev = root / "sys/devices/pci0000:00/0000:00:03.0/0000:3d:00.0"
        dev.mkdir(parents=True, exist_ok=True)
        os.symlink(dev, d / "device")
    if carrier is not None:
        w(d / "carrier", carrier)
    elif (d / "carrier").exists():
        (d / "carrier").unlink()  # the kernel answers EINVAL: no file content to read
    w(d / "operstate", oper)
    w(d / "flags", flags)
    w(d / "speed", speed)
    w(d / "type", type_)
    return d


def pci(root: Path, bdf: str, vendor: str, cls: str, width: str, max_width: str, speed: str, max_speed: str,
        up_width: str | None = "16", up_speed: str | None = "32.0 GT/s PCIe") -> Path:
    up = root / "sys/devices/pci0000:00" / f"0000:00:{bdf[5:7]}.0"
    if up_width is not None:
        w(up / "max_link_width", up_width)
    if up_speed is not None:
        w(up / "max_link_speed", up_speed)
    d = up / bdf
    for name, v in (("vendor", vendor), ("class", cls), ("current_link_width", width), ("max_link_width", max_width),
                    ("current_link_speed", speed), ("max_link_speed", max_speed)):
        w(d / name, v)
    link = root / "sys/bus/pci/devices" / bdf
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        os.symlink(os.path.relpath(d, link.parent), link)
    return d


def kinds(events) -> list[tuple[str, bool, str | None]]:
    return sorted((e.kind, e.healthy, e.device.name or e.device.pci_bus_id) for e in events)


def test_ib_port_down_init_active_and_rate(tmp_path: Path) -> None:
    p0 = ib_port(tmp_path, "mlx5_0", 1, "4: ACTIVE", "5: LinkUp", "400 Gb/sec (4X NDR)")
    p1 = ib_port(tmp_path, "mlx5_1", 1, "1: DOWN", "2: Polling", "10 Gb/sec (4X SDR)", bdf="0000:1b:00.0")
    probe = SysfsProbe(tmp_path, cluster="c", node="n1", ib_expected_rate_gbps=400)
    ev = probe.poll_once()
    assert kinds(ev) == [("ib_port_down", False, "mlx5_1")]
    e = ev[0]
    assert e.component is Component.IB and e.source is Source.SYSFS and e.severity is Severity.DEGRADED
    assert e.device.port == 1 and e.device.pci_bus_id == "0000:1b:00.0"
    assert e.attrs["phys_state"] == "POLLING" and "Polling" not in e.kind
    assert probe.poll_once() == []
    w(p1 / "state", "2: INIT")
    w(p1 / "phys_state", "5: LinkUp")
    assert kinds(probe.poll_once()) == [("ib_port_down", True, "mlx5_1"), ("ib_port_init", False, "mlx5_1")]
    w(p1 / "state", "4: ACTIVE")
    w(p1 / "rate", "400 Gb/sec (4X NDR)")
    cleared = probe.poll_once()
    assert kinds(cleared) == [("ib_port_init", True, "mlx5_1")]
    assert cleared[0].attrs["clearing_kind"] == "ib_port_active"
    w(p0 / "rate", "200 Gb/sec (2X NDR)")
    ev = probe.poll_once()
    assert kinds(ev) == [("ib_port_rate_degraded", False, "mlx5_0")] and "200 Gb/sec" in ev[0].message


def test_nic_carrier_admin_down_and_virtual(tmp_path: Path) -> None:
    netdev(tmp_path, "eth0", "1", "up")
    netdev(tmp_path, "eth1", "0", "down", speed="-1")
    netdev(tmp_path, "eth2", None, "down", flags="0x1002")  # admin down: carrier read gives EINVAL
    netdev(tmp_path, "veth9", "0", "down", physical=False)
    netdev(tmp_path, "ib0", "0", "down", type_="32")
    probe = SysfsProbe(tmp_path, cluster="c", node="n1")
    ev = probe.poll_once()
    assert kinds(ev) == [("nic_link_down", False, "eth1")]
    assert ev[0].component is Component.NIC and ev[0].device.pci_bus_id == "0000:3d:00.0"
    netdev(tmp_path, "eth1", "1", "up")
    cleared = probe.poll_once()
    assert kinds(cleared) == [("nic_link_down", True, "eth1")] and cleared[0].attrs["clearing_kind"] == "nic_link_up"


def test_pcie_width_and_speed_against_device_and_upstream_max(tmp_path: Path) -> None:
    # GPU at x8 of x16: degraded; GPU idle at 2.5 GT/s: not judged here
    pci(tmp_path, "0000:3b:00.0", "0x10de", "0x030200", "8", "16", "2.5 GT/s PCIe", "32.0 GT/s PCIe")
    # Gen5 GPU in a Gen4 slot, full width: by design, quiet
    pci(tmp_path, "0000:5d:00.0", "0x10de", "0x030200", "16", "16", "16.0 GT/s PCIe", "32.0 GT/s PCIe",
        up_speed="16.0 GT/s PCIe")
    # ConnectX NIC at 8 GT/s of 16: degraded
    pci(tmp_path, "0000:1a:00.0", "0x15b3", "0x020700", "16", "16", "8.0 GT/s PCIe", "16.0 GT/s PCIe",
        up_speed="16.0 GT/s PCIe")
    # Intel NIC and a Mellanox PCIe bridge: not ours
    pci(tmp_path, "0000:6a:00.0", "0x8086", "0x020000", "4", "8", "8.0 GT/s PCIe", "8.0 GT/s PCIe")
    pci(tmp_path, "0000:6b:00.0", "0x15b3", "0x060400", "4", "16", "8.0 GT/s PCIe", "16.0 GT/s PCIe")
    probe = SysfsProbe(tmp_path, cluster="c", node="n1")
    ev = probe.poll_once()
    assert kinds(ev) == [("pcie_link_degraded", False, "0000:3b:00.0"), ("pcie_link_speed_degraded", False, "0000:1a:00.0")]
    gpu = next(e for e in ev if e.kind == "pcie_link_degraded")
    assert gpu.component is Component.PCIE and "x8 of x16" in gpu.message and gpu.attrs["pci_function"] == "GPU"
    info = SysfsProbe(tmp_path, cluster="c", node="n1", gpu_link_speed_info=True).poll_once()
    assert ("pcie_link_speed_low", False, "0000:3b:00.0") in kinds(info)
    pci(tmp_path, "0000:3b:00.0", "0x10de", "0x030200", "16", "16", "32.0 GT/s PCIe", "32.0 GT/s PCIe")
    cleared = probe.poll_once()
    assert kinds(cleared) == [("pcie_link_degraded", True, "0000:3b:00.0")]
    assert cleared[0].attrs["clearing_kind"] == "pcie_link_full"


def test_missing_tree_is_quiet(tmp_path: Path) -> None:
    assert SysfsProbe(tmp_path / "nothing", cluster="c", node="n1").poll_once() == []


def test_this_hosts_real_sys_does_not_crash() -> None:
    probe = SysfsProbe(Path("/"), cluster="c", node="n1")
    probe.poll_once()
    assert probe.poll_once() == []


def test_value_parsers() -> None:
    assert parse_port_state("4: ACTIVE") == (4, "ACTIVE")
    assert parse_port_state("5: LinkUp") == (5, "LINKUP")
    assert parse_port_state("garbage") is None
    assert parse_rate("400 Gb/sec (4X NDR)") == (400.0, 4, "NDR")
    assert parse_rate("10 Gb/sec (4X)") == (10.0, 4, None)
    assert parse_rate("56 Gb/sec (4X FDR)") == (56.0, 4, "FDR")
    assert parse_link_speed("16.0 GT/s PCIe") == 16.0
    assert parse_link_speed("8 GT/s") == 8.0
    assert parse_link_speed("Unknown speed") is None


@given(st.text(max_size=60))
def test_value_parsers_never_raise(text: str) -> None:
    parse_port_state(text)
    parse_rate(text)
    parse_link_speed(text)
