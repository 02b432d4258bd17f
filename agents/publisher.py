"""The agent's publisher: the only part of the agent that knows JetStream and the spool.

Probes put events on a bounded `asyncio.Queue` (`Publisher.emit`, backpressure: a full queue makes
the probe wait). One task (`run`) takes them in order and publishes each to JetStream on
`fault_subject(cluster, node)` with `Nats-Msg-Id = msg_id(event_id)`, one at a time (in-flight
limit 1: strict per-node order, ~2.7k events/s measured for sync publish, far above any node's
fault rate). When NATS is away (disconnected, timeout, no responders, outbound buffer full) the
event is appended to the on-disk `Spool` instead; while the spool holds anything, new events go
behind it, so the stream receives them in observation order.

A second task (`replay`) drains the spool in order whenever NATS is (re)connected. It is woken by
the nats disconnected/reconnected callbacks and by appends (asyncio.Events, no polling); after a
failed attempt while still connected (JetStream not ready yet after a server restart) it retries
after an exponential backoff of 0.5 s → 30 s or at the next reconnect. Re-sent events keep their
original event id, so JetStream's duplicate window drops any copy that did arrive earlier (a
publish whose ack timed out, or a replay cut short by kill -9 before `Spool.commit`).

Every spool call (append with its fsync, peek, ack, commit) runs in one dedicated I/O thread, so a
slow disk never stalls heartbeats or diagnostics on the event loop. An event the agent could not
keep (spool at its bound with degraded/fatal events, the disk full or read-only, JetStream refusing
it for good) is counted in `lost_count` and the metric `fleetmend_agent_faults_lost_total{reason}`
and logged as `fault_lost` with its reason; the agent goes on, and the next event tries the spool
again, so spooling resumes by itself when space returns.

`emit` returns a future that resolves, once the event is settled, to True (published or spooled)
or False (lost): the kmsg probe advances its cursor only past events that were kept.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats.errors
import nats.js.errors
import structlog
from tenacity import AsyncRetrying, retry_if_result, wait_exponential

from agents import metrics
from agents.spool import Spool
from fleetmend.errors import SpoolError
from fleetmend.events import FaultEvent
from fleetmend.subjects import fault_subject, msg_id

MSG_ID_HEADER = "Nats-Msg-Id"
REPLAY_RETRY_MIN_S, REPLAY_RETRY_MAX_S = 0.5, 30.0
"""A failed replay pass while connected is retried after 0.5 s, doubling to 30 s (or at the next wake)."""

TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    asyncio.TimeoutError,  # includes nats.errors.TimeoutError
    nats.errors.NoRespondersError,
    nats.js.errors.NoStreamResponseError,  # stream not (yet) there after a server restart
    nats.js.errors.ServiceUnavailableError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.ConnectionDrainingError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
    ConnectionError,
)
"""Failures after which the event goes to the spool and is replayed later."""

DEFAULT_QUEUE_SIZE = 1024
"""Events between probes and the publisher; a kmsg storm beyond this waits in the kernel ring."""
T = TypeVar("T")

ENSURE_STREAM_EVERY_S = 10.0
"""A missing fault stream is recreated at most this often by one publisher."""
COMMIT_EVERY = 64
"""Replay persists its progress every N acked events (a crash re-sends at most N, deduped)."""


class Publisher:
    """Probes → bounded queue → JetStream, or the spool while NATS is away.

    Args:
        nc: a connected `nats.aio.client.Client`, or None until the runner has connected
            (everything is spooled meanwhile); see `attach`.
        js: its JetStream context (or None with nc None).
        spool: the node's `Spool`.
        cluster, node: the fault subject's tokens.
        publish_timeout_s: per JetStream publish (ack included).
        queue_size: bound of the probe → publisher queue.
        io_pool: a single-thread executor for spool I/O, shared by many publishers in one process
            (the simulator); default: its own (stopped by `close`).
        ensure_stream: `async () -> None` that creates the fault stream if it is missing; called
            (at most every `ENSURE_STREAM_EVERY_S`) when JetStream says no stream takes the subject,
            so an agent recreates a stream NATS lost (where its credentials allow).
    """

    def __init__(self, nc: Any, js: Any, spool: Spool, cluster: str, node: str,
                 publish_timeout_s: float = 5.0, queue_size: int = DEFAULT_QUEUE_SIZE, *,
                 io_pool: concurrent.futures.Executor | None = None,
                 ensure_stream: Callable[[], Awaitable[Any]] | None = None) -> None:
        self.spool = spool
        self.subject = fault_subject(cluster, node)
        self.publish_timeout_s = publish_timeout_s
        self.queue: asyncio.Queue[tuple[FaultEvent, asyncio.Future[bool]]] = asyncio.Queue(maxsize=queue_size)
        self.published_count = 0
        self.spooled_count = 0
        self.replayed_count = 0
        self.lost_count = 0
        """Events lost: spool full of degraded/fatal events, disk refusing writes, or refused by the server."""
        self.cluster = cluster
        self._own_pool = io_pool is None
        self._io_pool = io_pool or concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="spool-io")
        self.ensure_stream = ensure_stream
        self._ensured_at = -ENSURE_STREAM_EVERY_S
        self._log = structlog.get_logger("fleetmend.agent.publisher").bind(cluster=cluster, node=node)
        self._nc: Any = None
        self._js: Any = None
        self._online = asyncio.Event()  # NATS connected (as far as the callbacks say)
        self._wake = asyncio.Event()  # replay: something changed (reconnect, append)
        self._drained = asyncio.Event()  # spool empty after a replay
        if nc is not None:
            self.attach(nc, js)
        if spool.depth:
            self._wake.set()

    # ------------------------------------------------------------ connection state

    def attach(self, nc: Any, js: Any) -> None:
        """Use this connection from now on (the runner calls it once connected)."""
        self._nc, self._js = nc, js
        if nc.is_connected:
            self.on_reconnected()

    @property
    def online(self) -> bool:
        return self._nc is not None and self._nc.is_connected and self._online.is_set()

    def on_disconnected(self) -> None:
        """Wire to nats `disconnected_cb`."""
        if self._online.is_set():
            nc = self._nc
            if nc is not None and (getattr(nc, "is_draining", False) or getattr(nc, "is_closed", False)):
                self._log.info("nats_closed", spool_depth=self.spool.depth)  # our own drain at exit
            else:
                self._log.warning("nats_disconnected", spool_depth=self.spool.depth)
        self._online.clear()

    def on_reconnected(self) -> None:
        """Wire to nats `reconnected_cb` (and call after the first connect)."""
        self._online.set()
        self._wake.set()

    # ------------------------------------------------------------ intake

    async def emit(self, event: FaultEvent) -> asyncio.Future[bool]:
        """The probes' `emit` callback: waits while the queue is full (backpressure).

        Returns a future: True once the event is published or spooled, False if it was lost."""
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        await self.queue.put((event, fut))
        return fut

    async def run(self) -> None:
        """Publish queued events in order, forever (cancel to stop; `flush` first to finish)."""
        while True:
            event, fut = await self.queue.get()
            kept = False
            try:
                kept = await self._publish(event) != "lost"
            except SpoolError:
                pass  # logged and counted in _to_spool; the agent keeps going
            finally:
                if not fut.done():
                    fut.set_result(kept)
                self.queue.task_done()

    async def io(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a spool call in the spool's I/O thread (one at a time, in order)."""
        return await asyncio.get_running_loop().run_in_executor(self._io_pool, functools.partial(fn, *args))

    def close(self) -> None:
        """Stop the spool I/O thread (after `run`/`replay` are done); a shared pool is left running."""
        if self._own_pool:
            self._io_pool.shutdown(wait=True)

    async def _stream_missing(self) -> None:
        """JetStream has no stream for the subject (lost, deleted): recreate it, at most every
        `ENSURE_STREAM_EVERY_S`. Failures (no permission: the router/operator owns it) are logged."""
        loop = asyncio.get_running_loop()
        if self.ensure_stream is None or loop.time() - self._ensured_at < ENSURE_STREAM_EVERY_S:
            return
        self._ensured_at = loop.time()
        try:
            await self.ensure_stream()
            self._log.warning("fault_stream_recreated", subject=self.subject)
        except Exception as err:  # noqa: BLE001 - e.g. permission denied; the events wait in the spool
            self._log.warning("fault_stream_missing", subject=self.subject, error=repr(err))

    async def flush(self) -> None:
        """Wait until every queued event is published or spooled."""
        await self.queue.join()

    # ------------------------------------------------------------ publish

    async def publish(self, event: FaultEvent) -> bool:
        """Publish one event, or spool it. Returns True when JetStream acked it, False when spooled.

        An event JetStream refused for good is logged as `fault_lost`, counted, and False returned.

        Raises:
            SpoolError: it had to be spooled and the spool could not keep it (at its bound with
                degraded/fatal events, or the disk full/read-only); logged as `fault_lost`, counted.
        """
        return await self._publish(event) == "published"

    async def _publish(self, event: FaultEvent) -> str:
        """`publish`, saying what happened: "published", "spooled" or "lost" (refused for good)."""
        data = event.to_json_bytes()
        if self.spool.depth:
            await self._to_spool(event, data, "spool_not_empty")
            return "spooled"
        if not self.online:
            await self._to_spool(event, data, "nats_away")
            return "spooled"
        try:
            ack = await self._js_publish(event.event_id, data)
        except TRANSIENT_ERRORS as err:
            if not self._nc.is_connected:
                self.on_disconnected()
            await self._to_spool(event, data, f"publish_failed: {type(err).__name__}")
            if isinstance(err, nats.js.errors.NoStreamResponseError):
                await self._stream_missing()
            return "spooled"
        except nats.errors.Error as err:
            self.record_lost(event.event_id, "refused", f"JetStream refused it: {err!r}", kind=event.kind)
            return "lost"
        self.published_count += 1
        self._log.info("fault_published", event_id=event.event_id, component=event.component.value,
                       kind=event.kind, xid=event.code if event.kind == "xid" else None,
                       pci_bus_id=event.device.pci_bus_id, seq=ack.seq, duplicate=bool(ack.duplicate))
        return "published"

    async def _js_publish(self, event_id: str, data: bytes) -> Any:
        async with asyncio.timeout(self.publish_timeout_s):
            return await self._js.publish(self.subject, data, timeout=self.publish_timeout_s,
                                          headers={MSG_ID_HEADER: msg_id(event_id)})

    def record_lost(self, event_id: str, reason: str, detail: str, **kw: Any) -> None:
        self.lost_count += 1
        metrics.fault_lost(self.cluster, reason)
        self._log.error("fault_lost", event_id=event_id, reason=reason, detail=detail, lost_total=self.lost_count,
                        **kw)

    async def _to_spool(self, event: FaultEvent, data: bytes, reason: str) -> None:
        try:
            await self.io(self.spool.append, data, event.severity, event.event_id)
        except SpoolError as err:
            self.record_lost(event.event_id, err.reason, str(err), kind=event.kind, severity=event.severity.value)
            raise
        self.spooled_count += 1
        self._drained.clear()
        self._wake.set()
        self._log.info("fault_spooled", event_id=event.event_id, component=event.component.value,
                       kind=event.kind, severity=event.severity.value, reason=reason,
                       spool_depth=self.spool.depth)

    # ------------------------------------------------------------ replay

    async def replay(self) -> None:
        """Drain the spool, in order, whenever NATS is connected; forever (cancel to stop). A pass that fails
        while connected is retried (tenacity) after 0.5 s doubling to 30 s, or sooner when a reconnect or
        an append wakes the replay."""
        retrying = AsyncRetrying(retry=retry_if_result(lambda drained: drained is False),
                                 wait=wait_exponential(multiplier=REPLAY_RETRY_MIN_S, max=REPLAY_RETRY_MAX_S),
                                 sleep=self._sleep_or_wake)
        while True:
            await self._wake.wait()
            self._wake.clear()
            await retrying(self._replay_when_online)

    async def _replay_when_online(self) -> bool:
        """One replay pass once connected; True when there was nothing (left) to replay."""
        if not self.spool.depth:
            return True
        await self._online.wait()
        return await self.replay_once()

    async def _sleep_or_wake(self, seconds: float) -> None:
        """tenacity's sleep between failed replay passes: `seconds`, or until a reconnect or append wakes us."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._wake.wait()
        self._wake.clear()

    async def replay_once(self) -> bool:
        """Publish spooled events oldest first until empty. Returns False if NATS failed midway."""
        n = 0
        try:
            while self.online:
                try:
                    head = await self.io(self.spool.peek)
                except OSError as err:  # unreadable segment (EIO): try again later
                    self._log.warning("spool_replay_paused", replayed=n, spool_depth=self.spool.depth,
                                      error=repr(err))
                    return False
                if head is None:
                    break
                event_id, data = head
                try:
                    await self._js_publish(event_id, data)
                except TRANSIENT_ERRORS as err:
                    self._log.warning("spool_replay_paused", replayed=n, spool_depth=self.spool.depth,
                                      error=repr(err))
                    if isinstance(err, nats.js.errors.NoStreamResponseError):
                        await self._stream_missing()
                    return False
                except nats.errors.Error as err:
                    # Refused for good (payload too large for this server, ...): skip it, loudly.
                    self.record_lost(event_id, "refused", f"JetStream refused it: {err!r}")
                await self.io(self.spool.ack, event_id)
                n += 1
                if n % COMMIT_EVERY == 0:
                    await self.io(self.spool.commit)
        finally:
            await asyncio.shield(self.io(self.spool.commit))
            self.replayed_count += n
        if n:
            self._log.info("spool_replayed", replayed=n, spool_depth=self.spool.depth)
        if self.spool.depth == 0:
            self._drained.set()
            return True
        return False

    async def wait_spool_empty(self) -> None:
        """Return once the spool is empty (replay must be running). For `--once` and shutdown."""
        if self.spool.depth:
            self._drained.clear()
            self._wake.set()
            await self._drained.wait()
