"""The drift judge: reads every node's fingerprint from the KV bucket, judges with `fleetmend.drift`, and publishes
each deviation as a `config_drift_<check>` `FaultEvent` on the node's fault subject (the normal pipeline: router,
incident, FleetGuard's budget for what drains, a live fix for what can be set in place).

Runs inside the analyzer's active replica (`fleetmend.analyzer.service.Analyzer.tick`), every `DRIFT_INTERVAL_S`.
A deviation is published once while it lasts (again after a judge restart: the router collapses the repeat by its
`ConditionKey`, device = the fact key); when the node's next fingerprint agrees, its clearing event follows (same
kind and device, `healthy=True`, `clearing_kind` `config_drift_resolved`). A cohort split is logged
(`cohort_split`) and never published: humans decide.
A fingerprint in the bucket that does not parse is skipped with one warning line naming its key, and dead-lettered.
"""

from __future__ import annotations

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
)
from fleetmend.events import Component, Device, FaultEvent, Severity, Source
from fleetmend.fingerprint import Fingerprint
from fleetmend.infra.jetstream import ensure_fingerprint_stores, kv_keys, open_kv_bucket

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
        report = judge(fps, self.invariants, await self.allowed(), self.quorum, self.majority)
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
