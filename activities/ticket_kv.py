"""`KvTicketStore`: the deployment's one ticket ledger, in a JetStream key-value bucket.

Every worker replica (and `fleetmend tickets`) reads and writes the same bucket
(`fleetmend.subjects.TICKET_KV_BUCKET`, file storage, replicated like the NATS cluster), so a ticket
filed by one replica is found by the others, and an incident retried on another replica never gets
a second ticket. Same interface as the file ledger `LocalTicketStore` (the default filer, and the
webhook and Jira filers' ledger).

Keys: `t.<ticket id>` → the ticket document (request fields, full evidence, status, history);
`i.<sha1(incident id)>` → `{"ticket_id": …}`; `seq` → the last `FM-` number.

Idempotent filing holds across replicas and crashes: the incident's index key is written first with
compare-and-set (`create`), so of two replicas filing the same incident one wins and the other
adopts its ticket id; a crash after the index and before the ticket document leaves the index, and
the retry finishes the ticket under that id. Ids come from `seq`, advanced with compare-and-set.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from dataclasses import asdict
from datetime import datetime, timezone
from typing import Any

from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError

import fleetmend
from activities.ticket_store import DEFAULT_REPAIRED_STATUSES
from fleetmend import subjects
from fleetmend.errors import TicketError, TicketNotFoundError
from fleetmend.infra.jetstream import kv_config, kv_keys
from fleetmend.infra.retry import LostRace, until_won
from fleetmend.messages import TicketRef, TicketRequest, TicketStatus, TicketUpdate


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def ticket_key(ticket_id: str) -> str:
    """`t.<id>` when the id is a valid key token, else `t.h<sha1>` (webhook ids can be anything)."""
    if re.fullmatch(r"[A-Za-z0-9_-]{1,100}", ticket_id):
        return f"t.{ticket_id}"
    return "t.h" + hashlib.sha1(ticket_id.encode()).hexdigest()


def incident_key(incident_id: str) -> str:
    return "i." + hashlib.sha1(incident_id.encode()).hexdigest()


class KvTicketStore:
    """The ticket ledger in JetStream KV (see module docstring).

    Args:
        js: a JetStream context (the worker's, or the CLI's).
        bucket: default `subjects.TICKET_KV_BUCKET`.
        prefix: ticket id prefix of the local filer; ids look like `FM-000123`.
        repaired_statuses: statuses that mean repaired for `poll` (case-insensitive).
        timeout_s: per KV call.
    """

    name = "local"

    def __init__(self, js: Any, bucket: str = subjects.TICKET_KV_BUCKET, prefix: str = "FM",
                 repaired_statuses: list[str] | None = None, timeout_s: float = 10.0) -> None:
        self.js, self.bucket, self.prefix, self.timeout_s = js, bucket, prefix, timeout_s
        self.repaired = {x.lower() for x in (repaired_statuses or DEFAULT_REPAIRED_STATUSES)}
        self._kv: Any = None
        self.directory = f"JetStream KV bucket {bucket}"
        """Where the ledger is, for messages (the file ledger's attribute of the same name)."""

    async def kv(self) -> Any:
        """The bucket, created on first use."""
        if self._kv is None:
            async with asyncio.timeout(self.timeout_s):
                try:
                    self._kv = await self.js.key_value(self.bucket)
                except BucketNotFoundError:
                    self._kv = await self.js.create_key_value(kv_config(  # bounded: issue 27
                        self.bucket, "fleetmend ticket ledger (one per deployment)", history=5))
        return self._kv

    async def _get(self, key: str) -> tuple[Any, int]:
        kv = await self.kv()
        try:
            e = await kv.get(key)
        except KeyNotFoundError:
            return None, 0
        return json.loads(e.value or b"null"), e.revision or 0

    async def _next_id(self) -> str:
        kv = await self.kv()

        async def one_round() -> str:
            last, rev = await self._get("seq")
            n = int(last or 0) + 1
            while (await self._get(ticket_key(f"{self.prefix}-{n:06d}")))[0] is not None:
                n += 1  # a lost counter never reuses an id
            try:
                if rev:
                    await kv.update("seq", json.dumps(n).encode(), last=rev)
                else:
                    await kv.create("seq", json.dumps(n).encode())
            except KeyWrongLastSequenceError:
                raise LostRace("seq") from None  # another replica took this number: read again
            return f"{self.prefix}-{n:06d}"

        return await until_won(one_round, attempts=None)  # tenacity (fleetmend.infra.retry), until it wins

    async def find_by_incident(self, incident_id: str) -> dict | None:
        """The ticket filed for `incident_id`, or None."""
        idx, _ = await self._get(incident_key(incident_id))
        return (await self._get(ticket_key(idx["ticket_id"])))[0] if idx else None

    async def record(self, req: TicketRequest, *, ticket_id: str | None = None, url: str | None = None,
                     extra: dict | None = None) -> TicketRef:
        """File `req` unless its incident has a ticket. `ticket_id` None allocates the next `FM-` id.

        Returns:
            `TicketRef`; created=False with the existing ticket when the incident already has one.
        Raises:
            TicketError: `ticket_id` is already the ticket of another incident.
        """
        kv = await self.kv()
        ikey = incident_key(req.incident_id)
        idx, _ = await self._get(ikey)
        if idx is None:
            tid = ticket_id or await self._next_id()
            other, _ = await self._get(ticket_key(tid))
            if other is not None:
                raise TicketError(f"ticket {tid} already exists in {self.directory} for incident "
                                  f"{other.get('incident_id')}")
            try:  # index first, compare-and-set: one winner per incident, whatever replicas race
                await kv.create(ikey, json.dumps({"ticket_id": tid, "incident_id": req.incident_id}).encode())
                idx = {"ticket_id": tid}
            except KeyWrongLastSequenceError:
                idx, _ = await self._get(ikey)
                assert idx is not None
        tid = idx["ticket_id"]
        existing, _ = await self._get(ticket_key(tid))
        if existing is not None:
            return TicketRef(tid, existing.get("url"), created=False)
        # No document yet: this call won the index, or a crash came between index and ticket.
        now = _now()
        doc = {**asdict(req), "ticket_id": tid, "url": url, "status": "open", "filed_at": now, "updated_at": now,
               "history": [{"at": now, "status": "open", "comment": "filed"}],
               "fleetmend_version": fleetmend.__version__, **(extra or {})}
        try:
            await kv.create(ticket_key(tid), json.dumps(doc, default=str).encode())
        except KeyWrongLastSequenceError:  # a racing replica finished it first
            existing, _ = await self._get(ticket_key(tid))
            return TicketRef(tid, (existing or {}).get("url"), created=False)
        return TicketRef(tid, url, created=True)

    async def update_record(self, upd: TicketUpdate) -> dict:
        """Append to the ticket's history and set its status (compare-and-set, retried). Returns it.

        Raises:
            TicketNotFoundError: no such ticket in the ledger.
        """
        kv = await self.kv()

        async def one_round() -> dict:
            doc, rev = await self._get(ticket_key(upd.ticket_id))
            if doc is None:
                raise TicketNotFoundError(f"ticket {upd.ticket_id} (incident {upd.incident_id}) not found in "
                                          f"{self.directory}")
            now = _now()
            doc["history"].append({"at": now, "status": upd.status, "comment": upd.comment,
                                   "incident_id": upd.incident_id})
            doc["status"], doc["updated_at"] = upd.status, now
            try:
                await kv.update(ticket_key(upd.ticket_id), json.dumps(doc, default=str).encode(), last=rev)
            except KeyWrongLastSequenceError:
                raise LostRace(upd.ticket_id) from None
            return doc

        return await until_won(one_round, attempts=None)  # tenacity (fleetmend.infra.retry), until it wins

    async def list_all(self) -> list[dict]:
        """Every ticket, oldest filed first (for `fleetmend tickets`)."""
        await self.kv()  # creates the bucket on first use
        docs = []
        for k in await kv_keys(self.js, self.bucket, "t.", timeout_s=self.timeout_s):
            doc, _ = await self._get(k)
            if doc:
                docs.append(doc)
        return sorted(docs, key=lambda d: (d.get("filed_at", ""), d["ticket_id"]))

    # -- TicketFiler ----------------------------------------------------------------------------

    async def file(self, req: TicketRequest) -> TicketRef:
        """File a ticket in the ledger for `req.incident_id` (idempotent across replicas)."""
        return await self.record(req)

    async def update(self, upd: TicketUpdate) -> None:
        await self.update_record(upd)

    async def get(self, ticket_id: str) -> dict | None:
        return (await self._get(ticket_key(ticket_id)))[0]

    async def poll(self, ticket_id: str) -> TicketStatus:
        """The ledger's status of `ticket_id`. Raises TicketNotFoundError for an unknown ticket."""
        doc = await self.get(ticket_id)
        if doc is None:
            raise TicketNotFoundError(f"ticket {ticket_id} not found in {self.directory}")
        status = str(doc.get("status", ""))
        return TicketStatus(ticket_id, status, status.lower() in self.repaired, doc.get("url"), "ticket ledger")
