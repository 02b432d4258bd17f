"""Where the node agent's memory goes: RSS after each layer, each measured in a fresh interpreter.

    python bench/agent_memory.py

Prints, per step, VmRSS and its parts from /proc/self/status: RssAnon (private heap: what the
process itself costs) and RssFile (mapped files, mostly shared-library code that every process
on the node maps from the same page cache). Steps:

    interpreter        python -c pass
    asyncio+ssl        the floor of any asyncio Python process that can speak TLS (nats-py imports ssl)
    nats+structlog     the floor of any asyncio NATS client in Python (bench/agent_cost.py's "bare")
    +pydantic          the event schema's library (imported; its model machinery loads with the first model)
    +settings          fleetmend.config loaded (pydantic-settings and the first models built)
    +contract          fleetmend.events + the fault catalog loaded
    +agent modules     every module the agent imports (runner, probes, parsers, spool, publisher)

Every step except the bare interpreter and "nvml alone" uses the agent's lean imports
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

STEPS: list[tuple[str, str]] = [
    ("interpreter", "note = ''"),
    ("asyncio+ssl", "import asyncio, ssl; note = ''"),
    ("nats+structlog", LEAN + "import asyncio, nats, structlog; note = ''"),
    ("+pydantic", LEAN + "import asyncio, nats, structlog, pydantic; note = ''"),
    ("+settings", LEAN + "import asyncio, nats, structlog\nfrom fleetmend.config import load_settings\n"
                  "load_settings(); note = ''"),
    ("+contract", LEAN + "import asyncio, nats, structlog\nfrom fleetmend.events import FaultEvent\n"
                  "from fleetmend.catalog import default_catalog\ndefault_catalog(); note = ''"),
    ("+agent modules", "from agents.__main__ import lean_imports\nlean_imports('nats://x:4222')\n"
                       "import asyncio, nats, structlog\nfrom fleetmend.catalog import default_catalog\n"
                       "default_catalog()\nimport agents.runner, agents.nvml, agents.kmsg.probe, agents.sysfs, "
                       "agents.udev, agents.spool, agents.publisher, agents.diag, agents.recovery, agents.lastboot\nnote = ''"),
    ("nvml alone", "FULL = False\n" + _NVML),
    ("+nvml init", "from agents.__main__ import lean_imports\nlean_imports('nats://x:4222')\n"
                   "import asyncio, nats, structlog\nfrom fleetmend.catalog import default_catalog\n"
                   "default_catalog()\nimport agents.runner, agents.nvml, agents.kmsg.probe, agents.sysfs, "
                   "agents.udev, agents.spool, agents.publisher, agents.diag, agents.recovery, agents.lastboot\n"
                   "FULL = True\n" + _NVML),
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


def main() -> int:
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print(f"{'step (MiB)':18s} {'VmRSS':>8s} {'RssAnon':>8s} {'RssFile':>8s}  note")
    rows = {}
    for name, code in STEPS:
        r = measure(code)
        if "error" in r:
            print(f"{name:18s} error: {r['error']}")
            continue
        rows[name] = r
        print(f"{name:18s} {r['VmRSS']:8.1f} {r['RssAnon']:8.1f} {r['RssFile']:8.1f}  {r['note']}")
    if "+agent modules" in rows and "interpreter" in rows and "asyncio+ssl" in rows:
        agent, bare, floor = (rows[k]["VmRSS"] for k in ("+agent modules", "interpreter", "asyncio+ssl"))
        print(f"\nagent without NVML {agent:.1f} MiB beside: bare interpreter {bare:.1f}, asyncio+ssl floor "
              f"{floor:.1f}, target {TARGET_MIB:.0f} (issue 30); {agent - floor:.1f} MiB above the floor")
    return 0


if __name__ == "__main__":
    sys.exit(main())
