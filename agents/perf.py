"""`PerfSampler`: one compact `PerfSample` per node every `agent.perf.interval_s`, for the fail-slow
analyzer (`fleetmend.analyzer`). It judges nothing itself: no fault is raised here.

What it reads (per sample; counters become deltas against the previous sample):

    per GPU (NVML)   nvmlDeviceGetUtilizationRates, nvmlDeviceGetClockInfo / nvmlDeviceGetMaxClockInfo
                     (NVML_CLOCK_SM), clocks-event reasons as time fractions: field values
                     NVML_FI_DEV_CLOCKS_EVENT_REASON_{SW_POWER_CAP 74, SW_THERM_SLOWDOWN 269,
                     HW_THERM_SLOWDOWN 270, HW_POWER_BRAKE_SLOWDOWN 271} (cumulative ns, R535+),
                     else nvmlDeviceGetViolationStatus (NVML_PERF_POLICY_POWER / _THERMAL: violation ns
                     against a µs reference clock), else the instantaneous mask of
                     nvmlDeviceGetCurrentClocksEventReasons (1.0 or 0.0 for the interval; HW slowdown
                     0x8 has no counter and always comes from the mask), nvmlDeviceGetPowerUsage /
                     nvmlDeviceGetEnforcedPowerLimit (mW), nvmlDeviceGetTemperature, PCIe current/max
                     generation and width, nvmlDeviceGetPcieReplayCounter, NVLink state and
                     nvmlDeviceGetNvLinkErrorCounter (CRC flit+data, replay, recovery; summed over
                     links), nvmlDeviceGetTotalEccErrors(CORRECTED, VOLATILE)
    per IB/RoCE port <root>/sys/class/infiniband/<hca>/ports/<n>/{rate, counters/symbol_error,
                     counters/link_downed, counters/link_error_recovery, counters/port_xmit_wait,
                     counters/port_rcv_errors}; model from <hca>/hca_type (else board_id)
    per Ethernet NIC <root>/sys/class/net/<if>/{speed, carrier_down_count, statistics/rx_errors}
                     (physical, non-InfiniBand interfaces)
    host             <root>/sys/devices/system/cpu/cpu<N>/thermal_throttle/{core,package}_throttle_count,
                     cpufreq/{scaling_cur_freq, base_frequency | cpuinfo_max_freq} (kHz);
                     CPU model from <root>/proc/cpuinfo

Cost: ~30 NVML calls per GPU and ~10 small file reads per port, plus 3 per CPU, once a minute:
bench/agent_cost.py measures the agent with the sampler on. NVML and the filesystem enter through
the constructor (`nvml=`, `root=`) as in `agents.nvml` and `agents.sysfs`, so tests feed a stand-in
and recorded trees. A counter that goes backwards (reset, driver reload, 32-bit wrap) gives None
for that interval, never a negative delta.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import structlog
from pydantic import BaseModel, ValidationError

from agents.nvml import (
    E_GPU_IS_LOST,
    ERR_CORRECTED,
    NVLINK_COUNTERS,
    TEMPERATURE_GPU,
    VOLATILE,
    _code,
    _nvml_error_type,
    _real_pynvml,
    _text,
    present_nvlinks,
    read_once,
)
from agents.sysfs import _int, _read, parse_rate
from fleetmend import __version__
from fleetmend.telemetry import GpuPerf, HardwareClass, HostPerf, PerfSample, PortPerf

P = TypeVar("P", bound=BaseModel)

# nvml.h values (checked against pynvml in tests)
CLOCK_SM = 1  # NVML_CLOCK_SM
FI_REASON_COUNTERS = {"sw_power_cap": 74, "sw_thermal": 269, "hw_thermal": 270, "power_brake": 271}
"""NVML_FI_DEV_CLOCKS_EVENT_REASON_* field ids: cumulative nanoseconds in that reason."""
VIOLATION_POLICIES = {"sw_power_cap": 0, "sw_thermal": 1}  # NVML_PERF_POLICY_POWER, _THERMAL
REASON_MASK = {"sw_power_cap": 0x4, "hw_slowdown": 0x8, "sw_thermal": 0x20, "hw_thermal": 0x40, "power_brake": 0x80}
"""nvmlClocksEventReason* bits."""
NVLINK_GROUPS = {"crc": ("dl_crc_flit", "dl_crc_data"), "replay": ("dl_replay",), "recovery": ("dl_recovery",)}
IB_COUNTERS = {"symbol_error_delta": "symbol_error", "link_downed_delta": "link_downed",
               "link_error_recovery_delta": "link_error_recovery", "xmit_wait_delta": "port_xmit_wait",
               "rcv_errors_delta": "port_rcv_errors"}
ARPHRD_INFINIBAND = 32
_CPU_DIR = re.compile(r"^cpu\d+$")

Publish = Callable[[PerfSample], Awaitable[None]]


def _delta(prev: dict[Any, int], key: Any, value: int | None) -> int | None:
    """value - previous (None on first sight, unknown value, or a counter that went backwards)."""
    if value is None:
        prev.pop(key, None)
        return None
    last = prev.get(key)
    prev[key] = value
    if last is None or value < last:
        return None
    return value - last


class _Gpu:
    def __init__(self, index: int, handle: Any) -> None:
        self.index, self.handle = index, handle
        self.unsupported: set[str] = set()
        self.links: list[int] | None = None
        self.prev: dict[Any, int] = {}


class PerfSampler:
    """Builds `PerfSample`s (`sample()`, blocking: run it in a thread) and publishes them (`run`).

    Args:
        nvml: the `pynvml` module ("default": import it; None: no GPUs) or a stand-in.
        root: filesystem root the `sys/...` and `proc/cpuinfo` paths are read under.
        cluster, node, agent_version: stamped on samples.
        interval_s: sampling period (seconds, > 0).
        nvml_retry_samples: while nvmlInit fails, retry it every this many samples.
    """

    name = "perf"

    def __init__(self, nvml: Any = "default", root: Path = Path("/"), *, cluster: str = "local",
                 node: str = "localhost", agent_version: str = __version__, interval_s: float = 60.0,
                 nvml_retry_samples: int = 10) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.nvml = _real_pynvml() if nvml == "default" else nvml
        self.NVMLError = _nvml_error_type(self.nvml) if self.nvml is not None else OSError
        self.root = Path(root)
        self.cluster, self.node, self.agent_version = cluster, node, agent_version
        self.interval_s = interval_s
        self.nvml_retry_samples = nvml_retry_samples
        self.gpus: list[_Gpu] = []
        self.initialised = False
        self._init_tries = 0
        self._hw: dict[str, Any] = {}
        self._prev: dict[Any, int] = {}
        self._last_mono: float | None = None
        self._cpu_dirs: list[Path] | None = None
        self._log = structlog.get_logger("fleetmend.agent.perf").bind(cluster=cluster, node=node)
        self._refused: set[str] = set()  # fields already logged by _part

    # ------------------------------------------------------------------ NVML lifecycle

    def _init_nvml(self) -> None:
        if self.initialised or self.nvml is None:
            return
        if self._init_tries % self.nvml_retry_samples:
            self._init_tries += 1
            return
        self._init_tries += 1
        try:
            self.nvml.nvmlInit()
        except (self.NVMLError, OSError) as err:
            self._log.debug("perf_nvml_unavailable", error=str(err))
            return
        self.initialised = True
        try:
            n = int(self.nvml.nvmlDeviceGetCount())
            self.gpus = [_Gpu(i, self.nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(n)]
            if self.gpus:
                with contextlib.suppress(self.NVMLError):
                    self._hw["gpu_model"] = _text(self.nvml.nvmlDeviceGetName(self.gpus[0].handle))
                with contextlib.suppress(self.NVMLError, AttributeError):  # the version findings' fingerprint
                    vbios = self.nvml.nvmlDeviceGetVbiosVersion(self.gpus[0].handle)
                    if isinstance(vbios, (str, bytes)):
                        self._hw["vbios"] = _text(vbios)[:64]
            with contextlib.suppress(self.NVMLError):
                self._hw["driver"] = _text(self.nvml.nvmlSystemGetDriverVersion())
        except self.NVMLError as err:
            self._log.warning("perf_nvml_enumeration_failed", error=str(err))
            self.gpus = []

    def shutdown(self) -> None:
        if self.initialised:
            with contextlib.suppress(self.NVMLError):
                self.nvml.nvmlShutdown()
            self.initialised = False

    # ------------------------------------------------------------------ sampling

    def sample(self, now_mono: float | None = None) -> PerfSample:
        """Read everything once and return the sample (deltas against the previous call).

        `now_mono`: monotonic time of the reading (tests pass it to fix the interval).
        """
        now = time.monotonic() if now_mono is None else now_mono
        interval = self.interval_s if self._last_mono is None else max(1e-3, now - self._last_mono)
        self._last_mono = now
        self._init_nvml()
        gpus = [g for g in (self._gpu(x, interval) for x in self.gpus) if g is not None]
        ports, hca_model = self._ports()
        host = self._host()
        hw = HardwareClass(gpu_model=self._hw.get("gpu_model"), gpu_count=len(self.gpus),
                           driver=self._hw.get("driver"), vbios=self._hw.get("vbios"), hca_model=hca_model,
                           cpu_model=self._cpu_model())
        return PerfSample(cluster=self.cluster, node=self.node, interval_s=round(interval, 3), hw=hw, gpus=gpus,
                          ports=ports, host=host, agent_version=self.agent_version)

    def _read(self, g: _Gpu, what: str, fn: Callable[..., Any] | None, *args: Any) -> Any:
        """One NVML read; None when unsupported (remembered) or failing. GPU_IS_LOST propagates."""
        return read_once(self.NVMLError, g, what, fn, *args)

    def _gpu(self, g: _Gpu, interval: float) -> GpuPerf | None:
        try:
            return self._gpu_reads(g, interval)
        except self.NVMLError as err:
            self._log.debug("perf_gpu_lost", gpu=g.index, error=str(err))
            return None  # the NVML probe reports gpu_fallen_off_bus

    def _part(self, model: type[P], fields: dict[str, Any]) -> P:
        """`model(**fields)`, leaving out any reading the contract refuses (out of range, not finite: a
        driver sentinel such as 0xFFFFFFFF): that reading is unknown for this sample, logged once per
        model and field, and every other reading of the sample still goes out. The analyzer refuses a
        whole sample with such a value, so it must never leave the node."""
        try:
            return model(**fields)
        except ValidationError as err:
            bad = {str(e["loc"][0]) for e in err.errors() if e.get("loc")}
            for name in sorted(bad - self._refused):
                self._log.warning("perf_reading_refused", part=model.__name__, field=name,
                                  value=repr(fields.get(name))[:80])
            self._refused |= bad
            return model(**{k: v for k, v in fields.items() if k not in bad})

    def _gpu_reads(self, g: _Gpu, interval: float) -> GpuPerf:
        nv = self.nvml
        r: dict[str, Any] = {"index": g.index}
        util = self._read(g, "util", nv.nvmlDeviceGetUtilizationRates)
        r["util_pct"] = None if util is None else float(util.gpu)
        clk = self._read(g, "sm_clock", nv.nvmlDeviceGetClockInfo, CLOCK_SM)
        clk_max = self._read(g, "sm_clock_max", nv.nvmlDeviceGetMaxClockInfo, CLOCK_SM)
        r["sm_clock_mhz"] = None if clk is None else float(clk)
        r["sm_clock_max_mhz"] = None if clk_max is None else float(clk_max)
        r["event_frac"] = self._event_frac(g, interval)
        pw = self._read(g, "power", nv.nvmlDeviceGetPowerUsage)
        lim = self._read(g, "power_limit", nv.nvmlDeviceGetEnforcedPowerLimit)
        r["power_w"] = None if pw is None else round(int(pw) / 1000, 1)
        r["power_limit_w"] = None if lim is None else round(int(lim) / 1000, 1)
        t = self._read(g, "temperature", nv.nvmlDeviceGetTemperature, TEMPERATURE_GPU)
        r["temperature_c"] = None if t is None else float(t)
        for key, fn in (("pcie_gen", nv.nvmlDeviceGetCurrPcieLinkGeneration),
                        ("pcie_gen_max", nv.nvmlDeviceGetMaxPcieLinkGeneration),
                        ("pcie_width", nv.nvmlDeviceGetCurrPcieLinkWidth),
                        ("pcie_width_max", nv.nvmlDeviceGetMaxPcieLinkWidth)):
            v = self._read(g, key, fn)
            r[key] = None if v is None else int(v)
        replay = self._read(g, "pcie_replay", getattr(nv, "nvmlDeviceGetPcieReplayCounter", None))
        r["pcie_replay_delta"] = _delta(g.prev, "pcie_replay", None if replay is None else int(replay))
        ecc = self._read(g, "ecc_corrected", nv.nvmlDeviceGetTotalEccErrors, ERR_CORRECTED, VOLATILE)
        r["ecc_corrected_delta"] = _delta(g.prev, "ecc_corrected", None if ecc is None else int(ecc))
        r.update(self._nvlink(g))
        return self._part(GpuPerf, r)

    def _event_frac(self, g: _Gpu, interval: float) -> dict[str, float]:
        nv = self.nvml
        out: dict[str, float] = {}
        counted: set[str] = set()
        fvs = self._read(g, "reason_fields", getattr(nv, "nvmlDeviceGetFieldValues", None),
                         list(FI_REASON_COUNTERS.values()))
        if fvs is not None:
            for (reason, _fid), fv in zip(FI_REASON_COUNTERS.items(), fvs, strict=False):
                if int(getattr(fv, "nvmlReturn", 1)) != 0:
                    continue
                d = _delta(g.prev, ("fi", reason), int(fv.value.ullVal))
                counted.add(reason)
                if d is not None:
                    out[reason] = round(min(1.0, d / (interval * 1e9)), 4)
        for reason, policy in VIOLATION_POLICIES.items():
            if reason in counted:
                continue
            v = self._read(g, f"violation_{reason}", getattr(nv, "nvmlDeviceGetViolationStatus", None), policy)
            if v is None:
                continue
            counted.add(reason)
            d_ns = _delta(g.prev, ("viol", reason), int(v.violationTime))
            d_ref = _delta(g.prev, ("ref", reason), int(v.referenceTime))
            if d_ns is not None and d_ref:
                out[reason] = round(min(1.0, d_ns / (d_ref * 1000)), 4)
        fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
        mask = self._read(g, "reason_mask", fn)
        if mask is not None:
            for reason, bit in REASON_MASK.items():
                if reason not in counted:
                    out[reason] = 1.0 if int(mask) & bit else 0.0
        return out

    def _nvlink(self, g: _Gpu) -> dict[str, Any]:
        nv = self.nvml
        if g.links is None:
            g.links = present_nvlinks(nv, g.handle, self.NVMLError)
        if not g.links:
            return {}
        up = 0
        sums: dict[str, int | None] = {k: 0 for k in NVLINK_GROUPS}
        for link in g.links:
            try:
                up += 1 if int(nv.nvmlDeviceGetNvLinkState(g.handle, link)) else 0
            except self.NVMLError as err:
                if _code(err) == E_GPU_IS_LOST:
                    raise
            for group, names in NVLINK_GROUPS.items():
                for cname in names:
                    try:
                        v: int | None = int(nv.nvmlDeviceGetNvLinkErrorCounter(g.handle, link, NVLINK_COUNTERS[cname]))
                    except self.NVMLError as err:
                        if _code(err) == E_GPU_IS_LOST:
                            raise
                        v = None
                    d = _delta(g.prev, (link, cname), v)
                    cur = sums[group]
                    sums[group] = None if d is None or cur is None else cur + d
        return {"nvlink_up": up, "nvlink_total": len(g.links), "nvlink_crc_delta": sums["crc"],
                "nvlink_replay_delta": sums["replay"], "nvlink_recovery_delta": sums["recovery"]}

    # ------------------------------------------------------------------ sysfs

    def _ports(self) -> tuple[list[PortPerf], str | None]:
        ports: list[PortPerf] = []
        models: list[str] = []
        base = self.root / "sys" / "class" / "infiniband"
        for port_dir in sorted(base.glob("*/ports/*")) if base.is_dir() else []:
            hca = port_dir.parts[-3]
            if _int(port_dir.name) is None:
                continue
            if hca not in self._hw.setdefault("hca_models", {}):
                self._hw["hca_models"][hca] = _read(base / hca / "hca_type") or _read(base / hca / "board_id")
            if self._hw["hca_models"][hca]:
                models.append(self._hw["hca_models"][hca])
            name = f"{hca}/{port_dir.name}"
            rate = parse_rate(_read(port_dir / "rate"))
            r: dict[str, Any] = {"name": name, "kind": "ib", "rate_gbps": rate[0] if rate else None,
                                 "width": rate[1] if rate else None}
            for field, counter in IB_COUNTERS.items():
                r[field] = _delta(self._prev, (name, counter), _int(_read(port_dir / "counters" / counter)))
            ports.append(self._part(PortPerf, r))
        ports = self._with_roles(ports)
        net = self.root / "sys" / "class" / "net"
        for d in sorted(net.iterdir()) if net.is_dir() else []:
            if not (d / "device").exists() or _int(_read(d / "type")) == ARPHRD_INFINIBAND:
                continue
            speed = _int(_read(d / "speed"))
            ports.append(self._part(PortPerf, dict(
                name=d.name, kind="nic", rate_gbps=speed / 1000 if speed and speed > 0 else None,
                link_downed_delta=_delta(self._prev, (d.name, "carrier_down"), _int(_read(d / "carrier_down_count"))),
                rcv_errors_delta=_delta(self._prev, (d.name, "rx_errors"), _int(_read(d / "statistics" / "rx_errors"))))))
        return ports, (",".join(sorted(set(models))) or None)

    def _with_roles(self, ports: list[PortPerf]) -> list[PortPerf]:
        """IB ports of the node's most common HCA model are `compute` (the GPUs' rails, one HCA per
        GPU or two), the others `storage` (a front-end HCA of another model); one model: all compute."""
        models: dict[str, str | None] = self._hw.get("hca_models", {})
        count: dict[str, int] = {}
        for p in ports:
            m = models.get(p.name.split("/", 1)[0])
            if m:
                count[m] = count.get(m, 0) + 1
        if len(count) < 2:
            return [p.model_copy(update={"role": "compute"}) for p in ports]
        top = max(count.values())
        rails = {m for m, n in count.items() if n == top}
        return [p.model_copy(update={"role": "compute" if models.get(p.name.split("/", 1)[0]) in rails
                                     else "storage"}) for p in ports]

    def _host(self) -> HostPerf:
        if self._cpu_dirs is None:
            base = self.root / "sys" / "devices" / "system" / "cpu"
            self._cpu_dirs = sorted((d for d in base.iterdir() if _CPU_DIR.match(d.name)),
                                    key=lambda d: int(d.name[3:])) if base.is_dir() else []
        throttle: int | None = 0
        seen_throttle = False
        cur: list[int] = []
        nominal: list[int] = []
        for d in self._cpu_dirs:
            for f in ("core_throttle_count", "package_throttle_count"):
                v = _int(_read(d / "thermal_throttle" / f))
                if v is None:
                    continue
                seen_throttle = True
                dv = _delta(self._prev, (d.name, f), v)
                throttle = None if dv is None or throttle is None else throttle + dv
            c = _int(_read(d / "cpufreq" / "scaling_cur_freq"))
            if c:
                cur.append(c)
                n = _int(_read(d / "cpufreq" / "base_frequency")) or _int(_read(d / "cpufreq" / "cpuinfo_max_freq"))
                if n:
                    nominal.append(n)
        return self._part(HostPerf, dict(
            cpus=len(self._cpu_dirs) or None, cpu_throttle_delta=throttle if seen_throttle else None,
            cpu_freq_mhz=round(sum(cur) / len(cur) / 1000, 1) if cur else None,
            cpu_freq_nominal_mhz=round(sum(nominal) / len(nominal) / 1000, 1) if nominal else None))

    def _cpu_model(self) -> str | None:
        if "cpu_model" not in self._hw:
            model = None
            text = _read(self.root / "proc" / "cpuinfo") or ""
            for line in text.splitlines():
                k, _, v = line.partition(":")
                if k.strip() in ("model name", "Model name", "cpu model"):
                    model = re.sub(r"\s+", " ", v.strip()) or None
                    break
            self._hw["cpu_model"] = model
        return self._hw["cpu_model"]

    # ------------------------------------------------------------------ loop

    async def run(self, publish: Publish, stop: asyncio.Event | None = None) -> None:
        """Sample every `interval_s` (the first after one interval, so deltas exist) and `await
        publish(sample)` until cancelled or `stop` is set. A failing publish is logged, never fatal."""
        stop = stop or asyncio.Event()
        try:
            await asyncio.to_thread(self.sample)  # baseline for the counters
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.interval_s):
                        await stop.wait()
                if stop.is_set():
                    break
                s = await asyncio.to_thread(self.sample)
                try:
                    await publish(s)
                except Exception as err:  # noqa: BLE001 - telemetry is best effort; the next sample retries
                    self._log.debug("perf_publish_failed", error=repr(err))
        finally:
            self.shutdown()
