"""Shared pieces of the text parsers: event construction and the GPU-memory judgement used by the
nvidia-smi (`-q`, CSV) and dcgm-exporter readers (the same rules as the NVML probe)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fleetmend import __version__
from fleetmend.catalog import Catalog, default_catalog
from fleetmend.events import Component, Device, FaultEvent, Severity, Source


@dataclass
class Ctx:
    """Who the events are stamped for."""

    cluster: str = "local"
    node: str = "local"
    agent_version: str = __version__
    catalog: Catalog = field(default_factory=default_catalog)

    def event(self, kind: str, component: Component, severity: Severity, message: str, source: Source, *,
              device: Device | None = None, code: int | None = None, raw: str = "", pid: int | None = None,
              attrs: dict[str, Any] | None = None, healthy: bool = False) -> FaultEvent:
        """One classified event. `healthy`: a clearing event; `kind` names the clearing kind
        (`nic_link_up`) and the event travels under the kind it clears (`nic_link_down`, attrs
        `clearing_kind`), as the kernel-log parser emits them."""
        clean = {k: v for k, v in (attrs or {}).items() if v is None or isinstance(v, (str, int, float, bool))}
        message = " ".join(message.split())[:4000]
        if healthy:
            entry = self.catalog.kinds.get(kind)
            if entry is not None and entry.clears:
                clean["clearing_kind"], kind = kind, entry.clears[0]
            severity = Severity.INFO
        return self.catalog.stamp(FaultEvent(
            cluster=self.cluster, node=self.node, component=component, device=device or Device(), kind=kind,
            code=code, severity=severity, message=message, source=source, raw=raw or message,
            agent_version=self.agent_version, pid=pid, attrs=clean, healthy=healthy))

    def xid(self, xid: int, source: Source, message: str, *, device: Device | None = None, raw: str = "",
            attrs: dict[str, Any] | None = None) -> FaultEvent:
        """An XID event whose severity is its verdict's (the catalog's; unknown XIDs: degraded)."""
        ev = self.event("xid", Component.GPU, Severity.DEGRADED, message, source, device=device, code=xid, raw=raw,
                        attrs=attrs)
        assert ev.verdict is not None
        return ev.model_copy(update={"severity": ev.verdict.severity})


def to_int(v: Any) -> int | None:
    """'177' → 177; 'N/A', '[N/A]', '' → None."""
    try:
        return int(str(v).strip().split()[0].rstrip(","))
    except (ValueError, IndexError):
        return None


def yes(v: Any) -> bool | None:
    """'Yes'/'No'/'Active'/'Not Active'/'1'/'0' → bool; 'N/A' → None."""
    s = str(v).strip().lower()
    if s in ("yes", "active", "true", "1", "enabled"):
        return True
    if s in ("no", "not active", "false", "0", "disabled", "none"):
        return False
    return None


MEMORY_KEYS = ("dbe_volatile", "sbe_volatile", "dbe_aggregate", "sbe_aggregate", "remap_corr", "remap_unc",
               "remap_pending", "remap_failure", "retired_pending", "retired_sbe", "retired_dbe",
               "channel_repair_pending", "unrepairable_memory")


def judge_memory(r: dict[str, Any], where: str) -> list[tuple[str, Severity, str]]:
    """GPU memory readings → (kind, severity, message), most severe first. Keys: MEMORY_KEYS (missing = unknown).

    Rules (NVIDIA GPU memory error management; the same as `agents.nvml`): a remap failure or
    "Unrepairable Memory" → row_remap_failure (fatal); volatile uncorrectable errors →
    ecc_dbe_volatile (fatal); a pending remap with uncorrectable rows → remapped_rows_pending_uncorrectable
    (fatal); a pending remap (correctable rows only), a pending page retirement or a pending channel
    repair → degraded; uncorrectable rows already remapped and nothing pending → remapped_rows (info);
    correctable-only volatile errors → ecc_sbe_volatile (info); lifetime-only uncorrectable errors →
    ecc_dbe_aggregate (info).
    """
    out: list[tuple[str, Severity, str]] = []
    g = r.get
    if g("remap_failure") or g("unrepairable_memory"):
        what = "row remapping failed" if g("remap_failure") else "unrepairable memory reported"
        out.append(("row_remap_failure", Severity.FATAL, f"{where}: {what}; the GPU needs replacement"))
    if (g("dbe_volatile") or 0) > 0:
        out.append(("ecc_dbe_volatile", Severity.FATAL,
                    f"{where}: {g('dbe_volatile')} uncorrectable ECC error(s) since the last reset"))
    if g("remap_pending") and (g("remap_unc") or 0) > 0:
        out.append(("remapped_rows_pending_uncorrectable", Severity.FATAL,
                    f"{where}: row remap pending for {g('remap_unc')} uncorrectable row(s); reset the GPU"))
    elif g("remap_pending"):
        out.append(("remapped_rows_pending", Severity.DEGRADED,
                    f"{where}: row remap pending (correctable rows {g('remap_corr')}); reset at the next convenience"))
    if g("retired_pending"):
        out.append(("retired_pages_pending", Severity.DEGRADED,
                    f"{where}: page retirement pending (SBE pages {g('retired_sbe')}, DBE pages {g('retired_dbe')}); "
                    "reset or reboot"))
    if g("channel_repair_pending"):
        out.append(("remapped_rows_pending", Severity.DEGRADED, f"{where}: memory channel repair pending; reset the GPU"))
    if not out and (g("remap_unc") or 0) > 0 and g("remap_pending") is False:
        out.append(("remapped_rows", Severity.INFO,
                    f"{where}: {g('remap_unc')} uncorrectable row(s) remapped, none pending (in service, keep watching)"))
    if not any(k[0] == "ecc_dbe_volatile" for k in out) and (g("dbe_aggregate") or 0) > 0:
        out.append(("ecc_dbe_aggregate", Severity.INFO, f"{where}: {g('dbe_aggregate')} uncorrectable ECC error(s) lifetime"))
    if (g("sbe_volatile") or 0) > 0 and not out:
        out.append(("ecc_sbe_volatile", Severity.INFO, f"{where}: {g('sbe_volatile')} correctable ECC error(s) since reset"))
    return out
