"""Child process for the inventory udev test: runs `InventoryProbe(udev_source='kernel')` over the host root given
as argv[1] inside the network namespace it was started in (`ip netns exec NS python -m tests.udev_inventory_child
ROOT`), with the interval and the device poll out of reach (an hour), prints "ready" once the uevent socket is
bound, then one JSON line {reads, last_reason, reasons} after the first uevent-triggered read and a quiet spell;
exits after 20 s at the latest."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import structlog

from agents.inventory.probe import InventoryProbe

structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))


async def main(root: str) -> None:
    probe = InventoryProbe(Path(root), "c", "n1", interval_s=3600, change_poll_s=3600, udev_source="kernel",
                           udev_debounce_s=1.0, udev_virtual=True)  # a veth is the uevent a sandbox can make
    reasons: list[str] = []
    task = asyncio.create_task(probe.run(None))
    await asyncio.wait_for(probe.udev_listening.wait(), 10)
    while probe.reads < 1:
        await asyncio.sleep(0.05)
    reasons.append(probe.last_reason)
    print("ready", flush=True)
    deadline = time.monotonic() + 20
    while probe.reads < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    reasons.append(probe.last_reason)
    await asyncio.sleep(2.5)  # a second read now would mean the burst was not debounced
    print(json.dumps({"reads": probe.reads, "last_reason": probe.last_reason, "reasons": reasons,
                      "pending_by": probe.pending_by}), flush=True)
    task.cancel()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
