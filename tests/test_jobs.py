"""Job step timings: the dependency-free client never blocks or raises (NATS away: bounded queue,
drops counted), delivers batches to a real nats-server, and the analyzer flags a persistently slow
rank on its node (saying whether hardware telemetry agrees)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from datetime import datetime, timezone

from fleetmend import subjects
from fleetmend.dev import servers
from fleetmend.jobs import JobReporter, node_token, token


def test_module_is_stdlib_only() -> None:
    code = ("import sys; import fleetmend.jobs; bad = [m for m in sys.modules if m.split('.')[0] in "
            "('nats', 'pydantic', 'structlog', 'temporalio', 'orjson')]; print(bad); sys.exit(1 if bad else 0)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def test_nats_away_never_blocks_or_raises() -> None:
    r = JobReporter(f"nats://127.0.0.1:{servers.free_port()}", "c", batch_s=0.05, max_queue=100)
    t0 = time.monotonic()
    for i in range(1000):
        r.report("job1", i % 8, "gpu01", i, 0.5)
    r.report("job1", "not-a-rank", "gpu01", 1, 0.5)  # bad value: dropped, counted
    assert time.monotonic() - t0 < 5
    assert r.flush(0.5) is False  # nothing can be sent
    assert r.dropped >= 600 and r.errors >= 1 and r.sent == 0  # bounded: at most queue + one batch held
    r.close(0.1)
    assert token("a.b c") == "a-b-c"
    for name in ("gpu01", "ip-10-0-1-3.ec2.internal", "a=b.c", "nœud"):  # the one node-name encoding
        assert node_token(name) == subjects.node_token(name)


async def test_batches_arrive_and_a_slow_rank_becomes_fail_slow(nats_server, nc, unique) -> None:
    from fleetmend.analyzer.service import Analyzer, analyzer_kv
    from fleetmend.config import load_settings
    from fleetmend.events import FaultEvent
    from fleetmend.infra.jetstream import ensure_fault_stream, ensure_perf_stream
    from tests.conftest import assert_eventually

    cluster = f"jb{unique}"
    js = nc.jetstream()
    await ensure_perf_stream(js)
    await ensure_fault_stream(js)
    raw = await nc.subscribe(subjects.cluster_job_subject(cluster))
    await nc.flush()
    r = JobReporter(nats_server.url, cluster, batch_s=0.05)
    r.report("77", 0, "n0", 1, 1.0)
    assert await asyncio.to_thread(r.flush, 10) is True
    msg = await raw.next_msg(timeout=5)
    body = json.loads(msg.data)
    assert msg.subject == f"fleet.{cluster}.job.n0.77" and body["v"] == 1 and body["steps"][0][:4] == [0, "n0", 1, 1.0]
    await raw.unsubscribe()

    s = load_settings(None, cluster=cluster, nats_url=nats_server.url,
                      analyzer={"window_s": 60, "grace_s": 5, "windows": 3})

    class Clock:
        t = 0.0

        def __call__(self) -> float:
            return self.t

    clock = Clock()
    now = datetime.now(timezone.utc).timestamp()
    start = (now // 60) * 60 - 300
    clock.t = start
    a = Analyzer(s, nc, js, await analyzer_kv(js), holder="j", clock=clock, lease_clock=clock)
    await a.start()
    assert await a.lease()
    faults = await nc.subscribe(subjects.fault_subject(cluster, "n4"))
    # a node reports steps only once the analyzer knows it (its agent's perf samples)
    from fleetmend.telemetry import GpuPerf, HardwareClass, PerfSample

    for n in range(8):
        smp = PerfSample(cluster=cluster, node=f"n{n}", at=datetime.fromtimestamp(start + 1, timezone.utc),
                         interval_s=60, hw=HardwareClass(gpu_model="NVIDIA H200", gpu_count=8, driver="570"),
                         gpus=[GpuPerf(index=0, util_pct=95)])
        await nc.publish(subjects.perf_subject(cluster, f"n{n}"), smp.to_json_bytes())
    await nc.flush()
    await assert_eventually(lambda: a.samples >= 8, timeout_s=10, what="analyzer read the perf samples")
    clock.t = start + 200  # the steps below are at most one clock skew ahead of the analyzer's clock
    # job 99: 8 ranks on 8 nodes, one step every 10 s each. Rank 0 is 10 % slower by design for the
    # job's whole life (never slow: its own offset, learnt over the first 3 windows); rank 4 (on n4)
    # becomes 10 % slower after those 3 windows
    rep = JobReporter(nats_server.url, cluster, batch_s=0.05)
    for step in range(36):  # six windows of 60 s
        for rank in range(8):
            slow = rank == 0 or (rank == 4 and step >= 18)
            sec = 2.0 * (1.10 if slow else 1.0) + 0.01 * ((step + rank) % 3)
            rep.report("99", rank, f"n{rank}", step, sec, at=start + step * 10 + 1)
    assert await asyncio.to_thread(rep.flush, 10) is True
    await assert_eventually(lambda: a.job_steps >= 36 * 8, timeout_s=10, what="analyzer read the job steps")
    clock.t = start + 360 + 10
    await a.tick()
    ev = FaultEvent.from_json_bytes((await faults.next_msg(timeout=5)).data)
    assert ev.kind == "fail_slow" and ev.node == "n4"
    assert ev.attrs["job"] == "99" and ev.attrs["rank"] == 4 and ev.attrs["metric"] == "job_step_seconds"
    assert ev.attrs["group_size"] == 8 and ev.attrs["ratio"] > 1.05 and ev.attrs["hardware_agrees"] == ""
    assert "rank 4 of job 99" in ev.message and "hardware telemetry shows nothing" in ev.message
    assert len(a.published) == 1, "only the slow rank"
    await a.release()
    await faults.unsubscribe()
    r.close(0.1)
    rep.close(0.1)
