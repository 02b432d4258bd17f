"""Crashes that survived a reboot: read once at agent start, published once, never again.

A node that panicked comes back with a new boot and an empty kernel ring buffer; what the crash
printed survives only in:

- **pstore** (`/sys/fs/pstore`): the kernel's kmsg dumper writes the tail of the log at panic/oops
  time into persistent storage (fs/pstore/platform.c `pstore_dump`). Each file is one part of one
  dump, named `dmesg-<backend>-<id>` (`dmesg-efi-…`, `dmesg-efi_pstore-…`, `dmesg-ramoops-N`, `dmesg-erst-…`),
  its first line the header `"%s#%d Part%u\\n"` (reason, dump count in that boot, part), e.g.
  `Panic#1 Part1`. Part 1 holds the newest lines (the dumper copies from the end of the log
  backwards), so a dump reads in descending part order. A record the kernel could not decompress
  keeps its compressed bytes and the suffix `.enc.z` (fs/pstore/inode.c); the compressor is
  deflate (fs/pstore/platform.c, zlib without header since 6.6, the crypto API's raw deflate before).
  The inode's mtime is the dump's time. Lines carry `<level>` and `[uptime]` prefixes.
- **systemd-pstore's archive** (`/var/lib/systemd/pstore/<id>/dmesg.txt`): systemd-pstore.service
  moves the pstore files there at boot and joins the parts of one dump into `dmesg.txt`, each part
  preceded by a `dmesg-<backend>-<id>:` line (systemd src/pstore/pstore.c `process_dmesg_files`).
- **kdump** (`/var/crash/<dir>/vmcore-dmesg.txt`, the kernel log extracted from the vmcore by
  `vmcore-dmesg` / makedumpfile; RHEL names the directory `<ip>-YYYY-MM-DD-HH:MM:SS`; Debian's
  kdump-tools writes `/var/crash/<YYYYmmddHHMM>/dmesg.<YYYYmmddHHMM>`).
- **journald** (`journalctl -k -b -1 -o export`, when the journal is persistent): the previous boot's
  kernel messages in the export format (systemd docs JOURNAL_EXPORT_FORMATS: `FIELD=value` lines,
  binary fields as `FIELD\\n<le64 size><bytes>\\n`, entries separated by an empty line). A panic in
  interrupt context rarely reaches the disk, an oops or a panic in process context often does.

Each dump is parsed by the kernel-log parser (`agents.kmsg.KmsgParser`); the crash (kernel_panic,
oops, hard lockup) and the fault that caused it (a GHES or MCE record, an XID before the panic) become
one `kernel_panic_previous_boot` event with the reason, the module named in the oops
(`RIP: …+0x…/0x… [module]`, else the first `[module]` frame of the call trace), `Modules linked in`,
the boot id of the crashed boot where known and the crash time. An identity per dump (its source
and file names or boot id) and a signature of the crash itself (its `[uptime]` stamp and head line,
so the same panic found in pstore and in kdump is one event) are kept in `lastboot.json` in the
agent's state directory once the event was handed to the publisher; a later start skips them.

A boot whose id (`/proc/sys/kernel/random/boot_id`) differs from the one the agent recorded, with
neither a clean agent stop (SIGTERM, the way systemd stops services at shutdown) nor a reboot that
fleetmend ordered (the recovery handler records it before running the reboot command) recorded for
that boot, is an `unexpected_reboot` event, unless a crash of that boot was published (then the
crash event is the primary and carries `unexpected_reboot=True`).

Everything runs once, in a worker thread, at start; nothing stays in memory afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import json
import logging
import os
import re
import subprocess
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

from agents.kmsg.parser import KmsgParser
from agents.nvml import trim_heap
from fleetmend.catalog import Catalog, default_catalog
from fleetmend.events import Component, Device, FaultEvent, Severity, Source, utcnow

log = logging.getLogger(__name__)

STATE_FILE = "lastboot.json"
PUBLISHED_KEEP = 512
"""Identities kept in the state file (newest first); a node crashes far less often than that."""
JOURNAL_LINES = 3000
"""Kernel journal entries read from the end of the previous boot: an oops with its trace is ~100
lines, a panic the last lines of the boot; 3,000 bound the work on a boot that logged millions."""
JOURNAL_TIMEOUT_S = 60.0
CONTEXT_LINES = 600
"""Lines of context kept before a panic line found in a stream (the oops that led to it)."""
READ_MAX_BYTES = 1024 * 1024
"""A dump file larger than this is read from its last 1 MiB (~12,000 lines; a vmcore-dmesg.txt holds the
whole log buffer, up to 2^25 bytes): the crash and what led to it are at the end."""

JournalOpener = Callable[[], contextlib.AbstractContextManager[IO[bytes]]]
"""Returns a context manager yielding a binary stream in journald's export format."""

_PSTORE_HEADER = re.compile(r"^(?P<reason>[A-Z][A-Za-z]+)#(?P<count>\d+) Part(?P<part>\d+)\s*$")
_ARCHIVE_PART = re.compile(r"^dmesg-[\w.-]+:\s*$")
_PANIC = re.compile(r"Kernel panic - not syncing: ?(?P<reason>.*?)\s*$")
_PANIC_END = re.compile(r"---\[ end Kernel panic")
_RIP_MODULE = re.compile(r"\b(?:RIP|pc|PC is at|epc)\s*:?\s*(?:[0-9a-f]{4}:)?(?:\[<[0-9a-f]+>\]\s*)*"
                         r"(?:\[<[0-9a-f]+>\]\s*)?(?P<fn>[\w.$]+)\+0x[0-9a-f]+/0x[0-9a-f]+\s*\[(?P<mod>[\w-]+)\]")
_RIP_ANY = re.compile(r"\bRIP: (?:[0-9a-f]{4}:)?(?:\[<[0-9a-f]+>\]\s*)*(?P<fn>[\w.$]+)\+0x")
_FRAME_MODULE = re.compile(r"^\s*(?:\?\s*)?(?:\[<[0-9a-f]+>\]\s*(?:\?\s*)?)?(?P<fn>[\w.$]+)\+0x[0-9a-f]+/0x[0-9a-f]+"
                           r"\s*\[(?P<mod>[\w-]+)\]")
_MODULES = re.compile(r"Modules linked in:\s*(?P<mods>.*)$")
_TAINT = re.compile(r"\b(?:Tainted: (?P<t>[A-Z ]*[A-Z])\s+(?=[\d-])|Not tainted)")
_UPTIME = re.compile(r"^\s*(?:<\d{1,3}>)?\[\s*(?P<ts>\d+\.\d+)\]\s?(?P<msg>.*)$")
_LEVEL = re.compile(r"^<\d{1,3}>")
_RHEL_DIR = re.compile(r"(?P<d>\d{4}-\d\d-\d\d)-(?P<t>\d\d:\d\d:\d\d)$")
_DEBIAN_DIR = re.compile(r"^(?P<s>\d{12})$")

CRASH_KINDS = frozenset({"kernel_panic", "oops", "hard_lockup"})
"""Parser kinds that end (or doom) a boot. A soft lockup or hung task alone does not."""
NOT_A_CRASH = frozenset({"Shutdown", "Restart", "Halt", "Poweroff"})
"""pstore dump reasons written at a clean shutdown when `printk.always_kmsg_dump` is set
(kmsg_dump_reason_str): proof of an orderly end, not a crash."""


# ------------------------------------------------------------------------------------ state file

_state_lock = threading.Lock()


def state_path(agent_state_dir: Path) -> Path:
    """`<agent state dir>/lastboot.json`."""
    return Path(agent_state_dir) / STATE_FILE


def _load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        log.warning("lastboot_state_unreadable", extra={"path": str(path), "error": repr(err)})
        return {}


def _save(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _update(agent_state_dir: Path, fn: Callable[[dict[str, Any]], None]) -> None:
    path = state_path(agent_state_dir)
    with _state_lock:
        data = _load(path)
        fn(data)
        _save(path, data)


def record_clean_stop(agent_state_dir: Path, host_root: Path = Path("/")) -> None:
    """Note that the agent stopped cleanly (SIGTERM/SIGINT or `stop`) in the boot it recorded at
    start: a reboot after this is an orderly one. Nothing is noted when the recorded boot is not the
    running one (stopped before the start-time read finished). Raises OSError when the state dir is
    unwritable."""
    current = read_boot_id(Path(host_root))

    def fn(data: dict[str, Any]) -> None:
        boot = data.setdefault("boot", {})
        if boot.get("boot_id") == current:
            boot["clean_stop_at"] = utcnow().isoformat()
    _update(agent_state_dir, fn)


def record_reboot_ordered(agent_state_dir: Path, incident_id: str | None = None) -> None:
    """Note that fleetmend ordered this node's reboot (called by the recovery handler right before
    it runs the reboot command). Raises OSError when the state dir is unwritable."""
    def fn(data: dict[str, Any]) -> None:
        boot = data.setdefault("boot", {})
        boot["reboot_ordered_at"] = utcnow().isoformat()
        boot["reboot_incident"] = incident_id
    _update(agent_state_dir, fn)


# ------------------------------------------------------------------------------------ host facts

def read_boot_id(host_root: Path) -> str | None:
    """The running boot's id (`<root>/proc/sys/kernel/random/boot_id`, a UUID), or None."""
    try:
        return _norm_boot_id((host_root / "proc/sys/kernel/random/boot_id").read_text())
    except OSError:
        return None


def read_boot_time(host_root: Path) -> datetime | None:
    """When the running boot started (`btime` in `<root>/proc/stat`, epoch seconds), or None."""
    try:
        with (host_root / "proc/stat").open() as f:
            for line in f:
                if line.startswith("btime "):
                    return datetime.fromtimestamp(int(line.split()[1]), timezone.utc)
    except (OSError, ValueError, IndexError):
        return None
    return None


def _norm_boot_id(text: str | None) -> str | None:
    """`_BOOT_ID=7b0c…` (journald, 32 hex) and `7b0c…-…` (procfs) -> the dashed lower-case UUID."""
    if not text:
        return None
    h = text.strip().lower().replace("-", "")
    if not re.fullmatch(r"[0-9a-f]{32}", h):
        return None
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


# ------------------------------------------------------------------------------------ dumps

@dataclass
class Dump:
    """One crash dump's text as read from one source.

    source: "pstore", "pstore-archive", "kdump" or "journal"; identity: stable per dump (source + file
    names + size, or the boot id for the journal); lines: the kernel log lines, oldest first, with
    their `<level>` / `[uptime]` prefixes kept; reason: the pstore dump reason (Panic, Oops, ...) where
    the record has one; crashed_at: when the dump was written (pstore mtime, kdump directory name,
    journal timestamp); boot_id: the crashed boot's id where the source names it (journal);
    paths: files read.
    """

    source: str
    identity: str
    lines: list[str]
    reason: str | None = None
    crashed_at: datetime | None = None
    boot_id: str | None = None
    paths: list[str] = field(default_factory=list)


def _read_text(path: Path) -> str:
    """The file's text, or its last `READ_MAX_BYTES` from the first whole line on."""
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        cut = size > READ_MAX_BYTES
        if cut:
            f.seek(size - READ_MAX_BYTES)
        data = f.read(READ_MAX_BYTES)
    if cut:
        data = data[data.find(b"\n") + 1:]
    return data.decode("utf-8", "replace")


def _inflate(data: bytes) -> bytes:
    """Decompress a pstore `.enc.z` record: raw deflate (kernel crypto API / zlib without header),
    zlib or gzip framing. Raises zlib.error when none applies (lzo, lz4, zstd, 842 backends)."""
    last: zlib.error | None = None
    for wbits in (-15, 15, 31):
        try:
            return zlib.decompressobj(wbits).decompress(data, READ_MAX_BYTES)
        except zlib.error as err:
            last = err
    assert last is not None
    raise last


def _mtime(path: Path) -> datetime | None:
    try:
        return datetime.fromtimestamp(path.stat().st_mtime, timezone.utc)
    except OSError:
        return None


def read_pstore(directory: Path, errors: list[str]) -> list[Dump]:
    """Dumps in a pstore mount: `dmesg-*` files grouped by (backend, reason, count, time within
    60 s), parts joined newest-part-last. Unreadable/undecodable files are reported in `errors`."""
    try:
        names = sorted(p for p in directory.iterdir() if p.name.startswith("dmesg-"))
    except FileNotFoundError:
        return []
    except OSError as err:
        errors.append(f"{directory}: {err}")
        return []
    parts: list[tuple[str, str, int, int, datetime | None, Path, list[str]]] = []
    for p in names:
        try:
            raw = p.read_bytes()[-READ_MAX_BYTES:]
            if p.name.endswith(".enc.z"):
                raw = _inflate(raw)
        except (OSError, zlib.error) as err:
            errors.append(f"{p}: {'cannot decompress (not deflate)' if isinstance(err, zlib.error) else err}")
            continue
        lines = raw.decode("utf-8", "replace").splitlines()
        backend = p.name[len("dmesg-"):].rsplit("-", 1)[0]
        m = _PSTORE_HEADER.match(lines[0]) if lines else None
        reason, count, part = (m["reason"], int(m["count"]), int(m["part"])) if m else ("Unknown", 0, 1)
        parts.append((backend, reason, count, part, _mtime(p), p, lines[1:] if m else lines))
    groups: list[list[tuple[str, str, int, int, datetime | None, Path, list[str]]]] = []
    for item in sorted(parts, key=lambda x: (x[0], x[1], x[2], x[4] or datetime.min.replace(tzinfo=timezone.utc))):
        g = groups[-1] if groups else None
        if (g and g[0][:3] == item[:3] and item[3] not in {x[3] for x in g}
                and (item[4] is None or g[0][4] is None or abs((item[4] - g[0][4]).total_seconds()) <= 60)):
            g.append(item)
        else:
            groups.append([item])
    dumps: list[Dump] = []
    for g in groups:
        g.sort(key=lambda x: -x[3])  # Part N (oldest) ... Part 1 (newest)
        lines = [ln for x in g for ln in x[6]]
        ident = "pstore:" + ",".join(sorted(f"{x[5].name}:{x[5].stat().st_size}" for x in g))
        dumps.append(Dump(source="pstore", identity=ident, lines=lines, reason=g[0][1],
                          crashed_at=max((x[4] for x in g if x[4]), default=None), paths=[str(x[5]) for x in g]))
    return dumps


def read_pstore_archive(directory: Path, errors: list[str]) -> list[Dump]:
    """systemd-pstore's `<dir>/<id>/dmesg.txt` files: part separators and part headers dropped; the
    time from an efi/erst record id in a separator (the file itself is written at the next boot)."""
    out: list[Dump] = []
    try:
        files = sorted(directory.glob("*/dmesg.txt"))
    except OSError as err:
        errors.append(f"{directory}: {err}")
        return out
    for p in files:
        try:
            text = _read_text(p)
        except OSError as err:
            errors.append(f"{p}: {err}")
            continue
        reason = None
        at: datetime | None = None
        lines: list[str] = []
        for ln in text.splitlines():
            if _ARCHIVE_PART.match(ln):
                at = at or _efi_id_time(ln.rstrip(":\n ").rsplit("-", 1)[-1])
                continue
            m = _PSTORE_HEADER.match(ln)
            if m:
                reason = reason or m["reason"]
                continue
            lines.append(ln)
        out.append(Dump(source="pstore-archive", identity=f"pstore-archive:{p.parent.name}:{p.stat().st_size}",
                        lines=lines, reason=reason, crashed_at=at, paths=[str(p)]))
    return out


def _efi_id_time(record_id: str) -> datetime | None:
    """The dump time in an efi/erst record id: `((time * 100 + part) * 1000 + count)` (fs/pstore
    generic_id, efi-pstore); None for other ids (ramoops counts 0, 1, ...)."""
    if not record_id.isdigit() or int(record_id) < 10**14:
        return None
    try:
        return datetime.fromtimestamp(int(record_id) // 100_000, timezone.utc)
    except (OverflowError, ValueError, OSError):
        return None


def _kdump_time(dirname: str, path: Path) -> datetime | None:
    m = _RHEL_DIR.search(dirname)
    try:
        if m:
            return datetime.strptime(f"{m['d']} {m['t']}", "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc)
        m = _DEBIAN_DIR.match(dirname)
        if m:
            return datetime.strptime(m["s"], "%Y%m%d%H%M").replace(tzinfo=timezone.utc)
    except ValueError:
        pass
    return _mtime(path)


def read_kdump(directory: Path, errors: list[str]) -> list[Dump]:
    """kdump's kernel logs: `<dir>/*/vmcore-dmesg.txt` (kexec-tools) and `<dir>/*/dmesg.*`
    (kdump-tools). The directory name's time is taken as the local-time-agnostic crash time (UTC
    when the name has no zone), else the file's mtime."""
    out: list[Dump] = []
    try:
        files = sorted([*directory.glob("*/vmcore-dmesg.txt"), *directory.glob("*/dmesg.[0-9]*")])
    except OSError as err:
        errors.append(f"{directory}: {err}")
        return out
    for p in files:
        try:
            text = _read_text(p)
        except OSError as err:
            errors.append(f"{p}: {err}")
            continue
        out.append(Dump(source="kdump", identity=f"kdump:{p.parent.name}/{p.name}:{p.stat().st_size}",
                        lines=text.splitlines(), crashed_at=_kdump_time(p.parent.name, p), paths=[str(p)]))
    return out


def journal_entries(stream: IO[bytes]) -> Iterator[dict[str, bytes]]:
    """Entries of a journal export stream (JOURNAL_EXPORT_FORMATS): dict field -> raw value bytes.
    Text fields are `KEY=value\\n`; binary-safe fields `KEY\\n` + little-endian u64 size + data + `\\n`;
    an empty line ends an entry. A truncated stream ends the iteration (the partial entry is kept)."""
    entry: dict[str, bytes] = {}
    while True:
        line = stream.readline()
        if not line:
            if entry:
                yield entry
            return
        if line == b"\n":
            if entry:
                yield entry
            entry = {}
            continue
        line = line[:-1] if line.endswith(b"\n") else line
        key, eq, value = line.partition(b"=")
        if eq:
            entry[key.decode("ascii", "replace")] = value
            continue
        size_b = stream.read(8)
        if len(size_b) < 8:
            if entry:
                yield entry
            return
        size = int.from_bytes(size_b, "little")
        data = stream.read(size)
        stream.read(1)  # the newline after the data
        entry[key.decode("ascii", "replace")] = data


def journalctl_export(host_root: Path, lines: int = JOURNAL_LINES,
                      timeout_s: float = JOURNAL_TIMEOUT_S) -> JournalOpener:
    """The production journal opener: `journalctl -k -b -1 -o export -n LINES --no-pager` (with
    `-D <root>/var/log/journal` when the host root is not `/`). Raises FileNotFoundError when
    journalctl is not installed; the stream ends early (and the process is killed) after `timeout_s`."""

    @contextlib.contextmanager
    def opener() -> Iterator[IO[bytes]]:
        argv = ["journalctl", "-k", "-b", "-1", "-o", "export", "-n", str(lines), "--no-pager", "-q"]
        if Path(host_root).resolve() != Path("/"):
            argv += ["-D", str(Path(host_root) / "var/log/journal")]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        timer = threading.Timer(timeout_s, proc.kill)
        timer.start()
        try:
            assert proc.stdout is not None
            yield proc.stdout
        finally:
            timer.cancel()
            with contextlib.suppress(Exception):
                proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()

    return opener


@dataclass
class JournalTail:
    """What the previous boot's kernel journal says: its boot id, its last entry's time, the panic
    (as a `Dump`) if one was logged, else the last crash-like fault seen (kind, message)."""

    boot_id: str | None = None
    last_at: datetime | None = None
    dump: Dump | None = None
    last_fault: tuple[str, str] | None = None
    entries: int = 0


def read_journal(opener: JournalOpener, parser: KmsgParser) -> JournalTail:
    """Stream the export from `opener` through `parser`, keeping `CONTEXT_LINES` of context; the last
    panic found becomes `dump` (its lines: the context before it and what followed)."""
    tail = JournalTail()
    ring: deque[str] = deque(maxlen=CONTEXT_LINES)
    panic_lines: list[str] | None = None
    panic_at: datetime | None = None
    after = 0
    with opener() as stream:
        for entry in journal_entries(stream):
            tail.entries += 1
            msg = entry.get("MESSAGE")
            if msg is None:
                continue
            boot = _norm_boot_id(entry.get("_BOOT_ID", b"").decode("ascii", "replace"))
            tail.boot_id = boot or tail.boot_id
            at = _usec_time(entry.get("__REALTIME_TIMESTAMP"))
            tail.last_at = at or tail.last_at
            mono = entry.get("_SOURCE_MONOTONIC_TIMESTAMP") or entry.get("__MONOTONIC_TIMESTAMP")
            prefix = ""
            if mono and mono.isdigit():
                us = int(mono)
                prefix = f"[{us // 1_000_000:5d}.{us % 1_000_000:06d}] "
            for text in msg.decode("utf-8", "replace").split("\n"):
                line = prefix + text
                ring.append(line)
                for ev in parser.feed(line):
                    if ev.kind in CRASH_KINDS:
                        tail.last_fault = (ev.kind, ev.message)
                if panic_lines is not None:
                    panic_lines.append(line)
                    after += 1
                if _PANIC.search(text) and not _PANIC_END.search(text):
                    panic_lines, panic_at, after = list(ring), at, 0
            if panic_lines is not None and after > 100:
                panic_lines = panic_lines[:CONTEXT_LINES + 100]
    for ev in parser.flush():
        if ev.kind in CRASH_KINDS:
            tail.last_fault = (ev.kind, ev.message)
    if panic_lines is not None:
        tail.dump = Dump(source="journal", identity=f"journal:{tail.boot_id}", lines=panic_lines,
                         crashed_at=panic_at, boot_id=tail.boot_id, reason="Panic")
    return tail


BOOT_SLACK_S = 300.0
"""Clock slack when placing a dump in a boot: kdump names its directory in local time, an RTC drifts."""


def _in_boot(at: datetime | None, started: str | None, ended_by: datetime | None) -> bool:
    """Whether a dump written at `at` belongs to the boot that started at `started` (ISO) and ended
    before `ended_by` (the running boot's start). Unknown times do not exclude it."""
    if at is None:
        return True
    if ended_by is not None and (at - ended_by).total_seconds() > BOOT_SLACK_S:
        return False
    if started:
        try:
            if (datetime.fromisoformat(started) - at).total_seconds() > BOOT_SLACK_S:
                return False
        except ValueError:
            pass
    return True


def _usec_time(value: bytes | None) -> datetime | None:
    if not value or not value.isdigit():
        return None
    return datetime.fromtimestamp(int(value) / 1e6, timezone.utc)


# ------------------------------------------------------------------------------------ analysis

@dataclass
class Crash:
    """What one dump says about the crash: the primary event (the cause, from the parser), the panic
    reason, the module, `Modules linked in`, the signature used to recognise the same crash in another
    source, and the raw lines of the crash record."""

    event: FaultEvent
    crash_kind: str
    panic_reason: str | None
    module: str | None
    function: str | None
    modules_linked_in: str | None
    tainted: str | None
    signature: str
    raw: str


CAUSE_WINDOW_S = 60.0
"""A fatal fault is taken as the crash's cause when it was logged within 60 s before it (a GHES or MCE
record precedes its panic by milliseconds; an XID an hour earlier is another story)."""


def _close_in_time(a: FaultEvent, b: FaultEvent) -> bool:
    try:
        return abs(float(str(b.attrs["kernel_time"])) - float(str(a.attrs["kernel_time"]))) <= CAUSE_WINDOW_S
    except (KeyError, ValueError):
        return True  # no comparable kernel stamps (syslog or none): adjacent in the dump is close enough


def _facts(lines: list[str]) -> dict[str, str | None]:
    """Panic reason (and its uptime stamp), the module and function of the first `RIP: …[module]`
    (else of the first `[module]` call-trace frame), `Modules linked in` and the taint flags."""
    reason = panic_ts = module = function = modules = tainted = None
    first_frame_mod: tuple[str, str] | None = None
    for ln in lines:
        text = _LEVEL.sub("", ln)
        um = _UPTIME.match(text)
        msg = um["msg"] if um else text
        m = _PANIC.search(msg)
        if m and not _PANIC_END.search(msg):
            reason = m["reason"]
            panic_ts = um["ts"] if um else None
            continue
        m = _RIP_MODULE.search(msg)
        if m and module is None:
            module, function = m["mod"], m["fn"]
            continue
        if function is None:
            m = _RIP_ANY.search(msg)
            if m and not msg.rstrip().endswith("]") and "RIP: 0033" not in msg:
                function = m["fn"]
        m = _FRAME_MODULE.match(msg)
        if m and first_frame_mod is None:
            first_frame_mod = (m["mod"], m["fn"])
        m = _MODULES.search(msg)
        if m and modules is None:
            modules = m["mods"].strip()
        m = _TAINT.search(msg)
        if m and tainted is None:
            tainted = " ".join((m["t"] or "").split()) or "not tainted"
    if module is None and first_frame_mod is not None:
        module, function = first_frame_mod[0], function or first_frame_mod[1]
    return {"reason": reason, "panic_ts": panic_ts, "module": module, "function": function,
            "modules": modules, "tainted": tainted}


def analyse(dump: Dump, parser: KmsgParser) -> Crash | None:
    """Parse a dump; None when it holds no crash (a clean-shutdown dump, or a log without one)."""
    events: list[FaultEvent] = []
    for ln in dump.lines:
        events.extend(parser.feed(ln))
    events.extend(parser.flush())
    crash_idx = [i for i, e in enumerate(events) if e.kind in CRASH_KINDS
                 and not str(e.attrs.get("panic_reason", "")).endswith("]---")]
    panic_idx = [i for i, e in enumerate(events) if "panic_reason" in e.attrs
                 and not str(e.attrs["panic_reason"]).endswith("]---")]
    if not crash_idx and not panic_idx:
        return None
    main_i = panic_idx[-1] if panic_idx else crash_idx[-1]
    main = events[main_i]
    # The cause: a fatal hardware/driver fault just before the crash in the same dump (GHES, MCE,
    # XID, AER fatal), else the crash itself.
    cause = main
    for e in reversed(events[:main_i]):
        if e.kind in CRASH_KINDS or e.kind in ("soft_lockup", "hung_task"):
            continue
        if e.severity is Severity.FATAL and not e.healthy and _close_in_time(e, main):
            cause = e
        break
    # The oops that led to the panic (module, process) is the crash record before it when the
    # parser kept them apart.
    oops = next((events[i] for i in reversed(crash_idx) if i <= main_i and events[i].kind != "kernel_panic"), None)
    crash_ev = oops or main
    # Module, function, modules and taint from the crash record's own lines first (a dump's tail may
    # hold an earlier WARNING with its own RIP), then from the whole dump.
    facts = _facts(crash_ev.raw.splitlines())
    whole = _facts(dump.lines)
    if facts["module"] is None and facts["function"] is None:
        facts["module"], facts["function"] = whole["module"], whole["function"]
    for k in ("reason", "panic_ts", "modules", "tainted"):
        if facts[k] is None:
            facts[k] = whole[k]
    reason, panic_line_ts = facts["reason"], facts["panic_ts"]
    module, function = facts["module"], facts["function"]
    modules, tainted = facts["modules"], facts["tainted"]
    head_line = crash_ev.raw.splitlines()[0] if crash_ev.raw else crash_ev.message
    hm = _UPTIME.match(_LEVEL.sub("", head_line))
    head_ts = hm["ts"] if hm else panic_line_ts
    head_msg = (hm["msg"] if hm else head_line).strip()
    signature = hashlib.sha256(f"{head_ts}|{head_msg[:120]}|{reason}".encode()).hexdigest()[:32]
    raw_lines = [ln for i in sorted({i for i in (*crash_idx, main_i) if i <= main_i}) for ln in events[i].raw.splitlines()]
    if cause is not main:
        raw_lines = cause.raw.splitlines() + raw_lines
    return Crash(event=cause, crash_kind=crash_ev.kind if oops else main.kind, panic_reason=reason,
                 module=module, function=function, modules_linked_in=modules, tainted=tainted,
                 signature=signature, raw="\n".join(raw_lines))


# ------------------------------------------------------------------------------------ the probe

class LastBootProbe:
    """Reads what survived the previous boot once at start (`name = "lastboot"`) and returns.

    Args:
        host_root: the host's `/` as this process sees it (`agent.host_root`): `proc/`, `sys/fs/pstore`,
            `var/lib/systemd/pstore`, `var/crash` and `var/log/journal` are read under it.
        state_dir: the agent's state directory (`lastboot.json` lives there).
        cluster, node, agent_version, catalog: stamped on / used to classify the events.
        journal: opener of the previous boot's kernel journal in export format; default
            `journalctl_export(host_root)`; None leaves the journal out.
    Emits:
        `kernel_panic_previous_boot` per crash not published before (component/device of the fault
        that caused it), `unexpected_reboot` when the boot changed without a clean stop or an ordered
        reboot and no crash of that boot was published. Read errors are logged
        (`lastboot_unreadable`, with the files) and named on the events (`unreadable`); never raised.
    """

    name = "lastboot"

    def __init__(self, host_root: Path, state_dir: Path, *, cluster: str, node: str, agent_version: str = "unknown",
                 catalog: Catalog | None = None, journal: JournalOpener | None | str = "default") -> None:
        self.host_root = Path(host_root)
        self.state_dir = Path(state_dir)
        self.cluster, self.node, self.agent_version = cluster, node, agent_version
        self.catalog = catalog or default_catalog()
        self.journal: JournalOpener | None = (journalctl_export(self.host_root) if journal == "default"
                                              else journal)  # type: ignore[assignment]

    def _parser(self) -> KmsgParser:
        return KmsgParser(self.cluster, self.node, self.agent_version, catalog=self.catalog)

    async def run(self, emit: Any) -> None:
        t0 = time.monotonic()
        events, commit = await asyncio.to_thread(self.collect)
        log.info("lastboot_read", extra={"events": [e.kind for e in events],
                                         "duration_s": round(time.monotonic() - t0, 3)})
        for ev in events:
            await emit(ev)
        await asyncio.to_thread(commit)
        del events, commit
        gc.collect()
        trim_heap()  # hand the freed text back to the OS: the agent lives on at its idle size

    def collect(self) -> tuple[list[FaultEvent], Callable[[], None]]:
        """Read every source, decide, and return (events to publish, a function that records them as
        published and this boot as the running one; call it after the events were handed over)."""
        path = state_path(self.state_dir)
        with _state_lock:
            state = _load(path)
        published: dict[str, str] = dict(state.get("published") or {})
        prev: dict[str, Any] = dict(state.get("boot") or {})
        boot_id = read_boot_id(self.host_root)
        boot_time = read_boot_time(self.host_root)
        new_boot = bool(prev.get("boot_id")) and boot_id is not None and prev.get("boot_id") != boot_id
        unexpected = new_boot and not prev.get("clean_stop_at") and not prev.get("reboot_ordered_at")
        errors: list[str] = []
        dumps: list[Dump] = []
        dumps += read_pstore(self.host_root / "sys/fs/pstore", errors)
        dumps += read_pstore_archive(self.host_root / "var/lib/systemd/pstore", errors)
        dumps += read_kdump(self.host_root / "var/crash", errors)
        journal_tail: JournalTail | None = None
        if self.journal is not None and (new_boot or not prev):
            try:
                journal_tail = read_journal(self.journal, self._parser())
                if journal_tail.dump is not None:
                    dumps.append(journal_tail.dump)
            except FileNotFoundError as err:
                log.info("lastboot_journal_unavailable", extra={"error": str(err)})
            except OSError as err:
                errors.append(f"journal: {err}")
        if errors:
            log.warning("lastboot_unreadable", extra={"errors": errors[:20]})
        out: list[FaultEvent] = []
        new_keys: list[str] = []
        seen_sig: dict[str, FaultEvent] = {}
        crashed_prev_boot = False
        for dump in dumps:
            if dump.identity in published:
                continue
            new_keys.append(dump.identity)
            if dump.reason in NOT_A_CRASH:
                log.info("lastboot_clean_dump", extra={"source": dump.source, "reason": dump.reason,
                                                       "paths": dump.paths})
                continue
            crash = analyse(dump, self._parser())
            dump.lines = []  # free the text as soon as it is read
            if crash is None:
                log.info("lastboot_no_crash_in_dump", extra={"source": dump.source, "paths": dump.paths})
                continue
            sig_key = f"crash:{crash.signature}"
            if sig_key in published:
                continue
            if sig_key in seen_sig:  # the same crash from a second source
                ev = seen_sig[sig_key]
                srcs = f"{ev.attrs['crash_source']},{dump.source}"
                ev.attrs["crash_source"] = srcs
                continue
            new_keys.append(sig_key)
            previous_boot = dump.boot_id or (prev.get("boot_id") if new_boot and _in_boot(
                dump.crashed_at, prev.get("boot_started_at"), boot_time) else None)
            if previous_boot is not None and previous_boot == prev.get("boot_id"):
                crashed_prev_boot = True
            ev = self._crash_event(crash, dump, previous_boot, unexpected and previous_boot == prev.get("boot_id"),
                                   errors)
            seen_sig[sig_key] = ev
            out.append(ev)
        if unexpected and not crashed_prev_boot:
            out.append(self._unexpected_event(prev, boot_id, boot_time, journal_tail, errors))

        def commit() -> None:
            def fn(data: dict[str, Any]) -> None:
                pub = dict(data.get("published") or {})
                now = utcnow().isoformat()
                for k in new_keys:
                    pub[k] = now
                keep = sorted(pub.items(), key=lambda kv: kv[1], reverse=True)[:PUBLISHED_KEEP]
                data["published"] = dict(keep)
                data["boot"] = {"boot_id": boot_id, "boot_started_at": boot_time.isoformat() if boot_time else None,
                                "agent_started_at": now, "clean_stop_at": None, "reboot_ordered_at": None,
                                "reboot_incident": None}
                if not new_boot and prev.get("boot_id") == boot_id:
                    # Same boot (the agent restarted): keep an ordered reboot that has not happened yet.
                    data["boot"]["reboot_ordered_at"] = prev.get("reboot_ordered_at")
                    data["boot"]["reboot_incident"] = prev.get("reboot_incident")
            _update(self.state_dir, fn)

        return out, commit

    def _finish(self, draft: FaultEvent) -> FaultEvent:
        return self.catalog.stamp(draft, keep_severity=False)  # classified once, here

    def _crash_event(self, crash: Crash, dump: Dump, previous_boot: str | None, unexpected: bool,
                     errors: list[str]) -> FaultEvent:
        cause = crash.event
        attrs: dict[str, str | int | float | bool | None] = {
            "crash_source": dump.source,
            "crash_kind": crash.crash_kind,
            "dump_reason": dump.reason,
            "panic_reason": crash.panic_reason,
            "module": crash.module,
            "function": crash.function,
            "modules_linked_in": (crash.modules_linked_in or None) and crash.modules_linked_in[:1024],
            "tainted": crash.tainted,
            "previous_boot_id": previous_boot,
            "crashed_at": dump.crashed_at.isoformat() if dump.crashed_at else None,
            "crash_files": ", ".join(dump.paths)[:1024] or None,
        }
        if cause.kind not in CRASH_KINDS:
            attrs["cause_kind"] = cause.kind
            if cause.code is not None:
                attrs["cause_code"] = cause.code
        for k in ("process", "cpu"):
            if k in cause.attrs:
                attrs[k] = cause.attrs[k]
        if unexpected:
            attrs["unexpected_reboot"] = True
        if errors:
            attrs["unreadable"] = "; ".join(errors)[:1024]
        what = crash.panic_reason or (crash.crash_kind.replace("_", " "))
        where = f" in {crash.function} [{crash.module}]" if crash.module and crash.function else (
            f" in [{crash.module}]" if crash.module else "")
        boot = f" (boot {previous_boot[:8]}" if previous_boot else " (an earlier boot"
        when = f", {dump.crashed_at:%Y-%m-%d %H:%M:%S} UTC)" if dump.crashed_at else ")"
        message = f"Crash survived a reboot{boot}{when}: {what}{where}; read from {dump.source}"
        draft = FaultEvent(
            cluster=self.cluster, node=self.node, component=cause.component,
            device=cause.device if cause.kind not in CRASH_KINDS else Device(),
            kind="kernel_panic_previous_boot", severity=Severity.FATAL, message=message[:4000],
            source=Source.KMSG, raw=crash.raw, agent_version=self.agent_version, pid=cause.pid,
            attrs={k: v for k, v in attrs.items() if v is not None},
        )
        return self._finish(draft)

    def _unexpected_event(self, prev: dict[str, Any], boot_id: str | None, boot_time: datetime | None,
                          journal: JournalTail | None, errors: list[str]) -> FaultEvent:
        attrs: dict[str, str | int | float | bool | None] = {
            "previous_boot_id": prev.get("boot_id"),
            "boot_id": boot_id,
            "previous_boot_started_at": prev.get("boot_started_at"),
            "agent_last_started_at": prev.get("agent_started_at"),
            "boot_started_at": boot_time.isoformat() if boot_time else None,
        }
        if journal is not None:
            attrs["journal_last_entry_at"] = journal.last_at.isoformat() if journal.last_at else None
            if journal.last_fault:
                attrs["last_kernel_fault"] = journal.last_fault[0]
                attrs["last_kernel_fault_message"] = journal.last_fault[1][:512]
        if errors:
            attrs["unreadable"] = "; ".join(errors)[:1024]
        message = (f"Unexpected reboot: boot {str(prev.get('boot_id'))[:8]} ended without a clean agent stop "
                   f"or a reboot ordered by fleetmend, and no crash record of it was found")
        if journal is not None and journal.last_fault:
            message += f" (last kernel fault in its journal: {journal.last_fault[0]})"
        draft = FaultEvent(
            cluster=self.cluster, node=self.node, component=Component.KERNEL, kind="unexpected_reboot",
            severity=Severity.DEGRADED, message=message, source=Source.KMSG, agent_version=self.agent_version,
            attrs={k: v for k, v in attrs.items() if v is not None},
        )
        return self._finish(draft)
