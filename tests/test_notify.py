"""Notifications (webhook, Slack, PagerDuty Events API v2) against a local HTTP server on a free
port, with the sent-record in a real JetStream KV bucket: a retry never sends twice."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import nats
import pytest

from activities.notify import (
    Notifier,
    NotifyError,
    PagerDutyChannel,
    SlackChannel,
    WebhookChannel,
    channels_from_settings,
)
from fleetmend import subjects
from fleetmend.config import NotifySettings
from fleetmend.messages import Notification, NotifyEvent

ALL = {e.value for e in NotifyEvent}


class Hooks:
    """A local HTTP server recording every POST by path; `fail[path] = n` answers 500 n times."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, dict, dict]] = []
        self.fail: dict[str, int] = {}
        hooks = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if hooks.fail.get(self.path, 0) > 0:
                    hooks.fail[self.path] -= 1
                    self.send_response(500)
                    self.end_headers()
                    self.wfile.write(b"down")
                    return
                hooks.posts.append((self.path, dict(self.headers), body))
                self.send_response(202 if self.path == "/pd" else 200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b'{"status": "success"}')

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def to(self, path: str) -> list[dict]:
        return [b for p, _, b in self.posts if p == path]


@pytest.fixture
def hooks():
    h = Hooks()
    yield h
    h.server.shutdown()


def note(event: NotifyEvent, incident: str = "remediate/c1/gpu-7/run1") -> Notification:
    return Notification(event=event, cluster="c1", node="gpu-7", summary=f"gpu-7: xid79 {event.value}",
                        dedup_key=f"fleetmend/{incident}/{event.value}", alert_key=f"fleetmend/{incident}",
                        severity="fatal", incident_id=incident, ticket="FM-000001",
                        runbook="fleetmend runbook xid79")


def channels(h: Hooks) -> list:
    return [WebhookChannel(h.url + "/hook", {"X-Token": "t"}, ALL), SlackChannel(h.url + "/slack", ALL),
            PagerDutyChannel("R0UTING", h.url + "/pd", ALL)]


async def test_each_channel_gets_its_format_once(hooks, nats_server, unique) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        n = Notifier(channels(hooks), nc.jetstream(), bucket=f"notified_{unique}")
        res = await n.send(note(NotifyEvent.TICKET_FILED))
        assert sorted(res.sent) == ["pagerduty", "slack", "webhook"] and res.already == []
        # a retried activity (same dedup key), even from another replica's Notifier: nothing sent again
        other = Notifier(channels(hooks), nc.jetstream(), bucket=f"notified_{unique}")
        again = await other.send(note(NotifyEvent.TICKET_FILED))
        assert again.sent == [] and sorted(again.already) == ["pagerduty", "slack", "webhook"]
        assert len(hooks.posts) == 3
    finally:
        await nc.close()
    (_, headers, hook), = [p for p in hooks.posts if p[0] == "/hook"]
    assert headers["Idempotency-Key"] == "fleetmend/remediate/c1/gpu-7/run1/ticket_filed"
    assert headers["X-Token"] == "t" and hook["event"] == "ticket_filed" and hook["ticket"] == "FM-000001"
    slack, = hooks.to("/slack")
    assert ":ticket:" in slack["text"] and "FM-000001" in slack["text"] and "fleetmend runbook xid79" in slack["text"]
    pd, = hooks.to("/pd")
    assert pd["routing_key"] == "R0UTING" and pd["event_action"] == "trigger"
    assert pd["dedup_key"] == "fleetmend/remediate/c1/gpu-7/run1"  # one PagerDuty alert per incident
    assert pd["payload"]["severity"] == "critical" and pd["payload"]["source"] == "gpu-7"
    assert pd["payload"]["group"] == "c1" and pd["payload"]["summary"].startswith("gpu-7: xid79")


async def test_return_to_service_resolves_the_incidents_page(hooks) -> None:
    n = Notifier([PagerDutyChannel("R0UTING", hooks.url + "/pd", ALL)])
    await n.send(note(NotifyEvent.TICKET_FILED))
    await n.send(note(NotifyEvent.LEMON))
    await n.send(note(NotifyEvent.RETURNED))
    trigger, lemon, resolve = hooks.to("/pd")
    assert trigger["dedup_key"] == lemon["dedup_key"] == resolve["dedup_key"]  # PagerDuty: one alert, one page
    assert (trigger["event_action"], lemon["event_action"], resolve["event_action"]) == ("trigger", "trigger",
                                                                                         "resolve")


async def test_a_failed_channel_is_retried_alone(hooks, nats_server, unique) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        n = Notifier(channels(hooks), nc.jetstream(), bucket=f"notified_{unique}")
        hooks.fail["/slack"] = 1
        with pytest.raises(NotifyError, match="slack") as err:
            await n.send(note(NotifyEvent.DRAINED))
        assert "delivered to webhook, pagerduty" in str(err.value)
        retry = await n.send(note(NotifyEvent.DRAINED))  # what Temporal's retry policy does
        assert retry.sent == ["slack"] and sorted(retry.already) == ["pagerduty", "webhook"]
    finally:
        await nc.close()
    assert len(hooks.to("/hook")) == len(hooks.to("/pd")) == len(hooks.to("/slack")) == 1


async def test_unreachable_channel_is_an_error_not_a_hang(hooks) -> None:
    from fleetmend.dev import servers

    dead = f"http://127.0.0.1:{servers.free_port()}/x"
    with pytest.raises(NotifyError, match="webhook"):
        await Notifier([WebhookChannel(dead, {}, ALL)], timeout_s=2).send(note(NotifyEvent.DRAINED))


def test_settings_choose_channels_and_events() -> None:
    assert channels_from_settings(NotifySettings()) == []
    chans = channels_from_settings(NotifySettings(webhook_url="http://h/", slack_webhook_url="http://s/",
                                                  pagerduty_routing_key="k", events=["drained", "returned"]))
    assert [c.name for c in chans] == ["webhook", "slack", "pagerduty"]
    wh, _, pd = chans
    assert wh.wants(note(NotifyEvent.DRAINED)) and not wh.wants(note(NotifyEvent.LEMON))
    # PagerDuty pages only for what needs a human (not every automatic drain), and resolves on return
    assert not pd.wants(note(NotifyEvent.DRAINED)) and pd.wants(note(NotifyEvent.RETURNED))


async def test_an_incident_notifies_drain_ticket_and_return_once_each(hooks, temporal_client, nats_server,
                                                                      unique) -> None:
    """NodeRemediation on a real Temporal dev server with the real `notify` activity (other side
    effects stand-ins): the local server hears drained, ticket filed and returned, once each."""
    from temporalio.worker import Worker

    from activities.notify import NotifyActivities
    from fleetmend.messages import RepairedCommand
    from tests.activity_standins import Calls, stand_ins
    from tests.conftest import assert_eventually
    from tests.test_workflow import fault, phase_is, start
    from workflows.remediation import NodeRemediation

    nc = await nats.connect(nats_server.url)
    calls, tq = Calls(), f"tq-{unique}"
    acts = [a for a in stand_ins(calls) if a.__name__ != "notify"]
    real = NotifyActivities(Notifier(channels(hooks), nc.jetstream(), bucket=f"notified_{unique}"))
    try:
        async with Worker(temporal_client, task_queue=tq, workflows=[NodeRemediation],
                          activities=acts + [real.notify]):
            h = await start(temporal_client, tq, unique, "n1", [fault(unique, "n1", 79, drain=True)])
            await assert_eventually(lambda: phase_is(h, "awaiting_repair"), what="awaiting_repair")
            await assert_eventually(lambda: len(hooks.to("/hook")) >= 2, what="drain and ticket notified")
            await h.execute_update(NodeRemediation.mark_repaired, RepairedCommand(by="alice@ops", ticket="RMA-1"))
            st = await assert_eventually(lambda: phase_is(h, "closed"), what="closed")
            await h.result()
    finally:
        await nc.close()
    assert st.outcome == "returned_to_service"
    events = [b["event"] for b in hooks.to("/hook")]
    assert events == ["drained", "ticket_filed", "returned"], events
    incident = hooks.to("/hook")[0]["incident_id"]
    assert all(b["dedup_key"] == f"fleetmend/{incident}/{b['event']}" for b in hooks.to("/hook"))
    assert hooks.to("/hook")[1]["ticket"] == "FM-000001" and "xid79" in hooks.to("/hook")[1]["runbook"]
    assert [p["event_action"] for p in hooks.to("/pd")] == ["trigger", "trigger", "resolve"]
    assert len({p["dedup_key"] for p in hooks.to("/pd")}) == 1
    assert len(hooks.to("/slack")) == 3


async def test_breaker_open_is_notified_once_per_trip(hooks, temporal_client, nc, unique) -> None:
    """The elected poller's check against a real FleetGuard whose breaker tripped: one notification,
    however many polls (and pollers) see it."""
    from temporalio.worker import Worker

    from activities.notify import notify_breaker
    from fleetmend.messages import GuardPolicy
    from tests.activity_standins import GUARD_ACTIVITIES, Calls, guard_activities, real_guard, stand_ins
    from tests.conftest import assert_eventually
    from tests.test_workflow import fault, phase_is, start
    from workflows.fleetguard import FleetGuard
    from workflows.remediation import NodeRemediation

    calls, tq, cluster = Calls(), f"tq-{unique}", f"b{unique}"
    guard = real_guard(temporal_client, tq, GuardPolicy(breaker_distinct_nodes=1, cluster_nodes=100), nc.jetstream())
    tq = subjects.cluster_task_queue(tq, cluster)  # the cluster's queue: its incidents and its guard
    acts = [a for a in stand_ins(calls) if a.__name__ not in GUARD_ACTIVITIES]
    notifier = Notifier(channels(hooks))
    async with Worker(temporal_client, task_queue=tq, workflows=[NodeRemediation, FleetGuard],
                      activities=acts + guard_activities(guard, calls)):
        assert await notify_breaker(temporal_client, cluster, notifier) is None  # no FleetGuard yet
        h1 = await start(temporal_client, tq, cluster, "x1", [fault(cluster, "x1", 79, drain=True)])
        await assert_eventually(lambda: phase_is(h1, "awaiting_repair"))
        assert await notify_breaker(temporal_client, cluster, notifier) is None  # breaker closed
        h2 = await start(temporal_client, tq, cluster, "x2", [fault(cluster, "x2", 79, drain=True)])
        await assert_eventually(lambda: phase_is(h2, "awaiting_permit"))
        first = await assert_eventually(lambda: notify_breaker(temporal_client, cluster, notifier),
                                        what="breaker open notified")
        again = await notify_breaker(temporal_client, cluster, notifier)
    assert sorted(first.sent) == ["pagerduty", "slack", "webhook"] and again.sent == []
    (hook,) = hooks.to("/hook")
    assert hook["event"] == "breaker_open" and cluster in hook["summary"] and "x1, x2" in hook["summary"]
    (pd,) = hooks.to("/pd")
    assert pd["payload"]["severity"] == "critical" and pd["event_action"] == "trigger"


async def test_a_lemon_node_is_notified(temporal_client, unique) -> None:
    from temporalio.worker import Worker

    from tests.activity_standins import Calls, stand_ins
    from tests.conftest import assert_eventually
    from tests.test_workflow import fault, phase_is, start
    from workflows.remediation import NodeRemediation

    calls, tq = Calls(lemon="lemon: n9 back with xid79 after 2 repairs"), f"tq-{unique}"
    async with Worker(temporal_client, task_queue=tq, workflows=[NodeRemediation], activities=stand_ins(calls)):
        h = await start(temporal_client, tq, unique, "n9", [fault(unique, "n9", 79, drain=True)])
        await assert_eventually(lambda: phase_is(h, "awaiting_repair"))
        await assert_eventually(lambda: len(calls.notifications) >= 3, what="notified")
    assert [n.event.value for n in calls.notifications] == ["lemon", "drained", "ticket_filed"]
    assert "RMA" in calls.notifications[2].summary and calls.notifications[0].node == "n9"


async def test_no_channels_configured_starts_no_notify_activity(temporal_client, unique) -> None:
    """The router sets `IncidentPolicy.notify` from `[notify]`: nobody to notify, no activity per event."""
    from temporalio.worker import Worker

    from fleetmend.config import Settings
    from fleetmend.messages import IncidentPolicy
    from tests.activity_standins import Calls, stand_ins
    from tests.conftest import assert_eventually
    from tests.test_workflow import fault, phase_is, start
    from workflows.remediation import NodeRemediation

    s = Settings()
    assert IncidentPolicy.from_settings(s.policy, s.notify.any).notify is False
    assert IncidentPolicy.from_settings(s.policy, NotifySettings(slack_webhook_url="http://s/").any).notify
    calls, tq = Calls(), f"tq-{unique}"
    async with Worker(temporal_client, task_queue=tq, workflows=[NodeRemediation], activities=stand_ins(calls)):
        h = await start(temporal_client, tq, unique, "q1", [fault(unique, "q1", 79, drain=True)], notify=False)
        await assert_eventually(lambda: phase_is(h, "awaiting_repair"))
    assert calls.notifications == [] and len(calls.tickets) == 1


async def test_a_fault_that_needs_a_person_but_drains_nothing_is_notified_once(temporal_client, unique) -> None:
    """A degraded `config_drift_topology_repair` (check the cabling a repair touched) drains nothing; before the
    `attention` patch it was seen only in `fleetmend status`. One notification per incident, none for an
    application-side XID (RESTART_APP: the job's owner acts) or an info reading."""
    from temporalio.worker import Worker

    from fleetmend.events import Component, Device, FaultEvent, Severity, Source, Verdict
    from fleetmend.messages import FaultBatch, RoutedFault
    from tests.activity_standins import Calls, stand_ins
    from tests.conftest import assert_eventually
    from tests.test_workflow import fault, row_reading, start
    from workflows.remediation import NodeRemediation

    def drift(eid: str, device: str) -> RoutedFault:
        return RoutedFault(event=FaultEvent(
            cluster=unique, node="t1", component=Component.PCIE, kind="config_drift_topology_repair",
            severity=Severity.DEGRADED, source=Source.ANALYZER, device=Device(name=device), event_id=eid,
            raw="topology.hash before=ab12 after=cd34", message="GPU to NIC placement moved across a repair",
            verdict=Verdict(severity="degraded", immediate_action="CHECK_MECHANICALS",
                            investigatory_action="check the cables, risers and slots the repair touched",
                            fault_class="config_drift_topology_repair", drain=False,
                            **row_reading("config_drift_topology_repair"))))

    calls, tq = Calls(), f"tq-{unique}"
    async with Worker(temporal_client, task_queue=tq, workflows=[NodeRemediation], activities=stand_ins(calls)):
        app = await start(temporal_client, tq, unique, "a1", [fault(unique, "a1", 13, drain=False, severity="degraded")],
                          close_after_idle_s=2.0)
        h = await start(temporal_client, tq, unique, "t1", [drift(f"{unique}-1", "topology.hash")],
                        close_after_idle_s=600.0)
        await assert_eventually(lambda: len(calls.notifications) >= 1, what="attention notified")
        await h.signal(NodeRemediation.faults, FaultBatch(faults=[drift(f"{unique}-2", "topology.hash2")]))
        await app.result()  # the application XID's incident closes recorded, notifying nobody
        st = await h.query(NodeRemediation.status)
        assert st.phase == "triage" and not st.drained
        await h.terminate("test done")
    (n,) = calls.notifications
    assert n.event.value == "attention" and n.node == "t1", n
    assert "config_drift_topology_repair" in n.summary and "CHECK_MECHANICALS" in n.summary and "cables" in n.summary
    assert n.details["fault_class"] == "config_drift_topology_repair" and n.runbook
