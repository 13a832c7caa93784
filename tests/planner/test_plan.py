"""The plan: made from graph frontiers under a budget, written as JSON, read back and checked
field by field, matched, checked against the graph, the device and the options it runs with."""

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from kareus.devices import SimulatedGPU
from kareus.devices.base import StepMeasurement
from kareus.options import KareusOptionError, KareusOptions
from kareus.passes.decide import Choice
from kareus.passes.reasons import Reason, ReasonKind
from kareus.passes.variants import PartitionChoices, VariantSpace
from kareus.planner.budget import Budget, BudgetError
from kareus.planner.compose import FrontierPoint
from kareus.planner.graph import GraphFrontier
from kareus.planner.plan import Plan, PlanError, make_plan
from kareus.planner.step import StepPlanner


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
    ("{", r"^plan.json: not a kareus plan: not JSON \(Expecting property name"),
    ("[" * 100_000, "^plan.json: not a kareus plan: not JSON"),  # nested too deeply
    ("[1, 2]", r"^plan.json: not a kareus plan \(no schema field in \[1, 2\]\)$"),
    ('{"x": 1}', r"^plan.json: not a kareus plan \(no schema field in \{'x': 1\}\)$"),
    ('{"schema": 99}', "plan schema 99, made by another kareus .this one reads schemas 3 and 4"),
    ('{"schema": true}', "plan schema True, made by another kareus"),
    ('{"schema": 3, "graphs": []}', ("^plan.json: missing fields predicted, baseline, .*, "
     "kareus_version, pipeline, instructions$")),
])
def test_a_damaged_plan_file_is_refused_in_one_line(tmp_path, text, match):
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(PlanError, match=match) as info:
        Plan.from_json(text, "plan.json")
    assert "\n" not in str(info.value)
    with pytest.raises(PlanError, match=str(path)):
        Plan.load(path)
    with pytest.raises(PlanError, match="cannot read the plan"):
        Plan.load(tmp_path / "missing.json")
    with pytest.raises(PlanError, match="cannot read the plan"):
        Plan.load(f"{tmp_path}/a\0b.json")  # a NUL byte: no path


def test_a_binary_file_is_refused_in_one_line(tmp_path):
    path = tmp_path / "plan.json"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    with pytest.raises(PlanError) as info:
        Plan.load(path)
    assert str(info.value) == (f"{path}: not a kareus plan: not UTF-8 text (byte 0 is "
                               "b'\\x89'; a binary file?)")


DELETE = object()


@pytest.mark.parametrize("field, value, message", [
    (("graphs", 0, "label"), 7, "graphs[0].label: 7 is not a non-empty string"),
    (("graphs", 1, "graph_hash"), None, "graphs[1].graph_hash: None is not a non-empty string"),
    (("graphs", 1, "choice", "clock_mhz"), -5,
     "graphs[1].choice.clock_mhz: -5 is not a clock (an integer >= 0; 0: the default clocks)"),
    (("graphs", 1, "choice", "clock_mhz"), 1410.5, "graphs[1].choice.clock_mhz: 1410.5 is not"),
    (("graphs", 0, "choice", "nanobatches"), 3,
     "graphs[0].choice.nanobatches: 3 is not a nanobatch count (one of 1, 2, 4)"),
    (("graphs", 0, "choice", "nanobatches"), True, "graphs[0].choice.nanobatches: True is not"),
    (("graphs", 1, "choice", "partitions"), [[-1, None]],
     "graphs[1].choice.partitions[0][0]: -1 is not a launch slot (an integer >= 0)"),
    (("graphs", 1, "choice", "partitions"), [[0, 0]],
     "graphs[1].choice.partitions[0][1]: 0 is not a number of SMs (an integer >= 1; null: "),
    (("graphs", 1, "choice", "partitions"), [[0]],
     "graphs[1].choice.partitions[0]: [0] is not a list of 2"),
    (("graphs", 1, "choice", "partitions"), "0,8", "graphs[1].choice.partitions: '0,8' is not a"),
    (("graphs", 0, "time_s"), float("nan"), "graphs[0].time_s: nan is not a finite number >= 0"),
    (("graphs", 0, "effective_energy_j"), "1 J", "graphs[0].effective_energy_j: '1 J' is not"),
    (("graphs", 0, "extra"), 1, "graphs[0]: unknown field extra"),
    (("graphs", 0, "choice", "clock_mhz"), DELETE, "graphs[0].choice: missing field clock_mhz"),
    (("graphs",), {}, "graphs: {} is not a list"),
    (("predicted", "energy_j"), -1.0, "predicted.energy_j: -1.0 is not a finite number >= 0"),
    (("baseline", "time_s"), 0, "baseline.time_s: 0 is not a finite number > 0"),
    (("frontier", 0), 3, "frontier[0]: 3 is not a JSON object"),
    (("frequency_only", 0, "time_s"), float("inf"), "frequency_only[0].time_s: inf is not"),
    (("budget", "kind"), "speed", 'budget.kind: \'speed\' is not one of "fastest", "energy"'),
    (("budget", "fraction"), None, ("budget: {'fraction': None, 'kind': 'time', 'value': None} is "
     "not a budget (fastest: neither a value nor a fraction")),
    (("device",), None, "device: None is not a non-empty string"),
    (("model_version",), 2, "model_version: 2 is not a non-empty string or null"),
    (("static_power_w",), "90 W", "static_power_w: '90 W' is not a finite number >= 0"),
    (("options",), [], "options: [] is not a JSON object"),
    (("kareus_version",), 1, "kareus_version: 1 is not a non-empty string"),
    (("device",), DELETE, "missing field device"),
])
def test_every_field_is_checked_and_named(gpu, tmp_path, field, value, message):
    raw = json.loads(make_plan([FORWARD, BACKWARD], Budget.parse(time_budget=1.2), gpu,
                               {"nanobatches": "auto"}, "0.1.0").to_json())
    *parents, last = field
    record = raw
    for key in parents:
        record = record[key]
    if value is DELETE:
        del record[last]
    else:
        record[last] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(PlanError) as info:
        Plan.load(path)
    assert str(info.value).startswith(f"{path}: {message}")
    assert "\n" not in str(info.value)


def test_a_plan_written_before_choices_were_one_record_is_refused_with_what_to_do():
    """data/plan-schema1.json was written by kareus 0.1.0 before a graph's choice became
    one record (schema 1: nanobatches, clock_mhz, slots and resources side by side, the
    default clock spelled as the device's first search clock)."""
    path = Path(__file__).parent / "data" / "plan-schema1.json"
    with pytest.raises(PlanError, match="plan schema 1, made by another kareus .* make a new "
                       "plan: run without the plan option"):
        Plan.load(path)


SPACE = VariantSpace(  # the backward's: k = 2 with one partition of 3 slots, k = 4 infeasible
    nanobatches=(1, 2),
    infeasible={4: Reason(ReasonKind.NOT_DIVISIBLE, None, "batch 6 is not divisible by 4")},
    choices={2: (PartitionChoices(0, "p0", "all_reduce_1", "tp", 3, (None, 8, 16)),)},
)


def _with_choice(plan, choice):
    """``plan`` with its backward's choice replaced, and that entry."""
    entry = dataclasses.replace(plan.graphs[1], choice=choice)
    return dataclasses.replace(plan, graphs=(plan.graphs[0], entry)), entry


@pytest.mark.parametrize("choice, message", [
    (Choice(2, 1410, ((999, None),)), ("graphs[1] (r0/backward).choice.partitions: not a variant "
     "of this graph: partition 0: slot 999 outside 0..2; make a new plan")),
    (Choice(2, 1410, ((0, 7),)), ("graphs[1] (r0/backward).choice.partitions: not a variant of "
     "this graph: partition 0: resources 7 outside its choices (None, 8, 16)")),
    (Choice(2, 1410, ()), ("graphs[1] (r0/backward).choice.partitions: not a variant of this "
     "graph: Variant(nanobatches=2, slots=(), resources=()) has 0 slots")),
    (Choice(4, 1410, ((0, None),)), ("graphs[1] (r0/backward).choice.nanobatches: not a variant of "
     "this graph: 4 nanobatches do not apply: batch 6 is not divisible by 4")),
    (Choice(2, 5000, ((0, None),)), ("graphs[1] (r0/backward).choice.clock_mhz: sim:a100-sxm4-40gb "
     "does not support 5000 MHz (its 81 clocks run from 1410 down to 210 MHz; 0: the default "
     "clocks); make a new plan (drop the plan option)")),
    (Choice(1, 1401), ("graphs[1] (r0/backward).choice.clock_mhz: sim:a100-sxm4-40gb does not "
     "support 1401 MHz")),
])
def test_a_choice_outside_the_graph_or_the_device_names_the_plan_graph_and_field(
    gpu, choice, message
):
    plan, entry = _with_choice(make_plan([FORWARD, BACKWARD], Budget("fastest"), gpu, {}, "0.1.0"),
                               choice)
    with pytest.raises(PlanError) as info:
        plan.check_choice(entry, SPACE, gpu, "p.json")
    assert str(info.value).startswith(f"p.json: {message}")


@pytest.mark.parametrize("choice", [Choice(2, 1410, ((2, 16),)), Choice(2, 0, ((0, None),)),
                                    Choice(1, 210), Choice(1, 0, ((0, None),))])
def test_a_choice_of_the_graph_at_a_clock_of_the_device_applies(gpu, choice):
    plan, entry = _with_choice(make_plan([FORWARD, BACKWARD], Budget("fastest"), gpu, {}, "0.1.0"),
                               choice)
    plan.check_choice(entry, SPACE, gpu, "p.json")


def test_a_plan_for_another_device_or_model_version_is_refused(gpu):
    plan = make_plan([FORWARD, BACKWARD], Budget("fastest"), gpu, {}, "0.1.0")
    plan.check_device(gpu, "p.json")
    with pytest.raises(PlanError) as info:
        plan.check_device(SimulatedGPU("sim:h200"), "p.json")
    assert str(info.value) == (
        "p.json: the plan was made on sim:a100-sxm4-40gb (model sim-gpu-3 sim:a100-sxm4-40gb), "
        "this is sim:h200 (model sim-gpu-3 sim:h200); make a new plan on this device (drop the "
        "plan option)"
    )
    older = dataclasses.replace(plan, model_version="sim-gpu-1 sim:a100-sxm4-40gb")
    with pytest.raises(PlanError, match=r"made on sim:a100-sxm4-40gb \(model sim-gpu-1 "
                       r"sim:a100-sxm4-40gb\), this is sim:a100-sxm4-40gb \(model sim-gpu-3 "):
        older.check_device(gpu, "p.json")


def test_the_step_planner_refuses_a_plan_for_another_device(gpu, tmp_path):
    plan = make_plan([FORWARD, BACKWARD], Budget("fastest"), gpu, {}, "0.1.0")
    with pytest.raises(PlanError, match="p.json: the plan was made on sim:a100-sxm4-40gb .*, "
                       "this is sim:h200"):
        StepPlanner({"plan": "p.json"}, {}, Budget("fastest"), SimulatedGPU("sim:h200"), "0.1.0",
                    tmp_path, counts=None, timeout_s=1.0, given=plan)


def test_the_step_planner_refuses_a_given_choice_outside_the_graph(gpu, tmp_path):
    plan, _ = _with_choice(make_plan([FORWARD, BACKWARD], Budget("fastest"), gpu, {}, "0.1.0"),
                           Choice(2, 1410, ((999, None),)))
    planner = StepPlanner({"plan": "p.json"}, {}, Budget("fastest"), gpu, "0.1.0", tmp_path,
                          counts=None, timeout_s=1.0, given=plan)
    backward = SimpleNamespace(label="r0/backward", key="b" * 16, kind="backward", space=SPACE)
    with pytest.raises(PlanError, match=r"^p.json: graphs\[1\] \(r0/backward\).choice.partitions:"
                       " not a variant of this graph: partition 0: slot 999 outside 0..2"):
        planner.given_choice(backward)
    forward = SimpleNamespace(label="r0/forward", key="f" * 16, kind="forward", space=SPACE)
    assert planner.given_choice(forward) == (plan.graphs[0].choice, "choice from the plan p.json")
    other = SimpleNamespace(label="r0/forward", key="x" * 16, kind="forward", space=SPACE)
    with pytest.raises(PlanError, match="^p.json: the plan was made for another graph r0/forward"):
        planner.given_choice(other)


def test_options_a_given_plan_contradicts_are_refused(gpu, tmp_path):
    path = make_plan([FORWARD, BACKWARD], Budget("fastest"), gpu, {"microbatches": 4},
                     "0.1.0", microbatches=4).save(tmp_path / "p.json")
    plan = Plan.load(path)
    KareusOptions(plan=str(path), microbatches=4).check_plan(plan)
    with pytest.raises(KareusOptionError) as info:
        KareusOptions(plan=str(path)).check_plan(plan)
    assert str(info.value) == (
        f"kareus options: microbatches=1 and plan={str(path)!r}, made with microbatches=4, "
        "contradict: its step costs count 4 passes a step; give microbatches=4, or make a new "
        "plan"
    )


MEASURED = StepMeasurement(first_step=2, steps=5, time_s=0.9, gpu_energy_j=((0, 70.0), (1, 75.5)),
                           rank=1, world_size=2, method="nvml-energy-counter")


def test_a_measured_plan_round_trips_and_a_schema_3_plan_is_one_measured_nothing(gpu, tmp_path):
    plan = make_plan([FORWARD, BACKWARD], Budget("fastest"), gpu, {}, "0.1.0")
    measured = dataclasses.replace(plan, measured=MEASURED)
    assert measured.digest == plan.digest  # what the ranks agree on leaves it out
    loaded = Plan.load(measured.save(tmp_path / "measured.json"))
    assert loaded == measured and loaded.measured.energy_j == 75.5
    assert loaded.measured.total_energy_j == 145.5
    raw = json.loads(plan.to_json())
    assert raw["schema"] == 4 and raw["measured"] is None and raw["option_sources"] == {}
    del raw["measured"], raw["option_sources"]
    raw["schema"] = 3  # as kareus wrote plans before steps were measured
    old = Plan.from_json(json.dumps(raw), "old.json")
    assert old == plan and old.measured is None
    raw["measured"] = None  # schema 3 has no such field
    with pytest.raises(PlanError, match="^old.json: unknown field measured$"):
        Plan.from_json(json.dumps(raw), "old.json")


@pytest.mark.parametrize("field, value, message", [
    ("rank", 2, (r"measured.gpu_energy_j: \[0, 1\] are not distinct ranks below world_size 2 "
                 "that include rank 2")),
    ("gpu_energy_j", [[0, 1.0], [0, 2.0]], "measured.gpu_energy_j: .* are not distinct"),
    ("gpu_energy_j", [[1, -1.0]], r"measured.gpu_energy_j\[0\]\[1\]: -1.0 is not a finite"),
    ("steps", 0, "measured.steps: 0 is not an integer >= 1"),
    ("method", "", "measured.method: '' is not a non-empty string"),
])
def test_a_damaged_measurement_is_refused_naming_its_field(gpu, field, value, message):
    raw = json.loads(dataclasses.replace(
        make_plan([FORWARD], Budget("fastest"), gpu, {}, "0.1.0"), measured=MEASURED).to_json())
    raw["measured"][field] = value
    with pytest.raises(PlanError, match=f"^plan.json: {message}"):
        Plan.from_json(json.dumps(raw), "plan.json")


def test_a_plan_whose_gpu_drew_less_than_the_static_power_loads_back(gpu, tmp_path):
    """A measured graph's energy above static is negative where the GPU drew less than the
    static power assumed for it; the plan made on it must load back, not be refused."""
    plan = make_plan([FORWARD, BACKWARD], Budget.parse(time_budget=1.2), gpu,
                     {"nanobatches": "auto"}, "0.1.0")
    raw = json.loads(plan.to_json())
    raw["graphs"][0]["effective_energy_j"] = -0.25
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(raw))
    assert Plan.load(path).graphs[0].effective_energy_j == -0.25
