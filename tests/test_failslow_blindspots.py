"""Issue 28, point 6: no silent blind spots (the comparator, no servers).

A clock that moves in 15 MHz steps must not hide a 5 % slowdown behind a MAD of one step."""

from __future__ import annotations

import dataclasses
import random

import pytest

from fleetmend.analyzer.core import Comparator, quantized_mad, window_value
from fleetmend.analyzer.metrics import SPECS
from fleetmend.config import AnalyzerSettings

T0 = 1_800_000_000.0
STEP = 15 / 1980


def test_the_interpolated_mad_of_a_quantized_metric() -> None:
    q = 1.0
    assert quantized_mad([5.0] * 10, 5.0, q) == pytest.approx(0.25)  # all at the median: a quarter step floor
    vals = [5.0] * 45 + [6.0] * 55  # 45 % at the median, 55 % one step off: plain MAD 1 step
    assert quantized_mad(vals, 5.0, 0.0) == 1.0
    assert quantized_mad(vals, 5.0, q) == pytest.approx(0.5 + 0.05 / 0.55)
    wide = [float(x) for x in range(-40, 41)]  # a spread of many steps: the plain MAD, within a step
    assert abs(quantized_mad(wide, 0.0, q) - quantized_mad(wide, 0.0, 0.0)) <= q
    assert window_value([1.0, 1.0, 0.0, 1.0, 0.0], STEP) == pytest.approx(2 / 3)  # between the steps
    assert window_value([1.0, 1.0, 1.0, 1.0, 100.0], STEP) == 1.0  # one spike cannot move it
    assert SPECS["sm_clock_ratio"].quantum == pytest.approx(STEP) and SPECS["temperature_c"].quantum == 1.0


def _clocks_job(seed: int, quantum: bool) -> list[str]:
    """64 nodes of one job, clocks under 2 % jitter (a 40 MHz σ below the 1,980 MHz maximum, in
    15 MHz steps), one sample a minute; n0 has every GPU 5 % slow. Returns the nodes found."""
    rng = random.Random(seed)
    c = Comparator(AnalyzerSettings())
    if not quantum:  # the rule before: median of samples, plain MAD
        c.specs = {k: dataclasses.replace(v, quantum=0.0) for k, v in c.specs.items()}
    found: list[str] = []
    for w in range(12):
        for k in range(5):
            t = T0 + w * 300 + k * 60 + 1
            for n in range(64):
                mhz = min(1980.0, 1980 * (0.95 if n == 0 else 1.0) - abs(rng.gauss(0, 40)))
                c.add(f"n{n}", "H", t, {"sm_clock_ratio": (round(mhz / 15) * 15 / 1980, "gpu:0")})
                c.note_job(f"n{n}", "j", t)
        found += [f.node for f in c.close_window(c.window_of(T0 + w * 300 + 1)).findings]
    return found


@pytest.mark.parametrize("seed", range(4))
def test_a_5_percent_slow_clock_under_2_percent_jitter_is_found(seed: int) -> None:
    assert _clocks_job(seed, quantum=True) == ["n0"]
    assert _clocks_job(seed, quantum=False) == []  # the blind spot issue 28 measured


def _bursts(bursty: bool) -> list[str]:
    """30 nodes, one sample a minute. n0's IB port bursts (20 symbol errors/min) in every third
    sample; n1 bursts once in every window (a heavy-tailed healthy counter); the rest are clean."""
    c = Comparator(AnalyzerSettings())
    if not bursty:  # the rule before: the window median
        c.specs = {k: dataclasses.replace(v, bursty=False) for k, v in c.specs.items()}
    found: list[str] = []
    i = 0
    for w in range(8):
        for k in range(5):
            t = T0 + w * 300 + k * 60 + 1
            i += 1
            for n in range(30):
                v = 20.0 if (n == 0 and i % 3 == 0) or (n == 1 and k == 2) else 0.0
                c.add(f"n{n}", "H", t, {"ib_symbol_errors_per_min": (v, "port:mlx5_0/1")})
        found += [f.node for f in c.close_window(c.window_of(T0 + w * 300 + 1)).findings]
    return found


def test_bursty_counters_are_judged_by_how_often_they_exceed() -> None:
    assert window_value([0.0, 0.0, 20.0, 0.0, 0.0], bursty=True) == 0.0  # one burst is nothing
    assert window_value([0.0, 20.0, 0.0, 0.0, 20.0], bursty=True) == 20.0
    assert _bursts(bursty=True) == ["n0"]
    assert _bursts(bursty=False) == []  # the window median is 0: the blind spot issue 28 measured
