"""Quarantine latency: a fault line entering the agent → the drain issued by the scheduler adapter.

    python bench/quarantine.py --nodes 10000 --faults 200 --rate 20
    python bench/quarantine.py --nodes 10000 --modes burst --burst 1000

A simulated fleet of NODES nodes sends heartbeats (every 10 s each) and background faults from the
Llama 3 mix; meanwhile the measured XID 79 lines, on distinct nodes `m00000…`, go through the
agent's real `KmsgParser` + `Publisher`. Each mode has its own router and worker processes:

- real-drain: standalone scheduler; the drain lands in the JetStream KV bucket, watched here.
  The blast-radius budget and breaker are opened (they would queue most of the measured nodes,
  which is their job), so the figure is the permit path's latency, not the safety queue.
- observe-only: `policy.observe_only`; the decision is the workflow closing with outcome "observed".
- burst: BURST nodes fail at once under a real budget (`--budget` nodes, `--per-rack` per rack of
  `--rack-size` nodes; breaker and failure-domain incidents opened so the budget is what queues).
  Within `--burst-window` seconds every measured node must be drained, or shown by `fleetmend
  status` in phase `awaiting_permit` with the reason it waits.

Measured faults go out at `--rate` per second (one burst when the mode is `burst`). Only the
measured nodes count: the bench waits for each of them up to `--deadline` seconds after its fault,
names any that are missing, and exits 1 when one is missing (or, in a burst, neither drained nor
visibly queued). In every drain mode the bench replays the drain records (the KV bucket's puts and
deletes, in order) and reports the most nodes drained at once, per cluster and per rack, against the
budget; more than the budget allows is also exit 1. The guard's own counters are not consulted.

For reference, NVIDIA NVSentinel's published scale test reports a quarantine decision p50 of
0.37 s and p90 of 0.48 s at 1,500 nodes (about 2.5 nodes/s).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import CpuMeter, machine, pct, stack, table

XID79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
OPEN = "100000"


def node_of(key: str) -> str:
    """The node a drain record's key names (`subjects.drain_kv_key`: `<cluster>.<node token>`; an older
    key is the node name itself)."""
    from fleetmend import subjects

    try:
        return subjects.parse_drain_kv_key(key)[1]
    except ValueError:
        return key


def replay_drains(records: list[tuple[float, str, bool]], rack_of: dict[str, str]) -> tuple[int, int, str | None]:
    """From drain records (time, key, drained?) in bucket order: (most nodes drained at once, most in one
    rack at once, that rack)."""
    drained: set[str] = set()
    peak = peak_rack = 0
    worst = None
    per_rack: Counter[str] = Counter()
    for _, key, on in records:
        node = node_of(key)
        rack = rack_of.get(node)
        if on and node not in drained:
            drained.add(node)
            if rack:
                per_rack[rack] += 1
        elif not on and node in drained:
            drained.discard(node)
            if rack:
                per_rack[rack] -= 1
        peak = max(peak, len(drained))
        if rack and per_rack[rack] > peak_rack:
            peak_rack, worst = per_rack[rack], rack
    return peak, peak_rack, worst


async def measure(st, mode: str, a: argparse.Namespace) -> dict:
    import nats
    from temporalio.client import Client

    from agents.kmsg import KmsgParser
    from agents.publisher import Publisher
    from agents.spool import Spool
    from fleetmend import subjects
    from fleetmend.catalog import default_catalog
    from fleetmend.dev.simulate import SimConfig, run_sim
    from fleetmend.infra.converter import data_converter
    from fleetmend.infra.jetstream import ensure_fault_stream
    from fleetmend.policy import drain_budget

    cluster = f"q{mode.replace('-', '')}"
    observe = mode == "observe-only"
    burst = mode == "burst"
    count = a.burst if burst else a.faults
    measured = [f"m{i:05d}" for i in range(count)]
    rack_of = {n: f"r{i // a.rack_size:03d}" for i, n in enumerate(measured)} if burst else {}
    topo = None
    if rack_of:
        topo = st.root / f"topology-{cluster}.toml"
        topo.write_text("".join(f'[node.{n}]\nrack = "{r}"\n' for n, r in rack_of.items()))
    known = a.nodes + count
    policy = {"observe_only": observe, "cluster_nodes": known}
    if topo is not None:
        policy["topology_file"] = str(topo)
    s = st.settings(cluster=cluster, scheduler="standalone", task_queue=f"tq-{cluster}", policy=policy)
    env = {"FLEETMEND_POLICY__CLUSTER_NODES": str(known),
           "FLEETMEND_POLICY__BREAKER_DISTINCT_NODES": OPEN, "FLEETMEND_POLICY__DOMAIN_INCIDENT_NODES": OPEN}
    if topo is not None:
        env["FLEETMEND_POLICY__TOPOLOGY_FILE"] = str(topo)
    if burst:
        env.update({"FLEETMEND_POLICY__MAX_DRAINED_NODES": str(a.budget), "FLEETMEND_POLICY__MAX_DRAINED_PERCENT": "100",
                    "FLEETMEND_POLICY__MAX_DRAINED_PER_RACK": str(a.per_rack)})
        budget, rack_cap = drain_budget(known, a.budget, 100.0), a.per_rack
    else:
        env.update({"FLEETMEND_POLICY__MAX_DRAINED_NODES": OPEN, "FLEETMEND_POLICY__MAX_DRAINED_PERCENT": "100",
                    "FLEETMEND_POLICY__MAX_DRAINED_PER_RACK": OPEN})
        budget, rack_cap = int(OPEN), int(OPEN)
    worker = st.spawn("worker", s, env)
    router = st.spawn("router", s, env)
    nc = await nats.connect(st.nats_url)
    js = nc.jetstream()
    await ensure_fault_stream(js)
    client = await Client.connect(st.temporal_address, data_converter=data_converter)
    want = set(measured)
    seen: dict[str, float] = {}
    records: list[tuple[float, str, bool]] = []
    wtask = None
    if not observe:
        kv = await js.create_key_value(bucket=subjects.DRAIN_KV_BUCKET, history=5)
        watcher = await kv.watch(f"{cluster}.>")  # this mode's cluster only (modes share the bucket)

        async def watch() -> None:
            async for entry in watcher:
                if entry is None:
                    continue
                now = time.monotonic()
                on = bool(entry.value) and entry.operation not in ("DEL", "PURGE")
                records.append((now, entry.key, on))
                node = node_of(entry.key)
                if on and node in want and node not in seen:
                    seen[node] = now

        wtask = asyncio.create_task(watch())
    await asyncio.sleep(3)  # processes up
    stop = asyncio.Event()
    sim_cfg = SimConfig(nodes=a.nodes, cluster=cluster, node_prefix="bg", duration_s=1e9, seed=7,
                        fault_rate_per_s=a.background, state_dir=st.root / "sim")
    sim_task = asyncio.create_task(run_sim(s, sim_cfg, stop=stop))
    await asyncio.sleep(2)  # the fleet heartbeating
    hb = await _heartbeat_window(nc, cluster, router.pid, a) if a.hb_window > 0 else None
    meter = CpuMeter({"router": router.pid, "worker": worker.pid, "temporal": st.procs[1].pid})
    spy = None
    if a.profile:  # py-spy (PyPI) samples the worker for the measured window
        import subprocess

        Path(a.profile).mkdir(parents=True, exist_ok=True)
        spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "-r", "50", "-f", "speedscope", "-o",
                                str(Path(a.profile) / f"worker-{mode}.json"), "--pid", str(worker.pid)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    catalog = default_catalog()
    senders = []
    for node in measured:
        pub = Publisher(nc, js, Spool(st.root / "spool" / cluster / node, 1 << 20), cluster, node)
        pub.attach(nc, js)
        senders.append((node, pub, KmsgParser(cluster, node, "bench", catalog=catalog)))
    started: dict[str, float] = {}
    waits = []

    async def send(node: str, pub, parser) -> None:
        started[node] = time.monotonic()  # the line enters the agent
        for ev in parser.feed(XID79) + parser.flush():
            await pub.publish(ev)
        if observe:
            waits.append(asyncio.create_task(_closed(client.get_workflow_handle(
                subjects.workflow_id(cluster, node)), node, seen, a.deadline)))

    t_first = time.monotonic()
    if burst:
        await asyncio.gather(*(send(*x) for x in senders))
    else:
        for i, x in enumerate(senders):  # paced on the schedule, not on each send's duration
            delay = t_first + i / a.rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await send(*x)
    t_sent = time.monotonic()
    window = None
    if burst:
        window = await _burst_window(s, client, cluster, measured, seen, t_first, a.burst_window)
    while not burst and len(seen.keys() & want) < len(want) and time.monotonic() < t_sent + a.deadline:
        await asyncio.sleep(0.05)
    cpu = meter.read()
    if spy is not None:
        import signal

        spy.send_signal(signal.SIGINT)  # py-spy writes its profile on SIGINT
        spy.wait(30)
    guard = None
    if a.profile:
        guard = await _guard_tasks(client, subjects.fleetguard_workflow_id(cluster))
        mid = measured[len(measured) // 2]
        (Path(a.profile) / f"timeline-{mode}-{mid}.txt").write_text(
            await _timeline(client, subjects.workflow_id(cluster, mid)) + "\n")
    stop.set()
    await asyncio.gather(sim_task, *waits, return_exceptions=True)
    if wtask is not None:
        await asyncio.sleep(0.5)
        wtask.cancel()
    lat = [seen[n] - started[n] for n in measured if n in seen]
    missing = [n for n in measured if n not in seen]
    if a.profile and not burst:  # where a missing node's incident stands: its history and its own timeline
        for n in missing[:3]:
            wid = subjects.workflow_id(cluster, n)
            try:
                st_ = await client.get_workflow_handle(wid).query("status")
                notes = " | ".join(f"{e.get('at')} {e.get('text')}" for e in (st_.get("timeline") or [])[-12:]) \
                    if isinstance(st_, dict) else repr(st_)[:2000]
                text = await _timeline(client, wid) + "\n\n" + notes
            except Exception as err:  # noqa: BLE001 - no incident at all is the finding
                text = f"{wid}: {err!r}"
            (Path(a.profile) / f"missing-{mode}-{n}.txt").write_text(text + "\n")
    peak, peak_rack, worst_rack = replay_drains(sorted(records), rack_of)
    await nc.close()
    router.stop()
    worker.stop()
    return {"mode": mode, "lat": lat, "missing": missing, "count": count, "cpu": cpu,
            "send_s": t_sent - t_first, "window": window, "peak": peak, "peak_rack": peak_rack,
            "worst_rack": worst_rack, "guard": guard, "budget": budget, "rack_cap": rack_cap, "drain_records": len(records),
            "hb": hb}


async def _heartbeat_window(nc, cluster: str, router_pid: int, a: argparse.Namespace) -> dict:
    """The router tracking the simulated fleet's heartbeats alone, for `--hb-window` s before the measured
    faults: heartbeats/s seen by a NATS subscriber of the same subjects (the simulator's achieved rate,
    against NODES / 10 s), and the router's CPU (% of one core) and RSS."""
    seen = 0

    async def count(_msg) -> None:
        nonlocal seen
        seen += 1

    sub = await nc.subscribe(f"fleet.{cluster}.hb.*", cb=count)
    meter = CpuMeter({"router": router_pid})
    t0 = time.monotonic()
    await asyncio.sleep(a.hb_window)
    took = time.monotonic() - t0
    cpu, rss = meter.read()["router"]
    await sub.unsubscribe()
    return {"rate": seen / took, "target": a.nodes / 10.0, "cpu": cpu, "rss": rss, "window_s": took}


async def _burst_window(s, client, cluster: str, measured: list[str], seen: dict[str, float],
                        t0: float, window_s: float) -> dict:
    """Poll, as `fleetmend status` sees it (phase, and the reason the permit waits: FleetGuard's, or the
    permit pool's for a node whose incident the router is still starting), until every measured node is
    drained or visibly queued, or `window_s` after the burst began."""
    from fleetmend.cli.incidents import list_incidents

    result: dict = {}
    while True:
        elapsed = time.monotonic() - t0
        try:
            # running incidents, and the nodes the router refused a slot whose incidents it is still starting
            rows = {r["node"]: r for r in await list_incidents(s, 100_000) if r["status"] in ("running", "starting")}
        except Exception as err:  # noqa: BLE001 - a slow visibility read: try again
            result["error"] = str(err)
            rows = {}
        waits = {n: r.get("waiting") or "" for n, r in rows.items()}
        drained = [n for n in measured if n in seen]
        queued = [n for n in measured if n not in seen and (rows.get(n) or {}).get("phase") == "awaiting_permit"
                  and waits.get(n) and not waits[n].startswith(("not queued", "FleetGuard unreadable"))]
        neither = [n for n in measured if n not in seen and n not in queued]
        result = {"at_s": elapsed, "drained": len(drained), "queued": len(queued), "neither": neither,
                  "reasons": Counter(waits[n].split(":")[0] for n in queued).most_common(4)}
        if not neither or elapsed >= window_s:
            return result
        await asyncio.sleep(1.0)


async def _guard_tasks(client, wid: str) -> str:
    """The FleetGuard's workflow tasks over all its runs: how many, how fast, and where a task's time
    went (scheduled → started: waiting for a worker slot; started → completed: running)."""
    from temporalio.api.enums.v1 import EventType

    tasks = events = runs = 0
    first = last = None
    wait, work = [], []
    slowest: tuple[float, object, Counter] | None = None  # (running s, completed at, messages it took)
    pending: Counter = Counter()
    async for wf in client.list_workflows(f"WorkflowId = '{wid}'"):
        runs += 1
        hist = await client.get_workflow_handle(wid, run_id=wf.run_id).fetch_history()
        sched = started = None
        for ev in hist.events:
            events += 1
            t = ev.event_time.ToDatetime()
            first = t if first is None or t < first else first
            last = t if last is None or t > last else last
            if ev.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED:
                sched = t
            elif ev.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED and sched is not None:
                started = t
                wait.append((t - sched).total_seconds())
            elif ev.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
                tasks += 1
                if started is not None:
                    work.append((t - started).total_seconds())
                    if slowest is None or work[-1] > slowest[0]:
                        slowest = (work[-1], t, pending)
                pending = Counter()
            elif ev.event_type in (EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED,
                                   EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED):
                pending[EventType.Name(ev.event_type).removeprefix("EVENT_TYPE_WORKFLOW_EXECUTION_").lower()] += 1
    span = (last - first).total_seconds() if first and last else 0.0
    slow = (f"; slowest {slowest[0] * 1000:.0f} ms at +{(slowest[1] - first).total_seconds():.1f} s, after "
            f"{dict(slowest[2]) or 'no message'}") if slowest and first else ""
    return (f"{tasks} workflow tasks, {events} events, {runs} run(s) over {span:.0f} s "
            f"({tasks / span if span else 0:.1f} tasks/s); per task: waiting p50 {pct(wait, 50) * 1000:.0f} / "
            f"p99 {pct(wait, 99) * 1000:.0f} ms, running p50 {pct(work, 50) * 1000:.0f} / p99 {pct(work, 99) * 1000:.0f} ms"
            + slow)


async def _timeline(client, wid: str) -> str:
    """One incident's history as `+seconds EVENT` steps from its start (where a drain's time went)."""
    from temporalio.api.enums.v1 import EventType

    hist = await client.get_workflow_handle(wid).fetch_history()
    t0 = None
    out = []
    for ev in hist.events[:40]:
        t = ev.event_time.ToDatetime()
        t0 = t0 or t
        name = EventType.Name(ev.event_type).removeprefix("EVENT_TYPE_")
        out.append(f"+{(t - t0).total_seconds():.2f} {name}")
    return "; ".join(out)


async def _closed(handle, node: str, seen: dict[str, float], deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            await handle.result()
            seen[node] = time.monotonic()
            return
        except Exception:  # noqa: BLE001 - not started yet
            await asyncio.sleep(0.05)


async def raw_drain_rate(st, n: int) -> tuple[float, float]:
    """The raw limit of the drain path on this server, in the same run: `n` signal-with-starts (64 in
    flight) of a workflow whose one activity is the "drain", timed to the last activity; no NATS,
    router, FleetGuard or policy. Returns (drains/s, Temporal CPU % of one core)."""
    import uuid

    from temporalio import activity
    from temporalio.client import Client
    from temporalio.worker import Worker

    from bench.sws_workflow import DrainOnce

    done: list[float] = []

    @activity.defn(name="bench_drain")
    async def bench_drain(_wid: str) -> None:
        done.append(time.monotonic())

    client = await Client.connect(st.temporal_address)
    tq = f"raw-{uuid.uuid4().hex[:6]}"
    sem = asyncio.Semaphore(64)

    async def one(i: int) -> None:
        async with sem:
            await client.start_workflow(DrainOnce.run, id=f"raw-drain-{tq}-{i}", task_queue=tq,
                                        start_signal="ev", start_signal_args=[i])

    meter = CpuMeter({"temporal": st.procs[1].pid})
    async with Worker(client, task_queue=tq, workflows=[DrainOnce], activities=[bench_drain],
                      max_concurrent_workflow_tasks=8):
        t0 = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(n)))
        while len(done) < n and time.monotonic() < t0 + 300:
            await asyncio.sleep(0.05)
    return (len(done) / (max(done) - t0) if done else 0.0), meter.read()["temporal"][0]


async def raw_pool_rate(st, n: int) -> float:
    """The raw limit of the permit pool here: `n` claims (64 in flight, as the router's node
    senders make them) against one cluster's pool with room for all, timed to the last; claims/s."""
    import nats

    from fleetmend.infra.permit_pool import PermitPool

    nc = await nats.connect(st.nats_url)
    try:
        pool = await PermitPool.open(nc.jetstream())
        await pool.publish("rawpool", budget=n, rack_cap=n, open=True)
        sem = asyncio.Semaphore(64)

        async def one(i: int) -> bool:
            async with sem:
                return (await pool.claim("rawpool", f"r{i:06d}", f"k{i % 100}")).ok

        t0 = time.monotonic()
        ok = await asyncio.gather(*(one(i) for i in range(n)))
        took = time.monotonic() - t0
        assert all(ok), "a claim was refused with room for all"
        return n / took
    finally:
        await nc.close()


async def main(a: argparse.Namespace) -> int:
    async with stack() as st:
        raw = await raw_drain_rate(st, a.raw_drains) if a.raw_drains else None
        raw_pool = await raw_pool_rate(st, a.raw_drains) if a.raw_drains else None
        results = [await measure(st, m, a) for m in a.modes.split(",")]
    rows = [("machine", machine()), ("simulated nodes (heartbeat 10 s each)", f"{a.nodes:,}"),
            ("permit path", "the default: a fault that must drain now is cordoned by the router under a permit "
                            "pool slot; the rest wait at FleetGuard"),
            ("background fault lines/s", f"{a.background}")]
    if raw is not None:
        rows.append(("raw limit: signal-with-start + one activity (the least a drain takes), /s",
                     f"{raw[0]:.1f} ({a.raw_drains} at 64 in flight, before the modes; Temporal {raw[1]:.0f} % "
                     "of a core)"))
    if raw_pool is not None:
        rows.append(("raw limit: permit pool claims (compare-and-set on JetStream KV, 64 in flight), /s",
                     f"{raw_pool:.0f} ({a.raw_drains} claims)"))
    bad = False
    for r in results:
        lat, m = r["lat"], r["mode"]
        how = (f"{r['count']} at once (sent in {r['send_s']:.2f} s)" if m == "burst"
               else f"{r['count']} at {a.rate:g}/s (sent in {r['send_s']:.1f} s)")
        rows.append((f"{m}: measured XID 79 faults", how))
        rows.append((f"{m}: p50 / p90 / p99 / max s" + (" (of those drained)" if m == "burst" else ""),
                     f"{pct(lat, 50):.3f} / {pct(lat, 90):.3f} / {pct(lat, 99):.3f} / "
                     f"{max(lat) if lat else float('nan'):.3f}  (missing {len(r['missing'])} of {r['count']}"
                     f" after {a.deadline:g} s)"))
        if r["missing"] and m != "burst":  # a burst is judged by its window: the budget queues most
            bad = True
            rows.append((f"{m}: MISSING", ", ".join(r["missing"][:20]) + (" …" if len(r["missing"]) > 20 else "")))
        if m != "observe-only":
            over = r["peak"] > r["budget"] or r["peak_rack"] > r["rack_cap"]
            bad |= over
            cap = "open" if r["budget"] >= int(OPEN) else str(r["budget"])
            rcap = "open" if r["rack_cap"] >= int(OPEN) else str(r["rack_cap"])
            rows.append((f"{m}: most drained at once (drain records) / budget",
                         f"{r['peak']} / {cap}; per rack {r['peak_rack']} ({r['worst_rack'] or '-'}) / {rcap}"
                         f"{'  OVER BUDGET' if over else ''}  ({r['drain_records']} records)"))
        w = r["window"]
        if w is not None:
            bad |= bool(w["neither"]) or w["at_s"] > a.burst_window
            rows.append((f"{m}: drained or visibly queued", f"{w['drained']} drained + {w['queued']} queued of "
                         f"{r['count']} at {w['at_s']:.1f} s (window {a.burst_window:g} s); reasons "
                         f"{w['reasons']}; neither {len(w['neither'])}"
                         + (f": {', '.join(w['neither'][:10])}" if w["neither"] else "")))
        if r["guard"]:
            rows.append((f"{m}: FleetGuard history", r["guard"]))
        if r.get("hb"):
            h = r["hb"]
            rows.append((f"{m}: router tracking heartbeats alone ({h['window_s']:.0f} s)",
                         f"{h['rate']:,.0f} heartbeats/s seen of {h['target']:,.0f}/s wanted (the simulator's rate); "
                         f"router {h['cpu']:.0f} % of a core, RSS {h['rss']:.0f} MiB"))
        rows.append((f"{m}: CPU % router / worker / temporal",
                     " / ".join(f"{r['cpu'][k][0]:.0f}" for k in ("router", "worker", "temporal"))))
    rows.append(("NVSentinel reference (1,500 nodes)", "p50 0.37 s, p90 0.48 s"))
    table(f"Quarantine latency ({time.strftime('%Y-%m-%d %H:%M')})", rows)
    return 1 if bad else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=10_000, help="simulated background nodes")
    ap.add_argument("--faults", type=int, default=50, help="measured faults (distinct nodes) per paced mode")
    ap.add_argument("--rate", type=float, default=2.0, help="measured failing nodes per second")
    ap.add_argument("--burst", type=int, default=1000, help="nodes failing at once in mode `burst`")
    ap.add_argument("--burst-window", type=float, default=30.0,
                    help="seconds within which a burst must be drained or visibly queued")
    ap.add_argument("--budget", type=int, default=20, help="burst: max drained nodes")
    ap.add_argument("--per-rack", type=int, default=2, help="burst: max drained per rack")
    ap.add_argument("--rack-size", type=int, default=16, help="burst: measured nodes per rack")
    ap.add_argument("--deadline", type=float, default=60.0, help="seconds to wait for each measured node")
    ap.add_argument("--background", type=float, default=1.0, help="background fault lines per second")
    ap.add_argument("--modes", default="observe-only,real-drain", help="observe-only, real-drain, burst")
    ap.add_argument("--raw-drains", type=int, default=0, metavar="N",
                    help="first measure the raw limit: N signal-with-starts of a one-activity workflow")
    ap.add_argument("--hb-window", type=float, default=10.0,
                    help="seconds of heartbeats alone before the measured faults (router CPU and memory); 0: none")
    ap.add_argument("--profile", metavar="DIR", help="py-spy the worker into DIR; report the FleetGuard's task rate")
    a = ap.parse_args()
    sys.exit(asyncio.run(main(a)))
