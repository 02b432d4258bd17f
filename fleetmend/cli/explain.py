"""`fleetmend explain`: classify fault text offline (kernel logs, nvidia-smi, DCGM, other tools) and say
what the catalog says about it.

The CLI (`fleetmend explain [FILE|-] [--json] [--exit-zero]`, the command `explain`) reads the
input with `explain_stream`: up to `WHOLE_MAX_BYTES` it is read whole and every parser runs over it
(`explain_text`); a larger input is read as a kernel log, streamed in bounded memory
(`agents.kmsg.stream.parse_stream`). Each event is printed as it is found (`render_entry` or
`explained_json`), a summary last; the exit status follows health-check convention (`exit_status`).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

import typer
from rich.console import Console
from rich.markup import escape
from rich.text import Text
from typer.core import TyperCommand

from fleetmend.catalog import Catalog, Classification, default_catalog
from fleetmend.cli.common import err, out
from fleetmend.events import FaultEvent, Severity, device_label

EXIT_OK, EXIT_DEGRADED, EXIT_FATAL, EXIT_UNREADABLE = 0, 1, 2, 3
EXIT_STDOUT_CLOSED = 128 + 13
"""The reader of standard output went away (`fleetmend explain big.log | head`): the status of a command killed
by SIGPIPE (13), as `cat` gives there, silently; not click's 1, which here reads as "degraded"."""
"""Health-check convention (the Nagios plugin statuses OK, WARNING, CRITICAL, UNKNOWN): 0 nothing to act
on (no fault, or only info and cleared ones), 1 the worst finding is degraded, 2 a fatal finding,
3 the input could not be read (no such file, a directory, no permission, binary data) or bad usage."""
WHOLE_MAX_BYTES = 8 * 1024 * 1024
"""Inputs up to 8 MiB are read whole and run through every parser (a paste of tool output and logs);
a larger input is a kernel log in practice and is streamed through the kernel-log parser only."""
_BINARY_SNIFF_BYTES = 64 * 1024
_BINARY_CONTROL_SHARE = 0.05
"""Text with NUL bytes is binary when, NULs left out, over 5 % of the first 64 KiB are other control bytes
(not tab, newline, CR, form feed, vertical tab, backspace, ESC): a log has next to none, an executable or random
data about 10-40 %. NUL runs alone are what a crash or power loss leaves in /var/log/kern.log, syslog, messages (the
filesystem zero-fills the unflushed tail): they are line breaks there, not a reason to refuse the log."""
_NUL_RUN = re.compile(rb"\x00+")
_TEXT_BYTES = bytes(b for b in range(256) if 0x20 <= b != 0x7F or b in b"\t\n\r\x0b\x0c\x08\x1b")


class UnreadableInput(Exception):
    """The input is not text we can read (binary data); the message says what it looked like."""


@dataclass(frozen=True)
class Explained:
    """One parsed event and the catalog's classification of it."""

    event: FaultEvent
    classification: Classification


def explain_text(text: str, catalog: Catalog | None = None, node: str = "local") -> list[Explained]:
    """Parse any text the agent meets and classify every event: kernel logs (dmesg, journald,
    syslog, raw /dev/kmsg), `nvidia-smi` (table, `-q`, CSV queries), DCGM (`dcgmi diag`,
    `dcgmi health`, `dcgmi nvlink`, dcgm-exporter metrics) and other tools (device-plugin, CUDA and
    NCCL logs, mcelog, ibstat, ibv_devinfo, ibdev2netdev, BMC SEL). Formats: `agents.parsers`.

    Args:
        text: the text, several lines; a paste may mix formats.
        catalog: default the packaged catalog (pass `load_catalog(overrides)` for operator overrides).
        node: node name stamped on the events (default "local").
    Returns:
        `Explained` per event, in log order.
    """
    from agents.parsers import parse_any  # lazily: only this command needs the agent's parsers

    cat = catalog or default_catalog()
    events = parse_any(text, cluster="local", node=node, catalog=cat)
    return [Explained(e, cat.classify(e)) for e in events]


def _looks_binary(head: bytes) -> bool:
    """Compressed data by its magic bytes, or (NULs left out) mostly control bytes (`_BINARY_CONTROL_SHARE`)."""
    if any(head.startswith(magic) for magic, _, _ in _COMPRESSED):
        return True
    sniff = head[:_BINARY_SNIFF_BYTES]
    nuls = sniff.count(b"\x00")
    if nuls > len(sniff) // 10 and nuls < 2 * len(_NUL_RUN.findall(sniff)):
        return True  # NULs scattered one by one through the data (UTF-16 text, records of binary fields): no zero-fill
    rest = sniff.replace(b"\x00", b"")
    controls = len(rest.translate(None, _TEXT_BYTES))  # what is left once the text bytes are deleted
    return controls > _BINARY_CONTROL_SHARE * len(rest)


def _nul_runs_as_breaks(data: bytes, run: ExplainRun) -> bytes:
    """Each run of NUL bytes becomes one line break (the lines either side stay apart); counted in `run`."""
    if b"\x00" not in data:
        return data
    run.nul_bytes += data.count(b"\x00")
    return _NUL_RUN.sub(b"\n", data)


class _NulSkipping:
    """A binary stream whose NUL runs read as line breaks (`_nul_runs_as_breaks`)."""

    def __init__(self, stream: Any, run: ExplainRun) -> None:
        self.stream, self.run = stream, run

    def read(self, n: int = -1) -> bytes:
        return _nul_runs_as_breaks(self.stream.read(n), self.run)


class _Prefixed:
    """A binary stream that first returns `head` (already read) and then the rest of `stream`."""

    def __init__(self, head: bytes, stream: IO[bytes]) -> None:
        self.head, self.stream = head, stream

    def read(self, n: int = -1) -> bytes:
        if self.head:
            chunk, self.head = (self.head, b"") if n < 0 or n >= len(self.head) else (self.head[:n], self.head[n:])
            return chunk
        return self.stream.read(n)


@dataclass
class ExplainRun:
    """What `explain_stream` found so far: `mode` ("whole" or "stream"), counts by severity word
    ("fatal", "degraded", "info", "cleared"), whether any finding asks for a drain, and the worst severity
    of the non-clearing findings (None: none). A fault repeated past the parser's record cap comes in parts
    (`agents.kmsg.parser.MAX_RECORD_LINES`): the parts after the first (`attrs["continued"]`) are counted in
    `continued`, not as more faults."""

    mode: str = "whole"
    counts: dict[str, int] = field(default_factory=dict)
    drain: bool = False
    worst: Severity | None = None
    nul_bytes: int = 0
    continued: int = 0

    def note(self, x: Explained) -> None:
        key = "cleared" if x.event.healthy else x.event.severity.value
        if x.event.attrs.get("continued"):
            self.continued += 1
        else:
            self.counts[key] = self.counts.get(key, 0) + 1
        if not x.event.healthy:
            self.drain = self.drain or x.classification.drain
            if self.worst is None or x.event.severity.rank > self.worst.rank:
                self.worst = x.event.severity

    @property
    def total(self) -> int:
        return sum(self.counts.values())




def explain_stream(stream: IO[bytes], run: ExplainRun | None = None, catalog: Catalog | None = None,
                   node: str = "local") -> Iterator[Explained]:
    """Explain a binary stream of any size, yielding each event as it is found (log order).

    Up to `WHOLE_MAX_BYTES` the input is read whole and given to `explain_text` (every format). A larger
    input is streamed through the kernel-log parser in bounded memory (about 10 MiB of buffers); tool
    outputs inside it (nvidia-smi, DCGM, ...) are not read. `run` (when given) records the mode, the
    counts and the worst severity as events are yielded.

    Raises:
        UnreadableInput: compressed data, or the first 64 KiB hold NUL bytes and, those left out, mostly
            control bytes (binary data, not a log: `_looks_binary`). NUL runs in a text are line breaks
            (counted in `run.nul_bytes`).
        OSError: reading the stream failed.
    """
    from agents.kmsg import KmsgParser  # lazily, as explain_text: only this command needs the agent's parsers
    from agents.kmsg.stream import parse_stream

    run = run if run is not None else ExplainRun()
    cat = catalog or default_catalog()
    head = stream.read(WHOLE_MAX_BYTES + 1)
    if b"\x00" in head[:_BINARY_SNIFF_BYTES] and _looks_binary(head):
        raise UnreadableInput(_binary_kind(head))
    if len(head) <= WHOLE_MAX_BYTES:
        run.mode = "whole"
        text = _nul_runs_as_breaks(head, run).decode("utf-8", "replace")
        for x in explain_text(text, catalog=cat, node=node):
            run.note(x)
            yield x
        return
    run.mode = "stream"
    parser = KmsgParser("local", node, "unknown", catalog=cat)
    for ev in parse_stream(cast(IO[bytes], _NulSkipping(_Prefixed(head, stream), run)), parser):
        x = Explained(ev, cat.classify(ev))
        run.note(x)
        yield x


_COMPRESSED = ((b"\x1f\x8b", "gzip-compressed", "zcat"), (b"\x28\xb5\x2f\xfd", "zstd-compressed", "zstdcat"),
               (b"\xfd7zXZ\x00", "xz-compressed", "xzcat"), (b"BZh", "bzip2-compressed", "bzcat"))
"""(magic bytes, what it is, the tool that decompresses it to standard output)."""


def _binary_kind(head: bytes) -> str:
    """What binary input looks like, and for a compressed log the command that reads it."""
    for magic, what, tool in _COMPRESSED:
        if head.startswith(magic):
            return f"{what} data, not a text log (decompress it first: {tool} FILE | fleetmend explain -)"
    return "binary data, not a text log (a kernel log or tool output is text)"


def exit_status(run: ExplainRun, exit_zero: bool = False) -> int:
    """`EXIT_FATAL` / `EXIT_DEGRADED` by the worst non-clearing finding, else `EXIT_OK`; 0 with `exit_zero`."""
    if exit_zero or run.worst is None or run.worst is Severity.INFO:
        return EXIT_OK
    return EXIT_FATAL if run.worst is Severity.FATAL else EXIT_DEGRADED


def explained_json(e: Explained) -> dict[str, Any]:
    """One JSON-ready dict: the FaultEvent fields (`model_dump(mode="json")`, without its `verdict`: the
    verdict's fields are the flat keys below, each said once) plus the catalog's view.

    Naming: the event's own `source` (the probe, e.g. "kmsg") stays `source`, as on the wire; the
    catalog entry's citation is `catalog_source`. Added keys: `immediate_action`,
    `investigatory_action`, `catalog_source`, `fault_class`, `drain`, `description`, and
    `resolution`/`unit` (XID 144-150 decode; None otherwise). A clearing event (`healthy`) shows the kind its
    line says (`attrs.clearing_kind`, e.g. `nic_link_up`) as `kind` and the kind it clears as `clears`: on the
    wire it travels under the kind it clears (same `fault_key`).
    """
    row = e.event.model_dump(mode="json", exclude={"verdict"})  # its fields are the flat ones below
    c = e.classification
    clearing = e.event.attrs.get("clearing_kind") if e.event.healthy else None
    if clearing:  # a clearing event travels under the kind it clears (one fault_key); a reader sees what it says
        row["clears"], row["kind"] = row["kind"], clearing
    row.update(
        immediate_action=c.immediate_action.value,
        investigatory_action=c.investigatory_action,
        catalog_source=c.source,
        fault_class=c.fault_class,
        drain=c.drain,
        description=c.description,
        resolution=c.resolution.value if c.resolution else None,
        unit=c.unit,
    )
    return row


_STYLE = {Severity.INFO: "green", Severity.DEGRADED: "yellow", Severity.FATAL: "bold red"}


def render_table(explained: list[Explained], console: Console) -> None:
    """Print a summary line, then each fault as a two-line entry (`render_entry`)."""
    run = ExplainRun()
    for x in explained:
        run.note(x)
    render_summary(run, console)
    for x in explained:
        render_entry(x, console)


def render_summary(run: ExplainRun, console: Console) -> None:
    """One line: counts by severity and whether the node should be drained."""
    counts = ", ".join(f"{n} {k}" for k, n in sorted(run.counts.items()))
    parts = (f" (+{run.continued} continuation row(s): a fault repeating past {_record_cap()} lines comes in parts)"
             if run.continued else "")
    console.print(Text.assemble((f"{run.total} fault(s): {counts}{parts}. ", "bold"),
                                ("Recommendation: drain the node." if run.drain else "No drain needed.",
                                 "bold red" if run.drain else "green")))


def render_entry(x: Explained, console: Console) -> None:
    """Print one fault as a two-line entry that reads at any terminal width:

        Aug 10 15:36:05  XID 48  gpu 0000:55:00.0  fatal  → WORKFLOW_XID_48, drain
            An uncorrectable double bit error (DBE) has been detected on GPU ...

    Time is the kernel's own stamp where the text had one (`attrs["kernel_time"]`), else the wall
    stamp printed around it (`attrs["collector_time"]`, e.g. `dmesg -H`), else the time the event was
    observed. Healthy (clearing) events show severity "cleared".
    """
    when, component, kind, dev, sev, action, drain_s, msg = _row(x)
    line = Text.assemble((f"{when}  ", "dim"), (f"{kind}  ", "bold"), f"{component} {dev}  ",
                         (_plain(sev), _STYLE[x.event.severity] if not x.event.healthy else "green"),
                         f"  → {action}" + (", drain" if drain_s == "yes" else ""),
                         (_times(x.event), "dim"))
    console.print(line, overflow="fold")
    console.print(Text("    " + msg), overflow="fold")


def _record_cap() -> int:
    from agents.kmsg.parser import MAX_RECORD_LINES  # lazily, as the parsers

    return MAX_RECORD_LINES


def _times(ev: FaultEvent) -> str:
    """`  400 times`; a part after the first of one fault's long run: `  400 more times (the same fault, continued)`."""
    n = int(ev.attrs.get("count") or 1)
    if ev.attrs.get("continued"):
        return f"  {n} more time(s) (the same fault, continued)"
    return f"  {n} times" if n > 1 else ""


def _plain(cell: str) -> str:
    return cell.split("]", 1)[1].rsplit("[/]", 1)[0] if cell.startswith("[") else cell


def _row(x: Explained) -> list[str]:
    """One table row; "what" is the driver's own text after the XID framing where there is one."""
    ev, c = x.event, x.classification
    when = str(ev.attrs.get("kernel_time") or ev.attrs.get("collector_time")
               or ev.observed_at.strftime("%Y-%m-%d %H:%M:%S"))
    shown = str(ev.attrs.get("clearing_kind") or ev.kind) if ev.healthy else ev.kind
    kind = f"XID {ev.code}" if ev.kind == "xid" else (f"{shown} {ev.code}" if ev.code is not None else shown)
    dev = device_label(ev.device) or "-"  # the one device form (a GPU by index: gpu:7)
    if ev.device.port is not None:
        dev = f"{dev} port {ev.device.port}"
    sev = "cleared" if ev.healthy else ev.severity.value
    action = c.immediate_action.value + (f" ({c.resolution.value})" if c.resolution else "")
    msg = str(ev.attrs.get("xid_text") or ev.message)
    return [when, ev.component.value, kind, dev, f"[{_STYLE[ev.severity]}]{sev}[/]", action,
            "yes" if c.drain else "no", msg]


EXPLAIN_EPILOG = """Exit statuses (health-check convention):

\b
  0    nothing to act on: no fault, or only info / cleared ones (always 0 with --exit-zero)
  1    the worst finding is degraded
  2    a fatal finding
  3    the input could not be read (no such file, a directory, no permission, binary data) or bad usage
  141  standard output was closed before the end (e.g. `| head`), as for a command killed by SIGPIPE

Inputs up to 8 MiB are read whole (kernel logs and tool outputs); a larger input is streamed as a
kernel log in bounded memory. Faults are printed as they are found; the summary comes last."""


class _ExplainCommand(TyperCommand):
    """Bad usage exits `EXIT_UNREADABLE` (UNKNOWN, as health checks do) instead of click's 2."""

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except Exception as e:
            # click's UsageError (typer vendors click in some versions: matched by class name)
            if any(c.__name__ == "UsageError" for c in type(e).__mro__):
                e.exit_code = EXIT_UNREADABLE  # type: ignore[attr-defined]
            raise


app = typer.Typer(rich_markup_mode=None, add_completion=False)
"""`fleetmend explain` (top-level: added to the root app without a group name; plain help, as the root's)."""


def explain_main(args: list[str]) -> None:
    """`fleetmend explain ARGS` as the console script runs it: this one command without the rest of the app
    (whose imports, nats-py, aiohttp, temporalio, the Kubernetes client, were half of explain's start-up);
    the same options, help, logging (warnings, to stderr) and exit statuses. Does not return."""
    import os

    import typer.main

    from fleetmend.cli.common import run_and_exit
    from fleetmend.infra.logs import configure_logging

    configure_logging(os.environ.get("FLEETMEND_LOG_FORMAT", "auto"), level="warning")
    command = typer.main.get_command(app)
    run_and_exit(lambda: command.main(args=args, prog_name="fleetmend explain"))


@app.command(cls=_ExplainCommand, epilog=EXPLAIN_EPILOG)
def explain(
    file: str = typer.Argument("-", help="Kernel log or tool output file, or - for standard input."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object a line."),
    exit_zero: bool = typer.Option(False, "--exit-zero",
                                   help="Exit 0 whatever was found (3 still means unreadable input)."),
) -> None:
    """Parse a dmesg/journal/kmsg text or tool output (no server needed) and say what each fault
    means and what to do."""
    run = ExplainRun()
    if file == "-" and sys.stdin.isatty():  # nothing piped: say so instead of waiting on the terminal
        err.print("[red]error:[/red] no input: give a file (`fleetmend explain dmesg.txt`) or pipe one "
                  "(`dmesg | fleetmend explain`)")
        raise typer.Exit(EXIT_UNREADABLE)
    # rich's console meets a closed pipe with SystemExit(1) (Console.on_broken_pipe): here it raises, to be told apart
    prior = vars(out).get("on_broken_pipe")
    out.on_broken_pipe = _raise_broken_pipe  # type: ignore[method-assign]
    try:
        _explain_to_stdout(file, run, as_json)
    except BrokenPipeError:
        _quiet_stdout()
        raise typer.Exit(EXIT_STDOUT_CLOSED) from None
    finally:
        if prior is None:
            del out.on_broken_pipe
        else:
            out.on_broken_pipe = prior  # type: ignore[method-assign]
    if run.mode == "stream":
        err.print(f"(input over {WHOLE_MAX_BYTES // 2**20} MiB: read as a kernel log, streamed)")
    raise typer.Exit(exit_status(run, exit_zero))


def _raise_broken_pipe() -> None:
    raise BrokenPipeError


def _quiet_stdout() -> None:
    """Standard output onto /dev/null, so that the interpreter's last flush of what is still buffered for the
    closed pipe does not fail again (the Python documentation's handling of SIGPIPE, `signal` module notes)."""
    import os

    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        out.quiet = True
    except (OSError, ValueError, AttributeError):  # no file descriptor behind stdout (a test's capture): nothing to quiet
        pass


def _explain_to_stdout(file: str, run: ExplainRun, as_json: bool) -> None:
    """Read FILE (or standard input), print each finding, then the summary, and flush: a closed standard
    output raises BrokenPipeError here (to `explain`), whichever write meets it."""
    try:
        if file == "-":
            stream: IO[bytes] = sys.stdin.buffer
        else:
            p = Path(file)
            if p.is_dir():
                raise IsADirectoryError(file)
            stream = p.open("rb")
        with stream:
            for x in explain_stream(stream, run):
                if as_json:
                    sys.stdout.write(json.dumps(explained_json(x), default=str) + "\n")
                else:
                    render_entry(x, out)
    except BrokenPipeError:
        raise
    except (OSError, UnreadableInput) as e:
        known: dict[type[Exception], str] = {FileNotFoundError: "no such file", IsADirectoryError: "is a directory",
                                             PermissionError: "permission denied"}
        why = known.get(type(e)) or (
            str(e) if isinstance(e, UnreadableInput) else (e.strerror or str(e)))
        err.print(f"[red]error:[/red] cannot read {escape(file)}: {escape(why)}")
        raise typer.Exit(EXIT_UNREADABLE) from e
    if not as_json:
        if run.total == 0:
            out.print("no faults found")
        else:
            render_summary(run, out)
    if run.nul_bytes:
        err.print(f"({run.nul_bytes} NUL byte(s) skipped: a zero-filled stretch, as a crash or power loss leaves "
                  "in a log)")
    sys.stdout.flush()
