#!/usr/bin/env python3
"""Check the agent's real GPU path on a machine with NVIDIA GPUs: what an operator runs on a new
node type before trusting fleetmend there.

    python scripts/gpu_check.py [--load-s 30] [--polls 20] [--json OUT.json]

1. The NVML probe on the real driver: init, one poll (a healthy idle GPU must publish nothing),
   the time one poll of every GPU takes (median and max of `--polls` polls, milliseconds).
2. The diagnostics responder's QUICK and LONG levels against the same GPUs, called directly
   (no NATS): on a healthy GPU every QUICK GPU check passes; LONG runs the configured site
   commands (`dcgmi diag -r 2` by default: NOT_APPLICABLE where DCGM is not installed).
3. Under load: a bf16 matrix-product loop through PyTorch on every GPU for `--load-s` seconds,
   with the probe polling once a second and its XID listener thread running. A busy healthy GPU
   must publish no fault (power capping and boost clock changes are normal under load); the
   clock event reasons, utilization, PCIe generation/width, temperature and power seen are printed.
   Needs PyTorch with CUDA; without it (or with `--load-s 0`) this step is skipped and says so.

Never resets a GPU, changes clocks or writes any GPU setting. Exit status: 0 all as expected,
1 NVML unavailable, 2 an expectation failed (printed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agents.diag import DiagResponder
from agents.nvml import NvmlProbe
from fleetmend.diagnostics import DiagLevel, DiagRequest, DiagResult

LOAD = r"""
import sys, time, torch
secs = float(sys.argv[1])
devs = [torch.device(f"cuda:{i}") for i in range(torch.cuda.device_count())]
mats = [(torch.randn(8192, 8192, device=d, dtype=torch.bfloat16),
         torch.randn(8192, 8192, device=d, dtype=torch.bfloat16)) for d in devs]
print("load-started", len(devs), flush=True)
t0, n = time.monotonic(), 0
while time.monotonic() - t0 < secs:
    for a, b in mats:
        c = a @ b
    n += 1
    if n % 50 == 0:
        torch.cuda.synchronize()
torch.cuda.synchronize()
dt = time.monotonic() - t0
print(f"load-done {n} products per GPU in {dt:.1f} s = {n * 2 * 8192**3 / dt / 1e12:.0f} TFLOP/s per GPU",
      flush=True)
"""


def _readings(p: NvmlProbe) -> list[dict]:
    nv, out = p.nvml, []
    for g in p.gpus:
        h = g.handle
        row: dict = {"gpu": g.index, "bus": g.device.pci_bus_id}
        for key, fn in {
            "util_pct": lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu,
            "pcie_gen": lambda: f"{nv.nvmlDeviceGetCurrPcieLinkGeneration(h)}/{nv.nvmlDeviceGetMaxPcieLinkGeneration(h)}",
            "pcie_width": lambda: f"{nv.nvmlDeviceGetCurrPcieLinkWidth(h)}/{nv.nvmlDeviceGetMaxPcieLinkWidth(h)}",
            "clock_event_reasons": lambda: hex(nv.nvmlDeviceGetCurrentClocksEventReasons(h)),
            "temp_c": lambda: nv.nvmlDeviceGetTemperature(h, 0),
            "power_w": lambda: round(nv.nvmlDeviceGetPowerUsage(h) / 1000),
            "sm_mhz": lambda: nv.nvmlDeviceGetClockInfo(h, 1),
        }.items():
            try:
                row[key] = fn()
            except Exception as err:  # noqa: BLE001 - print what the driver refused
                row[key] = f"error: {err}"
        out.append(row)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--load-s", type=float, default=30.0)
    ap.add_argument("--polls", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None, help="write every figure and event here")
    args = ap.parse_args()
    report: dict = {"failures": []}
    fail = report["failures"].append

    # 1. probe on the real driver --------------------------------------------------------------
    p = NvmlProbe(cluster="gpucheck", node="gpucheck", xid_wait_ms=500, poll_interval_s=1.0)
    init_events = p.init()
    report["init_events"] = [ev.summary() for ev in init_events]
    if not p.initialised:
        print("NVML unavailable: " + "; ".join(ev.message for ev in init_events))
        if args.json:
            args.json.write_text(json.dumps(report, indent=2, default=str))
        return 1
    nv = p.nvml
    report["driver"] = nv.nvmlSystemGetDriverVersion()
    report["nvml"] = nv.nvmlSystemGetNVMLVersion()
    report["gpus"] = [{"index": g.index, "bus": g.device.pci_bus_id, "uuid": g.device.uuid,
                       "name": nv.nvmlDeviceGetName(g.handle)} for g in p.gpus]
    first = p.poll_once()
    report["first_poll_events"] = [ev.model_dump(mode="json") for ev in first]
    if [ev for ev in first if not ev.healthy]:
        fail(f"idle poll published faults: {[ev.summary() for ev in first]}")
    times_ms = []
    for _ in range(args.polls):
        t = time.perf_counter()
        extra = p.poll_once()
        times_ms.append((time.perf_counter() - t) * 1000)
        if extra:
            fail(f"repeat idle poll published: {[ev.summary() for ev in extra]}")
    report["poll_ms"] = {"median": statistics.median(times_ms), "max": max(times_ms), "polls": args.polls,
                         "gpus": len(p.gpus)}
    report["unsupported_reads"] = {g.index: sorted(g.unsupported) for g in p.gpus}
    report["nvlinks"] = {g.index: g.links for g in p.gpus}
    report["idle"] = _readings(p)

    # 2. diagnostics responder, directly --------------------------------------------------------
    diag = DiagResponder(None, "gpucheck", "gpucheck", expected_gpus=len(p.gpus))
    for level in (DiagLevel.QUICK, DiagLevel.LONG):
        t = time.perf_counter()
        rep = asyncio.run(diag.run(DiagRequest(level=level, deadline_s=120)))
        report[f"diag_{level.value}"] = {"result": rep.result.value, "s": round(time.perf_counter() - t, 2),
                                         "checks": [c.model_dump(mode="json") for c in rep.checks]}
        for c in rep.checks:
            if level is DiagLevel.QUICK and c.name in ("nvml_reachable", "gpu_count", "remapped_rows_pending",
                                                       "pcie_link_width") and c.result is not DiagResult.PASS:
                fail(f"diag {c.name}: {c.result.value} ({c.measured}; {c.detail})")

    # 3. under load ------------------------------------------------------------------------------
    xids: list = []
    stop = threading.Event()

    def listen() -> None:  # the probe's own XID path: event set wait on a thread
        async def go() -> None:
            async def emit(ev):  # type: ignore[no-untyped-def]
                if ev.kind == "xid":
                    xids.append(ev.summary())
            p2 = NvmlProbe(cluster="gpucheck", node="gpucheck", xid_wait_ms=500, poll_interval_s=3600)
            task = asyncio.create_task(p2.run(emit))
            while not stop.is_set():
                await asyncio.sleep(0.2)
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        asyncio.run(go())

    import importlib.util

    skip = ("--load-s 0" if args.load_s <= 0 else
            "PyTorch is not installed" if importlib.util.find_spec("torch") is None else None)
    th = threading.Thread(target=listen, daemon=True)
    th.start()
    loaded_events, samples = [], []
    started = done = f"load-skipped ({skip})" if skip else ""
    if not skip:
        load = subprocess.Popen([sys.executable, "-c", LOAD, str(args.load_s)], stdout=subprocess.PIPE, text=True)
        assert load.stdout is not None
        started = load.stdout.readline().strip()
        t0 = time.monotonic()
        while load.poll() is None and time.monotonic() - t0 < args.load_s + 60:
            loaded_events += p.poll_once()
            samples.append(_readings(p))
            time.sleep(1.0)
        done = load.stdout.read().strip()
    stop.set()
    th.join(timeout=10)
    p.shutdown()
    report["load"] = {"started": started, "done": done, "samples": samples}
    report["load_events"] = [ev.model_dump(mode="json") for ev in loaded_events]
    report["xid_events"] = xids
    faults = [ev.summary() for ev in loaded_events if not ev.healthy and ev.severity.value != "info"]
    if faults:
        fail(f"faults published under load on a healthy GPU: {faults}")
    if not skip and not done.startswith("load-done"):
        fail(f"the load did not run: {started!r} {done!r}")

    # print ---------------------------------------------------------------------------------------
    print(f"driver {report['driver']}  NVML {report['nvml']}  GPUs: "
          + ", ".join(f"{g['index']} {g['name']} {g['bus']}" for g in report["gpus"]))
    print(f"init events: {report['init_events'] or 'none'}")
    print(f"first poll events: {[e['kind'] for e in report['first_poll_events']] or 'none'}")
    print(f"poll of {len(p.gpus)} GPU(s): median {report['poll_ms']['median']:.2f} ms, "
          f"max {report['poll_ms']['max']:.2f} ms over {args.polls} polls")
    print(f"unsupported reads: {report['unsupported_reads']}  nvlinks: {report['nvlinks']}")
    print(f"idle: {report['idle']}")
    for level in ("quick", "long"):
        d = report[f"diag_{level}"]
        print(f"diag {level}: {d['result']} in {d['s']} s: "
              + "; ".join(f"{c['name']}={c['result']} ({c['measured']})" for c in d["checks"]))
    print(f"load: {started} / {done}")
    if samples:
        peak = max(samples, key=lambda s: s[0].get("util_pct") if isinstance(s[0].get("util_pct"), int) else -1)
        print(f"under load (busiest sample): {peak}")
        print("clock event reasons seen under load: "
              + ", ".join(sorted({str(r.get('clock_event_reasons')) for s in samples for r in s})))
    print(f"events under load: {[ev.summary() for ev in loaded_events] or 'none'}; XID events: {xids or 'none'}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    for f in report["failures"]:
        print("FAIL:", f)
    print("RESULT:", "ok" if not report["failures"] else f"{len(report['failures'])} expectation(s) failed")
    return 2 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
