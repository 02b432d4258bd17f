"""Clustered chaos run (issue 27, point 2): the deployment past one machine, with SIGKILLs in a burst of faults.

    python bench/chaos_cluster.py --nodes 6 --faults 48 --duration 20 --seed 11 -v

Starts, each as its own OS process: three `nats-server`s as one JetStream cluster
(`fleetmend.dev.servers.start_nats_cluster`; every stream and KV bucket at 3 replicas, `[streams] replicas`),
the Temporal dev server, and two fleet clusters (`east`, `west`), each with two routers
(`fleetmend router --cluster C`), two workers (`fleetmend worker --cluster C`, standalone scheduler: drains in
the drain bucket, tickets in the ticket bucket) and one agent process running a real `run_agent` per node
(`bench/chaos.py agents`: the agent's `Publisher`, JetStream or its spool, fed by a `FollowProbe`). Every
process is given all three NATS URLs. `east` also runs the fail-slow analyzer twice (`fleetmend analyzer
--cluster east`: one holds the lease, one stands by), fed by simulated telemetry (`fleetmend.dev.perfsim`,
two-second windows) so that it has windows to judge.

While the driver writes `--faults` seeded faults (drain-worthy XIDs 79/48/95 and application-side 13/31/43)
for random nodes of both clusters over `--duration` seconds, it kills with SIGKILL, at seeded points in the
burst (`--kill-order`): one nats-server (the one holding the standby analyzer's perf consumer, so its windows' input is cut),
one router, one worker and the active analyzer. The nats-server is started again
(same store) a few seconds later; the router, worker and analyzer are not (their replicas carry on). Each
cluster's budget is `BUDGET` drained nodes. Then it waits for quiescence and prints a table; exit status 1
when any claim fails. Every count comes from the systems of record, not from fleetmend's counters:

- every fault sent is recorded once in its node's `NodeRemediation` (its `status` query);
- every incident was opened once: Temporal's visibility lists one run of each node's workflow;
- each node was drained at most once and ticketed once per drain: the standalone scheduler's drain bucket
  (every write kept, read message by message) and the ticket store's bucket; every drain-worthy node is
  drained or waits for a permit; no other node is drained;
- the budget held: replaying each cluster's drain writes (deletes included), never more than `BUDGET` at once;
- the analyzer's standby took over with its windows (`fleetmend/analyzer/service.py`: both replicas keep the
  open windows from the perf stream; the one that becomes active loads `state.<cluster>`, the last judged
  window and the streaks its predecessor wrote, and judges on from there): the lease's holder is the standby,
  which logged `analyzer_state_loaded` at the window the killed one had written, and it judged and wrote
  later windows (`state.<cluster>`'s `last_closed` moved on, its `window_judged` lines say active);
- every stream and bucket is at 3 replicas, and the restarted nats-server caught up: its own monitoring
  endpoint (`/jsz`) shows, for every stream and bucket, the state the other two hold.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.chaos import (  # noqa: E402
    STABLE_PHASES,
    Sent,
    kv_drain_timeline,
    pipeline_env,
    print_table,
    replay_drain_timeline,
    wait_quiet,
    write_fault,
)
from fleetmend import subjects  # noqa: E402
from fleetmend.dev import servers  # noqa: E402

CLUSTERS = ("east", "west")
ANALYZED = "east"
"""The cluster whose analyzer runs twice (active and standby)."""
BUDGET = 3
"""Drained nodes allowed at once in each cluster (`policy.max_drained_nodes`)."""
DRAIN_SHARE = 0.35
REPLICAS = 3
QUIESCE_TIMEOUT_S = 150.0
CATCH_UP_S = 30.0
ANALYZER_WINDOW_S = 2.0
PERF_NODES = 8
"""Simulated telemetry nodes of `ANALYZED` (the analyzer's `min_group_size` is 8)."""
PERF_INTERVAL_S = 0.5
KILL_ORDER = ("worker", "nats", "router", "analyzer")
"""The default order of the kills. A worker killed with drains in flight (seen 6 s after the nats-server's kill,
while its streams elected leaders) leaves them to the 60 s heartbeat timeout of the drain
(`workflows.remediation.DRAIN_HEARTBEAT`) before its replica retries them: correct, but a minute longer (seen
with the seeded order router, nats, worker, analyzer: quiescence 50 s after the last fault instead of 3 s).
`--kill-order random` draws the order from the seed."""
ANALYZER_RESUME_S = 40.0
"""After quiescence, how long the standby may still take to judge two windows of samples as the active one (an
ordered consumer lost with its server is recreated after two missed 5 s heartbeats, then a retry)."""


@dataclass
class ClusterChaos:
    nodes: int
    faults: int
    duration_s: float
    seed: int
    workdir: Path
    verbose: bool = False
    kill_order: tuple[str, ...] = KILL_ORDER
    procs: dict[str, servers.ManagedProcess] = field(default_factory=dict)
    sent: list[Sent] = field(default_factory=list)
    kills: list[tuple[float, str, float | None]] = field(default_factory=list)
    """(seconds since start, victim, seconds until it was back; None: left dead, its replica carries on)."""
    down: set[str] = field(default_factory=set)
    unexpected_exits: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.node_names = {c: [f"{c[0]}{i:02d}" for i in range(self.nodes)] for c in CLUSTERS}
        self.state = self.workdir / "state"
        self.inject = self.workdir / "inject"
        self.logs = self.workdir / "logs"
        for d in (self.state, self.inject, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        self.temporal_port = servers.free_port()
        self.temporal_address = f"127.0.0.1:{self.temporal_port}"
        self.t0 = time.monotonic()

    def _env(self) -> dict[str, str]:
        return {
            "FLEETMEND_NATS_URL": self.nats.url, "FLEETMEND_TEMPORAL_ADDRESS": self.temporal_address,
            "FLEETMEND_STATE_DIR": str(self.state), "FLEETMEND_TASK_QUEUE": "chaosc",
            "FLEETMEND_STREAMS__REPLICAS": str(REPLICAS),
            **pipeline_env(max_drained_nodes=BUDGET),  # the budget is the claim here: BUDGET nodes per cluster
            # two-second windows judged half a second after they end; a finding needs 1000 of them (none is
            # raised: the run is about the lease and the windows, not about a fail-slow incident)
            "FLEETMEND_ANALYZER__WINDOW_S": str(ANALYZER_WINDOW_S), "FLEETMEND_ANALYZER__GRACE_S": "0.5",
            "FLEETMEND_ANALYZER__WINDOWS": "1000", "FLEETMEND_ANALYZER__MIN_SAMPLES_PER_WINDOW": "2",
            "FLEETMEND_ANALYZER__LEASE_TTL_S": "3",
        }

    def _say(self, text: str) -> None:
        if self.verbose:
            print(f"[chaos-cluster {time.monotonic() - self.t0:6.1f}s] {text}", file=sys.stderr, flush=True)

    # -- processes ----------------------------------------------------------------------------
    def _build(self) -> None:
        py, env = sys.executable, self._env()
        cli = [py, "-m", "fleetmend.cli.main"]
        self.procs["temporal"] = servers.temporal_dev_server(self.workdir / "temporal.db", self.temporal_port, 0,
                                                             log_path=self.logs / "temporal.log", ui=False)
        for c in CLUSTERS:
            for k in (1, 2):
                self.procs[f"router-{c}-{k}"] = servers.ManagedProcess(
                    f"router-{c}-{k}", [*cli, "router", "--cluster", c], self.logs / f"router-{c}-{k}.log", env=env)
                self.procs[f"worker-{c}-{k}"] = servers.ManagedProcess(
                    f"worker-{c}-{k}", [*cli, "worker", "--cluster", c], self.logs / f"worker-{c}-{k}.log", env=env)
            self.procs[f"agent-{c}"] = servers.ManagedProcess(
                f"agent-{c}", [py, str(ROOT / "bench" / "chaos.py"), "agents", "--dir", str(self.workdir),
                               "--node-list", ",".join(self.node_names[c])], self.logs / f"agent-{c}.log",
                env={**env, "FLEETMEND_CLUSTER": c})
        for k in (1, 2):
            self.procs[f"analyzer-{k}"] = servers.ManagedProcess(
                f"analyzer-{k}", [*cli, "analyzer", "--cluster", ANALYZED], self.logs / f"analyzer-{k}.log", env=env)

    async def start_all(self) -> None:
        self.nats = await asyncio.to_thread(servers.start_nats_cluster, self.workdir / "nats")
        self._say(f"nats cluster up: {self.nats.url}")
        self._build()
        self.procs["temporal"].start()
        await asyncio.to_thread(self.procs["temporal"].wait_tcp, "127.0.0.1", self.temporal_port, 60.0)
        await servers.wait_temporal_ready(self.temporal_address)
        self._say("temporal up")
        for name, p in self.procs.items():
            if name != "temporal":
                p.start()

    def stop_all(self) -> None:
        for name, p in self.procs.items():
            if name != "temporal":
                p.terminate()
        for name, p in self.procs.items():
            if name != "temporal":
                p.stop(timeout_s=5)  # nothing is checked after this: no need to wait for graceful worker exits
        if "temporal" in self.procs:
            self.procs["temporal"].stop()
        if getattr(self, "nats", None) is not None:
            self.nats.stop()

    async def supervise(self, stop: asyncio.Event) -> None:
        """Count (and restart) a fleetmend process that exited without being killed: the claim is that none does."""
        while not stop.is_set():
            for name, p in self.procs.items():
                if name != "temporal" and name not in self.down and p.proc is not None and not p.alive():
                    self.unexpected_exits[name] += 1
                    self._say(f"{name} exited on its own (rc {p.proc.returncode}); restarting\n{p.log_tail(5)}")
                    p.start()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.5):
                    await stop.wait()

    # -- load, faults and kills ------------------------------------------------------------------
    async def drive_faults(self) -> None:
        interval = self.duration_s / max(self.faults, 1)
        for i in range(self.faults):
            cluster = CLUSTERS[i % len(CLUSTERS)]
            node = self.rng.choice(self.node_names[cluster])
            self.sent.append(write_fault(self.inject, i, cluster, node, self.rng.random() < DRAIN_SHARE, self.rng))
            await asyncio.sleep(interval)

    async def kill_loop(self, lease_kv: Any) -> None:
        """SIGKILL one nats-server, one router, one worker and the active analyzer, in `kill_order` (empty: a
        seeded order), one at a seeded point of each quarter of the burst; the nats-server is started again
        (same store) 2-4 s later."""
        victims = list(self.kill_order) or self.rng.sample(list(KILL_ORDER), len(KILL_ORDER))
        slot = self.duration_s / len(victims)
        self.nats_victim = self.rng.randrange(REPLICAS)
        pending_restart: asyncio.Task | None = None
        for k, what in enumerate(victims):
            at = slot * k + self.rng.uniform(0.2, 0.6) * slot
            await asyncio.sleep(max(0.0, at - (time.monotonic() - self.t_burst)))
            t_kill = time.monotonic() - self.t0
            if what == "nats":
                hosting = await self.standby_consumer_server(lease_kv)
                i = self.nats_victim = hosting if hosting is not None else self.nats_victim
                self.nats_victim_why = ("it held the standby analyzer's perf consumer" if hosting is not None
                                        else "drawn from the seed (the standby's consumer not found)")
                self.down.add(f"nats-server-{i}")
                self._say(f"kill -9 nats-server-{i} (pid {self.nats.servers[i].pid})")
                self.nats.kill(i)
                pending_restart = asyncio.create_task(self._restart_nats(i, t_kill))
                continue
            if what == "analyzer":
                name = await self.active_analyzer(lease_kv)
                self.analyzer_before = await self.analyzer_state(lease_kv)
            else:
                name = f"{what}-{self.rng.choice(CLUSTERS)}-{self.rng.choice((1, 2))}"
            if name is None:
                self.kills.append((t_kill, "analyzer (no holder found)", None))
                continue
            self.down.add(name)
            self._say(f"kill -9 {name} (pid {self.procs[name].pid})")
            self.procs[name].kill()
            self.kills.append((t_kill, name, None))
            if what == "analyzer":
                self.killed_analyzer, self.t_analyzer_kill = name, time.time()
        if pending_restart is not None:
            await pending_restart

    async def _restart_nats(self, i: int, t_kill: float) -> None:
        await asyncio.sleep(self.rng.uniform(2.0, 4.0))
        await asyncio.to_thread(self.nats.start, i)
        self.down.discard(f"nats-server-{i}")
        back = time.monotonic() - self.t0 - t_kill
        self.nats_back_at = time.monotonic()
        self.kills.append((t_kill, f"nats-server-{i}", back))
        self._say(f"nats-server-{i} back in the cluster after {back:.1f}s")

    # -- the analyzer ------------------------------------------------------------------------------
    async def analyzer_state(self, kv: Any) -> dict[str, Any]:
        """The analyzer bucket's `lease.<cluster>` holder and `state.<cluster>` (last judged window, streaks)."""
        from nats.js.errors import KeyNotFoundError

        out: dict[str, Any] = {"holder": None, "last_closed": None, "streaks": {}, "state_rev": 0}
        with contextlib.suppress(KeyNotFoundError):
            e = await kv.get(f"lease.{ANALYZED}")
            out["holder"] = json.loads(e.value)["holder"] if e.value else None
        with contextlib.suppress(KeyNotFoundError):
            e = await kv.get(f"state.{ANALYZED}")
            st = json.loads(e.value or b"{}")
            out.update(last_closed=st.get("last_closed"), state_rev=e.revision,
                       streaks={f"{n}/{m}": s[0] for n, ms in st.get("streaks", {}).items() for m, s in ms.items()})
        return out

    async def standby_consumer_server(self, kv: Any) -> int | None:
        """Which nats-server holds the standby analyzer's perf consumer (its ordered consumer, placed on one
        server): killing that one takes the standby's windows' input away, which it must get back. Found from
        the standby's own TCP connection (psutil), that connection's subscriptions on the server it reached
        (`/connz?subs=detail`), and the consumer with that deliver subject (`consumer_info().cluster.leader`).
        None when not found (then a seeded random server is killed)."""
        import psutil

        active = await self.active_analyzer(kv)
        standby = {"analyzer-1": "analyzer-2", "analyzer-2": "analyzer-1"}.get(active or "")
        if standby is None or self.procs[standby].pid is None:
            return None
        try:
            local = {c.laddr.port for c in psutil.Process(self.procs[standby].pid).net_connections("tcp")
                     if c.raddr and c.raddr.port in self.nats.ports}
            inboxes: set[str] = set()
            for j in range(REPLICAS):
                for conn in self.nats.monitor(j, "connz?subs=detail&limit=1024").get("connections") or []:
                    if conn.get("port") in local:
                        inboxes |= {x["subject"] for x in conn.get("subscriptions_list_detail") or []}
            js = self.nc.jetstream(timeout=5.0)
            for ci in await js.consumers_info(subjects.PERF_STREAM):
                if ci.config.deliver_subject in inboxes and ci.cluster is not None and ci.cluster.leader:
                    return int(ci.cluster.leader.rsplit("-", 1)[1])
        except Exception as err:  # noqa: BLE001 - a process gone meanwhile, a monitor not answering
            self._say(f"standby's consumer not found: {err!r}")
        return None

    async def active_analyzer(self, kv: Any) -> str | None:
        holder = (await self.analyzer_state(kv))["holder"] or ""
        for name in ("analyzer-1", "analyzer-2"):
            if f"-{self.procs[name].pid}-" in holder:
                return name
        return None

    def _log_events(self, name: str, event: str) -> list[dict[str, Any]]:
        out = []
        for line in self.procs[name].log_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if isinstance(rec, dict) and rec.get("event") == event:
                    out.append(rec)
        return out

    async def analyzer_claims(self, kv: Any) -> tuple[list[tuple[str, Any]], list[str]]:
        row = "analyzer: standby took over with its windows"
        before = getattr(self, "analyzer_before", None)
        killed = getattr(self, "killed_analyzer", None)
        if before is None or killed is None:
            return [(row, "NO: the active analyzer was not found to kill")], ["the active analyzer was not killed"]
        standby = "analyzer-2" if killed == "analyzer-1" else "analyzer-1"
        deadline = time.monotonic() + ANALYZER_RESUME_S
        while True:  # its input may have been cut (its consumer's server killed): nats-py resumes it within ~20 s
            after = await self.analyzer_state(kv)
            loaded = self._log_events(standby, "analyzer_state_loaded")
            judged = [r for r in self._log_events(standby, "window_judged") if r.get("active")]
            with_samples = [r for r in judged if r.get("nodes", 0) > 0]
            if len(with_samples) >= 2 or time.monotonic() > deadline:
                break
            await asyncio.sleep(1.0)
        pid = self.procs[standby].pid
        took = after["holder"] is not None and f"-{pid}-" in after["holder"]
        cont = [k for k, n in before["streaks"].items() if after["streaks"].get(k, 0) > n]
        failures = []
        if not took:
            failures.append(f"analyzer: the lease holder after the kill is {after['holder']!r}, not the standby")
        if not loaded or before["last_closed"] is None or \
                max(r.get("last_window", -1) for r in loaded) < before["last_closed"]:
            failures.append(f"analyzer: the standby did not load the killed one's state (window "
                            f"{before['last_closed']}; loaded {[r.get('last_window') for r in loaded]})")
        if after["last_closed"] is None or before["last_closed"] is None or \
                after["last_closed"] < before["last_closed"] + 2 or len(with_samples) < 2:
            failures.append(f"analyzer: the standby did not go on judging windows of samples after the takeover "
                            f"(last window {before['last_closed']} -> {after['last_closed']}, {len(judged)} judged as "
                            f"active, {len(with_samples)} of them with samples)")
        return [(row, f"{'yes' if not failures else 'NO'}: lease {killed} -> {standby}; state loaded at window "
                      f"{max((r.get('last_window', -1) for r in loaded), default=None)} (killed one wrote "
                      f"{before['last_closed']}); since then {len(judged)} windows judged as active, {len(with_samples)} with "
                      f"samples (last {after['last_closed']}); outlier streaks carried on "
                      f"{len(cont)}/{len(before['streaks'])}")], failures

    # -- observation ---------------------------------------------------------------------------
    def _targets(self) -> list[tuple[str, str]]:
        return sorted({(s.cluster, s.node) for s in self.sent})

    async def observe(self, client: Any, js: Any) -> dict[str, Any]:
        from temporalio.service import RPCError

        from activities.ticket_kv import KvTicketStore
        from bench.chaos import kv_drain_writes
        from workflows.remediation import NodeRemediation

        statuses: dict[tuple[str, str], Any] = {}
        for c, node in self._targets():
            h = client.get_workflow_handle_for(NodeRemediation.run, subjects.workflow_id(c, node))
            try:
                async with asyncio.timeout(10):
                    statuses[(c, node)] = await h.query(NodeRemediation.status)
            except (RPCError, TimeoutError) as err:
                statuses[(c, node)] = err
        try:
            ci = await js.consumer_info(subjects.FAULT_STREAM, subjects.ROUTER_DURABLE)
            pending = (ci.num_pending or 0) + (ci.num_ack_pending or 0)
        except Exception:  # noqa: BLE001 - not there yet, or the cluster electing
            pending = -1
        return {"statuses": statuses, "pending": pending, "drains": await kv_drain_writes(js),
                "tickets": await KvTicketStore(js).list_all()}

    def quiet(self, obs: dict[str, Any]) -> bool:
        if obs["pending"] != 0:
            return False
        live = [st for st in obs["statuses"].values() if not isinstance(st, Exception)]
        if len(live) != len(obs["statuses"]):
            return False
        recorded = {f["event_id"] for st in live for f in st.faults}
        if any(s.event_id not in recorded for s in self.sent):
            return False
        drained = {n for n, st in obs["statuses"].items() if st.drained}
        ticketed = {(t.get("cluster"), t.get("node")) for t in obs["tickets"]}
        return all(st.phase in STABLE_PHASES for st in live) and drained <= ticketed

    async def runs_per_workflow(self, client: Any) -> dict[tuple[str, str], int]:
        """Runs of each node's workflow in Temporal's visibility (its own record of every run ever started)."""
        out = {}
        for c, node in self._targets():
            wid = subjects.workflow_id(c, node)
            out[(c, node)] = len([w async for w in client.list_workflows(f"WorkflowId = '{wid}'")])
        return out

    async def verdict(self, obs: dict[str, Any], runs: dict[tuple[str, str], int], js: Any,
                      quiesced_s: float | None) -> tuple[list[tuple[str, Any]], list[str]]:
        failures: list[str] = []
        sent_ids = {s.event_id: s for s in self.sent}
        rec: Counter = Counter()
        extra = 0
        live = {}
        for key, st in obs["statuses"].items():
            if isinstance(st, Exception):
                failures.append(f"{key}: workflow status unreadable: {st}")
                continue
            live[key] = st
            for f in st.faults:
                rec[f["event_id"]] += f.get("count", 1)
                s = sent_ids.get(f["event_id"])
                if s is None or (s.cluster, s.node) != key:
                    extra += 1
        missing = [e for e in sent_ids if rec[e] == 0]
        dup_records = sum(c - 1 for c in rec.values() if c > 1)
        if missing:
            failures.append(f"{len(missing)} fault(s) sent but not recorded, e.g. {missing[:3]}")
        if dup_records:
            failures.append(f"{dup_records} fault(s) recorded more than once")
        if extra:
            failures.append(f"{extra} record(s) for events never sent to that node")
        twice_opened = {k: n for k, n in runs.items() if n != 1}
        if twice_opened:
            failures.append(f"incidents not opened exactly once (runs in Temporal): {twice_opened}")
        # drains, from the scheduler's own bucket: writes per (node, incident), drains per node, the budget
        writes: Counter = Counter()
        for node, entries in obs["drains"].items():
            for e in entries:
                if e.get("owner") == "fleetmend":
                    writes[(node, e.get("incident_id"))] += 1
        drains_per_node: Counter = Counter()
        peaks = {}
        for c in CLUSTERS:
            timeline = await kv_drain_timeline(js, c)
            peak, twice = replay_drain_timeline(set(), timeline)
            peaks[c] = peak
            drained = set()
            for node, on in timeline:
                if on and node not in drained:
                    drains_per_node[(c, node)] += 1
                    drained.add(node)
                elif not on:
                    drained.discard(node)
            if peak > BUDGET:
                failures.append(f"{c}: {peak} nodes drained at once under a budget of {BUDGET}")
        tickets_per_node = Counter((t.get("cluster"), t.get("node")) for t in obs["tickets"])
        tickets_per_incident = Counter(t.get("incident_id") for t in obs["tickets"])
        drain_nodes = {(s.cluster, s.node) for s in self.sent if s.drain}
        drained_nodes = {k for k, n in drains_per_node.items() if n}
        held = {k for k, st in live.items() if st.phase == "awaiting_permit"}
        if any(n > 1 for n in drains_per_node.values()):
            failures.append(f"nodes drained more than once: {[k for k, n in drains_per_node.items() if n > 1]}")
        if any(n > 1 for n in writes.values()):
            failures.append(f"duplicate drain writes: {[k for k, n in writes.items() if n > 1]}")
        if drained_nodes - drain_nodes:
            failures.append(f"nodes drained without a drain-worthy fault: {sorted(drained_nodes - drain_nodes)}")
        if drain_nodes - drained_nodes - held:
            failures.append(f"drain-worthy nodes neither drained nor waiting for a permit: "
                            f"{ {k: live[k].phase if k in live else '?' for k in drain_nodes - drained_nodes - held} }")
        if set(tickets_per_node) != drained_nodes or any(n != 1 for n in tickets_per_node.values()):
            failures.append(f"tickets per node differ from one per drained node: {dict(tickets_per_node)} vs "
                            f"drained {sorted(drained_nodes)}")
        if any(n > 1 for n in tickets_per_incident.values()):
            failures.append(f"incidents ticketed twice: {[k for k, n in tickets_per_incident.items() if n > 1]}")
        wf_drained = {k for k, st in live.items() if st.drained}
        if wf_drained != drained_nodes:
            failures.append(f"workflows and scheduler disagree on drained nodes: workflows only "
                            f"{sorted(wf_drained - drained_nodes)}, scheduler only {sorted(drained_nodes - wf_drained)}")
        if quiesced_s is None:
            failures.append(f"no quiescence within {QUIESCE_TIMEOUT_S:.0f}s (consumer pending {obs['pending']})")
        per = {c: (sum(1 for s in self.sent if s.cluster == c),
                   sum(1 for k in drained_nodes if k[0] == c), sum(1 for k in held if k[0] == c)) for c in CLUSTERS}
        rows: list[tuple[str, Any]] = [
            ("fleet clusters (routers, workers each)", ", ".join(f"{c} (2, 2)" for c in CLUSTERS)),
            ("nodes per cluster (real agents)", self.nodes),
            ("faults sent", len(self.sent)),
            ("faults recorded once (workflow status)", f"{sum(1 for e in sent_ids if rec[e] == 1)}/{len(sent_ids)}"),
            ("faults missing / recorded twice / foreign", f"{len(missing)} / {dup_records} / {extra}"),
            ("incidents (nodes with a fault)", len(runs)),
            ("incidents opened once (Temporal runs)", f"{sum(1 for n in runs.values() if n == 1)}/{len(runs)}"),
            ("drain-worthy nodes", len(drain_nodes)),
            ("drained (scheduler's drain bucket)", f"{len(drained_nodes)}: "
                                                    f"{', '.join(f'{c} {p[1]}' for c, p in per.items())}"),
            ("waiting for a permit (budget full)", f"{len(held)}: {', '.join(f'{c} {p[2]}' for c, p in per.items())}"),
            ("nodes drained more than once", sum(1 for n in drains_per_node.values() if n > 1)),
            ("tickets (ticket store) / drained nodes ticketed once",
             f"{len(obs['tickets'])} / {sum(1 for k in drained_nodes if tickets_per_node.get(k) == 1)}"
             f"/{len(drained_nodes)}"),
            ("most drained at once (drain records) / budget",
             ", ".join(f"{c} {peaks[c]}/{BUDGET}" for c in CLUSTERS)),
            ("kills (kill -9 at s; back after s, - left dead)",
             ", ".join(f"{n}@{t:.0f}s({'-' if b is None else f'{b:.1f}'})" for t, n, b in sorted(self.kills))),
            ("nats-server killed because", getattr(self, "nats_victim_why", "-")),
            ("unexpected exits", sum(self.unexpected_exits.values())),
            ("quiescence after last fault s", "-" if quiesced_s is None else f"{quiesced_s:.1f}"),
        ]
        return rows, failures

    async def replicas_and_catch_up(self, js: Any) -> tuple[list[tuple[str, Any]], list[str]]:
        """Every stream and bucket at `REPLICAS`; the restarted server's own `/jsz` holds what the others hold."""
        names = [n async for n in _stream_names(js)]
        at = {}
        for n in names:
            at[n] = (await js.stream_info(n)).config.num_replicas
        low = {n: r for n, r in at.items() if r != REPLICAS}
        i = getattr(self, "nats_victim", None)
        failures = []
        if low:
            failures.append(f"streams/buckets not at {REPLICAS} replicas: {low}")
        if i is None:
            return [("streams and buckets at 3 replicas", f"{len(at) - len(low)}/{len(at)}")], failures + \
                ["no nats-server was killed"]
        t0 = time.monotonic()
        diff: dict[str, Any] = {}
        while time.monotonic() - t0 < CATCH_UP_S:
            # the others first: what the restarted one must hold at least (a stream written meanwhile, the
            # leases' renewals, may move on between the reads; the quiet ones must be equal)
            try:
                others = [_stream_states(self.nats.monitor(j, "jsz?streams=true")) for j in range(REPLICAS) if j != i]
                mine = _stream_states(self.nats.monitor(i, "jsz?streams=true"))
            except OSError as err:
                diff = {"monitor": repr(err)}
                await asyncio.sleep(0.5)
                continue
            diff = {}
            for n in names:
                want = max((o.get(n, (0, 0, 0)) for o in others), key=lambda s: s[1])
                have = mine.get(n)
                busy = n in BUSY_STREAMS
                if have is None or (have != want if not busy else have[1] < min(o.get(n, (0, 0, 0))[1]
                                                                                  for o in others)):
                    diff[n] = {"restarted": have, "others": want}
            if not diff:
                break
            await asyncio.sleep(0.5)
        caught = time.monotonic() - t0
        if diff:
            failures.append(f"nats-server-{i} did not catch up within {CATCH_UP_S:.0f}s: {diff}")
        return [("streams and buckets at 3 replicas", f"{len(at) - len(low)}/{len(at)} "
                 f"({sum(1 for n in at if n.startswith('KV_'))} buckets, {sum(1 for n in at if not n.startswith('KV_'))}"
                 f" streams)"),
                (f"restarted nats-server-{i}: its own /jsz equals the others'",
                 f"{len(names) - len(diff)}/{len(names)} streams and buckets ("
                 + (f"equal at the first read, {t0 - self.nats_back_at:.0f} s after its restart" if caught < 0.5
                    else f"equal {t0 + caught - self.nats_back_at:.0f} s after its restart") + ")")], failures

    async def run(self) -> int:
        import nats
        from temporalio.client import Client

        from fleetmend.config import load_settings
        from fleetmend.dev.perfsim import PerfFleet, run_perf_sim
        from fleetmend.infra.converter import data_converter
        from fleetmend.infra.jetstream import use_replicas

        use_replicas(REPLICAS)
        try:
            await self.start_all()
            stop_sup, stop_perf = asyncio.Event(), asyncio.Event()
            sup = asyncio.create_task(self.supervise(stop_sup))
            perf_settings = load_settings(None, nats_url=self.nats.url, cluster=ANALYZED,
                                          streams={"replicas": REPLICAS})
            perf = asyncio.create_task(run_perf_sim(
                perf_settings, PerfFleet(PERF_NODES, slow_nodes=1, slowdown=0.2, seed=self.seed, cluster=ANALYZED,
                                         node_prefix="perf", job_nodes=PERF_NODES),
                3600.0, PERF_INTERVAL_S, stop_perf))
            async def quiet(err: Exception) -> None:  # the driver's reconnects while a server is down: expected
                self._say(f"driver's NATS client: {err!r}")

            nc = self.nc = await nats.connect(self.nats.urls, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                                              error_cb=quiet)
            js = nc.jetstream(timeout=10.0)
            from fleetmend.analyzer.service import analyzer_kv

            kv = await analyzer_kv(js)
            # the analyzer is active and has written a judged window before the burst starts
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                st = await self.analyzer_state(kv)
                if st["holder"] and st["last_closed"] is not None and await self.active_analyzer(kv):
                    break
                await asyncio.sleep(0.5)
            self._say(f"analyzer active: {st}")
            self.t_burst = time.monotonic()
            await asyncio.gather(self.drive_faults(), self.kill_loop(kv))
            t_last = time.monotonic()
            self._say(f"{len(self.sent)} faults sent; waiting for quiescence")
            client = await Client.connect(self.temporal_address, data_converter=data_converter)
            quiesced, obs = await wait_quiet(lambda: self.observe(client, js), self.quiet, t_last, QUIESCE_TIMEOUT_S,
                                             2.0)
            self._say(f"quiescence: {quiesced}")
            runs = await self.runs_per_workflow(client)
            rows, failures = await self.verdict(obs, runs, js, quiesced)
            more, failed = await self.analyzer_claims(kv)
            rows += more
            failures += failed
            stop_perf.set()
            await asyncio.gather(perf, return_exceptions=True)
            more, failed = await self.replicas_and_catch_up(js)
            rows += more
            failures += failed
            rows.append(("wall s", f"{time.monotonic() - self.t0:.1f}"))
            stop_sup.set()
            await sup
            await nc.close()
            print_table(rows, failures, seed=self.seed, title="clustered chaos run",
                        verdict="PASS: every fault recorded once, every incident opened once, each node drained "
                                "and ticketed once within the budget; the analyzer's standby took over; the "
                                "restarted nats-server caught up")
            return 1 if failures else 0
        finally:
            self.stop_all()


BUSY_STREAMS = frozenset({f"KV_{subjects.LEASE_KV_BUCKET}", f"KV_{subjects.ANALYZER_KV_BUCKET}", subjects.PERF_STREAM,
                          subjects.JOB_STREAM, f"KV_{subjects.PERMIT_KV_BUCKET}"})
"""Written all the time by live processes (presence and leases renewed, the analyzer's state and lease, telemetry,
the guard's pool syncs): the restarted server must hold at least what the others held when read just before."""


async def _stream_names(js: Any) -> Any:
    """Every stream's name (the KV buckets' `KV_<bucket>` included), from the JetStream API."""
    resp = await js._api_request("$JS.API.STREAM.NAMES", b"{}", timeout=10.0)
    for n in resp.get("streams") or []:
        yield n


def _stream_states(jsz: dict[str, Any]) -> dict[str, tuple[int, int, int]]:
    """stream → (messages, last_seq, first_seq) as this one server holds it (its `/jsz?streams=true`)."""
    return {st["name"]: (st["state"]["messages"], st["state"]["last_seq"], st["state"]["first_seq"])
            for acc in jsz.get("account_details") or [] for st in acc.get("stream_detail") or []}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=6, help="nodes per fleet cluster")
    ap.add_argument("--faults", type=int, default=48)
    ap.add_argument("--duration", type=float, default=20.0, help="seconds over which faults are sent")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--kill-order", default=",".join(KILL_ORDER),
                    help="comma-separated victims (worker, nats, router, analyzer), or 'random' (seeded)")
    ap.add_argument("--workdir", type=Path, default=None, help="keep state and logs here (default: a temp dir)")
    ap.add_argument("-v", "--verbose", action="store_true", help="narrate kills and restarts on stderr")
    args = ap.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fleetmend-chaos-cluster-"))
    order = () if args.kill_order == "random" else tuple(x.strip() for x in args.kill_order.split(","))
    if sorted(order) not in ([], sorted(KILL_ORDER)):
        ap.error(f"--kill-order: each of {', '.join(KILL_ORDER)} once, or 'random'")
    chaos = ClusterChaos(args.nodes, args.faults, args.duration, args.seed, workdir, verbose=args.verbose,
                         kill_order=order)
    rc = asyncio.run(chaos.run())
    print(f"state and logs: {workdir}" if args.workdir or rc else "", file=sys.stderr)
    if rc == 0 and args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
