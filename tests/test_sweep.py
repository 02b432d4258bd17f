"""`fleetmend sweep`: hostlist expansion, the comparison rule, the agent's built-in checks, and end to
end with real NATS, Temporal and real agents whose `agent.bench_command` prints set values: the
slowed node is flagged (and with --act gets a fail_slow event), a node without an agent is listed as
not answering, healthy nodes are not flagged."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from activities.slurm import SlurmScheduler, expand_hostlist
from fleetmend.config import SlurmSettings
from fleetmend.sweep import compare, findings, lower_is_better


def test_expand_hostlist() -> None:
    assert expand_hostlist("gpu[01-03,07]") == ["gpu01", "gpu02", "gpu03", "gpu07"]
    assert expand_hostlist("a[1-2]b[08-09],c5,a1b08") == ["a1b08", "a1b09", "a2b08", "a2b09", "c5"]
    assert expand_hostlist("node7") == ["node7"]
    assert expand_hostlist("gpu[9-11]") == ["gpu9", "gpu10", "gpu11"]
    for bad in ("gpu[01-", "gpu]1[", "gpu[a-b]", "gpu[5-2]"):
        with pytest.raises(ValueError):
            expand_hostlist(bad)


@given(st.lists(st.integers(0, 999), min_size=1, max_size=30, unique=True))
def test_hostlist_matches_enumeration(nums: list[int]) -> None:
    expr = "n[" + ",".join(f"{n:03d}" for n in nums) + "]"
    assert expand_hostlist(expr) == [f"n{n:03d}" for n in nums]


def test_scontrol_agrees_when_installed() -> None:
    if not __import__("shutil").which("scontrol"):
        pytest.skip("no scontrol here")
    assert asyncio.run(SlurmScheduler(SlurmSettings()).expand("gpu[01-03,07]")) == expand_hostlist("gpu[01-03,07]")


def test_compare_orientation_outliers_and_small_metrics() -> None:
    assert lower_is_better("step_time_ms") and lower_is_better("allreduce_latency_us") and lower_is_better("load_s")
    assert not lower_is_better("tokens_per_s") and not lower_is_better("busbw_gbps") and not lower_is_better("tflops")
    reports = {f"n{i}": {"tflops": 100.0, "step_time_ms": 80.0} for i in range(6)}
    reports["n2"] = {"tflops": 94.0, "step_time_ms": 80.0}  # 6 % below: outlier at 5 %
    reports["n3"] = {"tflops": 100.0, "step_time_ms": 88.0}  # 10 % slower steps: outlier
    reports["n4"] = {"tflops": 97.0, "step_time_ms": 81.0, "rare": 1.0}  # 3 %: fine; "rare" only here
    res = compare("c", "s1", reports, 5.0)
    assert res.outliers == ["n2", "n3"]
    n3 = next(r for r in res.rows if r.node == "n3")
    assert n3.worst_metric == "step_time_ms" and n3.worst_ratio == pytest.approx(80 / 88)
    assert res.not_judged == ["rare"]
    assert {f.node: f.metric for f in findings(res)} == {"n2": "tflops", "n3": "step_time_ms"}
    assert compare("c", "s1", reports, 7.0).outliers == ["n3"]


def test_reports_and_results_are_bounded_with_a_note() -> None:
    """A node answering 13,000 metrics (issue 28: a ~1 MB answer made the result exceed Temporal's
    2 MiB payload limit) keeps 128 and a note; a result past `MAX_RESULT_CELLS` keeps each node's
    outlying and worst cells and says so; each metric's noise is summarised."""
    import json
    from dataclasses import asdict

    from fleetmend.sweep import MAX_METRICS_PER_NODE, MAX_RESULT_CELLS, clip_report, clip_result

    huge = {f"m{i:05d}_per_s": 1.0 for i in range(13_000)}
    metrics, skipped, noise = clip_report(huge, {f"k{i}": "x" * 5000 for i in range(100)}, {"m00000_per_s": 2.0})
    assert len(metrics) == MAX_METRICS_PER_NODE and "13000 metrics reported" in skipped["clipped"]
    assert max(len(v) for v in skipped.values()) <= 300 and "clipped_skipped" in skipped and noise == {"m00000_per_s": 2.0}
    reports = {f"n{i:03d}": {f"m{k:03d}": 100.0 for k in range(MAX_METRICS_PER_NODE)} for i in range(200)}
    reports["n007"]["m005"] = 50.0
    res = compare("c", "s", reports, 5.0, noise_pct={"n000": {"m000": 1.0}, "n001": {"m000": 3.0}})
    assert res.noise_pct == {"m000": 2.0} and res.noise_max_pct == {"m000": 3.0}
    res = clip_result(res)
    assert res.clipped and sum(len(r.metrics) for r in res.rows) <= MAX_RESULT_CELLS
    assert next(r for r in res.rows if r.node == "n007").metrics["m005"].outlier and res.outliers == ["n007"]
    assert len(json.dumps(asdict(res))) < 2 * 1024 * 1024


def test_builtin_host_checks_measure_something() -> None:
    from agents.bench import run_bench
    from fleetmend.diagnostics import BenchRequest

    rep = asyncio.run(run_bench(BenchRequest(host_seconds=0.2), cluster="c", node="n", nvml=None,
                                bench_command=[sys.executable, "-c", "print('progress...'); print('{\"x_per_s\": 3}')"]))
    assert rep.metrics["mem_copy_gbps"] > 0 and rep.metrics["cpu_sha256_mbps"] > 0 and rep.metrics["cpu_zlib_mbps"] > 0
    assert rep.metrics["x_per_s"] == 3.0 and "gpu" in rep.skipped
    bad = asyncio.run(run_bench(BenchRequest(builtin=False), cluster="c", node="n",
                                bench_command=[sys.executable, "-c", "print('{\"x\": \"fast\", \"y\": NaN, \"z\": 2}')"]))
    assert bad.metrics == {"z": 2.0}  # one bad metric skips that metric, not the node's valid ones
    assert "not a finite number" in bad.skipped["bench_command.x"] and "bench_command.y" in bad.skipped
    assert set(rep.noise_pct) == {"mem_copy_gbps", "cpu_sha256_mbps", "cpu_zlib_mbps"}  # best of 3, spread said


def test_a_hanging_or_chatty_benchmark_cannot_wedge_the_agent() -> None:
    """`bench_timeout_s` bounds the run (its child processes killed with it); a benchmark printing
    far more than it should is read with a cap (the tail kept: the last JSON line still counts)."""
    import time

    from agents.bench import BENCH_OUTPUT_MAX_BYTES, GpuTools, run_bench
    from fleetmend.diagnostics import BenchRequest

    hang = [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(60)']); time.sleep(60)"]
    t0 = time.monotonic()
    rep = asyncio.run(run_bench(BenchRequest(builtin=False, deadline_s=60), cluster="c", node="n",
                                bench_command=hang, tools=GpuTools(bench_timeout_s=2)))
    assert time.monotonic() - t0 < 8 and "agent.bench_timeout_s" in rep.skipped["bench_command"]
    chatty = [sys.executable, "-c", "import sys; [sys.stdout.write('x' * 1023 + '\\n') for _ in range(20_000)]; "
              "print('{\"tokens_per_s\": 7}')"]  # ~20 MB, then the result
    rep = asyncio.run(run_bench(BenchRequest(builtin=False, deadline_s=60), cluster="c", node="n", bench_command=chatty))
    assert rep.metrics == {"tokens_per_s": 7.0} and f"last {BENCH_OUTPUT_MAX_BYTES} were read" in rep.skipped[
        "bench_command.output"]


async def test_sweep_end_to_end_with_real_agents(nats_server, temporal_server, tmp_path: Path, unique: str) -> None:
    from agents.runner import run_agent
    from fleetmend import subjects
    from fleetmend.config import load_settings
    from fleetmend.events import FaultEvent
    from fleetmend.infra.connect import connect_nats, connect_temporal
    from fleetmend.infra.jetstream import ensure_fault_stream
    from fleetmend.worker import build_worker

    cluster = f"sw{unique}"
    base = dict(cluster=cluster, nats_url=nats_server.url, temporal_address=temporal_server.address,
                state_dir=tmp_path / "state", task_queue=f"tq-{unique}", log_format="json")
    s = load_settings(None, node="cli", **base)
    nc = await connect_nats(s, name="sweep-e2e")
    await ensure_fault_stream(nc.jetstream())
    client = await connect_temporal(s)
    worker = await build_worker(s, client, nc)
    wtask = asyncio.create_task(worker.run())
    values = {"g1": 100.0, "g2": 101.0, "g3": 99.0, "g4": 88.0, "g5": 100.5}  # g4 is 12 % slow
    stop = asyncio.Event()
    agents = []
    for node, v in values.items():
        cmd = [sys.executable, "-c", f"import json; print(json.dumps({{'tokens_per_s': {v}, 'step_time_ms': "
                                     f"{8000 / v:.3f}}}))"]
        a = load_settings(None, node=node, agent={"bench_command": cmd, "perf_enabled": False}, **base)
        agents.append(asyncio.create_task(run_agent(a, stop=stop, probes=[], hardware=False)))
    faults = await nc.subscribe(subjects.fault_subject(cluster, "g4"))
    env = {**os.environ, "FLEETMEND_NATS_URL": nats_server.url, "FLEETMEND_TEMPORAL_ADDRESS": temporal_server.address,
           "FLEETMEND_STATE_DIR": str(tmp_path / "state"), "FLEETMEND_CLUSTER": cluster,
           "FLEETMEND_TASK_QUEUE": f"tq-{unique}", "FLEETMEND_LOG_FORMAT": "json"}
    try:
        from tests.conftest import wait_agents_answer

        await wait_agents_answer(nc, cluster, values, what="agents answer on their diag subjects")
        p = await asyncio.to_thread(subprocess.run, [
            sys.executable, "-m", "fleetmend.cli.main", "sweep", "--nodelist", "g[1-6]", "--site-only",
            "--deadline", "10", "--id", f"t{unique}", "--json", "--act"], env=env, capture_output=True, text=True,
            timeout=120)
        assert p.returncode == 1, p.stdout + p.stderr  # an outlier was found
        d = json.loads(p.stdout)
        assert d["outliers"] == ["g4"]
        assert set(d["not_answering"]) == {"g6"}, "g6 has no agent: listed, not waited on"
        assert d["medians"]["tokens_per_s"] == 100.0
        row = next(r for r in d["rows"] if r["node"] == "g4")
        assert row["metrics"]["tokens_per_s"]["ratio"] == pytest.approx(0.88)
        assert row["metrics"]["step_time_ms"]["outlier"] is True
        assert d["incidents_opened"] == ["g4"]
        ev = FaultEvent.from_json_bytes((await faults.next_msg(timeout=10)).data)
        assert ev.kind == "fail_slow" and ev.attrs["sweep_id"] == f"t{unique}" and ev.attrs["ratio"] < 0.95
        # visible in Temporal under its id
        desc = await client.get_workflow_handle(subjects.sweep_workflow_id(cluster, f"t{unique}")).describe()
        assert desc.workflow_type == "Sweep"
        # the readable table, healthy nodes only (no outlier → exit 0)
        p = await asyncio.to_thread(subprocess.run, [
            sys.executable, "-m", "fleetmend.cli.main", "sweep", "g1", "g2", "g3", "g5", "--site-only",
            "--deadline", "10", "--id", f"u{unique}"], env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
        assert "tokens_per_s" in p.stdout and "OUTLIER" not in p.stdout and "median" in p.stdout
    finally:
        stop.set()
        await asyncio.gather(*agents, return_exceptions=True)
        await worker.shutdown()
        wtask.cancel()
        await nc.close()


async def test_a_real_agent_bounds_a_hanging_benchmark_by_its_setting(nats_server, tmp_path: Path, unique: str) -> None:
    """`agent.bench_timeout_s` reaches the agent's benchmark runner: a site benchmark that hangs is killed at
    the setting (2 s here), not at the sweep's much longer deadline, and the report says why."""
    import time

    from agents.runner import run_agent
    from fleetmend import subjects
    from fleetmend.config import load_settings
    from fleetmend.diagnostics import BenchReport, BenchRequest
    from fleetmend.infra.connect import connect_nats
    from tests.conftest import wait_agents_answer

    cluster = f"bt{unique}"
    a = load_settings(None, cluster=cluster, node="hang", nats_url=nats_server.url, state_dir=tmp_path / "state",
                      log_format="json", agent={"bench_command": ["sleep", "60"], "bench_timeout_s": 2,
                                                "perf_enabled": False})
    stop = asyncio.Event()
    agent = asyncio.create_task(run_agent(a, stop=stop, probes=[], hardware=False))
    nc = await connect_nats(a, name="bench-timeout")
    try:
        await wait_agents_answer(nc, cluster, ["hang"], what="the agent answers")
        t0 = time.monotonic()
        body = BenchRequest(sweep_id="t", deadline_s=40, builtin=False).model_dump_json().encode()
        msg = await nc.request(subjects.diag_subject(cluster, "hang"), body, timeout=45)
        rep = BenchReport.model_validate_json(msg.data)
        took = time.monotonic() - t0
        assert took < 15, f"the hanging benchmark ran {took:.0f} s under a 2 s agent.bench_timeout_s"
        assert "agent.bench_timeout_s" in rep.skipped.get("bench_command", ""), rep.skipped
    finally:
        stop.set()
        await asyncio.gather(agent, return_exceptions=True)
        await nc.close()
