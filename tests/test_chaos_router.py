"""Router reliability against real NATS and Temporal: it survives a nats-server restart without
operator action; a message redelivered after a crash between signal and ack is applied once (the
workflow dedupes event ids); a message Temporal never accepts is dead-lettered after `max_deliver`
attempts with the reason; CLI commands carry `by` into the workflow history (audit)."""

from __future__ import annotations

import asyncio
import json

from temporalio.worker import Worker

from fleetmend import subjects
from fleetmend.catalog import load_catalog
from fleetmend.config import load_settings
from fleetmend.events import Component, Device, FaultEvent, Severity, Source
from fleetmend.infra.jetstream import ensure_deadletter_stream, ensure_fault_stream
from fleetmend.messages import AbortCommand
from fleetmend.router.core import Router
from tests.activity_standins import Calls, stand_ins
from tests.conftest import assert_eventually
from workflows.remediation import NodeRemediation


def app_event(cluster: str, node: str, xid: int = 13, bus: str = "0000:3b:00.0") -> FaultEvent:
    """An application-side XID (no drain): the incident stays in triage, recording faults."""
    return FaultEvent(cluster=cluster, node=node, component=Component.GPU, kind="xid", code=xid,
                      severity=Severity.DEGRADED, source=Source.INJECT, device=Device(pci_bus_id=bus))


async def publish(js, ev: FaultEvent) -> None:
    await js.publish(subjects.fault_subject(ev.cluster, ev.node), ev.to_json_bytes(),
                     headers={"Nats-Msg-Id": ev.event_id})


async def status(client, cluster: str, node: str):
    h = client.get_workflow_handle_for(NodeRemediation.run, subjects.workflow_id(cluster, node))
    return await h.query(NodeRemediation.status)


def make_settings(nats_server, temporal_server, tmp_path, unique, **router):
    return load_settings(None, cluster=f"cr{unique}", nats_url=nats_server.url,
                         temporal_address=temporal_server.address, state_dir=tmp_path, task_queue=f"tq-{unique}",
                         router={"nak_delay_s": 0.2, **router})


async def test_router_survives_nats_restart(nats_server, temporal_server, temporal_client, tmp_path, unique):
    from fleetmend.infra.connect import connect_nats

    s = make_settings(nats_server, temporal_server, tmp_path, unique)
    cluster = s.cluster
    nc = await connect_nats(s, name="router-under-test")
    js = nc.jetstream()
    await ensure_fault_stream(js)
    await ensure_deadletter_stream(js)
    stop = asyncio.Event()
    router = Router(s, nc, js, temporal_client, load_catalog(), filter_subject=f"fleet.{cluster}.fault.*",
                    durable=f"r-{unique}")
    async with Worker(temporal_client, task_queue=subjects.cluster_task_queue(s.task_queue, s.cluster),
                      workflows=[NodeRemediation],
                      activities=stand_ins(Calls())):
        task = asyncio.create_task(router.run(stop))
        try:
            before = app_event(cluster, "n1")
            await publish(js, before)
            await assert_eventually(lambda: router.stats.routed == 1, what="routed before the restart")
            nats_server.stop()
            try:
                await asyncio.sleep(1.5)  # the router's fetch loop sees the connection go
                assert not task.done()
            finally:
                nats_server.start()  # session fixture: always back
            await assert_eventually(lambda: nc.is_connected, timeout_s=20, what="router reconnected")
            after = app_event(cluster, "n1", xid=31)

            async def published() -> bool:
                try:
                    await publish(js, after)
                    return True
                except Exception:
                    return False

            await assert_eventually(published, timeout_s=20, what="publish after restart")
            await assert_eventually(lambda: router.stats.routed == 2, timeout_s=30, what="routed after the restart")
            st = await status(temporal_client, cluster, "n1")
            assert {f["event_id"] for f in st.faults} == {before.event_id, after.event_id}
            assert not task.done(), "no operator action: the same router task kept going"
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)
            await nc.close()


async def test_redelivery_after_crash_before_ack_applies_once(nc, temporal_server, temporal_client, nats_server,
                                                              tmp_path, unique, monkeypatch):
    """Router A signals Temporal and 'crashes' before acking (ack suppressed); after ack_wait the
    message is redelivered to router B, which signals again: the workflow records the fault once and
    counts the duplicate."""
    from nats.aio.msg import Msg

    s = make_settings(nats_server, temporal_server, tmp_path, unique, ack_wait_s=2.0)
    cluster = s.cluster
    js = nc.jetstream()
    await ensure_fault_stream(js)
    await ensure_deadletter_stream(js)
    ev = app_event(cluster, "n2")
    async with Worker(temporal_client, task_queue=subjects.cluster_task_queue(s.task_queue, s.cluster),
                      workflows=[NodeRemediation],
                      activities=stand_ins(Calls())):
        real_ack = Msg.ack

        async def lost_ack(self) -> None:
            return None

        monkeypatch.setattr(Msg, "ack", lost_ack)
        stop_a = asyncio.Event()
        a = Router(s, nc, js, temporal_client, load_catalog(), filter_subject=f"fleet.{cluster}.fault.*",
                   durable=f"r-{unique}")
        task_a = asyncio.create_task(a.run(stop_a))
        await publish(js, ev)
        await assert_eventually(lambda: a.stats.signals >= 1, what="router A signalled")
        stop_a.set()
        await task_a
        monkeypatch.setattr(Msg, "ack", real_ack)
        stop_b = asyncio.Event()
        b = Router(s, nc, js, temporal_client, load_catalog(), filter_subject=f"fleet.{cluster}.fault.*",
                   durable=f"r-{unique}")
        task_b = asyncio.create_task(b.run(stop_b))
        try:
            await assert_eventually(lambda: b.stats.routed >= 1, timeout_s=20, what="redelivered to router B")

            async def deduped():
                st = await status(temporal_client, cluster, "n2")
                return st if st.duplicates >= 1 else None

            st = await assert_eventually(deduped, timeout_s=20, what="workflow counted the duplicate")
            assert [f["event_id"] for f in st.faults] == [ev.event_id]
            assert st.faults[0]["count"] == 1
            ci = await js.consumer_info(subjects.FAULT_STREAM, f"r-{unique}")
            assert ci.num_ack_pending == 0 and ci.num_pending == 0
        finally:
            stop_b.set()
            await task_b


class _TemporalDown:
    """A Temporal client whose every call fails (the server is unreachable)."""

    async def start_workflow(self, *args, **kwargs):
        raise RuntimeError("temporal unreachable (test)")


async def test_message_temporal_never_accepts_is_deadlettered_after_bounded_attempts(nc, nats_server,
                                                                                   temporal_server, tmp_path, unique):
    s = make_settings(nats_server, temporal_server, tmp_path, unique, max_deliver=3, nak_delay_s=0.1)
    cluster = s.cluster
    js = nc.jetstream()
    await ensure_fault_stream(js)
    await ensure_deadletter_stream(js)
    router = Router(s, nc, js, _TemporalDown(), load_catalog(), filter_subject=f"fleet.{cluster}.fault.*",
                    durable=f"r-{unique}")
    stop = asyncio.Event()
    task = asyncio.create_task(router.run(stop))
    ev = app_event(cluster, "n3")
    try:
        await publish(js, ev)
        await assert_eventually(lambda: router.stats.deadlettered == 1, timeout_s=30, what="dead-lettered")
        assert router.stats.naks == 2, router.stats
        info = await js.stream_info(subjects.DEADLETTER_STREAM)
        last = json.loads((await js.get_msg(subjects.DEADLETTER_STREAM, info.state.last_seq)).data)
        assert last["subject"] == subjects.fault_subject(cluster, "n3")
        assert "not accepted by Temporal after 3 deliveries" in last["reason"]
        assert "temporal unreachable (test)" in last["reason"]
        ci = await js.consumer_info(subjects.FAULT_STREAM, f"r-{unique}")
        assert ci.num_ack_pending == 0 and ci.num_pending == 0, "termed, not left to redeliver"
    finally:
        stop.set()
        await task


async def test_cli_command_by_is_in_workflow_history(temporal_client, temporal_server, tmp_path, unique):
    """`fleetmend abort` sends AbortCommand(by=user@host); the update's input, with `by`, is in the
    workflow history (what the Temporal UI shows), and the timeline names who."""
    from temporalio.api.enums.v1 import EventType

    cluster, node = f"au{unique}", "n4"
    async with Worker(temporal_client, task_queue=f"tq-{unique}", workflows=[NodeRemediation],
                      activities=stand_ins(Calls())):
        from fleetmend.events import Verdict
        from fleetmend.messages import FaultBatch, IncidentInput, RoutedFault

        ev = app_event(cluster, node).model_copy(update={"verdict": Verdict(
            severity="degraded", immediate_action="RESTART_APP", fault_class="xid13")})
        h = await temporal_client.start_workflow(
            NodeRemediation.run, IncidentInput(cluster=cluster, node=node), id=subjects.workflow_id(cluster, node),
            task_queue=f"tq-{unique}", start_signal="faults",
            start_signal_args=[FaultBatch(faults=[RoutedFault(event=ev)])])
        await h.execute_update("abort", AbortCommand(by="alice@ops-host", note="chaos audit"), result_type=str)
        await h.result()
        found = False
        async for e in h.fetch_history_events():
            if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED:
                payloads = e.workflow_execution_update_accepted_event_attributes.accepted_request.input.args.payloads
                found = found or any(b"alice@ops-host" in p.data for p in payloads)
        assert found, "the update's `by` is recorded in history"
        st = await h.query(NodeRemediation.status)
        assert any(t.get("by") == "alice@ops-host" for t in st.timeline), st.timeline


async def test_deadletters_counted_in_fleet_status(nc, nats_server, temporal_server, tmp_path, unique):
    """Non-UTF-8, truncated, oversized and wrong-schema messages are dead-lettered, and `fleetmend
    status` shows the count with reasons."""
    import os
    import subprocess
    import sys

    from fleetmend.cli.ledger import deadletter_line
    from fleetmend.router.core import MAX_EVENT_BYTES

    s = make_settings(nats_server, temporal_server, tmp_path, unique)
    cluster = s.cluster
    js = nc.jetstream()
    await ensure_fault_stream(js)
    await ensure_deadletter_stream(js)
    good = app_event(cluster, "n5")
    wrong_version = json.loads(good.to_json_bytes())
    wrong_version["schema_version"] = 99
    bad = [b"\xff\xfe\xfd", good.to_json_bytes()[:-7], b" " * (MAX_EVENT_BYTES + 1),
           json.dumps(wrong_version).encode()]
    before = (await js.stream_info(subjects.DEADLETTER_STREAM)).state.messages
    for data in bad:
        await js.publish(subjects.fault_subject(cluster, "n5"), data)
    router = Router(s, nc, js, _TemporalDown(), load_catalog(), filter_subject=f"fleet.{cluster}.fault.*",
                    durable=f"r-{unique}")
    stop = asyncio.Event()
    task = asyncio.create_task(router.run(stop))
    try:
        await assert_eventually(lambda: router.stats.deadlettered == 4, timeout_s=20, what="4 dead letters")
    finally:
        stop.set()
        await task
    assert sum(router.stats.deadletter_reasons.values()) == 4
    line = await deadletter_line(s)
    assert line.startswith(f"dead letters: {before + 4} ("), line
    for reason in ("not_utf8", "not_json", "oversized", "invalid_event"):
        assert f"{reason}: " in line, line
    env = {**os.environ, "FLEETMEND_NATS_URL": nats_server.url, "FLEETMEND_TEMPORAL_ADDRESS": temporal_server.address,
           "FLEETMEND_CLUSTER": cluster, "FLEETMEND_STATE_DIR": str(tmp_path)}
    p = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "fleetmend.cli.main", "status"], env=env,
                                capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert f"dead letters: {before + 4}" in p.stdout, p.stdout
    away = load_settings(None, nats_url="nats://127.0.0.1:1", nats_connect_timeout_s=0.5)
    assert (await deadletter_line(away)).startswith("dead letters: unknown"), "status still prints without NATS"
