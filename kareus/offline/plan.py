"""``kareus plan``: a workload's iteration planned offline, beside the baseline and Perseus.

The workload's graphs are traced and profiled for one rank over fake tensors
(``trace.trace_stages``) on a simulated GPU; every stage's forward and backward
instruction then has its options under each method (``planner.methods``), and the
iteration, a 1F1B (or GPipe) DAG of stages x microbatches, is planned over them exactly
(``planner.pipeline``): per method its frontier of whole iterations, a pipeline replica's
time (the last stage's finish) and energy (summed over its pp x tp GPUs, static power over
the whole iteration). The budget picks the kareus plan; the metrics compare the frontiers
(``metrics``). Every figure is the simulator's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kareus.devices.errors import DeviceSpecError
from kareus.devices.resolve import ACCEPTED_DEVICES, check_device, resolve_device
from kareus.errors import KareusError
from kareus.offline.metrics import max_throughput, reductions, summary
from kareus.offline.trace import StageGraphs, trace_stages
from kareus.offline.workload import Workload
from kareus.passes.decide import Choice
from kareus.planner.budget import Budget
from kareus.planner.compose import FrontierPoint
from kareus.planner.graph import GraphFrontier
from kareus.planner.iteration import (
    FRONTIER_POINTS,
    IterationPlan,
    energy_model,
    plan_iteration,
)
from kareus.planner.methods import METHODS, InstructionChoice, instruction_options
from kareus.planner.pipeline import PipelineDag, PipelinePoint, gpipe, one_f_one_b
from kareus.planner.pipeline_step import plan_of, stage_options
from kareus.planner.plan import GraphPlan, PipelineLayout, Plan, StepCost

SCHEDULES: dict[str, Callable[[int, int], PipelineDag]] = {"1f1b": one_f_one_b, "gpipe": gpipe}


class OfflinePlanError(KareusError, ValueError):
    """An offline plan cannot be made as asked (the message says which input)."""


@dataclass(frozen=True)
class OfflinePlan:
    """A workload's iteration planned on a device: each method's frontier (the baseline's
    one point), the kareus plan the budget chose, and the metrics."""

    workload: Workload
    schedule: str
    device: str
    model_version: str | None
    budget: Budget
    frontiers: dict[str, list[PipelinePoint]]
    chosen: PipelinePoint
    dag: PipelineDag
    stages: tuple[StageGraphs, ...]
    static_power_w: float  # one GPU's
    clock_switch_s: float

    @property
    def baseline(self) -> PipelinePoint:
        return self.frontiers["baseline"][0]

    def metrics(self) -> dict[str, Any]:
        """Kareus and Nanobatching + Perseus against Perseus at each of its points (iso-time
        energy, iso-energy time: the method's comparison, which its artifact measured for
        Nanobatching + Perseus), and every method's fastest plan against the baseline."""
        return {
            **{f"{m}_vs_perseus": self._against_perseus(m)
               for m in ("kareus", "nanobatch_perseus")},
            "max_throughput_vs_baseline": {
                m: dataclasses.asdict(max_throughput(self.frontiers[m], self.baseline))
                for m in METHODS if m != "baseline"
            },
        }

    def _against_perseus(self, method: str) -> dict[str, Any]:
        against = reductions(self.frontiers[method], self.frontiers["perseus"])
        return {
            "points": [dataclasses.asdict(r) for r in against],
            "energy_at_iso_time": summary([r.energy_at_iso_time for r in against]),
            "time_at_iso_energy": summary([r.time_at_iso_energy for r in against]),
        }

    def to_json(self) -> dict[str, Any]:
        """The result JSON: the workload, the device, each frontier fastest first as
        {time_s, energy_j} per iteration of one replica, the chosen plan, the metrics."""
        w = self.workload
        return {
            "workload": {
                "model": w.name, "shape": dataclasses.asdict(w.model), "tp": w.tp, "pp": w.pp,
                "microbatches": w.microbatches, "microbatch_size": w.microbatch_size,
                "seq": w.seq, "sp": w.sp, "recompute": w.recompute, "schedule": self.schedule,
                "gpus": w.tp * w.pp,
            },
            "device": self.device,
            "model_version": self.model_version,
            "modelled": "every figure is the simulated GPU's",
            "budget": dataclasses.asdict(self.budget),
            "frontiers": {m: [_cost(p) for p in points] for m, points in self.frontiers.items()},
            "chosen": {**_cost(self.chosen), "instructions": [
                {"stage": i.stage, "microbatch": i.microbatch, "kind": i.kind,
                 **_instruction(c)}
                for i, c in zip(self.dag.instructions, self.chosen.choices, strict=True)
            ]},
            "metrics": self.metrics(),
        }


REAL_DEVICES = ("auto", "nvml", "nvml-dry-run")
"""Devices a compile measures by running graphs: none can plan an offline trace."""


def check_offline_device(device: str) -> None:
    """Refuse, without opening anything, a device an offline plan cannot run on: a real GPU
    (the trace is of fake tensors), or no device at all (``check_device``)."""
    if device in REAL_DEVICES:
        raise DeviceSpecError(device, ACCEPTED_DEVICES[len(REAL_DEVICES):], (
            "kareus plan traces the model on fake tensors, which no real GPU runs: plan "
            "offline on a simulated GPU or a GPU .json; to measure a real GPU, compile the "
            "model with backend=\"kareus\" on it (device \"nvml\")"))
    check_device(device)


def plan_offline(
    workload: Workload,
    device: str,
    budget: Budget,
    *,
    schedule: str = "1f1b",
    cache_dir: str | Path | None = None,
    search: str = "grid",
    search_budget: int = 32,
    points: int = FRONTIER_POINTS,
    stages: Sequence[StageGraphs] | None = None,
    max_solve_s: float | None = None,
) -> OfflinePlan:
    """Trace and profile ``workload`` on ``device`` (``stages``: already traced), and plan
    its iteration under each method; the kareus plan is the one ``budget`` asks for (a
    ``BudgetError`` stating the range where none meets it). With pipeline parallelism each
    plan is proven optimal, or with ``max_solve_s`` the best found within that many seconds
    of the solver, its proven gap kept (``PipelinePoint.gap``)."""
    if schedule not in SCHEDULES:
        raise OfflinePlanError(
            f"schedule: got {schedule!r}; accepted: {', '.join(map(repr, SCHEDULES))}"
        )
    check_offline_device(device)
    gpu = resolve_device(device)
    dag = SCHEDULES[schedule](workload.pp, workload.microbatches)
    if stages is None:
        stages = trace_stages(workload, device, cache_dir=cache_dir, search=search,
                              search_budget=search_budget)
    model = energy_model(gpu.static_power_w, gpu.clock_switch_s, workload.tp * workload.pp)
    planned = plan_iteration(
        dag, {m: method_options(stages, m, workload.tp) for m in METHODS}, budget, model=model,
        max_power_w=(gpu.power_limit_w or 0.0) * workload.tp * workload.pp, points=points,
        max_solve_s=max_solve_s,
    )
    frontiers, chosen = planned.frontiers, planned.chosen
    return OfflinePlan(workload, schedule, gpu.identity, gpu.model_version, budget, frontiers,
                       chosen, dag, tuple(stages), gpu.static_power_w,
                       gpu.clock_switch_s)


def method_options(
    stages: Sequence[StageGraphs], method: str, tp: int
) -> dict[tuple[int, str], list[FrontierPoint]]:
    """Every (stage, kind)'s instruction options under ``method``, its energies summed over
    the stage's ``tp`` GPUs (they run the same graphs alike)."""
    options: dict[tuple[int, str], list[FrontierPoint]] = {}
    for s in stages:
        for kind, graphs in (("forward", s.forward), ("backward", s.backward)):
            options[s.stage, kind] = [
                FrontierPoint(o.time_s, tp * o.effective_energy_j, o.choice)
                for o in instruction_options(graphs, method)
            ]
            if not options[s.stage, kind]:
                raise OfflinePlanError(
                    f"stage {s.stage}'s {kind}: no clock at which every graph has a cost "
                    f"under {method}"
                )
    return options


def _cost(p: PipelinePoint) -> dict[str, float]:
    """A point of a frontier; ``gap``: 0 where proven optimal (see ``plan_offline``)."""
    return {"time_s": p.time_s, "energy_j": p.energy_j, "gap": p.gap}


def _instruction(c: InstructionChoice) -> dict[str, Any]:
    return {"clock_mhz": c.clock_mhz, "graphs": [dataclasses.asdict(g) for g in c.graphs]}


def step_plan(plan: OfflinePlan, kareus_version: str) -> tuple[Plan, str]:
    """The plan a compile of the workload loads as its ``plan`` option, and what it is.

    With pipeline parallelism, the plan of every instruction (``pipeline_plan``). Without,
    each graph at one choice for every microbatch: what the iteration is planned as then
    (``iteration.chain_frontier``), costs per GPU, as the compile-time planner's."""
    w = plan.workload
    if w.pp > 1:
        return pipeline_plan(plan, kareus_version), (
            f"a choice per instruction of the {plan.schedule} pipeline ({w.pp} stages, "
            f"{w.microbatches} microbatches): {plan.chosen.time_s * 1e3:.4g} ms, "
            f"{plan.chosen.energy_j:.4g} J per iteration of {w.tp * w.pp} GPUs")
    (stage,) = plan.stages
    # Without pipeline parallelism every microbatch runs the chosen forward and backward.
    f, b = (next(c for i, c in zip(plan.dag.instructions, plan.chosen.choices, strict=True)
                 if i.kind == kind) for kind in ("forward", "backward"))
    point, base = plan.chosen, plan.baseline
    gpus = w.tp * w.pp
    graphs = []
    for (graph, _), choice in [*zip(stage.forward, f.graphs), *zip(stage.backward, b.graphs)]:
        cost = _point(graph, choice)
        graphs.append(GraphPlan(graph.label, graph.graph_hash, choice, cost.time_s,
                                cost.effective_energy_j))

    def per_gpu(p: PipelinePoint) -> StepCost:
        return StepCost(p.time_s, p.energy_j / gpus)

    return Plan(
        graphs=tuple(graphs),
        predicted=per_gpu(point),
        baseline=per_gpu(base),
        frontier=tuple(map(per_gpu, plan.frontiers["kareus"])),
        frequency_only=tuple(map(per_gpu, plan.frontiers["perseus"])),
        budget=plan.budget,
        device=plan.device,
        model_version=plan.model_version,
        static_power_w=plan.static_power_w,
        options={"microbatches": w.microbatches, "nanobatches": 1},
        kareus_version=kareus_version,
    ), (f"each graph at one choice for all {w.microbatches} microbatches: "
        f"{point.time_s * 1e3:.4g} ms, {point.energy_j:.4g} J per iteration of {gpus} GPUs; "
        f"the plan holds costs per GPU, {point.energy_j / gpus:.4g} J")


def pipeline_plan(plan: OfflinePlan, kareus_version: str) -> Plan:
    """The chosen iteration as a pipeline's plan, the record ``planner.pipeline_step``
    makes at run time: each instruction's clock and graphs' choices, when it starts; costs
    per iteration of one replica."""
    w = plan.workload
    posted = [stage_options(
        s.stage, w.tp,
        {kind: tuple((g.label, g.graph_hash, n) for g, n in getattr(s, kind))
         for kind in ("forward", "backward")},
        {g.label: g for g, _ in (*s.forward, *s.backward)},
    ) for s in plan.stages]
    return plan_of(
        PipelineLayout(plan.schedule, w.pp, w.pp, w.microbatches), plan.dag,
        IterationPlan(plan.frontiers, plan.chosen), posted, budget=plan.budget,
        device=(plan.device, plan.model_version, plan.static_power_w),
        options={"nanobatches": 1}, kareus_version=kareus_version,
    )


def _point(graph: GraphFrontier, choice: Choice) -> FrontierPoint:
    """``graph``'s point of ``choice``: on its frontier, or the frequency-only, baseline or
    default-variant one (what the other methods' plans choose)."""
    return next(o for o in (*graph.points, *graph.frequency_only, graph.baseline,
                            *graph.nanobatched) if o.choice == choice)
