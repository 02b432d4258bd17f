"""`KmsgProbe`: reads /dev/kmsg (or replays a file) through `KmsgParser` and emits `FaultEvent`s."""

from __future__ import annotations

import asyncio
import collections
import errno
import hashlib
import json
import logging
import os
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from agents.kmsg.parser import KmsgParser
from fleetmend.catalog import Catalog
from fleetmend.events import FaultEvent

log = logging.getLogger(__name__)

Emit = Callable[[FaultEvent], Awaitable[Any]]
"""`await emit(event)`; may return a future that settles once the event is published or spooled."""

KMSG_READ_BYTES = 8192
"""/dev/kmsg returns one record per read(); records are at most ~1 KiB of text plus the dictionary,
and a buffer smaller than the record fails with EINVAL, so 8 KiB is safe."""
FILE_POLL_S = 1.0
"""Replay files (not /dev/kmsg) are followed by stat() once a second, tail -f style."""


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _seek(fd: int, whence: int) -> None:
    """lseek /dev/kmsg to its oldest record (SEEK_SET) or past the newest (SEEK_END); a character
    device without a record buffer (a pty carrying kmsg records) has nothing to seek: ESPIPE is fine."""
    try:
        os.lseek(fd, 0, whence)
    except OSError as err:
        if err.errno != errno.ESPIPE:
            raise


def kmsg_event_id(scope: str, origin: int, n: int = 0) -> str:
    """Deterministic event id of the `n`-th event whose record starts at `origin` within `scope`.

    `scope` names the input: `kmsg|<cluster>|<node>|<boot id>` (origin = kmsg SEQ) or
    `file|<cluster>|<node>|<device>:<inode>|<sha256 of the first 4 KiB>` (origin = byte offset).
    Returns 24 hex digits (the length of `new_event_id`), the start of SHA-256(scope|origin|n).
    """
    return hashlib.sha256(f"{scope}|{origin}|{n}".encode()).hexdigest()[:24]


def file_scope(path: Path, cluster: str, node: str) -> str:
    """`kmsg_event_id` scope of a replayed file: its device, inode and first 4 KiB (so a file
    rewritten in place with other content is a new input)."""
    st = path.stat()
    with path.open("rb") as f:
        head = hashlib.sha256(f.read(4096)).hexdigest()[:16]
    return f"file|{cluster}|{node}|{st.st_dev}:{st.st_ino}|{head}"


class KmsgProbe:
    """Kernel log probe (`name = "kmsg"`).

    Args:
        source: `/dev/kmsg` (character device: live) or a regular file (replay: dmesg/journal text).
        parser: a `KmsgParser`; default one built from cluster/node/agent_version/catalog.
        parser_factory: zero-argument callable returning a parser (wins over `parser`).
        follow: for files, keep reading appended lines after the end (tail -f by stat polling); False
            returns after one pass. /dev/kmsg is always followed.
        state_dir: where the cursor file `kmsg.cursor` lives (last SEQ + boot id); None: no cursor.
        cluster, node, agent_version, catalog: for the default parser.

    What a restart can lose or repeat (/dev/kmsg):
        - First start without a cursor seeks to the end: earlier records of this boot are not read.
        - With a cursor from this boot, reading resumes after the saved SEQ. Records the kernel
          overwrote in its ring buffer while the agent was down are lost (detected as a SEQ gap or
          EPIPE and logged as `kmsg_records_lost`).
        - With a cursor from an earlier boot (boot id differs), the whole buffer of this boot is
          read from the oldest record, so boot-time faults are reported.
        - The cursor advances only past records whose events were published to JetStream or kept
          in the spool (or counted as lost when neither could take them: `fault_lost`), never past
          events still queued in memory; a crash repeats at most the records after it.
        - Event ids are derived from the record (`kmsg_event_id`: boot id + SEQ; for a replayed
          file, the file's identity + byte offset), so a repeated record carries the same id and
          JetStream's duplicate window, then the workflow, drop the copy.
    """

    name = "kmsg"

    def __init__(
        self,
        source: Path = Path("/dev/kmsg"),
        parser: KmsgParser | None = None,
        parser_factory: Callable[[], KmsgParser] | None = None,
        follow: bool = True,
        state_dir: Path | None = None,
        cluster: str = "local",
        node: str = "localhost",
        agent_version: str = "unknown",
        catalog: Catalog | None = None,
    ) -> None:
        self.source = Path(source)
        if parser_factory is not None:
            self.parser = parser_factory()
        else:
            self.parser = parser or KmsgParser(cluster, node, agent_version, catalog=catalog)
        self.follow = follow
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self.records_lost = 0
        self.cluster, self.node = self.parser.cluster, self.parser.node
        self.cursor_error: str | None = None
        self._cur_seq: int | None = None  # SEQ of the kmsg record being fed
        self._origin_of: dict[str, int] = {}
        # (origin of the record, future of its event) for events not yet published/spooled
        self._unsettled: collections.deque[tuple[int, asyncio.Future[bool]]] = collections.deque()

    # ------------------------------------------------------------------ cursor

    @property
    def cursor_path(self) -> Path | None:
        return self.state_dir / "kmsg.cursor" if self.state_dir else None

    def _load_cursor(self) -> tuple[str | None, int | None]:
        p = self.cursor_path
        if p is None:
            return None, None
        try:
            data = json.loads(p.read_text())
            return data.get("boot_id"), int(data["seq"])
        except FileNotFoundError:
            return None, None
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.warning("kmsg_cursor_unreadable", extra={"path": str(p), "error": repr(err)})
            return None, None

    def _save_cursor(self, seq: int | None) -> None:
        """Persist `seq`; a disk that refuses (full, read-only) is logged once per error, never fatal:
        the cursor then stays behind and a restart repeats records (same ids: deduplicated)."""
        p = self.cursor_path
        if p is None or seq is None:
            return
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_suffix(".tmp")
            tmp.write_text(json.dumps({"boot_id": _boot_id(), "seq": seq}))
            os.replace(tmp, p)
        except OSError as err:
            why = f"{errno.errorcode.get(err.errno or -1, 'OSError')}: {err.strerror or err}"
            if why != self.cursor_error:
                log.warning("kmsg_cursor_not_saved", extra={"path": str(p), "error": why, "seq": seq})
            self.cursor_error = why
            return
        self.cursor_error = None

    def _settled_through(self, last_seq: int | None) -> int | None:
        """The highest SEQ the cursor may take: just before the first record with an event still
        in memory (not yet published or spooled), else `last_seq`."""
        while self._unsettled and self._unsettled[0][1].done():
            self._unsettled.popleft()
        if self._unsettled:
            return self._unsettled[0][0] - 1
        return last_seq

    # ------------------------------------------------------------------ run

    async def run(self, emit: Emit) -> None:
        """Read until cancelled (or, for a file with follow=False, until its end); `await emit(event)` each."""
        try:
            mode = self.source.stat().st_mode
        except OSError as err:
            raise FileNotFoundError(f"kmsg source {self.source} not readable: {err}") from err
        if stat.S_ISCHR(mode):
            await self._run_kmsg(emit)
        else:
            await self._run_file(emit)

    async def _emit_all(self, emit: Emit, events: list[FaultEvent], origins: bool = False) -> None:
        for ev in events:
            fut = await emit(ev)
            if origins and isinstance(fut, asyncio.Future) and not fut.done():
                origin = self._origin_of.get(ev.event_id, self._cur_seq)
                if origin is not None:
                    self._unsettled.append((origin, fut))

    async def _run_kmsg(self, emit: Emit) -> None:
        fd = os.open(self.source, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
        loop = asyncio.get_running_loop()
        scope = f"kmsg|{self.cluster}|{self.node}|{_boot_id()}"
        def event_id_for(origin: int, n: int) -> str:
            eid = kmsg_event_id(scope, origin, n)
            self._origin_of[eid] = origin
            return eid

        self.parser.event_id_for = event_id_for
        boot_id, cursor = self._load_cursor()
        skip_upto: int | None = None
        if cursor is not None and boot_id == _boot_id():
            _seek(fd, os.SEEK_SET)
            skip_upto = cursor
        elif cursor is not None:
            _seek(fd, os.SEEK_SET)  # new boot: read this boot's buffer from its oldest record
        else:
            _seek(fd, os.SEEK_END)
        last_seq: int | None = cursor if skip_upto is not None else None
        try:
            while True:
                try:
                    data = os.read(fd, KMSG_READ_BYTES)
                except BlockingIOError:
                    await self._emit_all(emit, self.parser.flush(), origins=True)
                    self._origin_of.clear()
                    saved = self._settled_through(last_seq)
                    self._save_cursor(saved)
                    readable: asyncio.Future[None] = loop.create_future()

                    def wake(fut: asyncio.Future[None] = readable) -> None:
                        if not fut.done():
                            fut.set_result(None)

                    loop.add_reader(fd, wake)
                    try:
                        # Wake for new records, or to move the cursor once queued events settle.
                        while not readable.done():
                            waits: list[asyncio.Future[Any]] = [readable]
                            if self._unsettled:
                                waits.append(self._unsettled[0][1])
                            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                            now = self._settled_through(last_seq)
                            if now != saved:
                                self._save_cursor(now)
                                saved = now
                    finally:
                        loop.remove_reader(fd)
                    continue
                except OSError as err:
                    if err.errno == errno.EPIPE:
                        self.records_lost += 1
                        log.warning("kmsg_records_lost", extra={"reason": "ring buffer overwrote unread records"})
                        continue
                    raise
                if not data:
                    # EOF: /dev/kmsg never returns it (it blocks or raises EAGAIN); another character
                    # device (e.g. /dev/null given as --kmsg-file) does. End instead of spinning.
                    await self._emit_all(emit, self.parser.flush(), origins=True)
                    if self._unsettled:
                        await asyncio.gather(*(f for _o, f in self._unsettled))
                    self._save_cursor(self._settled_through(last_seq))
                    return
                text = data.decode("utf-8", "replace")
                head = text.split(";", 1)[0].split(",")
                seq = int(head[1]) if len(head) >= 3 and head[1].isdigit() else None
                if seq is not None:
                    if skip_upto is not None and seq <= skip_upto:
                        continue
                    if last_seq is not None and seq > last_seq + 1:
                        self.records_lost += seq - last_seq - 1
                        log.warning("kmsg_records_lost", extra={"missing": seq - last_seq - 1})
                    skip_upto = None
                    last_seq = seq
                self._cur_seq = seq
                for line in text.split("\n"):
                    if line:
                        await self._emit_all(emit, self.parser.feed(line, origin=seq), origins=True)
        finally:
            os.close(fd)

    async def _run_file(self, emit: Emit) -> None:
        pos = 0  # bytes read so far
        buf = b""  # an incomplete last line
        scope = file_scope(self.source, self.cluster, self.node)
        self.parser.event_id_for = lambda origin, n: kmsg_event_id(scope, origin, n)
        while True:
            size = self.source.stat().st_size
            if size < pos:  # truncated or replaced: start over, as a new input
                pos, buf = 0, b""
                scope = file_scope(self.source, self.cluster, self.node)
            if size > pos:
                with self.source.open("rb") as f:
                    f.seek(pos)
                    chunk = f.read()
                start = pos - len(buf)  # file offset of buf's first byte
                pos += len(chunk)
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    text = line.decode("utf-8", "replace")
                    await self._emit_all(emit, self.parser.feed(text, origin=start))
                    start += len(line) + 1
            if not self.follow:
                if buf:
                    await self._emit_all(emit, self.parser.feed(buf.decode("utf-8", "replace"), origin=pos - len(buf)))
                await self._emit_all(emit, self.parser.flush())
                return
            await self._emit_all(emit, self.parser.flush())
            await asyncio.sleep(FILE_POLL_S)
