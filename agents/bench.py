"""The agent's side of `fleetmend sweep`: a short benchmark whose numbers are compared across nodes.

Answered on the diag subject (`BenchRequest` → `BenchReport`), one run at a time per node (the
diagnostics hardware lock). What it measures, in this order, each within what is left of the
request's deadline:

    mem_copy_gbps       copy of a 64 MiB buffer (memoryview slice assignment, memcpy underneath),
                        GB/s: memory bandwidth as one core sees it
    cpu_sha256_mbps     SHA-256 over 1 MiB blocks, MB/s: single-core integer throughput
    cpu_zlib_mbps       zlib level 6 over 1 MiB of mixed data, MB/s: branchy single-core work
    gpu_*               with NVML: per GPU SM clock / max (`gpu_sm_clock_ratio_min`), PCIe width
                        ratio (`gpu_pcie_width_ratio_min`), number of GPUs (`gpu_count`), as they are
    <site names>        `agent.bench_command`: its stdout is one JSON object of named numbers
                        (higher is better unless the name says otherwise, `fleetmend.sweep`)
    gpu_load_*          the same GPUs under load (`gpu_load_step`): a load generator
                        (`agent.gpu_load_command`, else `gpu_burn` or `dcgmproftester13/12/11` found
                        on PATH) runs while NVML is sampled; see `LoadStats.metrics`
    nvbandwidth_*       `agent.nvbandwidth_command` when its program is on PATH: the slowest link of
                        each measured matrix (agents.parsers.nvbandwidth)
    dcgm_*              `agent.sweep_dcgm_command` (default `dcgmi diag -r pcie -j -v`) when dcgmi is
                        on PATH: the numbers in the tests' info lines (agents.parsers.dcgm.diag_json_metrics)

The site command runs before the GPU tools: it is what the operator asked for, the tools are
opportunistic and take what is left of the deadline. The GPU tools run only where NVML found GPUs.
Standard library only (no numpy): the agent's footprint stays as it is. A check that cannot run, or
ran and failed, is listed in `skipped` with the reason (a missing tool too, never silently); the
report is always sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import os
import shutil
import signal
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import structlog

from agents.commands import run_command, tail
from agents.nvml import TEMPERATURE_GPU, THRESHOLD_SLOWDOWN, _nvml_error_type, read_once
from fleetmend import __version__
from fleetmend.diagnostics import BenchReport, BenchRequest
from fleetmend.events import utcnow

log = structlog.get_logger("fleetmend.agent.bench")

MEM_BUFFER_BYTES = 64 * 1024 * 1024
BENCH_OUTPUT_MAX_BYTES = 1024 * 1024
"""Output of the site benchmark kept (its last MiB: the last JSON line wins); more is read and let go,
so a benchmark printing 300 MB costs the agent 1 MiB, and the report says it was clipped."""
MAX_SITE_METRICS = 256
"""Named numbers taken from the site benchmark (the first ones, by name); the rest are noted in `skipped`."""
METRIC_NAME_MAX = 80
HOST_CHECK_RUNS = 3
"""The built-in host checks run this many times and report the best run (background load only ever
slows a run down); how far apart the runs were goes in `BenchReport.noise_pct`."""


def mem_copy_gbps(seconds: float) -> float:
    src = bytearray(os.urandom(1024)) * (MEM_BUFFER_BYTES // 1024)
    dst = bytearray(MEM_BUFFER_BYTES)
    mv_src, mv_dst = memoryview(src), memoryview(dst)
    n, t0 = 0, time.perf_counter()
    while True:
        mv_dst[:] = mv_src
        n += 1
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return round(n * MEM_BUFFER_BYTES / dt / 1e9, 3)


def cpu_sha256_mbps(seconds: float) -> float:
    block = os.urandom(1024 * 1024)
    n, t0 = 0, time.perf_counter()
    while True:
        hashlib.sha256(block).digest()
        n += 1
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return round(n / dt, 2)


def cpu_zlib_mbps(seconds: float) -> float:
    block = (os.urandom(512 * 1024) + b"fleetmend " * 52429)[: 1024 * 1024]
    n, t0 = 0, time.perf_counter()
    while True:
        zlib.compress(block, 6)
        n += 1
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return round(n / dt, 2)


def gpu_metrics(nvml: Any) -> tuple[dict[str, float], str | None]:
    """(metrics, why skipped) from NVML; ({}, reason) without a driver or GPUs."""
    if nvml is None:
        return {}, "pynvml not installed"
    try:
        nvml.nvmlInit()
    except Exception as err:  # noqa: BLE001 - NVMLError_LibraryNotFound on a CPU node
        return {}, f"no NVIDIA driver on this host ({err})"
    try:
        n = int(nvml.nvmlDeviceGetCount())
        if n == 0:
            return {}, "no GPUs"
        clocks, widths = [], []
        for i in range(n):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            try:
                clocks.append(float(nvml.nvmlDeviceGetClockInfo(h, 1)) / float(nvml.nvmlDeviceGetMaxClockInfo(h, 1)))
            except Exception:  # noqa: BLE001 - not supported on this GPU
                pass
            try:
                widths.append(int(nvml.nvmlDeviceGetCurrPcieLinkWidth(h)) / int(nvml.nvmlDeviceGetMaxPcieLinkWidth(h)))
            except Exception:  # noqa: BLE001
                pass
        out: dict[str, float] = {"gpu_count": float(n)}
        if clocks:
            out["gpu_sm_clock_ratio_min"] = round(min(clocks), 4)
        if widths:
            out["gpu_pcie_width_ratio_min"] = round(min(widths), 4)
        return out, None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


CLOCK_SM = 1  # NVML_CLOCK_SM
LOAD_REASONS = {"hw_slowdown": 0x8, "thermal": 0x20 | 0x40, "power_brake": 0x80, "sw_power_cap": 0x4}
"""Clocks-event reasons the load step counts (nvmlClocksEventReason* bits; thermal = SW or HW thermal slowdown)."""
LOAD_BUSY_UTIL_PCT = 50.0
"""The sampling window opens once every GPU reports at least this utilization (the generator has
started its kernels: CUDA init and allocation take seconds, idle clocks must not be counted)."""
LOAD_START_MAX_S = 30.0
"""How long the load generator may take to make every GPU busy before the step gives up."""
LOAD_SAMPLE_S = 0.2
"""NVML sampling period during the load (5 samples a second; each sample ~6 NVML calls per GPU)."""
LOAD_STOP_GRACE_S = 5.0
WELL_KNOWN_LOADS: dict[str, list[str]] = {
    "gpu_burn": ["gpu_burn", "{seconds}"],
    "dcgmproftester13": ["dcgmproftester13", "--no-dcgm-validation", "-t", "1004", "-d", "{seconds}"],
    "dcgmproftester12": ["dcgmproftester12", "--no-dcgm-validation", "-t", "1004", "-d", "{seconds}"],
    "dcgmproftester11": ["dcgmproftester11", "--no-dcgm-validation", "-t", "1004", "-d", "{seconds}"],
}
"""Load generators used when `agent.gpu_load_command` is unset, first found on PATH wins: gpu-burn
(`gpu_burn [TIME]`, matrix multiplies on every GPU) and DCGM's `dcgmproftester<CUDA major>` (field
1004, DCGM_FI_PROF_PIPE_TENSOR_ACTIVE: tensor-core load on every GPU; `-d` seconds). `{seconds}` in an
argv is replaced by how long the generator should run (the step stops it once it has sampled)."""
DEFAULT_NVBANDWIDTH = ["nvbandwidth", "-t", "host_to_device_memcpy_ce", "device_to_host_memcpy_ce",
                       "device_to_device_memcpy_read_ce"]
"""PCIe both ways and NVLink (or PCIe peer) reads: 3 testcases, seconds on an 8-GPU node."""
DEFAULT_DCGM = ["dcgmi", "diag", "-r", "pcie", "-j", "-v"]
"""DCGM's PCIe test alone: host↔GPU bandwidth and latency per GPU in its info lines (a run level
such as `-r 2` adds memory and takes ~2 min)."""


@dataclass
class GpuTools:
    """What the GPU steps run (the agent's `agent.gpu_load_command`, `gpu_load_seconds`,
    `nvbandwidth_command`, `sweep_dcgm_command`). `load_command` None: a well-known generator on
    PATH; []: the load step is off. An empty tool argv turns that tool off (said in `skipped`).
    `bench_timeout_s` (`agent.bench_timeout_s`): bounds the whole run, whatever the request's deadline."""

    load_command: list[str] | None = None
    load_seconds: float = 10.0
    bench_timeout_s: float | None = None
    nvbandwidth_command: list[str] = field(default_factory=lambda: list(DEFAULT_NVBANDWIDTH))
    dcgm_command: list[str] = field(default_factory=lambda: list(DEFAULT_DCGM))


def load_command(configured: list[str] | None, which: Any = shutil.which) -> tuple[list[str] | None, str]:
    """(argv, where it came from) for the load step, or (None, why there is none)."""
    if configured is not None:
        if not configured:
            return None, "turned off (agent.gpu_load_command = [])"
        return list(configured), "agent.gpu_load_command"
    for name, argv in WELL_KNOWN_LOADS.items():
        path = which(name)
        if path:
            return [path, *argv[1:]], f"{name} found on PATH ({path})"
    return None, ("no load generator: agent.gpu_load_command is not set and none of "
                  f"{', '.join(WELL_KNOWN_LOADS)} is on PATH; clocks were read idle only")


@dataclass
class _LoadGpu:
    index: int
    handle: Any
    unsupported: set[str] = field(default_factory=set)
    clock_ratios: list[float] = field(default_factory=list)
    reason_hits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOAD_REASONS, 0))
    reason_samples: int = 0
    power_w: list[float] = field(default_factory=list)
    limit_w: float | None = None
    default_limit_w: float | None = None
    temp_max_c: float | None = None
    slowdown_c: float | None = None


class LoadStats:
    """NVML readings of every GPU while the load generator runs (blocking calls: run each in a thread).

    `metrics()`, each the minimum over the GPUs (the worst GPU), all higher-is-better under
    `fleetmend.sweep.lower_is_better`:

        gpu_load_sm_clock_ratio_min        mean SM clock / max SM clock over the window
        gpu_load_<reason>_free_min         fraction of samples without that clocks-event reason
                                           (hw_slowdown, thermal, power_brake, sw_power_cap); a GPU
                                           in power brake a fifth of the time gives 0.8
        gpu_load_power_ratio_min           mean power draw / enforced power limit
        gpu_load_power_limit_ratio_min     enforced limit / default limit (a GPU capped by hand)
        gpu_load_temp_headroom_c_min       slowdown threshold - hottest reading, °C; the most
                                           sensitive of these to the 5 % rule (a few °C apart on a
                                           25 °C margin), read it with the reasons beside it

    A reading the GPU does not support is left out (`agents.nvml.read_once`).
    Raises (from the read methods): NVMLError with NVML_ERROR_GPU_IS_LOST.
    """

    def __init__(self, nvml: Any) -> None:
        self.nv = nvml
        self.err = _nvml_error_type(nvml)
        self.gpus: list[_LoadGpu] = []
        self.samples = 0

    def open(self) -> str | None:
        """nvmlInit and the GPUs' handles and limits; returns why not, or None."""
        nv = self.nv
        try:
            nv.nvmlInit()
        except Exception as err:  # noqa: BLE001 - no driver on a CPU node
            return f"no NVIDIA driver on this host ({err})"
        n = int(nv.nvmlDeviceGetCount())
        self.gpus = [_LoadGpu(i, nv.nvmlDeviceGetHandleByIndex(i)) for i in range(n)]
        for g in self.gpus:
            lim = read_once(self.err, g, "limit", nv.nvmlDeviceGetEnforcedPowerLimit)
            g.limit_w = None if lim is None else int(lim) / 1000
            dflt = read_once(self.err, g, "default_limit",
                             getattr(nv, "nvmlDeviceGetPowerManagementDefaultLimit", None))
            g.default_limit_w = None if dflt is None else int(dflt) / 1000
            t = read_once(self.err, g, "slowdown", nv.nvmlDeviceGetTemperatureThreshold, THRESHOLD_SLOWDOWN)
            g.slowdown_c = None if t is None else float(t)
        return None if self.gpus else "no GPUs"

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.nv.nvmlShutdown()

    def utilization(self) -> list[float | None]:
        out = []
        for g in self.gpus:
            u = read_once(self.err, g, "util", self.nv.nvmlDeviceGetUtilizationRates)
            out.append(None if u is None else float(u.gpu))
        return out

    def sample(self) -> None:
        nv, err = self.nv, self.err
        mask_fn = (getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
                   or getattr(nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None))
        for g in self.gpus:
            clk = read_once(err, g, "sm_clock", nv.nvmlDeviceGetClockInfo, CLOCK_SM)
            mx = read_once(err, g, "sm_clock_max", nv.nvmlDeviceGetMaxClockInfo, CLOCK_SM)
            if clk is not None and mx:
                g.clock_ratios.append(float(clk) / float(mx))
            mask = read_once(err, g, "reasons", mask_fn)
            if mask is not None:
                g.reason_samples += 1
                for reason, bits in LOAD_REASONS.items():
                    g.reason_hits[reason] += 1 if int(mask) & bits else 0
            pw = read_once(err, g, "power", nv.nvmlDeviceGetPowerUsage)
            if pw is not None:
                g.power_w.append(int(pw) / 1000)
            t = read_once(err, g, "temperature", nv.nvmlDeviceGetTemperature, TEMPERATURE_GPU)
            if t is not None:
                g.temp_max_c = float(t) if g.temp_max_c is None else max(g.temp_max_c, float(t))
        self.samples += 1

    def metrics(self) -> dict[str, float]:
        per: dict[str, list[float]] = {}
        for g in self.gpus:
            if g.clock_ratios:
                per.setdefault("gpu_load_sm_clock_ratio_min", []).append(sum(g.clock_ratios) / len(g.clock_ratios))
            if g.reason_samples:
                for reason, hits in g.reason_hits.items():
                    per.setdefault(f"gpu_load_{reason}_free_min", []).append(1 - hits / g.reason_samples)
            if g.power_w and g.limit_w:
                per.setdefault("gpu_load_power_ratio_min", []).append(sum(g.power_w) / len(g.power_w) / g.limit_w)
            if g.limit_w and g.default_limit_w:
                per.setdefault("gpu_load_power_limit_ratio_min", []).append(g.limit_w / g.default_limit_w)
            if g.temp_max_c is not None and g.slowdown_c:
                per.setdefault("gpu_load_temp_headroom_c_min", []).append(g.slowdown_c - g.temp_max_c)
        return {k: round(min(v), 4) for k, v in per.items()}


async def _stop_group(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM the generator's process group (gpu_burn forks one process per GPU), SIGKILL after
    `LOAD_STOP_GRACE_S`."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        async with asyncio.timeout(LOAD_STOP_GRACE_S):
            await proc.wait()
    except TimeoutError:
        pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    await proc.wait()


def _out_tail(f: Any) -> str:
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(max(0, size - 300))
    return " ".join(f.read().decode(errors="replace").split())


async def gpu_load_step(nvml: Any, argv: list[str], seconds: float,
                        budget_s: float) -> tuple[dict[str, float], str | None]:
    """Run the load generator `argv` (`{seconds}` replaced), wait until every GPU is busy (at most
    `LOAD_START_MAX_S`), sample NVML every `LOAD_SAMPLE_S` for `seconds`, stop the generator.
    Returns (`LoadStats.metrics()`, None) or ({}, why not). Never blocks the event loop (NVML reads in
    a thread, the generator a subprocess in its own session, its output in a temporary file)."""
    need = seconds + 3
    if budget_s < need:
        return {}, (f"deadline: {budget_s:.0f} s left, the load step needs about {need:.0f} s "
                    "(give the sweep a longer --deadline)")
    stats = LoadStats(nvml)
    try:
        why = await asyncio.to_thread(stats.open)
    except Exception as err:  # noqa: BLE001 - NVMLError enumerating GPUs: said, not raised
        why = f"NVML failed while listing the GPUs: {err}"
    if why:
        await asyncio.to_thread(stats.close)
        return {}, why
    start_limit = min(LOAD_START_MAX_S, budget_s - seconds - 1)
    run_s = str(math.ceil(start_limit + seconds + LOAD_STOP_GRACE_S))
    argv = [a.replace("{seconds}", run_s) for a in argv]
    out = tempfile.TemporaryFile()
    try:
        try:
            proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL, stdout=out,
                                                        stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        except OSError as err:
            return {}, f"cannot start {argv[0]}: {err}"
        try:
            t0 = time.monotonic()
            while True:
                if proc.returncode is not None:
                    return {}, f"{argv[0]} exited ({proc.returncode}) before the GPUs were busy: {_out_tail(out)}"
                util = await asyncio.to_thread(stats.utilization)
                if all(u is not None and u >= LOAD_BUSY_UTIL_PCT for u in util):
                    break
                if time.monotonic() - t0 > start_limit:
                    return {}, (f"GPUs not busy {start_limit:.0f} s after starting {argv[0]} (utilization "
                                f"{util} %, wanted ≥ {LOAD_BUSY_UTIL_PCT:g} on every GPU)")
                await asyncio.sleep(LOAD_SAMPLE_S)
            w0 = time.monotonic()
            while time.monotonic() - w0 < seconds:
                await asyncio.to_thread(stats.sample)
                if proc.returncode is not None:
                    return {}, (f"{argv[0]} exited ({proc.returncode}) {time.monotonic() - w0:.1f} s into the "
                                f"{seconds:g} s window: {_out_tail(out)}")
                await asyncio.sleep(LOAD_SAMPLE_S)
            return stats.metrics(), None
        except stats.err as err:  # GPU_IS_LOST (read_once passes only that on)
            return {}, f"a GPU was lost during the load step ({err}); the NVML probe reports it"
        finally:
            await _stop_group(proc)
    finally:
        out.close()
        await asyncio.to_thread(stats.close)


async def _tool(argv: list[str], budget_s: float) -> tuple[int, str] | str:
    """Run a measurement tool within `budget_s`: (exit code, output) or why it gave nothing."""
    if budget_s <= 1:
        return f"deadline: {max(budget_s, 0):.0f} s left (give the sweep a longer --deadline)"
    try:
        res = await run_command(argv, budget_s - 0.5)
    except OSError as err:
        return f"cannot start {argv[0]}: {err}"
    if res is None:
        return f"did not finish within {budget_s - 0.5:.0f} s (killed)"
    return res[0], res[1].decode(errors="replace")


async def nvbandwidth_step(argv: list[str], budget_s: float) -> tuple[dict[str, float], dict[str, str]]:
    """nvbandwidth's matrices → `nvbandwidth_<matrix key>_gbps|_ns` (agents.parsers.nvbandwidth);
    waived and failed testcases, a missing binary or a non-zero exit → skipped."""
    from agents.parsers import nvbandwidth  # lazy: `agents.parsers` (every tool parser) only for a sweep

    if not argv:
        return {}, {"nvbandwidth": "turned off (agent.nvbandwidth_command = [])"}
    if not shutil.which(argv[0]):
        return {}, {"nvbandwidth": f"{argv[0]} not on PATH (agent.nvbandwidth_command)"}
    res = await _tool(argv, budget_s)
    if isinstance(res, str):
        return {}, {"nvbandwidth": res}
    rc, text = res
    parsed = nvbandwidth.parse(text)
    metrics = nvbandwidth.metrics(parsed)
    skipped = {f"nvbandwidth_{k}": "waived by nvbandwidth (not possible on this system)" for k in parsed.waived}
    skipped.update({f"nvbandwidth_{k}": f"nvbandwidth: {v[:300]}" for k, v in parsed.errors.items()})
    if rc != 0:
        skipped["nvbandwidth"] = f"exit {rc}: {tail(text.encode())[-300:]}"
    elif not metrics and not skipped:
        skipped["nvbandwidth"] = f"no bandwidth matrix in its output: {text[-300:]!r}"
    return metrics, skipped


async def dcgm_step(argv: list[str], budget_s: float) -> tuple[dict[str, float], dict[str, str]]:
    """`dcgmi diag ... -j` → `dcgm_<test>_<quantity>` (agents.parsers.dcgm.diag_json_metrics); a test
    that did not pass, a missing dcgmi or unreadable output → skipped. dcgmi exits non-zero when a
    test fails, so its JSON is read whatever the exit code."""
    from agents.parsers.dcgm import diag_json_metrics  # lazy: `agents.parsers` only for a sweep

    if not argv:
        return {}, {"dcgm": "turned off (agent.sweep_dcgm_command = [])"}
    if not shutil.which(argv[0]):
        return {}, {"dcgm": f"{argv[0]} not on PATH (agent.sweep_dcgm_command)"}
    res = await _tool(argv, budget_s)
    if isinstance(res, str):
        return {}, {"dcgm": res}
    rc, text = res
    try:
        return diag_json_metrics(text)
    except ValueError as err:
        return {}, {"dcgm": f"exit {rc}: {err}"}


def parse_site_output(text: str) -> tuple[dict[str, float], dict[str, str]]:
    """The bench command's stdout: one JSON object of named numbers (the last JSON line wins, so a
    tool that prints progress first still works). Returns (metrics, skipped): one bad metric (not
    a finite number, an overlong name) skips that metric only, named in skipped as
    `bench_command.<name>`; beyond `MAX_SITE_METRICS` the rest are skipped with one note.
    Raises ValueError when there is no JSON object at all."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip().startswith("{")]
    if not lines:
        raise ValueError(f"no JSON object on stdout: {text[-300:]!r}")
    try:
        data = json.loads(lines[-1])
    except (json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"last JSON line does not parse: {err}") from None
    if not isinstance(data, dict):
        raise ValueError("stdout is JSON but not an object")
    out: dict[str, float] = {}
    skipped: dict[str, str] = {}
    for k, v in data.items():
        name = str(k)
        if len(name) > METRIC_NAME_MAX or not name:
            skipped[f"bench_command.{name[:40]}"] = f"metric name longer than {METRIC_NAME_MAX} characters or empty"
        elif isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
            skipped[f"bench_command.{name}"] = f"{str(v)[:40]!r} is not a finite number"
        elif len(out) >= MAX_SITE_METRICS:
            skipped["bench_command.clipped"] = (f"{len(data)} metrics; the first {MAX_SITE_METRICS} kept "
                                                f"(agents.bench.MAX_SITE_METRICS)")
        else:
            out[name] = float(v)
        if len(skipped) > 32:
            skipped["bench_command.more"] = "more bad metrics not listed"
            break
    return out, skipped


async def run_capped(argv: list[str], timeout_s: float,
                     max_bytes: int = BENCH_OUTPUT_MAX_BYTES) -> tuple[int, bytes, int] | None:
    """Run `argv` (no shell, its own session), stdout and stderr together, keeping only the last
    `max_bytes` of its output. Returns (exit code, output kept, bytes it wrote), or None when it ran
    past `timeout_s` (its whole process group is killed: a benchmark's children cannot keep it
    running). Raises OSError when it cannot be started."""
    proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                                                start_new_session=True)
    assert proc.stdout is not None
    kept = bytearray()
    total = 0
    try:
        async with asyncio.timeout(timeout_s):
            while chunk := await proc.stdout.read(65536):
                total += len(chunk)
                kept += chunk
                if len(kept) > 2 * max_bytes:
                    del kept[:len(kept) - max_bytes]
            rc = await proc.wait()
    except TimeoutError:
        await _stop_group(proc)
        return None
    return rc, bytes(kept[-max_bytes:]), total


async def run_bench(req: BenchRequest, *, cluster: str, node: str, nvml: Any = None,
                    bench_command: list[str] | None = None, tools: GpuTools | None = None) -> BenchReport:
    """Run the built-in checks, the site command and the GPU tools within `req.deadline_s` (module
    docstring for the order). Returns the report."""
    started = utcnow()
    tools = tools or GpuTools()
    budget_s = req.deadline_s if tools.bench_timeout_s is None else min(req.deadline_s, tools.bench_timeout_s)
    deadline = time.monotonic() + budget_s
    metrics: dict[str, float] = {}
    skipped: dict[str, str] = {}
    noise: dict[str, float] = {}
    builtin = (("mem_copy_gbps", mem_copy_gbps), ("cpu_sha256_mbps", cpu_sha256_mbps),
               ("cpu_zlib_mbps", cpu_zlib_mbps)) if req.builtin else ()
    run_s = req.host_seconds / HOST_CHECK_RUNS
    for name, fn in builtin:
        if deadline - time.monotonic() < req.host_seconds + 1:
            skipped[name] = "deadline"
            continue
        runs = [await asyncio.to_thread(fn, run_s) for _ in range(HOST_CHECK_RUNS)]
        metrics[name] = max(runs)  # best of N: background load only ever slows a run down
        if metrics[name] > 0:
            noise[name] = round(100 * (max(runs) - min(runs)) / max(runs), 2)
    has_gpus = False
    if req.builtin:
        gm, why = await asyncio.to_thread(gpu_metrics, nvml)
        metrics.update(gm)
        has_gpus = "gpu_count" in gm
        if why:
            skipped["gpu"] = why
    if bench_command:
        left = deadline - time.monotonic()
        if left <= 1:
            skipped["bench_command"] = "deadline"
        else:
            try:
                res = await run_capped(bench_command, left - 0.5)
            except OSError as err:
                res = None
                skipped["bench_command"] = f"cannot start {bench_command[0]}: {err}"
            if res is None:
                skipped.setdefault("bench_command", f"did not finish within {left - 0.5:.0f} s "
                                                    "(agent.bench_timeout_s or the sweep's --deadline; killed)")
            elif res[0] != 0:
                skipped["bench_command"] = f"exit {res[0]}: {tail(res[1])[-300:]}"
            else:
                if res[2] > len(res[1]):
                    skipped["bench_command.output"] = (f"wrote {res[2]} bytes; its last {len(res[1])} were read "
                                                       "(agents.bench.BENCH_OUTPUT_MAX_BYTES)")
                try:
                    site, bad = parse_site_output(res[1].decode(errors="replace"))
                    metrics.update(site)
                    skipped.update(bad)
                except ValueError as err:
                    skipped["bench_command"] = f"bad output: {err}"
    if req.builtin and not has_gpus:
        for step in ("gpu_load", "nvbandwidth", "dcgm"):
            skipped[step] = "no GPUs on this node (see 'gpu')"
    elif req.builtin:
        argv, source = load_command(tools.load_command)
        if argv is None:
            skipped["gpu_load"] = source
        else:
            try:
                lm, why = await gpu_load_step(nvml, argv, tools.load_seconds, deadline - time.monotonic())
            except Exception as err:  # a bug or odd NVML must not cost the whole report
                log.exception("bench_gpu_load_failed")
                lm, why = {}, f"failed: {err!r}"
            metrics.update(lm)
            if why:
                skipped["gpu_load"] = f"{why} [load: {source}]"
            else:
                log.info("bench_gpu_load_done", load=source, metrics=len(lm))
        for step, step_fn, argv_ in (("nvbandwidth", nvbandwidth_step, tools.nvbandwidth_command),
                                     ("dcgm", dcgm_step, tools.dcgm_command)):
            try:
                m, sk = await step_fn(argv_, deadline - time.monotonic())
            except Exception as err:  # as above
                log.exception("bench_step_failed", step=step)
                m, sk = {}, {step: f"failed: {err!r}"}
            metrics.update(m)
            skipped.update(sk)
    return BenchReport(node=node, cluster=cluster, sweep_id=req.sweep_id, metrics=metrics, skipped=skipped,
                       noise_pct=noise, started_at=started, finished_at=utcnow(), agent_version=__version__)


async def answer_bench(responder: Any, msg: Any) -> None:
    """Answer one bench request on the responder's subject (one run at a time with diagnostics)."""
    try:
        req = BenchRequest.model_validate_json(msg.data)
    except ValueError as err:
        rep = BenchReport(node=responder.node, cluster=responder.cluster,
                          skipped={"request": f"bad bench request: {str(err)[:300]}"}, agent_version=__version__)
    else:
        log.info("bench_requested", sweep_id=req.sweep_id, deadline_s=req.deadline_s)
        async with responder._hw_lock:
            rep = await run_bench(req, cluster=responder.cluster, node=responder.node, nvml=responder.nvml,
                                  bench_command=getattr(responder, "bench_command", None),
                                  tools=getattr(responder, "gpu_tools", None))
        log.info("bench_answered", sweep_id=req.sweep_id, metrics=len(rep.metrics), skipped=list(rep.skipped))
    if msg.reply:
        await msg.respond(rep.model_dump_json().encode())
