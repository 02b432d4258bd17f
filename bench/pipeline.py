"""Pipeline throughput: fault events/s from JetStream through the router into Temporal, beside the
raw JetStream publish+consume rate and the raw signal-with-start rate of the same servers, all
measured in this run.

    python bench/pipeline.py --nodes 1000 --events 5000

Events are XID 13 (application side: recorded, no drain), so the figure is the router + Temporal
path, not activities. Router and worker run as separate processes (`fleetmend router|worker`).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import CpuMeter, machine, stack, table, wait_drained
from fleetmend import subjects
from fleetmend.events import Component, Device, FaultEvent, Severity, Source


def xid13(cluster: str, node: str) -> FaultEvent:
    return FaultEvent(cluster=cluster, node=node, component=Component.GPU, kind="xid", code=13,
                      severity=Severity.DEGRADED, source=Source.INJECT, device=Device(pci_bus_id="0000:3b:00.0"),
                      raw="NVRM: Xid (PCI:0000:3b:00): 13, pid=1234, name=python, Graphics SM Warp Exception")


async def publish_all(js, events: list[FaultEvent], window: int = 512) -> float:
    t0 = time.monotonic()
    for i in range(0, len(events), window):
        chunk = events[i:i + window]
        await asyncio.gather(*(js.publish(subjects.fault_subject(e.cluster, e.node), e.to_json_bytes(),
                                          headers={"Nats-Msg-Id": e.event_id}) for e in chunk))
    return time.monotonic() - t0


async def raw_jetstream(nc, n: int) -> tuple[float, float]:
    """Raw JetStream: publish n messages (512 in flight), then durable pull fetch(100) + ack."""
    from nats.js.api import StreamConfig

    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="RAWBENCH", subjects=["rawbench.>"], storage="file"))
    payload = xid13("raw", "n0").to_json_bytes()
    t0 = time.monotonic()
    for i in range(0, n, 512):
        await asyncio.gather(*(js.publish(f"rawbench.{j % 100}", payload) for j in range(i, min(n, i + 512))))
    pub_rate = n / (time.monotonic() - t0)
    psub = await js.pull_subscribe("rawbench.>", durable="rawbench", stream="RAWBENCH")
    got = 0
    t0 = time.monotonic()
    while got < n:
        msgs = await psub.fetch(100, timeout=5)
        for m in msgs:
            await m.ack()
        got += len(msgs)
    cons_rate = n / (time.monotonic() - t0)
    await js.delete_stream("RAWBENCH")
    return pub_rate, cons_rate


async def raw_sws(client, task_queue: str, ids: int, calls: int,
                  in_flight: int = 64) -> tuple[float, float]:
    """Raw signal-with-start: (rate creating `ids` workflows, rate on those running ids)."""
    from bench.sws_workflow import Sink

    sem = asyncio.Semaphore(in_flight)

    async def one(i: int) -> None:
        async with sem:
            await client.start_workflow(Sink.run, id=f"sink-{task_queue}-{i % ids}", task_queue=task_queue,
                                        start_signal="ev", start_signal_args=[i])

    t0 = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(ids)))  # each call creates its workflow
    create = ids / (time.monotonic() - t0)
    t0 = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(calls)))
    return create, calls / (time.monotonic() - t0)


async def main(nodes: int, events: int, raw_n: int, sws_calls: int, seed: int) -> dict[str, float]:
    import nats
    from temporalio.client import Client
    from temporalio.worker import Worker

    from bench.sws_workflow import Sink
    from fleetmend.infra.converter import data_converter

    rng = random.Random(seed)
    async with stack() as st:
        nc = await nats.connect(st.nats_url)
        client = await Client.connect(st.temporal_address, data_converter=data_converter)
        js_pub, js_cons = await raw_jetstream(nc, raw_n)
        async with Worker(client, task_queue="rawsws", workflows=[Sink]):
            sws_create, sws = await raw_sws(client, "rawsws", min(1000, nodes), sws_calls)

        s = st.settings(cluster="bench", scheduler="none", task_queue="bench")
        worker = st.spawn("worker", s)
        await asyncio.sleep(2)
        cluster = "bench"
        evs = [xid13(cluster, f"n{rng.randrange(nodes):05d}") for _ in range(events)]
        js = nc.jetstream()
        from fleetmend.infra.jetstream import ensure_fault_stream

        await ensure_fault_stream(js)
        await publish_all(js, evs)  # backlog first: the router then drains it as fast as it can
        router = st.spawn("router", s)
        meter = CpuMeter({"router": router.pid, "worker": worker.pid, "temporal": st.procs[1].pid,
                          "nats": st.procs[0].pid})
        t0 = time.monotonic()
        t1 = await wait_drained(js, subjects.FAULT_STREAM, subjects.ROUTER_DURABLE, timeout_s=1800)
        cpu = meter.read()
        rate = events / (t1 - t0)
        # correctness: a few nodes' workflows hold exactly the events sent to them
        from workflows.remediation import NodeRemediation

        counts: dict[str, int] = {}
        for e in evs:
            counts[e.node] = counts.get(e.node, 0) + 1
        checked = ok = 0
        for node in list(counts)[:5]:
            h = client.get_workflow_handle_for(NodeRemediation.run, subjects.workflow_id(cluster, node))
            for _ in range(100):
                stt = await h.query(NodeRemediation.status)
                got = sum(f["count"] for f in stt.faults) + stt.duplicates
                if got >= counts[node]:
                    break
                await asyncio.sleep(0.2)
            checked += 1
            ok += int(got == counts[node])
        await nc.close()
    rows = [
        ("machine", machine()),
        ("nodes / events", f"{nodes} / {events}"),
        ("raw JetStream publish (512 in flight), msgs/s", f"{js_pub:,.0f}"),
        ("raw JetStream fetch(100)+ack, msgs/s", f"{js_cons:,.0f}"),
        ("raw signal-with-start creating workflows (64 in flight), /s", f"{sws_create:,.1f}"),
        ("raw signal-with-start on running ids (64 in flight), /s", f"{sws:,.1f}"),
        ("pipeline JetStream → router → Temporal, events/s", f"{rate:,.1f}"),
        ("incidents created by the pipeline (distinct nodes)", f"{len(set(e.node for e in evs)):,}"),
        ("ratio pipeline / raw SWS creating", f"{rate / sws_create:.2f}"),
        ("ratio pipeline / raw SWS on running ids", f"{rate / sws:.2f}"),
        ("ratio pipeline / raw JetStream consume", f"{rate / js_cons:.4f}"),
        ("CPU % of one core (router/worker/temporal/nats)",
         " / ".join(f"{cpu[k][0]:.0f}" for k in ("router", "worker", "temporal", "nats"))),
        ("RSS MiB (router/worker)", f"{cpu['router'][1]:.0f} / {cpu['worker'][1]:.0f}"),
        ("check: 5 sampled workflows hold exactly their events", f"{ok}/{checked}"),
    ]
    table(f"Pipeline throughput ({time.strftime('%Y-%m-%d %H:%M')})", rows)
    return {"pipeline": rate, "sws": sws, "sws_create": sws_create, "js_cons": js_cons}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--events", type=int, default=5000)
    ap.add_argument("--raw", type=int, default=20000, help="messages for the raw JetStream figure")
    ap.add_argument("--sws", type=int, default=1000, help="calls for the raw signal-with-start figure")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    asyncio.run(main(a.nodes, a.events, a.raw, a.sws, a.seed))
