"""The plan: made from graph frontiers under a budget, written as JSON, read back, matched."""

import json
from pathlib import Path

import pytest

from kareus.devices import SimulatedGPU
from kareus.passes.decide import Choice
from kareus.planner.budget import Budget, BudgetError
from kareus.planner.compose import FrontierPoint
from kareus.planner.graph import GraphFrontier
from kareus.planner.plan import Plan, PlanError, make_plan


def _graph(label, key, points):
    frontier = tuple(FrontierPoint(t, e, Choice(k, f, parts)) for t, e, k, f, parts in points)
    single = tuple(o for o in frontier if o.choice.nanobatches == 1)
    return GraphFrontier(label, key, frontier, single, single[0])


FORWARD = _graph("r0/forward", "f" * 16, [
    (1.0, 10.0, 1, 1410, ()), (1.2, 8.0, 1, 1200, ()), (1.1, 7.0, 2, 1410, ((1, None),)),
])
BACKWARD = _graph("r0/backward", "b" * 16, [
    (2.0, 20.0, 1, 1410, ()), (2.5, 15.0, 1, 1200, ()), (2.2, 13.0, 2, 1200, ((0, 8),)),
])


@pytest.fixture
def gpu():
    return SimulatedGPU("sim:a100-sxm4-40gb")


def test_a_plan_round_trips_through_json(gpu, tmp_path):
    plan = make_plan([FORWARD, BACKWARD], Budget.parse(time_budget=1.2), gpu,
                     {"nanobatches": "auto"}, "0.1.0")
    loaded = Plan.load(plan.save(tmp_path / "plan.json"))
    assert loaded == plan and loaded.digest == plan.digest
    raw = json.loads((tmp_path / "plan.json").read_text())
    assert raw["kareus_version"] == "0.1.0" and raw["device"] == gpu.identity
    assert [g["graph_hash"] for g in raw["graphs"]] == ["f" * 16, "b" * 16]
    # least energy within 1.2 x the baseline's time; a clock switch between the graphs
    # costs what the device says
    assert plan.predicted.time_s <= 1.2 * plan.baseline.time_s
    assert {(g.choice.nanobatches, g.choice.clock_mhz) for g in plan.graphs} <= {
        (2, 1410), (2, 1200), (1, 1200), (1, 1410)}
    assert plan.predicted.energy_j == min(p.energy_j for p in plan.frontier
                                          if p.time_s <= 1.2 * plan.baseline.time_s)


def test_a_graph_is_matched_by_label_or_hash_and_refused_when_made_for_another(gpu):
    plan = make_plan([FORWARD, BACKWARD], Budget("fastest"), gpu, {}, "0.1.0")
    assert plan.match("r0/forward", "f" * 16, "forward").graph_hash == "f" * 16
    assert plan.match("r7/backward", "b" * 16, "backward").label == "r0/backward"
    assert plan.match("r0/inference", "i" * 16, "inference") is None
    with pytest.raises(PlanError, match=r"made for another graph r0/forward: its hash is f+, "
                       r"this graph \(r3/forward\)'s is x+"):
        plan.match("r3/forward", "x" * 16, "forward")


def test_a_budget_per_step_is_met_by_every_accumulated_microbatch(gpu):
    one = make_plan([FORWARD, BACKWARD], Budget("fastest"), gpu, {}, "0.1.0")
    four = make_plan([FORWARD, BACKWARD], Budget.parse(time_budget="14 s"), gpu, {}, "0.1.0",
                     microbatches=4)
    assert four.baseline.time_s == pytest.approx(4 * one.baseline.time_s)
    assert four.predicted.time_s <= 14.0  # here the fastest: static power dominates
    assert four.predicted.energy_j == pytest.approx(4 * one.predicted.energy_j)
    with pytest.raises(BudgetError, match="time budget 10 s per step"):
        make_plan([FORWARD, BACKWARD], Budget.parse(time_budget="10 s"), gpu, {}, "0.1.0",
                  microbatches=4)


def test_an_unmet_budget_states_the_range(gpu):
    with pytest.raises(BudgetError, match=r"the plans reach [\d.]+ to [\d.]+ J"):
        make_plan([FORWARD, BACKWARD], Budget.parse(energy_budget="1 mJ"), gpu, {}, "0.1.0")


@pytest.mark.parametrize("text, match", [
    ("{", "not a kareus plan"),
    ('{"schema": 99}', "plan schema 99, made by another kareus .this one reads schema 2"),
    ('{"schema": 2, "graphs": []}', "not a kareus plan"),
    ('{"schema": 2, "graphs": [{"choice": 3}]}', "not a kareus plan .TypeError"),
])
def test_a_damaged_plan_file_is_refused(tmp_path, text, match):
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(PlanError, match=match):
        Plan.load(path)
    with pytest.raises(PlanError, match="cannot read the plan"):
        Plan.load(tmp_path / "missing.json")


def test_a_plan_written_before_choices_were_one_record_is_refused_with_what_to_do():
    """data/plan-schema1.json was written by kareus 0.1.0 before a graph's choice became
    one record (schema 1: nanobatches, clock_mhz, slots and resources side by side, the
    default clock spelled as the device's first search clock)."""
    path = Path(__file__).parent / "data" / "plan-schema1.json"
    with pytest.raises(PlanError, match="plan schema 1, made by another kareus .* make a new "
                       "plan: run without the plan option"):
        Plan.load(path)
