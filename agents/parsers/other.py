"""Other text an operator pastes: NVIDIA k8s-device-plugin logs, CUDA/PyTorch/NCCL application logs,
mcelog records, `ibstat`, `ibv_devinfo`, `ibdev2netdev`, and BMC SEL lists (`ipmitool sel elist`).

Formats and rules:
- device plugin (klog): `XidCriticalError: Xid=48 on Device=GPU-...` → XID event (catalog severity).
- CUDA: "uncorrectable ECC error encountered" (CUDA error 214 / legacy 39) → cuda_uncorrectable_ecc
  (fatal); "GPU has fallen off the bus" / "GPU is lost" → gpu_fallen_off_bus.
- NCCL: `NCCL WARN NET/IB : Got completion from peer ... with status=N` (an ibv_wc error, e.g. 12
  IBV_WC_RETRY_EXC_ERR) or `NET/IB ... error`/`port ... down` → nccl_ib_error (ib, degraded).
- mcelog: "Hardware event. This is not a software error." records; "Uncorrected error" or "Processor
  context corrupt" → mce_uncorrected (fatal), "Corrected error" → mce (info).
- ibstat / ibv_devinfo / ibstatus: per-port State Down / PORT_DOWN / `1: DOWN` → ib_port_down, Init/Armed →
  ib_port_init; ibstatus `Fatal error: device 'X': sys files not found` → nic_removed (the HCA has no ports).
- ibdev2netdev: `mlx5_0 port 1 ==> ib0 (Down)` → ib_port_down (IB netdev) or nic_link_down (Ethernet).
- BMC SEL (`ipmitool sel list|elist`: `id | [date | time |] sensor | event | Asserted`): Uncorrectable ECC →
  edac_ue (memory, fatal), Correctable ECC → edac_ce (info), Processor/CPU IERR or machine check →
  mce_uncorrected, PCI PERR/SERR or bus uncorrectable/fatal → aer_fatal. Deasserted lines are recoveries and
  publish nothing.
- BMC logs in vendor layouts, judged by the same rules on their message text: Dell iDRAC `racadm getsel`
  (`Severity:` / `Description:` records) and Lifecycle log `racadm lclog view` (`Message ID = MEM0001`,
  `Severity = Critical`, `Message = ...`); HPE iLO IML (`CRITICAL: Uncorrectable Machine Check Exception
  (...)`, or table rows with a `Critical`/`Caution` column). Informational/OK records publish nothing.
- rasdaemon `ras-mc-ctl --errors` / `--summary`: memory controller events (Corrected → edac_ce,
  Uncorrected/Fatal → edac_ue), PCIe AER events (aer_corrected/aer_nonfatal/aer_fatal), MCE events
  (Corrected → mce, otherwise mce_uncorrected), one event per section, kind and device. A section's records are
  numbered (`--errors`: `1 <time> error: ...`) or indented (`--summary`: `\t1 Corrected error ... errors`); the first
  line that is neither (the next pasted command, other output) ends the section.
- NCCL `NET/IB : Got async event : local catastrophic error` (v2.19) / `NET/IB : mlx5_0:1 async fatal event:
  local catastrophic error` (v2.30) (IBV_EVENT_DEVICE_FATAL) → ib_device_fatal (fatal: the HCA is dead until reset).
- NCCL NVLS: a `NCCL WARN` from transport/nvls.cc or naming NVLS (`Failed to bind NVLink SHARP (NVLS) Multicast
  memory ...`) → nccl_nvls_error (nvlink, degraded: fabric manager / NVSwitch multicast is broken on the node).
- IBM Autopilot node labels (`autopilot.ibm.com/dcgm.level.3=ERR_<time>_<test>.<gpu>`,
  `autopilot.ibm.com/gpuhealth=EVICT`) → dcgm_diag_fail (fatal) for the failed DCGM test.
- NVIDIA Fabric Manager log: `detected NVSwitch fatal error N on fid F on NVSwitch pci bus id B physical id P
  port Q` → sxid_fatal (code N, the switch's PCI address and port; fatal for the GPUs behind it), `non-fatal`
  → sxid_nonfatal.
- systemd-networkd (journal/syslog): `IFNAME: Lost carrier` → nic_link_down, `Gained carrier` → its clearing
  event (nic_link_up).
"""

from __future__ import annotations

import re

from agents.kmsg.matchers import normalize_bdf
from agents.parsers.common import Ctx, to_int
from agents.parsers.dcgm import component_of
from fleetmend.events import Component, Device, FaultEvent, Severity, Source

_PLUGIN_XID = re.compile(r"XidCriticalError:\s*Xid=(\d+)(?:\s+on\s+Device=(\S+?)[;,]?(?:\s|$))?")
_CUDA_ECC = re.compile(r"uncorrectable ECC error encountered|cuda(?:\s+runtime)?\s+error\s*\((?:39|214)\)", re.I)
_LOST = re.compile(r"GPU has fallen off the bus|GPU is lost", re.I)
_NCCL_IB = re.compile(r"NCCL WARN NET/IB\s*:\s*(.*(?:status=(\d+)|error|port .*down).*)", re.I)
_NCCL_COMPLETION = re.compile(r"NCCL WARN NET/IB(?:/GIN)?\s*: Got completion from peer (?P<peer>\S+) with "
                              r"(?:status=(?:(?P<sname>\w+)"
                              r"\()?(?P<st>\d+)\)?|error (?P<st2>\d+))(?:.*? hca (?P<hca>[\w-]+))?")
"""NCCL transport/net_ib (v2.18.5 `NET/IB : Got completion from peer %s with error %d, opcode %d, len %d, vendor err %d
(%s)...`; v2.19-v2.27 `... with status=%d opcode=%d len=%d vendor err %d (%s)%s%s%s%s`; v2.28+ p2p.cc `NET/IB: Got
completion from peer %s with status=%s(%d) opcode=%s(%d) vendor_err=%u %s%s%s%s hca %s`): an ibv_wc error on the job's
queue pair (12 IBV_WC_RETRY_EXC_ERR: the peer or the path stopped answering)."""
_NCCL_ASYNC = re.compile(r"NCCL WARN NET/IB\s*:\s*(?:(?P<dev>[\w-]+):(?P<port>\d+) )?"
                         r"(?:Got non-fatal async event: (?P<ev>[^(]+?)\(\d+\)|"
                         r"Got async event : (?P<ev2>.+?)\s*$|async fatal event on (?P<obj>QP|CQ|SRQ)\b.*?: (?P<ev3>[^:]+?)\s*$)",
                         re.M)
"""NCCL net_ib/common.cc ncclIbAsyncThreadMain (v2.30.7): `NET/IB : %s:%d Got non-fatal async event: %s(%d)`
(ibv_event_type_str: `port error` = IBV_EVENT_PORT_ERR, the port went down under the job; `port active`, `LID change`,
`P_Key change`, `SM change`, `client reregistration` are fabric management, not faults), `NET/IB : %s:%d async fatal
event on QP (%p) ...: %s` / `on CQ` (one queue pair or CQ failed: the job's connection); v2.19-v2.22 `NET/IB : %s:%d
Got async event : %s`, before v2.19 `NET/IB : Got async event : %s` (no device)."""
_MCE = re.compile(r"Hardware event\. This is not a software error\.")
_IBSTAT_CA = re.compile(r"^CA '([^']+)'")
_IBSTAT_PORT = re.compile(r"^\s*Port (\d+):\s*$")
_IBSTAT_STATE = re.compile(r"^\s*State:\s*(\w+)")
_IBV_HCA = re.compile(r"^\s*hca_id:\s*(\S+)")
_IBV_PORT = re.compile(r"^\s*port:\s*(\d+)\s*$")
_IBV_STATE = re.compile(r"^\s*state:\s*PORT_(\w+)")
_IBSTATUS_DEV = re.compile(r"^Infiniband device '([^']+)' port (\d+) status:")
_IBSTATUS_STATE = re.compile(r"^\s*state:\s*\d+:\s*(\w+)")
_IBSTATUS_FATAL = re.compile(r"^Fatal error:\s+device '([^']+)': sys files not found")
"""rdma-core infiniband-diags/scripts/ibstatus (v50): `Infiniband device '%s' port %s status:` then `\tstate:\t\t %s`
(sysfs `4: ACTIVE`, `1: DOWN`, `2: INIT`, `3: ARMED`); `Fatal error:  device '%s': sys files not found (%s)` when the
HCA named has no sysfs ports (driver not loaded, device gone)."""
_IB2NET = re.compile(r"^(\S+) port (\d+) ==> (\S+) \((\w+)\)")
_SEL = re.compile(r"^\s*[0-9a-fA-F]+\s*\|([^|]*)\|([^|]*)\|([^|]*)\|([^|]*)\|\s*(Asserted|Deasserted)?", re.M)
_SEL_SHORT = re.compile(r"^\s*[0-9a-fA-F]+\s*\|([^|]*)\|([^|]*)\|\s*(Asserted|Deasserted)\s*$", re.M)
_NCCL_FATAL = re.compile(r"NET/IB\s*:\s*(?:(?P<dev>mlx\d_\d+|[\w-]+:\d+)\s+)?(?:Got async event|async fatal event)\s*:\s*"
                         r"local catastrophic error"
                         r"(?:\s*\((?P<dev2>[^)]*)\))?", re.I)
"""NCCL src/transport/net_ib (v2.19.3 net_ib.cc `NET/IB : Got async event : %s`; v2.30.7 net_ib/common.cc
`NET/IB : %s:%d async fatal event: %s` for IBV_EVENT_DEVICE_FATAL, ibv_event_type_str `local catastrophic error`)."""
_NCCL_NVLS = re.compile(r"(?:\[(?P<cdev>\d+)\] )?(?P<file>\S*nvls\S*):\d+(?: \([^)]*\))? NCCL WARN (?P<msg>.*)|"
                        r"NCCL WARN (?P<msg2>.*NVLink SHARP \(NVLS\).*|.*\bNVLS\b.*)")
"""NCCL debug.cc ncclDebugLog (v2.30.7): `%s:%d:%d [%d] %s:%d (%s) NCCL WARN %s` (host:pid:tid [cudaDev]
file:line (func)), before v2.2x without `(%s)`; transport/nvls.cc `Failed to bind NVLink SHARP (NVLS) Multicast memory
of size %ld : CUDA error %d '%s'.` (the fabric manager or NVSwitches are broken), older versions' CUCHECK `Cuda
failure '%s'` at transport/nvls.cc: a warning from the NVLS transport is an NVLS fault."""
_AUTOPILOT = re.compile(r"autopilot\.ibm\.com/(?P<key>[\w.-]+)=(?P<val>\S+)")
_KV_REC = re.compile(r"^\s*(?P<k>Severity|Description|Message|Message ID|MessageID|Record|Date/Time|Timestamp)"
                     r"\s*[:=]\s*(?P<v>.*?)\s*$", re.I)
_IML = re.compile(r"^\s*(?:(?P<sev>CRITICAL|CAUTION|REPAIRED|INFORMATIONAL)\s*:\s*"
                  r"|.*\b(?P<sev2>Critical|Caution)\b.*?\|\s*)(?P<msg>.+?)\s*$")
_IML_WORDS = ("CRITICAL", "CAUTION", "Critical", "Caution")
_RAS_SECTION = re.compile(r"^(?P<name>Memory controller events|PCIe AER events|MCE (?:events|records)|Extlog|"
                          r"Memory failure events)", re.I)
_BDF_ANY = re.compile(r"\b(?:[0-9a-fA-F]{4}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]\b")


_FM_SWITCH = re.compile(r"detected NVSwitch (?P<sev>fatal|non-fatal) error (?P<code>\d+) on fid (?P<fid>\d+) on NVSwitch "
                        r"pci bus id (?P<bdf>[0-9a-fA-F]{1,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]) physical id "
                        r"(?P<phys>\d+)(?: port (?P<port>-?\d+))?")
"""NVIDIA Fabric Manager log (/var/log/fabricmanager.log, R450+; closed source, format as printed by R535-R570 and
quoted by the Fabric Manager User Guide 'NVSwitch errors'): `[%b %d %Y %H:%M:%S] [ERROR] [tid %d] detected NVSwitch
fatal error %d on fid %d on NVSwitch pci bus id %s physical id %d port %d` (and `non-fatal`): the SXid, read as the
kernel's `SXid` line is (`sxid_fatal` / `sxid_nonfatal`) with the switch's PCI address."""
_NETWORKD = re.compile(r"systemd-networkd\[\d+\]: (?P<if>[\w.@:-]+): (?P<st>Lost|Gained) carrier\s*$", re.M)
"""systemd src/network/networkd-link.c link_carrier_lost / link_carrier_gained: log_link_info(`Lost carrier`),
(`Gained carrier`), journald/syslog `systemd-networkd[PID]: IFNAME: ...` (v219+)."""


def _fabric_manager(text: str, ctx: Ctx) -> list[FaultEvent]:
    out: list[FaultEvent] = []
    if "detected NVSwitch" not in text:
        return out
    for m in _FM_SWITCH.finditer(text):
        fatal = m["sev"] == "fatal"
        line = _line_of(text, m.start()).strip()
        bdf = normalize_bdf(m["bdf"])
        out.append(ctx.event("sxid_fatal" if fatal else "sxid_nonfatal", Component.NVLINK,
                             Severity.FATAL if fatal else Severity.DEGRADED, f"fabric manager: {line}",
                             Source.INJECT, device=Device(pci_bus_id=bdf, port=int(m["port"]) if m["port"] else None),
                             code=int(m["code"]), raw=line,
                             attrs={"text_kind": "fabric-manager", "fid": int(m["fid"]),
                                    "physical_id": int(m["phys"])}))
    return out


def _networkd(text: str, ctx: Ctx) -> list[FaultEvent]:
    out: list[FaultEvent] = []
    if "carrier" not in text:
        return out
    for m in _NETWORKD.finditer(text):
        up = m["st"] == "Gained"
        line = _line_of(text, m.start()).strip()
        out.append(ctx.event("nic_link_up" if up else "nic_link_down", Component.NIC,
                             Severity.INFO if up else Severity.DEGRADED, line, Source.INJECT,
                             device=Device(name=m["if"]), raw=line, healthy=up,
                             attrs={"text_kind": "systemd-networkd"}))
    return out


def parse(text: str, ctx: Ctx) -> list[FaultEvent]:
    out: list[FaultEvent] = []
    for m in _PLUGIN_XID.finditer(text):
        uuid = m.group(2)
        out.append(ctx.xid(int(m.group(1)), Source.NVML, f"k8s-device-plugin: XidCriticalError Xid={m.group(1)} "
                           f"on {uuid or 'unknown device'}; device marked unhealthy",
                           device=Device(uuid=uuid), raw=_line_of(text, m.start()),
                           attrs={"text_kind": "k8s-device-plugin"}))
    if (e := _CUDA_ECC.search(text)) is not None:
        out.append(ctx.event("cuda_uncorrectable_ecc", Component.GPU, Severity.FATAL,
                             f"application: {_line_of(text, e.start()).strip()}", Source.INJECT,
                             raw=_line_of(text, e.start()), attrs={"text_kind": "application"}))
    if not out and (lost := _LOST.search(text)) and "NVRM" not in text and "DCGM_" not in _line_of(text, lost.start()):
        out.append(ctx.event("gpu_fallen_off_bus", Component.GPU, Severity.FATAL,
                             f"application: {_line_of(text, lost.start()).strip()}", Source.INJECT,
                             raw=_line_of(text, lost.start()), attrs={"text_kind": "application"}))
    for m in _NCCL_FATAL.finditer(text):
        dev = m.group("dev") or m.group("dev2")
        out.append(ctx.event("ib_device_fatal", Component.IB, Severity.FATAL, "NCCL NET/IB: local catastrophic error"
                             + (f" on {dev}" if dev else "") + " (IBV_EVENT_DEVICE_FATAL: the HCA is dead)",
                             Source.INJECT, device=Device(name=dev.split(":")[0] if dev else None),
                             raw=_line_of(text, m.start()), attrs={"text_kind": "nccl"}))
        break
    nccl_ib = len(out)
    for m in _NCCL_ASYNC.finditer(text) if "NET/IB" in text else ():
        ev = (m["ev"] or m["ev2"] or m["ev3"] or "").strip()
        if "catastrophic error" in ev and m["obj"] is None:
            continue  # IBV_EVENT_DEVICE_FATAL: read above
        line = _line_of(text, m.start()).strip()
        if ev == "port error":
            where = f"{m['dev']} port {m['port']}" if m["dev"] else "an HCA port"
            out.append(ctx.event("ib_port_down", Component.IB, Severity.DEGRADED,
                                 f"NCCL NET/IB: {where}: port error (IBV_EVENT_PORT_ERR)", Source.INJECT,
                                 device=Device(name=m["dev"], port=int(m["port"]) if m["port"] else None), raw=line,
                                 attrs={"text_kind": "nccl", "ib_event": ev}))
        elif m["obj"] in ("QP", "CQ"):
            out.append(ctx.event("nccl_ib_error", Component.IB, Severity.DEGRADED,
                                 f"NCCL NET/IB: {m['dev']}:{m['port']} async fatal event on {m['obj']}: {ev}", Source.INJECT,
                                 device=Device(name=m["dev"], port=int(m["port"]) if m["port"] else None), raw=line,
                                 attrs={"text_kind": "nccl", "ib_event": ev[:96]}))
        else:
            continue
        break
    for m in _NCCL_COMPLETION.finditer(text) if "Got completion" in text else ():
        wc_status = int(m["st"] or m["st2"])
        if wc_status == 0:
            continue
        line = _line_of(text, m.start()).strip()
        out.append(ctx.event("nccl_ib_error", Component.IB, Severity.DEGRADED,
                             f"NCCL NET/IB: completion error {m['sname'] or wc_status} from peer {m['peer']}"
                             + (f" on {m['hca']}" if m["hca"] else ""), Source.INJECT,
                             device=Device(name=m["hca"]), raw=line,
                             attrs={"text_kind": "nccl", "ibv_wc_status": wc_status, "peer": m["peer"][:64]}))
        break
    for m in _NCCL_IB.finditer(text) if len(out) == nccl_ib else ():
        if "catastrophic" in m.group(1) or "async event" in m.group(1) or "async fatal event" in m.group(1):
            continue
        status = int(m.group(2)) if m.group(2) else None
        if status == 0:
            continue
        out.append(ctx.event("nccl_ib_error", Component.IB, Severity.DEGRADED, f"NCCL NET/IB: {m.group(1)}",
                             Source.INJECT, raw=_line_of(text, m.start()),
                             attrs={"text_kind": "nccl", "ibv_wc_status": status}))
        break
    if "NCCL WARN" in text and ("NVLS" in text or "nvls" in text):
        for m in _NCCL_NVLS.finditer(text):
            msg = (m["msg"] or m["msg2"] or "").strip()
            out.append(ctx.event("nccl_nvls_error", Component.NVLINK, Severity.DEGRADED, f"NCCL NVLS: {msg[:300]}",
                                 Source.INJECT, raw=_line_of(text, m.start()),
                                 attrs={"text_kind": "nccl", "cuda_device": int(m["cdev"]) if m["cdev"] else None}))
            break
    out += _mcelog(text, ctx)
    out += _ib_tools(text, ctx)
    out += _sel(text, ctx)
    out += _vendor_bmc(text, ctx)
    out += _ras_mc_ctl(text, ctx)
    out += _autopilot(text, ctx)
    out += _fabric_manager(text, ctx)
    out += _networkd(text, ctx)
    return out


def classify_hw_text(text: str) -> tuple[str, Component, Severity] | None:
    """A BMC/IML/SEL message → (kind, component, severity), or None for text that names no fault.

    Rules (IPMI 2.0 sensor-specific offsets for Memory/Processor/Critical Interrupt; Dell iDRAC event
    message reference MEM/CPU/PCI ids; HPE IML messages): uncorrectable or multi-bit memory → edac_ue;
    correctable memory / single-bit → edac_ce; processor IERR, machine check, internal error →
    mce_uncorrected; PCI(e) bus fatal/uncorrectable, PERR/SERR → aer_fatal.
    """
    e = text.lower()
    if re.search(r"uncorrectable (?:ecc|memory)|multi-?bit (?:memory|ecc)|uncorrectable machine check.*memory|"
                 r"memory .*uncorrectable", e):
        return "edac_ue", Component.MEMORY, Severity.FATAL
    if re.search(r"processor|cpu", e) and re.search(r"ierr|internal error|machine check|\bmce\b|thermal trip", e) \
            or "machine check exception" in e:
        return "mce_uncorrected", Component.CPU, Severity.FATAL
    if re.search(r"pci (?:perr|serr)|bus (?:uncorrectable|fatal) error|(?:uncorrectable|fatal) pci(?:e| express)? "
                 r"(?:express )?error|pci(?:e| express)? (?:bus )?(?:fatal|uncorrectable) error|bus fatal error", e):
        return "aer_fatal", Component.PCIE, Severity.FATAL
    if re.search(r"correctable (?:ecc|memory)|single-?bit (?:memory|ecc)|corrected memory error", e):
        return "edac_ce", Component.MEMORY, Severity.INFO
    return None


def _has_kv_records(text: str) -> bool:
    """A `Severity:`/`Severity =` record line exists (found by substring, then checked on its line only)."""
    i = text.find("Severity")
    while i != -1:
        if _KV_REC.match(_line_of(text, i)):
            return True
        i = text.find("Severity", i + 8)
    return False


def _vendor_bmc(text: str, ctx: Ctx) -> list[FaultEvent]:
    out: list[FaultEvent] = []
    if _has_kv_records(text):
        rec: dict[str, str] = {}
        lines: list[str] = []

        def flush() -> None:
            msg = rec.get("description") or rec.get("message") or ""
            sev = rec.get("severity", "").lower()
            if msg and sev not in ("ok", "informational", "info", "normal"):
                mid = (rec.get("message id") or rec.get("messageid") or "").strip()
                # Dell message-id families name the part: CPUnnnn processor, MEMnnnn memory, PCInnnn PCI bus
                area = {"CPU": "processor", "MEM": "memory", "PCI": "pci bus"}.get(mid[:3].upper(), "")
                hit = classify_hw_text(f"{area} {msg}" if area else msg)
                if hit:
                    kind, comp, s = hit
                    out.append(ctx.event(kind, comp, s, f"BMC: {rec.get('message id', '')} {msg}".replace("BMC:  ", "BMC: "),
                                         Source.KMSG, raw="\n".join(lines),
                                         attrs={"text_kind": "bmc_log", "bmc_severity": rec.get("severity"),
                                                "message_id": rec.get("message id") or rec.get("messageid")}))
            rec.clear()
            lines.clear()

        for line in text.splitlines():
            m = _KV_REC.match(line)
            if m:
                k = m.group("k").lower()
                if k in rec and k in ("severity", "description", "message", "record"):
                    flush()
                rec[k] = m.group("v")
                lines.append(line)
            elif set(line.strip()) <= set("-=") and line.strip():
                flush()
        flush()
    if not any(w in text for w in _IML_WORDS):
        return out
    for line in text.splitlines():
        if not any(w in line for w in _IML_WORDS):
            continue
        if "|" in line and re.match(r"^\s*[0-9a-fA-F]+\s*\|", line):
            continue  # ipmitool rows: _sel
        m = _IML.match(line)
        if not m:
            continue
        sev = (m.group("sev") or m.group("sev2") or "").upper()
        if sev not in ("CRITICAL", "CAUTION"):
            continue
        hit = classify_hw_text(m.group("msg"))
        if hit:
            kind, comp, s = hit
            out.append(ctx.event(kind, comp, s, f"BMC IML: {m.group('msg').strip()}", Source.KMSG, raw=line.strip(),
                                 attrs={"text_kind": "iml", "bmc_severity": sev.lower()}))
    return out


def _ras_mc_ctl(text: str, ctx: Ctx) -> list[FaultEvent]:
    if not re.search(r"^(?:Memory controller events|PCIe AER events|MCE (?:events|records))", text, re.M | re.I):
        return []
    section = ""
    groups: dict[tuple[str, str | None], tuple[Component, Severity, list[str]]] = {}
    for line in text.splitlines():
        sm = _RAS_SECTION.match(line.strip())
        if sm and line.strip().endswith(":"):
            section = sm.group("name").lower()
            continue
        t = line.strip()
        if not t or not section or t.lower().startswith("no "):
            continue
        if not line[0].isspace() and not t[0].isdigit():
            # a section's records are numbered (`--errors`: `1 <time> error: ...`) or indented (`--summary`:
            # `\t1 Corrected error ... errors`); any other line (the next command, a shell prompt, other
            # output pasted after it) ends the section and is not a record
            section = ""
            continue
        low = t.lower()
        dev: str | None = None
        if section.startswith("memory controller"):
            kind, comp = ("edac_ue", Component.MEMORY) if re.search(r"uncorrected|fatal", low) else ("edac_ce", Component.MEMORY)
            dm = re.search(r"(?:DIMM Label\(s\): '([^']*)'|error at (\S+))", t)
            dev = (dm.group(1) or dm.group(2)) if dm else None
        elif section.startswith("pcie aer"):
            if "non-fatal" in low or "nonfatal" in low:
                kind = "aer_nonfatal"
            elif "fatal" in low:
                kind = "aer_fatal"
            else:
                kind = "aer_corrected"
            comp = Component.PCIE
            bm = _BDF_ANY.search(t)
            dev = bm.group(0) if bm else None
        elif section.startswith("mce"):
            comp = Component.CPU
            kind = "mce" if re.search(r"corrected_error|\bcorrected\b", low) and "uncorrected" not in low else "mce_uncorrected"
        else:
            continue
        entry = ctx.catalog.kinds.get(kind)
        sev = entry.severity if entry else Severity.DEGRADED
        key = (kind, dev)
        if key not in groups:
            groups[key] = (comp, sev, [])
        groups[key][2].append(t)
    out: list[FaultEvent] = []
    for (kind, dev), (comp, sev, lines) in groups.items():
        bdf = normalize_bdf(dev) if dev and comp is Component.PCIE else None
        device = Device(pci_bus_id=bdf) if bdf else Device(name=dev[:64] if dev else None)
        more = f" (+{len(lines) - 1} more)" if len(lines) > 1 else ""
        out.append(ctx.event(kind, comp, sev, f"ras-mc-ctl: {lines[0]}" + more,
                             Source.KMSG, device=device, raw="\n".join(lines[:50]),
                             attrs={"text_kind": "ras-mc-ctl", "records": len(lines)}))
    return out


def _autopilot(text: str, ctx: Ctx) -> list[FaultEvent]:
    if "autopilot.ibm.com/" not in text:
        return []
    out: list[FaultEvent] = []
    evict = None
    for m in _AUTOPILOT.finditer(text):
        key, val = m.group("key"), m.group("val")
        if key.startswith("dcgm.level") and val.upper().startswith("ERR"):
            parts = val.split("_")
            test = "_".join(p for p in parts[3:]) if len(parts) > 3 else val
            gpu = None
            if "." in test:
                test, _, ids = test.partition(".")
                gpu = to_int(ids.split(".")[0]) if ids[:1].isdigit() else None
            out.append(ctx.event("dcgm_diag_fail", component_of(test), Severity.FATAL,
                                 f"Autopilot {key}: DCGM test {test} failed" + (f" on GPU {gpu}" if gpu is not None else ""),
                                 Source.DCGM, device=Device(index=gpu), raw=_line_of(text, m.start()).strip(),
                                 attrs={"text_kind": "autopilot", "test": test}))
        elif key == "gpuhealth" and val.upper() == "EVICT":
            evict = m
    if evict is not None and not out:
        out.append(ctx.event("dcgm_health_failure", Component.GPU, Severity.FATAL,
                             "Autopilot gpuhealth=EVICT: the node's GPUs failed a health check", Source.DCGM,
                             raw=_line_of(text, evict.start()).strip(), attrs={"text_kind": "autopilot"}))
    return out


def _line_of(text: str, pos: int) -> str:
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", pos)
    return text[start:end if end >= 0 else None]


def _mcelog(text: str, ctx: Ctx) -> list[FaultEvent]:
    out = []
    starts = [m.start() for m in _MCE.finditer(text)]
    for i, s in enumerate(starts):
        rec = text[s:starts[i + 1] if i + 1 < len(starts) else None]
        cpu = re.search(r"^CPU (\d+) BANK (\d+)", rec, re.M)
        dev = Device(name=f"cpu{cpu.group(1)}") if cpu else Device()
        attrs = {"text_kind": "mcelog", "bank": int(cpu.group(2)) if cpu else None}
        if re.search(r"Uncorrected error|Processor context corrupt|PCC\b", rec):
            out.append(ctx.event("mce_uncorrected", Component.CPU, Severity.FATAL,
                                 "mcelog: uncorrected machine check"
                                 + (f" (CPU {cpu.group(1)} bank {cpu.group(2)})" if cpu else ""),
                                 Source.KMSG, device=dev, raw=rec, attrs=attrs))
        elif re.search(r"Corrected error", rec):
            out.append(ctx.event("mce", Component.CPU, Severity.INFO, "mcelog: corrected machine check", Source.KMSG,
                                 device=dev, raw=rec, attrs=attrs))
    return out


def _port_event(ctx: Ctx, hca: str, port: int, state: str, raw: str, text_kind: str) -> FaultEvent | None:
    s = state.upper()
    if s == "DOWN":
        return ctx.event("ib_port_down", Component.IB, Severity.DEGRADED, f"{hca} port {port} is DOWN ({text_kind})",
                         Source.SYSFS, device=Device(name=hca, port=port), raw=raw, attrs={"text_kind": text_kind})
    if s in ("INIT", "INITIALIZE", "ARMED"):
        return ctx.event("ib_port_init", Component.IB, Severity.INFO, f"{hca} port {port} is {s} ({text_kind})",
                         Source.SYSFS, device=Device(name=hca, port=port), raw=raw, attrs={"text_kind": text_kind})
    return None


def _ib_tools(text: str, ctx: Ctx) -> list[FaultEvent]:
    out: list[FaultEvent] = []
    hca, port, block = None, None, []
    for line in text.splitlines():
        if m := _IBSTATUS_DEV.match(line):
            hca, port, block = m.group(1), int(m.group(2)), [line]
            continue
        if m := _IBSTATUS_FATAL.match(line):
            out.append(ctx.event("nic_removed", Component.IB, Severity.DEGRADED,
                                 f"{m.group(1)}: no sysfs ports (ibstatus: {line.strip()})", Source.SYSFS,
                                 device=Device(name=m.group(1)), raw=line.strip(), attrs={"text_kind": "ibstatus"}))
            continue
        if m := (_IBSTAT_CA.match(line) or _IBV_HCA.match(line)):
            hca, port = m.group(1), None
            continue
        if m := (_IBSTAT_PORT.match(line) or _IBV_PORT.match(line)):
            port, block = int(m.group(1)), [line]
            continue
        if hca is not None and port is not None:
            block.append(line)
            if m := (_IBSTAT_STATE.match(line) or _IBV_STATE.match(line) or _IBSTATUS_STATE.match(line)):
                kind = "ibv_devinfo" if "PORT_" in line else ("ibstatus" if line.lstrip().startswith("state") else "ibstat")
                ev = _port_event(ctx, hca, port, m.group(1), "\n".join(block), kind)
                if ev is not None:
                    out.append(ev)
        if m := _IB2NET.match(line.strip()):
            hca2, p2, netdev, st = m.group(1), int(m.group(2)), m.group(3), m.group(4)
            if st.lower() == "down":
                if netdev.startswith("ib"):
                    out.append(ctx.event("ib_port_down", Component.IB, Severity.DEGRADED,
                                         f"{hca2} port {p2} ({netdev}) is Down (ibdev2netdev)", Source.SYSFS,
                                         device=Device(name=hca2, port=p2), raw=line.strip(),
                                         attrs={"netdev": netdev, "text_kind": "ibdev2netdev"}))
                else:
                    out.append(ctx.event("nic_link_down", Component.NIC, Severity.DEGRADED,
                                         f"{netdev} ({hca2} port {p2}) is Down (ibdev2netdev)", Source.SYSFS,
                                         device=Device(name=netdev, port=p2), raw=line.strip(),
                                         attrs={"hca": hca2, "text_kind": "ibdev2netdev"}))
    return out


def _sel(text: str, ctx: Ctx) -> list[FaultEvent]:
    out: list[FaultEvent] = []
    for m in _SEL.finditer(text):
        sensor, event, state = m.group(3).strip(), m.group(4).strip(), (m.group(5) or "Asserted")
        if state == "Deasserted":
            continue
        e = f"{sensor} {event}".lower()
        raw = m.group(0).strip()
        attrs = {"text_kind": "bmc_sel", "sensor": sensor}
        if "uncorrectable ecc" in e or "uncorrectable machine check" in e and "memory" in e or "multi-bit" in e:
            out.append(ctx.event("edac_ue", Component.MEMORY, Severity.FATAL, f"BMC SEL: {sensor}: {event}",
                                 Source.KMSG, device=Device(name=sensor), raw=raw, attrs=attrs))
        elif "correctable ecc" in e:
            out.append(ctx.event("edac_ce", Component.MEMORY, Severity.INFO, f"BMC SEL: {sensor}: {event}",
                                 Source.KMSG, device=Device(name=sensor), raw=raw, attrs=attrs))
        elif ("processor" in e or "cpu" in e) and ("ierr" in e or "machine check" in e or "thermal trip" in e):
            out.append(ctx.event("mce_uncorrected", Component.CPU, Severity.FATAL, f"BMC SEL: {sensor}: {event}",
                                 Source.KMSG, device=Device(name=sensor), raw=raw, attrs=attrs))
        elif re.search(r"pci (?:perr|serr)|bus (?:uncorrectable|fatal) error", e):
            out.append(ctx.event("aer_fatal", Component.PCIE, Severity.FATAL, f"BMC SEL: {sensor}: {event}",
                                 Source.KMSG, device=Device(name=sensor), raw=raw, attrs=attrs))
    return out
