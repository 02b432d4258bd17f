"""StandaloneScheduler against the real nats-server (JetStream KV), one bucket per test."""

from __future__ import annotations

import asyncio
import json

import pytest
from nats.js.api import StorageType

from activities.scheduler import SchedulerActivities, build_scheduler
from activities.slurm import SlurmScheduler
from activities.standalone import NoopScheduler, StandaloneScheduler
from fleetmend.config import Settings
from fleetmend.errors import ConfigError
from fleetmend.messages import DrainRequest, UndrainRequest


@pytest.fixture
def bucket(unique: str) -> str:
    return f"drains_{unique}"


async def test_bucket_is_created_file_backed_with_history(nc, bucket) -> None:
    s = StandaloneScheduler(nc.jetstream(), bucket=bucket)
    await s.drain("gpu-001", "xid 79", "inc-1")
    status = await (await nc.jetstream().key_value(bucket)).status()
    assert status.history >= 5
    si = await nc.jetstream().stream_info(f"KV_{bucket}")
    assert si.config.storage == StorageType.FILE


async def test_drain_undrain_and_idempotency(nc, bucket) -> None:
    s = StandaloneScheduler(nc.jetstream(), bucket=bucket)
    assert await s.state("gpu-001") == "in_service"
    r = await s.drain("gpu-001", "xid 79 fell off the bus", "inc-1")
    assert (r.drained, r.owned, r.operator_drained, r.state) == (True, True, False, "drained")
    entry = await (await s.kv()).get(s.key("gpu-001"))
    doc = json.loads(entry.value)
    assert doc["owner"] == "fleetmend" and doc["incident_id"] == "inc-1" and doc["reason"] == "xid 79 fell off the bus"
    assert "at" in doc

    again = await s.drain("gpu-001", "xid 79 fell off the bus", "inc-1")
    assert (again.drained, again.owned) == (True, True) and "no write" in again.detail
    assert (await (await s.kv()).get(s.key("gpu-001"))).revision == entry.revision, "idempotent drain wrote again"

    u = await s.undrain("gpu-001", "inc-1")
    assert u.resumed and u.state == "in_service"
    assert await s.state("gpu-001") == "in_service"
    u2 = await s.undrain("gpu-001", "inc-1")
    assert u2.resumed is False and "not drained" in u2.detail

    # A node can be drained again after its tombstone (create over a deleted key).
    assert (await s.drain("gpu-001", "xid 79 again", "inc-2")).owned


async def test_operator_drain_is_never_undrained(nc, bucket) -> None:
    s = StandaloneScheduler(nc.jetstream(), bucket=bucket)
    await s.operator_drain("gpu-002", "bios update")
    r = await s.drain("gpu-002", "xid 48", "inc-3")
    assert (r.drained, r.owned, r.operator_drained) == (True, False, True)
    u = await s.undrain("gpu-002", "inc-3")
    assert u.resumed is False and u.operator_drained
    assert await s.state("gpu-002") == "drained"
    rows = {n.name: n for n in await s.list_nodes()}
    assert rows["gpu-002"].owner == "operator" and rows["gpu-002"].reason == "bios update"
    assert await s.operator_undrain("gpu-002") is True
    assert await s.state("gpu-002") == "in_service"
    assert await s.list_nodes() == []


async def test_concurrent_drains_from_two_workers_write_once(nc, bucket) -> None:
    a = StandaloneScheduler(nc.jetstream(), bucket=bucket)
    b = StandaloneScheduler(nc.jetstream(), bucket=bucket)
    await a.kv()
    # one incident's drain activity retried on two workers at once
    results = await asyncio.gather(*(w.drain("gpu-003", "xid 79", "inc-3") for w in [a, b, a, b]))
    assert all(r.drained and r.owned for r in results)
    entry = await (await a.kv()).get(a.key("gpu-003"))
    history = await (await a.kv()).history(a.key("gpu-003"))
    assert len(history) == 1, f"double drain: {history}"
    assert json.loads(entry.value)["incident_id"] == "inc-3"


async def test_drained_set_survives_a_new_instance_and_connection(nc, nats_server, bucket) -> None:
    import nats

    s = StandaloneScheduler(nc.jetstream(), bucket=bucket)
    await s.drain("gpu-004", "xid 79", "inc-4")
    other = await nats.connect(nats_server.url)
    try:
        fresh = StandaloneScheduler(other.jetstream(), bucket=bucket)
        assert await fresh.state("gpu-004") == "drained"
        r = await fresh.drain("gpu-004", "xid 79", "inc-4")
        assert r.owned and "no write" in r.detail
        assert (await fresh.undrain("gpu-004", "inc-4")).resumed
    finally:
        await other.close()
    assert await s.state("gpu-004") == "in_service"


async def test_activities_with_standalone(nc, bucket) -> None:
    from temporalio.testing import ActivityEnvironment

    acts = SchedulerActivities(StandaloneScheduler(nc.jetstream(), bucket=bucket))
    env = ActivityEnvironment()
    r = await env.run(acts.drain_node, DrainRequest("c1", "gpu-005", "xid 79", "inc-5"))
    assert r.owned
    u = await env.run(acts.undrain_node, UndrainRequest("c1", "gpu-005", "inc-5"))
    assert u.resumed


async def test_build_scheduler_and_noop(nc, tmp_path, monkeypatch) -> None:
    assert isinstance(build_scheduler(Settings(scheduler="slurm")), SlurmScheduler)
    assert isinstance(build_scheduler(Settings(scheduler="standalone"), js=nc.jetstream()), StandaloneScheduler)
    noop = build_scheduler(Settings(scheduler="none"))
    assert isinstance(noop, NoopScheduler)
    r = await noop.drain("n1", "x", "i")
    assert r.drained is False and r.detail == "scheduler none: nothing drained"
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ConfigError, match="scheduler kubernetes: no API server configuration"):
        build_scheduler(Settings(scheduler="kubernetes", kubernetes={"kubeconfig": tmp_path / "missing"}))
    with pytest.raises(ConfigError, match="pass js="):
        build_scheduler(Settings(scheduler="standalone"))


async def test_two_clusters_one_node_name_never_share_a_drain(nc, bucket) -> None:
    """Cluster B's incident of `gpu-007` neither takes over nor lifts cluster A's drain of its `gpu-007`.
    (Before drain keys carried the cluster, B's drain found A's entry, called it its own, and B's undrain
    — `fleetmend abort --undrain` in B — deleted it while A's incident still said drained.)"""
    a = StandaloneScheduler(nc.jetstream(), cluster="a", bucket=bucket)
    b = StandaloneScheduler(nc.jetstream(), cluster="b", bucket=bucket)
    ra = await a.drain("gpu-007", "xid 79", "remediate/a/gpu-007/r1")
    rb = await b.drain("gpu-007", "xid 48", "remediate/b/gpu-007/r1")
    assert ra.owned and rb.owned and "recorded" in rb.detail
    assert (await b.undrain("gpu-007", "remediate/b/gpu-007/r1")).resumed
    assert await a.state("gpu-007") == "drained", "cluster A's node went back to service"
    assert [n.name for n in await a.list_nodes()] == ["gpu-007"] and await b.list_nodes() == []
    assert (await a.undrain("gpu-007", "remediate/a/gpu-007/r1")).resumed


async def test_an_undrain_lifts_only_its_own_incidents_drain(nc, bucket) -> None:
    s = StandaloneScheduler(nc.jetstream(), cluster="a", bucket=bucket)
    await s.drain("ip-10-0-1-23.ec2.internal", "xid 79", "remediate/a/n/r1")
    u = await s.undrain("ip-10-0-1-23.ec2.internal", "remediate/a/n/OTHER")
    assert not u.resumed and "belongs to incident remediate/a/n/r1" in u.detail
    assert await s.state("ip-10-0-1-23.ec2.internal") == "drained"
    # the node's next incident adopts the drain (its predecessor is over), then may lift it
    r = await s.drain("ip-10-0-1-23.ec2.internal", "xid 79", "remediate/a/n/r2")
    assert r.owned and "adopted" in r.detail
    assert not (await s.undrain("ip-10-0-1-23.ec2.internal", "remediate/a/n/r1")).resumed
    assert (await s.undrain("ip-10-0-1-23.ec2.internal", "remediate/a/n/r2")).resumed
    assert [n.name for n in await s.list_nodes()] == []


async def test_a_drain_written_before_keys_had_the_cluster_is_lifted_by_its_incident(nc, bucket) -> None:
    s = StandaloneScheduler(nc.jetstream(), cluster="a", bucket=bucket)
    kv = await s.kv()
    await kv.put("gpu-009", json.dumps({"reason": "xid 79", "incident_id": "remediate/a/gpu-009/r0",
                                        "owner": "fleetmend", "at": "2026-01-01T00:00:00+00:00"}).encode())
    assert not (await s.undrain("gpu-009", "remediate/b/gpu-009/r0")).resumed
    assert (await s.undrain("gpu-009", "remediate/a/gpu-009/r0")).resumed


async def test_a_worker_refuses_another_clusters_drain(nc, bucket) -> None:
    from temporalio.exceptions import ApplicationError
    from temporalio.testing import ActivityEnvironment

    acts = SchedulerActivities(StandaloneScheduler(nc.jetstream(), cluster="a", bucket=bucket), cluster="a")
    with pytest.raises(ApplicationError, match="drains cluster 'a', not 'b'"):
        await ActivityEnvironment().run(acts.drain_node, DrainRequest("b", "gpu-010", "xid 79", "inc-10"))
    assert await acts.scheduler.list_nodes() == []
