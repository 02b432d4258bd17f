"""Ticket filers: the local JSON store (real files, real flock, real processes) and the webhook
filer against a real local HTTP server (stdlib `http.server` in a thread)."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import sys
import threading
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.ticket_store import LocalTicketStore
from activities.tickets import TicketActivities, build_ticket_filer
from activities.webhook import WebhookTicketFiler
from fleetmend.config import Settings
from fleetmend.errors import ConfigError, TicketError, TicketRejectedError
from fleetmend.messages import TicketRef, TicketRequest, TicketUpdate


def req(incident: str = "inc-1", node: str = "gpu-017") -> TicketRequest:
    return TicketRequest(
        incident_id=incident, cluster="c1", node=node, title=f"{node}: XID 79 GPU fell off the bus",
        severity="fatal", fault_class="gpu_lost",
        evidence={"raw": ["NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus."],
                  "diag": {"result": "FAIL", "checks": [{"name": "nvidia-smi", "ok": False}]}})


# --------------------------------------------------------------------------------------------------
# LocalTicketStore


async def test_local_store_is_idempotent_by_incident(tmp_path: Path) -> None:
    store = LocalTicketStore(tmp_path / "tickets")
    first = await store.file(req("inc-1"))
    assert first == TicketRef("FM-000001", None, True)
    again = await store.file(req("inc-1"))
    assert again == TicketRef("FM-000001", None, False)
    second = await store.file(req("inc-2", node="gpu-018"))
    assert second.ticket_id == "FM-000002" and second.created

    doc = await store.get("FM-000001")
    assert doc is not None
    assert doc["incident_id"] == "inc-1" and doc["node"] == "gpu-017" and doc["status"] == "open"
    assert doc["evidence"] == req().evidence, "the full evidence bundle is stored"
    # A fresh instance (another worker, after a restart) sees the same tickets.
    fresh = LocalTicketStore(tmp_path / "tickets")
    assert (await fresh.file(req("inc-2"))).ticket_id == "FM-000002"
    assert [t["ticket_id"] for t in fresh.list()] == ["FM-000001", "FM-000002"]
    assert not list((tmp_path / "tickets").glob("*.tmp")), "no temp files left behind"


async def test_concurrent_filing_yields_one_ticket(tmp_path: Path) -> None:
    # Separate instances: the fcntl lock (not the instance's asyncio.Lock) must serialize them.
    stores = [LocalTicketStore(tmp_path) for _ in range(8)]
    refs = await asyncio.gather(*(s.file(req("inc-same")) for s in stores))
    assert {r.ticket_id for r in refs} == {"FM-000001"}
    assert sum(r.created for r in refs) == 1
    distinct = await asyncio.gather(*(s.file(req(f"inc-{i}")) for i, s in enumerate(stores)))
    assert len({r.ticket_id for r in distinct}) == 8
    assert len(LocalTicketStore(tmp_path).list()) == 9


def _file_in_process(directory: str, worker: int) -> list[tuple[str, bool]]:
    async def go() -> list[tuple[str, bool]]:
        store = LocalTicketStore(Path(directory))
        out = []
        for i in range(5):
            r = await store.file(req(f"w{worker}-{i}"))
            out.append((r.ticket_id, r.created))
        r = await store.file(req("inc-shared"))
        out.append((r.ticket_id, r.created))
        return out

    return asyncio.run(go())


def test_concurrent_processes_never_collide(tmp_path: Path) -> None:
    # spawn, not fork: the test process has threads (event loop, servers) that fork would copy mid-state.
    with ProcessPoolExecutor(4, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = list(pool.map(_file_in_process, [str(tmp_path)] * 4, range(4)))
    own = [tid for res in results for tid, _ in res[:5]]
    assert len(set(own)) == 20, "two processes got the same ticket id"
    shared = [res[5] for res in results]
    assert len({tid for tid, _ in shared}) == 1 and sum(c for _, c in shared) == 1
    assert len(LocalTicketStore(tmp_path).list()) == 21


async def test_update_history(tmp_path: Path) -> None:
    store = LocalTicketStore(tmp_path)
    ref = await store.file(req("inc-9"))
    await store.update(TicketUpdate(ref.ticket_id, "inc-9", "waiting_repair", "vendor RMA 4411 opened"))
    await store.update(TicketUpdate(ref.ticket_id, "inc-9", "resolved", "GPU replaced; verify passed"))
    doc = await store.get(ref.ticket_id)
    assert doc["status"] == "resolved"
    assert [h["status"] for h in doc["history"]] == ["open", "waiting_repair", "resolved"]
    assert doc["history"][1]["comment"] == "vendor RMA 4411 opened"
    with pytest.raises(TicketError, match="FM-000777"):
        await store.update(TicketUpdate("FM-000777", "inc-x", "resolved", ""))
    assert await store.get("FM-000777") is None


# --------------------------------------------------------------------------------------------------
# Webhook against a real HTTP server


@dataclass
class Hook:
    url: str
    script: list[tuple[int, dict | None, dict]] = field(default_factory=list)
    """Responses to give, in order: (status, json body, headers); the last one repeats."""
    requests: list[dict] = field(default_factory=list)


@pytest.fixture
def hook():
    state = Hook(url="")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            state.requests.append({"method": "POST", "path": self.path, "headers": dict(self.headers),
                                   "body": body})
            status, doc, headers = state.script.pop(0) if len(state.script) > 1 else state.script[0]
            payload = json.dumps(doc).encode() if doc is not None else b""
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}/tickets"
    yield state
    server.shutdown()
    server.server_close()


def webhook(hook: Hook, tmp_path: Path, **kw) -> WebhookTicketFiler:
    return WebhookTicketFiler(hook.url, {"Authorization": "Bearer t0ken"}, 5.0, LocalTicketStore(tmp_path),
                              backoff_s=0.01, **kw)


async def test_webhook_posts_once_per_incident(hook: Hook, tmp_path: Path) -> None:
    hook.script = [(201, {"id": "OPS-4411", "url": "https://tickets.example/OPS-4411"}, {})]
    filer = webhook(hook, tmp_path)
    ref = await filer.file(req("inc-w1"))
    assert ref == TicketRef("OPS-4411", "https://tickets.example/OPS-4411", True)

    assert len(hook.requests) == 1
    r = hook.requests[0]
    assert r["method"] == "POST" and r["path"] == "/tickets"
    assert r["headers"]["Content-Type"] == "application/json"
    assert r["headers"]["Idempotency-Key"] == "inc-w1"
    assert r["headers"]["Authorization"] == "Bearer t0ken"
    body = json.loads(r["body"])
    assert set(body) == {"incident_id", "cluster", "node", "title", "severity", "fault_class", "evidence",
                         "fleetmend_version"}
    assert body["incident_id"] == "inc-w1" and body["evidence"] == req().evidence

    again = await filer.file(req("inc-w1"))
    assert again == TicketRef("OPS-4411", "https://tickets.example/OPS-4411", False)
    # Even a new filer (worker restart) over the same ledger does not POST again.
    assert (await webhook(hook, tmp_path).file(req("inc-w1"))).created is False
    assert len(hook.requests) == 1, "second file() for the same incident must not POST"
    doc = await filer.get("OPS-4411")
    assert doc["incident_id"] == "inc-w1" and doc["evidence"] == req().evidence


async def test_webhook_concurrent_files_post_once(hook: Hook, tmp_path: Path) -> None:
    hook.script = [(201, {"key": "OPS-9"}, {})]
    filer = webhook(hook, tmp_path)
    refs = await asyncio.gather(*(filer.file(req("inc-c")) for _ in range(5)))
    assert {r.ticket_id for r in refs} == {"OPS-9"} and sum(r.created for r in refs) == 1
    assert len(hook.requests) == 1


async def test_webhook_id_from_location_or_incident(hook: Hook, tmp_path: Path) -> None:
    hook.script = [(201, None, {"Location": "https://tickets.example/api/issue/RMA-77"})]
    ref = await webhook(hook, tmp_path).file(req("inc-loc"))
    assert ref.ticket_id == "RMA-77" and ref.url == "https://tickets.example/api/issue/RMA-77"
    hook.script = [(202, {"accepted": True}, {})]
    ref = await webhook(hook, tmp_path).file(req("inc-bare"))
    assert ref.ticket_id == "inc-bare" and ref.url is None


async def test_webhook_retries_5xx_then_succeeds(hook: Hook, tmp_path: Path) -> None:
    hook.script = [(500, {"error": "db locked"}, {}), (503, None, {}), (201, {"id": "OPS-5"}, {})]
    ref = await webhook(hook, tmp_path).file(req("inc-r"))
    assert ref.ticket_id == "OPS-5" and ref.created
    assert len(hook.requests) == 3
    assert {r["headers"]["Idempotency-Key"] for r in hook.requests} == {"inc-r"}


async def test_webhook_gives_up_after_bounded_attempts(hook: Hook, tmp_path: Path) -> None:
    hook.script = [(502, None, {})]
    with pytest.raises(TicketError, match="failed 3 times") as ei:
        await webhook(hook, tmp_path, max_attempts=3).file(req("inc-down"))
    assert not isinstance(ei.value, TicketRejectedError)
    assert len(hook.requests) == 3
    assert await LocalTicketStore(tmp_path).find_by_incident("inc-down") is None


async def test_webhook_400_is_rejected_without_retry(hook: Hook, tmp_path: Path) -> None:
    hook.script = [(400, {"error": "unknown field severity"}, {})]
    with pytest.raises(TicketError) as ei:
        await webhook(hook, tmp_path).file(req("inc-bad"))
    assert isinstance(ei.value, TicketRejectedError) and ei.value.status_code == 400
    assert "unknown field severity" in str(ei.value)
    assert len(hook.requests) == 1


async def test_webhook_connection_refused_is_ticket_error(tmp_path: Path) -> None:
    from fleetmend.dev.servers import free_port

    filer = WebhookTicketFiler(f"http://127.0.0.1:{free_port()}/t", {}, 2.0, LocalTicketStore(tmp_path),
                               max_attempts=2, backoff_s=0.01)
    with pytest.raises(TicketError, match="unreachable after 2 attempts"):
        await filer.file(req("inc-refused"))


async def test_webhook_update_is_recorded_and_optionally_posted(hook: Hook, tmp_path: Path) -> None:
    hook.script = [(201, {"id": "OPS-6"}, {})]
    filer = webhook(hook, tmp_path, update_url=hook.url + "/{ticket_id}/comments")
    ref = await filer.file(req("inc-u"))
    await filer.update(TicketUpdate(ref.ticket_id, "inc-u", "resolved", "GPU swapped"))
    doc = await filer.get("OPS-6")
    assert doc["status"] == "resolved" and doc["history"][-1]["comment"] == "GPU swapped"
    assert hook.requests[-1]["path"] == "/tickets/OPS-6/comments"
    assert json.loads(hook.requests[-1]["body"])["status"] == "resolved"


# --------------------------------------------------------------------------------------------------
# build + activities


def test_build_ticket_filer(tmp_path: Path) -> None:
    local = build_ticket_filer(Settings(state_dir=tmp_path))
    assert isinstance(local, LocalTicketStore) and local.directory == tmp_path / "tickets"
    wh = build_ticket_filer(Settings(state_dir=tmp_path, tickets={"kind": "webhook", "webhook_url": "http://x/"}))
    assert isinstance(wh, WebhookTicketFiler) and wh.local.directory == tmp_path / "tickets"
    with pytest.raises(ConfigError, match="webhook_url"):
        build_ticket_filer(Settings(state_dir=tmp_path, tickets={"kind": "webhook"}))


async def test_activities_file_update_and_error_mapping(hook: Hook, tmp_path: Path) -> None:
    env = ActivityEnvironment()
    beats: list = []
    env.on_heartbeat = lambda *d: beats.append(d)
    local = TicketActivities(LocalTicketStore(tmp_path / "local"))
    ref = await env.run(local.file_ticket, req("inc-a"))
    assert ref.created and ref.ticket_id == "FM-000001"
    assert (await env.run(local.file_ticket, req("inc-a"))).created is False
    await env.run(local.update_ticket, TicketUpdate(ref.ticket_id, "inc-a", "resolved", "ok"))
    assert beats, "activities heartbeat"
    with pytest.raises(ApplicationError) as ei:
        await env.run(local.update_ticket, TicketUpdate("FM-999999", "inc-a", "resolved", ""))
    assert ei.value.type == "TicketNotFound" and ei.value.non_retryable

    hook.script = [(422, {"error": "node field required"}, {})]
    remote = TicketActivities(webhook(hook, tmp_path / "wh"))
    with pytest.raises(ApplicationError) as ei:
        await env.run(remote.file_ticket, req("inc-b"))
    assert ei.value.type == "TicketRejected" and ei.value.non_retryable
    assert ei.value.details[0] == {"status_code": 422}


if sys.platform != "linux":  # pragma: no cover
    pytestmark = pytest.mark.skip("fcntl/flock semantics verified on Linux only")


async def test_crash_between_index_and_ticket_write_still_files_one_ticket(tmp_path):
    """kill -9 after the incident index was written but before the ticket: the retry completes the
    same ticket id instead of allocating a second one."""
    store = LocalTicketStore(tmp_path)
    req = TicketRequest(incident_id="remediate/c/n1/run-1", cluster="c", node="n1", title="t", severity="fatal",
                        fault_class="xid79", evidence={})
    ref = await store.file(req)
    store._path(ref.ticket_id).unlink()  # what a crash before the ticket write leaves behind
    again = await store.file(req)
    assert again.ticket_id == ref.ticket_id and again.created
    assert [t["ticket_id"] for t in store.list()] == [ref.ticket_id]
    assert (await store.file(req)).created is False
