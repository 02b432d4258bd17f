"""Ticket filers (vendor/RMA tickets with an evidence bundle) and their Temporal activities.

Filing is idempotent by `incident_id`: a retried activity, a second worker or a replayed workflow
gets the ticket that already exists (`TicketRef.created=False`), never a second one.

- `LocalTicketStore(directory)`: one JSON file per ticket (`FM-000123.json`), written atomically
  (temp file + fsync + `os.replace` + directory fsync); ids allocated under an `fcntl.flock` so
  concurrent workers on one host can't collide; `by-incident/` maps an incident to its ticket.
- `WebhookTicketFiler(url, headers, timeout_s, local)`: POSTs a JSON document with
  `Idempotency-Key: <incident_id>` and records the remote id in the local store, so a second
  `file()` for the same incident does not POST again. 5xx and connection errors are retried (bounded,
  tenacity); a 4xx is a `TicketRejectedError` (never retried).

- `JiraTicketFiler` (activities/jira.py): Jira REST v2, idempotent by an incident label.

`TicketActivities(filer)` exposes `file_ticket`, `update_ticket` and `poll_ticket` (the ticket
system as a source of "repaired") for the worker.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import re
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Protocol, runtime_checkable

import httpx
from temporalio import activity
from temporalio.exceptions import ApplicationError
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

import fleetmend
from fleetmend import metrics
from fleetmend.config import Settings, TicketKind
from fleetmend.errors import ConfigError, TicketError


@dataclass
class TicketRequest:
    incident_id: str
    cluster: str
    node: str
    title: str
    severity: str
    fault_class: str
    evidence: dict
    """Raw lines, classification, diagnostics report: stored (and sent) in full."""


@dataclass
class TicketRef:
    ticket_id: str
    url: str | None
    created: bool
    """False when the incident already had a ticket (idempotent re-file)."""


@dataclass
class TicketUpdate:
    ticket_id: str
    incident_id: str
    status: str
    comment: str


@dataclass
class TicketStatus:
    """What `poll_ticket` reports: the ticket system's own status and whether it means repaired."""

    ticket_id: str
    status: str
    """The remote status name as the ticket system says it (Jira "Done", a webhook's "repaired", …)."""
    repaired: bool
    """`status` is one of `tickets.repaired_statuses` (case-insensitive)."""
    url: str | None = None
    detail: str = ""


class TicketRejectedError(TicketError):
    """The ticket system refused the request (HTTP 4xx): retrying cannot help.

    Attributes:
        status_code: the HTTP status.
    """

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


class TicketNotFoundError(TicketError, LookupError):
    """No ticket with that id in the store."""


@runtime_checkable
class TicketFiler(Protocol):
    name: str

    async def file(self, req: TicketRequest) -> TicketRef: ...

    async def update(self, upd: TicketUpdate) -> None: ...

    async def get(self, ticket_id: str) -> dict | None: ...


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
    """

    name = "local"

    def __init__(self, directory: Path, prefix: str = "FM") -> None:
        self.directory = Path(directory)
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


def _transient(err: BaseException) -> bool:
    return isinstance(err, (httpx.TransportError, _ServerError, TimeoutError))


class _ServerError(TicketError):
    """HTTP 5xx: the ticket system is having trouble; worth retrying."""


class WebhookTicketFiler:
    """File tickets by POSTing JSON to a webhook (Jira/ServiceNow bridge, vendor portal, …).

    Body: `{incident_id, cluster, node, title, severity, fault_class, evidence, fleetmend_version}`;
    headers: `Content-Type: application/json`, `Idempotency-Key: <incident_id>`, plus `headers`.
    The remote id comes from the response JSON `id` or `key`, else the `Location` header's last path
    segment, else the incident id. Updates are recorded in the local ledger, and POSTed to
    `update_url` (`{ticket_id}` substituted) when one is given.

    Args:
        url: webhook URL.
        headers: extra headers (auth tokens).
        timeout_s: bound on each HTTP request.
        local: the ledger (idempotency across restarts).
        max_attempts: POST attempts for 5xx/connection errors (bounded).
        backoff_s: first retry delay; doubles, capped at 10 s.
        update_url: optional URL for updates.
        status_url: optional `{ticket_id}`-templated URL; `GET` answers JSON with a `status` field
            (makes the ticket pollable: `poll`).
        repaired_statuses: statuses that mean repaired for `poll` (case-insensitive).
    """

    name = "webhook"

    def __init__(self, url: str, headers: dict[str, str] | None, timeout_s: float, local: LocalTicketStore,
                 *, max_attempts: int = 4, backoff_s: float = 0.5, update_url: str | None = None,
                 status_url: str | None = None, repaired_statuses: list[str] | None = None) -> None:
        self.status_url = status_url
        self.repaired = {x.lower() for x in (repaired_statuses or DEFAULT_REPAIRED_STATUSES)}
        self.url = url
        self.headers = dict(headers or {})
        self.timeout_s = timeout_s
        self.local = local
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.update_url = update_url
        self._incident_locks: dict[str, asyncio.Lock] = {}

    async def _post(self, url: str, body: dict, idempotency_key: str) -> httpx.Response:
        headers = {**self.headers, "Content-Type": "application/json", "Idempotency-Key": idempotency_key}
        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            async for attempt in AsyncRetrying(
                    stop=stop_after_attempt(self.max_attempts),
                    wait=wait_exponential(multiplier=self.backoff_s, max=10),
                    retry=retry_if_exception(_transient), reraise=True):
                with attempt:
                    async with asyncio.timeout(self.timeout_s):
                        resp = await client.post(url, content=json.dumps(body, default=str), headers=headers)
                    if resp.status_code >= 500:
                        raise _ServerError(f"POST {url} -> {resp.status_code}: {resp.text[:300]}")
                    if resp.status_code >= 400:
                        raise TicketRejectedError(
                            f"POST {url} for incident {body.get('incident_id')} rejected with "
                            f"{resp.status_code}: {resp.text[:300]}; fix the request or the webhook config",
                            resp.status_code)
                    return resp
        raise AssertionError("unreachable")  # pragma: no cover

    @staticmethod
    def _remote_id(resp: httpx.Response, incident_id: str) -> tuple[str, str | None]:
        location = resp.headers.get("location")
        try:
            doc = resp.json()
        except ValueError:
            doc = None
        if isinstance(doc, dict):
            for key in ("id", "key"):
                if doc.get(key) not in (None, ""):
                    return str(doc[key]), doc.get("url") or doc.get("self") or location
        if location:
            return location.rstrip("/").rsplit("/", 1)[-1] or incident_id, location
        return incident_id, None

    async def file(self, req: TicketRequest) -> TicketRef:
        """POST the ticket unless the ledger already holds one for `req.incident_id`.

        Returns:
            `TicketRef(ticket_id=<remote id>, url=<remote url or None>, created=...)`.
        Raises:
            TicketRejectedError: 4xx (not retryable).
            TicketError: 5xx / connection errors after `max_attempts`.
        """
        lock = self._incident_locks.setdefault(req.incident_id, asyncio.Lock())
        async with lock:
            existing = await self.local.find_by_incident(req.incident_id)
            if existing:
                return TicketRef(existing["ticket_id"], existing.get("url"), created=False)
            body = {"incident_id": req.incident_id, "cluster": req.cluster, "node": req.node,
                    "title": req.title, "severity": req.severity, "fault_class": req.fault_class,
                    "evidence": req.evidence, "fleetmend_version": fleetmend.__version__}
            try:
                resp = await self._post(self.url, body, req.incident_id)
            except _ServerError as err:
                raise TicketError(f"webhook {self.url} failed {self.max_attempts} times for incident "
                                  f"{req.incident_id}: {err}") from err
            except (httpx.TransportError, TimeoutError) as err:
                raise TicketError(f"webhook {self.url} unreachable after {self.max_attempts} attempts "
                                  f"for incident {req.incident_id}: {err!r}") from err
            remote_id, url = self._remote_id(resp, req.incident_id)
            ref = await asyncio.to_thread(
                self.local.record_sync, req, ticket_id=remote_id, url=url,
                extra={"webhook_url": self.url, "remote_status_code": resp.status_code})
            # Another process may have recorded first: the ledger's answer wins; the remote side
            # deduplicated the POST by Idempotency-Key.
            return TicketRef(ref.ticket_id, ref.url, created=ref.created)

    async def update(self, upd: TicketUpdate) -> None:
        """Record the update in the ledger; POST it to `update_url` when configured.

        Raises:
            TicketError: unknown ticket, or the update POST failed.
        """
        doc = await asyncio.to_thread(self.local.update_sync, upd)
        if self.update_url:
            body = {**asdict(upd), "fleetmend_version": fleetmend.__version__}
            key = f"{upd.incident_id}/update/{len(doc['history'])}"
            try:
                await self._post(self.update_url.replace("{ticket_id}", upd.ticket_id), body, key)
            except (httpx.TransportError, TimeoutError) as err:
                raise TicketError(f"update of {upd.ticket_id} via {self.update_url}: {err!r}") from err

    async def get(self, ticket_id: str) -> dict | None:
        """The ledger's copy of the ticket, or None."""
        return await self.local.get(ticket_id)

    async def poll(self, ticket_id: str) -> TicketStatus:
        """The remote status (`GET status_url`, JSON `status`), or the ledger's without a status_url.

        Raises:
            TicketNotFoundError: 404 from the status URL, or unknown to the ledger.
            TicketError: the status URL failed or answered without a `status`.
        """
        if not self.status_url:
            return await poll_ledger(self.local, ticket_id, self.repaired)
        url = self.status_url.replace("{ticket_id}", ticket_id)
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s) as client:
                async with asyncio.timeout(self.timeout_s):
                    resp = await client.get(url, headers={**self.headers, "Accept": "application/json"})
        except (httpx.TransportError, TimeoutError) as err:
            raise TicketError(f"ticket status GET {url}: {err!r}; is tickets.webhook_status_url reachable?") from err
        if resp.status_code == 404:
            raise TicketNotFoundError(f"ticket {ticket_id} not found at {url}")
        if resp.status_code >= 400:
            raise TicketError(f"ticket status GET {url} -> {resp.status_code}: {resp.text[:200]}")
        try:
            status = str(resp.json()["status"])
        except (ValueError, KeyError, TypeError) as err:
            raise TicketError(f"ticket status GET {url}: expected JSON with a 'status' field, got "
                              f"{resp.text[:200]!r}") from err
        return TicketStatus(ticket_id, status, status.lower() in self.repaired, None, f"status from {url}")

    def list(self) -> list[dict]:
        return self.local.list()


DEFAULT_REPAIRED_STATUSES = ["Done", "Resolved", "Closed", "repaired"]


async def poll_ledger(local: LocalTicketStore, ticket_id: str, repaired: set[str]) -> TicketStatus:
    """`TicketStatus` from the local ledger (local filer; webhook without a status URL)."""
    doc = await local.get(ticket_id)
    if doc is None:
        raise TicketNotFoundError(f"ticket {ticket_id} not found in {local.directory}")
    status = str(doc.get("status", ""))
    return TicketStatus(ticket_id, status, status.lower() in repaired, doc.get("url"), "local ledger")


def build_ticket_filer(settings: Settings) -> TicketFiler:
    """The filer for `settings.tickets.kind`; the local ledger lives in `settings.state_dir / "tickets"`.

    Raises:
        ConfigError: webhook without `tickets.webhook_url`; jira without url or credentials.
    """
    local = LocalTicketStore(settings.state_dir / "tickets")
    t = settings.tickets
    if t.kind == TicketKind.LOCAL:
        return local
    if t.kind == TicketKind.WEBHOOK:
        if not t.webhook_url:
            raise ConfigError("tickets.kind = webhook needs tickets.webhook_url "
                              "(or FLEETMEND_TICKETS__WEBHOOK_URL)")
        return WebhookTicketFiler(t.webhook_url, t.webhook_headers, t.webhook_timeout_s, local,
                                  status_url=t.webhook_status_url, repaired_statuses=t.repaired_statuses)
    if t.kind == TicketKind.JIRA:
        from activities.jira import JiraTicketFiler

        return JiraTicketFiler(t.jira, local, t.repaired_statuses)
    raise ConfigError(f"unknown ticket kind {t.kind!r}; expected local, webhook, jira")


class TicketActivities:
    """`file_ticket` / `update_ticket` for the worker, bound to one filer.

    Args:
        filer: any `TicketFiler`.
    """

    def __init__(self, filer: TicketFiler, repaired_statuses: list[str] | None = None) -> None:
        self.filer = filer
        self.repaired = {x.lower() for x in (repaired_statuses or DEFAULT_REPAIRED_STATUSES)}

    @activity.defn(name="file_ticket")
    async def file_ticket(self, req: TicketRequest) -> TicketRef:
        """File (or find) the ticket for `req.incident_id`.

        Raises:
            ApplicationError: type "TicketRejected", non-retryable, when the ticket system refuses (4xx).
            TicketError: transient; Temporal retries.
        """
        activity.heartbeat({"phase": "filing", "incident_id": req.incident_id})
        try:
            ref = await self.filer.file(req)
        except TicketRejectedError as err:
            metrics.TICKETS.labels(filer=self.filer.name, outcome="rejected").inc()
            raise ApplicationError(str(err), {"status_code": err.status_code},
                                   type="TicketRejected", non_retryable=True) from err
        metrics.TICKETS.labels(filer=self.filer.name, outcome="filed" if ref.created else "found").inc()
        activity.logger.info("ticket_filed incident_id=%s ticket_id=%s created=%s filer=%s",
                             req.incident_id, ref.ticket_id, ref.created, self.filer.name)
        return ref

    @activity.defn(name="update_ticket")
    async def update_ticket(self, upd: TicketUpdate) -> None:
        """Record a status change on the ticket.

        Raises:
            ApplicationError: "TicketNotFound" or "TicketRejected", non-retryable.
        """
        activity.heartbeat({"phase": "updating", "ticket_id": upd.ticket_id})
        try:
            await self.filer.update(upd)
        except TicketRejectedError as err:
            raise ApplicationError(str(err), type="TicketRejected", non_retryable=True) from err
        except TicketNotFoundError as err:
            raise ApplicationError(str(err), type="TicketNotFound", non_retryable=True) from err
        activity.logger.info("ticket_updated ticket_id=%s status=%s", upd.ticket_id, upd.status)

    @activity.defn(name="poll_ticket")
    async def poll_ticket(self, ticket_id: str) -> TicketStatus:
        """The ticket system's status of `ticket_id` and whether it means repaired.

        Jira: the issue's status name; webhook: `GET tickets.webhook_status_url`; local: the ledger.
        A workflow polls this on a timer while awaiting repair (see README "Tickets as the source of
        repaired").

        Raises:
            ApplicationError: "TicketNotFound" (non-retryable) for a ticket the system doesn't know.
            TicketError: transient (Temporal retries).
        """
        try:
            poll = getattr(self.filer, "poll", None)
            if poll is not None:
                st = await poll(ticket_id)
            elif isinstance(self.filer, LocalTicketStore):
                st = await poll_ledger(self.filer, ticket_id, self.repaired)
            else:
                doc = await self.filer.get(ticket_id)
                if doc is None:
                    raise TicketNotFoundError(f"ticket {ticket_id} not found by filer {self.filer.name}")
                status = str(doc.get("status", ""))
                st = TicketStatus(ticket_id, status, status.lower() in self.repaired, doc.get("url"))
        except TicketNotFoundError as err:
            raise ApplicationError(str(err), type="TicketNotFound", non_retryable=True) from err
        except TicketRejectedError as err:
            raise ApplicationError(str(err), type="TicketRejected", non_retryable=True) from err
        activity.logger.info("ticket_polled ticket_id=%s status=%s repaired=%s", ticket_id, st.status, st.repaired)
        return st
