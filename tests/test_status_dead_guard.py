"""`fleetmend status` must not hang on a cluster whose FleetGuard no worker polls (its worker is down, or the
cluster is served by nobody yet): the guard's query is bounded and its error names the cluster."""

from __future__ import annotations

import asyncio
import time

import pytest

from fleetmend import subjects
from fleetmend.cli.breaker import GUARD_QUERY_TIMEOUT_S, permit_waits
from fleetmend.errors import FleetmendError
from fleetmend.messages import GuardApi, GuardInput, GuardPolicy


async def test_a_guard_no_worker_polls_is_reported_within_its_timeout(temporal_client, unique) -> None:
    cluster = f"dead{unique}"
    await temporal_client.start_workflow(GuardApi.WORKFLOW, GuardInput(cluster=cluster, policy=GuardPolicy()),
                                         id=subjects.fleetguard_workflow_id(cluster), task_queue=f"nobody-{unique}")
    t0 = time.monotonic()
    with pytest.raises(FleetmendError, match=rf"FleetGuard of cluster {cluster} did not answer .*worker of cluster"):
        await asyncio.wait_for(permit_waits(temporal_client, cluster), timeout=GUARD_QUERY_TIMEOUT_S + 20)
    assert time.monotonic() - t0 < GUARD_QUERY_TIMEOUT_S + 15  # without the bound: no answer within 23 s
    await temporal_client.get_workflow_handle(subjects.fleetguard_workflow_id(cluster)).terminate("test done")
