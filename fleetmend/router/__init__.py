"""The router process: JetStream → classification → Temporal signal-with-start."""

from __future__ import annotations

import asyncio

import structlog

from fleetmend.config import Settings

log = structlog.get_logger("fleetmend.router")


async def run_router(settings: Settings, stop: asyncio.Event, build_scheduler=None) -> None:  # noqa: ANN001
    """Run one router replica until `stop` is set; then drain the NATS connection.

    `build_scheduler(settings, js=...)` (`activities.scheduler.build_scheduler`, passed by the CLI) gives
    the router its scheduler adapter for the fast path (`policy.fast_drain`)."""
    from fleetmend.catalog import load_catalog
    from fleetmend.connect import close_nats, connect_nats, connect_temporal
    from fleetmend.router.core import Router

    catalog = load_catalog(settings.catalog_overrides)
    nc = await connect_nats(settings, name="fleetmend-router")
    client = await connect_temporal(settings)
    scheduler = build_scheduler(settings, js=nc.jetstream()) \
        if build_scheduler is not None and settings.policy.fast_drain else None
    router = Router(settings, nc, nc.jetstream(), client, catalog, scheduler=scheduler)
    # -- metrics (fleetmend/metrics.py): /metrics port and the consumer-lag gauge
    from fleetmend import metrics

    metrics.start_http_server(settings.metrics.router_port, settings.metrics.host)
    # one router replica per durable consumer publishes its lag (fleetmend/fleetgauges.py: a KV lease)
    from fleetmend import fleetgauges

    elected: dict[str, bool] = {"held": False}  # the lag's publisher also publishes the silent-agent gauge

    def forget() -> None:
        fleetgauges.forget_router_lag(router.stream, router.durable)
        metrics.AGENTS_SILENT.clear()

    lag = asyncio.create_task(fleetgauges.run_elected(
        router.js, fleetgauges.ROLE_ROUTER_LAG, router.durable,
        lambda: metrics.refresh_router_lag(router.js, router.stream, router.durable), forget,
        settings.metrics.poll_interval_s, stop, log, state=elected)) if settings.metrics.router_port else None
    # -- monitor of the monitor: silent agents become agent_silent faults (fleetmend/router/heartbeats.py)
    from fleetmend.router.heartbeats import HeartbeatMonitor

    heartbeats = asyncio.create_task(HeartbeatMonitor(nc, nc.jetstream(), settings.router.heartbeat_silence_s,
                                                      publish_gauge=lambda: elected["held"])
                                     .run(stop), name="heartbeats")
    beat = asyncio.create_task(metrics.beat_forever(stop), name="liveness")  # /healthz
    metrics.HEALTH.set_ready()  # /readyz: NATS and Temporal connected
    try:
        await router.run(stop)
    finally:
        metrics.HEALTH.set_ready(False, "stopping")
        beat.cancel()
        heartbeats.cancel()
        if lag is not None:
            lag.cancel()
        await close_nats(nc)
