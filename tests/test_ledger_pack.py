"""The ledger's roll-up (`fleetmend.infra.ledger.LedgerStore.roll_up`) on a real nats-server: closed records packed
many per value, idempotently, and the report's figures the same before and after.

- Records written the way production writes them (the phase functions the router and the activities call),
  over several close days and more records than a part holds, plus an open record: the roll-up packs every
  closed one, leaves the open one alone, purges the packed records' own messages; the figures (and `--json` of
  the real CLI) are equal before and after; a second roll-up writes nothing.
- A crash between the pack write and the purge, and a crash between two part writes: every incident counted
  once, and the next roll-up finishes the work.
- Two roll-ups at once (two replicas during a lease handover): every incident once.
- A newer copy of a packed record (a close retried after the roll-up): the reader keeps the newer; the next
  roll-up replaces it in its pack.
- Records closed too recently stay individual (`min_age_s`); a backlog is packed over several bounded runs.
- The pack codec itself: index columns, shared values, times exact, a field the index lacks.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from datetime import datetime, timezone

import pytest

from fleetmend import ledger as L
from fleetmend import subjects
from fleetmend.infra.ledger import LedgerStore, decode, encode, scan
from fleetmend.report import FIELDS, ReportParams, build_report
from tests.test_ledger import cli, fingerprint, incident, put_fingerprint

DAY = 86400.0


async def _keys(js, prefix: str) -> list[str]:
    got: list[str] = []
    await scan(js, subjects.LEDGER_KV_BUCKET, prefix, lambda k, _d: got.append(k))
    return got


async def _fill(store: LedgerStore, js, cluster: str, *, days: int = 3, per_day: int = 5) -> int:
    """Closed incidents through the phase functions, then moved back `d` days (their own keys rewritten as
    `_archive` writes them: close day d ago), plus one open incident. Returns the closed records written."""
    for i in range(days * per_day):
        node = f"n{i}"
        await put_fingerprint(js, fingerprint(cluster, node, f"GPU-{i}", driver="535.104.05" if i % 3 else "550.90.07"))
        await incident(store, cluster, node, f"remediate/{cluster}/{node}/r{i}", datetime.now(timezone.utc))
    kv = await store.kv()
    for i, key in enumerate(sorted(await _keys(js, f"inc.{cluster}."))):
        back = (i % days) * DAY + 3600.0 * (i % 7)
        head, detail = decode((await kv.get(key)).value)
        for k in ("observed_at", "routed_at", "drained_at", "ticket_filed_at", "ticket_closed_at", "returned_at",
                  "closed_at"):
            if head.get(k) is not None:
                head[k] -= back
        await js.purge_stream(f"KV_{subjects.LEDGER_KV_BUCKET}", subject=f"$KV.{subjects.LEDGER_KV_BUCKET}.{key}")
        await store._archive(head, detail)  # the key names the drain time: the moved record's own key
    await put_fingerprint(js, fingerprint(cluster, "still-out", "GPU-x"))
    await incident(store, cluster, "still-out", f"remediate/{cluster}/still-out/r", datetime.now(timezone.utc),
                   resolve=False)
    return days * per_day


def _figures(heads: list[dict], now: float, fleet: list[dict] | None = None) -> dict:
    return build_report(heads, ReportParams(since=now - 30 * DAY, now=now), fleet=fleet or [], cluster="c")


@pytest.fixture
def small_parts(monkeypatch):
    monkeypatch.setattr(L, "PACK_RECORDS", 4)  # 15 records over 3 days: 2 parts a day


async def test_roll_up_packs_closed_records_and_the_figures_do_not_change(nc, nats_server, unique, small_parts):
    cluster = f"p{unique}"
    js = nc.jetstream()
    store = LedgerStore(js)
    n = await _fill(store, js, cluster, days=5)
    now = time.time()
    before = await store.read_heads(cluster, fields=FIELDS)
    assert len(before) == n + 1
    cli_before = json.loads((await cli(nats_server.url, "report", "--json", "--cluster", cluster, "--since", "30d")).stdout)

    per_day = Counter(L.pack_day(h) for h in before if h.get("outcome"))
    assert len(per_day) >= 5
    stats = await store.roll_up(cluster)
    parts = sum(math.ceil(c / 4) for c in per_day.values())
    assert stats == {"records": n, "parts": parts, "purged": n, "left": 0, "more": 0}, stats
    assert await _keys(js, f"inc.{cluster}.") == [], "every packed record's own message is purged"
    packs = sorted(await _keys(js, f"pack.{cluster}."))
    assert len(packs) == parts and {k.split(".")[2] for k in packs} == set(per_day), packs
    assert len(await _keys(js, f"open.{cluster}.")) == 1, "an open record stays individual"

    after = await store.read_heads(cluster, fields=FIELDS)
    fleet = await store.fleet(cluster)
    assert _figures(after, now, fleet) == _figures(before, now, fleet)
    assert sorted((h["node"], h["drained_at"]) for h in after) == sorted((h["node"], h["drained_at"]) for h in before)
    cli_after = json.loads((await cli(nats_server.url, "report", "--json", "--cluster", cluster, "--since", "30d")).stdout)
    for k in ("incidents", "outcomes", "mttr_h", "ticket_turnaround_h", "time_to_drain_s", "time_to_detect_s",
              "findings", "parts_not_replaced", "false_drain_rate", "lemons"):
        assert cli_after[k] == cli_before[k], k
    # the open record's hours grow between the two runs
    assert cli_after["gpu_hours"] == pytest.approx(cli_before["gpu_hours"], abs=0.05)
    assert cli_after["gpu_hours_by_fault_class"] == pytest.approx(cli_before["gpu_hours_by_fault_class"], abs=0.05)

    # the details travel too: the vendor bundle's read (with_detail) finds the raw lines in the packs
    full = await store.read_heads(cluster, with_detail=True)
    assert len(full) == n + 1 and all("fallen off the bus" in h["_detail"]["raw"] for h in full)
    assert {h["_key"].split(".")[0] for h in full} == {"inc", "open"}

    # a report of the last day skips the packs of days before (margin: 2 days) and gives the same figures
    since = now - 1 * DAY
    recent = await store.read_heads(cluster, fields=FIELDS, since=since)
    assert len(recent) < len(after)
    assert build_report(recent, ReportParams(since=since, now=now)) == build_report(after, ReportParams(since=since, now=now))

    assert await store.roll_up(cluster) == {"records": 0, "parts": 0, "purged": 0, "left": 0, "more": 0}, "nothing left to do"


async def test_a_crash_between_the_pack_and_the_purge_counts_every_incident_once(nc, unique, small_parts, monkeypatch):
    cluster = f"q{unique}"
    js = nc.jetstream()
    store = LedgerStore(js)
    n = await _fill(store, js, cluster)
    now = time.time()
    before = _figures(await store.read_heads(cluster, fields=FIELDS), now)

    async def killed(_packed, _whole=None):  # the process dies after each day's pack write, before its purge
        return 0

    monkeypatch.setattr(store, "_purge", killed)
    assert (await store.roll_up(cluster))["purged"] == 0
    assert len(await _keys(js, f"inc.{cluster}.")) == n and await _keys(js, f"pack.{cluster}."), "both copies"
    heads = await store.read_heads(cluster, fields=FIELDS)
    assert len(heads) == n + 1 and _figures(heads, now) == before
    assert len((await store.read_heads(cluster, with_detail=True))) == n + 1

    monkeypatch.undo()
    monkeypatch.setattr(L, "PACK_RECORDS", 4)
    stats = await store.roll_up(cluster)  # finds every record packed already: writes nothing, purges
    assert stats == {"records": n, "parts": 0, "purged": n, "left": 0, "more": 0}, stats
    heads = await store.read_heads(cluster, fields=FIELDS)
    assert len(heads) == n + 1 and _figures(heads, now) == before


async def test_a_crash_between_two_part_writes_loses_nothing(nc, unique, small_parts, monkeypatch):
    cluster = f"r{unique}"
    js = nc.jetstream()
    store = LedgerStore(js)
    n = await _fill(store, js, cluster)
    now = time.time()
    before = _figures(await store.read_heads(cluster, fields=FIELDS), now)
    kv = await store.kv()
    real_create = kv.create
    writes = [0]

    async def create(key, value, **kw):
        if key.startswith("pack."):
            writes[0] += 1
            if writes[0] == 2:  # the first day's second part
                raise ConnectionError("killed mid roll-up")
        return await real_create(key, value, **kw)

    monkeypatch.setattr(kv, "create", create)
    with pytest.raises(ConnectionError):
        await store.roll_up(cluster)
    monkeypatch.setattr(kv, "create", real_create)
    heads = await store.read_heads(cluster, fields=FIELDS)
    assert len(heads) == n + 1 and _figures(heads, now) == before
    stats = await store.roll_up(cluster)
    assert stats["records"] == n and stats["left"] == 0 and stats["purged"] == n, stats
    assert await _keys(js, f"inc.{cluster}.") == []
    heads = await store.read_heads(cluster, fields=FIELDS)
    assert len(heads) == n + 1 and _figures(heads, now) == before


async def test_two_roll_ups_at_once_count_every_incident_once(nats_server, nc, unique, small_parts):
    import nats

    cluster = f"s{unique}"
    js = nc.jetstream()
    store = LedgerStore(js)
    n = await _fill(store, js, cluster)
    now = time.time()
    before = _figures(await store.read_heads(cluster, fields=FIELDS), now)
    other = await nats.connect(nats_server.url)
    try:
        a, b = await asyncio.gather(store.roll_up(cluster), LedgerStore(other.jetstream()).roll_up(cluster))
    finally:
        await other.close()
    assert a["records"] + b["records"] >= n
    heads = await store.read_heads(cluster, fields=FIELDS)
    assert len(heads) == n + 1 and _figures(heads, now) == before
    await store.roll_up(cluster)  # whatever a lost race left: packed now
    assert await _keys(js, f"inc.{cluster}.") == []
    heads = await store.read_heads(cluster, fields=FIELDS)
    assert len(heads) == n + 1 and _figures(heads, now) == before


async def test_a_newer_copy_after_the_roll_up_wins_and_replaces_the_packed_one(nc, unique):
    cluster = f"t{unique}"
    js = nc.jetstream()
    store = LedgerStore(js)
    await put_fingerprint(js, fingerprint(cluster, "n1", "GPU-1"))
    await incident(store, cluster, "n1", f"remediate/{cluster}/n1/r", datetime.now(timezone.utc))
    assert (await store.roll_up(cluster))["records"] == 1
    (packed,) = await store.read_heads(cluster, with_detail=True)
    head, detail = {k: v for k, v in packed.items() if not k.startswith("_")}, packed["_detail"]
    await store._archive(dict(head, ticket_status="reopened"), detail)  # a late copy of the same record
    (now_read,) = await store.read_heads(cluster, fields=FIELDS + ("ticket_status",))
    assert now_read["ticket_status"] == "reopened", "the newest copy wins"
    assert await store.roll_up(cluster) == {"records": 1, "parts": 1, "purged": 1, "left": 0, "more": 0}
    (again,) = await store.read_heads(cluster, fields=FIELDS + ("ticket_status",))
    assert again["ticket_status"] == "reopened" and len(await _keys(js, f"pack.{cluster}.")) == 1


def test_the_pack_codec():
    heads = [{"cluster": "c", "node": f"n{i}", "drained_at": 10.0 + i, "fault_class": "xid79",
              "versions_drain": {"nvidia_driver": "550"}, "lemon": "yes" if i == 2 else None, "keys": ["a"]}
             for i in range(8)]
    recs = [(f"inc.c.n{i}.{i}", 100 + i, h, encode(h, {"raw": f"line {i}\nline {i + 1}"})) for i, h in enumerate(heads)]
    value = L.encode_pack(recs, ("node", "drained_at", "fault_class", "versions_drain", "lemon", "slow"))
    assert value.startswith(L.PACK_MAGIC)
    got = list(L.decode_pack_index(value))
    assert [(k, s) for k, s, _ in got] == [(r[0], r[1]) for r in recs]
    assert got[2][2] == {"node": "n2", "drained_at": 12.0, "fault_class": "xid79",
                         "versions_drain": {"nvidia_driver": "550"}, "lemon": "yes"}
    assert "lemon" not in got[0][2] and "keys" not in got[0][2] and "slow" not in got[0][2]
    assert got[0][2]["versions_drain"] is got[7][2]["versions_drain"], "equal values decoded once, shared"
    assert list(L.decode_pack_index(value, ("node",)))[3][2] == {"node": "n3"}
    with pytest.raises(L.PackFieldsMissing):
        L.decode_pack_index(value, ("node", "keys"))
    full = L.decode_pack_full(value)
    assert full == recs, "the records as stored, byte for byte"
    assert decode(full[4][3]) == (heads[4], {"raw": "line 4\nline 5"})
    bare = L.encode_pack([("inc.c.x.1", 1, {"node": "x"}, b'{"node":"x"}')], ("node",))  # a record without detail
    assert decode(L.decode_pack_full(bare)[0][3]) == ({"node": "x"}, {})
    assert L.pack_day({"closed_at": 86400.0 * 365}) == "19710101" and L.pack_day({}) == "19700101"


async def test_young_records_stay_individual_and_a_backlog_takes_several_runs(nc, unique, small_parts):
    """`min_age_s` leaves the records closed since then individual (each packed one is purged by its own key);
    `max_records` bounds a run: a backlog is packed over several, every incident counted once throughout."""
    cluster = f"u{unique}"
    js = nc.jetstream()
    store = LedgerStore(js)
    n = await _fill(store, js, cluster, days=3, per_day=4)
    now = time.time()
    before = _figures(await store.read_heads(cluster, fields=FIELDS), now)
    heads = await store.read_heads(cluster, fields=FIELDS)
    young = sum(1 for h in heads if h.get("outcome") and now - h["closed_at"] < 1.5 * DAY)
    assert 0 < young < n
    stats = await store.roll_up(cluster, min_age_s=1.5 * DAY)
    assert stats == {"records": n - young, "parts": stats["parts"], "purged": n - young, "left": young, "more": 0}
    assert len(await _keys(js, f"inc.{cluster}.")) == young
    assert _figures(await store.read_heads(cluster, fields=FIELDS), now) == before
    runs = []
    while not runs or runs[-1]["more"]:
        runs.append(await store.roll_up(cluster, max_records=3))
        assert _figures(await store.read_heads(cluster, fields=FIELDS), now) == before
        assert len(runs) < 10
    assert sum(r["records"] for r in runs) == young and all(r["records"] <= 3 for r in runs), runs
    assert await _keys(js, f"inc.{cluster}.") == []


def test_the_pack_codec_keeps_times_exact_and_their_holes():
    heads = [{"node": "a", "drained_at": 1764789123.1234567, "returned_at": None, "gpu_count": 8},
             {"node": "b", "drained_at": 0.1 + 0.2, "returned_at": 5.0, "gpu_count": 8},
             {"node": "c", "drained_at": 3.0, "returned_at": 1e-300, "gpu_count": 4}]
    recs = [(f"inc.c.{h['node']}.1", i, h, encode(h, {})) for i, h in enumerate(heads)]
    got = [h for _k, _s, h in L.decode_pack_index(L.encode_pack(recs, ("node", "drained_at", "returned_at",
                                                                       "gpu_count")))]
    assert got == [{k: v for k, v in h.items() if v is not None} for h in heads]
    assert all(type(h["gpu_count"]) is int for h in got), "ints stay ints"
