"""The router process: its service (`run_router`: connections, metrics, health, heartbeats)."""

from __future__ import annotations

import asyncio

import structlog

from activities.scheduler import build_scheduler
from fleetmend.catalog import load_catalog
from fleetmend.config import Settings
from fleetmend.infra import fleetgauges, metrics
from fleetmend.infra.connect import close_nats, connect_nats, connect_temporal
from fleetmend.infra.jetstream import ROUTER_BUCKETS, report_all_bucket_settings
from fleetmend.infra.lease import Presence
from fleetmend.router.core import Router
from fleetmend.router.heartbeats import HeartbeatMonitor

log = structlog.get_logger("fleetmend.router")


async def run_router(settings: Settings, stop: asyncio.Event) -> None:
    """Run one router replica until `stop` is set; then drain the NATS connection.

    The router cordons faults that must drain now through the cluster's scheduler adapter
    (`activities.scheduler.build_scheduler`), under a slot of the permit pool."""

    catalog = load_catalog(settings.catalog_overrides)
    nc = await connect_nats(settings, name="fleetmend-router")
    client = await connect_temporal(settings)
    scheduler = build_scheduler(settings, js=nc.jetstream())
    router = Router(settings, nc, nc.jetstream(), client, catalog, scheduler=scheduler)
    # buckets left at another replica count than [streams] replicas: one warning each (they stay as they are)
    await report_all_bucket_settings(nc.jetstream(), ROUTER_BUCKETS)
    # -- metrics (fleetmend/infra/metrics.py): /metrics port and the consumer-lag gauge
    metrics.start_http_server(settings.metrics.router_port, settings.metrics.host)
    # one router replica per durable consumer publishes its lag (fleetmend/infra/fleetgauges.py: a KV lease)
    elected: dict[str, bool] = {"held": False}  # the lag's publisher also publishes the silent-agent gauge

    def forget() -> None:
        fleetgauges.forget_router_lag(router.stream, router.durable)
        metrics.AGENTS_SILENT.clear()

    lag = asyncio.create_task(fleetgauges.run_elected(
        router.js, fleetgauges.ROLE_ROUTER_LAG, router.durable,
        lambda: metrics.refresh_router_lag(router.js, router.stream, router.durable), forget,
        settings.metrics.poll_interval_s, stop, log, state=elected)) if settings.metrics.router_port else None
    # -- monitor of the monitor: silent agents become agent_silent faults (fleetmend/router/heartbeats.py)
    heartbeats = asyncio.create_task(HeartbeatMonitor(nc, nc.jetstream(), settings.router.heartbeat_silence_s,
                                                      publish_gauge=lambda: elected["held"])
                                     .run(stop), name="heartbeats")
    # `fleetmend status` lists the live routers (fleetmend/infra/lease.py)
    present = asyncio.create_task(Presence(nc.jetstream(), "router", [settings.cluster], info={
        "filter": router.filter_subject, "durable": router.durable}).run(stop, log), name="presence")
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
        present.cancel()  # deletes its key (a clean stop), before the connection goes
        await asyncio.gather(present, return_exceptions=True)
        await close_nats(nc)
