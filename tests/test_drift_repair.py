"""A node whose topology changed across a repair is flagged (`fleetmend.analyzer.drift.RepairWatch`), against a real
NATS: fingerprints read by the real reader from synthesised roots in the KV bucket, the permit pool document saying
who is drained (as FleetGuard writes it), the drift judge ticking, `fleetmend drift --json` showing the finding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from agents.inventory import read_fingerprint
from fleetmend import subjects
from fleetmend.analyzer.drift import REPAIR_KIND, DriftJudge, repair_key
from fleetmend.config import load_settings
from fleetmend.infra.connect import connect_nats
from fleetmend.infra.jetstream import ensure_fault_stream, ensure_fingerprint_stores
from fleetmend.infra.permit_pool import Holder, PoolState, permit_bucket
from tests.fixtures.hosts.synth import HostSpec, build_host
from tests.test_security import secured  # noqa: F401 - the secured NATS fixture

SWAPPED = HostSpec(nic_numa_swap=True)
"""GPU 0's NIC in a slot of the other socket (what a careless NIC swap leaves)."""


async def test_topology_changed_across_a_repair_is_flagged_and_cleared(nats_server, tmp_path: Path,
                                                                        unique: str) -> None:
    cluster = f"rp{unique}"
    s = load_settings(None, cluster=cluster, node="judge", nats_url=nats_server.url, state_dir=tmp_path / "state")
    nc = await connect_nats(s, name="drift-repair")
    js = nc.jetstream()
    await ensure_fault_stream(js)
    fp_kv = await ensure_fingerprint_stores(js)
    pool_kv = await permit_bucket(js)

    async def host(node: str, spec: HostSpec | None = None) -> None:
        fp = read_fingerprint(build_host(tmp_path / f"{node}-{time.monotonic_ns()}", spec), cluster, node)
        await fp_kv.put(subjects.fingerprint_kv_key(cluster, node), fp.to_json_bytes())

    async def drained(*nodes: str) -> None:
        await pool_kv.put(subjects.permit_kv_key(cluster), PoolState(
            budget=4, open=True, holders={n: Holder(rack=None, by="guard", at=1764547200.0) for n in nodes}).to_json())

    try:
        for i in range(6):
            await host(f"gpu-{i}", SWAPPED if i == 4 else None)  # gpu-4 is the odd one out before its repair
        judge = DriftJudge(cluster, js)
        await judge.tick()
        assert [e.kind for e in judge.published] == ["config_drift_topology"]  # gpu-4, by the cohort
        await drained("gpu-2", "gpu-4")
        await judge.tick()
        doc = json.loads((await (await js.key_value(subjects.ANALYZER_KV_BUCKET)).get(repair_key(cluster))).value)
        assert sorted(doc["watch"]) == ["gpu-2", "gpu-4"]
        # the repairs: gpu-2 comes back with GPU 0's NIC on the other socket, gpu-4 comes back like its peers
        await host("gpu-2", SWAPPED)
        await host("gpu-4")
        await drained()
        judge.published.clear()
        again = DriftJudge(cluster, js)  # a failover in between: the notes are in the analyzer bucket
        await again.tick()
        flagged = [e for e in again.published if e.kind == REPAIR_KIND]
        assert [(e.node, e.severity, e.healthy) for e in flagged] == [("gpu-2", "degraded", False)]
        ev = flagged[0]
        assert ev.attrs["changed"] == ("GPU 0000:1b:00.0: nic 0000:1c:00.0 PIX nvme 0000:1d:00.0 PIX numa 0 -> "
                                       "nic 0000:44:00.0 NODE nvme 0000:1d:00.0 PIX numa 0")
        assert ev.attrs["before"] != ev.attrs["after"] and ev.device.name == "topology.hash"
        env = dict(os.environ, FLEETMEND_NATS_URL=s.nats_url, FLEETMEND_CLUSTER=cluster)
        res = subprocess.run([sys.executable, "-m", "fleetmend.cli.main", "drift", "--json"], env=env,
                             capture_output=True, text=True, timeout=60, check=True)
        after = json.loads(res.stdout)["after_repair"]
        assert [f["node"] for f in after["open"]] == ["gpu-2"]
        # gpu-4's GPU 0 is nearer its NIC than before its drain: no change to flag (a repair that put a NIC back)
        assert [(f["node"], f["like_peers"]) for f in after["recent"]] == [("gpu-2", False)]
        text = subprocess.run([sys.executable, "-m", "fleetmend.cli.main", "drift"], env=env, capture_output=True,
                              text=True, timeout=60, check=True).stdout
        assert "topology of gpu-2 changed across its repair" in " ".join(text.split())
        # the NIC put back where it was: the finding clears
        await host("gpu-2")
        again.published.clear()
        await again.tick()
        cleared = [e for e in again.published if e.kind == REPAIR_KIND]
        assert [(e.node, e.healthy, e.attrs["clearing_kind"]) for e in cleared] == [
            ("gpu-2", True, "config_drift_resolved")]
        doc = json.loads((await (await js.key_value(subjects.ANALYZER_KV_BUCKET)).get(repair_key(cluster))).value)
        assert doc["open"] == {} and doc["watch"] == {}
    finally:
        await nc.close()


async def test_no_pool_no_watch_a_drain_that_changed_nothing_and_one_like_its_peers(
        nats_server, tmp_path: Path, unique: str) -> None:
    cluster = f"rq{unique}"
    s = load_settings(None, cluster=cluster, node="judge", nats_url=nats_server.url, state_dir=tmp_path / "state")
    nc = await connect_nats(s, name="drift-repair2")
    js = nc.jetstream()
    await ensure_fault_stream(js)
    fp_kv = await ensure_fingerprint_stores(js)
    try:
        fps: dict[str, Any] = {}
        for i in range(3):
            fps[f"n{i}"] = read_fingerprint(build_host(tmp_path / f"n{i}"), cluster, f"n{i}")
            await fp_kv.put(subjects.fingerprint_kv_key(cluster, f"n{i}"), fps[f"n{i}"].to_json_bytes())
        judge = DriftJudge(cluster, js)
        await judge.tick()  # no permit pool key for this cluster: nothing watched, nothing written
        assert judge.published == [] and judge.repairs.doc is None
        pool_kv = await permit_bucket(js)
        await pool_kv.put(subjects.permit_kv_key(cluster), PoolState(holders={"n1": Holder(at=1.0)}).to_json())
        await judge.tick()
        await pool_kv.put(subjects.permit_kv_key(cluster), PoolState().to_json())
        await judge.tick()  # returned with the same topology (a GPU swapped in the same slot): nothing to flag
        assert judge.published == [] and judge.repairs.doc == {"watch": {}, "open": {}, "recent": []}
        # a class whose every node has GPU 0's NIC on the far switch: n2 comes back like its peers, no fault
        for node in ("n0", "n1"):
            fp = read_fingerprint(build_host(tmp_path / f"{node}-s", SWAPPED), cluster, node)
            await fp_kv.put(subjects.fingerprint_kv_key(cluster, node), fp.to_json_bytes())
        await pool_kv.put(subjects.permit_kv_key(cluster), PoolState(holders={"n2": Holder(at=2.0)}).to_json())
        await judge.tick()
        fp = read_fingerprint(build_host(tmp_path / "n2-s", SWAPPED), cluster, "n2")
        await fp_kv.put(subjects.fingerprint_kv_key(cluster, "n2"), fp.to_json_bytes())
        await pool_kv.put(subjects.permit_kv_key(cluster), PoolState().to_json())
        judge.published.clear()
        await judge.tick()
        assert [e.kind for e in judge.published] == []  # farther than before, but what its peers have
        (finding,) = judge.repairs.doc["recent"]
        assert finding["node"] == "n2" and finding["like_peers"] and judge.repairs.doc["open"] == {}
    finally:
        await nc.close()


async def test_the_analyzer_credentials_read_the_pool_and_cannot_write_it(secured) -> None:  # noqa: F811
    """Secured NATS: the drift judge reads who is drained with the analyzer's credentials, and only reads."""
    import asyncio

    import nats
    import pytest

    from fleetmend.infra import security
    from tests.test_security import CLUSTER

    url, cs = secured
    admin = await nats.connect(url, nkeys_seed=str(cs.seed_file("admin")))
    pool = await permit_bucket(admin.jetstream())
    await pool.put(subjects.permit_kv_key(CLUSTER), PoolState(holders={"n1": Holder(at=5.0)}).to_json())
    await admin.close()
    an = await nats.connect(url, nkeys_seed=str(cs.seed_file("analyzer")),
                            inbox_prefix=security.role_inbox_prefix("analyzer"))
    try:
        judge = DriftJudge(CLUSTER, an.jetstream())
        assert await judge.repairs.drained() == {"n1": 5.0}
        await judge.tick()  # the whole judge under the analyzer's credentials (fingerprint stores, bucket, pool)
        assert judge.repairs.doc == {"watch": {}, "open": {}, "recent": []}  # n1 has no fingerprint to note
        kv = await an.jetstream().key_value(subjects.PERMIT_KV_BUCKET)
        with pytest.raises((asyncio.TimeoutError, nats.errors.Error)):
            await kv.put(subjects.permit_kv_key(CLUSTER), b"{}")
    finally:
        await an.close()
