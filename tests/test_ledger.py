"""The incident ledger on a real nats-server (`fleetmend.infra.ledger`), phase by phase as the router and the
activities write it, and `fleetmend report` (the real CLI) over it.

- A drained incident: the router's note, the drain (fingerprint versions and serials, rack), diagnostics,
  ticket, resolution, return, close; each phase retried changes nothing; the record moves to `inc.…`.
- The repaired part came back unchanged: the ticket's comment and the report say "part not replaced"; the same
  part failing again with the same fault class is a repeat part (RMA like a lemon).
- (A version finding and its vendor bundle from running agents: tests/test_version_finding_agents.py.)
- A ledger write never fails its caller (NATS gone: logged, counted, None).
- The ledger's clock: in an activity, the Temporal server's time of the attempt (tests/test_ledger_intervals.py
  skips time with it); elsewhere this host's.
(Roll-up into packs: tests/test_ledger_pack.py.)
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone

import pytest

from fleetmend import subjects
from fleetmend.fingerprint import Fingerprint, HardwareClass
from fleetmend.infra import metrics
from fleetmend.infra.jetstream import ensure_fingerprint_stores
from fleetmend.infra.ledger import LedgerStore
from fleetmend.policy import FailureDomain, Topology

GPU = "0000:3b:00.0"


async def cli(nats_url: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "FLEETMEND_NATS_URL": nats_url, "FLEETMEND_LOG_FORMAT": "json"}
    return await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "fleetmend.cli.main", *args], env=env,
                                   capture_output=True, text=True, timeout=120)


async def put_fingerprint(js, fp: Fingerprint) -> None:
    kv = await ensure_fingerprint_stores(js)
    await kv.put(subjects.fingerprint_kv_key(fp.cluster, fp.node), fp.to_json_bytes())


def fingerprint(cluster: str, node: str, serial: str, driver: str = "550.90.07") -> Fingerprint:
    return Fingerprint(cluster=cluster, node=node, hardware=HardwareClass(gpu_model="H100", gpu_count=8),
                       versions={"nvidia_driver": driver, "vbios": "96.00.74.00.0B", "kernel": "5.15.0"},
                       serials={GPU: serial})


async def incident(store: LedgerStore, cluster: str, node: str, incident_id: str, observed: datetime, *,
                   resolve: bool = True) -> str | None:
    """One incident, every phase twice (activities retry); returns the drain's repeat-part reason."""
    note = {"observed_at": observed.timestamp(), "routed_at": observed.timestamp() + 0.5, "fault_class": "xid79",
            "kind": "xid", "code": 79, "device": GPU, "severity": "fatal", "raw": "NVRM: Xid (PCI:0000:3b:00): 79"}
    for _ in range(2):
        await store.note_routed(cluster, node, [note])
    wid = subjects.workflow_id(cluster, node)
    why = None
    for _ in range(2):
        got = await store.drained(cluster=cluster, node=node, incident_id=incident_id, workflow_id=wid,
                                  observed_at=observed, reason=f"xid79 incident {incident_id}", drained=True,
                                  state="drained")
        why = why or got
    for _ in range(2):
        await store.diagnosed(cluster=cluster, node=node, incident_id=incident_id, attempt="run/1", result="fail",
                              checks=[{"name": "gpu_count", "result": "fail", "measured": "7", "expected": "8"}])
        await store.recovered(cluster=cluster, node=node, incident_id=incident_id, attempt="run/2", op="reboot",
                              result="dry_run")
        await store.ticket_filed(cluster=cluster, node=node, incident_id=incident_id, ticket="T-1",
                                 title=f"[fleetmend] {node}: xid79 (fatal)", fault_class="xid79",
                                 evidence={"raw": "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus."})
    if resolve:
        said = await store.ticket_updated(incident_id=incident_id, ticket="T-1", status="resolved")
        await store.returned(cluster=cluster, node=node, incident_id=incident_id, resumed=True)
        await store.returned(cluster=cluster, node=node, incident_id=incident_id, resumed=True)
        await store.closed(cluster=cluster, node=node, workflow_id=wid, outcome="returned_to_service")
        await store.closed(cluster=cluster, node=node, workflow_id=wid, outcome="returned_to_service")
        assert said is None or "part not replaced" in said
        store.last_said = said  # type: ignore[attr-defined]
    return why


async def test_an_incident_phase_by_phase_then_the_same_part_again(nc, nats_server, unique):
    cluster, node = f"l{unique}", "gpu-7.rack1"
    js = nc.jetstream()
    await put_fingerprint(js, fingerprint(cluster, node, "GPU-aaaa"))
    store = LedgerStore(js, topology=Topology({node: FailureDomain(rack="r1")}))
    t0 = datetime.now(timezone.utc)
    assert await incident(store, cluster, node, f"remediate/{cluster}/{node}/run1", t0) is None
    assert "part not replaced" in store.last_said and GPU in store.last_said  # type: ignore[attr-defined]

    heads = await store.read_heads(cluster, with_detail=True)
    assert len(heads) == 1, heads
    h = heads[0]
    assert h["_key"].startswith(f"inc.{cluster}.") and h["outcome"] == "returned_after_repair"
    assert h["fault_class"] == "xid79" and h["device"] == GPU and h["gpu_count"] == 8
    assert h["observed_at"] == pytest.approx(t0.timestamp()) and h["routed_at"] == pytest.approx(t0.timestamp() + 0.5)
    assert h["drained_at"] <= h["ticket_filed_at"] <= h["ticket_closed_at"] <= h["returned_at"] <= h["closed_at"]
    assert h["diags"] == 1 and h["diag_failed"] == ["gpu_count"] and h["recovery"] == ["reboot:dry_run"]
    assert h["versions_drain"]["nvidia_driver"] == "550.90.07" == h["versions_return"]["nvidia_driver"]
    assert h["part_serial_drain"] == h["part_serial_return"] == "GPU-aaaa" and h["part_not_replaced"] is True
    assert h["_detail"]["serials_drain"] == {GPU: "GPU-aaaa"} and "fallen off the bus" in h["_detail"]["raw"]
    assert h["_detail"]["diagnostics"][0]["checks"][0]["measured"] == "7"
    assert await store.read_record(subjects.ledger_open_key(cluster, node)) is None, "the open record moved on"

    # the same part (serial GPU-aaaa) fails again with xid79: a repeat part, straight to RMA
    why = await incident(store, cluster, node, f"remediate/{cluster}/{node}/run2", t0 + timedelta(seconds=5),
                         resolve=False)
    assert why is not None and "repeat part" in why and "xid79" in why
    again = await store.drained(cluster=cluster, node=node, incident_id=f"remediate/{cluster}/{node}/run2",
                                workflow_id=subjects.workflow_id(cluster, node), observed_at=t0 + timedelta(seconds=5),
                                reason="xid79 incident", drained=True, state="drained")
    assert again == why, "a retried drain answers the same"
    rep = json.loads((await cli(nats_server.url, "report", "--json", "--cluster", cluster, "--since", "1h")).stdout)
    assert rep["gpu_hours_by_fault_class"]["xid79"] > 0 and rep["incidents"] == 2
    assert rep["outcomes"] == {"returned_after_repair": 1, "still_out": 1}
    assert rep["parts_not_replaced"][0]["serial"] == "GPU-aaaa"
    assert any("repeat part" in w for x in rep["lemons"] if x["node"] == node for w in x["why"])
    # the second fault came within the router's one-minute throttle of the first: its routing is unknown, not made up
    assert rep["time_to_detect_s"]["n"] == 1 and rep["time_to_detect_s"]["mean"] == pytest.approx(0.5, abs=0.01)
    assert rep["gpu_hours_by_rack"].get("r1", 0) > 0
    text = (await cli(nats_server.url, "report", "--cluster", cluster, "--since", "1h")).stdout
    assert "part not replaced" in text and "GPU-hours" in text


async def test_a_ledger_write_never_fails_its_caller(nats_server):
    import nats

    client = await nats.connect(nats_server.url)
    store = LedgerStore(client.jetstream())
    await client.close()
    before = metrics.LEDGER_WRITE_FAILURES.labels(phase="drained")._value.get()
    t = time.monotonic()
    got = await store.drained(cluster="c", node="n", incident_id="remediate/c/n/r", workflow_id="remediate/c/n",
                              observed_at=None, reason="xid79 incident", drained=True, state="drained")
    assert got is None and time.monotonic() - t < 6
    assert metrics.LEDGER_WRITE_FAILURES.labels(phase="drained")._value.get() == before + 1
    await store.note_routed("c", "n", [{"observed_at": 1.0, "kind": "xid"}])  # no exception either


class RecordingChannel:
    """A notification channel (the `activities.notify.Channel` plug-in) that keeps what it was sent."""

    name = "recording"

    def __init__(self) -> None:
        self.sent: list = []

    def wants(self, n) -> bool:
        return True

    async def send(self, client, n) -> None:
        self.sent.append(n)


async def test_the_elected_worker_exports_the_report_and_notifies_each_finding_once(nc, unique, tmp_path):
    from activities.notify import Notifier
    from fleetmend.config import load_settings
    from fleetmend.worker.service import report_refresh

    cluster = f"w{unique}"
    js = nc.jetstream()
    for i in range(12):
        drv = "535.104.05" if i >= 9 else "550.90.07"
        await put_fingerprint(js, fingerprint(cluster, f"n{i}", f"GPU-{i}", driver=drv))
    store = LedgerStore(js)
    for i in (9, 10, 11):
        await incident(store, cluster, f"n{i}", f"remediate/{cluster}/n{i}/r", datetime.now(timezone.utc),
                       resolve=False)
    s = load_settings(None, cluster=cluster, notify={"webhook_url": "http://127.0.0.1:9/unused"})
    channel = RecordingChannel()
    notifier = Notifier([channel], js)
    rep = await report_refresh(s, store, notifier)
    again = await report_refresh(s, store, notifier)
    assert [f["value"] for f in rep["findings"]] == ["535.104.05"] and again["findings"] == rep["findings"]
    assert len(channel.sent) == 1 and channel.sent[0].event.value == "version_finding"
    assert "--vendor-bundle" in channel.sent[0].summary and "535.104.05" in channel.sent[0].summary
    gauge = metrics.REPORT_GPU_HOURS.labels(cluster=cluster, by="fault_class", group="xid79")._value.get()
    assert gauge == pytest.approx(again["gpu_hours_by_fault_class"]["xid79"])  # the latest refresh
    assert metrics.REPORT_FIGURE.labels(cluster=cluster, figure="version_findings")._value.get() == 1
    metrics.forget_report(cluster)
    assert not [s for s in metrics.REPORT_FIGURE.collect()[0].samples if s.labels["cluster"] == cluster]


async def test_the_ticket_update_says_part_not_replaced(nc, unique, tmp_path):
    """The real ticket activities (Temporal's ActivityEnvironment runs them) over the local ticket store: the
    resolving update's comment says the part was not replaced when its serial is the one at the drain, and says
    nothing when the part was swapped."""
    from temporalio.testing import ActivityEnvironment

    from activities.ticket_store import LocalTicketStore
    from activities.tickets import TicketActivities
    from fleetmend.messages import TicketRequest, TicketUpdate

    js = nc.jetstream()
    store = LedgerStore(js)
    acts = TicketActivities(LocalTicketStore(tmp_path / "tickets"), ledger=store)
    env = ActivityEnvironment()
    comments = {}
    for node, swapped in (("same", False), ("swapped", True)):
        cluster = f"t{unique}"
        await put_fingerprint(js, fingerprint(cluster, node, "GPU-old"))
        iid = f"remediate/{cluster}/{node}/run"
        await incident(store, cluster, node, iid, datetime.now(timezone.utc), resolve=False)
        ref = await env.run(acts.file_ticket, TicketRequest(incident_id=iid, cluster=cluster, node=node,
                                                           title=f"[fleetmend] {node}: xid79 (fatal)", severity="fatal",
                                                           fault_class="xid79", evidence={"raw": "Xid 79"}))
        if swapped:  # the repair put in another GPU: the agent's next fingerprint has its UUID
            await put_fingerprint(js, fingerprint(cluster, node, "GPU-new"))
        await env.run(acts.update_ticket, TicketUpdate(ticket_id=ref.ticket_id, incident_id=iid, status="resolved",
                                                       comment="Verification passed; node returned to service."))
        doc = await acts.filer.get(ref.ticket_id)
        comments[node] = doc["history"][-1]["comment"]
    assert "Part not replaced: 0000:3b:00.0 has serial GPU-old" in comments["same"]
    assert "not replaced" not in comments["swapped"]


async def test_the_ledger_clock_is_the_activity_s_server_time():
    """In an activity the ledger writes the Temporal server's time of the attempt's start (the time-skipping
    test of the intervals relies on it); outside one, and in an ActivityEnvironment without a server, this host's."""
    import dataclasses

    from temporalio import activity
    from temporalio.testing import ActivityEnvironment

    from fleetmend.infra.ledger import clock

    @activity.defn
    async def now() -> float:
        return clock()

    env = ActivityEnvironment()
    t = time.time()
    assert t - 1 <= await env.run(now) <= time.time() + 1, "no server: this host's clock"
    env.info = dataclasses.replace(env.info, started_time=datetime(2030, 1, 2, tzinfo=timezone.utc))
    assert await env.run(now) == datetime(2030, 1, 2, tzinfo=timezone.utc).timestamp()
    assert t - 1 <= clock() <= time.time() + 1
