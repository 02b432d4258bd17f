"""The worker process: runs the cluster's Temporal workers (`fleetmend.worker.build`) with its
/metrics, /healthz and /readyz, and one elected replica's fleet-level gauges and breaker notices."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone

import structlog
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_exponential

from activities.fleetguard import announce_policy
from activities.notify import Notifier, channels_from_settings, notify_breaker
from fleetmend.config import Settings
from fleetmend.infra import fleetgauges, metrics
from fleetmend.infra.connect import close_nats, connect_nats, connect_temporal
from fleetmend.worker import analyzer_link
from fleetmend.worker.build import build_worker

log = structlog.get_logger("fleetmend.worker")


async def run_worker(settings: Settings, stop: asyncio.Event) -> None:
    """Run until `stop` is set (graceful shutdown, exit 0), or until the Temporal worker fails
    (logged, then `SystemExit(1)`): a worker process that no longer polls must not stay alive
    looking healthy, so its supervisor (systemd, Kubernetes, dev up) restarts it."""
    nc = await connect_nats(settings, name="fleetmend-worker")
    client = await connect_temporal(settings)
    worker = await build_worker(settings, client, nc)
    log.info("worker_started", task_queue=settings.task_queue, scheduler=settings.scheduler.value)
    announced = asyncio.create_task(_announce_policy(client, settings, stop), name="guard-policy")
    # the fail-slow analyzer's domain findings to FleetGuard, the scheduler's jobs to the analyzer (issue 28)
    links = analyzer_link.start(client, settings, nc, stop)
    # -- metrics (fleetmend/infra/metrics.py): /metrics port; incidents by phase, drains in force (visibility)
    metrics.start_http_server(settings.metrics.worker_port, settings.metrics.host)
    watcher = metrics.IncidentWatcher(client, settings.cluster)
    # One replica per cluster publishes the fleet-level gauges (fleetmend/infra/fleetgauges.py): elected by a KV lease.
    def elected() -> None:  # observe only incidents opened from now on: the previous publisher saw the rest
        watcher.since = datetime.now(timezone.utc)

    notifier = Notifier(channels_from_settings(settings.notify), nc.jetstream(), settings.notify.timeout_s)

    async def refresh() -> None:
        await watcher.refresh()
        if settings.notify.any:  # breaker open: one notification per trip, from the elected replica
            await notify_breaker(client, settings.cluster, notifier)

    poll = asyncio.create_task(fleetgauges.run_elected(
        nc.jetstream(), fleetgauges.ROLE_INCIDENTS, settings.cluster, refresh,
        lambda: fleetgauges.forget_cluster_gauges(settings.cluster), settings.metrics.poll_interval_s, stop, log,
        on_elected=elected)) if settings.metrics.worker_port or settings.notify.any else None
    running = asyncio.create_task(worker.run(), name="temporal-worker")
    beat = asyncio.create_task(metrics.beat_forever(stop), name="liveness")  # /healthz
    metrics.HEALTH.set_ready()  # /readyz: NATS and Temporal connected, polling
    stopping = asyncio.create_task(stop.wait(), name="stop")
    failed: BaseException | None = None
    try:
        await asyncio.wait({running, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if running.done():
            failed = running.exception() or RuntimeError("the Temporal worker stopped polling on its own")
            log.error("worker_failed", error=repr(failed))
        else:
            await worker.shutdown()
            await asyncio.gather(running, return_exceptions=True)
    finally:
        metrics.HEALTH.set_ready(False, "stopping")
        beat.cancel()
        stopping.cancel()
        if poll is not None:
            poll.cancel()
        for task in links:
            task.cancel()
        await close_nats(nc)
    announced.cancel()
    if failed is not None:
        raise SystemExit(1)
    log.info("worker_stopped")


async def _announce_policy(client, settings: Settings, stop: asyncio.Event) -> None:  # noqa: ANN001
    """Tell FleetGuard this worker's policy (`activities.fleetguard.announce_policy`), retrying (1 s
    doubling to 60 s) until it is accepted or the worker stops: a lowered budget or observe-only must close
    the permit pool without waiting for a fault."""
    def logged(state: RetryCallState) -> None:
        log.warning("guard_policy_not_announced", cluster=settings.cluster, attempt=state.attempt_number,
                    error=repr(state.outcome.exception()) if state.outcome else None)

    async for attempt in AsyncRetrying(wait=wait_exponential(multiplier=1, max=60),
                                       retry=retry_if_exception(lambda _e: not stop.is_set()),
                                       before_sleep=logged, reraise=True):
        with attempt:
            await announce_policy(client, settings)
    log.info("guard_policy_announced", cluster=settings.cluster, max_drained_nodes=settings.policy.max_drained_nodes,
             observe_only=settings.policy.observe_only)
