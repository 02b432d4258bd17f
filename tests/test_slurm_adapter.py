"""SlurmScheduler against a real 4-node Slurm 22.05 cluster (tests/fixtures_slurm.py)."""

from __future__ import annotations

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.scheduler import SchedulerActivities
from activities.slurm import SlurmScheduler, normalize_slurm_state, parse_scontrol_node, strip_reason_suffix
from fleetmend.config import SlurmSettings
from fleetmend.errors import NodeNotFoundError
from fleetmend.messages import DrainRequest, UndrainRequest
from tests.conftest import assert_eventually

pytestmark = pytest.mark.slurm


@pytest.fixture
def sched(slurm) -> SlurmScheduler:
    return SlurmScheduler(SlurmSettings(slurm_conf=str(slurm.conf), command_timeout_s=15))


def test_parse_scontrol_line_with_spaces_and_reason() -> None:
    line = ("NodeName=node2 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 OS=Linux 6.18.44 #1 SMP @0  "
            "RealMemory=1000 State=IDLE+DRAIN Partitions=debug  CfgTRES=cpu=1,mem=1000M AllocTRES= "
            "Reason=fleetmend: xid 79 a=b [incident abc] [root@2026-11-29T17:03:16]\n")
    f = parse_scontrol_node(line)
    assert f["NodeName"] == "node2" and f["State"] == "IDLE+DRAIN"
    assert f["OS"] == "Linux 6.18.44 #1 SMP @0" and f["CfgTRES"] == "cpu=1,mem=1000M" and f["AllocTRES"] == ""
    assert strip_reason_suffix(f["Reason"]) == "fleetmend: xid 79 a=b [incident abc]"
    assert [normalize_slurm_state(s) for s in ("IDLE+DRAIN", "ALLOCATED+DRAIN", "MIXED+DRAIN", "DOWN*",
                                                 "IDLE*", "DOWN+DRAIN", "IDLE")] == \
        ["drained", "draining", "draining", "down*", "idle*", "drained", "idle"]


async def test_drain_sets_prefixed_reason_and_is_idempotent(slurm, sched) -> None:
    r = await sched.drain("node1", "xid 79 GPU fell off the bus", "inc-1")
    assert (r.drained, r.owned, r.operator_drained) == (True, True, False)
    assert r.state == "drained"
    assert slurm.state("node1") == "IDLE+DRAIN"
    assert slurm.reason("node1").startswith("fleetmend: xid 79 GPU fell off the bus [incident inc-1] [root@")
    assert slurm.sinfo_state("node1") == "drained"
    assert sched.update_calls == 1

    again = await sched.drain("node1", "xid 79 GPU fell off the bus", "inc-1")
    assert (again.drained, again.owned, again.operator_drained) == (True, True, False)
    assert sched.update_calls == 1, "second drain must not send a second scontrol update"
    assert "no update sent" in again.detail


async def test_operator_drain_is_left_alone_and_never_resumed(slurm, sched) -> None:
    slurm.run("scontrol", "update", "NodeName=node2", "State=DRAIN", "Reason=cabling check by ops")
    r = await sched.drain("node2", "xid 48 DBE", "inc-2")
    assert (r.drained, r.owned, r.operator_drained) == (True, False, True)
    assert sched.update_calls == 0
    assert strip_reason_suffix(slurm.reason("node2")) == "cabling check by ops"

    u = await sched.undrain("node2", "inc-2")
    assert u.resumed is False and u.operator_drained is True
    assert "lacks prefix" in u.detail
    assert slurm.state("node2") == "IDLE+DRAIN"
    assert sched.update_calls == 0


async def test_operator_down_node_is_left_alone(slurm, sched) -> None:
    slurm.run("scontrol", "update", "NodeName=node3", "State=DOWN", "Reason=psu swap")
    r = await sched.drain("node3", "xid 79", "inc-3")
    assert (r.drained, r.owned, r.operator_drained) == (True, False, True)
    assert r.state.startswith("down")
    assert (await sched.undrain("node3", "inc-3")).resumed is False
    assert slurm.state("node3").startswith("DOWN")


async def test_undrain_returns_node_to_idle(slurm, sched) -> None:
    await sched.drain("node3", "xid 94 contained ECC", "inc-4")
    u = await sched.undrain("node3", "inc-4")
    assert u.resumed is True and "RESUME" in u.detail
    # Right after RESUME slurmctld shows idle* until its next ping of slurmd answers.
    await assert_eventually(lambda: slurm.sinfo_state("node3") == "idle", timeout_s=30, what="node3 idle")
    assert await sched.state("node3") == "idle"
    assert slurm.reason("node3") == ""

    again = await sched.undrain("node3", "inc-4")
    assert again.resumed is False and again.operator_drained is False
    assert "not drained" in again.detail


async def test_an_undrain_lifts_only_its_own_incidents_drain(slurm, sched) -> None:
    await sched.drain("node3", "xid 79", "remediate/a/node3/r1")
    u = await sched.undrain("node3", "remediate/a/node3/OTHER")
    assert not u.resumed and "belongs to incident remediate/a/node3/r1" in u.detail
    assert slurm.state("node3") == "IDLE+DRAIN"
    # the node's next incident adopts the drain; then only its undrain lifts it
    r = await sched.drain("node3", "xid 79 again", "remediate/a/node3/r2")
    assert r.owned and "adopted" in r.detail and "[incident remediate/a/node3/r2]" in slurm.reason("node3")
    assert not (await sched.undrain("node3", "remediate/a/node3/r1")).resumed
    assert (await sched.undrain("node3", "remediate/a/node3/r2")).resumed
    await assert_eventually(lambda: slurm.sinfo_state("node3") == "idle", timeout_s=30, what="node3 idle")


async def test_drain_with_running_job_goes_draining_then_drained(slurm, sched) -> None:
    out = slurm.run("sbatch", "-w", "node4", "--parsable", "-o", "/dev/null", "--wrap", "sleep 5")
    job_id = out.stdout.strip().split(";")[0]
    await assert_eventually(
        lambda: slurm.run("squeue", "-h", "-j", job_id, "-o", "%T").stdout.strip() == "RUNNING",
        timeout_s=30, what=f"job {job_id} running")
    r = await sched.drain("node4", "xid 63 row remap pending", "inc-5")
    assert r.owned and r.drained
    assert r.state == "draining" and r.raw_state.startswith(("ALLOCATED+DRAIN", "MIXED+DRAIN"))
    assert slurm.sinfo_state("node4") == "draining"
    # The job is not killed: it runs to completion, then the node is drained.
    await assert_eventually(lambda: slurm.sinfo_state("node4") == "drained", timeout_s=40, what="node4 drained")
    assert (await sched.drain("node4", "xid 63", "inc-5")).state == "drained"


async def test_unknown_node_raises_node_not_found(slurm, sched) -> None:
    with pytest.raises(NodeNotFoundError) as ei:
        await sched.drain("node99", "xid 79", "inc-6")
    assert "node99" in str(ei.value) and str(slurm.conf) in str(ei.value)
    with pytest.raises(NodeNotFoundError):
        await sched.undrain("node99", "inc-6")


async def test_a_hostlist_name_drains_nothing(slurm, sched) -> None:
    # `scontrol update NodeName=node[1-4]` drains all four: one event must never do that on one permit
    for name in ("node[1-4]", "node1,node2"):
        with pytest.raises(NodeNotFoundError, match="hostlist"):
            await sched.drain(name, "xid 79", "inc-h")
        with pytest.raises(NodeNotFoundError, match="hostlist"):
            await sched.undrain(name, "inc-h")
    assert [slurm.sinfo_state(f"node{i}") for i in range(1, 5)] == ["idle"] * 4
    assert sched.update_calls == 0


async def test_list_nodes(slurm, sched) -> None:
    await sched.drain("node1", "xid 79", "inc-7")
    slurm.run("scontrol", "update", "NodeName=node2", "State=DRAIN", "Reason=ops")
    rows = {r.name: r for r in await sched.list_nodes()}
    assert set(rows) == {"node1", "node2", "node3", "node4"}
    assert rows["node1"].owner == "fleetmend" and rows["node1"].incident_id == "inc-7"
    assert rows["node1"].state == "drained"
    assert rows["node2"].owner == "operator" and rows["node2"].reason == "ops"
    assert rows["node3"].owner is None and rows["node3"].state == "idle"


async def test_activities_wait_for_drained_and_map_node_not_found(slurm, sched) -> None:
    acts = SchedulerActivities(sched)
    env = ActivityEnvironment()
    beats: list = []
    env.on_heartbeat = lambda *d: beats.append(d[0] if d else None)
    job = slurm.run("sbatch", "-w", "node2", "--parsable", "-o", "/dev/null", "--wrap", "sleep 3").stdout.strip()
    await assert_eventually(
        lambda: slurm.run("squeue", "-h", "-j", job, "-o", "%T").stdout.strip() == "RUNNING",
        timeout_s=30, what="job running")
    res = await env.run(acts.drain_node, DrainRequest("c1", "node2", "xid 79", "inc-8", wait_drained_s=60))
    assert res.owned and res.state == "drained"
    assert any(b and b.get("phase") == "waiting_for_jobs" for b in beats)

    und = await env.run(acts.undrain_node, UndrainRequest("c1", "node2", "inc-8"))
    assert und.resumed

    with pytest.raises(ApplicationError) as ei:
        await env.run(acts.drain_node, DrainRequest("c1", "nope7", "xid 79", "inc-9"))
    assert ei.value.type == "NodeNotFound" and ei.value.non_retryable


# ------------------------------------------------------------------ `scontrol --json` with the text fallback

JSON_24 = """{"nodes": [{"name": "gpu-001", "hostname": "gpu-001", "address": "10.0.0.1",
  "state": ["IDLE", "DRAIN"], "reason": "fleetmend: xid79 incident [incident i-9]", "reason_set_by_user": "root"},
 {"name": "gpu-002", "state": ["DOWN", "NOT_RESPONDING"], "reason": "Not responding"},
 {"name": "gpu-003", "state": ["MIXED"], "reason": ""}], "errors": [], "warnings": []}"""
"""The shape of `scontrol --json show node` in Slurm 23.02+ (data_parser v0.0.39+; fields as 24.11 prints them)."""
JSON_21 = """{"nodes": [{"name": "n1", "state": "allocated", "state_flags": ["DRAIN"], "reason": "ops"}]}"""
"""The older REST shape (v0.0.37, Slurm 21.08): one state word and its flags."""


def test_parse_scontrol_json_both_shapes() -> None:
    from activities.slurm import parse_scontrol_json

    rows = {r["NodeName"]: r for r in parse_scontrol_json(JSON_24)}
    assert rows["gpu-001"]["State"] == "IDLE+DRAIN" and rows["gpu-001"]["Reason"].endswith("[incident i-9]")
    assert normalize_slurm_state(rows["gpu-002"]["State"]) == "down*"
    assert normalize_slurm_state(rows["gpu-003"]["State"]) == "mixed"
    (n1,) = parse_scontrol_json(JSON_21)
    assert n1["State"] == "ALLOCATED+DRAIN" and normalize_slurm_state(n1["State"]) == "draining"
    with pytest.raises(ValueError):
        parse_scontrol_json('{"errors": []}')


async def test_a_scontrol_with_json_is_read_as_json(tmp_path) -> None:
    """A stand-in `scontrol` that speaks only `--json show node` (a Slurm 23.02+ client): state and
    listing come from the JSON, no text form is ever asked for."""
    import json as _json
    import stat

    log = tmp_path / "calls"
    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/sh\n"
                    f"echo \"$@\" >> {log}\n"
                    "if [ \"$1\" = --json ]; then cat <<'EOF'\n" + JSON_24 + "\nEOF\nexit 0; fi\n"
                    "echo 'text form asked' >&2; exit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    s = SlurmScheduler(SlurmSettings(scontrol=str(fake)))
    assert await s.state("gpu-001") == "drained" and s.json_supported is True
    rows = {r.name: r for r in await s.list_nodes()}
    assert rows["gpu-001"].owner == "fleetmend" and rows["gpu-001"].incident_id == "i-9"
    assert rows["gpu-002"].state == "down*" and rows["gpu-003"].owner is None
    assert all(line.startswith("--json show node") for line in log.read_text().splitlines())
    assert _json.loads(JSON_24)  # the sample itself is valid JSON


async def test_a_slurm_without_json_falls_back_to_text_once(slurm, sched) -> None:
    """Slurm 22.05 (Debian bookworm, CI) has no `scontrol --json`: the first show learns it, every
    later one goes straight to the text form; a newer Slurm answers in JSON."""
    version = slurm.run("scontrol", "--version").stdout.split()[-1]
    major, minor = (int(x) for x in version.split(".")[:2])
    assert await sched.state("node3") == "idle"
    assert sched.json_supported is ((major, minor) >= (23, 2))
    assert [r.name for r in await sched.list_nodes()] == ["node1", "node2", "node3", "node4"]
