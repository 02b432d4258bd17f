"""`fleetmend report`'s computation (`fleetmend.report`, pure) and its HTML page in a real headless Chromium.

- GPU-hours never go negative and add up: per node, per fault class and over consecutive windows (hypothesis).
- Version findings from fingerprints the agent's reader takes from synthesised host roots with two driver versions:
  the minority driver takes every fault → one finding naming it; the faults spread evenly → none (the same from
  twelve running agents through the router, the worker and the CLI: tests/test_version_finding_agents.py). Each
  node counts once, a drained one with its driver at the drain.
- The HTML page opens without a server and shows the figures `--json` prints (read back from Chromium's DOM).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from html import unescape
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agents.inventory.reader import read_fingerprint
from fleetmend.ledger import Outcome, close_outcome, part_not_replaced, repeat_part
from fleetmend.report import ReportParams, build_report, gpu_hours_of, hypergeom_sf
from fleetmend.report_html import render_html
from tests.fixtures.hosts.synth import HostSpec, build_host

H = 3600.0
IN_CI = bool(os.environ.get("CI"))


def rec(node: str, fc: str, drained: float, returned: float | None = None, *, gpus: int = 8, **kw) -> dict:
    return {"cluster": "c", "node": node, "incident_id": f"remediate/c/{node}/{drained}", "fault_class": fc,
            "drained_at": drained, "returned_at": returned, "gpu_count": gpus,
            "closed_at": returned, "outcome": "returned_after_repair" if returned else None, **kw}


def test_hypergeometric_tail_matches_counting():
    # 12 nodes, 3 hold the rare driver, 3 faulty nodes all on it: 1 of C(12,3) = 220 draws
    assert hypergeom_sf(3, 12, 3, 3) == pytest.approx(1 / 220)
    assert hypergeom_sf(0, 12, 3, 3) == 1.0 and hypergeom_sf(4, 12, 3, 3) == 0.0
    total = sum(math.comb(3, x) * math.comb(9, 4 - x) for x in range(0, 4))
    assert hypergeom_sf(1, 12, 3, 4) == pytest.approx(1 - math.comb(9, 4) / total)


span = st.tuples(st.floats(0, 100 * H), st.floats(0, 50 * H), st.booleans())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["n1", "n2", "n3"]), st.sampled_from(["xid79", "xid48", "fail_slow"]),
                          span, st.integers(0, 16)), max_size=30),
       st.floats(0, 150 * H))
def test_gpu_hours_never_negative_and_add_up(items, cut):
    now = 150 * H
    recs = [rec(n, fc, d, (d + dur) if ret else None, gpus=g) for n, fc, (d, dur, ret), g in items]
    for r in recs[::3]:  # some end before they start (a clock step): counted as zero, never negative
        if r["returned_at"] is not None:
            r["returned_at"] = r["drained_at"] - 10
    p = ReportParams(since=0, now=now)
    rep = build_report(recs, p)
    assert rep["gpu_hours"] >= 0
    assert all(v >= 0 for by in ("fault_class", "node", "rack", "hw_class") for v in rep[f"gpu_hours_by_{by}"].values())
    for by in ("fault_class", "node", "rack", "hw_class"):
        assert sum(rep[f"gpu_hours_by_{by}"].values()) == pytest.approx(rep["gpu_hours"], abs=0.01 + 1e-3 * len(recs))
    for node in ("n1", "n2", "n3"):  # a node's hours are the sum of its incidents'
        mine = sum(gpu_hours_of(r, p) for r in recs if r["node"] == node)
        assert rep["gpu_hours_by_node"].get(node, 0.0) == pytest.approx(mine, abs=0.001 * (1 + len(recs)))
    # two consecutive windows add up to the whole
    a = build_report(recs, ReportParams(since=0, now=cut))["gpu_hours"]
    b = build_report(recs, ReportParams(since=cut, now=now))["gpu_hours"]
    assert a + b == pytest.approx(rep["gpu_hours"], abs=0.01 + 2e-3 * len(recs))


def test_figures_from_a_handful_of_incidents():
    t0 = 1_000_000.0
    recs = [
        rec("n1", "xid79", t0, t0 + 10 * H, observed_at=t0 - 4, routed_at=t0 - 3, rack="r1",
            ticket="T-1", ticket_filed_at=t0 + H, ticket_closed_at=t0 + 9 * H, part_not_replaced=True, part="0000:3b:00.0",
            part_serial_drain="GPU-1"),
        rec("n2", "xid48", t0, t0 + 2 * H, observed_at=t0 - 2, rack="r1", gpus=4),
        rec("n3", "fail_slow", t0, None, observed_at=t0 - 1, slow={"ratio": 1.25, "slow_s": 900.0, "metric":
                                                                   "job_step_seconds", "job": "j1", "job_gpus": 64}),
    ]
    recs[1].update(outcome=Outcome.NO_FAULT_FOUND.value)
    rep = build_report(recs, ReportParams(since=t0 - H, now=t0 + 20 * H))
    assert rep["gpu_hours"] == pytest.approx(8 * 10 + 4 * 2 + 8 * 20)
    assert rep["gpu_hours_by_fault_class"] == {"fail_slow": 160.0, "xid79": 80.0, "xid48": 8.0}
    assert rep["gpu_hours_by_rack"] == {"r1": 88.0, "-": 160.0}
    assert rep["mttr_h"]["n"] == 2 and rep["mttr_h"]["mean"] == pytest.approx(6.0)
    assert rep["time_to_detect_s"] == {"n": 1, "mean": 1.0, "p50": 1.0, "p90": 1.0}
    assert rep["time_to_drain_s"]["mean"] == pytest.approx(7 / 3, abs=1e-3)
    assert rep["ticket_turnaround_h"]["mean"] == pytest.approx(8.0)
    assert rep["false_drain_rate"] == 0.5 and rep["outcomes"]["still_out"] == 1
    assert rep["parts_not_replaced"][0]["serial"] == "GPU-1"
    # slowness: 1 − 1/1.25 = 0.2 of the pace, 0.25 h slow, the job's 64 GPUs
    assert rep["slowness_gpu_hours"] == pytest.approx(0.2 * 0.25 * 64)
    assert set(rep["how"]) >= {"gpu_hours", "mttr_h", "findings", "false_drain_rate", "slowness_gpu_hours"}


def test_outcomes_part_rules_and_repeat_part():
    assert close_outcome({"ticket": "T", "rma": True}, "returned_to_service") == Outcome.RMA
    assert close_outcome({"ticket": "T"}, "returned_to_service") == Outcome.REPAIRED
    assert close_outcome({"diag_first_result": "pass"}, "returned_to_service") == Outcome.NO_FAULT_FOUND
    assert close_outcome({"diag_first_result": "fail"}, "returned_to_service") == Outcome.RECOVERED
    assert part_not_replaced({"ticket": "T", "part_serial_drain": "A", "part_serial_return": "A"}) is True
    assert part_not_replaced({"ticket": "T", "part_serial_drain": "A", "part_serial_return": "B"}) is False
    assert part_not_replaced({"part_serial_drain": "A", "part_serial_return": "A"}) is None
    fails = [{"fault_class": "xid79", "at": 100.0, "node": "n1", "incident_id": "i1"}]
    assert "repeat part" in (repeat_part(fails, "xid79", 200.0, 1000.0, "i2") or "")
    assert repeat_part(fails, "xid48", 200.0, 1000.0, "i2") is None  # another fault class
    assert repeat_part(fails, "xid79", 5000.0, 1000.0, "i2") is None  # outside the window
    assert repeat_part(fails, "xid79", 200.0, 1000.0, "i1") is None  # the same incident


def _fleet(tmp_path: Path) -> list[dict]:
    """Twelve nodes read by the agent's fingerprint reader: nine on driver 550.90.07, three on 535.104.05."""
    fleet = []
    for i in range(12):
        drv = "535.104.05" if i >= 9 else "550.90.07"
        fp = read_fingerprint(build_host(tmp_path / f"n{i}", HostSpec(driver=drv, gpus=2, cpus=2)), "c", f"n{i}")
        assert fp.versions["nvidia_driver"] == drv
        fleet.append({"node": fp.node, "versions": fp.versions})
    return fleet


def test_version_finding_minority_driver_takes_all_faults(tmp_path):
    fleet = _fleet(tmp_path)
    versions = {f["node"]: f["versions"] for f in fleet}
    p = ReportParams(since=0, now=100 * H)
    rare = [rec(f"n{i}", "xid79", H * i, H * i + H, versions_drain=versions[f"n{i}"]) for i in (9, 10, 11)]
    rep = build_report(rare, p, fleet=fleet, cluster="c")
    assert [(f["fault_class"], f["key"], f["value"]) for f in rep["findings"]] == [
        ("xid79", "nvidia_driver", "535.104.05")]
    f = rep["findings"][0]
    assert (f["nodes_with_fault_and_value"], f["nodes_with_fault"], f["fleet_nodes_with_value"], f["fleet_nodes"]) == (
        3, 3, 3, 12)
    assert f["p_value"] == pytest.approx(1 / 220) and "hypergeometric" in f["test"]
    assert f["nodes"] == ["n10", "n11", "n9"]
    # spread evenly over the fleet (3 of 12 faulty nodes on each fourth): no finding
    even = [rec(f"n{i}", "xid79", H * i, H * i + H, versions_drain=versions[f"n{i}"]) for i in (0, 3, 6, 9)]
    assert build_report(even, p, fleet=fleet, cluster="c")["findings"] == []
    # too few nodes for a pattern a vendor can act on: none, however unlikely
    assert build_report(rare[:2], p, fleet=fleet, cluster="c")["findings"] == []


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def test_html_page_shows_the_json_figures_in_a_browser(tmp_path):
    binary = _chromium()
    if binary is None:
        if IN_CI:
            pytest.fail("chromium not installed; .ci/run installs it (apt-get install -y chromium)")
        pytest.skip("chromium not installed (apt-get install -y chromium)")
    t0 = 1_000_000.0
    recs = [rec("n1", "xid79", t0, t0 + 10 * H, rack="r1", observed_at=t0 - 5, routed_at=t0 - 4,
                versions_drain={"nvidia_driver": "550.90.07"}),
            rec("n2", "xid48", t0, t0 + 3 * H, rack="r2", hw_class="H100 x8", observed_at=t0 - 3)]
    rep = json.loads(json.dumps(build_report(recs, ReportParams(since=t0 - H, now=t0 + 24 * H)), allow_nan=False))
    page = tmp_path / "report.html"
    page.write_text(render_html(rep), encoding="utf-8")
    common = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1200,1600"]
    dom = subprocess.run([*common, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120).stdout
    shown = {m[0]: json.loads(unescape(m[1])) for m in re.findall(r'<div class="value" data-figure="([^"]+)" '
                                                                   r'data-value="([^"]*)"', dom)}
    assert shown["gpu_hours"] == rep["gpu_hours"] == pytest.approx(8 * 13)
    assert shown["mttr_h"] == rep["mttr_h"]["mean"] and shown["time_to_detect_s"] == rep["time_to_detect_s"]["mean"]
    assert shown["incidents"] == rep["incidents"] and shown["false_drain_rate"] == rep["false_drain_rate"]
    bars = {(m[0], unescape(m[1])): float(m[2]) for m in re.findall(
        r'data-figure="(gpu_hours_by_[a-z_.]+)" data-group="([^"]*)" data-value="([^"]*)"', dom)}
    for key, values in (("gpu_hours_by_fault_class", rep["gpu_hours_by_fault_class"]),
                        ("gpu_hours_by_rack", rep["gpu_hours_by_rack"]),
                        ("gpu_hours_by_version.nvidia_driver", rep["gpu_hours_by_version"]["nvidia_driver"])):
        assert {g: v for (k, g), v in bars.items() if k == key} == pytest.approx(values)
    assert "http://" not in page.read_text().replace("http://www.w3.org/2000/svg", ""), "no network at view time"
    shot = tmp_path / "report.png"
    subprocess.run([*common, f"--screenshot={shot}", page.as_uri()], capture_output=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 10_000
    print(f"\nreport screenshot: {shot}")


def test_the_fingerprint_names_each_gpu_by_its_uuid(tmp_path):
    """The agent's reader takes the GPU's UUID from the driver's information file (the part's identity the
    ledger compares at the drain and the return); the judged facts and the digest do not include it."""
    gpu = "0000:1b:00.0"  # the first GPU of a synthesised host
    info = "Model: \t\t NVIDIA H100 80GB HBM3\nGPU UUID: \t GPU-1234-abcd\nVideo BIOS: \t 96.00.74.00.0B\n"
    a = read_fingerprint(build_host(tmp_path / "a", HostSpec(gpus=2, cpus=2, extra={
        f"proc/driver/nvidia/gpus/{gpu}/information": info})), "c", "a")
    assert a.serials.get(gpu) == "GPU-1234-abcd", a.serials
    b = read_fingerprint(build_host(tmp_path / "b", HostSpec(gpus=2, cpus=2, extra={
        f"proc/driver/nvidia/gpus/{gpu}/information": info.replace("1234", "9999")})), "c", "a")
    assert b.serials[gpu] != a.serials[gpu] and b.digest == a.digest
    assert not any("GPU-" in v for v in a.facts().values())


def test_version_finding_counts_each_node_once_with_its_value_at_the_drain(tmp_path):
    """Three nodes drained on 535.104.05 that run 550.90.07 now (upgraded since), while three others run 535 now:
    six nodes held 535, not three. The faulty three are 3 of 6 holders among 12 (p = C(6,3)/C(12,3) = 0.09): no
    finding. Taking the fleet's count now (3) as the holders would make the faulty three all of them (p = 1/220)."""
    fleet = _fleet(tmp_path)  # n9, n10, n11 on 535 now
    old = {**next(f["versions"] for f in fleet if f["node"] == "n0"), "nvidia_driver": "535.104.05"}
    p = ReportParams(since=0, now=100 * H)
    recs = [rec(f"n{i}", "xid79", H * i, H * i + H, versions_drain=old) for i in (0, 3, 6)]
    assert build_report(recs, p, fleet=fleet, cluster="c")["findings"] == []
    # the same three drained on 535 and still on it, with nobody else on it: a finding, K = 3 of N = 12
    fleet3 = [{"node": f["node"], "versions": old if f["node"] in ("n0", "n3", "n6") else
               {**f["versions"], "nvidia_driver": "550.90.07"}} for f in fleet]
    (f,) = build_report(recs, p, fleet=fleet3, cluster="c")["findings"]
    assert (f["fleet_nodes_with_value"], f["fleet_nodes"], f["p_value"]) == (3, 12, pytest.approx(1 / 220))
    # a faulty node the fleet does not list now (retired) still counts once: N = 13
    gone = [rec("n99", "xid79", H, 2 * H, versions_drain=old)]
    (f,) = build_report(recs + gone, p, fleet=fleet3, cluster="c")["findings"]
    assert (f["nodes_with_fault_and_value"], f["fleet_nodes_with_value"], f["fleet_nodes"]) == (4, 4, 13)


def test_nodes_of_one_name_in_two_clusters_are_two_nodes():
    """The all-cluster report summed a gpu-020 of two clusters and called it a lemon (two false alarms, one in
    each: a new user's trial, F12); over several clusters a node is `<cluster>/<node>`, one cluster's reads
    as before."""
    p = ReportParams(since=0.0, now=10 * H, lemon_repairs=2)
    recs = [rec("gpu-020", "xid79", 1 * H, 2 * H), {**rec("gpu-020", "xid79", 3 * H, 4 * H), "cluster": "nope"}]
    both = build_report(recs, p)
    assert both["lemons"] == [] and set(both["gpu_hours_by_node"]) == {"c/gpu-020", "nope/gpu-020"}
    one = build_report([recs[0], {**recs[1], "cluster": "c"}], p, cluster="c")
    assert [x["node"] for x in one["lemons"]] == ["gpu-020"] and set(one["gpu_hours_by_node"]) == {"gpu-020"}
