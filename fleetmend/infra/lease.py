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

import asyncio
import contextlib
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


# ---------------------------------------------------------------- presence: which processes serve which cluster

PRESENCE_RENEW_S = 10.0
"""A running worker or router rewrites its presence keys this often."""
PRESENCE_STALE_S = 45.0
"""A presence key not rewritten for this long (four missed renewals and a little clock skew) is a process that is
gone: its cluster counts as unserved by it. The age is the reader's clock against the writer's (`at`, Unix time):
hosts of one deployment keep NTP time, far inside this."""
PRESENCE_FORGET_S = 3600.0
"""A presence key this stale is deleted by the next process of its role and cluster that starts (a killed
process never deletes its own)."""


class Presence:
    """One process's announcement that it serves some clusters: key `subjects.presence_kv_key(role, cluster,
    holder)` of the lease bucket, value `{"holder", "role", "cluster", "at", "started_at", ...info}` (JSON,
    `at` in Unix seconds), rewritten every `renew_s` by `run` and deleted on a clean stop. Readers:
    `presence`. A worker announces the cluster it drains (`fleetmend worker`), a router its own cluster and
    the subjects it consumes.

    Args:
        js: JetStream (the lease bucket is opened, or created, by `run`).
        role: `worker` or `router`.
        clusters: the clusters this process serves.
        holder: this process (`default_holder()`).
        info: more fields for the value (e.g. the task queue).
    """

    def __init__(self, js: Any, role: str, clusters: list[str], holder: str | None = None,
                 info: dict[str, Any] | None = None, renew_s: float = PRESENCE_RENEW_S) -> None:
        self.js, self.role, self.clusters = js, role, list(clusters)
        self.kv: Any = None
        self.holder = holder or default_holder()
        self.info = dict(info or {})
        self.renew_s = renew_s
        self.started_at = time.time()
        self.keys = [subjects.presence_kv_key(role, c, self.holder) for c in self.clusters]

    async def announce(self) -> None:
        """Write this process's keys once. Raises what the NATS client raises."""
        if self.kv is None:
            self.kv = await lease_bucket(self.js)
        for cluster, key in zip(self.clusters, self.keys, strict=True):
            await self.kv.put(key, json.dumps({**self.info, "holder": self.holder, "role": self.role,
                                               "cluster": cluster, "at": time.time(),
                                               "started_at": self.started_at}).encode())

    async def withdraw(self) -> None:
        """Delete this process's keys (clean stop); failures are left to staleness."""
        if self.kv is None:
            return
        for key in self.keys:
            try:
                await self.kv.delete(key)
            except Exception:  # noqa: BLE001 - NATS away: the key goes stale in PRESENCE_STALE_S
                pass

    async def forget_stale(self) -> int:
        """Delete keys of this role and these clusters not rewritten for `PRESENCE_FORGET_S` (processes
        that were killed). Returns how many."""
        gone = 0
        if self.kv is None:
            self.kv = await lease_bucket(self.js)
        for p in await presence(self.js, self.role):
            if p["cluster"] in self.clusters and p["age_s"] > PRESENCE_FORGET_S:
                try:
                    await self.kv.delete(subjects.presence_kv_key(self.role, p["cluster"], p["holder"]))
                    gone += 1
                except Exception:  # noqa: BLE001 - another process deleted it, or no permission
                    pass
        return gone

    async def run(self, stop: Any, log: Any) -> None:
        """Announce every `renew_s` until `stop` (an `asyncio.Event`) is set, or the task is cancelled, then
        withdraw. A failed write is logged and retried at the next renewal (readers see the key age meanwhile)."""
        failing = False
        try:
            try:
                await self.forget_stale()
            except Exception:  # noqa: BLE001 - housekeeping only
                pass
            while not stop.is_set():
                try:
                    await self.announce()
                    if failing:
                        log.info("presence_announced", role=self.role, clusters=self.clusters)
                    failing = False
                except Exception as err:  # noqa: BLE001 - NATS away: try again at the next renewal
                    if not failing:
                        log.warning("presence_not_announced", role=self.role, clusters=self.clusters, error=repr(err))
                    failing = True
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=self.renew_s)
        finally:
            await self.withdraw()


async def presence(js: Any, role: str | None = None, cluster: str | None = None,
                   bucket: str = subjects.LEASE_KV_BUCKET, timeout_s: float = 5.0) -> list[dict[str, Any]]:
    """Every presence key (`Presence`) of `role` and `cluster` (None: any), each its value with `age_s` (seconds
    since its last rewrite, by this host's clock) and `alive` (`age_s` < `PRESENCE_STALE_S`), sorted by
    role, cluster and holder; [] when the bucket does not exist yet.

    Raises:
        TimeoutError: NATS did not answer within `timeout_s`.
        nats.js.errors.APIError: no permission to read the bucket.
    """
    from nats.js.errors import NotFoundError

    from fleetmend.infra.jetstream import kv_keys

    prefix = f"{subjects.PRESENCE_KEY_PREFIX}." + (f"{role}." if role else "") + (f"{cluster}." if role and cluster
                                                                                  else "")
    try:
        keys = await kv_keys(js, bucket, prefix, timeout_s)
    except NotFoundError:
        return []
    kv = await js.key_value(bucket)
    now = time.time()
    out = []
    for key in keys:
        try:
            r, c, holder = subjects.parse_presence_kv_key(key)
        except ValueError:
            continue
        if cluster is not None and c != cluster:
            continue
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:  # deleted (a clean stop)
            continue
        try:
            value = json.loads(entry.value or b"{}")
        except ValueError:
            continue
        age = max(0.0, now - float(value.get("at") or 0))
        out.append({**value, "role": r, "cluster": c, "holder": holder, "age_s": age, "alive": age < PRESENCE_STALE_S})
    return out


def served_clusters(rows: list[dict[str, Any]], role: str = "worker") -> set[str]:
    """The clusters with at least one live process of `role` among `presence` rows."""
    return {r["cluster"] for r in rows if r["role"] == role and r["alive"]}


def unserved_reason(cluster: str) -> str:
    """What `fleetmend status` and the incident's summary say of a cluster that no live worker serves."""
    return f"no worker serves cluster {cluster}: start `fleetmend worker --cluster {cluster}`"
