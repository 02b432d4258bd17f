"""The agent's diagnostics responder: answers `DiagRequest`s on `diag_subject(cluster, node)`.

QUICK checks (seconds), each a `CheckResult`:

    nvml_reachable         nvmlInit succeeds (measured: driver version)
    gpu_count              nvmlDeviceGetCount() vs `expected_gpus`, or when it is not set, vs the most
                           this node has shown (kept in the agent's state) and the NVIDIA GPUs on its PCI
                           bus (FAIL when fewer are visible: a GPU lost after an XID 79 is not "repaired")
    remapped_rows_pending  nvmlDeviceGetRemappedRows: a pending remap (or a remap failure) needs a
                           GPU reset before the memory is trustworthy (NVIDIA row-remapping docs)
    pcie_link_width        current vs maximum link width per GPU (a degraded x8/x4 link)
    ib_ports_active        every <sysfs_root>/sys/class/infiniband/*/ports/*/state is ACTIVE
    kmsg_readable          the kernel log the kmsg probe follows can be opened

On a host without the NVIDIA driver (CI, a CPU node) `nvmlInit` raises NVMLError_LibraryNotFound or
NVMLError_DriverNotLoaded and every GPU check is NOT_APPLICABLE ("no NVIDIA driver on this host"),
so the pipeline runs end to end there; no IB devices → ib_ports_active NOT_APPLICABLE.

LONG adds the configured site commands (default `dcgmi diag -r 2`): exit 0 → PASS, non-zero →
FAIL with the output's tail, not installed → NOT_APPLICABLE, past the deadline → UNKNOWN.

Checks run off the event loop (`asyncio.to_thread`) within the request's `deadline_s`; what did
not finish is reported UNKNOWN ("deadline"). A request that is not a valid `DiagRequest` gets a
report with one UNKNOWN check named `request` (the reason), and the responder keeps serving.
NVML enters through the constructor (`nvml=pynvml`), so tests pass an autospecced stand-in.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
from pydantic import ValidationError

from agents.bench import GpuTools, answer_bench
from agents.commands import run_command, tail
from agents.recovery import RecoveryHandler
from fleetmend import __version__
from fleetmend.diagnostics import (
    CheckResult,
    DiagLevel,
    DiagReport,
    DiagRequest,
    DiagResult,
    is_bench_request,
    is_recovery_request,
)
from fleetmend.events import utcnow
from fleetmend.subjects import diag_subject

GPU_COUNT_FILE = "gpus_seen"
"""In the agent's state directory: the most GPUs NVML has shown on this node (`gpu_count`'s default
expectation)."""
QUICK_CHECKS = ("nvml_reachable", "gpu_count", "remapped_rows_pending", "pcie_link_width",
                "ib_ports_active", "kmsg_readable")
GPU_CHECKS = frozenset({"nvml_reachable", "gpu_count", "remapped_rows_pending", "pcie_link_width"})
DEFAULT_LONG_COMMANDS: dict[str, list[str]] = {"dcgm_diag": ["dcgmi", "diag", "-r", "2"]}
"""`dcgmi diag -r 2`: DCGM's medium run (~2 min), the level NVIDIA recommends before return to service."""
NO_DRIVER = "no NVIDIA driver on this host"


def _real_pynvml() -> Any:
    try:
        import pynvml  # lazy: NVML's library only where the responder runs; None on hosts without it
    except ImportError:
        return None
    return pynvml


def _error_types(nvml: Any) -> tuple[type[BaseException], type[BaseException], type[BaseException]]:
    """(NVMLError, no-driver errors, NotSupported) of `nvml`, or of the real pynvml when `nvml` is an
    autospecced stand-in (whose attributes are mocks, not exception classes)."""
    src = nvml
    if not (isinstance(getattr(nvml, "NVMLError", None), type)
            and issubclass(nvml.NVMLError, BaseException)):
        src = _real_pynvml()
    if src is None:
        return (OSError, OSError, OSError)
    no_driver = tuple(getattr(src, n) for n in ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded"))
    return src.NVMLError, no_driver, src.NVMLError_NotSupported  # type: ignore[return-value]


def _is_dcgmi_diag(argv: list[str]) -> bool:
    return bool(argv) and os.path.basename(argv[0]) == "dcgmi" and "diag" in argv[1:]


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


class DiagResponder:
    """Request/reply diagnostics for one node.

    Args:
        nc: connected nats client.
        cluster, node: subject tokens (`diag_subject(cluster, node)`).
        nvml: the `pynvml` module (default: imported if installed, else every GPU check is
            NOT_APPLICABLE), or a stand-in with the same functions.
        expected_gpus: `gpu_count` fails below this; None: below the most GPUs this node has shown
            (`state_dir`/`GPU_COUNT_FILE`, kept across restarts and reboots) or on its PCI bus.
        state_dir: the agent's state directory (None: no memory, the PCI bus only).
        sysfs_root: root under which `sys/class/infiniband` is read (tests pass a tmp tree).
        kmsg_path: the kernel log the kmsg probe reads.
        long_commands: name → argv of the LONG level's site commands.
        agent_version: stamped on reports.
    """

    def __init__(self, nc: Any, cluster: str, node: str, *, nvml: Any = "default",
                 expected_gpus: int | None = None, sysfs_root: Path = Path("/"),
                 kmsg_path: Path = Path("/dev/kmsg"), long_commands: dict[str, list[str]] | None = None,
                 agent_version: str = __version__, state_dir: Path | None = None) -> None:
        self.nc = nc
        self.cluster, self.node = cluster, node
        self.subject = diag_subject(cluster, node)
        self._nvml = nvml
        self.expected_gpus = expected_gpus
        self.state_dir = None if state_dir is None else Path(state_dir)
        self.sysfs_root = Path(sysfs_root)
        self.kmsg_path = Path(kmsg_path)
        self.long_commands = DEFAULT_LONG_COMMANDS if long_commands is None else long_commands
        self.agent_version = agent_version
        self._sub: Any = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._hw_lock = asyncio.Lock()  # one diagnostics run at a time on the hardware
        self.recovery: RecoveryHandler | None = None  # set by the runner (else a dry-run default)
        self.bench_command: list[str] | None = None  # `agent.bench_command`, for `fleetmend sweep` (agents/bench.py)
        self.gpu_tools: GpuTools | None = None  # the sweep's GPU load, nvbandwidth and dcgm steps
        self._log = structlog.get_logger("fleetmend.agent.diag").bind(cluster=cluster, node=node)

    # ------------------------------------------------------------------ serving

    @property
    def nvml(self) -> Any:
        """The `pynvml` module (imported at the first check that needs it: an idle agent does not load it)
        or the stand-in given; None without one."""
        if isinstance(self._nvml, str) and self._nvml == "default":
            self._nvml = _real_pynvml()
        return self._nvml

    @nvml.setter
    def nvml(self, value: Any) -> None:
        self._nvml = value

    async def start(self) -> None:
        """Subscribe on the node's diag subject (requests are answered in their own tasks)."""
        self._sub = await self.nc.subscribe(self.subject, cb=self._on_msg)
        self._log.info("diag_responder_started", subject=self.subject)

    async def stop(self) -> None:
        """Unsubscribe and cancel requests in progress."""
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception as err:  # noqa: BLE001 - closing connection; nothing left to clean
                self._log.debug("diag_unsubscribe_failed", error=repr(err))
            self._sub = None
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _on_msg(self, msg: Any) -> None:
        # --- recovery requests (GPU reset / reboot) share this subject: agents/recovery.py ---
        if is_recovery_request(msg.data):
            if self.recovery is None:
                self.recovery = RecoveryHandler(self.cluster, self.node)  # dry-run reboot by default
            task = asyncio.create_task(self.recovery.answer(msg))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        # --- end recovery ---
        # --- sweep benchmark requests (fleetmend sweep) share it too: agents/bench.py ---
        if is_bench_request(msg.data):
            task = asyncio.create_task(answer_bench(self, msg))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        task = asyncio.create_task(self._answer(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, msg: Any) -> None:
        started = utcnow()
        try:
            req = DiagRequest.model_validate_json(msg.data)
        except (ValidationError, ValueError) as err:
            self._log.warning("diag_request_invalid", error=str(err)[:500])
            report = DiagReport(node=self.node, cluster=self.cluster, level=DiagLevel.QUICK,
                                started_at=started, agent_version=self.agent_version, checks=[
                                    CheckResult(name="request", result=DiagResult.UNKNOWN,
                                                detail=f"bad diagnostics request (not a DiagRequest): "
                                                       f"{str(err)[:500]}")])
        else:
            self._log.info("diag_requested", level=req.level.value, incident_id=req.incident_id,
                           checks=req.checks or "all", deadline_s=req.deadline_s)
            async with self._hw_lock:
                report = await self.run(req)
            self._log.info("diag_answered", level=req.level.value, incident_id=req.incident_id,
                           result=report.result.value,
                           failed=[c.name for c in report.checks if c.result is DiagResult.FAIL])
        if msg.reply:
            await msg.respond(report.model_dump_json().encode())
        else:
            self._log.warning("diag_request_without_reply_subject")

    # ------------------------------------------------------------------ checks

    async def run(self, req: DiagRequest) -> DiagReport:
        """Run the checks `req` asks for within `req.deadline_s`. Returns the `DiagReport`."""
        started = utcnow()
        deadline = time.monotonic() + req.deadline_s
        wanted = list(req.checks) or list(QUICK_CHECKS) + (
            list(self.long_commands) if req.level is DiagLevel.LONG else [])
        known = set(QUICK_CHECKS) | set(self.long_commands)
        checks: list[CheckResult] = []
        ctx = _NvmlSession(self.nvml)
        try:
            for name in wanted:
                left = deadline - time.monotonic()
                if name not in known:
                    checks.append(CheckResult(name=name, result=DiagResult.UNKNOWN,
                                              detail=f"unknown check; expected {', '.join(sorted(known))}"))
                elif left <= 0:
                    checks.append(CheckResult(name=name, result=DiagResult.UNKNOWN,
                                              detail=f"not run: deadline of {req.deadline_s:g} s passed"))
                elif name in self.long_commands:
                    checks.append(await self._run_command(name, self.long_commands[name], left))
                else:
                    fn: Callable[[_NvmlSession], CheckResult] = getattr(self, f"_check_{name}")
                    try:
                        async with asyncio.timeout(left):
                            checks.append(await asyncio.to_thread(fn, ctx))
                    except TimeoutError:
                        checks.append(CheckResult(name=name, result=DiagResult.UNKNOWN,
                                                  detail=f"timed out (deadline {req.deadline_s:g} s)"))
                    except Exception as err:  # noqa: BLE001 - one broken check must not lose the report
                        checks.append(CheckResult(name=name, result=DiagResult.UNKNOWN,
                                                  detail=f"check raised {err!r}"))
        finally:
            await asyncio.to_thread(ctx.close)
        return DiagReport(node=self.node, cluster=self.cluster, level=req.level, checks=checks,
                          started_at=started, finished_at=utcnow(), agent_version=self.agent_version)

    def _gpu_gate(self, name: str, ctx: _NvmlSession) -> CheckResult | None:
        """NOT_APPLICABLE / UNKNOWN result when NVML is not usable, else None."""
        ctx.ensure_init()
        if ctx.no_driver and not self.nvidia_gpus_on_bus():
            return CheckResult(name=name, result=DiagResult.NOT_APPLICABLE, detail=NO_DRIVER)
        if ctx.no_driver or ctx.init_error is not None:
            return CheckResult(name=name, result=DiagResult.UNKNOWN, detail=f"NVML unusable: {ctx.init_error}")
        return None

    def nvidia_gpus_on_bus(self) -> list[str]:
        """PCI addresses of NVIDIA display/3D controllers (vendor 0x10de, class 0x03xxxx) under
        `<sysfs_root>/sys/bus/pci/devices`. A GPU node whose driver failed to load still has them, so
        "no driver" there is a failure, not "not applicable" (which only a GPU-less host may claim)."""
        found = []
        for dev in sorted((self.sysfs_root / "sys" / "bus" / "pci" / "devices").glob("*")):
            try:
                vendor = (dev / "vendor").read_text().strip().lower()
                klass = (dev / "class").read_text().strip().lower()
            except OSError:
                continue
            if vendor == "0x10de" and klass.startswith("0x03"):
                found.append(dev.name)
        return found

    def _check_nvml_reachable(self, ctx: _NvmlSession) -> CheckResult:
        ctx.ensure_init()
        if ctx.no_driver:
            gpus = self.nvidia_gpus_on_bus()
            if not gpus:
                return CheckResult(name="nvml_reachable", result=DiagResult.NOT_APPLICABLE, detail=NO_DRIVER)
            return CheckResult(name="nvml_reachable", result=DiagResult.FAIL, measured=f"{len(gpus)} GPU(s) on the bus",
                               expected="NVIDIA driver loaded",
                               detail=f"NVIDIA GPUs on the PCI bus ({', '.join(gpus[:4])}) but NVML is unusable: "
                                      f"{ctx.init_error}; driver not loaded or GPU lost")
        if ctx.init_error is not None:
            return CheckResult(name="nvml_reachable", result=DiagResult.FAIL, expected="nvmlInit succeeds",
                               detail=f"nvmlInit failed: {ctx.init_error}")
        try:
            driver = _text(self.nvml.nvmlSystemGetDriverVersion())
        except ctx.NVMLError as err:
            driver = f"unknown ({err})"
        return CheckResult(name="nvml_reachable", result=DiagResult.PASS, measured=f"driver {driver}")

    def _check_gpu_count(self, ctx: _NvmlSession) -> CheckResult:
        if (gate := self._gpu_gate("gpu_count", ctx)) is not None:
            return gate
        n = ctx.count()
        expected, why = self.expected_gpus, "agent.expected_gpus"
        if expected is None:  # the most this node has shown, or what its PCI bus holds
            seen, on_bus = self._gpus_seen(n), len(self.nvidia_gpus_on_bus())
            expected, why = (seen, "the most this node has shown") if seen >= on_bus else (on_bus, "on its PCI bus")
            expected = expected or None
        if expected is not None and n < expected:
            return CheckResult(name="gpu_count", result=DiagResult.FAIL, measured=str(n), expected=str(expected),
                               detail=f"{expected - n} GPU(s) missing against {expected} ({why}): fallen off the "
                                      "bus or not enumerated (set agent.expected_gpus if GPUs were removed on "
                                      "purpose)")
        return CheckResult(name="gpu_count", result=DiagResult.PASS, measured=str(n),
                           expected=None if expected is None else str(expected))

    def _gpus_seen(self, n: int) -> int:
        """The most GPUs NVML has shown on this node (`state_dir`/`GPU_COUNT_FILE`), `n` included (written
        when higher). 0 without a state directory. A file that cannot be read or written counts as none."""
        if self.state_dir is None:
            return 0
        path = self.state_dir / GPU_COUNT_FILE
        try:
            seen = int(path.read_text().strip() or 0)
        except (OSError, ValueError):
            seen = 0
        if n > seen:
            try:
                self.state_dir.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                tmp.write_text(f"{n}\n")
                tmp.replace(path)
            except OSError:
                pass
            seen = n
        return seen

    def _check_remapped_rows_pending(self, ctx: _NvmlSession) -> CheckResult:
        if (gate := self._gpu_gate("remapped_rows_pending", ctx)) is not None:
            return gate
        bad, unsupported, n = [], 0, ctx.count()
        for i in range(n):
            h = self.nvml.nvmlDeviceGetHandleByIndex(i)
            try:
                corr, unc, pending, failure = self.nvml.nvmlDeviceGetRemappedRows(h)
            except ctx.NotSupported:
                unsupported += 1  # pre-Ampere GPUs have no row remapper
                continue
            if pending or failure:
                what = ", ".join(w for w, on in (("remap pending", pending), ("remap failure", failure)) if on)
                bad.append(f"GPU {i} ({ctx.bus_id(h)}): {what} (correctable rows {corr}, uncorrectable {unc})")
        if n and unsupported == n:
            return CheckResult(name="remapped_rows_pending", result=DiagResult.NOT_APPLICABLE,
                               detail="row remapping not supported by these GPUs")
        if bad:
            return CheckResult(name="remapped_rows_pending", result=DiagResult.FAIL,
                               measured=f"{len(bad)} of {n} GPUs", expected="none pending",
                               detail="; ".join(bad) + "; a GPU reset applies pending remaps")
        return CheckResult(name="remapped_rows_pending", result=DiagResult.PASS, measured=f"0 of {n} GPUs")

    def _check_pcie_link_width(self, ctx: _NvmlSession) -> CheckResult:
        if (gate := self._gpu_gate("pcie_link_width", ctx)) is not None:
            return gate
        bad, widths, n = [], set(), ctx.count()
        for i in range(n):
            h = self.nvml.nvmlDeviceGetHandleByIndex(i)
            cur = int(self.nvml.nvmlDeviceGetCurrPcieLinkWidth(h))
            top = int(self.nvml.nvmlDeviceGetMaxPcieLinkWidth(h))
            widths.add(f"x{cur}")
            if cur < top:
                bad.append(f"GPU {i} ({ctx.bus_id(h)}): x{cur} of x{top}")
        if bad:
            return CheckResult(name="pcie_link_width", result=DiagResult.FAIL, measured="; ".join(bad),
                               expected="current = max width", detail="degraded PCIe link: reseat or RMA")
        return CheckResult(name="pcie_link_width", result=DiagResult.PASS,
                           measured=",".join(sorted(widths)) or "no GPUs")

    def _check_ib_ports_active(self, ctx: _NvmlSession) -> CheckResult:
        base = self.sysfs_root / "sys" / "class" / "infiniband"
        states = sorted(base.glob("*/ports/*/state"))
        if not states:
            return CheckResult(name="ib_ports_active", result=DiagResult.NOT_APPLICABLE,
                               detail=f"no InfiniBand devices under {base}")
        bad = []
        for p in states:
            state = p.read_text().strip()  # e.g. "4: ACTIVE"
            if not state.endswith("ACTIVE"):
                bad.append(f"{p.parts[-4]}/{p.parts[-2]}: {state}")
        if bad:
            return CheckResult(name="ib_ports_active", result=DiagResult.FAIL, measured="; ".join(bad),
                               expected="4: ACTIVE", detail=f"{len(bad)} of {len(states)} ports not active")
        return CheckResult(name="ib_ports_active", result=DiagResult.PASS, measured=f"{len(states)} ports ACTIVE")

    def _check_kmsg_readable(self, ctx: _NvmlSession) -> CheckResult:
        path = self.kmsg_path
        if not path.exists():
            return CheckResult(name="kmsg_readable", result=DiagResult.NOT_APPLICABLE,
                               detail=f"{path} does not exist on this host")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as err:
            return CheckResult(name="kmsg_readable", result=DiagResult.FAIL, expected="readable",
                               detail=f"cannot open {path}: {err.strerror}; the kmsg probe is blind "
                                      "(run the agent as root or with CAP_SYSLOG)")
        os.close(fd)
        return CheckResult(name="kmsg_readable", result=DiagResult.PASS, measured=str(path))

    async def _run_command(self, name: str, argv: list[str], timeout_s: float) -> CheckResult:
        if shutil.which(argv[0]) is None:
            return CheckResult(name=name, result=DiagResult.NOT_APPLICABLE,
                               detail=f"{argv[0]} not installed on this host")
        ran = await run_command(argv, timeout_s)
        if ran is None:
            return CheckResult(name=name, result=DiagResult.UNKNOWN, measured=" ".join(argv),
                               detail=f"timed out after {timeout_s:.0f} s")
        rc, out = ran
        last = tail(out)
        if _is_dcgmi_diag(argv):
            return self._dcgm_result(name, argv, rc, out.decode(errors="replace"), last)
        return CheckResult(name=name, result=DiagResult.PASS if rc == 0 else DiagResult.FAIL,
                           measured=f"{' '.join(argv)}: exit {rc}", expected="exit 0", detail=last)

    def _dcgm_result(self, name: str, argv: list[str], rc: int | None, text: str, tail: str) -> CheckResult:
        """`dcgmi diag` output read with the same parser as `fleetmend explain` (agents.parsers.dcgm):
        a failed test (or an Error row) fails the check even if dcgmi exited 0; the measured value names
        each failed test and GPU; warnings are listed in the detail."""
        # lazy: `agents.parsers` loads every tool parser (~1 MiB of RSS), for nodes that run `dcgmi diag`
        from agents.parsers.common import Ctx
        from agents.parsers.dcgm import parse_diag

        events = parse_diag(text, Ctx(cluster=self.cluster, node=self.node))
        failed = [e for e in events if e.kind == "dcgm_diag_fail"]
        warned = [e for e in events if e.kind == "dcgm_diag_warning"]
        ok = rc == 0 and not failed
        measured = "; ".join(e.message for e in failed) or f"{' '.join(argv)}: exit {rc}, all tests passed"
        detail = "\n".join([f"warning: {e.message}" for e in warned] + ([tail] if not ok else []))
        return CheckResult(name=name, result=DiagResult.PASS if ok else DiagResult.FAIL, measured=measured[:2000],
                           expected="every test Pass, exit 0", detail=detail)


class _NvmlSession:
    """nvmlInit once per diagnostics run (lazily, on a worker thread), nvmlShutdown at the end."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self.NVMLError, self._no_driver_types, self.NotSupported = _error_types(nvml)
        self.initialised = False
        self.tried = False
        self.no_driver = nvml is None
        self.init_error: str | None = None
        self._count: int | None = None

    def ensure_init(self) -> None:
        if self.tried or self.nvml is None:
            return
        self.tried = True
        try:
            self.nvml.nvmlInit()
            self.initialised = True
        except self._no_driver_types as err:
            self.no_driver = True
            self.init_error = f"{type(err).__name__}: {err}"
        except self.NVMLError as err:
            self.init_error = str(err)

    def count(self) -> int:
        if self._count is None:
            self._count = int(self.nvml.nvmlDeviceGetCount())
        return self._count

    def bus_id(self, handle: Any) -> str:
        try:
            return _text(self.nvml.nvmlDeviceGetPciInfo(handle).busId).lower()
        except self.NVMLError:
            return "bus id unknown"

    def close(self) -> None:
        if self.initialised:
            try:
                self.nvml.nvmlShutdown()
            except self.NVMLError:
                pass  # shutting down a library that is already unusable
            self.initialised = False
