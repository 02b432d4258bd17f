"""Run every benchmark at a chosen size and write the tables to a Markdown file.

    python bench/run_all.py --size small            # minutes; a smoke run
    python bench/run_all.py --size full --out /tmp/full.md  # ~35 min; tables only

The tables go to `--out` (overwritten) and stdout. bench/RESULTS.md is the curated record: its
summary, the GPU section and the 100k-node arithmetic are written by hand around tables copied
from such a file, so never pass it as `--out`.

Each benchmark runs in its own process (its own NATS + Temporal on free ports) so one cannot
inherit another's backlog. Sizes:

| size  | pipeline (nodes/events) | quarantine nodes (scaling curve) | storm (nodes/events) | agent cost |
|-------|-------------------------|----------------------------------|----------------------|------------|
| small | 1k / 2k                 | 1k                               | 200 / 20k            | 20 s       |
| medium| 1k, 3k, 10k / 5k        | 1k, 3k, 10k                      | 2k / 100k            | 60 s       |
| full  | 1k, 3k, 10k / 10k       | 1k, 3k, 10k                      | 2k / 1M              | 60 s       |
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PY = sys.executable

SIZES = {
    "small": {
        "pipeline": [["--nodes", "1000", "--events", "2000", "--raw", "10000", "--sws", "500"]],
        "quarantine": [["--nodes", "1000", "--faults", "20", "--rate", "3"]],
        "storm": [["--nodes", "200", "--events", "20000"]],
        "agent": [["--seconds", "20"]],
    },
    "medium": {
        "pipeline": [["--nodes", n, "--events", "5000", "--raw", "30000", "--sws", "1000"]
                     for n in ("1000", "3000", "10000")],
        "quarantine": [["--nodes", n, "--faults", "30", "--rate", "2"] for n in ("1000", "3000", "10000")]
        + [["--nodes", "10000", "--faults", "200", "--rate", "20", "--modes", "real-drain"],
           ["--nodes", "10000", "--modes", "burst", "--burst", "1000"]],
        "storm": [["--nodes", "2000", "--events", "100000"]],
        "agent": [["--seconds", "60"]],
    },
    "full": {
        "pipeline": [["--nodes", n, "--events", "10000", "--raw", "50000", "--sws", "2000"]
                     for n in ("1000", "3000", "10000")],
        "quarantine": [["--nodes", n, "--faults", "50", "--rate", "2"] for n in ("1000", "3000", "10000")]
        + [["--nodes", "10000", "--faults", f, "--rate", r, "--modes", "real-drain"] for f, r in (("200", "20"),
                                                                                                   ("500", "50"))]
        + [["--nodes", "10000", "--modes", "burst", "--burst", "1000"]],
        "storm": [["--nodes", "2000", "--events", "1000000"]],
        "agent": [["--seconds", "60"]],
    },
}


def run(script: str, args: list[str]) -> str:
    path = HERE / f"{script}.py"
    if not path.exists():
        return f"\n## {script}\n\n(not available: {path.name} missing)\n"
    cmd = [PY, str(path), *args]
    print(f"$ {' '.join(cmd[1:])}", flush=True)
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True)
    took = time.monotonic() - t0
    m = re.search(r"\n## .*", p.stdout, re.S)
    if m:
        body = m.group(0) + (f"\n(exit status {p.returncode}: a claim of the bench failed, see the table)\n"
                             if p.returncode else "")
    elif p.returncode == 0:
        body = f"\n## {script} {' '.join(args)}\n\n```\n{p.stdout.strip()[-3000:]}\n```\n"
    else:
        body = f"\n## {script} {' '.join(args)}\n\n(failed, rc {p.returncode})\n```\n{p.stderr[-3000:]}\n```\n"
    print(body, flush=True)
    return f"{body}\n\nCommand: `python bench/{script}.py {' '.join(args)}` ({took:.0f} s wall)\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--only", default="", help="comma-separated subset: pipeline,quarantine,storm,agent")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    only = set(filter(None, a.only.split(",")))
    parts = [f"# fleetmend benchmarks ({a.size}, {time.strftime('%Y-%m-%d %H:%M %Z')})\n",
             f"Reproduce: `python bench/run_all.py --size {a.size}`\n"]
    scripts = {"pipeline": "pipeline", "quarantine": "quarantine", "storm": "storm", "agent": "agent_cost"}
    for key, runs in SIZES[a.size].items():
        if only and key not in only:
            continue
        for args in runs:
            parts.append(run(scripts[key], args))
    text = "\n".join(parts)
    if a.out:
        a.out.write_text(text)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
