"""`fleetmend dev up`: the whole pipeline on one machine, state under one directory.

Starts, in order: nats-server (JetStream, file store `STATE/nats`), `temporal server start-dev`
(SQLite `STATE/temporal.db`, Web UI, search attributes registered), then the worker, the router and
a local agent as child processes (the same `fleetmend worker|router|agent` commands production runs).
Children that die are restarted with backoff. SIGINT/SIGTERM stop everything in reverse order.
Starting again with the same state directory resumes open incidents where they were (Temporal
and JetStream state are files).
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import structlog

from fleetmend import servers
from fleetmend.config import Settings
from fleetmend.errors import ConfigError
from fleetmend.process import stop_on_signals

log = structlog.get_logger("fleetmend.devup")


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


async def dev_up(s: Settings, *, agent: bool = True, config: Path | None = None) -> int:
    """Run the local pipeline until SIGINT/SIGTERM. Returns the exit code (0 on a clean stop)."""
    state = s.state_dir
    (state / "logs").mkdir(parents=True, exist_ok=True)
    nats_host, nats_port = _host_port(s.nats_url, "FLEETMEND_NATS_URL")
    t_host, t_port = _host_port(s.temporal_address, "FLEETMEND_TEMPORAL_ADDRESS")

    stop = stop_on_signals(deadline_s=120.0)  # children get 45 s, then the servers 20 s each

    started: list[servers.ManagedProcess] = []
    try:
        nats = servers.start_nats(state / "nats", nats_port, host=nats_host, log_path=state / "logs" / "nats.log")
        started.append(nats)
        print(f"nats-server     {s.nats_url}  (JetStream store {state / 'nats'})", flush=True)
        temporal = servers.start_temporal(state / "temporal.db", t_port, s.temporal_ui_port, host=t_host,
                                          log_path=state / "logs" / "temporal.log")
        started.append(temporal)
        await servers.wait_temporal_ready(s.temporal_address, s.temporal_namespace)
        print(f"temporal        {s.temporal_address}  (SQLite {state / 'temporal.db'})", flush=True)
        print(f"Temporal UI     {s.temporal_ui_url}/namespaces/{s.temporal_namespace}/workflows", flush=True)

        env = child_env(s)
        base = [sys.executable, "-m", "fleetmend.cli.main"]
        cfg = ["--config", str(config)] if config else []
        children = [
            servers.ManagedProcess("worker", base + ["worker"] + cfg, state / "logs" / "worker.log", env=env),
            servers.ManagedProcess("router", base + ["router"] + cfg, state / "logs" / "router.log", env=env),
        ]
        if agent:
            children.append(servers.ManagedProcess("agent", base + ["agent"] + cfg, state / "logs" / "agent.log",
                                                   env=env))
        for c in children:
            c.start()
            started.append(c)
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
        return 1 if failed else 0
    except servers.ServerStartError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        print("stopping: " + ", ".join(p.name for p in reversed(started)), flush=True)
        # Pipeline processes first, all at once (each finishes its in-flight work), then the servers.
        pipeline = [p for p in started if p.name in ("agent", "router", "worker")]
        for p in pipeline:
            p.terminate()
        for p in pipeline:
            await asyncio.to_thread(p.stop, 45.0)
        for p in reversed([p for p in started if p not in pipeline]):
            await asyncio.to_thread(p.stop, 20.0)
        print("stopped", flush=True)
