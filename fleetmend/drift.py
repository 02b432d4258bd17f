"""Configuration drift: pure judging rules over node fingerprints (`fleetmend.fingerprint.Fingerprint`).

Three layers, in this order, per fact key (docs/fleet-shape.md):

1. **Allowed sets** (`AllowedSet`, set by `fleetmend drift allow KEY VALUE… --who --why`): during a rollout the
   expected value of a key is a set ({old driver, new driver}); a value outside it deviates, and neither the policy
   nor the cohort judges that key while the set exists (Google Cluster Health Scanner's several ACTIVE qualified
   versions; GCM's acceptable-value lists).
2. **Policy invariants** (`Invariant`, `DEFAULT_INVARIANTS`): settings that are never legitimately different, one
   row per key pattern with the values allowed, the reason and the source; a row applies to the hardware classes its
   `hardware` pattern matches, and an operator file (`load_invariants`) replaces one row by its key (or turns it
   off with `expected = []`). They catch fleet-wide misconfiguration a majority cannot see (every node of an image
   without `iommu=pt`).
3. **Cohort majority** (`cohort_verdict`): everything else — versions, topology hash, link gen/width, MPS/MRRS,
   THP, NUMA balancing, C-states, IRQ affinity, IB rate/MTU, RoCE — must be uniform inside a cohort (hardware class,
   device role). A node deviates only when the cohort has at least `quorum` members with the key (default 5) and
   the most common value holds at least `majority` of them (default 60 %); a tie or a weaker majority is a
   *cohort split*, reported for humans and never turned into a fault (NVSentinel NIC homogeneity: skip on a tie).

A key a node does not have is "not applicable" there: never a deviation, not counted in the cohort.

Stdlib only (tomllib, fnmatch): the contract.
"""

import fnmatch
import tomllib
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from fleetmend.errors import ConfigError
from fleetmend.fingerprint import DeviceRole, Fingerprint

DEFAULT_QUORUM = 5
"""Smallest cohort judged by majority: below it one odd node is a third of the vote (NVSentinel skips < 2; the
notes argue for 5)."""
DEFAULT_MAJORITY = 0.6
"""Share the most common value must hold for the others to be deviations; below it the cohort is split."""


class Layer(StrEnum):
    """Which rule found a deviation."""

    ALLOWED = "allowed"
    POLICY = "policy"
    COHORT = "cohort"


class FixKind(StrEnum):
    """How a deviation is fixed: `live` by the agent in place (`policy.reconfigure`), `reboot` (kernel command
    line, BIOS, IOMMU, ACS at boot: drains when idle and files a ticket), `repair` (versions, firmware, topology:
    a human upgrades or re-cables)."""

    LIVE = "live"
    REBOOT = "reboot"
    REPAIR = "repair"


@dataclass(frozen=True)
class Check:
    """One check: the fact keys it covers, its catalog kind (`config_drift_<name>`) and how it is fixed."""

    name: str
    patterns: tuple[str, ...]
    fix: FixKind

    @property
    def kind(self) -> str:
        return f"config_drift_{self.name}"


CHECKS: tuple[Check, ...] = (
    Check("governor", ("cpu.governor",), FixKind.LIVE),
    Check("peermem", ("gpudirect.peermem",), FixKind.LIVE),
    Check("numa_balancing", ("kernel.numa_balancing",), FixKind.LIVE),
    Check("thp", ("mm.thp_enabled", "mm.thp_defrag"), FixKind.LIVE),
    Check("irq_affinity", ("irq.affinity.*",), FixKind.LIVE),
    Check("persistence", ("gpu.persistence_mode",), FixKind.LIVE),
    Check("acs", ("pcie.acs",), FixKind.REBOOT),
    Check("iommu", ("iommu.mode",), FixKind.REBOOT),
    Check("cstate", ("cpu.max_cstate",), FixKind.REBOOT),
    Check("isolcpus", ("cpu.isolated", "cpu.nohz_full"), FixKind.REBOOT),
    Check("system_cpus", ("cgroup.system_cpus",), FixKind.REBOOT),
    Check("ecc", ("gpu.ecc",), FixKind.REBOOT),
    Check("mig", ("gpu.mig",), FixKind.REBOOT),
    Check("power_limit", ("gpu.power_limit", "gpu.app_clocks"), FixKind.LIVE),
    Check("pcie_link", ("pcie.link.*",), FixKind.REPAIR),
    Check("pcie_payload", ("pcie.payload.*",), FixKind.REBOOT),
    Check("ib_port", ("ib.*",), FixKind.REPAIR),
    Check("mtu", ("net.*.mtu",), FixKind.REPAIR),
    Check("roce", ("roce.*",), FixKind.REPAIR),
    Check("topology", ("topology.hash",), FixKind.REPAIR),
    Check("version", ("version.*",), FixKind.REPAIR),
)
"""Every check, first match wins; a fact no check covers is judged under `version` (a human looks)."""

LIVE_FIX_KEYS = ("cpu.governor", "gpudirect.peermem", "kernel.numa_balancing", "mm.thp_enabled", "mm.thp_defrag",
                 "gpu.persistence_mode", "gpu.app_clocks", "gpu.power_limit", "irq.affinity.*")
"""Fact keys the agent can set in place (agents/commands.py `ReconfigureHandler`)."""


def check_of(key: str) -> Check:
    """The `Check` covering fact `key` (`version` when none does)."""
    for c in CHECKS:
        if any(fnmatch.fnmatchcase(key, p) for p in c.patterns):
            return c
    return CHECKS[-1]


def live_fixable(key: str) -> bool:
    return any(fnmatch.fnmatchcase(key, p) for p in LIVE_FIX_KEYS)


@dataclass(frozen=True)
class Invariant:
    """A policy row: fact keys matching `key` (fnmatch) on classes matching `hardware` must be in `expected`.

    `fix_value` is what a live fix writes (the first expected value when empty)."""

    key: str
    expected: frozenset[str]
    reason: str
    source: str
    hardware: str = "*"
    fix_value: str = ""

    def applies(self, fact: str, hardware_key: str) -> bool:
        return bool(self.expected) and fnmatch.fnmatchcase(fact, self.key) and fnmatch.fnmatchcase(
            hardware_key, self.hardware)

    @property
    def wanted(self) -> str:
        return self.fix_value or sorted(self.expected)[0]


DEFAULT_INVARIANTS: tuple[Invariant, ...] = (
    Invariant("gpudirect.peermem", frozenset({"loaded", "loaded:nv_peer_mem"}),
              "GPUDirect RDMA needs nvidia_peermem on every GPU node with RDMA NICs; without it NCCL stages "
              "through host memory (6 vs 12 GB/s on 100G IB)", "NVIDIA/nccl#465; GPUDirect RDMA docs "
              "('must be loaded on each node boot')", fix_value="loaded"),
    Invariant("pcie.acs", frozenset({"off"}),
              "ACS Source Validation on the switches above GPUs/NICs routes P2P through the root complex: "
              "about half the inter-node bandwidth", "NVIDIA/nccl#949 (~56 % of expected); NVIDIA/nccl-tests#112; "
              "gpud components/pci (acs_enabled)"),
    Invariant("iommu.mode", frozenset({"off", "pt"}),
              "A translating IOMMU redirects PCI peer-to-peer traffic to the root complex: slower or hangs",
              "NCCL troubleshooting (IOMMU/VT-d); mlnx_tune report"),
    Invariant("cpu.governor", frozenset({"performance"}),
              "Frequency scaling makes host-side work (data loading, NCCL proxy threads) slow and unpredictable",
              "facebookresearch/gcm check_processor.py cpufreq-governor; mlnx_tune sets performance"),
    Invariant("gpu.persistence_mode", frozenset({"enabled"}),
              "Without persistence the driver tears the GPU down between jobs (start latency, lost settings)",
              "Azure azurehpc-health-checks azure_gpu_persistence.nhc; DCGM diag 'Persistence Mode'"),
    Invariant("gpu.ecc", frozenset({"current=on pending=on"}),
              "ECC off (or pending a change at the next reboot) trades silent corruption for memory",
              "DCGM dcgmi config (Target vs Current ECC)"),
    Invariant("gpu.mig", frozenset({"current=off pending=off"}),
              "MIG partitions a training GPU; a pending change alters the node at its next reboot",
              "AWS gpu-cluster-healthcheck 0-nvidia-smi-check.sh; DCGM L4 requires MIG off"),
)
"""Defaults, each with its reason and source. THP, NUMA balancing, C-states and versions are cohort facts: sites
choose them, but a class must agree."""


def load_invariants(path: Path | str | None, base: tuple[Invariant, ...] = DEFAULT_INVARIANTS) -> tuple[Invariant, ...]:
    """`base` with the rows of an operator TOML file replacing those of the same `key`, or added.

    File shape: `[invariant."cpu.governor"] expected = ["performance", "schedutil"]`, optional `reason`, `source`,
    `hardware` (fnmatch on `HardwareClass.key`), `fix_value`; `expected = []` turns the row off.

    Raises:
        ConfigError: the file cannot be read, is not TOML, or a row lacks `expected` or has unknown fields.
    """
    if path is None:
        return base
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(f"drift invariants {path}: {err}") from err
    rows = {i.key: i for i in base}
    for key, row in (data.get("invariant") or {}).items():
        if not isinstance(row, dict) or "expected" not in row:
            raise ConfigError(f"drift invariants {path}: [invariant.{key!r}] needs expected = [values]")
        unknown = set(row) - {"expected", "reason", "source", "hardware", "fix_value"}
        if unknown:
            raise ConfigError(f"drift invariants {path}: [invariant.{key!r}] unknown field(s) {sorted(unknown)}; "
                              "expected expected, reason, source, hardware, fix_value")
        rows[key] = Invariant(key, frozenset(str(v) for v in row["expected"]), str(row.get("reason", "operator policy")),
                              str(row.get("source", str(path))), str(row.get("hardware", "*")),
                              str(row.get("fix_value", "")))
    return tuple(rows.values())


@dataclass(frozen=True)
class AllowedSet:
    """Values of one fact key allowed during a rollout, with who set it and why."""

    key: str
    values: frozenset[str]
    who: str
    why: str
    at: str = ""


class CohortStatus(StrEnum):
    UNIFORM = "uniform"
    DRIFT = "drift"
    """A clear majority; the others deviate."""
    SPLIT = "split"
    """No value holds `majority` (or a tie): for humans, never a fault."""
    TOO_SMALL = "too_small"
    """Fewer than `quorum` nodes have the key: not judged by majority."""


@dataclass(frozen=True)
class CohortVerdict:
    status: CohortStatus
    size: int
    mode: str | None
    share: float
    deviants: tuple[str, ...] = ()


def cohort_verdict(values: dict[str, str], quorum: int = DEFAULT_QUORUM,
                   majority: float = DEFAULT_MAJORITY) -> CohortVerdict:
    """Judge one key in one cohort: `values` maps node → value (nodes without the key left out).

    Returns the status, the cohort size, the most common value (None on a tie or an empty cohort), its share
    (0..1) and, for `DRIFT`, the nodes with another value (sorted). Rules: module docstring, layer 3.
    """
    size = len(values)
    if size == 0:
        return CohortVerdict(CohortStatus.TOO_SMALL, 0, None, 0.0)
    counts = Counter(values.values()).most_common()
    top, n = counts[0]
    tie = len(counts) > 1 and counts[1][1] == n
    share = n / size
    if len(counts) == 1:
        return CohortVerdict(CohortStatus.UNIFORM, size, top, 1.0)
    if size < quorum:
        return CohortVerdict(CohortStatus.TOO_SMALL, size, None if tie else top, share)
    if tie or share < majority:
        return CohortVerdict(CohortStatus.SPLIT, size, None if tie else top, share)
    return CohortVerdict(CohortStatus.DRIFT, size, top, share,
                         tuple(sorted(node for node, v in values.items() if v != top)))


@dataclass(frozen=True)
class Deviation:
    """One node's fact that is not what it should be."""

    node: str
    key: str
    found: str
    expected: tuple[str, ...]
    layer: Layer
    reason: str
    source: str
    hardware: str
    role: DeviceRole
    check: str
    kind: str
    fix: FixKind
    wanted: str
    """What a live fix writes (the majority value or the invariant's `wanted`)."""


@dataclass(frozen=True)
class CohortView:
    """One (hardware class, role, key) cohort for `fleetmend drift`."""

    hardware: str
    role: DeviceRole
    key: str
    verdict: CohortVerdict


@dataclass
class DriftReport:
    deviations: list[Deviation] = field(default_factory=list)
    cohorts: list[CohortView] = field(default_factory=list)

    @property
    def splits(self) -> list[CohortView]:
        return [c for c in self.cohorts if c.verdict.status is CohortStatus.SPLIT]

    def by_node(self) -> dict[str, list[Deviation]]:
        out: dict[str, list[Deviation]] = {}
        for d in self.deviations:
            out.setdefault(d.node, []).append(d)
        return out


def judge(fingerprints: list[Fingerprint], invariants: tuple[Invariant, ...] = DEFAULT_INVARIANTS,
          allowed: dict[str, AllowedSet] | None = None, quorum: int = DEFAULT_QUORUM,
          majority: float = DEFAULT_MAJORITY) -> DriftReport:
    """Judge every node's facts with the three layers (module docstring).

    Args:
        fingerprints: the latest fingerprint of each node (one per node; a later duplicate replaces an earlier one).
        invariants: policy rows (`load_invariants`).
        allowed: fact key → `AllowedSet` of the cluster.
        quorum, majority: cohort rules.
    Returns:
        `DriftReport`: deviations sorted by node and key; every cohort judged by majority (keys with an allowed set
        or an applicable invariant are not) with its verdict.
    """
    allowed = allowed or {}
    latest = {fp.node: fp for fp in fingerprints}
    report = DriftReport()
    cohorts: dict[tuple[str, DeviceRole, str], dict[str, str]] = {}
    for node, fp in sorted(latest.items()):
        hw = fp.hardware.key
        for key, value in sorted(fp.facts().items()):
            role = fp.role_of(key)
            check = check_of(key)

            def dev(layer: Layer, expected: tuple[str, ...], reason: str, source: str, wanted: str,
                    node: str = node, key: str = key, value: str = value, role: DeviceRole = role,
                    check: Check = check, hw: str = hw) -> Deviation:
                return Deviation(node, key, value, expected, layer, reason, source, hw, role, check.name, check.kind,
                                 check.fix, wanted)

            if key in allowed:
                a = allowed[key]
                if value not in a.values:
                    report.deviations.append(dev(Layer.ALLOWED, tuple(sorted(a.values)),
                                                 f"outside the allowed set ({a.why})", f"fleetmend drift allow by {a.who}",
                                                 sorted(a.values)[0]))
                continue
            inv = next((i for i in reversed(invariants) if i.applies(key, hw)), None)
            if inv is not None:
                if value not in inv.expected:
                    report.deviations.append(dev(Layer.POLICY, tuple(sorted(inv.expected)), inv.reason, inv.source,
                                                 inv.wanted))
                continue
            cohorts.setdefault((hw, role, key), {})[node] = value
    for (hw, role, key), values in sorted(cohorts.items()):
        v = cohort_verdict(values, quorum, majority)
        report.cohorts.append(CohortView(hw, role, key, v))
        if v.status is CohortStatus.DRIFT and v.mode is not None:
            check = check_of(key)
            for node in v.deviants:
                report.deviations.append(Deviation(
                    node, key, values[node], (v.mode,), Layer.COHORT,
                    f"{v.share:.0%} of {v.size} {role.value} peers of this class have {v.mode!r}",
                    "cohort majority (quorum, 60 %): NVSentinel NIC homogeneity; ibdiagnet uniform firmware",
                    hw, role, check.name, check.kind, check.fix, v.mode))
    report.deviations.sort(key=lambda d: (d.node, d.key))
    return report


@dataclass(frozen=True)
class NcclHcaCheck:
    """What a job's `NCCL_IB_HCA` selects on one node against its GPU-local (compute) HCAs."""

    selected: tuple[str, ...]
    compute: tuple[str, ...]
    missing: tuple[str, ...]
    """Compute HCAs the setting leaves out (GPU traffic then crosses the CPU or another rail)."""
    extra: tuple[str, ...]
    """Non-compute HCAs it selects (storage or management NICs carrying collective traffic)."""

    @property
    def ok(self) -> bool:
        return not self.missing and not self.extra


def nccl_ib_hca(value: str | None, fp: Fingerprint) -> NcclHcaCheck:
    """Check `NCCL_IB_HCA` against the node's compute HCAs (`NicInfo.role` compute, from the topology).

    NCCL's syntax (NCCL environment variables docs): a comma list of HCA names, each optionally `:port`; a leading
    `^` excludes the listed ones instead; a leading `=` makes the names exact, otherwise each is a prefix
    (`mlx5` selects every `mlx5_*`). Unset or empty selects every HCA. Ports are ignored here (HCA level).
    """
    hcas = sorted(n.ib_device for n in fp.nics if n.ib_device)
    compute = tuple(sorted(n.ib_device for n in fp.nics if n.ib_device and n.role is DeviceRole.COMPUTE))
    spec = (value or "").strip()
    exclude, exact = spec.startswith("^"), False
    spec = spec.lstrip("^")
    if spec.startswith("="):
        exact, spec = True, spec[1:]
    names = [p.split(":")[0].strip() for p in spec.split(",") if p.strip()]

    def named(h: str) -> bool:
        return any(h == n if exact else h.startswith(n) for n in names)

    if not names:
        selected = hcas
    else:
        selected = [h for h in hcas if named(h) != exclude]
    return NcclHcaCheck(tuple(selected), compute, tuple(h for h in compute if h not in selected),
                        tuple(h for h in selected if h not in compute))
