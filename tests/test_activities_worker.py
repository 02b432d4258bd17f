"""Scheduler and ticket activities through a real Temporal worker (dev server fixture), called by
their registered names the way workflows/remediation.py calls them."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
from temporalio import workflow
from temporalio.client import WorkflowFailureError
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from activities.scheduler import SchedulerActivities
from activities.slurm import SlurmScheduler
from activities.standalone import StandaloneScheduler
from activities.ticket_store import LocalTicketStore
from activities.tickets import TicketActivities
from fleetmend.config import SlurmSettings
from fleetmend.messages import (
    DrainRequest,
    DrainResult,
    TicketRef,
    TicketRequest,
    TicketUpdate,
    UndrainRequest,
    UndrainResult,
)


@dataclass
class CycleInput:
    node: str
    incident_id: str


@dataclass
class CycleOutput:
    drain: DrainResult
    drain_again: DrainResult
    ticket: TicketRef
    ticket_again: TicketRef
    undrain: UndrainResult


_OPTS = dict(start_to_close_timeout=timedelta(seconds=60), heartbeat_timeout=timedelta(seconds=20),
             retry_policy=RetryPolicy(maximum_attempts=3, initial_interval=timedelta(milliseconds=100)))


@workflow.defn(name="fm_test_remediation_side_effects")
class SideEffects:
    @workflow.run
    async def run(self, inp: CycleInput) -> CycleOutput:
        req = DrainRequest("c1", inp.node, "xid 79 GPU fell off the bus", inp.incident_id)
        drain = await workflow.execute_activity("drain_node", req, result_type=DrainResult, **_OPTS)
        again = await workflow.execute_activity("drain_node", req, result_type=DrainResult, **_OPTS)
        treq = TicketRequest(inp.incident_id, "c1", inp.node, f"{inp.node}: XID 79", "fatal", "gpu_lost",
                             {"raw": ["NVRM: Xid (PCI:0000:3b:00): 79"]})
        ticket = await workflow.execute_activity("file_ticket", treq, result_type=TicketRef, **_OPTS)
        ticket_again = await workflow.execute_activity("file_ticket", treq, result_type=TicketRef, **_OPTS)
        await workflow.execute_activity(
            "update_ticket", TicketUpdate(ticket.ticket_id, inp.incident_id, "resolved", "verified"), **_OPTS)
        undrain = await workflow.execute_activity(
            "undrain_node", UndrainRequest("c1", inp.node, inp.incident_id), result_type=UndrainResult, **_OPTS)
        return CycleOutput(drain, again, ticket, ticket_again, undrain)


@workflow.defn(name="fm_test_drain_only")
class DrainOnly:
    @workflow.run
    async def run(self, inp: CycleInput) -> DrainResult:
        return await workflow.execute_activity(
            "drain_node", DrainRequest("c1", inp.node, "xid 79", inp.incident_id), result_type=DrainResult, **_OPTS)


def _worker(client, queue: str, scheduler, tmp_path: Path) -> Worker:
    sa, ta = SchedulerActivities(scheduler), TicketActivities(LocalTicketStore(tmp_path / "tickets"))
    return Worker(client, task_queue=queue, workflows=[SideEffects, DrainOnly],
                  activities=[sa.drain_node, sa.undrain_node, ta.file_ticket, ta.update_ticket],
                  workflow_runner=UnsandboxedWorkflowRunner(), graceful_shutdown_timeout=timedelta(seconds=5))


async def test_side_effects_through_worker_standalone(temporal_client, nc, unique, tmp_path) -> None:
    queue = f"q-{unique}"
    sched = StandaloneScheduler(nc.jetstream(), bucket=f"drains_{unique}")
    async with _worker(temporal_client, queue, sched, tmp_path):
        out = await temporal_client.execute_workflow(
            SideEffects.run, CycleInput("gpu-101", f"inc-{unique}"), id=f"wf-{unique}", task_queue=queue,
            result_type=CycleOutput)
    assert out.drain.owned and out.drain.drained
    assert out.drain_again.owned and "no write" in out.drain_again.detail
    assert out.ticket.created and not out.ticket_again.created
    assert out.ticket.ticket_id == out.ticket_again.ticket_id == "FM-000001"
    assert out.undrain.resumed
    doc = await LocalTicketStore(tmp_path / "tickets").get("FM-000001")
    assert doc["status"] == "resolved"


@pytest.mark.slurm
async def test_node_not_found_is_not_retried(temporal_client, slurm, unique, tmp_path) -> None:
    queue = f"q-{unique}"
    sched = SlurmScheduler(SlurmSettings(slurm_conf=str(slurm.conf), command_timeout_s=15))
    async with _worker(temporal_client, queue, sched, tmp_path):
        ok = await temporal_client.execute_workflow(
            DrainOnly.run, CycleInput("node1", f"inc-{unique}"), id=f"wf-ok-{unique}", task_queue=queue,
            result_type=DrainResult)
        assert ok.owned and slurm.state("node1") == "IDLE+DRAIN"
        handle = await temporal_client.start_workflow(
            DrainOnly.run, CycleInput("node404", f"inc-{unique}"), id=f"wf-404-{unique}", task_queue=queue)
        with pytest.raises(WorkflowFailureError) as ei:
            await handle.result()
    act = ei.value.cause
    assert isinstance(act, ActivityError)
    assert isinstance(act.cause, ApplicationError) and act.cause.type == "NodeNotFound"
    assert "node404" in act.cause.message
    history = await handle.fetch_history()
    attempts = [e.activity_task_started_event_attributes.attempt for e in history.events
                if e.HasField("activity_task_started_event_attributes")]
    assert attempts == [1], f"NodeNotFound must not be retried: attempts {attempts}"
