"""Replay recorded `NodeRemediation` histories against today's workflow code (STYLE rule 34).

`tests/histories/*.json` were recorded from real runs on the Temporal dev server *before* a
workflow change (`FLEETMEND_RECORD_HISTORIES=1 pytest tests/test_policy_replay.py -k record`
re-records them; do that only for a deliberate, versioned break). Every later change to the
workflow's command sequence must keep these replaying: guard it with `workflow.patched(<id>)`
(ids listed in the module docstring of `workflows/remediation.py`).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer, Worker

from tests.activity_standins import Calls, stand_ins
from tests.conftest import assert_eventually
from workflows.converter import data_converter
from workflows.remediation import HumanCommand, NodeRemediation

HISTORIES = Path(__file__).parent / "histories"
RECORD = os.environ.get("FLEETMEND_RECORD_HISTORIES") == "1"


def recorded() -> list[Path]:
    return sorted(HISTORIES.glob("*.json"))


@pytest.mark.parametrize("path", recorded(), ids=lambda p: p.stem)
async def test_recorded_history_replays(path: Path) -> None:
    history = WorkflowHistory.from_json(f"replay/{path.stem}", path.read_text())
    replayer = Replayer(workflows=[NodeRemediation], data_converter=data_converter)
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert result.replay_failure is None, f"{path.name} no longer replays: {result.replay_failure!r}"


def test_histories_are_present() -> None:
    names = {p.stem for p in recorded()}
    assert {"remediation_fatal_returned", "remediation_app_fault_recorded", "remediation_abort"} <= names


@pytest.mark.skipif(not RECORD, reason="set FLEETMEND_RECORD_HISTORIES=1 to re-record histories")
async def test_record_histories(temporal_client) -> None:  # noqa: ANN001
    from tests.test_workflow import fault, phase_is, start

    client, calls = temporal_client, Calls()
    tq = f"rec-{uuid.uuid4().hex[:8]}"
    cluster = "rec"
    async with Worker(client, task_queue=tq, workflows=[NodeRemediation], activities=stand_ins(calls)):
        sfx = uuid.uuid4().hex[:6]
        h1 = await start(client, tq, cluster, f"fatal-{sfx}", [fault(cluster, f"fatal-{sfx}", 79, drain=True)])
        await assert_eventually(lambda: phase_is(h1, "awaiting_repair"))
        await h1.execute_update(NodeRemediation.mark_repaired, HumanCommand(by="rec@ci", ticket="RMA-1"))
        await assert_eventually(lambda: phase_is(h1, "closed"))

        h2 = await start(client, tq, cluster, f"app-{sfx}", [fault(cluster, f"app-{sfx}", 13, drain=False,
                                                                   severity="degraded")], close_after_idle_s=2)
        await assert_eventually(lambda: phase_is(h2, "closed"))

        # Abort while in triage (an abort in awaiting_repair spun without yielding before patch
        # `abort-leaves-repair-loop`, so no such history can exist).
        h3 = await start(client, tq, cluster, f"abort-{sfx}", [fault(cluster, f"abort-{sfx}", 31, drain=False,
                                                                     severity="degraded")])
        await assert_eventually(lambda: phase_is(h3, "triage"))
        await h3.execute_update(NodeRemediation.abort, HumanCommand(by="rec@ci", note="test", undrain=True))
        await assert_eventually(lambda: phase_is(h3, "closed"))

        for name, h in (("remediation_fatal_returned", h1), ("remediation_app_fault_recorded", h2),
                        ("remediation_abort", h3)):
            await h.result()
            hist = await h.fetch_history()
            (HISTORIES / f"{name}.json").write_text(hist.to_json())
