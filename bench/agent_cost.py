"""What the node agent costs while idle: CPU % of one core and resident memory, all probes on.

    .venv/bin/python bench/agent_cost.py [--seconds 60] [--warmup-s 10]

Starts a real nats-server (JetStream, temp dir, free port), then the real agent as a subprocess
(`python -m agents`, default periods: heartbeat 10 s, NVML and sysfs polls 30 s, udev and kmsg event
driven; `--hardware` forces the nvml, sysfs and udev probes on), waits `--warmup-s`, then samples the
agent with psutil for `--seconds` (≥ 60 s): CPU % = (user+system CPU seconds) / wall seconds of one
core, RSS mean and max (children included). Beside it, the RSS of a bare
`python -c 'import nats, structlog, asyncio'` (with the agent's lean imports: no aiohttp, no rich)
measured in the same run: the floor any asyncio NATS client in Python pays. bench/agent_memory.py
breaks the agent's RSS down by layer (NVML's share shows only on a host with the driver).
Target: < 1 % of one core and < 60 MiB RSS.
Not a timed test: it prints figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fleetmend.dev import servers  # noqa: E402


def _tree_rss(p: psutil.Process) -> int:
    total = 0
    for q in [p, *p.children(recursive=True)]:
        try:
            total += q.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def _tree_cpu(p: psutil.Process) -> float:
    total = 0.0
    for q in [p, *p.children(recursive=True)]:
        try:
            t = q.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def bare_rss() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.modules['aiohttp'] = sys.modules['rich'] = None; "
                             "import nats, structlog, asyncio, time; print('up', flush=True); "
                             "time.sleep(5)"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    time.sleep(0.5)
    rss = psutil.Process(proc.pid).memory_info().rss
    proc.kill()
    proc.wait()
    return rss


def crash_root(root: Path, agent_state: Path) -> Path:
    """A host root for the lastboot read: a previous boot recorded, a ramoops oops and an efi panic in
    pstore, and a 16 MiB kdump vmcore-dmesg.txt (a real boot log repeated, a panic at its end)."""
    import json

    texts = REPO / "tests" / "crash_texts"
    (root / "proc/sys/kernel/random").mkdir(parents=True)
    (root / "proc/sys/kernel/random/boot_id").write_text("d2b8f1a0-33c4-4b7e-a0e1-5c9e7d4f2a61\n")
    (root / "proc/stat").write_text(f"btime {int(time.time()) - 60}\n")
    ps = root / "sys/fs/pstore"
    ps.mkdir(parents=True)
    (ps / "dmesg-ramoops-0").write_text("Oops#1 Part1\n" + (texts / "mlx5_flower_oops.txt").read_text())
    (ps / "dmesg-efi-159313241100101001").write_text("Panic#1 Part1\n" + (texts / "sched_irq_panic.txt").read_text())
    kd = root / "var/crash/127.0.0.1-2026-01-01-00:00:00"
    kd.mkdir(parents=True)
    boot = (REPO / "tests" / "h200_boot_dmesg.txt").read_text()
    with (kd / "vmcore-dmesg.txt").open("w") as f:
        while f.tell() < 16 * 1024 * 1024:
            f.write(boot)
        f.write((texts / "ghes_fatal_pcie_panic.txt").read_text())
    agent_state.mkdir(parents=True)
    (agent_state / "lastboot.json").write_text(json.dumps({"boot": {
        "boot_id": "6f1c3c3e-8a57-4f0e-9d55-0a4a2d3c9b10", "boot_started_at": "2026-01-01T00:00:00+00:00"}}))
    return root


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--warmup-s", type=float, default=10.0)
    ap.add_argument("--lastboot", choices=("on", "off", "crash"), default="on",
                    help="the start-time read of what survived the previous boot: on (this host's root), "
                         "off, or crash (a host root holding a 16 MiB kdump log, pstore dumps and a "
                         "previous boot, so the read parses them)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="fm-agent-cost-") as tmp:
        d = Path(tmp)
        port = servers.free_port()
        nats = servers.start_nats(d / "js", port)
        env = {**os.environ, "FLEETMEND_NATS_URL": f"nats://127.0.0.1:{port}", "FLEETMEND_STATE_DIR": str(d / "state"),
               "FLEETMEND_LOG_FORMAT": "json", "FLEETMEND_AGENT__NICE": "0",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        if args.lastboot == "off":
            env["FLEETMEND_AGENT__LASTBOOT_ENABLED"] = "false"
        elif args.lastboot == "crash":
            env["FLEETMEND_AGENT__HOST_ROOT"] = str(crash_root(d / "host", d / "state" / "agent" / "bench"))
        log = open(d / "agent.log", "wb")
        agent = subprocess.Popen([sys.executable, "-m", "agents", "--node", "bench", "--cluster", "bench", "--hardware"],
                                 env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            p = psutil.Process(agent.pid)
            time.sleep(args.warmup_s)
            if agent.poll() is not None:
                print((d / "agent.log").read_text()[-3000:])
                return 1
            cpu0, t0 = _tree_cpu(p), time.monotonic()
            rss: list[int] = []
            while time.monotonic() - t0 < args.seconds:
                rss.append(_tree_rss(p))
                time.sleep(1.0)
            cpu1, t1 = _tree_cpu(p), time.monotonic()
            bare = bare_rss()
        finally:
            agent.terminate()
            agent.wait(timeout=30)
            log.close()
            nats.stop()
        started = [line for line in (d / "agent.log").read_text().splitlines() if '"agent_starting"' in line]
        failed = sum('"probe_failed"' in line for line in (d / "agent.log").read_text().splitlines())
        kinds = [json.loads(line).get("kind") for line in (d / "agent.log").read_text().splitlines()
                 if '"fault_published"' in line]
    cpu_pct = 100.0 * (cpu1 - cpu0) / (t1 - t0)
    mib = 1024 * 1024
    probes = "?"
    if started:
        probes = ", ".join(json.loads(started[0]).get("probes", []))
    print(f"agent probes: {probes}; probe failures logged: {failed}; lastboot: {args.lastboot}; "
          f"published at start: {', '.join(str(k) for k in kinds) or 'nothing'}")
    print(f"window {t1 - t0:.1f} s after {args.warmup_s:g} s warm-up")
    print(f"agent CPU     {cpu_pct:.3f} % of one core   (target < 1 %)")
    print(f"agent RSS     mean {sum(rss) / len(rss) / mib:.1f} MiB, max {max(rss) / mib:.1f} MiB   (target < 60 MiB)")
    print(f"bare python -c 'import nats, structlog, asyncio' (no aiohttp, no rich) RSS {bare / mib:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
