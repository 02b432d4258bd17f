"""The agent's entry point: `fleetmend agent` runs the lean agent (no typer, rich, temporalio or
aiohttp in a process that runs on every node; bench/agent_memory.py has the figures)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("aiohttp", "rich", "typer", "temporalio", "kubernetes")


def _modules_after(code: str) -> list[str]:
    prog = code + f"\nimport sys, json; print(json.dumps(sorted(m for m in {HEAVY!r} if sys.modules.get(m))))"
    out = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, cwd=REPO, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_agent_process_imports_no_heavy_optional_library() -> None:
    loaded = _modules_after("from agents.__main__ import lean_imports\nlean_imports('nats://10.0.0.1:4222')\n"
                            "import agents.runner, agents.nvml, agents.diag, agents.recovery, nats, structlog")
    assert loaded == []


def test_websocket_nats_url_keeps_aiohttp_importable() -> None:
    code = ("from agents.__main__ import lean_imports\nlean_imports('wss://nats.example:443')\n"
            "import importlib.util, sys\nassert sys.modules.get('aiohttp', 1) is not None\n")
    assert "rich" not in _modules_after(code)


def test_fleetmend_agent_goes_to_the_lean_entry(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("fleetmend")
    out = subprocess.run([str(exe), "agent", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("usage: fleetmend agent")
    assert "--kmsg-file" in out.stdout and "--metrics-port" in out.stdout
    bad = subprocess.run([str(exe), "agent", "--kmsg-file", str(tmp_path / "missing.log"), "--once"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no such file" in bad.stderr


def test_bad_agent_arguments_are_clear_errors_not_tracebacks(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("fleetmend")
    cases = {("--inject-file", str(tmp_path / "none.jsonl"), "--once", "--no-kmsg"): "no such file",
             ("--kmsg-file", str(tmp_path), "--once"): "a directory, not a file",
             ("--metrics-port", "70000"): "not a TCP port"}
    for args, said in cases.items():
        out = subprocess.run([str(exe), "agent", *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and said in out.stderr and "Traceback" not in out.stderr, (args, out.stderr)
    state = tmp_path / "not-a-dir"
    state.write_text("")
    log = tmp_path / "k.log"
    log.write_text("[  1.0] NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=python, Graphics Exception\n")
    out = subprocess.run([str(exe), "agent", "--kmsg-file", str(log), "--once"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "FLEETMEND_STATE_DIR": str(state),
                                          "FLEETMEND_NATS_URL": "nats://127.0.0.1:1"})
    assert out.returncode == 1 and "Not a directory" in out.stderr and "Traceback" not in out.stderr, out.stderr
