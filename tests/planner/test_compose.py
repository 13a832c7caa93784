"""Composition against brute force on small synthetic frontiers."""

import itertools
import random

import pytest

from kareus.passes.decide import Choice
from kareus.planner.compose import (
    FrontierPoint,
    combine,
    front,
    step_frontier,
    variants_frontier,
)

P = FrontierPoint


def brute_front(options):
    def dominated(o):
        return any(p.time_s <= o.time_s and p.effective_energy_j <= o.effective_energy_j
                   and (p.time_s, p.effective_energy_j) != (o.time_s, o.effective_energy_j)
                   for p in options)

    return sorted({(o.time_s, o.effective_energy_j) for o in options if not dominated(o)})


def random_part(rng, n, name):
    return [FrontierPoint(rng.randint(1, 30), rng.randint(1, 30), f"{name}{i}") for i in range(n)]


@pytest.mark.parametrize("seed", range(20))
def test_combining_parts_matches_every_combination(seed):
    rng = random.Random(seed)
    parts = [random_part(rng, rng.randint(1, 6), name) for name in "abcd"]
    every = [
        FrontierPoint(sum(o.time_s for o in combo), sum(o.effective_energy_j for o in combo),
               tuple(o.choice for o in combo))
        for combo in itertools.product(*parts)
    ]
    combined = combine(parts)
    assert [(o.time_s, o.effective_energy_j) for o in combined] == brute_front(every)
    by_choice = {o.choice: o for o in every}
    for o in combined:  # each point's choice is a real combination with these totals
        assert (by_choice[o.choice].time_s, by_choice[o.choice].effective_energy_j) == (
            o.time_s, o.effective_energy_j)


def test_a_part_without_options_leaves_nothing():
    assert combine([[FrontierPoint(1, 1)], []]) == []
    assert front([]) == []


def test_repeated_layers_may_take_different_points():
    layer = [FrontierPoint(1, 10, "fast"), FrontierPoint(2, 4, "slow")]
    combined = combine([layer, layer])
    assert [(o.time_s, o.effective_energy_j) for o in combined] == [(2, 20), (3, 14), (4, 8)]
    assert combined[1].choice in (("fast", "slow"), ("slow", "fast"))


def test_the_graph_frontier_spans_clocks_and_counts():
    variants = {
        (2, 1410): (P(5, 50), [[P(1, 10, "p0@1410")], [P(2, 20, "p1@1410")]]),
        (2, 1200): (P(6, 40), [[P(1.2, 8, "p0@1200")], [P(2.4, 16, "p1@1200")]]),
        (4, 1410): (P(5, 60), [[P(0.5, 12, "x")], [P(1, 30, "y")]]),
        (2, 900): (P(9, 10), [[P(2, 5, "z")], []]),  # p1 unmeasured at 900
    }
    frontier = variants_frontier(variants)
    assert [(o.choice.nanobatches, o.choice.clock_mhz) for o in frontier] == [
        (4, 1410), (2, 1410), (2, 1200)]
    assert frontier[1] == FrontierPoint(8, 80, Choice(2, 1410, ("p0@1410", "p1@1410")))


def test_the_step_adds_switches_and_static_energy_once():
    forward = [FrontierPoint(1.0, 10.0, 1410), FrontierPoint(1.5, 7.0, 1200)]
    backward = [FrontierPoint(2.0, 20.0, 1410), FrontierPoint(3.0, 14.0, 1200)]

    def switch(a, b):
        return (0.1, 0.5) if a != b else (0.0, 0.0)

    points = step_frontier([forward, backward], repeats=2, static_power_w=100.0, switch=switch)
    every = {}
    for f, b in itertools.product(forward, backward):
        t = 2 * (f.time_s + b.time_s + (0.2 if f.choice != b.choice else 0.0))
        eff = 2 * (f.effective_energy_j + b.effective_energy_j
                   + (1.0 if f.choice != b.choice else 0.0))
        every[(f.choice, b.choice)] = (t, eff + 100.0 * t)
    for p in points:
        assert (p.time_s, p.energy_j) == pytest.approx(every[p.graphs])
    best = sorted(every.values())
    assert points[0].time_s == best[0][0] and points[0].energy_j == best[0][1]
    assert all(a.time_s < b.time_s and a.energy_j > b.energy_j
               for a, b in itertools.pairwise(points))
    # nothing off the returned frontier dominates a point on it
    for t, e in every.values():
        assert not any(t <= p.time_s and e < p.energy_j for p in points)
