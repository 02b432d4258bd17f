"""Diagnostics through the node's agent (NATS request/reply on `fleet.<cluster>.diag.<node>`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from temporalio import activity
from temporalio.exceptions import ApplicationError

from fleetmend import subjects
from fleetmend.diagnostics import DiagLevel, DiagReport, DiagRequest


@dataclass
class DiagActivityRequest:
    cluster: str
    node: str
    level: DiagLevel = DiagLevel.QUICK
    checks: list[str] | None = None
    timeout_s: float = 120.0
    incident_id: str | None = None


class DiagnosticsActivities:
    """Runs diagnostics on a node by asking its agent. Takes a connected `nats.aio.client.Client`."""

    def __init__(self, nc) -> None:  # noqa: ANN001 - nats client, not imported by workflows
        self._nc = nc

    @activity.defn(name="run_diagnostics")
    async def run_diagnostics(self, req: DiagActivityRequest) -> DiagReport:
        """Ask the node's agent for a `DiagReport`.

        Returns:
            `DiagReport` (checks with name/result/measured/expected).
        Raises:
            ApplicationError(type="AgentUnreachable"): no agent answered within `timeout_s` (retryable:
                the agent may be restarting); the workflow records UNKNOWN after its retries.
        """
        from nats.errors import NoRespondersError, TimeoutError as NatsTimeout

        body = DiagRequest(level=req.level, checks=req.checks or [], incident_id=req.incident_id,
                           deadline_s=req.timeout_s).model_dump_json().encode()
        subject = subjects.diag_subject(req.cluster, req.node)
        activity.heartbeat(f"asking {subject}")
        try:
            msg = await self._nc.request(subject, body, timeout=req.timeout_s)
        except NoRespondersError as err:
            raise ApplicationError(f"no agent listens on {subject}: is `fleetmend agent` running on {req.node}?",
                                   type="AgentUnreachable") from err
        except (NatsTimeout, asyncio.TimeoutError) as err:
            raise ApplicationError(f"agent on {req.node} did not answer {subject} within {req.timeout_s:.0f}s",
                                   type="AgentUnreachable") from err
        try:
            return DiagReport.model_validate_json(msg.data)
        except ValueError as err:
            raise ApplicationError(f"agent on {req.node} sent an invalid diagnostics report: {err}",
                                   type="InvalidReport", non_retryable=True) from err
