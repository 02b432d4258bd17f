"""An analyzer replica whose perf consumer is lost (its nats-server killed in a cluster, the consumer deleted)
reads samples again once nats-py recreates the ordered consumer by start sequence (issue 27, point 2: the
clustered chaos run found a standby that never judged a window of samples again after a nats-server kill).

nats-py keeps the ordered consumer's request on the core subscription (`sub._sub._jsi`); the analyzer clears the
start *time* of its first request there, or the server refuses every recreation (err 10094, BadRequestError).
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone

from fleetmend import subjects
from fleetmend.analyzer.service import Analyzer, analyzer_kv
from fleetmend.config import load_settings
from fleetmend.infra.jetstream import ensure_perf_stream
from fleetmend.telemetry import GpuPerf, HardwareClass, PerfSample
from tests.conftest import assert_eventually


def _sample(cluster: str, node: str) -> PerfSample:
    return PerfSample(cluster=cluster, node=node, at=datetime.now(timezone.utc), interval_s=60,
                      hw=HardwareClass(gpu_model="NVIDIA H200", gpu_count=8, driver="570"),
                      gpus=[GpuPerf(index=i, util_pct=96, sm_clock_mhz=1970, sm_clock_max_mhz=1980, temperature_c=60)
                            for i in range(8)])


async def test_a_recreated_perf_consumer_delivers_again(nc, nats_server, unique: str) -> None:
    cluster = f"rs{unique}"
    js = nc.jetstream()
    await ensure_perf_stream(js)
    s = load_settings(None, cluster=cluster, nats_url=nats_server.url)
    errors: list[BaseException] = []
    orig = nc._error_cb

    async def seen(err: BaseException) -> None:
        errors.append(err)
        if orig is not None:
            await orig(err)

    nc._error_cb = seen
    a = Analyzer(s, nc, js, await analyzer_kv(js), holder="r")
    await a.start()
    try:
        def nodes() -> set[str]:
            return {n for w in a.comparator.open.values() for n in w}

        await nc.publish(subjects.perf_subject(cluster, "n0"), _sample(cluster, "n0").to_json_bytes())
        await assert_eventually(lambda: "n0" in nodes(), 10, what="the first sample read")
        # what nats-py does when the consumer's heartbeats stop (its server gone): a new consumer from the next
        # stream sequence, on the request it kept from the first subscribe
        jsi = a._sub._sub._jsi
        await jsi.reset_ordered_consumer(jsi._sseq + 1)
        await asyncio.sleep(0.5)  # the recreation runs in a task of nats-py's
        await nc.publish(subjects.perf_subject(cluster, "n1"), _sample(cluster, "n1").to_json_bytes())
        await assert_eventually(lambda: "n1" in nodes(), 10,
                                what=f"a sample read after the consumer was recreated (client errors {errors!r})")
        assert not [e for e in errors if "BadRequest" in type(e).__name__], errors
    finally:
        for sub in (a._sub, a._job_sub, a._sched_sub):
            await sub.unsubscribe()
        nc._error_cb = orig
