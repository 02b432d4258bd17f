"""What the live agent keeps out of its process (issue 30 point 2, bench/agent_memory.py has the figures): on a host
without NVIDIA GPUs it loads neither NVML nor the optional libraries its dependencies would pull in (aiohttp for
nats-py's websockets, rich for structlog's tracebacks), nor the CLI's (typer), nor a second JSON library, nor
anything of the control plane, nor prometheus_client while no metrics port is set (with one, /metrics and /readyz
answer), nor the diagnostics responder's modules until a request comes on its diag subject; and its RSS stays
under the 60 MiB of the first target, a coarse guard against a heavy import slipping back in (the 30 MiB target is
bounded by the stack itself: see bench/RESULTS.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NEVER_IN_THE_AGENT = {"aiohttp", "rich", "typer", "orjson", "pynvml", "temporalio", "kubernetes", "httpx",
                      "prometheus_client"}  # the last only with metrics.agent_port set (agents/metrics.py)
UNTIL_ASKED = {"agents.diag", "agents.bench", "agents.recovery", "fleetmend.diagnostics"}
"""Built at the first request on the node's diag subject (agents/runner.py `DiagGate`), not before."""

_WRAPPER = """
import json, os, sys, threading, time  # a module blocked by lean_imports is None in sys.modules
def dump():
    deadline = time.monotonic() + 45  # the probes are built (a loaded CI box starts slowly), then they run a while
    while "agents.inventory.probe" not in sys.modules and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(float(os.environ["DUMP_AFTER_S"]))
    rss = int(open('/proc/self/status').read().split('VmRSS:')[1].split()[0]) / 1024
    modules = sorted(k for k, v in sys.modules.items() if v is not None)
    served = {}
    if os.environ.get("FLEETMEND_METRICS__AGENT_PORT"):  # read after the module list: urllib is the test's
        import urllib.request
        base = "http://127.0.0.1:" + os.environ["FLEETMEND_METRICS__AGENT_PORT"]
        for path in ("/metrics", "/readyz"):
            with urllib.request.urlopen(base + path, timeout=5) as r:
                served[path] = [r.status, r.read().decode()]
    with open(os.environ["DUMP_TO"], "w") as f:
        json.dump({"rss_mib": rss, "modules": modules, "served": served}, f)
    sys.stdout.flush()
    os._exit(0)
threading.Thread(target=dump, daemon=True).start()
from agents.__main__ import main
sys.exit(main(["--node", "mem-1", "--cluster", "c", "--hardware"]))
"""


_ASKED_WRAPPER = """
import asyncio, json, os, sys, threading, time
def modules():
    return sorted(k for k, v in sys.modules.items() if v is not None)
async def ask():  # on its own loop and connection: once the agent beats (its diag subject is open), ask it
    import nats
    from fleetmend.subjects import diag_subject, heartbeat_subject
    nc = await nats.connect(os.environ["FLEETMEND_NATS_URL"])
    sub = await nc.subscribe(heartbeat_subject("c", "mem-1"))
    await sub.next_msg(timeout=60)
    before = modules()
    reply = await nc.request(diag_subject("c", "mem-1"), b'{"level": "quick"}', timeout=30)
    await nc.close()
    return {"before": before, "after": modules(), "reply": json.loads(reply.data)}
def dump():
    while "agents.runner" not in sys.modules:  # nats imported after the agent's lean imports, as the agent does
        time.sleep(0.05)
    out = asyncio.run(ask())
    with open(os.environ["DUMP_TO"], "w") as f:
        json.dump(out, f)
    sys.stdout.flush()
    os._exit(0)
threading.Thread(target=dump, daemon=True).start()
from agents.__main__ import main
sys.exit(main(["--node", "mem-1", "--cluster", "c", "--hardware"]))
"""


def _run_agent(tmp_path: Path, wrapper: str = _WRAPPER, **extra_env: str) -> tuple[dict, subprocess.CompletedProcess]:
    """The live agent on a host of one NIC and no GPU, NATS away, for a few seconds: what it imported, its RSS
    and (with a metrics port) what it served."""
    host = tmp_path / "host"
    nic = host / "sys/bus/pci/devices/0000:3b:00.0"
    nic.mkdir(parents=True)
    (nic / "vendor").write_text("0x8086\n")
    (nic / "class").write_text("0x020000\n")
    (tmp_path / "kmsg").write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETMEND_")}
    env.update(FLEETMEND_NATS_URL="nats://127.0.0.1:1", FLEETMEND_STATE_DIR=str(tmp_path / "state"),
               FLEETMEND_AGENT__HOST_ROOT=str(host), FLEETMEND_AGENT__SYSFS__ROOT=str(host),
               FLEETMEND_AGENT__KMSG__PATH=str(tmp_path / "kmsg"), FLEETMEND_AGENT__NICE="0",
               DUMP_AFTER_S="3", DUMP_TO=str(tmp_path / "dump.json"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    env.update(extra_env)
    p = subprocess.run([sys.executable, "-c", wrapper], capture_output=True, text=True, cwd=REPO, env=env,
                       timeout=90)
    assert (tmp_path / "dump.json").exists(), p.stderr[-3000:]
    return json.loads((tmp_path / "dump.json").read_text()), p


def test_the_live_agent_on_a_host_without_gpus_keeps_heavy_imports_out(tmp_path: Path) -> None:
    dump, p = _run_agent(tmp_path)
    top = {m.split(".")[0] for m in dump["modules"]}
    assert not top & NEVER_IN_THE_AGENT, top & NEVER_IN_THE_AGENT
    mods = set(dump["modules"])
    assert not mods & UNTIL_ASKED, mods & UNTIL_ASKED
    assert {"agents.runner", "agents.kmsg.probe", "agents.spool", "agents.inventory.probe"} <= mods, \
        (sorted(m for m in mods if m.startswith("agents")), p.stdout[-2000:])
    assert "nvml_not_applicable" in p.stdout + p.stderr
    assert dump["rss_mib"] < 60, dump["rss_mib"]


def test_the_agent_with_a_metrics_port_serves_its_metrics_and_health(tmp_path: Path) -> None:
    """prometheus_client comes in with the port (agents/metrics.py): /metrics has the agent's series,
    /readyz says ready once the probes run."""
    from fleetmend.dev.servers import free_port

    dump, p = _run_agent(tmp_path, FLEETMEND_METRICS__AGENT_PORT=str(free_port()),
                         FLEETMEND_METRICS__HOST="127.0.0.1")
    assert "prometheus_client" in {m.split(".")[0] for m in dump["modules"]}
    status, text = dump["served"]["/metrics"]
    assert status == 200 and 'fleetmend_agent_spool_depth{cluster="c"}' in text, text[-2000:]
    assert dump["served"]["/readyz"] == [200, "ok\n"], (dump["served"], p.stderr[-2000:])


def test_a_connected_agent_loads_its_diagnostics_at_the_first_request(tmp_path: Path, nats_server) -> None:
    """Connected and beating, the agent holds the diag subscription but not the responder's modules
    (`UNTIL_ASKED`); the first request loads them and is answered."""
    dump, p = _run_agent(tmp_path, _ASKED_WRAPPER, FLEETMEND_NATS_URL=nats_server.url)
    before, after = set(dump["before"]), set(dump["after"])
    assert {"agents.runner", "agents.inventory.probe"} <= before
    assert not before & UNTIL_ASKED, before & UNTIL_ASKED
    assert UNTIL_ASKED <= after, UNTIL_ASKED - after
    reply = dump["reply"]
    assert reply["node"] == "mem-1" and reply["level"] == "quick" and reply["checks"], reply
    # the GPU checks import pynvml (agents/diag.py); nothing else heavy comes with the request
    heavy = {m.split(".")[0] for m in after} & (NEVER_IN_THE_AGENT - {"pynvml"})
    assert not heavy, heavy
