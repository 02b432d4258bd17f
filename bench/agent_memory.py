"""Where the node agent's memory goes: RSS after each layer, each measured in a fresh interpreter, and the
live agent itself.

    python bench/agent_memory.py [--live-s 8]

Prints, per step, VmRSS and its parts from /proc/self/status: RssAnon (private heap: what the
process itself costs) and RssFile (mapped files, mostly shared-library code that every process
on the node maps from the same page cache). Steps:

    interpreter        python -c pass
    asyncio+ssl        the raw limit: any asyncio Python process that can speak TLS (asyncio imports ssl)
    nats+structlog     the floor of any asyncio NATS client in Python (bench/agent_cost.py's "bare")
    +pydantic model    + one pydantic model class: the floor of any process that speaks the pydantic contract
    +FaultEvent        + the event contract (fleetmend.events)
    +settings          + fleetmend.config loaded (pydantic-settings and the settings tree)
    +catalog           + the fault catalog loaded (every XID and kind row)
    +agent modules     every module the live agent imports (runner, probes, kmsg parser, spool, publisher,
                       inventory, metrics)
    live agent         `python -m agents --hardware` itself, NATS away (it spools and keeps retrying), after
                       `--live-s` seconds: every probe running (on a host without NVIDIA GPUs the NVML probe
                       does not apply and NVML is not loaded)

Every step except the bare interpreter, the raw limit and "nvml alone" uses the agent's lean imports
(agents/__main__.py: no aiohttp, no rich), as the agent does.
    nvml alone         interpreter + pynvml + nvmlInit(): the floor any in-process NVML reader pays
    +nvml init         the agent's modules plus nvmlInit, GPU handles and the XID event set, then
                       the probe's heap trim (agents/nvml.py trim_heap)

On a host without the NVIDIA driver the NVML steps say so. Not a timed test: it prints figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_READ = """
import json
def _rss():
    out = {}
    for line in open('/proc/self/status'):
        k, _, v = line.partition(':')
        if k in ('VmRSS', 'RssAnon', 'RssFile', 'RssShmem'):
            out[k] = int(v.split()[0]) / 1024
    return out
"""

_NVML = """
note = ''
try:
    import pynvml
    pynvml.nvmlInit()
    n = pynvml.nvmlDeviceGetCount()
    hs = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
    if FULL:
        es = pynvml.nvmlEventSetCreate()
        for h in hs:
            try:
                pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, es)
            except pynvml.NVMLError:
                pass
    note = f'{n} GPU(s), driver {pynvml.nvmlSystemGetDriverVersion()}'
    if FULL:
        from agents.nvml import trim_heap
        trim_heap()
except Exception as err:
    note = f'NVML unavailable: {type(err).__name__}'
"""

LEAN = "import sys\nsys.modules.setdefault('aiohttp', None)\nsys.modules.setdefault('rich', None)\n"
# what agents.__main__.lean_imports does for a nats:// URL, without importing agents.__main__ (which loads
# fleetmend.config, so every step would include pydantic-settings); the last steps call it for real
"""Every step but the bare interpreter and `nvml alone` runs with the agent's lean imports (no aiohttp,
no rich), as the agent does, so each row adds to the one before."""

AGENT_MODULES = ("from agents.__main__ import lean_imports\nlean_imports('nats://x:4222')\n"
                 "import asyncio, nats, structlog\nfrom fleetmend.config import load_settings\nload_settings()\n"
                 "from fleetmend.catalog import default_catalog\ndefault_catalog()\n"
                 "import agents.runner, agents.nvml, agents.kmsg.probe, agents.sysfs, agents.udev, agents.spool, "
                 "agents.publisher, agents.diag, agents.recovery, agents.lastboot, agents.inventory.probe\n")

STEPS: list[tuple[str, str]] = [
    ("interpreter", "note = ''"),
    ("asyncio+ssl", "import asyncio, ssl; note = ''"),
    ("nats+structlog", LEAN + "import asyncio, nats, structlog; note = ''"),
    ("+pydantic model", LEAN + "import asyncio, nats, structlog, pydantic\nclass M(pydantic.BaseModel):\n"
                        "    x: int\nnote = ''"),
    ("+FaultEvent", LEAN + "import asyncio, nats, structlog\nfrom fleetmend.events import FaultEvent; note = ''"),
    ("+settings", LEAN + "import asyncio, nats, structlog\nfrom fleetmend.config import load_settings\n"
                  "load_settings(); note = ''"),
    ("+catalog", LEAN + "import asyncio, nats, structlog\nfrom fleetmend.config import load_settings\n"
                 "load_settings()\nfrom fleetmend.catalog import default_catalog\ndefault_catalog(); note = ''"),
    ("+agent modules", AGENT_MODULES + "note = ''"),
    ("nvml alone", "FULL = False\n" + _NVML),
    ("+nvml init", AGENT_MODULES + "FULL = True\n" + _NVML),
]


TARGET_MIB = 30.0
"""The agent's RSS target on a host without a GPU (issue 30; the EKS node monitoring agent requests 30 MiB)."""


def measure(code: str) -> dict:
    prog = _READ + code + "\nprint(json.dumps({**_rss(), 'note': note}))"
    env_path = str(REPO)
    out = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, cwd=REPO,
                         env={**__import__("os").environ, "PYTHONPATH": env_path + ":" +
                              __import__("os").environ.get("PYTHONPATH", "")})
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"rc {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def live_agent(seconds: float) -> dict:
    """VmRSS/RssAnon/RssFile (MiB) of `python -m agents --hardware` after `seconds`, NATS away (a closed local
    port: the agent spools and keeps reconnecting), in a temporary state directory."""
    import os
    import tempfile
    import time

    with tempfile.TemporaryDirectory(prefix="fm-agent-mem-") as tmp:
        env = {**os.environ, "FLEETMEND_NATS_URL": "nats://127.0.0.1:1", "FLEETMEND_STATE_DIR": tmp,
               "FLEETMEND_LOG_FORMAT": "json", "FLEETMEND_AGENT__NICE": "0",
               "PYTHONPATH": str(REPO) + ":" + os.environ.get("PYTHONPATH", "")}
        proc = subprocess.Popen([sys.executable, "-m", "agents", "--node", "mem", "--cluster", "bench", "--hardware"],
                                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            time.sleep(seconds)
            if proc.poll() is not None:
                return {"error": f"the agent exited with {proc.returncode}"}
            out: dict = {}
            for line in open(f"/proc/{proc.pid}/status"):
                k, _, v = line.partition(":")
                if k in ("VmRSS", "RssAnon", "RssFile"):
                    out[k] = int(v.split()[0]) / 1024
            return {**out, "note": f"after {seconds:g} s, every probe running"}
        finally:
            proc.terminate()
            proc.communicate(timeout=30)


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--live-s", type=float, default=8.0, help="how long the live agent runs before its RSS is read")
    args = ap.parse_args()
    print(f"{'step (MiB)':18s} {'VmRSS':>8s} {'RssAnon':>8s} {'RssFile':>8s}  note")
    rows = {}
    for name, r in [*((n, measure(c)) for n, c in STEPS), ("live agent", live_agent(args.live_s))]:
        if "error" in r:
            print(f"{name:18s} error: {r['error']}")
            continue
        rows[name] = r
        print(f"{name:18s} {r['VmRSS']:8.1f} {r['RssAnon']:8.1f} {r['RssFile']:8.1f}  {r['note']}")
    if {"live agent", "interpreter", "asyncio+ssl", "+pydantic model"} <= set(rows):
        agent, bare, floor, contract = (rows[k]["VmRSS"] for k in ("live agent", "interpreter", "asyncio+ssl",
                                                                   "+pydantic model"))
        print(f"\nlive agent {agent:.1f} MiB beside: bare interpreter {bare:.1f}, raw limit asyncio+ssl {floor:.1f}, "
              f"asyncio+nats+structlog+one pydantic model {contract:.1f}; target {TARGET_MIB:.0f} (issue 30): "
              f"{agent - floor:.1f} MiB above the raw limit, {agent - contract:.1f} above the stack's floor")
    return 0


if __name__ == "__main__":
    sys.exit(main())
