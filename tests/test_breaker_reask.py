"""FleetGuard's breaker after a reset, on the dev server: a queued node asking again (its incident
re-requests every `permit_rerequest_s`, or asks after the router forwarded it) is not a new fault.

When every re-ask was counted as a fresh drain-worthy fault, with more queued nodes than
`breaker_distinct_nodes` a `breaker reset` tripped again within one re-request period with no new fault
at all, and a storm's backlog could never be worked off (found by a fresh-eyes operator trial: reset at
03:47:16, tripped again at 03:48:48 on 101 queued nodes)."""

from __future__ import annotations

import asyncio
import uuid

from temporalio.service import RPCError
from temporalio.worker import Worker

from fleetmend import subjects
from fleetmend.messages import AbortCommand, GuardApi, GuardCommand, GuardPolicy, GuardStatus
from fleetmend.worker import workflow_runner
from tests.activity_standins import GUARD_ACTIVITIES, Calls, guard_activities, real_guard, stand_ins
from tests.conftest import assert_eventually
from tests.test_workflow import fault, start
from workflows.fleetguard import FleetGuard
from workflows.remediation import NodeRemediation

NODES = [f"q{i}" for i in range(5)]
REASK_S = 1.0


async def reask_after_reset(client, js) -> tuple[object, GuardStatus, GuardStatus]:
    """Budget 1, breaker at more than 2 distinct nodes: 5 incidents ask (1 granted, 4 queued, the breaker
    trips), an operator resets it, then every queued incident asks again (every `REASK_S`). Returns
    (guard history, status after the reset, status after three rounds of re-asks);
    tests/test_policy_replay.py records its history."""
    cluster, tq = f"rk{uuid.uuid4().hex[:6]}", f"rk-{uuid.uuid4().hex[:8]}"
    policy = GuardPolicy(max_drained_nodes=1, max_drained_percent=100, cluster_nodes=100,
                         breaker_distinct_nodes=2, domain_incident_nodes=1000)
    calls = Calls()
    acts = [a for a in stand_ins(calls) if a.__name__ not in GUARD_ACTIVITIES]
    guard = guard_activities(real_guard(client, tq, policy, js), calls)
    tq = subjects.cluster_task_queue(tq, cluster)  # the cluster's queue: its incidents and its guard
    handle = client.get_workflow_handle(subjects.fleetguard_workflow_id(cluster))

    async def status(pred):
        try:
            st = await handle.query(GuardApi.STATUS, result_type=GuardStatus)
        except RPCError:  # not started yet
            return None
        return st if pred(st) else None

    async with Worker(client, task_queue=tq, workflows=[FleetGuard, NodeRemediation],
                      workflow_runner=workflow_runner(), activities=acts + guard):
        incidents = []
        for n in NODES:
            incidents.append(await start(client, tq, cluster, n, [fault(cluster, n, 79, drain=True)],
                                         permit_rerequest_s=REASK_S))
            await assert_eventually(lambda n=n: status(lambda st: n in {h["node"] for h in st.held}
                                                       | {q["node"] for q in st.queue}), what=f"{n} at the guard")
        await assert_eventually(lambda: status(lambda st: st.breaker_tripped and len(st.queue) == 4),
                                what="the breaker tripped with 4 queued")
        await handle.execute_update(GuardApi.RESET_BREAKER, GuardCommand(by="ops@test", note="storm understood"),
                                    result_type=str)
        after_reset = await assert_eventually(lambda: status(lambda st: not st.breaker_tripped), what="reset")
        await asyncio.sleep(3 * REASK_S + 1)  # every queued incident asked again, three times
        after_reasks = await handle.query(GuardApi.STATUS, result_type=GuardStatus)
        for h in incidents:
            await h.execute_update(NodeRemediation.abort, AbortCommand(by="ops@test", note="test done", undrain=True))
        await assert_eventually(lambda: status(lambda st: not st.held and not st.queue), what="all released")
        history = await handle.fetch_history()
        await handle.terminate("test done")
    return history, after_reset, after_reasks


async def test_a_queued_node_asking_again_is_not_a_new_fault(temporal_client, nc) -> None:
    _history, after_reset, st = await reask_after_reset(temporal_client, nc.jetstream())
    assert [h["node"] for h in after_reset.held] == ["q0"]
    assert not st.breaker_tripped, st.breaker_reason
    assert st.recent_nodes == 0 and sorted(q["node"] for q in st.queue) == NODES[1:]
    assert [h["node"] for h in st.held] == ["q0"]  # the holder's re-ask: "permit already held", nothing else
    assert st.pool_holders == 1
