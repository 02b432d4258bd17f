"""Compare-and-set rounds retried through tenacity (issue 30 point 5: every retry outside Temporal's own is
tenacity's).

A compare-and-set round reads a value with its revision (a JetStream KV entry, a Kubernetes object's
`resourceVersion`), computes the change and writes it only if the revision is still the one read. A round
that loses (another writer came first) raises `LostRace` and is run again, from the read; any other
exception ends the rounds at once, and so does cancellation (tenacity never retries a `CancelledError`).

    result = await until_won(one_round, attempts=8)            # LostRace after 8 lost rounds
    result = await until_won(one_round, attempts=None)         # until it wins
    result = await until_won(one_round, attempts=64, pause=f)  # f(n): seconds after the n-th lost round

The first round is awaited directly and tenacity takes over only once it lost: tenacity's bookkeeping
(~30-90 µs a call on a loaded 2-core box: it inspects its callbacks every round) would otherwise be paid on
every permit claim and ledger write of the router, where a race is the exception.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt, stop_never

T = TypeVar("T")


class LostRace(Exception):
    """A compare-and-set round lost: the value changed since it was read. Raised by a round, caught by
    `until_won`, which reads again; raised by `until_won` itself after its last round lost."""


async def until_won(round_: Callable[[], Awaitable[T]], *, attempts: int | None,
                    pause: Callable[[int], float] | None = None) -> T:
    """Run `round_` until it returns: at most `attempts` rounds in all (None: no bound), `pause(n)` seconds
    after the n-th lost round (n from 1; None: none).

    Returns:
        What the winning round returned.
    Raises:
        LostRace: the last of `attempts` rounds lost.
        Whatever a round raises besides `LostRace`, at once (cancellation included).
    """
    try:
        return await round_()
    except LostRace:
        if attempts is not None and attempts <= 1:
            raise
    if pause is not None:
        await asyncio.sleep(pause(1))

    def wait(state: RetryCallState) -> float:  # tenacity's attempt n is round n + 1: n + 1 rounds lost before it
        return pause(state.attempt_number + 1) if pause is not None else 0.0

    async for attempt in AsyncRetrying(stop=stop_never if attempts is None else stop_after_attempt(attempts - 1),
                                       wait=wait, retry=retry_if_exception_type(LostRace), reraise=True):
        with attempt:
            return await round_()
    raise AssertionError("unreachable: tenacity returns the winning round or raises the last LostRace")
