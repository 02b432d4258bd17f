"""What the kernel-log parser costs per line: the agent parses every /dev/kmsg record it reads.

    .venv/bin/python bench/kmsg_parse_cost.py [--repeat 20]

Feeds `KmsgParser` (a) a real H200 host's boot log (tests/h200_boot_dmesg.txt: no faults, the common case)
and (b) every kernel-log case of `--corpus` (default tests/corpus; fault-dense), each `--repeat` times, and
prints µs per line (best of 3) and the memory the parser modules add once imported beyond the contract and
catalog (tracemalloc of `import agents.kmsg, agents.parsers` plus one parse).
Run it on two checkouts to compare a change. Not a timed test: it prints figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--corpus", type=Path, default=REPO / "tests" / "corpus", help="directory with cases*.jsonl")
    args = ap.parse_args()
    from fleetmend.catalog import default_catalog
    from fleetmend.events import FaultEvent  # noqa: F401

    default_catalog()
    tracemalloc.start()
    import agents.parsers  # noqa: F401
    from agents.kmsg import KmsgParser

    boot = (REPO / "tests" / "h200_boot_dmesg.txt").read_text().splitlines()
    corpus: list[str] = []
    for name in ("cases.jsonl", "cases-new.jsonl", "cases-more.jsonl"):
        path = args.corpus / name
        if path.exists():
            for line in path.read_text().splitlines():
                c = json.loads(line)
                if c["kind"] == "kmsg":
                    corpus += c["raw"].splitlines()
    p = KmsgParser("c", "n", "bench")
    for line in boot[:200]:
        p.feed(line)
    p.flush()
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"parser modules (beyond the contract) + one parse: {size / 1024:.0f} KiB traced")
    for label, lines in (("H200 boot log (no faults)", boot), ("corpus kernel logs (faults)", corpus)):
        best = float("inf")
        for _ in range(3):
            p = KmsgParser("c", "n", "bench")
            t0 = time.perf_counter()
            for _ in range(args.repeat):
                for line in lines:
                    p.feed(line)
                p.flush()
            best = min(best, time.perf_counter() - t0)
        n = len(lines) * args.repeat
        print(f"{label}: {len(lines)} lines x {args.repeat}: {1e6 * best / n:.1f} µs/line ({n / best:,.0f} lines/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
