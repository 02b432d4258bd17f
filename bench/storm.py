"""Storm: EVENTS duplicate and flapping events for NODES nodes. How long to absorb them, how many
workflows result (must be one incident per node), router/worker memory, nothing lost.

    python bench/storm.py --nodes 2000 --events 1000000

Each node's IB port flaps (Link DOWN / ACTIVE alternating, distinct event ids) and every 10th
round re-publishes each node's previous event with the same Nats-Msg-Id (an agent re-send): JetStream drops those
duplicates at publish. The router and worker run as separate processes.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import CpuMeter, machine, stack, table, wait_drained


async def main(nodes: int, events: int, seed: int, hold_s: float = 0.0) -> None:
    import nats
    from temporalio.client import Client

    from fleetmend import subjects
    from fleetmend.events import Component, Device, FaultEvent, Severity, Source
    from fleetmend.infra.converter import data_converter
    from fleetmend.infra.jetstream import ensure_fault_stream
    from workflows.remediation import NodeRemediation

    cluster = "storm"
    async with stack() as st:
        s = st.settings(cluster=cluster, scheduler="none", task_queue="storm")
        nc = await nats.connect(st.nats_url)
        js = nc.jetstream()
        await ensure_fault_stream(js)
        worker = st.spawn("worker", s)
        router = st.spawn("router", s)
        await asyncio.sleep(3)
        meter = CpuMeter({"router": router.pid, "worker": worker.pid, "temporal": st.procs[1].pid,
                          "nats": st.procs[0].pid})
        sent_unique = dup_acks = 0
        per_node: dict[str, int] = {}
        t0 = time.monotonic()
        window: list = []
        peak = {"router": 0.0, "worker": 0.0}

        async def flush() -> None:
            nonlocal dup_acks
            acks = await asyncio.gather(*window)
            dup_acks += sum(1 for a in acks if a.duplicate)
            window.clear()

        async def sample_rss() -> None:  # once a second for the whole run: the peak comes while absorbing
            while True:
                for k, (_c, rss) in meter.read().items():
                    if k in peak and rss == rss:  # not NaN
                        peak[k] = max(peak[k], rss)
                await asyncio.sleep(1.0)

        sampler = asyncio.create_task(sample_rss())

        last: dict[str, FaultEvent] = {}
        for i in range(events):
            node = f"s{i % nodes:05d}"
            if (i // nodes) % 10 == 9 and node in last:
                ev = last[node]  # agent re-send of this node's previous event: same event id
            else:
                healthy = (i // nodes) % 2 == 1  # flapping: DOWN, ACTIVE, DOWN, ...
                ev = FaultEvent(cluster=cluster, node=node, component=Component.IB, kind="ib_port_down",
                                severity=Severity.INFO if healthy else Severity.DEGRADED, healthy=healthy,
                                source=Source.INJECT, device=Device(pci_bus_id="0000:4b:00.0", name="mlx5_0", port=1),
                                raw=f"mlx5_core 0000:4b:00.0 mlx5_0: Port: 1 Link {'ACTIVE' if healthy else 'DOWN'}")
                sent_unique += 1
                per_node[node] = per_node.get(node, 0) + 1
            last[node] = ev
            window.append(js.publish(subjects.fault_subject(cluster, ev.node), ev.to_json_bytes(),
                                     headers={"Nats-Msg-Id": ev.event_id}))
            if len(window) >= 1000:
                await flush()
        if window:
            await flush()
        t_pub = time.monotonic() - t0
        t1 = await wait_drained(js, subjects.FAULT_STREAM, subjects.ROUTER_DURABLE, timeout_s=7200)
        cpu = meter.read()
        for k in peak:
            peak[k] = max(peak[k], cpu[k][1])
        client = await Client.connect(st.temporal_address, data_converter=data_converter)
        wf = await client.count_workflows(  # open incidents: a run continued-as-new is closed, its successor runs
            f"WorkflowType='NodeRemediation' AND FleetCluster='{cluster}' AND ExecutionStatus='Running'")
        checked = ok = 0
        for node in list(per_node)[:10]:
            h = client.get_workflow_handle_for(NodeRemediation.run, subjects.workflow_id(cluster, node))
            got = -1
            for _ in range(300):
                try:
                    stt = await h.query(NodeRemediation.status)
                except Exception:  # noqa: BLE001 - the worker is still replaying the storm's backlog
                    await asyncio.sleep(1.0)
                    continue
                got = sum(f["count"] for f in stt.faults)
                if got >= per_node[node]:
                    break
                await asyncio.sleep(0.2)
            checked += 1
            ok += int(got == per_node[node])
        t2 = time.monotonic()
        sample = client.get_workflow_handle(subjects.workflow_id(cluster, next(iter(per_node))))
        ex = (await sample.describe()).raw_description.workflow_execution_info
        hist = f"{ex.history_length:,} events, {ex.history_size_bytes / 1024:,.0f} KiB"
        runs = sum([1 async for _ in client.list_workflows(f"WorkflowId='{sample.id}'")])
        sampler.cancel()
        cpu = meter.read()
        info = await js.stream_info(subjects.DEADLETTER_STREAM) if await _has(js) else None
        await nc.close()
        if hold_s:
            print(f"holding the stack {hold_s:.0f} s: worker pid {worker.pid}", flush=True)
            await asyncio.sleep(hold_s)
    rows = [
        ("machine", machine()),
        ("nodes / events published (unique + re-sent)", f"{nodes:,} / {events:,} ({sent_unique:,} + {events - sent_unique:,})"),
        ("JetStream duplicates dropped at publish", f"{dup_acks:,}"),
        ("publish time, s", f"{t_pub:.1f}"),
        ("absorbed (published → consumer drained), s", f"{t1 - t0:.1f}"),
        ("absorb rate, unique events/s", f"{sent_unique / (t1 - t0):,.0f}"),
        ("worker caught up (10 sampled nodes complete), s after publish start", f"{t2 - t0:.1f}"),
        ("open incidents (running workflows; must equal nodes)", f"{wf.count:,}"),
        ("peak RSS MiB router / worker (sampled every second)", f"{peak['router']:.0f} / {peak['worker']:.0f}"),
        ("CPU % router / worker / temporal / nats (whole run)", " / ".join(f"{cpu[k][0]:.0f}" for k in
                                                               ("router", "worker", "temporal", "nats"))),
        ("dead letters", f"{info.state.messages if info else 0}"),
        ("one sampled node: runs (continued-as-new) / history events in its open run", f"{runs} / {hist}"),
        ("check: 10 sampled nodes hold every unique event (counted)", f"{ok}/{checked}"),
    ]
    table(f"Storm ({time.strftime('%Y-%m-%d %H:%M')})", rows)


async def _has(js) -> bool:
    try:
        from fleetmend import subjects

        await js.stream_info(subjects.DEADLETTER_STREAM)
        return True
    except Exception:  # noqa: BLE001
        return False


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2000)
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--hold", type=float, default=0.0, metavar="S",
                    help="keep the stack up S seconds after the figures (to inspect the worker process)")
    a = ap.parse_args()
    asyncio.run(main(a.nodes, a.events, a.seed, a.hold))
