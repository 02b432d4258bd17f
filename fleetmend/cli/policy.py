"""Operator commands for policy and fleet safety:

    fleetmend inject --node N (--xid X | --kind K) [--severity S] [--bus-id B] [--cluster C]
    fleetmend breaker status | reset [--note ...]
    fleetmend pause [--note ...] | resume

`inject` publishes a synthetic `FaultEvent` (`source=inject`) through JetStream to the node's fault
subject with `Nats-Msg-Id`, so the whole pipeline (router → NodeRemediation → FleetGuard → drain)
can be exercised without breaking hardware. `breaker`/`pause`/`resume` talk to the cluster's
FleetGuard workflow (`fleetguard/<cluster>`); commands carry who sent them for the audit trail.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from fleetmend.config import Settings
from fleetmend.errors import FleetmendError


def build_injected_event(settings: Settings, node: str, *, xid: int | None, kind: str | None,
                         severity: str | None, bus_id: str | None, by: str):  # noqa: ANN201 - FaultEvent
    """The synthetic event `inject` publishes. Severity and component are the catalog's: the router
    classifies every event by the catalog, so a `severity` other than the catalog's is refused rather than
    published and silently overridden.

    Raises:
        FleetmendError: neither or both of xid/kind; an unknown kind (lists a few known ones); a
            `severity` that differs from the catalog's.
    """
    from fleetmend.catalog import load_catalog
    from fleetmend.events import Component, Device, FaultEvent, Severity, Source

    if (xid is None) == (kind is None):
        raise FleetmendError("give exactly one of --xid N or --kind NAME")
    catalog = load_catalog(settings.catalog_overrides)
    if xid is not None:
        entry = catalog.xids.get(xid)
        sev = entry.base_severity if entry else Severity.DEGRADED
        comp = entry.component if entry else Component.GPU
        ev_kind, code, message = "xid", xid, f"injected XID {xid}" + (f" ({entry.mnemonic})" if entry else "")
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


async def _inject(settings: Settings, event) -> dict[str, Any]:  # noqa: ANN001
    from fleetmend import subjects
    from fleetmend.infra.connect import connect_nats
    from fleetmend.infra.jetstream import ensure_fault_stream

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


async def _guard_handle(settings: Settings, *, start: bool):  # noqa: ANN202
    from fleetmend import subjects
    from fleetmend.infra.connect import connect_temporal
    from fleetmend.policy import load_topology
    from fleetmend.messages import GuardApi, GuardInput, GuardPolicy, guard_task_queue

    client = await connect_temporal(settings)
    wid = subjects.fleetguard_workflow_id(settings.cluster)
    if start:  # the guard may not exist yet (no permit requested so far): start it, then update it
        policy = GuardPolicy.from_settings(settings.policy, len(load_topology(settings.policy.topology_file)))
        await client.start_workflow(GuardApi.WORKFLOW, GuardInput(cluster=settings.cluster, policy=policy), id=wid,
                                    task_queue=guard_task_queue(settings.task_queue), start_signal=GuardApi.ENSURE)
    return client.get_workflow_handle(wid)


async def _guard_status(settings: Settings) -> dict[str, Any]:
    from temporalio.service import RPCError

    from fleetmend.messages import GuardApi, GuardStatus

    handle = await _guard_handle(settings, start=False)
    try:
        st = await handle.query(GuardApi.STATUS, result_type=GuardStatus)
    except RPCError as e:
        if "not found" in str(e).lower():
            raise FleetmendError(f"no FleetGuard for cluster {settings.cluster} yet: no drain permit has been "
                                 "requested (it starts with the first drain-worthy fault, or `fleetmend pause`)") from e
        raise FleetmendError(f"could not read FleetGuard of {settings.cluster}: {e}; is `fleetmend worker` running?") \
            from e
    return dict(st.__dict__)


async def _guard_update(settings: Settings, update: str, by: str, note: str) -> str:
    from temporalio.client import WorkflowUpdateFailedError
    from temporalio.service import RPCError

    from fleetmend.messages import GuardCommand

    handle = await _guard_handle(settings, start=True)
    try:
        return await handle.execute_update(update, GuardCommand(by=by, note=note), result_type=str)
    except WorkflowUpdateFailedError as e:
        raise FleetmendError(f"FleetGuard {settings.cluster}: {e.cause.message if e.cause else e}") from e
    except RPCError as e:
        raise FleetmendError(f"FleetGuard {settings.cluster}: {e}; is `fleetmend worker` running?") from e


def register(app: typer.Typer) -> None:
    from fleetmend.cli import main as m

    def _guard_done(s: Settings, update: str, result: str, as_json: bool) -> None:
        if as_json:
            sys.stdout.write(json.dumps({"command": update, "cluster": s.cluster, "by": m._who(),
                                         "result": result}) + "\n")
        else:
            m.out.print(result)

    breaker_app = typer.Typer(no_args_is_help=True, help="The cluster's drain breaker (FleetGuard).")
    app.add_typer(breaker_app, name="breaker")

    @app.command()
    def inject(
        node: str = typer.Option(..., "--node", help="Node the synthetic fault is about."),
        xid: Optional[int] = typer.Option(None, "--xid", help="An XID number (e.g. 79)."),
        kind: Optional[str] = typer.Option(None, "--kind", help="A catalog kind (e.g. aer_fatal, ib_port_down)."),
        severity: Optional[str] = typer.Option(None, "--severity", help="info, degraded or fatal: must be the "
                                               "catalog's (the router classifies by it)."),
        bus_id: Optional[str] = typer.Option(None, "--bus-id", help="GPU PCI bus id, e.g. 0000:3b:00.0."),
        cluster: Optional[str] = m.ClusterOpt,
        as_json: bool = typer.Option(False, "--json"),
        config: Optional[Path] = m.ConfigOpt,
    ) -> None:
        """Publish a synthetic fault (source=inject) for NODE through JetStream: tests the pipeline end to end."""
        s = m._settings(config, cluster=cluster)
        if severity is not None and severity not in ("info", "degraded", "fatal"):
            m.err.print(f"[red]error:[/red] unknown severity {severity!r}; expected info, degraded, fatal")
            raise typer.Exit(2)
        try:
            event = build_injected_event(s, node, xid=xid, kind=kind, severity=severity, bus_id=bus_id, by=m._who())
        except FleetmendError as e:
            m.err.print(f"[red]error:[/red] {e}")
            raise typer.Exit(2) from e
        except ValueError as e:  # pydantic: a bad node name or bus id
            from pydantic import ValidationError

            text = "; ".join(f"--{'-'.join(str(p) for p in x['loc']).replace('pci_bus_id', 'bus-id')}: "
                             f"{x['msg'].removeprefix('Value error, ')}" for x in e.errors()) \
                if isinstance(e, ValidationError) else str(e)
            m.err.print(f"[red]error:[/red] {escape(text)}")
            raise typer.Exit(2) from e
        res = m._run(_inject(s, event))
        if as_json:
            sys.stdout.write(json.dumps(res) + "\n")
            return
        m.out.print(f"injected {escape(event.summary())} → {res['subject']} (event {res['event_id']}, "
                    f"stream seq {res['seq']}{', duplicate' if res['duplicate'] else ''})")

    @breaker_app.command("status")
    def breaker_status(
        as_json: bool = typer.Option(False, "--json"),
        cluster: Optional[str] = m.ClusterOpt,
        config: Optional[Path] = m.ConfigOpt,
    ) -> None:
        """Permits held, the queue, the breaker and infrastructure incidents of the cluster."""
        s = m._settings(config, cluster=cluster)
        d = m._run(_guard_status(s))
        if s.policy.fast_drain:
            d["pool"] = m._run(_pool_status(s))
        if as_json:
            sys.stdout.write(json.dumps(d, default=str, indent=2) + "\n")
            return
        state = "TRIPPED" if d["breaker_tripped"] else "closed" + ("" if d["paused"] or d["observe_only"]
                                                                   else " (drains allowed)")
        m.out.print(f"FleetGuard {d['cluster']}: breaker {state}"
                    + (f"; PAUSED by {d['paused_by']}: no drains" if d["paused"] else "")
                    + ("; observe-only" if d["observe_only"] else ""))
        if d["breaker_tripped"]:
            m.out.print(f"  tripped at {d['breaker_tripped_at']}: {escape(d['breaker_reason'] or '')}")
            m.out.print("  reset with: fleetmend breaker reset --note '…'")
        m.out.print(f"permits held {len(d['held'])}/{d['budget']} (known nodes {d['known_nodes']}), "
                    f"queued {len(d['queue'])}")
        t = Table(title="permits and queue")
        for col in ("node", "state", "severity", "fault", "rack", "since"):
            t.add_column(col, no_wrap=True)
        for h in d["held"]:
            t.add_row(h["node"], "held", h["severity"], h["fault_class"], h.get("rack") or "", h["granted_at"])
        for q in d["queue"]:
            t.add_row(q["node"], "queued", q["severity"], q["fault_class"], q.get("rack") or "", q["requested_at"])
        if d["held"] or d["queue"]:
            m.out.print(t)
        pool = d.get("pool")
        if pool is not None:
            held = {h["node"] for h in d["held"]}
            router_only = sorted(n for n, h in pool["holders"].items() if h["by"] == "router" and n not in held)
            m.out.print(f"permit pool: {len(pool['holders'])}/{pool['budget']} slots held, "
                        f"{pool['rack_cap']} per rack, "
                        + ("open" if pool["open"] else f"closed ({escape(pool['why'])})")
                        + (f"; router drains not adopted yet: {', '.join(router_only)}" if router_only else ""))
        elif s.policy.fast_drain:
            m.out.print("permit pool: not published yet (FleetGuard writes it when it starts)")
        for inc in d["infra_incidents"]:
            m.out.print(f"infrastructure incident {inc['domain']} ({'closed' if inc.get('closed_at') else 'open'}): "
                        f"{len(inc['nodes'])} nodes, ticket {inc.get('ticket') or '-'}")

    async def _pool_status(s) -> dict | None:  # noqa: ANN001 - Settings
        """The cluster's permit pool as stored (`fleetmend.infra.permit_pool`), or None before FleetGuard wrote it."""
        from dataclasses import asdict

        from fleetmend.infra.connect import close_nats, connect_nats
        from fleetmend.infra.permit_pool import PermitPool

        nc = await connect_nats(s, name="fleetmend-cli")
        try:
            st = await (await PermitPool.open(nc.jetstream())).read(s.cluster)
        finally:
            await close_nats(nc)
        return asdict(st) if st is not None else None

    @breaker_app.command("reset")
    def breaker_reset(
        note: str = typer.Option("", "--note", help="Why it is safe to resume."),
        as_json: bool = m.JsonOpt,
        cluster: Optional[str] = m.ClusterOpt,
        config: Optional[Path] = m.ConfigOpt,
    ) -> None:
        """Reset a tripped breaker: queued drains resume, highest severity first."""
        s = m._settings(config, cluster=cluster)
        _guard_done(s, "reset_breaker", m._run(_guard_update(s, "reset_breaker", m._who(), note)), as_json)

    @app.command()
    def pause(
        note: str = typer.Option("", "--note", help="Why."),
        as_json: bool = m.JsonOpt,
        cluster: Optional[str] = m.ClusterOpt,
        config: Optional[Path] = m.ConfigOpt,
    ) -> None:
        """Global pause: faults are still classified and recorded; no node is drained until `resume`."""
        s = m._settings(config, cluster=cluster)
        _guard_done(s, "pause", m._run(_guard_update(s, "pause", m._who(), note)), as_json)

    @app.command()
    def resume(
        note: str = typer.Option("", "--note"),
        as_json: bool = m.JsonOpt,
        cluster: Optional[str] = m.ClusterOpt,
        config: Optional[Path] = m.ConfigOpt,
    ) -> None:
        """End a global pause; queued drains proceed within the budget."""
        s = m._settings(config, cluster=cluster)
        _guard_done(s, "resume", m._run(_guard_update(s, "resume", m._who(), note)), as_json)
