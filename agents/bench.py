"""The agent's side of `fleetmend sweep`: a short benchmark whose numbers are compared across nodes.

Answered on the diag subject (`BenchRequest` → `BenchReport`), one run at a time per node (the
diagnostics hardware lock). What it measures, each within `host_seconds`:

    mem_copy_gbps       copy of a 64 MiB buffer (memoryview slice assignment, memcpy underneath),
                        GB/s: memory bandwidth as one core sees it
    cpu_sha256_mbps     SHA-256 over 1 MiB blocks, MB/s: single-core integer throughput
    cpu_zlib_mbps       zlib level 6 over 1 MiB of mixed data, MB/s: branchy single-core work
    gpu_*               with NVML: per GPU SM clock / max (`gpu_sm_clock_ratio_min`), PCIe width
                        ratio (`gpu_pcie_width_ratio_min`), number of GPUs (`gpu_count`); a sustained
                        load step needs a load generator (PyTorch), which the agent does not ship,
                        so clocks are read as they are (idle GPUs of one model compare equally)
    <site names>        `agent.bench_command`: its stdout is one JSON object of named numbers
                        (higher is better unless the name says otherwise, `fleetmend.sweep`)

Standard library only (no numpy): the agent's footprint stays as it is. A check that cannot run is
listed in `skipped` with the reason; the report is always sent.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
import zlib
from typing import Any

import structlog

from agents.commands import run_command, tail
from fleetmend import __version__
from fleetmend.diagnostics import BenchReport, BenchRequest
from fleetmend.events import utcnow

log = structlog.get_logger("fleetmend.agent.bench")

MEM_BUFFER_BYTES = 64 * 1024 * 1024


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


def parse_site_output(text: str) -> dict[str, float]:
    """The bench command's stdout: one JSON object of named numbers (the last JSON line wins, so a
    tool that prints progress first still works). Raises ValueError naming what is wrong."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip().startswith("{")]
    if not lines:
        raise ValueError(f"no JSON object on stdout: {text[-300:]!r}")
    data = json.loads(lines[-1])
    if not isinstance(data, dict):
        raise ValueError("stdout is JSON but not an object")
    out = {}
    for k, v in data.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{k!r} is {type(v).__name__}, expected a number")
        out[str(k)] = float(v)
    return out


async def run_bench(req: BenchRequest, *, cluster: str, node: str, nvml: Any = None,
                    bench_command: list[str] | None = None) -> BenchReport:
    """Run the built-in checks and the site command within `req.deadline_s`. Returns the report."""
    started = utcnow()
    deadline = time.monotonic() + req.deadline_s
    metrics: dict[str, float] = {}
    skipped: dict[str, str] = {}
    builtin = (("mem_copy_gbps", mem_copy_gbps), ("cpu_sha256_mbps", cpu_sha256_mbps),
               ("cpu_zlib_mbps", cpu_zlib_mbps)) if req.builtin else ()
    for name, fn in builtin:
        if deadline - time.monotonic() < req.host_seconds + 1:
            skipped[name] = "deadline"
            continue
        metrics[name] = await asyncio.to_thread(fn, req.host_seconds)
    if req.builtin:
        gm, why = await asyncio.to_thread(gpu_metrics, nvml)
        metrics.update(gm)
        if why:
            skipped["gpu"] = why
    if bench_command:
        left = deadline - time.monotonic()
        if left <= 1:
            skipped["bench_command"] = "deadline"
        else:
            try:
                res = await run_command(bench_command, left - 0.5)
            except OSError as err:
                res = None
                skipped["bench_command"] = f"cannot start {bench_command[0]}: {err}"
            if res is None:
                skipped.setdefault("bench_command", f"did not finish within {left - 0.5:.0f} s")
            elif res[0] != 0:
                skipped["bench_command"] = f"exit {res[0]}: {tail(res[1])[-300:]}"
            else:
                try:
                    metrics.update(parse_site_output(res[1].decode(errors="replace")))
                except ValueError as err:
                    skipped["bench_command"] = f"bad output: {err}"
    return BenchReport(node=node, cluster=cluster, sweep_id=req.sweep_id, metrics=metrics, skipped=skipped,
                       started_at=started, finished_at=utcnow(), agent_version=__version__)


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
                                  bench_command=getattr(responder, "bench_command", None))
        log.info("bench_answered", sweep_id=req.sweep_id, metrics=len(rep.metrics), skipped=list(rep.skipped))
    if msg.reply:
        await msg.respond(rep.model_dump_json().encode())
