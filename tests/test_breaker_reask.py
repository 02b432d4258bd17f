"""FleetGuard's breaker after a reset, on the dev server: a queued node asking again (its incident
re-requests every `permit_rerequest_s`, or asks after the router forwarded it) is not a new fault.

Before patch `reask-not-a-fault` every re-ask was counted as a fresh drain-worthy fault, so with more
queued nodes than `breaker_distinct_nodes` a `breaker reset` tripped again within one re-request
period with no new fault at all, and a storm's backlog could never be worked off (found by a
fresh-eyes operator trial: reset at 03:47:16, tripped again at 03:48:48 on 101 queued nodes)."""

from __future__ import annotations

import uuid

from temporalio.worker import Worker

from activities.fleetguard import FleetGuardActivities
from fleetmend import subjects
from fleetmend.events import Severity
from fleetmend.messages import (
    GuardApi,
    GuardCommand,
    GuardInput,
    GuardPolicy,
    GuardStatus,
    PermitDecision,
    PermitRequest,
)
from fleetmend.worker import workflow_runner
from workflows.fleetguard import FleetGuard

NODES = [f"q{i}" for i in range(5)]


async def reask_after_reset(client) -> tuple[object, GuardStatus, GuardStatus]:
    """Budget 1, breaker at more than 2 distinct nodes: 5 nodes ask (1 granted, 4 queued, the breaker
    trips), an operator resets it, then every queued node asks again. Returns (guard handle, status
    after the reset, status after the re-asks); tests/test_policy_replay.py records its history."""
    cluster, tq = f"rk{uuid.uuid4().hex[:6]}", f"rk-{uuid.uuid4().hex[:8]}"
    policy = GuardPolicy(max_drained_nodes=1, max_drained_percent=100, cluster_nodes=100,
                         breaker_distinct_nodes=2, domain_incident_nodes=1000)
    acts = FleetGuardActivities(client, tq, policy)
    handle = client.get_workflow_handle(subjects.fleetguard_workflow_id(cluster))

    def req(node: str) -> PermitRequest:
        return PermitRequest(cluster=cluster, node=node, severity=Severity.FATAL, fault_class="xid79", policy=policy)

    async with Worker(client, task_queue=tq, workflows=[FleetGuard], workflow_runner=workflow_runner(),
                      activities=[acts.running_incidents]):
        await client.start_workflow(GuardApi.WORKFLOW, GuardInput(cluster=cluster, policy=policy),
                                    id=subjects.fleetguard_workflow_id(cluster), task_queue=tq,
                                    start_signal=GuardApi.ENSURE)
        for n in NODES:
            await handle.execute_update(GuardApi.DECIDE_PERMIT, req(n), result_type=PermitDecision)
        await handle.execute_update(GuardApi.RESET_BREAKER, GuardCommand(by="ops@test", note="storm understood"),
                                    result_type=str)
        after_reset = await handle.query(GuardApi.STATUS, result_type=GuardStatus)
        for n in NODES:  # the incidents' re-requests
            await handle.execute_update(GuardApi.DECIDE_PERMIT, req(n), result_type=PermitDecision)
        after_reasks = await handle.query(GuardApi.STATUS, result_type=GuardStatus)
        history = await handle.fetch_history()
        await handle.terminate("test done")
    return history, after_reset, after_reasks


async def test_a_queued_node_asking_again_is_not_a_new_fault(temporal_client) -> None:
    _history, after_reset, st = await reask_after_reset(temporal_client)
    assert not after_reset.breaker_tripped and [h["node"] for h in after_reset.held] == ["q0"]
    assert not st.breaker_tripped, st.breaker_reason
    assert st.recent_nodes == 0 and [q["node"] for q in st.queue] == NODES[1:]
    assert [h["node"] for h in st.held] == ["q0"]  # the holder's re-ask: "permit already held", nothing else
