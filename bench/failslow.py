"""Fail-slow detection at fleet scale: time to detect, false positives, the analyzer's CPU and memory.

    .venv/bin/python bench/failslow.py [--nodes 10000] [--slow 5] [--slowdown 0.05] [--hours 24]
                                       [--workloads compute|mixed] [--class-wide]
                                       [--process-seconds 240] [--process-interval 15]

Part 1, simulated day (no servers): `fleetmend.dev.perfsim.PerfFleet` draws `--nodes` noisy healthy
nodes and `--slow` degraded ones (patterns in turn: clocks, power brake, PCIe x8, IB symbol errors,
thermal; each `--slowdown` slower), one sample per node a minute for `--hours`, degradation from the
second hour on; nodes run jobs of 16 (`--workloads compute`, or `mixed`: compute-bound at the power
cap, memory-bound, communication-bound with ~10x the IB wait, as in issue 28), and each busy node
says which job it runs, as its job's step times would. The analyzer's comparator
(`fleetmend.analyzer.core.Comparator`, default settings: 5-min windows, 3 in a row) judges every
window. The metrics go in through `PerfFleet.derived` (the numbers `metrics.derive` gives for the
same samples, without building 14 million pydantic objects); the per-sample cost of decoding and
deriving is measured in part 2. Prints per slowed node the minutes from degradation to the
fail_slow finding, every finding on a healthy node (false positives; target 0), and the
comparator's CPU seconds per simulated hour. `--class-wide` judges every metric across the hardware
class, the rule before issue 28 (for contrast: the mixed fleet's false positives).

Part 2, the real process: nats-server (temp dir, free port) and `fleetmend analyzer` as a child
process (window 60 s, grace 10 s); this process publishes the samples of `--nodes` nodes every
`--process-interval` seconds (4× the agent's default rate at 15 s) for `--process-seconds`. Prints the
analyzer's CPU % of one core and RSS (psutil), the CPU per sample, the same scaled to `--nodes` at the
default 60 s interval, and the fail_slow events it published (only the load-independent patterns can
complete three windows within a few minutes).

Not a timed test: it prints figures.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import machine  # noqa: E402
from fleetmend.analyzer.core import Comparator  # noqa: E402
from fleetmend.config import AnalyzerSettings  # noqa: E402
from fleetmend.dev.perfsim import HW, MIXED, PerfFleet  # noqa: E402

T0 = 1_800_000_000.0


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def simulated_day(nodes: int, slow: int, slowdown: float, hours: float, seed: int, workloads: str = "compute",
                  class_wide: bool = False) -> list[str]:
    cfg = AnalyzerSettings()
    slow_from = T0 + 3600
    fleet = PerfFleet(nodes, slow_nodes=slow, slowdown=slowdown, seed=seed, slow_from=slow_from,
                      workloads=MIXED if workloads == "mixed" else ("compute",))
    names = fleet.names
    comp = Comparator(cfg)
    if class_wide:
        comp.specs = {m: dataclasses.replace(s, work_dependent=False) for m, s in comp.specs.items()}
        comp.explainer.enabled = False  # nor were co-occurring outliers one finding
    rss0 = _rss_mib()
    rss_peak = rss0
    gen_cpu = an_cpu = 0.0
    detected: dict[str, tuple[float, str]] = {}
    false_pos: list[tuple[str, str, float]] = []
    windows = 0
    wall0 = time.monotonic()
    key = HW.key
    for step in range(int(hours * 60)):
        t = T0 + step * 60 + 30
        c0 = time.process_time()
        batch = [fleet.derived(i, t) for i in range(nodes)]
        c1 = time.process_time()
        add, note, job_of = comp.add, comp.note_job, fleet.job_of
        for i in range(nodes):
            add(names[i], key, t, batch[i], t)
            job = job_of(i)
            if job is not None:
                note(names[i], job, t, t)
        del batch
        due = comp.due(t)
        if due:
            rss_peak = max(rss_peak, _rss_mib())
        for w in due:
            res = comp.close_window(w)
            windows += 1
            for f in res.findings:
                if f.node in fleet.slow:
                    detected.setdefault(f.node, ((f.window_end - slow_from) / 60, f.metric))
                else:
                    false_pos.append((f.node, f.metric, (f.window_end - T0) / 3600))
        c2 = time.process_time()
        gen_cpu += c1 - c0
        an_cpu += c2 - c1
        if step and step % 360 == 0:
            print(f"  … {step / 60:.0f} simulated h, {time.monotonic() - wall0:.0f} s", flush=True)
    lines = [f"simulated {hours:g} h of {nodes} nodes (one sample a minute), {slow} slowed by {slowdown:.0%} from "
             f"hour 1, workloads {workloads}{' (judged class-wide: the rule before issue 28)' if class_wide else ''}; "
             f"comparator: window {cfg.window_s:g} s × {cfg.windows}, mad_k {cfg.mad_k:g}, "
             f"min group {cfg.min_group_size}; {windows} windows judged",
             f"{'node':<12} {'pattern':<12} {'detected after':>15}  metric"]
    for node, pattern in sorted(fleet.slow.items(), key=lambda x: x[1]):
        d = detected.get(node)
        lines.append(f"{node:<12} {pattern:<12} {(f'{d[0]:.0f} min' if d else 'NOT DETECTED'):>15}  "
                     f"{d[1] if d else '-'}")
    fp_nodes = len({n for n, _, _ in false_pos})
    lines.append(f"false positives over {hours:g} h: {len(false_pos)} on {fp_nodes} healthy nodes"
                 + (" " + ", ".join(f"{n} {m} at h {h:.1f}" for n, m, h in false_pos[:10]) if false_pos else ""))
    lines.append(f"comparator CPU {an_cpu:.1f} s for {hours:g} simulated h = {an_cpu / hours:.2f} s per hour "
                 f"= {100 * an_cpu / (hours * 3600):.3f} % of one core in real time "
                 f"(simulator {gen_cpu:.0f} s, not counted)")
    lines.append(f"bench process RSS {rss0:.0f} MiB before the comparator, peak {rss_peak:.0f} MiB with a window "
                 f"open (includes the simulator's one-minute batch of {nodes} metric dicts); "
                 f"ru_maxrss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    return lines


async def real_process(nodes: int, slow: int, slowdown: float, seconds: float, interval: float, seed: int) -> list[str]:
    import psutil

    from fleetmend.config import load_settings
    from fleetmend.dev import servers
    from fleetmend.dev.devup import child_env
    from fleetmend.dev.perfsim import run_perf_sim
    from fleetmend.events import FaultEvent
    from fleetmend.infra.connect import close_nats, connect_nats
    from fleetmend.infra.jetstream import ensure_fault_stream, ensure_perf_stream

    root = Path(tempfile.mkdtemp(prefix="fleetmend-bench-failslow-"))
    (root / "logs").mkdir()
    port = servers.free_port()
    nats = servers.start_nats(root / "nats", port, log_path=root / "logs" / "nats.log")
    cluster = "bench"
    s = load_settings(None, nats_url=f"nats://127.0.0.1:{port}", cluster=cluster, state_dir=root / "state")
    analyzer = None
    try:
        nc = await connect_nats(s, name="bench-failslow")
        js = nc.jetstream()
        await ensure_perf_stream(js)
        await ensure_fault_stream(js)
        found: dict[str, str] = {}

        async def on_fault(msg) -> None:
            ev = FaultEvent.from_json_bytes(msg.data)
            found.setdefault(ev.node, str(ev.attrs.get("metric")))

        await nc.subscribe(f"fleet.{cluster}.fault.*", cb=on_fault)
        env = {**os.environ, **child_env(s), "FLEETMEND_ANALYZER__WINDOW_S": "60", "FLEETMEND_ANALYZER__GRACE_S": "10",
               "FLEETMEND_LOG_FORMAT": "json"}
        analyzer = servers.ManagedProcess("analyzer", [sys.executable, "-m", "fleetmend.cli.main", "analyzer"],
                                          root / "logs" / "analyzer.log", env=env)
        analyzer.start()
        await asyncio.sleep(3)
        proc = psutil.Process(analyzer.pid)
        fleet = PerfFleet(nodes, slow_nodes=slow, slowdown=slowdown, seed=seed, cluster=cluster)
        t0 = time.monotonic()
        cpu0 = sum(proc.cpu_times()[:2])
        rss: list[float] = []

        async def watch() -> None:
            while True:
                rss.append(proc.memory_info().rss / 2**20)
                await asyncio.sleep(2)

        w = asyncio.create_task(watch())
        rep = await run_perf_sim(s, fleet, seconds, interval)
        await asyncio.sleep(15)  # the last window's grace
        w.cancel()
        cpu = sum(proc.cpu_times()[:2]) - cpu0
        wall = time.monotonic() - t0
        await close_nats(nc)
    finally:
        if analyzer is not None:
            analyzer.stop(20)
        nats.stop(20)
        if os.environ.get("FLEETMEND_BENCH_KEEP") != "1":
            shutil.rmtree(root, ignore_errors=True)
    per_sample_us = 1e6 * cpu / max(1, rep["samples"])
    at_default = per_sample_us * 1e-6 * nodes / 60 * 100
    healthy_hits = [n for n in found if n not in fleet.slow]
    reported = ", ".join(f"{n} ({fleet.slow.get(n, 'HEALTHY')}, {m})" for n, m in found.items()) or "none"
    return [
        f"real process: {nodes} nodes, one sample each every {interval:g} s for {seconds:g} s "
        f"({rep['samples']} samples, {rep['samples'] / seconds:.0f}/s), window 60 s × 3",
        f"analyzer CPU {100 * cpu / wall:.1f} % of one core over {wall:.0f} s; {per_sample_us:.0f} µs per sample "
        f"(decode, derive, file, judge) → at the default 60 s interval {at_default:.2f} % of one core for {nodes} nodes",
        f"analyzer RSS max {max(rss):.0f} MiB, last {rss[-1]:.0f} MiB",
        f"fail_slow published for: {reported}; healthy nodes reported: {len(healthy_hits)}",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=10_000)
    ap.add_argument("--slow", type=int, default=5)
    ap.add_argument("--slowdown", type=float, default=0.05)
    ap.add_argument("--hours", type=float, default=24.0, help="0 skips part 1")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--workloads", choices=("compute", "mixed"), default="compute")
    ap.add_argument("--class-wide", action="store_true", help="judge every metric across the class (the old rule)")
    ap.add_argument("--process-seconds", type=float, default=240.0, help="0 skips part 2")
    ap.add_argument("--process-interval", type=float, default=15.0)
    a = ap.parse_args()
    print(machine(), flush=True)
    if a.hours > 0:
        out = simulated_day(a.nodes, a.slow, a.slowdown, a.hours, a.seed, a.workloads, a.class_wide)
        print("\n".join(out), flush=True)
    if a.process_seconds > 0:
        out2 = asyncio.run(real_process(a.nodes, a.slow, a.slowdown, a.process_seconds, a.process_interval, a.seed))
        print("\n".join(out2), flush=True)


if __name__ == "__main__":
    main()
