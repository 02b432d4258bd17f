"""A runbook per fault class, generated from the catalog data (`fleetmend/catalog/*.toml`).

Each runbook says what the fault means (the catalog's description, NVIDIA's mnemonic and
hardware-versus-application reading, possible causes), what fleetmend does about it (severity,
drain, debounce, escalation, the recovery the immediate action selects, the verification before
return) and what a human checks (the investigatory action, the commands). The same text is
`fleetmend runbook CLASS`, `docs/runbooks/<class>.md` (regenerated with
`python -m fleetmend.catalog.runbooks docs/runbooks`, checked up to date by the tests) and is referenced from
tickets, notifications and `fleetmend show`.

Fault classes: `xid<N>` for every XID of the catalog and every non-XID kind that is not a clearing
event: every class `Catalog.classify` gives a catalog row, so every pointer `runbook_ref` makes for one
opens. XIDs NVIDIA's Ampere+ catalog marks "Unused" are included: a driver for an older GPU still
prints them, and fleetmend classifies them (some drain); their page says what the older documentation
calls them. Imports only the catalog.
"""

from __future__ import annotations

import re
import sys
from functools import lru_cache
from pathlib import Path

from fleetmend.catalog import Action, Catalog, KindEntry, XidEntry, default_catalog
from fleetmend.catalog.gen_xid import Reading, load_reading

RUNBOOK_DIR = "docs/runbooks"

ACTION_TEXT: dict[str, str] = {
    "IGNORE": "Nothing to do for the device; the fault is recorded.",
    "RESTART_APP": "The application is at fault: restart it. The GPU is not suspect unless the fault repeats on "
                   "the same GPU (history rule: `policy.app_xid_repeats` within `policy.app_xid_window_s`).",
    "RESET_GPU": "Reset the GPU (`nvidia-smi -r`, only when no process holds it), then reboot if configured; "
                 "what does not hold becomes a ticket.",
    "RESTART_BM": "Reboot the node (bare metal); what does not hold becomes a ticket.",
    "RESTART_VM": "Restart the VM; what does not hold becomes a ticket.",
    "DRAIN_DIAGNOSE": "Drain and run diagnostics; the result goes into a ticket.",
    "RMA": "Hardware replacement: no automatic recovery, an RMA ticket with the evidence at once.",
    "CONTACT_SUPPORT": "Contact the vendor's support with the evidence.",
    "CHECK_MECHANICALS": "Check cooling, power and seating (mechanicals) of the device.",
    "CHECK_UVM": "Check the unified-memory (UVM) driver and its configuration.",
    "UPDATE_SWFW": "Update the driver or firmware to a fixed version.",
    "WORKFLOW_NVLINK_ERR": "NVLink error workflow: drain, reset the GPU, verify the links with DCGM diagnostics.",
    "WORKFLOW_NVLINK5_ERR": "NVLink5 (XID 144-150): the decoded intrinfo rule says fatal (drain, reset) or "
                            "non-fatal (record).",
    "WORKFLOW_XID_45": "XID 45 follows other faults (a channel torn down): ignored next to another XID, else "
                       "treated as an application fault.",
    "WORKFLOW_XID_48": "Double-bit ECC error: drain, reset the GPU (row remapping takes effect), verify memory; "
                       "with XID 63/64 the remap is pending.",
    "XID_154": "The driver changed its recovery action: the printed action decides (Reset/Reboot drains).",
    "XID_154_EVAL": "Evaluate the driver's recovery action printed with the event.",
    "NONE": "The catalog assigns no action yet: recorded for review.",
    "DIAGNOSE_IN_SERVICE": "Diagnose while the node keeps its jobs: no drain; the incident records the fault "
                           "and its repeats.",
    "RESET_GPU_WHEN_IDLE": "Reset the GPU when no job holds it (the pending remap or retirement is applied on "
                           "reset): no drain.",
}


def fault_classes(catalog: Catalog | None = None) -> dict[str, XidEntry | KindEntry]:
    """fault class → catalog entry, sorted (XIDs by number, then kinds by name)."""
    cat = catalog or default_catalog()
    out: dict[str, XidEntry | KindEntry] = {}
    for n in sorted(cat.xids):
        out[f"xid{n}"] = cat.xids[n]
    for name in sorted(cat.kinds):
        k = cat.kinds[name]
        if not k.healthy:
            out[name] = k
    return out


def runbook_ref(fault_class: str) -> str:
    """How a ticket, a notification or `fleetmend show` points at the runbook (plain text)."""
    return f"fleetmend runbook {fault_class} ({RUNBOOK_DIR}/{fault_class}.md)"


def _unused(e: XidEntry) -> bool:
    """NVIDIA's Ampere+ catalog describes the XID as "Unused" (no current driver documents it)."""
    return e.description.strip().rstrip(".").lower() == "unused"


@lru_cache(maxsize=1)
def _reading() -> Reading:
    return load_reading()


def _why(e: XidEntry) -> str | None:
    """The reason of the `xid_reading.toml` severity rule that gave the row its severity and drain, when
    the row still reads as that rule says (an operator's override may not)."""
    hardware = e.hw_vs_app.strip().lower().startswith("hardware")
    for rule in _reading().severity:
        if rule.fits(e.xid, e.immediate_action.value, hardware, e.component):
            if rule.decoded or (rule.severity, rule.drain) != (e.severity, e.drain):
                return None
            return f"{rule.reason} (`fleetmend/catalog/xid_reading.toml` rule `{rule.name}`)"
    return None


def _action(a: Action | str) -> str:
    key = getattr(a, "value", a)
    return f"`{key}`: {ACTION_TEXT.get(key, 'see the catalog source.')}"


def render(fault_class: str, catalog: Catalog | None = None) -> str:
    """The runbook of `fault_class` as markdown.

    Raises:
        KeyError: not a fault class of the catalog (the message lists how to find them).
    """
    cat = catalog or default_catalog()
    classes = fault_classes(cat)
    if fault_class not in classes:
        m = re.fullmatch(r"xid(\d+)", fault_class)
        if m and cat.xids:
            raise KeyError(f"XID {int(m.group(1))} is not in the catalog (it describes XIDs {min(cat.xids)} to "
                           f"{max(cat.xids)}): fleetmend reads an XID it does not know as degraded, contact "
                           f"support, no drain; `fleetmend runbook --list` lists the fault classes")
        raise KeyError(f"no fault class {fault_class!r} in the catalog (xid<N> or a kind name; "
                       f"`fleetmend runbook --list` lists them)")
    e = classes[fault_class]
    lines: list[str] = []
    if isinstance(e, XidEntry):
        sev, drain = e.base_severity, bool(e.drain)
        component = e.component.value
        lines += [f"# XID {e.xid} — {e.mnemonic} (`{fault_class}`)", "", "## What it means", ""]
        if _unused(e):
            lines += [f"Unused: NVIDIA's XID catalog for Ampere and later GPUs lists XID {e.xid} as unused, so a "
                      "current driver on such a GPU is not documented to print it; seen on a node, it most likely "
                      "comes from an older GPU or driver"
                      + (f". NVIDIA's r555 documentation calls it: {e.legacy_name_r555.rstrip('.')}."
                         if e.legacy_name_r555 else " (no older documentation names it).")]
        else:
            lines.append(e.description.rstrip(".") + ".")
        lines += ["", f"- reading: {e.hw_vs_app}", f"- component: {component}"]
        if e.legacy_name_r555 and e.legacy_name_r555 != e.description and not _unused(e):
            lines.append(f"- older driver documentation (r555): {e.legacy_name_r555}")
        if e.legacy_possible_causes:
            lines.append(f"- possible causes: {e.legacy_possible_causes.replace(',', ', ')}")
        clearable = None
        escalation = None
    else:
        sev, drain = e.severity, e.drain
        component = e.component.value
        lines += [f"# {e.name} (`{fault_class}`)", "", "## What it means", "", e.description.rstrip(".") + ".",
                  "", f"- component: {component}"]
        clearable = None if e.cleared_by.startswith("none:") else e.cleared_by
        escalation = (f"{e.escalate_count} within {e.escalate_window_s:g} s on one device become "
                      f"`{e.escalate_to}` ({e.escalate_reason})" if e.escalate_to else None)
        if e.follows_recovery_action:
            lines.append("- severity and drain follow the recovery action the driver prints")
    lines += ["", "## What fleetmend does", "",
              f"- severity **{sev.value}**; " + ("**drains the node** (within the cluster's blast-radius budget, "
                                                 "FleetGuard)" if drain else "does **not** drain the node"),
              f"- immediate action {_action(e.immediate_action)}"]
    why = _why(e) if isinstance(e, XidEntry) else None
    if why:
        lines.append(f"- why: {why}")
    if clearable:
        lines.append(f"- cleared by `{clearable}`: waits `policy.debounce_s` first and drains nothing if it clears")
    elif not isinstance(e, XidEntry):
        lines.append(f"- no clearing event ({e.cleared_by.removeprefix('none:').strip()})")
    if escalation:
        lines.append(f"- escalates: {escalation}")
    if drain:
        checks = e.verify
        lines += ["- then: diagnostics through the node's agent, the recovery above when the catalog names one, a "
                  "ticket with the evidence (raw kernel lines, classification, diagnostics) for what does not hold",
                  "- before return to service it verifies with: "
                  + (", ".join(f"`{c}`" for c in checks) if checks else "every quick check of the agent"),
                  "- the same fault back after `policy.lemon_repairs` repairs within `policy.lemon_window_s` makes "
                  "the node a lemon: straight to an RMA ticket"]
    inv = e.investigatory_action
    lines += ["", "## What a human checks", ""]
    if inv and inv.strip() not in ("(none)", "NONE", ""):
        lines.append(f"- investigatory action: {inv.replace('_', ' ') if inv.isupper() else inv}")
    lines += ["- `fleetmend status NODE`: the incident's timeline, the raw lines and what fired",
              "- `fleetmend history NODE`: has this node had this before (a repeat is evidence for the vendor)",
              "- after the repair: `fleetmend repaired NODE --ticket ID`; fleetmend verifies before the node returns",
              "- a false alarm: `fleetmend abort NODE --undrain --note '…'`",
              "", "## Source", "", e.source, ""]
    return "\n".join(lines)


def write_all(directory: Path, catalog: Catalog | None = None) -> list[Path]:
    """Write every runbook and an index `README.md` under `directory`. Returns the files written."""
    classes = fault_classes(catalog)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for fc in classes:
        p = directory / f"{fc}.md"
        p.write_text(render(fc, catalog))
        written.append(p)
    idx = directory / "README.md"
    idx.write_text(index(catalog))
    return written + [idx]


SCOPE = (
    "What is read: NVIDIA GPUs (XIDs, NVRM messages without an Xid, NVSwitch SXids and the fabric manager's log), "
    "AMD GPUs' `amdgpu` ring timeouts, failed resets and RAS uncorrectable errors (vendor-neutral kinds "
    "`gpu_ring_timeout`, `gpu_reset_failed`, `gpu_ras_uncorrectable`), ConnectX and AWS EFA devices, NICs, "
    "bonding, NVMe, block devices, filesystems, md RAID, NFS clients, PCIe AER, machine checks, EDAC and the "
    "kernel's own crashes and limits. Every format string read, with its source and version, is in "
    "`fleetmend/catalog/source/formats.tsv`. Out of scope: AWS Neuron and other accelerators (Intel Gaudi), and "
    "AMD GPU messages other than the three above; their lines produce no event."
)
"""The scope paragraph of the runbook index (issue 29 point 4: say plainly what is not read)."""


UNLISTED = (
    "Every XID of NVIDIA's catalog has a page, those the Ampere+ catalog marks unused included (an older GPU's "
    "driver still prints them; the page gives the older documentation's name). An XID beyond the catalog (a "
    "newer driver's) is read as degraded, contact support, no drain, with no page: `fleetmend runbook xidN` says so."
)
"""The runbook index's paragraph on XIDs (issue F16: every catalog XID has a page)."""


def index(catalog: Catalog | None = None) -> str:
    rows = ["# Runbooks", "", "One per fault class, generated from the catalog (`python -m fleetmend.catalog.runbooks "
            f"{RUNBOOK_DIR}`; a test checks they are up to date). `fleetmend runbook CLASS` prints one.", "",
            SCOPE, "", UNLISTED, "",
            "| fault class | severity | drains | immediate action |", "|---|---|---|---|"]
    for fc, e in fault_classes(catalog).items():
        sev, drain = (e.base_severity, bool(e.drain)) if isinstance(e, XidEntry) else (e.severity, e.drain)
        rows.append(f"| [{fc}]({fc}.md) | {sev.value} | {'yes' if drain else 'no'} | "
                    f"{getattr(e.immediate_action, 'value', e.immediate_action)} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # pragma: no cover - the generator
    target = Path(sys.argv[1] if len(sys.argv) > 1 else RUNBOOK_DIR)
    print(f"{len(write_all(target))} files written under {target}")
