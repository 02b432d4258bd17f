"""The `Sweep` conversation: the CLI starts `Sweep` with `SweepInput` and reads its `SweepResult`;
the workflow asks each node's agent through `bench_node` (`BenchActivityRequest`) and opens
fail_slow incidents through `open_fail_slow` (`FailSlowRequest` of `SweepFinding`s).
"""

from dataclasses import dataclass, field


@dataclass
class SweepInput:
    """Start argument of the `Sweep` workflow (id `sweep/<cluster>/<sweep_id>`)."""

    cluster: str
    sweep_id: str
    nodes: list[str]
    deadline_s: float = 60.0
    """Each agent answers within this; nodes that do not are listed as not answering."""
    outlier_pct: float = 5.0
    act: bool = False
    """Open a fail_slow incident for each outlier."""
    host_seconds: float = 1.0
    builtin: bool = True
    """False: only the site's `agent.bench_command`."""


@dataclass
class MetricCell:
    value: float
    median: float
    ratio: float | None
    """value / median oriented so that < 1 is worse (median / value for lower-is-better metrics)."""
    outlier: bool


@dataclass
class NodeRow:
    node: str
    metrics: dict[str, MetricCell] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    outlier: bool = False
    worst_metric: str | None = None
    worst_ratio: float | None = None


@dataclass
class SweepResult:
    cluster: str
    sweep_id: str
    outlier_pct: float
    rows: list[NodeRow] = field(default_factory=list)
    medians: dict[str, float] = field(default_factory=dict)
    not_answering: dict[str, str] = field(default_factory=dict)
    """node → why (no agent listens, deadline passed)."""
    not_judged: list[str] = field(default_factory=list)
    """Metrics reported by fewer than `MIN_NODES_TO_JUDGE` nodes."""
    incidents_opened: list[str] = field(default_factory=list)
    noise_pct: dict[str, float] = field(default_factory=dict)
    """Metric → median over the nodes of how far apart its repeated runs were (% of the best run):
    an outlier within that noise is weak evidence."""
    noise_max_pct: dict[str, float] = field(default_factory=dict)
    """Metric → the largest spread any node saw."""
    clipped: str | None = None
    """Why some cells are left out (`fleetmend.sweep.clip_result`), or None."""

    @property
    def outliers(self) -> list[str]:
        return [r.node for r in self.rows if r.outlier]

@dataclass
class BenchActivityRequest:
    """`Sweep` → activity `bench_node`: ask one node's agent for a `BenchReport`."""

    cluster: str
    node: str
    sweep_id: str
    deadline_s: float
    host_seconds: float = 1.0
    builtin: bool = True


@dataclass
class SweepFinding:
    node: str
    metric: str
    value: float
    median: float
    ratio: float
    nodes: int


@dataclass
class FailSlowRequest:
    """`Sweep` → activity `open_fail_slow`: one fail_slow FaultEvent per finding, on the node's fault subject."""

    cluster: str
    sweep_id: str
    outlier_pct: float
    findings: list[SweepFinding] = field(default_factory=list)
