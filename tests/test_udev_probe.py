"""UdevProbe with REAL kernel uevents: a veth pair created and deleted inside a fresh network
namespace (the host's interfaces are untouched). Needs root; skipped otherwise, failed under CI=true."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from agents.udev import UdevProbe, classify_uevent, default_source
from fleetmend.events import Component, FaultEvent, Severity, Source

ROOT = Path(__file__).resolve().parents[1]


def _need_root() -> None:
    if os.geteuid() != 0 or not Path("/usr/sbin/ip").exists() and not Path("/sbin/ip").exists():
        if os.environ.get("CI") == "true":
            pytest.fail("udev test needs root and iproute2 (CI=true)")
        pytest.skip("needs root and iproute2 for network namespaces")


@pytest.fixture
def netns():
    _need_root()
    name = f"fm{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    yield name
    subprocess.run(["ip", "netns", "del", name], check=False)


def _child(ns: str, n_events: int) -> subprocess.Popen:
    proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "tests.udev_netns_child", str(n_events)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    if line != "ready":
        proc.kill()
        raise AssertionError(f"child did not start: {line!r} {proc.stderr.read()}")
    return proc


def _events(proc: subprocess.Popen) -> list[FaultEvent]:
    out, err = proc.communicate(timeout=30)
    return [FaultEvent.model_validate_json(line) for line in out.splitlines() if line.strip()]


def test_real_veth_remove_and_readd_in_a_netns(netns: str) -> None:
    a, b = "fmv0", "fmv1"
    subprocess.run(["ip", "-n", netns, "link", "add", a, "type", "veth", "peer", "name", b], check=True)
    proc = _child(netns, 4)  # 2 removals + 2 clearings
    subprocess.run(["ip", "-n", netns, "link", "del", a], check=True)  # removes both ends
    subprocess.run(["ip", "-n", netns, "link", "add", a, "type", "veth", "peer", "name", b], check=True)
    events = _events(proc)
    got = sorted((e.kind, e.healthy, e.device.name) for e in events)
    assert got == [("nic_removed", False, a), ("nic_removed", False, b), ("nic_removed", True, a),
                   ("nic_removed", True, b)], got
    removed = next(e for e in events if not e.healthy)
    assert removed.source is Source.UDEV and removed.component is Component.NIC
    assert removed.severity is Severity.DEGRADED and "DEVPATH=/devices/virtual/net/" in removed.raw
    cleared = next(e for e in events if e.healthy)
    assert cleared.attrs["clearing_kind"] == "device_added" and cleared.severity is Severity.INFO


def test_virtual_netdevs_are_ignored_by_default() -> None:
    """The default probe tracks physical netdevs only: veth/bridge churn on a container host is no fault."""
    assert classify_uevent("remove", "net", {"INTERFACE": "veth1", "DEVPATH": "/devices/virtual/net/veth1"}) is None
    c = classify_uevent("remove", "net",
                        {"INTERFACE": "eth3", "DEVPATH": "/devices/pci0000:00/0000:00:03.0/0000:3d:00.0/net/eth3"})
    assert c is not None and c[0] == "nic_removed"


def test_pci_uevents_gpu_nvme_nic() -> None:
    p = UdevProbe("kernel", cluster="c", node="n1")
    gpu = {"PCI_CLASS": "30200", "PCI_ID": "10DE:2330", "PCI_SLOT_NAME": "0000:3B:00.0",
           "DEVPATH": "/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0", "SUBSYSTEM": "pci", "ACTION": "remove"}
    ev = p.handle("remove", "pci", gpu)
    assert [(e.kind, e.severity, e.device.pci_bus_id) for e in ev] == [("gpu_removed", Severity.FATAL, "0000:3b:00.0")]
    assert p.handle("remove", "pci", gpu) == []  # same removal twice: once
    assert p.handle("bind", "pci", gpu) == []
    back = p.handle("add", "pci", gpu)
    assert [(e.kind, e.healthy) for e in back] == [("gpu_removed", True)]
    nvme = {"PCI_CLASS": "10802", "PCI_ID": "144D:A80A", "PCI_SLOT_NAME": "0000:c1:00.0"}
    assert [e.kind for e in p.handle("remove", "pci", nvme)] == ["nvme_removed"]
    cx7 = {"PCI_CLASS": "20700", "PCI_ID": "15B3:1021", "PCI_SLOT_NAME": "0000:1a:00.0"}
    assert [e.kind for e in p.handle("remove", "pci", cx7)] == ["nic_removed"]
    bridge = {"PCI_CLASS": "60400", "PCI_ID": "10DE:22B1", "PCI_SLOT_NAME": "0000:05:00.0"}
    assert p.handle("remove", "pci", bridge) == []
    assert p.handle("add", "pci", {"PCI_CLASS": "30200", "PCI_ID": "10DE:2330", "PCI_SLOT_NAME": "0000:9a:00.0"}) == []


def test_source_selection(tmp_path: Path) -> None:
    assert default_source(tmp_path / "control") == "kernel"
    (tmp_path / "control").touch()
    assert default_source(tmp_path / "control") == "udev"
    with pytest.raises(ValueError, match="expected auto, udev, kernel"):
        UdevProbe("udevd")


def test_a_uevent_burst_triggers_one_fresh_fingerprint(netns: str, tmp_path: Path) -> None:
    """The inventory probe listens to real kernel uevents (pyudev source='kernel', here inside a network namespace):
    a veth pair created and deleted (four net uevents within a second) gives exactly one fresh read, after the
    debounce, with the poll and the interval an hour away."""
    import json

    from tests.fixtures.hosts.synth import build_host

    root = build_host(tmp_path / "host")
    proc = subprocess.Popen(["ip", "netns", "exec", netns, sys.executable, "-m", "tests.udev_inventory_child",
                             str(root)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()  # type: ignore[union-attr]
    if line != "ready":
        proc.kill()
        raise AssertionError(f"child did not start: {line!r} {proc.stderr.read()}")  # type: ignore[union-attr]
    subprocess.run(["ip", "-n", netns, "link", "add", "fmi0", "type", "veth", "peer", "name", "fmi1"], check=True)
    subprocess.run(["ip", "-n", netns, "link", "del", "fmi0"], check=True)
    out, err = proc.communicate(timeout=40)
    got = json.loads(out.strip().splitlines()[-1])
    assert got["reads"] == 2, (got, err[-2000:])
    assert got["reasons"][0] == "start" and got["last_reason"].startswith("udev add net fmi"), got
    assert "udev add net" in got["pending_by"]


def test_without_a_uevent_socket_the_poll_stays(tmp_path: Path) -> None:
    """A monitor that cannot be opened (an unknown source here; no permission or no pyudev on a host) is logged
    and the device poll carries on."""
    import asyncio

    from agents.inventory.probe import InventoryProbe
    from tests.fixtures.hosts.synth import build_host

    async def go() -> InventoryProbe:
        probe = InventoryProbe(build_host(tmp_path / "h"), "c", "n", interval_s=3600, change_poll_s=0.05,
                               udev_source="nonsense")
        task = asyncio.create_task(probe.run(None))
        while probe.reads < 1:
            await asyncio.sleep(0.02)
        (tmp_path / "h/sys/class/net/fmx0").mkdir(parents=True)  # a new netdev: the poll sees it
        for _ in range(200):
            if probe.reads >= 2:
                break
            await asyncio.sleep(0.02)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return probe

    probe = asyncio.run(go())
    assert not probe.udev_listening.is_set() and probe.reads == 2 and probe.last_reason == "device poll"


def test_the_inventory_rereads_on_physical_devices_not_on_veth_churn(tmp_path) -> None:
    """A container host makes a veth per pod: none is in the fingerprint, so its uevents start no read (a read
    per pod start would cost the node's cores); a PCI device's add does."""
    from types import SimpleNamespace

    from agents.inventory.probe import InventoryProbe

    class Monitor:
        def __init__(self, *devices: object) -> None:
            self.devices = list(devices)

        def poll(self, timeout: float = 0) -> object:
            return self.devices.pop(0) if self.devices else None

    veth = SimpleNamespace(action="add", subsystem="net", sys_name="veth1a2b",
                           device_path="/devices/virtual/net/veth1a2b")
    nic = SimpleNamespace(action="add", subsystem="pci", sys_name="0000:17:00.0",
                          device_path="/devices/pci0000:16/0000:16:02.0/0000:17:00.0")
    probe = InventoryProbe(tmp_path, "c", "n1", udev_source=None)
    probe._on_uevent(Monitor(veth, veth))
    assert probe._udev_first is None
    probe._on_uevent(Monitor(veth, nic))
    assert probe._udev_first is not None and probe._udev_what == "udev add pci 0000:17:00.0"
