"""`/healthz` and `/readyz` next to `/metrics` (the Kubernetes probes of the Helm chart use them)."""

from __future__ import annotations

import asyncio
import time

import httpx

from fleetmend.dev import servers
from fleetmend.infra import metrics


async def _get(url: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=5) as c:
        return await c.get(url)


async def test_readiness_follows_the_role_and_liveness_the_event_loop() -> None:
    health = metrics.Health(stall_after_s=0.5)
    port = servers.free_port()
    srv = metrics.start_http_server(port, "127.0.0.1", health=health)
    base = f"http://127.0.0.1:{port}"
    stop = asyncio.Event()
    beat = asyncio.create_task(metrics.beat_forever(stop, 0.05, health))
    try:
        r = await _get(base + "/readyz")
        assert (r.status_code, r.text.strip()) == (503, "starting")
        health.set_ready()
        assert (await _get(base + "/readyz")).status_code == 200
        assert (await _get(base + "/healthz")).status_code == 200
        assert "fleetmend_router_naks_total" in (await _get(base + "/metrics")).text
        health.set_ready(False, "shutting down")
        r = await _get(base + "/readyz")
        assert (r.status_code, r.text.strip()) == (503, "shutting down")
        # a blocked event loop: the tick stops, liveness fails (the HTTP server runs in its own thread)
        time.sleep(0.8)
        r = httpx.get(base + "/healthz", timeout=5)  # still blocking the loop
        assert r.status_code == 503 and "event loop stalled" in r.text
        await asyncio.sleep(0.2)
        assert (await _get(base + "/healthz")).status_code == 200
    finally:
        stop.set()
        await beat
        srv.shutdown()
