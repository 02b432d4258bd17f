"""Agent → KV bucket and stream: a node's fingerprint (hardware class, versions, topology, settings).

The agent reads it from its host root (`agents.inventory.read_fingerprint`) at start, every
`agent.inventory_interval_s` and when the set of PCI/RDMA/network devices changes, and puts it in the
JetStream KV bucket `FINGERPRINT_KV_BUCKET` (latest per node, key `subjects.fingerprint_kv_key`); a
`FingerprintChange` (what changed, when, seen by which agent) goes to the stream `FINGERPRINT_STREAM`
on `fleet.<cluster>.fingerprint.<node token>` whenever the `digest` differs from the last one published.
Never through Temporal: it is state, not work. The drift judge (`fleetmend.analyzer.drift`) reads the
bucket and judges with the pure rules of `fleetmend.drift`.

Settings and versions are flat `key → value` strings; a key that is absent means "not applicable on this
node" (the file it is read from does not exist), never a deviation. Per-device keys carry the device's role
(`compute`, `storage`, `management`, `gpu`, `nvme`) in their name (`pcie.link.compute.0000:18:00.0`) so a
storage NIC is never compared with a compute NIC (NVSentinel's lesson, docs/fleet-shape.md).

Wire format: JSON, `schema_version` = `FINGERPRINT_SCHEMA_VERSION`; unknown fields ignored. Imports only stdlib,
pydantic and `fleetmend.events`, like `fleetmend.telemetry`: the agent imports it, and `fleetmend.messages` (which
re-exports these names through `fleetmend.fingerprint` for the workflows and activities) would bring
`temporalio` into every node's agent.
"""

import hashlib
from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from fleetmend.events import utcnow

FINGERPRINT_SCHEMA_VERSION = 1
"""Current fingerprint schema. Additive fields do not bump it."""

RECONFIGURE_ACTIVITY = "reconfigure_node"
"""Activity name of `activities.reconfigure.ReconfigureActivities.reconfigure_node` (to be listed in
`fleetmend.messages.names.Activity` when the remediation workflow calls it)."""


class TopoLevel(StrEnum):
    """The PCIe path between two devices, in `nvidia-smi topo -m`'s legend (best first).

    PIX: at most one PCIe switch between them; PXB: several bridges, no host bridge; PHB: through the PCIe host
    bridge (the CPU); NODE: between host bridges of one NUMA node; SYS: across the SMP interconnect (another
    NUMA node). Derived from the sysfs PCI ancestry (`agents.inventory.pci.topo_level`)."""

    PIX = "PIX"
    PXB = "PXB"
    PHB = "PHB"
    NODE = "NODE"
    SYS = "SYS"

    @property
    def rank(self) -> int:
        return list(TopoLevel).index(self)


class DeviceRole(StrEnum):
    """What a device is for; cohorts are keyed by hardware class and role.

    A NIC is `compute` when it is PIX/PXB from a GPU (GPU traffic leaves through it), `management` when it carries
    the default route, otherwise `storage` (NVSentinel's role signals: NUMA/PCIe locality, default route)."""

    GPU = "gpu"
    COMPUTE = "compute"
    STORAGE = "storage"
    MANAGEMENT = "management"
    NVME = "nvme"
    NODE = "node"
    """A node-wide setting (governor, THP, IOMMU)."""


class GpuPlacement(BaseModel):
    """One GPU and the devices its traffic should use: the nearest NIC and NVMe with their `TopoLevel`."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    pci_bus_id: str
    """`0000:18:00.0`."""
    numa_node: int | None = None
    """None where sysfs says -1 (unknown, common in VMs)."""
    local_cpulist: str | None = None
    nearest_nic: str | None = None
    nic_level: TopoLevel | None = None
    nearest_nvme: str | None = None
    nvme_level: TopoLevel | None = None


class NicInfo(BaseModel):
    """One network or RDMA function: its PCI address, RDMA device and netdevs, role and NUMA node."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    pci_bus_id: str
    role: DeviceRole
    numa_node: int | None = None
    ib_device: str | None = None
    """`mlx5_0`, from `/sys/bus/pci/devices/<bdf>/infiniband/`."""
    netdevs: list[str] = Field(default_factory=list)
    link_layer: str | None = None
    """`InfiniBand` or `Ethernet` (port 1)."""


class HardwareClass(BaseModel):
    """What makes nodes comparable: GPU model and count, board (DMI product), CPU model and sockets, HCA PSIDs."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    gpu_model: str = ""
    gpu_count: int = 0
    board: str = ""
    cpu_model: str = ""
    cpu_sockets: int = 0
    hca_models: list[str] = Field(default_factory=list)
    """Sorted distinct HCA PSIDs (`/sys/class/infiniband/<ib>/board_id`), e.g. `MT_0000000838`."""

    @property
    def key(self) -> str:
        """`H100 80GB HBM3 x8 | DGX H100 | Xeon Platinum 8480C x2 | MT_0000000838`: the cohort's class part."""
        parts = [f"{self.gpu_model or 'no-gpu'} x{self.gpu_count}", self.board or "unknown-board",
                 f"{self.cpu_model or 'unknown-cpu'} x{self.cpu_sockets}", ",".join(self.hca_models) or "no-hca"]
        return " | ".join(parts)


class Fingerprint(BaseModel):
    """A node's shape at `read_at`.

    Fields: `hardware` (the class), `versions` (key → version: `nvidia_driver`, `vbios`, `cuda`, `hca_fw`, `ofed`,
    `kernel`, `bios`), `gpus` and `nics` (placement), `topology_hash` (sha256 of the sorted
    `(gpu, numa, nearest NIC, level, nearest NVMe, level)` tuples, 16 hex), `settings` (key → value, see module
    docstring), `roles` (settings key → `DeviceRole`, for cohorts), `read_ms` (how long the read took).
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    schema_version: int = FINGERPRINT_SCHEMA_VERSION
    cluster: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")
    node: str = Field(min_length=1, max_length=253)
    read_at: datetime = Field(default_factory=utcnow)
    agent_version: str = "unknown"
    hardware: HardwareClass = Field(default_factory=HardwareClass)
    versions: dict[str, str] = Field(default_factory=dict)
    gpus: list[GpuPlacement] = Field(default_factory=list)
    nics: list[NicInfo] = Field(default_factory=list)
    topology_hash: str = ""
    settings: dict[str, str] = Field(default_factory=dict)
    roles: dict[str, DeviceRole] = Field(default_factory=dict)
    read_ms: float = 0.0
    serials: dict[str, str] = Field(default_factory=dict)
    """Device → identity that moves with the part: a GPU's PCI bus id → its UUID (`/proc/driver/nvidia/gpus/<bdf>/
    information`), an NVMe controller's bus id → its serial, an HCA's bus id → its node GUID. Not a fact (not
    judged, not in the `digest`: every part differs); the incident ledger compares it at the drain and at the
    return ("part not replaced")."""

    def facts(self) -> dict[str, str]:
        """Every judged fact as one flat map: `settings`, `version.<name>` and `topology.hash`."""
        out = dict(self.settings)
        out.update({f"version.{k}": v for k, v in self.versions.items()})
        if self.topology_hash:
            out["topology.hash"] = self.topology_hash
        return out

    def role_of(self, key: str) -> DeviceRole:
        """The role a fact belongs to (`DeviceRole.NODE` for node-wide facts and versions)."""
        return self.roles.get(key, DeviceRole.NODE)

    @property
    def digest(self) -> str:
        """sha256 (16 hex) of class, facts and topology: equal digests mean nothing changed."""
        h = hashlib.sha256(self.hardware.key.encode())
        for k, v in sorted(self.facts().items()):
            h.update(f"\0{k}={v}".encode())
        return h.hexdigest()[:16]

    def to_json_bytes(self) -> bytes:
        return self.model_dump_json().encode()


class FingerprintChange(BaseModel):
    """One change of a node's fingerprint, kept in `FINGERPRINT_STREAM`: who saw it, when, what changed.

    `changed` maps fact key → [before, after] (None = absent); `first` is true for the node's first fingerprint
    (nothing to compare with). `seen_by` is the agent (`agent:<version>`) or the actor of a live fix
    (`reconfigure:<incident id>`)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    schema_version: int = FINGERPRINT_SCHEMA_VERSION
    cluster: str
    node: str
    at: datetime = Field(default_factory=utcnow)
    seen_by: str
    digest_before: str | None = None
    digest_after: str
    first: bool = False
    changed: dict[str, list[str | None]] = Field(default_factory=dict)
    topology_changed: bool = False

    def to_json_bytes(self) -> bytes:
        return self.model_dump_json().encode()


def fingerprint_change(before: Fingerprint | None, after: Fingerprint, seen_by: str) -> FingerprintChange | None:
    """The `FingerprintChange` from `before` to `after`, or None when their digests are equal."""
    if before is not None and before.digest == after.digest:
        return None
    if before is None:
        return FingerprintChange(cluster=after.cluster, node=after.node, at=after.read_at, seen_by=seen_by,
                                 digest_after=after.digest, first=True)
    a, b = before.facts(), after.facts()
    changed: dict[str, list[str | None]] = {k: [a.get(k), b.get(k)] for k in sorted(a.keys() | b.keys())
                                            if a.get(k) != b.get(k)}
    return FingerprintChange(cluster=after.cluster, node=after.node, at=after.read_at, seen_by=seen_by,
                             digest_before=before.digest, digest_after=after.digest, changed=changed,
                             topology_changed=before.topology_hash != after.topology_hash)


class ReconfigureRequest(BaseModel):
    """→ the agent (`subjects.reconfigure_subject`): set these live settings and re-read them.

    `fixes` maps a settings key (`cpu.governor`, `gpudirect.peermem`, `kernel.numa_balancing`, `mm.thp_enabled`,
    `gpu.persistence_mode`, `irq.affinity.<role>.<bdf>`) to the wanted value; `dry_run` only says what would be
    written (`policy.reconfigure`, default dry-run like reboots)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    cluster: str
    node: str
    incident_id: str = ""
    fixes: dict[str, str]
    dry_run: bool = True
    timeout_s: float = Field(default=60.0, gt=0, le=600)
    """How long the activity waits for the agent's answer (a modprobe and a re-read take seconds)."""


class FixResult(BaseModel):
    """One key of a `ReconfigureReport`: what was found, wanted, written and read back."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    key: str
    before: str | None
    wanted: str
    after: str | None
    applied: bool
    """A write was made (False in dry-run, for an unknown key, or when it already held)."""
    verified: bool
    """A fresh read of the host root after the write equals `wanted`."""
    detail: str = ""


class ReconfigureReport(BaseModel):
    """The agent's answer to a `ReconfigureRequest`: one `FixResult` per key; `verified` when every key holds."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    node: str
    dry_run: bool
    results: list[FixResult] = Field(default_factory=list)
    error: str = ""

    @property
    def verified(self) -> bool:
        return not self.error and bool(self.results) and all(r.verified for r in self.results)
