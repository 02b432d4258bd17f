"""Monitor of the monitor: a node whose agent stops sending heartbeats becomes a fault.

`HeartbeatMonitor` subscribes to `fleet.*.hb.*` (core NATS: heartbeats are never stored), keeps the
last heartbeat per (cluster, node), and when a node has been silent for `silence_s` publishes an
`agent_silent` `FaultEvent` (component agent, source heartbeat, severity degraded, no drain: a dead
agent is not a bad node) to that node's fault subject in JetStream. When heartbeats return it
publishes the clearing event (same kind, `healthy=True`, `attrs.clearing_kind =
"agent_heartbeat_resumed"`).

Several router replicas run this at once. They must not publish duplicates, so the event id (and
with it the `Nats-Msg-Id`) is derived, not random: from the node and the agent's own timestamp
(`at`) of the last heartbeat before the silence (for `agent_silent`) or of the first heartbeat after
it (for the clearing). Every replica receives the same heartbeat, so every replica computes the same
id and JetStream keeps one copy (within the stream's duplicate window, which is far longer than the
replicas' check skew of `check_interval_s`). The id keeps the time-ordered form of
`fleetmend.events.new_event_id`: 16 hex digits of nanoseconds, then 8 hex digits of a SHA-256.

An agent that stops on purpose (`--once` done, SIGTERM) sends a last heartbeat with `"leaving": true`
and is forgotten (no `agent_silent`: a stopped agent is not a silent one); it is watched again from its
next heartbeat. One that dies sends none and is reported.

What a restart loses: the last-seen table is in memory, so a replica only watches nodes it heard
from since it started; a node that went silent before every replica restarted is not reported
until it sends a heartbeat again (then it is tracked as usual).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import structlog

from fleetmend import __version__
from fleetmend.events import Component, Device, FaultEvent, Severity, Source
from fleetmend.infra import metrics
from fleetmend.subjects import all_heartbeats_subject, fault_subject, msg_id, parse_heartbeat_subject

KIND = "agent_silent"
CLEARING_KIND = "agent_heartbeat_resumed"


@dataclass
class _Node:
    last_seen: float  # monotonic, this replica's receive time
    last_at: datetime  # the agent's own timestamp of its last heartbeat
    agent_version: str
    silent_since: datetime | None = None  # last_at when agent_silent was published


def deterministic_event_id(kind: str, cluster: str, node: str, at: datetime) -> str:
    """Same inputs → same id on every replica: `<ns of at:016x><sha256(kind|cluster|node|at)[:8]>`."""
    ns = int(at.timestamp() * 1_000_000_000)
    digest = hashlib.sha256(f"{kind}|{cluster}|{node}|{at.isoformat()}".encode()).hexdigest()[:8]
    return f"{ns:016x}{digest}"


def _parse_subject(subject: str) -> tuple[str, str] | None:
    """(cluster, node name) of a heartbeat subject (the node token decoded), None for anything else."""
    try:
        return parse_heartbeat_subject(subject)
    except ValueError:
        return None


class HeartbeatMonitor:
    """Args:
        nc: connected nats client; js: its JetStream context (publishes the fault events).
        silence_s: silence after which a node is reported (`RouterSettings.heartbeat_silence_s`).
        check_interval_s: how often the table is checked (default silence_s / 6, at least 0.05 s).
        publish_timeout_s: bound on one JetStream publish; a failed publish is retried next check.
    """

    def __init__(self, nc: Any, js: Any, silence_s: float, check_interval_s: float | None = None,
                 publish_timeout_s: float = 5.0, publish_gauge: Any = None) -> None:
        self.nc, self.js = nc, js
        self.publish_gauge = publish_gauge
        """None (every replica sets the gauge), or a callable: set `fleetmend_agents_silent` only while it
        says True (the router replica elected to publish fleet-level gauges, `fleetmend.infra.fleetgauges`)."""
        self.silence_s = silence_s
        self.check_interval_s = check_interval_s or max(silence_s / 6, 0.05)
        self.publish_timeout_s = publish_timeout_s
        self.nodes: dict[tuple[str, str], _Node] = {}
        self.published: list[FaultEvent] = []
        self._pending: list[FaultEvent] = []
        self._log = structlog.get_logger("fleetmend.router.heartbeats")

    async def _on_heartbeat(self, msg: Any) -> None:
        key = _parse_subject(msg.subject)
        if key is None:
            return
        try:
            hb = json.loads(msg.data)
            at = datetime.fromisoformat(hb["at"]).astimezone(timezone.utc)
            version = str(hb.get("agent_version", "unknown"))
        except (KeyError, TypeError, ValueError):  # JSONDecodeError, UnicodeDecodeError are ValueErrors
            self._log.warning("heartbeat_invalid", subject=msg.subject)
            return
        if hb.get("leaving") is True:  # the agent stops on purpose (`--once` done, SIGTERM): not silent
            if self.nodes.pop(key, None) is not None:
                self._log.info("agent_left", cluster=key[0], node=key[1], agent_version=version)
            return
        node = self.nodes.get(key)
        if node is None:
            self.nodes[key] = _Node(time.monotonic(), at, version)
            return
        node.last_seen, node.last_at, node.agent_version = time.monotonic(), at, version
        if node.silent_since is not None:
            self._pending.append(self._event(key, node, healthy=True))
            node.silent_since = None

    def _event(self, key: tuple[str, str], node: _Node, healthy: bool) -> FaultEvent:
        cluster, name = key
        at = node.last_at
        eid = deterministic_event_id(CLEARING_KIND if healthy else KIND, cluster, name, at)
        if healthy:
            msg = f"agent on {name} sends heartbeats again (agent {node.agent_version})"
        else:
            msg = (f"no heartbeat from the agent on {name} for more than {self.silence_s:g} s "
                   f"(last one sent at {at.isoformat()})")
        return FaultEvent(event_id=eid, cluster=cluster, node=name, component=Component.AGENT,
                          device=Device(name="agent"), kind=KIND, severity=Severity.INFO if healthy else Severity.DEGRADED,
                          healthy=healthy, message=msg, source=Source.HEARTBEAT, raw=msg, agent_version=__version__,
                          attrs={"last_heartbeat_at": at.isoformat(), "silence_s": self.silence_s,
                                 "clearing_kind": CLEARING_KIND if healthy else None})

    def check(self) -> None:
        """Queue an agent_silent event for every node silent longer than `silence_s`; set the
        `fleetmend_agents_silent` gauge of each cluster to its number of silent nodes."""
        now = time.monotonic()
        silent: dict[str, int] = {}
        for key, node in self.nodes.items():
            if node.silent_since is None and now - node.last_seen > self.silence_s:
                node.silent_since = node.last_at
                self._pending.append(self._event(key, node, healthy=False))
            silent[key[0]] = silent.get(key[0], 0) + (node.silent_since is not None)
        if self.publish_gauge is not None and not self.publish_gauge():
            return
        for cluster, n in silent.items():
            metrics.AGENTS_SILENT.labels(cluster=cluster).set(n)

    async def _flush(self) -> None:
        while self._pending:
            ev = self._pending[0]
            try:
                async with asyncio.timeout(self.publish_timeout_s):
                    ack = await self.js.publish(fault_subject(ev.cluster, ev.node), ev.to_json_bytes(),
                                                headers={"Nats-Msg-Id": msg_id(ev.event_id)})
            except Exception as err:  # noqa: BLE001 - JetStream away: keep it queued, retry next check
                self._log.warning("agent_silent_publish_failed", node=ev.node, error=repr(err))
                return
            self._pending.pop(0)
            self.published.append(ev)
            self._log.info("agent_silent_published" if not ev.healthy else "agent_heartbeat_resumed",
                           cluster=ev.cluster, node=ev.node, event_id=ev.event_id,
                           duplicate=bool(getattr(ack, "duplicate", False)))

    async def run(self, stop: asyncio.Event) -> None:
        """Watch heartbeats until `stop` is set."""
        sub = await self.nc.subscribe(all_heartbeats_subject(), cb=self._on_heartbeat)
        self._log.info("heartbeat_monitor_started", silence_s=self.silence_s)
        try:
            while not stop.is_set():
                self.check()
                await self._flush()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.check_interval_s):
                        await stop.wait()
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
