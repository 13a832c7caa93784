"""A pipeline's iteration planned under each method, and the plan a budget picks.

The same for a pipeline at run time (``planner.pipeline_step``) and offline (``kareus
plan``): every (stage, kind)'s instruction options under each method
(``planner.methods``), the iteration's DAG (``planner.pipeline``), and per method its
frontier of whole iterations (the baseline's one point; with one stage, the step
planner's exact DP over identical microbatches; with several, the DAG solves at evenly
spaced time limits, exact or with their gap stated: ``planner.pipeline_large``). Every
frontier keeps the baseline, so no plan is worse than doing nothing; Perseus's and
Nanobatching + Perseus's are solved side by side, then kareus's weighing their plans too
(their choices are kareus choices), so a time-limited solve never leaves kareus's
frontier above theirs. Methods with equal options (nanobatching that pays nowhere) are one
program, solved once.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kareus.planner.budget import Budget, choose
from kareus.planner.compose import FrontierPoint, step_frontier
from kareus.planner.methods import METHODS, InstructionChoice, instruction_clock
from kareus.planner.pipeline import (
    EnergyModel,
    Options,
    PipelineDag,
    PipelinePoint,
    baseline,
    pareto,
    pipeline_frontier,
    side_by_side,
    solve_budget,
)

FRONTIER_POINTS = 10  # the method's artifact compares 10-point frontiers


@dataclass(frozen=True)
class IterationPlan:
    """Each method's frontier (fastest first; the baseline's one point) and the kareus
    plan the budget chose."""

    frontiers: dict[str, list[PipelinePoint]]
    chosen: PipelinePoint

    @property
    def baseline(self) -> PipelinePoint:
        return self.frontiers["baseline"][0]


def energy_model(static_power_w: float, clock_switch_s: float, gpus: int) -> EnergyModel:
    """A replica's pricing: one GPU's ``static_power_w`` times its ``gpus`` over the whole
    iteration, a blocked GPU at static power (what the simulated GPU draws in a
    collective), a clock switch a stall of ``clock_switch_s`` (time at static power, no
    effective energy)."""

    def switch(a: InstructionChoice, b: InstructionChoice) -> tuple[float, float]:
        return (clock_switch_s if a.clock_mhz != b.clock_mhz else 0.0), 0.0

    return EnergyModel(static_power_w=static_power_w * gpus, switch=switch,
                       switch_key=instruction_clock)


def plan_iteration(
    dag: PipelineDag,
    options: Mapping[str, Options],
    budget: Budget,
    *,
    model: EnergyModel,
    max_power_w: float,
    points: int = FRONTIER_POINTS,
    max_solve_s: float | None = None,
) -> IterationPlan:
    """Every method's frontier over ``options`` (method -> (stage, kind) -> options; the
    baseline's the one option of each) and the kareus plan ``budget`` asks for (a
    ``BudgetError`` stating the range where none meets it; ``max_power_w``: the
    replica's, for a trade-off). ``max_solve_s``: per DAG solve, past which the best plan
    found is kept with its proven gap (``PipelinePoint.gap``); None: every plan proven."""
    full: dict[str, list[PipelinePoint]] = {}  # with one stage: every point
    best_found = max_solve_s is not None
    only = {key: opts[0] for key, opts in options["baseline"].items()}
    base = baseline(dag, options["baseline"], only, model=model)
    frontiers: dict[str, list[PipelinePoint]] = {"baseline": [base]}
    methods = [m for m in METHODS if m != "baseline"]
    if dag.stages == 1:
        for method in methods:
            full[method] = pareto([*chain_frontier(dag, options[method], model), base])
            frontiers[method] = sampled(full[method], points)
    else:
        # The baselines' solves side by side, then kareus's weighing their plans (their
        # choices are kareus's too: unrewritten or nanobatched graphs at a clock), as
        # it weighs the baseline's; so none found under a time limit stands worse.
        # A method whose options are another's (nanobatching that pays nowhere) gets
        # that method's frontier: the same program is not solved twice.
        same = _same_options(options, methods)
        others = [m for m in methods if m != "kareus" and same[m] == m]
        found = side_by_side([functools.partial(
            pipeline_frontier, dag, options[method], model=model, points=points,
            max_solve_s=max_solve_s, best_found=best_found) for method in others])
        frontiers |= {m: pareto([*f, base]) for m, f in zip(others, found)}
        if same["kareus"] == "kareus":
            known = [base, *(p for m in others for p in frontiers[m])]
            frontiers["kareus"] = pareto([*pipeline_frontier(
                dag, options["kareus"], model=model, points=points, max_solve_s=max_solve_s,
                best_found=best_found, known=known), base])
        frontiers |= {m: list(frontiers[same[m]]) for m in methods if same[m] != m}
    kareus = full.get("kareus", frontiers["kareus"])
    if budget.kind != "fastest" and dag.stages > 1:  # the fastest is the frontier's first
        # The exact plan the budget asks for, not only the frontier's points' best.
        exact = solve_budget(dag, options["kareus"], budget, model=model,
                             max_power_w=max_power_w, baseline_point=base,
                             max_solve_s=max_solve_s, best_found=best_found,
                             known=[p for f in frontiers.values() for p in f])
        kareus = sorted({*kareus, exact}, key=lambda p: (p.time_s, p.energy_j))
    return IterationPlan(frontiers, choose(kareus, base, budget, max_power_w))


def _same_options(options: Mapping[str, Options], methods: Sequence[str]) -> dict[str, str]:
    """Each method's first method (in ``methods``' order) with options equal to its own
    (itself where none before has)."""
    same: dict[str, str] = {}
    for method in methods:
        same[method] = next((m for m in same if same[m] == m and options[m] == options[method]),
                            method)
    return same


def chain_frontier(
    dag: PipelineDag, options: Mapping[tuple[int, str], Sequence[FrontierPoint]],
    model: EnergyModel,
) -> list[PipelinePoint]:
    """Without pipeline parallelism, the whole frontier of the iteration, every microbatch
    at the same forward and backward option: the step planner's exact DP
    (``compose.step_frontier``), which prices the switches between them and into the next
    iteration."""
    forward, backward = options[0, "forward"], options[0, "backward"]
    points = step_frontier([forward, backward], repeats=dag.microbatches,
                           static_power_w=model.static_power_w, switch=model.switch,
                           switch_key=model.switch_key)
    return [PipelinePoint(p.time_s, p.energy_j, p.effective_energy_j,
                          tuple(p.graphs[0] if i.kind == "forward" else p.graphs[1]
                                for i in dag.instructions))
            for p in points]


def sampled(frontier: Sequence[PipelinePoint], points: int) -> list[PipelinePoint]:
    """``points`` of a frontier (fastest first) the way ``pipeline_frontier`` finds them:
    the fastest, the least energy, and the least energy within time limits evenly spaced
    between theirs."""
    quick, frugal = frontier[0], min(frontier, key=lambda p: (p.energy_j, p.time_s))
    step = (frugal.time_s - quick.time_s) / (points - 1)
    limits = [quick.time_s + k * step for k in range(points)]
    found = [min((p for p in frontier if p.time_s <= limit * (1 + 1e-12)),
                 key=lambda p: (p.energy_j, p.time_s)) for limit in limits]
    return list(dict.fromkeys(found))
