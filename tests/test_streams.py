"""Streams are the operator's: fleetmend creates a missing stream with the configured replicas and
limits, never changes an existing one (a difference is one warning), and an agent recreates a fault
stream that NATS lost. Each test runs its own nats-server (it changes stream settings)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import nats
import pytest
import structlog
from nats.js.errors import NotFoundError

from agents.runner import run_agent
from fleetmend.config import AgentSettings, Settings, StreamSettings
from fleetmend.dev import servers
from fleetmend.events import Component, FaultEvent, Severity, Source
from fleetmend.infra import jetstream
from fleetmend.infra.jetstream import ensure_deadletter_stream, ensure_fault_stream, fault_stream_config
from fleetmend.subjects import DEADLETTER_STREAM, FAULT_STREAM, fault_subject
from tests.conftest import assert_eventually


@pytest.fixture
def own_nats(tmp_path: Path):
    port = servers.free_port()
    proc = servers.start_nats(tmp_path / "js", port)
    yield f"nats://127.0.0.1:{port}"
    proc.stop()


async def test_missing_streams_are_created_with_limits(own_nats: str) -> None:
    nc = await nats.connect(own_nats)
    js = nc.jetstream()
    s = StreamSettings(fault_max_bytes=64 * 1024**2, fault_max_age_s=3600, deadletter_max_bytes=8 * 1024**2)
    await ensure_fault_stream(js, s)
    await ensure_deadletter_stream(js, s)
    f = (await js.stream_info(FAULT_STREAM)).config
    d = (await js.stream_info(DEADLETTER_STREAM)).config
    assert f.max_bytes == 64 * 1024**2 and f.max_age == 3600 and f.max_msgs_per_subject == s.fault_max_msgs_per_node
    assert f.num_replicas == 1 and f.max_msg_size == s.fault_max_msg_bytes
    assert d.max_bytes == 8 * 1024**2 and d.max_age == s.deadletter_max_age_s
    await nc.close()


async def test_an_existing_stream_is_never_rewritten_one_warning(own_nats: str) -> None:
    """The operator changed the stream (here: limits; in a cluster: replicas 3). Agent and router
    starts leave it as it is and say so once."""
    nc = await nats.connect(own_nats)
    js = nc.jetstream()
    jetstream._warned.clear()
    await ensure_fault_stream(js)
    cfg = fault_stream_config()
    cfg.max_bytes, cfg.max_age = 2 * 1024**3, 30 * 24 * 3600.0
    await js.update_stream(cfg)  # the operator's edit
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):  # agent, router, another agent
            await ensure_fault_stream(js, StreamSettings())
    after = (await js.stream_info(FAULT_STREAM)).config
    assert after.max_bytes == 2 * 1024**3 and after.max_age == 30 * 24 * 3600.0, "left as the operator set it"
    warned = [e for e in logs if e["event"] == "stream_settings_differ"]
    assert len(warned) == 1, logs
    assert set(warned[0]["differences"]) == {"max_bytes", "max_age"}
    await nc.close()


async def test_a_stream_of_an_older_version_gets_todays_subjects_and_keeps_its_limits(own_nats: str) -> None:
    """FLEET_JOBS made by 0.1 listened on `fleet.*.job.*`; job reports now name their sender
    (`fleet.<c>.job.<node>.<job>`) and would be lost. The subjects are the code's contract: they are
    moved on, the operator's limits are kept."""
    from fleetmend.infra.jetstream import ensure_perf_stream
    from fleetmend.subjects import JOB_STREAM, job_subject

    nc = await nats.connect(own_nats)
    js = nc.jetstream()
    from nats.js.api import StreamConfig

    await js.add_stream(StreamConfig(name=JOB_STREAM, subjects=["fleet.*.job.*"], max_age=7200.0))
    with structlog.testing.capture_logs() as logs:
        await ensure_perf_stream(js)
    after = (await js.stream_info(JOB_STREAM)).config
    assert after.subjects == ["fleet.*.job.*.*"] and after.max_age == 7200.0, after
    assert any(e["event"] == "stream_subjects_updated" for e in logs), logs
    ack = await js.publish(job_subject("c1", "gpu-1", "j7"), b"{}")
    assert ack.stream == JOB_STREAM
    await nc.close()


async def test_agent_recreates_a_fault_stream_nats_lost(own_nats: str, tmp_path: Path) -> None:
    cluster, node = "clost", "n1"
    s = Settings(cluster=cluster, node=node, nats_url=own_nats, state_dir=tmp_path / "state",
                 nats_connect_timeout_s=5,
                 agent=AgentSettings(nice=0, heartbeat_interval_s=0.2, publish_timeout_s=2,
                                     kmsg_path=tmp_path / "no-kmsg"))

    class Probe:
        name = "one"

        def __init__(self) -> None:
            self.q: asyncio.Queue[FaultEvent] = asyncio.Queue()

        async def run(self, emit) -> None:
            while True:
                await emit(await self.q.get())

    probe = Probe()
    nc = await nats.connect(own_nats)
    js = nc.jetstream()
    stop = asyncio.Event()
    agent = asyncio.create_task(run_agent(s, stop=stop, probes=[probe], shutdown_timeout_s=5))
    try:
        await assert_eventually(lambda: _has_stream(js), timeout_s=20, what="the agent created the stream")
        await js.delete_stream(FAULT_STREAM)  # NATS lost it (storage wiped, stream deleted by mistake)
        ev = FaultEvent(cluster=cluster, node=node, component=Component.GPU, kind="xid", code=79,
                        severity=Severity.FATAL, source=Source.INJECT, message="xid 79")
        probe.q.put_nowait(ev)

        async def stored() -> int:
            try:
                info = await js.stream_info(FAULT_STREAM, subjects_filter=fault_subject(cluster, node))
            except Exception:
                return 0
            return (info.state.subjects or {}).get(fault_subject(cluster, node), 0)

        await assert_eventually(lambda: _eq(stored(), 1), timeout_s=40, what="event in the recreated stream")
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(agent, 20)
        await nc.close()


async def _has_stream(js) -> bool:
    try:
        await js.stream_info(FAULT_STREAM)
        return True
    except Exception:
        return False


async def _eq(coro, n: int) -> bool:
    return (await coro) == n


def test_deadletters_on_a_fresh_install_prints_no_traceback(own_nats: str, tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "FLEETMEND_NATS_URL": own_nats, "FLEETMEND_STATE_DIR": str(tmp_path / "state")}
    env.pop("FLEETMEND_CONFIG", None)

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "fleetmend.cli.main", "deadletters", *args], env=env,
                              capture_output=True, text=True, timeout=60)

    r = run()  # no dead-letter stream at all
    assert r.returncode == 0 and "no dead-lettered messages" in r.stdout and "Traceback" not in r.stderr, r.stderr

    async def create() -> None:
        nc = await nats.connect(own_nats)
        await ensure_deadletter_stream(nc.jetstream())
        await nc.close()

    asyncio.run(create())  # the router created it; nothing was ever dead-lettered
    for args in ((), ("--json",)):
        r = run(*args)
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout.strip() == "[]"


async def test_router_recreates_a_fault_stream_nats_lost(own_nats: str, temporal_client, tmp_path: Path) -> None:
    """The router owns the streams when agents run with node credentials (they may not create it):
    a fault stream deleted under a running router is created again, with its consumer."""
    from fleetmend.catalog import load_catalog
    from fleetmend.config import load_settings
    from fleetmend.router.core import Router

    s = load_settings(None, nats_url=own_nats, state_dir=tmp_path, task_queue="tq-lost")
    nc = await nats.connect(own_nats)
    js = nc.jetstream()
    router = Router(s, nc, js, temporal_client, load_catalog())
    stop = asyncio.Event()
    task = asyncio.create_task(router.run(stop))
    try:
        await assert_eventually(lambda: _has_stream(js), timeout_s=20, what="router set up")
        await asyncio.sleep(1.0)
        await js.delete_stream(FAULT_STREAM)
        await assert_eventually(lambda: _has_stream(js), timeout_s=30, what="the router recreated the stream")
        from fleetmend.subjects import ROUTER_DURABLE

        ci = await assert_eventually(lambda: _consumer(js, ROUTER_DURABLE), timeout_s=20, what="its consumer")
        assert ci.config.durable_name == ROUTER_DURABLE
        assert not task.done()
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await nc.close()


async def _consumer(js, name: str):
    try:
        return await js.consumer_info(FAULT_STREAM, name)
    except Exception:
        return None


def test_a_stream_raised_to_three_replicas_is_reported_never_lowered():
    """A single test server cannot hold 3 replicas; the comparison that decides the warning can be
    checked directly: the operator's 3 replicas differ from the configured 1 (reported; `ensure_stream`
    updates only a stream's subjects, sending back the server's own config, so its replicas stay)."""
    from fleetmend.infra.jetstream import differences

    want = fault_stream_config(StreamSettings(replicas=1))
    have = fault_stream_config(StreamSettings(replicas=1))
    have.num_replicas = 3
    assert differences(want, have) == {"num_replicas": (3, 1)}
    assert differences(want, fault_stream_config(StreamSettings())) == {}


async def test_kv_keys_lists_every_key_right_after_it_was_written(nc, unique):
    """`kv_keys` sees a key the moment its put returned, on every try: nats-py's `KeyValue.keys()` can
    report an empty bucket (NoKeysError) when its watcher's messages are still buffered, which made
    `fleetmend tickets` print no ticket right after one was filed."""
    from nats.js.api import KeyValueConfig

    from fleetmend.infra.jetstream import kv_keys

    js = nc.jetstream()
    bucket = f"keys_{unique}"
    kv = await js.create_key_value(KeyValueConfig(bucket=bucket, history=5))
    assert await kv_keys(js, bucket) == []
    written: list[str] = []
    for i in range(40):
        for key in (f"t.FM-{i:06d}", f"i.inc-{i}"):
            await kv.put(key, b"{}")
            written.append(key)
        assert await kv_keys(js, bucket) == sorted(written)
        assert await kv_keys(js, bucket, "t.") == sorted(k for k in written if k.startswith("t."))
    await kv.delete("t.FM-000000")
    assert "t.FM-000000" in await kv_keys(js, bucket, "t."), "a deleted key stays listed; readers skip it"
    with pytest.raises(NotFoundError):
        await kv_keys(js, f"absent_{unique}")
