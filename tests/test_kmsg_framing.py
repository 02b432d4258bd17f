"""Framings around kernel messages, robustness on arbitrary input, and the KmsgProbe file/cursor paths."""

from __future__ import annotations

import asyncio
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agents.kmsg import KmsgParser, KmsgProbe, normalize_bdf, parse_text
from agents.kmsg.framing import IGNORE, Deframer

# ------------------------------------------------------------------ strategies

hexd = st.sampled_from("0123456789abcdef")
domains = st.integers(0, 0xFFFF)
buses = st.integers(0, 0xFF)
devs = st.integers(0, 0x1F)
xids = st.sampled_from([8, 13, 31, 32, 43, 45, 48, 61, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95, 119, 120, 154])
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.-]{0,14}", fullmatch=True).filter(lambda s: "," not in s)
hosts = st.from_regex(r"[a-z][a-z0-9-]{0,10}", fullmatch=True).filter(lambda h: h != "kernel")


@st.composite
def xid_line(draw):
    dom, bus, dev = draw(domains), draw(buses), draw(devs)
    xid = draw(xids)
    style = draw(st.sampled_from(["none", "pid", "pid_name", "unknown", "quoted"]))
    pid = draw(st.integers(1, 4_194_304))
    name = draw(names)
    body = {
        "none": "",
        "pid": f"pid={pid}, ",
        "pid_name": f"pid={pid}, name={name}, ",
        "unknown": "pid=<unknown>, name=<unknown>, ",
        "quoted": "pid='<unknown>', name=<unknown>, ",
    }[style]
    tail = draw(st.sampled_from(["Ch 0000003a, intr 10000000", "Graphics Exception: ESR 0x0", "GPU has fallen off the bus."]))
    line = f"NVRM: Xid (PCI:{dom:04x}:{bus:02x}:{dev:02x}): {xid}, {body}{tail}"
    want_pid = pid if style in ("pid", "pid_name") else None
    return line, xid, f"{dom:04x}:{bus:02x}:{dev:02x}.0", want_pid


@st.composite
def framed(draw, msg: str):
    style = draw(st.sampled_from(["bare", "uptime", "ctime", "delta", "iso", "syslog", "syslog_nohost", "syslog_uptime",
                                  "prio", "talos", "kmsg", "journal_iso"]))
    up = draw(st.floats(0, 9_999_999, allow_nan=False)).__round__(6)
    host = draw(hosts)
    day = draw(st.integers(1, 28))
    return {
        "bare": msg,
        "uptime": f"[{up:12.6f}] {msg}",
        "ctime": f"[Sun Feb {day:2d} 16:24:18 2025] {msg}",
        "delta": f"[  +{up % 10:.6f}] {msg}",
        "iso": f"kern  :warn  : 2025-01-{day:02d}T04:41:44,283302+00:00 {msg}",
        "syslog": f"Feb {day:2d} 03:28:16 {host} kernel: {msg}",
        "syslog_nohost": f"Feb {day:2d} 03:28:16 kernel: {msg}",
        "syslog_uptime": f"Sep {day:2d} 16:18:02 {host} kernel: [{up:.6f}] {msg}",
        "prio": f"<4>[{up:12.6f}] {msg}",
        "talos": f"10.0.0.1: kern: warning: [2026-04-22T21:27:51.291660856Z]: {msg}",
        "kmsg": f"4,{draw(st.integers(0, 10**9))},{int(up * 1e6)},-;{msg}",
        "journal_iso": f"2025-01-{day:02d}T04:41:44.283302+00:00 {host} kernel: {msg}",
    }[style]


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_framing_decodes_the_same_xid(data) -> None:
    line, xid, bdf, pid = data.draw(xid_line())
    text = data.draw(framed(line))
    events = parse_text(text, node="n")
    assert len(events) == 1, (text, events)
    e = events[0]
    assert (e.kind, e.code, e.device.pci_bus_id, e.pid) == ("xid", xid, bdf, pid), text


@settings(max_examples=200)
@given(st.text(max_size=400))
def test_arbitrary_text_never_raises(text) -> None:
    p = KmsgParser("c", "n", "t")
    for line in text.splitlines() or [text]:
        p.feed(line)
    p.flush()
    assert p.parse_errors == 0


@settings(max_examples=200)
@given(st.binary(max_size=400))
def test_arbitrary_bytes_never_raise(data) -> None:
    parse_text(data.decode("utf-8", "replace"), node="n")


@settings(max_examples=100)
@given(st.lists(st.sampled_from([
    "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
    "               NVRM: continuation line",
    "[  +0.000004] pcieport 0000:00:03.0:    [12] Timeout",
    "pcieport 0000:00:03.0: AER: Corrected error received: 0000:00:03.0",
    "Call Trace:", " <TASK>", "[...]", "$ dmesg", "", " SUBSYSTEM=pci", "6,1,2,-;x\\x0ay",
    "INFO: task a:1 blocked for more than 120 seconds.", "oom-kill:constraint=X,task=p,pid=9,uid=0",
]), max_size=30))
def test_fragment_soup_never_raises(lines) -> None:
    p = KmsgParser("c", "n", "t")
    for line in lines:
        p.feed(line)
    p.flush()
    assert p.parse_errors == 0


# ------------------------------------------------------------------ specific framings


def test_normalize_bdf() -> None:
    assert normalize_bdf("PCI:0000:3B:00") == "0000:3b:00.0"
    assert normalize_bdf("3b:00.1") == "0000:3b:00.1"
    assert normalize_bdf("0019:01:00") == "0019:01:00.0"
    assert normalize_bdf("not a bdf") is None


def test_deframer_styles() -> None:
    d = Deframer()
    assert d.deframe("[...]") == IGNORE
    assert d.deframe("$ sudo dmesg | grep -i xid") == IGNORE
    f = d.deframe("Feb 23 03:28:16  kernel: EDAC MC1: 1 CE memory scrubbing error")
    assert f.text.startswith("EDAC MC1") and not f.foreign
    f = d.deframe("Feb 14 05:03:41 node-a01 systemd[1]: Started x.")
    assert f.foreign
    f = d.deframe("node-a01 kernel: mlx5_core 0000:5c:00.0: x")
    assert f.text == "mlx5_core 0000:5c:00.0: x"
    f = d.deframe("user  :notice: 2025-01-21T04:41:44,283302+00:00 hello")
    assert f.foreign
    f = d.deframe("6,3973,227996636,-;nvidia-peermem x")
    assert (f.text, f.seq, f.ts) == ("nvidia-peermem x", 3973, 227.996636)


def test_raw_kmsg_dictionary_and_escapes() -> None:
    text = "\n".join(
        [
            "3,812,5000000,-;pcieport 0000:00:03.0: AER: Uncorrected (Fatal) error received: 0000:00:03.0",
            " SUBSYSTEM=pci",
            " DEVICE=+pci:0000:00:03.0",
            "4,813,5000100,-;NVRM: Xid (PCI:0000:03:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
        ]
    )
    events = parse_text(text, node="n")
    assert [(e.kind, e.device.pci_bus_id) for e in events] == [("aer_fatal", "0000:00:03.0"), ("xid", "0000:03:00.0")]
    assert "SUBSYSTEM=pci" in events[0].raw


def test_fallen_off_bus_probe_time_continuation() -> None:
    text = (
        "[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0\n"
        "               NVRM: (PCI ID: 10de:26b5) installed in this system has\n"
        "               NVRM: fallen off the bus and is not responding to commands.\n"
    )
    (e,) = parse_text(text, node="n")
    assert (e.kind, e.device.pci_bus_id, e.severity.value) == ("gpu_fallen_off_bus", "0000:b3:00.0", "fatal")
    assert "fallen off the bus and is not responding" in e.message


def test_xid95_flags_and_nvlink5_attrs() -> None:
    (e,) = parse_text("NVRM: Xid (PCI:0000:01:00): 95, pid=7062, Uncontained: LTC TAG (0x2, 0x1). RST: Yes, D-RST: No", node="n")
    assert (e.attrs["rst"], e.attrs["d_rst"]) == (True, False)
    (e,) = parse_text(
        "NVRM: Xid (PCI:0018:01:00): 145, RLW_RXPIPE Nonfatal XC0 i0 Link 13 (0x0409a0c2 0x00000008 0x1 0x0 0x0 0x4)",
        node="n",
    )
    assert (e.attrs["unit"], e.attrs["resolution"], e.attrs["link"], e.severity.value) == (
        "RLW_RXPIPE", "IGNORE", 13, "degraded",
    )


def test_pcie_reduced_width_is_degraded() -> None:
    line = (
        "[ 10.7] pci 0000:04:00.0: 126.024 Gb/s available PCIe bandwidth, limited by 16.0 GT/s PCIe x8 link at "
        "0000:01:00.0 (capable of 504.112 Gb/s with 32.0 GT/s PCIe x16 link)"
    )
    (e,) = parse_text(line, node="n")
    assert (e.kind, e.severity.value, e.attrs["pcie_link_width"]) == ("pcie_link_degraded", "degraded", 8)


def test_clearing_events_are_healthy() -> None:
    events = parse_text(
        "[1.0] mlx5_core 0000:ab:00.0 mlx5_5: Port: 1 Link DOWN\n[9.0] mlx5_core 0000:ab:00.0 mlx5_5: Port: 1 Link ACTIVE",
        node="n",
    )
    assert [(e.kind, e.healthy, e.device.port) for e in events] == [("ib_port_down", False, 1), ("ib_port_down", True, 1)]
    assert events[1].attrs["clearing_kind"] == "ib_port_active" and events[1].severity.value == "info"
    assert events[0].condition == events[1].condition


# ------------------------------------------------------------------ probe


def test_probe_replays_a_file(tmp_path) -> None:
    f = tmp_path / "dmesg.txt"
    f.write_text(
        "[ 1.0] NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"
        "[ 5.0] INFO: task python:42 blocked for more than 120 seconds.\n"
    )
    got = []

    async def emit(ev):
        got.append(ev)

    probe = KmsgProbe(source=f, follow=False, node="n")
    assert probe.name == "kmsg"
    asyncio.run(probe.run(emit))
    assert [(e.kind, e.code, e.pid) for e in got] == [("xid", 79, None), ("hung_task", None, 42)]


def test_probe_cursor_round_trip(tmp_path) -> None:
    probe = KmsgProbe(source=tmp_path / "x", state_dir=tmp_path / "state", follow=False)
    assert probe._load_cursor() == (None, None)
    probe._save_cursor(1234)
    boot, seq = probe._load_cursor()
    assert seq == 1234
    assert json.loads((tmp_path / "state" / "kmsg.cursor").read_text())["seq"] == 1234


def test_a_real_h200_hosts_boot_log_is_not_a_fault() -> None:
    """tests/h200_boot_dmesg.txt: the whole boot log of a healthy H200 host (driver 580.159.04,
    read there with scripts/gpu_check.py's run, 2026-11-29). NVRM's boot lines (module load,
    "FBHUB Interrupt detected. Clearing it.", persistence-mode deprecation) and the rest of a
    normal boot must yield no fault: a false positive here would drain healthy nodes at boot."""
    from pathlib import Path

    text = (Path(__file__).with_name("h200_boot_dmesg.txt")).read_text()
    assert "NVRM: loading NVIDIA UNIX Open Kernel Module" in text
    events = parse_text(text)
    assert [e for e in events if not e.healthy] == []
