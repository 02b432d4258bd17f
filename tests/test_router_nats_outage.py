"""A router whose set-up again fails (NATS still away) tries again until it succeeds (issue 27, point 2: in the
clustered chaos run, every surviving router logged `router_setup_failed` once while a killed nats-server's streams
elected leaders, then consumed nothing for the rest of the run: a fetch on its unsubscribed subscription only timed
out, which reads as idle)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats
from nats.js.api import StreamConfig

from fleetmend import subjects
from fleetmend.catalog import load_catalog
from fleetmend.config import load_settings
from fleetmend.dev import servers
from fleetmend.router.core import Router
from tests.conftest import assert_eventually
from tests.test_router import xid_event


async def test_the_router_consumes_again_after_a_set_up_that_failed(temporal_client, tmp_path: Path,
                                                                     unique: str) -> None:
    """Its fault stream deleted and, for a while, another stream on the fault subjects (so that creating it again
    is refused, as a set-up is while a cluster elects its leaders): the router fails a set-up, then sets up again
    once the way is clear, and routes the next fault."""
    port = servers.free_port()
    proc = servers.start_nats(tmp_path / "js", port)
    url = f"nats://127.0.0.1:{port}"
    s = load_settings(None, nats_url=url, state_dir=tmp_path, task_queue=f"tq-{unique}", cluster=f"o{unique}")
    nc = await nats.connect(url)
    js = nc.jetstream(timeout=5.0)
    router = Router(s, nc, js, temporal_client, load_catalog())
    stop = asyncio.Event()
    task = None
    setups: list[str] = []  # the router's own calls of `setup` after its start, and how each ended
    first_setup = router.setup

    async def setup():
        try:
            psub = await first_setup()
        except Exception as err:
            setups.append(f"failed: {err!r}")
            raise
        setups.append("ok")
        return psub

    async def consumer():
        try:
            return await js.consumer_info(subjects.FAULT_STREAM, subjects.ROUTER_DURABLE)
        except Exception:
            return None

    try:
        task = asyncio.create_task(router.run(stop))
        await assert_eventually(consumer, 20, what="the router set up")
        router.setup = setup  # type: ignore[method-assign]  # what _fetch_loop calls to set up again
        await js.delete_stream(subjects.FAULT_STREAM)
        await js.add_stream(StreamConfig(name="BLOCKER", subjects=[subjects.all_faults_subject()]))
        await assert_eventually(lambda: any(x.startswith("failed") for x in setups), 40, what="a set-up that failed")
        await js.delete_stream("BLOCKER")
        await assert_eventually(lambda: "ok" in setups, 20, what=f"set up again once the way is clear ({setups})")
        assert await consumer() is not None
        ev = xid_event(s.cluster, "n1", 13)
        await js.publish(subjects.fault_subject(s.cluster, "n1"), ev.to_json_bytes(),
                         headers={"Nats-Msg-Id": ev.event_id})
        await assert_eventually(lambda: router.stats.received >= 1, 30, what="the next fault consumed")
        assert not task.done()
    finally:
        stop.set()
        if task is not None:
            await asyncio.wait_for(task, 30)
        await nc.close()
        proc.stop()
