"""NvmlProbe's real code against a stand-in autospecced from the real pynvml module (a misspelled
NVML call or a wrong argument count fails), with readings set per GPU; and against the real pynvml
on this host (no driver: one nvml_unavailable event, then quiet)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from unittest import mock

import pynvml
import pytest

from agents import nvml as nvml_mod
from agents.nvml import NvmlProbe
from fleetmend.catalog import default_catalog
from fleetmend.events import Component, FaultEvent, Severity, Source


class Gpu:
    """Per-GPU readings the stand-in returns."""

    def __init__(self, i: int) -> None:
        self.i = i
        self.ecc = {(0, 0): 0, (1, 0): 0, (0, 1): 0, (1, 1): 0}  # (error type, counter type) -> count
        self.rows = (0, 0, 0, 0)
        self.retired_pending = 0
        self.width, self.max_width = 16, 16
        self.gen, self.max_gen, self.util = 1, 5, 0
        self.links = {0: 1, 1: 1}  # link -> state (1 = active)
        self.nvlink_errors: dict[tuple[int, int], int] = {}
        self.reasons = 0
        self.temp, self.slowdown = 40, 90
        self.recovery = 0
        self.lost = False


def nvml_standin(gpus: list[Gpu]) -> mock.Mock:
    nv = mock.create_autospec(pynvml, instance=False)
    nv.NVMLError = pynvml.NVMLError
    err = pynvml.NVMLError

    def g(h):
        gpu = gpus[h[1]]
        if gpu.lost:
            raise err(pynvml.NVML_ERROR_GPU_IS_LOST)
        return gpu

    nv.nvmlInit.return_value = None
    nv.nvmlSystemGetDriverVersion.return_value = "570.124.06"
    nv.nvmlDeviceGetCount.side_effect = lambda: len(gpus)
    nv.nvmlDeviceGetHandleByIndex.side_effect = lambda i: ("h", i)
    nv.nvmlDeviceGetPciInfo.side_effect = lambda h: SimpleNamespace(busId=f"00000000:{0x18 + h[1]:02X}:00.0".encode())
    nv.nvmlDeviceGetUUID.side_effect = lambda h: f"GPU-0000000{h[1]}-0000-0000-0000-000000000000"
    nv.nvmlDeviceGetTotalEccErrors.side_effect = lambda h, e, c: g(h).ecc[(e, c)]
    nv.nvmlDeviceGetRemappedRows.side_effect = lambda h: g(h).rows
    nv.nvmlDeviceGetRetiredPagesPendingStatus.side_effect = lambda h: g(h).retired_pending
    nv.nvmlDeviceGetRetiredPages.side_effect = lambda h, cause: [0x1000] * (2 if cause == 0 else 0)
    nv.nvmlDeviceGetCurrPcieLinkWidth.side_effect = lambda h: g(h).width
    nv.nvmlDeviceGetMaxPcieLinkWidth.side_effect = lambda h: g(h).max_width
    nv.nvmlDeviceGetCurrPcieLinkGeneration.side_effect = lambda h: g(h).gen
    nv.nvmlDeviceGetMaxPcieLinkGeneration.side_effect = lambda h: g(h).max_gen
    nv.nvmlDeviceGetUtilizationRates.side_effect = lambda h: SimpleNamespace(gpu=g(h).util, memory=0)

    def link_state(h, link):
        if link not in g(h).links:
            raise err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return g(h).links[link]

    nv.nvmlDeviceGetNvLinkState.side_effect = link_state
    nv.nvmlDeviceGetNvLinkErrorCounter.side_effect = lambda h, link, c: g(h).nvlink_errors.get((link, c), 0)
    nv.nvmlDeviceGetCurrentClocksEventReasons.side_effect = lambda h: g(h).reasons
    nv.nvmlDeviceGetTemperature.side_effect = lambda h, sensor: g(h).temp
    nv.nvmlDeviceGetTemperatureThreshold.side_effect = lambda h, t: g(h).slowdown

    def fields(h, ids):
        assert ids == [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION]
        return [SimpleNamespace(nvmlReturn=0, value=SimpleNamespace(uiVal=g(h).recovery))]

    nv.nvmlDeviceGetFieldValues.side_effect = fields
    return nv


def probe(nv, **kw) -> NvmlProbe:
    return NvmlProbe(nv, cluster="c", node="n1", xid_events=False, **kw)


def kinds(events: list[FaultEvent]) -> list[tuple[str, bool, int | None]]:
    return [(e.kind, e.healthy, e.device.index) for e in events]


def test_constants_are_the_nvml_values() -> None:
    p = pynvml
    assert nvml_mod.EVENT_XID_CRITICAL == p.nvmlEventTypeXidCriticalError
    assert (nvml_mod.ERR_CORRECTED, nvml_mod.ERR_UNCORRECTED) == (p.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                                                                   p.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)
    assert (nvml_mod.VOLATILE, nvml_mod.AGGREGATE) == (p.NVML_VOLATILE_ECC, p.NVML_AGGREGATE_ECC)
    assert nvml_mod.THRESHOLD_SLOWDOWN == p.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
    assert nvml_mod.TEMPERATURE_GPU == p.NVML_TEMPERATURE_GPU
    assert nvml_mod.RETIRE_DBE == p.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
    assert nvml_mod.NVLINK_COUNTERS == {"dl_replay": p.NVML_NVLINK_ERROR_DL_REPLAY,
                                        "dl_recovery": p.NVML_NVLINK_ERROR_DL_RECOVERY,
                                        "dl_crc_flit": p.NVML_NVLINK_ERROR_DL_CRC_FLIT,
                                        "dl_crc_data": p.NVML_NVLINK_ERROR_DL_CRC_DATA}
    assert nvml_mod.NVLINK_MAX_LINKS == p.NVML_NVLINK_MAX_LINKS
    assert nvml_mod.FI_GPU_RECOVERY_ACTION == p.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
    assert set(nvml_mod.CLOCK_REASONS) == {p.nvmlClocksEventReasonHwSlowdown, p.nvmlClocksEventReasonSwThermalSlowdown,
                                           p.nvmlClocksEventReasonHwThermalSlowdown,
                                           p.nvmlClocksEventReasonHwPowerBrakeSlowdown}
    from fleetmend.catalog import default_catalog

    assert default_catalog().recovery_action(nvml=p.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT).name == "NODE_REBOOT"
    assert default_catalog().recovery_action(nvml=p.NVML_GPU_RECOVERY_ACTION_DRAIN_P2P).name == "DRAIN_P2P"
    assert (nvml_mod.E_TIMEOUT, nvml_mod.E_GPU_IS_LOST, nvml_mod.E_LIBRARY_NOT_FOUND) == (
        p.NVML_ERROR_TIMEOUT, p.NVML_ERROR_GPU_IS_LOST, p.NVML_ERROR_LIBRARY_NOT_FOUND)


def test_healthy_gpus_publish_nothing_and_repeat_polls_stay_quiet() -> None:
    nv = nvml_standin([Gpu(0), Gpu(1)])
    p = probe(nv)
    init = p.init()
    assert init == []  # NVML was never unavailable: nothing to clear
    assert p.poll_once() == [] and p.poll_once() == []
    assert [g.device.pci_bus_id for g in p.gpus] == ["0000:18:00.0", "0000:19:00.0"]
    assert p.gpus[0].links == [0, 1]


def test_ecc_steps_publish_once_per_value_and_clear_after_reset() -> None:
    gpus = [Gpu(0), Gpu(1)]
    p = probe(nvml_standin(gpus))
    p.init()
    gpus[1].ecc[(1, 0)] = 2  # volatile DBE
    gpus[1].ecc[(1, 1)] = 2  # aggregate DBE
    ev = p.poll_once()
    assert sorted(kinds(ev)) == [("ecc_dbe_aggregate", False, 1), ("ecc_dbe_volatile", False, 1)]
    dbe = next(e for e in ev if e.kind == "ecc_dbe_volatile")
    assert dbe.severity is Severity.FATAL and dbe.source is Source.NVML and dbe.component is Component.GPU
    assert dbe.device.pci_bus_id == "0000:19:00.0" and dbe.attrs["ecc_dbe_volatile"] == 2
    assert default_catalog().classify(dbe).drain
    assert p.poll_once() == []  # same reading: debounced
    gpus[1].ecc[(1, 0)] = 3
    gpus[1].ecc[(1, 1)] = 3
    assert sorted(kinds(p.poll_once())) == [("ecc_dbe_aggregate", False, 1), ("ecc_dbe_volatile", False, 1)]
    gpus[1].ecc[(1, 0)] = 0  # GPU reset: volatile counter back to 0, aggregate stays
    cleared = p.poll_once()
    assert kinds(cleared) == [("ecc_dbe_volatile", True, 1)]
    assert cleared[0].severity is Severity.INFO and cleared[0].attrs["clearing_kind"] == "gpu_memory_healthy"
    assert cleared[0].condition == dbe.condition


@pytest.mark.parametrize(("rows", "kind", "severity"), [
    ((1, 0, 1, 0), "remapped_rows_pending", Severity.DEGRADED),
    ((0, 4, 1, 0), "remapped_rows_pending_uncorrectable", Severity.FATAL),
])
def test_remapped_rows_pending(rows, kind, severity) -> None:
    gpus = [Gpu(0)]
    p = probe(nvml_standin(gpus))
    p.init()
    gpus[0].rows = rows
    ev = p.poll_once()
    assert kinds(ev) == [(kind, False, 0)] and ev[0].severity is severity
    gpus[0].rows = (rows[0], rows[1], 0, 0)  # reset applied the remap
    assert kinds(p.poll_once()) == [(kind, True, 0)]


def test_remap_failure_and_pending_kind_change_clears_the_old_kind() -> None:
    gpus = [Gpu(0)]
    p = probe(nvml_standin(gpus))
    p.init()
    gpus[0].rows = (1, 0, 1, 0)
    assert kinds(p.poll_once()) == [("remapped_rows_pending", False, 0)]
    gpus[0].rows = (1, 1, 1, 1)
    assert kinds(p.poll_once()) == [("remapped_rows_pending", True, 0),
                                    ("remapped_rows_pending_uncorrectable", False, 0),
                                    ("row_remap_failure", False, 0)]


def test_retired_pages_pending() -> None:
    gpus = [Gpu(0)]
    p = probe(nvml_standin(gpus))
    p.init()
    gpus[0].retired_pending = 1
    ev = p.poll_once()
    assert kinds(ev) == [("retired_pages_pending", False, 0)] and ev[0].attrs["retired_pages_sbe"] == 2


def test_pcie_width_always_generation_only_under_load() -> None:
    gpus = [Gpu(0)]
    p = probe(nvml_standin(gpus))
    p.init()
    assert p.poll_once() == []  # idle at Gen1 of Gen5: power saving, not a fault
    gpus[0].util = 95
    ev = p.poll_once()
    assert kinds(ev) == [("pcie_link_speed_degraded", False, 0)] and ev[0].component is Component.PCIE
    gpus[0].util = 0  # idle again: no judgement, no clearing
    assert p.poll_once() == []
    gpus[0].util, gpus[0].gen = 90, 5
    assert kinds(p.poll_once()) == [("pcie_link_speed_degraded", True, 0)]
    gpus[0].width = 8
    ev = p.poll_once()
    assert kinds(ev) == [("pcie_link_degraded", False, 0)] and "x8 of x16" in ev[0].message


def test_nvlink_down_and_error_steps() -> None:
    gpus = [Gpu(0)]
    p = probe(nvml_standin(gpus), nvlink_error_step=100)
    p.init()
    assert p.poll_once() == []
    gpus[0].links[1] = 0
    ev = p.poll_once()
    assert kinds(ev) == [("nvlink_down", False, 0)] and ev[0].device.port == 1
    gpus[0].nvlink_errors[(0, 2)] = 50  # CRC flit +50: below the step
    assert p.poll_once() == []
    gpus[0].nvlink_errors[(0, 1)] = 1  # one DL recovery
    ev = p.poll_once()
    assert kinds(ev) == [("nvlink_errors", False, 0)] and ev[0].severity is Severity.DEGRADED
    gpus[0].links[1] = 1
    assert sorted(kinds(p.poll_once())) == [("nvlink_down", True, 0), ("nvlink_errors", True, 0)]


def test_clock_reasons_temperature_and_recovery_action() -> None:
    gpus = [Gpu(0), Gpu(1)]
    p = probe(nvml_standin(gpus))
    p.init()
    gpus[0].reasons = 0x8 | 0x40 | 0x1  # HW slowdown + HW thermal (+ GPU idle, ignored)
    gpus[1].temp = 91
    gpus[1].recovery = 2  # NODE_REBOOT
    ev = p.poll_once()
    assert sorted(kinds(ev)) == [("clocks_hw_slowdown", False, 0), ("clocks_thermal_slowdown", False, 0),
                                 ("gpu_recovery_action", False, 1), ("gpu_temperature_high", False, 1)]
    rec = next(e for e in ev if e.kind == "gpu_recovery_action")
    assert rec.severity is Severity.FATAL and rec.attrs["recovery_action"] == "NODE_REBOOT"
    gpus[1].temp = 88  # within the 5 °C hysteresis: still hot
    assert p.poll_once() == []
    gpus[1].temp, gpus[1].recovery, gpus[0].reasons = 80, 0, 0
    assert sorted(kinds(p.poll_once())) == [("clocks_hw_slowdown", True, 0), ("clocks_thermal_slowdown", True, 0),
                                            ("gpu_recovery_action", True, 1), ("gpu_temperature_high", True, 1)]


def test_gpu_lost_is_fatal_and_other_gpus_still_read() -> None:
    gpus = [Gpu(0), Gpu(1)]
    p = probe(nvml_standin(gpus))
    p.init()
    gpus[0].lost = True
    gpus[1].rows = (0, 1, 1, 0)
    ev = p.poll_once()
    assert sorted(kinds(ev)) == [("gpu_fallen_off_bus", False, 0), ("remapped_rows_pending_uncorrectable", False, 1)]
    assert p.poll_once() == []


def test_unsupported_reads_are_skipped_and_not_retried() -> None:
    nv = nvml_standin([Gpu(0)])
    nv.nvmlDeviceGetRemappedRows.side_effect = pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
    nv.nvmlDeviceGetFieldValues.side_effect = lambda h, ids: [SimpleNamespace(nvmlReturn=3, value=None)]
    p = probe(nv)
    p.init()
    assert p.poll_once() == [] and p.poll_once() == []
    assert nv.nvmlDeviceGetRemappedRows.call_count == 1
    assert nv.nvmlDeviceGetFieldValues.call_count == 1


def test_xid_event_from_the_event_set() -> None:
    gpus = [Gpu(0), Gpu(1)]
    nv = nvml_standin(gpus)
    p = probe(nv)
    p.init()
    ev = p.xid_event(SimpleNamespace(device=("h", 1), eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=79,
                                     gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF))
    assert ev is not None and ev.kind == "xid" and ev.code == 79 and ev.source is Source.NVML
    assert ev.device.pci_bus_id == "0000:19:00.0" and ev.severity is Severity.FATAL
    assert default_catalog().classify(ev).immediate_action.value == "RESTART_BM"


async def test_run_delivers_xid_events_from_the_thread_and_stops() -> None:
    gpus = [Gpu(0)]
    nv = nvml_standin(gpus)
    pending = [SimpleNamespace(device=("h", 0), eventType=8, eventData=48, gpuInstanceId=0, computeInstanceId=0)]
    waits = threading.Event()

    def wait(es, timeout_ms):
        assert timeout_ms == 50
        waits.set()
        if pending:
            return pending.pop()
        threading.Event().wait(timeout_ms / 1000)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)

    nv.nvmlEventSetCreate.return_value = "es"
    nv.nvmlEventSetWait_v2.side_effect = wait
    gpus[0].ecc[(0, 0)] = 5
    p = NvmlProbe(nv, cluster="c", node="n1", poll_interval_s=0.05, xid_wait_ms=50)
    got: list[FaultEvent] = []

    async def emit(e: FaultEvent) -> None:
        got.append(e)

    task = asyncio.create_task(p.run(emit))
    for _ in range(200):
        if any(e.kind == "xid" for e in got):
            break
        await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [(e.kind, e.code) for e in got] == [("ecc_sbe_volatile", None), ("xid", 48)]
    nv.nvmlDeviceRegisterEvents.assert_called_once_with(("h", 0), pynvml.nvmlEventTypeXidCriticalError, "es")
    nv.nvmlEventSetFree.assert_called_once_with("es")
    nv.nvmlShutdown.assert_called_once_with()


async def test_no_driver_on_this_host_one_info_event_then_quiet() -> None:
    """The real pynvml here: libnvidia-ml is absent → one nvml_unavailable (info), no crash, no repeats."""
    p = NvmlProbe(pynvml, cluster="c", node="n1", retry_interval_s=0.01)
    got: list[FaultEvent] = []

    async def emit(e: FaultEvent) -> None:
        got.append(e)

    task = asyncio.create_task(p.run(emit))
    await asyncio.sleep(0.3)  # ~30 retries of nvmlInit
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    if p.initialised or any(e.kind != "nvml_unavailable" for e in got):
        pytest.skip("this host has a working NVML")
    assert len(got) == 1
    e = got[0]
    assert (e.kind, e.component, e.severity, e.healthy) == ("nvml_unavailable", Component.AGENT, Severity.INFO, False)
    assert "no NVIDIA driver" in e.message


def test_init_failure_is_degraded_and_clears_when_nvml_comes_up() -> None:
    nv = nvml_standin([Gpu(0)])
    nv.nvmlInit.side_effect = pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
    p = probe(nv)
    ev = p.init()
    assert kinds(ev) == [("nvml_unavailable", False, None)] and ev[0].severity is Severity.DEGRADED
    assert p.init() == []
    nv.nvmlInit.side_effect = None
    ev = p.init()
    assert kinds(ev) == [("nvml_unavailable", True, None)] and ev[0].attrs["clearing_kind"] == "nvml_available"


def pci_tree(root, devices: dict[str, tuple[str, str]]):
    """`root/sys/bus/pci/devices/<bdf>/{vendor,class}` for each bdf → (vendor, class), as sysfs writes them."""
    for bdf, (vendor, cls) in devices.items():
        d = root / "sys/bus/pci/devices" / bdf
        d.mkdir(parents=True)
        (d / "vendor").write_text(vendor + "\n")
        (d / "class").write_text(cls + "\n")
    return root


def test_nvidia_gpus_on_bus_counts_display_controllers_of_nvidia_only(tmp_path) -> None:
    root = pci_tree(tmp_path, {"0000:17:00.0": ("0x10de", "0x030200"),  # H100: 3D controller
                               "0000:17:00.1": ("0x10de", "0x040300"),  # NVIDIA HDMI audio: not a GPU
                               "0000:3b:00.0": ("0x8086", "0x020000"),  # Intel NIC
                               "0000:00:02.0": ("0x8086", "0x030000")})  # Intel VGA: not NVIDIA
    assert nvml_mod.nvidia_gpus_on_bus(root) == 1
    assert nvml_mod.nvidia_gpus_on_bus(tmp_path / "elsewhere") is None  # no sysfs there: unknown


async def test_no_nvidia_gpu_on_the_bus_is_not_applicable_nothing_published(tmp_path) -> None:
    """A CPU node or a dev box (issue 30: `dev up` opened an incident for the host itself): no event, NVML
    not even loaded, and the probe says why."""
    root = pci_tree(tmp_path, {"0000:3b:00.0": ("0x8086", "0x020000"), "0000:17:00.1": ("0x10de", "0x040300")})
    nv = nvml_standin([])
    nv.nvmlInit.side_effect = pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    got: list[FaultEvent] = []

    async def emit(e: FaultEvent) -> None:
        got.append(e)

    p = NvmlProbe(nv, cluster="c", node="n1", retry_interval_s=0.01, host_root=root)
    await asyncio.wait_for(p.run(emit), 5)  # returns: nothing to watch
    assert got == [] and not nv.nvmlInit.called
    assert p.not_applicable and "no NVIDIA GPU on the PCI bus" in p.not_applicable
    lazy = NvmlProbe(cluster="c", node="n1", host_root=root)  # the real pynvml, never imported for it
    await asyncio.wait_for(lazy.run(emit), 5)
    assert lazy._nvml == "default" and got == []


async def test_nvidia_gpu_on_the_bus_without_a_driver_is_a_fault(tmp_path) -> None:
    """Where the bus shows an NVIDIA GPU, a missing driver is degraded (a GPU node that cannot be read), not info."""
    root = pci_tree(tmp_path, {"0000:17:00.0": ("0x10de", "0x030200")})
    nv = nvml_standin([])
    nv.nvmlInit.side_effect = pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    got: list[FaultEvent] = []

    async def emit(e: FaultEvent) -> None:
        got.append(e)

    p = NvmlProbe(nv, cluster="c", node="n1", retry_interval_s=0.01, host_root=root)
    task = asyncio.create_task(p.run(emit))
    await asyncio.sleep(0.2)  # ~20 retries of nvmlInit (tenacity): one event only
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert nv.nvmlInit.call_count > 2 and len(got) == 1
    e = got[0]
    assert (e.kind, e.severity, e.healthy) == ("nvml_unavailable", Severity.DEGRADED, False)
    assert "1 NVIDIA GPU(s) on the PCI bus but no NVIDIA driver" in e.message and p.not_applicable is None
