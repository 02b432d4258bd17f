"""The router: durable JetStream pull consumer → validate → classify → coalesce → signal-with-start.

Guarantees:
- A message is acked only after Temporal accepted the signal-with-start that carries it.
- A message that can never be valid (not UTF-8, not JSON, wrong schema, oversized, node ≠ subject)
  is written to `fleet.deadletter` with its reason and then `term()`ed. If the dead-letter write
  itself fails, the message is nak'ed and retried: nothing accepted is dropped.
- While Temporal is away, messages are nak'ed with a delay and come back; after `max_deliver`
  deliveries they are dead-lettered (reason: the last error) instead of vanishing silently.
- Events of one node keep their order: at most one signal per node in flight, events queued
  behind it go together in the next signal (a nak'ed event comes back behind newer ones; the
  workflow orders by nothing but arrival and dedupes by event id).
- Repeats of one condition (same `ConditionKey` and `healthy`) queued for a node are
  collapsed into one `RoutedFault` carrying every occurrence's id and time, ordered by the latest
  occurrence, so a flapping link's storm costs Temporal ids, not copies of the same text.
- Up to `router.max_unacked` messages are held un-acked while they wait for their node's turn (a
  deep backlog then fills each signal with many events); a message held past half of `ack_wait_s`
  is marked in progress so JetStream does not redeliver it while it waits.
- Any number of router replicas share the durable consumer.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import structlog
from pydantic import ValidationError

from fleetmend import metrics, subjects
from fleetmend.config import Settings
from fleetmend.errors import InvalidEventError
from fleetmend.events import FaultEvent, condition_key
from fleetmend.messages import (
    KEY_CLUSTER, KEY_NODE, KEY_PHASE, FaultBatch, IncidentInput, IncidentPolicy, Occurrence, Phase, RemediationApi,
    RoutedFault,
)

log = structlog.get_logger("fleetmend.router")

MAX_EVENT_BYTES = 64 * 1024
"""Largest fault message accepted (bytes). Events carry at most 16 KiB of raw text (events.MAX_RAW_BYTES)."""


@dataclass
class RouterStats:
    received: int = 0
    routed: int = 0
    signals: int = 0
    deadlettered: int = 0
    naks: int = 0
    deadletter_reasons: dict[str, int] = field(default_factory=dict)


def decode_event(subject: str, data: bytes) -> FaultEvent:
    """Validate one wire message.

    Returns:
        The `FaultEvent`.
    Raises:
        InvalidEventError: with a reason an operator can act on (never retried).
    """
    try:
        cluster, node = subjects.parse_fault_subject(subject)
    except ValueError as err:
        raise InvalidEventError(str(err), subject=subject) from err
    if len(data) > MAX_EVENT_BYTES:
        raise InvalidEventError(f"oversized: {len(data)} bytes > {MAX_EVENT_BYTES}", subject=subject)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InvalidEventError(f"not UTF-8 at byte {err.start}", subject=subject) from err
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise InvalidEventError(f"not JSON: {err.msg} at line {err.lineno} column {err.colno}",
                                subject=subject) from err
    if not isinstance(obj, dict):
        raise InvalidEventError(f"not a JSON object but {type(obj).__name__}", subject=subject)
    try:
        ev = FaultEvent.model_validate(obj)
    except ValidationError as err:
        parts = [f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}" for e in err.errors()[:5]]
        raise InvalidEventError("invalid FaultEvent: " + "; ".join(parts), subject=subject) from err
    if ev.cluster != cluster or ev.node != node:
        raise InvalidEventError(
            f"event names {ev.cluster}/{ev.node} but arrived on the subject of {cluster}/{node}", subject=subject)
    return ev


class Router:
    """One router replica. `await Router(...).run(stop)` until `stop` is set.

    Args:
        settings: `Settings` (router section, policy, task queue).
        nc, js: connected NATS client and its JetStream context.
        client: connected `temporalio.client.Client` (pydantic data converter).
        catalog: `fleetmend.catalog.Catalog` used to classify each event.
        filter_subject: which fault subjects to consume (default every cluster).
        durable: durable consumer name (replicas share it).
    """

    def __init__(self, settings: Settings, nc, js, client, catalog, *,  # noqa: ANN001
                 filter_subject: str | None = None, durable: str = subjects.ROUTER_DURABLE,
                 stream: str = subjects.FAULT_STREAM) -> None:
        self.s = settings
        self.nc, self.js, self.client, self.catalog = nc, js, client, catalog
        self.filter_subject = filter_subject or subjects.all_faults_subject()
        self.durable = durable
        self.stream = stream
        self.stats = RouterStats()
        self._sem = asyncio.Semaphore(settings.router.max_in_flight)
        self._queued: dict[tuple[str, str], list[tuple[Any, FaultEvent, float]]] = {}
        self._senders: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._held = 0
        self._max_unacked = max(self.s.router.max_unacked, self.s.router.fetch_batch)
        self._room = asyncio.Event()

    async def setup(self):  # noqa: ANN201
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        from fleetmend.jetstream import ensure_deadletter_stream, ensure_fault_stream

        await ensure_fault_stream(self.js, self.s)
        await ensure_deadletter_stream(self.js, self.s)
        cfg = ConsumerConfig(durable_name=self.durable, ack_policy=AckPolicy.EXPLICIT,
                             deliver_policy=DeliverPolicy.ALL, ack_wait=self.s.router.ack_wait_s,
                             max_deliver=self.s.router.max_deliver, filter_subject=self.filter_subject,
                             max_ack_pending=self._max_unacked + self.s.router.fetch_batch)
        return await self.js.pull_subscribe(self.filter_subject, durable=self.durable, stream=self.stream,
                                            config=cfg)

    async def run(self, stop: asyncio.Event) -> None:
        """Fetch continuously into per-node queues; each node has at most one signal in flight.

        Events of a node that arrive while its signal is in flight are sent together in the next
        call (coalescing: the deeper the backlog, the more
        events per Temporal call). At most `max_unacked` messages are held un-acked.
        """
        from nats.errors import TimeoutError as NatsTimeout

        psub = await self.setup()
        log.info("router_started", durable=self.durable, filter=self.filter_subject, task_queue=self.s.task_queue)
        while not stop.is_set():
            if self._held >= self._max_unacked:
                self._room.clear()
                try:
                    await asyncio.wait_for(self._room.wait(), timeout=1.0)
                except asyncio.TimeoutError:
                    pass
                continue
            try:
                msgs = await psub.fetch(min(self.s.router.fetch_batch, self._max_unacked - self._held), timeout=1.0)
            except (NatsTimeout, asyncio.TimeoutError):
                continue  # idle, not a failure (nats-io/nats.py#418)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - connection trouble: log, back off, go on
                log.warning("fetch_failed", error=repr(err))
                await asyncio.sleep(1.0)
                continue
            await self.handle_batch(msgs)
        if self._senders:
            log.info("router_finishing", nodes_in_flight=len(self._senders))
            await asyncio.gather(*self._senders.values(), return_exceptions=True)
        log.info("router_stopped", **self.stats.__dict__)

    async def handle_batch(self, msgs: list) -> None:  # noqa: ANN001
        """Validate a fetched batch, dead-letter the invalid, queue the rest per node."""
        for msg in msgs:
            self.stats.received += 1
            try:
                ev = decode_event(msg.subject, msg.data)
            except InvalidEventError as err:
                await self.deadletter(msg, err.reason)
                continue
            metrics.router_event(ev)
            key = (ev.cluster, ev.node)
            self._queued.setdefault(key, []).append((msg, ev, time.monotonic()))
            self._held += 1
            if key not in self._senders:
                self._senders[key] = asyncio.create_task(self._sender(key))

    async def _sender(self, key: tuple[str, str]) -> None:
        """Send a node's queued events, one signal-with-start at a time, until its queue is empty."""
        try:
            while self._queued.get(key):
                items = self._queued.pop(key)
                try:
                    await self._route_node(key[0], key[1], items)
                finally:
                    self._held -= len(items)
                    self._room.set()
        finally:
            self._senders.pop(key, None)

    async def _route_node(self, cluster: str, node: str, items: list[tuple[Any, FaultEvent, float]]) -> None:
        faults = collapse([ev for _msg, ev, _t in items], self.catalog)
        wid = subjects.workflow_id(cluster, node)
        inp = IncidentInput(cluster=cluster, node=node, policy=IncidentPolicy.from_settings(self.s.policy))
        bound = log.bind(workflow_id=wid, node=node, cluster=cluster, events=len(items))
        batch = FaultBatch(faults=faults, routed_at=datetime.now(timezone.utc))
        async with self._sem:
            await self._keep_alive(items)  # after the wait for a slot, right before the call
            try:
                await self._signal_with_start(wid, inp, batch, cluster, node)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - Temporal away or overloaded: retry later, never drop
                await self._retry_later(items, repr(err), bound)
                return
        for msg, _ev, _t in items:
            await msg.ack()
            metrics.router_accepted(_ev)
        self.stats.routed += len(items)
        self.stats.signals += 1
        bound.info("events_routed", kinds=sorted({ev.kind for _m, ev, _t in items}), faults=len(faults))

    async def _keep_alive(self, items: list[tuple[Any, FaultEvent, float]]) -> None:
        """Tell JetStream that messages held past half their ack wait are still being worked on
        (`+WPI`), so a deep backlog is not redelivered while it waits for its node's turn."""
        limit = time.monotonic() - self.s.router.ack_wait_s / 2
        for i, (msg, ev, held_since) in enumerate(items):
            if held_since < limit:
                try:
                    await msg.in_progress()
                except Exception as err:  # noqa: BLE001 - at worst JetStream redelivers; the workflow dedupes
                    log.warning("in_progress_failed", error=repr(err))
                items[i] = (msg, ev, time.monotonic())

    async def _signal_with_start(self, wid: str, inp, batch, cluster: str, node: str) -> None:  # noqa: ANN001
        from temporalio.common import SearchAttributePair, TypedSearchAttributes

        async with asyncio.timeout(self.s.router.temporal_call_timeout_s):
            await self.client.start_workflow(
                RemediationApi.WORKFLOW, inp, id=wid, task_queue=self.s.task_queue,
                start_signal=RemediationApi.FAULTS, start_signal_args=[batch],
                search_attributes=TypedSearchAttributes([
                    SearchAttributePair(KEY_NODE, node), SearchAttributePair(KEY_CLUSTER, cluster),
                    SearchAttributePair(KEY_PHASE, Phase.TRIAGE.value)]),
                static_summary=f"{node} ({cluster}): remediation incident")

    async def _retry_later(self, items: list[tuple[Any, FaultEvent, float]], error: str,
                           bound) -> None:  # noqa: ANN001
        for msg, _ev, _t in items:
            delivered = msg.metadata.num_delivered if msg.metadata else 1
            if delivered >= self.s.router.max_deliver:
                await self.deadletter(msg, f"not accepted by Temporal after {delivered} deliveries: {error}")
            else:
                self.stats.naks += 1
                metrics.ROUTER_NAKS.inc()
                await msg.nak(delay=self.s.router.nak_delay_s * min(delivered, 10))
        bound.warning("temporal_signal_failed", error=error)

    async def deadletter(self, msg, reason: str) -> None:  # noqa: ANN001
        """Write a dead-letter record (original bytes + reason) to `fleet.deadletter`, then term()."""
        md = msg.metadata
        record = {
            "reason": reason,
            "subject": msg.subject,
            "stream_seq": md.sequence.stream if md else None,
            "num_delivered": md.num_delivered if md else None,
            "at": datetime.now(timezone.utc).isoformat(),
            "data_b64": base64.b64encode(msg.data[:MAX_EVENT_BYTES]).decode(),
            "data_bytes": len(msg.data),
        }
        try:
            await self.js.publish(subjects.DEADLETTER_SUBJECT, json.dumps(record).encode(), timeout=5.0)
        except Exception as err:  # noqa: BLE001 - could not record: keep the message, retry later
            log.error("deadletter_write_failed", error=repr(err), reason=reason, subject=msg.subject)
            await msg.nak(delay=self.s.router.nak_delay_s)
            return
        await msg.term()
        self.stats.deadlettered += 1
        metrics.deadlettered(reason)
        key = metrics.deadletter_reason(reason)
        self.stats.deadletter_reasons[key] = self.stats.deadletter_reasons.get(key, 0) + 1
        log.warning("event_deadlettered", reason=reason, subject=msg.subject)


def collapse(events: list[FaultEvent], catalog) -> list[RoutedFault]:  # noqa: ANN001 - Catalog
    """Collapse one node's queued events, oldest first, by condition into `RoutedFault`s.

    Each entry keeps its condition's first event (with the catalog's `Verdict` on it) and lists the
    later ones as `repeats` (id and time); entries are ordered by their *latest* occurrence, so the
    workflow's arrival order still says which of a flapping link's DOWN and UP came last.
    """
    groups: dict[tuple, tuple[RoutedFault, list[int]]] = {}
    for i, ev in enumerate(events):
        key = (condition_key(ev), ev.healthy)
        got = groups.get(key)
        if got is None:
            groups[key] = (RoutedFault(event=ev, verdict=catalog.verdict(ev)), [i])
        else:
            got[0].repeats.append(Occurrence(event_id=ev.event_id, observed_at=ev.observed_at))
            got[1][0] = i
    return [rf for rf, _last in sorted(groups.values(), key=lambda g: g[1][0])]
