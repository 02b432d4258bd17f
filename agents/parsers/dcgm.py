"""DCGM text → FaultEvents: `dcgmi diag` result tables, `dcgmi health -c` reports, `dcgmi nvlink
--link-status`, and dcgm-exporter Prometheus metrics. The diagnostics responder uses `parse_diag`
for the LONG level's `dcgmi diag` output.

Formats (DCGM 2.x-4.x user guide; dcgm-exporter default counters):
- diag: a `| Name | Result |` table; a result cell is Pass/Fail/Skip/Warn, optionally "Fail - GPU: 0" or
  "Pass - GPUs: 1, 2"; rows named Error/Warning/Info carry messages; long cells are hard-wrapped
  (even mid-word) onto following rows whose first cell is empty. Section rows `|-----  Deployment  ---|`.
- health: `| Overall Health | Warning |`, `| -> 0 | Warning |` (GPU id), `|    -> PCIe system | Warning |`
  followed by wrapped message rows; Failure → fatal, Warning → degraded.
- diag JSON (`dcgmi diag -j`; layouts from DCGM's dcgmi/Diag.cpp and nvvs/include/NvvsJsonStrings.h at v2.4.7,
  v3.3.9 and v4.6.0: 2.x/3.x `"DCGM GPU Diagnostic"`, 4.x `"DCGM Diagnostic"`; `--iterations N` wraps the runs in
  `{"iterations": [...], "Overall Result": ..., "Warning": ...}`): each test result with status Fail (fatal) or Warn
  (degraded) per entity (4.x `entity_group`/`entity_id`, 3.x `gpu_id` (a number in the Deployment tests, a string in
  the plugins), 2.x `gpu_ids`), with its warnings (4.x/3.x `[{"warning": ..., "error_id": ...}]`, 3.x Deployment
  `[{"warnings": ...}]`, 2.x a plain string); a failed 4.x `test_summary` with no failing entity is one event.
- nvlink error counters JSON (`dcgmi nvlink -e -g N -j`; dcgmi/Nvlink.cpp DisplayNvLinkErrorCountsForGpu over
  DcgmiOutputJson, DcgmiOutput.cpp): `{"header": ["NVLINK Error Counts", "GPU N"], "body": {"Link L": {"children":
  {"CRC FLIT Error": {"value": "0"}, ...}}}}` (Hopper and older: CRC FLIT/CRC Data/Replay/Recovery Error per link;
  Blackwell: one `"Error Detail"` section with Malformed Packet, Buffer Overrun, Rx/Rx Remote/Rx General Error,
  Effective Error, Tx Discards, Link Integrity Error, Rx Symbol Error, Symbol BER, Effective BER).
- nvlink link status: `gpuId N:` then one letter per link (U up, D down, X disabled, _ unsupported).
- exporter: `NAME{label="v",...} value`. DCGM_FI_DEV_XID_ERRORS is the *last* XID (0 = none);
  DCGM_FI_DEV_XID_ERRORS_ACTIVE / DCGM_EXP_XID_ERRORS_COUNT carry the XID in label `xid`; ECC, row
  remap, retired page and clock-event counters use the NVML probe's rules.
"""

from __future__ import annotations

import json
import re
from typing import Any

from agents.kmsg.matchers import normalize_bdf
from agents.parsers.common import Ctx, judge_memory, to_int
from fleetmend.events import Component, Device, FaultEvent, Severity, Source
from fleetmend.sweep import lower_is_better

SRC = Source.DCGM
_CELLS = re.compile(r"^\|(.*)\|\s*$")
_GPU_LIST = re.compile(r"GPUs?\s*:\s*([\d,\s]+)")
_GPU_IN_TEXT = re.compile(r"\bGPU\s*(\d+)\b")
_METRIC = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
HEALTH_REPORT = re.compile(r"Health Monitor Report|Overall Health")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def looks_like(text: str) -> bool:
    return bool(re.search(r"DCGM_|dcgmi|(?m:^#\s*Entity\s)|\|\s*Diagnostic\s*\|\s*Result|Health Monitor Report|Overall Health|"
                          r"NvLink Link Status|NVLINK Error Counts|"
                          r"\|\s*(?:Deployment|Hardware|Integration|Stress|Memory|Diagnostic)\b|"
                          r"\|\s*(?:Pass|Fail|Warn|Skip)\b",
                          text))


def parse(text: str, ctx: Ctx) -> list[FaultEvent]:
    health = _health(text, ctx)
    diag = [] if HEALTH_REPORT.search(text) else parse_diag(text, ctx)
    return (diag + health + _nvlink(text, ctx) + _exporter(text, ctx) + _dmon(text, ctx) + _diag_json(text, ctx)
            + _nvlink_json(text, ctx))


def json_documents(text: str) -> list[Any]:
    """Every JSON value that starts at the beginning of a line of `text` (`dcgmi ... -j` run once per GPU and
    pasted together, or one document after a command line); text between documents is skipped."""
    dec = json.JSONDecoder()
    out: list[Any] = []
    pos = 0
    while True:
        i = text.find("{", pos)
        if i < 0:
            break
        if i > 0 and text[i - 1] not in "\n\r" and text[:i].strip():
            line_start = text.rfind("\n", 0, i) + 1
            if text[line_start:i].strip():  # a brace inside a line of prose, not a document
                pos = i + 1
                continue
        try:
            doc, end = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            pos = i + 1
            continue
        out.append(doc)
        pos = end
    if not out:  # one document inside framing (a log prefix before its first brace): the old reading
        start, end = text.find("{"), text.rfind("}")
        if 0 <= start < end:
            try:
                out.append(json.loads(text[start:end + 1]))
            except json.JSONDecodeError:
                pass
    return out


DIAG_NAMES = ("DCGM Diagnostic", "DCGM GPU Diagnostic")
"""NvvsJsonStrings.h NVVS_NAME: 4.x `DCGM Diagnostic`, 2.x-3.x `DCGM GPU Diagnostic`."""


def diag_objects(doc: Any) -> list[dict[str, Any]]:
    """The diagnostic report(s) in one `dcgmi diag -j` document: the `DCGM Diagnostic` object, or, with
    `--iterations N`, the one of every iteration (`{"iterations": [...], "Overall Result": ...}`)."""
    if not isinstance(doc, dict):
        return []
    iterations = doc.get("iterations")
    runs: list[Any] = iterations if isinstance(iterations, list) else [doc]
    out = []
    for run in runs:
        if isinstance(run, dict):
            d = next((run[k] for k in DIAG_NAMES if isinstance(run.get(k), dict)), None)
            if d is not None:
                out.append(d)
    return out


def _warnings(res: dict[str, Any]) -> str:
    """A result's warning text: 4.x/3.x `[{"warning": ...}]`, 3.x Deployment `[{"warnings": ...}]` (dcgmi wrote the
    plural key there), 2.x a plain string."""
    w = res.get("warnings")
    if isinstance(w, str):
        return w
    parts = []
    for item in w if isinstance(w, list) else []:
        if isinstance(item, dict):
            parts.append(str(item.get("warning") or item.get("warnings") or ""))
        elif isinstance(item, str):
            parts.append(item)
    return "; ".join(p for p in parts if p)


_ENTITY_COMPONENT = {"CPU": Component.CPU, "CPU_CORE": Component.CPU, "SWITCH": Component.NVLINK,
                     "LINK": Component.NVLINK, "CONNECTX": Component.IB}


def _result_entity(res: dict[str, Any]) -> tuple[Device, Component | None, str]:
    """(device, component if the entity names one, words for the message) of one result entry."""
    group = str(res.get("entity_group", "GPU")).upper()
    if group in ("GPU", "GPU_I", "GPU_CI"):
        gpu = _entity_gpu(res)
        return Device(index=gpu), None, f" on GPU {gpu}" if gpu is not None else ""
    eid = res.get("entity_id")
    name = f"{res.get('entity_group')} {eid}"
    return Device(name=name), _ENTITY_COMPONENT.get(group), f" on {name}"


def _diag_json(text: str, ctx: Ctx) -> list[FaultEvent]:
    """`dcgmi diag -r N -j` (module docstring): one event per test result that did not pass, per entity:
    `Fail` → dcgm_diag_fail (fatal), `Warn` → dcgm_diag_warning (degraded), with the test's warning text; a
    test whose `test_summary` failed with no failing entity → one event without a device; a `runtime_error` →
    dcgm_diag_fail. Text holding no such JSON object gives nothing."""
    if "Diagnostic\"" not in text or "{" not in text:
        return []
    out: list[FaultEvent] = []
    seen: set[tuple[str, str, str]] = set()
    for doc in json_documents(text):
        for diag in diag_objects(doc):
            if diag.get("runtime_error"):
                msg = str(diag["runtime_error"])[:300]
                out.append(ctx.event("dcgm_diag_fail", Component.GPU, Severity.FATAL, f"dcgmi diag: {msg}", SRC, raw=msg,
                                     attrs={"test": "dcgmi diag"}))
            for cat in diag.get("test_categories") or []:
                if not isinstance(cat, dict):
                    continue
                for test in cat.get("tests") or []:
                    if not isinstance(test, dict):
                        continue
                    name = str(test.get("name", "")) or "dcgmi diag"
                    where = f"{cat.get('category', '')}/{name}".strip("/")
                    results = [r for r in test.get("results") or [] if isinstance(r, dict)]
                    summary = test.get("test_summary")
                    failing = [r for r in results if str(r.get("status", "")).upper() in ("FAIL", "WARN")]
                    if not failing and isinstance(summary, dict) and str(summary.get("status", "")).upper() in ("FAIL", "WARN"):
                        failing = [summary]
                    for res in failing:
                        status = str(res.get("status", "")).upper()
                        dev, comp, on = _result_entity(res) if res is not summary else (Device(), None, "")
                        warn = _warnings(res)
                        key = (where, on, status)
                        if key in seen:
                            continue
                        seen.add(key)
                        fatal = status == "FAIL"
                        out.append(ctx.event("dcgm_diag_fail" if fatal else "dcgm_diag_warning",
                                             comp or component_of(name + " " + warn),
                                             Severity.FATAL if fatal else Severity.DEGRADED,
                                             f"{where}: {status}{on}" + (f": {warn}" if warn else ""), SRC, device=dev,
                                             raw=json.dumps(res)[:2000],
                                             attrs={"test": name, "section": str(cat.get("category", ""))}))
    return out


NVLINK_QUIET_COUNTERS = frozenset({"Rx Symbol Error", "Symbol BER", "Effective BER"})
"""Blackwell counters that are not faults when non-zero: symbol errors are corrected by the link's FEC (a healthy link
counts them) and the BERs are ratios; `Effective Error` (errors FEC could not correct) and the rest are read."""


def _nvlink_json(text: str, ctx: Ctx) -> list[FaultEvent]:
    """`dcgmi nvlink -e -g N -j` (module docstring): any non-zero error counter of a link → nvlink_errors
    (degraded) on GPU N, as `nvidia-smi nvlink -e` is read; `Not Supported` / `Not Specified` values and the
    FEC-corrected Blackwell counters (`NVLINK_QUIET_COUNTERS`) are left out."""
    if "NVLINK Error Counts" not in text:
        return []
    out: list[FaultEvent] = []
    for doc in json_documents(text):
        if not isinstance(doc, dict) or "NVLINK Error Counts" not in (doc.get("header") or []):
            continue
        gpu = next((to_int(h.split()[1]) for h in doc["header"] if isinstance(h, str) and re.fullmatch(r"GPU \d+", h)),
                   None)
        errors: dict[str, int] = {}
        body_any = doc.get("body")
        body: dict[str, Any] = body_any if isinstance(body_any, dict) else {}
        for section, box in body.items():
            children = box.get("children") if isinstance(box, dict) else None
            for counter, cell in (children or {}).items():
                if counter in NVLINK_QUIET_COUNTERS or not isinstance(cell, dict):
                    continue
                n = to_int(cell.get("value"))
                if n:
                    link = re.fullmatch(r"Link (\d+)", section)
                    key = (f"link{link.group(1)}_" if link else "") + _slug(counter)
                    errors[key] = n
        if errors:
            out.append(ctx.event("nvlink_errors", Component.NVLINK, Severity.DEGRADED,
                                 f"GPU {gpu}: NVLink error counters non-zero (dcgmi nvlink -e): "
                                 + ", ".join(f"{k}={v}" for k, v in sorted(errors.items())[:12]), SRC,
                                 device=Device(index=gpu), raw=json.dumps(doc)[:2000],
                                 attrs=dict(errors, text_kind="dcgmi nvlink -e -j")))
    return out


def component_of(name: str) -> Component:
    n = name.lower()
    if "pcie" in n or "pci" in n:
        return Component.PCIE
    if "nvlink" in n or "nvswitch" in n or "fabric" in n:
        return Component.NVLINK
    return Component.GPU


def _rows(text: str) -> list[tuple[str, str]]:
    """Two-column table rows, wrapped continuation rows joined onto their row.

    DCGM hard-wraps a long cell at the column width, even mid-word ("13.3 second" + "s started"); a
    segment that fills the column continues the word unless the next segment starts with a space; a
    shorter segment ended its line (join with a space); a continuation that starts with a result word
    (Pass/Fail/Skip/Warn) is a second result of the same test (join with "; ").
    """
    rows: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        t = line.strip()
        if not t.startswith("|"):
            continue
        body = t[1:-1] if t.endswith("|") and len(t) > 1 else t[1:]  # a last row may lack its closing bar
        parts = body.split("|")
        if len(parts) < 2 or set(body) <= set("-=+| "):
            continue
        name, value = parts[0], "|".join(parts[1:])
        inner = value[1:] if value.startswith(" ") else value
        if not name.strip() and rows:
            rows[-1][1].append(inner)
        else:
            rows.append((name, [inner]))
    width = max((len(seg.strip()) for _, segs in rows for seg in segs), default=0)
    out = []
    for name, segs in rows:
        joined, prev = "", ""
        for seg in segs:
            if not joined:
                joined, prev = seg.strip(), seg
                continue
            full = len(prev.strip()) >= width - 1
            if re.match(r"\s*(?:Pass|Fail|Skip|Warn)\b", seg):
                sep = "; "
            elif not full or seg.startswith(" "):
                sep = " "
            else:
                sep = ""
            joined += sep + seg.strip()
            prev = seg
        out.append((name.strip(), " ".join(joined.split())))
    return out


def parse_diag(text: str, ctx: Ctx) -> list[FaultEvent]:
    """`dcgmi diag -r N` table → one event per failed test (fatal), warning (degraded) and error message.

    Returns [] for a passing run. GPU ids come from "Fail - GPU: 0" or the message ("GPU 3 has ...").
    """
    out: list[FaultEvent] = []
    section = ""
    last_test = ""
    for name, value in _rows(text):
        if re.fullmatch(r"-+\s*[\w /]+?\s*-*", name) or (name.startswith("-") and "-" in value[:3]):
            section = name.strip("- ")
            continue
        if name in ("Error", "Warning", "Info"):
            if name == "Info" or not value:
                continue
            gpus = [int(g) for g in _GPU_IN_TEXT.findall(value)[:1]]
            idx = gpus[0] if gpus else None
            where = last_test or section or "dcgmi diag"
            fatal = name == "Error"
            out.append(ctx.event("dcgm_diag_fail" if fatal else "dcgm_diag_warning", component_of(where + " " + value),
                                 Severity.FATAL if fatal else Severity.DEGRADED, f"{where}: {value}", SRC,
                                 device=Device(index=idx), raw=f"{name}: {value}",
                                 attrs={"test": where, "section": section}))
            continue
        if name in ("Diagnostic", "Metadata Fields", "") or not value:
            continue
        last_test = name
        for part in re.split(r"(?=\b(?:Pass|Fail|Skip|Warn)\b)", value):
            p = part.strip()
            if not re.match(r"(?:fail|warn)\b", p.lower()):
                continue
            gl = _GPU_LIST.search(p)
            ids: list[int | None] = [int(x) for x in re.findall(r"\d+", gl.group(1))] if gl else [None]
            fatal = p.lower().startswith("fail")
            for idx in ids:
                out.append(ctx.event("dcgm_diag_fail" if fatal else "dcgm_diag_warning", component_of(name),
                                     Severity.FATAL if fatal else Severity.DEGRADED,
                                     f"dcgmi diag {name}: {p}" + (f" (GPU {idx})" if idx is not None else ""), SRC,
                                     device=Device(index=idx), raw=f"{name}: {value}",
                                     attrs={"test": name, "section": section}))
    return out


def _health(text: str, ctx: Ctx) -> list[FaultEvent]:
    if not HEALTH_REPORT.search(text):
        return []
    out: list[FaultEvent] = []
    gpu: int | None = None
    for name, value in _rows(text):
        n = name.strip()
        m = re.fullmatch(r"->\s*(?:GPU\s*)?(\d+)", n)
        if m:
            gpu = int(m.group(1))
            continue
        m = re.fullmatch(r"->\s*(.+)", n)
        if not m or m.group(1).lower() == "errors":
            continue
        system = m.group(1).strip()
        state = value.split()[0].lower() if value else ""
        if state not in ("warning", "failure", "fail"):
            continue
        fatal = state.startswith("fail")
        detail = value[len(value.split()[0]):].strip()
        idx = gpu
        if idx is None and (g := _GPU_IN_TEXT.search(detail)):
            idx = int(g.group(1))
        out.append(ctx.event("dcgm_health_failure" if fatal else "dcgm_health_warning", component_of(system),
                             Severity.FATAL if fatal else Severity.DEGRADED,
                             f"dcgmi health {system}: {value}", SRC, device=Device(index=idx), raw=f"{n}: {value}",
                             attrs={"health_system": system}))
    return out


def _nvlink(text: str, ctx: Ctx) -> list[FaultEvent]:
    if "Link Status" not in text and "gpuId" not in text:
        return []
    out: list[FaultEvent] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^\s*gpuId\s+(\d+)\s*:\s*$", line)
        if not m or i + 1 >= len(lines):
            continue
        states = lines[i + 1].split()
        if not states or not all(s in ("U", "D", "X", "_") for s in states):
            continue
        down = [k for k, s in enumerate(states) if s == "D"]
        if down:
            idx = int(m.group(1))
            out.append(ctx.event("nvlink_down", Component.NVLINK, Severity.DEGRADED,
                                 f"GPU {idx}: {len(down)} of {len(states)} NVLinks down (links {down})", SRC,
                                 device=Device(index=idx), raw=f"{line.strip()} {lines[i + 1].strip()}",
                                 attrs={"links_down": len(down), "links": len(states)}))
    return out


_EXPORTER_MEMORY = {
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": "dbe_volatile", "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": "sbe_volatile",
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": "dbe_aggregate", "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL": "sbe_aggregate",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": "remap_failure", "DCGM_FI_DEV_ROW_REMAP_PENDING": "remap_pending",
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": "remap_unc", "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": "remap_corr",
    "DCGM_FI_DEV_RETIRED_PENDING": "retired_pending", "DCGM_FI_DEV_RETIRED_SBE": "retired_sbe",
    "DCGM_FI_DEV_RETIRED_DBE": "retired_dbe",
}
_BOOL = {"remap_failure", "remap_pending", "retired_pending"}
_CLOCK_BITS = {0x8: "clocks_hw_slowdown", 0x20: "clocks_thermal_slowdown", 0x40: "clocks_thermal_slowdown",
               0x80: "clocks_power_brake"}


def _exporter(text: str, ctx: Ctx) -> list[FaultEvent]:
    if "DCGM_" not in text:
        return []
    out: list[FaultEvent] = []
    per_gpu: dict[tuple[Any, ...], tuple[Device, dict[str, Any], list[str]]] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = _METRIC.match(line.strip())
        if not m or not m.group(1).startswith("DCGM_"):
            continue
        name, labels = m.group(1), dict(_LABEL.findall(m.group(2) or ""))
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        dev = Device(index=to_int(labels.get("gpu")), uuid=labels.get("UUID") or labels.get("uuid"),
                     pci_bus_id=normalize_bdf(labels.get("pci_bus_id")))
        where = f"GPU {dev.index if dev.index is not None else dev.uuid}"
        if name == "DCGM_FI_DEV_XID_ERRORS":
            # dcgm-exporter >= 3.3 labels the last XID `err_code` (and `err_msg`); the sample value is the XID
            # too, or a timestamp in some versions, so the label wins when present.
            code = to_int(labels["err_code"]) if "err_code" in labels else (int(value) if value < 1000 else None)
            if code:
                attrs = {"metric": name}
                if labels.get("err_msg"):
                    attrs["err_msg"] = labels["err_msg"][:256]
                out.append(ctx.xid(code, SRC, f"{where}: dcgm-exporter last XID {code}"
                                   + (f" ({labels['err_msg']})" if labels.get("err_msg") else ""), device=dev,
                                   raw=line.strip(), attrs=attrs))
            continue
        if "XID" in name and "xid" in labels:
            xid = to_int(labels["xid"])
            if xid is not None and value > 0:
                out.append(ctx.xid(xid, SRC, f"{where}: XID {xid} seen {int(value)} time(s) in the window ({name})",
                                   device=dev, raw=line.strip(), attrs={"metric": name, "count": int(value)}))
            continue
        if name in ("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"):
            for bit, kind in _CLOCK_BITS.items():
                if int(value) & bit:
                    out.append(ctx.event(kind, Component.GPU, Severity.DEGRADED, f"{where}: clocks slowed ({kind})",
                                         SRC, device=dev, raw=line.strip()))
            continue
        key = _EXPORTER_MEMORY.get(name)
        if key is not None:
            slot = per_gpu.setdefault((dev.index, dev.uuid, dev.pci_bus_id), (dev, {}, []))
            slot[1][key] = bool(value) if key in _BOOL else int(value)
            slot[2].append(line.strip())
    for dev, r, lines in per_gpu.values():
        where = f"GPU {dev.index if dev.index is not None else dev.uuid}"
        for kind, sev, msg in judge_memory(r, where):
            out.append(ctx.event(kind, Component.GPU, sev, msg, SRC, device=dev, raw="\n".join(lines), attrs=r))
    return out


# ---------------------------------------------------------------------- dcgmi dmon

_DMON_HEAD = re.compile(r"^#\s*Entity\s+(.*\S)\s*$")
_DMON_ROW = re.compile(r"^\s*(GPU|GPU-I|GPU-CI|NvSwitch|Switch)\s+(\d+)\s+(.*\S)\s*$")
_DMON_CMD = re.compile(r"dmon\b.*?-e\s+([\d,]+)")
_DMON_FIELDS = {230: "xid", 310: "sbe_volatile", 311: "dbe_volatile", 312: "sbe_aggregate", 313: "dbe_aggregate",
                390: "retired_sbe", 391: "retired_dbe", 392: "retired_pending", 393: "remap_unc",
                394: "remap_corr", 395: "remap_failure", 396: "remap_pending"}
"""dcgm_fields.h field ids read from `dcgmi dmon -e ...` (230 DCGM_FI_DEV_XID_ERRORS = the last XID, 0 none;
310-313 ECC SBE/DBE volatile/aggregate totals; 390-392 retired pages; 393-396 row remapping)."""


def _dmon(text: str, ctx: Ctx) -> list[FaultEvent]:
    """`dcgmi dmon -e F1,F2,... [-c N]`: a `#Entity  TAG1  TAG2` header, an `ID` line, then rows
    `GPU 0  v1  v2` (`N/A` for blank values). Columns are named by the field ids on the command line when
    the text has it, else by tag (a tag containing `XID` is field 230). Non-zero XID → that XID's event;
    the ECC/retirement/remap columns go through the NVML probe's memory rules."""
    if "Entity" not in text:
        return []
    cmd = _DMON_CMD.search(text)
    ids = [int(x) for x in cmd.group(1).split(",") if x] if cmd else []
    out: list[FaultEvent] = []
    tags: list[str] | None = None
    seen: set[tuple[int, int]] = set()
    for line in text.splitlines():
        h = _DMON_HEAD.match(line.strip())
        if h:
            tags = h.group(1).split()
            continue
        m = _DMON_ROW.match(line)
        if not m or tags is None:
            continue
        vals = m.group(3).split()
        idx = int(m.group(2))
        dev = Device(index=idx) if m.group(1) == "GPU" else Device(name=f"{m.group(1)} {idx}")
        r: dict[str, Any] = {}
        for i, v in enumerate(vals[: len(tags)]):
            fid = ids[i] if len(ids) == len(tags) else (230 if "XID" in tags[i].upper() else None)
            key = _DMON_FIELDS.get(fid) if fid is not None else None
            n = to_int(v)
            if key is None or n is None:
                continue
            if key == "xid":
                if n > 0 and (idx, n) not in seen:
                    seen.add((idx, n))
                    out.append(ctx.xid(n, SRC, f"GPU {idx}: dcgmi dmon field 230 (last XID) = {n}", device=dev,
                                       raw=line.strip(), attrs={"field_id": 230, "text_kind": "dcgmi dmon"}))
                continue
            r[key] = bool(n) if key in _BOOL else n
        for kind, sev, msg in judge_memory(r, f"GPU {idx}") if r else []:
            out.append(ctx.event(kind, Component.GPU, sev, msg, SRC, device=dev, raw=line.strip(), attrs=r))
    return out


# ---------------------------------------------------------------- dcgmi diag -j: performance numbers

_INFO_GPU = re.compile(r"^\s*GPU\s+(\d+)\s+")
_INFO_GFLOPS = re.compile(r"approximately\s+(-?\d+(?:\.\d+)?)\s+gigaflops", re.I)
_INFO_VALUE = re.compile(r"([A-Za-z][A-Za-z0-9 /_-]*?)\s*(?::\s*|\t+)(-?\d+(?:\.\d+)?)\s*(GB/s|us|ms|W|C)?(?![\w.])")
_UNIT_SUFFIX = {"GB/s": "gbps", "us": "us", "ms": "ms", "W": "w"}


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


def _info_values(msg: str) -> tuple[int | None, list[tuple[str, float]]]:
    """One info line → (GPU id it names, [(name, value)]). Shapes (nvvs plugins): "GPU 0 GPU to Host
    bandwidth:\\t\\t13.08 GB/s", "GPU 0 bidirectional latency:\\t\\t7.482 us", "GPU 1 relative stress
    level:\\t577" (3.x; 4.x drops the colon), "GPU 0 max power: 700.0 W average power usage: 690.2 W",
    "GPU 0 calculated at approximately 5123.45 gigaflops during this test". Temperatures ("temperature
    average:\t31 C") are left out: not a performance number."""
    m = _INFO_GPU.match(msg)
    gpu = int(m.group(1)) if m else None
    body = msg[m.end():] if m else msg
    if g := _INFO_GFLOPS.search(body):
        return gpu, [("gflops", float(g.group(1)))]
    out = []
    for label, num, unit in _INFO_VALUE.findall(body):
        name = _slug(label)
        if not name or unit == "C":  # temperatures: no performance number (the load step reads them)
            continue
        out.append((name + (f"_{_UNIT_SUFFIX[unit]}" if unit else ""), float(num)))
    return gpu, out


def _entity_gpu(res: dict[str, Any]) -> int | None:
    if str(res.get("entity_group", "GPU")).upper() == "GPU" and isinstance(res.get("entity_id"), int):
        return int(res["entity_id"])
    ids = str(res.get("gpu_ids", res.get("gpu_id", ""))).split(",")
    return int(ids[0]) if len(ids) == 1 and ids[0].strip().isdigit() else None


def diag_json_metrics(text: str) -> tuple[dict[str, float], dict[str, str]]:
    """`dcgmi diag -r <tests> -j` (DCGM 3.x `"DCGM GPU Diagnostic"` with `gpu_ids`, 4.x `"DCGM
    Diagnostic"` with `entity_group`/`entity_id`; NvvsJsonStrings.h) → (metrics, problems).

    metrics: the numbers the tests print in their `info` lines, one per test and quantity, named
    `dcgm_<test>_<quantity>[_gbps|_us|_ms|_w]` (e.g. `dcgm_pcie_host_to_gpu_bandwidth_gbps`,
    `dcgm_pcie_bidirectional_latency_us`, `dcgm_diagnostic_gflops`,
    `dcgm_targeted_power_average_power_usage_w`), reduced over the GPUs to the worst one: the
    minimum, or the maximum for names `fleetmend.sweep.lower_is_better` reads as lower-is-better.
    problems: `dcgm_<test>` → what DCGM said for a test that did not pass on some GPU (FAIL, SKIP,
    WARN with its warning text), `dcgm` → a `runtime_error`.

    Raises:
        ValueError: no JSON object in `text`, or not a DCGM diagnostic report.
    """
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start:
        raise ValueError(f"no JSON object in dcgmi output: {text[-300:]!r}")
    try:
        doc = json.loads(text[start:end + 1])
    except json.JSONDecodeError as err:
        raise ValueError(f"dcgmi output is not valid JSON: {err}") from err
    diags = diag_objects(doc)
    if not diags:
        raise ValueError("JSON without a 'DCGM Diagnostic' object (not `dcgmi diag -j` output?)")
    per: dict[str, list[float]] = {}
    problems: dict[str, str] = {}
    for diag in diags:
        _diag_metrics(diag, per, problems)
    metrics = {k: (max(v) if lower_is_better(k) else min(v)) for k, v in per.items()}
    return metrics, problems


def _diag_metrics(diag: dict[str, Any], per: dict[str, list[float]], problems: dict[str, str]) -> None:
    if diag.get("runtime_error"):
        problems["dcgm"] = str(diag["runtime_error"])[:300]
    for cat in diag.get("test_categories") or []:
        for test in (cat.get("tests") or [] if isinstance(cat, dict) else []):
            if not isinstance(test, dict):
                continue
            tname = _slug(str(test.get("name", "")))
            if not tname:
                continue
            for res in test.get("results") or []:
                if not isinstance(res, dict):
                    continue
                status = str(res.get("status", "")).upper()
                gpu = _entity_gpu(res)
                if status not in ("PASS", "NOT_RUN", "NOT RUN", ""):
                    warn = _warnings(res)
                    note = f"{status}" + (f" on GPU {gpu}" if gpu is not None else "") + (f": {warn}" if warn else "")
                    key = f"dcgm_{tname}"
                    problems[key] = (problems[key] + "; " + note)[:500] if key in problems else note[:500]
                info = res.get("info") or []
                for msg in [info] if isinstance(info, str) else info:
                    _gpu, values = _info_values(str(msg))
                    for name, v in values:
                        per.setdefault(f"dcgm_{tname}_{name}", []).append(v)
