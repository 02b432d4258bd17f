"""Jira ticket filer (REST API v2), idempotent by incident id, pollable for "repaired".

Calls (Jira REST API v2, the same on Cloud and Data Center unless noted):
- find:    `GET {search_path}?jql=project = "<KEY>" AND labels = "fleetmend-incident-<hash>"`
           (`search_path` = `/rest/api/2/search` on Data Center, `/rest/api/3/search/jql` on Cloud)
- create:  `POST /rest/api/2/issue` `{"fields": {"project": {"key"}, "issuetype": {"name"}, "summary",
           "description" (wiki markup with the evidence), "labels"}}` → 201 `{"id", "key", "self"}`
- attach:  `POST /rest/api/2/issue/{key}/attachments`, multipart field `file`, header
           `X-Atlassian-Token: no-check` (the full evidence bundle as JSON)
- comment: `POST /rest/api/2/issue/{key}/comment` `{"body"}`
- transition: `GET /rest/api/2/issue/{key}/transitions` then `POST` `{"transition": {"id"}}`
- read:    `GET /rest/api/2/issue/{key}?fields=status,summary,resolution`

Idempotency: every issue carries the label `fleetmend-incident-<sha1(incident id)[:16]>`. Before
creating, the filer looks in the local ledger, then searches Jira by that label, so a retried
activity, a second worker or a lost ledger finds the existing issue instead of opening another.
The issue key is recorded in the local ledger (`LocalTicketStore`) like the webhook filer's.

Auth: `email` + `api_token` (Cloud; HTTP Basic) or `bearer_token` (Data Center personal access
token). 5xx, 429 (honouring `Retry-After` up to 30 s) and connection errors are retried
`max_attempts` times; any other 4xx is a `TicketRejectedError` (not retried).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import asdict
from typing import Any

import httpx
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt

import fleetmend
from activities.ticket_kv import KvTicketStore
from activities.ticket_store import LocalTicketStore
from fleetmend.config import JiraSettings
from fleetmend.errors import ConfigError, TicketError, TicketNotFoundError, TicketRejectedError
from fleetmend.messages import TicketRef, TicketRequest, TicketStatus, TicketUpdate

API = "/rest/api/2"
DESCRIPTION_MAX_CHARS = 30_000
"""Jira rejects text fields over 32,767 characters; the description keeps headroom, the full
evidence goes as an attachment."""
RETRY_AFTER_MAX_S = 30.0


def incident_label(incident_id: str) -> str:
    """`fleetmend-incident-<16 hex>`: a Jira label (no spaces, ≤ 255 chars) unique to the incident."""
    return "fleetmend-incident-" + hashlib.sha1(incident_id.encode()).hexdigest()[:16]


def description(req: TicketRequest) -> str:
    """The issue description in Jira wiki markup (REST v2): what, where, and the evidence as JSON."""
    evidence = json.dumps(req.evidence, indent=2, sort_keys=True, default=str)
    head = (f"h3. {req.title}\n\n"
            f"||node|{req.node}|\n||cluster|{req.cluster}|\n||fault class|{req.fault_class}|\n"
            f"||severity|{req.severity}|\n||incident|{req.incident_id}|\n"
            + (f"||runbook|{req.evidence['runbook']}|\n" if req.evidence.get("runbook") else "") + "\n"
            + f"Filed by fleetmend {fleetmend.__version__}. Full evidence attached as "
            f"evidence-{_file_safe(req.incident_id)}.json.\n\n")
    budget = DESCRIPTION_MAX_CHARS - len(head) - 80
    if len(evidence) > budget:
        evidence = evidence[:budget] + "\n… (truncated; see the attachment)"
    return head + "{code:json}\n" + evidence + "\n{code}"


def _file_safe(value: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in value)[:100]


class _Retryable(TicketError):
    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


_TRANSIENT = (_Retryable, httpx.TransportError, TimeoutError)
"""What a Jira call retries: 5xx and 429 answers, connection errors, timeouts."""


class JiraTicketFiler:
    """File, update and poll Jira issues (see module docstring for the REST calls).

    Args:
        settings: `JiraSettings` (url, project, issue type, auth, labels, transitions, timeouts).
        local: the ledger (incident → issue key; statuses and history).
        repaired_statuses: Jira status names that mean "repaired" for `poll` (case-insensitive).
        transport: an `httpx` transport (tests); None uses the network.
        backoff_s: first retry delay; doubles, capped at 10 s.
    Raises:
        ConfigError: no `url`, or no credentials.
    """

    name = "jira"

    def __init__(self, settings: JiraSettings, local: "LocalTicketStore | KvTicketStore", repaired_statuses: list[str],
                 *, transport: httpx.AsyncBaseTransport | None = None, backoff_s: float = 0.5) -> None:
        if not settings.url:
            raise ConfigError("tickets.kind = jira needs tickets.jira.url (FLEETMEND_TICKETS__JIRA__URL), "
                              "e.g. https://example.atlassian.net")
        if not (settings.bearer_token or (settings.email and settings.api_token)):
            raise ConfigError("tickets.kind = jira needs tickets.jira.email + tickets.jira.api_token (Cloud) "
                              "or tickets.jira.bearer_token (Data Center)")
        self.s = settings
        self.base = settings.url.rstrip("/")
        self.local = local
        self.repaired = {x.lower() for x in repaired_statuses}
        self.transport = transport
        self.backoff_s = backoff_s
        self._locks: dict[str, asyncio.Lock] = {}

    def _client(self) -> httpx.AsyncClient:
        headers = {"Accept": "application/json"}
        auth = None
        if self.s.bearer_token:
            headers["Authorization"] = f"Bearer {self.s.bearer_token}"
        else:
            auth = httpx.BasicAuth(self.s.email or "", self.s.api_token or "")
        return httpx.AsyncClient(base_url=self.base, headers=headers, auth=auth, timeout=self.s.timeout_s,
                                 transport=self.transport)

    async def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """One REST call with bounded retries (tenacity): 5xx, 429 and connection errors or timeouts are tried
        `max_attempts` times, `backoff_s` doubling to 10 s apart, or `Retry-After` (up to 30 s) when Jira
        says it. Raises TicketRejectedError (4xx) at once, TicketError after the last try."""
        async with self._client() as client:
            try:
                async for attempt in AsyncRetrying(stop=stop_after_attempt(self.s.max_attempts), wait=self._wait,
                                                   retry=retry_if_exception_type(_TRANSIENT), reraise=True):
                    with attempt:
                        async with asyncio.timeout(self.s.timeout_s):
                            resp = await client.request(method, path, **kw)
                        if resp.status_code == 429 or resp.status_code >= 500:
                            ra = resp.headers.get("retry-after")
                            raise _Retryable(f"{resp.status_code}: {resp.text[:200]}",
                                             float(ra) if ra and ra.isdigit() else None)
                        if resp.status_code >= 400:
                            raise TicketRejectedError(
                                f"Jira {method} {self.base}{path} rejected with {resp.status_code}: "
                                f"{_jira_errors(resp)}; check tickets.jira (project, issue_type, credentials)",
                                resp.status_code)
                        return resp
            except _TRANSIENT as err:
                raise TicketError(f"Jira {method} {self.base}{path} failed {self.s.max_attempts} times: "
                                  f"{type(err).__name__}: {err}; is the Jira URL reachable from the worker?") from err
        raise AssertionError("unreachable: tenacity returns the response or raises the last error")

    def _wait(self, state: RetryCallState) -> float:
        """Seconds before the next try: Jira's `Retry-After` (at most `RETRY_AFTER_MAX_S`) when it sent one, else
        `backoff_s` doubling per try, 10 s at most."""
        err = state.outcome.exception() if state.outcome else None
        if isinstance(err, _Retryable) and err.retry_after_s is not None:
            return min(err.retry_after_s, RETRY_AFTER_MAX_S)
        return min(self.backoff_s * 2 ** (state.attempt_number - 1), 10.0)

    # -- TicketFiler ----------------------------------------------------------------------------

    async def find(self, incident_id: str) -> dict | None:
        """The Jira issue labelled for `incident_id` (`{"key", "id", "fields"}`), or None."""
        jql = f'project = "{self.s.project}" AND labels = "{incident_label(incident_id)}" ORDER BY created ASC'
        resp = await self._request("GET", self.s.search_path,
                                   params={"jql": jql, "fields": "status,summary", "maxResults": "1"})
        issues = resp.json().get("issues") or []
        return issues[0] if issues else None

    async def file(self, req: TicketRequest) -> TicketRef:
        """Create the issue for `req.incident_id` unless the ledger or Jira already has one.

        Returns:
            `TicketRef(ticket_id="OPS-123", url="<base>/browse/OPS-123", created=...)`.
        Raises:
            TicketRejectedError: Jira refused (4xx: bad project, issue type, field, credentials).
            TicketError: Jira unreachable or failing after `max_attempts`.
        """
        lock = self._locks.setdefault(req.incident_id, asyncio.Lock())
        async with lock:
            existing = await self.local.find_by_incident(req.incident_id)
            if existing:
                return TicketRef(existing["ticket_id"], existing.get("url"), created=False)
            found = await self.find(req.incident_id)
            created = found is None
            if found is None:
                fields = {"project": {"key": self.s.project}, "issuetype": {"name": self.s.issue_type},
                          "summary": req.title[:255], "description": description(req),
                          "labels": sorted({*self.s.labels, incident_label(req.incident_id)})}
                resp = await self._request("POST", f"{API}/issue", json={"fields": fields})
                found = resp.json()
                key = found["key"]
                await self._attach(key, f"evidence-{_file_safe(req.incident_id)}.json",
                                   json.dumps({**asdict(req)}, indent=2, default=str).encode())
            key = found["key"]
            url = f"{self.base}/browse/{key}"
            ref = await self.local.record(req, ticket_id=key, url=url,
                                          extra={"jira_url": self.base, "jira_id": str(found.get("id", ""))})
            return TicketRef(ref.ticket_id, ref.url, created=created and ref.created)

    async def _attach(self, key: str, filename: str, data: bytes) -> None:
        await self._request("POST", f"{API}/issue/{key}/attachments",
                            headers={"X-Atlassian-Token": "no-check"},
                            files={"file": (filename, data, "application/json")})

    async def comment(self, key: str, body: str) -> None:
        await self._request("POST", f"{API}/issue/{key}/comment", json={"body": body})

    async def transition(self, key: str, name: str) -> bool:
        """Apply the transition called `name` (or leading to a status called `name`).

        Returns:
            False when the issue's workflow offers no such transition now (e.g. already Done).
        """
        resp = await self._request("GET", f"{API}/issue/{key}/transitions")
        for t in resp.json().get("transitions") or []:
            if name.lower() in (str(t.get("name", "")).lower(), str((t.get("to") or {}).get("name", "")).lower()):
                await self._request("POST", f"{API}/issue/{key}/transitions", json={"transition": {"id": t["id"]}})
                return True
        return False

    async def update(self, upd: TicketUpdate) -> None:
        """Record in the ledger, comment on the issue, and transition it when `tickets.jira.transitions`
        maps `upd.status` (e.g. resolved → Done).

        Raises:
            TicketNotFoundError: unknown ticket in the ledger. TicketRejectedError, TicketError: as `file`.
        """
        await self.local.update_record(upd)
        await self.comment(upd.ticket_id, f"fleetmend: {upd.status}. {upd.comment}".strip())
        target = self.s.transitions.get(upd.status)
        if target and not await self.transition(upd.ticket_id, target):
            await self.comment(upd.ticket_id, f"fleetmend: transition {target!r} not available from the "
                                              "issue's current status; left as is")

    async def get(self, ticket_id: str) -> dict | None:
        """The issue as Jira has it now: `{"ticket_id", "status", "resolution", "summary", "url"}`, or None."""
        try:
            resp = await self._request("GET", f"{API}/issue/{ticket_id}",
                                       params={"fields": "status,summary,resolution"})
        except TicketRejectedError as err:
            if err.status_code == 404:
                return None
            raise
        f = resp.json().get("fields") or {}
        return {"ticket_id": ticket_id, "status": (f.get("status") or {}).get("name", ""),
                "resolution": (f.get("resolution") or {}).get("name"), "summary": f.get("summary"),
                "url": f"{self.base}/browse/{ticket_id}"}

    async def poll(self, ticket_id: str) -> TicketStatus:
        """Jira's status of the issue, mapped to repaired by `repaired_statuses`.

        Raises:
            TicketNotFoundError: the issue does not exist (anymore).
            TicketError: Jira is unreachable.
        """
        doc = await self.get(ticket_id)
        if doc is None:
            raise TicketNotFoundError(f"Jira issue {ticket_id} not found at {self.base}")
        status = doc["status"]
        return TicketStatus(ticket_id, status, status.lower() in self.repaired, doc["url"],
                            f"Jira status {status!r}" + (f", resolution {doc['resolution']!r}"
                                                         if doc.get("resolution") else ""))

    async def list_all(self) -> list[dict]:
        return await self.local.list_all()


def _jira_errors(resp: httpx.Response) -> str:
    """Jira's `{"errorMessages": [...], "errors": {field: msg}}` as one line, else the body."""
    try:
        doc = resp.json()
    except ValueError:
        return resp.text[:300]
    if not isinstance(doc, dict):
        return resp.text[:300]
    parts = list(doc.get("errorMessages") or []) + [f"{k}: {v}" for k, v in (doc.get("errors") or {}).items()]
    return "; ".join(parts)[:300] or resp.text[:300]
