"""`fleetmend analyzer`: the process around the comparator.

- Reads `fleet.<cluster>.perf.*` from the perf stream with an ordered push consumer, starting
  `window_s + grace_s` before now so the open window is rebuilt after a restart; judges each window
  `grace_s` after it ends (wall clock).
- One active replica per cluster: a `fleetmend.infra.lease.KvLease` on key `lease.<cluster>` of the KV
  bucket `fleetmend_analyzer` (compare-and-set on revisions, no clock sync; renewed every tick, at
  most `lease_ttl_s / 3` apart; a standby takes over when the key has not changed for `lease_ttl_s`).
  Both replicas keep the windows; only the active one publishes findings and writes the state, and a
  replica that becomes active first loads the state the previous holder wrote.
- State `state.<cluster>` (streaks, their evidence, report times; `Comparator.to_state`) is written
  after every judged window, so a restart or failover keeps counting where it was.
- A finding becomes a `fail_slow` FaultEvent published on the node's fault subject through
  JetStream (Nats-Msg-Id = event id), so it takes the normal pipeline: router → NodeRemediation →
  FleetGuard budget → diagnostics → ticket.
- The scheduler's running jobs (`fleet.<cluster>.sched.jobs`, core NATS, published every minute by a
  worker from its scheduler adapter: Slurm job → nodes, a Kubernetes job's pods → nodes;
  `fleetmend.worker.analyzer_link`) say which nodes run one job, whether or not every rank reports
  step times (`Comparator.note_sched`: the scheduler's word comes first). Only the worker's
  credentials may publish there. A node that reports step times of a job the scheduler lists
  without that node is not believed (the rows are dropped and counted, `job.not_in_job`).
- Job step times (`fleetmend.jobs`, `fleet.<cluster>.job.<node>.<job>`) go through a second comparator whose
  groups are jobs and whose members are ranks, each judged with its own offset in the job removed
  (`job_comparator`): a rank persistently slower than that becomes fail_slow on its node, saying
  whether that node's hardware telemetry agrees. The same rows tell the node comparator which job
  each node ran (`Comparator.note_job`): work-dependent metrics are compared among a job's nodes
  only, and not at all for a node whose job is unknown.
- A sample that is not a valid `PerfSample` (a non-finite or impossible reading included, or one
  that names another node than its subject) is written to `fleet.deadletter` with the reason and
  skipped; so is a job message that speaks for another node than its subject's sender, for more
  than one node, or for more ranks than the node has GPUs (rows of a node that sent no perf sample
  are dropped and counted). Samples and steps dated beyond the clock skew
  ahead of this replica's clock, or before any open window, are dropped and counted
  (`Comparator.dropped`, logged once a minute as `analyzer_input_dropped`), and per node: the
  nodes whose samples were dropped for their time are logged after each window
  (`analyzer_clock_skew`) and listed in the status. A group too small to compare is logged (once an
  hour per group and metric) with how it was judged instead, and counted in
  `fleetmend_analyzer_small_groups`.
- Status `status.<cluster>` (`Analyzer.status`: small groups and how they were judged, nodes with
  late or early samples) is written by the active replica after every judged window:
  `nats kv get fleetmend_analyzer status.<cluster>`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import math
import os
import socket
import time
from datetime import datetime, timezone
from typing import Any

import structlog
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import BucketNotFoundError, KeyNotFoundError
from pydantic import ValidationError

from fleetmend import subjects
from fleetmend.analyzer.core import MAX_JOBS_PER_WINDOW, MAX_NODES_PER_WINDOW, Comparator, WindowResult, finding_event
from fleetmend.analyzer.drift import DriftJudge
from fleetmend.analyzer.metrics import MetricSpec, derive
from fleetmend.catalog import load_catalog
from fleetmend.config import Settings
from fleetmend.events import MAX_CLOCK_SKEW_S, Component
from fleetmend.infra import metrics
from fleetmend.infra.connect import close_nats, connect_nats
from fleetmend.infra.jetstream import ensure_perf_stream, kv_config
from fleetmend.infra.lease import KvLease
from fleetmend.messages import DOMAIN_MAX_FINDINGS, DOMAIN_MAX_NODES
from fleetmend.policy import load_topology
from fleetmend.telemetry import PerfSample

log = structlog.get_logger("fleetmend.analyzer")

SMALL_GROUP_LOG_EVERY_S = 3600.0
SKEW_KEEP_S = 3600.0
"""A node's samples dropped for their time are listed in the status for this long after the last."""
STATUS_MAX_NODES = 200
"""Nodes (and small groups) listed in the status at most, the worst first (a KV value stays small)."""
DROPPED_LOG_EVERY_S = 60.0
MAX_SAMPLE_BYTES = 256 * 1024
MAX_STEP_SECONDS = 86400.0
"""A step time above a day is not a step time."""
KNOWN_NODE_TTL_S = 3600.0
"""A node is known (may report job steps) for this long after its last perf sample."""
SCHED_TTL_S = 180.0
"""A job the scheduler listed is remembered this long after the last list that named it (the worker
lists every minute: three lists missed and it is forgotten)."""
MAX_SCHED_BYTES = 1024 * 1024
MAX_JOB_NAME = 128


JOB_SPEC = MetricSpec("job_step_seconds", "high", False, 0.05, 0.0, Component.GPU, "step time s",
                      why="a rank's step time, judged against the other ranks of its own job only",
                      lo=0.0, hi=MAX_STEP_SECONDS, baseline_windows=3)
"""A rank's step time: higher is worse, judged against the other ranks of its job, with the rank's
own offset (learnt over its first `job_baseline_windows` windows in the job) removed."""


def job_comparator(cfg: Any) -> Comparator:
    """A `Comparator` of job step times: groups are jobs, keys `<node>/<rank>`, at least
    `job_min_ranks` ranks; the job's median and MAD weigh each node as one member (the median of
    its ranks), so a node claiming many ranks cannot move them by more than one node's weight. A
    rank's offset against the job's median is learnt over its first
    `job_baseline_windows` windows in the job (a rank slower by design, e.g. rank 0 doing the
    logging, keeps its offset for the job's life and is never slow for it); from then on a rank whose
    step time, divided by its offset, is `job_slow_ratio` above the job's median so divided (and
    beyond `mad_k` MADs) is slow in that window."""
    c = Comparator(cfg.model_copy(update={"min_group_size": cfg.job_min_ranks}),
                   unit_of=lambda member: member.rpartition("/")[0])
    c.specs = {"job_step_seconds": dataclasses.replace(JOB_SPEC, min_rel=cfg.job_slow_ratio - 1,
                                                         baseline_windows=cfg.job_baseline_windows)}
    return c


def status_key(cluster: str) -> str:
    """`status.<cluster>`: what the active analyzer judged last (`Analyzer.status`)."""
    return subjects.analyzer_status_key(cluster)


def lease_key(cluster: str) -> str:
    return f"lease.{cluster}"


def state_key(cluster: str) -> str:
    return f"state.{cluster}"


async def analyzer_kv(js: Any) -> Any:
    """The analyzer's KV bucket (created when missing; history 1, file storage)."""
    try:
        return await js.key_value(subjects.ANALYZER_KV_BUCKET)
    except BucketNotFoundError:
        return await js.create_key_value(kv_config(subjects.ANALYZER_KV_BUCKET, "fail-slow analyzer: lease and state"))


class Analyzer:
    """One analyzer replica of `settings.cluster`.

    Args:
        settings: cluster, `analyzer` section.
        nc, js, kv: connected NATS client, its JetStream context, the analyzer KV bucket.
        holder: this replica's lease identity (default host-pid-random).
        clock: epoch-seconds clock that closes windows (tests).
        lease_clock: monotonic clock of the lease (tests).
    """

    def __init__(self, settings: Settings, nc: Any, js: Any, kv: Any, *, holder: str | None = None,
                 clock: Any = time.time, lease_clock: Any = time.monotonic) -> None:
        self.s, self.cfg = settings, settings.analyzer
        self.cluster = settings.cluster
        self.nc, self.js, self.kv = nc, js, kv
        self.holder = holder or f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"
        self.clock = clock
        self._lease = KvLease(kv, lease_key(self.cluster), self.holder, self.cfg.lease_ttl_s, clock=lease_clock)
        topology = load_topology(settings.policy.topology_file)
        self.comparator = Comparator(self.cfg, domains_of=(lambda node: topology.domain(node).keys())
                                     if len(topology) else None)
        """Node metrics; failure domains from the topology file FleetGuard reads (`policy.topology_file`),
        else inferred from co-occurrence (`fleetmend.analyzer.shared`)."""
        self.shared_active: list[dict[str, Any]] = []
        """Domain and version findings seen in the last judged window (the status lists them)."""
        self.domains: list[dict[str, Any]] = []
        """The domain findings reported and still seen in the last judged window, each with every node
        it explains (`status()["domains"]`: what a worker relays to FleetGuard as infrastructure
        incidents, `fleetmend.messages.DomainReport`)."""
        self.drift = DriftJudge(self.cluster, js, catalog=load_catalog(settings.catalog_overrides))  # analyzer/drift.py
        self.jobs = job_comparator(self.cfg)
        """Per-rank step times of jobs (`fleetmend.jobs`): group = job, key = `<node>/<rank>`."""
        self.job_steps = 0
        self.active = False
        self.samples = 0
        self.rejected = 0
        self.published: list[str] = []
        """event ids of fail_slow events published by this replica (tests, logs)."""
        self.small_groups: dict[tuple[str, str], int] = {}
        """(group, metric) → nodes with a value, of the last judged window's groups too small to compare."""
        self.small_groups_judged: dict[tuple[str, str], tuple[int, str]] = {}
        """The same → (nodes, how they were judged instead: `expected`, `own_history`)."""
        self.nodes: dict[str, tuple[float, int]] = {}
        """node → (analyzer clock at its last valid perf sample, its GPU count): the nodes that may
        report job steps (bounded: forgotten `KNOWN_NODE_TTL_S` after their last sample)."""
        self._dropped_logged: dict[str, int] = {}
        self._dropped_at = -1e18
        self._claims: dict[tuple[int, str], dict[str, set[int]]] = {}
        """(window, node) → job → ranks the node reported in that window: one node speaks for at most
        its GPU count of ranks per job and `MAX_JOBS_PER_WINDOW` jobs (pruned as windows close)."""
        self._small_logged: dict[tuple[str, str], float] = {}
        self.skewed: dict[str, tuple[dict[str, int], float]] = {}
        """node → (reason → samples and job steps dropped for their time: `late`, `future` (early),
        `stale`; analyzer clock of the last drop), kept `SKEW_KEEP_S` (the status lists them)."""
        self.last_window_end: float | None = None
        self.sched_jobs: dict[str, tuple[frozenset[str], float]] = {}
        """The scheduler's running jobs (`_on_sched_msg`): job → (its nodes, analyzer clock of the last
        list naming it), forgotten `SCHED_TTL_S` after."""
        self.sched_lists = 0
        self._sched_sub: Any = None
        self._sub: Any = None
        self._job_sub: Any = None
        self._log = log.bind(cluster=self.cluster, holder=self.holder)

    # ------------------------------------------------------------------ samples

    async def start(self) -> None:
        """Subscribe to the cluster's perf samples from `window_s + grace_s` ago."""
        since = datetime.fromtimestamp(self.clock() - self.cfg.window_s - self.cfg.grace_s, timezone.utc)
        self._sub = await self._ordered(subjects.cluster_perf_subject(self.cluster), subjects.PERF_STREAM, since,
                                        self._on_msg)
        self._job_sub = await self._ordered(subjects.cluster_job_subject(self.cluster), subjects.JOB_STREAM, since,
                                            self._on_job_msg)
        self._sched_sub = await self.nc.subscribe(subjects.sched_jobs_subject(self.cluster), cb=self._on_sched_msg)

    async def _ordered(self, subject: str, stream: str, since: datetime, cb: Any) -> Any:
        """An ordered push consumer from `since`. nats-py recreates an ordered consumer after a gap
        by start *sequence* but keeps the start *time* of the first request, which the server refuses
        (err 10094); the stored time is cleared once the consumer exists, so a recreation resumes by
        sequence as intended."""
        cfg = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME,
                             # nats-py sends the value as given; the server wants RFC 3339 with Z
                             opt_start_time=since.isoformat().replace("+00:00", "Z"))  # type: ignore[arg-type]
        sub = await self.js.subscribe(subject, stream=stream, cb=cb, ordered_consumer=True, config=cfg)
        # the ordered-consumer state sits on the core subscription the PushSubscription wraps (nats-py 2.x:
        # `sub._sub._jsi`); missed, every recreation was refused and the replica read no sample again after its
        # consumer was lost (a nats-server of the cluster killed: bench/chaos_cluster.py)
        jsi = getattr(sub, "_jsi", None) or getattr(getattr(sub, "_sub", None), "_jsi", None)
        if jsi is None or getattr(jsi, "_ccreq", None) is None:
            raise RuntimeError("nats-py's ordered consumer state not found (sub._sub._jsi): a client version whose "
                               "recreation by start sequence this analyzer cannot set; pin nats-py or update _ordered")
        jsi._ccreq.opt_start_time = None
        return sub

    async def _on_job_msg(self, msg: Any) -> None:
        """One batch of step times (`fleetmend.jobs`) on `fleet.<cluster>.job.<node token>.<job>`. A
        message speaks for its sender only: every row must name the subject's node (whose credentials
        allow no other node's subject, `subjects.node_job_subject`), under its real name,
        with at most `max(1, its GPU count)` distinct ranks of the job in a window (across messages)
        and steps of at most `MAX_JOBS_PER_WINDOW` jobs in a window, else it is dead-lettered whole
        with the reason; a node this analyzer has no perf sample from (a made-up name) is dropped and counted
        (`jobs.dropped["unknown_node"]`, logged once a minute).
        Accepted rows feed the ranks' comparator and tell the node comparator which job the node ran
        (its work-dependent metrics are then compared with that job's other nodes)."""
        now = self.clock()
        try:
            if len(msg.data) > MAX_SAMPLE_BYTES:
                raise ValueError(f"job message of {len(msg.data)} bytes exceeds {MAX_SAMPLE_BYTES}")
            data = json.loads(msg.data)
            if not isinstance(data, dict) or data.get("v") != 1 or not isinstance(data.get("steps"), list):
                raise ValueError("expected {\"v\": 1, \"job\": ..., \"steps\": [[rank, node, step, seconds, time], ...]}")
            cluster, sender, job = subjects.parse_job_subject(msg.subject)
            if cluster != self.cluster or str(data.get("job")) != job:
                raise ValueError(f"message names job {str(data.get('job'))[:40]!r} but was published on {msg.subject}")
            rows = []
            for row in data["steps"]:
                if not isinstance(row, list) or len(row) != 5:
                    raise ValueError(f"a step row is [rank, node, step, seconds, time], got {str(row)[:80]}")
                r, n, _step, sec, at = row
                rank, node, sec, at = int(r), subjects.check_node_name(str(n)), float(sec), float(at)
                if not (math.isfinite(sec) and math.isfinite(at)):
                    raise ValueError(f"rank {rank}: step time and time must be finite numbers")
                if not 0 < sec <= MAX_STEP_SECONDS or rank < 0:
                    raise ValueError(f"rank {rank}: step time {sec} outside (0, {MAX_STEP_SECONDS:g}] s or rank < 0")
                rows.append((rank, node, sec, at))
            nodes = {node for _, node, _, _ in rows}
            if len(nodes) > 1:
                raise ValueError(f"one job message names {len(nodes)} nodes ({', '.join(sorted(nodes)[:4])}): "
                                 "a node reports for its own ranks only")
            if nodes and nodes != {sender}:
                raise ValueError(f"rows name node {next(iter(nodes))!r} but {sender!r} sent them ({msg.subject}): "
                                 "a node reports for its own ranks only")
            known = self.nodes.get(rows[0][1]) if rows else None
            if rows and known is None:
                # a made-up name, or a node whose first perf sample this replica has not read yet (the
                # two streams replay side by side after a restart): dropped and counted, not dead-lettered
                self.jobs.dropped["unknown_node"] += len(rows)
                return
            sched = self.sched_jobs.get(job)
            if rows and sched is not None and sender not in sched[0] and now - sched[1] <= SCHED_TTL_S:
                # the scheduler runs this job elsewhere: a node speaking for a job it is not part of
                self.jobs.dropped["not_in_job"] += len(rows)
                return
            claims = self._check_claims(job, rows, known[1], now) if rows and known is not None else {}
        except (ValueError, TypeError, UnicodeDecodeError, OverflowError) as err:
            self.rejected += 1
            await self._deadletter(msg, f"invalid job timing message: {str(err)[:300]}")
            return
        for key, ranks in claims.items():
            self._claims.setdefault(key, {}).setdefault(job, set()).update(ranks)
        for rank, node, sec, at in rows:
            if self.jobs.add(f"{node}/{rank}", f"job:{job}", at, {"job_step_seconds": (sec, f"rank:{rank}")},
                             now=now):
                self.comparator.note_job(node, job, at, now=now)
                self.job_steps += 1

    async def _on_sched_msg(self, msg: Any) -> None:
        """One list of the scheduler's running jobs (`{"v": 1, "cluster": C, "at": t, "jobs": {job:
        [node, ...]}}`, possibly one of several parts): each job's nodes are noted as running it in the
        open window (`Comparator.note_sched`) and remembered for `SCHED_TTL_S`. Node names go through
        `subjects.check_node_name`; an invalid name or job is skipped and counted
        (`sched.invalid`); a malformed message is dead-lettered."""
        now = self.clock()
        try:
            if len(msg.data) > MAX_SCHED_BYTES:
                raise ValueError(f"scheduler job list of {len(msg.data)} bytes exceeds {MAX_SCHED_BYTES}")
            data = json.loads(msg.data)
            if not isinstance(data, dict) or data.get("v") != 1 or not isinstance(data.get("jobs"), dict):
                raise ValueError("expected {\"v\": 1, \"cluster\": ..., \"jobs\": {job: [node, ...]}}")
            if data.get("cluster") != self.cluster:
                raise ValueError(f"job list of cluster {str(data.get('cluster'))[:40]!r} on {msg.subject}")
        except (ValueError, TypeError, UnicodeDecodeError) as err:
            self.rejected += 1
            await self._deadletter(msg, f"invalid scheduler job list: {str(err)[:300]}")
            return
        self.sched_lists += 1
        for job, nodes in data["jobs"].items():
            if (not isinstance(job, str) or not job or len(job) > MAX_JOB_NAME or not job.isprintable()
                    or not isinstance(nodes, list)):
                self.comparator.dropped["sched.invalid"] += 1
                continue
            if job not in self.sched_jobs and len(self.sched_jobs) >= MAX_NODES_PER_WINDOW:
                self.comparator.dropped["sched.too_many_jobs"] += 1
                continue
            ok = []
            for n in nodes[:MAX_NODES_PER_WINDOW]:
                try:
                    ok.append(subjects.check_node_name(str(n)))
                except ValueError:
                    self.comparator.dropped["sched.invalid"] += 1
            self.sched_jobs[job] = (frozenset(ok), now)
            for node in ok:
                self.comparator.note_sched(node, job, now, now=now)

    def _forget_sched(self, now: float) -> None:
        for job in [j for j, (_, t) in self.sched_jobs.items() if now - t > SCHED_TTL_S]:
            del self.sched_jobs[job]

    def _check_claims(self, job: str, rows: list[tuple[int, str, float, float]], gpus: int,
                      now: float) -> dict[tuple[int, str], set[int]]:
        """The (window, node) → ranks this message adds, after checking that, with what the node
        already reported in those windows (other messages included), it speaks for at most
        `max(1, gpus)` ranks of `job` and at most `MAX_JOBS_PER_WINDOW` jobs. Rows outside the
        windows that can still be judged are left out (the comparator drops them). Raises ValueError."""
        cfg = self.cfg
        lo, hi = now - cfg.window_s - cfg.grace_s - MAX_CLOCK_SKEW_S, now + MAX_CLOCK_SKEW_S
        node = rows[0][1]
        out: dict[tuple[int, str], set[int]] = {}
        for rank, _, _, at in rows:
            if lo <= at <= hi:
                out.setdefault((self.jobs.window_of(at), node), set()).add(rank)
        cap = max(1, gpus)
        for key, ranks in out.items():
            seen = self._claims.get(key, {})
            if len(seen.get(job, set()) | ranks) > cap:
                raise ValueError(f"node {node!r} reports {len(seen.get(job, set()) | ranks)} ranks of job {job} "
                                 f"in one window but has {gpus} GPUs")
            if len(set(seen) | {job}) > MAX_JOBS_PER_WINDOW:
                raise ValueError(f"node {node!r} reports steps of more than {MAX_JOBS_PER_WINDOW} jobs in one window")
        return out

    async def _on_msg(self, msg: Any) -> None:
        reason = None
        try:
            if len(msg.data) > MAX_SAMPLE_BYTES:
                raise ValueError(f"sample of {len(msg.data)} bytes exceeds {MAX_SAMPLE_BYTES}")
            sample = PerfSample.from_json_bytes(msg.data)
            cluster, node = subjects.parse_perf_subject(msg.subject)
            if (sample.cluster, sample.node) != (cluster, node):
                raise ValueError(f"sample names {sample.cluster}/{sample.node} but was published on {msg.subject}")
        except (ValidationError, ValueError, UnicodeDecodeError) as err:
            reason = f"invalid perf sample: {str(err)[:500]}"
        if reason is not None:
            self.rejected += 1
            await self._deadletter(msg, reason)
            return
        self.add(sample)

    def add(self, sample: PerfSample) -> bool:
        """File one sample into its window. Returns False when it is dropped (late, dated beyond the
        allowed clock skew ahead of this analyzer's clock, older than any open window, or its node
        filled the window; `Comparator.dropped` counts why, `tick` logs it)."""
        now = self.clock()
        _busy, derived = derive(sample, self.cfg.busy_util_pct)
        self.samples += 1
        if sample.node in self.nodes or len(self.nodes) < MAX_NODES_PER_WINDOW:
            self.nodes[sample.node] = (now, sample.hw.gpu_count)
        fp = {k: v for k, v in (("driver", sample.hw.driver), ("vbios", sample.hw.vbios)) if v}
        return self.comparator.add(sample.node, sample.hw.key, sample.at.timestamp(), derived, now=now,
                                   fingerprint=fp)

    async def _deadletter(self, msg: Any, reason: str) -> None:
        record = {"reason": reason, "subject": msg.subject, "at": datetime.now(timezone.utc).isoformat(),
                  "data_b64": base64.b64encode(msg.data[:MAX_SAMPLE_BYTES]).decode(), "data_bytes": len(msg.data),
                  "by": "analyzer"}
        try:
            await self.js.publish(subjects.DEADLETTER_SUBJECT, json.dumps(record).encode(), timeout=5.0)
        except Exception as err:  # noqa: BLE001 - the sample is telemetry: logged, not retried
            self._log.error("deadletter_write_failed", error=repr(err), reason=reason)
        self._log.warning("perf_sample_rejected", reason=reason, subject=msg.subject)

    # ------------------------------------------------------------------ lease and state

    async def lease(self) -> bool:
        """Acquire, renew or watch the cluster's lease (`fleetmend.infra.lease.KvLease`, key
        `lease.<cluster>` of the analyzer bucket). Returns whether this replica is active now; a
        replica that becomes active loads the state its predecessor wrote."""
        was = self.active
        try:
            self.active = await self._lease.tick()
        except Exception as err:  # noqa: BLE001 - NATS away: active only while our last write is good
            self._log.warning("lease_unavailable", error=repr(err))
            self.active = self._lease.held
        if self.active and not was:
            await self.load_state()
            self._log.info("analyzer_active")
        elif was and not self.active:
            self._log.info("analyzer_standby")
        metrics.ANALYZER_ACTIVE.labels(self.cluster).set(1 if self.active else 0)
        return self.active

    async def release(self) -> None:
        """Give the lease up at exit (the key is deleted) so the standby takes over at its next tick."""
        with contextlib.suppress(Exception):
            await self._lease.release()
        self.active = False

    async def load_state(self) -> None:
        try:
            entry = await self.kv.get(state_key(self.cluster))
        except KeyNotFoundError:
            return
        if entry.value:
            self.comparator.load_state(json.loads(entry.value))
            self._log.info("analyzer_state_loaded", last_window=self.comparator.last_closed,
                           streaks=sum(len(v) for v in self.comparator.streaks.values()))

    async def save_state(self) -> None:
        await self.kv.put(state_key(self.cluster), json.dumps(self.comparator.to_state()).encode())

    # ------------------------------------------------------------------ judging

    async def tick(self) -> list[WindowResult]:
        """Renew the lease, judge every due window, publish findings and save state (active only)."""
        active = await self.lease()
        results = []
        now = self.clock()
        self._log_dropped(now)
        for w in self.comparator.due(now):
            res = self.comparator.close_window(w)
            results.append(res)
            self.last_window_end = (w + 1) * self.cfg.window_s
            skewed = self._collect_skewed(now)
            if skewed:
                worst = sorted(skewed.items(), key=lambda kv: -sum(kv[1].values()))[:20]
                self._log.warning("analyzer_clock_skew", nodes=len(skewed), worst=dict(worst),
                                  hint="samples dropped for their time: late = the node's clock behind or its "
                                       "delivery slow, future = its clock ahead; check NTP/chrony on these nodes")
            self._report_small(res, now)
            metrics.ANALYZER_SMALL_GROUPS.labels(self.cluster).set(len({(g.group, g.metric) for g in res.small_groups}))
            self._log.info("window_judged", window_end=datetime.fromtimestamp((w + 1) * self.cfg.window_s,
                                                                              timezone.utc).isoformat(),
                           nodes=res.nodes, judged=res.judged, outliers=res.outliers, findings=len(res.findings),
                           small_groups=len(res.small_groups), small_job_groups=res.small_job_groups,
                           no_job=res.no_job, explained=res.explained, shared=len(res.shared_seen),
                           active=active)
            self.shared_active = [f.evidence() for f in res.shared_seen][:STATUS_MAX_NODES]
            self.domains = [{"key": f.key, "nodes": sorted(f.nodes)[:DOMAIN_MAX_NODES], "metrics": f.metrics,
                             "windows": f.windows, "share": round(f.value, 4)}
                            for f in res.shared_seen if f.kind == "domain" and f.reported][:DOMAIN_MAX_FINDINGS]
            if not active:
                continue
            for g in res.shared_findings:  # one finding for many outliers: no node event, no drain
                self._log.warning(f"fail_slow_{g.kind}", **g.evidence(),
                                  hint="outliers sharing a failure domain or a version: not a node's fault, "
                                       "nothing is drained; their nodes are judged again once it clears")
            for f in res.findings:
                ev = finding_event(f, self.cluster)
                await self.js.publish(subjects.fault_subject(self.cluster, f.node), ev.to_json_bytes(),
                                      headers={"Nats-Msg-Id": subjects.msg_id(ev.event_id)}, timeout=5.0)
                self.published.append(ev.event_id)
                metrics.ANALYZER_FAIL_SLOW.labels(self.cluster, f.metric).inc()
                self._log.warning("fail_slow", node=f.node, **f.evidence())
            self.comparator.forget_reports_before(now)
            await self.save_state()
            await self.save_status()
        for w in self.jobs.due(now):
            # a rack event or a slow version slows the steps of its nodes too: not their ranks' fault
            self.jobs.explained_units = set(self.comparator.explainer.explained_nodes)
            res = self.jobs.close_window(w)
            for key in [k for k in self._claims if k[0] <= w]:
                del self._claims[key]
            if not active:
                continue
            for f in res.findings:
                ev = self.job_event(f)
                await self.js.publish(subjects.fault_subject(self.cluster, ev.node), ev.to_json_bytes(),
                                      headers={"Nats-Msg-Id": subjects.msg_id(ev.event_id)}, timeout=5.0)
                self.published.append(ev.event_id)
                metrics.ANALYZER_FAIL_SLOW.labels(self.cluster, f.metric).inc()
                self._log.warning("fail_slow_rank", node=ev.node, **ev.attrs)
        if active:
            await self.drift.maybe_tick()  # config drift of the cluster's fingerprints, every DRIFT_INTERVAL_S
        return results

    def job_event(self, f: Any) -> Any:
        """The fail_slow event of a slow rank: on the rank's node, with the job's evidence, and which
        hardware metrics of that node are outlying too (`hardware_agrees`, empty when none)."""
        node, _, rank = f.node.partition("/")
        hw = sorted(set(self.comparator.streaks.get(node, {})) | set(self.comparator.reported.get(node, {})))
        g = dataclasses.replace(f, node=node)
        ev = finding_event(g, self.cluster, JOB_SPEC)
        job = f.group.removeprefix("job:")
        agrees = f"; hardware telemetry agrees ({', '.join(hw)})" if hw else "; hardware telemetry shows nothing"
        return ev.model_copy(update={
            "message": (f"fail-slow: rank {rank} of job {job} on {node}: median step {f.value:.4g} s vs "
                        f"{f.peer_median:.4g} s expected (the job's median at this rank's own offset "
                        f"x{f.baseline if f.baseline is not None else 1.0:.3f}, ratio {f.ratio:.3f}) in {f.windows} "
                        f"consecutive {f.window_s:g} s windows among {f.group_size} ranks{agrees}"),
            "attrs": {**ev.attrs, "job": job, "rank": int(rank), "hardware_agrees": ",".join(hw)}})

    def _log_dropped(self, now: float) -> None:
        """Once a minute at most: what was dropped at the door since the last line (by reason), and
        forget nodes silent for `KNOWN_NODE_TTL_S`."""
        if now - self._dropped_at < DROPPED_LOG_EVERY_S:
            return
        self._dropped_at = now
        total = {f"perf.{k}": v for k, v in self.comparator.dropped.items()}
        total.update({f"job.{k}": v for k, v in self.jobs.dropped.items()})
        new = {k: v - self._dropped_logged.get(k, 0) for k, v in total.items() if v > self._dropped_logged.get(k, 0)}
        if new:
            self._log.warning("analyzer_input_dropped", dropped=new,
                              hint="late/stale/future: the sender's clock or delivery; non_finite/out_of_range: "
                                   "impossible values; flood: too many samples from one node")
        self._dropped_logged = total
        gone = now - KNOWN_NODE_TTL_S
        for node in [n for n, (t, _) in self.nodes.items() if t < gone]:
            del self.nodes[node]
        self._forget_sched(now)

    def _collect_skewed(self, now: float) -> dict[str, dict[str, int]]:
        """Merge what the comparators dropped per node for its time since the last call (a rank key
        `<node>/<rank>` counts for its node) into `skewed`; returns the new counts."""
        new: dict[str, dict[str, int]] = {}
        for key, reasons in [*self.comparator.take_skewed().items(), *self.jobs.take_skewed().items()]:
            node = key.split("/", 1)[0]
            for r, n in reasons.items():
                new.setdefault(node, {})[r] = new.get(node, {}).get(r, 0) + n
        for node, reasons in new.items():
            old = self.skewed.get(node, ({}, now))[0]
            self.skewed[node] = ({r: old.get(r, 0) + reasons.get(r, 0) for r in {*old, *reasons}}, now)
        for node in [n for n, (_, t) in self.skewed.items() if now - t > SKEW_KEEP_S]:
            del self.skewed[node]
        return new

    def status(self) -> dict[str, Any]:
        """What the analyzer judged last, JSON-ready (KV `status.<cluster>`, written by the active
        replica after each judged window): the groups too small to compare and how they were
        judged instead, and the nodes whose samples were dropped for their time in the last
        `SKEW_KEEP_S` (`late`: after their window was judged, the node's clock behind or its
        delivery slow; `future`: ahead of this analyzer's clock beyond the allowed skew; `stale`), the
        domain and version findings seen in the last window (`shared_findings`), and the domain
        findings reported and still seen with every node they explain (`domains`: a worker relays
        them to FleetGuard, `fleetmend.worker.analyzer_link`)."""
        worst = sorted(self.skewed.items(), key=lambda kv: -sum(kv[1][0].values()))[:STATUS_MAX_NODES]
        return {"cluster": self.cluster, "holder": self.holder, "window_end": self.last_window_end,
                "small_groups": [{"group": g, "metric": m, "nodes": n, "judged": j}
                                 for (g, m), (n, j) in sorted(self.small_groups_judged.items())][:STATUS_MAX_NODES],
                "shared_findings": self.shared_active,
                "domains": self.domains,
                "scheduler_jobs": len(self.sched_jobs),
                "clock_skew": {node: reasons for node, (reasons, _) in worst},
                "clock_skew_nodes": len(self.skewed)}

    async def save_status(self) -> None:
        await self.kv.put(status_key(self.cluster), json.dumps(self.status()).encode())

    def _report_small(self, res: WindowResult, now: float) -> None:
        """The last judged window's small groups (`small_groups`), each logged once an hour at most."""
        self.small_groups = {(g.group, g.metric): g.size for g in res.small_groups}
        self.small_groups_judged = {(g.group, g.metric): (g.size, g.judged or "not judged") for g in res.small_groups}
        for key in [k for k, t in self._small_logged.items() if now - t >= SMALL_GROUP_LOG_EVERY_S]:
            del self._small_logged[key]
        for g in res.small_groups:
            key = (g.group, g.metric)
            if now - self._small_logged.get(key, -1e18) >= SMALL_GROUP_LOG_EVERY_S:
                self._small_logged[key] = now
                self._log.warning("group_too_small", group=g.group, metric=g.metric, nodes=g.size,
                                  min_group_size=self.cfg.min_group_size, judged=g.judged or "not judged",
                                  hint="fewer comparable nodes than analyzer.min_group_size: judged against "
                                       "the class's fixed expectation or each node's own history")

    async def run(self, stop: asyncio.Event, tick_s: float = 1.0, started: bool = False) -> None:
        """`start` (unless `started`), then `tick` every `tick_s` (at most `lease_ttl_s / 3` apart, so
        the lease is renewed in time) until `stop`; then release the lease."""
        if not started:
            await self.start()
        try:
            while not stop.is_set():
                try:
                    await self.tick()
                except Exception as err:  # noqa: BLE001 - NATS hiccup: the next tick retries
                    self._log.warning("analyzer_tick_failed", error=repr(err))
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(tick_s, self.cfg.lease_ttl_s / 3)):
                        await stop.wait()
        finally:
            for sub in (self._sub, self._job_sub, self._sched_sub):
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            await self.release()


async def run_analyzer(settings: Settings, stop: asyncio.Event) -> None:
    """Run one analyzer replica until `stop` is set (perf stream and KV bucket ensured at start)."""

    nc = await connect_nats(settings, name=f"fleetmend-analyzer-{settings.cluster}")
    js = nc.jetstream(timeout=10.0)
    try:  # the fault and dead-letter streams are the router's
        await ensure_perf_stream(js)
    except Exception as err:  # noqa: BLE001 - e.g. no permission: an operator owns the streams
        log.warning("stream_not_ensured", stream="perf", error=repr(err))
    kv = await analyzer_kv(js)
    metrics.start_http_server(settings.metrics.analyzer_port, settings.metrics.host)
    a = Analyzer(settings, nc, js, kv)
    log.info("analyzer_starting", cluster=settings.cluster, window_s=a.cfg.window_s, windows=a.cfg.windows,
             min_group_size=a.cfg.min_group_size, holder=a.holder)
    beat = asyncio.create_task(metrics.beat_forever(stop), name="liveness")  # /healthz
    try:
        await a.start()
        metrics.HEALTH.set_ready()  # /readyz: NATS connected, reading samples (active or standby)
        await a.run(stop, started=True)
    finally:
        metrics.HEALTH.set_ready(False, "stopping")
        beat.cancel()
        await close_nats(nc)
