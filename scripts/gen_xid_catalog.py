#!/usr/bin/env python3
"""Generate the reviewable XID catalog TOML from the corpus TSVs (`--corpus`).

Reads `xid_catalog.tsv` (NVIDIA's XID catalog as data, one XID a row) and `xid_nvlink5_decode.tsv`
(the catalog's 'Xid 144-150 Decode' sheet) and writes `fleetmend/catalog/xid.toml` and
`fleetmend/catalog/nvlink5.toml`. Run once when the catalog changes; the TOML is committed so the
package never needs the corpus at runtime:

    .venv/bin/python scripts/gen_xid_catalog.py [--corpus tests/corpus] [--out fleetmend/catalog]

NVIDIA's fields are transcribed unchanged. Below them each row gets fleetmend's reading, written out
so the row says everything that happens on that XID (`fleetmend.catalog` reads only the TOML):

- `component`: `nvlink` for the NVLink XIDs, else `gpu`.
- `severity`, `drain` from NVIDIA's immediate action and the hardware-versus-application reading:

  ======================================================  ===========  =======
  immediate_action                                        severity     drain
  ======================================================  ===========  =======
  RESET_GPU, RESTART_BM, RESTART_VM, RMA,                 fatal        yes
  WORKFLOW_XID_48 (DBE), WORKFLOW_NVLINK_ERR (XID 74)
  CONTACT_SUPPORT with hw_vs_app starting "hardware"      fatal        yes
  CONTACT_SUPPORT otherwise (driver/system, unused)       degraded     no
  RESTART_APP, WORKFLOW_XID_45, CHECK_MECHANICALS,        degraded     no
  CHECK_UVM, UPDATE_SWFW, NONE (no action assigned yet)
  DRAIN_DIAGNOSE                                          degraded     yes
  IGNORE with hw_vs_app starting "hardware" (63, 92, 121) degraded     no
  IGNORE otherwise (43, 137, ...)                         info         no
  WORKFLOW_NVLINK5_ERR (XID 144-150), XID_154             decoded per event (left out)
  ======================================================  ===========  =======

  Why: operator readings of real kernel logs put restart-the-app faults (XID 13, 31, 45) at degraded,
  a pending row remap (XID 63, IGNORE but hardware) at degraded, and anything needing a GPU reset or
  reboot (XID 79, 95, 119, 120, 48, 74, 149 Fatal) at fatal. Automation drains only when the device is
  untrustworthy until reset/reboot/replacement; an application fault alone never drains.
- `recovery` from the immediate action: RESET_GPU, WORKFLOW_XID_48, WORKFLOW_NVLINK_ERR and a pending
  row remap → RESET_GPU; RESTART_BM/RESTART_VM → RESTART_BM; RMA → RMA; else DRAIN_DIAGNOSE.
- `verify`: NVLink XIDs → DCGM diag (its level 2 runs the NVLink/P2P bandwidth tests); ECC/row-remap
  XIDs → remapped_rows_pending plus DCGM's memory test; XID 79 (fallen off the bus) → PCIe link width;
  each after nvml_reachable and gpu_count. Others: every QUICK check.
- `history` (+ `urgency`, `history_source`) for the XIDs the history rules read (`HISTORY` below).
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# XIDs that describe the NVLink fabric rather than the GPU core (mnemonics per NVIDIA's catalog).
NVLINK_XIDS = {74, 108, 136, 137, 144, 145, 146, 147, 148, 149, 150, 155, 166, 170}

FATAL_ACTIONS = {"RESET_GPU", "RESTART_BM", "RESTART_VM", "RMA", "WORKFLOW_XID_48", "WORKFLOW_NVLINK_ERR"}
DECODED_ACTIONS = {"WORKFLOW_NVLINK5_ERR", "XID_154"}
RECOVERY = {"RESET_GPU": "RESET_GPU", "RESTART_BM": "RESTART_BM", "RESTART_VM": "RESTART_BM", "RMA": "RMA",
            "WORKFLOW_XID_48": "RESET_GPU", "WORKFLOW_NVLINK_ERR": "RESET_GPU"}
GPU_CHECKS = ["nvml_reachable", "gpu_count"]
VERIFY_NVLINK = {74, *range(144, 151)}
VERIFY_MEMORY = {48, 63, 64, 92, 94, 95}
VERIFY_PCIE = {79}

_XID_CATALOG = "NVIDIA Xid catalog (XID 13/31: application faults unless repeated on the same GPU across jobs)"
_MEMORY = "NVIDIA GPU Memory Error Management (row remapping: a pending remap is applied at the next GPU reset)"
HISTORY = {
    13: ("repeats", "now", _XID_CATALOG),
    31: ("repeats", "now", _XID_CATALOG),
    45: ("sympathetic", "now", "NVIDIA Xid catalog: XID 45 is preemptive cleanup after another error"),
    48: ("dbe", "now", _MEMORY + "; a DBE with XID 63/64 is reset to apply the remap"),
    63: ("remap_pending", "when_idle", _MEMORY + "; drain when idle, then reset"),
    64: ("remap_failure", "now", _MEMORY),
}
"""XID → (history rule, urgency, source) for the XIDs the history rules in fleetmend/policy.py read."""
RECOVERY_BY_XID = {63: "RESET_GPU"}
"""A pending row remap is applied by a GPU reset (NVIDIA GPU Memory Error Management)."""


def reading(n: int, action: str, hw_vs_app: str, component: str) -> list[str]:
    """fleetmend's fields for one XID row, as TOML lines (rules in the module docstring)."""
    hardware = hw_vs_app.strip().lower().startswith("hardware")
    lines = []
    if action not in DECODED_ACTIONS:
        if action in FATAL_ACTIONS:
            sev, drain = "fatal", True
        elif action == "CONTACT_SUPPORT":
            sev, drain = ("fatal", True) if hardware else ("degraded", False)
        elif action == "IGNORE":
            sev, drain = ("degraded" if hardware else "info"), False
        elif action == "DRAIN_DIAGNOSE":
            sev, drain = "degraded", True
        else:
            sev, drain = "degraded", False
        lines += [f"severity = {_s(sev)}", f"drain = {'true' if drain else 'false'}"]
    lines.append(f"recovery = {_s(RECOVERY_BY_XID.get(n, RECOVERY.get(action, 'DRAIN_DIAGNOSE')))}")
    if component == "nvlink" and n not in VERIFY_NVLINK:
        verify = GPU_CHECKS + ["dcgm_diag"]
    elif n in VERIFY_NVLINK:
        verify = GPU_CHECKS + ["dcgm_diag"]
    elif n in VERIFY_MEMORY:
        verify = GPU_CHECKS + ["remapped_rows_pending", "dcgm_diag"]
    elif n in VERIFY_PCIE:
        verify = GPU_CHECKS + ["pcie_link_width"]
    else:
        verify = []
    lines.append(f"verify = {json.dumps(verify)}")
    if n in HISTORY:
        rule, urgency, source = HISTORY[n]
        lines.append(f"history = {_s(rule)}")
        if urgency != "now":
            lines.append(f"urgency = {_s(urgency)}")
        lines.append(f"history_source = {_s(source)}")
    return lines


def _s(value: str) -> str:
    """A TOML basic string (JSON string escapes are valid TOML escapes)."""
    return json.dumps(value, ensure_ascii=False)


def _action(value: str) -> str:
    value = value.strip()
    return "NONE" if value.startswith("(none") else value


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))


def gen_xid(src: Path) -> str:
    out = [
        "# NVIDIA XID catalog, generated by scripts/gen_xid_catalog.py from the corpus file xid_catalog.tsv.",
        "# Do not edit by hand: change the generator or override entries in the operator catalog overrides.",
        "# immediate_action: NVIDIA's 'Immediate Action' (\"NONE\" where the catalog assigns none).",
        "# hw_vs_app: hardware-versus-application reading (legacy cause matrix, r555).",
        "# Below NVIDIA's fields, fleetmend's reading of each XID: severity, drain, urgency, recovery, verify,",
        "# history (fleetmend/catalog/__init__.py says what each means; the generator says how they are chosen).",
        "",
    ]
    for row in _rows(src):
        n = int(row["xid"])
        out.append(f"[xid.{n}]")
        out.append(f"mnemonic = {_s(row['mnemonic'])}")
        out.append(f"description = {_s(row['description'])}")
        out.append(f"immediate_action = {_s(_action(row['immediate_action']))}")
        out.append(f"investigatory_action = {_s(row['investigatory_action'].strip())}")
        out.append(f"hw_vs_app = {_s(row['hw_vs_app'])}")
        out.append(f"component = {_s('nvlink' if n in NVLINK_XIDS else 'gpu')}")
        out.append(f"legacy_possible_causes = {_s(row['legacy_possible_causes'])}")
        out.append(f"legacy_name_r555 = {_s(row['legacy_name_r555'])}")
        out.append(f"source = {_s(row['source'])}")
        out.append("# fleetmend's reading (scripts/gen_xid_catalog.py):")
        out.extend(reading(n, _action(row["immediate_action"]), row["hw_vs_app"], "nvlink" if n in NVLINK_XIDS else "gpu"))
        out.append("")
    return "\n".join(out)


def gen_nvlink5(src: Path) -> str:
    out = [
        "# NVLink5 decode rules for XID 144-150, generated by scripts/gen_xid_catalog.py from",
        "# the corpus file xid_nvlink5_decode.tsv (NVIDIA Xid Catalog sheet 'Xid 144-150 Decode').",
        "# intrinfo patterns: 32 characters, most significant bit first, '-' = any bit.",
        "# v1 applies to drivers before R575, v2 to R575 and later.",
        "",
    ]
    for row in _rows(src):
        out.append("[[rule]]")
        out.append(f"xid = {int(row['xid'])}")
        out.append(f"unit = {_s(row['unit'])}")
        out.append(f"intrinfo_pattern_v1 = {_s(row['intrinfo_pattern_v1(<R575)'])}")
        out.append(f"intrinfo_pattern_v2 = {_s(row['intrinfo_pattern_v2(>=R575)'])}")
        out.append(f"error_status = {_s(row['error_status'])}")
        out.append(f"resolution = {_s(_action(row['resolution']))}")
        out.append(f"investigatory = {_s(row['investigatory'])}")
        out.append(f"severity = {_s(row['severity'])}")
        out.append(f"hw_sw = {_s(row['hw_sw'])}")
        out.append(f"local_remote_effect = {_s(row['local_remote_effect'])}")
        out.append(f"source = {_s(row['source'])}")
        out.append("")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=ROOT / "tests" / "corpus")
    ap.add_argument("--out", type=Path, default=ROOT / "fleetmend" / "catalog")
    args = ap.parse_args()
    (args.out / "xid.toml").write_text(gen_xid(args.corpus / "xid_catalog.tsv"), encoding="utf-8")
    (args.out / "nvlink5.toml").write_text(gen_nvlink5(args.corpus / "xid_nvlink5_decode.tsv"), encoding="utf-8")
    print(f"wrote {args.out / 'xid.toml'} and {args.out / 'nvlink5.toml'}")


if __name__ == "__main__":
    main()
