"""`fleetmend inventory NODE [--json]`: a node's latest fingerprint from the KV bucket (hardware class, versions,
GPU placement with the nearest NIC/NVMe, settings); `fleetmend versions [--json]`: the distribution of driver,
firmware and kernel versions per hardware class.
"""

from __future__ import annotations

import json
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from fleetmend import subjects
from fleetmend.cli.common import ClusterOpt, ConfigOpt, JsonOpt, err, out, run, settings
from fleetmend.config import Settings
from fleetmend.infra.connect import connect_nats

app = typer.Typer()
"""`fleetmend inventory` and `fleetmend versions` (top-level)."""


async def _one(s: Settings, cluster: str, node: str) -> Any:
    from nats.js.errors import KeyNotFoundError

    from fleetmend.fingerprint import Fingerprint  # lazy: fleetmend.messages (see fleetmend.cli.common)
    from fleetmend.infra.jetstream import open_kv_bucket

    nc = await connect_nats(s, name="fleetmend-cli")
    try:
        kv = await open_kv_bucket(nc.jetstream(), subjects.FINGERPRINT_KV_BUCKET, "latest node fingerprint")
        try:
            entry = await kv.get(subjects.fingerprint_kv_key(cluster, node))
        except KeyNotFoundError:
            return None
        return Fingerprint.model_validate_json(entry.value)
    finally:
        await nc.close()


@app.command()
def inventory(node: str = typer.Argument(..., help="Node name."), cluster: Optional[str] = ClusterOpt,
              nccl_ib_hca: Optional[str] = typer.Option(None, "--nccl-ib-hca", help="Check a job's NCCL_IB_HCA "
                                                        "value against the node's GPU-local HCAs instead."),
              as_json: bool = JsonOpt, config: Optional[Path] = ConfigOpt) -> None:
    """A node's latest fingerprint: hardware class, versions, each GPU's nearest NIC and NVMe (PCIe level, NUMA)
    and settings. With --nccl-ib-hca: which GPU-local HCAs that value leaves out and which others it selects
    (exit 1 when either is not empty)."""
    s = settings(config, **({"cluster": cluster} if cluster else {}))
    try:
        subjects.check_node_name(node)
    except ValueError as e:
        err.print(f"[red]{escape(str(e))}[/red]")
        raise typer.Exit(2) from e
    fp = run(_one(s, s.cluster, node))
    if fp is None:
        err.print(f"[red]no fingerprint of {escape(node)} in cluster {escape(s.cluster)}[/red] (is its agent running "
                  "with agent.inventory_enabled?)")
        raise typer.Exit(1)
    if nccl_ib_hca is not None:
        from fleetmend.drift import nccl_ib_hca as check_hca

        try:
            chk = check_hca(nccl_ib_hca, fp)
        except ValueError as e:
            err.print(f"[red]{escape(str(e))}[/red]")
            raise typer.Exit(2) from e
        result = {"node": node, "nccl_ib_hca": nccl_ib_hca, "selected": list(chk.selected),
                  "compute": list(chk.compute), "missing": list(chk.missing), "extra": list(chk.extra), "ok": chk.ok}
        if as_json:
            sys.stdout.write(json.dumps(result, indent=2) + "\n")
        else:
            out.print(f"NCCL_IB_HCA={escape(nccl_ib_hca)} on {escape(node)}: selects {', '.join(chk.selected) or '-'}; "
                      f"GPU-local {', '.join(chk.compute) or '-'}; left out {', '.join(chk.missing) or '-'}; "
                      f"not GPU-local {', '.join(chk.extra) or '-'}")
        raise typer.Exit(0 if chk.ok else 1)
    if as_json:
        sys.stdout.write(fp.model_dump_json(indent=2) + "\n")
        return
    out.print(f"{escape(node)}  class: {escape(fp.hardware.key)}  read {fp.read_at:%Y-%m-%d %H:%M:%S}Z "
              f"in {fp.read_ms:.0f} ms  digest {fp.digest}  topology {fp.topology_hash or '-'}")
    t = Table(title="versions")
    t.add_column("name")
    t.add_column("version")
    for k, v in sorted(fp.versions.items()):
        t.add_row(k, escape(v))
    out.print(t)
    t = Table(title="GPU placement")
    for col in ("gpu", "numa", "cpus", "nearest NIC", "level", "nearest NVMe", "level"):
        t.add_column(col)
    for g in fp.gpus:
        t.add_row(g.pci_bus_id, str(g.numa_node), escape(g.local_cpulist or ""), g.nearest_nic or "-",
                  g.nic_level.value if g.nic_level else "-", g.nearest_nvme or "-",
                  g.nvme_level.value if g.nvme_level else "-")
    out.print(t)
    t = Table(title="settings")
    t.add_column("key")
    t.add_column("value")
    for k, v in sorted(fp.settings.items()):
        t.add_row(escape(k), escape(v))
    out.print(t)


def version_table(fps: list[Any]) -> dict[str, dict[str, dict[str, int]]]:
    """hardware class → version name → value → node count."""
    dist: dict[str, dict[str, Counter[str]]] = defaultdict(lambda: defaultdict(Counter))
    for fp in fps:
        for name, value in fp.versions.items():
            dist[fp.hardware.key][name][value] += 1
    return {hw: {n: dict(c.most_common()) for n, c in sorted(names.items())} for hw, names in sorted(dist.items())}


@app.command()
def versions(cluster: Optional[str] = ClusterOpt, as_json: bool = JsonOpt, config: Optional[Path] = ConfigOpt) -> None:
    """Driver, VBIOS, CUDA, HCA firmware, OFED, kernel and BIOS versions per hardware class, with node counts."""
    s = settings(config, **({"cluster": cluster} if cluster else {}))
    fps = run(_all(s, s.cluster))
    table = version_table(fps)
    if as_json:
        sys.stdout.write(json.dumps({"cluster": s.cluster, "nodes": len(fps), "classes": table}, indent=2) + "\n")
        return
    if not fps:
        out.print(f"no fingerprints for cluster {escape(s.cluster)}")
        return
    for hw, names in table.items():
        t = Table(title=escape(hw))
        for col in ("name", "version", "nodes"):
            t.add_column(col)
        for name, values in names.items():
            for value, count in values.items():
                t.add_row(name, escape(value), str(count))
        out.print(t)


async def _all(s: Settings, cluster: str) -> list[Any]:
    from fleetmend.analyzer.drift import DriftJudge

    nc = await connect_nats(s, name="fleetmend-cli")
    try:
        return await DriftJudge(cluster, nc.jetstream()).fingerprints()
    finally:
        await nc.close()
