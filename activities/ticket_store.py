"""`LocalTicketStore`: tickets as JSON files (the default `TicketFiler`, and every filer's ledger).

One JSON file per ticket (`FM-000123.json`), written atomically (temp file + fsync + `os.replace` +
directory fsync); ids allocated under an `fcntl.flock` so concurrent workers on one host can't
collide; `by-incident/` maps an incident to its ticket (filing is idempotent by `incident_id`).
"""

from __future__ import annotations

import asyncio
import builtins
import fcntl
import hashlib
import json
import os
import re
import tempfile
from contextlib import contextmanager
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Protocol

import fleetmend
from fleetmend.config import TicketSettings
from fleetmend.errors import TicketError, TicketNotFoundError
from fleetmend.messages import TicketRef, TicketRequest, TicketStatus, TicketUpdate

DEFAULT_REPAIRED_STATUSES: list[str] = list(TicketSettings.model_fields["repaired_statuses"].get_default(
    call_default_factory=True))
"""`tickets.repaired_statuses`' default (fleetmend/config.py)."""


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def _safe_name(value: str) -> str:
    """A file name for an id: kept as is when it is `[A-Za-z0-9_.-]`, else sanitized + short hash."""
    if re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,100}", value):
        return value
    digest = hashlib.sha1(value.encode()).hexdigest()[:10]
    return re.sub(r"[^A-Za-z0-9_.-]", "_", value)[:80].lstrip(".") + "-" + digest


def _atomic_write_json(path: Path, doc: Any) -> None:
    """Write `doc` to `path` so a reader sees the old or the new file, never half of one."""
    data = json.dumps(doc, indent=2, sort_keys=True, default=str).encode()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class LocalTicketStore:
    """Tickets as JSON files under `directory` (the default filer, and the webhook filer's ledger).

    Layout: `FM-000123.json` (the ticket: request fields, full evidence, status, history),
    `by-incident/<incident_id>.json` → `{"ticket_id": ...}`, `.seq` (last number), `.lock`.

    Args:
        directory: created if missing.
        prefix: ticket id prefix; ids look like `FM-000123`.
        repaired_statuses: statuses that mean repaired for `poll` (case-insensitive).
    """

    name = "local"

    def __init__(self, directory: Path, prefix: str = "FM", repaired_statuses: list[str] | None = None) -> None:
        self.directory = Path(directory)
        self.repaired = {x.lower() for x in (repaired_statuses or DEFAULT_REPAIRED_STATUSES)}
        self.prefix = prefix
        self._async_lock = asyncio.Lock()

    # -- sync core (runs in a thread: flock blocks) ---------------------------------------------

    @contextmanager
    def _locked(self) -> Iterator[None]:
        (self.directory / "by-incident").mkdir(parents=True, exist_ok=True)
        with open(self.directory / ".lock", "a+") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def _path(self, ticket_id: str) -> Path:
        return self.directory / f"{_safe_name(ticket_id)}.json"

    def _index(self, incident_id: str) -> Path:
        return self.directory / "by-incident" / f"{_safe_name(incident_id)}.json"

    def _read(self, path: Path) -> dict | None:
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None

    def _next_id(self) -> str:
        seq_path = self.directory / ".seq"
        try:
            last = int(seq_path.read_text().strip() or 0)
        except FileNotFoundError:
            last = 0
        n = last + 1
        while self._path(f"{self.prefix}-{n:06d}").exists():  # a lost .seq never reuses an id
            n += 1
        _atomic_write_json(seq_path, n)
        return f"{self.prefix}-{n:06d}"

    def find_by_incident_sync(self, incident_id: str) -> dict | None:
        """The ticket filed for `incident_id`, or None."""
        idx = self._read(self._index(incident_id))
        return self._read(self._path(idx["ticket_id"])) if idx else None

    def record_sync(self, req: TicketRequest, *, ticket_id: str | None = None, url: str | None = None,
                    extra: dict | None = None) -> TicketRef:
        """File `req` unless its incident has a ticket. `ticket_id` None allocates the next `FM-` id.

        Returns:
            `TicketRef`; created=False with the existing ticket when the incident already has one.
        """
        with self._locked():
            idx = self._read(self._index(req.incident_id))
            existing = self._read(self._path(idx["ticket_id"])) if idx else None
            if existing:
                return TicketRef(existing["ticket_id"], existing.get("url"), created=False)
            if idx:
                # A crash after the index write and before the ticket write: finish under that id.
                tid = idx["ticket_id"]
            else:
                tid = ticket_id or self._next_id()
                if self._path(tid).exists():
                    raise TicketError(f"ticket {tid} already exists in {self.directory} for another incident")
                # Index first: whatever a crash leaves, a retry finds this incident's one ticket id.
                _atomic_write_json(self._index(req.incident_id), {"ticket_id": tid})
            now = _now()
            doc = {**asdict(req), "ticket_id": tid, "url": url, "status": "open", "filed_at": now,
                   "updated_at": now, "history": [{"at": now, "status": "open", "comment": "filed"}],
                   "fleetmend_version": fleetmend.__version__, **(extra or {})}
            _atomic_write_json(self._path(tid), doc)
            return TicketRef(tid, url, created=True)

    def update_sync(self, upd: TicketUpdate) -> dict:
        """Append to the ticket's history and set its status. Returns the ticket.

        Raises:
            TicketNotFoundError: no such ticket in this store.
        """
        with self._locked():
            doc = self._read(self._path(upd.ticket_id))
            if doc is None:
                raise TicketNotFoundError(
                    f"ticket {upd.ticket_id} (incident {upd.incident_id}) not found in {self.directory}")
            now = _now()
            doc["history"].append({"at": now, "status": upd.status, "comment": upd.comment,
                                   "incident_id": upd.incident_id})
            doc["status"], doc["updated_at"] = upd.status, now
            _atomic_write_json(self._path(upd.ticket_id), doc)
            return doc

    def list(self) -> list[dict]:
        """Every ticket, oldest filed first (for `fleetmend tickets`)."""
        if not self.directory.exists():
            return []
        docs = []
        for p in self.directory.glob("*.json"):
            doc = self._read(p)
            if doc and "ticket_id" in doc:
                docs.append(doc)
        return sorted(docs, key=lambda d: (d.get("filed_at", ""), d["ticket_id"]))

    # -- TicketFiler ----------------------------------------------------------------------------

    async def file(self, req: TicketRequest) -> TicketRef:
        """File a local ticket for `req.incident_id` (idempotent).

        Returns:
            `TicketRef(ticket_id="FM-000123", url=None, created=...)`.
        """
        async with self._async_lock:
            return await asyncio.to_thread(self.record_sync, req)

    async def update(self, upd: TicketUpdate) -> None:
        """Record a status change / comment. Raises TicketError for an unknown ticket."""
        async with self._async_lock:
            await asyncio.to_thread(self.update_sync, upd)

    async def get(self, ticket_id: str) -> dict | None:
        """The ticket document, or None."""
        return await asyncio.to_thread(self._read, self._path(ticket_id))

    async def find_by_incident(self, incident_id: str) -> dict | None:
        return await asyncio.to_thread(self.find_by_incident_sync, incident_id)

    # -- the ledger interface the webhook and Jira filers use (shared with `KvTicketStore`) --------

    async def record(self, req: TicketRequest, *, ticket_id: str | None = None, url: str | None = None,
                     extra: dict | None = None) -> TicketRef:
        """`record_sync` in a thread (see there)."""
        return await asyncio.to_thread(self.record_sync, req, ticket_id=ticket_id, url=url, extra=extra)

    async def update_record(self, upd: TicketUpdate) -> dict:
        """`update_sync` in a thread (see there)."""
        return await asyncio.to_thread(self.update_sync, upd)

    async def list_all(self) -> builtins.list[dict]:
        return await asyncio.to_thread(self.list)

    async def poll(self, ticket_id: str) -> TicketStatus:
        """The ledger's status of `ticket_id`. Raises TicketNotFoundError for an unknown ticket."""
        return await poll_ledger(self, ticket_id, self.repaired)


class TicketLedger(Protocol):
    """What `poll_ledger` reads: the local file ledger or the JetStream KV one (`activities.ticket_kv`)."""

    @property
    def directory(self) -> str | Path: ...

    async def get(self, ticket_id: str) -> dict | None: ...


async def poll_ledger(local: TicketLedger, ticket_id: str, repaired: set[str]) -> TicketStatus:
    """`TicketStatus` from the local ledger (local filer; webhook without a status URL)."""
    doc = await local.get(ticket_id)
    if doc is None:
        raise TicketNotFoundError(f"ticket {ticket_id} not found in {local.directory}")
    status = str(doc.get("status", ""))
    return TicketStatus(ticket_id, status, status.lower() in repaired, doc.get("url"), "local ledger")
