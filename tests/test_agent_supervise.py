"""The agent's probe supervisor (agents.runner._supervise, tenacity): a failing probe is restarted after
1 s doubling to 5 min, counted afresh after a long run; with restart off it fails once; a probe that does not
apply to this host says so in the heartbeat's status. Delays scaled down to milliseconds."""

from __future__ import annotations

import asyncio

import pytest

from agents import runner


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def info(self, event: str, **kw) -> None:
        self.events.append((event, kw))

    error = warning = info


class Flaky:
    """Fails with each `plan` entry's run time (seconds) in turn; then runs until cancelled."""

    name = "flaky"

    def __init__(self, plan: list[float]) -> None:
        self.plan, self.runs = list(plan), 0

    async def run(self, emit) -> None:
        self.runs += 1
        if not self.plan:
            await asyncio.Event().wait()
        await asyncio.sleep(self.plan.pop(0))
        raise OSError(f"boom {self.runs}")


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(runner, "PROBE_RESTART_MIN_S", 0.01)
    monkeypatch.setattr(runner, "PROBE_RESTART_MAX_S", 0.08)


async def _supervised(probe, restart: bool = True, settle_s: float = 0.0) -> tuple[dict, Log]:
    status: dict[str, str] = {}
    log = Log()
    task = asyncio.create_task(runner._supervise(probe, None, status, restart, log))
    deadline = asyncio.get_running_loop().time() + 5
    while getattr(probe, "plan", None) and asyncio.get_running_loop().time() < deadline and not task.done():
        await asyncio.sleep(0.005)
    await asyncio.sleep(settle_s)
    if not task.done():
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    return status, log


async def test_restarts_double_to_the_cap(fast) -> None:
    p = Flaky([0, 0, 0, 0, 0])
    status, log = await _supervised(p, settle_s=0.1)
    delays = [kw["restart_in_s"] for e, kw in log.events if e == "probe_failed"]
    assert delays == [0.01, 0.02, 0.04, 0.08, 0.08]
    assert sum(e == "probe_restarted" for e, _ in log.events) == 5 and p.runs == 6
    assert status["flaky"] == "ok"  # running again


async def test_a_long_run_counts_the_backoff_afresh(fast) -> None:
    p = Flaky([0, 0, 0.12, 0])  # the third run outlives the 0.08 s cap before it fails
    _, log = await _supervised(p, settle_s=0.05)
    assert [kw["restart_in_s"] for e, kw in log.events if e == "probe_failed"] == [0.01, 0.02, 0.01, 0.02]


async def test_without_restart_one_failure_is_recorded() -> None:
    p = Flaky([0, 0])
    status, log = await _supervised(p, restart=False)
    assert p.runs == 1 and status["flaky"] == "failed: boom 1"
    assert [(e, kw["restart_in_s"]) for e, kw in log.events] == [("probe_failed", None)]


async def test_a_probe_that_does_not_apply_says_so() -> None:
    class NotHere:
        name = "nvml"
        not_applicable = None

        async def run(self, emit) -> None:
            self.not_applicable = "no NVIDIA GPU on the PCI bus"

    status, log = await _supervised(NotHere())
    assert status == {"nvml": "not applicable: no NVIDIA GPU on the PCI bus"}
    assert [e for e, _ in log.events] == ["probe_finished"]
