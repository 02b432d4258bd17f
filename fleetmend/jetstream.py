"""JetStream streams fleetmend needs, created or updated idempotently by whoever starts first
(agent, router, `fleetmend dev up`). The only place stream configuration is written.
"""

from __future__ import annotations

import asyncio
from typing import Any

from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from fleetmend.subjects import (
    DEADLETTER_STREAM,
    DEADLETTER_SUBJECT,
    FAULT_STREAM,
    all_faults_subject,
)

DEFAULT_DUPLICATE_WINDOW_S = 120.0
"""Nats-Msg-Id dedupe window. 120 s covers an agent replaying its spool right after a reconnect
(re-sends happen within seconds); a longer window costs server memory per message id."""


async def _ensure(js: JetStreamContext, cfg: StreamConfig, timeout_s: float) -> Any:
    assert cfg.name is not None
    async with asyncio.timeout(timeout_s):
        try:
            await js.stream_info(cfg.name)
        except NotFoundError:
            return await js.add_stream(cfg)
        return await js.update_stream(cfg)


async def ensure_fault_stream(js: JetStreamContext, subjects: list[str] | None = None,
                              duplicate_window_s: float = DEFAULT_DUPLICATE_WINDOW_S,
                              max_age_s: float = 7 * 24 * 3600.0, timeout_s: float = 5.0) -> Any:
    """Create (or update to this config) stream `FAULT_STREAM`, file storage, limits retention.

    Args:
        js: a JetStream context.
        subjects: default `["fleet.*.fault.*"]` (`subjects.all_faults_subject()`).
        duplicate_window_s: Nats-Msg-Id dedupe window (seconds).
        max_age_s: messages older than this are removed (7 days: far beyond any router outage).
        timeout_s: per JetStream API call.
    Returns:
        `nats.js.api.StreamInfo`.
    Raises:
        nats.js.errors.APIError: the server refused (e.g. overlapping subjects of another stream).
        TimeoutError: no answer within `timeout_s` (JetStream not enabled, or NATS away).
    """
    cfg = StreamConfig(
        name=FAULT_STREAM,
        subjects=subjects or [all_faults_subject()],
        storage=StorageType.FILE,
        retention=RetentionPolicy.LIMITS,
        discard=DiscardPolicy.OLD,
        duplicate_window=duplicate_window_s,
        max_age=max_age_s,
    )
    return await _ensure(js, cfg, timeout_s)


async def ensure_deadletter_stream(js: JetStreamContext, max_age_s: float = 30 * 24 * 3600.0,
                                   timeout_s: float = 5.0) -> Any:
    """Create (or update) stream `DEADLETTER_STREAM` on subject `fleet.deadletter`, file storage.

    Returns `StreamInfo`. Raises `nats.js.errors.APIError`.
    """
    cfg = StreamConfig(
        name=DEADLETTER_STREAM,
        subjects=[DEADLETTER_SUBJECT],
        storage=StorageType.FILE,
        retention=RetentionPolicy.LIMITS,
        max_age=max_age_s,
    )
    return await _ensure(js, cfg, timeout_s)
