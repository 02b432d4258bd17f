"""`fleetmend dev up`: the whole pipeline on one machine, state under one directory.

Starts, in order: nats-server (JetStream, file store `STATE/nats`), `temporal server start-dev`
(SQLite `STATE/temporal.db`, Web UI, search attributes registered), then the worker, the router, the
fail-slow analyzer and a local agent as child processes (the same `fleetmend worker|router|analyzer|agent`
commands production runs).
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
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import structlog

from fleetmend.dev import servers
from fleetmend.config import Settings
from fleetmend.errors import ConfigError
from fleetmend.infra.process import stop_on_signals

log = structlog.get_logger("fleetmend.dev.devup")

WATCHDOG_GRACE_S = 10.0
"""After `dev up` died: how long its children get to stop on SIGTERM before SIGKILL."""
WATCHDOG_POLL_S = 0.2


def _write_pids(path: Path, procs: list[servers.ManagedProcess]) -> None:
    import psutil

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


def watchdog_main(argv: list[str]) -> None:
    """`<parent pid> <pid file>`: wait until the parent is gone, then stop the process groups listed
    in the pid file (SIGTERM, then SIGKILL after `WATCHDOG_GRACE_S`). SIGTERM to the watchdog
    itself (the parent's clean stop) ends it without touching anything."""
    import psutil

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
    def running(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    while time.monotonic() < deadline and any(running(p) for p in groups):
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
    from fleetmend.infra import security

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
    from fleetmend.infra.connect import connect_temporal

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
    import fcntl

    fd = os.open(state / "devup.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


async def dev_up(s: Settings, *, agent: bool = True, config: Path | None = None, secure: bool = False) -> int:
    """Run the local pipeline until SIGINT/SIGTERM. Returns the exit code (0 on a clean stop; 1 when
    another `dev up` holds the state directory, a server died, or a process kept failing).

    `secure`: NATS requires the per-role credentials of `secure_setup`, and each child connects
    with its own (the agent with its node's, the router and worker with theirs)."""
    state = s.state_dir
    (state / "logs").mkdir(parents=True, exist_ok=True)
    if lock_state_dir(state) is None:
        holder = (state / "devup.lock").read_text().strip() or "?"
        print(f"error: another `fleetmend dev up` (pid {holder}) uses {state}; stop it, or set "
              "FLEETMEND_STATE_DIR to another directory", file=sys.stderr, flush=True)
        return 1
    nats_host, nats_port = _host_port(s.nats_url, "FLEETMEND_NATS_URL")
    t_host, t_port = _host_port(s.temporal_address, "FLEETMEND_TEMPORAL_ADDRESS")

    stop = stop_on_signals(deadline_s=120.0)  # children get 45 s, then the servers 20 s each

    started: list[servers.ManagedProcess] = []
    pid_file = state / "devup.pids"
    _write_pids(pid_file, [])
    watchdog = start_watchdog(pid_file)
    try:
        nats_conf, role_env = secure_setup(s) if secure else (None, {})
        nats = servers.start_nats(state / "nats", nats_port, host=nats_host, log_path=state / "logs" / "nats.log",
                                  config_file=nats_conf)
        started.append(nats)
        _write_pids(pid_file, started)
        print(f"nats-server     {s.nats_url}  (JetStream store {state / 'nats'})", flush=True)
        if secure:
            print(f"credentials     {state / 'creds'}  (operator commands: FLEETMEND_NATS_NKEY_SEED="
                  f"{state / 'creds' / 'admin.nk'})", flush=True)
        temporal = servers.start_temporal(state / "temporal.db", t_port, s.temporal_ui_port, host=t_host,
                                          log_path=state / "logs" / "temporal.log")
        started.append(temporal)
        _write_pids(pid_file, started)
        await servers.wait_temporal_ready(s.temporal_address, s.temporal_namespace)
        await _retention(s)
        print(f"temporal        {s.temporal_address}  (SQLite {state / 'temporal.db'})", flush=True)
        print(f"Temporal UI     {s.temporal_ui_url}/namespaces/{s.temporal_namespace}/workflows", flush=True)

        env = child_env(s)
        base = [sys.executable, "-m", "fleetmend.cli.main"]
        cfg = ["--config", str(config)] if config else []
        children = [
            servers.ManagedProcess("worker", base + ["worker"] + cfg, state / "logs" / "worker.log",
                                   env={**env, **role_env.get("worker", {})}),
            servers.ManagedProcess("router", base + ["router"] + cfg, state / "logs" / "router.log",
                                   env={**env, **role_env.get("router", {})}),
            servers.ManagedProcess("analyzer", base + ["analyzer"] + cfg, state / "logs" / "analyzer.log",
                                   env={**env, **role_env.get("analyzer", {})}),
        ]
        if agent:
            children.append(servers.ManagedProcess("agent", base + ["agent"] + cfg, state / "logs" / "agent.log",
                                                   env={**env, **role_env.get("agent", {})}))
        for c in children:
            c.start()
            started.append(c)
            _write_pids(pid_file, started)
            print(f"{c.name:<15} pid {c.pid}  log {c.log_path}", flush=True)
        print(f"state           {state}", flush=True)
        print("ready: replay a log with `fleetmend agent --node NAME --kmsg-file FILE --once`; "
              "`fleetmend status`; Ctrl-C stops everything", flush=True)

        restarts: dict[str, list[float]] = {c.name: [] for c in children}
        failed = False  # a server died or a process kept failing: exit 1, not a clean stop
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass
            for proc in (nats, temporal):
                if not proc.alive() and not stop.is_set():
                    print(f"{proc.name} exited unexpectedly; stopping. log tail:\n{proc.log_tail()}", flush=True)
                    failed = True
                    stop.set()
            for c in children:
                if not c.alive() and not stop.is_set():
                    recent = [t for t in restarts[c.name] if time.monotonic() - t < 60]
                    restarts[c.name] = recent
                    if len(recent) >= 5:
                        print(f"{c.name} keeps failing (5 restarts in 60 s); stopping. log tail:\n{c.log_tail()}",
                              flush=True)
                        failed = True
                        stop.set()
                        break
                    print(f"{c.name} exited (code {c.proc.returncode if c.proc else '?'}); restarting", flush=True)
                    restarts[c.name].append(time.monotonic())
                    c.start()
                    _write_pids(pid_file, started)
        return 1 if failed else 0
    except servers.ServerStartError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        print("stopping: " + ", ".join(p.name for p in reversed(started)), flush=True)
        # Pipeline processes first, all at once (each finishes its in-flight work), then the servers.
        pipeline = [p for p in started if p.name in ("agent", "router", "worker", "analyzer")]
        for p in pipeline:
            p.terminate()
        for p in pipeline:
            await asyncio.to_thread(p.stop, 45.0)
        for p in reversed([p for p in started if p not in pipeline]):
            await asyncio.to_thread(p.stop, 20.0)
        with contextlib.suppress(OSError):
            pid_file.unlink()
        watchdog.terminate()
        await asyncio.to_thread(watchdog.wait, 10)
        print("stopped", flush=True)
