"""The incident ledger's record and the pure rules that change it, phase by phase (no I/O).

One record per incident that drained a node, written by the places that already run at each phase (the router
when a drain-worthy fault reaches an incident, then the activities: drain, diagnostics, recovery, ticket,
undrain, permit release), never by a workflow: the ledger adds no Temporal round trip. The record lives in the
JetStream KV bucket `subjects.LEDGER_KV_BUCKET` (`fleetmend.infra.ledger`), kept `ledger.max_age_days`, far
beyond Temporal's retention; `fleetmend report` (`fleetmend.report`) reads it.

A record is a flat JSON object (the *head*, what the report reads) and a *detail* object (what a vendor asks
for: raw fault lines, every device serial, the diagnostics' checks), stored as `head\\n detail`. Times are Unix
seconds (floats). Head keys:

| key | what |
|---|---|
| `cluster`, `node`, `incident_id`, `workflow_id` | whose (`incident_id`: workflow id / first run id) |
| `rack`, `hw_class`, `gpu_count` | the topology's rack; the fingerprint's hardware class key and GPU count |
| `fault_class`, `kind`, `code`, `device`, `severity` | the fault that drained the node (the incident's) |
| `observed_at` | the fault line (the event's `observed_at`) |
| `routed_at` | the fault reached its incident (the router's signal-with-start) |
| `drained_at`, `drained_by` | the node was cordoned (`router`: the router's must-drain-now cordon; `incident`) |
| `diag_first_at`, `diag_first_result`, `diag_failed`, `diags` | the first diagnostics after the drain; count |
| `recovery` | `op:result` of each GPU reset / reboot asked |
| `ticket`, `ticket_filed_at`, `ticket_closed_at`, `ticket_status`, `rma` | the repair ticket |
| `lemon`, `repeat_part` | why the node went to RMA (FleetGuard's lemon rule; the same part failing again) |
| `returned_at`, `closed_at`, `outcome` | back in service; the incident closed; `Outcome` below (None: still out) |
| `versions_drain`, `versions_return` | the fingerprint's versions (driver, VBIOS, HCA firmware, kernel, BIOS, …) |
| `part`, `part_serial_drain`, `part_serial_return`, `part_not_replaced` | the faulty device and its serial |
| `slow` | `fail_slow` only: `ratio`, `slow_s` (slow before detection), `metric`, `job`, `job_gpus` |
| `keys` | activity attempts already applied (`run/activity id`), so a retried activity changes nothing |
"""

from __future__ import annotations

import base64
import json
import struct
import sys
import zlib
from array import array
from enum import StrEnum
from typing import Any, Iterable, Iterator

LEDGER_SCHEMA_VERSION = 1
MAX_KEYS_KEPT = 64
"""Activity ids remembered per record (idempotency of retried diagnostics and recovery activities)."""
MAX_RAW_CHARS = 4000
"""Raw fault text kept in a record's detail (the incident's own budget; the full text is in the fault stream)."""
MAX_DIAG_KEPT = 8
"""Diagnostics reports kept in a record's detail (failed and unknown checks only)."""
MAX_ROUTINGS_KEPT = 16
"""Router notes kept per node (`route.<cluster>.<node>`): the recent drain-worthy faults and when each was routed."""
MAX_PART_FAILURES = 32
"""Failures kept per part (`part.<serial hash>`)."""
ROUTE_THROTTLE_S = 60.0
"""The router notes a node's condition at most once per this long (a storm of repeats writes once a minute)."""

FINDING_KEYS = ("nvidia_driver", "vbios", "hca_fw", "kernel", "bios")
"""Fingerprint version keys a version finding is sought on."""


class Outcome(StrEnum):
    """How a drained incident ended, as the report counts it. Stable strings, never reused."""

    RECOVERED = "returned_after_recovery"
    """Back in service after a GPU reset or reboot held; no ticket."""
    REPAIRED = "returned_after_repair"
    """Back in service after a ticket's repair."""
    RMA = "returned_after_rma"
    """Back in service after an RMA ticket (lemon, repeat part, or the catalog's RMA)."""
    NO_FAULT_FOUND = "no_fault_found"
    """Back in service without a ticket, and the first diagnostics after the drain failed no check: the false
    drains (the share of them is the false-drain rate)."""
    ABORTED = "aborted"
    OPERATOR_OWNED = "operator_owned"
    """An operator had drained the node first; fleetmend recorded and left it."""
    SUPERSEDED = "superseded"
    """The record was still open when the node's next incident drained it (its incident was terminated or
    reset): counted out of service until then."""
    OTHER = "closed_other"


def new_record(cluster: str, node: str, incident_id: str, workflow_id: str, observed_at: float | None) -> dict[str, Any]:
    """A record for a drain that opens the incident's entry."""
    return {"v": LEDGER_SCHEMA_VERSION, "cluster": cluster, "node": node, "incident_id": incident_id,
            "workflow_id": workflow_id, "observed_at": observed_at, "keys": []}


def same_incident(rec: dict[str, Any], incident_id: str, observed_at: float | None) -> bool:
    """Whether `rec` is the incident that drains now: the same incident id and the same first drain-worthy
    fault (a node's next incident continues the same workflow chain and keeps its incident id)."""
    if rec.get("incident_id") != incident_id or rec.get("outcome") is not None:
        return False
    a, b = rec.get("observed_at"), observed_at
    return a is None or b is None or abs(a - b) < 1e-3


def seen(rec: dict[str, Any], key: str) -> bool:
    """True when the activity attempt `key` was applied already; else remembers it (bounded) and returns False."""
    keys: list[str] = rec.setdefault("keys", [])
    if key in keys:
        return True
    keys.append(key)
    del keys[:-MAX_KEYS_KEPT]
    return False


def first(rec: dict[str, Any], key: str, value: Any) -> None:
    """Set `key` only when it is unset (the first occurrence wins: retries and repeats change nothing)."""
    if rec.get(key) is None and value is not None:
        rec[key] = value


def pick_routing(routings: list[dict[str, Any]], observed_at: float | None, fault_class: str | None) -> dict[str, Any] | None:
    """The router's note of the fault that drained: the one with the same `observed_at`, else the latest note of
    the same fault class observed no later than it (the router notes a condition once per `ROUTE_THROTTLE_S`)."""
    if not routings:
        return None
    if observed_at is not None:
        for r in routings:
            if r.get("observed_at") is not None and abs(r["observed_at"] - observed_at) < 1e-3:
                return r
        older = [r for r in routings if (r.get("observed_at") or 0) <= observed_at + 1e-3
                 and (fault_class is None or r.get("fault_class") == fault_class)]
        return max(older, key=lambda r: r.get("observed_at") or 0) if older else None
    same = [r for r in routings if fault_class is None or r.get("fault_class") == fault_class]
    return max(same, key=lambda r: r.get("routed_at") or 0) if same else None


def note_routing(routings: list[dict[str, Any]], note: dict[str, Any], now: float) -> bool:
    """Add the router's `note` (`observed_at`, `routed_at`, `fault_class`, `kind`, `code`, `device`, …) to a node's
    list; False (nothing to write) when the same condition was noted within `ROUTE_THROTTLE_S`."""
    cond = (note.get("kind"), note.get("code"), note.get("device"))
    for r in routings:
        if (r.get("kind"), r.get("code"), r.get("device")) == cond and now - (r.get("routed_at") or 0) < ROUTE_THROTTLE_S:
            return False
    routings.append(note)
    del routings[:-MAX_ROUTINGS_KEPT]
    return True


def slow_of(kind: str, attrs: dict[str, Any]) -> dict[str, Any] | None:
    """What a `fail_slow` event says about its cost (`fleetmend.analyzer.core.Finding.evidence`): the ratio to the
    peer median, how long the node was slow before the finding (`windows` × `window_s`), the metric, and for job
    step times (`job_step_seconds`) the job (the analyzer's group) and its ranks (`group_size`, one GPU each)."""
    if kind != "fail_slow":
        return None
    try:
        ratio = float(attrs["ratio"]) if attrs.get("ratio") is not None else None
        slow_s = float(attrs.get("windows") or 0) * float(attrs.get("window_s") or 0)
    except (TypeError, ValueError):
        return None
    metric = str(attrs.get("metric") or "")
    out: dict[str, Any] = {"ratio": ratio, "slow_s": slow_s, "metric": metric}
    if metric.startswith("job_"):
        out["job"] = str(attrs.get("group") or "")
        try:
            out["job_gpus"] = int(attrs.get("job_gpus") or attrs.get("group_size") or 0)
        except (TypeError, ValueError):
            out["job_gpus"] = 0
    return out


def part_of(device: str | None, serials: dict[str, str], event_serial: str | None = None) -> tuple[str | None, str | None]:
    """(the faulty device, its serial): the fingerprint's serial of `device` (a PCI bus id or a kernel name),
    else the one the fault's own text gave (`Device.serial` or `.uuid`)."""
    if not device:
        return None, event_serial
    return device, serials.get(device) or event_serial


def repeat_part(failures: list[dict[str, Any]], fault_class: str, now: float, window_s: float,
                this_incident: str) -> str | None:
    """The lemon-like reason when the same part (by serial) failed with the same fault class within `window_s`
    before `now`, in another incident (`failures`: the part's `{fault_class, at, cluster, node, incident_id}`)."""
    earlier = [f for f in failures if f.get("fault_class") == fault_class and f.get("incident_id") != this_incident
               and now - window_s <= (f.get("at") or 0) <= now]
    if not earlier:
        return None
    last = max(earlier, key=lambda f: f.get("at") or 0)
    return (f"repeat part: the same device failed with {fault_class} {len(earlier)} time(s) within "
            f"{window_s / 86400:.0f} days (last on {last.get('node')}); RMA instead of another loop")


def part_not_replaced(rec: dict[str, Any]) -> bool | None:
    """True when a repaired incident's faulty device has the serial it had at the drain; False when it changed;
    None when either serial is unknown or the incident was not repaired through a ticket."""
    a, b = rec.get("part_serial_drain"), rec.get("part_serial_return")
    if not rec.get("ticket") or not a or not b:
        return None
    return a == b


def close_outcome(rec: dict[str, Any], workflow_outcome: str) -> str:
    """The ledger's `Outcome` of a record whose incident closed with `workflow_outcome`
    (`fleetmend.messages.Outcome` value)."""
    if workflow_outcome == "returned_to_service":
        if rec.get("ticket"):
            return Outcome.RMA.value if rec.get("rma") else Outcome.REPAIRED.value
        if rec.get("diag_first_result") in ("pass", "not_applicable"):
            return Outcome.NO_FAULT_FOUND.value
        return Outcome.RECOVERED.value
    if workflow_outcome == "aborted":
        return Outcome.ABORTED.value
    if workflow_outcome == "operator_owned":
        return Outcome.OPERATOR_OWNED.value
    return Outcome.OTHER.value


def out_of_service(rec: dict[str, Any], now: float) -> tuple[float, float] | None:
    """(start, end) of the time the node was out of service: from the drain to the return, else to the close
    (an aborted incident that left the node drained counts until fleetmend let it go), else to `now` (still out).
    None when the record has no drain time. Never negative: an end before the start is the start."""
    start = rec.get("drained_at")
    if start is None:
        return None
    end = rec.get("returned_at") or rec.get("closed_at") or now
    return start, max(start, end)


# ---------------------------------------------------------------------------------------------------- packs
# Closed records, many per KV value (`subjects.ledger_pack_key`): written by the roll-up
# (`fleetmend.infra.ledger.LedgerStore.roll_up`), read by the report. Pure: bytes in, bytes out.

PACK_MAGIC = b"FMLP1"
"""The first bytes of a pack value (format 1)."""
PACK_RECORDS = 2000
"""Records a pack holds at most (then the next part of the day starts)."""
PACK_SOFT_BYTES = 512 * 1024
"""A pack grows past this size by records already in it only (a newer copy replacing an older one), never by
new ones: new records go to the next part. Well below NATS's default 1 MiB message limit."""

_NAN = float("nan")

Packed = tuple[str, int, dict[str, Any], bytes]
"""(the record's own key `inc.<cluster>.<node>.<drained ms>`, the stream sequence of that key's message the
copy came from, head, the record as stored: `<head JSON>\\n<detail JSON>`). The key is the record's identity;
the higher sequence is the newer copy. The detail is never decoded to be packed."""


def pack_day(head: dict[str, Any]) -> str:
    """`YYYYMMDD` (UTC) of a closed record's close (else its drain; else 19700101): the day its pack is named by."""
    import time as _time

    t = head.get("closed_at") or head.get("drained_at") or 0.0
    try:
        return _time.strftime("%Y%m%d", _time.gmtime(float(t)))
    except (TypeError, ValueError, OverflowError, OSError):
        return "19700101"


def _dumps(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def encode_pack(records: list[Packed], fields: Iterable[str]) -> bytes:
    """One pack value: `PACK_MAGIC`, the index's length (4 bytes, big-endian), the index, the full records.

    - index (zlib JSON): `keys`, `seqs`, and of each record only `fields` (the report's `FIELDS`), column by
      column (`cols`: field → values); a column of dicts, lists or few distinct strings holds indexes into `tab`
      (`tabled`), so equal values (versions, hardware class, cluster) are decoded once and shared; a column of
      floats (the times) is the base64 of its IEEE doubles, little-endian (`doubles`; None as NaN), which decodes
      ~5× faster than JSON numbers and exactly; a column that is None throughout is left out. The report decodes
      this part only.
    - full (zlib): the records as stored, one `<head JSON>\\n<detail JSON>` after the other, newline-separated,
      in the same order: the vendor bundle and the next roll-up read it.
    """
    fields = list(fields)
    heads = [r[2] for r in records]
    tab: list[Any] = []
    tab_at: dict[str, int] = {}
    cols: dict[str, list[Any]] = {}
    tabled: list[str] = []
    doubles: list[str] = []
    holes: list[str] = []  # double columns with a None (NaN)
    for f in fields:
        col = [h.get(f) for h in heads]
        present = [v for v in col if v is not None]
        if not present:
            continue
        if all(type(v) is float and v == v for v in present):  # not NaN: NaN stands for None here
            arr = array("d", (_NAN if v is None else v for v in col))
            if sys.byteorder != "little":
                arr.byteswap()
            cols[f] = base64.b64encode(arr.tobytes()).decode()  # type: ignore[assignment]
            doubles.append(f)
            if len(present) < len(col):
                holes.append(f)
            continue
        nested = any(isinstance(v, (dict, list)) for v in present)
        strings = all(isinstance(v, str) for v in present)
        if nested or (strings and len(set(present)) * 4 <= len(present)):
            out: list[Any] = []
            for v in col:
                if v is None:
                    out.append(None)
                    continue
                k = json.dumps(v, sort_keys=True, separators=(",", ":"))
                i = tab_at.get(k)
                if i is None:
                    i = tab_at[k] = len(tab)
                    tab.append(v)
                out.append(i)
            col = out
            tabled.append(f)
        cols[f] = col
    index = {"v": 1, "fields": fields, "keys": [r[0] for r in records], "seqs": [r[1] for r in records],
             "cols": cols, "tabled": tabled, "doubles": doubles,
             "holes": holes, "tab": tab}
    zi = zlib.compress(_dumps(index), 6)
    zf = zlib.compress(b"\n".join(_two_lines(r[3]) for r in records), 6)
    return PACK_MAGIC + struct.pack(">I", len(zi)) + zi + zf


def _split(value: bytes) -> tuple[bytes, bytes]:
    if not value.startswith(PACK_MAGIC):
        raise ValueError("not a ledger pack (no FMLP1 magic)")
    n = struct.unpack(">I", value[len(PACK_MAGIC):len(PACK_MAGIC) + 4])[0]
    start = len(PACK_MAGIC) + 4
    return value[start:start + n], value[start + n:]


class PackFieldsMissing(KeyError):
    """A pack's index does not hold a field asked for (a pack written before the report read that field)."""


def _two_lines(raw: bytes) -> bytes:
    """A stored record as exactly two lines (head, detail): compact JSON has no raw newline."""
    head, nl, detail = raw.partition(b"\n")
    return head + b"\n" + (detail.strip() or b"{}") if nl else head + b"\n{}"


def decode_pack_index(value: bytes, fields: Iterable[str] | None = None) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """(key, seq, head with the index's fields) of every record of a pack, in order. With `fields`, only those.
    A head has no key whose value is None.

    Raises:
        PackFieldsMissing: a field of `fields` is not in this pack's index (read `decode_pack_full` instead).
        ValueError, zlib.error: not a pack.
    """
    idx = json.loads(zlib.decompress(_split(value)[0]))
    want = set(idx["fields"] if fields is None else fields)
    missing = want - set(idx["fields"])
    if missing:
        raise PackFieldsMissing(f"pack index lacks {sorted(missing)}")
    tab, tabled, doubles, holes = idx["tab"], set(idx["tabled"]), set(idx["doubles"]), set(idx["holes"])
    names, cols = [], []
    for f, col in idx["cols"].items():
        if f not in want:
            continue
        if f in doubles:
            arr = array("d")
            arr.frombytes(base64.b64decode(col))
            if sys.byteorder != "little":
                arr.byteswap()
            col = arr.tolist()
            if f in holes:  # NaN: None
                col = [None if v != v else v for v in col]
        elif f in tabled:
            col = [None if i is None else tab[i] for i in col]
        names.append(f)
        cols.append(col)
    keys, seqs = idx["keys"], idx["seqs"]
    rows = zip(*cols, strict=True) if cols else [()] * len(keys)
    if any(None in c for c in cols):
        return ((key, seq, {n: v for n, v in zip(names, row, strict=True) if v is not None})
                for key, seq, row in zip(keys, seqs, rows, strict=True))
    return ((key, seq, dict(zip(names, row, strict=True))) for key, seq, row in zip(keys, seqs, rows, strict=True))


def decode_pack_full(value: bytes) -> list[Packed]:
    """Every record of a pack: (key, seq, head, the record as stored), in order. The details stay undecoded."""
    zi, zf = _split(value)
    idx = json.loads(zlib.decompress(zi))
    lines = zlib.decompress(zf).split(b"\n")
    return [(k, s, json.loads(lines[2 * i]), lines[2 * i] + b"\n" + lines[2 * i + 1])
            for i, (k, s) in enumerate(zip(idx["keys"], idx["seqs"], strict=True))]


__all__ = ["FINDING_KEYS", "LEDGER_SCHEMA_VERSION", "Outcome", "PACK_MAGIC", "PACK_RECORDS", "PACK_SOFT_BYTES",
           "PackFieldsMissing", "Packed", "close_outcome", "decode_pack_full", "decode_pack_index", "encode_pack",
           "first", "new_record", "note_routing", "out_of_service", "pack_day", "part_not_replaced", "part_of",
           "pick_routing", "repeat_part", "same_incident", "seen", "slow_of"]
