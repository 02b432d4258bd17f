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
- No input can stop the router: any exception while decoding or classifying one message makes
  that message a dead letter with the exception as its reason; the rest of the batch is routed.
  The limits a message must keep are stated in `fleetmend.events` (`MAX_EVENT_BYTES`,
  `MAX_JSON_DEPTH`, `OBSERVED_AT_RANGE`); an `observed_at` more than `MAX_CLOCK_SKEW_S` ahead of the
  receipt time is clamped to it (the agent's value kept in `attrs`).
- A message that reaches the consumer's max deliveries for any reason (a crash loop, a bug) is
  dead-lettered from JetStream's advisory (`subjects.max_deliveries_advisory`), never dropped: every
  replica hears the advisory, and the dead-letter record's `Nats-Msg-Id` (`dl-<stream>-<seq>`)
  keeps one copy.
- Any number of router replicas share the durable consumer.
- Every cluster's incidents start on that cluster's own task queue (`subjects.cluster_task_queue`, derived in
  `fleetmend.infra.incidents`), which only a worker of that cluster polls. An incident of a cluster that no
  live worker announces (`fleetmend.infra.lease.presence`, read every `WORKER_PRESENCE_READ_S` off this path)
  is still started, and its summary says "no worker serves cluster C: start `fleetmend worker --cluster C`";
  nothing of it runs, and no permit of it is held, until such a worker starts.
- Drain now (`fleetmend.infra.permit_pool`): before its signal-with-start, a node whose fault the catalog
  says drains *now* (drain, urgency now, no history rule, no debounce; the catalog's own verdict and
  the event's both) is cordoned here at once when it gets a slot in the cluster's permit pool
  (compare-and-set; the budget, rack cap, breaker, pause, observe-only and open infrastructure
  incidents are the pool's). The slot records the fault, so a drain whose incident never starts is
  found and given one by FleetGuard (`reconcile_pool`). No slot: nothing is drained here and the
  incident asks FleetGuard. This stage never holds a message back: whatever it meets (pool or
  scheduler trouble) is logged and the event is routed as without it.
- Forwarding: a node refused a slot has its incident started in phase `awaiting_permit`, and once the
  signal-with-start is accepted its permit request goes to the cluster's FleetGuard (`request_permits`;
  a burst's nodes in a few signals, `MAX_FORWARD_BATCH` each), so the guard queues it with the reason
  it waits before the incident's first workflow task runs. A forward that fails is logged: the
  incident asks for itself.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

import structlog
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from pydantic import ValidationError
from tenacity import AsyncRetrying, retry_if_exception, retry_if_exception_type, stop_after_attempt, wait_fixed

from activities.fleetguard import fault_summary
from fleetmend import subjects
from fleetmend.catalog import Urgency
from fleetmend.config import Settings
from fleetmend.errors import InvalidEventError
from fleetmend.events import MAX_EVENT_BYTES, MAX_JSON_DEPTH, FaultEvent, condition_key, json_nesting_depth
from fleetmend.infra import metrics
from fleetmend.infra.incidents import signal_guard, start_incident
from fleetmend.infra.jetstream import ensure_deadletter_stream, ensure_fault_stream
from fleetmend.infra.lease import presence, served_clusters, unserved_reason
from fleetmend.infra.ledger import LedgerStore
from fleetmend.infra.permit_pool import BY_ROUTER, PermitPool
from fleetmend.ledger import slow_of
from fleetmend.messages import (
    MAX_SIGNAL_BYTES,
    FaultBatch,
    GuardApi,
    GuardPolicy,
    IncidentInput,
    IncidentPolicy,
    Occurrence,
    PermitRequest,
    Phase,
    RoutedFault,
    for_workflow,
    guard_task_queue,
)
from fleetmend.policy import Topology, load_topology

log = structlog.get_logger("fleetmend.router")

__all__ = ["MAX_EVENT_BYTES", "Router", "decode_event", "collapse"]

ENSURE_GUARD_EVERY_S = 10.0
"""How often the router may start its cluster's FleetGuard while it finds no pool (the guard publishes it)."""
FORWARD_LINGER_S = 0.05
"""Forwarding: how long the first refused node waits for others of its burst to share its signal."""
MAX_FORWARD_BATCH = 200
"""Forwarding: permit requests per `request_permits` signal (~0.5 KiB each; Temporal's payload limit
is 2 MiB)."""
WAIT_KEY_LINGER_S = 30.0
"""How long a refused node's wait key outlives the start of its incident (`_clear_waiting`)."""
WORKER_PRESENCE_READ_S = 5.0
"""How often the router reads which clusters a live worker serves (one KV listing)."""
RESETUP_AFTER_FAILURES = 5
"""Failed fetches in a row after which the router sets up its streams and consumer again."""
FETCH_RETRY_S = 1.0
"""Seconds between a failed fetch and the next (`Router._fetch_again`)."""


def _nats_trouble(err: BaseException) -> bool:
    """Whether a failed JetStream read is worth trying again: any error but a missing message (a
    cancellation is no error)."""
    return isinstance(err, Exception) and not isinstance(err, NotFoundError)


class _FetchFailed(Exception):
    """A fetch failed (not idle): tenacity fetches again a second later."""


@dataclass
class RouterStats:
    received: int = 0
    routed: int = 0
    signals: int = 0
    deadlettered: int = 0
    naks: int = 0
    drained_now: int = 0
    drain_now_refused: int = 0
    forwarded: int = 0
    """Permit requests forwarded to FleetGuard (accepted by Temporal)."""
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
    depth = json_nesting_depth(data)
    if depth > MAX_JSON_DEPTH:
        raise InvalidEventError(f"not JSON within limits: nested {depth} levels deep > {MAX_JSON_DEPTH}",
                                subject=subject)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InvalidEventError(f"not UTF-8 at byte {err.start}", subject=subject) from err
    try:
        obj = json.loads(text)
    except RecursionError as err:  # unreachable within MAX_JSON_DEPTH; kept as a second line of defence
        raise InvalidEventError("not JSON within limits: nested too deep", subject=subject) from err
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
        scheduler: the `SchedulerAdapter` of `settings.cluster` (`activities.scheduler.build_scheduler`)
            that cordons faults which must drain now; without one (tests of routing alone) every drain
            goes through FleetGuard.
    """

    def __init__(self, settings: Settings, nc, js, client, catalog, *,  # noqa: ANN001
                 filter_subject: str | None = None, durable: str = subjects.ROUTER_DURABLE,
                 stream: str = subjects.FAULT_STREAM, scheduler=None) -> None:  # noqa: ANN001
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
        self._fetch_failures = 0
        """Failed fetches in a row (`_fetch_again`)."""
        self._max_unacked = max(self.s.router.max_unacked, self.s.router.fetch_batch)
        self._room = asyncio.Event()
        self._fast = scheduler is not None and not settings.policy.observe_only
        self._scheduler = scheduler
        self._pool: PermitPool | None = None  # both set by _setup_fast_path, on the first fast drain
        self._topology: Topology | None = None
        self._guard_ensured_at = -1e9
        self._forwards: list[Any] = []  # PermitRequest, waiting for `_forward_loop`
        self._bg: set[asyncio.Task[None]] = set()  # wait-key deletes in flight (kept: a dropped task is collected)
        self._forwarder: asyncio.Task[None] | None = None
        self._ledger = LedgerStore(js, settings.ledger)  # the incident ledger: `_note_ledger`, nothing else
        self.served: set[str] | None = None
        """Clusters with a live worker (`_watch_workers`); None until first read."""
        self._warned_unserved: set[str] = set()

    async def _setup_fast_path(self) -> None:
        """Permit pool and topology for the drains this router makes."""
        if self._pool is None:
            self._pool = await PermitPool.open(self.js)
        if self._topology is None:
            self._topology = load_topology(self.s.policy.topology_file)
        await self._ensure_guard()

    async def _ensure_guard(self) -> None:
        """Start the cluster's FleetGuard if it is not running (signal-with-start of `request_permits` with
        no request), so it publishes the permit pool before the first fault, not after the first incident
        asked. At most once per `ENSURE_GUARD_EVERY_S`; failures are logged (the first incident starts it too)."""
        now = time.monotonic()
        if now - self._guard_ensured_at < ENSURE_GUARD_EVERY_S:
            return
        self._guard_ensured_at = now
        try:
            await self._signal_guard(GuardApi.REQUEST_PERMITS, [])
        except Exception as err:  # noqa: BLE001 - Temporal away: the first incident starts the guard
            log.warning("fleetguard_ensure_failed", cluster=self.s.cluster, error=repr(err))

    def _guard_policy(self) -> GuardPolicy:
        assert self._topology is not None, "_setup_fast_path first"
        return GuardPolicy.from_settings(self.s.policy, len(self._topology))

    async def _signal_guard(self, signal: str, arg: Any) -> None:
        """Signal-with-start this router's cluster's FleetGuard (started with this router's policy when
        absent). Raises what `Client.start_workflow` raises, or TimeoutError."""
        async with asyncio.timeout(self.s.router.temporal_call_timeout_s):
            await signal_guard(self.client, self.s.cluster, guard_task_queue(self.s.task_queue), self._guard_policy(),
                               signal, arg)

    def _forward(self, req) -> None:  # noqa: ANN001 - PermitRequest
        """Queue `req` for FleetGuard (`_forward_loop`, started when none runs)."""
        self._forwards.append(req)
        if self._forwarder is None or self._forwarder.done():
            self._forwarder = asyncio.create_task(self._forward_loop())

    async def _forward_loop(self) -> None:
        """Send the forwarded permit requests, `MAX_FORWARD_BATCH` per `request_permits` signal, until
        none wait. A failed signal is logged and its requests are let go: each incident asks for itself
        (and again every `policy.permit_rerequest_s`), so nothing is lost, only seen later."""
        while self._forwards:
            await asyncio.sleep(FORWARD_LINGER_S)
            batch, self._forwards = self._forwards[:MAX_FORWARD_BATCH], self._forwards[MAX_FORWARD_BATCH:]
            try:
                await self._signal_guard(GuardApi.REQUEST_PERMITS, batch)
            except Exception as err:  # noqa: BLE001 - the incidents ask for themselves
                log.warning("permit_forward_failed", cluster=self.s.cluster, nodes=len(batch), error=repr(err))
                continue
            self.stats.forwarded += len(batch)
            log.info("permits_forwarded", cluster=self.s.cluster, nodes=len(batch))

    async def setup(self):  # noqa: ANN201
        await ensure_fault_stream(self.js, self.s)
        await ensure_deadletter_stream(self.js, self.s)
        if self._fast:
            await self._setup_fast_path()
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
        psub = await self.setup()
        advisories = await self.watch_max_deliveries()
        workers = asyncio.create_task(self._watch_workers(stop), name="worker-presence")
        log.info("router_started", durable=self.durable, filter=self.filter_subject, task_queue=self.s.task_queue)
        try:
            await self._fetch_loop(psub, stop)
        finally:
            workers.cancel()
            with contextlib.suppress(Exception):
                await advisories.unsubscribe()
        if self._senders:
            log.info("router_finishing", nodes_in_flight=len(self._senders))
            await asyncio.gather(*self._senders.values(), return_exceptions=True)
        if self._forwarder is not None:
            await asyncio.gather(self._forwarder, return_exceptions=True)
        for task in list(self._bg):  # wait-key deletes still lingering: FleetGuard's reconciliation drops them
            task.cancel()
        log.info("router_stopped", **self.stats.__dict__)

    async def _watch_workers(self, stop: asyncio.Event) -> None:
        """Keep `served` (the clusters a live worker announces, `fleetmend.infra.lease.presence`) fresh, every
        `WORKER_PRESENCE_READ_S`, off the routing path; a failed read keeps the last answer. A cluster that
        becomes unserved, or served again, is logged once."""
        while not stop.is_set():
            try:
                now = served_clusters(await presence(self.js, "worker"))
            except Exception as err:  # noqa: BLE001 - NATS away or no permission: keep what was known
                log.debug("worker_presence_unread", error=repr(err))
            else:
                if self.served is not None:
                    for c in sorted(now - self.served):
                        log.info("cluster_served", cluster=c)
                self._warned_unserved -= now
                self.served = now
            await asyncio.sleep(WORKER_PRESENCE_READ_S)

    def unserved(self, cluster: str) -> bool:
        """Whether no live worker serves `cluster` (False until the first presence read: unknown)."""
        if self.served is None or cluster in self.served:
            return False
        if cluster not in self._warned_unserved:
            self._warned_unserved.add(cluster)
            log.warning("cluster_unserved", cluster=cluster, reason=unserved_reason(cluster))
        return True

    async def _fetch_loop(self, psub, stop: asyncio.Event) -> None:  # noqa: ANN001
        """Fetch until `stop`. After `RESETUP_AFTER_FAILURES` failed fetches in a row (the stream or
        the consumer is gone: NATS lost its storage, someone deleted it) the streams and the durable
        consumer are set up again (`setup`: a missing stream is created, an existing one untouched), every
        second until that succeeds (a set-up that failed leaves no subscription: a fetch on the old, unsubscribed
        one would only time out, which reads as idle, and the router would consume nothing again)."""
        while not stop.is_set():
            if psub is None:  # set up again: the old subscription is gone, and the last try failed (NATS away)
                try:
                    psub = await self.setup()
                    log.warning("router_set_up_again", after_failures=self._fetch_failures, durable=self.durable)
                except Exception as again:  # noqa: BLE001 - NATS still away (a cluster electing): next round
                    log.warning("router_setup_failed", error=repr(again))
                    await asyncio.sleep(1.0)
                    continue
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
                psub, msgs = await self._fetch_again(psub, err, stop)
                if not msgs:
                    continue
            self._fetch_failures = 0
            await self.handle_batch(msgs)

    async def _fetch_again(self, psub, err: Exception, stop: asyncio.Event) -> tuple[Any, list]:  # noqa: ANN001
        """After a failed fetch (`err`): fetch again `FETCH_RETRY_S` later, and so on (tenacity), until a fetch
        answers, comes back idle or finds no room (no messages then), or `stop`. Each failure is logged
        (`fetch_failed`); every `RESETUP_AFTER_FAILURES`-th in a row sets the streams and the consumer up again.
        Returns the subscription (a new one after a set-up) and what the fetch brought. The routing loop calls
        this only after a failure: a fetch that works costs no retry bookkeeping. The failures are counted in a
        row across idle answers, as before tenacity: only a fetch that brings messages starts the count afresh."""

        async def failed(e: BaseException) -> None:
            nonlocal psub
            log.warning("fetch_failed", error=repr(e))
            self._fetch_failures += 1
            failures = self._fetch_failures
            if failures % RESETUP_AFTER_FAILURES == 0:
                with contextlib.suppress(Exception):
                    await psub.unsubscribe()
                psub = None  # the routing loop sets up again, every second until it succeeds

        await failed(err)
        await asyncio.sleep(FETCH_RETRY_S)  # after the routing loop's failed fetch; tenacity waits after its own
        async for attempt in AsyncRetrying(wait=wait_fixed(FETCH_RETRY_S), reraise=True,
                                           retry=retry_if_exception_type(_FetchFailed)):
            with attempt:
                if stop.is_set() or psub is None or self._held >= self._max_unacked:
                    return psub, []
                try:
                    msgs = await psub.fetch(min(self.s.router.fetch_batch, self._max_unacked - self._held),
                                            timeout=1.0)
                    return psub, msgs
                except (NatsTimeout, asyncio.TimeoutError):
                    return psub, []  # idle: NATS answers again
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    await failed(e)
                    raise _FetchFailed from e
        raise AssertionError("unreachable: tenacity retries until a fetch answers")

    async def watch_max_deliveries(self):  # noqa: ANN201 - nats Subscription
        """Subscribe to JetStream's max-deliveries advisory of this consumer: the message it names is
        dead-lettered (`_on_max_deliveries`). Returns the subscription."""
        return await self.nc.subscribe(subjects.max_deliveries_advisory(self.stream, self.durable),
                                       cb=self._on_max_deliveries)

    async def _on_max_deliveries(self, adv_msg) -> None:  # noqa: ANN001
        try:
            adv = json.loads(adv_msg.data)
            seq, deliveries = int(adv["stream_seq"]), adv.get("deliveries")
        except (ValueError, KeyError, TypeError) as err:
            log.warning("max_deliveries_advisory_unreadable", error=repr(err))
            return
        try:  # NATS trouble: 5 tries a second apart (tenacity), then said loudly; never a cancellation
            async for attempt in AsyncRetrying(stop=stop_after_attempt(5), wait=wait_fixed(1.0), reraise=True,
                                               retry=retry_if_exception(_nats_trouble)):
                with attempt:
                    m = await self.js.get_msg(self.stream, seq)
        except NotFoundError:
            log.warning("max_deliveries_message_gone", stream=self.stream, stream_seq=seq)
            return
        except Exception as err:  # noqa: BLE001 - the fifth failure
            log.error("max_deliveries_deadletter_failed", stream_seq=seq, error=repr(err))
            return
        reason = f"reached max deliveries ({deliveries}) without being acked"
        if await self._write_deadletter(m.subject, m.data or b"", seq, deliveries, reason):
            self._counted_deadletter(reason, m.subject)

    async def handle_batch(self, msgs: list) -> None:
        """Validate a fetched batch, dead-letter the invalid, queue the rest per node. Whatever goes
        wrong with one message (an exception anywhere in its handling) dead-letters that message."""
        for msg in msgs:
            self.stats.received += 1
            try:
                await self._take(msg)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - one message must never stop the router
                log.error("message_failed", subject=getattr(msg, "subject", "?"), error=repr(err))
                with contextlib.suppress(Exception):
                    await self.deadletter(msg, f"router error on this message: {type(err).__name__}: {err}"[:500])

    async def _take(self, msg) -> None:  # noqa: ANN001
        try:
            ev = decode_event(msg.subject, msg.data)
        except InvalidEventError as err:
            await self.deadletter(msg, err.reason)
            return
        ev = ev.clamp_observed_at(datetime.now(timezone.utc))
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

    def _build(self, cluster: str, node: str, items: list[tuple[Any, FaultEvent, float]]):  # noqa: ANN202
        """(faults, IncidentInput, FaultBatch) of a node's queued items: collapse and classify."""
        seqs = [m.metadata.sequence.stream if getattr(m, "metadata", None) else None for m, _ev, _t in items]
        faults = collapse([ev for _msg, ev, _t in items], self.catalog, seqs)
        inp = IncidentInput(cluster=cluster, node=node, policy=IncidentPolicy.from_settings(self.s.policy,
                                                                                            self.s.notify.any))
        return faults, inp, FaultBatch(faults=faults, routed_at=datetime.now(timezone.utc))
    async def _isolate(self, cluster: str, node: str, items: list[tuple[Any, FaultEvent, float]],
                       err: Exception) -> list[tuple[Any, FaultEvent, float]]:
        """A node's batch could not be built: build each event alone, dead-letter those that fail
        (with the exception as the reason), return the rest."""
        good = []
        for item in items:
            try:
                self._build(cluster, node, [item])
            except Exception as one:  # noqa: BLE001 - this event is the poison
                await self.deadletter(item[0], f"classification failed: {type(one).__name__}: {one}"[:500])
            else:
                good.append(item)
        log.error("batch_isolated", cluster=cluster, node=node, error=repr(err), events=len(items),
                  deadlettered=len(items) - len(good))
        return good

    async def _route_node(self, cluster: str, node: str, items: list[tuple[Any, FaultEvent, float]]) -> None:
        try:
            faults, inp, batch = self._build(cluster, node, items)
        except Exception as err:  # noqa: BLE001 - one event must not block its node's others
            items = await self._isolate(cluster, node, items, err)
            if not items:
                return
            faults, inp, batch = self._build(cluster, node, items)
        wid = subjects.workflow_id(cluster, node)
        bound = log.bind(workflow_id=wid, node=node, cluster=cluster, events=len(items))
        parts = split_batch(faults)
        forward = await self._drain_now_under_pool(cluster, node, wid, items) if self._fast else None
        phase = Phase.AWAITING_PERMIT if forward is not None else Phase.TRIAGE
        if forward is not None:  # its request goes to the guard from here: the incident need not ask at once
            inp = replace(inp, permit_forwarded=True)
        async with self._sem:
            await self._keep_alive(items)  # after the wait for a slot, right before the call
            try:
                for part in parts:  # in order; a failure retries them all (the workflow dedupes ids)
                    await self._signal_with_start(wid, inp, FaultBatch(faults=part, routed_at=batch.routed_at),
                                                  cluster, node, phase)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - Temporal away or overloaded: retry later, never drop
                await self._retry_later(items, repr(err), bound)
                return
        for msg, _ev, _t in items:
            await msg.ack()
            metrics.router_accepted(_ev)
        self.stats.routed += len(items)
        self.stats.signals += len(parts)
        self._note_ledger(cluster, node, faults, datetime.now(timezone.utc))  # background, never Temporal
        if forward is not None:  # the incident exists now: the guard's answer has somewhere to go
            self._forward(forward)
            self._clear_waiting(cluster, node)
        bound.info("events_routed", kinds=sorted({ev.kind for _m, ev, _t in items}), faults=len(faults))

    def _drain_now(self, items: list[tuple[Any, FaultEvent, float]]) -> tuple[FaultEvent, str] | None:
        """(the first unhealthy event that must drain now by the catalog's own verdict and by the one the
        incident will read, the producer's or else the catalog's; the fault class the incident reads),
        or None when there is none. The catalog classifies only events whose own verdict allows it."""
        debounce = self.s.policy.debounce_s > 0

        def now(v) -> bool:  # noqa: ANN001 - Verdict
            return v.drain and v.urgency is Urgency.NOW and v.history is None and not (v.clearable and debounce)

        for _m, ev, _t in items:
            if ev.healthy or (ev.verdict is not None and not now(ev.verdict)):
                continue
            mine = self.catalog.verdict(ev)
            if now(mine):
                return ev, (ev.verdict or mine).fault_class
        return None

    async def _drain_now_under_pool(self, cluster: str, node: str, wid: str,
                          items: list[tuple[Any, FaultEvent, float]]) -> PermitRequest | None:
        """A pool slot, then the drain, for a node that must drain now. Never raises.

        Returns:
            the `PermitRequest` to forward to FleetGuard when the pool refused the node a slot (its
            incident waits for a permit), else None."""
        if cluster != self.s.cluster:
            return None  # the scheduler adapter here drains this router's own cluster only
        found = self._drain_now(items)
        if found is None:
            return None
        ev, fault_class = found
        bound = log.bind(node=node, cluster=cluster, workflow_id=wid)
        try:
            if self._pool is None:
                await self._setup_fast_path()
            pool, topology = self._pool, self._topology
            assert pool is not None and topology is not None
            dom = topology.domain(node)
            claim = await pool.claim(cluster, node, dom.rack, by=BY_ROUTER, domains=dom.keys(),
                                     fault=fault_summary(ev))
        except Exception as err:  # noqa: BLE001 - the incident asks FleetGuard
            bound.warning("drain_now_pool_failed", error=repr(err))
            return None
        if not claim.ok:
            self.stats.drain_now_refused += 1
            if claim.reason.startswith("no permit pool yet"):
                await self._ensure_guard()
            bound.info("drain_now_refused", reason=claim.reason)
            try:  # visible in `fleetmend status` before its incident exists (a burst starts them at Temporal's rate)
                await pool.note_waiting(cluster, node, claim.reason, fault_class, ev.severity.value,
                                        fault=fault_summary(ev))
            except Exception as err:  # noqa: BLE001 - only the early view is lost
                bound.warning("permit_wait_not_noted", error=repr(err))
            return PermitRequest(
                cluster=cluster, node=node, severity=ev.severity, fault_class=fault_class,
                reason=f"router: {fault_class} must drain now; no permit pool slot ({claim.reason})",
                rack=dom.rack, domains=dom.keys(), policy=self._guard_policy(),
                requested_at=datetime.now(timezone.utc), forwarded=True)
        if not claim.new:
            # held already: by its incident (drained under that permit), or by an earlier fast drain whose
            # incident adopts it or will (a router that stopped between slot and drain: the incident's
            # drain under the adopted permit cordons it). Draining again here would re-own the drain
            # under a new id, which the incident's undrain must not meet.
            return None
        try:
            res = await self._scheduler.drain(node, f"{fault_class}: must drain now, {claim.reason}",
                                              f"fast-{ev.event_id}")
        except Exception as err:  # noqa: BLE001 - not drained: free the slot, the incident asks FleetGuard
            bound.error("drain_now_failed", error=repr(err))
            with contextlib.suppress(Exception):
                await pool.release(cluster, node)
            return None
        self.stats.drained_now += 1
        metrics.drain_result(cluster, self._scheduler.name, res, ev.observed_at)
        bound.info("drained_now", fault_class=fault_class, permit=claim.reason, state=res.state, owned=res.owned,
                   operator_drained=res.operator_drained, detail=res.detail)
        return None

    # ---------------------------------------------------------------- the incident ledger (issue 26)
    def _note_ledger(self, cluster: str, node: str, faults: list[RoutedFault], routed_at: datetime | None) -> None:
        """The router's one ledger call: the batch's drain-worthy faults reach the node's incident now (when the
        fault line was seen and when it was routed: the report's time to detect; a fail_slow's cost). Written
        in the background (a NATS KV write, never Temporal), never raising: the drain path does not wait on it;
        the incident's `drain_node` reads the note later (`fleetmend.infra.ledger.LedgerStore.drained`)."""
        notes = []
        for rf in faults:
            ev, v = rf.event, rf.event.verdict
            if ev.healthy or v is None or not v.drain:
                continue
            notes.append({"observed_at": ev.observed_at.timestamp(), "routed_at": (routed_at or datetime.now(
                timezone.utc)).timestamp(), "fault_class": v.fault_class, "kind": ev.kind, "code": ev.code,
                "device": condition_key(ev).device, "serial": ev.device.serial or ev.device.uuid,
                "severity": ev.severity.value, "raw": ev.raw[:1000], "slow": slow_of(ev.kind, ev.attrs)})
            if len(notes) == 4:
                break
        if not notes:
            return
        task = asyncio.create_task(self._ledger.note_routed(cluster, node, notes))
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    def _clear_waiting(self, cluster: str, node: str) -> None:
        """Drop `node`'s wait key in the background, `WAIT_KEY_LINGER_S` after its incident started: the
        Temporal server lists a new workflow a while after accepting it (seconds in a storm), and until then
        the key is what shows the node in `fleetmend status`. A key this router does not drop (it stopped)
        is dropped by FleetGuard's reconciliation."""
        if self._pool is None:
            return

        async def clear() -> None:
            await asyncio.sleep(WAIT_KEY_LINGER_S)
            try:
                await self._pool.clear_waiting(cluster, node)  # type: ignore[union-attr]
            except Exception as err:  # noqa: BLE001 - a stale key says "incident starting" with its age
                log.warning("permit_wait_not_cleared", cluster=cluster, node=node, error=repr(err))

        task = asyncio.create_task(clear())
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

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

    async def _signal_with_start(self, wid: str, inp, batch, cluster: str, node: str,  # noqa: ANN001
                                 phase: Phase = Phase.TRIAGE) -> None:
        """`phase`: the incident's `FleetPhase` if this call starts it (`awaiting_permit` when its permit
        request is forwarded); an incident already running keeps its own."""
        async with asyncio.timeout(self.s.router.temporal_call_timeout_s):
            await start_incident(self.client, self.s.task_queue, inp, batch, phase, unserved=self.unserved(cluster))

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

    async def _write_deadletter(self, subject: str, data: bytes, stream_seq: int | None,
                                num_delivered: int | None, reason: str) -> bool:
        """Publish one dead-letter record (original bytes + reason) to `fleet.deadletter`, with
        `Nats-Msg-Id` `dl-<stream>-<seq>` so replicas and retries store it once. False if it failed."""
        record = {
            "reason": reason,
            "subject": subject,
            "stream_seq": stream_seq,
            "num_delivered": num_delivered,
            "at": datetime.now(timezone.utc).isoformat(),
            "data_b64": base64.b64encode(data[:MAX_EVENT_BYTES]).decode(),
            "data_bytes": len(data),
        }
        headers = {"Nats-Msg-Id": f"dl-{self.stream}-{stream_seq}"} if stream_seq is not None else None
        try:
            await self.js.publish(subjects.DEADLETTER_SUBJECT, json.dumps(record).encode(), timeout=5.0,
                                  headers=headers)
        except Exception as err:  # noqa: BLE001 - could not record: the caller keeps the message
            log.error("deadletter_write_failed", error=repr(err), reason=reason, subject=subject)
            return False
        return True

    def _counted_deadletter(self, reason: str, subject: str) -> None:
        self.stats.deadlettered += 1
        metrics.deadlettered(reason)
        key = metrics.deadletter_reason(reason)
        self.stats.deadletter_reasons[key] = self.stats.deadletter_reasons.get(key, 0) + 1
        log.warning("event_deadlettered", reason=reason, subject=subject)

    async def deadletter(self, msg, reason: str) -> None:  # noqa: ANN001
        """Write a dead-letter record (original bytes + reason) to `fleet.deadletter`, then term().
        If the record cannot be written, the message is nak'ed and comes back."""
        md = msg.metadata
        if not await self._write_deadletter(msg.subject, msg.data or b"", md.sequence.stream if md else None,
                                            md.num_delivered if md else None, reason):
            await msg.nak(delay=self.s.router.nak_delay_s)
            return
        await msg.term()
        self._counted_deadletter(reason, msg.subject)


MAX_REPEATS_PER_FAULT = 1000
"""Occurrences one `RoutedFault` carries (≈ 80 bytes each in the signal); a longer storm of one
condition is sent as several entries of that condition."""


def split_batch(faults: list[RoutedFault], limit: int = MAX_SIGNAL_BYTES,
                max_repeats: int = MAX_REPEATS_PER_FAULT) -> list[list[RoutedFault]]:
    """Cut a node's collapsed faults into signal payloads below `limit` bytes (JSON, estimated
    generously), in order. An entry with more than `max_repeats` repeats becomes several entries of
    the same condition (the workflow counts them into one record, exactly as before)."""
    expanded: list[RoutedFault] = []
    for rf in faults:
        if len(rf.repeats) <= max_repeats:
            expanded.append(rf)
            continue
        expanded.append(RoutedFault(event=rf.event, repeats=rf.repeats[:max_repeats],
                                    stream_seq=rf.stream_seq))
        rest = rf.repeats[max_repeats:]
        for j in range(0, len(rest), max_repeats + 1):
            part = rest[j:j + max_repeats + 1]
            head = rf.event.model_copy(update={"event_id": part[0].event_id, "observed_at": part[0].observed_at})
            expanded.append(RoutedFault(event=head, repeats=part[1:]))
    chunks: list[list[RoutedFault]] = []
    cur: list[RoutedFault] = []
    size = 0
    for rf in expanded:
        n = len(rf.event.to_json_bytes()) + 600 + 100 * len(rf.repeats)
        if cur and size + n > limit:
            chunks.append(cur)
            cur, size = [], 0
        cur.append(rf)
        size += n
    if cur:
        chunks.append(cur)
    return chunks


def collapse(events: list[FaultEvent], catalog, seqs: list[int | None] | None = None) -> list[RoutedFault]:  # noqa: ANN001
    """Collapse one node's queued events, oldest first, by condition into `RoutedFault`s.

    Each entry keeps its condition's first event (with its `Verdict`: the producer's, or stamped here
    with `catalog` when the producer did not classify; then cut to the workflow byte budget by
    `messages.for_workflow`, its fault-stream sequence from `seqs`) and lists the later ones as `repeats`
    (id and time); entries are ordered by their *latest* occurrence, so the workflow's arrival order
    still says which of a flapping link's DOWN and UP came last.
    """
    groups: dict[tuple, tuple[RoutedFault, list[int]]] = {}
    for i, ev in enumerate(events):
        key = (condition_key(ev), ev.healthy)
        got = groups.get(key)
        if got is None:
            seq = seqs[i] if seqs else None
            stamped = ev if ev.verdict is not None else catalog.stamp(ev)
            groups[key] = (RoutedFault(event=for_workflow(stamped, seq), stream_seq=seq), [i])
        else:
            got[0].repeats.append(Occurrence(event_id=ev.event_id, observed_at=ev.observed_at))
            got[1][0] = i
    return [rf for rf, _last in sorted(groups.values(), key=lambda g: g[1][0])]
