"""Prometheus metrics: scraped over HTTP (httpx) from the router in-process, from the activities,
and from a real `fleetmend worker` process; names, bounded labels and values that moved."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from temporalio.testing import ActivityEnvironment
from temporalio.worker import Worker

from activities.scheduler import SchedulerActivities
from fleetmend import subjects
from fleetmend.catalog import load_catalog
from fleetmend.config import load_settings
from fleetmend.dev import servers
from fleetmend.infra import metrics
from fleetmend.infra.jetstream import ensure_deadletter_stream, ensure_fault_stream
from fleetmend.messages import DrainRequest, DrainResult, UndrainRequest, UndrainResult
from fleetmend.router.core import Router
from tests.activity_standins import Calls, stand_ins
from tests.conftest import assert_eventually
from tests.test_router import xid_event
from workflows.remediation import NodeRemediation

FORBIDDEN_LABELS = {"node", "event_id", "incident_id", "workflow_id"}


@pytest.fixture(scope="module")
def metrics_url() -> str:
    port = servers.free_port()
    srv = metrics.start_http_server(port, "127.0.0.1")
    yield f"http://127.0.0.1:{port}/metrics"
    srv.shutdown()


async def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    async with httpx.AsyncClient(timeout=5) as c:
        r = await c.get(url)
    r.raise_for_status()
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            assert not FORBIDDEN_LABELS & set(s.labels), f"unbounded label in {s.name}: {s.labels}"
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def test_deadletter_reasons_are_a_closed_set() -> None:
    assert metrics.deadletter_reason("not UTF-8 at byte 0") == "not_utf8"
    assert metrics.deadletter_reason("not JSON: Expecting value at line 1 column 1") == "not_json"
    assert metrics.deadletter_reason("invalid FaultEvent: kind: Field required") == "invalid_event"
    assert metrics.deadletter_reason("event names c/a but arrived on the subject of c/b") == "node_mismatch"
    assert metrics.deadletter_reason("not accepted by Temporal after 50 deliveries: x") == "temporal_rejected"
    assert metrics.deadletter_reason("something new") == "other"
    assert set(metrics.DEADLETTER_REASONS) >= {metrics.deadletter_reason(x) for x in ("a", "oversized: 1 bytes")}


async def test_router_metrics_move(metrics_url, nats_server, temporal_server, temporal_client, nc, tmp_path,
                                   unique) -> None:
    s = load_settings(None, cluster=f"m{unique}", nats_url=nats_server.url, temporal_address=temporal_server.address,
                      state_dir=tmp_path, task_queue=f"tq-{unique}")
    js = nc.jetstream()
    await ensure_fault_stream(js)
    await ensure_deadletter_stream(js)
    before = await scrape(metrics_url)
    calls = Calls()
    async with Worker(temporal_client, task_queue=subjects.cluster_task_queue(s.task_queue, s.cluster),
                      workflows=[NodeRemediation],
                      activities=stand_ins(calls)):
        stop = asyncio.Event()
        router = Router(s, nc, js, temporal_client, load_catalog(), filter_subject=f"fleet.{s.cluster}.fault.*",
                        durable=f"m-{unique}")
        task = asyncio.create_task(router.run(stop))
        try:
            await js.publish(subjects.fault_subject(s.cluster, "n1"), b"{not json")
            good = xid_event(s.cluster, "n1")
            await js.publish(subjects.fault_subject(s.cluster, "n1"), good.to_json_bytes(),
                             headers={"Nats-Msg-Id": good.event_id})
            await assert_eventually(lambda: router.stats.routed == 1 and router.stats.deadlettered == 1,
                                    what="one routed, one dead-lettered")
            assert await metrics.refresh_router_lag(js, subjects.FAULT_STREAM, f"m-{unique}") == 0
            counts = await assert_eventually(lambda: _incidents(temporal_client, s.cluster), what="incident visible")
            after = await scrape(metrics_url)
        finally:
            stop.set()
            await task
    d = lambda name, **kw: value(after, name, **kw) - value(before, name, **kw)  # noqa: E731
    assert d("fleetmend_router_deadletters_total", reason="not_json") == 1
    assert d("fleetmend_router_events_total", cluster=s.cluster, kind="xid", severity="fatal", source="inject") == 1
    assert d("fleetmend_router_accept_seconds_count", cluster=s.cluster) == 1
    assert value(after, "fleetmend_router_lag_messages", consumer=f"m-{unique}") == 0
    phase, n = next(iter(counts.items()))
    assert value(after, "fleetmend_incidents", cluster=s.cluster, phase=phase) == n == 1
    assert ("fleetmend_drains_in_force", frozenset({("cluster", s.cluster)})) in after


async def _incidents(client, cluster: str) -> dict | None:
    counts = await metrics.refresh_incidents(client, cluster)
    return counts or None


class _Adapter:
    name = "fake"

    async def drain(self, node: str, reason: str, incident_id: str) -> DrainResult:
        return DrainResult(node, True, True, False, "drained", "ok")

    async def undrain(self, node: str, incident_id: str) -> UndrainResult:
        return UndrainResult(node, True, "idle", "ok")

    async def state(self, node: str) -> str:
        return "drained"


async def test_activity_metrics_time_to_quarantine_and_mttr(metrics_url, unique) -> None:
    cluster = f"a{unique}"
    acts = SchedulerActivities(_Adapter())
    env = ActivityEnvironment()
    now = datetime.now(timezone.utc)
    await env.run(acts.drain_node, DrainRequest(cluster, "n1", "xid79 incident i", "i",
                                                observed_at=now - timedelta(seconds=7)))
    await env.run(acts.undrain_node, UndrainRequest(cluster, "n1", "i", drained_at=now - timedelta(hours=5)))
    await env.run(acts.drain_node, DrainRequest(cluster, "n2", "xid79 incident j", "j"))  # old caller: no time
    m = await scrape(metrics_url)
    assert value(m, "fleetmend_drains_total", cluster=cluster, scheduler="fake", outcome="owned") == 2
    assert value(m, "fleetmend_undrains_total", cluster=cluster, outcome="resumed") == 1
    assert value(m, "fleetmend_time_to_quarantine_seconds_count", cluster=cluster) == 1
    assert 6 < value(m, "fleetmend_time_to_quarantine_seconds_sum", cluster=cluster) < 60
    assert value(m, "fleetmend_time_to_quarantine_seconds_bucket", cluster=cluster, le="10.0") == 1
    assert value(m, "fleetmend_mttr_seconds_bucket", cluster=cluster, le="14400.0") == 0
    assert value(m, "fleetmend_mttr_seconds_bucket", cluster=cluster, le="43200.0") == 1
    metrics.set_breaker(cluster, True)
    assert value(await scrape(metrics_url), "fleetmend_breaker_open", cluster=cluster) == 1


async def test_worker_process_serves_metrics(nats_server, temporal_server, tmp_path, unique) -> None:
    port = servers.free_port()
    env = {**os.environ, "FLEETMEND_NATS_URL": nats_server.url, "FLEETMEND_TEMPORAL_ADDRESS": temporal_server.address,
           "FLEETMEND_STATE_DIR": str(tmp_path), "FLEETMEND_CLUSTER": f"w{unique}", "FLEETMEND_TASK_QUEUE": f"tq-{unique}",
           "FLEETMEND_METRICS__POLL_INTERVAL_S": "0.5",
           "FLEETMEND_LOG_FORMAT": "json"}
    proc = subprocess.Popen([sys.executable, "-m", "fleetmend.cli.main", "worker", "--metrics-port", str(port)],
                            env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        async def up() -> dict | None:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            try:
                m = await scrape(f"http://127.0.0.1:{port}/metrics")
            except httpx.TransportError:
                return None
            return m if ("fleetmend_drains_in_force", frozenset({("cluster", f"w{unique}")})) in m else None

        m = await assert_eventually(up, timeout_s=60, interval_s=0.3, what="worker /metrics with the visibility poll")
        assert value(m, "fleetmend_drains_in_force", cluster=f"w{unique}") == 0
        assert any(n == "process_cpu_seconds_total" for n, _ in m)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def test_time_between_a_nodes_incidents_is_observed(temporal_client, unique):
    """A node whose incident closed and later opens a new one: the worker's poller observes the gap
    in fleetmend_time_between_incidents_seconds (cluster label only)."""
    import uuid
    from datetime import datetime, timedelta, timezone

    from temporalio.worker import Worker

    from fleetmend.infra import metrics
    from tests.activity_standins import Calls, stand_ins
    from tests.test_workflow import fault, start
    from workflows.remediation import NodeRemediation

    cluster, tq = f"mtbf{unique}", f"tq-{uuid.uuid4().hex[:8]}"
    since = datetime.now(timezone.utc) - timedelta(seconds=1)

    def count() -> float:
        return metrics.REGISTRY.get_sample_value("fleetmend_time_between_incidents_seconds_count",
                                                 {"cluster": cluster}) or 0.0

    async with Worker(temporal_client, task_queue=tq, workflows=[NodeRemediation], activities=stand_ins(Calls())):
        h = await start(temporal_client, tq, cluster, "m1", [fault(cluster, "m1", 79, drain=True)], observe_only=True)
        assert (await h.result()).outcome == "observed"
        assert await metrics.observe_new_incidents(temporal_client, cluster, since) == 0  # first incident: no gap
        await start(temporal_client, tq, cluster, "m1", [fault(cluster, "m1", 48, drain=True)], observe_only=True)

        async def observed():
            return await metrics.observe_new_incidents(temporal_client, cluster, since) >= 1

        await assert_eventually(observed, what="second incident observed")
    assert count() >= 1
