"""Machine output of the CLI: `--json` puts only JSON on stdout (logs and errors go to stderr),
`--version`, and the exit statuses `--help` documents."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FLEETMEND = [sys.executable, "-m", "fleetmend.cli.main"]


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FLEETMEND, *args], capture_output=True, text=True, cwd=REPO, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_version_prints_the_installed_version() -> None:
    p = _cli("--version")
    assert p.returncode == 0, p.stderr
    assert p.stdout == f"fleetmend {version('fleetmend')}\n"


def test_help_documents_exit_statuses() -> None:
    p = _cli("--help")
    assert p.returncode == 0
    for line in ("0    done", "1    could not be done", "2    bad usage or configuration", "130  interrupted"):
        assert line in p.stdout, p.stdout
    bad = _cli("status", "--no-such-option")
    assert bad.returncode == 2 and bad.stdout == ""


def test_a_log_line_never_lands_on_stdout_before_the_json(tmp_path: Path) -> None:
    """NATS unreachable: before, nats-py's connect error (a structlog warning) was printed on stdout ahead
    of any JSON; now the failed first connect is the command's one error line on stderr."""
    env = {"FLEETMEND_NATS_URL": "nats://127.0.0.1:1", "FLEETMEND_NATS_CONNECT_TIMEOUT_S": "1",
           "FLEETMEND_STATE_DIR": str(tmp_path), "FLEETMEND_SCHEDULER": "standalone"}
    p = _cli("nodes", "--json", env=env)
    assert p.returncode == 1
    assert p.stdout == "", p.stdout
    # and since try2 F8 the failed first connect logs nothing: the one error line is all of stderr
    assert "nats_error" not in p.stderr and p.stderr.startswith("error: cannot reach NATS"), p.stderr


def test_json_logs_go_to_stderr_in_every_process_format() -> None:
    code = ("from fleetmend.infra.logs import configure_logging\nimport logging, structlog\n"
            "configure_logging('json')\nstructlog.get_logger('t').warning('probe_logged', n=1)\n"
            "logging.getLogger('nats').error('stdlib_logged')\nprint('RESULT')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=30)
    assert p.returncode == 0, p.stderr
    assert p.stdout == "RESULT\n"
    lines = [json.loads(x) for x in p.stderr.splitlines()]
    assert [x["event"] for x in lines] == ["probe_logged", "stdlib_logged"]


def test_logs_follow_the_current_stderr_after_an_in_process_command_closed_its_own() -> None:
    """A CLI command run in-process (a test's runner) swaps sys.stderr for a buffer it closes after;
    before, the handler kept that buffer and every later record failed with "--- Logging error ---
    ... I/O operation on closed file" (CI run on 86a9da3, an activity's log after a CLI test)."""
    code = ("import io, logging, sys\nfrom fleetmend.infra.logs import configure_logging\n"
            "real = sys.stderr\nsys.stderr = io.StringIO()\nconfigure_logging('json')\nsys.stderr.close()\n"
            "sys.stderr = real\nlogging.getLogger('activity').warning('after_the_runner')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=30)
    assert p.returncode == 0, p.stderr
    assert "Logging error" not in p.stderr, p.stderr
    assert [json.loads(x)["event"] for x in p.stderr.splitlines()] == ["after_the_runner"], p.stderr


def test_creds_generate_json_lists_what_it_wrote(tmp_path: Path) -> None:
    p = _cli("creds", "generate", "--out", str(tmp_path / "c"), "--cluster", "c1", "--nodes", "n1,n2", "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    names = {c["name"] for c in doc["credentials"]}
    assert {"router", "worker", "admin", "node:c1/n1", "node:c1/n2"} <= names
    assert all(Path(c["seed_file"]).exists() for c in doc["credentials"]) and Path(doc["accounts_conf"]).exists()


_SDK_FAILURE = '''
import asyncio, sys, uuid  # noqa: E401
from datetime import timedelta
from temporalio import activity, workflow
from temporalio.client import Client, WorkflowFailureError
from temporalio.common import RetryPolicy
from temporalio.worker import Worker
from fleetmend.infra.logs import configure_logging

configure_logging("json", sys.argv[2])

@activity.defn
async def publish() -> None:
    raise ConnectionRefusedError(111, "nats: connection refused (127.0.0.1:4222)")

@workflow.defn(sandboxed=False)
class One:
    @workflow.run
    async def run(self) -> None:
        await workflow.execute_activity(publish, start_to_close_timeout=timedelta(seconds=10),
                                        retry_policy=RetryPolicy(maximum_attempts=1))

async def main() -> None:
    client = await Client.connect(sys.argv[1])
    tq = "logs-" + uuid.uuid4().hex[:8]
    async with Worker(client, task_queue=tq, workflows=[One], activities=[publish]):
        try:
            await client.execute_workflow(One.run, id=tq, task_queue=tq)
        except WorkflowFailureError:
            print("FAILED AS EXPECTED")

asyncio.run(main())
sys.stdout.flush(); sys.stderr.flush()
import os; os._exit(0)  # the SDK's runtime threads can abort a finalising interpreter: not what is tested here
'''


@pytest.mark.parametrize("level", ["info", "debug"])
def test_an_activity_failure_logged_by_the_sdk_is_one_line_with_its_error(temporal_server, level: str) -> None:
    """The SDK logs every failed activity ("Completing activity as failed") at WARNING with its traceback; after a
    NATS or Temporal outage an operator's log filled with tracebacks (CI run 4 of issue 24). One JSON line with
    `error`, the traceback only at debug (it is in the workflow's history too)."""
    p = subprocess.run([sys.executable, "-c", _SDK_FAILURE, temporal_server.address, level], capture_output=True,
                       text=True, cwd=REPO, timeout=60)
    assert p.returncode == 0 and "FAILED AS EXPECTED" in p.stdout, p.stderr[-3000:]
    lines = [json.loads(x) for x in p.stderr.splitlines() if x.startswith("{")]
    (failed,) = [x for x in lines if x["event"].startswith("Completing activity as failed")]
    assert failed["level"] == "warning" and failed["logger"].startswith("temporalio")
    if level == "info":
        assert failed["error"] == "ConnectionRefusedError: [Errno 111] nats: connection refused (127.0.0.1:4222)"
        assert "exception" not in failed and "Traceback" not in p.stderr
    else:
        assert "Traceback" in failed["exception"] and "error" not in failed
