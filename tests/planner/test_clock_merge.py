"""Merging clocks a plan hardly gains by: what merges, what it may lose, and that a plan's
stated gap counts the loss against the full options' optimum (by brute force)."""

from __future__ import annotations

import pytest
from test_pipeline_dag import _brute_force, _least

from kareus.planner.clock_merge import merge_clocks, uniform_switch
from kareus.planner.compose import FrontierPoint as P
from kareus.planner.pipeline import (
    EnergyModel,
    _merge_loss,
    _Solver,
    least_energy,
    one_f_one_b,
    pipeline_frontier,
)

SWITCH = EnergyModel(0.0, switch=lambda a, b: (0.05, 0.0), switch_key=lambda c: c[0])
"""Choices are (clock, name), as ``test_pipeline_dag``'s brute force takes them."""


def _options(twin_j: float = 0.01, tail_j: float = 0.02) -> dict:
    """Each (stage, kind) at clock 3 (fastest), clock 2 (as fast, ``twin_j`` dearer), clock
    1 (slower, much cheaper) and clock 0 (slower still, ``tail_j`` cheaper than 1)."""
    out = {}
    for s in range(2):
        for kind, scale in (("forward", 1.0), ("backward", 2.0)):
            t = scale * (1.0 + 0.1 * s)
            out[s, kind] = [P(t, 40 * scale, (3, kind)), P(t, 40 * scale + twin_j, (2, kind)),
                            P(1.3 * t, 30 * scale, (1, kind)),
                            P(1.6 * t, 30 * scale - tail_j, (0, kind))]
    return out


def _clocks(options) -> set:
    return {o.choice[0] for opts in options.values() for o in opts}


def test_a_clock_as_fast_merges_into_the_cheaper_and_a_slower_into_a_faster():
    options = _options()
    counts = dict.fromkeys(options, 3)
    merged = merge_clocks(options, counts, SWITCH.switch_key, 0.0, budget_j=0.0)
    assert _clocks(merged.options) == {3, 1, 0}  # 2 into 3 loses nothing: 3 is cheaper
    assert merged.loss_j == 0.0
    merged = merge_clocks(options, counts, SWITCH.switch_key, 0.0, budget_j=1.0)
    assert _clocks(merged.options) == {3, 1}  # 0 into 1: 0.02 J for each of 12
    assert merged.loss_j == pytest.approx(12 * 0.02)
    # a budget short of 0.24 J keeps clock 0; none merges into a slower clock
    assert _clocks(merge_clocks(options, counts, SWITCH.switch_key, 0.0, 0.2).options) == {
        3, 1, 0}
    merged = merge_clocks(options, counts, SWITCH.switch_key, 0.0, budget_j=1e9)
    assert _clocks(merged.options) == {3}
    assert merged.loss_j == pytest.approx(3 * (10 + 20 + 10 + 20) + 12 * 0.02)


def test_a_clock_faster_somewhere_does_not_merge_into_the_other():
    options = _options()
    options[1, "backward"] = [P(1.0, 80.0, (3, "b")), P(0.9, 81.0, (2, "b"))]  # clock 2 faster here
    merged = merge_clocks(options, dict.fromkeys(options, 1), SWITCH.switch_key, 0.0, 0.5)
    assert {2, 3} <= _clocks(merged.options)  # 2 into 3 would slow stage 1's backward


def test_switches_priced_by_their_clocks_rule_out_merging():
    options = _options()
    assert uniform_switch(options, SWITCH.switch, SWITCH.switch_key, 0.0)
    assert not uniform_switch(options, lambda a, b: (0.05, 0.1 * (a[0] < b[0])), SWITCH.switch_key,
                              0.0)
    # a switch priced below nothing (its blocked seconds worth more than its joules): a
    # merge that removes one would cost
    assert not uniform_switch(options, SWITCH.switch, SWITCH.switch_key, 1.0)


def test_a_merged_solve_states_its_loss_and_the_gap_holds_against_the_full_optimum():
    dag, options = one_f_one_b(2, 2), _options()
    costs = makespan, _ = _brute_force(dag, options, SWITCH)
    merged = _Solver(dag, options, SWITCH, None, True, merge_loss=_merge_loss(True))
    assert merged.loss_j == pytest.approx(8 * 0.02)  # 2 into 3 free; 0 into 1
    assert max(map(len, merged.options)) == 2
    for limit in (None, makespan.min(), 0.5 * (makespan.min() + makespan.max())):
        optimum = _least(costs, float("inf") if limit is None else limit)
        exact = least_energy(dag, options, time_limit_s=limit, model=SWITCH)
        point = least_energy(dag, options, time_limit_s=limit, model=SWITCH, best_found=True)
        assert exact.gap == 0 and exact.energy_j == pytest.approx(optimum)
        assert point.energy_j >= optimum * (1 - 1e-9)
        assert point.energy_j * (1 - point.gap) <= optimum * (1 + 1e-9)
        assert point.gap == pytest.approx(merged.loss_j / point.energy_j)
    # without a limit the full optimum runs everything at clock 0, which the merged
    # program has not: its plan is the loss above it, and says so
    frugal = least_energy(dag, options, time_limit_s=None, model=SWITCH, best_found=True)
    assert frugal.energy_j == pytest.approx(_least(costs, float("inf")) + merged.loss_j)


def test_a_frontier_asked_to_be_proven_merges_nothing():
    dag, options = one_f_one_b(2, 2), _options()
    proven = pipeline_frontier(dag, options, model=SWITCH, points=3)
    stated = pipeline_frontier(dag, options, model=SWITCH, points=3, best_found=True)
    assert all(p.gap == 0 for p in proven)
    assert all(p.gap > 0 for p in stated)
    assert 0 in {c[0] for p in proven for c in p.choices}
    assert not {c[0] for p in stated for c in p.choices} & {0, 2}
