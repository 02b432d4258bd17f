"""Simulated fleet telemetry: noisy healthy nodes and a few degraded ones, for `fleetmend sim --perf`
and bench/failslow.py.

Healthy nodes (8 GPUs of one model, one NDR HCA) follow what peers of one hardware class look like:

- jobs: nodes are grouped into jobs of `job_nodes` consecutive nodes; a job's nodes are busy (GPUs
  ~95 % utilized) or idle (~0 %) together, switching on average every 90 min, about 85 % of the
  time busy; each busy spell is a new job id (`job_of`) of one workload kind, drawn from `workloads`:
  `compute` (the default; time at the SW power cap 10-50 % per job, as heavy kernels do),
  `compute-light` (power cap 5-30 %), `memory` (lower power: no power cap, GPUs 6 °C cooler, full
  boost clocks) or `comm` (communication-bound: ~10x the IB `port_xmit_wait`, no power cap);
  `("compute-light", "memory", "comm")` is the mixed fleet of issue 28, where comparing all busy
  nodes with each other flags most healthy ones;
- SM clock of a busy GPU: a per-GPU constant (silicon and cooling spread, σ 0.5 % of max) plus
  per-sample noise (σ 0.4 %), and 1 % of samples dip to ~85 % for that minute (a transient power
  excursion), compute-bound jobs clock 1.5 % lower; idle GPUs sit at their idle clocks;
- clocks-event reasons: 0 most of the time; 0.2 % of samples show a burst of power brake (5-30 % of
  the minute), 1 % a short thermal slowdown on busy GPUs; time at the SW power cap depends on the job
  (per job, ±3 % per node, ±5 % per sample);
- IB `port_xmit_wait` of a busy node: ~2e5 ticks/min (comm jobs ~2.5e6), ±25 % per node, ±10 % per sample;
- temperature: per GPU 55-68 °C busy, 30-38 °C idle, ±1.5 °C noise;
- IB: symbol errors 0 with the odd single count (1 % of samples), PCIe replays likewise (2 %).

Degraded nodes (`slow_nodes`, slowed by `slowdown` F, default 0.05) take one pattern each, in turn:

    clocks        one GPU's SM clock (1 − F) lower
    power_brake   one GPU in HW power brake 2F of the time (clocks halve while braked: F slower)
    pcie          one GPU's PCIe link trained at x8 of x16
    ib            the HCA port's symbol errors rising (5 /min plus 2 /min per hour)
    thermal       one GPU's cooling failed: +12 °C, thermal slowdown 2F of the time, clocks F lower

Everything is drawn from one seeded `random.Random` per node (and one per job), so a run is
reproducible. `run_perf_sim` also publishes, for every busy node, one step time per interval on its
job's subject (`fleetmend.jobs` wire format; a node reports its own rank only), so the analyzer knows
which nodes share a job.
`sample()` builds the `PerfSample` an agent would publish; `derived()` returns the analyzer's
metrics for the same draw without building the sample (the benchmark's fast path).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from fleetmend import subjects
from fleetmend.analyzer.metrics import Derived
from fleetmend.infra.connect import close_nats, connect_nats
from fleetmend.infra.jetstream import ensure_perf_stream
from fleetmend.telemetry import GpuPerf, HardwareClass, HostPerf, PerfSample, PortPerf

_MASK = (1 << 16) - 1
_TABLE_RNG = random.Random(20240601)
_NORM = [_TABLE_RNG.gauss(0.0, 1.0) for _ in range(1 << 16)] + [0.0] * 64
"""N(0, 1) table the noise is read from (64 spare entries so an offset near the end stays in range)."""
PATTERNS = ("clocks", "power_brake", "pcie", "ib", "thermal")
WORKLOADS = ("compute", "compute-light", "memory", "comm")
MIXED = ("compute-light", "memory", "comm")
GPUS = 8
SM_MAX = 1980.0
HW = HardwareClass(gpu_model="NVIDIA H200", gpu_count=GPUS, driver="570.124.06", hca_model="MT4129",
                   cpu_model="Intel(R) Xeon(R) Platinum 8480+")


@dataclass
class _Job:
    idx: int
    rng: random.Random
    busy: bool
    kind: str = "compute"
    power_cap: float = 0.0
    t: float = float("-inf")
    """Time of the last state update (the first node drawn at a new time updates its job)."""
    spell: int = 0
    """Busy spells so far: each is a new job id."""


@dataclass
class _Node:
    name: str
    rng: random.Random
    gpu_base: list[float]
    gpu_temp: list[float]
    job: _Job
    rank: int
    cap_offset: float
    wait_base: float
    pattern: str | None = None
    sym_total: int = 0

    @property
    def busy(self) -> bool:
        return self.job.busy


@dataclass
class PerfFleet:
    """A simulated fleet.

    Args:
        nodes: fleet size.
        slow_nodes: how many are degraded (the first pattern goes to a random node, and so on).
        slowdown: F, the fraction the degraded nodes lose (0 < F < 0.5).
        seed: reproducibility.
        cluster, node_prefix: names (`<prefix>-00042`).
        slow_from: epoch seconds when the degradation starts (None: from the start).
        busy_fraction: long-run share of busy nodes.
        job_nodes: nodes per job (consecutive names; the last job may be smaller).
        workloads: the kinds a job's busy spell is drawn from (`WORKLOADS`; `MIXED`).
    """

    nodes: int
    slow_nodes: int = 0
    slowdown: float = 0.05
    seed: int = 1
    cluster: str = "sim"
    node_prefix: str = "sim"
    slow_from: float | None = None
    busy_fraction: float = 0.85
    job_minutes: float = 90.0
    job_nodes: int = 16
    workloads: tuple[str, ...] = ("compute",)
    fleet: list[_Node] = field(default_factory=list, init=False)
    jobs: list[_Job] = field(default_factory=list, init=False)
    slow: dict[str, str] = field(default_factory=dict, init=False)
    """node name → pattern."""

    def __post_init__(self) -> None:
        if not 0 <= self.slow_nodes <= self.nodes:
            raise ValueError(f"slow_nodes must be within 0..{self.nodes}, got {self.slow_nodes}")
        if not 0 < self.slowdown < 0.5:
            raise ValueError(f"slowdown must be within (0, 0.5), got {self.slowdown}")
        if self.job_nodes < 1:
            raise ValueError(f"job_nodes must be >= 1, got {self.job_nodes}")
        bad = [w for w in self.workloads if w not in WORKLOADS]
        if bad or not self.workloads:
            raise ValueError(f"workloads must be among {WORKLOADS}, got {self.workloads}")
        master = random.Random(self.seed)
        for i in range(self.nodes):
            r = random.Random(master.getrandbits(64))
            if i % self.job_nodes == 0:
                jr = random.Random(r.getrandbits(64))
                job = _Job(idx=len(self.jobs), rng=jr, busy=jr.random() < self.busy_fraction)
                self._new_spell(job)
                self.jobs.append(job)
            self.fleet.append(_Node(
                name=f"{self.node_prefix}-{i:05d}", rng=r,
                gpu_base=[min(1.0, r.gauss(0.985, 0.005)) for _ in range(GPUS)],
                gpu_temp=[r.uniform(55, 68) for _ in range(GPUS)], job=self.jobs[-1], rank=i % self.job_nodes,
                cap_offset=r.uniform(-0.03, 0.03), wait_base=r.uniform(0.8, 1.25)))
        for k, idx in enumerate(master.sample(range(self.nodes), self.slow_nodes)):
            n = self.fleet[idx]
            n.pattern = PATTERNS[k % len(PATTERNS)]
            self.slow[n.name] = n.pattern

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.fleet]

    def _new_spell(self, job: _Job) -> None:
        r = job.rng
        job.spell += 1
        job.kind = self.workloads[int(r.random() * len(self.workloads))]
        job.power_cap = {"compute": r.uniform(0.1, 0.5), "compute-light": r.uniform(0.05, 0.3)}.get(job.kind, 0.0)

    def job_of(self, i: int) -> str | None:
        """The job id node `i` ran in its latest draw (`sample`/`derived`), None when idle."""
        n = self.fleet[i]
        if not n.job.busy:
            return None
        return f"{self.node_prefix}-j{n.job.idx}-{n.job.spell}"

    def step_seconds(self, i: int, t: float) -> float:
        """Node `i`'s step time at `t` (its latest draw): 1 s ±1 %, `slowdown` slower while a pattern
        that slows the GPU (clocks, power brake, thermal) is active."""
        n = self.fleet[i]
        slow = n.pattern in ("clocks", "power_brake", "thermal") and (self.slow_from is None or t >= self.slow_from)
        return (1 + self.slowdown if slow else 1.0) * (1 + 0.01 * _NORM[n.rng.getrandbits(16)])

    def _job_step(self, n: _Node, t: float, interval_s: float) -> None:
        """Advance `n`'s job to time `t` once (busy ↔ idle with p = interval / mean duration)."""
        job = n.job
        if t <= job.t:
            return
        job.t = t
        mean_busy = self.job_minutes * 60
        mean_idle = mean_busy * (1 - self.busy_fraction) / self.busy_fraction
        if job.rng.random() < interval_s / (mean_busy if job.busy else mean_idle):
            job.busy = not job.busy
            if job.busy:
                self._new_spell(job)

    def _draw(self, n: _Node, t: float, interval_s: float) -> dict:
        """One interval of node `n` ending at epoch `t`: per-GPU readings and port/host counters.

        Per GPU one uniform draw picks at most one rare event (power-brake burst 0.2 %, clock dip 1 %,
        thermal burst 1 %, PCIe replay 2 %); Gaussian noise comes from a fixed table of N(0, 1) values
        read from a random offset per sample (cheap enough for 10,000 nodes over simulated days)."""
        r = n.rng
        rand = r.random
        self._job_step(n, t, interval_s)
        kind = n.job.kind
        clock_off = -0.015 if kind in ("compute", "compute-light") else 0.0
        temp_off = -6.0 if kind == "memory" else 0.0
        power_cap = max(0.0, n.job.power_cap + n.cap_offset) if n.job.power_cap > 0 else 0.0
        slow = n.pattern if (n.pattern and (self.slow_from is None or t >= self.slow_from)) else None
        f = self.slowdown
        k = r.getrandbits(16)
        N = _NORM
        busy = n.busy
        gpus = []
        for i in range(GPUS):
            u = rand()
            brake = thermal = 0.0
            replay = 0
            j = (k + 4 * i) & _MASK
            if u < 0.002:
                brake = 0.05 + 0.25 * (u / 0.002)
            elif 0.032 <= u < 0.052:
                replay = 1
            if busy:
                util = min(100.0, 95 + 3 * N[j])
                ratio = n.gpu_base[i] + clock_off + 0.004 * N[j + 1]
                if 0.002 <= u < 0.012:
                    ratio = 0.8 + 0.1 * ((u - 0.002) / 0.01)
                elif 0.012 <= u < 0.022:
                    thermal = 0.02 + 0.18 * ((u - 0.012) / 0.01)
                temp = n.gpu_temp[i] + temp_off + 1.5 * N[j + 2]
                cap = min(1.0, max(0.0, power_cap + 0.05 * N[j + 3])) if power_cap > 0 else 0.0
            else:
                util = max(0.0, 1 + N[j])
                ratio = 345.0 / SM_MAX
                temp = n.gpu_temp[i] - 27 + 1.5 * N[j + 2]
                cap = 0.0
            width = 16
            if slow and i == 0:
                if slow == "clocks" and busy:
                    ratio *= 1 - f
                elif slow == "power_brake":
                    brake = min(1.0, max(brake, 2 * f + 0.02 * N[j + 3]))
                    if busy:
                        ratio *= 1 - f
                elif slow == "pcie":
                    width = 8
                elif slow == "thermal" and busy:
                    temp += 12
                    thermal = max(thermal, min(1.0, 2 * f + 0.02 * N[j + 1]))
                    ratio *= 1 - f
            gpus.append((util, ratio, brake, thermal, cap, temp, width, replay))
        sym = 1 if rand() < 0.01 else 0
        if slow == "ib":
            hours = 0.0 if self.slow_from is None else max(0.0, (t - self.slow_from) / 3600)
            sym = max(0, sym + int((5 + 2 * hours) * interval_s / 60 + N[(k + 40) & _MASK]))
        n.sym_total += sym
        wait = 0
        if busy:
            wait = int((2.5e6 if kind == "comm" else 2e5) * n.wait_base * (1 + 0.3 * N[(k + 41) & _MASK] / 3)
                       * interval_s / 60)
            wait = max(0, wait)
        return {"gpus": gpus, "sym": sym, "wait": wait}

    def sample(self, i: int, t: float, interval_s: float = 60.0) -> PerfSample:
        """Node `i`'s `PerfSample` for the interval ending at epoch `t`."""
        n = self.fleet[i]
        d = self._draw(n, t, interval_s)
        gpus = []
        for k, (util, ratio, brake, thermal, cap, temp, width, replay) in enumerate(d["gpus"]):
            gpus.append(GpuPerf(
                index=k, util_pct=round(util, 1), sm_clock_mhz=round(ratio * SM_MAX, 1), sm_clock_max_mhz=SM_MAX,
                event_frac={"power_brake": round(brake, 4), "hw_slowdown": 0.0, "hw_thermal": 0.0,
                            "sw_thermal": round(thermal, 4), "sw_power_cap": round(cap, 4)},
                power_w=round(700 * (0.9 if util > 50 else 0.12), 1), power_limit_w=700.0, temperature_c=round(temp, 1),
                pcie_gen=5 if util > 50 else 1, pcie_gen_max=5, pcie_width=width, pcie_width_max=16,
                pcie_replay_delta=replay, nvlink_up=18, nvlink_total=18, nvlink_crc_delta=0, nvlink_replay_delta=0,
                nvlink_recovery_delta=0, ecc_corrected_delta=0))
        port = PortPerf(name="mlx5_0/1", kind="ib", rate_gbps=400.0, width=4, symbol_error_delta=d["sym"],
                        link_downed_delta=0, link_error_recovery_delta=0, xmit_wait_delta=d["wait"], rcv_errors_delta=0)
        return PerfSample(cluster=self.cluster, node=n.name, at=datetime.fromtimestamp(t, timezone.utc),
                          interval_s=interval_s, hw=HW, gpus=gpus, ports=[port],
                          host=HostPerf(cpus=224, cpu_throttle_delta=0, cpu_freq_mhz=2000.0, cpu_freq_nominal_mhz=2000.0),
                          agent_version="sim")

    def derived(self, i: int, t: float, interval_s: float = 60.0, busy_util_pct: float = 50.0) -> Derived:
        """The analyzer's metrics (`metrics.derive`) of node `i`'s interval ending at `t`, computed from
        the same draw as `sample` without building the `PerfSample` (same numbers, ~20× faster)."""
        n = self.fleet[i]
        d = self._draw(n, t, interval_s)
        g = d["gpus"]
        per_min = 60.0 / interval_s
        utils = sorted(x[0] for x in g)
        busy = (utils[3] + utils[4]) / 2 >= busy_util_pct
        brake, wb = -1.0, 0
        width, ww = 99, 0
        replays = 0
        clk, kc = 9e9, -1
        th, kt = -1.0, 0
        cap, kp = -1.0, 0
        temp, kT = -1e9, 0
        for k, (util, ratio, br, thermal, cp, tp, wd, rp) in enumerate(g):
            if br > brake:
                brake, wb = br, k
            if wd < width:
                width, ww = wd, k
            replays += rp
            if busy and util >= busy_util_pct:
                c = round(ratio * SM_MAX, 1)
                if c < clk:
                    clk, kc = c, k
                if thermal > th:
                    th, kt = thermal, k
                if cp > cap:
                    cap, kp = cp, k
                if tp > temp:
                    temp, kT = tp, k
        out: Derived = {
            "power_brake_frac": (round(brake, 4), f"gpu:{wb}"),
            "hw_slowdown_frac": (0.0, "gpu:0"),
            "pcie_width_ratio": (width / 16, f"gpu:{ww}"),
            "pcie_replay_per_min": (replays * per_min, "gpu:0"),
            "nvlink_errors_per_min": (0.0, "gpu:0"),
            "nvlink_down": (0.0, "gpu:0"),
            "ecc_corrected_per_min": (0.0, "gpu:0"),
        }
        if busy:
            if kc >= 0:
                out["sm_clock_ratio"] = (clk / SM_MAX, f"gpu:{kc}")
                out["thermal_frac"] = (round(th, 4), f"gpu:{kt}")
                out["power_cap_frac"] = (round(cap, 4), f"gpu:{kp}")
                out["temperature_c"] = (round(temp, 1), f"gpu:{kT}")
                out["pcie_gen_ratio"] = (1.0, f"gpu:{kc}")
            out["ib_xmit_wait_per_min"] = (d["wait"] * per_min, "port:mlx5_0/1")
            out["cpu_freq_ratio"] = (1.0, "host")
        out["ib_symbol_errors_per_min"] = (d["sym"] * per_min, "port:mlx5_0/1")
        out["ib_link_recovery_per_min"] = (0.0, "port:mlx5_0/1")
        out["ib_rcv_errors_per_min"] = (0.0, "port:mlx5_0/1")
        out["port_rate_gbps"] = (400.0, "port:mlx5_0/1")
        out["cpu_throttle_per_min"] = (0.0, "host")
        return out


async def run_perf_sim(settings: Any, fleet: PerfFleet, duration_s: float, interval_s: float = 60.0,
                       stop: asyncio.Event | None = None) -> dict[str, int]:
    """Publish `fleet`'s samples to NATS (core publish on each node's perf subject, captured by the perf
    stream, as the agent does), every node once per `interval_s`, spread over the interval, for
    `duration_s` seconds (or until `stop`). Returns {"samples": n, "intervals": n}."""
    stop = stop or asyncio.Event()
    nc = await connect_nats(settings, name=f"fleetmend-perfsim-{fleet.cluster}")
    try:
        with contextlib.suppress(Exception):  # the analyzer or an operator may own the stream
            await ensure_perf_stream(nc.jetstream(timeout=5.0))
        sent = intervals = 0
        loop = asyncio.get_running_loop()
        t_end = loop.time() + duration_s
        batch = max(1, len(fleet.fleet) // max(1, int(interval_s * 10)))  # ~10 publishes bursts a second
        while not stop.is_set() and loop.time() < t_end:
            start = loop.time()
            for i in range(len(fleet.fleet)):
                now = time.time()
                s = fleet.sample(i, now, interval_s)
                await nc.publish(subjects.perf_subject(fleet.cluster, s.node), s.to_json_bytes())
                job = fleet.job_of(i)
                if job is not None:  # the node's own rank only, as a job's ranks report for themselves
                    row = [fleet.fleet[i].rank, s.node, int(now // interval_s), fleet.step_seconds(i, now), now]
                    await nc.publish(subjects.job_subject(fleet.cluster, s.node, job),
                                     json.dumps({"v": 1, "cluster": fleet.cluster, "job": job, "steps": [row]}).encode())
                sent += 1
                if (i + 1) % batch == 0:
                    delay = start + interval_s * (i + 1) / len(fleet.fleet) - loop.time()
                    if delay > 0:
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(delay):
                                await stop.wait()
                    if stop.is_set() or loop.time() >= t_end:
                        break
            intervals += 1
            left = start + interval_s - loop.time()
            if left > 0 and not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(left, max(0.0, t_end - loop.time()))):
                        await stop.wait()
        await nc.flush()
        return {"samples": sent, "intervals": intervals}
    finally:
        await close_nats(nc)
