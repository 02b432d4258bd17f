"""The fabric manager and irqbalance checks of the fingerprint (`agents.inventory.reader`): read from
`proc/<pid>/comm` under the host root, the fabric manager only where NVSwitches (vendor 0x10de, class 0x068000) are on
the PCI bus; judged by `fleetmend.drift` (fabric manager: policy; irqbalance: cohort) into their catalog kinds."""

from __future__ import annotations

from pathlib import Path

from agents.inventory import read_fingerprint
from fleetmend.catalog import load_catalog
from fleetmend.drift import FixKind, Layer, check_of, judge
from tests.fixtures.hosts.synth import HostSpec, build_host

FM = ("systemd", "sshd", "nv-fabricmanage", "nvidia-persiste")


def _fp(tmp: Path, name: str, spec: HostSpec):  # type: ignore[no-untyped-def]
    return read_fingerprint(build_host(tmp / name, spec), "c", name)


def test_not_applicable_without_nvswitch_or_without_processes(tmp_path: Path) -> None:
    plain = _fp(tmp_path, "plain", HostSpec(processes=("systemd", "sshd")))
    assert "fabric.manager" not in plain.settings and plain.settings["irq.balance"] == "stopped"
    recorded = _fp(tmp_path, "rec", HostSpec(nvswitches=4))  # NVSwitches, but no proc/<pid> in the tree
    assert "fabric.manager" not in recorded.settings and "irq.balance" not in recorded.settings


def test_fabric_manager_running_or_not_on_an_nvswitch_board(tmp_path: Path) -> None:
    up = _fp(tmp_path, "up", HostSpec(nvswitches=4, processes=(*FM, "irqbalance")))
    assert up.settings["fabric.manager"] == "running" and up.settings["irq.balance"] == "running"
    down = _fp(tmp_path, "down", HostSpec(nvswitches=4, processes=("systemd", "nv-hostengine")))
    assert down.settings["fabric.manager"] == "stopped"


def test_judged_into_their_catalog_rows(tmp_path: Path) -> None:
    specs = {f"n{i}": HostSpec(nvswitches=4, processes=FM if i != 2 else ("systemd",)) for i in range(6)}
    specs["n4"] = HostSpec(nvswitches=4, processes=(*FM, "irqbalance"))
    report = judge([_fp(tmp_path, n, s) for n, s in specs.items()])
    got = {(d.node, d.key, d.layer, d.kind) for d in report.deviations}
    assert got == {("n2", "fabric.manager", Layer.POLICY, "config_drift_fabric_manager"),
                   ("n4", "irq.balance", Layer.COHORT, "config_drift_irqbalance")}
    fm = next(d for d in report.deviations if d.key == "fabric.manager")
    assert fm.expected == ("running",) and "NVSentinel#883" in fm.source and fm.fix is FixKind.REBOOT
    assert check_of("irq.balance").fix is FixKind.REPAIR and check_of("irq.affinity.compute.x").name == "irq_affinity"
    cat = load_catalog(None)
    assert cat.kinds["config_drift_fabric_manager"].drain and not cat.kinds["config_drift_irqbalance"].drain
    assert "0x068000" in cat.kinds["config_drift_fabric_manager"].source
    cleared = cat.kinds["config_drift_resolved"].clears
    assert {"config_drift_fabric_manager", "config_drift_irqbalance"} <= set(cleared)
