"""The deployment's one ticket ledger in JetStream KV, shared by worker replicas: two filers on their
own NATS connections (as two worker replicas are) against the real nats-server."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import nats
import pytest

from activities.ticket_kv import KvTicketStore, incident_key
from activities.tickets import build_ticket_filer
from fleetmend.config import Settings
from fleetmend.messages import TicketRequest, TicketUpdate

REPO = Path(__file__).resolve().parents[1]


def req(incident: str, node: str = "gpu-1", cluster: str = "c1") -> TicketRequest:
    return TicketRequest(incident_id=incident, cluster=cluster, node=node, title=f"{node}: xid79",
                         severity="fatal", fault_class="xid79", evidence={"raw": ["NVRM: Xid 79"]})


@pytest.fixture
async def replicas(nats_server, unique):
    """Two ledgers on two connections, one bucket: what two worker replicas see."""
    a, b = await nats.connect(nats_server.url), await nats.connect(nats_server.url)
    bucket = f"tickets_{unique}"
    yield KvTicketStore(a.jetstream(), bucket=bucket), KvTicketStore(b.jetstream(), bucket=bucket)
    await a.close()
    await b.close()


async def test_two_replicas_filing_the_same_incidents_file_each_once(replicas) -> None:
    a, b = replicas
    incidents = [f"remediate/c1/gpu-{i}/run{i}" for i in range(12)]
    refs = await asyncio.gather(*(f.file(req(inc)) for inc in incidents for f in (a, b, a)))
    by_incident: dict[str, list] = {}
    for inc, ref in zip([inc for inc in incidents for _ in range(3)], refs, strict=True):
        by_incident.setdefault(inc, []).append(ref)
    for inc, rs in by_incident.items():
        assert len({r.ticket_id for r in rs}) == 1, (inc, rs)  # one ticket id per incident
        assert sum(r.created for r in rs) == 1, (inc, rs)  # created exactly once
    listed_a, listed_b = await a.list_all(), await b.list_all()
    assert listed_a == listed_b and len(listed_a) == len(incidents)  # both replicas read one ledger
    assert len({t["ticket_id"] for t in listed_a}) == len(incidents)  # ids never collide across replicas


async def test_a_crash_between_index_and_ticket_never_files_twice(replicas) -> None:
    a, b = replicas
    # Replica A wrote the incident's index and died before the ticket document (what it leaves behind):
    kv = await a.kv()
    await kv.create(incident_key("inc-crash"), json.dumps({"ticket_id": "FM-000777"}).encode())
    assert await a.find_by_incident("inc-crash") is None
    # The activity is retried on replica B: it finishes the ticket under the id A had taken.
    first = await b.file(req("inc-crash"))
    assert (first.ticket_id, first.created) == ("FM-000777", True)
    again = await asyncio.gather(a.file(req("inc-crash")), b.file(req("inc-crash")))
    assert [(r.ticket_id, r.created) for r in again] == [("FM-000777", False)] * 2
    assert [t["ticket_id"] for t in await a.list_all()] == ["FM-000777"]


async def test_concurrent_updates_from_both_replicas_both_land(replicas) -> None:
    a, b = replicas
    ref = await a.file(req("inc-upd"))
    await asyncio.gather(a.update(TicketUpdate(ref.ticket_id, "inc-upd", "diagnosed", "dcgm fail")),
                         b.update(TicketUpdate(ref.ticket_id, "inc-upd", "awaiting", "RMA open")))
    doc = await b.get(ref.ticket_id)
    assert [h["comment"] for h in doc["history"]][1:] in (["dcgm fail", "RMA open"], ["RMA open", "dcgm fail"])
    await b.update(TicketUpdate(ref.ticket_id, "inc-upd", "Resolved", "swapped"))
    st = await a.poll(ref.ticket_id)
    assert st.status == "Resolved" and st.repaired


async def test_worker_filer_uses_the_kv_ledger_and_the_cli_reads_it(nats_server, tmp_path, unique) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        filer = build_ticket_filer(Settings(state_dir=tmp_path, cluster=f"l{unique}"), js=nc.jetstream())
        assert isinstance(filer, KvTicketStore)
        ref = await filer.file(req(f"inc-{unique}", node=f"gpu-{unique}", cluster=f"l{unique}"))
    finally:
        await nc.close()
    assert not (tmp_path / "tickets").exists()  # nothing on the replica's own disk
    env = {**os.environ, "FLEETMEND_NATS_URL": nats_server.url, "FLEETMEND_STATE_DIR": str(tmp_path / "other")}
    p = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "fleetmend.cli.main", "tickets", "--json"],
                                capture_output=True, text=True, cwd=REPO, timeout=60, env=env)
    assert p.returncode == 0, p.stderr
    mine = [t for t in json.loads(p.stdout) if t["ticket_id"] == ref.ticket_id]
    assert len(mine) == 1 and mine[0]["node"] == f"gpu-{unique}" and mine[0]["evidence"]["raw"]
    files = build_ticket_filer(Settings(state_dir=tmp_path, tickets={"ledger": "files"}), js=object())
    assert type(files).__name__ == "LocalTicketStore"
