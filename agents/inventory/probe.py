"""`InventoryProbe`: reads the node fingerprint and keeps it in JetStream (latest in a KV bucket, changes in a stream).

When: at start, every `agent.inventory_interval_s` (default 900 s), on a device add or remove (a uevent of the
`pci`, `net`, `infiniband` or `nvme` subsystem, `agents.udev.open_monitor`; debounced: the read waits until no
uevent came for `UDEV_DEBOUNCE_S`, at most `UDEV_MAX_DELAY_S` after the first, since a hot-plug is a burst of
them), when the set of PCI functions, RDMA devices or netdevs changes (the fallback where no uevent can be read:
`device_signature`, three directory listings polled every `change_poll_s`), and right after a live fix
(`reread`). Each read costs < 200 ms (bench/inventory_cost.py); between
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
from fleetmend.infra.jetstream import ensure_fingerprint_stores, open_fingerprint_stores
from fleetmend.subjects import fingerprint_kv_key, fingerprint_subject, reconfigure_subject

CHANGE_POLL_S = 30.0
"""How often the device sets are compared (three listdirs): without uevents, a hot-plugged or lost device shows
within 30 s."""
UDEV_DEBOUNCE_S = 2.0
"""Quiet time after the last uevent before the fresh read: a NIC's add is a pci, an infiniband and one or more
net uevents within a second; one read covers them."""
UDEV_MAX_DELAY_S = 10.0
"""A storm of uevents (a flapping device) still gets a read this long after its first uevent."""
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
        udev_source: where uevents come from (`agent.udev.source`: "auto", "udev", "kernel"); None reads none
            (the poll alone). A monitor that cannot be opened (no pyudev, no permission) leaves the poll, logged
            once as `udev_unavailable`.
    """

    name = "inventory"

    def __init__(self, host_root: Path | str, cluster: str, node: str, *, interval_s: float = 900.0,
                 change_poll_s: float = CHANGE_POLL_S, reconfigure: bool = False, nvml: Any = None,
                 peermem_command: list[str] | None = None, agent_version: str = __version__,
                 udev_source: str | None = "auto", udev_debounce_s: float = UDEV_DEBOUNCE_S,
                 create_stores: bool = True, udev_virtual: bool = False) -> None:
        self.root = Path(host_root)
        self.udev_virtual = udev_virtual
        """Also reread on uevents of virtual devices (`/devices/virtual/…`: veth, bridges). Off: a container host
        makes a veth per pod, none of them in the fingerprint, and a read per pod start would cost the node's
        cores what the fingerprint must not (the tests turn it on: a veth is the uevent a sandbox can make)."""
        self.create_stores = create_stores
        """Create the fingerprint stream and bucket when missing (an unsecured dev setup). A node with credentials
        may not (`fleetmend.infra.security`: the analyzer creates them): it only opens them, and while they are
        missing its fingerprint stays pending (retried on the next wake) instead of a refused create that the
        server logs as a publish violation."""
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
        self.udev_source, self.udev_debounce_s = udev_source, udev_debounce_s
        self.udev_listening = asyncio.Event()
        """Set once the uevent monitor is open (tests wait on it)."""
        self.reads = 0
        self.last_reason = ""
        """Why the last read was made (`start`, `interval`, `reread`, `udev add net veth0`, `device poll`)."""
        self._udev_first: float | None = None
        self._udev_last = 0.0
        self._udev_what = ""
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

    def _open_udev(self) -> Any:
        """The uevent monitor and its reader on this loop, or None (module docstring)."""
        if self.udev_source is None:
            return None
        from agents.udev import DEVICE_SUBSYSTEMS, open_monitor

        try:
            mon = open_monitor(self.udev_source, DEVICE_SUBSYSTEMS)
        except (ImportError, OSError, ValueError) as err:
            self._log.warning("udev_unavailable", error=repr(err)[:200], fallback_poll_s=self.change_poll_s)
            return None
        asyncio.get_running_loop().add_reader(mon.fileno(), self._on_uevent, mon)
        self.udev_listening.set()
        self._log.info("udev_listening", source=self.udev_source, subsystems=list(DEVICE_SUBSYSTEMS))
        return mon

    def _on_uevent(self, mon: Any) -> None:
        """Drain the monitor; an add or remove starts (or extends) the debounce window."""
        try:
            while (device := mon.poll(timeout=0)) is not None:
                if device.action not in ("add", "remove"):
                    continue
                if not self.udev_virtual and str(getattr(device, "device_path", "")).startswith("/devices/virtual/"):
                    continue  # veth/bridge churn: no device of the fingerprint
                now = time.monotonic()
                if self._udev_first is None:
                    self._udev_first = now
                    self._udev_what = f"udev {device.action} {device.subsystem} {device.sys_name}"
                self._udev_last = now
                self._wake.set()
        except OSError as err:  # the socket went away: the poll goes on
            self._log.warning("udev_read_failed", error=repr(err)[:200])

    def _udev_due(self, now: float) -> float | None:
        """Seconds until the debounced read is due (0: now), or None when no uevent waits."""
        if self._udev_first is None:
            return None
        return max(0.0, min(self._udev_last + self.udev_debounce_s, self._udev_first + UDEV_MAX_DELAY_S) - now)

    async def run(self, emit: Any) -> None:
        """Read, publish, wait for the interval, a uevent, a device change or a reread; until cancelled."""
        signature = await asyncio.to_thread(device_signature, self.root, self.udev_virtual)
        mon = self._open_udev()
        next_read = 0.0
        reason = "start"
        try:
            while True:
                now = time.monotonic()
                if now >= next_read or self._reread:
                    reason = reason if self._reread else ("start" if self.reads == 0 else "interval")
                    self._reread = False
                    self.pending = await self.read()
                    self.reads += 1
                    self.last_reason = reason
                    next_read = now + self.interval_s
                    self._log.info("fingerprint_read", read_ms=self.pending.read_ms, digest=self.pending.digest,
                                   settings=len(self.pending.settings), why=reason)
                    reason = "reread"
                if self.pending is not None and self.nc is not None:
                    await self._publish(self.pending)
                self._wake.clear()
                wait_s = max(0.0, min(self.change_poll_s, next_read - time.monotonic()))
                due = self._udev_due(time.monotonic())
                if due is not None:
                    wait_s = min(wait_s, due)
                try:
                    async with asyncio.timeout(wait_s):
                        await self._wake.wait()
                except TimeoutError:
                    _reraise_cancel()
                due = self._udev_due(time.monotonic())
                if due is not None:
                    if due > 0:
                        continue  # more uevents may follow: wait out the debounce
                    reason, self._udev_first = self._udev_what, None
                    self._log.info("devices_changed", by=reason)
                    self.pending_by = f"agent:{self.agent_version} ({reason})"
                    self._reread = True
                    signature = await asyncio.to_thread(device_signature, self.root, self.udev_virtual)
                    continue
                sig = await asyncio.to_thread(device_signature, self.root, self.udev_virtual)
                if sig != signature:
                    signature = sig
                    reason = "device poll"
                    self._log.info("devices_changed", by=reason)
                    self.pending_by = f"agent:{self.agent_version} (device change)"
                    self._reread = True
        finally:
            if mon is not None:
                try:
                    asyncio.get_running_loop().remove_reader(mon.fileno())
                except (OSError, ValueError, RuntimeError):
                    pass
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
                    self.kv = (await ensure_fingerprint_stores(js, timeout_s=PUBLISH_TIMEOUT_S) if self.create_stores
                               else await open_fingerprint_stores(js, timeout_s=PUBLISH_TIMEOUT_S))
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
