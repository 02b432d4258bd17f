"""Scheduler adapters (drain/undrain a node) and their Temporal activities.

Every adapter is idempotent and keeps **ownership**: fleetmend only ever returns to service (Slurm
`State=RESUME`, KV entry removal) a drain that it set itself. A drain an operator set first is
remembered (`operator_drained=True`) and left alone, before and after the incident.

- `SlurmScheduler`: `scontrol update NodeName=<n> State=DRAIN Reason="<prefix> <reason> [incident <id>]"`,
  ownership by the reason prefix (`SlurmSettings.reason_prefix`, default `fleetmend:`). Verified against
  Slurm 22.05.8 (shared/notes/what-runs-here.md §1).
- `StandaloneScheduler`: hosts without a scheduler; the drained set is a JetStream key-value bucket
  (`subjects.DRAIN_KV_BUCKET`), written with optimistic concurrency (create / update-with-revision).
- `NoopScheduler`: `scheduler = "none"`; drains nothing, says so.

`SchedulerActivities(scheduler)` exposes `drain_node` and `undrain_node` for the worker.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from temporalio import activity
from temporalio.exceptions import ApplicationError

from fleetmend import metrics, subjects
from fleetmend.config import SchedulerKind, Settings, SlurmSettings
from fleetmend.errors import ConfigError, NodeNotFoundError, SchedulerError

if TYPE_CHECKING:
    from nats.js import JetStreamContext
    from nats.js.kv import KeyValue

OWNER_FLEETMEND = "fleetmend"
OWNER_OPERATOR = "operator"


# --------------------------------------------------------------------------------------------------
# Messages (the contract workflows/remediation.py codes against)


@dataclass
class DrainRequest:
    cluster: str
    node: str
    reason: str
    incident_id: str
    wait_drained_s: float = 0.0
    """Seconds `drain_node` waits (heartbeating) for DRAINING → DRAINED, i.e. running jobs to end.
    0 returns as soon as the drain is set (the node may still be `draining`)."""
    observed_at: datetime | None = None
    """When the fault that caused the drain was observed (the event's `observed_at`); given, the
    activity observes `fleetmend_time_to_quarantine_seconds`. Optional: older callers omit it."""


@dataclass
class DrainResult:
    node: str
    drained: bool
    """The node is (now) drained or draining (or down): no new work lands on it."""
    owned: bool
    """fleetmend set this drain (reason carries the prefix / KV entry owner is fleetmend)."""
    operator_drained: bool
    """Someone else drained (or downed) it first; fleetmend leaves it and never undrains it."""
    state: str
    """Normalized state: idle, allocated, mixed, draining, drained, down, … (`*` = not responding)."""
    detail: str
    reason: str = ""
    """The scheduler's current drain reason (without Slurm's `[user@time]` suffix)."""
    raw_state: str = ""
    """The scheduler's own state text, e.g. Slurm `ALLOCATED+DRAIN`."""


@dataclass
class UndrainRequest:
    cluster: str
    node: str
    incident_id: str
    drained_at: datetime | None = None
    """When the node was drained; given, a successful undrain observes `fleetmend_mttr_seconds`."""


@dataclass
class UndrainResult:
    node: str
    resumed: bool
    """True only when this call returned a fleetmend-owned drain to service."""
    state: str
    detail: str
    operator_drained: bool = False
    """The drain belongs to someone else and was left in place (resumed is False)."""


@dataclass
class NodeInfo:
    """One row of `list_nodes()` (for `fleetmend nodes` / `fleetmend status`)."""

    name: str
    state: str
    reason: str
    owner: str | None
    """"fleetmend", "operator", or None when the node is not drained."""
    incident_id: str | None = None


@runtime_checkable
class SchedulerAdapter(Protocol):
    name: str

    async def drain(self, node: str, reason: str, incident_id: str) -> DrainResult: ...

    async def undrain(self, node: str, incident_id: str) -> UndrainResult: ...

    async def state(self, node: str) -> str: ...


# --------------------------------------------------------------------------------------------------
# Slurm

_REASON_SUFFIX = re.compile(r"\s*\[[^\[\]@]*@[^\[\]]*\]\s*$")
_INCIDENT = re.compile(r"\[incident ([^\]]+)\]")
_KEY_SPLIT = re.compile(r"\s+(?=[A-Za-z][A-Za-z0-9_:/]*=)")


def parse_scontrol_node(text: str) -> dict[str, str]:
    """Parse one `scontrol -o show node X` line into its Key=Value fields.

    Values may hold spaces (`OS=Linux 6.18 #1 SMP …`); `Reason=` is always last in 22.05 and runs
    to the end of the line (it may contain `=` and brackets), so it is cut off before splitting.

    Args:
        text: the line (leading/trailing whitespace ignored).
    Returns:
        dict of field → value, e.g. `{"NodeName": "node3", "State": "IDLE+DRAIN",
        "Reason": "fleetmend: xid 79 [incident i-1] [root@2026-11-29T14:50:26]"}`.
    """
    line = text.strip().splitlines()[0] if text.strip() else ""
    fields: dict[str, str] = {}
    idx = line.find(" Reason=")
    if idx >= 0:
        fields["Reason"] = line[idx + len(" Reason="):].strip()
        line = line[:idx]
    for token in _KEY_SPLIT.split(line):
        key, sep, value = token.partition("=")
        if sep:
            fields[key] = value.strip()
    return fields


def strip_reason_suffix(reason: str) -> str:
    """`"maint x [root@2026-11-29T14:50:26]"` → `"maint x"` (Slurm appends who and when)."""
    return _REASON_SUFFIX.sub("", reason or "").strip()


def normalize_slurm_state(raw: str) -> str:
    """scontrol's State → sinfo's long word: `IDLE+DRAIN` → drained, `ALLOCATED+DRAIN` → draining,
    `DOWN*` → down*, `MIXED` → mixed. Flags other than DRAIN (e.g. `+COMPLETING`) are dropped."""
    if not raw:
        return "unknown"
    not_responding = "*" in raw
    parts = raw.replace("*", "").split("+")
    base, flags = parts[0].lower(), {p.upper() for p in parts[1:]}
    if "DRAIN" in flags:
        if base in ("allocated", "mixed", "completing") or "COMPLETING" in flags:
            word = "draining"
        else:
            word = "drained"
    else:
        word = base
    return word + ("*" if not_responding else "")


def _is_drained(raw: str) -> bool:
    parts = {p for p in raw.replace("*", "").split("+")}
    return bool(parts & {"DRAIN", "DRAINED", "DRAINING", "DOWN", "FAIL", "FAILING"})


class SlurmScheduler:
    """Drain and RESUME through `scontrol` (asyncio subprocesses, never a shell).

    Args:
        settings: `SlurmSettings` (binaries, SLURM_CONF, `reason_prefix`, `command_timeout_s`).
    """

    name = "slurm"

    def __init__(self, settings: SlurmSettings) -> None:
        self.settings = settings
        self.prefix = settings.reason_prefix.strip()
        self.env = dict(os.environ)
        if settings.slurm_conf:
            self.env["SLURM_CONF"] = settings.slurm_conf
        self.update_calls = 0
        """How many `scontrol update` commands this instance ran (visible idempotency)."""

    # -- subprocess plumbing -------------------------------------------------------------------

    def _where(self) -> str:
        return f"{self.settings.scontrol} (SLURM_CONF={self.env.get('SLURM_CONF', 'default /etc/slurm/slurm.conf')})"

    async def _run(self, *argv: str) -> tuple[int, str, str]:
        try:
            async with asyncio.timeout(self.settings.command_timeout_s):
                proc = await asyncio.create_subprocess_exec(
                    *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=self.env)
                try:
                    out, err = await proc.communicate()
                except asyncio.CancelledError:
                    if proc.returncode is None:
                        proc.kill()
                        await proc.wait()
                    raise
        except TimeoutError as err:
            raise SchedulerError(
                f"{' '.join(argv)} did not finish within {self.settings.command_timeout_s}s; "
                f"is slurmctld reachable? ({self._where()})") from err
        except FileNotFoundError as err:
            raise SchedulerError(f"{argv[0]} not found; set slurm.scontrol/slurm.sinfo or install slurm-client") from err
        return proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")

    async def show(self, node: str) -> dict[str, str]:
        """`scontrol -o show node <node>` parsed (see `parse_scontrol_node`).

        Raises:
            NodeNotFoundError: slurmctld does not know `node`.
            SchedulerError: scontrol failed otherwise (stderr in the message).
        """
        rc, out, err = await self._run(self.settings.scontrol, "-o", "show", "node", node)
        if rc != 0 or not out.strip():
            text = (err or out).strip()
            if "not found" in text.lower():
                raise NodeNotFoundError(f"node {node!r} not found by {self._where()}: {text}")
            raise SchedulerError(f"scontrol show node {node} failed (rc {rc}): {text} [{self._where()}]")
        return parse_scontrol_node(out)

    async def _update(self, node: str, *fields: str) -> None:
        self.update_calls += 1
        rc, out, err = await self._run(self.settings.scontrol, "update", f"NodeName={node}", *fields)
        if rc != 0:
            text = (err or out).strip()
            if "invalid node name" in text.lower():
                raise NodeNotFoundError(f"node {node!r} not found by {self._where()}: {text}")
            raise SchedulerError(
                f"scontrol update NodeName={node} {' '.join(fields)} failed (rc {rc}): {text} [{self._where()}]")

    def _owned(self, reason: str) -> bool:
        return bool(self.prefix) and reason.startswith(self.prefix)

    def format_reason(self, reason: str, incident_id: str) -> str:
        """`"<prefix> <reason> [incident <id>]"`, on one line, without quotes (Slurm stores it verbatim)."""
        clean = " ".join(reason.replace('"', "'").split())[:200]
        return f"{self.prefix} {clean} [incident {incident_id}]"

    # -- adapter API ---------------------------------------------------------------------------

    async def state(self, node: str) -> str:
        """Normalized state of `node` (idle, draining, drained, down*, …). Raises NodeNotFoundError."""
        return normalize_slurm_state((await self.show(node)).get("State", ""))

    async def drain(self, node: str, reason: str, incident_id: str) -> DrainResult:
        """Drain `node` unless it is already drained or down.

        Args:
            node: Slurm NodeName.
            reason: why (e.g. "xid 79 GPU fell off the bus"); stored after the prefix.
            incident_id: recorded in the reason as `[incident <id>]`.
        Returns:
            `DrainResult`. Already drained by fleetmend → owned=True with no second update; drained or
            DOWN by someone else → operator_drained=True, owned=False, untouched.
        Raises:
            NodeNotFoundError: unknown node.
            SchedulerError: scontrol failed or timed out.
        """
        fields = await self.show(node)
        raw = fields.get("State", "")
        current = strip_reason_suffix(fields.get("Reason", ""))
        if _is_drained(raw):
            if self._owned(current):
                return DrainResult(node, True, True, False, normalize_slurm_state(raw),
                                   f"already drained by fleetmend ({current!r}); no update sent",
                                   reason=current, raw_state=raw)
            return DrainResult(node, True, False, True, normalize_slurm_state(raw),
                               f"already {raw} by someone else (reason {current!r}); left as is, "
                               "fleetmend will not resume it", reason=current, raw_state=raw)
        await self._update(node, "State=DRAIN", f"Reason={self.format_reason(reason, incident_id)}")
        after = await self.show(node)
        raw = after.get("State", "")
        now_reason = strip_reason_suffix(after.get("Reason", ""))
        owned = self._owned(now_reason)
        return DrainResult(node, _is_drained(raw), owned, _is_drained(raw) and not owned,
                           normalize_slurm_state(raw),
                           f"scontrol State=DRAIN set; now {raw}" if owned else
                           f"drain raced with another writer: reason now {now_reason!r}",
                           reason=now_reason, raw_state=raw)

    async def undrain(self, node: str, incident_id: str) -> UndrainResult:
        """RESUME `node` if, and only if, its drain reason carries our prefix.

        Returns:
            `UndrainResult`: resumed=True after `State=RESUME`; resumed=False (a success) when the node
            was not drained; resumed=False with operator_drained=True when the drain is someone else's.
        Raises:
            NodeNotFoundError, SchedulerError: as `drain`.
        """
        fields = await self.show(node)
        raw = fields.get("State", "")
        current = strip_reason_suffix(fields.get("Reason", ""))
        if not _is_drained(raw):
            return UndrainResult(node, False, normalize_slurm_state(raw), f"not drained ({raw}); nothing to resume")
        if not self._owned(current):
            return UndrainResult(node, False, normalize_slurm_state(raw),
                                 f"drain is not fleetmend's: reason {current!r} lacks prefix {self.prefix!r}; "
                                 "left for the operator", operator_drained=True)
        m = _INCIDENT.search(current)
        note = "" if not m or m.group(1) == incident_id else f" (drain was set by incident {m.group(1)})"
        await self._update(node, "State=RESUME")
        raw_after = (await self.show(node)).get("State", "")
        return UndrainResult(node, True, normalize_slurm_state(raw_after),
                             f"scontrol State=RESUME; now {raw_after}{note}")

    async def list_nodes(self) -> list[NodeInfo]:
        """Every node slurmctld knows (`scontrol -o show node`), with state, reason and owner.

        Raises:
            SchedulerError: scontrol failed.
        """
        rc, out, err = await self._run(self.settings.scontrol, "-o", "show", "node")
        if rc != 0:
            raise SchedulerError(f"scontrol show node failed (rc {rc}): {(err or out).strip()} [{self._where()}]")
        rows = []
        for line in out.splitlines():
            if not line.startswith("NodeName="):
                continue
            f = parse_scontrol_node(line)
            raw, reason = f.get("State", ""), strip_reason_suffix(f.get("Reason", ""))
            owner = None
            if _is_drained(raw):
                owner = OWNER_FLEETMEND if self._owned(reason) else OWNER_OPERATOR
            m = _INCIDENT.search(reason) if owner == OWNER_FLEETMEND else None
            rows.append(NodeInfo(f.get("NodeName", "?"), normalize_slurm_state(raw), reason, owner,
                                 m.group(1) if m else None))
        return rows


# --------------------------------------------------------------------------------------------------
# Standalone (JetStream KV)

_WRONG_LAST_SEQUENCE = 10071
"""JetStream API error code: expected last subject sequence mismatch (optimistic concurrency)."""


class StandaloneScheduler:
    """The drained set of a cluster without a scheduler, in a JetStream KV bucket.

    Key = node name; value = JSON `{"reason", "incident_id", "owner": "fleetmend"|"operator", "at"}`.
    A deleted key (tombstone; history ≥ 5 keeps the trail) means "in service". Writes use
    `create` / `update(last=revision)` / `delete(last=revision)` so concurrent workers can't
    double-drain or remove a drain that changed under them.

    Args:
        js: JetStream context.
        bucket: KV bucket name (created if missing: file storage, history 5).
        op_timeout_s: bound on each KV round trip.
    """

    name = "standalone"
    STATE_DRAINED = "drained"
    STATE_IN_SERVICE = "in_service"

    def __init__(self, js: JetStreamContext, bucket: str = subjects.DRAIN_KV_BUCKET,
                 op_timeout_s: float = 10.0) -> None:
        self.js = js
        self.bucket = bucket
        self.op_timeout_s = op_timeout_s
        self._kv: KeyValue | None = None

    async def kv(self) -> KeyValue:
        """The bucket, created on first use if missing."""
        if self._kv is None:
            from nats.js.api import KeyValueConfig, StorageType
            from nats.js.errors import BucketNotFoundError

            async with asyncio.timeout(self.op_timeout_s):
                try:
                    self._kv = await self.js.key_value(self.bucket)
                except BucketNotFoundError:
                    self._kv = await self.js.create_key_value(KeyValueConfig(
                        bucket=self.bucket, history=5, storage=StorageType.FILE,
                        description="fleetmend drained nodes (standalone scheduler)"))
        return self._kv

    async def _entry(self, node: str) -> tuple[dict[str, Any] | None, int]:
        """(value, revision) of `node`'s key; (None, 0) when not drained."""
        from nats.js.errors import KeyNotFoundError

        kv = await self.kv()
        async with asyncio.timeout(self.op_timeout_s):
            try:
                e = await kv.get(node)
            except KeyNotFoundError:  # never written, or a delete tombstone (`create` handles both)
                return None, 0
        if not e.value or e.operation in ("DEL", "PURGE"):
            return None, 0
        return json.loads(e.value), e.revision or 0

    @staticmethod
    def _doc(reason: str, incident_id: str | None, owner: str) -> bytes:
        return json.dumps({"reason": reason, "incident_id": incident_id, "owner": owner,
                           "at": datetime.now(timezone.utc).isoformat()}).encode()

    async def _write(self, node: str, value: bytes, revision: int) -> bool:
        """create (revision 0) or update-with-revision. False when someone else wrote first."""
        from nats.js.errors import KeyWrongLastSequenceError

        kv = await self.kv()
        async with asyncio.timeout(self.op_timeout_s):
            try:
                if revision == 0:
                    await kv.create(node, value)
                else:
                    await kv.update(node, value, last=revision)
                return True
            except KeyWrongLastSequenceError:
                return False

    async def state(self, node: str) -> str:
        """`drained` or `in_service` (the standalone adapter has no inventory: any name is valid)."""
        entry, _ = await self._entry(node)
        return self.STATE_DRAINED if entry else self.STATE_IN_SERVICE

    async def drain(self, node: str, reason: str, incident_id: str) -> DrainResult:
        """Record `node` as drained by fleetmend unless any drain entry exists.

        Returns:
            `DrainResult` (same ownership semantics as `SlurmScheduler.drain`).
        Raises:
            SchedulerError: the KV write kept conflicting (5 attempts).
        """
        for _ in range(5):
            entry, rev = await self._entry(node)
            if entry:
                owned = entry.get("owner") == OWNER_FLEETMEND
                who = "fleetmend" if owned else f"the {entry.get('owner', 'operator')}"
                return DrainResult(node, True, owned, not owned, self.STATE_DRAINED,
                                   f"already drained by {who} (reason {entry.get('reason')!r}, "
                                   f"incident {entry.get('incident_id')}); no write",
                                   reason=entry.get("reason", ""), raw_state=json.dumps(entry))
            if await self._write(node, self._doc(reason, incident_id, OWNER_FLEETMEND), rev):
                return DrainResult(node, True, True, False, self.STATE_DRAINED,
                                   f"drain recorded in KV bucket {self.bucket}", reason=reason)
        raise SchedulerError(f"drain of {node}: KV bucket {self.bucket} kept changing under us (5 tries)")

    async def undrain(self, node: str, incident_id: str) -> UndrainResult:
        """Remove `node`'s entry if fleetmend owns it (delete with the read revision).

        Returns:
            `UndrainResult` as `SlurmScheduler.undrain`.
        Raises:
            SchedulerError: the entry kept changing (5 attempts).
        """
        from nats.js.errors import APIError

        kv = await self.kv()
        for _ in range(5):
            entry, rev = await self._entry(node)
            if not entry:
                return UndrainResult(node, False, self.STATE_IN_SERVICE, "not drained; nothing to resume")
            if entry.get("owner") != OWNER_FLEETMEND:
                return UndrainResult(node, False, self.STATE_DRAINED,
                                     f"drain is the {entry.get('owner')}'s (reason {entry.get('reason')!r}); "
                                     "left for the operator", operator_drained=True)
            try:
                async with asyncio.timeout(self.op_timeout_s):
                    await kv.delete(node, last=rev)
            except APIError as err:
                if err.err_code == _WRONG_LAST_SEQUENCE:
                    continue
                raise SchedulerError(f"undrain of {node} in KV bucket {self.bucket}: {err}") from err
            note = "" if entry.get("incident_id") == incident_id else f" (drain was set by incident {entry.get('incident_id')})"
            return UndrainResult(node, True, self.STATE_IN_SERVICE, f"drain entry removed{note}")
        raise SchedulerError(f"undrain of {node}: KV bucket {self.bucket} kept changing under us (5 tries)")

    async def operator_drain(self, node: str, reason: str) -> None:
        """An operator's drain (CLI `fleetmend drain`): owner "operator", never removed by `undrain`.
        Overwrites a fleetmend entry (the operator takes the drain over, as a new Slurm reason would)."""
        kv = await self.kv()
        async with asyncio.timeout(self.op_timeout_s):
            await kv.put(node, self._doc(reason, None, OWNER_OPERATOR))

    async def operator_undrain(self, node: str) -> bool:
        """An operator returns `node` to service whoever drained it. Returns False if it wasn't drained."""
        entry, _ = await self._entry(node)
        if not entry:
            return False
        kv = await self.kv()
        async with asyncio.timeout(self.op_timeout_s):
            await kv.delete(node)
        return True

    async def list_nodes(self) -> list[NodeInfo]:
        """The drained nodes (in-service nodes are not recorded)."""
        from nats.js.errors import NoKeysError

        kv = await self.kv()
        async with asyncio.timeout(self.op_timeout_s):
            try:
                keys = await kv.keys()
            except NoKeysError:
                return []
        rows = []
        for k in sorted(keys):
            entry, _ = await self._entry(k)
            if entry:
                rows.append(NodeInfo(k, self.STATE_DRAINED, entry.get("reason", ""), entry.get("owner"),
                                     entry.get("incident_id")))
        return rows


# --------------------------------------------------------------------------------------------------
# None


class NoopScheduler:
    """`scheduler = "none"`: remediation runs (diagnose, ticket) but nothing is ever drained."""

    name = "none"

    async def drain(self, node: str, reason: str, incident_id: str) -> DrainResult:
        return DrainResult(node, False, False, False, "unknown", "scheduler none: nothing drained")

    async def undrain(self, node: str, incident_id: str) -> UndrainResult:
        return UndrainResult(node, False, "unknown", "scheduler none: nothing to resume")

    async def state(self, node: str) -> str:
        return "unknown"

    async def list_nodes(self) -> list[NodeInfo]:
        return []


def build_scheduler(settings: Settings, js: JetStreamContext | None = None) -> SchedulerAdapter:
    """The adapter for `settings.scheduler`.

    Args:
        settings: process settings.
        js: JetStream context, required for `standalone`.
    Returns:
        `SlurmScheduler`, `StandaloneScheduler`, `KubernetesScheduler` (activities/kubernetes.py) or
        `NoopScheduler`.
    Raises:
        ConfigError: standalone without `js`, kubernetes without an API server configuration, or an
            unknown kind.
    """
    kind = settings.scheduler
    if kind == SchedulerKind.SLURM:
        return SlurmScheduler(settings.slurm)
    if kind == SchedulerKind.STANDALONE:
        if js is None:
            raise ConfigError("scheduler standalone keeps its drained set in JetStream; pass js= (a JetStream context)")
        return StandaloneScheduler(js)
    if kind == SchedulerKind.NONE:
        return NoopScheduler()
    if kind == SchedulerKind.KUBERNETES:
        from activities.kubernetes import KubernetesScheduler

        return KubernetesScheduler(settings.kubernetes)
    raise ConfigError(f"unknown scheduler {kind!r}; expected slurm, standalone, kubernetes, none")


# --------------------------------------------------------------------------------------------------
# Activities

_POLL_S = 1.0
"""Poll interval while waiting for DRAINING → DRAINED; slurmctld updates node state at once."""


class SchedulerActivities:
    """`drain_node` / `undrain_node` for the worker, bound to one adapter.

    Args:
        scheduler: any `SchedulerAdapter`.
    """

    def __init__(self, scheduler: SchedulerAdapter) -> None:
        self.scheduler = scheduler

    @activity.defn(name="drain_node")
    async def drain_node(self, req: DrainRequest) -> DrainResult:
        """Drain `req.node` (idempotent). With `req.wait_drained_s` > 0, heartbeat until it is drained.

        Raises:
            ApplicationError: type "NodeNotFound", non-retryable, for a node the scheduler doesn't know.
            SchedulerError: transient failure (Temporal retries).
        """
        log = activity.logger
        try:
            result = await self.scheduler.drain(req.node, req.reason, req.incident_id)
            activity.heartbeat({"phase": "drain_set", "state": result.state})
            deadline = time.monotonic() + req.wait_drained_s
            while result.owned and result.state.startswith("draining") and time.monotonic() < deadline:
                await asyncio.sleep(_POLL_S)
                result.state = await self.scheduler.state(req.node)
                activity.heartbeat({"phase": "waiting_for_jobs", "state": result.state})
        except NodeNotFoundError as err:
            raise ApplicationError(str(err), type="NodeNotFound", non_retryable=True) from err
        metrics.drain_result(req.cluster, self.scheduler.name, result, req.observed_at)
        log.info("drain_requested node=%s scheduler=%s drained=%s owned=%s operator_drained=%s state=%s: %s",
                 req.node, self.scheduler.name, result.drained, result.owned, result.operator_drained,
                 result.state, result.detail)
        return result

    @activity.defn(name="undrain_node")
    async def undrain_node(self, req: UndrainRequest) -> UndrainResult:
        """RESUME `req.node` if fleetmend owns its drain (idempotent; never an operator's drain).

        Raises:
            ApplicationError: type "NodeNotFound", non-retryable.
            SchedulerError: transient failure (Temporal retries).
        """
        try:
            result = await self.scheduler.undrain(req.node, req.incident_id)
        except NodeNotFoundError as err:
            raise ApplicationError(str(err), type="NodeNotFound", non_retryable=True) from err
        metrics.undrain_result(req.cluster, self.scheduler.name, result, req.drained_at)
        activity.heartbeat({"phase": "undrain_done", "state": result.state})
        activity.logger.info("undrain_requested node=%s scheduler=%s resumed=%s state=%s: %s",
                             req.node, self.scheduler.name, result.resumed, result.state, result.detail)
        return result
