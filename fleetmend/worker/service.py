"""The worker process: runs the cluster's Temporal workers (`fleetmend.worker.build`) with its
/metrics, /healthz and /readyz, and one elected replica's fleet-level gauges and breaker notices. It announces
the cluster it drains in the lease bucket (`fleetmend.infra.lease.Presence`) while it runs."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timezone

import structlog
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_exponential

from activities.fleetguard import announce_policy
from activities.notify import Notifier, channels_from_settings, notify_breaker, notify_findings
from fleetmend.config import Settings
from fleetmend.infra import fleetgauges, metrics
from fleetmend.infra.connect import close_nats, connect_nats, connect_temporal
from fleetmend.infra.jetstream import WORKER_BUCKETS, report_all_bucket_settings
from fleetmend.infra.lease import Presence
from fleetmend.infra.ledger import ROLE_LEDGER_PACK
from fleetmend.report import FIELDS, ReportParams, build_report
from fleetmend.worker import analyzer_link
from fleetmend.worker.build import build_ledger, build_worker

log = structlog.get_logger("fleetmend.worker")


async def run_worker(settings: Settings, stop: asyncio.Event) -> None:
    """Run until `stop` is set (graceful shutdown, exit 0), or until the Temporal worker fails
    (logged, then `SystemExit(1)`): a worker process that no longer polls must not stay alive
    looking healthy, so its supervisor (systemd, Kubernetes, dev up) restarts it."""
    nc = await connect_nats(settings, name="fleetmend-worker")
    client = await connect_temporal(settings)
    worker = await build_worker(settings, client, nc)
    # buckets left at another replica count than [streams] replicas: one warning each (they stay as they are)
    await report_all_bucket_settings(nc.jetstream(), WORKER_BUCKETS)
    log.info("worker_started", cluster=settings.cluster, task_queue=worker.task_queue,
             guard_task_queue=worker.guard.task_queue, scheduler=settings.scheduler.value)
    # which clusters are served: `fleetmend status`, and the router's summary of an incident no worker can take
    present = asyncio.create_task(Presence(nc.jetstream(), "worker", [settings.cluster], info={
        "task_queue": worker.task_queue, "scheduler": settings.scheduler.value}).run(stop, log), name="presence")
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

    ledger = build_ledger(settings, nc)
    report_due = [0.0]

    async def refresh() -> None:
        await watcher.refresh()
        if settings.notify.any:  # breaker open: one notification per trip, from the elected replica
            await notify_breaker(client, settings.cluster, notifier)
        if time.monotonic() >= report_due[0]:  # the ledger's report: gauges and version findings
            report_due[0] = time.monotonic() + settings.ledger.refresh_s
            await report_refresh(settings, ledger, notifier)

    # the ledger's roll-up: closed records packed many per value (fleetmend.infra.ledger), by one replica
    packer = asyncio.create_task(fleetgauges.run_elected(
        nc.jetstream(), ROLE_LEDGER_PACK, settings.cluster, lambda: ledger.roll_up(settings.cluster), lambda: None,
        settings.ledger.pack_interval_s, stop, log), name="ledger-pack")
    poll = asyncio.create_task(fleetgauges.run_elected(
        nc.jetstream(), fleetgauges.ROLE_INCIDENTS, settings.cluster, refresh,
        lambda: forget_all(settings.cluster), settings.metrics.poll_interval_s, stop, log,
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
            # the process stops: every loop bound to `stop` ends by itself. A cancel alone is not enough on
            # Python 3.11, whose asyncio.wait_for (nats-py's request) swallows a cancel that lands as the reply
            # arrives (CPython gh-86296): the presence loop then ran on and the worker never exited (CI run 10)
            stop.set()
        else:
            await worker.shutdown()
            await asyncio.gather(running, return_exceptions=True)
    finally:
        metrics.HEALTH.set_ready(False, "stopping")
        beat.cancel()
        stopping.cancel()
        if poll is not None:
            poll.cancel()
        packer.cancel()
        for task in links:
            task.cancel()
        present.cancel()  # deletes its key (a clean stop), before the connection goes
        await asyncio.wait({present}, timeout=10.0)  # bounded: a stopping process must stop
        await close_nats(nc)
    announced.cancel()
    if failed is not None:
        raise SystemExit(1)
    log.info("worker_stopped")


def forget_all(cluster: str) -> None:
    fleetgauges.forget_cluster_gauges(cluster)
    metrics.forget_report(cluster)


async def report_refresh(settings: Settings, ledger, notifier: Notifier) -> dict:  # noqa: ANN001 - LedgerStore
    """`fleetmend report` of the cluster over `ledger.findings_window_days`: its figures as gauges
    (`fleetmend_report_*`) and each version finding as a notification (once per finding). Returns the report."""
    now = time.time()
    c = settings.cluster
    params = ReportParams.from_settings(settings, now - settings.ledger.findings_window_days * 86400.0, now)
    heads, fleet = await ledger.read_heads(c, fields=FIELDS, since=params.since), await ledger.fleet(c)
    # the arithmetic in a thread: at 100,000 records it takes seconds, which the worker's event loop (activities,
    # heartbeats) must not wait out
    rep = await asyncio.to_thread(build_report, heads, params, fleet=fleet, cluster=c)
    metrics.export_report(c, rep)
    if rep["findings"] and settings.notify.any:
        await notify_findings(c, rep["findings"], notifier)
    return rep


async def _announce_policy(client, settings: Settings, stop: asyncio.Event) -> None:  # noqa: ANN001
    """Tell FleetGuard this worker's policy (`activities.fleetguard.announce_policy`), retrying (1 s
    doubling to 60 s) until it is accepted or the worker stops: a lowered budget or observe-only must close
    the permit pool without waiting for a fault."""
    def logged(state: RetryCallState) -> None:
        log.warning("guard_policy_not_announced", cluster=settings.cluster, attempt=state.attempt_number,
                    error=repr(state.outcome.exception()) if state.outcome else None)

    def worth_retrying(err: BaseException) -> bool:  # a cancellation is never retried
        return isinstance(err, Exception) and not stop.is_set()

    async for attempt in AsyncRetrying(wait=wait_exponential(multiplier=1, max=60),
                                       retry=retry_if_exception(worth_retrying), before_sleep=logged, reraise=True):
        with attempt:
            await announce_policy(client, settings)
    log.info("guard_policy_announced", cluster=settings.cluster, max_drained_nodes=settings.policy.max_drained_nodes,
             observe_only=settings.policy.observe_only)
