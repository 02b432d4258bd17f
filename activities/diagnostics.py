"""Diagnostics through the node's agent (NATS request/reply on `fleet.<cluster>.diag.<node>`)."""

from __future__ import annotations

import asyncio
from typing import TypeVar

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from pydantic import BaseModel
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.scheduler import NodeEventRecorder
from fleetmend import subjects
from fleetmend.diagnostics import DiagReport, DiagRequest, DiagResult
from fleetmend.infra.ledger import LedgerStore
from fleetmend.messages import Activity, DiagActivityRequest

T = TypeVar("T", bound=BaseModel)


async def ask_agent(nc: NATS, cluster: str, node: str, body: bytes, timeout_s: float, reply: type[T],
                    what: str) -> T:
    """Request/reply with a node's agent on `fleet.<cluster>.diag.<node>`, heartbeating first.

    Returns:
        The reply parsed as `reply` (a pydantic model).
    Raises:
        ApplicationError(type="AgentUnreachable"): nobody listens, or no answer within `timeout_s`
            (retryable: the agent may be restarting).
        ApplicationError(type="InvalidReport", non_retryable): the answer is not a `reply`.
    """
    subject = subjects.diag_subject(cluster, node)
    activity.heartbeat(f"{what} via {subject}")
    try:
        msg = await nc.request(subject, body, timeout=timeout_s)
    except NoRespondersError as err:
        raise ApplicationError(f"no agent listens on {subject}: is `fleetmend agent` running on {node}?",
                               type="AgentUnreachable") from err
    except (NatsTimeout, asyncio.TimeoutError) as err:
        raise ApplicationError(f"agent on {node} did not answer {what} on {subject} within {timeout_s:.0f}s",
                               type="AgentUnreachable") from err
    try:
        return reply.model_validate_json(msg.data)
    except ValueError as err:
        raise ApplicationError(f"agent on {node} sent an invalid {what} reply: {err}", type="InvalidReport",
                               non_retryable=True) from err


class DiagnosticsActivities:
    """Runs diagnostics on a node by asking its agent. Takes a connected `nats.aio.client.Client`."""

    def __init__(self, nc: NATS, node_events: NodeEventRecorder | None = None, ledger: LedgerStore | None = None) -> None:
        self._nc = nc
        self._ledger = ledger
        """The incident ledger: each report is added to the incident's record (never fails the activity)."""
        self._node_events = node_events
        """Optional `async (node, step, message, key=...)` recorder (the Kubernetes adapter's
        `record_event`): each report becomes a `FleetmendDiagnostics` Event on the Node."""

    @activity.defn(name=Activity.RUN_DIAGNOSTICS)
    async def run_diagnostics(self, req: DiagActivityRequest) -> DiagReport:
        """Ask the node's agent for a `DiagReport`.

        Returns:
            `DiagReport` (checks with name/result/measured/expected).
        Raises:
            ApplicationError(type="AgentUnreachable"): no agent answered within `timeout_s` (retryable:
                the agent may be restarting); the workflow records UNKNOWN after its retries.
        """
        body = DiagRequest(level=req.level, checks=req.checks or [], incident_id=req.incident_id,
                           deadline_s=req.timeout_s).model_dump_json().encode()
        report = await ask_agent(self._nc, req.cluster, req.node, body, req.timeout_s, DiagReport,
                                 what="diagnostics")
        if self._node_events is not None:
            failed = [c.name for c in report.checks if c.result == DiagResult.FAIL]
            await self._node_events(
                req.node, "diagnostics", f"{req.level} diagnostics: {report.result}"
                + (f" (failed: {', '.join(failed[:10])})" if failed else ""),
                key=f"{req.incident_id}|diagnostics|{activity.info().workflow_run_id}|{activity.info().activity_id}")
        if self._ledger is not None:
            info = activity.info()
            await self._ledger.diagnosed(
                cluster=req.cluster, node=req.node, incident_id=req.incident_id,
                attempt=f"{info.workflow_run_id}/{info.activity_id}", result=report.result.value,
                checks=[c.model_dump(mode="json") for c in report.checks])
        return report
