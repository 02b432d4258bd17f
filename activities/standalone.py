"""Adapters for hosts without a workload scheduler (each a `SchedulerAdapter`).

- `StandaloneScheduler`: the drained set is a JetStream key-value bucket (`subjects.DRAIN_KV_BUCKET`),
  written with optimistic concurrency (create / update-with-revision).
- `NoopScheduler`: `scheduler = "none"`; drains nothing, says so.
"""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from nats.js.errors import APIError, BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError

from fleetmend import subjects
from fleetmend.errors import SchedulerError
from fleetmend.infra.jetstream import kv_config, kv_keys
from fleetmend.infra.retry import LostRace, until_won
from fleetmend.messages import OWNER_FLEETMEND, OWNER_OPERATOR, DrainResult, NodeInfo, UndrainResult

if TYPE_CHECKING:
    from nats.js import JetStreamContext
    from nats.js.kv import KeyValue


_WRONG_LAST_SEQUENCE = 10071
"""JetStream API error code: expected last subject sequence mismatch (optimistic concurrency)."""
CAS_TRIES = 5
"""Compare-and-set rounds of a drain or undrain before it gives up (`SchedulerError`)."""


class StandaloneScheduler:
    """The drained set of a cluster without a scheduler, in a JetStream KV bucket.

    Key = `subjects.drain_kv_key(cluster, node)` (`<cluster>.<node token>`: clusters sharing one NATS
    account never share a record); value = JSON `{"reason", "incident_id", "owner":
    "fleetmend"|"operator", "at"}`. An undrain removes a fleetmend entry only when its `incident_id` is
    the undraining incident's; a later incident of the same node adopts an earlier incident's entry
    when it drains (one incident per node runs at a time). Entries written before keys carried the
    cluster (key = the node name) are still removed by the incident that wrote them.
    A deleted key (tombstone; history ≥ 5 keeps the trail) means "in service". Writes use
    `create` / `update(last=revision)` / `delete(last=revision)` so concurrent workers can't
    double-drain or remove a drain that changed under them.

    Args:
        js: JetStream context.
        cluster: the cluster whose drained set this is (`Settings.cluster`).
        bucket: KV bucket name (created if missing: file storage, history 5).
        op_timeout_s: bound on each KV round trip.
    """

    name = "standalone"
    STATE_DRAINED = "drained"
    STATE_IN_SERVICE = "in_service"

    def __init__(self, js: JetStreamContext, cluster: str = "local", bucket: str = subjects.DRAIN_KV_BUCKET,
                 op_timeout_s: float = 10.0) -> None:
        self.js = js
        self.cluster = cluster
        subjects.drain_kv_key(cluster, "x")  # validates the cluster name
        self.bucket = bucket
        self.op_timeout_s = op_timeout_s
        self._kv: KeyValue | None = None

    async def kv(self) -> KeyValue:
        """The bucket, created on first use if missing."""
        if self._kv is None:
            async with asyncio.timeout(self.op_timeout_s):
                try:
                    self._kv = await self.js.key_value(self.bucket)
                except BucketNotFoundError:
                    self._kv = await self.js.create_key_value(kv_config(  # bounded: issue 27
                        self.bucket, "fleetmend drained nodes (standalone scheduler)", history=5))
        return self._kv

    def key(self, node: str) -> str:
        """This cluster's KV key of `node`. Raises ValueError for an invalid node name."""
        return subjects.drain_kv_key(self.cluster, node)

    async def _entry(self, node: str, key: str | None = None) -> tuple[dict[str, Any] | None, int]:
        """(value, revision) of `node`'s key (or of `key` as given); (None, 0) when not drained."""
        kv = await self.kv()
        async with asyncio.timeout(self.op_timeout_s):
            try:
                e = await kv.get(key or self.key(node))
            except KeyNotFoundError:  # never written, or a delete tombstone (`create` handles both)
                return None, 0
        if not e.value or e.operation in ("DEL", "PURGE"):
            return None, 0
        return json.loads(e.value), e.revision or 0

    @staticmethod
    def _doc(reason: str, incident_id: str | None, owner: str) -> bytes:
        return json.dumps({"reason": reason, "incident_id": incident_id, "owner": owner,
                           "at": datetime.now(timezone.utc).isoformat()}).encode()

    async def _write(self, node: str, value: bytes, revision: int) -> bool:
        """create (revision 0) or update-with-revision. False when someone else wrote first."""
        kv = await self.kv()
        async with asyncio.timeout(self.op_timeout_s):
            try:
                if revision == 0:
                    await kv.create(self.key(node), value)
                else:
                    await kv.update(self.key(node), value, last=revision)
                return True
            except KeyWrongLastSequenceError:
                return False

    async def state(self, node: str) -> str:
        """`drained` or `in_service` (the standalone adapter has no inventory: any name is valid)."""
        entry, _ = await self._entry(node)
        return self.STATE_DRAINED if entry else self.STATE_IN_SERVICE

    async def drain(self, node: str, reason: str, incident_id: str) -> DrainResult:
        """Record `node` as drained by fleetmend unless any drain entry exists.

        Returns:
            `DrainResult` (same ownership semantics as `SlurmScheduler.drain`).
        Raises:
            SchedulerError: the KV write kept conflicting (5 attempts).
        """
        async def one_round() -> DrainResult:
            entry, rev = await self._entry(node)
            if entry and entry.get("owner") == OWNER_FLEETMEND and entry.get("incident_id") != incident_id:
                # an earlier incident's drain of this node: adopt it, so this incident's undrain may lift it
                adopted = {**entry, "incident_id": incident_id, "adopted_from": entry.get("incident_id"),
                           "at": datetime.now(timezone.utc).isoformat()}
                if not await self._write(node, json.dumps(adopted).encode(), rev):
                    raise LostRace(node)
                return DrainResult(node, True, True, False, self.STATE_DRAINED,
                                   f"already drained by fleetmend incident {entry.get('incident_id')}; "
                                   "adopted by this incident", reason=entry.get("reason", ""),
                                   raw_state=json.dumps(adopted))
            if entry:
                owned = entry.get("owner") == OWNER_FLEETMEND
                who = "fleetmend" if owned else f"the {entry.get('owner', 'operator')}"
                return DrainResult(node, True, owned, not owned, self.STATE_DRAINED,
                                   f"already drained by {who} (reason {entry.get('reason')!r}, "
                                   f"incident {entry.get('incident_id')}); no write",
                                   reason=entry.get("reason", ""), raw_state=json.dumps(entry))
            if await self._write(node, self._doc(reason, incident_id, OWNER_FLEETMEND), rev):
                return DrainResult(node, True, True, False, self.STATE_DRAINED,
                                   f"drain recorded in KV bucket {self.bucket}", reason=reason)
            raise LostRace(node)

        try:
            return await until_won(one_round, attempts=CAS_TRIES)  # tenacity (fleetmend.infra.retry)
        except LostRace:
            raise SchedulerError(f"drain of {node}: KV bucket {self.bucket} kept changing under us "
                                 f"({CAS_TRIES} tries)") from None

    async def undrain(self, node: str, incident_id: str) -> UndrainResult:
        """Remove `node`'s entry if fleetmend drained it for `incident_id` (delete with the read revision).

        Returns:
            `UndrainResult` as `SlurmScheduler.undrain`; resumed=False, nothing changed, when the entry
            is an operator's or another incident's.
        Raises:
            SchedulerError: the entry kept changing (5 attempts).
        """
        kv = await self.kv()

        async def one_round() -> UndrainResult:
            key = self.key(node)
            entry, rev = await self._entry(node)
            if not entry and subjects.node_token(node) == node:
                legacy, legacy_rev = await self._entry(node, key=node)  # a key written before keys had the cluster
                if legacy and legacy.get("incident_id") == incident_id:
                    key, entry, rev = node, legacy, legacy_rev
            if not entry:
                return UndrainResult(node, False, self.STATE_IN_SERVICE, "not drained; nothing to resume")
            if entry.get("owner") != OWNER_FLEETMEND:
                return UndrainResult(node, False, self.STATE_DRAINED,
                                     f"drain is the {entry.get('owner')}'s (reason {entry.get('reason')!r}); "
                                     "left for the operator", operator_drained=True)
            if entry.get("incident_id") != incident_id:
                return UndrainResult(node, False, self.STATE_DRAINED,
                                     f"the drain belongs to incident {entry.get('incident_id')}, not {incident_id}; "
                                     "left as is")
            try:
                async with asyncio.timeout(self.op_timeout_s):
                    await kv.delete(key, last=rev)
            except APIError as err:
                if err.err_code == _WRONG_LAST_SEQUENCE:
                    raise LostRace(node) from None
                raise SchedulerError(f"undrain of {node} in KV bucket {self.bucket}: {err}") from err
            return UndrainResult(node, True, self.STATE_IN_SERVICE, "drain entry removed")

        try:
            return await until_won(one_round, attempts=CAS_TRIES)  # tenacity (fleetmend.infra.retry)
        except LostRace:
            raise SchedulerError(f"undrain of {node}: KV bucket {self.bucket} kept changing under us "
                                 f"({CAS_TRIES} tries)") from None

    async def operator_drain(self, node: str, reason: str) -> None:
        """An operator's drain (CLI `fleetmend drain`): owner "operator", never removed by `undrain`.
        Overwrites a fleetmend entry (the operator takes the drain over, as a new Slurm reason would)."""
        kv = await self.kv()
        async with asyncio.timeout(self.op_timeout_s):
            await kv.put(self.key(node), self._doc(reason, None, OWNER_OPERATOR))

    async def operator_undrain(self, node: str) -> bool:
        """An operator returns `node` to service whoever drained it. Returns False if it wasn't drained."""
        entry, _ = await self._entry(node)
        if not entry:
            return False
        kv = await self.kv()
        async with asyncio.timeout(self.op_timeout_s):
            await kv.delete(self.key(node))
        return True

    async def list_nodes(self) -> list[NodeInfo]:
        """This cluster's drained nodes, by their real names (in-service nodes are not recorded)."""
        await self.kv()  # creates the bucket on first use
        rows = []
        for k in await kv_keys(self.js, self.bucket, timeout_s=self.op_timeout_s):
            try:
                cluster, node = subjects.parse_drain_kv_key(k)
            except ValueError:
                continue  # a key written before keys had the cluster: the cluster is unknown
            if cluster != self.cluster:
                continue
            entry, _ = await self._entry(node)
            if entry:
                rows.append(NodeInfo(node, self.STATE_DRAINED, entry.get("reason", ""), entry.get("owner"),
                                     entry.get("incident_id")))
        return rows



class NoopScheduler:
    """`scheduler = "none"`: remediation runs (diagnose, ticket) but nothing is ever drained."""

    name = "none"

    async def drain(self, node: str, reason: str, incident_id: str) -> DrainResult:
        return DrainResult(node, False, False, False, "unknown", "scheduler none: nothing drained")

    async def undrain(self, node: str, incident_id: str) -> UndrainResult:
        return UndrainResult(node, False, "unknown", "scheduler none: nothing to resume")

    async def state(self, node: str) -> str:
        return "unknown"

    async def list_nodes(self) -> list[NodeInfo]:
        return []
