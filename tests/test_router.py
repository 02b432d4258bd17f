"""The router against real NATS JetStream and real Temporal: ack only after Temporal accepted,
dead-letter (with the reason) what can never be valid, never crash on bad input, nak while
Temporal is away and deliver once it is back."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import pytest
from temporalio.client import Client
from temporalio.worker import Worker

from fleetmend import subjects
from fleetmend.catalog import load_catalog
from fleetmend.config import load_settings
from fleetmend.dev import servers
from fleetmend.events import Component, Device, FaultEvent, Severity, Source
from fleetmend.infra.converter import data_converter
from fleetmend.infra.jetstream import ensure_deadletter_stream, ensure_fault_stream
from fleetmend.router.core import MAX_EVENT_BYTES, Router, decode_event
from tests.activity_standins import Calls, stand_ins
from tests.conftest import assert_eventually
from workflows.remediation import NodeRemediation


def xid_event(cluster: str, node: str, xid: int = 79, **kw) -> FaultEvent:
    return FaultEvent(cluster=cluster, node=node, component=Component.GPU, kind="xid", code=xid,
                      severity=Severity.FATAL, source=Source.INJECT, device=Device(pci_bus_id="0000:3b:00.0"),
                      raw=f"NVRM: Xid (PCI:0000:3b:00): {xid}, pid='<unknown>', name=<unknown>, test", **kw)


async def deadletters(js, subject_prefix: str) -> list[dict]:
    info = await js.stream_info(subjects.DEADLETTER_STREAM)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            m = await js.get_msg(subjects.DEADLETTER_STREAM, seq)
        except Exception:
            continue
        rec = json.loads(m.data)
        if rec["subject"].startswith(subject_prefix):
            out.append(rec)
    return out


async def run_router(settings, nc, client, cluster: str, unique: str):
    stop = asyncio.Event()
    r = Router(settings, nc, nc.jetstream(), client, load_catalog(), filter_subject=f"fleet.{cluster}.fault.*",
               durable=f"r-{unique}")
    task = asyncio.create_task(r.run(stop))
    return r, stop, task


@pytest.fixture
def settings(nats_server, temporal_server, tmp_path, unique):
    return load_settings(None, cluster=f"rt{unique}", nats_url=nats_server.url,
                         temporal_address=temporal_server.address, state_dir=tmp_path, task_queue=f"tq-{unique}",
                         router={"nak_delay_s": 0.2, "max_deliver": 50})


def test_decode_rejects_what_can_never_be_valid():
    good = xid_event("c1", "n1")
    assert decode_event("fleet.c1.fault.n1", good.to_json_bytes()).event_id == good.event_id
    cases = {
        b"\xff\xfe not utf-8": "not UTF-8",
        b"{not json": "not JSON",
        b"[1, 2]": "not a JSON object",
        b'{"cluster": "c1"}': "invalid FaultEvent",
        good.model_copy(update={"schema_version": 99}).to_json_bytes(): "schema_version 99",
        b" " * (MAX_EVENT_BYTES + 1): "oversized",
    }
    for data, reason in cases.items():
        with pytest.raises(Exception) as ei:
            decode_event("fleet.c1.fault.n1", data)
        assert reason in str(ei.value), (data[:30], str(ei.value))
    with pytest.raises(Exception, match="arrived on the subject of c1/n2"):
        decode_event("fleet.c1.fault.n2", good.to_json_bytes())
    with pytest.raises(Exception, match="not a fault subject"):
        decode_event("fleet.c1.hb.n1", good.to_json_bytes())


async def test_bad_input_is_deadlettered_with_reason_and_good_input_routed(settings, nc, temporal_client, unique):
    js = nc.jetstream()
    await ensure_fault_stream(js)
    await ensure_deadletter_stream(js)
    cluster = settings.cluster
    calls = Calls()
    async with Worker(temporal_client, task_queue=subjects.cluster_task_queue(settings.task_queue, settings.cluster),
                      workflows=[NodeRemediation],
                      activities=stand_ins(calls)):
        router, stop, task = await run_router(settings, nc, temporal_client, cluster, unique)
        try:
            spoofed = xid_event(cluster, "other-node")
            await js.publish(subjects.fault_subject(cluster, "n1"), b"\xff\xfe\x00garbage")
            await js.publish(subjects.fault_subject(cluster, "n1"), b'{"schema_version": 1, "kind": "xid"}')
            await js.publish(subjects.fault_subject(cluster, "n1"), spoofed.to_json_bytes())
            good = xid_event(cluster, "n1")
            await js.publish(subjects.fault_subject(cluster, "n1"), good.to_json_bytes(),
                             headers={"Nats-Msg-Id": good.event_id})
            dl = await assert_eventually(
                lambda: _at_least(deadletters(js, f"fleet.{cluster}."), 3), what="3 dead letters")
            reasons = sorted(d["reason"] for d in dl)
            assert any("not UTF-8" in r for r in reasons)
            assert any("invalid FaultEvent" in r for r in reasons)
            assert any("arrived on the subject of" in r for r in reasons)
            assert base64.b64decode(dl[0]["data_b64"]), "the original bytes are kept"

            async def routed():
                h = temporal_client.get_workflow_handle_for(NodeRemediation.run, subjects.workflow_id(cluster, "n1"))
                st = await h.query(NodeRemediation.status)
                return st if st.faults else None

            st = await assert_eventually(routed, what="good event in the workflow")
            assert st.faults[0]["event_id"] == good.event_id and st.faults[0]["fault_class"] == "xid79"
            assert not task.done(), "the router is still running after bad input"
            ci = await js.consumer_info(subjects.FAULT_STREAM, f"r-{unique}")
            await assert_eventually(lambda: _no_pending(js, unique), what="everything acked or termed")
            assert router.stats.deadlettered == 3 and router.stats.routed == 1, (router.stats, ci)
        finally:
            stop.set()
            await task


async def _at_least(coro, n):
    got = await coro
    return got if len(got) >= n else None


async def _no_pending(js, unique):
    from nats.js.errors import NotFoundError

    try:
        ci = await js.consumer_info(subjects.FAULT_STREAM, f"r-{unique}")
    except NotFoundError:  # the router has not created its durable consumer yet
        return False
    return ci.num_ack_pending == 0 and ci.num_pending == 0


async def test_temporal_away_means_nak_then_delivery_once_back(nats_server, nc, tmp_path: Path, unique: str):
    """A private Temporal server is stopped while an event arrives: the router naks (no ack, no loss),
    and when the same server (same SQLite file) is back the event reaches exactly one workflow."""
    port = servers.free_port()
    db = tmp_path / "t.db"
    proc = servers.start_temporal(db, port, servers.free_port(), ui=False)
    address = f"127.0.0.1:{port}"
    await servers.wait_temporal_ready(address)
    cluster = f"away{unique}"
    s = load_settings(None, cluster=cluster, nats_url=nats_server.url, temporal_address=address,
                      state_dir=tmp_path, task_queue=f"tq-{unique}",
                      router={"nak_delay_s": 0.2, "temporal_call_timeout_s": 2.0})
    client = await Client.connect(address, data_converter=data_converter)
    js = nc.jetstream()
    await ensure_fault_stream(js)
    await ensure_deadletter_stream(js)
    router, stop, task = await run_router(s, nc, client, cluster, unique)
    try:
        proc.stop()
        ev = xid_event(cluster, "n9")
        await js.publish(subjects.fault_subject(cluster, "n9"), ev.to_json_bytes(), headers={"Nats-Msg-Id": ev.event_id})
        await assert_eventually(lambda: router.stats.naks >= 2, timeout_s=60, what="naks while Temporal is away")
        assert router.stats.routed == 0 and router.stats.deadlettered == 0
        proc.start()
        await servers.wait_temporal_ready(address)
        await assert_eventually(lambda: router.stats.routed == 1, timeout_s=90, what="routed after Temporal is back")
        desc = await client.get_workflow_handle(subjects.workflow_id(cluster, "n9")).describe()
        assert desc.status is not None
        await asyncio.sleep(1.0)
        assert router.stats.routed == 1, "delivered once, not again"
    finally:
        stop.set()
        await task
        proc.stop()



def _ib(cluster: str, node: str, up: bool) -> FaultEvent:
    return FaultEvent(cluster=cluster, node=node, component=Component.IB, kind="ib_port_down",
                      severity=Severity.INFO if up else Severity.DEGRADED, healthy=up, source=Source.INJECT,
                      device=Device(name="mlx5_0", port=1),
                      raw=f"mlx5_core 0000:4b:00.0 mlx5_0: Port: 1 Link {'ACTIVE' if up else 'DOWN'}")


def test_collapse_keeps_every_occurrence_and_orders_by_the_latest():
    from fleetmend.catalog import default_catalog
    from fleetmend.router.core import collapse

    d1, u1, x, d2, u2, d3 = (_ib("c", "n", False), _ib("c", "n", True), xid_event("c", "n", 13),
                             _ib("c", "n", False), _ib("c", "n", True), _ib("c", "n", False))
    out = collapse([d1, u1, x, d2, u2, d3], default_catalog())
    assert [(rf.event.event_id, [r.event_id for r in rf.repeats]) for rf in out] == [
        (x.event_id, []), (u1.event_id, [u2.event_id]), (d1.event_id, [d2.event_id, d3.event_id])]
    assert collapse([], default_catalog()) == []
    assert out[0].event.verdict.fault_class == "xid13" and out[2].event.verdict.clearable  # stamped by the router


def test_the_router_reads_the_producers_verdict_and_classifies_only_events_without_one():
    from fleetmend.catalog import default_catalog
    from fleetmend.events import Verdict
    from fleetmend.router.core import collapse

    mine = Verdict(severity=Severity.FATAL, immediate_action="RMA", fault_class="operator_reading", drain=True)
    stamped = xid_event("c", "n", 13).model_copy(update={"verdict": mine})
    bare = xid_event("c", "n2", 79)
    out = collapse([stamped, bare], default_catalog())
    assert out[0].event.verdict is mine  # read, not classified again
    assert out[1].event.verdict is not None and out[1].event.verdict.fault_class == "xid79" and out[1].event.verdict.drain


def test_producers_classify_once_when_they_build_the_event():
    """The kmsg parser stamps each event with the catalog's verdict (severity, drain, recovery, checks)."""
    from agents.kmsg import parse_text

    (ev,) = parse_text("NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.")
    assert ev.verdict is not None and ev.verdict.fault_class == "xid79" and ev.verdict.drain
    assert ev.verdict.severity is ev.severity is Severity.FATAL and "pcie_link_width" in ev.verdict.verify


async def test_a_nodes_storm_is_collapsed_and_every_event_counted(settings, nc, temporal_client, unique):
    """300 flapping events of one node queued before the router starts: far fewer signals than
    events, every distinct event counted once in the workflow, and the last word (DOWN) stands."""
    js = nc.jetstream()
    await ensure_fault_stream(js)
    cluster = settings.cluster
    events = [_ib(cluster, "s1", up=i % 2 == 1) for i in range(299)] + [_ib(cluster, "s1", up=False)]
    for ev in events:
        await js.publish(subjects.fault_subject(cluster, "s1"), ev.to_json_bytes(), headers={"Nats-Msg-Id": ev.event_id})
    calls = Calls()
    s = settings.model_copy(update={"policy": settings.policy.model_copy(update={"observe_only": True,
                                                                                 "debounce_s": 3600.0})})
    async with Worker(temporal_client, task_queue=subjects.cluster_task_queue(s.task_queue, s.cluster),
                      workflows=[NodeRemediation],
                      activities=stand_ins(calls)):
        router, stop, task = await run_router(s, nc, temporal_client, cluster, unique)
        try:
            await assert_eventually(lambda: _no_pending(js, unique), what="all 300 acked")
            h = temporal_client.get_workflow_handle_for(NodeRemediation.run, subjects.workflow_id(cluster, "s1"))

            async def counted():
                st = await h.query(NodeRemediation.status)
                return st if sum(f["count"] for f in st.faults) == 300 else None

            st = await assert_eventually(counted, what="300 occurrences in the incident")
            assert router.stats.routed == 300 and router.stats.signals < 30, router.stats
            assert st.duplicates == 0 and calls.drains == []
            down = next(f for f in st.faults if not f["healthy"])
            up = next(f for f in st.faults if f["healthy"])
            assert (down["count"], up["count"]) == (151, 149) and down["last_seq"] > up["last_seq"]
            hist = await h.fetch_history()
            signals = [json.loads(e.workflow_execution_signaled_event_attributes.input.payloads[0].data)
                       for e in hist.events if e.HasField("workflow_execution_signaled_event_attributes")]
            entries = [len(sig["faults"]) for sig in signals]
            assert sum(entries) <= 2 * len(signals) < 60, f"collapsed: {entries}"
            assert sum(1 + len(rf["repeats"]) for sig in signals for rf in sig["faults"]) == 300
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)


async def test_a_message_held_past_half_its_ack_wait_is_kept_from_redelivery(settings, nc, temporal_client, unique):
    js = nc.jetstream()
    s = settings.model_copy(update={"router": settings.router.model_copy(update={"ack_wait_s": 2.0})})
    r = Router(s, nc, js, temporal_client, load_catalog(), filter_subject=f"fleet.{s.cluster}.fault.*",
               durable=f"r-{unique}")
    psub = await r.setup()
    ev = xid_event(s.cluster, "h1")
    await js.publish(subjects.fault_subject(s.cluster, "h1"), ev.to_json_bytes())
    [msg] = await psub.fetch(1, timeout=5)
    import time

    items = [(msg, ev, time.monotonic() - 1.5)]  # fetched 1.5 s ago: past half of the 2 s ack wait
    await r._keep_alive(items)
    assert items[0][2] > time.monotonic() - 0.5, "the hold clock restarts"
    await asyncio.sleep(1.5)  # past the original deadline
    from nats.errors import TimeoutError as NatsTimeout

    with pytest.raises((NatsTimeout, asyncio.TimeoutError)):
        await psub.fetch(1, timeout=0.3)
    await msg.ack()
    await asyncio.sleep(2.5)  # and without the keep-alive it would have come back:
    await js.publish(subjects.fault_subject(s.cluster, "h1"), xid_event(s.cluster, "h1").to_json_bytes())
    [m2] = await psub.fetch(1, timeout=5)
    await asyncio.sleep(2.5)
    [again] = await psub.fetch(1, timeout=5)
    assert again.metadata.sequence.stream == m2.metadata.sequence.stream and again.metadata.num_delivered == 2
    await again.ack()


def test_decode_limits_are_stated_and_enforced():
    """Depth, size and value limits of the contract (fleetmend.events) are dead-letter reasons, not
    exceptions escaping the decoder."""
    from fleetmend.errors import InvalidEventError
    from fleetmend.events import MAX_JSON_DEPTH

    good = xid_event("c1", "n1").as_dict()
    deep = b"{\"a\": " + b"[" * 30_000 + b"]" * 30_000 + b"}"
    with pytest.raises(InvalidEventError, match=f"nested 30001 levels deep > {MAX_JSON_DEPTH}"):
        decode_event("fleet.c1.fault.n1", deep)
    for when in ("9999-12-31T23:59:59-23:59", "0001-01-01T00:00:00+14:00", "1969-12-31T00:00:00+00:00"):
        with pytest.raises(InvalidEventError, match="observed_at"):
            decode_event("fleet.c1.fault.n1", json.dumps({**good, "observed_at": when}).encode())
    # brackets inside strings are text, not nesting
    ok = {**good, "raw": "[" * 5000}
    assert decode_event("fleet.c1.fault.n1", json.dumps(ok).encode()).raw.startswith("[[[")


def test_an_agent_clock_ahead_is_clamped_and_recorded():
    from datetime import datetime, timedelta, timezone

    from fleetmend.events import CLAMPED_FROM_ATTR, MAX_CLOCK_SKEW_S

    now = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)
    ahead = xid_event("c1", "n1", observed_at=now + timedelta(days=3 * 365))
    got = ahead.clamp_observed_at(now)
    assert got.observed_at == now and got.attrs[CLAMPED_FROM_ATTR] == ahead.observed_at.isoformat()
    within = xid_event("c1", "n1", observed_at=now + timedelta(seconds=MAX_CLOCK_SKEW_S - 1))
    assert within.clamp_observed_at(now) is within


async def test_poison_messages_never_stop_the_router(settings, nc, temporal_client, unique):
    """A batch with JSON nested 60k deep, an observed_at that overflows when converted to UTC and
    an event years ahead between two valid events: the poison is dead-lettered with its reason, the
    valid events reach their incident, the future one clamped, and the router keeps running."""
    from datetime import datetime, timedelta, timezone

    from fleetmend.events import CLAMPED_FROM_ATTR

    js = nc.jetstream()
    await ensure_fault_stream(js)
    await ensure_deadletter_stream(js)
    cluster = settings.cluster
    calls = Calls()
    subject = subjects.fault_subject(cluster, "n1")
    first = xid_event(cluster, "n1", xid=13)
    overflow = json.loads(xid_event(cluster, "n1").to_json_bytes())
    overflow["observed_at"] = "9999-12-31T23:59:59-23:59"
    future = xid_event(cluster, "n1", xid=31, observed_at=datetime.now(timezone.utc) + timedelta(days=3 * 365))
    last = xid_event(cluster, "n1", xid=79)
    for data in (first.to_json_bytes(), b"[" * 60_000, json.dumps(overflow).encode(), future.to_json_bytes(),
                 last.to_json_bytes()):
        await js.publish(subject, data)
    async with Worker(temporal_client, task_queue=subjects.cluster_task_queue(settings.task_queue, settings.cluster),
                      workflows=[NodeRemediation],
                      activities=stand_ins(calls)):
        router, stop, task = await run_router(settings, nc, temporal_client, cluster, unique)
        try:
            dl = await assert_eventually(lambda: _at_least(deadletters(js, subject), 2), what="2 dead letters")
            reasons = " | ".join(d["reason"] for d in dl)
            assert "nested 60000 levels deep" in reasons and "observed_at" in reasons, reasons

            async def routed():
                h = temporal_client.get_workflow_handle_for(NodeRemediation.run, subjects.workflow_id(cluster, "n1"))
                st = await h.query(NodeRemediation.status)
                return st if len(st.faults) >= 3 else None

            st = await assert_eventually(routed, timeout_s=60, what="the 3 valid events in the workflow")
            ids = {f["event_id"] for f in st.faults}
            assert {first.event_id, future.event_id, last.event_id} <= ids
            assert not task.done(), "the router is still running"
            await assert_eventually(lambda: _no_pending(js, unique), what="everything acked or termed")
            assert router.stats.deadlettered == 2 and router.stats.routed == 3, router.stats
        finally:
            stop.set()
            await task
    clamped = [f for f in st.faults if f["event_id"] == future.event_id][0]
    assert CLAMPED_FROM_ATTR in str(clamped) or clamped.get("observed_at", "")[:4] != str(future.observed_at.year)


async def test_a_message_at_max_deliveries_is_deadlettered_not_dropped(settings, nc, temporal_client, unique):
    """Whatever keeps a message from being acked (here: a consumer that fetches and never acks, as a
    crash-looping router would), JetStream's max-deliveries advisory makes it a dead letter."""
    from nats.js.api import AckPolicy, ConsumerConfig

    js = nc.jetstream()
    await ensure_fault_stream(js)
    await ensure_deadletter_stream(js)
    cluster = settings.cluster
    subject = subjects.fault_subject(cluster, "n9")
    durable = f"r-{unique}"
    router = Router(settings, nc, js, temporal_client, load_catalog(), filter_subject=subject, durable=durable)
    sub = await router.watch_max_deliveries()
    try:
        psub = await js.pull_subscribe(subject, durable=durable, stream=subjects.FAULT_STREAM,
                                       config=ConsumerConfig(durable_name=durable, ack_policy=AckPolicy.EXPLICIT,
                                                             ack_wait=1.0, max_deliver=2, filter_subject=subject))
        ev = xid_event(cluster, "n9")
        ack = await js.publish(subject, ev.to_json_bytes())
        for _ in range(2):  # delivered twice, never acked
            msgs = await psub.fetch(1, timeout=5)
            assert msgs[0].metadata.sequence.stream == ack.seq

        async def fetching_on() -> list | None:  # the consumer keeps pulling, as a router does
            try:
                got = await psub.fetch(1, timeout=0.5)
            except asyncio.TimeoutError:  # nats' TimeoutError derives from it
                got = []
            assert not got, "a third delivery beyond max_deliver"
            return await _at_least(deadletters(js, subject), 1)

        dl = await assert_eventually(fetching_on, timeout_s=30, what="the max-deliveries dead letter")
        assert dl[0]["stream_seq"] == ack.seq and "max deliveries (2)" in dl[0]["reason"]
        assert json.loads(base64.b64decode(dl[0]["data_b64"]))["event_id"] == ev.event_id
    finally:
        await sub.unsubscribe()


async def test_400_distinct_15k_faults_then_xid79_still_drains(settings, nc, temporal_client, unique):
    """Byte budget: 400 distinct application faults with 15 KiB of raw text each (6 MB of text) into
    one incident, then an XID 79: every signal and the workflow's state stay within Temporal's
    payload limit, the incident records them and drains on the XID 79."""
    js = nc.jetstream()
    await ensure_fault_stream(js)
    await ensure_deadletter_stream(js)
    cluster, node = settings.cluster, "big"
    subject = subjects.fault_subject(cluster, node)
    text = ("NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=python, Graphics Exception: ESR 0x404600=0x80000001 "
            * 200)[:15 * 1024]
    for i in range(400):
        ev = FaultEvent(cluster=cluster, node=node, component=Component.GPU, kind="xid", code=13,
                        severity=Severity.DEGRADED, source=Source.INJECT,
                        device=Device(pci_bus_id=f"0000:{i // 200 + 1:02x}:{i % 200:02x}.0"), raw=text + f" #{i}",
                        attrs={f"k{j}": "v" * 300 for j in range(40)})
        await js.publish(subject, ev.to_json_bytes())
    calls = Calls()
    settings = settings.model_copy(update={"policy": settings.policy.model_copy(
        update={"debounce_s": 0.0, "app_xid_repeats": 100})})
    async with Worker(temporal_client, task_queue=subjects.cluster_task_queue(settings.task_queue, settings.cluster),
                      workflows=[NodeRemediation],
                      activities=stand_ins(calls)):
        router, stop, task = await run_router(settings, nc, temporal_client, cluster, unique)
        try:
            h = temporal_client.get_workflow_handle_for(NodeRemediation.run, subjects.workflow_id(cluster, node))

            async def absorbed():
                try:
                    st = await h.query(NodeRemediation.status)
                except Exception:
                    return None
                return st if len(st.faults) + st.faults_dropped >= 400 else None

            st = await assert_eventually(absorbed, timeout_s=120, what="400 faults absorbed")
            assert not st.drained
            await js.publish(subject, xid_event(cluster, node, xid=79).to_json_bytes())

            async def drained():
                st = await h.query(NodeRemediation.status)
                return st if st.drained else None

            st = await assert_eventually(drained, timeout_s=90, what="drained on the later XID 79")
            assert [d for d in calls.drains if d.node == node]
            assert router.stats.deadlettered == 0 and router.stats.signals > 1, router.stats
            hist = await h.fetch_history()
            failed = [e for e in hist.events if e.HasField("workflow_task_failed_event_attributes")]
            assert not failed, failed[:1]
            rec = next(f for f in st.faults if f["code"] == 13)
            assert len(rec["raw"].encode()) <= 1024 and "more bytes in FLEET_FAULTS seq" in rec["raw"]
            assert rec["stream_seq"] is not None
        finally:
            stop.set()
            await task
