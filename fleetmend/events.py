"""The one event shape that crosses every boundary: probe → JetStream → router → workflow.

`FaultEvent` is built by probes, validated by the router and delivered to the node's
`NodeRemediation` workflow as the signal payload. There is no second internal shape.

Wire format: JSON (UTF-8), one object per NATS message, `schema_version` = `SCHEMA_VERSION`.
Unknown fields from newer agents are ignored (forward compatible); a message whose
`schema_version` is newer than this reader understands is rejected (dead-lettered) because its
meaning may have changed.

Imports only stdlib and pydantic (design rule: the contract never imports nats/temporalio).
"""

from __future__ import annotations

import os
import re
import time
from datetime import datetime, timedelta, timezone
from enum import StrEnum
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, field_validator

from fleetmend.subjects import check_node_name

SCHEMA_VERSION = 1
"""Current wire schema. Bump only for incompatible meaning changes; additive fields don't bump."""

MAX_RAW_BYTES = 16 * 1024
"""Longest `raw` text kept on an event (bytes of UTF-8). Longer evidence is truncated with a marker,
so one runaway register dump cannot exceed the NATS max payload (1 MiB default)."""


MAX_EVENT_BYTES = 64 * 1024
"""Largest wire message accepted (bytes); larger ones are dead-lettered. An event is < 20 KiB."""
MAX_JSON_DEPTH = 16
"""Deepest JSON nesting a wire message may have (a FaultEvent needs 2: event → device/attrs).
Deeper messages are dead-lettered before they are parsed (the decoder would recurse on them)."""
MAX_CLOCK_SKEW_S = 300.0
"""How far an agent's clock may run ahead of the router's. An `observed_at` later than the receipt
time plus this is clamped to the receipt time (`clamp_observed_at`), so a skewed or hostile clock
cannot place events in the future of every history window."""
OBSERVED_AT_RANGE = (datetime(1970, 1, 1, tzinfo=timezone.utc), datetime(9000, 1, 1, tzinfo=timezone.utc))
"""`observed_at` outside this range is invalid (dead-lettered): it could not be converted to UTC."""
CLAMPED_FROM_ATTR = "observed_at_agent"
"""`attrs` key that keeps the agent's original `observed_at` (ISO 8601) when it was clamped."""


class Component(StrEnum):
    """What part of the node a fault is about. Stable wire strings; never reuse a value."""

    GPU = "gpu"
    NVLINK = "nvlink"
    PCIE = "pcie"
    IB = "ib"
    NIC = "nic"
    NVME = "nvme"
    STORAGE = "storage"
    """Block devices, filesystems, md RAID and network storage (NFS) beside the NVMe controllers themselves."""
    CPU = "cpu"
    MEMORY = "memory"
    KERNEL = "kernel"
    AGENT = "agent"


class Severity(StrEnum):
    """How bad a reading is, from an operator's point of view.

    - info: nothing to do (also used for clearing events),
    - degraded: impaired but working, or the action is to restart the application,
    - fatal: device lost or untrustworthy until reset, reboot or replacement.
    """

    INFO = "info"
    DEGRADED = "degraded"
    FATAL = "fatal"

    @property
    def rank(self) -> int:
        """0 (info) < 1 (degraded) < 2 (fatal); for max() and ordering."""
        return _SEVERITY_RANK[self]

    @classmethod
    def worst(cls, *levels: "Severity | str") -> "Severity":
        """The most severe of `levels` (INFO when none): the one severity order, used everywhere."""
        return max((cls(x) for x in levels), key=lambda x: x.rank, default=cls.INFO)


_SEVERITY_RANK = {Severity.INFO: 0, Severity.DEGRADED: 1, Severity.FATAL: 2}


class Urgency(StrEnum):
    """How urgently a drain-worthy fault drains."""

    NOW = "now"
    WHEN_IDLE = "when_idle"
    """Running jobs finish first (a Slurm DRAIN already lets them); nothing is reset until idle."""


class Recovery(StrEnum):
    """What an incident tries after draining, before a vendor ticket (catalog `recovery`)."""

    RESET_GPU = "RESET_GPU"
    RESTART_BM = "RESTART_BM"
    RMA = "RMA"
    DIAGNOSE = "DRAIN_DIAGNOSE"
    """No automatic recovery: diagnose and file a ticket."""


class History(StrEnum):
    """The history rule (fleetmend/policy.py) that reads a fault class (catalog `history`)."""

    REPEATS = "repeats"
    SYMPATHETIC = "sympathetic"
    DBE = "dbe"
    REMAP_PENDING = "remap_pending"
    REMAP_FAILURE = "remap_failure"
    RATE = "rate"


class Verdict(BaseModel):
    """The catalog's decision about one event (`Catalog.verdict`), made once, by whoever builds the
    event (`Catalog.stamp`); every later stage reads it and none classifies again.

    Fields: severity; immediate_action (NVIDIA's for XIDs); fault_class (`xid79`, `aer_fatal`); drain
    (automation may take the node out of service); clearable (the kind has a clearing event: debounced);
    urgency, recovery, verify (agent checks that prove it gone; empty: every QUICK check), history (the
    history rule that reads it); source (the catalog row's citation); description.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    severity: Severity
    immediate_action: str
    investigatory_action: str = ""
    fault_class: str = ""
    drain: bool = False
    source: str = ""
    description: str = ""
    clearable: bool = False
    urgency: Urgency = Urgency.NOW
    recovery: Recovery = Recovery.DIAGNOSE
    verify: list[str] = Field(default_factory=list)
    history: History | None = None


class Source(StrEnum):
    """Which probe (or tool) produced the event."""

    KMSG = "kmsg"
    NVML = "nvml"
    UDEV = "udev"
    SYSFS = "sysfs"
    DCGM = "dcgm"
    HEARTBEAT = "heartbeat"
    INJECT = "inject"
    NVIDIA_SMI = "nvidia-smi"
    ANALYZER = "analyzer"
    """The fail-slow analyzer (peer comparison of telemetry), not a node's own probe."""
    SWEEP = "sweep"
    """`fleetmend sweep --act`: an outlier of an on-demand benchmark sweep."""


class Device(BaseModel):
    """The device a fault is about, as far as the text identifies it.

    `pci_bus_id` is lower-case `dddd:bb:dd.f` (the driver's `PCI:0000:3b:00` becomes `0000:3b:00.0`).
    `name` is a kernel name where there is no BDF (netdev `eth3`, `nvme2`, `mlx5_0`, `cpu7`).
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    index: int | None = None
    pci_bus_id: str | None = None
    uuid: str | None = None
    serial: str | None = None
    name: str | None = None
    port: int | None = None


class ConditionKey(NamedTuple):
    """Identity of one condition on one node: what repeats and clearing events of it share.

    `device` is the PCI bus id, else the kernel name, else the UUID, else `gpu:<index>` (the form the analyzer's
    findings name a GPU in), else None.
    A clearing event (`healthy=True`) has the key of the fault it clears. This is the one identity
    used everywhere: the agent's condition tracker, the router's coalescing, the workflow's records.
    """

    kind: str
    code: int | None
    device: str | None

    def __str__(self) -> str:
        code = "" if self.code is None else f":{self.code}"
        return f"{self.kind}{code}@{self.device or '-'}"


def device_label(device: "Device") -> str | None:
    """The one string that names a device in keys and records (see `ConditionKey`)."""
    label = device.pci_bus_id or device.name or device.uuid
    if label is None and device.index is not None:
        label = f"gpu:{device.index}"
    return label


def condition_key(ev: "FaultEvent") -> ConditionKey:
    """The `ConditionKey` of an event (healthy or not)."""
    return ConditionKey(ev.kind, ev.code, device_label(ev.device))


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_JSON_BRACKET = re.compile(rb"[\[\]{}]")


def json_nesting_depth(data: bytes) -> int:
    """How deeply the JSON text `data` nests arrays/objects (brackets inside strings ignored);
    computed with regular expressions only, so any depth is measured without recursion. When the
    text has no more brackets than `MAX_JSON_DEPTH`, their count is returned (an upper bound)."""
    if data.count(b"[") + data.count(b"{") <= MAX_JSON_DEPTH:
        return data.count(b"[") + data.count(b"{")  # an upper bound, within the limit
    depth = deepest = 0
    for b in _JSON_BRACKET.findall(_JSON_STRING.sub(b'""', data)):
        depth += 1 if b in (b"[", b"{") else -1
        deepest = max(deepest, depth)
    return deepest


def new_event_id(now_ns: int | None = None) -> str:
    """A unique, time-ordered id: 16 hex digits of UTC nanoseconds + 8 random hex digits.

    Lexicographic order equals time order (until the year 2554). Used as `Nats-Msg-Id`, so a
    re-sent event is deduplicated by JetStream and again by the workflow.
    """
    ns = time.time_ns() if now_ns is None else now_ns
    return f"{ns:016x}{os.urandom(4).hex()}"


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class FaultEvent(BaseModel):
    """One observation about one node (a fault, or with `healthy=True` the clearing of one).

    Fields:
        event_id: unique, time-ordered (`new_event_id`); the JetStream `Nats-Msg-Id`.
        schema_version: wire schema (`SCHEMA_VERSION`).
        cluster, node: where it was observed; must match the subject it was published on. The node
            is the scheduler's name as it is (`ip-10-0-1-23.ec2.internal`); subjects carry its token.
        component: `Component`.
        device: `Device` (index, PCI bus id, UUID/serial, kernel name) where known.
        kind: what was seen, snake_case and stable (`xid`, `gpu_fallen_off_bus`, `aer_fatal`,
            `ib_port_down`, `hung_task`, ...). The catalog is keyed by `kind` (+ `code`).
        code: numeric code where the kind has one (the XID number, SXid number).
        severity: `Severity`: the producer's reading (`verdict.severity` once classified).
        healthy: True for a clearing event of an earlier unhealthy `kind` on the same device.
        message: one readable line.
        observed_at: UTC time the agent observed it (kernel timestamps are often relative).
        source: `Source`.
        raw: the original text (all lines of a multi-line record), at most `MAX_RAW_BYTES`.
        agent_version: version of the agent that built the event.
        pid: process the event is attributed to (XID `pid=`), None when unknown.
        attrs: small extra decoded fields (e.g. NVLink5 `unit`, `rst`, `d_rst`), str/int/bool values.
        verdict: the catalog's `Verdict`, set once by the producer (`Catalog.stamp`); None from a
            producer that does not classify (an older agent, a hand-written event): the router stamps it.
    """

    model_config = ConfigDict(frozen=True, extra="ignore", use_enum_values=False)

    event_id: str = Field(default_factory=new_event_id, min_length=8, max_length=64)
    schema_version: int = SCHEMA_VERSION
    cluster: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")
    node: str = Field(min_length=1, max_length=253)
    """Any node name `fleetmend.subjects.check_node_name` accepts (dots included)."""
    component: Component
    device: Device = Field(default_factory=Device)
    kind: str = Field(min_length=1, max_length=64, pattern=r"^[a-z0-9_]+$")
    code: int | None = None
    severity: Severity
    healthy: bool = False
    message: str = Field(default="", max_length=4096)
    observed_at: datetime = Field(default_factory=utcnow)
    source: Source
    raw: str = ""
    agent_version: str = "unknown"
    pid: int | None = None
    attrs: dict[str, str | int | float | bool | None] = Field(default_factory=dict)
    verdict: Verdict | None = None

    @field_validator("node")
    @classmethod
    def _node(cls, v: str) -> str:
        return check_node_name(v)

    @field_validator("raw")
    @classmethod
    def _cap_raw(cls, v: str) -> str:
        data = v.encode("utf-8", "replace")
        if len(data) <= MAX_RAW_BYTES:
            return v
        return data[: MAX_RAW_BYTES - 32].decode("utf-8", "ignore") + "\n…[truncated by fleetmend]"

    @field_validator("observed_at")
    @classmethod
    def _utc(cls, v: datetime) -> datetime:
        try:
            out = v.replace(tzinfo=timezone.utc) if v.tzinfo is None else v.astimezone(timezone.utc)
        except OverflowError as err:
            raise ValueError(f"observed_at {v.isoformat()} is out of range when converted to UTC") from err
        if not OBSERVED_AT_RANGE[0] <= out < OBSERVED_AT_RANGE[1]:
            raise ValueError(f"observed_at {out.isoformat()} outside {OBSERVED_AT_RANGE[0].year}.."
                             f"{OBSERVED_AT_RANGE[1].year}")
        return out

    @field_validator("schema_version")
    @classmethod
    def _known_schema(cls, v: int) -> int:
        if v < 1 or v > SCHEMA_VERSION:
            raise ValueError(
                f"schema_version {v} is not understood by this reader (knows 1..{SCHEMA_VERSION}); "
                "upgrade the router/worker before the agents"
            )
        return v

    @property
    def condition(self) -> "ConditionKey":
        """Identity of the *condition* (not the occurrence): `condition_key(self)`."""
        return condition_key(self)

    def to_json_bytes(self) -> bytes:
        return self.model_dump_json(exclude_none=False).encode()

    @classmethod
    def from_json_bytes(cls, data: bytes) -> "FaultEvent":
        """Parse one wire message. Raises `pydantic.ValidationError` (or `UnicodeDecodeError`)."""
        return cls.model_validate_json(data)

    def clamp_observed_at(self, received_at: datetime, max_skew_s: float = MAX_CLOCK_SKEW_S) -> "FaultEvent":
        """This event, or a copy whose `observed_at` is `received_at` when the agent's time is more
        than `max_skew_s` later than `received_at` (the original goes to `attrs[CLAMPED_FROM_ATTR]`)."""
        if self.observed_at <= received_at + timedelta(seconds=max_skew_s):
            return self
        attrs = {**self.attrs, CLAMPED_FROM_ATTR: self.observed_at.isoformat()}
        return self.model_copy(update={"observed_at": received_at, "attrs": attrs})

    def summary(self) -> str:
        code = f" {self.code}" if self.code is not None else ""
        dev = self.device.pci_bus_id or self.device.name or self.device.uuid or ""
        state = "cleared" if self.healthy else self.severity.value
        return f"{self.kind}{code} {dev} ({state})".replace("  ", " ").strip()

    def as_dict(self) -> dict[str, Any]:
        """JSON-compatible dict (enums as strings, datetime ISO-8601)."""
        return self.model_dump(mode="json")
