"""`fleetmend.infra.retry.until_won`, the compare-and-set rounds of the permit pool, the ledger, the ticket
ledger, the standalone and Kubernetes schedulers (tenacity): a lost round is run again from its read, with
the pause asked for; the last of `attempts` lost rounds raises `LostRace`; any other error ends the rounds at
once; a cancelled round is not run again."""

from __future__ import annotations

import asyncio

import pytest

from fleetmend.infra.retry import LostRace, until_won


def rounds(outcomes: list[object]):
    ran: list[int] = []

    async def one_round() -> object:
        ran.append(len(ran) + 1)
        out = outcomes[len(ran) - 1]
        if isinstance(out, BaseException):
            raise out
        return out

    return one_round, ran


async def test_lost_rounds_are_run_again_with_their_pause_until_one_wins(monkeypatch) -> None:
    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(s: float) -> None:
        slept.append(s)
        await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    one_round, ran = rounds([LostRace(), LostRace(), LostRace(), "won"])
    assert await until_won(one_round, attempts=4, pause=lambda n: n / 100) == "won"
    assert ran == [1, 2, 3, 4] and slept == [0.01, 0.02, 0.03]

    slept.clear()
    one_round, ran = rounds(["at once"])
    assert await until_won(one_round, attempts=4, pause=lambda n: n / 100) == "at once"
    assert ran == [1] and slept == []


async def test_the_last_lost_round_raises_and_other_errors_end_the_rounds_at_once() -> None:
    one_round, ran = rounds([LostRace("a"), LostRace("b"), LostRace("c"), "too late"])
    with pytest.raises(LostRace, match="c"):
        await until_won(one_round, attempts=3)
    assert ran == [1, 2, 3]
    one_round, ran = rounds([LostRace("only")])
    with pytest.raises(LostRace):
        await until_won(one_round, attempts=1)
    assert ran == [1]
    one_round, ran = rounds([LostRace(), KeyError("gone"), "never"])
    with pytest.raises(KeyError):
        await until_won(one_round, attempts=5)
    assert ran == [1, 2]
    one_round, ran = rounds([LostRace()] * 200 + ["won"])
    assert await until_won(one_round, attempts=None) == "won" and len(ran) == 201


async def test_a_cancelled_round_is_not_run_again() -> None:
    started = asyncio.Event()
    ran: list[int] = []

    async def one_round() -> None:
        ran.append(1)
        if len(ran) == 1:
            raise LostRace()
        started.set()
        await asyncio.sleep(30)

    task = asyncio.create_task(until_won(one_round, attempts=None))
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    assert len(ran) == 2
