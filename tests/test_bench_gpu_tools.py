"""The sweep's GPU steps (agents/bench.py): the load step's real code against an NVML stand-in
autospecced from pynvml whose readings follow a real stand-in load process (busy while it runs,
idle once it is stopped); nvbandwidth and dcgmi parsed from recorded output (tests/fixtures/bench,
sources in its README) printed by stand-in programs on PATH; every missing tool named in `skipped`."""

from __future__ import annotations

import asyncio
import os
import stat
import sys
from pathlib import Path

import pynvml
import pytest

from agents import bench
from agents.bench import GpuTools, gpu_load_step, load_command, run_bench
from agents.parsers import nvbandwidth
from agents.parsers.dcgm import diag_json_metrics
from fleetmend.diagnostics import BenchRequest
from fleetmend.sweep import compare, lower_is_better
from tests.test_perf_sampler import PerfGpu, perf_standin

FIX = Path(__file__).parent / "fixtures" / "bench"


def fixture(name: str) -> str:
    return (FIX / name).read_text()


def script(path: Path, body: str) -> Path:
    """An executable Python program at `path` (a stand-in for a site tool)."""
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def printer(path: Path, text: str, rc: int = 0) -> Path:
    """A stand-in that prints `text` (recorded output) and exits `rc`, like the real tool would."""
    return script(path, f"import sys\nsys.stdout.write({text!r})\nsys.exit({rc})\n")


# ---------------------------------------------------------------- nvbandwidth


def test_nvbandwidth_recorded_outputs() -> None:
    r = nvbandwidth.parse(fixture("nvbandwidth_v0.2_rtx4090x8.txt"))
    assert [m.key for m in r.matrices] == ["host_to_device_memcpy_ce", "device_to_host_memcpy_ce"]
    assert r.matrices[0].sum == 205.04 and len(r.matrices[0].cells[0]) == 8
    # the slowest GPU's link, not the SUM: GPU 2 at 23.90 GB/s host→device
    assert nvbandwidth.metrics(r) == {"nvbandwidth_host_to_device_memcpy_ce_gbps": 23.9,
                                      "nvbandwidth_device_to_host_memcpy_ce_gbps": 26.25}
    # v0.8, one GPU, labels padded differently
    assert nvbandwidth.metrics(nvbandwidth.parse(fixture("nvbandwidth_v0.8_a100x1.txt"))) == {
        "nvbandwidth_host_to_device_memcpy_sm_gbps": 25.13}
    assert nvbandwidth.metrics(nvbandwidth.parse(fixture("nvbandwidth_v0.8_h20x8_local_copy.txt"))) == {
        "nvbandwidth_device_local_copy_gbps": 1115.72}
    # GPU×GPU matrix with an N/A diagonal, no Running line (elided by the poster): key from SUM
    r = nvbandwidth.parse(fixture("nvbandwidth_v0.8_a6000x6_d2d_read.txt"))
    assert r.matrices[0].key == "device_to_device_memcpy_read_ce" and r.matrices[0].cells[0][0] is None
    assert nvbandwidth.metrics(r) == {"nvbandwidth_device_to_device_memcpy_read_ce_gbps": 21.8}
    # v0.2 waives with "Waiving <key>."
    r = nvbandwidth.parse(fixture("nvbandwidth_v0.2_rtx2080ti_waiving.txt"))
    assert r.waived == ["device_to_device_memcpy_write_ce"] and r.matrices == []


def test_nvbandwidth_format_rules() -> None:
    # releases before v0.5 print 0.00 on the diagonal (the tool's README); several matrices per
    # testcase each with its own SUM key; a latency matrix in ns; Waived:/Error: lines; a matrix
    # whose cells disagree with its SUM line is not trusted
    text = """Running device_to_device_memcpy_write_ce.
memcpy CE GPU(row) <- GPU(column) bandwidth (GB/s)
          0         1         2
0      0.00    276.07    276.36
1    276.19      0.00    138.02
2    276.33    276.29      0.00

SUM device_to_device_memcpy_write_ce 1519.26

Running device_to_device_bidirectional_memcpy_read_ce.
memcpy CE GPU(row) <-> GPU(column) Read1 bandwidth (GB/s)
           0         1
 0       N/A    250.10
 1    249.90       N/A

SUM device_to_device_bidirectional_memcpy_read_ce_read1 500.00

memcpy CE GPU(row) <-> GPU(column) Total bandwidth (GB/s)
           0         1
 0       N/A    500.10
 1    499.90       N/A

SUM device_to_device_bidirectional_memcpy_read_ce_total 1000.00

Running host_device_latency_sm.
memory latency SM CPU(row) <-> GPU(column) (ns)
           0         1
 0    812.40    845.10

SUM host_device_latency_sm 1657.50

Running all_to_host_memcpy_ce.
Waived: 
Running device_to_device_memcpy_read_sm.
Error: peer access failed
Running host_to_device_memcpy_ce.
memcpy CE CPU(row) -> GPU(column) bandwidth (GB/s)
           0         1
 0     55.61     55.63

SUM host_to_device_memcpy_ce 99.00
"""
    r = nvbandwidth.parse(text)
    m = nvbandwidth.metrics(r)
    assert m == {"nvbandwidth_device_to_device_memcpy_write_ce_gbps": 138.02,  # diagonal 0.00 left out
                 "nvbandwidth_device_to_device_bidirectional_memcpy_read_ce_read1_gbps": 249.9,
                 "nvbandwidth_device_to_device_bidirectional_memcpy_read_ce_total_gbps": 499.9,
                 "nvb_host_device_latency_sm_ns": 845.1}  # latency: the worst is the largest
    assert lower_is_better("nvb_host_device_latency_sm_ns")
    assert not lower_is_better("nvbandwidth_device_to_device_memcpy_write_ce_gbps")
    assert r.waived == ["all_to_host_memcpy_ce"]
    assert r.errors["device_to_device_memcpy_read_sm"] == "peer access failed"
    assert "SUM line says 99.00" in r.errors["host_to_device_memcpy_ce"]
    # a 1×N GPU matrix (all_to_one) is not square: its first cell is a real link and counts
    one = ("Running all_to_one_write_ce.\nmemcpy CE GPU(row) <- GPU(column) bandwidth (GB/s)\n"
           "  0  1\n 0  10.00  300.00\n\nSUM all_to_one_write_ce 310.00\n")
    assert nvbandwidth.metrics(nvbandwidth.parse(one)) == {"nvbandwidth_all_to_one_write_ce_gbps": 10.0}
    assert nvbandwidth.parse("garbage\n(GB/s)\n") is not None  # never raises


# ---------------------------------------------------------------- DCGM


def test_dcgm_json_3x_recorded() -> None:
    m, problems = diag_json_metrics(fixture("dcgmi_diag_3x_per_gpu.json"))
    # pcie info lines of 4 GPUs → the worst GPU per quantity (min bandwidth, max latency)
    assert m["dcgm_pcie_host_to_gpu_bandwidth_gbps"] == 12.13
    assert m["dcgm_pcie_gpu_to_host_bandwidth_gbps"] == 13.07
    assert m["dcgm_pcie_bidirectional_bandwidth_gbps"] == 22.41
    assert m["dcgm_pcie_gpu_to_host_latency_us"] == 4.386 and lower_is_better("dcgm_pcie_gpu_to_host_latency_us")
    assert m["dcgm_pcie_bidirectional_latency_us"] == 7.482
    assert m["dcgm_sm_stress_relative_stress_level"] == 577.0
    assert not any("temperature" in k for k in m), "temperatures are not performance numbers"
    assert problems["dcgm_sm_stress"].startswith("FAIL on GPU 0: Max stress level of 2128.7")
    assert problems["dcgm_memory_bandwidth"].startswith("SKIP on GPU 0")
    assert "dcgm_pcie" not in problems


def test_dcgm_json_4x_shape() -> None:
    # DCGM 4.x: results carry entity_group/entity_id (dcgmi/Diag.cpp HelperJsonAddResult); info
    # texts as the nvvs plugins format them (TargetedPower_wrapper.cpp, DiagnosticPlugin.cpp,
    # TargetedStress_wrapper.cpp without the colon)
    doc = """{"DCGM Diagnostic": {"test_categories": [
      {"category": "Stress", "tests": [
        {"name": "targeted_power", "results": [
          {"entity_group": "GPU", "entity_group_id": 1, "entity_id": 0, "status": "Pass",
           "info": ["GPU 0 max power: 699.8 W average power usage: 688.1 W"]},
          {"entity_group": "GPU", "entity_group_id": 1, "entity_id": 1, "status": "Pass",
           "info": ["GPU 1 max power: 700.2 W average power usage: 612.4 W"]}],
         "test_summary": {"status": "Pass"}},
        {"name": "diagnostic", "results": [
          {"entity_group": "GPU", "entity_group_id": 1, "entity_id": 0, "status": "Pass",
           "info": ["GPU 0 calculated at approximately 51234.56 gigaflops during this test"]},
          {"entity_group": "GPU", "entity_group_id": 1, "entity_id": 1, "status": "Fail",
           "warnings": [{"warning": "GPU 1 gflops below threshold", "error_id": 1, "error_category": 1,
                         "error_severity": 2}],
           "info": ["GPU 1 calculated at approximately 40100.00 gigaflops during this test"]}],
         "test_summary": {"status": "Fail"}},
        {"name": "targeted_stress", "results": [
          {"entity_group": "GPU", "entity_group_id": 1, "entity_id": 0, "status": "Pass",
           "info": ["GPU 0 relative stress level\\t4012"]}], "test_summary": {"status": "Pass"}}]}]},
      "metadata": {"version": "4.2.3"}}"""
    m, problems = diag_json_metrics("Successfully ran diagnostic for group.\n" + doc)
    assert m == {"dcgm_targeted_power_max_power_w": 699.8, "dcgm_targeted_power_average_power_usage_w": 612.4,
                 "dcgm_diagnostic_gflops": 40100.0, "dcgm_targeted_stress_relative_stress_level": 4012.0}
    assert problems == {"dcgm_diagnostic": "FAIL on GPU 1: GPU 1 gflops below threshold"}
    m, problems = diag_json_metrics('{"DCGM Diagnostic": {"runtime_error": "Unable to connect to host engine"}}')
    assert m == {} and problems == {"dcgm": "Unable to connect to host engine"}
    for bad in ("Error: unable to establish a connection to the specified host: localhost", '{"other": 1}', "{nope"):
        with pytest.raises(ValueError):
            diag_json_metrics(bad)


# ---------------------------------------------------------------- load step

IDLE = dict(util=0, sm=345, power_mw=74_000, temp=31)


class LoadedGpu(PerfGpu):
    """An H200 (SXM, 700 W, slowdown at 90 °C) whose readings depend on whether the load runs."""

    def __init__(self, i: int, marker: Path, *, sm: int = 1980, power_mw: int = 688_000, temp: int = 66,
                 brake_every: int = 0, limit_mw: int = 700_000) -> None:
        super().__init__(i)
        self.marker, self.loaded_sm, self.loaded_power, self.loaded_temp = marker, sm, power_mw, temp
        self.brake_every, self.reads = brake_every, 0
        self.limit_mw, self.default_mw, self.slowdown = limit_mw, 700_000, 90

    @property
    def busy(self) -> bool:
        return self.marker.exists()


def load_standin(gpus: list[LoadedGpu]):
    from types import SimpleNamespace

    nv = perf_standin(gpus)

    def g(h):
        if gpus[h[1]].lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return gpus[h[1]]

    nv.nvmlDeviceGetUtilizationRates.side_effect = lambda h: SimpleNamespace(gpu=100 if g(h).busy else 0, memory=0)
    nv.nvmlDeviceGetClockInfo.side_effect = lambda h, t: g(h).loaded_sm if g(h).busy else IDLE["sm"]
    nv.nvmlDeviceGetPowerUsage.side_effect = lambda h: g(h).loaded_power if g(h).busy else IDLE["power_mw"]
    nv.nvmlDeviceGetTemperature.side_effect = lambda h, s: g(h).loaded_temp if g(h).busy else IDLE["temp"]
    nv.nvmlDeviceGetPowerManagementDefaultLimit.side_effect = lambda h: g(h).default_mw

    def reasons(h):
        gpu = g(h)
        if not gpu.busy:
            return 0x1  # GPU idle
        gpu.reads += 1
        brake = gpu.brake_every and gpu.reads % gpu.brake_every == 0
        return 0x4 | ((0x80 | 0x8) if brake else 0)  # SW power cap all the time under full load

    nv.nvmlDeviceGetCurrentClocksEventReasons.side_effect = reasons
    return nv


LOAD_SCRIPT = """import os, signal, sys, time
marker, seconds = sys.argv[1], float(sys.argv[2])
open(marker + ".args", "w").write(" ".join(sys.argv[1:]))
time.sleep(0.5)  # CUDA init
open(marker, "w").close()
def stop(*_):
    os.unlink(marker)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
time.sleep(seconds)
os.unlink(marker)
"""


async def test_load_step_samples_under_load_and_stops_the_generator(tmp_path: Path) -> None:
    marker = tmp_path / "busy"
    gen = script(tmp_path / "burn", LOAD_SCRIPT)
    # GPU 0 healthy; GPU 1 in power brake 1 sample in 5 with clocks 10 % low and a 600 W limit set by hand
    gpus = [LoadedGpu(0, marker), LoadedGpu(1, marker, sm=1782, power_mw=590_000, temp=71, brake_every=5,
                                            limit_mw=600_000)]
    nv = load_standin(gpus)
    m, why = await gpu_load_step(nv, [str(gen), str(marker), "{seconds}"], 2.0, 30.0)
    assert why is None, why
    assert m["gpu_load_sm_clock_ratio_min"] == pytest.approx(1782 / 1980, abs=1e-4)
    assert m["gpu_load_power_brake_free_min"] == pytest.approx(0.8, abs=0.12)
    assert m["gpu_load_hw_slowdown_free_min"] == m["gpu_load_power_brake_free_min"]
    assert m["gpu_load_thermal_free_min"] == 1.0
    assert m["gpu_load_sw_power_cap_free_min"] == 0.0
    assert m["gpu_load_power_ratio_min"] == pytest.approx(590 / 600, abs=1e-3)
    assert m["gpu_load_power_limit_ratio_min"] == pytest.approx(600 / 700, abs=1e-3)
    assert m["gpu_load_temp_headroom_c_min"] == 90 - 71
    assert all(not lower_is_better(k) for k in m), "every load metric is higher-is-better by its name"
    assert not marker.exists(), "the generator was stopped (its SIGTERM handler removed the marker)"
    args = (tmp_path / "busy.args").read_text().split()
    assert int(args[1]) >= 2, "{seconds} was replaced by the generator's run time"
    nv.nvmlShutdown.assert_called()


async def test_load_step_failures_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "busy"
    nv = load_standin([LoadedGpu(0, marker)])
    m, why = await gpu_load_step(nv, [sys.executable, "-c", "print('CUDA error: no device'); raise SystemExit(3)"],
                                 2.0, 30.0)
    assert m == {} and "exited (3) before the GPUs were busy" in why and "CUDA error: no device" in why
    monkeypatch.setattr(bench, "LOAD_START_MAX_S", 1.0)
    m, why = await gpu_load_step(nv, [sys.executable, "-c", "import time; time.sleep(30)"], 2.0, 30.0)
    assert m == {} and "GPUs not busy" in why
    m, why = await gpu_load_step(nv, [str(tmp_path / "nope")], 2.0, 30.0)
    assert m == {} and "cannot start" in why
    m, why = await gpu_load_step(nv, ["true"], 20.0, 10.0)
    assert m == {} and why.startswith("deadline")
    # a GPU that falls off the bus during the window
    gpus = [LoadedGpu(0, marker)]
    nv = load_standin(gpus)
    gen = script(tmp_path / "burn", LOAD_SCRIPT)
    task = asyncio.create_task(gpu_load_step(nv, [str(gen), str(marker), "{seconds}"], 3.0, 30.0))
    while not marker.exists():
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)
    gpus[0].lost = True
    m, why = await task
    assert m == {} and "lost" in why
    assert not marker.exists()


def test_load_command_choice(tmp_path: Path) -> None:
    assert load_command([]) == (None, "turned off (agent.gpu_load_command = [])")
    assert load_command(["my-burn", "{seconds}"]) == (["my-burn", "{seconds}"], "agent.gpu_load_command")
    argv, src = load_command(None, which=lambda n: f"/opt/dcgm/bin/{n}" if n == "dcgmproftester12" else None)
    assert argv == ["/opt/dcgm/bin/dcgmproftester12", "--no-dcgm-validation", "-t", "1004", "-d", "{seconds}"]
    assert src == "dcgmproftester12 found on PATH (/opt/dcgm/bin/dcgmproftester12)"
    argv, why = load_command(None, which=lambda n: None)
    assert argv is None and "no load generator" in why and "gpu_burn" in why


# ---------------------------------------------------------------- the whole bench with stand-in tools


async def test_run_bench_with_standin_tools_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    marker = tmp_path / "busy"
    script(bindir / "gpu_burn", LOAD_SCRIPT.replace("sys.argv[1], float(sys.argv[2])",
                                                    f"{str(marker)!r}, float(sys.argv[1])"))
    printer(bindir / "nvbandwidth", fixture("nvbandwidth_v0.2_rtx4090x8.txt"))
    printer(bindir / "dcgmi", fixture("dcgmi_diag_3x_per_gpu.json"), rc=226)  # dcgmi: non-zero when a test fails
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    nv = load_standin([LoadedGpu(0, marker), LoadedGpu(1, marker)])
    rep = await run_bench(BenchRequest(host_seconds=0.1, deadline_s=60), cluster="c", node="n1", nvml=nv,
                          tools=GpuTools(load_seconds=1.0))
    assert rep.metrics["gpu_count"] == 2 and rep.metrics["gpu_load_sm_clock_ratio_min"] == 1.0
    assert rep.metrics["nvbandwidth_host_to_device_memcpy_ce_gbps"] == 23.9
    assert rep.metrics["dcgm_pcie_host_to_gpu_bandwidth_gbps"] == 12.13
    assert "gpu_load" not in rep.skipped and "nvbandwidth" not in rep.skipped and "dcgm" not in rep.skipped
    assert rep.skipped["dcgm_sm_stress"].startswith("FAIL on GPU 0")
    assert not marker.exists()
    assert int((tmp_path / "busy.args").read_text()) >= 1, "gpu_burn found on PATH got its TIME argument"

    # the same node without the tools: each one named in skipped, never silently absent
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    rep = await run_bench(BenchRequest(host_seconds=0.1, deadline_s=60), cluster="c", node="n2", nvml=nv)
    assert not any(k.startswith(("gpu_load_", "nvbandwidth_", "dcgm_")) for k in rep.metrics)
    assert "no load generator" in rep.skipped["gpu_load"]
    assert rep.skipped["nvbandwidth"] == "nvbandwidth not on PATH (agent.nvbandwidth_command)"
    assert rep.skipped["dcgm"] == "dcgmi not on PATH (agent.sweep_dcgm_command)"
    rep = await run_bench(BenchRequest(host_seconds=0.1), cluster="c", node="n3", nvml=nv,
                          tools=GpuTools(load_command=[], nvbandwidth_command=[], dcgm_command=[]))
    assert all("turned off" in rep.skipped[k] for k in ("gpu_load", "nvbandwidth", "dcgm"))
    # a CPU node: the GPU steps say why they did not run
    rep = await run_bench(BenchRequest(host_seconds=0.1), cluster="c", node="cpu1", nvml=None)
    assert rep.skipped["gpu_load"] == rep.skipped["nvbandwidth"] == "no GPUs on this node (see 'gpu')"


def test_tool_metrics_feed_the_comparison() -> None:
    """A node whose nvbandwidth shows one x8 link is the outlier; a node without nvbandwidth is not
    judged on it (nor flagged for lacking it)."""
    good = nvbandwidth.metrics(nvbandwidth.parse(fixture("nvbandwidth_v0.2_rtx4090x8.txt")))
    slow = nvbandwidth.metrics(nvbandwidth.parse(fixture("nvbandwidth_v0.2_rtx4090x8.txt").replace(
        "0     25.50     24.26     23.90", "0     25.50     24.26     12.10").replace("205.04", "193.24")))
    dm, _ = diag_json_metrics(fixture("dcgmi_diag_3x_per_gpu.json"))
    base = {"gpu_load_sm_clock_ratio_min": 1.0, "gpu_load_power_brake_free_min": 1.0}
    reports = {f"n{i}": {**base, **good, **dm} for i in range(4)}
    reports["n1"] = {**base, **slow, **dm}
    reports["n3"] = {**base, **dm}  # no nvbandwidth on this node
    reports["n2"] = {**base, "gpu_load_power_brake_free_min": 0.8, **good, **dm}  # power brake 20 % of the time
    res = compare("c", "s", reports, 5.0)
    assert res.outliers == ["n1", "n2"]
    rows = {r.node: r for r in res.rows}
    assert rows["n1"].worst_metric == "nvbandwidth_host_to_device_memcpy_ce_gbps"
    assert rows["n1"].worst_ratio == pytest.approx(12.10 / 23.9, abs=1e-3)
    assert rows["n2"].worst_metric == "gpu_load_power_brake_free_min"
    assert "nvbandwidth_host_to_device_memcpy_ce_gbps" not in rows["n3"].metrics and not rows["n3"].outlier


async def test_gpu_tools_through_real_agents_and_the_sweep(nats_server, temporal_server, tmp_path: Path,
                                                           unique: str) -> None:
    """End to end: real agents (each with its NVML stand-in, stand-in load generator, nvbandwidth
    and dcgmi), real NATS and Temporal, `fleetmend sweep --json`: the node with a slow link and the
    node in power brake are flagged on those metrics; the node without nvbandwidth says so in
    skipped and is not judged on it."""
    import json
    import subprocess

    from agents.runner import run_agent
    from fleetmend.config import load_settings
    from fleetmend.infra.connect import connect_nats, connect_temporal
    from fleetmend.infra.jetstream import ensure_fault_stream
    from fleetmend.worker import build_worker
    from tests.conftest import wait_agents_answer

    cluster = f"gt{unique}"
    base = dict(cluster=cluster, nats_url=nats_server.url, temporal_address=temporal_server.address,
                state_dir=tmp_path / "state", task_queue=f"tq-{unique}", log_format="json")
    s = load_settings(None, node="cli", **base)
    nc = await connect_nats(s, name="gpu-tools-e2e")
    await ensure_fault_stream(nc.jetstream())
    client = await connect_temporal(s)
    worker = await build_worker(s, client, nc)
    wtask = asyncio.create_task(worker.run())
    good = fixture("nvbandwidth_v0.2_rtx4090x8.txt")
    slow = good.replace("0     25.50     24.26     23.90",
                        "0     25.50     24.26     12.10").replace("205.04", "193.24")  # GPU 2 at x8
    dcgmi = printer(tmp_path / "dcgmi", fixture("dcgmi_diag_3x_per_gpu.json"), rc=226)
    stop = asyncio.Event()
    agents = []
    markers = {}
    for node in ("g1", "g2", "g3", "g4"):
        d = tmp_path / node
        d.mkdir()
        markers[node] = d / "busy"
        gen = script(d / "burn", LOAD_SCRIPT)
        nvb = printer(d / "nvbandwidth", slow if node == "g2" else good) if node != "g4" else d / "nvbandwidth"
        nv = load_standin([LoadedGpu(0, markers[node]),
                           LoadedGpu(1, markers[node], brake_every=5 if node == "g3" else 0)])
        a = load_settings(None, node=node, **base, agent={
            "perf_enabled": False, "gpu_load_command": [str(gen), str(markers[node]), "{seconds}"],
            "gpu_load_seconds": 2.0, "nvbandwidth_command": [str(nvb), "-t", "host_to_device_memcpy_ce"],
            "sweep_dcgm_command": [str(dcgmi), "diag", "-r", "pcie", "-j"]})
        agents.append(asyncio.create_task(run_agent(a, stop=stop, probes=[], hardware=False, nvml=nv)))
    env = {**os.environ, "FLEETMEND_NATS_URL": nats_server.url, "FLEETMEND_TEMPORAL_ADDRESS": temporal_server.address,
           "FLEETMEND_STATE_DIR": str(tmp_path / "state"), "FLEETMEND_CLUSTER": cluster,
           "FLEETMEND_TASK_QUEUE": f"tq-{unique}", "FLEETMEND_LOG_FORMAT": "json"}
    try:
        await wait_agents_answer(nc, cluster, markers, what="agents answer on their diag subjects")
        p = await asyncio.to_thread(subprocess.run, [
            sys.executable, "-m", "fleetmend.cli.main", "sweep", "g1", "g2", "g3", "g4", "--host-seconds", "0.1",
            "--deadline", "60", "--id", f"gt{unique}", "--json"],
            env=env, capture_output=True, text=True, timeout=180)
        assert p.returncode == 1, p.stdout + p.stderr
        d = json.loads(p.stdout)
        assert d["not_answering"] == {}
        rows = {r["node"]: r for r in d["rows"]}
        link = "nvbandwidth_host_to_device_memcpy_ce_gbps"
        assert d["medians"][link] == 23.9 and link not in d["not_judged"]
        assert rows["g2"]["metrics"][link]["outlier"] is True
        assert rows["g2"]["metrics"][link]["ratio"] == pytest.approx(12.10 / 23.9, abs=1e-3)
        brake = rows["g3"]["metrics"]["gpu_load_power_brake_free_min"]
        assert brake["outlier"] is True and brake["value"] == pytest.approx(0.8, abs=0.12)
        assert {"g2", "g3"} <= set(d["outliers"])
        gpu_tool = ("gpu_load_", "nvbandwidth_", "dcgm_")
        for n in ("g1", "g4"):
            flagged = [m for m, c in rows[n]["metrics"].items() if m.startswith(gpu_tool) and c["outlier"]]
            assert flagged == [], (n, flagged)
        assert link not in rows["g4"]["metrics"]
        assert rows["g4"]["skipped"]["nvbandwidth"].endswith("not on PATH (agent.nvbandwidth_command)")
        for n in rows:
            assert rows[n]["metrics"]["dcgm_pcie_host_to_gpu_bandwidth_gbps"]["value"] == 12.13
            assert rows[n]["metrics"]["gpu_load_sm_clock_ratio_min"]["value"] == 1.0
            assert rows[n]["skipped"]["dcgm_sm_stress"].startswith("FAIL on GPU 0")
            assert not markers[n].exists(), f"{n}: the load generator was stopped"
    finally:
        stop.set()
        await asyncio.gather(*agents, return_exceptions=True)
        await worker.shutdown()
        wtask.cancel()
        await nc.close()


def test_dcgm_json_odd_shapes_never_crash() -> None:
    for doc in ('{"DCGM Diagnostic": {"test_categories": [1, null, {"tests": ["x", {"results": 3}]}]}}',
                '{"DCGM Diagnostic": {"test_categories": {"a": 1}}}',
                '{"DCGM Diagnostic": {"test_categories": [{"tests": [{"name": "pcie", "results": '
                '[{"status": "PASS", "info": "GPU 0 Host to GPU bandwidth:\\t\\t12.50 GB/s"}, 7]}]}]}}'):
        m, _ = diag_json_metrics(doc)
    assert m == {"dcgm_pcie_host_to_gpu_bandwidth_gbps": 12.5}


async def test_nvml_failing_at_listing_is_said_not_raised(tmp_path: Path) -> None:
    nv = load_standin([LoadedGpu(0, tmp_path / "busy")])
    nv.nvmlDeviceGetHandleByIndex.side_effect = pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
    m, why = await gpu_load_step(nv, ["true"], 1.0, 30.0)
    assert m == {} and why.startswith("NVML failed while listing the GPUs")
