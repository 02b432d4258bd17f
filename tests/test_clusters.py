"""Many clusters from one control plane (issue 27, point 1): one router routes every cluster's faults, each
cluster's incidents run on that cluster's own task queue, and only that cluster's worker drains them; a
cluster no worker serves says so (`fleetmend status`, the incident's summary) and holds no permit.

Its own nats-server: the router consumes every cluster's faults (`fleet.*.fault.*`), which on the session's
server would re-route other tests' events.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from temporalio.api.enums.v1 import EventType

from activities.scheduler import build_scheduler
from fleetmend import subjects
from fleetmend.catalog import load_catalog
from fleetmend.config import load_settings
from fleetmend.dev import servers
from fleetmend.infra.connect import close_nats, connect_nats, connect_temporal
from fleetmend.infra.lease import Presence, presence, served_clusters
from fleetmend.infra.permit_pool import PermitPool
from fleetmend.router.core import Router
from fleetmend.worker import build_worker
from tests.conftest import assert_eventually
from tests.test_router import xid_event
from workflows.remediation import NodeRemediation


def test_cluster_task_queue_naming_rule() -> None:
    assert subjects.cluster_task_queue("fleetmend", "east") == "fleetmend.east"
    assert subjects.cluster_task_queue("fleetmend-guard", "east") == "fleetmend-guard.east"
    # a cluster name holds no '.', so two clusters (and a cluster and a guard) never share a queue
    assert subjects.cluster_task_queue("fleetmend", "east-guard") != subjects.cluster_task_queue("fleetmend-guard",
                                                                                                  "east")
    with pytest.raises(ValueError):
        subjects.cluster_task_queue("fleetmend", "a.b")
    key = subjects.presence_kv_key("worker", "east", "host-1.example:42")
    assert subjects.parse_presence_kv_key(key) == ("worker", "east", "host-1.example:42")


@pytest.fixture
def own_nats(tmp_path: Path):
    port = servers.free_port()
    proc = servers.start_nats(tmp_path / "js", port)
    yield f"nats://127.0.0.1:{port}"
    proc.stop()


async def test_two_clusters_each_drained_by_its_own_worker_and_an_unserved_one_says_so(
        own_nats: str, temporal_server, tmp_path: Path, unique: str) -> None:
    a, b, c = f"a{unique}", f"b{unique}", f"c{unique}"
    tq = f"tq-{unique}"

    def conf(cluster: str):
        return load_settings(None, cluster=cluster, nats_url=own_nats, temporal_address=temporal_server.address,
                             state_dir=tmp_path / cluster, scheduler="standalone", task_queue=tq, log_format="json",
                             policy={"max_drained_nodes": 5, "max_drained_percent": 100, "cluster_nodes": 100,
                                     "debounce_s": 0})

    sa, sb = conf(a), conf(b)
    nc = await connect_nats(sa, name="clusters")
    js = nc.jetstream()
    client = await connect_temporal(sa)
    stop = asyncio.Event()
    # the control plane's router is cluster a's (it cordons a's must-drain-now faults itself); b's and c's
    # faults go to their own clusters' queues
    router = Router(sa, nc, js, client, load_catalog(), durable=f"router-{unique}", scheduler=build_scheduler(sa, js=js))
    wa, wb = await build_worker(sa, client, nc), await build_worker(sb, client, nc, legacy=False)  # one per process
    tasks = [asyncio.create_task(t) for t in (
        wa.run(), wb.run(),
        Presence(js, "worker", [a], holder=f"wa-{unique}", info={"task_queue": wa.task_queue}).run(stop, _Log()),
        Presence(js, "worker", [b], holder=f"wb-{unique}", info={"task_queue": wb.task_queue}).run(stop, _Log()),
        Presence(js, "router", [a], holder=f"r-{unique}", info={"filter": router.filter_subject}).run(stop, _Log()))]
    drains = await build_scheduler(sa, js=js).kv()  # type: ignore[attr-defined]

    async def drained(cluster: str, node: str) -> bool:
        try:
            return bool((await drains.get(subjects.drain_kv_key(cluster, node))).value)
        except Exception:
            return False

    async def incident_drained(cluster: str, node: str):
        h = client.get_workflow_handle_for(NodeRemediation.run, subjects.workflow_id(cluster, node))
        try:
            st = await h.query(NodeRemediation.status)
        except Exception:
            return None
        return st if st.drained else None  # then diagnostics (no agent here: the incident goes on to a ticket)

    async def drain_attempts(cluster: str, node: str) -> list[int]:
        h = client.get_workflow_handle(subjects.workflow_id(cluster, node))
        scheduled, attempts = {}, []
        async for e in h.fetch_history_events():
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                scheduled[e.event_id] = e.activity_task_scheduled_event_attributes.activity_type.name
            elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
                a = e.activity_task_started_event_attributes
                if scheduled.get(a.scheduled_event_id) == "drain_node":
                    attempts.append(a.attempt)
        return attempts

    try:
        await assert_eventually(lambda: _served(js, {a, b}), timeout_s=30, what="both workers announced")
        tasks.append(asyncio.create_task(router.run(stop)))
        await assert_eventually(lambda: router.served == {a, b} or None, timeout_s=30, what="the router read them")
        for cluster, node in ((a, "na"), (b, "nb"), (c, "nc")):
            await js.publish(subjects.fault_subject(cluster, node), xid_event(cluster, node, 79).to_json_bytes())

        for cluster, node in ((a, "na"), (b, "nb")):
            await assert_eventually(lambda: incident_drained(cluster, node), timeout_s=60,  # noqa: B023
                                    what=f"{cluster}/{node} drained")
            assert await drained(cluster, node), f"{node} drained by {cluster}'s standalone adapter"
            desc = await client.get_workflow_handle(subjects.workflow_id(cluster, node)).describe()
            assert desc.task_queue == subjects.cluster_task_queue(tq, cluster)
            # each drain went to its own cluster's adapter at the first attempt (no WrongCluster retries)
            attempts = await assert_eventually(lambda: drain_attempts(cluster, node),  # noqa: B023
                                               what="the drain recorded")
            assert attempts == [1], attempts
        for cluster, node in ((a, "nb"), (b, "na"), (a, "nc"), (b, "nc"), (c, "nc")):
            assert not await drained(cluster, node), f"{cluster}'s adapter must not hold {node}"

        # c: its incident exists (the fault is recorded), says why nothing happens, and holds no permit
        hc = client.get_workflow_handle(subjects.workflow_id(c, "nc"))
        desc = await assert_eventually(hc.describe, what="c's incident started")
        summary = await desc.static_summary() or ""
        assert f"no worker serves cluster {c}: start `fleetmend worker --cluster {c}`" in summary, summary
        pool = await PermitPool.open(js)
        assert await pool.read(c) is None, "no FleetGuard of c runs: nothing of c is counted"
        assert "nc" not in ((await pool.read(a)).holders or {})

        env = {**os.environ, "FLEETMEND_NATS_URL": own_nats, "FLEETMEND_TEMPORAL_ADDRESS": temporal_server.address,
               "FLEETMEND_TASK_QUEUE": tq, "FLEETMEND_STATE_DIR": str(tmp_path / "cli"), "COLUMNS": "250"}
        rows = json.loads((await _cli(env, "status", "--json")).stdout)
        by = {(r["cluster"], r["node"]): r for r in rows}
        assert by[(c, "nc")]["unserved"] == f"no worker serves cluster {c}: start `fleetmend worker --cluster {c}`"
        assert "unserved" not in by[(a, "na")] and "unserved" not in by[(b, "nb")]
        table = (await _cli(env, "status")).stdout
        assert f"no worker serves cluster {c}" in table, table
        lines = {ln.split("│")[1].strip(): ln for ln in table.splitlines() if ln.count("│") >= 5}
        assert lines[a].split("│")[2].strip() == "1" and lines[a].split("│")[3].strip() == "1", table
        assert lines[b].split("│")[2].strip() == "1", table
        assert lines[c].split("│")[2].strip() == "0" and "fleetmend worker --cluster" in lines[c], table

        # c's worker starts: the waiting incident is drained by c's adapter
        sc = conf(c)
        wc = await build_worker(sc, client, nc, legacy=False)
        tasks.append(asyncio.create_task(wc.run()))
        await assert_eventually(lambda: incident_drained(c, "nc"), timeout_s=60, what="c drained once its worker runs")
        assert await drained(c, "nc")
        await wc.shutdown()
    finally:
        stop.set()
        for w in (wa, wb):
            await w.shutdown()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
        await close_nats(nc)


async def _served(js, want: set[str]) -> bool:
    return want <= served_clusters(await presence(js, "worker"))


async def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    p = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "fleetmend.cli.main", *args], env=env,
                                capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, (p.stdout, p.stderr)
    return p


class _Log:
    def info(self, *a, **k) -> None:
        pass

    warning = info


def test_status_cluster_rows_say_which_cluster_is_unserved() -> None:
    from fleetmend.cli.incidents import _matches, cluster_rows

    assert _matches("fleet.*.fault.*", "fleet.east.fault.n1") and not _matches("fleet.west.fault.*", "fleet.east.fault.n1")
    assert _matches("fleet.>", "fleet.east.fault.n1") and not _matches("fleet.*.fault", "fleet.east.fault.n1")
    alive = [{"role": "worker", "cluster": "east", "holder": "h:1", "age_s": 3.0, "alive": True},
             {"role": "worker", "cluster": "west", "holder": "h:2", "age_s": 300.0, "alive": False},
             {"role": "router", "cluster": "east", "holder": "h:3", "age_s": 1.0, "alive": True,
              "filter": "fleet.*.fault.*"}]
    rows = [{"cluster": "west", "node": "w1", "status": "running"}, {"cluster": "north", "node": "n1", "status": "running"},
            {"cluster": "east", "node": "e1", "status": "completed"}]
    by = {r["cluster"]: r for r in cluster_rows(rows, alive)}
    assert by["east"] == {"cluster": "east", "workers": 1, "routers": 1, "open": 0, "note": ""}
    assert by["west"]["workers"] == 0 and by["west"]["open"] == 1
    assert by["west"]["note"] == ("no worker serves cluster west: start `fleetmend worker --cluster west` "
                                  "(last worker seen 300 s ago)")
    assert by["north"]["note"] == "no worker serves cluster north: start `fleetmend worker --cluster north`"
    assert "no router alive" in cluster_rows(rows, alive[:2])[0]["note"]
