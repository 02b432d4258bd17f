"""Issue 29 point 3: kinds fleetmend reads, read wrong before. Each test states the driver's format (the
table in `fleetmend/catalog/source/formats.tsv` cites the file and version) and what must come out."""

from __future__ import annotations

from agents.kmsg import parse_text
from fleetmend.catalog import default_catalog
from fleetmend.cli.explain import Explained, explained_json
from fleetmend.events import FaultEvent


def events(text: str) -> list[FaultEvent]:
    return parse_text(text, node="n")


def test_nvme_timeouts_in_every_kernel_wording() -> None:
    """drivers/nvme/host/pci.c nvme_timeout, v4.x..v6.0 and v6.1+; rdma.c / tcp.c (fabrics)."""
    lines = [
        ("nvme nvme0: I/O tag 28 (401c) opcode 0x2 (Read) QID 0 timeout, reset controller", "nvme0"),
        ("nvme nvme1: I/O tag 5 (0005) opcode 0x1 (Write) QID 3 timeout, aborting req_op:WRITE(1) size:4096", "nvme1"),
        ("nvme nvme2: I/O tag 9 (1009) type 4 opcode 0x18 (Keep Alive) QID 0 timeout", "nvme2"),
        ("nvme nvme3: I/O 5(Read) QID 1 timeout, completion polled", "nvme3"),
        ("nvme nvme4: I/O 731 QID 7 timeout, aborting", "nvme4"),
    ]
    for i, (line, dev) in enumerate(lines):
        evs = events(f"[ {100 + 500 * i}.000001] {line}")
        assert [(e.kind, e.device.name, e.severity.value) for e in evs] == [("nvme_timeout", dev, "degraded")], line


def test_fallen_off_the_bus_in_three_nvrm_lines_keeps_its_device() -> None:
    """open-gpu-kernel-modules osapi.c (595.45.04): one nv_printf of three `NVRM:` lines; only the first
    names the GPU. Plain dmesg, timestamped and one /dev/kmsg record holding all three."""
    body = ("NVRM: The NVIDIA GPU 0000:b3:00.0\n"
            "NVRM: (PCI ID: 10de:2330) installed in this system has\n"
            "NVRM: fallen off the bus and is not responding to commands.\n")
    stamped = "".join(f"[   12.34567{i}] {line}\n" for i, line in enumerate(body.splitlines()))
    kmsg = "3,811,12345678,-;" + body.rstrip("\n").replace("\n", "\\x0a") + "\n"
    for text in (body, stamped, kmsg):
        evs = events(text)
        assert [(e.kind, e.device.pci_bus_id, e.severity.value) for e in evs] == [
            ("gpu_fallen_off_bus", "0000:b3:00.0", "fatal")], text
        assert "PCI ID: 10de:2330" in evs[0].raw or text is kmsg
    # an unrelated GPU line long before does not lend its address
    far = "NVRM: The NVIDIA GPU 0000:b3:00.0\n" + "usb 1-1: new device\n" * 5 + body.splitlines()[2] + "\n"
    assert [e.device.pci_bus_id for e in events(far)] == [None]


OOM = """\
[ 1234.000001] python3 invoked oom-killer: gfp_mask=0x100cca(GFP_HIGHUSER_MOVABLE), order=0, oom_score_adj=0
[ 1234.000002] CPU: 3 PID: 4321 Comm: python3 Not tainted 5.15.0-91-generic #101-Ubuntu
[ 1234.000100] Mem-Info:
[ 1234.000300] [   4321]     0  4321 12345678 9876543 80000000        0             0 python3
[ 1234.000400] oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0-1,global_oom,\
task_memcg=/user.slice,task=python3,pid={pid},uid=0
[ 1234.000500] Out of memory: Killed process {pid} (python3) total-vm:49382712kB, anon-rss:39506172kB, \
file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:78125kB oom_score_adj:0
[ 1234.600000] oom_reaper: reaped process {pid} (python3), now anon-rss:0kB, file-rss:0kB, shmem-rss:0kB
"""


def test_one_oom_kill_is_one_event_and_two_are_two() -> None:
    """mm/oom_kill.c prints invoked / summary / Killed process / reaped once per kill."""
    evs = events(OOM.replace("{pid}", "4321"))
    assert [(e.kind, e.pid, e.attrs.get("count", 1)) for e in evs] == [("oom_kill", 4321, 1)]
    assert evs[0].message.startswith("Out of memory: Killed process 4321")
    two = OOM.replace("{pid}", "4321") + OOM.replace("{pid}", "4400").replace("1234.", "1240.")
    assert [(e.pid, e.attrs.get("count", 1)) for e in events(two)] == [(4321, 1), (4400, 1)]
    old = "[ 9.1] Out of memory: Kill process 77 (java) score 901 or sacrifice child\n" \
          "[ 9.1] Killed process 77 (java) total-vm:1kB, anon-rss:1kB, file-rss:0kB\n"
    assert [(e.pid, e.attrs.get("count", 1)) for e in events(old)] == [(77, 1)]


def _mce(ts: int, status: str, addr: str | None) -> str:
    out = (f"[ {ts}.1] mce: [Hardware Error]: Machine check events logged\n"
           f"[ {ts}.1] mce: [Hardware Error]: CPU 0: Machine Check: 0 Bank 8: {status}\n")
    if addr:
        out += f"[ {ts}.1] mce: [Hardware Error]: TSC 0 ADDR {addr} MISC 200001c020000086 \n"
    return out


def test_corrected_machine_checks_that_overflow_or_repeat_at_one_address_are_not_info() -> None:
    """MCi_STATUS.OVER (bit 62) set with UC clear: overflowed; two corrected errors at one ADDR: a weak cell."""
    assert [(e.kind, e.severity.value, e.attrs.get("count", 1)) for e in events(_mce(100, "cc00008000010090", None))] \
        == [("mce_corrected_repeated", "degraded", 1)]
    once = events(_mce(100, "8c00008000010090", "1234000"))
    assert [(e.kind, e.severity.value, e.attrs.get("mce_addr")) for e in once] == [("mce", "info", "0x1234000")]
    again = events(_mce(100, "8c00008000010090", "1234000") + _mce(900, "8c00008000010090", "1234000"))
    assert [(e.kind, e.severity.value) for e in again] == [("mce", "info"), ("mce_corrected_repeated", "degraded")]
    assert again[1].attrs["repeat_count"] == 2
    apart = events(_mce(100, "8c00008000010090", "1234000") + _mce(900, "8c00008000010090", "5678000"))
    assert [e.kind for e in apart] == ["mce", "mce"]
    no_addr = events(_mce(100, "8c00008000010090", None) + _mce(900, "8c00008000010090", None))
    assert [e.kind for e in no_addr] == ["mce", "mce"]


def test_mlx5_link_up_reads_as_link_up() -> None:
    """en_main.c mlx5e_update_carrier `Link up`: a clearing event; explain shows what the line says."""
    evs = events("[ 1.0] mlx5_core 0000:5e:00.0 enp94s0f0np0: Link up\n")
    assert [(e.kind, e.healthy, e.attrs["clearing_kind"]) for e in evs] == [("nic_link_down", True, "nic_link_up")]
    cat = default_catalog()
    row = explained_json(Explained(evs[0], cat.classify(evs[0])))
    assert (row["kind"], row["clears"], row["description"]) == ("nic_link_up", "nic_link_down",
                                                                  "NIC link is up (clears nic_link_down)")


def test_dmesg_human_stamps_are_not_kernel_time() -> None:
    """util-linux dmesg --human: a wall clock to the minute, then deltas; the kernel's stamp is neither."""
    evs = events("[Dec 1 10:30] nvme nvme0: I/O 12 QID 3 timeout, aborting\n"
                 "[  +0.000123] mlx5_core 0000:5e:00.0 eth2: Link down\n")
    assert [("kernel_time" in e.attrs, e.attrs.get("collector_time")) for e in evs] == [
        (False, "Dec 1 10:30"), (False, "Dec 1 10:30 +0.000123s")]
    assert events("[  372.968431] nvme nvme0: I/O 12 QID 3 timeout, aborting\n")[0].attrs["kernel_time"] == "372.968431"


def test_healthy_lines_of_the_new_families_stay_silent() -> None:
    """Mounts, remount options, a healthy array, a plugged cable, a VM's absent floppy: no event (or only a
    clearing one)."""
    healthy = (
        "[    2.1] EXT4-fs (nvme0n1p2): mounted filesystem with ordered data mode. Quota mode: none.\n"
        "[    2.2] EXT4-fs (nvme0n1p2): re-mounted. Opts: errors=remount-ro. Quota mode: none.\n"
        "[    2.3] XFS (sdb1): Mounting V5 Filesystem\n"
        "[    2.4] XFS (sdb1): Ending clean mount\n"
        "[    2.5] md/raid1:md0: active with 2 out of 2 mirrors\n"
        "[    2.6] blk_update_request: I/O error, dev fd0, sector 0 op 0x0:(READ) flags 0x0 phys_seg 1 prio class 0\n"
        "[    2.7] Buffer I/O error on dev fd0, logical block 0, async page read\n"
        "[    2.8] I/O error, dev sr0, sector 0 op 0x0:(READ) flags 0x80700 phys_seg 1 prio class 0\n"
        "[    2.9] bond0: (slave eno1): Enslaving as a backup interface with an up link\n"
        "[    3.0] amdgpu 0000:03:00.0: amdgpu: GPU reset(2) succeeded!\n"
        "[    3.1] amdgpu 0000:03:00.0: amdgpu: GPU reset end with ret = 0\n"
        "[    3.2] bash[2345]: segfault at 0 ip 00007f3a1b2c3d4e sp 00007ffd1234abcd error 4 in libc.so.6[7f3a1b000000+1e00000]\n"
    )
    assert [(e.kind, e.message) for e in events(healthy)] == []
    plugged = events("[ 11.0] mlx5_core 0004:01:00.0: Port module event: module 0, Cable plugged\n")
    assert [(e.healthy, e.severity.value) for e in plugged] == [(True, "info")]


def test_probe_notices_and_refused_requests_are_not_faults() -> None:
    """Lines that carry a fault's words but are not one: nvme core.c prints `Shutdown timeout set to %u seconds` at
    every probe (the drive's RTD3E, not a timeout); nvme_log_error for a command the drive does not support (sct 0 /
    sc 0x2 Invalid Field); efa_com_cmd_exec refusing an application's request (comp_status 1 out of resources);
    NCCL's non-fatal fabric events; a healthy array and a power limit notice."""
    quiet = (
        "[    2.0] nvme nvme0: Shutdown timeout set to 10 seconds\n"
        "[    2.1] nvme0n1: Dataset Management(0x9) @ LBA 0, 0 blocks, Invalid Field in Command (sct 0x0 / sc 0x2) DNR \n"
        "[    2.2] efa 0000:00:1d.0 efa_0: Failed to process command CREATE_QP (opcode 1) comp_status 1 err -12\n"
        "[    2.3] md/raid:md1: raid level 6 active with 8 out of 8 devices, algorithm 2\n"
        "[    2.4] mce: CPU3: Package power limit notification (total events = 1)\n"
        "[    2.5] pcieport 0000:00:03.0: AER: device recovery successful\n"
        "[    2.6] mlx5_core 0000:3b:00.0: mlx5_pcie_event:298:(pid 5): PCIe slot advertised sufficient power (75W).\n"
    )
    assert [(e.kind, e.message) for e in events(quiet)] == []
    from agents.parsers import parse_any
    nccl = ("node-a01:4242:4250 [0] transport/net_ib/common.cc:181 (ncclIbAsyncThreadMain) NCCL WARN NET/IB : mlx5_0:1 "
            "Got non-fatal async event: port active(9)\n")
    assert parse_any(nccl, node="n") == []
    down = parse_any(nccl.replace("port active(9)", "port error(10)"), node="n")
    assert [(e.kind, e.device.name, e.device.port) for e in down] == [("ib_port_down", "mlx5_0", 1)]


def test_amd_machine_check_flags_decide_the_kind() -> None:
    """edac/mce_amd.c: `Uncorrected, software restartable error.` then `MC%d_STATUS[-|UE|MiscV|AddrV|-|...]` is a
    recoverable error (UC without PCC), not a fatal one; `System Fatal error.` with PCC is."""
    recoverable = ("[ 50.1] [Hardware Error]: Uncorrected, software restartable error.\n"
                   "[ 50.1] [Hardware Error]: CPU:2 (19:1:1) MC15_STATUS[-|UE|MiscV|AddrV|-|-|Poison|-]: 0xbc00000000000000\n")
    assert [(e.kind, e.severity.value) for e in events(recoverable)] == [("mce_recoverable", "degraded")]
    fatal = ("[ 50.1] [Hardware Error]: System Fatal error.\n"
             "[ 50.1] [Hardware Error]: CPU:2 (19:1:1) MC4_STATUS[Over|UE|MiscV|AddrV|PCC|-|-|-]: 0xfe00000000000000\n")
    assert [(e.kind, e.severity.value) for e in events(fatal)] == [("mce_uncorrected", "fatal")]


def test_journald_and_syslog_framings_beyond_dmesg() -> None:
    """journalctl -o short-monotonic / short-unix / short-full, and an rsyslog template that prints the severity
    between host and tag: the same message, the same event; a foreign program's line is not read as the kernel's."""
    msg = "mlx5_core 0000:3b:00.0 enp59s0f0np0: Link down"
    for prefix in ("[ 1000.123456] node-a01 kernel: ", "1764583200.123456 node-a01 kernel: ",
                   "Mon 2026-12-01 10:00:01 UTC node-a01 kernel: ", "Jun 18 10:10:06.585546 node-a01 ERR kernel: "):
        evs = events(prefix + msg)
        assert [(e.kind, e.device.name) for e in evs] == [("nic_link_down", "enp59s0f0np0")], prefix
    assert events("[ 1000.123456] node-a01 myapp[42]: " + msg) == []


def test_the_end_kernel_panic_trailer_closes_the_same_panic() -> None:
    """panic() ends its report with `---[ end Kernel panic - not syncing: <reason> ]---`: one panic, not two (it was
    a second kernel_panic, try2 F10); the trailer alone (the head lost) is still the panic, its reason without `]---`."""
    from pathlib import Path

    text = (Path(__file__).parent / "crash_texts" / "sched_irq_panic.txt").read_text()
    assert [e.kind for e in parse_text(text, node="n") if e.kind == "kernel_panic"] == ["kernel_panic"]
    alone = parse_text(text.splitlines()[-1], node="n")
    assert [(e.kind, e.attrs["panic_reason"]) for e in alone] == [("kernel_panic", "Fatal exception in interrupt")]
