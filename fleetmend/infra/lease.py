"""A lease in a JetStream key-value bucket: one holder at a time among the replicas of a process.

Used to elect the one worker replica that publishes a cluster's fleet-level gauges (incidents by
phase, drains in force, breaker, time between incidents) and the one router replica that publishes
the consumer lag, so a dashboard that sums over replicas does not count the fleet twice.

The rule needs no synchronised clocks. The holder writes its key with compare-and-set on the
revision it last wrote (`KeyValue.update(last=...)`) every `ttl_s / 3`; a contender that sees the
same revision unchanged for `ttl_s` by its own monotonic clock takes the key over with
compare-and-set on that revision, so of two contenders exactly one wins. A holder that cannot renew
(NATS away) counts itself the holder only until `ttl_s` after its last successful write, which is
before any contender's `ttl_s` of seeing that write unchanged has passed. A holder that stops
cleanly deletes its key (`release`), and the next contender takes it at its next tick.
"""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import datetime, timezone
from typing import Any, Callable

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from fleetmend import subjects
from fleetmend.infra.jetstream import open_kv_bucket

DEFAULT_TTL_S = 30.0
"""A dead holder is replaced within 30-40 s: a gauge at most that stale, against one KV write per
holder every 10 s."""


def default_holder() -> str:
    """`<host>:<pid>`: unique among the replicas of one deployment, readable in `nats kv get`."""
    return f"{socket.gethostname()}:{os.getpid()}"


async def lease_bucket(js: Any, bucket: str = subjects.LEASE_KV_BUCKET, ttl_s: float = DEFAULT_TTL_S,
                       timeout_s: float = 10.0) -> Any:
    """The lease bucket, created on first use (file storage, history 1).

    Returns:
        `nats.js.kv.KeyValue`.
    Raises:
        TimeoutError: JetStream did not answer within `timeout_s`.
        nats.js.errors.APIError: the server refused (e.g. no JetStream in the account).
    """
    return await open_kv_bucket(js, bucket, "fleetmend leases: which replica publishes the fleet-level gauges",
                                timeout_s)


def lease_key(role: str, cluster: str) -> str:
    """`<role>.<cluster>`, e.g. `incident-poller.local`. Raises ValueError for an invalid name."""
    return f"{subjects._check('role', role)}.{subjects._check('cluster', cluster)}"


class KvLease:
    """One key of the lease bucket, contended for by every replica of a role.

    Args:
        kv: the bucket (`lease_bucket`).
        key: `lease_key(role, cluster)`.
        holder: this replica's name (`default_holder()`).
        ttl_s: seconds (> 0) a holder's write stays good; `tick` must be called at least every
            `ttl_s / 3` by the holder.
        clock: monotonic seconds (tests drive it).
    """

    def __init__(self, kv: Any, key: str, holder: str, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease ttl_s must be > 0, got {ttl_s}")
        self.kv, self.key, self.holder, self.ttl_s, self._clock = kv, key, holder, ttl_s, clock
        self._revision: int | None = None  # the revision this holder last wrote
        self._valid_until = 0.0
        self._seen: tuple[int, float] | None = None  # (revision another holder wrote, when first seen)

    @property
    def held(self) -> bool:
        """Whether this replica holds the lease now (by its own clock)."""
        return self._revision is not None and self._clock() < self._valid_until

    def _value(self) -> bytes:
        return json.dumps({"holder": self.holder,
                           "renewed_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}).encode()

    def _won(self, revision: int, at: float) -> bool:
        self._revision, self._valid_until, self._seen = revision, at + self.ttl_s, None
        return True

    async def tick(self) -> bool:
        """Acquire, renew or watch the lease once. Returns whether this replica holds it now.

        Raises:
            Exceptions of the NATS client other than a lost compare-and-set (NATS away): the holder
            then still counts as holding until its write expires (`held`).
        """
        now = self._clock()
        if self._revision is not None:
            try:
                return self._won(await self.kv.update(self.key, self._value(), last=self._revision), now)
            except KeyWrongLastSequenceError:
                self._revision = None  # taken over (we were away longer than ttl_s) or deleted
        try:
            entry = await self.kv.get(self.key)
        except KeyNotFoundError:
            try:
                return self._won(await self.kv.create(self.key, self._value()), now)
            except KeyWrongLastSequenceError:
                return False  # another replica created it first
        assert entry.revision is not None
        if self._seen is None or self._seen[0] != entry.revision:
            self._seen = (entry.revision, now)
            return False
        if now - self._seen[1] < self.ttl_s:
            return False
        try:  # unchanged for ttl_s: its holder is gone
            return self._won(await self.kv.update(self.key, self._value(), last=entry.revision), now)
        except KeyWrongLastSequenceError:
            return False

    async def release(self) -> None:
        """Give the lease up (clean stop): delete the key if this replica still holds it."""
        if self._revision is None:
            return
        try:
            await self.kv.delete(self.key, last=self._revision)
        except KeyWrongLastSequenceError:
            pass
        finally:
            self._revision = None

    async def holder_now(self) -> str | None:
        """Who holds the key according to the bucket (for `status` output); None when nobody."""
        try:
            entry = await self.kv.get(self.key)
        except KeyNotFoundError:
            return None
        return json.loads(entry.value or b"{}").get("holder")
