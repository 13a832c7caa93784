"""A plan is never worse than doing nothing: random small steps against brute force.

Each graph has points at a few clocks (the unrewritten graph at every clock among them, as
``planner.graph`` makes them); a clock switch between consecutive graphs stalls the GPU at
static power. The step's frontier must be the Pareto set of every combination, switches
counted; the baseline (every graph unrewritten at the default clock, no switch) on it or
dominated by a point of it; and every budget the baseline meets met.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest

from kareus.passes.decide import Choice
from kareus.passes.ops import DEFAULT_CLOCK_MHZ
from kareus.planner.budget import Budget
from kareus.planner.compose import FrontierPoint, fronts_by
from kareus.planner.graph import GraphFrontier
from kareus.planner.plan import make_plan

CLOCKS = (DEFAULT_CLOCK_MHZ, 1500, 1200)


@dataclass(frozen=True)
class _Device:
    """What planning reads of a device."""

    static_power_w: float
    clock_switch_s: float
    power_limit_w: float = 700.0
    identity: str = "fake"
    model_version: str | None = None


def _graph(rng: random.Random, index: int) -> GraphFrontier:
    points = []
    base_time = rng.uniform(1e-4, 1e-2)
    for clock in CLOCKS:
        slower = 1.0 if clock == DEFAULT_CLOCK_MHZ else rng.uniform(1.0, 1.4)
        energy = base_time * rng.uniform(50, 300) * (1 if clock == DEFAULT_CLOCK_MHZ
                                                     else rng.uniform(0.5, 1.1))
        points.append(FrontierPoint(base_time * slower, energy, Choice(1, clock)))
        for slot in range(rng.randint(0, 2)):  # rewritten variants at this clock
            points.append(FrontierPoint(base_time * slower * rng.uniform(0.6, 1.5),
                                        energy * rng.uniform(0.6, 1.5),
                                        Choice(2, clock, ((slot, None),))))
    unrewritten = tuple(p for p in points if p.choice.nanobatches == 1)
    return GraphFrontier(f"r{index}/g", f"{index:016x}", tuple(points), unrewritten,
                         unrewritten[0])


def _brute_force(graphs, device, repeats):
    """Every combination of the graphs' points, switches and static power counted."""
    costs = []
    for combo in itertools.product(*(g.points for g in graphs)):
        clocks = [p.choice.clock_mhz for p in combo]
        switches = sum(a != b for a, b in zip(clocks, clocks[1:] + clocks[:1]))
        time_s = repeats * (sum(p.time_s for p in combo) + switches * device.clock_switch_s)
        effective = repeats * sum(p.effective_energy_j for p in combo)
        costs.append((time_s, effective + device.static_power_w * time_s))
    return costs


def _same(a, b, rel=1e-9):
    return all(abs(x - y) <= rel * max(abs(x), abs(y)) for x, y in zip(a, b))


def _covers(a, b, rel=1e-9):
    """``a`` is at least as fast and as frugal as ``b`` (to rounding)."""
    return all(x <= y * (1 + rel) for x, y in zip(a, b))


@pytest.mark.parametrize("seed", range(40))
def test_the_plan_is_never_worse_than_the_baseline_and_meets_what_it_meets(seed):
    rng = random.Random(seed)
    graphs = [_graph(rng, i) for i in range(rng.randint(2, 6))]
    # switches from negligible to far longer than a graph (a launch-bound step)
    device = _Device(static_power_w=rng.uniform(50, 120),
                     clock_switch_s=rng.choice([0.0, 1e-4, 3e-2]))
    repeats = rng.choice([1, 2])
    plan = make_plan(graphs, Budget("fastest"), device, {}, "0", repeats)
    base = plan.baseline
    costs = _brute_force(graphs, device, repeats)
    # the step's frontier is brute force's Pareto set: each of its points is a
    # combination's cost, and every combination is matched or beaten by one of them
    front = [(p.time_s, p.energy_j) for p in plan.frontier]
    assert all(any(_same(f, c) for c in costs) for f in front)
    assert all(any(_covers(f, c) for f in front) for c in costs)
    assert any(_same((base.time_s, base.energy_j), c) for c in costs)
    for budget in (Budget("fastest"), Budget("energy", fraction=1.0),
                   Budget("time", fraction=1.0), Budget("time", fraction=1.5),
                   Budget("tradeoff", value=0.5), Budget("tradeoff", value=1.0)):
        chosen = make_plan(graphs, budget, device, {}, "0", repeats).predicted
        assert not (chosen.time_s > base.time_s * (1 + 1e-9)
                    and chosen.energy_j > base.energy_j * (1 + 1e-9)), budget
        if budget.kind == "energy":
            assert chosen.energy_j <= base.energy_j * (1 + 1e-9)
        if budget.kind == "time":
            assert chosen.time_s <= budget.fraction * base.time_s * (1 + 1e-9)


def test_adjacent_graphs_share_a_clock_where_a_switch_costs_more_than_it_saves():
    """Each graph alone would rather run at 1200 MHz or 1500 MHz, but not the same one; a
    switch stalls far longer than either saves, so the step runs both at one clock."""
    def graph(index, low):
        points = (FrontierPoint(1e-3, 0.20, Choice(1, DEFAULT_CLOCK_MHZ)),
                  FrontierPoint(1.1e-3, 0.10, Choice(1, low)),
                  FrontierPoint(1.2e-3, 0.19, Choice(1, 2700 - low)))
        return GraphFrontier(f"r{index}/g", f"{index:016x}", points, points, points[0])

    graphs = [graph(0, 1200), graph(1, 1500)]
    # per graph the other low clock is dominated, yet it is kept: it may save a switch
    assert len(fronts_by(graphs[0].points, lambda c: c.clock_mhz)) == 3
    device = _Device(static_power_w=100.0, clock_switch_s=3e-2)
    plan = make_plan(graphs, Budget("time", fraction=1.2), device, {}, "0")
    clocks = {g.choice.clock_mhz for g in plan.graphs}
    assert len(clocks) == 1, plan.graphs
    assert plan.predicted.energy_j < plan.baseline.energy_j
