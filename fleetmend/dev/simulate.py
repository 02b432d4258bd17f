"""Fleet simulator: N virtual nodes on one machine, through the agent's real publishing path.

Each virtual node sends heartbeats (core NATS, `fleet.<cluster>.hb.<node>`) and, at a seeded
random rate, fault lines drawn from a published failure mix. A fault line is real kernel-log text
that goes through the agent's own `KmsgParser` and `Publisher` (same subjects, schema, Nats-Msg-Id
dedupe, spool while NATS is away); a node's publisher is created when it first faults.

Failure mix (default): Llama 3 paper (Dubey et al. 2024, "The Llama 3 Herd of Models", Table 5):
419 unexpected interruptions in 54 days of pre-training on 16,384 H100 GPUs (2,048 nodes of 8),
i.e. 419 / 54 / 2,048 ≈ 0.0038 interruptions per node-day. Categories with no kernel-log signal
(host maintenance, NCCL watchdog, silent data corruption, dependency…) are counted but emit no
event: no node agent sees them, and saying otherwise would flatter the simulation.

Use `accelerate` to compress time (a 10,000-node fleet sees ~38 interruptions a day at the real
rate) or `fault_rate_per_s` to set the fleet-wide rate directly.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import structlog

from agents.kmsg import KmsgParser
from agents.publisher import Publisher
from agents.spool import Spool
from fleetmend import __version__, subjects
from fleetmend.catalog import Catalog, default_catalog
from fleetmend.config import Settings
from fleetmend.events import utcnow
from fleetmend.infra.connect import close_nats, connect_nats
from fleetmend.infra.jetstream import ensure_fault_stream

log = structlog.get_logger("fleetmend.sim")

LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54
LLAMA3_NODES = 16_384 // 8
LLAMA3_RATE_PER_NODE_DAY = LLAMA3_INTERRUPTIONS / LLAMA3_DAYS / LLAMA3_NODES
"""≈ 0.00379 interruptions per node per day (Llama 3 paper, Table 5 and §3.3.4)."""


def _bdf(rng: random.Random) -> str:
    return f"0000:{rng.choice(['18', '2a', '3a', '5d', '9a', 'ab', 'ba', 'db'])}:00"


LineMaker = Callable[[random.Random], str]

FAILURE_MIX: list[tuple[str, int, LineMaker | None]] = [
    # (category, interruptions in the paper's table, kernel-log line an agent would see)
    ("faulty_gpu", 148, lambda r: f"NVRM: Xid (PCI:{_bdf(r)}): 79, pid='<unknown>', name=<unknown>, "
                                  "GPU has fallen off the bus."),
    ("gpu_hbm3", 72, lambda r: f"NVRM: Xid (PCI:{_bdf(r)}): 48, pid={r.randint(1000, 99999)}, name=python, "
                               "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer "
                               f"at physAddr 0x{r.getrandbits(36):x} partition 3, subpartition 0."),
    ("software_bug", 54, lambda r: f"NVRM: Xid (PCI:{_bdf(r)}): 13, pid={r.randint(1000, 99999)}, name=python, "
                                   "Graphics SM Warp Exception on (GPC 1, TPC 2, SM 0): Out Of Range Address"),
    ("network_switch_cable", 35, lambda r: f"mlx5_core 0000:{r.choice(['0c', '1a', '4b', '8d'])}:00.0 mlx5_"
                                           f"{r.randint(0, 7)}: Port: 1 Link DOWN"),
    ("host_maintenance", 32, None),
    ("gpu_sram", 19, lambda r: f"NVRM: Xid (PCI:{_bdf(r)}): 95, pid={r.randint(1000, 99999)}, "
                               "Uncontained: LTC TAG (0x2, 0x1). RST: Yes, D-RST: No"),
    ("gpu_system_processor", 17, lambda r: f"NVRM: Xid (PCI:{_bdf(r)}): 119, pid={r.randint(1000, 99999)}, "
                                           "name=python, Timeout after 6s of waiting for RPC response from GPU0 GSP! "
                                           "Expected function 76 (GSP_RM_CONTROL) (0x20802a02 0x8)."),
    ("nic", 7, lambda r: f"ixgbe 0000:{r.choice(['0c', '1a'])}:00.0 eth{r.randint(0, 3)}: NIC Link is Down"),
    ("nccl_watchdog", 7, None),
    ("silent_data_corruption", 6, None),
    ("gpu_thermal", 6, None),
    ("ssd", 3, lambda r: f"nvme nvme{r.randint(0, 3)}: I/O {r.randint(1, 999)} QID {r.randint(1, 8)} timeout, "
                         "reset controller"),
    ("power_supply", 3, None),
    ("server_chassis", 2, None),
    ("io_expansion_board", 2, None),
    ("dependency", 2, None),
    ("cpu", 2, lambda r: "mce: [Hardware Error]: CPU 3: Machine Check Exception: 5 Bank 6: b200000000070005"),
    ("system_memory", 2, lambda r: "EDAC MC0: 1 UE memory read error on CPU_SrcID#0_MC#0_Chan#1_DIMM#0 "
                                   "(channel:1 slot:0 page:0x1a2b3c offset:0x0 grain:32)"),
]


@dataclass
class SimConfig:
    nodes: int = 100
    cluster: str = "sim"
    node_prefix: str = "sim"
    duration_s: float = 60.0
    seed: int = 1
    accelerate: float = 1.0
    """Multiply the published per-node rate by this (1 = real time)."""
    fault_rate_per_s: float | None = None
    """Fleet-wide fault lines per second; overrides the published rate × accelerate."""
    heartbeat_interval_s: float = 10.0
    heartbeats: bool = True
    state_dir: Path | None = None


@dataclass
class SimReport:
    nodes: int
    duration_s: float
    heartbeats_sent: int = 0
    fault_lines: int = 0
    events_published: int = 0
    events_spooled: int = 0
    by_category: Counter = field(default_factory=Counter)
    silent_by_category: Counter = field(default_factory=Counter)
    emitted: list[tuple[str, str, float]] = field(default_factory=list)
    """(node, event_id, monotonic emit time) for latency benchmarks."""


def node_name(cfg: SimConfig, i: int) -> str:
    return f"{cfg.node_prefix}-{i:05d}"


def fleet_rate_per_s(cfg: SimConfig) -> float:
    if cfg.fault_rate_per_s is not None:
        return cfg.fault_rate_per_s
    return cfg.nodes * LLAMA3_RATE_PER_NODE_DAY * cfg.accelerate / 86_400.0


class FleetSim:
    """One simulator run: `start()` connects and ensures the fault stream, `run()` sends heartbeats
    and fault lines until `cfg.duration_s` is up (or `stop`), then `close()` replays what the
    publishers spooled and drains NATS. `run_sim(...)` is the usual way in; the arguments are its."""

    def __init__(self, settings: Settings, cfg: SimConfig, stop: asyncio.Event | None = None,
                 on_event: Callable[[str, Any], None] | None = None) -> None:
        self.settings, self.cfg = settings, cfg
        self.stop = stop or asyncio.Event()
        self.on_event = on_event
        self.rng = random.Random(cfg.seed)
        self.state = (cfg.state_dir or settings.state_dir / "sim") / cfg.cluster
        self.report = SimReport(nodes=cfg.nodes, duration_s=cfg.duration_s)
        self.publishers: dict[str, Publisher] = {}
        self.parsers: dict[str, KmsgParser] = {}
        self.categories = [c for c, _n, _m in FAILURE_MIX]
        self.weights = [n for _c, n, _m in FAILURE_MIX]
        self.makers = {c: m for c, _n, m in FAILURE_MIX}
        self.catalog: Catalog | None = None
        self.spool_io = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sim-spool-io")
        """One thread for every node's spool I/O (threads start when first used)."""
        self.nc: Any = None
        self.js: Any = None

    async def start(self) -> None:
        self.nc = await connect_nats(self.settings, name=f"fleetmend-sim-{self.cfg.cluster}")
        self.js = self.nc.jetstream(timeout=self.settings.agent.publish_timeout_s)
        await ensure_fault_stream(self.js, self.settings)
        self.catalog = default_catalog()

    async def run(self) -> SimReport:
        """Returns the `SimReport`."""
        await self.start()
        t0 = time.monotonic()
        tasks = [asyncio.create_task(x()) for x in (self.heartbeats, self.faults, self.timer)]
        try:
            await self.stop.wait()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.close()
        report = self.report
        report.duration_s = time.monotonic() - t0
        log.info("sim_finished", nodes=self.cfg.nodes, fault_lines=report.fault_lines,
                 published=report.events_published, heartbeats=report.heartbeats_sent)
        return report

    async def close(self) -> None:
        for p in self.publishers.values():
            await p.replay_once()
        await close_nats(self.nc)

    def publisher(self, node: str) -> Publisher:
        """The node's publisher (spool under `state/<node>/spool`) and parser, made when it first faults."""
        if node not in self.publishers:
            spool = Spool(self.state / node / "spool", self.settings.agent.spool_max_bytes)
            p = Publisher(self.nc, self.js, spool, self.cfg.cluster, node, self.settings.agent.publish_timeout_s,
                          io_pool=self.spool_io)
            p.attach(self.nc, self.js)
            self.publishers[node] = p
            self.parsers[node] = KmsgParser(self.cfg.cluster, node, __version__, catalog=self.catalog)
        return self.publishers[node]

    async def heartbeats(self) -> None:
        """Every node's heartbeat once per `heartbeat_interval_s`, spread evenly (sleeping every 100)."""
        cfg = self.cfg
        if not cfg.heartbeats or cfg.nodes == 0:
            return
        gap = cfg.heartbeat_interval_s / cfg.nodes
        i = 0
        while not self.stop.is_set():
            node = node_name(cfg, i % cfg.nodes)
            hb = {"node": node, "cluster": cfg.cluster, "agent_version": __version__, "sim": True,
                  "at": utcnow().isoformat()}
            await self.nc.publish(subjects.heartbeat_subject(cfg.cluster, node), json.dumps(hb, separators=(",", ":")).encode())
            self.report.heartbeats_sent += 1
            i += 1
            if i % 100 == 0:
                await asyncio.sleep(gap * 100)

    async def faults(self) -> None:
        """Fault lines at `fleet_rate_per_s` (Poisson), drawn from `FAILURE_MIX`, on random nodes."""
        rate = fleet_rate_per_s(self.cfg)
        if rate <= 0:
            return
        rng, report = self.rng, self.report
        while not self.stop.is_set():
            await asyncio.sleep(rng.expovariate(rate))
            cat = rng.choices(self.categories, self.weights)[0]
            maker = self.makers[cat]
            if maker is None:
                report.silent_by_category[cat] += 1
                continue
            node = node_name(self.cfg, rng.randrange(self.cfg.nodes))
            line = maker(rng)
            pub = self.publisher(node)
            parser = self.parsers[node]
            events = parser.feed(line) + parser.flush()
            report.fault_lines += 1
            report.by_category[cat] += 1
            for ev in events:
                report.emitted.append((node, ev.event_id, time.monotonic()))
                if self.on_event:
                    self.on_event(node, ev)
                if await pub.publish(ev):
                    report.events_published += 1
                else:
                    report.events_spooled += 1

    async def timer(self) -> None:
        try:
            await asyncio.wait_for(self.stop.wait(), timeout=self.cfg.duration_s)
        except asyncio.TimeoutError:
            self.stop.set()


async def run_sim(settings: Settings, cfg: SimConfig, stop: asyncio.Event | None = None,
                  on_event: Callable[[str, Any], None] | None = None) -> SimReport:
    """Run the simulated fleet for `cfg.duration_s` (or until `stop`). Returns a `SimReport`."""
    return await FleetSim(settings, cfg, stop, on_event).run()
