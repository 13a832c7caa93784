"""Pipelines too large to solve exactly (``planner.pipeline_large``): the plans are within
their limits, and every gap they state holds against brute force on random small
pipelines planned the large way (``exact_up_to=0``); the rank bound never exceeds the
optimum, at any prices; plans found before are weighed; a DAG above the threshold takes
this path."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from scipy.optimize import OptimizeResult
from test_pipeline_dag import _brute_force, _case, _least

from kareus.planner.compose import FrontierPoint
from kareus.planner.iteration import energy_model
from kareus.planner.methods import InstructionChoice
from kareus.planner.pipeline import (
    ENERGY,
    EnergyModel,
    PipelinePoint,
    PipelineSolveError,
    _evaluate,
    _prune,
    _Solver,
    fastest,
    least_energy,
    one_f_one_b,
    pipeline_frontier,
    side_by_side,
)
from kareus.planner.pipeline_descent import Timing, descend, rank_phases, sweep
from kareus.planner.pipeline_large import (
    EXACT_INSTRUCTIONS,
    GAP,
    Prices,
    RankBound,
    by_kind,
    by_phase,
    hull,
    shared_program,
)

P = FrontierPoint


def _holds(point: PipelinePoint, optimum: float) -> bool:
    """The stated gap holds: the point is no more than its gap above the optimum."""
    return point.energy_j * (1 - point.gap) <= optimum * (1 + 1e-7)


@pytest.mark.parametrize("seed", range(30))
def test_large_plans_meet_their_limits_and_their_gaps_hold(seed):
    rng = random.Random(seed)
    dag, options, model, _ = _case(rng)
    costs = makespan, _ = _brute_force(dag, options, model)
    quick = fastest(dag, options, model=model, exact_up_to=0)
    assert quick.time_s * (1 - quick.gap) <= makespan.min() * (1 + 1e-7)
    assert 0 <= quick.gap < 1
    limits = [None, quick.time_s, *(rng.uniform(quick.time_s, makespan.max())
                                    for _ in range(2))]
    for limit in limits:
        point = least_energy(dag, options, time_limit_s=limit, model=model, exact_up_to=0)
        optimum = _least(costs, np.inf if limit is None else limit)
        assert point.energy_j >= optimum * (1 - 1e-9)  # no plan beats the optimum
        assert _holds(point, optimum), (limit, point.gap)
        if limit is not None:
            assert point.time_s <= limit * (1 + 1e-9)
        assert len(point.choices) == len(dag.instructions)


@pytest.mark.parametrize("seed", range(30))
def test_the_rank_bound_never_exceeds_the_optimum(seed):
    rng = random.Random(100 + seed)
    dag, options, model, _ = _case(rng)
    costs = makespan, _ = _brute_force(dag, options, model)
    per = [_prune(options[i.stage, i.kind], model) for i in dag.instructions]
    bound = RankBound(dag, per, model)
    assert bound.shortest <= makespan.min() * (1 + 1e-9)
    relaxation = _Solver(dag, options, model, None, exact_up_to=0).parts.relaxation
    for limit in (makespan.min(), rng.uniform(makespan.min(), makespan.max()),
                  makespan.max()):
        optimum = _least(costs, limit) * (1 + 1e-9)
        assert bound.energy(limit) <= optimum
        # a bound at any prices: the relaxation's duals, and random ones
        _, _, duals = relaxation._relax(ENERGY, limit, None)
        assert duals is not None and bound.energy(limit, duals) <= optimum
        guessed = Prices({edge: rng.uniform(0, 300) for edge in dag.edges},
                         [rng.uniform(0, 300) for _ in dag.orders])
        assert bound.energy(limit, guessed) <= optimum
    assert bound.energy(bound.shortest * 0.9) == np.inf  # nothing ends before the shortest


def _clocked(clock: int, time_s: float, energy_j: float) -> FrontierPoint:
    return P(time_s, energy_j, InstructionChoice(clock, ()))


def _stage_options(stages: int, heavy: int) -> dict:
    """Options at three clocks per (stage, kind); stage ``heavy`` slower than the rest:
    the others have slack every microbatch."""
    options = {}
    for s, kind in itertools.product(range(stages), ("forward", "backward")):
        scale = (1.0 if kind == "forward" else 2.0) * (1.3 if s == heavy else 1.0)
        options[s, kind] = [_clocked(c, scale * 1e-2 * (1980 / c) ** 0.9,
                                     scale * 3.0 * (c / 1980) ** 1.2)
                            for c in (1980, 1500, 1200)]
    return options


def test_a_rank_bound_charges_the_switches_the_relaxation_misses():
    """With switches priced, slowing a rank's instructions between fast ones costs two
    stalls: the rank bound knows it, the relaxation without switches does not, so near the
    fastest time the rank bound is the higher (the tighter) of the two; both stay below
    the exact optimum."""
    dag = one_f_one_b(3, 4)
    options = _stage_options(3, heavy=1)
    model = energy_model(static_power_w=60.0, clock_switch_s=0.02, gpus=3)
    exact = least_energy(dag, options, time_limit_s=fastest(dag, options, model=model).time_s,
                         model=model)
    per = [_prune(options[i.stage, i.kind], model) for i in dag.instructions]
    free = energy_model(static_power_w=60.0, clock_switch_s=0.0, gpus=3)
    relaxed = least_energy(dag, options, time_limit_s=exact.time_s, model=free)
    ranks = RankBound(dag, per, model).energy(exact.time_s)
    assert relaxed.energy_j <= ranks <= exact.energy_j * (1 + 1e-9)
    assert ranks > relaxed.energy_j * (1 + 1e-3)


def test_the_relaxations_prices_lift_the_rank_bound_above_both():
    """Priced by the relaxation's duals for the precedences between ranks, each rank pays
    for the slack it takes from the others and for the switches it cannot avoid: a little
    off the fastest time, where the rank bound alone lets every rank use all the slack, the
    priced bound is above the relaxation and the rank bound, and below the optimum."""
    dag = one_f_one_b(4, 6)
    options = _stage_options(4, heavy=1)
    model = energy_model(static_power_w=60.0, clock_switch_s=0.02, gpus=4)
    limit = 1.03 * fastest(dag, options, model=model).time_s
    exact = least_energy(dag, options, time_limit_s=limit, model=model)
    solver = _Solver(dag, options, model, None, exact_up_to=0)
    result, unit, duals = solver.parts.relaxation._relax(ENERGY, limit, None)
    bound = solver.parts.rank_bound
    priced = bound.energy(limit, duals)
    assert max(result.fun * unit, bound.energy(limit)) * 1.01 < priced
    assert priced <= exact.energy_j * (1 + 1e-9)


def test_the_shared_program_gives_filling_and_draining_their_own_options():
    """Near the fastest time a rank's filling and draining wait on other ranks, so their
    best clocks are not its steady state's: the program with them on their own options
    and the steady state in two runs (``by_phase``) finds the exact optimum where one
    option a (stage, kind) stays over 10% above it."""
    dag = one_f_one_b(4, 8)
    options = _stage_options(4, heavy=3)
    model = energy_model(static_power_w=60.0, clock_switch_s=0.02, gpus=4)
    limit = 1.02 * fastest(dag, options, model=model).time_s
    exact = least_energy(dag, options, time_limit_s=limit, model=model).energy_j
    per = tuple(tuple(_prune(options[i.stage, i.kind], model)) for i in dag.instructions)
    sharing = by_phase(dag, per)
    fill, steady, drain = rank_phases(dag, dag.orders[1])
    assert len({sharing.classes[i] for i in (*fill, *drain)}) == len(fill) + len(drain)
    assert len({sharing.classes[i] for i in steady}) == 2 * 2  # two runs, two kinds
    found = {name: _Solver(dag, options, model, None, True, sharing=shared)._solve(
        ENERGY, limit, None).energy_j
        for name, shared in (("phase", sharing), ("kind", by_kind(dag, per)))}
    assert found["phase"] == pytest.approx(exact, rel=1e-9)
    assert found["kind"] > exact * 1.1
    for stages, program in ((4, by_phase), (8, by_kind)):  # deeper: one a (stage, kind)
        deep = one_f_one_b(stages, 8)
        per = tuple(tuple(_prune(_stage_options(stages, heavy=3)[i.stage, i.kind], model))
                    for i in deep.instructions)
        assert shared_program(deep, per) == program(deep, per)


def test_hull_keeps_the_lower_convex_hull_of_time_and_price():
    a, b, c, d, e = P(1, 10, "a"), P(2, 6, "b"), P(3, 5, "c"), P(4, 1, "d"), P(5, 2, "e")
    assert hull([c, a, e, d, b], 0.0) == [a, b, d]  # c above b-d; e slower and dearer
    # the blocked power's price of time tilts the hull: 1 J of each second is saved
    assert hull([P(1, 3, "x"), P(2, 3.5, "y")], 1.0) == [P(1, 3, "x"), P(2, 3.5, "y")]


def test_a_deep_pipeline_is_planned_the_large_way_with_its_gaps_stated():
    """320 instructions (above ``EXACT_INSTRUCTIONS``): the frontier comes back, every
    point with its gap, the fastest as fast as every instruction at its fastest."""
    dag = one_f_one_b(4, 40)
    assert len(dag.instructions) > EXACT_INSTRUCTIONS
    options = _stage_options(4, heavy=3)
    model = energy_model(static_power_w=60.0, clock_switch_s=0.02, gpus=4)
    solver = _Solver(dag, options, model, None)
    assert solver.large and not hasattr(solver, "constraints")  # never builds the program
    frontier = pipeline_frontier(dag, options, model=model, points=4)
    assert frontier[0].time_s == pytest.approx(
        pipeline_frontier(dag, {k: [min(v, key=lambda o: o.time_s)] for k, v in options.items()},
                          model=model, points=2)[0].time_s)
    assert all(0 <= p.gap < 0.5 for p in frontier)
    assert frontier[-1].energy_j < frontier[0].energy_j  # the slack is used
    for a, b in itertools.pairwise(frontier):
        assert a.time_s < b.time_s and a.energy_j > b.energy_j


def test_plans_found_before_are_weighed():
    """A plan handed in (another method's, whose options these dominate) that beats what
    the shared options and the descents reach stands on the frontier, its gap against this
    program."""
    dag = one_f_one_b(3, 6)
    options = _stage_options(3, heavy=0)
    model = energy_model(static_power_w=60.0, clock_switch_s=0.02, gpus=3)
    limit = fastest(dag, options, model=model).time_s * 1.1
    exact = least_energy(dag, options, time_limit_s=limit, model=model)
    shared = least_energy(dag, options, time_limit_s=limit, model=model, exact_up_to=0)
    assert exact.energy_j < shared.energy_j * (1 - 1e-6)  # the per-instruction plan is better
    weighed = least_energy(dag, options, time_limit_s=limit, model=model, exact_up_to=0,
                           known=[exact])
    assert weighed.energy_j == pytest.approx(exact.energy_j)
    assert weighed.gap == pytest.approx(shared.gap * shared.energy_j / exact.energy_j
                                        - (shared.energy_j - exact.energy_j) / exact.energy_j)


def test_solves_side_by_side_come_back_in_order_or_raise():
    import time

    assert side_by_side([lambda: (time.sleep(0.05), 1)[1], lambda: 2]) == [1, 2]
    with pytest.raises(ValueError, match="second"):
        side_by_side([lambda: time.sleep(0.05), lambda: (_ for _ in ()).throw(
            ValueError("second"))])


def test_a_model_with_negative_switch_prices_keeps_the_bound_below():
    """A switch priced below nothing (its seconds not blocked, at more than its joules): the
    relaxation without switches is floored by what the switches could take off."""
    rng = random.Random(7)
    dag, options, _, _ = _case(rng, one_f_one_b(2, 3))
    model = EnergyModel(static_power_w=50.0, blocking_power_w=40.0,
                        switch=lambda a, b: (0.5, 1.0) if a[0] != b[0] else (0.0, 0.0),
                        switch_key=lambda c: c[0])
    costs = _brute_force(dag, options, model)
    point = least_energy(dag, options, time_limit_s=None, model=model, exact_up_to=0)
    assert _holds(point, _least(costs, np.inf))


def test_a_small_dag_out_of_time_without_a_plan_is_planned_the_large_way():
    """HiGHS stopped before it found any plan of the exact program (``max_solve_s`` all
    but zero): without ``best_found`` that fails; with it the solve falls back to the
    large way, its gap stated and holding."""
    fell_back = 0
    for seed in range(8):
        dag, options, model, _ = _case(random.Random(200 + seed))
        try:
            least_energy(dag, options, time_limit_s=None, model=model, max_solve_s=1e-9)
            continue  # presolve proved it at once
        except PipelineSolveError:
            fell_back += 1
        point = least_energy(dag, options, time_limit_s=None, model=model, max_solve_s=1e-9,
                             best_found=True)
        assert _holds(point, _least(_brute_force(dag, options, model), np.inf))
    assert fell_back


@pytest.mark.parametrize("seed", range(10))
def test_the_descents_timing_costs_a_plan_as_the_exact_evaluation(seed):
    rng = random.Random(300 + seed)
    dag, options, model, _ = _case(rng)
    per = [_prune(options[i.stage, i.kind], model) for i in dag.instructions]
    timing = Timing(dag, per, model)
    for _ in range(5):
        plan = [rng.randrange(len(opts)) for opts in per]
        exact = _evaluate(dag, model, [opts[k] for opts, k in zip(per, plan)])
        assert timing.cost(plan) == pytest.approx((exact.time_s, exact.energy_j), rel=1e-12)
        assert timing.plan_of(exact.choices) == plan


@pytest.mark.parametrize("seed", range(10))
def test_a_sweep_never_ends_later_nor_costs_more(seed):
    """Each instruction takes its cheapest option within its latest finish: the plan ends
    by the time it is given and, given its own end, costs no more."""
    rng = random.Random(400 + seed)
    dag, options, model, _ = _case(rng)
    per = [_prune(options[i.stage, i.kind], model) for i in dag.instructions]
    timing = Timing(dag, per, model)
    plan = [rng.randrange(len(opts)) for opts in per]
    end, energy = timing.cost(plan)
    for limit in (end, end * 1.1):
        swept = timing.cost(sweep(timing, plan, limit))
        assert swept[0] <= limit * (1 + 1e-12)
    assert timing.cost(sweep(timing, plan, end))[1] <= energy * (1 + 1e-12)


def _at_fastest(stages: int, microbatches: int, heavy: int) -> tuple:
    """A 1F1B DAG with stage ``heavy`` slower (``_stage_options``), its model, its
    ``Timing`` and the plan of every instruction at its fastest."""
    dag = one_f_one_b(stages, microbatches)
    options = _stage_options(stages, heavy=heavy)
    model = energy_model(static_power_w=60.0, clock_switch_s=0.02, gpus=stages)
    per = [_prune(options[i.stage, i.kind], model) for i in dag.instructions]
    quick = [min(range(len(o)), key=lambda k, o=o: (o[k].time_s, o[k].effective_energy_j))
             for o in per]
    return dag, options, model, Timing(dag, per, model), quick


def test_the_descent_lowers_the_shared_plan_near_the_fastest_time():
    """Near the fastest time shared options slow no stage: moving a rank's filling and
    draining instructions to slower clocks (relabels) and each instruction into its slack
    (the sweep) lowers the plan within the same time."""
    dag, options, model, timing, quick = _at_fastest(4, 8, heavy=3)
    end, energy = timing.cost(quick)
    lowered = descend(timing, quick, lambda cost: cost[1], end, None)
    assert timing.cost(lowered)[0] <= end
    assert timing.cost(lowered)[1] < energy * 0.97
    exact = least_energy(dag, options, time_limit_s=end, model=model)
    assert timing.cost(lowered)[1] >= exact.energy_j * (1 - 1e-9)  # never below the optimum


def test_best_first_relabels_reach_what_stepwise_relabels_miss():
    """Phases compete for one slack: tried stepwise, the first ranks' phases spend it and
    the plan stays over 3% above the optimum; tried best first (by what each saves) the
    descent from every instruction at its fastest reaches the optimum, and so does the
    large way's solve, which descends from there too."""
    dag, options, model, timing, quick = _at_fastest(3, 6, heavy=2)
    limit = timing.cost(quick)[0] * 1.02
    exact = least_energy(dag, options, time_limit_s=limit, model=model).energy_j
    for moves, above in (("best_first", 0.0), ("stepwise", 0.03)):
        lowered = timing.cost(descend(timing, quick, lambda cost: cost[1], limit, None,
                                      moves))
        assert lowered[0] <= limit * (1 + 1e-12)
        if moves == "best_first":
            assert lowered[1] == pytest.approx(exact, rel=1e-9)
        else:
            assert lowered[1] > exact * (1 + above)
    large = least_energy(dag, options, time_limit_s=limit, model=model, exact_up_to=0)
    assert large.energy_j == pytest.approx(exact, rel=1e-9)


def test_merges_lower_what_relabels_and_sweeps_leave():
    """At the fastest time, once neither order of relabels (with their sweeps) lowers the
    plan further, merging spans of filling and draining instructions into their
    neighbours' clocks does, never below the exact optimum; the large way's solve, which
    merges after relabelling, reaches that plan too."""
    dag, options, model, timing, quick = _at_fastest(4, 6, heavy=3)
    end = timing.cost(quick)[0]

    def relabelled(plan: list[int]) -> list[int]:
        return min((descend(timing, plan, lambda cost: cost[1], end, None, moves)
                    for moves in ("best_first", "stepwise")), key=lambda p: timing.cost(p)[1])

    settled = relabelled(relabelled(quick))
    assert relabelled(settled) == settled
    merged = timing.cost(descend(timing, settled, lambda cost: cost[1], end, None, "merge"))
    assert merged[0] <= end * (1 + 1e-12)
    assert merged[1] < timing.cost(settled)[1] * (1 - 5e-3)
    exact = least_energy(dag, options, time_limit_s=end, model=model).energy_j
    assert merged[1] >= exact * (1 - 1e-9)
    large = least_energy(dag, options, time_limit_s=end, model=model, exact_up_to=0)
    assert large.energy_j <= merged[1] * (1 + 1e-9)


@pytest.mark.parametrize("dual_gap", [1.0, 0.005])
def test_a_plan_highs_did_not_prove_is_lowered_and_bounded_by_the_rank_bound(
    monkeypatch, dual_gap
):
    """HiGHS ran out of time on a small DAG with a plan (every instruction at its
    fastest) and its dual bound: where their gap is above ``GAP`` the plan is lowered by
    the descents and bounded by the rank bound too, the stated gap holding; within
    ``GAP`` it is kept as HiGHS found it."""
    dag, options, model, timing, quick = _at_fastest(3, 6, heavy=2)
    limit = timing.cost(quick)[0] * 1.02
    exact = least_energy(dag, options, time_limit_s=limit, model=model).energy_j
    solver = _Solver(dag, options, model, max_solve_s=60.0, best_found=True)
    x = np.zeros(len(solver.upper))
    for cols, k in zip(solver.columns, quick):
        x[cols[k]] = 1.0
    found = _evaluate(dag, model, [o[k] for o, k in zip(solver.options, quick)]).energy_j

    def out_of_time(weights, limit_s, limit_j, integral=True):
        return OptimizeResult(status=1, x=x, message="time limit reached",
                              mip_gap=dual_gap, mip_dual_bound=found * (1 - dual_gap)
                              / solver.energy_unit), solver.energy_unit

    monkeypatch.setattr(solver, "_run", out_of_time)
    point = solver.least_energy(limit)
    assert point.time_s <= limit * (1 + 1e-12)
    if dual_gap > GAP:
        assert point.energy_j == pytest.approx(exact, rel=1e-9)  # the descents reach it
        assert point.gap < 0.05 and _holds(point, exact)  # by the rank bound
    else:  # (the stand-in's dual bound is above the optimum: only HiGHS's word is taken)
        assert point.energy_j == pytest.approx(found) and point.gap == pytest.approx(dual_gap)


def test_a_plan_highs_did_not_prove_stands_where_the_large_way_finds_none(monkeypatch):
    """The large way re-plans a small DAG HiGHS left above ``GAP``; where it finds no plan
    of its own (``PipelineSolveError``), HiGHS's plan is returned with HiGHS's gap."""
    dag, options, model, timing, quick = _at_fastest(3, 6, heavy=2)
    limit = timing.cost(quick)[0] * 1.02
    solver = _Solver(dag, options, model, max_solve_s=60.0, best_found=True)
    x = np.zeros(len(solver.upper))
    for cols, k in zip(solver.columns, quick):
        x[cols[k]] = 1.0
    found = _evaluate(dag, model, [o[k] for o, k in zip(solver.options, quick)]).energy_j
    monkeypatch.setattr(solver, "_run", lambda *a, **k: (OptimizeResult(
        status=1, x=x, message="time limit reached", mip_gap=0.2,
        mip_dual_bound=found * 0.8 / solver.energy_unit), solver.energy_unit))

    def none_found(*args):
        raise PipelineSolveError("no plan of its own")

    monkeypatch.setattr(solver, "_solve_large", none_found)
    point = solver.least_energy(limit)
    assert point.energy_j == pytest.approx(found) and point.gap == pytest.approx(0.2)


def test_methods_of_equal_options_are_solved_once(monkeypatch):
    """Nanobatching that pays nowhere leaves three methods one program: it is solved once
    and every one of them gets its frontier."""
    from kareus.planner import iteration
    from kareus.planner.budget import Budget

    dag = one_f_one_b(2, 2)
    options = _stage_options(2, heavy=1)
    solved = []
    real = iteration.pipeline_frontier
    monkeypatch.setattr(iteration, "pipeline_frontier",
                        lambda *a, **k: solved.append(a[1]) or real(*a, **k))
    model = energy_model(static_power_w=60.0, clock_switch_s=0.02, gpus=2)
    methods = {"baseline": {k: v[:1] for k, v in options.items()}, "perseus": options,
               "nanobatch_perseus": dict(options), "kareus": dict(options)}
    planned = iteration.plan_iteration(dag, methods, Budget.parse(), model=model,
                                       max_power_w=1000.0, points=3)
    assert solved == [options]
    assert planned.frontiers["kareus"] == planned.frontiers["perseus"] == (
        planned.frontiers["nanobatch_perseus"])
    other = {k: [P(o.time_s * 0.9, o.effective_energy_j, o.choice) for o in v]
             for k, v in options.items()}
    solved.clear()
    iteration.plan_iteration(dag, methods | {"kareus": other}, Budget.parse(),
                             model=model, max_power_w=1000.0, points=3)
    assert solved == [options, other]
