"""What the analyzer judges: per-node scalar metrics derived from a `PerfSample`, each with the
direction that is bad, whether it depends on load, and the floors below which a gap to the peer
median is never called an outlier (whatever the MAD says: a group whose healthy nodes all read
exactly 0 has a MAD of 0).

A node's metric is its worst device (the slowest GPU, the noisiest port): one bad GPU slows the
whole synchronous job. Rates are per minute of the sample's interval.

| metric | bad | load | floor | why the floor |
|---|---|---|---|---|
| sm_clock_ratio | low | busy | `analyzer.min_ratio_sm_clock` (3 %) relative | healthy boost clocks of one model spread ~1 % |
| power_brake_frac | high | any | 0.05 of the interval | an external power-brake signal is never normal |
| hw_slowdown_frac | high | any | 0.05 | HW slowdown (power/thermal emergency) is never normal |
| thermal_frac | high | busy | 0.05 | a busy GPU may briefly touch its thermal limit |
| power_cap_frac | high | busy | 0.15 | heavy kernels sit at the software power cap by design |
| temperature_c | high | busy | 8 °C | inlet and position spread a few °C across a rack |
| pcie_width_ratio | low | any | 0.2 | x16 → x8 is 0.5; widths are discrete |
| pcie_gen_ratio | low | busy | 0.2 | an idle GPU drops to Gen1 on purpose |
| pcie_replay_per_min | high | any | 5 /min | a few replays a minute is link noise |
| nvlink_errors_per_min | high | any | 10 /min | CRC/replay are retried in hardware; a rate matters |
| nvlink_down | high | any | 0.5 links | a missing link is already a fault (nvlink_down) |
| ecc_corrected_per_min | high | any | 1 /min | single-bit errors are corrected; a rate predicts trouble |
| ib_symbol_errors_per_min | high | any | 1 /min | physical-layer errors, BER well below 1e-12 when healthy |
| ib_link_recovery_per_min | high | any | 0.2 /min | link retrains stall every job on the port |
| ib_rcv_errors_per_min | high | any | 1 /min | malformed packets received |
| ib_xmit_wait_per_min | high | busy | 2× median and 1e6 ticks/min | congestion spreads widely; only a big gap counts |
| port_rate_gbps | low | any | 0.2 relative | a port trained at half rate |
| cpu_throttle_per_min | high | any | 1 /min | thermal throttling of a healthy CPU is rare |
| cpu_freq_ratio | low | busy | 0.1 relative | idle cores clock down on purpose |
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median

from fleetmend.events import Component, Device
from fleetmend.telemetry import PerfSample


@dataclass(frozen=True)
class MetricSpec:
    """How one metric is judged.

    name: stable metric name (evidence `metric`); bad: "low" or "high"; busy_only: judged only on
    busy samples compared with busy peers; min_rel: smallest gap relative to the peer median;
    min_abs: smallest absolute gap; component: `Component` of the fail_slow event; label: readable.
    """

    name: str
    bad: str
    busy_only: bool
    min_rel: float
    min_abs: float
    component: Component
    label: str


def _specs(min_ratio_sm_clock: float = 0.03) -> dict[str, MetricSpec]:
    S = MetricSpec
    rows = [
        S("sm_clock_ratio", "low", True, min_ratio_sm_clock, 0.0, Component.GPU, "SM clock / max"),
        S("power_brake_frac", "high", False, 0.0, 0.05, Component.GPU, "time in HW power brake"),
        S("hw_slowdown_frac", "high", False, 0.0, 0.05, Component.GPU, "time in HW slowdown"),
        S("thermal_frac", "high", True, 0.0, 0.05, Component.GPU, "time in thermal slowdown"),
        S("power_cap_frac", "high", True, 0.0, 0.15, Component.GPU, "time at the SW power cap"),
        S("temperature_c", "high", True, 0.0, 8.0, Component.GPU, "GPU temperature °C"),
        S("pcie_width_ratio", "low", False, 0.0, 0.2, Component.PCIE, "PCIe width / max"),
        S("pcie_gen_ratio", "low", True, 0.0, 0.2, Component.PCIE, "PCIe generation / max"),
        S("pcie_replay_per_min", "high", False, 0.0, 5.0, Component.PCIE, "PCIe replays /min"),
        S("nvlink_errors_per_min", "high", False, 0.0, 10.0, Component.NVLINK, "NVLink CRC/replay/recovery /min"),
        S("nvlink_down", "high", False, 0.0, 0.5, Component.NVLINK, "NVLinks down"),
        S("ecc_corrected_per_min", "high", False, 0.0, 1.0, Component.GPU, "corrected ECC errors /min"),
        S("ib_symbol_errors_per_min", "high", False, 0.0, 1.0, Component.IB, "IB symbol errors /min"),
        S("ib_link_recovery_per_min", "high", False, 0.0, 0.2, Component.IB, "IB link recoveries+downs /min"),
        S("ib_rcv_errors_per_min", "high", False, 0.0, 1.0, Component.IB, "IB receive errors /min"),
        S("ib_xmit_wait_per_min", "high", True, 1.0, 1e6, Component.IB, "IB port_xmit_wait ticks /min"),
        S("port_rate_gbps", "low", False, 0.2, 0.0, Component.IB, "port rate Gb/s"),
        S("cpu_throttle_per_min", "high", False, 0.0, 1.0, Component.CPU, "CPU thermal throttles /min"),
        S("cpu_freq_ratio", "low", True, 0.1, 0.0, Component.CPU, "CPU frequency / nominal"),
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
            if busy and p.xmit_wait_delta is not None:
                add("ib_xmit_wait", p.xmit_wait_delta * per_min, w)
            if p.rate_gbps:
                add("port_rate_gbps", p.rate_gbps, w)
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
