"""Issue 28, the analyzer's side: a healthy fleet running different work is never called slow.

- like with like: each metric says whether it depends on the work; work-dependent metrics are
  compared only among the nodes of one job, and not at all for a node whose job is unknown;
- a mixed healthy fleet (compute-bound at the power cap, communication-bound with ~10x IB wait,
  memory-bound, idle) gives no finding, while a PCIe link at x8 and clocks low against the node's own
  job are still found; the same fleet judged the old way (everything across the class) is flagged;
- a job's ranks may be uneven by design: a rank is slow only against its own start in the job;
- nothing one node sends moves a median or grows the analyzer's memory: non-finite and impossible
  values are refused at decode (dead-lettered) or dropped (counted), future and stale samples are
  dropped and the open windows stay bounded, a job message speaks for its one known node only.
"""

from __future__ import annotations

import dataclasses
import json
import math
from datetime import datetime, timezone
from typing import Any

import pytest
from pydantic import ValidationError

from fleetmend import subjects
from fleetmend.analyzer import core, metrics
from fleetmend.analyzer.core import Comparator
from fleetmend.analyzer.service import Analyzer, job_comparator
from fleetmend.config import AnalyzerSettings, load_settings
from fleetmend.dev.perfsim import HW, MIXED, PerfFleet
from fleetmend.events import MAX_CLOCK_SKEW_S
from fleetmend.telemetry import GpuPerf, HardwareClass, PerfSample, PortPerf

T0 = 1_800_000_000.0

WORK = {"sm_clock_ratio", "power_cap_frac", "temperature_c", "ib_xmit_wait_per_min", "cpu_freq_ratio"}
HW_OWN = {"power_brake_frac", "hw_slowdown_frac", "thermal_frac", "pcie_width_ratio", "pcie_gen_ratio",
          "pcie_replay_per_min", "nvlink_errors_per_min", "nvlink_down", "ecc_corrected_per_min",
          "ib_symbol_errors_per_min", "ib_link_recovery_per_min", "ib_rcv_errors_per_min", "port_rate_gbps",
          "storage_port_rate_gbps", "sm_clock_free_ratio",
          "cpu_throttle_per_min"}


def test_every_metric_says_whether_it_depends_on_the_work() -> None:
    specs = metrics.SPECS
    assert set(specs) == WORK | HW_OWN
    assert {m for m, s in specs.items() if s.work_dependent} == WORK
    doc = metrics.__doc__ or ""
    for name, s in specs.items():
        assert s.why, f"{name}: say why it is {'work-dependent' if s.work_dependent else 'the hardware own'}"
        row = next(line for line in doc.splitlines() if line.startswith(f"| {name} |"))
        assert row.split("|")[4].strip() == ("work" if s.work_dependent else "hw"), row


def run(fleet: PerfFleet, comp: Comparator, hours: float, jobs: bool = True) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for step in range(int(hours * 60)):
        t = T0 + step * 60 + 30
        for i, n in enumerate(fleet.fleet):
            comp.add(n.name, HW.key, t, fleet.derived(i, t), now=t)
            job = fleet.job_of(i)
            if jobs and job is not None:
                comp.note_job(n.name, job, t, now=t)
        for w in comp.due(t):
            for f in comp.close_window(w).findings:
                found.setdefault(f.node, set()).add(f.metric)
    return found


def class_wide(cfg: AnalyzerSettings) -> Comparator:
    """Today's rule, for contrast: every metric judged across the hardware class."""
    c = Comparator(cfg)
    c.specs = {m: dataclasses.replace(s, work_dependent=False) for m, s in c.specs.items()}
    c.explainer.enabled = False  # nor were co-occurring outliers one finding
    return c


def test_mixed_healthy_fleet_gives_no_finding_but_real_faults_are_found() -> None:
    cfg = AnalyzerSettings()
    healthy = PerfFleet(192, seed=3, workloads=MIXED, job_nodes=16)
    kinds = {j.kind for j in healthy.jobs}
    assert kinds == set(MIXED)
    # the scenario is the defect: judged across the class, healthy nodes are flagged for their work
    old = run(PerfFleet(192, seed=3, workloads=MIXED, job_nodes=16), class_wide(cfg), hours=1.5)
    assert len(old) >= 10 and {m for ms in old.values() for m in ms} & {"ib_xmit_wait_per_min", "power_cap_frac"}
    assert run(healthy, Comparator(cfg), hours=3) == {}
    # two degraded nodes in the same mix: clocks 5 % low against the node's own job, one GPU's PCIe at x8
    fleet = PerfFleet(192, slow_nodes=3, seed=3, workloads=MIXED, job_nodes=16, slow_from=T0 + 1800)
    brake = next(n for n, p in fleet.slow.items() if p == "power_brake")
    next(n for n in fleet.fleet if n.name == brake).pattern = None
    del fleet.slow[brake]
    assert sorted(fleet.slow.values()) == ["clocks", "pcie"]
    clocks = next(n for n in fleet.fleet if n.pattern == "clocks")
    clocks.job.busy, clocks.job.kind = True, "compute-light"  # a busy job for the whole run
    clocks.job.power_cap = 0.2
    found = run(fleet, Comparator(cfg), hours=3)
    assert set(found) == set(fleet.slow), found
    by_pattern = {p: found[n] for n, p in fleet.slow.items()}
    assert "sm_clock_ratio" in by_pattern["clocks"] and "pcie_width_ratio" in by_pattern["pcie"]


def test_a_node_without_a_known_job_is_not_judged_on_work_dependent_metrics() -> None:
    fleet = PerfFleet(64, slow_nodes=1, seed=5, workloads=("compute",), job_nodes=16)  # the clocks pattern
    clocks = next(n for n in fleet.fleet if n.pattern == "clocks")
    clocks.job.busy = True
    assert run(fleet, Comparator(AnalyzerSettings()), hours=1.5, jobs=False) == {}
    c = Comparator(AnalyzerSettings())
    c.add("a", HW.key, T0 + 1, {"sm_clock_ratio": (0.5, "gpu:0")})
    c.note_job("a", "j1", T0 + 2)
    c.note_job("a", "j2", T0 + 3)  # two jobs in one window: which peers? none
    assert c.close_window(c.window_of(T0)).no_job == 0  # one sample: below min_samples, not even counted


def test_uneven_ranks_by_design_are_not_slow_a_rank_that_slows_later_is() -> None:
    cfg = AnalyzerSettings(window_s=60, windows=3)
    c = job_comparator(cfg)
    found = []
    for w in range(12):
        for s in range(6):
            t = T0 + w * 60 + s * 10 + 1
            for rank in range(8):
                sec = 2.0 + 0.01 * ((s + rank) % 3)
                if rank == 0:
                    sec *= 1.10  # by design, the job's whole life
                if rank == 5 and w >= 6:
                    sec *= 1.08  # a GPU that degrades mid-job
                c.add(f"n{rank}/{rank}", "job:j", t, {"job_step_seconds": (sec, f"rank:{rank}")})
        for x in c.due(T0 + (w + 1) * 60 + cfg.grace_s):
            found += c.close_window(x).findings
    assert [(f.node, f.windows) for f in found] == [("n5/5", 3)]
    f = found[0]
    assert f.window_end == T0 + 9 * 60 and f.ratio == pytest.approx(1.08, abs=0.01)
    assert f.baseline == pytest.approx(1.0, abs=0.01) and f.evidence()["baseline_ratio"] == pytest.approx(1.0, abs=0.01)
    b0 = c.baselines["job:j"]["n0/0"][0]
    assert b0 == pytest.approx(1.10, abs=0.01)  # rank 0's own offset, kept for the job's life
    state = json.loads(json.dumps(c.to_state()))
    d = job_comparator(cfg)
    d.load_state(state)
    assert d.baselines["job:j"]["n0/0"][0] == pytest.approx(b0)


@pytest.mark.parametrize("weighted", [True, False])
def test_one_node_speaking_for_many_ranks_moves_the_job_median_as_one_member(weighted: bool) -> None:
    """A node (it may claim up to 1,024 GPUs) reports 16 ranks of an 8-node job: normal for the
    baseline windows, then at half the step time. Weighted as one member (the job comparator), the
    honest ranks keep their median and none is slow; counting its ranks one by one (the control) would
    pull the median down and call every honest rank slow."""
    cfg = AnalyzerSettings(window_s=60, windows=3)
    c = job_comparator(cfg)
    if not weighted:
        c.unit_of = None
    found = []
    for w in range(10):
        for s in range(6):
            t = T0 + w * 60 + s * 10 + 1
            for rank in range(8):
                c.add(f"n{rank}/{rank}", "job:j", t, {"job_step_seconds": (2.0 + 0.01 * ((s + rank) % 3), "r")})
            for rank in range(8, 24):
                c.add(f"liar/{rank}", "job:j", t, {"job_step_seconds": (2.0 if w < 4 else 1.0, "r")})
        for x in c.due(T0 + (w + 1) * 60 + cfg.grace_s):
            found += c.close_window(x).findings
    honest = sorted({f.node for f in found if not f.node.startswith("liar/")})
    assert honest == ([] if weighted else [f"n{r}/{r}" for r in range(8)])


@pytest.mark.parametrize("quota", [True, False])
def test_one_node_claiming_many_ranks_cannot_crowd_out_the_honest_ranks_offsets(
        quota: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node that claims 1,024 GPUs (the schema's most) reports 1,024 new ranks of each of 2 made-up
    jobs in a window: with a fleet-wide room for 1,500 offsets (`MAX_BASELINE_MEMBERS` scaled down
    from 200,000 with the fleet), it may hold at most `MAX_BASELINE_PER_UNIT` of them, so an
    honest 8-node job that starts next still learns its ranks' offsets and its rank 5, slower from
    window 6, is found. Without the per-node share (the control) the one node fills the room and
    no honest rank is ever judged."""
    monkeypatch.setattr(core, "MAX_BASELINE_MEMBERS", 1500)
    if not quota:
        monkeypatch.setattr(core, "MAX_BASELINE_PER_UNIT", 10**9)
    cfg = AnalyzerSettings(window_s=60, windows=3)
    c = job_comparator(cfg)
    found = []
    for w in range(12):
        for s in range(3):
            t = T0 + w * 60 + s * 10 + 1
            if w < 2:
                for job in ("x1", "x2"):
                    for rank in range(1024):
                        c.add(f"liar/{w}-{rank}", f"job:{job}", t, {"job_step_seconds": (1.0, "r")})
            if w >= 1:
                for rank in range(8):
                    sec = 2.0 + 0.01 * ((s + rank) % 3)
                    if rank == 5 and w >= 6:
                        sec *= 1.08
                    c.add(f"n{rank}/{rank}", "job:j", t, {"job_step_seconds": (sec, f"rank:{rank}")})
        for x in c.due(T0 + (w + 1) * 60 + cfg.grace_s):
            found += c.close_window(x).findings
    assert [f.node for f in found] == (["n5/5"] if quota else [])
    if quota:
        assert c.dropped["baselines_unit_full"] > 0 and c._unit_members["liar"] == core.MAX_BASELINE_PER_UNIT
    else:
        assert c.dropped["baselines_full"] > 0


def _ports_sample(node: str, t: float, storage_wait: int) -> PerfSample:
    """A busy 8-GPU node with 4 compute rails (2e6 wait ticks each a minute) and a storage HCA."""
    ports = [PortPerf(name=f"mlx5_{p}/1", role="compute", rate_gbps=400.0, xmit_wait_delta=2_000_000)
             for p in range(4)]
    ports.append(PortPerf(name="mlx5_4/1", role="storage", rate_gbps=200.0, xmit_wait_delta=storage_wait))
    return PerfSample(cluster="c", node=node, at=datetime.fromtimestamp(t, timezone.utc), interval_s=60,
                      hw=HardwareClass(gpu_model="NVIDIA H200", gpu_count=8, driver="570"),
                      gpus=[GpuPerf(index=i, util_pct=96, sm_clock_mhz=1950, sm_clock_max_mhz=1980) for i in range(8)],
                      ports=ports)


@pytest.mark.parametrize("by_role", [True, False])
def test_a_rank_writing_the_checkpoint_is_not_slow_on_ib_wait(by_role: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point 6, NICs by role: the IB wait a job's nodes are compared on is their compute rails'. A
    16-node job whose node 0 writes the checkpoint (its storage HCA waits 10^8 ticks a minute, 12x
    its rails' sum) is not an outlier on `ib_xmit_wait_per_min`; summing the storage port in (the
    control, the derivation before) flagged it."""
    if not by_role:
        real = metrics.derive

        def summed(sample: PerfSample, busy_util_pct: float = 50.0) -> tuple[bool, metrics.Derived]:
            busy, out = real(sample, busy_util_pct)
            wait = sum(p.xmit_wait_delta or 0 for p in sample.ports) * 60.0 / sample.interval_s
            return busy, {**out, "ib_xmit_wait_per_min": (float(wait), "port:mlx5_4/1")}
        monkeypatch.setattr(metrics, "derive", summed)
    c = Comparator(AnalyzerSettings())
    c._judge_by_role = lambda *a: {}  # type: ignore[method-assign]  # the NICs' roles alone (not rule 5b's)
    found = []
    for w in range(6):
        for k in range(5):
            t = T0 + w * 300 + k * 60 + 1
            for n in range(16):
                sample = _ports_sample(f"n{n}", t, 100_000_000 if n == 0 else 1_000 * (n % 3))
                _busy, derived = metrics.derive(sample)
                c.add(sample.node, sample.hw.key, t, derived)
                c.note_sched(sample.node, "j1", t)
        found += c.close_window(c.window_of(T0 + w * 300 + 1)).findings
    if by_role:
        assert metrics.derive(_ports_sample("n0", T0, 10**8))[1]["ib_xmit_wait_per_min"][0] == 4 * 2_000_000
    assert [(f.node, f.metric) for f in found] == ([] if by_role else [("n0", "ib_xmit_wait_per_min")])


def _sample(node: str, t: float, **gpu: Any) -> PerfSample:
    return PerfSample(cluster="c", node=node, at=datetime.fromtimestamp(t, timezone.utc), interval_s=60,
                      hw=HardwareClass(gpu_model="NVIDIA H200", gpu_count=8, driver="570"),
                      gpus=[GpuPerf(index=i, util_pct=96, sm_clock_mhz=1950, sm_clock_max_mhz=1980, **gpu)
                            for i in range(8)])


@pytest.mark.parametrize("patch", [
    {"temperature_c": "NaN"}, {"temperature_c": "Infinity"}, {"sm_clock_mhz": "-Infinity"}, {"temperature_c": 1e999},
    {"event_frac": {"power_brake": "NaN"}}, {"event_frac": {"power_brake": 1.5}}, {"util_pct": 250},
    {"pcie_replay_delta": -3}, {"temperature_c": 900},
])
def test_non_finite_and_impossible_readings_are_refused_at_decode(patch: dict) -> None:
    body = json.loads(_sample("n1", T0).to_json_bytes())
    for k, v in patch.items():
        body["gpus"][0][k] = v
    raw = json.dumps(body).replace('"NaN"', "NaN").replace('"Infinity"', "Infinity").replace('"-Infinity"', "-Infinity")
    with pytest.raises(ValidationError):
        PerfSample.from_json_bytes(raw.encode())


def test_one_node_sending_nan_cannot_move_the_median() -> None:
    c = Comparator(AnalyzerSettings())
    nan, inf = math.nan, math.inf
    for m in range(20):
        t = T0 + m * 60 + 1
        for n in range(16):
            bad = n == 0
            c.add(f"n{n}", HW.key, t, {"power_brake_frac": (nan if bad and m % 2 else (inf if bad else 0.0), "gpu:0"),
                                       "pcie_width_ratio": (7.0 if bad else 1.0, "gpu:0")}, now=t)
    found = [f for w in c.due(1e12) for f in c.close_window(w).findings]
    assert found == []
    assert c.dropped["non_finite:power_brake_frac"] == 20 and c.dropped["out_of_range:pcie_width_ratio"] == 20


def test_future_and_stale_samples_are_dropped_and_memory_stays_bounded() -> None:
    cfg = AnalyzerSettings()
    c = Comparator(cfg)
    now = T0
    for i in range(20_000):
        t = now + (i % 997) * 3600.0 * (1 if i % 2 else -1)  # up to 41 days ahead and behind
        c.add(f"n{i % 50}", HW.key, t, {"power_brake_frac": (0.0, "gpu:0")}, now=now)
    for _ in range(100):  # a node flooding one window
        c.add("n0", HW.key, now + 1, {"power_brake_frac": (0.0, "gpu:0")}, now=now)
    bound = (cfg.window_s + cfg.grace_s + 2 * MAX_CLOCK_SKEW_S) / cfg.window_s + 2
    assert len(c.open) <= bound and c.dropped["future"] > 9_000 and c.dropped["stale"] > 9_000
    assert sum(len(w) for w in c.open.values()) <= 50 * len(c.open)
    for _ in range(1000):
        c.add("n1", HW.key, now + 2, {"power_brake_frac": (0.0, "gpu:0")}, now=now)
    assert c.dropped["flood"] > 0 and max(nw.n for w in c.open.values() for nw in w.values()) <= 600
    kept = c.open[c.window_of(now + 2)]["n1"].values["power_brake_frac"]
    assert 32 <= len(kept) < core.MAX_VALUES_PER_METRIC  # thinned, not grown: the median spans the window


def test_made_up_node_names_and_departed_nodes_do_not_grow_the_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core, "MAX_NODES_PER_WINDOW", 100)
    cfg = AnalyzerSettings(window_s=60)
    c = Comparator(cfg)
    for i in range(1000):  # a NATS without node credentials: any name can arrive
        c.add(f"made-up-{i}", f"group-{i}", T0 + 1, {"power_brake_frac": (0.0, "gpu:0")}, now=T0)
    assert len(c.open[c.window_of(T0)]) == 100 and c.dropped["too_many_nodes"] == 900
    # a node outlying for two windows that then leaves: its streak is forgotten within STREAK_TTL_S
    d = Comparator(cfg)
    for w in range(int(core.STREAK_TTL_S // 60) + 4):
        t = T0 + w * 60 + 1
        for n in range(10):
            if n == 0 and w >= 2:
                continue
            for k in range(3):
                d.add(f"n{n}", HW.key, t + k, {"power_brake_frac": (0.5 if n == 0 else 0.0, "gpu:0")})
        d.close_window(d.window_of(t))
        if w == 1:
            assert d.streaks["n0"]["power_brake_frac"][0] == 2
    assert d.streaks == {}


# ---------------------------------------------------------------------- the service's door (no NATS)

class FakeJS:
    def __init__(self) -> None:
        self.published: list[tuple[str, dict]] = []

    async def publish(self, subject: str, data: bytes, **_: Any) -> None:
        self.published.append((subject, json.loads(data)))


@dataclasses.dataclass
class Msg:
    subject: str
    data: bytes


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def analyzer(now: float) -> tuple[Analyzer, FakeJS]:
    js = FakeJS()
    s = load_settings(None, cluster="c", analyzer={"window_s": 60, "grace_s": 5})
    return Analyzer(s, None, js, None, holder="t", clock=Clock(now), lease_clock=Clock(now)), js


def job_msg(job: str, rows: list, sender: str | None = None) -> Msg:
    """A job message on the subject of `sender` (default: the node its first row names)."""
    sender = sender if sender is not None else (rows[0][1] if rows else "n0")
    return Msg(subjects.job_subject("c", sender, job),
               json.dumps({"v": 1, "cluster": "c", "job": job, "steps": rows}, allow_nan=True).encode())


async def test_a_nan_perf_sample_is_dead_lettered_and_a_future_one_dropped() -> None:
    a, js = analyzer(T0)
    body = _sample("n1", T0).to_json_bytes().replace(b'"temperature_c"', b'"x"')
    bad = json.loads(body)
    bad["gpus"][0]["temperature_c"] = 1.0
    raw = json.dumps(bad).replace('"temperature_c": 1.0', '"temperature_c": NaN').encode()
    await a._on_msg(Msg("fleet.c.perf.n1", raw))
    assert a.rejected == 1 and "finite" in js.published[0][1]["reason"]
    await a._on_msg(Msg("fleet.c.perf.n1", _sample("n1", T0 + MAX_CLOCK_SKEW_S + 60).to_json_bytes()))
    await a._on_msg(Msg("fleet.c.perf.n1", _sample("n1", T0 + 10).to_json_bytes()))
    assert a.comparator.dropped["future"] == 1 and len(a.comparator.open) == 1


async def test_a_job_message_speaks_for_its_one_known_node_only() -> None:
    a, js = analyzer(T0)
    dotted = "ip-10-0-1-3.ec2.internal"
    for n in ["n0", "n1", dotted]:
        a.add(_sample(n, T0 + 1))
    reasons = []
    for rows in ([[0, "n0", 1, 1.0, T0 + 2], [1, "n1", 1, 1.0, T0 + 2]],  # speaks for another node too
                 [[r, "n0", 1, 1.0, T0 + 2] for r in range(9)],  # more ranks than the node has GPUs
                 [[0, "n0", 1, math.nan, T0 + 2]], [[0, "n0", 1, -1.0, T0 + 2]]):
        await a._on_job_msg(job_msg("j1", rows))
        reasons.append(js.published[-1][1]["reason"])
    assert a.rejected == 4 and a.job_steps == 0, reasons
    assert "names 2 nodes" in reasons[0] and "9 ranks" in reasons[1] and "finite" in reasons[2]
    for rows in ([[0, "victim", 1, 1.0, T0 + 2]],  # a node with no perf sample: made up
                 [[0, "ip-10-0-1-3-ec2-internal", 1, 1.0, T0 + 2]]):  # the old client's mangled name
        await a._on_job_msg(job_msg("j1", rows))
    assert a.jobs.dropped["unknown_node"] == 2 and a.rejected == 4 and a.job_steps == 0
    await a._on_job_msg(job_msg("j1", [[2, dotted, 1, 1.0, T0 + 2], [3, dotted, 1, 1.1, T0 + 3]]))
    assert a.job_steps == 2 and a.rejected == 4
    assert {k for w in a.jobs.open.values() for k in w} == {f"{dotted}/2", f"{dotted}/3"}
    assert a.comparator.open[a.comparator.window_of(T0)][dotted].jobs == {"j1"}
    # one rank per message does not get round the cap: at most its 8 GPUs' ranks of a job per window
    for r in range(9):
        await a._on_job_msg(job_msg("j2", [[r, "n1", 1, 1.0, T0 + 2]]))
    assert a.rejected == 5 and "9 ranks of job j2 in one window" in js.published[-1][1]["reason"]
    assert {k for w in a.jobs.open.values() for k in w if k.startswith("n1/")} == {f"n1/{r}" for r in range(8)}
    for job in ("j3", "j4", "j5", "j6"):  # nor do many jobs at once
        await a._on_job_msg(job_msg(job, [[0, "n1", 1, 1.0, T0 + 2]]))
    assert a.rejected == 6 and "more than 4 jobs" in js.published[-1][1]["reason"]


async def test_a_job_message_speaks_for_the_sender_of_its_subject_only() -> None:
    """The subject names the sender (its credentials allow only `fleet.<c>.job.<its token>.*`): rows
    naming another known node, a body naming another job, or the old subject without a sender are
    dead-lettered with the reason, and nothing reaches the comparators."""
    a, js = analyzer(T0)
    dotted = "ip-10-0-1-3.ec2.internal"
    for n in ["n0", "victim", dotted]:
        a.add(_sample(n, T0 + 1))
    await a._on_job_msg(job_msg("j1", [[0, "victim", 1, 9.0, T0 + 2]], sender="n0"))
    assert "'victim' but 'n0' sent them" in js.published[-1][1]["reason"]
    other = job_msg("j1", [[0, "n0", 1, 1.0, T0 + 2]])
    await a._on_job_msg(Msg(subjects.job_subject("c", "n0", "j2"), other.data))
    assert "names job 'j1'" in js.published[-1][1]["reason"]
    await a._on_job_msg(Msg("fleet.c.job.j1", other.data))
    assert "not a job subject" in js.published[-1][1]["reason"]
    await a._on_job_msg(Msg("fleet.c.job.ip-10-0-1-3-ec2-internal.j1",  # a token that is not the dotted name's
                            job_msg("j1", [[0, dotted, 1, 1.0, T0 + 2]]).data))
    assert "'ip-10-0-1-3-ec2-internal' sent them" in js.published[-1][1]["reason"]
    assert a.rejected == 4 and a.job_steps == 0 and not a.jobs.open
    await a._on_job_msg(job_msg("j1", [[0, dotted, 1, 1.0, T0 + 2]]))
    assert a.job_steps == 1 and a.rejected == 4
    assert subjects.job_subject("c", dotted, "j1") == "fleet.c.job.ip-10-0-1-3=2Eec2=2Einternal.j1"
