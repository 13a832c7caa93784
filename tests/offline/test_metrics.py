"""The method's metrics, by hand on small frontiers."""

from types import SimpleNamespace as C

import pytest

from kareus.offline.metrics import max_throughput, reductions, summary

PERSEUS = [C(time_s=10.0, energy_j=100.0), C(time_s=12.0, energy_j=90.0),
           C(time_s=15.0, energy_j=85.0)]
KAREUS = [C(time_s=9.0, energy_j=95.0), C(time_s=11.0, energy_j=80.0),
          C(time_s=14.0, energy_j=75.0)]


def test_iso_time_and_iso_energy_take_the_best_plan_within_without_interpolating():
    r = reductions(KAREUS, PERSEUS)
    # at 10 s: only the 9 s plan is in time (95 J); within 100 J the fastest is 9 s
    assert r[0].energy_at_iso_time == pytest.approx(0.05)
    assert r[0].time_at_iso_energy == pytest.approx(0.1)
    # at 12 s: 80 J (the 11 s plan) against 90 J; within 90 J: 11 s against 12 s
    assert r[1].energy_at_iso_time == pytest.approx(1 - 80 / 90)
    assert r[1].time_at_iso_energy == pytest.approx(1 - 11 / 12)
    # at 15 s: 75 J against 85 J; within 85 J the fastest is 11 s
    assert r[2].energy_at_iso_time == pytest.approx(1 - 75 / 85)
    assert r[2].time_at_iso_energy == pytest.approx(1 - 11 / 15)


def test_a_point_nothing_reaches_has_no_reduction():
    (r,) = reductions([C(time_s=20.0, energy_j=200.0)], [C(time_s=10.0, energy_j=100.0)])
    assert r.energy_at_iso_time is None and r.time_at_iso_energy is None
    assert summary([None, 0.1, 0.3]) == {"max": 0.3, "mean": pytest.approx(0.2), "points": 2.0}
    assert summary([None]) == {"max": None, "mean": None, "points": 0.0}


def test_maximum_throughput_is_the_fastest_plan_against_the_baseline():
    t = max_throughput(KAREUS, C(time_s=10.0, energy_j=100.0))
    assert (t.time_s, t.energy_j) == (9.0, 95.0)
    assert t.time_reduction == pytest.approx(0.1) and t.energy_reduction == pytest.approx(0.05)
