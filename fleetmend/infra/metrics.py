"""Prometheus metrics of the agent, router, worker and analyzer (`prometheus-client`), one place for all.

Labels come from bounded sets only (an unbounded label is a memory leak in Prometheus): cluster,
component, kind, source, severity, action, scheduler, filer, outcome, phase, reason (one of
`DEADLETTER_REASONS`). Never a node, event or incident id: per-node questions go to Temporal
visibility (`fleetmend status`, the UI).

Each process serves `/metrics` on its own port when `metrics.<process>_port` (or `--metrics-port`)
is not 0: `start_http_server(port)` at process start. The same port answers `/healthz` (liveness: 200
while the process's event loop turns, 503 once it has not run `beat_forever`'s tick for
`HEALTH.stall_after_s`) and `/readyz` (readiness: 200 after the role called `HEALTH.set_ready()`,
503 with the reason before that and while it shuts down), for Kubernetes probes. Gauges that need a
remote read (router lag from the consumer's `num_pending`; incidents by phase and drains in force from Temporal
visibility) are refreshed every `metrics.poll_interval_s` by `poll_router_lag` / `poll_incidents`.

Every metric, with its type, labels and help, is listed in `docs/metrics.md`, generated from the
metric objects below and `SET_BY` (`python -m fleetmend.dev.refdocs docs`).

The fleet-level gauges (incidents, drains in force, breaker, drain queue and permits, time between
incidents; the router's lag) are published by one elected replica per cluster (per consumer for
the lag), so sums over replicas count the fleet once. The election is a lease in the JetStream KV
bucket `fleetmend_leases` (`fleetmend/infra/fleetgauges.py`): a dead publisher is replaced within
30-40 s, a stopped one at once; `fleetmend_fleet_gauges_publisher` summed over replicas is 1 per
cluster (0: nobody publishes, an alert).

Among the metrics: time to quarantine (fault observed → drained), MTTR (drained → returned) and the
time between a node's incidents (previous closed → next opened, observed by the worker's poller).
The Grafana dashboard is `deploy/grafana/fleetmend.json`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import datetime, timezone
from socketserver import ThreadingMixIn
from typing import Any, Callable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

# Seconds from a fault to a quarantined node: probes see it in < 1 s, routing < 1 s, a Slurm drain
# ~1 s, a Kubernetes drain minutes (evictions); the buckets span both.
QUARANTINE_BUCKETS_S = (1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
# Repair takes hours (reset, reboot) to weeks (RMA).
MTTR_BUCKETS_S = (600, 1800, 3600, 4 * 3600, 12 * 3600, 86400, 3 * 86400, 7 * 86400, 14 * 86400, 30 * 86400)
ACCEPT_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300)

DEADLETTER_REASONS = ("bad_subject", "oversized", "not_utf8", "not_json", "not_object", "invalid_event",
                      "node_mismatch", "temporal_rejected", "max_deliveries", "router_error", "other")
"""The `reason` label of dead letters: the router's free-text reason mapped onto this closed set."""

_EVENT_LABELS = ("cluster", "source", "component", "kind", "severity")

AGENT_EVENTS = Counter("fleetmend_agent_events", "Fault events emitted by the agent's probes.", _EVENT_LABELS)
AGENT_SPOOL_DEPTH = Gauge("fleetmend_agent_spool_depth", "Events waiting in the agent's on-disk spool.",
                          ["cluster"])
AGENT_FAULTS_LOST = Counter("fleetmend_agent_faults_lost", "Fault events the agent could not keep (neither "
                            "published nor spooled), by reason.", ["cluster", "reason"])
ROUTER_EVENTS = Counter("fleetmend_router_events", "Valid fault events the router received.", _EVENT_LABELS)
ROUTER_DEADLETTERS = Counter("fleetmend_router_deadletters", "Messages dead-lettered by the router.", ["reason"])
ANALYZER_ACTIVE = Gauge("fleetmend_analyzer_active", "1 while this analyzer replica holds its cluster's lease.",
                        ["cluster"])
ANALYZER_SMALL_GROUPS = Gauge("fleetmend_analyzer_small_groups", "Hardware-group/metric pairs with too few "
                              "comparable nodes to judge in the last window.", ["cluster"])
ANALYZER_FAIL_SLOW = Counter("fleetmend_analyzer_fail_slow", "fail_slow events the analyzer published.",
                             ["cluster", "metric"])
ROUTER_NAKS = Counter("fleetmend_router_naks", "Messages nak'ed for redelivery (Temporal away or slow).")
ROUTER_LAG = Gauge("fleetmend_router_lag_messages", "Messages not yet delivered to the router consumer.",
                   ["stream", "consumer"])
ROUTER_ACCEPT = Histogram("fleetmend_router_accept_seconds",
                          "Fault observed_at → Temporal accepted the signal-with-start.", ["cluster"],
                          buckets=ACCEPT_BUCKETS_S)
AGENTS_SILENT = Gauge("fleetmend_agents_silent", "Nodes whose agent sent no heartbeat for heartbeat_silence_s.",
                      ["cluster"])
INCIDENTS = Gauge("fleetmend_incidents", "Open NodeRemediation incidents by phase.", ["cluster", "phase"])
DRAINS_IN_FORCE = Gauge("fleetmend_drains_in_force", "Nodes drained by open incidents.", ["cluster"])
BREAKER_OPEN = Gauge("fleetmend_breaker_open", "1 while the cluster's drain breaker is open.", ["cluster"])
DRAIN_QUEUE = Gauge("fleetmend_drain_queue", "Drain requests waiting for a FleetGuard permit.", ["cluster"])
DRAIN_PERMITS_HELD = Gauge("fleetmend_drain_permits_held", "FleetGuard drain permits held.", ["cluster"])
DRAINS = Counter("fleetmend_drains", "drain_node results.", ["cluster", "scheduler", "outcome"])
UNDRAINS = Counter("fleetmend_undrains", "undrain_node results.", ["cluster", "scheduler", "outcome"])
TIME_TO_QUARANTINE = Histogram("fleetmend_time_to_quarantine_seconds", "Fault observed_at → node drained.",
                               ["cluster"], buckets=QUARANTINE_BUCKETS_S)
MTTR = Histogram("fleetmend_mttr_seconds", "Node drained → returned to service.", ["cluster"],
                 buckets=MTTR_BUCKETS_S)
TICKETS = Counter("fleetmend_tickets", "Ticket operations.", ["filer", "outcome"])
TIME_BETWEEN_INCIDENTS = Histogram(
    "fleetmend_time_between_incidents_seconds",
    "Per node: previous incident closed → next incident opened (MTBF-style; the node is not a label).",
    ["cluster"], buckets=MTTR_BUCKETS_S)

LEDGER_WRITE_FAILURES = Counter("fleetmend_ledger_write_failures", "Incident-ledger writes that failed (logged; the "
                                "drain, diagnostics or ticket went on), by phase.", ["phase"])
_REPORT_WINDOW = " Over the last ledger.findings_window_days, refreshed every ledger.refresh_s."
REPORT_GPU_HOURS = Gauge("fleetmend_report_gpu_hours", "GPU-hours out of service (fleetmend report): GPUs × hours from "
                         "the drain to the return, clipped to the window; `by` is fault_class, rack, hw_class or "
                         "version:<key>, `group` its value." + _REPORT_WINDOW, ["cluster", "by", "group"])
REPORT_FIGURE = Gauge("fleetmend_report_figure", "A figure of fleetmend report: mttr_h, time_to_detect_s, "
                      "time_to_drain_s, ticket_turnaround_h (means), false_drain_rate, lemon_nodes, "
                      "parts_not_replaced, slowness_gpu_hours, version_findings, gpu_hours (docs/compute-lost.md "
                      "says how each is computed)." + _REPORT_WINDOW, ["cluster", "figure"])
_report_series: dict[str, set[tuple[str, ...]]] = {}


def export_report(cluster: str, report: dict[str, Any]) -> None:
    """Set the report gauges of `cluster` from `fleetmend.report.build_report`'s dict (series no longer in it are
    removed)."""
    old = _report_series.pop(cluster, set())
    now: set[tuple[str, ...]] = set()
    groups = [(by, report.get(f"gpu_hours_by_{by}") or {}) for by in ("fault_class", "rack", "hw_class")]
    groups += [(f"version:{k}", v) for k, v in (report.get("gpu_hours_by_version") or {}).items()]
    for by, values in groups:
        for group, h in values.items():
            REPORT_GPU_HOURS.labels(cluster=cluster, by=by, group=group).set(h)
            now.add(("g", by, group))
    figures = {"gpu_hours": report.get("gpu_hours"), "false_drain_rate": report.get("false_drain_rate"),
               "lemon_nodes": len(report.get("lemons") or []),
               "parts_not_replaced": len(report.get("parts_not_replaced") or []),
               "slowness_gpu_hours": report.get("slowness_gpu_hours"),
               "version_findings": len(report.get("findings") or [])}
    for name in ("mttr_h", "time_to_detect_s", "time_to_drain_s", "ticket_turnaround_h"):
        figures[name] = (report.get(name) or {}).get("mean")
    for name, value in figures.items():
        if value is not None:
            REPORT_FIGURE.labels(cluster=cluster, figure=name).set(float(value))
            now.add(("f", name))
    _remove_report_series(cluster, old - now)
    _report_series[cluster] = now


def forget_report(cluster: str) -> None:
    """Remove `cluster`'s report gauges (this replica no longer publishes them)."""
    _remove_report_series(cluster, _report_series.pop(cluster, set()))


def _remove_report_series(cluster: str, series_set: set[tuple[str, ...]]) -> None:
    """Drop these report gauge series of `cluster` (("g", fault class, dimension) or ("f", figure))."""
    for series in series_set:
        try:
            if series[0] == "g":
                REPORT_GPU_HOURS.remove(cluster, series[1], series[2])
            else:
                REPORT_FIGURE.remove(cluster, series[1])
        except KeyError:
            pass


SET_BY: dict[str, str] = {
    "fleetmend_agent_events_total": "agent (each event a probe emits)",
    "fleetmend_agent_spool_depth": "agent (read at scrape time)",
    "fleetmend_agent_faults_lost_total": ("agent: events it could not keep (`spool_full`, errno name such as "
                                          "`ENOSPC`/`EROFS`, `refused`)"),
    "fleetmend_router_events_total": "router (valid events)",
    "fleetmend_router_deadletters_total": "router",
    "fleetmend_router_naks_total": "router (Temporal away)",
    "fleetmend_router_lag_messages": "router (consumer num_pending)",
    "fleetmend_router_accept_seconds": "router: observed_at → signal-with-start accepted",
    "fleetmend_agents_silent": "router heartbeat monitor: nodes whose agent is silent now",
    "fleetmend_incidents": "worker (visibility)",
    "fleetmend_drains_in_force": "worker (visibility: FleetDrained)",
    "fleetmend_breaker_open": "worker (FleetGuard `status` query; 1 open / 0 closed)",
    "fleetmend_drain_queue": "worker (FleetGuard `status`)",
    "fleetmend_drain_permits_held": "worker (FleetGuard `status`)",
    "fleetmend_drains_total": "drain activity",
    "fleetmend_undrains_total": "undrain activity",
    "fleetmend_time_to_quarantine_seconds": "drain activity: observed_at → drained",
    "fleetmend_mttr_seconds": "undrain activity: drained_at → returned",
    "fleetmend_time_between_incidents_seconds": "worker poller: a node's previous incident closed → next opened",
    "fleetmend_tickets_total": "ticket activities",
    "fleetmend_ledger_write_failures_total": "router and activities: incident-ledger writes that failed",
    "fleetmend_report_gpu_hours": "worker's elected replica: `fleetmend report` over the ledger, every ledger.refresh_s",
    "fleetmend_report_figure": "worker's elected replica: `fleetmend report` over the ledger, every ledger.refresh_s",
    "fleetmend_analyzer_active": "analyzer (1 while this replica holds the lease)",
    "fleetmend_analyzer_small_groups": "analyzer: (group, metric) pairs too small to judge, last window",
    "fleetmend_analyzer_fail_slow_total": "analyzer: fail_slow events published",
    "fleetmend_fleet_gauges_publisher": ("every worker/router replica: 1 on the one elected to publish the "
                                         "fleet-level gauges (`fleetmend/infra/fleetgauges.py`)"),
}
"""Exposed metric name → the process (and code path) that sets it: the "set by" column of `docs/metrics.md`."""


class Health:
    """Liveness and readiness of this process, answered at `/healthz` and `/readyz` (thread-safe).

    Liveness fails (503) only when `beat_forever` runs and its last tick is older than
    `stall_after_s` seconds: the event loop is blocked, a restart helps. Readiness is what the role
    declares: `set_ready(True)` once connected and serving, `set_ready(False, reason)` on shutdown.
    """

    def __init__(self, stall_after_s: float = 60.0) -> None:
        self.stall_after_s = stall_after_s
        self._lock = threading.Lock()
        self._ready = False
        self._reason = "starting"
        self._last_beat: float | None = None

    def set_ready(self, ready: bool = True, reason: str = "") -> None:
        with self._lock:
            self._ready, self._reason = ready, ("" if ready else reason or "not ready")

    def beat(self) -> None:
        with self._lock:
            self._last_beat = time.monotonic()

    def live(self) -> tuple[bool, str]:
        """(alive, reason)."""
        with self._lock:
            if self._last_beat is None:
                return True, "ok"
            age = time.monotonic() - self._last_beat
        if age > self.stall_after_s:
            return False, f"event loop stalled: last tick {age:.0f} s ago (limit {self.stall_after_s:.0f} s)"
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        """(ready, reason)."""
        with self._lock:
            return self._ready, "ok" if self._ready else self._reason


HEALTH = Health()
"""This process's health, served by `start_http_server`."""


async def beat_forever(stop: asyncio.Event, interval_s: float = 1.0, health: Health = HEALTH) -> None:
    """Tick `health` every `interval_s` from the event loop until `stop` (liveness source)."""
    while not stop.is_set():
        health.beat()
        try:
            async with asyncio.timeout(interval_s):
                await stop.wait()
        except TimeoutError:
            pass


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def health_app(registry: CollectorRegistry = REGISTRY, health: Health = HEALTH) -> Callable[..., Any]:
    """WSGI app: `/healthz`, `/readyz` (text, 200 or 503), anything else `/metrics` (prometheus)."""
    metrics_app = make_wsgi_app(registry)

    def app(environ: dict, start_response: Callable[..., Any]) -> list[bytes]:
        path = environ.get("PATH_INFO", "")
        if path in ("/healthz", "/readyz"):
            ok, why = (health.live if path == "/healthz" else health.ready)()
            start_response("200 OK" if ok else "503 Service Unavailable",
                           [("Content-Type", "text/plain; charset=utf-8")])
            return [(why + "\n").encode()]
        return metrics_app(environ, start_response)

    return app


def start_http_server(port: int, host: str = "0.0.0.0", registry: CollectorRegistry = REGISTRY,
                      health: Health = HEALTH) -> Any:
    """Serve `/metrics`, `/healthz` and `/readyz` on `host:port` in a daemon thread; port 0 does nothing.

    Returns:
        The server (its `server_port` is the bound port), or None when `port` is 0.
    Raises:
        OSError: the port is taken (the message names it).
    """
    if not port:
        return None
    try:
        server = make_server(host, port, health_app(registry, health), _Server, handler_class=_QuietHandler)
    except OSError as err:
        raise OSError(err.errno, f"metrics port {host}:{port} unavailable ({err.strerror}); "
                                 "set metrics.<process>_port / --metrics-port, or 0 to disable") from err
    threading.Thread(target=server.serve_forever, name=f"metrics:{port}", daemon=True).start()
    return server


def _ev_labels(ev: Any) -> dict[str, str]:
    def v(x: Any) -> str:
        return str(getattr(x, "value", x) or "")
    return {"cluster": ev.cluster, "source": v(ev.source), "component": v(ev.component), "kind": v(ev.kind),
            "severity": v(ev.severity)}


def agent_event(ev: Any) -> None:
    AGENT_EVENTS.labels(**_ev_labels(ev)).inc()


def counting_emit(emit: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Wrap the agent's `emit(event)` so every event a probe yields is counted."""

    async def wrapped(ev: Any) -> Any:
        agent_event(ev)
        return await emit(ev)

    return wrapped


def watch_spool(cluster: str, spool: Any) -> None:
    """The spool-depth gauge reads `spool.depth` at scrape time (no polling)."""
    AGENT_SPOOL_DEPTH.labels(cluster=cluster).set_function(lambda: spool.depth)


def router_event(ev: Any) -> None:
    ROUTER_EVENTS.labels(**_ev_labels(ev)).inc()


def router_accepted(ev: Any) -> None:
    """observed_at → now, when Temporal accepted the signal carrying `ev`."""
    obs = getattr(ev, "observed_at", None)
    if obs is not None:
        ROUTER_ACCEPT.labels(cluster=ev.cluster).observe(max(0.0, _age_s(obs)))


def deadletter_reason(reason: str) -> str:
    """Map the router's free-text reason onto `DEADLETTER_REASONS`."""
    r = reason.lower()
    for needle, key in (("oversized", "oversized"), ("not utf-8", "not_utf8"), ("not json", "not_json"),
                        ("not a json object", "not_object"), ("invalid faultevent", "invalid_event"),
                        ("arrived on the subject", "node_mismatch"), ("not accepted by temporal", "temporal_rejected"),
                        ("max deliveries", "max_deliveries"), ("router error", "router_error"),
                        ("classification failed", "router_error"), ("subject", "bad_subject")):
        if needle in r:
            return key
    return "other"


def deadlettered(reason: str) -> None:
    ROUTER_DEADLETTERS.labels(reason=deadletter_reason(reason)).inc()


def _age_s(at: datetime) -> float:
    if at.tzinfo is None:
        at = at.replace(tzinfo=timezone.utc)
    return (datetime.now(timezone.utc) - at).total_seconds()


def drain_result(cluster: str, scheduler: str, result: Any, observed_at: datetime | None = None) -> None:
    """Count a drain by outcome (owned, operator, none); observe time to quarantine when given."""
    outcome = "owned" if result.owned else "operator" if result.operator_drained else \
        "drained" if result.drained else "none"
    DRAINS.labels(cluster=cluster, scheduler=scheduler, outcome=outcome).inc()
    if observed_at is not None and result.drained and result.owned:
        TIME_TO_QUARANTINE.labels(cluster=cluster).observe(max(0.0, _age_s(observed_at)))


def undrain_result(cluster: str, scheduler: str, result: Any, drained_at: datetime | None = None) -> None:
    outcome = "resumed" if result.resumed else "operator" if result.operator_drained else "none"
    UNDRAINS.labels(cluster=cluster, scheduler=scheduler, outcome=outcome).inc()
    if drained_at is not None and result.resumed:
        MTTR.labels(cluster=cluster).observe(max(0.0, _age_s(drained_at)))


def set_breaker(cluster: str, is_open: bool) -> None:
    """For FleetGuard (or whoever reads its state): 1 while automatic drains are stopped."""
    BREAKER_OPEN.labels(cluster=cluster).set(1 if is_open else 0)


async def refresh_router_lag(js: Any, stream: str, consumer: str) -> int:
    """Read the durable consumer's `num_pending` (+ un-acked) into the lag gauge. Returns it."""
    info = await js.consumer_info(stream, consumer)
    lag = int(info.num_pending or 0)
    ROUTER_LAG.labels(stream=stream, consumer=consumer).set(lag)
    return lag


async def refresh_incidents(client: Any, cluster: str, limit: int = 10_000) -> dict[str, int]:
    """Count running NodeRemediation workflows of `cluster` by FleetPhase and FleetDrained.

    One visibility list per refresh (bounded by `limit`); phases that went to zero are reset.
    Returns:
        phase → count.
    """
    query = (f"WorkflowType='NodeRemediation' AND ExecutionStatus='Running' AND FleetCluster='{cluster}'")
    counts: dict[str, int] = {}
    drained = 0
    async for wf in client.list_workflows(query, limit=limit):
        sa = {p.key.name: p.value for p in wf.typed_search_attributes}
        phase = str(sa.get("FleetPhase") or "unknown")
        counts[phase] = counts.get(phase, 0) + 1
        drained += 1 if sa.get("FleetDrained") else 0
    for (c, phase), _ in list(_known_phases.items()):
        if c == cluster and phase not in counts:
            INCIDENTS.labels(cluster=cluster, phase=phase).set(0)
    for phase, n in counts.items():
        INCIDENTS.labels(cluster=cluster, phase=phase).set(n)
        _known_phases[(cluster, phase)] = n
    DRAINS_IN_FORCE.labels(cluster=cluster).set(drained)
    await refresh_guard(client, cluster)
    return counts


async def observe_new_incidents(client: Any, cluster: str, since: datetime, until: datetime | None = None,
                                limit: int = 1000) -> int:
    """For each NodeRemediation run of `cluster` started in (`since`, `until`], observe the time since the
    same node's previous run closed (`fleetmend_time_between_incidents_seconds`).

    One visibility list for the new runs plus one per new run for its predecessor.
    Returns:
        How many were observed (first incidents of a node have no predecessor).
    """
    window = f"StartTime > '{since.astimezone(timezone.utc).isoformat()}'"
    if until is not None:
        window += f" AND StartTime <= '{until.astimezone(timezone.utc).isoformat()}'"
    new = [wf async for wf in client.list_workflows(
        f"WorkflowType='NodeRemediation' AND FleetCluster='{cluster}' AND {window}", limit=limit)]
    seen = 0
    for wf in new:
        prev = [p async for p in client.list_workflows(
            f"WorkflowId='{wf.id}' AND CloseTime < '{wf.start_time.astimezone(timezone.utc).isoformat()}'",
            limit=50)]
        closed = [p.close_time for p in prev if p.close_time is not None and p.run_id != wf.run_id]
        if closed:
            TIME_BETWEEN_INCIDENTS.labels(cluster=cluster).observe(
                max(0.0, (wf.start_time - max(closed)).total_seconds()))
            seen += 1
    return seen


class IncidentWatcher:
    """`refresh()` for the worker's poller: incident gauges, FleetGuard gauges and the time between
    a node's incidents, remembering where the last refresh left off."""

    def __init__(self, client: Any, cluster: str) -> None:
        self.client, self.cluster = client, cluster
        self.since = datetime.now(timezone.utc)

    async def refresh(self) -> None:
        now = datetime.now(timezone.utc)
        await refresh_incidents(self.client, self.cluster)
        await observe_new_incidents(self.client, self.cluster, self.since, until=now)
        self.since = now  # each run is observed once: windows (since, now] do not overlap


async def refresh_guard(client: Any, cluster: str) -> bool | None:
    """Breaker and drain-queue gauges from the cluster's FleetGuard `status` query.

    Returns:
        Whether the breaker is open; None when the cluster has no FleetGuard yet (gauges untouched).
    """
    from temporalio.service import RPCError

    from fleetmend.subjects import fleetguard_workflow_id

    try:
        st = await client.get_workflow_handle(fleetguard_workflow_id(cluster)).query("status")
    except RPCError as err:
        if "not found" in str(err).lower():
            return None
        raise
    get = st.get if isinstance(st, dict) else lambda k, d=None: getattr(st, k, d)
    is_open = bool(get("breaker_tripped", False))
    set_breaker(cluster, is_open)
    DRAIN_QUEUE.labels(cluster=cluster).set(len(get("queue", []) or []))
    DRAIN_PERMITS_HELD.labels(cluster=cluster).set(len(get("held", []) or []))
    return is_open


_known_phases: dict[tuple[str, str], int] = {}


async def poll_forever(refresh: Callable[[], Any], interval_s: float, stop: asyncio.Event, log: Any,
                       what: str) -> None:
    """Call `refresh()` every `interval_s` until `stop`; failures are logged (rate: once per failure
    streak) and retried next interval, never fatal to the process."""
    failing = False
    while not stop.is_set():
        try:
            await refresh()
            failing = False
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - a metrics read must never take the process down
            if not failing:
                log.warning("metrics_refresh_failed", what=what, error=repr(err))
            failing = True
        try:
            async with asyncio.timeout(interval_s):
                await stop.wait()
        except TimeoutError:
            pass
