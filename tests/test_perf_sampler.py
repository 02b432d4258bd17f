"""PerfSampler's real code against an NVML stand-in autospecced from pynvml (a misspelled call fails)
and recorded sysfs trees (file contents as the kernel writes them); then the live agent publishing
samples to a real nats-server, captured by the perf stream."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest

from agents import perf as perf_mod
from agents.perf import PerfSampler
from fleetmend.telemetry import PerfSample
from tests.test_nvml_probe import Gpu, nvml_standin
from tests.test_sysfs_probe import ib_port, netdev, w


def test_constants_match_pynvml() -> None:
    assert perf_mod.CLOCK_SM == pynvml.NVML_CLOCK_SM
    assert perf_mod.FI_REASON_COUNTERS == {
        "sw_power_cap": pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP,
        "sw_thermal": pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN,
        "hw_thermal": pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN,
        "power_brake": pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN}
    assert perf_mod.VIOLATION_POLICIES == {"sw_power_cap": pynvml.NVML_PERF_POLICY_POWER,
                                           "sw_thermal": pynvml.NVML_PERF_POLICY_THERMAL}
    assert perf_mod.REASON_MASK["power_brake"] == pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown
    assert perf_mod.REASON_MASK["hw_slowdown"] == pynvml.nvmlClocksEventReasonHwSlowdown


class PerfGpu(Gpu):
    def __init__(self, i: int) -> None:
        super().__init__(i)
        self.sm, self.sm_max = 1980, 1980
        self.power_mw, self.limit_mw = 650_000, 700_000
        self.replay = 0
        self.fi_ns = {74: 0, 269: 0, 270: 0, 271: 0}
        self.fi_supported = True
        self.violation = {0: (0, 0), 1: (0, 0)}  # policy -> (reference µs, violation ns)


def perf_standin(gpus: list[PerfGpu]):
    nv = nvml_standin(gpus)
    g = lambda h: gpus[h[1]]  # noqa: E731
    nv.nvmlDeviceGetName.return_value = "NVIDIA H200"
    nv.nvmlDeviceGetClockInfo.side_effect = lambda h, t: g(h).sm if t == pynvml.NVML_CLOCK_SM else 0
    nv.nvmlDeviceGetMaxClockInfo.side_effect = lambda h, t: g(h).sm_max
    nv.nvmlDeviceGetPowerUsage.side_effect = lambda h: g(h).power_mw
    nv.nvmlDeviceGetEnforcedPowerLimit.side_effect = lambda h: g(h).limit_mw
    nv.nvmlDeviceGetPcieReplayCounter.side_effect = lambda h: g(h).replay

    def fields(h, ids):
        if not g(h).fi_supported:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [SimpleNamespace(nvmlReturn=0, value=SimpleNamespace(ullVal=g(h).fi_ns[i])) for i in ids]

    nv.nvmlDeviceGetFieldValues.side_effect = fields

    def violation(h, policy):
        ref, ns = g(h).violation[policy]
        return SimpleNamespace(referenceTime=ref, violationTime=ns)

    nv.nvmlDeviceGetViolationStatus.side_effect = violation
    return nv


def host_tree(root: Path, cpus: int = 4) -> None:
    w(root / "proc/cpuinfo", "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n")
    for c in range(cpus):
        d = root / f"sys/devices/system/cpu/cpu{c}"
        w(d / "thermal_throttle/core_throttle_count", "0")
        w(d / "thermal_throttle/package_throttle_count", "0")
        w(d / "cpufreq/scaling_cur_freq", "3000000")
        w(d / "cpufreq/base_frequency", "2000000")
    (root / "sys/devices/system/cpu/cpufreq").mkdir(parents=True, exist_ok=True)  # not a cpuN dir


def ib_counters(port_dir: Path, **values: int) -> None:
    for name in ("symbol_error", "link_downed", "link_error_recovery", "port_xmit_wait", "port_rcv_errors"):
        w(port_dir / "counters" / name, str(values.get(name, 0)))


def test_sample_gpu_port_host_deltas(tmp_path: Path) -> None:
    gpus = [PerfGpu(0), PerfGpu(1)]
    gpus[1].fi_supported = False  # older driver: violation counters, then the mask
    nv = perf_standin(gpus)
    port = ib_port(tmp_path, "mlx5_0", 1, "4: ACTIVE", "5: LinkUp", "400 Gb/sec (4X NDR)")
    w(tmp_path / "sys/class/infiniband/mlx5_0/hca_type", "MT4129")
    ib_counters(port, symbol_error=10, port_xmit_wait=1000)
    eth = netdev(tmp_path, "eth0", "1", "up", speed="100000")
    w(eth / "carrier_down_count", "2")
    w(eth / "statistics/rx_errors", "5")
    host_tree(tmp_path)
    s = PerfSampler(nv, tmp_path, cluster="c1", node="n1", interval_s=60)

    first = s.sample(now_mono=1000.0)
    assert first.hw.key == "NVIDIA H200x2|570.124.06|MT4129"
    assert first.hw.cpu_model == "Intel(R) Xeon(R) Platinum 8480+"
    assert first.gpus[0].pcie_replay_delta is None  # no baseline yet
    assert first.ports[0].symbol_error_delta is None

    # one interval of 60 s: GPU 0 spends 12 s in power brake, 30 s at the SW power cap; PCIe replays,
    # NVLink CRC errors, an ECC SBE; the IB port counts symbol errors; a CPU throttles
    gpus[0].util, gpus[0].sm = 97, 1800
    gpus[0].fi_ns[271] += 12 * 10**9
    gpus[0].fi_ns[74] += 30 * 10**9
    gpus[0].reasons = 0x8  # HW slowdown asserted at sampling time (no counter for it)
    gpus[0].replay = 7
    gpus[0].nvlink_errors = {(0, 2): 40, (1, 3): 2, (0, 1): 1}
    gpus[0].ecc[(0, 0)] = 1
    gpus[0].width = 8
    gpus[1].violation = {0: (60_000_000, 6 * 10**9), 1: (60_000_000, 0)}
    gpus[1].reasons = 0x80
    gpus[1].links = {0: 1, 1: 0}
    ib_counters(port, symbol_error=25, port_xmit_wait=1500, link_error_recovery=1)
    w(eth / "statistics/rx_errors", "9")
    w(tmp_path / "sys/devices/system/cpu/cpu2/thermal_throttle/core_throttle_count", "3")
    w(tmp_path / "sys/devices/system/cpu/cpu2/cpufreq/scaling_cur_freq", "1000000")

    second = s.sample(now_mono=1060.0)
    assert second.interval_s == 60.0
    g0, g1 = second.gpus
    assert (g0.util_pct, g0.sm_clock_mhz, g0.sm_clock_max_mhz) == (97.0, 1800.0, 1980.0)
    assert g0.event_frac["power_brake"] == pytest.approx(0.2)
    assert g0.event_frac["sw_power_cap"] == pytest.approx(0.5)
    assert g0.event_frac["hw_thermal"] == 0.0
    assert g0.event_frac["hw_slowdown"] == 1.0
    assert (g0.power_w, g0.power_limit_w) == (650.0, 700.0)
    assert (g0.pcie_width, g0.pcie_width_max, g0.pcie_replay_delta) == (8, 16, 7)
    assert (g0.nvlink_up, g0.nvlink_total, g0.nvlink_crc_delta, g0.nvlink_replay_delta,
            g0.nvlink_recovery_delta) == (2, 2, 42, 0, 1)  # CRC flit 40 + data 2
    assert g0.ecc_corrected_delta == 1
    # GPU 1: violation counters for power (6 s of 60 s) and thermal; the mask for power brake
    assert g1.event_frac["sw_power_cap"] == pytest.approx(0.1)
    assert g1.event_frac["sw_thermal"] == 0.0
    assert g1.event_frac["power_brake"] == 1.0
    assert g1.nvlink_up == 1
    ib, nic = second.ports
    assert (ib.name, ib.kind, ib.rate_gbps, ib.width) == ("mlx5_0/1", "ib", 400.0, 4)
    assert (ib.symbol_error_delta, ib.xmit_wait_delta, ib.link_error_recovery_delta, ib.link_downed_delta) == (
        15, 500, 1, 0)
    assert (nic.name, nic.kind, nic.rate_gbps, nic.rcv_errors_delta, nic.link_downed_delta) == (
        "eth0", "nic", 100.0, 4, 0)
    assert second.host.cpus == 4
    assert second.host.cpu_throttle_delta == 3
    assert second.host.cpu_freq_mhz == 2500.0 and second.host.cpu_freq_nominal_mhz == 2000.0
    # wire form round-trips and stays compact
    data = second.to_json_bytes()
    assert PerfSample.from_json_bytes(data) == second
    assert len(data) < 2500


def test_counter_reset_gives_no_delta(tmp_path: Path) -> None:
    port = ib_port(tmp_path, "mlx5_0", 1, "4: ACTIVE", "5: LinkUp", "400 Gb/sec (4X NDR)")
    ib_counters(port, symbol_error=100)
    s = PerfSampler(None, tmp_path, cluster="c", node="n")
    s.sample(now_mono=0.0)
    ib_counters(port, symbol_error=3)  # counters cleared (perfquery -x, driver reload)
    assert s.sample(now_mono=60.0).ports[0].symbol_error_delta is None
    ib_counters(port, symbol_error=5)
    assert s.sample(now_mono=120.0).ports[0].symbol_error_delta == 2


def test_a_reading_the_contract_refuses_is_left_out_not_the_sample(tmp_path: Path) -> None:
    """A driver sentinel (temperature 0xFFFFFFFF, a clock above any GPU's) would fail the whole sample at
    the analyzer; the sampler leaves that reading out and keeps the rest, and the loop never dies."""
    gpus = [PerfGpu(0), PerfGpu(1)]
    gpus[1].temp = 0xFFFFFFFF
    gpus[1].sm = 4_294_967_295
    s = PerfSampler(perf_standin(gpus), tmp_path, cluster="c", node="n")
    s.sample(now_mono=0.0)
    got = s.sample(now_mono=60.0)
    g0, g1 = got.gpus
    assert g1.temperature_c is None and g1.sm_clock_mhz is None
    assert g1.power_w == 650.0 and g1.sm_clock_max_mhz == 1980.0  # the other readings still go out
    assert g0.temperature_c is not None and g0.sm_clock_mhz == 1980.0
    PerfSample.from_json_bytes(got.model_dump_json().encode())  # what leaves the node decodes at the analyzer


def test_gpu_lost_is_left_out_and_no_nvml_is_a_cpu_node(tmp_path: Path) -> None:
    gpus = [PerfGpu(0), PerfGpu(1)]
    s = PerfSampler(perf_standin(gpus), tmp_path, cluster="c", node="n")
    gpus[1].lost = True
    assert [g.index for g in s.sample(now_mono=0.0).gpus] == [0]
    nv = perf_standin([])
    nv.nvmlInit.side_effect = pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    host_tree(tmp_path)
    cpu = PerfSampler(nv, tmp_path, cluster="c", node="n").sample()
    assert cpu.gpus == [] and cpu.hw.key == "cpu:Intel(R) Xeon(R) Platinum 8480+|-"


def test_real_host_sample_does_not_crash() -> None:
    s = PerfSampler("default", Path("/"), cluster="c", node="n")
    s.sample()
    PerfSample.from_json_bytes(s.sample().to_json_bytes())
    s.shutdown()


async def test_live_agent_publishes_samples_to_the_perf_stream(nats_server, nc, tmp_path: Path, unique) -> None:
    from agents.runner import run_agent
    from fleetmend.config import load_settings
    from fleetmend.infra.jetstream import ensure_perf_stream
    from fleetmend.subjects import PERF_STREAM, perf_subject

    js = nc.jetstream()
    await ensure_perf_stream(js)
    port = ib_port(tmp_path, "mlx5_0", 1, "4: ACTIVE", "5: LinkUp", "400 Gb/sec (4X NDR)")
    ib_counters(port)
    host_tree(tmp_path)
    node = f"perf-{unique}"
    s = load_settings(None, cluster="c1", node=node, nats_url=nats_server.url, state_dir=tmp_path / "state",
                      agent={"perf_interval_s": 0.3, "sysfs_root": str(tmp_path), "nvml_enabled": False})
    stop = asyncio.Event()
    task = asyncio.create_task(run_agent(s, stop=stop, probes=[], hardware=True))
    subject = perf_subject("c1", node)
    sub = await js.subscribe(subject, stream=PERF_STREAM, ordered_consumer=True)
    try:
        msg = await sub.next_msg(timeout=15)
        sample = PerfSample.from_json_bytes(msg.data)
        assert (sample.cluster, sample.node) == ("c1", node)
        assert sample.ports[0].name == "mlx5_0/1" and sample.host.cpus == 4
        assert 0.2 < sample.interval_s < 5
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 30) == 0
        await sub.unsubscribe()


def test_ports_get_a_role_compute_rails_and_a_storage_hca(tmp_path: Path) -> None:
    """Issue 28: NICs are compared by role. The HCAs of the node's most common model are the
    compute rails, another model is storage; a compute port at half rate no longer hides behind a
    slower storage port (the analyzer's `port_rate_gbps` reads compute ports only)."""
    from fleetmend.analyzer.metrics import derive

    for hca, model, rate in (("mlx5_0", "MT4129", "200 Gb/sec (4X HDR)"), ("mlx5_1", "MT4129", "400 Gb/sec (4X NDR)"),
                             ("mlx5_2", "MT4125", "100 Gb/sec (4X EDR)")):
        ib_counters(ib_port(tmp_path, hca, 1, "4: ACTIVE", "5: LinkUp", rate))
        w(tmp_path / f"sys/class/infiniband/{hca}/hca_type", model)
    host_tree(tmp_path)
    nv = perf_standin([PerfGpu(0)])
    nv.nvmlDeviceGetVbiosVersion.return_value = "96.00.89.00.01"  # the version findings' fingerprint
    smp = PerfSampler(nv, tmp_path, cluster="c1", node="n1", interval_s=60).sample(now_mono=1.0)
    assert smp.hw.vbios == "96.00.89.00.01" and "96.00" not in smp.hw.key  # a firmware rollout does not split the class
    assert {p.name: p.role for p in smp.ports if p.kind == "ib"} == {
        "mlx5_0/1": "compute", "mlx5_1/1": "compute", "mlx5_2/1": "storage"}
    _, d = derive(smp)
    assert d["port_rate_gbps"] == (200.0, "port:mlx5_0/1")  # the slow rail, not the 100 Gb/s storage port
    assert d["storage_port_rate_gbps"] == (100.0, "port:mlx5_2/1")
    solo = tmp_path / "solo"
    ib_counters(ib_port(solo, "mlx5_0", 1, "4: ACTIVE", "5: LinkUp", "400 Gb/sec (4X NDR)"))
    w(solo / "sys/class/infiniband/mlx5_0/hca_type", "MT4129")
    host_tree(solo)
    one = PerfSampler(perf_standin([PerfGpu(0)]), solo, cluster="c1", node="n1", interval_s=60).sample(now_mono=1.0)
    assert [p.role for p in one.ports if p.kind == "ib"] == ["compute"]
