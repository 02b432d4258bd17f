"""What the analyzer judges: per-node scalar metrics derived from a `PerfSample`, each with the
direction that is bad, whether it depends on load, **whether it depends on the work the node runs**,
the values it can physically take, and the floors below which a gap to the peer median is never
called an outlier (whatever the MAD says: a group whose healthy nodes all read exactly 0 has a MAD of 0).

A node's metric is its worst device (the slowest GPU, the noisiest port): one bad GPU slows the
whole synchronous job. Rates are per minute of the sample's interval.

**Like with like** (`MetricSpec.work_dependent`). A *work-dependent* metric (`work` below) reads
what the job asks of the hardware as much as the hardware itself: a compute-bound job sits at the
software power cap and runs hot at lower boost clocks, a communication-bound job fills the IB
port's send queue, an idle node does neither. Such a metric is compared only among the nodes of one
job (the nodes that reported that job's step times in the window, `fleetmend.jobs`) of one
hardware class; a node whose job is unknown (no step times, or several jobs in one window) is not
judged on it at all. A *hardware-own* metric (`hw`) reads a property or an error rate that healthy
hardware keeps whatever it runs (a link's trained width against its maximum, links down, error
counters, external power brake, HW slowdown, thermal slowdown of a busy GPU) and is judged across
the hardware class, as before.

| metric | bad | load | kind | floor | why this kind / why the floor |
|---|---|---|---|---|---|
| sm_clock_ratio | low | busy | work | `min_ratio_sm_clock` (3 %) rel. | clocks follow the power the kernels draw / ~1 % spread |
| sm_clock_free_ratio | low | busy | hw | `min_ratio_sm_clock` (3 %) rel. | no clocks-event reason: as high as Boost goes / ~1 % |
| power_brake_frac | high | any | hw | 0.05 of the interval | an external brake signal; no job asks for it / never normal |
| hw_slowdown_frac | high | any | hw | 0.05 | a power/thermal emergency under any work / never normal |
| thermal_frac | high | busy | hw | 0.05 | healthy cooling holds any job off it / brief touches happen |
| power_cap_frac | high | busy | work | 0.15 | heavy kernels sit at the SW power cap by design: it measures the job |
| temperature_c | high | busy | work | 8 °C | heat follows the power drawn / inlet and position spread a few °C |
| pcie_width_ratio | low | any | hw | 0.2 | the trained width against max ignores traffic / x16 → x8 is 0.5 |
| pcie_gen_ratio | low | busy | hw | 0.2 | a busy link runs at max gen under any work / idle drops to Gen1 |
| pcie_replay_per_min | high | any | hw | 5 /min | link errors, not load / a few a minute is link noise |
| nvlink_errors_per_min | high | any | hw | 10 /min | CRC/replay/recovery are link errors / retried in hardware |
| nvlink_down | high | any | hw | 0.5 links | links up against present ignores the job / already a fault |
| ecc_corrected_per_min | high | any | hw | 1 /min | memory errors, not load / a rate predicts trouble |
| ib_symbol_errors_per_min | high | any | hw | 1 /min | physical-layer errors / BER well below 1e-12 when healthy |
| ib_link_recovery_per_min | high | any | hw | 0.2 /min | retrains are no traffic pattern / they stall every job |
| ib_rcv_errors_per_min | high | any | hw | 1 /min | malformed packets are errors, not load |
| ib_xmit_wait_per_min | high | busy | work | 2× median, 1e6 /min | the job's traffic (comm-bound ~10×) / compute ports only |
| port_rate_gbps | low | any | hw | 0.2 relative | the trained rate ignores traffic / a port at half rate; compute ports only |
| storage_port_rate_gbps | low | any | hw | 0.2 relative | the same for storage ports (`PortPerf.role`) |
| cpu_throttle_per_min | high | any | hw | 1 /min | a healthy, cooled CPU rarely throttles under any load |
| cpu_freq_ratio | low | busy | work | 0.1 relative | turbo depends on the cores the job keeps busy / idle clocks down |

A group too small to compare (fewer than `min_group_size` nodes: a 5-node class, a lone new GPU
model) is still judged: a hardware-own metric with a fixed expectation (`MetricSpec.expected`: PCIe
at its maximum width and generation, no NVLink down, error counters and brake/slowdown shares at 0)
against that, with the floors; the port rate, which has none, against the node's own history (the
median of its first 3 windows). The analyzer lists such groups with how they were judged.

An error counter that comes in bursts (`MetricSpec.bursty`: replays, NVLink and IB errors, link
recoveries, corrected ECC, CPU throttles) is judged by how often it exceeds, not by its window
median nor by how high one burst goes. A sample *exceeds* when its rate is above the group's usual
level (the median of its nodes' window medians, 0 on healthy links) by the metric's floor; a node's
value is the share of its samples of its last 2 × `windows` windows that exceed
(`core.BURST_POOL_WINDOWS`), and it is an outlier when that share is at least `BURST_SHARE` (a
quarter) and above its peers' median share by more than chance allows: `mad_k` times the larger of
the shares' MAD (interpolated within one sample's step) and the binomial σ of the peers' share over
the node's samples. So symbol-error bursts in a third of the samples count against clean peers,
one burst in every window (6 of 30 samples at one sample a minute) does not, and a fleet whose
healthy nodes all burst a fifth of the time (10× noise: 8 GPUs' replays, 5 ports' symbol errors)
does not flag the nodes that happen to burst a third of the time. A bursty finding's `value` and
`peer_median` are shares of samples, `burst_over` the rate a sample had to exceed, and its `ratio`
is None (an error rate is no pace).

**Clocks without a reason** (`sm_clock_free_ratio`). NVML says why a GPU's clocks are held down
(`CLOCK_EVENT_REASONS`: SW power cap, SW/HW thermal, HW slowdown, power brake); with none active
the clocks are "as high as possible" (nvmlClocksEventReasonNone). So the SM clock of a busy GPU
(utilization ≥ `FREE_CLOCK_UTIL_PCT`) whose every reason was active for at most `FREE_REASON_MAX` of
the interval is the hardware's own, not the job's: a compute-bound job lowers its clocks by sitting
at the power cap, which is then a reason, and such a GPU's sample does not count. This one is
judged across the hardware class, so a GPU 5 % slow under load is found whatever job the node runs
(a job of 4 nodes, a job that reports no step times); `sm_clock_ratio` stays the job-group
comparison of all busy clocks. A reading without all five reasons (an old driver) gives no value.

A quantized metric (`MetricSpec.quantum`: SM clocks in 15 MHz steps, temperature in 1 °C) takes
its group's MAD as the interpolated median of the deviations (`core.quantized_mad`): with half the
peers one step off the median the plain MAD is a whole step and 6 MADs would be ~7 % of the clock,
hiding a 5 % slowdown; the interpolated one is about half a step, and never below a quarter step.

Every value also has a physical range (`MetricSpec.lo`..`hi`: fractions 0..1, ratios 0..1.1, rates
and counts ≥ 0, temperature −40..150 °C); the comparator drops a value outside it, or one that is
not finite, before any median sees it (counted by reason, `Comparator.dropped`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import median

from fleetmend.events import Component, Device
from fleetmend.telemetry import CLOCK_EVENT_REASONS, RATE_MAX_GBPS, TEMPERATURE_MAX_C, TEMPERATURE_MIN_C, PerfSample


@dataclass(frozen=True)
class MetricSpec:
    """How one metric is judged.

    name: stable metric name (evidence `metric`); bad: "low" or "high"; busy_only: judged only on
    busy samples compared with busy peers; min_rel: smallest gap relative to the peer median;
    min_abs: smallest absolute gap; component: `Component` of the fail_slow event; label: readable.
    work_dependent: the value depends on the work the node runs, so it is compared only among the
    nodes of one job (see module docstring); False: the hardware's own, judged across the class.
    why: one line, why it is work-dependent or the hardware's own (the table above).
    lo, hi: the physically possible values; anything outside (or not finite) is dropped.
    baseline_windows: > 0: each member is first measured against the group for this many judged
    windows, and from then on judged with that offset removed (a job's rank 0 slower by design is
    not slow; `Comparator`).
    quantum: the resolution of the value (below).
    """

    name: str
    bad: str
    busy_only: bool
    min_rel: float
    min_abs: float
    component: Component
    label: str
    work_dependent: bool = False
    why: str = ""
    lo: float = 0.0
    hi: float = math.inf
    baseline_windows: int = 0
    expected: float | None = None
    """The class's fixed expectation of healthy hardware (a link at max width: 1.0; no link down, no
    error, no brake: 0.0): a group too small to compare is judged against it, with the floors."""
    shared: bool = False
    """A failure domain can move it (a rack's cooling, a PDU, a leaf switch): outliers sharing a
    domain are one domain finding before any node is blamed (`shared`). False: a node's own (PCIe,
    NVLink, ECC)."""
    bursty: bool = False
    """An error counter that comes in bursts: judged by how often it exceeds (the share of a node's
    recent samples above the group's level by `min_abs`) against its peers' share, not by a window
    median (module docstring)."""
    quantum: float = 0.0
    """The metric's resolution in its own units (0: continuous): SM clocks move in 15 MHz steps, so
    `sm_clock_ratio` moves in steps of 15 MHz / ~2,000 MHz; temperatures in 1 °C. The group's MAD of a
    quantized metric is the grouped-data (interpolated) median of the deviations (`core.quantized_mad`),
    never 0 and never a whole step because half the peers sit one step off."""


WORK = True
HW_OWN = False
BURST_SHARE = 0.25
"""A bursty counter's node is an outlier only when at least this share of its pooled samples exceed
(with 5 samples a window, 8 of 30: one burst a window never counts; `core.Comparator`)."""


def judged_floors(spec: MetricSpec) -> tuple[float, float]:
    """(min_rel, min_abs) in the units a judgement of `spec` is in: a bursty counter is judged on the
    share of samples that exceed (`BURST_SHARE` absolute), every other metric on its own value."""
    return (0.0, BURST_SHARE) if spec.bursty else (spec.min_rel, spec.min_abs)


SM_CLOCK_STEP_MHZ = 15.0
"""NVIDIA GPUs set SM clocks in 15 MHz steps (NVML `nvmlDeviceGetSupportedGraphicsClocks`)."""
FREE_CLOCK_UTIL_PCT = 80.0
"""A GPU's clock counts toward `sm_clock_free_ratio` only at this utilization or more (clocks ramp down
in the idle gaps of a lightly loaded GPU, NVML's GpuIdle reason, which the agent does not record)."""
FREE_REASON_MAX = 0.01
"""Each clocks-event reason active for at most this share of the interval: the clocks were free."""
SM_CLOCK_MAX_TYPICAL_MHZ = 1980.0
"""H100/H200 SXM maximum SM clock: one clock step is 0.76 % of it (1.06 % on an A100 at 1,410 MHz,
where the interpolated MAD is a little pessimistic, never a whole step)."""


def _specs(min_ratio_sm_clock: float = 0.03) -> dict[str, MetricSpec]:
    S = MetricSpec
    G, P, N, IB, C = Component.GPU, Component.PCIE, Component.NVLINK, Component.IB, Component.CPU
    rows = [
        S("sm_clock_ratio", "low", True, min_ratio_sm_clock, 0.0, G, "SM clock / max", WORK,
          "boost clocks under load follow the power the job's kernels draw", hi=1.1,
          quantum=SM_CLOCK_STEP_MHZ / SM_CLOCK_MAX_TYPICAL_MHZ, shared=True),
        S("sm_clock_free_ratio", "low", True, min_ratio_sm_clock, 0.0, G, "SM clock / max with no clocks-event reason",
          HW_OWN, "a busy GPU no clocks-event reason holds down runs as high as GPU Boost allows, whatever the job",
          hi=1.1, quantum=SM_CLOCK_STEP_MHZ / SM_CLOCK_MAX_TYPICAL_MHZ, shared=True),
        S("power_brake_frac", "high", False, 0.0, 0.05, G, "time in HW power brake", HW_OWN,
          "an external power-brake signal is never asked for by a job", hi=1.0, expected=0.0, shared=True),
        S("hw_slowdown_frac", "high", False, 0.0, 0.05, G, "time in HW slowdown", HW_OWN,
          "HW slowdown is a power/thermal emergency under any work", hi=1.0, expected=0.0, shared=True),
        S("thermal_frac", "high", True, 0.0, 0.05, G, "time in thermal slowdown", HW_OWN,
          "healthy cooling keeps a busy GPU out of thermal slowdown under any job", hi=1.0, expected=0.0, shared=True),
        S("power_cap_frac", "high", True, 0.0, 0.15, G, "time at the SW power cap", WORK,
          "heavy kernels sit at the software power cap by design: it measures the job", hi=1.0, shared=True),
        S("temperature_c", "high", True, 0.0, 8.0, G, "GPU temperature °C", WORK,
          "heat follows the power the job draws", lo=TEMPERATURE_MIN_C, hi=TEMPERATURE_MAX_C, quantum=1.0, shared=True),
        S("pcie_width_ratio", "low", False, 0.0, 0.2, P, "PCIe width / max", HW_OWN,
          "the width a link trained at does not depend on traffic", hi=1.0, expected=1.0),
        S("pcie_gen_ratio", "low", True, 0.0, 0.2, P, "PCIe generation / max", HW_OWN,
          "a busy GPU's link runs at its maximum generation under any work", hi=1.0, expected=1.0),
        S("pcie_replay_per_min", "high", False, 0.0, 5.0, P, "PCIe replays /min", HW_OWN,
          "replays are link errors, not load", bursty=True, expected=0.0),
        S("nvlink_errors_per_min", "high", False, 0.0, 10.0, N, "NVLink CRC/replay/recovery /min", HW_OWN,
          "CRC/replay/recovery are link errors, not load", bursty=True, expected=0.0),
        S("nvlink_down", "high", False, 0.0, 0.5, N, "NVLinks down", HW_OWN,
          "links up against links present does not depend on the job", expected=0.0),
        S("ecc_corrected_per_min", "high", False, 0.0, 1.0, G, "corrected ECC errors /min", HW_OWN,
          "memory errors, not load", bursty=True, expected=0.0),
        S("ib_symbol_errors_per_min", "high", False, 0.0, 1.0, IB, "IB symbol errors /min", HW_OWN,
          "physical-layer errors, not traffic", bursty=True, expected=0.0, shared=True),
        S("ib_link_recovery_per_min", "high", False, 0.0, 0.2, IB, "IB link recoveries+downs /min", HW_OWN,
          "link retrains are no traffic pattern", bursty=True, expected=0.0, shared=True),
        S("ib_rcv_errors_per_min", "high", False, 0.0, 1.0, IB, "IB receive errors /min", HW_OWN,
          "malformed packets are errors, not load", bursty=True, expected=0.0, shared=True),
        S("ib_xmit_wait_per_min", "high", True, 1.0, 1e6, IB, "IB port_xmit_wait ticks /min", WORK,
          "congestion ticks follow the job's traffic (a communication-bound job waits ~10x more)", shared=True),
        S("port_rate_gbps", "low", False, 0.2, 0.0, IB, "port rate Gb/s", HW_OWN,
          "the rate a port trained at does not depend on traffic", hi=RATE_MAX_GBPS, shared=True),
        S("storage_port_rate_gbps", "low", False, 0.2, 0.0, IB, "storage port rate Gb/s", HW_OWN,
          "the rate a storage port trained at does not depend on traffic", hi=RATE_MAX_GBPS, shared=True),
        S("cpu_throttle_per_min", "high", False, 0.0, 1.0, C, "CPU thermal throttles /min", HW_OWN,
          "a healthy, cooled CPU rarely throttles under any load", bursty=True, expected=0.0, shared=True),
        S("cpu_freq_ratio", "low", True, 0.1, 0.0, C, "CPU frequency / nominal", WORK,
          "turbo frequency depends on how many cores the job keeps busy", hi=4.0, shared=True),
    ]
    return {r.name: r for r in rows}


SPECS = _specs()


def specs_for(min_ratio_sm_clock: float) -> dict[str, MetricSpec]:
    """The metric table with the configured SM-clock floor."""
    return _specs(min_ratio_sm_clock)


Derived = dict[str, tuple[float, str]]
"""metric name → (value, where): where is `gpu:<index>`, `port:<name>` or `host`."""


def is_busy(sample: PerfSample, busy_util_pct: float) -> bool:
    """Median GPU utilization ≥ `busy_util_pct`. A node without GPUs (or without readings) is not busy."""
    utils = [g.util_pct for g in sample.gpus if g.util_pct is not None]
    return bool(utils) and median(utils) >= busy_util_pct


def _worst(items: list[tuple[float, str]], bad: str) -> tuple[float, str] | None:
    if not items:
        return None
    return min(items) if bad == "low" else max(items)


def _sum(items: list[tuple[float, str]]) -> tuple[float, str] | None:
    if not items:
        return None
    worst = max(items)
    return sum(v for v, _ in items), worst[1]


def derive(sample: PerfSample, busy_util_pct: float = 50.0) -> tuple[bool, Derived]:
    """(busy, metrics) of one sample. Load-dependent metrics are only derived on busy samples, and
    only from the busy GPUs of them. Unknown readings give no metric (never a zero)."""
    busy = is_busy(sample, busy_util_pct)
    per_min = 60.0 / sample.interval_s
    out: Derived = {}
    acc: dict[str, list[tuple[float, str]]] = {}

    def add(name: str, value: float | None, where: str) -> None:
        if value is not None:
            acc.setdefault(name, []).append((float(value), where))

    for g in sample.gpus:
        w = f"gpu:{g.index}"
        gbusy = busy and g.util_pct is not None and g.util_pct >= busy_util_pct
        ef = g.event_frac
        add("power_brake_frac", ef.get("power_brake"), w)
        add("hw_slowdown_frac", ef.get("hw_slowdown"), w)
        if g.pcie_width and g.pcie_width_max:
            add("pcie_width_ratio", g.pcie_width / g.pcie_width_max, w)
        if g.pcie_replay_delta is not None:
            add("pcie_replay_per_min", g.pcie_replay_delta * per_min, w)
        nv = [d for d in (g.nvlink_crc_delta, g.nvlink_replay_delta, g.nvlink_recovery_delta) if d is not None]
        if nv:
            add("nvlink_errors_per_min", sum(nv) * per_min, w)
        if g.nvlink_total:
            add("nvlink_down", (g.nvlink_total - (g.nvlink_up or 0)), w)
        if g.ecc_corrected_delta is not None:
            add("ecc_corrected_per_min", g.ecc_corrected_delta * per_min, w)
        if gbusy:
            if g.sm_clock_mhz is not None and g.sm_clock_max_mhz:
                add("sm_clock_ratio", g.sm_clock_mhz / g.sm_clock_max_mhz, w)
                if (g.util_pct >= FREE_CLOCK_UTIL_PCT and len(ef) >= len(CLOCK_EVENT_REASONS)  # type: ignore[operator]
                        and all(ef.get(k, 1.0) <= FREE_REASON_MAX for k in CLOCK_EVENT_REASONS)):
                    add("sm_clock_free_ratio", g.sm_clock_mhz / g.sm_clock_max_mhz, w)
            th = [ef[k] for k in ("hw_thermal", "sw_thermal") if k in ef]
            if th:
                add("thermal_frac", max(th), w)
            add("power_cap_frac", ef.get("sw_power_cap"), w)
            add("temperature_c", g.temperature_c, w)
            if g.pcie_gen and g.pcie_gen_max:
                add("pcie_gen_ratio", g.pcie_gen / g.pcie_gen_max, w)
    for p in sample.ports:
        w = f"port:{p.name}"
        if p.kind == "ib":
            if p.symbol_error_delta is not None:
                add("ib_symbol_errors", p.symbol_error_delta * per_min, w)
            rec = [d for d in (p.link_error_recovery_delta, p.link_downed_delta) if d is not None]
            if rec:
                add("ib_link_recovery", sum(rec) * per_min, w)
            if p.rcv_errors_delta is not None:
                add("ib_rcv_errors", p.rcv_errors_delta * per_min, w)
            if busy and p.xmit_wait_delta is not None and p.role != "storage":
                # a storage port waits on the node's own I/O (the rank that writes the checkpoint),
                # not on the job's traffic its peers share: compute ports only (role with role)
                add("ib_xmit_wait", p.xmit_wait_delta * per_min, w)
            if p.rate_gbps:
                add("storage_port_rate_gbps" if p.role == "storage" else "port_rate_gbps", p.rate_gbps, w)
    for name in ("ib_symbol_errors", "ib_link_recovery", "ib_rcv_errors", "ib_xmit_wait"):
        if name in acc:
            s = _sum(acc.pop(name))
            if s is not None:
                out[f"{name}_per_min"] = s
    for name, items in acc.items():
        spec = SPECS[name]
        if name in ("pcie_replay_per_min", "nvlink_errors_per_min", "ecc_corrected_per_min", "nvlink_down"):
            v = _sum(items)
        else:
            v = _worst(items, spec.bad)
        if v is not None:
            out[name] = v
    h = sample.host
    if h.cpu_throttle_delta is not None:
        out["cpu_throttle_per_min"] = (h.cpu_throttle_delta * per_min, "host")
    if busy and h.cpu_freq_mhz and h.cpu_freq_nominal_mhz:
        out["cpu_freq_ratio"] = (h.cpu_freq_mhz / h.cpu_freq_nominal_mhz, "host")
    return busy, out


def device_of(where: str) -> Device:
    """`gpu:3` → Device(index=3); `port:mlx5_0/1` → Device(name="mlx5_0", port=1); `port:eth0` →
    Device(name="eth0"); `host`/other → Device(name=where)."""
    kind, _, rest = where.partition(":")
    if kind == "gpu" and rest.isdigit():
        return Device(index=int(rest))
    if kind == "port":
        name, _, port = rest.partition("/")
        return Device(name=name, port=int(port)) if port.isdigit() else Device(name=name)
    return Device(name=where)
