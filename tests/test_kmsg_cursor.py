"""The kmsg cursor moves only past records whose events were published or spooled, and event ids
are derived from the record, so a record read again (after a restart, or a file replayed twice)
is the same event and JetStream drops the copy."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import subprocess
import sys
import termios
from pathlib import Path

from agents.kmsg.probe import KmsgProbe, file_scope, kmsg_event_id
from fleetmend.subjects import FAULT_STREAM, fault_subject
from tests.conftest import assert_eventually

REPO = Path(__file__).resolve().parents[1]


def _record(seq: int) -> bytes:
    """One /dev/kmsg record: XID 79 on its own GPU, 5 s after the previous one."""
    return (f"3,{seq},{seq * 5_000_000},-;NVRM: Xid (PCI:0000:{seq:02x}:00): 79, pid='<unknown>', "
            f"name=<unknown>, GPU has fallen off the bus.\n").encode()


async def test_cursor_waits_until_events_are_published_or_spooled(tmp_path: Path) -> None:
    """A pty slave is a character device that hands out one record per read, like /dev/kmsg."""
    master, slave = pty.openpty()
    attrs = termios.tcgetattr(slave)
    attrs[3] &= ~termios.ECHO
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    futures: list[asyncio.Future[bool]] = []
    events = []

    async def emit(ev):  # the publisher's contract: a future settled once published/spooled
        fut = asyncio.get_running_loop().create_future()
        futures.append(fut)
        events.append(ev)
        return fut

    probe = KmsgProbe(source=Path(os.ttyname(slave)), state_dir=tmp_path / "state", node="n1", cluster="c1")
    task = asyncio.create_task(probe.run(emit))
    try:
        for seq in (1, 2, 3):
            os.write(master, _record(seq))
        await assert_eventually(lambda: len(events) == 3, timeout_s=10, what="3 events emitted")
        await asyncio.sleep(0.3)
        cursor = tmp_path / "state" / "kmsg.cursor"
        saved = json.loads(cursor.read_text())["seq"] if cursor.exists() else 0
        assert saved == 0, "nothing is published or spooled yet: the cursor must not move past record 1"
        futures[0].set_result(True)
        await assert_eventually(lambda: json.loads(cursor.read_text())["seq"] == 1, timeout_s=5,
                                what="cursor at 1")
        futures[1].set_result(False)  # lost (counted by the publisher): settled, the cursor goes on
        futures[2].set_result(True)
        await assert_eventually(lambda: json.loads(cursor.read_text())["seq"] == 3, timeout_s=5,
                                what="cursor at 3")
        # ids come from boot id + SEQ: the same record read again is the same event
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        assert [e.event_id for e in events] == [kmsg_event_id(f"kmsg|c1|n1|{boot}", s) for s in (1, 2, 3)]
    finally:
        task.cancel()
        os.close(master)
        os.close(slave)


def _agent(env: dict[str, str], node: str, log: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agents", "--node", node, "--kmsg-file", str(log), "--once"],
                          env=env, capture_output=True, text=True, timeout=120)


async def test_kmsg_file_replayed_twice_is_stored_once(nats_server, nc, unique: str, tmp_path: Path) -> None:
    cluster, node = f"c{unique}", "n1"
    log = tmp_path / "dmesg.txt"
    log.write_text("".join(f"[{i * 10}.0] NVRM: Xid (PCI:0000:{i:02x}:00): 79, pid='<unknown>', name=<unknown>, "
                           "GPU has fallen off the bus.\n" for i in range(1, 6)))
    env = {**os.environ, "FLEETMEND_NATS_URL": nats_server.url, "FLEETMEND_STATE_DIR": str(tmp_path / "state"),
           "FLEETMEND_CLUSTER": cluster, "FLEETMEND_AGENT__NICE": "0", "PYTHONPATH": str(REPO)}
    for _ in range(2):  # the agent restarted on the same file
        r = _agent(env, node, log)
        assert r.returncode == 0, r.stderr[-2000:]
    js = nc.jetstream()
    info = await js.stream_info(FAULT_STREAM, subjects_filter=fault_subject(cluster, node))
    stored = (info.state.subjects or {}).get(fault_subject(cluster, node), 0)
    assert stored == 5, "the second replay's events carry the same ids: deduplicated"
    scope = file_scope(log, cluster, node)
    psub = await js.pull_subscribe(fault_subject(cluster, node), stream=FAULT_STREAM)
    msgs = await psub.fetch(5, timeout=5)
    assert [json.loads(m.data)["event_id"] for m in msgs] == [
        kmsg_event_id(scope, off) for off in [sum(len(ln) for ln in log.read_text().splitlines(True)[:i])
                                              for i in range(5)]]
