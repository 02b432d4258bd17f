"""Child process for the udev test: runs `UdevProbe(source='kernel', include_virtual_net=True)` inside
the network namespace it was started in (`ip netns exec NS python -m tests.udev_netns_child N`),
prints "ready" once the netlink socket is bound, then one JSON line per event; exits after N events
or 20 s."""

from __future__ import annotations

import asyncio
import sys

import structlog

from agents.udev import UdevProbe

structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))


async def main(n: int) -> None:
    probe = UdevProbe("kernel", include_virtual_net=True, cluster="c", node="n1")
    got = 0
    done = asyncio.Event()

    async def emit(ev) -> None:  # type: ignore[no-untyped-def]
        nonlocal got
        print(ev.model_dump_json(), flush=True)
        got += 1
        if got >= n:
            done.set()

    task = asyncio.create_task(probe.run(emit))
    await probe.started.wait()
    print("ready", flush=True)
    try:
        async with asyncio.timeout(20):
            await done.wait()
    except TimeoutError:
        pass
    task.cancel()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
