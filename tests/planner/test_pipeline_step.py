"""A pipeline's plan at run time: what a stage posts, the plan every rank makes from the
posts, a stored plan's reuse, and the store exchange's deadline."""

import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from kareus.passes.decide import Choice
from kareus.planner.budget import Budget
from kareus.planner.compose import FrontierPoint
from kareus.planner.graph import GraphFrontier
from kareus.planner.pipeline_step import (
    PipelineNotPlanned,
    StageOptions,
    make_pipeline_plan,
    per_stage,
    runs_stored,
    stage_options,
)
from kareus.planner.plan import Plan
from kareus.runtime.agreement import gather
from kareus.runtime.pipelining import PipelineShape

SHAPE = PipelineShape("1f1b", 2, 2, 4, (0,))
DEVICE = SimpleNamespace(static_power_w=50.0, clock_switch_s=1e-6, power_limit_w=400.0,
                         identity="sim:test", model_version="test-1")


def _frontier(label, time_s, energy_j):
    """A graph at the default clock, and at 900 MHz 1.5x slower for 0.6x the energy."""
    fast = FrontierPoint(time_s, energy_j, Choice(1, 0))
    slow = FrontierPoint(1.5 * time_s, 0.6 * energy_j, Choice(1, 900))
    return GraphFrontier(label, label + "-hash", (fast, slow), (fast, slow), fast)


FRONTIERS = {f"s{s}/r0/{k}": _frontier(f"s{s}/r0/{k}", t, 10 * t)
             for s in range(2) for k, t in (("forward", 1.0), ("backward", 2.0))}


def _posts():
    return [stage_options(s, 2, {k: ((f"s{s}/r0/{k}", f"s{s}/r0/{k}-hash", 1),)
                                 for k in ("forward", "backward")}, FRONTIERS)
            for s in range(2)]


def test_what_a_stage_posts_reads_back_the_same():
    for post in _posts():
        assert StageOptions.from_json(post.to_json()) == post
        assert post.gpus == 2  # energies are its GPUs' sum
        assert [o.effective_energy_j for o in post.options["forward"]["perseus"]] == [20.0, 12.0]


def test_a_stage_running_a_graph_without_a_frontier_cannot_be_planned():
    with pytest.raises(PipelineNotPlanned, match="stage 0's forward runs graphs kareus could "
                       r"not plan \(s0/r1/forward\)"):
        stage_options(0, 1, {"forward": (("s0/r1/forward", "h", 1),)}, FRONTIERS)


def test_every_rank_makes_the_same_plan_of_every_instruction():
    plans = [make_pipeline_plan(SHAPE, _posts(), Budget("time", fraction=1.0), DEVICE, {}, "v")
             for _ in range(2)]
    assert plans[0] == plans[1] and plans[0].digest == plans[1].digest
    plan = plans[0]
    assert len(plan.instructions) == 16 and plan.pipeline.microbatches == 4
    assert plan.predicted.time_s <= plan.baseline.time_s
    assert plan.predicted.energy_j < plan.baseline.energy_j
    slowed = [i for i in plan.instructions if i.clock_mhz == 900]
    assert slowed and all(i.graphs[0].choice.clock_mhz == 900 for i in slowed)
    assert Plan.from_json(plan.to_json()) == plan
    # the first forward and the last backward of stage 0 bound the iteration
    first, last = plan.instruction(0, 0, "forward"), plan.instruction(0, 3, "backward")
    assert first.start_s == 0.0 and first.clock_mhz == 0
    assert last.start_s + last.time_s == pytest.approx(plan.predicted.time_s)


def test_a_stored_plan_serves_only_the_same_pipeline_and_graphs():
    plan = make_pipeline_plan(SHAPE, _posts(), Budget("fastest"), DEVICE, {}, "v")
    ran = {(0, k): ((f"s0/r0/{k}", f"s0/r0/{k}-hash", 1),) for k in ("forward", "backward")}
    assert runs_stored(plan, SHAPE, ran)
    assert not runs_stored(plan, PipelineShape("gpipe", 2, 2, 4, (0,)), ran)
    assert not runs_stored(plan, SHAPE, {**ran, (0, "forward"): (("x", "other-hash", 1),)})
    assert not runs_stored(None, SHAPE, ran)


def test_gather_reads_every_post_and_names_those_missing_at_its_deadline():
    store = dist.HashStore()
    assert gather("p", {"stage0": "a"}, ["stage0"], timeout_s=0, what="x",
                  store=store).values == {"stage0": "a"}
    assert gather("p", {"stage0": "b"}, ["stage0"], timeout_s=0, what="x",
                  store=store).values == {"stage0": "a"}  # the first post wins
    start = time.monotonic()
    missing = gather("p", {}, ["stage0", "stage1"], timeout_s=0.3, what="x", store=store)
    assert missing.missing == ("stage1",) and 0.3 <= time.monotonic() - start < 2


def test_planning_the_pipeline_as_one_beats_each_stage_planning_alone():
    budget = Budget("time", fraction=1.0)
    plan = make_pipeline_plan(SHAPE, _posts(), budget, DEVICE, {}, "v")
    alone = per_stage(SHAPE, _posts(), budget, DEVICE)
    assert alone.time_s <= plan.baseline.time_s * (1 + 1e-9)  # each stage met its budget
    assert plan.predicted.time_s <= plan.baseline.time_s * (1 + 1e-9)
    assert plan.predicted.energy_j < alone.energy_j  # slack used, which no stage alone sees
