"""Shared plumbing for the benchmarks: a private NATS + Temporal stack on free ports, child
processes for router/worker, percentiles and CPU/RSS meters. Benchmarks print figures; they
assert nothing about speed."""

from __future__ import annotations

import asyncio
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from fleetmend.config import Settings, load_settings
from fleetmend.dev import servers
from fleetmend.infra.logs import configure_logging

configure_logging("console", level="warning")  # benchmarks print tables, not per-event logs


def pct(values: list[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100); NaN for no values."""
    if not values:
        return float("nan")
    v = sorted(values)
    k = max(0, min(len(v) - 1, int(round(p / 100 * len(v) + 0.5)) - 1))
    return v[k]


def machine() -> str:
    return (f"{platform.node()}: {os.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB, "
            f"Python {platform.python_version()}, {platform.platform()}")


@dataclass
class Stack:
    root: Path
    nats_url: str
    temporal_address: str
    procs: list[servers.ManagedProcess] = field(default_factory=list)

    def settings(self, **kw) -> Settings:
        return load_settings(None, nats_url=self.nats_url, temporal_address=self.temporal_address,
                             state_dir=self.root / "state", **kw)

    def env(self, settings: Settings) -> dict[str, str]:
        from fleetmend.dev.devup import child_env

        e = {**os.environ, **child_env(settings), "FLEETMEND_LOG_FORMAT": "json"}
        e["FLEETMEND_POLICY__OBSERVE_ONLY"] = str(settings.policy.observe_only).lower()
        return e

    def spawn(self, role: str, settings: Settings, extra_env: dict[str, str] | None = None) -> servers.ManagedProcess:
        p = servers.ManagedProcess(role, [sys.executable, "-m", "fleetmend.cli.main", role],
                                   self.root / "logs" / f"{role}.log", env={**self.env(settings), **(extra_env or {})})
        p.start()
        self.procs.append(p)
        return p


@asynccontextmanager
async def stack(wal: bool = True):
    """NATS (JetStream, file store) + Temporal dev server (SQLite file, WAL) on free ports."""
    root = Path(tempfile.mkdtemp(prefix="fleetmend-bench-"))
    (root / "logs").mkdir()
    nport, tport = servers.free_port(), servers.free_port()
    nats = servers.start_nats(root / "nats", nport, log_path=root / "logs" / "nats.log")
    temporal = servers.start_temporal(root / "temporal.db", tport, servers.free_port(), ui=False,
                                      log_path=root / "logs" / "temporal.log")
    await servers.wait_temporal_ready(f"127.0.0.1:{tport}")
    st = Stack(root, f"nats://127.0.0.1:{nport}", f"127.0.0.1:{tport}", [nats, temporal])
    try:
        yield st
    finally:
        for p in reversed(st.procs):
            p.stop(20)
        if os.environ.get("FLEETMEND_BENCH_KEEP") != "1":  # logs and data stay only when asked for
            shutil.rmtree(root, ignore_errors=True)


class CpuMeter:
    """CPU % of one core and RSS for a set of processes over a window."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.procs = {k: psutil.Process(v) for k, v in pids.items()}
        self.t0 = time.monotonic()
        self.c0 = {k: self._cpu(p) for k, p in self.procs.items()}

    @staticmethod
    def _cpu(p: psutil.Process) -> float:
        try:
            t = p.cpu_times()
            return t.user + t.system
        except psutil.Error:
            return 0.0

    def read(self) -> dict[str, tuple[float, float]]:
        dt = max(1e-6, time.monotonic() - self.t0)
        out = {}
        for k, p in self.procs.items():
            try:
                rss = p.memory_info().rss / 2**20
            except psutil.Error:
                rss = float("nan")
            out[k] = (100 * (self._cpu(p) - self.c0[k]) / dt, rss)
        return out


async def wait_drained(js, stream: str, durable: str, timeout_s: float) -> float:
    """Wait until the durable consumer has nothing pending or unacked; returns when (monotonic)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ci = await js.consumer_info(stream, durable)
            if ci.num_pending == 0 and ci.num_ack_pending == 0 and ci.delivered.stream_seq > 0:
                return time.monotonic()
        except Exception:  # noqa: BLE001 - consumer not created yet
            pass
        await asyncio.sleep(0.05)
    raise TimeoutError(f"consumer {durable} not drained after {timeout_s}s")


def table(title: str, rows: list[tuple[str, str]]) -> str:
    w = max(len(r[0]) for r in rows)
    lines = [f"\n## {title}\n", f"| {'measure'.ljust(w)} | value |", f"|{'-' * (w + 2)}|-------|"]
    lines += [f"| {a.ljust(w)} | {b} |" for a, b in rows]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def run(coro) -> None:
    asyncio.run(coro)


__all__ = ["pct", "machine", "stack", "Stack", "CpuMeter", "wait_drained", "table", "run", "subprocess"]
