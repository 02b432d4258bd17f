"""Upgrade with incidents open (issue 27, point 3): a deployment restarts its workers one at a time onto a build
that adds a workflow patch, while incidents wait for repair and others are mid-diagnosis.

The deployment: its own nats-server (the router consumes every cluster's faults), the session's Temporal dev
server, `fleetmend router` and two `fleetmend worker` processes of one cluster (`--scheduler standalone`: the
drained set is the scheduler's KV bucket), and each node's diagnostics responder (the agent's `DiagResponder`).
The new build is a real code change: `workflows/` copied to a temporary directory with one more command in
`NodeRemediation._return` (a timer) behind `workflow.patched(PATCH)`, put first on the new workers' PYTHONPATH.

Sequence: open incidents on the old build (five drained and awaiting repair, one of them returned before the
upgrade; two held in their initial diagnostics), restart worker 1 onto the new build (the held diagnostics
answer while it stops), repair incidents and open one while old and new workers run side by side, restart
worker 2, then repair the rest and open two more incidents on the new build alone.

It passes only if every incident returns to service; no workflow task failed in any history (the guard's
included) and no worker logged a non-determinism error; each incident is one workflow run; the scheduler's own
records show each node drained once and returned once; each incident holds the patch's marker exactly when the
worker that took it to the return was a new-build process (identities in the history), the incidents opened
after the upgrade among them; and every history replays offline with the new build, while the old build cannot
replay the patched ones (the patch is a real change of the command sequence).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowExecutionStatus, WorkflowHistory
from temporalio.worker import Replayer, UnsandboxedWorkflowRunner

from agents.diag import DiagResponder
from bench.chaos import kv_drain_timeline, kv_drain_writes
from fleetmend import subjects
from fleetmend.config import load_settings
from fleetmend.dev import servers
from fleetmend.infra.connect import close_nats, connect_nats, connect_temporal
from fleetmend.infra.converter import data_converter
from fleetmend.messages import RepairedCommand, guard_task_queue
from tests.conftest import assert_eventually
from tests.test_router import xid_event
from workflows.fleetguard import FleetGuard
from workflows.remediation import NodeRemediation

ROOT = Path(__file__).resolve().parent.parent
PATCH = "upgrade-probe"
PATCH_CODE = f"""\
        if workflow.patched({PATCH!r}):  # the new build's extra command (tests/test_upgrade.py)
            await workflow.sleep(timedelta(milliseconds=100), summary="{PATCH}: new build, before the return")
"""
ANCHOR = "    async def _return(self) -> None:\n        s = self._state\n"
"""Where the patch goes: the return to service, which no open incident has reached."""


def new_build(dest: Path) -> Path:
    """`workflows/` copied under `dest` with `PATCH_CODE` at `ANCHOR`. Returns `dest` (first on PYTHONPATH)."""
    shutil.copytree(ROOT / "workflows", dest / "workflows", ignore=shutil.ignore_patterns("__pycache__"))
    path = dest / "workflows" / "remediation.py"
    src = path.read_text()
    assert src.count(ANCHOR) == 1, "the patch's anchor moved: update ANCHOR"
    path.write_text(src.replace(ANCHOR, ANCHOR + PATCH_CODE))
    return dest


class HeldResponder(DiagResponder):
    """A node's diagnostics responder whose answers to diagnostics (not recovery) wait for `release`."""

    def __init__(self, *a: Any, release: asyncio.Event, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.release = release
        self.held = 0

    async def _answer(self, msg: Any) -> None:
        if not self.release.is_set():
            self.held += 1
            await self.release.wait()
        await super()._answer(msg)


class Deployment:
    """The router and the workers as OS processes (`servers.ManagedProcess`), logs under `logs`."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env, self.logs = env, logs
        self.procs: dict[str, servers.ManagedProcess] = {}
        self.identities: dict[str, str] = {}
        """Temporal identity (`pid@host`, the SDK's default) → process name."""

    def start(self, name: str, role: str, pythonpath: str) -> servers.ManagedProcess:
        # -P: PYTHONPATH alone says which build runs (`-m` would put the working directory, this checkout, first)
        p = servers.ManagedProcess(name, [sys.executable, "-P", "-m", "fleetmend.cli.main", role],
                                   self.logs / f"{name}.log", env={**self.env, "PYTHONPATH": pythonpath})
        p.start()
        self.procs[name] = p
        self.identities[f"{p.pid}@{socket.gethostname()}"] = name
        return p

    async def started(self, name: str, text: str, timeout_s: float = 45) -> None:
        p = self.procs[name]

        def ready() -> bool:
            assert p.alive(), f"{name} exited:\n{p.log_tail(30)}"
            return text in p.log_tail(400)

        await assert_eventually(ready, timeout_s=timeout_s, interval_s=0.1, what=f"{name} started")

    async def stop(self, name: str, *, signalled: bool = False) -> float:
        """SIGTERM (the worker's graceful shutdown; once: a second one exits at once) and wait for a clean exit.
        Returns the seconds it took."""
        p = self.procs[name]
        t0 = time.monotonic()
        if not signalled:
            p.terminate()
        rc = await asyncio.to_thread(p.proc.wait, 60)
        assert rc == 0, f"{name} stopped with {rc}:\n{p.log_tail(30)}"
        return time.monotonic() - t0

    def stop_all(self) -> None:
        for p in self.procs.values():
            p.terminate()
        for p in self.procs.values():
            p.stop(30.0)

    def log_text(self) -> str:
        return "\n".join((self.logs / f"{n}.log").read_text(errors="replace") for n in self.procs)


async def _aiter(items: Any) -> Any:
    for i in items:
        yield i


@pytest.fixture
def own_nats(tmp_path: Path):
    port = servers.free_port()
    proc = servers.start_nats(tmp_path / "js", port)
    yield f"nats://127.0.0.1:{port}"
    proc.stop()


async def test_rolling_upgrade_with_open_incidents_completes_every_incident_once(
        own_nats: str, temporal_server, tmp_path: Path, unique: str) -> None:
    t_start = time.monotonic()
    cluster, tq = f"up{unique}", f"tq-{unique}"
    build2 = new_build(tmp_path / "build2")
    env = {**os.environ, "FLEETMEND_NATS_URL": own_nats, "FLEETMEND_TEMPORAL_ADDRESS": temporal_server.address,
           "FLEETMEND_STATE_DIR": str(tmp_path / "state"), "FLEETMEND_CLUSTER": cluster, "FLEETMEND_TASK_QUEUE": tq,
           "FLEETMEND_SCHEDULER": "standalone", "FLEETMEND_LOG_FORMAT": "json", "FLEETMEND_METRICS__WORKER_PORT": "0",
           "FLEETMEND_METRICS__ROUTER_PORT": "0", "FLEETMEND_POLICY__MAX_DRAINED_NODES": "100",
           "FLEETMEND_POLICY__MAX_DRAINED_PERCENT": "100", "FLEETMEND_POLICY__MAX_DRAINED_PER_RACK": "100",
           "FLEETMEND_POLICY__BREAKER_DISTINCT_NODES": "100", "FLEETMEND_POLICY__DOMAIN_INCIDENT_NODES": "100",
           "FLEETMEND_POLICY__DEBOUNCE_S": "0", "FLEETMEND_POLICY__RECOVERY_SETTLE_S": "0"}
    for k in ("FLEETMEND_CONFIG", "PYTHONPATH"):
        env.pop(k, None)
    old_path, new_path = str(ROOT), os.pathsep.join([str(build2), str(ROOT)])
    dep = Deployment(env, tmp_path / "logs")
    s = load_settings(None, cluster=cluster, nats_url=own_nats, temporal_address=temporal_server.address,
                      task_queue=tq, state_dir=tmp_path / "state", scheduler="standalone")
    nc = await connect_nats(s, name="upgrade-test")
    js = nc.jetstream()
    client = await connect_temporal(s)

    waiting = [f"a{i}" for i in range(5)]  # drained and waiting for repair when the upgrade starts
    held = ["m0", "m1"]  # in their initial diagnostics (the agent's answer held) when worker 1 stops
    during, after = ["c0"], ["n0", "n1"]  # opened while old and new run side by side; after the upgrade
    release = asyncio.Event()
    responders = [DiagResponder(nc, cluster, n, nvml=None) for n in (*waiting, *during, *after)]
    responders += [HeldResponder(nc, cluster, n, nvml=None, release=release) for n in held]
    for r in responders:
        await r.start()

    async def fault(node: str) -> None:
        await js.publish(subjects.fault_subject(cluster, node), xid_event(cluster, node, 79).to_json_bytes())

    def handle(node: str):
        return client.get_workflow_handle_for(NodeRemediation.run, subjects.workflow_id(cluster, node))

    async def phase(node: str) -> str | None:
        # a closed incident is read from its result, as `fleetmend status` reads it (fleetmend.cli.lookup): a
        # query of a run the new build closed (its patch marker in the history) that reaches an old worker fails
        # with a nondeterminism error, and that worker, polling again at once, kept winning the query for 60 s
        try:
            if (await handle(node).describe()).status == WorkflowExecutionStatus.COMPLETED:
                return (await handle(node).result(follow_runs=False)).phase
            return (await handle(node).query(NodeRemediation.status)).phase
        except Exception:  # not started yet
            return None

    async def wait_phase(nodes: list[str], want: str, timeout_s: float = 60) -> None:
        async def all_there() -> bool:
            return all([await phase(n) == want for n in nodes])

        await assert_eventually(all_there, timeout_s=timeout_s, interval_s=0.2, what=f"{nodes} {want}")

    async def repair(nodes: list[str]) -> None:
        for n in nodes:
            await handle(n).execute_update(NodeRemediation.mark_repaired,
                                           RepairedCommand(by="upgrade@ci", note="replaced", ticket=None))

    marks: dict[str, float] = {}
    try:
        # -- the old build: router, two workers
        dep.start("router", "router", old_path)
        for w in ("worker1", "worker2"):
            dep.start(w, "worker", old_path)
        for w in ("worker1", "worker2"):
            await dep.started(w, "worker_started")
        await dep.started("router", "router_started")
        for n in (*waiting, *held):
            await fault(n)
        await wait_phase(waiting, "awaiting_repair")
        await assert_eventually(lambda: sum(r.held for r in responders if isinstance(r, HeldResponder)) >= 2,
                                timeout_s=30, what="both held incidents in their initial diagnostics")
        for n in held:
            assert await phase(n) == "diagnosing"
        await repair(waiting[:1])  # one incident returns on the old build alone
        await wait_phase(waiting[:1], "closed")
        marks["opened"] = time.monotonic() - t_start

        # -- worker 1 onto the new build; the held diagnostics answer while it stops
        dep.procs["worker1"].terminate()
        await asyncio.sleep(0.3)
        release.set()
        await dep.stop("worker1", signalled=True)
        dep.start("worker1-new", "worker", new_path)
        await dep.started("worker1-new", "worker_started")
        coexist_from = time.time()
        # old and new side by side: repairs, a held incident's way on, and a new incident
        await repair(waiting[1:3])
        await fault(during[0])
        await wait_phase(waiting[1:3], "closed")
        await wait_phase([*held, *during], "awaiting_repair")
        coexist_to = time.time()

        # -- worker 2 onto the new build
        await dep.stop("worker2")
        dep.start("worker2-new", "worker", new_path)
        await dep.started("worker2-new", "worker_started")
        marks["upgraded"] = time.monotonic() - t_start
        await repair([*waiting[3:], *held, *during])
        for n in after:
            await fault(n)
        await wait_phase(after, "awaiting_repair")
        await repair(after)
        nodes = [*waiting, *held, *during, *after]
        await wait_phase(nodes, "closed", timeout_s=60)
        marks["closed"] = time.monotonic() - t_start

        # -- every incident returned to service, one run each, no task failed
        histories: dict[str, WorkflowHistory] = {}
        for n in nodes:
            st = await handle(n).query(NodeRemediation.status)
            assert st.outcome == "returned_to_service" and not st.drained, (n, st.outcome, st.drained)
            runs = [w async for w in client.list_workflows(f"WorkflowId = '{subjects.workflow_id(cluster, n)}'")]
            assert len(runs) == 1, f"{n}: {len(runs)} workflow runs"
            histories[n] = await handle(n).fetch_history()
        guard_tq = subjects.cluster_task_queue(guard_task_queue(tq), cluster)
        guards = [w async for w in client.list_workflows(f"TaskQueue = '{guard_tq}'")]
        assert guards, "the cluster's FleetGuard ran"
        for g in guards:
            histories[g.id] = await client.get_workflow_handle(g.id, run_id=g.run_id).fetch_history()
        for name, h in histories.items():
            (tmp_path / f"{name.replace('/', '_')}.json").write_text(h.to_json())
            failed = [e for e in h.events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED]
            assert not failed, f"{name}: workflow task failed: {failed[0].workflow_task_failed_event_attributes}"
        logs = dep.log_text()
        for bad in ("ondeterminism", "Failed activation", "Workflow task failed"):
            assert bad not in logs, f"a worker logged {bad!r}"

        # -- the scheduler's own records: each node drained once and returned once (the router's cordon and the
        # incident's adoption of it are two writes of one drain: the node goes out of service once)
        timeline = await kv_drain_timeline(js, cluster)
        writes = await kv_drain_writes(js)
        for n in nodes:
            states = [on for node, on in timeline if node == n]
            changes = [on for i, on in enumerate(states) if i == 0 or on != states[i - 1]]
            assert changes == [True, False], (n, states, writes.get(n))
            assert len({w["incident_id"] for w in writes[n]} - {w.get("adopted_from") for w in writes[n]}) == 1, \
                (n, writes[n])

        # -- the patch: taken exactly where a new-build worker reached the return
        new_ids = {i for i, name in dep.identities.items() if name.endswith("-new")}
        old_ids = set(dep.identities) - new_ids
        took: dict[str, bool] = {}
        by_build_at_return: dict[str, str] = {}
        coexist_builds: set[str] = set()
        for n in nodes:
            events = histories[n].events
            patched = [e for e in events if e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED
                       and PATCH.encode() in e.marker_recorded_event_attributes.SerializeToString()]
            timers = [e for e in events if e.event_type == EventType.EVENT_TYPE_TIMER_STARTED
                      and PATCH.encode() in e.SerializeToString()]  # the patch's timer: its summary names it
            undrain = next(e for e in events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
                           and e.activity_task_scheduled_event_attributes.activity_type.name == "undrain_node")
            first_at_return = undrain if not patched else patched[0]
            completed = [e for e in events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED
                         and e.event_id < first_at_return.event_id][-1]
            who = completed.workflow_task_completed_event_attributes.identity
            assert who in new_ids | old_ids, (n, who, dep.identities)
            took[n] = bool(patched)
            by_build_at_return[n] = "new" if who in new_ids else "old"
            assert took[n] == (who in new_ids), f"{n}: patch taken {took[n]}, return reached by {dep.identities[who]}"
            assert len(patched) <= 1 and len(timers) == len(patched), (n, len(patched), len(timers))
            for e in events:
                if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED and \
                        coexist_from <= e.event_time.ToDatetime().timestamp() <= coexist_to:
                    coexist_builds.add("new" if e.workflow_task_completed_event_attributes.identity in new_ids
                                       else "old")
        held_on = {}  # which worker ran each held initial diagnostics (the one stopped first, or the other)
        for n in held:
            ev = histories[n].events
            first = next(e.event_id for e in ev if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
                         and e.activity_task_scheduled_event_attributes.activity_type.name == "run_diagnostics")
            started = next(e for e in ev if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED
                           and e.activity_task_started_event_attributes.scheduled_event_id == first)
            held_on[n] = dep.identities.get(started.activity_task_started_event_attributes.identity, "?")
        for n in (*waiting[3:], *held):  # opened on the old build, returned on the new: replayed across builds
            builds = {"new" if e.workflow_task_completed_event_attributes.identity in new_ids else "old"
                      for e in histories[n].events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED}
            assert builds == {"old", "new"}, (n, builds)
        assert not took[waiting[0]], "returned before the upgrade: the old path"
        assert all(took[n] for n in after), "incidents opened after the upgrade take the patched branch"
        assert all(took[n] for n in waiting[3:]), "repaired after the upgrade: the patched branch"

        # -- replay: every history with the new build; the old build cannot replay a patched one
        spec = importlib.util.spec_from_file_location("upgrade_build2_remediation",
                                                      build2 / "workflows" / "remediation.py")
        assert spec and spec.loader
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        run_of = {name: h.run_id for name, h in histories.items()}
        for code, classes in (("new", [mod.NodeRemediation, FleetGuard]), ("old", [NodeRemediation, FleetGuard])):
            replayer = Replayer(workflows=classes, data_converter=data_converter,
                                workflow_runner=UnsandboxedWorkflowRunner())
            res = await replayer.replay_workflows(_aiter(histories.values()), raise_on_replay_failure=False)
            failed = {name for name, run in run_of.items() if run in res.replay_failures}
            want = set() if code == "new" else {name for name, t in took.items() if t}
            assert failed == want, (f"replayed with the {code} build: failed {sorted(failed)}, expected "
                                    f"{sorted(want)}: {list(res.replay_failures.values())[:1]!r}")
        marks["replayed"] = time.monotonic() - t_start
        print(f"upgrade: {json.dumps(marks)}; held diagnostics ran on {held_on}; return reached by {by_build_at_return}; "
              f"builds that completed tasks while both ran: {sorted(coexist_builds)}")
    finally:
        release.set()
        await asyncio.to_thread(dep.stop_all)
        for r in responders:
            await r.stop()
        await close_nats(nc)
