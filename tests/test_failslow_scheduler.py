"""A job's ranks from the scheduler, and the analyzer's domain findings to FleetGuard, through the worker
(issue 28, points 1 and 2; `fleetmend.worker.analyzer_link`).

- The comparator groups a job's nodes by the scheduler's word (`note_sched`), so nodes of a job whose
  ranks report no step times are still compared on the metrics that depend on the work.
- The worker's job publisher lists the scheduler's running jobs on `fleet.<cluster>.sched.jobs`; the real
  analyzer takes them up, and no longer believes a node reporting steps of a job the scheduler runs
  elsewhere.
- The Slurm adapter lists a real job's nodes; the Kubernetes adapter a job's pods' nodes (kmock).
- The domain relay reads the analyzer's status from its KV bucket and signals FleetGuard when the list
  of domains changes (and again while it lasts), never from a stopped analyzer.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import pytest

from fleetmend import subjects
from fleetmend.analyzer.core import Comparator
from fleetmend.config import AnalyzerSettings, load_settings
from fleetmend.messages import GuardApi
from fleetmend.worker.analyzer_link import DOMAIN_REFRESH_S, DomainRelay, JobPublisher, domain_report, job_list_parts
from tests.conftest import assert_eventually
from tests.test_security import secured  # noqa: F401 - the secured nats-server fixture

T0 = 1_800_000_000.0
W = 300.0


def _feed(c: Comparator, windows: int, sched: bool) -> list[tuple[int, str, str]]:
    """16 busy H200 nodes of one job (j7) whose ranks report no step times; n03's clocks are 5 % low
    from window 3 on (its clocks held by the power cap: no clocks-event reason is free)."""
    found = []
    for w in range(windows):
        for k in range(5):
            t = T0 + w * W + k * 60 + 1
            for n in range(16):
                v = 0.97 - 0.001 * (n % 3) - (0.05 if n == 3 and w >= 3 else 0.0)
                c.add(f"n{n:02d}", "H200x8", t, {"sm_clock_ratio": (v, "gpu:0"), "power_cap_frac": (0.2, "gpu:0")},
                      now=t)
                if sched:
                    c.note_sched(f"n{n:02d}", "j7", t, now=t)
        res = c.close_window(c.window_of(T0 + w * W + 1))
        found += [(w, f.node, f.metric) for f in res.findings]
    return found


def test_the_scheduler_s_word_groups_a_job_whose_ranks_report_nothing() -> None:
    assert _feed(Comparator(AnalyzerSettings()), 8, sched=False) == []  # no job known: not judged on clocks
    found = _feed(Comparator(AnalyzerSettings()), 8, sched=True)
    assert found == [(5, "n03", "sm_clock_ratio")], found


def test_a_node_the_scheduler_puts_in_two_jobs_is_not_judged_on_work() -> None:
    c = Comparator(AnalyzerSettings())
    for k in range(5):
        t = T0 + k * 60 + 1
        for n in range(16):
            c.add(f"n{n:02d}", "H200x8", t, {"power_cap_frac": (0.9 if n == 0 else 0.1, "gpu:0")}, now=t)
            c.note_sched(f"n{n:02d}", "j1", t, now=t)
            c.note_job(f"n{n:02d}", "reported-other-name", t, now=t)  # the scheduler's word comes first
        c.note_sched("n00", "j2", t, now=t)
    res = c.close_window(c.window_of(T0 + 1))
    assert res.no_job == 1 and res.outliers == 0


def test_job_lists_are_split_into_bounded_parts_without_splitting_a_job() -> None:
    jobs = {f"j{i}": [f"gpu{i:03d}-{k}" for k in range(64)] for i in range(100)}
    parts = job_list_parts("c", jobs, T0, max_bytes=8_000)
    assert len(parts) > 1 and all(len(p) < 8_000 + 1_000 for p in parts)
    merged: dict[str, list[str]] = {}
    for p in parts:
        d = json.loads(p)
        assert d["v"] == 1 and d["cluster"] == "c" and not set(d["jobs"]) & set(merged)
        merged.update(d["jobs"])
    assert merged == jobs
    assert json.loads(job_list_parts("c", {}, T0)[0])["jobs"] == {}


class _Adapter:
    def __init__(self, jobs: dict[str, list[str]]) -> None:
        self.jobs = jobs

    async def running_jobs(self) -> dict[str, list[str]]:
        return self.jobs


async def test_the_worker_publishes_the_scheduler_s_jobs_and_the_analyzer_takes_them(nats_server, nc) -> None:
    from fleetmend.analyzer.service import Analyzer, analyzer_kv
    from fleetmend.infra.jetstream import ensure_perf_stream

    cluster = f"s{uuid.uuid4().hex[:8]}"
    s = load_settings(None, cluster=cluster, nats_url=nats_server.url)
    js = nc.jetstream()
    await ensure_perf_stream(js)
    clock = type("C", (), {"t": time.time(), "__call__": lambda self: self.t})()
    a = Analyzer(s, nc, js, await analyzer_kv(js), holder="t", clock=clock, lease_clock=clock)
    await a.start()
    try:
        pub = JobPublisher(s, nc, _Adapter({"4242": ["gpu01", "gpu02", "gpu03"], "ns/train": ["gpu04"]}))
        assert await pub.refresh() == 2
        await assert_eventually(lambda: len(a.sched_jobs) == 2, what="the analyzer has the scheduler's jobs")
        assert a.sched_jobs["4242"][0] == {"gpu01", "gpu02", "gpu03"}
        now = clock()
        nw = a.comparator.open[a.comparator.window_of(now)]
        assert nw["gpu01"].sched == {"4242"} and nw["gpu04"].sched == {"ns/train"}

        # gpu09 (a known node, not in job 4242) reports steps of 4242: not believed
        from datetime import datetime, timezone

        from fleetmend.telemetry import GpuPerf, HardwareClass, PerfSample

        a.add(PerfSample(cluster=cluster, node="gpu09", at=datetime.fromtimestamp(now, timezone.utc), interval_s=60,
                         hw=HardwareClass(gpu_model="NVIDIA H200", gpu_count=8, driver="570"),
                         gpus=[GpuPerf(index=0, util_pct=96, sm_clock_mhz=1950, sm_clock_max_mhz=1980)]))
        body = {"v": 1, "cluster": cluster, "job": "4242", "steps": [[0, "gpu09", 1, 1.0, now]]}
        await nc.publish(subjects.job_subject(cluster, "gpu09", "4242"), json.dumps(body).encode())
        await assert_eventually(lambda: a.jobs.dropped["not_in_job"] == 1, what="the fake rank dropped")
        assert a.job_steps == 0
        assert a.status()["scheduler_jobs"] == 2
        # a malformed list is dead-lettered, a bad node name skipped and counted
        await nc.publish(subjects.sched_jobs_subject(cluster), b"[1, 2]")
        await nc.publish(subjects.sched_jobs_subject(cluster), json.dumps(
            {"v": 1, "cluster": cluster, "at": now, "jobs": {"5": ["ok-node", "bad node"]}}).encode())
        await assert_eventually(lambda: a.rejected == 1 and a.comparator.dropped["sched.invalid"] == 1,
                                what="bad input counted")
        assert a.sched_jobs["5"][0] == {"ok-node"}
    finally:
        for sub in (a._sub, a._job_sub, a._sched_sub):
            await sub.unsubscribe()


class _Client:
    """Records FleetGuard signal-with-starts (`Client.start_workflow`)."""

    def __init__(self) -> None:
        self.signals: list[tuple[str, Any]] = []

    async def start_workflow(self, wf: str, inp: Any, **kw: Any) -> None:
        self.signals.append((kw["start_signal"], kw["start_signal_args"][0]))


async def test_the_relay_signals_fleetguard_when_the_analyzer_s_domains_change(nats_server, nc) -> None:
    from fleetmend.analyzer.service import analyzer_kv

    cluster = f"r{uuid.uuid4().hex[:8]}"
    s = load_settings(None, cluster=cluster, nats_url=nats_server.url)
    js = nc.jetstream()
    kv = await analyzer_kv(js)
    t = [time.time()]
    client = _Client()
    relay = DomainRelay(client, s, js, clock=lambda: t[0])
    assert await relay.refresh() is None  # no status yet

    async def status(end: float, domains: list[dict]) -> None:
        await kv.put(subjects.analyzer_status_key(cluster), json.dumps({"window_end": end, "domains": domains}).encode())

    rack = {"key": "rack:r7", "nodes": ["b", "a"], "metrics": ["thermal_frac"], "windows": 3, "share": 0.4}
    await status(t[0] - 60, [rack])
    rep = await relay.refresh()
    assert rep is not None and [(f.key, f.nodes) for f in rep.findings] == [("rack:r7", ["b", "a"])]
    assert client.signals[-1][0] == GuardApi.DOMAINS and client.signals[-1][1].cluster == cluster
    assert await relay.refresh() is None  # unchanged
    t[0] += DOMAIN_REFRESH_S + 1
    await status(t[0] - 60, [rack])
    assert await relay.refresh() is not None  # unchanged but due again while it lasts
    await status(t[0] - 60, [])
    rep = await relay.refresh()
    assert rep is not None and rep.findings == []  # cleared: FleetGuard closes the incident
    assert await relay.refresh() is None
    t[0] += 7200
    await status(t[0] - 3600, [rack])  # an analyzer that stopped an hour ago: not relayed
    assert await relay.refresh() is None and len(client.signals) == 3


def test_domain_report_is_bounded() -> None:
    rep = domain_report("c", {"window_end": T0, "domains": [
        {"key": f"rack:{i}", "nodes": [f"n{k}" for k in range(2000)], "metrics": ["x"], "windows": 3}
        for i in range(80)] + [{"nope": 1}]})
    assert len(rep.findings) == 50 and len(rep.findings[0].nodes) == 1000
    assert rep.window_end is not None and rep.window_end.timestamp() == T0


@pytest.mark.slurm
async def test_slurm_lists_a_running_job_s_nodes(slurm) -> None:
    from activities.slurm import SlurmScheduler
    from fleetmend.config import SlurmSettings

    job = slurm.run("sbatch", "--parsable", "-N", "2", "-w", "node2,node3", "-o", "/dev/null",
                    "--wrap", "sleep 60").stdout.strip().split(";")[0]
    sched = SlurmScheduler(SlurmSettings(slurm_conf=str(slurm.conf), command_timeout_s=15))
    try:
        async def listed():
            jobs = await sched.running_jobs()
            return jobs if jobs.get(job) else None

        jobs = await assert_eventually(listed, timeout_s=30, what=f"job {job} running")
        assert jobs[job] == ["node2", "node3"]
    finally:
        slurm.run("scancel", job, check=False)
        await asyncio.sleep(0.5)


async def test_kubernetes_lists_a_job_s_pods_nodes() -> None:
    import kmock

    from activities.kubernetes import KubernetesScheduler
    from fleetmend.config import KubernetesSettings

    pods = kmock.resource("", "v1", "pods")
    async with kmock.KubernetesEmulator() as k8s, kmock.Server(k8s) as srv:
        k8s.resources["v1/pods"] = {}

        def pod(ns: str, name: str, node: str, labels: dict, phase: str = "Running") -> None:
            k8s.objects[pods, ns, name] = {"apiVersion": "v1", "kind": "Pod",
                                           "metadata": {"name": name, "namespace": ns, "labels": labels},
                                           "spec": {"nodeName": node, "containers": [{"name": "c", "image": "i"}]},
                                           "status": {"phase": phase}}

        pod("ml", "train-0", "gpu-1", {"batch.kubernetes.io/job-name": "train", "job-name": "train"})
        pod("ml", "train-1", "gpu-2", {"batch.kubernetes.io/job-name": "train"})
        pod("ml", "train-2", "gpu-2", {"batch.kubernetes.io/job-name": "train"})
        pod("ml", "done", "gpu-3", {"batch.kubernetes.io/job-name": "train"}, phase="Succeeded")
        pod("rl", "w-0", "gpu-4", {"training.kubeflow.org/job-name": "ppo"})
        pod("rl", "web", "gpu-5", {"app": "web"})
        s = KubernetesScheduler(KubernetesSettings(api_url=str(srv.url).rstrip("/")))
        assert await s.running_jobs() == {"ml/train": ["gpu-1", "gpu-2"], "rl/ppo": ["gpu-4"]}


async def test_only_the_worker_lists_jobs_and_it_reads_the_analyzer_s_status(secured) -> None:  # noqa: F811
    """Credentials (`fleetmend.infra.security`): the worker publishes the scheduler's jobs and reads the
    analyzer's status; the analyzer hears the jobs; a node can publish neither."""
    import nats

    from fleetmend.analyzer.service import analyzer_kv
    from fleetmend.infra import security
    from tests.test_security import CLUSTER, node_client

    url, cs = secured
    analyzer = await nats.connect(url, nkeys_seed=str(cs.seed_file("analyzer")),
                                  inbox_prefix=security.role_inbox_prefix("analyzer"))
    worker = await nats.connect(url, nkeys_seed=str(cs.seed_file("worker")),
                                inbox_prefix=security.role_inbox_prefix("worker"))
    errors: list[str] = []
    n1 = await node_client(url, cs, "n1", errors)
    try:
        got: list[bytes] = []

        async def heard(msg: Any) -> None:
            got.append(msg.data)

        await analyzer.subscribe(subjects.sched_jobs_subject(CLUSTER), cb=heard)
        await analyzer.flush()
        await n1.publish(subjects.sched_jobs_subject(CLUSTER), b"from a node")
        await worker.publish(subjects.sched_jobs_subject(CLUSTER), b"from the worker")
        await assert_eventually(lambda: got == [b"from the worker"] and any(
            "permissions violation for publish" in e and "sched.jobs" in e for e in errors), what="only the worker")

        kv = await analyzer_kv(analyzer.jetstream())
        await kv.put(subjects.analyzer_status_key(CLUSTER), json.dumps({"window_end": time.time(), "domains": [
            {"key": "rack:r1", "nodes": ["n1"], "metrics": ["thermal_frac"], "windows": 3}]}).encode())
        client = _Client()
        relay = DomainRelay(client, load_settings(None, cluster=CLUSTER, nats_url=url), worker.jetstream())
        rep = await relay.refresh()
        assert rep is not None and rep.findings[0].key == "rack:r1" and len(client.signals) == 1
    finally:
        for c in (analyzer, worker, n1):
            await c.close()
