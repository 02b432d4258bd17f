"""Kernel-log parsing of a stream of any size in bounded memory, at a small multiple of a bare read.

`parse_stream(stream, ...)` reads bytes in chunks of `CHUNK_BYTES`, finds the lines that hold any of
`TOKENS` in one Aho-Corasick pass over the chunk (ahocorasick_rs; a regex alternation of the same
words costs more per line than the parser itself), decodes and feeds `KmsgParser` only those lines and the lines that
follow them while the parser has a record open (call traces, register dumps, GHES bodies carry no
token but belong to the record before them). Lines between are skipped without being looked at.

Why skipping gives the same events as feeding every line: a line without a token starts no record
(every head in `heads.HEADS` and every fact `KmsgParser` learns from a line needs one
of `TOKENS` in the line); when no record is open, such a line completes nothing and closes nothing.
The one piece of state a skipped line would change is the running total of `dmesg -H` deltas
(`[  +0.004974]`); such stamps are among the tokens, so those lines are always fed. tests/test_explain_stream.py
checks the equality on every kernel-log text of the repository's corpus.

A line that was fed and started nothing is remembered by its message (the text after `[uptime]`,
`INERT_MAX` of them): when the same message comes again with no record open, it is skipped unread.
Lines the parser learns from (NVRM) and `dmesg -H` deltas are never remembered.

A matcher for a new kind whose head line holds none of `TOKENS` must add its word here.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import IO, TYPE_CHECKING

from agents.kmsg.parser import KmsgParser
from fleetmend.events import FaultEvent

if TYPE_CHECKING:
    from ahocorasick_rs import BytesAhoCorasick

CHUNK_BYTES = 4 * 1024 * 1024
"""Bytes read at a time (memory holds about two chunks)."""

TOKENS = (
    # GPU / NVIDIA driver (learned facts: the driver banner and 'GPU at PCI:' lines hold NVRM)
    "Xid", "NVRM", "GPU", "fsp", "FSP", "GSP", "gsp", "NVLink", "nvlink", "peermem",
    # errors, failures, resets, timeouts (NIC, NVMe, firmware, generic)
    "rror", "RROR", "fail", "Fail", "FAIL", "fatal", "Fatal", "FATAL", "timeout", "Timeout", "timed out",
    "TX", "Tx", "tx", "reset", "Reset", "RESET", "ecovery", "WATCHDOG", "health", "Health", "FW",
    "syndrome", "abort", "Abort", "critical", "Critical", "corrupt", "Unable", "unable", "compromised",
    "WARNING", "FTQ",
    # PCIe / RAS / CPU
    "PCIe Bus", "PCIe bandwidth", "AER", "EDAC", "Hardware", "mce", "MCE", "Machine", "machine check", "ECC",
    "ecc", "fallen", "throttl",
    # links and devices
    "mlx5", "Link is", "link status", "bond", "slave", "active interface", "nvme", "Port module", "efa ",
    # storage, filesystems, NFS, OS limits, libraries (issue 29)
    "-fs", "XFS", "md/raid", " path - ", ": server ", "file-max", "table full", "CMCI", "segfault", " in lib",
    "signaled seq", "uncorrectable hardware", "GPU reset", "GPU Recovery", "ASIC reset",
    # formats read from the drivers' sources (formats.tsv): hot-plug slots, DPC, NVMe namespace errors, IB port state,
    # CPU thermal, memory failure, EDAC pre-v3.6
    "lot(", "containment", "@ LBA", "Port: ", "speed normal", "Memory failure", "CE page", "UE page", "JBD2",
    "unregister_netdevice", "mlx4_en", "inaccessible", "giving up",
    # kernel crashes, lockups, memory
    "Kernel panic", "kernel panic", "lockup", "LOCKUP", "BUG:", "BUG at", "Oops", "general protection",
    "opcode", "divide error", "blocked for", "hung", "stall", "stuck", "oom", "OOM", "Kill", "of memory",
    # `dmesg -H` delta stamps: the deframer keeps their running total, so every such line is fed
    "[+", "[ +", "[  +", "[   +", "[    +", "[<+", "[< +",
)
"""Words one of which every line that starts a fault record holds (case-sensitive substrings)."""



INERT_MAX = 100_000
"""Messages remembered as starting nothing (a long log repeats its messages; each is judged once)."""

INDENT = (b" ", b"\t")
"""An indented line may continue the line before it (the parser joins them): it is fed with it."""
FRAMED = (b"[", b"<")
"""A line starting so carries its own stamp (`[uptime]`, pstore's `<level>[uptime]`) and continues no
line; any other line may be a mail client's wrap of the line before when the parser says that line
could be wrapped (`KmsgParser.may_be_continued`): then it is fed too and the parser decides."""


def _inert_key(raw: bytes) -> bytes | None:
    """The message of a `[uptime] message` line, the key under which a line that started nothing is
    remembered; None for lines that must always be fed: other framings, `dmesg -H` deltas (the running
    total), NVRM lines (the parser learns the driver version and the GPU a serial belongs to from them)."""
    if not raw.startswith(b"[") or b"+" in raw[1:6] or b"NVRM" in raw:
        return None
    end = raw.find(b"]")
    return raw[end + 1:] if end > 0 else None


def _interesting_starts(chunk: str) -> list[int]:
    """Sorted offsets of the starts of lines in `chunk` that hold a token."""
    starts: set[int] = set()
    find, rfind = chunk.find, chunk.rfind
    for tok in TOKENS:
        i = find(tok)
        while i != -1:
            s = rfind("\n", 0, i) + 1
            starts.add(s)
            e = find("\n", i)
            if e == -1:
                break
            i = find(tok, e + 1)
    return sorted(starts)


def _line_starts_ac(chunk: bytes, automaton: BytesAhoCorasick) -> list[int]:
    """As `_interesting_starts`, on bytes, with one Aho-Corasick pass (ahocorasick_rs)."""
    rfind = chunk.rfind
    starts: list[int] = []
    last_end = -1
    for _, i, _e in automaton.find_matches_as_indexes(chunk):
        if i < last_end:  # still in the line found last
            continue
        s = rfind(b"\n", 0, i) + 1
        starts.append(s)
        e = chunk.find(b"\n", i)
        last_end = e if e != -1 else len(chunk)
    return starts


def _automaton() -> BytesAhoCorasick | None:
    try:
        import ahocorasick_rs
    except ImportError:  # pragma: no cover - a dependency; the str.find scan is the slow fallback
        return None
    # a DFA: same matches as the default (contiguous NFA), at under half the instructions per byte (about
    # 40 -> 16 on a kernel log), for a table of a few hundred KiB built once
    return ahocorasick_rs.BytesAhoCorasick([t.encode() for t in TOKENS], implementation=ahocorasick_rs.Implementation.DFA)


def parse_stream(stream: IO[bytes], parser: KmsgParser, *, chunk_bytes: int = CHUNK_BYTES,
                 full: bool = False) -> Iterator[FaultEvent]:
    """Yield the events of a kernel log read from a binary stream, in log order.

    Args:
        stream: binary stream (a file opened "rb", `sys.stdin.buffer`); lines are decoded as UTF-8
            with undecodable bytes replaced (U+FFFD), like `open(errors="replace")`.
        parser: the `KmsgParser` to feed (its cluster/node/catalog stamp the events).
        chunk_bytes: bytes read at a time.
        full: True feeds every line (no skipping; for comparison).
    Raises:
        OSError from `stream.read`.
    Memory: about two chunks plus the open record (at most `MAX_RECORD_LINES` lines).
    """
    ac = _automaton()
    carry = b""
    feed = parser.feed
    busy = False  # the last line fed held a token, or the parser has a record open

    def is_open() -> bool:
        return parser._record is not None  # same package: the parser's record state

    def complete() -> list[FaultEvent]:
        out: list[FaultEvent] = []
        parser._complete_pending(out)  # same package: what feeding a non-continuation line does first
        return out

    def line(chunk: bytes, pos: int, end: int) -> str:
        return chunk[pos:end].decode("utf-8", "replace")

    parser_emitted = [False]
    inert: set[bytes] = set()

    def step(chunk: bytes, pos: int, n: int) -> Generator[FaultEvent, None, tuple[int, bool]]:
        """Feed the line at `pos`; return the next line's offset and whether it must be fed too: it
        may continue this line (it does not start with a stamp, or is not read yet), or the record
        this line opened or kept open may absorb it. The line is judged now (`complete`), as the next line's arrival would."""
        e = chunk.find(b"\n", pos)
        evs = feed(line(chunk, pos, e))
        pos = e + 1
        nxt = chunk[pos:pos + 1]
        if pos >= n or nxt in INDENT or (nxt not in FRAMED and parser.may_be_continued()):
            parser_emitted[0] = True  # not judged yet: never cached
            yield from evs
            return pos, True
        evs += complete()
        parser_emitted[0] = bool(evs)
        yield from evs
        return pos, is_open()

    while True:
        data = stream.read(chunk_bytes)
        if not data:
            break
        chunk = carry + data if carry else data
        cut = chunk.rfind(b"\n")
        if cut == -1:
            carry = chunk
            continue
        carry = chunk[cut + 1:]
        chunk = chunk[:cut + 1]
        if full:
            for ln in chunk.decode("utf-8", "replace").splitlines():
                yield from feed(ln)
            continue
        if ac is not None:
            starts = _line_starts_ac(chunk, ac)
        else:
            text = chunk.decode("latin-1")  # byte offsets = character offsets
            starts = _interesting_starts(text)
            del text
        pos, n = 0, len(chunk)
        for s in starts:
            while busy and pos < s:
                pos, busy = yield from step(chunk, pos, n)
            if s < pos:
                continue
            if s > pos and chunk[s:s + 1] not in FRAMED:
                # an unstamped line may continue the lines before it (indentation, a mail client's
                # wrap), back to the last unindented one: give the parser those lines too
                prev = s
                while True:
                    prev = chunk.rfind(b"\n", 0, prev - 1) + 1
                    if prev <= pos or chunk[prev:prev + 1] not in INDENT:
                        break
                prev = max(prev, pos)
                while prev < s:
                    e = chunk.find(b"\n", prev)
                    yield from feed(line(chunk, prev, e))
                    prev = e + 1
            if not busy:
                e = chunk.find(b"\n", s)
                key = _inert_key(chunk[s:e])
                if key is not None and key in inert and chunk[e + 1:e + 2] in FRAMED:
                    pos = e + 1  # the same message was fed before and started nothing: skip it
                    continue
                # `step(chunk, s, n)`, inline (most lines fed are these: no generator, no nested calls)
                evs = feed(chunk[s:e].decode("utf-8", "replace"))
                pos = e + 1
                nxt = chunk[pos:pos + 1]
                if pos >= n or nxt in INDENT or (nxt not in FRAMED and parser.may_be_continued()):
                    parser_emitted[0] = busy = True
                else:
                    parser._complete_pending(evs)  # same package: what feeding a non-continuation line does first
                    parser_emitted[0] = bool(evs)
                    busy = parser._record is not None
                if evs:
                    yield from evs
                if key is not None and not busy and not parser_emitted[0]:
                    if len(inert) >= INERT_MAX:
                        inert.clear()
                    inert.add(key)
                continue
            pos, busy = yield from step(chunk, s, n)
        while busy and pos < n:
            pos, busy = yield from step(chunk, pos, n)
        del chunk
    if carry:
        yield from feed(carry.decode("utf-8", "replace"))
    yield from parser.flush()
