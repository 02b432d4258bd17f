"""The clustered chaos claim at CI size (issue 27, point 2): three nats-servers as one JetStream cluster (every
stream and KV bucket at 3 replicas), the Temporal dev server, two fleet clusters each with two routers, two workers
and real agents, the analyzer twice (active and standby). During a burst of 48 faults across both clusters one
worker, one nats-server (the one holding the standby analyzer's consumer), one router and the active analyzer are
killed with SIGKILL, and the nats-server is started again. Every count is read from the systems of record (workflow
status, Temporal's visibility, the drain and ticket buckets, each nats-server's own /jsz). The bench's table is
printed in the test log. About 50-60 s on the 2-core box with other work on it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_clustered_chaos_every_fault_once_budget_held_standby_took_over_nats_caught_up(capsys, tmp_path: Path):
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "chaos_cluster.py"), "--nodes", "6", "--faults", "48",
                        "--duration", "20", "--seed", "11", "--workdir", str(tmp_path / "chaos")],
                       capture_output=True, text=True, timeout=420, cwd=ROOT)
    with capsys.disabled():
        print(p.stdout)
    out = p.stdout
    assert p.returncode == 0, f"clustered chaos claims failed (rc {p.returncode}):\n{out}\n{p.stderr[-3000:]}"
    assert re.search(r"^faults recorded once \(workflow status\)\s+48/48$", out, re.M), out
    assert re.search(r"^faults missing / recorded twice / foreign\s+0 / 0 / 0$", out, re.M), out
    n = int(re.search(r"^incidents \(nodes with a fault\)\s+(\d+)$", out, re.M)[1])
    assert n >= 8 and re.search(rf"^incidents opened once \(Temporal runs\)\s+{n}/{n}$", out, re.M), out
    drained = re.search(r"^drained \(scheduler's drain bucket\)\s+(\d+): east (\d+), west (\d+)$", out, re.M)
    assert drained and int(drained[1]) >= 2, out
    assert re.search(rf"^tickets \(ticket store\) / drained nodes ticketed once\s+{drained[1]} / "
                     rf"{drained[1]}/{drained[1]}$", out, re.M), out
    assert re.search(r"^nodes drained more than once\s+0$", out, re.M), out
    peaks = re.search(r"^most drained at once \(drain records\) / budget\s+east (\d)/(\d), west (\d)/(\d)$", out, re.M)
    assert peaks and int(peaks[1]) <= int(peaks[2]) and int(peaks[3]) <= int(peaks[4]), out
    kills = re.search(r"^kills \(kill -9 at s; back after s, - left dead\)\s+(.*)$", out, re.M)[1]
    for victim in (r"worker-\w+-\d@\d+s\(-\)", r"nats-server-\d@\d+s\(\d+\.\d\)", r"router-\w+-\d@\d+s\(-\)",
                   r"analyzer-\d@\d+s\(-\)"):
        assert re.search(victim, kills), kills
    assert re.search(r"^analyzer: standby took over with its windows\s+yes: lease analyzer-(\d) -> analyzer-(?!\1)\d",
                     out, re.M), out
    assert re.search(r"^streams and buckets at 3 replicas\s+(\d+)/\1 \(\d+ buckets, 5 streams\)$", out, re.M), out
    assert re.search(r"^restarted nats-server-\d: its own /jsz equals the others'\s+(\d+)/\1 streams and buckets",
                     out, re.M), out
    assert "PASS" in out
