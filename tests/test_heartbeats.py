"""Heartbeat monitor over the real nats-server: a silent agent becomes ONE agent_silent fault in
JetStream even with two router replicas watching, and ONE clearing event when heartbeats return."""

from __future__ import annotations

import asyncio
import json

from fleetmend.events import Component, FaultEvent, Severity, Source, utcnow
from fleetmend.infra.jetstream import ensure_fault_stream
from fleetmend.router.heartbeats import HeartbeatMonitor, deterministic_event_id
from fleetmend.subjects import fault_subject, heartbeat_subject
from tests.conftest import assert_eventually


async def _beat(nc, cluster: str, node: str) -> None:
    await nc.publish(heartbeat_subject(cluster, node), json.dumps(
        {"node": node, "cluster": cluster, "agent_version": "9.9", "at": utcnow().isoformat(), "probes": {}}).encode())


async def _faults(js, cluster: str, node: str) -> list[FaultEvent]:
    out = []
    sub = await js.subscribe(fault_subject(cluster, node), ordered_consumer=True)
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=0.3)
            except Exception:
                break
            out.append(FaultEvent.from_json_bytes(msg.data))
    finally:
        await sub.unsubscribe()
    return out


async def test_silent_agent_one_fault_across_replicas_then_cleared(nc, unique: str) -> None:
    cluster = f"c{unique}"
    js = nc.jetstream()
    await ensure_fault_stream(js)
    stop = asyncio.Event()
    replicas = [HeartbeatMonitor(nc, js, silence_s=0.6, check_interval_s=0.05) for _ in range(2)]
    tasks = [asyncio.create_task(r.run(stop)) for r in replicas]
    try:
        await asyncio.sleep(0.1)  # subscriptions in place
        for _ in range(3):
            await _beat(nc, cluster, "quiet")
            await _beat(nc, cluster, "alive")
            await asyncio.sleep(0.1)
        # "quiet" stops; "alive" keeps beating for the rest of the test

        async def keep_alive() -> None:
            while not stop.is_set():
                await _beat(nc, cluster, "alive")
                await asyncio.sleep(0.1)

        tasks.append(asyncio.create_task(keep_alive()))
        await assert_eventually(lambda: all(len(r.published) == 1 for r in replicas) and replicas, timeout_s=10,
                                what="both replicas published agent_silent")
        got = await _faults(js, cluster, "quiet")
        assert len(got) == 1, [e.event_id for e in got]  # the second replica's copy was deduplicated
        ev = got[0]
        assert (ev.kind, ev.component, ev.source, ev.severity, ev.healthy) == (
            "agent_silent", Component.AGENT, Source.HEARTBEAT, Severity.DEGRADED, False)
        assert replicas[0].published[0].event_id == replicas[1].published[0].event_id == ev.event_id
        assert await _faults(js, cluster, "alive") == []

        await _beat(nc, cluster, "quiet")  # back
        await assert_eventually(lambda: all(len(r.published) == 2 for r in replicas), timeout_s=10,
                                what="both replicas published the clearing")
        got = await _faults(js, cluster, "quiet")
        assert [(e.kind, e.healthy) for e in got] == [("agent_silent", False), ("agent_silent", True)]
        assert got[1].attrs["clearing_kind"] == "agent_heartbeat_resumed" and got[1].condition == ev.condition
    finally:
        stop.set()
        await asyncio.gather(*tasks)


async def test_invalid_heartbeats_are_ignored(nc, unique: str) -> None:
    js = nc.jetstream()
    stop = asyncio.Event()
    mon = HeartbeatMonitor(nc, js, silence_s=0.2, check_interval_s=0.05)
    task = asyncio.create_task(mon.run(stop))
    try:
        await asyncio.sleep(0.1)
        await nc.publish(f"fleet.c{unique}.hb.n1", b"{not json")
        await nc.publish(f"fleet.c{unique}.hb.n2", b'{"at": "yesterday"}')
        await asyncio.sleep(0.4)
        assert mon.nodes == {} and mon.published == []
    finally:
        stop.set()
        await task


def test_event_id_is_deterministic_and_time_ordered() -> None:
    t1, t2 = utcnow(), utcnow()
    a = deterministic_event_id("agent_silent", "c", "n", t1)
    assert a == deterministic_event_id("agent_silent", "c", "n", t1)
    assert a != deterministic_event_id("agent_silent", "c", "m", t1)
    assert len(a) == 24 and a[:16] <= deterministic_event_id("agent_silent", "c", "n", t2)[:16]


async def test_a_dotted_node_goes_silent_under_its_real_name_and_is_counted(nc, unique: str) -> None:
    from fleetmend.infra import metrics

    cluster, node = f"d{unique}", "ip-10-0-1-23.ec2.internal"
    js = nc.jetstream()
    await ensure_fault_stream(js)
    stop = asyncio.Event()
    mon = HeartbeatMonitor(nc, js, silence_s=0.4, check_interval_s=0.05)
    task = asyncio.create_task(mon.run(stop))
    try:
        await asyncio.sleep(0.1)
        await _beat(nc, cluster, node)
        await assert_eventually(lambda: len(mon.published) == 1, timeout_s=10, what="agent_silent published")
        (ev,) = await _faults(js, cluster, node)
        assert ev.node == node and ev.kind == "agent_silent"
        assert metrics.AGENTS_SILENT.labels(cluster=cluster)._value.get() == 1
        await _beat(nc, cluster, node)
        await assert_eventually(lambda: len(mon.published) == 2, timeout_s=10, what="clearing published")
        await asyncio.sleep(0.2)
        assert metrics.AGENTS_SILENT.labels(cluster=cluster)._value.get() == 0
    finally:
        stop.set()
        await task


async def test_only_the_elected_replica_sets_the_silent_gauge(nc, unique: str) -> None:
    """Two monitors (two router replicas) see the same silence; only the one elected to publish the
    fleet-level gauges sets `fleetmend_agents_silent`, so a sum over replicas counts the node once."""
    from fleetmend.infra import metrics

    cluster, node = f"e{unique}", "n1"
    js = nc.jetstream()
    await ensure_fault_stream(js)
    stop = asyncio.Event()
    other = HeartbeatMonitor(nc, js, silence_s=0.4, check_interval_s=0.05, publish_gauge=lambda: False)
    task = asyncio.create_task(other.run(stop))
    try:
        await asyncio.sleep(0.1)
        await _beat(nc, cluster, node)
        await assert_eventually(lambda: len(other.published) == 1, timeout_s=10, what="agent_silent published")
        await asyncio.sleep(0.2)
        assert (cluster,) not in {tuple(k) for k in metrics.AGENTS_SILENT._metrics}  # never set by a non-publisher
    finally:
        stop.set()
        await task


async def test_an_agent_that_stops_on_purpose_is_not_reported_silent(nc, unique: str, tmp_path) -> None:
    """`fleetmend agent --once` (the README's "Try it") sends its heartbeats and, as it exits, one with
    `leaving`: the monitor forgets it and no `agent_silent` follows; a node that just stops beating is
    still reported."""
    from agents.runner import run_agent
    from fleetmend.config import load_settings

    cluster = f"l{unique}"
    js = nc.jetstream()
    await ensure_fault_stream(js)
    stop = asyncio.Event()
    mon = HeartbeatMonitor(nc, js, silence_s=1.0, check_interval_s=0.05)
    task = asyncio.create_task(mon.run(stop))
    try:
        await asyncio.sleep(0.1)
        s = load_settings(None, cluster=cluster, node="once", nats_url=nc.connected_url.geturl(),
                          state_dir=tmp_path / "state")
        log = tmp_path / "kern.log"
        log.write_text("[    1.000000] Linux version 6.8.0 (buildd@lcy02) #1 SMP\n")
        assert await run_agent(s, kmsg_file=log, once=True) == 0
        await _beat(nc, cluster, "crashed")  # beats once, then nothing
        await assert_eventually(lambda: [e.node for e in mon.published] == ["crashed"], timeout_s=10,
                                what="the crashed agent reported, the stopped one not")
        await asyncio.sleep(1.5)
        assert [e.node for e in mon.published] == ["crashed"] and (cluster, "once") not in mon.nodes
    finally:
        stop.set()
        await task
