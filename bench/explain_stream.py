"""`fleetmend explain` on a 100 MB kernel log: peak RSS, time, ratio to a bare Python loop, faults found.

    .venv/bin/python bench/explain_stream.py [--mb 100] [--plant-every-kb 100] [--distinct]

Builds a kernel log of `--mb` MB (in a temp dir; FLEETMEND_BENCH_KEEP=1 keeps it) from a real boot
log (tests/h200_boot_dmesg.txt, an H200 host: the noise, which holds no fault) with its uptime stamps
rewritten to keep rising, and plants a real fault text every `--plant-every-kb` KB: every kernel-log
case of the corpus (tests.corpus_paths.load_cases("kmsg")) and tests/crash_texts/*, in turn, each
between blank lines. Faults planted = the events the line parser finds in each planted text alone.

Then it times, on the same file:
    bare loop        `for line in open(path, errors="replace"): pass` (and in binary mode)
    explain          `fleetmend explain FILE --json` as a child process (output counted, not kept):
                     wall and CPU time, peak RSS (ru_maxrss of the child), events found, exit status
and prints the ratio explain / bare loop, of CPU time (user + system; on a shared machine wall time
measures the neighbours) and of wall time. Targets: peak RSS < 150 MiB, ratio < 20x, found == planted.
Not a timed test: it prints figures.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

_UP = re.compile(r"^\[\s*(\d+)\.(\d+)\]")


def planted_texts() -> list[tuple[str, str]]:
    from tests.corpus_paths import load_cases

    texts = [(c["id"], c["raw"]) for c in load_cases("kmsg")]
    texts += [(p.name, p.read_text()) for p in sorted((REPO / "tests/crash_texts").glob("*.txt"))]
    return texts


def build(path: Path, mb: int, every_kb: int, distinct: bool = False) -> tuple[int, collections.Counter[str], int]:
    """Write the log; returns (events planted, their kinds, texts planted). `distinct` appends a running
    number to every noise line, so no message repeats (the streaming parser remembers messages that
    started nothing; a real log repeats many of its messages, the boot log cycled here repeats all)."""
    from agents.kmsg import parse_text

    noise = (REPO / "tests/h200_boot_dmesg.txt").read_text().splitlines()
    assert not parse_text("\n".join(noise), node="n"), "the noise must hold no fault"
    texts = planted_texts()
    expected = [parse_text(raw, node="n") for _, raw in texts]
    target = mb * 1_000_000
    planted = planted_texts_n = 0
    kinds: collections.Counter[str] = collections.Counter()
    offset = 0.0
    written = 0
    next_plant = every_kb * 1000
    i = serial = 0
    with path.open("w") as f:
        while written < target:
            for ln in noise:
                m = _UP.match(ln)
                if m:
                    ts = float(f"{m[1]}.{m[2]}") + offset
                    ln = f"[{ts:12.6f}]" + ln[m.end():]
                if distinct:
                    serial += 1
                    ln = f"{ln} #{serial}"
                f.write(ln + "\n")
                written += len(ln) + 1
                if written >= next_plant and written < target:
                    k = i % len(texts)
                    block = "\n" + texts[k][1].rstrip("\n") + "\n\n"
                    f.write(block)
                    written += len(block)
                    planted += len(expected[k])
                    kinds.update(e.kind for e in expected[k])
                    planted_texts_n += 1
                    i += 1
                    next_plant += every_kb * 1000
            offset += 100.0
    return planted, kinds, planted_texts_n


def bare_loop(path: Path, mode: str) -> tuple[float, float]:
    """(wall s, CPU s) of one bare pass over the lines."""
    t0, c0 = time.perf_counter(), time.process_time()
    if mode == "text":
        with path.open(errors="replace") as f:
            for _ in f:
                pass
    else:
        with path.open("rb") as f:
            for _ in f:
                pass
    return time.perf_counter() - t0, time.process_time() - c0


def run_explain(path: Path) -> tuple[float, float, int, int, collections.Counter[str], int]:
    """(wall s, CPU s, peak RSS KiB, events, kinds, exit status) of `fleetmend explain FILE --json`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", "from fleetmend.cli.entry import main; main()",
                             "explain", str(path), "--json"], stdout=subprocess.PIPE, env=env)
    n = 0
    kinds: collections.Counter[str] = collections.Counter()
    assert proc.stdout is not None
    for line in proc.stdout:
        n += 1
        kinds[json.loads(line)["kind"]] += 1
    _, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    return wall, ru.ru_utime + ru.ru_stime, ru.ru_maxrss, n, kinds, os.waitstatus_to_exitcode(status)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--plant-every-kb", type=int, default=100)
    ap.add_argument("--distinct", action="store_true",
                    help="no noise message repeats (worst case for the parser's memory of inert messages)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fm-explain-"))
    try:
        path = tmp / "kern.log"
        t0 = time.perf_counter()
        planted, pkinds, ntexts = build(path, args.mb, args.plant_every_kb, args.distinct)
        size = path.stat().st_size
        lines = sum(1 for _ in path.open("rb"))
        print(f"log: {size / 1e6:.1f} MB, {lines:,} lines{' (no noise message repeats)' if args.distinct else ''}, "
              f"{ntexts} fault texts planted "
              f"({planted} events expected), built in {time.perf_counter() - t0:.1f} s")
        bare_t = min(bare_loop(path, "text") for _ in range(3))
        bare_b = min(bare_loop(path, "bytes") for _ in range(3))
        wall, cpu, rss_kib, found, fkinds, rc = run_explain(path)
        print(f"bare loop     text {bare_t[0]:.2f} s wall / {bare_t[1]:.2f} s CPU, binary {bare_b[0]:.2f} / "
              f"{bare_b[1]:.2f} s (best of 3; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs: "
              "other work shares them, so CPU time is the fair measure)")
        print(f"explain       {wall:.2f} s wall, {cpu:.2f} s CPU (start-up included) = {cpu / bare_t[1]:.1f}x the "
              f"text loop's CPU ({cpu / bare_b[1]:.1f}x binary; wall {wall / bare_t[0]:.1f}x)   (target < 20x)")
        print(f"peak RSS      {rss_kib / 1024:.1f} MiB   (target < 150 MiB)")
        print(f"faults        found {found} / planted {planted}; exit status {rc}")
        diff = {k: (fkinds[k], pkinds[k]) for k in set(fkinds) | set(pkinds) if fkinds[k] != pkinds[k]}
        if diff:
            print(f"kinds differing (found, planted): {diff}  (history rules such as the AER burst turn "
                  "repeats of one device into another kind across the log)")
    finally:
        if os.environ.get("FLEETMEND_BENCH_KEEP") == "1":
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
