"""What reading the node fingerprint costs: the agent reads it at start, every 15 min and on a device change.

    .venv/bin/python bench/inventory_cost.py [--root /] [--repeat 20] [--json]

Reads `agents.inventory.read_fingerprint` over `--root` (default: a synthesised 8-GPU host built from the kernel's
documented formats, tests/fixtures/hosts/synth.py; `--root /` reads this machine) `--repeat` times and prints the
median and worst wall time beside a bare `os.listdir` walk of the same directories the reader lists (the floor any
reader pays), and the raw limit: 200 ms per read (issue 25). At 900 s between reads, 200 ms is 0.022 % of one
core; the agent's budget is 0.1 %. Not a timed test: it prints figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LIMIT_MS = 200.0
INTERVAL_S = 900.0


def bare_walk(root: Path) -> int:
    """List the directories the reader lists (PCI devices and each device dir, cpu dirs, infiniband, net, irq)."""
    n = 0
    for rel in ("sys/bus/pci/devices", "sys/devices/system/cpu", "sys/class/infiniband", "sys/class/net",
                "sys/kernel/iommu_groups", "proc/irq"):
        try:
            names = os.listdir(root / rel)
        except OSError:
            continue
        n += len(names)
        if rel == "sys/bus/pci/devices":
            for name in names:
                try:
                    n += len(os.listdir(root / rel / name))
                except OSError:
                    pass
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=None)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from agents.inventory import read_fingerprint

    tmp = None
    root = args.root
    if root is None:
        from tests.fixtures.hosts.synth import build_host

        tmp = tempfile.TemporaryDirectory()
        root = build_host(Path(tmp.name) / "host")
    reads, walks = [], []
    fp = None
    for _ in range(args.repeat):
        t = time.perf_counter()
        fp = read_fingerprint(root, "bench", "bench")
        reads.append((time.perf_counter() - t) * 1000)
        t = time.perf_counter()
        bare_walk(root)
        walks.append((time.perf_counter() - t) * 1000)
    assert fp is not None
    med = statistics.median(reads)
    out = {"root": str(args.root or "synthesised 8-GPU host"), "gpus": fp.hardware.gpu_count, "nics": len(fp.nics),
           "settings": len(fp.settings), "read_ms_median": round(med, 2), "read_ms_max": round(max(reads), 2),
           "bare_listdir_walk_ms_median": round(statistics.median(walks), 2), "limit_ms": LIMIT_MS,
           "core_share_pct_at_900s": round(med / 1000 / INTERVAL_S * 100, 5)}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"fingerprint read over {out['root']}: {out['gpus']} GPUs, {out['nics']} NICs, {out['settings']} settings")
        print(f"  read_fingerprint   median {out['read_ms_median']:8.2f} ms   max {out['read_ms_max']:8.2f} ms"
              f"   (limit {LIMIT_MS:.0f} ms)")
        print(f"  bare os.listdir    median {out['bare_listdir_walk_ms_median']:8.2f} ms")
        print(f"  core share at one read per {INTERVAL_S:.0f} s: {out['core_share_pct_at_900s']:.5f} % (budget 0.1 %)")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
