"""Jira filer and ticket polling against a local HTTP server that checks the documented API shape.

`FakeJira` (stdlib `http.server` in a thread) accepts only what Jira REST v2 documents: the method
and path of each call, Basic auth, JSON bodies with the documented fields, multipart attachments
with `X-Atlassian-Token: no-check`. Anything else answers 400 with a Jira-style error and is
recorded in `violations`, which every test asserts empty.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import threading
from email.parser import BytesParser
from email.policy import HTTP
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.jira import JiraTicketFiler, description, incident_label
from activities.ticket_store import LocalTicketStore
from activities.tickets import TicketActivities, build_ticket_filer
from activities.webhook import WebhookTicketFiler
from fleetmend.config import JiraSettings, Settings
from fleetmend.errors import ConfigError, TicketError, TicketRejectedError
from fleetmend.messages import TicketRequest, TicketUpdate

EMAIL, TOKEN = "bot@example.com", "tok-123"


class FakeJira(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.issues: dict[str, dict] = {}
        self.attachments: dict[str, list[tuple[str, bytes]]] = {}
        self.comments: dict[str, list[str]] = {}
        self.calls: list[tuple[str, str]] = []
        self.violations: list[str] = []
        self.fail_next: list[int] = []
        """Status codes to answer the next requests with (5xx, 429) before serving normally."""
        self.webhook_status: dict[str, str] = {}
        self.seq = 0
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


TRANSITIONS = [{"id": "11", "name": "Start Progress", "to": {"name": "In Progress"}},
               {"id": "31", "name": "Done", "to": {"name": "Done"}}]


class _Handler(BaseHTTPRequestHandler):
    server: FakeJira

    def log_message(self, *a) -> None:
        pass

    def _send(self, code: int, doc: object | None = None) -> None:
        body = json.dumps(doc).encode() if doc is not None else b""
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _bad(self, why: str) -> None:
        self.server.violations.append(f"{self.command} {self.path}: {why}")
        self._send(400, {"errorMessages": [why], "errors": {}})

    def _json(self) -> dict | None:
        if not self.headers.get("Content-Type", "").startswith("application/json"):
            self._bad("Content-Type must be application/json")
            return None
        n = int(self.headers.get("Content-Length", 0))
        try:
            return json.loads(self.rfile.read(n))
        except ValueError:
            self._bad("body is not JSON")
            return None

    def _auth_ok(self) -> bool:
        want = "Basic " + base64.b64encode(f"{EMAIL}:{TOKEN}".encode()).decode()
        if self.headers.get("Authorization") != want:
            self.server.violations.append(f"{self.command} {self.path}: bad auth")
            self._send(401, {"errorMessages": ["You are not authenticated."]})
            return False
        return True

    def do_GET(self) -> None:
        self.route("GET")

    def do_POST(self) -> None:
        self.route("POST")

    def route(self, method: str) -> None:
        srv = self.server
        u = urlparse(self.path)
        srv.calls.append((method, u.path))
        if u.path.startswith("/status/"):  # the generic webhook's status URL
            key = u.path.rsplit("/", 1)[-1]
            return self._send(200, {"id": key, "status": srv.webhook_status[key]}) if key in srv.webhook_status \
                else self._send(404, {"error": "no such ticket"})
        if not self._auth_ok():
            return None
        if srv.fail_next:
            code = srv.fail_next.pop(0)
            self.send_response(code)
            if code == 429:
                self.send_header("Retry-After", "0")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        q = parse_qs(u.query)
        m = re.fullmatch(r"/rest/api/2/issue/([A-Z]+-\d+)(/attachments|/comment|/transitions)?", u.path)
        if method == "GET" and u.path == "/rest/api/2/search":
            jql = q.get("jql", [""])[0]
            mm = re.fullmatch(r'project = "(\w+)" AND labels = "([\w-]+)" ORDER BY created ASC', jql)
            if not mm:
                return self._bad(f"unexpected JQL {jql!r}")
            hits = [{"id": i["id"], "key": k, "fields": {"status": {"name": i["status"]},
                                                          "summary": i["fields"]["summary"]}}
                    for k, i in sorted(srv.issues.items()) if mm.group(2) in i["fields"]["labels"]
                    and i["fields"]["project"]["key"] == mm.group(1)]
            return self._send(200, {"startAt": 0, "maxResults": 1, "total": len(hits), "issues": hits[:1]})
        if method == "POST" and u.path == "/rest/api/2/issue":
            body = self._json()
            if body is None:
                return None
            f = body.get("fields", {})
            for need in ("project", "issuetype", "summary", "description", "labels"):
                if need not in f:
                    return self._bad(f"fields.{need} missing")
            if not isinstance(f["project"], dict) or "key" not in f["project"]:
                return self._bad("fields.project must be {key}")
            if not isinstance(f["issuetype"], dict) or "name" not in f["issuetype"]:
                return self._bad("fields.issuetype must be {name}")
            if any(" " in label for label in f["labels"]):
                return self._bad("labels cannot contain spaces")
            if len(f["description"]) > 32767:
                return self._bad("description too long")
            with srv.lock:
                srv.seq += 1
                key = f"{f['project']['key']}-{srv.seq}"
                srv.issues[key] = {"id": str(10000 + srv.seq), "fields": f, "status": "To Do"}
            return self._send(201, {"id": srv.issues[key]["id"], "key": key,
                                    "self": f"{srv.url}/rest/api/2/issue/{srv.issues[key]['id']}"})
        if not m or m.group(1) not in srv.issues:
            return self._send(404, {"errorMessages": ["Issue does not exist or you do not have permission to see it."],
                                    "errors": {}})
        key, sub, issue = m.group(1), m.group(2), srv.issues[m.group(1)]
        if method == "GET" and sub is None:
            fields = {"status": {"name": issue["status"]}, "summary": issue["fields"]["summary"],
                      "resolution": {"name": "Fixed"} if issue["status"] == "Done" else None}
            return self._send(200, {"id": issue["id"], "key": key, "fields": fields})
        if method == "POST" and sub == "/attachments":
            if self.headers.get("X-Atlassian-Token") != "no-check":
                return self._bad("attachments need X-Atlassian-Token: no-check")
            ctype = self.headers.get("Content-Type", "")
            if not ctype.startswith("multipart/form-data; boundary="):
                return self._bad("attachments must be multipart/form-data")
            n = int(self.headers.get("Content-Length", 0))
            msg = BytesParser(policy=HTTP).parsebytes(b"Content-Type: " + ctype.encode() + b"\r\n\r\n"
                                                      + self.rfile.read(n))
            parts = {p.get_param("name", header="content-disposition"): p for p in msg.iter_parts()}
            if "file" not in parts:
                return self._bad("multipart field must be named 'file'")
            part = parts["file"]
            srv.attachments.setdefault(key, []).append((part.get_filename(), part.get_payload(decode=True)))
            return self._send(200, [{"filename": part.get_filename()}])
        if method == "POST" and sub == "/comment":
            body = self._json()
            if body is None:
                return None
            if not isinstance(body.get("body"), str):
                return self._bad("comment body must be a string (v2)")
            srv.comments.setdefault(key, []).append(body["body"])
            return self._send(201, {"id": str(len(srv.comments[key])), "body": body["body"]})
        if sub == "/transitions":
            if method == "GET":
                return self._send(200, {"transitions": [t for t in TRANSITIONS if t["to"]["name"] != issue["status"]]})
            body = self._json()
            if body is None:
                return None
            tid = (body.get("transition") or {}).get("id")
            t = next((t for t in TRANSITIONS if t["id"] == tid), None)
            if t is None:
                return self._bad(f"transition id {tid!r} invalid")
            issue["status"] = t["to"]["name"]
            return self._send(204)
        return self._bad("unrouted")


@pytest.fixture
def jira():
    srv = FakeJira()
    yield srv
    srv.shutdown()
    srv.server_close()
    assert srv.violations == []


def req(incident: str = "inc-1") -> TicketRequest:
    return TicketRequest(incident_id=incident, cluster="c1", node="gpu-001", title="gpu-001: XID 79 GPU fell off the bus",
                         severity="fatal", fault_class="xid_79", evidence={"raw": ["NVRM: Xid (PCI:0000:3b:00): 79"],
                                                                          "diag": {"result": "fail"}})


def filer(jira: FakeJira, tmp_path, **kw) -> JiraTicketFiler:
    s = JiraSettings(url=jira.url, project="OPS", email=EMAIL, api_token=TOKEN, **kw)
    return JiraTicketFiler(s, LocalTicketStore(tmp_path / "tickets"), ["Done", "Resolved"], backoff_s=0.01)


async def test_file_creates_issue_with_evidence_and_attachment(jira: FakeJira, tmp_path) -> None:
    f = filer(jira, tmp_path)
    ref = await f.file(req())
    assert ref.created and ref.ticket_id == "OPS-1" and ref.url == f"{jira.url}/browse/OPS-1"
    fields = jira.issues["OPS-1"]["fields"]
    assert fields["issuetype"] == {"name": "Bug"} and fields["project"] == {"key": "OPS"}
    assert incident_label("inc-1") in fields["labels"] and "fleetmend" in fields["labels"]
    assert "XID 79" in fields["summary"] and "NVRM: Xid (PCI:0000:3b:00): 79" in fields["description"]
    (name, data), = jira.attachments["OPS-1"]
    assert name == "evidence-inc-1.json" and json.loads(data)["evidence"]["diag"] == {"result": "fail"}
    # Idempotent: the ledger answers; no second search or create.
    n = len(jira.calls)
    again = await f.file(req())
    assert not again.created and again.ticket_id == "OPS-1" and len(jira.calls) == n


async def test_idempotent_by_label_when_the_ledger_is_lost(jira: FakeJira, tmp_path) -> None:
    await filer(jira, tmp_path / "a").file(req("inc-2"))
    ref = await filer(jira, tmp_path / "b").file(req("inc-2"))  # another worker, empty ledger
    assert not ref.created and ref.ticket_id == "OPS-1" and len(jira.issues) == 1
    assert [c for c in jira.calls if c == ("POST", "/rest/api/2/issue")] == [("POST", "/rest/api/2/issue")]


async def test_update_comments_and_transitions_then_poll_reports_repaired(jira: FakeJira, tmp_path) -> None:
    f = filer(jira, tmp_path)
    ref = await f.file(req("inc-3"))
    acts = TicketActivities(f)
    env = ActivityEnvironment()
    st = await env.run(acts.poll_ticket, ref.ticket_id)
    assert (st.status, st.repaired) == ("To Do", False)
    await env.run(acts.update_ticket, TicketUpdate(ref.ticket_id, "inc-3", "escalated", "No repair after 3 days."))
    assert jira.comments["OPS-1"] == ["fleetmend: escalated. No repair after 3 days."]
    assert jira.issues["OPS-1"]["status"] == "To Do"  # escalated maps to no transition
    jira.issues["OPS-1"]["status"] = "Done"  # the vendor fixed it and closed the issue
    st = await env.run(acts.poll_ticket, ref.ticket_id)
    assert (st.status, st.repaired, st.url) == ("Done", True, f"{jira.url}/browse/OPS-1")
    assert "resolution 'Fixed'" in st.detail
    # resolved → the "Done" transition is not offered from Done: a comment says so.
    await f.update(TicketUpdate(ref.ticket_id, "inc-3", "resolved", "Verification passed."))
    assert jira.comments["OPS-1"][-1].startswith("fleetmend: transition 'Done' not available")
    jira.issues["OPS-1"]["status"] = "In Progress"
    await f.update(TicketUpdate(ref.ticket_id, "inc-3", "resolved", "Verification passed."))
    assert jira.issues["OPS-1"]["status"] == "Done"
    assert f.local.find_by_incident_sync("inc-3")["status"] == "resolved"


async def test_retries_wait_doubling_or_as_jira_says(jira: FakeJira, tmp_path, monkeypatch) -> None:
    """tenacity's waits between tries: `backoff_s` doubling, or the 429's Retry-After (the fake says 0)."""
    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(s: float) -> None:
        slept.append(s)
        await real_sleep(0)

    f = filer(jira, tmp_path)
    jira.fail_next = [503, 502, 429]
    monkeypatch.setattr(asyncio, "sleep", sleep)
    assert await f.find("inc-waits") is None  # the fourth try answers: no such issue
    monkeypatch.undo()
    assert slept == [0.01, 0.02, 0.0] and jira.fail_next == []


async def test_retries_5xx_and_429_then_rejects_4xx(jira: FakeJira, tmp_path) -> None:
    f = filer(jira, tmp_path)
    jira.fail_next = [503, 429]
    ref = await f.file(req("inc-4"))
    assert ref.created
    jira.fail_next = [500] * 10
    with pytest.raises(TicketError, match="failed 4 times"):
        await f.file(req("inc-5"))
    jira.fail_next = []
    bad = filer(jira, tmp_path / "x")
    bad.s = bad.s.model_copy(update={"api_token": "wrong"})
    with pytest.raises(TicketRejectedError) as ei:
        await bad.file(req("inc-6"))
    assert ei.value.status_code == 401 and "You are not authenticated" in str(ei.value)
    jira.violations.clear()  # the 401 was on purpose
    acts = TicketActivities(f)
    with pytest.raises(ApplicationError) as ae:
        await ActivityEnvironment().run(acts.poll_ticket, "OPS-999")
    assert ae.value.type == "TicketNotFound" and ae.value.non_retryable


def test_description_is_bounded_and_config_errors() -> None:
    big = TicketRequest("i", "c", "n", "t", "fatal", "x", {"raw": ["x" * 100] * 1000})
    d = description(big)
    assert len(d) <= 30_000 and "truncated; see the attachment" in d
    with pytest.raises(ConfigError, match="tickets.jira.url"):
        build_ticket_filer(Settings(tickets={"kind": "jira"}))
    with pytest.raises(ConfigError, match="api_token"):
        build_ticket_filer(Settings(tickets={"kind": "jira", "jira": {"url": "http://x"}}))
    f = build_ticket_filer(Settings(tickets={"kind": "jira", "jira": {"url": "http://x", "bearer_token": "t"}}))
    assert isinstance(f, JiraTicketFiler)


async def test_webhook_and_local_tickets_are_pollable(jira: FakeJira, tmp_path) -> None:
    local = LocalTicketStore(tmp_path / "ledger")
    hook = WebhookTicketFiler(f"{jira.url}/hook", None, 5.0, local, status_url=f"{jira.url}/status/{{ticket_id}}",
                              repaired_statuses=["repaired"])
    ref = await local.file(req("inc-7"))  # the ledger stands in for a filed webhook ticket
    jira.webhook_status[ref.ticket_id] = "in_repair"
    acts = TicketActivities(hook)
    env = ActivityEnvironment()
    assert (await env.run(acts.poll_ticket, ref.ticket_id)).repaired is False
    jira.webhook_status[ref.ticket_id] = "REPAIRED"
    st = await env.run(acts.poll_ticket, ref.ticket_id)
    assert st.repaired and st.status == "REPAIRED"
    with pytest.raises(ApplicationError) as ei:
        await env.run(acts.poll_ticket, "nope")
    assert ei.value.type == "TicketNotFound"
    # The local store polls its own ledger, with its own repaired statuses.
    lacts = TicketActivities(LocalTicketStore(tmp_path / "ledger", repaired_statuses=["resolved"]))
    assert (await env.run(lacts.poll_ticket, ref.ticket_id)).status == "open"
    await local.update(TicketUpdate(ref.ticket_id, "inc-7", "resolved", "done"))
    assert (await env.run(lacts.poll_ticket, ref.ticket_id)).repaired
