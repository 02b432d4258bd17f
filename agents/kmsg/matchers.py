"""Head matchers: one kernel message in, at most one fault candidate out.

A *head* starts a fault record (an `NVRM: Xid` line, `AER: ... error received`, `INFO: task ...
blocked`). Lines that only add detail to an open record (register dumps, call traces, AER status
lines) are not heads; `detail()` extracts fields from them. Rules and their sources are in
`fleetmend/catalog/kinds.toml`; XID framings follow NVIDIA's driver output from r340 to r580
(with/without `pid=`, quoted `pid='<unknown>'`, `name=` with hyphens, `Ch 0000003a`, NVLink5 register
words, MIG `GPU-I:` suffixes).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from fleetmend.events import Component

Attr = str | int | float | bool | None

_BDF_RAW = r"(?:[0-9a-fA-F]{1,8}:)?[0-9a-fA-F]{1,2}:[0-9a-fA-F]{1,2}(?:\.[0-7])?"


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


# ------------------------------------------------------------------------------------------ XID

_XID = re.compile(
    rf"NVRM: Xid \((?:PCI:)?(?P<bdf>{_BDF_RAW})(?:[ ,][^)]*)?\):\s*(?P<xid>\d+)\s*(?:,\s*(?P<rest>.*))?$"
)
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


def _xid(text: str) -> Candidate | None:
    m = _XID.search(text)
    if not m:
        return None
    bdf = normalize_bdf(m["bdf"])
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

Rule = tuple[re.Pattern[str], "callable"]  # type: ignore[valid-type]

_FALLEN = re.compile(rf"(?:GPU\s+|NVIDIA GPU\s+)(?P<bdf>{_BDF_RAW})\b.*?fallen off the bus", re.I)
_FALLEN_ANY = re.compile(r"NVRM:.*fallen off the bus", re.I)
_RESET_REQ = re.compile(r"NV_ERR_RESET_REQUIRED|\bReset required\b", re.I)
_GSP = re.compile(
    r"NVRM: .*(?:GSP-CrashCat Report|kgspHealthCheck\w*:|GSP (?:RPC )?timeout|GSP (?:crash|halt)|"
    r"GSP task exception|_kgspBootstrap\w*: .*failed)",
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
_PCIE_BW = re.compile(
    _DEV_PREFIX + r"\s+(?P<avail>[\d.]+ [GM]b/s) available PCIe bandwidth, limited by (?P<speed>[\d.]+ GT/s) "
    r"PCIe x(?P<w>\d+) link at (?P<at>\S+) \(capable of (?P<cap>[\d.]+ [GM]b/s) with (?P<cspeed>[\d.]+ GT/s) "
    r"PCIe x(?P<cw>\d+) link\)"
)
_EDAC = re.compile(r"EDAC (?:[\w-]+ )?(?P<mc>MC\d+): (?P<n>\d+) (?P<t>CE|UE|Corrected|Uncorrected)\b(?P<rest>.*)")
_MCE_LOGGED = re.compile(r"mce: \[Hardware Error\]: Machine check events logged", re.I)
_MCE_UC = re.compile(
    r"mce: (?:\[Hardware Error\]: .*Machine Check Exception|Uncorrected hardware memory error|"
    r"\[Hardware Error\]: .*(?:PROCESSOR|STATUS) .*UC\b)",
    re.I,
)
_GHES = re.compile(r"\{\d+\}\[Hardware Error\]: Hardware error from APEI Generic Hardware Error Source")
_IB_PORT = re.compile(
    rf"mlx5_core (?P<bdf>{_BDF_RAW})(?: (?P<dev>\w+))?:?\s+Port: (?P<port>\d+) Link (?P<st>DOWN|INIT|ACTIVE|ARMED|POLLING)\b",
    re.I,
)
_IB_POWER = re.compile(rf"mlx5_core (?P<bdf>{_BDF_RAW}).*insufficient power on the PCIe slot", re.I)
_ACCESS_REG = re.compile(r"mlx5_cmd_(?:out_err|check).*ACCESS_REG\(0x[0-9a-f]+\).*failed", re.I)
_NIC_LINK = re.compile(
    rf"(?:(?P<drv>[\w.-]+) (?P<bdf>{_BDF_RAW}) )?(?P<ifname>[\w.@-]+): (?:NIC )?Link is (?P<st>Up|Down)\b", re.I
)
_BOND_SLAVE = re.compile(
    r"(?P<bond>[\w.-]+): (?:link status definitely (?P<st1>down|up) for interface (?P<if1>[\w.@-]+)|"
    r"\(slave (?P<if2>[\w.@-]+)\): link status definitely (?P<st2>down|up))"
)
_BOND_NONE = re.compile(r"(?P<bond>[\w.-]+): now running without any active interface")
_BOND_BACK = re.compile(r"(?P<bond>[\w.-]+): (?:first active interface up|active interface up)")
_NVME_TIMEOUT = re.compile(
    r"nvme (?P<dev>nvme\d+): (?:I/O (?:tag )?\d+ (?:\([^)]*\) )?QID \d+ timeout|controller is down; will reset)"
)
_NVME_NOTREADY = re.compile(r"nvme (?P<dev>nvme\d+): Device not ready; aborting reset")
_NVME_REMOVED = re.compile(r"nvme (?P<dev>nvme\d+): Removing after probe failure")
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


def _aer_kind(sev: str) -> str:
    s = sev.lower()
    if "non-fatal" in s or "nonfatal" in s:
        return "aer_nonfatal"
    if "fatal" in s:
        return "aer_fatal"
    return "aer_corrected"


def match_head(text: str) -> Candidate | None:
    """The fault candidate a kernel message starts, or None.

    Args:
        text: the message with framing removed (leading indentation allowed).
    Returns:
        `Candidate` (kind, code, bdf, pid, attrs, family) or None for lines that start no fault.
    """
    t = text.strip()
    if not t:
        return None
    if "Xid" in t:
        c = _xid(t)
        if c:
            return c
    if "NVRM" in t or "GPU" in t:
        m = _FALLEN.search(t)
        if m and "fallen off the bus" in t.lower():
            return Candidate(kind="gpu_fallen_off_bus", bdf=normalize_bdf(m["bdf"]), family="gpu_lost", priority=5)
        if _FALLEN_ANY.search(t):
            return Candidate(kind="gpu_fallen_off_bus", family="gpu_lost", priority=4)
        if "NVRM" in t and _RESET_REQ.search(t):
            return Candidate(kind="gpu_reset_required", family="gsp", priority=6)
        if _GSP.search(t):
            return Candidate(kind="gsp_error", family="gsp", priority=1)
        if _NVL_DISC.search(t):
            return Candidate(kind="nvlink_discovery_failed")
    if "SXid" in t:
        m = _SXID.search(t)
        if m:
            rest = m["rest"]
            dm = _SXID_DEV.search(t)
            fatal = rest.lower().startswith("fatal")
            detail = rest.startswith("Data {") or rest.startswith("Severity ")
            return Candidate(
                kind="sxid_fatal" if fatal else "sxid_nonfatal", code=int(m["code"]), bdf=normalize_bdf(m["bdf"]),
                dev_name=dm["dev"] if dm else None, family="sxid", detail=detail, priority=2 if fatal else 1,
                attrs={"sxid_text": rest[:512]},
            )
    if "peermem" in t and _PEERMEM.search(t):
        return Candidate(kind="peermem_invalid_context")
    if "rror" in t or "ecovery" in t:
        m = _AER_HEAD.search(t)
        if m:
            return Candidate(
                kind=_aer_kind(m["sev"]), bdf=normalize_bdf(m["bdf"]), family="aer",
                attrs={"aer_severity": m["sev"], "multiple": bool(m["multi"])},
            )
        m = _AER_BUS.search(t)
        if m:
            return Candidate(
                kind=_aer_kind(m["sev"]), bdf=normalize_bdf(m["bdf"]), family="aer", detail=True,
                attrs={"aer_severity": m["sev"].strip(), "aer_type": m["type"].strip()},
            )
        m = _AER_FAILED.search(t)
        if m:
            return Candidate(
                kind="aer_recovery_failed", bdf=normalize_bdf(m["bdf"]), family="aer", priority=-1,
                attrs={"recovery_failed": True},
            )
    if "PCIe bandwidth" in t:
        m = _PCIE_BW.search(t)
        if m:
            reduced = int(m["w"]) < int(m["cw"])
            return Candidate(
                kind="pcie_link_degraded" if reduced else "pcie_bandwidth_limited", bdf=normalize_bdf(m["bdf"]),
                attrs={
                    "pcie_link_width": int(m["w"]), "pcie_link_width_capable": int(m["cw"]),
                    "pcie_link_speed": m["speed"], "pcie_link_speed_capable": m["cspeed"],
                    "limited_at": m["at"],
                },
            )
    if "EDAC" in t:
        m = _EDAC.search(t)
        if m:
            ue = m["t"] in ("UE", "Uncorrected")
            return Candidate(
                kind="edac_ue" if ue else "edac_ce", dev_name=m["mc"].lower(), family="ras", priority=3,
                attrs={"error_count": int(m["n"]), "edac_detail": m["rest"].strip()[:256]},
            )
    if "Hardware Error" in t or "mce:" in t:
        if _GHES.search(t):
            return Candidate(kind="ghes_recoverable", family="ras", priority=2)
        if _MCE_UC.search(t):
            return Candidate(kind="mce_uncorrected", family="ras", priority=1)
        if _MCE_LOGGED.search(t):
            return Candidate(kind="mce", family="ras", detail=True, priority=0)
    if "mlx5" in t:
        m = _IB_PORT.search(t)
        if m:
            st = m["st"].upper()
            kind = {"DOWN": "ib_port_down", "ACTIVE": "ib_port_active"}.get(st, "ib_port_init")
            return Candidate(
                kind=kind, bdf=normalize_bdf(m["bdf"]), dev_name=m["dev"], port=int(m["port"]),
                healthy=kind == "ib_port_active", attrs={"port_state": st},
            )
        m = _IB_POWER.search(t)
        if m:
            return Candidate(kind="ib_insufficient_power", bdf=normalize_bdf(m["bdf"]))
        if _ACCESS_REG.search(t):
            return Candidate(kind="ib_access_reg_noise")
    if "Link is" in t:
        m = _NIC_LINK.search(t)
        if m:
            up = m["st"].lower() == "up"
            return Candidate(
                kind="nic_link_up" if up else "nic_link_down", bdf=normalize_bdf(m["bdf"]), dev_name=m["ifname"],
                healthy=up, attrs={"driver": m["drv"]} if m["drv"] else {},
            )
    if "bond" in t or "active interface" in t or "slave" in t:
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
    if "nvme" in t:
        m = _NVME_TIMEOUT.search(t)
        if m:
            return Candidate(kind="nvme_timeout", dev_name=m["dev"], family="nvme", priority=1)
        m = _NVME_NOTREADY.search(t)
        if m:
            return Candidate(kind="nvme_timeout", dev_name=m["dev"], family="nvme", detail=True, priority=1)
        m = _NVME_REMOVED.search(t)
        if m:
            return Candidate(kind="nvme_removed", dev_name=m["dev"], family="nvme", priority=2)
    m = _PANIC.search(t)
    if m:
        reason = m["reason"].strip()
        attrs: dict[str, Attr] = {"panic_reason": reason[:256]}
        hm = _HARD.search(reason)
        if hm:
            attrs["cpu"] = int(hm["cpu"])
        return Candidate(kind="kernel_panic", family="crash", priority=3, attrs=attrs)
    if "lockup" in t.lower() or "LOCKUP" in t:
        m = _SOFT.search(t)
        if m:
            return Candidate(
                kind="soft_lockup", pid=int(m["pid"]), family="crash", priority=0,
                attrs={"cpu": int(m["cpu"]), "stuck_s": int(m["s"]), "process": m["comm"]},
            )
        m = _HARD.search(t)
        if m:
            return Candidate(kind="hard_lockup", family="crash", priority=2, attrs={"cpu": int(m["cpu"])})
    if _OOPS.search(t):
        return Candidate(kind="oops", family="crash", priority=1, attrs={"oops": t[:256]})
    if _OOPS_LINE.search(t):
        return Candidate(kind="oops", family="crash", priority=1, detail=True, attrs={"oops": t[:256]})
    if "blocked for more than" in t:
        m = _HUNG.search(t)
        if m:
            return Candidate(
                kind="hung_task", pid=int(m["pid"]), family="crash", priority=0,
                attrs={"process": m["comm"], "blocked_s": int(m["s"])},
            )
    if "oom" in t or "Kill" in t or "memory" in t:
        m = _OOM_SUMMARY.search(t)
        if m:
            return Candidate(kind="oom_kill", pid=int(m["pid"]), family="oom", attrs={"process": m["comm"]})
        m = _OOM_KILL.search(t) or _OOM_KILLED.search(t)
        if m:
            return Candidate(kind="oom_kill", pid=int(m["pid"]), family="oom", attrs={"process": m["comm"]})
        m = _OOM_INVOKED.search(t)
        if m:
            return Candidate(kind="oom_kill", family="oom", attrs={"invoked_by": m["comm"][:128]})
    return None


# ------------------------------------------------------------------------------------------ details

_CPU_PID = re.compile(r"\bCPU: ?(?P<cpu>\d+) (?:UID: \d+ )?PID: (?P<pid>\d+) Comm: (?P<comm>\S+)")
_TASK_LINE = re.compile(r"^task:(?P<comm>.+?)\s+state:\S+.*?\bpid:\s*(?P<pid>\d+)")
_AER_STATUS = re.compile(r"error status/mask=(?P<status>[0-9a-fA-F]+)/(?P<mask>[0-9a-fA-F]+)")
_AER_BIT = re.compile(r"^\[\s*(?P<bit>\d+)\]\s+(?P<name>.+?)\s*(?P<first>\(First\))?$")
_GHES_SEV = re.compile(r"\[Hardware Error\]: event severity: (?P<sev>\w+)")
_GHES_SECTION = re.compile(r"\[Hardware Error\]:\s+section_type: (?P<st>.+)$")
_GHES_DEVICE = re.compile(rf"\[Hardware Error\]:\s+device_id: (?P<bdf>{_BDF_RAW})\s*$")

CRASH_KINDS = {"kernel_panic", "oops", "hard_lockup", "soft_lockup", "hung_task"}


def detail(kind: str, text: str) -> dict[str, Attr]:
    """Fields a non-head line adds to an open record of `kind`.

    Returns a dict with any of: `pid` (int; crash kinds: from `CPU: N PID: M Comm: X` or the hung-task
    `task:NAME ... pid:N` line), `aer_status`/`aer_mask`/`aer_errors` (AER status lines),
    `kind` (GHES `event severity:` -> ghes_corrected/ghes_recoverable/ghes_fatal), `ghes_section`,
    `bdf` (GHES PCIe `device_id:`), `process`.
    """
    t = text.strip()
    out: dict[str, Attr] = {}
    if kind in CRASH_KINDS:
        m = _CPU_PID.search(t)
        if m:
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
