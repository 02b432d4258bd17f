"""Process lifecycle shared by every long-running command (STYLE 20)."""

from __future__ import annotations

import asyncio
import os
import signal


def stop_on_signals() -> asyncio.Event:
    """An Event set by the first SIGTERM/SIGINT; a second SIGINT/SIGTERM exits at once (code 130).

    Call from inside the running event loop.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    hits = {"n": 0}

    def on_signal() -> None:
        hits["n"] += 1
        if hits["n"] > 1:
            os._exit(130)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    return stop
