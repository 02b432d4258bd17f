"""`fleetmend dev up`: the whole pipeline on one machine, state under one directory.

Starts, in order: nats-server (JetStream, file store `STATE/nats`), `temporal server start-dev`
(SQLite `STATE/temporal.db`, Web UI, search attributes registered), then the worker, the router, the
fail-slow analyzer and a local agent as child processes (the same `fleetmend worker|router|analyzer|agent`
commands production runs).
Every cluster its agents report is served: a worker of the cluster's own (`worker-<cluster>`, the same
`fleetmend worker --cluster C`) is started for each cluster whose heartbeats or faults arrive, or that the
fault stream already holds (`ClusterWatch`); with a scheduler that is bound to one cluster's own settings
(Slurm, Kubernetes) dev up refuses instead and prints why and what to run.
With `--join-nats` (or a NATS URL that lists several servers, a `tls://` one, or a host that is not this machine's)
dev up starts no nats-server: it joins the NATS (cluster) at that URL (`check_nats`, each server tried at once: when
none answers with JetStream it stops with one line naming each address and why; one down among others is printed),
creates the streams and KV buckets there that
are missing (`ensure_jetstream`), and every process it starts connects to those URLs.
Children that die are restarted with backoff. SIGINT/SIGTERM stop everything in reverse order.
Starting again with the same state directory resumes open incidents where they were (Temporal
and JetStream state are files).

Nothing outlives `dev up`, even when it is killed with SIGKILL: every child runs in its own process
group with a parent-death signal (SIGTERM), and a small watchdog process (`watchdog_main`) notices
when `dev up` is gone, sends SIGTERM to each child's process group (so what a child started goes
too), and SIGKILL to whatever is left after `WATCHDOG_GRACE_S`. The children's groups are listed in
`STATE/devup.pids` (pid and start time, so a reused pid is never signalled).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import psutil
import structlog

from fleetmend import subjects
from fleetmend.config import Settings
from fleetmend.dev import servers
from fleetmend.errors import ConfigError
from fleetmend.infra import security
from fleetmend.infra.connect import (
    _why,
    close_nats,
    connect_nats,
    connect_temporal,
    nats_auth_options,
    nats_servers,
)
from fleetmend.infra.process import stop_on_signals

log = structlog.get_logger("fleetmend.dev.devup")

WATCHDOG_GRACE_S = 10.0
"""After `dev up` died: how long its children get to stop on SIGTERM before SIGKILL."""
WATCHDOG_POLL_S = 0.2


def _write_pids(path: Path, procs: list[servers.ManagedProcess]) -> None:
    rows = []
    for p in procs:
        if p.alive() and p.pid is not None:
            with contextlib.suppress(psutil.Error):
                rows.append({"name": p.name, "pid": p.pid, "started": psutil.Process(p.pid).create_time()})
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rows))
    os.replace(tmp, path)


def start_watchdog(pid_file: Path) -> subprocess.Popen:
    """Start the watchdog of this process (see module docstring); it exits when it is terminated
    (a clean stop) or after cleaning up once this process is gone."""
    code = "import sys; from fleetmend.dev.devup import watchdog_main; watchdog_main(sys.argv[1:])"
    return subprocess.Popen([sys.executable, "-c", code, str(os.getpid()), str(pid_file)],
                            start_new_session=True, stdin=subprocess.DEVNULL)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def watchdog_main(argv: list[str]) -> None:
    """`<parent pid> <pid file>`: wait until the parent is gone, then stop the process groups listed
    in the pid file (SIGTERM, then SIGKILL after `WATCHDOG_GRACE_S`). SIGTERM to the watchdog
    itself (the parent's clean stop) ends it without touching anything."""
    parent, pid_file = int(argv[0]), Path(argv[1])
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while os.getppid() == parent:
        time.sleep(WATCHDOG_POLL_S)
    try:
        rows = json.loads(pid_file.read_text())
    except (OSError, ValueError):
        return  # a clean stop removed it
    groups = []
    for r in rows:
        try:
            if abs(psutil.Process(r["pid"]).create_time() - r["started"]) < 0.01:
                groups.append(r["pid"])
        except psutil.Error:
            continue
    for pid in groups:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + WATCHDOG_GRACE_S
    while time.monotonic() < deadline and any(_running(p) for p in groups):
        time.sleep(WATCHDOG_POLL_S)
    for pid in groups:  # leaders past their grace, and whatever they left in their group
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        pid_file.unlink()


def _host_port(value: str, what: str) -> tuple[str, int]:
    if "://" in value:
        u = urlparse(value)
        if not u.hostname or not u.port:
            raise ConfigError(f"{what} {value!r}: expected scheme://host:port")
        return u.hostname, u.port
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"{what} {value!r}: expected host:port")
    return host, int(port)


def _local_host(host: str) -> bool:
    """Whether `host` is an address of this machine (one a server started here could listen on)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.bind((host, 0))
        return True
    except OSError:
        return False


def joins_nats(url: str, join: bool = False) -> bool:
    """Whether `dev up` joins the NATS at `url` instead of starting its own: `join` (`--join-nats`), or a URL that
    no nats-server started here could be: several servers (a cluster), a scheme other than `nats://` (dev up's
    own server speaks plain NATS), or a host that is not this machine's."""
    urls = nats_servers(url)
    if join or len(urls) != 1:
        return True
    u = urlparse(urls[0])
    return u.scheme != "nats" or not u.hostname or not _local_host(u.hostname)


JOIN_CHECK_S = 1.8
"""Bound on `check_nats`: every server is tried at once, each within this (a refused one answers at once)."""


async def check_nats(s: Settings, timeout_s: float = JOIN_CHECK_S) -> tuple[list[str], list[str]]:
    """Try each server of `s.nats_url` once, all at once, with `s`'s credentials and TLS, and ask each for its
    JetStream account.

    Returns:
        (servers that answer with JetStream, one line per server that does not: the address and why:
        `connection refused`, `timed out`, `name not resolved`, `JetStream not enabled`, the server's own words).
    """
    import nats

    opts = nats_auth_options(s)

    async def one(url: str) -> str | None:
        errors: list[BaseException] = []

        async def seen(err: Exception) -> None:
            errors.append(err)

        try:
            async with asyncio.timeout(timeout_s):
                # two tries 0.2 s apart (nats-py's first connect with 0 reconnects retries without end)
                nc = await nats.connect(url, name="fleetmend-devup-check", connect_timeout=timeout_s,
                                        max_reconnect_attempts=1, reconnect_time_wait=0.2, error_cb=seen, **opts)
        except Exception as err:  # noqa: BLE001 - the reason goes into the line
            return f"{url}: {_why(errors[-1] if errors else err)}"
        try:
            async with asyncio.timeout(timeout_s):
                await nc.jetstream().account_info()
        except Exception as err:  # noqa: BLE001 - no JetStream (or not for these credentials)
            text = " ".join(str(err).split())[:200] or type(err).__name__
            return f"{url}: JetStream not enabled for this account ({text}); start nats-server with -js"
        finally:
            with contextlib.suppress(Exception):
                await nc.close()
        return None

    urls = nats_servers(s.nats_url)
    answers = await asyncio.gather(*(one(u) for u in urls))
    return [u for u, a in zip(urls, answers, strict=True) if a is None], [a for a in answers if a is not None]


async def ensure_jetstream(s: Settings, nc: Any) -> tuple[list[str], list[str]]:
    """Create the streams and KV buckets the pipeline uses that are missing on the joined NATS, each by its owner's
    own code (its limits, history and replicas); existing ones are left as they are (`jetstream.ensure_stream`).
    The notification bucket is left to the first notification.

    Returns:
        (stream names, bucket names).
    Raises:
        nats.js.errors.APIError, TimeoutError: as `jetstream.ensure_stream` (no room for a stream's `max_bytes`,
            no permission).
    """
    from activities.standalone import StandaloneScheduler
    from activities.ticket_kv import KvTicketStore
    from fleetmend.analyzer.service import analyzer_kv
    from fleetmend.infra import jetstream
    from fleetmend.infra.lease import lease_bucket
    from fleetmend.infra.ledger import LedgerStore
    from fleetmend.infra.permit_pool import permit_bucket

    js = nc.jetstream()
    await jetstream.ensure_fault_stream(js, s)
    await jetstream.ensure_deadletter_stream(js, s)
    await jetstream.ensure_perf_stream(js)
    await jetstream.ensure_fingerprint_stores(js)
    await jetstream.open_kv_bucket(js, subjects.DRIFT_ALLOW_KV_BUCKET, "allowed drift values (fleetmend drift allow)")
    await lease_bucket(js)
    await permit_bucket(js)
    await KvTicketStore(js).kv()
    await LedgerStore(js, s.ledger).kv()
    await analyzer_kv(js)
    if s.scheduler.value == "standalone":
        await StandaloneScheduler(js, s.cluster).kv()
    streams = [subjects.FAULT_STREAM, subjects.DEADLETTER_STREAM, subjects.PERF_STREAM, subjects.JOB_STREAM,
               subjects.FINGERPRINT_STREAM]
    buckets = [subjects.LEASE_KV_BUCKET, subjects.PERMIT_KV_BUCKET, subjects.TICKET_KV_BUCKET,
               subjects.LEDGER_KV_BUCKET, subjects.ANALYZER_KV_BUCKET, subjects.FINGERPRINT_KV_BUCKET,
               subjects.DRIFT_ALLOW_KV_BUCKET] + ([subjects.DRAIN_KV_BUCKET] if s.scheduler.value == "standalone"
                                                 else [])
    return streams, buckets


def child_env(s: Settings) -> dict[str, str]:
    env = {
        "FLEETMEND_NATS_URL": s.nats_url,
        "FLEETMEND_TEMPORAL_ADDRESS": s.temporal_address,
        "FLEETMEND_TEMPORAL_UI_PORT": str(s.temporal_ui_port),
        "FLEETMEND_STATE_DIR": str(s.state_dir),
        "FLEETMEND_CLUSTER": s.cluster,
        "FLEETMEND_NODE": s.node,
        "FLEETMEND_SCHEDULER": s.scheduler.value,
        "FLEETMEND_TASK_QUEUE": s.task_queue,
        "FLEETMEND_LOG_FORMAT": "json",
        "PYTHONUNBUFFERED": "1",
    }
    return env


def secure_setup(s: Settings) -> tuple[Path, dict[str, dict[str, str]]]:
    """`dev up --secure`: credentials under `STATE/creds` (`fleetmend.infra.security.generate`) for this
    host's node, every node already there (add one with `fleetmend creds generate --out STATE/creds
    --cluster C --nodes N` before starting), router, worker and admin.

    Returns (nats-server config file, environment of each child: worker, router, analyzer, agent).
    """
    cdir = s.state_dir / "creds"
    nodes = sorted({s.node} | {p.stem for p in (cdir / "nodes").glob("*.nk")})
    cs = security.generate(cdir, s.cluster, nodes)
    conf = cdir / "nats-server.conf"
    conf.write_text(security.server_conf(cs.accounts_conf))
    env = {role: {"FLEETMEND_NATS_NKEY_SEED": str(cs.seed_file(role)),
                  "FLEETMEND_NATS_INBOX_PREFIX": security.role_inbox_prefix(role)}
           for role in ("worker", "router", "analyzer")}
    env["agent"] = {"FLEETMEND_NATS_NKEY_SEED": str(cs.seed_file(f"node:{s.cluster}/{s.node}")),
                    "FLEETMEND_NATS_INBOX_PREFIX": security.node_inbox_prefix(s.cluster, s.node),
                    "FLEETMEND_AGENT__MANAGE_STREAM": "false"}
    return conf, env


async def _retention(s: Settings) -> None:
    """Closed incidents are kept `temporal_retention_days` (the dev server's own default is 1 day)."""
    client = await connect_temporal(s)
    _, days = await servers.ensure_retention(client, s.temporal_namespace, s.temporal_retention_days)
    print(f"retention       closed incidents kept {days:g} days (temporal_retention_days)", flush=True)


def lock_state_dir(state: Path) -> int | None:
    """Hold `state/devup.lock` (an exclusive `flock`, released when this process exits) so that one
    `dev up` uses a state directory at a time: a second one on other ports would start a second
    nats-server on the same JetStream store and a second Temporal on the same SQLite file, and
    overwrite the first one's pid file (whose watchdog then could not stop the first one's children).

    Returns:
        The lock's file descriptor (keep it open), or None when another process holds the lock.
    """
    fd = os.open(state / "devup.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


PIPELINE = ("worker", "router", "analyzer", "agent")
"""The pipeline processes `dev up` starts as children (the same commands production runs)."""
RESTARTS_PER_MINUTE = 5
"""A child that exits this many times within 60 s stops `dev up` (exit 1) instead of restarting again."""


class DevUp:
    """One `dev up` run: `lock()` the state directory, `start_servers()`, `start_children()`,
    `watch()` them until SIGINT/SIGTERM, then `stop_all()` in reverse order. `dev_up(...)` is the
    usual way in; the arguments are its."""

    def __init__(self, s: Settings, *, agent: bool = True, config: Path | None = None,
                 secure: bool = False, join_nats: bool = False) -> None:
        self.s = s
        self.agent, self.config, self.secure = agent, config, secure
        self.join = joins_nats(s.nats_url, join_nats)
        """Join the NATS at `s.nats_url` instead of starting nats-server (`joins_nats`)."""
        self.state = s.state_dir
        self.pid_file = self.state / "devup.pids"
        self.started: list[servers.ManagedProcess] = []
        """Everything started, in order (what `stop_all()` stops and the pid file lists)."""
        self.servers: list[servers.ManagedProcess] = []
        self.children: list[servers.ManagedProcess] = []
        self.role_env: dict[str, dict[str, str]] = {}
        self.failed = False
        """A server died or a process kept failing: exit 1, not a clean stop."""
        self.cluster_workers: dict[str, servers.ManagedProcess] = {}
        """The workers of clusters other than `s.cluster` (`serve_cluster`), by cluster."""
        self.refused: set[str] = set()
        """Clusters reported but not served (`serve_cluster` said why)."""
        self.joined: tuple[list[str], list[str]] = ([], [])
        """`check_nats` of the joined NATS: (servers that answer, a line for each that does not)."""

    async def run(self) -> int:
        """Returns the exit code (0 on a clean stop; 1 when another `dev up` holds the state
        directory, a server died, or a process kept failing)."""
        if self.join:  # before anything is started or written: a NATS that is not there is one line, at once
            try:
                await self.check_joined()
            except servers.ServerStartError as e:
                print(f"error: {e}", file=sys.stderr, flush=True)
                return 1
        (self.state / "logs").mkdir(parents=True, exist_ok=True)
        if not self.lock():
            return 1
        nats_addr = ("", 0) if self.join else _host_port(self.s.nats_url, "FLEETMEND_NATS_URL")
        temporal_addr = _host_port(self.s.temporal_address, "FLEETMEND_TEMPORAL_ADDRESS")
        stop = stop_on_signals(deadline_s=120.0)  # children get 45 s, then the servers 20 s each
        _write_pids(self.pid_file, [])
        watchdog = start_watchdog(self.pid_file)
        try:
            await self.start_servers(nats_addr, temporal_addr)
            self.start_children()
            await self.watch(stop)
            return 1 if self.failed else 0
        except servers.ServerStartError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return 1
        finally:
            await self.stop_all(watchdog)

    def lock(self) -> bool:
        """Take the state directory (`lock_state_dir`); False, after saying who holds it, when another
        `dev up` does."""
        if lock_state_dir(self.state) is not None:
            return True
        holder = (self.state / "devup.lock").read_text().strip() or "?"
        print(f"error: another `fleetmend dev up` (pid {holder}) uses {self.state}; stop it, or set "
              "FLEETMEND_STATE_DIR to another directory", file=sys.stderr, flush=True)
        return False

    def _started(self, proc: servers.ManagedProcess) -> None:
        self.started.append(proc)
        _write_pids(self.pid_file, self.started)

    async def start_servers(self, nats_addr: tuple[str, int], temporal_addr: tuple[str, int]) -> None:
        """nats-server (with `secure_setup`'s config under `secure`), or the joined NATS checked and its streams and
        buckets made (`join_nats`); then the Temporal dev server, ready and with its retention set."""
        s, state = self.s, self.state
        if self.join:
            await self.join_nats()
        else:
            if servers.port_in_use(*nats_addr):
                raise servers.ServerStartError(
                    f"port {nats_addr[0]}:{nats_addr[1]} is already in use; to use the NATS there, add --join-nats; "
                    "else set FLEETMEND_NATS_URL to a free port or stop the other server")
            nats_conf, self.role_env = secure_setup(s) if self.secure else (None, {})
            nats = servers.start_nats(state / "nats", nats_addr[1], host=nats_addr[0],
                                      log_path=state / "logs" / "nats.log", config_file=nats_conf)
            self.servers.append(nats)
            self._started(nats)
            print(f"nats-server     {s.nats_url}  (JetStream store {state / 'nats'})", flush=True)
        if self.secure:
            print(f"credentials     {state / 'creds'}  (operator commands: FLEETMEND_NATS_NKEY_SEED="
                  f"{state / 'creds' / 'admin.nk'})", flush=True)
        temporal = servers.start_temporal(state / "temporal.db", temporal_addr[1], s.temporal_ui_port,
                                          host=temporal_addr[0], log_path=state / "logs" / "temporal.log")
        self.servers.append(temporal)
        self._started(temporal)
        await servers.wait_temporal_ready(s.temporal_address, s.temporal_namespace)
        await _retention(s)
        print(f"temporal        {s.temporal_address}  (SQLite {state / 'temporal.db'})", flush=True)
        print(f"Temporal UI     {s.temporal_ui_url}/namespaces/{s.temporal_namespace}/workflows", flush=True)

    async def check_joined(self) -> None:
        """The NATS to join: `--secure` refused (it is dev up's own server's), then `check_nats`; a server that does
        not answer while others do is printed.

        Raises:
            servers.ServerStartError: no server answers with JetStream (one line: each address and why).
        """
        if self.secure:
            raise servers.ServerStartError(
                "--secure starts dev up's own nats-server with credentials it generates; to join an existing NATS, give "
                "dev up that NATS's credentials (nats_nkey_seed, nats_creds or nats_user) without --secure")
        ok, bad = await check_nats(self.s)
        if not ok:
            raise servers.ServerStartError(
                f"cannot join NATS: {'; '.join(bad)} (dev up starts no nats-server when it joins one: start it, "
                "or fix --nats-url / FLEETMEND_NATS_URL; without --join-nats a single local URL starts one)")
        for line in bad:
            print(f"nats            {line}; joined through {', '.join(ok)}", flush=True)
        self.joined = (ok, bad)

    async def join_nats(self) -> None:
        """Create the missing streams and buckets on the NATS `check_joined` found (`ensure_jetstream`); start none.

        Raises:
            servers.ServerStartError: the streams or buckets cannot be made.
        """
        s = self.s
        ok, bad = self.joined
        nc = await connect_nats(s, name="fleetmend-devup")
        try:
            streams, buckets = await ensure_jetstream(s, nc)
        except Exception as err:
            raise servers.ServerStartError(f"NATS at {s.nats_url}: cannot create the streams and buckets: "
                                           f"{' '.join(str(err).split()) or type(err).__name__}") from err
        finally:
            await close_nats(nc)
        print(f"nats            joined {s.nats_url}  ({len(ok)} of {len(ok) + len(bad)} servers answer; "
              "dev up started no nats-server)", flush=True)
        print(f"jetstream       streams {', '.join(streams)}; buckets {', '.join(buckets)}", flush=True)

    def start_children(self) -> None:
        """The worker, router, analyzer and (unless `agent=False`) the agent, each with its role's
        environment."""
        env = child_env(self.s)
        base = [sys.executable, "-m", "fleetmend.cli.main"]
        cfg = ["--config", str(self.config)] if self.config else []
        logs = self.state / "logs"
        names = [n for n in PIPELINE if n != "agent" or self.agent]
        self.children = [servers.ManagedProcess(n, [*base, n, *cfg], logs / f"{n}.log",
                                                env={**env, **self.role_env.get(n, {})}) for n in names]
        for c in self.children:
            c.start()
            self._started(c)
            print(f"{c.name:<15} pid {c.pid}  log {c.log_path}", flush=True)
        print(f"state           {self.state}", flush=True)
        print("ready: replay a log with `fleetmend agent --node NAME --kmsg-file FILE --once`; "
              "`fleetmend status`; Ctrl-C stops everything", flush=True)

    def serve_cluster(self, cluster: str, seen_from: str) -> bool:
        """Start `worker-<cluster>` (a worker of `cluster`, on its own queues) unless one runs; with a scheduler
        bound to one cluster's settings, print why not and what to run instead. Returns whether it started."""
        if cluster == self.s.cluster or cluster in self.cluster_workers or cluster in self.refused:
            return False
        try:
            subjects.cluster_task_queue(self.s.task_queue, cluster)
        except ValueError:
            return False
        if self.s.scheduler.value not in ("standalone", "none"):
            self.refused.add(cluster)
            print(f"cluster {cluster} (reported by {seen_from}) is not served: dev up drains cluster "
                  f"{self.s.cluster} through {self.s.scheduler.value}, whose settings name that cluster's own "
                  f"nodes; start `fleetmend worker --cluster {cluster} --config <{cluster}'s settings>`", flush=True)
            return False
        env = {**child_env(self.s), **self.role_env.get("worker", {}), "FLEETMEND_METRICS__WORKER_PORT": "0"}
        cfg = ["--config", str(self.config)] if self.config else []
        name = f"worker-{cluster}"
        proc = servers.ManagedProcess(name, [sys.executable, "-m", "fleetmend.cli.main", "worker", *cfg,
                                             "--cluster", cluster], self.state / "logs" / f"{name}.log", env=env)
        proc.start()
        self._started(proc)
        self.children.append(proc)
        self.cluster_workers[cluster] = proc
        print(f"{name:<15} pid {proc.pid}  log {proc.log_path}  (cluster {cluster}, reported by {seen_from})",
              flush=True)
        return True

    async def watch_clusters(self, stop: asyncio.Event) -> None:
        """Serve every cluster the agents report (`serve_cluster`): those in the fault stream already, then each
        new one whose heartbeat or fault arrives (core NATS subscriptions). NATS trouble is printed once; the
        pipeline runs on without it."""
        try:
            nc = await connect_nats(self._watch_settings(), name="fleetmend-devup")
        except Exception as err:  # noqa: BLE001 - only the extra clusters are not served
            print(f"clusters: cannot watch for other clusters ({err!r}); only {self.s.cluster} is served", flush=True)
            return
        try:
            with contextlib.suppress(Exception):  # an empty store has no stream yet
                info = await nc.jetstream().stream_info(subjects.FAULT_STREAM, subjects_filter=subjects.all_faults_subject())
                for subj in sorted(info.state.subjects or {}):
                    with contextlib.suppress(ValueError):
                        cluster, node = subjects.parse_fault_subject(subj)
                        self.serve_cluster(cluster, f"node {node}, earlier fault")

            async def seen(msg) -> None:  # noqa: ANN001 - nats Msg
                parse = subjects.parse_heartbeat_subject if ".hb." in msg.subject else subjects.parse_fault_subject
                with contextlib.suppress(ValueError):
                    cluster, node = parse(msg.subject)
                    if cluster not in self.cluster_workers and cluster != self.s.cluster:
                        self.serve_cluster(cluster, f"node {node}")

            subs = [await nc.subscribe(subjects.all_heartbeats_subject(), cb=seen),
                    await nc.subscribe(subjects.all_faults_subject(), cb=seen)]
            await stop.wait()
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        finally:
            await close_nats(nc)

    def _watch_settings(self) -> Settings:
        """This process's NATS settings: with `secure`, the admin's credentials."""
        if not self.secure:
            return self.s
        return self.s.model_copy(update={"nats_nkey_seed": self.state / "creds" / "admin.nk"})

    async def watch(self, stop: asyncio.Event) -> None:
        """Once a second until `stop`: a server that died stops everything; a child that died is
        restarted, unless it did so `RESTARTS_PER_MINUTE` times in the last 60 s."""
        restarts: dict[str, list[float]] = {c.name: [] for c in self.children}
        clusters = asyncio.create_task(self.watch_clusters(stop), name="clusters")
        try:
            await self._watch(stop, restarts)
        finally:
            await asyncio.gather(clusters, return_exceptions=True)

    async def _watch(self, stop: asyncio.Event, restarts: dict[str, list[float]]) -> None:
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=1.0)
            for proc in self.servers:
                if not proc.alive() and not stop.is_set():
                    print(f"{proc.name} exited unexpectedly; stopping. log tail:\n{proc.log_tail()}", flush=True)
                    self.failed = True
                    stop.set()
            for c in self.children:
                if c.alive() or stop.is_set():
                    continue
                recent = [t for t in restarts.setdefault(c.name, []) if time.monotonic() - t < 60]
                restarts[c.name] = recent
                if len(recent) >= RESTARTS_PER_MINUTE:
                    print(f"{c.name} keeps failing ({RESTARTS_PER_MINUTE} restarts in 60 s); stopping. "
                          f"log tail:\n{c.log_tail()}", flush=True)
                    self.failed = True
                    stop.set()
                    break
                print(f"{c.name} exited (code {c.proc.returncode if c.proc else '?'}); restarting", flush=True)
                restarts[c.name].append(time.monotonic())
                c.start()
                _write_pids(self.pid_file, self.started)

    async def stop_all(self, watchdog: subprocess.Popen) -> None:
        """Pipeline processes first, all at once (each finishes its in-flight work, 45 s), then the
        servers in reverse order (20 s each); then the pid file and the watchdog go."""
        print("stopping: " + ", ".join(p.name for p in reversed(self.started)), flush=True)
        pipeline = [p for p in self.started if p not in self.servers]
        for p in pipeline:
            p.terminate()
        for p in pipeline:
            await asyncio.to_thread(p.stop, 45.0)
        for p in reversed([p for p in self.started if p not in pipeline]):
            await asyncio.to_thread(p.stop, 20.0)
        with contextlib.suppress(OSError):
            self.pid_file.unlink()
        watchdog.terminate()
        await asyncio.to_thread(watchdog.wait, 10)
        print("stopped", flush=True)


async def dev_up(s: Settings, *, agent: bool = True, config: Path | None = None, secure: bool = False,
                 join_nats: bool = False) -> int:
    """Run the local pipeline until SIGINT/SIGTERM. Returns the exit code (0 on a clean stop; 1 when
    another `dev up` holds the state directory, the NATS to join does not answer, a server died, or a process
    kept failing).

    `secure`: NATS requires the per-role credentials of `secure_setup`, and each child connects
    with its own (the agent with its node's, the router and worker with theirs).
    `join_nats`: use the NATS at `s.nats_url` instead of starting nats-server (also without it for a URL
    `joins_nats` says no local server could be)."""
    return await DevUp(s, agent=agent, config=config, secure=secure, join_nats=join_nats).run()
