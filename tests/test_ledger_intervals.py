"""The ledger's intervals from one incident on Temporal's time-skipping test server, with known (skipped) durations.

Everything is the real thing except the clock: the router (signal-with-start, its ledger note), the worker as
`fleetmend worker` builds it (`build_worker`: the real FleetGuard, drain under the permit pool with the standalone
scheduler, diagnostics over NATS, the local ticket ledger, the incident ledger written by the activities), and the
agent's own diagnostics responder (`agents.diag.DiagResponder`) over a real nats-server. A fatal `nvme_removed`
(clearable: the incident waits `debounce_s` for the device to come back) goes through drain → diagnose → ticket →
repaired → verify → settle → return, and the test skips the waits: the debounce (D), the repair (W) and the settle
after verification (S). The ledger's times are the Temporal server's (`fleetmend.infra.ledger.clock`), so:

- time to drain (fault line → cordon) = D,
- MTTR (drain → return) = W + S, ticket turnaround (filed → resolved) = W + S,

each within a second plus the real seconds the test's own steps took inside that span outside the skips (a skip
moves the server's clock by exactly its duration; the activities and the test's polling run in real time).
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment

from agents.diag import DiagResponder
from fleetmend import subjects
from fleetmend.catalog import load_catalog
from fleetmend.config import load_settings
from fleetmend.dev import servers
from fleetmend.events import Component, Device, FaultEvent, Severity, Source
from fleetmend.infra.converter import data_converter
from fleetmend.infra.jetstream import ensure_deadletter_stream, ensure_fault_stream
from fleetmend.infra.ledger import LedgerStore
from fleetmend.messages import RepairedCommand
from fleetmend.report import FIELDS, ReportParams, build_report
from fleetmend.router.core import Router
from fleetmend.worker import build_worker
from tests.conftest import assert_eventually
from tests.test_fleetguard import register_search_attributes
from tests.test_ledger import fingerprint, put_fingerprint
from workflows.remediation import NodeRemediation

D = 300.0
"""Debounce: the incident waits this long for the NVMe controller to come back before it drains."""
W = 5 * 3600.0
"""The repair: from the ticket (awaiting repair) to `fleetmend repaired`."""
S = 1800.0
"""`policy.settle_s`: clean after verification for this long before the return."""


@pytest.fixture
async def tsenv():
    env = await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=servers.find_binary("temporal-test-server"), data_converter=data_converter)
    await register_search_attributes(env)
    yield env
    await env.shutdown()


async def test_ledger_intervals_equal_the_skipped_durations(tsenv, nats_server, nc, unique, tmp_path: Path):
    env = tsenv
    cluster, node = f"iv{unique}", "gpu-17"
    s = load_settings(None, cluster=cluster, nats_url=nats_server.url, state_dir=tmp_path / "state",
                      scheduler="standalone", task_queue=f"tq-{unique}",
                      policy={"debounce_s": D, "settle_s": S, "ticket_poll_s": 0.0, "recovery_settle_s": 0.0,
                              "cluster_nodes": 16})
    js = nc.jetstream()
    await ensure_fault_stream(js)
    await ensure_deadletter_stream(js)
    await put_fingerprint(js, fingerprint(cluster, node, "GPU-17"))
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("6,1,0,-;hello\n")
    responder = DiagResponder(nc, cluster, node, sysfs_root=tmp_path / "host", kmsg_path=kmsg)  # no GPU, no IB
    await responder.start()
    stop = asyncio.Event()
    router = Router(s, nc, js, env.client, load_catalog(), filter_subject=f"fleet.{cluster}.fault.*",
                    durable=f"iv-{unique}")
    worker = await build_worker(s, env.client, nc)
    tasks = [asyncio.create_task(router.run(stop)), asyncio.create_task(worker.run())]
    handle = env.client.get_workflow_handle_for(NodeRemediation.run, subjects.workflow_id(cluster, node))
    real: dict[str, float] = {}

    store = LedgerStore(js)
    slept = [0.0]  # real seconds spent inside the skips (the server's clock jumps by the duration instead)

    async def skip(seconds: float) -> None:
        r = time.monotonic()
        await env.sleep(timedelta(seconds=seconds))
        slept[0] += time.monotonic() - r

    async def phase(want: str, noted: str | None = None):
        try:
            st = await handle.query(NodeRemediation.status)
        except Exception:
            return None
        if st.phase != want:
            return None
        # a note the workflow makes in the same task that starts its next timer: the timer is there to skip
        if noted is not None and not any(noted in str(e) for e in st.timeline):
            return None
        return st

    try:
        # the NVMe controller disappears: the agent's udev probe's event, observed now (the server's clock)
        t0 = (await env.get_current_time()).timestamp()
        ev = FaultEvent(cluster=cluster, node=node, component=Component.NVME, kind="nvme_removed",
                        severity=Severity.FATAL, source=Source.UDEV, device=Device(pci_bus_id="0000:c1:00.0"),
                        raw="udev: remove pci 0000:c1:00.0 (PCI_CLASS 10802)", message="NVMe controller removed",
                        observed_at=datetime.fromtimestamp(t0, timezone.utc))
        r0 = time.monotonic()
        await js.publish(subjects.fault_subject(cluster, node), ev.to_json_bytes(), headers={"Nats-Msg-Id": ev.event_id})
        await assert_eventually(lambda: phase("triage"), timeout_s=60, what="incident waiting out the debounce")
        await skip(D)  # the controller does not come back
        st = await assert_eventually(lambda: phase("awaiting_repair"), timeout_s=60, what="drained, ticket filed")
        assert st.drained and st.ticket and st.fault_class == "nvme_removed"
        real["to_drain"] = time.monotonic() - r0 - slept[0]  # ⊇ the real part of fault line → cordon

        r1, slept[0] = time.monotonic(), 0.0
        await skip(W)  # the technician reseats the drive
        await handle.execute_update(NodeRemediation.mark_repaired, RepairedCommand(by="tech@dc", note="reseated"))
        await assert_eventually(lambda: phase("verifying", "verification: pass"), timeout_s=60,
                                what="verified, settling")
        await skip(S)
        st = await assert_eventually(lambda: phase("closed"), timeout_s=60, what="returned to service")
        assert st.outcome == "returned_to_service" and not st.drained
        real["repair"] = time.monotonic() - r1 - slept[0] + real["to_drain"]  # ⊇ the real part of drain → return

        (h,) = await store.read_heads(cluster)
        assert h["outcome"] == "returned_after_repair" and h["ticket"] == st.ticket
        assert h["observed_at"] == pytest.approx(t0, abs=1e-3)
        to_drain = h["drained_at"] - h["observed_at"]
        mttr = h["returned_at"] - h["drained_at"]
        turnaround = h["ticket_closed_at"] - h["ticket_filed_at"]
        tol_drain, tol_repair = 1.0 + real["to_drain"], 1.0 + real["repair"]
        print(f"\nledger: time to drain {to_drain:.3f} s (skipped {D:.0f}), MTTR {mttr:.3f} s and turnaround "
              f"{turnaround:.3f} s (skipped {W + S:.0f}); real seconds in the spans: {real}")
        assert D <= to_drain <= D + tol_drain, to_drain
        assert W + S <= mttr <= W + S + tol_repair, mttr
        assert W + S <= turnaround <= W + S + tol_repair, turnaround

        # the report's figures over the ledger, at the server's now (its clock ran D + W + S ahead of this host's)
        now = (await env.get_current_time()).timestamp()
        rep = build_report(await store.read_heads(cluster, fields=FIELDS), ReportParams(since=now - 86400, now=now))
        assert rep["incidents"] == 1 and rep["outcomes"] == {"returned_after_repair": 1}
        assert rep["time_to_drain_s"]["mean"] == pytest.approx(to_drain, abs=1e-3)
        assert rep["mttr_h"]["mean"] == pytest.approx(mttr / 3600, abs=1e-3)
        assert rep["ticket_turnaround_h"]["mean"] == pytest.approx(turnaround / 3600, abs=1e-3)
        assert rep["gpu_hours"] == pytest.approx(8 * mttr / 3600, abs=0.01), "8 GPUs from the fingerprint"
        assert rep["time_to_detect_s"]["n"] == 1 and rep["time_to_detect_s"]["mean"] < tol_drain
    finally:
        stop.set()
        await worker.shutdown()
        for t in tasks:
            try:
                await asyncio.wait_for(t, 30)
            except (asyncio.CancelledError, Exception):
                pass
        await responder.stop()
