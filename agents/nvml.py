"""`NvmlProbe`: GPU health read through NVML (`pynvml`, package nvidia-ml-py).

What it reads (per GPU, every `poll_interval_s`; each a debounced slot, `agents.conditions`):

    ECC counters            nvmlDeviceGetTotalEccErrors(h, CORRECTED|UNCORRECTED, VOLATILE|AGGREGATE)
                            volatile DBE > 0 → ecc_dbe_volatile (fatal); volatile SBE > 0 → ecc_sbe_volatile
                            (info); aggregate steps → ecc_*_aggregate (info); each step republishes
    remapped rows           nvmlDeviceGetRemappedRows(h) → (correctable, uncorrectable, pending, failure):
                            failure → row_remap_failure (fatal, RMA); pending with uncorrectable rows →
                            remapped_rows_pending_uncorrectable (fatal); pending (correctable only) →
                            remapped_rows_pending (degraded)  [NVIDIA A100/H100 row-remapping docs]
    retired pages           nvmlDeviceGetRetiredPagesPendingStatus / nvmlDeviceGetRetiredPages (pre-Ampere)
                            → retired_pages_pending (degraded)
    PCIe link               width nvmlDeviceGetCurrPcieLinkWidth vs nvmlDeviceGetMaxPcieLinkWidth, always →
                            pcie_link_degraded; generation nvmlDeviceGetCurrPcieLinkGeneration vs
                            nvmlDeviceGetMaxPcieLinkGeneration only while the GPU is busy
                            (utilization ≥ `pcie_gen_min_util_pct`): an idle GPU downclocks its link to
                            Gen1 to save power, which is not a fault → pcie_link_speed_degraded
    NVLink                  nvmlDeviceGetNvLinkState(h, link) of the links present at start → nvlink_down;
                            nvmlDeviceGetNvLinkErrorCounter(h, link, DL_RECOVERY|DL_REPLAY|DL_CRC_FLIT|
                            DL_CRC_DATA): a step of ≥ `nvlink_error_step` in one poll → nvlink_errors
    clock event reasons     nvmlDeviceGetCurrentClocksEventReasons (older drivers: ...ThrottleReasons):
                            HW slowdown, SW/HW thermal slowdown, HW power brake → clocks_hw_slowdown,
                            clocks_thermal_slowdown, clocks_power_brake (degraded)
    temperature             nvmlDeviceGetTemperature(h, GPU) ≥ slowdown threshold
                            (nvmlDeviceGetTemperatureThreshold, else `temperature_max_c`) →
                            gpu_temperature_high; clears 5 °C below (hysteresis)
    recovery action         nvmlDeviceGetGpuRecoveryAction (where pynvml has it) or field
                            NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (230) → gpu_recovery_action (R570+)
    GPU lost                NVML_ERROR_GPU_IS_LOST from any call → gpu_fallen_off_bus (fatal)

XID events: a thread waits on an NVML event set (nvmlEventSetCreate, nvmlDeviceRegisterEvents with
nvmlEventTypeXidCriticalError, nvmlEventSetWait_v2 with a `xid_wait_ms` timeout so stop is
noticed) and each XID becomes a `kind="xid"` event (source nvml; the kmsg probe reports the same
XID with its text, the router coalesces them by fault key).

Not applicable: given the host root (`host_root`, the agent's `agent.host_root`), the probe first looks
for NVIDIA GPUs on the PCI bus (`sys/bus/pci/devices/*/vendor` 0x10de, `class` 0x03xxxx). With none, it
publishes nothing, does not load NVML and returns, saying why in `not_applicable` (the heartbeat shows it):
a CPU node or a dev box is not a fault. Where the bus cannot be read, it goes on as below.

No NVML (no driver, nvmlInit raising): ONE `nvml_unavailable` event (component agent; degraded when
NVIDIA GPUs are on the bus or NVML is there but fails; info when the library or driver is absent and
the bus was not read), then the probe retries `nvmlInit` every `retry_interval_s` silently (tenacity);
when NVML comes up the event is cleared. Other probes are unaffected (each probe runs in its own task).

What a restart loses: the debounce state (first readings are republished; at-least-once) and XID
events raised while no event set was registered (the kmsg probe still reads those from the log).

NVML enters through the constructor (`nvml=pynvml`), so tests pass `create_autospec(pynvml)`.
Constants are nvml.h values, written here so an autospecced stand-in (whose module attributes are
mocks) still gets real numbers; `tests/test_nvml_probe.py` checks them against pynvml.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog
from tenacity import AsyncRetrying, retry_if_result, wait_fixed

from agents.conditions import UNKNOWN, Conditions, Reading
from agents.kmsg.matchers import normalize_bdf
from fleetmend import __version__
from fleetmend.catalog import Catalog, default_catalog
from fleetmend.events import Component, Device, FaultEvent, Severity, Source

Emit = Callable[[FaultEvent], Awaitable[None]]

# nvml.h values (checked against pynvml in tests)
EVENT_XID_CRITICAL = 8  # nvmlEventTypeXidCriticalError
ERR_CORRECTED, ERR_UNCORRECTED = 0, 1  # NVML_MEMORY_ERROR_TYPE_*
VOLATILE, AGGREGATE = 0, 1  # NVML_VOLATILE_ECC, NVML_AGGREGATE_ECC
TEMPERATURE_GPU, THRESHOLD_SLOWDOWN = 0, 1
RETIRE_SBE, RETIRE_DBE = 0, 1  # NVML_PAGE_RETIREMENT_CAUSE_*
NVLINK_COUNTERS = {"dl_replay": 0, "dl_recovery": 1, "dl_crc_flit": 2, "dl_crc_data": 3}
NVLINK_MAX_LINKS = 36
FI_GPU_RECOVERY_ACTION = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
CLOCK_REASONS = {  # nvmlClocksEventReason* bit → kind
    0x8: "clocks_hw_slowdown",
    0x20: "clocks_thermal_slowdown",  # SW thermal slowdown
    0x40: "clocks_thermal_slowdown",  # HW thermal slowdown
    0x80: "clocks_power_brake",
}
E_INVALID_ARGUMENT, E_NOT_SUPPORTED, E_NOT_FOUND = 2, 3, 6
E_DRIVER_NOT_LOADED, E_TIMEOUT, E_LIBRARY_NOT_FOUND, E_FUNCTION_NOT_FOUND, E_GPU_IS_LOST = 9, 10, 12, 13, 15
ABSENT = frozenset({E_DRIVER_NOT_LOADED, E_LIBRARY_NOT_FOUND})
"""nvmlInit errors that mean "no NVIDIA driver here" (a CPU node): info, not a fault."""
UNSUPPORTED = frozenset({E_NOT_SUPPORTED, E_FUNCTION_NOT_FOUND, E_INVALID_ARGUMENT, E_NOT_FOUND})
TEMPERATURE_HYSTERESIS_C = 5


def _real_pynvml() -> Any:
    try:
        import pynvml  # lazy: NVML's library loads only where an NVML probe or reader runs
    except ImportError:
        return None
    return pynvml


NVIDIA_VENDOR = 0x10DE
DISPLAY_CLASS = 0x03
"""PCI vendor id of NVIDIA and base class of display controllers (VGA 0x0300, 3D 0x0302: every data-center GPU)."""


def nvidia_gpus_on_bus(host_root: Path) -> int | None:
    """How many NVIDIA GPUs the PCI bus shows under `host_root` (`sys/bus/pci/devices/*/vendor` 0x10de and
    `class` 0x03xxxx; Linux Documentation/ABI/testing/sysfs-bus-pci), or None when the bus cannot be read
    (no sysfs there): then nobody knows, and NVML decides."""
    devices = Path(host_root) / "sys/bus/pci/devices"
    try:
        entries = list(devices.iterdir())
    except OSError:
        return None
    n = 0
    for dev in entries:
        try:
            vendor = int((dev / "vendor").read_text().strip(), 16)
            pci_class = int((dev / "class").read_text().strip(), 16)
        except (OSError, ValueError):
            continue
        n += vendor == NVIDIA_VENDOR and pci_class >> 16 == DISPLAY_CLASS
    return n


def _nvml_error_type(nvml: Any) -> type[BaseException]:
    """`NVMLError` of `nvml`, or of the real pynvml when `nvml` is a stand-in whose attributes are mocks."""
    err = getattr(nvml, "NVMLError", None)
    if isinstance(err, type) and issubclass(err, BaseException):
        return err
    real = _real_pynvml()
    return real.NVMLError if real is not None else OSError


def _code(err: BaseException) -> int | None:
    v = getattr(err, "value", None)
    return v if isinstance(v, int) else None


def present_nvlinks(nv: Any, handle: Any, nvml_error: type[BaseException]) -> list[int]:
    """The NVLink indices (0..NVLINK_MAX_LINKS-1) whose state NVML can read on `handle`.

    Raises: `nvml_error` with `NVML_ERROR_GPU_IS_LOST` (the caller reports the lost GPU); any other
    NVML error on a link means that link is absent."""
    links: list[int] = []
    for link in range(NVLINK_MAX_LINKS):
        try:
            nv.nvmlDeviceGetNvLinkState(handle, link)
        except nvml_error as err:
            if _code(err) == E_GPU_IS_LOST:
                raise
            continue
        links.append(link)
    return links


def read_once(nvml_error: type[BaseException], g: Any, what: str, fn: Callable[..., Any] | None, *args: Any,
              failed: Any = None, log: Any = None) -> Any:
    """`fn(g.handle, *args)`: one NVML read on the GPU `g` (anything with `handle` and an `unsupported`
    set of read names). `failed` when `fn` is None, when the GPU does not support the read (remembered
    in `g.unsupported`, never retried) or when it fails (logged at debug on `log`).

    Raises: `nvml_error` with `NVML_ERROR_GPU_IS_LOST` (the caller reports the lost GPU)."""
    if fn is None or what in g.unsupported:
        return failed
    try:
        return fn(g.handle, *args)
    except nvml_error as err:
        code = _code(err)
        if code == E_GPU_IS_LOST:
            raise
        if code in UNSUPPORTED:
            g.unsupported.add(what)
        elif log is not None:
            log.debug("nvml_read_failed", gpu=getattr(g, "index", None), read=what, error=str(err))
        return failed


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


class _Gpu:
    def __init__(self, index: int, handle: Any, device: Device) -> None:
        self.index, self.handle, self.device = index, handle, device
        self.links: list[int] | None = None  # NVLinks present (discovered on first poll)
        self.counters: dict[tuple[int, str], int] = {}
        self.unsupported: set[str] = set()  # reads this GPU does not support (not retried)


def trim_heap() -> bool:
    """Hand the heap that nvmlInit and event-set setup allocated and freed back to the OS
    (glibc's `malloc_trim(0)`; glibc keeps freed heap otherwise). Measured on an H200 host with
    driver 580.159.04: nvmlInit adds ~19 MiB of RSS that nvmlShutdown does not return, and
    malloc_trim returns ~10 MiB of it. Returns False where libc has no malloc_trim (musl)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


class NvmlProbe:
    """NVML probe (`name = "nvml"`).

    Args:
        nvml: the `pynvml` module ("default": import it) or a stand-in with the same functions.
        cluster, node, agent_version: stamped on events.
        catalog: severity of XIDs and clearing kinds; default the packaged catalog.
        poll_interval_s: period of the counter/state reads (default 30 s; each poll is ~20 NVML
            calls per GPU, microseconds each).
        retry_interval_s: how often `nvmlInit` is retried while NVML is unavailable.
        xid_wait_ms: timeout of one `nvmlEventSetWait_v2`; bounds how long stop waits for the thread.
        xid_events: False leaves the XID event thread out (the kmsg probe still sees XIDs).
        pcie_gen_min_util_pct: judge PCIe generation only at or above this GPU utilization.
        temperature_max_c: used where the GPU reports no slowdown threshold.
        nvlink_error_step: a rise of an NVLink error counter by at least this much within one poll
            is published (DL recovery errors always count from 1).
        host_root: the host's `/` (`agent.host_root`): with no NVIDIA GPU on its PCI bus the probe is not
            applicable (nothing published, NVML not loaded); None: the bus is not looked at.
    """

    name = "nvml"

    def __init__(self, nvml: Any = "default", *, cluster: str = "local", node: str = "localhost",
                 agent_version: str = __version__, catalog: Catalog | None = None,
                 poll_interval_s: float = 30.0, retry_interval_s: float = 300.0, xid_wait_ms: int = 1000,
                 xid_events: bool = True, pcie_gen_min_util_pct: int = 50, temperature_max_c: int = 87,
                 nvlink_error_step: int = 100, host_root: Path | None = None) -> None:
        self._nvml = nvml
        self._nvml_error: type[BaseException] | None = None
        self.host_root = host_root
        self.gpus_on_bus: int | None = None
        """NVIDIA GPUs on the PCI bus (read at `run`), None when not looked at or unreadable."""
        self.not_applicable: str | None = None
        """Why the probe does not apply to this host (no NVIDIA GPU on the bus), else None."""
        self.cluster, self.node, self.agent_version = cluster, node, agent_version
        self.catalog = catalog or default_catalog()
        self.poll_interval_s, self.retry_interval_s = poll_interval_s, retry_interval_s
        self.xid_wait_ms, self.xid_events = xid_wait_ms, xid_events
        self.pcie_gen_min_util_pct = pcie_gen_min_util_pct
        self.temperature_max_c = temperature_max_c
        self.nvlink_error_step = nvlink_error_step
        self.conditions = Conditions(cluster, node, Source.NVML, agent_version, self.catalog)
        self.gpus: list[_Gpu] = []
        self.initialised = False
        self._log = structlog.get_logger("fleetmend.agent.nvml").bind(cluster=cluster, node=node)

    # ------------------------------------------------------------------ lifecycle

    @property
    def nvml(self) -> Any:
        """The `pynvml` module (imported at first use: a host without NVIDIA GPUs never loads it) or the
        stand-in given."""
        if isinstance(self._nvml, str) and self._nvml == "default":
            self._nvml = _real_pynvml()
        return self._nvml

    @property
    def NVMLError(self) -> type[BaseException]:  # pynvml's name
        if self._nvml_error is None:
            self._nvml_error = _nvml_error_type(self.nvml)
        return self._nvml_error

    def init(self) -> list[FaultEvent]:
        """nvmlInit and enumerate GPUs. Returns the nvml_unavailable event or its clearing (debounced).
        No driver is info where the bus was not read, degraded where NVIDIA GPUs are on it."""
        on_bus = f"{self.gpus_on_bus} NVIDIA GPU(s) on the PCI bus but " if self.gpus_on_bus else ""
        absent = Severity.DEGRADED if self.gpus_on_bus else Severity.INFO
        if self.nvml is None:
            return self.conditions.observe("nvml", self._unavailable(
                f"{on_bus}pynvml (nvidia-ml-py) is not installed", absent, None))
        try:
            self.nvml.nvmlInit()
        except self.NVMLError as err:
            code = _code(err)
            sev = absent if code in ABSENT else Severity.DEGRADED
            what = (f"{on_bus}no NVIDIA driver on this host" if code in ABSENT
                    else "NVML is present but nvmlInit failed")
            return self.conditions.observe("nvml", self._unavailable(f"{what}: {err}", sev, code))
        except OSError as err:  # ctypes load problems outside pynvml's own error mapping
            return self.conditions.observe("nvml", self._unavailable(f"NVML could not be loaded: {err}",
                                                                     Severity.DEGRADED, None))
        self.initialised = True
        try:
            self.gpus = self._enumerate()
        except self.NVMLError as err:
            self.shutdown()
            return self.conditions.observe("nvml", self._unavailable(f"NVML device enumeration failed: {err}",
                                                                     Severity.DEGRADED, _code(err)))
        driver = "unknown"
        try:
            driver = _text(self.nvml.nvmlSystemGetDriverVersion())
        except self.NVMLError:
            pass
        self._log.info("nvml_ready", gpus=len(self.gpus), driver_version=driver)
        trim_heap()
        return self.conditions.observe("nvml", None, clear_message=f"NVML available: {len(self.gpus)} GPU(s), "
                                                                   f"driver {driver}")

    def shutdown(self) -> None:
        if self.initialised:
            try:
                self.nvml.nvmlShutdown()
            except self.NVMLError as err:
                self._log.debug("nvml_shutdown_failed", error=str(err))
            self.initialised = False

    def _unavailable(self, message: str, severity: Severity, code: int | None) -> Reading:
        return Reading(kind="nvml_unavailable", component=Component.AGENT, severity=severity, message=message,
                       device=Device(name="nvml"), attrs={"nvml_error": code}, signature=(code,))

    def _enumerate(self) -> list[_Gpu]:
        gpus = []
        for i in range(int(self.nvml.nvmlDeviceGetCount())):
            h = self.nvml.nvmlDeviceGetHandleByIndex(i)
            bdf = uuid = None
            try:
                bdf = normalize_bdf(_text(self.nvml.nvmlDeviceGetPciInfo(h).busId))
            except self.NVMLError:
                pass
            try:
                uuid = _text(self.nvml.nvmlDeviceGetUUID(h))
            except self.NVMLError:
                pass
            gpus.append(_Gpu(i, h, Device(index=i, pci_bus_id=bdf, uuid=uuid)))
        return gpus

    # ------------------------------------------------------------------ run

    async def run(self, emit: Emit) -> None:
        """Return at once where no NVIDIA GPU is on the bus (`not_applicable`); else init (retrying every
        `retry_interval_s`, tenacity), start the XID thread, poll until cancelled."""
        if self.host_root is not None:
            self.gpus_on_bus = await asyncio.to_thread(nvidia_gpus_on_bus, self.host_root)
            if self.gpus_on_bus == 0:
                self.not_applicable = "no NVIDIA GPU on the PCI bus"  # in every heartbeat: short
                self._log.info("nvml_not_applicable", reason=self.not_applicable,
                               read=str(Path(self.host_root) / "sys/bus/pci/devices"),
                               looked_for="vendor 0x10de, class 0x03xxxx")
                return

        async def init_and_emit() -> bool:
            for ev in await asyncio.to_thread(self.init):
                await emit(ev)
            return self.initialised

        await AsyncRetrying(retry=retry_if_result(lambda up: not up), wait=wait_fixed(self.retry_interval_s))(
            init_and_emit)
        loop = asyncio.get_running_loop()
        xids: asyncio.Queue[FaultEvent] = asyncio.Queue(maxsize=1000)
        stop = threading.Event()
        thread = None
        if self.xid_events and self.gpus:
            thread = threading.Thread(target=self._xid_thread, args=(stop, loop, xids), name="nvml-xid", daemon=True)
            thread.start()
        try:
            while True:
                for ev in await asyncio.to_thread(self.poll_once):
                    await emit(ev)
                deadline = time.monotonic() + self.poll_interval_s
                while (left := deadline - time.monotonic()) > 0:
                    try:
                        async with asyncio.timeout(left):
                            ev = await xids.get()
                    except TimeoutError:
                        break
                    await emit(ev)
        finally:
            stop.set()
            if thread is not None:
                await asyncio.to_thread(thread.join, self.xid_wait_ms / 1000 * 3)
            self.shutdown()

    # ------------------------------------------------------------------ XID events

    def _xid_thread(self, stop: threading.Event, loop: asyncio.AbstractEventLoop,
                    out: asyncio.Queue[FaultEvent]) -> None:
        try:
            es = self.nvml.nvmlEventSetCreate()
        except self.NVMLError as err:
            self._log.warning("nvml_xid_events_unavailable", error=str(err))
            return
        try:
            registered = 0
            for g in self.gpus:
                try:
                    self.nvml.nvmlDeviceRegisterEvents(g.handle, EVENT_XID_CRITICAL, es)
                    registered += 1
                except self.NVMLError as err:
                    self._log.warning("nvml_xid_register_failed", gpu=g.index, error=str(err))
            if not registered:
                return
            trim_heap()
            while not stop.is_set():
                try:
                    data = self.nvml.nvmlEventSetWait_v2(es, self.xid_wait_ms)
                except self.NVMLError as err:
                    if _code(err) == E_TIMEOUT:
                        continue
                    self._log.warning("nvml_xid_wait_failed", error=str(err))
                    stop.wait(self.xid_wait_ms / 1000)
                    continue
                ev = self.xid_event(data)
                if ev is not None:
                    loop.call_soon_threadsafe(_put, out, ev, self._log)
        finally:
            try:
                self.nvml.nvmlEventSetFree(es)
            except self.NVMLError:
                pass

    def xid_event(self, data: Any) -> FaultEvent | None:
        """One `nvmlEventSetWait_v2` result (c_nvmlEventData_t: device, eventType, eventData) → XID event."""
        if int(getattr(data, "eventType", EVENT_XID_CRITICAL)) & EVENT_XID_CRITICAL == 0:
            return None
        xid = int(data.eventData)
        gpu = self._gpu_of(data.device)
        device = gpu.device if gpu is not None else Device()
        entry = self.catalog.xids.get(xid)
        what = f"{entry.mnemonic}: {entry.description}" if entry is not None else "not in the XID catalog"
        where = device.pci_bus_id or (f"GPU {device.index}" if device.index is not None else "unknown GPU")
        msg = f"NVML XID critical error event: Xid {xid} on {where} ({what})"
        return self.catalog.stamp(FaultEvent(
            cluster=self.cluster, node=self.node, component=Component.GPU, device=device, kind="xid", code=xid,
            severity=Severity.DEGRADED, message=msg[:4000], source=Source.NVML, raw=msg, agent_version=self.agent_version,
            attrs={"via": "nvml_event", "gpu_instance_id": _int_or_none(getattr(data, "gpuInstanceId", None)),
                   "compute_instance_id": _int_or_none(getattr(data, "computeInstanceId", None))}),
            keep_severity=False)

    def _gpu_of(self, handle: Any) -> _Gpu | None:
        for g in self.gpus:
            if g.handle is handle or g.handle == handle or _address(g.handle) == _address(handle) is not None:
                return g
        try:
            bdf = normalize_bdf(_text(self.nvml.nvmlDeviceGetPciInfo(handle).busId))
        except self.NVMLError:
            return None
        return next((g for g in self.gpus if g.device.pci_bus_id == bdf), None)

    # ------------------------------------------------------------------ polling

    def poll_once(self) -> list[FaultEvent]:
        """Read every GPU once (blocking NVML calls: run it in a thread). Returns the events to publish."""
        out: list[FaultEvent] = []
        for g in self.gpus:
            try:
                out += self._poll_gpu(g)
            except self.NVMLError as err:
                if _code(err) == E_GPU_IS_LOST:
                    out += self.conditions.observe(f"lost@{g.index}", Reading(
                        kind="gpu_fallen_off_bus", component=Component.GPU, severity=Severity.FATAL, device=g.device,
                        message=f"GPU {g.index} ({g.device.pci_bus_id}) is lost: NVML returned GPU_IS_LOST"))
                else:
                    self._log.warning("nvml_poll_failed", gpu=g.index, error=str(err))
        return out

    def _read(self, g: _Gpu, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Call one NVML read; UNKNOWN when the GPU does not support it (remembered) or it fails."""
        return read_once(self.NVMLError, g, what, fn, *args, failed=UNKNOWN, log=self._log)

    def _poll_gpu(self, g: _Gpu) -> list[FaultEvent]:
        out: list[FaultEvent] = []
        for slot, reading in self._readings(g):
            out += self.conditions.observe(f"{slot}@{g.index}", reading)
        return out

    def _readings(self, g: _Gpu) -> list[tuple[str, Any]]:
        nv, dev = self.nvml, g.device
        where = f"GPU {g.index} ({dev.pci_bus_id or dev.uuid or '?'})"
        r: list[tuple[str, Any]] = []

        # ECC counters
        ecc = {}
        for name, etype, ctype in (("sbe_volatile", ERR_CORRECTED, VOLATILE), ("dbe_volatile", ERR_UNCORRECTED, VOLATILE),
                                   ("sbe_aggregate", ERR_CORRECTED, AGGREGATE),
                                   ("dbe_aggregate", ERR_UNCORRECTED, AGGREGATE)):
            v = self._read(g, f"ecc_{name}", nv.nvmlDeviceGetTotalEccErrors, etype, ctype)
            ecc[name] = v if v is UNKNOWN else int(v)
        counts = {k: v for k, v in ecc.items() if v is not UNKNOWN}
        for name, sev in (("dbe_volatile", Severity.FATAL), ("sbe_volatile", Severity.INFO),
                          ("dbe_aggregate", Severity.INFO), ("sbe_aggregate", Severity.INFO)):
            v = ecc[name]
            reading: Any = UNKNOWN
            if v is not UNKNOWN:
                label = {"dbe": "uncorrectable (DBE)", "sbe": "correctable (SBE)"}[name[:3]]
                scope = "since the last reset" if "volatile" in name else "lifetime"
                reading = None if v == 0 else Reading(
                    kind=f"ecc_{name}", component=Component.GPU, severity=sev, device=dev,
                    message=f"{where}: {v} {label} ECC error(s) {scope}", attrs={f"ecc_{k}": c for k, c in counts.items()},
                    signature=(v,))
            r.append((f"ecc_{name}", reading))

        # remapped rows (Ampere+)
        rows = self._read(g, "remapped_rows", nv.nvmlDeviceGetRemappedRows)
        if rows is UNKNOWN:
            r += [("remap", UNKNOWN), ("remap_failure", UNKNOWN)]
        else:
            corr, unc, pending, failure = (int(x) for x in rows)
            attrs = {"remapped_rows_correctable": corr, "remapped_rows_uncorrectable": unc,
                     "remapped_rows_pending": bool(pending), "row_remap_failure": bool(failure)}
            state = f"correctable {corr}, uncorrectable {unc}, pending {bool(pending)}, failure {bool(failure)}"
            if pending and unc:
                rd: Any = Reading(kind="remapped_rows_pending_uncorrectable", component=Component.GPU,
                                  severity=Severity.FATAL, device=dev, attrs=attrs, signature=(corr, unc),
                                  message=f"{where}: row remap pending for uncorrectable errors ({state}); "
                                          "reset the GPU to apply it")
            elif pending:
                rd = Reading(kind="remapped_rows_pending", component=Component.GPU, severity=Severity.DEGRADED,
                             device=dev, attrs=attrs, signature=(corr, unc),
                             message=f"{where}: row remap pending ({state}); reset the GPU at the next convenience")
            else:
                rd = None
            r.append(("remap", rd))
            r.append(("remap_failure", None if not failure else Reading(
                kind="row_remap_failure", component=Component.GPU, severity=Severity.FATAL, device=dev, attrs=attrs,
                message=f"{where}: row remapping failed ({state}); the GPU needs replacement (RMA)")))

        # retired pages (pre-Ampere page retirement)
        pend = self._read(g, "retired_pages_pending", nv.nvmlDeviceGetRetiredPagesPendingStatus)
        if pend is UNKNOWN:
            r.append(("retired_pages", UNKNOWN))
        else:
            retired = {}
            for label, cause in (("sbe", RETIRE_SBE), ("dbe", RETIRE_DBE)):
                pages = self._read(g, f"retired_pages_{label}", nv.nvmlDeviceGetRetiredPages, cause)
                if pages is not UNKNOWN:
                    retired[f"retired_pages_{label}"] = len(pages)
            r.append(("retired_pages", None if not int(pend) else Reading(
                kind="retired_pages_pending", component=Component.GPU, severity=Severity.DEGRADED, device=dev,
                attrs=retired, signature=tuple(sorted(retired.items())),
                message=f"{where}: page retirement pending ({retired or 'counts unknown'}); "
                        "reset the GPU or reboot to retire the pages")))

        # PCIe link: width always, generation only under load
        cur_w = self._read(g, "pcie_width", nv.nvmlDeviceGetCurrPcieLinkWidth)
        max_w = self._read(g, "pcie_max_width", nv.nvmlDeviceGetMaxPcieLinkWidth)
        if UNKNOWN in (cur_w, max_w) or not int(max_w):
            r.append(("pcie_width", UNKNOWN))
        else:
            cur_w, max_w = int(cur_w), int(max_w)
            r.append(("pcie_width", None if cur_w >= max_w else Reading(
                kind="pcie_link_degraded", component=Component.PCIE, severity=Severity.DEGRADED, device=dev,
                attrs={"pcie_link_width": cur_w, "pcie_link_width_max": max_w}, signature=(cur_w, max_w),
                message=f"{where}: PCIe link trained at x{cur_w} of x{max_w}")))
        cur_g = self._read(g, "pcie_gen", nv.nvmlDeviceGetCurrPcieLinkGeneration)
        max_g = self._read(g, "pcie_max_gen", nv.nvmlDeviceGetMaxPcieLinkGeneration)
        util = self._read(g, "utilization", nv.nvmlDeviceGetUtilizationRates)
        busy = util is not UNKNOWN and int(util.gpu) >= self.pcie_gen_min_util_pct
        if UNKNOWN in (cur_g, max_g) or not busy:
            r.append(("pcie_gen", UNKNOWN))  # an idle GPU runs its link at Gen1 on purpose
        else:
            cur_g, max_g = int(cur_g), int(max_g)
            r.append(("pcie_gen", None if cur_g >= max_g else Reading(
                kind="pcie_link_speed_degraded", component=Component.PCIE, severity=Severity.DEGRADED, device=dev,
                attrs={"pcie_link_gen": cur_g, "pcie_link_gen_max": max_g, "gpu_utilization_pct": int(util.gpu)},
                signature=(cur_g, max_g),
                message=f"{where}: PCIe link at Gen{cur_g} of Gen{max_g} while the GPU is {int(util.gpu)} % busy")))

        # NVLink
        r += self._nvlink(g, where)

        # clock event (throttle) reasons
        fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        mask = self._read(g, "clock_reasons", fn)
        active: dict[str, list[str]] = {}
        if mask is not UNKNOWN:
            names = {0x8: "HW slowdown", 0x20: "SW thermal slowdown", 0x40: "HW thermal slowdown", 0x80: "HW power brake"}
            for bit, kind in CLOCK_REASONS.items():
                if int(mask) & bit:
                    active.setdefault(kind, []).append(names[bit])
        for kind in ("clocks_hw_slowdown", "clocks_thermal_slowdown", "clocks_power_brake"):
            if mask is UNKNOWN:
                r.append((kind, UNKNOWN))
                continue
            r.append((kind, None if kind not in active else Reading(
                kind=kind, component=Component.GPU, severity=Severity.DEGRADED, device=dev,
                attrs={"clocks_event_reasons": int(mask)}, signature=tuple(active[kind]),
                message=f"{where}: clocks slowed down ({', '.join(active[kind])})")))

        # temperature (hysteresis: clears 5 °C below the threshold)
        temp = self._read(g, "temperature", nv.nvmlDeviceGetTemperature, TEMPERATURE_GPU)
        limit = self._read(g, "temperature_slowdown", nv.nvmlDeviceGetTemperatureThreshold, THRESHOLD_SLOWDOWN)
        limit_c = self.temperature_max_c if limit is UNKNOWN or not int(limit) else int(limit)
        if temp is UNKNOWN:
            r.append(("temperature", UNKNOWN))
        else:
            t = int(temp)
            hot = f"temperature@{g.index}" in self.conditions.active()
            if t >= limit_c:
                r.append(("temperature", Reading(
                    kind="gpu_temperature_high", component=Component.GPU, severity=Severity.DEGRADED, device=dev,
                    attrs={"temperature_c": t, "temperature_slowdown_c": limit_c}, signature=(limit_c,),
                    message=f"{where}: temperature {t} °C at or above the slowdown threshold {limit_c} °C")))
            elif hot and t > limit_c - TEMPERATURE_HYSTERESIS_C:
                r.append(("temperature", UNKNOWN))
            else:
                r.append(("temperature", None))

        # recovery action (R570+ drivers)
        r.append(("recovery", self._recovery(g, where)))
        return r

    def _nvlink(self, g: _Gpu, where: str) -> list[tuple[str, Any]]:
        nv = self.nvml
        if g.links is None:
            g.links = present_nvlinks(nv, g.handle, self.NVMLError)
        r: list[tuple[str, Any]] = []
        for link in g.links:
            dev = g.device.model_copy(update={"port": link})
            try:
                state = int(nv.nvmlDeviceGetNvLinkState(g.handle, link))
            except self.NVMLError as err:
                if _code(err) == E_GPU_IS_LOST:
                    raise
                r.append((f"nvlink{link}", UNKNOWN))
                continue
            r.append((f"nvlink{link}", None if state else Reading(
                kind="nvlink_down", component=Component.NVLINK, severity=Severity.DEGRADED, device=dev,
                message=f"{where}: NVLink {link} is down")))
            steps: dict[str, int] = {}
            totals: dict[str, int] = {}
            for cname, counter in NVLINK_COUNTERS.items():
                try:
                    v = int(nv.nvmlDeviceGetNvLinkErrorCounter(g.handle, link, counter))
                except self.NVMLError as err:
                    if _code(err) == E_GPU_IS_LOST:
                        raise
                    continue
                prev = g.counters.get((link, cname))
                g.counters[(link, cname)] = v
                totals[f"nvlink_{cname}"] = v
                if prev is not None and v > prev:
                    steps[cname] = v - prev
            alarming = {k: d for k, d in steps.items()
                        if d >= (1 if k == "dl_recovery" else self.nvlink_error_step)}
            if alarming:
                sev = Severity.DEGRADED if "dl_recovery" in alarming else Severity.INFO
                detail = ", ".join(f"{k} +{d}" for k, d in sorted(alarming.items()))
                r.append((f"nvlink{link}_errors", Reading(
                    kind="nvlink_errors", component=Component.NVLINK, severity=sev, device=dev, attrs=totals,
                    signature=tuple(sorted(totals.items())),
                    message=f"{where}: NVLink {link} error counters rose within one poll ({detail})")))
            elif totals:
                r.append((f"nvlink{link}_errors", None))
        return r

    def _recovery(self, g: _Gpu, where: str) -> Any:
        nv = self.nvml
        value: Any = UNKNOWN
        if "recovery" in g.unsupported:
            return UNKNOWN
        fn = getattr(nv, "nvmlDeviceGetGpuRecoveryAction", None)
        if fn is not None:
            value = self._read(g, "recovery", fn)
        elif hasattr(nv, "nvmlDeviceGetFieldValues"):
            vals = self._read(g, "recovery", nv.nvmlDeviceGetFieldValues, [FI_GPU_RECOVERY_ACTION])
            if vals is not UNKNOWN:
                fv = vals[0]
                if int(getattr(fv, "nvmlReturn", 0)) != 0:
                    g.unsupported.add("recovery")
                    return UNKNOWN
                value = int(fv.value.uiVal)
        if value is UNKNOWN:
            return UNKNOWN
        act = self.catalog.recovery_action(nvml=int(value))  # catalog: recovery_actions.toml
        name, sev = (act.name, act.severity) if act is not None else (f"UNKNOWN_{int(value)}", Severity.DEGRADED)
        if sev is Severity.INFO:
            return None
        return Reading(kind="gpu_recovery_action", component=Component.GPU, severity=sev, device=g.device,
                       attrs={"recovery_action": name}, signature=(name,),
                       message=f"{where}: NVML recovery action {name}")


def _put(q: asyncio.Queue[FaultEvent], ev: FaultEvent, log: Any) -> None:
    try:
        q.put_nowait(ev)
    except asyncio.QueueFull:
        log.warning("nvml_xid_dropped", xid=ev.code, reason="1000 XID events queued; the publisher is stuck")


def _int_or_none(v: Any) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _address(handle: Any) -> int | None:
    """The C pointer value of an NVML device handle (None for non-ctypes stand-ins)."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None
