"""`fleetmend drift [--cluster C] [--json]`: each cohort and the nodes that deviate, judged now from the
fingerprint bucket with the rules of `fleetmend.drift`; `fleetmend drift allow KEY VALUE… --who --why`: an allowed
set for a rollout (stored in `DRIFT_ALLOW_KV_BUCKET`, read by the drift judge and by this command).
"""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from fleetmend import subjects
from fleetmend.cli.common import (
    MAX_TICKET_CHARS,
    ClusterOpt,
    ConfigOpt,
    JsonOpt,
    err,
    free_text,
    out,
    run,
    settings,
    who,
)
from fleetmend.config import Settings
from fleetmend.infra.connect import connect_nats

if TYPE_CHECKING:
    from fleetmend.drift import DriftReport

app = typer.Typer(invoke_without_command=True, help="Configuration drift: cohorts, deviating nodes, allowed sets.")


def report_json(report: DriftReport, cluster: str, nodes: int,
                topology: list[dict[str, Any]] | None = None,
                repairs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `--json` shape: cluster, nodes, deviations (node, key, found, expected, layer, reason, source, check,
    kind, fix, wanted, role, hardware), cohorts (hardware, role, key, size, majority, share, status), splits,
    topology_changes (node, at, seen_by, changed: see `topology_changes`) and after_repair: `open` (nodes whose
    topology changed across a repair and is not their peers': a `config_drift_topology_repair` fault each) and
    `recent` findings (node, drained_at, at, before, after, changed, like_peers; unix times), from the drift
    judge's repair watch (`fleetmend.analyzer.drift.RepairWatch`)."""
    cohorts = [{"hardware": c.hardware, "role": c.role.value, "key": c.key, "size": c.verdict.size,
                "majority": c.verdict.mode, "share": round(c.verdict.share, 3), "status": c.verdict.status.value}
               for c in report.cohorts]
    return {"cluster": cluster, "nodes": nodes,
            "deviations": [{"node": d.node, "key": d.key, "found": d.found, "expected": list(d.expected),
                            "layer": d.layer.value, "reason": d.reason, "source": d.source, "check": d.check,
                            "kind": d.kind, "fix": d.fix.value, "wanted": d.wanted, "role": d.role.value,
                            "hardware": d.hardware} for d in report.deviations],
            "cohorts": cohorts, "splits": [c for c in cohorts if c["status"] == "split"],
            "topology_changes": topology or [],
            "after_repair": {"open": sorted((repairs or {}).get("open", {}).values(), key=lambda f: f["node"]),
                             "recent": list((repairs or {}).get("recent", []))}}


TOPOLOGY_LOOKBACK_S = 30 * 24 * 3600.0
"""How far back `fleetmend drift` looks for topology changes in `FINGERPRINT_STREAM` (a month of repairs)."""


async def _judge(s: Settings, cluster: str) -> tuple[DriftReport, int, list[dict[str, Any]], dict[str, Any]]:
    from fleetmend.analyzer.drift import DriftJudge  # lazy: nats, fleetmend.messages (see fleetmend.cli.common)
    from fleetmend.drift import judge

    nc = await connect_nats(s, name="fleetmend-cli")
    try:
        j = DriftJudge(cluster, nc.jetstream())
        fps = await j.fingerprints()
        report = judge(fps, j.invariants, await j.allowed(), j.quorum, j.majority)
        return report, len(fps), await topology_changes(nc.jetstream(), cluster), await repair_findings(
            nc.jetstream(), cluster)
    finally:
        await nc.close()


async def repair_findings(js: Any, cluster: str) -> dict[str, Any]:
    """The drift judge's repair watch document (`repairs.<cluster>` in the analyzer bucket), {} before it wrote one."""
    from fleetmend.analyzer.drift import repair_key

    try:
        kv = await js.key_value(subjects.ANALYZER_KV_BUCKET)
        return dict(json.loads((await kv.get(repair_key(cluster))).value or b"{}"))
    except Exception:  # noqa: BLE001 - no analyzer bucket or no document yet: nothing found
        return {}


async def topology_changes(js: Any, cluster: str, lookback_s: float = TOPOLOGY_LOOKBACK_S,
                           limit: int = 10_000) -> list[dict[str, Any]]:
    """Changes of a node's GPU/NIC/NVMe placement (`FingerprintChange.topology_changed`) in the last `lookback_s`,
    oldest first: node, at, seen_by, changed keys. A node listed here after a repair was re-cabled or had a device
    moved or swapped. [] when the stream does not exist yet."""
    from datetime import timedelta

    from nats.js.api import ConsumerConfig, DeliverPolicy

    from fleetmend.fingerprint import FingerprintChange

    since = (datetime.now(timezone.utc) - timedelta(seconds=lookback_s)).isoformat()
    try:
        # nats-py sends opt_start_time as given: an RFC 3339 string is what the server reads (typed datetime there)
        sub = await js.subscribe(f"fleet.{cluster}.fingerprint.*", ordered_consumer=True,
                                 config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME,
                                                       opt_start_time=since))  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - no stream yet (no agent ever published): nothing changed
        return []
    out: list[dict[str, Any]] = []
    try:
        for _ in range(limit):
            try:
                msg = await sub.next_msg(timeout=1.0)
            except Exception:  # noqa: BLE001 - timeout: the stream is read to its end
                break
            try:
                ch = FingerprintChange.model_validate_json(msg.data)
            except ValueError:
                continue
            if ch.topology_changed:
                out.append({"node": ch.node, "at": ch.at.isoformat(), "seen_by": ch.seen_by,
                            "changed": sorted(ch.changed)})
    finally:
        await sub.unsubscribe()
    return out


@app.callback()
def drift(ctx: typer.Context, cluster: Optional[str] = ClusterOpt, as_json: bool = JsonOpt,
          config: Optional[Path] = ConfigOpt) -> None:
    """Each cohort (hardware class, device role, key: size, majority value and share) and the deviating nodes with
    the value expected, the value found and why. A split cohort (no value holds 60 %) is listed for humans and
    opens nothing."""
    if ctx.invoked_subcommand is not None:
        return
    s = settings(config, **({"cluster": cluster} if cluster else {}))
    report, nodes, topo, repairs = run(_judge(s, s.cluster))
    if as_json:
        sys.stdout.write(json.dumps(report_json(report, s.cluster, nodes, topo, repairs), indent=2) + "\n")
        return
    for f in sorted(repairs.get("open", {}).values(), key=lambda f: f["node"]):
        out.print(f"[red]topology of {escape(f['node'])} changed across its repair[/red] (drained "
                  f"{datetime.fromtimestamp(f['drained_at'], timezone.utc):%Y-%m-%d %H:%M}Z; hash {escape(f['before'])}"
                  f" -> {escape(f['after'])}, not its peers'): {escape('; '.join(f['changed'][:4]))}")
    for tc in topo:
        out.print(f"topology of {escape(tc['node'])} changed at {tc['at'][:19]} ({escape(tc['seen_by'])}): "
                  f"{escape(', '.join(tc['changed'][:6]))}")
    if nodes == 0:
        out.print(f"no fingerprints for cluster {escape(s.cluster)} (agents publish one at start and every "
                  "agent.inventory_interval_s)")
        return
    shown = [c for c in report.cohorts if c.verdict.status.value != "uniform"]
    t = Table(title=f"cohorts of {escape(s.cluster)} ({nodes} nodes; {len(report.cohorts) - len(shown)} uniform "
                    "not shown)")
    for col in ("hardware", "role", "key", "size", "majority", "share", "status"):
        t.add_column(col)
    for c in shown:
        t.add_row(escape(c.hardware), c.role.value, escape(c.key), str(c.verdict.size), escape(str(c.verdict.mode)),
                  f"{c.verdict.share:.0%}", c.verdict.status.value)
    out.print(t)
    if not report.deviations:
        out.print("no deviations")
        return
    t = Table(title="deviations")
    for col in ("node", "key", "found", "expected", "layer", "fix", "why"):
        t.add_column(col)
    for d in report.deviations:
        t.add_row(escape(d.node), escape(d.key), escape(d.found), escape(" | ".join(d.expected)), d.layer.value,
                  d.fix.value, escape(d.reason))
    out.print(t)


@app.command("allow")
def allow(key: str = typer.Argument(..., help="Fact key, e.g. version.nvidia_driver."),
          values: list[str] = typer.Argument(..., help="Every value allowed during the rollout."),
          by: str = typer.Option("", "--who", help="Who allows it (default user@host).",
                                      callback=free_text(MAX_TICKET_CHARS)),
          why: str = typer.Option(..., "--why", help="Why (the rollout, the change ticket).",
                                       callback=free_text()),
          remove: bool = typer.Option(False, "--remove", help="Drop the allowed set of KEY (VALUE is ignored)."),
          cluster: Optional[str] = ClusterOpt, config: Optional[Path] = ConfigOpt) -> None:
    """Allow a set of values for one key while a rollout runs: the cohort majority and the policy are suspended for
    that key, and a value outside the set deviates."""
    s = settings(config, **({"cluster": cluster} if cluster else {}))
    if not why.strip():
        err.print("[red]--why must say why (the rollout or change ticket)[/red]")
        raise typer.Exit(2)
    allowed, author = sorted(set(values)), by or who()
    record = {"key": key, "values": allowed, "who": author, "why": why, "at": datetime.now(timezone.utc).isoformat()}
    run(_store_allow(s, s.cluster, key, None if remove else record))
    out.print(f"{'removed the allowed set of' if remove else 'allowed'} {escape(key)}"
              + ("" if remove else f" = {escape(', '.join(allowed))} ({escape(author)}: {escape(why)})"))


async def _store_allow(s: Settings, cluster: str, key: str, record: dict[str, Any] | None) -> None:
    from fleetmend.infra.jetstream import open_kv_bucket

    try:
        kv_key = subjects.drift_allow_kv_key(cluster, key)
    except ValueError as e:
        err.print(f"[red]{escape(str(e))}[/red]")
        raise typer.Exit(2) from e
    nc = await connect_nats(s, name="fleetmend-cli")
    try:
        kv = await open_kv_bucket(nc.jetstream(), subjects.DRIFT_ALLOW_KV_BUCKET, "allowed drift values")
        if record is None:
            await kv.delete(kv_key)
        else:
            await kv.put(kv_key, json.dumps(record).encode())
    finally:
        await nc.close()
