"""The ticket plug-in interface (`TicketFiler`), its factory and its Temporal activities.

Filing is idempotent by `incident_id`: a retried activity, a second worker or a replayed workflow
gets the ticket that already exists (`TicketRef.created=False`), never a second one.

Filers, one module each: `LocalTicketStore` (activities/ticket_store.py, the default and every
filer's ledger), `WebhookTicketFiler` (activities/webhook.py), `JiraTicketFiler` (activities/jira.py).
Requests and results (`TicketRequest`, `TicketRef`, `TicketUpdate`, `TicketStatus`) are in
`fleetmend.messages`.

`TicketActivities(filer)` exposes `file_ticket`, `update_ticket` and `poll_ticket` (the ticket
system as a source of "repaired") for the worker.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.jira import JiraTicketFiler
from activities.scheduler import NodeEventRecorder
from activities.ticket_kv import KvTicketStore
from activities.ticket_store import LocalTicketStore
from activities.webhook import WebhookTicketFiler
from fleetmend.catalog.runbooks import runbook_ref
from fleetmend.config import Settings, TicketKind
from fleetmend.errors import ConfigError, TicketNotFoundError, TicketRejectedError
from fleetmend.infra import metrics
from fleetmend.infra.ledger import LedgerStore
from fleetmend.messages import Activity, TicketRef, TicketRequest, TicketStatus, TicketUpdate


@runtime_checkable
class TicketFiler(Protocol):
    """What every ticket system offers; the activities and `fleetmend tickets` call these."""

    name: str

    async def file(self, req: TicketRequest) -> TicketRef: ...

    async def update(self, upd: TicketUpdate) -> None: ...

    async def get(self, ticket_id: str) -> dict | None: ...

    async def poll(self, ticket_id: str) -> TicketStatus:
        """The system's status of the ticket and whether it means repaired (`tickets.repaired_statuses`).
        Raises TicketNotFoundError for a ticket the system does not know."""
        ...


def build_ticket_filer(settings: Settings, js: Any = None) -> TicketFiler:
    """The filer for `settings.tickets.kind`, with the deployment's ledger: the JetStream KV bucket
    (`KvTicketStore`) when `js` is given and `tickets.ledger` is `kv`, else the files under
    `settings.state_dir / "tickets"`.

    Raises:
        ConfigError: webhook without `tickets.webhook_url`; jira without url or credentials.
    """
    t = settings.tickets
    local: Any
    if js is not None and t.ledger == "kv":
        local = KvTicketStore(js, repaired_statuses=t.repaired_statuses)
    else:
        local = LocalTicketStore(settings.state_dir / "tickets", repaired_statuses=t.repaired_statuses)
    if t.kind == TicketKind.LOCAL:
        return local
    if t.kind == TicketKind.WEBHOOK:
        if not t.webhook_url:
            raise ConfigError("tickets.kind = webhook needs tickets.webhook_url "
                              "(or FLEETMEND_TICKETS__WEBHOOK_URL)")

        return WebhookTicketFiler(t.webhook_url, t.webhook_headers, t.webhook_timeout_s, local,
                                  status_url=t.webhook_status_url, repaired_statuses=t.repaired_statuses)
    if t.kind == TicketKind.JIRA:
        return JiraTicketFiler(t.jira, local, t.repaired_statuses)
    raise ConfigError(f"unknown ticket kind {t.kind!r}; expected local, webhook, jira")


class TicketActivities:
    """`file_ticket` / `update_ticket` / `poll_ticket` for the worker, bound to one filer.

    Args:
        filer: any `TicketFiler`.
        node_events: see below.
    """

    def __init__(self, filer: TicketFiler, node_events: NodeEventRecorder | None = None,
                 ledger: LedgerStore | None = None) -> None:
        self.filer = filer
        self._ledger = ledger
        """The incident ledger: the ticket's filing and status; on `resolved`, the faulty part's serial then and
        at the drain ("part not replaced" goes into the ticket's comment). Never fails the activity."""
        self._node_events = node_events
        """Optional `async (node, step, message, key=...)` recorder (the Kubernetes adapter's
        `record_event`): a filed ticket becomes a `FleetmendTicketFiled` Event on the Node."""

    @activity.defn(name=Activity.FILE_TICKET)
    async def file_ticket(self, req: TicketRequest) -> TicketRef:
        """File (or find) the ticket for `req.incident_id`.

        Raises:
            ApplicationError: type "TicketRejected", non-retryable, when the ticket system refuses (4xx).
            TicketError: transient; Temporal retries.
        """
        activity.heartbeat({"phase": "filing", "incident_id": req.incident_id})
        if req.fault_class and "runbook" not in req.evidence:  # the ticket text points at what to do

            req.evidence["runbook"] = runbook_ref(req.fault_class)
        try:
            ref = await self.filer.file(req)
        except TicketRejectedError as err:
            metrics.TICKETS.labels(filer=self.filer.name, outcome="rejected").inc()
            raise ApplicationError(str(err), {"status_code": err.status_code},
                                   type="TicketRejected", non_retryable=True) from err
        metrics.TICKETS.labels(filer=self.filer.name, outcome="filed" if ref.created else "found").inc()
        activity.logger.info("ticket_filed incident_id=%s ticket_id=%s created=%s filer=%s",
                             req.incident_id, ref.ticket_id, ref.created, self.filer.name)
        if self._node_events is not None:
            await self._node_events(req.node, "ticket", f"ticket {ref.ticket_id} filed ({self.filer.name})",
                                    key=f"{req.incident_id}|ticket|{ref.ticket_id}")
        if self._ledger is not None:
            await self._ledger.ticket_filed(cluster=req.cluster, node=req.node, incident_id=req.incident_id,
                                            ticket=ref.ticket_id, title=req.title, fault_class=req.fault_class,
                                            evidence=req.evidence)
        return ref

    @activity.defn(name=Activity.UPDATE_TICKET)
    async def update_ticket(self, upd: TicketUpdate) -> None:
        """Record a status change on the ticket.

        Raises:
            ApplicationError: "TicketNotFound" or "TicketRejected", non-retryable.
        """
        activity.heartbeat({"phase": "updating", "ticket_id": upd.ticket_id})
        if self._ledger is not None:
            said = await self._ledger.ticket_updated(incident_id=upd.incident_id, ticket=upd.ticket_id,
                                                     status=upd.status)
            if said and said not in upd.comment:
                upd.comment = f"{upd.comment}\n{said[0].upper()}{said[1:]}."
        try:
            await self.filer.update(upd)
        except TicketRejectedError as err:
            raise ApplicationError(str(err), type="TicketRejected", non_retryable=True) from err
        except TicketNotFoundError as err:
            raise ApplicationError(str(err), type="TicketNotFound", non_retryable=True) from err
        activity.logger.info("ticket_updated ticket_id=%s status=%s", upd.ticket_id, upd.status)

    @activity.defn(name=Activity.POLL_TICKET)
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
            st = await self.filer.poll(ticket_id)
        except TicketNotFoundError as err:
            raise ApplicationError(str(err), type="TicketNotFound", non_retryable=True) from err
        except TicketRejectedError as err:
            raise ApplicationError(str(err), type="TicketRejected", non_retryable=True) from err
        activity.logger.info("ticket_polled ticket_id=%s status=%s repaired=%s", ticket_id, st.status, st.repaired)
        return st
