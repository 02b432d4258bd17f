"""Diagnostics request/reply over the real nats-server, with NVML absent (this host) and an
autospecced stand-in of the real `pynvml` module (misspelled calls fail)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pynvml
import pytest

from agents.diag import QUICK_CHECKS, DiagResponder
from fleetmend.diagnostics import DiagLevel, DiagReport, DiagRequest, DiagResult
from fleetmend.subjects import diag_subject

GPU = ("nvml_reachable", "gpu_count", "remapped_rows_pending", "pcie_link_width")


def _fake_nvml(n_gpus: int = 8, pending_on: int | None = None, narrow_on: int | None = None) -> mock.Mock:
    """An autospec of the real pynvml: every call the responder makes must exist with that signature."""
    nv = mock.create_autospec(pynvml, instance=False)
    nv.NVMLError = pynvml.NVMLError
    nv.NVMLError_NotSupported = pynvml.NVMLError_NotSupported
    nv.NVMLError_LibraryNotFound = pynvml.NVMLError_LibraryNotFound
    nv.NVMLError_DriverNotLoaded = pynvml.NVMLError_DriverNotLoaded
    nv.nvmlInit.return_value = None
    nv.nvmlSystemGetDriverVersion.return_value = "570.124.06"
    nv.nvmlDeviceGetCount.return_value = n_gpus
    nv.nvmlDeviceGetHandleByIndex.side_effect = lambda i: ("handle", i)
    nv.nvmlDeviceGetPciInfo.side_effect = lambda h: SimpleNamespace(busId=f"00000000:{0x18 + h[1]:02X}:00.0".encode())
    nv.nvmlDeviceGetRemappedRows.side_effect = lambda h: (0, 2, 1, 0) if h[1] == pending_on else (0, 0, 0, 0)
    nv.nvmlDeviceGetCurrPcieLinkWidth.side_effect = lambda h: 8 if h[1] == narrow_on else 16
    nv.nvmlDeviceGetMaxPcieLinkWidth.return_value = 16
    return nv


async def _ask(nc, cluster: str, node: str, body: bytes, timeout_s: float = 10.0) -> DiagReport:
    msg = await nc.request(diag_subject(cluster, node), body, timeout=timeout_s)
    return DiagReport.model_validate_json(msg.data)


@pytest.fixture
def kmsg_file(tmp_path: Path) -> Path:
    p = tmp_path / "kmsg"
    p.write_text("6,1,0,-;hello\n")
    return p


async def test_no_nvml_on_this_host_every_gpu_check_not_applicable(nc, unique: str, kmsg_file: Path,
                                                                  tmp_path: Path) -> None:
    cluster, node = f"c{unique}", "n1"
    r = DiagResponder(nc, cluster, node, sysfs_root=tmp_path, kmsg_path=kmsg_file)  # real pynvml
    await r.start()
    try:
        report = await _ask(nc, cluster, node, DiagRequest(level=DiagLevel.QUICK, incident_id="i1").model_dump_json().encode())
    finally:
        await r.stop()
    by = {c.name: c for c in report.checks}
    assert list(by) == list(QUICK_CHECKS)
    for name in GPU:
        assert by[name].result is DiagResult.NOT_APPLICABLE, by[name]
        assert by[name].detail == "no NVIDIA driver on this host"
    assert by["ib_ports_active"].result is DiagResult.NOT_APPLICABLE
    assert by["kmsg_readable"].result is DiagResult.PASS
    assert report.passed and report.node == node and report.cluster == cluster


async def test_pending_remapped_rows_fail_naming_the_gpu(nc, unique: str, kmsg_file: Path, tmp_path: Path) -> None:
    cluster, node = f"c{unique}", "n1"
    for dev, port, state in (("mlx5_0", 1, "4: ACTIVE"), ("mlx5_1", 1, "4: ACTIVE")):
        d = tmp_path / "sys/class/infiniband" / dev / "ports" / str(port)
        d.mkdir(parents=True)
        (d / "state").write_text(state + "\n")
    nv = _fake_nvml(8, pending_on=5)
    r = DiagResponder(nc, cluster, node, nvml=nv, expected_gpus=8, sysfs_root=tmp_path, kmsg_path=kmsg_file)
    await r.start()
    try:
        report = await _ask(nc, cluster, node, DiagRequest().model_dump_json().encode())
    finally:
        await r.stop()
    by = {c.name: c for c in report.checks}
    assert report.result is DiagResult.FAIL and not report.passed
    assert by["remapped_rows_pending"].result is DiagResult.FAIL
    assert "GPU 5 (00000000:1d:00.0)" in by["remapped_rows_pending"].detail
    assert "GPU 4" not in by["remapped_rows_pending"].detail
    assert by["gpu_count"].result is DiagResult.PASS and by["gpu_count"].measured == "8"
    assert by["nvml_reachable"].result is DiagResult.PASS and "570.124.06" in by["nvml_reachable"].measured
    assert by["pcie_link_width"].result is DiagResult.PASS
    assert by["ib_ports_active"].result is DiagResult.PASS
    nv.nvmlInit.assert_called_once_with()
    nv.nvmlShutdown.assert_called_once_with()


async def test_missing_gpu_narrow_link_and_down_ib_port(nc, unique: str, kmsg_file: Path, tmp_path: Path) -> None:
    cluster, node = f"c{unique}", "n1"
    d = tmp_path / "sys/class/infiniband/mlx5_3/ports/1"
    d.mkdir(parents=True)
    (d / "state").write_text("1: DOWN\n")
    r = DiagResponder(nc, cluster, node, nvml=_fake_nvml(7, narrow_on=2), expected_gpus=8,
                      sysfs_root=tmp_path, kmsg_path=kmsg_file)
    await r.start()
    try:
        report = await _ask(nc, cluster, node, DiagRequest(
            checks=["gpu_count", "pcie_link_width", "ib_ports_active", "no_such_check"]).model_dump_json().encode())
    finally:
        await r.stop()
    by = {c.name: c for c in report.checks}
    assert by["gpu_count"].result is DiagResult.FAIL and by["gpu_count"].expected == "8"
    assert by["pcie_link_width"].result is DiagResult.FAIL and "GPU 2" in by["pcie_link_width"].measured
    assert by["ib_ports_active"].result is DiagResult.FAIL and "mlx5_3/1: 1: DOWN" in by["ib_ports_active"].measured
    assert by["no_such_check"].result is DiagResult.UNKNOWN and "expected" in by["no_such_check"].detail


async def test_garbage_request_gets_error_report_and_responder_lives(nc, unique: str, kmsg_file: Path,
                                                                     tmp_path: Path) -> None:
    cluster, node = f"c{unique}", "n1"
    r = DiagResponder(nc, cluster, node, nvml=None, sysfs_root=tmp_path, kmsg_path=kmsg_file)
    await r.start()
    try:
        bad = await _ask(nc, cluster, node, b"{not json")
        assert [c.name for c in bad.checks] == ["request"]
        assert bad.checks[0].result is DiagResult.UNKNOWN and "bad diagnostics request" in bad.checks[0].detail
        assert not bad.passed
        wrong = await _ask(nc, cluster, node, b'{"level": "forever"}')
        assert wrong.checks[0].name == "request"
        good = await _ask(nc, cluster, node, DiagRequest().model_dump_json().encode())
        assert good.passed
    finally:
        await r.stop()


async def test_long_level_runs_commands_with_deadline(nc, unique: str, kmsg_file: Path, tmp_path: Path) -> None:
    cluster, node = f"c{unique}", "n1"
    r = DiagResponder(nc, cluster, node, nvml=None, sysfs_root=tmp_path, kmsg_path=kmsg_file,
                      long_commands={"ok_tool": ["true"], "bad_tool": ["sh", "-c", "echo broken; exit 3"],
                                     "missing_tool": ["dcgmi-not-installed", "diag"],
                                     "slow_tool": ["sleep", "30"]})
    await r.start()
    try:
        report = await _ask(nc, cluster, node, DiagRequest(level=DiagLevel.LONG, deadline_s=2).model_dump_json().encode())
    finally:
        await r.stop()
    by = {c.name: c for c in report.checks}
    assert by["ok_tool"].result is DiagResult.PASS
    assert by["bad_tool"].result is DiagResult.FAIL and "broken" in by["bad_tool"].detail
    assert by["missing_tool"].result is DiagResult.NOT_APPLICABLE
    assert by["slow_tool"].result is DiagResult.UNKNOWN


async def test_gpu_node_without_a_driver_fails_verification_not_passes(tmp_path):
    """NOT_APPLICABLE is only for hosts without NVIDIA GPUs. A node whose GPUs are on the PCI bus but
    whose driver failed to load (after an XID 79, say) must FAIL, never be returned to service."""
    from agents.diag import DiagResponder
    from fleetmend.diagnostics import DiagRequest, DiagResult

    dev = tmp_path / "sys" / "bus" / "pci" / "devices" / "0000:3b:00.0"
    dev.mkdir(parents=True)
    (dev / "vendor").write_text("0x10de\n")
    (dev / "class").write_text("0x030200\n")
    gpu_node = DiagResponder(None, "c", "n", nvml=None, sysfs_root=tmp_path)
    rep = await gpu_node.run(DiagRequest())
    by = {c.name: c for c in rep.checks}
    assert by["nvml_reachable"].result == DiagResult.FAIL and "0000:3b:00.0" in by["nvml_reachable"].detail
    assert rep.result == DiagResult.FAIL and not rep.passed

    (tmp_path / "empty").mkdir()
    cpu_node = DiagResponder(None, "c", "n", nvml=None, sysfs_root=tmp_path / "empty")
    rep = await cpu_node.run(DiagRequest())
    assert {c.name: c for c in rep.checks}["nvml_reachable"].result == DiagResult.NOT_APPLICABLE


async def test_a_lost_gpu_fails_gpu_count_without_expected_gpus(nc, unique: str, kmsg_file: Path,
                                                                  tmp_path: Path) -> None:
    """With `agent.expected_gpus` unset (the default), `gpu_count` expects the most GPUs the node has shown
    (kept in the agent's state, across restarts) or the NVIDIA GPUs on its PCI bus: an 8-GPU node that
    comes back from an XID 79 "repair" with 7 visible fails the verification (it passed before: a new
    user's trial, F9)."""
    cluster, node = f"c{unique}", "n1"
    state = tmp_path / "state"

    async def count(n: int, sysfs: Path) -> object:
        r = DiagResponder(nc, cluster, node, nvml=_fake_nvml(n), sysfs_root=sysfs, kmsg_path=kmsg_file,
                          state_dir=state)
        await r.start()
        try:
            rep = await _ask(nc, cluster, node, DiagRequest(checks=["gpu_count"]).model_dump_json().encode())
        finally:
            await r.stop()
        return {c.name: c for c in rep.checks}["gpu_count"]

    empty = tmp_path / "empty"
    first = await count(8, empty)
    assert first.result is DiagResult.PASS and first.measured == "8"
    lost = await count(7, empty)  # a new responder (an agent restart, a reboot): the state remembers 8
    assert lost.result is DiagResult.FAIL and lost.expected == "8" and "the most this node has shown" in lost.detail
    # no state at all, but the PCI bus holds 8 NVIDIA GPUs
    state_gone = tmp_path / "state"
    for f in state_gone.iterdir():
        f.unlink()
    bus = tmp_path / "bus"
    for i in range(8):
        dev = bus / "sys/bus/pci/devices" / f"0000:{0x18 + i:02x}:00.0"
        dev.mkdir(parents=True)
        (dev / "vendor").write_text("0x10de\n")
        (dev / "class").write_text("0x030200\n")
    on_bus = await count(7, bus)
    assert on_bus.result is DiagResult.FAIL and on_bus.expected == "8" and "on its PCI bus" in on_bus.detail
