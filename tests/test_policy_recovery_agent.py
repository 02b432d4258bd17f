"""GPU reset / reboot requests end to end: RecoveryActivities → real NATS → the agent's diag
subscriber → agents/recovery.py, with stand-in `nvidia-smi` / reboot scripts on PATH."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from temporalio.testing import ActivityEnvironment

from activities.recovery import RecoveryActivities
from agents.diag import DiagResponder
from agents.recovery import RecoveryHandler
from fleetmend.diagnostics import DiagRequest, RecoveryOp, RecoveryRequest, RecoveryResult
from fleetmend.messages import RecoveryActivityRequest
from tests.conftest import assert_eventually

BUS = "0000:3b:00.0"


def script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.fixture
def fake_bin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A PATH with only a stand-in nvidia-smi: apps listed from $APPS_FILE; `-r` logged to $RESET_LOG."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (tmp_path / "apps").write_text("")
    script(bin_ / "nvidia-smi", f"""case "$1" in
  --query-compute-apps=*) cat {tmp_path / 'apps'} ;;
  -r) echo "$@" >> {tmp_path / 'reset.log'}; echo "GPU $3 was successfully reset." ;;
  *) exit 2 ;;
esac
""")
    script(bin_ / "fake-reboot", f"echo rebooting >> {tmp_path / 'reboot.log'}\n")
    monkeypatch.setenv("PATH", f"{bin_}:/usr/bin:/bin")
    return tmp_path


async def test_reset_refused_while_a_process_holds_the_gpu_then_applied(fake_bin: Path):
    h = RecoveryHandler("c", "n")
    (fake_bin / "apps").write_text("00000000:3B:00.0, 4242\n00000000:5E:00.0, 7\n")
    report, _ = await h.handle(RecoveryRequest(op=RecoveryOp.RESET_GPU, pci_bus_id=BUS))
    assert report.result is RecoveryResult.REFUSED and "4242" in report.detail and "7" not in report.detail
    assert not (fake_bin / "reset.log").exists()
    (fake_bin / "apps").write_text("00000000:5E:00.0, 7\n")
    report, _ = await h.handle(RecoveryRequest(op=RecoveryOp.RESET_GPU, pci_bus_id=BUS))
    assert report.result is RecoveryResult.APPLIED, report.detail
    assert (fake_bin / "reset.log").read_text().split() == ["-r", "-i", BUS]


async def test_reset_not_applicable_without_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    report, _ = await RecoveryHandler("c", "n").handle(RecoveryRequest(op=RecoveryOp.RESET_GPU, pci_bus_id=BUS))
    assert report.result is RecoveryResult.NOT_APPLICABLE


async def test_reboot_is_a_dry_run_unless_configured(fake_bin: Path):
    report, after = await RecoveryHandler("c", "n").handle(RecoveryRequest(op=RecoveryOp.REBOOT))
    assert report.result is RecoveryResult.DRY_RUN and after is None
    report, after = await RecoveryHandler("c", "n", reboot_command=["fake-reboot"]).handle(
        RecoveryRequest(op=RecoveryOp.REBOOT))
    assert report.result is RecoveryResult.APPLIED and not (fake_bin / "reboot.log").exists()
    await after()  # runs after the reply is sent
    assert (fake_bin / "reboot.log").read_text() == "rebooting\n"


async def test_recovery_request_over_nats_shares_the_diag_subject(nc, fake_bin: Path, unique: str):
    diag = DiagResponder(nc, unique, "node1", nvml=None)
    diag.recovery = RecoveryHandler(unique, "node1", reboot_command=["fake-reboot"])
    await diag.start()
    try:
        acts = RecoveryActivities(nc)
        env = ActivityEnvironment()
        rep = await env.run(acts.reset_gpu, RecoveryActivityRequest(cluster=unique, node="node1",
                                                                    op=RecoveryOp.RESET_GPU, pci_bus_id=BUS,
                                                                    timeout_s=10))
        assert rep.result is RecoveryResult.APPLIED and rep.node == "node1"
        rep = await env.run(acts.reboot_node, RecoveryActivityRequest(cluster=unique, node="node1",
                                                                      op=RecoveryOp.REBOOT, timeout_s=10))
        assert rep.result is RecoveryResult.APPLIED and rep.command == ["fake-reboot"]
        # diagnostics still answered on the same subject
        msg = await nc.request(diag.subject, DiagRequest(checks=["kmsg_readable"]).model_dump_json().encode(),
                               timeout=10)
        assert b"kmsg_readable" in msg.data
        await assert_eventually(lambda: (fake_bin / "reboot.log").exists(), what="reboot ran after the reply")
    finally:
        await diag.stop()
