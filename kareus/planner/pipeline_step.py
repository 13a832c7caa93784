"""Planning a pipeline's iteration at run time, once for all its stages.

Each stage compiles its graphs lazily and on its own ranks, so no rank can plan the
pipeline when it compiles. Once this rank's part of the first iteration has run
(``runtime.pipelining`` says when, and which graphs each of its instructions ran, how
often), its stages' instruction options are known: per (stage, kind), the graphs' own
frontiers summed per clock (``planner.methods``), energies times the stage's GPUs. Each
stage posts them through the store (first post wins; ``agreement.gather``, with a
deadline, never a collective), every rank reads every stage's, solves the iteration's DAG
under the budget (``planner.iteration``: exact, deterministic, so every rank makes the
same plan), and the ranks agree on the plan's digest before any runs it. A stage that
never reports, or a rank that made another plan, leaves every rank at its unplanned
choices, with the reason logged. A plan stored by an earlier run with the same options
whose instructions run these graphs is agreed on and run without exchanging or solving.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from kareus.devices.base import Device
from kareus.errors import KareusError
from kareus.passes.decide import Choice
from kareus.planner.budget import Budget, choose
from kareus.planner.compose import FrontierPoint, StepPoint, step_frontier
from kareus.planner.graph import GraphFrontier
from kareus.planner.iteration import IterationPlan, energy_model, plan_iteration
from kareus.planner.methods import METHODS, InstructionChoice, instruction_options
from kareus.planner.pipeline import (
    KINDS,
    PipelineDag,
    PipelinePoint,
    baseline,
    from_orders,
    gpipe,
    one_f_one_b,
    schedule,
)
from kareus.planner.plan import (
    GraphPlan,
    InstructionGraph,
    InstructionPlan,
    PipelineLayout,
    Plan,
    StepCost,
)
from kareus.runtime.agreement import agree, gather
from kareus.runtime.pipelining import Composition, InstructionTracker, PipelineShape

if TYPE_CHECKING:
    from kareus.planner.step import StepPlanner

log = logging.getLogger("kareus")

_BUILDERS = {"1f1b": one_f_one_b, "gpipe": gpipe}


class PipelineNotPlanned(KareusError, RuntimeError):
    """This rank cannot plan the pipeline (the message says why); it runs unplanned."""


@dataclasses.dataclass(frozen=True)
class StageOptions:
    """What a stage posts: its GPUs, and per kind the graphs its instruction runs and its
    options under each method (times per instruction, energies summed over its GPUs)."""

    stage: int
    gpus: int
    graphs: dict[str, Composition]
    options: dict[str, dict[str, list[FrontierPoint]]]  # kind -> method -> options
    costs: dict[str, list[FrontierPoint]]  # label -> each choice's cost of one call, per GPU

    def to_json(self) -> str:
        return json.dumps({
            "stage": self.stage, "gpus": self.gpus,
            "graphs": {k: [list(g) for g in v] for k, v in self.graphs.items()},
            "costs": {label: [[o.time_s, o.effective_energy_j, dataclasses.astuple(o.choice)]
                              for o in points] for label, points in self.costs.items()},
            "options": {k: {m: [[o.time_s, o.effective_energy_j, o.choice.clock_mhz,
                                 [dataclasses.astuple(c) for c in o.choice.graphs]]
                                for o in opts] for m, opts in per.items()}
                        for k, per in self.options.items()},
        })

    @classmethod
    def from_json(cls, text: str) -> StageOptions:
        raw = json.loads(text)

        def point(t: float, e: float, clock: int, graphs: list) -> FrontierPoint:
            choices = tuple(Choice(k, f, tuple(map(tuple, parts))) for k, f, parts in graphs)
            return FrontierPoint(t, e, InstructionChoice(clock, choices))

        def cost(t: float, e: float, choice: list) -> FrontierPoint:
            k, f, parts = choice
            return FrontierPoint(t, e, Choice(k, f, tuple(map(tuple, parts))))

        return cls(raw["stage"], raw["gpus"],
                   {k: tuple(tuple(g) for g in v) for k, v in raw["graphs"].items()},
                   {k: {m: [point(*o) for o in opts] for m, opts in per.items()}
                    for k, per in raw["options"].items()},
                   {label: [cost(*o) for o in points] for label, points in raw["costs"].items()})


def stage_options(
    stage: int, gpus: int, compositions: Mapping[str, Composition],
    frontiers: Mapping[str, GraphFrontier],
) -> StageOptions:
    """A stage's options from what its instructions ran (kind -> graphs) and the graphs'
    frontiers by label (a ``PipelineNotPlanned`` where a graph has none)."""
    options: dict[str, dict[str, list[FrontierPoint]]] = {}
    for kind, graphs in compositions.items():
        missing = [label for label, h, _ in graphs
                   if label not in frontiers or frontiers[label].graph_hash != h]
        if missing:
            raise PipelineNotPlanned(
                f"stage {stage}'s {kind} runs graphs kareus could not plan ({', '.join(missing)})")
        runs = [(frontiers[label], calls) for label, _, calls in graphs]
        options[kind] = {}
        for method in METHODS:
            found = instruction_options(runs, method)
            if not found:
                raise PipelineNotPlanned(
                    f"stage {stage}'s {kind}: no clock at which all its graphs have a cost")
            options[kind][method] = [FrontierPoint(o.time_s, gpus * o.effective_energy_j,
                                                   o.choice) for o in found]
    costs = {}
    for graphs in compositions.values():
        for label, _, _ in graphs:
            f = frontiers[label]
            costs[label] = list(dict.fromkeys(
                (*f.points, *f.frequency_only, f.baseline, *f.nanobatched)))
    return StageOptions(stage, gpus, dict(compositions), options, costs)


def iteration_dag(shape: PipelineShape) -> PipelineDag:
    """The DAG of the pipeline's iteration: its schedule's rule, or the orders the
    schedule computed (interleaved 1F1B)."""
    if shape.orders is not None:
        return from_orders(shape.stages, shape.microbatches, shape.orders)
    return _BUILDERS[shape.schedule](shape.stages, shape.microbatches)


def make_pipeline_plan(
    shape: PipelineShape,
    posted: Sequence[StageOptions],
    budget: Any,
    device: Device,
    options: Mapping[str, Any],
    kareus_version: str,
) -> Plan:
    """The iteration's plan from every stage's options (deterministic: every rank that
    has the same posts makes the same plan)."""
    dag = iteration_dag(shape)
    gpus = sum(p.gpus for p in posted)
    model = energy_model(device.static_power_w, device.clock_switch_s, gpus)
    per_method = {m: {(p.stage, k): p.options[k][m] for p in posted for k in KINDS}
                  for m in METHODS}
    planned = plan_iteration(dag, per_method, budget, model=model,
                             max_power_w=(device.power_limit_w or 0.0) * gpus)
    layout = PipelineLayout(shape.schedule, shape.stages, shape.ranks, shape.microbatches)
    return plan_of(layout, dag, planned, posted, budget=budget,
                   device=(device.identity, device.model_version, device.static_power_w),
                   options=options, kareus_version=kareus_version)


def per_stage(shape: PipelineShape, posted: Sequence[StageOptions], budget: Budget,
              device: Device) -> PipelinePoint:
    """What the iteration costs when each stage plans alone (as without ``pipeline_step``):
    every microbatch of a stage at the one (forward, backward) choice its own step of
    ``shape.microbatches`` passes takes under ``budget`` (the step planner's DP), on the
    same DAG and pricing as the pipeline's plan."""
    dag = iteration_dag(shape)
    gpus = sum(p.gpus for p in posted)
    model = energy_model(device.static_power_w, device.clock_switch_s, gpus)
    options = {(p.stage, k): p.options[k]["kareus"] for p in posted for k in KINDS}
    picks = {}
    for p in posted:
        fwd, bwd = p.options["forward"]["kareus"], p.options["backward"]["kareus"]
        alone = energy_model(device.static_power_w, device.clock_switch_s, p.gpus)
        points = step_frontier([fwd, bwd], repeats=shape.microbatches,
                               static_power_w=alone.static_power_w, switch=alone.switch,
                               switch_key=alone.switch_key)
        base = [p.options[k]["baseline"][0] for k in KINDS]
        t = shape.microbatches * sum(o.time_s for o in base)
        e = shape.microbatches * sum(o.effective_energy_j for o in base)
        chosen = choose(points, StepPoint(t, e + alone.static_power_w * t, e,
                                          tuple(o.choice for o in base)),
                        budget, (device.power_limit_w or 0.0) * p.gpus)
        for k, c in zip(KINDS, chosen.graphs, strict=True):
            picks[p.stage, k] = next(o for o in options[p.stage, k] if o.choice == c)
    return baseline(dag, options, picks, model=model)


def plan_of(
    layout: PipelineLayout,
    dag: PipelineDag,
    planned: IterationPlan,
    posted: Sequence[StageOptions],
    *,
    budget: Budget,
    device: tuple[str, str | None, float],
    options: Mapping[str, Any],
    kareus_version: str,
) -> Plan:
    """The plan record of ``planned``'s chosen iteration over ``dag``, whose stages'
    options are ``posted``: each instruction's clock, graphs' choices, predicted start and
    cost; ``device``: (identity, model version, one GPU's static power)."""
    by_stage = {p.stage: p for p in posted}
    chosen = planned.chosen
    points = [_option(by_stage[i.stage], i.kind, c)
              for i, c in zip(dag.instructions, chosen.choices, strict=True)]
    starts, _ = schedule(dag, [o.time_s for o in points])
    instructions = []
    for i, c, start, point in zip(dag.instructions, chosen.choices, starts, points,
                                  strict=True):
        composition = by_stage[i.stage].graphs[i.kind]
        instructions.append(InstructionPlan(
            i.stage, i.microbatch, i.kind, c.clock_mhz,
            tuple(InstructionGraph(label, h, n, g)
                  for (label, h, n), g in zip(composition, c.graphs, strict=True)),
            start, point.time_s, point.effective_energy_j,
        ))
    graphs: dict[str, GraphPlan] = {}
    for entry in instructions:
        for g in entry.graphs:
            if g.label not in graphs:
                cost = next(o for o in by_stage[entry.stage].costs[g.label]
                            if o.choice == g.choice)
                graphs[g.label] = GraphPlan(g.label, g.graph_hash, g.choice, cost.time_s,
                                            cost.effective_energy_j)

    def cost(p: PipelinePoint) -> StepCost:
        return StepCost(p.time_s, p.energy_j)

    identity, model_version, static_power_w = device
    return Plan(
        graphs=tuple(graphs.values()),
        predicted=cost(chosen),
        baseline=cost(planned.baseline),
        frontier=tuple(map(cost, planned.frontiers["kareus"])),
        frequency_only=tuple(map(cost, planned.frontiers["perseus"])),
        budget=budget,
        device=identity,
        model_version=model_version,
        static_power_w=static_power_w,
        options=dict(options),
        kareus_version=kareus_version,
        pipeline=layout,
        instructions=tuple(instructions),
    )


def _option(stage: StageOptions, kind: str, choice: InstructionChoice) -> FrontierPoint:
    """The option of ``stage``'s ``kind`` that runs ``choice``, under whichever method
    offers it (the baseline's may be pruned from kareus's, where another dominates it)."""
    return next(o for per in stage.options[kind].values() for o in per if o.choice == choice)


def runs_stored(plan: Plan | None, shape: PipelineShape,
                compositions: Mapping[tuple[int, str], Composition]) -> bool:
    """Whether a stored ``plan`` was made for this pipeline and these stages' graphs."""
    if plan is None or plan.pipeline != PipelineLayout(shape.schedule, shape.stages,
                                                       shape.ranks, shape.microbatches):
        return False
    for (stage, kind), graphs in compositions.items():
        for m in range(shape.microbatches):
            entry = plan.instruction(stage, m, kind)
            if entry is None or [g.graph_hash for g in entry.graphs] != [h for _, h, _ in graphs]:
                return False
    return True


def world_group() -> list[str]:
    """The groups whose ranks agree on a pipeline's plan: all of them."""
    return [dist.group.WORLD.group_name]


def exchange(key: str, mine: Sequence[StageOptions], shape: PipelineShape, *,
             timeout_s: float) -> list[StageOptions]:
    """Every stage's options: this rank's posted, the others' read (a
    ``PipelineNotPlanned`` naming the stages that did not report within ``timeout_s``)."""
    got = gather(key, {f"stage{p.stage}": p.to_json() for p in mine},
                 [f"stage{s}" for s in range(shape.stages)], timeout_s=timeout_s,
                 what="the other pipeline stages' graph frontiers")
    if got.missing:
        raise PipelineNotPlanned(
            f"{', '.join(got.missing)} did not report within {timeout_s:g} s")
    return [StageOptions.from_json(got.values[f"stage{s}"]) for s in range(shape.stages)]


def agree_on(key: str, plan: Plan | None, why: str | None, timeout_s: float) -> bool:
    """Whether every rank proposes this plan (None: this rank has none, ``why``)."""
    verdict = agree(f"{key}/plan", plan.digest if plan else f"unplanned: {why}",
                    world_group(), timeout_s=timeout_s, falls_back=plan is None)
    if plan is None or not verdict:  # also where every rank agrees it has none
        log.warning("kareus: the pipeline is not planned: %s; each graph keeps its choice",
                    why if plan is None else verdict.reason)
    return bool(verdict) and plan is not None


class PipelinePlanning:
    """Plans the pipeline once, when this rank's part of an iteration ended with every
    one of its instructions' graphs seen (an ``InstructionTracker`` listener)."""

    def __init__(self, step: StepPlanner, shape: PipelineShape, tracker: InstructionTracker,
                 *, timeout_s: float) -> None:
        self.step, self.shape, self.tracker, self.timeout_s = step, shape, tracker, timeout_s
        layout = (shape.schedule, shape.stages, shape.ranks, shape.microbatches)
        self.key = f"kareus/pipeline/{step.path.stem}/{'-'.join(map(str, layout))}"
        self.tried = False
        self.posted: list[StageOptions] = []  # every stage's options, once exchanged

    def __call__(self, shape: PipelineShape) -> None:
        if shape != self.shape or self.tried:
            return
        compositions = self.tracker.composition(shape.local_stages)
        if any((s, k) not in compositions for s in shape.local_stages for k in KINDS):
            return  # a graph still compiles lazily (a later iteration completes them)
        self.tried = True
        plan, why, stored = None, None, self.step.stored
        deadline = time.monotonic() + self.timeout_s  # both waits together: one timeout
        try:
            if runs_stored(stored, shape, compositions):
                plan = stored
            else:
                plan = self._plan(compositions)
        except Exception as exc:  # noqa: BLE001 - the pipeline still trains, unplanned
            why = f"{type(exc).__name__}: {exc}"
        if agree_on(self.key, plan, why, max(0.0, deadline - time.monotonic())):
            assert plan is not None
            self.step.adopt(plan, store=plan is not stored)
            log.info("kareus pipeline plan: %.4g s, %.4g J per iteration (baseline %.4g s, "
                     "%.4g J)", plan.predicted.time_s, plan.predicted.energy_j,
                     plan.baseline.time_s, plan.baseline.energy_j)

    def _plan(self, compositions: Mapping[tuple[int, str], Composition]) -> Plan:
        frontiers = self.step.graph_frontiers()
        mine = []
        for s in self.shape.local_stages:
            graphs = {k: compositions[s, k] for k in KINDS}
            labels = [label for c in graphs.values() for label, _, _ in c]
            mine.append(stage_options(s, self.step.gpus(labels), graphs, frontiers))
        posted = exchange(self.key, mine, self.shape, timeout_s=self.timeout_s)
        self.posted = posted
        step = self.step
        return make_pipeline_plan(self.shape, posted, step.budget, step.device, step.options,
                                  step.kareus_version)
