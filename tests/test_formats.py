"""Issue 29 point 1: every format string in `fleetmend/catalog/source/formats.tsv` (taken from the driver's or
tool's source at a named version), filled with arbitrary arguments, is read as its listed kind with its device.

Real captures (tests/corpus) stay the tests of record; this is what makes an unseen wording of a known message
read right. The synthesis: each C conversion (`%d`, `%04x`, `%llu`, `%s`, `%pg`, ...) takes any value of its
type unless the row's `args` constrains it; the prefix's `{bdf}`/`{name}`/`{drv}` are generated; a kmsg row is
framed, line by line, in one of the framings the deframer reads (`FRAMINGS`: dmesg, dmesg -T/-H/-x, syslog,
journald, /dev/kmsg records, bare lines), drawn per example. Rows of kind `silent` are healthy messages of a family
that is read: they must publish nothing.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agents.kmsg import parse_text
from agents.kmsg.matchers import normalize_bdf
from agents.parsers import parse_any
from fleetmend.catalog import default_catalog

TABLE = Path(__file__).resolve().parents[1] / "fleetmend" / "catalog" / "source" / "formats.tsv"
_CONV = re.compile(r"%(?P<flags>[-#0 +]*)(?P<width>\d+)?(?P<len>hh|h|ll|l|L|z)?(?P<conv>[diuxXcsp%])")


def rows() -> list[dict[str, str]]:
    lines = [ln for ln in TABLE.read_text().splitlines() if ln and not ln.startswith("#")]
    return list(csv.DictReader(lines, delimiter="\t", quoting=csv.QUOTE_NONE))


READ = [r for r in rows() if r["kind"] != "-"]


def _args(spec: str) -> dict[str, st.SearchStrategy[str | int]]:
    out: dict[str, st.SearchStrategy[str | int]] = {}
    if spec == "-":
        return out
    for part in spec.split(";"):
        key, _, val = part.partition("=")
        if val.startswith("re:"):
            out[key] = st.from_regex(f"^{val[3:]}$", fullmatch=True)
        elif re.fullmatch(r"-?(?:0x)?[0-9a-f]+\.\.-?(?:0x)?[0-9a-f]+", val):
            lo, hi = (int(x, 0) for x in val.split(".."))
            out[key] = st.integers(lo, hi)
        else:
            out[key] = st.sampled_from(val.split("|"))
    return out


_WORD = st.from_regex(r"^[A-Za-z][A-Za-z0-9_]{0,11}$", fullmatch=True)
_BLOCKDEV = st.from_regex(r"^(sd[a-z]{1,2}[0-9]?|nvme[0-9]{1,2}n[0-9]{1,2}(p[0-9])?|nvme[0-9]c[0-9]n[0-9]|vd[a-z][0-9]?|"
                          r"xvd[a-z]|dm-[0-9]{1,2}|md[0-9]{1,3}(p[0-9])?)$", fullmatch=True)


def _kmsg_pri(i: int) -> str:
    return f"3,{5000 + i},{(1000 + i) * 1_000_000 + 123456},-;"


FRAMINGS: dict[str, object] = {
    "dmesg": lambda i: f"[{1000 + i:>5}.{123456 + i:06d}] ",
    "dmesg -T": lambda i: f"[Mon Dec  1 10:00:{i % 60:02d} 2026] ",
    "dmesg -H": lambda i: "[Dec 1 10:00] " if i == 0 else f"[  +0.{12 + i:06d}] ",
    "dmesg -x": lambda i: f"kern  :err   : [{1000 + i:>5}.{123456 + i:06d}] ",
    "dmesg -r": lambda i: f"<3>[{1000 + i:>5}.{123456 + i:06d}] ",
    "syslog": lambda i: f"Dec  1 10:00:{i % 60:02d} node-a01 kernel: ",
    "syslog+uptime": lambda i: f"Dec  1 10:00:{i % 60:02d} node-a01 kernel: [{1000 + i:>5}.{123456 + i:06d}] ",
    "journalctl -o short-iso": lambda i: f"2026-12-01T10:00:{i % 60:02d}+0000 node-a01 kernel: ",
    "journalctl -o short-precise": lambda i: f"Dec 01 10:00:{i % 60:02d}.{123456 + i:06d} node-a01 kernel: ",
    "journalctl -o short-iso-precise": lambda i: f"2026-12-01T10:00:{i % 60:02d}.{123456 + i:06d}+00:00 node-a01 kernel: ",
    "journalctl -o short-monotonic": lambda i: f"[{1000 + i:>5}.{123456 + i:06d}] node-a01 kernel: ",
    "journalctl -o short-unix": lambda i: f"1764583200.{123456 + i:06d} node-a01 kernel: ",
    "journalctl -o short-full": lambda i: f"Mon 2026-12-01 10:00:{i % 60:02d} UTC node-a01 kernel: ",
    "/dev/kmsg": _kmsg_pri,
    "bare": lambda i: "",
}
"""How a kernel message reaches the parser: util-linux dmesg (default, --ctime, --human, --decode, --raw),
syslog and journald lines (with and without the kernel's own uptime stamp), raw /dev/kmsg records and bare
messages (`NVRM:` at column 0, as pasted)."""


def _default(m: re.Match[str]) -> st.SearchStrategy[str | int]:
    conv, length, width = m["conv"], m["len"] or "", int(m["width"] or 0)
    if conv in "di":
        return st.integers(0, 2**31 - 1)
    if conv in "uxX":
        if width and m["flags"] and "0" in m["flags"] and conv in "xX":
            return st.integers(0, 16**width - 1)
        return st.integers(0, 2**64 - 1 if length in ("ll", "L") else 2**32 - 1)
    if conv == "c":
        return st.sampled_from("abcxyz")
    return _WORD


def _ext(fmt: str, end: int) -> str:
    e = end
    while e < len(fmt) and fmt[e].isalpha() and fmt[e - 1:e + 1] != "ss":
        e += 1
    return fmt[end:e]


def synthesise(fmt: str, draw, constraints: dict) -> tuple[str, list]:
    """`fmt` with each conversion replaced by a drawn value; returns (text, values by conversion number)."""
    out, values, pos, n = [], [], 0, 0
    for m in _CONV.finditer(fmt):
        if m.start() < pos:
            continue
        out.append(fmt[pos:m.start()])
        pos = m.end()
        if m["conv"] == "%":
            out.append("%")
            continue
        n += 1
        ext = _ext(fmt, m.end()) if m["conv"] == "p" else ""
        pos += len(ext)
        strat = constraints.get(str(n))
        if strat is None:
            strat = {"g": _BLOCKDEV, "S": st.from_regex(r"^[a-z_]{3,12}\+0x[0-9a-f]{1,4}/0x[0-9a-f]{2,4}$", fullmatch=True),
                     "x": st.integers(0, 2**64 - 1), "V": _WORD}.get(ext[:1], None) if m["conv"] == "p" else None
            if strat is None:
                strat = _default(m)
        v = draw(strat)
        values.append(v)
        if m["conv"] == "p":
            out.append(f"{v:016x}" if isinstance(v, int) else str(v))
        elif m["conv"] in "diuxXc" and isinstance(v, int):
            spec = "%" + m["flags"] + (m["width"] or "") + (m["conv"] if m["conv"] != "i" else "d")
            out.append(spec % v)
        else:
            out.append(str(v))
    out.append(fmt[pos:])
    return "".join(out), values


_BDF = st.tuples(st.one_of(st.integers(0, 0xFFFF), st.integers(0x10000, 0x1FFFF)), st.integers(0, 255), st.integers(0, 31),
                 st.integers(0, 7)).map(lambda t: f"{t[0]:04x}:{t[1]:02x}:{t[2]:02x}.{t[3]}")
"""The prefix's PCI address: dev_name of a PCI device, `%04x:%02x:%02x.%d`; Intel VMD domains print five digits
(`10000:e1:00.0`)."""


def _expected_device(row: dict[str, str], values: list, holders: dict[str, str]) -> tuple[str, str | None]:
    dev = row["device"]
    if dev == "pci":
        return "pci", normalize_bdf(holders["bdf"])
    if dev == "name":
        return "name", holders["name"]
    if dev.startswith("pci="):
        parts = [int(values[int(i) - 1]) for i in dev[4:].split(",")]
        dom, bus, slot = parts[:3]
        fn = parts[3] if len(parts) > 3 else 0
        return "pci", f"{dom:04x}:{bus:02x}:{slot:02x}.{fn}"
    if dev.startswith("name="):
        return "name", str(values[int(dev[5:]) - 1])
    return "none", None


@pytest.mark.parametrize("row", READ, ids=[f"{r['kind']}:{r['format'][:40]}" for r in READ])
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data())
def test_every_listed_format_reads_as_its_kind_with_its_device(row: dict[str, str], data) -> None:
    constraints = _args(row["args"])
    holders = {"bdf": data.draw(_BDF), "name": str(data.draw(constraints.get("{name}", _WORD))),
               "drv": str(data.draw(constraints.get("{drv}", st.just("mlx5_core"))))}
    text, values = synthesise(row["format"].replace("\\n", "\n").replace("\\t", "\t"), data.draw, constraints)
    prefix = "" if row["prefix"] == "-" else row["prefix"].format(**holders)
    text_lines = text.split("\n")
    if row["reader"] == "kmsg":
        frame = FRAMINGS[data.draw(st.sampled_from(sorted(FRAMINGS)))]
        log = "".join(f"{frame(i)}{prefix}{line}\n" for i, line in enumerate(text_lines))  # type: ignore[operator]
        events = parse_text(log, node="n1")
    else:
        log = "".join(f"{prefix}{line}\n" for line in text_lines)
        events = parse_any(log, node="n1")
    if row["kind"] == "silent":
        assert not events, f"a healthy message published {[e.kind for e in events]}:\n{log}"
        return
    got = [(e.attrs.get("clearing_kind") if e.healthy else e.kind, e) for e in events]
    mine = [e for k, e in got if k == row["kind"]]
    assert mine, f"{row['kind']} not read from:\n{log}\ngot {[k for k, _ in got]}"
    e = mine[0]
    what, want = _expected_device(row, values, holders)
    if what == "pci":
        assert e.device.pci_bus_id == want, (log, e.device)
    elif what == "name":
        assert (e.device.name or "").lower() == str(want).lower(), (log, e.device)
    if row["code"] != "-":
        assert e.code == int(values[int(row["code"]) - 1]), (log, e.code)
    assert e.verdict is not None and e.verdict.fault_class, e


def test_the_table_names_a_source_and_version_for_every_row_and_known_kinds() -> None:
    cat = default_catalog()
    for r in rows():
        assert r["source"] and r["version"] and r["note"], r
        if r["kind"] == "-":
            assert r["note"].startswith("left out") or "not read" in r["note"] or "read by" in r["note"], r
        else:
            assert r["kind"] in ("xid", "silent") or r["kind"] in cat.kinds, r
            assert r["file"] != "-", r


KMSG_READ = [r for r in READ if r["reader"] == "kmsg" and r["kind"] != "silent"]


@pytest.mark.parametrize("row", KMSG_READ, ids=[f"{r['kind']}:{r['format'][:40]}" for r in KMSG_READ])
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data())
def test_every_listed_format_is_found_by_the_streaming_reader(row: dict[str, str], data) -> None:
    """`fleetmend explain` on a large log skips lines without one of `agents.kmsg.stream.TOKENS`: every listed
    format's lines, between healthy boot-log lines, must give the same events streamed as parsed line by line."""
    import io

    from agents.kmsg import KmsgParser
    from agents.kmsg.stream import parse_stream

    constraints = _args(row["args"])
    holders = {"bdf": data.draw(_BDF), "name": str(data.draw(constraints.get("{name}", _WORD))),
               "drv": str(data.draw(constraints.get("{drv}", st.just("mlx5_core"))))}
    text, _ = synthesise(row["format"].replace("\\n", "\n").replace("\\t", "\t"), data.draw, constraints)
    prefix = "" if row["prefix"] == "-" else row["prefix"].format(**holders)
    frame = FRAMINGS[data.draw(st.sampled_from(sorted(FRAMINGS)))]
    noise = "[  900.000001] usb 1-1: new high-speed USB device number 2 using xhci_hcd\n"
    log = noise + "".join(f"{frame(i)}{prefix}{line}\n" for i, line in enumerate(text.split("\n"))) + noise  # type: ignore[operator]
    want = [(e.kind, e.code, e.device.pci_bus_id, e.device.name) for e in parse_text(log, node="n1")]
    got = [(e.kind, e.code, e.device.pci_bus_id, e.device.name)
           for e in parse_stream(io.BytesIO(log.encode()), KmsgParser("local", "n1", "unknown"))]
    assert got == want and want, log


CHECKED = TABLE.with_name("formats-checked.tsv")
_KEY = ("source", "version", "prefix", "format", "kind")


def checked_records() -> list[dict[str, str]]:
    lines = [ln for ln in CHECKED.read_text().splitlines() if ln and not ln.startswith("#")]
    return list(csv.DictReader(lines, delimiter="\t", quoting=csv.QUOTE_NONE))


def test_every_row_has_a_check_record_and_no_record_is_stale() -> None:
    """Issue 29: the claim "taken from the source" is auditable. Every row of formats.tsv has a record in
    formats-checked.tsv (keyed by source, version, prefix, format, kind): checked (verbatim / rendered / fixed,
    with the ids of the stored source texts that hold it, or the repository@commit:path read, and a note), or
    explicitly `unchecked` with why. A row edited without re-checking loses its record; a record whose row was
    removed or reworded is stale."""
    recs = checked_records()
    by_key = {tuple(r[k] for k in _KEY): r for r in recs}
    assert len(by_key) == len(recs), "duplicate check records"
    row_keys = {tuple(r[k] for k in _KEY) for r in rows()}
    missing = sorted(row_keys - set(by_key))
    assert not missing, f"rows without a check record: {missing[:5]}"
    stale = sorted(set(by_key) - row_keys)
    assert not stale, f"check records for rows not in formats.tsv: {stale[:5]}"
    for r in recs:
        assert r["result"] in ("verbatim", "rendered", "fixed", "unchecked", "n/a"), r
        assert r["note"] not in ("", "-"), r
        if r["result"] in ("verbatim", "rendered", "fixed"):
            assert (r["method"] == "find_string" and re.fullmatch(r"\d+(,\d+)*", r["evidence"])) or (
                r["method"] == "read_file" and re.fullmatch(r"[\w.-]+/[\w.-]+@[0-9a-f]{40}:\S+", r["evidence"])), r
