"""The drain-permit pool: the blast-radius budget, as a compare-and-set semaphore in JetStream KV.

Every drain fleetmend makes under a permit holds one slot here, whichever stage made it, and gives it
back with the permit; nothing else counts drains. So the budget and the rack cap hold across any number
of router replicas and workers, and `fleetmend breaker status` reads the truth.

- The router takes a slot (`by="router"`) for a node whose fault the catalog says must drain *now*
  (drain, urgency now, no history rule, no debounce), right before it cordons the node and before the
  incident exists: Temporal is off that path, so a storm's first drains do not wait for workflow starts
  (bench/RESULTS.md, "Quarantine latency"). Its incident later asks FleetGuard `preclaimed` and is adopted.
- FleetGuard takes the slots (`by="guard"`) of the queued nodes it grants, in its queue order, in the
  same write that publishes its settings (`publish(claims=...)`); the incident's `drain_node` then finds
  its slot held and cordons. A drain that finds no slot (a human freed it meanwhile) takes one again or
  waits (`activities.quarantine.PoolGate`).
- FleetGuard owns everything else and writes it (`publish`, from its `sync_permit_pool` activity):
  the budget and rack cap it computes, `open` (false while the breaker is tripped, the guard paused or
  the policy observe-only, with `why`), and the failure domains with an open infrastructure incident.
  The router claims only from an open pool and never for a node in a closed domain.
- A holder leaves when its incident gives the permit back (`release`: return to service, close,
  abort), or by hand (`fleetmend breaker release NODE`, which returns the node to service first).
  A holder whose incident is terminated or reset stays: its node is still cordoned, so it still counts.

One key per cluster in bucket `subjects.PERMIT_KV_BUCKET`, a JSON document (`PoolState`):

    {"budget": 20, "rack_cap": 2, "open": true, "why": "",
     "closed_domains": ["rack:r07"],
     "holders": {"gpu-001": {"rack": "r01", "by": "router", "at": 1764547200.0,
                             "fault": {"kind": "xid", "code": 79, ...}}}}

`fault` (router holders only) is the fault the router drained for, so that FleetGuard can open the
node's incident when it never started (`activities.fleetguard.FleetGuardActivities.reconcile_pool`).

No key (the guard has not published yet): the router claims nothing and sends the node to FleetGuard,
which publishes the pool when it starts.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import structlog
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from fleetmend import subjects
from fleetmend.infra.jetstream import kv_keys, open_kv_bucket
from fleetmend.infra.retry import LostRace, until_won

log = structlog.get_logger("fleetmend.infra.permit_pool")

BY_ROUTER = "router"
BY_GUARD = "guard"
CAS_ATTEMPTS = 64
"""Compare-and-set rounds before a claim gives up (`PoolBusyError`); each round is one KV read and one
conditional write, and only a writer that lost to another's write tries again (`fleetmend.infra.retry`)."""


def _cas_pause(lost: int) -> float:
    """Seconds after the `lost`-th lost compare-and-set round: uniform up to 2 ms × `lost`, 50 ms at most (the
    losers of one race do not all read again at once)."""
    return random.uniform(0, min(0.05, 0.002 * lost))


T = TypeVar("T")


class PoolBusyError(RuntimeError):
    """The key kept changing under us for `CAS_ATTEMPTS` rounds (transient: retry later)."""


@dataclass
class Holder:
    rack: str | None = None
    by: str = BY_ROUTER
    at: float = 0.0
    """Unix time of the claim (seconds)."""
    fault: dict[str, Any] | None = None
    """Router holders: the fault drained for (`FaultEvent` fields kind, code, component, device, severity,
    fault_class, event_id, observed_at, source, message), so an incident that never started can be opened."""


@dataclass
class PoolState:
    budget: int = 0
    rack_cap: int = 0
    open: bool = False
    why: str = ""
    closed_domains: list[str] = field(default_factory=list)
    holders: dict[str, Holder] = field(default_factory=dict)

    def in_rack(self, rack: str | None) -> int:
        return sum(1 for h in self.holders.values() if rack and h.rack == rack)

    def to_json(self) -> bytes:
        """The document as stored (compact JSON; holders written by hand, not `asdict`: every claim
        rewrites the whole document, so its cost is on the drain path)."""
        holders = {n: {"rack": h.rack, "by": h.by, "at": h.at, **({"fault": h.fault} if h.fault else {})}
                   for n, h in self.holders.items()}
        return json.dumps({"budget": self.budget, "rack_cap": self.rack_cap, "open": self.open, "why": self.why,
                           "closed_domains": self.closed_domains, "holders": holders},
                          separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "PoolState":
        d = json.loads(data)
        return cls(budget=int(d.get("budget", 0)), rack_cap=int(d.get("rack_cap", 0)), open=bool(d.get("open")),
                   why=str(d.get("why", "")), closed_domains=list(d.get("closed_domains") or []),
                   holders={n: Holder(**h) for n, h in (d.get("holders") or {}).items()})


@dataclass
class Claim:
    ok: bool
    reason: str
    new: bool = False
    """True when this call added the holder (False: it held already, or nothing was recorded)."""
    holders: int = 0
    budget: int = 0
    by: str = ""
    """Who holds the slot (`BY_ROUTER`, `BY_GUARD`) when ok."""


async def permit_bucket(js: Any, bucket: str = subjects.PERMIT_KV_BUCKET, timeout_s: float = 10.0) -> Any:
    """The pool's bucket, created on first use (file storage, history 1).

    Raises:
        TimeoutError: JetStream did not answer within `timeout_s`.
        nats.js.errors.APIError: the server refused (e.g. no JetStream in the account).
    """
    return await open_kv_bucket(js, bucket, "fleetmend drain permits: the blast-radius budget per cluster "
                                            "(FleetGuard + router)", timeout_s)


class PermitPool:
    """Claims and releases against one bucket (`permit_bucket`). Safe to share in one process and to run
    in any number of processes at once."""

    def __init__(self, kv: Any, js: Any = None, bucket: str = subjects.PERMIT_KV_BUCKET) -> None:
        self.kv = kv
        self.bucket = bucket
        self.js = js
        """JetStream, to list the wait keys (`waiting`); None: `waiting` returns {}."""
        self._waiting: dict[str, list[tuple[str, str | None, str, list[str], dict | None, asyncio.Future]]] = {}
        self._committers: dict[str, asyncio.Task[None]] = {}

    @classmethod
    async def open(cls, js: Any, bucket: str = subjects.PERMIT_KV_BUCKET) -> "PermitPool":
        return cls(await permit_bucket(js, bucket), js, bucket)

    async def _get(self, cluster: str) -> tuple[PoolState | None, int]:
        try:
            entry = await self.kv.get(subjects.permit_kv_key(cluster))
        except KeyNotFoundError:
            return None, 0
        if not entry.value:  # deleted (a tombstone)
            return None, entry.revision or 0
        return PoolState.from_json(entry.value), entry.revision

    async def _put(self, cluster: str, state: PoolState, revision: int) -> bool:
        """Write `state` if the key is still at `revision` (0: it must not exist). False: lost the race."""
        key = subjects.permit_kv_key(cluster)
        try:
            if revision:
                await self.kv.update(key, state.to_json(), last=revision)
            else:
                await self.kv.create(key, state.to_json())
        except KeyWrongLastSequenceError:
            return False
        return True

    async def _cas(self, cluster: str, change: Callable[[PoolState | None], tuple[PoolState | None, T]]) -> T:
        """Read the key, `change(state)` → (the state to write, or None to write nothing; the result), and
        write it only if the key is still at the revision read; on a lost race, read again.

        Raises:
            PoolBusyError: lost `CAS_ATTEMPTS` times in a row."""
        async def one_round() -> T:
            state, rev = await self._get(cluster)
            new, result = change(state)
            if new is None or await self._put(cluster, new, rev):
                return result
            raise LostRace(cluster)

        try:  # tenacity (`until_won`); a jittered pause after each lost round: up to 2 ms × rounds lost, 50 ms at most
            return await until_won(one_round, attempts=CAS_ATTEMPTS, pause=_cas_pause)
        except LostRace:
            raise PoolBusyError(f"permit pool of {cluster}: lost {CAS_ATTEMPTS} compare-and-set rounds in a row") \
                from None

    async def read(self, cluster: str) -> PoolState | None:
        """The cluster's pool, or None before FleetGuard first published it."""
        return (await self._get(cluster))[0]

    async def claim(self, cluster: str, node: str, rack: str | None, *, by: str = BY_ROUTER,
                    domains: list[str] | None = None, fault: dict[str, Any] | None = None) -> Claim:
        """Take a drain slot for `node` (idempotent: a holder is granted again).

        `by=BY_ROUTER` (a fault that must drain now) needs an open pool and none of `domains` closed, and
        records `fault`; `by=BY_GUARD` (a FleetGuard grant) only needs room. Both need fewer than `budget`
        holders and fewer than `rack_cap` in the node's rack.

        Claims made in this process while one is being written are decided together, in arrival order,
        and written with one compare-and-set (group commit): a storm's claims do not race each other
        for the key, and one round trip serves many of them.

        Returns:
            `Claim`: ok, or not with the reason (no pool yet, closed, budget, rack cap).
        Raises:
            PoolBusyError: lost the compare-and-set `CAS_ATTEMPTS` times in a row.
        """
        fut: asyncio.Future[Claim] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(cluster, []).append((node, rack, by, list(domains or []), fault, fut))
        if cluster not in self._committers:
            self._committers[cluster] = asyncio.create_task(self._commit(cluster))
        return await asyncio.shield(fut)

    async def _commit(self, cluster: str) -> None:
        """Write the waiting claims of `cluster`, a batch at a time, until none wait."""
        try:
            while self._waiting.get(cluster):
                batch = self._waiting.pop(cluster)
                try:
                    results = await self._claim_batch(cluster, [(n, r, b, d, f) for n, r, b, d, f, _fut in batch])
                except Exception as err:  # noqa: BLE001 - every claim of the batch gets it
                    for *_x, fut in batch:
                        if not fut.done():
                            fut.set_exception(err)
                    continue
                for (*_x, fut), res in zip(batch, results, strict=True):
                    if not fut.done():
                        fut.set_result(res)
        finally:
            self._committers.pop(cluster, None)

    async def _claim_batch(self, cluster: str,
                           reqs: list[tuple[str, str | None, str, list[str], dict | None]]) -> list[Claim]:
        def change(state: PoolState | None) -> tuple[PoolState | None, list[Claim]]:
            if state is None:
                return None, [Claim(False, "no permit pool yet (FleetGuard has not published one)") for _ in reqs]
            out = [self._decide(state, *req) for req in reqs]
            return (state if any(c.new for c in out) else None), out

        return await self._cas(cluster, change)

    @staticmethod
    def _decide(state: PoolState, node: str, rack: str | None, by: str, domains: list[str],
                fault: dict | None = None) -> Claim:
        """One claim against `state` (added to it when granted and new)."""
        held = len(state.holders)
        if node in state.holders:
            return Claim(True, "already holds a permit", holders=held, budget=state.budget, by=state.holders[node].by)
        if by == BY_ROUTER:
            if not state.open:
                return Claim(False, f"pool closed: {state.why}", holders=held, budget=state.budget)
            closed = sorted(set(domains) & set(state.closed_domains))
            if closed:
                return Claim(False, f"infrastructure incident open in {', '.join(closed)}", holders=held,
                             budget=state.budget)
        if held >= state.budget:
            return Claim(False, f"budget: {held}/{state.budget} permits held", holders=held, budget=state.budget)
        if rack and state.in_rack(rack) >= state.rack_cap:
            return Claim(False, f"rack {rack}: {state.in_rack(rack)}/{state.rack_cap} drained", holders=held,
                         budget=state.budget)
        state.holders[node] = Holder(rack=rack, by=by, at=time.time(), fault=fault if by == BY_ROUTER else None)
        return Claim(True, f"permit {held + 1}/{state.budget} ({by})", new=True, holders=held + 1,
                     budget=state.budget, by=by)

    async def note_waiting(self, cluster: str, node: str, reason: str, fault_class: str, severity: str,
                           fault: dict[str, Any] | None = None) -> None:
        """The router refused `node` a slot and is starting its incident: `fleetmend status` shows it as
        waiting, with `reason`, before the incident exists (in a burst the router starts incidents at the
        Temporal server's rate, and the guard takes their requests up later still). With `fault` (as
        `Holder.fault`), a key whose incident never starts (Temporal away past the router's deliveries)
        gets one from FleetGuard's reconciliation. A plain put per node, outside the pool's document.
        Raises what a KV put raises."""
        await self.kv.put(subjects.permit_wait_kv_key(cluster, node), json.dumps(
            {"reason": reason, "fault_class": fault_class, "severity": severity, "at": time.time(),
             **({"fault": fault} if fault else {})}, separators=(",", ":")).encode())

    async def clear_waiting(self, cluster: str, node: str) -> None:
        """`node`'s incident has started (or its fault was dead-lettered): its wait key goes. Idempotent."""
        try:
            await self.kv.delete(subjects.permit_wait_kv_key(cluster, node))
        except KeyNotFoundError:
            pass

    async def waiting(self, cluster: str | None = None) -> dict[tuple[str, str], dict[str, Any]]:
        """(cluster, node) → {reason, fault_class, severity, at} of the nodes the router refused a slot and
        has not started an incident for yet; `cluster` None: every cluster's."""
        if self.js is None:
            return {}
        out: dict[tuple[str, str], dict[str, Any]] = {}
        # every cluster's: the wait keys alone (`*.wait.*`), not the pools' documents and drains beside them
        keys = [k for k in await kv_keys(self.js, self.bucket, prefix=f"{cluster}.wait." if cluster else "*.wait.")
                if ".wait." in k]
        gate = asyncio.Semaphore(32)  # a burst leaves thousands of keys (deleted ones too): read them together

        async def read(key: str) -> None:
            async with gate:
                try:
                    entry = await self.kv.get(key)
                    where = subjects.parse_permit_wait_kv_key(key)
                except (KeyNotFoundError, ValueError):
                    return
            if entry.value:
                out[where] = json.loads(entry.value)

        await asyncio.gather(*(read(k) for k in keys))
        return out

    async def release(self, cluster: str, node: str) -> bool:
        """Give `node`'s slot back. Returns whether it held one. Idempotent.

        Raises:
            PoolBusyError: as `claim`."""
        def change(state: PoolState | None) -> tuple[PoolState | None, bool]:
            if state is None or node not in state.holders:
                return None, False
            del state.holders[node]
            return state, True

        return await self._cas(cluster, change)

    async def publish(self, cluster: str, *, budget: int, rack_cap: int, open: bool, why: str = "",
                      closed_domains: list[str] | None = None, held: dict[str, str | None] | None = None,
                      drop: list[str] | None = None,
                      claims: list[tuple[str, str | None]] | None = None) -> tuple[PoolState, list[Claim]]:
        """FleetGuard's write, one compare-and-set: budget, rack cap, open/why and closed domains replace
        what was there; `held` (node → rack: the guard's permit holders) become holders when the pool is
        new (a guard that rebuilt its holders from the running incidents); `drop` are removed; then each
        of `claims` (node, rack), in order, takes a slot while the budget and its rack cap leave room
        (`by="guard"`, whatever `open` says: the guard decided). Router holders stay (drained nodes).

        Returns:
            (the pool as written, one `Claim` per entry of `claims`).
        Raises:
            PoolBusyError: as `claim`."""
        def change(state: PoolState | None) -> tuple[PoolState, tuple[PoolState, list[Claim]]]:
            fresh = state is None
            state = state or PoolState()
            state.budget, state.rack_cap, state.open, state.why = budget, rack_cap, open, why
            state.closed_domains = sorted(closed_domains or [])
            now = time.time()
            for node, rack in (held or {}).items() if fresh else ():
                state.holders.setdefault(node, Holder(rack=rack, by=BY_GUARD, at=now))
            for node in drop or []:
                state.holders.pop(node, None)
            out = [self._decide(state, node, rack, BY_GUARD, []) for node, rack in claims or []]
            return state, (state, out)

        return await self._cas(cluster, change)


__all__ = ["BY_GUARD", "BY_ROUTER", "Claim", "Holder", "PermitPool", "PoolBusyError", "PoolState", "permit_bucket"]
