"""The KV lease electing one publisher of fleet-level gauges, against a real nats-server."""

from __future__ import annotations

import asyncio

import pytest

from fleetmend.infra.lease import KvLease, lease_bucket, lease_key


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def _bucket(nc, unique: str):
    return await lease_bucket(nc.jetstream(), bucket=f"leases_{unique}")


async def test_one_holder_among_contenders_then_takeover_after_ttl(nc, unique: str) -> None:
    kv = await _bucket(nc, unique)
    clock = Clock()
    key = lease_key("incident-poller", "c1")
    a, b, c = (KvLease(kv, key, name, ttl_s=30, clock=clock) for name in ("a", "b", "c"))
    won = await asyncio.gather(a.tick(), b.tick(), c.tick())
    assert sum(won) == 1, won  # concurrent creates: exactly one wins the compare-and-set
    holder = [x for x, w in zip((a, b, c), won, strict=True) if w][0]
    others = [x for x in (a, b, c) if x is not holder]
    assert await holder.holder_now() == holder.holder
    for _ in range(5):  # the holder renews every 10 s; the others never take over
        clock.t += 10
        assert await holder.tick()
        assert [await o.tick() for o in others] == [False, False]
    # the holder dies (stops ticking): after ttl_s of an unchanged revision one contender takes over
    clock.t += 20
    assert [await o.tick() for o in others] == [False, False]
    assert holder.held  # its own last write is 20 s old: still within ttl_s
    clock.t += 11
    assert holder.held is False  # its last write is now older than ttl_s
    taken = [await o.tick() for o in others]
    assert sum(taken) == 1, taken
    new = [o for o, t in zip(others, taken, strict=True) if t][0]
    assert await new.holder_now() == new.holder
    # the old holder comes back: its compare-and-set fails, it is a contender again
    assert await holder.tick() is False and holder.held is False


async def test_release_hands_over_at_the_next_tick(nc, unique: str) -> None:
    kv = await _bucket(nc, unique)
    clock = Clock()
    key = lease_key("router-lag", "c1")
    a, b = KvLease(kv, key, "a", ttl_s=30, clock=clock), KvLease(kv, key, "b", ttl_s=30, clock=clock)
    assert await a.tick() and not await b.tick()
    await a.release()
    assert a.held is False and await a.holder_now() is None
    assert await b.tick()  # no waiting for ttl_s after a clean stop
    assert await a.tick() is False


async def test_each_cluster_has_its_own_lease(nc, unique: str) -> None:
    kv = await _bucket(nc, unique)
    a = KvLease(kv, lease_key("incident-poller", "c1"), "a")
    b = KvLease(kv, lease_key("incident-poller", "c2"), "b")
    assert await a.tick() and await b.tick()


def test_names_are_checked() -> None:
    with pytest.raises(ValueError):
        lease_key("incident-poller", "bad.cluster")
    with pytest.raises(ValueError):
        KvLease(None, "k", "a", ttl_s=0)
