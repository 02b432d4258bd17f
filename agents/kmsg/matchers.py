"""Head builders: one kernel message in, at most one fault candidate out.

A *head* starts a fault record (an `NVRM: Xid` line, `AER: ... error received`, `INFO: task ...
blocked`). This module holds the patterns, their kernel and driver sources and one builder per family
(`xid_head`, `aer_head`, `mlx5_fw_head`, ...); `agents.kmsg.heads.HEADS` orders them, each behind its
substring guard, and `heads.match_head` tries them. Lines that only add detail to an open record
(register dumps, call traces, AER status lines) are not heads; `detail()` extracts fields from them.
Rules and their sources are in `fleetmend/catalog/kinds.toml`; XID framings follow NVIDIA's driver
output from r340 to r580 (with/without `pid=`, quoted `pid='<unknown>'`, `name=` with hyphens,
`Ch 0000003a`, NVLink5 register words, MIG `GPU-I:` suffixes).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from fleetmend.events import Component

Attr = str | int | float | bool | None

_BDF_RAW = r"(?:[0-9a-fA-F]{1,8}:)?[0-9a-fA-F]{1,2}:[0-9a-fA-F]{1,2}(?:\.[0-7])?"


_LOWERED: list[tuple[str, str]] = [("", "")]
"""(the text `lowered` last lowered, its lower-case form), replaced as one pair (one store: safe across threads): the
heads of one message share one `str.lower`. The text is held here, so its identity is not reused while kept."""


def lowered(t: str) -> str:
    """`t.lower()`, kept for the next call on the same string object."""
    last = _LOWERED[0]
    if last[0] is t:
        return last[1]
    low = t.lower()
    _LOWERED[0] = (t, low)
    return low


def may_hold(t: str, *words: str) -> bool:
    """Whether `t` may hold one of `words` (lower-case ASCII) in any letter case: the cheap necessary test a builder
    runs before a case-insensitive pattern that cannot match without one of them (such patterns open with `[\\w.-]+`
    or `.*` and cost tens of microseconds on a long line that holds the head's guard word but no fault, e.g. a kernel
    command line naming mlx5). Exact for ASCII text, where re.IGNORECASE folds only ASCII letters; text holding other
    characters always may (re.IGNORECASE folds KELVIN SIGN onto k, long s onto s, dotless i onto i)."""
    if not t.isascii():
        return True
    last = _LOWERED[0]  # `lowered`, inline: this runs several times on every message a head's guard lets in
    if last[0] is t:
        low = last[1]
    else:
        low = t.lower()
        _LOWERED[0] = (t, low)
    for w in words:
        if w in low:
            return True
    return False


def normalize_bdf(text: str | None) -> str | None:
    """`PCI:0000:3B:00` / `3b:00.0` / `0019:01:00` -> lower-case `dddd:bb:dd.f` (`0000:3b:00.0`).

    Returns None for text that is not a PCI address.
    """
    if not text:
        return None
    t = text.strip().lower()
    if t.startswith("pci:"):
        t = t[4:]
    m = re.fullmatch(r"(?:([0-9a-f]{1,8}):)?([0-9a-f]{1,2}):([0-9a-f]{1,2})(?:\.([0-7]))?", t)
    if not m:
        return None
    dom, bus, dev, fn = m.groups()
    return f"{int(dom or '0', 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{int(fn or '0')}"


@dataclass
class Candidate:
    """A fault seen in one message, before catalog classification.

    kind/code/component as in `FaultEvent`; `family` groups kinds that describe one condition (merged
    within a record window: XID 79 + 'fallen off the bus'; the OOM triple); `detail` marks a line that
    only refines an open record of its family (e.g. `PCIe Bus Error: severity=`), becoming a head
    only when no such record is open; `priority` breaks severity ties when merging (higher = more
    specific).
    """

    kind: str
    component: Component | None = None
    code: int | None = None
    bdf: str | None = None
    dev_name: str | None = None
    port: int | None = None
    pid: int | None = None
    healthy: bool = False
    attrs: dict[str, Attr] = field(default_factory=dict)
    family: str | None = None
    detail: bool = False
    priority: int = 0
    message: str = ""
    form: str | None = None
    """Which line of a multi-line report this is (`oom_head`: invoked / summary / selected / killed / reaped): a
    report prints each form once, so a second line of a form already in the open record is a new one."""


# ------------------------------------------------------------------------------------------ XID

_XID = re.compile(r"NVRM: Xid \((?P<id>[^)]*)\):\s*(?P<xid>\d+)\s*(?:,\s*(?P<rest>.*))?$")
_XID_ID = re.compile(rf"^(?:PCI:)?(?P<bdf>{_BDF_RAW})(?:[ ,].*)?$")
_XID_OLD_ID = re.compile(r"^(?P<bus>[0-9a-fA-F]{4}):(?P<slot>[0-9a-fA-F]{2})$")


def xid_device(ident: str) -> str | None:
    """The PCI address in an `NVRM: Xid (...)` parenthesis, normalised; None when redacted or absent.

    Framings (NVIDIA driver r1xx to r580): `PCI:0000:3b:00` (domain:bus:device), `0000:03:00` (no
    `PCI:`), `0003:00` (pre-r300 drivers print `%04x:%02x` = bus:slot, domain 0), `PCI:0000:3b:00 GPU-I:..`
    (MIG suffix); `PCI:...`, `PCI:xxxx` and the like are redactions (None, the XID is still read).
    """
    t = ident.strip()
    m = _XID_ID.match(t)
    if m:
        return normalize_bdf(m["bdf"])
    m = _XID_OLD_ID.match(t)
    if m:
        return f"0000:{int(m['bus'], 16):02x}:{int(m['slot'], 16):02x}.0" if int(m["bus"], 16) < 256 else None
    return None
_PID = re.compile(r"^pid=(?:'(?P<q>[^']*)'|\"(?P<dq>[^\"]*)\"|(?P<pid>-?\d+)|(?P<other>[^,\s]*))\s*(?:,\s*|$)")
_NAME = re.compile(r"^name=(?P<name>.*?)(?:,\s+|$)")
_NVL5 = re.compile(
    r"^(?P<unit>[A-Z][A-Z0-9_/]*)\s+(?P<word>Fatal|Nonfatal|Non-fatal|NonFatal)\b.*?"
    r"Link\s+(?P<link>-?\d+)\s*\((?P<regs>[^)]*)\)"
)
_NVL74 = re.compile(r"link\s+(?P<link>-?\d+)\s*\((?P<regs>0x[^)]*)\)", re.I)
_RST = re.compile(r"\bRST:\s*(?P<rst>Yes|No)\b.*?\bD-RST:\s*(?P<drst>Yes|No)\b", re.I)
_RECOVERY = re.compile(r"recovery action changed from\s+\S+\s*\((?P<old>[^)]*)\)\s*to\s+\S+\s*\((?P<new>[^)]*)\)", re.I)
_CHANNEL = re.compile(r"\b(?:Ch|channel|Channel ID)\s+(?P<ch>(?:0x)?[0-9a-fA-F]{4,8})\b")
_PHYS = re.compile(r"physAddr\s+(?P<pa>0x[0-9a-fA-F]+)")


def xid_head(text: str) -> Candidate | None:
    m = _XID.search(text)
    if not m:
        return None
    bdf = xid_device(m["id"])
    xid = int(m["xid"])
    rest = (m["rest"] or "").strip()
    pid: int | None = None
    attrs: dict[str, Attr] = {}
    pm = _PID.match(rest)
    if pm:
        if pm["pid"] is not None and int(pm["pid"]) > 0:
            pid = int(pm["pid"])
        elif pm["q"] and pm["q"].isdigit():
            pid = int(pm["q"])
        rest = rest[pm.end():]
    nm = _NAME.match(rest)
    if nm:
        name = nm["name"].strip()
        if name and name != "<unknown>":
            attrs["process"] = name
        rest = rest[nm.end():]
    attrs["xid_text"] = rest[:512]
    if 144 <= xid <= 150:
        vm = _NVL5.search(rest)
        if vm:
            regs = re.findall(r"0x[0-9a-fA-F]+", vm["regs"])
            attrs["unit"] = vm["unit"]
            attrs["fatal_word"] = "Fatal" if vm["word"] == "Fatal" else "Nonfatal"
            attrs["link"] = int(vm["link"])
            if len(regs) >= 2:
                attrs["intrinfo"] = regs[0].lower()
                attrs["error_status"] = regs[1].lower()
            attrs["registers"] = " ".join(r.lower() for r in regs)
    elif xid == 74:
        vm = _NVL74.search(rest)
        if vm:
            attrs["link"] = int(vm["link"])
            attrs["registers"] = " ".join(re.findall(r"0x[0-9a-fA-F]+", vm["regs"]))
    rm = _RST.search(rest)
    if rm:
        attrs["rst"] = rm["rst"].lower() == "yes"
        attrs["d_rst"] = rm["drst"].lower() == "yes"
    rcm = _RECOVERY.search(rest)
    if rcm:
        attrs["recovery_action"] = rcm["new"].strip()
        attrs["recovery_action_previous"] = rcm["old"].strip()
    cm = _CHANNEL.search(rest)
    if cm:
        attrs["channel"] = cm["ch"]
    pa = _PHYS.search(rest)
    if pa:
        attrs["phys_addr"] = pa["pa"]
    family = "gpu_lost" if xid == 79 else ("gsp" if xid in (119, 120) else None)
    return Candidate(kind="xid", code=xid, bdf=bdf, pid=pid, attrs=attrs, family=family, priority=10)


# ------------------------------------------------------------------------------------------ others

_FALLEN = re.compile(rf"(?:GPU\s+|NVIDIA GPU\s+)(?:at\s+)?(?:PCI:)?(?P<bdf>{_BDF_RAW})\b.*?fallen off the bus", re.I)
_FALLEN_ANY = re.compile(r"NVRM:.*fallen off the bus", re.I)
_RESET_REQ = re.compile(r"NV_ERR_RESET_REQUIRED|\bReset required\b", re.I)
_GSP = re.compile(
    r"NVRM: .*(?:GSP-CrashCat Report|kgspHealthCheck\w*:|GSP (?:RPC )?timeout|GSP (?:crash|halt)|"
    r"GSP task exception|_kgspBootstrap\w*: .*failed|GSP RM heartbeat timed out|LibOS heartbeat timed out|"
    r"GSP-RM unresponsive|GSP core unresponsive|Max GSP-RM boot attempts exceeded|unexpected WPR2 already up)",
    re.I,
)
_NVL_DISC = re.compile(r"NVRM: .*(?:knvlinkDiscover\w*: .*fail|nvlink.*discovery.*fail)", re.I)
_SXID = re.compile(rf"SXid \((?:PCI:)?(?P<bdf>{_BDF_RAW})\):\s*(?P<code>\d+),\s*(?P<rest>.*)$")
_SXID_DEV = re.compile(r"(?P<dev>nvidia-nvswitch\d+): SXid")
_PEERMEM = re.compile(r"nvidia-peermem .*invalid context", re.I)
_DEV_PREFIX = rf"(?P<drv>[\w.-]+) (?P<bdf>{_BDF_RAW})(?::pcie\d+)?:"
_AER_HEAD = re.compile(
    _DEV_PREFIX + r"\s+(?:AER: )?(?P<multi>Multiple )?"
    r"(?P<sev>Corrected|Correctable|Uncorrected \((?:Non-Fatal|Fatal)\)|Uncorrectable \((?:Non-Fatal|Fatal)\))"
    r" error(?: message)? received",
    re.I,
)
_AER_BUS = re.compile(_DEV_PREFIX + r"\s+(?:AER: )?PCIe Bus Error: severity=(?P<sev>[^,]+),\s*type=(?P<type>[^,]+)", re.I)
_AER_FAILED = re.compile(_DEV_PREFIX + r"\s+(?:AER: )?device recovery failed", re.I)
_DPC = re.compile(_DEV_PREFIX + r"\s+DPC:? containment event, status:(?P<status>0x[0-9a-fA-F]+) source:(?P<src>0x[0-9a-fA-F]+)")
"""drivers/pci/pcie/dpc.c dpc_process_error (dev_fmt `DPC: `): `containment event, status:%#06x source:%#06x` (v4.x
dpc_work on the DPC service device `dpc <bdf>:pcie008: DPC containment event, ...`): the port contained an
uncorrectable error by disabling its link; the device below is off the bus until recovery (read as aer_fatal, the
port the device)."""
_PCIE_BW = re.compile(
    _DEV_PREFIX + r"\s+(?P<avail>[\d.]+ [GM]b/s) available PCIe bandwidth, limited by (?P<speed>[\d.]+ GT/s) "
    r"PCIe x(?P<w>\d+) link at (?P<at>\S+) \(capable of (?P<cap>[\d.]+ [GM]b/s) with (?P<cspeed>[\d.]+ GT/s) "
    r"PCIe x(?P<cw>\d+) link\)"
)
_EDAC = re.compile(r"EDAC (?:[\w-]+ )?(?P<mc>MC\d+): (?:(?P<n>\d+) )?(?P<t>CE|UE|Corrected|Uncorrected)\b(?P<rest>.*)")
"""drivers/edac/edac_mc.c: v3.6+ edac_ce_error/edac_ue_error `EDAC MC%d: %d CE %s%son %s (%s %s - %s)` (v5.x+ `... (%s
page:0x%lx offset:0x%lx grain:%ld syndrome:0x%lx%s%s)`), ghes_edac `%d CE Single-bit ECC on ...`; v2.6-v3.5
edac_mc_handle_ce `EDAC MC%d: CE page 0x%lx, offset 0x%lx, grain %d, syndrome 0x%lx, row %d, channel %d, label "%s":
%s` and `UE page 0x%lx, ...` (no count: one error)."""
_MCE_LOGGED = re.compile(r"(?:mce: )?\[Hardware Error\]: Machine check events logged", re.I)
_GHES = re.compile(r"\{\d+\}\[Hardware Error\]: Hardware error from APEI Generic Hardware Error Source")
_IB_PORT = re.compile(
    rf"(?P<drv>[\w-]+) (?P<bdf>{_BDF_RAW})(?: (?P<dev>[\w-]+))?:?\s+Port: (?P<port>\d+) Link "
    r"(?P<st>DOWN|INIT|ACTIVE_DEFER|ACTIVE|ARMED|POLLING)\b",
    re.I,
)
"""drivers/infiniband/core/cache.c ib_cache_update (v6.9+): ibdev_info(`Port: %d Link %s`, ib_port_state_to_str) with the
ib device prefix `<driver> <parent bus id> <ibdev>: ` (mlx5_core/mlx4_core/irdma/bnxt_re ... `mlx5_0`, `rocep59s0f0`)."""
_IB_POWER = re.compile(rf"mlx5_core (?P<bdf>{_BDF_RAW}).*insufficient power on the PCIe slot", re.I)
_ACCESS_REG = re.compile(r"mlx5_cmd_(?:out_err|check).*ACCESS_REG\(0x[0-9a-f]+\).*failed", re.I)
_NIC_LINK = re.compile(
    rf"(?:(?P<drv>[\w.-]+) (?P<bdf>{_BDF_RAW}) )?(?P<ifname>[\w.@-]+): (?:(?:igb|ixgbe|e1000e?): [\w.@-]+ )?(?:NIC )?"
    r"Link is (?P<st>Up|Down)\b|(?P<drv2>mlx4_en): (?P<if2>[\w.@-]+): Link (?P<st2>Up|Down)$",
    re.I,
)
"""NIC drivers' link messages: `NIC Link is Up %s` / `NIC Link is Down` (ixgbe, i40e, ice (`NIC Link is up %sbps Full
Duplex, ...`), bnxt_en (`NIC Link is Up, %u Mbps %s%s duplex, ...`), e1000e, igb (`igb: %s NIC Link is Up ...` after
the netdev prefix)), `Link is Up - %s/%s` (r8169 phylib, tg3 `Link is up at %d Mbps, %s duplex`), mlx4_en (`mlx4_en:
%s: Link Up` / `Link Down`, en_info)."""
_BOND_SLAVE = re.compile(
    r"(?P<bond>[\w.-]+): (?:link status definitely (?P<st1>down|up) for interface (?P<if1>[\w.@-]+)|"
    r"\(slave (?P<if2>[\w.@-]+)\): link status definitely (?P<st2>down|up))"
)
"""drivers/net/bonding/bond_main.c bond_miimon_commit: v5.3+ slave_info(bond, slave, `link status definitely
down, disabling slave`) / `link status definitely up, %u Mbps %s duplex`, printed `%s: (slave %s): ...`; before
v5.3 netdev_info(bond, `link status definitely down for interface %s, disabling it`). Any bond name (not only
`bond*`: `team0`, `mgmt`, `uplink`)."""
_BOND_PENDING = re.compile(
    r"(?P<bond>[\w.-]+): (?:\(slave (?P<if2>[\w.@-]+)\): )?link status (?P<st>down|up)(?: again after \d+ ms)?"
    r"(?: for (?:(?:active|backup) )?interface(?: (?P<if1>[\w.@-]+))?)?, (?:disabling|enabling) it in (?P<ms>\d+) ms"
)
"""bond_main.c bond_miimon_inspect: v5.3+ slave_info(`link status down for %sinterface, disabling it in %d ms`)
(`active `/`backup `/``), `link status up, enabling it in %d ms` (no "for interface" on the up side); before v5.3
`%s: link status down for %sinterface %s, disabling it in %d ms`: the downdelay/updelay has started (definitely
down/up follows)."""
_BOND_NONE = re.compile(r"(?P<bond>[\w.-]+): now running without any active interface")
_BOND_BACK = re.compile(r"(?P<bond>[\w.-]+): (?:first active interface up|active interface up)")
_NVME_ID = rf"(?P<dev>nvme\d+|{_BDF_RAW})"
_NVME_TIMEOUT = re.compile(
    rf"nvme {_NVME_ID}: (?:I/O (?:tag )?\d+ ?(?:\([^)]*\) )?(?:type \d+ )?(?:opcode \S+ (?:\([^)]*\) )?)?QID \d+ "
    r"timeout|controller is down; will reset)"
)
"""drivers/nvme/host/pci.c nvme_timeout(): v4.x-v6.0 `I/O %d QID %d timeout, aborting|reset controller|disable
controller`, `I/O %d(%s) QID %d timeout, completion polled`; v6.1+ `I/O tag %d (%04x) opcode %#x (%s) QID %d
timeout, reset controller` / `..., aborting req_op:%s(%u) size:%u`; rdma.c/tcp.c `I/O tag %d (%04x) [type %d ]
opcode %#x (%s) QID %d timeout`; `controller is down; will reset: CSTS=0x%x, PCI_STATUS=0x%hx`; printed with the
controller (`nvme nvme0:`) or, in older kernels and some paths, the PCI device (`nvme 0000:5e:00.0:`)."""
_NVME_NOTREADY = re.compile(rf"nvme {_NVME_ID}: Device not ready; aborting (?:reset|initialisation)")
_NVME_REMOVED = re.compile(
    rf"nvme {_NVME_ID}: (?:Removing after probe failure|Disabling device after reset failure|"
    r"Unable to change power state from D3\w* to D0, device inaccessible|failure state error detected, request disconnect)"
)
_NVME_RESET = re.compile(rf"nvme {_NVME_ID}: (?:resetting controller|Abort status: 0x[0-9a-f]+|Shutdown timeout(?! set to)|"
                         r"Device shutdown incomplete|frozen state error detected, reset controller)")
"""pci.c/core.c: `resetting controller`, `Abort status: 0x%x`, `Device shutdown incomplete; abort shutdown` (older
`Shutdown timeout; abort shutdown`; `Shutdown timeout set to %u seconds` is a probe notice, not read), pci.c
nvme_error_detected `frozen state error detected, reset controller` / `failure state error detected, request disconnect`
(PCI error recovery reached the drive)."""


def _nvme_dev(dev: str) -> dict:
    """`nvme0` -> device name; a PCI address -> normalised bus id."""
    return {"dev_name": dev} if dev.startswith("nvme") else {"bdf": normalize_bdf(dev)}


def pci_prefixed(t: str) -> bool:
    """Cheap test for a driver-model prefix `<driver> dddd:bb:dd.f ...` (dev_printk with a PCI device)."""
    sp = t.find(" ", 0, 40)
    if sp <= 0:
        return False
    if t[sp + 5:sp + 6] != ":":
        sp += 1  # a five-digit domain (Intel VMD: `10000:e1:00.0`)
    return t[sp + 5:sp + 6] == ":" and t[sp + 8:sp + 9] == ":"
_PANIC = re.compile(r"Kernel panic - not syncing: ?(?P<reason>.*)")
_OOPS = re.compile(
    r"^(?:BUG: unable to handle (?:kernel )?(?:NULL pointer dereference|paging request|page fault)|"
    r"BUG: kernel NULL pointer dereference|kernel BUG at |general protection fault|divide error: )"
)
_OOPS_LINE = re.compile(r"^(?:Oops|invalid opcode): [0-9a-fA-F]+ \[#\d+\]")
_SOFT = re.compile(r"BUG: soft lockup - CPU#(?P<cpu>\d+) stuck for (?P<s>\d+)s! \[(?P<comm>.*):(?P<pid>\d+)\]")
_HARD = re.compile(r"Watchdog detected hard LOCKUP on cpu (?P<cpu>\d+)", re.I)
_HUNG = re.compile(r"INFO: task (?P<comm>.+?):(?P<pid>\d+) blocked for more than (?P<s>\d+) seconds")
_OOM_INVOKED = re.compile(r"^(?P<comm>\S.*?) invoked oom-killer:")
_OOM_SUMMARY = re.compile(r"oom-kill:constraint=.*?,task=(?P<comm>[^,]*),pid=(?P<pid>\d+)")
_OOM_KILL = re.compile(
    r"(?:Memory cgroup out of memory|Out of memory(?: \([^)]*\))?): Kill(?:ed)? process (?P<pid>\d+) \((?P<comm>[^)]*)\)"
)
_OOM_KILLED = re.compile(r"^Killed process (?P<pid>\d+) \((?P<comm>[^)]*)\)")
_OOM_REAPED = re.compile(r"^oom_reaper: reaped process (?P<pid>\d+) \((?P<comm>[^)]*)\)")



# ------------------------------------------------------------------------------------------ NIC transmit timeouts

_NETDEV_WD = re.compile(
    r"NETDEV WATCHDOG: (?:(?P<if>[\w.@:-]+) \((?P<drv>[^)]*)\): transmit queue (?P<q>\d+) timed out(?: (?P<ms>\d+) ms)?|"
    r"CPU: (?P<cpu>\d+): transmit queue (?P<q2>\d+) timed out(?: (?P<ms2>\d+) ms)?|"
    r"(?P<if3>[\w.@:-]+): transmit timed out)"
)
_IPOIB_TIMEOUT = re.compile(r"(?:^|\s)(?P<if>[\w.@-]+): transmit timeout: latency (?P<ms>\d+) msecs")
"""drivers/infiniband/ulp/ipoib/ipoib_main.c ipoib_timeout: ipoib_warn(`transmit timeout: latency %d msecs`) (ipoib_warn
prints `%s: ` with the IPoIB interface, `ib0`, `ibp59s0`), then `queue stopped %d, tx_head %u, ...`."""
"""net/sched/sch_generic.c dev_watchdog(): `NETDEV WATCHDOG: %s (%s): transmit queue %u timed out[ %u ms]`
inside a WARN_ONCE (v2.6.27..v6.7), `netdev_crit(dev, "NETDEV WATCHDOG: CPU: %d: transmit queue %u timed out
%u ms")` since v6.8 (the netdev prefix names driver, bus id and interface), `NETDEV WATCHDOG: %s: transmit
timed out` before v2.6.27."""
_NETDEV_PREFIX = re.compile(r"^(?P<drv>[\w.-]+) (?P<bus>\S+) (?P<if>[\w.@-]+)(?: \([\w ]+\))?: ")
_WD_WARN = re.compile(r"^WARNING: (?:CPU: \d+ PID: \d+ )?at \S*net/sched/sch_generic\.c:\d+ dev_watchdog\b")
_NIC_DEV = re.compile(rf"^(?P<drv>[\w.-]+) (?P<bdf>{_BDF_RAW})(?: (?P<if>[\w.@-]+))?: (?P<msg>.*)$")
NIC_DRIVERS = frozenset(
    "igb igc e1000 e1000e ixgbe ixgbevf i40e iavf ice idpf fm10k bnxt_en bnx2 bnx2x tg3 ena mlx4_en mlx5_core "
    "r8169 r8125 r8152 qede qlcnic be2net enic vmxnet3 virtio_net hns3 atlantic cxgb4 sfc nfp ionic gve txgbe "
    "ngbe 8139too via-rhine".split()
)
"""NIC drivers whose device-level messages (`igb 0000:09:00.0: Detected Tx Unit Hang`, no interface name)
are read as NIC events; a message with an interface name (netdev_printk) is a NIC message whatever the driver."""
_NIC_TX_FOLLOW = re.compile(
    r"TX timeout on queue: ?(?P<q>\d+)|TX timeout detected|"  # mlx5e en_main.c mlx5e_tx_timeout_work / bnxt.c
    r"Found a Tx that wasn't completed on time, qid (?P<q2>\d+)|TX hasn't completed, qid (?P<q6>\d+)|"  # ena_netdev.c
    r"Lost TX completions are above the threshold|"  # ena_netdev.c check_missing_comp_in_tx_queue (v6.5+)
    r"TX q (?P<q3>\d+) is paused for too long|"  # ena_netdev.c
    r"tx_timeout: VSI_(?:num|seid): \d+, Q (?P<q4>\d+)|tx_timeout recovery level \d+|"  # ice_main.c / i40e_main.c
    r"Detected Tx Unit Hang|Detected Hardware Unit Hang|tx hang \d+ detected on queue (?P<q5>\d+)|"  # ixgbe/igb/e1000e
    r"initiating reset due to tx timeout|transmit timed out, resetting|"  # ixgbe / tg3.c tg3_tx_timeout
    r"<--- start FTQ dump --->|"  # bnx2.c bnx2_tx_timeout -> bnx2_dump_ftq
    r"(?:tx|transmit)[ _-]?(?:timeout|timed out|hang)(?!: \d+$)",
    re.I,
)
_NIC_RESET = re.compile(
    r"lost tx completions is above the threshold|Trigger reset is on|Keep alive watchdog timeout|"  # ena
    r"Device reset completed successfully|"  # ena
    r"starting reset task|Reset adapter|resetting adapter|PF reset (?:requested|done)",
    re.I,
)
_NIC_UNRECOVERABLE = re.compile(
    r"tx_timeout recovery unsuccessful|device is in (?:un|non-)recoverable state|"  # ice_main.c / i40e_main.c
    r"Device reset failed|Reset indication didn't turn off|"  # ena_netdev.c ena_restore_device / ena_com
    r"(?:adapter|device) reset failed|failed to reset (?:the )?(?:adapter|device)|Abort FW reset",
    re.I,
)


def nic_tx_head(t: str) -> Candidate | None:
    """NIC transmit timeouts, driver resets and unrecoverable resets (family `nic_tx`).

    Sources: net/sched/sch_generic.c dev_watchdog; drivers/net/ethernet/mellanox/mlx5/core/en_main.c
    (`TX timeout on queue: %d, SQ: 0x%x, CQ: 0x%x, SQ Cons: 0x%x SQ Prod: 0x%x, usecs since last trans: %u`);
    broadcom/bnxt/bnxt.c (`TX timeout detected, starting reset task!`); amazon/ena/ena_netdev.c (`Found a Tx
    that wasn't completed on time, qid %d, index %d.`, `The number of lost tx completions is above the
    threshold (%d > %d). Reset the device`, `Trigger reset is on`, `Device reset completed successfully`);
    intel/ice/ice_main.c and i40e/i40e_main.c (`tx_timeout: VSI_num: %d, Q %u, NTC: ...`, `tx_timeout recovery
    level %d, txqueue %u`, `tx_timeout recovery unsuccessful, device is in unrecoverable state.`);
    intel/ixgbe/ixgbe_main.c (`Detected Tx Unit Hang`, `tx hang %d detected on queue %d, resetting adapter`,
    `initiating reset due to tx timeout`); igb/e1000e (`Detected Tx Unit Hang`, `Detected Hardware Unit
    Hang`); broadcom/tg3.c (`transmit timed out, resetting`); broadcom/bnx2.c (FTQ dump on tx timeout).
    """
    if "NETDEV WATCHDOG" in t:
        m = _NETDEV_WD.search(t)
        if m:
            attrs: dict[str, Attr] = {}
            bdf = None
            ifname = m["if"] or m["if3"]
            drv = m["drv"]
            pm = _NETDEV_PREFIX.match(t)
            if pm and t.find("NETDEV WATCHDOG") > 0:
                drv = drv or pm["drv"]
                ifname = ifname or pm["if"]
                bdf = normalize_bdf(pm["bus"])
            q, ms = m["q"] or m["q2"], m["ms"] or m["ms2"]
            if q is not None:
                attrs["queue"] = int(q)
            if ms is not None:
                attrs["timed_out_ms"] = int(ms)
            if m["cpu"] is not None:
                attrs["cpu"] = int(m["cpu"])
            if drv:
                attrs["driver"] = drv
            if ifname:
                attrs["interface"] = ifname
            return Candidate(kind="nic_tx_timeout", component=Component.NIC, bdf=bdf, dev_name=ifname,
                             family="nic_tx", priority=2, attrs=attrs)
    if "transmit timeout: latency" in t:
        m = _IPOIB_TIMEOUT.search(t)
        if m:
            return Candidate(kind="nic_tx_timeout", component=Component.IB, dev_name=m["if"], family="nic_tx", priority=2,
                             attrs={"interface": m["if"], "timed_out_ms": int(m["ms"]), "driver": "ib_ipoib"})
    if "dev_watchdog" in t and _WD_WARN.search(t):
        return Candidate(kind="nic_tx_timeout", component=Component.NIC, family="nic_tx", detail=True, priority=0)
    m = _NIC_DEV.match(t)
    if m is None or (m["if"] is None and m["drv"] not in NIC_DRIVERS):
        return None
    low = m["msg"].lower()
    if not any(k in low for k in ("tx", "transmit", "reset", "hang", "ftq", "recover", "abort", "watchdog")):
        return None
    attrs = {"driver": m["drv"]}
    if m["if"]:
        attrs["interface"] = m["if"]
    base = dict(component=Component.NIC, bdf=normalize_bdf(m["bdf"]), dev_name=m["if"], family="nic_tx")
    if _NIC_UNRECOVERABLE.search(m["msg"]):
        return Candidate(kind="nic_reset_failed", priority=5, attrs=attrs, **base)  # type: ignore[arg-type]
    fm = _NIC_TX_FOLLOW.search(m["msg"])
    if fm:
        q = next((g for g in fm.groups() if g is not None), None)
        if q is not None:
            attrs["queue"] = int(q)
        return Candidate(kind="nic_tx_timeout", priority=1, attrs=attrs, **base)  # type: ignore[arg-type]
    if _NIC_RESET.search(m["msg"]):
        return Candidate(kind="nic_tx_timeout", priority=0, detail=True, attrs=dict(attrs, reset=True), **base)  # type: ignore[arg-type]
    return None


# ------------------------------------------------------------------------------------------ mlx5 firmware

_MLX5_DEV = re.compile(rf"^(?P<drv>mlx5_core|mlx5_ib|mlx5e?)\s+(?P<bdf>{_BDF_RAW})(?:\s+(?P<if>[\w.@-]+))?:\s*(?P<msg>.*)$")
_MLX5_CMD_TIMEOUT = re.compile(
    r"(?:cmd\[-?\d+\]: )?(?P<cmd>[A-Z][A-Z0-9_]+)\(0x(?P<op>[0-9a-fA-F]+)\)\s*(?:Async, )?"
    r"(?:timeout\. Will cause a leak|No done completion|canceled on out of queue timeout|"
    r"(?P<rec>(?:Async, )?recovered after timeout|completion arrived after timeout))"
)
"""drivers/net/ethernet/mellanox/mlx5/core/cmd.c: wait_func() `%s(0x%x) timeout. Will cause a leak of a
command resource`, `%s(0x%x) canceled on out of queue timeout.`; wait_func_handle_exec_timeout() `cmd[%d]:
%s(0x%x) No done completion` / `cmd[%d]: %s(0x%x) recovered after timeout`; cb_timeout_handler() `cmd[%d]:
%s(0x%x) Async, timeout. Will cause a leak of a command resource`."""
_MLX5_FW_FATAL = re.compile(
    r"device's health compromised|[Hh]ealth poll failed|Fatal error \d+ detected|health recovery flow aborted|"
    r"FW is unable to respond to initialization segment reads|synd 0x[0-9a-fA-F]+: \w|"
    r"unrecoverable hardware error|mlx5_enter_error_state|System error event triggered|"
    r"PCI channel state was permanently failed"
)
_MLX5_FW_WORDS = ("health", "Health", "Fatal error", "FW is unable", "synd 0x", "unrecoverable", "error_state",
                  "System error", "permanently failed")
"""Substrings one of which every `_MLX5_FW_FATAL` match holds (checked first: the regex runs on few lines)."""
"""drivers/net/ethernet/mellanox/mlx5/core/health.c: poll_health() `device's health compromised - reached
miss count`, `Fatal error %u detected`, print_health_info() `synd 0x%x: %s` (hsynd_str: `firmware internal
error`, `unrecoverable hardware error`, ...), mlx5_enter_error_state() `start`/`end` and `System error
event triggered`."""
_MLX5_TEMP = re.compile(r"High temperature on sensors with bit set (?P<msb>[0-9a-fA-F]+) (?P<lsb>[0-9a-fA-F]+)")
"""drivers/net/ethernet/mellanox/mlx5/core/events.c temp_warn: mlx5_core_warn(`High temperature on sensors with bit set
%llx %llx`) (the sensors over their warning threshold, as bit masks)."""
_MLX5_HEALTH_ISSUE = re.compile(r"Health issue observed, (?P<what>.*?), severity\((?P<sev>\d+)\)")
"""health.c (v6.3+) mlx5_health_... `Health issue observed, %s, severity(%d) %s:`; severity is a syslog level."""
_MLX5_LINK = re.compile(r"^Link (?P<st>up|down)\b", re.I)
"""drivers/net/ethernet/mellanox/mlx5/core/en_main.c mlx5e_update_carrier: `Link up` / `Link down`."""


def mlx5_fw_head(t: str) -> Candidate | None:
    m = _MLX5_DEV.match(t)
    if m is None:
        if "synd 0x" in t and _MLX5_FW_FATAL.search(t):  # `mlx5_core: INFO: synd 0x8: ...`
            return Candidate(kind="mlx5_fw_fatal", component=Component.IB, family="mlx5_fw", detail=True, priority=1)
        return None
    msg = m["msg"]
    bdf = normalize_bdf(m["bdf"])
    base: dict = dict(bdf=bdf, family="mlx5_fw")
    attrs: dict[str, Attr] = {"driver": m["drv"]}
    if m["if"]:
        attrs["interface"] = m["if"]
    lm = _MLX5_LINK.match(msg)
    if lm and m["if"]:
        up = lm["st"].lower() == "up"
        return Candidate(kind="nic_link_up" if up else "nic_link_down", component=Component.NIC, bdf=bdf,
                         dev_name=m["if"], healthy=up, attrs=attrs)
    if "(0x" in msg:
        cm = _MLX5_CMD_TIMEOUT.search(msg)
        if cm:
            attrs["command"] = cm["cmd"]
            attrs["opcode"] = "0x" + cm["op"].lower()
            if cm["rec"]:
                return Candidate(kind="mlx5_cmd_recovered", component=Component.IB, priority=0, attrs=attrs, **base)
            return Candidate(kind="mlx5_cmd_timeout", component=Component.IB, priority=3, attrs=attrs, **base)
    if "High temperature" in msg:
        tm = _MLX5_TEMP.search(msg)
        if tm:
            attrs["sensors"] = f"{tm['msb']} {tm['lsb']}"
            return Candidate(kind="nic_temperature_high", component=Component.IB, bdf=bdf, attrs=attrs)
    if "Health issue" in msg:
        hm = _MLX5_HEALTH_ISSUE.search(msg)
        if hm:
            attrs["health_issue"] = hm["what"][:128]
            attrs["health_severity"] = int(hm["sev"])
            kind = "mlx5_fw_fatal" if int(hm["sev"]) <= 3 else "mlx5_health_warning"
            return Candidate(kind=kind, component=Component.IB, priority=1, attrs=attrs, **base)
    if any(w in msg for w in _MLX5_FW_WORDS) and _MLX5_FW_FATAL.search(msg):
        return Candidate(kind="mlx5_fw_fatal", component=Component.IB, priority=2, attrs=attrs, **base)
    return None


# ------------------------------------------------------------------------------------------ machine checks

_MCE_HEAD = re.compile(
    r"\[Hardware Error\]: CPU (?P<cpu>\d+): Machine Check(?P<exc> Exception)?: (?P<mcg>[0-9a-fA-F]+) "
    r"Bank (?P<bank>\d+)(?:: (?P<status>[0-9a-fA-F]{1,16}))?"
)
"""arch/x86/kernel/cpu/mce/core.c __print_mce(): `HW_ERR "CPU %d: Machine Check%s: %Lx Bank %d: %016Lx"`
(` Exception` when MCG_STATUS.MCIP is set), HW_ERR = `[Hardware Error]: `, pr_fmt `mce: ` since v4.x (older
kernels print no `mce: `)."""
_MCE_FATAL_TEXT = re.compile(
    r"\[Hardware Error\]: (?:Machine check: )?(?:Processor context corrupt|Action required: .*|"
    r"Machine check from unknown source|System Fatal error\.|"
    r"Some CPUs didn't answer in synchronization|Timeout: Not all CPUs entered broadcast exception handler)|"
    r"mce: Uncorrected hardware memory error|Memory error not recovered|Fatal local machine check",
    re.I,
)
"""mce/severity.c severity texts used as the panic message (`Processor context corrupt`, `Action required:
...`), mce/core.c (`Machine check from unknown source`, `Timeout: Not all CPUs entered broadcast exception
handler`), edac/mce_amd.c decode_error_status (`System Fatal error.`: UC with PCC)."""
_MCE_RECOVERABLE_TEXT = re.compile(r"\[Hardware Error\]: Uncorrected, software (?:restartable|containable) error")
"""edac/mce_amd.c decode_error_status: UC without PCC (`Uncorrected, software restartable error.`, `... containable
error.`): the kernel can contain it (mce_recoverable)."""
_MCE_AMD = re.compile(r"\[Hardware Error\]: CPU:(?P<cpu>\d+) \([0-9a-f]+:[0-9a-f]+:[0-9a-f]+\) MC(?P<bank>\d+)_STATUS"
                      r"\[(?P<flags>[^\]]*)\](?:: 0x(?P<status>[0-9a-fA-F]{1,16}))?")
"""edac/mce_amd.c amd_decode_mce (v3.x-v6.x): `CPU:%d (%x:%x:%x) MC%d_STATUS[%s|%s|%s|%s|%s` (`Over`/`-`, `UE`/`CE`/`-`
(deferred), `MiscV`, `AddrV`, `PCC` (before v4.x: `PCC` before `AddrV`)) then `|%s...` (Deferred, Poison, ...) and
`]: 0x%016llx`: the bank's flags, read as the Intel line's status bits are."""
_MCE_CORRECTED_TEXT = re.compile(r"\[Hardware Error\]: (?:Corrected error, no action required|Deferred error)")
_HW_PANIC = re.compile(r"(?P<mce>Fatal (?:local )?[Mm]achine check|[Mm]achine check|MCE)|(?P<ghes>Fatal hardware error)")
"""Panic reasons that name a hardware cause: mce/core.c mce_panic (`Fatal machine check`, `Fatal Machine
check` in 2.6.x, `Machine check from unknown source`), drivers/acpi/apei/ghes.c __ghes_panic
(`Fatal hardware error!`)."""

MCI_OVER = 1 << 62
MCI_UC = 1 << 61
MCI_PCC = 1 << 57
MCI_VAL = 1 << 63


def mce_kind(status: int) -> str:
    """MCi_STATUS -> kind (Intel SDM vol. 3B 15.3.2.2, AMD APM vol. 2 9.3): VAL and UC with PCC (processor
    context corrupt) -> mce_uncorrected (fatal); UC without PCC (software recoverable: SRAO/SRAR, the
    kernel poisons the page and kills the consumer) -> mce_recoverable; UC clear with OVER (bit 62: a
    further error arrived before the bank was read, so they come faster than they are logged) ->
    mce_corrected_repeated; UC clear -> mce (corrected; repeats at one `mce_addr` escalate, kinds.toml)."""
    if status & MCI_UC:
        return "mce_uncorrected" if status & MCI_PCC else "mce_recoverable"
    return "mce_corrected_repeated" if status & MCI_OVER else "mce"


def _mce_amd(m: re.Match[str]) -> Candidate:
    flags = set(m["flags"].split("|"))
    if "UE" in flags:
        kind = "mce_uncorrected" if "PCC" in flags else "mce_recoverable"
    else:
        kind = "mce_corrected_repeated" if "Over" in flags else "mce"
    attrs: dict[str, Attr] = {"cpu": int(m["cpu"]), "bank": int(m["bank"]), "mci_flags": m["flags"][:96]}
    if m["status"]:
        attrs["mci_status"] = f"0x{int(m['status'], 16):016x}"
    return Candidate(kind=kind, family="ras", priority=2 if kind != "mce" else 0, attrs=attrs)


def _mce(t: str) -> Candidate | None:
    if "_STATUS[" in t:
        am = _MCE_AMD.search(t)
        if am:
            return _mce_amd(am)
    m = _MCE_HEAD.search(t)
    if m:
        attrs: dict[str, Attr] = {"cpu": int(m["cpu"]), "bank": int(m["bank"]),
                                  "mcg_status": f"0x{int(m['mcg'], 16):x}", "exception": bool(m["exc"])}
        if m["status"]:
            status = int(m["status"], 16)
            kind = mce_kind(status)
            attrs["mci_status"] = f"0x{status:016x}"
        else:  # status elided: an exception (MCG_STATUS.MCIP) is taken as uncorrected until its text says more
            kind = "mce_uncorrected" if m["exc"] else "mce"
        return Candidate(kind=kind, family="ras", priority=2 if kind != "mce" else 0, attrs=attrs)
    if _MCE_FATAL_TEXT.search(t):
        return Candidate(kind="mce_uncorrected", family="ras", detail=True, priority=1, attrs={"mce_text": t[:200]})
    if _MCE_RECOVERABLE_TEXT.search(t):
        return Candidate(kind="mce_recoverable", family="ras", detail=True, priority=1, attrs={"mce_text": t[:200]})
    if _MCE_CORRECTED_TEXT.search(t):
        return Candidate(kind="mce", family="ras", detail=True, priority=0)
    return None


# ------------------------------------------------------------------------------------------ GHES body lines

_GHES_BODY = re.compile(
    r"(?:\{\d+\})?\[Hardware Error\]:\s+(?:event severity: (?P<sev>\w+)|section_type: (?P<sec>.+?)\s*$|"
    r"Error \d+, type: (?P<type>\w+)|It has been corrected by h/w)"
)
"""drivers/acpi/apei/ghes.c + drivers/firmware/efi/cper.c: a record's lines all carry the `{N}[Hardware
Error]: ` prefix (`{N}` since v4.x); `event severity: recoverable|fatal|corrected|info`, `Error N, type:`,
`section_type: PCIe error|memory error|general processor error|ARM processor error`, `device_id: dddd:bb:dd.f`.
A record whose header line was lost or wrapped is still recognised from these lines."""
_GHES_SEV_KIND = {"fatal": "ghes_fatal", "corrected": "ghes_corrected", "info": "ghes_corrected",
                  "informational": "ghes_corrected", "recoverable": "ghes_recoverable"}


def ghes_component(section: str) -> Component | None:
    """CPER section type (cper.c cper_sec_type_strs / section GUID names) -> component."""
    s = section.lower()
    if "pci" in s:
        return Component.PCIE
    if "memory" in s:
        return Component.MEMORY
    if "processor" in s or "cpu" in s:
        return Component.CPU
    return None


def _ghes_body(t: str) -> Candidate | None:
    m = _GHES_BODY.search(t)
    if not m:
        return None
    attrs: dict[str, Attr] = {}
    if m["sev"]:
        kind = _GHES_SEV_KIND.get(m["sev"].lower(), "ghes_recoverable")
        attrs["cper_severity"] = m["sev"].lower()
    elif m["type"]:
        kind = _GHES_SEV_KIND.get(m["type"].lower(), "ghes_recoverable")
    elif m["sec"]:
        kind = "ghes_recoverable"
        attrs["ghes_section"] = m["sec"]
    else:
        kind = "ghes_corrected"
    c = Candidate(kind=kind, family="ras", detail=True, priority=1, attrs=attrs)
    if m["sec"]:
        c.component = ghes_component(m["sec"])
    return c


# ------------------------------------------------------------------------------------------ GPU boot (no Xid)

_GPU_INIT = re.compile(
    rf"NVRM: (?:GPU (?P<bdf>{_BDF_RAW}): )?(?:RmInitAdapter failed!?(?: \((?P<code>[^)]*)\))?|"
    r"rm_init_adapter failed|RmInitAdapter: (?:.*failed|Cannot initialize.*)|"
    r"(?P<cables>GPU does not have the necessary power cables connected)|"
    r"(?P<bar>This PCI I/O region assigned to your NVIDIA device is invalid)|"
    r"(?P<probe>The NVIDIA probe routine failed for \d+ device)|(?P<none>None of the NVIDIA devices were initialized))"
)
_GPU_BAR = re.compile(rf"NVRM: BAR\d+ is \d+M @ 0x[0-9a-fA-F]+ \(PCI:(?P<bdf>{_BDF_RAW})\)")
"""kernel-open/nvidia/nv-pci.c nv_pci_probe: `NVRM: This PCI I/O region assigned to your NVIDIA device is invalid:` then
`NVRM: BAR%d is %lluM @ 0x%llx (PCI:%04x:%02x:%02x.%x)` (the second line names the GPU); osinit.c RmInitAdapter
NV_DEV_PRINTF `GPU does not have the necessary power cables connected.`; nv-pci.c nvidia_init_module `The NVIDIA probe
routine failed for %d device(s).`, `None of the NVIDIA devices were initialized.` (after the device's own line)."""
"""NVIDIA open-gpu-kernel-modules kernel-open/nvidia/nv.c / src/nvidia/arch/nvalloc/unix/src/osinit.c:
`NVRM: GPU %04x:%02x:%02x.%x: RmInitAdapter failed! (0x%x:0x%x:%d)`, `rm_init_adapter failed, device minor
number %d` (older: `NVRM: RmInitAdapter failed! (0x26:0xffff:1228)`)."""
_GPU_FSP = re.compile(
    r"NVRM: (?:GPU (?P<bdf>" + _BDF_RAW + r"): )?(?P<fn>kfsp\w+|\w*Fsp\w*|\w*GfwBoot\w*)(?::| ).*"
)
"""open-gpu-kernel-modules src/nvidia/src/kernel/gpu/fsp/ (kern_fsp.c, arch/hopper/kern_fsp_gh100.c):
`kfspDumpDebugState_GH100: NV_PFSP_FALCON_COMMON_SCRATCH_GROUP_2(%d) = 0x%x`, `kfspWaitForSecureBoot_GH100:
Timeout waiting for GFW_BOOT...`, FSP boot-command and RPC failures; on pre-Hopper GPUs the VBIOS boot wait
(gpu/arch/turing `gpuWaitForGfwBootComplete_TU102: failed to wait for GFW_BOOT`, `kgspWaitForGfwBootOk_TU102`):
the GPU never finished its firmware boot."""
_GPU_FSP_BAD = re.compile(r"DumpDebugState|fail|error|timeout|timed out|not (?:responding|ready)", re.I)


_GPU_INIT_WORDS = ("InitAdapter", "init_adapter", "power cables", "I/O region", "probe routine failed",
                   "None of the NVIDIA")


def gpu_boot_head(t: str) -> Candidate | None:
    m = _GPU_INIT.search(t) if any(w in t for w in _GPU_INIT_WORDS) else None
    if m:
        attrs: dict[str, Attr] = {"init_error": m["code"]} if m["code"] else {}
        if m["cables"]:
            attrs["init_error"] = "power cables not connected"
        elif m["bar"]:
            attrs["init_error"] = "invalid PCI I/O region (BAR)"
        follow = bool(m["probe"] or m["none"])
        return Candidate(kind="gpu_init_failed", bdf=normalize_bdf(m["bdf"]) if m["bdf"] else None,
                         family="gpu_boot", priority=1 if follow else 3, detail=follow, attrs=attrs)
    if "sp" in t or "Gfw" in t:
        m = _GPU_FSP.search(t)
        if m and _GPU_FSP_BAD.search(t):
            return Candidate(kind="gpu_fsp_error", bdf=normalize_bdf(m["bdf"]) if m["bdf"] else None,
                             family="gpu_boot", priority=2, attrs={"fsp_function": m["fn"][:64]})
    return None


def _aer_kind(sev: str) -> str:
    s = sev.lower()
    if "non-fatal" in s or "nonfatal" in s:
        return "aer_nonfatal"
    if "fatal" in s:
        return "aer_fatal"
    return "aer_corrected"


# ------------------------------------------------------------------------------------------ head builders
# One function per family of heads, tried by `agents.kmsg.heads.HEADS` (in its order, behind its
# substring guard): each returns the candidate the message starts, or None.


def gpu_lost_head(t: str) -> Candidate | None:
    if "fallen off the bu" not in lowered(t):  # both patterns need it, in any case (and re.I reads "ſ" as "s")
        return None
    m = _FALLEN.search(t)
    if m:
        return Candidate(kind="gpu_fallen_off_bus", bdf=normalize_bdf(m["bdf"]), family="gpu_lost", priority=5)
    if _FALLEN_ANY.search(t):
        return Candidate(kind="gpu_fallen_off_bus", family="gpu_lost", priority=4)
    return None


def gpu_reset_required_head(t: str) -> Candidate | None:
    if not may_hold(t, "reset_required", "reset required"):
        return None
    return Candidate(kind="gpu_reset_required", family="gsp", priority=6) if _RESET_REQ.search(t) else None


def gsp_head(t: str) -> Candidate | None:
    if not may_hold(t, "gsp", "libos heartbeat", "wpr2"):  # every alternative of `_GSP` holds one
        return None
    return Candidate(kind="gsp_error", family="gsp", priority=1) if _GSP.search(t) else None


def nvlink_discovery_head(t: str) -> Candidate | None:
    if not may_hold(t, "nvlink") or not may_hold(t, "fail"):
        return None
    return Candidate(kind="nvlink_discovery_failed") if _NVL_DISC.search(t) else None


def sxid_head(t: str) -> Candidate | None:
    m = _SXID.search(t)
    if not m:
        return None
    rest = m["rest"]
    dm = _SXID_DEV.search(t)
    fatal = rest.lower().startswith("fatal")
    detail = rest.startswith("Data {") or rest.startswith("Severity ")
    return Candidate(
        kind="sxid_fatal" if fatal else "sxid_nonfatal", code=int(m["code"]), bdf=normalize_bdf(m["bdf"]),
        dev_name=dm["dev"] if dm else None, family="sxid", detail=detail, priority=2 if fatal else 1,
        attrs={"sxid_text": rest[:512]},
    )


def peermem_head(t: str) -> Candidate | None:
    return Candidate(kind="peermem_invalid_context") if _PEERMEM.search(t) else None


def aer_head(t: str) -> Candidate | None:
    m = _AER_HEAD.search(t) if may_hold(t, "error received", "error message received") else None
    if m:
        return Candidate(
            kind=_aer_kind(m["sev"]), bdf=normalize_bdf(m["bdf"]), family="aer",
            attrs={"aer_severity": m["sev"], "multiple": bool(m["multi"])},
        )
    m = _AER_BUS.search(t) if may_hold(t, "pcie bus error: severity=") else None
    if m:
        return Candidate(
            kind=_aer_kind(m["sev"]), bdf=normalize_bdf(m["bdf"]), family="aer", detail=True,
            attrs={"aer_severity": m["sev"].strip(), "aer_type": m["type"].strip()},
        )
    if "containment event" in t:
        m = _DPC.search(t)
        if m:
            return Candidate(kind="aer_fatal", bdf=normalize_bdf(m["bdf"]), family="aer", priority=1,
                             attrs={"dpc_status": m["status"], "dpc_source": m["src"], "aer_severity": "DPC containment"})
    m = _AER_FAILED.search(t) if may_hold(t, "device recovery failed") else None
    if m:
        return Candidate(
            kind="aer_recovery_failed", bdf=normalize_bdf(m["bdf"]), family="aer", priority=-1,
            attrs={"recovery_failed": True},
        )
    return None


def pcie_bandwidth_head(t: str) -> Candidate | None:
    m = _PCIE_BW.search(t)
    if not m:
        return None
    reduced = int(m["w"]) < int(m["cw"])
    return Candidate(
        kind="pcie_link_degraded" if reduced else "pcie_bandwidth_limited", bdf=normalize_bdf(m["bdf"]),
        attrs={
            "pcie_link_width": int(m["w"]), "pcie_link_width_capable": int(m["cw"]),
            "pcie_link_speed": m["speed"], "pcie_link_speed_capable": m["cspeed"],
            "limited_at": m["at"],
        },
    )


def edac_head(t: str) -> Candidate | None:
    m = _EDAC.search(t)
    if not m:
        return None
    ue = m["t"] in ("UE", "Uncorrected")
    return Candidate(
        kind="edac_ue" if ue else "edac_ce", dev_name=m["mc"].lower(), family="ras", priority=3,
        attrs={"error_count": int(m["n"] or 1), "edac_detail": m["rest"].strip()[:256]},
    )


def hardware_error_head(t: str) -> Candidate | None:
    """GHES record headers and bodies, machine checks (`[Hardware Error]:` lines)."""
    if _GHES.search(t):
        return Candidate(kind="ghes_recoverable", family="ras", priority=2)
    c = _mce(t) or _ghes_body(t)
    if c:
        return c
    if _MCE_LOGGED.search(t):
        return Candidate(kind="mce", family="ras", detail=True, priority=0)
    return None


def ib_head(t: str) -> Candidate | None:
    m = _IB_PORT.search(t) if may_hold(t, "port: ") else None
    if m:
        st = m["st"].upper()
        kind = {"DOWN": "ib_port_down", "ACTIVE": "ib_port_active", "ACTIVE_DEFER": "ib_port_active"}.get(st, "ib_port_init")
        return Candidate(
            kind=kind, bdf=normalize_bdf(m["bdf"]), dev_name=m["dev"], port=int(m["port"]),
            healthy=kind == "ib_port_active", attrs={"port_state": st},
        )
    m = _IB_POWER.search(t) if may_hold(t, "insufficient power on the pcie slot") else None
    if m:
        return Candidate(kind="ib_insufficient_power", bdf=normalize_bdf(m["bdf"]))
    if may_hold(t, "access_reg(0x") and _ACCESS_REG.search(t):
        return Candidate(kind="ib_access_reg_noise")
    return None


def nic_link_head(t: str) -> Candidate | None:
    m = _NIC_LINK.search(t)
    if not m:
        return None
    up = (m["st"] or m["st2"]).lower() == "up"
    drv = m["drv"] or m["drv2"]
    return Candidate(
        kind="nic_link_up" if up else "nic_link_down", bdf=normalize_bdf(m["bdf"]), dev_name=m["ifname"] or m["if2"],
        healthy=up, attrs={"driver": drv} if drv else {},
    )


def bond_head(t: str) -> Candidate | None:
    if "link status" in t and "ms" in t:
        m = _BOND_PENDING.search(t)
        if m:
            up = m["st"] == "up"
            return Candidate(
                kind="bond_slave_up" if up else "bond_slave_down", dev_name=m["if1"] or m["if2"], healthy=up,
                detail=True, attrs={"bond": m["bond"], "delay_ms": int(m["ms"])},
            )
    m = _BOND_SLAVE.search(t)
    if m:
        up = (m["st1"] or m["st2"]) == "up"
        return Candidate(
            kind="bond_slave_up" if up else "bond_slave_down", dev_name=m["if1"] or m["if2"], healthy=up,
            attrs={"bond": m["bond"]},
        )
    m = _BOND_NONE.search(t)
    if m:
        return Candidate(kind="bond_no_active_slave", dev_name=m["bond"])
    m = _BOND_BACK.search(t)
    if m:
        return Candidate(kind="bond_active_slave", dev_name=m["bond"], healthy=True)
    return None


def nvme_head(t: str) -> Candidate | None:
    m = _NVME_TIMEOUT.search(t)
    if m:
        return Candidate(kind="nvme_timeout", family="nvme", priority=1, **_nvme_dev(m["dev"]))
    m = _NVME_NOTREADY.search(t)
    if m:
        return Candidate(kind="nvme_timeout", family="nvme", detail=True, priority=1, **_nvme_dev(m["dev"]))
    m = _NVME_REMOVED.search(t)
    if m:
        return Candidate(kind="nvme_removed", family="nvme", priority=2, **_nvme_dev(m["dev"]))
    m = _NVME_RESET.search(t)
    if m:
        return Candidate(kind="nvme_timeout", family="nvme", detail=True, priority=1, **_nvme_dev(m["dev"]))
    return None


def panic_head(t: str) -> Candidate | None:
    m = _PANIC.search(t)
    if not m:
        return None
    # panic() closes its report with `---[ end Kernel panic - not syncing: %s ]---` (kernel/panic.c): the same
    # panic, a line of its record (detail: it merges without counting); alone (the head lost) it is the panic
    trailer = m.start() >= 9 and t[m.start() - 9:m.start()] == "---[ end "
    reason = m["reason"].strip()
    if trailer:
        reason = reason.removesuffix("]---").rstrip()
    attrs: dict[str, Attr] = {"panic_reason": reason[:256]}
    hw = _HW_PANIC.search(reason)
    if hw:  # the panic names its hardware cause: the event is that cause (merges into its record)
        if hw["ghes"]:
            return Candidate(kind="ghes_fatal", family="ras", detail=True, priority=3, attrs=attrs)
        return Candidate(kind="mce_uncorrected", family="ras", detail=True, priority=3, attrs=attrs)
    hm = _HARD.search(reason)
    if hm:
        attrs["cpu"] = int(hm["cpu"])
    return Candidate(kind="kernel_panic", family="crash", priority=3, attrs=attrs, detail=trailer)


def has_lockup(t: str) -> bool:
    """`lockup` in any case (`BUG: soft lockup`, `hard LOCKUP`): the lockup heads' guard."""
    return "lockup" in lowered(t)


def lockup_head(t: str) -> Candidate | None:
    m = _SOFT.search(t)
    if m:
        return Candidate(
            kind="soft_lockup", pid=int(m["pid"]), family="crash", priority=0,
            attrs={"cpu": int(m["cpu"]), "stuck_s": int(m["s"]), "process": m["comm"]},
        )
    m = _HARD.search(t)
    if m:
        return Candidate(kind="hard_lockup", family="crash", priority=2, attrs={"cpu": int(m["cpu"])})
    return None


def oops_head(t: str) -> Candidate | None:
    if _OOPS.search(t):
        return Candidate(kind="oops", family="crash", priority=1, attrs={"oops": t[:256]})
    if _OOPS_LINE.search(t):
        return Candidate(kind="oops", family="crash", priority=1, detail=True, attrs={"oops": t[:256]})
    return None


def hung_task_head(t: str) -> Candidate | None:
    m = _HUNG.search(t)
    if not m:
        return None
    return Candidate(
        kind="hung_task", pid=int(m["pid"]), family="crash", priority=0,
        attrs={"process": m["comm"], "blocked_s": int(m["s"])},
    )


def oom_head(t: str) -> Candidate | None:
    """One OOM kill report (mm/oom_kill.c): `%s invoked oom-killer: gfp_mask=%#x(%pGg), order=%d,
    oom_score_adj=%hd` (dump_header), the summary `oom-kill:constraint=%s,nodemask=%*pbl,...,task=%s,pid=%d,
    uid=%d` (v4.19+), `%s: Killed process %d (%s) total-vm:%lukB, ...` (`Out of memory`, `Memory cgroup out
    of memory`; `Kill process %d (%s) score %u or sacrifice child` before v4.19), `oom_reaper: reaped process
    %d (%s), now anon-rss:...`: every line one kill; `form` lets the parser count the report once."""
    m = _OOM_SUMMARY.search(t)
    if m:
        return Candidate(kind="oom_kill", pid=int(m["pid"]), family="oom", attrs={"process": m["comm"]},
                         form="summary")
    m = _OOM_KILL.search(t) or _OOM_KILLED.search(t)
    if m:
        return Candidate(kind="oom_kill", pid=int(m["pid"]), family="oom", attrs={"process": m["comm"]},
                         form="killed" if "Killed" in m[0] else "selected")
    m = _OOM_REAPED.search(t)
    if m:
        return Candidate(kind="oom_kill", pid=int(m["pid"]), family="oom", attrs={"process": m["comm"]},
                         form="reaped", detail=True)
    m = _OOM_INVOKED.search(t)
    if m:
        return Candidate(kind="oom_kill", family="oom", attrs={"invoked_by": m["comm"][:128]}, form="invoked")
    return None


# ------------------------------------------------------------------------------------------ details

_CPU_PID = re.compile(r"\bCPU: ?(?P<cpu>\d+) (?:UID: \d+ )?PID: (?P<pid>\d+) Comm: (?P<comm>\S+)")
_TASK_LINE = re.compile(r"^task:(?P<comm>.+?)\s+state:\S+.*?\bpid:\s*(?P<pid>\d+)")
_AER_STATUS = re.compile(r"error status/mask=(?P<status>[0-9a-fA-F]+)/(?P<mask>[0-9a-fA-F]+)")
_AER_BIT = re.compile(r"^\[\s*(?P<bit>\d+)\]\s+(?P<name>.+?)\s*(?P<first>\(First\))?$")
_GHES_SEV = re.compile(r"\[Hardware Error\]: event severity: (?P<sev>\w+)")
_GHES_SECTION = re.compile(r"\[Hardware Error\]:\s+section_type: (?P<st>.+)$")
_GHES_DEVICE = re.compile(rf"\[Hardware Error\]:\s+device_id: (?P<bdf>{_BDF_RAW})\s*$")

_NVME_PCI_LINE = re.compile(rf"^nvme (?P<bdf>{_BDF_RAW}): ")
_MCE_ADDR = re.compile(r"\[Hardware Error\]: .*?\bADDR (?P<addr>[0-9a-fA-F]+)\b")
"""mce/core.c __print_mce: `HW_ERR "RIP%s %02x:<%016Lx> "`, then pr_cont `TSC %llx `, `ADDR %llx `, `MISC %llx `
on one line (`[Hardware Error]: TSC 0 ADDR 3ffe5c8c0 MISC 200001c020000086`)."""
_AMD_DEV_LINE = re.compile(rf"^amdgpu (?P<bdf>{_BDF_RAW}): ")
_AMD_PROCESS = re.compile(r"Process (?:information: process )?(?P<comm>\S*) pid (?P<pid>\d+) thread")
CRASH_KINDS = {"kernel_panic", "oops", "hard_lockup", "soft_lockup", "hung_task", "rcu_stall"}


def detail(kind: str, text: str) -> dict[str, Attr]:
    """Fields a non-head line adds to an open record of `kind`.

    Returns a dict with any of: `pid` (int; crash kinds: from `CPU: N PID: M Comm: X` or the hung-task
    `task:NAME ... pid:N` line), `aer_status`/`aer_mask`/`aer_errors` (AER status lines),
    `kind` (GHES `event severity:` -> ghes_corrected/ghes_recoverable/ghes_fatal), `ghes_section`,
    `bdf` (GHES PCIe `device_id:`; amdgpu: the `amdgpu <bdf>:` line after a DRM_ERROR ring timeout), `process`,
    `mce_addr` (machine checks: the bank's ADDR, hex).
    """
    t = text.strip()
    out: dict[str, Attr] = {}
    if kind in CRASH_KINDS:
        m = _CPU_PID.search(t)
        if m and int(m["pid"]) > 0:  # PID 0 is the idle task (swapper/N): no process to name
            out["pid"] = int(m["pid"])
            out["process"] = m["comm"]
        m = _TASK_LINE.search(t)
        if m:
            out["pid"] = int(m["pid"])
            out["process"] = m["comm"].strip()
    elif kind.startswith("aer_"):
        m = _AER_STATUS.search(t)
        if m:
            out["aer_status"] = m["status"]
            out["aer_mask"] = m["mask"]
        parts = t.split(": ", 1)
        m = _AER_BIT.match(parts[1].strip() if len(parts) == 2 else t)
        if m:
            out["aer_error"] = m["name"] + (" (First)" if m["first"] else "")
    elif kind.startswith("mce"):
        m = _MCE_ADDR.search(t)
        if m:
            out["mce_addr"] = f"0x{int(m['addr'], 16):x}"
    elif kind.startswith("gpu_ring"):
        m = _AMD_PROCESS.search(t)
        if m and int(m["pid"]) > 0:
            out["pid"] = int(m["pid"])
            out["process"] = m["comm"]
        m = _AMD_DEV_LINE.match(t)
        if m:
            out["bdf"] = normalize_bdf(m["bdf"])
    elif kind == "gpu_init_failed":
        m = _GPU_BAR.search(t)
        if m:
            out["bdf"] = normalize_bdf(m["bdf"])
    elif kind.startswith("nvme_"):
        m = _NVME_PCI_LINE.match(t)
        if m:
            out["bdf"] = normalize_bdf(m["bdf"])
    elif kind.startswith("ghes_"):
        m = _GHES_SEV.search(t)
        if m:
            sev = m["sev"].lower()
            out["kind"] = {"fatal": "ghes_fatal", "corrected": "ghes_corrected", "info": "ghes_corrected"}.get(
                sev, "ghes_recoverable"
            )
        m = _GHES_SECTION.search(t)
        if m:
            out["ghes_section"] = m["st"].strip()
        m = _GHES_DEVICE.search(t)
        if m:
            out["bdf"] = normalize_bdf(m["bdf"])
    return out


# ------------------------------------------------------------------------------------------ storage, filesystems
# Formats and versions: fleetmend/catalog/source/formats.tsv (tests/test_formats.py synthesises a line from each).

_DISK = r"[^\s,()]+"
_BLK_ERR = re.compile(rf"(?:^|: )(?P<what>[A-Za-z][\w/ ]*?) error, dev (?P<dev>{_DISK}), sector (?P<sector>\d+)")
"""block/blk-core.c: v4.18-v5.x print_req_error `%s: %s error, dev %s, sector %llu op 0x%x:(%s) flags 0x%x
phys_seg %u prio class %u` (caller, blk_errors[].name: `I/O`, `critical medium`, `timeout`, `critical
target`, ...), v5.16+ blk_print_req_error without the caller; v4.x-v4.17 `%s: I/O error, dev %s, sector %llu`."""
_BUFFER_ERR = re.compile(rf"Buffer I/O error on (?:dev(?:ice)? )?(?P<dev>{_DISK}), logical block (?P<block>\d+)")
"""fs/buffer.c buffer_io_error / end_buffer_async_write: `Buffer I/O error on dev %pg, logical block %llu%s`
(`, async page read`, `, lost async page write`); v2.6-v3.x `Buffer I/O error on device %s, logical block %Lu`."""
REMOVABLE_DISKS = ("fd", "sr")
"""Floppy and optical drives: a VM without a floppy logs `I/O error, dev fd0, sector 0` at every probe, an empty
virtual CD-ROM `I/O error, dev sr0`; neither holds anything a job uses, so their errors are not events."""
_EXT_RO = re.compile(r"(?P<fs>EXT[234]-fs) \((?P<dev>[^)]+)\): (?:Remounting filesystem read-only|"
                     r"error: remounting filesystem read-only)")
"""fs/ext4/super.c ext4_handle_error: ext4_msg(sb, KERN_CRIT, `Remounting filesystem read-only`), ext4_msg
printing `EXT4-fs (%s): %pV` (sb->s_id); ext3 (before v4.3) ext3_handle_error `error: remounting filesystem read-only`."""
_EXT_ERR = re.compile(r"(?P<fs>EXT[234]-fs) (?:error|warning(?= \(device [^)]+\): \w+:\d+: ))"
                      r"(?: \(device (?P<dev>[^)]+)\))?(?::| in )|"
                      r"(?P<fs2>EXT[234]-fs) \((?P<dev2>[^)]+)\): (?:I/O error while writing superblock|"
                      r"error count since last fsck|Delayed block allocation failed|previous I/O error to superblock)")
"""fs/ext4/super.c __ext4_error `EXT4-fs error (device %s): %s:%d: comm %s: %pV`, __ext4_error_inode
`EXT4-fs error (device %s): %s:%d: inode #%lu: comm %s: %pV`, __ext4_std_error `EXT4-fs error (device %s) in
%s:%d: %s`, __ext4_warning `EXT4-fs warning (device %s): %s:%d: %pV` (page-io.c ext4_end_bio `I/O error %d writing to
inode ...`, namei.c `Directory index full!`, ...; __ext4_warning_inode adds `inode #%lu: comm %s: `);
ext4_msg lines `EXT4-fs (%s): I/O error while writing superblock` (ext4_commit_super), `error count since last fsck:
%u` (print_daily_error_info: errors recorded and not yet repaired), `Delayed block allocation failed for inode %lu ...`
(inode.c), `previous I/O error to superblock detected`."""
_JBD2_ERR = re.compile(r"JBD2: (?:Detected IO errors while flushing file data on|I/O error when updating journal superblock "
                       r"for) (?P<jdev>[^\s.]+)")
"""fs/jbd2/commit.c `JBD2: Detected IO errors while flushing file data on %s`, journal.c jbd2_write_superblock `JBD2:
I/O error when updating journal superblock for %s.` (the journal device, `sda1-8`)."""
_EXT_ABORT = re.compile(r"(?:EXT4-fs \((?P<dev>[^)]+)\): )?Aborting journal on device (?P<jdev>[^\s.]+(?:\.\S+)?)\.?$")
"""fs/jbd2/journal.c jbd2_journal_abort / __journal_abort_soft: `Aborting journal on device %s.` (the
journal device, e.g. `sda1-8`): the filesystem goes read-only next."""
_XFS_SHUTDOWN = re.compile(r"XFS \((?P<dev>[^)]+)\): (?P<why>.*?)(?: \(0x[0-9a-f]+\))?(?: detected at \S+ \([^)]*\))?\.?"
                           r"\s+Shutting down filesystem|XFS \((?P<dev2>[^)]+)\): (?:Filesystem has been shut down|"
                           r"xfs_do_force_shutdown\(0x[0-9a-f]+\) called from line)")
"""fs/xfs/xfs_fsops.c xfs_do_force_shutdown: v5.19+ `%s (0x%x) detected at %pS (%s:%d).  Shutting down
filesystem.` (`Log I/O Error`, `Metadata I/O Error`, `Corruption of in-memory data`, `Corruption of on-disk
metadata`), v4.x-v5.18 `Log I/O Error Detected. Shutting down filesystem`, `I/O Error Detected. Shutting down
filesystem`, `Corruption of in-memory data detected.  Shutting down filesystem`; xfs_log.c `Filesystem has been
shut down due to log error (0x%x).`; v4.x-v5.18 xfs_notice `xfs_do_force_shutdown(0x%x) called from line %d of file %s.
Return address = %pS` before the reason; printed by xfs_alert with `XFS (%s): ` (mp->m_super->s_id)."""
_XFS_ERR = re.compile(r"XFS \((?P<dev>[^)]+)\): (?:metadata I/O error|log I/O error|Metadata corruption detected|"
                      r"xfs_log_force: error|writeback error on sector|Internal error |Corruption detected\. Unmount|"
                      r"Failing async write on buffer)")
"""fs/xfs/xfs_buf.c `metadata I/O error in "%pS" at daddr 0x%llx len %d error %d` (v4.x `metadata I/O error: block
0x%llx ("%s") error %d numblks %d`), xfs_log.c `log I/O error %d`, xfs_error.c `Metadata corruption detected at %pS, %s
block 0x%llx`, `Internal error %s at line %d of file %s.  Caller %pS`, `Corruption detected. Unmount and run
xfs_repair`, xfs_buf_item.c `Failing async write on buffer block 0x%llx. Retrying async write.`."""
_MD_FAIL = re.compile(r"md/raid(?P<level>\d*):(?P<md>[\w.-]+): Disk failure on (?P<dev>[^\s,]+), disabling device\.?")
"""drivers/md/raid1.c raid1_error / raid10.c raid10_error: `md/raid1:%s: Disk failure on %pg, disabling
device.` then `md/raid1:%s: Operation continuing on %d devices.`; raid5.c raid5_error `md/raid:%s: Disk failure
on %pg, disabling device.`; before v5.18 `%s` (bdevname) for `%pg`."""
_MD_CANNOT = re.compile(r"md/raid(?P<level>\d*):(?P<md>[\w.-]+): (?:Cannot continue operation \((?P<f>\d+)/(?P<n>\d+) "
                        r"failed\)|Operation continuing on 0 devices|not enough operational devices \(\d+/\d+ failed\))")
"""drivers/md/raid5.c raid5_error `md/raid:%s: Cannot continue operation (%d/%d failed).`, raid5_run `md/raid:%s: not
enough operational devices (%d/%d failed)`: the array failed."""
_MD_MEMBER = re.compile(r"md/raid(?P<level>\d*):(?P<md>[\w.-]+): (?:(?P<dev>[^\s:]+): (?P<what>unrecoverable I/O read error|"
                        r"Raid device exceeded read_error threshold|Failing raid device)|Too many read errors, failing device "
                        r"(?P<dev2>[^\s,]+?)\.?$|read error (?:not correctable|NOT corrected!!) \(sector \d+ on "
                        r"(?P<dev3>[^\s)]+)\))")
"""raid1.c/raid10.c read_request `md/raid1:%s: %pg: unrecoverable I/O read error for block %llu` (no mirror held the
block: the read failed upwards, a block_io_error on that member); raid10.c fix_read_error `md/raid10:%s: %pg: Raid device
exceeded read_error threshold [cur %d:max %d]`, `md/raid10:%s: %pg: Failing raid device`; raid5.c raid5_end_read_request
`md/raid:%s: Too many read errors, failing device %pg.`, `md/raid:%s: read error not correctable (sector %llu on %pg).`,
`read error NOT corrected!! (sector %llu on %pg).` (`read error corrected (...)` is healthy)."""
_MD_ACTIVE = re.compile(r"md/raid(?P<level>\d*):(?P<md>[\w.-]+): (?:raid level (?P<lv>\d+) )?active with (?P<n>\d+) out of "
                        r"(?P<of>\d+) (?:mirrors|devices)")
"""raid1.c raid1_run `md/raid1:%s: active with %d out of %d mirrors`, raid5.c raid5_run `md/raid:%s: raid level %d
active with %d out of %d devices, algorithm %d`: fewer active than configured is a degraded array."""
_NVME_PATH = re.compile(r"block (?P<dev>nvme\w+): no (?P<which>usable|available) path - (?P<act>requeuing|failing) I/O")
"""drivers/nvme/host/multipath.c nvme_ns_head_submit_bio: dev_warn_ratelimited(disk_to_dev(head->disk), `no
usable path - requeuing I/O` (a path may come back) / `no available path - failing I/O` (none will))."""
_NFS = re.compile(r"(?:^|\s)(?P<prog>[a-z][\w-]{1,15}): server (?P<srv>\S+) (?P<st>not responding, (?:still trying|"
                  r"timed out)|OK)$")
"""net/sunrpc/clnt.c call_timeout / call_decode: `%s: server %s not responding, still trying`, `%s: server %s
not responding, timed out` (soft mounts), `%s: server %s OK` (cl_program->name: nfs, lockd, nfsacl, rpcbind, ...;
cl_hostname)."""


_NVME_IO_ERR = re.compile(r"(?:^|\s)(?P<dev>nvme\d+(?:c\d+)?n\d+): (?P<op>[A-Za-z][\w ]*?)\(0x[0-9a-f]+\) @ LBA (?P<lba>\d+), "
                          r"(?P<n>\d+) blocks, (?P<status>.+?) \(sct 0x(?P<sct>[0-9a-f]+) / sc 0x(?P<sc>[0-9a-f]+)\)")
"""drivers/nvme/host/core.c nvme_log_error (v5.19+): `%s: %s(0x%x) @ LBA %llu, %u blocks, %s (sct 0x%x / sc 0x%x) %s%s`
(the namespace disk, the opcode's name, the status string, `MORE `, `DNR`)."""


def _nvme_status_is_fault(sct: int, sc: int) -> bool:
    """NVMe base spec status: type 2 (media and data integrity errors: unrecovered read, write fault, guard and
    compare failures, access denied, deallocated block) is the drive's; in the generic type 0 only Data Transfer
    Error (0x4) and Internal Error (0x6) are. The rest (invalid field or opcode: a command the drive does not
    support, aborts after a reset, path errors of type 3 that multipath retries) is not a device fault."""
    return sct == 2 or (sct == 0 and sc in (0x4, 0x6))


def storage_head(t: str) -> Candidate | None:
    """Block-layer errors, filesystem errors and read-only remounts/shutdowns, md member failures, NVMe multipath
    path loss (family `storage`: one disk's I/O error, the filesystem error and the remount are one episode)."""
    if " error, dev " in t:
        m = _BLK_ERR.search(t)
        if m and not m["dev"].startswith(REMOVABLE_DISKS):
            dev = None if m["dev"] == "?" else m["dev"]
            return Candidate(kind="block_io_error", component=Component.STORAGE, dev_name=dev, family="storage",
                             attrs={"block_error": m["what"].strip(), "sector": int(m["sector"])})
    if "Buffer I/O error" in t:
        m = _BUFFER_ERR.search(t)
        if m and not m["dev"].startswith(REMOVABLE_DISKS):
            return Candidate(kind="block_io_error", component=Component.STORAGE, dev_name=m["dev"], family="storage",
                             detail=True, attrs={"logical_block": int(m["block"])})
    if "-fs" in t:
        m = _EXT_RO.search(t)
        if m:
            return Candidate(kind="fs_read_only", component=Component.STORAGE, dev_name=m["dev"], family="storage",
                             priority=3, attrs={"fs": m["fs"][:-3].lower()})
        m = _EXT_ERR.search(t)
        if m:
            return Candidate(kind="fs_error", component=Component.STORAGE, dev_name=m["dev"] or m["dev2"],
                             family="storage", priority=1, attrs={"fs": (m["fs"] or m["fs2"])[:-3].lower(), "fs_error": t[:256]})
    if "JBD2: " in t:
        m = _JBD2_ERR.search(t)
        if m:
            return Candidate(kind="fs_error", component=Component.STORAGE, dev_name=m["jdev"].rsplit("-", 1)[0],
                             family="storage", priority=1, attrs={"journal": m["jdev"], "fs_error": t[:256]})
    if "Aborting journal" in t:
        m = _EXT_ABORT.search(t)
        if m:
            dev = m["dev"] or m["jdev"].rsplit("-", 1)[0]
            return Candidate(kind="fs_error", component=Component.STORAGE, dev_name=dev, family="storage",
                             priority=2, detail=True, attrs={"journal": m["jdev"]})
    if "XFS (" in t:
        m = _XFS_SHUTDOWN.search(t)
        if m:
            return Candidate(kind="fs_read_only", component=Component.STORAGE, dev_name=m["dev"] or m["dev2"],
                             family="storage", priority=3, attrs={"fs": "xfs", "shutdown": (m["why"] or "")[:128]})
        m = _XFS_ERR.search(t)
        if m:
            return Candidate(kind="fs_error", component=Component.STORAGE, dev_name=m["dev"], family="storage",
                             priority=1, attrs={"fs": "xfs", "fs_error": t[:256]})
    if "md/raid" in t:
        m = _MD_FAIL.search(t)
        if m:
            return Candidate(kind="md_member_failed", component=Component.STORAGE, dev_name=m["dev"],
                             attrs={"md": m["md"], "raid_level": m["level"] or "5"})
        m = _MD_CANNOT.search(t)
        if m:
            return Candidate(kind="md_array_failed", component=Component.STORAGE, dev_name=m["md"],
                             attrs={"raid_level": m["level"] or "5"})
        m = _MD_MEMBER.search(t)
        if m:
            dev = m["dev"] or m["dev2"] or m["dev3"]
            failed = m["dev2"] is not None or (m["what"] or "").startswith(("Raid device", "Failing"))
            return Candidate(kind="md_member_failed" if failed else "block_io_error", component=Component.STORAGE,
                             dev_name=dev, family="storage" if not failed else None,
                             attrs={"md": m["md"], "raid_level": m["level"] or "5"})
        if "active with" in t:
            m = _MD_ACTIVE.search(t)
            if m and int(m["n"]) < int(m["of"]):
                return Candidate(kind="md_array_degraded", component=Component.STORAGE, dev_name=m["md"],
                                 attrs={"raid_level": m["lv"] or m["level"] or "1", "active": int(m["n"]),
                                        "members": int(m["of"])})
    if "@ LBA" in t:
        m = _NVME_IO_ERR.search(t)
        if m and _nvme_status_is_fault(int(m["sct"], 16), int(m["sc"], 16)):
            return Candidate(kind="block_io_error", component=Component.STORAGE, dev_name=m["dev"], family="storage",
                             attrs={"block_error": m["status"][:64], "nvme_op": m["op"][:32], "lba": int(m["lba"]),
                                    "nvme_sct": int(m["sct"], 16), "nvme_sc": int(m["sc"], 16)})
    if " path - " in t:
        m = _NVME_PATH.search(t)
        if m:
            failing = m["act"] == "failing"
            return Candidate(kind="nvme_no_path" if failing else "nvme_path_requeue", component=Component.NVME,
                             dev_name=m["dev"], family="nvme_path", priority=2 if failing else 1)
    return None


def nfs_head(t: str) -> Candidate | None:
    m = _NFS.search(t)
    if not m:
        return None
    ok = m["st"] == "OK"
    return Candidate(kind="nfs_server_ok" if ok else "nfs_server_not_responding", component=Component.STORAGE,
                     dev_name=m["srv"], healthy=ok, attrs={"rpc_program": m["prog"]})


# ------------------------------------------------------------------------------------------ OS limits, libraries

_FILE_MAX = re.compile(r"VFS: file-max limit (?P<n>\d+) reached")
"""fs/file_table.c alloc_empty_file: pr_info(`VFS: file-max limit %lu reached`, get_max_files())."""
_CONNTRACK = re.compile(r"nf_conntrack: (?:nf_conntrack: )?table full, dropping packet")
"""net/netfilter/nf_conntrack_core.c __nf_conntrack_alloc: net_warn_ratelimited(`nf_conntrack: table full,
dropping packet`) under pr_fmt `nf_conntrack: ` (v4.x+ prints the name twice)."""
_SEGV = re.compile(r"(?P<comm>\S[^\[]*)\[(?P<pid>\d+)\]: (?:segfault at (?P<addr>[0-9a-f]+) ip [0-9a-f]+ sp [0-9a-f]+ "
                   r"error (?P<err>[0-9a-f]+)|trap (?P<trap>[\w ]+?) ip:[0-9a-f]+ sp:[0-9a-f]+ error:[0-9a-f]+|"
                   r"general protection fault ip:[0-9a-f]+ sp:[0-9a-f]+ error:[0-9a-f]+)"
                   r" in (?P<lib>[^\s\[]+)\[")
"""arch/x86/mm/fault.c show_signal_msg `%s%s[%d]: segfault at %lx ip %px sp %px error %lx`, then mm/memory.c
print_vma_addr ` in %s[%lx+%lx]` (v6.2+: ` in %s[%lx,%lx+%lx]`); arch/x86/kernel/traps.c `%s[%d] trap %s ip:%lx
sp:%lx error:%lx` / `%s[%d] general protection fault ip:%lx sp:%lx error:%lx` with the same ` in ` suffix."""
GPU_LIBRARIES = ("libcuda", "libnccl", "libnvidia-", "libcudart", "libcublas", "libcudnn", "libnvrm", "libnvToolsExt",
                 "libnvJitLink", "libnvrtc", "libcufft", "libcusparse", "libnvshmem", "libnccl-net", "libfabric",
                 "libefa", "libmlx5", "libibverbs")
"""A segfault inside these (NVIDIA driver/CUDA/NCCL user libraries, and the RDMA providers NCCL loads) is
read; one inside an application's own code or libc is the application's bug and is not a node fault."""
_CMCI = re.compile(r"(?:CPU(?P<cpu>\d+) BANK(?P<bank>\d+) )?CMCI storm (?P<st>detected|subsided)")
"""arch/x86/kernel/cpu/mce/intel.c (v3.10-v6.7) `CMCI storm detected: switching to poll mode`, `CMCI storm
subsided: switching to interrupt mode`; mce/threshold.c (v6.8+) `CPU%d BANK%d CMCI storm detected`, `CPU%d BANK%d
CMCI storm subsided` (pr_fmt `mce: `)."""


def os_limit_head(t: str) -> Candidate | None:
    if "file-max" in t:
        m = _FILE_MAX.search(t)
        if m:
            return Candidate(kind="os_file_max_reached", attrs={"file_max": int(m["n"])})
    if "table full" in t and _CONNTRACK.search(t):
        return Candidate(kind="conntrack_table_full", component=Component.NIC)
    if "CMCI storm" in t:
        m = _CMCI.search(t)
        if m:
            ok = m["st"] == "subsided"
            attrs: dict[str, Attr] = {}
            if m["cpu"] is not None:
                attrs.update(cpu=int(m["cpu"]), bank=int(m["bank"]))
            return Candidate(kind="cmci_storm_subsided" if ok else "cmci_storm", component=Component.CPU, healthy=ok,
                             attrs=attrs)
    if " in lib" in t:
        m = _SEGV.search(t)
        if m and m["lib"].startswith(GPU_LIBRARIES):
            return Candidate(kind="gpu_library_segfault", component=Component.GPU, pid=int(m["pid"]),
                             attrs={"process": m["comm"].strip()[:64], "library": m["lib"][:128],
                                    "signal": "SIGSEGV" if m["addr"] is not None else "trap"})
    return None


# ------------------------------------------------------------------------------------------ EFA, GPU lost (no Xid)

_EFA_TIMEOUT = re.compile(rf"efa (?P<bdf>{_BDF_RAW})(?: (?P<ib>[\w-]+))?: (?:Wait for completion \(polling\) timeout|"
                          r"The device didn't send any completion for admin cmd|The device sent a completion but the "
                          r"driver didn't receive any MSI-X interrupt|Failed to submit command|Admin queue is closed|"
                          r"Failed to process command .*? comp_status (?P<cs>-?\d+) err (?P<err>-?\d+))")
"""drivers/infiniband/hw/efa/efa_com.c efa_com_wait_and_process_admin_cq_polling / _interrupts:
ibdev_err_ratelimited(`Wait for completion (polling) timeout`), _interrupts `The device didn't send any completion
for admin cmd %s(%d) status %d (...)`, `The device sent a completion
but the driver didn't receive any MSI-X interrupt for admin cmd ...`, efa_com_cmd_exec `Failed to submit command %s
(opcode %u) err %d`, `Failed to process command %s (opcode %u) comp_status %d err %d` (read when the device failed:
comp_status 6 unknown error, or err -ETIME; a refused request of an application, out of resources or an illegal
parameter, is not a device fault); ibdev printk prefixes `efa <bdf> <ibdev>: `."""
_NV_LOST = re.compile(rf"NVRM: (?:GPU (?P<bdf>{_BDF_RAW}): )?(?:.*\bGPU lost from the bus \[NV_ERR_GPU_IS_LOST\]|"
                      r"GPU is lost, skipping)")
"""open-gpu-kernel-modules 595.45.04: nvstatuscodes.h NV_ERR_GPU_IS_LOST `GPU lost from the bus`, printed by
nvassert.c nvAssertOkFailed `Assertion failed: %s (0x%08X) returned from ...` as `GPU lost from the bus
[NV_ERR_GPU_IS_LOST] (0x0000000F)`; kernel-open/nvidia/nv.c, nv-pci.c `GPU is lost, skipping %s` (NV_DEV_PRINTF
prefix `NVRM: GPU %04x:%02x:%02x.%x: `)."""


def efa_head(t: str) -> Candidate | None:
    m = _EFA_TIMEOUT.search(t)
    if not m or (m["cs"] is not None and int(m["cs"]) != 6 and int(m["err"]) != -62):
        return None
    return Candidate(kind="efa_admin_timeout", component=Component.IB, bdf=normalize_bdf(m["bdf"]), dev_name=m["ib"])


def gpu_is_lost_head(t: str) -> Candidate | None:
    m = _NV_LOST.search(t)
    if not m:
        return None
    return Candidate(kind="gpu_fallen_off_bus", bdf=normalize_bdf(m["bdf"]) if m["bdf"] else None, family="gpu_lost",
                     priority=3, detail=m["bdf"] is None, attrs={"nv_status": "NV_ERR_GPU_IS_LOST"})


# ------------------------------------------------------------------------------------------ ConnectX modules

_MLX5_MODULE = re.compile(rf"mlx5_core (?P<bdf>{_BDF_RAW}):? (?:\w+:\d+:\(pid \d+\): )?Port module event(?P<err>\[error\])?: "
                          r"module (?P<mod>\d+), (?P<status>[^,]+?)(?:, (?P<error>.+?))?\s*$")
"""drivers/net/ethernet/mellanox/mlx5/core/events.c port_module (v5.2+; en_main.c/port.c before):
mlx5_core_info(`Port module event: module %u, %s`) (mlx5_pme_status: `Cable plugged`, `Cable unplugged`, `Cable
error`), mlx5_core_err(`Port module event[error]: module %u, %s, %s`; mlx5_core_err prefixes `%s:%d:(pid %d): `,
function, line and pid) (mlx5_pme_error: `Power budget exceeded`,
`Long Range for non MLNX cable`, `Bus stuck (I2C or data shorted)`, `No EEPROM/retry timeout`, `Enforce part
number list`, `Unknown identifier`, `High Temperature`, `Bad or shorted cable/module`, `Unknown status`)."""


def fabric_device_head(t: str) -> Candidate | None:
    """RDMA/fabric device faults below the port state: ConnectX port modules (cable/transceiver), the EFA
    device's admin queue."""
    if "efa " in t:
        c = efa_head(t)
        if c is not None:
            return c
    return mlx5_module_head(t) if "Port module event" in t else None


def mlx5_module_head(t: str) -> Candidate | None:
    m = _MLX5_MODULE.search(t)
    if not m:
        return None
    status = m["status"].strip()
    attrs: dict[str, Attr] = {"module": int(m["mod"]), "module_status": status[:64]}
    if m["error"]:
        attrs["module_error"] = m["error"].strip()[:96]
    low = status.lower()
    if m["err"] or "error" in low:
        kind, healthy = "ib_module_error", False
    elif "unplugged" in low:
        kind, healthy = "ib_module_unplugged", False
    elif "plugged" in low:
        kind, healthy = "ib_module_plugged", True
    else:
        return None
    return Candidate(kind=kind, component=Component.IB, bdf=normalize_bdf(m["bdf"]), healthy=healthy, attrs=attrs)


# ------------------------------------------------------------------------------------------ AMD GPUs (amdgpu)

_AMD_PREFIX = rf"(?:amdgpu (?P<bdf>{_BDF_RAW}): (?:amdgpu: )?|\[drm:\w+ \[amdgpu\]\] \*ERROR\* |\[drm ERROR :\w+\] )"
_AMD_RING = re.compile(_AMD_PREFIX + r"ring (?P<ring>\S+) timeout, signaled seq=(?P<sig>\d+), emitted seq=(?P<emit>\d+)")
"""drivers/gpu/drm/amd/amdgpu/amdgpu_job.c amdgpu_job_timedout: v6.x dev_err(adev->dev, `ring %s timeout, signaled
seq=%u, emitted seq=%u`) (`amdgpu <bdf>: [amdgpu: ]`), before v6.1 DRM_ERROR (`[drm:amdgpu_job_timedout [amdgpu]]
*ERROR* ring %s timeout, ...`); then `Process information: process %s pid %d thread %s pid %d` (v6.x `Process %s pid
%d thread %s pid %d`)."""
_AMD_RESET_FAILED = re.compile(_AMD_PREFIX + r"(?:GPU reset\(\d+\) failed|GPU Recovery Failed: -?\d+|"
                               r"GPU reset end with ret = -\d+|ASIC reset failed with error, -?\d+)")
"""amdgpu_device.c amdgpu_device_gpu_recover / amdgpu_device_reinit_after_reset: `GPU reset(%d) failed`, `GPU
Recovery Failed: %d`, `GPU reset end with ret = %d` (ret < 0), `ASIC reset failed with error, %d for drm dev, %s`."""
_AMD_RAS = re.compile(_AMD_PREFIX + r"(?:(?P<n>\d+) uncorrectable hardware errors detected in (?P<block>\S+) block|"
                      r"uncorrectable hardware error ?\((?P<ev>\w+)\) detected!?)")
"""amdgpu_ras.c amdgpu_ras_error_print_error_data / amdgpu_ras_log_on_err_counter: `%ld uncorrectable hardware errors
detected in %s block`; amdgpu_ras_global_ras_isr (v5.x) `uncorrectable hardware error(ERREVENT_ATHUB_INTERRUPT)
detected!`: the GPU's memory or fabric lost data (as a double-bit ECC error on an NVIDIA GPU)."""


def amdgpu_head(t: str) -> Candidate | None:
    """AMD GPU faults read into vendor-neutral kinds: ring (job) timeout, reset failure, RAS uncorrectable."""
    if "timeout, signaled seq" in t:
        m = _AMD_RING.search(t)
        if m:
            return Candidate(kind="gpu_ring_timeout", component=Component.GPU, bdf=normalize_bdf(m["bdf"]),
                             family="amdgpu", priority=1,
                             attrs={"ring": m["ring"][:32], "signaled_seq": int(m["sig"]), "emitted_seq": int(m["emit"])})
    if "uncorrectable hardware error" in t:
        m = _AMD_RAS.search(t)
        if m:
            attrs: dict[str, Attr] = {"ras_block": m["block"] or m["ev"] or ""}
            if m["n"]:
                attrs["error_count"] = int(m["n"])
            return Candidate(kind="gpu_ras_uncorrectable", component=Component.GPU, bdf=normalize_bdf(m["bdf"]),
                             family="amdgpu", priority=3, attrs=attrs)
    m = _AMD_RESET_FAILED.search(t)
    if m:
        return Candidate(kind="gpu_reset_failed", component=Component.GPU, bdf=normalize_bdf(m["bdf"]),
                         family="amdgpu", priority=2)
    return None


# ------------------------------------------------------------------------------------------ CPU thermal, memory failure

_THERM = re.compile(r"CPU(?P<cpu>\d+): (?P<level>Core|Package) (?:temperature (?P<hot>above threshold), "
                    r"(?:cpu|CPU) clock throttled|"
                    r"temperature/speed (?P<ok>normal))")
"""arch/x86/kernel/cpu/mce/therm_throt.c: v2.6-v5.5 therm_throt_process KERN_CRIT `CPU%d: %s temperature above threshold,
cpu clock throttled (total events = %lu)` / KERN_INFO `CPU%d: %s temperature/speed normal`; v5.6+ throttle_active_work
(pr_fmt `mce: `, printed only when the throttling lasts) the same texts, `normal` with `(total events = %lu)`.
`CPU%d: %s power limit notification` is the package at its power limit, a normal state (not read)."""
_MEM_FAILURE = re.compile(r"(?:Memory failure: |MCE )(?P<pfn>0x[0-9a-fA-F]+): (?:recovery action for (?P<type>[^:]+): "
                          r"(?P<result>\w+)|(?:Sending SIGBUS to|Killing) (?P<comm>[^:\s]+):(?P<pid>\d+) due to hardware "
                          r"memory corruption|(?P<type2>.+?) page recovery: (?P<result2>\w+))")
"""mm/memory-failure.c (pr_fmt `Memory failure: `): action_result `%#lx: recovery action for %s: %s` (page type;
Recovered/Ignored/Failed/Delayed), kill_proc `%#lx: Sending SIGBUS to %s:%d due to hardware memory corruption`; before
v5.x `MCE %#lx: Killing %s:%d due to hardware memory corruption`, `MCE %#lx: %s page recovery: %s`."""


def cpu_thermal_head(t: str) -> Candidate | None:
    m = _THERM.search(t)
    if not m:
        return None
    ok = m["ok"] is not None
    return Candidate(kind="cpu_thermal_normal" if ok else "cpu_thermal_throttle", component=Component.CPU, healthy=ok,
                     attrs={"cpu": int(m["cpu"]), "thermal_level": m["level"].lower()})


def memory_failure_head(t: str) -> Candidate | None:
    m = _MEM_FAILURE.search(t)
    if not m:
        return None
    attrs: dict[str, Attr] = {"pfn": m["pfn"].lower()}
    if m["type"] or m["type2"]:
        attrs["page_type"] = (m["type"] or m["type2"]).strip()[:64]
        attrs["recovery_result"] = m["result"] or m["result2"]
    if m["comm"]:
        attrs["process"] = m["comm"][:64]
    return Candidate(kind="memory_failure", component=Component.MEMORY, pid=int(m["pid"]) if m["pid"] else None,
                     family="ras", priority=1, attrs=attrs)


# ------------------------------------------------------------------------------------------ PCIe hot-plug slots

_PCIEHP = re.compile(_DEV_PREFIX + r"\s+(?:pciehp: )?[Ss]lot\((?P<slot>[^)]*)\): (?P<what>Link Down|Card not present|Link Up|"
                     r"Card present)\b")
"""drivers/pci/hotplug/pciehp_ctrl.c pciehp_handle_presence_or_link_change (ctrl_info, `pciehp: ` via dev_fmt):
`Slot(%s): Link Down`, `Slot(%s): Card not present`, `Slot(%s): Link Up`, `Slot(%s): Card present`; v4.x on the pciehp
service device (`pciehp 0000:02:05.0:pcie24: Slot(%s): Link Down`, with debug on `slot(%s): Link Down event`)."""


def pciehp_head(t: str) -> Candidate | None:
    m = _PCIEHP.search(t)
    if not m:
        return None
    up = m["what"] in ("Link Up", "Card present")
    return Candidate(kind="pcie_slot_link_up" if up else "pcie_slot_link_down", component=Component.PCIE,
                     bdf=normalize_bdf(m["bdf"]), healthy=up, attrs={"slot": m["slot"][:32], "slot_event": m["what"]})


# ------------------------------------------------------------------------------------------ RCU stalls, netdev teardown

_RCU_STALL = re.compile(r"INFO: (?P<flavor>rcu_\w+) (?:self-detected stall on CPU|detected (?:expedited )?stalls on "
                        r"(?:CPUs/)?tasks|detected stall on CPU)")
"""kernel/rcu/tree_stall.h (pr_fmt `rcu: ` since v5.0; tree.c before): print_other_cpu_stall `INFO: %s detected stalls on
CPUs/tasks:`, print_cpu_stall `INFO: %s self-detected stall on CPU`; tree_exp.h `INFO: %s detected expedited stalls on
CPUs/tasks: {`; tasks.h `INFO: %s detected stalls on tasks:` (rcu_sched, rcu_preempt, rcu_bh, rcu_tasks); v2.6.3x
rcutree.c `INFO: %s detected stall on CPU %d (t=%lu jiffies)` (rcu_sched_state): a CPU or
task held off RCU for the stall timeout (21 s): the CPU is stuck as in a soft lockup."""
_NETDEV_UNREG = re.compile(r"unregister_netdevice: waiting for (?P<dev>\S+) to become free\. Usage count = (?P<n>-?\d+)")
"""net/core/dev.c netdev_wait_allrefs_any (netdev_wait_allrefs before v5.17): `unregister_netdevice: waiting for %s to
become free. Usage count = %d`, every 10 s while a reference is held: the namespace (a container's network) cannot be
torn down, and the tasks tearing it down hang (node-problem-detector reads it as UnregisterNetDevice)."""


def rcu_stall_head(t: str) -> Candidate | None:
    m = _RCU_STALL.search(t)
    if not m:
        return None
    return Candidate(kind="rcu_stall", family="crash", priority=0, attrs={"rcu_flavor": m["flavor"]})


def netdev_unregister_head(t: str) -> Candidate | None:
    m = _NETDEV_UNREG.search(t)
    if not m:
        return None
    return Candidate(kind="netdev_unregister_stuck", dev_name=m["dev"], family="netdev_unreg",
                     attrs={"usage_count": int(m["n"])})


# ------------------------------------------------------------------------------------------ PCI power state

_PCI_D0 = re.compile(rf"(?P<drv>[\w.-]+) (?P<bdf>{_BDF_RAW}): (?:Unable to change power state from (?P<from>D[0-3]\w*) to D0, "
                     r"device inaccessible|can't change power state from (?P<from2>D[0-3]\w*) to D0 \(config space "
                     r"inaccessible\)|not ready \d+ms after (?P<after>[\w ]+); giving up)")
"""drivers/pci/pci.c pci_power_up / pci_set_full_power_state (v5.x+): pci_err(`Unable to change power state from %s to D0,
device inaccessible`): config space reads all ones; the device is off the bus (printed under the device's driver:
`nvidia`, `nvme`, `mlx5_core`); v4.x-v5.x `can't change power state from %s to D0 (config space inaccessible)`;
pci_dev_wait `not ready %dms after %s; giving up` (the device never answered after a resume or reset)."""


def pci_power_head(t: str) -> Candidate | None:
    m = _PCI_D0.search(t)
    if not m:
        return None
    bdf = normalize_bdf(m["bdf"])
    attrs: dict[str, Attr] = {"driver": m["drv"], "power_state": m["from"] or m["from2"] or f"not ready after {m['after']}"}
    if m["drv"] == "nvidia":
        return Candidate(kind="gpu_fallen_off_bus", bdf=bdf, family="gpu_lost", priority=4, attrs=attrs)
    if m["drv"] in NIC_DRIVERS or m["drv"].startswith("mlx"):
        return Candidate(kind="nic_removed", component=Component.NIC, bdf=bdf, attrs=attrs)
    return None
