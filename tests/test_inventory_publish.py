"""The inventory probe over real NATS: the KV bucket holds the latest fingerprint, the stream its changes; live fixes
are dry runs by default, applied and verified when `policy.reconfigure` is on."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

from agents.commands import ReconfigureHandler
from agents.inventory.probe import InventoryProbe
from fleetmend.fingerprint import Fingerprint, FingerprintChange, ReconfigureReport, ReconfigureRequest
from fleetmend.subjects import FINGERPRINT_KV_BUCKET, fingerprint_kv_key, fingerprint_subject, reconfigure_subject
from tests.conftest import assert_eventually
from tests.fixtures.hosts.synth import HostSpec, build_host


async def _changes(nc: Any, cluster: str, node: str) -> list[FingerprintChange]:
    js = nc.jetstream()
    sub = await js.subscribe(fingerprint_subject(cluster, node), ordered_consumer=True)
    out = []
    try:
        while True:
            msg = await sub.next_msg(timeout=0.5)
            out.append(FingerprintChange.model_validate_json(msg.data))
    except Exception:
        pass
    finally:
        await sub.unsubscribe()
    return out


async def _latest(nc: Any, cluster: str, node: str) -> Fingerprint:
    kv = await nc.jetstream().key_value(FINGERPRINT_KV_BUCKET)
    return Fingerprint.model_validate_json((await kv.get(fingerprint_kv_key(cluster, node))).value)


async def test_published_at_start_and_on_change(nc: Any, tmp_path: Path, unique: str) -> None:
    root = build_host(tmp_path / "h")
    node = f"n-{unique}.example"
    probe = InventoryProbe(root, unique, node, interval_s=3600, change_poll_s=0.2)
    task = asyncio.create_task(probe.run(None))
    try:
        await probe.attach(nc)
        await assert_eventually(lambda: probe.published >= 1, what="first fingerprint published")
        fp = await _latest(nc, unique, node)
        assert fp.node == node and fp.hardware.gpu_count == 8 and fp.settings["cpu.governor"] == "performance"
        (first,) = await _changes(nc, unique, node)
        assert first.first and first.digest_after == fp.digest
        # someone sets powersave by hand: the next read records who/what/when
        for f in root.glob("sys/devices/system/cpu/cpu*/cpufreq/scaling_governor"):
            f.write_text("powersave\n")
        probe.reread("test")
        await assert_eventually(lambda: probe.published >= 2, what="second fingerprint published")
        changes = await _changes(nc, unique, node)
        assert [c.changed for c in changes[1:]] == [{"cpu.governor": ["performance", "powersave"]}]
        assert changes[1].seen_by == "test"
        # a device disappears (udev remove): noticed without waiting for the interval
        (root / "sys/bus/pci/devices/0000:df:00.0").unlink()
        await assert_eventually(lambda: probe.published >= 3, what="device change published")
        last = (await _changes(nc, unique, node))[-1]
        assert last.topology_changed and "(device change)" in last.seen_by
        from fleetmend.cli.drift import topology_changes

        flagged = await topology_changes(nc.jetstream(), unique)  # what `fleetmend drift` lists after a repair
        assert [(t["node"], t["seen_by"]) for t in flagged] == [(node, last.seen_by)]
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_restart_compares_with_the_bucket(nc: Any, tmp_path: Path, unique: str) -> None:
    root = build_host(tmp_path / "h")
    for _ in range(2):  # the second agent run finds its fingerprint in the bucket: no new change record
        probe = InventoryProbe(root, unique, "n1", interval_s=3600)
        task = asyncio.create_task(probe.run(None))
        await probe.attach(nc)
        await assert_eventually(lambda p=probe: p.published >= 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert len(await _changes(nc, unique, "n1")) == 1


async def test_live_fix_dry_run_then_applied_and_verified(nc: Any, tmp_path: Path, unique: str) -> None:
    root = build_host(tmp_path / "h", HostSpec(governor="powersave", peermem=False, numa_balancing="1",
                                               thp="always", irq_off_node=True))
    fixes = {"cpu.governor": "performance", "gpudirect.peermem": "loaded", "kernel.numa_balancing": "0",
             "mm.thp_enabled": "never", "irq.affinity.compute.0000:1c:00.0": "local", "iommu.mode": "off"}
    probe = InventoryProbe(root, unique, "n1", interval_s=3600, reconfigure=False)
    task = asyncio.create_task(probe.run(None))
    try:
        await probe.attach(nc)
        req = ReconfigureRequest(cluster=unique, node="n1", incident_id="inc-1", fixes=fixes, dry_run=False)
        msg = await nc.request(reconfigure_subject(unique, "n1"), req.model_dump_json().encode(), timeout=10)
        report = ReconfigureReport.model_validate_json(msg.data)
        assert report.dry_run and not report.verified  # policy.reconfigure is off: nothing written
        assert all(not r.applied for r in report.results)
        assert (root / "proc/sys/kernel/numa_balancing").read_text().strip() == "1"
        by_key = {r.key: r for r in report.results}
        assert by_key["cpu.governor"].detail.startswith("dry run: would write 'performance' to 8")
        assert by_key["iommu.mode"].detail.startswith("cannot: iommu.mode is not set live")
        # bad input: one line back, no traceback
        msg = await nc.request(reconfigure_subject(unique, "n1"), b"{not json", timeout=10)
        assert ReconfigureReport.model_validate_json(msg.data).error.startswith("invalid reconfigure request")
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    # policy.reconfigure on; modprobe stands in as a script that creates the module dir under the host root
    modprobe = [sys.executable, "-c", f"import os; os.makedirs({str(root / 'sys/module/nvidia_peermem')!r})"]
    fixer = ReconfigureHandler(root, unique, "n1", enabled=True, peermem_command=modprobe)
    report = await fixer.handle(ReconfigureRequest(cluster=unique, node="n1", fixes=fixes, dry_run=False))
    by_key = {r.key: r for r in report.results}
    for key in fixes:
        if key != "iommu.mode":
            assert by_key[key].applied and by_key[key].verified, by_key[key]
    assert not by_key["iommu.mode"].verified and not report.verified  # a reboot-only key never verifies live
    assert (root / "proc/irq/100/smp_affinity_list").read_text().strip() == "0-3"
    again = await fixer.handle(ReconfigureRequest(cluster=unique, node="n1", fixes={"cpu.governor": "performance"},
                                                  dry_run=False))
    assert again.verified and again.results[0].detail == "already holds" and not again.results[0].applied


async def test_reconfigure_activity_refuses_what_cannot_be_set_live(nc: Any, unique: str) -> None:
    from temporalio.exceptions import ApplicationError
    from temporalio.testing import ActivityEnvironment

    from activities.reconfigure import ReconfigureActivities

    act = ReconfigureActivities(nc).reconfigure_node
    with pytest.raises(ApplicationError, match="not live-fixable: iommu.mode") as e:
        await ActivityEnvironment().run(act, ReconfigureRequest(cluster=unique, node="n1", fixes={"iommu.mode": "pt"}))
    assert e.value.type == "InvalidRequest" and e.value.non_retryable
    with pytest.raises(ApplicationError, match="no agent answers live fixes") as e:
        await ActivityEnvironment().run(act, ReconfigureRequest(cluster=unique, node="n1",
                                                                fixes={"cpu.governor": "performance"}, timeout_s=2))
    assert e.value.type == "AgentUnreachable" and not e.value.non_retryable
