"""The calibration records and their judging (tolerances, ranges, known misses), and the
probes' process group; the points themselves are checked in test_simulated.py."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from calibration import POINTS, QUANTITIES, TOLERANCES, DataPoint
from conftest import init_fake_pg
from probes import _PREDICTORS, fake_world, predict

from kareus.devices import preset_names

H200 = "sim:h200"


def point(quantity: str = "all_reduce_us", value: float = 100.0, **kw) -> DataPoint:
    return DataPoint(H200, quantity, value, "a source", kw.pop("role", "fidelity"), **kw)


def test_every_quantity_has_a_tolerance_class_and_a_prediction():
    assert {q.kind for q in QUANTITIES.values()} <= set(TOLERANCES)
    assert set(_PREDICTORS) == set(QUANTITIES)


def test_points_are_labelled_uniquely_and_cite_a_source():
    assert len({p.label for p in POINTS}) == len(POINTS)
    assert all(p.source and p.preset in preset_names() for p in POINTS)
    assert {p.role for p in POINTS} == {"input", "fidelity"}


@pytest.mark.parametrize(
    ("quantity", "low", "high"),
    [("all_reduce_us", 90.0, 110.0), ("gemm_power_w", 85.0, 115.0)],
    ids=["time-10%", "power-15%"],
)
def test_relative_tolerance_by_quantity_class(quantity, low, high):
    p = point(quantity)
    assert p.band == pytest.approx((low, high))
    assert p.passes(low * 1.0001) and p.passes(high * 0.9999)
    assert not p.passes(low * 0.999) and not p.passes(high * 1.001)
    assert p.error(105.0) == pytest.approx(0.05) and p.error(80.0) == pytest.approx(-0.2)


def test_ratios_are_judged_absolutely():
    p = point("memory_clock_saving", 0.32)
    assert p.band == pytest.approx((0.29, 0.35))
    assert p.error(0.25) == pytest.approx(-0.07)
    assert p.verdict(0.34) == "PASS" and p.verdict(0.36) == "FAIL"


def test_a_published_range_widens_by_the_tolerance_and_errs_from_its_nearer_end():
    p = point("idle_power_w", 85.0, published_low=75.0, published_high=100.0)
    assert p.band == pytest.approx((75 * 0.85, 100 * 1.15))
    assert p.error(90.0) == 0.0
    assert p.error(120.0) == pytest.approx(0.2)
    assert p.error(60.0) == pytest.approx(-0.2)


def test_a_known_miss_is_explained_not_hidden():
    p = point(known_miss="protocol switch not modelled")
    assert p.verdict(200.0) == "explained"
    assert p.verdict(100.0) == "PASS"  # the miss went away: reported as a pass


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"quantity": "speed"}, "unknown quantity"),
        ({"role": "guess"}, "role must be"),
        ({"published_low": 1.0}, "needs both"),
        ({"published_low": 1.0, "published_high": 2.0}, "outside the published range"),
    ],
    ids=["quantity", "role", "half-range", "value-outside"],
)
def test_malformed_points_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        point(**kw)


def test_best_of_sizes_is_the_best_single_size():
    sizes = (1024, 4096)
    best = predict(point("gemm_tflops", 1.0, params=(("square_sizes", sizes),)))
    each = [predict(point("gemm_tflops", 1.0, params=(("shape", (s, s, s)),))) for s in sizes]
    assert best == max(each)


def test_fake_world_makes_a_group_only_when_none_exists():
    assert not dist.is_initialized()
    with fake_world() as group:
        assert dist.get_world_size() == 8 and group == dist.group.WORLD.group_name
        with fake_world() as inner:  # reused, not replaced
            assert inner == group
        assert dist.is_initialized()
    assert not dist.is_initialized()
    init_fake_pg(2)
    try:
        with pytest.raises(ValueError, match="2 ranks"), fake_world():
            pass
        assert dist.get_world_size() == 2
    finally:
        dist.destroy_process_group()
