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
from fleetmend.fingerprint import DeviceRole, Fingerprint, TopoLevel

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
    Check("fabric_manager", ("fabric.manager",), FixKind.REBOOT),
    Check("irqbalance", ("irq.balance",), FixKind.REPAIR),
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
    Invariant("fabric.manager", frozenset({"running"}),
              "On NVSwitch boards the fabric manager sets up the NVLink fabric: without it CUDA programs fail to "
              "start or GPUs lose their NVLink peers (and NCCL's NVLS); its fabric state in NVML/DCGM stays "
              "latched healthy after it dies", "AWS awsome-distributed-training 3-topology-check.sh (systemctl "
              "is-active nvidia-fabricmanager: RESET); DCGM diag 'Fabric Manager'; leptonai/gpud fabric-manager; "
              "NVIDIA/NVSentinel#883 (FM dead 2.5 weeks, fabric state still healthy)"),
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


NCCL_DOCS = "NCCL user guide, Environment Variables (docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html)"
MAX_NCCL_FINDINGS_PER_NODE = 16
"""Findings one node may carry (`nccl_env_findings`): 8 GPUs each with a left-out NIC plus a few node-wide ones fit;
beyond, the rest are summed up in one last finding."""


@dataclass(frozen=True)
class NcclFilter:
    """A parsed NCCL interface filter (`NCCL_IB_HCA`, `NCCL_SOCKET_IFNAME`), NCCL's documented syntax:

    a comma list of names, each a prefix (`mlx5` selects `mlx5_0` … `mlx5_17`) unless the list starts with `=` (exact
    names); a leading `^` (before the `=`: `^=mlx5_1`) turns it into an exclude list; an HCA name may carry a port
    (`mlx5_0:1`: that port only). Unset or empty selects everything."""

    exclude: bool = False
    exact: bool = False
    items: tuple[tuple[str, int | None], ...] = ()
    """(name, port or None for every port)."""

    def matches(self, name: str, item: str) -> bool:
        return name == item if self.exact else name.startswith(item)

    def selects(self, name: str, port: int | None = None) -> bool:
        """Whether NCCL uses `name` (port `port`; None: the device as a whole, any of its ports)."""
        if not self.items:
            return True
        hit = any(self.matches(name, n) and (p is None or port is None or p == port) for n, p in self.items)
        if self.exclude and port is None:  # the device stays usable unless every port of it is excluded
            hit = any(self.matches(name, n) and p is None for n, p in self.items)
        return hit != self.exclude


def parse_nccl_filter(value: str | None, *, ports: bool = True) -> NcclFilter:
    """`NcclFilter` of an `NCCL_IB_HCA` (ports=True) or `NCCL_SOCKET_IFNAME` (ports=False) value.

    Raises:
        ValueError: a port that is not a number (`mlx5_0:x`).
    """
    spec = (value or "").strip()
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    spec = spec[1:] if exact else spec
    items: list[tuple[str, int | None]] = []
    for tok in (t.strip() for t in spec.split(",")):
        if not tok:
            continue
        name, sep, port = tok.partition(":") if ports else (tok, "", "")
        if sep and not port.isdigit():
            raise ValueError(f"NCCL_IB_HCA token {tok!r}: the port after ':' must be a number")
        items.append((name, int(port) if sep else None))
    return NcclFilter(exclude, exact, tuple(items))


GDR_LEVELS = {"LOC": -1, "PIX": TopoLevel.PIX.rank, "PXB": TopoLevel.PXB.rank, "PHB": TopoLevel.PHB.rank,
              "SYS": TopoLevel.SYS.rank}
"""`NCCL_NET_GDR_LEVEL` (formerly `NCCL_IB_GDR_LEVEL`) names: GPUDirect RDMA is used when the GPU-NIC path is at
most this far (LOC never, SYS always). The deprecated integers 0-4 are LOC, PIX, PXB, PHB, SYS. NCCL has no NODE
level: a path between host bridges of one NUMA node (nvidia-smi's NODE) is PHB to it."""


def parse_gdr_level(value: str) -> tuple[str, int]:
    """(name, rank) of an `NCCL_NET_GDR_LEVEL` value. Raises ValueError for anything else."""
    v = value.strip().upper()
    if v.isdigit() and int(v) <= 4:
        v = ("LOC", "PIX", "PXB", "PHB", "SYS")[int(v)]
    if v not in GDR_LEVELS:
        raise ValueError(f"NCCL_NET_GDR_LEVEL={value!r}: expected LOC, PIX, PXB, PHB, SYS (or 0-4)")
    return v, GDR_LEVELS[v]


def _nccl_rank(level: TopoLevel) -> int:
    return TopoLevel.PHB.rank if level is TopoLevel.NODE else level.rank


@dataclass(frozen=True)
class NcclFinding:
    """One thing a job's NCCL environment gets wrong on one node: which variable, which GPU (None: node-wide),
    the value expected and the value given, and why."""

    node: str
    variable: str
    gpu: str | None
    expected: str
    given: str
    why: str


def _hca_ports(fp: Fingerprint) -> dict[str, list[int]]:
    """RDMA device → its port numbers, from the `ib.<role>.<dev>.<port>.state` settings ([1] when unknown)."""
    out: dict[str, list[int]] = {n.ib_device: [] for n in fp.nics if n.ib_device}
    for key in fp.settings:
        parts = key.split(".")
        if len(parts) == 5 and parts[0] == "ib" and parts[2] in out and parts[3].isdigit():
            out[parts[2]].append(int(parts[3]))
    return {h: sorted(set(p)) or [1] for h, p in out.items()}


def nccl_env_findings(env: dict[str, str], fp: Fingerprint) -> list[NcclFinding]:
    """Check a job's NCCL environment against one node's fingerprint (its GPUs' nearest NICs, their roles and NUMA
    nodes). Only the variables present in `env` are checked; syntax: `NcclFilter`, `GDR_LEVELS` (NCCL_DOCS).

    - `NCCL_IB_HCA`: a GPU whose nearest compute NIC (PIX/PXB) is not selected gets a finding naming the GPU, the
      NIC expected and what NCCL is left with (the nearest selected NIC, SYS when it is on the other NUMA node); a
      selected storage or management HCA, a name matching no RDMA device, and a filter selecting none are findings.
    - `NCCL_SOCKET_IFNAME`: an include list matching none of the node's PCI network interfaces (bootstrap fails or
      takes a virtual interface).
    - `NCCL_NET_GDR_LEVEL` (or `NCCL_IB_GDR_LEVEL`): LOC turns GPUDirect RDMA off for every GPU; a level below a
      GPU's path to its NIC turns it off for that GPU (traffic staged through host memory).
    At most `MAX_NCCL_FINDINGS_PER_NODE` findings; an unparsable value is one finding.
    """
    out: list[NcclFinding] = []
    node = fp.node

    def add(var: str, gpu: str | None, expected: str, given: str, why: str) -> None:
        out.append(NcclFinding(node, var, gpu, expected, given, why))

    by_bdf = {n.pci_bus_id: n for n in fp.nics}
    hcas = {n.ib_device: n for n in fp.nics if n.ib_device}
    nearest_used: dict[str, tuple[str, str]] = {}
    """GPU → (HCA NCCL would use, its level as NCCL names it)."""
    if "NCCL_IB_HCA" in env and hcas:
        value = env["NCCL_IB_HCA"]
        try:
            flt = parse_nccl_filter(value)
        except ValueError as e:
            flt = None
            add("NCCL_IB_HCA", None, "HCA names, optional :port", value, str(e))
        if flt is not None:
            ports = _hca_ports(fp)
            selected = sorted(h for h in hcas if any(flt.selects(h, p) for p in ports[h]))
            if not flt.exclude:
                for name, _port in flt.items:
                    if not any(flt.matches(h, name) for h in hcas):
                        add("NCCL_IB_HCA", None, "names of this node's RDMA devices: " + ", ".join(sorted(hcas)),
                            name, f"{name!r} matches no RDMA device here")
            if not selected:
                add("NCCL_IB_HCA", None, ", ".join(sorted(h for h in hcas if hcas[h].role is DeviceRole.COMPUTE)),
                    value or "(unset)", "selects no RDMA device: NCCL falls back to TCP sockets")
            for h in selected:
                n = hcas[h]
                if n.role in (DeviceRole.STORAGE, DeviceRole.MANAGEMENT):
                    add("NCCL_IB_HCA", None, "compute HCAs only", f"{h} ({n.role.value}, {n.pci_bus_id})",
                        f"selects the {n.role.value} NIC {h}: collective traffic shares the {n.role.value} network "
                        "and leaves no GPU through its own rail")
            for g in fp.gpus:
                nic = by_bdf.get(g.nearest_nic or "")
                if nic is None or not nic.ib_device or g.nic_level is None:
                    continue
                if g.nic_level.rank > TopoLevel.PXB.rank or nic.role is not DeviceRole.COMPUTE:
                    continue  # no GPU-local NIC for this GPU: nothing to expect
                if nic.ib_device in selected:
                    nearest_used[g.pci_bus_id] = (nic.ib_device, g.nic_level.value)
                    continue
                others = [hcas[h] for h in selected]
                same = [o for o in others if g.numa_node is not None and o.numa_node == g.numa_node]
                if same:
                    use, level = min(same, key=lambda o: o.ib_device or ""), "PHB"
                    where = f"{use.ib_device} on the same NUMA node {g.numa_node} (through the CPU, PHB at best)"
                elif others:
                    use, level = min(others, key=lambda o: o.ib_device or ""), "SYS"
                    where = (f"{use.ib_device} on NUMA node {use.numa_node if use.numa_node is not None else '?'}"
                             f" (SYS: across the socket interconnect)")
                else:
                    continue
                nearest_used[g.pci_bus_id] = (use.ib_device or "", level)
                add("NCCL_IB_HCA", g.pci_bus_id, f"{nic.ib_device} ({g.nic_level.value}, NUMA {g.numa_node})",
                    value or "(unset)", f"GPU {g.pci_bus_id}'s own NIC {nic.ib_device} is left out; its traffic "
                    f"goes through {where}")
    if "NCCL_SOCKET_IFNAME" in env:
        value = env["NCCL_SOCKET_IFNAME"]
        flt_s = parse_nccl_filter(value, ports=False)
        ifs = sorted({i for n in fp.nics for i in n.netdevs})
        if ifs and flt_s.items and not flt_s.exclude and not any(flt_s.selects(i) for i in ifs):
            add("NCCL_SOCKET_IFNAME", None, "one of " + ", ".join(ifs), value,
                "matches none of this node's PCI network interfaces (bootstrap fails, or uses a virtual one)")
    gdr_var = "NCCL_NET_GDR_LEVEL" if "NCCL_NET_GDR_LEVEL" in env else "NCCL_IB_GDR_LEVEL"
    if gdr_var in env and fp.gpus and hcas:
        value = env[gdr_var]
        try:
            name, rank = parse_gdr_level(value)
        except ValueError as e:
            add(gdr_var, None, "LOC, PIX, PXB, PHB or SYS", value, str(e))
        else:
            if rank < 0:
                paths = [_nccl_rank(g.nic_level) for g in fp.gpus if g.nic_level is not None]
                need = next(k for k, r in GDR_LEVELS.items() if r == max(paths)) if paths else "PIX"
                add(gdr_var, None, f"at least {need} (the GPU-NIC paths here)", value,
                    "LOC turns GPUDirect RDMA off for every GPU: NIC traffic is staged through host memory")
            else:
                for g in fp.gpus:
                    used = nearest_used.get(g.pci_bus_id)
                    if used is None and g.nearest_nic in by_bdf and g.nic_level is not None:
                        used = (by_bdf[g.nearest_nic].ib_device or g.nearest_nic, g.nic_level.value)
                    if used is None:
                        continue
                    path = TopoLevel(used[1])
                    if _nccl_rank(path) > rank:
                        add(gdr_var, g.pci_bus_id, f"at least {path.value if path is not TopoLevel.NODE else 'PHB'}",
                            value, f"GPU {g.pci_bus_id} reaches {used[0]} over {path.value}, beyond {name}: "
                            "GPUDirect RDMA is off for it (staged through host memory)")
    if len(out) > MAX_NCCL_FINDINGS_PER_NODE:
        rest = len(out) - (MAX_NCCL_FINDINGS_PER_NODE - 1)
        out = out[:MAX_NCCL_FINDINGS_PER_NODE - 1] + [NcclFinding(node, "-", None, "-", "-",
                                                                  f"{rest} more findings left out")]
    return out


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
    (`mlx5` selects every `mlx5_*`). Unset or empty selects every HCA. HCA level (`parse_nccl_filter`); the
    per-GPU check with ports and GDR level is `nccl_env_findings`.

    Raises:
        ValueError: a port that is not a number.
    """
    hcas = sorted(n.ib_device for n in fp.nics if n.ib_device)
    compute = tuple(sorted(n.ib_device for n in fp.nics if n.ib_device and n.role is DeviceRole.COMPUTE))
    flt = parse_nccl_filter(value)
    selected = [h for h in hcas if flt.selects(h)]
    return NcclHcaCheck(tuple(selected), compute, tuple(h for h in compute if h not in selected),
                        tuple(h for h in selected if h not in compute))


def placements(fp: Fingerprint) -> dict[str, list[str | int | None]]:
    """GPU PCI address → [nearest NIC, its level, nearest NVMe, its level, NUMA node]: the part of the fingerprint
    the topology hash is made of, kept to say *what* moved after a repair (JSON-friendly)."""
    return {g.pci_bus_id: [g.nearest_nic, g.nic_level.value if g.nic_level else None, g.nearest_nvme,
                           g.nvme_level.value if g.nvme_level else None, g.numa_node] for g in fp.gpus}


def _render(p: list[str | int | None]) -> str:
    return (f"nic {p[0] or '-'} {p[1] or '-'} nvme {p[2] or '-'} {p[3] or '-'} "
            f"numa {p[4] if p[4] is not None else '-'}")


def _farther_or_other(dev_before: str | int | None, level_before: str | int | None, dev_after: str | int | None,
                      level_after: str | int | None) -> bool:
    def rank(level: str | int | None) -> int:
        return TopoLevel(level).rank if isinstance(level, str) and level in TopoLevel.__members__ else 99

    rb, ra = rank(level_before), rank(level_after)
    return ra > rb or (ra == rb and dev_after != dev_before)


def placement_changes(before: dict[str, list[str | int | None]], after: dict[str, list[str | int | None]],
                      limit: int = 16) -> list[str]:
    """`GPU <bdf>: <before> -> <after>` for each GPU that was there before and is gone, or whose nearest NIC or NVMe
    is now farther, or as near through another device; at most `limit` lines. A GPU that is new, or now nearer its
    NIC/NVMe than before, is no change: the fault that drained the node may have taken that device away, and the
    repair brought it back."""
    out = []
    for g in sorted(before):
        b, a = before[g], after.get(g)
        if a is None:
            out.append(f"GPU {g}: {_render(b)} -> gone")
        elif _farther_or_other(b[0], b[1], a[0], a[1]) or _farther_or_other(b[2], b[3], a[2], a[3]):
            out.append(f"GPU {g}: {_render(b)} -> {_render(a)}")
    return out[:limit] + ([f"{len(out) - limit} more"] if len(out) > limit else [])


def topology_like_peers(report: DriftReport, hardware: str, value: str,
                        allowed: dict[str, AllowedSet] | None = None) -> bool:
    """True when topology hash `value` is what the node's peers have: the `topology.hash` cohort of class
    `hardware` (of at least two nodes) is uniform or has a clear majority with that value, or an allowed set
    (`fleetmend drift allow topology.hash …`) holds it. A repair that leaves a node like its peers made it right,
    whatever it was before."""
    a = (allowed or {}).get("topology.hash")
    if a is not None:
        return value in a.values
    for c in report.cohorts:
        if c.key == "topology.hash" and c.hardware == hardware:
            return (c.verdict.status in (CohortStatus.UNIFORM, CohortStatus.DRIFT) and c.verdict.mode == value
                    and c.verdict.size >= 2)  # alone in its class, a node is like nobody
    return False
