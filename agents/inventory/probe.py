"""`InventoryProbe`: reads the node fingerprint and keeps it in JetStream (latest in a KV bucket, changes in a stream).

When: at start, every `agent.inventory_interval_s` (default 900 s), when the set of PCI functions, RDMA devices or
netdevs changes (what a udev add/remove leaves behind: `device_signature`, three directory listings polled every
`change_poll_s`), and right after a live fix (`reread`). Each read costs < 200 ms (bench/inventory_cost.py); between
reads the probe sleeps, so the agent stays well under 0.1 % of a core.

Where: `Fingerprint` → KV `FINGERPRINT_KV_BUCKET` key `fingerprint_kv_key(cluster, node)` (a put only when the
digest changed or the last put is older than the interval, so the bucket also says the agent is alive); a
`FingerprintChange` → `fleet.<cluster>.fingerprint.<node token>` (stream `FINGERPRINT_STREAM`) when the digest
differs from the last one published (the bucket's entry is the baseline after a restart). Never through Temporal.

NATS: the runner hands the connection over with `attach(nc)` once connected; until then fingerprints wait (only the
latest is kept: an older one says nothing the newer does not). The probe also answers live-fix requests
(`ReconfigureRequest`) on `subjects.reconfigure_subject` through `agents.commands.ReconfigureHandler`.

What a restart loses: nothing that matters — the first read after start is compared with the bucket's entry.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import structlog

from agents.commands import ReconfigureHandler
from agents.inventory.reader import device_signature, read_fingerprint
from fleetmend import __version__
from fleetmend.fingerprint import Fingerprint, fingerprint_change
from fleetmend.infra.jetstream import ensure_fingerprint_stores
from fleetmend.subjects import fingerprint_kv_key, fingerprint_subject, reconfigure_subject

CHANGE_POLL_S = 30.0
"""How often the device sets are compared (three listdirs): a hot-plugged or lost device shows within 30 s."""
PUBLISH_TIMEOUT_S = 5.0


def _reraise_cancel() -> None:
    """Raise CancelledError when this task is being cancelled: a cancel that lands as an `asyncio.timeout` expires
    can surface as TimeoutError (Python 3.11), and the loop must not swallow it."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class InventoryProbe:
    """Fingerprint reader and publisher of one node (see the module docstring).

    Args:
        host_root: the host's `/` (`agent.host_root`).
        interval_s: `agent.inventory_interval_s`.
        reconfigure: `policy.reconfigure` (False: live fixes are dry runs).
        nvml: `pynvml` or a stand-in for GPU settings and persistence-mode fixes; None leaves them out.
        peermem_command: how nvidia_peermem is loaded (default `modprobe nvidia-peermem`).
    """

    name = "inventory"

    def __init__(self, host_root: Path | str, cluster: str, node: str, *, interval_s: float = 900.0,
                 change_poll_s: float = CHANGE_POLL_S, reconfigure: bool = False, nvml: Any = None,
                 peermem_command: list[str] | None = None, agent_version: str = __version__) -> None:
        self.root = Path(host_root)
        self.cluster, self.node = cluster, node
        self.interval_s, self.change_poll_s = interval_s, change_poll_s
        self.nvml = nvml
        self.agent_version = agent_version
        self.nc: Any = None
        self.kv: Any = None
        self.last: Fingerprint | None = None
        """The last fingerprint published (or found in the bucket at start)."""
        self.pending: Fingerprint | None = None
        self.pending_by = f"agent:{agent_version}"
        self.published = 0
        self._wake = asyncio.Event()
        self._reread = False
        self._last_put = 0.0
        self._sub: Any = None
        self.fixer = ReconfigureHandler(self.root, cluster, node, enabled=reconfigure, nvml=nvml,
                                        peermem_command=peermem_command, on_applied=self.reread)
        self._log = structlog.get_logger("fleetmend.agent.inventory").bind(cluster=cluster, node=node)

    async def attach(self, nc: Any) -> None:
        """Take the NATS connection (called by the runner once connected): answer live fixes, publish."""
        self.nc = nc
        if self._sub is None:
            self._sub = await nc.subscribe(reconfigure_subject(self.cluster, self.node), cb=self._on_fix)
        self._wake.set()

    async def _on_fix(self, msg: Any) -> None:
        await self.fixer.answer(msg)

    def reread(self, seen_by: str = "") -> None:
        """Read again now (after a live fix: the change is recorded as seen by `seen_by`)."""
        self._reread = True
        if seen_by:
            self.pending_by = seen_by
        self._wake.set()

    async def read(self) -> Fingerprint:
        return await asyncio.to_thread(read_fingerprint, self.root, self.cluster, self.node, nvml=self.nvml,
                                       agent_version=self.agent_version)

    async def run(self, emit: Any) -> None:
        """Read, publish, wait for the interval, a device change or a reread; until cancelled."""
        signature = await asyncio.to_thread(device_signature, self.root)
        next_read = 0.0
        try:
            while True:
                now = time.monotonic()
                if now >= next_read or self._reread:
                    self._reread = False
                    self.pending = await self.read()
                    next_read = now + self.interval_s
                    self._log.info("fingerprint_read", read_ms=self.pending.read_ms, digest=self.pending.digest,
                                   settings=len(self.pending.settings))
                if self.pending is not None and self.nc is not None:
                    await self._publish(self.pending)
                self._wake.clear()
                wait_s = max(0.0, min(self.change_poll_s, next_read - time.monotonic()))
                try:
                    async with asyncio.timeout(wait_s):
                        await self._wake.wait()
                except TimeoutError:
                    _reraise_cancel()
                sig = await asyncio.to_thread(device_signature, self.root)
                if sig != signature:
                    signature = sig
                    self._log.info("devices_changed")
                    self.pending_by = f"agent:{self.agent_version} (device change)"
                    self._reread = True
        finally:
            if self._sub is not None:
                sub, self._sub = self._sub, None
                try:
                    async with asyncio.timeout(PUBLISH_TIMEOUT_S):
                        await sub.unsubscribe()
                except Exception:  # noqa: BLE001 - the connection may be closing already
                    pass

    async def _publish(self, fp: Fingerprint) -> None:
        """Put `fp` in the bucket and, when it differs from the last, its change in the stream. A failure keeps it
        pending (the next wake retries); it is logged, never raised."""
        try:
            async with asyncio.timeout(PUBLISH_TIMEOUT_S * 3):
                js = self.nc.jetstream(timeout=PUBLISH_TIMEOUT_S)
                if self.kv is None:
                    self.kv = await ensure_fingerprint_stores(js, timeout_s=PUBLISH_TIMEOUT_S)
                key = fingerprint_kv_key(self.cluster, self.node)
                if self.last is None:
                    self.last = await self._stored(key)
                change = fingerprint_change(self.last, fp, self.pending_by)
                stale = time.monotonic() - self._last_put >= self.interval_s
                if change is not None or stale:
                    await self.kv.put(key, fp.to_json_bytes())
                    self._last_put = time.monotonic()
                if change is not None:
                    await js.publish(fingerprint_subject(self.cluster, self.node), change.to_json_bytes(),
                                     headers={"Nats-Msg-Id": f"{self.node}:{change.digest_after}:{fp.read_at.isoformat()}"})
                    self._log.info("fingerprint_changed", digest=fp.digest, first=change.first,
                                   changed=sorted(change.changed), seen_by=change.seen_by,
                                   topology_changed=change.topology_changed)
        except Exception as err:  # noqa: BLE001 - NATS away or refused: kept pending, retried on the next wake
            _reraise_cancel()
            self._log.warning("fingerprint_not_published", error=repr(err)[:300])
            return
        self.last, self.pending = fp, None
        self.pending_by = f"agent:{self.agent_version}"
        self.published += 1

    async def _stored(self, key: str) -> Fingerprint | None:
        from nats.js.errors import KeyNotFoundError

        try:
            entry = await self.kv.get(key)
        except KeyNotFoundError:
            return None
        try:
            return Fingerprint.model_validate_json(entry.value) if entry.value else None
        except ValueError:
            return None
