"""Fail-slow against the outside scenarios of issue 28, from a generator of the bench's own, through NATS.

    .venv/bin/python bench/failslow_scenarios.py [--nodes 1000] [--hours 24] [--scenario all|healthy|slow|rack|
                                                 rack-notopo|version|small|noise|slow-noise] [--seed 1]
                                                 [--injections N] [--direct]

Not `fleetmend.dev.perfsim`: this generator is written apart from it, closer to the evaluation that
filed issue 28. Nodes of two classes (H100x8 and H200x8, 8 GPUs, 4 compute IB rails at 400 Gb/s and
one 200 Gb/s storage HCA), racks of 32, ~85 % of the nodes in jobs of 4-64 nodes that end after
1-6 h and are replaced: compute-bound jobs touch the SW power cap 5-30 % of the time and clock
1.5 % lower, memory-bound ones draw less power and run cooler, communication-bound ones wait ~10x
longer on the IB port; a share of the jobs (`--reporting-jobs`, default half) report one rank's step
times per node, rank 0 10 % slower by design, the others none; the scheduler lists every running
job's nodes once a minute (`fleet.<cluster>.sched.jobs`, as `fleetmend.worker.analyzer_link` does
from Slurm or Kubernetes; `--no-scheduler`: it does not, and only the reporting jobs' nodes are
compared on the metrics that depend on the work).
SM clocks move in 15 MHz steps with a 2 % per-sample jitter; symbol errors, replays and throttles
come in heavy-tailed bursts on healthy nodes; 2 % of samples are lost; some nodes run 40 s late.

Each sample and step goes through a real nats-server (temporary, free port) into the real
`fleetmend.analyzer.service.Analyzer` (its JetStream ordered consumers, decode, derive, judge),
driven by a simulated clock: the analyzer's windows are the shipped defaults (300 s × 3), one sample
per node per simulated minute. `--direct` hands the same message bytes to the analyzer's own message
handlers (`Analyzer._on_msg`, `_on_job_msg`: decode, checks, derive, judge) without the round trip
through the nats-server (findings, state, status and the lease still go through it): ~4x faster on
a loaded 2-CPU box, for the long and many-injection runs.

Scenarios (`--scenario all` runs each in turn on a fresh fleet):
- healthy:      the mixed fleet, nothing wrong. Target: 0 node findings (each would drain), ≤ 1 false.
- slow:         the same with 5 % hardware slowdowns injected one by one at staggered times
                (clocks of every GPU, power brake, PCIe x8, thermal, IB symbol-error bursts, a
                compute rail at half rate; `--injections`, default nodes/50, each on its own node,
                the last 1.5 h before the end). A found node is repaired 30 min after its finding
                (drained, fixed, returned), so many injections in one run never make a fifth of the
                fleet faulty at once. Target: ≥ 99 % found; time to detect. A fault that shows under
                load only (clocks, thermal) cannot be seen on a node that has no job: such an injection
                whose node ran a job for less than 20 min (3 windows and the grace) after it began
                is counted apart (`unobservable`) and named with its busy minutes; a missed node that a
                domain finding names (an infrastructure incident: paged, not drained) is counted in
                `missed_in_domain_findings`.
- rack:         one rack 3-6 % slower (clocks, thermal slowdown) for 20 min, with a topology file;
                one node of that rack fails for real 10 min after. Target: one domain finding, 0
                drains among the rack's healthy nodes, the real fault found.
- rack-notopo:  the same without a topology file (the domain inferred).
- version:      a VBIOS on a quarter of the H200s clocks 5 % lower; a driver on half the H100s
                spends 15 % of the time in HW slowdown. Target: one version finding each, 0 drains.
- small:        a 5-node class with a PCIe x8 node, and 40 nodes joining mid-run.
- noise:        the healthy fleet with twice the jitter and ten times the bursts.
- slow-noise:   `slow` in the `noise` fleet (not in `all`): what heavy healthy noise costs the
                5 % slowdowns.

Per scenario it prints node findings (true: a node injected faulty; false: any other), domain and
version findings, misses, and minutes from injection to detection. A node finding is what would
drain a node (an upper bound on drains: FleetGuard's budget may hold some). Not a timed test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import nats  # noqa: E402
import structlog  # noqa: E402

from bench.common import machine  # noqa: E402
from fleetmend import subjects  # noqa: E402
from fleetmend.analyzer.service import Analyzer, analyzer_kv  # noqa: E402
from fleetmend.config import load_settings  # noqa: E402
from fleetmend.dev import servers  # noqa: E402
from fleetmend.infra.jetstream import ensure_fault_stream, ensure_perf_stream  # noqa: E402
from fleetmend.worker.analyzer_link import job_list_parts  # noqa: E402

SM_MAX = 1980
STEP_MHZ = 15
GPUS = 8
KINDS = ("compute", "memory", "comm")


@dataclass
class Node:
    name: str
    model: str
    driver: str
    vbios: str
    rack: int
    base: list[float]
    temp: list[float]
    late_s: float = 0.0
    job: str | None = None
    rank: int = 0
    kind: str = "idle"
    cap: float = 0.0
    fault: str | None = None
    fault_from: float = 1e30
    joined_at: float = 0.0
    prev_step: float = 0.0


@dataclass
class Job:
    name: str
    kind: str
    cap: float
    ends: float
    nodes: list[Node] = field(default_factory=list)
    reports: bool = True
    """The job reports its ranks' step times (`fleetmend.jobs`)."""


class Fleet:
    """The bench's own generator (module docstring)."""

    def __init__(self, n: int, rng: random.Random, t0: float, jitter: float = 0.02, bursts: float = 1.0,
                 reporting: float = 0.5) -> None:
        self.rng, self.jitter, self.bursts, self.reporting = rng, jitter, bursts, reporting
        self.nodes: list[Node] = []
        for i in range(n):
            model = "NVIDIA H100 80GB HBM3" if i % 2 else "NVIDIA H200"
            self.nodes.append(Node(f"gpu{i:05d}", model, "570.124.06", "96.00.89.00.01", i // 32,
                                   [1.0 - abs(rng.gauss(0, 0.004)) for _ in range(GPUS)],
                                   [58 + rng.gauss(0, 2.5) for _ in range(GPUS)],
                                   late_s=40.0 if rng.random() < 0.005 else 0.0))
        self.jobs: dict[str, Job] = {}
        self.seq = 0
        self.t0 = t0
        self.reassign(t0)

    def reassign(self, t: float) -> None:
        """End the jobs that are due; fill ~85 % of the nodes with new jobs of 4-64 nodes."""
        for j in [j for j in self.jobs.values() if j.ends <= t]:
            for n in j.nodes:
                n.job, n.kind, n.cap = None, "idle", 0.0
            del self.jobs[j.name]
        free = [n for n in self.nodes if n.job is None and n.joined_at <= t]
        self.rng.shuffle(free)
        busy = sum(1 for n in self.nodes if n.job is not None)
        while free and busy < 0.85 * len(self.nodes):
            size = min(len(free), self.rng.choice((4, 8, 8, 16, 16, 32, 64)))
            kind = self.rng.choice(KINDS)
            self.seq += 1
            same = [n for n in free if n.model == free[0].model][:size]  # a job runs on one class
            job = Job(f"j{self.seq}", kind, self.rng.uniform(0.05, 0.3) if kind == "compute" else 0.0,
                      t + self.rng.uniform(3600, 6 * 3600), same, reports=self.rng.random() < self.reporting)
            for r, n in enumerate(same):
                n.job, n.rank, n.kind, n.cap = job.name, r, kind, job.cap
                free.remove(n)
            busy += len(same)
            self.jobs[job.name] = job

    def sample(self, n: Node, t: float) -> dict[str, Any]:
        r = self.rng
        busy = n.job is not None
        f = n.fault if t >= n.fault_from else None
        gpus = []
        for i in range(GPUS):
            util = min(100.0, 94 + 4 * r.random()) if busy else r.random() * 2
            ratio = n.base[i] - (0.015 if n.kind == "compute" else 0.0) - abs(r.gauss(0, self.jitter / 2))
            ev = {"power_brake": 0.0, "hw_slowdown": 0.0, "hw_thermal": 0.0, "sw_thermal": 0.0,
                  "sw_power_cap": min(1.0, max(0.0, n.cap + r.gauss(0, 0.03))) if busy and n.cap else 0.0}
            temp = n.temp[i] + (8 if n.kind == "compute" else -5 if n.kind == "memory" else 0) + r.gauss(0, 1.0)
            width, replay = 16, (r.randint(1, 40) if r.random() < 0.005 * self.bursts else 0)
            if f == "clocks":
                ratio *= 0.95
            elif f == "power_brake" and i == 0:
                ev["power_brake"] = 0.1
                ratio *= 0.95
            elif f == "pcie" and i == 3:
                width = 8
            elif f == "thermal" and i == 5 and busy:
                ev["hw_thermal"] = 0.1
                temp += 10
            elif f == "rack" and busy:
                ratio *= 1 - 0.03 - 0.03 * ((n.rack * 7 + i) % 4) / 3
                ev["sw_thermal"] = 0.08 + 0.04 * (i % 3)
            elif f == "vbios" and busy:
                ratio *= 0.95
            elif f == "driver":
                ev["hw_slowdown"] = 0.15
            mhz = round(min(SM_MAX, ratio * SM_MAX) / STEP_MHZ) * STEP_MHZ if busy else 345
            gpus.append({"index": i, "util_pct": round(util, 1), "sm_clock_mhz": mhz, "sm_clock_max_mhz": SM_MAX,
                         "event_frac": ev, "power_w": 600.0 if busy else 90.0, "power_limit_w": 700.0,
                         "temperature_c": round(temp, 1), "pcie_gen": 5 if busy else 1, "pcie_gen_max": 5,
                         "pcie_width": width, "pcie_width_max": 16, "pcie_replay_delta": replay,
                         "nvlink_up": 18, "nvlink_total": 18, "nvlink_crc_delta": 0, "nvlink_replay_delta": 0,
                         "nvlink_recovery_delta": 0, "ecc_corrected_delta": 0})
        ports = []
        for p in range(5):
            storage = p == 4
            sym = r.randint(1, 50) if r.random() < 0.005 * self.bursts else 0
            if f == "ib" and p == 1 and r.random() < 1 / 3:
                sym = r.randint(20, 200)
            rate = 200.0 if storage else (200.0 if f == "port" and p == 2 else 400.0)
            wait = 0
            if busy and not storage:
                wait = int(abs(r.gauss(1, 0.3)) * (2e7 if n.kind == "comm" else 2e6))
            ports.append({"name": f"mlx5_{p}/1", "kind": "ib", "role": "storage" if storage else "compute",
                          "rate_gbps": rate, "width": 4, "symbol_error_delta": sym, "link_downed_delta": 0,
                          "link_error_recovery_delta": 0, "xmit_wait_delta": wait, "rcv_errors_delta": 0})
        at = t - n.late_s
        return {"schema_version": 1, "cluster": "bench", "node": n.name,
                "at": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at)) + f".{int((at % 1) * 1e6):06d}+00:00",
                "interval_s": 60.0,
                "hw": {"gpu_model": n.model, "gpu_count": GPUS, "driver": n.driver, "vbios": n.vbios,
                       "hca_model": "MT4125,MT4129", "cpu_model": "Intel(R) Xeon(R) Platinum 8480+"},
                "gpus": gpus, "ports": ports,
                "host": {"cpus": 112, "cpu_throttle_delta": r.randint(1, 5) if r.random() < 0.003 * self.bursts else 0,
                         "cpu_freq_mhz": 3000.0 + r.gauss(0, 30) if busy else 1200.0, "cpu_freq_nominal_mhz": 2000.0}}

    def step(self, n: Node, t: float) -> float:
        f = n.fault if t >= n.fault_from else None
        job = self.jobs[n.job] if n.job else None
        base = {"compute": 1.2, "memory": 0.8, "comm": 2.0}.get(job.kind if job else "", 1.0)
        s = base * (1.10 if n.rank == 0 else 1.0) * (1 + abs(self.rng.gauss(0, 0.01)))
        if f in ("clocks", "power_brake", "vbios", "rack"):
            s *= 1.05
        return s


@dataclass
class Outcome:
    node_findings: list[tuple[float, str, str]] = field(default_factory=list)
    shared: list[dict[str, Any]] = field(default_factory=list)


class Probe(Analyzer):
    """The real analyzer, recording what it found (node and rank findings, domain and version ones)."""

    outcome: Outcome

    async def tick(self) -> list:
        res = await super().tick()
        for r in res:
            self.outcome.node_findings += [(self.clock(), f.node, f.metric) for f in r.findings]
            self.outcome.shared += [g.evidence() for g in r.shared_findings]
        return res

    def job_event(self, f: Any) -> Any:
        ev = super().job_event(f)
        self.outcome.node_findings.append((self.clock(), ev.node, "job_step_seconds"))
        return ev


class _Msg:
    """A message as the analyzer's handlers read it (`--direct`)."""

    __slots__ = ("subject", "data")

    def __init__(self, subject: str, data: bytes) -> None:
        self.subject, self.data = subject, data


LOAD_ONLY = ("clocks", "thermal")
"""Patterns that show only while the node runs a job."""
OBSERVABLE_BUSY_MIN = 20
"""Minutes of load after a load-only fault begins that the analyzer needs at the least (3 windows of
5 min, the window the fault began in, and the grace)."""
REPAIR_AFTER_S = 1800.0
"""A found node is repaired this long after its finding (the fault cleared)."""


async def run_scenario(name: str, url: str, nodes: int, hours: float, seed: int, tmp: Path,
                       injections: int | None = None, direct: bool = False, reporting: float = 0.5,
                       scheduler: bool = True) -> dict[str, Any]:
    rng = random.Random(seed)
    now = (time.time() // 300) * 300 + 300
    t0 = now
    noisy = name in ("noise", "slow-noise")
    fleet = Fleet(nodes, rng, t0, jitter=0.04 if noisy else 0.02, bursts=10.0 if noisy else 1.0,
                  reporting=reporting)
    faulty: dict[str, float] = {}
    pats_of: dict[str, str] = {}
    expect_shared: list[str] = []
    topo_file = None
    if name in ("slow", "slow-noise"):
        pats = ("clocks", "power_brake", "pcie", "thermal", "ib", "port")
        cand = [n for n in fleet.nodes if n.job is not None]
        rng.shuffle(cand)
        k = min(len(cand), injections or max(6, nodes // 50))
        span = max(hours - 2.5, 0.0) * 3600
        for i, n in enumerate(cand[:k]):  # staggered from the second hour; the last 1.5 h before the end
            n.fault, n.fault_from = pats[i % len(pats)], t0 + 3600 + i * span / k
            faulty[n.name] = n.fault_from
            pats_of[n.name] = n.fault
    elif name in ("rack", "rack-notopo"):
        rack = 3
        for n in fleet.nodes:
            if n.rack == rack:
                n.fault, n.fault_from = "rack", t0 + 3600
        real = next(n for n in fleet.nodes if n.rack == rack and n.job is not None)
        expect_shared.append("domain")
        if name == "rack":
            topo_file = tmp / "topology.toml"
            topo_file.write_text("".join(f'[node.{n.name}]\nrack = "r{n.rack}"\n' for n in fleet.nodes))
        fleet._rack_end = t0 + 3600 + 1200  # type: ignore[attr-defined]
        fleet._real = (real, t0 + 3600 + 1200 + 600)  # type: ignore[attr-defined]
        faulty[real.name] = t0 + 3600 + 1200 + 600
    elif name == "version":
        h200 = [n for n in fleet.nodes if n.model == "NVIDIA H200"]
        for n in h200[: len(h200) // 4]:
            n.vbios, n.fault, n.fault_from = "96.00.AF.00.01", "vbios", t0
        h100 = [n for n in fleet.nodes if n.model != "NVIDIA H200"]
        for n in h100[: len(h100) // 2]:
            n.driver, n.fault, n.fault_from = "575.51.02", "driver", t0
        expect_shared += ["version", "version"]
    elif name == "small":
        for i in range(5):
            fleet.nodes.append(Node(f"b200-{i}", "NVIDIA B200", "570.124.06", "97.00.01", 99,
                                    [1.0] * GPUS, [55.0] * GPUS, fault="pcie" if i == 0 else None, fault_from=t0 + 1800))
        faulty["b200-0"] = t0 + 1800
        for n in fleet.nodes[:40]:
            n.joined_at = t0 + 3 * 3600
    s = load_settings(None, cluster="bench", nats_url=url,
                      policy={"topology_file": str(topo_file)} if topo_file else {})
    clock = type("C", (), {"t": now - 120, "__call__": lambda self: self.t})()
    nc = await nats.connect(url)
    js = nc.jetstream()
    probe = Probe(s, nc, js, await analyzer_kv(js), holder="bench", clock=clock, lease_clock=clock)
    probe.outcome = Outcome()
    await probe.start()
    assert await probe.lease()
    sent = 0
    repair_at: dict[str, float] = {}
    busy_after: dict[str, int] = {}
    """faulty node → minutes it ran a job after its fault began (a fault that shows under load only)."""
    started = time.perf_counter()
    for minute in range(int(hours * 60)):
        t = t0 + minute * 60
        if minute % 15 == 0:
            fleet.reassign(t)
        if name in ("rack", "rack-notopo"):
            for n in fleet.nodes:
                if n.fault == "rack" and t >= fleet._rack_end:  # type: ignore[attr-defined]
                    n.fault = None
            real, at = fleet._real  # type: ignore[attr-defined]
            if t >= at and real.fault is None:
                real.fault, real.fault_from = "pcie", at
        for node, at in list(repair_at.items()):  # found and repaired: healthy again
            if t >= at:
                nd = next(x for x in fleet.nodes if x.name == node)
                nd.fault, nd.fault_from = None, 1e30
                del repair_at[node]
        if scheduler:  # the worker's job list, as the scheduler says (every running job, reporting or not)
            jobs = {j.name: [n.name for n in j.nodes] for j in fleet.jobs.values()}
            for part in job_list_parts("bench", jobs, t):
                if direct:
                    await probe._on_sched_msg(_Msg(subjects.sched_jobs_subject("bench"), part))
                else:
                    await nc.publish(subjects.sched_jobs_subject("bench"), part)
        for n in fleet.nodes:
            if n.name in faulty and t >= faulty[n.name] and n.job is not None and n.fault is not None:
                busy_after[n.name] = busy_after.get(n.name, 0) + 1
            if n.joined_at > t or rng.random() < 0.02:  # not there yet, or a lost sample
                continue
            ts = t + rng.uniform(0, 50)
            subject, data = subjects.perf_subject("bench", n.name), json.dumps(fleet.sample(n, ts)).encode()
            if direct:
                await probe._on_msg(_Msg(subject, data))
            else:
                await nc.publish(subject, data)
            sent += 1
            if n.job is not None and fleet.jobs[n.job].reports:
                row = [n.rank, n.name, minute, round(fleet.step(n, ts), 4), ts]
                subject = subjects.job_subject("bench", n.name, n.job)
                data = json.dumps({"v": 1, "cluster": "bench", "job": n.job, "steps": [row]}).encode()
                if direct:
                    await probe._on_job_msg(_Msg(subject, data))
                else:
                    await nc.publish(subject, data)
        if not direct:
            await nc.flush()
            deadline = time.monotonic() + 60
            while probe.samples + probe.rejected < sent and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        clock.t = t + 60
        seen = len(probe.outcome.node_findings)
        await probe.tick()
        for _t, node, _m in probe.outcome.node_findings[seen:]:
            if name in ("slow", "slow-noise") and node in faulty and node not in repair_at and t >= faulty[node]:
                repair_at[node] = t + REPAIR_AFTER_S
    clock.t += 600
    await probe.tick()
    await probe.release()
    await nc.close()
    o = probe.outcome
    found_true = {n for t, n, _ in o.node_findings if n in faulty and t >= faulty[n]}
    false = [(round((t - t0) / 3600, 2), n, m) for t, n, m in o.node_findings if n not in faulty or t < faulty[n]]
    detect = {}
    for t, n, _m in sorted(o.node_findings):
        if n in faulty and n not in detect and t >= faulty[n]:
            detect[n] = round((t - faulty[n]) / 60, 1)
    kinds = [g["kind"] for g in o.shared]
    pattern = {n.name: pats_of.get(n.name) or n.fault or "rack-then-pcie" for n in fleet.nodes if n.name in faulty}
    missed = sorted(set(faulty) - found_true)
    named = {n for g in o.shared if g["kind"] == "domain" for n in str(g.get("node_list") or "").split(",") if n}
    in_domain = sorted(n for n in missed if n in named)
    """Missed as node findings but named in a domain finding (an infrastructure incident: paged, not drained)."""
    unobservable = [n for n in missed if pattern.get(n) in LOAD_ONLY and busy_after.get(n, 0) < OBSERVABLE_BUSY_MIN]
    observable = len(faulty) - len(unobservable)
    return {"scenario": name, "nodes": len(fleet.nodes), "hours": hours, "samples": sent,
            "scheduler": scheduler, "scheduler_lists": probe.sched_lists, "reporting_jobs": reporting,
            "direct": direct,
            "wall_s": round(time.perf_counter() - started, 1), "injected": len(faulty),
            "true_findings": len(found_true), "false_findings": len(false),
            "misses": {n: f"{pattern.get(n)}, busy {busy_after.get(n, 0)} min after its fault began"
                       for n in missed},
            "found_pct": round(100 * len(found_true) / len(faulty), 1) if faulty else None,
            "unobservable": len(unobservable),
            "missed_in_domain_findings": len(in_domain),
            "found_pct_observable": round(100 * len(found_true) / observable, 1) if observable else None,
            "found_by_pattern": {p: f"{sum(1 for n in found_true if pattern.get(n) == p)}/"
                                    f"{sum(1 for n in faulty if pattern.get(n) == p)}"
                                 for p in sorted({pattern.get(n) for n in faulty} - {None})},
            "minutes_to_detect": sorted(detect.values()), "domain_findings": kinds.count("domain"),
            "version_findings": kinds.count("version"), "shared": [f"{g['kind']} {g['key']} {g['metric']} "
                                                                   f"({g['nodes']} nodes)" for g in o.shared],
            "expected_shared": expect_shared, "false": false[:10], "rejected": probe.rejected,
            "dropped": dict(probe.comparator.dropped)}


async def main(args: argparse.Namespace) -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    print(machine())
    names = ["healthy", "slow", "rack", "rack-notopo", "version", "small", "noise"] if args.scenario == "all" \
        else [args.scenario]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        port = servers.free_port()
        proc = servers.start_nats(tmp / "js", port)
        url = f"nats://127.0.0.1:{port}"
        try:
            nc = await nats.connect(url)
            await ensure_perf_stream(nc.jetstream())
            await ensure_fault_stream(nc.jetstream())
            await nc.close()
            for i, name in enumerate(names):
                out = await run_scenario(name, url, args.nodes, args.hours, args.seed + i, tmp,
                                         injections=args.injections, direct=args.direct,
                                         reporting=args.reporting_jobs, scheduler=not args.no_scheduler)
                print(json.dumps(out))
        finally:
            proc.stop()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--hours", type=float, default=24.0)
    p.add_argument("--scenario", default="all")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--injections", type=int, default=None, help="slow: faults injected (default nodes/50)")
    p.add_argument("--direct", action="store_true", help="the analyzer's message handlers without the NATS round trip")
    p.add_argument("--reporting-jobs", type=float, default=0.5, help="share of the jobs that report step times")
    p.add_argument("--no-scheduler", action="store_true", help="no job list from the scheduler")
    asyncio.run(main(p.parse_args()))
