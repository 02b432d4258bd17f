"""`fleetmend inject --node N (--xid X | --kind K) [--severity S] [--bus-id B] [--cluster C]`.

Publishes a synthetic `FaultEvent` (`source=inject`) through JetStream to the node's fault subject with
`Nats-Msg-Id`, so the whole pipeline (router → NodeRemediation → FleetGuard → drain) can be exercised
without breaking hardware. The event carries who sent it (`attrs.injected_by`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from pydantic import ValidationError
from rich.markup import escape

from fleetmend import subjects
from fleetmend.catalog import load_catalog
from fleetmend.cli.common import ClusterOpt, ConfigOpt, err, out, run, settings, who
from fleetmend.config import Settings
from fleetmend.errors import FleetmendError
from fleetmend.events import Device, FaultEvent, Severity, Source
from fleetmend.infra.connect import connect_nats

app = typer.Typer()
"""`fleetmend inject` (top-level: added to the root app without a group name)."""


def build_injected_event(settings: Settings, node: str, *, xid: int | None, kind: str | None,
                         severity: str | None, bus_id: str | None, by: str) -> FaultEvent:
    """The synthetic event `inject` publishes. Severity and component are the catalog's: the router
    classifies every event by the catalog, so a `severity` other than the catalog's is refused rather than
    published and silently overridden.

    Raises:
        FleetmendError: neither or both of xid/kind; an XID or a kind the catalog does not have (an agent
            reports any XID the driver logs, but an injected one tests the pipeline on a known class); a
            `severity` that differs from the catalog's.
    """
    if (xid is None) == (kind is None):
        raise FleetmendError("give exactly one of --xid N or --kind NAME")
    catalog = load_catalog(settings.catalog_overrides)
    code: int | None
    if xid is not None:
        entry = catalog.xids.get(xid)
        if entry is None:
            raise FleetmendError(f"XID {xid} is not in the catalog (it knows XIDs {min(catalog.xids)} to "
                                 f"{max(catalog.xids)}: `fleetmend runbook` lists them); inject a catalog XID, or "
                                 "add this one with catalog_overrides first")
        sev, comp = entry.base_severity, entry.component
        ev_kind, code, message = "xid", xid, f"injected XID {xid} ({entry.mnemonic})"
        raw = f"NVRM: Xid (PCI:{(bus_id or '0000:00:00.0')[:-2]}): {xid}, injected by fleetmend inject"
    else:
        assert kind is not None
        k = catalog.kinds.get(kind)
        if k is None:
            known = ", ".join(sorted(catalog.kinds)[:12])
            raise FleetmendError(f"unknown kind {kind!r}; expected a catalog kind such as {known}, …")
        sev, comp, ev_kind, code, message, raw = k.severity, k.component, kind, None, f"injected {kind}", ""
    if severity is not None and Severity(severity) != sev:
        what = f"XID {xid}" if xid is not None else kind
        raise FleetmendError(f"the router classifies {what} by the catalog as {sev.value}, whatever the event "
                             f"says: --severity {severity} would be ignored (drop it, or change the class's "
                             "severity in the catalog with catalog_overrides)")
    return catalog.stamp(FaultEvent(
        cluster=settings.cluster, node=node, component=comp, kind=ev_kind, code=code,
        severity=Severity(severity) if severity else sev, source=Source.INJECT,
        device=Device(pci_bus_id=bus_id) if bus_id else Device(), message=f"{message} by {by}", raw=raw,
        attrs={"injected_by": by}))


async def _inject(settings: Settings, event: FaultEvent) -> dict[str, Any]:
    from fleetmend.infra.jetstream import ensure_fault_stream  # lazy: nats (see fleetmend.cli.common)

    nc = await connect_nats(settings, name="fleetmend-inject")
    try:
        js = nc.jetstream(timeout=10)
        await ensure_fault_stream(js, settings)
        subject = subjects.fault_subject(event.cluster, event.node)
        ack = await js.publish(subject, event.to_json_bytes(), headers={"Nats-Msg-Id": subjects.msg_id(event.event_id)})
        return {"event_id": event.event_id, "cluster": event.cluster, "node": event.node, "subject": subject,
                "stream": ack.stream, "seq": ack.seq,
                "duplicate": bool(ack.duplicate)}
    finally:
        await nc.close()


@app.command()
def inject(
    node: str = typer.Option(..., "--node", help="Node the synthetic fault is about."),
    xid: Optional[int] = typer.Option(None, "--xid", help="An XID number (e.g. 79)."),
    kind: Optional[str] = typer.Option(None, "--kind", help="A catalog kind (e.g. aer_fatal, ib_port_down)."),
    severity: Optional[str] = typer.Option(None, "--severity", help="info, degraded or fatal: must be the "
                                           "catalog's (the router classifies by it)."),
    bus_id: Optional[str] = typer.Option(None, "--bus-id", help="GPU PCI bus id, e.g. 0000:3b:00.0."),
    cluster: Optional[str] = ClusterOpt,
    as_json: bool = typer.Option(False, "--json"),
    config: Optional[Path] = ConfigOpt,
) -> None:
    """Publish a synthetic fault (source=inject) for NODE through JetStream: tests the pipeline end to end."""
    s = settings(config, cluster=cluster)
    if severity is not None and severity not in ("info", "degraded", "fatal"):
        err.print(f"[red]error:[/red] unknown severity {severity!r}; expected info, degraded, fatal")
        raise typer.Exit(2)
    if bus_id is not None:  # the kmsg parser's rule (`normalize_bdf`): what the agents report is what inject takes
        from agents.kmsg.matchers import normalize_bdf

        bdf = normalize_bdf(bus_id)
        if bdf is None:
            err.print("[red]error:[/red] " + escape(f"--bus-id: {bus_id!r} is not a PCI bus id; expected "
                                                   "[domain:]bus:device[.function] in hex, e.g. 0000:3b:00.0"))
            raise typer.Exit(2)
        bus_id = bdf
    try:
        event = build_injected_event(s, node, xid=xid, kind=kind, severity=severity, bus_id=bus_id, by=who())
    except FleetmendError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}")
        raise typer.Exit(2) from e
    except ValueError as e:  # pydantic: a bad node name or bus id
        text = "; ".join(f"--{'-'.join(str(p) for p in x['loc']).replace('pci_bus_id', 'bus-id')}: "
                         f"{x['msg'].removeprefix('Value error, ')}" for x in e.errors()) \
            if isinstance(e, ValidationError) else str(e)
        err.print(f"[red]error:[/red] {escape(text)}")
        raise typer.Exit(2) from e
    res = run(_inject(s, event))
    if as_json:
        sys.stdout.write(json.dumps(res) + "\n")
        return
    out.print(f"injected {escape(event.summary())} → {res['subject']} (event {res['event_id']}, "
              f"stream seq {res['seq']}{', duplicate' if res['duplicate'] else ''})")
