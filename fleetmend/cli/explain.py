"""`fleetmend explain`: classify fault text offline (kernel logs, nvidia-smi, DCGM, other tools) and say
what the catalog says about it.

The CLI (`fleetmend explain [FILE|-] [--json]`) calls `explain_text` then `render_table` or
`explained_json` per event.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fleetmend.catalog import Catalog, Classification, default_catalog
from fleetmend.events import FaultEvent, Severity

if TYPE_CHECKING:
    from rich.console import Console


@dataclass(frozen=True)
class Explained:
    """One parsed event and the catalog's classification of it."""

    event: FaultEvent
    classification: Classification


def explain_text(text: str, catalog: Catalog | None = None, node: str = "local") -> list[Explained]:
    """Parse any text the agent meets and classify every event: kernel logs (dmesg, journald,
    syslog, raw /dev/kmsg), `nvidia-smi` (table, `-q`, CSV queries), DCGM (`dcgmi diag`,
    `dcgmi health`, `dcgmi nvlink`, dcgm-exporter metrics) and other tools (device-plugin, CUDA and
    NCCL logs, mcelog, ibstat, ibv_devinfo, ibdev2netdev, BMC SEL). Formats: `agents.parsers`.

    Args:
        text: the text, several lines; a paste may mix formats.
        catalog: default the packaged catalog (pass `load_catalog(overrides)` for operator overrides).
        node: node name stamped on the events (default "local").
    Returns:
        `Explained` per event, in log order.
    """
    from agents.parsers import parse_any  # lazily: only this command needs the agent's parsers

    cat = catalog or default_catalog()
    events = parse_any(text, cluster="local", node=node, catalog=cat)
    return [Explained(e, cat.classify(e)) for e in events]


def explained_json(e: Explained) -> dict[str, Any]:
    """One JSON-ready dict: the FaultEvent fields (`model_dump(mode="json")`) plus the catalog's view.

    Naming: the event's own `source` (the probe, e.g. "kmsg") stays `source`, as on the wire; the
    catalog entry's citation is `catalog_source`. Added keys: `immediate_action`,
    `investigatory_action`, `catalog_source`, `fault_class`, `drain`, `description`, and
    `resolution`/`unit` (XID 144-150 decode; None otherwise).
    """
    out = e.event.model_dump(mode="json")
    c = e.classification
    out.update(
        immediate_action=c.immediate_action.value,
        investigatory_action=c.investigatory_action,
        catalog_source=c.source,
        fault_class=c.fault_class,
        drain=c.drain,
        description=c.description,
        resolution=c.resolution.value if c.resolution else None,
        unit=c.unit,
    )
    return out


_STYLE = {Severity.INFO: "green", Severity.DEGRADED: "yellow", Severity.FATAL: "bold red"}


def render_table(explained: list[Explained], console: Console) -> None:
    """Print each fault as a two-line entry that reads at any terminal width:

        Aug 10 15:36:05  XID 48  gpu 0000:55:00.0  fatal  → WORKFLOW_XID_48, drain
            An uncorrectable double bit error (DBE) has been detected on GPU ...

    Time is the kernel's own stamp where the text had one (`attrs["kernel_time"]`), else the time
    the event was observed. Healthy (clearing) events show severity "cleared". A summary line
    (counts by severity, whether the node should be drained) comes first.
    """
    from rich.text import Text

    rows = [_row(x) for x in explained]
    by_sev: dict[str, int] = {}
    for x in explained:
        key = "cleared" if x.event.healthy else x.event.severity.value
        by_sev[key] = by_sev.get(key, 0) + 1
    drain = any(x.classification.drain and not x.event.healthy for x in explained)
    counts = ", ".join(f"{n} {k}" for k, n in sorted(by_sev.items()))
    console.print(Text.assemble((f"{len(explained)} fault(s): {counts}. ", "bold"),
                                ("Recommendation: drain the node." if drain else "No drain needed.",
                                 "bold red" if drain else "green")))
    for r, x in zip(rows, explained):
        when, component, kind, dev, sev, action, drain_s, msg = r
        line = Text.assemble((f"{when}  ", "dim"), (f"{kind}  ", "bold"), f"{component} {dev}  ",
                             (_plain(sev), _STYLE[x.event.severity] if not x.event.healthy else "green"),
                             f"  → {action}" + (", drain" if drain_s == "yes" else ""),
                             (f"  ×{x.event.attrs['count']}" if int(x.event.attrs.get("count") or 1) > 1 else "",
                              "dim"))
        console.print(line, overflow="fold")
        console.print(Text("    " + msg), overflow="fold")


def _plain(cell: str) -> str:
    return cell.split("]", 1)[1].rsplit("[/]", 1)[0] if cell.startswith("[") else cell


def _row(x: Explained) -> list[str]:
    """One table row; "what" is the driver's own text after the XID framing where there is one."""
    ev, c = x.event, x.classification
    when = str(ev.attrs.get("kernel_time") or ev.observed_at.strftime("%Y-%m-%d %H:%M:%S"))
    kind = f"XID {ev.code}" if ev.kind == "xid" else (f"{ev.kind} {ev.code}" if ev.code is not None else ev.kind)
    dev = ev.device.pci_bus_id or ev.device.name or ev.device.uuid or "-"
    if ev.device.port is not None:
        dev = f"{dev} port {ev.device.port}"
    sev = "cleared" if ev.healthy else ev.severity.value
    action = c.immediate_action.value + (f" ({c.resolution.value})" if c.resolution else "")
    msg = str(ev.attrs.get("xid_text") or ev.message)
    return [when, ev.component.value, kind, dev, f"[{_STYLE[ev.severity]}]{sev}[/]", action,
            "yes" if c.drain else "no", msg]
