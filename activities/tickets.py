"""Ticket filers and their activities.

CONTRACT (used by workflows/remediation.py; implementation in progress):

    @dataclass TicketRequest: incident_id: str; cluster: str; node: str; title: str; severity: str;
                              fault_class: str; evidence: dict   # raw lines, classification, diag report
    @dataclass TicketRef:     ticket_id: str; url: str | None; created: bool   # created False = existed (idempotent)
    @dataclass TicketUpdate:  ticket_id: str; incident_id: str; status: str; comment: str

    class TicketFiler(Protocol):
        name: str
        async def file(self, req: TicketRequest) -> TicketRef      # idempotent by incident_id
        async def update(self, upd: TicketUpdate) -> None
        async def get(self, ticket_id: str) -> dict | None

    class TicketActivities:
        def __init__(self, filer: TicketFiler)
        @activity.defn(name="file_ticket")   async def file_ticket(self, req: TicketRequest) -> TicketRef
        @activity.defn(name="update_ticket") async def update_ticket(self, upd: TicketUpdate) -> None
"""
