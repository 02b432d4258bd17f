"""Running a site tool (dcgmi, nvidia-smi, a reboot command) from the agent, with a deadline."""

from __future__ import annotations

import asyncio

OUTPUT_TAIL_BYTES = 2000
"""How much of a tool's output goes into a report (the end: where the verdict and errors are)."""


async def run_command(argv: list[str], timeout_s: float) -> tuple[int, bytes] | None:
    """Run `argv` (no shell), stdout and stderr together.

    Returns:
        (exit code, whole output), or None when it ran past `timeout_s` seconds (it is killed).
    Raises:
        OSError: the program cannot be started.
    """
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    try:
        async with asyncio.timeout(timeout_s):
            out, _ = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return None
    return proc.returncode or 0, out


def tail(out: bytes) -> str:
    return out[-OUTPUT_TAIL_BYTES:].decode(errors="replace")
