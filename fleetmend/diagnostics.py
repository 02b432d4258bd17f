"""Diagnostics request/reply contract between the worker (activity) and a node's agent.

Subject: `subjects.diag_subject(cluster, node)`; request body `DiagRequest` JSON, reply `DiagReport` JSON.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from fleetmend.events import utcnow


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
