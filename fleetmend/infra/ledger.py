"""The incident ledger in JetStream KV (`subjects.LEDGER_KV_BUCKET`): written phase by phase by the router and the
activities, read by `fleetmend report` and the worker's elected replica. The record and its rules are
`fleetmend.ledger` (pure); this module is the I/O.

Every write is a compare-and-set of one key (`open.<cluster>.<node>` while the incident runs; `inc.…` once it
closed), so two writers never lose each other's fields, and every phase function is idempotent (a retried
activity finds its attempt recorded, or sets what is set already). A write never fails its caller: NATS away, a
full bucket or a bad record is logged (`ledger_write_failed`) and counted (`fleetmend_ledger_write_failures_total
{phase}`), and the drain, diagnostics or ticket goes on. A write is bounded by `WRITE_TIMEOUT_S`.

Stored value: `<head JSON>\\n<detail JSON>` (stdlib json, compact); the report decodes the head only.

Closed records are then rolled up (`LedgerStore.roll_up`, run by the worker's elected replica every
`ledger.pack_interval_s`): many per value under `pack.<cluster>.<close day>.<part>` (`fleetmend.ledger.encode_pack`),
so that a report over 100,000 records reads ~50 messages, not 100,000 (bench/ledger_report.py). The roll-up writes
a record's pack (compare-and-set) before it purges the record's own message, and purges only the message it
packed (its stream sequence): a crash between the two leaves both copies, never none, and the reader keeps the
newest copy of each record key (the highest stream sequence). Open records stay individual.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
from collections import defaultdict
from datetime import datetime
from typing import Any, Awaitable, Callable

import structlog
from nats.js.api import DeliverPolicy, KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from temporalio import activity

from fleetmend import ledger as L
from fleetmend import subjects
from fleetmend.config import LedgerSettings
from fleetmend.infra import metrics
from fleetmend.infra.jetstream import replicas
from fleetmend.infra.retry import LostRace, until_won
from fleetmend.policy import Topology

log = structlog.get_logger("fleetmend.infra.ledger")


def _dumps(obj: object) -> bytes:
    """Compact JSON bytes (the ledger's stored form)."""
    return json.dumps(obj, separators=(",", ":")).encode()


WRITE_TIMEOUT_S = 5.0
"""One phase write (reads and a compare-and-set) gives up after this long: the caller's drain goes on."""
CAS_ATTEMPTS = 8
ROLE_LEDGER_PACK = "ledger-pack"
"""The worker's elected replica that rolls the cluster's closed records up into packs
(`fleetmend.infra.fleetgauges.run_elected` role)."""
PURGES_AT_ONCE = 64
"""Purges of packed records' own messages in flight at once (a first roll-up of a large ledger)."""
PACK_SKIP_MARGIN_S = 2 * 86400.0
"""A report from `since` skips the packs of days that closed more than this before it: a record that closed
then was back in service before `since` (its return precedes its close), so it adds nothing to the window."""

Head = dict[str, Any]
Detail = dict[str, Any]
Change = Callable[[Head | None, Detail], tuple[Head, Detail] | None]


def clock() -> float:
    """The ledger's time of a phase. In an activity: the Temporal server's time when the attempt started (the
    drain, ticket or return it records happens at its start), so every worker host writes one clock, the one
    the incident's history and the Temporal UI show, and a time-skipping test server's skipped time is the
    ledger's too (tests/test_ledger_intervals.py). Elsewhere (the router, the CLI, an activity run without a
    server): this host's clock."""
    try:
        started = activity.info().started_time.timestamp()
    except RuntimeError:  # not in an activity
        return time.time()
    return started if started > 0 else time.time()  # ActivityEnvironment: no server, the epoch


def ts(t: datetime | float | None) -> float | None:
    """Unix seconds of a datetime (a naive one is UTC), a float as it is, None as None."""
    if t is None or isinstance(t, (int, float)):
        return t
    if t.tzinfo is None:
        from datetime import timezone

        t = t.replace(tzinfo=timezone.utc)
    return t.timestamp()


def encode(head: Head, detail: Detail) -> bytes:
    return _dumps(head) + b"\n" + _dumps(detail)


def decode(data: bytes) -> tuple[Head, Detail]:
    head, _, detail = data.partition(b"\n")
    return json.loads(head), (json.loads(detail) if detail else {})


class LedgerStore:
    """Args:
        js: a JetStream context.
        settings: `LedgerSettings` (bucket limits at creation, GPUs of an unknown node).
        topology: node → rack (`policy.topology_file`).
        repeat_part_window_s: `policy.repeat_part_window_days` in seconds.
    """

    def __init__(self, js: Any, settings: LedgerSettings | None = None, *, topology: Topology | None = None,
                 repeat_part_window_s: float = 30 * 86400.0) -> None:
        self.js = js
        self.settings = settings or LedgerSettings()
        self.topology = topology or Topology()
        self.repeat_part_window_s = repeat_part_window_s
        self._kv: Any = None
        self._fp: Any = None

    # ------------------------------------------------------------------ buckets
    async def kv(self) -> Any:
        """The ledger bucket, created on first use (history 1, file storage, `max_age_days`, `max_bytes`)."""
        if self._kv is None:
            try:
                self._kv = await self.js.key_value(subjects.LEDGER_KV_BUCKET)
            except BucketNotFoundError:
                try:
                    self._kv = await self.js.create_key_value(KeyValueConfig(
                        bucket=subjects.LEDGER_KV_BUCKET, history=1, storage=StorageType.FILE,
                        ttl=self.settings.max_age_days * 86400.0, max_bytes=self.settings.max_bytes,
                        description="fleetmend incident ledger (fleetmend report)", replicas=replicas()))
                except Exception:  # noqa: BLE001 - another process created it first; if not, this raises
                    self._kv = await self.js.key_value(subjects.LEDGER_KV_BUCKET)
        return self._kv

    async def fingerprint(self, cluster: str, node: str) -> dict[str, Any] | None:
        """The node's latest fingerprint as stored (JSON dict), or None (no agent inventory, or no bucket)."""
        try:
            if self._fp is None:
                self._fp = await self.js.key_value(subjects.FINGERPRINT_KV_BUCKET)
            entry = await self._fp.get(subjects.fingerprint_kv_key(cluster, node))
            return json.loads(entry.value) if entry.value else None
        except (KeyNotFoundError, BucketNotFoundError):
            return None

    # ------------------------------------------------------------------ the one write
    async def _update(self, key: str, change: Change) -> tuple[Head, Detail] | None:
        kv = await self.kv()

        async def one_round() -> tuple[Head, Detail] | None:
            try:
                entry = await kv.get(key)
                rev: int | None = entry.revision
                head, detail = decode(entry.value) if entry.value else (None, {})
            except KeyNotFoundError:
                rev, head, detail = None, None, {}
            out = change(head, detail)
            if out is None:
                return None
            try:
                if rev is None:
                    await kv.create(key, encode(*out))
                else:
                    await kv.update(key, encode(*out), last=rev)
            except KeyWrongLastSequenceError:
                raise LostRace(key) from None  # another writer won: read again
            return out

        try:
            return await until_won(one_round, attempts=CAS_ATTEMPTS)  # tenacity: fleetmend.infra.retry
        except LostRace:
            raise RuntimeError(f"ledger key {key} kept changing ({CAS_ATTEMPTS} rounds)") from None

    async def _safely(self, phase: str, work: Callable[[], Awaitable[Any]], **where: Any) -> Any:
        try:
            async with asyncio.timeout(WRITE_TIMEOUT_S):
                return await work()
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - the ledger never fails the drain: logged and counted
            metrics.LEDGER_WRITE_FAILURES.labels(phase=phase).inc()
            log.warning("ledger_write_failed", phase=phase, error=repr(err)[:300], **where)
            return None

    # ------------------------------------------------------------------ router
    async def note_routed(self, cluster: str, node: str, notes: list[dict[str, Any]]) -> None:
        """The router: these drain-worthy faults reached the node's incident now (`observed_at`, `routed_at`,
        `fault_class`, `kind`, `code`, `device`, `serial`, `severity`, `raw`, `slow`). Never raises."""
        now = time.time()

        def change(head: Head | None, detail: Detail) -> tuple[Head, Detail] | None:
            routings = list((head or {}).get("routings") or [])
            if not any([L.note_routing(routings, n, now) for n in notes]):
                return None
            return {"routings": routings}, {}

        await self._safely("routed", lambda: self._update(subjects.ledger_route_key(cluster, node), change),
                           cluster=cluster, node=node)

    # ------------------------------------------------------------------ drain
    async def drained(self, *, cluster: str, node: str, incident_id: str, workflow_id: str,
                      observed_at: datetime | None, reason: str, drained: bool, state: str,
                      router_claim_at: float | None = None) -> str | None:
        """The incident's drain took effect (`drain_node`): open (or find) the node's record, with the router's
        note of the fault, the fingerprint (hardware class, GPUs, versions, serials) and the rack; the faulty
        part's failure is added to its history. Returns the repeat-part reason when the same part failed with the
        same fault class within `repeat_part_window_s` (the incident goes to RMA like a lemon), else None.
        Never raises."""
        if not drained:
            return None
        return await self._safely("drained", lambda: self._drained(
            cluster, node, incident_id, workflow_id, ts(observed_at), reason, state, router_claim_at),
            cluster=cluster, node=node)

    async def _drained(self, cluster: str, node: str, incident_id: str, workflow_id: str, observed_at: float | None,
                       reason: str, state: str, router_claim_at: float | None) -> str | None:
        kv = await self.kv()
        now = clock()
        fault_class = reason.split(" ", 1)[0] if reason else None
        try:
            route_head, _ = decode((await kv.get(subjects.ledger_route_key(cluster, node))).value)
        except KeyNotFoundError:
            route_head = {}
        note = L.pick_routing(list(route_head.get("routings") or []), observed_at, fault_class) or {}
        fp = await self.fingerprint(cluster, node) or {}
        serials: dict[str, str] = dict(fp.get("serials") or {})
        device = note.get("device")
        part, serial = L.part_of(device, serials, note.get("serial"))
        superseded: list[tuple[Head, Detail]] = []
        retried: list[Head] = []
        # the note of another occurrence (the router notes a condition once a minute) dates this fault's routing
        # only when it was routed after this fault line: else the time to detect is unknown, never made up
        routed_at = note.get("routed_at")
        if routed_at is not None and observed_at is not None and routed_at < observed_at:
            routed_at = None

        def change(head: Head | None, detail: Detail) -> tuple[Head, Detail] | None:
            superseded.clear()
            if head is not None and L.same_incident(head, incident_id, observed_at):
                retried.append(head)
                return None  # a retried drain: recorded already
            if head is not None:
                old = dict(head, outcome=L.Outcome.SUPERSEDED.value, closed_at=now)
                superseded.append((old, detail))
            rec = L.new_record(cluster, node, incident_id, workflow_id, observed_at)
            hw = fp.get("hardware") or {}
            by_router = router_claim_at is not None
            rec.update({
                "rack": self.topology.domain(node).rack, "hw_class": _hw_key(hw) if hw else None,
                "gpu_count": int(hw.get("gpu_count") or 0) or None, "fault_class": note.get("fault_class") or fault_class,
                "kind": note.get("kind"), "code": note.get("code"), "device": device, "severity": note.get("severity"),
                "routed_at": routed_at, "drained_at": router_claim_at if by_router else now,
                "drained_by": "router" if by_router else "incident", "drain_state": state,
                "versions_drain": fp.get("versions") or {}, "part": part, "part_serial_drain": serial,
            })
            if note.get("slow"):
                rec["slow"] = note["slow"]
            return rec, {"raw": (note.get("raw") or "")[:L.MAX_RAW_CHARS], "serials_drain": serials}

        out = await self._update(subjects.ledger_open_key(cluster, node), change)
        for old in superseded:
            await self._archive(*old)
        if retried:
            return retried[-1].get("repeat_part")  # a retried drain answers what the first attempt found
        if out is None or not serial:
            return None
        rec = out[0]
        failures: list[dict[str, Any]] = []

        def add(head: Head | None, detail: Detail) -> tuple[Head, Detail] | None:
            got = list((head or {}).get("failures") or [])
            failures[:] = got
            if any(f.get("incident_id") == incident_id and f.get("at") == rec["drained_at"] for f in got):
                return None
            got.append({"fault_class": rec.get("fault_class"), "at": rec["drained_at"], "cluster": cluster,
                        "node": node, "incident_id": incident_id})
            return {"serial": serial, "failures": got[-L.MAX_PART_FAILURES:]}, {}

        await self._update(subjects.ledger_part_key(serial), add)
        why = L.repeat_part(failures, rec.get("fault_class") or "", rec["drained_at"] + 1e-6, self.repeat_part_window_s,
                            incident_id)
        if why:
            await self._on_open(cluster, node, incident_id, lambda h, d: h.update(repeat_part=why, rma=True) or True)
        return why

    async def _archive(self, head: Head, detail: Detail) -> None:
        """Write a closed record under its own key (`inc.…`, idempotent) and drop the node's open key."""
        kv = await self.kv()
        key = subjects.ledger_closed_key(head["cluster"], head["node"], int((head.get("drained_at") or 0) * 1000))
        try:
            await kv.create(key, encode(head, detail))
        except KeyWrongLastSequenceError:
            await kv.put(key, encode(head, detail))  # a retried close: the same record, or a later field

    async def _on_open(self, cluster: str, node: str, incident_id: str | None,
                       apply: Callable[[Head, Detail], bool], workflow_id: str | None = None) -> tuple[Head, Detail] | None:
        """Apply `apply(head, detail)` (True: changed) to the node's open record of this incident."""
        def change(head: Head | None, detail: Detail) -> tuple[Head, Detail] | None:
            if head is None or head.get("outcome") is not None:
                return None
            if incident_id is not None and head.get("incident_id") != incident_id:
                return None
            if workflow_id is not None and head.get("workflow_id") != workflow_id:
                return None
            return (head, detail) if apply(head, detail) else None

        return await self._update(subjects.ledger_open_key(cluster, node), change)

    # ------------------------------------------------------------------ diagnostics, recovery
    async def diagnosed(self, *, cluster: str, node: str, incident_id: str | None, attempt: str, result: str,
                        checks: list[dict[str, Any]]) -> None:
        """A diagnostics report (`run_diagnostics`): the first after the drain is the incident's verdict on the
        drain (its failed checks; none = a false drain if the node comes back without a ticket). Never raises."""
        def apply(head: Head, detail: Detail) -> bool:
            if L.seen(head, attempt):
                return False
            now = clock()
            head["diags"] = int(head.get("diags") or 0) + 1
            if head.get("diag_first_at") is None:
                head.update(diag_first_at=now, diag_first_result=result,
                            diag_failed=[c["name"] for c in checks if c.get("result") == "fail"])
            kept = [c for c in checks if c.get("result") in ("fail", "unknown")]
            diags = list(detail.get("diagnostics") or [])
            diags.append({"at": now, "result": result, "checks": kept[:20]})
            detail["diagnostics"] = diags[-L.MAX_DIAG_KEPT:]
            return True

        await self._safely("diagnosed", lambda: self._on_open(cluster, node, incident_id, apply),
                           cluster=cluster, node=node)

    async def recovered(self, *, cluster: str, node: str, incident_id: str | None, attempt: str, op: str,
                        result: str) -> None:
        """A GPU reset or reboot was asked (`reset_gpu`, `reboot_node`) with `result`. Never raises."""
        def apply(head: Head, detail: Detail) -> bool:
            if L.seen(head, attempt):
                return False
            head["recovery"] = [*(head.get("recovery") or []), f"{op}:{result}"][-8:]
            return True

        await self._safely("recovered", lambda: self._on_open(cluster, node, incident_id, apply),
                           cluster=cluster, node=node)

    # ------------------------------------------------------------------ tickets
    async def ticket_filed(self, *, cluster: str, node: str, incident_id: str, ticket: str, title: str,
                           fault_class: str, evidence: dict[str, Any]) -> None:
        """The repair ticket was filed (`file_ticket`): its id and time, RMA or not, the lemon reason, and the raw
        fault lines and diagnostics of its evidence (for a vendor). Never raises."""
        def apply(head: Head, detail: Detail) -> bool:
            if head.get("ticket") == ticket:
                return False
            head.update(ticket=ticket, ticket_filed_at=head.get("ticket_filed_at") or clock(),
                        rma=bool(head.get("rma")) or "] RMA " in title, ticket_status="filed")
            L.first(head, "fault_class", fault_class or None)
            if evidence.get("lemon"):
                head["lemon"] = str(evidence["lemon"])[:300]
            raw = str(evidence.get("raw") or "")
            if raw and len(raw) > len(detail.get("raw") or ""):
                detail["raw"] = raw[:L.MAX_RAW_CHARS]
            return True

        await self._safely("ticket_filed", lambda: self._on_open(cluster, node, incident_id, apply),
                           cluster=cluster, node=node)

    async def ticket_updated(self, *, incident_id: str, ticket: str, status: str) -> str | None:
        """A ticket status change (`update_ticket`). On `resolved` (the repair verified, the node back): the
        faulty part's serial at the return is read from the node's fingerprint and compared with the one at the
        drain. Returns "part not replaced: …" for the ticket's comment when they are equal, else None. Never
        raises."""
        cluster, node = _owner(incident_id)
        if cluster is None or node is None:
            return None

        async def work() -> str | None:
            fp = await self.fingerprint(cluster, node) if status == "resolved" else None
            said: list[str] = []

            def apply(head: Head, detail: Detail) -> bool:
                if head.get("ticket") != ticket:
                    return False
                head["ticket_status"] = status
                if status in ("resolved", "aborted"):
                    L.first(head, "ticket_closed_at", clock())
                if fp is not None:
                    serials = dict(fp.get("serials") or {})
                    detail["serials_return"] = serials
                    L.first(head, "versions_return", fp.get("versions") or None)
                    if head.get("part"):
                        head["part_serial_return"] = serials.get(head["part"]) or head.get("part_serial_return")
                    head["part_not_replaced"] = L.part_not_replaced(head)
                    if head["part_not_replaced"]:
                        said.append(f"part not replaced: {head['part']} has serial {head['part_serial_drain']}, the "
                                    f"one it had when the node was drained for {head.get('fault_class')}; the same "
                                    f"part failing again within the repeat-part window goes to RMA")
                return True

            await self._on_open(cluster, node, incident_id, apply)
            return said[0] if said else None

        return await self._safely("ticket_updated", work, incident_id=incident_id)

    # ------------------------------------------------------------------ return and close
    async def returned(self, *, cluster: str, node: str, incident_id: str, resumed: bool) -> None:
        """The node was returned to service (`undrain_node`, resumed): the time, and the versions and serials
        at the return. Never raises."""
        if not resumed:
            return

        async def work() -> None:
            fp = await self.fingerprint(cluster, node) or {}
            serials = dict(fp.get("serials") or {})

            def apply(head: Head, detail: Detail) -> bool:
                if head.get("returned_at") is not None:
                    return False
                head["returned_at"] = clock()
                if fp:
                    head["versions_return"] = fp.get("versions") or {}
                    detail["serials_return"] = serials
                    if head.get("part"):
                        head["part_serial_return"] = serials.get(head["part"])
                return True

            await self._on_open(cluster, node, incident_id, apply)

        await self._safely("returned", work, cluster=cluster, node=node)

    async def closed(self, *, cluster: str, node: str, workflow_id: str, outcome: str) -> None:
        """The incident closed (`release_drain_permit`, with the workflow's `Outcome`): the record gets its
        outcome and close time and moves to `inc.<cluster>.<node>.<drained ms>`. Never raises."""
        async def work() -> None:
            done: list[tuple[Head, Detail]] = []

            def apply(head: Head, detail: Detail) -> bool:
                head.update(closed_at=clock(), outcome=L.close_outcome(head, outcome))
                if head.get("part_not_replaced") is None:
                    head["part_not_replaced"] = L.part_not_replaced(head)
                done.append((head, detail))
                return True

            await self._on_open(cluster, node, None, apply, workflow_id=workflow_id)
            for head, detail in done:
                await self._archive(head, detail)
                kv = await self.kv()
                await kv.delete(subjects.ledger_open_key(cluster, node))

        await self._safely("closed", work, cluster=cluster, node=node)

    # ------------------------------------------------------------------ reading
    async def read_heads(self, cluster: str | None = None, *, with_detail: bool = False,
                         fields: tuple[str, ...] | None = None, since: float | None = None) -> list[Head]:
        """Every record's head (closed and open) of `cluster` (None: all): the packs, the closed records not
        rolled up yet and the open ones, read from the bucket's stream by `scan`. A record found twice (packed,
        and its own message not purged yet, or a newer copy written since) counts once: its newest copy (the
        highest stream sequence). With `with_detail`, each head carries its detail under `_detail` and its key
        under `_key`. With `fields` (e.g. `fleetmend.report.FIELDS`), a head keeps only those keys (the packs'
        index holds them: the rest of a pack is not decoded), and equal `versions_drain` maps are one object.
        With `since`, the packs of days that closed before `since` − `PACK_SKIP_MARGIN_S` are not decoded (their
        records lie wholly before the window)."""
        best: dict[str, tuple[int, Head]] = {}  # record key → (stream sequence of the copy, head)
        opened: list[Head] = []
        shared: dict[tuple[tuple[str, str], ...], dict[str, str]] = {}
        skip_before = L.pack_day({"closed_at": since - PACK_SKIP_MARGIN_S}) if since is not None else None

        def keep(h: Head) -> Head:
            if fields is not None:
                h = {k: h[k] for k in fields if h.get(k) is not None}
            v = h.get("versions_drain")
            if v:
                h["versions_drain"] = shared.setdefault(tuple(sorted(v.items())), v)
            return h

        def add(key: str, seq: int, head: Head, detail: Detail | None) -> None:
            prev = best.get(key)
            if prev is not None and prev[0] >= seq:
                return
            if with_detail:
                head["_detail"] = detail or {}
                head["_key"] = key
            best[key] = (seq, head)

        def take_pack(key: str, data: bytes, _seq: int) -> None:
            if skip_before is not None and key.split(".")[2] < skip_before:
                return
            if not with_detail:
                try:
                    rows = L.decode_pack_index(data, fields)  # projected, equal values shared already
                except L.PackFieldsMissing:
                    pass  # a pack written before a field was added to the report: its full records
                else:
                    get = best.get
                    for k, sq, h in rows:  # `add` inlined: 100,000 calls
                        prev = get(k)
                        if prev is None or prev[0] < sq:
                            best[k] = (sq, h)
                    return
            for k, sq, h, raw in L.decode_pack_full(data):
                add(k, sq, keep(h), json.loads(raw.partition(b"\n")[2]) if with_detail else None)

        def take_closed(key: str, data: bytes, seq: int) -> None:
            head, _, detail = data.partition(b"\n")
            add(key, seq, keep(json.loads(head)), json.loads(detail) if with_detail and detail else None)

        def take_open(key: str, data: bytes, _seq: int) -> None:
            head, _, detail = data.partition(b"\n")
            h = keep(json.loads(head))
            if with_detail:
                h["_detail"] = json.loads(detail) if detail else {}
                h["_key"] = key
            opened.append(h)

        await self.kv()
        closed_prefix, open_prefix = subjects.ledger_cluster_prefixes(cluster)
        gc_was = gc.isenabled()
        gc.disable()  # 100,000 new dicts would run the cycle collector over all of them again and again
        try:
            for prefix, take in ((subjects.ledger_pack_prefix(cluster), take_pack), (closed_prefix, take_closed),
                                 (open_prefix, take_open)):
                await scan(self.js, subjects.LEDGER_KV_BUCKET, prefix, take, with_seq=True)
        finally:
            if gc_was:
                gc.enable()
        return [h for _, h in best.values()] + opened

    # ------------------------------------------------------------------ roll-up
    async def roll_up(self, cluster: str | None = None, *, min_age_s: float = 0.0, max_records: int | None = 5000,
                      fields: tuple[str, ...] | None = None) -> dict[str, int]:
        """Pack the closed records of `cluster` (None: every cluster) that closed at least `min_age_s` ago into
        `pack.<cluster>.<close day>.<part>` values, then purge each packed record's own message. At most
        `max_records` a run (None: all; the worker's replica runs every `ledger.pack_interval_s`, so a large
        backlog takes a few runs and no run holds more than that many records in memory).

        Idempotent and safe to crash or to run twice at once: a pack is written by compare-and-set before
        anything is purged; a purge removes only messages that were packed (by stream sequence: a newer copy
        written meanwhile stays, for the next roll-up); a record already in a pack is replaced there by a newer
        copy, never added twice; records never move between parts. A day whose pack write loses a race is left
        as it is for the next run.

        Returns: `records` (packed this run, including ones found packed already), `parts` (values written),
        `purged` (messages purged), `left` (closed records left individual: too young, a lost race, or too
        large for a value), `more` (1: `max_records` were read, there may be more for the next run).
        """
        from fleetmend.report import FIELDS  # the index holds what the report reads

        fields = tuple(fields or FIELDS)
        await self.kv()
        closed_prefix = subjects.ledger_cluster_prefixes(cluster)[0]
        raws: list[tuple[str, int, bytes]] = []
        # in stream order: the records read are every closed record's message up to the last one read
        await scan(self.js, subjects.LEDGER_KV_BUCKET, closed_prefix, lambda k, d, q: raws.append((k, q, d)),
                   with_seq=True, limit=max_records, in_order=True)
        cut = max_records is not None and len(raws) >= max_records
        upto = max((q for _k, q, _d in raws), default=0)
        found = await asyncio.to_thread(_with_heads, raws)
        raws.clear()
        stats = {"records": 0, "parts": 0, "purged": 0, "left": 0, "more": int(cut)}
        now = time.time()
        groups: dict[tuple[str, str], list[L.Packed]] = defaultdict(list)
        for rec in found:
            head = rec[2]
            if head.get("outcome") is None or now - float(head.get("closed_at") or 0) < min_age_s:
                stats["left"] += 1
                continue
            groups[(rec[0].split(".")[1], L.pack_day(head))].append(rec)
        packed: list[L.Packed] = []
        for (c, day), recs in sorted(groups.items()):
            try:
                done, parts = await self._pack_day(c, day, recs, fields)
            except KeyWrongLastSequenceError:
                log.info("ledger_pack_race", cluster=c, day=day, note="another roll-up wrote first; next run")
                stats["left"] += len(recs)
                continue
            stats["parts"] += parts
            stats["left"] += len(recs) - len(done)
            packed += done
        stats["records"] = len(packed)
        # every record read is packed: one purge of the closed keys up to the last one read covers them (the scan
        # read in stream order, so nothing up to it went unread); else each packed record by its own key
        whole = (closed_prefix, upto) if packed and not stats["left"] else None
        stats["purged"] = await self._purge(packed, whole)
        if stats["records"] or stats["left"]:
            log.info("ledger_rolled_up", cluster=cluster, **stats)
        return stats

    async def _pack_day(self, cluster: str, day: str, recs: list[L.Packed],
                        fields: tuple[str, ...]) -> tuple[list[L.Packed], int]:
        """Merge `recs` into the day's parts and write the parts that changed. Returns (the records now in a
        pack with this copy or a newer one, parts written). Raises KeyWrongLastSequenceError on a lost race."""
        kv = await self.kv()
        stored: dict[int, tuple[int, bytes]] = {}  # part → (revision, value)

        def take(key: str, data: bytes, seq: int) -> None:
            stored[int(key.rsplit(".", 1)[1])] = (seq, data)

        await scan(self.js, subjects.LEDGER_KV_BUCKET, f"{subjects.ledger_pack_prefix(cluster)}{day}.", take,
                   with_seq=True)
        parts: dict[int, list[L.Packed]] = {}
        for n, (_rev, value) in sorted(stored.items()):
            parts[n] = await asyncio.to_thread(L.decode_pack_full, value)
        where = {r[0]: (n, i) for n, rs in parts.items() for i, r in enumerate(rs)}
        changed: set[int] = set()
        packed: list[L.Packed] = []
        fresh: dict[str, L.Packed] = {}
        for rec in sorted(recs, key=lambda r: (r[0], r[1])):
            at = where.get(rec[0])
            if at is None:
                fresh[rec[0]] = rec  # the same key twice: the later (newer) copy
                continue
            n, i = at
            if parts[n][i][1] < rec[1]:
                parts[n][i] = rec
                changed.add(n)
            packed.append(rec)
        newcomers = list(fresh.values())
        values: dict[int, bytes] = {}
        hard = int(getattr(getattr(self.js, "_nc", None), "max_payload", 0) or 1024 * 1024) - 4096
        last = max(parts) if parts else -1
        n = last if last >= 0 and len(parts[last]) < L.PACK_RECORDS else last + 1
        while newcomers:
            base = parts.get(n, [])
            take_n = min(len(newcomers), L.PACK_RECORDS - len(base))
            while True:
                value = await asyncio.to_thread(L.encode_pack, base + newcomers[:take_n], fields)
                if len(value) <= L.PACK_SOFT_BYTES or take_n == 0 or (take_n == 1 and not base):
                    break
                take_n //= 2
            if take_n == 0:  # this part is full by size: the next one
                n += 1
                continue
            if len(value) > hard:  # one record larger than a message: it stays individual
                log.warning("ledger_record_too_large_to_pack", key=newcomers[0][0], bytes=len(value))
                newcomers = newcomers[1:]
                continue
            parts[n] = base + newcomers[:take_n]
            packed += newcomers[:take_n]
            newcomers = newcomers[take_n:]
            values[n] = value
            changed.discard(n)
            n += 1
        for m in changed:
            values[m] = await asyncio.to_thread(L.encode_pack, parts[m], fields)
        for m, value in sorted(values.items()):
            key = subjects.ledger_pack_key(cluster, day, m)
            if m in stored:
                await kv.update(key, value, last=stored[m][0])
            else:
                await kv.create(key, value)
        return packed, len(values)

    async def _purge(self, packed: list[L.Packed], whole: tuple[str, int] | None = None) -> int:
        """Purge each packed record's own message: the one packed (its sequence) and any older, never a newer.
        With `whole` (prefix, sequence): every message under the prefix up to that sequence in one call (the
        caller packed all of them), and the rest by their own keys. Returns the records purged."""
        stream, pre = f"KV_{subjects.LEDGER_KV_BUCKET}", f"$KV.{subjects.LEDGER_KV_BUCKET}."
        gate = asyncio.Semaphore(PURGES_AT_ONCE)
        purged = 0
        if whole is not None:
            prefix, upto = whole
            await self.js.purge_stream(stream, subject=f"{pre}{prefix}>", seq=upto + 1)
            purged = sum(1 for r in packed if r[1] <= upto)
            packed = [r for r in packed if r[1] > upto]

        async def one(key: str, seq: int) -> bool:
            async with gate:
                try:
                    return bool(await self.js.purge_stream(stream, subject=pre + key, seq=seq + 1))
                except Exception as err:  # noqa: BLE001 - packed already: the next roll-up purges it
                    log.warning("ledger_purge_failed", key=key, error=repr(err)[:200])
                    return False

        done = await asyncio.gather(*(one(k, s) for k, s, _h, _d in packed))
        return purged + sum(done)

    async def read_record(self, key: str) -> tuple[Head, Detail] | None:
        try:
            entry = await (await self.kv()).get(key)
        except KeyNotFoundError:
            return None
        return decode(entry.value) if entry.value else None

    async def fleet(self, cluster: str | None) -> list[dict[str, Any]]:
        """`{cluster, node, versions, gpu_count}` of every node's latest fingerprint (of `cluster`; None: all)."""
        out: list[dict[str, Any]] = []

        def take(_key: str, data: bytes) -> None:
            try:
                fp = json.loads(data)
            except json.JSONDecodeError:
                return  # not a fingerprint: the drift judge dead-letters it
            if not isinstance(fp, dict) or not fp.get("node"):
                return
            out.append({"cluster": fp.get("cluster"), "node": fp.get("node"), "versions": fp.get("versions") or {},
                        "gpu_count": (fp.get("hardware") or {}).get("gpu_count")})

        try:
            await scan(self.js, subjects.FINGERPRINT_KV_BUCKET, f"{cluster}." if cluster else "", take)
        except NotFoundError:
            return []  # no inventory anywhere: no fleet to compare with
        except Exception as err:  # noqa: BLE001 - no fleet to compare with: the report goes on without findings
            log.warning("ledger_fleet_unread", error=repr(err)[:300], note="version findings need the fingerprints")
            return []
        return out


async def scan(js: Any, bucket: str, prefix: str, take: Callable[..., None], timeout_s: float = 300.0, *,
               with_seq: bool = False, limit: int | None = None, in_order: bool = False) -> int:
    """Call `take(key, value)` (with `with_seq`: `take(key, value, stream sequence)`) for every live key of KV
    `bucket` under `prefix` (deleted keys skipped; with `limit`, for the first `limit` only), reading the bucket's
    stream once with an ordered push consumer (last value per key): ~5× the pace of `fetch` or `next_msg` on the
    same box (bench/ledger_report.py). With `in_order`, every message under the prefix in stream order instead
    (for a bucket of history 1 the same set): what was read is then exactly every message up to the last one
    read. Returns the messages read.

    Raises:
        nats.js.errors.NotFoundError: no such bucket. TimeoutError: the stream did not deliver within `timeout_s`.
    """
    stream, pre = f"KV_{bucket}", f"$KV.{bucket}."
    info = await js.stream_info(stream)
    if not info.state.messages:
        return 0
    done = asyncio.Event()
    seen, taken = [0], [0]
    failed: list[BaseException] = []

    async def on_msg(m: Any) -> None:
        if done.is_set():
            return  # past the limit (or failed): the rest is not read
        seen[0] += 1
        meta = m.metadata
        try:
            if m.data and not (m.headers and m.headers.get("KV-Operation") in ("DEL", "PURGE")):
                taken[0] += 1
                if with_seq:
                    take(m.subject[len(pre):], m.data, meta.sequence.stream)
                else:
                    take(m.subject[len(pre):], m.data)
        except Exception as err:  # noqa: BLE001 - raised to scan's caller, not lost in the client's callback
            failed.append(err)
            done.set()
        if meta.num_pending == 0 or (limit is not None and taken[0] >= limit):  # the last, or enough
            done.set()

    sub = await js.subscribe(f"{pre}{prefix}>", stream=stream, ordered_consumer=True,
                             deliver_policy=DeliverPolicy.ALL if in_order else DeliverPolicy.LAST_PER_SUBJECT,
                             cb=on_msg, pending_msgs_limit=-1,
                             pending_bytes_limit=-1)
    try:
        info = await sub.consumer_info()
        if info.num_pending == 0 and not info.delivered.consumer_seq:
            done.set()  # nothing under this prefix
        async with asyncio.timeout(timeout_s):
            await done.wait()
    finally:
        await sub.unsubscribe()
    if failed:
        raise failed[0]
    return seen[0]


def _with_heads(raws: list[tuple[str, int, bytes]]) -> list[L.Packed]:
    """(key, seq, decoded head, the record as stored) of each (key, seq, record as stored)."""
    return [(k, q, json.loads(d.partition(b"\n")[0]), d) for k, q, d in raws]


def _hw_key(hw: dict[str, Any]) -> str:
    """`fleetmend.fingerprint.HardwareClass.key` of a stored fingerprint's `hardware` (without parsing it)."""
    parts = [f"{hw.get('gpu_model') or 'no-gpu'} x{hw.get('gpu_count') or 0}", hw.get("board") or "unknown-board",
             f"{hw.get('cpu_model') or 'unknown-cpu'} x{hw.get('cpu_sockets') or 0}",
             ",".join(hw.get("hca_models") or []) or "no-hca"]
    return " | ".join(parts)


def _owner(incident_id: str) -> tuple[str | None, str | None]:
    """(cluster, node) of an incident id `remediate/<cluster>/<node>/<run id>`."""
    try:
        return subjects.parse_workflow_id(incident_id.rsplit("/", 1)[0])
    except ValueError:
        return None, None


__all__ = ["ROLE_LEDGER_PACK", "LedgerStore", "clock", "decode", "encode", "scan", "ts"]
