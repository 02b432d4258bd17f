"""`fleetmend sweep --job JOBID` against a real Slurm cluster (tests/fixtures_slurm.py: slurmctld and
four slurmd on this host): a real job holds three of the four nodes, the CLI resolves the job to
those nodes through scontrol (hostlist `node[1-2,4]` expanded), and the sweep asks exactly their
agents — every node runs an agent, and each agent's `agent.bench_command` records that it was asked.
Real nats-server and Temporal, as in tests/test_sweep.py."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import wait_agents_answer

JOB_NODES = ["node1", "node2", "node4"]


def _job_state(slurm, job: str) -> str:
    return slurm.run("squeue", "-h", "-j", job, "-o", "%T", check=False).stdout.strip()


async def test_sweep_job_asks_exactly_the_nodes_of_a_running_job(slurm, nats_server, temporal_server,
                                                                  tmp_path: Path, unique: str) -> None:
    from agents.runner import run_agent
    from fleetmend.config import load_settings
    from fleetmend.infra.connect import connect_nats, connect_temporal
    from fleetmend.infra.jetstream import ensure_fault_stream
    from fleetmend.worker import build_worker

    job = slurm.run("sbatch", "--parsable", "-N", "3", "-w", ",".join(JOB_NODES), "-J", f"fm{unique}",
                    "-o", "/dev/null", "--wrap", "sleep 600").stdout.strip().split(";")[0]
    cluster = f"sj{unique}"
    base = dict(cluster=cluster, nats_url=nats_server.url, temporal_address=temporal_server.address,
                state_dir=tmp_path / "state", task_queue=f"tq-{unique}", log_format="json")
    asked = tmp_path / "asked"
    stop = asyncio.Event()
    agents: list[asyncio.Task] = []
    nc = worker = wtask = None
    try:
        deadline = time.monotonic() + 30
        while _job_state(slurm, job) != "RUNNING":
            assert time.monotonic() < deadline, f"job {job} not running: {_job_state(slurm, job)!r}\n{slurm.log_tail()}"
            await asyncio.sleep(0.2)
        shown = slurm.run("scontrol", "show", "job", job).stdout
        assert " NodeList=node[1-2,4]" in shown or "\n   NodeList=node[1-2,4]" in shown, shown

        s = load_settings(None, node="cli", **base)
        nc = await connect_nats(s, name="sweep-job")
        await ensure_fault_stream(nc.jetstream())
        client = await connect_temporal(s)
        worker = await build_worker(s, client, nc)
        wtask = asyncio.create_task(worker.run())
        for i, node in enumerate(slurm.nodes):  # an agent on every node, the job's and node3
            cmd = [sys.executable, "-c", f"open({str(asked)!r}, 'a').write('{node}\\n'); "
                                         f"print('{{\"tokens_per_s\": {100 + i}}}')"]
            a = load_settings(None, node=node, agent={"bench_command": cmd, "perf_enabled": False}, **base)
            agents.append(asyncio.create_task(run_agent(a, stop=stop, probes=[], hardware=False)))

        await wait_agents_answer(nc, cluster, slurm.nodes, what="every node's agent answers")
        # Slurm's config from fleetmend's own setting (slurm.slurm_conf), not from the environment
        env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
        env.update({"FLEETMEND_NATS_URL": nats_server.url, "FLEETMEND_TEMPORAL_ADDRESS": temporal_server.address,
                    "FLEETMEND_STATE_DIR": str(tmp_path / "state"), "FLEETMEND_CLUSTER": cluster,
                    "FLEETMEND_TASK_QUEUE": f"tq-{unique}", "FLEETMEND_LOG_FORMAT": "json",
                    "FLEETMEND_SLURM__SLURM_CONF": str(slurm.conf)})
        p = await asyncio.to_thread(subprocess.run, [
            sys.executable, "-m", "fleetmend.cli.main", "sweep", "--job", job, "--site-only", "--deadline", "10",
            "--id", f"j{unique}", "--json"], env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
        d = json.loads(p.stdout)
        assert [r["node"] for r in d["rows"]] == JOB_NODES
        assert d["not_answering"] == {}
        assert sorted(asked.read_text().split()) == JOB_NODES, "exactly the job's agents ran the benchmark"
        assert d["medians"]["tokens_per_s"] == 101.0  # node1 100, node2 101, node4 103

        # a job that does not exist: a clear error naming it, exit 2, no sweep
        p = await asyncio.to_thread(subprocess.run, [
            sys.executable, "-m", "fleetmend.cli.main", "sweep", "--job", "999999", "--site-only"],
            env=env, capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and "scontrol show job 999999" in p.stderr, p.stdout + p.stderr
    finally:
        slurm.run("scancel", job, check=False)
        stop.set()
        await asyncio.gather(*agents, return_exceptions=True)
        if worker is not None:
            await worker.shutdown()
        if wtask is not None:
            wtask.cancel()
        if nc is not None:
            await nc.close()
        deadline = time.monotonic() + 30
        while _job_state(slurm, job) not in ("", "COMPLETED", "CANCELLED") and time.monotonic() < deadline:
            await asyncio.sleep(0.2)


@pytest.mark.parametrize("expr", ["node[1-2,4]", "node[1-4]", "node3"])
def test_job_nodelist_expansion_matches_scontrol(slurm, expr: str) -> None:
    from activities.slurm import SlurmScheduler, expand_hostlist
    from fleetmend.config import SlurmSettings

    scheduler = SlurmScheduler(SlurmSettings(slurm_conf=str(slurm.conf)))
    assert asyncio.run(scheduler.expand(expr)) == expand_hostlist(expr)
