"""A run that absorbs a storm of faults continues-as-new by bytes, and nothing it absorbed is lost.

The worker holds what each cached run has absorbed until the run leaves the cache, so a run continues
as new once its history grew by `MAX_RUN_BYTES` (patch `run-bytes`), not only past `MAX_HISTORY_EVENTS`
events: a storm's faults arrive as a few large signals. Real Temporal dev server, stand-in activities.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

from temporalio.worker import Worker

from fleetmend.messages import FaultBatch, RoutedFault
from tests.activity_standins import Calls, stand_ins
from tests.test_workflow import fault, start
from workflows.remediation import MAX_RUN_BYTES, NodeRemediation

RAW = 1_500
"""Characters of kernel-log text per fault: 12 signals of 10 such faults carry ~2.7 × `MAX_RUN_BYTES`."""


def storm_batches(cluster: str, node: str, signals: int = 12, per_signal: int = 10) -> list[list[RoutedFault]]:
    """`signals` batches of `per_signal` distinct XID 13 events on one GPU (record-only), each with RAW
    characters of text, so the batches together carry more than twice `MAX_RUN_BYTES`."""
    out = []
    for _ in range(signals):
        batch = []
        for _ in range(per_signal):
            f = fault(cluster, node, 13, drain=False, severity="degraded")
            batch.append(dataclasses.replace(f, event=f.event.model_copy(update={"raw": f.event.raw.ljust(RAW, ".")})))
        out.append(batch)
    assert signals * per_signal * RAW > 2 * MAX_RUN_BYTES
    return out


async def send_storm(client, tq: str, cluster: str, node: str):
    """Open a record-only incident and send it the storm batches one signal at a time (the incident
    absorbs each before the next); returns the handle and the number of distinct events sent."""
    batches = storm_batches(cluster, node)
    h = await start(client, tq, cluster, node, batches[0], close_after_idle_s=3, app_xid_repeats=10**6)
    for b in batches[1:]:
        await asyncio.sleep(0.3)
        await h.signal(NodeRemediation.faults, FaultBatch(faults=b))
    return h, sum(len(b) for b in batches)


async def test_a_storm_run_continues_as_new_by_bytes_and_keeps_every_event(temporal_client, unique):
    client, calls, tq = temporal_client, Calls(), f"tq-{uuid.uuid4().hex[:8]}"
    async with Worker(client, task_queue=tq, workflows=[NodeRemediation], activities=stand_ins(calls)):
        h, sent = await send_storm(client, tq, unique, "sb1")
        st = await asyncio.wait_for(h.result(), 60)  # follows the continued runs to the last one
        runs = [w async for w in client.list_workflows(f"WorkflowId='{h.id}'")]
    assert st.phase == "closed" and st.outcome == "recorded" and calls.drains == []
    assert len(runs) >= 2, "the incident should have continued as new once its run absorbed MAX_RUN_BYTES"
    assert any("continuing as new" in e["text"] for e in st.timeline)
    assert sum(f["count"] for f in st.faults) == sent and st.faults_dropped == 0 and st.duplicates == 0, \
        "every event absorbed before and after continue-as-new is counted once"
