"""The drift judge: reads every node's fingerprint from the KV bucket, judges with `fleetmend.drift`, and publishes
each deviation as a `config_drift_<check>` `FaultEvent` on the node's fault subject (the normal pipeline: router,
incident, FleetGuard's budget for what drains, a live fix for what can be set in place).

Runs inside the analyzer's active replica (`fleetmend.analyzer.service.Analyzer.tick`), every `DRIFT_INTERVAL_S`.
A deviation is published once while it lasts (again after a judge restart: the router collapses the repeat by its
`ConditionKey`, device = the fact key); when the node's next fingerprint agrees, its clearing event follows (same
kind and device, `healthy=True`, `clearing_kind` `config_drift_resolved`). A cohort split is logged
(`cohort_split`) and never published: humans decide.
A fingerprint in the bucket that does not parse is skipped with one warning line naming its key, and dead-lettered.

A topology changed across a repair (`RepairWatch`, same tick): a node drained by fleetmend holds a slot of the
cluster's permit pool (`fleetmend.infra.permit_pool`, read only here) from its drain until its incident returns it;
the judge notes each holder's GPU/NIC/NVMe placement and topology hash when it first sees it drained, and when the
node leaves the pool compares them with its fingerprint then (`fleetmend.drift.placement_changes`: a GPU gone, or
farther from its NIC/NVMe, or as near through another device; a device back or nearer is no change, since the
drain's fault may have taken it away). A node that comes back with another placement gets a
`config_drift_topology_repair` fault (degraded, never drains: a human checks the cabling or slot the repair touched;
attrs: before, after, the GPUs whose nearest NIC/NVMe moved, when it was drained), logged
`topology_changed_after_repair` and listed by `fleetmend drift` (`after_repair`). Not flagged: a node whose new
topology is its peers' (the repair made it agree; recorded as such), or one an allowed set
(`fleetmend drift allow topology.hash …`) covers. Cleared (`config_drift_resolved`) when the node's placement is
back, agrees with its peers, or is allowed. The notes survive a failover in the analyzer bucket
(`repairs.<cluster>`, `REPAIR_KEY`); a drain and return both inside an analyzer outage is not seen (the change
record in `FLEET_FINGERPRINTS` still is, in `fleetmend drift`'s topology changes).
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
from typing import Any

import structlog

from fleetmend import __version__, subjects
from fleetmend.catalog import Catalog, load_catalog
from fleetmend.drift import (
    DEFAULT_INVARIANTS,
    DEFAULT_MAJORITY,
    DEFAULT_QUORUM,
    AllowedSet,
    Deviation,
    DriftReport,
    Invariant,
    judge,
    placement_changes,
    placements,
    topology_like_peers,
)
from fleetmend.events import Component, Device, FaultEvent, Severity, Source
from fleetmend.fingerprint import Fingerprint
from fleetmend.infra.jetstream import ensure_fingerprint_stores, kv_config, kv_keys, open_kv_bucket

DRIFT_INTERVAL_S = 60.0
"""How often the judge re-reads the bucket: fingerprints change every 15 min at most per node, so a minute keeps
the judge's reaction well inside one agent interval at a cost of one KV scan per cluster."""

log = structlog.get_logger("fleetmend.analyzer.drift")


def deviation_event(d: Deviation, cluster: str, digest: str, catalog: Catalog) -> FaultEvent:
    """The `config_drift_<check>` event of one deviation (degraded, source analyzer, device name = fact key).

    attrs: key, found, expected (`|`-joined), layer, reason, fix (live/reboot/repair), wanted, hardware, role.
    The event id hashes node, key, found and the fingerprint digest: a replica re-publishing the same finding is
    deduplicated by JetStream."""
    row = catalog.kinds.get(d.kind)
    eid = hashlib.sha1(f"{cluster}/{d.node}/{d.key}/{d.found}/{digest}".encode()).hexdigest()[:24]
    msg = (f"config drift: {d.key} = {d.found!r}, expected {' or '.join(repr(e) for e in d.expected)} "
           f"({d.layer.value}: {d.reason})")
    ev = FaultEvent(event_id=eid, cluster=cluster, node=d.node, component=row.component if row else Component.KERNEL,
                    device=Device(name=d.key), kind=d.kind, severity=Severity.DEGRADED, message=msg[:4096],
                    source=Source.ANALYZER, agent_version=__version__, raw=msg[:4096],
                    attrs={"key": d.key, "found": d.found, "expected": "|".join(d.expected), "layer": d.layer.value,
                           "reason": d.reason[:500], "fix": d.fix.value, "wanted": d.wanted, "hardware": d.hardware,
                           "role": d.role.value, "check": d.check})
    return catalog.stamp(ev)


def resolved_event(cluster: str, node: str, key: str, kind: str, digest: str, catalog: Catalog) -> FaultEvent:
    """The clearing event of `kind` for `key` on `node`: the same kind and device (`ConditionKey`), `healthy=True`,
    severity info, `attrs["clearing_kind"] = "config_drift_resolved"` (the convention of agents/conditions.py)."""
    eid = hashlib.sha1(f"{cluster}/{node}/{key}/resolved/{digest}".encode()).hexdigest()[:24]
    row = catalog.kinds.get(kind)
    msg = f"config drift resolved: {key} is as expected again"
    ev = FaultEvent(event_id=eid, cluster=cluster, node=node, component=row.component if row else Component.KERNEL,
                    device=Device(name=key), kind=kind, severity=Severity.INFO, healthy=True, source=Source.ANALYZER,
                    message=msg, raw=msg, agent_version=__version__,
                    attrs={"key": key, "clearing_kind": "config_drift_resolved"})
    return catalog.stamp(ev)


REPAIR_KIND = "config_drift_topology_repair"
REPAIR_RECENT = 50
"""Findings kept in the `repairs.<cluster>` document for `fleetmend drift` (newest last)."""
REPAIR_WATCH_MAX = 5000
"""Drained nodes watched at once (a permit pool holds at most the drain budget; this only bounds a broken one)."""


def repair_key(cluster: str) -> str:
    """`repairs.<cluster>`: the repair watch's document in `ANALYZER_KV_BUCKET`."""
    return f"repairs.{subjects.permit_kv_key(cluster)}"


def repair_event(cluster: str, finding: dict[str, Any], catalog: Catalog) -> FaultEvent:
    """The `config_drift_topology_repair` event of one finding (device name `topology.hash`)."""
    row = catalog.kinds.get(REPAIR_KIND)
    eid = hashlib.sha1(f"{cluster}/{finding['node']}/repair/{finding['before']}/{finding['after']}/"
                       f"{finding['drained_at']}".encode()).hexdigest()[:24]
    moved = "; ".join(finding["changed"][:4])
    msg = (f"topology changed across a repair: hash {finding['before']} before the drain, {finding['after']} after "
           f"the return ({moved})")
    ev = FaultEvent(event_id=eid, cluster=cluster, node=finding["node"],
                    component=row.component if row else Component.PCIE, device=Device(name="topology.hash"),
                    kind=REPAIR_KIND, severity=Severity.DEGRADED, message=msg[:4096], source=Source.ANALYZER,
                    agent_version=__version__, raw="\n".join(finding["changed"])[:4096],
                    attrs={"key": "topology.hash", "before": finding["before"], "after": finding["after"],
                           "changed": "; ".join(finding["changed"][:16])[:2000], "drained_at": finding["drained_at"],
                           "returned_seen_at": finding["at"], "check": "topology_repair", "fix": "repair"})
    return catalog.stamp(ev)


class RepairWatch:
    """The topology-after-repair check of one cluster (module docstring). State: `watch` (node → placement when
    first seen drained), `open` (node → finding with a fault published and not cleared), `recent` (findings)."""

    def __init__(self, cluster: str, js: Any, catalog: Catalog, log: Any) -> None:
        self.cluster, self.js, self.catalog, self._log = cluster, js, catalog, log
        self.doc: dict[str, Any] | None = None
        self._kv: Any = None
        self._pool_kv: Any = None
        self._pool_failed = False
        self._resend = False

    async def _state(self) -> dict[str, Any]:
        if self.doc is None:
            from nats.js.errors import BucketNotFoundError, KeyNotFoundError

            try:
                self._kv = await self.js.key_value(subjects.ANALYZER_KV_BUCKET)
            except BucketNotFoundError:
                self._kv = await self.js.create_key_value(kv_config(subjects.ANALYZER_KV_BUCKET,
                                                                    "fail-slow analyzer: lease and state"))
            try:
                self.doc = json.loads((await self._kv.get(repair_key(self.cluster))).value or b"{}")
            except (KeyNotFoundError, ValueError):
                self.doc = {}
            for part in ("watch", "open"):
                self.doc.setdefault(part, {})
            self.doc.setdefault("recent", [])
            self._resend = bool(self.doc["open"])
        return self.doc

    async def drained(self) -> dict[str, float] | None:
        """Node → unix time of its drain slot, from the permit pool (read only); None when there is no pool or it
        cannot be read (nothing is judged then)."""
        from nats.js.errors import BucketNotFoundError, KeyNotFoundError

        from fleetmend.infra.permit_pool import PoolState

        try:
            if self._pool_kv is None:
                self._pool_kv = await self.js.key_value(subjects.PERMIT_KV_BUCKET)
            entry = await self._pool_kv.get(subjects.permit_kv_key(self.cluster))
            if not entry.value:
                return None  # deleted: nothing to judge against (a watched node is not taken as returned)
            state = PoolState.from_json(entry.value)
        except (BucketNotFoundError, KeyNotFoundError):
            return None  # no pool yet: FleetGuard has not published it, so fleetmend drained nothing
        except Exception as err:  # noqa: BLE001 - no permission or NATS away: the rest of the judge goes on
            if not self._pool_failed:
                self._pool_failed = True
                self._log.warning("repair_watch_unavailable", error=repr(err)[:200])
            self._pool_kv = None
            return None
        self._pool_failed = False
        return {n: h.at for n, h in state.holders.items()}

    async def tick(self, fps: list[Fingerprint], report: DriftReport, allowed: dict[str, AllowedSet]
                   ) -> list[FaultEvent]:
        """Note newly drained nodes, judge returned ones, clear resolved findings. Returns the events to publish
        (faults and clearings); the document is written first, when it changed. After a (re)load the open findings'
        faults are sent again (same event ids; the router collapses a repeat, as for the deviations above); a caller
        that fails to publish drops the document (`forget`) so that the next tick reloads and resends."""
        held = await self.drained()
        if held is None:
            return []
        doc = copy.deepcopy(await self._state())
        latest = {fp.node: fp for fp in fps}
        before = json.dumps(doc, sort_keys=True)
        events: list[FaultEvent] = []
        if self._resend:
            events += [repair_event(self.cluster, f, self.catalog) for f in doc["open"].values()]
        now = time.time()
        for node, at in held.items():
            fp = latest.get(node)
            if node not in doc["watch"] and fp is not None and len(doc["watch"]) < REPAIR_WATCH_MAX:
                doc["watch"][node] = {"at": at, "topology": fp.topology_hash, "placements": placements(fp)}
        for node in [n for n in doc["watch"] if n not in held]:
            w, fp = doc["watch"].pop(node), latest.get(node)
            if fp is None or fp.topology_hash == w["topology"]:
                continue
            changed = placement_changes(w["placements"], placements(fp))
            if not changed:  # only devices back or nearer (the drain's fault had taken one away)
                self._log.info("topology_back_after_repair", node=node, before=w["topology"], after=fp.topology_hash)
                continue
            finding = {"node": node, "drained_at": w["at"], "at": now, "before": w["topology"],
                       "after": fp.topology_hash, "changed": changed,
                       "like_peers": topology_like_peers(report, fp.hardware.key, fp.topology_hash, allowed)}
            doc["recent"] = (doc["recent"] + [finding])[-REPAIR_RECENT:]
            if finding["like_peers"]:
                self._log.info("topology_changed_after_repair", node=node, before=w["topology"],
                               after=fp.topology_hash, verdict="now like its peers")
                continue
            doc["open"][node] = finding
            events.append(repair_event(self.cluster, finding, self.catalog))
            self._log.warning("topology_changed_after_repair", node=node, before=w["topology"],
                              after=fp.topology_hash, changed=finding["changed"][:4])
        for node, finding in list(doc["open"].items()):
            fp = latest.get(node)
            if fp is None or node in held:
                continue
            if fp.topology_hash == finding["before"] or topology_like_peers(report, fp.hardware.key,
                                                                           fp.topology_hash, allowed):
                del doc["open"][node]
                events.append(resolved_event(self.cluster, node, "topology.hash", REPAIR_KIND, fp.digest,
                                             self.catalog))
                self._log.info("topology_after_repair_resolved", node=node, topology=fp.topology_hash)
        if json.dumps(doc, sort_keys=True) != before:
            await self._kv.put(repair_key(self.cluster), json.dumps(doc).encode())
        self.doc, self._resend = doc, False
        return events

    def forget(self) -> None:
        """Drop the in-memory document: the next tick reloads it and sends the open findings again."""
        self.doc = None


class DriftJudge:
    """Judges one cluster's fingerprints (see the module docstring).

    Args:
        js: JetStream context (the fingerprint and allow buckets, the fault subject).
        invariants: policy rows (`fleetmend.drift.load_invariants`).
        interval_s: seconds between judgements (`maybe_tick`).
    """

    def __init__(self, cluster: str, js: Any, *, catalog: Catalog | None = None,
                 invariants: tuple[Invariant, ...] = DEFAULT_INVARIANTS, quorum: int = DEFAULT_QUORUM,
                 majority: float = DEFAULT_MAJORITY, interval_s: float = DRIFT_INTERVAL_S,
                 clock: Any = time.monotonic) -> None:
        self.cluster, self.js = cluster, js
        self.catalog = catalog or load_catalog(None)
        self.invariants, self.quorum, self.majority = invariants, quorum, majority
        self.interval_s, self.clock = interval_s, clock
        self.open: dict[tuple[str, str], str] = {}
        """(node, fact key) → kind of the deviation published and not yet resolved."""
        self.published: list[FaultEvent] = []
        self.last: DriftReport | None = None
        self._next = 0.0
        self._fp_kv: Any = None
        self._allow_kv: Any = None
        self._bad: set[str] = set()
        self._log = log.bind(cluster=cluster)
        self.repairs = RepairWatch(cluster, js, self.catalog, self._log)

    async def _buckets(self) -> tuple[Any, Any]:
        if self._fp_kv is None:  # the stores: created here (secured agents may only write their own key)
            self._fp_kv = await ensure_fingerprint_stores(self.js)
            self._allow_kv = await open_kv_bucket(self.js, subjects.DRIFT_ALLOW_KV_BUCKET,
                                                  "allowed drift values (fleetmend drift allow)")
        return self._fp_kv, self._allow_kv

    async def fingerprints(self) -> list[Fingerprint]:
        """The cluster's latest fingerprints; one that does not parse is skipped (one warning, dead-lettered)."""
        fp_kv, _ = await self._buckets()
        out = []
        for key in await kv_keys(self.js, subjects.FINGERPRINT_KV_BUCKET, prefix=f"{self.cluster}."):
            try:
                entry = await fp_kv.get(key)
            except Exception:  # noqa: BLE001 - deleted meanwhile: not a node any more
                continue
            try:
                out.append(Fingerprint.model_validate_json(entry.value))
            except ValueError as err:
                if key not in self._bad:
                    self._bad.add(key)
                    reason = f"fingerprint {key}: {str(err).splitlines()[0][:200]}"
                    self._log.warning("fingerprint_invalid", key=key, error=reason)
                    record = {"reason": reason, "stage": "drift_judge", "bucket": subjects.FINGERPRINT_KV_BUCKET,
                              "key": key}
                    try:
                        await self.js.publish(subjects.DEADLETTER_SUBJECT, json.dumps(record).encode(), timeout=5.0)
                    except Exception as perr:  # noqa: BLE001 - the dead-letter stream is the router's
                        self._log.warning("deadletter_failed", error=repr(perr))
        return out

    async def allowed(self) -> dict[str, AllowedSet]:
        """The cluster's allowed sets (`fleetmend drift allow`), fact key → `AllowedSet`."""
        return await read_allowed(self.js, self.cluster, await self._buckets())

    async def maybe_tick(self) -> DriftReport | None:
        """`tick` when `interval_s` has passed since the last one; else None."""
        if self.clock() < self._next:
            return None
        self._next = self.clock() + self.interval_s
        try:
            return await self.tick()
        except Exception as err:  # noqa: BLE001 - NATS hiccup: the next interval retries; the analyzer goes on
            self._log.warning("drift_judge_failed", error=repr(err)[:300])
            return None

    async def tick(self) -> DriftReport:
        """Judge now; publish new deviations and the clearing of resolved ones. Returns the report."""
        fps = await self.fingerprints()
        allowed = await self.allowed()
        report = judge(fps, self.invariants, allowed, self.quorum, self.majority)
        digests = {fp.node: fp.digest for fp in fps}
        now_open: dict[tuple[str, str], str] = {}
        for d in report.deviations:
            k = (d.node, d.key)
            now_open[k] = d.kind
            if k in self.open:
                continue
            ev = deviation_event(d, self.cluster, digests[d.node], self.catalog)
            await self._publish(ev)
            self._log.warning("config_drift", node=d.node, key=d.key, found=d.found, expected=list(d.expected),
                              layer=d.layer.value, fix=d.fix.value)
        for (node, key), kind in self.open.items():
            if (node, key) not in now_open and node in digests:
                await self._publish(resolved_event(self.cluster, node, key, kind, digests[node], self.catalog))
                self._log.info("config_drift_resolved", node=node, key=key)
        self.open = now_open | {k: v for k, v in self.open.items() if k[0] not in digests}
        for c in report.splits:
            self._log.warning("cohort_split", key=c.key, role=c.role.value, hardware=c.hardware, size=c.verdict.size,
                              share=round(c.verdict.share, 3), hint="no value holds 60 %: decide, then "
                              "`fleetmend drift allow` or fix the nodes; nothing is drained")
        try:
            for ev in await self.repairs.tick(fps, report, allowed):
                await self._publish(ev)
        except Exception as err:  # noqa: BLE001 - the analyzer bucket or NATS away: the next tick retries
            self.repairs.forget()
            self._log.warning("repair_watch_failed", error=repr(err)[:300])
        self.last = report
        return report

    async def _publish(self, ev: FaultEvent) -> None:
        await self.js.publish(subjects.fault_subject(self.cluster, ev.node), ev.to_json_bytes(),
                              headers={"Nats-Msg-Id": subjects.msg_id(ev.event_id)}, timeout=5.0)
        self.published.append(ev)


async def read_allowed(js: Any, cluster: str, buckets: tuple[Any, Any] | None = None) -> dict[str, AllowedSet]:
    """Allowed sets of `cluster` from `DRIFT_ALLOW_KV_BUCKET` (JSON `{"key", "values", "who", "why", "at"}`); a
    record that does not parse is skipped."""
    kv = buckets[1] if buckets else await open_kv_bucket(js, subjects.DRIFT_ALLOW_KV_BUCKET, "allowed drift values")
    out: dict[str, AllowedSet] = {}
    for key in await kv_keys(js, subjects.DRIFT_ALLOW_KV_BUCKET, prefix=f"{cluster}."):
        try:
            data = json.loads((await kv.get(key)).value)
            out[data["key"]] = AllowedSet(data["key"], frozenset(data["values"]), data["who"], data["why"],
                                          data.get("at", ""))
        except Exception:  # noqa: BLE001 - deleted (allow removed) or unreadable: no allowed set
            continue
    return out
