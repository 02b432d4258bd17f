"""A bounded, crash-safe, on-disk FIFO of serialized `FaultEvent`s, used while NATS is away.

Layout under `directory`:

    segment-<first seq, 16 digits>.log   append-only records, fsync'd on every append
    state.json                           {"acked_through": seq, "dropped": n}, replaced atomically

Record framing (big-endian): `u32 body_len | u32 crc32(body) | body`, where
`body = u64 seq | u8 severity rank | u8 id_len | event_id (ASCII) | payload`.
Every record carries a sequence number that never changes, so rewriting a segment (eviction,
compaction) never invalidates `acked_through`.

Crash safety: an append is durable when `append` returns (write + fsync). After kill -9 or power
loss the last record of a segment may be torn; on open it is detected (short header, short body,
crc mismatch), the segment is truncated there and `torn_records` counts it, never a crash.
`ack` is in memory; `commit` persists `acked_through`. A crash between the two re-sends the acked
records on the next replay; they keep their original event ids, so JetStream's Nats-Msg-Id
dedupe (duplicate window) drops the copies.

Bound: the segment files never hold more than `max_bytes`. When an append would cross it, acked
records are compacted away first, then the oldest INFO events are evicted (counted in `dropped`,
persisted). Degraded and fatal events are never evicted: if only they remain and the spool is
still full, `append` raises `SpoolFullError` (never block silently).

A disk that refuses a write (full filesystem `ENOSPC`, quota `EDQUOT`, read-only `EROFS`, `EIO`)
never breaks the spool: the partial record is cut off again (or, where even that fails, before the
next write), `append` raises `SpoolWriteError` with the errno name as `reason`, and the next
`append` simply tries again, so spooling resumes by itself once space returns. A spool directory
that cannot even be created or read at start leaves the spool "unavailable" (`error` says why);
every `append` retries opening it. `commit` failures (state file, segment deletion) are logged and
retried at the next commit; acked records then replay after a crash and are deduplicated.

Not thread-safe: one owner at a time. The publisher runs every call in one dedicated I/O thread
(fsync stays off the event loop); `depth`, `dropped_count` and `error` are plain counters/strings
that other threads may read at any time (heartbeats, the metrics endpoint).
"""

from __future__ import annotations

import errno
import io
import json
import os
import struct
import time
import zlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import structlog

from fleetmend.errors import SpoolFullError, SpoolWriteError
from fleetmend.events import Severity

_HEAD = struct.Struct(">II")  # body_len, crc32(body)
_BODY = struct.Struct(">QBB")  # seq, severity rank, id_len
_RANK_TO_SEV = {s.rank: s for s in Severity}
_SEG_PREFIX, _SEG_SUFFIX = "segment-", ".log"
_STATE = "state.json"
MAX_RECORD_BYTES = 4 * 1024 * 1024
"""Larger body lengths in a header are treated as corruption (a FaultEvent is < 64 KiB)."""

log = structlog.get_logger("fleetmend.spool")


@dataclass(slots=True)
class _Rec:
    seq: int
    event_id: str
    rank: int
    segment: int  # first seq of the segment file it lives in
    offset: int
    size: int  # whole record on disk, header included
    acked: bool = False


DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO})
"""Errors of the disk rather than of the configuration: survived (counted, retried), never fatal.
Anything else when the spool is first opened (not a directory, permission denied) is raised, so a
misconfigured state directory is one clear error at start."""


def errno_name(err: OSError) -> str:
    """`ENOSPC`, `EROFS`, … for an OSError (a bounded label); `OSError` when it carries no errno."""
    return errno.errorcode.get(err.errno or -1, "OSError")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _encode(seq: int, rank: int, event_id: str, payload: bytes) -> bytes:
    eid = event_id.encode("ascii")
    if len(eid) > 255:
        raise ValueError(f"event_id longer than 255 bytes: {event_id[:40]!r}…")
    body = _BODY.pack(seq, rank, len(eid)) + eid + payload
    return _HEAD.pack(len(body), zlib.crc32(body)) + body


class Spool:
    """Bounded on-disk FIFO. See module docstring for layout, crash safety and the bound.

    Args:
        directory: created if missing; owned by one process at a time.
        max_bytes: bound on the segment files' total size (bytes).
        segment_bytes: rotate to a new segment file beyond this size; default max_bytes // 8
            (at least 64 KiB), so acked segments are deleted whole without rewriting.
    """

    def __init__(self, directory: Path, max_bytes: int, segment_bytes: int | None = None) -> None:
        if max_bytes <= 0:
            raise ValueError(f"spool max_bytes must be positive, got {max_bytes}")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes or max(64 * 1024, max_bytes // 8)
        self._recs: deque[_Rec] = deque()  # live records (acked ones until commit), in order
        self._seg_sizes: dict[int, int] = {}  # segment id -> bytes on disk
        self._active: int | None = None  # segment id being appended to
        self._fh: io.FileIO | None = None
        self._acked_through = 0
        self._committed_through = 0
        self._last_seq = 0
        self.dropped_count = 0
        """INFO events evicted to make room (persisted across restarts)."""
        self.torn_records = 0
        """Torn/corrupt records found and cut off when this spool was opened."""
        self.error: str | None = None
        """Why the last write or open failed (`ENOSPC: …`), None once a write succeeds again."""
        self.write_errors = 0
        """Appends the disk refused (each raised `SpoolWriteError`)."""
        self._depth = 0
        self._opened = False
        self._tail_fix: tuple[int, int] | None = None  # (segment, offset) to cut back to before the next write
        self._last_commit_error_log = 0.0
        err = self._try_open()
        if err is not None and err.errno not in DISK_ERRNOS:
            raise err

    # ------------------------------------------------------------------ public

    @property
    def depth(self) -> int:
        """Number of events not yet acked (a counter: safe to read from any thread)."""
        return self._depth

    @property
    def size_bytes(self) -> int:
        """Bytes the segment files take on disk now."""
        return sum(self._seg_sizes.values())

    def __len__(self) -> int:
        return self.depth

    def append(self, event_bytes: bytes, severity: Severity, event_id: str) -> None:
        """Append one serialized event durably (fsync before returning).

        Raises:
            SpoolFullError: the bound is reached and only degraded/fatal events remain
                (`.directory`, `.size_bytes`, `.max_bytes` say which spool and how full).
            SpoolWriteError: the disk refused it (`.reason` ENOSPC, EROFS, EIO, …); nothing of this
                record stays on disk or in the index, and the next `append` tries again.
        """
        self._try_open()
        if not self._opened:
            self.write_errors += 1
            raise SpoolWriteError(f"spool {self.directory} unavailable: {self.error}",
                                  reason=self.error.split(":", 1)[0] if self.error else "OSError")
        seq = self._next_seq()
        rec_bytes = _encode(seq, Severity(severity).rank, event_id, event_bytes)
        seg, offset = self._active, self._seg_sizes.get(self._active, 0) if self._active is not None else 0
        try:
            if self._tail_fix is not None:
                self._cut_tail()
            if self.size_bytes + len(rec_bytes) > self.max_bytes:
                self._make_room(len(rec_bytes), event_id)
            if self._fh is None or self._active is None or self._seg_sizes.get(self._active, 0) >= self.segment_bytes:
                self._rotate(seq)
            assert self._fh is not None and self._active is not None
            seg, offset = self._active, self._seg_sizes[self._active]
            view = memoryview(rec_bytes)
            while view:
                n = self._fh.write(view)
                view = view[n:]
            os.fsync(self._fh.fileno())
        except OSError as err:
            if isinstance(err, SpoolFullError):
                raise
            self._write_failed(err, seg, offset, event_id)  # raises SpoolWriteError
        assert self._active is not None  # set by _rotate in the try block, which raised otherwise
        self._seg_sizes[self._active] = offset + len(rec_bytes)
        self._recs.append(_Rec(seq, event_id, Severity(severity).rank, self._active, offset, len(rec_bytes)))
        self._depth += 1
        self._last_seq = seq
        if self.error is not None:
            log.info("spool_writable_again", directory=str(self.directory), after=self.error,
                     write_errors=self.write_errors)
            self.error = None

    def peek(self) -> tuple[str, bytes] | None:
        """The oldest unacked event as (event_id, bytes), or None when empty."""
        for r in self._recs:
            if not r.acked:
                return r.event_id, self._read(r)
        return None

    def pending(self) -> Iterator[tuple[str, bytes]]:
        """Unacked events as (event_id, bytes), oldest first (a snapshot taken at the call)."""
        for r in [r for r in self._recs if not r.acked]:
            yield r.event_id, self._read(r)

    def ack(self, event_id: str) -> bool:
        """Mark the oldest unacked record with this id as delivered (in memory; see `commit`).

        Returns False when no unacked record has this id (already acked or evicted)."""
        for r in self._recs:
            if not r.acked and r.event_id == event_id:
                r.acked = True
                self._depth -= 1
                self._advance()
                return True
        return False

    def commit(self) -> None:
        """Delete segments that hold only acked records, then persist the acked prefix.

        Never raises for disk trouble: a failed deletion or state write is logged
        (`spool_commit_failed`, at most once a minute) and retried by the next commit."""
        self._advance()
        while self._recs and self._recs[0].acked and self._recs[0].seq <= self._acked_through:
            self._recs.popleft()
        live_segs = {r.segment for r in self._recs}
        try:
            for seg in sorted(self._seg_sizes):
                if seg not in live_segs:
                    if seg == self._active:
                        self._close_active()
                    (self.directory / self._seg_name(seg)).unlink(missing_ok=True)
                    del self._seg_sizes[seg]
            if self._acked_through != self._committed_through:
                self._write_state()
                self._committed_through = self._acked_through
        except OSError as err:
            now = time.monotonic()
            if now - self._last_commit_error_log > 60.0:
                self._last_commit_error_log = now
                log.warning("spool_commit_failed", directory=str(self.directory), error=f"{errno_name(err)}: {err}",
                            acked_through=self._acked_through)

    def commit_through(self, event_id: str) -> None:
        """Ack every record up to and including the oldest one with `event_id`, then `commit`."""
        for r in self._recs:
            if not r.acked:
                r.acked = True
                self._depth -= 1
            if r.event_id == event_id:
                break
        self.commit()

    def close(self) -> None:
        """Commit (best effort, see `commit`) and close the active segment. Never raises for disk trouble."""
        self.commit()
        try:
            self._close_active()
        except OSError as err:
            log.warning("spool_close_failed", directory=str(self.directory), error=f"{errno_name(err)}: {err}")

    # ----------------------------------------------------------------- private

    @staticmethod
    def _seg_name(seg: int) -> str:
        return f"{_SEG_PREFIX}{seg:016d}{_SEG_SUFFIX}"

    def _next_seq(self) -> int:
        return max(self._last_seq, self._acked_through) + 1

    def _advance(self) -> None:
        for r in self._recs:
            if not r.acked:
                break
            self._acked_through = max(self._acked_through, r.seq)

    def _write_state(self) -> None:
        tmp = self.directory / (_STATE + ".tmp")
        data = json.dumps({"acked_through": self._acked_through, "dropped": self.dropped_count}).encode()
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.directory / _STATE)
        _fsync_dir(self.directory)

    def _read(self, r: _Rec) -> bytes:
        with open(self.directory / self._seg_name(r.segment), "rb") as f:
            f.seek(r.offset)
            data = f.read(r.size)
        id_len = data[_HEAD.size + _BODY.size - 1]
        return data[_HEAD.size + _BODY.size + id_len:]

    def _try_open(self) -> OSError | None:
        """Open the spool once: create the directory, read state and segments. A failure (read-only
        or full filesystem, permissions) is logged, kept in `error`, retried by the next append, and
        returned."""
        if self._opened:
            return None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._recs.clear()
            self._seg_sizes.clear()
            self._depth = 0
            self._open()
            self._opened = True
            return None
        except OSError as err:
            why = f"{errno_name(err)}: {err}"
            if why != self.error:
                log.error("spool_unavailable", directory=str(self.directory), error=why)
            self.error = why
            return err

    def _open(self) -> None:
        for tmp in self.directory.glob("*.tmp"):
            try:
                tmp.unlink()
            except OSError as err:  # read-only: harmless leftovers, removed by a later open
                log.warning("spool_tmp_not_removed", path=str(tmp), error=f"{errno_name(err)}: {err}")
        state_path = self.directory / _STATE
        if state_path.exists():
            try:
                state = json.loads(state_path.read_bytes())
                self._acked_through = int(state.get("acked_through", 0))
                self.dropped_count = int(state.get("dropped", 0))
            except (ValueError, TypeError) as err:
                # Written atomically, so this is outside tampering; replaying acked records again is safe.
                log.warning("spool_state_unreadable", path=str(state_path), error=str(err))
        self._committed_through = self._acked_through
        segs = sorted(int(p.name[len(_SEG_PREFIX):-len(_SEG_SUFFIX)])
                      for p in self.directory.glob(f"{_SEG_PREFIX}*{_SEG_SUFFIX}"))
        for seg in segs:
            self._scan(seg)
        self.commit()  # drops fully acked segments left by a crash before commit
        if self.depth or self.torn_records or self.dropped_count:
            log.info("spool_opened", directory=str(self.directory), depth=self.depth,
                     size_bytes=self.size_bytes, dropped=self.dropped_count, torn_records=self.torn_records)

    def _scan(self, seg: int) -> None:
        path = self.directory / self._seg_name(seg)
        data = path.read_bytes()
        pos, last_seq = 0, self._recs[-1].seq if self._recs else 0
        while pos < len(data):
            why = None
            if len(data) - pos < _HEAD.size:
                why = "short header"
            else:
                body_len, crc = _HEAD.unpack_from(data, pos)
                end = pos + _HEAD.size + body_len
                if body_len < _BODY.size or body_len > MAX_RECORD_BYTES:
                    why = f"implausible length {body_len}"
                elif end > len(data):
                    why = "short body"
                elif zlib.crc32(data[pos + _HEAD.size:end]) != crc:
                    why = "crc mismatch"
            if why is not None:
                self.torn_records += 1
                log.warning("spool_torn_record", segment=str(path), offset=pos, reason=why,
                            bytes_cut=len(data) - pos)
                try:
                    with open(path, "r+b") as f:
                        f.truncate(pos)
                        os.fsync(f.fileno())
                except OSError as err:  # read-only: cut it before this segment's next write
                    log.warning("spool_torn_record_not_cut", segment=str(path), error=f"{errno_name(err)}: {err}")
                    self._tail_fix = (seg, pos)
                data = data[:pos]
                break
            seq, rank, id_len = _BODY.unpack_from(data, pos + _HEAD.size)
            eid = data[pos + _HEAD.size + _BODY.size: pos + _HEAD.size + _BODY.size + id_len].decode("ascii")
            size = _HEAD.size + body_len
            if seq > self._acked_through and seq > last_seq:
                self._recs.append(_Rec(seq, eid, rank, seg, pos, size))
                self._depth += 1
                last_seq = seq
            self._last_seq = max(self._last_seq, seq)
            pos += size
        self._seg_sizes[seg] = len(data)

    def _rotate(self, seq: int) -> None:
        self._close_active()
        path = self.directory / self._seg_name(seq)
        fh = open(path, "ab", buffering=0)  # unbuffered: a failed write leaves nothing queued in Python
        try:
            size = path.stat().st_size
            _fsync_dir(self.directory)
        except OSError:
            fh.close()
            raise
        self._fh, self._active = fh, seq
        self._seg_sizes.setdefault(seq, size)

    def _write_failed(self, err: OSError, seg: int | None, offset: int, event_id: str) -> None:
        """Undo a failed append (cut the segment back to `offset`, now or before the next write), then
        raise `SpoolWriteError`."""
        reason = errno_name(err)
        self.write_errors += 1
        self.error = f"{reason}: {err.strerror or err}"
        if seg is not None:
            self._tail_fix = (seg, offset)
            try:
                self._close_active()
            except OSError:
                self._fh, self._active = None, None
            try:
                self._cut_tail()
            except OSError:
                pass  # kept in _tail_fix: cut before the next write
        raise SpoolWriteError(f"spool {self.directory} could not keep event {event_id}: {self.error}",
                              reason=reason, cause=err) from err

    def _cut_tail(self) -> None:
        """Truncate the segment of `_tail_fix` to its last good record. Raises OSError (kept for later)."""
        assert self._tail_fix is not None
        seg, offset = self._tail_fix
        path = self.directory / self._seg_name(seg)
        try:
            with open(path, "r+b", buffering=0) as f:
                if os.fstat(f.fileno()).st_size > offset:
                    f.truncate(offset)
                    os.fsync(f.fileno())
        except FileNotFoundError:
            pass
        self._tail_fix = None
        if seg in self._seg_sizes:
            self._seg_sizes[seg] = min(self._seg_sizes[seg], offset)

    def _close_active(self) -> None:
        if self._fh is not None:
            self._fh.close()
        self._fh = None
        self._active = None

    def _make_room(self, need: int, event_id: str) -> None:
        self.commit()
        live = sum(r.size for r in self._recs if not r.acked)
        budget = self.max_bytes - need
        evict: set[int] = set()
        if live > budget:
            info_bytes = sum(r.size for r in self._recs if not r.acked and r.rank == Severity.INFO.rank)
            if live - info_bytes > budget:
                err = SpoolFullError(
                    f"spool {self.directory} is full: {self.size_bytes} bytes on disk, bound "
                    f"{self.max_bytes} bytes (agent.spool_max_bytes), {self.depth} degraded/fatal events "
                    f"waiting for NATS; cannot accept event {event_id} ({need} bytes). Restore NATS "
                    "connectivity or raise agent.spool_max_bytes")
                err.directory, err.size_bytes, err.max_bytes = self.directory, self.size_bytes, self.max_bytes
                raise err
            # Evict the oldest INFO events, with 10% slack so a full spool doesn't rewrite per append.
            target = max(budget - self.max_bytes // 10, live - info_bytes)
            for r in self._recs:
                if live <= target:
                    break
                if not r.acked and r.rank == Severity.INFO.rank:
                    evict.add(r.seq)
                    live -= r.size
        evicted = self._compact(evict)
        if evicted:
            self.dropped_count += evicted
            self._depth -= evicted
            log.warning("spool_evicted", directory=str(self.directory), evicted=evicted,
                        dropped_total=self.dropped_count, max_bytes=self.max_bytes)
            self._write_state()

    def _compact(self, evict: set[int]) -> int:
        """Rewrite every segment without acked or evicted records (tmp + fsync + rename).

        Segment by segment: the index follows each rename, so a disk error midway leaves the index
        true to what is on disk (and raises). Returns how many evicted records were removed."""
        self._close_active()
        removed = 0
        done: set[int] = set()
        try:
            for seg in sorted(self._seg_sizes):
                path = self.directory / self._seg_name(seg)
                recs = [r for r in self._recs if r.segment == seg and not r.acked and r.seq not in evict]
                gone = sum(1 for r in self._recs if r.segment == seg and not r.acked and r.seq in evict)
                if not recs:
                    path.unlink(missing_ok=True)
                    del self._seg_sizes[seg]
                    done.add(seg)
                    removed += gone
                    continue
                with open(path, "rb") as f:
                    blob = f.read()
                tmp = path.with_name(path.name + ".tmp")
                offsets, offset = [], 0
                try:
                    with open(tmp, "wb") as out:
                        for r in recs:
                            out.write(blob[r.offset:r.offset + r.size])
                            offsets.append(offset)
                            offset += r.size
                        out.flush()
                        os.fsync(out.fileno())
                    os.replace(tmp, path)
                except OSError:
                    tmp.unlink(missing_ok=True)
                    raise
                for r, off in zip(recs, offsets, strict=False):
                    r.offset = off
                self._seg_sizes[seg] = offset
                done.add(seg)
                removed += gone
            _fsync_dir(self.directory)
        finally:
            self._recs = deque(r for r in self._recs
                               if r.segment not in done or (not r.acked and r.seq not in evict))
        return removed
