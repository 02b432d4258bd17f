"""Crashes that survived a reboot (agents/lastboot.py), read from real pstore / systemd-pstore / kdump
/ journal layouts built under a temporary host root.

Texts (tests/crash_texts/, sources in tests/crash_texts/SOURCES.md): a 5.8-rc1 mlx5_core oops in
`mlx5e_configure_flower [mlx5_core]` (netdev), a 5.8-rc2 NULL dereference in interrupt context ending
in `Kernel panic - not syncing: Fatal exception in interrupt` (LKML), and a firmware-first GHES fatal
PCIe record ending in `Kernel panic - not syncing: Fatal hardware error!` (linux-acpi).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import zlib
from datetime import datetime, timezone
from pathlib import Path

import pytest

from agents import lastboot
from agents.lastboot import LastBootProbe, journal_entries, record_clean_stop, record_reboot_ordered
from agents.recovery import RecoveryHandler
from fleetmend.diagnostics import RecoveryOp, RecoveryRequest, RecoveryResult
from fleetmend.events import FaultEvent

TEXTS = Path(__file__).parent / "crash_texts"
BOOT_A = "6f1c3c3e-8a57-4f0e-9d55-0a4a2d3c9b10"
BOOT_B = "d2b8f1a0-33c4-4b7e-a0e1-5c9e7d4f2a61"
CRASH_AT = datetime(2020, 6, 26, 0, 40, 11, tzinfo=timezone.utc)
BOOT_A_START = datetime(2020, 6, 25, 23, 0, 0, tzinfo=timezone.utc)
BOOT_B_START = datetime(2020, 6, 26, 0, 45, 0, tzinfo=timezone.utc)


def _text(name: str) -> list[str]:
    return (TEXTS / name).read_text().splitlines()


def make_root(tmp_path: Path, boot_id: str = BOOT_B, boot_start: datetime = BOOT_B_START) -> Path:
    root = tmp_path / "host"
    (root / "proc/sys/kernel/random").mkdir(parents=True, exist_ok=True)
    (root / "proc/sys/kernel/random/boot_id").write_text(boot_id + "\n")
    (root / "proc/stat").write_text(f"cpu  1 2 3 4\nbtime {int(boot_start.timestamp())}\nprocesses 9\n")
    return root


def set_boot(root: Path, boot_id: str, boot_start: datetime) -> None:
    (root / "proc/sys/kernel/random/boot_id").write_text(boot_id + "\n")
    (root / "proc/stat").write_text(f"btime {int(boot_start.timestamp())}\n")


def write_efi_pstore(root: Path, lines: list[str], reason: str = "Panic", count: int = 1,
                     at: datetime = CRASH_AT, bufsize: int = 1024, backend: str = "efi") -> list[Path]:
    """Lay out a dump the way efi-pstore does: records of at most `bufsize` bytes filled from the end of
    the log (Part1 = newest), each starting with the '%s#%d Part%u' header, named
    dmesg-<backend>-<generic_id(time, part, count)> with the dump time as mtime."""
    d = root / "sys/fs/pstore"
    d.mkdir(parents=True, exist_ok=True)
    body = [f"<4>{ln}" for ln in lines]
    parts: list[list[str]] = []
    cur: list[str] = []
    size = 0
    for ln in reversed(body):
        if cur and size + len(ln) + 1 > bufsize - 24:
            parts.append(cur)
            cur, size = [], 0
        cur.insert(0, ln)
        size += len(ln) + 1
    parts.append(cur)
    out = []
    ts = int(at.timestamp())
    for part, chunk in enumerate(parts, 1):
        p = d / f"dmesg-{backend}-{(ts * 100 + part) * 1000 + count}"
        p.write_text(f"{reason}#{count} Part{part}\n" + "\n".join(chunk) + "\n")
        os.utime(p, (ts, ts))
        out.append(p)
    return out


def write_ramoops(root: Path, lines: list[str], reason: str, n: int, at: datetime, compressed: bool = False) -> Path:
    d = root / "sys/fs/pstore"
    d.mkdir(parents=True, exist_ok=True)
    data = (f"{reason}#1 Part1\n" + "\n".join(f"<4>{ln}" for ln in lines) + "\n").encode()
    name = f"dmesg-ramoops-{n}"
    if compressed:  # the kernel's deflate without zlib header, kept compressed: '.enc.z'
        c = zlib.compressobj(9, zlib.DEFLATED, -15)
        data = c.compress(data) + c.flush()
        name += ".enc.z"
    p = d / name
    p.write_bytes(data)
    os.utime(p, (at.timestamp(), at.timestamp()))
    return p


def export_entry(fields: dict[str, str | bytes]) -> bytes:
    """One journal export entry (JOURNAL_EXPORT_FORMATS); bytes values use the binary-safe form."""
    out = b""
    for k, v in fields.items():
        if isinstance(v, bytes):
            out += k.encode() + b"\n" + len(v).to_bytes(8, "little") + v + b"\n"
        else:
            out += f"{k}={v}\n".encode()
    return out + b"\n"


def journal_export(lines: list[str], boot_id: str, start: datetime, binary_at: int | None = None) -> bytes:
    """The kernel lines as `journalctl -k -o export` prints them: uptime in _SOURCE_MONOTONIC_TIMESTAMP,
    the message without the `[uptime]` prefix."""
    out = b""
    for i, ln in enumerate(lines):
        up, _, msg = ln.partition("] ")
        us = int(float(up.strip("[ ")) * 1e6)
        value: str | bytes = msg if i != binary_at else msg.encode() + b"\n\xff"
        out += export_entry({
            "__CURSOR": f"s=0;i={i}", "__REALTIME_TIMESTAMP": str(int(start.timestamp() * 1e6) + us),
            "__MONOTONIC_TIMESTAMP": str(us), "_BOOT_ID": boot_id.replace("-", ""), "_TRANSPORT": "kernel",
            "PRIORITY": "4", "SYSLOG_FACILITY": "0", "SYSLOG_IDENTIFIER": "kernel",
            "_SOURCE_MONOTONIC_TIMESTAMP": str(us), "MESSAGE": value,
        })
    return out


def opener_of(data: bytes):
    @contextlib.contextmanager
    def opener():
        yield io.BytesIO(data)
    return opener


def probe(root: Path, state: Path, journal=None) -> LastBootProbe:
    return LastBootProbe(root, state, cluster="c1", node="n1", agent_version="t", journal=journal)


def previous_boot_state(state: Path, boot_id: str = BOOT_A, started: datetime = BOOT_A_START, **extra) -> None:
    state.mkdir(parents=True, exist_ok=True)
    boot = {"boot_id": boot_id, "boot_started_at": started.isoformat(), "agent_started_at": started.isoformat(),
            "clean_stop_at": None, "reboot_ordered_at": None}
    boot.update(extra)
    (state / "lastboot.json").write_text(json.dumps({"boot": boot, "published": {}}))


def collect(p: LastBootProbe) -> list[FaultEvent]:
    events, commit = p.collect()
    commit()
    return events


# ------------------------------------------------------------------------------------ formats


def test_journal_export_parser_reads_text_and_binary_fields() -> None:
    data = export_entry({"MESSAGE": "a=b", "_BOOT_ID": "x"}) + export_entry({"MESSAGE": b"two\nlines\x00"})
    entries = list(journal_entries(io.BytesIO(data + b"MESSAGE\n\x10\x00")))  # last entry truncated
    assert entries[0] == {"MESSAGE": b"a=b", "_BOOT_ID": b"x"}
    assert entries[1] == {"MESSAGE": b"two\nlines\x00"}
    assert len(entries) == 2


def test_efi_pstore_parts_are_joined_in_order_and_the_panic_read(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    files = write_efi_pstore(root, _text("sched_irq_panic.txt"))
    assert len(files) > 3  # 1 KiB efi variables: the dump spans several parts
    state = tmp_path / "state"
    previous_boot_state(state)
    events = collect(probe(root, state))
    assert len(events) == 1, [e.message for e in events]
    ev = events[0]
    assert ev.kind == "kernel_panic_previous_boot" and ev.severity.value == "degraded"
    a = ev.attrs
    assert a["panic_reason"] == "Fatal exception in interrupt"
    assert a["crash_kind"] == "kernel_panic" and a["dump_reason"] == "Panic" and a["crash_source"] == "pstore"
    assert a["function"] == "check_preempt_wakeup" and "module" not in a  # core kernel: no [module]
    assert a["previous_boot_id"] == BOOT_A and a["unexpected_reboot"] is True
    assert a["crashed_at"] == CRASH_AT.isoformat()
    assert ev.pid == 909 and a["process"] == "kworker/2:1H"
    assert ev.raw.splitlines()[0].endswith("BUG: kernel NULL pointer dereference, address: 0000000000000150")
    assert "Kernel panic - not syncing" in ev.raw
    # never again: the next start (same boot) publishes nothing
    assert collect(probe(root, state)) == []


def test_ramoops_oops_names_the_module_and_compressed_records_are_read(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    write_ramoops(root, _text("mlx5_flower_oops.txt"), "Oops", 0, CRASH_AT, compressed=True)
    write_ramoops(root, ["[    1.000000] reboot: Restarting system"], "Restart", 1, CRASH_AT)  # clean: no crash
    state = tmp_path / "state"
    previous_boot_state(state)
    [ev] = collect(probe(root, state))
    a = ev.attrs
    assert a["module"] == "mlx5_core" and a["function"] == "mlx5e_configure_flower"
    assert a["dump_reason"] == "Oops" and a["crash_kind"] == "oops" and "panic_reason" not in a
    assert a["modules_linked_in"].startswith("act_skbedit act_tunnel_key") and " mlx5_core " in a["modules_linked_in"]
    assert a["tainted"] == "not tainted"
    assert ev.pid == 31736 and a["process"] == "tc"
    assert "mlx5e_configure_flower [mlx5_core]" in ev.message and "dmesg-ramoops-0.enc.z" in a["crash_files"]


def test_kdump_ghes_panic_is_attributed_to_the_pcie_device(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    d = root / "var/crash/127.0.0.1-2020-06-26-00:40:11"
    d.mkdir(parents=True)
    (d / "vmcore-dmesg.txt").write_text((TEXTS / "ghes_fatal_pcie_panic.txt").read_text())
    (d / "vmcore").write_bytes(b"\0" * 16)
    state = tmp_path / "state"
    previous_boot_state(state)
    [ev] = collect(probe(root, state))
    assert ev.component.value == "pcie" and ev.device.pci_bus_id == "0000:82:00.0"
    assert ev.attrs["cause_kind"] == "ghes_fatal" and ev.attrs["panic_reason"] == "Fatal hardware error!"
    assert ev.attrs["crash_source"] == "kdump" and ev.attrs["crashed_at"] == CRASH_AT.isoformat()
    assert ev.attrs["previous_boot_id"] == BOOT_A
    assert "Fatal hardware error!" in ev.message and "section_type: PCIe error" in ev.raw


def test_systemd_pstore_archive_is_read(tmp_path: Path) -> None:
    """systemd-pstore moved the efi files to /var/lib/systemd/pstore/<id>/ and wrote dmesg.txt."""
    root = make_root(tmp_path)
    files = write_efi_pstore(root, _text("mlx5_flower_oops.txt"), reason="Oops")
    arch = root / "var/lib/systemd/pstore" / files[0].name.rsplit("-", 1)[1][:-6]
    arch.mkdir(parents=True)
    parts = sorted(files, key=lambda p: p.name, reverse=True)  # systemd: reverse lexical order
    (arch / "dmesg.txt").write_text("".join(f"{p.name}:\n{p.read_text()}" for p in parts))
    for p in files:
        p.rename(arch / p.name)
    state = tmp_path / "state"
    previous_boot_state(state)
    [ev] = collect(probe(root, state))
    assert ev.attrs["crash_source"] == "pstore-archive" and ev.attrs["module"] == "mlx5_core"
    assert ev.attrs["dump_reason"] == "Oops"


def test_journal_panic_carries_the_crashed_boot_id_and_one_crash_in_two_sources_is_one_event(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    lines = _text("sched_irq_panic.txt")
    write_efi_pstore(root, lines)
    journal = journal_export(lines, BOOT_A, BOOT_A_START, binary_at=3)
    state = tmp_path / "state"
    previous_boot_state(state)
    [ev] = collect(probe(root, state, journal=opener_of(journal)))
    assert set(ev.attrs["crash_source"].split(",")) == {"pstore", "journal"}
    assert ev.attrs["previous_boot_id"] == BOOT_A
    # journal alone: the boot id comes from _BOOT_ID, the time from __REALTIME_TIMESTAMP of the panic line
    state2 = tmp_path / "state2"
    root2 = make_root(tmp_path / "r2")
    [ev2] = collect(probe(root2, state2, journal=opener_of(journal)))
    assert ev2.attrs["crash_source"] == "journal" and ev2.attrs["previous_boot_id"] == BOOT_A
    assert ev2.attrs["crashed_at"].startswith("2020-06-25T23:18:22")
    assert collect(probe(root2, state2, journal=opener_of(journal))) == []


# ------------------------------------------------------------------------------------ reboots


def test_unexpected_reboot_without_a_crash_record(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    state = tmp_path / "state"
    previous_boot_state(state)
    oops_only = journal_export(_text("mlx5_flower_oops.txt"), BOOT_A, BOOT_A_START)
    [ev] = collect(probe(root, state, journal=opener_of(oops_only)))
    assert ev.kind == "unexpected_reboot" and ev.severity.value == "degraded"
    assert ev.attrs["previous_boot_id"] == BOOT_A and ev.attrs["boot_id"] == BOOT_B
    assert ev.attrs["last_kernel_fault"] == "oops"
    assert ev.attrs["boot_started_at"] == BOOT_B_START.isoformat()
    assert collect(probe(root, state)) == []  # the same boot: nothing more


def test_first_start_clean_stop_and_ordered_reboot_are_not_unexpected(tmp_path: Path) -> None:
    root = make_root(tmp_path, BOOT_A, BOOT_A_START)
    state = tmp_path / "state"
    assert collect(probe(root, state)) == []  # first start ever: nothing to compare with
    record_clean_stop(state, root)
    set_boot(root, BOOT_B, BOOT_B_START)
    assert collect(probe(root, state)) == []  # orderly shutdown
    set_boot(root, "0a0a0a0a-1b1b-4c4c-8d8d-9e9e9e9e9e9e", BOOT_B_START)
    [ev] = collect(probe(root, state))  # boot B ended with neither
    assert ev.kind == "unexpected_reboot" and ev.attrs["previous_boot_id"] == BOOT_B


async def test_a_reboot_ordered_through_the_recovery_handler_is_not_unexpected(tmp_path: Path) -> None:
    root = make_root(tmp_path, BOOT_A, BOOT_A_START)
    state = tmp_path / "state"
    collect(probe(root, state))
    h = RecoveryHandler("c1", "n1", reboot_command=["true"], on_reboot=lambda req: record_reboot_ordered(
        state, req.incident_id))
    report, after = await h.handle(RecoveryRequest(op=RecoveryOp.REBOOT, node="n1", cluster="c1",
                                                   incident_id="inc-1"))
    assert report.result is RecoveryResult.APPLIED
    await after()
    assert json.loads((state / "lastboot.json").read_text())["boot"]["reboot_incident"] == "inc-1"
    set_boot(root, BOOT_B, BOOT_B_START)
    assert collect(probe(root, state)) == []


def test_unreadable_record_is_named_not_dropped(tmp_path: Path, caplog) -> None:
    root = make_root(tmp_path)
    d = root / "sys/fs/pstore"
    d.mkdir(parents=True)
    (d / "dmesg-efi-159313241100101001.enc.z").write_bytes(b"\x89LZO not deflate")
    state = tmp_path / "state"
    previous_boot_state(state)
    with caplog.at_level("WARNING"):
        [ev] = collect(probe(root, state))
    assert ev.kind == "unexpected_reboot" and "cannot decompress" in ev.attrs["unreadable"]
    assert "lastboot_unreadable" in caplog.text


def test_state_keeps_what_was_published_across_restarts(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    write_ramoops(root, _text("mlx5_flower_oops.txt"), "Oops", 0, CRASH_AT)
    state = tmp_path / "state"
    previous_boot_state(state)
    events, commit = probe(root, state).collect()
    assert len(events) == 1
    # not committed (the agent died before handing it over): published again at the next start
    assert len(probe(root, state).collect()[0]) == 1
    commit()
    data = json.loads((state / "lastboot.json").read_text())
    assert any(k.startswith("pstore:dmesg-ramoops-0:") for k in data["published"])
    assert any(k.startswith("crash:") for k in data["published"])
    assert data["boot"]["boot_id"] == BOOT_B
    assert probe(root, state).collect()[0] == []


# ------------------------------------------------------------------------------------ the agent


async def test_live_agent_publishes_a_surviving_panic_once(nats_server, nc, unique: str, tmp_path: Path) -> None:
    from agents.runner import run_agent
    from fleetmend.config import AgentSettings, Settings
    from fleetmend.infra.jetstream import ensure_fault_stream
    from fleetmend.subjects import fault_subject

    cluster, node = f"c{unique}", "n1"
    root = make_root(tmp_path)
    write_ramoops(root, _text("mlx5_flower_oops.txt"), "Oops", 0, CRASH_AT)
    write_efi_pstore(root, _text("sched_irq_panic.txt"))
    (tmp_path / "kmsg").write_text("")
    s = Settings(cluster=cluster, node=node, nats_url=nats_server.url, state_dir=tmp_path / "state",
                 agent=AgentSettings(nice=0, kmsg_path=tmp_path / "kmsg", host_root=root, sysfs_root=root,
                                     nvml_enabled=False, udev_enabled=False, sysfs_enabled=False,
                                     lastboot_journal=False))
    previous_boot_state(tmp_path / "state" / "agent" / node)
    js = nc.jetstream()
    await ensure_fault_stream(js)
    sub = await js.subscribe(fault_subject(cluster, node), ordered_consumer=True)

    async def run_once() -> None:
        stop = asyncio.Event()
        agent = asyncio.create_task(run_agent(s, stop=stop))
        await asyncio.sleep(2.0)
        stop.set()
        assert await asyncio.wait_for(agent, 20) == 0

    await run_once()
    got = [FaultEvent.from_json_bytes((await sub.next_msg(timeout=10)).data) for _ in range(2)]
    assert sorted(e.attrs.get("module", "-") for e in got) == ["-", "mlx5_core"]
    assert {e.kind for e in got} == {"kernel_panic_previous_boot"}
    assert all(e.attrs["previous_boot_id"] == BOOT_A for e in got)
    await run_once()  # restart: nothing again (and the clean stop makes no unexpected reboot)
    with pytest.raises(Exception):  # noqa: B017 - nats TimeoutError: nothing more
        await sub.next_msg(timeout=1.0)
    data = json.loads((tmp_path / "state" / "agent" / node / "lastboot.json").read_text())
    assert data["boot"]["boot_id"] == BOOT_B and data["boot"]["clean_stop_at"]
    assert lastboot.STATE_FILE == "lastboot.json"


def test_journalctl_is_asked_for_the_previous_boot_under_the_host_root(tmp_path: Path, monkeypatch) -> None:
    """The production opener runs `journalctl -k -b -1 -o export` with `-D <root>/var/log/journal`; a
    stand-in journalctl on PATH records its argv and prints a recorded export stream."""
    root = make_root(tmp_path)
    export = tmp_path / "prev.export"
    export.write_bytes(journal_export(_text("sched_irq_panic.txt"), BOOT_A, BOOT_A_START))
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "journalctl").write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/argv\ncat {export}\n')
    (bindir / "journalctl").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    state = tmp_path / "state"
    previous_boot_state(state)
    [ev] = collect(LastBootProbe(root, state, cluster="c1", node="n1"))
    argv = (tmp_path / "argv").read_text().split()
    assert argv[:6] == ["-k", "-b", "-1", "-o", "export", "-n"] and argv[-2:] == ["-D", f"{root}/var/log/journal"]
    assert ev.attrs["crash_source"] == "journal" and ev.attrs["previous_boot_id"] == BOOT_A


def test_real_journalctl_without_a_journal_reads_nothing(tmp_path: Path) -> None:
    import shutil

    if shutil.which("journalctl") is None:
        pytest.skip("journalctl not installed")
    from agents.kmsg import KmsgParser

    root = make_root(tmp_path)
    tail = lastboot.read_journal(lastboot.journalctl_export(root), KmsgParser("c1", "n1", "t"))
    assert tail.entries == 0 and tail.dump is None


def test_module_of_an_old_kernel_rip_line() -> None:
    """2.6.32 prints the address twice before the symbol (ntop/PF_RING#277, an i40e_zc oops at modprobe)."""
    facts = lastboot._facts(["RIP: 0010:[<ffffffffa0bac4a3>]  [<ffffffffa0bac4a3>] "
                             "i40e_vsi_map_rings_to_vectors+0xf3/0x280 [i40e_zc]"])
    assert facts["module"] == "i40e_zc" and facts["function"] == "i40e_vsi_map_rings_to_vectors"
    trace = lastboot._facts(["RIP: 0010:ioread32be+0x34/0x60", "Call Trace:", " <IRQ>",
                             " ? __pfx_poll_health+0x10/0x10 [mlx5_core]",
                             " mlx5_health_check_fatal_sensors+0x20/0x100 [mlx5_core]"])
    assert trace["module"] == "mlx5_core" and trace["function"] == "ioread32be"


def test_nic_driver_oops_under_load_in_ramoops(tmp_path: Path) -> None:
    """The ice driver's oops under 9K-MTU AF_XDP load, as ramoops keeps an oops dump (dump_oops=1)."""
    root = make_root(tmp_path)
    write_ramoops(root, _text("ice_rx_9k_mtu_oops.txt"), "Oops", 0, CRASH_AT)
    state = tmp_path / "state"
    previous_boot_state(state)
    [ev] = collect(probe(root, state))
    a = ev.attrs
    assert a["module"] == "ice" and a["function"] == "ice_clean_rx_irq" and a["dump_reason"] == "Oops"
    assert ev.pid == 3984 and a["process"] == "xskxceiver" and a["tainted"] == "G W"
    assert a["previous_boot_id"] == BOOT_A and ev.kind == "kernel_panic_previous_boot"
    assert "ice_clean_rx_irq [ice]" in ev.message
