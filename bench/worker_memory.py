"""Where the worker's memory goes: RSS of a real worker process as incidents open and absorb signals.

    python bench/worker_memory.py [--incidents 200] [--signals 80] [--cache 1000] [--env MALLOC_ARENA_MAX=2]

Starts NATS + the Temporal dev server (bench/common.py `stack`) and `fleetmend worker` as its own
process with `worker.max_cached_workflows = --cache`, opens `--incidents` NodeRemediation incidents
(one XID 13 each, record-only, kept open), then sends every incident `--signals` more batches of
one fault, printing the worker's RSS after the starts and after every 20 rounds. Compare
`--cache 1000` with `--cache 50` to see what is held per cached workflow run (bench/RESULTS.md,
"Worker memory"). Not a timed test: it prints figures.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine, stack, table


async def main(incidents: int, signals: int, cache: int, env: list[str]) -> None:
    import psutil
    from temporalio.client import Client

    from fleetmend import subjects
    from fleetmend.events import Component, Device, FaultEvent, Severity, Source, Verdict
    from fleetmend.infra.converter import data_converter
    from fleetmend.messages import FaultBatch, IncidentInput, IncidentPolicy, RoutedFault
    from workflows.remediation import NodeRemediation

    def xid13(node: str) -> RoutedFault:
        ev = FaultEvent(cluster="wm", node=node, component=Component.GPU, kind="xid", code=13,
                        severity=Severity.DEGRADED, source=Source.INJECT, device=Device(pci_bus_id="0000:3b:00.0"),
                        raw="NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=python, Graphics Exception", message="XID 13",
                        verdict=Verdict(severity="degraded", immediate_action="RESTART_APP", fault_class="xid13"))
        return RoutedFault(event=ev)

    rows: list[tuple[str, str]] = [("machine", machine()), ("incidents / signal rounds / cache",
                                                            f"{incidents} / {signals} / {cache}")]
    if env:
        rows.append(("worker environment", " ".join(env)))
    async with stack() as st:
        s = st.settings(cluster="wm", scheduler="none", task_queue="wm")
        w = st.spawn("worker", s, extra_env={"FLEETMEND_WORKER__MAX_CACHED_WORKFLOWS": str(cache),
                                                   **dict(e.split("=", 1) for e in env)})
        await asyncio.sleep(4)
        proc = psutil.Process(w.pid)

        def rss() -> str:
            return f"{proc.memory_info().rss / 2**20:.0f}"

        client = await Client.connect(st.temporal_address, data_converter=data_converter)
        rows.append(("worker RSS MiB, idle", rss()))
        policy = IncidentPolicy(close_after_idle_s=36000, app_xid_repeats=10**6, debounce_s=0.0, recovery_settle_s=0.0,
                                ticket_poll_s=0.0, close_info_after_s=0.0)
        handles = []
        for i in range(incidents):
            wid = subjects.workflow_id("wm", f"n{i}")
            await client.start_workflow(NodeRemediation.run, IncidentInput(cluster="wm", node=f"n{i}", policy=policy),
                                        id=wid, task_queue="wm", start_signal="faults",
                                        start_signal_args=[FaultBatch(faults=[xid13(f"n{i}")])])
            handles.append(client.get_workflow_handle_for(NodeRemediation.run, wid))
        await asyncio.sleep(6)
        rows.append((f"worker RSS MiB, {incidents} incidents open", rss()))
        def cpu_s() -> float:
            t = proc.cpu_times()
            return t.user + t.system

        cpu0 = cpu_s()
        for k in range(signals):
            await asyncio.gather(*[h.signal(NodeRemediation.faults, FaultBatch(faults=[xid13(f"n{i}")]))
                                   for i, h in enumerate(handles)])
            if k % 20 == 19 or k == signals - 1:
                await asyncio.sleep(3)
                rows.append((f"worker RSS MiB, after {k + 1} signals each", rss()))
        for _ in range(120):  # until the worker has absorbed everything (idle for a second)
            before = cpu_s()
            await asyncio.sleep(1.0)
            if cpu_s() - before < 0.05:
                break
        spent = cpu_s() - cpu0
        rows.append(("worker RSS MiB, absorbed", rss()))
        desc = await handles[0].describe()  # this run's history: what the SDK core holds per cached run
        runs = sum([1 async for _ in client.list_workflows(f"WorkflowId='{handles[0].id}'")])
        ex = desc.raw_description.workflow_execution_info
        rows.append(("one incident: runs so far / history of its open run",
                     f"{runs} / {ex.history_length} events, {ex.history_size_bytes / 1024:.0f} KiB"))
        rows.append(("worker CPU s absorbing the signals (replays of evicted runs included)",
                     f"{spent:.1f} ({1000 * spent / max(1, incidents * signals):.1f} ms per signal)"))
    table("Worker memory", rows)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--incidents", type=int, default=200)
    ap.add_argument("--signals", type=int, default=80)
    ap.add_argument("--cache", type=int, default=1000)
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment for the worker process (e.g. MALLOC_ARENA_MAX=2)")
    a = ap.parse_args()
    asyncio.run(main(a.incidents, a.signals, a.cache, a.env))
