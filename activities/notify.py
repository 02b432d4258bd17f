"""Notifications to humans: a JSON webhook, Slack (incoming webhook) and PagerDuty (Events API v2).

Sent on drain, ticket filed, breaker open, lemon node and return to service (`NotifyEvent`), as
the `notify` activity (called by `NodeRemediation`) or directly by the worker's elected poller
(breaker open, read from FleetGuard's status).

Never twice: each channel's acceptance of a `Notification.dedup_key` is recorded in the JetStream
KV bucket `fleetmend_notified` (key: sha1 of channel + dedup key). A retried activity (the worker
died, one channel failed) sends only to the channels without a record; a failed channel raises
after the others were recorded, so Temporal's retry policy retries just that one. The window left
is a crash between a channel's 2xx and its record: the webhook gets the same `Idempotency-Key`
again, PagerDuty deduplicates by `dedup_key` itself (a retry never pages twice), Slack may show the
message twice.

PagerDuty: one alert per incident (`dedup_key` = `Notification.alert_key`): ticket filed and lemon
trigger it (a second trigger with the same key updates the same alert, no new page), return to
service resolves it. Severity: fatal → critical, degraded → error, else warning/info.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import asdict
from datetime import datetime, timezone
from typing import Any, Protocol

import httpx
from nats.js.errors import BucketNotFoundError, KeyNotFoundError
from temporalio import activity
from temporalio.service import RPCError

from fleetmend import subjects
from fleetmend.config import NotifySettings
from fleetmend.infra.jetstream import kv_config
from fleetmend.messages import Activity, GuardApi, Notification, NotifyEvent, NotifyResult


class NotifyError(Exception):
    """A channel refused or could not be reached (the activity raises it: Temporal retries)."""


class Channel(Protocol):
    name: str

    def wants(self, n: Notification) -> bool: ...

    async def send(self, client: httpx.AsyncClient, n: Notification) -> None: ...


def _raise_for(resp: httpx.Response, what: str) -> None:
    if resp.status_code >= 300:
        raise NotifyError(f"{what} answered {resp.status_code}: {resp.text[:200]!r}")


class WebhookChannel:
    """POST the notification as JSON with `Idempotency-Key: <dedup_key>`."""

    name = "webhook"

    def __init__(self, url: str, headers: dict[str, str], events: set[str]) -> None:
        self.url, self.headers, self.events = url, headers, events

    def wants(self, n: Notification) -> bool:
        return n.event.value in self.events

    async def send(self, client: httpx.AsyncClient, n: Notification) -> None:
        body = {**asdict(n), "event": n.event.value, "sent_at": datetime.now(timezone.utc).isoformat()}
        resp = await client.post(self.url, json=body, headers={**self.headers, "Idempotency-Key": n.dedup_key})
        _raise_for(resp, f"notification webhook {self.url}")


def slack_text(n: Notification) -> str:
    icon = {NotifyEvent.DRAINED: ":construction:", NotifyEvent.TICKET_FILED: ":ticket:",
            NotifyEvent.BREAKER_OPEN: ":rotating_light:", NotifyEvent.LEMON: ":lemon:",
            NotifyEvent.RETURNED: ":white_check_mark:", NotifyEvent.VERSION_FINDING: ":mag:"}[n.event]
    lines = [f"{icon} *{n.event.value.replace('_', ' ')}* — {n.summary}"]
    if n.ticket:
        lines.append(f"ticket: <{n.ticket_url}|{n.ticket}>" if n.ticket_url else f"ticket: {n.ticket}")
    if n.runbook:
        lines.append(f"runbook: {n.runbook}")
    if n.node:
        lines.append(f"`fleetmend status {n.node}`")
    return "\n".join(lines)


class SlackChannel:
    """A Slack incoming webhook: `{"text": …}` (mrkdwn)."""

    name = "slack"

    def __init__(self, url: str, events: set[str]) -> None:
        self.url, self.events = url, events

    def wants(self, n: Notification) -> bool:
        return n.event.value in self.events

    async def send(self, client: httpx.AsyncClient, n: Notification) -> None:
        resp = await client.post(self.url, json={"text": slack_text(n)})
        _raise_for(resp, "Slack webhook")


_PD_SEVERITY = {"fatal": "critical", "degraded": "error", "info": "info"}


def pagerduty_event(routing_key: str, n: Notification) -> dict[str, Any]:
    """The Events API v2 body of `n` (trigger, or resolve on return to service)."""
    if n.event is NotifyEvent.RETURNED:
        return {"routing_key": routing_key, "event_action": "resolve", "dedup_key": n.alert_key}
    sev = "critical" if n.event is NotifyEvent.BREAKER_OPEN else _PD_SEVERITY.get(n.severity, "warning")
    body: dict[str, Any] = {
        "routing_key": routing_key, "event_action": "trigger", "dedup_key": n.alert_key,
        "payload": {"summary": n.summary[:1024], "source": n.node or n.cluster, "severity": sev,
                    "component": n.node or "fleet", "group": n.cluster, "class": n.event.value,
                    "custom_details": {**n.details, "incident_id": n.incident_id, "ticket": n.ticket}},
        "client": "fleetmend",
    }
    links = [{"href": u, "text": t} for u, t in ((n.ticket_url, f"ticket {n.ticket}"), (n.runbook, "runbook"))
             if u and u.startswith(("http://", "https://"))]
    if links:
        body["links"] = links
    return body


class PagerDutyChannel:
    """PagerDuty Events API v2 (`POST /v2/enqueue`, 202 Accepted)."""

    name = "pagerduty"

    def __init__(self, routing_key: str, url: str, events: set[str]) -> None:
        self.routing_key, self.url, self.events = routing_key, url, events

    def wants(self, n: Notification) -> bool:
        return n.event.value in self.events

    async def send(self, client: httpx.AsyncClient, n: Notification) -> None:
        resp = await client.post(self.url, json=pagerduty_event(self.routing_key, n))
        _raise_for(resp, "PagerDuty Events API")


def channels_from_settings(ns: NotifySettings) -> list[Channel]:
    events = set(ns.events)
    out: list[Channel] = []
    if ns.webhook_url:
        out.append(WebhookChannel(ns.webhook_url, ns.webhook_headers, events))
    if ns.slack_webhook_url:
        out.append(SlackChannel(ns.slack_webhook_url, events))
    if ns.pagerduty_routing_key:
        out.append(PagerDutyChannel(ns.pagerduty_routing_key, ns.pagerduty_url, events & set(ns.pagerduty_events)))
    return out


class Notifier:
    """Sends a `Notification` to its channels, each at most once per dedup key (see module docstring).

    Args:
        channels: `channels_from_settings(settings.notify)`.
        js: a JetStream context for the sent-record bucket; None keeps the record in memory only.
        timeout_s: per HTTP request.
    """

    def __init__(self, channels: list[Channel], js: Any = None, timeout_s: float = 10.0,
                 bucket: str = subjects.NOTIFY_KV_BUCKET) -> None:
        self.channels, self.js, self.timeout_s, self.bucket = channels, js, timeout_s, bucket
        self._kv: Any = None
        self._memory: set[str] = set()

    async def _bucket(self) -> Any:
        if self._kv is None and self.js is not None:
            async with asyncio.timeout(10):
                try:
                    self._kv = await self.js.key_value(self.bucket)
                except BucketNotFoundError:
                    self._kv = await self.js.create_key_value(kv_config(  # bounded: issue 27
                        self.bucket, "fleetmend notifications already delivered, per channel", ttl=30 * 86400))
        return self._kv

    @staticmethod
    def _key(channel: str, dedup_key: str) -> str:
        return "n." + hashlib.sha1(f"{channel}\0{dedup_key}".encode()).hexdigest()

    async def _was_sent(self, key: str) -> bool:
        kv = await self._bucket()
        if kv is None:
            return key in self._memory
        try:
            await kv.get(key)
            return True
        except KeyNotFoundError:
            return False

    async def _mark_sent(self, key: str, channel: str, n: Notification) -> None:
        kv = await self._bucket()
        if kv is None:
            self._memory.add(key)
            return
        await kv.put(key, json.dumps({"channel": channel, "dedup_key": n.dedup_key,
                                      "at": datetime.now(timezone.utc).isoformat()}).encode())

    async def send(self, n: Notification) -> NotifyResult:
        """Send to every channel that wants `n` and has no record of it.

        Returns:
            Which channels sent it now and which had it already.
        Raises:
            NotifyError: one or more channels failed (the others are recorded; a retry sends only these).
        """
        result, failed = NotifyResult(), []
        wanted = [c for c in self.channels if c.wants(n)]
        if not wanted:
            return result
        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            for c in wanted:
                key = self._key(c.name, n.dedup_key)
                if await self._was_sent(key):
                    result.already.append(c.name)
                    continue
                try:
                    await c.send(client, n)
                except (NotifyError, httpx.HTTPError) as err:
                    failed.append(f"{c.name}: {err}")
                    continue
                await self._mark_sent(key, c.name, n)
                result.sent.append(c.name)
        if failed:
            raise NotifyError(f"notification {n.dedup_key} not delivered to " + "; ".join(failed)
                              + (f" (delivered to {', '.join(result.sent)})" if result.sent else ""))
        return result


class NotifyActivities:
    """The `notify` activity, bound to one `Notifier`."""

    def __init__(self, notifier: Notifier) -> None:
        self.notifier = notifier

    @activity.defn(name=Activity.NOTIFY)
    async def notify(self, n: Notification) -> NotifyResult:
        """Send `n` (idempotent by `n.dedup_key`). Raises NotifyError when a channel failed."""
        return await self.notifier.send(n)


async def notify_breaker(client: Any, cluster: str, notifier: Notifier) -> NotifyResult | None:
    """Breaker open → one `breaker_open` notification per trip (dedup key: the trip's time), read from
    the cluster's FleetGuard `status` query. Called by the worker's elected poller.

    Returns:
        The send result, or None when the breaker is closed or the cluster has no FleetGuard yet.
    Raises:
        NotifyError: a channel failed (the next poll retries; delivered channels are not sent again).
    """
    try:
        st = await client.get_workflow_handle(subjects.fleetguard_workflow_id(cluster)).query(GuardApi.STATUS)
    except RPCError as err:
        if "not found" in str(err).lower():
            return None
        raise
    get = st.get if isinstance(st, dict) else lambda k, d=None: getattr(st, k, d)
    if not get("breaker_tripped", False):
        return None
    at = get("breaker_tripped_at") or "unknown"
    key = f"fleetmend/{cluster}/breaker/{at}"
    return await notifier.send(Notification(
        event=NotifyEvent.BREAKER_OPEN, cluster=cluster, severity="fatal", dedup_key=key, alert_key=key,
        summary=f"cluster {cluster}: drain breaker open since {at}: {get('breaker_reason') or ''}; no new drains "
                "until `fleetmend breaker reset`",
        details={"queued": len(get("queue", []) or []), "held": len(get("held", []) or [])}))


async def notify_findings(cluster: str, findings: list[dict[str, Any]], notifier: Notifier) -> int:
    """One `version_finding` notification per finding of `fleetmend.report.build_report` (dedup key: the finding's
    id, so a finding still there at the next refresh is not sent again). Called by the worker's elected replica.

    Returns: how many channels accepted a notification now. Raises: NotifyError (the next refresh retries)."""
    sent = 0
    for f in findings:
        key = f"fleetmend/{cluster}/version_finding/{f['id']}"
        res = await notifier.send(Notification(
            event=NotifyEvent.VERSION_FINDING, cluster=cluster, severity="degraded", dedup_key=key, alert_key=key,
            summary=(f"{f['fault_class']} concentrates on {f['key']}={f['value']}: {f['nodes_with_fault_and_value']} of "
                     f"{f['nodes_with_fault']} faulty nodes hold it, against {f['fleet_nodes_with_value']} of "
                     f"{f['fleet_nodes']} in the fleet ({f['test']}); for the vendor: `fleetmend report --cluster "
                     f"{cluster} --vendor-bundle {f['id']} DIR`"),
            details={k: f[k] for k in ("id", "fault_class", "key", "value", "p_value", "nodes")}))
        sent += len(res.sent)
    return sent
