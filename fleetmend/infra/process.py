"""Process lifecycle shared by every long-running command."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading

STOP_DEADLINE_S = 40.0
"""After SIGTERM/SIGINT a process has this long to stop cleanly (the worker's 30 s graceful
activity shutdown plus closing connections) before it exits anyway with status 1. A stop must not
hang on a server that died at the same moment (seen: a benchmark's worker still running 25 min
after its Temporal server and its parent were gone). Under a supervisor (systemd TimeoutStopSec,
Kubernetes terminationGracePeriodSeconds in deploy/) the shorter limit wins; this one matters
where nothing else would ever kill the process."""


def stop_on_signals(deadline_s: float | None = STOP_DEADLINE_S) -> asyncio.Event:
    """An Event set by the first SIGTERM/SIGINT; a second SIGINT/SIGTERM exits at once (code 130);
    a stop that takes longer than `deadline_s` seconds exits with code 1 (None: wait forever).

    Call from inside the running event loop.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    hits = {"n": 0}

    def overdue() -> None:
        sys.stderr.write(f"fleetmend: did not stop within {deadline_s:g} s of the signal; exiting\n")
        sys.stderr.flush()
        os._exit(1)

    def on_signal() -> None:
        hits["n"] += 1
        if hits["n"] > 1:
            os._exit(130)
        if deadline_s is not None:
            timer = threading.Timer(deadline_s, overdue)  # a thread: fires even if the event loop is stuck
            timer.daemon = True
            timer.start()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    return stop
