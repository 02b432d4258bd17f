"""The agent on a disk that says no: a full (ENOSPC) or read-only (EROFS) spool filesystem, for real.

A small tmpfs is mounted for each test (root only; skipped elsewhere), so the kernel itself refuses
the writes. What must hold: the agent keeps running, heartbeats and diagnostics keep answering,
every event it could not keep is counted (`fault_lost` with the reason, metric
`fleetmend_agent_faults_lost_total{reason}`), and spooling resumes by itself once space returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from agents.runner import run_agent
from agents.spool import Spool
from fleetmend.config import AgentSettings, MetricsSettings, Settings
from fleetmend.dev import servers
from fleetmend.errors import SpoolWriteError
from fleetmend.events import Component, Device, FaultEvent, Severity, Source
from fleetmend.infra import metrics
from fleetmend.subjects import FAULT_STREAM, diag_subject, fault_subject, heartbeat_subject
from tests.conftest import assert_eventually


def _can_mount() -> bool:
    return os.geteuid() == 0


pytestmark = pytest.mark.skipif(not _can_mount(), reason="mounting a tmpfs needs root")


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def remount(path: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True)


def fill(path: Path) -> Path:
    """Fill the filesystem of `path` to the last byte; returns the filler file."""
    filler = path / "filler"
    with open(filler, "wb", buffering=0) as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 4096)
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0")
    return filler


def _payload(i: int) -> bytes:
    return (f"event-{i:06d}-".encode() * 40)[:500]


def test_full_filesystem_refuses_cleanly_and_resumes(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "mnt", "128k") as mnt:
        sp = Spool(mnt / "spool", max_bytes=1 << 20, segment_bytes=16 * 1024)
        filler = fill(mnt)
        kept, lost = [], []
        for i in range(200):
            try:
                sp.append(_payload(i), Severity.FATAL, f"id{i:04d}")
                kept.append(f"id{i:04d}")
            except SpoolWriteError as err:
                assert err.reason == "ENOSPC" and "ENOSPC" in str(err)
                lost.append(f"id{i:04d}")
        assert lost, "the disk was full, some appends must fail"
        assert sp.error and sp.error.startswith("ENOSPC") and sp.write_errors == len(lost)
        assert [e for e, _ in sp.pending()] == kept and sp.depth == len(kept)
        filler.unlink()  # space returns
        sp.append(b"after", Severity.FATAL, "id-after")
        assert sp.error is None
        assert [e for e, _ in sp.pending()] == kept + ["id-after"]
        sp.close()
        again = Spool(mnt / "spool", max_bytes=1 << 20)
        assert again.torn_records == 0, "a refused write leaves no torn record behind"
        assert [e for e, _ in again.pending()] == kept + ["id-after"]


def test_read_only_filesystem_refuses_cleanly_and_resumes(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "mnt", "1m") as mnt:
        sp = Spool(mnt / "spool", max_bytes=1 << 20)
        sp.append(_payload(0), Severity.FATAL, "id0")
        sp.ack("id0")
        sp.commit()  # its segment is deleted and closed: nothing open for writing, so ro can be set
        remount(mnt, "ro")
        with pytest.raises(SpoolWriteError) as exc:
            sp.append(_payload(1), Severity.FATAL, "id1")
        assert exc.value.reason == "EROFS" and sp.error.startswith("EROFS")
        sp.commit()  # nothing it can write: logged, not raised
        remount(mnt, "rw")
        sp.append(_payload(2), Severity.FATAL, "id2")
        assert [e for e, _ in sp.pending()] == ["id2"]
        sp.close()
        assert [e for e, _ in Spool(mnt / "spool", max_bytes=1 << 20).pending()] == ["id2"]


def test_spool_opened_on_a_read_only_filesystem_waits_for_it(tmp_path: Path) -> None:
    """An agent restarted while its state filesystem is read-only must start (not crash-loop)."""
    with tmpfs(tmp_path / "mnt", "1m") as mnt:
        remount(mnt, "ro")
        sp = Spool(mnt / "agent" / "n1" / "spool", max_bytes=1 << 20)
        assert sp.error and sp.error.startswith("EROFS") and sp.depth == 0
        with pytest.raises(SpoolWriteError):
            sp.append(b"x", Severity.FATAL, "id0")
        remount(mnt, "rw")
        sp.append(b"y", Severity.FATAL, "id1")
        assert [e for e, _ in sp.pending()] == ["id1"]


def test_misconfigured_state_dir_is_still_an_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        Spool(tmp_path / "file" / "spool", max_bytes=1 << 20)


# ---------------------------------------------------------------- the whole agent


def _event(cluster: str, node: str, i: int) -> FaultEvent:
    return FaultEvent(cluster=cluster, node=node, component=Component.GPU,
                      device=Device(index=i % 8, pci_bus_id=f"0000:{i % 200:02x}:00.0"), kind="xid", code=79,
                      severity=Severity.FATAL, message=f"xid 79 #{i}", source=Source.INJECT, raw="x" * 400)


class ListProbe:
    """Emits whatever the test puts on its queue (a probe stand-in: the publisher path is real)."""

    name = "list"

    def __init__(self) -> None:
        self.q: asyncio.Queue[FaultEvent] = asyncio.Queue()
        self.futures: list[asyncio.Future] = []

    async def run(self, emit) -> None:
        while True:
            fut = await emit(await self.q.get())
            self.futures.append(fut)


def _lost(cluster: str, reason: str) -> float:
    return metrics.REGISTRY.get_sample_value("fleetmend_agent_faults_lost_total",
                                            {"cluster": cluster, "reason": reason}) or 0.0


async def test_agent_survives_full_spool_keeps_heartbeats_and_resumes(tmp_path: Path) -> None:
    cluster, node = f"c{uuid.uuid4().hex[:8]}", "n1"
    port = servers.free_port()
    url = f"nats://127.0.0.1:{port}"
    with tmpfs(tmp_path / "state", "256k") as state:
        s = Settings(cluster=cluster, node=node, nats_url=url, state_dir=state, nats_connect_timeout_s=2,
                     agent=AgentSettings(nice=0, heartbeat_interval_s=0.2, publish_timeout_s=2,
                                         kmsg_path=tmp_path / "no-kmsg"),
                     metrics=MetricsSettings(host="127.0.0.1", agent_port=servers.free_port()))  # counted if served
        probe = ListProbe()
        stop = asyncio.Event()
        agent = asyncio.create_task(run_agent(s, stop=stop, probes=[probe], shutdown_timeout_s=5))
        nats = None
        try:
            # NATS away, disk full: every event is refused by the disk
            await assert_eventually(lambda: (state / "agent" / node / "spool").is_dir(), timeout_s=10)
            filler = fill(state)
            events = [_event(cluster, node, i) for i in range(60)]
            for ev in events[:30]:
                probe.q.put_nowait(ev)
            await assert_eventually(lambda: len(probe.futures) == 30 and all(f.done() for f in probe.futures),
                                    timeout_s=20, what="30 events settled")
            kept = [f.result() for f in probe.futures]
            assert not all(kept), "a full disk must refuse some events"
            lost_before = kept.count(False)
            assert _lost(cluster, "ENOSPC") == lost_before
            assert not agent.done(), "the agent keeps running on a full spool"

            # NATS comes back: heartbeats flow and say what was lost; diagnostics answer
            nats = servers.start_nats(tmp_path / "js", port)
            import nats as nats_py

            nc = await nats_py.connect(url)
            beats: list[dict] = []

            async def on_hb(msg) -> None:
                beats.append(json.loads(msg.data))

            await nc.subscribe(heartbeat_subject(cluster, node), cb=on_hb)
            hb = await assert_eventually(lambda: beats and beats[-1], timeout_s=30, what="a heartbeat")
            assert hb["faults_lost"] == lost_before
            reply = await nc.request(diag_subject(cluster, node), b"not a request", timeout=10)
            assert b"bad diagnostics request" in reply.data  # the responder answers

            # space returns; with NATS away again the spool takes events again
            filler.unlink()
            nats.kill()
            await assert_eventually(lambda: not nc.is_connected, timeout_s=10)
            start = len(probe.futures)
            for ev in events[30:]:
                probe.q.put_nowait(ev)
            await assert_eventually(lambda: len(probe.futures) == start + 30
                                    and all(f.done() for f in probe.futures), timeout_s=60, what="settled")
            assert all(f.result() for f in probe.futures[start:]), "spooling resumed once space returned"
            assert _lost(cluster, "ENOSPC") == lost_before

            # NATS back: everything kept reaches the stream
            nats = servers.start_nats(tmp_path / "js", port)
            await assert_eventually(lambda: nc.is_connected, timeout_s=20)
            js = nc.jetstream()

            async def stream_count() -> int:
                try:
                    info = await js.stream_info(FAULT_STREAM, subjects_filter=fault_subject(cluster, node))
                except Exception:  # not yet created
                    return 0
                return (info.state.subjects or {}).get(fault_subject(cluster, node), 0)

            want = len(events) - lost_before
            await assert_eventually(lambda: _ge(stream_count(), want), timeout_s=60, what=f"{want} in the stream")
            await nc.close()
        finally:
            stop.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(agent, 30)
            if nats is not None:
                nats.stop()
        assert agent.result() == 0


async def _ge(coro, n: int) -> bool:
    return (await coro) >= n
