"""The agent's Prometheus metrics and health endpoints, only when they are served.

`serve(port, host)` with a port (`metrics.agent_port`, `--metrics-port`) imports `fleetmend.infra.metrics`
(and with it `prometheus_client`, `wsgiref`, `http.server`: ~1.1 MiB of the agent's RSS, bench/agent_memory.py)
and serves `/metrics`, `/healthz` and `/readyz` there. Without a port nothing of it is imported and nothing is
counted: nobody could read it. The same counters (`fleetmend_agent_events`, `fleetmend_agent_spool_depth`,
`fleetmend_agent_faults_lost`) are `fleetmend.infra.metrics`'s either way; lost faults are also in the log
(`fault_lost`) and every heartbeat.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import ModuleType
from typing import Any

_m: ModuleType | None = None
"""`fleetmend.infra.metrics` once `serve` was given a port; None: metrics off."""


def serve(port: int, host: str) -> None:
    """Serve `/metrics`, `/healthz` and `/readyz` on `host:port` (0: off, nothing imported).

    Raises:
        OSError: the port is taken (the message names it).
    """
    global _m
    if not port:
        return
    from fleetmend.infra import metrics

    metrics.start_http_server(port, host)
    _m = metrics


def served() -> bool:
    return _m is not None


def watch_spool(cluster: str, spool: Any) -> None:
    """`fleetmend_agent_spool_depth` reads `spool.depth` at scrape time."""
    if _m is not None:
        _m.watch_spool(cluster, spool)


def counting_emit(emit: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`emit` counting every event in `fleetmend_agent_events` (served), or `emit` itself."""
    return emit if _m is None else _m.counting_emit(emit)


def fault_lost(cluster: str, reason: str) -> None:
    """Count a fault the agent could neither publish nor spool (`fleetmend_agent_faults_lost`)."""
    if _m is not None:
        _m.AGENT_FAULTS_LOST.labels(cluster=cluster, reason=reason).inc()


def set_ready(ready: bool = True, reason: str = "") -> None:
    """`/readyz`: ready, or not with `reason`."""
    if _m is not None:
        _m.HEALTH.set_ready(ready, reason)


async def beat_forever(stop: asyncio.Event) -> None:
    """`/healthz`'s liveness tick from the event loop until `stop` (served), else wait for `stop`."""
    if _m is not None:
        await _m.beat_forever(stop)
    else:
        await stop.wait()
