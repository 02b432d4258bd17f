"""Performance telemetry: the compact sample an agent publishes every `agent.perf.interval_s`.

Subject `fleet.<cluster>.perf.<node token>` (`subjects.perf_subject`), captured by the JetStream stream
`FLEET_PERF` (`jetstream.ensure_perf_stream`): file storage, limits retention, short max age
(`DEFAULT_PERF_MAX_AGE_S`). Never through Temporal: telemetry is a stream of numbers, not work.

Why a stream with a short max age rather than core NATS plus a key-value bucket of latest samples:
the analyzer judges a node over several windows, so a replica that restarts or takes over from its
peer needs the last minutes of samples, not only the latest one; a stream replayed from a start
time gives exactly that, a KV of latest values would not. The agent still publishes with a plain
core-NATS publish (no ack awaited, no spool: a lost sample is replaced a minute later), so the cost
on the node is that of core NATS, and the max age bounds what the server keeps (10,000 nodes at one
~1.5 KiB sample a minute and 15 min: ~220 MiB of file store).

Wire format: JSON (UTF-8), one `PerfSample` per message, `schema_version` = `PERF_SCHEMA_VERSION`;
fields left out are unknown (None), never zero. Unknown fields are ignored (forward compatible); a
newer schema_version is rejected, as with `FaultEvent`.

Units: clocks MHz, power W, temperature °C, link rates Gb/s, PCIe width in lanes, time fractions
0..1 of the sample interval; `*_delta` fields are counter increases since the previous sample (None
on the first sample or after a counter reset).

Imports only stdlib and pydantic (the contract never imports nats/temporalio).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from fleetmend.events import utcnow
from fleetmend.subjects import check_node_name

PERF_SCHEMA_VERSION = 1
"""Current telemetry schema. Additive fields do not bump it."""

DEFAULT_PERF_MAX_AGE_S = 900.0
"""How long the perf stream keeps a sample: 15 min is three analyzer windows of 5 min, enough for a
restarted or standby analyzer to rebuild its open window (longer memory lives in its KV state)."""

CLOCK_EVENT_REASONS = ("hw_slowdown", "hw_thermal", "sw_thermal", "power_brake", "sw_power_cap")
"""Keys of `GpuPerf.event_frac`: NVML clocks-event reasons (nvmlClocksEventReason*), each the
fraction of the interval the GPU's clocks were held down for that reason."""


MAX_COUNT = 2**53
"""Largest counter delta accepted (exact in a float; a real counter moves far less in an interval)."""

Frac = Annotated[float, Field(ge=0.0, le=1.0)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
TEMPERATURE_MIN_C, TEMPERATURE_MAX_C = -40.0, 150.0
"""A GPU's possible temperatures; the analyzer's `temperature_c` metric uses the same bounds."""
RATE_MAX_GBPS = 100_000.0
"""Above any port's rate; the analyzer's `port_rate_gbps` metric uses the same bound."""
MHz = Annotated[float, Field(ge=0.0, le=100_000.0)]


class _Part(BaseModel):
    """Every reading is checked at decode: a value that is not finite (NaN, ±inf) or physically
    impossible (a negative counter delta, a fraction above 1, a utilisation above 100 %) fails the
    whole sample with a `ValidationError` naming the field; the analyzer dead-letters it with that
    reason, so it never reaches a median."""

    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False)


class GpuPerf(_Part):
    """One GPU's sample. See module docstring for units; None = not readable on this GPU/driver."""

    index: int = Field(ge=0, le=1024)
    util_pct: float | None = Field(default=None, ge=0.0, le=100.0)
    sm_clock_mhz: MHz | None = None
    sm_clock_max_mhz: MHz | None = None
    event_frac: dict[str, Frac] = Field(default_factory=dict)
    """Reason (`CLOCK_EVENT_REASONS`) → fraction 0..1 of the interval. From NVML's cumulative
    counters where the driver has them (field values NVML_FI_DEV_CLOCKS_EVENT_REASON_*, ns;
    nvmlDeviceGetViolationStatus for power/thermal), else 1.0/0.0 from the instantaneous mask
    (nvmlDeviceGetCurrentClocksEventReasons) at sampling time."""
    power_w: float | None = Field(default=None, ge=0.0, le=100_000.0)
    power_limit_w: float | None = Field(default=None, ge=0.0, le=100_000.0)
    temperature_c: float | None = Field(default=None, ge=TEMPERATURE_MIN_C, le=TEMPERATURE_MAX_C)
    pcie_gen: int | None = Field(default=None, ge=0, le=64)
    pcie_gen_max: int | None = Field(default=None, ge=0, le=64)
    pcie_width: int | None = Field(default=None, ge=0, le=64)
    pcie_width_max: int | None = Field(default=None, ge=0, le=64)
    pcie_replay_delta: Count | None = None
    nvlink_up: int | None = Field(default=None, ge=0, le=1024)
    nvlink_total: int | None = Field(default=None, ge=0, le=1024)
    nvlink_crc_delta: Count | None = None
    nvlink_replay_delta: Count | None = None
    nvlink_recovery_delta: Count | None = None
    ecc_corrected_delta: Count | None = None


class PortPerf(_Part):
    """One IB/RoCE port (`kind="ib"`, name `<hca>/<port>`) or Ethernet netdev (`kind="nic"`)."""

    name: str = Field(max_length=256)
    kind: str = Field(default="ib", max_length=16)
    role: Literal["compute", "storage"] | None = None
    """`compute` (the GPUs' rails) or `storage` (a front-end/storage HCA): ports are compared role
    with role, so a compute port at half rate cannot hide behind a slower storage port. None (an
    older agent): compute. The agent calls the HCAs of the node's most common HCA model compute and
    the others storage."""
    rate_gbps: float | None = Field(default=None, ge=0.0, le=RATE_MAX_GBPS)
    width: int | None = Field(default=None, ge=0, le=64)
    """Lanes (the `4X` of `400 Gb/sec (4X NDR)`)."""
    symbol_error_delta: Count | None = None
    link_downed_delta: Count | None = None
    link_error_recovery_delta: Count | None = None
    xmit_wait_delta: Count | None = None
    """`port_xmit_wait`: ticks the port had data to send but no credits (congestion/back-pressure)."""
    rcv_errors_delta: Count | None = None


class HostPerf(_Part):
    cpus: int | None = Field(default=None, ge=0, le=1_000_000)
    cpu_throttle_delta: Count | None = None
    """Sum over CPUs of core_throttle_count + package_throttle_count increases (thermal throttling)."""
    cpu_freq_mhz: MHz | None = None
    """Mean current frequency (cpufreq scaling_cur_freq) over CPUs."""
    cpu_freq_nominal_mhz: MHz | None = None
    """Mean nominal frequency (cpufreq base_frequency, else cpuinfo_max_freq)."""


class HardwareClass(_Part):
    """What a node is compared by: nodes with equal `key` are peers."""

    gpu_model: str | None = None
    gpu_count: int = Field(default=0, ge=0, le=1024)
    driver: str | None = None
    vbios: str | None = Field(default=None, max_length=64)
    """GPU 0's VBIOS version (NVML `nvmlDeviceGetVbiosVersion`): not part of `key` (a firmware
    rollout does not split the class); the analyzer names a version whose holders are the outliers."""
    hca_model: str | None = None
    cpu_model: str | None = None

    @property
    def key(self) -> str:
        """`<gpu model>x<count>|<driver>|<hca model>`; a CPU-only node: `cpu:<cpu model>|<hca model>`."""
        if self.gpu_count and self.gpu_model:
            return f"{self.gpu_model}x{self.gpu_count}|{self.driver or '?'}|{self.hca_model or '-'}"
        return f"cpu:{self.cpu_model or '?'}|{self.hca_model or '-'}"


class PerfSample(BaseModel):
    """One node's telemetry over one interval.

    Fields:
        schema_version: `PERF_SCHEMA_VERSION`.
        cluster, node: where it was sampled; must match the subject.
        at: UTC end of the interval.
        interval_s: length of the interval the deltas and fractions cover (seconds).
        hw: `HardwareClass`.
        gpus, ports, host: the readings.
        agent_version: the agent that sampled.
    Raises (on parse): `pydantic.ValidationError`.
    """

    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False)

    schema_version: int = PERF_SCHEMA_VERSION
    cluster: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")
    node: str = Field(min_length=1, max_length=253)
    """Any node name `fleetmend.subjects.check_node_name` accepts (dots included)."""
    at: datetime = Field(default_factory=utcnow)
    interval_s: float = Field(gt=0, le=86400.0)
    hw: HardwareClass = Field(default_factory=HardwareClass)
    gpus: list[GpuPerf] = Field(default_factory=list, max_length=1024)
    ports: list[PortPerf] = Field(default_factory=list, max_length=1024)
    host: HostPerf = Field(default_factory=HostPerf)
    agent_version: str = "unknown"

    @field_validator("node")
    @classmethod
    def _node(cls, v: str) -> str:
        return check_node_name(v)

    @field_validator("schema_version")
    @classmethod
    def _known(cls, v: int) -> int:
        if v < 1 or v > PERF_SCHEMA_VERSION:
            raise ValueError(f"perf schema_version {v} is not understood by this reader (knows 1..{PERF_SCHEMA_VERSION})")
        return v

    @field_validator("at")
    @classmethod
    def _utc(cls, v: datetime) -> datetime:
        return v.replace(tzinfo=timezone.utc) if v.tzinfo is None else v.astimezone(timezone.utc)

    def to_json_bytes(self) -> bytes:
        """Compact wire form: None fields and empty dicts left out."""
        return self.model_dump_json(exclude_none=True).encode()

    @classmethod
    def from_json_bytes(cls, data: bytes) -> "PerfSample":
        """Parse one wire message. Raises `pydantic.ValidationError`."""
        return cls.model_validate_json(data)
