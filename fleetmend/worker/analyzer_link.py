"""What a worker carries between the fail-slow analyzer and the rest of fleetmend (issue 28).

- **Domain findings → FleetGuard** (`DomainRelay`). The analyzer writes what it judged last to the KV
  entry `status.<cluster>` of its bucket (`fleetmend.analyzer.service.Analyzer.status`), among it
  `domains`: the domain findings it has reported (seen `windows` windows in a row) and still sees,
  each with the outliers it explains. Every `DOMAIN_POLL_S` the relay reads it and, when the list
  changed (or every `DOMAIN_REFRESH_S` while it is not empty), signals the cluster's FleetGuard
  (`activities.fleetguard.report_domains`, `DomainReport`): each finding becomes one infrastructure
  incident (a ticket, a human paged), the fail_slow incidents of its nodes are denied while it is
  open, and it closes as soon as the analyzer no longer lists it (`workflows.fleetguard`). A status
  older than `DOMAIN_STATUS_MAX_AGE_S` (the analyzer stopped) is not relayed: FleetGuard closes its
  analyzer incidents an hour after their last report.
- **The scheduler's jobs → the analyzer** (`JobPublisher`). Every `JOBS_PUBLISH_S` the scheduler
  adapter lists the running jobs and their nodes (`SlurmScheduler.running_jobs`: `scontrol -o show
  job`; `KubernetesScheduler.running_jobs`: the pods of each job by its label), published on
  `fleet.<cluster>.sched.jobs` (core NATS, parts of at most `JOBS_PART_BYTES`). The analyzer compares
  the nodes of one job together on the metrics that depend on the work, whether or not every rank
  reports step times (`fleetmend.analyzer.core.Comparator.note_sched`), and no longer believes a node
  that reports steps of a job the scheduler runs elsewhere.

Why in the worker: it already holds what both need, the Temporal client and the guard's policy, and
the scheduler adapter with its credentials (`activities.scheduler.build_scheduler`). The analyzer
stays a NATS-only process: it imports no adapter (a process imports no other process, and the
adapters are the activities' floor: tests/test_architecture.py), holds no scheduler or Temporal
credentials, and gets the scheduler's word on a subject only the worker's credentials may publish
(`fleetmend.infra.security`), so no node can make up a job's membership. Each runs in one elected
worker replica (`fleetmend.infra.fleetgauges.run_elected`, roles `ROLE_DOMAINS`, `ROLE_JOBS`).
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime, timezone
from typing import Any

import structlog
from nats.js.errors import BucketNotFoundError, KeyNotFoundError

from activities.fleetguard import guard_policy, report_domains
from fleetmend import subjects
from fleetmend.config import Settings
from fleetmend.infra import fleetgauges
from fleetmend.messages import DOMAIN_MAX_FINDINGS, DOMAIN_MAX_NODES, DomainFinding, DomainReport
from fleetmend.policy import load_topology

log = structlog.get_logger("fleetmend.worker.analyzer_link")

ROLE_DOMAINS = "analyzer-domains"
ROLE_JOBS = "scheduler-jobs"
DOMAIN_POLL_S = 30.0
DOMAIN_REFRESH_S = 900.0
"""A non-empty list is sent again this often even unchanged (FleetGuard closes an analyzer incident
an hour after the last report that listed it)."""
DOMAIN_STATUS_MAX_AGE_S = 1800.0
"""A status whose window ended longer ago than this is the word of an analyzer that stopped: not
relayed (beside `window_s`: 6 default windows)."""
JOBS_PUBLISH_S = 60.0
JOBS_PART_BYTES = 256 * 1024


def domain_report(cluster: str, status: dict[str, Any]) -> DomainReport:
    """The `DomainReport` of an analyzer status (`Analyzer.status`), bounded like FleetGuard keeps it."""
    end = status.get("window_end")
    findings = []
    for d in (status.get("domains") or [])[:DOMAIN_MAX_FINDINGS]:
        if not isinstance(d, dict) or not isinstance(d.get("key"), str):
            continue
        findings.append(DomainFinding(key=d["key"], nodes=[str(n) for n in (d.get("nodes") or [])][:DOMAIN_MAX_NODES],
                                      metrics=[str(m) for m in (d.get("metrics") or [])],
                                      windows=int(d.get("windows") or 0), share=float(d.get("share") or 0.0)))
    return DomainReport(cluster=cluster, findings=findings,
                        window_end=datetime.fromtimestamp(float(end), timezone.utc) if end is not None else None)


class DomainRelay:
    """The analyzer's domain findings to FleetGuard (module docstring). `refresh()` once per poll."""

    def __init__(self, client: Any, settings: Settings, js: Any, *, clock: Any = time.time) -> None:
        self.client, self.settings, self.js, self.clock = client, settings, js, clock
        self.policy = guard_policy(settings, load_topology(settings.policy.topology_file))
        self._kv: Any = None
        self.sent: str | None = None
        """The signature (domain keys and nodes) of the last report sent."""
        self.sent_at = -1e18
        self.reports = 0

    async def refresh(self) -> DomainReport | None:
        """Read the analyzer's status; send its domain findings when they changed (or are due again).
        Returns the report sent, or None. Raises NATS and Temporal errors (the caller logs them)."""
        if self._kv is None:
            try:
                self._kv = await self.js.key_value(subjects.ANALYZER_KV_BUCKET)
            except BucketNotFoundError:
                return None  # no analyzer has run yet
        try:
            entry = await self._kv.get(subjects.analyzer_status_key(self.settings.cluster))
        except KeyNotFoundError:
            return None
        status = json.loads(entry.value or b"{}")
        end = status.get("window_end")
        now = self.clock()
        if end is None or now - float(end) > DOMAIN_STATUS_MAX_AGE_S:
            return None
        report = domain_report(self.settings.cluster, status)
        sig = json.dumps([(f.key, sorted(f.nodes)) for f in report.findings])
        if sig == self.sent and not (report.findings and now - self.sent_at >= DOMAIN_REFRESH_S):
            return None
        await report_domains(self.client, self.settings, report, self.policy)
        if sig != self.sent:
            log.info("analyzer_domains_relayed", cluster=self.settings.cluster,
                     domains=[f.key for f in report.findings], nodes=sum(len(f.nodes) for f in report.findings))
        self.sent, self.sent_at = sig, now
        self.reports += 1
        return report


def job_list_parts(cluster: str, jobs: dict[str, list[str]], at: float,
                   max_bytes: int = JOBS_PART_BYTES) -> list[bytes]:
    """The scheduler's running jobs as messages of at most ~`max_bytes` each (a job's nodes are never
    split across two): `{"v": 1, "cluster": C, "at": t, "jobs": {job: [node, ...]}}`."""
    parts: list[bytes] = []
    cur: dict[str, list[str]] = {}
    size = 0

    def flush() -> None:
        parts.append(json.dumps({"v": 1, "cluster": cluster, "at": at, "jobs": cur}).encode())

    for job, nodes in sorted(jobs.items()):
        n = len(job) + sum(len(x) + 4 for x in nodes) + 8
        if cur and size + n > max_bytes:
            flush()
            cur, size = {}, 0
        cur[job] = list(nodes)
        size += n
    if cur or not parts:
        flush()
    return parts


class JobPublisher:
    """The scheduler's running jobs to the analyzer (module docstring). `refresh()` once a minute."""

    def __init__(self, settings: Settings, nc: Any, adapter: Any) -> None:
        self.settings, self.nc, self.adapter = settings, nc, adapter
        self.published = 0

    async def refresh(self) -> int:
        """List the running jobs and publish them; returns the jobs published. Raises SchedulerError
        (scontrol or the API server away: the caller logs it) and NATS errors."""
        jobs = await self.adapter.running_jobs()
        subject = subjects.sched_jobs_subject(self.settings.cluster)
        for part in job_list_parts(self.settings.cluster, jobs, time.time()):
            await self.nc.publish(subject, part)
        await self.nc.flush()
        self.published += 1
        return len(jobs)


def start(client: Any, settings: Settings, nc: Any, stop: asyncio.Event) -> list[asyncio.Task[None]]:
    """Start the domain relay and, where the scheduler can list its running jobs (Slurm, Kubernetes),
    the job publisher, each in one elected replica; the tasks end with `stop`."""
    from activities.scheduler import build_scheduler  # the worker builds its adapters from settings

    js = nc.jetstream()
    relay = DomainRelay(client, settings, js)
    tasks = [asyncio.create_task(fleetgauges.run_elected(
        js, ROLE_DOMAINS, settings.cluster, relay.refresh, lambda: None, DOMAIN_POLL_S, stop, log),
        name="analyzer-domains")]
    try:
        adapter = build_scheduler(settings, js=js)
    except Exception as err:  # noqa: BLE001 - the drains report the same error; the analyzer falls back
        log.warning("scheduler_jobs_not_published", cluster=settings.cluster, error=repr(err))
        adapter = None
    if adapter is not None and hasattr(adapter, "running_jobs"):
        pub = JobPublisher(settings, nc, adapter)
        tasks.append(asyncio.create_task(fleetgauges.run_elected(
            js, ROLE_JOBS, settings.cluster, pub.refresh, lambda: None, JOBS_PUBLISH_S, stop, log),
            name="scheduler-jobs"))
    return tasks


__all__ = ["DomainRelay", "JobPublisher", "domain_report", "job_list_parts", "start"]
