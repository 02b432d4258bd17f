"""The agent's on-disk spool: order, bound with INFO-first eviction, SpoolFullError, torn records."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agents.spool import Spool
from fleetmend.errors import FleetmendError, SpoolFullError
from fleetmend.events import Severity


def _payload(i: int, n: int = 100) -> bytes:
    return (f"event-{i:06d}-".encode() * 20)[:n]


def test_order_ack_and_reopen(tmp_path: Path) -> None:
    sp = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=4096)
    for i in range(100):
        sp.append(_payload(i), Severity.FATAL, f"id{i:04d}")
    assert sp.depth == 100
    assert [eid for eid, _ in sp.pending()] == [f"id{i:04d}" for i in range(100)]
    assert sp.peek() == ("id0000", _payload(0))
    for i in range(30):
        assert sp.ack(f"id{i:04d}")
    sp.commit()
    assert sp.depth == 70
    segments_before = len(list(tmp_path.glob("segment-*.log")))
    sp.close()

    again = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=4096)
    got = list(again.pending())
    assert [eid for eid, _ in got] == [f"id{i:04d}" for i in range(30, 100)]
    assert got[0][1] == _payload(30)
    # new appends continue after the old ones
    again.append(b"new", Severity.INFO, "idnew")
    assert [eid for eid, _ in again.pending()][-1] == "idnew"
    again.commit_through("idnew")
    assert again.depth == 0
    assert list(tmp_path.glob("segment-*.log")) == [] and segments_before > 1


def test_uncommitted_acks_are_replayed_after_reopen(tmp_path: Path) -> None:
    sp = Spool(tmp_path, max_bytes=1 << 20)
    for i in range(5):
        sp.append(_payload(i), Severity.DEGRADED, f"id{i}")
    sp.ack("id0")
    sp.ack("id1")  # no commit: a crash here must replay id0/id1 (JetStream dedupes them)
    del sp
    assert [e for e, _ in Spool(tmp_path, max_bytes=1 << 20).pending()] == [f"id{i}" for i in range(5)]


def test_bound_evicts_oldest_info_first_never_fatal(tmp_path: Path) -> None:
    sp = Spool(tmp_path, max_bytes=8 * 1024, segment_bytes=2048)
    sev = [Severity.INFO, Severity.FATAL, Severity.INFO, Severity.DEGRADED]
    appended = []
    for i in range(200):
        s = sev[i % 4]
        try:
            sp.append(_payload(i), s, f"id{i:04d}")
            appended.append((f"id{i:04d}", s))
        except SpoolFullError:
            break
    assert sp.size_bytes <= sp.max_bytes
    assert sp.dropped_count > 0
    left = [eid for eid, _ in sp.pending()]
    kept_sev = dict(appended)
    # every non-INFO event appended is still there, in order
    non_info = [eid for eid, s in appended if s is not Severity.INFO]
    assert [e for e in left if kept_sev[e] is not Severity.INFO] == non_info
    assert left == sorted(left)
    # the INFO events that survived are the newest ones
    info_left = [e for e in left if kept_sev[e] is Severity.INFO]
    info_all = [e for e, s in appended if s is Severity.INFO]
    assert info_left == info_all[len(info_all) - len(info_left):]
    assert len(info_all) - len(info_left) == sp.dropped_count
    dropped = sp.dropped_count
    sp.close()
    assert Spool(tmp_path, max_bytes=8 * 1024).dropped_count == dropped


def test_full_of_fatal_raises_with_where_and_bound(tmp_path: Path) -> None:
    sp = Spool(tmp_path, max_bytes=4 * 1024)
    n = 0
    with pytest.raises(SpoolFullError) as exc:
        while True:
            sp.append(_payload(n), Severity.FATAL, f"id{n:04d}")
            n += 1
    err = exc.value
    assert isinstance(err, OSError) and isinstance(err, FleetmendError)
    assert str(tmp_path) in str(err) and "4096" in str(err) and "spool_max_bytes" in str(err)
    assert err.max_bytes == 4096 and err.size_bytes <= 4096
    assert sp.depth == n  # nothing was evicted
    assert sp.dropped_count == 0
    # after acking some, there is room again
    sp.ack("id0000")
    sp.ack("id0001")
    sp.append(_payload(999), Severity.FATAL, "id-more")
    assert [e for e, _ in sp.pending()][-1] == "id-more"


@pytest.mark.parametrize("cut", [3, 10, 40])
def test_torn_last_record_is_cut_not_a_crash(tmp_path: Path, cut: int) -> None:
    sp = Spool(tmp_path, max_bytes=1 << 20)
    for i in range(10):
        sp.append(_payload(i), Severity.FATAL, f"id{i}")
    sp.close()
    (seg,) = tmp_path.glob("segment-*.log")
    size = seg.stat().st_size
    with open(seg, "r+b") as f:
        f.truncate(size - cut)  # the last record lost its tail (power loss mid-write)
    again = Spool(tmp_path, max_bytes=1 << 20)
    assert again.torn_records == 1
    assert [e for e, _ in again.pending()] == [f"id{i}" for i in range(9)]
    again.append(b"after", Severity.FATAL, "id-after")
    again.close()
    third = Spool(tmp_path, max_bytes=1 << 20)
    assert third.torn_records == 0
    assert [e for e, _ in third.pending()] == [f"id{i}" for i in range(9)] + ["id-after"]


def test_corrupt_record_crc_is_detected(tmp_path: Path) -> None:
    sp = Spool(tmp_path, max_bytes=1 << 20)
    for i in range(3):
        sp.append(_payload(i), Severity.FATAL, f"id{i}")
    sp.close()
    (seg,) = tmp_path.glob("segment-*.log")
    data = bytearray(seg.read_bytes())
    data[-5] ^= 0xFF
    seg.write_bytes(bytes(data))
    again = Spool(tmp_path, max_bytes=1 << 20)
    assert again.torn_records == 1
    assert [e for e, _ in again.pending()] == ["id0", "id1"]


_WRITER = """
import sys
from pathlib import Path
from agents.spool import Spool
from fleetmend.events import Severity
sp = Spool(Path(sys.argv[1]), max_bytes=1 << 24)
i = 0
while True:
    sp.append(b"x" * 300, Severity.FATAL, f"id{i:08d}")
    print(i, flush=True)
    i += 1
"""


def test_survives_kill_9_mid_append(tmp_path: Path) -> None:
    """A writer killed with SIGKILL while appending: every acknowledged append is there, in order."""
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE,
                            text=True, cwd=Path(__file__).resolve().parents[1])
    assert proc.stdout is not None
    confirmed = -1
    for line in proc.stdout:
        confirmed = int(line)
        if confirmed >= 300:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    sp = Spool(tmp_path, max_bytes=1 << 24)
    ids = [e for e, _ in sp.pending()]
    assert len(ids) >= confirmed + 1
    assert ids == [f"id{i:08d}" for i in range(len(ids))]
