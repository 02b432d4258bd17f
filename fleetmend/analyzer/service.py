"""`fleetmend analyzer`: the process around the comparator.

- Reads `fleet.<cluster>.perf.*` from the perf stream with an ordered push consumer, starting
  `window_s + grace_s` before now so the open window is rebuilt after a restart; judges each window
  `grace_s` after it ends (wall clock).
- One active replica per cluster: a `fleetmend.lease.KvLease` on key `lease.<cluster>` of the KV
  bucket `fleetmend_analyzer` (compare-and-set on revisions, no clock sync; renewed every tick, at
  most `lease_ttl_s / 3` apart; a standby takes over when the key has not changed for `lease_ttl_s`). Both replicas keep the windows; only the
  active one publishes findings and writes the state, and a replica that becomes active first loads
  the state the previous holder wrote.
- State `state.<cluster>` (streaks, their evidence, report times; `Comparator.to_state`) is written
  after every judged window, so a restart or failover keeps counting where it was.
- A finding becomes a `fail_slow` FaultEvent published on the node's fault subject through
  JetStream (Nats-Msg-Id = event id), so it takes the normal pipeline: router → NodeRemediation →
  FleetGuard budget → diagnostics → ticket.
- A sample that is not a valid `PerfSample` (or names another node than its subject) is written to
  `fleet.deadletter` with the reason and skipped; a group too small to compare is logged (once an
  hour per group and metric) and counted in `fleetmend_analyzer_small_groups`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
import time
from datetime import datetime, timezone
from typing import Any

import structlog
from pydantic import ValidationError

from fleetmend import subjects
from fleetmend.analyzer.core import Comparator, WindowResult, finding_event
from fleetmend.analyzer.metrics import derive
from fleetmend.config import Settings
from fleetmend.telemetry import PerfSample

log = structlog.get_logger("fleetmend.analyzer")

SMALL_GROUP_LOG_EVERY_S = 3600.0
MAX_SAMPLE_BYTES = 256 * 1024


def lease_key(cluster: str) -> str:
    return f"lease.{cluster}"


def state_key(cluster: str) -> str:
    return f"state.{cluster}"


async def analyzer_kv(js: Any) -> Any:
    """The analyzer's KV bucket (created when missing; history 1, file storage)."""
    from nats.js.api import KeyValueConfig
    from nats.js.errors import BucketNotFoundError

    try:
        return await js.key_value(subjects.ANALYZER_KV_BUCKET)
    except BucketNotFoundError:
        return await js.create_key_value(KeyValueConfig(bucket=subjects.ANALYZER_KV_BUCKET, history=1))


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
        from fleetmend.lease import KvLease

        self._lease = KvLease(kv, lease_key(self.cluster), self.holder, self.cfg.lease_ttl_s, clock=lease_clock)
        self.comparator = Comparator(self.cfg)
        self.active = False
        self.samples = 0
        self.rejected = 0
        self.published: list[str] = []
        """event ids of fail_slow events published by this replica (tests, logs)."""
        self.small_groups: dict[tuple[str, str], int] = {}
        self._small_logged: dict[tuple[str, str], float] = {}
        self._sub: Any = None
        self._log = log.bind(cluster=self.cluster, holder=self.holder)

    # ------------------------------------------------------------------ samples

    async def start(self) -> None:
        """Subscribe to the cluster's perf samples from `window_s + grace_s` ago."""
        from nats.js.api import ConsumerConfig, DeliverPolicy

        since = datetime.fromtimestamp(self.clock() - self.cfg.window_s - self.cfg.grace_s, timezone.utc)
        cfg = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME,
                             opt_start_time=since.isoformat().replace("+00:00", "Z"))
        self._sub = await self.js.subscribe(subjects.cluster_perf_subject(self.cluster), stream=subjects.PERF_STREAM,
                                            cb=self._on_msg, ordered_consumer=True, config=cfg)

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
        """File one sample into its window. Returns False for a late one (window already judged)."""
        _busy, metrics = derive(sample, self.cfg.busy_util_pct)
        self.samples += 1
        return self.comparator.add(sample.node, sample.hw.key, sample.at.timestamp(), metrics)

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
        """Acquire, renew or watch the cluster's lease (`fleetmend.lease.KvLease`, key
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
        from fleetmend import metrics

        metrics.ANALYZER_ACTIVE.labels(self.cluster).set(1 if self.active else 0)
        return self.active

    async def release(self) -> None:
        """Give the lease up at exit (the key is deleted) so the standby takes over at its next tick."""
        with contextlib.suppress(Exception):
            await self._lease.release()
        self.active = False

    async def load_state(self) -> None:
        from nats.js.errors import KeyNotFoundError

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
        from fleetmend import metrics

        active = await self.lease()
        results = []
        now = self.clock()
        for w in self.comparator.due(now):
            res = self.comparator.close_window(w)
            results.append(res)
            self._report_small(res, now)
            metrics.ANALYZER_SMALL_GROUPS.labels(self.cluster).set(len({(g.group, g.metric) for g in res.small_groups}))
            self._log.info("window_judged", window_end=datetime.fromtimestamp((w + 1) * self.cfg.window_s,
                                                                              timezone.utc).isoformat(),
                           nodes=res.nodes, judged=res.judged, outliers=res.outliers, findings=len(res.findings),
                           small_groups=len(res.small_groups), active=active)
            if not active:
                continue
            for f in res.findings:
                ev = finding_event(f, self.cluster)
                await self.js.publish(subjects.fault_subject(self.cluster, f.node), ev.to_json_bytes(),
                                      headers={"Nats-Msg-Id": subjects.msg_id(ev.event_id)}, timeout=5.0)
                self.published.append(ev.event_id)
                metrics.ANALYZER_FAIL_SLOW.labels(self.cluster, f.metric).inc()
                self._log.warning("fail_slow", node=f.node, **f.evidence())
            self.comparator.forget_reports_before(now)
            await self.save_state()
        return results

    def _report_small(self, res: WindowResult, now: float) -> None:
        for g in res.small_groups:
            key = (g.group, g.metric)
            self.small_groups[key] = g.size
            if now - self._small_logged.get(key, -1e18) >= SMALL_GROUP_LOG_EVERY_S:
                self._small_logged[key] = now
                self._log.warning("group_too_small", group=g.group, metric=g.metric, nodes=g.size,
                                  min_group_size=self.cfg.min_group_size,
                                  hint="not judged: fewer comparable nodes than analyzer.min_group_size")

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
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            await self.release()


async def run_analyzer(settings: Settings, stop: asyncio.Event) -> None:
    """Run one analyzer replica until `stop` is set (perf stream and KV bucket ensured at start)."""
    from fleetmend import metrics
    from fleetmend.connect import close_nats, connect_nats
    from fleetmend.jetstream import ensure_perf_stream

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
