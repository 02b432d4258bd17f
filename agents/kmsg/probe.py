"""`KmsgProbe`: reads /dev/kmsg (or replays a file) through `KmsgParser` and emits `FaultEvent`s."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path

from agents.kmsg.parser import KmsgParser
from fleetmend.catalog import Catalog
from fleetmend.events import FaultEvent

log = logging.getLogger(__name__)

Emit = Callable[[FaultEvent], Awaitable[None]]

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
        - The cursor is written only after the parser was flushed and its events were emitted, so a
          crash between emit and cursor write repeats those events (at-least-once; the router and
          workflow dedupe by fault key).
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
        p = self.cursor_path
        if p is None or seq is None:
            return
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps({"boot_id": _boot_id(), "seq": seq}))
        os.replace(tmp, p)

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

    async def _emit_all(self, emit: Emit, events: list[FaultEvent]) -> None:
        for ev in events:
            await emit(ev)

    async def _run_kmsg(self, emit: Emit) -> None:
        fd = os.open(self.source, os.O_RDONLY | os.O_NONBLOCK)
        loop = asyncio.get_running_loop()
        boot_id, cursor = self._load_cursor()
        skip_upto: int | None = None
        if cursor is not None and boot_id == _boot_id():
            os.lseek(fd, 0, os.SEEK_SET)
            skip_upto = cursor
        elif cursor is not None:
            os.lseek(fd, 0, os.SEEK_SET)  # new boot: read this boot's buffer from its oldest record
        else:
            os.lseek(fd, 0, os.SEEK_END)
        last_seq: int | None = cursor if skip_upto is not None else None
        try:
            while True:
                try:
                    data = os.read(fd, KMSG_READ_BYTES)
                except BlockingIOError:
                    await self._emit_all(emit, self.parser.flush())
                    self._save_cursor(last_seq)
                    fut: asyncio.Future[None] = loop.create_future()
                    loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
                    try:
                        await fut
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
                    await self._emit_all(emit, self.parser.flush())
                    self._save_cursor(last_seq)
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
                for line in text.split("\n"):
                    if line:
                        await self._emit_all(emit, self.parser.feed(line))
        finally:
            os.close(fd)

    async def _run_file(self, emit: Emit) -> None:
        pos = 0
        buf = ""
        while True:
            size = self.source.stat().st_size
            if size < pos:  # truncated or replaced: start over
                pos, buf = 0, ""
            if size > pos:
                with self.source.open("rb") as f:
                    f.seek(pos)
                    chunk = f.read()
                pos += len(chunk)
                buf += chunk.decode("utf-8", "replace")
                *lines, buf = buf.split("\n")
                for line in lines:
                    await self._emit_all(emit, self.parser.feed(line))
            if not self.follow:
                if buf:
                    await self._emit_all(emit, self.parser.feed(buf))
                await self._emit_all(emit, self.parser.flush())
                return
            await self._emit_all(emit, self.parser.flush())
            await asyncio.sleep(FILE_POLL_S)
