"""The pure policy rules (fleetmend/policy.py): history rules, drain budget, topology, verification."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from fleetmend.catalog import Recovery, Urgency, default_catalog
from fleetmend.errors import ConfigError
from fleetmend.events import Verdict
from fleetmend.policy import (
    FaultView,
    RuleSettings,
    decide,
    drain_budget,
    load_topology,
)

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
GPU = "0000:3b:00.0"


def fv(*, kind: str, code: int | None, device: str | None, times: list[datetime], severity: str, drain: bool,
       immediate_action: str, fault_class: str, clearable: bool = False, arrived_at: datetime | None = None,
       **verdict) -> FaultView:
    """A `FaultView` as the workflow builds it: the event's identity, times, and its `Verdict`."""
    return FaultView(kind=kind, code=code, device=device, times=times, arrived_at=arrived_at,
                     verdict=Verdict(severity=severity, drain=drain, immediate_action=immediate_action,
                                     fault_class=fault_class, clearable=clearable, **verdict))


def row(kind: str, code: int | None = None) -> dict:
    """The catalog row's urgency, recovery and history rule (what the workflow's records carry)."""
    r = default_catalog().xid(code) if kind == "xid" else default_catalog().kind(kind)
    return dict(recovery=r.recovery, urgency=r.urgency, history=r.history)


def xid(code: int, *, times: int = 1, drain: bool = False, action: str = "RESTART_APP", sev: str = "degraded",
        device: str = GPU, spread_s: float = 60.0) -> FaultView:
    return fv(kind="xid", code=code, device=device, severity=sev, drain=drain, immediate_action=action,
                     fault_class=f"xid{code}", times=[NOW - timedelta(seconds=spread_s * i) for i in range(times)][::-1],
                     **row("xid", code))


def test_app_xid_once_is_recorded_only():
    assert not decide([xid(13)], NOW, RuleSettings()).drain


def test_app_xid_repeating_on_one_gpu_is_a_hardware_suspect():
    d = decide([xid(13, times=3)], NOW, RuleSettings())
    assert d.drain and d.urgency is Urgency.NOW and d.recovery is Recovery.DIAGNOSE
    assert "hardware suspect" in d.reasons[0] and GPU in d.reasons[0]


def test_app_xid_repeats_outside_the_window_do_not_count():
    assert not decide([xid(31, times=3, spread_s=3000)], NOW, RuleSettings(app_xid_window_s=3600)).drain


def test_app_xids_on_different_gpus_do_not_add_up():
    faults = [xid(13, times=2), xid(13, times=1, device="0000:5e:00.0")]
    assert not decide(faults, NOW, RuleSettings()).drain


def test_app_xids_that_name_no_gpu_are_not_one_gpus_repeats():
    """Three XID 13 without a bus id (key device None) may be three GPUs: with `repeats_need_a_device` they are
    recorded, not a drain; without it (the workflow's default until it passes the flag behind workflow.patched) they
    drain as before, but the reason no longer says "GPU None" (try2 F19)."""
    unnamed = [xid(13, times=3, device=None)]  # type: ignore[arg-type]
    d = decide(unnamed, NOW, RuleSettings(repeats_need_a_device=True))
    assert not d.drain and "no named GPU" in d.reasons[0] and "recorded only" in d.reasons[0]
    assert decide([xid(13, times=3)], NOW, RuleSettings(repeats_need_a_device=True)).drain  # a named GPU: as before
    old = decide(unnamed, NOW, RuleSettings())
    assert old.drain and "None" not in old.reasons[0] and "unknown GPU" in old.reasons[0]


def test_xid45_is_sympathetic_next_to_another_xid_and_recorded_alone():
    d = decide([xid(45), xid(79, drain=True, action="RESTART_BM", sev="fatal")], NOW, RuleSettings())
    assert d.drain and d.fault_class == "xid79" and any("sympathetic to XID 79" in r for r in d.reasons)
    alone = decide([xid(45)], NOW, RuleSettings())
    assert not alone.drain and "alone" in alone.reasons[0]


def test_xid48_with_63_drains_and_resets():
    d = decide([xid(48, drain=True, action="WORKFLOW_XID_48", sev="fatal"), xid(63, action="IGNORE")], NOW,
               RuleSettings())
    assert d.drain and d.recovery is Recovery.RESET_GPU and d.urgency is Urgency.NOW
    assert any("XID 48 (DBE) with XID 63" in r for r in d.reasons)


def test_pending_remap_or_rising_sbe_rate_drain_when_idle():
    remap = decide([xid(63, action="IGNORE")], NOW, RuleSettings())
    assert remap.drain and remap.urgency is Urgency.WHEN_IDLE and remap.recovery is Recovery.RESET_GPU
    sbe = fv(kind="ecc_sbe_volatile", code=None, device=GPU, severity="info", drain=False,
                    immediate_action="IGNORE", fault_class="ecc_sbe_volatile",
                    times=[NOW - timedelta(seconds=30 * i) for i in range(12)][::-1], **row("ecc_sbe_volatile"))
    d = decide([sbe], NOW, RuleSettings(sbe_events_per_window=10, sbe_window_s=3600))
    assert d.drain and d.urgency is Urgency.WHEN_IDLE and "SBE rate rising" in d.reasons[0]
    sbe.times = sbe.times[-3:]
    assert not decide([sbe], NOW, RuleSettings(sbe_events_per_window=10)).drain


def test_when_idle_yields_to_a_fault_that_needs_draining_now():
    d = decide([xid(63, action="IGNORE", device="0000:5e:00.0"), xid(79, drain=True, action="RESTART_BM",
                                                                     sev="fatal")], NOW, RuleSettings())
    assert d.urgency is Urgency.NOW and d.recovery is Recovery.RESTART_BM


def test_debounce_waits_for_a_clearable_fault_and_a_cleared_one_never_drains():
    link = fv(kind="ib_port_down", code=None, device="mlx5_0", severity="fatal", drain=True,
                     immediate_action="DRAIN_DIAGNOSE", fault_class="ib_port_down", times=[NOW], clearable=True,
                     **row("ib_port_down"),
                     arrived_at=NOW - timedelta(seconds=10))
    d = decide([link], NOW, RuleSettings(), debounce_s=30)
    assert not d.drain and d.debounce == [link]
    assert decide([link], NOW + timedelta(seconds=25), RuleSettings(), debounce_s=30).drain
    link.cleared = True
    assert not decide([link], NOW + timedelta(seconds=25), RuleSettings(), debounce_s=30).drain



def test_rma_action_wins():
    d = decide([fv(kind="row_remap_failure", code=None, device=GPU, severity="fatal", drain=True,
                          immediate_action="RMA", fault_class="row_remap_failure", times=[NOW],
                          **row("row_remap_failure"))], NOW, RuleSettings())
    assert d.drain and d.recovery is Recovery.RMA


@pytest.mark.parametrize("known,n,p,expected", [(100, 20, 10.0, 10), (1000, 20, 10.0, 20), (1, 20, 10.0, 1),
                                                 (0, 5, 10.0, 5), (30, 100, 5.0, 1)])
def test_drain_budget(known, n, p, expected):
    assert drain_budget(known, n, p) == expected


def test_topology_file(tmp_path: Path):
    f = tmp_path / "topo.toml"
    f.write_text('[node.gpu-001]\nrack = "r01"\nleaf = "leaf-a"\npdu = "p1"\n[node.gpu-002]\nrack = "r01"\n')
    topo = load_topology(f)
    assert len(topo) == 2 and topo.domain("gpu-001").keys() == ["rack:r01", "leaf:leaf-a", "pdu:p1"]
    assert topo.domain("unknown").keys() == []
    f.write_text('[node.gpu-001]\nrow = "r01"\n')
    with pytest.raises(ConfigError, match=r"\[node.gpu-001\]: expected keys rack, leaf, pdu"):
        load_topology(f)
    with pytest.raises(ConfigError, match="not found"):
        load_topology(tmp_path / "missing.toml")
    assert len(load_topology(None)) == 0


def test_verification_is_chosen_from_the_original_fault():
    """Each catalog row names the checks that prove its fault gone (empty: every QUICK check)."""
    cat = default_catalog()
    assert "dcgm_diag" in cat.xid(74).verify                               # NVLink → DCGM's NVLink tests
    assert "dcgm_diag" in cat.kind("nvlink_down").verify
    assert "remapped_rows_pending" in cat.xid(48).verify                   # ECC → remap + memory
    assert "remapped_rows_pending" in cat.kind("row_remap_failure").verify
    assert "pcie_link_width" in cat.xid(79).verify                         # off the bus → link + count
    assert cat.kind("ib_port_down").verify == ["ib_ports_active"]
    assert cat.kind("oops").verify == []                                   # every QUICK check


def test_the_rules_name_no_xid_number():
    """Which rule reads a fault is the catalog row's `history`; the policy module holds no XID table."""
    import fleetmend.policy as policy

    src = Path(policy.__file__).read_text()
    code = src[src.index('"""', src.index('"""') + 3) + 3:]  # past the module docstring
    assert not any(f"{{{n}" in code or f" {n}}}" in code or f"== {n}" in code for n in (13, 31, 45, 48, 63, 64))


def test_history_windows_are_two_sided():
    """Occurrences dated in the future (a skewed or hostile agent clock) are not "recent": three
    XID 13 dated years ahead do not make a hardware suspect, nor do SBE events from the future."""
    from fleetmend.events import MAX_CLOCK_SKEW_S

    two_sided = RuleSettings(max_future_s=MAX_CLOCK_SKEW_S)
    ahead = xid(13, times=1)
    ahead.times = [NOW + timedelta(days=3 * 365, seconds=i) for i in range(3)]
    assert not decide([ahead], NOW, two_sided).drain
    assert decide([ahead], NOW, RuleSettings(max_future_s=None)).drain, "a one-sided window counts them"
    sbe = fv(kind="ecc_sbe_volatile", code=None, device=GPU, severity="info", drain=False,
                    immediate_action="IGNORE", fault_class="ecc_sbe_volatile",
                    times=[NOW + timedelta(days=400, seconds=i) for i in range(20)], **row("ecc_sbe_volatile"))
    assert not decide([sbe], NOW, two_sided).drain
    # within the allowed skew still counts
    near = xid(13)
    near.times = [NOW + timedelta(seconds=MAX_CLOCK_SKEW_S / 2)] * 3
    assert decide([near], NOW, two_sided).drain
