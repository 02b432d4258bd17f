"""Chaos suite: kill -9 every process of the pipeline mid-stream and prove nothing is lost or done twice.

    python bench/chaos.py --nodes 20 --faults 100 --duration 40 --seed 7

Starts, each as its own OS process: `nats-server -js` and `temporal server start-dev` (the
`fleetmend.dev.servers` code `dev up` uses), `fleetmend router`, `fleetmend worker --scheduler standalone`
(drained set in a JetStream KV bucket, local ticket store) and one agent process running a
`run_agent` per node (the real `Publisher` → JetStream/spool path; a `FollowProbe` tails each node's
JSON-lines fault file, re-reading it from the start after every restart, so re-sends are the rule).

While the driver appends `--faults` seeded fault events (a mix of drain-worthy XIDs 79/48/95 and
application-side XIDs 13/31/43, each on its own PCI address so records never merge) for random nodes
over `--duration` seconds, it kills -9, one at a time at seeded random points, the agent, the router,
the worker, nats-server and the Temporal server, and restarts each with the same state directories.
Then it waits for quiescence (every fault recorded, consumer empty, every drained node awaiting repair
with a ticket) and prints a table. Exit status 1 when any claim fails:

- every fault sent is recorded exactly once in its node's `NodeRemediation` workflow
  (`status` query: one `FaultRecord` per event id, count 1, no extra ids);
- no incident was drained twice (KV bucket history: one fleetmend drain write per node and incident);
- no incident was ticketed twice (local ticket store: one ticket per incident id);
- every node with a drain-worthy fault is drained and ticketed;
- an incident terminated while it holds a drain permit leaves its node drained and counted: FleetGuard
  lists it as stranded within 30 s, the pool keeps its slot, and `fleetmend breaker release NODE` returns
  it to service and frees the slot;
- a burst of `BURST_NODES` fatal faults under a budget of 5 more drains, with the router killed -9 a
  moment into it and the worker right after: at no instant more nodes drained than the budget (replayed
  from the drain records, deletes included), no node drained twice, no node left drained without a
  running incident, and the pool's holders are exactly the drained nodes.

After quiescence, two more rows: poison messages (JSON nested 50k deep, an observed_at that overflows
UTC, not UTF-8, not an object) published on a live node's subject must all become dead letters while
the router stays the same process; and, as root (the agents' spools live on a small tmpfs), NATS is
killed while that filesystem is full: the faults the disk refuses must be counted (`fault_lost`
ENOSPC) with the agent still up, and faults after space returns are spooled and reach the incident.

Internal modes (run by the driver itself): `python bench/chaos.py agents --dir D --nodes n1,n2,...`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fleetmend import subjects  # noqa: E402
from fleetmend.dev import servers  # noqa: E402

DRAIN_XIDS = (79, 48, 95)
"""Catalog drain=True (fell off the bus, DBE, uncontained ECC)."""
APP_XIDS = (13, 31, 43)
"""Catalog drain=False (application-side): recorded, nothing touched."""
DRAIN_SHARE = 0.3
QUIESCE_TIMEOUT_S = 150.0
TERMINATED_PERMIT_S = 30.0
POISON_DEADLETTER_S = 30.0
"""Poison messages published after quiescence must all be dead-lettered within this (router alive)."""
SPOOL_TMPFS_SIZE = "4m"
"""Root only: the agents' spools live on a tmpfs this big, so the full-spool phase fills a real
filesystem (ENOSPC). Without root the phase is reported as skipped."""
SPOOL_PHASE_FAULTS = 6
SPOOL_PHASE_S = 45.0
BURST_NODES = 40
BURST_BUDGET = 5
"""The burst phase's budget: this many drains beyond those in force when it starts."""
BURST_QUIESCE_S = 120.0
STABLE_PHASES = frozenset({"triage", "awaiting_permit", "awaiting_repair", "closed"})
"""Phases an incident rests in without more input; anything else (draining, diagnosing, ...) is in flight."""
FOLLOW_POLL_S = 0.2
"""How often the agent's FollowProbe looks for new lines (a bench stand-in for inotify)."""


# ------------------------------------------------------------------------------------- agent mode


class FollowProbe:
    """Tails a JSON-lines file of `FaultEvent`s (event ids kept), from the first line, forever.

    Runs inside the real agent (`run_agent(probes=[...])`), so every event goes through the agent's
    `Publisher` (JetStream with `Nats-Msg-Id`, or the on-disk spool while NATS is away). After a restart
    it re-emits the whole file: JetStream's duplicate window and the workflow's event-id set must
    absorb the re-sends.
    """

    name = "chaos-follow"

    def __init__(self, path: Path, cluster: str, node: str) -> None:
        self.path, self.cluster, self.node = path, cluster, node

    async def run(self, emit: Any) -> None:
        from fleetmend.events import FaultEvent

        offset = 0
        buf = b""
        while True:
            with contextlib.suppress(FileNotFoundError):
                with open(self.path, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
                offset += len(chunk)
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if line.strip():
                        data = json.loads(line)
                        data.update(cluster=self.cluster, node=self.node)
                        await emit(FaultEvent.model_validate(data))
            await asyncio.sleep(FOLLOW_POLL_S)


async def agents_main(args: argparse.Namespace) -> int:
    """One process, one `run_agent` per node (own spool, own diag responder), until SIGTERM."""
    import signal

    from agents.runner import run_agent
    from fleetmend.config import load_settings
    from fleetmend.infra.logs import configure_logging

    configure_logging("json")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    base = load_settings(None)
    inject = Path(args.dir) / "inject"
    runs = []
    for node in args.node_list.split(","):
        s = base.model_copy(update={"node": node})
        runs.append(run_agent(s, stop=stop, probes=[FollowProbe(inject / f"{node}.jsonl", s.cluster, node)],
                              shutdown_timeout_s=3.0))
    await asyncio.gather(*runs)
    return 0


# ------------------------------------------------------------------------------------- driver


@dataclass
class Sent:
    event_id: str
    cluster: str
    node: str
    xid: int
    drain: bool


def pipeline_env(*, max_drained_nodes: int) -> dict[str, str]:
    """The environment every chaos run gives its router, worker and agent processes: short acks, naks, calls and
    diagnostics, no debounce or recovery settle, a 2 s permit reconciliation, and every blast-radius limit but
    `max_drained_nodes` open (the claims are about drains, tickets and budgets under kills)."""
    return {
        "FLEETMEND_LOG_FORMAT": "json", "FLEETMEND_SCHEDULER": "standalone",
        "FLEETMEND_ROUTER__ACK_WAIT_S": "10", "FLEETMEND_ROUTER__NAK_DELAY_S": "0.5",
        "FLEETMEND_ROUTER__TEMPORAL_CALL_TIMEOUT_S": "5", "FLEETMEND_POLICY__DIAG_TIMEOUT_S": "3",
        "FLEETMEND_AGENT__NICE": "0", "FLEETMEND_AGENT__HEARTBEAT_INTERVAL_S": "5",
        "FLEETMEND_AGENT__PUBLISH_TIMEOUT_S": "2",
        "FLEETMEND_POLICY__MAX_DRAINED_NODES": str(max_drained_nodes), "FLEETMEND_POLICY__MAX_DRAINED_PERCENT": "100",
        "FLEETMEND_POLICY__MAX_DRAINED_PER_RACK": "100000", "FLEETMEND_POLICY__BREAKER_DISTINCT_NODES": "100000",
        "FLEETMEND_POLICY__DOMAIN_INCIDENT_NODES": "100000", "FLEETMEND_POLICY__DEBOUNCE_S": "0",
        "FLEETMEND_POLICY__RECOVERY_SETTLE_S": "0", "FLEETMEND_POLICY__PERMIT_RECONCILE_S": "2",
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }


def write_fault(inject: Path, i: int, cluster: str, node: str, drain: bool, rng: random.Random) -> Sent:
    """Append the `i`-th chaos fault for `node` to its JSON-lines file under `inject` (read by the agent's
    `FollowProbe`): a drain-worthy XID (`DRAIN_XIDS`) when `drain`, else an application-side one (`APP_XIDS`),
    each on its own PCI address so that records never merge. Returns what was sent."""
    from fleetmend.events import Component, Device, FaultEvent, Severity, Source

    xid = rng.choice(DRAIN_XIDS if drain else APP_XIDS)
    bus = f"0000:{(i >> 8) & 0xff:02x}:{i & 0xff:02x}.0"
    ev = FaultEvent(cluster=cluster, node=node, component=Component.GPU, kind="xid", code=xid,
                    severity=Severity.FATAL if drain else Severity.DEGRADED, source=Source.INJECT,
                    device=Device(pci_bus_id=bus), message=f"chaos fault {i}",
                    raw=f"NVRM: Xid (PCI:{bus[:-2]}): {xid}, pid='<unknown>', name=<unknown>, chaos {i}")
    with open(inject / f"{node}.jsonl", "ab") as f:
        f.write(ev.to_json_bytes() + b"\n")
    return Sent(ev.event_id, cluster, node, xid, drain)


async def wait_quiet(observe: Any, quiet: Any, since: float, timeout_s: float,
                     settle_s: float) -> tuple[float | None, Any]:
    """Call `observe()` every second until `quiet(obs)` or `timeout_s` from now; once quiet, wait `settle_s`
    (anything still to double-apply would show) and observe again. Returns (seconds from `since`, a
    `time.monotonic()`, until quiet, None if never; the last observation)."""
    deadline = time.monotonic() + timeout_s
    obs = await observe()
    while not quiet(obs):
        if time.monotonic() >= deadline:
            return None, obs
        await asyncio.sleep(1.0)
        obs = await observe()
    quiesced = time.monotonic() - since
    await asyncio.sleep(settle_s)
    return quiesced, await observe()


@dataclass
class Chaos:
    nodes: int
    faults: int
    duration_s: float
    seed: int
    workdir: Path
    verbose: bool = False
    cluster: str = "chaos"
    procs: dict[str, servers.ManagedProcess] = field(default_factory=dict)
    sent: list[Sent] = field(default_factory=list)
    kills: list[tuple[float, str, float]] = field(default_factory=list)
    """(seconds since start, victim, seconds until it was back)."""
    unexpected_exits: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.node_names = [f"n{i:03d}" for i in range(self.nodes)]
        self.state = self.workdir / "state"
        self.inject = self.workdir / "inject"
        self.logs = self.workdir / "logs"
        for d in (self.state, self.inject, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        self.nats_port = servers.free_port()
        self.temporal_port = servers.free_port()
        self.nats_url = f"nats://127.0.0.1:{self.nats_port}"
        self.temporal_address = f"127.0.0.1:{self.temporal_port}"
        self.env = {
            "FLEETMEND_NATS_URL": self.nats_url, "FLEETMEND_TEMPORAL_ADDRESS": self.temporal_address,
            "FLEETMEND_STATE_DIR": str(self.state), "FLEETMEND_CLUSTER": self.cluster, "FLEETMEND_TASK_QUEUE": "chaos",
            # every drain-worthy node should get a permit (the blast-radius tests live elsewhere)
            **pipeline_env(max_drained_nodes=100000),
        }

    # -- processes ----------------------------------------------------------------------------
    def _build(self) -> None:
        py = sys.executable
        self.procs["nats-server"] = servers.nats_server(self.workdir / "nats-js", self.nats_port,
                                                        log_path=self.logs / "nats.log")
        self.procs["temporal"] = servers.temporal_dev_server(self.workdir / "temporal.db", self.temporal_port,
                                                             0, log_path=self.logs / "temporal.log", ui=False)
        self.procs["router"] = servers.ManagedProcess(
            "router", [py, "-m", "fleetmend.cli.main", "router"], self.logs / "router.log", env=self.env)
        self.procs["worker"] = servers.ManagedProcess(
            "worker", [py, "-m", "fleetmend.cli.main", "worker"], self.logs / "worker.log", env=self.env)
        self.procs["agent"] = servers.ManagedProcess(
            "agent", [py, str(Path(__file__).resolve()), "agents", "--dir", str(self.workdir),
                      "--node-list", ",".join(self.node_names)], self.logs / "agent.log", env=self.env)

    async def _start(self, name: str) -> None:
        p = self.procs[name]
        p.start()
        if name == "nats-server":
            await asyncio.to_thread(p.wait_tcp, "127.0.0.1", self.nats_port, 15.0, "Server is ready")
        elif name == "temporal":
            await asyncio.to_thread(p.wait_tcp, "127.0.0.1", self.temporal_port, 60.0)
            await servers.wait_temporal_ready(self.temporal_address)

    async def start_all(self) -> None:
        self._build()
        self.spool_mount = None
        if os.geteuid() == 0 and not os.environ.get("FLEETMEND_CHAOS_NO_TMPFS"):
            mnt = self.state / "agent"
            mnt.mkdir(parents=True, exist_ok=True)
            r = await asyncio.to_thread(subprocess.run, ["mount", "-t", "tmpfs", "-o", f"size={SPOOL_TMPFS_SIZE}",
                                                         "tmpfs", str(mnt)], capture_output=True, text=True)
            self.spool_mount = mnt if r.returncode == 0 else None
        for name in ("nats-server", "temporal", "worker", "router", "agent"):
            await self._start(name)

    def stop_all(self) -> None:
        for name in ("agent", "router", "worker"):
            if name in self.procs:
                self.procs[name].terminate()
        for name in ("agent", "router", "worker", "temporal", "nats-server"):
            if name in self.procs:
                self.procs[name].stop(timeout_s=10)
        if getattr(self, "spool_mount", None) is not None:
            subprocess.run(["umount", "-l", str(self.spool_mount)], check=False)

    async def supervise(self, stop: asyncio.Event) -> None:
        """Restart a pipeline process that exited on its own (counted: the claim is that none does)."""
        while not stop.is_set():
            for name in ("router", "worker", "agent"):
                p = self.procs[name]
                if p.proc is not None and not p.alive() and not getattr(p, "_chaos_down", False):
                    self.unexpected_exits[name] += 1
                    self._say(f"{name} exited on its own (rc {p.proc.returncode}); restarting\n{p.log_tail(5)}")
                    await self._start(name)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.5):
                    await stop.wait()

    def _say(self, text: str) -> None:
        if self.verbose:
            print(f"[chaos {time.monotonic() - self.t0:6.1f}s] {text}", file=sys.stderr, flush=True)

    # -- load and faults ------------------------------------------------------------------------
    async def drive_faults(self) -> None:
        interval = self.duration_s / max(self.faults, 1)
        for i in range(self.faults):
            node = self.rng.choice(self.node_names)
            self.sent.append(write_fault(self.inject, i, self.cluster, node, self.rng.random() < DRAIN_SHARE,
                                         self.rng))
            await asyncio.sleep(interval)

    async def kill_loop(self) -> None:
        victims = ["agent", "router", "worker", "nats-server", "temporal"]
        self.rng.shuffle(victims)
        slot = self.duration_s / len(victims)
        for k, name in enumerate(victims):
            at = slot * k + self.rng.uniform(0.1, 0.6) * slot
            await asyncio.sleep(max(0.0, at - (time.monotonic() - self.t0)))
            p = self.procs[name]
            p._chaos_down = True  # type: ignore[attr-defined]
            t_kill = time.monotonic() - self.t0
            self._say(f"kill -9 {name} (pid {p.pid})")
            p.kill()
            await asyncio.sleep(self.rng.uniform(0.3, 2.0))
            await self._start(name)
            p._chaos_down = False  # type: ignore[attr-defined]
            back = time.monotonic() - self.t0 - t_kill
            self.kills.append((t_kill, name, back))
            self._say(f"{name} restarted after {back:.1f}s")

    # -- observation ----------------------------------------------------------------------------
    async def observe(self, client: Any, nc: Any) -> dict[str, Any]:
        """Everything the claims are checked against, read from the systems of record."""
        from temporalio.service import RPCError

        from activities.ticket_kv import KvTicketStore
        from workflows.remediation import NodeRemediation

        statuses: dict[str, Any] = {}
        for node in sorted({s.node for s in self.sent}):
            h = client.get_workflow_handle_for(NodeRemediation.run, subjects.workflow_id(self.cluster, node))
            try:
                async with asyncio.timeout(10):
                    statuses[node] = await h.query(NodeRemediation.status)
            except (RPCError, TimeoutError) as err:
                statuses[node] = err
        js = nc.jetstream()
        drains = await kv_drain_writes(js)
        try:
            ci = await js.consumer_info(subjects.FAULT_STREAM, subjects.ROUTER_DURABLE)
            pending = (ci.num_pending or 0) + (ci.num_ack_pending or 0)
        except Exception:  # noqa: BLE001 - not there yet
            pending = -1
        try:
            dl = (await js.stream_info(subjects.DEADLETTER_STREAM)).state.messages
        except Exception:  # noqa: BLE001
            dl = 0
        tickets = await KvTicketStore(js).list_all()  # the deployment's ledger every worker shares
        return {"statuses": statuses, "drains": drains, "pending": pending, "deadletters": dl, "tickets": tickets}

    def quiet(self, obs: dict[str, Any]) -> bool:
        if obs["pending"] != 0:
            return False
        recorded = {f["event_id"] for st in obs["statuses"].values() if not isinstance(st, Exception)
                    for f in st.faults}
        if any(s.event_id not in recorded for s in self.sent):
            return False
        for st in obs["statuses"].values():
            if isinstance(st, Exception) or st.phase not in STABLE_PHASES:
                return False
        return True

    def verdict(self, obs: dict[str, Any], quiesced_s: float | None) -> tuple[list[tuple[str, Any]], list[str]]:
        failures: list[str] = []
        sent_ids = {s.event_id: s for s in self.sent}
        rec_count: Counter = Counter()
        extra = 0
        errors = 0
        for node, st in obs["statuses"].items():
            if isinstance(st, Exception):
                errors += 1
                failures.append(f"{node}: workflow status unreadable: {st}")
                continue
            for f in st.faults:
                rec_count[f["event_id"]] += f.get("count", 1)
                if f["event_id"] not in sent_ids or sent_ids[f["event_id"]].node != node:
                    extra += 1
        recorded = sum(1 for e in sent_ids if rec_count[e] >= 1)
        missing = [e for e in sent_ids if rec_count[e] == 0]
        dup_records = sum(c - 1 for c in rec_count.values() if c > 1)
        deduped = sum(st.duplicates for st in obs["statuses"].values() if not isinstance(st, Exception))
        # drains: one fleetmend write per (node, incident)
        drain_writes = Counter()
        for node, entries in obs["drains"].items():
            for e in entries:
                if e.get("owner") == "fleetmend":
                    drain_writes[(node, e.get("incident_id"))] += 1
        dup_drains = sum(c - 1 for c in drain_writes.values() if c > 1)
        ticket_per_incident = Counter(t.get("incident_id") for t in obs["tickets"])
        dup_tickets = sum(c - 1 for c in ticket_per_incident.values() if c > 1)
        drain_nodes = {s.node for s in self.sent if s.drain}
        drained_nodes = {n for (n, _i) in drain_writes}
        ticketed_nodes = {t.get("node") for t in obs["tickets"]}
        if missing:
            failures.append(f"{len(missing)} fault(s) sent but not recorded, e.g. {missing[:3]}")
        if dup_records:
            failures.append(f"{dup_records} fault(s) recorded more than once")
        if extra:
            failures.append(f"{extra} record(s) for events never sent to that node")
        if dup_drains:
            failures.append(f"{dup_drains} duplicate drain(s): {[k for k, c in drain_writes.items() if c > 1]}")
        if dup_tickets:
            failures.append(f"{dup_tickets} duplicate ticket(s): {[k for k, c in ticket_per_incident.items() if c > 1]}")
        live = {n: st for n, st in obs["statuses"].items() if not isinstance(st, Exception)}
        held = {n for n, st in live.items() if st.phase == "awaiting_permit"}
        wf_drained = {n for n, st in live.items() if st.drained}
        wf_ticketed = {n for n, st in live.items() if st.ticket}
        untouched = sorted(n for n in drain_nodes if n not in drained_nodes and n not in held
                           and live.get(n) is not None and live[n].phase == "triage")
        if untouched:
            failures.append(f"drain-worthy nodes neither drained nor waiting for a permit: {untouched}")
        if wf_drained != drained_nodes:
            failures.append(f"workflows and scheduler disagree on drained nodes: workflows only "
                            f"{sorted(wf_drained - drained_nodes)}, scheduler only {sorted(drained_nodes - wf_drained)}")
        if wf_ticketed != ticketed_nodes:
            failures.append(f"workflows and ticket store disagree: workflows only {sorted(wf_ticketed - ticketed_nodes)}, "
                            f"store only {sorted(ticketed_nodes - wf_ticketed)}")
        if drained_nodes - drain_nodes:
            failures.append(f"nodes drained without a drain-worthy fault: {sorted(drained_nodes - drain_nodes)}")
        if quiesced_s is None:
            failures.append(f"no quiescence within {QUIESCE_TIMEOUT_S:.0f}s (consumer pending {obs['pending']})")
        rows: list[tuple[str, Any]] = [
            ("nodes", self.nodes),
            ("faults sent", len(self.sent)),
            ("faults recorded in workflows", recorded),
            ("faults missing", len(missing)),
            ("duplicate records", dup_records),
            ("redeliveries deduped by workflows", deduped),
            ("drain-worthy nodes", len(drain_nodes)),
            ("held by safety policy (awaiting permit)", len(held)),
            ("drains issued", sum(drain_writes.values())),
            ("duplicate drains", dup_drains),
            ("tickets filed", len(obs["tickets"])),
            ("duplicate tickets", dup_tickets),
            ("dead letters", obs["deadletters"]),
            ("kills (kill -9, restart s)", ", ".join(f"{n}@{t:.0f}s({b:.1f})" for t, n, b in self.kills)),
            ("unexpected exits", sum(self.unexpected_exits.values())),
            ("quiescence after last fault s", "-" if quiesced_s is None else f"{quiesced_s:.1f}"),
        ]
        return rows, failures

    async def terminated_incident(self, client: Any, nc: Any) -> tuple[list[tuple[str, Any]], list[str]]:
        """Terminate (as an operator would) one incident that holds a drain permit: its node stays drained,
        so FleetGuard must keep counting it (stranded, within `TERMINATED_PERMIT_S`; its pool slot kept)
        until `fleetmend breaker release NODE` returns it to service and frees the slot."""
        from fleetmend.infra.permit_pool import PermitPool
        from fleetmend.messages import GuardApi

        row = "terminated incident: still counted, then released by hand"
        guard = client.get_workflow_handle(subjects.fleetguard_workflow_id(self.cluster))
        try:
            st = await guard.query(GuardApi.STATUS)
        except Exception as err:  # noqa: BLE001 - no guard: nothing was drained
            return [(row, f"skipped (no FleetGuard: {err})")], []
        held = [h["node"] for h in st["held"]]
        if not held:
            return [(row, "skipped (no permit held)")], []
        node = held[0]
        pool = await PermitPool.open(nc.jetstream())
        await client.get_workflow_handle(subjects.workflow_id(self.cluster, node)).terminate(
            reason="chaos: an operator terminates an incident that holds a drain permit")
        t0 = time.monotonic()
        while time.monotonic() - t0 < TERMINATED_PERMIT_S:
            st = await guard.query(GuardApi.STATUS)
            if node in st.get("stranded", {}):
                break
            await asyncio.sleep(0.5)
        else:
            return [(row, f"{node}: not listed as stranded after {TERMINATED_PERMIT_S:.0f} s")], \
                [f"{node}: a terminated incident's drained node was not counted as stranded"]
        found = time.monotonic() - t0
        state = await pool.read(self.cluster)
        if state is None or node not in state.holders:
            return [(row, f"{node}: slot freed while still drained")], [f"{node}: stranded node's slot freed"]
        r = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "fleetmend.cli.main", "breaker", "release",
                                                     node, "--note", "chaos: checked by hand"],
                                    capture_output=True, text=True, env={**os.environ, **self.env}, timeout=60)
        # the guard's `release_permit` update answers at once and its pool write follows in its next activity:
        # the slot must be free within seconds, not at the instant the command returns
        deadline = time.monotonic() + 15
        while True:
            state = await pool.read(self.cluster)
            if state is None or node not in state.holders or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        drained = await kv_drained_now(nc.jetstream(), self.cluster)
        failures = []
        if r.returncode != 0:
            failures.append(f"breaker release {node} failed: {r.stdout.strip()} {r.stderr.strip()[-300:]}")
        if state is not None and node in state.holders:
            failures.append(f"{node}: slot still held after breaker release")
        if node in drained:
            failures.append(f"{node}: still drained after breaker release")
        return [(row, f"{node} stranded after {found:.1f} s, slot kept; released: "
                      f"{'undrained, slot freed' if not failures else 'FAILED'}")], failures

    async def burst_under_budget(self, client: Any, nc: Any) -> tuple[list[tuple[str, Any]], list[str]]:
        """`BURST_NODES` fatal XID 79 at once under a budget of `BURST_BUDGET` more drains; the router is
        killed -9 0.5 s in and the worker 2 s in, each restarted a second later."""
        from fleetmend.events import Component, Device, FaultEvent, Severity, Source
        from fleetmend.infra.permit_pool import PermitPool
        from workflows.remediation import NodeRemediation

        js = nc.jetstream()
        pool = await PermitPool.open(js)
        state = await pool.read(self.cluster)
        before = set(state.holders) if state is not None else set()
        budget = len(before) + BURST_BUDGET
        for name in ("router", "worker"):  # the same processes, now under a real budget
            p = self.procs[name]
            p._chaos_down = True  # type: ignore[attr-defined]
            p.env = {**p.env, "FLEETMEND_POLICY__MAX_DRAINED_NODES": str(budget)}
            p.kill()
            await self._start(name)
            p._chaos_down = False  # type: ignore[attr-defined]
        await asyncio.sleep(3.0)  # the guard takes the new budget with the next request
        first_seq = await kv_last_seq(js)
        nodes = [f"burst{i:02d}" for i in range(BURST_NODES)]
        for node in nodes:
            ev = FaultEvent(cluster=self.cluster, node=node, component=Component.GPU, kind="xid", code=79,
                            severity=Severity.FATAL, source=Source.INJECT, device=Device(pci_bus_id="0000:3b:00.0"),
                            message="chaos burst", raw="NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', "
                                                       "name=<unknown>, GPU has fallen off the bus.")
            await js.publish(subjects.fault_subject(self.cluster, node), ev.to_json_bytes(),
                             headers={"Nats-Msg-Id": ev.event_id})
        kills = []
        for name, at in (("router", 0.5), ("worker", 2.0)):
            await asyncio.sleep(at - (kills[-1][1] if kills else 0.0))
            p = self.procs[name]
            p._chaos_down = True  # type: ignore[attr-defined]
            p.kill()
            await asyncio.sleep(1.0)
            await self._start(name)
            p._chaos_down = False  # type: ignore[attr-defined]
            kills.append((name, at))
        deadline = time.monotonic() + BURST_QUIESCE_S
        phases: dict[str, str] = {}
        while time.monotonic() < deadline:
            phases = {}
            for node in nodes:
                h = client.get_workflow_handle_for(NodeRemediation.run, subjects.workflow_id(self.cluster, node))
                try:
                    async with asyncio.timeout(10):
                        phases[node] = (await h.query(NodeRemediation.status)).phase
                except Exception:  # noqa: BLE001 - not started yet
                    phases[node] = "-"
            if all(p in ("awaiting_repair", "awaiting_permit") for p in phases.values()):
                break
            await asyncio.sleep(1.0)
        await asyncio.sleep(3.0)  # anything still to over-drain would show now
        timeline = await kv_drain_timeline(js, self.cluster, after_seq=first_seq)
        start_drained = await kv_drained_now(js, self.cluster, upto_seq=first_seq)
        peak, twice = replay_drain_timeline(start_drained, timeline)
        drained = await kv_drained_now(js, self.cluster)
        state = await pool.read(self.cluster)
        holders = set(state.holders) if state is not None else set()
        no_incident = []
        for node in sorted(drained & set(nodes)):
            d = await client.get_workflow_handle(subjects.workflow_id(self.cluster, node)).describe()
            if d.status is None or d.status.name != "RUNNING":
                no_incident.append(node)
        failures = []
        stuck = sorted(n for n, p in phases.items() if p not in ("awaiting_repair", "awaiting_permit"))
        if stuck:
            failures.append(f"burst: not drained nor waiting for a permit after {BURST_QUIESCE_S:.0f} s: "
                            f"{ {n: phases[n] for n in stuck[:10]} }")
        if peak > budget:
            failures.append(f"burst: {peak} nodes drained at once under a budget of {budget}")
        if twice:
            failures.append(f"burst: drained twice: {twice}")
        if no_incident:
            failures.append(f"burst: drained without a running incident: {no_incident}")
        if holders != {n for n in drained}:
            failures.append(f"burst: pool holders and drained nodes disagree: pool only {sorted(holders - drained)}, "
                            f"drained only {sorted(drained - holders)}")
        n_drained = sum(1 for p in phases.values() if p == "awaiting_repair")
        return [("burst under budget (router, worker kill -9 mid-burst)",
                 f"{BURST_NODES} faults: {n_drained} drained, {sum(1 for p in phases.values() if p == 'awaiting_permit')}"
                 f" waiting; most drained at once {peak} / budget {budget}; drained twice {len(twice)}; "
                 f"drained without incident {len(no_incident)}; pool == drained: {holders == drained}")], failures

    async def poison(self, nc: Any) -> tuple[list[tuple[str, Any]], list[str]]:
        """Publish messages no agent should ever send (JSON nested 50k deep, an observed_at that
        overflows UTC, not UTF-8, JSON that is not an object) on live nodes' fault subjects: each must
        become a dead letter with its reason while the router keeps running."""
        js = nc.jetstream()
        router_pid = self.procs["router"].pid
        node = self.node_names[0]
        good = {"event_id": "0" * 24, "cluster": self.cluster, "node": node, "component": "gpu", "kind": "xid",
                "code": 13, "severity": "degraded", "source": "inject"}
        poison = [b'{"a": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
                  json.dumps({**good, "observed_at": "9999-12-31T23:59:59-23:59"}).encode(),
                  b"\xff\xfe not utf-8", b"[1, 2, 3]"]
        seqs = []
        for data in poison:
            seqs.append((await js.publish(subjects.fault_subject(self.cluster, node), data)).seq)
        t0 = time.monotonic()
        got: set[int] = set()
        while time.monotonic() - t0 < POISON_DEADLETTER_S and not set(seqs) <= got:
            got = set()
            with contextlib.suppress(Exception):
                info = await js.stream_info(subjects.DEADLETTER_STREAM)
                for seq in range(max(info.state.first_seq, info.state.last_seq - 50), info.state.last_seq + 1):
                    with contextlib.suppress(Exception):
                        got.add(json.loads((await js.get_msg(subjects.DEADLETTER_STREAM, seq)).data)["stream_seq"])
            await asyncio.sleep(0.5)
        dead = len(set(seqs) & got)
        router_same = self.procs["router"].alive() and self.procs["router"].pid == router_pid
        rows = [("poison messages (50k-deep JSON, bad observed_at, not UTF-8, not an object)", len(poison)),
                ("poison dead-lettered, router still the same process", f"{dead}/{len(poison)}, "
                 f"{'yes' if router_same else 'NO'}")]
        failures = []
        if dead != len(poison):
            failures.append(f"{len(poison) - dead} poison message(s) not dead-lettered within {POISON_DEADLETTER_S:.0f} s")
        if not router_same:
            failures.append("the router exited after poison messages")
        return rows, failures

    def _logged(self, event: str, **match: Any) -> int:
        n = 0
        for line in (self.logs / "agent.log").read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                n += rec.get("event") == event and all(str(rec.get(k, "")).startswith(v) for k, v in match.items())
        return n

    async def full_spool(self, client: Any) -> tuple[list[tuple[str, Any]], list[str]]:
        """NATS killed while the agents' spool filesystem is full: what the disk refuses is counted
        (`fault_lost` ENOSPC), the agent process stays up; once space returns, faults are spooled and
        reach their incidents after NATS is back."""
        from fleetmend.events import Component, Device, FaultEvent, Severity, Source
        from fleetmend.messages import RemediationApi

        name = "full spool (tmpfs ENOSPC, NATS down)"
        if self.spool_mount is None:
            return [(name, "skipped (mounting a tmpfs needs root)")], []
        agent_pid = self.procs["agent"].pid
        node = self.node_names[1]

        def write(i: int) -> FaultEvent:
            bus = f"0000:fe:{i:02x}.0"
            ev = FaultEvent(cluster=self.cluster, node=node, component=Component.GPU, kind="xid", code=13,
                            severity=Severity.DEGRADED, source=Source.INJECT, device=Device(pci_bus_id=bus),
                            message=f"spool phase {i}", raw=f"NVRM: Xid (PCI:{bus[:-2]}): 13, spool phase {i}")
            with open(self.inject / f"{node}.jsonl", "ab") as f:
                f.write(ev.to_json_bytes() + b"\n")
            return ev

        filler = self.spool_mount / "filler"
        with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 4096)
        lost0, spooled0 = self._logged("fault_lost", reason="ENOSPC"), self._logged("fault_spooled")
        nats = self.procs["nats-server"]
        nats._chaos_down = True  # type: ignore[attr-defined]
        nats.kill()
        for i in range(SPOOL_PHASE_FAULTS):
            write(i)
        t0 = time.monotonic()
        while time.monotonic() - t0 < SPOOL_PHASE_S and \
                self._logged("fault_lost", reason="ENOSPC") - lost0 < SPOOL_PHASE_FAULTS:
            await asyncio.sleep(0.5)
        lost = self._logged("fault_lost", reason="ENOSPC") - lost0
        filler.unlink()
        later = [write(SPOOL_PHASE_FAULTS + i) for i in range(SPOOL_PHASE_FAULTS)]
        while time.monotonic() - t0 < SPOOL_PHASE_S and self._logged("fault_spooled") - spooled0 < SPOOL_PHASE_FAULTS:
            await asyncio.sleep(0.5)
        spooled = self._logged("fault_spooled") - spooled0
        await self._start("nats-server")
        nats._chaos_down = False  # type: ignore[attr-defined]
        h = client.get_workflow_handle(subjects.workflow_id(self.cluster, node))
        want = {e.event_id for e in later}
        recorded: set[str] = set()
        while time.monotonic() - t0 < SPOOL_PHASE_S * 2 and not want <= recorded:
            with contextlib.suppress(Exception):
                st = await h.query(RemediationApi.STATUS)
                recorded = {f["event_id"] for f in st["faults"]}
            await asyncio.sleep(1.0)
        agent_up = self.procs["agent"].alive() and self.procs["agent"].pid == agent_pid
        rows = [(name + ": refused, counted fault_lost", f"{lost}/{SPOOL_PHASE_FAULTS}"),
                (name + ": spooled once space returned", f"{spooled}/{SPOOL_PHASE_FAULTS}"),
                (name + ": then recorded in the incident", f"{len(want & recorded)}/{SPOOL_PHASE_FAULTS}"),
                (name + ": agent still the same process", "yes" if agent_up else "NO")]
        failures = []
        if lost != SPOOL_PHASE_FAULTS:
            failures.append(f"full spool: {lost} of {SPOOL_PHASE_FAULTS} refused faults counted as fault_lost ENOSPC")
        if spooled < SPOOL_PHASE_FAULTS or not want <= recorded:
            failures.append(f"full spool: after space returned {spooled} spooled, "
                            f"{len(want & recorded)}/{SPOOL_PHASE_FAULTS} recorded")
        if not agent_up:
            failures.append("full spool: the agent process exited")
        return rows, failures

    async def run(self) -> int:
        import nats
        from temporalio.client import Client

        from fleetmend.infra.converter import data_converter

        self.t0 = time.monotonic()
        try:
            await self.start_all()
            self._say("all processes up")
            stop_sup = asyncio.Event()
            sup = asyncio.create_task(self.supervise(stop_sup))
            await asyncio.gather(self.drive_faults(), self.kill_loop())
            t_last = time.monotonic()
            self._say(f"{len(self.sent)} faults sent; waiting for quiescence")
            client = await Client.connect(self.temporal_address, data_converter=data_converter)
            nc = await nats.connect(self.nats_url)
            quiesced, obs = await wait_quiet(lambda: self.observe(client, nc), self.quiet, t_last, QUIESCE_TIMEOUT_S,
                                             3.0)
            stop_sup.set()
            await sup
            await nc.close()
            rows, failures = self.verdict(obs, quiesced)
            nc = await nats.connect(self.nats_url)
            for phase in (self.terminated_incident(client, nc), self.burst_under_budget(client, nc), self.poison(nc),
                          self.full_spool(client)):
                more, failed = await phase
                rows += more
                failures += failed
            await nc.close()
            print_table(rows, failures, seed=self.seed)
            return 1 if failures else 0
        finally:
            self.stop_all()


async def kv_drain_writes(js: Any) -> dict[str, list[dict[str, Any]]]:
    """Every write ever kept in the standalone scheduler's KV stream, per node (PUTs only, in order).

    Reads the bucket's backing stream message by message (`KV_<bucket>`), which keeps history 5 per
    key: ample for one incident per node. (nats-py's `kv.history()` intermittently answered
    NoKeysError for a key that had history, so it is not used here.)
    """
    from nats.js.errors import NotFoundError

    stream = f"KV_{subjects.DRAIN_KV_BUCKET}"
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    try:
        info = await js.stream_info(stream)
    except NotFoundError:
        return {}
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            m = await js.get_msg(stream, seq)
        except NotFoundError:
            continue
        op = (m.headers or {}).get("KV-Operation")
        if op in ("DEL", "PURGE") or not m.data:
            continue
        key = m.subject.split(".", 2)[2]  # $KV.<bucket>.<cluster>.<node token>
        out[subjects.parse_drain_kv_key(key)[1]].append(json.loads(m.data))
    return dict(out)


async def kv_last_seq(js: Any) -> int:
    """The drain bucket stream's last sequence (0: no stream yet)."""
    from nats.js.errors import NotFoundError

    try:
        return (await js.stream_info(f"KV_{subjects.DRAIN_KV_BUCKET}")).state.last_seq
    except NotFoundError:
        return 0


async def kv_drain_timeline(js: Any, cluster: str, after_seq: int = 0,
                            upto_seq: int | None = None) -> list[tuple[str, bool]]:
    """(node, drained by fleetmend?) of every write to `cluster`'s keys in the drain bucket with a
    sequence in (`after_seq`, `upto_seq`], in order (deletes included: a delete is the node back in service)."""
    from nats.js.errors import NotFoundError

    stream = f"KV_{subjects.DRAIN_KV_BUCKET}"
    try:
        info = await js.stream_info(stream)
    except NotFoundError:
        return []
    last = info.state.last_seq if upto_seq is None else min(upto_seq, info.state.last_seq)
    out = []
    for seq in range(max(after_seq + 1, info.state.first_seq), last + 1):
        try:
            m = await js.get_msg(stream, seq)
        except NotFoundError:
            continue
        c, node = subjects.parse_drain_kv_key(m.subject.split(".", 2)[2])
        if c != cluster:
            continue
        op = (m.headers or {}).get("KV-Operation")
        on = op not in ("DEL", "PURGE") and bool(m.data) and json.loads(m.data).get("owner") == "fleetmend"
        out.append((node, on))
    return out


async def kv_drained_now(js: Any, cluster: str, upto_seq: int | None = None) -> set[str]:
    """`cluster`'s nodes drained by fleetmend as of `upto_seq` (None: now), from the drain bucket's writes."""
    drained: set[str] = set()
    for node, on in await kv_drain_timeline(js, cluster, upto_seq=upto_seq):
        (drained.add if on else drained.discard)(node)
    return drained


def replay_drain_timeline(start: set[str], timeline: list[tuple[str, bool]]) -> tuple[int, list[str]]:
    """From the drained set at the start and the writes after it: (most drained at once, nodes that went
    from in service to drained more than once)."""
    drained = set(start)
    peak = len(drained)
    ons: Counter = Counter()
    for node, on in timeline:
        if on and node not in drained:
            ons[node] += 1
            drained.add(node)
        elif not on:
            drained.discard(node)
        peak = max(peak, len(drained))
    return peak, sorted(n for n, c in ons.items() if c > 1)


def print_table(rows: list[tuple[str, Any]], failures: list[str], *, seed: int, file: Any = None,
                title: str = "chaos run",
                verdict: str = "PASS: every fault recorded once; no incident drained or ticketed twice") -> None:
    file = file or sys.stdout
    width = max(len(k) for k, _ in rows)
    print(f"\n{title} (seed {seed})", file=file)
    print("-" * (width + 30), file=file)
    for k, v in rows:
        print(f"{k:<{width}}  {v}", file=file)
    print("-" * (width + 30), file=file)
    if failures:
        print("FAILED:", file=file)
        for f in failures:
            print(f"  - {f}", file=file)
    else:
        print(verdict, file=file)
    file.flush()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode")
    ag = sub.add_parser("agents", help="(internal) run one agent per node")
    ag.add_argument("--dir", required=True)
    ag.add_argument("--node-list", required=True)
    ap.add_argument("--nodes", type=int, default=20)
    ap.add_argument("--faults", type=int, default=100)
    ap.add_argument("--duration", type=float, default=40.0, help="seconds over which faults are sent")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workdir", type=Path, default=None, help="keep state and logs here (default: a temp dir)")
    ap.add_argument("-v", "--verbose", action="store_true", help="narrate kills and restarts on stderr")
    args = ap.parse_args(argv)
    if args.mode == "agents":
        return asyncio.run(agents_main(args))
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fleetmend-chaos-"))
    chaos = Chaos(args.nodes, args.faults, args.duration, args.seed, workdir, verbose=args.verbose)
    rc = asyncio.run(chaos.run())
    print(f"state and logs: {workdir}" if args.workdir or rc else "", file=sys.stderr)
    if rc == 0 and args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
