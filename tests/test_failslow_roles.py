"""Rule 5b (`fleetmend.analyzer.core`): the ranks of one job may do different work by design. A node judged
on a work-dependent metric in its job group is judged against its own offset from the job's median, learnt
over its first `analyzer.job_baseline_windows` windows in the job (issue 28 point 1: "a rank is slow only against its own
history in that job"). The roles below are the ones an adversarial review of the analyzer (2026-12-07) used to
drain healthy nodes: each was a node finding against its job's median."""

from __future__ import annotations

import random

from fleetmend.analyzer import core
from fleetmend.analyzer.core import Comparator
from fleetmend.config import AnalyzerSettings

T0 = 1_790_000_000.0 - 1_790_000_000.0 % 300
NODES = 16


def _job(*, roles: bool, fault_at: int | None = None, windows: int = 12,
         worse_role_at: int | None = None) -> list[core.Finding]:
    """A 16-node job on one hardware class, one busy sample a minute, 2 % noise (clocks 0.5 %). Healthy roles: n0 and n1
    (prefill / first pipeline stage) at the power cap half the time where the others are at 12 %; n2 and n3
    (parameter server) wait 4x more on IB; n4 (data loader) runs its CPUs at a 15 % lower turbo; n5 (top of
    the rack) runs 9 °C warmer. `fault_at`: from that window on n6's GPU clocks 6 % lower under load (a fault
    that starts in the job). `worse_role_at`: from then on n0 sits at the cap 95 % of the time. Returns the
    findings; `roles=False` judges as before rule 5b (against the job's median alone)."""
    rng = random.Random(7)
    c = Comparator(AnalyzerSettings())
    if not roles:
        c._judge_by_role = lambda *a: {}  # type: ignore[method-assign]
    found: list[core.Finding] = []
    for w in range(windows):
        for k in range(5):
            t = T0 + w * 300 + k * 60 + 1
            for n in range(NODES):
                def noisy(x: float, sigma: float = 0.02) -> float:
                    return x * (1 + rng.gauss(0, sigma))
                cap = 0.5 if n in (0, 1) else 0.12
                if n == 0 and worse_role_at is not None and w >= worse_role_at:
                    cap = 0.95
                clock = 0.97 * (0.94 if n == 6 and fault_at is not None and w >= fault_at else 1.0)
                c.add(f"n{n}", "H", t, {
                    "power_cap_frac": (min(1.0, noisy(cap)), "gpu:0"),
                    "ib_xmit_wait_per_min": (noisy(8e7 if n in (2, 3) else 2e7), "port:mlx5_0/1"),
                    "cpu_freq_ratio": (noisy(1.28 if n == 4 else 1.5), "host"),
                    "temperature_c": (round(noisy(76.0 if n == 5 else 67.0)), "gpu:0"),
                    "sm_clock_ratio": (min(1.1, noisy(clock, 0.005)), "gpu:0"),
                })
                c.note_sched(f"n{n}", "j1", t)
        found += c.close_window(c.window_of(T0 + w * 300 + 1)).findings
    return found


def test_healthy_roles_in_one_job_are_not_findings() -> None:
    assert _job(roles=True) == []
    # the control: judged against the job's median alone, each role node is a finding (each a healthy drain)
    before = {(f.node, f.metric) for f in _job(roles=False)}
    assert {("n0", "power_cap_frac"), ("n1", "power_cap_frac"), ("n2", "ib_xmit_wait_per_min"),
            ("n3", "ib_xmit_wait_per_min"), ("n4", "cpu_freq_ratio"), ("n5", "temperature_c")} <= before


def test_a_fault_that_starts_in_the_job_is_found_against_the_roles() -> None:
    found = _job(roles=True, fault_at=AnalyzerSettings().job_baseline_windows + 1)
    assert [(f.node, f.metric) for f in found] == [("n6", "sm_clock_ratio")]
    f = found[0]
    ev = f.evidence()
    assert "role_offset" in ev and abs(ev["role_offset"]) < 0.01  # n6 was like its peers before
    assert f.value < f.peer_median - f.threshold  # in the metric's own units, with its offset back in


def test_a_role_node_that_gets_worse_than_its_role_is_found() -> None:
    found = _job(roles=True, worse_role_at=AnalyzerSettings().job_baseline_windows + 1)
    assert [(f.node, f.metric) for f in found] == [("n0", "power_cap_frac")]
    ev = found[0].evidence()
    assert 0.3 < ev["role_offset"] < 0.45  # its role: ~0.38 above the job's median, learnt in its first windows
    assert ev["value"] > 0.9


def test_a_fault_present_from_the_job_start_is_left_to_the_hardware_own_metrics() -> None:
    """The trade-off rule 5b makes: a node that differs from its first window in the job is its role on a
    work-dependent metric (here its clocks under load, `sm_clock_ratio`); the hardware-own metrics (free
    clocks, link width and rate, error counters) compare it across the class, as before."""
    assert _job(roles=True, fault_at=0) == []
    assert ("n6", "sm_clock_ratio") in {(f.node, f.metric) for f in _job(roles=False, fault_at=0)}
