"""The operator's rough edges of issue 30 point 4, each as the operator meets it: the CLI as a
subprocess (or the connect helpers in-process where the time to fail is the point), real NATS and
Temporal where a server is involved.

Every test here failed on the code before the fix: a refused NATS connection waited 10.5 s and said
`TimeoutError()`; `config check | jq` got a `configuration valid` line after the JSON; `status
'bad node!'` exited 1; `status UNKNOWN --json` printed nothing; `inject --xid 99999` published;
`nodes` showed `remediate/<c>/<n>/<run id>` beside `remediate/<c>/<n>`; a 253-emoji node name
(1,012 bytes) was accepted and `creds generate` printed a traceback for it; a deeply nested TOML file
gave a `RecursionError` traceback; an empty or missing nkey seed path passed `config check`; `inf` and
`nan` passed as float settings; a malformed `FLEETMEND_AGENT__BENCH_COMMAND` did not name the variable.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetmend import subjects
from fleetmend.config import Settings
from fleetmend.errors import ServiceUnavailableError
from fleetmend.infra.connect import connect_nats, connect_temporal

REPO = Path(__file__).resolve().parents[1]
EMOJI_NODE = "\N{GRINNING FACE}" * 253


def _cli(*args: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLEETMEND_")}
    base.update({"FLEETMEND_STATE_DIR": str(tmp_path / "state"), **env})
    return subprocess.run([sys.executable, "-m", "fleetmend.cli.main", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=90, env=base)


def _refused_port() -> int:
    """A local port nothing listens on (bound, then closed: the kernel answers RST at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------ NATS or Temporal away

async def test_nats_away_fails_within_2_s_naming_the_address_and_connection_refused() -> None:
    url = f"nats://127.0.0.1:{_refused_port()}"
    s = Settings(nats_url=url, nats_connect_timeout_s=5.0)
    t0 = time.monotonic()
    with pytest.raises(ServiceUnavailableError) as info:
        await connect_nats(s, name="fleetmend-test")
    assert time.monotonic() - t0 < 2.0
    assert url in str(info.value) and "connection refused" in str(info.value)
    assert "TimeoutError" not in str(info.value)


async def test_a_nats_connection_made_fast_still_reconnects_forever(nats_server) -> None:
    nc = await connect_nats(Settings(nats_url=nats_server.url), name="fleetmend-test")
    try:
        assert nc.options["max_reconnect_attempts"] == -1 and nc.options["reconnect_time_wait"] == 1.0
    finally:
        await nc.close()


async def test_a_cluster_url_connects_through_the_server_that_answers(nats_server) -> None:
    """`nats_url` comma-separated for a cluster (issue 27): one server down, the next one is used (nats-py reads an
    unsplit string as one server: "invalid connect url option")."""
    url = f"nats://127.0.0.1:{_refused_port()},{nats_server.url}"
    nc = await connect_nats(Settings(nats_url=url), name="fleetmend-test")
    try:
        assert nc.is_connected and nc.connected_url.port == int(nats_server.url.rsplit(":", 1)[1])
    finally:
        await nc.close()


async def test_temporal_away_fails_within_2_s_naming_the_address_and_connection_refused() -> None:
    address = f"127.0.0.1:{_refused_port()}"
    t0 = time.monotonic()
    with pytest.raises(ServiceUnavailableError) as info:
        await connect_temporal(Settings(temporal_address=address))
    assert time.monotonic() - t0 < 2.0
    assert address in str(info.value) and "connection refused" in str(info.value)


async def test_a_temporal_that_accepts_but_never_answers_times_out() -> None:
    """A listening socket that never accepts: TCP connects (the kernel's backlog), gRPC never answers."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        address = f"127.0.0.1:{srv.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(ServiceUnavailableError) as info:
            await connect_temporal(Settings(temporal_address=address, temporal_connect_timeout_s=1.0))
        assert time.monotonic() - t0 < 5.0
    assert address in str(info.value) and "timed out" in str(info.value)


def test_a_command_with_nats_away_says_connection_refused_in_one_line(tmp_path: Path) -> None:
    url = f"nats://127.0.0.1:{_refused_port()}"
    p = _cli("nodes", "--no-incidents", tmp_path=tmp_path, FLEETMEND_NATS_URL=url, FLEETMEND_SCHEDULER="standalone")
    assert p.returncode == 1 and p.stdout == ""
    (line,) = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert url in line and "connection refused" in line, p.stderr
    assert "Traceback" not in p.stderr


# ------------------------------------------------------------------ config check

def test_config_check_json_is_only_json_on_stdout(tmp_path: Path) -> None:
    for args in (["config", "check", "--json"], ["config", "check"]):
        p = _cli(*args, tmp_path=tmp_path)
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["cluster"] == "local", args  # the whole stdout parses: `| jq` works
    assert "configuration valid" in p.stderr


def test_a_deeply_nested_toml_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    for depth in (40, 5000):  # pydantic's recursion, and tomllib's own
        f = tmp_path / f"deep{depth}.toml"
        f.write_text("a = " + "[" * depth + "]" * depth + "\n")
        p = _cli("config", "check", "-c", str(f), tmp_path=tmp_path)
        assert p.returncode == 2, (depth, p.stderr[-500:])
        assert "Traceback" not in p.stderr and "RecursionError" not in p.stderr
        (line,) = p.stderr.strip().splitlines()
        assert str(f) in line and "nested" in line


@pytest.mark.parametrize("seed", ["", "missing.nk"])
def test_an_empty_or_missing_nkey_seed_path_fails_config_check_and_the_agent(tmp_path: Path, seed: str) -> None:
    value = str(tmp_path / seed) if seed else ""
    p = _cli("config", "check", tmp_path=tmp_path, FLEETMEND_NATS_NKEY_SEED=value)
    assert p.returncode == 2, p.stdout
    assert "nats_nkey_seed" in p.stderr and "Traceback" not in p.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETMEND_")}
    env.update(FLEETMEND_NATS_NKEY_SEED=value, FLEETMEND_STATE_DIR=str(tmp_path / "state"),
               FLEETMEND_NATS_URL=f"nats://127.0.0.1:{_refused_port()}")
    a = subprocess.run([sys.executable, "-m", "agents", "--once", "--no-kmsg"], capture_output=True, text=True,
                       cwd=REPO, timeout=60, env=env)
    assert a.returncode == 2, a.stderr
    assert "nats_nkey_seed" in a.stderr and "Traceback" not in a.stderr and "ExceptionGroup" not in a.stderr
    assert len(a.stderr.strip().splitlines()) <= 2, a.stderr  # the error line (and its field line)


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "Infinity"])
def test_inf_and_nan_are_refused_in_float_settings(tmp_path: Path, value: str) -> None:
    for var in ("FLEETMEND_NATS_CONNECT_TIMEOUT_S", "FLEETMEND_AGENT__BENCH_TIMEOUT_S",
                "FLEETMEND_KUBERNETES__EVICT_TIMEOUT_S"):
        p = _cli("config", "check", "--json", tmp_path=tmp_path, **{var: value})
        assert p.returncode == 2, (var, value, p.stdout[:200])
        assert "finite" in p.stderr and "Traceback" not in p.stderr


def test_a_malformed_bench_command_names_the_variable_in_one_line(tmp_path: Path) -> None:
    p = _cli("config", "check", tmp_path=tmp_path, FLEETMEND_AGENT__BENCH_COMMAND="[oops")
    assert p.returncode == 2
    (line,) = p.stderr.strip().splitlines()
    assert "FLEETMEND_AGENT__BENCH_COMMAND" in line and "JSON" in line
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETMEND_")}
    env.update(FLEETMEND_AGENT__BENCH_COMMAND="[oops", FLEETMEND_STATE_DIR=str(tmp_path / "state"))
    a = subprocess.run([sys.executable, "-m", "fleetmend.cli.main", "agent", "--once", "--no-kmsg"],
                       capture_output=True, text=True, cwd=REPO, timeout=60, env=env)
    assert a.returncode == 2 and "FLEETMEND_AGENT__BENCH_COMMAND" in a.stderr
    assert len(a.stderr.strip().splitlines()) == 1 and "Traceback" not in a.stderr


# ------------------------------------------------------------------ node names and inject

def test_a_bad_node_name_is_a_usage_error_exit_2(tmp_path: Path) -> None:
    for args in (["status", "bad node!"], ["show", "a/b"], ["history", "gpu[01-04]"], ["repaired", "x'y"],
                 ["inject", "--node", "bad node!", "--xid", "79"]):
        p = _cli(*args, tmp_path=tmp_path, FLEETMEND_TEMPORAL_ADDRESS=f"127.0.0.1:{_refused_port()}",
                 FLEETMEND_NATS_URL=f"nats://127.0.0.1:{_refused_port()}")
        assert p.returncode == 2, (args, p.stderr)
        assert "invalid node name" in p.stderr and "cannot reach" not in p.stderr, args  # refused before connecting


def test_a_253_emoji_node_name_is_refused_in_one_line(tmp_path: Path) -> None:
    assert len(EMOJI_NODE) == 253 and len(f"remediate/c/{EMOJI_NODE}".encode()) > 1000
    with pytest.raises(ValueError, match="bytes"):
        subjects.workflow_id("c", EMOJI_NODE)
    longest_ascii = "n" * subjects.NODE_NAME_MAX
    assert len(subjects.workflow_id("c" * 128, longest_ascii).encode()) <= 1000
    p = _cli("creds", "generate", "--out", str(tmp_path / "c"), "--cluster", "c1", "--nodes", EMOJI_NODE,
             tmp_path=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-400:]
    assert len(p.stderr.strip().splitlines()) == 1 and "bytes" in p.stderr
    p = _cli("status", EMOJI_NODE, tmp_path=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr


def test_inject_refuses_an_xid_the_catalog_does_not_have(tmp_path: Path) -> None:
    p = _cli("inject", "--node", "gpu-001", "--xid", "99999", tmp_path=tmp_path,
             FLEETMEND_NATS_URL=f"nats://127.0.0.1:{_refused_port()}")
    assert p.returncode == 2 and p.stdout == ""
    (line,) = p.stderr.strip().splitlines()
    assert "XID 99999 is not in the catalog" in line and "cannot reach" not in line


# ------------------------------------------------------------------ with the servers

async def test_status_of_a_node_without_incidents_prints_json(temporal_server, unique, tmp_path: Path) -> None:
    node = f"nobody-{unique}"
    p = await asyncio.to_thread(_cli, "status", node, "--json", tmp_path=tmp_path,
                                FLEETMEND_TEMPORAL_ADDRESS=temporal_server.address)
    assert p.returncode == 1, p.stderr
    doc = json.loads(p.stdout)
    assert doc["node"] == node and doc["incident"] is None and "no incident" in doc["error"]


async def test_nodes_shows_one_incident_id_form(nats_server, unique, tmp_path: Path) -> None:
    """A drain records the incident's idempotency key `<workflow id>/<first run id>`; `nodes` shows the
    workflow id, the form of the incidents it joins and of `status`."""
    import nats

    from activities.standalone import StandaloneScheduler

    cluster = f"c{unique}"
    nc = await nats.connect(nats_server.url)
    try:
        sched = StandaloneScheduler(nc.jetstream(), cluster)
        wid = subjects.workflow_id(cluster, "gpu-001")
        await sched.drain("gpu-001", "xid79 incident", f"{wid}/0194d1b2-run")
    finally:
        await nc.close()
    p = await asyncio.to_thread(_cli, "nodes", "--no-incidents", "--json", tmp_path=tmp_path,
                                FLEETMEND_NATS_URL=nats_server.url, FLEETMEND_CLUSTER=cluster,
                                FLEETMEND_SCHEDULER="standalone")
    assert p.returncode == 0, p.stderr
    (row,) = [r for r in json.loads(p.stdout) if r["name"] == "gpu-001"]
    assert row["incident_id"] == wid
