"""The worker's wiring: the cluster's Temporal worker and the guard's (`Workers`), each workflow and
activity registered with its adapters (`build_worker`), and the workflow sandbox (`workflow_runner`).

A worker drains one cluster, `Settings.cluster`, and polls that cluster's queues only:
`subjects.cluster_task_queue(task_queue, cluster)` (incidents, sweeps, their activities) and the same of
`guard_task_queue(task_queue)` (its FleetGuard). So a drain never reaches another cluster's adapter, and each
cluster needs a worker of its own (`fleetmend worker --cluster C`). The unsuffixed queues that every cluster
shared before 0.3 (`task_queue`, `<task_queue>-guard`) are polled only with `legacy=True` (`LEGACY_QUEUES`)."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import structlog
from nats.aio.client import Client as NATS
from temporalio.client import Client
from temporalio.worker import Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from activities.diagnostics import DiagnosticsActivities
from activities.fleetguard import FleetGuardActivities
from activities.notify import Notifier, NotifyActivities, channels_from_settings
from activities.quarantine import PooledDrainActivities
from activities.reconfigure import ReconfigureActivities
from activities.recovery import RecoveryActivities
from activities.scheduler import NodeEvents, SchedulerActivities, build_scheduler
from activities.sweep import SweepActivities
from activities.tickets import TicketActivities, build_ticket_filer
from fleetmend.config import Settings
from fleetmend.infra.ledger import LedgerStore
from fleetmend.messages import guard_task_queue
from fleetmend.policy import load_topology
from fleetmend.subjects import cluster_task_queue
from workflows.fleetguard import FleetGuard
from workflows.remediation import NodeRemediation
from workflows.sweep import Sweep

log = structlog.get_logger("fleetmend.worker")

GRACEFUL_SHUTDOWN = timedelta(seconds=30)
"""Running activities (a drain in flight) get 30 s to finish on SIGTERM; the default 0 cancels them at once."""


def workflow_runner() -> SandboxedWorkflowRunner:
    """The sandbox with the project's own modules (`fleetmend`, `workflows`) passed through: loaded once
    per process instead of re-imported for every workflow run. A run then costs a fraction of the memory
    and CPU (the storm measured ~0.8 → ~0.35 MiB per cached run), and a message type is one class in
    every run, so the converter's TypeAdapter cache hits. The sandbox's runtime checks (wall clock,
    random, I/O called from workflow code) still apply; module-level state in those packages is shared,
    so they keep none that a workflow mutates."""
    return SandboxedWorkflowRunner(
        restrictions=SandboxRestrictions.default.with_passthrough_modules("fleetmend", "workflows"))


async def build_worker(settings: Settings, client: Client, nc: NATS, *, task_queue: str | None = None,
                       legacy: bool | None = None) -> Workers:
    """The worker of `settings.cluster` on its cluster's queues of `task_queue` (default `settings.task_queue`), and
    on the pre-0.3 shared ones unless `legacy` is False (default `LEGACY_QUEUES`; the Temporal SDK allows one
    worker per queue in a process, so a process that runs workers of several clusters keeps it for one)."""
    adapter = build_scheduler(settings, js=nc.jetstream())
    sched = SchedulerActivities(adapter, cluster=settings.cluster)
    node_events = adapter.record_event if isinstance(adapter, NodeEvents) else None  # Kubernetes: Events on the Node
    ledger = build_ledger(settings, nc)  # the incident ledger: written by the activities below, phase by phase
    tickets = TicketActivities(build_ticket_filer(settings, js=nc.jetstream()), node_events=node_events, ledger=ledger)
    diag = DiagnosticsActivities(nc, node_events=node_events, ledger=ledger)
    tq = task_queue or settings.task_queue
    guard = FleetGuardActivities.from_settings(client, settings, nc.jetstream(), task_queue=tq)
    guard.ledger = ledger
    # every drain under a permit finds (or takes) its slot in the cluster's permit pool first
    drain = PooledDrainActivities(sched.drain_node, guard.gate, undrain=sched.undrain_node, ledger=ledger)
    recovery = RecoveryActivities(nc, ledger=ledger)
    reconfigure = ReconfigureActivities(nc)
    sweep = SweepActivities(nc)
    notify = NotifyActivities(Notifier(channels_from_settings(settings.notify), nc.jetstream(),
                                       settings.notify.timeout_s))

    def main(queue: str) -> Worker:
        return Worker(
            client, task_queue=queue, workflows=[NodeRemediation, Sweep], workflow_runner=workflow_runner(),
            activities=[drain.drain_node, drain.undrain_node, tickets.file_ticket, tickets.update_ticket,
                        tickets.poll_ticket, diag.run_diagnostics, guard.request_drain_permit,
                        guard.release_drain_permit, recovery.reset_gpu, recovery.reboot_node,
                        reconfigure.reconfigure_node, sweep.bench_node, sweep.open_fail_slow, notify.notify],
            graceful_shutdown_timeout=GRACEFUL_SHUTDOWN,
            max_concurrent_workflow_tasks=settings.worker.max_concurrent_workflow_tasks,
            max_cached_workflows=settings.worker.max_cached_workflows,
            max_concurrent_activities=settings.worker.max_concurrent_activities,
        )

    def guard_worker(queue: str) -> Worker:  # FleetGuard and the activities it schedules, with task slots of its own
        return Worker(
            client, task_queue=queue, workflows=[FleetGuard], workflow_runner=workflow_runner(),
            activities=[guard.running_incidents, guard.sync_permit_pool, guard.reconcile_pool, tickets.file_ticket],
            graceful_shutdown_timeout=GRACEFUL_SHUTDOWN, max_concurrent_workflow_tasks=GUARD_WORKFLOW_TASKS,
            max_cached_workflows=GUARD_CACHED_RUNS, max_concurrent_activities=GUARD_ACTIVITIES,
        )

    cl = settings.cluster
    shared = [main(tq), guard_worker(guard_task_queue(tq))] if (LEGACY_QUEUES if legacy is None else legacy) else []
    return Workers(main(cluster_task_queue(tq, cl)), guard_worker(cluster_task_queue(guard_task_queue(tq), cl)),
                   *shared)


LEGACY_QUEUES = False
"""Whether a worker also polls the unsuffixed queues of releases before 0.3, where an incident or guard started
before an upgrade stays (each workflow keeps the queue it started on). Off: no release before 0.3 was deployed
(0.x), and the second set of pollers doubled every worker's polling and its ways to fail at start (a worker whose
namespace is missing took over 90 s to exit on a loaded box with four). `build_worker(..., legacy=True)` turns it
on for a development state that still has such workflows open."""


def build_ledger(settings: Settings, nc: NATS) -> LedgerStore:
    """The incident ledger (`fleetmend.infra.ledger.LedgerStore`) with the deployment's topology (racks) and
    repeat-part window."""
    return LedgerStore(nc.jetstream(), settings.ledger, topology=load_topology(settings.policy.topology_file),
                       repeat_part_window_s=settings.policy.repeat_part_window_days * 86400.0)


GUARD_WORKFLOW_TASKS = 2
"""Workflow-task slots of the guard queue: one guard per cluster has one task at a time; two leave room
for a second cluster's guard or a sweep of one that just continued-as-new."""
GUARD_CACHED_RUNS = 16
GUARD_ACTIVITIES = 4
"""The guard's pool writes (`sync_permit_pool`), reconciliation (`running_incidents`, `reconcile_pool`)
and infrastructure-incident tickets."""


class Workers:
    """The worker process's Temporal workers, run and shut down together: the cluster's queue (incidents,
    sweeps, every side effect), the cluster's guard queue, and the `legacy` ones (`LEGACY_QUEUES`). `run()`
    returns or raises when any stops, like `temporalio.worker.Worker.run`."""

    def __init__(self, main: Worker, guard: Worker, *legacy: Worker) -> None:
        self.main, self.guard, self.legacy = main, guard, list(legacy)
        self._stopping = False

    @property
    def task_queue(self) -> str:
        return self.main.task_queue

    @property
    def all(self) -> list[Worker]:
        return [self.main, self.guard, *self.legacy]

    async def run(self) -> None:
        tasks = [asyncio.create_task(w.run(), name=f"temporal-worker {w.task_queue}") for w in self.all]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()  # a worker that failed raises here
            if not self._stopping:
                raise RuntimeError(f"{next(iter(done)).get_name()} stopped polling on its own")
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def shutdown(self) -> None:
        self._stopping = True
        # a worker never started (a test runs some of them) must not be waited on: its shutdown never returns
        await asyncio.gather(*(w.shutdown() for w in self.all if w.is_running))
