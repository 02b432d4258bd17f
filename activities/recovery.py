"""Recovery before RMA: GPU reset and node reboot, asked of the node's agent.

Request/reply on the node's diag subject (`subjects.diag_subject`) with a `RecoveryRequest` body
(`"type": "recovery"`); the agent's handler (agents/recovery.py) answers a `RecoveryReport`:
APPLIED, REFUSED (a process holds the GPU), NOT_APPLICABLE (no nvidia-smi), DRY_RUN (reboot
disabled, the default) or FAILED. The workflow verifies afterwards; this activity only asks.
"""

from __future__ import annotations

from nats.aio.client import Client as NATS
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.diagnostics import ask_agent
from fleetmend.diagnostics import RecoveryReport, RecoveryRequest
from fleetmend.infra.ledger import LedgerStore
from fleetmend.messages import Activity, RecoveryActivityRequest


class RecoveryActivities:
    """Takes a connected `nats.aio.client.Client`, and the incident ledger (each answer is added to the
    incident's record; never fails the activity)."""

    def __init__(self, nc: NATS, ledger: LedgerStore | None = None) -> None:
        self._nc = nc
        self._ledger = ledger

    async def _ask(self, req: RecoveryActivityRequest) -> RecoveryReport:
        body = RecoveryRequest(op=req.op, pci_bus_id=req.pci_bus_id, incident_id=req.incident_id,
                               deadline_s=req.timeout_s).model_dump_json().encode()
        # An agent without recovery support answers diagnostics instead: InvalidReport, not retried.
        report = await ask_agent(self._nc, req.cluster, req.node, body, req.timeout_s, RecoveryReport,
                                 what=req.op.value)
        if self._ledger is not None:
            info = activity.info()
            await self._ledger.recovered(cluster=req.cluster, node=req.node, incident_id=req.incident_id,
                                         attempt=f"{info.workflow_run_id}/{info.activity_id}", op=req.op.value,
                                         result=report.result.value)
        return report

    @activity.defn(name=Activity.RESET_GPU)
    async def reset_gpu(self, req: RecoveryActivityRequest) -> RecoveryReport:
        """Ask the agent to reset one GPU (`nvidia-smi -r -i <bus id>`, only if no process holds it).

        Returns: `RecoveryReport`. Raises: ApplicationError AgentUnreachable (retryable), InvalidReport.
        """
        if not req.pci_bus_id:
            raise ApplicationError("reset_gpu needs the GPU's PCI bus id", type="InvalidRequest",
                                   non_retryable=True)
        return await self._ask(req)

    @activity.defn(name=Activity.REBOOT_NODE)
    async def reboot_node(self, req: RecoveryActivityRequest) -> RecoveryReport:
        """Ask the agent to reboot the node (its configured `reboot_command`; empty = dry run)."""
        return await self._ask(req)
