"""`WebhookTicketFiler`: file tickets by POSTing JSON to a webhook (a `TicketFiler`).

POSTs a JSON document with `Idempotency-Key: <incident_id>` and records the remote id in the local
ledger (`LocalTicketStore`), so a second `file()` for the same incident does not POST again. 5xx
and connection errors are retried (bounded, tenacity); a 4xx is a `TicketRejectedError` (never retried).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict

import httpx
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

import fleetmend
from activities.ticket_kv import KvTicketStore
from activities.ticket_store import DEFAULT_REPAIRED_STATUSES, LocalTicketStore, poll_ledger
from fleetmend.errors import TicketError, TicketNotFoundError, TicketRejectedError
from fleetmend.messages import TicketRef, TicketRequest, TicketStatus, TicketUpdate


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

    def __init__(self, url: str, headers: dict[str, str] | None, timeout_s: float, local: "LocalTicketStore | KvTicketStore",
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
            ref = await self.local.record(
                req, ticket_id=remote_id, url=url,
                extra={"webhook_url": self.url, "remote_status_code": resp.status_code})
            # Another process may have recorded first: the ledger's answer wins; the remote side
            # deduplicated the POST by Idempotency-Key.
            return TicketRef(ref.ticket_id, ref.url, created=ref.created)

    async def update(self, upd: TicketUpdate) -> None:
        """Record the update in the ledger; POST it to `update_url` when configured.

        Raises:
            TicketError: unknown ticket, or the update POST failed.
        """
        doc = await self.local.update_record(upd)
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

    async def list_all(self) -> list[dict]:
        return await self.local.list_all()
