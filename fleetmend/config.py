"""Operator configuration: one pydantic settings tree for every process.

Sources, highest precedence first: explicit overrides (CLI flags) → environment
(`FLEETMEND_<FIELD>`, nested with `__`, e.g. `FLEETMEND_SLURM__SCONTROL=/opt/slurm/bin/scontrol`)
→ TOML file (`--config FILE` or `FLEETMEND_CONFIG`) → defaults below.

Unknown keys are errors (a typo fails at startup, not silently). `fleetmend config check` prints
every error at once.
"""

from __future__ import annotations

import os
import re
import socket
import tomllib
from enum import StrEnum
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError

from fleetmend.errors import ConfigError
from fleetmend.subjects import check_node_name


def default_node_name() -> str:
    """This host's short name (up to the first dot, other characters than `[A-Za-z0-9_-]` made `-`).

    Only the default: `node` takes any Kubernetes or Slurm node name (`FLEETMEND_NODE`, `--node`).
    """
    name = socket.gethostname().split(".")[0] or "localhost"
    return re.sub(r"[^A-Za-z0-9_-]", "-", name)


def default_state_dir() -> Path:
    """`$XDG_STATE_HOME/fleetmend`, else `~/.local/state/fleetmend`."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "fleetmend"


class _Section(BaseModel):
    # inf and nan are refused in every float setting: `inf` as a timeout or a threshold never fires,
    # and nan compares false with everything (a budget check that is never true).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class SchedulerKind(StrEnum):
    STANDALONE = "standalone"
    SLURM = "slurm"
    KUBERNETES = "kubernetes"
    NONE = "none"


class TicketKind(StrEnum):
    LOCAL = "local"
    WEBHOOK = "webhook"
    JIRA = "jira"


class SlurmSettings(_Section):
    scontrol: str = "scontrol"
    """Path or name of `scontrol` (found on PATH)."""
    sinfo: str = "sinfo"
    """Path or name of `sinfo` (found on PATH)."""
    slurm_conf: str | None = None
    """Value for SLURM_CONF in the adapter's subprocesses; None keeps the environment's."""
    reason_prefix: str = "fleetmend:"
    """Drain reasons start with this; only nodes whose reason carries it are ever resumed (ownership)."""
    command_timeout_s: float = 30.0
    """scontrol is a single RPC to slurmctld; 30 s covers a busy controller."""


class TicketSettings(_Section):
    kind: TicketKind = TicketKind.LOCAL
    """Ticket filer: `local` (the ledger only), `webhook` (POST JSON to `webhook_url`) or `jira`."""
    webhook_url: str | None = None
    """Where the webhook filer POSTs each ticket and update as JSON."""
    webhook_timeout_s: float = 10.0
    """Bound on one webhook request."""
    webhook_headers: dict[str, str] = Field(default_factory=dict)
    """Extra HTTP headers of webhook requests (e.g. Authorization); shown as `***` by `config check`."""
    webhook_status_url: str | None = None
    """GET `{ticket_id}`-templated URL answering JSON with a `status` field: makes the webhook
    ticket's status pollable (`poll_ticket`). None: only the local ledger's status is known."""
    repaired_statuses: list[str] = Field(default_factory=lambda: ["Done", "Resolved", "Closed", "repaired"])
    """Remote ticket statuses that mean "repaired" for `poll_ticket` (compared case-insensitively)."""
    jira: "JiraSettings" = Field(default_factory=lambda: JiraSettings())
    ledger: str = Field("kv", pattern="^(kv|files)$")
    """Where the deployment's ticket ledger lives: `kv` (a JetStream KV bucket every worker replica and
    `fleetmend tickets` share) or `files` (JSON files under `state_dir/tickets`, one host only)."""


class JiraSettings(_Section):
    """Jira (Cloud or Data Center) REST API v2. Auth: `email` + `api_token` (Cloud, HTTP Basic) or
    `bearer_token` (Data Center personal access token)."""

    url: str | None = None
    """Base URL, e.g. https://example.atlassian.net (no trailing /rest)."""
    project: str = "OPS"
    """Jira project key issues are created in."""
    issue_type: str = "Bug"
    """Jira issue type of created issues."""
    email: str | None = None
    """Jira Cloud account e-mail (HTTP Basic with `api_token`)."""
    api_token: str | None = None
    """Jira Cloud API token (with `email`)."""
    bearer_token: str | None = None
    """Jira Data Center personal access token."""
    labels: list[str] = Field(default_factory=lambda: ["fleetmend"])
    """Labels on every issue; `fleetmend-incident-<hash>` is added per incident (idempotency key)."""
    transitions: dict[str, str] = Field(default_factory=lambda: {"resolved": "Done", "aborted": "Done"})
    """fleetmend ticket status → the Jira transition name to apply (others become comments only)."""
    timeout_s: float = 15.0
    """Bound on each REST call; Jira Cloud answers in < 2 s, attachments take longer."""
    max_attempts: int = 4
    """Tries for 5xx/429/connection errors (bounded, exponential backoff from 0.5 s)."""
    search_path: str = "/rest/api/2/search"
    """JQL search endpoint: Data Center `/rest/api/2/search`; Jira Cloud `/rest/api/3/search/jql`
    (the Cloud replacement; same `jql`, `fields`, `maxResults` parameters and `issues` answer)."""


TicketSettings.model_rebuild()  # resolve its "JiraSettings" reference (pydantic-settings warned on FLEETMEND_TICKETS__JIRA__*)


class KubernetesSettings(_Section):
    """The Kubernetes scheduler adapter (activities/kubernetes.py)."""

    kubeconfig: Path | None = None
    """kubeconfig file; None: $KUBECONFIG or ~/.kube/config (unless in a cluster)."""
    context: str | None = None
    """kubeconfig context; None: the file's current context."""
    in_cluster: bool | None = None
    """True: service-account config; None: auto (KUBERNETES_SERVICE_HOST set)."""
    api_url: str | None = None
    """Explicit API server URL without auth (kubectl proxy, tests); overrides the above."""
    taint_key: str = "fleetmend.io/fault"
    """NoSchedule taint put on a drained Node, valued with the fault class; undrain removes only this taint."""
    annotation_prefix: str = "fleetmend.io"
    """Prefix of the Node annotations fleetmend writes (`<prefix>/cordon-owner`, `/incident`, `/reason`,
    `/drained-at`)."""
    evict_timeout_s: float = 90.0
    """How long one drain retries evictions a PodDisruptionBudget refuses (429); below the workflow's
    2 min drain activity timeout. Pods left are reported; a retried drain carries on."""
    evict_retry_s: float = 5.0
    """Delay between eviction rounds (kubectl drain waits 5 s after a 429 too)."""
    request_timeout_s: float = 30.0
    """Bound on each API server request."""
    grace_period_s: int | None = None
    """Pod termination grace for evictions; None keeps each pod's own."""
    skip_namespaces: list[str] = Field(default_factory=lambda: ["kube-system"])
    """Namespaces whose pods a drain never evicts (system daemons that are not DaemonSets, and
    fleetmend's own pods: the Helm chart adds its release namespace). They stay on the cordoned node
    and do not keep it `draining`."""
    opt_out_label: str = "fleetmend.io/drain"
    """A Node labelled `<opt_out_label>=false` is never cordoned, tainted or evicted by fleetmend: its
    incidents run (diagnostics, tickets) and the drain reports the opt-out."""


class NotifySettings(_Section):
    """Notifications to humans (`activities/notify.py`): any of a JSON webhook, a Slack incoming
    webhook and PagerDuty Events API v2; none configured sends nothing. Each notification carries a
    deduplication key, and what a channel accepted is recorded in the `fleetmend_notified` KV
    bucket, so a retried activity never sends it twice (PagerDuty also deduplicates by `dedup_key`)."""

    webhook_url: str | None = None
    """POST JSON (the `Notification` fields) with `Idempotency-Key: <dedup_key>`."""
    webhook_headers: dict[str, str] = Field(default_factory=dict)
    """Extra HTTP headers of webhook notifications; shown as `***` by `config check`."""
    slack_webhook_url: str | None = None
    """A Slack incoming-webhook URL (https://hooks.slack.com/services/…)."""
    pagerduty_routing_key: str | None = None
    """Events API v2 integration key of the PagerDuty service."""
    pagerduty_url: str = "https://events.pagerduty.com/v2/enqueue"
    """PagerDuty Events API v2 endpoint."""
    events: list[str] = Field(default_factory=lambda: ["drained", "ticket_filed", "breaker_open", "lemon",
                                                       "returned", "version_finding", "attention"])
    """Which events are sent (drained, ticket_filed, breaker_open, lemon, returned, version_finding: a fault class
    concentrated on one driver/firmware value, from the incident ledger; attention: a fault that drains nothing
    but needs a person, e.g. cabling changed across a repair)."""
    pagerduty_events: list[str] = Field(default_factory=lambda: ["ticket_filed", "breaker_open", "lemon",
                                                                 "returned"])
    """Which events reach PagerDuty (a page): by default not every drain, only what needs a human
    (ticket, breaker, lemon) and the resolve on return to service."""
    timeout_s: float = Field(10.0, gt=0)
    """Per HTTP request (seconds); the activity's retry policy retries failures."""

    @property
    def any(self) -> bool:
        return bool(self.webhook_url or self.slack_webhook_url or self.pagerduty_routing_key)


class MetricsSettings(_Section):
    """Prometheus `/metrics` port per process; 0 turns it off. Distinct defaults let `dev up` run all."""

    host: str = "0.0.0.0"
    """Address the `/metrics`, `/healthz` and `/readyz` server listens on."""
    agent_port: int = Field(default=0, ge=0, le=65535)
    """The agent's `/metrics` port (`--metrics-port`); 0: off."""
    router_port: int = Field(default=0, ge=0, le=65535)
    """The router's `/metrics` port; 0: off."""
    worker_port: int = Field(default=0, ge=0, le=65535)
    """The worker's `/metrics` port; 0: off."""
    analyzer_port: int = Field(default=0, ge=0, le=65535)
    """The analyzer's `/metrics` port; 0: off."""
    poll_interval_s: float = 15.0
    """How often the worker/router refresh gauges from Temporal visibility and JetStream (a Prometheus
    scrape interval)."""


# -- agent probes: one section per probe kind (`agent.kmsg`, `agent.nvml`, ...), read by the probe registry
class KmsgProbeSettings(_Section):
    """`agent.kmsg`: the kernel-log probe (always on; `--kmsg-file` replays a file instead)."""

    path: Path = Path("/dev/kmsg")
    """Kernel log followed live (also what the diagnostics responder reads)."""


class NvmlProbeSettings(_Section):
    """`agent.nvml`: the NVML probe."""

    enabled: bool = True
    """Where `agent.host_root`'s PCI bus shows no NVIDIA GPU the probe does not apply (nothing published, NVML not
    loaded); without a driver it publishes one nvml_unavailable (degraded where GPUs are on the bus) and goes quiet."""
    poll_interval_s: float = 30.0
    """ECC/remap/PCIe/NVLink/clock reads: ~20 NVML calls per GPU, microseconds each; 30 s finds a pending
    remap long before a scheduler would place the next job (XIDs arrive as events, not by polling)."""
    retry_interval_s: float = 300.0
    """How often nvmlInit is retried while NVML is unavailable (a driver installed later is picked up)."""
    xid_events: bool = True
    """Also wait on NVML's XID event set (nvmlEventSetWait_v2) beside the kernel log."""
    xid_wait_ms: int = 1000
    """One event-set wait; bounds how long stop waits for the XID thread (1 s)."""
    pcie_gen_min_util_pct: int = 50
    """Judge a GPU's PCIe generation only at or above this utilization: an idle GPU drops to Gen1 on purpose."""
    temperature_max_c: int = 87
    """Temperature limit where the GPU reports no slowdown threshold (H100 slows down near 87-90 °C)."""
    nvlink_error_step: int = 100
    """An NVLink CRC/replay counter rising by this much within one poll is published (a DL recovery error always)."""


class SysfsProbeSettings(_Section):
    """`agent.sysfs`: the sysfs probe (IB ports, NIC carrier, PCIe links)."""

    enabled: bool = True
    """Run the sysfs probe when the agent runs live."""
    poll_interval_s: float = 30.0
    """IB port/NIC carrier/PCIe link reads: ~10 small sysfs reads per device; 30 s like NVML."""
    root: Path = Path("/")
    """Root the `sys/...` paths are read under (a container mounting the host's /sys elsewhere sets it);
    the perf sampler reads under it too."""
    ib_expected_rate_gbps: float | None = None
    """An ACTIVE IB port below this rate is degraded (e.g. 400 for NDR); None: rate not judged."""


class UdevProbeSettings(_Section):
    """`agent.udev`: the udev/uevent probe (PCI and netdev add/remove)."""

    enabled: bool = True
    """Run the udev probe when the agent runs live."""
    source: str = "auto"
    """auto ('udev' where /run/udev/control exists, else the kernel's own uevents), udev or kernel."""
    include_virtual_net: bool = False
    """Also report removal of virtual netdevs (veth, bridges); off: container churn is no fault."""

    @field_validator("source")
    @classmethod
    def _source(cls, v: str) -> str:
        if v not in ("auto", "udev", "kernel"):
            raise ValueError(f"unknown udev source {v!r}; expected auto, udev, kernel")
        return v


class LastbootProbeSettings(_Section):
    """`agent.lastboot`: what survived the previous boot, read once at start when the agent runs live."""

    enabled: bool = True
    """Publish a crash that survived the reboot (pstore, kdump, previous boot's journal) and unexpected reboots."""
    journal: bool = True
    """Also read the previous boot's kernel journal (`journalctl -k -b -1`; needs journalctl and a persistent journal)."""


class PerfProbeSettings(_Section):
    """`agent.perf`: performance telemetry for fail-slow detection (live agents only)."""

    enabled: bool = True
    """Publish a `PerfSample` on `fleet.<cluster>.perf.<node>` every `interval_s`."""
    interval_s: float = Field(default=60.0, gt=0)
    """60 s: a fail-slow lasts minutes to hours, so a minute resolves it while the sampler stays far below
    0.1 % of a core (~30 NVML calls per GPU and a few hundred small file reads a sample)."""


FLAT_PROBE_KEYS: dict[str, tuple[str, str]] = {
    "kmsg_path": ("kmsg", "path"),
    "nvml_enabled": ("nvml", "enabled"), "nvml_poll_interval_s": ("nvml", "poll_interval_s"),
    "nvml_retry_interval_s": ("nvml", "retry_interval_s"), "nvml_xid_events": ("nvml", "xid_events"),
    "nvml_xid_wait_ms": ("nvml", "xid_wait_ms"), "pcie_gen_min_util_pct": ("nvml", "pcie_gen_min_util_pct"),
    "gpu_temperature_max_c": ("nvml", "temperature_max_c"), "nvlink_error_step": ("nvml", "nvlink_error_step"),
    "sysfs_enabled": ("sysfs", "enabled"), "sysfs_poll_interval_s": ("sysfs", "poll_interval_s"),
    "sysfs_root": ("sysfs", "root"), "ib_expected_rate_gbps": ("sysfs", "ib_expected_rate_gbps"),
    "udev_enabled": ("udev", "enabled"), "udev_source": ("udev", "source"),
    "udev_include_virtual_net": ("udev", "include_virtual_net"),
    "lastboot_enabled": ("lastboot", "enabled"), "lastboot_journal": ("lastboot", "journal"),
    "perf_enabled": ("perf", "enabled"), "perf_interval_s": ("perf", "interval_s"),
}
"""Flat `agent.*` probe keys of earlier releases → (section, field). Still accepted (TOML, environment
`FLEETMEND_AGENT__NVML_ENABLED`, keyword arguments) and moved into their section; setting a flat key
and its sectioned spelling together is an error."""


class AgentSettings(_Section):
    heartbeat_interval_s: float = Field(default=10.0, gt=0)
    """10 s: a silent node is noticed within a minute at the router's default silence of 60 s."""
    spool_max_bytes: int = 64 * 1024 * 1024
    """64 MiB ≈ 100k events of ~600 B: hours of a fault storm while NATS is away."""
    publish_timeout_s: float = 5.0
    """Bound on one JetStream publish; a publish that fails or times out goes to the disk spool."""
    manage_stream: bool = True
    """Create the fault stream when it is missing (at start, or when NATS lost it). Node credentials
    from `fleetmend creds generate` set it to false: the router (or the operator) owns the stream."""
    cpu_affinity: list[int] | None = None
    """Housekeeping cores to pin the agent to (e.g. [0]); None leaves affinity alone."""
    nice: int = 10
    """Raised niceness so the agent never competes with the training job; 0 leaves it."""
    expected_gpus: int | None = None
    """Quick diagnostics fail when fewer GPUs are visible; None: fewer than the most this node has shown
    (kept in the agent's state directory) or than the NVIDIA GPUs on its PCI bus (`agents.diag`)."""
    host_root: Path = Path("/")
    """The host's `/` as the agent sees it (a container mounting the host at /host sets "/host"): pstore,
    kdump, journal files and /proc are read under it (the lastboot probe, the clean-stop record)."""
    inventory_interval_s: float = Field(default=900.0, gt=0)
    """Re-read and publish the node fingerprint (agents/inventory) this often; also at start and when the set of
    PCI/RDMA/network devices changes. 15 min: configuration drifts by hand or by a reboot, rarely faster, and a
    read costs < 200 ms (bench/inventory_cost.py). 0 is refused; turn it off with `agent.inventory_enabled`."""
    inventory_enabled: bool = True
    """Read and publish the node fingerprint (live agents only, like the hardware probes)."""
    # -- probes: hardware ones run when the agent runs live (no --once, no replayed file)
    kmsg: KmsgProbeSettings = Field(default_factory=KmsgProbeSettings)
    nvml: NvmlProbeSettings = Field(default_factory=NvmlProbeSettings)
    sysfs: SysfsProbeSettings = Field(default_factory=SysfsProbeSettings)
    udev: UdevProbeSettings = Field(default_factory=UdevProbeSettings)
    lastboot: LastbootProbeSettings = Field(default_factory=LastbootProbeSettings)
    perf: PerfProbeSettings = Field(default_factory=PerfProbeSettings)
    # -- benchmarks (`fleetmend sweep`, agents/bench.py)
    bench_command: list[str] = Field(default_factory=list)
    """Site benchmark for `fleetmend sweep`: argv whose stdout is one JSON object of named numbers (higher
    is better unless the name ends in `_s`, `_ms`, `_us` or contains `latency`/`time`). Empty: none."""
    bench_timeout_s: float = Field(default=120.0, gt=0)
    """Bound on one sweep benchmark run on this node (built-in checks and `bench_command` together)."""
    gpu_load_command: list[str] | None = None
    """Load generator for the sweep's GPU load step (argv; `{seconds}` is replaced by its run time), e.g.
    ["gpu_burn", "{seconds}"] or a site's torch one-liner. None: `gpu_burn` or `dcgmproftester13/12/11`
    when found on PATH; []: no load step. NVML is sampled while it runs (agents/bench.py)."""
    gpu_load_seconds: float = Field(default=10.0, gt=0, le=300)
    """Sampled window under load: 50 NVML samples at 5 a second; power brake and thermal slowdown
    show within seconds of full load. The step also waits (≤ 30 s) for the GPUs to get busy."""
    nvbandwidth_command: list[str] = Field(default_factory=lambda: ["nvbandwidth", "-t", "host_to_device_memcpy_ce",
                                                                    "device_to_host_memcpy_ce",
                                                                    "device_to_device_memcpy_read_ce"])
    """NVIDIA nvbandwidth for the sweep, run when its program is on PATH; [] turns it off."""
    sweep_dcgm_command: list[str] = Field(default_factory=lambda: ["dcgmi", "diag", "-r", "pcie", "-j", "-v"])
    """DCGM diagnostic whose JSON info lines give the sweep numbers (run when dcgmi is on PATH and the
    host engine answers); e.g. "-r", "pcie,memory_bandwidth" for more; [] turns it off."""

    @model_validator(mode="before")
    @classmethod
    def _flat_probe_keys(cls, data: Any) -> Any:
        """Move flat keys (`nvml_enabled`) into their section (`nvml.enabled`); see `FLAT_PROBE_KEYS`."""
        if not isinstance(data, dict) or not any(k in data for k in FLAT_PROBE_KEYS):
            return data
        data = dict(data)
        for flat, (section, field) in FLAT_PROBE_KEYS.items():
            if flat not in data:
                continue
            value = data.pop(flat)
            sec = data.get(section)
            if isinstance(sec, BaseModel):
                sec = sec.model_dump(exclude_unset=True)
            sec = dict(sec or {})
            if field in sec:
                raise ValueError(f"agent.{flat} and agent.{section}.{field} are the same setting; "
                                 f"set only agent.{section}.{field}")
            sec[field] = value
            data[section] = sec
        return data


class RouterSettings(_Section):
    fetch_batch: int = 100
    """fetch(100) + ack measured at ~12k msgs/s here, far above Temporal's rate; bigger gains nothing."""
    max_in_flight: int = 64
    """Concurrent signal-with-start calls; Temporal's dev server saturates near 64-100."""
    max_unacked: int = Field(default=20_000, ge=1)
    """Messages held un-acked while they wait for their node's turn. A backlog deeper than the
    fleet's node count lets each node's signal carry many events (bench/storm.py: 2,000 nodes).
    Memory: ~4 KiB a held message."""
    ack_wait_s: float = 60.0
    """JetStream ack wait of the router's consumer: a message not acked in this time is redelivered."""
    max_deliver: int = Field(default=50, ge=1)
    """After this many deliveries a message is dead-lettered (poison), not retried forever."""
    nak_delay_s: float = 2.0
    """Redelivery delay of a nak'ed message (Temporal away or slow), times the delivery count up to 10."""
    temporal_call_timeout_s: float = 15.0
    """Bound on one signal-with-start or other call to Temporal; past it the message is nak'ed."""
    heartbeat_silence_s: float = 60.0
    """An agent silent this long becomes an agent_silent fault (6 missed beats at the agent's default 10 s)."""


class StreamSettings(_Section):
    """JetStream streams and KV buckets fleetmend creates when they are missing (`fleetmend/infra/jetstream.py`).
    An existing stream or bucket is the operator's: never updated, a difference is one warning at start."""

    replicas: int = Field(default=1, ge=1, le=5)
    """Copies of each stream and of each KV bucket fleetmend creates (leases, permits, drains, tickets, ledger,
    analyzer, fingerprints: one setting for all), set before the first start: 3 on a three-node JetStream
    cluster (deploy/nats; `bench/chaos_cluster.py` runs one), 1 on one server. One already at another count
    stays so and is reported (`stream_settings_differ`, `bucket_settings_differ`): `nats stream edit NAME
    --replicas 3` (a bucket's stream is `KV_<bucket>`)."""
    fault_max_bytes: int = Field(default=4 * 1024**3, ge=1024 * 1024)
    """Bound of the fault stream (bytes): 4 GiB ≈ 4 million events of ~1 KiB; the oldest go first."""
    fault_max_age_s: float = Field(default=7 * 24 * 3600.0, gt=0)
    """Fault events older than this are removed (7 days: far beyond any router outage)."""
    fault_max_msgs_per_node: int = Field(default=100_000, ge=1000)
    """At most this many events per node subject: one node's storm drops its own oldest events,
    never other nodes' (100k ≈ an hour of a runaway 30 events/s flapping link)."""
    fault_max_msg_bytes: int = Field(default=256 * 1024, ge=64 * 1024)
    """Largest message the fault stream stores (an event is < 64 KiB; the server refuses larger)."""
    deadletter_max_bytes: int = Field(default=1024**3, ge=1024 * 1024)
    """Bound of the dead-letter stream (bytes); records carry at most 64 KiB of the original message."""
    deadletter_max_age_s: float = Field(default=30 * 24 * 3600.0, gt=0)
    """Dead letters older than this are removed (30 days)."""
    duplicate_window_s: float = Field(default=120.0, gt=0)
    """Nats-Msg-Id dedupe window of the fault stream (seconds)."""
class AnalyzerSettings(_Section):
    """The fail-slow analyzer (`fleetmend analyzer`, fleetmend/analyzer/): compares each node with its
    peers of the same hardware class (the hardware's own metrics) or of the same job (metrics that
    depend on the work), window by window, and reports a node that stays an outlier."""

    window_s: float = Field(default=300.0, gt=0)
    """One judgement per window: the node's value is the median of its samples in it, so one spiky
    sample cannot make an outlier. 5 min = 5 samples at the agent's default 60 s."""
    windows: int = Field(default=3, ge=1)
    """Consecutive outlier windows before `fail_slow` is raised (15 min by default): fail-slows last
    minutes to hours, a one-off (a job's checkpoint, a burst of congestion) does not persist."""
    min_samples_per_window: int = Field(default=3, ge=1)
    """A node with fewer samples of a metric in a window is not judged on it in that window."""
    min_group_size: int = Field(default=8, ge=3)
    """Fewer comparable nodes than this and the group is reported as too small (log + metric), not
    judged: a median of a handful of nodes says little about what is normal."""
    mad_k: float = Field(default=6.0, gt=0)
    """A value is an outlier when it is more than `mad_k` scaled MADs (1.4826·MAD ≈ σ for normal data)
    from the peer median in the bad direction AND beyond the metric's relative/absolute floors
    (analyzer/metrics.py). 6σ: at 10,000 nodes × 15 metrics × 288 windows a day, 4σ would still let
    through dozens of chance exceedances; persistence over `windows` removes the rest."""
    busy_util_pct: float = Field(default=50.0, ge=0, le=100)
    """A sample is busy when its GPUs' median utilization is at least this; load-dependent metrics
    (clocks, temperature, power cap, PCIe generation, port_xmit_wait) compare busy samples only."""
    grace_s: float = Field(default=90.0, ge=0)
    """A window is judged this long after it ends, so samples in flight still count."""
    reopen_after_s: float = Field(default=24 * 3600.0, gt=0)
    """The same node and metric is reported again only after this long (each report can cost a drain)."""
    min_ratio_sm_clock: float = Field(default=0.03, ge=0)
    """SM clock ratio: at least 3 % below the busy peers' median (boost clocks of healthy GPUs of one
    model spread by ~1 %; a 5 % slower node is what a synchronous job notices)."""
    lease_ttl_s: float = Field(default=15.0, gt=0)
    """Active-replica lease in the KV bucket: renewed every third of this; a standby takes over when it
    has not been renewed for this long."""
    sweep_outlier_pct: float = Field(default=5.0, gt=0, lt=100)
    """`fleetmend sweep`: a node more than this far below the sweep's median on any metric is flagged
    (5 %: what a synchronous job notices; the built-in host checks repeat within ~2 % on an idle node)."""
    sweep_deadline_s: float = Field(default=60.0, gt=0)
    """`fleetmend sweep`: each agent answers within this; nodes that do not are listed, not waited on."""
    job_min_ranks: int = Field(default=4, ge=2)
    """A job's step times are compared across ranks only with at least this many ranks reporting."""
    job_slow_ratio: float = Field(default=1.05, gt=1)
    """A rank whose median step time over a window, divided by its own offset (`job_baseline_windows`),
    is this much above the job's median so divided (and beyond `mad_k` MADs) is slow in that window;
    `windows` slow windows in a row → fail_slow on its node."""
    job_baseline_windows: int = Field(default=3, ge=1)
    """A rank's own offset against its job's median is learnt over its first this many windows in the
    job and removed from then on: ranks may be uneven by design (rank 0 10 % slower), so a rank is slow
    only against its own start in the job; one slow from the start is not found from step times. The
    same for a node's role on each work-dependent metric of its job (power cap share, clocks and
    temperature under load, IB wait, CPU frequency: a prefill stage, a parameter server, a data loader),
    whose offset is its difference from the job's median (`fleetmend.analyzer.core`, rule 5b)."""


class LedgerSettings(_Section):
    """The incident ledger (`fleetmend.ledger`) and `fleetmend report`."""

    max_age_days: float = Field(default=400.0, gt=0)
    """Days the ledger keeps a record (JetStream KV bucket `fleetmend_ledger`): beyond Temporal's retention
    (`temporal_retention_days`), so a year's compute lost can be counted; 400 days covers a year plus a quarter."""
    max_bytes: int = Field(default=2 * 1024**3, ge=64 * 1024 * 1024)
    """Byte limit of the ledger bucket: ~2 KB a record (head ~0.8 KB, detail ≤ ~5 KB), so 2 GiB holds ≥ 400,000
    incidents; the oldest go first beyond it. Read at creation only (an existing bucket is the operator's)."""
    default_gpus_per_node: int = Field(default=8, ge=1)
    """GPUs counted for a node whose fingerprint was not known at the drain (an HGX/DGX node has 8)."""
    finding_p: float = Field(default=0.01, gt=0, lt=1)
    """A version finding needs p × the number of tests made ≤ this (one-sided hypergeometric, Bonferroni)."""
    finding_min_nodes: int = Field(default=3, ge=1)
    """...and at least this many faulty nodes holding the value (a pattern a vendor can act on)."""
    findings_window_days: float = Field(default=30.0, gt=0)
    """The worker's elected replica looks for version findings (and exports the report's gauges) over this many
    days, every `refresh_s`; each new finding is notified once (`version_finding`)."""
    refresh_s: float = Field(default=600.0, gt=0)
    """How often the elected worker replica reads the ledger for the gauges and findings (a read of 100,000
    records takes seconds: bench/RESULTS.md)."""
    pack_interval_s: float = Field(default=600.0, gt=0)
    """How often the worker's elected replica (lease `ledger-pack`) rolls the cluster's closed records up into
    packs of up to 2,000 (`pack.<cluster>.<close day>.<part>`): what keeps a report over 100,000 records within
    seconds. Open records stay individual; a record closed since the last roll-up is read on its own until the
    next."""


class WorkerSettings(_Section):
    """The Temporal worker process (`fleetmend/worker/`)."""

    max_concurrent_workflow_tasks: int = Field(default=8, ge=2)
    """Workflow activations run at once. They share one GIL, so more at once only makes each take
    longer; past 2 s the SDK's deadlock detector fails an activation (TMPRL1101), and under the
    storm bench with the SDK's default of 100 the worker failed hundreds of tasks and stalled.
    8 keeps the worker's throughput (it is CPU-bound either way) and each activation short."""
    max_cached_workflows: int = Field(default=300, ge=0)
    """Workflow runs kept in memory between tasks (sticky cache; an evicted run replays its history
    on its next task). The worker holds ~0.1–0.45 MiB per cached run, growing with what the run has
    absorbed, so this bounds the worker's memory when many incidents are open (a fault storm); a run
    continues-as-new by history bytes, which bounds the replay of an evicted one. bench/storm.py
    prints the worker's peak RSS with 2,000 open incidents (bench/RESULTS.md, "Worker memory")."""
    max_concurrent_activities: int = Field(default=100, ge=1)
    """Activities the worker runs at once (drains, diagnostics requests, tickets)."""


class PolicySettings(_Section):
    """Knobs the NodeRemediation workflow reads (sent as workflow input, so history is self-contained)."""

    observe_only: bool = False
    """Classify and record everything, drain nothing (shadow mode for new rules)."""
    repair_escalation_s: float = 3 * 24 * 3600.0
    """Waiting for repair longer than this escalates the ticket (3 days: a vendor RMA SLA)."""
    settle_s: float = 0.0
    """Clean period after verification before return to service."""
    diag_timeout_s: float = Field(default=120.0, gt=0)
    """Bound on one diagnostics request to a node's agent."""
    close_after_idle_s: float = 3600.0
    """A record-only incident (no drain) closes after this long without new faults."""

    # --- blast radius (FleetGuard, one per cluster) -------------------------------------------
    max_drained_nodes: int = Field(default=20, ge=1)
    """Most nodes automation holds drained at once in a cluster. 20: a human should look before more go."""
    max_drained_percent: float = Field(default=10.0, gt=0, le=100)
    """…and at most this share of the cluster's known nodes (topology file, `cluster_nodes`, nodes seen);
    the smaller limit wins, never below 1. 10 %: a training job of 90 % of the fleet still fits."""
    max_drained_per_rack: int = Field(default=2, ge=1)
    """Per rack (topology file): 2, so a rack-level event shows as an infrastructure incident
    (`domain_incident_nodes`) before it empties the rack."""
    cluster_nodes: int | None = Field(default=None, ge=1)
    """Known node count when no topology file lists them; None: topology size, else nodes seen."""
    topology_file: Path | None = None
    """TOML `[node.NAME] rack/leaf/pdu` (fleetmend/policy.py `Topology`); loaded by the worker."""
    breaker_distinct_nodes: int = Field(default=10, ge=1)
    """Breaker trips when drain-worthy faults come from MORE than this many distinct nodes within
    `breaker_window_s`; 10 in 10 min is far above a healthy fleet's rate (~1/day per 1k GPUs)."""
    breaker_window_s: float = Field(default=600.0, gt=0)
    """Window of `breaker_distinct_nodes` (seconds)."""
    domain_incident_nodes: int = Field(default=3, ge=2)
    """This many distinct nodes faulting under one rack/leaf/PDU within `domain_window_s` become one
    infrastructure incident: no further drains there, a ticket pages a human."""
    domain_window_s: float = Field(default=300.0, gt=0)
    """Window of `domain_incident_nodes` (seconds)."""
    # --- history rules (NodeRemediation) --------------------------------------------------------
    debounce_s: float = Field(default=30.0, ge=0)
    """A fault whose kind has a clearing event (link down, GPU missing) waits this long; if it clears
    first nothing drains. 30 s covers an IB port retrain or a udev remove/add cycle."""
    app_xid_repeats: int = Field(default=3, ge=2)
    """XID 13/31 this often on the same GPU within `app_xid_window_s` → hardware suspect."""
    app_xid_window_s: float = Field(default=3600.0, gt=0)
    """Window of `app_xid_repeats` (seconds; 1 hour)."""
    sbe_events_per_window: int = Field(default=10, ge=1)
    """SBE (volatile) events within `sbe_window_s` that mean a rising rate → drain when idle."""
    sbe_window_s: float = Field(default=3600.0, gt=0)
    """Window of `sbe_events_per_window` (seconds; 1 hour)."""
    lemon_repairs: int = Field(default=2, ge=1)
    """The same fault class returning after this many repairs within `lemon_window_s` → RMA."""
    lemon_window_s: float = Field(default=30 * 24 * 3600.0, gt=0)
    """30 days: a part that fails again within a month of two repairs is the part, not bad luck."""
    repeat_part_window_days: float = Field(default=30.0, gt=0)
    """The same part (a GPU's UUID or serial, from the node's fingerprint) failing again with the same fault class
    within this many days goes to RMA like a lemon (the incident ledger, `fleetmend.ledger.repeat_part`): a repair
    that did not replace the part did not repair it. 30 days, the lemon rule's window."""
    # --- recovery before RMA ------------------------------------------------------------------
    recovery_settle_s: float = Field(default=120.0, ge=0)
    """After a GPU reset or reboot, wait this long (for late XIDs, driver re-init) before verifying."""
    close_info_after_s: float = Field(default=300.0, ge=0)
    """An incident that holds only info readings or clearings (an agent that came back, a link that
    went ACTIVE) closes after 5 min quiet instead of `close_after_idle_s`: nothing to act on, and it
    should not sit in `fleetmend status`. 0 = no special case."""
    ticket_poll_s: float = Field(default=900.0, ge=0)
    """While awaiting repair, poll the ticket (Jira status, webhook status URL, local ledger) this
    often; a status in `tickets.repaired_statuses` counts as `fleetmend repaired`. 15 min: a repair
    takes hours, and each poll is one Temporal activity per waiting node. 0 = off."""
    # --- drain permits: reconciling FleetGuard with the incidents --------------------------------
    permit_rerequest_s: float = Field(default=120.0, gt=0)
    """An incident still waiting for its drain permit asks FleetGuard again this often (a guard that
    was terminated or reset rebuilds its queue; the request is idempotent)."""
    permit_reconcile_s: float = Field(default=60.0, gt=0)
    """FleetGuard checks this often that every node holding a slot of the permit pool, or queued for
    one, still has a running incident. A queued request whose incident is gone is withdrawn; a slot
    held longer than this whose incident never started (the router drained the node, then Temporal
    stayed away past its deliveries, or the router died between cordon and signal) gets its incident;
    a slot whose incident was terminated or reset keeps counting against the budget (the node is still
    cordoned) until `fleetmend breaker release NODE` returns it to service. So a cordon outlives its
    incident by at most about twice this."""
    reconfigure: bool = False
    """Agent side: apply live configuration fixes (governor, nvidia_peermem, NUMA balancing, THP, IRQ affinity,
    persistence mode) asked for by a `config_drift` incident. False (the default) = dry run: the agent answers
    what it would write and writes nothing, like `reboot_command`."""
    reboot_command: list[str] = Field(default_factory=list)
    """Agent side: argv the agent runs for a reboot request, e.g. ["systemctl", "reboot"]. Empty (the
    default) = dry run: the agent answers what it would do and reboots nothing, so `dev up` never
    reboots the dev box."""
    gpu_reset_command: list[str] = Field(default_factory=lambda: ["nvidia-smi", "-r", "-i"])
    """Agent side: argv for a GPU reset; the PCI bus id is appended. Runs only when no process holds the GPU."""


def policy_default(name: str) -> Any:
    """The default of `PolicySettings.<name>`: every other shape of policy takes its defaults from here."""
    f = PolicySettings.model_fields[name]
    return f.default_factory() if f.default_factory is not None else f.default  # type: ignore[call-arg]


class TlsSettings(_Section):
    """TLS for one client connection (NATS or Temporal). Files are PEM.

    Enabled when `enabled` is true, when any file is set, or (NATS) when the URL scheme is `tls://`.
    """

    enabled: bool = False
    """Use TLS even with no file set (the system trust store checks the server)."""
    ca_file: Path | None = None
    """CA bundle that signed the server's certificate; None uses the system trust store."""
    cert_file: Path | None = None
    """Client certificate (mutual TLS); set together with `key_file`."""
    key_file: Path | None = None
    """Private key of `cert_file`."""
    server_name: str | None = None
    """Name to verify the server certificate against (SNI) when it differs from the host dialled."""

    @model_validator(mode="after")
    def _pair(self) -> "TlsSettings":
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together (mutual TLS): set both or neither")
        return self

    @property
    def active(self) -> bool:
        return self.enabled or any(f is not None for f in (self.ca_file, self.cert_file, self.key_file))


class Settings(BaseSettings):
    """Every process's configuration. See module docstring for sources and precedence."""

    model_config = SettingsConfigDict(
        env_prefix="FLEETMEND_", env_nested_delimiter="__", extra="forbid", validate_default=True,
        allow_inf_nan=False,
    )

    cluster: str = "local"
    """Cluster name: letters, digits, `-` and `_` (it becomes a NATS subject token), at most 128 characters."""
    node: str = Field(default_factory=default_node_name)
    """This node's name: any Kubernetes or Slurm node name, dots included; subjects and KV keys carry it encoded
    (`fleetmend.subjects.node_token`)."""
    nats_url: str = "nats://127.0.0.1:4222"
    """NATS server URL(s): `nats://`, `tls://`, `ws://` or `wss://`, comma-separated for a cluster; user and
    password may be in the URL."""
    nats_user: str | None = None
    """NATS user (with `nats_password`), when not in the URL."""
    nats_password: str | None = None
    """NATS password for `nats_user`."""
    nats_creds: Path | None = None
    """NATS `.creds` file (JWT + nkey seed; operator/JWT deployments)."""
    nats_nkey_seed: Path | None = None
    """File holding this process's nkey seed (`SU...`), as written by `fleetmend creds`."""
    nats_inbox_prefix: str | None = None
    """Reply-inbox prefix; a node's credentials only let it read `_INBOX.<cluster>.<node token>.>`.
    The agent with an nkey seed or creds file and no prefix set uses `subjects.inbox_prefix(cluster, node)`."""
    nats_tls: TlsSettings = Field(default_factory=TlsSettings)
    temporal_tls: TlsSettings = Field(default_factory=TlsSettings)
    nats_connect_timeout_s: float = 5.0
    """Bound on one NATS connect; a process gives up after twice this with a clear error."""
    temporal_address: str = "127.0.0.1:7233"
    """Temporal frontend `host:port`."""
    temporal_connect_timeout_s: float = Field(10.0, gt=0)
    """Bound on connecting to Temporal (a frontend that accepts TCP but never answers); a refused
    connection fails at once."""
    temporal_namespace: str = "default"
    """Temporal namespace of the incidents, the guard and the sweeps."""
    temporal_retention_days: int = Field(90, ge=0, le=3650)
    """Days Temporal keeps a closed incident (`fleetmend history`): set on the namespace by `dev up` and
    `fleetmend temporal setup`; 0 leaves the namespace as it is. Longer: Temporal archival (docs/operating.md)."""
    temporal_ui_port: int = 8233
    """Port of the Temporal Web UI (`dev up` serves it; `fleetmend` prints links to it)."""
    task_queue: str = "fleetmend"
    """The deployment's Temporal task queue: a cluster's incidents run on `<task_queue>.<cluster>` and its FleetGuard on
    `<task_queue>-guard.<cluster>`, both polled by that cluster's workers only (`subjects.cluster_task_queue`)."""
    state_dir: Path = Field(default_factory=default_state_dir)
    """Local state: `dev up`'s servers, logs, the agent's spool and last-boot record, file ledgers."""
    scheduler: SchedulerKind = SchedulerKind.STANDALONE
    """How nodes are drained: `standalone` (drained set in a JetStream KV bucket), `slurm` (`scontrol`),
    `kubernetes` (cordon, taint, evict) or `none` (drain nothing)."""
    slurm: SlurmSettings = Field(default_factory=SlurmSettings)
    kubernetes: KubernetesSettings = Field(default_factory=KubernetesSettings)
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    tickets: TicketSettings = Field(default_factory=TicketSettings)
    agent: AgentSettings = Field(default_factory=AgentSettings)
    router: RouterSettings = Field(default_factory=RouterSettings)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    streams: StreamSettings = Field(default_factory=StreamSettings)
    analyzer: AnalyzerSettings = Field(default_factory=AnalyzerSettings)
    policy: PolicySettings = Field(default_factory=PolicySettings)
    ledger: LedgerSettings = Field(default_factory=LedgerSettings)
    notify: NotifySettings = Field(default_factory=NotifySettings)
    catalog_overrides: Path | None = None
    """TOML file of operator overrides to the fault catalog."""
    log_format: str = "auto"
    """auto (console in a tty, else JSON), json or console."""

    @field_validator("cluster")
    @classmethod
    def _name(cls, v: str) -> str:
        if len(v) > 128:
            raise ValueError(f"{len(v)} characters; at most 128 (it names files and subject tokens)")
        if not re.match(r"^[A-Za-z0-9_-]+$", v):
            raise ValueError(f"{v!r}: use letters, digits, '-' and '_' only (it becomes a NATS subject token)")
        return v

    @field_validator("node")
    @classmethod
    def _node_name(cls, v: str) -> str:
        return check_node_name(v)  # any Kubernetes or Slurm node name; subjects encode it

    @field_validator("nats_url")
    @classmethod
    def _nats_url(cls, v: str) -> str:
        for url in v.split(","):
            u = urlparse(url.strip())
            if u.scheme not in ("nats", "tls", "ws", "wss") or not u.hostname:
                raise ValueError(f"{url!r}: expected nats://host:port (or tls://, comma-separated for a cluster)")
            try:
                port = u.port
            except ValueError:  # out of range, or not a number
                port = -1
            if port is not None and not 0 < port < 65536:
                raise ValueError(f"{url!r}: the port must be 1 to 65535")
        return v

    @field_validator("temporal_ui_port")
    @classmethod
    def _ui_port(cls, v: int) -> int:
        if not 0 < v < 65536:
            raise ValueError(f"{v}: a TCP port is 1 to 65535")
        return v

    @field_validator("temporal_address")
    @classmethod
    def _temporal_address(cls, v: str) -> str:
        host, _, port = v.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{v!r}: expected host:port, e.g. 127.0.0.1:7233")
        return v

    @field_validator("nats_nkey_seed", "nats_creds", "catalog_overrides", mode="before")
    @classmethod
    def _path_given(cls, v: Any) -> Any:
        # An empty value (`FLEETMEND_NATS_NKEY_SEED=`) would become Path("."), the working directory.
        if isinstance(v, str) and not v.strip():
            raise ValueError("empty path; give a file or leave the setting out")
        return v

    @field_validator("log_format")
    @classmethod
    def _fmt(cls, v: str) -> str:
        if v not in ("auto", "json", "console"):
            raise ValueError(f"unknown log_format {v!r}; expected auto, json, console")
        return v

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings)

    @property
    def temporal_ui_url(self) -> str:
        host = self.temporal_address.rsplit(":", 1)[0]
        return f"http://{host}:{self.temporal_ui_port}"


def load_settings(config_file: Path | str | None = None, **overrides: Any) -> Settings:
    """Load the settings tree.

    Args:
        config_file: TOML file; default `$FLEETMEND_CONFIG` if set, else none.
        overrides: explicit values (CLI flags); `None` values are ignored.
    Returns:
        `Settings`.
    Raises:
        ConfigError: listing every invalid field at once, with the file name.
    """
    path = config_file or os.environ.get("FLEETMEND_CONFIG")
    data: dict[str, Any] = {}
    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
            _check_depth(data, str(path))
        except RecursionError as err:  # tomllib itself recurses on nested arrays and inline tables
            raise ConfigError(f"config file {path}: nested deeper than Python can parse; fleetmend reads at "
                              f"most {MAX_CONFIG_DEPTH} levels (its settings are 4 deep)") from err
        except FileNotFoundError as err:
            raise ConfigError(f"config file {path} not found") from err
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"config file {path}: {err}") from err
        except UnicodeDecodeError as err:
            raise ConfigError(f"config file {path}: not UTF-8 at byte {err.start}; TOML files are UTF-8") from err
        except OSError as err:
            raise ConfigError(f"config file {path}: {err.strerror or err}") from err
    # Environment beats the file: drop file keys that the environment sets.
    for key in list(data):
        if os.environ.get(f"FLEETMEND_{key.upper()}") is not None:
            data.pop(key)
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return Settings(**data)
    except SettingsError as err:  # an environment value that is not valid JSON for a list/dict setting
        raise ConfigError(_env_error(err)) from err
    except ValidationError as err:
        where = f" in {path}" if path else ""
        n = err.error_count()
        errors = [f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}" for e in err.errors()]
        if n == 1:  # one error, one line
            raise ConfigError(f"invalid configuration{where}: {errors[0]}") from err
        lines = [f"invalid configuration{where} ({n} errors):"] + [f"  {e}" for e in errors]
        raise ConfigError("\n".join(lines)) from err


MAX_CONFIG_DEPTH = 16
"""Deepest nesting of tables and arrays a config file may have (the settings tree is 4 levels deep)."""


def _check_depth(data: Any, path: str, depth: int = 0) -> None:
    """Raise ConfigError when `data` nests deeper than `MAX_CONFIG_DEPTH` (before pydantic recurses into it)."""
    if depth > MAX_CONFIG_DEPTH:
        raise ConfigError(f"config file {path}: nested more than {MAX_CONFIG_DEPTH} levels deep; fleetmend's "
                          "settings are at most 4 (a table of sections of lists)")
    children = data.values() if isinstance(data, dict) else data if isinstance(data, list) else ()
    for v in children:
        _check_depth(v, path, depth + 1)


def _env_error(err: SettingsError) -> str:
    """One line for an environment value pydantic-settings could not parse as JSON: which variable,
    why, and what a list or table setting looks like. pydantic-settings names only the top-level
    field (`agent`); the variable is the one below it whose value is not valid JSON."""
    import json

    m = re.search(r'field "(\w+)"', str(err))
    field = m.group(1) if m else ""
    cause = str(err.__cause__) if err.__cause__ else str(err)
    bad = []
    for var, value in sorted(os.environ.items()):
        if not var.upper().startswith(f"FLEETMEND_{field.upper()}") or value.strip()[:1] not in ("[", "{", '"'):
            continue
        try:
            json.loads(value)
        except ValueError:
            bad.append(var)
    where = ", ".join(bad) if bad else f"a FLEETMEND_{field.upper()}* variable"
    return (f"invalid configuration: {where}: not valid JSON ({cause}); a list setting takes a JSON array "
            """such as '["nvbandwidth", "-t", "0"]', a table a JSON object""")


# ---------------------------------------------------------------- printing settings without secrets
_SECRET_KEYS = ("password", "token", "routing_key", "slack_webhook_url", "webhook_headers", "secret")


def redacted(settings: Settings) -> dict[str, Any]:
    """`settings` as JSON-ready data with every secret replaced by `"***"` (what `config check` prints:
    its output gets pasted into tickets and chats). Secret: a field whose name holds password, token,
    routing_key or secret, Slack's webhook URL (the URL is the credential), the values of
    `webhook_headers` (Authorization), and the password in a URL's user info (`nats://u:***@host`)."""
    from urllib.parse import urlsplit, urlunsplit

    def url(v: str) -> str:
        try:
            parts = urlsplit(v)
        except ValueError:
            return v
        if parts.password is None:
            return v
        host = parts.hostname or ""
        netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))

    def walk(d: Any) -> Any:
        if isinstance(d, dict):
            out = {}
            for k, v in d.items():
                if v and any(s in k for s in _SECRET_KEYS):
                    out[k] = {h: "***" for h in v} if isinstance(v, dict) else "***"
                else:
                    out[k] = walk(v)
            return out
        if isinstance(d, list):
            return [walk(x) for x in d]
        return url(d) if isinstance(d, str) and "@" in d and "://" in d else d

    return walk(settings.model_dump(mode="json"))


def state_dir_problem(path: Path) -> str | None:
    """Why `path` cannot be the state directory (`Settings.state_dir`), without creating anything: it, or the
    nearest of its parents that exists, is not a directory, or that one is not writable; None when it can be."""
    if path.exists() and not path.is_dir():
        return f"state dir {path}: not a directory"
    existing = path
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        return f"state dir {path}: {existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"state dir {path}: not writable ({existing}: permission denied)"
    return None


def ensure_state_dir(path: Path) -> None:
    """Create the state directory `path` (and its parents) and check a file can be written in it.

    Raises:
        ConfigError: one line saying why it cannot be used (a file, a missing or read-only parent, ...).
    """
    import tempfile

    problem = state_dir_problem(path)
    if problem is not None:
        raise ConfigError(problem + "; set FLEETMEND_STATE_DIR (or --state-dir) to a writable directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        why = ("not a directory" if isinstance(e, (NotADirectoryError, FileExistsError))
               else "not writable (permission denied)" if isinstance(e, PermissionError)
               else (e.strerror or str(e)).lower())
        raise ConfigError(f"state dir {path}: {why}; set FLEETMEND_STATE_DIR (or --state-dir) to a writable "
                          "directory") from None
