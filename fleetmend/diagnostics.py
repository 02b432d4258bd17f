"""Diagnostics and recovery request/reply contract between the worker (activity) and a node's agent.

Subject: `subjects.diag_subject(cluster, node)`; request body `DiagRequest` JSON, reply `DiagReport` JSON;
or a `RecoveryRequest` (`"type": "recovery"`), reply `RecoveryReport`.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from fleetmend.events import Recovery, utcnow


class DiagLevel(StrEnum):
    QUICK = "quick"
    """Seconds: NVML reachable, GPU count, no pending remapped rows, PCIe width, IB ports active."""
    LONG = "long"
    """Minutes: site tools (`dcgmi diag -r N`, NCCL/bandwidth test command from config)."""


class DiagResult(StrEnum):
    PASS = "pass"
    FAIL = "fail"
    NOT_APPLICABLE = "not_applicable"
    """The check does not apply on this host (e.g. GPU checks on a host without GPUs, like CI)."""
    UNKNOWN = "unknown"
    """The check could not run (tool missing, timed out)."""


class DiagRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    level: DiagLevel = DiagLevel.QUICK
    checks: list[str] = Field(default_factory=list)
    """Names of checks to run; empty = every check of the level."""
    incident_id: str | None = None
    deadline_s: float = 60.0


class CheckResult(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    result: DiagResult
    measured: str | None = None
    expected: str | None = None
    detail: str = ""


class DiagReport(BaseModel):
    model_config = ConfigDict(extra="ignore")

    node: str
    cluster: str
    level: DiagLevel
    checks: list[CheckResult] = Field(default_factory=list)
    started_at: datetime = Field(default_factory=utcnow)
    finished_at: datetime = Field(default_factory=utcnow)
    agent_version: str = "unknown"

    @property
    def result(self) -> DiagResult:
        """FAIL if any check failed; else UNKNOWN if any is unknown; PASS if any passed;
        NOT_APPLICABLE when every check was not applicable (no checks at all: UNKNOWN)."""
        rs = {c.result for c in self.checks}
        if DiagResult.FAIL in rs:
            return DiagResult.FAIL
        if DiagResult.UNKNOWN in rs or not rs:
            return DiagResult.UNKNOWN
        if DiagResult.PASS in rs:
            return DiagResult.PASS
        return DiagResult.NOT_APPLICABLE

    @property
    def passed(self) -> bool:
        """Good enough to return the node: no failure and nothing unknown."""
        return self.result in (DiagResult.PASS, DiagResult.NOT_APPLICABLE)


class RecoveryOp(StrEnum):
    """What the worker asks a node's agent to do. Stable wire strings; never reuse."""

    RESET_GPU = "reset_gpu"
    REBOOT = "reboot"


class RecoveryResult(StrEnum):
    APPLIED = "applied"
    """The agent ran the reset/reboot command and it exited 0."""
    REFUSED = "refused"
    """Not safe now (a process holds the GPU); nothing was done."""
    NOT_APPLICABLE = "not_applicable"
    """This host cannot do it (no nvidia-smi, no such GPU)."""
    DRY_RUN = "dry_run"
    """Reboot is disabled on this agent (the default): it says what it would have run."""
    FAILED = "failed"


class RecoveryRequest(BaseModel):
    """Body of a recovery request on `diag_subject(cluster, node)`; `op` tells it from a `DiagRequest`."""

    model_config = ConfigDict(extra="ignore")

    type: str = Field(default="recovery", pattern="^recovery$")
    op: RecoveryOp
    pci_bus_id: str | None = None
    """GPU to reset (`0000:3b:00.0`); required for RESET_GPU."""
    incident_id: str | None = None
    deadline_s: float = 120.0


class RecoveryReport(BaseModel):
    model_config = ConfigDict(extra="ignore")

    node: str
    cluster: str
    op: RecoveryOp
    result: RecoveryResult
    detail: str = ""
    command: list[str] = Field(default_factory=list)


def is_recovery_request(data: bytes) -> bool:
    """Cheap test the agent's diag subscriber uses to route a message to the recovery handler."""
    return b'"type"' in data and b'"recovery"' in data


def recovery_steps(recovery: Recovery | None) -> list[RecoveryOp]:
    """What a catalog `recovery` does, in order (each step followed by a settle period and verification):
    RESET_GPU → GPU reset, then a reboot; RESTART_BM → a reboot; RMA and DRAIN_DIAGNOSE → none."""
    return {Recovery.RESET_GPU: [RecoveryOp.RESET_GPU, RecoveryOp.REBOOT],
            Recovery.RESTART_BM: [RecoveryOp.REBOOT]}.get(recovery, []) if recovery else []


# ------------------------------------------------------------------ sweep benchmark (fleetmend sweep)


class BenchRequest(BaseModel):
    """Body of a sweep benchmark request on `diag_subject(cluster, node)`; `type` tells it from a
    `DiagRequest`. The agent answers a `BenchReport`."""

    model_config = ConfigDict(extra="ignore")

    type: str = Field(default="bench", pattern="^bench$")
    sweep_id: str | None = None
    deadline_s: float = Field(default=60.0, gt=0)
    """The agent answers within this, with what finished (the sweep does not wait for more)."""
    host_seconds: float = Field(default=1.0, gt=0, le=30)
    """Length of each built-in host measurement (memory copy, hashing)."""
    builtin: bool = True
    """False: only `agent.bench_command` (the site's own benchmark)."""


class BenchReport(BaseModel):
    """A node's benchmark numbers. `metrics`: name → value (higher is better unless
    `fleetmend.sweep.lower_is_better(name)`); `skipped`: check → why it did not run or failed."""

    model_config = ConfigDict(extra="ignore")

    node: str
    cluster: str
    sweep_id: str | None = None
    metrics: dict[str, float] = Field(default_factory=dict)
    skipped: dict[str, str] = Field(default_factory=dict)
    noise_pct: dict[str, float] = Field(default_factory=dict)
    """Metric → how far apart its repeated runs were, % of the best (the built-in host checks)."""
    started_at: datetime = Field(default_factory=utcnow)
    finished_at: datetime = Field(default_factory=utcnow)
    agent_version: str = "unknown"


def is_bench_request(data: bytes) -> bool:
    """Cheap test the agent's diag subscriber uses to route a message to the benchmark runner."""
    return b'"type"' in data and b'"bench"' in data
