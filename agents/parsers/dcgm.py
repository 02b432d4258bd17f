"""DCGM text → FaultEvents: `dcgmi diag` result tables, `dcgmi health -c` reports, `dcgmi nvlink
--link-status`, and dcgm-exporter Prometheus metrics. The diagnostics responder uses `parse_diag`
for the LONG level's `dcgmi diag` output.

Formats (DCGM 2.x-4.x user guide; dcgm-exporter default counters):
- diag: a `| Name | Result |` table; a result cell is Pass/Fail/Skip/Warn, optionally "Fail - GPU: 0" or
  "Pass - GPUs: 1, 2"; rows named Error/Warning/Info carry messages; long cells are hard-wrapped
  (even mid-word) onto following rows whose first cell is empty. Section rows `|-----  Deployment  ---|`.
- health: `| Overall Health | Warning |`, `| -> 0 | Warning |` (GPU id), `|    -> PCIe system | Warning |`
  followed by wrapped message rows; Failure → fatal, Warning → degraded.
- diag JSON (`dcgmi diag -j`, 3.x "DCGM GPU Diagnostic" / 4.x "DCGM Diagnostic"): each test result with status
  Fail (fatal) or Warn (degraded) per GPU (`entity_id` / `gpu_id`), with its warnings.
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
                          r"NvLink Link Status|\|\s*(?:Deployment|Hardware|Integration|Stress|Memory|Diagnostic)\b|"
                          r"\|\s*(?:Pass|Fail|Warn|Skip)\b",
                          text))


def parse(text: str, ctx: Ctx) -> list[FaultEvent]:
    health = _health(text, ctx)
    diag = [] if HEALTH_REPORT.search(text) else parse_diag(text, ctx)
    return diag + health + _nvlink(text, ctx) + _exporter(text, ctx) + _dmon(text, ctx) + _diag_json(text, ctx)


def _diag_json(text: str, ctx: Ctx) -> list[FaultEvent]:
    """`dcgmi diag -r N -j` (DCGM 3.x `"DCGM GPU Diagnostic"`, 4.x `"DCGM Diagnostic"`; NvvsJsonStrings.h):
    one event per test result that did not pass, per GPU: `Fail` → dcgm_diag_fail (fatal), `Warn` →
    dcgm_diag_warning (degraded), with the test's warning text; a `runtime_error` → dcgm_diag_fail. Text
    that is not such a JSON object gives nothing."""
    if "Diagnostic\"" not in text or "{" not in text:
        return []
    start, end = text.find("{"), text.rfind("}")
    try:
        doc = json.loads(text[start:end + 1])
    except json.JSONDecodeError:
        return []
    diag = (doc.get("DCGM Diagnostic") or doc.get("DCGM GPU Diagnostic")) if isinstance(doc, dict) else None
    if not isinstance(diag, dict):
        return []
    out: list[FaultEvent] = []
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
            for res in test.get("results") or []:
                if not isinstance(res, dict):
                    continue
                status = str(res.get("status", "")).upper()
                if status not in ("FAIL", "WARN"):
                    continue
                gpu = _entity_gpu(res)
                warn = "; ".join(str(w.get("warning", "")) for w in res.get("warnings") or [] if isinstance(w, dict))
                fatal = status == "FAIL"
                where = f"{cat.get('category', '')}/{name}".strip("/")
                out.append(ctx.event("dcgm_diag_fail" if fatal else "dcgm_diag_warning", component_of(name + " " + warn),
                                     Severity.FATAL if fatal else Severity.DEGRADED,
                                     f"{where}: {status}" + (f" on GPU {gpu}" if gpu is not None else "")
                                     + (f": {warn}" if warn else ""), SRC, device=Device(index=gpu),
                                     raw=json.dumps(res)[:2000], attrs={"test": name, "section": str(cat.get("category", ""))}))
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
    diag = doc.get("DCGM Diagnostic") or doc.get("DCGM GPU Diagnostic") if isinstance(doc, dict) else None
    if not isinstance(diag, dict):
        raise ValueError("JSON without a 'DCGM Diagnostic' object (not `dcgmi diag -j` output?)")
    per: dict[str, list[float]] = {}
    problems: dict[str, str] = {}
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
                if status not in ("PASS", "NOT_RUN", ""):
                    warn = "; ".join(str(w.get("warning", "")) for w in res.get("warnings") or []
                                     if isinstance(w, dict))
                    note = f"{status}" + (f" on GPU {gpu}" if gpu is not None else "") + (f": {warn}" if warn else "")
                    key = f"dcgm_{tname}"
                    problems[key] = (problems[key] + "; " + note)[:500] if key in problems else note[:500]
                info = res.get("info") or []
                for msg in [info] if isinstance(info, str) else info:
                    _gpu, values = _info_values(str(msg))
                    for name, v in values:
                        per.setdefault(f"dcgm_{tname}_{name}", []).append(v)
    metrics = {k: (max(v) if lower_is_better(k) else min(v)) for k, v in per.items()}
    return metrics, problems
