"""`fleetmend dev up` as an operator runs it: every process it starts stops on SIGTERM/SIGINT, and a
second start on the same state directory resumes the open incident where it was."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from fleetmend.dev.servers import free_port
from tests.corpus_paths import corpus_case

FLEETMEND = [sys.executable, "-m", "fleetmend.cli.main"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie awaiting reaping by PID 1 counts as gone
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _start(env: dict[str, str], log: Path) -> tuple[subprocess.Popen, list[int]]:
    out = open(log, "w")
    p = subprocess.Popen(FLEETMEND + ["dev", "up"], env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        text = log.read_text()
        if "ready:" in text:
            pids = [int(x) for x in re.findall(r"pid (\d+)", text)]
            return p, pids
        if p.poll() is not None:
            raise AssertionError(f"dev up exited {p.returncode}:\n{text}")
        time.sleep(0.2)
    p.kill()
    raise AssertionError(f"dev up not ready:\n{log.read_text()}")


def _stop(p: subprocess.Popen, sig: int, pids: list[int]) -> None:
    p.send_signal(sig)
    assert p.wait(timeout=90) == 0
    deadline = time.monotonic() + 10
    while any(_alive(x) for x in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [x for x in pids if _alive(x)], "every child of dev up is gone"


def _status(env: dict[str, str], node: str) -> dict | None:
    r = subprocess.run(FLEETMEND + ["status", node, "--json"], env=env, capture_output=True, text=True, timeout=60)
    return json.loads(r.stdout) if r.returncode == 0 else None


def _wait_phase(env: dict[str, str], node: str, phase: str, timeout_s: float = 90) -> dict:
    deadline = time.monotonic() + timeout_s
    st = None
    while time.monotonic() < deadline:
        st = _status(env, node)
        if st and st["phase"] == phase:
            return st
        time.sleep(0.5)
    raise AssertionError(f"{node} never reached {phase}; last status {st}")


def test_dev_up_stops_everything_and_resumes_open_incidents(tmp_path: Path):
    state = tmp_path / "state"
    env = {**os.environ, "FLEETMEND_STATE_DIR": str(state),
           "FLEETMEND_NATS_URL": f"nats://127.0.0.1:{free_port()}",
           "FLEETMEND_TEMPORAL_ADDRESS": f"127.0.0.1:{free_port()}",
           "FLEETMEND_TEMPORAL_UI_PORT": str(free_port()), "FLEETMEND_CLUSTER": "devup"}
    env.pop("FLEETMEND_CONFIG", None)
    log = tmp_path / "devup-1.log"
    dmesg = tmp_path / "dmesg.txt"
    dmesg.write_text(corpus_case("c093")["raw"] + "\n")  # XID 95 uncontained ECC: drain + ticket

    p, pids = _start(env, log)
    text = log.read_text()
    assert f"Temporal UI     http://127.0.0.1:{env['FLEETMEND_TEMPORAL_UI_PORT']}" in text
    assert len(pids) == 4, text  # worker, router, analyzer, agent
    # node t1's agent replays the log and stays up to answer diagnostics
    agent = subprocess.Popen(FLEETMEND + ["agent", "--node", "t1", "--kmsg-file", str(dmesg)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        st = _wait_phase(env, "t1", "awaiting_repair")
        assert st["drained"] and st["ticket"] and st["faults"][0]["code"] == 95
        # an agent of another cluster: dev up starts that cluster's worker, which drains it (issue 27)
        east = subprocess.run(FLEETMEND + ["agent", "--cluster", "east", "--node", "e1", "--kmsg-file", str(dmesg),
                                           "--once"], env=env, capture_output=True, text=True, timeout=120)
        assert east.returncode == 0, east.stderr
        deadline = time.monotonic() + 90
        while not ((st := _status(env, "e1")) and st["drained"]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert st and st["drained"] and st["cluster"] == "east", (st, log.read_text()[-3000:])
        text = log.read_text()
        assert "worker-east" in text and "(cluster east, reported by node e1" in text, text
        pids += [int(x) for x in re.findall(r"worker-east\s+pid (\d+)", text)]
        server_pids = [int(x) for x in subprocess.run(["pgrep", "-f", str(state)], capture_output=True,
                                                      text=True).stdout.split()]
        _stop(p, signal.SIGTERM, pids + server_pids)

        p, pids = _start(env, tmp_path / "devup-2.log")
        st = _wait_phase(env, "t1", "awaiting_repair")
        assert st["ticket"] and st["drained"], "the open incident resumed where it was"
        r = subprocess.run(FLEETMEND + ["repaired", "t1", "--note", "replaced"], env=env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        st = _wait_phase(env, "t1", "closed")
        assert st["outcome"] == "returned_to_service" and not st["drained"]
    finally:
        agent.terminate()
        agent.wait(timeout=30)
    server_pids = [int(x) for x in subprocess.run(["pgrep", "-f", str(state)], capture_output=True,
                                                  text=True).stdout.split()]
    _stop(p, signal.SIGINT, pids + server_pids)


def test_dev_up_exits_non_zero_when_a_server_dies(tmp_path: Path):
    """nats-server killed -9 under dev up: it stops everything and exits 1 (a supervisor or CI must
    not read that as a clean stop)."""
    env = {**os.environ, "FLEETMEND_STATE_DIR": str(tmp_path / "state"),
           "FLEETMEND_NATS_URL": f"nats://127.0.0.1:{free_port()}",
           "FLEETMEND_TEMPORAL_ADDRESS": f"127.0.0.1:{free_port()}",
           "FLEETMEND_TEMPORAL_UI_PORT": str(free_port()), "FLEETMEND_CLUSTER": "devdie"}
    env.pop("FLEETMEND_CONFIG", None)
    log = tmp_path / "devup.log"
    p, pids = _start(env, log)
    # a second dev up on the same state directory (other ports): refused before it starts anything,
    # and the first one's pid file (its watchdog's list) is left alone
    other = {**env, "FLEETMEND_NATS_URL": f"nats://127.0.0.1:{free_port()}",
             "FLEETMEND_TEMPORAL_ADDRESS": f"127.0.0.1:{free_port()}", "FLEETMEND_TEMPORAL_UI_PORT": str(free_port())}
    second = subprocess.run(FLEETMEND + ["dev", "up"], env=other, capture_output=True, text=True, timeout=60)
    assert second.returncode == 1 and f"another `fleetmend dev up` (pid {p.pid}) uses" in second.stderr, second
    assert "nats-server" not in second.stdout and (tmp_path / "state" / "devup.pids").exists()
    import psutil

    [nats] = [c for c in psutil.Process(p.pid).children(recursive=True) if c.name() == "nats-server"]
    pids.append(nats.pid)
    nats.kill()
    assert p.wait(timeout=120) == 1, log.read_text()[-2000:]
    assert "nats-server exited unexpectedly" in log.read_text()
    deadline = time.monotonic() + 10
    while any(_alive(x) for x in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [x for x in pids if _alive(x)], "every child of dev up is gone"


def test_dev_up_killed_with_sigkill_leaves_nothing_behind(tmp_path: Path):
    """SIGKILL gives dev up no chance to stop anything: its children (servers, worker, router,
    agent) and what they started (here: the agent's reboot command, still running) must exit on
    their own, within seconds."""
    import asyncio

    import psutil

    env = {**os.environ, "FLEETMEND_STATE_DIR": str(tmp_path / "state"),
           "FLEETMEND_NATS_URL": f"nats://127.0.0.1:{free_port()}",
           "FLEETMEND_TEMPORAL_ADDRESS": f"127.0.0.1:{free_port()}",
           "FLEETMEND_TEMPORAL_UI_PORT": str(free_port()), "FLEETMEND_CLUSTER": "devkill",
           "FLEETMEND_NODE": "killnode", "FLEETMEND_POLICY__REBOOT_COMMAND": '["sleep", "600"]'}
    env.pop("FLEETMEND_CONFIG", None)
    p, pids = _start(env, tmp_path / "devup.log")

    async def reboot() -> bytes:  # the agent answers, then runs its reboot command (a grandchild)
        import nats

        from fleetmend.subjects import diag_subject

        nc = await nats.connect(env["FLEETMEND_NATS_URL"])
        try:
            for _ in range(100):
                try:
                    return (await nc.request(diag_subject("devkill", "killnode"),
                                             b'{"type": "recovery", "op": "reboot"}', timeout=2)).data
                except Exception:  # the agent is still connecting
                    await asyncio.sleep(0.3)
            raise AssertionError("the agent never answered")
        finally:
            await nc.close()

    assert b"applied" in asyncio.run(reboot())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        children = psutil.Process(p.pid).children(recursive=True)
        if any(c.name() == "sleep" for c in children):
            break
        time.sleep(0.1)
    names = {c.pid: c.name() for c in children}
    assert "sleep" in names.values(), names
    pids = sorted(set(names) | set(pids))
    assert len(pids) >= 6, names  # nats-server, temporal, worker, router, agent, the agent's command
    p.kill()
    p.wait(timeout=10)
    deadline = time.monotonic() + 15
    while any(_alive(x) for x in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {x: names.get(x) for x in pids if _alive(x)}
    for x in left:  # do not leave them running for the next test
        with contextlib.suppress(ProcessLookupError):
            os.kill(x, signal.SIGKILL)
    assert not left, f"still running after dev up was killed: {left}"


def test_dev_up_joins_an_existing_nats(tmp_path: Path):
    """`dev up` with a NATS URL of several servers (issue 27, point 2) starts no nats-server: it checks each server
    (one that refuses is named, the others are used), creates the streams and buckets on the NATS it joins, and every
    process it starts connects there; a fatal fault drains through it; stopping dev up leaves that NATS running."""
    import asyncio
    import urllib.request

    import nats
    import psutil

    from fleetmend import subjects
    from fleetmend.dev.servers import start_nats

    port, mon, dead = free_port(), free_port(), free_port()
    theirs = start_nats(tmp_path / "their-js", port, http_port=mon)  # the NATS an operator already runs
    try:
        url = f"nats://127.0.0.1:{port},nats://localhost:{port},nats://127.0.0.1:{dead}"
        env = {**os.environ, "FLEETMEND_STATE_DIR": str(tmp_path / "state"), "FLEETMEND_NATS_URL": url,
               "FLEETMEND_TEMPORAL_ADDRESS": f"127.0.0.1:{free_port()}",
               "FLEETMEND_TEMPORAL_UI_PORT": str(free_port()), "FLEETMEND_CLUSTER": "devjoin"}
        env.pop("FLEETMEND_CONFIG", None)
        log = tmp_path / "devup.log"
        p, pids = _start(env, log)
        text = log.read_text()
        assert f"nats            joined {url}  (2 of 3 servers answer; dev up started no nats-server)" in text, text
        assert f"nats            nats://127.0.0.1:{dead}: connection refused; joined through" in text, text
        assert "nats-server     " not in text and len(pids) == 4, text  # worker, router, analyzer, agent
        assert not [c for c in psutil.Process(p.pid).children(recursive=True) if c.name() == "nats-server"]

        async def on_their_nats() -> tuple[set[str], set[str]]:
            nc = await nats.connect(f"nats://127.0.0.1:{port}")
            try:
                js = nc.jetstream()
                streams = {(await js.stream_info(n)).config.name for n in (
                    subjects.FAULT_STREAM, subjects.DEADLETTER_STREAM, subjects.PERF_STREAM, subjects.JOB_STREAM,
                    subjects.FINGERPRINT_STREAM)}
                buckets = {(await js.stream_info(f"KV_{b}")).config.name for b in (
                    subjects.DRAIN_KV_BUCKET, subjects.TICKET_KV_BUCKET, subjects.PERMIT_KV_BUCKET,
                    subjects.LEASE_KV_BUCKET, subjects.LEDGER_KV_BUCKET, subjects.ANALYZER_KV_BUCKET,
                    subjects.FINGERPRINT_KV_BUCKET, subjects.DRIFT_ALLOW_KV_BUCKET)}
                return streams, buckets
            finally:
                await nc.close()

        streams, buckets = asyncio.run(on_their_nats())  # made by dev up before it started anything
        assert len(streams) == 5 and len(buckets) == 8, (streams, buckets)

        def clients() -> set[str]:
            with urllib.request.urlopen(f"http://127.0.0.1:{mon}/connz?limit=1024", timeout=5) as r:
                return {c.get("name", "") for c in json.loads(r.read())["connections"]}

        want = {"fleetmend-worker", "fleetmend-router", "fleetmend-analyzer-devjoin", "fleetmend-devup"}
        deadline = time.monotonic() + 60
        while not (want <= clients() and any(n.startswith("fleetmend-agent-") for n in clients())):
            assert time.monotonic() < deadline, f"connected to their NATS: {clients()}; dev up:\n{log.read_text()}"
            time.sleep(0.3)

        dmesg = tmp_path / "dmesg.txt"
        dmesg.write_text(corpus_case("c093")["raw"] + "\n")  # XID 95: drain
        r = subprocess.run(FLEETMEND + ["agent", "--node", "j1", "--kmsg-file", str(dmesg), "--once"], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        deadline = time.monotonic() + 90
        while not ((st := _status(env, "j1")) and st["drained"]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert st and st["drained"], (st, log.read_text()[-3000:])
        server_pids = [int(x) for x in subprocess.run(["pgrep", "-f", str(tmp_path / "state")], capture_output=True,
                                                      text=True).stdout.split()]
        _stop(p, signal.SIGTERM, pids + server_pids)
        assert theirs.alive(), "dev up stops what it started, not the NATS it joined"
    finally:
        theirs.stop()


def test_dev_up_refuses_a_nats_to_join_that_does_not_answer(tmp_path: Path):
    """Nothing listens at the NATS to join: one line on stderr with the address and `connection refused`, exit 1,
    nothing started; the check itself takes under 2 s. Which URLs dev up joins rather than serves itself."""
    import asyncio

    from fleetmend.config import load_settings
    from fleetmend.dev.devup import check_nats, joins_nats

    a, b = free_port(), free_port()
    env = {**os.environ, "FLEETMEND_STATE_DIR": str(tmp_path / "state"),
           "FLEETMEND_TEMPORAL_ADDRESS": f"127.0.0.1:{free_port()}", "FLEETMEND_TEMPORAL_UI_PORT": str(free_port())}
    env.pop("FLEETMEND_CONFIG", None)
    r = subprocess.run(FLEETMEND + ["dev", "up", "--nats-url", f"nats://127.0.0.1:{a}", "--join-nats"], env=env,
                       capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r
    assert lines[0].startswith(f"error: cannot join NATS: nats://127.0.0.1:{a}: connection refused"), lines
    assert not (tmp_path / "state" / "logs").exists() and "temporal" not in r.stdout, r.stdout
    r = subprocess.run(FLEETMEND + ["dev", "up", "--nats-url", f"nats://127.0.0.1:{a}", "--join-nats", "--secure"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.startswith("error: --secure starts dev up's own nats-server"), r

    s = load_settings(None, nats_url=f"nats://127.0.0.1:{a},nats://127.0.0.1:{b}", state_dir=tmp_path / "s")
    t0 = time.monotonic()
    ok, bad = asyncio.run(check_nats(s))
    assert time.monotonic() - t0 < 2.0 and not ok
    assert bad == [f"nats://127.0.0.1:{a}: connection refused", f"nats://127.0.0.1:{b}: connection refused"]

    assert not joins_nats("nats://127.0.0.1:4222") and not joins_nats("nats://localhost:4222")
    assert joins_nats("nats://127.0.0.1:4222", join=True)
    assert joins_nats("nats://127.0.0.1:4222,nats://127.0.0.1:4223")  # a cluster
    assert joins_nats("tls://127.0.0.1:4222")  # dev up's own server speaks plain NATS
    assert joins_nats("nats://192.0.2.7:4222")  # TEST-NET-1: not an address of this machine
