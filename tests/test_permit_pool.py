"""The drain-permit pool (`fleetmend.infra.permit_pool`) on a real NATS server, and the router's drains of
faults that must drain now through real NATS, Temporal and the standalone scheduler.

- Racing claims from several connections (router replicas, workers) never put more holders in the pool
  than its budget, or more in one rack than its cap; a holder is granted again, a released slot frees.
- A closed pool (breaker, pause, observe-only) refuses the router, not a FleetGuard grant; a domain
  with an open infrastructure incident refuses the router; no pool yet refuses every claim; the guard's
  write takes its queue heads' slots in order while there is room.
- End to end: the router starts its cluster's FleetGuard, which publishes the pool before the first
  fault; a fault that must drain now is drained by the router and its incident adopts it (the guard's
  log says so); an XID 13 (a history rule) is left to its incident; a burst on more nodes than the
  budget never has more nodes drained at once than the budget (replayed from the drain records), and
  the rest wait at the guard; `fleetmend breaker status` shows the pool; a paused guard closes the
  pool and the router drains nothing more; an aborted node's slot goes back to the pool and, after
  the resume, the guard's queue takes it.
- FleetGuard adopts a preclaimed request through pause and breaker, with its lemon verdict, and the
  adoptions trip the breaker, which keeps the pool closed.
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import nats
import pytest
import structlog

from activities.scheduler import build_scheduler
from activities.standalone import StandaloneScheduler
from fleetmend import subjects
from fleetmend.catalog import load_catalog
from fleetmend.config import load_settings
from fleetmend.infra import permit_pool
from fleetmend.infra.connect import connect_nats, connect_temporal
from fleetmend.infra.jetstream import ensure_fault_stream
from fleetmend.infra.lease import Presence
from fleetmend.infra.permit_pool import BY_GUARD, BY_ROUTER, PermitPool, PoolBusyError
from fleetmend.messages import GuardApi, GuardCommand, GuardStatus
from fleetmend.router.core import Router
from fleetmend.worker import build_worker
from tests.conftest import assert_eventually
from tests.test_e2e import cli
from tests.test_node_names_e2e import env_of
from tests.test_router import xid_event


async def test_racing_claims_keep_the_budget_and_the_rack_cap(nats_server, unique: str) -> None:
    cluster = f"pp{unique}"
    conns = [await nats.connect(nats_server.url) for _ in range(3)]
    try:
        pools = [await PermitPool.open(c.jetstream()) for c in conns]
        await pools[0].publish(cluster, budget=5, rack_cap=2, open=True)
        nodes = [(f"n{i:02d}", f"r{i % 4}") for i in range(40)]
        random.Random(3).shuffle(nodes)
        claims = await asyncio.gather(*(pools[i % 3].claim(cluster, n, r, by=BY_ROUTER if i % 2 else BY_GUARD)
                                        for i, (n, r) in enumerate(nodes)))
        won = [n for (n, _r), c in zip(nodes, claims, strict=True) if c.ok]
        state = await pools[1].read(cluster)
        assert sorted(won) == sorted(state.holders) and len(won) == 5
        racks = [h.rack for h in state.holders.values()]
        assert max(racks.count(r) for r in set(racks)) <= 2
        refused = {c.reason.split(":")[0].split(" ")[0] for c in claims if not c.ok}
        assert refused <= {"budget", "rack"} and "budget" in refused

        again = await pools[2].claim(cluster, won[0], state.holders[won[0]].rack)
        assert again.ok and not again.new and again.by == state.holders[won[0]].by
        assert await pools[0].release(cluster, won[0]) and not await pools[0].release(cluster, won[0])
        loser = next(n for n, r in nodes if n not in won and r == state.holders[won[0]].rack)
        got = await pools[1].claim(cluster, loser, state.holders[won[0]].rack)
        assert got.ok and got.new and got.holders == 5
    finally:
        for c in conns:
            await c.close()


async def test_a_claim_that_loses_its_compare_and_set_reads_again_and_wins(nats_server, unique: str,
                                                                          monkeypatch) -> None:
    """A real lost race (another process writes the key between this claim's read and its write): the claim
    reads again and wins (tenacity, `fleetmend.infra.retry`), the other's holder kept; a key that changes under
    every round gives up after `CAS_ATTEMPTS` rounds with `PoolBusyError`."""
    cluster = f"pr{unique}"
    conns = [await nats.connect(nats_server.url) for _ in range(2)]
    try:
        mine, other = [await PermitPool.open(c.jetstream()) for c in conns]
        await other.publish(cluster, budget=5, rack_cap=5, open=True)
        reads, races = [], [f"o{i}" for i in range(3)]
        real_get = mine.kv.get

        async def get_then_raced(key: str):
            entry = await real_get(key)
            reads.append(entry.revision)
            if races:
                await other.claim(cluster, races.pop(0), "r2", by=BY_GUARD)  # lands before this round's write
            return entry

        monkeypatch.setattr(mine.kv, "get", get_then_raced)
        races[1:] = []
        got = await mine.claim(cluster, "n1", "r1", by=BY_GUARD)
        assert got.ok and got.new
        assert len(reads) == 2 and reads[1] > reads[0]  # lost one round, read again, won
        assert set((await other.read(cluster)).holders) == {"o0", "n1"}

        monkeypatch.setattr(permit_pool, "CAS_ATTEMPTS", 3)
        reads.clear()
        races[:] = ["o1", "o2", "o3"]
        with pytest.raises(PoolBusyError, match="lost 3 compare-and-set rounds"):
            await mine.claim(cluster, "n2", "r1", by=BY_GUARD)
        assert len(reads) == 3 and "n2" not in (await other.read(cluster)).holders
    finally:
        for c in conns:
            await c.close()


async def test_a_closed_pool_refuses_the_router_not_the_guard(nats_server, unique: str) -> None:
    cluster = f"pc{unique}"
    nc = await nats.connect(nats_server.url)
    try:
        pool = await PermitPool.open(nc.jetstream())
        none_yet = await pool.claim(cluster, "a", None, by=BY_ROUTER)
        assert not none_yet.ok and "no permit pool yet" in none_yet.reason
        assert not (await pool.claim(cluster, "a", None, by=BY_GUARD)).ok  # no budget known: nobody drains
        assert await pool.read(cluster) is None  # …and nothing was recorded

        # the pool's first write carries the guard's holders; later writes never bring a given-back slot back
        await pool.publish(cluster, budget=3, rack_cap=3, open=False, why="breaker tripped at 12:00",
                           held={"a": None})
        shut = await pool.claim(cluster, "b", None, by=BY_ROUTER)
        assert not shut.ok and shut.reason == "pool closed: breaker tripped at 12:00"
        assert (await pool.claim(cluster, "b", None, by=BY_GUARD)).new
        assert await pool.release(cluster, "a")
        await pool.publish(cluster, budget=3, rack_cap=3, open=True, held={"a": None, "b": None},
                           closed_domains=["rack:r7"])
        assert sorted((await pool.read(cluster)).holders) == ["b"]

        infra = await pool.claim(cluster, "c", "r7", by=BY_ROUTER, domains=["rack:r7"])
        assert not infra.ok and "rack:r7" in infra.reason
        fault = {"kind": "xid", "code": 79}
        assert (await pool.claim(cluster, "c", "r8", by=BY_ROUTER, domains=["rack:r8"], fault=fault)).ok
        state, _ = await pool.publish(cluster, budget=3, rack_cap=3, open=True, drop=["b"])
        assert sorted(state.holders) == ["c"] and state.holders["c"].by == BY_ROUTER
        assert state.holders["c"].fault == fault  # what reconciliation opens its incident with

        # the guard's grants: its queue heads in order, while the budget and each rack cap leave room
        state, got = await pool.publish(cluster, budget=3, rack_cap=1, open=True,
                                        claims=[("d", "r8"), ("e", "r9"), ("f", "r10"), ("g", None)])
        assert [c.ok for c in got] == [False, True, True, False]  # c holds rack r8's one slot
        assert got[0].reason.startswith("rack r8: 1/1") and got[3].reason.startswith("budget: 3/3")
        assert sorted(state.holders) == ["c", "e", "f"] and state.holders["e"].by == BY_GUARD
    finally:
        await nc.close()


def _replay(records: list[tuple[str, bool]]) -> int:
    drained: set[str] = set()
    peak = 0
    for key, on in records:
        (drained.add if on else drained.discard)(key)
        peak = max(peak, len(drained))
    return peak


async def _fast_stack(cluster: str, budget: int, nats_server, temporal_server, tmp_path: Path,
                      unique: str):
    """(settings, NATS, JetStream, Temporal client, the standalone scheduler's drain bucket) for
    a 100-node cluster with `budget` drain slots, no breaker or failure domain in the
    way, no debounce. The bucket is the scheduler's own (other tests share it)."""
    s = load_settings(None, cluster=cluster, nats_url=nats_server.url, temporal_address=temporal_server.address,
                      state_dir=tmp_path / "state", scheduler="standalone", task_queue=f"tq-{unique}",
                      log_format="json",
                      policy={"max_drained_nodes": budget, "max_drained_percent": 100,
                              "cluster_nodes": 100, "breaker_distinct_nodes": 1000,
                              "domain_incident_nodes": 1000, "debounce_s": 0})
    nc = await connect_nats(s, name=f"test-{cluster}")
    js = nc.jetstream()
    await ensure_fault_stream(js)
    return s, nc, js, await connect_temporal(s), await StandaloneScheduler(js, cluster=cluster).kv()


async def test_router_fast_path_end_to_end(nats_server, temporal_server, tmp_path: Path, unique: str) -> None:
    cluster = f"fp{unique}"
    s, nc, js, client, kv = await _fast_stack(cluster, 3, nats_server, temporal_server, tmp_path, unique)
    records: list[tuple[str, bool]] = []
    watcher = await kv.watch(f"{cluster}.>")

    async def watch() -> None:
        async for entry in watcher:
            if entry is not None:
                records.append((entry.key, bool(entry.value) and entry.operation not in ("DEL", "PURGE")))

    stop = asyncio.Event()
    router = Router(s, nc, js, client, load_catalog(), filter_subject=f"fleet.{cluster}.fault.*",
                    durable=f"router-{unique}", scheduler=build_scheduler(s, js=js))
    worker = await build_worker(s, client, nc)
    # as `fleetmend worker` does: the guard commands refuse a cluster no worker announces (try2 F26)
    present = Presence(js, "worker", [cluster])
    await present.announce()
    tasks = [asyncio.create_task(router.run(stop)), asyncio.create_task(worker.run()), asyncio.create_task(watch()),
             asyncio.create_task(present.run(stop, structlog.get_logger()))]
    pool = await PermitPool.open(js)
    guard = client.get_workflow_handle(subjects.fleetguard_workflow_id(cluster))

    async def fail(node: str, xid: int = 79) -> None:
        await js.publish(subjects.fault_subject(cluster, node), xid_event(cluster, node, xid).to_json_bytes())

    async def guard_status() -> GuardStatus:
        return await guard.query(GuardApi.STATUS, result_type=GuardStatus)

    async def drained(node: str) -> bool:
        try:
            return bool((await kv.get(subjects.drain_kv_key(cluster, node))).value)
        except Exception:
            return False

    try:
        # 1. the router starts its cluster's FleetGuard, which publishes the pool before any fault
        state = await assert_eventually(lambda: pool.read(cluster), timeout_s=60, what="the guard's pool")
        assert state.budget == 3 and state.rack_cap == 2 and state.open and not state.holders
        await fail("n0")
        await assert_eventually(lambda: drained("n0"), timeout_s=60, what="n0 drained")

        # 2. the router drains n1 at once; its incident adopts it
        await fail("n1")
        await assert_eventually(lambda: drained("n1"), timeout_s=30, what="n1 drained")
        assert router.stats.drained_now == 2 and router.stats.drain_now_refused == 0
        st = await assert_eventually(
            lambda: _when(guard_status(), lambda g: any(h["node"] == "n1" for h in g.held)), timeout_s=60,
            what="n1 adopted")
        assert any("n1: drained by the router under a permit pool slot; adopted" in line for line in st.log)

        # 3. an XID 13 (history rule) is not the router's to drain
        await fail("n9", xid=13)
        await asyncio.sleep(2)
        assert not await drained("n9") and router.stats.drained_now == 2

        # 4. a burst on five more nodes: the router takes the last slot for one of them; the others go to
        # the guard (queued, or granted and waiting for a slot); never more than 3 drained at once
        burst = [f"b{i}" for i in range(5)]
        await asyncio.gather(*(fail(b) for b in burst))
        await assert_eventually(
            lambda: _when(guard_status(), lambda g: {h["node"] for h in g.held} | {q["node"] for q in g.queue}
                          >= set(burst)), timeout_s=90, what="the whole burst known to the guard")
        assert sum([await drained(b) for b in burst]) == 1
        # the guard's word is as of its last pool write: "next in the queue" while the write that finds the
        # router's claim is in flight (CI run on 86a9da3); it names the budget once that write lands
        full = lambda g: g.queue and all(  # noqa: E731
            q["waiting"].startswith("budget: ") and "/3 permits held" in q["waiting"] for q in g.queue)
        try:
            await assert_eventually(lambda: _when(guard_status(), full), timeout_s=30, what="the budget named")
        except AssertionError:
            raise AssertionError([(q["node"], q["waiting"]) for q in (await guard_status()).queue]) from None
        assert _replay(records) <= 3 and len((await pool.read(cluster)).holders) == 3
        assert router.stats.drained_now == 3 and router.stats.drain_now_refused >= 4
        env = env_of(s)
        out = " ".join((await cli(env, "breaker", "status")).stdout.split())
        assert "permits held 3/3 (known nodes 100, 2 per rack)" in out and "permit pool open" in out, out

        # 5. pause: the pool closes and the router drains nothing more, even with a slot free
        await guard.execute_update(GuardApi.PAUSE, GuardCommand(by="test", note="maintenance"), result_type=str)
        await assert_eventually(lambda: _when(pool.read(cluster), lambda p: not p.open), timeout_s=30,
                                what="pool closed")
        out = " ".join((await cli(env, "breaker", "status")).stdout.split())
        assert "breaker closed; PAUSED by test at " in out and "(maintenance): no drains" in out, out
        assert "drains allowed" not in out, out
        refused = router.stats.drain_now_refused
        await cli(env, "abort", "n0", "--undrain", "--note", "test frees a slot")
        await assert_eventually(lambda: _when(pool.read(cluster), lambda p: "n0" not in p.holders), timeout_s=90,
                                what="n0's slot given back")
        await fail("c0")
        await assert_eventually(lambda: _true(router.stats.drain_now_refused > refused), timeout_s=30,
                                what="router refused by the closed pool")
        assert not await drained("c0")
        await guard.execute_update(GuardApi.RESUME, GuardCommand(by="test"), result_type=str)
        await assert_eventually(lambda: _when(pool.read(cluster), lambda p: p.open and len(p.holders) == 3),
                                timeout_s=90, what="a burst node took the freed slot")
        drained_now = lambda: {k.split(".")[-1] for k, on in records if on}  # noqa: E731
        await assert_eventually(lambda: _true(len(drained_now() & set(burst)) == 2), timeout_s=60,
                                what="a second burst node drained")
        assert _replay(records) <= 3 and not await drained("c0")
    finally:
        await _stop_stack(stop, worker, tasks, nc)


async def _stop_stack(stop: asyncio.Event, worker, tasks: list, nc) -> None:
    """Stop a test's router (`stop`), its worker and tasks, then its NATS connection."""
    stop.set()
    await worker.shutdown()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await nc.close()


async def _when(coro, pred):
    try:
        v = await coro
    except Exception:
        return None
    return v if v is not None and pred(v) else None


async def _true(v: bool):
    return v or None


async def _decisions(handle) -> dict[str, object]:
    """node → the last `PermitDecision` the guard signalled it (from the guard's history)."""
    from temporalio.api.enums.v1 import EventType

    from fleetmend.infra.converter import data_converter
    from fleetmend.messages import PermitDecision

    out = {}
    for ev in (await handle.fetch_history()).events:
        if ev.event_type == EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED:
            a = ev.signal_external_workflow_execution_initiated_event_attributes
            (decision,) = await data_converter.decode(a.input.payloads, [PermitDecision])
            out[a.workflow_execution.workflow_id.rsplit("/", 1)[-1]] = decision
    return out


async def test_guard_adopts_router_drains_and_closes_the_pool(nats_server, temporal_server, unique: str) -> None:
    """FleetGuard on the dev server: a preclaimed request is adopted whatever the pause, breaker or budget
    say, carries its lemon verdict, and counts toward the breaker, whose trip closes the pool; a request
    that is not preclaimed still queues, and so does one the router forwarded."""
    from dataclasses import replace

    from temporalio.worker import Worker

    from fleetmend.events import Severity
    from fleetmend.messages import GuardInput, GuardPolicy, Outcome, PermitRelease, PermitRequest
    from fleetmend.worker import workflow_runner
    from tests.activity_standins import real_guard
    from workflows.fleetguard import FleetGuard

    cluster = f"ga{unique}"
    s = load_settings(None, cluster=cluster, nats_url=nats_server.url, temporal_address=temporal_server.address)
    nc = await connect_nats(s, name="guard-adopts")
    client = await connect_temporal(s)
    policy = GuardPolicy(max_drained_nodes=2, max_drained_percent=100, cluster_nodes=100,
                         breaker_distinct_nodes=2, lemon_repairs=1)
    tq = f"ga-{unique}"
    acts = real_guard(client, tq, policy, nc.jetstream())
    tq = subjects.cluster_task_queue(tq, cluster)  # the guard's queue of its cluster
    pool = await PermitPool.open(nc.jetstream())
    handle = client.get_workflow_handle(subjects.fleetguard_workflow_id(cluster))

    def req(node: str, preclaimed: bool = True) -> PermitRequest:
        return PermitRequest(cluster=cluster, node=node, severity=Severity.FATAL, fault_class="xid79",
                             policy=policy, preclaimed=preclaimed)

    async def status(pred):
        return await _when(handle.query(GuardApi.STATUS, result_type=GuardStatus), pred)

    async with Worker(client, task_queue=tq, workflows=[FleetGuard], workflow_runner=workflow_runner(),
                      activities=[acts.running_incidents, acts.sync_permit_pool, acts.reconcile_pool]):
        await client.start_workflow(GuardApi.WORKFLOW, GuardInput(cluster=cluster, policy=policy),
                                    id=subjects.fleetguard_workflow_id(cluster), task_queue=tq,
                                    start_signal=GuardApi.REQUEST_PERMITS, start_signal_args=[[]])
        state = await assert_eventually(lambda: pool.read(cluster), timeout_s=30, what="pool published")
        assert (state.budget, state.rack_cap, state.open) == (2, 2, True)
        # `lem` went back to service once after an xid79 repair: the next xid79 makes it a lemon
        await handle.signal(GuardApi.RELEASE, PermitRelease(cluster=cluster, node="lem", outcome=Outcome.RETURNED,
                                                            fault_class="xid79", returned=True))
        await handle.execute_update(GuardApi.PAUSE, GuardCommand(by="test"), result_type=str)
        await assert_eventually(lambda: _when(pool.read(cluster), lambda p: not p.open and "paused" in p.why),
                                timeout_s=30, what="pause closes the pool")

        await handle.signal(GuardApi.REQUEST_PERMITS, [req("lem"), req("a"), req("b"), req("c", preclaimed=False)])
        # a request the router forwarded queues like an incident's own, and its policy (the router's
        # settings) does not replace the guard's
        fwd = replace(req("d", preclaimed=False), forwarded=True, reason="router: xid79 must drain now",
                      policy=replace(policy, max_drained_nodes=99))
        await handle.signal(GuardApi.REQUEST_PERMITS, [fwd])
        st = await assert_eventually(lambda: status(lambda g: len(g.queue) == 2), timeout_s=30,
                                     what="c and the forwarded d queued")
        # adopted over the budget of 2: the pool, not the guard, held the budget when b was drained
        assert st.breaker_tripped and sorted(h["node"] for h in st.held) == ["a", "b", "lem"]
        assert [q["node"] for q in st.queue] == ["c", "d"] and st.budget == 2
        assert st.queue[1]["reason"] == "router: xid79 must drain now"
        dec = await assert_eventually(lambda: _when(_decisions(handle), lambda d: {"lem", "a", "b"} <= set(d)),
                                      timeout_s=30, what="the adoptions signalled")
        assert dec["lem"].granted and dec["lem"].reason.startswith("adopted") and "RMA" in dec["lem"].lemon
        assert dec["a"].granted and dec["a"].lemon is None and "c" not in dec
        await handle.execute_update(GuardApi.RESUME, GuardCommand(by="test"), result_type=str)
        await assert_eventually(lambda: _when(pool.read(cluster), lambda p: not p.open and "breaker" in p.why),
                                timeout_s=30, what="the breaker keeps the pool closed after resume")
        from tests.test_policy_replay import RECORD, _write

        if RECORD:  # a replay baseline: adoptions, pause, breaker, a forwarded request
            _write("fleetguard_pool", await handle.fetch_history())
        await handle.terminate("test done")
    await nc.close()


async def test_router_forwards_refused_nodes_to_the_guard(nats_server, temporal_server, tmp_path: Path,
                                                           unique: str) -> None:
    """A burst larger than the budget, with no worker on the incidents' queue (no incident runs a
    workflow task): the router drains what the pool allows, starts the other incidents in phase
    `awaiting_permit` and forwards their requests, so the guard queues them with the reason, as
    `fleetmend status` shows. Once the worker runs, each incident's own request keeps the place the
    router took, and nothing is queued twice."""
    cluster = f"fw{unique}"
    s, nc, js, client, kv = await _fast_stack(cluster, 1, nats_server, temporal_server, tmp_path, unique)
    stop = asyncio.Event()
    router = Router(s, nc, js, client, load_catalog(), filter_subject=f"fleet.{cluster}.fault.*",
                    durable=f"router-{unique}", scheduler=build_scheduler(s, js=js))
    worker = await build_worker(s, client, nc)
    tasks = [asyncio.create_task(router.run(stop)), asyncio.create_task(worker.guard.run())]
    pool = await PermitPool.open(js)
    guard = client.get_workflow_handle(subjects.fleetguard_workflow_id(cluster))
    env = env_of(s)
    nodes = [f"n{i}" for i in range(4)]
    main_runs = False

    async def queue() -> list[dict]:
        return (await guard.query(GuardApi.STATUS, result_type=GuardStatus)).queue

    async def drained() -> list[str]:
        out = []
        for n in nodes:
            try:
                out += [n] if (await kv.get(subjects.drain_kv_key(cluster, n))).value else []
            except Exception:
                pass
        return out

    try:
        await assert_eventually(lambda: pool.read(cluster), timeout_s=60, what="the guard's pool")
        for n in nodes:
            await js.publish(subjects.fault_subject(cluster, n), xid_event(cluster, n, 79).to_json_bytes())
        q = await assert_eventually(lambda: _when(queue(), lambda q: len(q) == 3), timeout_s=60,
                                    what="three refused nodes queued at the guard")
        first = await drained()
        assert len(first) == 1 and {e["node"] for e in q} == set(nodes) - set(first)
        # the guard's own word is as of its last pool write: "next in the queue" when that write came before the
        # router's claim (a race of two processes); what the operator sees, resolved with the pool, is below
        assert all(e["waiting"].startswith("budget: 1/1") or e["waiting"] == "next in the queue" for e in q), q
        assert all(e["reason"].startswith("router: xid79 must drain now; no permit pool slot (budget")
                   for e in q), q
        assert router.stats.forwarded == 3 and router.stats.drained_now == 1
        from temporalio.api.sdk.v1 import WorkflowMetadata

        md = await guard.query("__temporal_workflow_metadata", result_type=WorkflowMetadata)  # the Temporal UI's
        assert "queued: 3" in md.current_details and "permit pool: 1/1 slots held" in md.current_details
        # what the operator sees, before any incident ran a workflow task (no worker on their queue)
        rows = await assert_eventually(
            lambda: _when(cli(env, "status", "--json", "--cluster", cluster),
                          lambda r: sum('"awaiting_permit"' in line for line in r.stdout.splitlines()) >= 3),
            timeout_s=30, what="incidents listed in phase awaiting_permit")
        listed = {r["node"]: r for r in json.loads(rows.stdout)}
        for n in set(nodes) - set(first):
            assert listed[n]["phase"] == "awaiting_permit" and listed[n]["waiting"].startswith("budget: 1/1"), listed
        places = {e["node"]: e["requested_at"] for e in q}

        # the incidents run: each asks for itself; the router's place in the queue stands, no duplicate
        tasks.append(asyncio.create_task(worker.main.run()))
        main_runs = True
        from workflows.remediation import NodeRemediation

        for n in places:
            h = client.get_workflow_handle(subjects.workflow_id(cluster, n))
            await assert_eventually(
                lambda h=h: _when(h.query(NodeRemediation.status),
                                  lambda i: any("waiting for a drain permit" in t["text"] for t in i.timeline)),
                timeout_s=90, what=f"{n}'s incident asked for itself")
        st = await assert_eventually(
            lambda: _when(guard.query(GuardApi.STATUS, result_type=GuardStatus),
                          lambda g: any("adopted" in line for line in g.log)), timeout_s=60, what="adopted")
        assert [h["node"] for h in st.held] == first
        assert sorted(e["node"] for e in st.queue) == sorted(places)
        assert {e["node"]: e["requested_at"] for e in st.queue} == places
        assert await drained() == first
    finally:
        stop.set()
        await (worker.shutdown() if main_runs else worker.guard.shutdown())  # a worker never run never stops
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await nc.close()


async def test_observe_only_drains_nothing_on_any_path(nats_server, temporal_server, tmp_path: Path,
                                                       unique: str) -> None:
    """Observe-only: the router takes no slot and cordons nothing even with a scheduler and a must-drain-now
    fault, the guard keeps the pool closed, and the incident closes `observed`."""
    from workflows.remediation import NodeRemediation

    cluster = f"oo{unique}"
    s, nc, js, client, kv = await _fast_stack(cluster, 5, nats_server, temporal_server, tmp_path, unique)
    s = s.model_copy(update={"policy": s.policy.model_copy(update={"observe_only": True})})
    stop = asyncio.Event()
    router = Router(s, nc, js, client, load_catalog(), filter_subject=f"fleet.{cluster}.fault.*",
                    durable=f"router-{unique}", scheduler=build_scheduler(s, js=js))
    worker = await build_worker(s, client, nc)
    tasks = [asyncio.create_task(router.run(stop)), asyncio.create_task(worker.run())]
    pool = await PermitPool.open(js)
    try:
        await js.publish(subjects.fault_subject(cluster, "n0"), xid_event(cluster, "n0", 79).to_json_bytes())
        h = client.get_workflow_handle_for(NodeRemediation.run, subjects.workflow_id(cluster, "n0"))
        st = await assert_eventually(lambda: _when(h.query(NodeRemediation.status), lambda i: i.phase == "closed"),
                                     timeout_s=60, what="the incident closed")
        assert st.outcome == "observed" and not st.drained
        assert router.stats.drained_now == 0
        state = await pool.read(cluster)
        assert state is None or (not state.open and not state.holders)
        from nats.js.errors import KeyNotFoundError

        try:
            entry = await kv.get(subjects.drain_kv_key(cluster, "n0"))
        except KeyNotFoundError:
            entry = None
        assert entry is None or not entry.value, "observe-only drained n0"
    finally:
        await _stop_stack(stop, worker, tasks, nc)


def test_status_says_why_a_node_waits_from_the_pool_before_the_guard_took_it_up() -> None:
    """In a burst the router starts incidents faster than FleetGuard takes their requests up: `fleetmend
    status` then reads the permit pool itself (the budget's owner) for the nodes the guard does not list yet."""
    from fleetmend.cli.breaker import _pool_reason

    full = {"budget": 2, "open": True, "why": "", "holders": {"a": {}, "b": {}}}
    assert _pool_reason(full, "c").startswith("budget: 2/2 permits held (permit pool")
    assert _pool_reason(full, "a") == "holds a permit pool slot: its drain follows"
    assert _pool_reason({**full, "open": False, "why": "paused by ops"}, "c") == "permit pool closed: paused by ops"
    assert _pool_reason({**full, "budget": 5}, "c") is None  # room: the pool does not say why it waits
    assert _pool_reason(None, "c") is None


async def test_a_worker_s_policy_reaches_the_pool_at_its_start(nats_server, temporal_server, unique: str) -> None:
    """A restarted worker with a lowered budget, then with observe-only: FleetGuard takes its policy at
    once (the `policy` signal of `announce_policy`) and writes the pool, before any fault or request."""
    from temporalio.worker import Worker

    from activities.fleetguard import announce_policy
    from fleetmend.messages import GuardPolicy, guard_task_queue
    from fleetmend.worker import workflow_runner
    from tests.activity_standins import real_guard
    from workflows.fleetguard import FleetGuard

    cluster, tq = f"ap{unique}", f"ap-{unique}"
    base = dict(cluster=cluster, nats_url=nats_server.url, temporal_address=temporal_server.address, task_queue=tq)
    s = load_settings(None, **base, policy={"max_drained_nodes": 6, "max_drained_percent": 100,
                                            "cluster_nodes": 100})
    nc = await connect_nats(s, name="announce")
    client = await connect_temporal(s)
    acts = real_guard(client, guard_task_queue(tq), GuardPolicy(), nc.jetstream())
    pool = await PermitPool.open(nc.jetstream())
    handle = client.get_workflow_handle(subjects.fleetguard_workflow_id(cluster))
    async with Worker(client, task_queue=subjects.cluster_task_queue(guard_task_queue(tq), cluster),
                      workflows=[FleetGuard], workflow_runner=workflow_runner(),
                      activities=[acts.running_incidents, acts.sync_permit_pool, acts.reconcile_pool]):
        await announce_policy(client, s)
        await assert_eventually(lambda: _when(pool.read(cluster), lambda p: p.budget == 6 and p.open), timeout_s=30,
                                what="the pool sized by the first worker")
        lowered = load_settings(None, **base, policy={"max_drained_nodes": 1, "max_drained_percent": 100,
                                                      "cluster_nodes": 100})
        await announce_policy(client, lowered)
        await assert_eventually(lambda: _when(pool.read(cluster), lambda p: p.budget == 1), timeout_s=30,
                                what="the lowered budget in the pool, with no request")
        observe = load_settings(None, **base, policy={"max_drained_nodes": 1, "max_drained_percent": 100,
                                                      "cluster_nodes": 100, "observe_only": True})
        await announce_policy(client, observe)
        state = await assert_eventually(lambda: _when(pool.read(cluster), lambda p: not p.open), timeout_s=30,
                                        what="observe-only closes the pool")
        assert "observe-only" in state.why
        st = await handle.query(GuardApi.STATUS, result_type=GuardStatus)
        assert st.observe_only and any("policy from a worker: max_drained_nodes 6 → 1" in line for line in st.log)
        await handle.terminate("test done")
    await nc.close()
