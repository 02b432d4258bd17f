"""The agent side of recovery requests (GPU reset, reboot) arriving on the node's diag subject.

- RESET_GPU: `nvidia-smi -r -i <bus id>` (the configured `gpu_reset_command` + bus id) only when no
  compute process holds that GPU (`nvidia-smi --query-compute-apps=gpu_bus_id,pid`); otherwise
  REFUSED naming the pids. Without nvidia-smi on the host: NOT_APPLICABLE.
- REBOOT: runs the configured `reboot_command`; empty (the default) answers DRY_RUN and reboots
  nothing, so a development machine running `fleetmend dev up` is never rebooted. The reply is sent
  before the command runs (a reboot would otherwise take the answer with it).

Commands run as subprocesses with a deadline; the executable is resolved by `which` (a test passes
a directory of stand-in scripts on PATH).
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from typing import Any

import structlog
from pydantic import ValidationError

from agents.commands import run_command, tail
from fleetmend.diagnostics import RecoveryOp, RecoveryReport, RecoveryRequest, RecoveryResult

QUERY_APPS = ["nvidia-smi", "--query-compute-apps=gpu_bus_id,pid", "--format=csv,noheader"]


def _norm_bus(bus: str) -> str:
    """`00000000:3B:00.0` (nvidia-smi) and `0000:3b:00.0` (kernel) compare equal."""
    bus = bus.strip().lower()
    dom, _, rest = bus.partition(":")
    return f"{int(dom, 16):04x}:{rest}" if rest else bus


class RecoveryHandler:
    """Answers `RecoveryRequest`s for one node. `reboot_command=[]` is a dry run (the default)."""

    def __init__(self, cluster: str, node: str, *, reboot_command: list[str] | None = None,
                 gpu_reset_command: list[str] | None = None,
                 on_reboot: Callable[[RecoveryRequest], None] | None = None) -> None:
        """`on_reboot(req)` runs right before the reboot command (the agent records the ordered reboot,
        so the next boot is not reported as unexpected); an exception from it is logged, not raised."""
        self.cluster, self.node = cluster, node
        self.on_reboot = on_reboot
        self.reboot_command = list(reboot_command or [])
        self.gpu_reset_command = list(gpu_reset_command or ["nvidia-smi", "-r", "-i"])
        self._lock = asyncio.Lock()
        self._log = structlog.get_logger("fleetmend.agent.recovery").bind(cluster=cluster, node=node)

    async def answer(self, msg: Any) -> None:
        """Handle one NATS message: validate, act, respond with a `RecoveryReport`."""
        try:
            req = RecoveryRequest.model_validate_json(msg.data)
        except (ValidationError, ValueError) as err:
            self._log.warning("recovery_request_invalid", error=str(err)[:500])
            return
        async with self._lock:
            report, after = await self.handle(req)
        if msg.reply:
            await msg.respond(report.model_dump_json().encode())
        if after is not None:
            await after()

    async def handle(self, req: RecoveryRequest) -> tuple[RecoveryReport, Any]:
        """Returns (report, an optional coroutine function to run after the reply: the reboot)."""
        self._log.info("recovery_requested", op=req.op.value, pci_bus_id=req.pci_bus_id, incident_id=req.incident_id)
        if req.op is RecoveryOp.RESET_GPU:
            return await self._reset(req), None
        return self._reboot(req)

    def _report(self, req: RecoveryRequest, result: RecoveryResult, detail: str,
                command: list[str] | None = None) -> RecoveryReport:
        self._log.info("recovery_answered", op=req.op.value, result=result.value, detail=detail[:300])
        return RecoveryReport(node=self.node, cluster=self.cluster, op=req.op, result=result, detail=detail,
                              command=command or [])

    async def _reset(self, req: RecoveryRequest) -> RecoveryReport:
        if not req.pci_bus_id:
            return self._report(req, RecoveryResult.FAILED, "reset_gpu needs pci_bus_id")
        if shutil.which(self.gpu_reset_command[0]) is None or shutil.which(QUERY_APPS[0]) is None:
            return self._report(req, RecoveryResult.NOT_APPLICABLE,
                                f"{self.gpu_reset_command[0]} not installed on this host")
        rc, out = await _run(QUERY_APPS, req.deadline_s)
        if rc != 0:
            return self._report(req, RecoveryResult.FAILED, f"could not list GPU processes: {out}", QUERY_APPS)
        want = _norm_bus(req.pci_bus_id)
        holders = [line.split(",")[1].strip() for line in out.splitlines()
                   if "," in line and _norm_bus(line.split(",")[0]) == want]
        if holders:
            return self._report(req, RecoveryResult.REFUSED,
                                f"GPU {req.pci_bus_id} is held by pid(s) {', '.join(holders)}; not reset", QUERY_APPS)
        argv = self.gpu_reset_command + [req.pci_bus_id]
        rc, out = await _run(argv, req.deadline_s)
        result = RecoveryResult.APPLIED if rc == 0 else RecoveryResult.FAILED
        return self._report(req, result, f"exit {rc}: {out}", argv)

    def _reboot(self, req: RecoveryRequest) -> tuple[RecoveryReport, Any]:
        if not self.reboot_command:
            return self._report(req, RecoveryResult.DRY_RUN,
                                "reboot disabled on this agent (policy.reboot_command is empty): "
                                "would reboot; nothing done"), None
        if shutil.which(self.reboot_command[0]) is None:
            return self._report(req, RecoveryResult.NOT_APPLICABLE, f"{self.reboot_command[0]} not found",
                                self.reboot_command), None
        argv = list(self.reboot_command)

        async def after() -> None:
            if self.on_reboot is not None:
                try:
                    self.on_reboot(req)
                except Exception as err:  # noqa: BLE001 - the reboot goes ahead; the next boot may read as unexpected
                    self._log.warning("reboot_not_recorded", error=repr(err))
            rc, out = await _run(argv, req.deadline_s)
            self._log.info("reboot_command_ran", rc=rc, output=out[:300])

        return self._report(req, RecoveryResult.APPLIED, f"running {' '.join(argv)}", argv), after


async def _run(argv: list[str], timeout_s: float) -> tuple[int, str]:
    ran = await run_command(argv, timeout_s)
    if ran is None:
        return -1, f"timed out after {timeout_s:.0f}s"
    return ran[0], tail(ran[1]).strip()
