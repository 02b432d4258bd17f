"""JetStream streams fleetmend needs. The only place stream configuration is written.

Streams are the operator's: whoever starts first (agent, router, `fleetmend dev up`) creates a
stream that is missing, with the configured replicas and limits (`[streams]` in the settings,
`StreamSettings`), and does not change one that exists. An existing stream whose settings differ from
the configuration (e.g. raised to 3 replicas, or a larger byte bound) is left as it is and reported by one
warning per process (`stream_settings_differ`), naming each difference; an operator changes a stream with
the NATS tools (`nats stream edit`). Two exceptions: the subjects, which are the wire contract, and a
stream with no byte bound at all (made by a release before 0.3), which gets the configured one.

Every stream and bucket has a byte bound (the constants below, `kv_config`): JetStream reserves a stream's
`max_bytes` in the store when the stream is created (and refuses one that does not fit), so the streams
together never use more than `max_file_store`, and one node's flood of telemetry or job timings evicts its
own stream's oldest messages instead of refusing fault events ("insufficient resources").

Replicas: every stream and KV bucket fleetmend creates gets `[streams] replicas` copies (one setting for both:
3 on a three-node JetStream cluster, 1 on one server). The fault and dead-letter streams read it from the
settings they are given; the other streams and every bucket (`kv_config`, whoever creates it) from the
process-wide value `connect_nats` sets from the process's settings (`use_replicas`). A bucket that exists with
another replica count is left as it is and reported by one warning per process (`bucket_settings_differ`,
`report_bucket_settings`), as streams are (`stream_settings_differ`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, KeyValueConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, BucketNotFoundError, NoStreamResponseError, NotFoundError
from tenacity import AsyncRetrying, retry_if_exception, wait_fixed

from fleetmend.config import StreamSettings
from fleetmend.subjects import (
    ANALYZER_KV_BUCKET,
    DEADLETTER_STREAM,
    DEADLETTER_SUBJECT,
    DRAIN_KV_BUCKET,
    DRIFT_ALLOW_KV_BUCKET,
    FAULT_STREAM,
    FINGERPRINT_KV_BUCKET,
    FINGERPRINT_STREAM,
    JOB_STREAM,
    LEASE_KV_BUCKET,
    LEDGER_KV_BUCKET,
    NOTIFY_KV_BUCKET,
    PERF_STREAM,
    PERMIT_KV_BUCKET,
    TICKET_KV_BUCKET,
    all_faults_subject,
    all_fingerprints_subject,
    all_jobs_subject,
    all_perf_subject,
)

log = structlog.get_logger("fleetmend.infra.jetstream")

DEFAULT_DUPLICATE_WINDOW_S = 120.0
"""Nats-Msg-Id dedupe window. 120 s covers an agent replaying its spool right after a reconnect
(re-sends happen within seconds); a longer window costs server memory per message id."""

_COMPARED = ("subjects", "num_replicas", "max_bytes", "max_age", "max_msgs_per_subject", "max_msg_size",
             "duplicate_window", "storage", "retention", "discard")
_warned: set[str] = set()
_replicas = 1
"""Replicas of the streams and buckets this process creates without settings at hand (`use_replicas`)."""


def use_replicas(n: int) -> None:
    """Create every stream and KV bucket of this process from now on with `n` replicas (`[streams] replicas`);
    `fleetmend.infra.connect.connect_nats` calls it with the settings of the process it connects.

    Raises:
        ValueError: `n` outside 1..5 (JetStream's limit).
    """
    global _replicas
    if not 1 <= int(n) <= 5:
        raise ValueError(f"replicas {n}: JetStream keeps 1 to 5 copies of a stream")
    _replicas = int(n)


def replicas() -> int:
    """The replicas this process creates streams and buckets with (`use_replicas`; 1 until set)."""
    return _replicas


def _value(v: Any) -> Any:
    return getattr(v, "value", v)


def differences(want: StreamConfig, have: StreamConfig) -> dict[str, tuple[Any, Any]]:
    """Settings fleetmend would create that the existing stream does not have: name → (have, want).
    Only the fields fleetmend sets are compared; durations within 1 ms are equal."""
    out: dict[str, tuple[Any, Any]] = {}
    for f in _COMPARED:
        w, h = _value(getattr(want, f)), _value(getattr(have, f))
        if w is None:
            continue
        if f == "num_replicas" and h is None:
            h = 1
        if f in ("max_age", "duplicate_window") and h is not None and abs(float(w) - float(h)) < 1e-3:
            continue
        if f == "subjects":
            w, h = sorted(w), sorted(h or [])
        if w != h:
            out[f] = (h, w)
    return out


class _Leaderless(Exception):
    """A replicated stream whose leader is not elected yet."""


async def wait_for_leader(js: JetStreamContext, stream: str) -> Any:
    """Return `stream`'s info once it has a leader. A stream (or KV bucket) just created at more than one
    replica answers its creation before its own leader is elected, and a write in between gets "no responders"
    (seen in CI: the standalone scheduler's first put on a new R3 bucket); nats.go's publish retries that,
    nats-py's does not. Polls every 0.1 s without a bound of its own: the caller's timeout bounds it.

    Raises:
        nats.js.errors.APIError: the server refused the info request (other than 503, not available yet).
    """
    def not_yet(err: BaseException) -> bool:  # 503: "JetStream system temporarily unavailable" (no leader yet)
        return isinstance(err, (_Leaderless, NoRespondersError, NatsTimeoutError, NoStreamResponseError)) or (
            isinstance(err, APIError) and err.code == 503)

    async for attempt in AsyncRetrying(wait=wait_fixed(0.1), reraise=True, retry=retry_if_exception(not_yet)):
        with attempt:
            info = await js.stream_info(stream)
            if info.cluster is not None and not info.cluster.leader:
                raise _Leaderless(stream)
            return info
    raise AssertionError("unreachable: tenacity returns the info or raises")


async def ensure_stream(js: JetStreamContext, cfg: StreamConfig, timeout_s: float = 5.0) -> Any:
    """Create stream `cfg.name` if it is missing; otherwise leave its settings as they are (limits,
    replicas, storage are the operator's), with one warning per process when they differ from `cfg`
    (`differences`). Its `subjects` are the code's wire contract, not a setting: when they differ (a
    stream created by an older version, e.g. `fleet.*.job.*` before job reports named their sender) they
    are updated, and that is logged.

    Returns:
        `nats.js.api.StreamInfo` of the stream as it is on the server.
    Raises:
        nats.js.errors.APIError: the server refused to create it (insufficient storage for
            `max_bytes`, overlapping subjects of another stream, no permission).
        TimeoutError: no answer within `timeout_s` (JetStream not enabled, or NATS away).
    """
    assert cfg.name is not None
    async with asyncio.timeout(timeout_s):
        try:
            info = await js.stream_info(cfg.name)
        except NotFoundError:
            info = await js.add_stream(cfg)
            log.info("stream_created", stream=cfg.name, replicas=cfg.num_replicas, max_bytes=cfg.max_bytes,
                     max_age_s=cfg.max_age)
            if (cfg.num_replicas or 1) > 1:
                info = await wait_for_leader(js, cfg.name)
            return info
    if cfg.subjects and sorted(info.config.subjects or []) != sorted(cfg.subjects):
        old, info.config.subjects = info.config.subjects, list(cfg.subjects)
        async with asyncio.timeout(timeout_s):
            info = await js.update_stream(info.config)
        log.warning("stream_subjects_updated", stream=cfg.name, old=old, new=cfg.subjects,
                    note="the subjects are fleetmend's wire contract; a stream made by an older version is moved on")
    if cfg.max_bytes and cfg.max_bytes > 0 and (info.config.max_bytes or -1) <= 0:
        # no byte bound at all (a stream made by a release before 0.3): it could take every other stream's
        # storage, the fault stream's included. A missing bound is filled in; a set one stays the operator's.
        info.config.max_bytes = cfg.max_bytes
        async with asyncio.timeout(timeout_s):
            info = await js.update_stream(info.config)
        log.warning("stream_bounded", stream=cfg.name, max_bytes=cfg.max_bytes,
                    note="the stream had no byte bound; one node's flood could refuse every fault event")
    diff = differences(cfg, info.config)
    if diff and cfg.name not in _warned:
        _warned.add(cfg.name)
        log.warning("stream_settings_differ", stream=cfg.name,
                    differences={k: {"stream": h, "configured": w} for k, (h, w) in diff.items()},
                    note="the stream is left as it is (streams are the operator's); change it with "
                         "`nats stream edit` or align the [streams] settings")
    return info


def _settings(streams: Any) -> Any:
    if streams is None:
        return StreamSettings(replicas=_replicas)
    return getattr(streams, "streams", streams)  # Settings or StreamSettings


def fault_stream_config(streams: Any = None, subjects: list[str] | None = None) -> StreamConfig:
    """`StreamConfig` of `FAULT_STREAM` from `StreamSettings` (or `Settings`; None: defaults):
    file storage, limits retention, discard old, `max_bytes`, `max_age`, per-node message limit."""
    s = _settings(streams)
    return StreamConfig(
        name=FAULT_STREAM,
        subjects=subjects or [all_faults_subject()],
        storage=StorageType.FILE,
        retention=RetentionPolicy.LIMITS,
        discard=DiscardPolicy.OLD,
        duplicate_window=s.duplicate_window_s,
        max_age=s.fault_max_age_s,
        max_bytes=s.fault_max_bytes,
        max_msgs_per_subject=s.fault_max_msgs_per_node,
        max_msg_size=s.fault_max_msg_bytes,
        num_replicas=s.replicas,
    )


def deadletter_stream_config(streams: Any = None) -> StreamConfig:
    """`StreamConfig` of `DEADLETTER_STREAM` (subject `fleet.deadletter`) from `StreamSettings`."""
    s = _settings(streams)
    return StreamConfig(
        name=DEADLETTER_STREAM,
        subjects=[DEADLETTER_SUBJECT],
        storage=StorageType.FILE,
        retention=RetentionPolicy.LIMITS,
        discard=DiscardPolicy.OLD,
        max_age=s.deadletter_max_age_s,
        max_bytes=s.deadletter_max_bytes,
        num_replicas=s.replicas,
    )


async def ensure_fault_stream(js: JetStreamContext, streams: Any = None, *, subjects: list[str] | None = None,
                              timeout_s: float = 5.0) -> Any:
    """Create `FAULT_STREAM` if missing (`fault_stream_config`); an existing one is left as it is.

    Args:
        js: a JetStream context.
        streams: `StreamSettings` or `Settings` (None: the defaults).
        subjects: default `["fleet.*.fault.*"]` (`subjects.all_faults_subject()`).
        timeout_s: per JetStream API call.
    Returns `StreamInfo`. Raises as `ensure_stream`.
    """
    return await ensure_stream(js, fault_stream_config(streams, subjects), timeout_s)


async def ensure_deadletter_stream(js: JetStreamContext, streams: Any = None, *, timeout_s: float = 5.0) -> Any:
    """Create `DEADLETTER_STREAM` if missing (`deadletter_stream_config`). Returns `StreamInfo`."""
    return await ensure_stream(js, deadletter_stream_config(streams), timeout_s)


# ---------------------------------------------------------------- the byte bounds of every stream and bucket

MiB = 1024 * 1024
PERF_MAX_BYTES = 1024 * MiB
"""Bound of `PERF_STREAM`: 50,000 nodes × 15 samples (15 min at the agent's 60 s) × ~1.4 KiB a sample (8 GPUs,
8 NICs); at 100,000 nodes the oldest minutes go first (raise it with `nats stream edit`). With discard-old a
flood evicts this stream's oldest samples, never another stream's storage."""
PERF_MAX_MSG_BYTES = 64 * 1024
"""Largest perf sample stored (a sample is a few KiB; the server refuses larger)."""
JOB_MAX_BYTES = 512 * MiB
"""Bound of `JOB_STREAM`: 5,000 job subjects (node × job) at ~100 KiB each within its 15-minute max age."""
JOB_MAX_MSG_BYTES = 32 * 1024
"""Largest job report stored: `fleetmend.jobs.MAX_BATCH` 256 records × ~60 bytes ≈ 16 KiB, with room."""
JOB_MAX_MSGS_PER_SUBJECT = 2_000
"""Job reports kept per node and job: a report batches up to 256 steps, so 2,000 hold 15 min of a 500 steps/s
job; one node's flood of one job subject (≤ 2,000 × 32 KiB = 64 MiB) evicts only its own oldest reports."""
FINGERPRINT_MAX_BYTES = 128 * MiB
"""Bound of `FINGERPRINT_STREAM` (change records, ~1 KiB, 1,000 per node at most; changes are rare)."""
FINGERPRINT_MAX_MSG_BYTES = 256 * 1024
KV_MAX_BYTES: dict[str, int] = {
    LEASE_KV_BUCKET: 16 * MiB, PERMIT_KV_BUCKET: 64 * MiB, DRAIN_KV_BUCKET: 256 * MiB, TICKET_KV_BUCKET: 512 * MiB,
    NOTIFY_KV_BUCKET: 64 * MiB, ANALYZER_KV_BUCKET: 256 * MiB, FINGERPRINT_KV_BUCKET: 512 * MiB,
    DRIFT_ALLOW_KV_BUCKET: 16 * MiB,
}
"""Bound of each KV bucket (the bytes of its kept revisions): leases and presence keys (~200 B per process),
the permit pool (one document per cluster, ~150 B per holder, and wait keys), drains and tickets (history 5,
~0.5–1 KiB a revision, 100,000 nodes), notifications sent, the analyzer's state, fingerprints (~5 KiB ×
100,000 nodes) and drift allow lists. A bucket not listed gets `KV_DEFAULT_MAX_BYTES`. Every bound is reserved
by JetStream at creation (about 1.7 GiB for these, 8.3 GiB with the streams' defaults): the server's
`max_file_store` must hold them, which is what keeps the fault stream's share free."""
KV_DEFAULT_MAX_BYTES = 64 * MiB
KV_MAX_VALUE_BYTES = 1 * MiB
"""Largest value a bucket stores (the permit pool's document is the largest, ~150 B × holders)."""


def kv_max_bytes(bucket: str) -> int:
    """`KV_MAX_BYTES[bucket]`, else `KV_DEFAULT_MAX_BYTES`."""
    return KV_MAX_BYTES.get(bucket, KV_DEFAULT_MAX_BYTES)


def kv_config(bucket: str, description: str | None = None, **kw: Any) -> KeyValueConfig:
    """`KeyValueConfig` of one of fleetmend's buckets: file storage, history 1, its byte bound (`kv_max_bytes`,
    so the bucket reserves its storage and can never take the fault stream's), `KV_MAX_VALUE_BYTES` and the
    configured replicas (`replicas()`, `[streams] replicas`); `kw` overrides (e.g. `direct=True`)."""
    return KeyValueConfig(**{"bucket": bucket, "description": description, "history": 1, "storage": StorageType.FILE,
                             "max_bytes": kv_max_bytes(bucket), "max_value_size": KV_MAX_VALUE_BYTES,
                             "replicas": _replicas, **kw})


async def report_bucket_settings(js: JetStreamContext, bucket: str, *, timeout_s: float = 5.0) -> int | None:
    """Compare an existing bucket's replicas with the configured ones (`replicas()`); a difference is left as it
    is (buckets, like streams, are the operator's: `nats stream edit KV_<bucket> --replicas N`) and reported by
    one warning per process and bucket (`bucket_settings_differ`).

    Returns:
        The bucket's replicas as the server has them; None when the bucket does not exist or cannot be read
        (no permission: a node's credentials read their own key only), which is not reported.
    """
    try:
        async with asyncio.timeout(timeout_s):
            info = await js.stream_info(f"KV_{bucket}")
    except Exception:  # noqa: BLE001 - missing, or not this client's to read: nothing to compare
        return None
    have = info.config.num_replicas or 1
    if have != _replicas and f"KV_{bucket}" not in _warned:
        _warned.add(f"KV_{bucket}")
        log.warning("bucket_settings_differ", bucket=bucket, differences={"replicas": {"bucket": have,
                                                                                       "configured": _replicas}},
                    note="the bucket is left as it is (buckets are the operator's); change it with "
                         f"`nats stream edit KV_{bucket} --replicas {_replicas}` or align [streams] replicas")
    return have


ROUTER_BUCKETS = (LEASE_KV_BUCKET, PERMIT_KV_BUCKET, DRAIN_KV_BUCKET, LEDGER_KV_BUCKET)
"""The buckets the router checks at start: those its credentials may read (`fleetmend.infra.security`)."""
WORKER_BUCKETS = (DRAIN_KV_BUCKET, TICKET_KV_BUCKET, NOTIFY_KV_BUCKET)
"""The worker's own (besides the router's, which it reads too): checked at its start."""


async def report_all_bucket_settings(js: JetStreamContext, buckets: tuple[str, ...] | None = None, *,
                                     timeout_s: float = 5.0) -> dict[str, int]:
    """`report_bucket_settings` for each of `buckets` (None: every bucket of fleetmend's, `KV_MAX_BYTES` and the
    ledger's) that exists. The router and the worker call it at start with the buckets their credentials may
    read (`ROUTER_BUCKETS`, `WORKER_BUCKETS`: an info request on another is a permissions violation, answered by
    no one), so a deployment raised to 3 replicas with buckets left at 1 says so once per bucket.

    Returns:
        bucket → its replicas on the server, for the buckets that exist.
    """
    out = {}
    for bucket in buckets if buckets is not None else (*KV_MAX_BYTES, LEDGER_KV_BUCKET):
        have = await report_bucket_settings(js, bucket, timeout_s=timeout_s)
        if have is not None:
            out[bucket] = have
    return out


async def ensure_perf_stream(js: JetStreamContext, max_age_s: float = 900.0, max_msgs_per_subject: int = 64,
                             timeout_s: float = 5.0, *, perf_max_bytes: int = PERF_MAX_BYTES,
                             job_max_bytes: int = JOB_MAX_BYTES) -> Any:
    """Create (or update) stream `PERF_STREAM` on `fleet.*.perf.*` (telemetry samples) and
    `JOB_STREAM` on `fleet.*.job.*.*` (job step timings, the sender's node token before the job):
    file storage, limits retention, old
    messages discarded.

    Args:
        max_age_s: samples older than this are removed (default 15 min, see
            `fleetmend.telemetry.DEFAULT_PERF_MAX_AGE_S`).
        max_msgs_per_subject: per node cap of the perf stream, so one chatty node loses its own oldest samples
            first (jobs: `JOB_MAX_MSGS_PER_SUBJECT` per node and job).
        timeout_s: per JetStream API call.
        perf_max_bytes, job_max_bytes: the streams' byte bounds (`PERF_MAX_BYTES`, `JOB_MAX_BYTES`): each stream
            reserves them in JetStream, so neither can take the fault stream's storage.
    Returns:
        `StreamInfo` of the perf stream.
    Raises:
        nats.js.errors.APIError, TimeoutError: as `ensure_fault_stream`.
    """
    info = await ensure_stream(js, StreamConfig(
        name=PERF_STREAM, subjects=[all_perf_subject()], storage=StorageType.FILE,
        retention=RetentionPolicy.LIMITS, discard=DiscardPolicy.OLD, max_age=max_age_s,
        max_msgs_per_subject=max_msgs_per_subject, duplicate_window=DEFAULT_DUPLICATE_WINDOW_S,
        max_bytes=perf_max_bytes, max_msg_size=PERF_MAX_MSG_BYTES, num_replicas=_replicas), timeout_s)
    await ensure_stream(js, StreamConfig(
        name=JOB_STREAM, subjects=[all_jobs_subject()], storage=StorageType.FILE,
        retention=RetentionPolicy.LIMITS, discard=DiscardPolicy.OLD, max_age=max_age_s,
        max_msgs_per_subject=JOB_MAX_MSGS_PER_SUBJECT, duplicate_window=DEFAULT_DUPLICATE_WINDOW_S,
        max_bytes=job_max_bytes, max_msg_size=JOB_MAX_MSG_BYTES, num_replicas=_replicas), timeout_s)
    return info


async def kv_keys(js: JetStreamContext, bucket: str, prefix: str = "", timeout_s: float = 5.0) -> list[str]:
    """Keys of KV `bucket` that start with `prefix` (a whole dot-separated token prefix, e.g. `"t."`),
    sorted; [] for an empty bucket.

    Read from the bucket stream's per-subject state (`STREAM.INFO` with a subjects filter), not from
    nats-py's `KeyValue.keys()`, whose watcher can signal "no more keys" before the messages already
    buffered on its subscription are counted and then reports an empty bucket that is not (a
    `fleetmend tickets` right after a ticket was filed printed none). A key whose latest entry is a
    delete or purge marker is still listed: callers read each key and treat a deleted one as absent
    (`KeyDeletedError` is a `KeyNotFoundError`). The server lists up to 100,000 subjects per call,
    beyond what a ticket ledger or drain store holds.

    Raises:
        nats.js.errors.NotFoundError: the bucket does not exist.
        asyncio.TimeoutError: the server did not answer within `timeout_s`.
    """
    pre = f"$KV.{bucket}."
    async with asyncio.timeout(timeout_s):
        info = await js.stream_info(f"KV_{bucket}", subjects_filter=f"{pre}{prefix}>" if prefix else f"{pre}>")
    subjects_ = info.state.subjects or {}
    return sorted(s[len(pre):] for s in subjects_ if s.startswith(pre))


async def open_kv_bucket(js: JetStreamContext, bucket: str, description: str, timeout_s: float = 10.0,
                         direct: bool = False) -> Any:
    """A KV bucket of fleetmend's, created on first use (`kv_config`: file storage, history 1, the configured
    replicas); a bucket another process created meanwhile is opened, and an existing one whose replicas
    differ from the configuration is reported (`report_bucket_settings`). `direct`: created with direct gets,
    whose API subject names the key (`$JS.API.DIRECT.GET.KV_<bucket>.$KV.<bucket>.<key>`), so credentials can
    let a node read its own key only.

    Returns:
        `nats.js.kv.KeyValue`.
    Raises:
        TimeoutError: JetStream did not answer within `timeout_s`.
        nats.js.errors.APIError: the server refused (e.g. no JetStream in the account).
    """
    async with asyncio.timeout(timeout_s):
        try:
            kv = await js.key_value(bucket)
        except BucketNotFoundError:
            cfg = kv_config(bucket, description, direct=direct or None)
            try:
                kv = await js.create_key_value(cfg)
            except Exception:  # noqa: BLE001 - another process created it first; if not, this raises
                kv = await js.key_value(bucket)
            else:
                if (cfg.replicas or 1) > 1:
                    await wait_for_leader(js, f"KV_{bucket}")
                return kv
        # an existing bucket keeps its replicas; one that differs from [streams] replicas is reported once
        # (`key_value` read the same stream info, so whoever may open the bucket may read it)
        await report_bucket_settings(js, bucket, timeout_s=timeout_s)
        return kv


# ---------------------------------------------------------------- fingerprints (issue 25): bucket + change stream

FINGERPRINT_CHANGES_MAX_AGE_S = 90 * 24 * 3600.0
"""How long `FINGERPRINT_STREAM` keeps change records: a quarter, long enough to ask "what changed on this node
since its last repair"; changes are rare (a few per node per rollout), so this is small."""


async def open_fingerprint_stores(js: JetStreamContext, timeout_s: float = 5.0) -> Any:
    """Open the fingerprint stores (`ensure_fingerprint_stores`) without creating them: what a node's credentials
    allow (stream info, its own key). Returns the bucket's `nats.js.kv.KeyValue`.

    Raises:
        nats.js.errors.NotFoundError: the stream or bucket does not exist yet (the analyzer creates them).
        TimeoutError: no answer within `timeout_s`.
    """
    async with asyncio.timeout(timeout_s):
        await js.stream_info(FINGERPRINT_STREAM)
        return await js.key_value(FINGERPRINT_KV_BUCKET)


async def ensure_fingerprint_stores(js: JetStreamContext, timeout_s: float = 5.0) -> Any:
    """Create stream `FINGERPRINT_STREAM` on `fleet.*.fingerprint.*` (file storage, limits retention,
    `FINGERPRINT_CHANGES_MAX_AGE_S`, 1,000 records per node) if missing, and open (or create) the KV bucket
    `FINGERPRINT_KV_BUCKET` (latest fingerprint per node, history 1).

    Returns:
        `nats.js.kv.KeyValue` of the bucket.
    Raises:
        nats.js.errors.APIError, TimeoutError: as `ensure_fault_stream`.
    """
    await ensure_stream(js, StreamConfig(
        name=FINGERPRINT_STREAM, subjects=[all_fingerprints_subject()], storage=StorageType.FILE,
        retention=RetentionPolicy.LIMITS, discard=DiscardPolicy.OLD, max_age=FINGERPRINT_CHANGES_MAX_AGE_S,
        max_msgs_per_subject=1000, duplicate_window=DEFAULT_DUPLICATE_WINDOW_S, max_bytes=FINGERPRINT_MAX_BYTES,
        max_msg_size=FINGERPRINT_MAX_MSG_BYTES, num_replicas=_replicas), timeout_s)
    return await open_kv_bucket(js, FINGERPRINT_KV_BUCKET, "latest node fingerprint (fleetmend inventory)",
                                timeout_s=max(timeout_s, 10.0), direct=True)  # a node reads its own key only
