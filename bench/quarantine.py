"""Quarantine latency: a fault line entering the agent → the drain issued by the scheduler adapter.

    python bench/quarantine.py --nodes 10000 --faults 50

A simulated fleet of NODES nodes sends heartbeats (every 10 s each) and background faults from the
Llama 3 mix; meanwhile FAULTS measured XID 79 lines, one every `--gap` seconds on distinct nodes,
go through the agent's real `KmsgParser` + `Publisher`. Two modes, each with its own router and
worker processes:

- real-drain: standalone scheduler; the drain lands in the JetStream KV bucket, watched here.
- observe-only: `policy.observe_only`; the decision is the workflow closing with outcome "observed".

The fleet's blast-radius budget and breaker are opened for this measurement (they would queue most
of the measured nodes, which is their job); XID 79 has no debounce (it has no clearing event).

For reference, NVIDIA NVSentinel's published scale test reports a quarantine decision p50 of
0.37 s and p90 of 0.48 s at 1,500 nodes (about 2.5 nodes/s).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import CpuMeter, machine, pct, stack, table  # noqa: E402


async def measure(st, mode: str, nodes: int, faults: int, gap_s: float, background_rate: float) -> dict:  # noqa: ANN001
    import nats
    from temporalio.client import Client

    from agents.kmsg import KmsgParser
    from agents.publisher import Publisher
    from agents.spool import Spool
    from fleetmend import subjects
    from fleetmend.catalog import default_catalog
    from fleetmend.jetstream import ensure_fault_stream
    from fleetmend.cli.simulate import SimConfig, run_sim
    from fleetmend.converter import data_converter

    cluster = f"q{mode.replace('-', '')}"
    observe = mode == "observe-only"
    s = st.settings(cluster=cluster, scheduler="standalone", task_queue=f"tq-{cluster}",
                    policy={"observe_only": observe})
    # The blast-radius budget and breaker would (rightly) queue most of 30+ nodes faulting within
    # seconds; opened here so the figure is the decision path's latency, not the safety queue.
    wide_open = {"FLEETMEND_POLICY__MAX_DRAINED_NODES": "100000", "FLEETMEND_POLICY__MAX_DRAINED_PERCENT": "100",
                 "FLEETMEND_POLICY__MAX_DRAINED_PER_RACK": "100000",
                 "FLEETMEND_POLICY__BREAKER_DISTINCT_NODES": "100000",
                 "FLEETMEND_POLICY__DOMAIN_INCIDENT_NODES": "100000"}
    worker = st.spawn("worker", s, wide_open)
    router = st.spawn("router", s, wide_open)
    nc = await nats.connect(st.nats_url)
    js = nc.jetstream()
    await ensure_fault_stream(js)
    client = await Client.connect(st.temporal_address, data_converter=data_converter)
    kv = await js.create_key_value(bucket=subjects.DRAIN_KV_BUCKET, history=5) if not observe else None
    seen: dict[str, float] = {}
    if kv is not None:
        watcher = await kv.watchall()

        async def watch() -> None:
            async for entry in watcher:
                if entry is not None and entry.key not in seen and entry.value:
                    seen[entry.key] = time.monotonic()

        wtask = asyncio.create_task(watch())
    await asyncio.sleep(3)  # processes up
    stop = asyncio.Event()
    sim_cfg = SimConfig(nodes=nodes, cluster=cluster, node_prefix="bg", duration_s=1e9, seed=7,
                        fault_rate_per_s=background_rate, state_dir=st.root / "sim")
    sim_task = asyncio.create_task(run_sim(s, sim_cfg, stop=stop))
    meter = CpuMeter({"router": router.pid, "worker": worker.pid, "temporal": st.procs[1].pid})
    catalog = default_catalog()
    started: dict[str, float] = {}
    waits = []
    for i in range(faults):
        node = f"m{i:05d}"
        pub = Publisher(nc, js, Spool(st.root / "spool" / cluster / node, 1 << 20), cluster, node)
        pub.attach(nc, js)
        parser = KmsgParser(cluster, node, "bench", catalog=catalog)
        line = "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
        started[node] = time.monotonic()  # the line enters the agent
        for ev in parser.feed(line) + parser.flush():
            await pub.publish(ev)
        if observe:
            h = client.get_workflow_handle(subjects.workflow_id(cluster, node))
            waits.append(asyncio.create_task(_closed(h, node, seen)))
        await asyncio.sleep(gap_s)
    deadline = time.monotonic() + 300
    while len(seen) < faults and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    cpu = meter.read()
    stop.set()
    await asyncio.gather(sim_task, *waits, return_exceptions=True)
    if kv is not None:
        wtask.cancel()
    lat = [seen[n] - started[n] for n in started if n in seen]
    await nc.close()
    router.stop()
    worker.stop()
    return {"mode": mode, "lat": lat, "missing": faults - len(lat), "cpu": cpu}


async def _closed(handle, node: str, seen: dict[str, float]) -> None:  # noqa: ANN001
    for _ in range(600):
        try:
            await handle.result()
            seen[node] = time.monotonic()
            return
        except Exception:  # noqa: BLE001 - not started yet
            await asyncio.sleep(0.05)


async def main(nodes: int, faults: int, gap_s: float, background_rate: float, modes: list[str]) -> None:
    async with stack() as st:
        results = [await measure(st, m, nodes, faults, gap_s, background_rate) for m in modes]
    rows = [("machine", machine()), ("simulated nodes (heartbeat 10 s each)", f"{nodes:,}"),
            ("background fault lines/s", f"{background_rate}"), ("measured XID 79 faults per mode", f"{faults}")]
    for r in results:
        lat = r["lat"]
        rows.append((f"{r['mode']}: p50 / p90 / p99 s",
                     f"{pct(lat, 50):.3f} / {pct(lat, 90):.3f} / {pct(lat, 99):.3f}  (missing {r['missing']})"))
        rows.append((f"{r['mode']}: CPU % router / worker / temporal",
                     " / ".join(f"{r['cpu'][k][0]:.0f}" for k in ("router", "worker", "temporal"))))
    rows.append(("NVSentinel reference (1,500 nodes)", "p50 0.37 s, p90 0.48 s"))
    table(f"Quarantine latency ({time.strftime('%Y-%m-%d %H:%M')})", rows)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=10_000)
    ap.add_argument("--faults", type=int, default=50)
    ap.add_argument("--gap", type=float, default=0.5, help="seconds between measured faults")
    ap.add_argument("--background", type=float, default=1.0, help="background fault lines per second")
    ap.add_argument("--modes", default="observe-only,real-drain")
    a = ap.parse_args()
    asyncio.run(main(a.nodes, a.faults, a.gap, a.background, a.modes.split(",")))
