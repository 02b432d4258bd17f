"""`fleetmend config check` as an operator runs it: the settings it prints carry no secret (the output
gets pasted into tickets and chats), and a nested Jira variable raises no pydantic-settings warning."""

from __future__ import annotations

import json
import os
import subprocess
import sys

FLEETMEND = [sys.executable, "-m", "fleetmend.cli.main"]


def test_config_check_prints_no_secret(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETMEND_")}
    env.update({"FLEETMEND_STATE_DIR": str(tmp_path), "FLEETMEND_NATS_PASSWORD": "hunter2",
                "FLEETMEND_NATS_URL": "nats://ops:urlpw@nats.example:4222",
                "FLEETMEND_TICKETS__JIRA__API_TOKEN": "jiratok", "FLEETMEND_TICKETS__JIRA__BEARER_TOKEN": "dctok",
                "FLEETMEND_NOTIFY__PAGERDUTY_ROUTING_KEY": "pdkey",
                "FLEETMEND_NOTIFY__SLACK_WEBHOOK_URL": "https://hooks.slack.com/services/T/B/slacksecret",
                "FLEETMEND_TICKETS__WEBHOOK_HEADERS": '{"Authorization": "Bearer hdrsecret"}'})
    p = subprocess.run(FLEETMEND + ["config", "check"], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    for secret in ("hunter2", "urlpw", "jiratok", "dctok", "pdkey", "slacksecret", "hdrsecret"):
        assert secret not in p.stdout + p.stderr, secret
    assert "Warning" not in p.stderr, p.stderr  # pydantic-settings: unresolved forward reference 'jira'
    shown = json.loads(p.stdout[: p.stdout.rindex("}") + 1])
    assert shown["nats_url"] == "nats://ops:***@nats.example:4222" and shown["nats_password"] == "***"
    assert shown["tickets"]["jira"]["api_token"] == "***" and shown["tickets"]["webhook_headers"] == {"Authorization": "***"}
    assert shown["tickets"]["jira"]["email"] is None and shown["cluster"] == "local"  # the rest as it is


def _run(argv: list[str], tmp_path, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETMEND_")}
    env.update({"FLEETMEND_STATE_DIR": str(tmp_path / "state"), **extra})
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)


def test_config_check_reads_the_catalog_overrides(tmp_path) -> None:
    """Every process loads `catalog_overrides` at start; a bad row, unknown key, broken TOML or missing file
    fails `config check` with one line naming the file and the entry, exit 2, never at the process's start."""
    cases = {"bad_value.toml": ('[xid.79]\nseverity = "catastrophic"\n', "[xid.79]: severity"),
             "bad_key.toml": ("[xid.79]\nbogus_field = 1\n", "[xid.79]"),
             "not_toml.toml": ("this is not toml\n", "not valid TOML")}
    for name, (text, expect) in cases.items():
        (tmp_path / name).write_text(text)
        p = _run(FLEETMEND + ["config", "check"], tmp_path, FLEETMEND_CATALOG_OVERRIDES=str(tmp_path / name))
        assert p.returncode == 2, (name, p.stdout, p.stderr)
        assert expect in p.stderr and str(tmp_path / name) in p.stderr and "Traceback" not in p.stderr, p.stderr
    p = _run(FLEETMEND + ["config", "check"], tmp_path, FLEETMEND_CATALOG_OVERRIDES=str(tmp_path / "missing.toml"))
    assert p.returncode == 2 and "not found" in p.stderr, p.stderr
    (tmp_path / "good.toml").write_text('[xid.13]\nseverity = "fatal"\n')
    p = _run(FLEETMEND + ["config", "check"], tmp_path, FLEETMEND_CATALOG_OVERRIDES=str(tmp_path / "good.toml"))
    assert p.returncode == 0, p.stderr


def test_a_bad_catalog_override_stops_the_agent_with_one_line(tmp_path) -> None:
    (tmp_path / "ov.toml").write_text('[xid.79]\nseverity = "catastrophic"\n')
    log = tmp_path / "dmesg.txt"
    log.write_text("NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.\n")
    p = _run([sys.executable, "-m", "agents", "--node", "n1", "--kmsg-file", str(log), "--once"], tmp_path,
             FLEETMEND_CATALOG_OVERRIDES=str(tmp_path / "ov.toml"), FLEETMEND_NATS_URL="nats://127.0.0.1:1")
    assert p.returncode == 2, p.stderr
    assert "invalid catalog_overrides" in p.stderr and "[xid.79]" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_an_environment_value_that_is_not_json_is_one_line_exit_2(tmp_path) -> None:
    p = _run(FLEETMEND + ["config", "check"], tmp_path, FLEETMEND_AGENT__BENCH_COMMAND="[notjson")
    assert p.returncode == 2, p.stderr
    assert "FLEETMEND_AGENT__BENCH_COMMAND: not valid JSON" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
