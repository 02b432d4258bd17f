"""Kernel log text -> `FaultEvent`s: framing, multi-line records, matching, merging, classification.

Pipeline per physical line: `Deframer` strips the framing (`framing.py`); an indented unframed line is
joined to the previous logical message; each logical message either starts a record (a head,
`heads.match_head`), merges into the open record (same condition: repeats, XID 79 + 'fallen off the
bus', the OOM triple, AER detail lines), is absorbed as detail (call traces, register dumps, GSP RPC
tables, `{1}[Hardware Error]:` blocks; within `RECORD_WINDOW_S` of the record) or is dropped. A record
completes when the next record starts, on a foreign line (another program's syslog line), an elision,
or on `flush()`; it then becomes one `FaultEvent` classified by the catalog.
"""

from __future__ import annotations

import logging
import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from agents.kmsg.framing import IGNORE, Deframer, Framed
from agents.kmsg.heads import match_head
from agents.kmsg.matchers import Attr, Candidate, detail, ghes_component, normalize_bdf
from fleetmend.catalog import Catalog, default_catalog
from fleetmend.events import Component, Device, FaultEvent, Severity, Source

log = logging.getLogger(__name__)

RECORD_WINDOW_S = 2.0
"""Lines within 2 s of a record's last line may join it: a kernel prints one report in one burst
(c001's GSP tables and stack share one second); a later report of the same fault is a new event."""
MAX_RECORD_LINES = 400
"""A record stops absorbing after 400 lines (a full OOM task table); `raw` is capped anyway. The cap also bounds
how long a flood of one fault goes unreported: the agent publishes a record only when it closes, and one XID line
every millisecond would keep it open for as long as the flood lasts. So a fault repeating past the cap is reported
in parts of at most 400 lines, each an event of the same condition (`fault_key`; the workflow coalesces them into
one fault); every part after the first carries `attrs["continued"] = True` (one fault, not several)."""
PER_LINE_KINDS = frozenset({"aer_corrected"})
"""Kinds whose catalog escalation (`escalate_to/escalate_count/escalate_window_s`, e.g. 3 corrected AER
errors on one port within 60 s become `aer_corrected_burst`) counts every line of a record, on its PCI
device only (a corrected AER line is one error on one port); other kinds count per episode (`_escalate`)."""
FAMILY_WINDOW_S = {"nvme": 120.0, "nic_tx": 10.0, "netdev_unreg": 15.0}
"""An NVMe timeout -> reset -> 'Device not ready' -> removal chain spans ~25 s per step (admin command
timeout 30 s default); heads of that family on the same controller merge within 120 s. A NIC transmit-timeout
episode (watchdog line, driver dump, reset) continues while its lines come within 10 s (ENA checks missing
completions every second, igb/e1000e report a hang every 2 s); each `NETDEV WATCHDOG` line in it is one
timeout for the repeat count (dev_watchdog fires once per watchdog period while the queue stays stuck).
`unregister_netdevice: waiting for %s to become free` repeats every 10 s (netdev_unregister_timeout_secs) while one
device stays held: one condition, counted."""

ESCALATE_KEY_ATTR = {"mce": "mce_addr"}
"""Kinds whose repeats count per value of an attribute, not per device: a corrected machine check repeats
at one physical address (`mce_addr`); one without an address counts nowhere."""

BOOT_POLL_S = 30.0
"""A corrected machine check printed in the kernel's first 30 s (uptime stamp) is the CPU-online bank scan
(mce/core.c `__mcheck_cpu_init_generic` -> `machine_check_poll(MCP_UC, ...)`, "log everything at CPU online"):
the bank kept its error across the reset, so its OVER bit (bit 62) counts errors over an unknown span before
this boot, not a rate. Such a record is `mce` (corrected; its address still counts toward the escalation),
not `mce_corrected_repeated`. Later (CMCI, the poll timer) OVER means errors came faster than they were
read, and stays mce_corrected_repeated."""

CAUSE_FAMILIES = {"ras", "mlx5_fw", "gpu_boot"}
CAUSE_WINDOW_S = 30.0
"""A crash (panic, Oops, BUG, lockup) within 30 s after an open hardware record of these families
(machine check, GHES/CPER, EDAC; ConnectX firmware command timeout or health failure; GPU boot failure)
is that record's consequence: it is absorbed into the record (attrs `followed_by`, `panic_reason`) and
the hardware fault stays the primary event, with its component and device. mce/core.c panics right after
printing the bank; ghes.c panics right after the record; a dead ConnectX leaves the health timer reading
freed memory (the Oops comes seconds later)."""

GPU_LOST_AND_BOOT = {"gpu_lost", "gpu_boot"}
"""A GPU off the bus (`Unable to change power state ... device inaccessible`, `fallen off the bus`, XID 79) and the
driver's failure to initialise it (`RmInitAdapter failed`) within one record window are one condition: the record reads
as the GPU lost (the more specific cause), the init failure kept as `followed_by`."""

MAIL_WRAP_MIN = 66
MAIL_WRAP_MAX = 80
"""Mail clients wrap quoted text at 66-80 columns (git send-email/Thunderbird 72, Outlook/Gmail 76-78):
a line longer than 80 was not wrapped, and a wrap happened only where the next word did not fit."""

_DRIVER = re.compile(r"NVRM: loading NVIDIA UNIX .*?Kernel Module(?: for \S+)?\s+(?P<ver>\d+\.\d+(?:\.\d+)?)")
_GPU_AT = re.compile(r"NVRM: GPU at PCI:(?P<bdf>[0-9a-fA-F:.]+): (?P<uuid>GPU-[0-9a-fA-F-]+)")
_SERIAL = re.compile(r"NVRM: GPU Board Serial Number: (?P<serial>\S+)")
_GPU_ANNOUNCE = re.compile(r"NVRM: The NVIDIA GPU (?P<bdf>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])\s*$")
"""open-gpu-kernel-modules src/nvidia/arch/nvalloc/unix/src/osapi.c (RmInitAdapter probe, 595.45.04): one
nv_printf of three lines, `NVRM: The NVIDIA GPU %04x:%02x:%02x.%x` / `NVRM: (PCI ID: %04x:%04x) installed
in this system has` / `NVRM: fallen off the bus and is not responding to commands.`: dmesg shows each line
as its own message, every one with `NVRM:` at column 0, so only the first names the device."""
ANNOUNCE_LINES = 3
"""The 'fallen off the bus' line takes the device of a `NVRM: The NVIDIA GPU` line at most 3 messages back."""
_SUBSYS = re.compile(r"^(?P<p>[\w.-]+: )")


@dataclass
class _Record:
    cand: Candidate
    lines: list[str]
    ts_first: float | None
    ts_last: float | None
    stamp: str | None
    wall: str | None = None
    count: int = 1
    forms: set[str] = field(default_factory=set)  # `Candidate.form`s this report has printed
    origin: int | None = None  # where its first line was read (kmsg SEQ or file offset), for the event id

    def near(self, ts: float | None, window_s: float = RECORD_WINDOW_S) -> bool:
        return ts is None or self.ts_last is None or abs(ts - self.ts_last) <= window_s




@dataclass
class _Context:
    driver_version: str | None = None
    uuid_by_bdf: dict[str, str] = field(default_factory=dict)
    serial_by_bdf: dict[str, str] = field(default_factory=dict)
    last_gpu_bdf: str | None = None
    announced: tuple[str, int, list[str]] | None = None  # (bdf, message number, raw lines) of `The NVIDIA GPU`
    messages: int = 0


class KmsgParser:
    """Stream parser for kernel log text.

    Args:
        cluster, node: stamped on every event (cluster `[A-Za-z0-9_-]+`; node any name `subjects.check_node_name` accepts).
        agent_version: stamped on every event.
        catalog: classifies events (severity, component); default: the packaged catalog.
        driver_version: NVIDIA driver version if known (selects NVLink5 v1/v2 decode rules); also
            learned from the driver's 'loading NVIDIA UNIX ... Kernel Module X.Y' banner.

    Use `feed(line)` per physical line and `flush()` when input pauses (the probe calls it when
    /dev/kmsg has nothing more to read) or ends. Both return the events whose records completed.
    `parse_errors` counts lines that raised inside a matcher (logged, skipped).

    `event_id_for`: None (default) gives every event a fresh `new_event_id()`. The kmsg probe sets
    it to `f(origin, n) -> str`, where `origin` is where the record's first line was read (the
    /dev/kmsg SEQ, or a replayed file's byte offset, passed to `feed`) and `n` counts events of one
    origin (0, 1, …): reading the same record again then yields the same id, which JetStream's
    duplicate window and the workflow drop.
    """

    def __init__(
        self,
        cluster: str,
        node: str,
        agent_version: str,
        catalog: Catalog | None = None,
        driver_version: str | None = None,
    ) -> None:
        self.cluster = cluster
        self.node = node
        self.agent_version = agent_version
        self.catalog = catalog or default_catalog()
        self._deframer = Deframer()
        self._ctx = _Context(driver_version=driver_version)
        self._pending: Framed | None = None
        self._pending_raw: list[str] = []
        self._last_len = 0
        self._record: _Record | None = None
        self._burst_history: dict[str, deque[float | None]] = {}
        self._repeat_history: dict[str, deque[float | None]] = {}
        self.parse_errors = 0
        self.lines_seen = 0
        self.last_seq: int | None = None
        self.event_id_for: Callable[[int, int], str] | None = None
        self._origin: int | None = None  # of the line being fed
        self._pending_origin: int | None = None  # of the pending logical message's first line
        self._logical_origin: int | None = None  # of the logical message being matched
        self._last_id_origin: tuple[int | None, int] = (None, 0)

    # ------------------------------------------------------------------ public

    def feed(self, line: str, origin: int | None = None) -> list[FaultEvent]:
        """Consume one physical line (with or without its newline).

        Args:
            origin: where the line was read (kmsg SEQ, file byte offset), for `event_id_for`.
        Returns:
            Events completed by this line (usually none; a record completes when the next starts).
        """
        self.lines_seen += 1
        self._origin = origin
        out: list[FaultEvent] = []
        try:
            f = self._deframer.deframe(line)
        except Exception as err:  # noqa: BLE001  # a decoder bug must not stop the agent; counted and logged
            self.parse_errors += 1
            log.warning("kmsg_line_skipped", extra={"line_no": self.lines_seen, "error": repr(err)})
            return out
        if f == IGNORE:
            if not (line.startswith(" ") and "=" in line and self._deframer.last_was_kmsg):
                self._complete_pending(out)
                self._close(out)
            elif self._pending is not None:
                self._pending_raw.append(line.rstrip("\n"))  # kmsg dictionary (SUBSYSTEM=, DEVICE=)
            return out
        assert isinstance(f, Framed)
        if f.seq is not None:
            self.last_seq = f.seq
        last_len, self._last_len = self._last_len, len(f.raw) + f.quoted
        if self._pending is not None and not f.framed and self._pending_raw and self._pending_raw[-1].endswith("=") \
                and not self._pending.foreign:
            # quoted-printable soft line break (RFC 2045 6.7): the line goes on exactly where '=' stands
            self._pending.text = self._pending.text.rstrip()[:-1] + f.text
            self._pending_raw[-1] = self._pending_raw[-1][:-1] + f.raw
            return out
        if self._is_continuation(f) or self._is_mail_wrap(f, last_len):
            assert self._pending is not None
            self._pending.text = self._join(self._pending.text, f.text)
            self._pending_raw.append(f.raw)
            return out
        self._complete_pending(out)
        if f.kmsg and "\n" in f.text:
            # One /dev/kmsg record whose message spans lines: each line is a logical message.
            for i, part in enumerate(f.text.split("\n")):
                sub = Framed(text=part, ts=f.ts, stamp=f.stamp, raw=part, foreign=f.foreign, framed=True, seq=f.seq)
                self._pending, self._pending_raw = sub, [f.raw] if i == 0 else []
                self._pending_origin = self._origin
                self._complete_pending(out)
            return out
        self._pending, self._pending_raw = f, [f.raw]
        self._pending_origin = self._origin
        return out

    def flush(self) -> list[FaultEvent]:
        """Complete the pending line and the open record. Returns their events."""
        out: list[FaultEvent] = []
        self._complete_pending(out)
        self._close(out)
        return out

    # ------------------------------------------------------------------ lines

    def _is_continuation(self, f: Framed) -> bool:
        return (
            self._pending is not None
            and not f.framed
            and f.text[:1] in (" ", "\t")
            and not self._pending.foreign
        )

    def may_be_continued(self) -> bool:
        """Whether the next physical line could join the pending message as a mail-client wrap (the
        pending message is timestamped and its last line short enough to have been wrapped). Indented
        lines may always continue it. For readers that skip lines (agents.kmsg.stream)."""
        p = self._pending
        return p is not None and not p.foreign and p.framed and p.ts is not None and self._last_len <= MAIL_WRAP_MAX

    def _is_mail_wrap(self, f: Framed, last_len: int) -> bool:
        """A mail client wrapped the previous (timestamped) line here: this line has no framing and no
        indentation, starts no fault of its own, and its first word would not have fitted on the
        previous line within the narrowest common wrap width (66 columns; clients wrap at 66-80)."""
        p = self._pending
        if p is None or f.framed or p.foreign or not p.framed or p.ts is None or f.text[:1] in (" ", "\t", ""):
            return False
        if last_len > MAIL_WRAP_MAX or last_len + 1 + len(f.text.split(None, 1)[0]) <= MAIL_WRAP_MIN:
            return False
        return match_head(f.text) is None

    @staticmethod
    def _join(head: str, cont: str) -> str:
        cont = cont.strip()
        hm = _SUBSYS.match(head.strip())
        if hm and cont.startswith(hm["p"]):
            cont = cont[len(hm["p"]):]
        return f"{head.rstrip()} {cont}"

    def _complete_pending(self, out: list[FaultEvent]) -> None:
        f, raw = self._pending, self._pending_raw
        self._pending, self._pending_raw = None, []
        if f is None:
            return
        self._logical_origin = self._pending_origin
        try:
            self._logical(f, raw, out)
        except Exception as err:  # noqa: BLE001  # a decoder bug must not stop the agent; counted and logged
            self.parse_errors += 1
            log.warning("kmsg_line_skipped", extra={"line_no": self.lines_seen, "error": repr(err)})

    def _logical(self, f: Framed, raw: list[str], out: list[FaultEvent]) -> None:
        if f.foreign:
            self._close(out)
            return
        text = f.text
        self._ctx.messages += 1
        self._learn(text, raw)
        cand = match_head(text)
        if cand is not None and cand.kind == "gpu_fallen_off_bus" and cand.bdf is None:
            self._announced_device(cand, raw)
        rec = self._record
        if cand is None:
            a = self._ctx.announced
            if a is not None and a[1] < self._ctx.messages < a[1] + ANNOUNCE_LINES:
                a[2].extend(raw)  # `NVRM: (PCI ID: ...) installed in this system has`
            if rec is not None and rec.near(f.ts) and len(rec.lines) < MAX_RECORD_LINES:
                rec.lines.extend(raw)
                rec.ts_last = f.ts if f.ts is not None else rec.ts_last
                self._apply_detail(rec, text)
            elif rec is not None:
                self._close(out)
            return
        if rec is not None and self._absorb(rec, cand, f, text):
            rec.lines.extend(raw)
            rec.ts_last = f.ts if f.ts is not None else rec.ts_last
            return
        if rec is not None and self._merge(rec, cand, f):
            rec.lines.extend(raw)
            rec.ts_last = f.ts if f.ts is not None else rec.ts_last
            return
        if rec is not None and len(rec.lines) >= MAX_RECORD_LINES and _same_condition(rec.cand, cand):
            cand.attrs["continued"] = True  # the same fault past the line cap: its next part (MAX_RECORD_LINES)
        self._close(out)
        if cand.message == "":
            cand.message = text.strip()
        self._record = _Record(cand=cand, lines=list(raw), ts_first=f.ts, ts_last=f.ts, stamp=f.stamp, wall=f.wall,
                               origin=self._logical_origin)

    def _announced_device(self, cand: Candidate, raw: list[str]) -> None:
        """A device-less 'fallen off the bus' line takes the PCI address of the `NVRM: The NVIDIA GPU`
        line just before it (`_GPU_ANNOUNCE`), whose lines then lead its raw text."""
        a = self._ctx.announced
        if a is not None and self._ctx.messages - a[1] <= ANNOUNCE_LINES - 1:
            cand.bdf = a[0]
            raw[:0] = [r for r in a[2] if r not in raw]
        self._ctx.announced = None

    def _learn(self, text: str, raw: list[str] | None = None) -> None:
        if "NVRM: " not in text:  # every pattern below needs it (most messages: three searches saved)
            return
        if "The NVIDIA GPU" in text:
            am = _GPU_ANNOUNCE.search(text)
            if am:
                self._ctx.announced = (normalize_bdf(am["bdf"]) or am["bdf"], self._ctx.messages, list(raw or []))
        m = _DRIVER.search(text)
        if m:
            self._ctx.driver_version = m["ver"]
        m = _GPU_AT.search(text)
        if m:
            bdf = normalize_bdf(m["bdf"].rstrip(":"))
            if bdf:
                self._ctx.uuid_by_bdf[bdf] = m["uuid"]
                self._ctx.last_gpu_bdf = bdf
        m = _SERIAL.search(text)
        if m and self._ctx.last_gpu_bdf:
            self._ctx.serial_by_bdf[self._ctx.last_gpu_bdf] = m["serial"]

    # ------------------------------------------------------------------ records

    def _apply_detail(self, rec: _Record, text: str) -> None:
        d = detail(rec.cand.kind, text)
        if not d:
            return
        c = rec.cand
        if "pid" in d and c.pid is None:
            c.pid = int(d["pid"])  # type: ignore[arg-type]
            if d.get("process"):
                c.attrs.setdefault("process", d["process"])
        if "kind" in d:
            c.kind = str(d["kind"])
        if d.get("bdf") and c.bdf is None:
            c.bdf = str(d["bdf"])
            if c.kind.startswith("ghes_"):
                c.component = Component.PCIE
        for k in ("aer_status", "aer_mask", "ghes_section", "mce_addr"):
            if k in d:
                c.attrs.setdefault(k, d[k])
        if "ghes_section" in d and c.component is None:
            c.component = ghes_component(str(d["ghes_section"]))
        if "aer_error" in d:
            prev = c.attrs.get("aer_errors")
            c.attrs["aer_errors"] = f"{prev}; {d['aer_error']}" if prev else d["aer_error"]

    def _absorb(self, rec: _Record, cand: Candidate, f: Framed, text: str) -> bool:
        """Lines that belong to the open record although they match a head: a crash caused by an open
        hardware record (`CAUSE_FAMILIES`), and the body lines of an open GHES record (its `event severity:`
        line sets the kind; a panic upgrades it to ghes_fatal)."""
        a = rec.cand
        if cand.family == "crash" and a.family in CAUSE_FAMILIES and rec.near(f.ts, CAUSE_WINDOW_S):
            if len(rec.lines) >= MAX_RECORD_LINES:
                return False
            a.attrs.setdefault("followed_by", cand.kind)
            if "panic_reason" in cand.attrs:
                a.attrs.setdefault("panic_reason", cand.attrs["panic_reason"])
            return True
        if cand.form is not None and a.family == cand.family and rec.near(f.ts):
            if a.form is not None and not rec.forms:
                rec.forms.add(a.form)
            if cand.form not in rec.forms and (a.pid is None or cand.pid is None or a.pid == cand.pid):
                # the next line of the same report (OOM: invoked -> summary -> Killed process): one event
                rec.forms.add(cand.form)
                if a.pid is None and cand.pid is not None:
                    a.pid = cand.pid
                    a.message = f.text.strip()
                elif cand.form == "killed":  # the line an operator knows the kill by
                    a.message = f.text.strip()
                for k, v in cand.attrs.items():
                    a.attrs.setdefault(k, v)
                return True
        if {a.family, cand.family} == GPU_LOST_AND_BOOT and rec.near(f.ts) and (a.bdf is None or cand.bdf is None
                                                                              or a.bdf == cand.bdf):
            # a GPU off the bus and the driver failing to initialise it: one condition, read as the GPU lost
            if a.family == "gpu_boot":
                cand.bdf = cand.bdf or a.bdf
                for k, v in a.attrs.items():
                    cand.attrs.setdefault(k, v)
                cand.attrs.setdefault("followed_by", a.kind)
                cand.message = cand.message or f.text.strip()
                rec.cand = cand
            else:
                a.attrs.setdefault("followed_by", cand.kind)
            return True
        if a.kind.startswith("ghes_") and cand.kind.startswith("ghes_") and cand.detail and rec.near(f.ts):
            if "cper_severity" in cand.attrs or "panic_reason" in cand.attrs:
                a.kind = cand.kind
            for k, v in cand.attrs.items():
                a.attrs.setdefault(k, v)
            a.component = a.component or cand.component
            self._apply_detail(rec, text)
            return True
        return False

    def _sev(self, kind: str) -> int:
        entry = self.catalog.kinds.get(kind)
        return entry.severity.rank if entry else 1

    def _merge(self, rec: _Record, cand: Candidate, f: Framed) -> bool:
        a = rec.cand
        window_s = FAMILY_WINDOW_S.get(a.family or "", RECORD_WINDOW_S) if a.family == cand.family else RECORD_WINDOW_S
        if not rec.near(f.ts, window_s) or len(rec.lines) >= MAX_RECORD_LINES:
            return False
        same_dev = a.bdf == cand.bdf and a.dev_name == cand.dev_name and a.port == cand.port
        if a.kind == cand.kind and a.code == cand.code and same_dev and a.pid == cand.pid and a.healthy == cand.healthy:
            if a.detail and not cand.detail and rec.count == 1:
                # the report's own line after its announcement (`Machine check events logged`, then the bank)
                a.detail, a.priority, a.message = False, max(a.priority, cand.priority), f.text.strip()
            elif not cand.detail:
                rec.count += 1
            for k, v in cand.attrs.items():
                a.attrs.setdefault(k, v)
            return True
        if a.family is None or a.family != cand.family:
            return False
        if a.kind == cand.kind and a.bdf is None and a.dev_name is None and (cand.bdf or cand.dev_name):
            # a device-less first line (e.g. the WARNING at dev_watchdog) refined by the line naming the device
            a.bdf, a.dev_name, a.port = cand.bdf, cand.dev_name, cand.port
            a.component = a.component or cand.component
            for k, v in cand.attrs.items():
                a.attrs.setdefault(k, v)
            a.message = f.text.strip()
            return True
        compatible = (
            (a.bdf is None or cand.bdf is None or a.bdf == cand.bdf)
            and (a.dev_name is None or cand.dev_name is None or a.dev_name == cand.dev_name)
            and (a.pid is None or cand.pid is None or a.pid == cand.pid)
        )
        if not compatible or (a.kind == cand.kind and a.code == cand.code and not cand.detail):
            return False
        upgrade = (self._sev_of(cand), cand.priority) > (self._sev_of(a), a.priority)
        if upgrade:
            new = cand
            new.bdf = new.bdf or a.bdf
            new.dev_name = new.dev_name or a.dev_name
            new.pid = new.pid if new.pid is not None else a.pid
            new.component = new.component or a.component
            for k, v in a.attrs.items():
                new.attrs.setdefault(k, v)
            new.message = a.message if cand.detail else (new.message or "")
            rec.cand = new
            if not new.message:
                new.message = f.text.strip()
        else:
            a.bdf = a.bdf or cand.bdf
            a.pid = a.pid if a.pid is not None else cand.pid
            for k, v in cand.attrs.items():
                a.attrs.setdefault(k, v)
        return True

    def _sev_of(self, c: Candidate) -> int:
        if c.kind == "xid" and c.code is not None:
            entry = self.catalog.xids.get(c.code)
            return entry.base_severity.rank if entry else 1
        return self._sev(c.kind)

    def _close(self, out: list[FaultEvent]) -> None:
        rec, self._record = self._record, None
        if rec is None:
            return
        ev = self._event(rec)
        if ev is not None:
            out.append(ev)

    def _event(self, rec: _Record) -> FaultEvent | None:
        c = rec.cand
        attrs: dict[str, Attr] = dict(c.attrs)
        if rec.count > 1:
            attrs["count"] = rec.count
        if rec.stamp:
            attrs["kernel_time"] = rec.stamp
        if rec.wall and rec.wall != rec.stamp:
            attrs["collector_time"] = rec.wall
        if c.kind == "mce_corrected_repeated" and rec.stamp and _uptime(rec.stamp) < BOOT_POLL_S:
            c.kind = "mce"  # the CPU-online scan of a bank left from before this boot (BOOT_POLL_S)
            attrs["boot_scan"] = True
        if c.kind in PER_LINE_KINDS:
            self._escalate_burst(rec, attrs)
        self._escalate(rec, attrs)
        if c.kind == "xid":
            if self._ctx.driver_version:
                attrs.setdefault("driver_version", self._ctx.driver_version)
        if c.healthy:
            # Contract: a clearing event carries the kind it clears (same fault_key), healthy=True.
            entry = self.catalog.kinds.get(c.kind)
            if entry is not None and entry.clears:
                attrs["clearing_kind"] = c.kind
                c.kind = entry.clears[0]
        uuid = self._ctx.uuid_by_bdf.get(c.bdf or "")
        serial = self._ctx.serial_by_bdf.get(c.bdf or "")
        message = c.message or c.kind
        if rec.count > 1:
            message = f"{message} ({rec.count} times)"  # not "(x16)": read as a PCIe width
        draft = FaultEvent(
            cluster=self.cluster,
            node=self.node,
            component=c.component or Component.KERNEL,
            device=Device(pci_bus_id=c.bdf, name=c.dev_name, port=c.port, uuid=uuid, serial=serial),
            kind=c.kind,
            code=c.code,
            severity=Severity.INFO,
            healthy=c.healthy,
            message=message[:4000],
            source=Source.KMSG,
            raw="\n".join(rec.lines),
            agent_version=self.agent_version,
            pid=c.pid,
            attrs=attrs,
        )
        cls = self.catalog.classify(draft)
        if cls.unit:
            attrs["unit"] = cls.unit
        if cls.resolution is not None:
            attrs["resolution"] = cls.resolution.value
        component = c.component or cls.component or Component.KERNEL
        update: dict[str, object] = {"severity": cls.severity, "component": component, "attrs": attrs}
        if self.event_id_for is not None and rec.origin is not None:
            last, n = self._last_id_origin
            n = n + 1 if last == rec.origin else 0
            self._last_id_origin = (rec.origin, n)
            update["event_id"] = self.event_id_for(rec.origin, n)
        return self.catalog.stamp(draft.model_copy(update=update), classification=cls)  # classified once, here


    def _escalate_burst(self, rec: _Record, attrs: dict[str, Attr]) -> None:
        """A burst of a `PER_LINE_KINDS` kind on one PCI device within the catalog's window becomes its
        `escalate_to` kind (`[kind.aer_corrected]`: 3 within 60 s -> aer_corrected_burst, attr
        `burst_count`). Every line of the record counts (a record of repeats holds several errors); a
        record without a PCI address counts nowhere. Records without timestamps count as within the window."""
        c = rec.cand
        entry = self.catalog.kinds.get(c.kind)
        if entry is None or not entry.escalate_to or not entry.escalate_count or not c.bdf:
            return
        hist = self._burst_history.setdefault(f"{c.kind}|{c.bdf}", deque(maxlen=max(64, entry.escalate_count * 4)))
        for _ in range(rec.count):
            hist.append(rec.ts_last)
        now = rec.ts_last
        window = entry.escalate_window_s or 0.0
        recent = [t for t in hist if t is None or now is None or now - t <= window]
        if len(recent) >= entry.escalate_count:
            c.kind = entry.escalate_to
            attrs["burst_count"] = len(recent)

    def _escalate(self, rec: _Record, attrs: dict[str, Attr]) -> None:
        """Repeats of a kind on one device within the catalog's window become its `escalate_to` kind
        (`[kind.X] escalate_to/escalate_count/escalate_window_s`, e.g. nic_tx_timeout ->
        nic_tx_timeout_repeated). One record (one episode: a watchdog line and its driver follow-ups) counts
        once. Records without timestamps count as within the window. `PER_LINE_KINDS` count in
        `_escalate_burst` instead."""
        c = rec.cand
        entry = self.catalog.kinds.get(c.kind)
        if entry is None or not entry.escalate_to or not entry.escalate_count or c.kind in PER_LINE_KINDS:
            return
        if c.kind in ESCALATE_KEY_ATTR:
            at = attrs.get(ESCALATE_KEY_ATTR[c.kind])
            if at is None:
                return
            key = f"{c.kind}|{at}"
        else:
            key = f"{c.kind}|{c.bdf or c.dev_name or ''}"
        hist = self._repeat_history.setdefault(key, deque(maxlen=max(entry.escalate_count, 1) * 4))
        occurrences = sum("NETDEV WATCHDOG" in line for line in rec.lines) or 1
        for _ in range(min(occurrences, hist.maxlen or 1)):
            hist.append(rec.ts_last)
        now = rec.ts_last
        window = entry.escalate_window_s or 0.0
        recent = [t for t in hist if t is None or now is None or 0 <= now - t <= window]
        if len(recent) >= entry.escalate_count:
            attrs["repeat_count"] = len(recent)
            attrs["repeat_window_s"] = window
            c.kind = entry.escalate_to


def parse_text(
    text: str,
    cluster: str = "local",
    node: str | None = None,
    catalog: Catalog | None = None,
    agent_version: str = "unknown",
    driver_version: str | None = None,
) -> list[FaultEvent]:
    """Parse a whole kernel log text (any framing in `framing.py`).

    Args:
        text: dmesg / journald / syslog / raw /dev/kmsg text, several lines.
        cluster, node: stamped on the events; node defaults to this host's short name.
        catalog: default the packaged catalog.
        agent_version, driver_version: as `KmsgParser`.
    Returns:
        Events in the order their records appear (root cause first where the text shows it).
    """
    if node is None:
        from fleetmend.config import default_node_name

        node = default_node_name()
    p = KmsgParser(cluster, node, agent_version, catalog=catalog, driver_version=driver_version)
    out: list[FaultEvent] = []
    for line in text.splitlines():
        out.extend(p.feed(line))
    out.extend(p.flush())
    return out


def _uptime(stamp: str) -> float:
    """A kernel uptime stamp (`0.644337`) as seconds; any other stamp (a wall date) is infinitely late."""
    try:
        return float(stamp)
    except ValueError:
        return float("inf")


def _same_condition(a: Candidate, b: Candidate) -> bool:
    """`b` repeats `a`'s fault (kind, code, device, process, health): what `KmsgParser._merge` counts as a repeat."""
    return (a.kind == b.kind and a.code == b.code and a.bdf == b.bdf and a.dev_name == b.dev_name
            and a.port == b.port and a.pid == b.pid and a.healthy == b.healthy)
