"""`nvbandwidth` plain-text output → one number per matrix, for `fleetmend sweep` (agents/bench.py).

Format (NVIDIA nvbandwidth v0.2-v0.8, `output.cpp` and `inline_common.h` of that tool): a header
(version, CUDA/driver versions, `Device N: ...` lines), then per testcase

    Running host_to_device_memcpy_ce.                       (older releases: `Waiving <key>.` instead)
    memcpy CE CPU(row) -> GPU(column) bandwidth (GB/s)      description; unit in the last parentheses
               0         1         2                        column labels
     0     55.61     55.63     55.60                        row label, then one cell per column
                                                            ("N/A" where a pair is not measured)
    SUM host_to_device_memcpy_ce 166.84                     (with --perfFormatter: `&&&& PERF <key> <sum> +GB/s`)

A testcase may print several matrices (the bidirectional device-to-device ones print `_read1`,
`_read2`, `_total`); each matrix's own key is the one on its SUM line. `Waived: ` (or `Waiving
<key>.`) marks a testcase the system cannot run (no peer access, one GPU); `Error: <text>` or
`ERROR: <text>` one that failed.

What a matrix becomes: its worst cell, i.e. the slowest link of the node, not the SUM. A node with
one GPU on a degraded PCIe link (x8, Gen3) loses half the bandwidth on that GPU but only 1/16 of the
SUM of 8 GPUs, inside the sweep's 5 % tolerance; a synchronous job runs at the pace of that one GPU.
Bandwidth (GB/s) → the minimum cell; latency (ns, the `*_latency_sm` testcases) → the maximum cell,
named `nvb_<key>_ns`.
The diagonal of a square GPU×GPU matrix is not a link (a GPU with itself: `N/A`, or `0.00` in
releases before v0.5) and is left out. Every other `0.00` counts: a link that moved nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_RUNNING = re.compile(r"^Running (\S+)\.\s*$")
_WAIVING = re.compile(r"^Waiving (\S+)\.\s*$")
_DESC = re.compile(r"\((GB/s|ns)\)\s*$")
_SUM = re.compile(r"^(?:SUM|&&&& PERF) (\S+) (-?\d+(?:\.\d+)?)")
_STATUS = re.compile(r"^(Waived|Error|ERROR):\s*(.*)$")


@dataclass
class Matrix:
    key: str
    unit: str
    """"GB/s" or "ns"."""
    description: str
    cells: list[list[float | None]]
    sum: float | None = None

    def worst(self) -> float | None:
        """Minimum bandwidth / maximum latency over the measured cells (diagonal of a GPU×GPU matrix
        left out); None when nothing was measured."""
        square_gpu = (len(self.cells) > 1 and all(len(r) == len(self.cells) for r in self.cells)
                      and "GPU(row)" in self.description and "GPU(column)" in self.description)
        vals = [v for i, row in enumerate(self.cells) for j, v in enumerate(row)
                if v is not None and not (square_gpu and i == j)]
        if not vals:
            return None
        return max(vals) if self.unit == "ns" else min(vals)


@dataclass
class Result:
    matrices: list[Matrix] = field(default_factory=list)
    waived: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    """testcase (or "nvbandwidth") → the tool's message."""


def _number(tok: str) -> float | None:
    if tok == "N/A":
        return None
    return float(tok)


def parse(text: str) -> Result:
    """Parse nvbandwidth's plain output (any number of testcases). Never raises on odd input: lines
    it does not recognise are skipped; a matrix whose cells do not add up to its SUM line is
    reported in `errors` rather than trusted."""
    res = Result()
    current: str | None = None
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].rstrip()
        s = line.strip()
        i += 1
        if m := _RUNNING.match(s):
            current = m.group(1)
            continue
        if m := _WAIVING.match(s):
            res.waived.append(m.group(1))
            current = None
            continue
        if m := _STATUS.match(s):
            if m.group(1) == "Waived":
                res.waived.append(current or "?")
            else:
                res.errors[current or "nvbandwidth"] = m.group(2).strip() or m.group(1)
            current = None
            continue
        if not (m := _DESC.search(s)) or ("bandwidth" not in s.lower() and "latency" not in s.lower()):
            continue
        unit, desc = m.group(1), s
        # header row of column labels, then rows until a blank line or the SUM line
        if i >= len(lines):
            break
        ncols = len(lines[i].split())
        i += 1
        cells: list[list[float | None]] = []
        bad = False
        while i < len(lines) and lines[i].strip() and not _SUM.match(lines[i].strip()):
            toks = lines[i].split()
            i += 1
            if len(toks) != ncols + 1:
                bad = True
                continue
            try:
                cells.append([_number(t) for t in toks[1:]])
            except ValueError:
                bad = True
        key, total = current or "?", None
        while i < len(lines) and not lines[i].strip():
            i += 1
        if i < len(lines) and (sm := _SUM.match(lines[i].strip())):
            key, total = sm.group(1), float(sm.group(2))
            i += 1
        if bad or not cells:
            res.errors[key] = f"unreadable matrix under {desc!r}"
            continue
        mat = Matrix(key=key, unit=unit, description=desc, cells=cells, sum=total)
        parsed = sum(v for r in cells for v in r if v is not None)
        if total is not None and abs(parsed - total) > 0.01 * sum(len(r) for r in cells) + 0.01:
            res.errors[key] = f"cells add up to {parsed:.2f}, SUM line says {total:.2f}"
            continue
        res.matrices.append(mat)
    return res


def metric_name(m: Matrix) -> str:
    """`nvbandwidth_<key>_gbps` (higher is better) or `nvb_<key>_ns` for a latency matrix (lower is
    better): `fleetmend.sweep.lower_is_better` reads any name containing "bandwidth" as a rate, so
    the latency names carry the short prefix."""
    if m.unit == "ns":
        return f"nvb_{m.key}_ns"
    return f"nvbandwidth_{m.key}_gbps"


def metrics(res: Result) -> dict[str, float]:
    """One number per measured matrix (see module docstring)."""
    out = {}
    for m in res.matrices:
        w = m.worst()
        if w is not None:
            out[metric_name(m)] = round(w, 3)
    return out
