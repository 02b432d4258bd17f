#!/usr/bin/env python3
"""Run the NVML probe once against this machine's real GPUs and print what it read.

    .venv/bin/python scripts/nvml_probe.py [--xid-wait-s 5] [--json]

Prints the driver version and, per GPU, the raw NVML readings the probe judges (ECC counters,
remapped rows, retired pages, PCIe link, NVLink, clock event reasons, temperature, recovery action),
then the events one poll produced (on a healthy GPU: none), then any XID event that arrives within
`--xid-wait-s`. On a machine without a driver it prints the single `nvml_unavailable` event.
Exit status: 0 read fine, 1 NVML unavailable.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agents.conditions import UNKNOWN
from agents.nvml import NvmlProbe


def _show(v: object) -> object:
    if v is UNKNOWN:
        return "unsupported/unknown"
    return v


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--xid-wait-s", type=float, default=3.0, help="listen for XID events this long")
    ap.add_argument("--json", action="store_true", help="print events as JSON lines")
    args = ap.parse_args()
    p = NvmlProbe(cluster="local", node="probe-check", xid_wait_ms=500)
    for ev in p.init():
        print(f"EVENT {ev.summary()}: {ev.message}")
    if not p.initialised:
        return 1
    try:
        nv = p.nvml
        print(f"driver {nv.nvmlSystemGetDriverVersion()}, NVML {nv.nvmlSystemGetNVMLVersion()}, {len(p.gpus)} GPU(s)")
        for g in p.gpus:
            print(f"\nGPU {g.index} {g.device.pci_bus_id} {g.device.uuid} {nv.nvmlDeviceGetName(g.handle)}")
            for _slot, _reading in p._readings(g):
                pass  # evaluates every read once (populates g.unsupported and link list)
            h = g.handle
            reads = {
                "ecc sbe/dbe volatile": lambda: (nv.nvmlDeviceGetTotalEccErrors(h, 0, 0),
                                                 nv.nvmlDeviceGetTotalEccErrors(h, 1, 0)),
                "ecc sbe/dbe aggregate": lambda: (nv.nvmlDeviceGetTotalEccErrors(h, 0, 1),
                                                  nv.nvmlDeviceGetTotalEccErrors(h, 1, 1)),
                "remapped rows (corr, unc, pending, failure)": lambda: nv.nvmlDeviceGetRemappedRows(h),
                "retired pages pending": lambda: nv.nvmlDeviceGetRetiredPagesPendingStatus(h),
                "pcie width cur/max": lambda: (nv.nvmlDeviceGetCurrPcieLinkWidth(h), nv.nvmlDeviceGetMaxPcieLinkWidth(h)),
                "pcie gen cur/max": lambda: (nv.nvmlDeviceGetCurrPcieLinkGeneration(h), nv.nvmlDeviceGetMaxPcieLinkGeneration(h)),
                "utilization %": lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu,
                "nvlinks present": lambda: g.links,
                "clock event reasons": lambda: hex(nv.nvmlDeviceGetCurrentClocksEventReasons(h)),
                "temperature C / slowdown C": lambda: (nv.nvmlDeviceGetTemperature(h, 0),
                                                       nv.nvmlDeviceGetTemperatureThreshold(h, 1)),
                "recovery action (field 230)": lambda: p._recovery(g, "") or "NONE",
                "unsupported reads": lambda: sorted(g.unsupported),
            }
            for label, fn in reads.items():
                try:
                    print(f"  {label:45s} {_show(fn())}")
                except Exception as err:  # noqa: BLE001 - a diagnostic script prints every failure
                    print(f"  {label:45s} error: {err}")
        p.conditions = type(p.conditions)("local", "probe-check", p.conditions.source)  # fresh debounce state
        events = p.poll_once()
        print(f"\none poll: {len(events)} event(s)")
        for ev in events:
            print(ev.model_dump_json() if args.json else f"EVENT {ev.summary()}: {ev.message}")
    finally:
        p.shutdown()

    async def listen() -> None:
        got = []

        async def emit(ev):  # type: ignore[no-untyped-def]
            if ev.kind == "xid":
                got.append(ev)
                print(f"XID EVENT {ev.summary()}: {ev.message}")

        p2 = NvmlProbe(cluster="local", node="probe-check", xid_wait_ms=500, poll_interval_s=3600)
        try:
            async with asyncio.timeout(args.xid_wait_s):
                await p2.run(emit)
        except TimeoutError:
            pass
        print(f"XID events within {args.xid_wait_s:g} s: {len(got)}")

    asyncio.run(listen())
    return 0


if __name__ == "__main__":
    sys.exit(main())
