"""Running a site tool (dcgmi, nvidia-smi, a reboot command) from the agent, with a deadline; and the live
configuration fixes of a `config_drift` incident (`ReconfigureHandler`)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
from pydantic import ValidationError

from fleetmend.fingerprint import FixResult, ReconfigureReport, ReconfigureRequest

OUTPUT_TAIL_BYTES = 2000
"""How much of a tool's output goes into a report (the end: where the verdict and errors are)."""


async def run_command(argv: list[str], timeout_s: float) -> tuple[int, bytes] | None:
    """Run `argv` (no shell), stdout and stderr together.

    Returns:
        (exit code, whole output), or None when it ran past `timeout_s` seconds (it is killed).
    Raises:
        OSError: the program cannot be started.
    """
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    try:
        async with asyncio.timeout(timeout_s):
            out, _ = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return None
    return proc.returncode or 0, out


def tail(out: bytes) -> str:
    return out[-OUTPUT_TAIL_BYTES:].decode(errors="replace")


# ---------------------------------------------------------------- live configuration fixes (issue 25)

PEERMEM_LOAD_COMMAND = ["modprobe", "nvidia-peermem"]
"""How `gpudirect.peermem` is loaded: NVIDIA's GPUDirect RDMA docs ("sudo modprobe nvidia-peermem", on each boot)."""
FIX_COMMAND_TIMEOUT_S = 30.0
"""Bound on a fix command (modprobe): loading a module takes well under a second."""


def _cpufreq_files(root: Path) -> list[Path]:
    base = root / "sys/devices/system/cpu"
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []
    return [f for c in names if c.startswith("cpu") and c[3:].isdigit()
            if (f := base / c / "cpufreq/scaling_governor").exists()]


def _irq_files(root: Path, bdf: str) -> tuple[str | None, list[Path]]:
    dev = root / "sys/bus/pci/devices" / bdf
    try:
        local = (dev / "local_cpulist").read_text().strip()
        irqs = sorted(os.listdir(dev / "msi_irqs"))
    except OSError:
        return None, []
    return local, [root / "proc/irq" / n / "smp_affinity_list" for n in irqs]


class ReconfigureHandler:
    """Applies live configuration fixes under `host_root` and re-reads the fingerprint to verify them.

    What each key writes (all under `host_root`, so a fixture tree stands in for a host):
        cpu.governor            the value into every `sys/devices/system/cpu/cpu*/cpufreq/scaling_governor`
        kernel.numa_balancing   the value into `proc/sys/kernel/numa_balancing`
        mm.thp_enabled/defrag   the word into `sys/kernel/mm/transparent_hugepage/{enabled,defrag}`
        irq.affinity.<r>.<bdf>  `local`: the NIC's `local_cpulist` into `proc/irq/<n>/smp_affinity_list` of each
                                of its `msi_irqs` (what Mellanox `set_irq_affinity_cpulist.sh` does)
        gpudirect.peermem       `loaded`: runs `peermem_command` (default `modprobe nvidia-peermem`); verified by
                                `sys/module/nvidia_peermem/` appearing under `host_root`
        gpu.persistence_mode    `enabled`: NVML `nvmlDeviceSetPersistenceMode(h, 1)` on every GPU (`nvml=`)
        gpu.app_clocks          `at max`: NVML `nvmlDeviceSetApplicationsClocks(h, max mem, max sm)` (what Azure's
                                azure_gpu_app_clocks.nhc does with `nvidia-smi -ac`)
        gpu.power_limit         `enforced=<W>W default=<W>W` with both equal: NVML
                                `nvmlDeviceSetPowerManagementLimit(h, default)` on every GPU
    Anything else (IOMMU, ACS, kernel command line, BIOS, firmware) needs a reboot or a human: answered as not
    applied, with the reason.

    `enabled=False` (`policy.reconfigure`, the default) answers every request as a dry run: what would be
    written, nothing written. Idempotent: a key that already holds its wanted value is not written again and
    reports verified.
    """

    def __init__(self, host_root: Path | str, cluster: str, node: str, *, enabled: bool = False,
                 peermem_command: list[str] | None = None, nvml: Any = None,
                 on_applied: Callable[[str], None] | None = None) -> None:
        """`on_applied(seen_by)` runs after a real write (the inventory probe re-reads and publishes)."""
        self.root = Path(host_root)
        self.cluster, self.node = cluster, node
        self.enabled = enabled
        self.peermem_command = list(peermem_command or PEERMEM_LOAD_COMMAND)
        self.nvml = nvml
        self.on_applied = on_applied
        self._lock = asyncio.Lock()
        self._log = structlog.get_logger("fleetmend.agent.reconfigure").bind(cluster=cluster, node=node)

    def _read(self) -> dict[str, str]:
        from agents.inventory import read_fingerprint  # lazy: commands.py is imported by every responder

        return read_fingerprint(self.root, self.cluster, self.node, nvml=self.nvml).settings

    async def handle(self, req: ReconfigureRequest) -> ReconfigureReport:
        """Apply `req.fixes` (or only describe them in a dry run) and verify each by a fresh read.

        Returns:
            `ReconfigureReport` with one `FixResult` per key, in key order. Never raises for a bad key or a
            failed write: the result says what happened.
        """
        dry = req.dry_run or not self.enabled
        async with self._lock:
            before = await asyncio.to_thread(self._read)
            plans: list[tuple[str, str, str]] = []  # key, wanted, detail of the plan
            results: dict[str, FixResult] = {}
            for key, wanted in sorted(req.fixes.items()):
                found = before.get(key)
                if found == wanted:
                    results[key] = FixResult(key=key, before=found, wanted=wanted, after=found, applied=False,
                                             verified=True, detail="already holds")
                    continue
                detail = self._plan(key, wanted)
                if detail.startswith("cannot"):
                    results[key] = FixResult(key=key, before=found, wanted=wanted, after=found, applied=False,
                                             verified=False, detail=detail)
                    continue
                plans.append((key, wanted, detail))
            if dry:
                for key, wanted, detail in plans:
                    results[key] = FixResult(key=key, before=before.get(key), wanted=wanted, after=before.get(key),
                                             applied=False, verified=False, detail=f"dry run: would {detail}")
            else:
                errors: dict[str, str] = {}
                for key, wanted, _detail in plans:
                    try:
                        await self._apply(key, wanted)
                    except (OSError, RuntimeError) as err:
                        errors[key] = f"{type(err).__name__}: {err}"
                after = await asyncio.to_thread(self._read)
                for key, wanted, detail in plans:
                    got = after.get(key)
                    results[key] = FixResult(key=key, before=before.get(key), wanted=wanted, after=got,
                                             applied=key not in errors, verified=got == wanted,
                                             detail=errors.get(key, detail))
                if plans and self.on_applied is not None:
                    self.on_applied(f"reconfigure:{req.incident_id or 'cli'}")
        report = ReconfigureReport(node=self.node, dry_run=dry, results=[results[k] for k in sorted(results)])
        self._log.info("reconfigure_answered", dry_run=dry, verified=report.verified,
                       keys=[r.key for r in report.results if not r.verified])
        return report

    def _plan(self, key: str, wanted: str) -> str:
        """What a fix of `key` to `wanted` would write, or 'cannot …' with the reason."""
        if key == "cpu.governor":
            files = _cpufreq_files(self.root)
            return f"write {wanted!r} to {len(files)} scaling_governor files" if files else "cannot: no cpufreq"
        if key == "kernel.numa_balancing":
            return f"write {wanted!r} to proc/sys/kernel/numa_balancing"
        if key in ("mm.thp_enabled", "mm.thp_defrag"):
            return f"write {wanted!r} to sys/kernel/mm/transparent_hugepage/{key.removeprefix('mm.thp_')}"
        if key.startswith("irq.affinity."):
            if wanted != "local":
                return f"cannot: irq affinity is fixed to 'local' only, not {wanted!r}"
            local, files = _irq_files(self.root, key.split(".", 3)[-1])
            return f"write {local} to {len(files)} smp_affinity_list files" if files else "cannot: no msi_irqs"
        if key == "gpudirect.peermem":
            return f"run {' '.join(self.peermem_command)}" if wanted == "loaded" else "cannot: only loading is done"
        if key == "gpu.persistence_mode":
            if wanted != "enabled" or self.nvml is None:
                return "cannot: persistence mode is enabled through NVML only"
            return "enable persistence mode on every GPU (NVML)"
        if key == "gpu.app_clocks":
            if wanted != "at max" or self.nvml is None:
                return "cannot: application clocks are set to max through NVML only"
            return "set application clocks to max on every GPU (NVML)"
        if key == "gpu.power_limit":
            parts = wanted.replace("enforced=", "").replace("default=", "").split()
            if self.nvml is None or len(parts) != 2 or parts[0] != parts[1]:
                return "cannot: the power limit is only reset to the default, through NVML"
            return "reset the enforced power limit to the default on every GPU (NVML)"
        return f"cannot: {key} is not set live (needs a reboot, firmware or a human)"

    async def _apply(self, key: str, wanted: str) -> None:
        if key == "cpu.governor":
            for f in _cpufreq_files(self.root):
                await asyncio.to_thread(f.write_text, wanted + "\n")
        elif key == "kernel.numa_balancing":
            await asyncio.to_thread((self.root / "proc/sys/kernel/numa_balancing").write_text, wanted + "\n")
        elif key in ("mm.thp_enabled", "mm.thp_defrag"):
            f = self.root / "sys/kernel/mm/transparent_hugepage" / key.removeprefix("mm.thp_")
            await asyncio.to_thread(f.write_text, wanted + "\n")
        elif key.startswith("irq.affinity."):
            local, files = _irq_files(self.root, key.split(".", 3)[-1])
            for f in files:
                await asyncio.to_thread(f.write_text, f"{local}\n")
        elif key == "gpudirect.peermem":
            res = await run_command(self.peermem_command, FIX_COMMAND_TIMEOUT_S)
            if res is None or res[0] != 0:
                raise RuntimeError(f"{' '.join(self.peermem_command)}: "
                                   + ("timed out" if res is None else f"exit {res[0]}: {tail(res[1])}"))
        elif key.startswith("gpu."):
            await asyncio.to_thread(self._nvml_fix, key)

    def _nvml_fix(self, key: str) -> None:
        nvml = self.nvml
        nvml.nvmlInit()
        try:
            for i in range(nvml.nvmlDeviceGetCount()):
                h = nvml.nvmlDeviceGetHandleByIndex(i)
                if key == "gpu.persistence_mode":
                    nvml.nvmlDeviceSetPersistenceMode(h, 1)
                elif key == "gpu.app_clocks":  # NVML_CLOCK_SM = 1, NVML_CLOCK_MEM = 2
                    nvml.nvmlDeviceSetApplicationsClocks(h, nvml.nvmlDeviceGetMaxClockInfo(h, 2),
                                                         nvml.nvmlDeviceGetMaxClockInfo(h, 1))
                elif key == "gpu.power_limit":
                    nvml.nvmlDeviceSetPowerManagementLimit(h, nvml.nvmlDeviceGetPowerManagementDefaultLimit(h))
        finally:
            nvml.nvmlShutdown()

    async def answer(self, msg: Any) -> None:
        """One NATS request: a `ReconfigureRequest` → a `ReconfigureReport` reply; a bad request gets a report with
        `error` (one line), never a traceback."""
        try:
            req = ReconfigureRequest.model_validate_json(msg.data)
        except (ValidationError, ValueError) as err:
            line = str(err).splitlines()[0][:300]
            self._log.warning("reconfigure_request_invalid", error=line)
            report = ReconfigureReport(node=self.node, dry_run=True, error=f"invalid reconfigure request: {line}")
        else:
            if req.node != self.node:
                report = ReconfigureReport(node=self.node, dry_run=True,
                                           error=f"request for node {req.node!r} reached {self.node!r}")
            else:
                report = await self.handle(req)
        if msg.reply:
            await msg.respond(report.model_dump_json().encode())
