"""Strip the framing that tools put around kernel log lines, leaving the kernel's message text.

Framings handled (any nesting order that occurs in practice, applied repeatedly):

- raw `/dev/kmsg` records `PRI,SEQ,TS_USEC,FLAGS;message` (Documentation/ABI/testing/dev-kmsg), with
  `\\xNN` escapes and continuation lines ` KEY=VALUE` (device dictionary);
- `dmesg` uptime `[ 1234.567890]`, `dmesg -T` `[Sun Feb 23 16:24:18 2025]`, `dmesg -H` deltas
  `[  +0.000316]` and `[Feb23 16:24]`, `dmesg --decode --time-format iso`
  (`kern  :warn  : 2025-01-21T04:41:44,283302+00:00 `), `dmesg -r` / pstore `<N>` priorities;
- syslog / journald short and ISO (`Mon DD HH:MM:SS[.us] [host] kernel: `, host may be missing, the
  message may carry the `[uptime]` stamp too), journald `-o short-monotonic` (`[ 1000.123456] host kernel: `),
  `-o short-unix` (`1764583200.123456 host kernel: `), `-o short-full` (`Mon 2026-12-01 10:00:01 UTC host kernel: `);
  non-kernel programs (`systemd[1]:`) are *foreign*;
- talosctl (`10.0.0.1: kern: warning: [RFC3339]: `); OpenWrt/busybox `logread`
  (`Tue Aug 12 16:40:43 2025 kern.crit kernel: `);
- collector prefixes, stripped with their wall-clock time kept in `Framed.wall`: console servers
  (`YYYY-MM-DD HH:MM:SS` then spaces or a tab, then the kernel's `[uptime]`), Open MPI
  `mpirun --tag-output/--timestamp-output` (`2019-05-10T04:29:11.340Z: [1,12]<stdout>:`, and Open MPI
  4's `Mon Nov 30 17:51:57 2026[1,12]<stdout>:`; orte/mca/iof/base/iof_base_output.c), pdsh/pssh/clush
  `host: ` before a timestamped line, and mail quoting `> ` / `>> ` (any depth);
- bare lines; `$ sudo dmesg ...` command lines and `[...]`, `...` elisions (ignored, end a record).

An indented line with no framing (`               NVRM: fallen off the bus...`) continues the previous
logical message; so does an unindented, unframed line right after a timestamped line that a mail client
wrapped (see `KmsgParser`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timezone

_WEEKDAYS = frozenset("Mon Tue Wed Thu Fri Sat Sun".split())
_MONTHS = {m: i for i, m in enumerate("Jan Feb Mar Apr May Jun Jul Aug Sep Oct Nov Dec".split(), 1)}


@dataclass
class Framed:
    """One physical line with its framing removed.

    Fields: text (the kernel message, leading indentation kept), ts (seconds on some monotonic-ish
    scale: uptime, epoch or seconds-of-year; only differences are used), stamp (the original
    timestamp text; None for `dmesg -H`, whose stamps are a wall clock to the minute and deltas),
    raw (the line as given), foreign (a non-kernel syslog/journald/kmsg line),
    framed (some framing was recognised), seq (raw kmsg sequence number), kmsg (raw kmsg record).
    """

    text: str
    ts: float | None = None
    stamp: str | None = None
    raw: str = ""
    foreign: bool = False
    framed: bool = False
    seq: int | None = None
    kmsg: bool = False
    wall: str | None = None
    """The wall-clock stamp of an outer collector framing (console server, mpirun, syslog around an
    `[uptime]` stamp), as printed, or the `dmesg -H` minute stamp plus the deltas since (`Dec 1 10:30
    +0.000123s`); None when the only stamp is the kernel's own."""
    quoted: int = 0
    """Length of the mail-quote prefix (`> `, `>> `) removed from the line."""


IGNORE = "ignore"
"""Sentinel kind for lines that carry nothing (commands, elisions, empty)."""

_KMSG = re.compile(r"^(?P<pri>\d{1,4}),(?P<seq>\d+),(?P<ts>\d+),(?P<flags>[^;,]*)(?:,[^;]*)?;(?P<msg>.*)$")
_KMSG_DICT = re.compile(r"^ [A-Z][A-Z0-9_]*=")
_TALOS = re.compile(r"^\S+: (?P<fac>[a-z0-9]+): +(?P<lvl>[a-z]+): +\[(?P<ts>[^\]]+)\]: ?(?P<msg>.*)$")
_FACILITIES = (
    "kern|user|mail|daemon|auth|syslog|lpr|news|uucp|cron|authpriv|ftp|local[0-7]"
)
_DECODE = re.compile(
    rf"^(?P<fac>{_FACILITIES})\s*:\s*(?P<lvl>emerg|alert|crit|err|warn|warning|notice|info|debug)\s*: ?(?P<msg>.*)$"
)
_ISO = r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?"
_ISO_LEAD = re.compile(rf"^(?P<ts>{_ISO}) ?(?P<msg>.*)$")
_SYSLOG = re.compile(
    r"^(?:(?P<mon>Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) +(?P<day>\d{1,2}) +"
    r"(?P<hms>\d\d:\d\d:\d\d)(?:\.(?P<frac>\d+))?"
    rf"|(?P<iso>{_ISO}))"
    r" +(?:(?P<host>[^\s:\[]*[^\s:]) +)?(?:(?:EMERG|ALERT|CRIT|ERR|WARNING|WARN|NOTICE|INFO|DEBUG) +)?"
    r"(?P<tag>[A-Za-z0-9_./@-]+)(?:\[\d+\])?: ?(?P<msg>.*)$"
)
"""syslog/journald lines; an rsyslog template may print the severity between host and tag (SONiC:
`Jun 18 10:10:06.585546 host EMERG kernel: [  669.047114] ...`)."""
_LOGREAD = re.compile(
    r"^(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) (?P<mon>[A-Z][a-z]{2}) +(?P<day>\d{1,2}) (?P<hms>\d\d:\d\d:\d\d) (?P<year>\d{4}) "
    rf"(?P<fac>{_FACILITIES})\.(?P<lvl>[a-z]+) (?P<tag>[\w./@-]+)(?:\[\d+\])?: ?(?P<msg>.*)$"
)
"""OpenWrt/busybox `logread`: `Tue Aug 12 16:40:43 2025 kern.crit kernel: [1317557.006117] ...`."""
_JOURNAL_FULL = re.compile(
    r"^(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) (?P<date>\d{4}-\d\d-\d\d) (?P<hms>\d\d:\d\d:\d\d(?:\.\d+)?) (?:[A-Z]{2,5}|[+-]\d{4}) "
    r"(?:(?P<host>[^\s:\[]*[^\s:]) +)?(?P<tag>[A-Za-z0-9_./@-]+)(?:\[\d+\])?: ?(?P<msg>.*)$"
)
"""`journalctl -o short-full`: `Mon 2026-12-01 10:00:01 UTC node-a01 kernel: ...` (systemd logs-show.c, output_short with
OUTPUT_SHORT_FULL: weekday, ISO date, time, zone)."""
_JOURNAL_UNIX = re.compile(r"^(?P<ts>\d{9,11}\.\d{1,9}) (?:(?P<host>[^\s:\[]*[^\s:]) +)?(?P<tag>[A-Za-z0-9_./@-]+)(?:\[\d+\])?: "
                           r"?(?P<msg>.*)$")
"""`journalctl -o short-unix`: `1764583200.123456 node-a01 kernel: ...` (seconds since the epoch)."""
_MONO_HOST = re.compile(r"^(?P<host>[A-Za-z0-9][\w.-]*) (?:(?P<kernel>kernel)|(?P<tag>[\w./@-]+)\[\d+\]): ?(?P<msg>.*)$")
"""`journalctl -o short-monotonic`: `[ 1000.123456] node-a01 kernel: ...` (the monotonic stamp, then host and
identifier): after the stamp, `host kernel: ` is framing and `host prog[pid]: ` a foreign line. Two words before the
colon, the second `kernel` or `name[pid]`, is a form no kernel message starts with (`python3[42]: segfault` has one)."""
_HOST_KERNEL = re.compile(r"^(?:(?P<host>[^\s:\[]*[^\s:]) +)?kernel: ?(?P<msg>.*)$")
_PRIO = re.compile(r"^<(?P<pri>\d{1,3})>(?P<msg>.*)$")
_UPTIME = re.compile(r"^\[ *(?P<ts>\d+\.\d+)\] ?(?P<msg>.*)$")
_DELTA = re.compile(r"^\[<? *\+ *(?P<ts>\d+\.\d+)>?\] ?(?P<msg>.*)$")
_CTIME = re.compile(
    r"^\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun|[^\W\d_]{2,4}\.?) (?P<mon>[^\W\d_]{3,4}\.?) +(?P<day>\d{1,2}) "
    r"(?P<hms>\d\d:\d\d:\d\d) (?P<year>\d{4})\] ?(?P<msg>.*)$"
)
"""`dmesg -T` (ctime in the reader's locale: `[Sun Feb 23 16:24:18 2025]`, pt_BR `[Ter Set 19 06:01:41 2017]`)."""
_HSTAMP = re.compile(r"^\[(?P<mon>[A-Z][a-z]{2}) ?(?P<day>\d{1,2}) (?P<hm>\d\d:\d\d)\] ?(?P<msg>.*)$")
_BRACKET_ISO = re.compile(rf"^\[(?P<ts>{_ISO})\] ?(?P<msg>.*)$")
_COMMAND = re.compile(r"^\s*(?:\$|#|>>>|\w+@[\w.-]+[:~][^$#]*[$#]) ")
_ELISION = re.compile(r"^\s*(?:\[\s*(?:\.\.\.|…)\s*\]|\.\.\.+|…|<snip>|\[snip\])\s*$", re.I)
_ESCAPE = re.compile(r"\\x([0-9a-fA-F]{2})")
_QUOTE = re.compile(r"^(?:[ \t]?>)+[ \t]?")
_CTIME_BARE = r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) [A-Z][a-z]{2} +\d{1,2} \d\d:\d\d:\d\d \d{4}"
_MPI = re.compile(
    rf"^(?:(?P<ts>{_ISO}|{_CTIME_BARE}):? ?)?\[\d+,\d+\]<(?:stdout|stderr|stddiag)>: ?(?P<msg>.*)$"
)
_CONSOLE = re.compile(rf"^(?P<ts>{_ISO})(?: *:)?[ \t]+(?P<msg>.*)$")
_COLLECTOR_HOST = re.compile(r"^(?P<host>[A-Za-z0-9][A-Za-z0-9_.-]{0,62}): (?P<msg>.*)$")
_TIMESTAMPED = re.compile(
    rf"^(?:\[ *\d+\.\d+\]|\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) |\[<? *\+ *\d|<\d{{1,3}}>\[|\d{{1,4}},\d+,\d+,|{_ISO}[ \t]|"
    r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) +\d{1,2} \d\d:\d\d:\d\d )"
)


def _iso_ts(s: str) -> float | None:
    s = s.replace(",", ".").replace(" ", "T", 1)
    s = re.sub(r"(\.\d{6})\d+", r"\1", s)
    if s.endswith("Z"):
        s = s[:-1] + "+00:00"
    try:
        dt = datetime.fromisoformat(s)
    except ValueError:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


def _soy(mon: str, day: str, hms: str) -> float:
    """Seconds since the start of a (31-day-month) year: enough for differences within a capture."""
    h, m, s = (int(x) for x in hms.split(":"))
    return ((_MONTHS.get(mon, 1) * 31 + int(day)) * 24 + h) * 3600.0 + m * 60 + s


def unescape_kmsg(msg: str) -> str:
    """Undo /dev/kmsg's `\\xNN` escaping of non-printable bytes (newlines become real newlines)."""
    if "\\x" not in msg:
        return msg
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), msg)


class Deframer:
    """Stateful framing stripper (state: the running total of `dmesg -H` deltas)."""

    def __init__(self) -> None:
        self._rel_s = 0.0
        self._h_base: str | None = None  # the last `dmesg -H` minute stamp
        self._h_rel = 0.0  # `_rel_s` at that stamp
        self.last_was_kmsg = False

    def deframe(self, line: str) -> Framed | str:
        """Strip framing from one physical line.

        Returns:
            `Framed`, or `IGNORE` for empty lines, shell commands, elisions and kmsg dictionary lines.
        """
        line = line.rstrip("\r\n")
        if not line.strip():
            return IGNORE
        if self.last_was_kmsg and _KMSG_DICT.match(line):
            return IGNORE
        self.last_was_kmsg = False
        quoted = 0
        if ">" in line[:8]:
            q = _QUOTE.match(line)
            if q:
                quoted = q.end()
                line = line[quoted:]
                if not line.strip():
                    return IGNORE
        if _ELISION.match(line) or _COMMAND.match(line):
            return IGNORE
        if line[:1] in (" ", "\t"):
            bare = line.lstrip()
            if _TIMESTAMPED.match(bare):  # `  [  372.968431] ...` indented in a mail or a patch description
                line = bare
        f = Framed(text=line, raw=line, quoted=quoted)
        if ":" in line[:64] and line[:1].isalnum():
            self._strip_collector(f)
            line = f.text
        m = _KMSG.match(line)
        if m:
            pri = int(m["pri"])
            f.text, f.ts, f.seq, f.kmsg, f.framed = unescape_kmsg(m["msg"]), int(m["ts"]) / 1e6, int(m["seq"]), True, True
            f.stamp = f"{int(m['ts']) / 1e6:.6f}"
            f.foreign = (pri >> 3) != 0
            self.last_was_kmsg = True
            return f
        for _ in range(4):
            if not self._strip_once(f):
                break
        return f

    @staticmethod
    def _strip_collector(f: Framed) -> None:
        """Remove one outer collector prefix (mpirun tag, pdsh/pssh `host: ` before a timestamped line)."""
        t = f.text
        if "]<std" in t:
            m = _MPI.match(t)
            if m:
                f.text, f.framed = m["msg"], True
                if m["ts"]:
                    f.wall = m["ts"]
                    f.ts = _iso_ts(m["ts"]) if m["ts"][:1].isdigit() else None
                return
        m = _COLLECTOR_HOST.match(t)
        if m and m["host"] != "kernel" and _TIMESTAMPED.match(m["msg"]):
            f.text, f.framed = m["msg"], True

    def _strip_once(self, f: Framed) -> bool:
        """Remove one framing layer. The first character picks the candidates (bracketed stamps, `<N>`
        priorities, or the word/date-led framings), so a line costs a few regex attempts, not all of them."""
        t = f.text
        c = t[:1]
        if c == "[":
            return self._strip_bracket(f, t)
        if c == "<":
            m = _PRIO.match(t)
            if m:
                f.text, f.framed = m["msg"], True
                return True
            return False
        if not c or c in " \t":
            return False
        if ": " in t:
            m = _TALOS.match(t)
            if m:
                f.text, f.framed, f.stamp = m["msg"], True, m["ts"]
                f.ts = _iso_ts(m["ts"]) if f.ts is None else f.ts
                f.foreign = f.foreign or m["fac"] != "kern"
                return True
        if c.isalpha():
            m = _DECODE.match(t)
            if m:
                f.text, f.framed = m["msg"], True
                f.foreign = f.foreign or m["fac"] != "kern"
                m2 = _ISO_LEAD.match(f.text)
                if m2:
                    f.text, f.stamp, f.ts = m2["msg"], m2["ts"], _iso_ts(m2["ts"])
                return True
            if t[:3] in _WEEKDAYS and t[4:5].isdigit():
                m = _JOURNAL_FULL.match(t)
                if m:
                    f.text, f.framed = m["msg"], True
                    f.stamp = f"{m['date']} {m['hms']}"
                    f.wall = f.wall or f.stamp
                    f.ts = _iso_ts(f"{m['date']}T{m['hms']}")
                    f.foreign = f.foreign or m["tag"] != "kernel"
                    return True
            if t[:3] in _WEEKDAYS:
                m = _LOGREAD.match(t)
                if m:
                    f.text, f.framed = m["msg"], True
                    f.stamp = f"{m['mon']} {m['day']} {m['hms']} {m['year']}"
                    f.wall = f.wall or f.stamp
                    f.ts = int(m["year"]) * 400 * 86400.0 + _soy(m["mon"], m["day"], m["hms"])
                    f.foreign = f.foreign or m["tag"] != "kernel"
                    return True
        if c.isdigit() or t[:3] in _MONTHS:
            m = _SYSLOG.match(t)
            if m and m["iso"] and m["host"] is None and m["tag"] != "kernel":
                m = None  # `2025-01-21T04:41:44,283302+00:00 NVRM: ...` (dmesg --time-format iso): no host, not syslog
            if m:
                f.text, f.framed = m["msg"], True
                if m["iso"]:
                    f.stamp, f.ts = m["iso"], _iso_ts(m["iso"])
                else:
                    f.stamp = f"{m['mon']} {m['day']} {m['hms']}"
                    f.ts = _soy(m["mon"], m["day"], m["hms"]) + (float("0." + m["frac"]) if m["frac"] else 0.0)
                if m["tag"] != "kernel":
                    f.foreign = True
                f.wall = f.wall or f.stamp
                return True
        if c.isdigit() and t[9:12].strip(".0123456789") == "":
            m = _JOURNAL_UNIX.match(t)
            if m and (m["host"] is not None or m["tag"] == "kernel"):
                f.text, f.framed, f.stamp, f.ts = m["msg"], True, m["ts"], float(m["ts"])
                f.wall = f.wall or m["ts"]
                f.foreign = f.foreign or m["tag"] != "kernel"
                return True
        if c.isdigit():
            m = _CONSOLE.match(t)
            if m:
                ts = _iso_ts(m["ts"])
                if ts is not None:
                    f.text, f.framed, f.stamp, f.ts = m["msg"], True, m["ts"], ts
                    f.wall = f.wall or m["ts"]
                    return True
        if not f.framed and "kernel:" in t:
            m = _HOST_KERNEL.match(t)
            if m:
                f.text, f.framed = m["msg"], True
                return True
        return False

    def _strip_bracket(self, f: Framed, t: str) -> bool:
        m = _UPTIME.match(t)
        if m:
            f.text, f.framed = m["msg"], True
            f.stamp, f.ts = m["ts"], float(m["ts"])  # uptime beats a coarser syslog stamp
            if " kernel: " in f.text[:80] or "]: " in f.text[:80]:
                hm = _MONO_HOST.match(f.text)
                if hm:
                    f.text = hm["msg"]
                    f.foreign = f.foreign or hm["kernel"] is None
            return True
        m = _DELTA.match(t)
        if m:
            self._rel_s += float(m["ts"])
            f.text, f.framed, f.ts = m["msg"], True, self._rel_s
            if self._h_base is not None:  # `dmesg -H`: the minute stamp plus the deltas since, as a wall time
                f.wall = f"{self._h_base} +{self._rel_s - self._h_rel:.6f}s"
            return True
        m = _CTIME.match(t)
        if m:
            f.text, f.framed = m["msg"], True
            f.stamp = f"{m['mon']} {m['day']} {m['hms']} {m['year']}"
            f.ts = int(m["year"]) * 400 * 86400.0 + _soy(m["mon"], m["day"], m["hms"])
            return True
        m = _BRACKET_ISO.match(t)
        if m:
            f.text, f.framed, f.stamp, f.ts = m["msg"], True, m["ts"], _iso_ts(m["ts"])
            return True
        m = _HSTAMP.match(t)
        if m:
            # `dmesg -H` prints the wall clock to the minute when the minute changes, then deltas: neither is the
            # kernel's stamp (util-linux dmesg.c print_record, --human), so it is a wall time, not `stamp`.
            f.text, f.framed = m["msg"], True
            f.ts = _soy(m["mon"], m["day"], m["hm"] + ":00")
            self._h_base, self._rel_s, self._h_rel = f"{m['mon']} {m['day']} {m['hm']}", f.ts, f.ts
            f.wall = self._h_base
            return True
        return False
