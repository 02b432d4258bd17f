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
- ibstat / ibv_devinfo: per-port State Down / PORT_DOWN → ib_port_down, Init/Armed → ib_port_init.
- ibdev2netdev: `mlx5_0 port 1 ==> ib0 (Down)` → ib_port_down (IB netdev) or nic_link_down (Ethernet).
- BMC SEL (`id | date | time | sensor | event | Asserted`): Uncorrectable ECC → edac_ue (memory, fatal),
  Correctable ECC → edac_ce (info), Processor IERR/machine check → mce_uncorrected, PCI PERR/SERR or
  bus uncorrectable/fatal → aer_fatal. Deasserted lines are recoveries and publish nothing.
"""

from __future__ import annotations

import re

from agents.parsers.common import Ctx
from fleetmend.events import Component, Device, FaultEvent, Severity, Source

_PLUGIN_XID = re.compile(r"XidCriticalError:\s*Xid=(\d+)(?:\s+on\s+Device=(\S+?)[;,]?(?:\s|$))?")
_CUDA_ECC = re.compile(r"uncorrectable ECC error encountered|cuda(?:\s+runtime)?\s+error\s*\((?:39|214)\)", re.I)
_LOST = re.compile(r"GPU has fallen off the bus|GPU is lost", re.I)
_NCCL_IB = re.compile(r"NCCL WARN NET/IB\s*:\s*(.*(?:status=(\d+)|error|port .*down).*)", re.I)
_MCE = re.compile(r"Hardware event\. This is not a software error\.")
_IBSTAT_CA = re.compile(r"^CA '([^']+)'")
_IBSTAT_PORT = re.compile(r"^\s*Port (\d+):\s*$")
_IBSTAT_STATE = re.compile(r"^\s*State:\s*(\w+)")
_IBV_HCA = re.compile(r"^\s*hca_id:\s*(\S+)")
_IBV_PORT = re.compile(r"^\s*port:\s*(\d+)\s*$")
_IBV_STATE = re.compile(r"^\s*state:\s*PORT_(\w+)")
_IB2NET = re.compile(r"^(\S+) port (\d+) ==> (\S+) \((\w+)\)")
_SEL = re.compile(r"^\s*[0-9a-fA-F]+\s*\|([^|]*)\|([^|]*)\|([^|]*)\|([^|]*)\|\s*(Asserted|Deasserted)?", re.M)


def parse(text: str, ctx: Ctx) -> list[FaultEvent]:
    out: list[FaultEvent] = []
    for m in _PLUGIN_XID.finditer(text):
        uuid = m.group(2)
        out.append(ctx.xid(int(m.group(1)), Source.NVML, f"k8s-device-plugin: XidCriticalError Xid={m.group(1)} "
                           f"on {uuid or 'unknown device'}; device marked unhealthy",
                           device=Device(uuid=uuid), raw=_line_of(text, m.start()),
                           attrs={"text_kind": "k8s-device-plugin"}))
    if (m := _CUDA_ECC.search(text)) is not None:
        out.append(ctx.event("cuda_uncorrectable_ecc", Component.GPU, Severity.FATAL,
                             f"application: {_line_of(text, m.start()).strip()}", Source.INJECT,
                             raw=_line_of(text, m.start()), attrs={"text_kind": "application"}))
    if not out and (m := _LOST.search(text)) and "NVRM" not in text:
        out.append(ctx.event("gpu_fallen_off_bus", Component.GPU, Severity.FATAL,
                             f"application: {_line_of(text, m.start()).strip()}", Source.INJECT,
                             raw=_line_of(text, m.start()), attrs={"text_kind": "application"}))
    for m in _NCCL_IB.finditer(text):
        status = int(m.group(2)) if m.group(2) else None
        if status == 0:
            continue
        out.append(ctx.event("nccl_ib_error", Component.IB, Severity.DEGRADED, f"NCCL NET/IB: {m.group(1)}",
                             Source.INJECT, raw=_line_of(text, m.start()),
                             attrs={"text_kind": "nccl", "ibv_wc_status": status}))
        break
    out += _mcelog(text, ctx)
    out += _ib_tools(text, ctx)
    out += _sel(text, ctx)
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
                                 "mcelog: uncorrected machine check" + (f" (CPU {cpu.group(1)} bank {cpu.group(2)})" if cpu else ""),
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
        if m := (_IBSTAT_CA.match(line) or _IBV_HCA.match(line)):
            hca, port = m.group(1), None
            continue
        if m := (_IBSTAT_PORT.match(line) or _IBV_PORT.match(line)):
            port, block = int(m.group(1)), [line]
            continue
        if hca is not None and port is not None:
            block.append(line)
            if m := (_IBSTAT_STATE.match(line) or _IBV_STATE.match(line)):
                kind = "ibv_devinfo" if "PORT_" in line else "ibstat"
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
        if "uncorrectable ecc" in e or "uncorrectable machine check" in e and "memory" in e:
            out.append(ctx.event("edac_ue", Component.MEMORY, Severity.FATAL, f"BMC SEL: {sensor}: {event}",
                                 Source.KMSG, device=Device(name=sensor), raw=raw, attrs=attrs))
        elif "correctable ecc" in e:
            out.append(ctx.event("edac_ce", Component.MEMORY, Severity.INFO, f"BMC SEL: {sensor}: {event}",
                                 Source.KMSG, device=Device(name=sensor), raw=raw, attrs=attrs))
        elif "processor" in e and ("ierr" in e or "machine check" in e or "thermal trip" in e):
            out.append(ctx.event("mce_uncorrected", Component.CPU, Severity.FATAL, f"BMC SEL: {sensor}: {event}",
                                 Source.KMSG, device=Device(name=sensor), raw=raw, attrs=attrs))
        elif re.search(r"pci (?:perr|serr)|bus (?:uncorrectable|fatal) error", e):
            out.append(ctx.event("aer_fatal", Component.PCIE, Severity.FATAL, f"BMC SEL: {sensor}: {event}",
                                 Source.KMSG, device=Device(name=sensor), raw=raw, attrs=attrs))
    return out
