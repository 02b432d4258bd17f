"""A new user's second try (try2 findings F1, F5, F6, F8, F13, F14, F22, F23, F26, F27): bad input is one line
(usage and configuration errors exit 2), never a traceback, a hang or a silent drop. Each test failed before
its fix."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _cli(*args: str, tmp_path: Path, timeout: float = 90, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLEETMEND_")}
    base.update({"FLEETMEND_STATE_DIR": str(tmp_path / "state"), **env})
    return subprocess.run([sys.executable, "-m", "fleetmend.cli.main", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=timeout, env=base)


def _one_error_line(p: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, p.stderr
    return lines[0]


# ------------------------------------------------------------------ F26: a cluster no worker serves

@pytest.mark.parametrize("command", [["pause", "--note", "x"], ["resume"], ["breaker", "reset"], ["breaker", "status"]])
async def test_a_guard_command_for_a_cluster_no_worker_serves_fails_at_once(
        command: list[str], nats_server, temporal_server, nc, unique, tmp_path: Path) -> None:
    from fleetmend.infra.lease import Presence

    served = Presence(nc.jetstream(), "worker", [f"real{unique}"], holder=f"h{unique}")
    await served.announce()
    try:
        t0 = time.monotonic()
        p = _cli(*command, "--cluster", f"lcoal{unique}", tmp_path=tmp_path, timeout=40,
                 FLEETMEND_NATS_URL=nats_server.url, FLEETMEND_TEMPORAL_ADDRESS=temporal_server.address)
        assert time.monotonic() - t0 < 20
    finally:
        await served.withdraw()
    assert p.returncode == 1
    line = _one_error_line(p)
    assert f"no worker serves cluster lcoal{unique}" in line and f"real{unique}" in line, line
    assert f"fleetmend worker --cluster lcoal{unique}" in line


# ------------------------------------------------------------------ F6: FLEETMEND_LOG_FORMAT

@pytest.mark.parametrize("command", [["config", "check"], ["runbook"], ["nodes"]])
def test_an_unknown_log_format_is_one_configuration_line_exit_2(command: list[str], tmp_path: Path) -> None:
    p = _cli(*command, tmp_path=tmp_path, FLEETMEND_LOG_FORMAT="xml")
    assert p.returncode == 2, p.stderr
    line = _one_error_line(p)
    assert line.startswith("invalid configuration: FLEETMEND_LOG_FORMAT") and "'xml'" in line and "json" in line


# ------------------------------------------------------------------ F8: NATS away

def test_a_command_with_nats_away_prints_only_its_error_line(tmp_path: Path) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for command in (["nodes", "--no-incidents"], ["inject", "--node", "x", "--xid", "79"]):
        p = _cli(*command, tmp_path=tmp_path, FLEETMEND_NATS_URL=f"nats://127.0.0.1:{port}",
                 FLEETMEND_SCHEDULER="standalone")
        assert p.returncode == 1
        line = _one_error_line(p)
        assert line.startswith("error: cannot reach NATS") and "connection refused" in line, line


# ------------------------------------------------------------------ F13, F14, F1: report

@pytest.mark.parametrize("where", ["/nonexistent/dir/r.html", "{tmp}"])
def test_report_html_to_an_unwritable_path_is_one_usage_line(where: str, tmp_path: Path) -> None:
    target = where.format(tmp=tmp_path)
    # NATS is not even asked: the path is checked first
    p = _cli("report", "--html", target, tmp_path=tmp_path, FLEETMEND_NATS_URL="nats://127.0.0.1:1")
    assert p.returncode == 2, p.stderr
    line = _one_error_line(p)
    assert line.startswith(f"--html {target}:") and ("no such directory" in line or "is a directory" in line), line


@pytest.mark.parametrize("since", ["99999d", "1753-01-01", "2999-01-01T00:00:00"])
def test_report_since_beyond_ten_years_or_in_the_future_is_one_usage_line(since: str, tmp_path: Path) -> None:
    p = _cli("report", "--since", since, tmp_path=tmp_path, FLEETMEND_NATS_URL="nats://127.0.0.1:1")
    assert p.returncode == 2, p.stderr
    line = _one_error_line(p)
    assert line.startswith(f"--since {since!r}:") and ("at most 3650 days" in line or "future" in line), line


def test_report_headline_keeps_a_small_nonzero_gpu_hours(capsys) -> None:
    from fleetmend.cli import report
    from fleetmend.report import ReportParams, build_report

    t0 = 1_000_000.0  # one GPU out for 2.3 minutes: 0.038 GPU-hours
    rec = {"cluster": "c", "node": "n1", "incident_id": "remediate/c/n1/1", "fault_class": "xid79",
           "drained_at": t0, "returned_at": t0 + 138, "closed_at": t0 + 138, "gpu_count": 1,
           "outcome": "returned_after_repair"}
    rep = build_report([rec], ReportParams(since=t0 - 3600, now=t0 + 3600))
    report._print(rep)
    text = capsys.readouterr().out
    assert "0.04 GPU-hours out of service in 1 incident" in text, text
    assert report.gpu_hours_text(0.0038) == "0.0038" and report.gpu_hours_text(0.0) == "0.00"
    assert report.gpu_hours_text(1234.5) == "1,234.50"


# ------------------------------------------------------------------ F22: ports

@pytest.mark.parametrize(("var", "value"), [("FLEETMEND_TEMPORAL_UI_PORT", "70000"), ("FLEETMEND_TEMPORAL_UI_PORT", "-1"),
                                            ("FLEETMEND_TEMPORAL_UI_PORT", "0"),
                                            ("FLEETMEND_NATS_URL", "nats://127.0.0.1:99999"),
                                            ("FLEETMEND_NATS_URL", "nats://127.0.0.1:4222,nats://h2:0"),
                                            ("FLEETMEND_METRICS__WORKER_PORT", "65536")])
def test_config_check_refuses_a_port_out_of_range_in_one_line(var: str, value: str, tmp_path: Path) -> None:
    p = _cli("config", "check", tmp_path=tmp_path, **{var: value})
    assert p.returncode == 2 and p.stdout == "", p.stderr
    line = _one_error_line(p)
    assert line.startswith("invalid configuration: ") and var[len("FLEETMEND_"):].lower().replace("__", ".") in line


def test_dev_up_with_a_ui_port_out_of_range_starts_nothing(tmp_path: Path) -> None:
    p = _cli("dev", "up", "--ui-port", "99999", "--nats-url", "nats://127.0.0.1:4333", tmp_path=tmp_path, timeout=30)
    assert p.returncode == 2 and p.stdout == "", p.stdout  # nothing started ("nats-server ..." is stdout)
    line = _one_error_line(p)
    assert line.startswith("invalid configuration: temporal_ui_port: ") and "99999" in line and "65535" in line, line
    p = _cli("dev", "up", "--nats-url", "nats://127.0.0.1:99999", tmp_path=tmp_path, timeout=30)
    assert p.returncode == 2 and p.stdout == "" and "nats_url" in _one_error_line(p)


# ------------------------------------------------------------------ F23: the state directory

def test_a_state_dir_that_is_a_file_is_one_line_before_dev_up_starts_anything(tmp_path: Path) -> None:
    f = tmp_path / "statefile"
    f.write_text("")
    for state in (f, f / "below"):
        p = _cli("dev", "up", "--nats-url", "nats://127.0.0.1:4334", "--temporal-address", "127.0.0.1:7334",
                 tmp_path=tmp_path, timeout=30, FLEETMEND_STATE_DIR=str(state))
        assert p.returncode == 2 and p.stdout == "", p.stdout
        line = _one_error_line(p)
        assert line.startswith(f"error: state dir {state}: ") and "not a directory" in line, line
        c = _cli("config", "check", tmp_path=tmp_path, FLEETMEND_STATE_DIR=str(state))
        assert c.returncode == 2 and "not a directory" in _one_error_line(c)


def test_ensure_state_dir_names_what_the_system_refused(tmp_path: Path, monkeypatch) -> None:
    from fleetmend.config import ensure_state_dir
    from fleetmend.errors import ConfigError

    def refuse(*_a, **_k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(ConfigError, match=r"^state dir .*: not writable \(permission denied\); set FLEETMEND_STATE_DIR"):
        ensure_state_dir(tmp_path / "new")


# ------------------------------------------------------------------ F5: inject --bus-id

@pytest.mark.parametrize("bus_id", ["zz", "0000:3b:00.9", "0000:3b:00.0 ; rm", ""])
def test_inject_refuses_a_bus_id_that_is_not_a_pci_address(bus_id: str, tmp_path: Path) -> None:
    # refused before NATS is asked (nothing listens at port 1)
    p = _cli("inject", "--node", "gpu-020", "--xid", "79", "--bus-id", bus_id, tmp_path=tmp_path,
             FLEETMEND_NATS_URL="nats://127.0.0.1:1")
    assert p.returncode == 2, p.stderr
    line = _one_error_line(p)
    assert line == (f"error: --bus-id: {bus_id!r} is not a PCI bus id; expected [domain:]bus:device[.function] in hex, "
                    "e.g. 0000:3b:00.0"), line


async def test_inject_normalizes_the_bus_id_as_the_agents_report_it(nats_server, nc, unique, tmp_path: Path) -> None:
    import json

    from fleetmend import subjects
    from fleetmend.infra.jetstream import ensure_fault_stream

    await ensure_fault_stream(nc.jetstream())
    p = _cli("inject", "--node", "gpu-020", "--xid", "79", "--bus-id", "PCI:3B:00", "--cluster", f"c{unique}",
             "--json", tmp_path=tmp_path, FLEETMEND_NATS_URL=nats_server.url)
    assert p.returncode == 0, p.stderr
    msg = await nc.jetstream().get_msg(subjects.FAULT_STREAM, json.loads(p.stdout)["seq"])
    assert json.loads(msg.data)["device"]["pci_bus_id"] == "0000:3b:00.0"


# ------------------------------------------------------------------ F27: notes and ticket ids

@pytest.mark.parametrize(("command", "option", "value", "why"), [
    (["repaired", "storm-102"], "--ticket", "RMA\n123\x1b[31m", "control character ('\\n' at position 4)"),
    (["repaired", "storm-102"], "--note", "line1 \x1b[2J", "control character ('\\x1b' at position 7)"),
    (["abort", "x-2"], "--note", "x" * 120_000, "120000 characters; at most 2000"),
    (["repaired", "x-2"], "--ticket", "T" * 129, "129 characters; at most 128"),
    (["pause"], "--note", "a\tb", "control character ('\\t' at position 2)"),
    (["breaker", "reset"], "--note", "rtl \u202e", "control character ('\\u202e' at position 5)"),
    (["drift", "allow", "version.nvidia_driver", "550"], "--why", "ok\r", "control character ('\\r' at position 3)"),
])
def test_notes_and_ticket_ids_refuse_control_characters_and_length(command: list[str], option: str, value: str,
                                                                   why: str, tmp_path: Path) -> None:
    # a usage error (exit 2) before any server is asked (nothing listens at port 1)
    p = _cli(*command, option, value, tmp_path=tmp_path, FLEETMEND_NATS_URL="nats://127.0.0.1:1",
             FLEETMEND_TEMPORAL_ADDRESS="127.0.0.1:1")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert f"Invalid value for '{option}': " in p.stderr and why in p.stderr, p.stderr
