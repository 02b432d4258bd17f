"""`fleetmend report` over a large incident ledger: time and memory, beside the raw limit of the same run.

    python bench/ledger_report.py --records 100000

A private nats-server (file store) gets `--records` closed incident records in the ledger bucket (realistic
heads of ~0.9 KB and details of ~0.9 KB: versions, serials of 8 GPUs, raw lines, diagnostics), published
straight to the bucket's subjects, plus 2,000 fingerprints. Then, in fresh child processes (so each peak RSS is
its own):

- raw: read every record from the bucket's stream with the ledger's own consumer (`fleetmend.infra.ledger.scan`),
  decoding nothing: the floor any report over this store pays;
- report: `LedgerStore.read_heads` + `fleet` + `fleetmend.report.build_report` (every figure and the version
  findings) and the JSON the CLI prints.

Prints a table: seconds and peak RSS of each. Nothing is asserted; the figures go to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _dumps(obj: object) -> bytes:
    """Compact JSON bytes (the ledger's stored form)."""
    return json.dumps(obj, separators=(",", ":")).encode()


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import machine, table  # noqa: E402
from fleetmend import subjects  # noqa: E402
from fleetmend.dev import servers  # noqa: E402

CLUSTER = "bench"
CLASSES = ["xid79", "xid48", "xid94", "xid95", "fail_slow", "ib_port_down", "nvlink_down", "aer_fatal"]


def record(i: int, now: float, rng: random.Random) -> tuple[str, bytes]:
    node = f"gpu-{i % 2000:05d}"
    drained = now - rng.uniform(0, 30 * 86400)
    fc = rng.choice(CLASSES)
    returned = drained + rng.uniform(600, 7 * 86400)
    head = {"v": 1, "cluster": CLUSTER, "node": node, "incident_id": f"remediate/{CLUSTER}/{node}/{i:032x}",
            "workflow_id": f"remediate/{CLUSTER}/{node}", "observed_at": drained - 3, "routed_at": drained - 2.5,
            "drained_at": drained, "drained_by": "router", "drain_state": "drained", "rack": f"r{i % 2000 // 16:03d}",
            "hw_class": "NVIDIA H100 80GB HBM3 x8 | DGX H100 | Intel Xeon Platinum 8480C x2 | MT_0000000838",
            "gpu_count": 8, "fault_class": fc, "kind": "xid", "code": 79, "device": "0000:3b:00.0",
            "severity": "fatal", "diag_first_at": drained + 30, "diag_first_result": "fail", "diags": 2,
            "diag_failed": ["gpu_count"], "recovery": ["reset_gpu:applied", "reboot:applied"], "ticket": f"FM-{i}",
            "ticket_filed_at": drained + 600, "ticket_closed_at": returned - 60, "ticket_status": "resolved",
            "rma": False, "returned_at": returned, "closed_at": returned + 5, "outcome": "returned_after_repair",
            "versions_drain": {"nvidia_driver": rng.choice(["550.90.07", "535.104.05"]), "vbios": "96.00.74.00.0B",
                               "hca_fw": "28.39.1002", "kernel": "5.15.0-107-generic", "bios": "1.7.0",
                               "cuda": "12.4", "ofed": "24.04-0.6.6"},
            "versions_return": {"nvidia_driver": "550.90.07"}, "part": "0000:3b:00.0",
            "part_serial_drain": f"GPU-{i:08x}", "part_serial_return": f"GPU-{i + 1:08x}", "part_not_replaced": False,
            "keys": ["run/1", "run/2", "run/3"]}
    detail = {"raw": "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.\n" * 4,
              "serials_drain": {f"0000:{b:02x}:00.0": f"GPU-{i:08x}-{b:02x}" for b in range(8)},
              "diagnostics": [{"at": drained + 30, "result": "fail", "checks": [
                  {"name": "gpu_count", "result": "fail", "measured": "7", "expected": "8", "detail": ""}]}]}
    key = subjects.ledger_closed_key(CLUSTER, node, int(drained * 1000) + i % 1000)
    return key, _dumps(head) + b"\n" + _dumps(detail)


async def fill(url: str, n: int) -> int:
    import nats

    from fleetmend.fingerprint import Fingerprint, HardwareClass
    from fleetmend.infra.jetstream import ensure_fingerprint_stores
    from fleetmend.infra.ledger import LedgerStore

    nc = await nats.connect(url)
    js = nc.jetstream()
    await LedgerStore(js).kv()
    fp_kv = await ensure_fingerprint_stores(js)
    rng = random.Random(7)
    now = time.time()
    for k in range(2000):
        fp = Fingerprint(cluster=CLUSTER, node=f"gpu-{k:05d}", hardware=HardwareClass(gpu_model="H100", gpu_count=8),
                         versions={"nvidia_driver": "535.104.05" if k % 4 == 0 else "550.90.07", "kernel": "5.15.0"})
        await fp_kv.put(subjects.fingerprint_kv_key(CLUSTER, fp.node), fp.to_json_bytes())
    size = 0
    for i in range(n):  # core publishes the stream captures (no ack each): the fill is not what is measured
        key, data = record(i, now, rng)
        size += len(data)
        await nc.publish(f"$KV.{subjects.LEDGER_KV_BUCKET}.{key}", data)
        if i % 1000 == 999:
            await nc.flush()
    await nc.flush()
    while (await js.stream_info(f"KV_{subjects.LEDGER_KV_BUCKET}")).state.messages < n:
        await asyncio.sleep(0.2)
    await nc.close()
    return size


async def phase(url: str, which: str) -> dict:
    import nats

    from fleetmend.infra.ledger import LedgerStore, scan
    from fleetmend.report import FIELDS, ReportParams, build_report

    nc = await nats.connect(url)
    store = LedgerStore(nc.jetstream())
    t0 = time.perf_counter()
    if which == "raw":
        got = [0, 0]

        def take(_key: str, data: bytes) -> None:
            got[0] += 1
            got[1] += len(data)

        await store.kv()
        await scan(nc.jetstream(), subjects.LEDGER_KV_BUCKET, f"inc.{CLUSTER}.", take)
        out = {"records": got[0], "bytes": got[1]}
    else:
        heads = await store.read_heads(CLUSTER, fields=FIELDS)
        fleet = await store.fleet(CLUSTER)
        now = time.time()
        rep = build_report(heads, ReportParams(since=now - 30 * 86400, now=now), fleet=fleet, cluster=CLUSTER)
        text = json.dumps(rep)
        out = {"records": len(heads), "incidents": rep["incidents"], "gpu_hours": rep["gpu_hours"],
               "findings": len(rep["findings"]), "json_bytes": len(text)}
    out["seconds"] = round(time.perf_counter() - t0, 3)
    out["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    await nc.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--phase", choices=["raw", "report"])
    ap.add_argument("--url")
    a = ap.parse_args()
    if a.phase:
        print(json.dumps(asyncio.run(phase(a.url, a.phase))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        port = servers.free_port()
        proc = servers.start_nats(Path(tmp) / "js", port)
        url = f"nats://127.0.0.1:{port}"
        try:
            t0 = time.perf_counter()
            size = asyncio.run(fill(url, a.records))
            fill_s = time.perf_counter() - t0
            res = {}
            for which in ("raw", "report"):
                p = subprocess.run([sys.executable, __file__, "--phase", which, "--url", url], capture_output=True,
                                   text=True, timeout=600, check=True)
                res[which] = json.loads(p.stdout.strip().splitlines()[-1])
        finally:
            proc.stop()
    raw, rep = res["raw"], res["report"]
    print(table(f"fleetmend report over {a.records:,} ledger records ({size / 2**20:.0f} MiB stored; {machine()})", [
        ("filled (publish to the bucket)", f"{fill_s:.1f} s"),
        ("raw: read every record, no decoding", f"{raw['seconds']:.2f} s, peak RSS {raw['peak_rss_mib']:.0f} MiB "
                                                f"({raw['records']:,} records, {raw['bytes'] / 2**20:.0f} MiB)"),
        ("report: read heads + fleet + every figure + JSON", f"{rep['seconds']:.2f} s, peak RSS "
                                                            f"{rep['peak_rss_mib']:.0f} MiB ({rep['incidents']:,} "
                                                            f"incidents in 30 d, {rep['findings']} findings)"),
        ("report ÷ raw", f"{rep['seconds'] / max(raw['seconds'], 1e-9):.1f}× the time"),
    ]))


if __name__ == "__main__":
    main()
