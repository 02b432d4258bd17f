"""The fail-slow analyzer: the comparator's rule on simulated fleets (every degraded pattern found,
no healthy node called slow, one spike never counts, idle GPUs not judged on load, small groups
reported, state carried over), then the service on a real nats-server: samples through the perf
stream, one active replica of two (KV lease), findings published once on the node's fault subject,
failover with state, bad samples dead-lettered."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timezone

import pytest

from fleetmend.analyzer.core import Comparator, finding_event
from fleetmend.analyzer.metrics import derive
from fleetmend.config import AnalyzerSettings, load_settings
from fleetmend.dev.perfsim import HW, PATTERNS, PerfFleet
from fleetmend.events import FaultEvent, Severity, Source
from fleetmend.telemetry import GpuPerf, HardwareClass, PerfSample

T0 = 1_800_000_000.0  # a window boundary (divisible by 300)


def run_fleet(fleet: PerfFleet, comparator: Comparator, hours: float, start: float = T0,
              via_samples: bool = False, jobs: bool = True) -> dict[str, list]:
    """Feed `hours` of `fleet`, a sample a minute per node; with `jobs`, each busy node also says
    which job it runs (as its job's step times would)."""
    found: dict[str, list] = {}
    for step in range(int(hours * 60)):
        t = start + step * 60 + 30
        for i, n in enumerate(fleet.fleet):
            if via_samples:
                s = fleet.sample(i, t)
                comparator.add(s.node, s.hw.key, s.at.timestamp(), derive(s)[1])
            else:
                comparator.add(n.name, HW.key, t, fleet.derived(i, t))
            job = fleet.job_of(i)
            if jobs and job is not None:
                comparator.note_job(n.name, job, t)
        for w in comparator.due(t):
            for f in comparator.close_window(w).findings:
                found.setdefault(f.node, []).append(f)
    return found


def test_every_degraded_pattern_found_and_no_healthy_node() -> None:
    fleet = PerfFleet(120, slow_nodes=len(PATTERNS), slowdown=0.05, seed=11, slow_from=T0 + 3600)
    found = run_fleet(fleet, Comparator(AnalyzerSettings()), hours=3)
    assert set(found) == set(fleet.slow), (fleet.slow, {n: [f.metric for f in fs] for n, fs in found.items()})
    expect = {"clocks": "sm_clock_ratio", "power_brake": "power_brake_frac", "pcie": "pcie_width_ratio",
              "ib": "ib_symbol_errors_per_min", "thermal": "thermal_frac"}
    for node, pattern in fleet.slow.items():
        metrics = {f.metric for f in found[node]}
        assert expect[pattern] in metrics, (pattern, metrics)
        first = min(f.window_end for f in found[node])
        assert first > T0 + 3600
        if pattern in ("power_brake", "pcie", "ib"):  # judged busy or idle: three windows after it began
            assert first <= T0 + 3600 + 4 * 300
    f = next(f for f in found[next(n for n, p in fleet.slow.items() if p == "clocks")] if f.metric == "sm_clock_ratio")
    # clocks under load are work-dependent: judged among the nodes of the node's own job, not the class
    assert f.windows == 3 and f.group.startswith(HW.key + " job:") and 8 <= f.group_size <= 16
    assert f.ratio == pytest.approx(0.95, abs=0.02) and len(f.values) == 3


def test_real_samples_give_the_same_verdicts() -> None:
    # the slowdowns start in the jobs (a node slower from its job's first window is its role's, rule 5b)
    fleet = PerfFleet(40, slow_nodes=2, slowdown=0.05, seed=5, slow_from=T0 + 1200)
    found = run_fleet(fleet, Comparator(AnalyzerSettings()), hours=1.0, via_samples=True)
    assert set(found) == set(fleet.slow)


def _sample(node: str, t: float, util: float, clock_ratio: float, temp: float = 60.0, brake: float = 0.0,
            gpus: int = 8, model: str = "NVIDIA H200") -> PerfSample:
    return PerfSample(cluster="c", node=node, at=datetime.fromtimestamp(t, timezone.utc), interval_s=60,
                      hw=HardwareClass(gpu_model=model, gpu_count=gpus, driver="570"),
                      gpus=[GpuPerf(index=i, util_pct=util, sm_clock_mhz=1980 * clock_ratio, sm_clock_max_mhz=1980,
                                    temperature_c=temp, event_frac={"power_brake": brake}) for i in range(gpus)])


def feed(c: Comparator, samples, job: str | None = None) -> list:
    """File `samples` (all of them running `job` when given) and judge every window."""
    out = []
    for s in samples:
        c.add(s.node, s.hw.key, s.at.timestamp(), derive(s)[1])
        if job is not None:
            c.note_job(s.node, job, s.at.timestamp())
    for w in c.due(1e12):
        out += c.close_window(w).findings
    return out


def test_one_spike_per_window_never_counts() -> None:
    c = Comparator(AnalyzerSettings())
    samples = []
    for m in range(30):  # six windows
        t = T0 + m * 60 + 1
        for n in range(20):
            spike = n == 3 and m % 5 == 2  # node 3: one awful minute in every window
            samples.append(_sample(f"n{n}", t, 95, 0.5 if spike else 0.985 + 0.001 * (n % 3),
                                   brake=0.9 if spike else 0.0))
    assert feed(c, samples) == []


def test_idle_gpus_are_not_judged_on_load_dependent_metrics() -> None:
    c = Comparator(AnalyzerSettings())
    samples = []
    for m in range(20):
        t = T0 + m * 60 + 1
        for n in range(12):
            samples.append(_sample(f"busy{n}", t, 96, 0.985, temp=65))
        # idle nodes: clocks at idle level and cool; the busy nodes are hot and fast: neither is slow
        for n in range(12):
            samples.append(_sample(f"idle{n}", t, 0, 0.17, temp=32))
    assert feed(c, samples) == []
    # …but a busy node whose clocks fall among busy peers of its own job is (once its own offset in the job
    # is known, rule 5b: from its fourth window)
    c = Comparator(AnalyzerSettings())
    samples = [_sample(f"busy{n}", T0 + m * 60 + 1, 96, 0.93 if n == 0 and m >= 15 else 0.985)
               for m in range(35) for n in range(12)]
    found = feed(c, samples, job="j1")
    assert {(f.node, f.metric) for f in found} == {("busy0", "sm_clock_ratio")}
    # …and without knowing the job, clocks (work-dependent) are not judged at all: rather a miss
    c = Comparator(AnalyzerSettings())
    assert feed(c, samples) == []


def test_small_group_is_reported_and_judged_alone() -> None:
    c = Comparator(AnalyzerSettings(min_group_size=8))
    for m in range(5):
        for n in range(5):
            s = _sample(f"a{n}", T0 + m * 60 + 1, 96, 0.5 if n == 0 else 0.985, model="NVIDIA B200")
            c.add(s.node, s.hw.key, s.at.timestamp(), derive(s)[1])
            c.note_job(s.node, "j", s.at.timestamp())
    res = c.close_window(c.due(1e12)[0])
    assert res.findings == [] and res.outliers == 0  # the slow clock is work-dependent: a 5-node job is too small
    assert res.judged == 5 * len({g.metric for g in res.small_groups})  # each node against the fixed expectation
    assert {(g.metric, g.size, g.judged) for g in res.small_groups} >= {("power_brake_frac", 5, "expected")}
    assert res.small_job_groups >= 1  # sm_clock_ratio among the job's 5 nodes: counted, not listed per job
    assert all(g.group.startswith("NVIDIA B200x8") for g in res.small_groups)


def test_state_survives_a_restart_and_reports_once() -> None:
    cfg = AnalyzerSettings()
    k = AnalyzerSettings().job_baseline_windows  # n0 is like its peers while its own offset in the job is learnt (rule 5b)
    samples = lambda w: [_sample(f"n{n}", T0 + w * 300 + m * 60 + 1, 96, 0.9 if n == 0 and w >= k else 0.985)  # noqa: E731
                         for m in range(5) for n in range(10)]
    a = Comparator(cfg)
    assert feed(a, [s for w in range(k + 2) for s in samples(w)], job="j") == []
    state = json.loads(json.dumps(a.to_state()))
    b = Comparator(cfg)  # the restarted (or standby) replica
    b.load_state(state)
    assert b.streaks["n0"]["sm_clock_ratio"][0] == 2
    found = feed(b, samples(k + 2), job="j")
    assert [(f.node, f.windows, len(f.values)) for f in found] == [("n0", 3, 3)]
    assert feed(b, samples(k + 3), job="j") == []  # already reported: not again within reopen_after_s
    c = Comparator(cfg)
    c.load_state(json.loads(json.dumps(b.to_state())))
    assert feed(c, samples(k + 4), job="j") == []  # …also not after another restart


def test_finding_event_carries_the_evidence() -> None:
    c = Comparator(AnalyzerSettings())
    found = feed(c, [_sample(f"n{n}", T0 + m * 60 + 1, 96, 0.9 if n == 0 and m >= 15 else 0.985)
                     for m in range(30) for n in range(10)], job="j")
    ev = finding_event(found[0], "c")
    assert isinstance(ev, FaultEvent)
    assert (ev.kind, ev.severity, ev.source, ev.node, ev.device.index) == ("fail_slow", Severity.DEGRADED,
                                                                           Source.ANALYZER, "n0", 0)
    assert ev.attrs["metric"] == "sm_clock_ratio" and ev.attrs["windows"] == 3 and ev.attrs["group_size"] == 10
    assert ev.attrs["ratio"] == pytest.approx(0.9 / 0.985, abs=1e-3)
    assert ev.attrs["peer_median"] == pytest.approx(0.985)
    assert "peer median" in ev.message and "3 consecutive 300 s windows" in ev.message
    assert finding_event(found[0], "c").event_id == ev.event_id  # a second replica dedupes by Nats-Msg-Id
    FaultEvent.from_json_bytes(ev.to_json_bytes())


# ---------------------------------------------------------------------- the service on real NATS

class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


async def test_service_lease_findings_failover_and_deadletter(nats_server, nc, unique) -> None:
    from fleetmend import subjects
    from fleetmend.analyzer.service import Analyzer, analyzer_kv, lease_key, status_key
    from fleetmend.infra.jetstream import ensure_deadletter_stream, ensure_fault_stream, ensure_perf_stream

    cluster = f"fs{unique}"
    js = nc.jetstream()
    await ensure_perf_stream(js)
    await ensure_fault_stream(js)
    await ensure_deadletter_stream(js)
    kv = await analyzer_kv(js)
    s = load_settings(None, cluster=cluster, nats_url=nats_server.url,
                      analyzer={"window_s": 60, "grace_s": 5, "windows": 3, "lease_ttl_s": 3})
    now = datetime.now(timezone.utc).timestamp()
    start = (now // 60) * 60 - 600  # ten minutes of history, already in the stream's max age
    clock = Clock(start)
    a = Analyzer(s, nc, js, kv, holder="a", clock=clock, lease_clock=clock)
    b = Analyzer(s, nc, js, kv, holder="b", clock=clock, lease_clock=clock)
    faults = await nc.subscribe(subjects.fault_subject(cluster, "n0"))
    dead = await js.subscribe(subjects.DEADLETTER_SUBJECT, ordered_consumer=True)

    async def publish_minute(m: int) -> None:
        for n in range(10):
            smp = _sample(f"n{n}", start + m * 20 + 1, 96, 0.985, brake=0.2 if n == 0 else 0.0).model_copy(
                update={"cluster": cluster, "node": f"n{n}"})
            await nc.publish(subjects.perf_subject(cluster, f"n{n}"), smp.to_json_bytes())

    # 2 windows of 3 samples each before anyone runs: the replicas start from the stream
    for m in range(6):
        await publish_minute(m)
    await nc.publish(subjects.perf_subject(cluster, "n1"), b'{"schema_version": 1, "node": "n1"}')
    await nc.flush()
    await a.start()
    await b.start()
    assert await a.lease() is True and await b.lease() is False
    await asyncio.sleep(1.0)
    from tests.conftest import assert_eventually

    await assert_eventually(lambda: a.samples == 60 and b.samples == 60 and a.rejected == 1, timeout_s=10)
    clock.t = start + 120 + 10
    await a.tick()
    await b.tick()
    assert a.comparator.streaks["n0"]["power_brake_frac"][0] == 2
    dl = await dead.next_msg(timeout=5)
    rec = json.loads(dl.data)
    assert rec["subject"] == subjects.perf_subject(cluster, "n1") and "invalid perf sample" in rec["reason"]

    # a node whose clock is 2 minutes behind: its sample lands in a judged window, dropped and named
    late = _sample("n3", start + 1, 96, 0.985).model_copy(update={"cluster": cluster, "node": "n3"})
    await nc.publish(subjects.perf_subject(cluster, "n3"), late.to_json_bytes())
    await nc.flush()
    await assert_eventually(lambda: b.samples == 61, timeout_s=10)
    # the active replica stops (no release, no more samples); the standby takes over after the TTL
    await a._sub.unsubscribe()
    for m in range(6, 9):
        await publish_minute(m)
    await nc.flush()
    await assert_eventually(lambda: b.samples == 91, timeout_s=10)
    clock.t = start + 180 + 10
    assert await a.lease() is True  # its last renewal before it dies
    res = await b.tick()  # lease still a's (not expired): judges, publishes nothing
    assert b.active is False and res[0].findings and b.published == []
    clock.t += s.analyzer.lease_ttl_s + 1
    assert await b.lease() is True  # takes over: the holder's state replaces its own judgement
    assert b.comparator.streaks["n0"]["power_brake_frac"][0] == 2 and b.comparator.reported == {}
    # window 2 stays judged (not re-counted); window 3 makes the third outlier window in a row
    for m in range(9, 12):
        await publish_minute(m)
    await nc.flush()
    await assert_eventually(lambda: b.samples == 121, timeout_s=10)
    clock.t = start + 240 + 10
    await b.tick()
    assert len(b.published) == 1
    msg = await faults.next_msg(timeout=5)
    ev = FaultEvent.from_json_bytes(msg.data)
    assert ev.kind == "fail_slow" and ev.node == "n0" and ev.attrs["metric"] == "power_brake_frac"
    assert ev.event_id == b.published[0]
    status = json.loads((await kv.get(status_key(cluster))).value)  # written by the active replica
    assert status["holder"] == "b" and status["window_end"] == start + 240
    assert status["clock_skew"] == {"n3": {"late": 1}} and status["clock_skew_nodes"] == 1
    entry = await kv.get(lease_key(cluster))
    assert json.loads(entry.value)["holder"] == "b"
    await b.release()
    from nats.js.errors import KeyNotFoundError

    with pytest.raises(KeyNotFoundError):  # released: the key is gone, a standby takes it at once
        await kv.get(lease_key(cluster))
    await faults.unsubscribe()
    await dead.unsubscribe()
    await b._sub.unsubscribe()


async def test_analyzer_and_node_credentials_cover_telemetry(tmp_path_factory, unique) -> None:
    """With `fleetmend creds generate` permissions: a node publishes its own perf samples and job
    steps (not another node's), and the analyzer role reads them, holds its lease, writes its state and publishes
    fail_slow on the node's fault subject."""
    import nats

    from fleetmend import subjects
    from fleetmend.analyzer.service import Analyzer, analyzer_kv
    from fleetmend.dev import servers
    from fleetmend.infra import security
    from fleetmend.infra.connect import connect_nats
    from fleetmend.infra.jetstream import ensure_deadletter_stream, ensure_fault_stream, ensure_perf_stream
    from tests.conftest import assert_eventually

    d = tmp_path_factory.mktemp("secanalyzer")
    cluster = "secp"
    cs = security.generate(d / "creds", cluster, [f"n{i}" for i in range(10)])
    conf = d / "nats.conf"
    conf.write_text(security.server_conf(cs.accounts_conf))
    port = servers.free_port()
    proc = servers.start_nats(d / "js", port, config_file=conf)
    url = f"nats://127.0.0.1:{port}"
    try:
        admin = await nats.connect(url, nkeys_seed=str(cs.seed_file("admin")))
        await ensure_fault_stream(admin.jetstream())
        await ensure_deadletter_stream(admin.jetstream())
        s = load_settings(None, cluster=cluster, nats_url=url, nats_nkey_seed=str(cs.seed_file("analyzer")),
                          nats_inbox_prefix=security.role_inbox_prefix("analyzer"),
                          analyzer={"window_s": 60, "grace_s": 5, "windows": 3})
        anc = await connect_nats(s, name="analyzer")
        ajs = anc.jetstream()
        await ensure_perf_stream(ajs)
        start = (datetime.now(timezone.utc).timestamp() // 60) * 60 - 300
        clock = Clock(start)
        a = Analyzer(s, anc, ajs, await analyzer_kv(ajs), holder="a", clock=clock, lease_clock=clock)
        await a.start()
        assert await a.lease() is True
        errors: list[str] = []

        async def err_cb(e: Exception) -> None:
            errors.append(str(e))

        nodes = {}
        for i in range(10):
            nodes[i] = await nats.connect(url, nkeys_seed=str(cs.seed_file(f"node:{cluster}/n{i}")),
                                          inbox_prefix=security.node_inbox_prefix(cluster, f"n{i}"), error_cb=err_cb)
        for m in range(12):
            for i in range(10):
                smp = _sample(f"n{i}", start + m * 20 + 1, 96, 0.985, brake=0.2 if i == 0 else 0.0).model_copy(
                    update={"cluster": cluster})
                await nodes[i].publish(subjects.perf_subject(cluster, f"n{i}"), smp.to_json_bytes())
        spoof = _sample("n0", start + 1, 96, 0.5).model_copy(update={"cluster": cluster})
        await nodes[1].publish(subjects.perf_subject(cluster, "n0"), spoof.to_json_bytes())  # not its own
        for c in nodes.values():
            await c.flush()
        await assert_eventually(lambda: a.samples == 120, timeout_s=10, what="analyzer read the node samples")
        await assert_eventually(lambda: any("permissions violation" in e and "perf.n0" in e for e in errors),
                                timeout_s=5, what="spoofed perf publish refused")
        # a job report names its sender in the subject: n1 may report its own ranks, never n0's
        own = json.dumps({"v": 1, "cluster": cluster, "job": "7", "steps": [[0, "n1", 1, 1.0, start + 2]]}).encode()
        await nodes[1].publish(subjects.job_subject(cluster, "n1", "7"), own)
        await nodes[1].publish(subjects.job_subject(cluster, "n0", "7"), own.replace(b'"n1"', b'"n0"'))
        await nodes[1].flush()
        await assert_eventually(lambda: a.job_steps == 1, timeout_s=10, what="analyzer read n1's own job step")
        await assert_eventually(lambda: any("permissions violation" in e and "job.n0.7" in e for e in errors),
                                timeout_s=5, what="job report on another node's subject refused")
        faults = await admin.subscribe(subjects.fault_subject(cluster, "n0"))
        clock.t = start + 240 + 10
        await a.tick()
        assert len(a.published) == 1
        ev = FaultEvent.from_json_bytes((await faults.next_msg(timeout=5)).data)
        assert ev.kind == "fail_slow" and ev.node == "n0"
        assert (await a.kv.get("state." + cluster)).value  # the state was written with analyzer credentials
        await a.release()
        for c in [*nodes.values(), anc, admin]:
            await c.close()
    finally:
        proc.stop()
