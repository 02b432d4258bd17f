"""The analyzer's memory whatever arrives: an honest fleet, then one node's worst, through the real door.

    .venv/bin/python bench/failslow_memory.py [--nodes 10000] [--hostile 300000]

Everything goes through `Analyzer._on_msg` / `_on_job_msg` (decode, subject check, derive, the
comparator's admission), with a fixed clock and no NATS (dead letters are counted, not sent):

1. `--nodes` honest 8-GPU nodes, five samples each in the open window, each reporting its 8 ranks of
   a job of 16 nodes (the fleet's working set; issue 28 measured 72 MiB at ~10,000 nodes).
2. Hostile input, `--hostile` messages in all, in four kinds: one node's samples dated anywhere from
   41 days behind to 41 days ahead (issue 28: RSS 60 → 536 MB after 1.2 M such samples); the same
   node flooding the open window; samples under made-up node names (a NATS without node credentials);
   job reports claiming 1,024 GPUs' ranks of many jobs.

Prints RSS after each phase, what the comparator holds (windows, nodes, values), what was dropped by
reason, and beside them the raw limit: the RSS of the honest fleet alone, and the bound the
constants give (`MAX_NODES_PER_WINDOW` × open windows × `MAX_VALUES_PER_METRIC` values per metric).
Not a timed test: it prints figures.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import structlog

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import machine  # noqa: E402
from fleetmend import subjects  # noqa: E402
from fleetmend.analyzer import core  # noqa: E402
from fleetmend.analyzer.service import Analyzer  # noqa: E402
from fleetmend.config import load_settings  # noqa: E402
from fleetmend.events import MAX_CLOCK_SKEW_S  # noqa: E402
from fleetmend.telemetry import GpuPerf, HardwareClass, PerfSample  # noqa: E402

T0 = 1_800_000_000.0


@dataclasses.dataclass
class Msg:
    subject: str
    data: bytes


class NullJS:
    """Dead letters are counted, not sent."""

    def __init__(self) -> None:
        self.published = 0

    async def publish(self, *_: Any, **__: Any) -> None:
        self.published += 1


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def sample(node: str, t: float, gpu_count: int = 8) -> bytes:
    return PerfSample(cluster="c", node=node, at=datetime.fromtimestamp(t, timezone.utc), interval_s=60,
                      hw=HardwareClass(gpu_model="NVIDIA H200", gpu_count=gpu_count, driver="570"),
                      gpus=[GpuPerf(index=i, util_pct=96, sm_clock_mhz=1950, sm_clock_max_mhz=1980,
                                    temperature_c=60, pcie_width=16, pcie_width_max=16,
                                    event_frac={"power_brake": 0.0, "sw_power_cap": 0.1}) for i in range(8)]
                      ).to_json_bytes()


def job_msg(node: str, job: str, rows: list) -> Msg:
    return Msg(subjects.job_subject("c", node, job),
               json.dumps({"v": 1, "cluster": "c", "job": job, "steps": rows}).encode())


def held(a: Analyzer) -> dict[str, int]:
    c = a.comparator
    return {"windows": len(c.open), "node_windows": sum(len(w) for w in c.open.values()),
            "values": sum(len(v) for w in c.open.values() for nw in w.values() for v in nw.values.values()),
            "rank_windows": sum(len(w) for w in a.jobs.open.values()), "known_nodes": len(a.nodes),
            "claims": len(a._claims)}


async def main(nodes: int, hostile: int) -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))  # one line per drop
    s = load_settings(None, cluster="c")
    now = T0 + 150.0  # the middle of a 300 s window
    a = Analyzer(s, None, NullJS(), None, holder="bench", clock=lambda: now, lease_clock=lambda: now)
    print(machine())
    base = rss_mib()
    print(f"RSS at start: {base:.0f} MiB")
    t0 = time.perf_counter()
    template = {k: sample(f"n{k}", T0 + 1 + k * 30) for k in range(5)}
    for n in range(nodes):
        name = f"n{n:05d}"
        for k in range(5):
            await a._on_msg(Msg(subjects.perf_subject("c", name), template[k].replace(b'"n%d"' % k,
                                                                                     f'"{name}"'.encode())))
        rows = [[r, name, 1, 2.0, T0 + 10] for r in range(8)]
        await a._on_job_msg(job_msg(name, f"job{n // 16}", rows))
    honest = rss_mib()
    print(f"honest fleet: {nodes} nodes x 5 samples + 8 ranks each in {time.perf_counter() - t0:.1f} s; "
          f"RSS {honest:.0f} MiB (+{honest - base:.0f}); holds {held(a)}")

    t0 = time.perf_counter()
    per_kind = hostile // 4
    attacker = "n00000"
    spread = [sample(attacker, now + d * 3600.0 * (1 if d % 2 else -1)) for d in range(997)]
    for i in range(per_kind):  # 1: dated anywhere within +-41 days
        await a._on_msg(Msg(subjects.perf_subject("c", attacker), spread[i % len(spread)]))
    print(f"  after {per_kind} messages dated +-41 days: RSS {rss_mib():.0f} MiB")
    flood = sample(attacker, now - 1)
    for _ in range(per_kind):  # 2: flooding the open window
        await a._on_msg(Msg(subjects.perf_subject("c", attacker), flood))
    print(f"  after {per_kind} messages flooding the open window: RSS {rss_mib():.0f} MiB")
    body = sample("mx", now - 2)
    for i in range(per_kind):  # 3: made-up names
        name = f"made-up-{i}"
        await a._on_msg(Msg(subjects.perf_subject("c", name), body.replace(b'"mx"', f'"{name}"'.encode())))
    print(f"  after {per_kind} messages made-up names: RSS {rss_mib():.0f} MiB")
    await a._on_msg(Msg(subjects.perf_subject("c", "liar"), sample("liar", now - 3, gpu_count=1024)))
    for i in range(per_kind):  # 4: a node claiming 1,024 GPUs' ranks of many jobs
        rows = [[(i * 64 + r) % 1024, "liar", 1, 1.0, now - 4] for r in range(64)]
        await a._on_job_msg(job_msg("liar", f"fake{i % 16}", rows))
    print(f"  after {per_kind} messages 1,024 GPUs' ranks of many jobs: RSS {rss_mib():.0f} MiB")
    after = rss_mib()
    c = a.comparator
    print(f"hostile: {4 * per_kind} messages in {time.perf_counter() - t0:.1f} s; RSS {after:.0f} MiB "
          f"(+{after - honest:.0f} over the honest fleet); holds {held(a)}")
    print(f"dropped (perf): {dict(c.dropped)}; dropped (job): {dict(a.jobs.dropped)}; "
          f"dead-lettered: {a.rejected}")
    bound_windows = int((s.analyzer.window_s + s.analyzer.grace_s + 2 * MAX_CLOCK_SKEW_S)
                        / s.analyzer.window_s) + 2
    print(f"raw limits: the honest fleet alone {honest:.0f} MiB; the constants allow at most {bound_windows} "
          f"open windows x {core.MAX_NODES_PER_WINDOW:,} nodes x {core.MAX_VALUES_PER_METRIC} values per metric, "
          f"one node at most {core.MAX_VALUES_PER_METRIC} values per metric per window "
          f"(the attacker holds {max(len(v) for w in c.open.values() if attacker in w for v in w[attacker].values.values())})")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=10_000)
    p.add_argument("--hostile", type=int, default=300_000)
    args = p.parse_args()
    asyncio.run(main(args.nodes, args.hostile))
