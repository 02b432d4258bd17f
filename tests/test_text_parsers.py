"""Every case of the corpus (tests/corpus, all kinds) through `parse_any` / `explain_text`, as
tests/test_kmsg_corpus.py does for kmsg; format tests for nvidia-smi, DCGM and other tools beyond the
corpus; hypothesis: no input crashes a parser; the diagnostics responder reads `dcgmi diag` output."""

from __future__ import annotations

import json as _json
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agents.diag import DiagResponder
from agents.parsers import dcgm, detect_kinds, nvidia_smi, other, parse_any
from agents.parsers.common import Ctx
from fleetmend.catalog import default_catalog
from fleetmend.cli.explain import explain_text
from fleetmend.diagnostics import DiagLevel, DiagRequest, DiagResult
from fleetmend.events import FaultEvent
from tests.corpus_paths import load_cases

CASES = load_cases()
TEXT_CASES = [c for c in CASES if c["kind"] != "kmsg"]
FIELDS = ("component", "xid", "pci_bus_id", "pid", "severity", "vendor_action")
WRONG_EXPECTED: dict[str, str] = {}
"""Cases whose `expected` we judge wrong (id → why); none so far."""


def _observed(e: FaultEvent) -> dict:
    cls = default_catalog().classify(e)
    return {"component": e.component.value, "xid": e.code if e.kind == "xid" else None,
            "pci_bus_id": e.device.pci_bus_id, "pid": e.pid, "severity": e.severity.value,
            "vendor_action": cls.immediate_action.value if e.kind == "xid" else None}


def test_corpus_has_every_kind() -> None:
    assert {c["kind"] for c in CASES} >= {"kmsg", "nvidia-smi", "dcgm", "other"}


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_every_corpus_case_through_explain(case: dict) -> None:
    if case["id"] in WRONG_EXPECTED:
        pytest.xfail(WRONG_EXPECTED[case["id"]])
    events = [x.event for x in explain_text(case["raw"], node="node-a01")]
    expected = {k: case["expected"][k] for k in FIELDS}
    if not events and expected["severity"] == "info":
        return  # "nothing to do" and nothing emitted
    observed = [_observed(e) for e in events]
    assert expected in observed, f"{case['id']}: expected {expected}\nemitted:\n" + "\n".join(map(str, observed))


@pytest.mark.parametrize("case", TEXT_CASES, ids=[c["id"] for c in TEXT_CASES])
def test_text_case_kind_detected_and_events_round_trip(case: dict) -> None:
    kinds = detect_kinds(case["raw"])
    if case["expected"]["severity"] != "info":
        assert kinds, f"{case['id']}: no format recognised"
    if case["kind"] in ("nvidia-smi", "dcgm"):
        assert case["kind"] in kinds
    for e in parse_any(case["raw"], node="n"):
        assert e.message and "\n" not in e.message and e.raw
        assert FaultEvent.from_json_bytes(e.to_json_bytes()) == e
        assert e.kind in default_catalog().kinds or e.kind == "xid", f"{e.kind} not in kinds.toml"


def _kinds(events) -> list[tuple[str, str, int | None]]:
    return sorted((e.kind, e.severity.value, e.device.index) for e in events)


CTX = Ctx(cluster="c", node="n")

OLD_Q = """\
GPU 00000000:3B:00.0
    Product Name                    : Tesla V100-SXM2-32GB
    ECC Errors
        Volatile
            Single Bit
                Device Memory       : 3
                Register File       : 0
                Total               : 3
            Double Bit
                Device Memory       : 1
                Register File       : 0
                Total               : 1
        Aggregate
            Single Bit
                Total               : 12
            Double Bit
                Total               : 1
    Retired Pages
        Single Bit ECC              : 0
        Double Bit ECC              : 1
        Pending Page Blacklist      : No
    GPU Link Info
        PCIe Generation
            Max                     : 3
            Current                 : 1
        Link Width
            Max                     : 16x
            Current                 : 8x
    Clocks Throttle Reasons
        Idle                        : Not Active
        HW Slowdown                 : Active
        HW Thermal Slowdown         : Not Active
"""


def test_nvidia_smi_q_older_driver_format() -> None:
    ev = nvidia_smi.parse(OLD_Q, CTX)
    assert _kinds(ev) == [("clocks_hw_slowdown", "degraded", None), ("ecc_dbe_volatile", "fatal", None),
                          ("pcie_link_degraded", "degraded", None)]
    assert all(e.device.pci_bus_id == "0000:3b:00.0" for e in ev)
    dbe = next(e for e in ev if e.kind == "ecc_dbe_volatile")
    assert dbe.attrs["dbe_volatile"] == 1 and dbe.attrs["sbe_aggregate"] == 12


def test_nvidia_smi_two_gpus_and_errors() -> None:
    text = OLD_Q + OLD_Q.replace("3B:00.0", "86:00.0").replace("Total               : 1\n        Aggregate",
                                                                 "Total               : 0\n        Aggregate")
    by_bdf = {}
    for e in nvidia_smi.parse(text, CTX):
        by_bdf.setdefault(e.device.pci_bus_id, set()).add(e.kind)
    assert "ecc_dbe_volatile" in by_bdf["0000:3b:00.0"] and "ecc_dbe_volatile" not in by_bdf["0000:86:00.0"]
    assert "ecc_dbe_aggregate" in by_bdf["0000:86:00.0"]
    drv = nvidia_smi.parse("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
                           "Make sure that the latest NVIDIA driver is installed and running.", CTX)
    assert [e.kind for e in drv] == ["gpu_driver_unreachable"]
    lost = nvidia_smi.parse("Unable to determine the device handle for gpu 0000:3B:00.0: GPU is lost.  "
                            "Reboot the system to recover this GPU", CTX)
    assert [(e.kind, e.device.pci_bus_id) for e in lost] == [("gpu_fallen_off_bus", "0000:3b:00.0")]


def test_nvidia_smi_table_err_and_csv_query() -> None:
    table = """\
| GPU  Name        Persistence-M| Bus-Id        Disp.A | Volatile Uncorr. ECC |
|===============================+======================+======================|
|   0  Tesla V100-SXM2...  On   | 00000000:18:00.0 Off |                    0 |
| N/A   34C    P0    42W / 300W |      0MiB / 32510MiB |      0%      Default |
+-------------------------------+----------------------+----------------------+
|   1  Tesla V100-SXM2...  On   | 00000000:3B:00.0 Off |                 ERR! |
|ERR!  ERR! ERR!    ERR! / ERR! |  32510MiB / 32510MiB |    ERR!      Default |
"""
    assert _kinds(nvidia_smi.parse(table, CTX)) == [("gpu_unhealthy_readout", "fatal", 1)]
    csv = ("index, pci.bus_id, ecc.errors.uncorrected.volatile.total, retired_pages.pending\n"
           "0, 00000000:18:00.0, 0, No\n1, 00000000:3B:00.0, [N/A], Yes\n")
    ev = nvidia_smi.parse(csv, CTX)
    assert [(e.kind, e.device.pci_bus_id, e.device.index) for e in ev] == [("retired_pages_pending", "0000:3b:00.0", 1)]


def test_dcgmi_health_and_exporter_metrics() -> None:
    health = """\
+---------------------------+----------------------------------------------------------+
| Health Monitor Report                                                                |
+===========================+==========================================================+
| Overall Health            | Failure                                                  |
| GPU                       |                                                          |
| -> 2                      | Failure                                                  |
|    -> Errors              |                                                          |
|       -> PCIe system      | Warning                                                  |
|                           | Detected more than 8 PCIe replays per minute for GPU 2 : |
|                           |  13 Reconnect PCIe card.                                 |
|       -> Memory system    | Failure                                                  |
|                           | A DBE has occurred.                                      |
+---------------------------+----------------------------------------------------------+
"""
    ev = dcgm.parse(health, CTX)
    assert _kinds(ev) == [("dcgm_health_failure", "fatal", 2), ("dcgm_health_warning", "degraded", 2)]
    assert {e.component.value for e in ev} == {"gpu", "pcie"}
    metrics = """\
DCGM_FI_DEV_XID_ERRORS{gpu="1",UUID="GPU-1",pci_bus_id="00000000:3B:00.0",device="nvidia1"} 79
DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{gpu="2",UUID="GPU-2",device="nvidia2"} 0
DCGM_FI_DEV_ROW_REMAP_FAILURE{gpu="2",UUID="GPU-2",device="nvidia2"} 1
DCGM_FI_DEV_CLOCK_THROTTLE_REASONS{gpu="3",UUID="GPU-3",device="nvidia3"} 136
"""
    ev = dcgm.parse(metrics, CTX)
    assert _kinds(ev) == [("clocks_hw_slowdown", "degraded", 3), ("clocks_power_brake", "degraded", 3),
                          ("row_remap_failure", "fatal", 2), ("xid", "fatal", 1)]
    xid = next(e for e in ev if e.kind == "xid")
    assert xid.code == 79 and xid.device.pci_bus_id == "0000:3b:00.0"


def test_dcgmi_diag_passing_run_is_quiet() -> None:
    text = """\
+---------------------------+------------------------------------------------+
| Diagnostic                | Result                                         |
+===========================+================================================+
|-----  Deployment  --------+------------------------------------------------|
| Blacklist                 | Pass                                           |
| NVML Library              | Pass                                           |
|-----  Hardware  ----------+------------------------------------------------|
| GPU Memory                | Pass - All                                     |
| Diagnostic                | Skip - All                                     |
+---------------------------+------------------------------------------------+
"""
    assert dcgm.parse(text, CTX) == []


def test_other_tools() -> None:
    sel = """\
   1 | 04/12/2023 | 10:12:03 | Memory #0x53 | Uncorrectable ECC | Asserted
   2 | 04/12/2023 | 10:12:04 | Memory #0x53 | Correctable ECC logging limit reached | Asserted
   3 | 04/12/2023 | 10:13:00 | Critical Interrupt #0x19 | PCI SERR | Asserted
   4 | 04/12/2023 | 10:14:00 | Memory #0x53 | Uncorrectable ECC | Deasserted
"""
    assert sorted((e.kind, e.component.value) for e in other.parse(sel, CTX)) == [
        ("aer_fatal", "pcie"), ("edac_ce", "memory"), ("edac_ue", "memory")]
    ibv = """\
hca_id:\tmlx5_0
\ttransport:\t\t\tInfiniBand (0)
\t\tport:\t1
\t\t\tstate:\t\t\tPORT_DOWN (1)
\t\t\tphys_state:\t\tPOLLING (2)
hca_id:\tmlx5_1
\t\tport:\t1
\t\t\tstate:\t\t\tPORT_ACTIVE (4)
"""
    ev = other.parse(ibv, CTX)
    assert [(e.kind, e.device.name, e.device.port) for e in ev] == [("ib_port_down", "mlx5_0", 1)]
    assert other.parse("mcelog: Corrected error\nHardware event. This is not a software error.\nCPU 3 BANK 7\n"
                       "Corrected error\n", CTX)[0].kind == "mce"


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=400))
def test_no_text_crashes_any_parser(text: str) -> None:
    for fn in (nvidia_smi.parse, dcgm.parse, other.parse):
        for e in fn(text, CTX):
            assert isinstance(e, FaultEvent)


_PIECES = st.sampled_from([
    "| GPU Memory | Fail - GPU: 0 |", "|  | s started |", "| -> 1 | Warning |", "|    -> PCIe | Failure |",
    "GPU 00000000:10:1C.0", "    Remapped Rows", "        Pending : Yes", "        Uncorrectable Error : x",
    "    ECC Errors", "        Volatile", "            DRAM Uncorrectable : 3", "DCGM_FI_DEV_XID_ERRORS{gpu=\"x\"} 1e9",
    "DCGM_FI_DEV_XID_ERRORS_ACTIVE{xid=\"-4\"} 2", "gpuId 0:", "    D U X _", "CA 'mlx5_0'", "\tPort 1:",
    "\t\tState: Down", "mlx5_0 port 1 ==> ib0 (Down)", "1 | a | b | Memory | Uncorrectable ECC | Asserted",
    "index, pci.bus_id, remapped_rows.pending", "0, zz, Yes", "XidCriticalError: Xid=99999999999 on Device=",
    "NCCL WARN NET/IB : status=x", "Hardware event. This is not a software error.", "", "|", "||", ":",
])


@settings(max_examples=300, deadline=None)
@given(st.lists(_PIECES, max_size=25))
def test_format_fragments_in_any_order_never_crash(pieces: list[str]) -> None:
    text = "\n".join(pieces)
    for e in parse_any(text, node="n"):
        assert isinstance(e, FaultEvent)


DCGM_FAIL = next((c["raw"] for c in CASES if c["id"] == "c044"), """\
| GPU Memory                | Pass - GPUs: 1, 2, 3, 4, 5, 6, 7               |
|                           | Fail - GPU: 0                                  |
""")


async def test_diag_responder_long_level_reads_dcgmi_diag(nc, unique: str, tmp_path: Path) -> None:
    """The LONG level runs `dcgmi diag` (a stand-in script named dcgmi on PATH that prints a recorded
    failing run and exits 0) and fails the check naming the test and GPU, via the same parser."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "out.txt").write_text(DCGM_FAIL + "\n")
    script = bin_dir / "dcgmi"
    script.write_text(f"#!{sys.executable}\nimport sys\nsys.stdout.write(open({str(tmp_path / 'out.txt')!r}).read())\n")
    script.chmod(0o755)
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("")
    r = DiagResponder(nc, f"c{unique}", "n1", nvml=None, sysfs_root=tmp_path, kmsg_path=kmsg,
                      long_commands={"dcgm_diag": [str(script), "diag", "-r", "2"]})
    report = await r.run(DiagRequest(level=DiagLevel.LONG, checks=["dcgm_diag"], deadline_s=30))
    (check,) = report.checks
    assert check.result is DiagResult.FAIL, check
    assert "GPU Memory" in check.measured and "GPU 0" in check.measured
    assert check.expected == "every test Pass, exit 0"


def test_every_kind_the_probes_and_parsers_emit_is_in_the_catalog() -> None:
    import re

    root = Path(__file__).resolve().parents[1]
    files = [root / "agents" / f for f in ("nvml.py", "sysfs.py", "udev.py", "conditions.py")]
    files += list((root / "agents" / "parsers").glob("*.py")) + [root / "fleetmend" / "router" / "heartbeats.py"]
    src = "".join(p.read_text() for p in files)
    kinds = set(re.findall(r'(?:kind=|ctx\.event\(|\(|: )"([a-z0-9_]+)",? *(?:Component|Severity)\.', src))
    kinds |= set(re.findall(r'kind="([a-z0-9_]+)"', src))
    kinds |= {f"ecc_{t}_{s}" for t in ("sbe", "dbe") for s in ("volatile", "aggregate")}
    kinds |= set(re.findall(r'0x[0-9a-f]+: "(clocks_[a-z_]+)"', src))
    kinds |= {"agent_silent", "remapped_rows_pending", "ib_port_down", "nic_link_down"}
    kinds -= {"xid", "dbe_volatile", "sbe_volatile", "dbe_aggregate", "sbe_aggregate"}  # nvml.py: f"ecc_{name}"
    cat = default_catalog()
    missing = sorted(k for k in kinds if k not in cat.kinds)
    assert len(kinds) > 25, sorted(kinds)
    assert not missing, f"emitted kinds missing from kinds.toml: {missing}"


# ------------------------------------------------------------------ issue 29: tool outputs not read before

def test_dcgmi_diag_json_reads_each_failed_or_warned_result_per_gpu() -> None:
    """`dcgmi diag -j` in the 4.x ("DCGM Diagnostic", entity_id) and 3.x ("DCGM GPU Diagnostic", gpu_ids) shapes."""
    v4 = ('{"DCGM Diagnostic": {"version": "4.2.3", "test_categories": [{"category": "Hardware", "tests": ['
          '{"name": "memory", "results": [{"entity_group": "GPU", "entity_id": 0, "status": "Pass"}, '
          '{"entity_group": "GPU", "entity_id": 3, "status": "Fail", "warnings": [{"warning": "row remapping failed"}]}]}, '
          '{"name": "pcie", "results": [{"entity_group": "GPU", "entity_id": 1, "status": "Warn", '
          '"warnings": [{"warning": "PCIe replay rate high"}]}]}]}]}}')
    evs = dcgm.parse(v4, Ctx())
    assert sorted((e.kind, e.device.index, e.severity.value, e.component.value) for e in evs) == [
        ("dcgm_diag_fail", 3, "fatal", "gpu"), ("dcgm_diag_warning", 1, "degraded", "pcie")]
    v3 = ('{"DCGM GPU Diagnostic": {"test_categories": [{"category": "Integration", "tests": [{"name": "PCIe", '
          '"results": [{"gpu_ids": "2", "status": "Fail", "warnings": [{"warning": "bandwidth below limit"}]}]}]}]}}')
    assert [(e.kind, e.device.index) for e in dcgm.parse(v3, Ctx())] == [("dcgm_diag_fail", 2)]
    passing = v4.replace('"Fail"', '"Pass"').replace('"Warn"', '"Pass"')
    assert dcgm.parse(passing, Ctx()) == []
    assert dcgm.parse('{"DCGM Diagnostic": ', Ctx()) == []  # cut short: nothing, no crash


def test_fabric_manager_nvswitch_errors_and_networkd_carrier() -> None:
    """Fabric manager log lines (as quoted by the Fabric Manager User Guide and peers' tests) and systemd-networkd."""
    fm = ("[Jul 23 2024 07:53:55] [ERROR] [tid 841] detected NVSwitch fatal error 20034 on fid 0 on NVSwitch pci bus "
          "id 00000000:86:00.0 physical id 3 port 33\n"
          "[Jul 09 2024 18:14:07] [ERROR] [tid 12727] detected NVSwitch non-fatal error 12028 on fid 0 on NVSwitch "
          "pci bus id 00000000:86:00.0 physical id 3 port 61\n")
    evs = parse_any(fm)
    assert [(e.kind, e.code, e.device.pci_bus_id, e.device.port, e.severity.value) for e in evs] == [
        ("sxid_fatal", 20034, "0000:86:00.0", 33, "fatal"), ("sxid_nonfatal", 12028, "0000:86:00.0", 61, "degraded")]
    nd = ("Dec 01 10:00:00 node-a01 systemd-networkd[812]: ens1f0: Lost carrier\n"
          "Dec 01 10:00:05 node-a01 systemd-networkd[812]: ens1f0: Gained carrier\n")
    evs = parse_any(nd)
    assert [(e.kind, e.healthy, e.device.name, e.attrs.get("clearing_kind")) for e in evs] == [
        ("nic_link_down", False, "ens1f0", None), ("nic_link_down", True, "ens1f0", "nic_link_up")]


def test_ibstatus_port_states_and_missing_devices() -> None:
    """rdma-core infiniband-diags/scripts/ibstatus: per port `state:\\t\\t 1: DOWN`; `Fatal error:  device 'X': sys files
    not found` for an HCA without sysfs ports."""
    text = ("Infiniband device 'mlx5_0' port 1 status:\n\tdefault gid:\t fe80:0000:0000:0000:0000:0000:0000:0001\n"
            "\tbase lid:\t 0x1\n\tsm lid:\t\t 0x1\n\tstate:\t\t 1: DOWN\n\tphys state:\t 3: Disabled\n"
            "\trate:\t\t 100 Gb/sec (4X EDR)\n\tlink_layer:\t InfiniBand\n\n"
            "Infiniband device 'mlx5_1' port 1 status:\n\tstate:\t\t 4: ACTIVE\n\tphys state:\t 5: LinkUp\n\n"
            "Fatal error:  device 'mlx5_4': sys files not found (/sys/class/infiniband/mlx5_4/ports)\n")
    evs = parse_any(text)
    assert [(e.kind, e.device.name, e.device.port) for e in evs] == [("ib_port_down", "mlx5_0", 1),
                                                                      ("nic_removed", "mlx5_4", None)]


# ------------------------------------------------------------------ DCGM JSON built from DCGM's source (issue 29 point 2)
# The builders follow the code that writes the documents: dcgmi/Diag.cpp (HelperJsonBuildOutput, HelperJsonAddResult,
# HelperJsonAddTestSummary at v4.6.0; the level-one and per-GPU writers at v3.3.9 and v2.4.7), NvvsJsonStrings.h for
# the keys, dcgmi/Nvlink.cpp DisplayNvLinkErrorCountsForGpu over DcgmiOutputJson (DcgmiOutput.cpp: addHeader appends
# to "header", out[section] is body[section], box[child] is children[child], a value is {"value": <string>}), and
# jsoncpp's toStyledString (three-space indent, `"key" : value`, keys sorted) for the text.


def _styled(doc: object) -> str:
    return _json.dumps(doc, indent=3, sort_keys=True).replace('": ', '" : ') + "\n"


def _diag_v4(results: list[tuple[str, str, int, str, str]], summary_only: tuple[str, str] | None = None) -> dict:
    """results: (category, test, gpu, status, warning); DCGM 4.x `DCGM Diagnostic` with entity groups."""
    cats: dict[str, dict[str, list[dict]]] = {}
    for cat, test, gpu, status, warn in results:
        entry: dict = {"entity_group_id": 1, "entity_group": "GPU", "entity_id": gpu, "status": status}
        if warn:
            entry["warnings"] = [{"warning": warn, "error_id": 83, "error_category": 4, "error_severity": 2}]
        cats.setdefault(cat, {}).setdefault(test, []).append(entry)
    if summary_only:
        cats.setdefault(summary_only[0], {}).setdefault(summary_only[1], [])
    diag = {"test_categories": []}
    for cat, tests in cats.items():
        entries = []
        for test, res in tests.items():
            t: dict = {"name": test}
            if res:
                t["results"] = res
            worst = "Fail" if any(r["status"] == "Fail" for r in res) else "Pass"
            if summary_only and (cat, test) == summary_only:
                worst = "Fail"
            t["test_summary"] = {"status": worst}
            entries.append(t)
        diag["test_categories"].append({"category": cat, "tests": entries})
    return {"entity_groups": [{"entity_group": "GPU", "entity_group_id": 1,
                               "entities": [{"entity_id": i, "device_id": "2330", "serial_num": f"SN000{i}"} for i in range(8)]}],
            "metadata": {"version": "4.6.0", "Driver Version Detected": "580.95.05"}, "DCGM Diagnostic": diag}


def _diag_v3(results: list[tuple[str, str, int, str, str]]) -> dict:
    """DCGM 3.x `DCGM GPU Diagnostic`: Deployment results carry `gpu_id` as a number and the message under the
    plural key `warnings` (Diag.cpp v3.3.9 HelperJsonAddLevelOneTests); plugin results `gpu_id` as a string."""
    cats: dict[str, dict[str, list[dict]]] = {}
    for cat, test, gpu, status, warn in results:
        entry: dict = {"status": status}
        if cat == "Deployment":
            if warn:
                entry["gpu_id"] = gpu
                entry["warnings"] = [{"warnings": warn, "error_id": 3, "error_category": 1, "error_severity": 2}]
        else:
            entry["gpu_id"] = str(gpu)
            if warn:
                entry["warnings"] = [{"warning": warn, "error_id": 83, "error_category": 4, "error_severity": 2}]
        cats.setdefault(cat, {}).setdefault(test, []).append(entry)
    return {"DCGM GPU Diagnostic": {"test_categories": [
                {"category": c, "tests": [{"name": t, "results": r} for t, r in ts.items()]} for c, ts in cats.items()]},
            "version": "3.3.9", "Driver Version Detected": "550.54.15", "GPU Device IDs": ["2330"]}


def _diag_v2(results: list[tuple[str, str, int, str, str]]) -> dict:
    """DCGM 2.x: `gpu_ids` as a string and `warnings` as a plain string (Diag.cpp v2.4.7 HelperJsonAddResult)."""
    cats: dict[str, dict[str, list[dict]]] = {}
    for cat, test, gpu, status, warn in results:
        entry: dict = {"gpu_ids": str(gpu), "status": status}
        if warn:
            entry["warnings"] = warn
        cats.setdefault(cat, {}).setdefault(test, []).append(entry)
    return {"DCGM GPU Diagnostic": {"test_categories": [
                {"category": c, "tests": [{"name": t, "results": r} for t, r in ts.items()]} for c, ts in cats.items()],
            "version": "2.4.7"}}


_DIAG_TESTS = [("Hardware", "memory"), ("Hardware", "diagnostic"), ("Integration", "pcie"), ("Stress", "targeted_power"),
               ("Stress", "nvlink")]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([_diag_v4, _diag_v3, _diag_v2]),
       st.lists(st.tuples(st.sampled_from(_DIAG_TESTS), st.integers(0, 7), st.sampled_from(["Pass", "Fail", "Warn", "Skip"]),
                          st.sampled_from(["", "GPU 0 failed to reach its power limit", "row remapping failed"])),
                min_size=1, max_size=12, unique_by=lambda r: (r[0], r[1])),
       st.booleans())
def test_dcgmi_diag_json_from_dcgm_source_reads_every_failed_result(build, rows, iterations) -> None:
    results = [(c, t, g, s, w if s != "Pass" else "") for (c, t), g, s, w in rows]
    doc = build(results)
    if iterations:  # --iterations 2: Diag.cpp RunStartDiag
        doc = {"iterations": [doc, doc], "Overall Result": "Fail" if any(r[3] == "Fail" for r in results) else "Pass"}
    events = dcgm.parse("$ dcgmi diag -r 3 -j\n" + _styled(doc), Ctx())
    want = sorted(("dcgm_diag_fail" if s == "Fail" else "dcgm_diag_warning", g) for _, _, g, s, _ in results
                  if s in ("Fail", "Warn"))
    assert sorted((e.kind, e.device.index) for e in events) == want
    for cat, test, gpu, s, w in results:
        if s not in ("Fail", "Warn"):
            continue
        mine = [e for e in events if e.device.index == gpu and f"{cat}/{test}: " in e.message]
        assert len(mine) == 1, (cat, test, gpu, [e.message for e in events])
        assert mine[0].severity.value == ("fatal" if s == "Fail" else "degraded")
        assert w in mine[0].message, (w, mine[0].message)


def test_dcgmi_diag_json_summary_runtime_error_and_other_entities() -> None:
    doc = _diag_v4([("Hardware", "memory", 0, "Pass", "")], summary_only=("Integration", "pcie"))
    evs = dcgm.parse(_styled(doc), Ctx())
    assert [(e.kind, e.device.index, e.component.value) for e in evs] == [("dcgm_diag_fail", None, "pcie")]
    doc = _diag_v4([])
    doc["DCGM Diagnostic"]["test_categories"] = [{"category": "Hardware", "tests": [{"name": "cpu_eud", "results": [
        {"entity_group_id": 7, "entity_group": "CPU", "entity_id": 1, "status": "Fail",
         "warnings": [{"warning": "CPU EUD failed"}]}]}]}]
    evs = dcgm.parse(_styled(doc), Ctx())
    assert [(e.kind, e.device.name, e.component.value) for e in evs] == [("dcgm_diag_fail", "CPU 1", "cpu")]
    # Diag.cpp HelperDisplayFailureMessage
    failed = {"DCGM Diagnostic": {"version": "4.6.0", "runtime_error": "Unable to connect to the host engine"}}
    evs = dcgm.parse(_styled(failed), Ctx())
    assert [(e.kind, e.severity.value) for e in evs] == [("dcgm_diag_fail", "fatal")]
    # 3.x Deployment: the message under the plural key, gpu_id a number
    doc = _diag_v3([("Deployment", "Persistence Mode", 5, "Fail", "Persistence mode for GPU 5 is disabled")])
    evs = dcgm.parse(_styled(doc), Ctx())
    assert [(e.kind, e.device.index) for e in evs] == [("dcgm_diag_fail", 5)]
    assert "Persistence mode for GPU 5 is disabled" in evs[0].message
    passing = _diag_v4([("Hardware", "memory", g, "Pass", "") for g in range(8)])
    assert dcgm.parse(_styled(passing), Ctx()) == []


_HOPPER = ("CRC FLIT Error", "CRC Data Error", "Replay Error", "Recovery Error")
_BLACKWELL = ("Malformed Packet Error", "Buffer Overrun Error", "Rx Error", "Rx Remote Error", "Rx General Error",
              "Effective Error", "Tx Discards", "Link Integrity Error", "Rx Symbol Error", "Symbol BER", "Effective BER")


def _nvlink_e(gpu: int, body: dict[str, dict[str, object]]) -> dict:
    """dcgmi nvlink -e -g GPU -j: DcgmiOutputJson with header [NVLINK Error Counts, GPU n] and one section per link
    (Hopper and older) or `Error Detail` (Blackwell), values as HelperDisplayValue strings."""
    return {"header": ["NVLINK Error Counts", f"GPU {gpu}"],
            "body": {sec: {"children": {k: {"value": str(v)} for k, v in kids.items()}} for sec, kids in body.items()}}


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 7),
       st.dictionaries(st.integers(0, 17), st.tuples(*[st.sampled_from([0, 0, 0, 3, 1024, "Not Supported"])] * 4),
                       min_size=1, max_size=18))
def test_dcgmi_nvlink_e_json_hopper_any_non_zero_counter_is_read(gpu: int, links: dict) -> None:
    body = {f"Link {link}": dict(zip(_HOPPER, vals, strict=True)) for link, vals in links.items()}
    events = dcgm.parse("$ dcgmi nvlink -e -g %d -j\n" % gpu + _styled(_nvlink_e(gpu, body)), Ctx())
    bad = {f"link{link}_{name.lower().replace(' ', '_')}" for link, vals in links.items()
           for name, v in zip(_HOPPER, vals, strict=True) if isinstance(v, int) and v}
    if not bad:
        assert events == []
        return
    assert [(e.kind, e.device.index, e.severity.value, e.component.value) for e in events] == [
        ("nvlink_errors", gpu, "degraded", "nvlink")]
    assert {k for k in events[0].attrs if k.startswith("link")} == bad


def test_dcgmi_nvlink_e_json_blackwell_reads_uncorrected_counters_only() -> None:
    quiet = dict.fromkeys(_BLACKWELL, 0) | {"Rx Symbol Error": 18234, "Symbol BER": "1.5e-09", "Effective BER": "2e-17"}
    assert dcgm.parse(_styled(_nvlink_e(2, {"Error Detail": quiet})), Ctx()) == []  # FEC-corrected: a healthy link
    bad = quiet | {"Effective Error": 4, "Link Integrity Error": 1}
    two = _styled(_nvlink_e(2, {"Error Detail": bad})) + _styled(_nvlink_e(3, {"Error Detail": quiet}))  # one run per GPU
    evs = dcgm.parse(two, Ctx())
    assert [(e.kind, e.device.index) for e in evs] == [("nvlink_errors", 2)]
    assert evs[0].attrs["effective_error"] == 4 and evs[0].attrs["link_integrity_error"] == 1
    assert "dcgm" in detect_kinds(two)
