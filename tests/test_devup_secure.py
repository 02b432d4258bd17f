"""`fleetmend dev up --secure`: the whole pipeline under the credentials `fleetmend creds generate`
writes (each role only its own subjects and JetStream API calls), through the end-to-end scenario:
a fatal XID drains, files a ticket and returns after repair; an agent that goes silent is noticed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from fleetmend.dev.servers import free_port
from fleetmend.infra import security
from tests.corpus_paths import corpus_case
from tests.test_devup import _alive

FLEETMEND = [sys.executable, "-m", "fleetmend.cli.main"]


def _wait(what: str, check, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.5)
    raise AssertionError(f"{what} not reached in {timeout_s}s; last {last}")


def test_dev_up_secure_end_to_end_and_a_silent_agent(tmp_path: Path) -> None:
    state = tmp_path / "state"
    env = {**os.environ, "FLEETMEND_STATE_DIR": str(state), "FLEETMEND_NATS_URL": f"nats://127.0.0.1:{free_port()}",
           "FLEETMEND_TEMPORAL_ADDRESS": f"127.0.0.1:{free_port()}", "FLEETMEND_TEMPORAL_UI_PORT": str(free_port()),
           "FLEETMEND_CLUSTER": "sec", "FLEETMEND_NODE": "devhost", "FLEETMEND_ROUTER__HEARTBEAT_SILENCE_S": "4",
           "FLEETMEND_AGENT__HEARTBEAT_INTERVAL_S": "0.5", "FLEETMEND_AGENT__NICE": "0"}
    for k in ("FLEETMEND_CONFIG", "FLEETMEND_NATS_NKEY_SEED", "FLEETMEND_NATS_USER", "FLEETMEND_NATS_INBOX_PREFIX"):
        env.pop(k, None)
    security.generate(state / "creds", "sec", ["t1", "t2"])  # the operator adds nodes before starting
    log = tmp_path / "devup.log"
    devup = subprocess.Popen(FLEETMEND + ["dev", "up", "--secure"], env=env, stdout=open(log, "w"),
                             stderr=subprocess.STDOUT)
    admin = {**env, "FLEETMEND_NATS_NKEY_SEED": str(state / "creds" / "admin.nk")}
    node_env = {k: v for k, v in env.items() if k not in ("FLEETMEND_NODE", "FLEETMEND_CLUSTER")}
    agents: list[subprocess.Popen] = []
    try:
        _wait("dev up ready", lambda: devup.poll() is not None or "ready:" in log.read_text(), 90)
        assert devup.poll() is None, log.read_text()
        text = log.read_text()
        assert "credentials" in text and "admin.nk" in text

        def status(node: str) -> dict | None:
            r = subprocess.run(FLEETMEND + ["status", node, "--json"], env=admin, capture_output=True, text=True,
                               timeout=60)
            return json.loads(r.stdout) if r.returncode == 0 else None

        dmesg = tmp_path / "dmesg.txt"
        dmesg.write_text(corpus_case("c093")["raw"] + "\n")  # XID 95 uncontained ECC: drain + ticket
        agents.append(subprocess.Popen(FLEETMEND + ["agent", "--config", str(state / "creds" / "nodes" / "t1.toml"),
                                                    "--kmsg-file", str(dmesg)], env=node_env,
                                       stdout=open(tmp_path / "t1.log", "w"), stderr=subprocess.STDOUT))
        agents.append(subprocess.Popen(FLEETMEND + ["agent", "--config", str(state / "creds" / "nodes" / "t2.toml"),
                                                    "--no-kmsg", "--no-hardware"], env=node_env,
                                       stdout=open(tmp_path / "t2.log", "w"), stderr=subprocess.STDOUT))
        st = _wait("t1 awaiting repair", lambda: (s := status("t1")) and s["phase"] == "awaiting_repair" and s)
        assert st["drained"] and st["ticket"] and st["faults"][0]["code"] == 95
        r = subprocess.run(FLEETMEND + ["repaired", "t1", "--note", "replaced"], env=admin, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        st = _wait("t1 closed", lambda: (s := status("t1")) and s["phase"] == "closed" and s)
        assert st["outcome"] == "returned_to_service" and not st["drained"], "verification ran through t1's agent"

        time.sleep(2)  # t2 has sent heartbeats; now it dies without a word
        agents[1].send_signal(signal.SIGKILL)
        st = _wait("t2's silence noticed", lambda: (s := status("t2")) and any(
            f["kind"] == "agent_silent" for f in s["faults"]) and s, 60)
        assert not st["drained"], "a silent agent is not a bad node"

        # Poison on a fault subject (an operator's credentials can publish anywhere): dead-lettered,
        # and dev up's restart limit never comes into play because the router never exits.
        import asyncio

        import nats

        async def poison() -> None:
            nc = await nats.connect(env["FLEETMEND_NATS_URL"], nkeys_seed=str(state / "creds" / "admin.nk"))
            for _ in range(6):
                for data in (b"[" * 60_000, b'{"observed_at": "9999-12-31T23:59:59-23:59"}', b"\xff"):
                    await nc.jetstream().publish("fleet.sec.fault.t1", data)
            await nc.close()

        asyncio.run(poison())
        _wait("18 dead letters", lambda: "dead letters: 18" in subprocess.run(
            FLEETMEND + ["status"], env=admin, capture_output=True, text=True, timeout=60).stdout, 60)
        assert "router exited" not in log.read_text() and devup.poll() is None, log.read_text()[-2000:]
        violations = [ln for ln in (state / "logs" / "nats.log").read_text().splitlines()
                      if "Violation" in ln]
        assert not violations, violations[:5]
    finally:
        for a in agents:
            if a.poll() is None:
                a.terminate()
                a.wait(timeout=30)
        devup.send_signal(signal.SIGTERM)
        devup.wait(timeout=120)
        time.sleep(0.5)
    assert devup.returncode == 0, log.read_text()[-3000:]
    assert not _alive(devup.pid)
