"""Drain permits survive what operators do to workflows: a terminated incident gives its permit back
(reconciliation), a terminated FleetGuard is rebuilt from the running incidents, and `breaker
release NODE` frees a permit by hand. Real Temporal dev server (visibility included); the guard and
its activities are the real ones, scheduler/tickets/diagnostics the recording stand-ins."""

from __future__ import annotations

import uuid

import pytest
from temporalio.client import WorkflowUpdateFailedError
from temporalio.worker import Worker

from activities.fleetguard import FleetGuardActivities
from fleetmend import subjects
from fleetmend.messages import AbortCommand, GuardPolicy, PermitReleaseCommand
from tests.activity_standins import GUARD_ACTIVITIES, Calls, guard_activities, stand_ins
from tests.conftest import assert_eventually
from tests.test_workflow import fault, start
from workflows.fleetguard import FleetGuard
from workflows.remediation import NodeRemediation

ONE_AT_A_TIME = dict(max_drained_nodes=1, max_drained_percent=100.0, max_drained_per_rack=10, cluster_nodes=10,
                     breaker_distinct_nodes=100, domain_incident_nodes=100)


class Fleet:
    def __init__(self, client, policy: GuardPolicy) -> None:
        self.client, self.calls = client, Calls()
        self.tq = f"pr-{uuid.uuid4().hex[:8]}"
        self.cluster = f"r{uuid.uuid4().hex[:8]}"
        guard = FleetGuardActivities(client, self.tq, policy)
        acts = [a for a in stand_ins(self.calls) if a.__name__ not in GUARD_ACTIVITIES]
        self.worker = Worker(client, task_queue=self.tq, workflows=[NodeRemediation, FleetGuard],
                             activities=acts + guard_activities(guard, self.calls))

    async def __aenter__(self) -> "Fleet":
        await self.worker.__aenter__()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.worker.__aexit__(*exc)

    def guard(self):
        return self.client.get_workflow_handle_for(FleetGuard.run, subjects.fleetguard_workflow_id(self.cluster))

    async def incident(self, node: str, **policy):
        return await start(self.client, self.tq, self.cluster, node, [fault(self.cluster, node, 79, drain=True)],
                           **policy)

    def drained(self, node: str) -> bool:
        return node in [n for op, n in self.calls.log if op == "drain"]

    async def status(self):
        return await self.guard().query(FleetGuard.status)


async def _held_and_queued(f: Fleet, held: str, queued: str) -> None:
    await assert_eventually(lambda: f.drained(held), what=f"{held} drained")
    st = await assert_eventually(lambda: _guard(f, lambda s: [h["node"] for h in s.held] == [held]
                                                and [q["node"] for q in s.queue] == [queued]),
                                 what=f"{held} holds the one permit, {queued} queued")
    assert st.queue[0]["waiting"].startswith("budget: 1/1"), st.queue[0]
    assert not f.drained(queued)


async def _new_run(f: Fleet, old_run: str) -> bool:
    from temporalio.client import WorkflowExecutionStatus

    d = await f.guard().describe()  # a terminated run still answers queries: look at the run itself
    return d.run_id != old_run and d.status == WorkflowExecutionStatus.RUNNING


async def _guard(f: Fleet, pred):
    st = await f.status()
    return st if pred(st) else None


async def test_terminated_incident_gives_its_permit_back(temporal_client) -> None:
    """Terminating the incident that holds the only permit: the guard's reconciliation releases it (audit
    note) and the queued node drains. Before: the permit leaked and nothing else ever drained."""
    async with Fleet(temporal_client, GuardPolicy(**ONE_AT_A_TIME, permit_reconcile_s=1.0)) as f:
        a = await f.incident("a")
        await assert_eventually(lambda: f.drained("a"), what="a drained")
        await f.incident("b")
        await _held_and_queued(f, "a", "b")
        await a.terminate(reason="operator terminated the workflow")
        await assert_eventually(lambda: f.drained("b"), timeout_s=30, what="b drained after a's permit came back")
        st = await f.status()
        assert [h["node"] for h in st.held] == ["b"]
        assert any("a: permit released by reconciliation" in line for line in st.log), st.log


async def test_new_guard_rebuilds_its_queue_from_running_incidents(temporal_client) -> None:
    """Terminating the FleetGuard loses its queue; the next guard (started by the holder's release)
    rebuilds held and queued nodes from the running incidents, so the queued node drains once the holder
    is done. The incident's own re-request is set far off here: only the rebuild can save it."""
    async with Fleet(temporal_client, GuardPolicy(**ONE_AT_A_TIME, permit_reconcile_s=3600.0)) as f:
        a = await f.incident("a", permit_rerequest_s=3600.0)
        await assert_eventually(lambda: f.drained("a"), what="a drained")
        await f.incident("b", permit_rerequest_s=3600.0)
        await _held_and_queued(f, "a", "b")
        await f.guard().terminate(reason="operator terminated the guard")
        await a.execute_update(NodeRemediation.abort, AbortCommand(by="tester@ci", note="done with a"))
        await assert_eventually(lambda: f.drained("b"), timeout_s=30, what="b drained by the rebuilt guard")
        st = await f.status()
        assert any("rebuilt from the running incidents" in line for line in st.log), st.log


async def test_waiting_incident_asks_again(temporal_client) -> None:
    """An incident waiting for a permit asks again every `permit_rerequest_s`: a guard terminated while it
    waited is started anew by that request (and rebuilt) — no holder has to act."""
    async with Fleet(temporal_client, GuardPolicy(**ONE_AT_A_TIME, permit_reconcile_s=3600.0)) as f:
        a = await f.incident("a", permit_rerequest_s=2.0)
        await assert_eventually(lambda: f.drained("a"), what="a drained")
        await f.incident("b", permit_rerequest_s=2.0)
        await _held_and_queued(f, "a", "b")
        old_run = (await f.guard().describe()).run_id
        await f.guard().terminate(reason="operator terminated the guard")
        await assert_eventually(lambda: _new_run(f, old_run), timeout_s=30,
                                what="a new guard, started by b's re-request")
        await assert_eventually(lambda: _guard(f, lambda s: [q["node"] for q in s.queue] == ["b"]), timeout_s=30,
                                what="the new guard has b queued again")
        await a.terminate(reason="done with a")
        await f.guard().execute_update(FleetGuard.release_permit, PermitReleaseCommand(by="tester@ci", node="a"))
        await assert_eventually(lambda: f.drained("b"), timeout_s=30, what="b drained")


async def test_breaker_release_frees_a_permit_by_hand(temporal_client, nats_server, temporal_server,
                                                     tmp_path) -> None:
    """`fleetmend status` shows why the queued node waits; `fleetmend breaker release NODE` frees the held
    permit (audited with who ran it) and the queued node drains; `release_permit` without `by` is refused."""
    import asyncio
    import json

    from typer.testing import CliRunner

    from fleetmend.cli.app import app

    async with Fleet(temporal_client, GuardPolicy(**ONE_AT_A_TIME, permit_reconcile_s=3600.0)) as f:
        env = {"FLEETMEND_NATS_URL": nats_server.url, "FLEETMEND_TEMPORAL_ADDRESS": temporal_server.address,
               "FLEETMEND_CLUSTER": f.cluster, "FLEETMEND_TASK_QUEUE": f.tq, "FLEETMEND_STATE_DIR": str(tmp_path),
               "FLEETMEND_LOG_FORMAT": "json", "USER": "alice"}

        def cli(*args: str):
            return CliRunner().invoke(app, list(args), env=env, catch_exceptions=False)

        await f.incident("a")
        await assert_eventually(lambda: f.drained("a"), what="a drained")
        await f.incident("b")
        await _held_and_queued(f, "a", "b")

        async def b_waits_visibly():
            r = await asyncio.to_thread(cli, "status", "--cluster", f.cluster, "--json")  # status alone: every cluster
            rows = {x["node"]: x for x in json.loads(r.output)}
            b = rows.get("b") or {}
            return b if b.get("phase") == "awaiting_permit" and (b.get("waiting") or "").startswith("budget") else None

        await assert_eventually(b_waits_visibly, what="`fleetmend status` shows b waiting for the budget")
        with pytest.raises(WorkflowUpdateFailedError):
            await f.guard().execute_update(FleetGuard.release_permit, PermitReleaseCommand(by=" ", node="a"))
        # a's incident still runs with its drain in force: freeing its permit would let b drain too
        r = await asyncio.to_thread(cli, "breaker", "release", "a", "--note", "too early")
        assert r.exit_code == 1 and "still runs" in r.output, r.output
        # b only waits: refused as well, and said as it is (it holds no permit)
        r = await asyncio.to_thread(cli, "breaker", "release", "b")
        assert r.exit_code == 1 and "b holds no permit: it is queued for one" in " ".join(r.output.split()), r.output
        assert [h["node"] for h in (await f.status()).held] == ["a"] and not f.drained("b")
        a = f.client.get_workflow_handle(subjects.workflow_id(f.cluster, "a"))
        await a.terminate(reason="terminated by hand; its permit leaks (reconciliation is an hour away here)")
        r = await asyncio.to_thread(cli, "breaker", "release", "a", "--note", "leaked")
        assert r.exit_code == 0 and "a: permit released" in r.output, r.output
        await assert_eventually(lambda: f.drained("b"), what="b drained")
        st = await f.status()
        assert any("a: permit released by " in line and ": leaked" in line for line in st.log), st.log
        r = await asyncio.to_thread(cli, "breaker", "release", "zz")
        assert r.exit_code == 0 and "nothing released" in r.output, r.output
