"""Kinds beyond XID read from their formats (kernel sources, driver sources, vendor tools), one test per
form; collector prefixes (console servers, mpirun, pdsh, mail) by property. Each kind's source is named
in fleetmend/catalog/kinds.toml and in the matcher's docstring."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from agents.kmsg import KmsgParser, parse_text
from agents.kmsg.matchers import mce_kind
from agents.parsers import parse_any
from fleetmend.catalog import default_catalog, load_catalog
from fleetmend.events import FaultEvent


def one(text: str, kind: str | None = None) -> FaultEvent:
    evs = parse_text(text, node="n")
    if kind is not None:
        evs = [e for e in evs if e.kind == kind]
    assert len(evs) == 1, [(e.kind, e.message) for e in parse_text(text, node="n")]
    return evs[0]


def shape(e: FaultEvent) -> tuple:
    return e.kind, e.component.value, e.device.pci_bus_id, e.pid, e.severity.value


# ------------------------------------------------------------------ NIC transmit timeouts


def test_netdev_watchdog_every_form() -> None:
    old = one("[  12.0] NETDEV WATCHDOG: eth0: transmit timed out")  # before v2.6.27
    assert shape(old) == ("nic_tx_timeout", "nic", None, None, "degraded") and old.attrs["interface"] == "eth0"
    warn = one("[ 1.0] ------------[ cut here ]------------\n"
               "[ 1.0] WARNING: CPU: 3 PID: 0 at net/sched/sch_generic.c:316 dev_watchdog+0x237/0x250\n"
               "[ 1.0] NETDEV WATCHDOG: enp94s0f0 (i40e): transmit queue 7 timed out\n"
               "[ 1.0] Modules linked in: i40e")
    assert (warn.attrs["interface"], warn.attrs["driver"], warn.attrs["queue"]) == ("enp94s0f0", "i40e", 7)
    new = one("[ 9.0] mlx5_core 0000:3B:00.1 ens1f1np1: NETDEV WATCHDOG: CPU: 12: transmit queue 3 timed out 5188 ms")
    assert shape(new) == ("nic_tx_timeout", "nic", "0000:3b:00.1", None, "degraded")
    assert (new.attrs["interface"], new.attrs["driver"], new.attrs["timed_out_ms"], new.attrs["cpu"]) == (
        "ens1f1np1", "mlx5_core", 5188, 12)


def test_driver_follow_ups_join_the_watchdog_episode() -> None:
    cases = {
        "mlx5_core 0000:81:00.0 ens1f0: TX timeout on queue: 3, SQ: 0x1a2, CQ: 0x45, SQ Cons: 0x0 SQ Prod: 0x10, "
        "usecs since last trans: 18432000": "0000:81:00.0",
        "bnxt_en 0000:3b:00.0 eno1np0: TX timeout detected, starting reset task!": "0000:3b:00.0",
        "ena 0000:00:05.0 eth0: The number of lost tx completions is above the threshold (129 > 128). Reset the device":
            "0000:00:05.0",
        "ice 0000:3b:00.0 ens1f0: tx_timeout: VSI_num: 3, Q 5, NTC: 0x2a, HW_HEAD: 0x2a, NTU: 0x2b, INT: 0x1":
            "0000:3b:00.0",
        "i40e 0000:5e:00.0 enp94s0f0: tx_timeout recovery level 1, hung_queue 7": "0000:5e:00.0",
        "ixgbe 0000:04:00.0 eth2: tx hang 1 detected on queue 5, resetting adapter": "0000:04:00.0",
        "tg3 0000:03:00.0 eth0: transmit timed out, resetting": "0000:03:00.0",
        "bnx2 0000:01:00.0 eth0: <--- start FTQ dump --->": "0000:01:00.0",
        "e1000e 0000:00:1f.6 eno1: Reset adapter unexpectedly": "0000:00:1f.6",
    }
    for line, bdf in cases.items():
        e = one(f"[ 5.000001] {line}")
        assert shape(e) == ("nic_tx_timeout", "nic", bdf, None, "degraded"), line
        assert e.attrs["interface"] and e.attrs["driver"], line
        # with the watchdog line first, one event: the episode
        ifname = line.split()[2].rstrip(":")
        text = (f"[ 5.0] {line.split()[0]} {line.split()[1]} {ifname}: NETDEV WATCHDOG: CPU: 1: transmit queue 0 "
                f"timed out 5000 ms\n[ 5.1] {line}")
        assert [ev.kind for ev in parse_text(text, node="n")] == ["nic_tx_timeout"], line


def test_unrecoverable_reset_is_fatal() -> None:
    e = one("[ 7.0] ice 0000:3b:00.0 ens1f0: tx_timeout recovery unsuccessful, device is in unrecoverable state.")
    assert shape(e) == ("nic_reset_failed", "nic", "0000:3b:00.0", None, "fatal")
    e = one("[ 7.0] ena 0000:00:05.0 eth0: Device reset failed")
    assert shape(e)[0::4] == ("nic_reset_failed", "fatal")


def _episodes(gap_s: float, n: int, ifname: str = "ens5") -> str:
    return "\n".join(f"[{100 + i * gap_s:12.6f}] ena 0000:00:05.0 {ifname}: Found a Tx that wasn't completed on time, "
                     f"qid 0, index {i}." for i in range(n))


def test_repeated_timeouts_on_one_interface_are_fatal_with_the_catalog_threshold() -> None:
    entry = default_catalog().kinds["nic_tx_timeout"]
    assert (entry.escalate_to, entry.escalate_count, entry.escalate_window_s) == ("nic_tx_timeout_repeated", 3, 600.0)
    assert entry.escalate_reason and len(entry.escalate_reason) > 40
    kinds = [e.kind for e in parse_text(_episodes(60, 3), node="n")]
    assert kinds == ["nic_tx_timeout", "nic_tx_timeout", "nic_tx_timeout_repeated"]
    last = parse_text(_episodes(60, 3), node="n")[-1]
    assert (last.severity.value, last.attrs["repeat_count"], last.attrs["repeat_window_s"]) == ("fatal", 3, 600.0)
    # spread over more than the window: never fatal
    assert {e.severity.value for e in parse_text(_episodes(400, 4), node="n")} == {"degraded"}
    # one burst of lines (one episode) is one event, degraded
    assert [e.kind for e in parse_text(_episodes(0.01, 8), node="n")] == ["nic_tx_timeout"]
    # other interfaces do not add up
    two = "\n".join(f"[{100 + i * 60:12.6f}] ena 0000:00:0{5 + i % 2}.0 ens{5 + i % 2}: Found a Tx that wasn't "
                    f"completed on time, qid 0, index {i}." for i in range(4))
    assert {e.kind for e in parse_text(two, node="n")} == {"nic_tx_timeout"}


def test_threshold_comes_from_the_catalog(tmp_path) -> None:
    override = tmp_path / "o.toml"
    override.write_text("[kind.nic_tx_timeout]\nescalate_count = 5\n")
    cat = load_catalog(overrides=override)
    assert {e.kind for e in parse_text(_episodes(60, 4), node="n", catalog=cat)} == {"nic_tx_timeout"}
    assert parse_text(_episodes(60, 5), node="n", catalog=cat)[-1].kind == "nic_tx_timeout_repeated"


def _aer(times: list[float], bdf: str = "0000:00:03.0") -> str:
    return "\n".join(f"[{t:12.6f}] pcieport {bdf}: AER: Corrected error received: {bdf}" for t in times)


def test_corrected_aer_burst_is_a_catalog_escalation() -> None:
    """3 corrected AER errors on one port within 60 s become aer_corrected_burst; the threshold is
    `[kind.aer_corrected]`'s escalation, with its reason, like nic_tx_timeout's."""
    entry = default_catalog().kinds["aer_corrected"]
    assert (entry.escalate_to, entry.escalate_count, entry.escalate_window_s) == ("aer_corrected_burst", 3, 60.0)
    assert entry.escalate_reason and len(entry.escalate_reason) > 40
    three = parse_text(_aer([100, 120, 150]), node="n")
    assert [e.kind for e in three] == ["aer_corrected", "aer_corrected", "aer_corrected_burst"]
    assert (three[-1].severity.value, three[-1].attrs["burst_count"]) == ("degraded", 3)
    assert [e.kind for e in parse_text(_aer([100, 150]), node="n")] == ["aer_corrected", "aer_corrected"]
    assert {e.kind for e in parse_text(_aer([100, 150, 200]), node="n")} == {"aer_corrected"}  # 100 s apart
    # other ports do not add up
    other = _aer([100], "0000:00:03.0") + "\n" + _aer([110], "0000:00:04.0") + "\n" + _aer([120], "0000:00:05.0")
    assert {e.kind for e in parse_text(other, node="n")} == {"aer_corrected"}


def test_aer_burst_threshold_comes_from_the_catalog(tmp_path) -> None:
    override = tmp_path / "o.toml"
    override.write_text("[kind.aer_corrected]\nescalate_count = 2\nescalate_window_s = 10.0\n")
    cat = load_catalog(overrides=override)
    assert [e.kind for e in parse_text(_aer([100, 105]), node="n", catalog=cat)] == [
        "aer_corrected", "aer_corrected_burst"]
    assert {e.kind for e in parse_text(_aer([100, 150]), node="n", catalog=cat)} == {"aer_corrected"}


# ------------------------------------------------------------------ ConnectX firmware


def test_mlx5_command_timeouts_and_health() -> None:
    for line in (
        "mlx5_core 0000:18:00.0: wait_func:1155:(pid 1967079): TEARDOWN_HCA(0x103) timeout. Will cause a leak of a "
        "command resource",
        "mlx5_core 0000:18:00.0: wait_func_handle_exec_timeout:1128:(pid 185911): cmd[-22]: CREATE_UCTX(0xa04) No done "
        "completion",
        "mlx5_core 0000:18:00.0: cb_timeout_handler:932:(pid 12): cmd[3]: QUERY_VPORT_COUNTER(0x770) Async, timeout. "
        "Will cause a leak of a command resource",
    ):
        e = one(f"[ 1.0] {line}")
        assert shape(e) == ("mlx5_cmd_timeout", "ib", "0000:18:00.0", None, "fatal"), line
        assert e.attrs["command"] and e.attrs["opcode"].startswith("0x")
    e = one("[ 1.0] mlx5_core 0000:00:02.0: wait_func_handle_exec_timeout:1113:(pid 3122): cmd[0]: CREATE_CQ(0x400) "
            "recovered after timeout")
    assert shape(e) == ("mlx5_cmd_recovered", "ib", "0000:00:02.0", None, "degraded")
    e = one("[ 2.0] mlx5_core 0000:d2:00.0: poll_health:825:(pid 0): device's health compromised - reached miss count")
    assert shape(e) == ("mlx5_fw_fatal", "ib", "0000:d2:00.0", None, "fatal")
    e = one("[ 3.0] mlx5_core 0000:73:00.0: mlx5_health_try_recover:329:(pid 9): Health issue observed, firmware "
            "internal error, severity(3) ERROR:")
    assert shape(e)[0::4] == ("mlx5_fw_fatal", "fatal")


def test_mlx5_link_events_keep_the_device() -> None:
    down = one("[ 4.0] mlx5_core 0000:3b:00.0 ens1f0np0: Link down")
    assert shape(down) == ("nic_link_down", "nic", "0000:3b:00.0", None, "degraded")
    up = one("[ 5.0] mlx5_core 0000:3b:00.0 ens1f0np0: Link up")
    assert up.healthy and up.device.pci_bus_id == "0000:3b:00.0"


def test_command_timeout_stays_primary_over_the_oops_it_causes() -> None:
    text = ("mlx5_core 0000:18:00.0: wait_func:1155:(pid 1967079): TEARDOWN_HCA(0x103) timeout. Will cause a leak of a "
            "command resource\n"
            "mlx5_core 0000:18:00.0: mlx5_function_close:1288:(pid 1967079): tear_down_hca failed, skip cleanup\n"
            "BUG: unable to handle page fault for address: ffffa26487064230\n"
            "Oops: 0000 [#1] PREEMPT SMP PTI\n"
            "CPU: 0 PID: 0 Comm: swapper/0 Tainted: G           OE     -------  ---  6.7.0-68.fc38.x86_64 #1\n"
            "RIP: 0010:ioread32be+0x34/0x60\n"
            " poll_health+0x42/0x230 [mlx5_core]\n")
    evs = parse_text(text, node="n")
    assert [shape(e) for e in evs] == [("mlx5_cmd_timeout", "ib", "0000:18:00.0", None, "fatal")]
    assert evs[0].attrs["followed_by"] == "oops" and "Oops: 0000" in evs[0].raw


# ------------------------------------------------------------------ machine checks


def test_mci_status_decoding() -> None:
    assert mce_kind(0xBE00000000800400) == "mce_uncorrected"  # VAL UC EN MISCV ADDRV PCC
    assert mce_kind(0xBD80000000100134) == "mce_recoverable"  # VAL UC EN MISCV ADDRV S AR, no PCC (SRAR)
    assert mce_kind(0xCC59214000041152) == "mce_corrected_repeated"  # VAL OVER, UC clear: overflowed (issue 29)
    assert mce_kind(0x8C00008000010090) == "mce"  # VAL MISCV ADDRV, UC and OVER clear


def test_machine_check_forms() -> None:
    new = one("[ 1.0] mce: [Hardware Error]: CPU 12: Machine Check Exception: 5 Bank 1: be00000000800400")
    assert shape(new) == ("mce_uncorrected", "cpu", None, None, "fatal")
    assert (new.attrs["cpu"], new.attrs["bank"], new.attrs["mci_status"]) == (12, 1, "0xbe00000000800400")
    old = one("[ 1.0] [Hardware Error]: CPU 20: Machine Check Exception: 4 Bank 5: be00000000800400")
    assert shape(old)[0::4] == ("mce_uncorrected", "fatal")
    srar = one("[ 1.0] mce: [Hardware Error]: CPU 1: Machine Check Exception: 5 Bank 1: bd80000000100134")
    assert shape(srar)[0::4] == ("mce_recoverable", "degraded")
    # (after boot: at boot the CPU-online scan reads a bank left from before the reset, parser.BOOT_POLL_S)
    ce = one("[4000.0] mce: [Hardware Error]: Machine check events logged\n"
             "[4000.0] mce: [Hardware Error]: CPU 3: Machine Check: 0 Bank 6: cc59214000041152")
    assert shape(ce) == ("mce_corrected_repeated", "cpu", None, None, "degraded")
    assert "count" not in ce.attrs and "Bank 6" in ce.message  # the announcement and its bank are one event


def test_panic_names_its_cause() -> None:
    alone = one("[ 9.0] Kernel panic - not syncing: Fatal machine check")
    assert shape(alone) == ("mce_uncorrected", "cpu", None, None, "fatal") and alone.attrs["panic_reason"]
    ghes = one("[ 9.0] Kernel panic - not syncing: Fatal hardware error!")
    assert shape(ghes)[0::4] == ("ghes_fatal", "fatal")
    after = parse_text("[ 1.0] mce: [Hardware Error]: CPU 0: Machine Check: 0 Bank 6: cc59214000041152\n"
                       "[ 1.5] Kernel panic - not syncing: Fatal machine check", node="n")
    assert [shape(e) for e in after] == [("mce_uncorrected", "cpu", None, None, "fatal")]


# ------------------------------------------------------------------ GHES / CPER


def test_ghes_record_without_its_header() -> None:
    text = ("{12}[Hardware Error]: event severity: recoverable\n"
            "{12}[Hardware Error]:  Error 0, type: recoverable\n"
            "{12}[Hardware Error]:   section_type: PCIe error\n"
            "{12}[Hardware Error]:   port_type: 4, root port\n"
            "{12}[Hardware Error]:   device_id: 0000:3a:00.0\n")
    assert shape(one(text)) == ("ghes_recoverable", "pcie", "0000:3a:00.0", None, "degraded")
    mem = one("[ 5.0] {3}[Hardware Error]:   section_type: memory error\n"
              "[ 5.0] {3}[Hardware Error]:   error_status: 0x0000000000000400\n")
    assert shape(mem)[0:2] == ("ghes_recoverable", "memory")


def test_ghes_then_panic_is_one_fatal_event() -> None:
    text = ("{7}[Hardware Error]: Hardware error from APEI Generic Hardware Error Source: 1\n"
            "{7}[Hardware Error]: event severity: recoverable\n"
            "{7}[Hardware Error]:   section_type: PCIe error\n"
            "{7}[Hardware Error]:   device_id: 0000:17:00.0\n"
            "Kernel panic - not syncing: Fatal hardware error!\n")
    evs = parse_text(text, node="n")
    assert [shape(e) for e in evs] == [("ghes_fatal", "pcie", "0000:17:00.0", None, "fatal")]


# ------------------------------------------------------------------ GPU without Xid, old Xid framings


def test_gpu_boot_failures() -> None:
    e = one("[ 2.0] NVRM: GPU 0000:98:00.0: RmInitAdapter failed! (0x62:0x65:1792)")
    assert shape(e) == ("gpu_init_failed", "gpu", "0000:98:00.0", None, "fatal") and e.attrs["init_error"] == "0x62:0x65:1792"
    e = one("[ 2.0] NVRM: GPU 0000:c1:00.0: kfspDumpDebugState_GH100: NV_PFSP_FALCON_COMMON_SCRATCH_GROUP_2(0) = 0x0")
    assert shape(e) == ("gpu_fsp_error", "gpu", "0000:c1:00.0", None, "fatal")
    e = one("[ 2.0] NVRM: kfspWaitForSecureBoot_GH100: Timeout waiting for FSP secure boot")
    assert shape(e)[0::4] == ("gpu_fsp_error", "fatal")


def test_old_and_redacted_xid_framings() -> None:
    assert (one("NVRM: Xid (0000:03:00): 14, Channel 00000001").code, one("NVRM: Xid (0000:03:00): 14, x").device.pci_bus_id) \
        == (14, "0000:03:00.0")
    short = one("NVRM: Xid (0003:00): 13, 0003 00000000 00008297 00001b0c 0000000f 00000000")
    assert (short.code, short.device.pci_bus_id) == (13, "0000:03:00.0")
    for redacted in ("PCI:...", "PCI:xxxx:xx:xx", "..."):
        e = one(f"NVRM: Xid ({redacted}): 145, RLW_RXPIPE Nonfatal XC0 i0 Link 13 (0x0409a0c2 0x00000008)")
        assert (e.kind, e.code, e.device.pci_bus_id) == ("xid", 145, None), redacted


def test_device_kept_on_lines_that_name_it() -> None:
    e = one("[ 1.0] NVRM: GPU at 0000:01:00.0 has fallen off the bus.")
    assert shape(e) == ("gpu_fallen_off_bus", "gpu", "0000:01:00.0", None, "fatal")
    e = one("[ 1.0] nvme 0000:5e:00.0: I/O 12 QID 0 timeout, reset controller")
    assert shape(e) == ("nvme_timeout", "nvme", "0000:5e:00.0", None, "degraded")
    e = one("[ 1.0] nvme 0000:5e:00.0: Unable to change power state from D3cold to D0, device inaccessible")
    assert shape(e) == ("nvme_removed", "nvme", "0000:5e:00.0", None, "fatal")
    evs = parse_any("Unable to determine the device handle for GPU0: 0000:01:00.0: Unknown Error", node="n")
    assert [(x.kind, x.device.pci_bus_id) for x in evs] == [("gpu_fallen_off_bus", "0000:01:00.0")]


# ------------------------------------------------------------------ collector prefixes

XID = "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
stamps = st.builds(lambda d, h, m, s, us: f"2025-01-{d:02d} {h:02d}:{m:02d}:{s:02d}" + (f".{us:06d}" if us else ""),
                   st.integers(1, 28), st.integers(0, 23), st.integers(0, 59), st.integers(0, 59),
                   st.one_of(st.none(), st.integers(1, 999999)))
kernel = st.sampled_from(["[ 1843.308145] ", "[Sun Feb 23 16:24:18 2025] ", "<4>[  201.650687] ", ""])


@st.composite
def collected(draw) -> tuple[str, str | None]:
    k = draw(kernel)
    style = draw(st.sampled_from(["console_tab", "console_spaces", "mpirun_iso", "mpirun_ctime", "pdsh", "quote"]))
    ts = draw(stamps)
    if style in ("pdsh", "quote") and not k:
        k = "[ 1.5] "
    line = {
        "console_tab": f"{ts}\t{k}{XID}",
        "console_spaces": f"{ts}  {k}{XID}",
        "mpirun_iso": f"{ts.replace(' ', 'T')}Z: [1,{draw(st.integers(0, 4095))}]<stdout>:{k}{XID}",
        "mpirun_ctime": f"Mon Nov 30 17:51:57 2026[1,12]<stderr>:{k}{XID}",
        "pdsh": f"{draw(st.from_regex(r'[a-z][a-z0-9-]{0,12}[0-9]', fullmatch=True))}: {k}{XID}",
        "quote": ">" * draw(st.integers(1, 3)) + " " + k + XID,
    }[style]
    wall = {"console_tab": ts, "console_spaces": ts, "mpirun_iso": ts.replace(" ", "T") + "Z",
            "mpirun_ctime": "Mon Nov 30 17:51:57 2026"}.get(style)
    return line, wall


@settings(max_examples=300, deadline=None)
@given(collected())
def test_collector_prefixes_are_stripped_and_their_time_kept(case) -> None:
    line, wall = case
    evs = parse_text(line, node="n")
    assert [(e.kind, e.code, e.device.pci_bus_id) for e in evs] == [("xid", 79, "0000:3b:00.0")], line
    assert evs[0].message.startswith("NVRM: Xid"), line
    if wall is not None:
        assert wall in (evs[0].attrs.get("collector_time"), evs[0].attrs.get("kernel_time")), (line, evs[0].attrs)


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=40, max_value=78), st.sampled_from(["", "> ", ">> "]))
def test_mail_wrapped_lines_read_like_the_unwrapped_ones(width, quote) -> None:
    import textwrap

    lines = ["[  230.680927] mlx5_core 0000:00:02.0: mlx5_cmd_eq_recover:247:(pid 3122): Recovered 1 EQEs on cmd_eq",
             "[  230.681799] mlx5_core 0000:00:02.0: wait_func_handle_exec_timeout:1113:(pid 3122): cmd[0]: "
             "CREATE_CQ(0x400) No done completion",
             "[  230.683266] __common_interrupt: 3.34 No irq handler for vector"]
    flat = parse_text("\n".join(lines), node="n")
    wrapped = "\n".join(quote + w for ln in lines for w in textwrap.wrap(ln, width=max(width, 66) - len(quote),
                                                                          break_long_words=False, break_on_hyphens=False))
    got = parse_text(wrapped, node="n")
    assert [(e.kind, e.device.pci_bus_id) for e in got] == [(e.kind, e.device.pci_bus_id) for e in flat] == [
        ("mlx5_cmd_timeout", "0000:00:02.0")], wrapped
    import io

    from agents.kmsg.stream import parse_stream

    streamed = parse_stream(io.BytesIO(wrapped.encode()), KmsgParser("local", "n", "unknown"), chunk_bytes=97)
    assert [e.message for e in streamed] == [e.message for e in got]


def test_mail_wrapped_real_thread() -> None:
    """The quoted, wrapped capture from an iommu patch thread (lore.kernel.org, 'iommu/amd: Don't rely on
    external callers to enable IRTE' review, mlx5 VF in a guest)."""
    text = (">> [  167.759472] __common_interrupt: 3.34 No irq handler for vector\n"
            ">> [  230.680927] mlx5_core 0000:00:02.0: mlx5_cmd_eq_recover:247:(pid\n"
            ">> 3122): Recovered 1 EQEs on cmd_eq\n"
            ">> [  230.681799] mlx5_core 0000:00:02.0:\n"
            ">> wait_func_handle_exec_timeout:1113:(pid 3122): cmd[0]: CREATE_CQ(0x400)\n"
            ">> recovered after timeout\n"
            ">> [  230.683266] __common_interrupt: 3.34 No irq handler for vector\n")
    e = one(text)
    assert shape(e) == ("mlx5_cmd_recovered", "ib", "0000:00:02.0", None, "degraded")
    assert e.attrs["command"] == "CREATE_CQ"


def test_unwrapped_short_lines_are_not_joined() -> None:
    """A short unframed line after a short framed one is not a wrap (the next word would have fitted)."""
    text = "[  1.0] mlx5_core 0000:00:02.0: x\nBUG: kernel NULL pointer dereference, address: 0000000000000000"
    assert [e.kind for e in parse_text(text, node="n")] == ["oops"]


def test_streaming_equals_batch_for_wrapped_lines() -> None:
    text = ("[  1.0] mlx5_core 0000:00:02.0:\nwait_func_handle_exec_timeout:1113:(pid 3): cmd[0]: ENABLE_HCA(0x104) "
            "No done completion")
    p = KmsgParser("c", "n", "t")
    out = []
    for line in text.splitlines():
        out += p.feed(line)
    out += p.flush()
    assert [e.kind for e in out] == [e.kind for e in parse_text(text, node="n")] == ["mlx5_cmd_timeout"]


# ------------------------------------------------------------------ tool outputs


def kinds(text: str) -> list[tuple]:
    return sorted((e.kind, e.component.value, e.device.index, e.device.pci_bus_id, e.code, e.severity.value)
                  for e in parse_any(text, node="n"))


def test_nvidia_smi_nvlink_status_and_errors() -> None:
    status = ("GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-00000000-0000-0000-0000-000000000001)\n"
              "\t Link 0: 25 GB/s\n\t Link 1: <inactive>\n\t Link 2: 25 GB/s\n"
              "GPU 1: NVIDIA A100-SXM4-80GB (UUID: GPU-00000000-0000-0000-0000-000000000002)\n"
              "\t Link 0: 25 GB/s\n\t Link 1: 25 GB/s\n\t Link 2: 25 GB/s\n")
    assert kinds(status) == [("nvlink_down", "nvlink", 0, None, None, "degraded")]
    errors = ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-0000-0000-0000-000000000003)\n"
              "\t Link 0: Replay Errors: 0\n\t Link 0: Recovery Errors: 0\n\t Link 0: CRC Errors: 0\n"
              "\t Link 1: Replay Errors: 12\n\t Link 1: Recovery Errors: 2\n\t Link 1: CRC Errors: 0\n"
              "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-0000-0000-0000-000000000004)\n"
              "\t Link 0: Replay Errors: 0\n\t Link 0: Recovery Errors: 0\n\t Link 0: CRC Errors: 0\n")
    evs = [e for e in parse_any(errors, node="n") if e.kind == "nvlink_errors"]
    assert [(e.device.index, e.attrs["link1_replay_errors"], e.attrs["link1_recovery_errors"]) for e in evs] == [(0, 12, 2)]


def test_nvidia_smi_recovery_action_csv() -> None:
    text = ("index, pci.bus_id, gpu_recovery_action\n"
            "0, 00000000:18:00.0, None\n1, 00000000:2A:00.0, Reset\n2, 00000000:3A:00.0, Drain and Reset\n"
            "3, 00000000:5D:00.0, Reboot\n4, 00000000:9A:00.0, Drain P2P\n")
    got = [(e.device.index, e.device.pci_bus_id, e.attrs["recovery_action"], e.severity.value)
           for e in parse_any(text, node="n") if e.kind == "gpu_recovery_action"]
    assert got == [(1, "0000:2a:00.0", "Reset", "fatal"), (2, "0000:3a:00.0", "Drain and Reset", "fatal"),
                   (3, "0000:5d:00.0", "Reboot", "fatal"), (4, "0000:9a:00.0", "Drain P2P", "degraded")]


def test_dcgmi_dmon_xid_field() -> None:
    text = ("$ dcgmi dmon -e 230,311 -c 1\n#Entity   XIDER        DBEVL\nID\nGPU 0     0            0\n"
            "GPU 1     79           0\nGPU 2     N/A          3\n")
    assert kinds(text) == [("ecc_dbe_volatile", "gpu", 2, None, None, "fatal"), ("xid", "gpu", 1, None, 79, "fatal")]
    no_cmd = "#Entity   XID\nID\nGPU 0     48\n"
    assert [(e.kind, e.code) for e in parse_any(no_cmd, node="n")] == [("xid", 48)]


def test_dcgm_exporter_err_code_label() -> None:
    text = ('DCGM_FI_DEV_XID_ERRORS{gpu="3",UUID="GPU-00000000-0000-0000-0000-000000000005",pci_bus_id="00000000:BA:00.0",'
            'device="nvidia3",modelName="NVIDIA H100 80GB HBM3",Hostname="node-a01",err_code="79",'
            'err_msg="GPU has fallen off the bus"} 1.7320212e+12\n'
            'DCGM_FI_DEV_XID_ERRORS{gpu="0",UUID="GPU-x",err_code="0",err_msg="No Error"} 0\n')
    evs = parse_any(text, node="n")
    assert [(e.code, e.device.index, e.device.pci_bus_id, e.severity.value) for e in evs] == [
        (79, 3, "0000:ba:00.0", "fatal")]
    assert evs[0].attrs["err_msg"] == "GPU has fallen off the bus"


def test_bmc_sel_elist_and_vendor_layouts() -> None:
    elist = ("   1 | 06/02/2021 | 13:53:42 | Memory #0x87 | Uncorrectable ECC | Asserted\n"
             "   2 | 06/02/2021 | 13:53:42 | Processor CPU1 Status | IERR | Asserted\n"
             "   3 | 06/02/2021 | 13:54:00 | Critical Interrupt #0xa1 | Bus Fatal Error | Asserted\n"
             "   4 | 06/02/2021 | 13:55:00 | Memory #0x87 | Correctable ECC | Deasserted\n")
    assert [k[0::5] for k in kinds(elist)] == [("aer_fatal", "fatal"), ("edac_ue", "fatal"), ("mce_uncorrected", "fatal")]
    getsel = ("Record:      1\nDate/Time:   11/08/2019 09:41:44\nSource:      system\nSeverity:    Critical\n"
              "Description: Multi-bit memory errors detected on a memory device at location(s) DIMM_B3.\n"
              "-------------------------------------------------------------------------------\n"
              "Record:      2\nDate/Time:   11/08/2019 09:41:50\nSource:      system\nSeverity:    Ok\n"
              "Description: The chassis is closed.\n")
    assert [k[0::5] for k in kinds(getsel)] == [("edac_ue", "fatal")]
    lclog = ("SeqNumber       = 4113\nMessage ID      = CPU0000\nCategory        = System Health\n"
             "Severity        = Critical\nTimestamp       = 2019-11-08 09:41:44\n"
             "Message         = Internal error has occurred check for additional logs.\nFQDD            = CPU.Socket.1\n")
    # CPU0000's text does not say "processor": the Dell message-id family (CPU) does
    assert [k[0::5] for k in kinds(lclog)] == [("mce_uncorrected", "fatal")]
    assert kinds(lclog.replace("CPU0000", "SYS1003")) == []
    iml = "CRITICAL: Uncorrectable Machine Check Exception (Board 0, Processor 2, APIC ID 0x00000040, Bank 0x00000004)\n"
    assert [k[0::5] for k in kinds(iml)] == [("mce_uncorrected", "fatal")]
    iml_pci = "Critical | System Error | 05/21/2020 10:22 | 1 | Uncorrectable PCI Express Error (Embedded device, Bus 0)\n"
    assert [k[0::5] for k in kinds(iml_pci)] == [("aer_fatal", "fatal")]


def test_ras_mc_ctl_errors_and_summary() -> None:
    errors = ("Memory controller events:\n"
              "1 2021-03-10 15:40:19 +0800 1 Corrected error(s): memory read error at CPU_SrcID#0_MC#0_Chan#1_DIMM#0 "
              "location: 0:0:1:0, addr 10477060416, grain 32, syndrome 0  area:DRAM err_code:0101:0091\n\n"
              "PCIe AER events:\n"
              "1 2021-03-10 15:41:00 +0800 Uncorrected (Fatal) error: Surprise Down Error dev 0000:17:00.0\n\n"
              "MCE events:\n"
              "1 2021-03-10 15:40:19 +0800 error: MEMORY CONTROLLER RD_CHANNEL1_ERR Transaction: Memory read error, "
              "mcg mcgstatus=0, mci Corrected_error, n_errors: 1\n")
    assert kinds(errors) == [("aer_fatal", "pcie", None, "0000:17:00.0", None, "fatal"),
                             ("edac_ce", "memory", None, None, None, "info"), ("mce", "cpu", None, None, None, "info")]
    summary = ("Memory controller events summary:\n"
               "\tUncorrected on DIMM Label(s): 'CPU_SrcID#1_MC#0_Chan#0_DIMM#0' location: 1:0:0:-1 errors: 2\n\n"
               "PCIe AER events summary:\n\t1 Uncorrected (Non-Fatal) errors: Completion Timeout\n\n"
               "No Extlog errors.\n\nMCE records summary:\n\t1 MEMORY CONTROLLER RD_CHANNEL1_ERR Transaction: Memory "
               "read error errors\n")
    assert [k[0::5] for k in kinds(summary)] == [("aer_nonfatal", "degraded"), ("edac_ue", "fatal"),
                                                ("mce_uncorrected", "fatal")]


def test_nccl_local_catastrophic_error_is_a_dead_hca() -> None:
    text = "node-a01:34050:34121 [0] transport/net_ib.cc:93 NCCL WARN NET/IB : Got async event : local catastrophic error"
    assert kinds(text) == [("ib_device_fatal", "ib", None, None, None, "fatal")]


def test_one_stuck_queue_firing_the_watchdog_again_and_again_is_fatal() -> None:
    text = "\n".join(f"[{1000 + 5 * i:.6f}] mtk_soc_eth 1e100000.ethernet eth0: NETDEV WATCHDOG: CPU: 1: transmit "
                     f"queue 3 timed out {5000 * (i + 1)} ms" for i in range(4))
    evs = parse_text(text, node="n")
    assert [(e.kind, e.severity.value, e.attrs["repeat_count"]) for e in evs] == [("nic_tx_timeout_repeated", "fatal", 4)]
    # a driver reporting one hang every 2 s (igb/e1000e) is one episode
    hang = "\n".join(f"[{50 + 2 * i:.6f}] e1000e 0000:00:19.0 eth0: Detected Hardware Unit Hang:" for i in range(5))
    assert [(e.kind, e.severity.value) for e in parse_text(hang, node="n")] == [("nic_tx_timeout", "degraded")]


def test_ghes_record_whose_header_was_wrapped() -> None:
    text = ("{1}[Hardware Error]: Hardware error from APEI Generic Hardware\n"
            "Error Source: 1\n"
            "{1}[Hardware Error]: event severity: fatal\n"
            "{1}[Hardware Error]:  Error 0, type: fatal\n"
            "{1}[Hardware Error]:   section_type: PCIe error\n"
            "{1}[Hardware Error]:   device_id: 0000:af:00.0\n")
    assert shape(one(text)) == ("ghes_fatal", "pcie", "0000:af:00.0", None, "fatal")


def test_recovery_action_severity_is_the_catalogs_too() -> None:
    text = "index, pci.bus_id, gpu_recovery_action\n1, 00000000:2A:00.0, Reset\n4, 00000000:9A:00.0, Drain P2P\n"
    cat = default_catalog()
    got = [(e.attrs["recovery_action"], e.severity, cat.classify(e).severity, cat.classify(e).drain)
           for e in parse_any(text, node="n")]
    assert [(a, s1.value, s2.value, d) for a, s1, s2, d in got] == [("Reset", "fatal", "fatal", True),
                                                                  ("Drain P2P", "degraded", "degraded", False)]


def test_new_kinds_classify_as_the_parser_says() -> None:
    """Every event of the corpus and of these tests carries the severity the catalog gives its kind (one
    classification: the router's verdict agrees with what the parser printed)."""
    from tests.corpus_paths import load_cases

    cat = default_catalog()
    for case in load_cases():
        for e in parse_any(case["raw"], node="n"):
            if e.kind != "xid" and not e.healthy and e.kind in cat.kinds:
                assert cat.classify(e).severity == e.severity, (case["id"], e.kind, e.severity)


def test_every_nic_and_firmware_head_survives_the_streaming_reader() -> None:
    """Each head form of these kinds holds a streaming token (agents.kmsg.stream.TOKENS), so a large input
    read by `fleetmend explain` finds it too."""
    import io

    from agents.kmsg.stream import parse_stream

    noise = "[ 0.1] x86/split lock detection: #DB: warning on user-space bus_locks\n" * 3
    heads = [
        "bnx2 0000:01:00.0 eth0: <--- start FTQ dump --->",
        "ena 0000:00:05.0 eth0: Keep alive watchdog timeout.",
        "igb 0000:09:00.0: Detected Tx Unit Hang",
        "e1000e 0000:00:19.0 eth0: Detected Hardware Unit Hang:",
        "mlx5_core 0000:18:00.0: wait_func:1155:(pid 1): TEARDOWN_HCA(0x103) timeout. Will cause a leak of a command resource",
        "mce: [Hardware Error]: CPU 12: Machine Check Exception: 5 Bank 1: be00000000800400",
        "NVRM: GPU 0000:98:00.0: RmInitAdapter failed! (0x62:0x65:1792)",
        "nvme 0000:5e:00.0: I/O 12 QID 0 timeout, reset controller",
    ]
    for h in heads:
        text = f"{noise}[ 5.0] {h}\n{noise}"
        want = [(e.kind, e.device.pci_bus_id) for e in parse_text(text, node="n")]
        got = [(e.kind, e.device.pci_bus_id) for e in parse_stream(io.BytesIO(text.encode()), KmsgParser("c", "n", "u"))]
        assert got == want and want, h
