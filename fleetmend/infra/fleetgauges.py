"""Fleet-level gauges published once per cluster, by one elected replica.

Incidents by phase, drains in force, breaker and drain queue (and the time-between-incidents
histogram) describe the whole cluster; the consumer lag describes the one durable consumer every
router replica shares. If every replica exported them, a dashboard summing over instances would
count the fleet once per replica. So one replica per (role, scope) holds a lease in a JetStream KV
bucket (`fleetmend.infra.lease`) and publishes; the others keep the lease warm and publish nothing. A
replica that loses the lease removes the series it exported, so no stale copy lingers.

`fleetmend_fleet_gauges_publisher{role, scope}` is 1 on the publisher and 0 elsewhere: summed over
replicas it is 1 per cluster (0 means no replica publishes: an alert).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

from prometheus_client import Gauge

from fleetmend.infra import metrics
from fleetmend.infra.lease import DEFAULT_TTL_S, KvLease, default_holder, lease_bucket, lease_key

PUBLISHER = Gauge("fleetmend_fleet_gauges_publisher",
                  "1 on the replica elected to publish the fleet-level gauges of (role, scope), else 0.",
                  ["role", "scope"])

ROLE_INCIDENTS = "incident-poller"
"""Worker role: incidents by phase, drains in force, breaker, drain queue, time between incidents."""
ROLE_ROUTER_LAG = "router-lag"
"""Router role: the durable consumer's lag."""


def _remove(gauge: Any, *labels: str) -> None:
    try:
        gauge.remove(*labels)
    except KeyError:
        pass


def forget_cluster_gauges(cluster: str) -> None:
    """Remove the cluster's incident and FleetGuard series from this process's /metrics."""
    for (c, phase) in list(metrics._known_phases):
        if c == cluster:
            _remove(metrics.INCIDENTS, cluster, phase)
            metrics._known_phases.pop((c, phase), None)
    for g in (metrics.DRAINS_IN_FORCE, metrics.BREAKER_OPEN, metrics.DRAIN_QUEUE, metrics.DRAIN_PERMITS_HELD):
        _remove(g, cluster)


def forget_router_lag(stream: str, consumer: str) -> None:
    _remove(metrics.ROUTER_LAG, stream, consumer)


async def run_elected(js: Any, role: str, scope: str, refresh: Callable[[], Awaitable[Any]],
                      forget: Callable[[], None], interval_s: float, stop: asyncio.Event, log: Any, *,
                      on_elected: Callable[[], None] | None = None, ttl_s: float = DEFAULT_TTL_S,
                      holder: str | None = None, state: dict[str, bool] | None = None) -> None:
    """Contend for the (role, scope) lease until `stop`; while held, `refresh()` every `interval_s`.

    Losing the lease (or stopping) calls `forget()`; winning it calls `on_elected()` first; `state["held"]`
    (when given) says whether this replica publishes now, for gauges set elsewhere. The lease
    is renewed every `ttl_s / 3`. NATS or refresh failures are logged once per streak, never fatal.
    On stop the lease is released, so another replica takes over at its next tick.
    """
    lease: KvLease | None = None
    held = False
    next_refresh = 0.0
    failing = {"lease": False, "refresh": False}

    def fail(what: str, err: BaseException) -> None:
        if not failing[what]:
            log.warning("fleet_gauges_failed", what=what, role=role, scope=scope, error=repr(err))
        failing[what] = True

    try:
        while not stop.is_set():
            try:
                if lease is None:
                    lease = KvLease(await lease_bucket(js, ttl_s=ttl_s), lease_key(role, scope),
                                    holder or default_holder(), ttl_s)
                await lease.tick()
                failing["lease"] = False
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - NATS away: the lease's own expiry decides
                fail("lease", err)
            now_held = lease is not None and lease.held
            if now_held and not held:
                log.info("fleet_gauges_elected", role=role, scope=scope)
                if on_elected is not None:
                    on_elected()
                next_refresh = 0.0
            elif held and not now_held:
                log.info("fleet_gauges_handed_over", role=role, scope=scope)
                forget()
            held = now_held
            if state is not None:
                state["held"] = held
            PUBLISHER.labels(role=role, scope=scope).set(1 if held else 0)
            if held and time.monotonic() >= next_refresh:
                next_refresh = time.monotonic() + interval_s
                try:
                    await refresh()
                    failing["refresh"] = False
                except asyncio.CancelledError:
                    raise
                except Exception as err:  # noqa: BLE001 - a metrics read must never take the process down
                    fail("refresh", err)
            try:
                async with asyncio.timeout(min(ttl_s / 3, interval_s)):
                    await stop.wait()
            except TimeoutError:
                pass
    finally:
        if held:
            forget()
        PUBLISHER.labels(role=role, scope=scope).set(0)
        if lease is not None:
            try:
                async with asyncio.timeout(5):
                    await lease.release()
            except Exception:  # noqa: BLE001 - NATS gone at shutdown: the lease expires by itself
                pass
