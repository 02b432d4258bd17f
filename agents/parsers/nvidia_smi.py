"""`nvidia-smi` text → FaultEvents: the default table, `-q` (also `-q -d ECC|PAGE_RETIREMENT|ROW_REMAPPER|
PERFORMANCE|PCIE`, whole or in fragments), `--query-* --format=csv`, and its error lines.

Formats (NVIDIA nvidia-smi man page; drivers 450-580):
- table rows: `|   1  NVIDIA H100 ...  On  |   00000000:55:00.0 Off |      2 |` — third column is
  "Volatile Uncorr. ECC"; `ERR!` in a GPU's rows means NVML could not read it.
- `-q`: indented "Key : Value" tree under `GPU 00000000:10:1C.0` headers (8-hex-digit domain, upper
  case). ECC Errors > Volatile|Aggregate > (SRAM|DRAM) (Un)Correctable (Ampere+), or > Single Bit|Double
  Bit > ... Total (older); Retired Pages > Single Bit ECC / Double Bit ECC / Pending Page Blacklist
  (or Pending Page Retirement); Remapped Rows > Correctable Error / Uncorrectable Error / Pending /
  Remapping Failure Occurred; Channel Repair Pending / Unrepairable Memory (Blackwell); Clocks Event
  (Throttle) Reasons > HW Slowdown ... : Active; GPU Link Info > Link Width > Max/Current "16x".
- CSV: a header of query field names (`pci.bus_id`, `ecc.errors.uncorrected.volatile.total`,
  `remapped_rows.pending`, ...) and one row per GPU.
Judgement: `agents.parsers.common.judge_memory` (the NVML probe's rules). Width below max is
degraded; PCIe generation is not judged from text (an idle GPU downclocks its link).
"""

from __future__ import annotations

import re
from typing import Any

from agents.kmsg.matchers import normalize_bdf
from agents.parsers.common import Ctx, judge_memory, to_int, yes
from fleetmend.events import Component, Device, FaultEvent, Severity, Source

SRC = Source.NVIDIA_SMI
_BDF = r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]"
_HEADER = re.compile(rf"^GPU\s+({_BDF})\s*$")
_KV = re.compile(r"^(\s*)([^:]+?)\s*:\s*(.*?)\s*$")
_SECTION = re.compile(r"^(\s*)(\S[^:]*?)\s*$")
_HANDLE = re.compile(rf"Unable to determine the device handle for (?:GPU|gpu)\s*(?:\d+\s*:\s*)?({_BDF})\s*:\s*(.+)")
_NVL_GPU = re.compile(r"^GPU (\d+): (.*?)(?: \(UUID: ([^)]*)\))?\s*$")
_NVL_LINK = re.compile(r"^\s+Link (\d+): (.+?)\s*$")
_NVL_COUNTER = re.compile(r"^([A-Za-z][A-Za-z ()-]*?(?:Errors?|Counter))\s*:\s*(\d+)$")
_RECOVERY_SEV = {"reset": Severity.FATAL, "gpu reset": Severity.FATAL, "drain and reset": Severity.FATAL,
                 "reboot": Severity.FATAL, "node reboot": Severity.FATAL, "drain p2p": Severity.DEGRADED}
_DRIVER = re.compile(r"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver|"
                     r"Failed to initialize NVML:\s*(.+)|^No devices were found", re.M)
_ROW = re.compile(rf"^\|\s*(\d+)\s+(.*?)\|\s*({_BDF})\s+(\S+)\s*\|\s*(.*?)\s*\|")
_CLOCKS = {"hw slowdown": "clocks_hw_slowdown", "hw thermal slowdown": "clocks_thermal_slowdown",
           "sw thermal slowdown": "clocks_thermal_slowdown", "hw power brake slowdown": "clocks_power_brake"}


def looks_like(text: str) -> bool:
    return bool(re.search(r"NVIDIA-SMI|nvidia-smi|Volatile Uncorr\. ECC|Remapped Rows|Retired [Pp]ages|"
                          r"ECC Errors|remapped_rows\.|ecc\.errors\.|Unable to determine the device handle|"
                          r"gpu_recovery_action|^\s+Link \d+: (?:<inactive>|[\d.]+ GB/s|\w[\w ]*Errors?: \d)|"
                          rf"^GPU\s+{_BDF}\s*$|Clocks (?:Event|Throttle) Reasons", text, re.M))


def parse(text: str, ctx: Ctx) -> list[FaultEvent]:
    """Every nvidia-smi form in `text` → events (possibly none)."""
    out: list[FaultEvent] = []
    for m in _HANDLE.finditer(text):
        bdf = normalize_bdf(m.group(1))
        out.append(ctx.event("gpu_fallen_off_bus", Component.GPU, Severity.FATAL,
                             f"nvidia-smi cannot get a handle for GPU {bdf}: {m.group(2).strip()}", SRC,
                             device=Device(pci_bus_id=bdf), raw=m.group(0)))
    for m in _DRIVER.finditer(text):
        out.append(ctx.event("gpu_driver_unreachable", Component.GPU, Severity.FATAL,
                             f"nvidia-smi: {m.group(0).strip()}", SRC, raw=m.group(0)))
    out += _table(text, ctx)
    out += _query(text, ctx)
    out += _csv(text, ctx)
    out += _nvlink(text, ctx)
    return out


# ---------------------------------------------------------------------- nvlink -s / -e

def _nvlink(text: str, ctx: Ctx) -> list[FaultEvent]:
    """`nvidia-smi nvlink -s` (per link `Link N: 25.781 GB/s` or `<inactive>`) and `nvidia-smi nvlink -e`
    (per link `Link N: Replay Errors: 0`, `Recovery Errors`, `CRC Errors`, and on newer drivers
    `Link N:` followed by indented counters) under `GPU i: <name> (UUID: ...)` headers.

    Judgement: inactive links on a GPU whose other links are up, or all of its links inactive → nvlink_down
    (degraded: P2P falls back to PCIe); any non-zero error counter → nvlink_errors (degraded).
    """
    if "Link " not in text:
        return []
    out: list[FaultEvent] = []
    gpus: list[tuple[int, str | None, str, list[str], dict[int, str], dict[str, int]]] = []
    cur_link: int | None = None
    for line in text.splitlines():
        h = _NVL_GPU.match(line.strip())
        if h and not line.startswith((" ", "\t")):
            uuid = h.group(3) if h.group(3) and h.group(3).startswith("GPU-") else None
            gpus.append((int(h.group(1)), uuid, h.group(2), [line], {}, {}))
            cur_link = None
            continue
        if not gpus:
            continue
        idx, uuid, name, raw, links, errors = gpus[-1]
        lm = _NVL_LINK.match(line)
        if lm:
            cur_link = int(lm.group(1))
            value = lm.group(2)
            cm = _NVL_COUNTER.match(value)
            if cm:
                if int(cm.group(2)):
                    errors[f"link{cur_link}_{cm.group(1).lower().replace(' ', '_')}"] = int(cm.group(2))
                    raw.append(line)
            elif value:
                links[cur_link] = value
                raw.append(line)
            continue
        cm = _NVL_COUNTER.match(line.strip())
        if cm and cur_link is not None and line.startswith((" ", "\t")):
            if int(cm.group(2)):
                errors[f"link{cur_link}_{cm.group(1).lower().replace(' ', '_')}"] = int(cm.group(2))
                raw.append(line)
    for idx, uuid, name, raw, links, errors in gpus:
        dev = Device(index=idx, uuid=uuid)
        inactive = sorted(k for k, v in links.items() if "inactive" in v.lower())
        if inactive:
            out.append(ctx.event("nvlink_down", Component.NVLINK, Severity.DEGRADED,
                                 f"GPU {idx} ({name}): {len(inactive)} of {len(links)} NVLinks inactive (links {inactive})",
                                 SRC, device=dev, raw="\n".join(raw),
                                 attrs={"links_down": len(inactive), "links": len(links), "text_kind": "nvlink -s"}))
        if errors:
            out.append(ctx.event("nvlink_errors", Component.NVLINK, Severity.DEGRADED,
                                 f"GPU {idx} ({name}): NVLink error counters non-zero: "
                                 + ", ".join(f"{k}={v}" for k, v in sorted(errors.items())[:12]),
                                 SRC, device=dev, raw="\n".join(raw), attrs=dict(errors, text_kind="nvlink -e")))
    return out


# ---------------------------------------------------------------------- table

def _table(text: str, ctx: Ctx) -> list[FaultEvent]:
    out: list[FaultEvent] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = _ROW.match(line.strip())
        if not m:
            continue
        idx, bdf, ecc = int(m.group(1)), normalize_bdf(m.group(3)), m.group(5).strip()
        dev = Device(index=idx, pci_bus_id=bdf)
        block = [line] + [x for x in lines[i + 1:i + 3] if x.strip().startswith("|") and not _ROW.match(x.strip())]
        n = to_int(ecc)
        if n:
            out.append(ctx.event("ecc_dbe_volatile", Component.GPU, Severity.FATAL,
                                 f"GPU {idx} ({bdf}): Volatile Uncorr. ECC = {n}", SRC, device=dev, raw="\n".join(block)))
        if any("ERR!" in b for b in block):
            out.append(ctx.event("gpu_unhealthy_readout", Component.GPU, Severity.FATAL,
                                 f"GPU {idx} ({bdf}): nvidia-smi shows ERR! (NVML cannot read the GPU)", SRC,
                                 device=dev, raw="\n".join(block)))
    return out


# ---------------------------------------------------------------------- -q

def _query(text: str, ctx: Ctx) -> list[FaultEvent]:
    records: list[tuple[str | None, dict[str, Any], list[str]]] = []
    cur: dict[str, Any] | None = None
    raw: list[str] = []
    stack: list[tuple[int, str]] = []
    for line in text.splitlines():
        if not line.strip() or line.strip() in ("[...]", "...") or line.lstrip().startswith("#"):
            continue
        h = _HEADER.match(line.strip())
        if h and (len(line) - len(line.lstrip())) < 4:
            cur, raw, stack = {}, [line], []
            records.append((normalize_bdf(h.group(1)), cur, raw))
            continue
        kv = _KV.match(line)
        if kv and kv.group(3) != "":
            indent, key, value = len(kv.group(1)), kv.group(2).strip().lower(), kv.group(3)
            while stack and stack[-1][0] >= indent:
                stack.pop()
            path = [s for _, s in stack]
            if cur is None:
                cur, raw = {}, []
                records.append((None, cur, raw))
            if _record(cur, path, key, value):
                raw.append(line)
            continue
        sec = _SECTION.match(line)
        if sec:
            indent = len(sec.group(1))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, sec.group(2).strip().lower().rstrip(":")))
    out: list[FaultEvent] = []
    for bdf, r, lines in records:
        if not r:
            continue
        dev = Device(pci_bus_id=bdf)
        where = f"GPU {bdf}" if bdf else "GPU"
        body = "\n".join(lines)
        for kind, sev, msg in judge_memory(r, where):
            out.append(ctx.event(kind, Component.GPU, sev, msg, SRC, device=dev, raw=body,
                                 attrs={k: v for k, v in r.items() if not isinstance(v, list)}))
        for kind in sorted(set(r.get("clocks", []))):
            out.append(ctx.event(kind, Component.GPU, Severity.DEGRADED, f"{where}: clocks slowed down ({kind})", SRC,
                                 device=dev, raw=body))
        cw, mw = r.get("width_current"), r.get("width_max")
        if cw and mw and cw < mw:
            out.append(ctx.event("pcie_link_degraded", Component.PCIE, Severity.DEGRADED,
                                 f"{where}: PCIe link x{cw} of x{mw}", SRC, device=dev, raw=body,
                                 attrs={"pcie_link_width": cw, "pcie_link_width_max": mw}))
        if r.get("recovery"):
            action = r["recovery"]
            known = ctx.catalog.recovery_action(action)  # catalog: recovery_actions.toml
            sev = known.severity if known is not None else Severity.FATAL
            out.append(ctx.event("gpu_recovery_action", Component.GPU, sev, f"{where}: recovery action {action}",
                                 SRC, device=dev, raw=body, attrs={"recovery_action": action}))
    return out


def _record(r: dict[str, Any], path: list[str], key: str, value: str) -> bool:
    """Store one -q field into the normalized record. Returns True when the field mattered."""
    p = " > ".join(path)
    if "ecc errors" in p and "sources" not in p:
        scope = "volatile" if "volatile" in p else ("aggregate" if "aggregate" in p else None)
        if scope:
            n = to_int(value)
            bit = "double bit" in p or "single bit" in p
            if bit:  # older drivers: Single Bit / Double Bit subsections; only their Total counts
                if key != "total" or n is None:
                    return False
                name = ("dbe_" if "double bit" in p else "sbe_") + scope
            elif "uncorrectable" in key:
                name = f"dbe_{scope}"
            elif "correctable" in key:
                name = f"sbe_{scope}"
            else:
                return False
            if n is None:
                return False
            r[name] = (r.get(name) or 0) + n
            return True
    if key == "channel repair pending":
        r["channel_repair_pending"] = yes(value)
        return True
    if key == "unrepairable memory":
        r["unrepairable_memory"] = yes(value)
        return True
    if "retired pages" in p:
        if key.startswith("single bit"):
            r["retired_sbe"] = to_int(value)
        elif key.startswith("double bit"):
            r["retired_dbe"] = to_int(value)
        elif key.startswith("pending"):
            r["retired_pending"] = yes(value)
        else:
            return False
        return True
    if "remapped rows" in p and "histogram" not in p:
        m = {"correctable error": "remap_corr", "uncorrectable error": "remap_unc", "pending": "remap_pending",
             "remapping failure occurred": "remap_failure"}.get(key)
        if m is None:
            return False
        r[m] = to_int(value) if m in ("remap_corr", "remap_unc") else yes(value)
        return True
    if ("clocks event reasons" in p or "clocks throttle reasons" in p) and key in _CLOCKS:
        if yes(value):
            r.setdefault("clocks", []).append(_CLOCKS[key])
            return True
        return False
    if "link width" in p and key in ("max", "current"):
        r["width_max" if key == "max" else "width_current"] = to_int(value.lower().rstrip("x"))
        return True
    if key in ("gpu recovery action",) and value.strip().lower() not in ("none", "n/a"):
        r["recovery"] = value.strip()
        return True
    if key in ("reset required", "drain and reset recommended") and "reset status" in p and yes(value):
        r["recovery"] = "Reset" if key == "reset required" else "Drain and Reset"
        return True
    return False


# ---------------------------------------------------------------------- CSV

_CSV_FIELDS = {
    "remapped_rows.correctable": "remap_corr", "remapped_rows.uncorrectable": "remap_unc",
    "remapped_rows.pending": "remap_pending", "remapped_rows.failure": "remap_failure",
    "ecc.errors.uncorrected.volatile.total": "dbe_volatile", "ecc.errors.corrected.volatile.total": "sbe_volatile",
    "ecc.errors.uncorrected.aggregate.total": "dbe_aggregate", "ecc.errors.corrected.aggregate.total": "sbe_aggregate",
    "retired_pages.pending": "retired_pending", "retired_pages.single_bit_ecc.count": "retired_sbe",
    "retired_pages.sbe": "retired_sbe", "retired_pages.double_bit.count": "retired_dbe", "retired_pages.dbe": "retired_dbe",
}


def _csv(text: str, ctx: Ctx) -> list[FaultEvent]:
    out: list[FaultEvent] = []
    header: list[str] | None = None
    for line in text.splitlines():
        s = line.split("#", 1)[0].strip() if "," in line else ""
        if not s:
            continue
        cells = [c.strip() for c in s.split(",")]
        names = [re.sub(r"\s*\[.*?\]$", "", c).lower() for c in cells]
        if any(n in _CSV_FIELDS or n in ("pci.bus_id", "gpu_uuid", "uuid", "index", "gpu_recovery_action") for n in names) and \
                all(re.fullmatch(r"[a-z_.]+", n) for n in names):
            header = names
            continue
        if header is None or len(cells) != len(header):
            continue
        row = dict(zip(header, cells, strict=False))
        action = row.get("gpu_recovery_action", "").strip()
        if action and action.lower() not in ("none", "n/a", "[n/a]", "not supported", "[not supported]"):
            bdf0 = normalize_bdf(row.get("pci.bus_id"))
            idx0 = to_int(row.get("index")) if "index" in row else None
            sev = _RECOVERY_SEV.get(action.lower(), Severity.DEGRADED)
            out.append(ctx.event("gpu_recovery_action", Component.GPU, sev,
                                 f"GPU {bdf0 or row.get('uuid') or idx0}: recovery action {action}", SRC,
                                 device=Device(index=idx0, pci_bus_id=bdf0, uuid=row.get("uuid") or row.get("gpu_uuid")),
                                 raw=line.strip(), attrs={"recovery_action": action}))
        r: dict[str, Any] = {}
        for name, key in _CSV_FIELDS.items():
            if name in row:
                r[key] = yes(row[name]) if key in ("remap_pending", "remap_failure", "retired_pending") else to_int(row[name])
        if not r:
            continue
        uuid = row.get("gpu_uuid") or row.get("uuid")
        bdf = normalize_bdf(row.get("pci.bus_id"))
        idx = to_int(row.get("index")) if "index" in row else None
        dev = Device(index=idx, pci_bus_id=bdf, uuid=uuid)
        where = f"GPU {bdf or uuid or idx}"
        for kind, sev, msg in judge_memory(r, where):
            out.append(ctx.event(kind, Component.GPU, sev, msg, SRC, device=dev, raw=line.strip(), attrs=r))
    return out
