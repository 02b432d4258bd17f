"""Fleet-level gauges come from one elected replica per cluster: the election loop against real
NATS, then two real worker processes whose /metrics are scraped."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nats
import structlog

from fleetmend.dev import servers
from fleetmend.infra.fleetgauges import run_elected
from tests.conftest import assert_eventually

REPO = Path(__file__).resolve().parents[1]
log = structlog.get_logger("test")


class Replica:
    def __init__(self) -> None:
        self.refreshes = 0
        self.forgotten = 0
        self.stop = asyncio.Event()

    async def refresh(self) -> None:
        self.refreshes += 1

    def forget(self) -> None:
        self.forgotten += 1


async def test_one_replica_publishes_and_another_takes_over(nats_server, unique) -> None:
    conns = [await nats.connect(nats_server.url) for _ in range(3)]
    reps = [Replica() for _ in conns]
    tasks = [asyncio.create_task(run_elected(c.jetstream(), "incident-poller", f"c{unique}", r.refresh, r.forget,
                                             0.05, r.stop, log, ttl_s=0.9, holder=f"r{i}"))
             for i, (c, r) in enumerate(zip(conns, reps, strict=True))]
    try:
        await asyncio.sleep(2.0)
        publishing = [r for r in reps if r.refreshes]
        assert len(publishing) == 1, [r.refreshes for r in reps]
        leader = publishing[0]
        # a clean stop releases the lease: another replica publishes at its next tick (ttl/3)
        leader.stop.set()
        await tasks[reps.index(leader)]
        assert leader.forgotten == 1
        before = {id(r): r.refreshes for r in reps}
        await asyncio.sleep(1.0)
        second = [r for r in reps if r is not leader and r.refreshes > before[id(r)]]
        assert len(second) == 1
        # a crash (connection gone, no release): the last replica takes over after ttl_s
        crashed = reps.index(second[0])
        await conns[crashed].close()
        tasks[crashed].cancel()
        last = [r for r in reps if r is not leader and r is not second[0]][0]
        n = last.refreshes
        t0 = time.monotonic()
        await assert_eventually(lambda: last.refreshes > n, timeout_s=5, what="takeover after a crash")
        assert time.monotonic() - t0 < 3.0
    finally:
        for r in reps:
            r.stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in conns:
            if not c.is_closed:
                await c.close()


def _scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            return r.read().decode()
    except OSError:
        return ""


def _series(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(name + "{")]


async def test_two_worker_replicas_publish_the_cluster_gauges_once(nats_server, temporal_server, unique,
                                                                   tmp_path: Path) -> None:
    cluster = f"g{unique}"
    ports = [servers.free_port(), servers.free_port()]
    procs = []
    for i, port in enumerate(ports):
        env = {**os.environ, "FLEETMEND_NATS_URL": nats_server.url, "FLEETMEND_TEMPORAL_ADDRESS":
               temporal_server.address, "FLEETMEND_CLUSTER": cluster, "FLEETMEND_TASK_QUEUE": f"tq-{unique}",
               "FLEETMEND_STATE_DIR": str(tmp_path / f"w{i}"), "FLEETMEND_SCHEDULER": "none",
               "FLEETMEND_METRICS__WORKER_PORT": str(port), "FLEETMEND_METRICS__POLL_INTERVAL_S": "1",
               "FLEETMEND_LOG_FORMAT": "json"}
        procs.append(subprocess.Popen([sys.executable, "-m", "fleetmend.cli.main", "worker"], env=env, cwd=REPO,
                                      stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"w{i}.log", "w")))
    try:
        def published() -> list[str] | None:
            texts = [_scrape(p) for p in ports]
            drains = [_series(t, "fleetmend_drains_in_force") for t in texts]
            pub = [[x for x in _series(t, "fleetmend_fleet_gauges_publisher") if cluster in x] for t in texts]
            if all(pub) and sum(bool(d) for d in drains) == 1:
                return texts
            return None

        texts = await assert_eventually(lambda: asyncio.to_thread(published), timeout_s=60,
                                        what="both workers up, one publishing")
        values = [float(_series(t, "fleetmend_fleet_gauges_publisher")[0].rsplit(" ", 1)[1]) for t in texts]
        assert sorted(values) == [0.0, 1.0]  # summed over replicas: 1 per cluster
        leader = values.index(1.0)
        # The publisher stops: the other replica publishes, the stopped one's series are gone with it.
        procs[leader].terminate()
        procs[leader].wait(timeout=60)
        other = ports[1 - leader]
        await assert_eventually(lambda: asyncio.to_thread(lambda: bool(_series(_scrape(other),
                                                                                "fleetmend_drains_in_force"))),
                                timeout_s=30, what="the other replica publishes")
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
