"""Logging for every fleetmend process: structlog JSON on stderr, console renderer in a tty.

Logs never go to stdout: stdout belongs to a command's result (`fleetmend status --json | jq` must
read JSON only), and container runtimes, systemd and `dev up` collect stderr the same way.

Stdlib loggers (nats, temporalio, asyncio) are routed through `structlog.stdlib.ProcessorFormatter`,
so one process writes one format. Bind context once (`log = structlog.get_logger().bind(cluster=…,
node=…)`); event names are snake_case past tense (`fault_published`, `spool_replayed`).
Inside workflows use `workflow.logger`, never structlog (`workflow.logger` stays quiet while a history replays).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_FORMATS = ("auto", "json", "console")


def _sdk_failure_one_line(lvl: int) -> Any:
    """A foreign-record processor: a WARNING (or lower) from the Temporal SDK's loggers (`temporalio.*`) that
    carries a traceback, e.g. "Completing activity as failed" for an activity cut off by a NATS or Temporal
    outage, keeps one line: `error` = `<type>: <message>` (500 chars at most). The traceback is in the
    failure the SDK sends to the server (the workflow's history, the Temporal UI), so the log need not repeat
    it; at `debug` level it stays. Errors (`logger.exception`, the SDK's own bugs) keep their tracebacks."""

    def proc(_logger: Any, _name: str, ed: Any) -> Any:
        rec = ed.get("_record")
        exc = ed.get("exc_info")
        if (lvl > logging.DEBUG and rec is not None and exc and rec.levelno < logging.ERROR
                and rec.name.startswith("temporalio")):
            err = exc[1] if isinstance(exc, tuple) else exc if isinstance(exc, BaseException) else None
            if err is not None:
                ed.pop("exc_info")
                ed["error"] = f"{type(err).__name__}: {err}"[:500]
        return ed

    return proc


class _CurrentStderr(logging.StreamHandler):
    """A stream handler that writes to whatever `sys.stderr` is when a record is emitted, not the stream
    it was when logging was configured: a CLI command run in-process (a test's runner, an embedding
    program) swaps `sys.stderr` for a buffer and closes it after, and a handler bound to that buffer
    then fails every later record with "I/O operation on closed file" (as the stdlib's last-resort
    handler does, `logging._StderrHandler`)."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def configure_logging(fmt: str = "auto", level: str | int = "info") -> None:
    """Configure structlog and the stdlib root logger. Idempotent (safe to call twice).

    Args:
        fmt: "auto" (console when stderr is a tty, else JSON), "json" or "console".
        level: minimum level for both structlog and stdlib loggers ("debug", "info", ... or an int).
    Raises:
        ValueError: unknown `fmt`, listing the valid ones.
    """
    if fmt not in _FORMATS:
        raise ValueError(f"unknown log format {fmt!r}; expected {', '.join(_FORMATS)}")
    console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    lvl = logging.getLevelName(level.upper()) if isinstance(level, str) else level

    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any = (structlog.dev.ConsoleRenderer() if console
                     else structlog.processors.JSONRenderer())

    structlog.configure(
        processors=[*shared, structlog.processors.StackInfoRenderer(),
                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        cache_logger_on_first_use=False,
    )
    handler = _CurrentStderr()
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, _sdk_failure_one_line(lvl)],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    *([] if console else [structlog.processors.format_exc_info]),
                    renderer],
    ))
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_fleetmend", False):
            root.removeHandler(h)
    handler._fleetmend = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(lvl)
