"""Live configuration fixes of a `config_drift` incident, asked of the node's agent.

Request/reply on `fleet.<cluster>.reconfigure.<node token>` (`subjects.reconfigure_subject`) with a
`ReconfigureRequest`; the agent's inventory probe answers through `agents.commands.ReconfigureHandler` with a
`ReconfigureReport`, after writing under its `agent.host_root` and re-reading the fingerprint.
"""

from __future__ import annotations

import asyncio

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from temporalio import activity
from temporalio.exceptions import ApplicationError

from fleetmend import subjects
from fleetmend.drift import live_fixable
from fleetmend.fingerprint import RECONFIGURE_ACTIVITY, ReconfigureReport, ReconfigureRequest


class ReconfigureActivities:
    """Takes a connected `nats.aio.client.Client`."""

    def __init__(self, nc: NATS) -> None:
        self._nc = nc

    @activity.defn(name=RECONFIGURE_ACTIVITY)
    async def reconfigure_node(self, req: ReconfigureRequest) -> ReconfigureReport:
        """Ask the node's agent to set live settings and re-read them.

        Contract (for the remediation workflow):
            Input: `ReconfigureRequest` (cluster, node, incident_id, `fixes` = fact key → wanted value, taken from a
                `config_drift_*` event's attrs `key` and `wanted`; `dry_run`; `timeout_s`). Only keys
                `fleetmend.drift.live_fixable` accepts are sent (governor, nvidia_peermem, NUMA balancing, THP, IRQ
                affinity, persistence mode, application clocks, power limit); others are refused here, before the agent is asked.
            Output: `ReconfigureReport` (one `FixResult` per key: before, wanted, after, applied, verified, detail).
            Verified: a fresh read of the node's fingerprint after the write equals the wanted value, for every key
                (`report.verified`); the incident may then close without a drain, and the next fingerprint clears
                the `config_drift` fault (`config_drift_resolved`). A report that is not verified means: drain when
                idle and file a ticket, as for a reboot-only fix.
            Dry run: the agent writes only when its `policy.reconfigure` is true AND `req.dry_run` is false;
                `policy.reconfigure` defaults to false, so by default every answer is a dry run (`report.dry_run`,
                nothing applied), like `policy.reboot_command`.
            Idempotent: a key that already holds its wanted value is not written again and reports verified, so a
                retried activity re-applies nothing.
        Raises:
            ApplicationError InvalidRequest (non-retryable): no fixes, or a key that cannot be set live.
            ApplicationError AgentUnreachable (retryable): nobody answers on the subject within `timeout_s`.
            ApplicationError InvalidReport (non-retryable): the answer is not a `ReconfigureReport`, or names an error.
        """
        bad = sorted(k for k in req.fixes if not live_fixable(k))
        if not req.fixes or bad:
            raise ApplicationError(f"reconfigure_node: {'no fixes' if not req.fixes else 'not live-fixable: '}"
                                   f"{', '.join(bad)}; live keys: cpu.governor, gpudirect.peermem, "
                                   "kernel.numa_balancing, mm.thp_enabled, mm.thp_defrag, gpu.persistence_mode, "
                                   "gpu.app_clocks, gpu.power_limit, irq.affinity.*", type="InvalidRequest", non_retryable=True)
        subject = subjects.reconfigure_subject(req.cluster, req.node)
        activity.heartbeat(f"reconfigure {sorted(req.fixes)} via {subject}")
        try:
            msg = await self._nc.request(subject, req.model_dump_json().encode(), timeout=req.timeout_s)
        except NoRespondersError as err:
            raise ApplicationError(f"no agent answers live fixes on {subject}: is `fleetmend agent` running on "
                                   f"{req.node} with agent.inventory_enabled?", type="AgentUnreachable") from err
        except (NatsTimeout, asyncio.TimeoutError) as err:
            raise ApplicationError(f"agent on {req.node} did not answer the live fix within {req.timeout_s:.0f}s",
                                   type="AgentUnreachable") from err
        try:
            report = ReconfigureReport.model_validate_json(msg.data)
        except ValueError as err:
            raise ApplicationError(f"agent on {req.node} sent an invalid reconfigure report: {err}",
                                   type="InvalidReport", non_retryable=True) from err
        if report.error:
            raise ApplicationError(f"agent on {req.node}: {report.error}", type="InvalidReport", non_retryable=True)
        return report
