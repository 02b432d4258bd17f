"""`fleetmend report` over a large incident ledger: time and memory, beside the raw limit of the same run.

    python bench/ledger_report.py --records 100000

A private nats-server (file store) gets what production writes: `--records` closed incident records (2,000 nodes,
closed over 30 days) under their own keys (`inc.<cluster>.<node>.<drained ms>`, as `LedgerStore.closed` archives
them, in the order they closed; realistic heads of ~1.2 KB and details of ~0.7 KB: versions, serials of 8 GPUs, raw
lines, diagnostics), `--open` records still open (`open.<cluster>.<node>`), and 2,000 fingerprints. Then, each in a
fresh child process (so each peak RSS is its own), all with the same `now`:

- report, unpacked: the report over the records as closed (one message per record), before any roll-up;
- roll-up: `LedgerStore.roll_up` as the worker's elected replica runs it (at most 5,000 records a run, runs until
  none is left: a backlog's first roll-up; afterwards each run packs what closed since the last): every closed
  record into `pack.<cluster>.<close day>.<part>` values, then the records' own messages purged;
- raw: read every message the report reads (the packs, the open records) with the ledger's own consumer
  (`fleetmend.infra.ledger.scan`), decoding nothing: the floor any report over this store pays;
- report: `LedgerStore.read_heads` + `fleet` + `fleetmend.report.build_report` (every figure and the version
  findings) and the JSON the CLI prints, over the packed ledger;
- cli: `fleetmend report --json --since 30d` as an operator runs it, a process from start to exit.

Prints a table: seconds and peak RSS of each, and whether the packed report's JSON equals the unpacked one's
(it must: the same records, the same `now`). Nothing is asserted; the figures go to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
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


def record(i: int, now: float, rng: random.Random, *, closed: bool = True) -> tuple[str, bytes]:
    node = f"gpu-{i % 2000:05d}"
    drained = now - rng.uniform(0, 30 * 86400)
    fc = rng.choice(CLASSES)
    returned = min(drained + rng.uniform(600, 7 * 86400), now - 60) if closed else None
    head = {"v": 1, "cluster": CLUSTER, "node": node, "incident_id": f"remediate/{CLUSTER}/{node}/{i:032x}",
            "workflow_id": f"remediate/{CLUSTER}/{node}", "observed_at": drained - 3, "routed_at": drained - 2.5,
            "drained_at": drained, "drained_by": "router", "drain_state": "drained", "rack": f"r{i % 2000 // 16:03d}",
            "hw_class": "NVIDIA H100 80GB HBM3 x8 | DGX H100 | Intel Xeon Platinum 8480C x2 | MT_0000000838",
            "gpu_count": 8, "fault_class": fc, "kind": "xid", "code": 79, "device": "0000:3b:00.0",
            "severity": "fatal", "diag_first_at": drained + 30, "diag_first_result": "fail", "diags": 2,
            "diag_failed": ["gpu_count"], "recovery": ["reset_gpu:applied", "reboot:applied"], "ticket": f"FM-{i}",
            "ticket_filed_at": drained + 600, "rma": False,
            "versions_drain": {"nvidia_driver": rng.choice(["550.90.07", "535.104.05"]), "vbios": "96.00.74.00.0B",
                               "hca_fw": "28.39.1002", "kernel": "5.15.0-107-generic", "bios": "1.7.0",
                               "cuda": "12.4", "ofed": "24.04-0.6.6"},
            "part": "0000:3b:00.0", "part_serial_drain": f"GPU-{i:08x}", "keys": ["run/1", "run/2", "run/3"]}
    if closed:
        head.update({"ticket_closed_at": returned - 60, "ticket_status": "resolved", "returned_at": returned,
                     "closed_at": returned + 5, "outcome": "returned_after_repair",
                     "versions_return": {"nvidia_driver": "550.90.07"}, "part_serial_return": f"GPU-{i + 1:08x}",
                     "part_not_replaced": False})
    detail = {"raw": "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.\n" * 4,
              "serials_drain": {f"0000:{b:02x}:00.0": f"GPU-{i:08x}-{b:02x}" for b in range(8)},
              "diagnostics": [{"at": drained + 30, "result": "fail", "checks": [
                  {"name": "gpu_count", "result": "fail", "measured": "7", "expected": "8"}]}]}
    if closed:
        key = subjects.ledger_closed_key(CLUSTER, node, int(drained * 1000) + i % 1000)
    else:
        key = subjects.ledger_open_key(CLUSTER, f"open-{i:05d}")
        head["node"] = f"open-{i:05d}"
    return key, _dumps(head) + b"\n" + _dumps(detail)


async def fill(url: str, n: int, n_open: int, now: float) -> int:
    import nats

    from fleetmend.fingerprint import Fingerprint, HardwareClass
    from fleetmend.infra.jetstream import ensure_fingerprint_stores
    from fleetmend.infra.ledger import LedgerStore

    nc = await nats.connect(url)
    js = nc.jetstream()
    await LedgerStore(js).kv()
    fp_kv = await ensure_fingerprint_stores(js)
    rng = random.Random(7)
    for k in range(2000):
        fp = Fingerprint(cluster=CLUSTER, node=f"gpu-{k:05d}", hardware=HardwareClass(gpu_model="H100", gpu_count=8),
                         versions={"nvidia_driver": "535.104.05" if k % 4 == 0 else "550.90.07", "kernel": "5.15.0"})
        await fp_kv.put(subjects.fingerprint_kv_key(CLUSTER, fp.node), fp.to_json_bytes())
    size = 0
    # in the order production archives them (at their close), so the stream holds them as it would
    made = sorted((record(i, now, rng, closed=i < n) for i in range(n + n_open)),
                  key=lambda kd: json.loads(kd[1].partition(b"\n")[0]).get("closed_at") or now)
    for i, (key, data) in enumerate(made):  # core publishes the stream captures (no ack each): not what is measured
        size += len(data)
        await nc.publish(f"$KV.{subjects.LEDGER_KV_BUCKET}.{key}", data)
        if i % 1000 == 999:
            await nc.flush()
    await nc.flush()
    while (await js.stream_info(f"KV_{subjects.LEDGER_KV_BUCKET}")).state.messages < n + n_open:
        await asyncio.sleep(0.2)
    await nc.close()
    return size


def peak_rss_mib() -> float:
    """This process's peak resident set (VmHWM: its own, unlike ru_maxrss, which a child started by fork and exec
    inherits from its parent)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


async def phase(url: str, which: str, now: float, records: int = 0, n_open: int = 0) -> dict:
    import nats

    from fleetmend.infra.ledger import LedgerStore, scan
    from fleetmend.report import FIELDS, ReportParams, build_report

    if which == "cli":  # the operator's command, end to end: interpreter start, imports, connect, read, print
        env = {**os.environ, "FLEETMEND_NATS_URL": url, "FLEETMEND_LOG_FORMAT": "json"}
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "fleetmend.cli.main", "report", "--json", "--cluster", CLUSTER,
                            "--since", "30d"], env=env, capture_output=True, text=True, timeout=600, check=True, cwd=ROOT)
        seconds = time.perf_counter() - t0
        rep = json.loads(p.stdout)
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        return {"seconds": round(seconds, 3), "cpu_s": round(ru.ru_utime + ru.ru_stime, 3), "incidents": rep["incidents"],
                "peak_rss_mib": round(ru.ru_maxrss / 1024, 1)}
    if which == "fill":
        t0 = time.perf_counter()
        size = await fill(url, records, n_open, now)
        return {"seconds": round(time.perf_counter() - t0, 1), "bytes": size}
    nc = await nats.connect(url)
    js = nc.jetstream()
    store = LedgerStore(js)
    await store.kv()
    t0, c0 = time.perf_counter(), time.process_time()
    if which == "raw":
        got = [0, 0]

        def take(_key: str, data: bytes) -> None:
            got[0] += 1
            got[1] += len(data)

        for prefix in (subjects.ledger_pack_prefix(CLUSTER), *subjects.ledger_cluster_prefixes(CLUSTER)):
            await scan(js, subjects.LEDGER_KV_BUCKET, prefix, take)
        out = {"messages": got[0], "bytes": got[1]}
    elif which == "roll_up":  # as the worker's elected replica does it: runs of at most 5,000 until none is left
        out = {"records": 0, "parts": 0, "runs": 0}
        while True:
            got = await store.roll_up(CLUSTER)
            out["records"] += got["records"]
            out["parts"] += got["parts"]
            out["runs"] += 1
            if not got["more"]:
                break
        info = await js.stream_info(f"KV_{subjects.LEDGER_KV_BUCKET}")
        out["stream_messages"], out["stream_bytes"] = info.state.messages, info.state.bytes
    else:
        since = now - 30 * 86400
        heads = await store.read_heads(CLUSTER, fields=FIELDS, since=since)
        fleet = await store.fleet(CLUSTER)
        rep = build_report(heads, ReportParams(since=since, now=now), fleet=fleet, cluster=CLUSTER)
        text = json.dumps(rep)
        out = {"records": len(heads), "incidents": rep["incidents"], "gpu_hours": rep["gpu_hours"],
               "findings": len(rep["findings"]), "json_bytes": len(text),
               "json_sha1": hashlib.sha1(text.encode()).hexdigest()}
    out["seconds"] = round(time.perf_counter() - t0, 3)
    out["cpu_s"] = round(time.process_time() - c0, 3)
    out["peak_rss_mib"] = peak_rss_mib()
    await nc.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--open", type=int, default=200, help="records still open (individual keys)")
    ap.add_argument("--phase", choices=["fill", "raw", "roll_up", "report", "cli"])
    ap.add_argument("--url")
    ap.add_argument("--now", type=float)
    a = ap.parse_args()
    if a.phase:
        print(json.dumps(asyncio.run(phase(a.url, a.phase, a.now, a.records, a.open))))
        return
    now = time.time()

    def child(which: str) -> dict:
        p = subprocess.run([sys.executable, __file__, "--phase", which, "--url", url, "--now", repr(now),
                            "--records", str(a.records), "--open", str(a.open)],
                           capture_output=True, text=True, timeout=1200, check=True)
        return json.loads(p.stdout.strip().splitlines()[-1])

    with tempfile.TemporaryDirectory() as tmp:
        port = servers.free_port()
        proc = servers.start_nats(Path(tmp) / "js", port)
        url = f"nats://127.0.0.1:{port}"
        try:
            filled = child("fill")
            loads = [os.getloadavg()[0]]
            unpacked = child("report")
            rolled = child("roll_up")
            raw = child("raw")
            loads.append(os.getloadavg()[0])
            rep = child("report")
            cli = child("cli")
            loads.append(os.getloadavg()[0])
        finally:
            proc.stop()
    same = "equal" if rep["json_sha1"] == unpacked["json_sha1"] else "DIFFERENT"

    def took(r: dict) -> str:
        return f"{r['seconds']:.2f} s ({r['cpu_s']:.2f} CPU s), peak RSS {r['peak_rss_mib']:.0f} MiB"

    table(f"fleetmend report over {a.records:,} closed + {a.open} open ledger records ({filled['bytes'] / 2**20:.0f} "
          f"MiB as written; {machine()}; load average {min(loads):.1f}–{max(loads):.1f})", [
        ("filled (publish to the bucket)", f"{filled['seconds']:.1f} s"),
        ("report, unpacked (one message per record)", took(unpacked)),
        ("roll-up (pack every closed record, purge its own message)",
         f"{took(rolled)}; {rolled['runs']} runs, {rolled['records']:,} records, {rolled['parts']} pack writes; "
         f"stream now {rolled['stream_messages']:,} messages, {rolled['stream_bytes'] / 2**20:.0f} MiB"),
        ("raw: read every message the report reads, no decoding",
         f"{took(raw)} ({raw['messages']:,} messages, {raw['bytes'] / 2**20:.1f} MiB)"),
        ("report: read heads + fleet + every figure + JSON",
         f"{took(rep)} ({rep['incidents']:,} incidents in 30 d, {rep['findings']} findings)"),
        ("report ÷ raw", f"{rep['seconds'] / max(raw['seconds'], 1e-9):.1f}× the time"),
        ("`fleetmend report --json --since 30d` (the CLI process, start to exit)",
         f"{took(cli)} ({cli['incidents']:,} incidents)"),
        ("report JSON, packed vs unpacked (same now)", same),
    ])


if __name__ == "__main__":
    main()
