"""The fault catalog: data validity, clearing rules, severity mapping, NVLink5 decode, overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from agents.kmsg.heads import HEADS
from fleetmend.catalog import Action, Recovery, gen_xid, load_catalog
from fleetmend.errors import CatalogError
from fleetmend.events import Component, FaultEvent, Severity, Source

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cat():
    return load_catalog()


def _ev(kind: str, code: int | None = None, **kw) -> FaultEvent:
    return FaultEvent(
        cluster="c", node="n", component=Component.GPU, kind=kind, code=code, severity=Severity.INFO,
        source=Source.KMSG, **kw,
    )


def test_every_xid_entry_has_a_source(cat) -> None:
    assert len(cat.xids) >= 170
    for n, e in cat.xids.items():
        assert e.source.strip(), f"XID {n} has no source"
        assert "NVIDIA" in e.source


def test_every_kind_has_a_source(cat) -> None:
    for name, e in cat.kinds.items():
        assert e.source.strip(), name


def test_clearable_kinds_are_those_with_a_clearing_event(cat) -> None:
    assert cat.clearable(_ev("ib_port_down")) and cat.verdict(_ev("ib_port_down")).clearable
    assert not cat.clearable(_ev("aer_fatal"))  # cleared_by "none: ..."
    assert not cat.clearable(_ev("xid", 79)) and not cat.clearable(_ev("no_such_kind"))


def test_every_unhealthy_kind_names_its_clearing_event(cat) -> None:
    for name, e in cat.kinds.items():
        if e.healthy:
            assert e.clears, f"clearing kind {name} clears nothing"
            for cleared in e.clears:
                assert cat.kind(cleared).cleared_by == name, f"{cleared} is not cleared_by {name}"
            continue
        if e.cleared_by.startswith("none:"):
            assert len(e.cleared_by) > len("none: "), f"{name}: say why nothing clears it"
            continue
        clearing = cat.kind(e.cleared_by)
        assert clearing.healthy and name in clearing.clears, f"{name}: cleared_by {e.cleared_by} does not clear it"


def test_parser_kinds_are_all_in_the_catalog(cat) -> None:
    """Every kind a kmsg head can start (`agents.kmsg.heads.HEADS`), every kind a detail line turns a
    record into, and every kind those escalate to has a catalog row."""
    kinds = {k for head in HEADS for k in head.kinds} - {"xid"}
    kinds |= {"ghes_corrected", "ghes_recoverable", "ghes_fatal"}  # matchers.detail(): GHES `event severity:`
    kinds |= {cat.kinds[k].escalate_to for k in set(kinds) if k in cat.kinds and cat.kinds[k].escalate_to}
    missing = sorted(k for k in kinds if k not in cat.kinds)
    assert not missing, f"kmsg heads emit kinds not in kinds.toml: {missing}"
    assert {"aer_corrected_burst", "nic_tx_timeout_repeated"} <= kinds


@pytest.mark.parametrize(
    ("xid", "severity", "drain", "action"),
    [
        (13, Severity.DEGRADED, False, Action.RESTART_APP),
        (31, Severity.DEGRADED, False, Action.RESTART_APP),
        (43, Severity.INFO, False, Action.IGNORE),
        (45, Severity.DEGRADED, False, Action.WORKFLOW_XID_45),
        (48, Severity.FATAL, True, Action.WORKFLOW_XID_48),
        (63, Severity.DEGRADED, False, Action.IGNORE),
        (74, Severity.FATAL, True, Action.WORKFLOW_NVLINK_ERR),
        (79, Severity.FATAL, True, Action.RESTART_BM),
        (95, Severity.FATAL, True, Action.RESET_GPU),
        (119, Severity.FATAL, True, Action.RESET_GPU),
        (120, Severity.FATAL, True, Action.RESET_GPU),
    ],
)
def test_xid_severity_mapping(cat, xid, severity, drain, action) -> None:
    c = cat.classify(_ev("xid", xid))
    assert (c.severity, c.drain, c.immediate_action, c.fault_class) == (severity, drain, action, f"xid{xid}")
    assert c.source == cat.xid(xid).source


@pytest.mark.parametrize(
    ("xid", "intrinfo", "status", "unit", "severity", "resolution"),
    [
        (149, 0x000FE406, 0, "NETIR/NETIR_INT", Severity.FATAL, Action.RESET_GPU),
        (149, 0x025001C6, 0, "NETIR_LINK_EVT/NETIR_LINK_DOWN", Severity.FATAL, Action.RESET_GPU),
        (145, 0x0409A0C2, 0x8, "RLW_RXPIPE", Severity.DEGRADED, Action.IGNORE),
        (144, 0b100001, 0x2, "SAW_MVB", Severity.FATAL, Action.RESET_GPU),
        (144, 0b0000001, 0x4, "SAW_MVB", Severity.DEGRADED, Action.IGNORE),  # v2 pattern
    ],
)
def test_nvlink5_decode(cat, xid, intrinfo, status, unit, severity, resolution) -> None:
    d = cat.decode_nvlink5(xid, intrinfo, status)
    assert d is not None and (d.unit, d.severity, d.resolution) == (unit, severity, resolution)


def test_nvlink5_driver_version_selects_pattern_set(cat) -> None:
    assert cat.decode_nvlink5(144, 0b0000001, 0x4, driver_version="570.86.15") is None
    assert cat.decode_nvlink5(144, 0b0000001, 0x4, driver_version="575.51.02").pattern_version == "v2"


def test_nvlink5_classification_uses_attrs(cat) -> None:
    ev = _ev("xid", 149, attrs={"intrinfo": "0x000fe406", "error_status": "0x00000000", "unit": "NETIR"})
    c = cat.classify(ev)
    assert (c.severity, c.immediate_action, c.resolution, c.drain) == (
        Severity.FATAL, Action.WORKFLOW_NVLINK5_ERR, Action.RESET_GPU, True,
    )
    undecodable = cat.classify(_ev("xid", 147, attrs={"fatal_word": "Fatal"}))
    assert undecodable.severity is Severity.FATAL


def test_xid154_reads_new_recovery_action(cat) -> None:
    assert cat.classify(_ev("xid", 154, attrs={"recovery_action": "Drain and Reset"})).severity is Severity.FATAL
    assert cat.classify(_ev("xid", 154, attrs={"recovery_action": "None"})).severity is Severity.INFO
    assert cat.classify(_ev("xid", 154, attrs={"recovery_action": "Drain P2P"})).severity is Severity.DEGRADED
    assert cat.classify(_ev("xid", 154, attrs={"recovery_action": "Node Reboot Required"})).drain


def test_recovery_actions_are_one_table(cat) -> None:
    """NVML's value, XID 154's text and nvidia-smi's text name the same rows of recovery_actions.toml."""
    assert {a.nvml for a in cat.recovery_actions} == set(range(8))
    assert cat.recovery_action("Drain and Reset").name == "DRAIN_AND_RESET" == cat.recovery_action(nvml=4).name
    assert cat.recovery_action("Drain P2P").severity is Severity.DEGRADED
    assert cat.recovery_action("Reset").name == "GPU_RESET" and cat.recovery_action("no idea") is None


def test_unknown_kind_and_xid_classify_without_raising(cat) -> None:
    assert cat.classify(_ev("made_up_kind")).source == "not in catalog"
    assert cat.classify(_ev("xid", 9999)).fault_class == "xid9999"
    with pytest.raises(KeyError):
        cat.xid(9999)


def test_healthy_event_is_info(cat) -> None:
    c = cat.classify(_ev("nic_link_up", healthy=True))
    assert c.severity is Severity.INFO and not c.drain


def test_overrides_apply(tmp_path) -> None:
    f = tmp_path / "ovr.toml"
    f.write_text('[xid.13]\nimmediate_action = "RMA"\nseverity = "fatal"\ndrain = true\nrecovery = "RMA"\n'
                 '[kind.aer_corrected]\nseverity = "degraded"\n')
    c = load_catalog(overrides=f)
    assert c.xid(13).immediate_action is Action.RMA and (c.xid(13).severity, c.xid(13).drain) == (Severity.FATAL, True)
    v = c.verdict(_ev("xid", 13))
    assert v.recovery is Recovery.RMA and v.drain and v.severity is Severity.FATAL  # one row changed: all of it
    assert c.xid(31).recovery is Recovery.DIAGNOSE
    assert c.kind("aer_corrected").severity is Severity.DEGRADED
    assert c.xid(79).immediate_action is Action.RESTART_BM


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ('[xid.13]\nimmediate_acton = "RMA"\n', "[xid.13]"),
        ('[kind.hung_task]\nseverity = "awful"\n', "[kind.hung_task]"),
        ('[nvswitch.1]\nx = 1\n', "unknown section"),
        ('[kind.new_thing]\nseverity = "fatal"\n', "[kind.new_thing]"),
        ("[xid.13\n", "not valid TOML"),
    ],
)
def test_bad_overrides_raise_catalog_error_naming_file_and_entry(tmp_path, body, needle) -> None:
    f = tmp_path / "ovr.toml"
    f.write_text(body)
    with pytest.raises(CatalogError) as err:
        load_catalog(overrides=f)
    assert needle in str(err.value) and str(f) in str(err.value)


def test_missing_override_file(tmp_path) -> None:
    with pytest.raises(CatalogError, match="not found"):
        load_catalog(overrides=tmp_path / "nope.toml")


def test_committed_toml_matches_generator() -> None:
    """xid.toml and nvlink5.toml are what `python -m fleetmend.catalog.gen_xid` writes from NVIDIA's
    tables and xid_reading.toml."""
    assert gen_xid.gen_xid(gen_xid.SOURCE / "xid_catalog.tsv") == (gen_xid.CATALOG / "xid.toml").read_text()
    assert gen_xid.gen_nvlink5(gen_xid.SOURCE / "xid_nvlink5_decode.tsv") == (gen_xid.CATALOG / "nvlink5.toml").read_text()


def test_xid_79_reads_from_its_rules() -> None:
    """What XID 79 does is named in its row: the rules of xid_reading.toml that gave each field."""
    text = (gen_xid.CATALOG / "xid.toml").read_text()
    row = text[text.index("[xid.79]\n"):text.index("[xid.80]\n")]
    assert "# fleetmend's reading (xid_reading.toml: severity.reset_or_replace, recovery.reboot, verify.pcie):" in row
    rules = gen_xid.load_reading()
    assert [r.checks for r in rules.verify if r.name == "pcie"] == [["nvml_reachable", "gpu_count", "pcie_link_width"]]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ('[[severity]]\nname = "x"\nreason = "r"\nsevere = "fatal"\n', "[[severity]] x: severe"),
        ('[xid.999]\nrecovery = "RESET_GPU"\n', "[xid.999]: recovery needs a recovery_reason"),
        ('[[verify]]\nname = "quick"\nreason = "r"\nchecks = []\n', "rule names used twice: ['quick']"),
    ],
)
def test_bad_reading_rules_raise_catalog_error_naming_file_and_rule(tmp_path, body, needle) -> None:
    f = tmp_path / "xid_reading.toml"
    f.write_text(gen_xid.READING.read_text() + "\n" + body)
    with pytest.raises(CatalogError) as err:
        gen_xid.load_reading(f)
    assert needle in str(err.value) and str(f) in str(err.value)


def _event(kind: str, code: int | None = None, **attrs: object) -> FaultEvent:
    return FaultEvent(cluster="c", node="n1", component=Component.KERNEL, kind=kind, code=code,
                      severity=Severity.INFO, message=kind, source=Source.KMSG, agent_version="t", attrs=attrs)


def test_no_verdict_says_drain_in_its_action_and_no_drain_in_drain() -> None:
    """Issue 29 point 3: a soft lockup said `immediate_action: DRAIN_DIAGNOSE` beside `drain: false`. The
    action decides (kind rows have no drain key), so every row and every decoded XID 154 verdict agrees."""
    cat = load_catalog()
    events = [_event(k) for k in cat.kinds] + [_event("xid", n) for n in cat.xids]
    events += [_event("gpu_recovery_action", recovery_action=a.name) for a in cat.recovery_actions]
    for ev in events:
        v = cat.verdict(ev)
        act = Action(v.immediate_action)
        healthy_row = ev.kind in cat.kinds and cat.kinds[ev.kind].healthy
        if act.drains and not healthy_row:
            assert v.drain, (ev.kind, ev.code, v)
        if act is Action.IGNORE or (ev.kind != "xid" and not act.drains):
            assert not v.drain, (ev.kind, ev.code, v)
    soft = cat.verdict(_event("soft_lockup"))
    assert (soft.immediate_action, soft.drain) == ("DIAGNOSE_IN_SERVICE", False)
    reboot = cat.verdict(_event("gpu_recovery_action", recovery_action="NODE_REBOOT"))
    assert (reboot.immediate_action, reboot.drain, reboot.severity) == ("RESTART_BM", True, Severity.FATAL)
    p2p = cat.verdict(_event("gpu_recovery_action", recovery_action="DRAIN_P2P"))
    assert (p2p.drain, p2p.severity) == (False, Severity.DEGRADED)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ('[kind.soft_lockup]\ndrain = true\n', "drain is derived from immediate_action"),
        ('[xid.13]\nimmediate_action = "RESET_GPU"\n', "drain must be true"),
        ('[xid.79]\nimmediate_action = "IGNORE"\n', "IGNORE cannot drain"),
    ],
)
def test_an_override_cannot_make_action_and_drain_disagree(tmp_path, body, needle) -> None:
    f = tmp_path / "o.toml"
    f.write_text(body)
    with pytest.raises(CatalogError, match=needle):
        load_catalog(overrides=f)
    f.write_text('[kind.soft_lockup]\nimmediate_action = "DRAIN_DIAGNOSE"\n')
    assert load_catalog(overrides=f).verdict(_event("soft_lockup")).drain is True
