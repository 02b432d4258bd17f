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
