"""Agent → JetStream against the real nats-server: msg ids, spooling while NATS is away, in-order
replay with dedupe, the whole agent in-process, and kill -9 of the agent process mid-outage."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nats
import nats.errors

from agents.publisher import MSG_ID_HEADER, Publisher
from agents.runner import run_agent
from agents.spool import Spool
from fleetmend.config import AgentSettings, Settings
from fleetmend.events import Component, FaultEvent, Severity, Source
from fleetmend.infra.jetstream import ensure_fault_stream
from fleetmend.subjects import fault_subject, heartbeat_subject
from tests.conftest import assert_eventually

REPO = Path(__file__).resolve().parents[1]


def _event(cluster: str, node: str, i: int, severity: Severity = Severity.FATAL) -> FaultEvent:
    return FaultEvent(cluster=cluster, node=node, component=Component.GPU, kind="xid", code=79,
                      severity=severity, source=Source.INJECT, message=f"event {i}",
                      raw=f"NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus. #{i}")


async def _stream_events(js, cluster: str, node: str, settle_s: float = 0.5) -> list[tuple[str, FaultEvent]]:
    """Every message of this node in the fault stream, in stream order: (Nats-Msg-Id, event)."""
    sub = await js.subscribe(fault_subject(cluster, node), ordered_consumer=True)
    out = []
    try:
        while True:
            msg = await sub.next_msg(timeout=settle_s)
            out.append((msg.headers.get(MSG_ID_HEADER), FaultEvent.from_json_bytes(msg.data)))
    except nats.errors.TimeoutError:
        pass
    finally:
        await sub.unsubscribe()
    return out


def _ensure_nats_up(nats_server) -> None:
    if not nats_server.proc.alive():
        nats_server.start()


async def test_publish_sets_msg_id_and_arrives(nc, unique: str, tmp_path: Path) -> None:
    js = nc.jetstream()
    await ensure_fault_stream(js)
    cluster, node = f"c{unique}", "n1"
    pub = Publisher(nc, js, Spool(tmp_path / "spool", 1 << 20), cluster, node, publish_timeout_s=5)
    events = [_event(cluster, node, i) for i in range(5)]
    for ev in events:
        assert await pub.publish(ev) is True
    # the same event again (a retry) is deduplicated by JetStream
    assert await pub.publish(events[0]) is True
    got = await _stream_events(js, cluster, node)
    assert [mid for mid, _ in got] == [e.event_id for e in events]
    assert [e.event_id for _, e in got] == [e.event_id for e in events]
    assert pub.spool.depth == 0 and pub.published_count == 6


async def test_nats_away_spools_then_replays_in_order_once(nats_server, unique: str, tmp_path: Path) -> None:
    cluster, node = f"c{unique}", "n1"
    spool = Spool(tmp_path / "spool", 1 << 20)
    pub = Publisher(None, None, spool, cluster, node, publish_timeout_s=2)
    nc = await nats.connect(nats_server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2,
                            disconnected_cb=_async(pub.on_disconnected),
                            reconnected_cb=_async(pub.on_reconnected))
    js = nc.jetstream()
    await ensure_fault_stream(js)
    pub.attach(nc, js)
    tasks = [asyncio.create_task(pub.run()), asyncio.create_task(pub.replay())]
    events = [_event(cluster, node, i) for i in range(12)]
    try:
        for ev in events[:4]:
            await pub.emit(ev)
        await pub.flush()
        assert pub.published_count == 4

        nats_server.stop()
        await assert_eventually(lambda: not nc.is_connected, timeout_s=10, what="client saw the disconnect")
        for ev in events[4:]:
            await pub.emit(ev)
        await pub.flush()
        assert spool.depth == 8 and pub.spooled_count == 8
        # a publish whose ack was lost is spooled again under its original id: JetStream must dedupe it
        spool.append(events[1].to_json_bytes(), events[1].severity, events[1].event_id)

        nats_server.start()
        await assert_eventually(lambda: spool.depth == 0, timeout_s=30, what="spool replayed")
        got = await _stream_events(js, cluster, node)
        assert [e.event_id for _, e in got] == [e.event_id for e in events]  # order, each exactly once
        assert [mid for mid, _ in got] == [e.event_id for e in events]
        assert pub.replayed_count == 9
    finally:
        for t in tasks:
            t.cancel()
        _ensure_nats_up(nats_server)
        await nc.close()


def _async(fn):
    async def cb() -> None:
        fn()
    return cb


def _settings(nats_server, tmp_path: Path, cluster: str, node: str, **agent) -> Settings:
    return Settings(cluster=cluster, node=node, nats_url=nats_server.url, state_dir=tmp_path / "state",
                    nats_connect_timeout_s=5,
                    agent=AgentSettings(nice=0, heartbeat_interval_s=0.2, publish_timeout_s=2,
                                        kmsg_path=tmp_path / "no-kmsg", **agent))


def _write_inject(path: Path, events: list[FaultEvent]) -> None:
    path.write_text("".join(e.model_dump_json() + "\n" for e in events))


async def test_run_agent_publishes_heartbeats_and_stops(nats_server, nc, unique: str, tmp_path: Path) -> None:
    cluster, node = f"c{unique}", "n1"
    events = [_event(cluster, node, i) for i in range(5)]
    _write_inject(tmp_path / "events.jsonl", events)
    beats: list[dict] = []

    async def on_hb(msg) -> None:
        beats.append(json.loads(msg.data))

    await nc.subscribe(heartbeat_subject(cluster, node), cb=on_hb)
    stop = asyncio.Event()
    agent = asyncio.create_task(run_agent(_settings(nats_server, tmp_path, cluster, node), stop=stop,
                                          inject_file=tmp_path / "events.jsonl", kmsg=False))
    js = nc.jetstream()
    await assert_eventually(lambda: len(beats) >= 2, timeout_s=20, what="two heartbeats")
    got = await assert_eventually(lambda: _n(_stream_events(js, cluster, node), 5), timeout_s=20,
                                  what="5 events in the stream")
    assert [e.event_id for _, e in got] == [e.event_id for e in events]
    hb = beats[-1]
    assert hb["node"] == node and hb["cluster"] == cluster and hb["probes"] == {"inject": "ok"}
    assert hb["spool_depth"] == 0 and hb["spool_dropped"] == 0
    stop.set()
    assert await asyncio.wait_for(agent, 15) == 0


async def _n(coro, n: int):
    got = await coro
    return got if len(got) == n else None


async def test_run_agent_once_without_nats_spools_and_returns_nonzero(nats_server, unique: str,
                                                                       tmp_path: Path) -> None:
    cluster, node = f"c{unique}", "n1"
    events = [_event(cluster, node, i, Severity.DEGRADED) for i in range(3)]
    _write_inject(tmp_path / "events.jsonl", events)
    s = _settings(nats_server, tmp_path, cluster, node).model_copy(
        update={"nats_url": "nats://127.0.0.1:1", "nats_connect_timeout_s": 1})
    rc = await run_agent(s, once=True, inject_file=tmp_path / "events.jsonl", kmsg=False)
    assert rc == 1
    spool = Spool(tmp_path / "state" / "agent" / node / "spool", 1 << 20)
    assert [eid for eid, _ in spool.pending()] == [e.event_id for e in events]


def _agent_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "agents", "--no-kmsg", *args]


def _agent_env(nats_server, tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "FLEETMEND_NATS_URL": nats_server.url, "FLEETMEND_STATE_DIR": str(tmp_path / "state"),
            "FLEETMEND_AGENT__NICE": "0", "FLEETMEND_AGENT__PUBLISH_TIMEOUT_S": "2",
            "FLEETMEND_NATS_CONNECT_TIMEOUT_S": "5", "FLEETMEND_LOG_FORMAT": "json",
            "PYTHONPATH": str(REPO)}


def _count_logged(path: Path, event: str) -> int:
    n = 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            n += json.loads(line).get("event") == event
        except ValueError:
            continue
    return n


async def test_agent_killed_while_nats_away_loses_nothing(nats_server, nc, unique: str, tmp_path: Path) -> None:
    """kill -9 the agent process (real KmsgProbe replaying fatal/degraded XID lines) after it spooled
    N events during an outage; restart it with NATS back: every event it spooled reaches the stream
    exactly once, in order."""
    cluster, node = f"c{unique}", "n1"
    n = 50
    (tmp_path / "kmsg.txt").write_text("".join(
        f"[ {1000 + i}.000000] NVRM: Xid (PCI:0000:{['3b', '86', '18'][i % 3]}:00): {[79, 48, 13][i % 3]}, "
        f"pid={100 + i}, name=python, event {i}\n" for i in range(n)))
    env = _agent_env(nats_server, tmp_path)
    log1 = tmp_path / "agent1.log"
    await ensure_fault_stream(nc.jetstream())
    nats_server.stop()
    proc = None
    try:
        with open(log1, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "agents", "--node", node, "--cluster", cluster,
                                     "--kmsg-file", str(tmp_path / "kmsg.txt")],
                                    env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        await assert_eventually(lambda: _count_logged(log1, "fault_spooled") == n, timeout_s=60,
                                what=f"{n} events spooled by the agent process")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert proc.returncode == -signal.SIGKILL
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        _ensure_nats_up(nats_server)
    spooled_ids = [json.loads(line)["event_id"] for line in log1.read_text().splitlines()
                   if line.startswith("{") and json.loads(line).get("event") == "fault_spooled"]

    # NATS is back: a fresh agent (no probes) replays the spool and exits.
    t0 = time.monotonic()
    log2 = tmp_path / "agent2.log"
    with open(log2, "wb") as out:
        done = await asyncio.to_thread(subprocess.run, _agent_cmd("--node", node, "--cluster", cluster, "--once"),
                                       env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, timeout=60)
    assert done.returncode == 0, log2.read_text()[-3000:]
    # its own drain at exit is no disconnection: no warning for an operator to chase
    assert '"nats_closed"' in log2.read_text() and '"nats_disconnected"' not in log2.read_text()
    got = await _stream_events(nc.jetstream(), cluster, node)
    assert [e.event_id for _, e in got] == spooled_ids
    assert [mid for mid, _ in got] == spooled_ids and len(set(spooled_ids)) == n
    assert {e.severity for _, e in got} == {Severity.FATAL, Severity.DEGRADED}
    print(f"replayed {n} spooled events after kill -9 in {time.monotonic() - t0:.2f}s (incl. process start)")

KMSG_TEXT = (
    "[ 1234.567890] NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus.\n"
    "[ 1235.000000] NVRM: Xid (PCI:0000:86:00): 48, pid=1234, name=python, An uncorrectable double bit"
    " error (DBE) has been detected on GPU in the framebuffer at partition 0, subpartition 0.\n"
    "[ 1236.100000] NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=x, Graphics SM Warp Exception on (GPC 0,"
    " TPC 0, SM 0): Illegal Instruction Encoding\n"
)


async def test_kmsg_file_replay_once_through_real_probe(nats_server, nc, unique: str, tmp_path: Path) -> None:
    """`--kmsg-file F --once`: the real KmsgProbe (same parser as /dev/kmsg) → JetStream, exit 0."""
    cluster, node = f"c{unique}", "n1"
    (tmp_path / "kmsg.txt").write_text(KMSG_TEXT)
    rc = await run_agent(_settings(nats_server, tmp_path, cluster, node), kmsg_file=tmp_path / "kmsg.txt",
                         once=True)
    assert rc == 0
    got = await _stream_events(nc.jetstream(), cluster, node)
    assert [(e.kind, e.code, e.device.pci_bus_id) for _, e in got] == [
        ("xid", 79, "0000:3b:00.0"), ("xid", 48, "0000:86:00.0"), ("xid", 13, "0000:3b:00.0")]
    assert all(mid == e.event_id and e.source is Source.KMSG for mid, e in got)


async def test_spool_io_runs_off_the_event_loop(tmp_path: Path) -> None:
    """Every spool call (append + fsync, peek, ack, commit) runs in the spool's I/O thread: a burst
    spooled while NATS is away never blocks heartbeats or diagnostics on the event loop."""
    import threading

    spool = Spool(tmp_path / "spool", 1 << 22)
    threads: set[str] = set()
    for name in ("append", "peek", "ack", "commit"):
        real = getattr(spool, name)

        def spy(*a, _real=real, **kw):
            threads.add(threading.current_thread().name)
            return _real(*a, **kw)

        setattr(spool, name, spy)
    pub = Publisher(None, None, spool, "c1", "n1")
    runner = asyncio.create_task(pub.run())
    futs = [await pub.emit(_event("c1", "n1", i)) for i in range(200)]
    assert all(await asyncio.gather(*futs)), "NATS away: every event spooled"
    runner.cancel()
    pub.close()
    assert spool.depth == 200
    assert threads and threading.main_thread().name not in threads, threads
